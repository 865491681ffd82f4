"""The spike gate in one process: its configuration, its pure judgement, the per-step values it records on the device,
and a guard that rejects a finite spike and learns only from accepted windows.

The 2-process runs (a spike on rank 1 only under DDP and FSDP2, rewind against a run without the bad batch, the
global gradient norm against ``clip_grad_norm_``) are in ``tests/recover/test_spike_gate.py``.
"""

from __future__ import annotations

import math
import pickle
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import HOST_READS, CountOps
from lightning_ckguard import GradientGuard, NonFiniteGradientError, Spike, SpikeGate
from lightning_ckguard.agree.spikes import SpikeHistory, StepMeasures, global_values, judge, judged_alike_words
from lightning_ckguard.record import finiteness, sources, squares
from lightning_ckguard.record import step_values as rows
from lightning_ckguard.record.finiteness import NonFiniteCheck
from lightning_ckguard.record.squares import FlagsAndSquares, SquaresLayout
from lightning_ckguard.record.step_values import StepValues
from lightning_ckguard.record.window import NonFiniteWindow

# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"measures": ()}, "one or both of"),
        ({"measures": None}, "one or both of"),
        ({"measures": 1}, "one or both of"),
        ({"measures": ("loss", "perplexity")}, "one or both of"),
        ({"measures": ("loss", "loss")}, "each once"),
        ({"factor": 1.0}, "factor"),
        ({"factor": float("inf")}, "factor"),
        ({"factor": True}, "factor"),
        ({"factor": 10**400}, "factor"),
        ({"deviations": 0}, "deviations"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"history": 4}, "history"),
        ({"history": 50, "warmup_steps": 100}, "warm-up never ends"),
        ({"resolution": 100}, "power of two"),
        ({"resolution": 1}, "resolution"),
    ],
)
def test_bad_values_are_value_errors_at_construction(arguments, message):
    with pytest.raises(ValueError, match=message):
        SpikeGate(**arguments)


def test_numpy_numbers_are_taken_and_kept_as_plain_python_numbers():
    # a sweep's grid yields numpy scalars, which FiniteGradCheckpoint's own arguments take too
    gate = SpikeGate(factor=np.float32(5.0), deviations=np.float64(3), warmup_steps=np.int64(10),
                     history=np.int32(200), resolution=np.int64(64))
    assert gate == SpikeGate(factor=5.0, deviations=3.0, warmup_steps=10, history=200, resolution=64)
    assert [type(getattr(gate, name)) for name in ("factor", "deviations", "warmup_steps", "history", "resolution")] \
        == [float, float, int, int, int]
    for bad in ({"factor": np.bool_(True)}, {"warmup_steps": np.float64(3.0)}):
        with pytest.raises(ValueError, match="SpikeGate"):
            SpikeGate(**bad)


def test_the_agreements_digest_of_a_gate_depends_on_its_values_not_their_types():
    # a gate pickled by an earlier release keeps `factor=10` (unpickling runs no __post_init__): equal, so alike
    old = SpikeGate()
    object.__setattr__(old, "factor", 10)
    histories = [SpikeHistory(gate) for gate in (SpikeGate(), old)]
    for history in histories:
        history.learn(_measures([1.0, 2.0]))
    assert judged_alike_words(histories[0], 2, 1) == judged_alike_words(histories[1], 2, 1)
    assert judged_alike_words(histories[0], 2, 1) != judged_alike_words(SpikeHistory(SpikeGate()), 2, 1)


def test_a_single_measure_may_be_named_alone_and_the_gate_is_a_value():
    gate = SpikeGate(measures="grad_norm")
    assert gate.measures == ("grad_norm",)
    assert gate == SpikeGate(measures=("grad_norm",)) and pickle.loads(pickle.dumps(gate)) == gate
    with pytest.raises(ValueError, match="SpikeGate"):
        GradientGuard(torch.nn.Linear(2, 1), spike_gate="on")  # type: ignore[arg-type]


# ------------------------------------------------------------------ the judgement


def _measures(losses, norms=None, first_step=0):
    norms = norms if norms is not None else [1.0] * len(losses)
    labels = tuple((first_step + i, first_step + i) for i in range(len(losses)))
    return StepMeasures({"loss": tuple(losses), "grad_norm": tuple(norms)}, labels)


def _history(gate, values):
    history = SpikeHistory(gate)
    history.learn(_measures(values))
    return history


def test_nothing_spikes_during_the_warm_up():
    gate = SpikeGate(warmup_steps=20, history=100)
    check = judge(gate, _history(gate, [1.0] * 19), _measures([1e6]))
    assert check.spikes == ()
    assert [(level.measure, level.baseline, level.window_max) for level in check.levels] == [
        ("loss", None, 1e6), ("grad_norm", None, 1.0)]


