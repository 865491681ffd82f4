"""The verdict is a pure function of the reduced ballots (and, on a rejection, the roll call); the error carries the
same fields everywhere. Each case runs every rank's part of both collectives in one process: a ballot each, reduced
with MAX, then, only on a rejection, a roll call each, reduced with SUM."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import pytest
import torch

from lightning_ckguard import GradientGuard, NonFiniteGradientError, RankReport
from lightning_ckguard.agree.agreement import (
    TALLY_SIZE,
    RollCall,
    Tally,
    Verdict,
    ballot,
    reach_verdict,
    roll_call,
)
from lightning_ckguard.record.state_check import NAME_WORDS, STATE_SUMMARY_SIZE, StateCheck
from lightning_ckguard.record.window import SUMMARY_SIZE


def _row(applied=0, first=-1, last=-1, skipped=0, first_skipped=-1, last_skipped=-1, pending=0, params=(), state=()):
    row = [applied, first, last, skipped, first_skipped, last_skipped, pending, len(params)]
    row += list(params) + [-1] * (SUMMARY_SIZE - len(row) - len(params))
    non_finite = [(name, torch.tensor([float("nan")])) for name in state]
    return row + StateCheck().summary(non_finite, torch.device("cpu")).tolist()


def agree_among(rows: Sequence[list[int]], global_step: int, names: Sequence[str], count_skipped_steps: bool = False
                ) -> tuple[Verdict, list[str]]:
    """Every rank's part of the agreement, the collectives done by hand; also which ones ran."""
    world_size = len(rows)
    reports = [RankReport.from_summary(rank, row) for rank, row in enumerate(rows)]
    ballots = torch.tensor([ballot(report, world_size, count_skipped_steps) for report in reports])
    assert ballots.shape == (world_size, TALLY_SIZE)
    tally, roll, ran = Tally.from_words(ballots.amax(0).tolist(), world_size), RollCall(), ["max"]
    if tally.rejects:
        called = torch.tensor([roll_call(report, row, tally, count_skipped_steps)
                               for report, row in zip(reports, rows, strict=True)])
        roll, ran = RollCall.from_words(called.sum(0).tolist(), tally, len(rows[0])), ran + ["sum"]
    return reach_verdict(tally, roll, global_step, names, count_skipped_steps), ran


def test_all_finite_accepts_in_one_collective():
    verdict, ran = agree_among([_row(), _row()], 10, ["a", "b"])
    assert verdict.accepted and verdict.ranks == () and verdict.num_steps == 0 and verdict.reports == ()
    assert ran == ["max"]
    with pytest.raises(ValueError):
        verdict.to_error()


def test_one_rank_rejects_for_everyone_and_names_its_parameters():
    rows = [_row(), _row(2, 4, 9, params=[1]), _row(), _row(1, 7, 7, params=[0, 1])]
    verdict, ran = agree_among(rows, 12, ["w", "b"])
    assert not verdict.accepted and ran == ["max", "sum"]
    assert verdict.ranks == (1, 3)
    assert (verdict.first_step, verdict.last_step, verdict.num_steps) == (4, 9, 2)
    assert verdict.parameters == ("w", "b")
    error = verdict.to_error()
    assert "ranks 1, 3" in str(error) and "global step 12" in str(error) and "steps 4 to 9" in str(error)


def test_skipped_steps_are_reported_but_reject_only_when_counted():
    rows = [_row(skipped=3, first_skipped=0, last_skipped=2), _row()]
    lenient, ran = agree_among(rows, 5, [])
    assert lenient.accepted and lenient.skipped_steps == 3 and "skipped" in lenient.reason and ran == ["max"]
    strict, _ = agree_among(rows, 5, [], count_skipped_steps=True)
    assert not strict.accepted and strict.ranks == (0,) and (strict.first_step, strict.last_step) == (0, 2)


def test_pending_rejection_rejects_without_new_steps():
    verdict, _ = agree_among([_row(pending=1), _row(pending=1)], 3, [])
    assert not verdict.accepted and "[0, 1]" in verdict.reason and verdict.to_error().pending_rejection


def test_an_error_at_16_ranks_with_3_faulty_ones_names_all_three():
    rows = [_row() for _ in range(16)]
    rows[2] = _row(1, 6, 6, params=[0])
    rows[9] = _row(state=["buffer bn.running_var"])
    rows[15] = _row(3, 4, 8, params=[1])
    verdict, _ = agree_among(rows, 9, ["stem.weight", "head.weight"])
    error = verdict.to_error()
    assert error.ranks == (2, 15) and error.non_finite_state == ((9, "buffer bn.running_var"),)
    assert (error.first_step, error.last_step, error.num_steps) == (4, 8, 3)
    assert error.parameters == ("stem.weight", "head.weight")
    assert "ranks 2, 15 in 3 optimizer steps (steps 4 to 8)" in str(error)
    assert "rank 9: buffer bn.running_var" in str(error)
    assert "unnamed_ranks" not in error.fields() and "more" not in str(error)


