"""The callback where ``ModelCheckpoint`` writes nothing: an evaluation job pointed at a training's directory (it must
not remove what that training is writing), a ``fast_dev_run`` or ``save_top_k=0`` on a directory nobody may write
to; and what the training sees when its staged checkpoint is removed before it is published."""

from __future__ import annotations

import os
from typing import Any

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import QUIET, FaultyModel, hook_writes
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.staging import staging_path

#: A directory no process can create, root included, for a run that must not need one.
UNWRITABLE = "/proc/ckguard-no-such-directory"


def _trained(tmp_path: Any) -> str:
    dirpath = str(tmp_path / "ckpts")
    Trainer(max_steps=4, callbacks=[FiniteGradCheckpoint(dirpath=dirpath, save_last=True)], devices=1,
            **QUIET).fit(FaultyModel())
    return dirpath


@pytest.mark.parametrize("run", ["validate", "test-last", "predict"])
def test_an_evaluation_job_on_a_trainings_dirpath_leaves_what_that_training_writes_alone(tmp_path, run):
    dirpath = _trained(tmp_path)
    in_flight = staging_path(os.path.join(dirpath, "epoch=3-step=40.ckpt"))  # the training's, being written now
    with open(in_flight, "wb") as half_written:
        half_written.write(b"half a checkpoint")
    before = sorted(os.listdir(dirpath))
    trainer = Trainer(callbacks=[FiniteGradCheckpoint(dirpath=dirpath, save_last=True)], devices=1, **QUIET)
    if run == "validate":
        trainer.validate(FaultyModel())
    elif run == "test-last":
        trainer.test(FaultyModel(), ckpt_path="last")
    else:
        trainer.predict(FaultyModel())
    assert sorted(os.listdir(dirpath)) == before  # as ModelCheckpoint leaves it


@pytest.mark.parametrize("callback_class", [ModelCheckpoint, FiniteGradCheckpoint])
@pytest.mark.parametrize("setting", [dict(fast_dev_run=True), dict(save_top_k=0)], ids=["fast_dev_run", "top-0"])
def test_a_fit_that_can_write_nothing_needs_no_writable_dirpath(callback_class, setting):
    trainer_args = dict(setting) if "fast_dev_run" in setting else dict(max_steps=2)
    callback = callback_class(dirpath=UNWRITABLE, **({} if "fast_dev_run" in setting else setting))
    trainer = Trainer(callbacks=[callback], devices=1, **QUIET, **trainer_args)
    trainer.fit(FaultyModel())  # ModelCheckpoint's fit completes: so must the guard's
    assert trainer.global_step >= 1 and not os.path.exists(UNWRITABLE)


def test_a_staged_checkpoint_removed_before_it_is_published_fails_and_is_not_listed(tmp_path):
    # another process (an older release's evaluation job) removes the staging entry right after it is written
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    undo = hook_writes(after=lambda path: os.remove(path) if path.endswith("step=4.ckpt.ckguard-staging") else None)
    try:
        # rank 0 raises its own error (its peers would raise CheckpointWriteError), at the next agreement
        with pytest.raises(FileNotFoundError, match=r"step=4\.ckpt\.ckguard-staging was gone"):
            Trainer(max_steps=6, callbacks=[callback], devices=1, **QUIET).fit(FaultyModel())
    finally:
        undo()
    assert sorted(os.listdir(tmp_path)) == ["step=2.ckpt"]
    assert os.path.basename(callback.best_model_path) == "step=2.ckpt"  # the ledger matches the disk
