"""The write path of a fit, chosen once (:func:`choose_writer`): one object that saves, links and evicts for every
accepted boundary, and reports to the next agreement what it could not finish.

- :class:`StagedWriter`: a local ``dirpath``, written by Lightning itself. Every rank writes its part into the name's
  hidden staging sibling; the write's outcome is agreed by the caller's ``write`` (the seal, in place of Lightning's
  post-save barrier); rank 0 then moves it into place with one rename (:func:`~lightning_ckguard.publish.staging.
  move_into_place`). Evictions wait until the boundary published everything.
- :class:`BackgroundWriter`: the same under Lightning's ``AsyncCheckpointIO``: the plugin is called as
  ``ModelCheckpoint`` calls it, and the boundary's storage operations run as one unit on the guard's publication
  thread (:mod:`~lightning_ckguard.publish.background`).
- :class:`DirectWriter`: everything else (object storage, a user's own ``CheckpointIO``, a replaced
  ``save_checkpoint``): the write goes to the real name, as ``ModelCheckpoint`` makes it; evictions still wait.

What rank 0 does alone after the last collective of a boundary (a move into place, a link, an eviction, a background
write) can fail on rank 0 alone. Raising there would leave the other ranks in the next collective, so the writer holds
it: it puts nothing more in place or evicts nothing more, removes what the boundary created, and reports the failure in
the next agreement (:meth:`report`, a few integers riding in the agreement's one collective) or at the end of the fit
(:meth:`finish`). Every rank then raises, and the ledger goes back to the one before the first boundary that was not
published (a boundary whose eviction failed was published: its ledger stands, the checkpoint not evicted stays on disk).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, Protocol

from lightning_ckguard._distributed import barrier, failure_words, failures_from, is_rank_zero, reduce_ints
from lightning_ckguard.publish.background import (
    BackgroundPublisher,
    PluginWrites,
    PublicationUnit,
    WriteFailure,
    each_warning_on_failure,
)
from lightning_ckguard.publish.durability import Durability
from lightning_ckguard.publish.ledger import Ledger
from lightning_ckguard.publish.seal import write_error
from lightning_ckguard.publish.staging import (
    Replacements,
    discard,
    staging_path,
    writes_directories,
)
from lightning_ckguard.publish.storage import Storage

log = logging.getLogger(__name__)

#: ``flush(path)`` makes what a rank wrote at ``path`` durable (:mod:`~lightning_ckguard.publish.durability`).
Flush = Callable[[str], None]
#: ``write(path, flush)`` writes the checkpoint at ``path`` on every rank, runs ``flush(path)`` on each rank right
#: after its own part, and raises on every rank if any rank's write or flush failed.
Write = Callable[[str, Flush], None]
#: ``link(target, linkpath)`` makes ``linkpath`` a link to ``target`` (``ModelCheckpoint``'s own link).
Link = Callable[[str, str], None]
#: ``remove(path)`` removes a checkpoint for real (``ModelCheckpoint``'s own removal).
Remove = Callable[[str], None]


class Writer(Protocol):
    """What every write path does; one is chosen per fit, identically on every rank."""

    def open(self, before: Ledger | None) -> None:
        """An accepted boundary starts writing; ``before`` is its ledger before the hook."""

    def save(self, filepath: str, write: Write) -> None:
        """Publish the checkpoint ``write`` writes as ``filepath``."""

    def link(self, target: str, linkpath: str, link: Link) -> None:
        """Make ``linkpath`` a link to ``target`` once ``target`` is published."""

    def remove(self, path: str, remove: Remove) -> None:
        """Evict ``path`` once the boundary published everything (never if it fails)."""

    def close(self, published: bool, created: Sequence[str], remove: Remove) -> None:
        """The boundary's hook returned (``published``) or failed: on a failure, remove what it ``created``."""

    def report(self) -> list[int]:
        """This rank's integers for the next agreement (the same count on every rank), reduced with MAX there."""

    def settle(self, collective: Any, reduced: Sequence[int]) -> WriteFailure | None:
        """Every rank's :meth:`report`, reduced: the failure every rank raises, or None."""

    def finish(self, collective: Any, during_exception: bool,
               reduced: Sequence[int] | None = None) -> WriteFailure | None:
        """The end of the fit: wait for every write; agreed on every rank, or during an exception this rank's own.
        ``reduced``: :meth:`report`'s words already reduced in an agreement at the end, settled from them with no
        collective of its own."""

    def wait(self) -> None:
        """Wait until every accepted boundary's write has run (before a rewind reads one)."""

    def release(self) -> None:
        """The fit is over: stop threads, give back what was replaced."""


