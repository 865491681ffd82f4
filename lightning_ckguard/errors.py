"""The errors raised on every rank: a rejected checkpoint boundary, and a checkpoint write that failed on some rank.

The words of the rejection live here, next to the error that carries them, so the error depends on nothing else in the
package; ``BoundaryReport`` (``report.py``) builds on it.

Both errors are values: equal when their type and fields are, and rebuilt from their fields when pickled, so an error
a callback holds compares equal to its copy in a checkpoint, a queue or another process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

#: The measures a spike gate watches: the loss of each optimizer step and the global gradient norm it applied.
MEASURES = ("loss", "grad_norm")
_MEASURE_WORDS = {"loss": "the loss", "grad_norm": "the global gradient norm"}
#: Up to how many spikes the message spells out (every one of them stays in ``spikes``).
_SPIKES_SPELLED_OUT = 3


@dataclass(frozen=True)
class Spike:
    """A step whose loss or global gradient norm jumped far above its baseline: the same on every rank.

    Attributes:
        measure: ``"loss"`` or ``"grad_norm"``.
        first_step: The optimizer step (``trainer.global_step`` when it ran) where it spiked.
        last_step: The same step; in a window longer than the gate's resolution a value stands for the largest of
            several consecutive steps, ``first_step`` to ``last_step``.
        value: The measure at that step, over every rank (the mean loss, the norm of all gradients).
        baseline: The median of the measure over the accepted window values before this window.
        ratio: ``value / baseline`` for a positive baseline; else ``1 + (value - baseline) / |baseline|`` (the
            rise in units of the baseline's size).
        deviations: ``(value - baseline)`` in robust standard deviations (1.4826 times the median absolute
            deviation of the same history).
    """

    measure: str
    first_step: int
    last_step: int
    value: float
    baseline: float
    ratio: float
    deviations: float

    def describe(self) -> str:
        """One clause for a person, e.g. ``the loss spiked at step 12 to 1.2e+06, 1.5e+06x its baseline of 0.81``."""
        steps = f"step {self.first_step}" if self.first_step == self.last_step else (
            f"steps {self.first_step} to {self.last_step}")
        measure = _MEASURE_WORDS.get(self.measure, self.measure)
        if self.value == math.inf and self.measure == "grad_norm":  # finite gradients whose squares overflowed
            return (f"{measure} spiked at {steps} past the range of its sum of squares (finite gradients whose "
                    f"squares overflowed it: a norm above about 1.8e19 for float32 gradients), far above its "
                    f"baseline of {self.baseline:.4g}")
        # "times" only means something above a positive baseline; below one, the rise itself
        rise = f"{self.ratio:.3g}x" if self.baseline > 0 else f"{self.value - self.baseline:.4g} above"
        return (f"{measure} spiked at {steps} to {self.value:.4g}, "
                f"{rise} its baseline of {self.baseline:.4g} ({self.deviations:.3g} deviations)")


def describe_spikes(spikes: Sequence[Spike | Mapping[str, Any]]) -> str:
    """The spikes for a person, the first few spelled out (the error's message, a rewind's line)."""
    spelled = "; ".join(_as_spike(spike).describe() for spike in spikes[:_SPIKES_SPELLED_OUT])
    more = len(spikes) - _SPIKES_SPELLED_OUT
    return spelled + (f"; and {more} more spike(s)" if more > 0 else "")


def _as_spike(spike: Spike | Mapping[str, Any]) -> Spike:
    return spike if isinstance(spike, Spike) else Spike(**spike)


def _steps(first_step: int, last_step: int, num_steps: int) -> str:
    plural = "step" if num_steps == 1 else "steps"
    if first_step == last_step:
        return f"{num_steps} optimizer {plural} (step {first_step})"
    return f"{num_steps} optimizer {plural} (steps {first_step} to {last_step})"


def _state_cause(non_finite_state: Sequence[tuple[int, str]]) -> str:
    by_rank: dict[int, list[str]] = {}
    for rank, name in non_finite_state:
        by_rank.setdefault(rank, []).append(name)
    parts = [f"rank {rank}: {', '.join(names)}" for rank, names in sorted(by_rank.items())]
    return f"the state about to be written holds non-finite values ({'; '.join(parts)})"


def rejection_text(
    *,
    ranks: Sequence[int],
    first_step: int,
    last_step: int,
    num_steps: int,
    global_step: int,
    parameters: Sequence[str],
    skipped_steps: int,
    non_finite_state: Sequence[tuple[int, str]] = (),
    unnamed_ranks: int = 0,
    spikes: Sequence[Spike | Mapping[str, Any]] = (),
) -> str:
    """The sentence every rank raises and rank zero warns with for a rejected boundary."""
    rank_word = "rank" if len(ranks) + unnamed_ranks == 1 else "ranks"
    rank_list = ", ".join(str(r) for r in ranks) + (f" and {unnamed_ranks} more" if unnamed_ranks else "")
    causes: list[str] = []
    if num_steps > 0:
        causes.append(
            f"non-finite gradients were recorded on {rank_word} {rank_list} in "
            f"{_steps(first_step, last_step, num_steps)} since the last published checkpoint"
        )
    elif not non_finite_state and not spikes:  # nothing else rejects: the weights of the previous rejection
        causes.append(
            f"the previous boundary on {rank_word} {rank_list} was rejected and no optimizer step has been applied "
            "since, so the weights are still the rejected ones"
        )
    if non_finite_state:  # next to the gradient history, if there is one
        causes.append(_state_cause(non_finite_state))
    if spikes:
        causes.append(describe_spikes(spikes))
    text = f"Refusing to publish a checkpoint at global step {global_step}: {'; and '.join(causes)}."
    if parameters:
        text += f" {_parameters_noun(num_steps, skipped_steps)}: {', '.join(parameters)}."
    if skipped_steps:
        # whether they are among ``num_steps`` is the guard's `count_skipped_steps`, which the fields do not hold:
        # said as a rule, so that no step is counted twice either way
        text += (f" {skipped_steps} step(s) with non-finite gradients were skipped by the loss scaler or DeepSpeed and "
                 "never applied; they count as non-finite steps only with `count_skipped_steps=True`.")
    return text + (
        " Nothing was written, deleted or linked for this boundary; the checkpoints already on disk are the last "
        "good ones."
    )


def _parameters_noun(num_steps: int, skipped_steps: int) -> str:
    """What the listed parameters are. A rank's record counts a parameter's non-finite steps, applied and skipped
    alike: with skipped steps beside counted ones, a parameter may be non-finite only in a skipped one."""
    if num_steps == 0:  # no counted step: the parameters come from the steps the loss scaler or DeepSpeed skipped
        return "Parameters with non-finite gradients in the skipped steps"
    if skipped_steps:
        return "Parameters with non-finite gradients in these steps or in the skipped ones"
    return "Offending parameters"


class _ComparedByValue:
    """An error that is a value, like the verdict it comes from: equal to its pickled or deep-copied self, where
    exceptions otherwise compare by identity. Subclasses name their fields in ``_key``."""

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self) or not isinstance(other, _ComparedByValue):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self), self._key()))


class _RebuiltFromFields(_ComparedByValue):
    """An error whose keyword-only constructor takes exactly the attributes named in ``_FIELDS``: they are its
    ``_key``, and it is pickled as a call of its constructor with them (an exception's own pickling would call it with
    the message)."""

    _FIELDS: ClassVar[tuple[str, ...]]

    def _key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_from_fields, (type(self), dict(zip(self._FIELDS, self._key(), strict=True))))


def _rebuild_from_fields(cls: type[_RebuiltFromFields], fields: dict[str, Any]) -> _RebuiltFromFields:
    return cls(**fields)


class NonFiniteGradientError(_ComparedByValue, RuntimeError):
    """Raised on every rank, with the same fields, when a checkpoint boundary sees non-finite gradients, or a
    non-finite tensor in the state it is about to write.

    Nothing was committed, written, deleted or linked for the rejected boundary: the files in the checkpoint
    directory and the checkpoint callback's state are exactly what they were before it.

    Attributes:
        ranks: Sorted ranks the rejection is attributed to: those that recorded a non-finite gradient in the
            window, or, when none did, those whose state to be written was not finite. Global ranks under a
            Lightning or Fabric strategy and with the default process group; with a ``torch.distributed`` sub-group,
            ranks within that group (``dist.get_global_rank(group, rank)`` maps them).
        first_step: First optimizer step (the value of ``trainer.global_step`` when it ran) with a non-finite gradient.
        last_step: Last such step.
        num_steps: Number of non-finite optimizer steps in the window that count: the applied ones, and with
            ``count_skipped_steps=True`` the skipped ones too. Ranks count their own steps; this is the largest count
            any rank saw, which is exact whenever the ranks saw the same steps.
        global_step: The ``trainer.global_step`` of the rejected boundary.
        parameters: Names of parameters with non-finite gradients, where the gradient source can attribute them: of
            the named ranks whose counted steps reject, when some do (a rank's record does not tell its applied steps
            from its skipped ones, so a rank that had both may add parameters non-finite only in a skipped step);
            else of the named ranks' skipped steps.
        skipped_steps: Steps that a loss scaler or DeepSpeed skipped (never applied) in the window, whether they
            count or not (the largest count any rank saw).
        pending_rejection: The previous boundary was rejected and no optimizer step has been applied since.
        non_finite_state: ``(rank, tensor name)`` of each non-finite tensor in the state about to be written (e.g.
            ``(1, "buffer bn.running_var")``, ``(1, "optimizer: fp32 master partition of group 0")``); such a
            tensor rejects the boundary whatever the gradients were.
        unnamed_ranks: Ranks the rejection is attributed to beyond those in ``ranks``: a rejection names up to 16
            ranks (all of them up to 16 ranks; beyond, the lowest of each sixteenth of the ranks), and counts the
            rest. In :meth:`fields` only when there are some.
        spikes: The steps whose loss or global gradient norm spiked (:class:`Spike`), with a spike gate on; such a
            step rejects the boundary by itself, though every value was finite. No rank is named for it: the values
            are global. In :meth:`fields` only when there are some.
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
        non_finite_state: Sequence[tuple[int, str] | Sequence[Any]] = (),
        unnamed_ranks: int = 0,
        spikes: Sequence[Spike | Mapping[str, Any]] = (),
    ) -> None:
        self.ranks: tuple[int, ...] = tuple(sorted(ranks))
        self.first_step = first_step
        self.last_step = last_step
        self.num_steps = num_steps
        self.global_step = global_step
        self.parameters: tuple[str, ...] = tuple(parameters)
        self.skipped_steps = skipped_steps
        self.pending_rejection = pending_rejection
        self.non_finite_state: tuple[tuple[int, str], ...] = tuple((int(r), str(n)) for r, n in non_finite_state)
        self.unnamed_ranks = unnamed_ranks
        self.spikes: tuple[Spike, ...] = tuple(_as_spike(spike) for spike in spikes)
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
            "non_finite_state": [list(entry) for entry in self.non_finite_state],
            # only past 16 offending ranks: up to there the fields are those of every earlier release
            **({"unnamed_ranks": self.unnamed_ranks} if self.unnamed_ranks else {}),
            **({"spikes": [asdict(spike) for spike in self.spikes]} if self.spikes else {}),
        }

    def _key(self) -> tuple[Any, ...]:
        return (self.ranks, self.first_step, self.last_step, self.num_steps, self.global_step, self.parameters,
                self.skipped_steps, self.pending_rejection, self.non_finite_state, self.unnamed_ranks, self.spikes)

    def __reduce__(self) -> tuple[Any, ...]:
        # keyword-only constructor: rebuild from fields so the error survives pickling (spawned workers, queues)
        return (_rebuild_error, (self.fields(),))


