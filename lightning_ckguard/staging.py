"""Atomic publication of directory checkpoints (DeepSpeed, FSDP2 distributed checkpoints, sharded FSDP).

A single-file checkpoint is already written atomically: Lightning serializes it in memory and writes it through an
fsspec transaction. A directory is written by every rank, file by file, so a crash mid-save would leave a partial
directory under the final name. Instead every rank writes into a hidden staging sibling; after Lightning's
post-save barrier rank 0 moves it into place (one ``rename``), and only then are evictions and links performed.

A crash leaves at worst a staging directory, or a retired copy of the checkpoint being replaced; both are resolved
by :func:`recover` when training starts again.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

STAGING_SUFFIX = ".ckguard-staging"
RETIRED_SUFFIX = ".ckguard-retired"


def writes_directories(strategy: Any) -> bool:
    """Whether ``strategy`` writes a checkpoint as a directory that every rank fills."""
    kind = type(strategy).__name__
    return (
        "DeepSpeed" in kind
        or bool(getattr(strategy, "_save_distributed_checkpoint", False))
        or getattr(strategy, "_state_dict_type", None) == "sharded"
    )


def staging_path(filepath: str) -> str:
    """The hidden sibling that ``filepath`` is written into before it is published."""
    head, tail = os.path.split(filepath)
    return os.path.join(head, f".{tail}{STAGING_SUFFIX}")


def _retired_path(filepath: str) -> str:
    head, tail = os.path.split(filepath)
    return os.path.join(head, f".{tail}{RETIRED_SUFFIX}")


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


def recover(dirpath: str) -> list[str]:
    """Resolve what an interrupted publication left in ``dirpath``; return one line per action, for a warning.

    A staging directory was never published: it is removed. A retired checkpoint whose replacement never arrived is
    restored under its name; one whose replacement did arrive is removed.
    """
    if not os.path.isdir(dirpath):
        return []
    actions: list[str] = []
    for name in sorted(os.listdir(dirpath)):
        path = os.path.join(dirpath, name)
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
    return actions


__all__ = ["discard", "move_into_place", "recover", "staging_path", "writes_directories"]
