"""The spike gate: a boundary whose window holds a step whose loss or global gradient norm jumped far above its
baseline is rejected, though every value is finite.

Each rank records its steps' values on the device (:mod:`lightning_ckguard.record.step_values`); at the boundary one
all-reduce sums them, and every rank reads the same global value per step (:func:`global_values`) and judges it with
the same pure function (:func:`judge`) against the same baseline, so the decision is the same everywhere without a
word more.

**The baseline** of a measure is the median of its last ``SpikeGate.history`` values from accepted windows, with
1.4826 times their median absolute deviation (MAD) as its spread: both ignore the rare large value that a mean and a
variance (or their moving averages) would absorb, so a spike that slipped through, or a noisy phase, does not
teach the gate that spikes are normal; and neither drifts within a window, since only accepted windows are learned
(:meth:`SpikeHistory.learn`), after they are published. A rejected window, rewound or skipped, teaches nothing.

**A step spikes** when its value is both more than ``factor`` times the baseline and more than ``deviations``
spreads above it: the factor alone would fire on a small loss's ordinary noise (0.01 to 0.05), the deviations alone
on a very steady measure (a spread near zero). A baseline of 0 or below (a negative log-likelihood) has no "times":
there the factor asks the value to rise above the baseline by more than ``factor - 1`` times the baseline's size, which
for a positive baseline is the same rule (:func:`scores`). A measure with neither a size nor a spread (exactly 0 for
most of its history) cannot be judged, and never spikes. Until ``warmup_steps`` accepted values are learned, nothing
spikes.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import statistics
import struct
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_ckguard.errors import MEASURES, Spike
from lightning_ckguard.record import step_values as rows

Measure = Literal["loss", "grad_norm"]
#: The spread of a normal distribution is 1.4826 times its median absolute deviation.
_MAD_TO_SPREAD = 1.4826


@dataclass(frozen=True)
class SpikeGate:
    """Reject a boundary whose window holds a step whose loss or global gradient norm spiked, though finite.

    Off unless given (``FiniteGradCheckpoint(spike_gate=SpikeGate())``, ``GradientGuard(module,
    spike_gate=SpikeGate())``). The rejection goes through the callback's ``on_non_finite`` policy, so
    ``"rewind"`` goes back to the last good checkpoint and trains on past the bad batches.

    Args:
        measures: The measures watched: ``"loss"`` (the mean over the ranks of each optimizer step's loss, what
            ``training_step`` returned, summed over the micro-batches of an accumulated step as Lightning scales
            them; taken as each backward starts, so with manual optimization what ``manual_backward`` was given)
            and ``"grad_norm"`` (the 2-norm of all gradients the step applied, over every rank's shard).
        factor: A step spikes when its value is more than ``factor`` times the baseline (the median of the accepted
            history; below 0, a negative log-likelihood say: when it rises above the baseline by more than
            ``factor - 1`` times the baseline's size) ...
        deviations: ... and more than ``deviations`` robust standard deviations above it (1.4826 times the
            history's median absolute deviation).
        warmup_steps: Accepted window values learned before anything can spike. A window of up to ``resolution``
            steps gives one value per step; a longer one is folded, and each of its values stands for the largest of
            2, 4, ... steps, so a long window teaches fewer values than it has steps (steps whose values were not
            finite teach none).
        history: Accepted window values the baseline is taken over (the most recent ones), counted as for
            ``warmup_steps``: one per step of a window up to ``resolution`` steps, one per folded slot beyond.
        resolution: Steps a window holds one by one; in a longer window each value stands for the largest of 2, 4,
            ... neighbouring steps, and the boundary's all-reduce stays ``5 * resolution`` float64 words.

    Raises:
        ValueError: For an unknown or repeated measure, no measure, ``factor`` not above 1, ``deviations`` not
            positive, a negative ``warmup_steps``, a ``history`` below 8 or below ``warmup_steps``, or a
            ``resolution`` that is not a power of two of at least 2.
    """

    measures: tuple[Measure, ...] = ("loss", "grad_norm")
    factor: float = 10.0
    deviations: float = 20.0
    warmup_steps: int = 100
    history: int = 1000
    resolution: int = rows.DEFAULT_CAPACITY

    def __post_init__(self) -> None:
        given = self.measures
        measures = (given,) if isinstance(given, str) else tuple(given) if isinstance(given, Sequence) else ()
        if not measures or any(m not in MEASURES for m in measures) or len(set(measures)) != len(measures):
            raise ValueError(f"`SpikeGate(measures=...)` takes one or both of {MEASURES}, each once; got "
                             f"{self.measures!r}.")
        object.__setattr__(self, "measures", measures)
        # numpy scalars too (a sweep's grid yields them), kept as plain Python numbers so the gate stays a plain value
        for name, low in (("factor", 1.0), ("deviations", 0.0)):
            value = getattr(self, name)
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not number or not _finite(value) or value <= low:
                raise ValueError(f"`SpikeGate({name}=...)` must be a finite number above {low:g}, got {value!r}.")
            object.__setattr__(self, name, float(value))
        for name, least in (("warmup_steps", 0), ("history", 8), ("resolution", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"`SpikeGate({name}=...)` must be an integer of at least {least}, got {value!r}.")
            object.__setattr__(self, name, int(value))
        if self.history < self.warmup_steps:
            raise ValueError(f"`SpikeGate(history={self.history})` must hold at least `warmup_steps` "
                             f"({self.warmup_steps}) values, or the warm-up never ends.")
        if self.resolution & (self.resolution - 1):
            raise ValueError(f"`SpikeGate(resolution=...)` must be a power of two, got {self.resolution!r}.")


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int beyond any float
        return False


@dataclass(frozen=True)
class StepMeasures:
    """One window's global values, the same on every rank: per measure, one value per slot (None where a step was
    not finite, or gave no loss), and each slot's first and last step."""

    values: dict[str, tuple[float | None, ...]]
    labels: tuple[tuple[int, int], ...]

    def first(self, slots: int) -> StepMeasures:
        """The window's first ``slots`` slots (every slot, if it holds no more)."""
        if slots >= len(self.labels):
            return self
        return StepMeasures({m: v[:slots] for m, v in self.values.items()}, self.labels[:slots])


def global_values(words: Sequence[float], capacity: int, labels: Sequence[Sequence[int]], world_size: int
                  ) -> StepMeasures:
    """Read the step values summed over every rank (``rows.ROWS * capacity`` words) into global ones: the loss as
    the mean over the ranks that gave one, the gradient norm from the partitions' squares plus the replicated squares
    once. A slot that holds a step whose gradients were not finite on some rank (and not left out) has no values; one
    whose steps were all left out has no gradient norm (its squares are ``-inf``). A loss that was not finite on some
    rank leaves only its slot's loss unjudged: the gradient norm of a step beside it is judged as ever."""
    table = [words[row * capacity : (row + 1) * capacity] for row in range(rows.ROWS)]
    loss: list[float | None] = []
    grad_norm: list[float | None] = []
    for slot in range(len(labels)):
        if table[rows.INVALID][slot] > 0:  # a rank's gradients were not finite: the finiteness check's slot
            loss.append(None)
            grad_norm.append(None)
            continue
        total, seen = table[rows.LOSS][slot], table[rows.LOSS_SEEN][slot]
        loss.append(total / seen if seen > 0 and math.isfinite(total) else None)
        squares = table[rows.SHARDED][slot] + table[rows.REPLICATED][slot] / world_size
        grad_norm.append(math.sqrt(squares) if squares >= 0 else None)
    return StepMeasures({"loss": tuple(loss), "grad_norm": tuple(grad_norm)},
                        tuple((int(first), int(last)) for first, last in labels))


@dataclass(frozen=True)
class Level:
    """Where a measure stood at a boundary: its baseline (None during the warm-up) and the window's largest value
    (None if the window had no finite one)."""

    measure: str
    baseline: float | None
    window_max: float | None


@dataclass(frozen=True)
class SpikeCheck:
    """What the gate found at one boundary: the spikes (empty: none) and each watched measure's level."""

    spikes: tuple[Spike, ...] = ()
    levels: tuple[Level, ...] = ()


class SpikeHistory:
    """The accepted values of each watched measure, the most recent ``gate.history`` of them (host-side)."""

    def __init__(self, gate: SpikeGate) -> None:
        self.gate = gate
        self.values: dict[str, deque[float]] = {measure: deque(maxlen=gate.history) for measure in gate.measures}

    def baseline(self, measure: str) -> tuple[float, float] | None:
        """``(median, spread)`` of the measure's accepted values, or None until the warm-up is over."""
        values = self.values[measure]
        if not values or len(values) < self.gate.warmup_steps:
            return None
        median = statistics.median(values)
        return median, _MAD_TO_SPREAD * statistics.median(abs(v - median) for v in values)

    def learn(self, measures: StepMeasures) -> None:
        """Learn an accepted, published window's values (its finite ones)."""
        for measure, history in self.values.items():
            history.extend(v for v in measures.values[measure] if v is not None and math.isfinite(v))

    def state_dict(self) -> dict[str, list[float]]:
        """The accepted values of each watched measure, oldest first, as plain floats."""
        return {measure: list(values) for measure, values in self.values.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up the accepted values :meth:`state_dict` gave (an earlier fit's): for each watched measure, the most
        recent ``gate.history`` of them, in place of this history's. A measure the gate does not watch is left out;
        one it watches that ``state`` lacks starts empty.

        Raises:
            ValueError: If ``state`` is not a mapping of measures to lists of finite numbers.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"A spike history must be a mapping of measures to values, got {state!r}.")
        loaded = {measure: _finite_values(measure, state.get(measure, ())) for measure in self.values}
        for measure, values in loaded.items():
            self.values[measure].clear()
            self.values[measure].extend(values)


def _finite_values(measure: str, values: Any) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError(f"The spike history of {measure!r} must be a list of finite numbers, got {values!r}.")
    return [float(v) for v in values]


def scores(value: float, median: float, spread: float) -> tuple[float, float]:
    """How far ``value`` stands above a baseline ``(median, spread)``: ``(ratio, deviations)``, to be compared with
    the gate's ``factor`` and ``deviations``. ``ratio`` is ``value / median`` for a positive median; for any median,
    ``1 + (value - median) / |median|`` (the rise in units of the baseline's size), infinite for a rise above a
    median of 0. ``deviations`` is the rise in spreads, infinite for a rise above a spread of 0."""
    rise = value - median
    ratio = value / median if median > 0 else (1 + rise / -median if median < 0 else (math.inf if rise > 0 else 1.0))
    deviations = rise / spread if spread > 0 else (math.inf if rise > 0 else 0.0)
    return ratio, deviations


def judge(gate: SpikeGate, history: SpikeHistory, measures: StepMeasures) -> SpikeCheck:
    """The spikes of a window and the levels of its measures; pure and deterministic, so every rank reaches the same
    from the same global values and the same accepted history."""
    spikes: list[Spike] = []
    levels: list[Level] = []
    for measure in gate.measures:
        values = measures.values[measure]
        present = [v for v in values if v is not None]
        baseline = history.baseline(measure)
        levels.append(Level(measure, baseline[0] if baseline else None, max(present) if present else None))
        if baseline is None:
            continue
        median, spread = baseline
        if median == 0 and spread == 0:  # no size and no spread: nothing to judge a rise by
            continue
        for value, (first, last) in zip(values, measures.labels, strict=True):
            if value is None:
                continue
            ratio, deviations = scores(value, median, spread)
            if ratio > gate.factor and deviations > gate.deviations:
                spikes.append(Spike(measure, first, last, value, median, ratio, deviations))
    spikes.sort(key=lambda spike: (spike.first_step, MEASURES.index(spike.measure)))
    return SpikeCheck(tuple(spikes), tuple(levels))


def judged_alike_words(history: SpikeHistory, slots: int, steps_per_slot: int) -> list[int]:
    """What the ranks must agree on to judge a window alike, besides the summed step values, as five int64 words for
    an all-reduce with MAX: a 56-bit digest of the gate's settings and its accepted history, and its negation; minus
    the slots of this rank's window (a rank whose exception came before its step was recorded holds one fewer); the
    steps per slot of its window, and its negation. Read by :func:`read_judged_alike`."""
    gate = history.gate
    settings = [gate.factor, gate.deviations, gate.warmup_steps, gate.history, gate.resolution]
    digest = hashlib.blake2b(" ".join(gate.measures).encode() + struct.pack("<5d", *settings), digest_size=7)
    for measure, values in history.values.items():
        digest.update(measure.encode())
        digest.update(struct.pack(f"<q{len(values)}d", len(values), *values))
    value = int.from_bytes(digest.digest(), "little")
    return [value, -value, -slots, steps_per_slot, -steps_per_slot]


@dataclass(frozen=True)
class JudgedAlike:
    """What :func:`read_judged_alike` found: whether every rank holds the same gate and history, whether every
    rank's window is folded alike (its slots hold the same steps), and the fewest slots any rank's window holds (the
    slots every rank judges: one held by some ranks only has some ranks' values)."""

    histories: bool = True
    folds: bool = True
    slots: int | None = None


def read_judged_alike(reduced: Sequence[int]) -> JudgedAlike:
    """:func:`judged_alike_words` reduced with MAX; everything alike without them (no gate)."""
    if not reduced:
        return JudgedAlike()
    return JudgedAlike(int(reduced[0]) == -int(reduced[1]), int(reduced[3]) == -int(reduced[4]), -int(reduced[2]))


__all__ = ["Level", "SpikeCheck", "SpikeGate", "SpikeHistory", "StepMeasures", "global_values", "judge",
           "JudgedAlike", "judged_alike_words", "read_judged_alike", "scores"]
