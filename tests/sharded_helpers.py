"""Models and probes for the sharded-gradient tests (DeepSpeed ZeRO 1/2/3, FSDP2), shared by the worker and the demo.

The fault is planted in rank 1's *local* gradient contribution, before any reduction: a hook on the activation of
the first layer makes one feature's gradient NaN on rank 1 only. The reduction (all-reduce, reduce-scatter) then
carries the NaN into exactly the gradient elements of that feature, ``stem.weight[3, :]`` and ``stem.bias[3]``. The
parameters are registered so that these elements sit in rank 1's partition under every sharding tested:

- ZeRO-1/2 partition the flat buffer of all parameters in registration order; ``stem`` is registered last, so it
  lies in the second half (rank 1) and ``out``/``mid`` fill the first.
- ZeRO-3 and FSDP2 shard every parameter along its first dimension; row 3 of ``stem.weight`` (4 rows) and element 3
  of ``stem.bias`` (4 elements) are in rank 1's half.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import ledger_state, tree_digest

FAULT_FEATURE = 3
FAULT_PARAMETERS = ["stem.weight", "stem.bias"]
# The state a boundary right after an applied NaN step would have written, as the state check names it: under
# DeepSpeed ZeRO-1/2 rank 1's fp32 master partition (which holds `stem`) and the parameters gathered from it, on both
# ranks; under FSDP2 only rank 1's shards of `stem`.
APPLIED_NAN_STATE = {
    "deepspeed": [[0, "parameter stem.weight"], [0, "parameter stem.bias"], [1, "parameter stem.weight"],
                  [1, "parameter stem.bias"], [1, "optimizer: fp32 master partition of group 0"]],
    "fsdp2": [[1, "parameter stem.weight"], [1, "parameter stem.bias"]],
}


def _nan_feature(grad: Tensor) -> Tensor:
    grad = grad.clone()
    grad[..., FAULT_FEATURE] = float("nan")
    return grad


class ShardedFaultModel(BoringModel):
    """``stem -> tanh -> mid -> tanh -> out``; at ``fault_steps`` on ``fault_ranks`` the stem activation's gradient
    gets a NaN feature (see the module docstring). ``fsdp2=True`` shards it with ``fully_shard`` in
    ``configure_model`` (for ``ModelParallelStrategy``).

    ``val_losses[epoch]`` is logged as ``val_loss``. At ``snapshot_steps`` and fault steps, before the step runs, the
    checkpoint directory and callback state are snapshotted; at every batch start the latest verdict is kept.
    """

    def __init__(
        self,
        fault_steps: Iterable[int] = (),
        fault_ranks: Iterable[int] = (1,),
        snapshot_steps: Iterable[int] = (),
        val_losses: list[float] | None = None,
        fsdp2: bool = False,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        del self.layer
        # registration order = ZeRO-1/2 flat-buffer order: `stem` last, in rank 1's partition
        self.out = nn.Linear(64, 2)
        self.mid = nn.Linear(4, 64)
        self.stem = nn.Linear(32, 4)
        self.fault_steps = set(fault_steps)
        self.fault_ranks = set(fault_ranks)
        self.snapshot_steps = set(snapshot_steps) | self.fault_steps
        self.val_losses = val_losses
        self.fsdp2 = fsdp2
        self.lr = lr
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.verdicts: dict[int, dict[str, Any]] = {}
        self.collections: Counter = Counter()  # checkpoint collection calls on the strategy (see count_collections)

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.stem, self.mid, self.out):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        if (
            self.training
            and h.requires_grad
            and self.trainer.global_step in self.fault_steps
            and self.global_rank in self.fault_ranks
        ):
            h.register_hook(_nan_feature)
        return self.out(torch.tanh(self.mid(torch.tanh(h))))

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        loss = out["x"] if self.val_losses is None else torch.tensor(float(self.val_losses[self.current_epoch]))
        self.log("val_loss", loss, sync_dist=self.val_losses is None)
        return out

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        callback = next(c for c in self.trainer.callbacks if isinstance(c, ModelCheckpoint))
        verdict = getattr(callback, "last_verdict", None)
        if verdict is not None:
            self.verdicts[verdict.global_step] = verdict_fields(verdict)
        if step in self.snapshot_steps and step not in self.snapshots:
            self.snapshots[step] = {
                # rank 0 owns the files; another rank could race its evictions (directories take a while to remove)
                "tree": tree_digest(callback.dirpath) if self.global_rank == 0 else None,
                "state": ledger_state(callback),
                "collections": dict(self.collections),
            }

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


COLLECTION_METHODS = ("lightning_module_state_dict", "optimizer_state", "save_checkpoint")


def count_collections(strategy: Any, counts: Counter) -> None:
    """Count calls into the strategy's checkpoint collection: gathering module and optimizer state (ZeRO-3 and FSDP
    collectives) and writing (``engine.save_checkpoint`` under DeepSpeed)."""
    for name in COLLECTION_METHODS:
        original = getattr(strategy, name)

        def counted(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(strategy, name, counted)


def verdict_fields(verdict: Any) -> dict[str, Any]:
    """A verdict as plain values, with what each rank it names reported (how many of its parameters were
    non-finite; a rejection names the offending ranks only)."""
    return {
        "accepted": verdict.accepted,
        "global_step": verdict.global_step,
        "ranks": list(verdict.ranks),
        "skipped_steps": verdict.skipped_steps,
        "parameters": list(verdict.parameters),
        "non_finite_parameters_by_named_rank": {str(r.rank): r.num_parameters for r in verdict.reports},
    }


def weights_finite(module: nn.Module) -> bool:
    """Whether this rank's (local shard of the) weights is finite. Local: reads DTensor shards, no collective."""
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        ds_tensor = getattr(param, "ds_tensor", None)  # ZeRO-3 keeps the real values in the partition
        local = ds_tensor if ds_tensor is not None else local
        if local.numel() and not bool(torch.isfinite(local.detach().float()).all()):
            return False
    return True


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
HOST_READS = ("_local_scalar_dense", "is_nonzero", "equal")


