"""The publication seal: every checkpoint write of a guarded Trainer passes one gate.

``FiniteGradCheckpoint`` guards its own boundaries. Other writes reach the strategy directly: a manual
``trainer.save_checkpoint`` (weights-only ones skip every callback hook), ``OnExceptionCheckpoint``, another
checkpoint callback. The seal wraps ``trainer.strategy.save_checkpoint``, which every rank calls for every such write,
so each guard can admit the write (after the same preflight agreement), refuse it on every rank, or let its own
accepted boundary through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class SaveAdmission(Protocol):
    """A guard that decides, identically on every rank, whether a checkpoint write may happen."""

    def admit_save(self, strategy: Any, filepath: str) -> bool:
        """Return True to let ``strategy`` write ``filepath``, False to skip it with a warning, or raise to refuse."""
        ...


class PublicationSeal:
    """Wraps a strategy's ``save_checkpoint`` and asks every registered guard before a write."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._save_checkpoint: Callable[..., Any] = strategy.save_checkpoint
        self._guards: list[SaveAdmission] = []

    @classmethod
    def install(cls, strategy: Any, guard: SaveAdmission) -> PublicationSeal:
        """Install the seal on ``strategy`` once, and register ``guard`` with it."""
        seal = strategy.save_checkpoint
        if not isinstance(seal, PublicationSeal):
            seal = cls(strategy)
            strategy.save_checkpoint = seal
        if guard not in seal._guards:
            seal._guards.append(guard)
        return seal

    def __call__(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> Any:
        admitted = [guard.admit_save(self._strategy, str(filepath)) for guard in self._guards]
        if not all(admitted):
            return None
        return self._save_checkpoint(checkpoint, filepath, storage_options=storage_options)
