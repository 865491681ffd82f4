"""The top-K vote: whether a monitored value earns a place in the top K, decided by every rank in one collective.

``ModelCheckpoint`` decides this in ``check_monitor_top_k`` with ``reduce_boolean_decision``, but only after
branching on whether the monitored key was logged. A rank whose metrics lack it (``self.log(...,
rank_zero_only=True)``, a metric logged under a condition) defers, warns or raises on its own, while its peers go
on to the vote or to the save's barrier and wait there: a hang until the process-group timeout, or a collective
matched with the wrong partner. Here each rank first decides locally, without a collective
(:func:`local_top_k_decision`), then every rank joins the same single ``all_gather`` (:func:`agree_on_top_k`),
key or no key, and all of them act on the same :class:`TopKVote`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_ckguard._distributed import gather_ints


@dataclass(frozen=True)
class TopKVote:
    """What every rank decided together about one monitored value.

    Attributes:
        improves: Every rank's value makes the top K (``ModelCheckpoint``'s unanimous decision).
        missing_ranks: The ranks whose logged metrics lack the monitored key; when not empty, nothing is saved.
    """

    improves: bool
    missing_ranks: tuple[int, ...] = ()


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
    """Every rank's ``(present, improves)`` in one ``all_gather`` through ``strategy`` (its process group and
    timeout); the same :class:`TopKVote` on every rank. Without peers, no collective."""
    return vote_of(gather_ints(strategy, local_vote(present, improves)))


def local_vote(present: bool, improves: bool) -> list[int]:
    """This rank's part of the vote, as the integers every rank sends."""
    return [int(present), int(improves)]


def vote_of(votes: Sequence[Sequence[int]]) -> TopKVote:
    """The vote from every rank's :func:`local_vote`, in rank order (gathered here or carried in another collective).
    Pure: the same :class:`TopKVote` on every rank."""
    missing = tuple(rank for rank, (has_key, _) in enumerate(votes) if not has_key)
    return TopKVote(improves=not missing and all(vote for _, vote in votes), missing_ranks=missing)


__all__ = ["TopKVote", "agree_on_top_k", "local_top_k_decision", "local_vote", "vote_of"]
