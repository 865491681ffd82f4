"""Atomic publication of checkpoints on a local filesystem: files, directories (DeepSpeed, FSDP2 distributed
checkpoints, sharded FSDP) and ``last`` links.

A directory is written by every rank, file by file, so a crash mid-save would leave a partial directory under the
final name. A single file is serialized in memory by Lightning and written through an fsspec transaction, but that
transaction writes a temporary file in ``$TMPDIR`` and *moves* it into place: when ``$TMPDIR`` is on another
filesystem than the checkpoint, the move is a copy, and a crash during it leaves a truncated file under the final
name. So every write goes to a hidden staging sibling in the same directory; once every rank is done (Lightning's
post-save barrier), rank 0 moves it into place, and only then are evictions and links performed.

How the move replaces what is there (:func:`move_into_place`):

- a file or a link: one ``os.replace``, so the name is never absent; the staged writer first gives the file it
  replaces a second name (:func:`keep_previous_file`, a hard link) until the boundary ends, so that a later write of
  the same boundary that fails can put it back (:func:`restore_previous`; a replaced directory is put back from its
  retired copy, below);
- a directory, on Linux where the checkpoint's own filesystem supports ``renameat2(RENAME_EXCHANGE)`` (ext4, xfs,
  btrfs, tmpfs; probed once per filesystem): the new and the old directory swap names in one step, so the name is
  never absent either; the old one is then renamed to a retired name;
- a directory elsewhere (NFS, other systems): the old one is renamed aside first, to the retired name, then the new
  one moved in; between the two renames the name is briefly absent, with the old checkpoint recoverable.

A retired directory is kept until the name is written again (:func:`release_retired`, before the next write into its
staging sibling) or the fit ends (:func:`release_all_retired`), not removed right after the swap: a reader resolves a
path one component at a time, and one that entered the old directory just before the swap would otherwise find its
files being deleted under it (an empty listing, a file that vanished), though the name itself was never absent. A
boundary that fails after it replaced a directory puts the retired copy back under its name (:func:`restore_previous`).

A crash leaves at worst a staging entry (a checkpoint never published, or the old one an exchange just replaced), or
a retired copy of the checkpoint being replaced; both are resolved by :func:`recover` when training starts again
(before ``ckpt_path="last"`` is resolved, and in ``setup``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
import sys
import zipfile
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from lightning_ckguard._distributed import is_deepspeed_strategy

STAGING_SUFFIX = ".ckguard-staging"
RETIRED_SUFFIX = ".ckguard-retired"


def writes_directories(strategy: Any) -> bool:
    """Whether ``strategy`` writes a checkpoint as a directory that every rank fills."""
    return (
        is_deepspeed_strategy(strategy)
        or bool(getattr(strategy, "_save_distributed_checkpoint", False))
        or getattr(strategy, "_state_dict_type", None) == "sharded"
    )


def uses_distributed_checkpoint(strategy: Any) -> bool:
    """Whether ``strategy`` saves and loads its directory checkpoints through ``torch.distributed.checkpoint``:
    Lightning's FSDP and model-parallel strategies (DeepSpeed writes its own)."""
    return not is_deepspeed_strategy(strategy) and (
        hasattr(strategy, "_save_distributed_checkpoint") or hasattr(strategy, "_state_dict_type"))


def _hidden_sibling(filepath: str, suffix: str) -> str:
    head, tail = os.path.split(filepath)
    return os.path.join(head, f".{tail}{suffix}")


def _hidden_for(name: str, suffix: str) -> str | None:
    """The checkpoint name a hidden sibling ``name`` (made by :func:`_hidden_sibling` with ``suffix``) stands for,
    or None when ``name`` is not one."""
    return name[1 : -len(suffix)] if name.startswith(".") and name.endswith(suffix) else None


def staging_path(filepath: str) -> str:
    """The hidden sibling that ``filepath`` is written into before it is published."""
    return _hidden_sibling(filepath, STAGING_SUFFIX)


