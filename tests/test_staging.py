"""Directory checkpoints are published by one rename, and what an interrupted publication leaves is recovered."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from helpers import QUIET, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.staging import move_into_place, recover, staging_path


def _checkpoint_dir(path, content: str) -> None:
    os.makedirs(path)
    for shard in ("shard0", "shard1"):
        with open(os.path.join(path, shard), "w") as f:
            f.write(content)


def _content(path) -> set[str]:
    return {open(os.path.join(path, name)).read() for name in os.listdir(path)}


def test_move_into_place_replaces_a_published_directory_whole(tmp_path):
    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "old")
    staging = staging_path(final)
    _checkpoint_dir(staging, "new")
    move_into_place(staging, final)
    assert _content(final) == {"new"}
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_recover_removes_staging_and_restores_an_interrupted_replacement(tmp_path):
    # a crash before the rename: only the staging directory
    _checkpoint_dir(staging_path(str(tmp_path / "step=4.ckpt")), "partial")
    # a crash between moving the old `last` aside and moving the new one in
    _checkpoint_dir(tmp_path / ".last.ckpt.ckguard-retired", "old last")
    # a crash after the new one arrived, before the old copy was deleted
    _checkpoint_dir(tmp_path / "step=2.ckpt", "new step 2")
    _checkpoint_dir(tmp_path / ".step=2.ckpt.ckguard-retired", "old step 2")
    actions = recover(str(tmp_path))
    assert len(actions) == 3
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]
    assert _content(tmp_path / "last.ckpt") == {"old last"}
    assert _content(tmp_path / "step=2.ckpt") == {"new step 2"}


def test_setup_recovers_leftovers_with_a_warning(tmp_path):
    _checkpoint_dir(staging_path(str(tmp_path / "epoch=0-step=4.ckpt")), "partial")
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    seed_everything(0)
    with pytest.warns(UserWarning, match="removed the unpublished partial checkpoint"):
        Trainer(callbacks=[callback], max_steps=4, limit_val_batches=0, **QUIET).fit(FaultyModel())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


def test_ledger_entries_whose_files_are_gone_are_dropped_on_resume(tmp_path):
    def fit(max_epochs: int, ckpt_path: str | None = None) -> FiniteGradCheckpoint:
        callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
        seed_everything(0)
        trainer = Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(FaultyModel(val_losses=[3.0, 2.0, 4.0, 5.0]), ckpt_path=ckpt_path)
        return callback

    fit(2)
    best = tmp_path / "epoch=1-step=4.ckpt"
    assert best.exists()
    best.unlink()  # lost: deleted by hand, or in a crash
    with pytest.warns(UserWarning, match=r"dropped 1 checkpoint\(s\).*epoch=1-step=4.ckpt"):
        callback = fit(4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert str(best) not in callback.best_k_models
    # epoch 0 stays the best left; epochs 2 and 3 are worse but fill the free slot of the top-2
    assert callback.best_model_path == str(tmp_path / "epoch=0-step=2.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6  # `last` moves with the top-K
