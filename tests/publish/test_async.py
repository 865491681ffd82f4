"""Asynchronous saves with Lightning's ``AsyncCheckpointIO``, in one process: the training step does not wait for the
write, boundaries publish in the order they were accepted (write, move into place, ``last``, evictions), and a
background write that fails surfaces at the next boundary with the ledger back to what is on disk. The two-rank
cases (a failure on rank 0 raised on both ranks, readers) are in ``test_publication_readers.py``; ``kill -9`` during a
background write in ``test_crash.py``; the plugin's own calls against ``ModelCheckpoint``'s in
``test_conformance.py``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

import lightning_ckguard.publish.background as background
import lightning_ckguard.publish.staging as staging_module
from helpers import QUIET, FailingWrites, FaultyModel, SleepsAtStep, hook_writes, refuse_moves_to
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.staging import published_path

WRITE_SECONDS = 0.25


class SlowIO(TorchCheckpointIO):
    """Torch checkpoint IO whose writes take ``WRITE_SECONDS`` while :meth:`slow` is entered, recording writes and
    removals in ``events``. The writes are slowed below ``save_checkpoint`` (:func:`hook_writes`): the guard stages
    only Lightning's own."""

    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events

    @contextlib.contextmanager
    def slow(self) -> Iterator[None]:
        undo = hook_writes(before=lambda path: time.sleep(WRITE_SECONDS), after=lambda path: self.events.append(
            ("written", os.path.basename(published_path(path)))))
        try:
            yield
        finally:
            undo()

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        self.events.append(("evicted", os.path.basename(str(path))))


class StepEnds(Callback):
    """Records each step's end in ``events``, and what the checkpoint directory holds then, before that step's
    boundary (Lightning runs checkpoint callbacks after the others)."""

    def __init__(self, events: list[tuple[str, Any]], dirpath: Any = None) -> None:
        self.events = events
        self.dirpath = dirpath
        self.listings: dict[int, list[str]] = {}

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.events.append(("step", trainer.global_step))
        if self.dirpath is not None:
            self.listings[trainer.global_step] = sorted(os.listdir(self.dirpath))


def _fit(tmp_path, plugin: Any, callback: ModelCheckpoint, max_steps: int = 6, extra: list | None = None,
         model: FaultyModel | None = None) -> Trainer:
    seed_everything(0)
    trainer = Trainer(callbacks=[callback, *(extra or [])], max_steps=max_steps, limit_val_batches=0,
                      plugins=[plugin] if plugin is not None else None, **QUIET)
    trainer.fit(model or FaultyModel())
    return trainer


def _newest_two(tmp_path, **kwargs: Any) -> dict[str, Any]:
    return {"dirpath": tmp_path, "filename": "{step}", "monitor": "step", "mode": "max", "save_top_k": 2,
            "save_last": True, "every_n_train_steps": 2, **kwargs}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_boundaries_publish_in_acceptance_order_after_their_write_while_training_goes_on(tmp_path, monkeypatch,
                                                                                      save_last):
    events: list[tuple[str, Any]] = []
    move = staging_module.move_into_place

    def recorded_move(staging: str, filepath: str, keep_retired: bool = False) -> bool:
        retired = move(staging, filepath, keep_retired)
        events.append(("published", os.path.basename(filepath)))
        assert os.path.exists(filepath)  # a link resolves: its target was published before it
        return retired

    monkeypatch.setattr(staging_module, "move_into_place", recorded_move)
    callback = FiniteGradCheckpoint(**_newest_two(tmp_path, save_last=save_last))
    io = SlowIO(events)
    with io.slow():
        _fit(tmp_path, AsyncCheckpointIO(io), callback, extra=[StepEnds(events)])
    # the step did not wait: training reached its last step before the first write was done, three boundaries queued
    assert events.index(("step", 6)) < events.index(("written", "step=2.ckpt"))
    storage = [event for event in events if event[0] != "step"]
    # each boundary: its writes, then its moves into place (`last` after the top-K file), then its evictions
    last_written = [("written", "last.ckpt")] if save_last is True else []
    expected: list[tuple[str, Any]] = []
    for step, evicted in ((2, None), (4, None), (6, "step=2.ckpt")):
        expected += [("written", f"step={step}.ckpt"), *last_written, ("published", f"step={step}.ckpt"),
                     ("published", "last.ckpt"), *([("evicted", evicted)] if evicted else [])]
    assert storage == expected
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6
    assert sorted(callback.best_k_models) == [str(tmp_path / "step=4.ckpt"), str(tmp_path / "step=6.ckpt")]
    if save_last == "link":  # relative, as ModelCheckpoint links it: the run directory can be moved
        assert os.readlink(tmp_path / "last.ckpt") == "step=6.ckpt"