@pytest.mark.parametrize("history", [8, 100])
def test_the_warm_up_ends_with_its_last_value_even_where_the_history_holds_no_more(history):
    # warmup_steps == history is allowed: the baseline must form once the history is full, or the gate never fires
    gate = SpikeGate(measures="loss", warmup_steps=8, history=history)
    noisy = [1.0 + 0.01 * i for i in range(8)]
    assert judge(gate, _history(gate, noisy[:7]), _measures([1e6])).spikes == ()
    (spike,) = judge(gate, _history(gate, noisy), _measures([1e6], first_step=8)).spikes
    assert (spike.measure, spike.first_step) == ("loss", 8)


def test_a_step_spikes_only_past_both_the_factor_and_the_deviations():
    gate = SpikeGate(factor=10, deviations=20, warmup_steps=10, history=100)
    noisy = [1.0 + 0.5 * math.sin(i) for i in range(40)]  # median about 1, spread about 0.5
    history = _history(gate, noisy)
    median, spread = history.baseline("loss")
    assert 0.9 < median < 1.1 and 0.4 < spread < 0.8
    # 9x: past the deviations, not the factor; 50x: past both
    check = judge(gate, history, _measures([9 * median, 1.0, 50 * median], first_step=100))
    assert [(s.measure, s.first_step, round(s.ratio)) for s in check.spikes] == [("loss", 102, 50)]
    # a very steady history (spread near zero): 3x is far past the deviations, not past the factor
    steady = _history(gate, [2.0] * 40)
    assert judge(gate, steady, _measures([6.0])).spikes == ()
    assert judge(gate, steady, _measures([25.0])).spikes[0].deviations == math.inf


def test_a_baseline_of_zero_or_below_is_judged_by_its_size_and_one_without_size_or_spread_never_spikes():
    gate = SpikeGate(measures="loss", factor=10, deviations=20, warmup_steps=8, history=16)
    # a negative log-likelihood that sits at exactly -2 (a spread of 0): a tiny rise is no spike, a rise of more
    # than (10 - 1) x 2 above it is
    flat = _history(gate, [-2.0] * 16)
    assert judge(gate, flat, _measures([-1.999, -1.9, 15.9])).spikes == ()
    (spike,) = judge(gate, flat, _measures([16.5], first_step=40)).spikes
    assert (spike.first_step, spike.baseline, spike.ratio, spike.deviations) == (40, -2.0, 10.25, math.inf)
    assert "18.5 above its baseline of -2" in spike.describe() and "x its baseline" not in spike.describe()
    mostly_flat = _history(gate, [-2.0] * 12 + [-1.9, -2.1, -1.8, -2.2])
    assert judge(gate, mostly_flat, _measures([-1.9, 0.0])).spikes == ()
    # exactly 0 for most of its history (a hinge loss with every margin met): no size, no spread, nothing to judge
    zero = _history(gate, [0.0] * 16)
    assert judge(gate, zero, _measures([1e-9, 1e6])).spikes == ()
    # a median of 0 with a spread: the deviations decide
    around_zero = _history(gate, [0.0] * 6 + [sign * k / 10 for k in range(1, 6) for sign in (1, -1)])
    median, spread = around_zero.baseline("loss")
    assert median == 0.0 and spread > 0
    assert [s.value for s in judge(gate, around_zero, _measures([19 * spread, 21 * spread])).spikes] == [21 * spread]
    # a positive baseline is judged as before: 10.5 x a steady 1.0 spikes, 9.5 x does not
    steady = _history(gate, [1.0] * 16)
    assert [s.value for s in judge(gate, steady, _measures([9.5, 10.5])).spikes] == [10.5]


def test_steps_that_were_not_finite_or_gave_no_loss_are_neither_judged_nor_learned():
    gate = SpikeGate(warmup_steps=10, history=100)
    history = _history(gate, [1.0] * 20)
    check = judge(gate, history, _measures([None, 1e9], norms=[1e9, None]))
    assert [(s.measure, s.first_step) for s in check.spikes] == [("grad_norm", 0), ("loss", 1)]
    history.learn(_measures([None, float("inf"), 3.0], norms=[None, None, None]))
    assert list(history.values["loss"])[-1] == 3.0 and len(history.values["loss"]) == 21
    assert len(history.values["grad_norm"]) == 20


def test_global_values_add_up_shards_once_and_replicas_once():
    capacity, world = 4, 2
    table = [[0.0] * capacity for _ in range(rows.ROWS)]
    # slot 0: loss summed over 2 ranks that both gave one; shards 3 + 4 squared; replicated 25 on each rank
    table[rows.LOSS][0], table[rows.LOSS_SEEN][0] = 3.0, 2.0
    table[rows.SHARDED][0], table[rows.REPLICATED][0] = 9.0 + 16.0, 2 * 25.0
    table[rows.INVALID][1] = 1.0  # slot 1: a rank saw a non-finite value
    words = [value for row in table for value in row]
    measures = global_values(words, capacity, [[5, 5], [6, 6]], world)
    assert measures.values["loss"] == (1.5, None)
    assert measures.values["grad_norm"] == (math.sqrt(25.0 + 25.0), None)
    assert measures.labels == ((5, 5), (6, 6))


