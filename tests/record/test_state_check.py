"""The state check in one process: what it reads, what it names, what it never flags, and what it rejects."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

from helpers import QUIET, ledger_state, tree_digest
from lightning_ckguard import FiniteGradCheckpoint, GradientGuard, NonFiniteGradientError, StateCheckError
from lightning_ckguard.record.state_check import NAME_WORDS, StateCheck, decode_state_summary
from lightning_ckguard.record.state_sources import CheckpointState, named_state

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class BatchNormModel(BoringModel):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        del self.layer
        self.stem = nn.Linear(32, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.stem(x))))

    def configure_optimizers(self):
        if self.optimizer == "adam-eps0":
            return torch.optim.Adam(self.parameters(), lr=0.1, eps=0.0)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _stepped(model: nn.Module, optimizer_class=torch.optim.Adam) -> torch.optim.Optimizer:
    optimizer = optimizer_class(model.parameters(), lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    return optimizer


def test_sources_name_parameters_buffers_and_optimizer_state_but_no_integers_or_step_counters():
    model = BatchNormModel()
    optimizer = _stepped(model)
    names = [name for name, _ in CheckpointState(model, (optimizer,)).named_tensors()]
    assert "parameter stem.weight" in names and "buffer bn.running_var" in names
    assert "optimizer: exp_avg of stem.weight" in names and "optimizer: exp_avg_sq of out.bias" in names
    assert "buffer bn.num_batches_tracked" not in names  # an integer buffer cannot be non-finite
    assert not any(name.startswith("optimizer: step of") for name in names)  # step counters are counts, not values
    fabric_names = [name for name, _ in named_state({"model": model, "optimizer": optimizer, "scale": torch.ones(1)})]
    assert "model: parameter stem.weight" in fabric_names and "optimizer: exp_avg of stem.weight" in fabric_names
    assert "scale" in fabric_names


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_large_finite_values_pass_and_every_non_finite_value_is_caught(dtype):
    check = StateCheck()
    big = torch.finfo(dtype).max
    for values in ([1e30 if dtype in (torch.float32, torch.float64, torch.bfloat16) else 6e4, -1.0], [big, -big]):
        for numel in (3, 5000, 70_000):
            tensor = torch.zeros(numel, dtype=dtype)
            tensor[: len(values)] = torch.tensor(values, dtype=dtype)
            assert check.non_finite([("t", tensor)]) == [], (values, numel)
            for bad in (float("nan"), float("inf"), float("-inf")):
                poisoned = tensor.clone()
                poisoned[-1] = bad
                assert check.non_finite([("t", poisoned)]) == ["t"], (bad, numel)


def test_large_finite_weights_buffers_and_optimizer_state_do_not_reject():
    model = BatchNormModel()
    optimizer = _stepped(model)
    big = torch.finfo(torch.float32).max
    with torch.no_grad():
        model.stem.weight.fill_(1e30)
        model.out.weight.fill_(-big)
        model.bn.running_var.fill_(big)
        optimizer.state[model.stem.weight]["exp_avg_sq"].fill_(big)
        optimizer.state[model.stem.weight]["step"].fill_(1e30)  # a (huge) step counter
        model.bn.num_batches_tracked.fill_(2**62)
    verdict = GradientGuard(model).agree(state={"model": model, "optimizer": optimizer})
    assert verdict.accepted and verdict.non_finite_state == ()


def test_complex_parameters_and_their_optimizer_state_are_checked():
    module = nn.Linear(2, 2)
    module.phase = nn.Parameter(torch.randn(4, dtype=torch.cfloat))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    (module(torch.randn(3, 2)).sum() + module.phase.abs().sum()).backward()
    optimizer.step()
    with torch.no_grad():
        module.phase[1] = complex(0.0, float("nan"))
    state = CheckpointState(module, (optimizer,))
    names = [name for name, _ in named_state(state)]
    assert {"parameter phase", "optimizer: exp_avg of phase"} <= set(names)
    assert StateCheck().non_finite(named_state(state)) == ["parameter phase"]


def test_optimizer_state_held_in_lists_is_checked_and_named_by_its_place():
    """``torch.optim.LBFGS`` keeps its history as lists of tensors (``old_dirs``, ``old_stps``, ``ro``, ``al``): a NaN
    there is about to be written like any other state, and is named by its place in the list."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, history_size=4, max_iter=5)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((model(inputs) - targets) ** 2).mean()
        loss.backward()
        return loss

    optimizer.step(closure)
    state = CheckpointState(model, (optimizer,))
    names = [name for name, _ in named_state(state)]
    assert {"optimizer: d of 0.weight", "optimizer: old_dirs[1] of 0.weight", "optimizer: ro[1] of 0.weight"} <= set(
        names)
    assert not any("n_iter" in name or "func_evals" in name for name in names)  # counts, not tensors
    assert StateCheck().non_finite(named_state(state)) == []
    with torch.no_grad():
        optimizer.state[model[0].weight]["old_dirs"][1][2] = float("nan")
    assert StateCheck().non_finite(named_state(state)) == ["optimizer: old_dirs[1] of 0.weight"]
    verdict = GradientGuard(model).agree(state={"model": model, "optimizer": optimizer})
    assert not verdict.accepted and verdict.non_finite_state == ((0, "optimizer: old_dirs[1] of 0.weight"),)
    # a number it keeps on the host is written as it is: a NaN there is named too
    with torch.no_grad():
        optimizer.state[model[0].weight]["old_dirs"][1][2] = 0.0
    optimizer.state[model[0].weight]["prev_loss"] = float("nan")
    assert StateCheck().non_finite(named_state(state)) == ["optimizer: prev_loss of 0.weight"]
    optimizer.state[model[0].weight]["prev_loss"] = 1e300  # finite, however large
    assert StateCheck().non_finite(named_state(state)) == []


