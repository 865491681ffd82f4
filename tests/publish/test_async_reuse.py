"""One ``AsyncCheckpointIO`` object across fits, and saves of the guard's names that are not the guard's.

A fit that raises (Lightning then calls ``on_exception``, never ``teardown``) gives the plugin back its own base IO, so
the next fit with that plugin (a new Trainer, or the same one fitted again) publishes in the background exactly as
with a fresh plugin; one a fit left behind anyway is seen through. A manual save of a name still queued on the
plugin's thread when a boundary writes that name stays the manual save's: the plugin's thread runs the two in the
order they were submitted, as under ``ModelCheckpoint``. The rest of background publication is in
``test_async.py``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from helpers import QUIET, AtStepEnd, FailingWrites, FaultyModel, hook_writes, ledger_state, relative_paths
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError
from lightning_ckguard.publish.background import PluginWrites
from lightning_ckguard.publish.staging import published_path

# the second fit resumes from step 2's checkpoint, mid-epoch: what Lightning warns about is not under test here
pytestmark = pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")

WRITE_SECONDS = 0.1


class RaisesAtStep(FaultyModel):
    """Raises a ``RuntimeError`` in the training step of global step ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.raise_step = step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.raise_step:
            raise RuntimeError(f"training_step failed at global step {self.global_step}")
        return super().training_step(batch, batch_idx)


