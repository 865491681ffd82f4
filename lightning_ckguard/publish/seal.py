"""The publication seal: every checkpoint write of a guarded Trainer passes one gate, before any work starts.

``FiniteGradCheckpoint`` guards its own boundaries. Other writes call ``trainer.save_checkpoint`` directly: a manual
save (weights-only ones skip every callback hook), ``OnExceptionCheckpoint``, another checkpoint callback, Lightning's
tuner. The seal wraps ``trainer.save_checkpoint``, which every rank calls for every write, so the gate is passed on
every rank before Lightning gathers anything (sharded model state, ZeRO-1 optimizer-state consolidation). Each guard
can admit the write after the same preflight agreement, refuse it on every rank, or let its own boundary through.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

from lightning_ckguard._distributed import (
    DistributedCheckpointMeeting,
    Failures,
    agree_on_failure,
    is_deepspeed_strategy,
    own_write_failure,
    replaced_attribute,
    write_errors,
)
from lightning_ckguard.errors import CheckpointWriteError
from lightning_ckguard.publish.staging import published_path, uses_distributed_checkpoint, writes_directories
from lightning_ckguard.publish.transaction import WriteRefused, active_transaction

#: The actions of the seal call under way, to run once its write succeeded on every rank (:meth:`after_write`).
_AFTER_WRITE: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "ckguard_after_write", default=None)


class SaveAdmission(Protocol):
    """A guard that decides, identically on every rank, whether a checkpoint write may happen."""

    def admit_save(self, trainer: Any, filepath: str) -> bool:
        """Return True to let ``trainer`` write ``filepath``, False to skip it with a warning, or raise to refuse."""
        ...


class PublicationSeal:
    """Wraps a Trainer's ``save_checkpoint`` and asks every registered guard before a write.

    Installed by a guard's ``setup`` and removed by its ``teardown`` (:meth:`uninstall`), so outside a fit the Trainer's
    own ``save_checkpoint`` (or whatever the user put there, a ``Mock`` in a unit test) is back. Guards are held weakly:
    the seal never keeps a callback alive.
    """

    #: Run on every rank right after its own part of a write, before the outcome is agreed (see :func:`save_flushed`).
    _flush: Callable[[str], None] = staticmethod(lambda path: None)

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._save_checkpoint: Callable[..., Any] = trainer.save_checkpoint
        # the Trainer's own attribute, if the user replaced the method (a Mock); absent when it is Lightning's method
        self._replaced_method = vars(trainer).get("save_checkpoint", _ABSENT)
        self._guards: list[weakref.ref[SaveAdmission]] = []
        functools.update_wrapper(self, self._save_checkpoint, updated=())

    @classmethod
    def install(cls, trainer: Any, guard: SaveAdmission) -> PublicationSeal:
        """Install the seal on ``trainer`` once, and register ``guard`` with it."""
        seal = trainer.save_checkpoint
        if not isinstance(seal, PublicationSeal):
            seal = cls(trainer)
            trainer.save_checkpoint = seal
        if guard not in seal.guards:
            seal._guards.append(weakref.ref(guard))
        return seal

    @staticmethod
    def uninstall(trainer: Any, guard: SaveAdmission) -> None:
        """Unregister ``guard``; with no guard left, give ``trainer`` back the ``save_checkpoint`` it had."""
        seal = vars(trainer).get("save_checkpoint")
        if not isinstance(seal, PublicationSeal):
            return
        seal._guards = [ref for ref in seal._guards if ref() is not None and ref() is not guard]
        if seal._guards:
            return
        if seal._replaced_method is _ABSENT:
            del trainer.save_checkpoint  # Lightning's method shows through again
        else:
            trainer.save_checkpoint = seal._replaced_method

    @property
    def guards(self) -> list[SaveAdmission]:
        """The registered guards still alive, in registration order."""
        return [guard for guard in (ref() for ref in self._guards) if guard is not None]

    @staticmethod
    def writes_through_lightning(trainer: Any) -> bool:
        """Whether ``trainer``'s writes go through Lightning's own ``Trainer.save_checkpoint`` and its strategy's own
        ``save_checkpoint``, sealed or not, so that the file lands at exactly the path it is given. Not when the user
        replaced the method on the Trainer, overrode it in a Trainer subclass, or overrode the strategy's in a strategy
        subclass of their own (a sidecar file, an upload, a log line naming the path): that code gets the real name,
        as under ``ModelCheckpoint``. Lightning's own strategies override it (DeepSpeed, FSDP, model parallel) and
        stay staged, as does any strategy that writes directories, whoever overrides what (a Trainer subclass too):
        every rank fills one, and only a staged directory is published whole."""
        attribute = vars(trainer).get("save_checkpoint", _ABSENT)
        if isinstance(attribute, PublicationSeal):
            attribute = attribute._replaced_method
        if attribute is not _ABSENT:  # replaced on the instance (a test double that may write nothing)
            return False
        strategy = getattr(trainer, "strategy", None)
        if writes_directories(strategy):  # staged whatever overrides it: only a staged directory is published whole
            return True
        return _defined_by_lightning(trainer, "save_checkpoint") and _defined_by_lightning(strategy, "save_checkpoint")

    @staticmethod
    def after_write(action: Callable[[], None]) -> None:
        """From a guard's ``admit_save``: run ``action`` once the write it admits succeeded on every rank (not if it
        fails, nor if another guard skips it). The seal whose call is under way takes it, wherever the Trainer's
        ``save_checkpoint`` attribute points by now (a wrapper installed after the seal, say)."""
        actions = _AFTER_WRITE.get()
        assert actions is not None, "admit_save runs inside a seal's call"
        actions.append(action)

    def __call__(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        actions: list[Callable[[], None]] = []
        token = _AFTER_WRITE.set(actions)
        try:
            admitted = [guard.admit_save(self._trainer, str(filepath)) for guard in self.guards]
        finally:
            _AFTER_WRITE.reset(token)
        if all(admitted):
            # the arguments go on exactly as given: a save_checkpoint the user replaced sees the caller's own call
            self._save_and_agree_on_failure(filepath, *args, **kwargs)
            for action in actions:
                action()
        elif active_transaction() is not None:
            # a boundary's own write, refused by another guard (the same on every rank): the boundary that asked for
            # it must not go on as if it had been written (its ledger, its evictions); it is undone
            raise WriteRefused

    def _save_and_agree_on_failure(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Write, and make a failure on any rank an error on every rank.

        Under DDP only rank 0 writes. If its write raised straight away, rank 0 would leave while its peers wait in
        Lightning's post-save barrier, and they would only learn of it from a timeout. Instead the failure is held,
        and the agreement takes the place of that barrier: every rank waits there for every other, learns which ranks
        failed, and raises.
        """
        strategy = self._trainer.strategy
        held = HeldWriteFailure()
        write = strategy.save_checkpoint
        # a rank whose hooks failed has nothing worth writing; where rank 0 writes alone, no peer waits for its write
        skip_after_hook_failure = _writes_on_rank_zero_alone(strategy)

        def write_holding_failure(*args: Any, **kwargs: Any) -> None:
            if held.error is not None and skip_after_hook_failure:
                return
            held.write(strategy, functools.partial(write, *args, **kwargs), lambda: self._flush(str(filepath)))

        barrier = strategy.barrier

        def barrier_unless_after_the_write(name: str | None = None, *args: Any, **kwargs: Any) -> None:
            # Lightning's post-save barrier: the agreement right after it waits for every rank just the same, and
            # carries each rank's outcome, so the save costs ModelCheckpoint's one collective, not two
            if name != _POST_SAVE_BARRIER:
                barrier(name, *args, **kwargs)

        try:
            with replaced_attribute(strategy, "save_checkpoint", write_holding_failure), \
                    replaced_attribute(strategy, "barrier", barrier_unless_after_the_write), \
                    held.hooks_holding_failures(self._trainer):
                self._save_checkpoint(filepath, *args, **kwargs)
            agree_on_write(strategy, held.error, published_path(str(filepath)))
        except Exception as error:
            # A strategy whose save runs collectives after the failing rank's failure point (DeepSpeed ends its save
            # with a barrier) leaves the others waiting there until the strategy's timeout, and this rank's barrier
            # or agreement then fails too. This rank's own failure is the error worth reporting.
            if held.error is None or error is held.error:
                raise
            raise held.error from error


