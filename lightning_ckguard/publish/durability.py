"""Durable publication: a published checkpoint survives a machine crash (power loss, kernel panic), not only a
killed process.

A rename is atomic for every process that reads the page cache. After a machine crash the disk holds only what was
flushed, so a name renamed into place over unflushed data can come back empty or cut off, while the checkpoint it
replaced, or the one evicted right after, is already gone. The order that prevents it (SQLite's atomic commit; Pillai
et al., "All File Systems Are Not Created Equal", OSDI 2014):

1. the data of every file of a staging entry is flushed after its last write, and the entries of the staging
   directory and its subdirectories, all before the rename (:meth:`Durability.flush_written`, on every rank that wrote
   part of it, before the write's outcome is agreed: a flush that fails is a failed write, on every rank). A write
   that created directories on the way to its name (a new ``dirpath``, a ``filename`` with a ``/``) also flushes the
   entry of each in its parent (:meth:`Durability.before_writing` notes, before the write, what exists): until then
   a crash can take the new directory, and the checkpoint in it, away. A ``last`` link is staged too: a symbolic
   link holds no data, but the copy made where the filesystem refuses links is a file, flushed like one;
2. after the rename, the directory that holds the name is flushed (:meth:`Durability.flush_entries`), before any
   eviction and before the boundary returns.

The mode is chosen once per fit (:func:`durability`): :class:`Flushing` by default, :class:`NotFlushing` for scratch
storage. Object storage needs neither: a completed upload is durable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Protocol


class Durability(Protocol):
    """What the writers flush, and when; one is chosen per fit, identically on every rank."""

    def flush_written(self, path: str) -> None:
        """``path`` (a staging file, directory or link) was written: flush its data and its directories' entries."""

    def before_writing(self, path: str) -> Callable[[str], None]:
        """``path`` is about to be written: the flush to run on it once it is (:meth:`flush_written`, then the entry
        of each directory that the write created above it, in its parent)."""

    def flush_entries(self, directory: str) -> None:
        """A name in ``directory`` was renamed into place (or linked): flush the directory's entries."""

    def making_directory(self, directory: str) -> Callable[[], None]:
        """``directory`` (and any missing parent) is about to be made: the flush to run once it is (each new
        directory's entry, in its parent)."""


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_directory(path: str) -> None:
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


class Flushing:
    """``fsync`` of the data before a rename, and of the directory after it."""

    def flush_written(self, path: str) -> None:
        if os.path.islink(path):
            return  # a symbolic link holds no data; its directory entry is flushed after the rename
        if not os.path.isdir(path):
            if os.path.exists(path):  # a checkpoint IO that wrote elsewhere left nothing to flush
                _fsync(path)
            return
        # every file, then each directory after what is inside it, the staging directory itself last
        for root, _, files in os.walk(path, topdown=False):
            for name in files:
                _flush_file_if_present(os.path.join(root, name))
            _fsync_directory(root)

    def before_writing(self, path: str) -> Callable[[str], None]:
        # what exists now was not made by this write: the directories below it were (one stat when none is made)
        return partial(self._flush_written_under, _nearest_existing(os.path.dirname(os.path.abspath(path))))

    def _flush_written_under(self, existing: str, path: str) -> None:
        """:meth:`flush_written`, then the parent of each directory made since ``existing`` was noted, up to it."""
        self.flush_written(path)
        _flush_made_directories(existing, os.path.dirname(os.path.abspath(path)))

    def making_directory(self, directory: str) -> Callable[[], None]:
        directory = os.path.abspath(directory)
        return partial(_flush_made_directories, _nearest_existing(directory), directory)

    def flush_entries(self, directory: str) -> None:
        _fsync_directory(directory or ".")


def _flush_made_directories(existing: str, directory: str) -> None:
    """The entry of ``directory`` and of each directory above it made since ``existing`` was noted, in its parent."""
    while directory != existing and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
        _fsync_directory(directory)


def _nearest_existing(directory: str) -> str:
    """``directory`` (absolute) if it exists, else its nearest ancestor that does."""
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    return directory


def _flush_file_if_present(path: str) -> None:
    if os.path.islink(path):
        return
    try:
        _fsync(path)
    except FileNotFoundError:
        pass  # renamed or removed by its writer while the tree was listed: nothing is left to flush under it


class NotFlushing:
    """No flush at all (``durable=False``): the ``kill -9`` guarantee only, for scratch storage."""

    def flush_written(self, path: str) -> None:
        """Nothing to do."""

    def before_writing(self, path: str) -> Callable[[str], None]:
        """Nothing to note (no system call): nothing to flush."""
        return self.flush_written

    def flush_entries(self, directory: str) -> None:
        """Nothing to do."""

    def making_directory(self, directory: str) -> Callable[[], None]:
        """Nothing to note (no system call): nothing to flush."""
        return _nothing


def _nothing() -> None:
    """No flush."""


def durability(durable: bool) -> Durability:
    """The durability of one fit: :class:`Flushing` when ``durable``, else :class:`NotFlushing`."""
    return Flushing() if durable else NotFlushing()


__all__ = ["Durability", "Flushing", "NotFlushing", "durability"]