class _Recorder(TorchDispatchMode):
    def __init__(self, sink: Counter) -> None:
        super().__init__()
        self.sink = sink
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.paused:
            namespace = func.namespace if hasattr(func, "namespace") else ""
            name = func.__name__.split(".")[0]
            if namespace in COLLECTIVE_NAMESPACES:
                self.sink[f"{namespace}.{name}"] += 1
            elif name in HOST_READS:
                self.sink[f"host:{name}"] += 1
        return func(*args, **(kwargs or {}))


class StepCollectives(Callback):
    """Counts collectives (``c10d`` ops, whatever Python API issued them) and host reads per training batch: from
    ``on_train_batch_start`` to the end of the checkpoint callback's ``on_train_batch_end``, leaving out its boundary.

    For ``FiniteGradCheckpoint`` only the boundary itself (``_boundary``) is left out, so its per-step work (settling
    DeepSpeed's skip outcome) is counted; for ``ModelCheckpoint`` its whole ``on_train_batch_end`` is the boundary.
    ``per_batch[i]`` is a ``Counter`` of op names for batch ``i``. Use it without validation batches.
    """

    def __init__(self) -> None:
        self.per_batch: list[Counter] = []
        self._mode: _Recorder | None = None

    def attach(self, checkpoint: ModelCheckpoint) -> None:
        batch_end = checkpoint.on_train_batch_end
        guarded = hasattr(checkpoint, "_boundary")
        if guarded:
            boundary = checkpoint._boundary

            def paused_boundary(*args: Any, **kwargs: Any) -> Any:
                mode = self._mode
                if mode is not None:
                    mode.paused = True
                try:
                    return boundary(*args, **kwargs)
                finally:
                    if mode is not None:
                        mode.paused = False

            checkpoint._boundary = paused_boundary  # type: ignore[method-assign]

        def counted_batch_end(*args: Any, **kwargs: Any) -> Any:
            if not guarded:
                self._close()
            try:
                return batch_end(*args, **kwargs)
            finally:
                self._close()

        checkpoint.on_train_batch_end = counted_batch_end  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._close()
        self.per_batch.append(Counter())
        self._mode = _Recorder(self.per_batch[-1])
        self._mode.__enter__()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)


__all__ = [
    "FAULT_PARAMETERS",
    "ShardedFaultModel",
    "StepCollectives",
    "count_collections",
    "verdict_fields",
    "weights_finite",
]
