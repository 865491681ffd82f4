"""A move into place that fails on rank 0, after the boundary's last collective, is held: nothing more of that boundary
is put in place or evicted, what it created is removed, and the next agreement (or the end of training) raises it
with the ledger back to the one before that boundary. An eviction that fails there (only rank 0 removes) is held the
same way, on 2 ranks too (``workers/held_moves_worker.py``), with its boundary's ledger standing: it was published."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer, seed_everything

import lightning_ckguard.publish.storage as storage_module
from conftest import OUT
from helpers import (
    QUIET,
    BusyRemovalIO,
    DirectoryCheckpointStrategy,
    FaultyModel,
    RaisesAtStep3,
    ledger_state,
    refuse_moves_to,
    refuse_removal_of_epoch_0,
    tree_digest,
)
from lightning_ckguard import FiniteGradCheckpoint

EPOCHS = dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


def fit_refusing_moves(trainer: Trainer, model: FaultyModel, name: str, epoch: int) -> None:
    """Fit, with rank 0's renames onto ``name`` refused from epoch ``epoch`` on, and expect the injected error."""
    undo: list = []
    model.on_train_epoch_start = lambda: (  # type: ignore[method-assign]
        undo.append(refuse_moves_to(name)) if trainer.current_epoch == epoch else None)
    try:
        with pytest.raises(OSError, match="injected"):
            trainer.fit(model)
    finally:
        for restore in undo:
            restore()


@pytest.mark.parametrize(("refused_name", "save_last"), [("epoch=1", True), ("last", True), ("last", "link")])
def test_a_refused_move_is_raised_at_the_next_boundary_with_nothing_of_its_boundary_left(refused_name, save_last,
                                                                                            tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=save_last)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])  # step 3: before epoch 1's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    fit_refusing_moves(trainer, model, refused_name, epoch=1)
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"], "the ledger was not rolled back to the published one"
    assert tree_digest(str(tmp_path)) == before["tree"], "something of the failed boundary is left, or was evicted"
    assert "epoch=0-step=2.ckpt" in before["tree"]
    assert trainer.current_epoch == 2, "raised at the next boundary's agreement, not before"


def test_a_refused_move_is_raised_first_at_a_boundary_that_writes_nothing_and_rejects(tmp_path):
    # epoch 1's move of its top-1 file is refused; epoch 2's validation is no top-1 (nothing written) and its window
    # holds a NaN (step 5): the held failure raises there, with the ledger back, before the rejection is applied
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = FaultyModel(fault_steps=[5], val_losses=[3.0, 2.0, 5.0], snapshot_steps=[3])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    fit_refusing_moves(trainer, model, "epoch=1", epoch=1)
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"], "the ledger still lists the file that was never put in place"
    assert tree_digest(str(tmp_path)) == before["tree"]


