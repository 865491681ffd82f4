"""Gradient sources without a process group: DeepSpeed's partitions read from a stand-in engine, which source a
strategy gets, the parameters ``param.grad`` is read from as the module and its optimizers change, and the names of a
``torch.compile``d module's parameters. Only the guards under Fabric's DeepSpeed (CPU shim: on the bare module, on the
engine itself) run one rank's process group, made for each test and taken down after it."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from conftest import deepspeed_missing


class _FakeEngine:
    """The attributes of a DeepSpeedEngine that the source reads."""

    def __init__(self, optimizer: Any, boundary: bool = True, applied: bool = True) -> None:
        self.optimizer = optimizer
        self.boundary = boundary
        self.applied = applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary

    def was_step_applied(self) -> bool:
        return self.applied

    def zero_optimization_stage(self) -> int:
        return 2


def test_deepspeed_source_reads_zero2_partition_slices_and_defers_the_skip_outcome():
    from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients

    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = list(module.parameters())
    pad = torch.zeros(1)
    pad._zero_padding = True  # type: ignore[attr-defined]
    slices = [torch.ones(2), pad, torch.full((2,), float("nan")), torch.ones(1), torch.zeros(3)]  # last: unmarked pad
    optimizer = SimpleNamespace(averaged_gradients={0: slices}, params_in_partition=[params[1:]])
    engine = _FakeEngine(optimizer)
    source = DeepSpeedGradients(engine, module)
    assert source.defers_skip_outcome
    indices, grads = source.local_gradients()
    assert [source.parameter_names[i] for i in indices] == ["0.bias", "1.weight", "1.bias"]
    assert [g is s for g, s in zip(grads, [slices[0], slices[2], slices[3]], strict=True)] == [True] * 3
    engine.boundary = False
    assert source.local_gradients() is None, "a micro-batch inside accumulation is not an optimizer step"
    assert source.skipped_last_step() is False
    engine.applied = False
    assert source.skipped_last_step() is True


def test_gradient_source_for_picks_the_deepspeed_source_from_the_engine():
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients
    from lightning_ckguard.record.source_selection import gradient_source_for
    from lightning_ckguard.record.sources import ParameterGradients

    module = torch.nn.Linear(2, 2)
    plain = gradient_source_for(DDPStrategy(), module)
    assert isinstance(plain, ParameterGradients)
    assert plain.defers_skip_outcome is False and plain.skipped_last_step() is False
    engine = _FakeEngine(SimpleNamespace())
    engine.module = module  # type: ignore[attr-defined]
    assert isinstance(gradient_source_for(DDPStrategy(), engine), DeepSpeedGradients)  # Fabric passes the engine


@pytest.mark.deepspeed
@pytest.mark.skipif(deepspeed_missing() is not None, reason="DeepSpeed is not installed")
def test_gradient_source_for_a_deepspeed_strategy_needs_its_engine():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients
    from lightning_ckguard.record.source_selection import gradient_source_for

    module = torch.nn.Linear(2, 2)
    strategy = DeepSpeedStrategy(stage=2)
    with pytest.raises(ValueError, match="no DeepSpeed engine yet"):
        gradient_source_for(strategy, module)
    strategy.model = _FakeEngine(SimpleNamespace())  # type: ignore[assignment]
    source = gradient_source_for(strategy, module)
    assert isinstance(source, DeepSpeedGradients) and source.parameter_names == ["weight", "bias"]


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning", "lightning.fabric", "lightning_fabric"])
def test_a_deepspeed_strategy_of_either_lightning_package_gets_the_deepspeed_source(package):
    import importlib

    from lightning_ckguard._distributed import is_deepspeed_strategy

    strategies = importlib.import_module(f"{package}.strategies")
    # created without running its constructor, which needs DeepSpeed installed: only the type matters here
    deepspeed = strategies.DeepSpeedStrategy.__new__(strategies.DeepSpeedStrategy)
    assert is_deepspeed_strategy(deepspeed)
    assert not is_deepspeed_strategy(strategies.DDPStrategy())


def test_a_spike_gate_divides_deepspeeds_fp16_loss_scale_out_of_the_gradient_norm():
    from lightning_ckguard import GradientGuard, SpikeGate
    from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients

    module = torch.nn.Linear(3, 1)
    params = list(module.parameters())
    unscaled = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([4.0])]  # a norm of 5
    for loss_scale, expected_sharded in ((1024.0, True), (None, True)):
        # ZeRO-2's partition slices still carry the loss scale at the optimizer step (fp16); bf16 has none
        scale = loss_scale or 1.0
        optimizer = SimpleNamespace(averaged_gradients={0: [g * scale for g in unscaled]},
                                    params_in_partition=[params], loss_scale=loss_scale)
        source = DeepSpeedGradients(_FakeEngine(optimizer), module)
        guard = GradientGuard(module, source=source, spike_gate=SpikeGate(measures="grad_norm"))
        guard.record(step=0)
        guard.conclude_step()
        assert source.shards_gradients is expected_sharded
        verdict = guard.agree(None, global_step=1)
        (level,) = verdict.spike_check.levels
        assert level.window_max == pytest.approx(5.0), loss_scale


def _guarded_step(module: torch.nn.Module, optimizer: Any) -> Any:
    """One step recorded from a stand-in engine's optimizer, and the verdict on it."""
    from lightning_ckguard import GradientGuard
    from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients

    guard = GradientGuard(module, source=DeepSpeedGradients(_FakeEngine(optimizer), module))
    guard.record(step=4)
    guard.conclude_step()
    return guard.agree(None, global_step=5)


