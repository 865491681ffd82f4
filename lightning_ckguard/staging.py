"""Atomic publication of checkpoints on a local filesystem: files, directories (DeepSpeed, FSDP2 distributed
checkpoints, sharded FSDP) and ``last`` links.

A directory is written by every rank, file by file, so a crash mid-save would leave a partial directory under the
final name. A single file is serialized in memory by Lightning and written through an fsspec transaction, but that
transaction writes a temporary file in ``$TMPDIR`` and *moves* it into place: when ``$TMPDIR`` is on another
filesystem than the checkpoint, the move is a copy, and a crash during it leaves a truncated file under the final
name. So every write goes to a hidden staging sibling in the same directory; once every rank is done (Lightning's
post-save barrier), rank 0 moves it into place with one ``rename``, and only then are evictions and links performed.

A crash leaves at worst a staging entry, or a retired copy of the checkpoint being replaced; both are resolved by
:func:`recover` when training starts again (before ``ckpt_path="last"`` is resolved, and in ``setup``).
"""

from __future__ import annotations

import os
import shutil
import zipfile
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


def staging_path(filepath: str) -> str:
    """The hidden sibling that ``filepath`` is written into before it is published."""
    head, tail = os.path.split(filepath)
    return os.path.join(head, f".{tail}{STAGING_SUFFIX}")


def published_path(path: str) -> str:
    """The name a staging path is published under (any other path is returned unchanged), for messages."""
    head, tail = os.path.split(path)
    if tail.startswith(".") and tail.endswith(STAGING_SUFFIX):
        return os.path.join(head, tail[1 : -len(STAGING_SUFFIX)])
    return path


def _retired_path(filepath: str) -> str:
    head, tail = os.path.split(filepath)
    return os.path.join(head, f".{tail}{RETIRED_SUFFIX}")


def is_local(fs: Any) -> bool:
    """Whether ``fs`` (an fsspec filesystem) is the local one, where ``rename`` publishes atomically."""
    return isinstance(fs, LocalFileSystem)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def move_into_place(staging: str, filepath: str) -> None:
    """Publish ``staging`` as ``filepath``, replacing an existing checkpoint of that name (rank 0 only).

    The old checkpoint is renamed aside first, so at every instant ``filepath`` is either the old complete checkpoint,
    absent (with the old one recoverable), or the new complete one.
    """
    retired = _retired_path(filepath)
    if os.path.lexists(filepath):
        _remove(retired)
        os.replace(filepath, retired)
    os.replace(staging, filepath)
    _remove(retired)


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


def recover(dirpath: str) -> list[str]:
    """Resolve what an interrupted publication left in ``dirpath``; return one line per action, for a warning.

    A staging entry was never published: it is removed. A retired checkpoint whose replacement never arrived is
    restored under its name; one whose replacement did arrive is removed.

    Safe to run on several ranks at once on a shared filesystem while nothing is being written (before training
    starts): an entry another rank already resolved is skipped, so every rank ends up seeing the same directory.
    """
    if not os.path.isdir(dirpath):
        return []
    actions: list[str] = []
    for name in sorted(os.listdir(dirpath)):
        path = os.path.join(dirpath, name)
        try:
            if name.startswith(".") and name.endswith(STAGING_SUFFIX):
                _remove(path)
                actions.append(f"removed the unpublished partial checkpoint {path}")
            elif name.startswith(".") and name.endswith(RETIRED_SUFFIX):
                original = os.path.join(dirpath, name[1 : -len(RETIRED_SUFFIX)])
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
    "checkpoint_is_complete",
    "discard",
    "is_local",
    "move_into_place",
    "published_path",
    "recover",
    "staging_path",
    "writes_directories",
]
