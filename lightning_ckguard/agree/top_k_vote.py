"""The top-K vote: whether a monitored value earns a place in the top K, decided by every rank in one collective.

``ModelCheckpoint`` decides this in ``check_monitor_top_k`` with ``reduce_boolean_decision``, but only after
branching on whether the monitored key was logged. A rank whose metrics lack it (``self.log(...,
rank_zero_only=True)``, a metric logged under a condition) defers, warns or raises on its own, while its peers go
on to the vote or to the save's barrier and wait there: a hang until the process-group timeout, or a collective
matched with the wrong partner. Here each rank first decides locally, without a collective
(:func:`local_top_k_decision`), then every rank joins the same single all-reduce (:func:`agree_on_top_k`, or the
agreement's, which the vote rides in), key or no key, and all of them act on the same :class:`TopKVote`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_ckguard._distributed import RankMap, rank_and_world, reduce_ints

#: Up to how many ranks lacking the monitored key a vote names (every one of them, up to this world size).
MISSING_RANKS = RankMap(8)
# Layout of a rank's vote, reduced with MAX: does some rank lack the key, decline, have the key; then who lacks it.
_MISSING, _DECLINES, _PRESENT = range(3)


@dataclass(frozen=True)
class TopKVote:
    """What every rank decided together about one monitored value.

    Attributes:
        improves: Every rank's value makes the top K (``ModelCheckpoint``'s unanimous decision).
        missing_ranks: The ranks whose logged metrics lack the monitored key (beyond 8 ranks, the lowest of each
            eighth of the ranks); when not empty, nothing is saved.
        missing_everywhere: No rank logged the monitored key.
    """

    improves: bool
    missing_ranks: tuple[int, ...] = ()
    missing_everywhere: bool = False


def local_top_k_decision(
    current: Tensor | None, best_k_models: dict[str, Tensor], kth_best_model_path: str, save_top_k: int, mode: str
) -> bool:
    """``ModelCheckpoint.check_monitor_top_k`` without its collective: whether ``current`` makes this rank's top K.

    With ``save_top_k == 0`` nothing ever enters the top K (``ModelCheckpoint`` never asks then; this answers
    anyway). A full top K is compared against its K-th best value; if ``kth_best_model_path`` is not one of
    ``best_k_models`` (e.g. state restored by hand), the K-th best is found the way ``ModelCheckpoint`` finds it
    after each save, instead of indexing a missing path.
    """
    if current is None or save_top_k == 0:
        return False
    if save_top_k == -1 or len(best_k_models) < save_top_k:
        return True
    monitor_op = {"min": torch.lt, "max": torch.gt}[mode]
    kth_best = best_k_models.get(kth_best_model_path)
    if kth_best is None:
        # the worst of the kept values, as in ModelCheckpoint._update_best_and_save; the top K is not empty here
        worst = max if mode == "min" else min
        kth_best = best_k_models[worst(best_k_models, key=best_k_models.__getitem__)]
    return bool(monitor_op(current, kth_best))


def agree_on_top_k(strategy: Any, present: bool, improves: bool) -> TopKVote:
    """Every rank's ``(present, improves)`` in one all-reduce through ``strategy``'s process group (its timeout); the
    same :class:`TopKVote` on every rank. Without peers, no collective."""
    return vote_of(reduce_ints(strategy, local_vote(strategy, present, improves)), rank_and_world(strategy)[1])


def local_vote(collective: Any, present: bool, improves: bool) -> list[int]:
    """This rank's part of the vote over ``collective``, as the integers every rank sends (reduced with MAX)."""
    rank, world_size = rank_and_world(collective)
    return [int(not present), int(not improves), int(present), *MISSING_RANKS.words(rank, world_size, not present)]


def vote_of(reduced: Sequence[int], world_size: int) -> TopKVote:
    """The vote from every rank's :func:`local_vote`, reduced (here or carried in another collective). Pure: the
    same :class:`TopKVote` on every rank."""
    missing = MISSING_RANKS.ranks(reduced[_PRESENT + 1 :], world_size)
    improves = not reduced[_MISSING] and not reduced[_DECLINES]
    return TopKVote(improves=improves, missing_ranks=missing, missing_everywhere=not reduced[_PRESENT])


__all__ = ["MISSING_RANKS", "TopKVote", "agree_on_top_k", "local_top_k_decision", "local_vote", "vote_of"]
