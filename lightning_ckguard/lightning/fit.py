"""One fit of a guarded checkpoint callback: the guard, the storage and the write path chosen at ``setup``, and each
boundary run as a transaction whose verdict and policy are applied here.

The callback (:mod:`lightning_ckguard.lightning.callback`) only adapts Lightning's hooks and ``ModelCheckpoint``'s
seams to this object; what is decided comes from pure functions below it (``reach_verdict``, ``vote_of``,
``respond``) and what is written goes through the one :class:`~lightning_ckguard.publish.writers.Writer` of the fit.
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from typing import Any
from weakref import proxy

from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_ckguard._distributed import broadcast_value, every_rank_arrives, is_multiprocess
from lightning_ckguard.agree.agreement import Verdict
from lightning_ckguard.agree.guard import GradientGuard
from lightning_ckguard.agree.report import BoundaryReport
from lightning_ckguard.agree.top_k_vote import TopKVote, agree_on_top_k, local_top_k_decision, local_vote, vote_of
from lightning_ckguard.errors import NonFiniteGradientError
from lightning_ckguard.lightning.held_metrics import flush_held_metrics, hold_metrics
from lightning_ckguard.lightning.validation import unwritable_dirpath_error
from lightning_ckguard.publish.durability import durability
from lightning_ckguard.publish.ledger import Ledger
from lightning_ckguard.publish.seal import PublicationSeal, save_flushed
from lightning_ckguard.publish.staging import published_path, writes_directories
from lightning_ckguard.publish.storage import Storage, storage_for
from lightning_ckguard.publish.transaction import (
    BoundaryAbandoned,
    BoundaryTransaction,
    active_transaction,
    run_boundary,
)
from lightning_ckguard.publish.writers import WriteFailure, Writer, choose_writer, writes_as_lightning
from lightning_ckguard.record.skips import loss_scale, scaler_skip_flag
from lightning_ckguard.record.source_selection import gradient_source_for
from lightning_ckguard.record.state_sources import averaged_weights, lightning_checkpoint_state
from lightning_ckguard.recover.policy import Response, respond
from lightning_ckguard.recover.rewind import DEFAULT_MAX_REWINDS, Position, Rewind, RewindLog, callbacks_of_kind

log = logging.getLogger(__name__)
#: How long ``save_on_exception`` waits, with peers, for every rank to be handling an exception before it saves nothing:
#: one raised everywhere (a SIGTERM, a Ctrl-C, a deterministic error) reaches every rank within seconds.
EXCEPTION_RENDEZVOUS = timedelta(seconds=30)
#: Counts the guarded fits this process set up, alike on every rank: names each one's exception rendezvous.
_SETUPS = itertools.count(1)
_warnings = WarningCache()

#: What the warning of a rejection that neither raises nor rewinds says happened.
_RESPONSE_WORDS = {
    Response.SEAL_AND_WARN: "Nothing was saved on exception.",
    Response.SKIP: "Skipped; training continues with a fresh window.",
    Response.STOP: "Stopping training.",
    Response.SEAL: "The fit had ended: nothing is published from this process any more (a `trainer.save_checkpoint` "
                   "of these weights is refused).",
}


@dataclass
class Decisions:
    """What the agreements of a callback decided, kept across fits: the rejection that sealed the run (while set,
    nothing is published), the most recent verdict and report, the running counts, and the last fit's rewinds."""

    rejection: NonFiniteGradientError | None = None
    last_verdict: Verdict | None = None
    last_report: BoundaryReport | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"accepted": 0, "rejected": 0})
    rewind_log: RewindLog | None = None  # the rewinds of the current (or most recent) fit
    # a spike gate's accepted history between fits: a resumed checkpoint's, or the one the last fit ended with; the
    # next fit's guard takes it up (a checkpoint resumed from wins)
    spike_history: Any = None
    # a publication that failed while an exception was handled, with peers (no collective was safe, and a rank
    # rolling back alone would leave the ranks' ledgers apart): its rollback, applied on every rank at the next setup
    pending_rollback: Ledger | None = None

    @staticmethod
    def kept_by_a_copy_of(checkpoint: Any) -> Decisions:
        """``checkpoint``'s decisions as a copy of it keeps them (pickled, deep-copied): with the running fit's spike
        history, since the fit itself is not kept."""
        return replace(checkpoint._decisions, spike_history=guard_state(checkpoint).get("spike_history"))

    @property
    def rewinds(self) -> tuple[Rewind, ...]:
        """The rewinds of the current (or most recent) fit, oldest first."""
        return tuple(self.rewind_log.rewinds) if self.rewind_log is not None else ()