def _gone(staging: str) -> None:
    raise FileNotFoundError(f"The checkpoint written to {staging} was gone before it could be published (removed by "
                            "another process?).")


class _HeldFailure:
    """A failure rank 0 met after the boundary's last collective, held for the next agreement. ``unpublished``: the
    boundary it belongs to was not published (a move into place failed), so the ledger goes back to the one before
    it; else only an eviction failed, after everything was published, and the ledger stands."""

    def __init__(self, error: BaseException, path: str, unpublished: bool) -> None:
        self.error, self.path, self.unpublished = error, path, unpublished


class _HoldsFailures:
    """What rank 0 does alone after the boundary's last collective and fails (a move into place, an eviction: only
    rank 0 removes) is held: nothing more of the boundary is put in place or evicted, and every rank learns of it in
    the next agreement or at the end of the fit. Raising there on rank 0 alone would leave its peers waiting in the
    next collective. Evictions wait until the boundary published everything; what it wrote under a name is not
    evicted."""

    def __init__(self, collective: Any) -> None:
        self._collective = collective
        self._written: list[str] = []
        self._evictions: list[tuple[str, Remove]] = []
        self._held: _HeldFailure | None = None
        self._unconfirmed: Ledger | None = None  # the ledger before the first boundary not yet agreed published
        # whether rank 0 was handed something to do alone since the last settle; the same on every rank, so a finish
        # with nothing to report skips its collective on every rank alike
        self._acted_alone = False

    def open(self, before: Ledger | None) -> None:
        self._written, self._evictions = [], []
        if self._unconfirmed is None:
            self._unconfirmed = before

    def remove(self, path: str, remove: Remove) -> None:
        self._evictions.append((path, remove))

    def close(self, published: bool, created: Sequence[str], remove: Remove) -> None:
        evictions, self._evictions = self._evictions, []
        if not published:
            _remove_all(reversed(created), remove)
            return
        # a name written anew is the new checkpoint, not an eviction
        evictions = [(path, evict) for path, evict in evictions if path not in self._written]
        self._acted_alone = self._acted_alone or bool(evictions)
        for path, evict in evictions:
            if self._held is not None:
                return  # nothing is evicted for a boundary that was not published whole, nor after a failed eviction
            self._hold_failure_of(partial(evict, path), path, unpublished=False)

    def _hold_failure_of(self, act: Callable[[], None], path: str, unpublished: bool) -> bool:
        """Run ``act``, what rank 0 does alone at ``path``; hold its failure. Returns whether it succeeded."""
        try:
            act()
        except Exception as error:
            self._held = _HeldFailure(error, path, unpublished)
            return False
        return True

    def report(self) -> list[int]:
        held = self._held
        return failure_words(self._collective, held.error if held is not None else None,
                             [int(held is not None and held.unpublished)])

    def settle(self, collective: Any, reduced: Sequence[int]) -> WriteFailure | None:
        held, self._held = self._held, None
        self._acted_alone = False
        found = failures_from(collective, reduced, held.error if held else None, held.path if held else None)
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        unpublished = bool(found.values[0])  # some rank's boundary was not published: back to before it
        error = write_error(found, held.error if held else None, found.detail, removal=not unpublished)
        if error is None:
            return None
        return WriteFailure(error, unconfirmed if unpublished else None)

    def finish(self, collective: Any, during_exception: bool,
               reduced: Sequence[int] | None = None) -> WriteFailure | None:
        if during_exception:  # no collective is safe: this rank's own failure only
            held, self._held = self._held, None
            return WriteFailure(held.error, self._unconfirmed if held.unpublished else None) if held else None
        if reduced is not None:
            return self.settle(collective, reduced)
        if not self._acted_alone:  # nothing rank 0 did alone can have failed: no collective, on every rank
            self._unconfirmed = None
            return None
        return self.settle(collective, reduce_ints(collective, self.report()))

    def wait(self) -> None:
        """Synchronous: every write has run."""

    def release(self) -> None:
        """Nothing to give back."""


