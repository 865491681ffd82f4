"""Agreement: one collective per boundary, and the verdict every rank derives from it.

Each rank contributes a small integer summary of its window. One ``all_gather`` gives every rank every summary, so
every rank reaches the same verdict from the same data: no rank ever decides alone. The verdict is a pure function
of the gathered summaries (:func:`evaluate_reports`), mirroring how Lightning's ``EarlyStopping`` separates the
decision from the hook that applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_ckguard.agree.report import BoundaryReport
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


def evaluate_reports(reports: Sequence[RankReport], count_skipped_steps: bool) -> tuple[bool, str]:
    """Decide a boundary from every rank's report. Returns ``(accepted, reason)``; pure and deterministic."""
    state = [r.rank for r in reports if r.non_finite_state]
    if state:
        return False, f"non-finite state to be written on rank(s) {state}"
    rejecting = [r.rank for r in reports if r.rejects(count_skipped_steps)]
    if rejecting:
        return False, f"non-finite gradients recorded on rank(s) {rejecting}"
    skipped = max((r.skipped_steps for r in reports), default=0)
    if skipped:
        return True, f"finite; {skipped} step(s) skipped by the loss scaler or DeepSpeed were never applied"
    return True, "finite"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one boundary's agreement; identical on every rank."""

    accepted: bool
    reason: str
    global_step: int
    reports: tuple[RankReport, ...]
    parameter_names: tuple[str, ...]
    count_skipped_steps: bool = False

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks the rejection is attributed to (empty when accepted): those whose window (gradient history)
        rejects, or, when no window does, those whose state to be written is not finite."""
        gradients = tuple(r.rank for r in self.reports if r.rejects_gradients(self.count_skipped_steps))
        return gradients or tuple(r.rank for r in self.reports if r.non_finite_state)

    @property
    def num_steps(self) -> int:
        """Largest number of counted non-finite steps any rank saw."""
        return max((r.counted_steps(self.count_skipped_steps) for r in self.reports), default=0)

    @property
    def skipped_steps(self) -> int:
        """Largest number of loss-scaler-skipped steps any rank saw."""
        return max((r.skipped_steps for r in self.reports), default=0)

    @property
    def first_step(self) -> int:
        """First counted non-finite optimizer step on any rank, ``-1`` if none."""
        firsts = [r.step_range(self.count_skipped_steps)[0] for r in self.reports]
        valid = [s for s in firsts if s >= 0]
        return min(valid) if valid else -1

    @property
    def last_step(self) -> int:
        """Last counted non-finite optimizer step on any rank, ``-1`` if none."""
        return max((r.step_range(self.count_skipped_steps)[1] for r in self.reports), default=-1)

    @property
    def non_finite_state(self) -> tuple[tuple[int, str], ...]:
        """``(rank, tensor name)`` of every non-finite state tensor about to be written, by rank; a rank with more than
        its names could carry adds ``(rank, "N more tensor(s)")``."""
        found: list[tuple[int, str]] = []
        for r in self.reports:
            found.extend((r.rank, name) for name in r.state_tensors)
            if r.non_finite_state > len(r.state_tensors):
                found.append((r.rank, f"{r.non_finite_state - len(r.state_tensors)} more tensor(s)"))
        return tuple(found)

    @property
    def parameters(self) -> tuple[str, ...]:
        """Names of offending parameters reported by the rejecting ranks, in parameter order."""
        indices = sorted({i for r in self.reports if r.rejects(self.count_skipped_steps) for i in r.parameter_indices})
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
            pending_rejection=any(r.pending_rejection for r in self.reports),
            non_finite_state=self.non_finite_state,
        )

    def to_error(self) -> NonFiniteGradientError:
        """The error every rank raises for a rejected boundary."""
        if self.accepted:
            raise ValueError("An accepted verdict has no error.")
        return self.report(boundary="agreement").to_error()


def reach_verdict(
    gathered: Tensor, global_step: int, parameter_names: Sequence[str], count_skipped_steps: bool
) -> Verdict:
    """Turn the gathered ``[world_size, SUMMARY_SIZE (+ STATE_SUMMARY_SIZE)]`` summaries into a verdict."""
    rows = gathered.to("cpu").tolist()
    reports = tuple(RankReport.from_summary(rank, row) for rank, row in enumerate(rows))
    accepted, reason = evaluate_reports(reports, count_skipped_steps)
    return Verdict(accepted, reason, global_step, reports, tuple(parameter_names), count_skipped_steps)


AllGather = Callable[[Tensor], Tensor]


def all_gather_for(collective: Any | None) -> AllGather:
    """Adapt what the caller has to one ``all_gather`` returning ``[world_size, ...]``.

    Accepts a Lightning or Fabric strategy (its ``all_gather``, so the strategy's process group and timeout apply),
    a ``torch.distributed`` process group, or ``None`` for a single process.
    """
    if collective is None:
        return lambda tensor: tensor.unsqueeze(0)
    if isinstance(collective, dist.ProcessGroup):
        group = collective

        def gather_group(tensor: Tensor) -> Tensor:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, tensor, group=group)
            return torch.stack(parts)

        return gather_group
    strategy_all_gather = getattr(collective, "all_gather", None)
    if not callable(strategy_all_gather):
        raise ValueError(
            f"`collective` must be a Lightning/Fabric strategy, a torch.distributed ProcessGroup or None, "
            f"got {type(collective).__name__}."
        )

    def gather_strategy(tensor: Tensor) -> Tensor:
        gathered = strategy_all_gather(tensor)
        # single-device strategies return the tensor unchanged
        return gathered if gathered.dim() > tensor.dim() else gathered.unsqueeze(0)

    return gather_strategy