def _rebuild_error(fields: dict[str, Any]) -> NonFiniteGradientError:
    return NonFiniteGradientError(**fields)


class RewindRefusedError(NonFiniteGradientError):
    """The ``NonFiniteGradientError`` of a rejected boundary that ``on_non_finite="rewind"`` could not rewind from.

    Raised on every rank, with the same fields, when no checkpoint was published in this fit to go back to, when
    ``max_rewinds`` rewinds were already made in this fit, or when restoring the checkpoint failed on some rank. The
    rejection's own fields are those of :class:`NonFiniteGradientError`; nothing was published for the boundary.

    Attributes:
        reason: Why there was no rewind, in words.
        rewinds: Every earlier rewind of this fit, one line each, oldest first.
    """

    def __init__(self, *, reason: str, rewinds: Sequence[str] = (), **fields: Any) -> None:
        self.reason = reason
        self.rewinds: tuple[str, ...] = tuple(rewinds)
        super().__init__(**fields)

    def _message(self) -> str:
        rejection = NonFiniteGradientError.fields(self)
        del rejection["pending_rejection"]
        text = f"{rejection_text(**rejection)} No rewind: {self.reason}."
        if not self.rewinds:
            return text + " There was no earlier rewind in this fit."
        return text + " Earlier rewinds in this fit: " + " ".join(
            f"({number}) {line}" for number, line in enumerate(self.rewinds, start=1)
        )

    def fields(self) -> dict[str, Any]:
        """The error's fields as plain values, with why the rewind was refused and the earlier rewinds."""
        return {**super().fields(), "reason": self.reason, "rewinds": list(self.rewinds)}

    def _key(self) -> tuple[Any, ...]:
        return (*super()._key(), self.reason, self.rewinds)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_refused, (self.fields(),))


