"""A rejection met by a write that is not the guard's own boundary, in one process: another guarded callback's
boundary (two ``FiniteGradCheckpoint`` on one Trainer), and a manual ``trainer.save_checkpoint`` inside
``training_step`` under ``"rewind"``; and what a rewind records after a boundary that only moved ``last``'s link."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from helpers import QUIET, FaultyModel, rewind_log
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError


def _two_guards(tmp_path: Any, policy: str) -> tuple[FiniteGradCheckpoint, FiniteGradCheckpoint]:
    first = FiniteGradCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=2, save_top_k=2, monitor="step",
                                 mode="max", filename="a-{step}", on_non_finite=policy)
    second = FiniteGradCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=5, save_top_k=-1, filename="b-{step}",
                                  on_non_finite=policy)
    return first, second


def _fit(model: Any, callbacks: list[Any], max_steps: int, **trainer_args: Any) -> list[str]:
    """Fit; the guard's warnings, as text."""
    trainer = Trainer(max_steps=max_steps, limit_val_batches=0, callbacks=callbacks, devices=1,
                      **{**QUIET, **trainer_args})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return [str(w.message) for w in caught if "FiniteGradCheckpoint" in str(w.message)]


def _on_disk(directory: Any) -> set[str]:
    return {name for name in os.listdir(directory) if name.endswith(".ckpt")}


def test_a_write_another_guard_refuses_leaves_the_boundarys_ledger_and_files_as_they_were(tmp_path):
    # a NaN at step 6, sanitized before the optimizer: both guards record it. The first guard rejects its step-8
    # boundary (skip) and accepts step 10 with a clean window of its own; the second's window still holds the NaN and
    # refuses that write. The first must not list (nor evict for) a checkpoint that was never written
    seed_everything(0)
    first, second = _two_guards(tmp_path, "skip")
    said = _fit(FaultyModel(fault_steps=[6]), [first, second], max_steps=10)
    names = {os.path.basename(path) for path in first.best_k_models}
    assert names == _on_disk(tmp_path / "a") == {"a-step=4.ckpt", "a-step=6.ckpt"}, (names, said)
    assert os.path.basename(first.best_model_path) == "a-step=6.ckpt"
    assert _on_disk(tmp_path / "b") == {"b-step=5.ckpt"}
    assert not any("ckguard-staging" in line for line in said), said  # messages name the real checkpoint
    assert any("another guarded callback refused a write" in line and "a-step=10.ckpt" not in line for line in said)


def test_a_rewind_restarts_the_other_guards_so_the_recovered_run_is_not_rewound_again(tmp_path):
    seed_everything(0)
    first, second = _two_guards(tmp_path, "rewind")
    model = FaultyModel(fault_steps=[7], sanitize=False)
    _fit(model, [first, second], max_steps=16)
    assert [(r.global_step, os.path.basename(r.checkpoint)) for r in first.rewinds] == [(8, "a-step=6.ckpt")]
    assert second.rewinds == ()  # its window described the weights the first guard's rewind threw away
    assert all(os.path.exists(path) for path in first.best_k_models)
    assert {"b-step=10.ckpt", "b-step=15.ckpt"} <= _on_disk(tmp_path / "b")
    assert all(torch.isfinite(p).all() for p in model.parameters())


class SavesInTrainingStep(FaultyModel):
    """Calls ``trainer.save_checkpoint`` inside ``training_step``, after its forward, at every step in ``save_at``."""

    def __init__(self, save_at: set[int], directory: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_at, self.directory = save_at, directory

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        output = super().training_step(batch, batch_idx)
        step = self.trainer.global_step
        if step in self.save_at:
            self.trainer.save_checkpoint(os.path.join(self.directory, f"manual-{step}.ckpt"))
        return output


def test_a_manual_save_inside_the_training_step_rewinds_at_the_callbacks_next_hook(tmp_path):
    # the NaN update is applied at step 5; the save inside step 6's training_step is rejected: rewinding there would
    # change the weights between that step's forward and its backward
    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}",
                                      on_non_finite="rewind")
    model = SavesInTrainingStep({3, 6}, tmp_path, fault_steps=[5], sanitize=False)
    said = _fit(model, [checkpoint], max_steps=12)
    (rewind,) = checkpoint.rewinds
    assert (os.path.basename(rewind.checkpoint), rewind.global_step) == ("step=4.ckpt", 7)
    assert _on_disk(tmp_path) == {"manual-3.ckpt", "step=4.ckpt", "step=8.ckpt", "step=12.ckpt"}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any("the weights go back at its next hook" in line for line in said), said