class RecordingIO(TorchCheckpointIO):
    """Lightning's checkpoint IO that records each removal in ``events`` with what the directory holds then."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    def remove_checkpoint(self, path: Any) -> None:
        self.events.append(("evicted", os.path.basename(str(path)), sorted(os.listdir(os.path.dirname(str(path))))))
        super().remove_checkpoint(path)


def _guard(dirpath: Any) -> FiniteGradCheckpoint:
    return FiniteGradCheckpoint(dirpath=dirpath, filename="{step}", monitor="step", mode="max", save_top_k=1,
                                every_n_train_steps=2)


class WriterOfEachStep(Callback):
    """Records, at each step's end, which write path the guard's fit uses."""

    def __init__(self) -> None:
        self.writers: list[str] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        fit = trainer.checkpoint_callback._fit  # type: ignore[union-attr]
        self.writers.append(type(fit.writer).__name__)


def _trainer(callback: ModelCheckpoint, plugin: Any, max_steps: int, writers: WriterOfEachStep) -> Trainer:
    return Trainer(callbacks=[writers, callback], plugins=[plugin], max_steps=max_steps, limit_val_batches=0,
                   **QUIET)


def _slow_writes(events: list[tuple[Any, ...]]) -> Callable[[], None]:
    """Slow writes (below ``save_checkpoint``), each recorded in ``events`` once written; returns what undoes it."""
    return hook_writes(before=lambda path: time.sleep(WRITE_SECONDS),
                       after=lambda path: events.append(("written", os.path.basename(path))))


def _first_fit_raises(trainer: Trainer, cause: str) -> None:
    """A NaN gradient at step 3 (rejected at step 4's boundary, ``on_non_finite="raise"``), or a training step that
    raises at step 3: either way step 2's checkpoint was published."""
    seed_everything(0)
    model = FaultyModel(fault_steps=[3]) if cause == "nan" else RaisesAtStep(3)
    with pytest.raises(NonFiniteGradientError if cause == "nan" else RuntimeError):
        trainer.fit(model)


def _second_fit(trainer: Trainer, callback: FiniteGradCheckpoint, events: list[tuple[Any, ...]]) -> None:
    """Resumes from the published checkpoint, with slow writes."""
    undo = _slow_writes(events)
    try:
        seed_everything(0)
        trainer.fit(FaultyModel(), ckpt_path=callback.best_model_path)
    finally:
        undo()


def _reuse(tmp_path, cause: str, second: str, fresh: bool) -> dict[str, Any]:
    """Fit 1 raises; fit 2 (a new Trainer, or the same one again) with the same plugin, or a fresh one (``fresh``)."""
    events: list[tuple[Any, ...]] = []
    dirpath = tmp_path / ("fresh" if fresh else "reused") / cause / second.replace(" ", "-")
    callback, writers = _guard(dirpath), WriterOfEachStep()
    plugin = AsyncCheckpointIO(RecordingIO(events))
    trainer = _trainer(callback, plugin, 10, writers)
    _first_fit_raises(trainer, cause)
    given_back = (type(plugin.checkpoint_io).__name__, "save_checkpoint" in vars(plugin))
    if fresh:
        plugin = AsyncCheckpointIO(RecordingIO(events))
    if second == "new trainer":
        trainer = _trainer(callback, plugin, 10, writers)
    else:
        trainer.strategy.checkpoint_io = plugin
    events.clear()
    writers.writers.clear()
    _second_fit(trainer, callback, events)
    return {"given back": given_back, "writers": sorted(set(writers.writers)), "events": events,
            "files": sorted(os.listdir(dirpath)), "ledger": relative_paths(ledger_state(callback), dirpath)}


@pytest.mark.parametrize("second", ["new trainer", "same trainer"])
@pytest.mark.parametrize("cause", ["nan", "error"])
def test_after_a_fit_that_raised_the_same_plugin_publishes_in_the_background_as_a_fresh_one(tmp_path, cause, second):
    """Before the fix the first fit left the guard's stand-in under the plugin: the second fit's writes were direct
    (at the real name, unstaged) and each eviction ran while its replacement was still queued on the plugin's
    thread."""
    reused, fresh = (_reuse(tmp_path, cause, second, fresh) for fresh in (False, True))
    assert reused["writers"] == ["BackgroundWriter"]
    assert reused == fresh
    assert reused["given back"] == ("RecordingIO", False)  # the plugin's own base IO and save_checkpoint
    written = [event[1] for event in reused["events"] if event[0] == "written"]
    assert written and all(published_path(name) != name for name in written)  # each one staged
    evictions = [event for event in reused["events"] if event[0] == "evicted"]
    assert evictions
    for _, name, listing in evictions:  # nothing evicted before its replacement (two steps on) was published
        step = int(name.removeprefix("step=").removesuffix(".ckpt"))
        assert f"step={step + 2}.ckpt" in listing


def test_a_stand_in_left_under_the_plugin_is_seen_through(tmp_path):
    """A :class:`PluginWrites` a fit left under the plugin (as one that never reached its end would) does not turn
    the next fit's publication direct: the same events, files and ledger as with a fresh plugin."""
    outcomes = {}
    for kind in ("left behind", "fresh"):
        events: list[tuple[Any, ...]] = []
        plugin = AsyncCheckpointIO(RecordingIO(events))
        if kind == "left behind":
            PluginWrites.install(plugin)
        callback, writers = _guard(tmp_path / kind), WriterOfEachStep()
        trainer = _trainer(callback, plugin, 6, writers)
        undo = _slow_writes(events)
        try:
            seed_everything(0)
            trainer.fit(FaultyModel())
        finally:
            undo()
        outcomes[kind] = (sorted(set(writers.writers)), events, sorted(os.listdir(tmp_path / kind)),
                          relative_paths(ledger_state(callback), tmp_path / kind))
    assert outcomes["left behind"] == outcomes["fresh"]
    assert outcomes["fresh"][0] == ["BackgroundWriter"]


class SavesByHand(Callback):
    """At the start of global step 3 the user saves a big checkpoint (slow to write), then ``last.ckpt``, by hand:
    both still queued on the plugin's thread when step 4's boundary writes ``last.ckpt``."""

    def __init__(self, dirpath: Any) -> None:
        self.dirpath = dirpath

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            trainer.save_checkpoint(os.path.join(self.dirpath, "big.ckpt"))
            trainer.save_checkpoint(os.path.join(self.dirpath, "last.ckpt"))


def _slow_big_write() -> Callable[[], None]:
    return hook_writes(before=lambda path: time.sleep(0.5) if os.path.basename(path) == "big.ckpt" else None)


def test_a_queued_manual_save_of_last_does_not_take_the_boundary_s_place(tmp_path):
    """As with ``ModelCheckpoint`` under the same plugin, ``last.ckpt`` ends with the boundary's checkpoint (step 4),
    not the older manual one (step 3): the plugin's thread writes the manual save first, the boundary's after it.
    Before the fix the boundary's write took the manual one's place, was written at the real name, and the manual
    checkpoint was then published over it."""
    outcomes = {}
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        dirpath = tmp_path / cls.__name__
        callback = cls(dirpath=dirpath, every_n_train_steps=4, save_top_k=1, save_last=True, filename="{step}")
        trainer = Trainer(callbacks=[SavesByHand(dirpath), callback], plugins=[AsyncCheckpointIO()], max_steps=4,
                          limit_val_batches=0, **QUIET)
        undo = _slow_big_write()
        try:
            seed_everything(0)
            trainer.fit(FaultyModel())
        finally:
            undo()
        steps = {name: torch.load(dirpath / name, weights_only=False)["global_step"]
                 for name in sorted(os.listdir(dirpath))}
        outcomes[cls.__name__] = (steps, relative_paths(ledger_state(callback), dirpath))
    assert outcomes["FiniteGradCheckpoint"] == outcomes["ModelCheckpoint"]
    assert outcomes["ModelCheckpoint"][0]["last.ckpt"] == 4


def test_a_fit_whose_setup_fails_leaves_the_plugin_as_it_was(tmp_path):
    # the dirpath cannot be made (its parent is a file): setup raises, and Lightning runs no teardown
    (tmp_path / "a_file").write_text("")
    plugin = AsyncCheckpointIO()
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "a_file" / "ckpts")
    trainer = Trainer(max_steps=2, callbacks=[callback], plugins=[plugin], devices=1, limit_val_batches=0, **QUIET)
    with pytest.raises(PermissionError, match="cannot write checkpoints"):
        trainer.fit(FaultyModel())
    assert type(plugin._checkpoint_io) is TorchCheckpointIO and "save_checkpoint" not in vars(plugin)


def _manual_save(path: Any) -> Callable[[Trainer], None]:
    """A manual ``trainer.save_checkpoint(path)``, waiting for the plugin's thread to have run (and failed) its write
    before the next boundary."""

    def save(trainer: Trainer) -> None:
        trainer.save_checkpoint(path)
        trainer.strategy.checkpoint_io._executor.submit(lambda: None).result()

    return save


def test_a_boundary_whose_plugin_call_raises_an_earlier_error_is_never_written_at_its_name(tmp_path):
    # a manual save fails on the plugin's thread; the plugin then queues the next save and raises that error: the
    # boundary fails (on every rank), and the checkpoint it had queued must not appear at its name afterwards
    plugin = AsyncCheckpointIO()
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpts", filename="{step}", every_n_train_steps=2)
    trainer = Trainer(callbacks=[AtStepEnd(1, _manual_save(tmp_path / "manual.ckpt")), callback], plugins=[plugin],
                      max_steps=4, limit_val_batches=0, devices=1, **QUIET)
    with FailingWrites("manual"), pytest.raises(OSError, match="No space left"):
        trainer.fit(FaultyModel())
    # Lightning's teardown waited for the plugin's thread: whatever it was to write is written by now
    assert not (tmp_path / "ckpts").exists() or os.listdir(tmp_path / "ckpts") == []
