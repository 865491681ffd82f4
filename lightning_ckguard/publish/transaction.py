"""Publication: one boundary of ``ModelCheckpoint``'s hook, run once, as a transaction.

The hook runs exactly once per boundary, so each of its clock reads, collectives and log calls happens once, as in
``ModelCheckpoint``. Its file operations come back to the callback, which routes them through the
:class:`BoundaryTransaction` that :func:`run_boundary` opened:

1. The ledger is captured and rank-zero log lines are held back before the hook starts.
2. The hook's first file operation (a save, a link or a removal) is where every rank agrees: ``ModelCheckpoint``'s own
   decisions before it are already rank-agreed (broadcast time checks, ``file_exists`` votes, the top-K vote), so every
   rank reaches it together. A hook that makes no file operation needs no agreement and keeps its bookkeeping. Once
   accepted, the held lines are emitted and the hold is lifted, so that they come before what the writes log, as
   with ``ModelCheckpoint``.
3. A rejection raises :class:`BoundaryRejected` there, which unwinds the hook before anything is collected or written;
   the captured ledger is restored and the held lines are dropped. Nothing else changed.
4. On acceptance the fit's writer is opened for the boundary, and every write happens through it as the hook asks (the
   ledger is committed first, so each file's own callback state lists it); the writer holds removals until the hook
   returned with every write done. A failed write rolls the ledger back, removes what this boundary created, and
   leaves the checkpoint it would have evicted in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal, Protocol

from lightning_utilities.core import rank_zero as _rank_zero

from lightning_ckguard.publish.ledger import Ledger

#: What a boundary did: wrote nothing (no agreement was needed), published, was rejected with nothing changed, or
#: was accepted but another guard of the Trainer refused one of its writes, and it was undone.
Outcome = Literal["wrote nothing", "published", "rejected", "refused"]


class BoundaryRejected(Exception):
    """Unwinds ``ModelCheckpoint``'s hook at a rejected boundary. :func:`run_boundary` catches it; it never escapes."""


class BoundaryAbandoned(Exception):
    """Unwinds ``ModelCheckpoint``'s hook at its first file operation, nothing written and no rejection: the boundary
    writes nothing (an earlier boundary's failure, learned by every rank while an exception is being handled, where
    raising it would replace the error being handled). :func:`run_boundary` catches it."""


class WriteRefused(BoundaryRejected):
    """Unwinds the hook of a boundary its own guard accepted when another guard of the Trainer refused one of its
    writes (that guard's window still holds a fault): the boundary is undone, as a failed write is, without an
    error. :func:`run_boundary` catches it."""


class BoundaryWriter(Protocol):
    """The part of a fit's writer (:class:`~lightning_ckguard.publish.writers.Writer`) a transaction drives."""

    def open(self, before: Ledger | None) -> None:
        """An accepted boundary starts writing."""

    def close(self, published: bool, created: Sequence[str], remove: Callable[[str], None]) -> None:
        """The boundary's hook returned (``published``) or failed (remove what it ``created``)."""


