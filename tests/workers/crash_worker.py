"""``kill -9`` at points of a checkpoint save, run by ``tests/publish/test_crash.py``:

    python crash_worker.py OUT_DIR STRATEGY PHASE [--plain]
    python crash_worker.py OUT_DIR STRATEGY resume CELL_DIR [CELL_DIR ...]

``STRATEGY`` is ``ddp`` (single-file checkpoints written by rank 0), ``deepspeed`` (ZeRO-2 directories through
``tests/deepspeed_shim.py``) or ``fsdp2`` (distributed-checkpoint directories). Two ranks (gloo, CPU) save every 2
steps with ``save_top_k=-1`` and ``save_last=True``; during the save at global step 4 the named process(es) die by
``SIGKILL``:

- ``rank1-before``: rank 1 as the save starts, before anything is serialized;
- ``rank0-during``: rank 0 as it opens its first checkpoint file in ``dirpath`` for writing; for a single file, with
  ``$TMPDIR`` on another filesystem, halfway through the copy fsspec makes of its temporary file into ``dirpath``;
- ``all-during``: every rank as it opens its first checkpoint file; a rank that writes nothing (DDP rank 1) in
  Lightning's post-save barrier;
- ``all-after``: every rank in Lightning's post-save barrier: everything is serialized, nothing is published;
- ``rank0-after-exchange``: rank 0 right after the new ``last.ckpt`` took the name (a file: its one ``os.replace``;
  a directory: the ``renameat2`` exchange, the old one now under the staging name), before anything else;
- ``rank0-between-renames`` (directories only): with the exchange unavailable (as on NFS), rank 0 between the two
  renames that replace ``last.ckpt`` (the old one is renamed aside, the new one is not in place yet);
- ``rank0-during-async`` (single files only): with ``AsyncCheckpointIO``, rank 0 halfway through the background
  write of the step-4 checkpoint (the copy of fsspec's temporary file, on the write thread).

``rank1-disk-full`` is not a crash: rank 1's first file of the step-4 save fails to open with ``ENOSPC``, and the
callback keeps only the latest checkpoint (``monitor="step"``), so that save would have evicted ``step=2.ckpt``.

``--plain`` uses ``ModelCheckpoint`` instead of ``FiniteGradCheckpoint`` (the control). ``resume`` runs one fit per
``CELL_DIR`` in one process group, each from ``ckpt_path="last"`` to global step 6.

Each rank writes ``{OUT_DIR}/rank{N}.json`` when it finishes; a killed rank writes nothing.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.fabric.strategies.launchers import subprocess_script  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, leave_without_finalizing, ledger_state  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402
from lightning_ckguard.publish import staging  # noqa: E402
from lightning_ckguard.publish.staging import STAGING_SUFFIX  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
CRASH_STEP = 4

# Lightning's launcher watches the ranks it started: 5 s after one dies, it SIGKILLs every rank, rank 0 included.
# Here a rank is killed on purpose and the test asks whether the survivor fails in its next collective rather than
# hanging; on a loaded machine rank 0 can take longer than 5 s to get there, and the observer's kill would hide the
# answer (seen once in CI). It looks every 90 s here: longer than a collective's own timeout (60 s), so a survivor that
# hangs is still caught by that timeout, or by the test's wall clock; the observer is not what is tested.
subprocess_script._ChildProcessObserver.__init__.__defaults__ = (90,)
TIMEOUT = timedelta(seconds=30)
PHASES = ("rank1-before", "rank0-during", "all-during", "all-after", "rank0-after-exchange", "rank0-between-renames",
          "rank0-during-async")
DISK_FULL = "rank1-disk-full"  # not a crash: rank 1's first file write of the step-4 save fails with ENOSPC


class KillSwitch:
    """Kills this process by ``SIGKILL`` at one point of the save at ``CRASH_STEP``; inert otherwise."""

    def __init__(self, phase: str, rank: int, dirpath: str, single_file: bool) -> None:
        self.phase, self.rank, self.dirpath = phase, rank, os.path.abspath(dirpath)
        self.single_file = single_file
        self.step = -1  # the global step of the latest save; its publication (renames) follows it

    def _armed(self, *phases: str, ranks: tuple[int, ...] = (0, 1)) -> bool:
        return self.step == CRASH_STEP and self.phase in phases and self.rank in ranks

    @staticmethod
    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def save_starts(self, step: int) -> None:
        self.step = step
        if self._armed("rank1-before", ranks=(1,)):
            self.kill()

    def post_save_barrier(self) -> None:
        if self._armed("all-after") or self._armed("all-during", ranks=(1,)):
            self.kill()  # (all-during: a rank that got here opened no file, i.e. DDP's rank 1)

    def _during(self) -> bool:
        return self._armed("rank0-during", "rank0-during-async", ranks=(0,)) or self._armed("all-during")

    def file_opened_for_writing(self, path: str) -> None:
        if self._armed(DISK_FULL, ranks=(1,)) and os.path.abspath(path).startswith(self.dirpath + os.sep):
            raise OSError(errno.ENOSPC, "No space left on device", path)  # from the audit hook: the open fails
        # a single file is copied in by sendfile (see `install`): it dies there, halfway, not at the open
        if not self.single_file and self._during() and os.path.abspath(path).startswith(self.dirpath + os.sep):
            self.kill()

    def copying(self, out_fd: int) -> bool:
        """Whether to copy only half of what is asked into ``out_fd`` and die (a crash in the middle of the copy)."""
        target = os.path.realpath(f"/proc/self/fd/{out_fd}")
        if not (self.single_file and target.startswith(self.dirpath + os.sep)):
            return False
        if self.phase == "rank0-during-async":
            # the background write can still be copying when the next save has begun (seen under load): which save
            # a file belongs to is in its name, ``.step=4.ckpt.ckguard-staging``, not in the latest save's step
            return self.rank == 0 and f"step={CRASH_STEP}." in os.path.basename(target)
        return self._during()

    def renamed(self, source: str, target: str) -> None:
        # the second rename of `last`: its staging entry onto the name, after the old one was renamed aside
        if (
            self._armed("rank0-between-renames", ranks=(0,))
            and os.path.basename(target) == "last.ckpt"
            and source.endswith(STAGING_SUFFIX)
        ):
            self.kill()

    def published_last(self, source: str, target: str) -> None:
        """``source`` (a staging entry) now has the name ``target``: die there if ``last`` was just replaced."""
        if (
            self._armed("rank0-after-exchange", ranks=(0,))
            and os.path.basename(target) == "last.ckpt"
            and source.endswith(STAGING_SUFFIX)
        ):
            self.kill()

    def install(self) -> None:
        # the exchange (directories) and os.replace (files, links) that publish: die right after them
        exchange, replace = staging._exchange, os.replace

        def exchange_then_maybe_die(a: str, b: str) -> None:
            exchange(a, b)
            self.published_last(a, b)

        def replace_then_maybe_die(source: Any, target: Any, **kwargs: Any) -> None:
            replace(source, target, **kwargs)
            if not os.path.isdir(target):  # a directory that os.replace moves to a free name is not the swap
                self.published_last(os.fspath(source), os.fspath(target))

        staging._exchange = exchange_then_maybe_die
        os.replace = replace_then_maybe_die
        if self.phase == "rank0-between-renames":  # as on a filesystem without RENAME_EXCHANGE (NFS)
            staging.supports_exchange = lambda directory: False

        def audit(event: str, args: tuple) -> None:
            if event == "open" and isinstance(args[0], (str, os.PathLike)):
                mode, flags = args[1], args[2]
                writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                    flags & (os.O_WRONLY | os.O_RDWR)
                )
                if writing:
                    self.file_opened_for_writing(os.fspath(args[0]))
            elif event == "os.rename" and isinstance(args[0], (str, os.PathLike)):
                self.renamed(os.fspath(args[0]), os.fspath(args[1]))

        sys.addaudithook(audit)
        # DeepSpeed writes through torch.save(path), whose C++ writer opens the file without an audit event
        save = torch.save

        def audited_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, os.PathLike)):
                self.file_opened_for_writing(os.fspath(f))
            return save(obj, f, *args, **kwargs)

        torch.save = audited_save
        # fsspec moves its temporary file into place; across filesystems shutil copies it with os.sendfile
        sendfile = os.sendfile

        def half_then_die(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
            if self.copying(out_fd):
                sendfile(out_fd, in_fd, offset, max(1, os.fstat(in_fd).st_size // 2))
                self.kill()
            return sendfile(out_fd, in_fd, offset, count)

        os.sendfile = half_then_die


def crashing(base: type, switch: KillSwitch) -> Any:
    """A subclass of strategy class ``base`` that reports the start and end of each save to ``switch``."""

    class Crashing(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # wrapped on the instance, not overridden in the class: a strategy class's own `save_checkpoint` is a
            # user's write, handed the real path (not staged), and this worker kills Lightning's staged write
            own_save = self.save_checkpoint

            def save_checkpoint(checkpoint: Any, filepath: Any, storage_options: Any = None) -> None:
                switch.save_starts(self.lightning_module.trainer.global_step)
                own_save(checkpoint, filepath, storage_options)
                # this rank's write is done: next comes the guard's write agreement, which stands in for
                # Lightning's post-save barrier (plain ModelCheckpoint: that barrier itself, below)
                switch.post_save_barrier()

            self.save_checkpoint = save_checkpoint

        def barrier(self, name: str | None = None) -> None:
            if name == "Trainer.save_checkpoint":
                switch.post_save_barrier()
            super().barrier(name)

    return Crashing


# the worker's STRATEGY argument -> the kind of strategy it trains under
STRATEGY_KINDS = {"ddp": "ddp", "deepspeed": "ds2", "fsdp2": "fsdp2"}


def make_crashing_strategy(strategy: str, switch: KillSwitch) -> Any:
    # DeepSpeed: bf16 with DeepSpeed's overflow check off, as in the other sharded workers
    return make_strategy(STRATEGY_KINDS[strategy], timeout=TIMEOUT, precision="bf16-mixed", check_grad_overflow=False,
                         wrap=lambda base: crashing(base, switch))


class StartStep(Callback):
    """Keeps the global step the fit starts from (after a resume, the step of the checkpoint it loaded)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.step = trainer.global_step


