"""Gradient sources: where each rank finds the local gradients that its optimizer is about to apply.

A source is local by contract: reading it issues no collective and no host sync. Strategy-specific sources plug in
here: DTensor shards (FSDP2, tensor parallel) are read by :class:`ParameterGradients`, DeepSpeed's optimizer
partitions by :mod:`lightning_ckguard.record.deepspeed_sources`, which builds on this module (never the other way
round). :func:`lightning_ckguard.record.source_selection.gradient_source_for` picks one from the strategy.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from itertools import chain
from typing import Any, Protocol

from torch import Tensor, nn


class GradientSource(Protocol):
    """Yields a rank's local gradients, with a stable index per parameter for attribution.

    ``defers_skip_outcome`` is True for sources whose strategy decides inside its optimizer step whether to skip it
    (DeepSpeed): the guard then holds the recorded step until :meth:`skipped_last_step` can tell, after the step.
    """

    defers_skip_outcome: bool

    @property
    def parameter_names(self) -> list[str]:
        """Name of each parameter index; indices are the same on every rank."""
        ...

    def local_gradients(self, optimizer: Any | None = None) -> tuple[tuple[int, ...], list[Tensor]] | None:
        """Return ``(indices, grads)`` for the parameters stepped by ``optimizer`` (all parameters if ``None``).

        ``None`` means this call is not an optimizer step (a DeepSpeed micro-batch before the gradient accumulation
        boundary): nothing is recorded. Reading is local: no collective, no host sync.
        """
        ...

    def skipped_last_step(self) -> bool:
        """After the optimizer step: whether the strategy skipped it (nothing applied). Host values only."""
        ...


#: Wrapper modules by class name, and the attribute that holds the module each wraps: Fabric's, DDP's, and
#: ``torch.compile``'s ``OptimizedModule`` (whose parameters would otherwise be named ``_orig_mod.<name>``).
_MODULE_WRAPPERS = {"_FabricModule": "module", "DistributedDataParallel": "module", "OptimizedModule": "_orig_mod"}


#: Where DeepSpeed's ZeRO-3 optimizer keeps this rank's gradient partitions, by ``ds_id`` (a name-mangled attribute).
ZERO3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
#: Attributes by which an optimizer that applies gradients it keeps outside ``param.grad`` is known: DeepSpeed's
#: ZeRO-1/2 (the reduced partitions), ZeRO-3 and bf16 optimizers. ``param.grad`` holds nothing of what they apply.
_GRADIENTS_OUTSIDE_PARAMS = (("averaged_gradients", "params_in_partition"), (ZERO3_GRAD_PARTITIONS,),
                             ("fp32_groups_gradients", "bf16_groups"))
#: Attributes by which a parameter those optimizers manage is known, read without the optimizer: DeepSpeed links each
#: one to its ZeRO-1/2 or bf16 optimizer's partition (``_hp_mapping``, on every parameter of theirs) or partitions it
#: under ZeRO-3 (``ds_id``). ZeRO-0's plain optimizers set neither: their gradients are in ``param.grad``.
_PARAMETERS_WITH_GRADIENTS_OUTSIDE = ("_hp_mapping", "ds_id")


def _keeps_gradients_outside(optimizer: Any) -> bool:
    """Whether ``optimizer`` (itself, or inside Fabric's or Lightning's wrapper) is one of those optimizers."""
    candidates = (optimizer, getattr(optimizer, "optimizer", None), getattr(optimizer, "_optimizer", None))
    return any(all(hasattr(candidate, name) for name in names)
               for candidate in candidates for names in _GRADIENTS_OUTSIDE_PARAMS)


def _refuse_gradients_kept_elsewhere(optimizer: Any | None, module: nn.Module | None = None,
                                     params: Iterable[Tensor] = ()) -> None:
    """Raise rather than read nothing, step after step, where DeepSpeed keeps the gradients: ``optimizer`` is one of
    its ZeRO optimizers or, read without one (``optimizer`` None), ``params`` (``module``'s) are managed by one.

    Raises:
        ValueError: For such an optimizer, or such parameters.
    """
    if optimizer is not None:
        if not _keeps_gradients_outside(optimizer):
            return
        subject = f"`{type(optimizer).__name__}` applies gradients it keeps"
    elif any(hasattr(param, name) for param in params for name in _PARAMETERS_WITH_GRADIENTS_OUTSIDE):
        subject = (f"The parameters of `{type(module).__name__}` are DeepSpeed's: its optimizer applies gradients it "
                   "keeps")
    else:
        return
    raise ValueError(
        f"{subject} outside `param.grad` (DeepSpeed ZeRO), where this guard reads them: build `GradientGuard` on the "
        "model `fabric.setup` returned (it then reads DeepSpeed's partitions), or pass `source=`."
    )


def unwrap_module(module: nn.Module) -> nn.Module:
    """The user's own module inside Fabric's, DDP's and ``torch.compile``'s wrappers, so reports use its parameter
    names."""
    while True:
        attribute = _MODULE_WRAPPERS.get(type(module).__name__)
        inner = getattr(module, attribute, None) if attribute is not None else None
        if isinstance(inner, nn.Module) and inner is not module:
            module = inner
        else:
            return module


def _local_tensor(grad: Tensor) -> Tensor:
    # DTensor (FSDP2, tensor parallel): its local shard; reducing the DTensor itself would be a collective
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def replica_count(param: Tensor) -> int:
    """How many ranks hold the same local part of ``param``: for a DTensor, the product of its mesh's sizes along the
    dimensions it is replicated on (HSDP's replicate dimension, tensor-parallel ranks of a replicated parameter); 1
    for anything else."""
    placements, mesh = getattr(param, "placements", None), getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        return 1
    count = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            count *= mesh.size(dim)
    return count


def _parameter_slots(module: nn.Module) -> tuple[int, ...]:
    """The ids of what ``module``'s parameter slots hold, each module once: a key that changes with its parameter set,
    without building ``named_parameters()``'s names (less than half its cost)."""
    ids: list[int] = []
    seen: set[int] = set()
    pending: list[nn.Module | None] = [module]
    while pending:
        owner = pending.pop()
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        ids.extend(map(id, owner._parameters.values()))
        pending.extend(owner._modules.values())
    return tuple(ids)


class ParameterIndex:
    """A stable index per parameter: the module's own names first, in ``named_parameters()`` order, then any other
    parameter (held by an optimizer but not named by the module, or one the module gained later) as first seen."""

    def __init__(self, module: nn.Module) -> None:
        self.names: list[str] = []
        # id -> (the parameter, weakly, and its index): an id outlives its tensor, and a new parameter at a dead
        # one's address (a replaced layer's) must not take the dead one's index and name
        self._index: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        self.add_module_parameters(module)

    def add_module_parameters(self, module: nn.Module) -> None:
        """Index ``module``'s parameters not indexed yet under their names (those it gained since: a layer added
        later)."""
        for name, param in module.named_parameters():
            self.add(param, name)

    def add(self, param: Tensor, name: str | None = None) -> int:
        """The index of ``param``, assigned on first sight."""
        key = id(param)
        known = self._index.get(key)
        if known is not None and known[0]() is param:
            return known[1]
        index = len(self.names)
        self._index[key] = (weakref.ref(param), index)
        self.names.append(name if name is not None else f"<parameter {index} outside the module>")
        return index

    def add_name(self, name: str) -> int:
        """An index for something that is not one parameter (e.g. a whole unattributable partition)."""
        self.names.append(name)
        return len(self.names) - 1


class ParameterGradients:
    """Reads ``param.grad`` of a module's parameters: single device, DDP, ZeRO-1 and DTensor shards.

    Under DDP the gradients read here are the all-reduced ones each rank applies; under FSDP2 (``fully_shard``) and
    tensor parallelism each rank reads the local shard of its DTensor gradients (possibly empty), and the agreement
    makes the verdict global. Parameters that have no gradient (frozen, unused in the step) are skipped. Parameters
    an optimizer holds that the module does not name are still read, under a positional name. Without an optimizer,
    the parameters read are the module's at that read: a layer added or replaced after construction is read too.
    """

    defers_skip_outcome = False
    #: Whether the last gradients read were DTensor shards (FSDP2, tensor parallel), each rank's own part, rather
    #: than whole gradients every rank holds (DDP): how a spike gate adds up their squares over the ranks.
    shards_gradients = False
    #: Per gradient of the last read, how many ranks hold the same shard of it (``replica_count``); None where
    #: each is one rank's alone.
    gradient_replicas: tuple[int, ...] | None = None

    def __init__(self, module: nn.Module, parameters: ParameterIndex | None = None) -> None:
        # ``parameters``: an index to share with another source of the same module, so both use the same indices
        self._parameters = parameters if parameters is not None else ParameterIndex(module)
        self._replicas: dict[int, int] = {}  # parameter index -> replica count, for counts other than 1
        # The module's parameters are taken at each read (a layer added later, a lazy one, a replaced one), listed
        # anew only when the ids of its parameter slots change. Each list holds its parameters, so an id in its key
        # cannot be a new tensor's: the same holds for the optimizers' lists below. The module is held weakly: a
        # LightningModule reaches its Trainer, its strategy and the process group, which must go when the fit's
        # objects go, not with this guard at interpreter exit (gloo's threads then abort the process)
        self._module = weakref.ref(module)
        self._module_params: tuple[tuple[int, ...], list[tuple[int, Tensor]]] = ((), [])
        self._params_of_module()
        # the layout (``_module_params``' key) whose parameters were last found not to be DeepSpeed's: checked at the
        # first read after it changed, and when an optimizer's parameters change (the engine may be made after this
        # guard), not every step
        self._checked_layout: tuple[int, ...] | None = None
        # per optimizer: (its parameters' ids when cached, [(index, param)]); rebuilt when they change. Held weakly, by
        # the optimizer itself: a new optimizer at a dead one's address (its id) must not read the dead one's params
        self._optimizer_params: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], list[tuple[int, Tensor]]]] = (
            weakref.WeakKeyDictionary())

    @property
    def parameter_names(self) -> list[str]:
        """Name of each parameter index: the module's names, then positional names for other parameters."""
        return self._parameters.names

    def _params_of_module(self) -> list[tuple[int, Tensor]]:
        module = self._module()
        if module is None:  # gone: nothing of it to read
            return []
        key = _parameter_slots(module)
        if key != self._module_params[0]:
            self._parameters.add_module_parameters(module)  # the new ones under their names
            self._module_params = (key, [self._indexed(p) for p in module.parameters()])
        return self._module_params[1]

    def _params_to_read(self, optimizer: Any | None) -> list[tuple[int, Tensor]]:
        """``optimizer``'s parameters, or the module's, refused where DeepSpeed keeps their gradients (a
        ``ValueError`` from :func:`_refuse_gradients_kept_elsewhere`)."""
        if optimizer is not None:
            return self._params_of(optimizer)
        params = self._params_of_module()
        self._refuse_deepspeed_module(params)
        return params

    def _refuse_deepspeed_module(self, params: list[tuple[int, Tensor]]) -> None:
        """Refuse a module whose parameters DeepSpeed manages (a bare module, not the engine): once per layout,
        attribute lookups only, no tensor is read."""
        layout = self._module_params[0]
        if layout is not self._checked_layout:
            _refuse_gradients_kept_elsewhere(None, self._module(), (param for _, param in params))
            self._checked_layout = layout

    def _params_of(self, optimizer: Any) -> list[tuple[int, Tensor]]:
        groups = optimizer.param_groups
        key = tuple(map(id, chain.from_iterable(group["params"] for group in groups)))
        cached = self._optimizer_params.get(optimizer)
        if cached is None:
            _refuse_gradients_kept_elsewhere(optimizer)
        if cached is None or cached[0] != key:
            # an optimizer DeepSpeed took over holds its partitions, whose `.grad` stays None: the module tells
            self._refuse_deepspeed_module(self._params_of_module())
            module = self._module()
            if module is not None:
                self._parameters.add_module_parameters(module)  # the module's new ones under their names
            cached = (key, [self._indexed(p) for group in groups for p in group["params"]])
            self._optimizer_params[optimizer] = cached
        return cached[1]

    def _indexed(self, param: Tensor) -> tuple[int, Tensor]:
        index = self._parameters.add(param)
        count = replica_count(param)
        if count != 1:
            self._replicas[index] = count
        return index, param

    def local_gradients(self, optimizer: Any | None = None) -> tuple[tuple[int, ...], list[Tensor]]:
        """``param.grad`` (its local shard for a DTensor) of every parameter ``optimizer`` steps that has one."""
        params = self._params_to_read(optimizer)
        indices: list[int] = []
        grads: list[Tensor] = []
        sharded = False
        for index, param in params:
            grad = param.grad
            if grad is not None:
                local = _local_tensor(grad)
                sharded = sharded or local is not grad
                indices.append(index)
                grads.append(local)
        self.shards_gradients = sharded
        replicas = self._replicas
        self.gradient_replicas = tuple(replicas.get(index, 1) for index in indices) if replicas else None
        return tuple(indices), grads

    def skipped_last_step(self) -> bool:
        """``param.grad`` strategies report skips before the step (a loss scaler's ``found_inf``), never after."""
        return False


__all__ = ["GradientSource", "ParameterGradients", "ParameterIndex", "replica_count", "unwrap_module"]
