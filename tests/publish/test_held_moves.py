"""A move into place that fails on rank 0, after the boundary's last collective, is held: nothing more of that boundary
is put in place or evicted, what it created is removed, and the next agreement (or the end of training) raises it
with the ledger back to the one before that boundary."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer, seed_everything

from helpers import QUIET, FaultyModel, ledger_state, refuse_moves_to, tree_digest
from lightning_ckguard import FiniteGradCheckpoint

EPOCHS = dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


def fit_refusing_moves(trainer: Trainer, model: FaultyModel, name: str, epoch: int) -> None:
    """Fit, with rank 0's renames onto ``name`` refused from epoch ``epoch`` on, and expect the injected error."""
    undo: list = []
    model.on_train_epoch_start = lambda: (  # type: ignore[method-assign]
        undo.append(refuse_moves_to(name)) if trainer.current_epoch == epoch else None)
    try:
        with pytest.raises(OSError, match="injected"):
            trainer.fit(model)
    finally:
        for restore in undo:
            restore()


@pytest.mark.parametrize(("refused_name", "save_last"), [("epoch=1", True), ("last", True), ("last", "link")])
def test_a_refused_move_is_raised_at_the_next_boundary_with_nothing_of_its_boundary_left(refused_name, save_last,
                                                                                            tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=save_last)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[3])  # step 3: before epoch 1's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    fit_refusing_moves(trainer, model, refused_name, epoch=1)
    before = model.snapshots[3]
    assert ledger_state(callback) == before["state"], "the ledger was not rolled back to the published one"
    assert tree_digest(str(tmp_path)) == before["tree"], "something of the failed boundary is left, or was evicted"
    assert "epoch=0-step=2.ckpt" in before["tree"]
    assert trainer.current_epoch == 2, "raised at the next boundary's agreement, not before"


def test_a_refused_move_at_the_last_boundary_is_raised_at_train_end(tmp_path):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **EPOCHS)
    fit_refusing_moves(trainer, model, "epoch=2", epoch=2)
    before = model.snapshots[5]
    assert ledger_state(callback) == before["state"]
    assert tree_digest(str(tmp_path)) == before["tree"]
    assert callback.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")
