"""``BoundaryReport``: what one boundary's agreement decided, as a small immutable value a person can read.

The error message, the rank-zero warnings and the logged ``ckguard/...`` metrics are all derived from it, so they
always say the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_ckguard.agreement import Verdict
    from lightning_ckguard.errors import NonFiniteGradientError


def _steps(first_step: int, last_step: int, num_steps: int) -> str:
    plural = "step" if num_steps == 1 else "steps"
    if first_step == last_step:
        return f"{num_steps} optimizer {plural} (step {first_step})"
    return f"{num_steps} optimizer {plural} (steps {first_step} to {last_step})"


def rejection_text(
    *,
    ranks: Sequence[int],
    first_step: int,
    last_step: int,
    num_steps: int,
    global_step: int,
    parameters: Sequence[str],
    skipped_steps: int,
) -> str:
    """The sentence every rank raises and rank zero warns with for a rejected boundary."""
    rank_word = "rank" if len(ranks) == 1 else "ranks"
    rank_list = ", ".join(str(r) for r in ranks)
    if num_steps > 0:
        cause = (
            f"non-finite gradients were recorded on {rank_word} {rank_list} in "
            f"{_steps(first_step, last_step, num_steps)} since the last published checkpoint"
        )
    elif skipped_steps > 0:
        cause = (
            f"{skipped_steps} optimizer step(s) with non-finite gradients were skipped by the loss scaler or "
            f"DeepSpeed on {rank_word} {rank_list} (steps {first_step} to {last_step}) and `count_skipped_steps=True`"
        )
    else:
        cause = (
            f"the previous boundary on {rank_word} {rank_list} was rejected and no optimizer step has run since, "
            "so the weights are still the rejected ones"
        )
    text = f"Refusing to publish a checkpoint at global step {global_step}: {cause}."
    if parameters:
        text += f" Offending parameters: {', '.join(parameters)}."
    if skipped_steps and num_steps:
        text += f" Another {skipped_steps} step(s) were skipped by the loss scaler or DeepSpeed and never applied."
    return text + (
        " Nothing was written, deleted or linked for this boundary; the checkpoints already on disk are the last "
        "good ones."
    )


# what a report takes over from a verdict, and passes on to the error
_VERDICT_FIELDS = ("global_step", "ranks", "first_step", "last_step", "num_steps", "skipped_steps", "parameters")


@dataclass(frozen=True)
class BoundaryReport:
    """The decision of one boundary (or manual save), identical on every rank.

    Attributes:
        boundary: Where it was decided, e.g. ``"validation end"`` or ``"a save to /ckpts/x.ckpt"``.
        global_step: ``trainer.global_step`` at the boundary.
        accepted: Whether the checkpoint was published.
        ranks: Ranks whose window rejected the boundary (empty when accepted).
        first_step: First counted non-finite optimizer step, ``-1`` if none.
        last_step: Last counted non-finite optimizer step, ``-1`` if none.
        num_steps: Counted non-finite optimizer steps (the largest count any rank saw).
        skipped_steps: Steps a loss scaler or DeepSpeed skipped in the window (never applied).
        parameters: Offending parameter names, where attributable.
        pending_rejection: Rejected because an earlier boundary was, and no optimizer step has run since.
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

    @classmethod
    def from_verdict(cls, verdict: Verdict, boundary: str) -> BoundaryReport:
        """Describe ``verdict`` as decided at ``boundary``."""
        counted = {name: getattr(verdict, name) for name in _VERDICT_FIELDS}
        pending = any(r.pending_rejection for r in verdict.reports)
        return cls(boundary=boundary, accepted=verdict.accepted, pending_rejection=pending, **counted)

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
        from lightning_ckguard.errors import NonFiniteGradientError

        if self.accepted:
            raise ValueError("An accepted boundary has no error.")
        return NonFiniteGradientError(**{name: getattr(self, name) for name in (*_VERDICT_FIELDS, "pending_rejection")})


__all__ = ["BoundaryReport", "rejection_text"]
