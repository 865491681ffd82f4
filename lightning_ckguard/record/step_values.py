"""Per-step values of the window for a spike gate: each optimizer step's loss and gradient sum of squares, on the
device, in a buffer of a fixed size.

Recording a step writes a few numbers into one slot of a small float64 matrix with five to seven tiny kernels; nothing
is read back to the host and nothing is communicated. At a boundary the whole matrix (:meth:`StepValues.summary`,
``ROWS x capacity`` words, whatever the window's length) is summed over the ranks in one all-reduce, and every rank
reads the same global values from it (``lightning_ckguard.agree.spikes``).

Rows, one column per slot:

- ``LOSS``: the step's loss on this rank (the sum of the micro-batch losses it was given);
- ``LOSS_SEEN``: 1 where this rank gave a loss for the step, so the global loss is the mean over the ranks that did;
- ``SHARDED``: the sum of squares of the gradients this rank alone applies (a ZeRO partition, an FSDP shard), summed
  over the ranks as it is;
- ``REPLICATED``: the sum of squares of gradients every rank holds whole (DDP): the same on every rank, so the sum
  over the ranks is divided by the world size;
- ``INVALID``: how many of the slot's steps were not finite on this rank (their gradients; their sum of squares is not
  finite either) and kept in its values: the finiteness check owns such a step, and a spike gate neither judges nor
  learns its slot. A step every rank leaves out alike (not finite where the gradients are replicated, or skipped by
  a loss scaler: ``record_step(left_out=...)``) adds nothing to its slot, so it hides none of its slot's other steps.
  A non-finite loss needs no row of its own: it leaves its slot's ``LOSS`` not finite, on every rank once summed,
  and a spike gate leaves that slot's loss unjudged (in a folded window the larger value wins, so its neighbours'
  losses too) but judges its gradient norm: the loss hides no spike of the gradients.

A step's losses come first (:meth:`StepValues.add_loss`, every micro-batch's, as its backward runs), then its
gradients' values (:meth:`StepValues.record_step`), which write the whole step into its slot: a boundary between two
steps, or between two micro-batches of one, finds every recorded step complete, and a micro-batch's loss given before
it waits for its step.

A window longer than ``capacity`` steps is folded: when the buffer is full, each pair of neighbouring slots becomes
one (each row's larger value), and every slot from then on holds twice as many steps. Within a slot every rank keeps
its own largest value, so the global value of a folded slot is the largest step's or above it: a fold can only make
a spike more visible, never hide one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOSS, LOSS_SEEN, SHARDED, REPLICATED, INVALID = range(5)
ROWS = 5
_VALUE_ROWS = [LOSS, SHARDED, REPLICATED]  # the rows a slot holds -inf in until a step gives it values
#: Slots per window by default: a window of up to this many optimizer steps is judged step by step.
DEFAULT_CAPACITY = 256


class StepValues:
    """The per-step values of one rank's window (see the module docstring), with their step labels on the host.

    The step under way collects its losses in one small vector, and recording its gradients writes that vector into
    the step's slot with one copy (merged with the slot's other steps, for a step that joins a folded slot): five tiny
    kernels per step, six or seven in a folded window, every view made once here.

    Args:
        device: Where the values live (the gradients' device, so recording needs no copy).
        capacity: Slots in the buffer, a power of two; longer windows are folded.
    """

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"`capacity` must be a power of two of at least 2, got {capacity!r}.")
        self.device = torch.device(device)
        self.capacity = capacity
        # a slot's LOSS and squares hold -inf until a step gives it values (so that merging is a plain maximum,
        # negative losses included); the summary reads a loss as 0 there
        self.values = torch.zeros(ROWS, capacity, dtype=torch.float64, device=self.device)
        self.values[_VALUE_ROWS] = -math.inf
        self.labels: list[list[int]] = []  # per used slot, [first step, last step] (host ints)
        self._steps_in_last_slot = 0
        self.steps_per_slot = 1
        # the step under way, one value per row, as it starts: no loss yet, but LOSS_SEEN set for the loss to come,
        # so that giving one is a single kernel (a step that gets none has LOSS and LOSS_SEEN replaced once, at its
        # end); its row views and each slot's column views are made once
        self._fresh_step = torch.zeros(ROWS, dtype=torch.float64, device=self.device)
        self._fresh_step[LOSS_SEEN] = 1.0
        self._no_loss = torch.tensor([-math.inf, 0.0], dtype=torch.float64, device=self.device)  # LOSS, LOSS_SEEN
        self._step = self._fresh_step.clone()
        self._step_rows = self._step.unbind(0)
        self._loss_rows = self._step[LOSS : LOSS_SEEN + 1]
        self._columns = self.values.unbind(1)
        self._column_values = [column[:INVALID] for column in self._columns]  # every row but INVALID (the last)
        self._column_counts = [column[INVALID] for column in self._columns]
        self._loss_given = False
        # what a step left out of the values leaves in its slot: nothing (no loss, no squares, not counted)
        self._left_out = torch.zeros(ROWS, dtype=torch.float64, device=self.device)
        self._left_out[_VALUE_ROWS] = -math.inf

    def add_loss(self, loss: Tensor | float) -> None:
        """Add a micro-batch's loss to the step under way, the next one :meth:`record_step` records (device-side; a
        float is taken as it is)."""
        with torch.no_grad():
            if isinstance(loss, Tensor):
                if loss.device != self.device:
                    loss = loss.to(self.device, non_blocking=True)
                if loss.dim():
                    loss = loss.reshape(())
            self._step_rows[LOSS].add_(loss)
            self._loss_given = True

    def record_step(self, sharded: Tensor | None, replicated: Tensor | None, invalid: Tensor, step: int,
                    left_out: Tensor | bool | None = None) -> None:
        """Complete the step under way, labelled ``step``, with its gradients' sums of squares (0-d float64 tensors,
        None where a kind is absent) and whether they were finite (``invalid``, a 0-d bool tensor), and write it into
        its slot. Its loss is what :meth:`add_loss` gave since the last step.

        ``left_out`` (a 0-d bool tensor or a bool) leaves the step out of the values: its slot keeps its other steps'
        values as they are, and a slot of such steps only has none. Every rank must leave out the same steps (a
        step that was not finite where the gradients are replicated, one a loss scaler skipped): the slot's global
        value is every rank's. A step that was not finite and not left out makes its whole slot not judged."""
        self._complete_step(sharded, replicated, invalid)
        self._place(self._step, step, left_out)
        self._start_next_step()

    def hold_step(self, sharded: Tensor | None, replicated: Tensor | None, invalid: Tensor) -> Tensor:
        """:meth:`record_step` for a step whose outcome comes later (DeepSpeed tells after the step whether it skipped
        it): the step under way, completed, taken aside (its losses with it, so that the next step's start afresh);
        :meth:`place_step` writes it into its slot."""
        self._complete_step(sharded, replicated, invalid)
        held = self._step.clone()
        self._start_next_step()
        return held

    def place_step(self, held: Tensor, step: int, left_out: Tensor | bool | None = None) -> None:
        """Write a step :meth:`hold_step` took aside into its slot, labelled ``step`` (``left_out``: as in
        :meth:`record_step`)."""
        self._place(held, step, left_out)

    def _complete_step(self, sharded: Tensor | None, replicated: Tensor | None, invalid: Tensor) -> None:
        if sharded is not None:
            self._step_rows[SHARDED].copy_(sharded)
        if replicated is not None:
            self._step_rows[REPLICATED].copy_(replicated)
        self._step_rows[INVALID].copy_(invalid)
        if not self._loss_given:
            self._loss_rows.copy_(self._no_loss)

    def _start_next_step(self) -> None:
        """The next step starts with no values and no loss given."""
        self._step.copy_(self._fresh_step)
        self._loss_given = False

    def _place(self, step_values: Tensor, step: int, left_out: Tensor | bool | None) -> None:
        slot = self._next_slot(step)
        if self.steps_per_slot == 1:  # a slot per step: the step or nothing, written straight into it
            if isinstance(left_out, Tensor):
                torch.where(left_out, self._left_out, step_values, out=self._columns[slot])
            else:
                self._columns[slot].copy_(self._left_out if left_out else step_values)
            return
        if isinstance(left_out, Tensor):
            step_values = torch.where(left_out, self._left_out, step_values)
        elif left_out:
            step_values = self._left_out
        # a folded window: the larger of each value (a NaN wins), the counts added
        values = self._column_values[slot]
        torch.maximum(values, step_values[:INVALID], out=values)
        self._column_counts[slot].add_(step_values[INVALID])

    def summary(self) -> Tensor:
        """This rank's values as ``ROWS * capacity`` float64 words on the device, to be summed over the ranks; a
        slot's loss where no step gave one is 0, its squares where every step was left out ``-inf`` (on every rank
        alike), and the slots past :attr:`labels` hold no values."""
        summary = self.values.clone()
        summary[LOSS] = torch.where(self.values[LOSS_SEEN] > 0, self.values[LOSS], 0.0)
        return summary.reshape(-1)

    def reset(self, *, discard_step_under_way: bool = False) -> None:
        """Start a fresh window. The losses of a step under way (micro-batches before a boundary) stay for it: the
        step completes in the new window, whatever the boundary decided. ``discard_step_under_way=True`` drops them
        too (after a rewind they are losses of weights that are gone): the next step holds only its own losses."""
        self.values.zero_()
        self.values[_VALUE_ROWS] = -math.inf
        self.labels.clear()
        self.steps_per_slot, self._steps_in_last_slot = 1, 0
        if discard_step_under_way:
            self._start_next_step()

    def _next_slot(self, step: int) -> int:
        """The slot of a new step (host arithmetic only), folding the buffer when it is full."""
        if self.labels and self._steps_in_last_slot < self.steps_per_slot:
            self.labels[-1][1] = step
            self._steps_in_last_slot += 1
            return len(self.labels) - 1
        if len(self.labels) == self.capacity:
            self._fold()
        self.labels.append([step, step])
        self._steps_in_last_slot = 1
        return len(self.labels) - 1

    def _fold(self) -> None:
        """Each pair of neighbouring slots as one: the larger of each value (a NaN wins), the counts added."""
        half = self.capacity // 2
        even, odd = self.values[:, 0::2], self.values[:, 1::2]
        folded = torch.maximum(even, odd)
        folded[INVALID] = even[INVALID] + odd[INVALID]
        self.values[:, :half] = folded
        self.values[:, half:] = 0
        self.values[_VALUE_ROWS, half:] = -math.inf
        self.labels = [[self.labels[2 * i][0], self.labels[2 * i + 1][1]] for i in range(half)]
        self.steps_per_slot *= 2


__all__ = ["DEFAULT_CAPACITY", "ROWS", "StepValues"]
