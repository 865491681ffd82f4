"""State sources: the local tensors each rank is about to write into a checkpoint, each with a name for a person.

The gradient sources (:mod:`lightning_ckguard.record.sources`) say which steps went wrong; these say whether what is
about to
be published is finite. They reach what no gradient passes through: buffers (BatchNorm running statistics), optimizer
state an optimizer computed from finite gradients (Adam's ``0/0`` with ``eps=0``), fp32 master copies, averaged
weights, a bit flip in memory.

Every tensor is this rank's own part, read where the strategy keeps it, with no collective:

- parameters: the local tensor (a DTensor's shard under FSDP2; DeepSpeed ZeRO-3's ``ds_tensor`` partition);
- buffers: the persistent floating-point ones, which the checkpoint holds (integer and boolean buffers, like
  BatchNorm's ``num_batches_tracked``, cannot be non-finite; non-persistent ones are not written). A buffer that
  already holds non-finite values when the guard starts (an attention mask filled with ``-inf``) is a constant of the
  model, not a sign of divergence: :func:`constant_buffers` finds those once, and they are left out;
- optimizer state: every floating-point tensor of ``optimizer.state`` but the ``step`` counters, also inside lists,
  tuples and mappings (``torch.optim.LBFGS``'s history: ``"optimizer: old_dirs[3] of weight"``), for the local shard
  of a ``ZeroRedundancyOptimizer``; for DeepSpeed's ZeRO optimizers the fp32 master partition of each group and the
  state of the optimizer that steps it;
- averaged weights of Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging``).

:func:`named_state` walks what a Fabric user saves (a dict of modules, optimizers and tensors);
:func:`lightning_checkpoint_state` finds the same for a Trainer. Nothing here imports Lightning or DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ckguard.record.sources import _local_tensor, unwrap_module

#: A named local state tensor: ``("buffer bn.running_var", tensor)``.
NamedTensor = tuple[str, Tensor]
#: Per module (by ``id``), the names of its buffers that are non-finite by design (see :func:`constant_buffers`).
ConstantBuffers = Mapping[int, frozenset[str]]

# keys of optimizer state that count steps rather than hold values of the model
_STEP_COUNTERS = frozenset({"step"})


def _local(tensor: Tensor) -> Tensor:
    """This rank's own values of ``tensor``: a DTensor's local shard, DeepSpeed ZeRO-3's partition, else itself."""
    partition = getattr(tensor, "ds_tensor", None)  # ZeRO-3: `tensor.data` is empty outside a forward
    if isinstance(partition, Tensor):
        return partition
    return _local_tensor(tensor)


def _checkable(tensor: Any) -> bool:
    # complex tensors too: NonFiniteCheck reads their real and imaginary parts
    return isinstance(tensor, Tensor) and (tensor.is_floating_point() or tensor.is_complex())


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``module``'s buffers that its ``state_dict`` holds, by qualified name (each shared one once)."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, buffer in owner._buffers.items():
            if buffer is None or name in owner._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield (f"{prefix}.{name}" if prefix else name), buffer


def constant_buffers(module: nn.Module) -> frozenset[str]:
    """Names of ``module``'s floating-point buffers that hold non-finite values now (an attention mask filled with
    ``-inf``): taken when the guard starts, they are constants of the model and left out of the state check. One host
    read per buffer, once."""
    return frozenset(
        name for name, buffer in _persistent_buffers(module)
        if _checkable(buffer) and buffer.numel() and not bool(buffer.isfinite().all())
    )


def module_state(module: nn.Module, label: str = "", constants: ConstantBuffers | None = None) -> Iterator[NamedTensor]:
    """``module``'s parameters and persistent floating-point buffers, as ``"parameter <name>"`` and
    ``"buffer <name>"``; the buffers ``constants`` lists for ``module`` are left out."""
    prefix = f"{label}: " if label else ""
    skipped = (constants or {}).get(id(module), frozenset())
    for name, param in module.named_parameters():
        local = _local(param)
        if _checkable(local):
            yield f"{prefix}parameter {name}", local.detach()
    for name, buffer in _persistent_buffers(module):
        local = _local(buffer)
        if _checkable(local) and name not in skipped:
            yield f"{prefix}buffer {name}", local


def _deepspeed_master_partitions(optimizer: Any) -> list[Tensor] | None:
    """The fp32 master partitions of a DeepSpeed ZeRO optimizer (one flat tensor per group), or None."""
    for attribute in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        partitions = getattr(optimizer, attribute, None)
        if isinstance(partitions, list) and all(isinstance(p, Tensor) for p in partitions):
            return partitions
    return None


