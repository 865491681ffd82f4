"""Accepted boundaries commit, then serialize; a failed write rolls the ledger back and keeps the evicted file."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from helpers import (
    QUIET,
    DirectoryCheckpointStrategy,
    FailingWrites,
    FaultyModel,
    HookFailsAt,
    hook_writes,
    ledger_state,
    refuse_moves_to,
    tree_digest,
)
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.ledger import Ledger

EPOCHS = dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


def test_checkpoint_state_lists_the_file_being_written(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    Trainer(callbacks=[callback], **QUIET, **EPOCHS).fit(FaultyModel(val_losses=[3.0, 2.0, 1.0]))
    for path in [*callback.best_k_models, callback.last_model_path]:
        state = torch.load(path, weights_only=False)["callbacks"][callback.state_key]
        if os.path.basename(path) != "last.ckpt":
            assert path in state["best_k_models"], f"{path} does not list itself"
            assert state["best_model_path"] == path  # each epoch improved, so each file was the best when written
        else:
            assert state["last_model_path"] == path


@pytest.mark.parametrize("failing", ["epoch=1", "last"])
def test_failed_serialization_rolls_back_and_keeps_evicted_file(failing, tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    with FailingWrites(failing) as disk, pytest.raises(OSError, match="No space left"):
        if failing == "last":
            # let epoch 0 write its `last` before the disk "fills up"
            disk.fail_on = "never"
            model.on_train_epoch_start = lambda: setattr(  # type: ignore[method-assign]
                disk, "fail_on", "last" if trainer.current_epoch == 1 else "never")
        trainer.fit(model)
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"], "the ledger was not rolled back"
    assert tree_digest(str(tmp_path)) == before["tree"], "files changed after a failed boundary"
    assert "epoch=0-step=2.ckpt" in before["tree"]  # the file the failed boundary would have evicted
    assert callback.best_model_path == str(tmp_path / "epoch=0-step=2.ckpt")


class ListsItsWrites(TorchCheckpointIO):
    """A checkpoint IO of the user's own: it writes at the name it is given (nothing is staged), listing each."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.written.append(os.path.basename(str(path)))
        super().save_checkpoint(checkpoint, path, storage_options)


class ListsItsSaves(FaultyModel):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved_in_epochs: list[int] = []

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.saved_in_epochs.append(self.current_epoch)


@pytest.mark.parametrize("hook", ["state_dict", "on_save_checkpoint"])
def test_a_hook_failing_before_the_write_raises_its_error_and_nothing_more_runs_or_is_written(hook, tmp_path):
    # the hook's failure is held until the agreement after the write (so that peers are not left waiting); on the
    # rank that would write, the checkpoint the hook left unfinished must not reach an IO that writes at the real name
    io = ListsItsWrites()
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = ListsItsSaves(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback, HookFailsAt(hook, rank=0, epoch=1)], plugins=[io], **QUIET, **EPOCHS)
    with pytest.raises(RuntimeError, match="hook failed on rank 0"):
        trainer.fit(model)
    assert io.written == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert model.saved_in_epochs == [0, 0], "a hook after the failed one ran"
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"], "the ledger was not rolled back"
    assert tree_digest(str(tmp_path)) == before["tree"], "files changed after a failed boundary"


@pytest.mark.parametrize("save_last", [True, "link"])
def test_a_name_an_earlier_write_of_a_failed_boundary_replaced_is_put_back(save_last, tmp_path):
    """``best.ckpt`` is overwritten by each better epoch; epoch 1's write of it succeeds, then its ``last`` fails:
    ``best.ckpt`` holds epoch 0's checkpoint again, as the rolled-back ledger says, with nothing hidden left."""
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="best", monitor="val_loss", save_top_k=1,
                                    save_last=save_last)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    undo: list[Callable[[], None]] = []

    def fail_in_epoch_1() -> None:
        if trainer.current_epoch == 1 and save_last is True:
            disk.fail_on = "last"  # its write fails
        elif trainer.current_epoch == 1:  # the link's move into place fails: held, raised at the next boundary
            undo.append(refuse_moves_to("last"))
        else:
            disk.fail_on = "never"

    model.on_train_epoch_start = fail_in_epoch_1  # type: ignore[method-assign]
    with FailingWrites("never") as disk, pytest.raises(OSError, match="No space left|injected"):
        try:
            trainer.fit(model)
        finally:
            for restore in undo:
                restore()
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"]
    assert tree_digest(str(tmp_path)) == before["tree"], "best.ckpt is not epoch 0's again"
    assert torch.load(tmp_path / "best.ckpt", weights_only=False)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", "last.ckpt"]