def test_the_same_files_and_ledger_as_a_synchronous_fit(tmp_path):
    callbacks = {}
    for kind, plugin in (("sync", None), ("async", AsyncCheckpointIO())):
        callbacks[kind] = FiniteGradCheckpoint(**_newest_two(tmp_path / kind))
        _fit(tmp_path / kind, plugin, callbacks[kind], max_steps=8)
    assert sorted(os.listdir(tmp_path / "sync")) == sorted(os.listdir(tmp_path / "async"))
    states = {kind: {k: str(v).replace(str(tmp_path / kind), "") for k, v in cb.state_dict().items()}
              for kind, cb in callbacks.items()}
    assert states["sync"] == states["async"]


@pytest.mark.parametrize("failing", ["step=4", "step=6"])
def test_a_failed_background_write_raises_by_the_next_boundary_and_the_ledger_returns_to_what_is_on_disk(
    tmp_path, failing
):
    """Keep-the-newest (``save_top_k=1``): the failed write's boundary would have evicted ``step=2.ckpt``. A failure
    of step 4's write is noticed at the boundary of step 6; one of the last boundary's (step 6) at the end of
    training. Either way the error is the write's own, nothing partial is left, and the checkpoint the failed
    boundary would have evicted is still there and still the best.

    The reproduction of issue 15: before background publication, ``FiniteGradCheckpoint`` handed an
    ``AsyncCheckpointIO`` write the real path, as ``ModelCheckpoint`` does (the staging rename of an earlier release
    raised ``FileNotFoundError`` instead, the write still queued): step 4's boundary evicted ``step=2.ckpt`` while
    its own write was queued, so at step 5 the directory was empty, and this test fails there."""
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="{step}", monitor="step", mode="max", save_top_k=1,
                                    every_n_train_steps=2)
    steps = StepEnds([], tmp_path)
    with FailingWrites(failing), pytest.raises(OSError, match="No space left on device"):
        _fit(tmp_path, AsyncCheckpointIO(), callback, extra=[steps],
             model=SleepsAtStep(4), max_steps=6 if failing == "step=6" else 8)
    # step 4's failure: raised at step 6's boundary (which published nothing), not later
    assert steps.events[-1] == ("step", 6)
    if failing == "step=4":  # after the failed write, before the next boundary: the checkpoint it would have evicted
        assert steps.listings[5] == ["step=2.ckpt"]
    expected = ["step=2.ckpt"] if failing == "step=4" else ["step=4.ckpt"]
    assert sorted(os.listdir(tmp_path)) == expected
    assert list(callback.best_k_models) == [str(tmp_path / expected[0])]
    assert callback.best_model_path == str(tmp_path / expected[0])
    assert callback.last_model_path == ""


def test_boundaries_queued_behind_a_failing_write_publish_nothing(tmp_path):
    # a checkpoint every step; step 2's write fails after a second, while the boundaries of the steps after it are
    # queued behind it: none of them may be put in place once a unit before it failed
    def fails_slowly(path: str) -> None:
        if os.path.basename(published_path(path)) == "step=2.ckpt":
            time.sleep(1.0)
            raise OSError(28, "No space left on device", path)

    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="{step}", monitor="step", mode="max", save_top_k=1,
                                    every_n_train_steps=1)
    undo = hook_writes(before=fails_slowly)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            _fit(tmp_path, AsyncCheckpointIO(), callback, max_steps=6)
    finally:
        undo()
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt"]
    assert callback.best_model_path == str(tmp_path / "step=1.ckpt")
    assert list(callback.best_k_models) == [str(tmp_path / "step=1.ckpt")]


@pytest.mark.parametrize("filename", ["best", "last"])
def test_a_unit_whose_last_cannot_be_put_in_place_puts_back_what_it_replaced(tmp_path, filename):
    """Each boundary's top-1 checkpoint has one name: ``best`` (replaced by each better one), or ``last`` itself
    (written twice per boundary with ``save_last``, into one staging entry: one move). Step 4's unit replaces
    ``best``, then the move of its ``last`` is refused: each name holds step 2's checkpoint again, as the rolled-back
    ledger says, and nothing hidden is left."""
    callback = FiniteGradCheckpoint(**_newest_two(tmp_path, filename=filename, save_top_k=1,
                                                  enable_version_counter=False))
    undo = refuse_moves_to("last.ckpt", nth=2)  # step 4's `last`
    try:
        with pytest.raises(OSError, match="injected"):
            _fit(tmp_path, AsyncCheckpointIO(), callback, max_steps=4)
    finally:
        undo()
    names = sorted({f"{filename}.ckpt", "last.ckpt"})
    assert sorted(os.listdir(tmp_path)) == names
    assert [torch.load(tmp_path / name, weights_only=False)["global_step"] for name in names] == [2] * len(names)
    assert callback.best_model_path == str(tmp_path / f"{filename}.ckpt")
    assert callback.best_model_score == 2


