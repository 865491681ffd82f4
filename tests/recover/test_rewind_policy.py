"""``on_non_finite="rewind"`` in one process: its arguments, its error, and a rewind a user can observe (weights,
optimizer, scheduler and the loss scaler as in the file, the loop counters going on, the rewind log), and the
Trainer-free ``restore_fabric_state``. The 2-process strategies are in ``tests/recover/test_rewind.py``."""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, EarlyStopping, Timer
from lightning.pytorch.plugins import MixedPrecision

from helpers import QUIET, AtStepEnd, FaultyModel, rewind_log
from lightning_ckguard import (
    FiniteGradCheckpoint,
    GradientGuard,
    NonFiniteGradientError,
    RewindRefusedError,
    restore_fabric_state,
)
from lightning_ckguard.recover.rewind import REWIND_LOG_NAME


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(on_non_finite="rewind", max_rewinds=-1), "`max_rewinds` must be an int >= 0"),
        (dict(on_non_finite="rewind", max_rewinds=1.5), "`max_rewinds` must be an int >= 0"),
        (dict(on_non_finite="rewind", max_rewinds=True), "`max_rewinds` must be an int >= 0"),
        (dict(on_non_finite="rewind", max_rewinds="3"), "`max_rewinds` must be an int >= 0"),
        (dict(max_rewinds=2), "`max_rewinds` is only used with `on_non_finite='rewind'`"),
        (dict(on_non_finite="skip", max_rewinds=0), "`max_rewinds` is only used with `on_non_finite='rewind'`"),
        (dict(on_non_finite="rewind", save_weights_only=True), "`save_weights_only=True`"),
    ],
)
def test_bad_rewind_arguments_are_a_value_error_at_construction(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        FiniteGradCheckpoint(**kwargs)


def test_valid_rewind_arguments_are_accepted():
    assert FiniteGradCheckpoint(on_non_finite="rewind").max_rewinds is None  # 3 per fit
    assert FiniteGradCheckpoint(on_non_finite="rewind", max_rewinds=0).max_rewinds == 0


def test_the_refusal_is_a_non_finite_gradient_error_and_a_value():
    error = RewindRefusedError(reason="no checkpoint", rewinds=["one"], ranks=[1], first_step=3, last_step=3,
                               num_steps=1, global_step=4, parameters=["w"])
    assert isinstance(error, NonFiniteGradientError)
    assert pickle.loads(pickle.dumps(error)) == error == copy.deepcopy(error)
    assert error.fields()["reason"] == "no checkpoint" and error.fields()["rewinds"] == ["one"]
    assert str(error).startswith("Refusing to publish a checkpoint at global step 4")
    assert "No rewind: no checkpoint. Earlier rewinds in this fit: (1) one" in str(error)


class AdamModel(FaultyModel):
    """Adam with a per-step scheduler, so optimizer and scheduler state (and their step counts) must come back."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class AfterRewind(Callback):
    """At the batch start right after each rewind: the live state against the file it went back to."""

    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rewinds = trainer.checkpoint_callback.rewinds
        if len(rewinds) == len(self.checks):
            return
        stored = torch.load(rewinds[-1].checkpoint, weights_only=False)
        live = pl_module.state_dict()
        optimizer = trainer.optimizers[0].state_dict()
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.checks.append({
            "global_step": trainer.global_step,
            "weights": all(torch.equal(live[k], v) for k, v in stored["state_dict"].items()),
            "optimizer": all(torch.equal(optimizer["state"][i][k], v)
                             for i, state in stored["optimizer_states"][0]["state"].items() for k, v in state.items()),
            "adam_step": float(optimizer["state"][0]["step"]),
            "scheduler": scheduler.state_dict() == stored["lr_schedulers"][0],
            "scheduler_epoch": scheduler.last_epoch,
            "scaler": getattr(trainer.precision_plugin, "scaler", None) is None
            or trainer.precision_plugin.scaler.state_dict() == stored["MixedPrecision"],
        })


def _fit(tmp_path, fault_steps, max_rewinds=2, max_steps=14):
    seed_everything(0)
    # the scaler skips the inf step (and halves its scale); count_skipped_steps=True makes the skip reject
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=2, monitor="step",
                                    mode="max", save_last=True, filename="{step}", on_non_finite="rewind",
                                    max_rewinds=max_rewinds, count_skipped_steps=True)
    probe = AfterRewind()
    # fp16 loss scaling on the CPU: the scaler's state comes back too
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = Trainer(max_steps=max_steps, callbacks=[probe, callback], limit_val_batches=0,
                      plugins=[MixedPrecision("16-mixed", "cpu", scaler)], **QUIET)
    model = AdamModel(fault_steps=fault_steps, sanitize=False, value=float("inf"), lr=0.01)
    return trainer, callback, probe, model


def test_a_rewind_restores_the_file_and_the_loop_goes_on(tmp_path):
    trainer, callback, probe, model = _fit(tmp_path, fault_steps=(3, 7))
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(model)
    assert trainer.global_step == 14  # counted on, never back
    assert [c["global_step"] for c in probe.checks] == [4, 8]
    for check in probe.checks:
        assert check["weights"] and check["optimizer"] and check["scheduler"] and check["scaler"], check
    # the optimizer's and the scheduler's step counts are the checkpoint's, not the loop's: step=6.ckpt holds the
    # 4 updates that survived the first rewind (steps 0, 1, 4, 5), while global_step says 8
    assert [(c["adam_step"], c["scheduler_epoch"]) for c in probe.checks] == [(2.0, 2), (4.0, 4)]
    assert [os.path.basename(r.checkpoint) for r in callback.rewinds] == ["step=2.ckpt", "step=6.ckpt"]
    assert rewind_log(tmp_path) == [r.as_dict() for r in callback.rewinds]
    assert sorted(os.listdir(tmp_path)) == [REWIND_LOG_NAME, "last.ckpt", "step=12.ckpt", "step=14.ckpt"]


def test_a_rejected_top_k_boundary_rewinds_and_the_top_k_goes_on(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, filename="{epoch}",
                                    on_non_finite="rewind", count_skipped_steps=True)  # the scaler skips the step
    probe = AfterRewind()
    precision = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))
    trainer = Trainer(max_epochs=4, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0,
                      callbacks=[probe, callback], plugins=[precision], **QUIET)
    model = AdamModel(fault_steps=(3,), sanitize=False, val_losses=[10.0, 9.0, 8.0, 7.0], lr=0.01)
    # epoch 1's boundary (after its validation, at train epoch end, global step 4) saw step 3's NaN: back to epoch 0's
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(model)
    (rewind,) = callback.rewinds
    assert (rewind.boundary, rewind.global_step, os.path.basename(rewind.checkpoint)) == ("train epoch end", 4,
                                                                                          "epoch=0.ckpt")
    assert rewind.skipped_batches == (2, 3) and rewind.discarded_steps == (2, 3)
    assert probe.checks[0]["weights"] and probe.checks[0]["optimizer"] and probe.checks[0]["scaler"]
    assert trainer.global_step == 8
    assert sorted(os.path.basename(p) for p in callback.best_k_models) == ["epoch=2.ckpt", "epoch=3.ckpt"]
    assert sorted(os.listdir(tmp_path)) == [REWIND_LOG_NAME, "epoch=2.ckpt", "epoch=3.ckpt"]


class Regression(LightningModule):
    """A linear regression whose validation loss comes from its weights (NaN once they are), on fixed batches; the
    targets of train batch ``bad`` (within each epoch) are NaN, and those of global step ``bad_step``."""

    def __init__(self, bad: int = -1, bad_step: int = -1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.bad, self.bad_step = bad, bad_step

    def _batches(self, count: int, bad: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        data = []
        for index in range(count):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(index))
            y = x.sum(dim=1, keepdim=True)
            data.append((x, y * float("nan") if index == bad else y))
        return data

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        targets = batch[1] * float("nan") if self.trainer.global_step == self.bad_step else batch[1]
        return torch.nn.functional.mse_loss(self.layer(batch[0]), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self._batches(20, self.bad), batch_size=None)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self._batches(3), batch_size=None)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class EarlyStoppingAfterRewind(Callback):
    """At the batch start right after each rewind: EarlyStopping's state against the file it went back to."""

    def __init__(self, early_stopping: EarlyStopping) -> None:
        self.early_stopping, self.checks = early_stopping, []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rewinds = trainer.checkpoint_callback.rewinds
        if len(rewinds) > len(self.checks):
            stored = torch.load(rewinds[-1].checkpoint, weights_only=False)["callbacks"][self.early_stopping.state_key]
            self.checks.append(self.early_stopping.state_dict() == stored and not trainer.should_stop)


def test_a_rewind_undoes_what_early_stopping_decided_on_the_discarded_weights(tmp_path):
    # EarlyStopping runs its validation-end check before the checkpoint callback: it sees the rejected validation's
    # NaN val_loss (computed on the diverged weights) and asks the fit to stop; the rewind that follows goes back to
    # weights on which it never decided that, so training goes on to max_epochs
    seed_everything(0)
    early_stopping = EarlyStopping(monitor="val_loss", patience=3)
    probe = EarlyStoppingAfterRewind(early_stopping)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True,
                                    on_non_finite="rewind")
    trainer = Trainer(max_epochs=2, val_check_interval=5, callbacks=[probe, early_stopping, callback], **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(Regression(bad=12))
    assert [(r.global_step, r.checkpoint_global_step) for r in callback.rewinds] == [(15, 10), (35, 30)]
    assert trainer.global_step == 40 and early_stopping.stopped_epoch == 0
    assert probe.checks == [True, True]


def test_two_rewinds_to_the_same_checkpoint_record_each_its_own_discarded_steps(tmp_path):
    # NaN at global step 5, rewound at 8 to step 4's checkpoint; NaN again at step 9 (batch 9), rewound at 12 to the
    # same checkpoint, with nothing published between: the second discarded steps 8-11, not 4-11 again
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}",
                                    on_non_finite="rewind")
    trainer = Trainer(max_steps=16, limit_val_batches=0, callbacks=[callback], **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place") as warned:
        trainer.fit(Regression(bad=9, bad_step=5))
    assert [(r.global_step, r.checkpoint_global_step, r.discarded_steps, r.skipped_batches)
            for r in callback.rewinds] == [(8, 4, (4, 7), (4, 7)), (12, 4, (8, 11), (8, 11))]
    logged = rewind_log(tmp_path)
    assert [(line["discarded_steps"], line["skipped_batches"]) for line in logged] == [([4, 7], [4, 7]),
                                                                                      ([8, 11], [8, 11])]
    # numbered from 1 in the record, the log and the warning
    assert [r.number for r in callback.rewinds] == [1, 2]
    assert [line["number"] for line in logged] == [1, 2]
    said = [str(w.message) for w in warned if "Rewound in place" in str(w.message)]
    assert len(said) == 2
    for number, (message, step) in enumerate(zip(said, (8, 12), strict=True), start=1):
        assert f"Rewound in place (rewind {number} of at most 3 in this fit): rewind {number} at global step {step} " \
               in message, message


class AskToStopAt(Callback):
    """Asks the fit to stop at the validation of ``step`` (a budget or plateau callback), before the checkpoint
    callback runs."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_rewind_keeps_the_stop_asked_for_when_its_checkpoint_was_published(tmp_path):
    # the stop asked for at step 10 waits for min_steps; the NaN at step 12 rewinds to step 10's checkpoint, whose
    # weights the stop was decided on: it stands, and the fit ends as it would have without the NaN
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, on_non_finite="rewind")
    trainer = Trainer(max_epochs=2, min_steps=12, val_check_interval=5, callbacks=[AskToStopAt(10), callback], **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(Regression(bad=12))
    assert [(r.global_step, r.checkpoint_global_step) for r in callback.rewinds] == [(15, 10)]
    assert trainer.global_step == 20 and trainer.should_stop


def test_a_resumed_fit_rewinds_to_the_checkpoint_it_resumed_from_until_it_publishes_one(tmp_path):
    # the first fit publishes steps 4 and 8; the second resumes from step 8's and is hit at step 9, before its first
    # boundary (12): it goes back to where it started, rather than refusing (nothing of its own published yet)
    def fit(max_steps: int, ckpt_path: str | None, fault_steps: tuple[int, ...]) -> tuple[Any, Any, Any]:
        seed_everything(0)
        callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}",
                                        on_non_finite="rewind")
        probe = AfterRewind()
        trainer = Trainer(max_steps=max_steps, limit_val_batches=0, callbacks=[probe, callback], **QUIET)
        trainer.fit(AdamModel(fault_steps=fault_steps, sanitize=False, lr=0.01), ckpt_path=ckpt_path)
        return trainer, callback, probe

    fit(8, None, ())
    with pytest.warns(UserWarning, match="Rewound in place.*step=8.ckpt"):
        trainer, callback, probe = fit(16, str(tmp_path / "step=8.ckpt"), (9,))
    (rewind,) = callback.rewinds
    assert (os.path.basename(rewind.checkpoint), rewind.checkpoint_global_step, rewind.global_step) == (
        "step=8.ckpt", 8, 12)
    assert rewind.discarded_steps == (8, 11) and rewind.skipped_batches == (8, 11)
    (check,) = probe.checks
    assert check["weights"] and check["optimizer"] and check["scheduler"], check
    assert trainer.global_step == 16 and callback.rejection is None
    assert sorted(os.listdir(tmp_path)) == [REWIND_LOG_NAME, "step=16.ckpt", "step=4.ckpt", "step=8.ckpt"]
    stored = torch.load(tmp_path / "step=16.ckpt", weights_only=False)["state_dict"]
    assert all(torch.isfinite(value).all() for value in stored.values())


class TimeUpFrom(Timer):
    """A ``Timer`` checked at each epoch end, whose time is up from global step ``step`` on."""

    def __init__(self, step: int) -> None:
        super().__init__(duration=dict(seconds=100), interval="epoch")
        self.step, self.trainer = step, None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        super().on_train_start(trainer, pl_module)

    def time_elapsed(self, stage: str = "train") -> float:
        return 1e9 if self.trainer is not None and self.trainer.global_step >= self.step else 0.0


def test_a_rewind_keeps_the_stop_of_a_timer_whose_time_is_up(tmp_path):
    # the Timer's epoch-end check (before the checkpoint callback's) asks to stop at step 40, where the boundary
    # rejects step 37's NaN and rewinds: the stop stands, rather than running one more epoch past the time budget
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, on_non_finite="rewind")
    trainer = Trainer(max_epochs=5, callbacks=[TimeUpFrom(40), callback], **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(Regression(bad_step=37))
    assert [(r.global_step, r.checkpoint_global_step) for r in callback.rewinds] == [(40, 20)]
    assert trainer.global_step == 40


def test_max_rewinds_zero_raises_at_the_first_rejection_and_seals(tmp_path):
    trainer, callback, _, model = _fit(tmp_path, fault_steps=(3,), max_rewinds=0)
    with pytest.raises(RewindRefusedError, match="`max_rewinds=0` rewinds were made in this fit already"):
        trainer.fit(model)
    assert callback.rejection is not None and callback.rewinds == ()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]


def test_restore_fabric_state_rewinds_a_fabric_loop(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    guard = GradientGuard(model)

    def step(value: float | None = None) -> None:
        optimizer.zero_grad()
        fabric.backward(model(torch.ones(3, 4)).sum())
        if value is not None:
            model.weight.grad[0, 0] = value
        guard.record(optimizer)
        optimizer.step()

    step()
    path = str(tmp_path / "good.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    step(float("nan"))
    assert not guard.agree(None).accepted
    remainder = restore_fabric_state(fabric, path, {"model": model, "optimizer": optimizer}, guard)
    assert remainder == {"step": 1}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert float(optimizer.state_dict()["state"][0]["step"]) == 1.0
    assert guard.agree(None).accepted  # a fresh window


def test_without_a_monitor_a_rewind_goes_back_to_the_steps_own_file_not_to_last(tmp_path):
    # without a monitor ModelCheckpoint keeps its top-K files out of best_k_models; `last` holds the same state at
    # the boundary, but a later boundary rewrites it: the rewind record must name the file that keeps that state
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_last=True,
                                    on_non_finite="rewind", count_skipped_steps=True)
    trainer = Trainer(max_steps=12, limit_val_batches=0, callbacks=[callback], **QUIET,
                      plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10))])
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(AdamModel(fault_steps=(7,), sanitize=False, lr=0.01))
    (rewind,) = callback.rewinds
    assert (rewind.global_step, os.path.basename(rewind.checkpoint)) == (10, "epoch=0-step=5.ckpt")
    assert [line["checkpoint"] for line in rewind_log(tmp_path)] == [rewind.checkpoint]


def test_a_rewind_whose_checkpoint_was_deleted_is_refused_saying_so(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}",
                                    on_non_finite="rewind")
    seed_everything(0)
    trainer = Trainer(max_steps=6, callbacks=[AtStepEnd(3, lambda _: os.remove(tmp_path / "step=2.ckpt")), callback],
                      limit_val_batches=0, **QUIET)
    with pytest.raises(RewindRefusedError, match=r"step=2.ckpt, no longer exists"):
        trainer.fit(FaultyModel(fault_steps=[3], sanitize=False))
    assert os.listdir(tmp_path) == []

