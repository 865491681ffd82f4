"""``FiniteGradCheckpoint``: ``ModelCheckpoint`` that publishes nothing a non-finite gradient has touched.

This module faces Lightning and nothing else: the constructor, the hooks, ``ModelCheckpoint``'s seams and the
state. Each hook hands its work to the fit's :class:`~lightning_ckguard.lightning.fit.GuardedFit` (chosen at
``setup``): a saving hook of ``ModelCheckpoint`` runs once per boundary as a transaction that all ranks agree on at
its first file operation, and its file operations go through the fit's one writer.
"""

import sys
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import lightning.pytorch as pl
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer

from lightning_ckguard.agree.agreement import Verdict
from lightning_ckguard.agree.report import BoundaryReport
from lightning_ckguard.agree.spikes import SpikeGate
from lightning_ckguard.errors import NonFiniteGradientError
from lightning_ckguard.lightning import packages, validation
from lightning_ckguard.lightning.fit import (
    Decisions,
    GuardedFit,
    drop_missing_checkpoints,
    guard_state,
    link_in_boundary,
    own_transaction,
)
from lightning_ckguard.lightning.packages import PUBLIC_NAME, LightningPackage
from lightning_ckguard.publish.storage import storage_for
from lightning_ckguard.recover.policy import NonFinitePolicy
from lightning_ckguard.recover.rewind import Rewind

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
            ``"rewind"``: publish nothing; every rank restores, in place, the last checkpoint this callback published
            in this fit (weights, optimizer, LR schedulers, loss scaler, weight averaging) and trains on with the next
            batch (:func:`~lightning_ckguard.restore_trainer_state`). Without one, or after ``max_rewinds`` rewinds,
            it raises :class:`~lightning_ckguard.RewindRefusedError` on every rank, naming every earlier rewind.
        count_skipped_steps: Whether optimizer steps a loss scaler skipped (never applied) reject a boundary. They
            are reported either way.
        max_rewinds: With ``on_non_finite="rewind"``: how many rewinds one fit may make (default 3); a resumed fit
            counts from zero. Only valid with that policy.
        durable: Whether a published checkpoint survives a machine crash, not only a killed process: on a local
            ``dirpath`` its data is flushed (``fsync``) before it is renamed into place, and the directory after,
            before anything is evicted. ``False`` skips the flushes (scratch storage). Object storage needs none.
        spike_gate: Also reject a window with a step whose loss or global gradient norm spiked, though finite
            (:class:`~lightning_ckguard.SpikeGate`), through the same ``on_non_finite`` policy. Off by default.

    Raises:
        ValueError: If an argument has the wrong type, ``on_non_finite`` is not a known policy, ``max_rewinds`` is
            negative or given with another policy, or ``"rewind"`` is asked for with ``save_weights_only=True``.

    Example::

        from lightning.pytorch import Trainer
        from lightning_ckguard import FiniteGradCheckpoint

        checkpoint = FiniteGradCheckpoint(monitor="val_loss", save_top_k=3, save_last=True)
        trainer = Trainer(strategy="ddp", devices=2, callbacks=[checkpoint])

    ``lightning_ckguard.FiniteGradCheckpoint`` subclasses ``lightning.pytorch``'s ``ModelCheckpoint``,
    ``lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint`` that of ``pytorch_lightning``.
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
        durable: bool = True,
        spike_gate: SpikeGate | None = None,
    ) -> None:
        arguments = dict(locals())
        validation.validate_arguments(arguments)
        super().__init__(**{name: arguments[name] for name in validation.MODEL_CHECKPOINT_ARGUMENTS})
        self.on_non_finite: NonFinitePolicy = on_non_finite
        self.count_skipped_steps, self.max_rewinds, self.durable = count_skipped_steps, max_rewinds, durable
        self.spike_gate, self._decisions = spike_gate, Decisions()
        self._fit: GuardedFit | None = None  # from setup to teardown

    @property
    def rejection(self) -> NonFiniteGradientError | None:
        """The error of the rejection that sealed this run, if any. While set, nothing is published."""
        return self._decisions.rejection

    @property
    def last_report(self) -> BoundaryReport | None:
        """What the most recent agreement decided, the same on every rank; its ``message`` is the warning's line."""
        return self._decisions.last_report

    @property
    def rewinds(self) -> tuple[Rewind, ...]:
        """The rewinds of the current (or most recent) fit, oldest first; the same on every rank."""
        return self._decisions.rewinds

    @property
    def last_verdict(self) -> Verdict | None:
        """The verdict of the most recent agreement (boundary or manual save), identical on every rank."""
        return self._decisions.last_verdict

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """``ModelCheckpoint.setup``; then, on every rank: refuse a Trainer of the other Lightning package, seal the
        Trainer's writes, choose the write path of this fit once, recover what an interrupted publication left, and
        check that ``dirpath`` is writable.

        Raises:
            TypeError: For a Trainer of the other Lightning package (the message names the import that fits).
        """
        if not isinstance(trainer, self._lightning.trainer):
            # a Trainer of the other package would not treat this callback as a ModelCheckpoint: refuse it
            given = type(trainer)
            raise packages.wrong_package_error(self._lightning.name, given.__module__, given.__qualname__)
        super().setup(trainer, pl_module, stage)
        self._fit = GuardedFit.set_up(self, trainer, stage)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give back the Trainer's ``save_checkpoint`` (not after a rejection), stop the writer, log what is left."""
        if self._fit is not None:
            self._fit.tear_down()
            self._fit = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The guard (parameter identities are final now), with ``"rewind"`` the rewind log; a new fit is unsealed."""
        self._fit_for(trainer).start_fitting(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s; then where training starts, a resumed fit's loops restored by now."""
        super().on_train_start(trainer, pl_module)
        self._fit_for(trainer).start_training()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """With a spike gate, the loss joins its step (device-side), before any boundary can judge the step."""
        if self._fit is not None:
            self._fit.record_loss(loss)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
                                 ) -> None:
        """Record, on the device, whether the gradients ``optimizer`` is about to apply are finite (no host sync)."""
        if self._fit is not None:  # after backward, accumulation and AMP unscaling, before clipping and the step
            self._fit.record(optimizer)

    # ------------------------------------------------------------------ boundaries

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        """Settle the batch's step (DeepSpeed's skip outcome), then ``ModelCheckpoint``'s hook, guarded."""
        fit = self._fit_for(trainer)
        fit.end_batch()  # the optimizer has run: a strategy that skips steps (DeepSpeed) knows now
        fit.boundary("train batch end", partial(super().on_train_batch_end, trainer, pl_module, outputs, batch,
                                                batch_idx))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary."""
        self._fit_for(trainer).boundary("train epoch end", partial(super().on_train_epoch_end, trainer, pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary."""
        self._fit_for(trainer).boundary("validation end", partial(super().on_validation_end, trainer, pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``ModelCheckpoint``'s hook as one guarded boundary; then wait for the writes (a failure raises on every
        rank), release the directories kept for readers, and log what no flush carried."""
        fit = self._fit_for(trainer)
        fit.boundary("train end", partial(super().on_train_end, trainer, pl_module))
        fit.finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """``ModelCheckpoint``'s save on exception as one guarded boundary (a rejection seals and warns: the original
        error surfaces); each rank then settles its writes without a collective."""
        fit = self._fit_for(trainer)
        try:
            fit.boundary("exception", partial(super().on_exception, trainer, pl_module, exception),
                         during_exception=True)
        finally:
            fit.finish(during_exception=True)

    def admit_save(self, trainer: pl.Trainer, filepath: str) -> bool:
        """Gate for every checkpoint write of the Trainer (see ``PublicationSeal``): every write agrees first, and a
        rejection applies ``on_non_finite`` in a fit, else raises; after one every later write is refused."""
        if (transaction := own_transaction(self)) is not None:  # our boundary's write (a subclass's own too)
            transaction.admit()  # agreed first: a no-op after the boundary's first file operation
            return True
        if self._fit is None or self._fit.trainer is not trainer:  # a Trainer it left: a rejection still stands
            if self._decisions.rejection is not None:
                raise self._decisions.rejection
            return True
        return self._fit.admit_save(filepath)

    def _fit_for(self, trainer: pl.Trainer) -> GuardedFit:
        """The fit ``setup`` chose for ``trainer``; for a Trainer driven by hand (no ``setup``), one made now."""
        if self._fit is None or self._fit.trainer is not trainer:
            self._fit = GuardedFit.for_trainer(self, trainer)
        return self._fit

    # ------------------------------------------------------------------ ModelCheckpoint's seams

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        transaction = own_transaction(self)
        if transaction is None:  # outside a boundary: the seal still puts it through the preflight
            super()._save_checkpoint(trainer, filepath)
            return
        fit = self._fit_for(trainer)
        transaction.admit()  # the boundary's first file operation agrees; a rejection unwinds the hook here
        transaction.note_write(filepath, existed=trainer.is_global_zero and fit.storage.existed(filepath))
        fit.save(filepath)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self._fit_for(trainer).remove(filepath, own_transaction(self))

    def _remove_for_real(self, trainer: pl.Trainer, filepath: str) -> None:  # ModelCheckpoint's own removal
        super()._remove_checkpoint(trainer, filepath)

    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        """``ModelCheckpoint``'s, after every rank voted on the monitored value (one collective): no rank branches
        alone on whether it has the key."""
        candidates = super()._monitor_candidates(trainer)
        if self.monitor is not None and self._fit_for(trainer).take_vote(candidates.get(self.monitor)).missing_ranks:
            candidates.pop(self.monitor, None)
        return candidates

    def check_monitor_top_k(self, trainer: pl.Trainer, current: Tensor | None = None) -> bool:
        """Whether ``current`` enters the top K: the vote every rank took with the candidates, when there is one."""
        vote = self._fit.vote_on(current) if self._fit is not None else None
        if vote is None:  # none taken, or on another value (a subclass ranks one of its own): ModelCheckpoint's
            return super().check_monitor_top_k(trainer, current)
        return vote.improves

    def file_exists(self, filepath: _PATH, trainer: pl.Trainer) -> bool:
        """``ModelCheckpoint.file_exists``, as the fit's storage answers it: a link to a checkpoint that
        ``ModelCheckpoint`` would have removed by now (kept, or evicted later here) does not exist."""
        return self._fit_for(trainer).file_exists(str(filepath), partial(super().file_exists, filepath, trainer))

    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """``ModelCheckpoint``'s rule, and on object storage the rule it applies on local disk: never the checkpoint
        the fit resumed from, nor one outside ``dirpath`` (Lightning issue #21813)."""
        fallback = partial(super()._should_remove_checkpoint, trainer, previous, current)
        dirpath = str(self.dirpath) if self.dirpath is not None else None
        return self._fit_for(trainer).removal_allowed(previous, current, dirpath, fallback)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """Candidates for ``ckpt_path="last"``, found after resolving what an interrupted publication left behind
        (Lightning resolves ``"last"`` on every rank before any ``setup``); on object storage as full URLs."""
        resolve_dirpath = self._ModelCheckpoint__resolve_ckpt_dir  # type: ignore[attr-defined]
        dirpath = self.dirpath if self.dirpath is not None else resolve_dirpath(trainer)
        storage = storage_for(get_filesystem(dirpath))  # the directory's own: `_fs` is local until `setup`
        fallback = partial(super()._find_last_checkpoints, trainer)
        is_last = partial(packages.is_last_name, self.CHECKPOINT_NAME_LAST, self.FILE_EXTENSION)
        return storage.last_checkpoints(str(dirpath), trainer.global_rank, is_last, fallback, trainer.state.fn == "fit")

    # ------------------------------------------------------------------ state

    @property
    def state_key(self) -> str:
        """Exactly the key ``ModelCheckpoint`` with the same arguments stores its state under, so checkpoints move
        between the two classes both ways with nothing lost (a subclass keeps its own name, as for any callback).

        Raises:
            TypeError: When a Trainer of the other Lightning package asks (it validates its callbacks' keys while it
                is constructed, before any hook could say which import fits).
        """
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if packages.package_of(caller) not in (None, self._lightning.name):
            raise packages.wrong_package_error(self._lightning.name, caller)
        key = super().state_key
        return "ModelCheckpoint" + key[len(PUBLIC_NAME):] if type(self).__qualname__ == PUBLIC_NAME else key

    @property
    def _legacy_state_key(self) -> Any:
        # where earlier releases stored the state ("FiniteGradCheckpoint{...}"): Lightning falls back to it on load
        own_name = type(self).__qualname__ == PUBLIC_NAME
        return PUBLIC_NAME + self.state_key[len("ModelCheckpoint"):] if own_name else super()._legacy_state_key

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_fit": None, "_decisions": Decisions.kept_by_a_copy_of(self)}  # not the fit itself

    def state_dict(self) -> dict[str, Any]:
        """``ModelCheckpoint``'s state, plus the format version of this release and a spike gate's accepted history."""
        return validation.with_format_version(super().state_dict()) | guard_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state written by this or an earlier release, or by a plain ``ModelCheckpoint``; forget (with a
        warning) the checkpoints it lists that are gone or cut off, as rank 0 sees them.

        Raises:
            ValueError: If the state comes from a newer, unknown format: loading it could silently drop bookkeeping.
        """
        super().load_state_dict(validation.without_format_version(state_dict))
        GuardedFit.take_up_spike_history(self, state_dict.get("spike_history"))
        drop_missing_checkpoints(self, self._fit)


class FiniteGradCheckpoint(GuardedCheckpoint, ModelCheckpoint):
    __doc__ = GuardedCheckpoint.__doc__
    _lightning = LightningPackage("lightning.pytorch", pl.Trainer, TorchCheckpointIO, AsyncCheckpointIO)

    @staticmethod
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:  # static, as in ModelCheckpoint
        link_in_boundary(ModelCheckpoint._link_checkpoint, trainer, filepath, linkpath, GuardedCheckpoint)