def _state_tensors(value: Any, path: str = "") -> Iterator[NamedTensor]:
    """The checkable tensors of one parameter's optimizer state, by their path in it: ``exp_avg``, and inside lists,
    tuples and mappings (``torch.optim.LBFGS`` keeps its history as lists: ``old_dirs[3]``); step counters left out at
    any depth, and counts (LBFGS's ``n_iter``). A Python float kept there (LBFGS's ``prev_loss``) is written as it is,
    so it is checked on the host: only a non-finite one becomes a tensor, for the check to name."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key not in _STEP_COUNTERS:
                yield from _state_tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _state_tensors(item, f"{path}[{index}]")
    elif isinstance(value, Tensor):
        local = _local(value)
        if _checkable(local):
            yield path, local
    elif isinstance(value, float) and not math.isfinite(value):
        yield path, torch.tensor(value, dtype=torch.float64)


def optimizer_state(
    optimizer: Any, parameter_names: Mapping[int, str], label: str = "optimizer"
) -> Iterator[NamedTensor]:
    """The floating-point state of ``optimizer`` this rank holds, named after the parameters it belongs to.

    ``parameter_names`` maps ``id(param)`` to the parameter's name. A ``ZeroRedundancyOptimizer`` contributes its local
    shard's state; a DeepSpeed ZeRO optimizer its fp32 master partitions and the state stepping them.
    """
    names = dict(parameter_names)
    masters = _deepspeed_master_partitions(optimizer)
    if masters is not None:
        for group, partition in enumerate(masters):
            name = f"fp32 master partition of group {group}"
            names[id(partition)] = f"the {name}"
            if _checkable(partition):
                yield f"{label}: {name}", partition.detach()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer stepping the partitions
    elif callable(getattr(optimizer, "consolidate_state_dict", None)) and hasattr(optimizer, "optim"):
        optimizer = optimizer.optim  # ZeroRedundancyOptimizer: the local optimizer over this rank's shard
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return
    for group_index, group in enumerate(getattr(optimizer, "param_groups", ())):
        for position, param in enumerate(group.get("params", ())):
            entries = state.get(param)
            if not isinstance(entries, Mapping):
                continue
            owner = names.get(id(param), f"parameter {position} of group {group_index}")
            for path, local in _state_tensors(entries):
                yield f"{label}: {path} of {owner}", local


def _parameter_names(module: nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in module.named_parameters()}


def averaged_weights(callback: Any) -> nn.Module | None:
    """The averaged model of a Lightning ``WeightAveraging`` callback (``EMAWeightAveraging``), if it has one yet."""
    model = getattr(callback, "_average_model", None)
    return model if isinstance(model, nn.Module) else None


@dataclass(frozen=True)
class CheckpointState:
    """What one rank writes into a checkpoint: its module, optimizers and averaged copies.

    Args:
        module: The model (its parameters and buffers are checked).
        optimizers: Its optimizers (their state is checked, named after ``module``'s parameters).
        averaged: Averaged copies of the model, by a label for messages (e.g. ``"EMAWeightAveraging"``).
    """

    module: nn.Module | None = None
    optimizers: tuple[Any, ...] = ()
    averaged: tuple[tuple[str, nn.Module], ...] = ()

    def named_tensors(self, constants: ConstantBuffers | None = None) -> Iterator[NamedTensor]:
        """Every local state tensor, named, in a fixed order (``constants``: buffers to leave out, per module)."""
        names: dict[int, str] = {}
        if self.module is not None:
            names = _parameter_names(self.module)
            yield from module_state(self.module, constants=constants)
        for index, optimizer in enumerate(self.optimizers):
            label = "optimizer" if len(self.optimizers) == 1 else f"optimizer {index}"
            yield from optimizer_state(optimizer, names, label)
        for label, model in self.averaged:
            yield from module_state(model, f"averaged weights ({label})", constants)


def lightning_checkpoint_state(trainer: Any) -> CheckpointState:
    """The local state ``trainer.save_checkpoint`` writes on this rank: the LightningModule, the optimizers (under
    DeepSpeed, the engine's ZeRO optimizer) and the averaged models of ``WeightAveraging`` callbacks."""
    engine_optimizer = getattr(getattr(trainer.strategy, "model", None), "optimizer", None)
    optimizers = tuple(trainer.optimizers)
    if _deepspeed_master_partitions(engine_optimizer) is not None:
        optimizers = (engine_optimizer,)
    averaged = tuple(
        (type(callback).__name__, model)
        for callback in trainer.callbacks
        if (model := averaged_weights(callback)) is not None
    )
    return CheckpointState(trainer.lightning_module, optimizers, averaged)


def named_state(state: Any, label: str = "", constants: ConstantBuffers | None = None) -> Iterator[NamedTensor]:
    """Walk what a caller saves (``fabric.save(path, state)``): mappings and sequences of modules, optimizers and
    tensors, or a :class:`CheckpointState`. Optimizer state is named after the parameters of the modules found in the
    same ``state``; names start with their key path (``"model: parameter layer.weight"``). ``constants``: buffers to
    leave out, per module."""
    if isinstance(state, CheckpointState):
        yield from state.named_tensors(constants)
        return
    names: dict[int, str] = {}
    for _, module in _walk(state, label):
        if isinstance(module, nn.Module):
            names.update(_parameter_names(unwrap_module(module)))
    for path, value in _walk(state, label):
        if isinstance(value, nn.Module):
            yield from module_state(unwrap_module(value), path, constants)
        elif isinstance(value, Tensor):
            local = _local(value)
            if _checkable(local):
                yield path or "tensor", local
        elif hasattr(value, "param_groups") and hasattr(value, "state"):
            yield from optimizer_state(value, names, path or "optimizer")


def _walk(state: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            yield from _walk(value, f"{path}[{index}]")
    else:
        yield path, state


__all__ = [
    "CheckpointState",
    "ConstantBuffers",
    "constant_buffers",
    "NamedTensor",
    "averaged_weights",
    "lightning_checkpoint_state",
    "module_state",
    "named_state",
    "optimizer_state",
]