def test_zero2_slices_without_padding_name_their_parameters_and_an_unknown_layout_names_its_group():
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = list(module.parameters())
    # group 0: one slice per parameter and no padding at all; group 1: fewer slices than parameters, a layout this
    # version does not know, read whole and named after its group
    slices = {0: [torch.ones(6), torch.tensor([1.0, float("nan")])], 1: [torch.full((3,), float("inf"))]}
    optimizer = SimpleNamespace(averaged_gradients=slices, params_in_partition=[params[:2], params[2:]])
    verdict = _guarded_step(module, optimizer)
    assert not verdict.accepted
    assert verdict.parameters == ("0.bias", "<ZeRO partition of parameter group 1>")


class _Fragment:
    """Where a parameter's elements lie in its group's flat fp32 partition, as DeepSpeed's ``_hp_mapping`` says."""

    def __init__(self, start: int, numel: int) -> None:
        self.address = SimpleNamespace(start=start, numel=numel)

    def get_hp_fragment_address(self) -> SimpleNamespace:
        return self.address


@pytest.mark.parametrize("layout", ["zero2-offload", "bf16-optimizer"])
def test_flat_fp32_partitions_are_read_by_each_parameters_address_and_whole_where_none_has_one(layout):
    # group 0 holds the first layer's weight (6 elements) and bias (2) at their addresses; group 1 maps no parameter
    # into this rank's partition, so it is read whole, unattributed
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = list(module.parameters())
    params[0]._hp_mapping, params[1]._hp_mapping = _Fragment(0, 6), _Fragment(6, 2)  # type: ignore[attr-defined]
    for bad_group, position, expected in ((1, 0, "<ZeRO partition of parameter group 1>"), (0, 7, "0.bias")):
        grads = [torch.zeros(8), torch.zeros(3)]
        grads[bad_group][position] = float("nan")  # in group 0, the bias's last element
        if layout == "zero2-offload":
            masters = [torch.zeros(8), torch.zeros(3)]
            for master, grad in zip(masters, grads, strict=True):
                master.grad = grad
            optimizer = SimpleNamespace(averaged_gradients={}, params_in_partition=[params[:2], params[2:]],
                                        cpu_offload=True, single_partition_of_fp32_groups=masters)
        else:
            optimizer = SimpleNamespace(fp32_groups_gradients=grads, bf16_groups=[params[:2], params[2:]],
                                        fp32_groups_gradient_flat_partition=grads)
        verdict = _guarded_step(module, optimizer)
        assert not verdict.accepted and verdict.parameters == (expected,), (bad_group, verdict.parameters)


