"""DeepSpeed gradient source: the local gradient partition each rank's ZeRO optimizer is about to apply.

Under DeepSpeed, ``param.grad`` is ``None`` at the optimizer step: gradients live in the optimizer's partitions. At
the gradient accumulation boundary, after DeepSpeed reduced them and before ``engine.step()``, each rank holds:

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``averaged_gradients[group]``, this rank's partition as per-parameter
  slices in ``params_in_partition[group]`` order (padding slices are zeros); with CPU offload, the flat fp32
  partition's ``.grad``, sliced per parameter by its ``_hp_mapping`` address.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): one partition per parameter in the optimizer's flat gradient buffer.
- bf16 with ZeRO-1 and fp32 gradient accumulation (``BF16_Optimizer``): this rank's flat partition of the reduced
  fp32 gradients, sliced per parameter by its ``_hp_mapping`` address.
- ZeRO-0 (no partitioning, plain or fp16 optimizer wrappers): ``param.grad``.

Everything read here is a reference to a tensor DeepSpeed already holds: no collective, no host sync.
``deepspeed.utils.safe_get_full_grad`` and the optimizers' ``has_overflow`` are collectives and are never called.

DeepSpeed may skip a step whose gradients were not finite (fp16 loss scaling, bf16 with ``check_grad_overflow``, and
ZeRO-3 or fp32 ZeRO-1/2 whenever the global gradient norm is not finite). It decides inside ``engine.step()`` from an
all-reduced value, so the outcome is the same on every rank and is only known after the step:
:meth:`DeepSpeedGradients.skipped_last_step` reads ``engine.was_step_applied()``, a Python bool DeepSpeed already has.

DeepSpeed itself is never imported here; the engine and its optimizer are read by attribute.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_ckguard.record.sources import ZERO3_GRAD_PARTITIONS, ParameterGradients, ParameterIndex


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``deepspeed.DeepSpeedEngine`` (checked by attribute, without importing it)."""
    return all(
        callable(getattr(obj, name, None))
        for name in ("is_gradient_accumulation_boundary", "was_step_applied", "zero_optimization_stage")
    )


