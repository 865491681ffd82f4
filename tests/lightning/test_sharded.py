"""Sharded gradients on two real CPU processes (gloo): DeepSpeed ZeRO-1/2/3 and FSDP2 (``ModelParallelStrategy``).

No rank holds the whole gradient. A NaN is planted in rank 1's local gradient contribution (a hook on the first
layer's activation, before any reduction), so after the reduction it sits in rank 1's partition or shard only (see
``tests/sharded_helpers.py``). Each rank reads its own partition; the agreement makes the verdict global. Checkpoints
are directories (DeepSpeed's engine checkpoints, torch distributed checkpoints), and every invariant holds for them.

DeepSpeed runs through ``tests/deepspeed_shim.py`` (Lightning's ``DeepSpeedStrategy`` minus its CUDA checks); these
tests skip when DeepSpeed is not importable. Each strategy runs all its scenarios in one process group
(``tests/workers/sharded_worker.py``) with a 60 s collective timeout and a wall-clock timeout on top.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from sharded_helpers import APPLIED_NAN_STATE, FAULT_PARAMETERS

from conftest import OUT, TESTS, WorkerResults, deepspeed_missing, run_ranks
from helpers import rank_1_rejection, relative_paths

pytestmark = pytest.mark.multiprocess

DEEPSPEED_KINDS = ["zero1", "zero2", "zero3"]
DEEPSPEED_PARAMETERS = DEEPSPEED_KINDS  # their items are marked `deepspeed` (conftest)
KINDS = [*DEEPSPEED_KINDS, "fsdp2"]
BOUNDARIES = ["periodic", "val_topk"]

EXPECTED_REJECTION = rank_1_rejection(FAULT_PARAMETERS)
# ZeRO-3 skips every step whose global gradient norm is not finite, whatever `check_grad_overflow` says: the NaN step
# is never applied, and (with count_skipped_steps=True) the skip is what rejects. Every rank skipped it, so every rank
# is listed; the parameters still come from the partition that held the NaN (rank 1's).
EXPECTED = {
    "zero1": {**EXPECTED_REJECTION, "non_finite_state": APPLIED_NAN_STATE["deepspeed"]},
    "zero2": {**EXPECTED_REJECTION, "non_finite_state": APPLIED_NAN_STATE["deepspeed"]},
    "zero3": {**EXPECTED_REJECTION, "ranks": [0, 1], "skipped_steps": 1},  # see SKIPPED_AND_COUNTED
    "fsdp2": {**EXPECTED_REJECTION, "non_finite_state": APPLIED_NAN_STATE["fsdp2"]},
}



def results_for(kind: str, worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Every scenario of ``kind``, as each rank saw it; run once per session."""
    if kind in DEEPSPEED_KINDS and (reason := deepspeed_missing()):
        pytest.skip(reason)
    return worker_results("workers/sharded_worker.py", [kind, OUT], timeout=280).ranks


def _dirname(result: dict[str, Any]) -> str:
    return os.path.dirname(result["last_model_path"])


def _non_finite_parameters(result: dict[str, Any]) -> dict[int, int]:
    """Per rank, how many parameters' local gradients were non-finite: as the ranks the rejection names reported it,
    0 for a rank it does not name."""
    named = result["last_verdict"]["non_finite_parameters_by_named_rank"]
    return {rank: named.get(str(rank), 0) for rank in range(2)}


