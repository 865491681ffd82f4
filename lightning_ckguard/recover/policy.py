"""What a rejected boundary does: one pure decision from the policy and the context, applied by the callback.

The verdict says *whether* a boundary is rejected, identically on every rank; this module says *what happens then*,
as a value, so every rank also takes the same action. Like Lightning's ``EarlyStopping``, the decision is a plain
function (:func:`respond`) and the hook that applies it does nothing but apply it. Restoring a checkpoint for
``"rewind"`` lives apart, in :mod:`lightning_ckguard.recover.rewind`.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

#: What every rank does at a rejected boundary (``FiniteGradCheckpoint(on_non_finite=...)``).
NonFinitePolicy = Literal["raise", "skip", "stop", "rewind"]

POLICIES: tuple[NonFinitePolicy, ...] = ("raise", "skip", "stop", "rewind")


class Response(Enum):
    """The action every rank takes for one rejected boundary."""

    #: An exception is already unwinding the fit: seal the run and warn; raising would hide the original error.
    SEAL_AND_WARN = "seal and warn"
    #: The fit has ended (its last steps, judged at train end): nothing trains on to skip, stop or rewind, so seal the
    #: run and warn; a later ``trainer.save_checkpoint`` of these weights is refused.
    SEAL = "seal"
    #: Publish nothing for this boundary, warn, and keep rejecting until a new step is recorded.
    SKIP = "skip"
    #: Restore the last checkpoint published in this fit, in place, on every rank, and train on.
    REWIND = "rewind"
    #: Seal the run and ask the Trainer to stop; ``fit()`` returns normally.
    STOP = "stop"
    #: Seal the run and raise the rejection's ``NonFiniteGradientError`` on every rank.
    RAISE = "raise"

    @property
    def seals(self) -> bool:
        """Whether the run is sealed afterwards: nothing later in the process publishes."""
        return self in (Response.SEAL_AND_WARN, Response.SEAL, Response.STOP, Response.RAISE)


def respond(policy: NonFinitePolicy, *, during_exception: bool, fitting: bool = True,
            at_the_end: bool = False) -> Response:
    """The response to a rejected boundary. Pure: the same inputs give the same response on every rank.

    Args:
        policy: The callback's ``on_non_finite``.
        during_exception: The boundary is ``ModelCheckpoint``'s save on exception.
        fitting: A fit is running (rewind needs its loop and the checkpoints it published).
        at_the_end: The fit's training has ended (the steps after its last boundary, judged at train end): only
            ``"raise"`` still raises; nothing is left to skip, stop or rewind.
    """
    if during_exception:
        return Response.SEAL_AND_WARN
    if at_the_end and policy != "raise":
        return Response.SEAL
    if policy == "skip":
        return Response.SKIP
    if policy == "rewind" and fitting:
        return Response.REWIND
    if policy == "stop":
        return Response.STOP
    return Response.RAISE


__all__ = ["POLICIES", "NonFinitePolicy", "Response", "respond"]
