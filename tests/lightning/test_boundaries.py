"""Single-process boundaries: parity with ModelCheckpoint, rejections, one agreement per boundary, policies."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
from conformance_helpers import FakeClock
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import QUIET, FaultyModel, count_agreements, ledger_state, relative_paths, tree_digest
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError, SpikeGate

EPOCHS = dict(max_epochs=4, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0)
VAL_LOSSES = [3.0, 1.0, 2.0, 0.5]

PARITY_CONFIGS = {
    "top2-last": (dict(monitor="val_loss", save_top_k=2, save_last=True), EPOCHS),
    "top1-link": (dict(monitor="val_loss", save_top_k=1, save_last="link"), EPOCHS),
    "max-mode-all": (dict(monitor="val_loss", save_top_k=-1, mode="max"), EPOCHS),
    "no-monitor": (dict(save_last=True), EPOCHS),
    "every-3-steps": (dict(every_n_train_steps=3, save_top_k=-1, filename="{step}"), dict(EPOCHS, limit_val_batches=0)),
    "every-3-steps-monitored": (dict(every_n_train_steps=3, monitor="val_loss", save_top_k=2, save_last=True), EPOCHS),
    "every-2-epochs": (dict(every_n_epochs=2, save_top_k=-1), EPOCHS),
    "train-epoch-end": (dict(monitor="val_loss", save_on_train_epoch_end=True, save_last=True), EPOCHS),
    "time-interval": (dict(train_time_interval=timedelta(0), save_top_k=-1, filename="{step}"),
                      dict(EPOCHS, limit_val_batches=0)),
    "weights-only": (dict(monitor="val_loss", save_top_k=2, save_weights_only=True), EPOCHS),
    "last-only": (dict(save_top_k=0, save_last=True), EPOCHS),
}


def fit(callback: ModelCheckpoint, trainer_kwargs: dict[str, Any], seed: int = 0, **model_kwargs: Any) -> Trainer:
    seed_everything(seed)
    model_kwargs.setdefault("val_losses", VAL_LOSSES)
    trainer = Trainer(callbacks=[callback], **QUIET, **trainer_kwargs)
    trainer.fit(FaultyModel(**model_kwargs))
    return trainer


def _checkpoint_contents(root: str) -> dict[str, Any]:
    contents = {}
    for name in sorted(os.listdir(root)):
        ckpt = torch.load(os.path.join(root, name), weights_only=False)
        states = {key.split("{")[1]: relative_paths(value, root) for key, value in ckpt.get("callbacks", {}).items()}
        contents[name] = (ckpt["global_step"], ckpt["state_dict"], states)
    return contents


@pytest.mark.parametrize("config", list(PARITY_CONFIGS))
def test_finite_runs_match_model_checkpoint(config, tmp_path):
    callback_kwargs, trainer_kwargs = PARITY_CONFIGS[config]
    plain = ModelCheckpoint(dirpath=tmp_path / "plain", **callback_kwargs)
    guarded = FiniteGradCheckpoint(dirpath=tmp_path / "guarded", **callback_kwargs)
    for callback in (plain, guarded):
        # twice into the same directory, so the version counter comes into play
        fit(callback, trainer_kwargs)
        fit(callback, trainer_kwargs)
    p, g = str(tmp_path / "plain"), str(tmp_path / "guarded")
    assert relative_paths(ledger_state(guarded), g) == relative_paths(ledger_state(plain), p)
    assert {k: v for k, v in tree_digest(g).items() if v[0] == "link"} == {
        k: v for k, v in tree_digest(p).items() if v[0] == "link"}
    ours, theirs = _checkpoint_contents(g), _checkpoint_contents(p)
    assert list(ours) == list(theirs) and ours
    for name in ours:
        step_o, weights_o, states_o = ours[name]
        step_t, weights_t, states_t = theirs[name]
        assert step_o == step_t
        assert all(torch.equal(weights_o[k], weights_t[k]) for k in weights_t)
        # the one addition: the format version of the guard's own state
        assert states_o == {key: {**state, "ckguard_format_version": 1} for key, state in states_t.items()}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_one_agreement_per_boundary_however_many_files_it_writes(save_last, tmp_path, monkeypatch):
    agreements = count_agreements(monkeypatch)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=save_last)
    # every epoch improves: each validation boundary writes the top-1 file, evicts the old one and moves `last`
    fit(callback, dict(EPOCHS), val_losses=[4.0, 3.0, 2.0, 1.0])
    assert len(agreements) == 4
    assert sorted(os.listdir(tmp_path)) == ["epoch=3-step=12.ckpt", "last.ckpt"]


def test_boundaries_that_write_nothing_judge_the_window_once_and_do_not_consume_it(tmp_path, monkeypatch):
    agreements = count_agreements(monkeypatch)
    gate = SpikeGate(warmup_steps=100)  # never judges here; its history shows which windows were published
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "a", monitor="val_loss", save_top_k=1, save_last=True,
                                    spike_gate=gate)
    fit(callback, dict(EPOCHS, max_epochs=3), val_losses=[1.0, 2.0, 3.0])  # only epoch 0 is a top-1
    # one judgement per validation end, written or not (without peers the unwritten ones are local: no collective)
    assert agreements == [3, 6, 9]
    assert sorted(os.listdir(tmp_path / "a")) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    # an accepted window that was not published is not learned: only epoch 0's 3 steps
    assert {k: len(v) for k, v in callback.state_dict()["spike_history"].items()} == {"loss": 3, "grad_norm": 3}
    # nor consumed: epoch 3's publication covers steps 3 to 11, each learned once
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "b", monitor="val_loss", save_top_k=1, spike_gate=gate)
    fit(callback, dict(EPOCHS), val_losses=[2.0, 3.0, 4.0, 1.0])
    assert {k: len(v) for k, v in callback.state_dict()["spike_history"].items()} == {"loss": 12, "grad_norm": 12}


@pytest.mark.parametrize("policy", ["raise", "stop"])
def test_a_boundary_that_writes_nothing_applies_the_rejection_of_a_fault_before_it(policy, tmp_path):
    # a NaN at step 4 (epoch 1); no later validation makes the top 1, so no later boundary writes: the policy acts at
    # epoch 1's boundary all the same, rather than never
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True,
                                    on_non_finite=policy)
    with contextlib.ExitStack() as stack:
        if policy == "raise":
            stack.enter_context(pytest.raises(NonFiniteGradientError, match="at global step 6"))
        else:
            stack.enter_context(pytest.warns(UserWarning, match="at train epoch end.*global step 6.*Stopping"))
        trainer = fit(callback, EPOCHS, fault_steps=[4], val_losses=[1.0, 2.0, 3.0, 4.0])
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert callback.rejection is not None and callback.rejection.global_step == 6
    assert callback.rejection.first_step == 4
    if policy == "stop":
        assert trainer.global_step == 6


# saves at global steps 5 and 10; the fit ends at step 12, with no boundary after steps 10 and 11
TRAINING_STEPS = dict(max_steps=12, limit_train_batches=20, limit_val_batches=0, num_sanity_val_steps=0)


@pytest.mark.parametrize("policy", ["raise", "skip", "stop", "rewind"])
def test_steps_after_the_last_boundary_are_judged_at_train_end_and_sealed(policy, tmp_path):
    # a NaN at step 10, applied (the weights diverge): no boundary comes after it, and ModelCheckpoint writes nothing
    # at train end; the fit must not end as if nothing happened, nor a save after it publish the NaN weights
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}",
                                    on_non_finite=policy)
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **TRAINING_STEPS)
    model = FaultyModel(fault_steps=[10], sanitize=False)
    with contextlib.ExitStack() as stack:
        if policy == "raise":
            stack.enter_context(pytest.raises(NonFiniteGradientError, match="global step 12.*steps 10 to 11"))
        else:
            stack.enter_context(pytest.warns(UserWarning, match="at train end.*The fit had ended"))
        trainer.fit(model)
    assert not torch.isfinite(model.layer.weight).all()
    assert sorted(os.listdir(tmp_path)) == ["step=10.ckpt", "step=5.ckpt"]
    assert callback.rejection is not None and (callback.rejection.first_step, callback.rejection.global_step) == (
        10, 12)
    with pytest.raises(NonFiniteGradientError):
        trainer.save_checkpoint(tmp_path / "after-fit.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["step=10.ckpt", "step=5.ckpt"]


def test_finite_steps_after_the_last_boundary_are_accepted_at_train_end_and_not_learned(tmp_path, monkeypatch):
    agreements = count_agreements(monkeypatch)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}",
                                    spike_gate=SpikeGate(warmup_steps=100))
    trainer = fit(callback, TRAINING_STEPS)
    assert agreements == [5, 10, 12]  # without peers the last one is local: no collective
    assert callback.rejection is None and callback.last_verdict.accepted
    # only the published windows are learned: steps 0 to 9
    assert {k: len(v) for k, v in callback.state_dict()["spike_history"].items()} == {"loss": 10, "grad_norm": 10}
    trainer.save_checkpoint(tmp_path / "after-fit.ckpt")  # the fit's weights are finite: written as ever
    assert sorted(os.listdir(tmp_path)) == ["after-fit.ckpt", "step=10.ckpt", "step=5.ckpt"]


def test_with_save_top_k_0_nothing_is_ranked_so_only_the_end_of_the_fit_judges(tmp_path):
    # ModelCheckpoint asks for the monitored value at every validation but never ranks it: no boundary judges, and
    # the policy acts on the whole fit's steps at its end
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=0, on_non_finite="stop")
    with pytest.warns(UserWarning, match="at train end.*global step 12.*step 4"):
        trainer = fit(callback, EPOCHS, fault_steps=[4])
    assert trainer.global_step == 12 and os.listdir(tmp_path) == []
    assert callback.rejection is not None and callback.rejection.global_step == 12


def test_rejection_of_top_k_plus_link_changes_nothing(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last="link")
    model = FaultyModel(fault_steps=[7], val_losses=[3.0, 2.0, 1.0, 0.5])
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(model)
    assert info.value.fields() == {
        "ranks": [0], "first_step": 7, "last_step": 7, "num_steps": 1, "global_step": 9,
        "parameters": ["layer.weight"], "skipped_steps": 0, "pending_rejection": False, "non_finite_state": [],
    }
    assert tree_digest(str(tmp_path)) == model.snapshots[7]["tree"]
    assert ledger_state(callback) == model.snapshots[7]["state"]
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=6.ckpt"
    for word in ("global step 9", "rank 0", "step 7", "layer.weight"):
        assert word in str(info.value)


def test_a_subclass_saving_without_model_checkpoints_save_agrees_first(tmp_path):
    # its own `trainer.save_checkpoint` inside the boundary is the first file operation: a rejection publishes nothing
    from test_conformance import saves_without_super

    callback = saves_without_super(FiniteGradCheckpoint)(dirpath=tmp_path, monitor="val_loss", save_top_k=2)
    with pytest.raises(NonFiniteGradientError, match="steps 4 to 5"):
        fit(callback, EPOCHS, fault_steps=[4], sanitize=False)
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt"]
    assert list(callback.best_k_models) == [str(tmp_path / "epoch=0-step=3.ckpt")]


def test_skip_keeps_rejecting_until_a_new_step_runs(tmp_path):
    # the fault is in the last step and is applied (no sanitizing): the validation boundary is skipped, and the
    # `save_last` at train end, at the same global step, must not publish the poisoned weights either
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_last=True, on_non_finite="skip")
    trainer_kwargs = dict(max_epochs=1, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="rejected the checkpoint at train end.*Skipped"):
        trainer = fit(callback, trainer_kwargs, fault_steps=[2], sanitize=False)
    assert os.listdir(tmp_path) == []
    assert callback.best_k_models == {} and callback.last_model_path == ""
    # the fit ends with the rejection still pending: sealed, so a save after it cannot publish those weights; the
    # end of the fit restates it, and counts it no more (the validation's and the train end's boundaries rejected)
    assert callback.rejection is not None and callback._decisions.counts["rejected"] == 2
    with pytest.raises(NonFiniteGradientError):
        trainer.save_checkpoint(tmp_path / "after-fit.ckpt")
    assert os.listdir(tmp_path) == []


def test_stop_returns_normally_and_later_boundaries_publish_nothing(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=-1, save_last=True,
                                    on_non_finite="stop")
    with pytest.warns(UserWarning, match="Stopping training"):
        trainer = fit(callback, EPOCHS, fault_steps=[4])
    assert trainer.should_stop and trainer.global_step == 6
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert callback.rejection is not None and callback.rejection.global_step == 6


def _verbose_lines(caplog, callback_cls, root) -> list[str]:
    caplog.clear()
    callback = callback_cls(dirpath=root, monitor="val_loss", save_top_k=1, save_last=True, verbose=True)
    with caplog.at_level("INFO"):
        fit(callback, EPOCHS, val_losses=[3.0, 4.0, 2.0, 5.0])
    return [r.getMessage().replace(str(root), "<dir>") for r in caplog.records if "val_loss" in r.getMessage()]


def test_verbose_lines_match_model_checkpoint(caplog, tmp_path):
    theirs = _verbose_lines(caplog, ModelCheckpoint, tmp_path / "plain")
    ours = _verbose_lines(caplog, FiniteGradCheckpoint, tmp_path / "guarded")
    assert ours == theirs
    assert sum("was not in top 1" in line for line in ours) == 2 and sum("saving model" in line for line in ours) == 2


def test_rejected_boundary_logs_no_saving_line(caplog, tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, verbose=True)
    with caplog.at_level("INFO"), pytest.raises(NonFiniteGradientError):
        fit(callback, EPOCHS, fault_steps=[4])
    saving = [r.getMessage() for r in caplog.records if "saving model" in r.getMessage()]
    assert len(saving) == 1 and "epoch=0-step=3.ckpt" in saving[0]


@pytest.mark.parametrize("config", list(PARITY_CONFIGS))
def test_every_kind_of_boundary_rejects_and_changes_nothing(config, tmp_path):
    callback_kwargs, trainer_kwargs = PARITY_CONFIGS[config]
    callback = FiniteGradCheckpoint(dirpath=tmp_path, **callback_kwargs)
    model = FaultyModel(fault_steps=[4], val_losses=VAL_LOSSES, sanitize=False)
    seed_everything(0)
    with pytest.raises(NonFiniteGradientError) as info:
        Trainer(callbacks=[callback], **QUIET, **trainer_kwargs).fit(model)
    assert (info.value.ranks, info.value.first_step) == ((0,), 4)
    assert tree_digest(str(tmp_path)) == model.snapshots[4]["tree"]
    assert ledger_state(callback) == model.snapshots[4]["state"]


class FailsAt(FaultyModel):
    def __init__(self, fail_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_step = fail_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.fail_step:
            raise RuntimeError("data loader hiccup")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("cls", [ModelCheckpoint, FiniteGradCheckpoint])
def test_save_on_exception_with_a_finite_window_saves_like_model_checkpoint(cls, tmp_path):
    callback = cls(dirpath=tmp_path, monitor="val_loss", save_on_exception=True)
    seed_everything(0)
    with pytest.raises(RuntimeError, match="hiccup"):
        Trainer(callbacks=[callback], **QUIET, **EPOCHS).fit(FailsAt(5, val_losses=VAL_LOSSES))
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt", "epoch=1-step=5.ckpt"]


class FailsAtAndCannotSaveThere(FailsAt):
    """The checkpoint on exception cannot be made either (a disk full, a broken peer's collective)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.global_step == self.fail_step:
            raise OSError(28, "No space left on device (injected)")


def test_a_save_on_exception_that_fails_warns_and_the_original_error_surfaces(tmp_path):
    # ModelCheckpoint raises the save's error out of on_exception, in place of the one Lightning was handling (and
    # cuts Lightning's handling short); the guarded save is rolled back, says why on this rank, and lets it surface
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_on_exception=True)
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    with pytest.warns(UserWarning, match=r"\(rank 0\): no checkpoint saved on this exception: OSError: .*No space"), \
            pytest.raises(RuntimeError, match="hiccup"):
        trainer.fit(FailsAtAndCannotSaveThere(5, val_losses=VAL_LOSSES))
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=3.ckpt"]
    assert list(callback.best_k_models) == [str(tmp_path / "epoch=0-step=3.ckpt")]
    assert trainer.state.status == "interrupted"


