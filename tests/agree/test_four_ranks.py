"""The rank-faulty scenarios past two ranks: four real gloo processes, NaN on rank 1 only; and, in the same launch,
the spike gate's global gradient norm under HSDP (FSDP2 with 2 replicas of 2 shards) and under tensor parallelism
(2 tensor-parallel ranks in each of 2 FSDP2 shards)."""

from __future__ import annotations

import pytest

from conftest import OUT, WorkerResults

SCENARIOS = ["ddp-periodic-reject", "zero1-val_topk-reject", "ddp-periodic-finite", "hsdp-spike-gate-norm",
             "tp-spike-gate-norm"]


# the module fixture launches with a 600 s wall-clock kill: let that, not pytest-timeout, stop a hang
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(660)]


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict]:
    return worker_results("workers/ddp_worker.py", [OUT, *SCENARIOS], timeout=600,
                          env={"CKGUARD_TEST_DEVICES": "4"}, world_size=4).ranks


@pytest.mark.parametrize("name", ["ddp-periodic-reject", "zero1-val_topk-reject"])
def test_every_one_of_four_ranks_rejects_with_the_same_error(ranks, name):
    errors = [results[name]["error"] for results in ranks]
    assert all(error == errors[0] for error in errors), errors
    assert errors[0]["ranks"] == [1] and errors[0]["first_step"] == 5
    for rank, results in enumerate(ranks):
        assert results[name]["state"] == results[name]["snapshots"]["5"]["state"], f"rank {rank}"
    rank0 = ranks[0][name]
    assert rank0["tree"] == rank0["snapshots"]["5"]["tree"] and rank0["tree"]


def test_four_finite_ranks_publish(ranks):
    assert all(results["ddp-periodic-finite"]["error"] is None for results in ranks)
    assert set(ranks[0]["ddp-periodic-finite"]["tree"]) == {f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)}


def test_the_spike_gates_norm_under_hsdp_counts_each_replicated_shard_once(ranks):
    for rank, results in enumerate(ranks):
        run = results["hsdp-spike-gate-norm"]
        measured = [step["grad_norm"] for step in run["measured"]]
        assert measured == pytest.approx(run["full"], rel=1e-5), f"rank {rank}"
        assert run["measured"] == ranks[0]["hsdp-spike-gate-norm"]["measured"]  # the same global values everywhere


def test_the_spike_gates_norm_under_tensor_parallelism_counts_a_bias_replicated_over_tp_ranks_once(ranks):
    run = ranks[0]["tp-spike-gate-norm"]
    # the row-wise layer's bias is sharded over dp and replicated over tp: held by both tp ranks of a dp rank
    assert run["placements"]["2.bias"] == ["shard", "replicate"], run["placements"]
    for rank, results in enumerate(ranks):
        run = results["tp-spike-gate-norm"]
        measured = [step["grad_norm"] for step in run["measured"]]
        assert measured == pytest.approx(run["full"], rel=1e-5), f"rank {rank}"
        assert run["measured"] == ranks[0]["tp-spike-gate-norm"]["measured"]