def test_optimizer_state_in_tuples_and_mappings_is_checked_but_their_step_counters_are_not():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.state[model.bias] = {"pair": (torch.zeros(2), torch.tensor([1.0, float("inf")])),
                                   "inner": {"step": torch.tensor(float("inf")), "sum": torch.tensor(float("nan")),
                                             "count": torch.tensor(3)}}
    found = StateCheck().non_finite(named_state(CheckpointState(model, (optimizer,))))
    assert found == ["optimizer: pair[1] of bias", "optimizer: inner.sum of bias"]


def test_optimizer_state_of_a_parameter_the_module_does_not_name_is_named_by_its_group_and_place():
    model = nn.Linear(2, 1)
    temperature = nn.Parameter(torch.ones(3))  # held by the optimizer, not by the module
    optimizer = torch.optim.Adam([{"params": model.parameters()}, {"params": [temperature]}], lr=1e-3)
    (model(torch.randn(4, 2)).sum() + temperature.sum()).backward()
    optimizer.step()
    with torch.no_grad():
        optimizer.state[temperature]["exp_avg"][1] = float("nan")
    found = StateCheck().non_finite(named_state(CheckpointState(model, (optimizer,))))
    assert found == ["optimizer: exp_avg of parameter 0 of group 1"]


def test_deepspeeds_master_partitions_and_the_moments_of_the_optimizer_stepping_them_are_checked():
    """DeepSpeed's ``BF16_Optimizer`` as the state check finds it: an fp32 master partition per group, stepped by a
    torch optimizer whose moments it does not forward as a ``state`` of its own."""
    masters = [torch.zeros(6, requires_grad=True), torch.zeros(3, requires_grad=True)]
    inner = torch.optim.Adam(masters, lr=1e-3)
    for master in masters:
        master.grad = torch.ones_like(master)
    inner.step()
    state = CheckpointState(nn.Linear(2, 1), (SimpleNamespace(fp32_groups_flat_partition=masters, optimizer=inner),))
    names = [name for name, _ in named_state(state)]
    assert {"optimizer: fp32 master partition of group 1",
            "optimizer: exp_avg_sq of the fp32 master partition of group 1"} <= set(names)
    assert StateCheck().non_finite(named_state(state)) == []
    with torch.no_grad():
        inner.state[masters[1]]["exp_avg_sq"][2] = float("nan")
    assert StateCheck().non_finite(named_state(state)) == [
        "optimizer: exp_avg_sq of the fp32 master partition of group 1"]


