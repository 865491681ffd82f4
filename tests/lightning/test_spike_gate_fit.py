"""``FiniteGradCheckpoint(spike_gate=...)`` in a single-process fit: a finite spike (one batch's targets scaled by
1e3) is rejected with its step, value and baseline; ``"rewind"`` goes back and ends where a run that never saw the
bad batch ends; the loss of an accumulated step is what Lightning counts; the ``ckguard/*`` levels reach the logger.

2-process runs (DDP, FSDP2, DeepSpeed ZeRO-2) are in ``tests/recover/test_spike_gate.py``.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

from helpers import QUIET, FailingWrites, FaultyModel, RecordingLogger, rewind_log
from lightning_ckguard import FiniteGradCheckpoint, GradientGuard, SpikeGate
from lightning_ckguard.record import step_values as rows

BAD_BATCH = 20
GATE = SpikeGate(warmup_steps=8, history=200)


def batches(count: int, bad: int | None = BAD_BATCH, skip: int | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Deterministic regression batches, one per index; ``bad``'s targets are scaled by 1e3 (finite), ``skip`` is
    left out (the run that never saw the bad batch)."""
    data = []
    weight = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(8, 4, generator=generator)
        y = x @ weight + 0.1 * torch.randn(8, 1, generator=generator)
        if index == bad:
            y = y * 1e3
        if index != skip:
            data.append((x, y))
    return data


class Regression(LightningModule):
    def __init__(self, data: list[tuple[torch.Tensor, ...]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.data = data
        self.losses: list[float] = []  # every training_step's loss, as returned

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.layer(x) - y).pow(2).mean()
        self.losses.append(float(loss))
        self.log("train_loss", loss)  # Lightning's flush of every step carries the guard's values
        return loss

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=None, shuffle=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def fit(root: Any, data: list, policy: str = "skip", max_steps: int = 30, gate: SpikeGate | None = GATE,
        ckpt_path: Any = None, model_class: type[Regression] = Regression, **trainer_options: Any
        ) -> tuple[FiniteGradCheckpoint, Regression, RecordingLogger, list[str]]:
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=os.path.join(root, "checkpoints"), filename="{step}",
                                    every_n_train_steps=1, save_top_k=-1, on_non_finite=policy, spike_gate=gate)
    model, logger = model_class(data), RecordingLogger()
    callbacks = [*trainer_options.pop("callbacks", []), callback]
    options = {**QUIET, "logger": logger, "log_every_n_steps": 1, **trainer_options}
    trainer = Trainer(max_steps=max_steps, limit_val_batches=0, callbacks=callbacks, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=ckpt_path)
    return callback, model, logger, [str(w.message) for w in caught if "FiniteGradCheckpoint" in str(w.message)]


