"""The fault matrix: strategy x faulty rank x boundary, on two real CPU processes (gloo).

Every cell trains 4 optimizer steps with a NaN planted at step 3 on the faulty ranks (or nowhere), so the first boundary
that would write after it is at global step 4 (see ``tests/workers/fault_matrix_worker.py``). The expected outcome, on
every rank: no fault, no error and the checkpoints written; a fault, the same ``NonFiniteGradientError`` fields on every
rank, the checkpoint directory byte-identical to the snapshot taken right before the faulty step, and the callback's
state unchanged. Each strategy runs its 16 cells in one process group (one worker launch) with a 60 s collective
timeout, and a wall-clock timeout on top, so a hang fails instead of stalling CI.

When the cells are done, the whole matrix as they found it is printed (run with ``-s`` to see it) and written to
``matrix.md`` in a temporary directory; no test repeats the cells' checks. DeepSpeed cells skip when DeepSpeed is not
importable.
"""

from __future__ import annotations

from typing import Any

import pytest
from sharded_helpers import APPLIED_NAN_STATE, FAULT_PARAMETERS

from conftest import LAST_AT_EVERY_BOUNDARY, OUT, WorkerResults, deepspeed_missing

pytestmark = pytest.mark.multiprocess

STRATEGIES = ["ddp", "zero1", "ds2", "ds3", "fsdp2"]
DEEPSPEED_PARAMETERS = {"ds2", "ds3"}  # their items are marked `deepspeed` (conftest)
FAULTY = ["none", "0", "1", "all"]
BOUNDARIES = ["periodic", "val_topk", "last", "final"]
SENTINEL = "earlier-run.txt"  # placed in the `final` directory before the fit, by rank 0
FAULT_STEP = 3
WORKER_TIMEOUT = 280  # per strategy (16 cells); each collective times out after 60 s inside

# top-level names in the checkpoint directory: before the fault (= after a rejection) and after a finite run
BEFORE_FAULT = {
    "periodic": {"step=2.ckpt"},
    "val_topk": {"epoch=0.ckpt"},
    "last": {"last.ckpt"},
    "final": {SENTINEL},
}
FINITE = {
    "periodic": {"step=4.ckpt"},  # step=2 evicted
    "val_topk": {"epoch=1.ckpt"},  # epoch=0 evicted
    "last": {"last.ckpt"},
    "final": {SENTINEL, "last.ckpt"},  # written at train end
}

# the boundary that decides at global step 4 (the last agreement of the run, rejecting or accepting)
DECIDED_AT = {
    "periodic": "train batch end",
    # validation runs once per epoch, before the epoch ends: ModelCheckpoint decides the top-K at train epoch end
    "val_topk": "train epoch end",
    "last": "train batch end",
    # Lightning 2.5's ModelCheckpoint writes `last` at every train epoch end (the fit's only one ends at step 4)
    "final": "train epoch end" if LAST_AT_EVERY_BOUNDARY else "train end",
}


def expected_error(strategy: str, faulty: str) -> dict[str, Any]:
    if strategy in ("ddp", "zero1"):
        # the NaN is written after the all-reduce: exactly the faulty ranks hold it (sanitized before the step)
        ranks = {"0": [0], "1": [1], "all": [0, 1]}[faulty]
        parameters, skipped, state = ["layer.weight"], 0, []
    else:
        # planted in the faulty ranks' local contribution, the reduction puts it in rank 1's partition or shard
        ranks, parameters, skipped = [1], FAULT_PARAMETERS, 0
        # the NaN step was applied (rank 1's partition or shard); the state check names what it poisoned
        state = APPLIED_NAN_STATE["fsdp2" if strategy == "fsdp2" else "deepspeed"]
        if strategy == "ds3":
            # DeepSpeed skips the step on every rank; count_skipped_steps=True makes the skip reject
            ranks, skipped, state = [0, 1], 1, []
    return {
        "ranks": ranks,
        "first_step": FAULT_STEP,
        "last_step": FAULT_STEP,
        "num_steps": 1,
        "global_step": FAULT_STEP + 1,
        "parameters": parameters,
        "skipped_steps": skipped,
        "pending_rejection": False,
        "non_finite_state": state,
    }