def test_the_names_travel_in_the_summary_and_a_long_list_is_counted():
    names = [f"optimizer: exp_avg of block.{i}.attention.query.weight" for i in range(40)]
    count, decoded = decode_state_summary(StateCheck().summary(None, torch.device("cpu")).tolist())
    assert (count, decoded) == (0, ())
    tensors = [(name, torch.tensor([float("nan")])) for name in names]
    count, decoded = decode_state_summary(StateCheck().summary(tensors, torch.device("cpu")).tolist())
    assert count == 40 and decoded == tuple(names[: len(decoded)]) and 0 < len(decoded) < 40
    assert sum(len(n.encode()) + 1 for n in decoded) <= NAME_WORDS * 8 + 1
    assert decode_state_summary(StateCheck().summary([("bn.ü", torch.tensor([float("inf")]))], torch.device("cpu"))
                                .tolist()) == (1, ("bn.ü",))


def test_names_that_fill_the_summary_exactly_all_travel():
    first = "a" * 200
    second = "b" * (NAME_WORDS * 8 - len(first) - 1)  # with the separator: every byte of the words
    tensors = [(first, torch.tensor([float("nan")])), (second, torch.tensor([float("nan")]))]
    assert decode_state_summary(StateCheck().summary(tensors, torch.device("cpu")).tolist()) == (2, (first, second))
    tensors.append(("c", torch.tensor([float("nan")])))  # one more does not fit: counted, not named
    assert decode_state_summary(StateCheck().summary(tensors, torch.device("cpu")).tolist()) == (3, (first, second))


def test_the_core_rejects_non_finite_state_whatever_count_skipped_steps_says():
    model = BatchNormModel()
    optimizer = _stepped(model)
    guard = GradientGuard(model, count_skipped_steps=False)
    guard.record(optimizer)  # finite gradients
    with torch.no_grad():
        optimizer.state[model.out.weight]["exp_avg"][0, 0] = float("nan")
    verdict = guard.agree(state={"model": model, "optimizer": optimizer}, global_step=7)
    assert not verdict.accepted and verdict.ranks == (0,)
    assert verdict.non_finite_state == ((0, "optimizer: exp_avg of out.weight"),)
    error = verdict.to_error()
    assert error.num_steps == 0 and error.non_finite_state == ((0, "optimizer: exp_avg of out.weight"),)
    assert "rank 0: optimizer: exp_avg of out.weight" in str(error) and "global step 7" in str(error)
    assert pickle.loads(pickle.dumps(error)) == error
    assert guard.agree(global_step=7).accepted, "without state, only the gradients decide"


class PoisonBuffer(Callback):
    """At the end of the batch that reaches ``step``, write a NaN into ``bn.running_var`` (after a snapshot)."""

    def __init__(self, checkpoint: FiniteGradCheckpoint, step: int) -> None:
        self.checkpoint, self.step, self.snapshot = checkpoint, step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.snapshot is None:
            self.snapshot = (tree_digest(str(self.checkpoint.dirpath)), ledger_state(self.checkpoint))
            with torch.no_grad():
                pl_module.bn.running_var[1] = float("nan")


def _periodic(tmp_path, **kwargs) -> FiniteGradCheckpoint:
    return FiniteGradCheckpoint(dirpath=tmp_path, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2,
                                save_last=True, filename="{step}", **kwargs)