def _checkpoints_are_directories(tree: dict[str, Any]) -> bool:
    top = {name: entry for name, entry in tree.items() if "/" not in name}
    return bool(top) and all(entry == ["dir"] for entry in top.values())


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("kind", KINDS)
def test_nan_in_one_ranks_partition_is_rejected_on_every_rank(worker_results, kind, boundary):
    ranks = results_for(kind, worker_results)
    name = f"{boundary}-reject"
    for rank, results in enumerate(ranks):
        result = results[name]
        assert result["error"] == EXPECTED[kind], f"rank {rank}: {result['error']}"
        before = result["snapshots"]["5"]
        assert result["state"] == before["state"], f"rank {rank}: callback state changed"
        assert result["global_step"] == 6
        # agreement came first: the rejected boundary never gathered state (ZeRO-3, FSDP) or called save_checkpoint
        assert result["collections"] == before["collections"], f"rank {rank}: checkpoint collection after the fault"
        assert before["collections"].get("save_checkpoint", 0) >= 2, "the finite boundaries before the fault saved"
        # each rank read only its own partition: rank 0's gradients were finite, rank 1's held both stem parameters
        # (rank 0 is named too where the state it would write is not finite, with no parameter of its own)
        assert _non_finite_parameters(result) == {0: 0, 1: 2}, f"rank {rank}"
    rank0 = ranks[0][name]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"], "checkpoint directory tree changed"
    assert _checkpoints_are_directories(rank0["tree"]), sorted(rank0["tree"])
    # the boundary would have written a new checkpoint, moved `last` and evicted the oldest: none of it happened
    expected_top = {"periodic": {"step=2.ckpt", "step=4.ckpt"}, "val_topk": {"epoch=0.ckpt", "epoch=1.ckpt"}}[boundary]
    published = {n for n in rank0["tree"] if "/" not in n and not n.startswith(".")}  # not the retired `last`
    assert published == expected_top | {"last.ckpt"}
    if kind == "fsdp2":
        # the NaN step was applied to rank 1's shard only: rank 0's local weights are still finite
        assert [results[name]["weights_finite"] for results in ranks] == [True, False]
    if kind == "zero3":
        assert all(results[name]["weights_finite"] for results in ranks), "DeepSpeed skipped the step"


SKIPPED_AND_COUNTED = {**EXPECTED_REJECTION, "ranks": [0, 1], "skipped_steps": 1}


@pytest.mark.parametrize(
    ("kind", "scenario", "expected"),
    [
        ("zero2", "offload-reject", EXPECTED["zero2"]),  # the fp32 partition's .grad, on the CPU
        ("zero3", "offload-reject", SKIPPED_AND_COUNTED),  # ZeRO-3's gradient partitions, optimizer on the CPU
        ("zero1", "bf16-optimizer-reject", SKIPPED_AND_COUNTED),  # BF16_Optimizer (fp32 gradient accumulation)
    ],
)
def test_other_deepspeed_layouts_read_the_local_partition(worker_results, kind, scenario, expected):
    ranks = results_for(kind, worker_results)
    for rank, results in enumerate(ranks):
        result = results[scenario]
        assert result["error"] == expected, f"rank {rank}: {result['error']}"
        assert _non_finite_parameters(result) == {0: 0, 1: 2}, f"rank {rank}"
        assert result["state"] == result["snapshots"]["5"]["state"], f"rank {rank}: callback state changed"
        assert result["collections"] == result["snapshots"]["5"]["collections"], f"rank {rank}"
    rank0 = ranks[0][scenario]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"] and _checkpoints_are_directories(rank0["tree"])


@pytest.mark.parametrize("kind", KINDS)
def test_finite_control_saves_and_resumes_like_model_checkpoint(worker_results, kind):
    ranks = results_for(kind, worker_results)
    for rank, results in enumerate(ranks):
        guarded, plain = results["resume-guarded"], results["resume-plain"]
        assert guarded["error"] is None and plain["error"] is None, f"rank {rank}: {guarded['error'] or plain['error']}"
        for stage, steps in (("first", 6), ("resumed", 10)):
            g, p = guarded[stage], plain[stage]
            assert g["global_step"] == p["global_step"] == steps, f"rank {rank} {stage}"
            ours, theirs = relative_paths(g["state"], _dirname(g)), relative_paths(p["state"], _dirname(p))
            assert ours == theirs, f"rank {rank} {stage}"
            assert g["weights_finite"]
    guarded, plain = ranks[0]["resume-guarded"], ranks[0]["resume-plain"]
    for stage in ("first", "resumed"):
        assert sorted(guarded[stage]["tree"]) == sorted(plain[stage]["tree"]), stage
        assert _checkpoints_are_directories(guarded[stage]["tree"])
    # resumed from last.ckpt (a directory) at step 6: step=8 and step=10 were added, older ones evicted
    assert {n for n in guarded["resumed"]["tree"] if "/" not in n} == {"step=8.ckpt", "step=10.ckpt", "last.ckpt"}


@pytest.mark.parametrize("kind", ["zero2", "zero3"])
def test_step_skipped_by_deepspeed_is_reported_and_does_not_reject(worker_results, kind):
    # ZeRO-2 with bf16 `check_grad_overflow` on; ZeRO-3 always: DeepSpeed skips the NaN step, nothing is applied
    for rank, results in enumerate(results_for(kind, worker_results)):
        result = results["overflow-skipped"]
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        assert result["global_step"] == 8 and result["weights_finite"]
        verdict = result["verdicts"]["6"]
        # an accepted verdict holds the largest count any rank saw; that every rank saw the skip shows where it
        # rejects: `overflow-counted` below names both ranks
        assert verdict["accepted"] and verdict["skipped_steps"] == 1 and verdict["ranks"] == [], verdict
    tree = results_for(kind, worker_results)[0]["overflow-skipped"]["tree"]
    assert {n for n in tree if "/" not in n} == {"step=6.ckpt", "step=8.ckpt", "last.ckpt"}


