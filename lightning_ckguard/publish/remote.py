"""Checkpoints on object storage and other non-local fsspec filesystems (``dirpath="s3://bucket/run"``).

What a ``ModelCheckpoint`` gets wrong there, and this module answers for the callback:

- ``ckpt_path="last"``: Lightning lists ``dirpath`` through fsspec, which returns paths without their protocol
  (``bucket/run/last.ckpt``); those are then looked up on the local filesystem, nothing is found, and the fit starts
  from scratch. :func:`newest_last_checkpoint` answers with the full URL of the newest complete ``last``.
- Removal: ``ModelCheckpoint._should_remove_checkpoint`` allows removing *any* path that is not on the local
  filesystem, including the checkpoint the fit resumed from and checkpoints outside ``dirpath`` (Lightning issue
  #21813). :func:`removal_allowed` applies the rule ``ModelCheckpoint`` applies on local disk, on every filesystem.
- Sharded strategies: Lightning's ``ModelParallelStrategy`` (FSDP2), ``FSDPStrategy`` and ``DeepSpeedStrategy`` turn
  the checkpoint path into a ``pathlib.Path``/``os`` path before writing, so ``s3://bucket/run/x.ckpt`` becomes the
  *local* relative directory ``s3:/bucket/run/x.ckpt``: nothing reaches the object store, and nothing written there
  would ever be found again. :func:`unsupported_strategy_error` refuses that combination at setup.

What is atomic where: an object store publishes a single object (one ``PUT``, or a multipart upload on completion)
all at once, so a reader never sees part of a checkpoint under its name, and a refused or interrupted upload leaves
the previous object of that name (or none) in place. That is the only kind of checkpoint written there: one file per
checkpoint (single-device, DDP, ZeRO-1), serialized in memory by Lightning and uploaded by one call.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from lightning_ckguard._distributed import broadcast_value, describe_error
from lightning_ckguard.errors import CheckpointWriteError

#: Strategy classes (of either Lightning package, matched by name) that write a checkpoint through ``pathlib``/``os``
#: paths, i.e. to the local disk whatever the URL says.
LOCAL_PATH_STRATEGIES = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")


def canonical(fs: Any, path: str) -> str:
    """``path`` as ``fs`` names it internally (no protocol, no trailing separator, no ``./`` or doubled
    separators), so that the protocol-less paths of a listing and the URLs a user passes compare equal."""
    stripped = str(fs._strip_protocol(str(path)))
    return os.path.normpath(stripped) if stripped else stripped


def removal_allowed(fs: Any, previous: str, current: str, dirpath: str | None, resumed_from: str | None) -> bool:
    """Whether the checkpoint ``previous`` may be removed now that ``current`` replaces it, on filesystem ``fs``.

    ``ModelCheckpoint``'s rule on local disk, on any filesystem: never the name being written, never the checkpoint
    the fit resumed from, never anything outside this callback's ``dirpath`` (another run's, or a file the user put
    elsewhere). What it does remove are the evicted entries of its ledger in ``dirpath``: the files this run wrote,
    and those of the run it continues there (as ``ModelCheckpoint`` does on local disk).
    """
    previous_path = canonical(fs, previous)
    if previous_path == canonical(fs, current):
        return False
    if resumed_from is not None and previous_path == canonical(fs, str(resumed_from)):
        return False
    if not dirpath:
        return False
    directory = canonical(fs, str(dirpath))
    return previous_path.startswith(directory.rstrip(fs.sep) + fs.sep)


def _modified(fs: Any, entry: dict[str, Any]) -> float:
    """The modification time of a listing entry, in seconds (0 when the filesystem does not say)."""
    stamp = entry.get("LastModified", entry.get("mtime"))
    if stamp is None:
        try:
            stamp = fs.modified(entry["name"])
        except (NotImplementedError, OSError):
            return 0.0
    return stamp.timestamp() if isinstance(stamp, datetime) else float(stamp)


def _version(name: str) -> int:
    """The version counter of ``last-v3.ckpt`` (3), 0 for an unversioned name: later versions were created later."""
    match = re.search(r"-v(\d+)\.[^.]*$", name)
    return int(match.group(1)) if match else 0


def newest_last_checkpoint(fs: Any, dirpath: str, is_last: Callable[[str], bool]) -> set[str]:
    """The newest complete ``last`` checkpoint in ``dirpath`` on ``fs``, as a URL with its protocol (a set of one, or
    empty), for ``ckpt_path="last"``.

    Only whole objects are candidates: a file with content (an object store shows an upload only once it completed).
    Directories never are, complete or not (no sharded checkpoint is written to a non-local filesystem, see
    :func:`unsupported_strategy_error`). The listing is read afresh, not from fsspec's cache, so every rank sees what
    the object store holds now. Object stores give modification times in whole seconds: among equally new ones, the
    highest version counter wins.
    """
    fs.invalidate_cache(canonical(fs, dirpath))
    if not fs.isdir(dirpath):
        return set()
    entries = [
        entry for entry in fs.ls(dirpath, detail=True)
        if entry.get("type") == "file" and entry.get("size", 0) > 0 and is_last(os.path.basename(entry["name"]))
    ]
    if not entries:
        return set()
    newest = max(entries, key=lambda e: (_modified(fs, e), _version(os.path.basename(e["name"]))))
    return {str(fs.unstrip_protocol(newest["name"]))}


def exists_on_every_rank(strategy: Any, fs: Any, path: str, is_global_zero: bool) -> bool:
    """Whether ``path`` exists, as rank 0 sees it, on every rank; a failed look (an object store that stopped
    answering) raises on every rank, in the one collective ``ModelCheckpoint.file_exists`` makes.

    ``ModelCheckpoint`` lets rank 0 look and then reduces the answer: a look that raised would leave rank 0 alone
    with its error and every other rank waiting in the reduction until the strategy's timeout.
    """
    answer, failure = False, None
    if is_global_zero:
        try:
            answer = bool(fs.exists(path))
        except Exception as error:
            failure = error
    # rank 0 alone looks, so its answer and its failure travel together in one broadcast (agree_on_failure's flag
    # gather would add a collective ModelCheckpoint does not make)
    agreed = broadcast_value(strategy, (answer, None if failure is None else describe_error(failure)))
    if failure is not None:
        raise failure
    if agreed[1] is not None:
        raise CheckpointWriteError(ranks=[0], filepath=path, cause=agreed[1])
    return bool(agreed[0])


def existed_before_write(fs: Any, path: str) -> bool:
    """Whether ``path`` exists before a write to it, for the rollback of a failed boundary (which removes only what the
    boundary created). If the filesystem cannot say, assume it does: a rollback then never removes it, and the write
    itself fails right after, on every rank (the seal)."""
    try:
        return bool(fs.exists(path))
    except Exception:
        return True


def unsupported_strategy_error(strategy: Any, dirpath: str) -> ValueError | None:
    """The error for a strategy that would write checkpoints meant for ``dirpath`` (not on the local filesystem) to
    the local disk instead, or None."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    found = next((name for name in LOCAL_PATH_STRATEGIES if name in names), None)
    if found is None:
        return None
    subclass = "" if type(strategy).__name__ == found else f" (a {found})"
    return ValueError(
        f"FiniteGradCheckpoint(dirpath={dirpath!r}) is not on the local filesystem, but `{type(strategy).__name__}`"
        f"{subclass} writes checkpoints through local paths: they would land in the local directory "
        f"{str(PurePosixPath(dirpath))!r} and never reach the object store. Give it a local or mounted shared "
        "`dirpath` (and copy the checkpoints to object storage afterwards), or use a strategy that saves one file "
        "per checkpoint (single device, DDP)."
    )


__all__ = [
    "canonical",
    "existed_before_write",
    "exists_on_every_rank",
    "newest_last_checkpoint",
    "removal_allowed",
    "unsupported_strategy_error",
]