def fit(strategy: str, dirpath: str, phase: str, plain: bool) -> dict[str, Any]:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    switch = KillSwitch(phase, rank, dirpath, single_file=strategy == "ddp")
    if phase != "resume":
        switch.install()
    seed_everything(7)
    kwargs: dict[str, Any] = dict(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True,
                                  filename="{step}")
    if phase == DISK_FULL:  # keep only the latest: the failed save at step 4 would have evicted step=2.ckpt
        kwargs.update(save_top_k=1, monitor="step", mode="max")
    callback = ModelCheckpoint(**kwargs) if plain else FiniteGradCheckpoint(**kwargs)
    start = StartStep()
    trainer = Trainer(
        strategy=make_crashing_strategy(strategy, switch),
        devices=2,
        precision="bf16-mixed" if strategy == "deepspeed" else "32-true",
        callbacks=[callback, start],
        plugins=[AsyncCheckpointIO()] if phase == "rank0-during-async" else None,
        max_steps=6,
        limit_val_batches=0,
        **QUIET,
    )
    result: dict[str, Any] = {"error": None}
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(ShardedFaultModel(fsdp2=strategy == "fsdp2"), ckpt_path="last" if phase == "resume" else None)
        except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            result["error"] = f"{type(error).__name__}: {error}"
            result["trace"] = traceback.format_exc()
    result.update(
        fit_seconds=time.monotonic() - started,
        start_step=start.step,
        global_step=trainer.global_step,
        ckpt_path=trainer.ckpt_path,
        warnings=[str(w.message) for w in caught if "FiniteGradCheckpoint" in str(w.message)],
        best_k_models=sorted(callback.best_k_models),
        last_model_path=callback.last_model_path,
        state=ledger_state(callback),
    )
    return result


def main() -> None:
    out, strategy, phase, *rest = sys.argv[1:]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if phase == "resume":
        results = {cell: fit(strategy, os.path.join(cell, "ckpts"), "resume", plain=False) for cell in rest}
    else:
        results = fit(strategy, os.path.join(out, "ckpts"), phase, plain="--plain" in rest)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    leave_without_finalizing()


if __name__ == "__main__":
    main()
