"""Two real processes (gloo), plain DDP and DDP with ZeroRedundancyOptimizer (ZeRO-1).

A NaN is written into one gradient element on rank 1 only, after DDP's all-reduce. If any rank decided alone, its
peer would wait in the next collective (ZeRO-1 consolidation, the save barrier) until the 60 s timeout, and the
scenario would report an unexpected error instead of the agreed ``NonFiniteGradientError``.

Every test runs twice, once per Lightning namespace (``tests/lightning_namespace.py``): ``[lightning]`` is
``lightning.pytorch`` with ``lightning_ckguard.FiniteGradCheckpoint``, ``[pytorch_lightning]`` is ``pytorch_lightning``
with ``lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint``. The ``ranks`` fixture launches the workers once per
namespace.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from lightning_namespace import IDS, NAMESPACES, lightning_env

from conftest import LIGHTNING_2_5, OUT, WorkerResults
from helpers import rank_1_rejection, relative_paths

OPTIMIZERS = ["ddp", "zero1"]
EXPECTED_REJECTION = rank_1_rejection(["layer.weight"])


# the module fixture launches with a 600 s wall-clock kill: let that, not pytest-timeout, stop a hang
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]


@pytest.fixture(scope="module", params=NAMESPACES, ids=[IDS[name] for name in NAMESPACES])
def ranks(request: pytest.FixtureRequest, worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Every scenario on 2 ranks, built from one Lightning namespace (one launch per namespace)."""
    results = worker_results("workers/ddp_worker.py", [OUT], timeout=600, env=lightning_env(request.param)).ranks
    for rank, rank_results in enumerate(results):  # the worker really built from the namespace the test asked for
        trainers = {r["trainer"] for r in rank_results.values() if "trainer" in r}
        assert trainers == {f"{request.param}.trainer.trainer"}, f"rank {rank} ran under {trainers}"
    return results


def _dirname(result: dict[str, Any]) -> str:
    paths = [p for p in (result["state"]["best_model_path"], result["state"]["last_model_path"]) if p]
    return os.path.dirname(paths[0]) if paths else "<none>"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("boundary", ["periodic", "val_topk", "last"])
def test_rank1_only_nan_is_rejected_on_every_rank_and_changes_nothing(ranks, optimizer, boundary):
    name = f"{optimizer}-{boundary}-reject"
    for rank, results in enumerate(ranks):
        result = results[name]
        assert result["error"] == EXPECTED_REJECTION, f"rank {rank}: {result['error']}"
        before = result["snapshots"]["5"]
        assert result["state"] == before["state"], f"rank {rank}: callback state changed"
        assert result["global_step"] == 6
        # the agreement came first: the rejected boundary never started ZeRO-1's optimizer-state consolidation
        assert result["consolidations"] == before["consolidations"], f"rank {rank}: consolidated after the fault"
    rank0 = ranks[0][name]
    # the readable report of the rejected boundary is the same value on every rank
    assert ranks[1][name]["report"] == rank0["report"]
    assert (rank0["report"]["accepted"], rank0["report"]["ranks"]) == (False, [1])
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"], "checkpoint directory changed"
    assert rank0["tree"], "the finite boundaries before the fault should have saved"
    if optimizer == "zero1":
        assert rank0["snapshots"]["5"]["consolidations"] > 0, "the finite saves before the fault consolidate"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("boundary", ["periodic", "val_topk", "last"])
