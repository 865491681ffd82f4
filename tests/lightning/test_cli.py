"""``FiniteGradCheckpoint`` from ``LightningCLI``: YAML configs and ``--trainer.callbacks+=``, checked by jsonargparse.

Every run is a real ``LightningCLI`` (``fit`` subcommand) in this process, on CPU, with ``helpers.FaultyModel`` chosen
by class path so a NaN can be planted from the config. What is asserted is what a CLI user sees: the checkpoint files
on disk, the callback the Trainer got, the config the CLI saved, and the CLI's error for an invalid value.
Both packages' CLIs are covered: ``lightning.pytorch.cli.LightningCLI`` with ``lightning_ckguard.FiniteGradCheckpoint``
and ``pytorch_lightning.cli.LightningCLI`` with ``lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint``, and each
Trainer refuses the other package's callback with the import that fits.
"""

from __future__ import annotations

import importlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_namespace import CKGUARD_MODULES, IDS, NAMESPACES

from conftest import LIGHTNING_2_5, TESTS
from helpers import QUIET, helpers_for
from lightning_ckguard import FiniteGradCheckpoint, SpikeGate

BORING = "--model=lightning.pytorch.demos.boring_classes.BoringModel"
CONFIG = os.path.join(TESTS, "data", "cli_config.yaml")
ALL_ARGUMENTS = os.path.join(TESTS, "data", "cli_all_arguments.yaml")

GUARD = "lightning_ckguard.FiniteGradCheckpoint"
QUIET_ARGS = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
]


@pytest.fixture(autouse=True)
def command_line(monkeypatch):
    # the CLI is given its arguments explicitly; pytest's own must not look like a second command line
    monkeypatch.setattr(sys, "argv", ["cli"])


def cli(args: list[str], run: bool = True) -> LightningCLI:
    # subclass mode: the model is chosen by class path (helpers.FaultyModel), as a user's config would
    return LightningCLI(BoringModel, subclass_mode_model=True, args=args, run=run)


def guard_of(cli_: LightningCLI) -> FiniteGradCheckpoint:
    guards = [c for c in cli_.trainer.callbacks if isinstance(c, FiniteGradCheckpoint)]
    assert len(guards) == 1, cli_.trainer.callbacks
    return guards[0]


def saved_callback_args(root: Path) -> dict[str, Any]:
    """The init_args of our callback in the config.yaml that LightningCLI's SaveConfigCallback wrote."""
    config = yaml.safe_load((root / "config.yaml").read_text())
    (entry,) = [c for c in config["trainer"]["callbacks"] if c["class_path"] == GUARD]
    return entry["init_args"]


def test_yaml_config_builds_the_callback_and_its_policy_applies(tmp_path):
    result = cli(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"])
    guard = guard_of(result)
    assert guard.on_non_finite == "skip" and guard.count_skipped_steps is True
    # the NaN at step 3 made the boundary at step 4 publish nothing ("skip"); training went on and step 6 published
    assert result.trainer.global_step == 6
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step=2.ckpt", "step=6.ckpt"]
    assert guard.last_verdict is not None and guard.last_verdict.accepted
    assert guard.last_verdict.count_skipped_steps is True  # the value reached the agreement, not just the attribute
    assert guard.rejection is None
    saved = saved_callback_args(tmp_path)
    assert saved["on_non_finite"] == "skip" and saved["count_skipped_steps"] is True
    assert saved["every_n_train_steps"] == 2 and saved["save_top_k"] == -1


def test_callbacks_append_from_the_command_line(tmp_path):
    result = cli([
        "fit",
        *QUIET_ARGS,
        "--trainer.max_steps=8",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks+={GUARD}",
        "--trainer.callbacks.every_n_train_steps=2",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.filename={step}",
        "--trainer.callbacks.on_non_finite=stop",
        "--model=helpers.FaultyModel",
        "--model.fault_steps=[3]",
    ])
    guard = guard_of(result)
    assert guard.on_non_finite == "stop" and guard.count_skipped_steps is False
    # "stop": the boundary at step 4 publishes nothing and fit() returns normally
    assert result.trainer.should_stop and result.trainer.global_step == 4
    assert os.listdir(tmp_path / "checkpoints") == ["step=2.ckpt"]
    assert guard.rejection is not None and guard.rejection.fields()["first_step"] == 3
    assert saved_callback_args(tmp_path)["on_non_finite"] == "stop"


def assert_every_argument_of_the_config(guard) -> None:
    """``guard`` holds every value of ``ALL_ARGUMENTS`` (run from the test's own directory)."""
    assert guard.dirpath == os.path.realpath("checkpoints/guarded")
    assert (guard.filename, guard.monitor, guard.verbose) == ("{epoch}-{step}", "val_loss", True)
    assert (guard.save_last, guard.save_top_k, guard.save_on_exception) == ("link", 3, True)
    assert (guard.save_weights_only, guard.mode, guard.auto_insert_metric_name) == (True, "max", False)
    assert guard._train_time_interval == timedelta(seconds=30)
    assert (guard._save_on_train_epoch_end, guard._enable_version_counter) == (False, False)
    assert (guard.on_non_finite, guard.count_skipped_steps, guard.durable) == ("stop", True, False)
    assert guard.spike_gate == SpikeGate(measures=("grad_norm",), factor=5.0, deviations=8.0, warmup_steps=20,
                                         history=200, resolution=64)


def test_every_argument_is_typed_and_reaches_the_callback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    guard = guard_of(cli(["--config", ALL_ARGUMENTS, BORING], run=False))
    assert_every_argument_of_the_config(guard)
    # the frequencies are mutually exclusive in ModelCheckpoint: the other two, one at a time
    for key, attribute in (("every_n_epochs", "_every_n_epochs"), ("every_n_train_steps", "_every_n_train_steps")):
        override = ["--trainer.callbacks.train_time_interval=null", f"--trainer.callbacks.{key}=5"]
        assert getattr(guard_of(cli(["--config", ALL_ARGUMENTS, BORING, *override], run=False)), attribute) == 5


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("on_non_finite", "explode", "Literal['raise', 'skip', 'stop', 'rewind']"),
        ("count_skipped_steps", "maybe", "Expected a <class 'bool'>"),
        ("save_last", "sometimes", "Literal['link']"),
        ("save_top_k", "three", "Expected a <class 'int'>"),
        ("every_n_train_steps", "often", "Expected a <class 'int'>"),
        ("train_time_interval", "soon", "timedelta"),
        ("spike_gate.factor", "huge", "Expected a <class 'float'>"),
        ("spike_gate.measures", "perplexity", "Expected a <class 'tuple'>"),
    ],
)
def test_invalid_values_are_rejected_by_the_cli(tmp_path, capsys, argument, value, expected):
    with pytest.raises(SystemExit) as exit_info:
        cli(["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
             f"--trainer.callbacks.{argument}={value}"])
    assert exit_info.value.code != 0
    error = capsys.readouterr().err
    key = argument.rsplit(".", 1)[-1]  # a nested key (the spike gate's) is named on its own line
    assert f'Parser key "{key}"' in error and value in error and expected in error, error[-3000:]
    assert not os.listdir(tmp_path), "nothing may run, and nothing be written, for an invalid config"