# ------------------------------------------------------------------ recording, on the device


def test_a_long_window_is_folded_into_its_slots_keeping_each_slots_largest_value():
    values = StepValues(torch.device("cpu"), capacity=4)
    for step in range(10):
        values.add_loss(torch.tensor(100.0 - step))
        values.record_step(None, torch.tensor(float(step), dtype=torch.float64), torch.tensor(False), step)
    # 10 steps in 4 slots: folded twice, 4 steps per slot; the last slot is still filling
    assert values.steps_per_slot == 4 and values.labels == [[0, 3], [4, 7], [8, 9]]
    summary = values.summary().view(rows.ROWS, 4)
    assert summary[rows.REPLICATED].tolist() == [3.0, 7.0, 9.0, -math.inf]  # an unused slot holds no values
    assert summary[rows.LOSS].tolist() == [100.0, 96.0, 92.0, 0.0]
    values.reset()
    summary = values.summary().view(rows.ROWS, 4)
    assert values.labels == [] and not summary[[rows.LOSS, rows.LOSS_SEEN, rows.INVALID]].any()
    assert (summary[[rows.SHARDED, rows.REPLICATED]] == -math.inf).all()  # no step gave squares


def test_a_step_that_was_not_finite_keeps_its_folded_slot_unjudged_whatever_joins_it_later():
    # capacity 2: steps 2 and 3 share a slot once folded; step 2's gradients were not finite (its loss 50 is the
    # diverged weights'), so the slot is the finiteness check's, also after finite step 3 joined it
    values = StepValues(torch.device("cpu"), capacity=2)
    for step, (loss, sum_of_squares, bad) in enumerate([(1.0, 1.0, False), (1.0, 1.0, False),
                                                        (50.0, float("nan"), True), (1.0, 1.0, False)]):
        values.add_loss(torch.tensor(loss, dtype=torch.float64))
        values.record_step(None, torch.tensor(sum_of_squares, dtype=torch.float64), torch.tensor(bad), step)
    measures = global_values(values.summary().tolist(), values.capacity, values.labels, 1)
    assert measures.labels == ((0, 1), (2, 3))
    assert measures.values["loss"] == (1.0, None) and measures.values["grad_norm"] == (1.0, None)


def test_micro_batch_losses_add_up_to_their_step_and_a_boundary_between_them_keeps_them_for_it():
    values = StepValues(torch.device("cpu"))
    zero, finite = torch.zeros((), dtype=torch.float64), torch.tensor(False)
    values.add_loss(torch.tensor(1.0))  # the first micro-batch of step 7 (accumulation)
    values.add_loss(torch.tensor(2.0))  # the second: then the step
    values.record_step(None, zero, finite, 7)
    values.add_loss(torch.tensor(float("nan")))
    values.record_step(None, zero, finite, 8)
    values.add_loss(torch.tensor(4.0))  # the first micro-batch of step 9, then a boundary between the two
    summary = values.summary().view(rows.ROWS, -1)
    assert summary[rows.LOSS, 0] == 3.0 and summary[rows.LOSS, 1].isnan()  # a NaN loss stays in its slot
    assert summary[rows.LOSS_SEEN, :3].tolist() == [1.0, 1.0, 0.0]  # step 9 is not recorded yet
    # the step of the NaN loss is not judged on its loss; its finite gradients are
    measures = global_values(summary.reshape(-1).tolist(), values.capacity, values.labels, 1)
    assert measures.values == {"loss": (3.0, None), "grad_norm": (0.0, 0.0)}
    values.reset()  # the window was published: step 9's first micro-batch stays for it
    values.add_loss(torch.tensor(5.0))
    values.record_step(None, zero, finite, 9)
    assert values.labels == [[9, 9]] and values.summary()[rows.LOSS * values.capacity] == 9.0


