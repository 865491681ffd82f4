"""The spike gate (``FiniteGradCheckpoint(spike_gate=SpikeGate(...))``, issue 28) on two real CPU processes: DDP
(replicated gradients), FSDP2 (DTensor shards) and DeepSpeed ZeRO-2 (flat-buffer partitions, bf16-mixed).

A regression model trains on per-rank batches that are a deterministic function of the rank and the batch index; at
step 5 rank 1's targets are multiplied by 1e3, so rank 1 alone sees a huge but finite loss and gradient. A checkpoint
every step makes each window one step; the gate (``SpikeGate(warmup_steps=3, history=50)``) has learned steps 0 to 4
by then. One process group per strategy runs every scenario (``tests/workers/spike_gate_worker.py``):

- with ``on_non_finite="raise"`` every rank raises the same error at global step 6, naming step 5 for the loss and
  the gradient norm and no rank, and nothing of that boundary is published;
- with ``on_non_finite="rewind"`` every rank goes back to ``step=5.ckpt`` and trains on with batch 6: every later
  checkpoint, and the final weights, are those of a run whose data never held batch 5 (one global step earlier);
- the loss and gradient norm the gate judges are the global ones: the same as a replay of the same steps in one
  process on the concatenated global batches, as the full (gathered) gradients' ``clip_grad_norm_`` (under DeepSpeed,
  as DeepSpeed's own global norm), and the same under DDP and FSDP2.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import pytest
import torch

from conftest import OUT, WorkerResults, deepspeed_missing

pytestmark = pytest.mark.multiprocess

DEEPSPEED_PARAMETERS = ["ds2"]  # their items are marked `deepspeed` (conftest)
FP32_KINDS = ["ddp", "fsdp2"]
KINDS = [*FP32_KINDS, *DEEPSPEED_PARAMETERS]
SPIKE_STEP = 5  # as in the worker: rank 1's targets times 1e3 at this step (and batch index)
STEPS = 10  # the spiked runs' max_steps; the reference, without batch 5, stops at 9
CHECKPOINTS = [f"step={n}.ckpt" for n in range(1, SPIKE_STEP + 1)]  # published before the spike's boundary
TOLERANCE: dict[str, Any] = dict(rtol=1e-5, atol=1e-6)  # float32 training, the same steps reduced in another order
NORM_TOLERANCE: dict[str, Any] = dict(rtol=1e-5, atol=0.0)
#: the gate's values against a float32 replay in one process: bf16-mixed (``ds2``) computes in bf16
REPLAY_TOLERANCE: dict[str, dict[str, Any]] = {"ddp": NORM_TOLERANCE, "fsdp2": NORM_TOLERANCE,
                                               "ds2": dict(rtol=2e-2, atol=0.0)}
#: the gate's norm against DeepSpeed's: on the CPU the gate takes a bf16 gradient's norm in bf16 (``squares.py``)
DEEPSPEED_NORM_TOLERANCE: dict[str, Any] = dict(rtol=5e-3, atol=0.0)


def results_for(kind: str, worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Every scenario of ``kind``, as each rank saw it; run once per session."""
    if kind in DEEPSPEED_PARAMETERS and (reason := deepspeed_missing()):
        pytest.skip(reason)
    return worker_results("workers/spike_gate_worker.py", [kind, OUT], timeout=150).ranks


def _close(actual: Any, expected: Any, where: str, tolerance: dict[str, Any] = TOLERANCE) -> None:
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               **tolerance, msg=lambda message: f"{where}: {message}")