def test_a_refused_move_at_the_last_boundary_is_raised_at_train_end(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    fit_refusing_moves(trainer, model, "epoch=2", epoch=2)
    before = model.snapshots[5]
    assert ledger_state(callback) == before["state"]
    assert tree_digest(str(tmp_path)) == before["tree"]
    assert callback.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")


class OwnBusyRemovalIO(CheckpointIO):
    """A user's own checkpoint IO (written at the real name, not staged), whose removal of epoch 0's fails."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        torch.save(checkpoint, str(path))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        return torch.load(str(path), map_location=map_location, weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        refuse_removal_of_epoch_0(path)
        os.remove(str(path))

    def teardown(self) -> None:
        """Nothing to release."""


@pytest.mark.parametrize("io", [BusyRemovalIO, OwnBusyRemovalIO], ids=["staged", "direct"])
def test_a_failed_eviction_is_held_until_the_next_boundary_with_its_boundary_published(io, caplog, tmp_path):
    # epoch 1's boundary publishes its checkpoint, then the eviction of epoch 0's fails: raised at epoch 2's agreement
    # (on every rank alike), with epoch 1's ledger standing, its log lines said, and epoch 0's file left in place
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, verbose=True)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], plugins=[io()], **QUIET, **EPOCHS)
    with caplog.at_level("INFO"), pytest.raises(OSError, match="Device or resource busy"):
        trainer.fit(model)
    assert trainer.current_epoch == 2, "raised at the next boundary's agreement, not at the eviction"
    before = model.snapshots[5]
    assert ledger_state(callback) == before["state"]
    assert callback.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")
    assert tree_digest(str(tmp_path)) == before["tree"]
    assert sorted(before["tree"]) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    saving = [r.getMessage() for r in caplog.records if "saving model to" in r.getMessage()]
    # the published boundary's line, and none of the boundary that raised at its agreement (it wrote nothing)
    assert [line.split("saving model to ")[1].split("'")[1].rsplit("/", 1)[1] for line in saving] == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"], saving


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
def test_a_failed_eviction_on_rank_0_raises_on_every_rank_at_the_next_agreement(worker_results):
    ranks = worker_results("workers/held_moves_worker.py", [OUT, "evict-fails"], timeout=300).ranks
    errors = [rank["evict-fails"]["error"] for rank in ranks]
    assert errors[0].get("type") == "OSError" and "Device or resource busy" in errors[0]["message"], errors[0]
    assert errors[1].get("type") == "CheckpointWriteError", errors[1]  # not left waiting for rank 0
    assert "failed on rank 0" in errors[1]["message"] and "Device or resource busy" in errors[1]["message"]
    assert errors[1]["message"].startswith("Removing the checkpoint") and "stays on disk" in errors[1]["message"]
    for rank, results in enumerate(ranks):
        result = results["evict-fails"]
        assert result["global_step"] == 6, f"rank {rank}: raised at epoch 2's agreement, not elsewhere"
        assert result["state"] == result["snapshots"]["5"]["state"], f"rank {rank}: epoch 1's ledger does not stand"
    rank0 = ranks[0]["evict-fails"]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"]
    assert sorted(rank0["tree"]) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
def test_a_held_failure_learned_during_an_exception_rolls_back_every_rank_at_the_next_setup(worker_results):
    ranks = worker_results("workers/held_moves_worker.py", [OUT, "held-then-exception"], timeout=300).ranks
    results = [rank["held-then-exception"] for rank in ranks]
    for rank, result in enumerate(results):
        assert result["first"]["error"]["unexpected"] == f"RuntimeError: boom on rank {rank}", result["first"]
        assert result["second"]["error"] is None, f"rank {rank}: {result['second']['error']}"
    # the same ledger on both ranks after the exception (rank 0 rolling back alone made the next fit hang) ...
    assert results[0]["first"]["state"] == results[1]["first"]["state"]
    # ... and the next fit started from what was published (nothing): it saved at steps 2 and 4
    assert results[0]["second"]["state"] == results[1]["second"]["state"]
    assert sorted(results[0]["second"]["tree"]) == ["step=2.ckpt", "step=4.ckpt"]


def test_a_retired_copy_rank_0_cannot_release_is_held_like_a_refused_move(tmp_path, monkeypatch):
    # epoch 2 writes `last` again, and rank 0 first releases the copy kept for readers of the one before: that fails
    # (a reader's file held open in it, on NFS). Held, not raised on rank 0 alone: nothing of the boundary is put in
    # place, and the next agreement raises it with the ledger of epoch 1
    def busy(path: str) -> None:
        raise OSError(errno.EBUSY, "Device or resource busy (injected)", path)

    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0, 0.5], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    model.on_train_epoch_start = lambda: (  # type: ignore[method-assign]
        monkeypatch.setattr(storage_module, "release_retired", busy) if model.current_epoch == 2 else None)
    seed_everything(0)
    trainer = Trainer(strategy=DirectoryCheckpointStrategy(), callbacks=[callback], **QUIET,
                      **dict(EPOCHS, max_epochs=4))
    with pytest.raises(OSError, match="injected"):
        trainer.fit(model)
    monkeypatch.undo()
    assert trainer.current_epoch == 3, "raised at the next boundary's agreement, on every rank alike, not at once"
    before = model.snapshots[5]
    assert ledger_state(callback) == before["state"], "the ledger was not rolled back to the published one"
    published = {name: entry for name, entry in before["tree"].items() if not name.startswith(".")}
    assert tree_digest(str(tmp_path)) == published, "something of the failed boundary is left"  # copies released


def test_a_held_failure_met_while_an_exception_is_handled_warns_and_the_exception_surfaces(tmp_path):
    # step 2's rename is refused (held); step 3 raises, and save_on_exception's boundary is the next agreement: the
    # held failure must not replace the error being handled (nor cut Lightning's handling of it short)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_on_exception=True)
    trainer = Trainer(callbacks=[callback], max_steps=6, limit_val_batches=0, **QUIET)
    undo = refuse_moves_to("epoch=0-step=2")
    try:
        warned = pytest.warns(UserWarning, match=r"no checkpoint saved on this exception: an earlier checkpoint "
                                                 r"write failed \(OSError: .*injected")
        with warned, pytest.raises(RuntimeError, match="boom"):
            trainer.fit(RaisesAtStep3())
    finally:
        undo()
    assert os.listdir(tmp_path) == []  # step 2 never put in place, nothing saved on the exception
    assert (callback.best_k_models, callback.last_model_path) == ({}, "")
    assert trainer.state.status == "interrupted"  # Lightning's own handling ran to its end


def test_a_held_failure_left_at_an_exception_rolls_the_ledger_back_in_one_process(tmp_path):
    # step 2's rename is refused (held); step 3 raises and no agreement comes after it: the fit's end, during the
    # exception, is where the failure is met, and the ledger goes back to what was published (nothing)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = Trainer(callbacks=[callback], max_steps=6, limit_val_batches=0, **QUIET)
    undo = refuse_moves_to("epoch=0-step=2")
    try:
        warned = pytest.warns(UserWarning, match=r"a checkpoint write failed as well: .*injected")
        with warned, pytest.raises(RuntimeError, match="boom"):
            trainer.fit(RaisesAtStep3())
    finally:
        undo()
    assert os.listdir(tmp_path) == []
    assert (callback.best_model_path, callback.best_k_models, callback.last_model_path) == ("", {}, "")


def test_a_held_failure_met_while_an_exception_is_handled_takes_the_top_k_back_to_what_was_published(tmp_path):
    # as above, with a monitored top K: step 2's boundary listed its checkpoint, then its rename was refused (held);
    # save_on_exception's agreement meets the failure, saves nothing, and the ledger is what was published: nothing
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, monitor="step", mode="max",
                                    save_top_k=-1, save_on_exception=True)
    trainer = Trainer(callbacks=[callback], max_steps=6, limit_val_batches=0, **QUIET)
    undo = refuse_moves_to("epoch=0-step=2")
    try:
        warned = pytest.warns(UserWarning, match="no checkpoint saved on this exception: an earlier checkpoint")
        with warned, pytest.raises(RuntimeError, match="boom"):
            trainer.fit(RaisesAtStep3())
    finally:
        undo()
    assert os.listdir(tmp_path) == []
    assert (callback.best_k_models, callback.best_model_path, callback.best_model_score) == ({}, "", None)
    assert (callback.kth_best_model_path, callback.current_score) == ("", None)


def test_a_name_the_failed_boundary_created_and_wrote_twice_is_gone_not_its_first_write(tmp_path, monkeypatch):
    """The first boundary writes ``last.ckpt`` twice (``filename="last"`` with ``save_last``): the first move creates
    the name, the second is refused (held). Nothing of the boundary is left: the name it created goes, and its first
    write is not kept as something to put back (the name held nothing before the boundary)."""
    import lightning_ckguard.publish.staging as staging_module

    move = staging_module.move_into_place
    moves: list[str] = []

    def refuse_the_second(staging: str, filepath: str, **options: Any) -> bool:
        moves.append(os.path.basename(filepath))
        if len(moves) == 2:
            raise OSError(30, "Read-only file system (injected)", filepath)
        return move(staging, filepath, **options)

    monkeypatch.setattr(staging_module, "move_into_place", refuse_the_second)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="last", save_top_k=1, save_last=True,
                                    enable_version_counter=False, every_n_train_steps=2)
    seed_everything(0)
    with pytest.raises(OSError, match="injected"):
        Trainer(callbacks=[callback], max_steps=6, limit_val_batches=0, **QUIET).fit(FaultyModel())
    assert moves == ["last.ckpt", "last.ckpt"]
    assert os.listdir(tmp_path) == []
    assert (callback.best_model_path, callback.last_model_path) == ("", "")