@pytest.mark.deepspeed
def test_count_skipped_steps_rejects_a_step_deepspeed_skipped(worker_results):
    ranks = results_for("zero2", worker_results)
    errors = [results["overflow-counted"]["error"] for results in ranks]
    assert errors[0] == errors[1], "every rank raises the same error"
    assert errors[0] == SKIPPED_AND_COUNTED
    for results in ranks:
        result = results["overflow-counted"]
        assert result["state"] == result["snapshots"]["5"]["state"]
        assert result["weights_finite"], "DeepSpeed skipped the step"
    rank0 = ranks[0]["overflow-counted"]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"]


@pytest.mark.deepspeed
def test_recording_under_zero2_issues_no_collective_between_boundaries(worker_results):
    # 4 optimizer steps of 2 micro-batches each; c10d ops and host reads counted per batch, boundaries left out
    for rank, results in enumerate(results_for("zero2", worker_results)):
        guarded = results["collectives-guarded"]["ops_per_batch"]
        plain = results["collectives-plain"]["ops_per_batch"]
        assert len(guarded) == len(plain) == 8
        assert any(ops for ops in plain), "the counter sees DeepSpeed's own gradient reductions"
        assert guarded == plain, f"rank {rank}: the guard added collectives or host reads between boundaries"
        assert results["collectives-guarded"]["error"] is None
    rank0 = results_for("zero2", worker_results)[0]
    assert sorted(rank0["collectives-guarded"]["tree"]) == sorted(rank0["collectives-plain"]["tree"])


@pytest.mark.deepspeed
@pytest.mark.skipif(deepspeed_missing() is not None, reason="DeepSpeed is not installed")
def test_deepspeed_demo_shows_rejection_intact_directories_and_resume(tmp_path):
    demo = os.path.join(os.path.dirname(TESTS), "examples", "deepspeed_nan_demo.py")
    proc = run_ranks(demo, [], timeout=280, env={"CKGUARD_DEMO_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("[", "    "))]
    text = "\n".join(lines)
    assert "[1] ModelCheckpoint" in text and "step=40.ckpt/ (NaN weights)" in text
    assert "NonFiniteGradientError(ranks=(1,), steps 23-23, boundary at step 24" in text
    assert "last.ckpt/ (finite), step=16.ckpt/ (finite), step=8.ckpt/ (finite)" in text
    assert "[3] resumed from last.ckpt/ and finished at step 40" in text
    assert "NaN weights" not in lines[-1]


# ---------------------------------------------------------------------- the source itself, in one process


@pytest.mark.parametrize("kind", ["zero2", "fsdp2"])
def test_a_hook_failing_on_one_rank_before_a_sharded_save_raises_on_every_rank_and_rolls_back(worker_results, kind):
    # DeepSpeed's and FSDP2's saves start with a broadcast and are collective: under ModelCheckpoint the failing rank
    # leaves while its peer waits in them until the 60 s timeout
    ranks = results_for(kind, worker_results)
    results = [rank["val_topk-hook-fails"] for rank in ranks]
    assert results[1]["error"] == {"type": "RuntimeError", "message": "hook failed on rank 1"}
    assert results[0]["error"]["type"] == "CheckpointWriteError"
    assert "failed on rank 1: RuntimeError: hook failed on rank 1" in results[0]["error"]["message"]
    def published(tree: dict[str, Any]) -> dict[str, Any]:  # not the retired `last` the failed boundary released
        return {path: entry for path, entry in tree.items() if not path.startswith(".")}

    before = results[0]["snapshots"]["5"]
    assert published(results[0]["tree"]) == published(before["tree"]), "files changed after a failed boundary"
    assert "epoch=0.ckpt" in results[0]["tree"]  # the checkpoint it would have evicted stays
    for rank, result in enumerate(results):
        assert result["state"] == result["snapshots"]["5"]["state"], f"rank {rank}: the ledger did not roll back"
        assert result["global_step"] == 6 and result["elapsed"] < 30, f"rank {rank}: not at epoch 2's boundary, or late"
