"""Rewind: recover from a rejected boundary in place, on every rank, from the last checkpoint published in this fit.

``FiniteGradCheckpoint(on_non_finite="rewind")`` keeps a :class:`RewindLog` per fit. It notes every checkpoint the
callback publishes (accepted and written); at a rejected boundary every rank restores, together and in place, the
most recent one through the strategy's own load path (:func:`restore_trainer_state`), so DDP, DDP +
``ZeroRedundancyOptimizer``, DeepSpeed ZeRO 1/2/3 and FSDP2 each restore their own shards. The decision to rewind is
the verdict, identical on every rank, and everything this module decides from (the published path, the history) is
the same on every rank: no rank decides alone.

What is restored: the model weights, the optimizer state (including its step counts), the LR schedulers (including
their step counts), the precision plugin's state (the loss scaler) and the state of weight-averaging callbacks
(``WeightAveraging``, ``EMAWeightAveraging``). What goes on: the loop progress (``trainer.global_step``, the epoch and
batch counters), the data loader, every other callback. The batches since the checkpoint are skipped, not replayed.

Fabric users restore from a path they choose with :func:`restore_fabric_state`, without a Trainer.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from lightning_ckguard._distributed import (
    DistributedCheckpointMeeting,
    agree_on_failure,
    broadcast_value,
    own_write_failure,
    write_errors,
)
from lightning_ckguard.agree.report import BoundaryReport
from lightning_ckguard.errors import CheckpointRestoreError, RewindRefusedError, Spike, describe_spikes
from lightning_ckguard.publish.staging import uses_distributed_checkpoint

#: The file, next to the checkpoints, that gets one JSON line per rewind (written by rank 0).
REWIND_LOG_NAME = "ckguard-rewinds.jsonl"

#: How many rewinds one fit may make when ``on_non_finite="rewind"`` is given without ``max_rewinds``.
DEFAULT_MAX_REWINDS = 3


@dataclass(frozen=True)
class Position:
    """Where training stands: ``trainer.global_step``, the last batch done (counted over the fit, from 0, as
    Lightning's ``fit_loop.total_batch_idx``; -1 before the first) and the epoch."""

    global_step: int
    batch: int
    epoch: int

    @classmethod
    def of(cls, trainer: Any) -> Position:
        return cls(int(trainer.global_step), int(trainer.fit_loop.total_batch_idx), int(trainer.current_epoch))


@dataclass(frozen=True)
class Rewind:
    """One rewind, as a value; the same on every rank. ``as_dict()`` is the JSON line of the rewind log.

    Attributes:
        number: 1 for the first rewind of the fit.
        boundary: The rejected boundary, e.g. ``"train batch end"``.
        global_step: ``trainer.global_step`` at the rejected boundary; it goes on from here.
        checkpoint: The checkpoint restored (the most recent one this callback published in this fit).
        checkpoint_global_step: The ``global_step`` at which that checkpoint was published.
        discarded_steps: First and last global step whose optimizer update was thrown away (``None`` if none).
        skipped_batches: First and last batch (counted over the fit, from 0) that trained since the checkpoint or
            the previous rewind and is not replayed (``None`` if none).
        epochs: ``trainer.current_epoch`` where the skipped range starts (at the checkpoint's boundary or the
            previous rewind: the first skipped batch may belong to the epoch after it) and at the rejected boundary.
        ranks, first_step, last_step, num_steps, parameters, skipped_steps, non_finite_state, spikes: The
            rejection's report (see :class:`~lightning_ckguard.agree.report.BoundaryReport`).
    """

    number: int
    boundary: str
    global_step: int
    checkpoint: str
    checkpoint_global_step: int
    discarded_steps: tuple[int, int] | None
    skipped_batches: tuple[int, int] | None
    epochs: tuple[int, int]
    ranks: tuple[int, ...]
    first_step: int
    last_step: int
    num_steps: int
    parameters: tuple[str, ...]
    skipped_steps: int
    non_finite_state: tuple[tuple[int, str], ...] = ()
    spikes: tuple[Spike, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values (what ``json.loads`` of its log line gives back). A spike's value, ratio or deviations
        that is not a finite number (a gradient norm past its sum of squares' range, a baseline with no spread) is the
        string ``"inf"``, ``"-inf"`` or ``"nan"``, which ``float()`` reads back: the line stays strict JSON."""
        values = asdict(self)
        values["non_finite_state"] = [list(entry) for entry in self.non_finite_state]
        values["spikes"] = [{name: _strict_json_number(value) for name, value in spike.items()}
                            for spike in values["spikes"]]
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}

    def describe(self) -> str:
        """One line for a person: where it went back to and what it skipped."""
        steps = ("no optimizer step" if self.discarded_steps is None
                 else f"the updates of global steps {self.discarded_steps[0]} to {self.discarded_steps[1]}")
        batches = ("no batch" if self.skipped_batches is None
                   else f"batches {self.skipped_batches[0]} to {self.skipped_batches[1]} of the fit (epoch "
                        + (f"{self.epochs[0]}" if self.epochs[0] == self.epochs[1] else
                           f"{self.epochs[0]} to {self.epochs[1]}") + ")")
        ranks = ", ".join(map(str, self.ranks)) or "none"
        parameters = ", ".join(self.parameters) or "not attributable"
        cause = (f"non-finite on rank(s) {ranks}, steps {self.first_step} to {self.last_step}, parameters: "
                 f"{parameters}") if self.ranks or not self.spikes else describe_spikes(self.spikes)
        return (
            f"rewind {self.number} at global step {self.global_step} ({self.boundary}; {cause}) went back to "
            f"{self.checkpoint} (published at global step {self.checkpoint_global_step}), discarding {steps} and "
            f"skipping {batches}"
        )


class RewindLog:
    """The rewinds of one fit and the checkpoint to go back to. Every rank keeps an identical one.

    Args:
        max_rewinds: Rewinds allowed in this fit; the rejection after the last one raises.
        log_dir: Where the JSON lines go (the checkpoint directory); ``None`` writes none.
        start: Where the fit starts (the first window begins here).
    """

    def __init__(self, max_rewinds: int, log_dir: str | None, start: Position) -> None:
        self.max_rewinds = max_rewinds
        self.log_dir = log_dir
        self.rewinds: list[Rewind] = []
        self.published: tuple[str, Position] | None = None
        self._window_start = start

    def start_at(self, at: Position, resumed_from: str | None) -> None:
        """Training starts at ``at`` (a resumed fit's loops restored). A fit resumed from ``resumed_from`` goes back
        there until it published a checkpoint of its own: it is the last good state this fit started from."""
        self._window_start = at
        if resumed_from is not None and self.published is None:
            self.published = (resumed_from, at)

    def note_published(self, path: str, at: Position) -> None:
        """A checkpoint this callback published (accepted and written) at ``at``: the next rewind goes back to it."""
        self.published = (path, at)
        self._window_start = at

    def rewind(self, trainer: Any, report: BoundaryReport, exists: Any = os.path.exists) -> Rewind:
        """Restore the most recent published checkpoint on every rank, together, and record the rewind.

        ``exists`` says whether a path exists (rank 0's answer counts). Call it on every rank at the same point.

        Raises:
            RewindRefusedError: On every rank, when there is no checkpoint to go back to, when ``max_rewinds``
                rewinds were made already, or when restoring failed on some rank (the state may then be half restored).
        """
        strategy = trainer.strategy
        if self.published is None:
            raise self.refusal(report, "no checkpoint was published in this fit yet, so there is nothing to go back to")
        path, published_at = self.published
        if len(self.rewinds) >= self.max_rewinds:
            raise self.refusal(report, f"`max_rewinds={self.max_rewinds}` rewinds were made in this fit already")
        found = broadcast_value(strategy, bool(exists(path)) if trainer.is_global_zero else None, src=0)
        if not found:
            raise self.refusal(report, f"the checkpoint to go back to, {path}, no longer exists")
        failure: BaseException | None = None
        try:
            restore_trainer_state(trainer, path)
        except write_errors() as error:  # every rank must hear of it, or the others would train on alone
            failure = error
        failed = agree_on_failure(strategy, failure)
        if failed.ranks:
            ranks = ", ".join(map(str, failed.ranks))
            raise self.refusal(report, f"restoring {path} failed on rank(s) {ranks}: {failed.cause}") from failure
        now = Position.of(trainer)
        record = self._record(report, path, published_at, now)
        self.rewinds.append(record)
        self._window_start = now
        if trainer.is_global_zero:
            self._append_line(record)
        return record

    def _record(self, report: BoundaryReport, path: str, published_at: Position, now: Position) -> Rewind:
        """The record of the rewind just made: from ``now`` back to ``path``, published at ``published_at``."""
        start = self._window_start
        return Rewind(
            number=len(self.rewinds) + 1,
            boundary=report.boundary,
            global_step=now.global_step,
            checkpoint=path,
            checkpoint_global_step=published_at.global_step,
            discarded_steps=(start.global_step, now.global_step - 1) if now.global_step > start.global_step else None,
            skipped_batches=(start.batch + 1, now.batch) if now.batch > start.batch else None,
            epochs=(start.epoch, now.epoch),
            ranks=report.ranks,
            first_step=report.first_step,
            last_step=report.last_step,
            num_steps=report.num_steps,
            parameters=report.parameters,
            skipped_steps=report.skipped_steps,
            non_finite_state=report.non_finite_state,
            spikes=report.spikes,
        )

    def refusal(self, report: BoundaryReport, reason: str) -> RewindRefusedError:
        """The error of a rejected boundary that is not rewound, naming every earlier rewind of this fit."""
        error = report.to_error()
        return RewindRefusedError(reason=reason, rewinds=[r.describe() for r in self.rewinds], **error.fields())

    @property
    def log_path(self) -> str | None:
        """The rewind log file, or ``None`` when there is no checkpoint directory."""
        return None if self.log_dir is None else os.path.join(self.log_dir, REWIND_LOG_NAME)

    def _append_line(self, record: Rewind) -> None:
        path = self.log_path
        if path is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:  # one line per rewind: appended lines of earlier fits stay
            f.write(json.dumps(record.as_dict(), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _strict_json_number(value: Any) -> Any:
    """``value``, or for a float that is not finite its name as ``float()`` reads it (JSON has no such numbers)."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def callbacks_of_kind(trainer: Any, kind: str) -> list[Any]:
    """``trainer``'s callbacks of the class named ``kind`` (or a subclass of it)."""
    # by class name, so either Lightning package's (and a version without them) needs no import here
    return [c for c in trainer.callbacks if any(k.__name__ == kind for k in type(c).__mro__)]


def restore_trainer_state(trainer: Any, path: str) -> dict[str, Any]:
    """Restore, in place and on every rank, the training state of the checkpoint at ``path``: the model weights, the
    optimizer state, the LR schedulers, the precision plugin's state and weight-averaging callbacks' state, in the
    order Lightning restores them from ``ckpt_path``, and ``EarlyStopping``'s (its patience and best score follow the
    weights: the validations of the discarded ones count no more); then the gradients accumulated so far
    (micro-batches of a step under way, computed from the discarded weights) are cleared, on every optimizer
    (DeepSpeed ZeRO-2's own buffers included) and on the module. The loop progress is not restored:
    ``trainer.global_step`` goes on. Returns the loaded checkpoint (what the strategy's load path returned).

    Every rank must call it at the same point: the strategy's load path may hold collectives (DeepSpeed's engine
    loads its partitions from the directory; FSDP2 reads its shards of a distributed checkpoint).

    Raises:
        ValueError: If the checkpoint does not match the trainer's training state: it holds a different number of LR
            schedulers, or an optimizer's state with other parameter groups (the optimizer's own ``load_state_dict``
            error); what was restored before it stays restored. Raised on this rank only: the callback's rewind tells
            every rank and raises :class:`~lightning_ckguard.RewindRefusedError` on each.
        FileNotFoundError: If there is no checkpoint at ``path`` (the strategy's load path's error).
    """
    strategy = trainer.strategy
    module = trainer.lightning_module
    # DeepSpeed and ModelParallel load weights and optimizer shards right here, and return the rest
    checkpoint: dict[str, Any] = strategy.load_checkpoint(path)
    module.on_load_checkpoint(checkpoint)
    strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)
    callback_states: Mapping[Any, Any] = checkpoint.get("callbacks", {})
    for callback in callbacks_of_kind(trainer, "WeightAveraging"):
        # after the weights: it puts the live weights back from "current_model_state", as it does on resume
        callback.on_load_checkpoint(trainer, module, checkpoint)
        _load_callback_state(callback, callback_states)
    for callback in callbacks_of_kind(trainer, "EarlyStopping"):
        _load_callback_state(callback, callback_states)
    precision = strategy.precision_plugin
    precision.on_load_checkpoint(checkpoint)
    if type(precision).__qualname__ in checkpoint:
        precision.load_state_dict(checkpoint[type(precision).__qualname__])
    if strategy.lightning_restore_optimizer:  # False where the strategy loaded them itself
        strategy.load_optimizer_state_dict(checkpoint)
    # the same fit wrote it: the same schedulers, in the same order
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers", []), strict=True):
        config.scheduler.load_state_dict(state)
    # a boundary between two micro-batches leaves the first one's gradient, computed from the discarded weights:
    # kept, the next step would apply it to the restored ones
    _clear_gradients([*trainer.optimizers, module])
    return checkpoint


def _load_callback_state(callback: Any, states: Mapping[Any, Any]) -> None:
    state = states.get(callback.state_key)
    if state is not None:
        callback.load_state_dict(state)


def _clear_gradients(owners: Iterable[Any]) -> None:
    """``zero_grad(set_to_none=True)`` on each of ``owners`` that has a ``zero_grad`` (modules, optimizers; a
    ``zero_grad`` without ``set_to_none``, as DeepSpeed's engine's, is called as it is); then, for DeepSpeed's ZeRO-1/2
    optimizer, what it already reduced or accumulated of the micro-batches of a step under way is dropped too
    (:func:`_discard_zero_accumulation`). Nothing here is a collective.

    DeepSpeed's optimizers set their parameters' gradients to ``None`` (what Lightning itself has them do at the first
    micro-batch of every step; ZeRO-3's also starts its accumulation again). ZeRO-2 keeps each micro-batch's reduced
    partition in buffers of its own, which its ``zero_grad`` leaves: without the discard, the restored weights' step
    would add the earlier micro-batches' gradients, computed from the discarded weights."""
    for owner in owners:
        zero_grad = getattr(owner, "zero_grad", None)
        if not callable(zero_grad):
            continue
        if _takes_set_to_none(zero_grad):
            zero_grad(set_to_none=True)
        else:
            zero_grad()
        zero = _zero_optimizer(owner)
        if zero is not None:
            _discard_zero_accumulation(zero)


#: ``DeepSpeedZeroOptimizer.micro_step_id`` before the first backward of a step (DeepSpeed's ``INITIAL_MICRO_STEP_ID``,
#: which its ``step()`` sets back)
_ZERO_INITIAL_MICRO_STEP_ID = -1


def _zero_optimizer(owner: Any) -> Any | None:
    """DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``, known by its ``all_grad_tensors`` and
    ``averaged_gradients`` dicts) that ``owner`` is or wraps (Fabric's optimizer wrapper, as ``optimizer``: the
    wrapper's own attributes would shadow the optimizer's); ``None`` for anything else."""
    for candidate in (getattr(owner, "optimizer", None), owner):  # a ZeRO optimizer's own `optimizer` is the base one
        buffers = (getattr(candidate, "all_grad_tensors", None), getattr(candidate, "averaged_gradients", None))
        if all(isinstance(buffer, dict) for buffer in buffers):
            return candidate
    return None


def _discard_zero_accumulation(optimizer: Any) -> None:
    """Drop what a ``DeepSpeedZeroOptimizer`` holds of the step under way, as its own ``step()`` drops an overflowed
    step's gradients: the pre-flattened partition buffers, ``averaged_gradients``, ``all_grad_tensors`` (each
    micro-batch's reduced partition, added up until the accumulation boundary), the CPU-offload bookkeeping; and
    ``micro_step_id`` set back, so that under CPU offload the next backward overwrites its accumulated CPU copies
    instead of adding to them. Each part only where this DeepSpeed version has it; local, no collective."""
    release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
    if callable(release):  # fp32 accumulation of bf16 gradients: a flat buffer behind `averaged_gradients`
        release()
    reset_cpu_buffers = getattr(optimizer, "reset_cpu_buffers", None)
    if getattr(optimizer, "cpu_offload", False) and callable(reset_cpu_buffers):
        reset_cpu_buffers()
    for buffers in (optimizer.averaged_gradients, optimizer.all_grad_tensors):
        for group in list(buffers):
            buffers[group] = None  # what the next micro-batch finds when a step starts
    if hasattr(optimizer, "micro_step_id"):
        optimizer.micro_step_id = _ZERO_INITIAL_MICRO_STEP_ID
    if hasattr(optimizer, "_offload_accumulated_param_ids"):  # the parameters offload accumulated this step
        optimizer._offload_accumulated_param_ids = set()


def _takes_set_to_none(function: Any) -> bool:
    """Whether ``function`` accepts a ``set_to_none`` keyword (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # no signature to read: pass nothing it might refuse
        return False
    return any(p.name == "set_to_none" or p.kind is p.VAR_KEYWORD for p in parameters)


def restore_fabric_state(fabric: Any, path: str, state: dict[str, Any], guard: Any | None = None,
                         strict: bool = True) -> dict[str, Any]:
    """Rewind a Fabric loop: restore ``state`` (your model, optimizer, anything with a ``state_dict``) in place
    from ``path``, on every rank together, through ``fabric.load`` and so through the strategy's own load path
    (sharded strategies restore their own shards), clear the gradients of the modules and optimizers in ``state``
    (``zero_grad(set_to_none=True)``: gradients accumulated so far, e.g. by micro-batches before the boundary, were
    computed from the discarded weights), then start a fresh window of ``guard``, the losses already given for the
    step under way dropped with it; an accepted window that was never published (its write failed) teaches a spike
    gate nothing, so its history stays that of the last checkpoint published. Returns what the checkpoint held
    besides ``state``, as ``fabric.load`` does.

    Call it on every rank at the same point, with the same ``path``: after a rejected ``guard.agree(...)``, with the
    path of the last checkpoint you published. Your own counters (step, epoch, data position) are yours to keep
    going or to set back.

    Raises:
        CheckpointRestoreError: On every rank, when loading failed on some rank (one collective tells every rank).
            A ``ValueError`` of the load (an optimizer whose parameter groups differ from the checkpoint's) is not
            raised as it is: it becomes this error's cause, as every other load error does.
    """
    remainder: dict[str, Any] = {}
    failure: BaseException | None = None
    # a sharded checkpoint: every rank meets before each of the distributed checkpoint's calls and at the barrier the
    # load ends with, so that one whose own preparation failed (a state dict to load into) stops its peers there
    sharded = uses_distributed_checkpoint(fabric.strategy) and os.path.isdir(path)
    meeting = DistributedCheckpointMeeting(fabric.strategy, "load", enabled=sharded, until_barrier=True)
    try:
        with meeting:
            remainder = fabric.load(path, state, strict=strict)
    except write_errors() as error:  # every rank must hear of it (a distributed checkpoint's BaseException too), or
        # the others would wait in their next collective
        failure = own_write_failure(error)
        if meeting.enabled:
            meeting.settle(failure)  # at the peers' next meeting point: a distributed checkpoint call, or the barrier
        else:
            fabric.barrier()  # where the others' `fabric.load` ends (a load fails before it: reading the file)
    failed = agree_on_failure(fabric.strategy, failure)
    if failed.ranks:
        raise CheckpointRestoreError(ranks=failed.ranks, filepath=str(path), cause=failed.cause,
                                     world_size=fabric.world_size) from failure
    _clear_gradients(state.values())  # only once every rank loaded: the agreement above is the only collective
    if guard is not None:
        # the restored weights are the accepted ones: the next window starts clean, without the step under way; a
        # window accepted but never published (its write failed) is thrown away with them, so the gate learns nothing
        guard.reset(discard_step_under_way=True, learn=False)
    return remainder


__all__ = [
    "DEFAULT_MAX_REWINDS",
    "REWIND_LOG_NAME",
    "Position",
    "Rewind",
    "RewindLog",
    "callbacks_of_kind",
    "restore_fabric_state",
    "restore_trainer_state",
]
