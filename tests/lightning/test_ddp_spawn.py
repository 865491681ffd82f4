"""`strategy="ddp_spawn"`: the callback travels to spawned workers, and both reject together."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from conftest import free_port
from helpers import QUIET, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(180)
def test_ddp_spawn_rejects_rank1_only_nan(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(
        strategy=DDPStrategy(start_method="spawn", timeout=timedelta(seconds=60)),
        devices=2, max_steps=8, limit_val_batches=0, callbacks=[callback], **QUIET,
    )
    # the worker's NonFiniteGradientError reaches the main process through torch.multiprocessing
    with pytest.raises(Exception, match="NonFiniteGradientError") as info:
        trainer.fit(FaultyModel(fault_steps=[5], fault_ranks=(1,)))
    assert "Refusing to publish a checkpoint at global step 6" in str(info.value)
    assert "rank 1 in 1 optimizer step (step 5)" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