def _directory_fit(tmp_path, fail_in_epoch_1: str, **kwargs) -> tuple[FiniteGradCheckpoint, FaultyModel]:
    """A fit whose checkpoints are directories (as DeepSpeed's and FSDP2's are); in epoch 1 the write of the name
    containing ``fail_in_epoch_1`` fails like a full disk. Returns the callback and the model (its snapshot at step
    3 is the directory and the ledger before epoch 1's boundary)."""
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True, **kwargs)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])
    strategy = DirectoryCheckpointStrategy()
    seed_everything(0)
    trainer = Trainer(strategy=strategy, callbacks=[callback], **QUIET, **EPOCHS)
    model.on_train_epoch_start = lambda: setattr(  # type: ignore[method-assign]
        strategy, "fail_on", fail_in_epoch_1 if trainer.current_epoch == 1 else None)
    with pytest.raises(OSError, match="No space left"):
        trainer.fit(model)
    return callback, model


def test_a_directory_an_earlier_write_of_a_failed_boundary_replaced_is_put_back(exchange, tmp_path):
    """``best.ckpt``, a directory, is replaced by epoch 1's better checkpoint; then epoch 1's ``last`` fails: the
    directory holds epoch 0's checkpoint again, as the rolled-back ledger says, and no hidden entry is left."""
    callback, model = _directory_fit(tmp_path, "last", filename="best")
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"]
    assert tree_digest(str(tmp_path)) == before["tree"], "best.ckpt is not epoch 0's directory again"
    assert torch.load(tmp_path / "best.ckpt" / "state.pt", weights_only=False)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["best.ckpt", "last.ckpt"]


def test_a_directory_written_twice_in_a_failed_boundary_holds_its_first_content_again(exchange, tmp_path):
    """``filename="last"`` with ``save_last``: each boundary writes the directory ``last.ckpt`` twice (its top-1
    checkpoint, then its `last`). Epoch 1's first write replaces epoch 0's, the second fails: ``last.ckpt`` is epoch
    0's again, not epoch 1's first write."""
    writes: list[int] = []
    original = DirectoryCheckpointStrategy.save_checkpoint

    def second_write_of_epoch_1_fails(strategy, checkpoint, filepath, storage_options=None) -> None:
        writes.append(checkpoint["epoch"])
        strategy.fail_on = "last" if writes.count(1) == 2 else None
        original(strategy, checkpoint, filepath, storage_options)

    DirectoryCheckpointStrategy.save_checkpoint = second_write_of_epoch_1_fails  # type: ignore[method-assign]
    try:
        callback, model = _directory_fit(tmp_path, "never", filename="last", enable_version_counter=False)
    finally:
        DirectoryCheckpointStrategy.save_checkpoint = original  # type: ignore[method-assign]
    assert writes == [0, 0, 1, 1]
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"]
    # before, epoch 0's first write was kept retired beside it, for readers; epoch 1's first write released it
    published = {path: entry for path, entry in before["tree"].items() if not path.startswith(".")}
    assert tree_digest(str(tmp_path)) == published, "last.ckpt is not epoch 0's directory again"
    assert torch.load(tmp_path / "last.ckpt" / "state.pt", weights_only=False)["epoch"] == 0


def test_a_name_written_twice_in_a_failed_boundary_holds_its_first_content_again(tmp_path):
    """``filename="last"`` with ``save_last``: each boundary writes ``last.ckpt`` twice (its top-1 file, then its
    `last`). Epoch 1's second write fails: ``last.ckpt`` is epoch 0's again, not epoch 1's first write."""
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="last", save_top_k=1, save_last=True,
                                    enable_version_counter=False)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    writes: list[int] = []

    def second_write_of_epoch_1_fails(path: str) -> None:
        writes.append(trainer.current_epoch)
        if writes.count(1) == 2:
            raise OSError(28, "No space left on device", path)

    stop = hook_writes(before=second_write_of_epoch_1_fails)
    try:
        with pytest.raises(OSError, match="No space left"):
            trainer.fit(model)
    finally:
        stop()
    assert writes == [0, 0, 1, 1]
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"]
    assert tree_digest(str(tmp_path)) == before["tree"], "last.ckpt is not epoch 0's again"
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2


