"""``GradientGuard``: recording and agreement without a Trainer.

The Lightning callback records and agrees through this class (publication, rewind and the Lightning seams are the
callback's own, for now); Fabric or plain ``torch.distributed`` code can use it directly::

    guard = GradientGuard(model)
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()
        guard.record(optimizer)          # device-side, no host sync, no collective
        optimizer.step()
        optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer}
    verdict = guard.agree(fabric.strategy, state=state)  # one all-reduce, same verdict on every rank
    if verdict.accepted:
        fabric.save(path, state)
        guard.reset()
    else:
        raise verdict.to_error()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import torch
from torch import Tensor, nn

from lightning_ckguard._distributed import (
    all_reduce_values,
    default_collective,
    failure_words,
    failures_from,
    rank_and_world,
    require_collective,
)
from lightning_ckguard.agree.agreement import (
    TALLY_SIZE,
    RankReport,
    RollCall,
    Tally,
    Verdict,
    ballot,
    reach_verdict,
    roll_call,
)
from lightning_ckguard.agree.spikes import (
    SpikeCheck,
    SpikeGate,
    SpikeHistory,
    StepMeasures,
    global_values,
    judge,
    judged_alike_words,
    read_judged_alike,
)
from lightning_ckguard.errors import StateCheckError
from lightning_ckguard.record.source_selection import default_gradient_source
from lightning_ckguard.record.sources import GradientSource, unwrap_module
from lightning_ckguard.record.squares import REPLICATED, SquaresLayout
from lightning_ckguard.record.state_check import StateCheck
from lightning_ckguard.record.state_sources import constant_buffers, named_state
from lightning_ckguard.record.step_values import StepValues
from lightning_ckguard.record.window import NonFiniteWindow


class GradientGuard:
    """Records gradient finiteness per optimizer step and agrees on it across ranks at checkpoint boundaries.

    Args:
        module: The model whose parameters are watched. Parameter names come from ``module.named_parameters()``;
            Fabric's and DDP's wrappers are looked through, so names are those of your own module. ``None`` (a
            Trainer with no LightningModule attached, driven by hand in a unit test): nothing is watched, and the
            agreement still runs.
        count_skipped_steps: Whether steps a loss scaler skipped (never applied) reject a boundary.
        source: Where local gradients are read; defaults to ``param.grad`` of ``module``, or to a DeepSpeed engine's
            local gradient partitions when ``module`` is the engine or what ``fabric.setup`` made of it (ZeRO leaves
            nothing in ``param.grad``).
        device: Device of the window's state; defaults to the device of ``module``'s first parameter.
        spike_gate: Also reject a boundary whose window holds a step whose loss or global gradient norm spiked
            (:class:`~lightning_ckguard.SpikeGate`); off by default. Give each step's loss to :meth:`record` (or
            :meth:`record_loss`). The gate adds one all-reduce of a fixed size per agreement, and learns its baseline
            from the windows :meth:`reset` closes after an accepted agreement.

    Raises:
        ValueError: If an argument has the wrong type, or ``device`` is none this build of PyTorch can use.
    """

    def __init__(
        self,
        module: nn.Module | None,
        *,
        count_skipped_steps: bool = False,
        source: GradientSource | None = None,
        device: torch.device | None = None,
        spike_gate: SpikeGate | None = None,
    ) -> None:
        _check_arguments(module, count_skipped_steps, source, spike_gate)
        if source is None:
            source = default_gradient_source(module if module is not None else nn.Module())
        module = unwrap_module(module) if module is not None else nn.Module()
        if device is None:
            first = next(module.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        device = _checked_device(device)
        self.count_skipped_steps = count_skipped_steps
        self.source: GradientSource = source
        self.spike_gate = spike_gate
        self._spike_history = SpikeHistory(spike_gate) if spike_gate is not None else None
        self._accepted_window: StepMeasures | None = None  # learned by the next reset, once published
        step_values = StepValues(torch.device(device), spike_gate.resolution) if spike_gate is not None else None
        self.window = NonFiniteWindow(torch.device(device), step_values,
                                      squares=spike_gate is not None and "grad_norm" in spike_gate.measures)
        self._state_check = StateCheck()
        self._constant_buffers: dict[int, frozenset[str]] = {}
        self.note_constant_buffers(module)
        self._steps_seen = 0

    def record(
        self,
        optimizer: Any | None = None,
        *,
        step: int | None = None,
        skipped: Tensor | bool | None = None,
        loss: Tensor | float | None = None,
    ) -> None:
        """Record the gradients ``optimizer`` is about to apply (all of ``module``'s when ``None``).

        Call it after backward (and after unscaling, with a loss scaler) and before ``optimizer.step()``. ``step``
        labels the step in reports (defaults to a running count); give every rank the same, so that every rank's
        report names the same steps. ``skipped`` is True, or a 0-d tensor that is True,
        when a loss scaler will skip this step (see :func:`~lightning_ckguard.record.skips.scaler_skip_flag`). Sources
        that only learn after the step whether it was skipped (DeepSpeed) hold the step until :meth:`conclude_step`.
        ``loss``: the step's loss (a device tensor, read on the device), for a spike gate watching the loss; with
        gradient accumulation, give the earlier micro-batches' losses to :meth:`record_loss` first (or every
        micro-batch's there, and none here).

        Raises:
            ValueError: If ``skipped`` is none of these: a bool (a NumPy bool, or the integers 0 and 1, count as one),
                a tensor, or None.
        """
        skipped = _skip_flag(skipped)
        if loss is not None:
            self.record_loss(loss)
        gradients = self.source.local_gradients(optimizer)
        if gradients is None:  # not an optimizer step (e.g. a DeepSpeed micro-batch inside accumulation)
            return
        indices, grads = gradients
        label = self._steps_seen if step is None else step
        num_parameters = len(self.source.parameter_names)
        layout = self._how_squares_add_up()
        if skipped is None and getattr(self.source, "defers_skip_outcome", False):
            self.window.record_pending(indices, grads, label, num_parameters, layout)
        else:
            self.window.record(indices, grads, label, num_parameters, skipped, layout)
        self._steps_seen += 1

    def _how_squares_add_up(self) -> SquaresLayout:
        """For a spike gate: whether the gradients just read are this rank's shard (which steps every rank leaves out
        of the step values alike depends on it); watching the gradient norm, also how many ranks hold each and the
        loss scale they still carry (DeepSpeed fp16). Without a gate nothing is asked of the source."""
        if self.spike_gate is None:
            return REPLICATED
        if "grad_norm" not in self.spike_gate.measures:
            return SquaresLayout(sharded=bool(getattr(self.source, "shards_gradients", False)))
        gradient_scale = getattr(self.source, "gradient_scale", None)
        return SquaresLayout(sharded=bool(getattr(self.source, "shards_gradients", False)),
                             scale=gradient_scale() if gradient_scale is not None else 1.0,
                             replicas=getattr(self.source, "gradient_replicas", None))

    def record_loss(self, loss: Tensor | float, *, scale: Tensor | float | None = None) -> None:
        """Add a loss to the step under way, for a spike gate watching the loss (nothing without one): device-side,
        no host read. The losses given since the last :meth:`record` add up to the next one's (every micro-batch's
        of an accumulated step); a Lightning callback gives each backward's. ``scale``: what ``loss`` was multiplied
        by (a loss scaler's scale), divided out on the device.

        A DTensor loss replicated on its mesh (tensor parallelism's ``loss_parallel``) is read as its local copy.

        Raises:
            ValueError: If ``loss`` is neither a real number nor a tensor of one element, or is a DTensor that is not
                replicated (its local part is not the loss; reading the whole would be a collective).
        """
        loss = _local_loss(loss)
        if self.window.step_values is not None:
            self.window.step_values.add_loss(loss if scale is None else loss / scale)

    def conclude_step(self) -> None:
        """After the optimizer step: settle a step whose skip outcome the source only knows now (DeepSpeed)."""
        if self.window.has_pending_step:
            self.window.settle(skipped=self.source.skipped_last_step())

    def agree(
        self, collective: Any | None = None, *, global_step: int | None = None, state: Any | None = None
    ) -> Verdict:
        """Join the one agreement collective and return the verdict, which is the same on every rank.

        Every rank of ``collective`` must call this at the same point. ``collective`` is a Lightning/Fabric
        strategy, a ``torch.distributed`` process group, or ``None``: a single process, or the default process group
        when ``torch.distributed`` is initialized with peers (so no rank decides alone). Agreeing does not reset the
        window: call :meth:`reset` once the checkpoint is published.

        ``state`` is what this rank is about to write (what ``fabric.save`` gets: a dict of modules, optimizers and
        tensors, or a ``CheckpointState`` (``lightning_ckguard.record.state_sources``)). Each of its local tensors is
        checked too, before the agreement, and a non-finite one rejects the boundary whatever ``count_skipped_steps``
        says; its name travels in the same collective (``verdict.non_finite_state``). Checking it reads one small
        flag vector to the host, as does reading this rank's own summary before the agreement.

        Raises:
            ValueError: If ``collective`` is none of the above, or ``global_step`` is not an int or None.
        """
        verdict, _ = self.agree_carrying(collective, (), global_step=global_step, state=state)
        return verdict

    def agree_carrying(
        self, collective: Any | None, carry: Sequence[int], *, global_step: int | None = None, state: Any | None = None
    ) -> tuple[Verdict, tuple[int, ...]]:
        """:meth:`agree`, with ``carry`` (a few integers, the same count on every rank) riding in the same collective,
        reduced with MAX: another decision every rank must take together at this point (the callback's top-K vote)
        costs nothing more. Returns the verdict and the largest of every rank's ``carry``, field by field.

        An accepted boundary is one all-reduce of a fixed size; a rejected one adds a second, bounded, that brings
        the reports of the ranks it names (:class:`~lightning_ckguard.agree.agreement.Verdict`). A spike gate adds
        one more, of a fixed size, before them: the sum of every rank's step values."""
        require_collective(collective)
        collective = default_collective(collective)
        summary, device, failure = self._own_summary(state)
        rank, world_size = rank_and_world(collective)
        window, spike_words = self._summed_step_values(collective, world_size)
        own = RankReport.from_summary(rank, summary)
        words = [*ballot(own, world_size, self.count_skipped_steps), *carry, *failure_words(collective, failure),
                 *spike_words]
        reduced = all_reduce_values(collective, torch.tensor(words, dtype=torch.int64, device=device)).tolist()
        if global_step is not None and (isinstance(global_step, bool) or not isinstance(global_step, Integral)):
            raise ValueError(f"`global_step` must be an int or None, got {global_step!r}.")
        step = self._steps_seen if global_step is None else int(global_step)
        spike_part = len(words) - len(spike_words)
        self._raise_failed_check(collective, reduced[TALLY_SIZE + len(carry) : spike_part], failure, step)
        spike_check = self._judge_spikes(window, reduced[spike_part:], step)
        tally = Tally.from_words(reduced[:TALLY_SIZE], world_size)
        roll = RollCall()
        if tally.rejects:  # only now, the names: every rank took the same branch from the same tally
            called = roll_call(own, summary, tally, self.count_skipped_steps)
            named = all_reduce_values(collective, torch.tensor(called, dtype=torch.int64, device=device), op="sum")
            roll = RollCall.from_words(named.tolist(), tally, len(summary))
        verdict = reach_verdict(tally, roll, step, self.source.parameter_names, self.count_skipped_steps, spike_check)
        if not verdict.accepted:
            self._accepted_window = None
        return verdict, tuple(int(value) for value in reduced[TALLY_SIZE : TALLY_SIZE + len(carry)])

    def _own_summary(self, state: Any) -> tuple[list[int], torch.device, Exception | None]:
        """This rank's summary for the agreement: its window, then the check of ``state``, and the error the check
        raised (a tensor left on the meta device, memory running out), counted as no state fault: this rank still
        joins every collective, and every rank raises it (:meth:`_raise_failed_check`). Raising here alone would
        leave the other ranks waiting in the agreement."""
        window = self.window.summary()
        device = window.device
        failure: Exception | None = None
        try:
            state_tensors = named_state(state, constants=self._constant_buffers) if state is not None else None
            state_part = self._state_check.summary(state_tensors, device)
        except Exception as error:
            failure, state_part = error, self._state_check.summary(None, device)
        return torch.cat([window, state_part]).tolist(), device, failure

    def _raise_failed_check(self, collective: Any, words: Sequence[int], failure: Exception | None, step: int) -> None:
        """After the agreement's collective: if checking the state raised on some rank, every rank raises the same
        :class:`StateCheckError` (a failing rank from its own error), before anything is decided."""
        found = failures_from(collective, words, failure)
        if found.ranks:
            self._accepted_window = None  # a boundary that decided nothing teaches a spike gate nothing
            raise StateCheckError(ranks=found.ranks, global_step=step, cause=found.cause) from failure

    def _summed_step_values(self, collective: Any, world_size: int) -> tuple[StepMeasures | None, list[int]]:
        """With a spike gate, every rank's step values summed (one all-reduce of a fixed size), as global values, and
        this rank's words for the agreement that tell whether the ranks judge alike (:func:`judged_alike_words`);
        ``(None, [])`` without a gate."""
        values = self.window.step_values
        if values is None or self._spike_history is None or self.spike_gate is None:
            return None, []
        summed = all_reduce_values(collective, values.summary().clone(), op="sum").tolist()
        window = global_values(summed, values.capacity, values.labels, world_size)
        return window, judged_alike_words(self._spike_history, len(window.labels), values.steps_per_slot)

    def _judge_spikes(self, window: StepMeasures | None, reduced: Sequence[int], step: int) -> SpikeCheck:
        """After the agreement's collective: the window's slots every rank holds, judged against the accepted history,
        the same check on every rank (:func:`judge` is pure). If the ranks' histories differ (one loaded on some
        ranks only), every rank raises the same error instead, before anything is decided. The window judged is kept
        until it is learned or dropped."""
        alike = read_judged_alike(reduced)
        if window is None or self._spike_history is None or self.spike_gate is None:
            return SpikeCheck()
        if not (alike.histories and alike.folds):
            self._accepted_window = None
            cause = ("its accepted history differs between ranks, so the ranks would judge this window differently. "
                     "Load the guard's state (`load_state_dict`) on every rank alike" if not alike.histories else
                     "the ranks' windows are folded differently (they recorded different numbers of steps, as when "
                     "an exception stops one rank before its step is recorded), so their steps cannot be lined up")
            raise RuntimeError(f"The spike gate cannot judge the window at global step {step}: {cause}. Nothing was "
                               "decided, written, deleted or linked for this boundary on any rank.")
        self._accepted_window = window.first(alike.slots if alike.slots is not None else len(window.labels))
        return judge(self.spike_gate, self._spike_history, self._accepted_window)

    def note_constant_buffers(self, module: nn.Module) -> frozenset[str]:
        """Leave ``module``'s buffers that hold non-finite values now (an attention mask filled with ``-inf``) out of
        the state check: they are constants of the model. Done for the guard's own module when it is created; call it
        for other modules you save (an averaged copy). Returns their names."""
        module = unwrap_module(module)
        names = constant_buffers(module)
        self._constant_buffers[id(module)] = names
        return names

    def reset(self, *, pending_rejection: bool = False, discard_step_under_way: bool = False,
              learn: bool = True) -> None:
        """Start a fresh window. ``pending_rejection=True`` keeps rejecting until a step is applied (one a loss scaler
        skipped is not).

        Call it once the checkpoint of an accepted agreement is published: a spike gate then learns that window's
        values. A window whose agreement rejected (rewound or skipped) teaches it nothing.

        The losses already given for the step under way (:meth:`record_loss`, micro-batches before a boundary) stay
        for that step. After a rewind they belong to weights that are gone: ``discard_step_under_way=True`` drops
        them, so that the next step recorded holds only its own losses. ``learn=False``: an accepted window that was
        not published (another guard rewound the run under it) teaches the gate nothing either."""
        if self._accepted_window is not None and self._spike_history is not None and learn and not pending_rejection:
            self._spike_history.learn(self._accepted_window)
        self._accepted_window = None
        self.window.reset(pending_rejection=pending_rejection, discard_step_under_way=discard_step_under_way)

    def forget_unpublished_window(self) -> None:
        """The last agreement's accepted window was not published (a boundary that agreed and then wrote nothing):
        a spike gate must not learn it, by :meth:`state_dict` or the next :meth:`reset`. The window itself goes on."""
        self._accepted_window = None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this guard: with a spike gate, its accepted history
        (``{"spike_history": {measure: [values]}}``), the window just agreed on included, since the checkpoint that
        holds this state publishes it; without a gate, nothing. A Fabric user saves the guard with the rest of the
        state (``fabric.save(path, {"model": model, "guard": guard, ...})``)."""
        if self._spike_history is None or self.spike_gate is None:
            return {}
        history = self._spike_history
        if self._accepted_window is not None:  # learned at the next reset, once this checkpoint is published
            history = SpikeHistory(self.spike_gate)
            history.load_state_dict(self._spike_history.state_dict())
            history.learn(self._accepted_window)
        return {"spike_history": history.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up what :meth:`state_dict` gave, in this process or an earlier one: a resumed run's spike gate keeps
        its baseline instead of warming up again. A state without a history, or a guard without a gate, changes
        nothing.

        Raises:
            ValueError: If the history is not a mapping of measures to lists of finite numbers.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"`state` must be a mapping (what `state_dict` gave), got {type(state).__name__}.")
        history = state.get("spike_history")
        if history is not None and self._spike_history is not None:
            self._spike_history.load_state_dict(history)

    @property
    def steps_recorded(self) -> int:
        """Optimizer steps recorded in the current window."""
        return self.window.steps_recorded


def _skip_flag(skipped: Any) -> Tensor | bool | None:
    """``skipped`` as :meth:`GradientGuard.record` passes it on: None and tensors as they are, a bool-like value as a
    bool. The window tells the usual step by ``skipped is False``, so ``0`` or ``numpy.False_`` passed on as is would
    count the step as skipped, and a non-finite gradient in it as never applied."""
    if skipped is None or isinstance(skipped, Tensor):
        return skipped
    # a NumPy scalar or 0-d array: its Python value (a bool or an int; a float is refused below)
    numpy_scalar = getattr(skipped, "ndim", None) == 0 and callable(getattr(skipped, "item", None))
    value = skipped.item() if numpy_scalar else skipped
    if isinstance(value, int) and value in (0, 1):  # bool is an int
        return bool(value)
    raise ValueError(f"`skipped` must be a bool, a 0-d bool tensor or None, got {skipped!r} "
                     f"({type(skipped).__name__}).")


def _checked_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` naming the argument."""
    try:
        checked = torch.device(device)
        torch.empty(0, device=checked)  # a device this build cannot use (an index without CUDA) fails here, once
        return checked
    except (RuntimeError, TypeError, AssertionError) as error:
        raise ValueError(f"`device` must be a device this build of PyTorch can use (a torch.device, a device string or "
                         f"index), got {device!r}: {error}") from error


def _local_loss(loss: Any) -> Tensor | float:
    """``loss`` as one number this rank holds: a real number, a tensor of one element (read on the device, never
    here), a replicated DTensor's local copy; else a ``ValueError``."""
    placements = getattr(loss, "placements", None)
    if isinstance(loss, Tensor) and placements is not None:  # a DTensor
        if not all(placement.is_replicate() for placement in placements):
            raise ValueError(f"`loss` must be replicated when it is a DTensor, got placements {tuple(placements)}: "
                             "pass `loss.full_tensor()` (a collective) or the value every rank holds.")
        loss = loss.to_local()  # type: ignore[attr-defined]
    _check_loss(loss)
    return loss  # type: ignore[no-any-return]


def _check_loss(loss: Any) -> None:
    """A loss is one number: a real number or a tensor of one element (read on the device, never here)."""
    if isinstance(loss, Tensor):
        if loss.numel() != 1:
            raise ValueError(f"`loss` must hold one value, got a tensor of shape {tuple(loss.shape)}.")
    elif isinstance(loss, bool) or not isinstance(loss, Real):
        raise ValueError(f"`loss` must be a tensor of one element or a real number, got {loss!r}.")


def _check_arguments(module: Any, count_skipped_steps: Any, source: Any, spike_gate: Any) -> None:
    """A ``ValueError`` that names the argument, at construction, rather than a wrong verdict later."""
    if module is not None and not isinstance(module, nn.Module):
        raise ValueError(f"`module` must be a torch.nn.Module or None, got {type(module).__name__}.")
    if not isinstance(count_skipped_steps, bool):
        raise ValueError(f"`count_skipped_steps` must be a bool, got {count_skipped_steps!r}.")
    if source is not None and not all(hasattr(source, name) for name in ("local_gradients", "parameter_names")):
        raise ValueError(f"`source` must be a GradientSource (local_gradients, parameter_names) or None, got "
                         f"{type(source).__name__}.")
    if spike_gate is not None and not isinstance(spike_gate, SpikeGate):
        raise ValueError(f"`spike_gate` must be a `SpikeGate` or None, got {spike_gate!r}.")
