"""Two real processes (gloo, DDP) with ``dirpath`` on a real S3-compatible server (the ``s3`` fixture's moto server,
reached by s3fs in every rank through the environment): a NaN on rank 1 only is rejected on every rank with the
bucket unchanged, and ``ckpt_path="last"`` then resumes on every rank from the last good checkpoint; an upload the
server refuses, or never answers, raises on every rank, rolls the ledger back and leaves the evicted checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import OUT, WorkerResults

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ranks(s3: Any, worker_results: WorkerResults) -> list[dict[str, Any]]:
    bucket = s3.new_bucket("ckguard-ddp")
    return worker_results("workers/object_storage_ddp_worker.py", [OUT, bucket], timeout=240,
                          env={"CKGUARD_TEST_S3_PID": str(s3.process.pid)}).ranks


def test_a_nan_on_rank_1_is_rejected_on_every_rank_the_bucket_is_unchanged_and_last_resumes(ranks):
    for rank, results in enumerate(ranks):
        rejected = results["nan-then-resume-last"]["rejected"]
        assert rejected["error"]["ranks"] == [1] and rejected["error"]["global_step"] == 6, f"rank {rank}"
        assert rejected["state"] == rejected["before"]["state"], f"rank {rank}: the ledger changed"
    rejected = ranks[0]["nan-then-resume-last"]["rejected"]
    assert set(rejected["bucket"]) == {"epoch=0-step=4.ckpt", "last.ckpt"}
    assert rejected["bucket"] == rejected["before"]["bucket"], "the bucket changed (keys, ETags or sizes)"

    for rank, results in enumerate(ranks):
        resumed = results["nan-then-resume-last"]["resumed"]
        assert resumed["error"] is None, f"rank {rank}: {resumed['error']}"
        assert resumed["ckpt_path"].startswith("s3://") and resumed["ckpt_path"].endswith("/nan/last.ckpt"), rank
        assert resumed["global_step"] == 8, f"rank {rank}"
    resumed = ranks[0]["nan-then-resume-last"]["resumed"]
    assert set(resumed["bucket"]) == {"epoch=0-step=8.ckpt", "last.ckpt"}  # resumed at 4, not restarted at 0


def test_an_upload_the_server_refuses_raises_on_every_rank_and_keeps_the_evicted_checkpoint(ranks):
    errors = [results["refused-upload"]["error"] for results in ranks]
    assert errors[0]["type"] == "OSError" and "smaller than the minimum allowed" in errors[0]["message"], errors[0]
    assert_rolled_back_on_every_rank_keeping_the_evicted_checkpoint(ranks, "refused-upload")


def test_an_upload_the_server_never_answers_raises_on_every_rank_and_keeps_the_evicted_checkpoint(ranks):
    errors = [results["server-stops-answering"]["error"] for results in ranks]
    assert "unexpected" not in errors[0] and "timeout" in errors[0]["message"].lower(), errors[0]
    assert_rolled_back_on_every_rank_keeping_the_evicted_checkpoint(ranks, "server-stops-answering")


def assert_rolled_back_on_every_rank_keeping_the_evicted_checkpoint(ranks, scenario: str) -> None:
    """Rank 0's upload at step 6 failed: rank 1 raised ``CheckpointWriteError`` naming rank 0, every rank's ledger is
    the one before, and the bucket still holds what step 6's save would have evicted."""
    assert ranks[1][scenario]["error"]["type"] == "CheckpointWriteError", ranks[1][scenario]["error"]
    assert "failed on rank 0" in ranks[1][scenario]["error"]["message"], ranks[1][scenario]["error"]
    for rank, results in enumerate(ranks):
        result = results[scenario]
        assert result["global_step"] == 6, f"rank {rank}"
        assert result["state"] == result["before"]["state"], f"rank {rank}: the ledger did not roll back"
    result = ranks[0][scenario]
    assert set(result["bucket"]) == {"epoch=0-step=4.ckpt", "last.ckpt"}  # step 6's save would have evicted step 4's
    assert result["bucket"] == result["before"]["bucket"]
