"""After a rejection nothing in the process publishes the diverged state; manual saves pass the preflight."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.loggers import CSVLogger

from helpers import QUIET, FaultyModel, RaisesAtStep3, tree_digest
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError

EPOCHS = dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


@pytest.mark.parametrize("exception_callback_first", [True, False])
def test_no_save_on_exception_and_no_on_exception_checkpoint_after_rejection(exception_callback_first, tmp_path):
    guard = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_last=True,
                                 save_on_exception=True)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "exception")
    callbacks = [on_exception, guard] if exception_callback_first else [guard, on_exception]
    model = FaultyModel(fault_steps=[3], val_losses=[3.0, 2.0, 1.0], sanitize=False)
    seed_everything(0)
    quiet = {k: v for k, v in QUIET.items() if k != "logger"}
    trainer = Trainer(callbacks=callbacks, logger=CSVLogger(tmp_path / "logs"), **quiet, **EPOCHS)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(model)
    assert info.value.global_step == 4
    assert tree_digest(str(tmp_path / "ckpt")) == model.snapshots[3]["tree"]
    assert not os.path.exists(on_exception.ckpt_path)
    # Lightning's exception handling still ran to the end: the logger was finalized
    assert os.path.exists(os.path.join(trainer.logger.log_dir, "metrics.csv"))

    # manual saves after the failed fit, full and weights-only, raise the same error and write nothing
    for weights_only in (False, True):
        with pytest.raises(NonFiniteGradientError) as again:
            trainer.save_checkpoint(tmp_path / "manual.ckpt", weights_only=weights_only)
        assert again.value.fields() == info.value.fields()
    assert not (tmp_path / "manual.ckpt").exists()


@pytest.mark.parametrize("weights_only", [False, True])
def test_manual_save_mid_run_goes_through_the_preflight(weights_only, tmp_path):
    # the callback itself never saves here: only the manual saves are checked
    guard = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=100)
    model = FaultyModel(fault_steps=[3], manual_save_dir=str(tmp_path), manual_weights_only=weights_only)
    seed_everything(0)
    trainer = Trainer(callbacks=[guard], **QUIET, **EPOCHS)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(model)
    assert (info.value.ranks, info.value.first_step, info.value.global_step) == ((0,), 3, 4)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.ckpt"))
    assert written == ["manual-0.ckpt"]  # epoch 0 was finite and was saved; epoch 1's save was refused


def test_a_new_fit_resuming_from_the_best_checkpoint_publishes_again(tmp_path):
    guard = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    with pytest.raises(NonFiniteGradientError):
        Trainer(callbacks=[guard], **QUIET, **EPOCHS).fit(FaultyModel(fault_steps=[3], val_losses=[3.0, 2.0, 1.0]))
    best = guard.best_model_path
    assert os.path.basename(best) == "epoch=0-step=2.ckpt"
    trainer = Trainer(callbacks=[guard], **QUIET, **EPOCHS)
    trainer.fit(FaultyModel(val_losses=[3.0, 2.0, 1.0]), ckpt_path=best)
    assert trainer.global_step == 6
    # the resumed-from file is kept and `last` gets a version suffix, exactly as ModelCheckpoint does on resume
    assert sorted(os.listdir(tmp_path)) == [
        "epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last-v1.ckpt", "last.ckpt"]
    assert guard.rejection is None


def test_manual_save_mid_run_follows_the_skip_policy(tmp_path):
    guard = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=100, on_non_finite="skip")
    model = FaultyModel(fault_steps=[3], manual_save_dir=str(tmp_path))
    seed_everything(0)
    trainer = Trainer(callbacks=[guard], **QUIET, **EPOCHS)
    with pytest.warns(UserWarning, match="rejected the checkpoint at a save to .*manual-1.ckpt.*Skipped"):
        trainer.fit(model)
    assert trainer.global_step == 6
    # epoch 1's save was skipped; epoch 2 recorded new, finite steps (the model sanitizes) and was saved
    assert sorted(p.name for p in tmp_path.rglob("*.ckpt")) == ["manual-0.ckpt", "manual-2.ckpt"]


def test_stop_refuses_other_checkpoint_callbacks_and_returns_normally(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    guard = FiniteGradCheckpoint(dirpath=tmp_path / "guarded", every_n_train_steps=2, save_top_k=-1,
                                 on_non_finite="stop")
    # another state key than the guard's (`mode` is part of it; without a monitor it changes nothing else)
    other = ModelCheckpoint(dirpath=tmp_path / "other", every_n_train_steps=2, save_top_k=-1, save_last=True,
                            mode="max")
    seed_everything(0)
    trainer = Trainer(callbacks=[guard, other], **QUIET, **EPOCHS)
    with pytest.warns(UserWarning, match="refused to write .*other"):
        trainer.fit(FaultyModel(fault_steps=[3], sanitize=False))
    assert trainer.should_stop and trainer.global_step == 4
    assert sorted(os.listdir(tmp_path / "guarded")) == ["epoch=0-step=2.ckpt"]
    assert sorted(os.listdir(tmp_path / "other")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert guard.rejection is not None and guard.rejection.global_step == 4
    # fit() returned and tore down, but the rejection stands: a manual save afterwards publishes nothing
    with pytest.raises(NonFiniteGradientError):
        trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert not (tmp_path / "manual.ckpt").exists()


def test_a_new_fit_not_resumed_after_a_stop_publishes_nothing_before_its_first_step(tmp_path):
    # the gradients are sanitised, so the weights "stop" left are finite and only the guard knows they are rejected
    guard = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, on_non_finite="stop")
    model = FaultyModel(fault_steps=[2])
    seed_everything(0)
    with pytest.warns(UserWarning, match="Stopping training"):
        Trainer(callbacks=[guard], max_steps=6, limit_val_batches=0, **QUIET).fit(model)
    assert guard.rejection.global_step == 3
    published = tree_digest(str(tmp_path))
    # a new fit from the same weights, not resumed: the boundary of its first micro-batch comes before any step
    model.fault_steps = set()
    trainer = Trainer(callbacks=[guard], max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, **QUIET)
    with pytest.warns(UserWarning, match="at global step 0: the previous boundary on rank 0 was rejected and no "
                                         "optimizer step has been applied since"):
        trainer.fit(model)
    assert trainer.global_step == 0 and guard.rejection.global_step == 0
    assert tree_digest(str(tmp_path)) == published


class _EmergencySave(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_exception(self, trainer, pl_module, exception):
        trainer.save_checkpoint(self.path)


def test_an_emergency_save_in_on_exception_is_refused_without_replacing_the_users_error(tmp_path):
    # the steps since the last published checkpoint hold a non-finite one that no boundary judged yet
    guard = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1)
    emergency = str(tmp_path / "emergency.ckpt")
    seed_everything(0)
    trainer = Trainer(callbacks=[guard, _EmergencySave(emergency)], max_steps=6, limit_val_batches=0, **QUIET)
    with pytest.warns(UserWarning, match="refused to write .*emergency.ckpt"):
        with pytest.raises(RuntimeError, match="boom on rank 0"):
            trainer.fit(RaisesAtStep3(fault_steps=[1]))
    assert not os.path.exists(emergency) and not (tmp_path / "ckpt").exists()
    assert guard.rejection is not None and guard.rejection.first_step == 1
