"""What someone else sees while a two-rank run (gloo, CPU) publishes, and background writes under DDP.

A separate process polls ``last.ckpt`` and the best checkpoint in a tight loop while training saves at every step,
200 times (``workers/poll_last.py``, started by rank 0 of ``workers/publication_readers_worker.py``): single files under
DDP (with ``$TMPDIR`` on another filesystem, where fsspec copies its temporary file into place), directories under
DeepSpeed ZeRO-2 and FSDP2. With ``FiniteGradCheckpoint`` it never finds ``last.ckpt`` absent, partial or failing to
load; plain ``ModelCheckpoint`` is the control, and what it shows is asserted too (counts in benchmarks/RESULTS.md).

``AsyncCheckpointIO`` under DDP: only rank 0 writes, in the background; its failure raises on both ranks at the same
boundary, the ledger back to what is on disk.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from conftest import OUT, WorkerResults, deepspeed_missing
from helpers import cross_device_tmpdir_or_skip

pytestmark = pytest.mark.multiprocess
DEEPSPEED_PARAMETERS = {"ds2"}  # their items are marked `deepspeed` (conftest)
SCENARIOS = {
    "ddp": ["reader", "reader-plain", "async-fail-next", "async-fail-end", "async-ok"],
    "ds2": ["reader", "reader-plain"],
    "fsdp2": ["reader"],
}


def results_for(strategy: str, worker_results: WorkerResults) -> list[dict[str, Any]]:
    if strategy == "ds2" and (reason := deepspeed_missing()):
        pytest.skip(reason)
    env = {"TMPDIR": cross_device_tmpdir_or_skip} if strategy == "ddp" else {}
    return worker_results("workers/publication_readers_worker.py", [strategy, OUT, *SCENARIOS[strategy]],
                          timeout=280, env=env).ranks


@pytest.mark.parametrize("strategy", ["ddp", "ds2", "fsdp2"])
@pytest.mark.timeout(300)
def test_a_reader_polling_last_never_finds_it_absent_partial_or_failing_to_load(worker_results, strategy):
    rank0 = results_for(strategy, worker_results)[0]["reader"]
    counts = rank0["counts"]
    assert rank0["saves"] >= 200
    assert counts["polls"] > 200, counts  # the reader looked often enough to land inside publications
    assert counts["last_absent"] == counts["last_incomplete"] == 0, counts
    assert counts["best_polls"] > 200 and counts["best_absent"] == counts["best_incomplete"] == 0, counts


@pytest.mark.parametrize("strategy", ["ddp", "ds2"])
@pytest.mark.timeout(300)
def test_the_control_plain_model_checkpoint_lets_the_reader_find_last_partial(worker_results, strategy):
    """``ModelCheckpoint`` writes ``last`` in place: a copy from ``$TMPDIR`` into the file, DeepSpeed's files into
    the existing directory; a reader finds it partial."""
    counts = results_for(strategy, worker_results)[0]["reader-plain"]["counts"]
    assert counts["polls"] > 200, counts
    assert counts["last_incomplete"] + counts["last_absent"] > 0, counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["async-fail-next", "async-fail-end"])
def test_a_failed_background_write_on_rank_0_raises_on_both_ranks_at_the_same_boundary(worker_results, scenario):
    """Keep-the-newest: step 4's (step 6's) write fails on rank 0's background thread. Both ranks raise at step 6's
    boundary (at the end of training): rank 0 its own error, rank 1 ``CheckpointWriteError`` naming rank 0; both
    ledgers are back to the checkpoint still on disk, the one the failed boundary would have evicted."""
    ranks = [rank[scenario] for rank in results_for("ddp", worker_results)]
    failed_name = "step=4.ckpt" if scenario == "async-fail-next" else "step=6.ckpt"
    kept_name = "step=2.ckpt" if scenario == "async-fail-next" else "step=4.ckpt"
    assert ranks[0]["error"].startswith("OSError: [Errno 28] No space left on device"), ranks[0]["error"]
    assert ranks[1]["error"].startswith("CheckpointWriteError: Writing the checkpoint"), ranks[1]["error"]
    assert f"{failed_name} failed on rank 0" in ranks[1]["error"], ranks[1]["error"]
    assert [rank["global_step"] for rank in ranks] == [6, 6]
    for rank in ranks:
        assert rank["files"] == [kept_name], rank["files"]
        assert [os.path.basename(p) for p in rank["state"]["best_k_models"]] == [kept_name]
        assert os.path.basename(rank["state"]["best_model_path"]) == kept_name
    assert ranks[0]["state"] == ranks[1]["state"]


@pytest.mark.timeout(300)
def test_background_writes_publish_the_same_on_both_ranks(worker_results):
    ranks = [rank["async-ok"] for rank in results_for("ddp", worker_results)]
    assert [rank["error"] for rank in ranks] == [None, None]
    assert ranks[0]["files"] == ["last.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert ranks[0]["last_step"] == 6
    assert ranks[0]["state"] == ranks[1]["state"]
    assert sorted(os.path.basename(p) for p in ranks[0]["state"]["best_k_models"]) == ["step=4.ckpt", "step=6.ckpt"]
