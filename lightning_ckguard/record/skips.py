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
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    if state is None or state.get("stage") is not OptState.UNSCALED:
        return None
    found = list(state["found_inf_per_device"].values())
    if not found:
        return None
    device = found[0].device
    # stack copies: GradScaler.update() accumulates into the first found_inf tensor in place
    return torch.stack([f.to(device, non_blocking=True) for f in found]).sum() > 0


def loss_scale(scaler: Any | None) -> Tensor | None:
    """The scale ``scaler`` multiplies a loss by before its backward (a device tensor, so no host sync), or ``None``
    without an enabled scaler: a loss seen after Lightning's mixed precision scaled it is divided by it."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, Tensor) else None


__all__ = ["loss_scale", "scaler_skip_flag"]