def test_a_new_optimizer_at_a_dead_ones_address_is_read_as_itself():
    """Phases that make their optimizer anew: CPython soon places a new one at a freed one's address (its ``id``). A
    cache keyed by that id read the dead optimizer's parameters, and an inf in the new one's gradient was accepted."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    guard = GradientGuard(model)
    addresses = set()
    reused = 0
    for attempt in range(200):
        part = model["a" if attempt % 2 == 0 else "b"]
        model.zero_grad()
        part(torch.randn(2, 4)).sum().backward()
        optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
        reused += id(optimizer) in addresses
        addresses.add(id(optimizer))
        part.weight.grad[0, 0] = float("inf")
        guard.record(optimizer)
        assert not guard.agree(None).accepted, f"attempt {attempt}: the inf was not read"
        guard.reset()
        del optimizer
    assert reused  # the case under test happened


class _MadeOnFirstForward(torch.nn.Module):
    """A layer whose weight only exists from its first forward on (a shape known from the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: torch.nn.Parameter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            self.weight = torch.nn.Parameter(torch.ones(x.shape[-1]))
        return x * self.weight


def _added_layer(model: torch.nn.Sequential) -> str:
    model.append(torch.nn.Linear(4, 4))
    return "1.weight"


def _replaced_layer(model: torch.nn.Sequential) -> str:
    model[0] = torch.nn.Linear(4, 4)
    return "0.weight"


def _made_on_first_forward(model: torch.nn.Sequential) -> str:
    model.append(_MadeOnFirstForward())
    return "1.weight"


def _lazy_linear(model: torch.nn.Sequential) -> str:
    model.append(torch.nn.LazyLinear(4))
    return "1.weight"


@pytest.mark.parametrize("change", [_added_layer, _replaced_layer, _made_on_first_forward, _lazy_linear],
                         ids=lambda change: change.__name__.strip("_"))
def test_without_an_optimizer_the_parameters_a_module_gains_after_the_guard_are_read(change):
    """``guard.record()`` reads the module's parameters as they are at that step: a NaN gradient in one the module
    gained after the guard was built is flagged and named."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    guard = GradientGuard(model)
    name = change(model)
    for step in range(2):  # the step whose forward made a parameter reads it, and so does the next (listed once)
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        dict(model.named_parameters())[name].grad[0] = float("nan")
        guard.record()
        verdict = guard.agree(None)
        assert not verdict.accepted, f"step {step}: the NaN in {name} was not read"
        assert verdict.parameters == (name,)
        guard.reset()


def test_a_layer_replaced_after_the_guard_is_named_as_itself_not_as_a_dead_one_at_its_address():
    """Replaced layers free their parameters, and CPython soon places new ones at their addresses (their ``id``): an
    index keyed by that id gave a new weight a dead bias's name."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    guard = GradientGuard(model)
    for attempt in range(100):
        slot = attempt % 2
        model[slot] = torch.nn.Linear(4, 4)
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        model[slot].weight.grad[0, 0] = float("inf")
        guard.record()
        verdict = guard.agree(None)
        assert verdict.parameters == (f"{slot}.weight",), f"attempt {attempt}"
        guard.reset()


def test_a_parameter_swapped_into_an_optimizers_group_is_read():
    """A group's parameter list keeps its length when one parameter is replaced in it: the new one is read."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GradientGuard(model)
    model(torch.randn(2, 4)).sum().backward()
    guard.record(optimizer)
    assert guard.agree(None).accepted
    guard.reset()
    model[1] = torch.nn.Linear(4, 4)
    optimizer.param_groups[0]["params"][2:] = list(model[1].parameters())
    model.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    model[1].bias.grad[0] = float("nan")
    guard.record(optimizer)
    verdict = guard.agree(None)
    assert not verdict.accepted and verdict.parameters == ("1.bias",)


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile``'s ``OptimizedModule`` around ``model``, built lazily: nothing here calls it, so no compiler
    runs."""
    try:
        compiled = torch.compile(model)
    except RuntimeError as error:  # a Python or platform torch.compile does not support
        pytest.skip(f"torch.compile is unavailable: {error}")
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is model
    return compiled


def test_a_compiled_modules_parameters_are_named_as_the_modules_own_in_a_rejection():
    """Not ``_orig_mod.1.weight``: the gradients' names and the state check's are those of the module compiled."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    compiled = _compiled(model)
    guard = GradientGuard(compiled)
    model(torch.randn(3, 2)).sum().backward()
    model[1].weight.grad[0, 0] = float("nan")
    guard.record()
    model[0].bias.data[0] = float("inf")  # and in the state about to be written
    error = guard.agree(None, state={"model": compiled}).to_error()
    assert error.parameters == ("1.weight",)
    assert error.non_finite_state == ((0, "model: parameter 0.bias"),)


@contextlib.contextmanager
def _one_process_deepspeed_fabric(stage: int) -> Iterator[Any]:
    """Fabric's DeepSpeed (on CPU, ``tests/deepspeed_shim.py``) in this process, as one rank: its process group, the
    environment variables its launcher sets and the thread count it changes are taken down after the test."""
    import torch.distributed as dist

    deepspeed_shim = pytest.importorskip("deepspeed_shim")
    from lightning.fabric import Fabric

    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    strategy = deepspeed_shim.CPUFabricDeepSpeedStrategy(config=deepspeed_shim.deepspeed_config(stage, "32-true"),
                                                         timeout=timedelta(seconds=30))
    with mock.patch.dict(os.environ):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        try:
            fabric.launch()
            yield fabric
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(threads)
            # DeepSpeed keeps the world group it cloned: an engine made later in this process must clone the next one
            groups = importlib.import_module("deepspeed.utils.groups")
            if hasattr(groups, "_WORLD_GROUP"):
                groups._WORLD_GROUP = None


@pytest.mark.deepspeed
@pytest.mark.skipif(deepspeed_missing() is not None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("built", ["before-setup", "after-setup"])
def test_a_guard_on_the_bare_module_under_deepspeed_refuses_record_without_an_optimizer(stage, built):
    """ZeRO keeps the gradients in its optimizer's partitions and ``param.grad`` stays None: a guard on the module
    itself, not on what ``fabric.setup`` returned, counted the step and accepted a NaN in it. Now ``record()``
    raises, naming what to build the guard on, and records nothing, at every step; the guard on what ``fabric.setup``
    returned rejects the NaN."""
    from lightning_ckguard import GradientGuard

    with _one_process_deepspeed_fabric(stage) as fabric:
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        bare = GradientGuard(net) if built == "before-setup" else None
        raw = torch.optim.SGD(net.parameters(), lr=0.1)  # DeepSpeed rewrites its groups to its own partitions
        model, optimizer = fabric.setup(net, raw)
        bare = bare or GradientGuard(net)
        inputs = torch.randn(4, 4)
        inputs[0, 0] = float("nan")
        fabric.backward(model(inputs).pow(2).mean())
        for _ in range(2):
            with pytest.raises(ValueError, match="build `GradientGuard` on the model `fabric.setup` returned"):
                bare.record()
            with pytest.raises(ValueError, match="build `GradientGuard` on the model `fabric.setup` returned"):
                bare.record(raw)  # the optimizer the user passed to `fabric.setup`: its partitions have no `.grad`
        assert bare.steps_recorded == 0
        guard = GradientGuard(model)
        guard.record(optimizer)
        assert not guard.agree(fabric.strategy).accepted


@pytest.mark.deepspeed
@pytest.mark.skipif(deepspeed_missing() is not None, reason="DeepSpeed is not installed")
def test_under_deepspeed_zero_0_a_guard_on_the_bare_module_reads_param_grad_and_rejects_a_nan():
    """ZeRO-0 leaves the reduced gradients in ``param.grad``: nothing to refuse there."""
    from lightning_ckguard import GradientGuard

    with _one_process_deepspeed_fabric(0) as fabric:
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        bare = GradientGuard(net)
        inputs = torch.randn(4, 4)
        inputs[0, 0] = float("nan")
        fabric.backward(model(inputs).pow(2).mean())
        bare.record()
        assert not bare.agree(fabric.strategy).accepted


@pytest.mark.deepspeed
@pytest.mark.skipif(deepspeed_missing() is not None, reason="DeepSpeed is not installed")
def test_a_guard_on_the_deepspeed_engine_itself_names_the_parameters_as_the_users_module_does():
    """A guard may be given what ``fabric.setup`` returned or the DeepSpeed engine inside it: either way a rejection
    names the parameters as the user's own module does (``0.weight``, not the engine's ``module.0.weight``)."""
    from lightning_ckguard import GradientGuard

    with _one_process_deepspeed_fabric(1) as fabric:
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        guards = [GradientGuard(model), GradientGuard(model._forward_module)]
        inputs = torch.randn(4, 4)
        inputs[0, 0] = float("nan")
        fabric.backward(model(inputs).pow(2).mean())
        names = []
        for guard in guards:
            guard.record(optimizer)
            names.append(guard.agree(fabric.strategy).to_error().parameters)
    assert names[0] == names[1] and names[0] and not any(name.startswith("module.") for name in names[0]), names


def test_without_deepspeed_a_module_is_checked_once_per_layout():
    """Whether DeepSpeed keeps the gradients is looked up (attributes only) at the first read of each layout of the
    module's parameters, not at the steps after it."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    guard = GradientGuard(model)
    model(torch.randn(3, 2)).sum().backward()
    guard.record()
    with mock.patch("lightning_ckguard.record.sources._refuse_gradients_kept_elsewhere") as check:
        for _ in range(3):
            guard.record()
        assert check.call_count == 0
        model.append(torch.nn.Linear(2, 1))
        guard.record()
        assert check.call_count == 1
    assert guard.steps_recorded == 5