class HeldWriteFailure:
    """This rank's failure of one write, held for the agreement after it (where every rank learns of it) instead of
    raised here alone: the first one, as :func:`~lightning_ckguard._distributed.own_write_failure` makes it this
    rank's (a distributed checkpoint's failure of other ranks only is theirs to hold)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def hold(self, error: BaseException) -> None:
        self.error = self.error or own_write_failure(error)

    @contextmanager
    def hooks_holding_failures(self, trainer: Any) -> Iterator[None]:
        """For one save: the code of yours a Trainer's ``dump_checkpoint`` calls on each rank before the strategy
        writes (each callback's ``state_dict`` and ``on_save_checkpoint``, the LightningModule's
        ``on_save_checkpoint``, the datamodule's ``state_dict``) holds its failure instead of raising it, and once one
        failed, the hooks after it are not called, as its raise would have skipped them. The rest of the dump still
        runs on that rank, with the collectives it holds (ZeRO-1's optimizer-state consolidation, a sharded model's
        gathering), so that its peers are not left waiting there: they learn of the failure in the agreement after
        the write, and every rank raises there, the failing one its own error."""
        with ExitStack() as stack:
            for owner, name in _dump_hooks(trainer):
                hook = getattr(owner, name)
                try:
                    stack.enter_context(replaced_attribute(owner, name, self._holding_failure(hook)))
                except (AttributeError, TypeError):  # an object whose hook cannot be set: it raises as it would
                    continue
            yield

    def _holding_failure(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def hook_holding_failure(*args: Any, **kwargs: Any) -> Any:
            if self.error is not None:
                return None
            try:
                return hook(*args, **kwargs)
            except Exception as error:
                self.hold(error)
                return None

        return hook_holding_failure

    def write(self, strategy: Any, write: Callable[[], None], flush: Callable[[], None]) -> None:
        """Run ``write`` through ``strategy``, then ``flush`` this rank's part if it succeeded (a flush that fails is
        a failed write); a failure of either is held. Under DeepSpeed a file write that fails is held inside the save,
        so that this rank still reaches the barrier DeepSpeed's save ends with, instead of leaving its peers there
        until the timeout (:func:`_file_writes_holding_failures`). A sharded save through
        ``torch.distributed.checkpoint`` meets first (``_distributed.DistributedCheckpointMeeting``), so that a rank
        whose own part failed before it inside the strategy's save (a Fabric strategy converts your objects' state
        there) stops its peers there. A failure of your hooks in the Trainer's ``dump_checkpoint`` before it is held
        by :meth:`hooks_holding_failures`; one of Lightning's own code there on one rank (an optimizer's state dict)
        still waits for the collective timeout, as under ``ModelCheckpoint``."""
        meeting = DistributedCheckpointMeeting(strategy, "save", enabled=saves_through_distributed_checkpoint(strategy))
        try:
            with _file_writes_holding_failures(strategy, self.hold), meeting:
                write()
            if not meeting.settle(self.error) and self.error is None:
                flush()
        except write_errors() as error:  # a distributed checkpoint's failure too (a BaseException)
            self.hold(error)
            meeting.settle(self.error)


def saves_through_distributed_checkpoint(strategy: Any) -> bool:
    """Whether ``strategy`` saves a sharded directory through ``torch.distributed.checkpoint`` (Lightning's FSDP and
    model-parallel strategies set to save sharded)."""
    return writes_directories(strategy) and uses_distributed_checkpoint(strategy)


def save_flushed(trainer: Any, filepath: str, flush: Callable[[str], None], *args: Any) -> None:
    """``trainer.save_checkpoint(filepath, *args)``, with ``flush(filepath)`` run on every rank right after its own
    part is written and before the write's outcome is agreed, so that a flush that fails on one rank fails the write
    on every rank. A Trainer driven by hand, whose writes are not sealed, flushes after its save returns."""
    seal = vars(trainer).get("save_checkpoint")
    if not isinstance(seal, PublicationSeal):
        trainer.save_checkpoint(filepath, *args)
        flush(filepath)
        return
    with replaced_attribute(seal, "_flush", flush):
        seal(filepath, *args)


@contextmanager
def _file_writes_holding_failures(strategy: Any, hold: Callable[[BaseException], None]) -> Iterator[None]:
    """Under DeepSpeed, make a failed file write held instead of raised, for the duration of one save.

    DeepSpeed's ``engine.save_checkpoint`` runs collectives after each rank has written its files (it ends with a
    barrier). A rank whose write raised would leave that save early, and its peers would wait in the barrier until the
    strategy's timeout. With its checkpoint engine's ``save`` holding the error, every rank goes through the same
    collectives, and the failure is raised on every rank right after (:func:`agree_on_write`).
    """
    deepspeed = is_deepspeed_strategy(strategy)
    engine = getattr(getattr(strategy, "model", None), "checkpoint_engine", None) if deepspeed else None
    if engine is None or not callable(getattr(engine, "save", None)):
        yield
        return
    save = engine.save

    def save_holding_failure(*args: Any, **kwargs: Any) -> Any:
        try:
            return save(*args, **kwargs)
        except write_errors() as error:
            hold(error)
            return None

    with replaced_attribute(engine, "save", save_holding_failure):
        yield


_ABSENT = object()

#: The top-level packages whose own classes' ``save_checkpoint`` writes exactly the path it is given.
_LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")


def _defined_by_lightning(owner: Any, name: str) -> bool:
    """Whether the method ``name`` that ``owner``'s class has comes from a class of a Lightning package (or from
    none: nothing overrides it, a test double), not from a subclass the user wrote."""
    cls = _defining_class(owner, name)
    return cls is None or _of_lightning(cls)


def _writes_on_rank_zero_alone(strategy: Any) -> bool:
    """Whether ``strategy`` saves by Lightning's base ``Strategy.save_checkpoint``: rank 0 writes through its
    checkpoint IO, and no rank runs a collective there (DDP, one device), so a rank may skip it. DeepSpeed's, FSDP's
    and model parallel's saves start with a broadcast, and a sharded one is collective."""
    cls = _defining_class(strategy, "save_checkpoint")
    return cls is not None and cls.__name__ == "Strategy" and _of_lightning(cls)