@pytest.mark.parametrize("capacity", [16, 2], ids=["a-slot-per-step", "folded"])
def test_a_step_left_out_hides_no_other_step_of_its_slot_and_one_kept_hides_its_slot_whatever_the_fold(capacity):
    # a step every rank leaves out alike (skipped by a loss scaler; not finite where gradients are replicated) adds
    # nothing to its slot; a sharded step that was not finite on one rank only, not known as skipped, makes its slot
    # not judged on every rank, folded or not: the same verdict whatever the window's length
    nan, huge, one = (torch.tensor(v, dtype=torch.float64) for v in (math.nan, 1e6, 1.0))
    not_finite, finite = torch.tensor(True), torch.tensor(False)

    def window(rank: int) -> StepValues:
        values = StepValues(torch.device("cpu"), capacity=capacity)
        steps = [(one, finite, None), (nan, not_finite, not_finite),  # step 1: skipped by the scaler, on every rank
                 (huge, finite, None), (nan, not_finite, not_finite),  # step 2: a spike; step 3 skipped beside it
                 (one, finite, None), (nan if rank == 0 else huge, finite if rank else not_finite, None)]
        for step, (sharded, invalid, left_out) in enumerate(steps):
            values.add_loss(torch.tensor(1e3 if step == 2 else 1.0))
            values.record_step(sharded, None, invalid, step, left_out=left_out)
        return values

    ranks = [window(0), window(1)]
    summed = (ranks[0].summary() + ranks[1].summary()).tolist()
    measures = global_values(summed, capacity, ranks[0].labels, 2)
    by_step = {}
    for (first, last), loss, norm in zip(measures.labels, measures.values["loss"], measures.values["grad_norm"],
                                         strict=True):
        for step in range(first, last + 1):
            by_step[step] = (loss, norm)
    assert by_step[2] == (1e3, math.sqrt(2e6)), by_step  # the spike, seen beside the skipped step 3, folded or not
    assert by_step[5] == (None, None)
    if capacity == 16:  # a slot per step: a step left out has no values of its own
        assert by_step[1] == by_step[3] == (None, None) and by_step[0] == (1.0, math.sqrt(2.0))


@pytest.mark.parametrize("capacity", [16, 2], ids=["a-slot-per-step", "folded"])
def test_a_loss_that_is_not_finite_on_one_rank_hides_no_spike_of_the_gradient_norm(capacity):
    # rank 1's loss of step 2 is NaN while every gradient stays finite, and step 2's gradient norm is 1000x its
    # baseline: the gate on the gradient norm must still see it, on every rank alike, in a slot of its own or folded
    # with step 3
    gate = SpikeGate(measures=("grad_norm",), warmup_steps=10, history=100)
    finite = torch.tensor(False)

    def window(rank: int) -> StepValues:
        values = StepValues(torch.device("cpu"), capacity=capacity)
        for step, (loss, square_sum) in enumerate([(1.0, 1.0), (1.0, 1.0), (math.nan if rank else 1.0, 1e6),
                                                (1.0, 1.0)]):
            values.add_loss(torch.tensor(loss))
            values.record_step(torch.tensor(square_sum / 2, dtype=torch.float64), None, finite, step)
        return values

    ranks = [window(0), window(1)]
    measures = global_values((ranks[0].summary() + ranks[1].summary()).tolist(), capacity, ranks[0].labels, 2)
    spikes = judge(gate, _history(gate, [1.0] * 20), measures).spikes
    assert [(s.measure, s.first_step, s.value) for s in spikes] == [("grad_norm", 2, 1e3)]
    assert None in measures.values["loss"]  # the NaN loss itself is not judged


@pytest.mark.parametrize("skipped", [True, False], ids=["skipped", "applied"])
def test_a_step_deepspeed_skipped_is_left_out_once_its_outcome_is_known(skipped):
    # DeepSpeed tells whether it skipped a step only after it: the step's values wait for the outcome
    values = StepValues(torch.device("cpu"), capacity=2)
    window = NonFiniteWindow(torch.device("cpu"), values)
    sharded = SquaresLayout(sharded=True)
    for step, grad in enumerate([torch.ones(4), torch.ones(4), torch.full((4,), 500.0), torch.full((4,), math.nan)]):
        values.add_loss(torch.tensor(1.0))
        window.record_pending((0,), [grad], step, 1, sharded)
        window.settle(skipped=skipped and step == 3)  # steps 0-1 and 2-3 share a folded slot
    measures = global_values(values.summary().tolist(), 2, values.labels, 1)
    assert values.labels == [[0, 1], [2, 3]]
    # the spike at step 2 is judged beside a skipped step 3; an applied step that was not finite leaves its slot out
    assert measures.values["grad_norm"] == ((2.0, 1000.0) if skipped else (2.0, None))


def test_the_losses_given_while_a_step_awaits_its_outcome_are_the_next_steps():
    # DeepSpeed: the next step's first backward may come before the outcome of the last one is known
    values = StepValues(torch.device("cpu"))
    window = NonFiniteWindow(torch.device("cpu"), values)
    values.add_loss(torch.tensor(1.0))
    window.record_pending((0,), [torch.ones(4)], 0, 1, SquaresLayout(sharded=True))
    values.add_loss(torch.tensor(100.0))  # step 1's
    window.settle(skipped=False)
    window.record_pending((0,), [torch.ones(4)], 1, 1, SquaresLayout(sharded=True))
    values.add_loss(torch.tensor(7.0))  # step 2's, and a reset (a Fabric boundary) before step 1's outcome
    window.reset()
    window.record_pending((0,), [torch.ones(4)], 2, 1, SquaresLayout(sharded=True))
    window.settle(skipped=False)
    assert global_values(values.summary().tolist(), values.capacity, values.labels, 1).values["loss"] == (7.0,)


