"""Drop-in: the callback state lives under ``ModelCheckpoint``'s key, checkpoints move between the two classes both
ways, writes Lightning does not make itself get the real path, and the Trainer gets its ``save_checkpoint`` back."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO

from helpers import QUIET, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint

LOSSES = [3.0, 2.0, 2.5, 1.0]
ARGS = dict(monitor="val_loss", save_top_k=2, save_last=True)


def _trainer(callback: ModelCheckpoint, max_epochs: int, **kwargs: Any) -> Trainer:
    return Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                   num_sanity_val_steps=0, **QUIET, **kwargs)


def _top_k_files(root) -> set[str]:
    return {name for name in os.listdir(root) if not name.startswith("last")}


def test_the_state_key_is_model_checkpoints_and_the_version_rides_inside(tmp_path):
    guarded = FiniteGradCheckpoint(dirpath=tmp_path, **ARGS)
    assert guarded.state_key == ModelCheckpoint(dirpath=tmp_path, **ARGS).state_key
    assert guarded.state_key.startswith("ModelCheckpoint{")
    seed_everything(0)
    _trainer(guarded, 2).fit(FaultyModel(val_losses=LOSSES))
    states = torch.load(guarded.last_model_path, weights_only=False)["callbacks"]
    state = states[ModelCheckpoint(dirpath=tmp_path, **ARGS).state_key]
    assert state["ckguard_format_version"] == 1
    assert set(state["best_k_models"]) == {str(tmp_path / "epoch=0-step=2.ckpt"), str(tmp_path / "epoch=1-step=4.ckpt")}


@pytest.mark.parametrize("first, second", [(FiniteGradCheckpoint, ModelCheckpoint),
                                           (ModelCheckpoint, FiniteGradCheckpoint)],
                         ids=["guarded-then-plain", "plain-then-guarded"])
def test_a_run_moves_between_the_two_classes_with_its_top_k_and_no_warning(first, second, tmp_path):
    seed_everything(0)
    _trainer(first(dirpath=tmp_path, **ARGS), 2).fit(FaultyModel(val_losses=LOSSES))
    assert _top_k_files(tmp_path) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"}

    resumed = second(dirpath=tmp_path, **ARGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(resumed, 3).fit(FaultyModel(val_losses=LOSSES), ckpt_path=str(tmp_path / "last.ckpt"))
    assert not [w for w in caught if "callbacks used to create the checkpoint" in str(w.message)]
    # the resumed ledger knew epoch 0 (3.0) was the worst of the top 2 and evicted it for epoch 2 (2.5)
    assert _top_k_files(tmp_path) == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"}
    assert set(resumed.best_k_models) == {str(tmp_path / name) for name in _top_k_files(tmp_path)}
    assert resumed.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")


def test_a_state_stored_under_the_earlier_key_still_loads(tmp_path):
    seed_everything(0)
    _trainer(FiniteGradCheckpoint(dirpath=tmp_path, **ARGS), 2).fit(FaultyModel(val_losses=LOSSES))
    last = str(tmp_path / "last.ckpt")
    checkpoint = torch.load(last, weights_only=False)
    key = ModelCheckpoint(dirpath=tmp_path, **ARGS).state_key
    checkpoint["callbacks"]["FiniteGradCheckpoint" + key[len("ModelCheckpoint"):]] = checkpoint["callbacks"].pop(key)
    torch.save(checkpoint, last)  # as releases before this one wrote it

    resumed = FiniteGradCheckpoint(dirpath=tmp_path, **ARGS)
    _trainer(resumed, 3).fit(FaultyModel(val_losses=LOSSES), ckpt_path=last)
    assert _top_k_files(tmp_path) == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"}


def test_a_trainer_with_both_classes_under_one_key_is_refused_by_lightning(tmp_path):
    with pytest.raises(RuntimeError, match="Found more than one stateful callback"):
        Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path, **ARGS), FiniteGradCheckpoint(dirpath=tmp_path, **ARGS)],
                **QUIET)


def test_a_subclass_keeps_its_own_state_key(tmp_path):
    class MyCheckpoint(FiniteGradCheckpoint):
        pass

    assert MyCheckpoint(dirpath=tmp_path, **ARGS).state_key.startswith(MyCheckpoint.__qualname__ + "{")


class MappingIO(CheckpointIO):
    """A user's own checkpoint IO that stores every checkpoint under another name (``<path>.mapped``)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(checkpoint, f"{path}.mapped")

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return torch.load(f"{path}.mapped", weights_only=False)

    def remove_checkpoint(self, path: Any) -> None:
        if os.path.exists(f"{path}.mapped"):
            os.remove(f"{path}.mapped")


