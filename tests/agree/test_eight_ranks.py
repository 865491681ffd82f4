"""The agreement on eight real processes (gloo, on however few cores): a NaN on rank 1 only.

Slow on a 2-core machine (eight Lightning processes share the cores); its time against the same scenarios on two
ranks is in ``benchmarks/RESULTS.md`` (A12).
"""

from __future__ import annotations

import pytest

from conftest import OUT, WorkerResults

#: raise: rejected on every rank; skip: rejected, then the next boundary (a fresh, finite window) publishes
SCENARIOS = ["ddp-periodic-reject", "ddp-periodic-skip"]

# the module fixture launches with a 600 s wall-clock kill: let that, not pytest-timeout, stop a hang
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict]:
    return worker_results("workers/ddp_worker.py", [OUT, *SCENARIOS], timeout=600,
                          env={"CKGUARD_TEST_DEVICES": "8"}, world_size=8).ranks


def test_a_nan_on_one_of_eight_ranks_is_rejected_on_all_eight_with_the_same_error(ranks):
    name = "ddp-periodic-reject"
    errors = [results[name]["error"] for results in ranks]
    assert all(error == errors[0] for error in errors), errors
    assert errors[0]["ranks"] == [1] and errors[0]["first_step"] == 5 and errors[0]["global_step"] == 6
    assert "unnamed_ranks" not in errors[0]
    for rank, results in enumerate(ranks):
        assert results[name]["state"] == results[name]["snapshots"]["5"]["state"], f"rank {rank}"
    rank0 = ranks[0][name]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"] and rank0["tree"]


def test_after_the_rejection_a_clean_boundary_publishes_on_eight_ranks(ranks):
    name = "ddp-periodic-skip"
    assert all(results[name]["error"] is None and results[name]["global_step"] == 8 for results in ranks)
    reports = [results[name]["report"] for results in ranks]
    assert all(report == reports[0] for report in reports) and reports[0]["accepted"]
    rank0 = ranks[0][name]
    before = rank0["snapshots"]["5"]["tree"]
    assert set(before) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
    assert {k: v for k, v in rank0["tree"].items() if k in before} == before  # step 6 rejected: nothing changed
    assert set(rank0["tree"]) - set(before) == {"epoch=0-step=8.ckpt"}