def test_a_gate_on_the_loss_alone_leaves_out_a_step_the_scaler_skipped_on_every_rank_alike(monkeypatch):
    # sharded gradients finite on this rank, in a step the loss scaler skipped (an inf on another rank's shard):
    # every rank leaves it out, whether the gate watches the gradient norm or not; the skip flag may be any 0-d tensor
    monkeypatch.setattr(sources, "_local_tensor", lambda grad: grad.view_as(grad))  # each grad "a DTensor's shard"
    model = torch.nn.Linear(3, 1)
    for measures in (("loss",), ("loss", "grad_norm")):
        guard = GradientGuard(model, spike_gate=SpikeGate(measures=measures))
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        guard.record(step=0, skipped=torch.tensor(1), loss=torch.tensor(50.0))
        guard.record(step=1, skipped=torch.tensor(False), loss=torch.tensor(2.0))
        values = guard.window.step_values
        measured = global_values(values.summary().tolist(), values.capacity, values.labels, 1).values
        assert measured["loss"] == (None, 2.0), measures


@pytest.mark.parametrize("one_pass", [False, True], ids=["cpu", "one-pass"])
def test_flags_stay_exact_and_the_squares_add_up(monkeypatch, one_pass):
    if one_pass:  # the accelerator path, run on CPU tensors: fp64 norms give the flags and the squares at once
        monkeypatch.setattr(squares, "_one_pass", lambda values: True)
    # on a CPU: read in pieces, its squares taken along; read by aminmax, a dot after it; four small ones read in a
    # batch, whose squares take a pass of their own (the fused norm); 3e38 (finite); a NaN
    grads = [torch.randn(300, 1000), torch.randn(128, 64), *[torch.randn(7) for _ in range(4)],
             torch.tensor([3e38, -3e38, 1.0]), torch.tensor([1.0, float("nan")])]
    reader, cpu = FlagsAndSquares(), torch.device("cpu")
    flags, total = reader(grads, cpu)
    assert flags.tolist() == [False] * 7 + [True]  # 3e38 is finite, whatever its square is
    assert total.isnan(), "a step with a non-finite gradient has no sum of squares: it is the finiteness check's"
    finite = sum(float(g.double().square().sum()) for g in grads[:6])
    flags, total = reader(grads[:7], cpu)
    assert not flags.any()
    if one_pass:
        large = float(grads[6][0])  # 3e38 as fp32 holds it
        assert float(total) == pytest.approx(finite + 2 * large**2 + 1, rel=1e-12)
    else:  # in fp32 on a CPU: the squares of 3e38 overflow, and the step is above every baseline
        assert float(total) == math.inf
        assert float(reader(grads[:6], cpu)[1]) == pytest.approx(finite, rel=1e-5)


@pytest.mark.parametrize("one_pass", [False, True], ids=["cpu", "one-pass"])
def test_a_gradient_held_by_several_ranks_counts_its_squares_once(monkeypatch, one_pass):
    if one_pass:
        monkeypatch.setattr(squares, "_one_pass", lambda values: True)
    # on a CPU: a mid-size one and a small one (a dot after their aminmax), an fp16 one (a pass of its own), one read
    # in pieces with its flags; held by 2, 1, 4 and 8 ranks
    grads = [torch.randn(128, 64), torch.randn(7), torch.randn(9).half(), torch.randn(300, 1000)]
    each = [float(g.double().square().sum()) for g in grads]
    reader = FlagsAndSquares()
    reader(grads, torch.device("cpu"), replicas=(2, 1, 4, 8))  # the first read of a layout plans it
    with CountOps() as ops:
        _, total = reader(grads, torch.device("cpu"), replicas=(2, 1, 4, 8))
    assert float(total) == pytest.approx(each[0] / 2 + each[1] + each[2] / 4 + each[3] / 8, rel=1e-3)
    # the weights go to the device as scalars: no host read, no tensor made of host values
    assert ops.host_reads == 0 and not any(n.startswith("lift_fresh") for n in ops.names), ops.names


def test_the_sum_of_squares_covers_the_gradients_read_apart_from_the_exact_reader():
    # a model with a bf16 layer: its gradient is squared in a pass of its own, the fp32 one with its flags
    grads = [torch.full((100,), 1.0), torch.full((10,), 3.0, dtype=torch.bfloat16)]
    _, total = FlagsAndSquares()(grads, torch.device("cpu"))
    assert float(total) == pytest.approx(100 + 90, rel=1e-2)


