"""No rank waits on a collective that another rank skips, and every collective takes the strategy's timeout.

Two real processes (gloo, CPU), ``workers/early_exit_worker.py``, one process group with a 20 s timeout.
"""

from __future__ import annotations

import pytest

from conftest import OUT, WorkerResults

# the module fixture launches with a 300 s wall-clock kill: let that, not pytest-timeout, stop a hang
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(330)]


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults):
    return worker_results("workers/early_exit_worker.py", [OUT], timeout=300).ranks


def test_a_monitor_key_missing_on_one_rank_after_validation_raises_on_every_rank(ranks):
    # ModelCheckpoint would send rank 1 out of its top-K check (it raises) while rank 0 goes on to save and waits
    results = [rank["missing-after-validation"] for rank in ranks]
    assert [r["error"]["type"] for r in results] == ["MisconfigurationException"] * 2, results[0]["error"]
    assert all("could not find the monitored key" in r["error"]["message"] for r in results)
    assert all(r["seconds"] < 20 for r in results), "a rank waited for the collective timeout"
    assert any("rank(s) [1]" in w for w in results[0]["warnings"]), results[0]["warnings"]
    assert results[0]["tree"] == {}  # nothing was written
    assert [r["state"]["best_k_models"] for r in results] == [{}, {}]


def test_a_monitor_key_missing_on_one_rank_in_training_warns_and_saves_nothing(ranks):
    results = [rank["missing-in-training"] for rank in ranks]
    assert [r["error"] for r in results] == [None, None], results[0]["error"] or results[1]["error"]
    assert [r["global_step"] for r in results] == [4, 4]
    assert results[0]["tree"] == {}
    assert [r["state"]["best_k_models"] for r in results] == [{}, {}]
    assert any("rank(s) [1]" in w for w in results[0]["warnings"]), results[0]["warnings"]
    assert all(r["seconds"] < 20 for r in results)


def test_the_agreement_fails_after_the_strategy_timeout_when_a_rank_never_arrives(ranks):
    zero, one = ranks[0]["straggler"], ranks[1]["straggler"]
    assert zero["error"] is not None, "rank 0 did not fail while rank 1 stalled"
    assert "agree" in zero["error"]["trace"], zero["error"]["trace"]  # it failed in the guard's agreement
    assert 20 <= zero["waited"] < 60, zero["waited"]  # the strategy's 20 s, not torch's 30 min default
    assert one["error"] is not None  # rank 1 arrived after rank 0 gave up: it fails too, instead of hanging
    assert zero["tree"] == {}
