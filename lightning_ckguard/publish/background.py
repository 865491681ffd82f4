"""Background publication: each accepted boundary written on a thread and published in order, after its write.

With Lightning's ``AsyncCheckpointIO`` the training step must not wait for storage. A boundary is still decided,
agreed on and committed on the training thread, and its checkpoint is serialized there into memory (the tensors
cloned, as ``AsyncCheckpointIO`` does); everything that touches storage becomes one :class:`PublicationUnit`, run on a
single background thread in the order the boundaries were accepted:

1. every write of the boundary, into its staging sibling, then flushed (:mod:`~lightning_ckguard.publish.durability`),
   with the directories it made on the way;
2. each staging entry moved into place, then ``last`` linked or replaced (a copy made where links are refused is
   flushed first), in the order the hook asked, each followed by the flush of its directory;
3. the evictions, last: nothing is evicted before the checkpoint that replaces it is published, flushed included.

A unit whose write or move fails removes what it had put down (staging entries, names it created), puts back what
its moves replaced (:class:`~lightning_ckguard.publish.staging.Replacements`) and stops the queue: no later unit
publishes, since its checkpoint lists the one that failed. The failure is held until the next boundary's agreement,
where :meth:`BackgroundPublisher.report` rides in its one collective, or the end of training (under DDP only rank 0
writes); :meth:`BackgroundPublisher.settle` tells every rank; every rank then raises as for a synchronous failure,
and the callback's ledger goes back to the one before the first unit that was not published: what is on disk. A unit
whose eviction fails was published: the queue stops there too, the checkpoint it did not remove stays on disk, and
the peers raise a ``CheckpointWriteError`` that says the removal failed (``removal=True``), as the synchronous
writers do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_ckguard._distributed import NO_VALUE, failure_words, failures_from
from lightning_ckguard.publish.durability import Durability
from lightning_ckguard.publish.ledger import Ledger
from lightning_ckguard.publish.seal import write_error
from lightning_ckguard.publish.staging import (
    Replacements,
    discard,
    make_link,
    published_path,
    release_retired,
    staging_path,
)

log = logging.getLogger(__name__)

Phase = Literal["write", "publish", "evict"]


@dataclass
class _Operation:
    phase: Phase
    path: str  # the published name it concerns, for messages
    run: Callable[[], None]
    staging: str | None = None  # a staging entry it fills or consumes, discarded if the unit fails


@dataclass
class PublicationUnit:
    """The storage operations of one accepted boundary, in the order they run.

    Args:
        sequence: The boundary's place in acceptance order (the same on every rank).
        before: The callback's ledger before the boundary: what a failure of this unit rolls back to.
        durability: What is flushed after each write and each move into place.
    """

    sequence: int
    before: Ledger
    durability: Durability
    writes: list[_Operation] = field(default_factory=list)
    publications: list[_Operation] = field(default_factory=list)
    evictions: list[_Operation] = field(default_factory=list)
    #: what its moves into place replaced, kept until it is published, and put back should it fail
    replaced: Replacements = field(init=False)

    def __post_init__(self) -> None:
        self.replaced = Replacements(self.durability.flush_entries)

    def write(self, staging: str, save: Callable[[], None]) -> None:
        """Write a checkpoint into ``staging`` (``save`` does it, from a snapshot taken on the training thread), then
        flush it."""

        def save_and_flush() -> None:
            flush = self.durability.before_writing(staging)  # what exists before the write did not come from it
            save()
            flush(staging)

        self.writes.append(_Operation("write", published_path(staging), save_and_flush, staging))

    def publish(self, staging: str, filepath: str) -> None:
        """Move ``staging`` into place as ``filepath`` once every write of the unit is done."""

        def move() -> None:
            if os.path.lexists(staging):  # a write that left nothing there has nothing to publish
                self.replaced.move_into_place(staging, filepath)

        self.publications.append(_Operation("publish", filepath, move, staging))

    def link(self, target: str, linkpath: str) -> None:
        """Link ``linkpath`` to ``target`` (made beside it and moved over it) once ``target`` is published."""
        staging = staging_path(linkpath)

        def link_and_move() -> None:
            make_link(target, staging)
            self.durability.flush_written(staging)  # a copy, where the filesystem refuses links, holds data
            self.replaced.move_into_place(staging, linkpath)

        self.publications.append(_Operation("publish", linkpath, link_and_move, staging))

    def put_back(self) -> None:
        """The unit failed: what its moves replaced goes back under its names, newest first."""
        each_warning_on_failure(self.replaced.to_put_back(), self.replaced.restore, "Could not put back the "
                                "checkpoint %s after a failed background checkpoint write: %s")

    def release_kept(self) -> None:
        """The unit is published: the files it kept to put back go."""
        each_warning_on_failure(self.replaced.to_release(), release_retired,
                                "Could not remove the replaced copy of %s: %s")

    def evict(self, path: str, remove: Callable[[str], None]) -> None:
        """Remove ``path`` (with ``remove``) once the unit has published everything; never a name the unit itself
        published (that is the new checkpoint, not an eviction)."""
        def evict_unless_published() -> None:
            if path not in {op.path for op in self.publications}:  # every publication of the unit, when it runs
                remove(path)

        self.evictions.append(_Operation("evict", path, evict_unless_published))


@dataclass(eq=False)  # told apart by identity: two of one path are two writes
class _ExpectedWrite:
    staging: str
    handed: tuple[dict[str, Any], Any] | None = None  # what the plugin handed over: its checkpoint, storage options


@dataclass(eq=False)
class _Submission:
    """One call of the plugin's ``save_checkpoint``, in the order the plugin queued it: the boundary's write it is
    (``expected``), or None for one the guard does not publish (a manual save, another callback's)."""

    expected: _ExpectedWrite | None


_NO_ATTRIBUTE = object()


class PluginWrites:
    """Stands in, for one fit, for the base checkpoint IO of a Trainer's ``AsyncCheckpointIO`` (the plugin's
    ``checkpoint_io``), so that the plugin itself is called exactly as ``ModelCheckpoint`` calls it.

    The callback calls ``trainer.save_checkpoint`` with the real path and ``ModelCheckpoint``'s removals go through
    the strategy as usual: the plugin's own ``save_checkpoint`` and ``remove_checkpoint`` (a subclass's overrides too)
    run once each, with the same arguments, in the same order. Underneath, where the plugin hands the work to its base
    IO on its own thread, a guarded boundary's checkpoint (the plugin's point-in-time copy) is handed over to the
    boundary's :class:`PublicationUnit`, which writes it with that same base IO into the name's staging sibling on the
    guard's one publication thread, then moves it into place: the writes and moves of one name never overlap, and run
    in acceptance order. A removal waits in the boundary's unit until everything the unit publishes is in place.
    Every other call (other callbacks' saves, manual saves, loads) passes through unchanged.

    Which of the plugin's base-IO calls is the boundary's follows the plugin's own order: each call of its
    ``save_checkpoint`` (on the training thread) is noted as a :class:`_Submission`, and a call on its thread takes the
    oldest noted for its path. A manual save of the same name still queued when the boundary runs thus stays the
    manual save's.

    A subclass whose ``save_checkpoint`` does its own I/O instead of calling ``super()`` writes wherever it writes:
    that checkpoint is not staged, and is published when the override wrote it. One whose ``remove_checkpoint``
    deletes by itself deletes at once, before the replacement is published.
    """

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.base = _base_io(plugin)  # the plugin's own base IO (Lightning's TorchCheckpointIO, or the user's)
        self.unit: PublicationUnit | None = None  # the accepted boundary running now, whose removals wait
        self._armed: dict[str, _ExpectedWrite] = {}  # per path, the boundary's write the plugin is being asked for
        # per path, the plugin's submissions its thread has not run yet, oldest first (it runs them in that order)
        self._submitted: dict[str, deque[_Submission]] = {}
        self._lock = threading.Lock()
        self._owners = 0  # the fit's writers using it: the last one gives the plugin back
        self._own_save = vars(plugin).get("save_checkpoint", _NO_ATTRIBUTE)  # an instance attribute, put back
        self._plugin_save: Callable[..., None] = plugin.save_checkpoint

    @classmethod
    def install(cls, plugin: Any) -> PluginWrites:
        """Put a :class:`PluginWrites` under ``plugin`` (an ``AsyncCheckpointIO``), once per fit; each call is one
        owner, given back by :meth:`uninstall`. One already there (another guard's of this fit, or one a fit that
        raised left behind) is reused, once the plugin's thread ran what it had queued: nothing of an earlier fit
        stays expected."""
        current = plugin._checkpoint_io  # the attribute behind `checkpoint_io`, whose setter never replaces
        if isinstance(current, cls):
            current._start_afresh()
        else:
            current = cls(plugin)
            plugin._checkpoint_io = current
            plugin.save_checkpoint = current.submit  # on the instance: outside a subclass's override, as a user calls
        current._owners += 1
        return current

    def uninstall(self) -> None:
        """One owner is done; the last gives the plugin its own base IO and ``save_checkpoint`` back, once its thread
        has run everything queued (a write of a boundary not published is then handed over, never written)."""
        self._owners = max(self._owners - 1, 0)
        if self._owners > 0:
            return
        self._start_afresh()
        plugin = self.plugin
        if plugin._checkpoint_io is self:
            plugin._checkpoint_io = self.base
        if vars(plugin).get("save_checkpoint") == self.submit:
            if self._own_save is _NO_ATTRIBUTE:
                del plugin.save_checkpoint
            else:
                plugin.save_checkpoint = self._own_save

    def _start_afresh(self) -> None:
        """Wait for the plugin's thread, then forget every expected write and the boundary's unit."""
        self._drain()
        with self._lock:
            self._armed.clear()
            self._submitted.clear()
        self.unit = None

    def _drain(self) -> None:
        """Block until the plugin's thread has run everything queued so far."""
        with contextlib.suppress(RuntimeError):  # shut down already: nothing is queued
            queued = self._behind_the_plugins_writes(_nothing)
            if queued is not None:
                queued.result()

    def expect(self, filepath: str) -> _ExpectedWrite:
        """The plugin is about to be asked to write ``filepath``: what it hands its base IO is the guard's to write."""
        expected = _ExpectedWrite(staging_path(filepath))
        with self._lock:
            self._armed[str(filepath)] = expected
        return expected

    def disarm(self, filepath: str, expected: _ExpectedWrite) -> None:
        """The boundary's call of the plugin for ``filepath`` is over: a later call of that name (a manual save) is
        not ``expected``, even if the plugin was never called for it."""
        with self._lock:
            if self._armed.get(str(filepath)) is expected:
                del self._armed[str(filepath)]

    def forget(self, filepath: str, expected: _ExpectedWrite) -> None:
        """``expected`` will never be handed over: the plugin's thread has run past it. (A save that raised keeps its
        note until the thread runs past it, as the plugin may have queued it: :meth:`disarm` only.)"""
        self.disarm(filepath, expected)
        with self._lock:
            waiting = self._submitted.get(str(filepath), deque())
            for submission in [s for s in waiting if s.expected is expected]:
                waiting.remove(submission)

    def writer(self, filepath: str, expected: _ExpectedWrite) -> Callable[[], None]:
        """What the unit runs as the write: wait until the plugin's thread has run everything queued so far (so this
        save too), then write what it handed over into staging with the plugin's base IO. A save the plugin never
        handed to its base IO (an override that writes by itself) leaves nothing in staging: nothing to publish."""
        queued = self._behind_the_plugins_writes(_nothing)

        def write() -> None:
            if queued is not None:
                queued.result()
            self.forget(filepath, expected)
            handed, expected.handed = expected.handed, None  # the copy is freed once written
            if handed is not None:
                checkpoint, storage_options = handed
                self.base.save_checkpoint(checkpoint, expected.staging, storage_options=storage_options)

        return write

    # the plugin's save_checkpoint, as the training thread calls it
    def submit(self, *args: Any, **kwargs: Any) -> None:
        """Note the call, in order, as the boundary's write of its path (when one is expected) or as one to pass
        through; then call the plugin's own ``save_checkpoint``. Behind it on the plugin's thread, a note its base IO
        never took (an override that wrote by itself, a call that failed before queueing) is dropped, before the
        next call's write runs."""
        path = args[1] if len(args) > 1 else kwargs.get("path")
        if path is None:  # not a call Lightning makes: nothing to match
            self._plugin_save(*args, **kwargs)
            return
        key = str(path)
        with self._lock:
            submission = _Submission(self._armed.pop(key, None))
            self._submitted.setdefault(key, deque()).append(submission)
        try:
            self._plugin_save(*args, **kwargs)
        finally:
            self._drop_when_run(key, submission)

    def _drop_when_run(self, key: str, submission: _Submission) -> None:
        try:
            if self._behind_the_plugins_writes(self._drop, key, submission) is not None:
                return
        except RuntimeError:  # shut down: nothing more runs there
            pass
        self._drop(key, submission)

    def _behind_the_plugins_writes(self, task: Callable[..., None], *args: Any) -> Future[None] | None:
        """``task(*args)`` queued on the plugin's thread (``AsyncCheckpointIO``'s one worker: first in, first out),
        behind everything queued so far; None for a plugin without one. A thread shut down raises ``RuntimeError``."""
        executor = getattr(self.plugin, "_executor", None)
        return executor.submit(task, *args) if executor is not None else None

    def _drop(self, key: str, submission: _Submission) -> None:
        with self._lock:
            waiting = self._submitted.get(key)
            if waiting is not None and submission in waiting:
                waiting.remove(submission)

    # the checkpoint IO the plugin sees
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        with self._lock:
            waiting = self._submitted.get(str(path))
            submission = waiting.popleft() if waiting else None
        expected = submission.expected if submission is not None else None
        if expected is None:
            self.base.save_checkpoint(checkpoint, path, storage_options=storage_options)
        else:
            expected.handed = (checkpoint, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        unit = self.unit
        if unit is None:
            self.base.remove_checkpoint(path)
        else:
            unit.evict(str(path), self.base.remove_checkpoint)

    def __getattr__(self, name: str) -> Any:  # load_checkpoint, teardown, anything else of the base IO
        if name in ("base", "plugin"):
            raise AttributeError(name)
        return getattr(self.base, name)


def _base_io(plugin: Any) -> Any:
    """The base checkpoint IO under ``plugin`` (an ``AsyncCheckpointIO``), through a :class:`PluginWrites` there."""
    io = plugin.checkpoint_io
    while isinstance(io, PluginWrites):  # one a fit that raised left behind
        io = io.base
    return io


def _nothing() -> None:
    """A task that marks a place in a thread's queue."""


@dataclass(frozen=True)
class WriteFailure:
    """A failed write (in the background, or a move into place on rank 0), as every rank learned it at the same
    point.

    Attributes:
        error: What this rank raises: its own error if its write failed, else a ``CheckpointWriteError``.
        published: The ledger of what was actually published (the one before the first unit that was not), or
            None when every unit published (only an eviction failed): the ledger stands.
    """

    error: BaseException
    published: Ledger | None


@dataclass
class _Failure:
    error: BaseException
    path: str
    first_unpublished: int
    removal: bool = False  # an eviction failed, after its unit was published

    def detail(self) -> tuple[str, bool]:
        """What the failing rank broadcasts with its error: the path, and whether it was a removal. Riding in the
        broadcast a failure already costs, the words of the agreement keep their count."""
        return self.path, self.removal


class BackgroundPublisher:
    """One background thread that runs :class:`PublicationUnit`s in acceptance order, and their failures.

    Every rank keeps one and opens a unit for every boundary identically (a rank that writes nothing runs empty units),
    so the units' ledgers are the same on every rank.
    """

    def __init__(self, durability: Durability) -> None:
        self._durability = durability
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._next_sequence = 0
        self._ledgers: dict[int, Ledger] = {}  # submitted units not yet known published on every rank
        self._failure: _Failure | None = None
        self._published_through = -1

    def open_unit(self, before: Ledger) -> PublicationUnit:
        """A new unit for the boundary starting now, whose ledger is ``before``."""
        return PublicationUnit(self._next_sequence, before, self._durability)

    def submit(self, unit: PublicationUnit) -> None:
        """Queue ``unit`` behind every unit submitted before it; it starts once they are done."""
        self._next_sequence = unit.sequence + 1
        self._ledgers[unit.sequence] = unit.before
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckguard-publication")
        self._futures = [future for future in self._futures if not future.done()]
        self._futures.append(self._executor.submit(self._run, unit))

    def _run(self, unit: PublicationUnit) -> None:
        with self._lock:
            if self._failure is not None:
                return  # an earlier unit failed: this one's checkpoint lists it, so it is never published
        created: list[str] = []
        operation: _Operation | None = None
        try:
            for operation in (*unit.writes, *unit.publications):
                if operation.phase == "publish" and not os.path.lexists(operation.path):
                    created.append(operation.path)
                operation.run()
        except BaseException as error:
            self._undo(unit, created)
            assert operation is not None
            with self._lock:
                self._failure = _Failure(error, operation.path, unit.sequence)
            return
        unit.release_kept()
        eviction: _Operation | None = None
        try:
            for eviction in unit.evictions:
                eviction.run()
        except BaseException as error:
            assert eviction is not None
            with self._lock:  # published; only an eviction failed: the evicted checkpoint stays, unlisted
                self._failure = _Failure(error, eviction.path, unit.sequence + 1, removal=True)
                self._published_through = unit.sequence
            return
        with self._lock:
            self._published_through = unit.sequence

    @staticmethod
    def _undo(unit: PublicationUnit, created: list[str]) -> None:
        """Undo what a failed unit put down: remove its staging entries and the names it published anew, and put
        back what its moves replaced."""
        each_warning_on_failure([*(op.staging for op in (*unit.writes, *unit.publications) if op.staging),
                                 *reversed(created)], discard,
                                "Could not remove %s after a failed background checkpoint write: %s")
        unit.put_back()

    def wait(self) -> None:
        """Block until every submitted unit has run (the end of training)."""
        for future in list(self._futures):
            future.result()
        self._futures = []

    def report(self, collective: Any) -> list[int]:
        """This rank's part of the next agreement over ``collective``: which rank failed, the first unit it did not
        publish, and the last unit it published (both reduced with MIN, so sent negated; the same count on every
        rank). Units still running are not waited for."""
        with self._lock:
            failure, published_through = self._failure, self._published_through
        first_unpublished = -failure.first_unpublished if failure is not None else NO_VALUE
        return failure_words(collective, failure.error if failure is not None else None,
                             [first_unpublished, -published_through])

    def settle(self, strategy: Any, reduced: Sequence[int]) -> WriteFailure | None:
        """Whether a unit failed on any rank, from every rank's :meth:`report` reduced (in the agreement, or at the end
        of training); only on a failure, one broadcast of its description. The same answer on every rank.

        After a failure the publisher starts afresh: the failed and the abandoned units are forgotten.
        """
        with self._lock:
            failure = self._failure
        found = failures_from(strategy, reduced, failure.error if failure is not None else None,
                              failure.detail() if failure is not None else None)
        first_unpublished, published_everywhere = -found.values[0], -found.values[1]
        for sequence in [s for s in self._ledgers if s <= published_everywhere]:
            del self._ledgers[sequence]  # published on every rank
        if not found.ranks:
            return None
        published = self._ledgers.get(first_unpublished)  # the earliest any failing rank did not publish
        self.wait()  # the abandoned units return at once
        with self._lock:
            self._failure = None
        self._ledgers.clear()
        path, removal = found.detail  # the first failing rank's: a peer's error names what failed there
        error = write_error(found, failure.error if failure is not None else None, path, removal=removal)
        assert error is not None  # some rank failed
        return WriteFailure(error, published)

    def local_failure(self) -> WriteFailure | None:
        """This rank's own failure, if any, without a collective (while an exception unwinds, when a peer may be
        gone); like :meth:`settle` it starts the publisher afresh."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is None:
            return None
        published = self._ledgers.get(failure.first_unpublished)
        self._ledgers.clear()
        return WriteFailure(failure.error, published)

    def close(self) -> None:
        """Wait for every unit, then stop the thread. A failure nobody was told of yet is logged."""
        self.wait()
        with self._lock:
            if self._failure is not None:
                log.warning("A background checkpoint %s of %s failed: %s",
                            "removal" if self._failure.removal else "write", self._failure.path, self._failure.error)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def each_warning_on_failure(paths: Iterable[str], act: Callable[[str], None], message: str,
                            logger: logging.Logger = log) -> None:
    """``act`` on each of ``paths`` (a snapshot of them); a failure is logged to ``logger`` as ``message % (path,
    error)`` and the next path goes on: these are clean-ups, and the boundary's own outcome is the one to surface."""
    for path in list(paths):
        try:
            act(path)
        except Exception as error:
            logger.warning(message, path, error)


__all__ = ["WriteFailure", "BackgroundPublisher", "PluginWrites", "PublicationUnit", "each_warning_on_failure"]
