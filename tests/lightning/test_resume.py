"""Restarting: resumed ledgers are consistent, and a plain ModelCheckpoint run's top-K carries over."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import QUIET, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint

# epochs 0-1 in the first run, 2-3 after resuming; val_loss is chosen per epoch
LOSSES = [3.0, 2.0, 2.5, 1.0]


def _trainer(callback: ModelCheckpoint, max_epochs: int) -> Trainer:
    return Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                   num_sanity_val_steps=0, **QUIET)


def _ckpt_files(root) -> set[str]:
    return {name for name in os.listdir(root) if not name.startswith("last")}


def _assert_consistent(callback: ModelCheckpoint, root) -> None:
    assert all(os.path.exists(path) for path in callback.best_k_models), "ledger entry without a file"
    assert {os.path.basename(p) for p in callback.best_k_models} == _ckpt_files(root)
    best = min(callback.best_k_models, key=lambda p: callback.best_k_models[p])
    assert callback.best_model_path == best


def test_resume_from_a_guarded_checkpoint_keeps_a_consistent_ledger(tmp_path):
    first = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    _trainer(first, 2).fit(FaultyModel(val_losses=LOSSES))
    resume_from = first.best_model_path
    assert resume_from in torch.load(resume_from, weights_only=False)["callbacks"][first.state_key]["best_k_models"]

    second = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    trainer = _trainer(second, 4)
    trainer.fit(FaultyModel(val_losses=LOSSES), ckpt_path=resume_from)
    assert trainer.global_step == 8
    # epoch 2 (2.5) evicted epoch 0 (3.0); epoch 3 (1.0) evicted epoch 2
    assert _ckpt_files(tmp_path) == {"epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt"}
    _assert_consistent(second, tmp_path)


@pytest.mark.parametrize("which", ["best", "last"])
def test_ckpt_path_best_and_last(which, tmp_path):
    first = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    first_trainer = _trainer(first, 2)
    first_trainer.fit(FaultyModel(val_losses=LOSSES))
    trainer = _trainer(first, 3)
    trainer.fit(FaultyModel(val_losses=LOSSES), ckpt_path=which)
    assert trainer.ckpt_path == (first_trainer.checkpoint_callback.last_model_path if which == "last"
                                 else str(tmp_path / "epoch=1-step=4.ckpt"))
    assert trainer.global_step == 6


def test_resume_from_a_plain_model_checkpoint_run_keeps_its_top_k(tmp_path):
    plain = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    _trainer(plain, 2).fit(FaultyModel(val_losses=LOSSES))
    assert _ckpt_files(tmp_path) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"}

    guarded = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    _trainer(guarded, 3).fit(FaultyModel(val_losses=LOSSES), ckpt_path=str(tmp_path / "last.ckpt"))
    # the adopted ledger knew epoch 0 (3.0) was the worst of the top 2 and evicted it for epoch 2 (2.5);
    # without it, epoch 0 would stay on disk forever as an untracked file
    assert _ckpt_files(tmp_path) == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"}
    _assert_consistent(guarded, tmp_path)


def test_the_file_a_fit_resumed_from_through_the_last_link_is_never_evicted(tmp_path):
    # epoch 1 (2.0) is the best and `last` links to it; the resumed fit's epoch 3 (1.0) is better and would evict it.
    # ModelCheckpoint compares the link's path with the eviction's, so it deletes the file it resumed from; by the
    # next boundary the link has moved too, and a `last` link is all the resumed fit ever knew it by
    losses = [3.0, 2.0, 2.5, 1.0]
    first = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last="link")
    seed_everything(0)
    _trainer(first, 2).fit(FaultyModel(val_losses=losses))
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=4.ckpt"

    second = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last="link")
    trainer = _trainer(second, 4)
    trainer.fit(FaultyModel(val_losses=losses), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")
    assert second.best_model_path == str(tmp_path / "epoch=3-step=8.ckpt")
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=3-step=8.ckpt"
    # kept, out of the ledger (as a checkpoint resumed from by its own name is); epoch 2 never entered the top-1
    assert _ckpt_files(tmp_path) == {"epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt"}
    assert torch.load(tmp_path / "epoch=1-step=4.ckpt", weights_only=False)["global_step"] == 4
    assert list(second.best_k_models) == [str(tmp_path / "epoch=3-step=8.ckpt")]


def _names_and_links(root) -> dict[str, str]:
    """Each name in ``root``: ``"file"``, or a link's target."""
    return {name: os.readlink(root / name) if os.path.islink(root / name) else "file" for name in os.listdir(root)}


def _resumed_through_its_own_name_with_last_links(cls: type[ModelCheckpoint], root) -> dict[str, str]:
    """Every 2 steps, `last-{epoch}` links; the second fit resumes from step 4's file by its own name, which
    `last-epoch=0` links to. Returns the directory: each name, a file or the link's target."""
    def trainer(max_epochs: int) -> Trainer:
        callback = cls(dirpath=root, save_last="link", save_top_k=-1, every_n_train_steps=2)
        callback.CHECKPOINT_NAME_LAST = "last-{epoch}"
        return Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=4, limit_val_batches=0,
                       **QUIET)

    seed_everything(0)
    trainer(1).fit(FaultyModel())
    trainer(2).fit(FaultyModel(), ckpt_path=str(root / "epoch=0-step=4.ckpt"))
    return _names_and_links(root)


