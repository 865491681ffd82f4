"""An eviction that fails in the background, under Lightning's ``AsyncCheckpointIO``: held like a failed background
write, but told as what it is. Its boundary was published, so the ledger stands and the checkpoint not removed stays;
rank 0 raises its own error, and a peer a ``CheckpointWriteError`` that says the removal failed, as with the
synchronous writers (``test_held_moves.py``).

One process: a whole fit, and the two ranks' views of the failure, each rank's publisher settled from the same reduced
words and the failing rank's broadcast (the two-process background paths run in ``test_publication_readers.py``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from helpers import QUIET, BusyRemovalIO, FaultyModel, ledger_state
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.errors import CheckpointWriteError
from lightning_ckguard.publish.background import BackgroundPublisher, WriteFailure
from lightning_ckguard.publish.durability import NotFlushing
from lightning_ckguard.publish.ledger import Ledger
from lightning_ckguard.publish.staging import staging_path

EPOCHS = dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


def test_a_failed_background_eviction_is_raised_with_its_boundary_published(tmp_path):
    # epoch 1's unit publishes its checkpoint, then the eviction of epoch 0's fails on the publication thread: raised
    # at epoch 2's agreement (or at train end, if the thread was not done by then), epoch 1's ledger standing
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], plugins=[AsyncCheckpointIO(BusyRemovalIO())], **QUIET, **EPOCHS)
    with pytest.raises(OSError, match="Device or resource busy"):
        trainer.fit(model)
    # the ledger at step 5 is the training thread's; what is on disk then depends on the publication thread's pace
    assert ledger_state(callback) == model.snapshots[5]["state"], "the ledger of the published boundary does not stand"
    assert callback.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]  # nothing staged left


class RankView:
    """Rank ``rank`` of two, as a publisher's collective: what it broadcasts is kept in ``sent``, and a broadcast
    from the other rank answers ``peer_broadcast``."""

    def __init__(self, rank: int) -> None:
        self.global_rank, self.world_size = rank, 2
        self.sent: Any = None
        self.peer_broadcast: Any = None

    def broadcast(self, value: Any, src: int = 0) -> Any:
        if src == self.global_rank:
            self.sent = value
            return value
        return self.peer_broadcast


def _save(staging: str, fails: str) -> Callable[[], None]:
    """What rank 0's unit runs as its write: a checkpoint into ``staging``, or, where the write ``fails``, a full
    disk."""

    def save() -> None:
        if fails == "write":
            raise OSError(errno.ENOSPC, "No space left on device", staging)
        torch.save({}, staging)

    return save


def _both_ranks_settle(tmp_path, fails: str) -> tuple[WriteFailure | None, WriteFailure | None]:
    """One boundary in the background on two ranks: rank 0 writes ``epoch=1`` and evicts ``epoch=0`` (only rank 0
    writes and removes); its ``fails`` (``"eviction"`` or ``"write"``) fails. Both ranks then settle at the next
    agreement: rank 0 first, as the one that broadcasts."""
    old, new = str(tmp_path / "epoch=0-step=2.ckpt"), str(tmp_path / "epoch=1-step=4.ckpt")
    torch.save({}, old)
    staging = staging_path(new)
    publishers = [BackgroundPublisher(NotFlushing()), BackgroundPublisher(NotFlushing())]
    views = [RankView(0), RankView(1)]
    for rank, publisher in enumerate(publishers):
        unit = publisher.open_unit(Ledger.capture(ModelCheckpoint(dirpath=tmp_path)))
        if rank == 0:
            unit.write(staging, _save(staging, fails))
            unit.publish(staging, new)
            unit.evict(old, BusyRemovalIO().remove_checkpoint)
        publisher.submit(unit)
        publisher.wait()
    reports = [publisher.report(view) for publisher, view in zip(publishers, views, strict=True)]
    reduced = [max(words) for words in zip(*reports, strict=True)]  # the agreement's all-reduce, with MAX
    mine = publishers[0].settle(views[0], reduced)
    views[1].peer_broadcast = views[0].sent
    theirs = publishers[1].settle(views[1], reduced)
    for publisher in publishers:
        publisher.close()
    return mine, theirs


def test_a_peer_is_told_that_the_removal_failed_and_that_its_boundary_was_published(tmp_path):
    mine, theirs = _both_ranks_settle(tmp_path, "eviction")
    assert mine is not None and theirs is not None
    old = str(tmp_path / "epoch=0-step=2.ckpt")
    assert isinstance(mine.error, OSError) and mine.error.errno == errno.EBUSY  # rank 0: its own error
    error = theirs.error
    assert isinstance(error, CheckpointWriteError) and error.removal, repr(error)
    assert (error.ranks, error.filepath) == ((0,), old)
    assert str(error).startswith(f"Removing the checkpoint {old} failed on rank 0: OSError: [Errno 16] Device or "
                                 "resource busy (injected)"), str(error)  # it said "Writing the checkpoint ..."
    assert str(error).endswith("The checkpoints written before it were published; it stays on disk.")
    assert mine.published is None and theirs.published is None, "the ledger stands on every rank"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


def test_a_peer_is_still_told_that_a_failed_background_write_published_nothing(tmp_path):
    mine, theirs = _both_ranks_settle(tmp_path, "write")
    assert mine is not None and theirs is not None
    new = str(tmp_path / "epoch=1-step=4.ckpt")
    assert isinstance(mine.error, OSError) and mine.error.errno == errno.ENOSPC
    error = theirs.error
    assert isinstance(error, CheckpointWriteError) and not error.removal, repr(error)
    assert str(error).startswith(f"Writing the checkpoint {new} failed on rank 0: OSError: [Errno 28] No space left")
    assert str(error).endswith("Nothing was published for it on any rank.")
    assert mine.published is not None and theirs.published is not None, "the ledger goes back to before it"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt"]


def _one_unit(tmp_path, fails: str) -> BackgroundPublisher:
    """Rank 0 of one process: a unit that writes ``epoch=1``, then evicts ``epoch=0``; its ``fails`` fails."""
    old, new = str(tmp_path / "epoch=0-step=2.ckpt"), str(tmp_path / "epoch=1-step=4.ckpt")
    torch.save({}, old)
    staging = staging_path(new)
    publisher = BackgroundPublisher(NotFlushing())
    unit = publisher.open_unit(Ledger.capture(ModelCheckpoint(dirpath=tmp_path)))
    unit.write(staging, _save(staging, fails))
    unit.publish(staging, new)
    unit.evict(old, BusyRemovalIO().remove_checkpoint)
    publisher.submit(unit)
    publisher.wait()
    return publisher


def test_a_failed_eviction_met_while_an_exception_unwinds_leaves_the_ledger_standing(tmp_path):
    # no agreement while an exception unwinds: the fit asks for this rank's own failure, and its boundary was published
    publisher = _one_unit(tmp_path, "eviction")
    failure = publisher.local_failure()
    publisher.close()
    assert failure is not None and isinstance(failure.error, OSError) and failure.error.errno == errno.EBUSY
    assert failure.published is None, "the ledger of a published boundary went back"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


def test_a_unit_that_removes_a_name_and_then_writes_it_again_keeps_the_new_checkpoint(tmp_path):
    # a subclass's overwrite of one fixed name (remove, then save) in one boundary: the removal is no eviction
    path = str(tmp_path / "model.ckpt")
    torch.save({"version": "old"}, path)
    publisher = BackgroundPublisher(NotFlushing())
    unit = publisher.open_unit(Ledger.capture(ModelCheckpoint(dirpath=tmp_path)))
    unit.evict(path, os.remove)
    staging = staging_path(path)
    unit.write(staging, lambda: torch.save({"version": "new"}, staging))
    unit.publish(staging, path)
    publisher.submit(unit)
    publisher.wait()
    publisher.close()
    assert os.listdir(tmp_path) == ["model.ckpt"] and torch.load(path)["version"] == "new"
