"""``FiniteGradCheckpoint``: ``ModelCheckpoint`` that publishes nothing a non-finite gradient has touched.

Each saving hook of ``ModelCheckpoint`` runs once, as one boundary
(:func:`~lightning_ckguard.publication.run_boundary`):

1. the hook decides, exactly as ``ModelCheckpoint`` does; a hook that writes nothing keeps its bookkeeping and does
   not consume the window;
2. at its first file operation every rank agrees in one collective through ``trainer.strategy``
   (:class:`~lightning_ckguard.guard.GradientGuard`);
3. on acceptance the hook goes on (commit, serialize, link; evictions at the end); on rejection it is unwound, its
   bookkeeping restored, and the ``on_non_finite`` policy applied.
"""

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal
from weakref import proxy

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer

from lightning_ckguard._distributed import barrier, broadcast_value, is_multiprocess
from lightning_ckguard._validation import unwritable_dirpath_error, validate_arguments
from lightning_ckguard.agreement import Verdict
from lightning_ckguard.background import BackgroundPublisher, PluginWrites, PublicationUnit
from lightning_ckguard.errors import NonFiniteGradientError
from lightning_ckguard.guard import GradientGuard
from lightning_ckguard.held_metrics import flush_held_metrics, hold_metrics
from lightning_ckguard.ledger import Ledger
from lightning_ckguard.policy import NonFinitePolicy, Response, respond
from lightning_ckguard.publication import BoundaryTransaction, active_transaction, run_boundary
from lightning_ckguard.remote import (
    existed_before_write,
    exists_on_every_rank,
    newest_last_checkpoint,
    removal_allowed,
    unsupported_strategy_error,
)
from lightning_ckguard.report import BoundaryReport
from lightning_ckguard.rewind import DEFAULT_MAX_REWINDS, Position, Rewind, RewindLog
from lightning_ckguard.seal import PublicationSeal, agree_on_write
from lightning_ckguard.skips import scaler_skip_flag
from lightning_ckguard.source_selection import gradient_source_for
from lightning_ckguard.staging import (
    checkpoint_is_complete,
    discard,
    is_local,
    move_into_place,
    recover,
    release_all_retired,
    release_retired,
    staging_path,
    writes_directories,
)
from lightning_ckguard.state_sources import averaged_weights, lightning_checkpoint_state
from lightning_ckguard.top_k_vote import TopKVote, agree_on_top_k, local_top_k_decision, local_vote, vote_of

log = logging.getLogger(__name__)


_warnings = WarningCache()

#: Version of the callback state this release writes; states without one are ``ModelCheckpoint``'s format (version 1).
STATE_FORMAT_VERSION = 1
_FORMAT_KEY = "ckguard_format_version"

#: The public class name in either package; the state key and messages use it.
PUBLIC_NAME = "FiniteGradCheckpoint"

#: How each Lightning package's users import the callback: the one implementation below, subclassing that package's
#: ``ModelCheckpoint`` (``lightning`` and ``pytorch_lightning`` hold separate copies of the same classes).
IMPORT_FOR_PACKAGE = {
    "lightning.pytorch": "from lightning_ckguard import FiniteGradCheckpoint",
    "pytorch_lightning": "from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint",
}


@dataclass(frozen=True)
class LightningPackage:
    """The classes of one Lightning package that the callback checks against."""

    name: str  # "lightning.pytorch" or "pytorch_lightning"
    trainer: type
    torch_checkpoint_io: type
    async_checkpoint_io: type


def _package_of(module: str) -> str | None:
    """The Lightning package a module belongs to, or None."""
    return next((name for name in IMPORT_FOR_PACKAGE if module == name or module.startswith(name + ".")), None)


#: Attributes that only mean something while a fit runs (a Trainer, a module's gradient source, this boundary's vote):
#: not part of the callback's value, so a pickled or deep-copied callback leaves them out.
_RUNTIME_ATTRIBUTES = ("_trainer", "_guard", "_vote", "_collected", "_rewind_log", "_background", "_unit",
                       "_plugin_writes")


if TYPE_CHECKING:
    _CheckpointBase = ModelCheckpoint  # what the mixin is always combined with, for the type checker
else:
    _CheckpointBase = object


