"""Real training loops beyond plain fp32 automatic optimization: loss scaling, accumulation, manual optimization,
weight averaging, clipping, frozen and unfrozen parameters. Every test trains for real."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from helpers import QUIET, CountOps, FaultyModel, count_agreements
from lightning_ckguard import FiniteGradCheckpoint, GradientGuard, NonFiniteGradientError
from lightning_ckguard.record.skips import scaler_skip_flag

STEPS = dict(limit_val_batches=0)


def _fp16(init_scale: float = 2.0**24) -> list[Any]:
    # a real fp16 loss scaler on CPU; the large initial scale makes the first steps overflow, as on GPU
    return [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))]


def _files(path: Any) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _fit_raises(callback: ModelCheckpoint, model: LightningModule, **trainer_kwargs: Any) -> NonFiniteGradientError:
    trainer = Trainer(callbacks=[callback], **QUIET, **trainer_kwargs)
    with pytest.raises(NonFiniteGradientError) as raised:
        trainer.fit(model)
    return raised.value


# ---------------------------------------------------------------------------------------------- fp16 loss scaling


def test_scaler_skipped_steps_are_reported_but_publish(tmp_path):
    seed_everything(0)
    model = BoringModel()
    initial = model.layer.weight.detach().clone()
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer = Trainer(max_steps=4, plugins=_fp16(), callbacks=[callback], **STEPS, **QUIET)
    trainer.fit(model)
    assert _files(tmp_path) == ["epoch=0-step=4.ckpt"]
    verdict = callback.last_verdict
    assert verdict is not None and verdict.accepted
    assert verdict.skipped_steps == 4 and verdict.num_steps == 0
    # the scaler really skipped them: the published weights are the initial ones
    saved = torch.load(tmp_path / "epoch=0-step=4.ckpt", weights_only=True)["state_dict"]["layer.weight"]
    assert torch.equal(saved, initial)


def test_count_skipped_steps_rejects_scaler_skips(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, count_skipped_steps=True)
    error = _fit_raises(callback, BoringModel(), max_steps=8, plugins=_fp16(), **STEPS)
    assert (error.skipped_steps, error.first_step, error.last_step, error.global_step) == (4, 0, 3, 4)
    assert _files(tmp_path) == []


def test_applied_non_finite_step_under_bf16_mixed_rejects(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    model = FaultyModel(fault_steps=(6,))
    error = _fit_raises(callback, model, max_steps=8, precision="bf16-mixed", **STEPS)
    assert (error.first_step, error.skipped_steps, error.parameters) == (6, 0, ("layer.weight",))
    assert _files(tmp_path) == ["epoch=0-step=4.ckpt"]


def test_scaler_skip_flag_matches_the_steps_a_real_scaler_skips():
    # a plain loop (no Trainer) with a real GradScaler: the flag is read before the step, the outcome after it
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    guard, counting = GradientGuard(model), GradientGuard(model, count_skipped_steps=True)
    flags, skipped = [], []
    for step in range(24):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        flag = scaler_skip_flag(scaler, optimizer)
        guard.record(optimizer, step=step, skipped=flag)
        counting.record(optimizer, step=step, skipped=flag)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        flags.append(flag)
        skipped.append(scaler.get_scale() < scale)
        optimizer.zero_grad()
    assert any(skipped) and not all(skipped)
    assert [bool(f) for f in flags] == skipped
    verdict = guard.agree()
    assert verdict.accepted and verdict.skipped_steps == sum(skipped)
    assert not counting.agree().accepted
    assert scaler_skip_flag(None, optimizer) is None


def _host_reads(callback_cls: type[ModelCheckpoint], steps: int, tmp_path: Any) -> int:
    seed_everything(0)
    callback = callback_cls(dirpath=tmp_path / f"{callback_cls.__name__}-{steps}", every_n_train_steps=10_000)
    trainer = Trainer(max_steps=steps, plugins=_fp16(), callbacks=[callback], **STEPS, **QUIET)
    with CountOps() as ops:
        trainer.fit(BoringModel())
    return ops.host_reads


def test_scaler_skip_detection_adds_no_host_sync_per_step(tmp_path):
    # GradScaler.step itself reads found_inf on the host every step; the guard must add nothing that grows
    extra = [_host_reads(FiniteGradCheckpoint, n, tmp_path) - _host_reads(ModelCheckpoint, n, tmp_path) for n in (4, 8)]
    assert extra[0] == extra[1] == 0


# ---------------------------------------------------------------------------------------------- accumulation


def test_nan_in_an_early_micro_batch_survives_accumulation_and_rejects(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    # optimizer step 1 accumulates batches 4..7; the NaN is in its second micro-batch
    model = FaultyModel(fault_batches=(5,))
    error = _fit_raises(callback, model, max_steps=3, accumulate_grad_batches=4, **STEPS)
    assert (error.first_step, error.global_step) == (1, 2)
    assert _files(tmp_path) == ["epoch=0-step=1.ckpt"]


def _extra_ops(accumulate: int, tmp_path: Any) -> int:
    counts = []
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        seed_everything(0)
        callback = cls(dirpath=tmp_path / f"{cls.__name__}-{accumulate}", every_n_train_steps=10_000)
        trainer = Trainer(max_steps=3, accumulate_grad_batches=accumulate, callbacks=[callback], **STEPS, **QUIET)
        with CountOps() as ops:
            trainer.fit(BoringModel())
        counts.append(len(ops.names))
    return counts[1] - counts[0]


def test_one_check_per_optimizer_step_not_per_micro_batch(tmp_path):
    # the guard's own work depends on optimizer steps only: 3 steps of 1 micro-batch cost what 3 steps of 4 do
    assert _extra_ops(1, tmp_path) == _extra_ops(4, tmp_path) > 0


# ---------------------------------------------------------------------------------------------- manual optimization


class ManualModel(LightningModule):
    """Manual optimization with one optimizer, or two (GAN-style: ``generator`` then ``critic`` every batch).

    ``faults`` holds ``(batch_idx, module name)`` pairs whose gradient gets a NaN right before that optimizer's step.
    """

    def __init__(self, two_optimizers: bool, faults: set[tuple[int, str]]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.two_optimizers = two_optimizers
        self.faults = faults
        self.generator = nn.Linear(32, 2)
        self.critic = nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        if not isinstance(optimizers, list):
            optimizers = [optimizers]
        modules = [("generator", self.generator), ("critic", self.critic)][: len(optimizers)]
        for (name, module), optimizer in zip(modules, optimizers, strict=True):
            optimizer.zero_grad()
            self.manual_backward(module(batch).pow(2).mean())
            if (batch_idx, name) in self.faults:
                module.weight.grad[0, 0] = float("nan")
            optimizer.step()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # after the guard recorded: keep the weights finite, so only the planted step is non-finite
        for p in self.parameters():
            if p.grad is not None:
                torch.nan_to_num_(p.grad, nan=0.0)

    def configure_optimizers(self) -> Any:
        if not self.two_optimizers:
            return torch.optim.SGD(self.parameters(), lr=0.01)
        return [torch.optim.SGD(m.parameters(), lr=0.01) for m in (self.generator, self.critic)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=2)


@pytest.mark.parametrize(
    ("two_optimizers", "fault", "first_step", "parameter"),
    [
        (False, (2, "generator"), 2, "generator.weight"),
        # two optimizers: every batch is two global steps, generator at 2b, critic at 2b + 1
        (True, (2, "generator"), 4, "generator.weight"),
        (True, (2, "critic"), 5, "critic.weight"),
    ],
)
def test_manual_optimization_attributes_steps_across_optimizers(two_optimizers, fault, first_step, parameter,
                                                                 tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    model = ManualModel(two_optimizers, {fault})
    error = _fit_raises(callback, model, max_steps=12, **STEPS)
    assert (error.first_step, error.last_step, error.parameters) == (first_step, first_step, (parameter,))
    published = ["epoch=0-step=4.ckpt"] if first_step >= 4 else []
    assert _files(tmp_path) == published


# ---------------------------------------------------------------------------------------------- weight averaging


def _all_finite(path: str) -> bool:
    checkpoint = torch.load(path, weights_only=False)
    tensors = [*checkpoint["state_dict"].values(), *checkpoint.get("current_model_state", {}).values()]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


EMA_EPOCHS = dict(max_epochs=4, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
# Lightning 2.6 added EMAWeightAveraging; with 2.5 there is nothing to test
EMAWeightAveraging = getattr(lightning_callbacks, "EMAWeightAveraging", None)
needs_ema = pytest.mark.skipif(EMAWeightAveraging is None, reason="this Lightning has no EMAWeightAveraging (2.6+)")


@needs_ema
def test_ema_boundary_saving_live_and_averaged_weights_checks_once(tmp_path, monkeypatch):
    seed_everything(0)
    agreements = count_agreements(monkeypatch)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    trainer = Trainer(callbacks=[EMAWeightAveraging(decay=0.5), callback], **EMA_EPOCHS, **QUIET)
    trainer.fit(FaultyModel(val_losses=[4.0, 3.0, 2.0, 1.0]))
    assert len(agreements) == 4  # one per validation boundary, each writing top-1 + last
    assert _files(tmp_path) == ["epoch=3-step=8.ckpt", "last.ckpt"]
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert set(checkpoint) >= {"state_dict", "current_model_state", "averaging_state"}


@needs_ema
@pytest.mark.parametrize("guarded", [True, False])
def test_no_file_holds_poisoned_live_or_ema_weights_after_a_rejection(guarded, tmp_path):
    seed_everything(0)
    kwargs = dict(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    callback = FiniteGradCheckpoint(**kwargs) if guarded else ModelCheckpoint(**kwargs)
    # unsanitized: the NaN reaches the live weights at step 3, and the average right after
    model = FaultyModel(fault_steps=(3,), sanitize=False, val_losses=[4.0, 3.0, 2.0, 1.0])
    trainer = Trainer(callbacks=[EMAWeightAveraging(decay=0.5), callback], **EMA_EPOCHS, **QUIET)
    if guarded:
        with pytest.raises(NonFiniteGradientError):
            trainer.fit(model)
        assert _files(tmp_path) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    else:
        trainer.fit(model)  # the control: plain ModelCheckpoint publishes the poisoned weights
    finite = [_all_finite(os.path.join(tmp_path, name)) for name in _files(tmp_path)]
    assert all(finite) is guarded


# ---------------------------------------------------------------------------------------------- clipping


@pytest.mark.parametrize(("algorithm", "value"), [("norm", float("nan")), ("value", float("inf"))])
def test_clipping_does_not_hide_the_offending_parameter(algorithm, value, tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    model = FaultyModel(fault_steps=(1,), fault_parameter="layer.bias", value=value, sanitize=False)
    error = _fit_raises(callback, model, max_steps=2, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm,
                        **STEPS)
    assert error.parameters == ("layer.bias",)  # recorded before clipping, so attribution is exact
    weight_finite = bool(torch.isfinite(model.layer.weight).all())
    # clipping by norm spread the NaN into every gradient; clipping by value turned +inf into a finite 0.5
    assert weight_finite is (algorithm == "value")
    assert _files(tmp_path) == []


# ---------------------------------------------------------------------------------------------- changing parameters


class BackboneModel(FaultyModel):
    """``backbone`` then ``layer``: the shape Lightning's ``BackboneFinetuning`` expects."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backbone = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_parameters_unfrozen_during_the_fit_are_recorded(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    # the backbone is frozen in epoch 0 (no gradient at all), unfrozen and added to the optimizer in epoch 1
    model = BackboneModel(fault_steps=(3,), fault_parameter="backbone.weight")
    trainer = Trainer(callbacks=[unfreeze, callback], max_epochs=3, limit_train_batches=2, **STEPS, **QUIET)
    with pytest.raises(NonFiniteGradientError) as raised:
        trainer.fit(model)
    assert (raised.value.first_step, raised.value.parameters) == (3, ("backbone.weight",))
    assert _files(tmp_path) == ["epoch=0-step=2.ckpt"]


def test_parameters_unfrozen_between_fits_are_recorded(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    model = BackboneModel(fault_steps=(1,), fault_parameter="layer.bias")
    model.backbone.requires_grad_(False)
    with pytest.raises(NonFiniteGradientError) as raised:
        Trainer(callbacks=[callback], max_steps=2, **STEPS, **QUIET).fit(model)
    assert raised.value.parameters == ("layer.bias",)  # the frozen backbone has no gradient and is not reported
    model.backbone.requires_grad_(True)
    model.fault_steps, model.fault_parameter = {3}, "backbone.weight"
    with pytest.raises(NonFiniteGradientError) as raised:
        Trainer(callbacks=[callback], max_steps=4, **STEPS, **QUIET).fit(model)
    assert (raised.value.first_step, raised.value.parameters) == (3, ("backbone.weight",))