class GuardedFit:
    """The runtime of one guarded checkpoint callback on one Trainer, from ``setup`` to ``teardown``.

    Args:
        checkpoint: The callback (a ``ModelCheckpoint`` with the guard's options).
        trainer: Its Trainer.
        storage: Where ``dirpath`` lives.
        writer: The write path of this fit.
    """

    def __init__(self, checkpoint: Any, trainer: Any, storage: Storage, writer: Writer) -> None:
        self.checkpoint, self.trainer, self.storage, self.writer = checkpoint, trainer, storage, writer
        self.decisions: Decisions = checkpoint._decisions
        self.guard: GradientGuard | None = None
        self.vote: TopKVote | None = None  # this boundary's top-K vote, when it took one
        self._voted_on: Any = None  # the monitored value it was taken on
        self._collected: tuple[Verdict, Sequence[int]] | None = None  # agreed with the vote, not yet applied
        self._written_before: tuple[Any, Any] = (None, None)  # the last write when this boundary started
        self._accepted_unpublished_at: int | None = None  # the step an unwritten boundary accepted the window at
        self._should_stop_when_published = False  # `trainer.should_stop` when the rewind's checkpoint was published
        self._rewind_due: BoundaryReport | None = None  # a rejected write outside the boundaries rewinds at the next
        self._resumed_from: str | None = None  # the checkpoint this fit resumed from, as the storage resolved it
        self._kept: list[str] = []  # checkpoints ModelCheckpoint would have removed and this fit keeps
        self._setup_number = 0  # which set-up fit of this process this is (0: one driven by hand, never set up)
        self._finished = False  # training ended (an exception leaves the fit in place: Lightning runs no teardown)

    @property
    def rewind_log(self) -> RewindLog | None:
        """This fit's rewinds, with ``on_non_finite="rewind"``."""
        return self.decisions.rewind_log

    @classmethod
    def for_trainer(cls, checkpoint: Any, trainer: Any) -> GuardedFit:
        """The fit of a Trainer that no ``setup`` announced (driven by hand): its write path, nothing prepared."""
        storage = storage_for(checkpoint._fs)
        return cls(checkpoint, trainer, storage, _writer_for(checkpoint, trainer, storage, background=False))

    @classmethod
    def set_up(cls, checkpoint: Any, trainer: Any, stage: str) -> GuardedFit:
        """At ``setup``, on every rank: seal the Trainer's writes, choose the write path once, and prepare the
        directory (recover what an interrupted publication left, check it is writable, in one collective). Only a fit
        that can write there prepares it: a ``validate``/``test`` job pointed at a training's directory, or a
        ``fast_dev_run``, must not remove what that training is writing, nor fail where ``ModelCheckpoint`` writes
        nothing."""
        storage, dirpath = storage_for(checkpoint._fs), _dirpath(checkpoint)
        storage.refuse_strategy(trainer.strategy, dirpath)  # before anything is installed or written
        PublicationSeal.install(trainer, checkpoint)
        prepared = dirpath if stage == "fit" and _may_write(checkpoint, trainer) else None

        def writable_error() -> Exception | None:
            if prepared is None:
                return None
            return unwritable_dirpath_error(prepared, trainer.global_rank, trainer.global_step)

        # None: the barrier alone; a rollback pending on some rank rides in the agreement (the rank that has it)
        pending = checkpoint._decisions.pending_rollback
        carried = storage.prepare(trainer.strategy, prepared, writable_error, rank_zero_warn,
                                  carried=[trainer.global_rank + 1 if pending is not None else 0])
        if carried and carried[0]:
            _settle_pending_rollback(checkpoint, trainer.strategy, source=carried[0] - 1)
        # only then the writer: one that takes over an AsyncCheckpointIO is given back by a fit that got this far
        fit = cls(checkpoint, trainer, storage, _writer_for(checkpoint, trainer, storage))
        fit._setup_number = next(_SETUPS)
        return fit

    def start_fitting(self, pl_module: Any) -> None:
        """At ``on_fit_start`` (parameter identities are final): the guard, the rewind log; unseal a new fit."""
        trainer, checkpoint, decisions = self.trainer, self.checkpoint, self.decisions
        self.guard = self._new_guard(gradient_source_for(trainer.strategy, pl_module))
        if trainer.ckpt_path is not None:  # resolved now: a `last` link it was resumed through moves later
            self._resumed_from = self.storage.resumed_checkpoint(str(trainer.ckpt_path))
        if checkpoint.on_non_finite == "rewind":  # every fit counts its rewinds from zero, resumed or not
            limit = DEFAULT_MAX_REWINDS if checkpoint.max_rewinds is None else checkpoint.max_rewinds
            log_dir = self.storage.rewind_log_dir(_dirpath(checkpoint))
            decisions.rewind_log = RewindLog(limit, log_dir, Position.of(trainer))  # its start: `start_training`
        if decisions.rejection is not None:
            resumed = trainer.ckpt_path is not None
            rank_zero_info(
                f"FiniteGradCheckpoint: a new fit starts after the rejection at global step "
                f"{decisions.rejection.global_step}"
                + (f"; resuming from {trainer.ckpt_path}." if resumed else "; the first checkpoint needs a new step.")
            )
            decisions.rejection = None
            self.guard.reset(pending_rejection=not resumed)

    def start_training(self) -> None:
        """At ``on_train_start``, where the loops stand once a resumed fit restored them: the rewind log's first window
        starts here, and the checkpoint a fit resumed from is the one a rewind goes back to until the fit publishes
        one of its own."""
        if self.rewind_log is not None:
            self.rewind_log.start_at(Position.of(self.trainer), self.resumed_from())

    def resumed_from(self) -> str | None:
        """The checkpoint this fit resumed from, never to be evicted: as resolved at the fit's start (the file a
        ``last`` link pointed to then), else the Trainer's ``ckpt_path`` as it is."""
        if self._resumed_from is not None:
            return self._resumed_from
        return str(self.trainer.ckpt_path) if self.trainer.ckpt_path is not None else None

    def record(self, optimizer: Any) -> None:
        """Record, on the device, whether the gradients ``optimizer`` is about to apply are finite."""
        if self.guard is not None:
            scaler = getattr(self.trainer.strategy.precision_plugin, "scaler", None)
            self.guard.record(optimizer, step=self.trainer.global_step, skipped=scaler_skip_flag(scaler, optimizer))

    def record_loss(self, loss: Tensor) -> None:
        """Before each backward: with a spike gate, its loss (``training_step``'s, as Lightning scaled it for
        accumulation) joins the step under way, device-side, before the step is recorded and before any boundary.
        Lightning's mixed precision has multiplied it by the loss scale by then: the scale is divided out."""
        if self.guard is not None and self.guard.spike_gate is not None:
            scaler = getattr(self.trainer.strategy.precision_plugin, "scaler", None)
            self.guard.record_loss(loss, scale=loss_scale(scaler))

    def end_batch(self) -> None:
        """At a train batch end, before its boundary: settle a step whose skip outcome the source knows only now
        (DeepSpeed)."""
        if self.guard is not None:
            self.guard.conclude_step()

    # ------------------------------------------------------------------ boundaries

    def boundary(self, name: str, hook: Callable[[], None], during_exception: bool = False) -> None:
        """Run ``ModelCheckpoint``'s ``hook`` once as one guarded boundary, and apply its outcome."""
        if self._rewind_if_due(during_exception):
            return  # the boundary is the rewind's, as a rejected one is
        if self.decisions.rejection is not None:
            return  # the run was rejected: nothing publishes again (the decision was the same on every rank)
        if during_exception and not self._every_rank_handles_the_exception():
            return
        top_k_before = (set(self.checkpoint.best_k_models), self.checkpoint.best_model_path)
        self._written_before = self._last_write()
        try:
            outcome = run_boundary(self.checkpoint, hook, agree=lambda: self._agree_at_boundary(name, during_exception),
                                   writer=self.writer, remove=self.evict)
        except Exception as error:
            if not during_exception:
                raise
            # rolled back (run_boundary did); the error being handled is the one to surface, not this save's
            warnings.warn(f"FiniteGradCheckpoint (rank {self.trainer.global_rank}): no checkpoint saved on this "
                          f"exception: {type(error).__name__}: {error}", stacklevel=2)
            return
        finally:
            judged = (self.vote, self._collected)
            self.vote, self._voted_on, self._collected = None, None, None  # the next boundary takes its own
        if outcome == "wrote nothing" and not during_exception:
            self._judge_unwritten(name, *judged)
        elif outcome == "rejected":
            self._reject(during_exception)
        elif outcome == "refused":
            rank_zero_warn(f"FiniteGradCheckpoint: another guarded callback refused a write of the boundary at {name} "
                           f"(global step {self.trainer.global_step}); nothing of it was kept.")
        elif outcome == "published" and self.guard is not None:
            log.debug("FiniteGradCheckpoint published at %s, global step %d", name, self.trainer.global_step)
            self.guard.reset()
            if self.rewind_log is not None:
                self._note_published(top_k_before)

    def _judge_unwritten(self, boundary: str, vote: TopKVote | None,
                         collected: tuple[Verdict, Sequence[int]] | None) -> None:
        """A boundary whose hook ranked a monitored value every rank logged, and wrote nothing (not in the top K, not
        due), still judges the window, so that ``on_non_finite`` acts at the first such boundary after a fault rather
        than at the first one that writes (which may never come: a diverged run's metric stops improving). A rejection
        is applied as at a write; an acceptance leaves the window going on (nothing was published, so a spike gate
        learns nothing of it). Either way an earlier write's failure the agreement carried raises first. With peers the
        verdict came with the vote, no collective more; without, it is taken here on the gradients and the spike gate
        (the state is checked with a write): one small host read, where ``ModelCheckpoint``'s own ranking reads the
        monitored value."""
        guard = self.guard
        if guard is None:
            return
        # with `save_top_k=0` ModelCheckpoint never ranks; with peers no verdict but the vote's is taken (another
        # would be a collective ModelCheckpoint lacks); in one process, no collective (the writer's report rides
        # along, as at a write)
        ranked = not (vote is None or vote.missing_ranks or vote.missing_everywhere or self.checkpoint.save_top_k == 0)
        if ranked and collected is None and not is_multiprocess(self.trainer.strategy):
            collected = self._collect([], check_state=False)
        guard.forget_unpublished_window()  # whatever an agreement accepted here, no write published
        if not ranked or collected is None:
            return
        if collected[0].accepted:  # every step so far judged: the end of the fit need not judge them again
            self._accepted_unpublished_at = self.trainer.global_step
            self._settle_writes(collected[1])  # an earlier write's failure raises here, as at a write
        else:
            self._apply_agreed(boundary, *collected)  # an earlier write's failure raises first, the ledger back
            self._reject(during_exception=False)

    def _every_rank_handles_the_exception(self) -> bool:
        """Before ``save_on_exception``'s boundary with peers: whether every rank is handling an exception too, asked
        through the rendezvous store, not a collective (a peer still training may be inside DDP's all-reduce, which
        the agreement would pair with). Where some rank is not, within :data:`EXCEPTION_RENDEZVOUS`, nothing is
        saved, with a warning on this rank; no collective runs."""
        checkpoint, strategy = self.checkpoint, self.trainer.strategy
        should_save = getattr(checkpoint, "_should_save_on_exception", None)  # ModelCheckpoint's rule, where it has it
        saving = should_save(self.trainer) if callable(should_save) else bool(checkpoint.save_on_exception)
        if not (saving and is_multiprocess(strategy)):
            return True  # nothing to save, or no peer: the boundary runs no collective or needs none
        # one name per set-up fit of a callback, the same on every rank (every rank sets up the same callbacks, in
        # the same order); never a name an earlier fit's rendezvous left in the store, which outlives Trainers
        if every_rank_arrives(f"setup-{self._setup_number}/exception", EXCEPTION_RENDEZVOUS):
            return True
        warnings.warn(f"FiniteGradCheckpoint (rank {strategy.global_rank}): no checkpoint saved on this exception: "
                      f"not every rank was handling an exception within {EXCEPTION_RENDEZVOUS.total_seconds():g} s "
                      "(an exception on some ranks only), or the rendezvous store could not be asked, so no rank "
                      "could agree on one; nothing was written.", stacklevel=2)
        return False

    def take_vote(self, current: Any) -> TopKVote:
        """Every rank's top-K vote on the monitored value ``current`` (one collective: with peers, inside a boundary,
        the agreement itself, collected now and applied at the first file operation)."""
        checkpoint = self.checkpoint
        improves = local_top_k_decision(current, checkpoint.best_k_models, checkpoint.kth_best_model_path,
                                        checkpoint.save_top_k, checkpoint.mode)
        if own_transaction(checkpoint) is not None and is_multiprocess(self.trainer.strategy):
            # without peers the vote is no collective: the agreement waits for a write, so as not to read state
            vote = local_vote(self.trainer.strategy, current is not None, improves)
            # a rank whose key is missing leaves its state out: this verdict is then not the one a write applies
            # (below), and ModelCheckpoint defers such a step boundary (before a first validation) at no cost
            verdict, carried = self._collect(vote, check_state=current is not None)
            self.vote = vote_of(carried[:len(vote)], self.trainer.world_size)
            # the writer's report follows the vote. Where the key is missing on some rank (every rank knows it alike)
            # a write may still come (`last` at train end, a save on exception): it takes its own agreement, with
            # every rank's state checked; nothing is judged without a write (`_judge_unwritten`)
            self._collected = None if self.vote.missing_ranks else (verdict, carried[len(vote):])
        else:
            self.vote = agree_on_top_k(self.trainer.strategy, present=current is not None, improves=improves)
        self._voted_on = current
        missing = self.vote.missing_ranks
        if missing and not self.vote.missing_everywhere:
            _warnings.warn(
                f"`FiniteGradCheckpoint(monitor={checkpoint.monitor!r})`: the monitored key is missing from the "
                f"logged metrics of rank(s) {list(missing)} at global step {self.trainer.global_step}, so every rank "
                f"treats it as missing. HINT: log it on every rank (not with `rank_zero_only=True`)."
            )
        return self.vote

    def vote_on(self, current: Any) -> TopKVote | None:
        """The top-K vote, if one was taken on ``current`` itself: a subclass's ``_monitor_candidates`` may rank
        another value than the one every rank voted on (a key it derives or rescales after ``super()``)."""
        return self.vote if current is not None and current is self._voted_on else None

    def save(self, filepath: str) -> None:
        """``ModelCheckpoint._save_checkpoint`` inside an accepted boundary, through the fit's writer."""
        trainer, checkpoint = self.trainer, self.checkpoint
        self.writer.save(filepath, lambda path, flush: save_flushed(trainer, path, flush, checkpoint.save_weights_only))
        checkpoint._last_global_step_saved = trainer.global_step
        checkpoint._last_checkpoint_saved = filepath
        if trainer.is_global_zero:  # after the move into place, so a logger that uploads the file finds it
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(checkpoint))

    def remove(self, path: str, transaction: BoundaryTransaction | None) -> None:
        """``ModelCheckpoint``'s removal of ``path``: in a boundary (its ``transaction``) once every write of the
        boundary succeeded, and never before the agreement (a subclass may remove before it writes), else now."""
        if transaction is not None:
            transaction.admit()
            transaction.removed.append(path)
            self.writer.remove(path, self.evict)
        else:
            self.evict(path)

    def removal_allowed(self, previous: str, current: str, dirpath: str | None, fallback: Callable[[], bool]) -> bool:
        """``ModelCheckpoint._should_remove_checkpoint`` (``fallback``) as the storage rules it; what is kept where
        ``ModelCheckpoint`` removes it (the file the fit resumed from) is remembered as gone for :meth:`file_exists`,
        and a link to it stays, as its dangling link does under ``ModelCheckpoint``."""
        allowed = bool(self.storage.removal_allowed(previous, current, dirpath, self.resumed_from(), fallback,
                                                    self._kept))
        if not allowed and fallback():
            self._kept.append(previous)
        return allowed

    def file_exists(self, path: str, fallback: Callable[[], bool]) -> bool:
        """``ModelCheckpoint.file_exists`` (``fallback``), as the storage answers it, given what ``ModelCheckpoint``
        would have removed by now: what this fit keeps instead, and the running boundary's evictions, which wait until
        its writes succeeded. A ``last`` link to one of them dangles for ``ModelCheckpoint`` and is moved, not
        versioned (``last-v1``) and left on the old checkpoint."""
        transaction = own_transaction(self.checkpoint)
        removed = [*self._kept, *(transaction.removed if transaction is not None else ())]
        return bool(self.storage.file_exists(self.trainer.strategy, path, fallback, removed))

    def evict(self, path: str) -> None:
        """``ModelCheckpoint``'s own removal, for real, and the copy an earlier replacement kept for readers (else a
        crash before the fit ends would have recovery restore the evicted checkpoint)."""
        self.checkpoint._remove_for_real(self.trainer, path)
        if self.trainer.is_global_zero:
            self.storage.release_retired(path)

    def _agree_at_boundary(self, boundary: str, during_exception: bool = False) -> bool:
        """The agreement at a boundary's first file operation (collected with the top-K vote, or now); an earlier
        write that failed on some rank raises here on every rank, the ledger back to what was published (while an
        exception is handled, a warning instead, and nothing is saved: the error being handled surfaces)."""
        verdict, carried = self._collected if self._collected is not None else self._collect([])
        return self._apply_agreed(boundary, verdict, carried, during_exception)

    def _apply_agreed(self, boundary: str, verdict: Verdict, carried: Sequence[int],
                      during_exception: bool = False) -> bool:
        """Apply an agreement: count and report its verdict, then settle the writer's report it carried (see
        :meth:`_agree_at_boundary`). Returns whether the verdict accepts."""
        self._apply_verdict(verdict, boundary)
        self._settle_writes(carried, during_exception)
        return verdict.accepted

    def _settle_writes(self, carried: Sequence[int], during_exception: bool = False) -> None:
        """Settle the writer's report an agreement carried: an earlier write that failed on some rank raises here on
        every rank, the ledger back to what was published (while an exception is handled: a warning, and
        :class:`BoundaryAbandoned`)."""
        failure = self.writer.settle(self.trainer.strategy, carried)
        if failure is None:
            return
        transaction = own_transaction(self.checkpoint)
        if failure.published is not None and transaction is not None:
            transaction.roll_back_to(failure.published)
        elif transaction is None:  # after a hook that wrote nothing: no transaction restores the ledger
            self._roll_back(failure)
        if during_exception:
            rank_zero_warn(f"FiniteGradCheckpoint: no checkpoint saved on this exception: an earlier checkpoint "
                           f"write failed ({type(failure.error).__name__}: {failure.error}); the checkpoint's "
                           "records went back to what was published.")
            raise BoundaryAbandoned
        raise failure.error

    def _collect(self, vote: Sequence[int], check_state: bool = True) -> tuple[Verdict, tuple[int, ...]]:
        """Every rank joins the agreement (one collective: the vote and the writer's report ride in it); returns the
        verdict and the carried integers, reduced, nothing applied yet. ``check_state=False``: this rank leaves the
        state out (same collectives; see :meth:`take_vote`)."""
        if self.guard is None:  # not fitting: nothing was recorded, but every rank still meets here
            self.guard = self._new_guard()
        trainer = self.trainer
        # what this write will hold, checked in the same agreement
        state = lightning_checkpoint_state(trainer) if check_state else None
        return self.guard.agree_carrying(trainer.strategy, [*vote, *self.writer.report()],
                                         global_step=trainer.global_step, state=state)

    def _agree(self, boundary: str) -> Verdict:
        # the writer's report rides along unread: an earlier write's failure surfaces at the next boundary
        verdict, _ = self._collect([])
        self._apply_verdict(verdict, boundary)
        return verdict

    def _apply_verdict(self, verdict: Verdict, boundary: str) -> None:
        """Count, report and log a verdict at the point it decides a write."""
        decisions = self.decisions
        report = verdict.report(boundary)
        decisions.last_verdict, decisions.last_report = verdict, report
        decisions.counts["accepted" if verdict.accepted else "rejected"] += 1
        # plain Python numbers from the verdict: no device read, no collective; they ride in Lightning's next flush
        hold_metrics(self.trainer, {
            "ckguard/accepted": float(decisions.counts["accepted"]),
            "ckguard/rejected": float(decisions.counts["rejected"]),
            "ckguard/non_finite_steps": float(report.num_steps),
            "ckguard/skipped_steps": float(report.skipped_steps),
            **report.metrics(),
        })
        if report.accepted and report.skipped_steps:
            rank_zero_info(report.message)

    def _reject(self, during_exception: bool, rewind_later: bool = False, at_the_end: bool = False) -> None:
        """Apply the response :func:`~lightning_ckguard.recover.policy.respond` decides for the rejection just agreed
        on (the same on every rank): the decision is there, this only carries it out. ``rewind_later``: a rewind
        waits for the callback's next hook (:meth:`_rewind_if_due`). ``at_the_end``: the fit's training is over."""
        decisions, guard = self.decisions, self.guard
        assert decisions.last_report is not None and guard is not None
        report = decisions.last_report
        response = respond(self.checkpoint.on_non_finite, during_exception=during_exception,
                           fitting=self.rewind_log is not None, at_the_end=at_the_end)
        if response is Response.REWIND and rewind_later:
            self._rewind_due = report
            rank_zero_warn(f"FiniteGradCheckpoint rejected a save outside its boundaries at global step "
                           f"{report.global_step}; the write is skipped, and the weights go back at its next hook.")
            return
        if response is Response.REWIND:
            self._rewind(report)
            return
        if response is Response.SKIP:
            guard.reset(pending_rejection=True)
        if response.seals:
            decisions.rejection = report.to_error()
        if response is Response.STOP:
            self.trainer.should_stop = True
        if response is Response.RAISE:
            raise decisions.rejection  # type: ignore[misc]  # set just above: RAISE seals
        rank_zero_warn(f"{report.message} {_RESPONSE_WORDS[response]}")

    def _note_published(self, top_k_before: tuple[set[str], str]) -> None:
        """Remember what a rewind would go back to: the top-K file this boundary wrote (a name no later boundary
        rewrites with other weights), else the file it wrote last (``last``, which holds the same state)."""
        assert self.rewind_log is not None
        checkpoint, (ledger_before, best_before) = self.checkpoint, top_k_before
        written = [path for path in checkpoint.best_k_models if path not in ledger_before]
        if not written and checkpoint.monitor is None and checkpoint.best_model_path != best_before:
            written = [checkpoint.best_model_path]  # without a monitor, the top-K files stay out of best_k_models
        wrote = self._last_write() != self._written_before  # a subclass's own write too (``ModelCheckpoint``'s fields)
        path = written[-1] if written else checkpoint._last_checkpoint_saved if wrote else None
        if path:  # a boundary that only moved a link wrote no state of this position
            self.rewind_log.note_published(path, Position.of(self.trainer))
            self._should_stop_when_published = bool(self.trainer.should_stop)

    def _rewind(self, report: BoundaryReport) -> None:
        """Every rank restores the last published checkpoint together (the verdict decided, the same everywhere)."""
        rewind_log, guard = self.rewind_log, self.guard
        assert rewind_log is not None and guard is not None
        self.writer.wait()  # the checkpoint to go back to may still be being written in the background
        try:
            rewind = rewind_log.rewind(self.trainer, report, exists=self.storage.fs.exists)
        except NonFiniteGradientError as refused:  # no checkpoint, max_rewinds reached, or the restore failed
            self.decisions.rejection = refused  # sealed: the weights are the rejected ones
            raise
        # the restored weights are the accepted ones: the next window starts clean, without the losses already given
        # for the step under way (they belong to the discarded weights)
        guard.reset(discard_step_under_way=True)
        # a stop asked for since was decided on the discarded weights (EarlyStopping runs before this hook and saw
        # the rejected validation's NaN): the restored state's stands, but a Timer whose time is up still stops
        self.trainer.should_stop = self._should_stop_when_published or _time_is_up(self.trainer)
        self._restart_other_guards()
        rank_zero_warn(
            f"{report.message} Rewound in place (rewind {rewind.number} of at most {rewind_log.max_rewinds} in this "
            f"fit): {rewind.describe()}; training goes on with the next batch, at global step {rewind.global_step}."
            + (f" Logged to {rewind_log.log_path}." if rewind_log.log_path else "")
        )
        hold_metrics(self.trainer, {"ckguard/rewinds": float(rewind.number)})

    def _last_write(self) -> tuple[Any, Any]:
        """What ``ModelCheckpoint`` records of its last write: a boundary that wrote changes it, a link does not."""
        return self.checkpoint._last_checkpoint_saved, self.checkpoint._last_global_step_saved

    def _rewind_if_due(self, during_exception: bool) -> bool:
        """A write outside the boundaries rejected under ``"rewind"`` (a manual save inside ``training_step``, whose
        backward still needs the weights it read) rewinds here, at the callback's next hook, on every rank. While an
        exception is handled nothing is rewound: the run is sealed instead. Returns whether a rewind was due."""
        report, self._rewind_due = self._rewind_due, None
        if report is None:
            return False
        if during_exception:
            self.decisions.rejection = report.to_error()
        else:
            self._rewind(report)
        return True

    def _restart_other_guards(self) -> None:
        """After a rewind the weights are a published checkpoint's: what the Trainer's other guarded callbacks
        recorded since describes weights that are gone, and would reject (or rewind) the recovered run again."""
        for callback in self.trainer.callbacks:
            other = getattr(callback, "_fit", None)
            if isinstance(other, GuardedFit) and other is not self and other.guard is not None:
                other.guard.reset(discard_step_under_way=True, learn=False)
                other._rewind_due = None  # its own rejection of the same weights: rewound already

    # ------------------------------------------------------------------ writes outside the boundaries

    def admit_save(self, filepath: str) -> bool:
        """The gate of a write that is not this callback's boundary (a manual ``trainer.save_checkpoint``, another
        callback's): the same agreement first; inside a running fit a rejection applies ``on_non_finite`` like a
        boundary, outside one it raises. After a rejection every later write is refused: skipped with a warning
        while the fit runs or an exception is being handled, raised otherwise."""
        trainer, decisions = self.trainer, self.decisions
        running, name = trainer.state.stage is not None, published_path(filepath)  # a boundary's: its real name
        if decisions.rejection is None:
            verdict = self._agree(f"a save to {name}")
            if verdict.accepted:  # a fresh window (a spike gate learns this one) once the write succeeded everywhere
                assert self.guard is not None
                PublicationSeal.after_write(self.guard.reset)
                return True
            if running and not trainer.interrupted:
                self._reject(during_exception=False, rewind_later=True)
                return False  # "skip", "stop" or a rewind at the next hook: the write is skipped
            decisions.rejection = verdict.to_error()
        if running:
            rank_zero_warn(f"FiniteGradCheckpoint refused to write {name}. {decisions.rejection}")
            return False
        raise decisions.rejection

    # ------------------------------------------------------------------ the end of the fit

    def finish(self, during_exception: bool = False) -> None:
        """At the end of training: every write has run, and a failure raises on every rank, as at a boundary. During
        an exception no collective is safe and the original error is the one to surface: each rank rolls back to
        what it published and says so. Then the copies kept for readers go."""
        try:
            last_steps = None if during_exception else self._agree_on_the_last_steps()
            failure = self.writer.finish(self.trainer.strategy, during_exception,
                                         last_steps[1] if last_steps is not None else None)
            if during_exception and failure is not None:
                if not is_multiprocess(self.trainer.strategy):
                    self._roll_back(failure)
                elif failure.published is not None:  # rolled back on every rank together, at the next setup
                    self.decisions.pending_rollback = failure.published
                rank_zero_warn(f"FiniteGradCheckpoint: a checkpoint write failed as well: {failure.error}")
            else:
                self._raise_write_failure(failure)
            if last_steps is not None:
                verdict, _, restates_skipped = last_steps
                self._apply_last_steps(verdict, restates_skipped)
        finally:
            self._finished = True
            self._keep_spike_history()  # an exception ends a fit without its teardown
            if self.decisions.rejection is None and self.trainer.is_global_zero:
                # not after a rejection: that changes nothing on disk (the next fit's recovery removes them)
                self.storage.release_all_retired(_dirpath(self.checkpoint))
            flush_held_metrics(self.trainer)  # nothing of Lightning's is logged after this

    def _agree_on_the_last_steps(self) -> tuple[Verdict, tuple[int, ...], bool] | None:
        """The steps after the fit's last agreement (no boundary came after them, or one that neither wrote nor
        ranked), judged at train end, so that ``on_non_finite`` acts on them and a ``trainer.save_checkpoint`` after
        ``fit`` cannot publish what they diverged. One agreement without the state (nothing is written), the
        writer's report riding in it, so the end of the fit runs no collective more for that; none when every step
        was judged. The same decision on every rank: each recorded the same steps, and judged the same boundaries.
        Returns the verdict, the carried integers, and whether it only restates the last boundary's skipped rejection
        (no step since)."""
        guard = self.guard
        if guard is None or self.decisions.rejection is not None:
            return None
        # a "skip" at the last boundary leaves its rejection pending, the weights still the rejected ones: judged too
        if guard.steps_recorded == 0 and guard.window.pending_rejection is False:
            return None
        if self._accepted_unpublished_at == self.trainer.global_step:
            return None  # judged at this step already (a boundary that ranked the value and wrote nothing)
        self.writer.wait()  # the agreement carries the outcome of every write
        restates = guard.steps_recorded == 0
        verdict, carried = self._collect([], check_state=False)
        guard.forget_unpublished_window()  # accepted or not, nothing is published: a spike gate learns nothing
        return verdict, carried, restates

    def _apply_last_steps(self, verdict: Verdict, restates_skipped: bool) -> None:
        """Apply the verdict on the fit's last steps: a rejection is counted, reported and seals the run (raises under
        ``"raise"``); one that only restates the last boundary's skipped rejection seals it without counting it twice.
        An acceptance changes nothing a user sees (no metric more for the loggers than ``ModelCheckpoint``'s fit logs:
        ``ckguard/accepted`` counts published checkpoints)."""
        if verdict.accepted:
            return
        if not restates_skipped:
            self._apply_verdict(verdict, "train end")
        self._reject(during_exception=False, at_the_end=True)

    def tear_down(self) -> None:
        """Give the Trainer back its own ``save_checkpoint`` (not after a rejection: the seal stays), stop the
        writer, and log the ``ckguard/*`` values no flush carried. A rewind still due (a write rejected after the
        callback's last hook) can no longer happen: the run is sealed instead, so the weights it left are never
        published."""
        if self._rewind_due is not None:
            report, self._rewind_due = self._rewind_due, None
            self.decisions.rejection = report.to_error()
            rank_zero_warn(f"{report.message} The fit ended before the weights could go back: nothing is published "
                           f"from this process any more.")
        if self.decisions.rejection is None:
            PublicationSeal.uninstall(self.trainer, self.checkpoint)
        self._keep_spike_history()
        self.writer.release()
        flush_held_metrics(self.trainer, uninstall=True)  # what a fit without a train end (validate) still holds

    @staticmethod
    def take_up_spike_history(checkpoint: Any, history: Any) -> None:
        """A loaded state's spike history, for the running fit's guard if it exists already (FSDP2 and DeepSpeed
        restore the checkpoint after setup, so Lightning loads the callback's state after ``on_fit_start`` made the
        guard), else for the next guard made (:meth:`_new_guard`): also after a fit that ended in an exception, which
        Lightning leaves in place without a teardown."""
        fit: GuardedFit | None = checkpoint._fit
        if fit is not None and fit.guard is not None and not fit._finished and history is not None:
            fit.guard.load_state_dict({"spike_history": history})
        else:
            checkpoint._decisions.spike_history = history

    def _keep_spike_history(self) -> None:
        """The spike gate's history as the fit leaves it, for the callback's state and a next fit."""
        if self.guard is not None and self.guard.spike_gate is not None:
            self.decisions.spike_history = self.guard.state_dict().get("spike_history")

    def _raise_write_failure(self, failure: WriteFailure | None) -> None:
        if failure is not None:
            self._roll_back(failure)
            raise failure.error

    def _roll_back(self, failure: WriteFailure) -> None:
        if failure.published is not None:
            failure.published.apply_to(self.checkpoint)

    def _new_guard(self, source: Any = None) -> GradientGuard:
        """A guard for the Trainer's module; buffers that are non-finite by design now (a ``-inf`` attention mask), in
        the module and in averaged copies, are left out of its state check, with an info line naming them."""
        trainer = self.trainer
        module = trainer.lightning_module  # None on a Trainer driven by hand: nothing recorded, nothing to check
        guard = GradientGuard(module, count_skipped_steps=self.checkpoint.count_skipped_steps, source=source,
                              device=trainer.strategy.root_device, spike_gate=self.checkpoint.spike_gate)
        if self.decisions.spike_history is not None:  # a resumed or continued fit's gate keeps its baseline
            guard.load_state_dict({"spike_history": self.decisions.spike_history})
            self.decisions.spike_history = None
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


