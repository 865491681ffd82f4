"""One process, both spellings: a NaN on a chosen step is refused, the directory is left as the last good save wrote
it, and ``ckpt_path="last"`` resumes from there.

``[lightning]`` is ``lightning.pytorch.Trainer`` with ``from lightning_ckguard import FiniteGradCheckpoint``;
``[pytorch_lightning]`` is ``pytorch_lightning.Trainer`` with ``from lightning_ckguard.pytorch_lightning import
FiniteGradCheckpoint``, and the model is ``helpers.FaultyModel`` built from that package (``helpers_for``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from lightning_namespace import CKGUARD_MODULES, IDS, NAMESPACES

import lightning_ckguard
from helpers import QUIET, helpers_for, ledger_state, tree_digest

# a boundary every 2 steps, at each epoch's end (so `last.ckpt` resumes cleanly); the NaN at step 5 is refused at the
# boundary at step 6
CALLBACK = dict(every_n_train_steps=2, save_top_k=-1, save_last=True, filename="{step}")
TRAINER = dict(max_steps=8, limit_train_batches=2, limit_val_batches=0, **QUIET)


@pytest.mark.parametrize("lightning", NAMESPACES, ids=[IDS[name] for name in NAMESPACES])
def test_nan_is_refused_then_resume_from_last_finishes(tmp_path, lightning):
    package = importlib.import_module(lightning)
    helpers = helpers_for(lightning)
    ckguard = importlib.import_module(CKGUARD_MODULES[lightning])
    # the errors are the same objects in both imports
    assert ckguard.NonFiniteGradientError is lightning_ckguard.NonFiniteGradientError
    assert ckguard.CheckpointWriteError is lightning_ckguard.CheckpointWriteError
    errors = {name for name in lightning_ckguard.__all__ if name.endswith("Error")}
    assert errors <= set(ckguard.__all__), errors - set(ckguard.__all__)
    assert all(getattr(ckguard, name) is getattr(lightning_ckguard, name) for name in errors)

    guard = ckguard.FiniteGradCheckpoint(dirpath=tmp_path, **CALLBACK)
    trainer = package.Trainer(callbacks=[guard], default_root_dir=tmp_path, **TRAINER)
    assert trainer.checkpoint_callback is guard
    model = helpers.FaultyModel(fault_steps=[5])
    package.seed_everything(0, verbose=False)
    with pytest.raises(lightning_ckguard.NonFiniteGradientError) as error:
        trainer.fit(model)
    fields = error.value.fields()
    assert (fields["ranks"], fields["first_step"], fields["last_step"]) == ([0], 5, 5)
    assert (fields["global_step"], fields["parameters"]) == (6, ["layer.weight"])
    # the directory and the callback's state are what the last good save (step 4) left
    before = model.snapshots[5]
    assert tree_digest(tmp_path) == before["tree"] and ledger_state(guard) == before["state"]
    assert set(before["tree"]) == {"step=2.ckpt", "step=4.ckpt", "last.ckpt"}
    assert guard.last_model_path == str(tmp_path / "last.ckpt")

    resumed = ckguard.FiniteGradCheckpoint(dirpath=tmp_path, **CALLBACK)
    trainer = package.Trainer(callbacks=[resumed], default_root_dir=tmp_path, **TRAINER)
    trainer.fit(helpers.FaultyModel(), ckpt_path="last")  # resolved through the guard, the checkpoint callback
    assert trainer.ckpt_path == str(tmp_path / "last.ckpt")
    assert trainer.global_step == 8 and resumed.last_verdict is not None and resumed.last_verdict.accepted
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt", "step=8.ckpt"]
    last = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 8
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())
    # the good files the refused run left are untouched by the resumed one
    after = tree_digest(tmp_path)
    assert [after[name] for name in ("step=2.ckpt", "step=4.ckpt")] == [before["tree"][name] for name in
                                                                          ("step=2.ckpt", "step=4.ckpt")]

    # the rewind's restore is duck typed: it takes this package's Trainer, through either import path
    checkpoint = ckguard.restore_trainer_state(trainer, str(tmp_path / "step=4.ckpt"))
    assert checkpoint["global_step"] == 4 and trainer.global_step == 8  # the loop goes on
    saved = torch.load(tmp_path / "step=4.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    restored = trainer.lightning_module.state_dict()
    assert all(torch.equal(restored[name], tensor) for name, tensor in saved.items())


def test_the_pytorch_lightning_module_exports_every_public_name():
    # a `pytorch_lightning` user imports everything from one place: the callback of its own package, and every other
    # public name as the very object `lightning_ckguard` exports
    from lightning_ckguard import pytorch_lightning as ckguard

    missing = [name for name in lightning_ckguard.__all__ if not hasattr(ckguard, name)]
    assert not missing, missing
    assert set(ckguard.__all__) == set(lightning_ckguard.__all__)
    others = set(lightning_ckguard.__all__) - {"FiniteGradCheckpoint"}
    assert all(getattr(ckguard, name) is getattr(lightning_ckguard, name) for name in others)
    assert ckguard.FiniteGradCheckpoint is not lightning_ckguard.FiniteGradCheckpoint


@pytest.mark.parametrize("first", ["pytorch_lightning", "lightning_ckguard.pytorch_lightning"])
def test_a_pytorch_lightning_user_keeps_its_rank_zero_logger(first):
    # `lightning_ckguard` imports `lightning.pytorch`, which points Lightning's rank-zero logger at its own: a
    # `pytorch_lightning` user's logging setup would stop applying to ModelCheckpoint's lines (a fresh interpreter: the
    # import order is the point)
    script = (f"import {first}, pytorch_lightning, lightning_ckguard.pytorch_lightning\n"
              "from lightning_utilities.core import rank_zero\nprint(rank_zero.log.name)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["pytorch_lightning.utilities.rank_zero"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["torch-io", "async-io"])
def test_a_pytorch_lightning_fit_publishes_each_checkpoint_whole_under_its_name(tmp_path, asynchronous):
    # that package's own TorchCheckpointIO and AsyncCheckpointIO are recognised as Lightning's: each file is written
    # under another name and appears under its own only once it is whole (one rename), as under `lightning.pytorch`
    import pytorch_lightning
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    from lightning_ckguard.publish.staging import published_path
    from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint

    helpers = helpers_for("pytorch_lightning")
    visible_when_written: dict[str, bool] = {}

    def written(path: str) -> None:
        name = published_path(path)
        visible_when_written[os.path.basename(name)] = os.path.exists(name)

    guard = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pytorch_lightning.Trainer(callbacks=[guard], plugins=[AsyncCheckpointIO()] if asynchronous else None,
                                        max_steps=4, limit_val_batches=0, **QUIET)
    pytorch_lightning.seed_everything(0, verbose=False)
    undo = helpers.hook_writes(after=written)
    try:
        trainer.fit(helpers.FaultyModel())
    finally:
        undo()
    assert visible_when_written == {"step=2.ckpt": False, "step=4.ckpt": False}
    assert sorted(os.listdir(tmp_path)) == ["step=2.ckpt", "step=4.ckpt"]


def test_a_package_whose_name_only_begins_like_pytorch_lightning_is_not_taken_for_it(tmp_path):
    # `state_key` refuses code of the other package (a `pytorch_lightning` Trainer validating its callbacks); code of
    # a package that only begins with its name (`pytorch_lightning_bolts`) reads it as any other caller does
    from lightning.pytorch.callbacks import ModelCheckpoint

    guard = lightning_ckguard.FiniteGradCheckpoint(dirpath=tmp_path)
    key = eval("guard.state_key", {"__name__": "pytorch_lightning_bolts.callbacks", "guard": guard})
    assert key == ModelCheckpoint(dirpath=tmp_path).state_key
    with pytest.raises(TypeError, match="from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint"):
        eval("guard.state_key", {"__name__": "pytorch_lightning.trainer.connectors", "guard": guard})