def _batch_norm_data():
    return torch.utils.data.DataLoader(torch.randn(64, 32), batch_size=4)


@pytest.mark.parametrize("count_skipped_steps", [False, True])
def test_a_nan_in_a_buffer_rejects_the_boundary_and_changes_nothing(tmp_path, count_skipped_steps):
    seed_everything(0)
    checkpoint = _periodic(tmp_path, count_skipped_steps=count_skipped_steps)
    poison = PoisonBuffer(checkpoint, step=4)
    trainer = Trainer(callbacks=[poison, checkpoint], max_steps=8, limit_val_batches=0, **QUIET)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(BatchNormModel(), train_dataloaders=_batch_norm_data())
    assert info.value.non_finite_state == ((0, "buffer bn.running_var"),) and info.value.num_steps == 0
    assert "buffer bn.running_var" in str(info.value)
    assert poison.snapshot == (tree_digest(str(tmp_path)), ledger_state(checkpoint))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]


class DeferredBuffer(PoisonBuffer):
    """At the end of the batch that reaches ``step``, a buffer left on the meta device (a deferred initialization
    never materialized): the check of the state to be written raises."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and self.snapshot is None:
            self.snapshot = (tree_digest(str(self.checkpoint.dirpath)), ledger_state(self.checkpoint))
            pl_module.register_buffer("deferred", torch.empty(3, device="meta"))

    def on_exception(self, trainer, pl_module, exception):
        del pl_module._buffers["deferred"]  # else Lightning's teardown fails to move it off the meta device


def test_a_state_check_that_raises_is_raised_from_the_agreement_and_changes_nothing(tmp_path):
    seed_everything(0)
    checkpoint = _periodic(tmp_path)
    deferred = DeferredBuffer(checkpoint, step=4)
    trainer = Trainer(callbacks=[deferred, checkpoint], max_steps=8, limit_val_batches=0, **QUIET)
    with pytest.raises(StateCheckError) as info:
        trainer.fit(BatchNormModel(), train_dataloaders=_batch_norm_data())
    assert (info.value.ranks, info.value.global_step) == ((0,), 4)
    assert info.value.cause == "NotImplementedError: Cannot copy out of meta tensor; no data!"
    assert isinstance(info.value.__cause__, NotImplementedError)
    assert deferred.snapshot == (tree_digest(str(tmp_path)), ledger_state(checkpoint))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]


def test_adam_with_eps_zero_makes_a_nan_from_finite_gradients_and_it_is_not_published(tmp_path):
    # a parameter whose gradient is exactly zero: Adam's update is 0 / (sqrt(0) + 0)
    class Frozen(BatchNormModel):
        def training_step(self, batch, batch_idx):
            return self(batch).sum() * 0.0 + self.stem.bias.sum() * 0.0

    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(callbacks=[checkpoint], max_steps=3, limit_val_batches=0, **QUIET)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(Frozen("adam-eps0"), train_dataloaders=_batch_norm_data())
    assert info.value.num_steps == 0, "the gradients were finite"
    assert (0, "parameter stem.weight") in info.value.non_finite_state
    assert os.listdir(tmp_path) == []


def test_a_manual_save_goes_through_the_same_check(tmp_path):
    class SaveByHand(Callback):
        """At step 1 a finite manual save; at step 3 an infinite momentum, then a manual save."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                trainer.save_checkpoint(tmp_path / "manual-finite.ckpt")
            if trainer.global_step == 3:
                with torch.no_grad():
                    trainer.optimizers[0].state[pl_module.stem.weight]["momentum_buffer"][0, 0] = float("inf")
                trainer.save_checkpoint(tmp_path / "manual.ckpt")

    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path / "run", every_n_train_steps=100)
    trainer = Trainer(callbacks=[SaveByHand(), checkpoint], max_steps=4, limit_val_batches=0, **QUIET)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(BatchNormModel(), train_dataloaders=_batch_norm_data())
    assert info.value.non_finite_state == ((0, "optimizer: momentum_buffer of stem.weight"),)
    assert info.value.global_step == 3
    assert not (tmp_path / "manual.ckpt").exists() and (tmp_path / "manual-finite.ckpt").exists()


