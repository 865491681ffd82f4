"""Per-step values of the window for a spike gate: each optimizer step's loss and gradient sum of squares, on the
device, in a buffer of a fixed size.

Recording a step writes a few numbers into one slot of a small float64 matrix with a handful of tiny kernels; nothing
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
- ``INVALID``: above 0 where the step's loss or gradients were not finite (their values there are not finite
  either): the finiteness check owns such a step, and a spike gate neither judges it nor learns from it.

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
        self._pending_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss_given = False
        self._open_slot: int | None = None  # the slot of a step whose loss may still come (a Trainer's batch end)

    def add_loss(self, loss: Tensor | float) -> None:
        """Add a micro-batch's loss to the step under way (device-side; a float is taken as it is)."""
        value = loss.detach() if isinstance(loss, Tensor) else torch.tensor(float(loss))
        self._pending_loss.add_(value.to(self.device, torch.float64, non_blocking=True).reshape(()))
        self._loss_given = True

    def record_step(self, sharded: Tensor | None, replicated: Tensor | None, invalid: Tensor, step: int) -> None:
        """A new optimizer step, labelled ``step``: its gradients' sums of squares (0-d float64 tensors, None where a
        kind is absent) and whether they were finite (``invalid``, a 0-d bool tensor). Its loss is what
        :meth:`add_loss` gave since the last step, plus what it gives until :meth:`close_step`."""
        self.close_step()
        slot = self._next_slot(step)
        zero = self._zero
        column = torch.stack([zero, zero, zero if sharded is None else sharded,
                              zero if replicated is None else replicated, invalid.to(torch.float64)])
        # a slot's value is the largest of its steps'
        torch.maximum(self.values[:, slot], column, out=self.values[:, slot])
        self._open_slot = slot

    def close_step(self) -> None:
        """The step's loss is complete: write it into the step's slot (a non-finite loss marks the step invalid)."""
        slot, self._open_slot = self._open_slot, None
        if slot is None or not self._loss_given:
            return
        loss = self._pending_loss
        column = self.values[:, slot]  # views by plain slicing: a list index would copy one to the device
        if self._slot_has_loss[slot]:  # the larger of the two (a NaN stays: the step is invalid then)
            torch.maximum(column[LOSS], loss, out=column[LOSS])
        else:  # the first loss of the slot, as it is (a negative one too: an empty slot's 0 is no loss)
            column[LOSS].copy_(loss)
            column[LOSS_SEEN].fill_(1.0)
            self._slot_has_loss[slot] = True
        column[INVALID].add_(loss.mul(0).ne(0))  # x * 0 is 0 for a finite x, NaN for NaN and both infinities
        self._pending_loss.zero_()
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
        self._pending_loss.zero_()
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