def test_each_gradient_keeps_its_replica_count_whichever_pass_squares_it():
    # HSDP or tensor parallelism: a small fp16 gradient on one rank (a dot), a large one held by 4 (a fused norm)
    grads = [torch.full((10,), 2.0, dtype=torch.float16), torch.full((8192,), 1.0, dtype=torch.float16)]
    _, total = FlagsAndSquares()(grads, torch.device("cpu"), replicas=(1, 4))
    assert float(total) == pytest.approx(40 + 8192 / 4, rel=1e-3)


@pytest.mark.parametrize("width", [4, 512], ids=["small", "read-in-pieces"])
def test_recording_with_the_gate_reads_nothing_back_and_communicates_nothing(width):
    model = torch.nn.Sequential(torch.nn.Linear(width, 8 * width), torch.nn.Tanh(), torch.nn.Linear(8 * width, 1))
    guard = GradientGuard(model, spike_gate=SpikeGate())
    loss = model(torch.randn(5, width)).pow(2).mean()
    loss.backward()
    guard.record(step=0, loss=loss.detach())  # warm the caches
    with CountOps() as ops:
        for step in range(1, 6):
            guard.record(step=step, loss=loss.detach())
    assert ops.names, "the dispatch mode saw no ops at all"
    assert ops.host_reads == 0, [n for n in ops.names if n.split(".")[0] in HOST_READS]
    assert not any("c10d" in n or "all_reduce" in n for n in ops.names)
    # nor makes a tensor of host values (an index list, say), which an accelerator would copy over every step
    assert not any(n.startswith("lift_fresh") for n in ops.names), ops.names


# ------------------------------------------------------------------ a guard with the gate


def _train(guard, model, optimizer, steps, first_step=0, spike_at=None, every=5):
    verdicts = []
    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator)
        if step == spike_at:
            y = y * 1e3
        optimizer.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        guard.record(optimizer, step=step, loss=loss.detach())
        optimizer.step()
        if (step + 1) % every == 0:
            verdict = guard.agree(None, global_step=step + 1)
            guard.reset()  # as after a publication, or a rewind: a rejected window must still teach nothing
            verdicts.append(verdict)
    return verdicts


def test_a_finite_spike_rejects_with_its_step_value_and_baseline_and_teaches_nothing():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=20, history=100))
    assert all(v.accepted for v in _train(guard, model, optimizer, 40))
    learned = {measure: list(values) for measure, values in guard._spike_history.values.items()}
    assert len(learned["loss"]) == 40
    (verdict,) = _train(guard, model, optimizer, 5, first_step=40, spike_at=42)
    assert not verdict.accepted and verdict.ranks == ()
    error = verdict.to_error()
    # the bad batch's step spikes on both measures; the weights it ruined make the steps after it spike too
    spikes = [(s.measure, s.first_step, s.last_step) for s in error.spikes]
    assert spikes[:2] == [("loss", 42, 42), ("grad_norm", 42, 42)] and all(s[1] >= 42 for s in spikes)
    assert all(s.ratio > 1e2 for s in error.spikes[:2]) and all(s.value > 10 * s.baseline for s in error.spikes)
    assert "the loss spiked at step 42 to" in str(error) and "the global gradient norm spiked at step 42" in str(error)
    # the rejected window taught the gate nothing: its baseline is what the accepted windows made it
    assert {m: list(v) for m, v in guard._spike_history.values.items()} == learned
    # an error is a value: pickled, it is equal; its fields hold the spikes as plain values
    assert pickle.loads(pickle.dumps(error)) == error
    assert NonFiniteGradientError(**error.fields()) == error
    assert error.fields()["spikes"][0]["measure"] == "loss" and isinstance(error.spikes[0], Spike)
    report = verdict.report("train batch end")
    assert report.metrics()["ckguard/loss_window_max"] == error.spikes[0].value
    assert report.metrics()["ckguard/loss_baseline"] == error.spikes[0].baseline


def test_finite_gradients_whose_squares_overflow_spike_in_words_that_say_so():
    # 1e20 everywhere: finite, and never flagged, but the squares of a 1 MiB fp32 piece overflow their sum
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=8, history=64))
    for step in range(12):
        optimizer.zero_grad()
        model(torch.randn(4, 512)).pow(2).mean().backward()
        if step == 10:
            for param in model.parameters():
                param.grad.fill_(1e20)
        guard.record(optimizer, loss=torch.tensor(1.0))
        if step % 2:
            verdict = guard.agree(None, global_step=step + 1)
            if verdict.accepted:
                guard.reset()
    assert not verdict.accepted and verdict.ranks == ()
    (spike,) = verdict.to_error().spikes
    assert (spike.measure, spike.first_step, math.isinf(spike.value)) == ("grad_norm", 10, True)
    message = str(verdict.to_error())
    assert "past the range of its sum of squares" in message and not re.search(r"\binf", message)