def _assert_same_weights(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert sorted(actual) == sorted(expected), where
    for name in expected:
        _close(actual[name], expected[name], f"{where}, {name}")


def _gate_values(result: dict[str, Any], measure: str) -> list[float]:
    """What the gate measured at boundaries 1, 2, ...: with one-step windows, steps 0, 1, ..."""
    verdicts = result["verdicts"]
    return [verdicts[str(boundary)]["levels"][measure] for boundary in range(1, len(verdicts) + 1)]


def _assert_spikes_at_the_bad_step(spikes: list[dict[str, Any]], replayed: dict[str, float], kind: str) -> None:
    assert [s["measure"] for s in spikes] == ["loss", "grad_norm"], f"{kind}: {spikes}"
    for spike in spikes:
        assert (spike["first_step"], spike["last_step"]) == (SPIKE_STEP, SPIKE_STEP), f"{kind}: {spike}"
        assert spike["ratio"] > 10 and spike["deviations"] > 20, f"{kind}: {spike}"
        # the global value: the mean loss over the ranks, the norm of every rank's gradients (not rank 1's own)
        _close(spike["value"], replayed[spike["measure"]], f"{kind}, {spike['measure']} value",
               REPLAY_TOLERANCE[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_finite_spike_on_rank_1_rejects_the_boundary_on_every_rank_with_the_same_report(worker_results, kind):
    ranks = results_for(kind, worker_results)
    errors = [results["raise"]["error"] for results in ranks]
    assert errors[0] == errors[1], "every rank raises the same error"
    error = errors[0]
    assert all(results["raise"]["error_type"] == "NonFiniteGradientError" for results in ranks), errors
    # no rank is named: the values are global; nothing was non-finite
    assert {k: error[k] for k in ("ranks", "parameters", "num_steps", "first_step", "global_step",
                                  "non_finite_state")} == {"ranks": [], "parameters": [], "num_steps": 0,
                                                           "first_step": -1, "global_step": SPIKE_STEP + 1,
                                                           "non_finite_state": []}
    _assert_spikes_at_the_bad_step(error["spikes"], ranks[0]["raise"]["replay"][SPIKE_STEP], kind)
    for spike in error["spikes"]:  # the baseline: the median of the accepted steps before it, 0 to 4
        history = _gate_values(ranks[0]["raise"], spike["measure"])[:SPIKE_STEP]
        assert spike["baseline"] == statistics.median(history), f"{kind}: {spike}, {history}"
    for rank, results in enumerate(ranks):
        result = results["raise"]
        report = result["last_report"]
        assert not report["accepted"] and report["ranks"] == [] and report["global_step"] == SPIKE_STEP + 1
        assert report["spikes"] == error["spikes"], f"rank {rank}: the report and the error say the same"
        assert result["global_step"] == SPIKE_STEP + 1, f"rank {rank}"
        accepted = {int(step): v["accepted"] for step, v in result["verdicts"].items()}
        assert accepted == {**{n: True for n in range(1, SPIKE_STEP + 1)}, SPIKE_STEP + 1: False}, f"rank {rank}"
        # nothing published at the rejected boundary: the top-K holds what was before it
        directory = os.path.dirname(next(iter(result["state"]["best_k_models"])))
        assert sorted(os.path.relpath(p, directory) for p in result["state"]["best_k_models"]) == sorted(CHECKPOINTS)
    assert ranks[0]["raise"]["entries"] == sorted(CHECKPOINTS), "no file of the rejected boundary on disk"


@pytest.mark.parametrize("kind", KINDS)
def test_a_rewind_past_the_spike_trains_on_as_if_the_bad_batch_never_came(worker_results, kind):
    ranks = results_for(kind, worker_results)
    rewinds = [results["rewind"]["rewinds"] for results in ranks]
    assert rewinds[0] == rewinds[1], "every rank records the same rewind"
    assert len(rewinds[0]) == 1, rewinds[0]
    rewind = rewinds[0][0]
    assert os.path.basename(rewind["checkpoint"]) == f"step={SPIKE_STEP}.ckpt"
    assert {k: rewind[k] for k in ("global_step", "checkpoint_global_step", "discarded_steps", "skipped_batches",
                                   "ranks", "num_steps")} == {
        "global_step": SPIKE_STEP + 1, "checkpoint_global_step": SPIKE_STEP,
        "discarded_steps": [SPIKE_STEP, SPIKE_STEP], "skipped_batches": [SPIKE_STEP, SPIKE_STEP], "ranks": [],
        "num_steps": 0}
    _assert_spikes_at_the_bad_step(rewind["spikes"], ranks[0]["raise"]["replay"][SPIKE_STEP], kind)
    for rank, results in enumerate(ranks):
        result, reference = results["rewind"], results["reference"]
        assert result["error"] is None and reference["error"] is None, f"rank {rank}: {result['error']}"
        assert result["global_step"] == STEPS and reference["global_step"] == STEPS - 1, f"rank {rank}"
        # the rewound run's weights are the reference's, which never saw batch 5
        _assert_same_weights(result["weights"], reference["weights"], f"{kind}, rank {rank}, final weights")
        # and the gate measured the same steps after the rewind as the reference did
        for measure in ("loss", "grad_norm"):
            after = _gate_values(result, measure)[SPIKE_STEP + 1:]
            _close(after, _gate_values(reference, measure)[SPIKE_STEP:], f"{kind}, rank {rank}, {measure}")
    rewound, reference = ranks[0]["rewind"], ranks[0]["reference"]
    assert rewound["entries"] == sorted(["ckguard-rewinds.jsonl", *CHECKPOINTS,
                                         *(f"step={n}.ckpt" for n in range(SPIKE_STEP + 2, STEPS + 1))])
    # every checkpoint on disk, read back: before the spike the same files, after it one global step later
    for n in range(1, STEPS):
        published = f"step={n if n <= SPIKE_STEP else n + 1}.ckpt"
        _assert_same_weights(rewound["files"][published], reference["files"][f"step={n}.ckpt"],
                             f"{kind}: {published} against the reference's step={n}.ckpt")
    _assert_same_weights(rewound["files"][f"step={STEPS}.ckpt"], rewound["weights"], f"{kind}: the last file")
    # a test that can fail: the update of the spiked step, had it stayed, moved the weights well past the tolerance
    applied, before = ranks[0]["raise"]["weights"], reference["files"][f"step={SPIKE_STEP}.ckpt"]
    with pytest.raises(AssertionError):
        _assert_same_weights(applied, before, "the spiked update")


@pytest.mark.parametrize("kind", KINDS)
def test_the_gate_judges_the_global_loss_and_the_norm_of_the_full_gradients(worker_results, kind):
    ranks = results_for(kind, worker_results)
    for scenario in ("reference", "raise"):
        gate = {measure: _gate_values(ranks[0][scenario], measure) for measure in ("loss", "grad_norm")}
        for rank, results in enumerate(ranks):
            result = results[scenario]
            where = f"{kind}, {scenario}, rank {rank}"
            assert {m: _gate_values(result, m) for m in gate} == gate, f"{where}: every rank judges the same values"
            # the gate's norm (shard squares summed, or replicated squares once) against the full gradients'
            steps = range(len(gate["grad_norm"]))
            if kind in DEEPSPEED_PARAMETERS:
                deepspeed = [result["deepspeed_norms"][str(step)] for step in steps]
                _close(gate["grad_norm"], deepspeed, f"{where}: against DeepSpeed's global norm",
                       DEEPSPEED_NORM_TOLERANCE)
            else:
                unsharded = [result["unsharded_norms"][str(step)] for step in steps]
                _close(gate["grad_norm"], unsharded, f"{where}: against clip_grad_norm_ of the gathered gradients",
                       NORM_TOLERANCE)
            # and against one process training on the concatenated global batches, with no distribution at all
            replayed = result["replay"]
            assert len(replayed) == len(gate["grad_norm"]), where
            for measure in gate:
                _close(gate[measure], [step[measure] for step in replayed], f"{where}: {measure} of the replay",
                       REPLAY_TOLERANCE[kind])


def test_replicated_and_sharded_gradients_give_the_gate_the_same_values(worker_results):
    ddp, fsdp2 = (results_for(kind, worker_results)[0] for kind in FP32_KINDS)
    for scenario in ("reference", "rewind", "raise"):
        for measure in ("loss", "grad_norm"):
            _close(_gate_values(fsdp2[scenario], measure), _gate_values(ddp[scenario], measure),
                   f"{scenario}, {measure}: FSDP2 against DDP", NORM_TOLERANCE)


#: as in the worker's ``negative-loss`` scenario: rank r gives each of these plus 0.1 * r
NEGATIVE_LOSSES = [-2.0, -1.5, -1.8, -1.7, -1.6, 0.5]


def test_the_gate_reads_negative_losses_as_they_are(worker_results):
    # a slot starts at 0: a step's loss once went in as max(0, loss), a negative one as 0, before the sum
    # (the first positive loss after a negative baseline of 0 then spiked)
    ranks = results_for("ddp", worker_results)
    steps = [results["negative-loss"]["steps"] for results in ranks]
    assert steps[0] == steps[1], "every rank reads the same"
    expected = [loss + 0.05 for loss in NEGATIVE_LOSSES]  # the mean over the two ranks
    _close([step["loss"] for step in steps[0]], expected, "the global loss of each step", NORM_TOLERANCE)
    # from about -1.7 to 0.55 is no spike: the value is not 10 times the (negative) baseline
    assert all(step["accepted"] and not step["spikes"] for step in steps[0]), steps[0]



@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_fit_keeps_the_gates_baseline_from_its_first_step(worker_results, kind):
    # FSDP2 and DeepSpeed restore the checkpoint after setup: the callback's state arrives after the guard is made
    for results in results_for(kind, worker_results):
        first, resumed = results["resume"]["fits"]
        assert first == {"error": None, "at_first_batch": 0, "at_end": 4}, first
        assert resumed == {"error": None, "at_first_batch": 4, "at_end": 6}, resumed


def test_ranks_whose_gates_or_windows_differ_reach_the_same_outcome(worker_results):
    # a history loaded on rank 0 only: each rank would judge against its own baseline, rank 0 rejecting the spike
    # and rank 1 accepting it (and waiting alone in its next collective); a window one slot shorter on rank 0 (its
    # step not recorded there): the slots every rank holds are judged, the same on every rank
    outcomes = [results["unlike-gates"]["outcomes"] for results in results_for("ddp", worker_results)]
    assert outcomes[0] == outcomes[1], "every rank the same"
    history, window, folded = outcomes[0]
    assert history["misuse"] == "history loaded on rank 0" and "accepted history differs between ranks" in (
        history["error"] or ""), history
    assert "at global step 2" in history["error"] and "on every rank alike" in history["error"]
    assert window["misuse"] == "window reset on rank 0" and window["error"] is None and window["accepted"], window
    # the one slot both hold: rank 0's step 1 (loss 1e4) and rank 1's step 0 (loss 1), averaged
    assert window["window_max"][0] == pytest.approx((1e4 + 1.0) / 2), window
    # a step more on rank 1 folds its two slots, not rank 0's: slot 0 would add rank 0's step 0 to rank 1's steps 0-1
    assert folded["misuse"] == "a step more on rank 1, folded" and "folded differently" in (folded["error"] or ""), (
        folded)


def test_a_vote_that_finds_the_monitored_key_missing_teaches_the_gate_nothing(worker_results):
    # each due boundary's vote is an agreement with peers: the window it accepted was never published, and is not
    # learned (by the callback's state at the fit's end either)
    for results in results_for("ddp", worker_results):
        result = results["unlogged-monitor"]
        assert result["error"] is None and result["entries"] == []
        assert result["history"] == {"loss": 0, "grad_norm": 0}, result["history"]
        assert result["state_checks"] == 0, "a pass over the state for a boundary that cannot write one"


def test_a_write_after_votes_that_found_the_key_missing_checks_every_ranks_state(worker_results):
    # `last` at train end, after votes that left the state out: its own agreement checks the NaN buffer, on every rank
    for results in results_for("ddp", worker_results):
        result = results["unlogged-monitor-last"]
        assert result["error_type"] == "NonFiniteGradientError", result["error"]
        assert result["error"]["non_finite_state"], result["error"]
        assert result["entries"] == []