class BoundaryTransaction:
    """The file operations of one boundary: agreed on at the first, the writer opened on acceptance.

    Args:
        checkpoint: The callback whose hook is running.
        before: Its ledger before the hook, what a rejection restores and a failed write rolls back to.
        agree: Joins the agreement (every rank, at the same point) and returns whether the boundary is accepted.
        writer: The fit's writer, opened for this boundary once it is accepted.
        held_lines: The rank-zero lines held back while the hook runs: logged on acceptance, dropped otherwise.
    """

    def __init__(self, checkpoint: Any, before: Ledger, agree: Callable[[], bool], writer: BoundaryWriter,
                 held_lines: _HeldLines) -> None:
        self.checkpoint = checkpoint
        self.before = before
        self._agree = agree
        self._writer = writer
        self._held_lines = held_lines
        self.accepted: bool | None = None  # None until the first file operation
        self.created: list[str] = []
        self.removed: list[str] = []  # what the hook removed: gone for ModelCheckpoint, evicted once published

    def admit(self) -> None:
        """Call before each file operation: the first one agrees; a rejected boundary unwinds the hook."""
        if self.accepted is None:
            try:
                self.accepted = self._agree()
            except BaseException:
                self._held_lines.drop()  # an earlier write's failure, raised here: this boundary did nothing
                raise
            if self.accepted:
                self._held_lines.release()  # what ModelCheckpoint said before its first write, said before it
                self._writer.open(self.before)
        if not self.accepted:
            raise BoundaryRejected

    def note_write(self, path: str, existed: bool) -> None:
        """A write is about to happen; a path that did not exist is removed again if the boundary fails."""
        if not existed:
            self.created.append(path)

    def roll_back_to(self, ledger: Ledger) -> None:
        """If the boundary fails, restore ``ledger`` instead of the one before it: a failure found here concerns
        earlier boundaries too (a background write), and the ledger goes back to what was actually published."""
        self.before = ledger


_active: ContextVar[BoundaryTransaction | None] = ContextVar("ckguard_boundary_transaction", default=None)


def active_transaction() -> BoundaryTransaction | None:
    """The boundary transaction whose hook is running now, if any (also reachable from static methods)."""
    return _active.get()


class _HeldLines(logging.Filter):
    """Holds back what ``rank_zero_info`` logs (``ModelCheckpoint``'s verbose lines) while it is installed, until
    :meth:`release` emits them or :meth:`drop` forgets them; both lift the hold."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._logger: logging.Logger | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def hold(self) -> None:
        self._logger = _rank_zero.log
        self._logger.addFilter(self)

    def drop(self) -> None:
        if self._logger is not None:
            self._logger.removeFilter(self)
            self._logger = None
        self.records = []

    def release(self) -> None:
        records = self.records
        self.drop()  # the hold is lifted first: emitted under it, each line would be held again
        for record in records:
            logging.getLogger(record.name).handle(record)


def run_boundary(
    checkpoint: Any, run_hook: Callable[[], None], agree: Callable[[], bool], writer: BoundaryWriter,
    remove: Callable[[str], None],
) -> Outcome:
    """Run ``run_hook`` (a ``ModelCheckpoint`` hook of ``checkpoint``) once, as one transaction.

    ``agree`` is called at the hook's first file operation, at most once; ``writer`` is opened on acceptance and closed
    when the hook returns; ``remove`` deletes a checkpoint for real (what a failed boundary created). Returns what the
    boundary did; a failed write raises after rolling back.
    """
    held_lines = _HeldLines()
    transaction = BoundaryTransaction(checkpoint, Ledger.capture(checkpoint), agree, writer, held_lines)
    token = _active.set(transaction)
    held_lines.hold()
    try:
        run_hook()
    except BoundaryAbandoned:
        held_lines.drop()
        transaction.before.apply_to(checkpoint)
        return "wrote nothing"
    except BoundaryRejected:
        held_lines.drop()  # the held lines described what was not done
        transaction.before.apply_to(checkpoint)
        if not transaction.accepted:
            return "rejected"
        writer.close(False, transaction.created, remove)  # refused by another guard: undone like a failed write
        return "refused"
    except BaseException:
        transaction.before.apply_to(checkpoint)
        held_lines.release()  # what ModelCheckpoint said before the failure, as it would have said it
        if transaction.accepted:
            writer.close(False, transaction.created, remove)
        raise
    finally:
        _active.reset(token)
    held_lines.release()  # a hook that wrote nothing: its lines, as ModelCheckpoint logs them
    if transaction.accepted:
        writer.close(True, (), remove)
    return "published" if transaction.accepted else "wrote nothing"


__all__ = [
    "BoundaryAbandoned", "BoundaryRejected", "BoundaryTransaction", "BoundaryWriter", "Outcome", "WriteRefused",
    "active_transaction", "run_boundary",
]