def test_a_loss_given_before_its_step_is_recorded_is_that_steps_loss():
    model = torch.nn.Linear(3, 1)
    guard = GradientGuard(model, spike_gate=SpikeGate())
    given = [1.0, 2.0, 3.0, 4.0]
    for step, loss in enumerate(given):
        model.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        if step == 2:  # an accumulated step: its micro-batches' losses, then the step
            guard.record_loss(torch.tensor(loss / 2))
            guard.record_loss(torch.tensor(loss / 2))
            guard.record(step=step)
        elif step == 3:
            guard.record(step=step, loss=torch.tensor(loss))
        else:
            guard.record_loss(torch.tensor(loss))
            guard.record(step=step)
    values = guard.window.step_values
    assert values.summary().view(rows.ROWS, -1)[rows.LOSS, :4].tolist() == given


def test_an_error_without_spikes_keeps_the_fields_of_earlier_releases():
    error = NonFiniteGradientError(ranks=[1], first_step=3, last_step=3, num_steps=1, global_step=4)
    assert "spikes" not in error.fields() and error.spikes == ()


def test_negative_losses_are_kept_as_they_are_in_their_slots_and_folds():
    values = StepValues(torch.device("cpu"), capacity=2)
    zero, finite = torch.zeros((), dtype=torch.float64), torch.tensor(False)
    for step, loss in enumerate([-2.0, -1.5, -1.75]):
        values.add_loss(torch.tensor(loss))
        values.record_step(None, zero, finite, step)
    # 3 steps in 2 slots: steps 0-1 folded into one (the larger, -1.5), step 2 alone; an empty slot is not a 0 loss
    assert values.labels == [[0, 1], [2, 2]]
    assert values.summary().view(rows.ROWS, 2)[rows.LOSS].tolist() == [-1.5, -1.75]


@pytest.mark.parametrize("left_out", [True, torch.tensor(True)], ids=["bool", "tensor"])
def test_a_step_left_out_leaves_its_own_slot_without_values(left_out):
    # a slot per step: a step every rank leaves out (a loss scaler's skip, told as a bool or a device flag) writes
    # nothing of its loss or squares, and the step before it keeps its own
    values = StepValues(torch.device("cpu"), capacity=4)
    finite = torch.tensor(False)
    for step, skipped in enumerate([False, left_out]):
        values.add_loss(torch.tensor(3.0))
        values.record_step(None, torch.tensor(2.0, dtype=torch.float64), finite, step, left_out=skipped)
    table = values.summary().view(rows.ROWS, 4)
    assert values.labels == [[0, 0], [1, 1]]
    assert table[rows.LOSS, :2].tolist() == [3.0, 0.0] and table[rows.LOSS_SEEN, :2].tolist() == [1.0, 0.0]
    assert table[rows.REPLICATED, :2].tolist() == [2.0, -math.inf]


def test_a_step_that_joins_a_folded_slot_keeps_its_negative_loss_and_a_step_without_loss_changes_none():
    values = StepValues(torch.device("cpu"), capacity=2)
    finite = torch.tensor(False)

    def step(number: int, squares: float, loss: float | None) -> None:
        if loss is not None:
            values.add_loss(torch.tensor(loss))
        values.record_step(None, torch.tensor(squares, dtype=torch.float64), finite, number)

    step(0, 1.0, -2.0)
    step(1, 1.0, -1.5)
    step(2, 5.0, None)  # folds 0-1 into one slot; no loss for this step
    step(3, 2.0, -4.0)  # joins step 2's slot: its first loss, as it is
    table = values.summary().view(rows.ROWS, 2)
    assert values.labels == [[0, 1], [2, 3]]
    assert table[rows.LOSS].tolist() == [-1.5, -4.0] and table[rows.LOSS_SEEN].tolist() == [1.0, 1.0]
    assert table[rows.REPLICATED].tolist() == [1.0, 5.0]
    step(4, 3.0, -7.0)  # folds again: 0-3 and 4
    step(5, 9.0, None)  # joins step 4's slot without a loss: the loss stays -7, the squares take the larger
    table = values.summary().view(rows.ROWS, 2)
    assert values.labels == [[0, 3], [4, 5]]
    assert table[rows.LOSS].tolist() == [-1.5, -7.0] and table[rows.REPLICATED].tolist() == [5.0, 9.0]


