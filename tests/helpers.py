"""Shared test models and observations: what a user can see on disk and in the callback."""

from __future__ import annotations

import errno
import gc
import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import torch
from lightning_namespace import building_from, lightning_module, namespace
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ckguard.errors import CheckpointWriteError, NonFiniteGradientError
from lightning_ckguard.publish.ledger import Ledger
from lightning_ckguard.recover.rewind import REWIND_LOG_NAME

# from `lightning.pytorch`, or from `pytorch_lightning` in a worker run with CKGUARD_TEST_LIGHTNING=pytorch_lightning
# (tests/lightning_namespace.py): FaultyModel, CountingStrategy and hook_writes then belong to that package's Trainer
ModelCheckpoint = lightning_module("callbacks").ModelCheckpoint
BoringModel = lightning_module("demos.boring_classes").BoringModel
TorchCheckpointIO = lightning_module("plugins.io").TorchCheckpointIO
SingleDeviceStrategy = lightning_module("strategies").SingleDeviceStrategy
Logger = lightning_module("loggers").Logger
Callback = lightning_module("callbacks").Callback


def helpers_for(name: str) -> ModuleType:
    """This module built from Lightning namespace ``name`` (``"lightning.pytorch"`` or ``"pytorch_lightning"``):
    this very module when it is the one it was imported for, otherwise a second copy, imported once as
    ``helpers_pytorch_lightning`` (an importable name, so a CLI ``class_path`` can name its classes)."""
    if name == namespace():
        return sys.modules[__name__]
    module_name = f"{__name__}_{name.replace('.', '_')}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, __file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            with building_from(name):
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


def rank_1_rejection(parameters: list[str]) -> dict[str, Any]:
    """The error fields every rank raises when rank 1 alone saw a NaN in ``parameters`` at step 5, and the boundary
    at global step 6 rejects: the fault the two-rank workers plant by default."""
    return {"ranks": [1], "first_step": 5, "last_step": 5, "num_steps": 1, "global_step": 6, "parameters": parameters,
            "skipped_steps": 0, "pending_rejection": False, "non_finite_state": []}


def tree_digest(root: str | None) -> dict[str, Any]:
    """Every entry under ``root``: file content hashes, link targets, directories. Symlinks are not followed."""
    digest: dict[str, Any] = {}
    if not root or not os.path.isdir(root):
        return digest
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            try:
                if os.path.islink(path):
                    digest[rel] = ["link", os.readlink(path)]
                elif os.path.isdir(path):
                    digest[rel] = ["dir"]
                else:
                    with open(path, "rb") as f:
                        digest[rel] = ["file", hashlib.sha256(f.read()).hexdigest()]
            except FileNotFoundError:
                # another rank may still be evicting while a non-zero rank looks; the tests compare rank 0's view
                continue
    return digest


def relative_paths(value: Any, root: Any) -> Any:
    """``value`` (strings, nested dicts) with ``root`` replaced by ``<dir>``, to compare runs in different dirs."""
    if isinstance(value, str):
        return value.replace(str(root), "<dir>")
    if isinstance(value, dict):
        return {relative_paths(k, root): relative_paths(v, root) for k, v in value.items()}
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def ledger_state(callback: ModelCheckpoint) -> dict[str, Any]:
    """The callback's whole bookkeeping as plain JSON-able values."""
    ledger = Ledger.capture(callback)
    return {name: _plain(getattr(ledger, name)) for name in ledger.__dataclass_fields__ if name != "last_time_checked"}


def rewind_log(dirpath: Any) -> list[dict[str, Any]]:
    """The lines of the rewind log in ``dirpath`` (``ckguard-rewinds.jsonl``), each parsed as strict JSON: a ``NaN``
    or an ``Infinity`` in one fails the test, as another JSON reader would refuse it. [] when there is no log."""
    path = os.path.join(dirpath, REWIND_LOG_NAME)
    if not os.path.exists(path):
        return []

    def refuse(constant: str) -> None:
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    with open(path) as log:
        return [json.loads(line, parse_constant=refuse) for line in log]