def _time_is_up(trainer: Any) -> bool:
    """Whether a ``Timer`` of ``trainer`` (``max_time``) has run out, as rank 0 sees it (the Timer's own rule, so that
    every rank stops together): one broadcast, only where there is a Timer (every rank has the same callbacks)."""
    timers = [c for c in callbacks_of_kind(trainer, "Timer") if callable(getattr(c, "time_remaining", None))]
    if not timers:
        return False
    remaining = [timer.time_remaining() for timer in timers]
    return bool(broadcast_value(trainer.strategy, any(left is not None and left <= 0 for left in remaining), src=0))


def guard_state(checkpoint: Any) -> dict[str, Any]:
    """What the callback's state adds to ``ModelCheckpoint``'s: a spike gate's accepted history, the running fit's
    guard's, else the one the last fit ended with or a resumed checkpoint gave (nothing without a gate)."""
    fit: GuardedFit | None = checkpoint._fit
    if fit is not None and fit.guard is not None and not fit._finished:
        return fit.guard.state_dict()
    history = checkpoint._decisions.spike_history
    return {"spike_history": history} if history is not None and checkpoint.spike_gate is not None else {}


def own_transaction(checkpoint: Any) -> BoundaryTransaction | None:
    """The transaction of ``checkpoint``'s boundary while its hook runs, else None."""
    transaction = active_transaction()
    return transaction if transaction is not None and transaction.checkpoint is checkpoint else None


