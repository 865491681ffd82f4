"""Side-by-side runs of ``ModelCheckpoint`` and a subclass, and everything a user can observe of each.

A *side* is one callback class fitted into its own root directory with the same arguments, the same seed and the same
scripted model. :func:`observe` runs a side and returns what a user can see of it as plain, comparable values (paths
relative to the root): the files and links on disk with each checkpoint's loaded content, the callback's bookkeeping
and ``state_dict``, the verbose log lines and warnings, how often ``ModelCheckpoint``'s hooks read the clock, how
often ``trainer.save_checkpoint`` was called and how many files the checkpoint IO wrote and removed, what a logger
was told, and the error ``fit`` raised, if any. :func:`differences` lists where two observations differ.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any
from unittest import mock

import lightning.pytorch.callbacks.model_checkpoint as model_checkpoint_module
import lightning.pytorch.trainer.connectors.logger_connector.result as results_module
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor

from helpers import QUIET, hook_writes, ledger_state, tree_digest

#: The logger ``rank_zero_info`` writes to: ModelCheckpoint's verbose lines.
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
#: The one key FiniteGradCheckpoint adds to ModelCheckpoint's callback state.
FORMAT_KEY = "ckguard_format_version"
#: Metrics FiniteGradCheckpoint logs to the Trainer's loggers, documented in the README ("Logged metrics").
GUARD_METRIC_PREFIX = "ckguard/"
ROOT = "<root>"

#: The bookkeeping a user reads after ``fit`` (and ModelCheckpoint's private markers that decide its next saves).
ATTRIBUTES = (
    "best_k_models",
    "best_model_path",
    "best_model_score",
    "last_model_path",
    "kth_value",
    "kth_best_model_path",
    "current_score",
    "dirpath",
    "_last_global_step_saved",
    "_last_checkpoint_saved",
    "_last_time_checked",
    "_defer_save_until_validation",
)


class FakeClock:
    """Replaces the ``time`` module inside ``lightning.pytorch.callbacks.model_checkpoint``.

    Time is driven by the training progress (the model advances it per batch), never by the reads, so a callback that
    reads the clock more often still sees the same times; ``reads`` counts the reads.
    """

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedModel(BoringModel):
    """BoringModel whose monitored values are chosen up front, so every top-K decision is deterministic.

    ``val_values[i]`` is logged as ``val_key`` by the ``i``-th validation run (several per epoch with a fractional
    ``val_check_interval``); ``train_values[global_step]`` is logged as ``train_key`` in every training step. Each
    training batch advances ``clock`` by ``seconds_per_batch``. With ``manual``, the model optimizes manually; with
    ``keep_pre_step_state`` as well, it keeps ``saved_models`` (the pre-optimization state ModelCheckpoint saves for
    manual optimization). ``raise_at_step`` raises a ``RuntimeError`` in that global step. ``nan_at_step`` writes a
    ``NaN`` into one gradient element after each backward of that global step, on ``nan_ranks``; right before, on
    every rank, it keeps what the checkpoint callback has published (``before_nan``: its directory, its ledger).
    """

    def __init__(
        self,
        val_values: Sequence[float] | None = None,
        val_key: str = "val_loss",
        train_values: Sequence[float] | None = None,
        train_key: str = "train_metric",
        clock: FakeClock | None = None,
        seconds_per_batch: float = 1.0,
        manual: bool = False,
        keep_pre_step_state: bool = False,
        raise_at_step: int | None = None,
        nan_at_step: int | None = None,
        nan_ranks: Sequence[int] = (0,),
    ) -> None:
        super().__init__()
        self.val_values = val_values
        self.val_key = val_key
        self.train_values = train_values
        self.train_key = train_key
        self.clock = clock
        self.seconds_per_batch = seconds_per_batch
        self.automatic_optimization = not manual
        self.keep_pre_step_state = keep_pre_step_state
        self.raise_at_step = raise_at_step
        self.nan_at_step = nan_at_step
        self.nan_ranks = tuple(nan_ranks)
        self.before_nan: dict[str, Any] | None = None
        self.validation_runs = 0
        self.resumed_from: str | None = None

    def on_fit_start(self) -> None:
        # what the fit resumed from, through a `last` link as it was then (before the fit moves the link)
        path = self.trainer.ckpt_path
        self.resumed_from = os.path.realpath(path) if path and os.path.exists(path) else path

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.clock is not None:
            self.clock.advance(self.seconds_per_batch)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.raise_at_step is not None and self.global_step == self.raise_at_step:
            raise RuntimeError(f"scripted failure at global step {self.global_step}")
        if self.train_values is not None:
            self.log(self.train_key, float(self.train_values[self.global_step % len(self.train_values)]))
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        if self.keep_pre_step_state:
            saved = getattr(self, "saved_models", {})
            saved[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
            self.saved_models = saved
        loss = self.step(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        if self.val_values is not None:
            self.log(self.val_key, float(self.val_values[self.validation_runs % len(self.val_values)]))
        return out

    def on_validation_epoch_end(self) -> None:
        self.validation_runs += 1

    def on_after_backward(self) -> None:
        if self.global_step != self.nan_at_step:
            return
        # each micro-batch's: a boundary may come between two (validation in the middle of an accumulation)
        self.before_nan = published(self.trainer.checkpoint_callback)
        if self.global_rank in self.nan_ranks:
            self.layer.weight.grad.view(-1)[0] = float("nan")


def published(callback: Any) -> dict[str, Any]:
    """What ``callback`` has published: its directory's entries (content hashes, link targets) and its ledger."""
    return {"files": tree_digest(callback.dirpath), "ledger": ledger_state(callback)}


class CountingIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO, counting the files it removes (its writes are counted below
    ``save_checkpoint``, by :func:`~helpers.hook_writes`: the guard stages only Lightning's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.removes = 0
        self.removed: list[str] = []

    def remove_checkpoint(self, path: Any) -> None:
        self.removes += 1
        self.removed.append(str(path))
        super().remove_checkpoint(path)


class RecordingCSVLogger(CSVLogger):
    """A CSVLogger that records what a checkpoint-uploading logger reads in ``after_save_checkpoint``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.after_save: list[dict[str, Any]] = []

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        saved = checkpoint_callback._last_checkpoint_saved
        self.after_save.append({
            "last_checkpoint_saved": saved,
            "exists": bool(saved) and os.path.exists(saved),
            "best_model_path": checkpoint_callback.best_model_path,
            "last_model_path": checkpoint_callback.last_model_path,
            "best_k_models": dict(checkpoint_callback.best_k_models),
        })
        super().after_save_checkpoint(checkpoint_callback)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


@contextmanager
def _captured_logs() -> Iterator[list[str]]:
    logger = logging.getLogger(RANK_ZERO_LOGGER)
    handler = _Records()
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@dataclass
class Side:
    """One callback class fitted into ``root``; ``make_callback`` builds it (per fit unless ``same_callback``)."""

    root: str
    make_callback: Callable[[], ModelCheckpoint]
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    fits: int = 1
    same_callback: bool = False
    logger: bool = False
    mock_save: bool = False
    #: FiniteGradCheckpoint's side: the one extra key of its state, ``ckguard_format_version``, is left out
    guarded: bool = False
    #: the ``ckpt_path`` every fit after the first resumes from (``"last"``, ``"best"``), or None
    resume: str | None = None
    #: what the Trainer of every fit after the first takes instead of ``trainer_kwargs`` (a resumed fit trains on)
    later_trainer_kwargs: dict[str, Any] | None = None
    #: what the last fit's model takes on top of ``model_kwargs`` (a fault in it)
    last_model_kwargs: dict[str, Any] = field(default_factory=dict)


def observe(side: Side, monkeypatch: Any) -> dict[str, Any]:
    """Fit ``side`` (``side.fits`` times into the same root) and return everything a user can observe of it."""
    os.makedirs(side.root, exist_ok=True)
    clock = FakeClock()
    monkeypatch.setattr(model_checkpoint_module, "time", clock)
    # ModelCheckpoint and the logging of results warn some things once per process; each side must see them afresh
    model_checkpoint_module.warning_cache.clear()
    results_module.warning_cache.clear()
    callback: ModelCheckpoint | None = None
    loggers: list[RecordingCSVLogger] = []
    ios: list[CountingIO] = []
    save_calls = 0
    mock_calls: list[Any] = []
    errors: list[str | None] = []
    resumed_from: list[str | None] = []
    with _captured_logs() as logs, warnings.catch_warnings(record=True) as caught, _written_files() as written:
        warnings.simplefilter("always")
        for fit in range(side.fits):
            if callback is None or not side.same_callback:
                callback = side.make_callback()
            seed_everything(0, verbose=False)
            io = CountingIO()
            ios.append(io)
            kwargs: dict[str, Any] = {**QUIET, "default_root_dir": side.root, "num_sanity_val_steps": 0}
            if side.logger:
                loggers.append(RecordingCSVLogger(save_dir=side.root))
                kwargs["logger"] = loggers[-1]
            loop = side.later_trainer_kwargs if fit and side.later_trainer_kwargs is not None else side.trainer_kwargs
            trainer = Trainer(callbacks=[callback], plugins=[io], **{**kwargs, **loop})
            if side.mock_save:
                save = mock.Mock()
                trainer.save_checkpoint = save  # as Lightning's own tests do: nothing is written
            else:
                save = _counting(trainer.save_checkpoint)
                trainer.save_checkpoint = save
            last = side.last_model_kwargs if fit == side.fits - 1 else {}
            model = ScriptedModel(clock=clock, **{**side.model_kwargs, **last})
            try:
                trainer.fit(model, ckpt_path=side.resume if fit else None)
                errors.append(None)
            except Exception as error:  # compared like any other observation
                errors.append(_describe(error))
            resumed_from.append(getattr(model, "resumed_from", None))
            if side.mock_save:
                save_calls += save.call_count
                mock_calls.extend((tuple(c.args), dict(c.kwargs)) for c in save.call_args_list)
            else:
                save_calls += save.calls
    assert callback is not None
    # with a fault in the last fit: what its callback had published before the NaN (None: none came), and at the end
    fault = dict(before_nan=model.before_nan, published=published(callback)) if side.last_model_kwargs else {}
    observation = {
        **fault,
        "errors": errors,
        "resumed_from": resumed_from,
        "tree": tree(side.root, side.guarded),
        "state_key": callback.state_key,
        "attributes": {name: getattr(callback, name, "<missing>") for name in ATTRIBUTES},
        "state_dict": _without_format_key(callback.state_dict()) if side.guarded else callback.state_dict(),
        "logs": list(logs),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "clock_reads": clock.reads,
        "save_checkpoint_calls": save_calls,
        "io_saves": len(written),
        "io_removes": sum(io.removes for io in ios),
        "io_removed": [path for io in ios for path in io.removed],
        "mock_calls": mock_calls,
        "after_save_checkpoint": [logger.after_save for logger in loggers],
    }
    return normalize(observation, side.root)


@contextmanager
def _written_files() -> Iterator[list[str]]:
    """The files Lightning's ``TorchCheckpointIO`` writes meanwhile, listed as they are written."""
    written: list[str] = []
    stop = hook_writes(after=written.append)
    try:
        yield written
    finally:
        stop()


def _counting(save: Callable[..., Any]) -> Any:
    def counting(*args: Any, **kwargs: Any) -> Any:
        counting.calls += 1  # type: ignore[attr-defined]
        return save(*args, **kwargs)

    counting.calls = 0  # type: ignore[attr-defined]
    return counting


def _describe(error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return f"{type(error).__name__}: {error} (raised at {where})"


def _without_format_key(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: v for k, v in state.items() if k != FORMAT_KEY}
    return state


def tree(root: str, guarded: bool = False) -> dict[str, Any]:
    """Every entry under ``root`` (symlinks not followed): directories, links with their target, files with their
    permission bits and content (checkpoints loaded; CSV metrics parsed, the guard's own metrics left out). With
    ``guarded``, ``ckguard_format_version`` is left out of the checkpoints' callback states."""
    entries: dict[str, Any] = {}
    guard_metrics_alone: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            mode = oct(os.lstat(path).st_mode & 0o777)
            if os.path.islink(path):
                entries[rel] = {"link": os.readlink(path), "resolves": os.path.exists(path)}
            elif os.path.isdir(path):
                entries[rel] = {"dir": mode}
            elif (content := _content(path, guarded)) is not _GUARD_METRICS_ALONE:
                entries[rel] = {"file": mode, "content": content}
            else:
                guard_metrics_alone.append(rel)
    # a directory left holding nothing else may have been made for them alone (a fit that logged nothing else):
    # marked, for ``differences`` to leave out where the reference has no such directory
    for rel in guard_metrics_alone:
        parent = os.path.dirname(rel)
        while parent and not any(other.startswith(parent + os.sep) for other in entries):
            entries[parent] = {**entries[parent], _FOR_GUARD_METRICS: True}
            parent = os.path.dirname(parent)
    return entries


_FOR_GUARD_METRICS = "holds only the guard's metrics"


def _reconciled(reference: dict[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (the guarded side's) without the directories that held only the guard's metrics where the reference
    has none, and with the mark taken off those it has too."""
    return {path: {k: v for k, v in entry.items() if k != _FOR_GUARD_METRICS} for path, entry in tree.items()
            if not entry.get(_FOR_GUARD_METRICS) or path in reference}


#: What :func:`_content` returns for a metrics file that holds only the guard's own metrics: its logger wrote it for
#: them alone (nothing else was logged by the end of the fit), so it is left out, as they are.
_GUARD_METRICS_ALONE = object()


def _content(path: str, guarded: bool) -> Any:
    if path.endswith(".ckpt"):
        checkpoint = torch.load(path, weights_only=False, map_location="cpu")
        if "callbacks" in checkpoint:
            # the state keys, and the states in that order (the one callback's state is compared even when the keys
            # differ); on the guarded side without ``ckguard_format_version``
            states = checkpoint.pop("callbacks")
            checkpoint["callback_state_keys"] = list(states)
            checkpoint["callback_states"] = [_without_format_key(s) if guarded else s for s in states.values()]
        return checkpoint
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not guarded:
            return rows
        # the guard's documented metrics out, and the rows that only held them (Lightning's rows all have an epoch)
        held = [{k: v for k, v in row.items() if not k.startswith(GUARD_METRIC_PREFIX)} for row in rows]
        held = [row for row in held if any(v for k, v in row.items() if k != "step")]
        return _GUARD_METRICS_ALONE if rows and not held else held
    with open(path, "rb") as f:
        return f.read()


def normalize(value: Any, root: str) -> Any:
    """``value`` with the side's root directory replaced by a placeholder, in every string, key and path."""
    roots = sorted({str(root), os.path.realpath(root)}, key=len, reverse=True)

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            for r in roots:
                v = v.replace(r, ROOT)
            return v
        if isinstance(v, bytes):
            for r in roots:
                v = v.replace(r.encode(), ROOT.encode())
            return v
        if isinstance(v, PurePath):
            return type(v)(walk(str(v)))
        if isinstance(v, dict):
            return {walk(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return v

    return walk(value)


def differences(reference: Any, other: Any, where: str = "", limit: int = 60) -> list[str]:
    """Where ``other`` differs from ``reference``: types, dict keys and their order, tensors by dtype, shape and value
    (NaN equal to NaN), floats (NaN equal to NaN), everything else by ``==``."""
    found: list[str] = []
    if isinstance(reference, dict) and isinstance(other, dict) and "tree" in reference and "tree" in other:
        other = {**other, "tree": _reconciled(reference["tree"], other["tree"])}  # two observations
    _diff(reference, other, where, found, limit)
    return found


def _diff(a: Any, b: Any, where: str, found: list[str], limit: int) -> None:
    if len(found) >= limit:
        return
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or not same_tensor(a, b):
            found.append(f"{where}: {_short(a)} != {_short(b)}")
        return
    if type(a) is not type(b):
        found.append(f"{where}: {type(a).__name__} {_short(a)} != {type(b).__name__} {_short(b)}")
        return
    if isinstance(a, dict):
        for key in a:
            if key not in b:
                found.append(f"{where}[{key!r}]: missing (reference has {_short(a[key])})")
        for key in b:
            if key not in a:
                found.append(f"{where}[{key!r}]: unexpected {_short(b[key])}")
        common_a, common_b = [k for k in a if k in b], [k for k in b if k in a]
        if common_a != common_b:
            found.append(f"{where}: key order {common_a} != {common_b}")
        for key in common_a:
            _diff(a[key], b[key], f"{where}[{key!r}]", found, limit)
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            found.append(f"{where}: length {len(a)} != {len(b)}: {_short(a, 800)} != {_short(b, 800)}")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(x, y, f"{where}[{i}]", found, limit)
        return
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return
    if a != b:
        found.append(f"{where}: {_short(a)} != {_short(b)}")


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and values; NaN equals NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])
    return torch.equal(a, b)


def same_value(a: Any, b: Any) -> bool:
    """Equality as ModelCheckpoint's own ``vars`` comparisons need it: tensors by value, containers recursively."""
    return not differences(a, b, limit=1)


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