@pytest.mark.parametrize("mode", ["min", "max"])
def test_forgetting_checkpoints_chooses_best_and_kth_again_among_the_rest(mode):
    scores = {"a.ckpt": torch.tensor(1.0), "b.ckpt": torch.tensor(2.0), "c.ckpt": torch.tensor(3.0)}
    best, kth = ("a.ckpt", "c.ckpt") if mode == "min" else ("c.ckpt", "a.ckpt")
    ledger = Ledger(
        best_k_models=scores, kth_best_model_path=kth, kth_value=scores[kth], best_model_path=best,
        best_model_score=scores[best], current_score=scores["b.ckpt"], last_model_path="last.ckpt",
        last_global_step_saved=6, last_checkpoint_saved="last.ckpt", last_time_checked=None,
        defer_save_until_validation=False,
    )
    left = ledger.without(["a.ckpt", "c.ckpt", "last.ckpt"], mode)
    assert list(left.best_k_models) == ["b.ckpt"]
    assert (left.best_model_path, left.kth_best_model_path, left.last_model_path) == ("b.ckpt", "b.ckpt", "")
    assert float(left.best_model_score) == float(left.kth_value) == 2.0
    empty = ledger.without(list(scores), mode)
    assert (empty.best_k_models, empty.best_model_path, empty.best_model_score) == ({}, "", None)
    assert float(empty.kth_value) == (float("inf") if mode == "min" else -float("inf"))
    assert ledger.best_k_models == scores  # a new value; the original is unchanged


def test_a_failed_write_still_logs_the_lines_model_checkpoint_logged_before_it(caplog, tmp_path):
    # ModelCheckpoint says "saving model to ..." and then the write fails: the line is held during the boundary and,
    # as the boundary was not rejected, reaches the log like ModelCheckpoint's own would
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, verbose=True)
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    with FailingWrites("epoch=0"), caplog.at_level("INFO"), pytest.raises(OSError, match="No space left"):
        trainer.fit(FaultyModel(val_losses=[3.0, 2.0, 1.0]))
    saving = [r.getMessage() for r in caplog.records if "saving model to" in r.getMessage()]
    assert len(saving) == 1 and "epoch=0-step=2.ckpt" in saving[0], saving


def _raising_after_top_k(cls: type[ModelCheckpoint]) -> type[ModelCheckpoint]:
    class RaisesAfterTopK(cls):  # type: ignore[valid-type,misc]
        """A subclass whose own step fails at step 4, after the top-K logged its line and before any file operation."""

        def _save_topk_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
            if trainer.global_step == 4:
                raise RuntimeError("a subclass's own step failed")

    return RaisesAfterTopK


@pytest.mark.parametrize("cls", [ModelCheckpoint, FiniteGradCheckpoint])
def test_a_hook_that_raises_before_its_first_file_operation_still_logs_what_it_said(cls, caplog, tmp_path):
    # "'val_loss' was not in top 1" is said, then the subclass raises before any save or link: the line reaches the
    # log as ModelCheckpoint's does, not dropped with the boundary
    callback = _raising_after_top_k(cls)(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True,
                                         verbose=True)
    seed_everything(0)
    with caplog.at_level("INFO"), pytest.raises(RuntimeError, match="a subclass's own step failed"):
        Trainer(callbacks=[callback], **QUIET, **EPOCHS).fit(FaultyModel(val_losses=[3.0, 4.0, 1.0]))
    lines = [r.getMessage() for r in caplog.records if "val_loss" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["Epoch 0, global step 2", "Epoch 1, global step 4"], lines
    assert "was not in top 1" in lines[1]


class LogsWhileSaved(FaultyModel):
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        logging.getLogger("my_project").info("on_save_checkpoint at step %d", self.global_step)


@pytest.mark.parametrize("cls", [ModelCheckpoint, FiniteGradCheckpoint])
def test_model_checkpoints_lines_come_before_what_the_write_logs(cls, caplog, tmp_path):
    # the held lines are released once the boundary is accepted, before its first write, not after the hook
    callback = cls(dirpath=tmp_path, monitor="val_loss", save_top_k=1, verbose=True)
    seed_everything(0)
    with caplog.at_level("INFO"):
        Trainer(callbacks=[callback], **QUIET, **EPOCHS).fit(LogsWhileSaved(val_losses=[3.0, 2.0, 1.0]))
    lines = [r.getMessage().split(":")[0] if r.name == "my_project" else r.getMessage().split(",")[0]
             for r in caplog.records if r.name == "my_project" or "val_loss" in r.getMessage()]
    assert lines == ["Epoch 0", "on_save_checkpoint at step 2", "Epoch 1", "on_save_checkpoint at step 4",
                     "Epoch 2", "on_save_checkpoint at step 6"]