def link_in_boundary(link: Any, trainer: Any, filepath: str, linkpath: str, guarded: type) -> None:
    """``ModelCheckpoint._link_checkpoint`` (``link``, a static method) inside a guarded boundary, through the
    fit's writer; outside one (of a ``guarded`` callback) it is ``link`` itself."""
    transaction = active_transaction()
    if transaction is None or not isinstance(transaction.checkpoint, guarded):
        link(trainer, filepath, linkpath)
        return
    transaction.admit()  # a boundary whose first file operation is a link agrees here
    transaction.note_write(linkpath, existed=trainer.is_global_zero and os.path.lexists(linkpath))
    checkpoint: Any = transaction.checkpoint
    fit: GuardedFit = checkpoint._fit_for(trainer)
    fit.writer.link(filepath, linkpath, partial(link, trainer))


def _may_write(checkpoint: Any, trainer: Any) -> bool:
    """Whether a fit of ``trainer`` can write into ``checkpoint``'s ``dirpath`` at all, as ``ModelCheckpoint``
    decides: never under ``fast_dev_run``, nor with ``save_top_k=0`` and neither ``last`` nor an exception
    checkpoint."""
    if trainer.fast_dev_run:
        return False
    return checkpoint.save_top_k != 0 or bool(checkpoint.save_last) or bool(getattr(checkpoint, "save_on_exception",
                                                                                          False))