class StagedWriter(_HoldsFailures):
    """Local files and directories, written by Lightning into a staging sibling and moved into place by rank 0, with
    the flushes of ``durability`` in between (data before the rename, the directory after it). A move that fails is
    held, and removes what the boundary created."""

    def __init__(self, collective: Any, storage: Storage, durability: Durability) -> None:
        super().__init__(collective)
        self._storage, self._durability = storage, durability
        self._created: list[str] = []  # the names this boundary put in place anew (rank 0)
        # what this boundary's moves replaced, kept to put back (rank 0)
        self._replaced = Replacements(durability.flush_entries)
        # a file is written by rank 0 alone; a directory by every rank, each flushing what it sees once its part is in
        # (and the directories it made on the way: each rank notes what exists before its own write)
        self._writes_alone = not writes_directories(collective) and not is_rank_zero(collective)

    def open(self, before: Ledger | None) -> None:
        super().open(before)
        self._created, self._replaced = [], Replacements(self._durability.flush_entries)

    def close(self, published: bool, created: Sequence[str], remove: Remove) -> None:
        # a failed later write puts back what an earlier one replaced: the disk is the rolled-back ledger's again
        if published:
            self._release_previous(self._replaced.to_release())
        else:
            self._put_back(self._replaced.to_put_back())
        super().close(published, created, remove)

    def save(self, filepath: str, write: Write) -> None:
        staging = staging_path(filepath)
        rank_zero = is_rank_zero(self._collective)
        # at most two copies of a name at a time; but the copy this boundary keeps to put back stays (a name written
        # twice in one boundary: `filename="last"` with `save_last`)
        if rank_zero and self._held is None and not self._replaced.moved(filepath):
            # a failure (a reader's file held open inside it, on NFS) is held like a failed move: this boundary is
            # not put in place, and every rank raises at the next agreement, not rank 0 alone here
            self._hold_unpublishing(partial(self._storage.release_retired, filepath), filepath)
        flush = _nothing_to_flush if self._writes_alone else self._durability.before_writing(staging)
        try:
            write(staging, flush)
        except BaseException:
            if rank_zero:
                discard(staging)
            raise
        self._written.append(filepath)
        self._acted_alone = True  # rank 0's move into place follows
        if not rank_zero:
            return
        if os.path.lexists(staging):
            self._in_place(filepath, staging, partial(self._replaced.move_into_place, staging, filepath))
        else:  # only Lightning's own write is staged, and it leaves its file there: gone (another job's recovery
            # removed it) is a failed publication, held and raised on every rank, not a checkpoint the ledger lists
            self._hold_unpublishing(partial(_gone, staging), filepath)

    def link(self, target: str, linkpath: str, link: Link) -> None:
        if os.path.abspath(target) == os.path.abspath(linkpath):
            # `last` is the checkpoint just saved: ModelCheckpoint's own link leaves the file alone and runs its barrier
            link(target, linkpath)
            self._written.append(linkpath)
            return
        # made beside `linkpath` (same relative target) and renamed over it: `last` is never absent
        staging = staging_path(linkpath)
        link(target, staging)  # rank 0 links, then ModelCheckpoint's barrier
        self._written.append(linkpath)
        self._acted_alone = True  # rank 0's move into place follows
        if is_rank_zero(self._collective) and os.path.lexists(staging):
            self._in_place(linkpath, staging, partial(self._flush_and_move_into_place, staging, linkpath))

    def _in_place(self, filepath: str, staging: str, put: Callable[[], None]) -> None:
        """Rank 0 puts ``staging`` in place as ``filepath`` (``put``); a failure is held, and undoes the boundary."""
        if self._held is not None:
            discard(staging)
            return
        new = not os.path.lexists(filepath)
        if not self._hold_unpublishing(put, filepath):
            discard(staging)
        elif new:
            self._created.append(filepath)

    def _hold_unpublishing(self, act: Callable[[], None], path: str) -> bool:
        """Run ``act``, rank 0's step towards publishing ``path``; a failure is held with the boundary unpublished,
        and what the boundary created is removed (on rank 0 alone). Returns whether it succeeded."""
        if self._hold_failure_of(act, path, unpublished=True):
            return True
        _remove_all(self._created, discard)
        self._put_back(self._replaced.to_put_back())
        return False

    def _flush_and_move_into_place(self, staging: str, filepath: str) -> None:
        """A link made by rank 0 alone: flushed there (a copy, where the filesystem refuses links, holds data), then
        moved into place."""
        self._durability.flush_written(staging)
        self._replaced.move_into_place(staging, filepath)

    def _put_back(self, replaced: Sequence[str]) -> None:
        """Rank 0, the boundary unpublished: each replaced checkpoint back under its name, in the order given."""
        _each_warning_on_failure(replaced, self._replaced.restore,
                                 "Could not put back the checkpoint %s after a failed checkpoint write: %s")

    def _release_previous(self, replaced: Sequence[str]) -> None:
        """Rank 0, the boundary published: the kept files go (else before the name's next write, or at the end)."""
        _each_warning_on_failure(replaced, self._storage.release_retired,
                                 "Could not remove the replaced copy of %s: %s")