def _defining_class(owner: Any, name: str) -> type | None:
    """The class in ``owner``'s class's method resolution order that defines ``name``, or None."""
    return next((cls for cls in type(owner).__mro__ if name in vars(cls)), None)


def _of_lightning(cls: type) -> bool:
    return str(cls.__module__).split(".")[0] in _LIGHTNING_PACKAGES


def _dump_hooks(trainer: Any) -> list[tuple[Any, str]]:
    """The hooks of yours a Trainer's ``dump_checkpoint`` calls, as (object, method name); none for a Trainer
    double without a callback list."""
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list):
        return []
    hooks = [(callback, name) for callback in callbacks for name in ("state_dict", "on_save_checkpoint")]
    module, datamodule = getattr(trainer, "lightning_module", None), getattr(trainer, "datamodule", None)
    if module is not None:
        hooks.append((module, "on_save_checkpoint"))
    if datamodule is not None:
        hooks.append((datamodule, "state_dict"))
    return hooks

#: The name ``Trainer.save_checkpoint`` gives the barrier it ends with (Lightning 2.5 and 2.6).
_POST_SAVE_BARRIER = "Trainer.save_checkpoint"


def agree_on_write(strategy: Any, failure: BaseException | None, filepath: str,
                   values: Sequence[int] = ()) -> tuple[int, ...]:
    """Raise on every rank if the write of ``filepath`` failed on any rank; no collective without peers. ``values``,
    a few integers every rank sends alike, ride along: returns the largest of each over the ranks.

    The failing ranks re-raise their own error; the others raise :class:`CheckpointWriteError` naming the first
    failing rank and its error.
    """
    found = agree_on_failure(strategy, failure, values=values)
    error = write_error(found, failure, filepath)
    if error is not None:
        raise error
    return found.values


def write_error(found: Failures, own: BaseException | None, filepath: str,
                removal: bool = False) -> BaseException | None:
    """What this rank raises once every rank learned which ranks' write of ``filepath`` failed (``found``): its
    ``own`` error if it failed, else a :class:`CheckpointWriteError` naming the first failing rank and its error (of a
    ``removal``: an eviction), or None when nothing failed."""
    if own is not None:
        return own
    if not found.ranks:
        return None
    return CheckpointWriteError(ranks=list(found.ranks), filepath=filepath, cause=found.cause, removal=removal)
