"""The error raised on every rank when a checkpoint boundary is rejected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_ckguard.report import rejection_text


class NonFiniteGradientError(RuntimeError):
    """Raised on every rank, with the same fields, when a checkpoint boundary sees non-finite gradients.

    Nothing was committed, written, deleted or linked for the rejected boundary: the files in the checkpoint
    directory and the checkpoint callback's state are exactly what they were before it.

    Attributes:
        ranks: Sorted global ranks that recorded a non-finite gradient in the window.
        first_step: First optimizer step (the value of ``trainer.global_step`` when it ran) with a non-finite gradient.
        last_step: Last such step.
        num_steps: Number of non-finite optimizer steps in the window. Ranks count their own steps; this is the
            largest count any rank saw, which is exact whenever the ranks saw the same steps.
        global_step: The ``trainer.global_step`` of the rejected boundary.
        parameters: Names of offending parameters, where the gradient source can attribute them.
        skipped_steps: Steps that a loss scaler or DeepSpeed skipped (never applied) in the window.
    """

    def __init__(
        self,
        *,
        ranks: Sequence[int],
        first_step: int,
        last_step: int,
        num_steps: int,
        global_step: int,
        parameters: Sequence[str] = (),
        skipped_steps: int = 0,
        pending_rejection: bool = False,
    ) -> None:
        self.ranks: tuple[int, ...] = tuple(sorted(ranks))
        self.first_step = first_step
        self.last_step = last_step
        self.num_steps = num_steps
        self.global_step = global_step
        self.parameters: tuple[str, ...] = tuple(parameters)
        self.skipped_steps = skipped_steps
        self.pending_rejection = pending_rejection
        super().__init__(self._message())

    def _message(self) -> str:
        return rejection_text(**{k: v for k, v in self.fields().items() if k != "pending_rejection"})

    def fields(self) -> dict[str, Any]:
        """The error's fields as plain values, e.g. to compare the error across ranks or to log it."""
        return {
            "ranks": list(self.ranks),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "num_steps": self.num_steps,
            "global_step": self.global_step,
            "parameters": list(self.parameters),
            "skipped_steps": self.skipped_steps,
            "pending_rejection": self.pending_rejection,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only constructor: rebuild from fields so the error survives pickling (spawned workers, queues)
        return (_rebuild_error, (self.fields(),))


def _rebuild_error(fields: dict[str, Any]) -> NonFiniteGradientError:
    return NonFiniteGradientError(**fields)


class CheckpointWriteError(RuntimeError):
    """Raised on the ranks whose own write succeeded when another rank failed to write a checkpoint.

    The failing ranks raise their original error (e.g. ``OSError: No space left on device``). Either way, every rank
    raises at the same point, the callback's bookkeeping rolls back, and the checkpoint it would have evicted stays.

    Attributes:
        ranks: Ranks whose write failed.
        filepath: The checkpoint being written.
        cause: The first failing rank's error, as text.
    """

    def __init__(self, *, ranks: Sequence[int], filepath: str, cause: str | None) -> None:
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.filepath = filepath
        self.cause = cause
        rank_word = "rank" if len(self.ranks) == 1 else "ranks"
        super().__init__(
            f"Writing the checkpoint {filepath} failed on {rank_word} {', '.join(map(str, self.ranks))}: {cause}. "
            "Nothing was published for it on any rank."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_write_error, (self.ranks, self.filepath, self.cause))


def _rebuild_write_error(ranks: Sequence[int], filepath: str, cause: str | None) -> CheckpointWriteError:
    return CheckpointWriteError(ranks=ranks, filepath=filepath, cause=cause)