class AtStepEnd(Callback):
    """Runs ``action(trainer)`` once: at the end of the first batch after which the fit is at optimizer step
    ``step`` (``trainer.global_step``), before that step's boundary (Lightning runs checkpoint callbacks last)."""

    def __init__(self, step: int, action: Callable[[Any], None]) -> None:
        self.step, self.action, self.done = step, action, False

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step and not self.done:
            self.done = True
            self.action(trainer)


class HookFailsAt(Callback):
    """Its ``hook`` (``"state_dict"`` or ``"on_save_checkpoint"``) raises ``RuntimeError("hook failed on rank R")`` in
    every save of epoch ``epoch`` on rank ``rank`` only: a failure of yours in the Trainer's ``dump_checkpoint``,
    before the strategy writes."""

    def __init__(self, hook: str, rank: int, epoch: int) -> None:
        self.hook, self.rank, self.epoch = hook, rank, epoch

    def _fails(self, trainer: Any, hook: str) -> None:
        if hook == self.hook and trainer.global_rank == self.rank and trainer.current_epoch == self.epoch:
            raise RuntimeError(f"hook failed on rank {self.rank}")

    def state_dict(self) -> dict[str, Any]:
        self._fails(self.trainer, "state_dict")
        return {}

    def setup(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self.trainer = trainer

    def on_save_checkpoint(self, trainer: Any, *args: Any) -> None:
        self._fails(trainer, "on_save_checkpoint")


class RecordingLogger(Logger):
    """A logger that records every ``log_metrics`` call, ``(step, metrics)``, in ``calls``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class FaultyModel(BoringModel):
    """BoringModel that writes ``value`` into one gradient element of ``fault_parameter`` on ``fault_ranks`` at
    ``fault_steps`` (global steps) and at ``fault_batches`` (batch indices within an epoch, i.e. micro-batches).

    The fault is written in ``on_after_backward``, i.e. after DDP's all-reduce, so the other ranks keep finite
    gradients. ``sanitize`` replaces non-finite gradients by zeros right before the optimizer step (after the guard
    recorded them), so the weights stay finite and later windows are clean: the guard must still reject.
    ``val_losses[epoch]`` is logged as ``val_loss`` to choose exactly which validation boundaries enter the top-K.
    With ``manual_save_dir``, every training epoch ends with a manual ``trainer.save_checkpoint`` there.
    At ``snapshot_steps`` and right before a fault, the checkpoint directory and callback state are snapshotted
    on every rank.
    """

    def __init__(
        self,
        fault_steps: Iterable[int] = (),
        snapshot_steps: Iterable[int] = (),
        fault_ranks: Sequence[int] = (0,),
        value: float = float("nan"),
        val_losses: Sequence[float] | None = None,
        zero1: bool = False,
        sanitize: bool = True,
        lr: float = 0.1,
        manual_save_dir: str | None = None,
        manual_weights_only: bool = False,
        fault_batches: Iterable[int] = (),
        fault_parameter: str = "layer.weight",
    ) -> None:
        super().__init__()
        self.fault_steps = set(fault_steps)
        self.snapshot_steps = set(snapshot_steps) | self.fault_steps
        self.fault_ranks = set(fault_ranks)
        self.value = value
        self.val_losses = val_losses
        self.zero1 = zero1
        self.sanitize = sanitize
        self.lr = lr
        self.manual_save_dir = manual_save_dir
        self.manual_weights_only = manual_weights_only
        self.fault_batches = set(fault_batches)
        self.fault_parameter = fault_parameter
        self.batch_idx = -1
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.consolidations = 0  # ZeRO-1 optimizer-state consolidations: the collective checkpoint collection

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.batch_idx = batch_idx
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        loss = out["x"] if self.val_losses is None else torch.tensor(float(self.val_losses[self.current_epoch]))
        self.log("val_loss", loss, sync_dist=self.val_losses is None)
        return out

    def on_after_backward(self) -> None:
        step = self.trainer.global_step
        if step in self.snapshot_steps:
            callback = next(c for c in self.trainer.callbacks if isinstance(c, ModelCheckpoint))
            self.snapshots[step] = {
                "tree": tree_digest(callback.dirpath),
                "state": ledger_state(callback),
                "consolidations": self.consolidations,
            }
        faulty = step in self.fault_steps or self.batch_idx in self.fault_batches
        if faulty and self.global_rank in self.fault_ranks:
            self.get_parameter(self.fault_parameter).grad.view(-1)[0] = self.value

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.sanitize:
            for p in self.parameters():
                if p.grad is not None:
                    torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)

    def on_train_epoch_end(self) -> None:
        if self.manual_save_dir is not None:
            path = os.path.join(self.manual_save_dir, f"manual-{self.current_epoch}.ckpt")
            self.trainer.save_checkpoint(path, weights_only=self.manual_weights_only)

    def configure_optimizers(self) -> Any:
        if self.zero1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            model = self

            class CountingZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
                def consolidate_state_dict(self, to: int = 0) -> None:
                    model.consolidations += 1
                    super().consolidate_state_dict(to)

            return CountingZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RaisesAtStep3(FaultyModel):
    """Raises an error of the user's own (``RuntimeError("boom on rank N")``) in the training step of global step 3."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_step == 3:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


class SleepsAtStep(FaultyModel):
    """Sleeps at the start of the given global steps, so a background write queued before each has finished by the
    next boundary."""

    def __init__(self, *steps: int) -> None:
        super().__init__()
        self.sleep_steps = set(steps)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step in self.sleep_steps:
            time.sleep(0.5)
        return super().training_step(batch, batch_idx)


def fit_outcome(fit: Callable[[], Any], write_errors: bool = False,
                also: tuple[type[Exception], ...] = ()) -> dict[str, Any]:
    """Run ``fit`` (a worker's ``trainer.fit``) and say how it ended, for the rank's result file: ``error`` is None,
    a ``NonFiniteGradientError``'s fields (with ``error_type`` and ``message``), with ``write_errors`` an ``OSError``
    or ``CheckpointWriteError`` (or one of ``also``) as its type and message, or anything else as ``unexpected``,
    with its trace, so the test shows what went wrong on which rank. ``elapsed``: the fit's seconds."""
    outcome: dict[str, Any] = {"error": None, "error_type": None}
    start = time.monotonic()
    try:
        fit()
    except NonFiniteGradientError as error:
        outcome.update(error=error.fields(), error_type=type(error).__name__, message=str(error))
    except Exception as error:
        if write_errors and isinstance(error, (OSError, CheckpointWriteError, *also)):
            outcome["error"] = {"type": type(error).__name__, "message": str(error)}
        else:
            outcome["error"] = {"unexpected": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    outcome["elapsed"] = time.monotonic() - start
    return outcome


def count_agreements(monkeypatch: Any) -> list[int]:
    """Count every agreement any ``GradientGuard`` runs from now on (the Trainer's strategy, single device, runs its
    collectives as no-ops): the returned list grows by one per agreement, with its global step."""
    from lightning_ckguard import GradientGuard

    agreements: list[int] = []
    original = GradientGuard.agree_carrying

    def counted(self: Any, collective: Any, carry: Sequence[int], **kwargs: Any) -> Any:
        agreements.append(kwargs.get("global_step", -1))
        return original(self, collective, carry, **kwargs)

    monkeypatch.setattr(GradientGuard, "agree_carrying", counted)
    return agreements


def reducing_with_peers(monkeypatch: Any, *calls: Sequence[Sequence[int]]) -> list[str]:
    """Stands in for ``torch.distributed.all_reduce`` in one process: call ``i`` reduces this rank's words with what
    the peers send to it (``calls[i]``, one list per peer), with MAX or SUM as asked, as every rank would. Returns
    the operations asked for, in order."""
    queue, ops = list(calls), []

    def all_reduce(tensor: Tensor, op: Any = None, group: Any = None) -> None:
        peers = [torch.tensor(words, dtype=tensor.dtype) for words in queue.pop(0)]
        stacked = torch.stack([tensor, *peers])
        name = "max" if op == torch.distributed.ReduceOp.MAX else "sum"
        tensor.copy_(stacked.amax(0) if name == "max" else stacked.sum(0))
        ops.append(name)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return ops


class DirectoryCheckpointStrategy(SingleDeviceStrategy):
    """A real single-device strategy that writes each checkpoint as a directory (as DeepSpeed and FSDP2 do), so
    directory publication runs in one process. A write whose path contains :attr:`fail_on` (which a test may change
    on the way) fails like a full disk, its directory made and left empty."""

    _save_distributed_checkpoint = True  # what marks Lightning's FSDP2 strategy as writing directories

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        # each write's path, and the hidden entries beside it as the write began
        self.writes: list[tuple[str, list[str]]] = []
        self.fail_on: str | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.is_global_zero:
            parent = os.path.dirname(str(filepath))
            names = os.listdir(parent) if os.path.isdir(parent) else []
            self.writes.append((str(filepath), sorted(n for n in names if n.startswith("."))))
            os.makedirs(filepath, exist_ok=True)  # into an existing one, as DeepSpeed does
            if self.fail_on is not None and self.fail_on in os.path.basename(str(filepath)):
                raise OSError(28, "No space left on device", str(filepath))
            torch.save(checkpoint, os.path.join(filepath, "state.pt"))


HOST_READS = ("_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose")


class CountOps(TorchDispatchMode):
    """Counts ATen ops by name; ``host_reads`` counts the ones that copy a value to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> int:
        return sum(1 for n in self.names if n.split(".")[0] in HOST_READS)


def refuse_removal_of_epoch_0(path: Any) -> None:
    """Fail like a busy file (``EBUSY``, as on NFS while a reader holds it) for a checkpoint named ``epoch=0...``."""
    if os.path.basename(str(path)).startswith("epoch=0"):
        raise OSError(errno.EBUSY, "Device or resource busy (injected)", str(path))


class BusyRemovalIO(TorchCheckpointIO):
    """Lightning's checkpoint IO (staged writes), whose removal of epoch 0's checkpoint fails."""

    def remove_checkpoint(self, path: Any) -> None:
        refuse_removal_of_epoch_0(path)
        super().remove_checkpoint(path)


def hook_writes(before: Callable[[str], None] | None = None,
                after: Callable[[str], None] | None = None) -> Callable[[], None]:
    """From now on, Lightning's ``TorchCheckpointIO`` in this process (any thread) runs ``before(path)`` before it
    writes a file and ``after(path)`` once it is written, ``path`` being what it was given (a staging name when the
    guard stages). Returns what undoes it.

    Faults and timings go in below ``save_checkpoint``, where a disk's would: the guard stages only Lightning's own
    ``save_checkpoint`` (a user's override gets the real name), so a test double overriding it would test the other
    write path."""
    module = sys.modules[TorchCheckpointIO.__module__]
    write = module._atomic_save

    def hooked(checkpoint: dict[str, Any], filepath: Any) -> None:
        if before is not None:
            before(str(filepath))
        write(checkpoint, filepath)
        if after is not None:
            after(str(filepath))

    module._atomic_save = hooked
    return lambda: setattr(module, "_atomic_save", write)


class FailingWrites:
    """While entered, every checkpoint file Lightning's ``TorchCheckpointIO`` writes in this process whose name
    contains :attr:`fail_on` (which a test may change on the way) fails like a full disk (:func:`hook_writes`)."""

    def __init__(self, fail_on: str) -> None:
        self.fail_on = fail_on
        self._undo: Callable[[], None] | None = None

    def _fail(self, path: str) -> None:
        if self.fail_on in os.path.basename(path):
            raise OSError(28, "No space left on device", path)

    def __enter__(self) -> FailingWrites:
        self._undo = hook_writes(before=self._fail)
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._undo is not None
        self._undo()


def refuse_moves_to(name: str, nth: int | None = None) -> Callable[[], None]:
    """From now on, rank 0's rename of a staging entry onto a checkpoint whose file name starts with ``name`` fails (a
    read-only directory entry, say), after the boundary's last collective; with ``nth``, only the ``nth`` such move
    (counting from 1). Returns what undoes it."""
    import lightning_ckguard.publish.staging as staging_module

    move = staging_module.move_into_place
    moves = 0

    def refusing(staging: str, filepath: str, keep_retired: bool = False) -> bool:
        nonlocal moves
        if os.path.basename(filepath).startswith(name):
            moves += 1
            if nth is None or moves == nth:
                raise OSError(30, "Read-only file system (injected)", filepath)
        return move(staging, filepath, keep_retired)

    staging_module.move_into_place = refusing  # type: ignore[assignment]
    return lambda: setattr(staging_module, "move_into_place", move)


def refuse_flushes_of_staging(name: str, directories_only: bool = False) -> Callable[[], None]:
    """From now on, this process's ``fsync`` of anything in the staging entry of a checkpoint whose file name starts
    with ``name`` fails (an I/O error the disk reports on flush); with ``directories_only``, only of its directories
    (which a writer such as torch's distributed checkpoint, flushing its own files, never flushes). Returns what undoes
    it."""
    from lightning_ckguard.publish.staging import staging_path

    fsync = os.fsync
    staged = os.path.basename(staging_path(name)).split(name)[0] + name  # the hidden prefix, then the name

    def refusing(descriptor: int) -> None:
        path = os.readlink(f"/proc/self/fd/{descriptor}")
        refused = not directories_only or os.path.isdir(path)
        if refused and any(part.startswith(staged) for part in path.split(os.sep)):
            raise OSError(5, "Input/output error (injected flush failure)")
        fsync(descriptor)

    os.fsync = refusing  # type: ignore[assignment]
    return lambda: setattr(os, "fsync", fsync)


def cross_device_tmpdir(reference: str) -> str | None:
    """A temporary directory on another filesystem than ``reference``: fsspec then *copies* its temporary file."""
    candidate = "/dev/shm"
    if os.path.isdir(candidate) and os.access(candidate, os.W_OK):
        if os.stat(candidate).st_dev != os.stat(reference).st_dev:
            return tempfile.mkdtemp(prefix="ckguard-tmp-", dir=candidate)
    return None


def cross_device_tmpdir_or_skip(reference: str) -> str:
    """``cross_device_tmpdir(reference)``, or skip the test where there is none (a ``worker_results`` env value)."""
    import pytest  # test side only: the workers import this module too

    tmpdir = cross_device_tmpdir(reference)
    if tmpdir is None:
        pytest.skip("needs a TMPDIR on another filesystem than the checkpoints (e.g. a tmpfs /dev/shm)")
    return tmpdir


def whole(tensor: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it together)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def unsharded_gradient_norm(parameters: Iterable[Tensor]) -> float:
    """``clip_grad_norm_`` over plain copies of the full gradients of ``parameters`` (those that have one): DDP's are
    whole already, a DTensor's shards are gathered (a collective per DTensor: every rank calls it together)."""
    copies = []
    for param in parameters:
        if param.grad is not None:
            copy = torch.nn.Parameter(whole(param.detach()).clone())
            copy.grad = whole(param.grad).detach().clone()
            copies.append(copy)
    return float(torch.nn.utils.clip_grad_norm_(copies, max_norm=float("inf")))


def run_scenarios(scenarios: dict[str, Callable[[str], dict[str, Any]]], out: str, only: set[str]) -> None:
    """Worker side: run each scenario (all of them, or those in ``only``) in order on this rank, rewriting
    ``out/rank{N}.json`` after each one, so a scenario that kills the process still leaves the earlier results."""
    results: dict[str, Any] = {}
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        results[name] = scenario(out)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
    leave_without_finalizing()


def deepspeed_unavailable_reported(out: str) -> bool:
    """Worker side, before any Trainer of a DeepSpeed kind: import the CPU shim (before DeepSpeed is imported anywhere,
    see ``tests/deepspeed_shim.py``); where DeepSpeed is not importable, write rank 0's ``{"unavailable": why}``
    (the test skips on it; rank 1 is never launched) and return True."""
    import deepspeed_shim

    if not deepspeed_shim.DEEPSPEED_UNAVAILABLE:
        return False
    with open(os.path.join(out, "rank0.json"), "w") as f:
        json.dump({"unavailable": deepspeed_shim.DEEPSPEED_UNAVAILABLE}, f)
    return True


def leave_without_finalizing() -> None:
    """End a worker rank whose results are written: destroy its process group, then exit with 0 at once.

    A DDP reducer that a garbage cycle keeps alive must not hold the gloo group's last reference, so cycles are
    collected while the group is still registered; and the interpreter's own finalization is skipped: destroying gloo
    objects there, in whatever order it frees them, ended ranks with ``terminate called without an active exception``
    (SIGABRT) or a deadlock on the GIL after every result was written (seen in CI, and on a loaded machine)."""
    if torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