class _GradientReads(TorchDispatchMode):
    """Counts the ATen ops that take one of ``grads`` (or a view of it) as an argument."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.pointers = {g.data_ptr() for g in grads}
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        if any(isinstance(a, torch.Tensor) and a.data_ptr() in self.pointers for a in flat):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_gate_that_watches_only_the_loss_reads_the_gradients_as_often_as_no_gate():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    loss = model(torch.randn(5, 64)).pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    reads = {}
    for name, gate in (("none", None), ("loss", SpikeGate(measures=("loss",))), ("both", SpikeGate())):
        guard = GradientGuard(model, spike_gate=gate)
        guard.record(step=0, loss=loss.detach())  # the first step of a layout plans its reads
        with _GradientReads(grads) as mode:
            guard.record(step=1, loss=loss.detach())
        reads[name] = sorted(mode.reads)
    assert reads["none"], "the dispatch mode saw no read of the gradients"
    assert reads["loss"] == reads["none"]
    assert len(reads["both"]) > len(reads["none"])  # the squares: a read of their own on a CPU


def test_fabric_saves_and_loads_the_guards_spike_history_with_the_rest_of_the_state(tmp_path):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=3, history=10))
    _train(guard, model, optimizer, steps=10)
    learned = guard.state_dict()["spike_history"]
    assert len(learned["loss"]) == 10 and len(learned["grad_norm"]) == 10
    fabric.save(tmp_path / "state.ckpt", {"model": model, "guard": guard})
    resumed = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=3, history=10))
    fabric.load(tmp_path / "state.ckpt", {"model": model, "guard": resumed})
    assert resumed.state_dict()["spike_history"] == learned


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sparse_gradient_is_coalesced_once_per_step_with_the_gate(dtype):
    """The gate's squares take the values the finiteness read made of a sparse gradient: one coalesce per step, as
    without a gate (it is the step's most expensive kernel: 17 ms for an embedding of 50,000 x 256); an fp16 one too,
    whose squares are not taken by the read."""
    embedding = torch.nn.Embedding(1000, 16, sparse=True).to(dtype)
    embedding(torch.tensor([[1, 2, 2, 999]])).sum().backward()
    expected = float(embedding.weight.grad.coalesce().values().double().square().sum())
    for guard in (GradientGuard(embedding), GradientGuard(embedding, spike_gate=SpikeGate())):
        guard.record(step=0)  # the first read plans the layout
        with CountOps() as ops:
            guard.record(step=1)
        assert sum(name.split(".")[0] in ("coalesce", "_coalesce") for name in ops.names) == 1, ops.names
    _, total = FlagsAndSquares()([embedding.weight.grad], torch.device("cpu"))
    assert float(total) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("weighted", [False, True])
def test_large_fp16_gradients_squares_are_summed_in_fp32_pieces(weighted):
    """fp16 on a CPU: pieces made fp32, a dot each (no square of an fp16 value overflows fp32), across piece ends."""
    torch.manual_seed(0)
    grads = [(torch.randn(3 * finiteness.PIECE_NUMEL + 17) * 200).half(), (torch.randn(64, 80) * 0.01).half(),
             torch.tensor([65504.0, -65504.0] * 3000, dtype=torch.float16)]
    each = [float(g.double().square().sum()) for g in grads]
    replicas = (2, 1, 4) if weighted else None
    flags, total = FlagsAndSquares()(grads, torch.device("cpu"), replicas=replicas)
    weights = (0.5, 1.0, 0.25) if weighted else (1.0, 1.0, 1.0)
    assert not flags.any()
    assert float(total) == pytest.approx(sum(w * e for w, e in zip(weights, each, strict=True)), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_small_gradients_read_in_batches_give_their_squares_from_the_stacked_copy(dtype):
    """Small tensors stacked and probed in chunks: each one's sum of squares is taken from the stacked copy right after
    (10,000 of them used to cost 11x a plain sum with a gate, a tensor each), weighted per gradient, exact flags."""
    torch.manual_seed(0)
    numel = 64 if dtype in (torch.bfloat16, torch.float16) else 1000
    grads = [torch.randn(numel).to(dtype) for _ in range(3 * finiteness.WORKSPACE_NUMEL // numel + 5)]  # 4 chunks
    each = [float(g.double().square().sum()) for g in grads]
    _, taken = NonFiniteCheck().read(grads, torch.device("cpu"), squares=True)
    assert taken is not None and sorted(taken.positions) == list(range(len(grads))) and taken.rest == []
    replicas = [1 + i % 3 for i in range(len(grads))]
    for weights in (None, replicas):
        flags, total = FlagsAndSquares()(grads, torch.device("cpu"), replicas=weights)
        expected = sum(e / (1 if weights is None else w) for e, w in zip(each, replicas, strict=True))
        assert not flags.any() and float(total) == pytest.approx(expected, rel=1e-5)
    grads[-2][3] = float("nan")
    flags, total = FlagsAndSquares()(grads, torch.device("cpu"))
    assert flags.tolist() == [i == len(grads) - 2 for i in range(len(grads))] and total.isnan()


def test_a_loaded_history_replaces_what_the_history_had_learned():
    # a callback reused for a next fit, resumed from a checkpoint: the checkpoint's history, not a mix of the two
    gate = SpikeGate(measures=("loss",), warmup_steps=8, history=16)
    history = _history(gate, [100.0] * 8)
    history.load_state_dict({"loss": [1.0] * 8})
    assert history.state_dict()["loss"] == [1.0] * 8
    assert judge(gate, history, _measures([50.0], first_step=9)).spikes