def test_a_last_link_to_the_file_a_fit_resumed_from_goes_as_model_checkpoint_removes_it(tmp_path):
    # only the file resumed from is kept; a link to it holds no checkpoint and goes (or stays) as ModelCheckpoint has it
    plain = _resumed_through_its_own_name_with_last_links(ModelCheckpoint, tmp_path / "plain")
    guarded = _resumed_through_its_own_name_with_last_links(FiniteGradCheckpoint, tmp_path / "guarded")
    assert guarded == plain
    assert "epoch=0-step=4.ckpt" in guarded


def _links_after_resumes(cls: type[ModelCheckpoint], root, fits, losses, save_top_k: int) -> tuple[dict[str, str], str]:
    """``fits``: (max_epochs, ckpt_path or a callable of the directory) per fit, one `save_last="link"` callback each.
    Returns the directory (each name, a file or the link's target) and the last fit's `last_model_path`."""
    for max_epochs, ckpt_path in fits:
        callback = cls(dirpath=root, monitor="val_loss", save_top_k=save_top_k, save_last="link")
        seed_everything(0)
        _trainer(callback, max_epochs).fit(FaultyModel(val_losses=losses),
                                           ckpt_path=ckpt_path(root) if callable(ckpt_path) else ckpt_path)
    return _names_and_links(root), os.path.basename(callback.last_model_path)


@pytest.mark.parametrize("through", ["last", "the link's path"])
def test_a_last_link_to_the_kept_file_a_fit_resumed_from_moves_as_model_checkpoint_moves_it(through, tmp_path):
    # the first fit's only checkpoint holds no `last_model_path` (ModelCheckpoint links `last` after writing it), so
    # the resumed fit's first `last` meets Lightning's version counter: ModelCheckpoint evicted the file it resumed
    # from, its `last.ckpt` dangles and is moved; the file kept here must not make it `last-v1.ckpt` and leave
    # `last.ckpt` on the old weights
    resume = "last" if through == "last" else (lambda root: str(root / "last.ckpt"))
    fits, losses = [(1, None), (3, resume)], [3.0, 2.0, 1.0]
    plain, plain_last = _links_after_resumes(ModelCheckpoint, tmp_path / "plain", fits, losses, save_top_k=1)
    guarded, guarded_last = _links_after_resumes(FiniteGradCheckpoint, tmp_path / "guarded", fits, losses, 1)
    assert plain == {"epoch=2-step=6.ckpt": "file", "last.ckpt": "epoch=2-step=6.ckpt"}
    assert guarded == {**plain, "epoch=0-step=2.ckpt": "file"}  # the file resumed from is kept, nothing more
    assert guarded_last == plain_last == "last.ckpt"


def test_a_last_link_to_a_checkpoint_the_boundary_evicts_moves_as_model_checkpoint_moves_it(tmp_path):
    # the third fit resumes from epoch 1's file (no `last_model_path` in it, `last.ckpt` still links to epoch 0) and
    # evicts epoch 0: ModelCheckpoint has removed it before `last` is written, here the eviction waits for the
    # boundary's writes; `last.ckpt` must still be moved, not versioned and left dangling
    fits = [(1, None), (2, "last"), (3, lambda root: str(root / "epoch=1-step=4.ckpt"))]
    losses = [3.0, 2.0, 1.0]
    plain = _links_after_resumes(ModelCheckpoint, tmp_path / "plain", fits, losses, save_top_k=2)
    guarded = _links_after_resumes(FiniteGradCheckpoint, tmp_path / "guarded", fits, losses, save_top_k=2)
    assert guarded == plain
    assert plain[0]["last.ckpt"] == "epoch=2-step=6.ckpt"


def _one_callback_resumed_from_last(cls: type[ModelCheckpoint], root) -> tuple[dict[str, str], str]:
    """One `save_last="link"` top-1 callback: 2 epochs, then resumed from `last` for a third with a better score."""
    callback = cls(dirpath=root, monitor="val_loss", save_top_k=1, save_last="link")
    for max_epochs, ckpt_path in [(2, None), (3, "last")]:
        seed_everything(0)
        _trainer(callback, max_epochs).fit(FaultyModel(val_losses=[2.0, 3.0, 1.0]), ckpt_path=ckpt_path)
    return _names_and_links(root), os.path.basename(callback.last_model_path)


def test_a_versioned_last_link_to_the_kept_file_a_fit_resumed_from_stays_as_model_checkpoint_leaves_it(tmp_path):
    # the resumed fit's first `last` is `last-v1.ckpt`, a link (the checkpoint resumed from holds no
    # `last_model_path`, `last.ckpt` still links to it); epoch 2 evicts that checkpoint: ModelCheckpoint removes it,
    # moves `last.ckpt`, and its removal of the then dangling `last-v1.ckpt` removes nothing. The file is kept here;
    # its link must stay too, not go where ModelCheckpoint's stays
    plain, plain_last = _one_callback_resumed_from_last(ModelCheckpoint, tmp_path / "plain")
    guarded, guarded_last = _one_callback_resumed_from_last(FiniteGradCheckpoint, tmp_path / "guarded")
    assert plain == {"epoch=2-step=6.ckpt": "file", "last.ckpt": "epoch=2-step=6.ckpt",
                     "last-v1.ckpt": "epoch=0-step=2.ckpt"}
    assert guarded == {**plain, "epoch=0-step=2.ckpt": "file"}  # the file resumed from is kept, nothing more
    assert guarded_last == plain_last == "last.ckpt"
