"""The verdict is a pure function of the gathered summaries; the error carries the same fields everywhere."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_ckguard import NonFiniteGradientError, RankReport
from lightning_ckguard.agree.agreement import all_gather_for, evaluate_reports, reach_verdict
from lightning_ckguard.record.window import SUMMARY_SIZE


def _row(applied=0, first=-1, last=-1, skipped=0, first_skipped=-1, last_skipped=-1, pending=0, params=()):
    row = [applied, first, last, skipped, first_skipped, last_skipped, pending, len(params)]
    return row + list(params) + [-1] * (SUMMARY_SIZE - len(row) - len(params))


def test_all_finite_accepts():
    gathered = torch.tensor([_row(), _row()])
    verdict = reach_verdict(gathered, 10, ["a", "b"], count_skipped_steps=False)
    assert verdict.accepted and verdict.ranks == () and verdict.num_steps == 0
    with pytest.raises(ValueError):
        verdict.to_error()


def test_one_rank_rejects_for_everyone_and_names_its_parameters():
    gathered = torch.tensor([_row(), _row(2, 4, 9, params=[1]), _row(), _row(1, 7, 7, params=[0, 1])])
    verdict = reach_verdict(gathered, 12, ["w", "b"], count_skipped_steps=False)
    assert not verdict.accepted
    assert verdict.ranks == (1, 3)
    assert (verdict.first_step, verdict.last_step, verdict.num_steps) == (4, 9, 2)
    assert verdict.parameters == ("w", "b")
    error = verdict.to_error()
    assert "ranks 1, 3" in str(error) and "global step 12" in str(error) and "steps 4 to 9" in str(error)


def test_skipped_steps_are_reported_but_reject_only_when_counted():
    gathered = torch.tensor([_row(skipped=3, first_skipped=0, last_skipped=2), _row()])
    lenient = reach_verdict(gathered, 5, [], count_skipped_steps=False)
    assert lenient.accepted and lenient.skipped_steps == 3 and "skipped" in lenient.reason
    strict = reach_verdict(gathered, 5, [], count_skipped_steps=True)
    assert not strict.accepted and strict.ranks == (0,) and (strict.first_step, strict.last_step) == (0, 2)


def test_pending_rejection_rejects_without_new_steps():
    reports = [RankReport.from_summary(r, _row(pending=1)) for r in range(2)]
    accepted, reason = evaluate_reports(reports, count_skipped_steps=False)
    assert not accepted and "[0, 1]" in reason


def test_error_survives_pickling_with_all_fields():
    error = NonFiniteGradientError(ranks=[3, 1], first_step=4, last_step=6, num_steps=2, global_step=8,
                                   parameters=["layer.weight"])
    assert error.ranks == (1, 3)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is NonFiniteGradientError and clone.fields() == error.fields() and str(clone) == str(error)
    assert isinstance(clone, RuntimeError)


def test_single_process_gather_adds_the_world_dimension():
    summary = torch.tensor(_row())
    assert all_gather_for(None)(summary).shape == (1, SUMMARY_SIZE)
    with pytest.raises(ValueError, match="collective"):
        all_gather_for(object())
