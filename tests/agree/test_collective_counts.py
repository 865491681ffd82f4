"""How many ``torch.distributed`` collectives the guard adds to ``ModelCheckpoint``'s, per boundary and per fit.

Two real processes (gloo), ``workers/collective_counts_worker.py``: every call of a ``torch.distributed`` collective is
counted, for both classes, inside each boundary hook call and outside them. Both ranks must run exactly the same
collectives (invariant 11). The numbers are in ``benchmarks/RESULTS.md`` (A11).

Today's floor is pinned, so a change that adds a collective fails here. Each accepted boundary runs one agreement (an
all-reduce of a fixed size that carries the top-K vote and the writer's report), and each save's write outcome (an
all-reduce too) takes the place of
Lightning's post-save barrier; a move into place is not agreed on its own (a failure on rank 0 rides in the next
agreement). While the top K fills, ``ModelCheckpoint`` takes no vote and the agreement is the one collective more;
once it is full, the agreement replaces ``ModelCheckpoint``'s vote (a barrier and an all-reduce): one fewer. A fit
costs 2 more: the agreed check that ``dirpath`` is writable (also the barrier after rank 0's crash recovery), and at
train end the writer's last report (a move that failed on rank 0 at the last boundary); the train-end hook's
collectives count with the fit's. Under FSDP2 each save adds one all-reduce more: every rank meets right before the
distributed checkpoint, so that a rank whose own part failed stops its peers there (not at the collective timeout).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import OUT, WorkerResults

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(330)]

#: at most this many more collectives than ModelCheckpoint's: per accepted boundary, and once per fit
MAX_EXTRA_PER_BOUNDARY = {"top K filling": 1, "top K full": -1}
MAX_EXTRA_PER_FIT = 2
#: the hook whose collectives count with the fit's: ``ModelCheckpoint`` saves nothing there in this fit
END_OF_FIT_HOOK = "on_train_end"


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict[str, Any]]:
    return worker_results("workers/collective_counts_worker.py", [OUT], timeout=300).ranks


def _total(calls: dict[str, int]) -> int:
    return sum(calls.values())


def boundaries(counts: dict[str, Any], cls: str) -> list[dict[str, Any]]:
    return [b for b in counts[cls]["boundaries"] if b["hook"] != END_OF_FIT_HOOK]


def extra_per_boundary(counts: dict[str, Any]) -> list[int]:
    """Per boundary, in order: the guard's collectives less ModelCheckpoint's."""
    plain, guarded = boundaries(counts, "ModelCheckpoint"), boundaries(counts, "FiniteGradCheckpoint")
    assert [(b["hook"], b["epoch"]) for b in guarded] == [(b["hook"], b["epoch"]) for b in plain]
    return [_total(g["calls"]) - _total(p["calls"]) for p, g in zip(plain, guarded, strict=True)]


def fit_total(counts: dict[str, Any], cls: str) -> int:
    """The collectives outside the boundaries: setup, teardown, the data loaders' checks, the train-end hook."""
    at_the_end = sum(_total(b["calls"]) for b in counts[cls]["boundaries"] if b["hook"] == END_OF_FIT_HOOK)
    return _total(counts[cls]["outside"]) + at_the_end


def extra_per_fit(counts: dict[str, Any]) -> int:
    return fit_total(counts, "FiniteGradCheckpoint") - fit_total(counts, "ModelCheckpoint")


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
    # the counting sees the agreement: more all-reduces in every guarded boundary than in ModelCheckpoint's (its
    # vote), and no all_gather anywhere: nothing a rank receives grows with the world size
    for plain, guarded in zip(boundaries(counts, "ModelCheckpoint"), boundaries(counts, "FiniteGradCheckpoint"),
                              strict=True):
        assert guarded["calls"].get("all_reduce", 0) > plain["calls"].get("all_reduce", 0), (plain, guarded)
    gathers = ("all_gather", "all_gather_into_tensor")
    assert not any(b["calls"].get(name, 0) for b in counts["FiniteGradCheckpoint"]["boundaries"] for name in gathers)
    outside = [{name: counts[cls]["outside"].get(name, 0) for name in gathers} for cls in
               ("ModelCheckpoint", "FiniteGradCheckpoint")]
    assert outside[0] == outside[1], outside


@pytest.mark.parametrize(("ending", "extra"), [
    # the last boundary's agreement (the top-K vote) settled the writer's report and judged every step: nothing is
    # left for the end of the fit but the agreed check of dirpath at its start
    ("last-unwritten", 1),
    # the steps after the last boundary are judged at train end, the writer's last report riding in that agreement
    ("trailing-steps", 2),
])
def test_the_end_of_a_fit_adds_only_what_its_last_steps_need(ranks, ending, extra):
    counts = ranks[0]
    assert fit_total(counts, f"FiniteGradCheckpoint/{ending}") - fit_total(counts, f"ModelCheckpoint/{ending}") == extra


def test_under_fsdp2_each_save_adds_its_meeting_before_the_distributed_checkpoint(ranks):
    """Under FSDP2 (``ModelParallelStrategy``, ``fully_shard``) each boundary writes two directories (its top-K one
    and ``last``), and each save meets once more right before the distributed checkpoint: the per-boundary floor is
    DDP's plus two; per fit, DDP's."""
    counts = ranks[0]
    plain, guarded = boundaries(counts, "ModelCheckpoint/fsdp2"), boundaries(counts, "FiniteGradCheckpoint/fsdp2")
    assert [(b["hook"], b["epoch"]) for b in guarded] == [(b["hook"], b["epoch"]) for b in plain]
    assert len(plain) == 4, "one saving boundary per epoch expected"
    extra = [_total(g["calls"]) - _total(p["calls"]) for p, g in zip(plain, guarded, strict=True)]
    filling, full = extra[:2], extra[2:]
    saves_per_boundary = 2
    assert max(filling) <= MAX_EXTRA_PER_BOUNDARY["top K filling"] + saves_per_boundary, extra
    assert max(full) <= MAX_EXTRA_PER_BOUNDARY["top K full"] + saves_per_boundary, extra
    assert fit_total(counts, "FiniteGradCheckpoint/fsdp2") - fit_total(counts, "ModelCheckpoint/fsdp2") <= (
        MAX_EXTRA_PER_FIT)


def test_the_spike_gate_adds_one_all_reduce_per_agreement_and_nothing_per_step(ranks):
    counts = ranks[0]
    guarded, gated = boundaries(counts, "FiniteGradCheckpoint"), boundaries(counts, "SpikeGate")
    assert [(b["hook"], b["epoch"]) for b in gated] == [(b["hook"], b["epoch"]) for b in guarded]
    for plain, with_gate in zip(guarded, gated, strict=True):
        added = {name: with_gate["calls"].get(name, 0) - plain["calls"].get(name, 0)
                 for name in {*plain["calls"], *with_gate["calls"]}}
        assert {name: n for name, n in added.items() if n} == {"all_reduce": 1}, (plain, with_gate)
    # outside the boundaries (the training steps among them): exactly what the guard without a gate runs
    assert fit_total(counts, "SpikeGate") == fit_total(counts, "FiniteGradCheckpoint")