def test_save_on_exception_after_a_nan_saves_nothing_and_keeps_the_original_error(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_on_exception=True)
    model = FailsAt(5, fault_steps=[4], val_losses=VAL_LOSSES)
    seed_everything(0)
    with pytest.warns(UserWarning, match="Nothing was saved on exception"), pytest.raises(RuntimeError, match="hiccup"):
        Trainer(callbacks=[callback], **QUIET, **EPOCHS).fit(model)
    assert tree_digest(str(tmp_path)) == model.snapshots[4]["tree"]
    assert callback.rejection is not None and callback.rejection.first_step == 4


class Clocked(FaultyModel):
    """Each batch takes 20 s on ``clock`` (ModelCheckpoint's ``time``, a ``FakeClock``)."""

    def __init__(self, clock: FakeClock, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.clock = clock

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.clock.advance(20.0)


def test_a_rejected_time_boundary_leaves_the_clock_as_it_was_so_the_next_batch_saves(tmp_path, monkeypatch):
    # a save per minute of 20 s batches is due at steps 3, 6 and 9. Step 6's is rejected (step 5's NaN) and skipped:
    # the time ModelCheckpoint marked for it is undone with the rest of its bookkeeping, so the save is still due at
    # the next batch (step 7), and the next minute counts from there (step 10)
    import lightning.pytorch.callbacks.model_checkpoint as model_checkpoint_module

    clock = FakeClock()
    monkeypatch.setattr(model_checkpoint_module, "time", clock)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(minutes=1), save_top_k=-1,
                                    filename="{step}", on_non_finite="skip")
    seed_everything(0)
    with pytest.warns(UserWarning, match="Skipped"):
        Trainer(callbacks=[callback], max_steps=10, limit_val_batches=0, **QUIET).fit(Clocked(clock, fault_steps=[5]))
    assert sorted(os.listdir(tmp_path)) == ["step=10.ckpt", "step=3.ckpt", "step=7.ckpt"]
