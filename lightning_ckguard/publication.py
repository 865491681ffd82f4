"""Publication: route ``ModelCheckpoint``'s file operations through a proposal, then publish or roll back.

A boundary runs ``ModelCheckpoint``'s own hook twice at most:

1. :meth:`BoundaryPublication.propose` runs it as a dry run. Saves, links and removals are only recorded, so the
   proposal says exactly what the boundary would write, and the ledger is restored afterwards.
2. After the agreement accepts, :meth:`BoundaryPublication.publish` runs it for real. ``ModelCheckpoint`` commits the
   ledger before it serializes (the file's own callback state lists it), links ``last``, and the removals it asks
   for are held back until every write succeeded. If any write fails, the ledger rolls back, files this boundary
   created are removed, the evicted files are still there, and the error propagates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_utilities.core import rank_zero as _rank_zero

from lightning_ckguard.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedWrite:
    """One file operation a boundary would perform."""

    action: Literal["save", "link", "remove"]
    path: str
    target: str | None = None


@dataclass(frozen=True)
class Proposal:
    """What a boundary would do: the ledger before and after it, its file operations in order, and the rank-zero
    log records it emitted (held back: "saving model to ..." must not print for a boundary that is rejected)."""

    before: Ledger
    after: Ledger
    writes: tuple[PlannedWrite, ...]
    held_logs: tuple[logging.LogRecord, ...] = ()

    @property
    def publishes(self) -> bool:
        """Whether the boundary writes anything. A boundary that writes nothing needs no agreement."""
        return any(write.action != "remove" for write in self.writes)

    def adopt(self, checkpoint: ModelCheckpoint) -> None:
        """Keep the dry run's outcome as if it had run for real; only for a proposal that publishes nothing."""
        assert not self.publishes
        self.after.apply_to(checkpoint)
        for record in self.held_logs:
            logging.getLogger(record.name).handle(record)


class _HoldRecords(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextmanager
def _held_rank_zero_logs() -> Iterator[list[logging.LogRecord]]:
    """Hold back what ``rank_zero_info`` logs (``ModelCheckpoint``'s verbose lines) instead of emitting it."""
    logger = _rank_zero.log
    hold = _HoldRecords()
    logger.addFilter(hold)
    try:
        yield hold.records
    finally:
        logger.removeFilter(hold)


class BoundaryPublication:
    """Mode switch for one callback's file operations: recorded (``planning``) or performed (``publishing``)."""

    def __init__(self) -> None:
        self._mode: Literal["idle", "planning", "publishing"] = "idle"
        self._planned: list[PlannedWrite] = []
        self._written: list[str] = []
        self._created: list[str] = []
        self._deferred_removals: list[str] = []

    @property
    def planning(self) -> bool:
        return self._mode == "planning"

    @property
    def publishing(self) -> bool:
        return self._mode == "publishing"

    def plan(self, action: Literal["save", "link", "remove"], path: str, target: str | None = None) -> None:
        self._planned.append(PlannedWrite(action, path, target))

    def note_write(self, path: str, existed: bool) -> None:
        """A write is about to happen; a path that did not exist is removed again if the boundary fails."""
        self._written.append(path)
        if not existed:
            self._created.append(path)

    def defer_removal(self, path: str) -> None:
        self._deferred_removals.append(path)

    def propose(self, checkpoint: ModelCheckpoint, run_hook: Callable[[], None]) -> Proposal:
        """Dry-run ``run_hook`` (a ``ModelCheckpoint`` hook) and return what it would do; state is left as before."""
        before = Ledger.capture(checkpoint)
        self._mode, self._planned = "planning", []
        try:
            with _held_rank_zero_logs() as held:
                run_hook()
            after = Ledger.capture(checkpoint)
        finally:
            self._mode = "idle"
            before.apply_to(checkpoint)
        return Proposal(before, after, tuple(self._planned), tuple(held))

    def publish(
        self,
        checkpoint: ModelCheckpoint,
        run_hook: Callable[[], None],
        rollback_to: Ledger,
        remove: Callable[[str], None],
    ) -> None:
        """Run ``run_hook`` for real, then perform the removals it asked for; roll back if any write fails."""
        self._mode, self._written, self._created, self._deferred_removals = "publishing", [], [], []
        try:
            run_hook()
        except BaseException:
            rollback_to.apply_to(checkpoint)
            for path in reversed(self._created):
                try:
                    remove(path)
                except Exception as cleanup_error:  # the original error is the one to surface
                    log.warning("Could not remove %s after a failed checkpoint write: %s", path, cleanup_error)
            raise
        finally:
            self._mode = "idle"
        for path in self._deferred_removals:
            if path not in self._written:
                remove(path)
