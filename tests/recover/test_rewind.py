"""``on_non_finite="rewind"`` on two real CPU processes: DDP, DDP + ZeRO-1, DeepSpeed ZeRO-1/2/3, FSDP2.

A NaN reaches rank 1 only, at steps 3, 7 and 11 (a checkpoint every 2 steps, top 2 by step plus ``last``); each
following boundary is rejected and every rank goes back, in place, to the checkpoint published 2 steps earlier. Right
after each rewind every rank compares its own weights and optimizer state, tensor by tensor, with what the file holds
(``tests/rewind_helpers.py``). A resumed fit then counts ``max_rewinds`` from zero. One process group per strategy
runs all its scenarios (``tests/workers/rewind_worker.py``), with 60 s collective timeouts. Under DeepSpeed ZeRO-2, a
rewind between the two micro-batches of a step (gradient accumulation) also drops what DeepSpeed's optimizer already
reduced of the first one.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from conftest import OUT, TESTS, WorkerResults, deepspeed_missing, run_ranks

pytestmark = pytest.mark.multiprocess

DEEPSPEED_KINDS = ["ds1", "ds2", "ds3"]
DEEPSPEED_PARAMETERS = DEEPSPEED_KINDS  # their items are marked `deepspeed` (conftest)
KINDS = ["ddp", "zero1", *DEEPSPEED_KINDS, "fsdp2"]
DEMO = os.path.join(os.path.dirname(TESTS), "examples", "rewind_demo.py")



def results_for(kind: str, worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Every scenario of ``kind``, as each rank saw it; run once per session."""
    if kind in DEEPSPEED_KINDS and (reason := deepspeed_missing()):
        pytest.skip(reason)
    return worker_results("workers/rewind_worker.py", [kind, OUT], timeout=280).ranks


def _fault(kind: str, step: int) -> dict[str, Any]:
    """What the rejection at ``step + 1`` reports: rank 1's NaN; under ZeRO-3 every rank skipped the step."""
    return {"ranks": [0, 1] if kind == "ds3" else [1], "first_step": step, "last_step": step, "num_steps": 1,
            "skipped_steps": 1 if kind == "ds3" else 0}


def _assert_restored(check: dict[str, Any], kind: str, where: str) -> None:
    for part in ("weights", "optimizer"):
        comparison = check[part]
        assert comparison["compared"] >= 1, f"{where}: no {part} tensors compared: {comparison}"
        assert not comparison["different"] and not comparison["missing"], f"{where}: {part} differ: {comparison}"
    if kind in ("ddp", "zero1"):
        assert check["schedulers"] == [True], f"{where}: the LR scheduler was not restored"
    if kind == "ddp":
        average = check["average"]
        assert average["compared"] >= 2 and not average["different"] and not average["missing"], where
    assert check["weights_finite"], f"{where}: weights not finite after the rewind"


@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_rewinds_in_place_to_the_checkpoint_it_published(worker_results, kind):
    ranks = results_for(kind, worker_results)
    for rank, results in enumerate(ranks):
        result = results["rewinds"]
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        assert [c["global_step"] for c in result["checks"]] == [4, 8, 12], f"rank {rank}"
        for check in result["checks"]:
            _assert_restored(check, kind, f"rank {rank}, after the rewind at step {check['global_step']}")
        rewinds = result["rewinds"]
        directory = os.path.dirname(result["last_model_path"])
        assert [os.path.relpath(r["checkpoint"], directory) for r in rewinds] == [
            "step=2.ckpt", "step=6.ckpt", "step=10.ckpt"]
        assert [r["discarded_steps"] for r in rewinds] == [[2, 3], [6, 7], [10, 11]]
        assert [r["skipped_batches"] for r in rewinds] == [[2, 3], [6, 7], [10, 11]]
        for rewind, fault_step in zip(rewinds, (3, 7, 11), strict=True):
            assert {k: rewind[k] for k in _fault(kind, fault_step)} == _fault(kind, fault_step)
    assert ranks[0]["rewinds"]["rewinds"] == ranks[1]["rewinds"]["rewinds"], "every rank records the same rewinds"
    rank0, rank1 = ranks[0]["rewinds"], ranks[1]["rewinds"]
    # rank 0 warns (report, checkpoint, skipped range), logs the count and appends one JSON line per rewind
    assert len(rank0["warnings"]) == 3 and not rank1["warnings"]
    assert all("went back to" in w and "skipping batches" in w and "rank(s) " in w for w in rank0["warnings"])
    # riding in the same batch's flush of Lightning's, logged at its `_batches_that_stepped` (the global step less one)
    assert rank0["logged_rewinds"] == [[3, 1.0], [7, 2.0], [11, 3.0]]
    assert rank0["rewind_log"] == rank0["rewinds"]


