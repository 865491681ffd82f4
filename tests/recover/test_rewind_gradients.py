"""A rewind at a boundary between two micro-batches of a step: what the first micro-batch left (its gradient, its loss
given to a spike gate) was computed from the discarded weights, and must not join the restored weights' step.

Lightning (automatic and manual optimization) through ``restore_trainer_state``; Fabric through
``restore_fabric_state``; and the guard's ``reset(discard_step_under_way=True)`` on its own. A Fabric rewind past a
window the agreement accepted but whose write failed teaches a spike gate nothing of it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from rewind_helpers import checkpoint_loads_finite

from helpers import QUIET, FaultyModel
from lightning_ckguard import (
    CheckpointPublisher,
    FiniteGradCheckpoint,
    GradientGuard,
    SpikeGate,
    restore_fabric_state,
)
from lightning_ckguard.record import step_values as rows


class ManualAccumulation(FaultyModel):
    """Manual optimization accumulating two micro-batches per step, as ``accumulate_grad_batches=2`` does."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.batch_idx = batch_idx
        optimizer = self.optimizers()
        self.manual_backward(self.step(batch) / 2)  # on_after_backward writes the fault
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()

    def on_validation_model_zero_grad(self) -> None:
        """Keep the first micro-batch's gradient through validation, as Lightning does for ``accumulate_grad_batches``
        (its default clears it before every validation of a manual-optimization module)."""


class GradientsAfterRewind(Callback):
    """At the batch start right after each rewind: whether any gradient is left on the module."""

    def __init__(self) -> None:
        self.left: list[bool] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(trainer.checkpoint_callback.rewinds) > len(self.left):
            self.left.append(any(p.grad is not None for p in pl_module.parameters()))


