"""Agreement: one fixed-size collective per accepted boundary, and the verdict every rank derives from it.

Each rank reads its own report (its window's summary and the state check's part) and casts a :func:`ballot`: a few
integers reduced with MAX over every rank (a MIN sent negated) into a :class:`Tally`, in one all-reduce whose bytes
do not grow with the world size. The tally holds all an accepted verdict needs, and which ranks to name if it
rejects: only then a second all-reduce, the :func:`roll_call` (summed, bounded: one slot per named rank), brings
those ranks' whole reports (steps, parameters, state tensors) and counts the rest. Every rank reaches the same
verdict from the same reduced words with a pure function (:func:`reach_verdict`): no rank ever decides alone,
mirroring how Lightning's ``EarlyStopping`` separates the decision from the hook that applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_ckguard._distributed import NO_VALUE, RankMap
from lightning_ckguard.agree.report import BoundaryReport
from lightning_ckguard.agree.spikes import SpikeCheck
from lightning_ckguard.errors import NonFiniteGradientError
from lightning_ckguard.record import window as w
from lightning_ckguard.record.state_check import decode_state_summary


@dataclass(frozen=True)
class RankReport:
    """What one rank recorded in its window."""

    rank: int
    non_finite_steps: int
    first_step: int
    last_step: int
    skipped_steps: int
    first_skipped_step: int
    last_skipped_step: int
    pending_rejection: bool
    num_parameters: int
    parameter_indices: tuple[int, ...]
    non_finite_state: int = 0
    state_tensors: tuple[str, ...] = ()

    @classmethod
    def from_summary(cls, rank: int, row: Sequence[int]) -> RankReport:
        """Read one rank's gathered summary vector: the window's (``NonFiniteWindow.summary``), then the state check's
        part (``lightning_ckguard.record.state_check``), if any."""
        non_finite_state, state_tensors = decode_state_summary(row[w.SUMMARY_SIZE :])
        return cls(
            rank=rank,
            non_finite_steps=row[w.APPLIED],
            first_step=row[w.FIRST_APPLIED],
            last_step=row[w.LAST_APPLIED],
            skipped_steps=row[w.SKIPPED],
            first_skipped_step=row[w.FIRST_SKIPPED],
            last_skipped_step=row[w.LAST_SKIPPED],
            pending_rejection=bool(row[w.PENDING]),
            num_parameters=row[w.NUM_PARAMETERS],
            parameter_indices=tuple(i for i in row[w.SUMMARY_HEADER : w.SUMMARY_SIZE] if i >= 0),
            non_finite_state=non_finite_state,
            state_tensors=state_tensors,
        )

    def counted_steps(self, count_skipped_steps: bool) -> int:
        """Non-finite steps that count against this rank: applied ones, plus skipped ones if they count."""
        return self.non_finite_steps + (self.skipped_steps if count_skipped_steps else 0)

    def step_range(self, count_skipped_steps: bool) -> tuple[int, int]:
        """First and last counted non-finite step, ``-1`` where there is none."""
        firsts = [self.first_step] + ([self.first_skipped_step] if count_skipped_steps else [])
        lasts = [self.last_step] + ([self.last_skipped_step] if count_skipped_steps else [])
        valid_firsts = [s for s in firsts if s >= 0]
        return (min(valid_firsts) if valid_firsts else -1, max(lasts))

    def rejects_gradients(self, count_skipped_steps: bool) -> bool:
        """Whether this rank's window (its gradient history) rejects the boundary."""
        return self.pending_rejection or self.counted_steps(count_skipped_steps) > 0

    def rejects(self, count_skipped_steps: bool) -> bool:
        """Whether this rank rejects the boundary: its window does, or its state to be written is not finite (whatever
        ``count_skipped_steps`` says)."""
        return self.non_finite_state > 0 or self.rejects_gradients(count_skipped_steps)


#: Up to how many offending ranks a rejection names (every one of them, up to this world size); the rest are counted.
NAMED_RANKS = RankMap(16)

# Layout of the tally: fields reduced with MAX (the first step, a MIN, is sent negated), then the named ranks.
REJECTS_GRADIENTS, NON_FINITE_STATE, COUNTED_STEPS, FIRST_STEP, LAST_STEP, SKIPPED_STEPS, PENDING = range(7)
TALLY_HEADER = 7
#: int64 words every rank sends, and receives, on an accepted boundary (before what rides along), at any world size.
TALLY_SIZE = TALLY_HEADER + NAMED_RANKS.slots


