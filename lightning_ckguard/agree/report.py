"""``BoundaryReport``: what one boundary's agreement decided, as a small immutable value a person can read.

The error message, the rank-zero warnings and the logged ``ckguard/...`` metrics are all derived from it, so they
always say the same thing. A verdict describes itself as one (:meth:`Verdict.report
<lightning_ckguard.agree.agreement.Verdict.report>`); this module knows nothing of verdicts, only of the error it
raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ckguard.agree.spikes import Level
from lightning_ckguard.errors import NonFiniteGradientError, Spike

# what a report passes on to the error
_ERROR_FIELDS = (
    "global_step", "ranks", "first_step", "last_step", "num_steps", "skipped_steps", "parameters", "pending_rejection",
    "non_finite_state", "unnamed_ranks", "spikes",
)


@dataclass(frozen=True)
class BoundaryReport:
    """The decision of one boundary (or manual save), identical on every rank; ``verdict.report(boundary)`` makes one.

    Attributes:
        boundary: Where it was decided, e.g. ``"validation end"`` or ``"a save to /ckpts/x.ckpt"``.
        global_step: ``trainer.global_step`` at the boundary.
        accepted: Whether the checkpoint was published.
        ranks: Ranks whose window rejected the boundary (empty when accepted).
        first_step: First counted non-finite optimizer step, ``-1`` if none.
        last_step: Last counted non-finite optimizer step, ``-1`` if none.
        num_steps: Counted non-finite optimizer steps (the largest count any rank saw); with
            ``count_skipped_steps=True`` the skipped ones among them.
        skipped_steps: Steps a loss scaler or DeepSpeed skipped in the window (never applied), counted or not.
        parameters: Names of parameters with non-finite gradients, where attributable (as
            ``NonFiniteGradientError.parameters``: of the counted steps, when some rank has any).
        pending_rejection: Rejected because an earlier boundary was, and no optimizer step has been applied since.
        non_finite_state: ``(rank, tensor name)`` of each non-finite tensor in the state about to be written
            (parameters, buffers, optimizer state, averaged weights); such a tensor rejects the boundary by itself.
        unnamed_ranks: Ranks the rejection is attributed to beyond those in ``ranks`` (a rejection names up to 16).
        spikes: With a spike gate, the steps whose loss or global gradient norm spiked (they reject by themselves).
        levels: With a spike gate, each watched measure's baseline and the window's largest value.
    """

    boundary: str
    global_step: int
    accepted: bool
    ranks: tuple[int, ...] = ()
    first_step: int = -1
    last_step: int = -1
    num_steps: int = 0
    skipped_steps: int = 0
    parameters: tuple[str, ...] = ()
    pending_rejection: bool = False
    non_finite_state: tuple[tuple[int, str], ...] = ()
    unnamed_ranks: int = 0
    spikes: tuple[Spike, ...] = ()
    levels: tuple[Level, ...] = ()

    @property
    def message(self) -> str:
        """One paragraph for a person: what was decided, where, and why."""
        if not self.accepted:
            return f"FiniteGradCheckpoint rejected the checkpoint at {self.boundary}. {self.to_error()}"
        text = f"FiniteGradCheckpoint accepted the checkpoint at {self.boundary} (global step {self.global_step})"
        if self.skipped_steps:
            text += f"; {self.skipped_steps} step(s) skipped by the loss scaler or DeepSpeed were never applied"
        return text + "."

    def to_error(self) -> NonFiniteGradientError:
        """The ``NonFiniteGradientError`` of a rejected boundary."""
        if self.accepted:
            raise ValueError("An accepted boundary has no error.")
        return NonFiniteGradientError(**{name: getattr(self, name) for name in _ERROR_FIELDS})

    def metrics(self) -> dict[str, float]:
        """The spike gate's ``ckguard/*`` values of this boundary, as plain numbers: each watched measure's baseline
        (from the end of the warm-up on) and the window's largest value (when it has a finite one)."""
        values: dict[str, float] = {}
        for level in self.levels:
            if level.baseline is not None:
                values[f"ckguard/{level.measure}_baseline"] = float(level.baseline)
            if level.window_max is not None:
                values[f"ckguard/{level.measure}_window_max"] = float(level.window_max)
        return values


__all__ = ["BoundaryReport"]