def published_path(path: str) -> str:
    """The name a staging path is published under (any other path is returned unchanged), for messages."""
    head, tail = os.path.split(path)
    name = _hidden_for(tail, STAGING_SUFFIX)
    return path if name is None else os.path.join(head, name)


def _retired_path(filepath: str) -> str:
    return _hidden_sibling(filepath, RETIRED_SUFFIX)


def is_local(fs: Any) -> bool:
    """Whether ``fs`` (an fsspec filesystem) is the local one, where ``rename`` publishes atomically."""
    return isinstance(fs, LocalFileSystem)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# renameat2's syscall number, for a C library without the wrapper (glibc before 2.28)
_RENAMEAT2_SYSCALL = {"x86_64": 316, "aarch64": 276}


def _load_renameat2() -> Callable[[str, str], None] | None:
    """``renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)`` as a Python function, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    number = _RENAMEAT2_SYSCALL.get(platform.machine())
    if function is None and number is None:
        return None

    def exchange(a: str, b: str) -> None:
        paths = (os.fsencode(a), os.fsencode(b))
        if function is not None:
            result = function(_AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_EXCHANGE)
        else:
            result = libc.syscall(number, _AT_FDCWD, paths[0], _AT_FDCWD, paths[1], _RENAME_EXCHANGE)
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), a, None, b)

    return exchange


_renameat2 = _load_renameat2()
#: Whether the exchange works, per filesystem (``st_dev``): probed once, on the checkpoint's own directory.
_exchange_support: dict[int, bool] = {}


def _exchange(a: str, b: str) -> None:
    """Swap the names ``a`` and ``b`` in one step (both must exist)."""
    assert _renameat2 is not None
    _renameat2(a, b)


def supports_exchange(directory: str) -> bool:
    """Whether entries in ``directory`` can swap names atomically (``renameat2`` with ``RENAME_EXCHANGE``).

    Probed once per filesystem with two empty entries named like staging entries (so that a crash during the probe
    leaves nothing :func:`recover` does not remove), and cached.
    """
    if _renameat2 is None:
        return False
    device = os.stat(directory).st_dev
    if device not in _exchange_support:
        probes = [os.path.join(directory, f".ckguard-probe-{os.getpid()}-{side}{STAGING_SUFFIX}") for side in "ab"]
        try:
            for probe in probes:
                os.makedirs(probe, exist_ok=True)
            _exchange(*probes)
            _exchange_support[device] = True
        except OSError as error:
            # EINVAL: the filesystem does not support the flag; ENOSYS: the kernel lacks the call
            if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                raise
            _exchange_support[device] = False
        finally:
            for probe in probes:
                if os.path.isdir(probe):
                    os.rmdir(probe)
    return _exchange_support[device]


def _is_directory(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def move_into_place(staging: str, filepath: str, keep_retired: bool = False) -> bool:
    """Publish ``staging`` as ``filepath``, replacing an existing checkpoint of that name (rank 0 only). Returns
    whether the replaced checkpoint was retired (a directory on either side): kept under its retired name.

    A file or link replaces a file or link by one ``os.replace``: ``filepath`` is never absent. Where a directory is
    involved, its entries swap names in one step where the filesystem supports it (:func:`supports_exchange`);
    elsewhere the old checkpoint is renamed aside first, so at every instant ``filepath`` is either the old complete
    checkpoint, absent (with the old one recoverable), or the new one. Either way the old directory is kept under its
    retired name until :func:`release_retired` or :func:`release_all_retired`, and a move that fails half-way puts
    the old one back under its name (``staging`` then still holds the new one). With ``keep_retired`` (the name was
    replaced earlier in the same boundary, and its retired copy is what a failure of the boundary puts back:
    :func:`restore_previous`), that copy is left alone and the entry at the name, the boundary's own earlier write,
    is removed instead (without an exchange, before the move: the name is absent meanwhile, and a crash then leaves
    the retired copy, which :func:`recover` restores). A file never replaces a directory (a link does, as
    ``ModelCheckpoint``'s replaces one): that raises ``IsADirectoryError`` with both left as they are.
    """
    if not os.path.lexists(filepath) or not (_is_directory(staging) or _is_directory(filepath)):
        os.replace(staging, filepath)
        return False
    if not (_is_directory(staging) or os.path.islink(staging)):  # a file never replaces a directory: none wrote it
        raise IsADirectoryError(errno.EISDIR, "A checkpoint file would replace this directory, which holds no "
                                "checkpoint of this fit: it is left as it is, remove or rename it", filepath)
    exchange = supports_exchange(os.path.dirname(os.path.abspath(filepath)))
    if keep_retired:
        if exchange:
            _exchange(staging, filepath)  # the boundary's earlier write is now under the staging name
            _remove(staging)
        else:
            _remove(filepath)
            os.replace(staging, filepath)
        return False
    retired = _retired_path(filepath)
    _remove(retired)  # normally released already, before this write began
    _swap_aside(staging, filepath, retired, exchange)
    # the old directory stays, retired, for readers already inside it (module docstring)
    return True


def _swap_aside(new: str, filepath: str, aside: str, exchange: bool) -> None:
    """Put ``new`` at ``filepath`` and what was there at ``aside`` (which must not exist), by an exchange where the
    filesystem has one, else by two renames; a failure of the second step undoes the first, so that ``filepath``
    holds what it held and ``new`` is where it was."""
    if exchange:
        _exchange(new, filepath)  # ``new`` published; the old entry is under ``new``'s name
        undo = partial(_exchange, new, filepath)
        second = partial(os.replace, new, aside)
    else:
        os.replace(filepath, aside)
        undo = partial(os.replace, aside, filepath)
        second = partial(os.replace, new, filepath)
    try:
        second()
    except BaseException:
        undo()
        raise


def keep_previous_file(filepath: str) -> bool:
    """Before a file or link at ``filepath`` is replaced (rank 0 only): a second name for it, its retired name (a
    hard link: no data is copied), so that a boundary failing after the replacement can put it back
    (:func:`restore_previous`). Returns whether one was made: not for a directory (whose move keeps its own retired
    copy) or a missing name, nor where the filesystem has no hard links (the replacement then cannot be undone)."""
    if not os.path.lexists(filepath) or _is_directory(filepath):
        return False
    retired = _retired_path(filepath)
    _remove(retired)
    try:
        os.link(filepath, retired, follow_symlinks=False)
    except (OSError, NotImplementedError):  # no hard links here (NotImplementedError: no linkat on this platform)
        return False
    return True


def restore_previous(filepath: str) -> None:
    """Put back what :func:`keep_previous_file` or a :func:`move_into_place` that retired it kept of ``filepath``
    (rank 0 only): a file or link in one ``os.replace``; where a directory is on either side, the two swap names (an
    exchange where the filesystem has one, else two renames by way of the staging name) and the failed boundary's
    entry is removed. Where ``filepath`` still is that file (its replacement failed), the retired name is only
    removed: a rename between two names of one file does nothing (POSIX), and would leave the retired name behind."""
    retired = _retired_path(filepath)
    if _same_entry(retired, filepath):
        os.remove(retired)
        return
    os.lstat(retired)  # nothing kept (removed by someone else): FileNotFoundError, and the name is left as it is
    if not os.path.lexists(filepath) or not (_is_directory(retired) or _is_directory(filepath)):
        os.replace(retired, filepath)
        return
    aside = staging_path(filepath)
    _remove(aside)  # a failed write's staging entry is discarded already; nothing else uses this name now
    _swap_aside(retired, filepath, aside, supports_exchange(os.path.dirname(os.path.abspath(filepath))))
    _remove(aside)


class Replacements:
    """The checkpoints one boundary's moves into place replace (rank 0), kept so that a failure later in the same
    boundary can put them back (:func:`restore_previous`): a file or link under a second name
    (:func:`keep_previous_file`, a hard link), a directory as the retired copy its move keeps anyway. Only a name's
    first move in the boundary keeps anything, and only where the name existed before it: a later move of the same
    name (``filename="last"`` with ``save_last``) replaces the boundary's own earlier write, and a name the boundary
    created has nothing to put back. One per boundary; ``flush_entries(directory)`` follows each move and each
    put-back (the directory holding the name, made durable before anything else happens in it)."""

    def __init__(self, flush_entries: Callable[[str], None]) -> None:
        self._flush_entries = flush_entries
        self._moved: set[str] = set()
        self._kept: list[str] = []  # in the order first replaced
        self._retired_directories: set[str] = set()

    def moved(self, filepath: str) -> bool:
        """Whether this boundary moved a checkpoint to ``filepath`` already (so what it keeps of the name stays)."""
        return filepath in self._moved

    def move_into_place(self, staging: str, filepath: str) -> None:
        """:func:`move_into_place`, keeping what the name held before the boundary, on its first move only."""
        first = filepath not in self._moved
        self._moved.add(filepath)
        if first and keep_previous_file(filepath):
            self._kept.append(filepath)
        if move_into_place(staging, filepath, keep_retired=not first) and first:
            if filepath not in self._kept:  # a file replaced by a directory is retired, not linked
                self._kept.append(filepath)
            self._retired_directories.add(filepath)
        self._flush_entries(os.path.dirname(filepath))

    def restore(self, filepath: str) -> None:
        """:func:`restore_previous` of one of :meth:`to_put_back`'s names."""
        restore_previous(filepath)
        self._flush_entries(os.path.dirname(filepath))

    def to_put_back(self) -> list[str]:
        """The boundary failed: the names whose kept checkpoint goes back, newest first; forgets them."""
        kept, self._kept = self._kept, []
        return kept[::-1]

    def to_release(self) -> list[str]:
        """The boundary was published: the names whose kept file can go now (a retired directory stays for readers
        inside it, until its name's next write or the fit's end); forgets them."""
        kept, self._kept = self._kept, []
        return [path for path in kept if path not in self._retired_directories]


def _same_entry(first: str, second: str) -> bool:
    """Whether ``first`` and ``second`` are two names of one file or link (links not followed)."""
    try:
        one, other = os.lstat(first), os.lstat(second)
    except FileNotFoundError:
        return False
    return (one.st_ino, one.st_dev) == (other.st_ino, other.st_dev)


def release_retired(filepath: str) -> None:
    """Remove the retired copy of ``filepath`` that :func:`move_into_place` kept, if any (rank 0 only): before the
    next write of that name, so that at most two copies of it exist at any time, and when it is evicted."""
    _remove(_retired_path(filepath))


def release_all_retired(dirpath: str) -> list[str]:
    """At the end of a fit (rank 0 only, nothing being written): remove every retired copy under ``dirpath``
    (subdirectories included) whose checkpoint is published, so the directory holds what ``ModelCheckpoint`` leaves.
    Returns the paths removed."""
    removed = []
    for directory, name in _hidden_entries(dirpath):
        checkpoint = _hidden_for(name, RETIRED_SUFFIX)
        if checkpoint is not None and os.path.lexists(os.path.join(directory, checkpoint)):
            _remove(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
    return removed


def _is_hidden_entry(name: str) -> bool:
    return any(_hidden_for(name, suffix) is not None for suffix in (STAGING_SUFFIX, RETIRED_SUFFIX))


def _hidden_entries(dirpath: str, subdirectories: bool = True) -> Iterator[tuple[str, str]]:
    """``(directory, name)`` of every staging or retired entry under ``dirpath``, a directory's in name order.

    A ``filename`` with a ``/`` puts checkpoints, and so their hidden siblings, in subdirectories of ``dirpath``, so
    the whole tree is walked (nothing but directory listings: a checkpoint is never opened). Hidden entries are
    resolved whole, never entered; symbolic links are not followed (what they point to is not this fit's); a
    directory that vanishes meanwhile (another rank resolved it) is skipped. Lazy: a directory's entries are resolved
    before the walk lists its subdirectories' contents. ``subdirectories=False``: ``dirpath``'s own entries only."""
    for directory, entered, files in os.walk(dirpath):
        yield from ((directory, name) for name in sorted(filter(_is_hidden_entry, [*entered, *files])))
        entered[:] = [name for name in entered if subdirectories and not _is_hidden_entry(name)]


def make_link(target: str, linkpath: str) -> None:
    """Make ``linkpath`` a symbolic link to ``target`` by a relative path, as ``ModelCheckpoint`` links ``last``; a
    copy where the system refuses links."""
    _remove(linkpath)
    try:
        os.symlink(os.path.relpath(target, os.path.dirname(linkpath)), linkpath)
    except OSError:
        shutil.copy(target, linkpath)


def discard(staging: str) -> None:
    """Remove a staging directory after a failed write (rank 0 only)."""
    _remove(staging)


def checkpoint_is_complete(path: str) -> bool:
    """Whether ``path`` holds a whole checkpoint, judged cheaply from markers its writer puts down last (nothing is
    loaded). Unknown formats (a custom ``CheckpointIO``) count as complete; only evidence of a cut-off write does not:

    - a file: empty, or a zip archive (``torch.save``'s format) whose central directory at the end is missing;
    - a directory: empty; distributed-checkpoint shards (``*.distcp``) without the ``.metadata`` the coordinator writes
      after them; a DeepSpeed checkpoint (``zero_to_fp32.py``) without its ``latest`` tag file.
    """
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if not names:
            return False
        if any(name.endswith(".distcp") for name in names) and ".metadata" not in names:
            return False
        return not ("zero_to_fp32.py" in names and "latest" not in names)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return False
    return head != b"PK\x03\x04" or zipfile.is_zipfile(path)


def recover(dirpath: str, subdirectories: bool = True) -> list[str]:
    """Resolve what an interrupted publication left under ``dirpath`` (its subdirectories too, unless
    ``subdirectories=False``); return one line per action, for a warning.

    A staging entry was never published, or holds the checkpoint an exchange replaced: it is removed. A retired
    checkpoint whose replacement never arrived is restored under its name; one whose replacement did arrive is
    removed.

    Safe to run on several ranks at once on a shared filesystem while nothing is being written (before training
    starts): an entry another rank already resolved is skipped, so every rank ends up seeing the same directory.
    """
    actions: list[str] = []
    for directory, name in _hidden_entries(dirpath, subdirectories):
        path = os.path.join(directory, name)
        retired_from = _hidden_for(name, RETIRED_SUFFIX)
        try:
            if _hidden_for(name, STAGING_SUFFIX) is not None:
                _remove(path)
                actions.append(f"removed the unpublished partial checkpoint {path}")
            elif retired_from is not None:
                original = os.path.join(directory, retired_from)
                if os.path.lexists(original):
                    _remove(path)
                    actions.append(f"removed {path}, replaced by {original}")
                else:
                    os.replace(path, original)
                    actions.append(f"restored {original}, whose replacement was interrupted")
        except FileNotFoundError:
            continue  # another rank resolved this entry first
    return actions


__all__ = [
    "Replacements",
    "checkpoint_is_complete",
    "discard",
    "is_local",
    "keep_previous_file",
    "make_link",
    "move_into_place",
    "published_path",
    "recover",
    "release_all_retired",
    "release_retired",
    "restore_previous",
    "staging_path",
    "supports_exchange",
    "writes_directories",
]
