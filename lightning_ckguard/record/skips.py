"""Whether a loss scaler will skip the optimizer step about to run, as a device tensor (no host sync).

``torch.amp.GradScaler.unscale_`` leaves one ``found_inf`` tensor per device in its per-optimizer state; ``step()``
skips the optimizer exactly when any of them is non-zero. Reading them before the step, after unscaling, is free:
the flag stays on the device and is only read back at a checkpoint boundary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState


def scaler_skip_flag(scaler: Any | None, optimizer: Any) -> Tensor | None:
    """A 0-d bool tensor, True when ``scaler`` will skip ``optimizer``'s coming step; ``None`` when it cannot tell.

    It can tell once ``scaler.unscale_(optimizer)`` ran for this step, which Lightning's mixed-precision plugins do
    before ``on_before_optimizer_step``. It cannot for optimizers that unscale inside their own fused step, or when
    no enabled scaler is in use; a non-finite gradient then counts as applied, which rejects (the safe side).
    """
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    state = _state_of(states, optimizer) if isinstance(states, dict) else None
    if state is None or state.get("stage") is not OptState.UNSCALED:
        return None
    found = list(state["found_inf_per_device"].values())
    if not found:
        return None
    device = found[0].device
    # stack copies: GradScaler.update() accumulates into the first found_inf tensor in place
    return torch.stack([f.to(device, non_blocking=True) for f in found]).sum() > 0


#: Where Fabric's ``_FabricOptimizer`` and Lightning's ``LightningOptimizer`` hold the optimizer they wrap (both have
#: ``_optimizer``, exposed as the ``optimizer`` property).
_WRAPPED_OPTIMIZER_ATTRIBUTES = ("_optimizer", "optimizer")
#: How many wrappers deep the scaler's optimizer is looked for.
_MAX_WRAPPERS = 8


def _state_of(states: dict[int, Any], optimizer: Any) -> dict[str, Any] | None:
    """The scaler's per-optimizer state of ``optimizer``, or of the optimizer it wraps: a scaler keys its state by the
    id of the optimizer it unscaled, which under Fabric is the inner one, not the ``_FabricOptimizer`` a loop holds.
    The object itself is asked first, so a scaler that unscaled the wrapper itself is answered as before."""
    seen: set[int] = set()
    current = optimizer
    for _ in range(_MAX_WRAPPERS):
        if current is None or id(current) in seen:
            return None
        seen.add(id(current))
        state = states.get(id(current))
        if state is not None:
            return state
        current = _wrapped(current)
    return None


def _wrapped(optimizer: Any) -> Any | None:
    """The optimizer ``optimizer`` wraps, or None: only an object with ``param_groups`` counts (an attribute named
    ``optimizer`` that holds anything else is not a wrapped optimizer)."""
    for name in _WRAPPED_OPTIMIZER_ATTRIBUTES:
        try:
            inner = getattr(optimizer, name, None)
        except Exception:  # a property that raises: nothing wrapped to be found there
            continue
        if inner is not None and inner is not optimizer and hasattr(inner, "param_groups"):
            return inner
    return None


def loss_scale(scaler: Any | None) -> Tensor | None:
    """The scale ``scaler`` multiplies a loss by before its backward (a device tensor, so no host sync), or ``None``
    without an enabled scaler: a loss seen after Lightning's mixed precision scaled it is divided by it."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, Tensor) else None


__all__ = ["loss_scale", "scaler_skip_flag"]
