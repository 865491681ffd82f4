"""A ``save_checkpoint`` of the user's own, on a Trainer subclass or a strategy subclass, is handed the checkpoint's
real path, as ``ModelCheckpoint`` hands it: only Lightning's own methods write exactly the path they get, so only they
see a staging name. Lightning's own strategies that override ``save_checkpoint`` (DeepSpeed, FSDP, model parallel)
stay staged. A distributed checkpoint's failure met inside a Trainer's save is held like any write error."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from helpers import QUIET, FaultyModel, hook_writes
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.seal import PublicationSeal

LOSSES = [3.0, 1.0, 2.0, 0.5]
ARGS = dict(monitor="val_loss", save_top_k=2, save_last=True)


class RecordingTrainer(Trainer):
    """A user's Trainer whose ``save_checkpoint`` notes each path it is given once written (an upload, say)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uploaded: list[tuple[str, bool]] = []

    def save_checkpoint(self, filepath: Any, weights_only: bool | None = False, storage_options: Any = None) -> None:
        super().save_checkpoint(filepath, weights_only, storage_options)
        self.uploaded.append((os.path.basename(str(filepath)), os.path.isfile(filepath)))


class SidecarStrategy(SingleDeviceStrategy):
    """A user's strategy whose ``save_checkpoint`` writes a manifest beside the path it is given."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        with open(f"{filepath}.json", "w") as manifest:
            json.dump({"step": checkpoint["global_step"], "path": os.path.basename(str(filepath))}, manifest)

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if os.path.exists(f"{filepath}.json"):
            os.remove(f"{filepath}.json")


def _fit(cls: type[ModelCheckpoint], root: Any, trainer_class: type[Trainer] = Trainer, **kwargs: Any) -> Trainer:
    seed_everything(0)
    trainer = trainer_class(callbacks=[cls(dirpath=root, **ARGS)], max_epochs=4, limit_train_batches=2,
                            limit_val_batches=1, num_sanity_val_steps=0, **QUIET, **kwargs)
    trainer.fit(FaultyModel(val_losses=LOSSES))
    return trainer


def _files(root: Any) -> dict[str, bytes | str]:
    """Every name under ``root`` (hidden ones included); a manifest's content, a checkpoint as a file."""
    return {name: (open(os.path.join(root, name), "rb").read() if name.endswith(".json") else "file")
            for name in sorted(os.listdir(root))}


def test_a_trainer_subclass_overriding_save_checkpoint_is_handed_the_real_paths(tmp_path):
    plain = _fit(ModelCheckpoint, tmp_path / "plain", RecordingTrainer)
    guarded = _fit(FiniteGradCheckpoint, tmp_path / "guarded", RecordingTrainer)
    assert isinstance(plain, RecordingTrainer) and isinstance(guarded, RecordingTrainer)
    assert guarded.uploaded == plain.uploaded  # the published names, each a file once written: no staging name
    assert all(not name.startswith(".") and exists for name, exists in guarded.uploaded), guarded.uploaded
    assert _files(tmp_path / "guarded") == _files(tmp_path / "plain")


def test_a_strategy_subclass_overriding_save_checkpoint_is_handed_the_real_paths(tmp_path):
    _fit(ModelCheckpoint, tmp_path / "plain", strategy=SidecarStrategy())
    _fit(FiniteGradCheckpoint, tmp_path / "guarded", strategy=SidecarStrategy())
    files = _files(tmp_path / "guarded")
    assert files == _files(tmp_path / "plain")  # the same checkpoints and manifests, nothing hidden beside them
    assert json.loads(files["last.ckpt.json"]) == {"step": 8, "path": "last.ckpt"}


def test_lightnings_own_methods_stay_staged(tmp_path):
    """The control: Lightning's Trainer and strategy write only the path they get, so the write is staged and the
    name published by one rename."""
    written: list[str] = []
    undo = hook_writes(before=written.append)
    try:
        _fit(FiniteGradCheckpoint, tmp_path, strategy=SingleDeviceStrategy(device=torch.device("cpu")))
    finally:
        undo()
    assert written and all(os.path.basename(path).startswith(".") for path in written), written


class _TrainerOf:
    """Stands for a Trainer holding ``strategy`` (Lightning's FSDP needs a GPU to build a real one)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy


class UploadingDDPStrategy(DDPStrategy):
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)


@pytest.mark.parametrize(
    ("strategy", "staged"),
    [(DDPStrategy(), True), (FSDPStrategy(), True), (FSDPStrategy(state_dict_type="sharded"), True),
     (ModelParallelStrategy(), True), (UploadingDDPStrategy(), False)],
    ids=["ddp", "fsdp-full", "fsdp-sharded", "model-parallel", "users-ddp-subclass"],
)
def test_only_a_save_checkpoint_of_the_users_own_class_turns_staging_off(strategy, staged):
    # Lightning's FSDP and model-parallel strategies override `save_checkpoint` inside the lightning package: still
    # Lightning's own (DeepSpeed's too: `tests -k deepspeed`)
    assert PublicationSeal.writes_through_lightning(_TrainerOf(strategy)) is staged


class _UploadingTrainerOf(_TrainerOf):
    def save_checkpoint(self, filepath: Any, weights_only: bool = False, storage_options: Any = None) -> None:
        """A Trainer subclass's own save (an upload after it, say)."""


@pytest.mark.parametrize(("strategy", "staged"),
                         [(DDPStrategy(), False), (FSDPStrategy(state_dict_type="sharded"), True)],
                         ids=["files", "directories"])
def test_a_trainer_subclass_of_its_own_writes_directories_staged_all_the_same(strategy, staged):
    # only a staged directory is published whole: a strategy that writes directories stays staged whoever overrides
    assert PublicationSeal.writes_through_lightning(_UploadingTrainerOf(strategy)) is staged


def test_a_distributed_checkpoint_failure_in_a_fit_raises_the_write_error_itself(tmp_path):
    """``torch.distributed.checkpoint``'s ``CheckpointException`` is a ``BaseException``: held like any write error,
    the fit raises this rank's own error (a full disk), and the failed checkpoint is not published."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    def fail_epoch_2(path: str) -> None:
        if "epoch=2" in os.path.basename(path):
            try:
                raise OSError(28, "No space left on device (injected)")
            except OSError as error:
                raise CheckpointException("CheckpointException", {0: _wrap_exception(error)}) from None

    undo = hook_writes(before=fail_epoch_2)
    try:
        with pytest.raises(OSError, match="No space left"):
            _fit(FiniteGradCheckpoint, tmp_path)
    finally:
        undo()
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