def results_for(strategy: str, worker_results: WorkerResults) -> list[dict[str, Any]]:
    """Both ranks' results for the 16 cells of ``strategy``; skips where they are unavailable. One launch per
    session: a worker that failed (or hung) fails its other cells at once instead of rerunning (``worker_results``)."""
    if strategy in DEEPSPEED_PARAMETERS and (reason := deepspeed_missing()):
        pytest.skip(reason)
    return worker_results("workers/fault_matrix_worker.py", [strategy, OUT], timeout=WORKER_TIMEOUT).ranks


def _top(tree: dict[str, Any]) -> set[str]:
    return {name for name in tree if "/" not in name}


def check_cell(strategy: str, faulty: str, boundary: str, ranks: list[dict[str, Any]]) -> str:
    """Assert the expected outcome of one cell on every rank; return it in words for the table."""
    cell = f"{faulty}-{boundary}"
    results = [r.get(cell) for r in ranks]
    assert all(r is not None for r in results), f"{strategy} {cell}: a rank did not finish the cell"
    for rank, result in enumerate(results):
        error = result["error"]
        assert not (error and "unexpected" in error), f"rank {rank}: {error['unexpected']}\n{error['trace']}"
        assert result["global_step"] == FAULT_STEP + 1, f"rank {rank}: stopped at {result['global_step']}"
    assert results[0]["state"] == results[1]["state"], "the ranks disagree on the callback state"
    report = results[0]["report"]
    assert results[1]["report"] == report, "the ranks disagree on the last boundary's report"
    assert report is not None, "no boundary agreed"
    assert (report["boundary"], report["global_step"]) == (DECIDED_AT[boundary], FAULT_STEP + 1), report
    assert report["accepted"] == (faulty == "none"), report
    tree = results[0]["tree"]
    if faulty == "none":
        for rank, result in enumerate(results):
            assert result["error"] is None, f"rank {rank}: {result['error']}"
        assert _top(tree) == FINITE[boundary], sorted(tree)
        written = sorted(_top(tree) - {SENTINEL})
        assert written, "a finite run wrote nothing"
        return f"saved {', '.join(written)} at {report['boundary']}"
    errors = [result["error"] for result in results]
    assert errors[0] == errors[1], f"the ranks raised different errors: {errors}"
    assert errors[0] == expected_error(strategy, faulty), errors[0]
    for rank, result in enumerate(results):
        before = result["snapshot"]
        assert before is not None, f"rank {rank}: no snapshot before the faulty step"
        assert result["state"] == before["state"], f"rank {rank}: callback state changed"
    assert tree == results[0]["snapshot"]["tree"], "checkpoint directory changed"
    assert _top(tree) == BEFORE_FAULT[boundary], sorted(tree)
    skipped = ", skip counted" if errors[0]["skipped_steps"] else ""
    return f"rejected at {report['boundary']} on both, ranks={errors[0]['ranks']}{skipped}; unchanged"


#: each cell's outcome in words, as its test found it: the table written when the module's tests are done
_table: dict[tuple[str, str, str], str] = {}


@pytest.fixture(scope="module", autouse=True)
def matrix_table(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """After the cells ran, write the matrix as they found it to ``matrix.md`` and print it (``-s`` shows it)."""
    yield
    if not _table:
        return
    lines = ["| strategy | faulty rank | " + " | ".join(BOUNDARIES) + " |", "|---|---|" + "---|" * len(BOUNDARIES)]
    for strategy in STRATEGIES:
        for faulty in FAULTY:
            row = [_table.get((strategy, faulty, boundary), "not run") for boundary in BOUNDARIES]
            lines.append(f"| {strategy} | {faulty} | " + " | ".join(row) + " |")
    table = "\n".join(lines) + "\n"
    path = tmp_path_factory.mktemp("fault-matrix") / "matrix.md"
    path.write_text(table)
    print(f"\nfault matrix ({path}):\n{table}")


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("faulty", FAULTY)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cell(worker_results, strategy, faulty, boundary):
    cell = (strategy, faulty, boundary)
    _table[cell] = "**FAIL**"
    try:
        ranks = results_for(strategy, worker_results)
    except pytest.skip.Exception as skipped:
        _table[cell] = f"skipped ({skipped.msg})"
        raise
    _table[cell] = check_cell(strategy, faulty, boundary, ranks)
