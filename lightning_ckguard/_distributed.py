"""Strategy facts and the small collectives every concern shares: whether there are peers, one ``all_gather`` of a
few integers, a broadcast of a Python value, and a named barrier. Each is a no-op (no collective) without peers.

Everything goes through the Lightning or Fabric strategy, so its process group and its timeout apply. Nothing here
imports recording, agreement or publication code: every other module may import this one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def is_multiprocess(strategy: Any) -> bool:
    """Whether ``strategy`` has peers to agree with (a world size above one)."""
    return int(getattr(strategy, "world_size", 1)) > 1


def gather_ints(strategy: Any, values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in rank order, from one ``all_gather``.

    Without peers, ``[list(values)]`` and no collective.
    """
    if not is_multiprocess(strategy):
        return [list(values)]
    local = torch.tensor(list(values), dtype=torch.int64, device=strategy.root_device)
    return strategy.all_gather(local).view(-1, len(values)).tolist()


def broadcast_value(strategy: Any, value: T, src: int = 0) -> T:
    """``value`` as rank ``src`` has it, on every rank. Without peers, ``value`` itself."""
    if not is_multiprocess(strategy):
        return value
    return strategy.broadcast(value, src=src)


def barrier(strategy: Any, name: str) -> None:
    """Wait for every rank at ``name``. Without peers, returns at once."""
    if is_multiprocess(strategy):
        strategy.barrier(name)


def _deepspeed_strategy_classes() -> tuple[type, ...]:
    # only packages already imported: a strategy of a package nobody imported cannot exist, and importing one (the
    # separate `pytorch_lightning` copy, say) would cost seconds at a save. The strategy modules import without
    # DeepSpeed itself.
    modules = ("lightning.fabric.strategies", "lightning.pytorch.strategies", "lightning_fabric.strategies",
               "pytorch_lightning.strategies")
    return tuple(cls for name in modules if (cls := getattr(sys.modules.get(name), "DeepSpeedStrategy", None)))


def is_deepspeed_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is a ``DeepSpeedStrategy`` (or a subclass) of Lightning or Fabric, in either package."""
    return isinstance(strategy, _deepspeed_strategy_classes())


__all__ = ["barrier", "broadcast_value", "gather_ints", "is_deepspeed_strategy", "is_multiprocess"]