class DirectWriter(_HoldsFailures):
    """Writes at the real name, as ``ModelCheckpoint`` does (object storage, where one upload is atomic; a user's
    own ``CheckpointIO`` or ``save_checkpoint``, which gets exactly the path it is given). Only an eviction is done
    by rank 0 alone: its failure is held. A name an earlier write of a failed boundary replaced is not put back
    (keeping a copy would cost a server-side copy of every replaced object, each save): rank 0 says which."""

    def close(self, published: bool, created: Sequence[str], remove: Remove) -> None:
        replaced = [path for path in dict.fromkeys(self._written) if path not in created]
        if not published and replaced and is_rank_zero(self._collective):
            log.warning("FiniteGradCheckpoint: the checkpoint write failed after %s had been replaced in the same "
                        "boundary: %s the checkpoint of that unpublished boundary, while the callback's records went "
                        "back to before it (written at the name itself, the replaced one was not kept).",
                        ", ".join(replaced), "it holds" if len(replaced) == 1 else "they hold")
        super().close(published, created, remove)

    def save(self, filepath: str, write: Write) -> None:
        write(filepath, _nothing_to_flush)  # the upload, or the user's own IO, is the publication
        self._written.append(filepath)

    def link(self, target: str, linkpath: str, link: Link) -> None:
        link(target, linkpath)
        self._written.append(linkpath)