@dataclass(frozen=True)
class Tally:
    """What every rank's ballot (:func:`ballot`) reduced to: all a verdict needs when nothing is wrong, and which
    ranks to name when something is.

    Attributes:
        rejects_gradients: Some rank's window rejects (non-finite steps that count, or a pending rejection).
        non_finite_state: Some rank's state to be written is not finite.
        counted_steps: The largest count of counted non-finite steps any rank saw.
        first_step: The first counted non-finite step on any rank, ``-1`` if none.
        last_step: The last counted non-finite step on any rank, ``-1`` if none.
        skipped_steps: The largest count of steps a loss scaler skipped on any rank.
        pending_rejection: Some rank still holds the weights of a rejected boundary.
        named_ranks: The offending ranks a rejection names (:data:`NAMED_RANKS`), rejecting gradients first.
    """

    rejects_gradients: bool = False
    non_finite_state: bool = False
    counted_steps: int = 0
    first_step: int = -1
    last_step: int = -1
    skipped_steps: int = 0
    pending_rejection: bool = False
    named_ranks: tuple[int, ...] = ()

    @classmethod
    def from_words(cls, words: Sequence[int], world_size: int) -> Tally:
        """Read the reduced ballots (``TALLY_SIZE`` words)."""
        return cls(
            rejects_gradients=bool(words[REJECTS_GRADIENTS]),
            non_finite_state=bool(words[NON_FINITE_STATE]),
            counted_steps=int(words[COUNTED_STEPS]),
            first_step=-int(words[FIRST_STEP]) if words[FIRST_STEP] != NO_VALUE else -1,
            last_step=int(words[LAST_STEP]),
            skipped_steps=int(words[SKIPPED_STEPS]),
            pending_rejection=bool(words[PENDING]),
            named_ranks=NAMED_RANKS.ranks(words[TALLY_HEADER:TALLY_SIZE], world_size),
        )

    @property
    def rejects(self) -> bool:
        """Whether the boundary is rejected."""
        return self.rejects_gradients or self.non_finite_state


def ballot(report: RankReport, world_size: int, count_skipped_steps: bool) -> list[int]:
    """This rank's ``TALLY_SIZE`` words for the tally, from its own report; every rank's are reduced with MAX."""
    first, last = report.step_range(count_skipped_steps)
    gradients = report.rejects_gradients(count_skipped_steps)
    header = [int(gradients), int(report.non_finite_state > 0), report.counted_steps(count_skipped_steps),
              -first if first >= 0 else NO_VALUE, last, report.skipped_steps, int(report.pending_rejection)]
    named = NAMED_RANKS.words(report.rank, world_size, report.rejects(count_skipped_steps), priority=int(gradients))
    return header + named


#: Layout of the roll call: the number of ranks rejecting on their gradients and of ranks with non-finite state
#: (summed), then one summary per named rank, in the order of ``Tally.named_ranks``.
ROLL_HEADER = 2


def roll_call(report: RankReport, summary: Sequence[int], tally: Tally, count_skipped_steps: bool) -> list[int]:
    """This rank's words for the roll call of a rejected boundary, reduced with SUM: it counts itself, and a named
    rank puts its whole ``summary`` (what it recorded: steps, parameters, state tensors) in its slot, the only one
    there."""
    width = len(summary)
    words = [int(report.rejects_gradients(count_skipped_steps)), int(report.non_finite_state > 0)]
    words += [0] * (NAMED_RANKS.slots * width)
    if report.rank in tally.named_ranks:
        start = ROLL_HEADER + tally.named_ranks.index(report.rank) * width
        words[start : start + width] = summary
    return words


@dataclass(frozen=True)
class RollCall:
    """The roll call read back: the named ranks' reports, and how many ranks reject on gradients or on state."""

    reports: tuple[RankReport, ...] = ()
    rejecting_gradients: int = 0
    non_finite_state: int = 0

    @classmethod
    def from_words(cls, words: Sequence[int], tally: Tally, width: int) -> RollCall:
        """Read the summed roll call of ``tally``'s named ranks, each summary ``width`` words."""
        reports = tuple(
            RankReport.from_summary(rank, words[ROLL_HEADER + i * width : ROLL_HEADER + (i + 1) * width])
            for i, rank in enumerate(tally.named_ranks)
        )
        return cls(reports, int(words[0]), int(words[1]))


