"""The recording window: what one rank saw since the last published checkpoint, kept on the device.

Recording a step launches a handful of small kernels and never reads a value back to the host. The window is only
read at a boundary, as one small integer vector (:meth:`NonFiniteWindow.summary`) that the agreement gathers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_ckguard.record.finiteness import IndexTensors, NonFiniteCheck
from lightning_ckguard.record.squares import REPLICATED, FlagsAndSquares, FlagsWithoutSquares, SquaresLayout
from lightning_ckguard.record.step_values import StepValues

#: How many offending parameter indices each rank reports at a boundary.
MAX_REPORTED_PARAMETERS = 8

# Layout of the summary vector, before the parameter indices.
APPLIED, FIRST_APPLIED, LAST_APPLIED, SKIPPED, FIRST_SKIPPED, LAST_SKIPPED, PENDING, NUM_PARAMETERS = range(8)
SUMMARY_HEADER = 8
SUMMARY_SIZE = SUMMARY_HEADER + MAX_REPORTED_PARAMETERS


class NonFiniteWindow:
    """Device-side record of non-finite optimizer steps since the window was last reset.

    State, declared up front (all on ``device``):

    - ``step_counts[0]``: applied steps with a non-finite gradient; ``step_counts[1]``: steps a loss scaler skipped.
    - ``first_steps`` / ``last_steps``: the first and last such step of each kind, ``-1`` if none.
    - ``parameter_counts[i]``: non-finite steps seen in parameter ``i``'s gradient.

    Host-side: ``steps_recorded`` and ``pending_rejection`` (the last boundary was rejected and no step has been
    applied since, so the weights are still the rejected ones: a bool, or a 0-d device tensor after steps whose skip
    flag only the device knows), and at most one step whose outcome is not known yet (see :meth:`record_pending`).

    With ``step_values`` (a spike gate is on), each step's gradient sum of squares goes there too, from the same
    read of the gradients where one read serves both (:class:`~lightning_ckguard.record.squares.FlagsAndSquares`);
    ``squares=False`` (a gate that watches only the loss) reads the flags alone and records zero squares.
    """

    def __init__(self, device: torch.device, step_values: StepValues | None = None, squares: bool = True) -> None:
        self.device = torch.device(device)
        self.step_counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.first_steps = torch.full((2,), -1, dtype=torch.int64, device=self.device)
        self.last_steps = torch.full((2,), -1, dtype=torch.int64, device=self.device)
        self.parameter_counts = torch.zeros(0, dtype=torch.int32, device=self.device)
        self.steps_recorded = 0
        self.pending_rejection: bool | Tensor = False
        self._check = NonFiniteCheck()
        self.step_values = step_values
        self._indices = IndexTensors(self.device)
        self._false = torch.zeros((), dtype=torch.bool, device=self.device)
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # chosen once: whether a step's read of the gradients also sums their squares
        self._flags_and_squares: FlagsAndSquares | FlagsWithoutSquares = (
            FlagsAndSquares(self._check) if step_values is not None and squares
            else FlagsWithoutSquares(self._check, self._zero))
        # a step whose outcome is not known yet: whether it was finite, its step values taken aside, its label
        self._pending: tuple[Tensor, Tensor | None, int, SquaresLayout] | None = None
        self._every_index: tuple[int, ...] = ()
        # views of the applied-step entries, updated in place by the usual (not skipped) step
        self._applied_count, self._applied_first, self._applied_last = (
            self.step_counts[0], self.first_steps[0], self.last_steps[0])

    def record(
        self,
        indices: tuple[int, ...],
        grads: Sequence[Tensor],
        step: int,
        num_parameters: int,
        skipped: Tensor | bool | None = None,
        layout: SquaresLayout = REPLICATED,
    ) -> None:
        """Record one optimizer step: ``grads[j]`` is the local gradient of parameter ``indices[j]``.

        ``skipped`` is True (a 0-d device tensor or a bool) when a loss scaler skipped this step: it was never
        applied. ``layout``: how the gradients' sum of squares adds up over the ranks, for a spike gate.
        """
        self.settle(skipped=False)
        non_finite, squares = self._observe(indices, grads, num_parameters, layout)
        if self.step_values is not None:
            self.step_values.record_step(*self._squares_by_kind(squares, layout), non_finite, step,
                                         self._left_out(non_finite, layout, skipped))
        self._count(non_finite, step, skipped)

    def record_pending(self, indices: tuple[int, ...], grads: Sequence[Tensor], step: int, num_parameters: int,
                       layout: SquaresLayout = REPLICATED) -> None:
        """Record a step whose outcome (applied or skipped) is only known after the optimizer ran (DeepSpeed).

        :meth:`settle` completes it; a step still pending at the next record or summary counts as applied. Its step
        values (a spike gate's) are taken aside now, its losses with them, and placed then, so that a skipped step
        is left out of them like a loss scaler's.
        """
        self.settle(skipped=False)
        non_finite, squares = self._observe(indices, grads, num_parameters, layout)
        held = None
        if self.step_values is not None:
            held = self.step_values.hold_step(*self._squares_by_kind(squares, layout), non_finite)
        self._pending = (non_finite, held, step, layout)

    @property
    def has_pending_step(self) -> bool:
        """Whether a step recorded with :meth:`record_pending` awaits :meth:`settle`."""
        return self._pending is not None

    def settle(self, skipped: Tensor | bool) -> None:
        """Complete the pending step, if any: ``skipped`` says whether the optimizer skipped it."""
        if self._pending is not None:
            non_finite, held, step, layout = self._pending
            self._pending = None
            if self.step_values is not None and held is not None:
                self.step_values.place_step(held, step, self._left_out(non_finite, layout, skipped))
            self._count(non_finite, step, skipped)

    def _observe(self, indices: tuple[int, ...], grads: Sequence[Tensor], num_parameters: int,
                 layout: SquaresLayout) -> tuple[Tensor, Tensor]:
        """Read the step's gradients: whether they were finite, and their sum of squares (with a spike gate)."""
        self.steps_recorded += 1
        if num_parameters > self.parameter_counts.numel():
            grown = torch.zeros(num_parameters, dtype=torch.int32, device=self.device)
            grown[: self.parameter_counts.numel()] = self.parameter_counts
            self.parameter_counts = grown
            self._every_index = tuple(range(num_parameters))
        if not grads:  # an empty step's squares are zero, so that every rank fills the same slots
            return self._false, self._zero
        flags, squares = self._flags_and_squares(grads, self.device, layout.replicas)
        non_finite = flags.any()
        if indices == self._every_index:  # every parameter in index order (the usual step): no index tensor
            self.parameter_counts.add_(flags)
        else:
            self.parameter_counts.index_add_(0, self._indices(indices), flags.to(torch.int32))
        return non_finite, squares

    @staticmethod
    def _squares_by_kind(squares: Tensor, layout: SquaresLayout) -> tuple[Tensor | None, Tensor | None]:
        """A step's sum of squares for its step values: (sharded, replicated), the loss scale divided out."""
        scale = layout.scale
        if isinstance(scale, Tensor) or scale != 1.0:  # a device tensor is divided out on the device, never read
            squares = squares / (scale * scale)
        return (squares, None) if layout.sharded else (None, squares)

    def _left_out(self, non_finite: Tensor, layout: SquaresLayout, skipped: Tensor | bool | None) -> Tensor | bool:
        """Whether every rank leaves the step out of the step values alike: one a loss scaler or DeepSpeed skipped
        (its ranks share the verdict), or one not finite where the gradients are replicated (the same everywhere).
        A sharded step that was not finite on this rank only is not: it leaves its slot unjudged on every rank."""
        if not layout.sharded:
            return non_finite
        return self._skip_flag(skipped) if isinstance(skipped, Tensor) else bool(skipped)

    def _skip_flag(self, skipped: Tensor | bool) -> Tensor:
        """A skip flag (True, or a 0-d tensor of any dtype on any device) as a bool tensor on the window's device."""
        return skipped.to(self.device, torch.bool, non_blocking=True) if isinstance(skipped, Tensor) else self._true

    def _count(self, non_finite: Tensor, step: int, skipped: Tensor | bool | None) -> None:
        # a handful of tiny kernels per step; ``first`` is set from ``last`` the first time ``last`` is set
        if skipped is None or skipped is False:  # the usual step: only the applied-step counters can change
            counts, first, last, events = self._applied_count, self._applied_first, self._applied_last, non_finite
            self.pending_rejection = False  # a step ran: the weights are no longer the rejected ones
        else:
            skip = self._skip_flag(skipped)
            counts, first, last = self.step_counts, self.first_steps, self.last_steps
            events = torch.stack([non_finite & ~skip, skip])
            if self.pending_rejection is not False:  # a rejection stays pending only through steps never applied
                self.pending_rejection = skip if self.pending_rejection is True else self.pending_rejection & skip
        counts.add_(events)
        last.masked_fill_(events, step)
        torch.where(first < 0, last, first, out=first)

    def summary(self) -> Tensor:
        """This rank's window as an int64 vector of ``SUMMARY_SIZE`` on the device (boundary use only)."""
        self.settle(skipped=False)
        counts = self.parameter_counts
        num = counts.numel()
        reported = torch.full((MAX_REPORTED_PARAMETERS,), -1, dtype=torch.int64, device=self.device)
        if num:
            positions = torch.arange(num, device=self.device)
            # offending parameters sort first, in index order
            keys = torch.where(counts > 0, positions, positions + num)
            lowest = torch.topk(keys, min(MAX_REPORTED_PARAMETERS, num), largest=False).values
            reported[: lowest.numel()] = torch.where(lowest < num, lowest, -1)
        header = torch.stack(
            [
                self.step_counts[0],
                self.first_steps[0],
                self.last_steps[0],
                self.step_counts[1],
                self.first_steps[1],
                self.last_steps[1],
                torch.as_tensor(self.pending_rejection, device=self.device).to(torch.int64),
                (counts > 0).sum().to(torch.int64),
            ]
        )
        return torch.cat([header, reported])

    def reset(self, *, pending_rejection: bool = False, discard_step_under_way: bool = False) -> None:
        """Start a fresh window; ``pending_rejection`` carries a rejection until a step is applied (not skipped).

        The finiteness of a step is recorded whole, once its gradients are final, so no part of a step under way is
        kept here; its step values' losses (micro-batches before the boundary) are, for it, unless
        ``discard_step_under_way=True`` (:meth:`StepValues.reset`). A pending step is dropped either way."""
        self.step_counts.zero_()
        self.first_steps.fill_(-1)
        self.last_steps.fill_(-1)
        self.parameter_counts.zero_()
        self.steps_recorded = 0
        self._pending = None
        self.pending_rejection = pending_rejection
        if self.step_values is not None:
            self.step_values.reset(discard_step_under_way=discard_step_under_way)