class GuardedCheckpoint(_CheckpointBase):
    r"""Drop-in replacement for :class:`~lightning.pytorch.callbacks.ModelCheckpoint` that never publishes a
    checkpoint after a non-finite gradient.

    Every rank records, on the device and without host syncs or collectives, whether the gradients its optimizer is
    about to apply are finite. At every boundary where ``ModelCheckpoint`` would write, delete or link a file, all
    ranks first agree through ``trainer.strategy`` in one small collective. Only an accepted boundary changes the
    top-K ledger, writes, evicts or links; a rejected one changes nothing. On finite runs it behaves exactly like
    ``ModelCheckpoint``: same files, same ``best_k_models``, same ``state_dict``.

    Args:
        dirpath, filename, monitor, verbose, save_last, save_top_k, save_on_exception, save_weights_only, mode,
            auto_insert_metric_name, every_n_train_steps, train_time_interval, every_n_epochs,
            save_on_train_epoch_end, enable_version_counter: As in ``ModelCheckpoint``, with the same defaults.
        on_non_finite: What every rank does at a rejected boundary.
            ``"raise"``: raise :class:`~lightning_ckguard.NonFiniteGradientError` (the same on every rank).
            ``"skip"``: publish nothing for this boundary, warn, and start a fresh window.
            ``"stop"``: publish nothing, set ``trainer.should_stop``; ``fit()`` returns normally.
            ``"rewind"``: publish nothing; every rank restores, in place, the most recent checkpoint this callback
            published in this fit (weights, optimizer, LR schedulers, loss scaler, weight averaging), starts a fresh
            window and trains on with the next batch (see :mod:`lightning_ckguard.rewind`). Without such a
            checkpoint, or after ``max_rewinds`` rewinds, it raises :class:`~lightning_ckguard.RewindRefusedError`
            (a ``NonFiniteGradientError``) on every rank, naming every earlier rewind.
        count_skipped_steps: Whether optimizer steps a loss scaler skipped (never applied) reject a boundary. They
            are reported either way.
        max_rewinds: With ``on_non_finite="rewind"``: how many rewinds one fit may make (default 3); a resumed fit
            counts from zero. Only valid with that policy.

    Raises:
        ValueError: If an argument has the wrong type, ``on_non_finite`` is not a known policy, ``max_rewinds`` is
            negative or given with another policy, or ``"rewind"`` is asked for with ``save_weights_only=True``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_ckguard import FiniteGradCheckpoint

        checkpoint = FiniteGradCheckpoint(monitor="val_loss", save_top_k=3, save_last=True)
        trainer = Trainer(strategy="ddp", devices=2, callbacks=[checkpoint])

    One implementation serves both Lightning packages: ``from lightning_ckguard import FiniteGradCheckpoint``
    subclasses ``lightning.pytorch``'s ``ModelCheckpoint``, ``from lightning_ckguard.pytorch_lightning import
    FiniteGradCheckpoint`` that of ``pytorch_lightning``; use the one your Trainer comes from.
    """

    #: The Lightning package of the concrete class: its Trainer and checkpoint IO (its ModelCheckpoint is the next
    #: class in the MRO, reached through ``super()``).
    _lightning: ClassVar[LightningPackage]

    def __init__(
        self,
        dirpath: _PATH | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        on_non_finite: NonFinitePolicy = "raise",
        count_skipped_steps: bool = False,
        max_rewinds: int | None = None,
    ) -> None:
        validate_arguments(dict(locals()))
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self.on_non_finite: NonFinitePolicy = on_non_finite
        self.count_skipped_steps = count_skipped_steps
        self.max_rewinds = max_rewinds
        self._rewind_log: RewindLog | None = None  # this fit's rewinds, with on_non_finite="rewind"
        self._guard: GradientGuard | None = None
        self._rejection: NonFiniteGradientError | None = None
        self._trainer: pl.Trainer | None = None
        self._last_verdict: Verdict | None = None
        self._last_report: BoundaryReport | None = None
        self._counts = {"accepted": 0, "rejected": 0}
        self._vote: TopKVote | None = None
        self._collected: Verdict | None = None  # this boundary's verdict, agreed with its top-K vote, not yet applied
        # with AsyncCheckpointIO: the thread that writes and publishes accepted boundaries in order, and the unit of
        # the boundary running now (see lightning_ckguard.background)
        self._background: BackgroundPublisher | None = None
        self._unit: PublicationUnit | None = None
        self._plugin_writes: PluginWrites | None = None  # under the AsyncCheckpointIO, chosen at setup

    @property
    def rejection(self) -> NonFiniteGradientError | None:
        """The error of the rejection that sealed this run, if any. While set, nothing is published."""
        return self._rejection

    @property
    def last_report(self) -> BoundaryReport | None:
        """What the most recent agreement (boundary or manual save) decided, as a readable immutable value; the
        same on every rank. ``str(report.message)`` is the line the callback warns with."""
        return self._last_report

    @property
    def rewinds(self) -> tuple[Rewind, ...]:
        """The rewinds of the current (or most recent) fit, oldest first; the same on every rank."""
        return tuple(self._rewind_log.rewinds) if self._rewind_log is not None else ()

    @property
    def last_verdict(self) -> Verdict | None:
        """The verdict of the most recent agreement (boundary or manual save), identical on every rank."""
        return self._last_verdict

    # ------------------------------------------------------------------ setup and recording

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """``ModelCheckpoint.setup``; then, on every rank: refuse a Trainer of the other Lightning package, install the
        publication seal, choose the write path of this fit once (background publication under an
        ``AsyncCheckpointIO``), recover what an interrupted publication left, and check that ``dirpath`` is writable.

        Raises:
            TypeError: For a Trainer of the other Lightning package (the message names the import that fits).
        """
        if not isinstance(trainer, self._lightning.trainer):
            # `lightning.pytorch` and `pytorch_lightning` are separate copies of the same classes: a Trainer of the
            # other package would not treat this callback as a ModelCheckpoint (it adds its own), so refuse it
            raise self._wrong_package_error(type(trainer).__module__, type(trainer).__qualname__)
        super().setup(trainer, pl_module, stage)
        if self.dirpath is not None and not is_local(self._fs):
            # every rank, before anything is written: such a strategy would write to local disk instead
            unsupported = unsupported_strategy_error(trainer.strategy, str(self.dirpath))
            if unsupported is not None:
                raise unsupported
        self._trainer = trainer
        self._background = None
        PublicationSeal.install(trainer, self)
        plugin = trainer.strategy.checkpoint_io
        self._plugin_writes = PluginWrites.install(plugin) if self._saves_in_background(trainer, plugin) else None
        if trainer.is_global_zero and self.dirpath is not None and is_local(self._fs):
            for action in recover(str(self.dirpath)):  # what a crash during an earlier publication left behind
                rank_zero_warn(f"FiniteGradCheckpoint {action}.")
        if stage == "fit" and self.dirpath is not None and is_local(self._fs):
            # every rank, as every rank writes its part of a directory checkpoint: fail now, not at the first save.
            # The agreement is also the barrier after rank 0's recovery: no rank restores before the files are back
            failure = unwritable_dirpath_error(str(self.dirpath), trainer.global_rank, trainer.global_step)
            agree_on_write(trainer.strategy, failure, str(self.dirpath))
        else:
            barrier(trainer.strategy, "FiniteGradCheckpoint.recover")  # every rank restores from the recovered files

    def _wrong_package_error(self, module: str, trainer_class: str | None = None) -> TypeError:
        """The error for a Trainer of another package: ``module`` is the Trainer's (or the Trainer code's) module."""
        here, other = self._lightning.name, _package_of(module)
        user = f"`{module}.{trainer_class}`" if trainer_class else f"a `{other}` Trainer"
        hint = (f" For a `{other}` Trainer, use `{IMPORT_FOR_PACKAGE[other]}`." if other is not None and other != here
                else f" Import the Trainer (and your LightningModule) from `{here}`.")
        return TypeError(
            f"This {PUBLIC_NAME} (`{IMPORT_FOR_PACKAGE[here]}`) is a `{here}` callback and needs a `{here}.Trainer`, "
            f"got {user}.{hint}"
        )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give the Trainer back its own ``save_checkpoint`` (not after a rejection: the seal stays), stop the
        background writer, and log the ``ckguard/*`` values no flush carried."""
        # After a rejection the seal stays: no later save in this process may publish the diverged state.
        if self._rejection is None:
            PublicationSeal.uninstall(trainer, self)
        if self._background is not None:  # every unit has run by now (train end, or the exception)
            self._background.close()
        if self._plugin_writes is not None:
            self._plugin_writes.uninstall()
            self._plugin_writes = None
        flush_held_metrics(trainer, uninstall=True)  # what a fit without a train end (validate) still holds
        self._trainer = None
        self._guard = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the guard for the wrapped module and its optimizers (their identities are final now) and, with
        ``on_non_finite="rewind"``, this fit's rewind log; a new fit after a rejection starts unsealed."""
        # after the strategy wrapped the model and built the optimizers, so parameter identities are final
        source = gradient_source_for(trainer.strategy, pl_module)
        self._guard = self._new_guard(trainer, source)
        if self.on_non_finite == "rewind":  # every fit counts its rewinds from zero, resumed or not
            limit = DEFAULT_MAX_REWINDS if self.max_rewinds is None else self.max_rewinds
            log_dir = str(self.dirpath) if self.dirpath is not None and is_local(self._fs) else None
            self._rewind_log = RewindLog(limit, log_dir, Position.of(trainer))
        if self._rejection is not None:
            resumed = trainer.ckpt_path is not None
            rank_zero_info(
                f"FiniteGradCheckpoint: a new fit starts after the rejection at global step "
                f"{self._rejection.global_step}"
                + (f"; resuming from {trainer.ckpt_path}." if resumed else "; the first checkpoint needs a new step.")
            )
            self._rejection = None
            self._guard.reset(pending_rejection=not resumed)

    def _new_guard(self, trainer: pl.Trainer, source: Any = None) -> GradientGuard:
        """A guard for ``trainer``'s module; buffers that are non-finite by design now (a ``-inf`` attention mask), in
        the module and in averaged copies, are left out of its state check, with an info line naming them."""
        module = trainer.lightning_module  # None on a Trainer driven by hand: nothing recorded, nothing to check
        guard = GradientGuard(module, count_skipped_steps=self.count_skipped_steps, source=source,
                              device=trainer.strategy.root_device)
        constants = sorted(guard.note_constant_buffers(module)) if module is not None else []
        for callback in getattr(trainer, "callbacks", ()):  # set by Lightning's callback connector
            averaged = averaged_weights(callback)
            if averaged is not None:
                label = f"averaged weights ({type(callback).__name__})"
                constants += [f"{label}: {name}" for name in sorted(guard.note_constant_buffers(averaged))]
        if constants:
            _warnings.info(
                "FiniteGradCheckpoint: these buffers hold non-finite values at the start (e.g. an attention mask of "
                f"-inf), so they are treated as constants and not checked: {', '.join(constants)}."
            )
        return guard

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Record, on the device, whether the gradients ``optimizer`` is about to apply are finite (no host sync,
        no collective)."""
        # after backward, gradient accumulation and AMP unscaling, before clipping and the step itself
        if self._guard is not None:
            scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
            self._guard.record(optimizer, step=trainer.global_step, skipped=scaler_skip_flag(scaler, optimizer))

    # ------------------------------------------------------------------ boundaries

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        """Settle the step's skip outcome (DeepSpeed), then ``ModelCheckpoint``'s hook as one guarded boundary."""
        if self._guard is not None:
            self._guard.conclude_step()  # the optimizer has run: a strategy that skips steps (DeepSpeed) knows now
        hook = partial(super().on_train_batch_end, trainer, pl_module, outputs, batch, batch_idx)
        self._boundary(trainer, "train batch end", hook)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary."""
        self._boundary(trainer, "train epoch end", partial(super().on_train_epoch_end, trainer, pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary."""
        self._boundary(trainer, "validation end", partial(super().on_validation_end, trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary; then wait for the background writes (a failure raises
        on every rank), release the directories kept for readers, and log what no flush carried."""
        self._boundary(trainer, "train end", partial(super().on_train_end, trainer, pl_module))
        self._finish_background(trainer)
        self._release_retired_copies(trainer)  # on a failure, on_exception does it, after the background drained
        flush_held_metrics(trainer)  # nothing of Lightning's is logged after this hook

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """``ModelCheckpoint``'s save on exception as one guarded boundary (a rejection seals and warns: the original
        error surfaces); each rank then settles its background writes without a collective."""
        hook = partial(super().on_exception, trainer, pl_module, exception)
        try:
            self._boundary(trainer, "exception", hook, during_exception=True)
            self._finish_background(trainer, during_exception=True)
        finally:
            self._release_retired_copies(trainer)
            flush_held_metrics(trainer)  # before Lightning finalizes the loggers

    def _finish_background(self, trainer: pl.Trainer, during_exception: bool = False) -> None:
        """At the end of training, wait for every background write; a failure raises on every rank, as at a
        boundary. During an exception no collective is safe and the original error is the one to surface: each rank
        rolls back to what it published and says so."""
        background = self._background
        if background is None:
            return
        background.wait()
        try:
            failure = background.local_failure() if during_exception else background.agree_on_failures(trainer.strategy)
        finally:
            background.close()
        if failure is None:
            return
        if failure.published is not None:
            failure.published.apply_to(self)
        if during_exception:
            rank_zero_warn(f"FiniteGradCheckpoint: a background checkpoint write failed as well: {failure.error}")
            return
        raise failure.error

    def _boundary(
        self, trainer: pl.Trainer, name: str, hook: Callable[[], None], during_exception: bool = False
    ) -> None:
        if self._rejection is not None:
            return  # the run was rejected: nothing publishes again (the decision was the same on every rank)
        top_k_before = set(self.best_k_models)
        remove = partial(self._evict, trainer)
        try:
            outcome = run_boundary(
                self,
                hook,
                agree=lambda: self._agree_at_boundary(trainer, name),
                # with a background unit, an eviction waits in it until the unit published everything
                remove=lambda path: self._unit.evict(path, remove) if self._unit is not None else remove(path),
            )
            if outcome == "published" and self._unit is not None:
                assert self._background is not None
                self._background.submit(self._unit)  # queued behind the boundaries accepted before it
        finally:
            self._vote = None  # the top-K vote belongs to this boundary: the next one takes its own
            self._collected = None
            self._unit = None
            if self._plugin_writes is not None:
                self._plugin_writes.unit = None
        if outcome == "rejected":
            self._reject(trainer, during_exception)
        elif outcome == "published":
            assert self._guard is not None
            log.debug("FiniteGradCheckpoint published at %s, global step %d", name, trainer.global_step)
            self._guard.reset()
            if self._rewind_log is not None:
                self._note_published(trainer, top_k_before)

    def _agree_at_boundary(self, trainer: pl.Trainer, boundary: str) -> bool:
        """The agreement at a boundary's first file operation. With background writes, every rank then also learns
        whether an earlier boundary's write failed (raised here, the ledger back to what was published), and an
        accepted boundary opens its unit."""
        # agreed already if the boundary voted on its top K (the vote rode in the agreement), else now
        collected = self._collected if self._collected is not None else self._collect_verdict(trainer)[0]
        verdict = self._apply_verdict(trainer, collected, boundary)
        background = self._background_publisher(trainer)
        if background is None:
            return verdict.accepted
        transaction = self._own_transaction()
        assert transaction is not None
        failure = background.agree_on_failures(trainer.strategy)
        if failure is not None:
            if failure.published is not None:
                transaction.roll_back_to(failure.published)
            raise failure.error
        if verdict.accepted:
            self._unit = background.open_unit(transaction.before)
            assert self._plugin_writes is not None
            self._plugin_writes.unit = self._unit  # the plugin's removals of this boundary wait in its unit
        return verdict.accepted

    def _saves_in_background(self, trainer: pl.Trainer, plugin: Any) -> bool:
        """Whether this fit publishes in the background: the Trainer saves through Lightning's ``AsyncCheckpointIO``
        (a subclass too) over a ``TorchCheckpointIO``, single files on a local filesystem. Otherwise every write is
        synchronous; strategies that write directories (DeepSpeed, distributed checkpoints) do so themselves."""
        return (
            isinstance(plugin, self._lightning.async_checkpoint_io)
            and isinstance(plugin.checkpoint_io, self._lightning.torch_checkpoint_io)  # type: ignore[attr-defined]
            and hasattr(plugin, "_checkpoint_io")
            and not writes_directories(trainer.strategy)
            and PublicationSeal.writes_through_lightning(trainer)
            and self.dirpath is not None
            and is_local(self._fs)
        )

    def _background_publisher(self, trainer: pl.Trainer) -> BackgroundPublisher | None:
        """The background publisher of a fit that publishes in the background (chosen at setup), else None."""
        if self._plugin_writes is None:
            return None
        if self._background is None:
            self._background = BackgroundPublisher()
        return self._background

    def _agree(self, trainer: pl.Trainer, boundary: str) -> Verdict:
        return self._apply_verdict(trainer, self._collect_verdict(trainer)[0], boundary)

    def _collect_verdict(
        self, trainer: pl.Trainer, carry: list[int] | None = None
    ) -> tuple[Verdict, tuple[tuple[int, ...], ...]]:
        """Every rank joins the agreement (one collective, ``carry`` riding in it); nothing is applied yet."""
        if self._guard is None:  # not fitting: nothing was recorded, but every rank still meets here
            self._guard = self._new_guard(trainer)
        # the state this write will hold is checked too, before anything is collected, in the same agreement
        state = lightning_checkpoint_state(trainer)
        return self._guard.agree_carrying(trainer.strategy, carry or [], global_step=trainer.global_step, state=state)

    def _apply_verdict(self, trainer: pl.Trainer, verdict: Verdict, boundary: str) -> Verdict:
        """Count, report and log a verdict at the point it decides a write."""
        report = verdict.report(boundary)
        self._last_verdict, self._last_report = verdict, report
        self._counts["accepted" if verdict.accepted else "rejected"] += 1
        self._log_metrics(trainer, report)
        if report.accepted and report.skipped_steps:
            rank_zero_info(report.message)
        return verdict

    def _log_metrics(self, trainer: pl.Trainer, report: BoundaryReport) -> None:
        # plain Python numbers from the verdict: no device read, no collective; they ride in Lightning's next flush
        hold_metrics(trainer, {
            "ckguard/accepted": float(self._counts["accepted"]),
            "ckguard/rejected": float(self._counts["rejected"]),
            "ckguard/non_finite_steps": float(report.num_steps),
            "ckguard/skipped_steps": float(report.skipped_steps),
        })

    def _reject(self, trainer: pl.Trainer, during_exception: bool) -> None:
        """Apply the response :func:`~lightning_ckguard.policy.respond` decides for the rejection just agreed on
        (the same on every rank): the decision is there, this only carries it out."""
        assert self._last_report is not None and self._guard is not None  # the report _agree just made
        report = self._last_report
        response = respond(self.on_non_finite, during_exception=during_exception,
                           fitting=self._rewind_log is not None)
        if response is Response.REWIND:
            assert self._rewind_log is not None
            self._rewind(trainer, report, self._rewind_log)
            return
        if response is Response.SKIP:
            self._guard.reset(pending_rejection=True)
        if response.seals:
            self._rejection = report.to_error()
        if response is Response.STOP:
            trainer.should_stop = True
        if response is Response.RAISE:
            raise self._rejection  # type: ignore[misc]  # set just above: RAISE seals
        rank_zero_warn(f"{report.message} {_RESPONSE_WORDS[response]}")

    def _note_published(self, trainer: pl.Trainer, top_k_before: set[str]) -> None:
        """Remember what a rewind would go back to: the top-K file this boundary wrote (a name no later boundary
        rewrites with other weights), else the file it wrote last (``last``, which holds the same state)."""
        assert self._rewind_log is not None
        written = [path for path in self.best_k_models if path not in top_k_before]
        path = written[-1] if written else self._last_checkpoint_saved
        if path:
            self._rewind_log.note_published(path, Position.of(trainer))

    def _rewind(self, trainer: pl.Trainer, report: BoundaryReport, rewind_log: RewindLog) -> None:
        """Every rank restores the last published checkpoint together (the verdict decided, the same everywhere)."""
        assert self._guard is not None
        if self._background is not None:
            self._background.wait()  # the checkpoint to go back to may still be being written in the background
        try:
            rewind = rewind_log.rewind(trainer, report, exists=self._fs.exists)
        except NonFiniteGradientError as refused:  # no checkpoint, max_rewinds reached, or the restore failed
            self._rejection = refused  # sealed: the weights are the rejected ones
            raise
        self._guard.reset()  # the restored weights are the accepted ones: the next window starts clean
        rank_zero_warn(
            f"{report.message} Rewound in place (rewind {rewind.number} of at most {rewind_log.max_rewinds} in this "
            f"fit): {rewind.describe()}; training goes on with the next batch, at global step {rewind.global_step}."
            + (f" Logged to {rewind_log.log_path}." if rewind_log.log_path else "")
        )
        hold_metrics(trainer, {"ckguard/rewinds": float(rewind.number)})

    # ------------------------------------------------------------------ writes outside our boundaries

    def admit_save(self, trainer: pl.Trainer, filepath: str) -> bool:
        """Gate for every checkpoint write of the Trainer (see :class:`~lightning_ckguard.seal.PublicationSeal`).

        Our own accepted boundary passes. Any other write (manual ``trainer.save_checkpoint``, other callbacks)
        passes the same preflight agreement first; inside a running fit a rejection applies ``on_non_finite`` like
        a boundary, outside one it raises. After a rejection every later write is refused: skipped with a warning
        while the fit is still running or Lightning is handling an exception (so the original error surfaces and
        the Trainer tears down), raised as the ``NonFiniteGradientError`` otherwise.
        """
        if self._own_transaction() is not None:
            return True  # our own boundary's write: its agreement was the first file operation (admit)
        if trainer is not self._trainer:
            # a Trainer this callback has since left: it records nothing for it any more, but a rejection stands
            if self._rejection is not None:
                raise self._rejection
            return True
        running = trainer.state.stage is not None
        if self._rejection is None:
            verdict = self._agree(trainer, f"a save to {filepath}")
            if verdict.accepted:
                assert self._guard is not None
                self._guard.reset()
                return True
            if running and not trainer.interrupted:
                self._reject(trainer, during_exception=False)
                return False  # "skip" or "stop": the write is skipped
            self._rejection = verdict.to_error()
        if running:
            rank_zero_warn(f"FiniteGradCheckpoint refused to write {filepath}. {self._rejection}")
            return False
        raise self._rejection

    # ------------------------------------------------------------------ ModelCheckpoint's file operations

    def _own_transaction(self) -> BoundaryTransaction | None:
        """The transaction of this callback's boundary while its hook runs, else None."""
        transaction = active_transaction()
        return transaction if transaction is not None and transaction.checkpoint is self else None

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        transaction = self._own_transaction()
        if transaction is None:  # called outside a boundary: the seal still puts it through the preflight
            super()._save_checkpoint(trainer, filepath)
            return
        transaction.admit()  # the boundary's first file operation agrees; a rejection unwinds the hook here
        transaction.note_write(filepath, existed=trainer.is_global_zero and self._existed(filepath))
        if self._unit is not None:
            self._save_in_background(trainer, filepath, self._unit)
        elif self._stages_writes(trainer):
            self._save_staged(trainer, filepath)
        else:
            super()._save_checkpoint(trainer, filepath)

    def _existed(self, filepath: str) -> bool:
        """Whether ``filepath`` exists before this boundary writes it (rank 0; an object store that cannot say)."""
        return bool(self._fs.exists(filepath)) if is_local(self._fs) else existed_before_write(self._fs, filepath)

    def file_exists(self, filepath: _PATH, trainer: pl.Trainer) -> bool:
        """``ModelCheckpoint.file_exists``; on a filesystem that is not local, a look that fails on rank 0 (an object
        store that stopped answering) raises on every rank instead of leaving the others in the reduction."""
        if is_local(self._fs):
            return bool(super().file_exists(filepath, trainer))
        return exists_on_every_rank(trainer.strategy, self._fs, str(filepath), trainer.is_global_zero)

    def _stages_writes(self, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint is written beside its name and renamed into place: on a local filesystem, for the
        writes Lightning itself makes at exactly the path it is given. A ``save_checkpoint`` the user replaced (a
        ``Mock``) or a ``CheckpointIO`` of their own gets the real path, as from ``ModelCheckpoint``."""
        if not (PublicationSeal.writes_through_lightning(trainer) and is_local(self._fs)):
            return False
        checkpoint_io = trainer.strategy.checkpoint_io
        return writes_directories(trainer.strategy) or isinstance(checkpoint_io, self._lightning.torch_checkpoint_io)

    def _save_staged(self, trainer: pl.Trainer, filepath: str) -> None:
        """``ModelCheckpoint._save_checkpoint``, publishing atomically: every rank writes into a staging sibling
        (Lightning's own write path, unchanged), and rank 0 moves it into place once all ranks are done."""
        staging = staging_path(filepath)
        if trainer.is_global_zero:
            release_retired(filepath)  # the copy the last replacement kept: at most two copies of a name at a time
        try:
            # ends with Lightning's post-save barrier; a failure on any rank raises on every rank (the seal)
            trainer.save_checkpoint(staging, self.save_weights_only)
        except BaseException:
            if trainer.is_global_zero:
                discard(staging)
            raise
        failure: Exception | None = None
        # a write that left nothing there (a checkpoint IO writing elsewhere) has nothing to publish
        if trainer.is_global_zero and os.path.lexists(staging):
            try:
                move_into_place(staging, filepath)
            except Exception as error:
                failure = error
        agree_on_write(trainer.strategy, failure, filepath)  # also the barrier: nobody links or evicts before this
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:  # after the rename, so a logger that uploads the file finds it
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _save_in_background(self, trainer: pl.Trainer, filepath: str, unit: PublicationUnit) -> None:
        """``ModelCheckpoint._save_checkpoint`` with ``AsyncCheckpointIO``: the checkpoint is collected on every rank
        and handed to the plugin exactly as ``ModelCheckpoint`` hands it (the plugin snapshots the tensors and queues
        the write on its own thread); underneath the plugin, its copy is handed over to the boundary's unit
        (:class:`~lightning_ckguard.background.PluginWrites`), which writes it into the staging sibling and moves it
        into place, before the unit's links and evictions."""
        writes = self._plugin_writes
        assert writes is not None
        expected = writes.expect(filepath) if trainer.is_global_zero else None  # rank 0 calls the plugin
        try:
            trainer.save_checkpoint(filepath, self.save_weights_only)  # a failure on any rank raises on every rank
        except BaseException:
            if expected is not None:
                writes.forget(filepath, expected)
            raise
        if expected is not None:
            unit.write(expected.staging, writes.writer(filepath, expected))
            unit.publish(expected.staging, filepath)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:  # as ModelCheckpoint with AsyncCheckpointIO: the write may still be running
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        """``ModelCheckpoint``'s candidates, after every rank voted on the monitored value (one collective).

        ``ModelCheckpoint`` asks for the candidates only where it will consider saving, at the same point on every
        rank. Its next steps branch on whether the monitored key is there: deferring to validation, warning,
        raising, or taking part in the top-K vote. A key missing on some ranks only would send them down different
        branches, and the others would wait in a collective they never join. After this vote the key is either
        present on every rank or removed on every rank, and :meth:`check_monitor_top_k` answers from the vote.
        """
        candidates = super()._monitor_candidates(trainer)
        if self.monitor is None:
            return candidates
        current = candidates.get(self.monitor)
        top_k = (self.best_k_models, self.kth_best_model_path, self.save_top_k, self.mode)
        improves = local_top_k_decision(current, *top_k)
        if self._own_transaction() is not None and is_multiprocess(trainer.strategy):
            # in a boundary the vote rides in the agreement, one collective for both: the first file operation, if
            # any, finds it agreed (and a boundary that then writes nothing applies nothing of it). Without peers
            # the vote is no collective: the agreement waits for a write, as it must not read state for nothing
            self._collected, votes = self._collect_verdict(trainer, local_vote(current is not None, improves))
            self._vote = vote_of(votes)
        else:
            self._vote = agree_on_top_k(trainer.strategy, present=current is not None, improves=improves)
        missing = self._vote.missing_ranks
        if missing and len(missing) < trainer.world_size:
            _warnings.warn(
                f"`FiniteGradCheckpoint(monitor={self.monitor!r})`: the monitored key is missing from the logged "
                f"metrics of rank(s) {list(missing)} at global step {trainer.global_step}, so every rank treats it "
                f"as missing. HINT: log it on every rank (not with `rank_zero_only=True`)."
            )
        if missing:
            candidates.pop(self.monitor, None)
        return candidates

    def check_monitor_top_k(self, trainer: pl.Trainer, current: Tensor | None = None) -> bool:
        """Whether ``current`` enters the top K: the vote every rank took with the candidates, when there is one."""
        if self._vote is None or current is None:
            return super().check_monitor_top_k(trainer, current)
        return self._vote.improves

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        transaction = self._own_transaction()
        if transaction is not None and self._unit is None:
            transaction.defer_removal(filepath)  # only once every write of the boundary succeeded
        else:
            # outside a boundary; or in the background, where the plugin is called now, as by ModelCheckpoint, and
            # the removal itself waits in the boundary's unit (PluginWrites)
            self._evict(trainer, filepath)

    def _evict(self, trainer: pl.Trainer, filepath: str) -> None:
        """``ModelCheckpoint``'s own removal, for real, and the retired copy an earlier replacement of the name kept
        (else a crash before the fit ends would have recovery restore the evicted checkpoint)."""
        super()._remove_checkpoint(trainer, filepath)
        if trainer.is_global_zero and is_local(self._fs):
            release_retired(filepath)

    def _release_retired_copies(self, trainer: pl.Trainer) -> None:
        """Once nothing is being published any more in this fit, rank 0 removes the replaced directories it kept for
        readers (:mod:`~lightning_ckguard.staging`), leaving the files ``ModelCheckpoint`` would. Not after a
        rejection: that changes nothing on disk, hidden entries included (the next fit's recovery removes them)."""
        if self._rejection is None and trainer.is_global_zero and self.dirpath is not None and is_local(self._fs):
            release_all_retired(str(self.dirpath))

    @property
    def state_key(self) -> str:
        """Exactly the key ``ModelCheckpoint`` with the same arguments stores its state under, so checkpoints move
        between the two classes both ways with nothing lost (a subclass keeps its own name, as for any callback).

        Raises:
            TypeError: When a Trainer of the other Lightning package asks (it validates its callbacks' keys while it
                is constructed, before any hook could say which import fits).
        """
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if _package_of(caller) not in (None, self._lightning.name):
            raise self._wrong_package_error(caller)
        key = super().state_key
        if type(self).__qualname__ == PUBLIC_NAME:
            return "ModelCheckpoint" + key[len(PUBLIC_NAME) :]
        return key

    @property
    def _legacy_state_key(self) -> Any:
        # where earlier releases stored the state ("FiniteGradCheckpoint{...}"): Lightning falls back to it on load
        if type(self).__qualname__ == PUBLIC_NAME:
            return PUBLIC_NAME + self.state_key[len("ModelCheckpoint") :]
        return super()._legacy_state_key

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), **dict.fromkeys(_RUNTIME_ATTRIBUTES)}

    def state_dict(self) -> dict[str, Any]:
        """``ModelCheckpoint``'s state, plus the format version of this release."""
        return {**super().state_dict(), _FORMAT_KEY: STATE_FORMAT_VERSION}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this or an earlier release, or by a plain ``ModelCheckpoint``.

        Raises:
            ValueError: If the state comes from a newer, unknown format: loading it could silently drop bookkeeping.
        """
        version = state_dict.get(_FORMAT_KEY, 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_FORMAT_VERSION:
            raise ValueError(
                f"The checkpoint's FiniteGradCheckpoint state has format version {version!r}, but this "
                f"lightning_ckguard reads versions 1 to {STATE_FORMAT_VERSION}. It was written by a newer release: "
                "upgrade lightning_ckguard to resume from it."
            )
        super().load_state_dict({key: value for key, value in state_dict.items() if key != _FORMAT_KEY})
        self._drop_missing_checkpoints()

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """Candidates for ``ckpt_path="last"``, found after resolving what an interrupted publication left behind.

        Lightning resolves ``"last"`` on every rank before any callback's ``setup``, so ``setup``'s recovery would be
        too late: a crash while ``last`` was being replaced leaves it renamed aside, and the run would start from
        scratch. Every rank recovers here (``recover`` tolerates running concurrently), then lists as usual.
        """
        # without a `dirpath` argument the directory comes from the logger, as ModelCheckpoint resolves it
        resolve_dirpath = self._ModelCheckpoint__resolve_ckpt_dir  # type: ignore[attr-defined]
        dirpath = self.dirpath if self.dirpath is not None else resolve_dirpath(trainer)
        fs = get_filesystem(dirpath)  # the directory's own: `_fs` is the local one until `setup` without a dirpath
        if not is_local(fs):
            # ModelCheckpoint would list protocol-less paths, which Lightning then looks up on the local disk
            return newest_last_checkpoint(fs, str(dirpath), self._is_last_name)
        actions = recover(str(dirpath))
        if actions:  # whichever rank got there first did it: that rank says so
            warnings.warn(f"FiniteGradCheckpoint (rank {trainer.global_rank}) {'; '.join(actions)}.", stacklevel=2)
        return super()._find_last_checkpoints(trainer)

    def _is_last_name(self, name: str) -> bool:
        """Whether a file name is one ``ModelCheckpoint`` gives a ``last`` checkpoint (``last.ckpt``, ``last-v1.ckpt``),
        by the test ``ModelCheckpoint._find_last_checkpoints`` applies."""
        stem, suffix = os.path.splitext(name)
        return suffix == self.FILE_EXTENSION and re.match(rf"^{self.CHECKPOINT_NAME_LAST}(-(\d+))?", stem) is not None

    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """``ModelCheckpoint``'s rule, and on a filesystem that is not local the rule it applies on local disk: never
        the checkpoint the fit resumed from, nor one outside ``dirpath`` (``ModelCheckpoint`` would remove any path
        there, Lightning issue #21813)."""
        if is_local(self._fs):
            return bool(super()._should_remove_checkpoint(trainer, previous, current))
        dirpath = str(self.dirpath) if self.dirpath is not None else None
        resumed_from = str(trainer.ckpt_path) if trainer.ckpt_path is not None else None
        return removal_allowed(self._fs, previous, current, dirpath, resumed_from)

    def _drop_missing_checkpoints(self) -> None:
        """Forget ledger entries whose checkpoint is gone (deleted by hand, lost in a crash) or visibly cut off
        (:func:`~lightning_ckguard.staging.checkpoint_is_complete`), with a warning; the files themselves stay.

        Rank 0's view of the files decides, so every rank keeps the same ledger even without a shared filesystem.
        """
        paths = [*self.best_k_models, self.last_model_path]
        local = is_local(self._fs)
        missing = [p for p in paths if p and not (self._fs.exists(p) and (not local or checkpoint_is_complete(p)))]
        trainer = self._trainer
        if trainer is not None:
            missing = broadcast_value(trainer.strategy, missing, src=0)
        if not missing:
            return
        Ledger.capture(self).without(missing, self.mode).apply_to(self)
        rank_zero_warn(
            f"FiniteGradCheckpoint dropped {len(missing)} checkpoint(s) its state lists but that no longer exist or "
            "are incomplete: "
            + ", ".join(missing)
        )


def link_in_boundary(link: Callable[[Any, str, str], None], trainer: Any, filepath: str, linkpath: str) -> None:
    """``ModelCheckpoint._link_checkpoint`` (``link``, a static method) inside a guarded boundary: the boundary it
    belongs to is the transaction running now. Outside one it is ``link`` itself."""
    transaction = active_transaction()
    if transaction is None or not isinstance(transaction.checkpoint, GuardedCheckpoint):
        link(trainer, filepath, linkpath)
        return
    transaction.admit()  # a boundary whose first file operation is a link agrees here
    transaction.note_write(linkpath, existed=trainer.is_global_zero and os.path.lexists(linkpath))
    unit = transaction.checkpoint._unit
    if unit is not None:  # background writes: linked once the target is published, in the boundary's unit
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            unit.link(filepath, linkpath)
        trainer.strategy.barrier()  # the collective ModelCheckpoint's link ends with, so every rank runs the same
        return
    if not is_local(transaction.checkpoint._fs):
        link(trainer, filepath, linkpath)
        return
    # the link is made beside `linkpath` (same relative target) and renamed over it: `last` is never gone
    staging = staging_path(linkpath)
    link(trainer, filepath, staging)  # rank 0 links, then a barrier
    if trainer.is_global_zero and os.path.lexists(staging):
        move_into_place(staging, linkpath)


#: What the warning of a rejection that neither raises nor rewinds says happened.
_RESPONSE_WORDS = {
    Response.SEAL_AND_WARN: "Nothing was saved on exception.",
    Response.SKIP: "Skipped; training continues with a fresh window.",
    Response.STOP: "Stopping training.",
}


class FiniteGradCheckpoint(GuardedCheckpoint, ModelCheckpoint):
    __doc__ = GuardedCheckpoint.__doc__
    _lightning = LightningPackage("lightning.pytorch", pl.Trainer, TorchCheckpointIO, AsyncCheckpointIO)

    @staticmethod
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:  # static, as in ModelCheckpoint
        link_in_boundary(ModelCheckpoint._link_checkpoint, trainer, filepath, linkpath)