@dataclass(frozen=True)
class Verdict:
    """The outcome of one boundary's agreement; identical on every rank.

    ``reports`` are the reports of the ranks a rejection names (none when accepted): every offending rank up to
    16 ranks, beyond that the lowest offending rank of each sixteenth of the ranks (those rejecting on their
    gradients first); ``unnamed_ranks`` counts the ranks the rejection is attributed to that are not named. The
    steps and counts come from every rank (``tally``). With a spike gate, ``spike_check`` holds what it found: a
    spike rejects by itself, and names no rank (its values are global).
    """

    accepted: bool
    reason: str
    global_step: int
    reports: tuple[RankReport, ...]
    parameter_names: tuple[str, ...]
    count_skipped_steps: bool = False
    tally: Tally = field(default_factory=Tally)
    unnamed_ranks: int = 0
    spike_check: SpikeCheck = field(default_factory=SpikeCheck)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The named ranks the rejection is attributed to (empty when accepted): those whose window (gradient
        history) rejects, or, when no window does, those whose state to be written is not finite."""
        gradients = tuple(r.rank for r in self.reports if r.rejects_gradients(self.count_skipped_steps))
        return gradients or tuple(r.rank for r in self.reports if r.non_finite_state)

    @property
    def num_steps(self) -> int:
        """Largest number of counted non-finite steps any rank saw."""
        return self.tally.counted_steps

    @property
    def skipped_steps(self) -> int:
        """Largest number of loss-scaler-skipped steps any rank saw."""
        return self.tally.skipped_steps

    @property
    def first_step(self) -> int:
        """First counted non-finite optimizer step on any rank, ``-1`` if none."""
        return self.tally.first_step

    @property
    def last_step(self) -> int:
        """Last counted non-finite optimizer step on any rank, ``-1`` if none."""
        return self.tally.last_step

    @property
    def non_finite_state(self) -> tuple[tuple[int, str], ...]:
        """``(rank, tensor name)`` of every non-finite state tensor about to be written, by named rank; a rank with
        more than its names could carry adds ``(rank, "N more tensor(s)")``."""
        found: list[tuple[int, str]] = []
        for r in self.reports:
            found.extend((r.rank, name) for name in r.state_tensors)
            if r.non_finite_state > len(r.state_tensors):
                found.append((r.rank, f"{r.non_finite_state - len(r.state_tensors)} more tensor(s)"))
        return tuple(found)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Names of the parameters with non-finite gradients on the named rejecting ranks, in parameter order: of the
        ranks whose counted steps reject, when some do, so that a rank named only for its state or a pending
        rejection adds no parameter of the steps its loss scaler skipped; else of every named rank (skipped steps
        only). A rank's record counts applied and skipped steps alike: one that had both may still add a skipped
        step's parameter (the message says so)."""
        rejecting = [r for r in self.reports if r.rejects(self.count_skipped_steps)]
        counted = [r for r in rejecting if r.counted_steps(self.count_skipped_steps) > 0]
        indices = sorted({i for r in counted or rejecting for i in r.parameter_indices})
        return tuple(self.parameter_names[i] if i < len(self.parameter_names) else f"<parameter {i}>" for i in indices)

    def report(self, boundary: str) -> BoundaryReport:
        """Describe this verdict as decided at ``boundary`` (e.g. ``"validation end"``), for people and loggers."""
        return BoundaryReport(
            boundary=boundary,
            global_step=self.global_step,
            accepted=self.accepted,
            ranks=self.ranks,
            first_step=self.first_step,
            last_step=self.last_step,
            num_steps=self.num_steps,
            skipped_steps=self.skipped_steps,
            parameters=self.parameters,
            pending_rejection=self.tally.pending_rejection,
            non_finite_state=self.non_finite_state,
            unnamed_ranks=self.unnamed_ranks,
            spikes=self.spike_check.spikes,
            levels=self.spike_check.levels,
        )

    def to_error(self) -> NonFiniteGradientError:
        """The error every rank raises for a rejected boundary."""
        if self.accepted:
            raise ValueError("An accepted verdict has no error.")
        return self.report(boundary="agreement").to_error()


def reach_verdict(
    tally: Tally, roll: RollCall, global_step: int, parameter_names: Sequence[str], count_skipped_steps: bool,
    spike_check: SpikeCheck = SpikeCheck(),  # noqa: B008  # an immutable value
) -> Verdict:
    """The verdict of a boundary from its ``tally``, when it rejects its ``roll`` call, and what a spike gate found
    (``spike_check``); pure and deterministic, so every rank reaches the same one from the same reduced words."""
    gradients = [r.rank for r in roll.reports if r.rejects_gradients(count_skipped_steps)]
    state = [r.rank for r in roll.reports if r.non_finite_state]
    unnamed_gradients, unnamed_state = roll.rejecting_gradients - len(gradients), roll.non_finite_state - len(state)
    if tally.non_finite_state:
        accepted, reason = False, f"non-finite state to be written on rank(s) {_listed(state, unnamed_state)}"
    elif tally.rejects_gradients:
        accepted, reason = False, f"non-finite gradients recorded on rank(s) {_listed(gradients, unnamed_gradients)}"
    elif spike_check.spikes:
        accepted, reason = False, f"{len(spike_check.spikes)} spike(s): {spike_check.spikes[0].describe()}"
    elif tally.skipped_steps:
        accepted = True
        reason = f"finite; {tally.skipped_steps} step(s) skipped by the loss scaler or DeepSpeed were never applied"
    else:
        accepted, reason = True, "finite"
    unnamed = unnamed_gradients if gradients else unnamed_state
    return Verdict(accepted, reason, global_step, roll.reports, tuple(parameter_names), count_skipped_steps, tally,
                   max(unnamed, 0), spike_check)


def _listed(ranks: Sequence[int], unnamed: int) -> str:
    return f"{list(ranks)}" + (f" and {unnamed} more" if unnamed > 0 else "")


