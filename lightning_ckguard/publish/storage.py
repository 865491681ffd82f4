"""Where a fit's checkpoints live: the local filesystem, or object storage (any fsspec filesystem that is not local).

The kind is chosen once per fit (:func:`storage_for`, from ``dirpath``'s filesystem) and becomes an object; the
callback asks its storage, never which kind it is. Each method that differs from ``ModelCheckpoint`` on one kind only
takes ``ModelCheckpoint``'s own answer (``fallback``) and returns it where ``ModelCheckpoint`` is right.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from lightning_ckguard._distributed import barrier, is_rank_zero
from lightning_ckguard.publish.remote import (
    existed_before_write,
    exists_on_every_rank,
    newest_last_checkpoint,
    removal_allowed,
    unsupported_strategy_error,
)
from lightning_ckguard.publish.seal import agree_on_write
from lightning_ckguard.publish.staging import (
    checkpoint_is_complete,
    is_local,
    recover,
    release_all_retired,
    release_retired,
)


class LocalStorage:
    """A ``dirpath`` on the local filesystem: a rename publishes, and hidden siblings are recovered after a crash."""

    #: Whether a write can be staged beside its name and moved into place by one rename.
    stages_writes = True

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def existed(self, path: str) -> bool:
        """Whether ``path`` exists before a boundary writes it (what a failed write's rollback leaves)."""
        return bool(self.fs.exists(path))

    def holds_checkpoint(self, path: str) -> bool:
        """Whether ``path`` holds a whole checkpoint (one cut off by a crash does not count)."""
        return bool(self.fs.exists(path)) and checkpoint_is_complete(path)

    def file_exists(self, strategy: Any, path: str, fallback: Callable[[], bool], removed: Sequence[str] = ()) -> bool:
        """``ModelCheckpoint.file_exists`` (``fallback``), right on local disk, but for a link to a checkpoint
        ``ModelCheckpoint`` would have removed by now (``removed``: one kept here, the file a fit resumed from, or an
        eviction waiting for the boundary's writes): for ``ModelCheckpoint`` it dangles and does not exist, so a
        ``last`` link to it is moved, not kept beside a new ``last-v1`` (rank 0 looks, in the same one collective)."""
        if not removed:
            return fallback()
        seen = strategy.is_global_zero and bool(self.fs.exists(path))
        local = seen and not _links_to(path, removed)
        return bool(strategy.reduce_boolean_decision(local, all=False))

    def resumed_checkpoint(self, path: str) -> str:
        """At the fit's start: the file it resumed from, with links resolved (``ckpt_path="last"`` names the ``last``
        link, which later boundaries move, and ``ModelCheckpoint`` would then evict the file it pointed to)."""
        return os.path.realpath(path)

    def removal_allowed(self, previous: str, current: str, dirpath: str | None, resumed_from: str | None,
                        fallback: Callable[[], bool], removed: Sequence[str] = ()) -> bool:
        """``ModelCheckpoint._should_remove_checkpoint`` (``fallback``), and never the file the fit resumed from
        (``resumed_from``, as :meth:`resumed_checkpoint` resolved it), whatever link it was resumed through. A link to
        a checkpoint ``ModelCheckpoint`` would have removed by now (``removed``: kept here) dangles for
        ``ModelCheckpoint``, whose removal then removes nothing: it stays, as it would there."""
        # a link is removed as ModelCheckpoint removes it (no checkpoint goes with it), the file it points to never
        if resumed_from is not None and not os.path.islink(previous) and os.path.realpath(previous) == resumed_from:
            return False
        return fallback() and not _links_to(previous, removed)

    def last_checkpoints(self, dirpath: str, rank: int, is_last_name: Callable[[str], bool],
                         fallback: Callable[[], set[str]], fitting: bool = True) -> set[str]:
        """Candidates for ``ckpt_path="last"``: ``ModelCheckpoint``'s listing (``fallback``), after resolving what an
        interrupted publication left (every rank may run it at once). Not for another stage (``fitting=False``): a
        ``test`` job may run beside the training that writes there."""
        actions = recover(dirpath) if fitting else []
        if actions:  # whichever rank got there first did it: that rank says so
            warnings.warn(f"FiniteGradCheckpoint (rank {rank}) {'; '.join(actions)}.", stacklevel=3)
        return fallback()

    def refuse_strategy(self, strategy: Any, dirpath: str | None) -> None:
        """Every strategy writes to local disk."""

    def prepare(self, strategy: Any, dirpath: str | None, writable_error: Callable[[], Exception | None],
                warn: Callable[[str], None], carried: Sequence[int] = (), owner: str = "FiniteGradCheckpoint",
                subdirectories: bool = True) -> tuple[int, ...] | None:
        """At setup, on every rank: rank 0 recovers what a crash left; every rank checks that it can write (agreed,
        so it is also the barrier after the recovery: no rank restores before the files are back). ``carried`` rides
        in that agreement: returns the largest of each over the ranks; None where nothing is prepared (a barrier).
        ``owner`` names who recovers in the warnings; ``subdirectories=False``: only ``dirpath``'s own entries (a
        writer whose names never lie in a subdirectory must not touch another's there)."""
        if dirpath is None:
            barrier(strategy, "FiniteGradCheckpoint.recover")
            return None
        failure: Exception | None = None
        if is_rank_zero(strategy):
            try:
                for action in recover(dirpath, subdirectories):
                    warn(f"{owner} {action}.")
            except Exception as error:  # raised on every rank by the agreement below, not on rank 0 alone
                failure = error
        return agree_on_write(strategy, failure or writable_error(), dirpath, carried)

    def release_retired(self, path: str) -> None:
        """Remove the copy of ``path`` that replacing it kept for readers (rank 0)."""
        release_retired(path)

    def release_all_retired(self, dirpath: str | None) -> None:
        """At the end of a fit (rank 0): remove every copy kept for readers."""
        if dirpath is not None:
            release_all_retired(dirpath)

    def rewind_log_dir(self, dirpath: str | None) -> str | None:
        """Where the rewind log is written: ``dirpath`` itself."""
        return dirpath


class ObjectStorage:
    """A ``dirpath`` on object storage (``s3://...``) or any non-local fsspec filesystem: one upload publishes a whole
    object, and the removal and ``last`` rules of local disk apply (:mod:`~lightning_ckguard.publish.remote`)."""

    stages_writes = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def existed(self, path: str) -> bool:
        """Whether ``path`` exists before a write (assumed so when the store cannot say: never rolled back)."""
        return existed_before_write(self.fs, path)

    def holds_checkpoint(self, path: str) -> bool:
        """Whether an object is there (an upload is whole or absent)."""
        return bool(self.fs.exists(path))

    def file_exists(self, strategy: Any, path: str, fallback: Callable[[], bool], removed: Sequence[str] = ()) -> bool:
        """Rank 0 looks; a failed look raises on every rank, in the one collective ``ModelCheckpoint`` makes (object
        storage has no links: ``removed`` changes nothing)."""
        return exists_on_every_rank(strategy, self.fs, path, strategy.is_global_zero)

    def resumed_checkpoint(self, path: str) -> str:
        """At the fit's start: the object it resumed from (object storage has no links)."""
        return path

    def removal_allowed(self, previous: str, current: str, dirpath: str | None, resumed_from: str | None,
                        fallback: Callable[[], bool], removed: Sequence[str] = ()) -> bool:
        """The rule ``ModelCheckpoint`` applies on local disk (it would remove any path here, Lightning #21813);
        object storage has no links: ``removed`` changes nothing."""
        return removal_allowed(self.fs, previous, current, dirpath, resumed_from)

    def last_checkpoints(self, dirpath: str, rank: int, is_last_name: Callable[[str], bool],
                         fallback: Callable[[], set[str]], fitting: bool = True) -> set[str]:
        """The newest ``last`` as a full URL (``ModelCheckpoint`` would list protocol-less paths, then look them up on
        the local disk)."""
        return newest_last_checkpoint(self.fs, dirpath, is_last_name)

    def refuse_strategy(self, strategy: Any, dirpath: str | None) -> None:
        """On every rank, before anything is written: refuse a strategy that would write to local paths instead."""
        unsupported = unsupported_strategy_error(strategy, str(dirpath))
        if unsupported is not None:
            raise unsupported

    def prepare(self, strategy: Any, dirpath: str | None, writable_error: Callable[[], Exception | None],
                warn: Callable[[str], None], carried: Sequence[int] = (), owner: str = "FiniteGradCheckpoint",
                subdirectories: bool = True) -> tuple[int, ...] | None:
        """At setup, on every rank: nothing to recover; the barrier every kind runs here (nothing carried: None)."""
        barrier(strategy, "FiniteGradCheckpoint.recover")
        return None

    def release_retired(self, path: str) -> None:
        """Nothing is kept for readers on object storage."""

    def release_all_retired(self, dirpath: str | None) -> None:
        """Nothing is kept for readers on object storage."""

    def rewind_log_dir(self, dirpath: str | None) -> str | None:
        """None: the rewind log is written on local filesystems only."""
        return None


Storage = LocalStorage | ObjectStorage


def storage_for(fs: Any) -> Storage:
    """The storage of a ``dirpath`` on filesystem ``fs`` (an fsspec filesystem)."""
    return LocalStorage(fs) if is_local(fs) else ObjectStorage(fs)


__all__ = ["LocalStorage", "ObjectStorage", "Storage", "storage_for"]


def _links_to(path: str, removed: Sequence[str]) -> bool:
    """Whether ``path`` is a link to one of the checkpoints ``removed`` (for ``ModelCheckpoint``, a dangling link)."""
    return bool(removed) and os.path.islink(path) and os.path.realpath(path) in {os.path.realpath(p) for p in removed}