@pytest.mark.parametrize("save_last", [True, "link"])
def test_a_boundary_whose_last_cannot_be_put_in_place_is_undone_and_the_previous_last_stays(tmp_path, monkeypatch,
                                                                                          save_last):
    # step 4's unit puts `step=4.ckpt` in place, then its `last` (a copy moved over the old one, or a link) is refused:
    # the unit's new name goes, and the `last` step 2 published is still there, whole
    def refused(source: str, destination: str, **options: Any) -> None:
        raise OSError(30, "Read-only file system (injected)", destination)

    module, operation = (staging_module, "move_into_place") if save_last is True else (background, "make_link")
    original = getattr(module, operation)

    def refuses_last_at_step_4(source: str, destination: str, **options: Any) -> Any:
        if save_last is True:  # the copy moved over the old `last`, once `step=4.ckpt` is in place
            last_of_step_4 = os.path.basename(destination) == "last.ckpt" and (tmp_path / "step=4.ckpt").exists()
        else:  # the link to `step=4.ckpt`
            last_of_step_4 = os.path.basename(source) == "step=4.ckpt"
        return (refused if last_of_step_4 else original)(source, destination, **options)

    monkeypatch.setattr(module, operation, refuses_last_at_step_4)
    callback = FiniteGradCheckpoint(**_newest_two(tmp_path, save_last=save_last))
    with pytest.raises(OSError, match="injected"):
        _fit(tmp_path, AsyncCheckpointIO(), callback, max_steps=4)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2
    assert list(callback.best_k_models) == [str(tmp_path / "step=2.ckpt")]
    assert callback.last_model_path == str(tmp_path / "last.ckpt")


def test_model_checkpoint_with_async_checkpoint_io_loses_the_evicted_checkpoint_when_the_write_fails(tmp_path):
    """The control: plain ``ModelCheckpoint`` evicts while the new checkpoint is still queued; when the write fails,
    both are gone: until the next boundary there is no checkpoint at all, while its ledger names the missing one."""
    callback = ModelCheckpoint(dirpath=tmp_path, filename="{step}", monitor="step", mode="max", save_top_k=1,
                               every_n_train_steps=2)
    steps = StepEnds([], tmp_path)
    with FailingWrites("step=4"), pytest.raises(OSError, match="No space left on device"):
        # the pause at step 3 lets step 2's write finish before step 4's boundary removes it: else the removal can
        # come first, and the write leaves the file behind afterwards
        _fit(tmp_path, AsyncCheckpointIO(), callback, extra=[steps], model=SleepsAtStep(3, 4),
             max_steps=8)
    assert steps.listings[5] == []


class OwnIO(TorchCheckpointIO):
    """A user's own checkpoint IO that takes ``storage_options`` (``TorchCheckpointIO`` refuses them)."""

    def __init__(self) -> None:
        self.options: list[Any] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.options.append(storage_options)
        super().save_checkpoint(checkpoint, path)


@pytest.mark.parametrize("kind", ["own", "async over own"])
def test_other_checkpoint_io_plugins_keep_working_with_storage_options(tmp_path, kind):
    own = OwnIO()
    plugin = own if kind == "own" else AsyncCheckpointIO(own)
    callback = FiniteGradCheckpoint(**_newest_two(tmp_path))
    trainer = _fit(tmp_path, plugin, callback)
    trainer.save_checkpoint(tmp_path / "manual.ckpt", storage_options={"compress": False})
    trainer.strategy.checkpoint_io.teardown()  # AsyncCheckpointIO: wait for its thread
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "manual.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert own.options[-1] == {"compress": False}
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6


class WritesItself(AsyncCheckpointIO):
    """A subclass whose ``save_checkpoint`` writes the file itself, synchronously, instead of calling ``super()``."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved.append(os.path.basename(str(path)))
        TorchCheckpointIO().save_checkpoint(checkpoint, path)


def test_an_override_that_writes_by_itself_is_published_where_it_wrote_and_nothing_waits_for_it(tmp_path):
    """Not staged (documented): the override gets the real path and writes there; the guard's unit finds nothing in
    staging, publishes nothing of its own, and the fit ends with ModelCheckpoint's files and ledger."""
    results = {}
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        plugin = WritesItself()
        callback = cls(**_newest_two(tmp_path / cls.__name__))
        _fit(tmp_path / cls.__name__, plugin, callback)
        results[cls.__name__] = (plugin.saved, sorted(os.listdir(tmp_path / cls.__name__)),
                                 sorted(os.path.basename(p) for p in callback.best_k_models))
    assert results["FiniteGradCheckpoint"] == results["ModelCheckpoint"]
    assert results["ModelCheckpoint"][1] == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