@pytest.mark.parametrize("optimization", ["automatic", "manual"])
def test_one_nan_micro_batch_before_a_boundary_between_micro_batches_costs_one_rewind(tmp_path, optimization):
    seed_everything(0)
    # validation every 3 batches with 2 micro-batches a step: boundaries after batches 2, 5, 8 and 11, so those
    # after 2 and 8 fall between the micro-batches of a step. Batch 7's NaN gradient makes step 3's update NaN;
    # batch 8 (the first micro-batch of step 4) backpropagates through NaN weights, and the boundary after it rewinds
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=-1, filename="{step}",
                                    on_non_finite="rewind", max_rewinds=1)
    probe = GradientsAfterRewind()
    model_class = FaultyModel if optimization == "automatic" else ManualAccumulation
    model = model_class(fault_batches=(7,), sanitize=False)
    accumulation = {"accumulate_grad_batches": 2} if optimization == "automatic" else {}
    trainer = Trainer(max_epochs=1, limit_train_batches=12, val_check_interval=3, limit_val_batches=1,
                      num_sanity_val_steps=0, callbacks=[probe, callback], **accumulation, **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(model)  # without clearing the gradients: a second rejection, refused (`max_rewinds=1`)
    (rewind,) = callback.rewinds
    assert (rewind.boundary, rewind.global_step, os.path.basename(rewind.checkpoint)) == ("validation end", 4,
                                                                                          "step=3.ckpt")
    assert probe.left == [False]  # the first micro-batch's gradient went with the weights it came from
    assert trainer.global_step == 6 and callback.rejection is None
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    published = sorted(name for name in os.listdir(tmp_path) if name.endswith(".ckpt"))
    assert published == ["step=1.ckpt", "step=3.ckpt", "step=6.ckpt"]
    assert all(checkpoint_loads_finite(str(tmp_path / name)) for name in published)


class LossesGiven(Callback):
    """Each loss Lightning backpropagates, by batch index (what the callback gives a spike gate, read on the host)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.losses[pl_module.batch_idx] = float(loss.detach())


def test_a_rewind_between_micro_batches_leaves_the_restored_step_only_its_own_loss(tmp_path):
    # the fit above with a loss spike gate: batch 8, the first micro-batch of step 4, gives a NaN loss (NaN weights);
    # the rewind after it drops that loss with the weights, so step 4 is batch 9 alone, judged and learned as such
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=-1, filename="{step}",
                                    on_non_finite="rewind", max_rewinds=1,
                                    spike_gate=SpikeGate(measures=("loss",), warmup_steps=0, history=8))
    given = LossesGiven()
    model = FaultyModel(fault_batches=(7,), sanitize=False)
    trainer = Trainer(max_epochs=1, limit_train_batches=12, val_check_interval=3, limit_val_batches=1,
                      num_sanity_val_steps=0, callbacks=[given, callback], accumulate_grad_batches=2, **QUIET)
    with pytest.warns(UserWarning, match="Rewound in place"):
        trainer.fit(model)
    (rewind,) = callback.rewinds
    assert (rewind.global_step, os.path.basename(rewind.checkpoint)) == (4, "step=3.ckpt")
    assert trainer.global_step == 6 and callback.rejection is None
    assert torch.isnan(torch.tensor(given.losses[8]))  # the discarded micro-batch's loss
    # the published windows' steps: 0-2 (step=1.ckpt, step=3.ckpt), then 4 and 5 (step=6.ckpt); step 3 was rejected
    published_steps = [(0, 1), (2, 3), (4, 5), (9,), (10, 11)]
    expected = [sum(given.losses[batch] for batch in batches) for batches in published_steps]
    history = callback.state_dict()["spike_history"]["loss"]
    assert len(history) == len(expected), history
    assert all(torch.isfinite(torch.tensor(history)))
    assert history == pytest.approx(expected, rel=1e-6)
    assert history[3] == pytest.approx(given.losses[9], rel=1e-6)  # step 4: batch 9's own loss, not batch 8's too


def test_restore_fabric_state_leaves_no_gradient_and_no_loss_of_the_step_under_way(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    guard = GradientGuard(model, spike_gate=SpikeGate(measures=("loss",)))

    def micro_batch(scale: float, fault: bool = False) -> float:
        loss = model(torch.full((3, 4), scale)).sum()
        guard.record_loss(loss.detach())
        fabric.backward(loss / 2)
        if fault:
            model.weight.grad[0, 0] = float("nan")
        return float(loss.detach())

    def finish_step() -> None:
        guard.record(optimizer)
        optimizer.step()
        optimizer.zero_grad()

    micro_batch(1.0), micro_batch(2.0), finish_step()
    path = str(tmp_path / "good.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    assert guard.agree(None).accepted
    guard.reset()
    micro_batch(1.0), micro_batch(2.0, fault=True), finish_step()  # the weights are NaN now
    micro_batch(1.0)  # the first micro-batch of the next step, then a boundary between the two
    assert not guard.agree(None).accepted
    restore_fabric_state(fabric, path, {"model": model, "optimizer": optimizer}, guard)
    assert all(p.grad is None for p in model.parameters())
    own_loss = micro_batch(2.0)
    finish_step()
    values = guard.window.step_values
    assert values is not None and values.summary().view(rows.ROWS, -1)[rows.LOSS, 0].item() == own_loss
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert guard.agree(None).accepted


@pytest.mark.parametrize("discard", [False, True])
def test_a_guard_reset_keeps_or_drops_the_losses_of_the_step_under_way(discard):
    model = torch.nn.Linear(3, 1)
    guard = GradientGuard(model, spike_gate=SpikeGate())
    model(torch.ones(1, 3)).sum().backward()
    guard.record_loss(torch.tensor(100.0))  # the first micro-batch of step 0, then a boundary between the two
    guard.reset(discard_step_under_way=discard)
    guard.record_loss(torch.tensor(2.0))
    guard.record(step=0)
    values = guard.window.step_values
    assert values is not None and values.labels == [[0, 0]]
    summary = values.summary().view(rows.ROWS, -1)
    assert (summary[rows.LOSS, 0].item(), summary[rows.LOSS_SEEN, 0].item()) == ((2.0, 1.0) if discard else
                                                                                   (102.0, 1.0))
    assert summary[rows.REPLICATED, 0].item() == 4.0  # the step's own gradients: ones on 3 weights and the bias
    guard.reset(discard_step_under_way=True)  # with nothing under way: an empty step, as after any step
    guard.record(step=1)
    assert guard.window.step_values.summary().view(rows.ROWS, -1)[rows.LOSS_SEEN, 0].item() == 0.0


@pytest.mark.parametrize("learn", [True, False])
def test_an_accepted_window_another_guards_rewind_threw_away_teaches_the_gate_nothing(learn):
    model = torch.nn.Linear(3, 1)
    guard = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=0, history=8))
    for step in range(3):
        model.zero_grad()
        loss = model(torch.ones(1, 3)).sum()
        guard.record_loss(loss)
        loss.backward()
        guard.record(step=step)
    assert guard.agree(None).accepted  # accepted, not yet published: then another guard rewinds the run under it
    guard.reset(discard_step_under_way=True, learn=learn)
    assert len(guard.state_dict()["spike_history"]["loss"]) == (3 if learn else 0)


@pytest.mark.parametrize("guard_in_state", [False, True], ids=["guard-kept", "guard-restored"])
def test_a_rewind_past_an_accepted_window_whose_write_failed_teaches_the_gate_nothing(tmp_path, guard_in_state):
    """``restore_fabric_state`` after a save the agreement accepted but whose write failed: the window it throws away
    was never published, so the gate's history is the one the checkpoint restored holds, not that window learned on
    top of it (with the guard restored from the file too)."""
    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    guard = GradientGuard(model, spike_gate=SpikeGate(measures=("loss",), warmup_steps=0, history=8))
    publisher = CheckpointPublisher(fabric.strategy, tmp_path, guard=guard)

    def steps(loss: float) -> None:
        for _ in range(2):
            optimizer.zero_grad()
            fabric.backward(model(torch.randn(2, 4)).sum() * 0)
            guard.record(optimizer, loss=torch.tensor(loss))
            optimizer.step()

    steps(1.0)
    publisher.save("a.ckpt", {"model": model, "optimizer": optimizer, "guard": guard})
    steps(5.0)
    with pytest.raises(Exception, match="pickle"):  # torch.save cannot pickle a lambda: the write fails
        publisher.save("b.ckpt", {"model": model, "optimizer": optimizer, "guard": guard, "bad": lambda: None})
    assert publisher.last_verdict is not None and publisher.last_verdict.accepted
    assert os.listdir(tmp_path) == ["a.ckpt"]
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, **({"guard": guard} if guard_in_state else {})}
    restore_fabric_state(fabric, str(tmp_path / "a.ckpt"), state, guard)
    held = torch.load(tmp_path / "a.ckpt", weights_only=True)["guard"]["spike_history"]
    assert held == {"loss": [1.0, 1.0]}
    assert guard.state_dict()["spike_history"] == held