def test_a_checkpoint_io_of_the_users_own_gets_the_real_paths(tmp_path):
    listings = {}
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        root = tmp_path / cls.__name__
        callback = cls(dirpath=root, monitor="val_loss", save_top_k=1, save_last=True)
        seed_everything(0)
        _trainer(callback, 3, plugins=[MappingIO()]).fit(FaultyModel(val_losses=LOSSES))
        listings[cls] = (sorted(os.listdir(root)), os.path.basename(callback.best_model_path))
    assert listings[FiniteGradCheckpoint] == listings[ModelCheckpoint]
    assert listings[ModelCheckpoint] == (["epoch=1-step=4.ckpt.mapped", "last.ckpt.mapped"], "epoch=1-step=4.ckpt")


class SidecarIO(TorchCheckpointIO):
    """A user's subclass of Lightning's checkpoint IO: ``super()`` writes, then a sidecar goes beside the path it was
    given (a digest, a manifest), and the path is recorded (as an uploader would)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        with open(f"{path}.json", "w") as sidecar:
            sidecar.write(f'{{"global_step": {checkpoint["global_step"]}}}')
        self.paths.append(os.path.basename(str(path)))

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        os.remove(f"{path}.json")


class OrderedAsyncCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` removes on the calling thread while saves may still be queued on its own
    (Lightning-AI/pytorch-lightning#14035): a top-k eviction can run before the evicted checkpoint, and its sidecar,
    were written. A removal here first waits for the saves queued before it, so the run does not depend on timing."""

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()  # one worker, first in first out: every earlier save ran
        super().remove_checkpoint(*args, **kwargs)


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_subclass_of_lightnings_checkpoint_io_that_overrides_save_gets_the_real_paths(tmp_path, background):
    """Only Lightning's own ``save_checkpoint`` is written to a staging name: an override sees the name
    ``ModelCheckpoint`` gives it, and what it puts beside the checkpoint lands there, not in a hidden staging entry."""
    seen = {}
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        root = tmp_path / cls.__name__
        callback = cls(dirpath=root, monitor="val_loss", save_top_k=1, save_last=True)
        io = SidecarIO()
        seed_everything(0)
        trainer = _trainer(callback, 3, plugins=[OrderedAsyncCheckpointIO(io) if background else io])
        trainer.fit(FaultyModel(val_losses=LOSSES))
        trainer.strategy.checkpoint_io.teardown()  # AsyncCheckpointIO: wait for its thread
        seen[cls] = (sorted(os.listdir(root)), io.paths, os.path.basename(callback.best_model_path))
    assert seen[FiniteGradCheckpoint] == seen[ModelCheckpoint]
    assert seen[ModelCheckpoint][0] == ["epoch=1-step=4.ckpt", "epoch=1-step=4.ckpt.json", "last.ckpt",
                                        "last.ckpt.json"]


def test_the_trainer_gets_its_own_save_checkpoint_back_after_fit(tmp_path):
    trainer = _trainer(FiniteGradCheckpoint(dirpath=tmp_path, **ARGS), 1)
    seed_everything(0)
    trainer.fit(FaultyModel(val_losses=LOSSES))
    assert "save_checkpoint" not in vars(trainer)  # Lightning's method, not the seal

    mocked = _trainer(FiniteGradCheckpoint(dirpath=tmp_path / "mocked", **ARGS), 2)
    mocked.save_checkpoint = Mock()
    mocked.fit(FaultyModel(val_losses=LOSSES))
    assert isinstance(mocked.save_checkpoint, Mock)
    # the mock saw the published names, as with ModelCheckpoint, and nothing crashed on the files it never wrote
    assert [os.path.basename(call.args[0]) for call in mocked.save_checkpoint.call_args_list] == [
        "epoch=0-step=2.ckpt", "last.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]


class PassThroughIO(TorchCheckpointIO):
    """A user's own checkpoint IO (its ``save_checkpoint`` overridden): the guard writes through it directly."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_users_own_checkpoint_io_overwriting_names_on_a_finite_run_logs_no_warning(tmp_path, caplog):
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True, save_top_k=1)
    seed_everything(0)
    with caplog.at_level(logging.WARNING, logger="lightning_ckguard"):
        Trainer(callbacks=[callback], max_steps=4, limit_val_batches=0, plugins=[PassThroughIO()], **QUIET).fit(
            FaultyModel())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert [r.getMessage() for r in caplog.records if r.name.startswith("lightning_ckguard")] == []
