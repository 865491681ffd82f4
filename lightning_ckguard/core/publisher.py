"""``CheckpointPublisher``: the callback's publication guarantees for your own loop (Fabric, ``torch.distributed``).

One call per checkpoint, on every rank at the same point::

    guard = GradientGuard(model)
    publisher = CheckpointPublisher(fabric.strategy, "checkpoints", guard=guard)
    ...
    publisher.save("step=100.ckpt", {"model": model, "optimizer": optimizer, "step": 100})

``save`` agrees first (the guard's one collective: gradient history and the state about to be written); a rejection
raises :class:`~lightning_ckguard.NonFiniteGradientError` on every rank and writes nothing. An accepted checkpoint is
written into a hidden staging sibling of its name (every rank its part, through the strategy's own save: single
files, DeepSpeed and FSDP directories), every rank learns whether any rank's write failed (a failure raises on every
rank and leaves no partial file), and rank 0 then moves it into place with one rename (a directory by an exchange
where the filesystem has one), so the name always holds a complete checkpoint. With ``durable=True`` (the default)
each rank flushes what it wrote before the write's outcome is agreed, and rank 0 flushes the directory after the
rename, so the checkpoint survives a machine crash too. Only then does the guard start a fresh window.

A Fabric strategy whose ``checkpoint_io`` is a user's own (a ``CheckpointIO`` of its own, or a ``TorchCheckpointIO``
subclass overriding ``save_checkpoint`` to write a sidecar file, upload or log the path) writes at the checkpoint's
real name instead, as the callback does: only Fabric's own ``save_checkpoint`` would never see a staging name. A
failed write of a new name is then removed again through that IO's ``remove_checkpoint``; a name it overwrote is not
put back.

On object storage (``dirpath="s3://bucket/run"``, any fsspec filesystem that is not local) one upload publishes a whole
object, so a checkpoint is written at its name directly (single files: DDP, or rank 0 of a process group), and a
strategy that would write through local paths instead (FSDP, DeepSpeed) is refused at construction.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from fsspec.core import split_protocol
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem

from lightning_ckguard._distributed import (
    broadcast_in_group,
    default_collective,
    is_rank_zero,
    require_collective,
)
from lightning_ckguard.agree.agreement import Verdict
from lightning_ckguard.agree.guard import GradientGuard
from lightning_ckguard.publish.durability import durability
from lightning_ckguard.publish.seal import HeldWriteFailure, agree_on_write
from lightning_ckguard.publish.staging import RETIRED_SUFFIX, STAGING_SUFFIX, _hidden_for, discard, writes_directories
from lightning_ckguard.publish.storage import storage_for
from lightning_ckguard.publish.writers import Flush, choose_writer, writes_as_lightning

#: The modules of Fabric's own ``TorchCheckpointIO``, in either Fabric package.
_FABRIC_TORCH_IO_MODULES = ("lightning.fabric.plugins.io.torch_io", "lightning_fabric.plugins.io.torch_io")


class ProcessGroupCollectives:
    """The few collectives the publisher needs, over a ``torch.distributed`` process group (the default one for
    ``None`` while one is initialized); rank 0 of the group writes."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.group_rank = dist.get_rank(group)
        self.is_global_zero = self.group_rank == 0
        cuda = dist.get_backend(group) == "nccl"
        self.root_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """``value`` as group rank ``src`` has it."""
        return broadcast_in_group(self.group, value, src)

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank of the group."""
        dist.barrier(group=self.group)


def _plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """What ``torch.save`` writes for a state of modules, optimizers and values: their state dicts, the rest as is."""
    return {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in state.items()}


class CheckpointPublisher:
    """Publishes checkpoints into ``dirpath`` with the guarantees of ``FiniteGradCheckpoint``, without a Trainer.

    Args:
        collective: A Fabric strategy (``fabric.strategy``: its process group and timeout apply, and its own
            ``save_checkpoint`` writes, sharded strategies included), a ``torch.distributed`` process group (rank 0
            of it writes with ``torch.save``), or ``None``: the default process group when one is initialized with
            peers, else a single process.
        dirpath: The directory the checkpoints are published in: a local path (created if needed; what an
            interrupted publication left there, a staging entry or a name renamed aside, is recovered on rank 0), or
            an object-storage URL such as ``"s3://bucket/run"``.
        guard: The :class:`~lightning_ckguard.GradientGuard` of the loop; every ``save`` agrees through it first.
            Without one, nothing is checked and only the publication's guarantees hold.
        durable: Whether a published checkpoint survives a machine crash, not only a killed process (a local
            ``dirpath``: the data flushed before the rename, the directory after it); ``False`` for scratch storage.

    Raises:
        ValueError: If ``collective`` is none of these (the ``Fabric`` object itself is refused: pass
            ``fabric.strategy``), ``dirpath`` is not a path or URL, ``guard`` is not a
            ``GradientGuard``, ``durable`` is not a bool, or ``dirpath`` is on object storage and ``collective`` a
            strategy that writes through local paths.
    """

    def __init__(self, collective: Any, dirpath: str | os.PathLike[str], *, guard: GradientGuard | None = None,
                 durable: bool = True) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ValueError(f"`dirpath` must be a directory path or URL, got {dirpath!r}.")
        if guard is not None and not isinstance(guard, GradientGuard):
            raise ValueError(f"`guard` must be a GradientGuard or None, got {type(guard).__name__}.")
        if not isinstance(durable, bool):
            raise ValueError(f"`durable` must be a bool, got {durable!r} ({type(durable).__name__}).")
        require_collective(collective)  # anything else would publish as a single process on every rank
        collective = default_collective(collective)  # None with peers: the default group, as for the guard
        if isinstance(collective, dist.ProcessGroup):
            collective = ProcessGroupCollectives(collective)
        self.collective = collective
        self.dirpath = os.fspath(dirpath)
        self.guard = guard
        #: The verdict of the most recent ``save`` (accepted or not), the same on every rank; None without a guard,
        #: and after a ``save`` whose agreement raised before reaching one (a state check that failed on some rank).
        self.last_verdict: Verdict | None = None
        fs = get_filesystem(self.dirpath)
        storage = storage_for(fs)
        if storage.stages_writes:  # staged writes are checked and renamed through `os`, which knows no URLs
            self.dirpath = _local_path(fs, self.dirpath)
        storage.refuse_strategy(collective, self.dirpath)
        # the same writers as the callback's, chosen the same way: staged and renamed on local disk, direct where one
        # upload is atomic or the strategy's checkpoint IO is the user's own
        staged_io = _writes_only_the_path(collective)
        self._durability = durability(durable) if storage.stages_writes else durability(False)
        self._writer = choose_writer(collective, storage, self._durability, in_background=None,
                                     writes_through_lightning=True, staged_io=staged_io)
        # a user's IO wrote at the name itself: a failed write's leftovers go through its own removal, as the
        # callback's rollback removes them (a sidecar too); nothing is left at the name by a staged write
        self._remove: Callable[[str], None] = discard if staged_io else collective.checkpoint_io.remove_checkpoint
        self._storage = storage
        self._kept: list[str] = []  # names whose replaced checkpoint is kept for readers (rank 0)
        made = self._make_dirpath(storage.fs)
        # rank 0 recovers what a crash left; no rank writes before that (the one collective here, which also tells
        # every rank of a failure of rank 0's, so that none raises alone)
        # its names never lie in a subdirectory: what another writer left in one is not its own to recover
        # the warnings name the user's line that made the publisher: above the lambda, `prepare` and this constructor
        storage.prepare(collective, self.dirpath, lambda: made, lambda message: warnings.warn(message, stacklevel=4),
                        owner="CheckpointPublisher", subdirectories=False)

    def _make_dirpath(self, fs: Any) -> Exception | None:
        """Rank 0 creates ``dirpath``; its failure is returned, for every rank to raise in the agreement after it."""
        if not self.is_global_zero:
            return None
        try:
            flush = self._durability.making_directory(self.dirpath)
            fs.makedirs(self.dirpath, exist_ok=True)
            flush()  # a machine crash must not take the new directory, and every checkpoint in it, along
        except Exception as error:
            return error
        return None

    @property
    def is_global_zero(self) -> bool:
        """Whether this rank moves checkpoints into place (rank 0)."""
        return is_rank_zero(self.collective)

    def save(self, name: str | os.PathLike[str], state: dict[str, Any], *, global_step: int | None = None
             ) -> Verdict | None:
        """Agree, write into staging, agree on the write, move into place; or raise on every rank.

        Call it on every rank at the same point, with the same ``name``. Returns the guard's verdict (None without a
        guard).

        Raises:
            ValueError: If ``name`` is not a plain file or directory name inside ``dirpath`` (a ``str`` or an
                ``os.PathLike``), or is shaped like the publisher's own hidden staging and retired entries (which
                the next publisher's recovery would remove), or ``state`` is not a ``dict``; nothing was agreed or
                written.
            NonFiniteGradientError: On every rank, when the guard rejects; nothing was written.
            StateCheckError: On every rank, when checking ``state`` raised on some rank (a tensor on the meta
                device, say); nothing was written.
            CheckpointWriteError: On the ranks whose own part succeeded, when another rank's write failed (that rank
                raises its own error); no partial checkpoint is left under ``name`` or its staging sibling.
        """
        name = _checked_name(name)
        if not isinstance(state, dict):  # the same code on every rank: no rank goes on alone
            raise ValueError(f"`state` must be a dict of what to save (modules, optimizers, values), got "
                             f"{type(state).__name__}.")
        verdict = None
        if self.guard is not None:
            self.last_verdict = None  # not the previous save's, if this agreement raises
            verdict = self.guard.agree(self.collective, global_step=global_step, state=state)
            self.last_verdict = verdict
            if not verdict.accepted:
                raise verdict.to_error()
        path = os.path.join(self.dirpath, name)
        self._write_and_publish(path, state)
        if self.guard is not None:
            self.guard.reset()  # only once it is published
        return verdict

    def _write_and_publish(self, path: str, state: dict[str, Any]) -> None:
        """Through the callback's writers: on local disk every rank writes into staging (the outcome agreed), rank 0
        moves it into place, and the move's outcome is agreed right away (a Trainer's fit lets it ride in the next
        agreement; a loop of its own may not agree again); on object storage the upload is the publication."""
        writer = self._writer
        # the previous save's, kept for readers until now; a failure is warned at `save`'s caller
        self._release_kept_copies(stacklevel=4)
        # a name this save makes is removed again if the write fails (rank 0; an upload is whole or absent)
        local = self.is_global_zero and self._storage.stages_writes
        existed = local and os.path.lexists(path)
        created = (path,) if local and not existed else ()
        writer.open(None)
        try:
            writer.save(path, partial(self._write_agreed, state=state, path=path))
        except BaseException:
            writer.close(False, created, self._remove)  # raised on every rank; nothing is left under a new name
            raise
        writer.close(True, (), self._remove)
        failure = writer.finish(self.collective, during_exception=False)
        if failure is not None:
            raise failure.error
        if existed:
            self._kept.append(path)

    def close(self) -> None:
        """Remove what the last ``save`` kept for readers (rank 0): a directory checkpoint that replaced one of its name
        keeps the old one under a hidden name until the next ``save``, so that a reader inside it is not cut off.
        Call it when the loop is done, on every rank (no collective); a ``save`` after it works as before."""
        self._release_kept_copies()

    def _release_kept_copies(self, stacklevel: int = 3) -> None:
        """Remove the copies kept for readers (rank 0); a failure is a warning at ``stacklevel`` (3: the caller of the
        public method that called this one)."""
        kept, self._kept = self._kept, []
        try:
            for path in kept:
                self._storage.release_retired(path)
        except OSError as error:  # rank 0 alone: a warning, never an error the other ranks would not raise
            warnings.warn(f"CheckpointPublisher could not remove the copies kept for readers in {self.dirpath}: "
                          f"{error}", stacklevel=stacklevel)

    def _write_agreed(self, staging: str, flush: Flush, state: dict[str, Any], path: str) -> None:
        held = HeldWriteFailure()  # as under the callback: every rank learns of it in the agreement below
        held.write(self.collective, partial(self._write, staging, state), partial(flush, staging))
        agree_on_write(self.collective, held.error, path)

    def _write(self, staging: str, state: dict[str, Any]) -> None:
        save_checkpoint = getattr(self.collective, "save_checkpoint", None)
        if callable(save_checkpoint):  # a Fabric strategy: its own write, every rank its part
            from lightning.fabric.wrappers import _unwrap_objects

            save_checkpoint(path=staging, state=_unwrap_objects(state))
        elif self.is_global_zero:
            _atomic_save(_plain_state(state), staging)  # through fsspec: a local path or an object-storage URL


def _local_path(fs: Any, dirpath: str) -> str:
    """``dirpath`` on the local filesystem as a plain path: a ``file://`` URL without its protocol (a plain path is
    kept as it is), so that what goes through ``os`` (the staging entry's check, the rename, the recovery) finds what
    fsspec wrote."""
    protocol, _ = split_protocol(dirpath)
    return dirpath if protocol is None else str(fs._strip_protocol(dirpath))


def _checked_name(name: Any) -> str:
    """``name`` as a plain ``str`` file or directory name inside ``dirpath``, or a ``ValueError``."""
    path = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(path, str) or not path or os.path.basename(path) != path or path in (".", ".."):
        raise ValueError(f"`name` must be a file or directory name inside `dirpath`, got {name!r}.")
    # the recovery at the next publisher's construction would remove (or rename) such an entry: refused up front
    if any(_hidden_for(path, suffix) is not None for suffix in (STAGING_SUFFIX, RETIRED_SUFFIX)):
        raise ValueError(f"`name` {name!r} is shaped like a hidden staging or retired entry of the publisher (a "
                         f"leading '.' and a {STAGING_SUFFIX!r} or {RETIRED_SUFFIX!r} suffix); choose another name.")
    return path


def _writes_only_the_path(collective: Any) -> bool:
    """Whether what writes for ``collective`` writes exactly the path it is given and nothing else, so a staging name
    stays invisible: the publisher's own ``torch.save`` (a process group, one process), a strategy that writes itself
    (DeepSpeed, FSDP, model parallel), or Fabric's own ``TorchCheckpointIO``."""
    if not callable(getattr(collective, "save_checkpoint", None)) or writes_directories(collective):
        return True
    try:
        io = collective.checkpoint_io
    except NotImplementedError:  # Fabric's FSDP and model-parallel strategies save by themselves, through no IO
        return True
    # only the Fabric packages already imported: an IO of a package nobody imported cannot exist, and the core must
    # work with raw torch.distributed alone
    own = (getattr(sys.modules.get(name), "TorchCheckpointIO", None) for name in _FABRIC_TORCH_IO_MODULES)
    return any(writes_as_lightning(io, cls) for cls in own if cls is not None)


__all__ = ["CheckpointPublisher", "ProcessGroupCollectives"]