def test_past_16_ranks_a_rejection_names_16_and_counts_the_rest_in_bounded_words():
    world_size = 1024  # every rank saw the NaN (DDP's all-reduced gradients)
    verdict, _ = agree_among([_row(1, 5, 5, params=[0])] * world_size, 6, ["w"])
    error = verdict.to_error()
    assert len(error.ranks) == 16 and error.ranks[:2] == (0, 64) and error.unnamed_ranks == world_size - 16
    assert "ranks 0, 64, 128" in str(error) and f"and {world_size - 16} more" in str(error)
    assert pickle.loads(pickle.dumps(error)) == error


def test_state_names_of_the_named_ranks_reach_every_rank_whole():
    names = [f"optimizer: exp_avg of parameter {i}" for i in range(3)]
    verdict, _ = agree_among([_row(), _row(state=names)], 4, [])
    assert verdict.non_finite_state == tuple((1, name) for name in names)
    assert len(_row()) == SUMMARY_SIZE + STATE_SUMMARY_SIZE == SUMMARY_SIZE + 1 + NAME_WORDS


@pytest.mark.parametrize("rows", [[_row(1, 3, 3, params=[0]), _row()], [_row(), _row(state=["buffer bn.running_var"])]],
                         ids=["gradients", "state"])
def test_a_rejection_among_few_ranks_names_them_all_and_counts_none_more(rows):
    verdict, _ = agree_among(rows, 4, ["w"])
    error = verdict.to_error()
    assert verdict.unnamed_ranks == 0 and error.unnamed_ranks == 0
    assert "more" not in verdict.reason and "more" not in str(error)


def test_past_16_ranks_a_rank_with_non_finite_gradients_is_named_before_a_state_only_one():
    # ranks 0 and 1 share a naming slot at 32 ranks: the one whose gradients were non-finite is named, with them
    rows = [_row() for _ in range(32)]
    rows[0], rows[1] = _row(state=["buffer bn.running_var"]), _row(1, 5, 5, params=[0])
    error = agree_among(rows, 6, ["w"])[0].to_error()
    assert error.ranks == (1,) and error.parameters == ("w",) and (error.first_step, error.last_step) == (5, 5)


def test_error_survives_pickling_with_all_fields():
    error = NonFiniteGradientError(ranks=[3, 1], first_step=4, last_step=6, num_steps=2, global_step=8,
                                   parameters=["layer.weight"])
    assert error.ranks == (1, 3)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is NonFiniteGradientError and clone.fields() == error.fields() and str(clone) == str(error)
    assert isinstance(clone, RuntimeError)


def test_a_guard_agrees_alone_without_a_collective_and_refuses_what_is_not_one():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    guard = GradientGuard(model)
    guard.record()
    assert guard.agree(None).accepted
    with pytest.raises(ValueError, match="collective"):
        guard.agree(object())


@pytest.mark.parametrize("arguments, argument", [
    (dict(module="model"), "module"),
    (dict(count_skipped_steps="no"), "count_skipped_steps"),  # a truthy string would count skipped steps
    (dict(count_skipped_steps=1), "count_skipped_steps"),
    (dict(source=object()), "source"),
    (dict(spike_gate="on"), "spike_gate"),
])
def test_a_guard_refuses_bad_arguments_at_construction_naming_them(arguments, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        GradientGuard(**{"module": torch.nn.Linear(2, 1), **arguments})


@pytest.mark.parametrize("nan", [False, True], ids=["accepted", "rejected"])
def test_a_guard_runs_one_collective_when_it_accepts_and_one_more_only_when_it_rejects(monkeypatch, nan):
    from types import SimpleNamespace

    from helpers import reducing_with_peers
    from lightning_ckguard._distributed import FAILING_RANKS
    from lightning_ckguard.agree.agreement import NAMED_RANKS, ROLL_HEADER

    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    if nan:
        model.bias.grad[0] = float("nan")
    guard = GradientGuard(model)
    guard.record(step=3)
    # a clean rank: its ballot, and no failure of its state check (FAILING_RANKS' words, all zero)
    clean_peer = ballot(RankReport.from_summary(1, _row()), 2, count_skipped_steps=False) + [0] * FAILING_RANKS.slots
    silent_roll = [0] * (ROLL_HEADER + NAMED_RANKS.slots * len(_row()))  # a clean rank, not named, counts nothing
    ops = reducing_with_peers(monkeypatch, [clean_peer], [silent_roll])
    rank0 = SimpleNamespace(world_size=2, global_rank=0, root_device=torch.device("cpu"))
    verdict, _ = guard.agree_carrying(rank0, (), global_step=4)
    assert ops == (["max", "sum"] if nan else ["max"])
    assert verdict.accepted is not nan and verdict.ranks == ((0,) if nan else ())


def test_past_16_ranks_one_named_rank_with_others_counted_is_said_as_ranks():
    # at 32 ranks, ranks 0 and 1 share a naming slot: rank 0 is named and rank 1 counted; two ranks, so "ranks"
    rows = [_row() for _ in range(32)]
    rows[0] = rows[1] = _row(1, 5, 5, params=[0])
    error = agree_among(rows, 6, ["w"])[0].to_error()
    assert (error.ranks, error.unnamed_ranks) == ((0,), 1)
    assert "non-finite gradients were recorded on ranks 0 and 1 more in 1 optimizer step (step 5)" in str(error)
