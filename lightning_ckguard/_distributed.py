"""Strategy facts and the small collectives every concern shares: whether there are peers, one ``all_gather`` of a
few integers, a broadcast of a Python value, and a named barrier. Each is a no-op (no collective) without peers.

Everything goes through the Lightning or Fabric strategy, so its process group and its timeout apply. Nothing here
imports recording, agreement or publication code: every other module may import this one.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def is_multiprocess(strategy: Any) -> bool:
    """Whether ``strategy`` has peers to agree with (a world size above one)."""
    return int(getattr(strategy, "world_size", 1)) > 1


def is_rank_zero(collective: Any) -> bool:
    """Whether this rank is rank 0 of ``collective`` (a strategy, a process group's collectives), the one that writes,
    moves and evicts; the only one without peers (``None``)."""
    return bool(getattr(collective, "is_global_zero", True))


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


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"``: how one rank's error is told to the others."""
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Failures:
    """What every rank learned, at the same point, of a step that may have failed on some ranks.

    Attributes:
        ranks: The ranks on which it failed (empty: it succeeded everywhere).
        cause: The first failing rank's error, described (:func:`describe_error`); None when nothing failed.
        detail: What that rank sent along with it (a path, say); None when nothing failed.
        values: Every rank's extra integers, in rank order (what :func:`agree_on_failure` got as ``values``).
    """

    ranks: tuple[int, ...]
    cause: str | None = None
    detail: Any = None
    values: tuple[tuple[int, ...], ...] = ()


def agree_on_failure(
    strategy: Any, failure: BaseException | None, *, values: Sequence[int] = (), detail: Any = None
) -> Failures:
    """Tell every rank which ranks failed, and the first one's error: one ``all_gather`` of a flag (and ``values``, a
    few integers every rank sends alike), then, only on a failure, one broadcast from the first failing rank of its
    description and ``detail``. The same :class:`Failures` on every rank; without peers, no collective.

    The pattern behind every "it failed on some rank, so every rank raises": a rank that raised alone would leave its
    peers waiting in the next collective.
    """
    rows = gather_ints(strategy, [int(failure is not None), *values])
    return failures_from(strategy, rows, failure, detail)


def failures_from(
    strategy: Any, rows: Sequence[Sequence[int]], failure: BaseException | None, detail: Any = None
) -> Failures:
    """:func:`agree_on_failure` from rows already gathered (each rank's failure flag first, then its values), for a
    flag that rode in another collective: only on a failure, one broadcast of the first failing rank's error."""
    failed = tuple(rank for rank, row in enumerate(rows) if row[0])
    extra = tuple(tuple(row[1:]) for row in rows)
    if not failed:
        return Failures((), values=extra)
    mine = (describe_error(failure), detail) if failure is not None else None
    shared: tuple[str, Any] = broadcast_value(strategy, mine, src=failed[0])  # type: ignore[assignment]  # the failing rank sends it
    return Failures(failed, shared[0], shared[1], extra)


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


__all__ = [
    "Failures",
    "agree_on_failure",
    "barrier",
    "broadcast_value",
    "describe_error",
    "failures_from",
    "gather_ints",
    "is_deepspeed_strategy",
    "is_multiprocess",
    "is_rank_zero",
]
