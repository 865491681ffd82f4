"""Bad input gets a clear error or warning, and nothing on disk is silently overwritten."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer, seed_everything

from helpers import QUIET, FaultyModel, tree_digest
from lightning_ckguard import FiniteGradCheckpoint

STEPS = dict(max_steps=4, limit_val_batches=0)


def _fit(callback: FiniteGradCheckpoint, ckpt_path: str | None = None, **trainer_kwargs) -> Trainer:
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], **QUIET, **{**STEPS, **trainer_kwargs})
    trainer.fit(FaultyModel(), ckpt_path=ckpt_path)
    return trainer


def test_dirpath_that_is_a_file_is_refused_at_construction(tmp_path):
    path = tmp_path / "not-a-directory"
    path.write_text("x")
    with pytest.raises(ValueError, match="`dirpath` must be a directory.*existing file"):
        FiniteGradCheckpoint(dirpath=path)
    assert path.read_text() == "x"


def test_state_from_a_newer_format_is_refused_on_resume(tmp_path):
    _fit(FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True))
    last = tmp_path / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("ModelCheckpoint")]
    checkpoint["callbacks"][key]["ckguard_format_version"] = 99
    torch.save(checkpoint, last)
    before = tree_digest(str(tmp_path))
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    with pytest.raises(ValueError, match="format version 99.*reads versions 1 to 1"):
        _fit(callback, ckpt_path=str(last), max_steps=8)
    assert tree_digest(str(tmp_path)) == before


def test_monitor_that_is_never_logged_fails_at_the_first_validation_and_writes_nothing(tmp_path):
    # as ModelCheckpoint: an error naming the key once a validation has run, and never a write
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="never_logged")
    with pytest.raises(MisconfigurationException, match="never_logged"):
        _fit(callback, max_epochs=1, max_steps=-1, limit_train_batches=2, limit_val_batches=1)
    assert not os.path.exists(tmp_path) or os.listdir(tmp_path) == []


def test_truncated_checkpoint_at_resume_is_an_error_and_overwrites_nothing(tmp_path):
    _fit(FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True))
    last = tmp_path / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100])
    before = tree_digest(str(tmp_path))
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    with pytest.raises(RuntimeError):
        _fit(callback, ckpt_path="last", max_steps=8)
    assert tree_digest(str(tmp_path)) == before


def test_corrupted_files_in_dirpath_are_never_overwritten_by_a_fresh_run(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "epoch=0-step=2.ckpt").write_bytes(b"not a checkpoint")
    _fit(FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1))
    assert (tmp_path / "epoch=0-step=2.ckpt").read_bytes() == b"not a checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2-v1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nothing can be created in, even by root: ``chattr +i`` (tests often run as root in CI)."""
    path = tmp_path / "read-only"
    path.mkdir()
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("needs `chattr +i` (e2fsprogs, CAP_LINUX_IMMUTABLE) to make a directory unwritable for root")
    try:
        yield path
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


@pytest.mark.parametrize("where", ["dirpath", "its parent"])
def test_an_unwritable_dirpath_is_an_error_before_training_starts(read_only_dir, where):
    dirpath = read_only_dir if where == "dirpath" else read_only_dir / "checkpoints"
    callback = FiniteGradCheckpoint(dirpath=dirpath, every_n_train_steps=2)
    with pytest.raises(PermissionError, match=r"cannot write checkpoints to dirpath .*read-only.*rank 0") as error:
        _fit(callback)
    assert "global step 0" in str(error.value)  # at setup: no training time is lost before the first save
    assert os.listdir(read_only_dir) == []
