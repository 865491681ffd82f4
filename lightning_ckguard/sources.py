"""Gradient sources: where each rank finds the local gradients that its optimizer is about to apply.

A source is local by contract: reading it issues no collective and no host sync. Strategy-specific sources (sharded
optimizer partitions, DTensor shards) plug in here; :func:`gradient_source_for` picks one from the strategy.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn


class GradientSource(Protocol):
    """Yields a rank's local gradients, with a stable index per parameter for attribution."""

    @property
    def parameter_names(self) -> list[str]:
        """Name of each parameter index; indices are the same on every rank."""
        ...

    def local_gradients(self, optimizer: Any | None = None) -> tuple[tuple[int, ...], list[Tensor]]:
        """Return ``(indices, grads)`` for the parameters stepped by ``optimizer`` (all parameters if ``None``)."""
        ...


def _local_tensor(grad: Tensor) -> Tensor:
    # DTensor (FSDP2, tensor parallel): its local shard; reducing the DTensor itself would be a collective
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


class ParameterGradients:
    """Reads ``param.grad`` of a module's parameters: single device, DDP, ZeRO-1 and DTensor shards.

    Under DDP the gradients read here are the all-reduced ones each rank applies. Parameters that have no gradient
    (frozen, unused in the step) are skipped. Parameters an optimizer holds that the module does not name are still
    read, under a positional name.
    """

    def __init__(self, module: nn.Module) -> None:
        self._names: list[str] = []
        self._index: dict[int, int] = {}
        for name, param in module.named_parameters():
            self._add(param, name)
        self._module_params: list[tuple[int, Tensor]] = [(self._index[id(p)], p) for p in module.parameters()]
        # per optimizer: (group sizes when cached, [(index, param)]); rebuilt when param groups change
        self._optimizer_params: dict[int, tuple[tuple[int, ...], list[tuple[int, Tensor]]]] = {}

    @property
    def parameter_names(self) -> list[str]:
        return self._names

    def _add(self, param: Tensor, name: str | None = None) -> int:
        key = id(param)
        if key not in self._index:
            self._index[key] = len(self._names)
            self._names.append(name if name is not None else f"<parameter {len(self._names)} outside the module>")
        return self._index[key]

    def _params_of(self, optimizer: Any) -> list[tuple[int, Tensor]]:
        groups = optimizer.param_groups
        sizes = tuple(len(group["params"]) for group in groups)
        cached = self._optimizer_params.get(id(optimizer))
        if cached is None or cached[0] != sizes:
            cached = (sizes, [(self._add(p), p) for group in groups for p in group["params"]])
            self._optimizer_params[id(optimizer)] = cached
        return cached[1]

    def local_gradients(self, optimizer: Any | None = None) -> tuple[tuple[int, ...], list[Tensor]]:
        params = self._module_params if optimizer is None else self._params_of(optimizer)
        indices: list[int] = []
        grads: list[Tensor] = []
        for index, param in params:
            grad = param.grad
            if grad is not None:
                indices.append(index)
                grads.append(_local_tensor(grad))
        return tuple(indices), grads


def gradient_source_for(strategy: Any, module: nn.Module) -> GradientSource:
    """Pick the gradient source for a Lightning (or Fabric) strategy.

    Raises:
        ValueError: For strategies whose gradients this version cannot read, rather than guarding nothing silently.
    """
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        raise ValueError(
            f"FiniteGradCheckpoint does not support `{name}` yet: DeepSpeed keeps gradients in its optimizer "
            "partitions, not in `param.grad`, so there is nothing this version can read."
        )
    return ParameterGradients(module)


__all__ = ["GradientSource", "ParameterGradients", "gradient_source_for"]