class DeepSpeedGradients:
    """Reads each rank's local gradient partition from a DeepSpeed engine's optimizer.

    Args:
        engine: The ``deepspeed.DeepSpeedEngine`` (in Lightning, ``trainer.strategy.model`` after setup).
        module: The module whose ``named_parameters()`` name the parameters (the LightningModule); defaults to
            ``engine.module``.

    :meth:`local_gradients` returns ``None`` for micro-batches inside gradient accumulation: only the accumulation
    boundary is an optimizer step. Parameter attribution is local: each rank names the parameters whose slices in
    its own partition are not finite.
    """

    defers_skip_outcome = True
    #: Whether the last gradients read are this rank's partition (ZeRO-1/2/3), not the whole all-reduced gradients
    #: every rank holds (ZeRO-0): how a spike gate adds up their squares over the ranks.
    shards_gradients = False

    def __init__(self, engine: Any, module: nn.Module | None = None) -> None:
        self.engine = engine
        module = module if module is not None else engine.module
        self._parameters = ParameterIndex(module)
        self._fallback = ParameterGradients(module, self._parameters)  # ZeRO-0: same indices and names
        self._group_indices: dict[tuple[str, int], int] = {}

    @property
    def parameter_names(self) -> list[str]:
        return self._parameters.names

    def _group_index(self, kind: str, group: int) -> int:
        """An index for a whole partition whose slices cannot be attributed to parameters."""
        key = (kind, group)
        index = self._group_indices.get(key)
        if index is None:
            name = f"<{kind} partition of parameter group {group}>"
            index = self._group_indices[key] = self._parameters.add_name(name)
        return index

    # ------------------------------------------------------------------ the protocol

    def local_gradients(self, optimizer: Any | None = None) -> tuple[tuple[int, ...], list[Tensor]] | None:
        """This rank's gradient partition at the accumulation boundary, ``None`` between boundaries.

        ``optimizer`` is ignored: DeepSpeed steps one optimizer, ``engine.optimizer``.
        """
        if not self.engine.is_gradient_accumulation_boundary():
            return None
        ds_optimizer = getattr(self.engine, "optimizer", None)
        pairs: list[tuple[int, Tensor]]
        if hasattr(ds_optimizer, ZERO3_GRAD_PARTITIONS):
            pairs = self._stage3(ds_optimizer)
        elif hasattr(ds_optimizer, "averaged_gradients") and hasattr(ds_optimizer, "params_in_partition"):
            pairs = self._stage1_and_2(ds_optimizer)
        elif hasattr(ds_optimizer, "fp32_groups_gradients") and hasattr(ds_optimizer, "bf16_groups"):
            pairs = self._bf16_optimizer(ds_optimizer)
        else:  # ZeRO-0: the gradients DeepSpeed all-reduced are in param.grad
            self.shards_gradients = False
            return self._fallback.local_gradients(None)
        self.shards_gradients = True
        return tuple(i for i, _ in pairs), [g for _, g in pairs]

    def gradient_scale(self) -> float | Tensor:
        """What the gradients read are still multiplied by: DeepSpeed's fp16 loss scale (its optimizer divides it out
        inside its step, after the guard read them), 1.0 in bf16 and fp32. A number DeepSpeed keeps on the host (or a
        device tensor, for a custom scale): reading it is no sync."""
        scale = getattr(getattr(self.engine, "optimizer", None), "loss_scale", None)
        return 1.0 if scale is None else scale

    def skipped_last_step(self) -> bool:
        """Whether DeepSpeed skipped the step that just ran (non-finite gradients: nothing was applied).

        ``was_step_applied()`` is a Python bool DeepSpeed set from its own, already host-synced, overflow decision.
        """
        return not self.engine.was_step_applied()

    # ------------------------------------------------------------------ per optimizer

    def _stage1_and_2(self, opt: Any) -> list[tuple[int, Tensor]]:
        pairs: list[tuple[int, Tensor]] = []
        if getattr(opt, "cpu_offload", False):
            for group, params in enumerate(opt.params_in_partition):
                flat = opt.single_partition_of_fp32_groups[group].grad
                if flat is not None:
                    pairs.extend(self._slices_of_flat_partition(flat, params, group))
            return pairs
        for group, params in enumerate(opt.params_in_partition):
            slices = opt.averaged_gradients.get(group)
            if slices is None:
                continue
            # padding slices are zeros: DeepSpeed marks the ones it inserts between parameters, and a trailing one
            # may be unmarked; the first len(params) unmarked slices are the parameters' own, in order
            real = [s for s in slices if not getattr(s, "_zero_padding", False)]
            if len(real) >= len(params):
                pairs.extend((self._parameters.add(p), s) for p, s in zip(params, real, strict=False))
            else:  # a layout this version does not know: check the whole partition, unattributed
                pairs.extend((self._group_index("ZeRO", group), s) for s in slices)
        return pairs

    def _stage3(self, opt: Any) -> list[tuple[int, Tensor]]:
        partitions = getattr(opt, ZERO3_GRAD_PARTITIONS)
        pairs: list[tuple[int, Tensor]] = []
        for group in opt.fp16_groups:
            for param in group:
                grad = partitions.get(getattr(param, "ds_id", None))
                if grad is not None and param.requires_grad:
                    pairs.append((self._parameters.add(param), grad))
        return pairs

    def _bf16_optimizer(self, opt: Any) -> list[tuple[int, Tensor]]:
        # the fp32 gradients are all-reduced whole; each rank applies its flat partition of them
        pairs: list[tuple[int, Tensor]] = []
        for group, params in enumerate(opt.bf16_groups):
            pairs.extend(self._slices_of_flat_partition(opt.fp32_groups_gradient_flat_partition[group], params, group))
        return pairs

    def _slices_of_flat_partition(self, flat: Tensor, params: list[Any], group: int) -> list[tuple[int, Tensor]]:
        """Per-parameter slices of a flat partition, by each parameter's ``_hp_mapping`` address in it."""
        pairs: list[tuple[int, Tensor]] = []
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue  # no element of this parameter is in this rank's partition
            address = mapping.get_hp_fragment_address()
            pairs.append((self._parameters.add(param), flat.narrow(0, address.start, address.numel)))
        if not pairs and flat.numel():
            pairs.append((self._group_index("ZeRO", group), flat))  # no mapping at all: check it unattributed
        return pairs


__all__ = ["DeepSpeedGradients", "is_deepspeed_engine"]
