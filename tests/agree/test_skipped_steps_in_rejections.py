"""What a rejection says about the steps a loss scaler or DeepSpeed skipped: each step counted once, whatever
``count_skipped_steps`` says, and a skipped step's parameters never called offending.

Driven through a ``GradientGuard`` in one process (its skip flags as a loss scaler gives them), and, for two ranks,
every rank's part of the agreement done by hand (``test_agreement.agree_among``'s way).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from lightning_ckguard import GradientGuard, NonFiniteGradientError
from lightning_ckguard.agree.agreement import RankReport, RollCall, Tally, ballot, reach_verdict, roll_call
from lightning_ckguard.agree.spikes import SpikeCheck
from lightning_ckguard.errors import Spike
from lightning_ckguard.record.state_check import StateCheck
from lightning_ckguard.record.window import SUMMARY_SIZE

NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]
SKIPPED_SENTENCE = ("1 step(s) with non-finite gradients were skipped by the loss scaler or DeepSpeed and never "
                    "applied; they count as non-finite steps only with `count_skipped_steps=True`.")


def _guarded_window(count_skipped_steps: bool, steps: Sequence[tuple[Sequence[int], bool]],
                    pending_rejection: bool = False) -> NonFiniteGradientError:
    """The error of a one-process guard whose steps had NaN gradients in the parameters ``steps[i][0]``, the step
    skipped by the loss scaler where ``steps[i][1]``; the boundary is at the next step."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    guard = GradientGuard(model, count_skipped_steps=count_skipped_steps)
    guard.reset(pending_rejection=pending_rejection)
    parameters = list(model.parameters())
    for step, (poisoned, skipped) in enumerate(steps):
        model.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        for index in poisoned:
            parameters[index].grad.fill_(float("nan"))
        guard.record(step=step, skipped=torch.tensor(skipped))  # a scaler's skip flag, on the device
    verdict = guard.agree(None, global_step=len(steps))
    assert not verdict.accepted
    return verdict.to_error()


# an applied NaN step in 0.weight at step 1, then a step the scaler skipped for a NaN in 1.weight at step 3
APPLIED_THEN_SKIPPED = [((), False), ((0,), False), ((), False), ((2,), True)]


def test_counted_skipped_steps_are_not_counted_again():
    error = _guarded_window(True, APPLIED_THEN_SKIPPED)
    assert (error.num_steps, error.skipped_steps, error.first_step, error.last_step) == (2, 1, 1, 3)
    message = str(error)
    assert "in 2 optimizer steps (steps 1 to 3) since the last published checkpoint" in message
    assert "Another" not in message, message  # it said "Another 1 step(s) were skipped": 3 steps where there were 2
    assert SKIPPED_SENTENCE in message


def test_skipped_steps_that_do_not_count_are_reported_beside_the_counted_ones():
    error = _guarded_window(False, APPLIED_THEN_SKIPPED)
    assert (error.num_steps, error.skipped_steps, error.first_step, error.last_step) == (1, 1, 1, 1)
    message = str(error)
    assert "in 1 optimizer step (step 1) since the last published checkpoint" in message
    assert SKIPPED_SENTENCE in message and "Another" not in message


@pytest.mark.parametrize("count_skipped_steps", [False, True])
def test_a_skipped_steps_parameter_is_not_called_offending_where_a_rank_had_both(count_skipped_steps):
    # one rank's record counts each parameter's non-finite steps, applied and skipped alike (growing the agreement's
    # words to tell them apart is not worth it): 1.weight was non-finite only in the skipped step, so the message
    # says what the list is, rather than "Offending parameters: 0.weight, 1.weight"
    error = _guarded_window(count_skipped_steps, APPLIED_THEN_SKIPPED)
    assert error.parameters == ("0.weight", "1.weight")
    message = str(error)
    assert "Offending parameters" not in message, message
    assert "Parameters with non-finite gradients in these steps or in the skipped ones: 0.weight, 1.weight." in message


def test_without_skipped_steps_the_parameters_are_the_offending_ones():
    error = _guarded_window(False, [((), False), ((0,), False)])
    assert error.parameters == ("0.weight",) and "Offending parameters: 0.weight." in str(error)
    assert "skipped" not in str(error)


def test_a_pending_rejection_through_skipped_steps_does_not_say_they_counted():
    # the previous boundary was rejected, and the only step since was skipped: the weights are the rejected ones.
    # It said "1 optimizer step(s) with non-finite gradients were skipped ... (steps -1 to -1) and
    # `count_skipped_steps=True`", with `count_skipped_steps=False`
    error = _guarded_window(False, [((2,), True)], pending_rejection=True)
    assert error.pending_rejection and (error.num_steps, error.skipped_steps, error.first_step) == (0, 1, -1)
    message = str(error)
    assert "the previous boundary on rank 0 was rejected and no optimizer step has been applied since" in message
    assert "-1" not in message and "and `count_skipped_steps=True`" not in message, message
    assert "Parameters with non-finite gradients in the skipped steps: 1.weight." in message
    assert SKIPPED_SENTENCE in message


def test_a_spike_beside_skipped_steps_is_the_cause_and_the_skips_do_not_count():
    # fp16's loss scaler skips steps in most windows; a spike rejects such a window by itself, and names no rank
    spike = Spike("loss", 17, 17, 900.0, 1.0, 900.0, 50.0)
    verdict = reach_verdict(Tally(skipped_steps=2), RollCall(), 20, [], False, SpikeCheck(spikes=(spike,)))
    message = str(verdict.to_error())
    assert message.startswith(f"Refusing to publish a checkpoint at global step 20: {spike.describe()}.")
    assert "on ranks " not in message and "-1" not in message, message
    assert "2 step(s) with non-finite gradients were skipped" in message
    assert "only with `count_skipped_steps=True`" in message


def _row(applied=0, first=-1, last=-1, skipped=0, first_skipped=-1, last_skipped=-1, params=(), state=()):
    row = [applied, first, last, skipped, first_skipped, last_skipped, 0, len(params)]
    row += list(params) + [-1] * (SUMMARY_SIZE - len(row) - len(params))
    non_finite = [(name, torch.tensor([float("nan")])) for name in state]
    return row + StateCheck().summary(non_finite, torch.device("cpu")).tolist()


def test_a_rank_named_for_its_state_adds_no_parameter_of_its_skipped_steps():
    # rank 0 applied a NaN step in 0.weight; rank 1's only non-finite step (1.weight) was skipped, and it is named
    # for a NaN buffer: with `count_skipped_steps=False` its skipped step's parameter offends nothing
    rows = [_row(1, 4, 4, params=[0]), _row(skipped=1, first_skipped=5, last_skipped=5, params=[2],
                                            state=["buffer bn.running_var"])]
    reports = [RankReport.from_summary(rank, row) for rank, row in enumerate(rows)]
    tally = Tally.from_words(torch.tensor([ballot(r, 2, False) for r in reports]).amax(0).tolist(), 2)
    called = torch.tensor([roll_call(r, row, tally, False) for r, row in zip(reports, rows, strict=True)])
    verdict = reach_verdict(tally, RollCall.from_words(called.sum(0).tolist(), tally, len(rows[0])), 6, NAMES, False)
    error = verdict.to_error()
    assert error.ranks == (0,) and error.non_finite_state == ((1, "buffer bn.running_var"),)
    assert error.parameters == ("0.weight",), error.parameters  # not 1.weight: it was non-finite in a skipped step
    assert "1.weight" not in str(error)
