"""How many ``torch.distributed`` collectives the guard adds to ``ModelCheckpoint``'s, per boundary and per fit.

Two real processes (gloo), ``workers/collective_counts_worker.py``: every call of a ``torch.distributed`` collective is
counted, for both classes, inside each boundary hook call and outside them. Both ranks must run exactly the same
collectives (invariant 11). The numbers are in ``benchmarks/RESULTS.md`` (A11).

Today's floor is pinned, so a change that adds a collective fails here. An accepted boundary with a full top K costs
1 more than ``ModelCheckpoint``'s 8: the top-K vote rides in the agreement (one all-gather, where ModelCheckpoint's
vote is a barrier and an all-reduce), each save's write outcome takes the place of Lightning's post-save barrier, and
a move-into-place outcome follows each of the two saves. While the top K is still filling, ModelCheckpoint does not
vote at all (6) and the guard still agrees: 3 more. A fit costs 1 more: the agreed check that ``dirpath`` is
writable, which is also the barrier after rank 0's crash recovery. The publication-core issue's goal is +1 per
accepted boundary and +3 per fit.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import OUT, WorkerResults

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(330)]

#: at most this many more collectives than ModelCheckpoint's: per accepted boundary, and once per fit
MAX_EXTRA_PER_BOUNDARY = {"top K filling": 3, "top K full": 1}
MAX_EXTRA_PER_FIT = 1


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict[str, Any]]:
    return worker_results("workers/collective_counts_worker.py", [OUT], timeout=300).ranks


def _total(calls: dict[str, int]) -> int:
    return sum(calls.values())


def extra_per_boundary(counts: dict[str, Any]) -> list[int]:
    """Per boundary, in order: the guard's collectives less ModelCheckpoint's."""
    plain, guarded = counts["ModelCheckpoint"]["boundaries"], counts["FiniteGradCheckpoint"]["boundaries"]
    assert [(b["hook"], b["epoch"]) for b in guarded] == [(b["hook"], b["epoch"]) for b in plain]
    return [_total(g["calls"]) - _total(p["calls"]) for p, g in zip(plain, guarded, strict=True)]


def extra_per_fit(counts: dict[str, Any]) -> int:
    return _total(counts["FiniteGradCheckpoint"]["outside"]) - _total(counts["ModelCheckpoint"]["outside"])


def test_every_rank_runs_the_same_collectives(ranks):
    assert ranks[0] == ranks[1]


def test_the_guard_adds_at_most_todays_floor_of_collectives(ranks):
    counts = ranks[0]
    per_boundary, per_fit = extra_per_boundary(counts), extra_per_fit(counts)
    for cls in ("ModelCheckpoint", "FiniteGradCheckpoint"):
        print(f"\n{cls}: outside the boundaries {counts[cls]['outside']}")
        for boundary in counts[cls]["boundaries"]:
            print(f"  {boundary['hook']} (epoch {boundary['epoch']}): {boundary['calls']}")
    print(f"extra per boundary: {per_boundary}; extra per fit: {per_fit}")
    assert len(per_boundary) == 4, "one saving boundary per epoch expected"
    filling, full = per_boundary[:2], per_boundary[2:]  # save_top_k=2: full from the third boundary on
    assert max(filling) <= MAX_EXTRA_PER_BOUNDARY["top K filling"], per_boundary
    assert max(full) <= MAX_EXTRA_PER_BOUNDARY["top K full"], per_boundary
    assert per_fit <= MAX_EXTRA_PER_FIT, per_fit
    assert min(per_boundary) >= 1, "no agreement per boundary: the counting sees too little"