def drop_missing_checkpoints(checkpoint: Any, fit: GuardedFit | None) -> None:
    """Forget the ledger entries of ``checkpoint`` whose checkpoint is gone (deleted by hand, lost in a crash) or
    visibly cut off, with a warning; the files themselves stay. Rank 0's view decides, so every rank keeps the same
    ledger even without a shared filesystem."""
    storage = fit.storage if fit is not None else storage_for(checkpoint._fs)
    paths = (*checkpoint.best_k_models, checkpoint.last_model_path)
    missing = [path for path in paths if path and not storage.holds_checkpoint(path)]
    if fit is not None:
        missing = broadcast_value(fit.trainer.strategy, missing, src=0)
    if missing:
        Ledger.capture(checkpoint).without(missing, checkpoint.mode).apply_to(checkpoint)
        rank_zero_warn(f"FiniteGradCheckpoint dropped {len(missing)} checkpoint(s) its state lists but that no longer "
                       "exist or are incomplete: " + ", ".join(missing) + ". Expected when resuming from a checkpoint "
                       "older than the run's latest (`ckpt_path='best'`, a manual save): its state still lists the "
                       "top-K checkpoints the run removed after writing it. Otherwise they were deleted by hand, never "
                       "copied here, or cut off by a crash. New checkpoints fill the top-K places they held "
                       "(ModelCheckpoint keeps such entries).")