def _rebuild_refused(fields: dict[str, Any]) -> RewindRefusedError:
    return RewindRefusedError(**fields)


def _rank_list(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0, 1``: the ranks a failure happened on, in its message."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"


class _FailedOnRanks(_RebuiltFromFields, RuntimeError):
    """An operation on one checkpoint that failed on some ranks, told to every rank: the ranks, the path, the first
    failing rank's error, and the message that names them."""

    def __init__(self, ranks: Sequence[int], filepath: str, cause: str | None, action: str, outcome: str) -> None:
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.filepath = filepath
        self.cause = cause
        super().__init__(f"{action} the checkpoint {filepath} failed on {_rank_list(self.ranks)}: {cause}. {outcome}")


class CheckpointWriteError(_FailedOnRanks):
    """Raised on the ranks whose own write succeeded when another rank failed to write a checkpoint.

    The failing ranks raise their original error (e.g. ``OSError: No space left on device``). Either way, every rank
    raises at the same point, the callback's bookkeeping rolls back, and the checkpoint it would have evicted stays.

    Attributes:
        ranks: Ranks whose write failed.
        filepath: The checkpoint being written (or removed).
        cause: The first failing rank's error, as text.
        removal: Rank 0 failed to remove ``filepath``, a checkpoint evicted from the top K after its boundary was
            published: the ledger stands, and the file stays on disk.
    """

    _FIELDS = ("ranks", "filepath", "cause", "removal")

    def __init__(self, *, ranks: Sequence[int], filepath: str, cause: str | None, removal: bool = False) -> None:
        self.removal = removal
        if removal:
            super().__init__(ranks, filepath, cause, "Removing",
                             "The checkpoints written before it were published; it stays on disk.")
        else:
            super().__init__(ranks, filepath, cause, "Writing", "Nothing was published for it on any rank.")


class CheckpointRestoreError(_FailedOnRanks):
    """Raised on every rank, with the same fields, when restoring a checkpoint in place
    (:func:`~lightning_ckguard.restore_fabric_state`) failed on some rank; on a failing rank it is raised from that
    rank's own error.

    The ranks whose load succeeded hold the checkpoint's state and the others do not (a sharded load that failed on
    some rank before its distributed checkpoint started changed no rank's state), so training must not go on as it
    is: restore again on every rank, or stop. The message says which case it is when ``world_size`` is known: one
    process, a failure on every rank, or on some of them.

    Attributes:
        ranks: Ranks whose load failed (beyond eight ranks, the lowest of each eighth of the ranks).
        filepath: The checkpoint being restored.
        cause: The first failing rank's error, as text.
        world_size: How many ranks restored together; None where the raiser did not say.
    """

    _FIELDS = ("ranks", "filepath", "cause", "world_size")

    def __init__(self, *, ranks: Sequence[int], filepath: str, cause: str | None, world_size: int | None = None
                 ) -> None:
        ranks = tuple(ranks)
        self.world_size = world_size
        super().__init__(ranks, filepath, cause, "Restoring", _restore_outcome(ranks, world_size))


def _restore_outcome(ranks: tuple[int, ...], world_size: int | None) -> str:
    """What a failed restore left, as far as the failing ranks and the world size tell."""
    if world_size == 1:
        left = "This process may hold part of the checkpoint's state (what it loaded before the failure)"
        return f"{left}: restore again, or stop."
    if world_size is None:  # neither one process nor a failure on every rank can be told from a failure on some
        left = ("A rank where it failed may hold part of the checkpoint's state, and a rank where it did not may hold "
                "all of it")
    elif len(set(ranks)) >= world_size:
        left = "It failed on every rank, and each may hold part of the checkpoint's state"
    else:
        left = "The other ranks may have restored it, so the ranks may no longer hold the same state"
    return f"{left}: restore again on every rank, or stop."


class StateCheckError(_RebuiltFromFields, RuntimeError):
    """Raised on every rank, with the same fields, when checking the state a rank is about to write raised on some
    rank (the check itself failed: a tensor left on the meta device, memory running out; a non-finite value rejects
    instead). On a failing rank it is raised from that rank's own error.

    Every rank still joined the agreement, so none waits for another in it; nothing was decided, written, deleted or
    linked for the boundary, and the callback's state is what it was.

    Attributes:
        ranks: Ranks whose check raised (beyond eight ranks, the lowest of each eighth of the ranks).
        global_step: The step of the boundary (``trainer.global_step``, or what :meth:`GradientGuard.agree` got).
        cause: The first failing rank's error, as text.
    """

    _FIELDS = ("ranks", "global_step", "cause")

    def __init__(self, *, ranks: Sequence[int], global_step: int, cause: str | None) -> None:
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.global_step = global_step
        self.cause = cause
        super().__init__(
            f"Checking the state about to be written at global step {global_step} failed on {_rank_list(self.ranks)}: "
            f"{cause}. Nothing was written, deleted or linked for this boundary on any rank."
        )


__all__ = [
    "MEASURES", "CheckpointRestoreError", "CheckpointWriteError", "NonFiniteGradientError", "RewindRefusedError",
    "Spike", "StateCheckError", "describe_spikes", "rejection_text",
]