def test_a_nan_in_the_averaged_weights_only_is_not_published(tmp_path):
    from lightning.pytorch import callbacks

    if not hasattr(callbacks, "EMAWeightAveraging"):
        pytest.skip("this Lightning has no EMAWeightAveraging (2.6+)")

    class PoisonAverage(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                ema = next(c for c in trainer.callbacks if isinstance(c, callbacks.EMAWeightAveraging))
                with torch.no_grad():
                    next(ema._average_model.parameters()).view(-1)[0] = float("nan")

    seed_everything(0)
    checkpoint = _periodic(tmp_path)
    trainer = Trainer(callbacks=[callbacks.EMAWeightAveraging(decay=0.5), PoisonAverage(), checkpoint], max_steps=8,
                      limit_val_batches=0, **QUIET)
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(BatchNormModel(), train_dataloaders=_batch_norm_data())
    assert info.value.non_finite_state == ((0, "averaged weights (EMAWeightAveraging): parameter module.stem.weight"),)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt"]


class MaskedModel(BatchNormModel):
    """Attention-style masks filled with ``-inf``: one persistent (written into the checkpoint), one not."""

    def __init__(self) -> None:
        super().__init__()
        mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)
        self.register_buffer("scratch_mask", mask.clone(), persistent=False)


def test_buffers_non_finite_by_design_are_constants_not_divergence(tmp_path, caplog):
    seed_everything(0)
    checkpoint = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(callbacks=[checkpoint], max_steps=4, limit_val_batches=0, **QUIET)
    model = MaskedModel()
    with caplog.at_level("INFO"):
        trainer.fit(model, train_dataloaders=_batch_norm_data())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert "treated as constants and not checked: mask." in caplog.text  # the persistent one; the other is not written
    # a buffer that turns non-finite during the fit is still checked
    guard = GradientGuard(model)
    with torch.no_grad():
        model.bn.running_mean[0] = float("nan")
    verdict = guard.agree(state={"model": model})
    assert verdict.non_finite_state == ((0, "model: buffer bn.running_mean"),)


def test_a_rewind_restores_state_the_check_rejected(tmp_path):
    seed_everything(0)
    checkpoint = _periodic(tmp_path, on_non_finite="rewind")
    poison = PoisonBuffer(checkpoint, step=4)
    trainer = Trainer(callbacks=[poison, checkpoint], max_steps=8, limit_val_batches=0, **QUIET)
    model = BatchNormModel()
    trainer.fit(model, train_dataloaders=_batch_norm_data())
    (rewind,) = checkpoint.rewinds
    assert rewind.non_finite_state == ((0, "buffer bn.running_var"),) and rewind.num_steps == 0
    assert os.path.basename(rewind.checkpoint) == "step=2.ckpt"
    assert bool(model.bn.running_var.isfinite().all()), "the restored buffer is the published one"
    assert trainer.global_step == 8 and "step=8.ckpt" in os.listdir(tmp_path)


def test_a_state_check_that_raises_names_the_global_step_the_agreement_was_given():
    # two steps recorded, the boundary at global step 10 (a Fabric loop's own count): the error names step 10
    model = nn.Linear(2, 1)
    guard = GradientGuard(model)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        guard.record()
    with pytest.raises(StateCheckError) as info:
        guard.agree(None, global_step=10, state={"model": model, "deferred": torch.empty(3, device="meta")})
    assert (info.value.ranks, info.value.global_step) == ((0,), 10)
    assert str(info.value).startswith("Checking the state about to be written at global step 10 failed on rank 0: ")
