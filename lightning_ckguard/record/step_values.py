"""Per-step values of the window for a spike gate: each optimizer step's loss and gradient sum of squares, on the
device, in a buffer of a fixed size.

Recording a step writes a few numbers into one slot of a small float64 matrix with about six tiny kernels; nothing
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
- ``INVALID``: above 0 where the step's gradients were not finite (their sum of squares is not finite either): the
  finiteness check owns such a step, and a spike gate neither judges it nor learns from it. A non-finite loss needs
  no row of its own: it leaves its slot's ``LOSS`` not finite, on every rank once summed, and a spike gate reads that
  the same way.

A window longer than ``capacity`` steps is folded: when the buffer is full, each pair of neighbouring slots becomes
one (each row's larger value), and every slot from then on holds twice as many steps. Within a slot every rank keeps
its own largest value, so the global value of a folded slot is the largest step's or above it: a fold can only make
a spike more visible, never hide one.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS, LOSS_SEEN, SHARDED, REPLICATED, INVALID = range(5)
ROWS = 5
#: Slots per window by default: a window of up to this many optimizer steps is judged step by step.
DEFAULT_CAPACITY = 256


class StepValues:
    """The per-step values of one rank's window (see the module docstring), with their step labels on the host.

    A step under way collects its values in one small vector, and closing it writes that vector into the step's slot
    with one copy (the larger values, for a step that joins a folded slot): about six tiny kernels per step, every
    view made once here.

    Args:
        device: Where the values live (the gradients' device, so recording needs no copy).
        capacity: Slots in the buffer, a power of two; longer windows are folded.
    """

    def __init__(self, device: torch.device, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"`capacity` must be a power of two of at least 2, got {capacity!r}.")
        self.device = torch.device(device)
        self.capacity = capacity
        self.values = torch.zeros(ROWS, capacity, dtype=torch.float64, device=self.device)
        self.labels: list[list[int]] = []  # per used slot, [first step, last step] (host ints)
        self._slot_has_loss: list[bool] = []  # per used slot: a loss was written into it
        self.steps_per_slot = 1
        self._steps_in_last_slot = 0
        # the step under way, one value per row; its row views and each slot's column are made once
        self._step = torch.zeros(ROWS, dtype=torch.float64, device=self.device)
        self._step_rows = self._step.unbind(0)
        self._columns = self.values.unbind(1)
        self._loss_given = False
        self._open_slot: int | None = None  # the slot of a step whose loss may still come (a Trainer's batch end)
        self._open_slot_is_fresh = False  # no earlier step of the window is in it

    def add_loss(self, loss: Tensor | float) -> None:
        """Add a micro-batch's loss to the step under way (device-side; a float is taken as it is)."""
        with torch.no_grad():
            if isinstance(loss, Tensor):
                if loss.device != self.device:
                    loss = loss.to(self.device, non_blocking=True)
                if loss.dim():
                    loss = loss.reshape(())
            if not self._loss_given:
                self._step_rows[LOSS_SEEN].fill_(1.0)
                self._loss_given = True
            self._step_rows[LOSS].add_(loss)

    def record_step(self, sharded: Tensor | None, replicated: Tensor | None, invalid: Tensor, step: int) -> None:
        """A new optimizer step, labelled ``step``: its gradients' sums of squares (0-d float64 tensors, None where a
        kind is absent) and whether they were finite (``invalid``, a 0-d bool tensor). Its loss is what
        :meth:`add_loss` gave since the last step, plus what it gives until :meth:`close_step`."""
        self.close_step()
        self._open_slot = self._next_slot(step)
        self._open_slot_is_fresh = self._steps_in_last_slot == 1
        if sharded is not None:
            self._step_rows[SHARDED].copy_(sharded)
        if replicated is not None:
            self._step_rows[REPLICATED].copy_(replicated)
        self._step_rows[INVALID].copy_(invalid)

    def close_step(self) -> None:
        """The step is complete: write it into its slot. A loss given with no step open waits for the next step."""
        slot, self._open_slot = self._open_slot, None
        if slot is None:
            return
        column = self._columns[slot]
        if self._open_slot_is_fresh:
            column.copy_(self._step)
        else:  # a folded slot keeps the largest of its steps' values (a NaN stays: the step is invalid then)
            merged = torch.maximum(column, self._step)
            if not self._loss_given:  # no loss this step: keep the slot's (0 from the step would lift a negative one)
                merged[LOSS] = column[LOSS]
            elif not self._slot_has_loss[slot]:  # the first loss of the slot, as it is (it may be negative)
                merged[LOSS] = self._step[LOSS]
            column.copy_(merged)
        if self._loss_given:
            self._slot_has_loss[slot] = True
        self._step.zero_()
        self._loss_given = False

    def summary(self) -> Tensor:
        """This rank's values as ``ROWS * capacity`` float64 words on the device, to be summed over the ranks; slots
        past :attr:`labels` are zero everywhere."""
        self.close_step()
        return self.values.reshape(-1)

    def reset(self) -> None:
        """Start a fresh window."""
        self.values.zero_()
        self.labels.clear()
        self._slot_has_loss.clear()
        self.steps_per_slot, self._steps_in_last_slot, self._open_slot = 1, 0, None
        self._step.zero_()
        self._loss_given = False

    def _next_slot(self, step: int) -> int:
        """The slot of a new step (host arithmetic only), folding the buffer when it is full."""
        if self.labels and self._steps_in_last_slot < self.steps_per_slot:
            self.labels[-1][1] = step
            self._steps_in_last_slot += 1
            return len(self.labels) - 1
        if len(self.labels) == self.capacity:
            self._fold()
        self.labels.append([step, step])
        self._slot_has_loss.append(False)
        self._steps_in_last_slot = 1
        return len(self.labels) - 1

    def _fold(self) -> None:
        half = self.capacity // 2
        even, odd = self.values[:, 0::2], self.values[:, 1::2]
        folded = torch.maximum(even, odd)
        # a loss only where a step gave one: the larger of two, else the one there is (it may be negative)
        both = (even[LOSS_SEEN] > 0) & (odd[LOSS_SEEN] > 0)
        folded[LOSS] = torch.where(both, folded[LOSS], torch.where(even[LOSS_SEEN] > 0, even[LOSS], odd[LOSS]))
        self.values[:, :half] = folded
        self.values[:, half:] = 0
        self.labels = [[self.labels[2 * i][0], self.labels[2 * i + 1][1]] for i in range(half)]
        self._slot_has_loss = [self._slot_has_loss[2 * i] or self._slot_has_loss[2 * i + 1] for i in range(half)]
        self.steps_per_slot *= 2
        self._steps_in_last_slot = self.steps_per_slot  # the last folded slot is full


__all__ = ["DEFAULT_CAPACITY", "ROWS", "StepValues"]
