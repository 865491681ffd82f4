"""``CheckpointPublisher`` under Fabric's DeepSpeed: a write failing on rank 1 raises on every rank, promptly.

Two real processes (gloo), ``workers/publisher_deepspeed_worker.py``: ZeRO-2, fp32, a save every 2 steps. At step 4
the kernel refuses part of rank 1's optimizer partition file (a file-size limit, as a full disk would). DeepSpeed's
``engine.save_checkpoint`` ends with a barrier after the files are written: a rank whose write raised straight out of
it would leave its peer waiting there until the 30 s collective timeout (and both ranks would then raise gloo's errors,
not the write's, with the process group broken for the next save). The publisher holds the failure inside DeepSpeed's
save instead, as the callback does, so every rank reaches that barrier and raises right after: rank 1 its own error,
rank 0 ``CheckpointWriteError`` naming rank 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import OUT, WorkerResults, deepspeed_missing

pytestmark = [pytest.mark.multiprocess, pytest.mark.deepspeed]

#: well below the worker's 30 s collective timeout: a rank left waiting in DeepSpeed's barrier would take longer
PROMPT_SECONDS = 15
DEEPSPEED_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Per rank, its scenarios' results."""
    if reason := deepspeed_missing():
        pytest.skip(reason)
    return worker_results("workers/publisher_deepspeed_worker.py", [OUT], timeout=180).ranks


@pytest.fixture(scope="module")
def events(ranks: list[dict[str, Any]]) -> list[dict[int, dict[str, Any]]]:
    """Per rank, its events by step."""
    return [{event["step"]: event for event in rank["rank-1-write-fails"]["events"]} for rank in ranks]


def test_a_guard_on_the_module_fabric_set_up_reads_zero_2_partitions_and_rejects_a_nan_on_rank_1(ranks):
    # ZeRO-2 leaves param.grad empty: a guard reading it would accept the NaN step on both ranks
    for rank in ranks:
        result = rank["nan-gradient-on-rank-1"]
        assert result["source"] == "DeepSpeedGradients"
        assert "build `GradientGuard` on the model `fabric.setup` returned" in (result["bare_module_refused"] or "")
        clean, nan = result["verdicts"]
        assert clean["accepted"], clean
        assert not nan["accepted"] and nan["reason"].startswith("non-finite gradients recorded on rank(s)"), nan
        assert 1 in nan["ranks"], nan


def test_a_write_failing_on_rank_1_raises_on_every_rank_before_any_timeout(events):
    rank_0, rank_1 = (ranks[4] for ranks in events)
    assert rank_1["error"] is not None and rank_1["error"]["type"] == "RuntimeError", rank_1["error"]
    # its own error, from DeepSpeed's own write of its partition file (torch.save), not a collective's
    assert "torch_checkpoint_engine.py" in rank_1["error"]["trace"], rank_1["error"]["trace"]
    assert rank_0["error"] is not None and rank_0["error"]["type"] == "CheckpointWriteError", rank_0["error"]
    message = rank_0["error"]["message"]
    assert "step=4.ckpt failed on rank 1" in message and rank_1["error"]["message"] in message, message
    assert [event["seconds"] < PROMPT_SECONDS for event in (rank_0, rank_1)] == [True, True], (rank_0, rank_1)


def test_the_earlier_checkpoint_stays_published_and_nothing_partial_is_left(events):
    published, failed = events[0][2], events[0][4]
    assert published["error"] is None and published["listing"] == ["step=2.ckpt"]
    assert published["contents"]["step=2.ckpt"] == DEEPSPEED_FILES
    assert failed["unchanged"], "the failed save changed the directory (a partial checkpoint, a staging entry)"
    assert failed["listing"] == ["step=2.ckpt"]


def test_the_window_is_kept_and_the_next_save_publishes_in_the_same_process_group(events):
    for rank in events:
        # the agreement accepted step 4; the write failed, so its window is not reset (a publish resets it)
        assert (rank[4]["last_verdict_accepted"], rank[4]["recorded_after"]) == (True, rank[4]["recorded_before"])
        assert (rank[6]["error"], rank[6]["recorded_after"]) == (None, 0)
    assert events[0][6]["listing"] == ["step=2.ckpt", "step=6.ckpt"]
    assert events[0][6]["contents"]["step=6.ckpt"] == DEEPSPEED_FILES