@pytest.mark.parametrize("kind", KINDS)
def test_training_goes_on_to_max_steps_and_everything_published_is_finite(worker_results, kind):
    ranks = results_for(kind, worker_results)
    for rank, results in enumerate(ranks):
        result = results["rewinds"]
        assert result["global_step"] == 14, f"rank {rank}: global_step counts on through the rewinds"
        assert result["weights_finite"], f"rank {rank}"
    rank0 = ranks[0]["rewinds"]
    directory = os.path.dirname(rank0["last_model_path"])
    # the rejected boundaries at 4, 8 and 12 published nothing; 10 and 14 are the top 2, `last` is step 14's
    assert rank0["entries"] == ["ckguard-rewinds.jsonl", "last.ckpt", "step=10.ckpt", "step=14.ckpt"]
    assert rank0["finite"] == {"last.ckpt": True, "step=10.ckpt": True, "step=14.ckpt": True}
    for results in ranks:
        best = {os.path.relpath(p, directory) for p in results["rewinds"]["state"]["best_k_models"]}
        assert best == {"step=10.ckpt", "step=14.ckpt"}, "best_k_models and the files on disk agree"


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_fit_counts_from_zero_and_the_next_fault_raises_with_the_history(worker_results, kind):
    ranks = results_for(kind, worker_results)
    errors = [results["resumed"]["error"] for results in ranks]
    assert errors[0] == errors[1], "every rank raises the same error"
    error = errors[0]
    for rank, results in enumerate(ranks):
        result = results["resumed"]
        assert result["error_type"] == "RewindRefusedError", f"rank {rank}: {result['error']}"
        # the earlier fit made 3 rewinds; this one, with max_rewinds=1, still rewinds once
        assert [c["global_step"] for c in result["checks"]] == [18], f"rank {rank}"
        _assert_restored(result["checks"][0], kind, f"rank {rank}, resumed fit")
        assert result["global_step"] == 20
    assert {k: error[k] for k in _fault(kind, 19)} == _fault(kind, 19) and error["global_step"] == 20
    assert "`max_rewinds=1`" in error["reason"]
    assert len(error["rewinds"]) == 1 and "step=16.ckpt" in error["rewinds"][0], error["rewinds"]
    assert "(1) rewind 1 at global step 18" in ranks[1]["resumed"]["message"]


def test_a_zero2_rewind_between_micro_batches_drops_what_deepspeed_reduced_of_the_first(worker_results):
    # batch 8, the first micro-batch of step 4, backpropagated through step 3's NaN weights; the boundary after it
    # rewinds. Kept in ZeRO-2's buffers, its NaN would join step 4: a second rejection at step 6, refused
    ranks = results_for("ds2", worker_results)
    for rank, results in enumerate(ranks):
        result = results["accumulation"]
        assert result["error"] is None, f"rank {rank}: {result['error']}"
        (rewind,) = result["rewinds"]
        assert (rewind["boundary"], rewind["global_step"], os.path.basename(rewind["checkpoint"])) == (
            "validation end", 4, "step=3.ckpt"), f"rank {rank}"
        assert result["held_after_rewind"] == [[]], f"rank {rank}: the optimizer kept {result['held_after_rewind']}"
        assert result["global_step"] == 6 and result["weights_finite"], f"rank {rank}"
        # DeepSpeed's engine counts micro-steps on through the rewind, as Lightning counts batches: same boundaries
        assert result["disagreements"] == [], f"rank {rank}"
    assert ranks[0]["accumulation"]["finite"] == {"step=1.ckpt": True, "step=3.ckpt": True, "step=6.ckpt": True}


def test_a_fault_before_any_published_checkpoint_raises_on_every_rank(worker_results):
    ranks = results_for("ddp", worker_results)
    errors = [results["no-checkpoint"]["error"] for results in ranks]
    assert errors[0] == errors[1]
    assert errors[0]["reason"] == "no checkpoint was published in this fit yet, so there is nothing to go back to"
    assert errors[0]["rewinds"] == [] and errors[0]["global_step"] == 2
    assert all(results["no-checkpoint"]["error_type"] == "RewindRefusedError" for results in ranks)
    assert ranks[0]["no-checkpoint"]["entries"] == [], "nothing was written"


def test_rewind_demo_recovers_in_place_and_finishes_finite(tmp_path):
    proc = run_ranks(DEMO, [], timeout=200, env={"CKGUARD_DEMO_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("[", "    "))]
    text = "\n".join(lines)
    assert "[1] rank 1 sees a NaN at step 11" in text, text
    assert "[2] rewound in place to step=10.ckpt (global step 10)" in text, text
    assert "[3] finished at global step 24 with finite weights on every rank" in text, text
    assert lines[-1] == "    last.ckpt (finite), step=10.ckpt (finite), step=20.ckpt (finite)", lines[-1]
    assert "NaN" not in lines[-1], lines[-1]