class BackgroundWriter:
    """Under Lightning's ``AsyncCheckpointIO``: each accepted boundary's storage operations as one unit, run in
    acceptance order on the guard's one publication thread; the plugin is called as ``ModelCheckpoint`` calls it."""

    def __init__(self, collective: Any, plugin: Any, durability: Durability) -> None:
        self._collective = collective
        self._writes = PluginWrites.install(plugin)
        self._owns_writes = True  # until given back, once: at teardown, or at the end of a fit that raised
        self._publisher = BackgroundPublisher(durability)
        self._unit: PublicationUnit | None = None

    def open(self, before: Ledger | None) -> None:
        assert before is not None  # a Trainer's boundary: its ledger
        self._unit = self._publisher.open_unit(before)
        self._writes.unit = self._unit  # the plugin's removals of this boundary wait in its unit

    def save(self, filepath: str, write: Write) -> None:
        unit, writes = self._unit, self._writes
        assert unit is not None
        expected = writes.expect(filepath) if is_rank_zero(self._collective) else None  # rank 0 calls the plugin
        try:
            write(filepath, _nothing_to_flush)  # the plugin hands the checkpoint over; its unit writes and flushes
        except BaseException:
            if expected is not None:
                # the plugin may have queued the write before raising (an earlier write's error): its thread then
                # hands the checkpoint to this expected write, which nobody takes, and never writes it at its name
                writes.disarm(filepath, expected)
            raise
        if expected is not None:
            writes.disarm(filepath, expected)  # only this call of the plugin was the boundary's
            unit.write(expected.staging, writes.writer(filepath, expected))
            unit.publish(expected.staging, filepath)

    def link(self, target: str, linkpath: str, link: Link) -> None:
        assert self._unit is not None
        if is_rank_zero(self._collective) and os.path.abspath(target) != os.path.abspath(linkpath):
            self._unit.link(target, linkpath)  # once the target is published, in the boundary's unit
        barrier(self._collective, "ModelCheckpoint._link_checkpoint")  # the collective ModelCheckpoint's link ends with

    def remove(self, path: str, remove: Remove) -> None:
        remove(path)  # the plugin is called now, as by ModelCheckpoint; the removal itself waits in the unit

    def close(self, published: bool, created: Sequence[str], remove: Remove) -> None:
        unit, self._unit = self._unit, None
        self._writes.unit = None
        if published and unit is not None:
            self._publisher.submit(unit)  # queued behind the boundaries accepted before it

    def report(self) -> list[int]:
        return self._publisher.report(self._collective)

    def settle(self, collective: Any, reduced: Sequence[int]) -> WriteFailure | None:
        return self._publisher.settle(collective, reduced)

    def finish(self, collective: Any, during_exception: bool,
               reduced: Sequence[int] | None = None) -> WriteFailure | None:
        try:
            self._publisher.wait()
            if during_exception:
                return self._publisher.local_failure()
            if reduced is None:
                reduced = reduce_ints(collective, self.report())
            return self._publisher.settle(collective, reduced)
        finally:
            self._publisher.close()
            if during_exception:  # Lightning runs no teardown after an exception: the plugin is given back now
                self._give_back_plugin()

    def wait(self) -> None:
        self._publisher.wait()

    def release(self) -> None:
        self._publisher.close()
        self._give_back_plugin()

    def _give_back_plugin(self) -> None:
        """This writer is done with the plugin (once): the last of a fit's writers gives it back its own IO, so the
        next fit with it (a new Trainer, or this one fitted again) finds Lightning's and publishes in the
        background."""
        if self._owns_writes:
            self._owns_writes = False
            self._writes.uninstall()


def _nothing_to_flush(path: str) -> None:
    """What a write that is not staged flushes: nothing."""


def _remove_all(paths: Iterable[str], remove: Remove) -> None:
    _each_warning_on_failure(paths, remove, "Could not remove %s after a failed checkpoint write: %s")


def _each_warning_on_failure(paths: Iterable[str], act: Callable[[str], None], message: str) -> None:
    each_warning_on_failure(paths, act, message, log)


def writes_as_lightning(io: Any, torch_checkpoint_io: type[Any]) -> bool:
    """Whether ``io`` saves by ``torch_checkpoint_io``'s own ``save_checkpoint`` (Lightning's or Fabric's
    ``TorchCheckpointIO``): it writes exactly the path it is given and nothing else, so a staging name stays invisible.
    A user's override (a sidecar file beside the checkpoint, an upload, a log line naming the path) gets the real name,
    as under ``ModelCheckpoint``."""
    if isinstance(io, PluginWrites):  # a guard's, left under an AsyncCheckpointIO: what it writes with
        io = io.base
    own = torch_checkpoint_io.save_checkpoint
    save = getattr(io, "save_checkpoint", None)
    return isinstance(io, torch_checkpoint_io) and getattr(save, "__func__", None) is own


def choose_writer(collective: Any, storage: Storage, durability: Durability, *, in_background: Any | None,
                  writes_through_lightning: bool, staged_io: bool) -> Writer:
    """The write path of one fit (the same on every rank): ``in_background`` is the Trainer's ``AsyncCheckpointIO``
    when its writes can be published in the background; ``writes_through_lightning`` says the Trainer's own
    ``save_checkpoint`` writes (not one the user replaced); ``staged_io`` that its checkpoint IO writes exactly the
    path it is given (Lightning's own, or a strategy that writes directories). ``durability`` applies to what is
    staged and renamed; a direct write is published as its writer leaves it."""
    if in_background is not None:
        return BackgroundWriter(collective, in_background, durability)
    if storage.stages_writes and writes_through_lightning and staged_io:
        return StagedWriter(collective, storage, durability)
    return DirectWriter(collective)


__all__ = [
    "BackgroundWriter", "DirectWriter", "StagedWriter", "WriteFailure", "Writer", "choose_writer",
    "writes_as_lightning",
]
