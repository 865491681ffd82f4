"""The response to a rejected boundary: a pure function of the policy and the context (``policy.respond``)."""

from __future__ import annotations

import pytest

from lightning_ckguard.recover.policy import POLICIES, Response, respond


@pytest.mark.parametrize(
    ("policy", "during_exception", "fitting", "expected"),
    [
        ("raise", False, True, Response.RAISE),
        ("skip", False, True, Response.SKIP),
        ("stop", False, True, Response.STOP),
        ("rewind", False, True, Response.REWIND),
        # outside a fit there is nothing to rewind to: the rejection raises
        ("rewind", False, False, Response.RAISE),
        ("skip", False, False, Response.SKIP),
    ]
    # while an exception unwinds the fit, whatever the policy: seal and warn, so the original error surfaces
    + [(policy, True, fitting, Response.SEAL_AND_WARN) for policy in POLICIES for fitting in (True, False)],
)
def test_each_policy_and_context_has_one_response(policy, during_exception, fitting, expected):
    assert respond(policy, during_exception=during_exception, fitting=fitting) is expected


@pytest.mark.parametrize("policy", POLICIES)
def test_at_the_end_of_training_only_raise_raises_and_every_other_policy_seals(policy):
    expected = Response.RAISE if policy == "raise" else Response.SEAL
    assert respond(policy, during_exception=False, at_the_end=True) is expected
    # an exception unwinding the fit still wins: its error surfaces
    assert respond(policy, during_exception=True, at_the_end=True) is Response.SEAL_AND_WARN


def test_only_skip_and_rewind_leave_the_run_unsealed():
    assert {response for response in Response if not response.seals} == {Response.SKIP, Response.REWIND}