def test_a_rewind_records_the_step_its_checkpoint_was_written_at_after_boundaries_that_only_moved_a_link(tmp_path):
    # the best checkpoint is epoch 0's; later epochs only move `last`, a link to it
    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last="link",
                                      on_non_finite="rewind")
    model = FaultyModel(fault_steps=[17], sanitize=False, val_losses=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    trainer = Trainer(max_epochs=6, limit_train_batches=4, limit_val_batches=1, callbacks=[checkpoint], devices=1,
                      **QUIET)
    trainer.fit(model)
    (rewind,) = checkpoint.rewinds
    published_at = torch.load(rewind.checkpoint, weights_only=False)["global_step"]
    (logged,) = rewind_log(tmp_path)
    assert os.path.basename(rewind.checkpoint) == "epoch=0-step=4.ckpt" and published_at == 4
    assert (rewind.checkpoint_global_step, rewind.discarded_steps[0]) == (4, 4)
    assert (logged["checkpoint_global_step"], logged["discarded_steps"][0]) == (4, 4)  # the log says the same


class SavesAtTrainEnd(FaultyModel):
    """Saves by hand in its own ``on_train_end``, which Lightning runs after every callback's; with ``poison``, after
    writing a NaN into its weights (their gradients all finite)."""

    def __init__(self, directory: Any, poison: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.directory, self.poison = directory, poison

    def on_train_end(self) -> None:
        if self.poison:
            with torch.no_grad():
                self.layer.weight[0, 0] = float("nan")
        self.trainer.save_checkpoint(os.path.join(self.directory, "final.ckpt"))


@pytest.mark.parametrize("diverged", ["gradients", "weights"])
def test_a_rejection_at_the_end_of_a_fit_under_rewind_seals_the_run(diverged, tmp_path):
    # nothing is left to rewind at, and nothing may publish those weights afterwards. A NaN update at step 9, with
    # no boundary after it: the steps after the last boundary are judged at train end, and rejected there. Weights
    # made NaN in the module's on_train_end (after every callback's): its save is rejected by the state check, a
    # rewind is due, and no hook of the callback is left to rewind at
    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}",
                                      on_non_finite="rewind")
    trainer = Trainer(max_steps=10, limit_val_batches=0, callbacks=[checkpoint], devices=1, **QUIET)
    faults = dict(fault_steps=[9], sanitize=False) if diverged == "gradients" else dict(poison=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SavesAtTrainEnd(tmp_path, **faults))
    sealed = "The fit had ended" if diverged == "gradients" else "The fit ended before the weights could go back"
    assert any(sealed in str(w.message) for w in caught)
    with pytest.raises(NonFiniteGradientError, match="global step 10"):
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert _on_disk(tmp_path) == {"step=4.ckpt", "step=8.ckpt"}


class SavesWithoutSuper(FiniteGradCheckpoint):
    """``ModelCheckpoint._save_checkpoint``'s own body, through ``trainer.save_checkpoint``, without ``super()``."""

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        trainer.save_checkpoint(filepath, self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath


def test_a_subclass_that_saves_without_super_can_rewind(tmp_path):
    seed_everything(0)
    checkpoint = SavesWithoutSuper(dirpath=tmp_path, every_n_train_steps=4, filename="{step}", on_non_finite="rewind")
    model = FaultyModel(fault_steps=[5], sanitize=False)
    Trainer(max_steps=12, limit_val_batches=0, callbacks=[checkpoint], devices=1, **QUIET).fit(model)
    assert [(r.global_step, os.path.basename(r.checkpoint)) for r in checkpoint.rewinds] == [(8, "step=4.ckpt")]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_manual_save_both_guards_rejected_is_rewound_once(tmp_path):
    # both guards reject the save inside step 6's training_step; the first one's rewind settles the second one's too
    seed_everything(0)
    first = FiniteGradCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=4, save_top_k=-1, filename="a-{step}",
                                 on_non_finite="rewind")
    second = FiniteGradCheckpoint(dirpath=tmp_path / "b", every_n_train_steps=50, save_top_k=-1, filename="b-{step}",
                                  on_non_finite="rewind")
    model = SavesInTrainingStep({6}, tmp_path, fault_steps=[5], sanitize=False)
    _fit(model, [first, second], max_steps=12)
    assert [(r.global_step, os.path.basename(r.checkpoint)) for r in first.rewinds] == [(7, "a-step=4.ckpt")]
    assert second.rewinds == ()  # without: it raised at its own hook, having no checkpoint to go back to
    assert all(torch.isfinite(p).all() for p in model.parameters())
