"""What ``GradientGuard.record`` is given: the ``skipped`` flag in the forms a loop has it (a bool, a NumPy bool, a
0-d tensor, a loss scaler's flag read through Fabric's optimizer wrapper), in one process.

A falsy flag that is not ``False`` itself (``0``, ``numpy.False_``) was taken for a skipped step, so a non-finite
gradient in it counted as never applied; a Fabric optimizer's flag was not found at all, so a step the scaler skipped
counted as applied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

from lightning_ckguard import GradientGuard, SpikeGate, scaler_skip_flag


def _verdict_of_a_nan_step(skipped: Any) -> bool:
    """Whether one step with a NaN gradient, recorded with ``skipped``, is accepted."""
    model = torch.nn.Linear(2, 1)
    guard = GradientGuard(model)
    model(torch.randn(3, 2)).sum().backward()
    model.weight.grad[0, 0] = float("nan")
    guard.record(skipped=skipped)
    return guard.agree(None).accepted


@pytest.mark.parametrize("skipped", [None, False, 0, np.False_, np.array(False), torch.tensor(False)],
                         ids=["None", "False", "0", "numpy.False_", "numpy-0d-False", "tensor-False"])
def test_a_step_not_skipped_by_any_falsy_flag_rejects_its_nan(skipped):
    assert not _verdict_of_a_nan_step(skipped)


@pytest.mark.parametrize("skipped", [True, 1, np.True_, np.array(True), torch.tensor(True)],
                         ids=["True", "1", "numpy.True_", "numpy-0d-True", "tensor-True"])
def test_a_step_skipped_by_any_true_flag_does_not_reject(skipped):
    assert _verdict_of_a_nan_step(skipped)  # never applied: by default, it does not reject


@pytest.mark.parametrize("skipped", ["False", 0.0, 2, -1, [False], np.float64(0.0), object()],
                         ids=["str", "float", "2", "-1", "list", "numpy-float", "object"])
def test_a_skipped_flag_that_is_no_bool_is_a_value_error(skipped):
    guard = GradientGuard(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match="skipped"):
        guard.record(skipped=skipped)
    assert guard.steps_recorded == 0


def test_the_scalers_skip_flag_is_found_through_fabrics_optimizer_wrapper():
    """fp16 mixed precision on CPU with a ``GradScaler`` of Fabric's: the scaler unscales the optimizer Fabric wraps,
    while the loop holds the ``_FabricOptimizer``. The step whose gradient overflowed is skipped by the scaler and
    reported as skipped, and the save is accepted."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard = GradientGuard(model)
    flags = []
    for step in range(3):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 4)).sum())
        if step == 1:
            model.module.weight.grad[0, 0] = float("inf")  # an overflow the scaler skips
        fabric.clip_gradients(model, optimizer, max_norm=1e9, error_if_nonfinite=False)  # unscales the inner one
        flag = scaler_skip_flag(fabric.strategy.precision.scaler, optimizer)
        flags.append(None if flag is None else bool(flag))
        guard.record(optimizer, step=step, skipped=flag)
        optimizer.step()
    assert flags == [False, True, False]
    assert scaler.get_scale() == 1.0  # the scaler did skip step 1 (its scale halved)
    verdict = guard.agree(fabric.strategy)
    assert verdict.accepted and verdict.tally.skipped_steps == 1, verdict


def test_a_scaler_that_unscaled_the_wrapper_itself_is_still_read_from_it():
    """The control: the optimizer object the scaler unscaled is looked up first, as before."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 2)).sum()).backward()
    model.weight.grad[0, 0] = float("nan")
    scaler.unscale_(optimizer)
    flag = scaler_skip_flag(scaler, optimizer)
    assert flag is not None and bool(flag)


@pytest.mark.parametrize("device", [5, "banana"])
def test_a_device_this_build_cannot_use_is_a_value_error(device):
    with pytest.raises(ValueError, match="`device` must be"):
        GradientGuard(torch.nn.Linear(2, 1), device=device)


@pytest.mark.parametrize("loss", [torch.ones(2), "x", None, True])
def test_a_loss_that_is_not_one_number_is_a_value_error_with_or_without_a_gate(loss):
    for gate in (None, SpikeGate()):
        guard = GradientGuard(torch.nn.Linear(2, 1), spike_gate=gate)
        with pytest.raises(ValueError, match="`loss` must"):
            guard.record_loss(loss)


def test_a_global_step_that_is_no_int_and_a_state_that_is_no_mapping_are_value_errors():
    guard = GradientGuard(torch.nn.Linear(2, 1), spike_gate=SpikeGate())
    with pytest.raises(ValueError, match="`global_step` must be an int"):
        guard.agree(None, global_step="7")
    assert guard.agree(None, global_step=7).global_step == 7
    with pytest.raises(ValueError, match="`state` must be a mapping"):
        guard.load_state_dict([1, 2])


def test_a_replicated_dtensor_loss_is_read_as_its_local_copy_and_a_sharded_one_is_a_value_error():
    """Tensor parallelism's ``loss_parallel`` gives a DTensor loss: replicated, its local copy is the loss (one rank's
    mesh here, on a process group of its own made for the test and taken down after it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor


    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        module = torch.nn.Linear(2, 1)
        guard = GradientGuard(module, spike_gate=SpikeGate())
        module(torch.ones(1, 2)).sum().backward()
        guard.record_loss(distribute_tensor(torch.tensor(2.5), mesh, [Replicate()]))
        guard.record(None, loss=torch.tensor(0.5))
        levels = {level.measure: level.window_max for level in guard.agree(None).spike_check.levels}
        assert levels["loss"] == 3.0  # the step's losses, both counted
        with pytest.raises(ValueError, match="`loss` must be replicated"):
            guard.record_loss(distribute_tensor(torch.ones(1), mesh, [Shard(0)]))
    finally:
        dist.destroy_process_group()
