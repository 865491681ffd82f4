"""The top-K ledger: every piece of ``ModelCheckpoint`` state that a boundary may change, as one value.

A boundary captures the ledger before ``ModelCheckpoint``'s hook runs: it is what a rejection restores and what a
failed write rolls back to (:mod:`lightning_ckguard.publish.transaction`). ``ModelCheckpoint`` replaces its tensors
rather than mutating them, so a capture copies the containers only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

# ModelCheckpoint attribute name for each ledger field.
_ATTRIBUTES = {
    "best_k_models": "best_k_models",
    "kth_best_model_path": "kth_best_model_path",
    "kth_value": "kth_value",
    "best_model_path": "best_model_path",
    "best_model_score": "best_model_score",
    "current_score": "current_score",
    "last_model_path": "last_model_path",
    "last_global_step_saved": "_last_global_step_saved",
    "last_checkpoint_saved": "_last_checkpoint_saved",
    "last_time_checked": "_last_time_checked",
    "defer_save_until_validation": "_defer_save_until_validation",
}


@dataclass(frozen=True)
class Ledger:
    """A snapshot of a ``ModelCheckpoint``'s mutable bookkeeping (top-K, best, last, save markers)."""

    best_k_models: dict[str, Tensor]
    kth_best_model_path: str
    kth_value: Tensor
    best_model_path: str
    best_model_score: Tensor | None
    current_score: Tensor | None
    last_model_path: str
    last_global_step_saved: int
    last_checkpoint_saved: str
    last_time_checked: float | None
    defer_save_until_validation: bool

    @classmethod
    def capture(cls, checkpoint: ModelCheckpoint) -> Ledger:
        """Snapshot ``checkpoint``'s bookkeeping. Containers are copied; ModelCheckpoint replaces tensors, never
        mutates them in place, so they are shared."""
        # an attribute an older Lightning's ModelCheckpoint lacks (`_defer_save_until_validation` before 2.5.5)
        # is captured as its default and never written back
        values: dict[str, Any] = {name: getattr(checkpoint, attr, _ABSENT) for name, attr in _ATTRIBUTES.items()}
        values["best_k_models"] = dict(values["best_k_models"])
        if values["defer_save_until_validation"] is _ABSENT:
            values["defer_save_until_validation"] = False
        return cls(**values)

    def apply_to(self, checkpoint: ModelCheckpoint) -> None:
        """Make ``checkpoint``'s bookkeeping exactly this snapshot."""
        for name, attribute in _ATTRIBUTES.items():
            if hasattr(checkpoint, attribute):
                value = getattr(self, name)
                setattr(checkpoint, attribute, dict(value) if isinstance(value, dict) else value)

    def without(self, paths: list[str], mode: str) -> Ledger:
        """This ledger with the checkpoints at ``paths`` forgotten (``mode`` is ``"min"`` or ``"max"``): best and
        k-th best are chosen again among the remaining top-K entries, and ``last`` is cleared if it is one of them."""
        gone = set(paths)
        scores = {path: score for path, score in self.best_k_models.items() if path not in gone}
        best, worst = (min, max) if mode == "min" else (max, min)
        changes: dict[str, Any] = {"best_k_models": scores}
        if self.last_model_path in gone:
            changes["last_model_path"] = ""
        if self.best_model_path in gone:
            changes["best_model_path"] = best(scores, key=scores.__getitem__) if scores else ""
            changes["best_model_score"] = scores[changes["best_model_path"]] if scores else None
        if self.kth_best_model_path in gone:
            changes["kth_best_model_path"] = worst(scores, key=scores.__getitem__) if scores else ""
            changes["kth_value"] = (
                scores[changes["kth_best_model_path"]] if scores
                else torch.tensor(float("inf") if mode == "min" else -float("inf"))
            )
        return replace(self, **changes)


_ABSENT = object()

#: ModelCheckpoint attributes that the ledger tracks.
TRACKED_ATTRIBUTES = frozenset(_ATTRIBUTES.values())