def test_invalid_policy_in_a_yaml_file_is_rejected(tmp_path, capsys):
    config = yaml.safe_load(Path(CONFIG).read_text())
    config["trainer"]["callbacks"][0]["init_args"]["on_non_finite"] = "explode"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        cli(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exit_info.value.code != 0
    error = capsys.readouterr().err
    assert 'Parser key "on_non_finite"' in error and "explode" in error, error[-3000:]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- namespaces
# `lightning` installs two packages holding separate copies of the same classes: `lightning.pytorch` (`import
# lightning as L`) and `pytorch_lightning`. A Trainer treats only its own package's ModelCheckpoint subclasses as
# checkpoint callbacks, so each package has its spelling of the callback: `lightning_ckguard.FiniteGradCheckpoint`
# and `lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint`; the errors are the same objects in both.

NAMESPACE_IDS = [IDS[name] for name in NAMESPACES]
PL_GUARD = "lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint"
SPELLINGS = {"lightning.pytorch": GUARD, "pytorch_lightning": PL_GUARD}
FITTING_IMPORTS = {name: f"from {module} import FiniteGradCheckpoint" for name, module in CKGUARD_MODULES.items()}


def namespace_cli(lightning: str, args: list[str], run: bool = True) -> Any:
    """``LightningCLI`` of package ``lightning`` (``lightning.pytorch.cli`` or ``pytorch_lightning.cli``)."""
    package = helpers_for(lightning)
    return importlib.import_module(f"{lightning}.cli").LightningCLI(
        package.BoringModel, subclass_mode_model=True, args=args, run=run)


def config_for(lightning: str, source: str, tmp_path: Path) -> str:
    """``source``'s config with the callback's ``class_path`` spelled for ``lightning``, and ``helpers.FaultyModel``
    built from that package (``helpers_for``: the module ``helpers_pytorch_lightning`` for ``pytorch_lightning``)."""
    config = yaml.safe_load(Path(source).read_text())
    config["trainer"]["callbacks"][0]["class_path"] = SPELLINGS[lightning]
    if "model" in config:
        config["model"]["class_path"] = f"{helpers_for(lightning).__name__}.FaultyModel"
    path = tmp_path / f"{IDS[lightning]}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize("lightning", NAMESPACES, ids=NAMESPACE_IDS)
def test_class_path_of_each_spelling_runs_under_that_packages_cli(tmp_path, lightning):
    root = tmp_path / "run"
    result = namespace_cli(lightning, ["fit", "--config", config_for(lightning, CONFIG, tmp_path),
                                       f"--trainer.default_root_dir={root}"])
    guard = result.trainer.checkpoint_callback
    assert type(guard) is importlib.import_module(CKGUARD_MODULES[lightning]).FiniteGradCheckpoint
    assert isinstance(guard, importlib.import_module(f"{lightning}.callbacks").ModelCheckpoint)
    assert result.trainer.checkpoint_callbacks == [guard] and type(result.trainer).__module__.startswith(lightning)
    assert (guard.on_non_finite, guard.count_skipped_steps) == ("skip", True)
    # the NaN at step 3 made the boundary at step 4 publish nothing ("skip"); training went on and step 6 published
    assert result.trainer.global_step == 6
    assert sorted(os.listdir(root / "checkpoints")) == ["step=2.ckpt", "step=6.ckpt"]
    assert guard.last_verdict is not None and guard.last_verdict.accepted and guard.rejection is None
    saved = yaml.safe_load((root / "config.yaml").read_text())["trainer"]["callbacks"]
    assert [(c["class_path"], c["init_args"]["on_non_finite"]) for c in saved] == [(SPELLINGS[lightning], "skip")]


@pytest.mark.parametrize("lightning", NAMESPACES, ids=NAMESPACE_IDS)
def test_every_argument_reaches_each_spelling(tmp_path, monkeypatch, lightning):
    monkeypatch.chdir(tmp_path)
    result = namespace_cli(lightning, ["--config", config_for(lightning, ALL_ARGUMENTS, tmp_path),
                                       f"--model={lightning}.demos.boring_classes.BoringModel"], run=False)
    guard = result.trainer.checkpoint_callback
    assert type(guard) is importlib.import_module(CKGUARD_MODULES[lightning]).FiniteGradCheckpoint
    assert result.trainer.checkpoint_callbacks == [guard]
    assert_every_argument_of_the_config(guard)


def test_each_trainer_recognises_its_own_spelling_as_the_checkpoint_callback(tmp_path):
    import lightning.pytorch
    import pytorch_lightning
    from pytorch_lightning.demos.boring_classes import BoringModel as PLBoringModel

    from lightning_ckguard import pytorch_lightning as ckguard_pl

    guard = ckguard_pl.FiniteGradCheckpoint(dirpath=tmp_path / "guarded")  # default arguments
    assert isinstance(guard, pytorch_lightning.callbacks.ModelCheckpoint)
    assert not isinstance(guard, lightning.pytorch.callbacks.ModelCheckpoint)
    trainer = pytorch_lightning.Trainer(callbacks=[guard], default_root_dir=tmp_path, max_epochs=1,
                                        limit_train_batches=2, limit_val_batches=0, **QUIET)
    # no plain ModelCheckpoint is added: `ckpt_path="best"` / `"last"` resolve through the guard
    assert trainer.checkpoint_callback is guard and trainer.checkpoint_callbacks == [guard]
    trainer.fit(PLBoringModel())
    assert os.listdir(tmp_path / "guarded") == ["epoch=0-step=2.ckpt"]
    assert guard.last_verdict is not None and guard.last_verdict.accepted
    guard = FiniteGradCheckpoint(dirpath=tmp_path / "guarded")
    trainer = lightning.pytorch.Trainer(callbacks=[guard], default_root_dir=tmp_path, **QUIET)
    assert trainer.checkpoint_callback is guard and trainer.checkpoint_callbacks == [guard]


@pytest.mark.parametrize("arguments", [{}, {"every_n_train_steps": 1}], ids=["default-arguments", "every-step"])
@pytest.mark.parametrize(("callback_package", "trainer_package"),
                         [("lightning.pytorch", "pytorch_lightning"), ("pytorch_lightning", "lightning.pytorch")],
                         ids=["lightning-callback-on-pytorch_lightning-trainer",
                              "pytorch_lightning-callback-on-lightning-trainer"])
def test_the_other_packages_trainer_is_refused_with_the_import_that_fits(tmp_path, callback_package,
                                                                          trainer_package, arguments):
    callback_class = importlib.import_module(CKGUARD_MODULES[callback_package]).FiniteGradCheckpoint
    trainer_class = importlib.import_module(trainer_package).Trainer
    guard = callback_class(dirpath=tmp_path / "guarded", **arguments)
    # refused at construction, before a plain ModelCheckpoint could be added beside it (same state key with default
    # arguments) and before anything runs or is written
    if LIGHTNING_2_5:
        # Lightning 2.5's Trainer gives up on a callback of the other package before any callback code runs
        # (`is_overridden` without a parent): its own error, which cannot name the import
        with pytest.raises(ValueError, match="Expected a parent"):
            trainer_class(callbacks=[guard], default_root_dir=tmp_path, max_steps=2, **QUIET)
    else:
        with pytest.raises(TypeError) as error:
            trainer_class(callbacks=[guard], default_root_dir=tmp_path, max_steps=2, **QUIET)
        assert FITTING_IMPORTS[trainer_package] in str(error.value), str(error.value)
    assert not (tmp_path / "guarded").exists() and not os.listdir(tmp_path)
