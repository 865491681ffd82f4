"""``save_on_exception`` with peers (``workers/exception_saves_worker.py``, 2 real processes): the checkpoint on
exception is agreed on only when every rank is handling an exception, which is asked through the rendezvous store,
never by a collective. An exception on one rank only saves nothing, and the healthy rank, inside DDP's gradient
all-reduce, is not sent the agreement's all-reduce (gloo aborted it, or summed the ballot into its gradients); an
exception on every rank saves the checkpoint, as ``ModelCheckpoint`` does."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import OUT, WorkerResults

pytestmark = pytest.mark.multiprocess


def _ranks(worker_results: WorkerResults, scenario: str) -> list[dict[str, Any]]:
    """One launch per scenario: a rank that raised leaves its process, as in a real job (its peer learns of it)."""
    launch = worker_results("workers/exception_saves_worker.py", [OUT, scenario], timeout=180)
    return [rank[scenario] for rank in launch.ranks]


@pytest.mark.parametrize("scenario", ["one-rank", "again-on-one-rank"])
def test_an_exception_on_one_rank_saves_nothing_and_each_rank_ends_with_a_python_error(worker_results, scenario):
    # "again-on-one-rank": after a fit whose exception every rank handled (and saved), in the same processes
    rank_0, rank_1 = (result if scenario == "one-rank" else result["second"]
                      for result in _ranks(worker_results, scenario))
    # rank 1 its own error; rank 0 the broken process group's (it lost its peer): an error, not an abort
    assert rank_1["error"]["unexpected"] == "RuntimeError: boom on rank 1", rank_1["error"]
    assert rank_0["error"] is not None and "unexpected" in rank_0["error"], rank_0
    assert "boom" not in rank_0["error"]["unexpected"]
    assert sorted(rank_0["tree"]) == ["epoch=0-step=2.ckpt"]  # nothing written on the exception
    for rank, result in enumerate((rank_0, rank_1)):
        (warning,) = [w for w in result["warnings"] if "no checkpoint saved on this exception" in w]
        assert f"(rank {rank})" in warning and "an exception on some ranks only" in warning
        assert result["seconds"] < 45, result["seconds"]  # the rendezvous's wait, not a collective's timeout


@pytest.mark.parametrize("scenario", ["every-rank", "every-rank-apart"])
def test_an_exception_on_every_rank_saves_the_checkpoint_as_model_checkpoint_does(worker_results, scenario):
    # "every-rank-apart": rank 0 stopped before its step was recorded, rank 1 after: a spike gate judges the steps
    # both ranks recorded, and does not refuse the save for the step one of them holds alone
    ranks = _ranks(worker_results, scenario)
    for rank, result in enumerate(ranks):
        assert result["error"]["unexpected"] == f"RuntimeError: boom on rank {rank}", result["error"]
        assert not [w for w in result["warnings"] if "no checkpoint saved on this exception" in w]
    assert sorted(ranks[0]["tree"]) == ["epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt"]
