"""The publication seal: every checkpoint write of a guarded Trainer passes one gate, before any work starts.

``FiniteGradCheckpoint`` guards its own boundaries. Other writes call ``trainer.save_checkpoint`` directly: a manual
save (weights-only ones skip every callback hook), ``OnExceptionCheckpoint``, another checkpoint callback, Lightning's
tuner. The seal wraps ``trainer.save_checkpoint``, which every rank calls for every write, so the gate is passed on
every rank before Lightning gathers anything (sharded model state, ZeRO-1 optimizer-state consolidation). Each guard
can admit the write after the same preflight agreement, refuse it on every rank, or let its own boundary through.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol


class SaveAdmission(Protocol):
    """A guard that decides, identically on every rank, whether a checkpoint write may happen."""

    def admit_save(self, trainer: Any, filepath: str) -> bool:
        """Return True to let ``trainer`` write ``filepath``, False to skip it with a warning, or raise to refuse."""
        ...


class PublicationSeal:
    """Wraps a Trainer's ``save_checkpoint`` and asks every registered guard before a write."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._save_checkpoint: Callable[..., Any] = trainer.save_checkpoint
        self._guards: list[SaveAdmission] = []
        functools.update_wrapper(self, self._save_checkpoint)

    @classmethod
    def install(cls, trainer: Any, guard: SaveAdmission) -> PublicationSeal:
        """Install the seal on ``trainer`` once, and register ``guard`` with it."""
        seal = trainer.save_checkpoint
        if not isinstance(seal, PublicationSeal):
            seal = cls(trainer)
            trainer.save_checkpoint = seal
        if guard not in seal._guards:
            seal._guards.append(guard)
        return seal

    def __call__(self, filepath: Any, weights_only: bool | None = None, storage_options: Any | None = None) -> None:
        admitted = [guard.admit_save(self._trainer, str(filepath)) for guard in self._guards]
        if all(admitted):
            self._save_checkpoint(filepath, weights_only=weights_only, storage_options=storage_options)