def test_finite_control_saves_like_model_checkpoint(ranks, optimizer, boundary):
    for rank, results in enumerate(ranks):
        guarded, plain = results[f"{optimizer}-{boundary}-finite"], results[f"{optimizer}-{boundary}-plain"]
        assert guarded["error"] is None and plain["error"] is None, f"rank {rank}"
        assert relative_paths(guarded["state"], _dirname(guarded)) == relative_paths(plain["state"], _dirname(plain))
    guarded, plain = ranks[0][f"{optimizer}-{boundary}-finite"], ranks[0][f"{optimizer}-{boundary}-plain"]
    assert sorted(guarded["tree"]) == sorted(plain["tree"])
    assert guarded["tree"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_skip_policy_publishes_nothing_then_resumes_with_a_fresh_window(ranks, optimizer):
    for results in ranks:
        result = results[f"{optimizer}-periodic-skip"]
        assert result["error"] is None
        assert result["global_step"] == 8  # training went on
    rank0 = ranks[0][f"{optimizer}-periodic-skip"]
    before = rank0["snapshots"]["5"]["tree"]
    assert set(before) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
    # step 6 was skipped; the fresh window (steps 6-7, finite again) publishes at step 8
    assert {k: v for k, v in rank0["tree"].items() if k in before} == before
    assert set(rank0["tree"]) - set(before) == {"epoch=0-step=8.ckpt"}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_stop_policy_stops_every_rank_and_publishes_nothing(ranks, optimizer):
    for results in ranks:
        result = results[f"{optimizer}-periodic-stop"]
        assert result["error"] is None
        assert result["should_stop"] is True
        assert result["global_step"] == 6
        assert result["state"] == result["snapshots"]["5"]["state"]
    rank0 = ranks[0][f"{optimizer}-periodic-stop"]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_an_unselected_boundary_applies_the_rejection_its_vote_carried(ranks, optimizer):
    # NaN at step 3 (epoch 1); epoch 1's validation is not in the top-1 and writes nothing, but the verdict that came
    # with its top-K vote rejects: every rank raises there (global step 4), not at epoch 2's selected boundary
    for results in ranks:
        result = results[f"{optimizer}-unselected-reject"]
        assert result["error"] == {**EXPECTED_REJECTION, "first_step": 3, "last_step": 3, "global_step": 4}
        assert result["state"] == result["snapshots"]["3"]["state"]
    rank0 = ranks[0][f"{optimizer}-unselected-reject"]
    assert rank0["tree"] == rank0["snapshots"]["3"]["tree"]
    assert "epoch=0-step=2.ckpt" in rank0["tree"]  # the file it would have evicted stays


def test_a_nan_after_the_last_boundary_raises_on_every_rank_at_train_end(ranks):
    # NaN at step 6 on rank 1 only, after the last boundary (global step 6): ModelCheckpoint writes nothing more, and
    # the fit must not end as if nothing happened; every rank raises the same error at train end (global step 8)
    for results in ranks:
        result = results["ddp-trailing-reject"]
        assert result["error"] == {**EXPECTED_REJECTION, "first_step": 6, "last_step": 6, "global_step": 8}
        assert result["state"] == result["snapshots"]["6"]["state"]
    rank0 = ranks[0]["ddp-trailing-reject"]
    assert rank0["tree"] == rank0["snapshots"]["6"]["tree"]
    assert sorted(rank0["tree"]) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt"]


def test_guard_on_a_raw_process_group_reaches_the_same_verdict(ranks):
    expected = {**EXPECTED_REJECTION, "first_step": 0, "last_step": 0, "global_step": 1, "parameters": ["bias"]}
    assert [results["process-group-guard"]["error"] for results in ranks] == [expected, expected]


def test_a_state_check_that_raises_on_one_rank_raises_on_every_rank_and_the_ranks_stay_in_step(ranks):
    """Rank 1 alone cannot check its state (a tensor on the meta device): had it raised there alone, rank 0 would
    have waited in the agreement until the collective timeout. Every rank raises the same error, the failing one from
    its own, and the next agreement runs on both."""
    results = [rank_results["process-group-state-check-fails"] for rank_results in ranks]
    cause = "NotImplementedError: Cannot copy out of meta tensor; no data!"
    for rank, result in enumerate(results):
        assert result["error"]["ranks"] == [1] and result["error"]["global_step"] == 1
        assert result["error"]["cause"] == cause
        assert "rank 1" in result["error"]["message"] and "global step 1" in result["error"]["message"]
        assert result["error"]["raised_from"] == ("NotImplementedError" if rank == 1 else "NoneType")
        assert result["next_agreement_accepted"] is True
    assert results[0]["error"]["message"] == results[1]["error"]["message"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_manual_save_is_agreed_before_any_checkpoint_collection(ranks, optimizer):
    # epoch 0 (steps 0-1) is saved by hand; the NaN at step 3 is in epoch 1, whose manual save must be refused
    for rank, results in enumerate(ranks):
        result = results[f"{optimizer}-manual-reject"]
        assert result["error"] == {**EXPECTED_REJECTION, "first_step": 3, "last_step": 3, "global_step": 4}
        assert result["consolidations"] == result["snapshots"]["3"]["consolidations"], f"rank {rank}"
    rank0 = ranks[0][f"{optimizer}-manual-reject"]
    assert set(rank0["tree"]) == {"manual-0.ckpt"} and rank0["tree"] == rank0["snapshots"]["3"]["tree"]


def test_nan_in_a_no_sync_micro_batch_on_one_rank_is_rejected_on_every_rank(ranks):
    # rank 1's NaN stays local under no_sync, then the last micro-batch's all-reduce carries it to both ranks
    errors = [results["ddp-accumulate-reject"]["error"] for results in ranks]
    expected = {**EXPECTED_REJECTION, "ranks": [0, 1], "first_step": 2, "last_step": 2, "global_step": 4}
    assert errors == [expected, expected]
    for results in ranks:
        result = results["ddp-accumulate-reject"]
        assert result["state"] == result["snapshots"]["2"]["state"]
    rank0 = ranks[0]["ddp-accumulate-reject"]
    assert set(rank0["tree"]) == {"epoch=0-step=2.ckpt"} and rank0["tree"] == rank0["snapshots"]["2"]["tree"]


@pytest.mark.skipif(LIGHTNING_2_5, reason="Lightning 2.5 has no EMAWeightAveraging")
def test_ema_best_boundary_is_guarded_on_every_rank(ranks):
    for rank, results in enumerate(ranks):
        result = results["ddp-ema_best-reject"]
        assert result["error"] == EXPECTED_REJECTION, f"rank {rank}: {result['error']}"
        assert result["state"] == result["snapshots"]["5"]["state"]
        assert results["ddp-ema_best-finite"]["error"] is None
    rank0 = ranks[0]["ddp-ema_best-reject"]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"]
    assert set(rank0["tree"]) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"}
    assert set(ranks[0]["ddp-ema_best-finite"]["tree"]) == {"epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"}


def assert_rank_0_failed_and_every_rank_rolled_back(ranks: list[dict[str, Any]], scenario: str, own: str,
                                                   told: str, failing: int = 0, own_type: str = "OSError") -> None:
    """Rank ``failing`` raised its own error (``own_type``, ``own`` in its message), the other rank a
    ``CheckpointWriteError`` naming it (and ``told``); every rank's ledger, and rank 0's files, are what they were
    before epoch 1's boundary, with the checkpoint it would have evicted still there."""
    errors = [results[scenario]["error"] for results in ranks]
    assert errors[failing]["type"] == own_type and own in errors[failing]["message"]
    assert errors[1 - failing]["type"] == "CheckpointWriteError"
    assert f"failed on rank {failing}" in errors[1 - failing]["message"] and told in errors[1 - failing]["message"]
    for rank, results in enumerate(ranks):
        result = results[scenario]
        assert result["state"] == result["snapshots"]["3"]["state"], f"rank {rank}: the ledger did not roll back"
    rank0 = ranks[0][scenario]
    assert rank0["tree"] == rank0["snapshots"]["3"]["tree"]
    assert "epoch=0-step=2.ckpt" in rank0["tree"]  # the file it would have evicted stays


def test_a_write_failing_on_rank_0_raises_on_every_rank_and_rolls_back(ranks):
    # rank 0 alone writes under DDP; its full disk must not leave rank 1 waiting in the post-save barrier
    assert_rank_0_failed_and_every_rank_rolled_back(ranks, "ddp-val_topk-write-fails", "No space left", "No space left")


def test_a_move_refused_on_rank_0_raises_on_every_rank_at_the_next_boundary_and_rolls_back(ranks):
    # rank 0 renames after the boundary's last collective: its failure is held, rides in the next agreement, and
    # every rank raises there; nothing of the failed boundary is left, nothing was evicted
    assert_rank_0_failed_and_every_rank_rolled_back(ranks, "ddp-val_topk-move-fails", "injected", "epoch=1")
    for rank, results in enumerate(ranks):
        global_step = results["ddp-val_topk-move-fails"]["global_step"]
        assert global_step == 6, f"rank {rank}: raised at the next boundary (epoch 2), not elsewhere"


@pytest.mark.parametrize("scenario, failing", [("ddp-val_topk-hook-fails", 1), ("zero1-val_topk-hook-fails", 0)])
def test_a_hook_failing_on_one_rank_before_the_write_raises_on_every_rank_and_rolls_back(ranks, scenario, failing):
    # under ModelCheckpoint the failing rank leaves the save while its peer waits in the next collective (the
    # post-save barrier; under ZeRO-1 the optimizer-state consolidation) until the 60 s timeout
    assert_rank_0_failed_and_every_rank_rolled_back(ranks, scenario, f"hook failed on rank {failing}", "epoch=1",
                                                    failing=failing, own_type="RuntimeError")
    for rank, results in enumerate(ranks):
        assert results[scenario]["global_step"] == 4, f"rank {rank}: raised at epoch 1's boundary"
        assert results[scenario]["elapsed"] < 30, f"rank {rank} waited for a timeout"