def test_a_finite_spike_is_rejected_with_its_step_value_and_baseline(tmp_path):
    callback, model, logger, messages = fit(tmp_path, batches(40), policy="skip", max_steps=24)
    rejected = [m for m in messages if "rejected the checkpoint" in m]
    assert rejected, messages
    # the bad batch is the 21st step (global step 20): its boundary, at global step 21, published nothing
    assert "Refusing to publish a checkpoint at global step 21: the loss spiked at step 20 to" in rejected[0]
    assert "the global gradient norm spiked at step 20" in rejected[0]
    files = sorted(os.listdir(tmp_path / "checkpoints"))
    assert "step=20.ckpt" in files and "step=21.ckpt" not in files
    # the levels ride in Lightning's flush: a baseline from the end of the warm-up on, the window's largest value
    logged = {key for _, metrics in logger.calls for key in metrics}
    assert {"ckguard/loss_baseline", "ckguard/loss_window_max", "ckguard/grad_norm_baseline",
            "ckguard/grad_norm_window_max"} <= logged
    ratios = [m["ckguard/loss_window_max"] / m["ckguard/loss_baseline"] for _, m in logger.calls
              if "ckguard/loss_baseline" in m]
    assert max(ratios) > 1e4 and sorted(ratios)[len(ratios) // 2] < 10, ratios  # the spike's, and the usual


def test_rewind_ends_where_a_run_that_never_saw_the_bad_batch_ends(tmp_path):
    callback, model, _, messages = fit(tmp_path / "rewound", batches(40), policy="rewind", max_steps=30)
    (rewind,) = callback.rewinds
    assert (rewind.global_step, rewind.checkpoint_global_step, rewind.skipped_batches) == (21, 20, (20, 20))
    assert [(s.measure, s.first_step) for s in rewind.spikes] == [("loss", 20), ("grad_norm", 20)]
    assert any("Rewound in place" in m and "the loss spiked at step 20" in m for m in messages), messages
    # the global step counts on through a rewind: the 30 steps made 29 updates, the bad one discarded
    _, reference, _, _ = fit(tmp_path / "reference", batches(40, skip=BAD_BATCH), policy="rewind", max_steps=29)
    for (name, rewound), (_, clean) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(rewound, clean, rtol=1e-5, atol=1e-6, msg=name)
    # and every checkpoint published after the rewind holds the reference run's state after as many updates
    for step in (22, 25, 30):
        rewound = torch.load(tmp_path / "rewound" / "checkpoints" / f"step={step}.ckpt", weights_only=True)
        clean = torch.load(tmp_path / "reference" / "checkpoints" / f"step={step - 1}.ckpt", weights_only=True)
        for name, value in rewound["state_dict"].items():
            torch.testing.assert_close(value, clean["state_dict"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert rewound["optimizer_states"][0]["state"][0]["step"] == clean["optimizer_states"][0]["state"][0]["step"]


class Frozen(Regression):
    """Learns nothing: every clean step has the same loss and gradient norm, so their spread is 0."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_the_rewind_log_stays_strict_json_when_a_spike_is_infinitely_many_deviations_away(tmp_path):
    data = [(torch.ones(8, 4), torch.ones(8, 1) * (1e3 if index == BAD_BATCH else 1.0)) for index in range(40)]
    callback, _, _, _ = fit(tmp_path, data, policy="rewind", max_steps=24, model_class=Frozen)
    (rewind,) = callback.rewinds
    assert {spike.deviations for spike in rewind.spikes} == {float("inf")}
    (line,) = rewind_log(tmp_path / "checkpoints")  # read as strict JSON
    assert line == rewind.as_dict()
    assert [float(spike["deviations"]) for spike in line["spikes"]] == [float("inf")] * len(rewind.spikes)


def test_the_loss_of_an_accumulated_step_is_the_mean_of_its_micro_batches(tmp_path):
    callback, model, _, messages = fit(tmp_path, batches(80, bad=41), policy="stop", max_steps=30,
                                       accumulate_grad_batches=2)
    # batches 40 and 41 make global step 20; Lightning scales each loss by 1/2 and the step's loss is their sum
    (spike,) = [s for s in callback.rejection.spikes if s.measure == "loss"]
    assert spike.first_step == 20
    assert spike.value == pytest.approx((model.losses[40] + model.losses[41]) / 2, rel=1e-6)


class ManualSave(Callback):
    """A manual ``trainer.save_checkpoint`` at the start or the end of batch ``at`` (a user's callback: at the end,
    before ``FiniteGradCheckpoint``'s own hook); a failure is kept, and training goes on."""

    def __init__(self, at: int, path: Any, when: str = "end") -> None:
        self.at, self.path, self.when = at, path, when
        self.failure: Exception | None = None
        self.history_before: dict[str, int] = {}
        self.history_after: dict[str, int] = {}

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (self.when, batch_idx) == ("start", self.at):
            self._save(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (self.when, batch_idx) == ("end", self.at):
            self._save(trainer)

    def _save(self, trainer: Trainer) -> None:
        guard = next(c for c in trainer.callbacks if isinstance(c, FiniteGradCheckpoint))._fit.guard
        self.history_before = {m: len(v) for m, v in guard._spike_history.values.items()}
        try:
            trainer.save_checkpoint(self.path)
        except OSError as error:
            self.failure = error
        self.history_after = {m: len(v) for m, v in guard._spike_history.values.items()}


def test_a_save_between_micro_batches_keeps_the_first_ones_loss_for_its_step(tmp_path):
    # batches 40 and 41 make global step 20; the bad one is the first, and a save runs after it (and agrees)
    save = ManualSave(41, tmp_path / "between.ckpt", when="start")
    callback, model, _, _ = fit(tmp_path, batches(80, bad=40), policy="stop", max_steps=30,
                                accumulate_grad_batches=2, callbacks=[save])
    assert save.failure is None and (tmp_path / "between.ckpt").exists()
    (spike,) = [s for s in callback.rejection.spikes if s.measure == "loss"]
    assert spike.first_step == 20
    assert spike.value == pytest.approx((model.losses[40] + model.losses[41]) / 2, rel=1e-6)


def test_a_save_before_the_guards_batch_end_judges_the_steps_own_loss(tmp_path):
    save = ManualSave(BAD_BATCH, tmp_path / "manual.ckpt")  # runs before FiniteGradCheckpoint's batch end
    callback, model, _, _ = fit(tmp_path, batches(40), policy="stop", max_steps=24, callbacks=[save])
    assert not (tmp_path / "manual.ckpt").exists()  # the manual save agreed first, and was refused
    (spike,) = [s for s in callback.rejection.spikes if s.measure == "loss"]
    assert (spike.first_step, spike.value) == (BAD_BATCH, pytest.approx(model.losses[BAD_BATCH], rel=1e-6))


def test_a_manual_save_that_fails_teaches_the_gate_nothing(tmp_path):
    (tmp_path / "a_file").write_text("")  # a path under a regular file cannot be written
    save = ManualSave(12, tmp_path / "a_file" / "manual.ckpt")
    callback, *_ = fit(tmp_path, batches(40, bad=None), max_steps=13, callbacks=[save],
                       gate=SpikeGate(warmup_steps=8, history=200))
    assert save.failure is not None
    # the checkpoints of steps 1-12 were published one by one: 12 values learned before the save, and the failed save
    # learned none; the boundary of step 13 then published the window that the failed save had agreed on
    assert save.history_before == save.history_after == {"loss": 12, "grad_norm": 12}
    published = torch.load(tmp_path / "checkpoints" / "step=13.ckpt", weights_only=True)
    history = published["callbacks"][callback.state_key]["spike_history"]
    assert {m: len(v) for m, v in history.items()} == {"loss": 13, "grad_norm": 13}


class StepLosses(Callback):
    """The loss the gate recorded for each step, read before ``FiniteGradCheckpoint``'s boundary (a user's callback
    runs first), where the window holds that step alone."""

    def __init__(self) -> None:
        self.recorded: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        callback = next(c for c in trainer.callbacks if isinstance(c, FiniteGradCheckpoint))
        values = callback._fit.guard.window.step_values
        self.recorded.append(float(values.summary()[rows.LOSS * values.capacity]))


def test_the_loss_under_a_loss_scaler_is_the_one_training_step_returned(tmp_path):
    # Lightning's fp16 mixed precision multiplies the loss by the scaler's scale before each backward
    losses = StepLosses()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)  # a new scale every step, no overflow
    _, model, _, _ = fit(tmp_path, batches(40, bad=None), max_steps=6, callbacks=[losses],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    assert scaler.get_scale() == 4.0 * 2**6
    assert losses.recorded == pytest.approx(model.losses, rel=1e-6)


class WrapSaveAtTrainStart(Callback):
    """Wraps ``trainer.save_checkpoint`` once the fit runs, over the callback's seal (a profiler or a logger might)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        sealed = trainer.save_checkpoint

        def counted(*args: Any, **kwargs: Any) -> None:
            self.calls += 1
            sealed(*args, **kwargs)

        trainer.save_checkpoint = counted


def test_a_manual_save_through_a_wrapper_installed_after_the_seal_is_admitted_and_teaches_the_gate(tmp_path):
    wrapper, save = WrapSaveAtTrainStart(), ManualSave(12, tmp_path / "manual.ckpt")
    fit(tmp_path, batches(40, bad=None), max_steps=13, callbacks=[wrapper, save])
    assert wrapper.calls > 1 and save.failure is None and (tmp_path / "manual.ckpt").exists()  # boundaries too
    assert save.history_after == {"loss": 13, "grad_norm": 13}  # the window the save published, learned


def test_a_finite_run_with_the_gate_publishes_what_model_checkpoint_does(tmp_path):
    fit(tmp_path / "guarded", batches(40, bad=None), max_steps=24)
    seed_everything(0)
    plain = ModelCheckpoint(dirpath=tmp_path / "plain" / "checkpoints", filename="{step}", every_n_train_steps=1,
                            save_top_k=-1)
    Trainer(max_steps=24, limit_val_batches=0, callbacks=[plain], **QUIET).fit(Regression(batches(40, bad=None)))
    assert sorted(os.listdir(tmp_path / "guarded" / "checkpoints")) == sorted(os.listdir(plain.dirpath))


def test_a_resumed_fit_keeps_the_gates_baseline_and_catches_a_spike_at_its_first_step(tmp_path):
    callback, *_ = fit(tmp_path / "first", batches(40, bad=None), max_steps=12)
    resumed_from = tmp_path / "first" / "checkpoints" / "step=12.ckpt"
    checkpoint = torch.load(resumed_from, weights_only=True)
    history = checkpoint["callbacks"][callback.state_key]["spike_history"]
    # every accepted step, the one this checkpoint publishes included
    assert {measure: len(values) for measure, values in history.items()} == {"loss": 12, "grad_norm": 12}
    spiking = [(x, y * 1e3) for x, y in batches(40, bad=None)]  # every batch after the resume spikes
    callback, _, _, messages = fit(tmp_path / "resumed", spiking, max_steps=13, ckpt_path=resumed_from)
    assert any("the loss spiked at step 12" in m for m in messages), messages
    # skipped at the fit's last boundary: the fit ends on the rejected weights, so the run is sealed
    assert callback.rejection is not None and any("The fit had ended" in m for m in messages)
    # the same resume from a checkpoint without the history warms up again, and misses it
    del checkpoint["callbacks"][callback.state_key]["spike_history"]
    torch.save(checkpoint, tmp_path / "without_history.ckpt")
    _, _, _, messages = fit(tmp_path / "control", spiking, max_steps=13, ckpt_path=tmp_path / "without_history.ckpt")
    assert not any("spiked" in m for m in messages), messages


def test_a_malformed_spike_history_is_a_value_error():
    guard = GradientGuard(torch.nn.Linear(2, 1), spike_gate=SpikeGate())
    with pytest.raises(ValueError, match="spike history of 'loss' must be a list of finite numbers"):
        guard.load_state_dict({"spike_history": {"loss": [1.0, float("nan")]}})
    with pytest.raises(ValueError, match="must be a mapping"):
        guard.load_state_dict({"spike_history": [1.0]})
    guard.load_state_dict({"spike_history": {"loss": [2.0] * 5, "unwatched": [1.0]}})
    assert guard.state_dict() == {"spike_history": {"loss": [2.0] * 5, "grad_norm": []}}
    assert GradientGuard(torch.nn.Linear(2, 1)).state_dict() == {}


def test_the_gates_history_outlives_its_fit_in_the_callbacks_state_and_in_a_next_fit(tmp_path):
    callback, *_ = fit(tmp_path, batches(40, bad=None), max_steps=12)
    # after the fit, the callback's state holds what its last checkpoint holds (a `trainer.save_checkpoint` now too)
    last = torch.load(tmp_path / "checkpoints" / "step=12.ckpt", weights_only=True)
    assert callback.state_dict()["spike_history"] == last["callbacks"][callback.state_key]["spike_history"]
    # a next fit with the same callback keeps the baseline: a spike at its first step is caught, not warmed up on
    seed_everything(0)
    trainer = Trainer(max_steps=1, limit_val_batches=0, callbacks=[callback], **QUIET)
    with pytest.warns(UserWarning, match="the loss spiked at step 0"):
        trainer.fit(Regression([(x, y * 1e3) for x, y in batches(40, bad=None)]))


class PickleThenRaise(Callback):
    """At global step 12: a copy of the guarded callback (pickled while its fit runs); then an exception ends it."""

    def __init__(self, guarded: FiniteGradCheckpoint) -> None:
        self.guarded, self.copy = guarded, b""

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 12:
            self.copy = pickle.dumps(self.guarded)
            raise RuntimeError("boom")


def test_the_gates_history_outlives_a_fit_an_exception_ended_and_travels_with_a_copy(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1,
                                    spike_gate=GATE, on_non_finite="skip")
    interrupt = PickleThenRaise(callback)
    with pytest.raises(RuntimeError, match="boom"):  # Lightning runs no teardown hook after an exception
        Trainer(max_steps=30, limit_val_batches=0, callbacks=[interrupt, callback], **QUIET).fit(
            Regression(batches(40, bad=None)))
    for guarded in (callback, pickle.loads(interrupt.copy)):  # each keeps the baseline for its next fit
        seed_everything(0)
        trainer = Trainer(max_steps=1, limit_val_batches=0, callbacks=[guarded], **QUIET)
        with pytest.warns(UserWarning, match="the loss spiked at step 0"):
            trainer.fit(Regression([(x, y * 1e3) for x, y in batches(40, bad=None)]))


class HistoryAtTrainStart(Callback):
    def __init__(self, callback: FiniteGradCheckpoint) -> None:
        self.callback, self.values = callback, None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.values = len(self.callback._fit.guard.state_dict()["spike_history"]["loss"])


def test_a_state_loaded_after_a_fit_an_exception_ended_is_the_next_fits(tmp_path):
    # the ended fit stays in place (no teardown after an exception): a state loaded by hand then (an earlier
    # checkpoint's) is what the callback's state says and what the next fit's gate starts from
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1,
                                    spike_gate=GATE, on_non_finite="skip")
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(max_steps=30, limit_val_batches=0, callbacks=[PickleThenRaise(callback), callback], **QUIET).fit(
            Regression(batches(40, bad=None)))
    state = torch.load(tmp_path / "step=3.ckpt", weights_only=True)["callbacks"][callback.state_key]
    assert len(state["spike_history"]["loss"]) == 3
    callback.load_state_dict(state)
    assert len(callback.state_dict()["spike_history"]["loss"]) == 3
    probe = HistoryAtTrainStart(callback)
    seed_everything(0)
    Trainer(max_steps=1, limit_val_batches=0, callbacks=[probe, callback], **QUIET).fit(Regression(batches(40, None)))
    assert probe.values == 3


def test_the_steps_judged_when_training_ends_are_not_learned_when_a_write_failure_ends_the_fit(tmp_path):
    # every 5 of 12 steps, written in the background; step 10's write fails and raises when training ends, after the
    # steps after it were judged (accepted): neither they nor anything after step 4's published window is learned
    # beyond what the boundaries accepted (steps 0 to 9), and the fit's error is the write's
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}",
                                    spike_gate=SpikeGate(warmup_steps=100))
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], plugins=[AsyncCheckpointIO(TorchCheckpointIO())], max_steps=12,
                      limit_train_batches=20, limit_val_batches=0, **QUIET)
    with FailingWrites("step=10"), pytest.raises(OSError, match="No space left"):
        trainer.fit(FaultyModel())
    assert {k: len(v) for k, v in callback.state_dict()["spike_history"].items()} == {"loss": 10, "grad_norm": 10}