def _settle_pending_rollback(checkpoint: Any, strategy: Any, source: int) -> None:
    """On every rank, at setup: the rollback rank ``source`` learned of while an exception was handled (a publication
    of the last fit failed there), applied now, so that every rank's ledger is the published one again."""
    decisions = checkpoint._decisions
    published: Ledger = broadcast_value(strategy, decisions.pending_rollback, src=source)
    published.apply_to(checkpoint)
    decisions.pending_rollback = None
    rank_zero_warn("FiniteGradCheckpoint: the records of the last fit went back, on every rank, to what it published: "
                   f"a checkpoint write of it had failed on rank {source} while an exception was handled.")


def _dirpath(checkpoint: Any) -> str | None:
    return str(checkpoint.dirpath) if checkpoint.dirpath is not None else None


def _writer_for(checkpoint: Any, trainer: Any, storage: Storage, background: bool = True) -> Writer:
    """The fit's write path. In the background under Lightning's ``AsyncCheckpointIO`` (a subclass too) over its
    ``TorchCheckpointIO``, for single files in a local ``dirpath``; staged for what Lightning writes itself into a
    local ``dirpath`` (its ``TorchCheckpointIO``'s own ``save_checkpoint``, or a strategy that writes directories);
    else as given. Only a fit ``setup`` announced (``background``) publishes in the background: one driven by hand has
    no teardown."""
    package, strategy = checkpoint._lightning, trainer.strategy
    plugin = strategy.checkpoint_io
    through_lightning = PublicationSeal.writes_through_lightning(trainer)
    in_background = (
        background
        and isinstance(plugin, package.async_checkpoint_io)
        and writes_as_lightning(plugin.checkpoint_io, package.torch_checkpoint_io)
        and hasattr(plugin, "_checkpoint_io")
        and not writes_directories(strategy)
        and through_lightning
        and checkpoint.dirpath is not None
        and storage.stages_writes
    )
    staged_io = writes_directories(strategy) or writes_as_lightning(plugin, package.torch_checkpoint_io)
    return choose_writer(strategy, storage, durability(checkpoint.durable),
                         in_background=plugin if in_background else None, writes_through_lightning=through_lightning,
                         staged_io=staged_io)


__all__ = ["Decisions", "GuardedFit", "drop_missing_checkpoints", "guard_state", "link_in_boundary",
           "own_transaction"]
