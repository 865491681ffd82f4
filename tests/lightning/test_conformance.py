"""Conformance with ModelCheckpoint: on finite single-process runs, FiniteGradCheckpoint is indistinguishable from it.

Each case fits a plain ``ModelCheckpoint`` and a ``FiniteGradCheckpoint`` with the same arguments, seed and scripted
model, each under its own root, and compares everything a user observes (see ``conformance_helpers.observe``): files,
links and each checkpoint's loaded content (its callback state under ModelCheckpoint's own state key), the bookkeeping
after ``fit``, the verbose log lines and warnings, how often ModelCheckpoint's hooks read the clock, how often
``trainer.save_checkpoint`` was called and how many files were written and removed. The only thing left out is the one
key FiniteGradCheckpoint adds to its state, ``ckguard_format_version`` (and, with a logger, its documented
``ckguard/*`` metrics). ModelCheckpoint is the reference: a case that differs fails, listing every difference.

The last tests compare the classes themselves: constructor annotations, the kind and parameters of every method
ModelCheckpoint defines, and ``vars()`` after pickling and deep-copying.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
from conformance_helpers import (
    ATTRIBUTES,
    GUARD_METRIC_PREFIX,
    ROOT,
    ScriptedModel,
    Side,
    differences,
    normalize,
    observe,
)
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn

from helpers import QUIET, RecordingLogger
from lightning_ckguard import FiniteGradCheckpoint

#: ``val_loss`` of the i-th validation run: the top-K choices are fixed in advance.
VAL = [3.0, 1.0, 2.0, 0.5, 4.0, 0.25, 1.5, 0.75]
NAN = float("nan")
EPOCHS = dict(max_epochs=4, limit_train_batches=4, limit_val_batches=2)
NO_VAL = dict(EPOCHS, limit_val_batches=0)
#: 2 epochs of BoringModel's 64 batches, 7 s each: with a 1 minute interval, ModelCheckpoint saves every 9th batch
TIMED = dict(max_epochs=2, limit_val_batches=0)


@dataclass(frozen=True)
class Case:
    callback: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=lambda: dict(EPOCHS))
    model: dict[str, Any] = field(default_factory=lambda: dict(val_values=VAL))
    dirpath: bool = True  # False: ModelCheckpoint's default directory (the logger's, or default_root_dir's)
    logger: bool = False
    fits: int = 1  # fits of one side, all into the same root (the second one meets the first one's files)
    same_callback: bool = False  # refit the same callback instance instead of a new one with the same arguments
    mock_save: bool = False  # trainer.save_checkpoint is a Mock: nothing is written
    resume: str | None = None  # the ckpt_path of every fit after the first ("last", "best")
    later_trainer: dict[str, Any] | None = None  # the Trainer's arguments for every fit after the first
    last_model: dict[str, Any] = field(default_factory=dict)  # what the last fit's model takes on top of `model`
    ckpt_files: int | None = None  # how many .ckpt files ModelCheckpoint leaves (checks the case tests what it says)


MONITOR = dict(monitor="val_loss")
SLASH = dict(val_values=VAL, val_key="val/loss")
STEPS = [5.0, 4.0, 6.0, 3.0, 7.0, 2.0, 8.0, 1.0, 9.0, 0.5, 9.5, 0.25, 10.0, 0.1, 11.0, 0.05]

CASES: dict[str, Case] = {
    # save_top_k, monitor, mode
    "top1-min": Case(dict(MONITOR, save_top_k=1)),
    "top3-min-last": Case(dict(MONITOR, save_top_k=3, save_last=True)),
    "top3-max": Case(dict(MONITOR, save_top_k=3, mode="max")),
    "all-max": Case(dict(MONITOR, save_top_k=-1, mode="max")),
    "top0-monitor": Case(dict(MONITOR, save_top_k=0), ckpt_files=0),
    "top0-monitor-last": Case(dict(MONITOR, save_top_k=0, save_last=True), ckpt_files=1),
    "top0-monitor-link": Case(dict(MONITOR, save_top_k=0, save_last="link"), ckpt_files=1),
    "no-monitor-top1": Case(dict(), ckpt_files=1),
    "no-monitor-all": Case(dict(save_top_k=-1), ckpt_files=4),
    "no-monitor-top0-last": Case(dict(save_top_k=0, save_last=True), ckpt_files=1),
    # save_last
    "last-none": Case(dict(MONITOR, save_top_k=2, save_last=None)),
    "last-false": Case(dict(MONITOR, save_top_k=2, save_last=False)),
    "last-true": Case(dict(MONITOR, save_top_k=2, save_last=True)),
    "last-link": Case(dict(MONITOR, save_top_k=2, save_last="link")),
    "last-link-no-monitor-all": Case(dict(save_top_k=-1, save_last="link")),
    # NaN monitored values: stored as +/-inf, never the best
    "nan-first-min": Case(dict(MONITOR, save_top_k=2, save_last=True, filename="{epoch}-{val_loss:.2f}"),
                          model=dict(val_values=[NAN, 1.0, 2.0, 0.5])),
    "nan-middle-max": Case(dict(MONITOR, save_top_k=2, mode="max", filename="{epoch}-{val_loss:.2f}"),
                           model=dict(val_values=[3.0, NAN, 2.0, 0.5])),
    "nan-middle-all": Case(dict(MONITOR, save_top_k=-1, filename="{epoch}-{val_loss:.2f}"),
                           model=dict(val_values=[3.0, NAN, 2.0, 0.5])),
    # every_n_train_steps (deferred to validation end when the monitored key is a validation metric)
    "every-3-steps": Case(dict(every_n_train_steps=3, save_top_k=-1, filename="{step}"), trainer=NO_VAL),
    "every-3-steps-monitored-val": Case(dict(MONITOR, every_n_train_steps=3, save_top_k=2, save_last=True)),
    "every-2-steps-monitored-train": Case(dict(monitor="train_metric", every_n_train_steps=2, save_top_k=2,
                                               save_last=True, filename="{step}-{train_metric:.2f}"),
                                          model=dict(val_values=VAL, train_values=STEPS)),
    # every_n_epochs
    "every-0-epochs-last": Case(dict(every_n_epochs=0, save_last=True), ckpt_files=1),
    "every-0-epochs-monitor-last": Case(dict(MONITOR, every_n_epochs=0, save_top_k=2, save_last=True), ckpt_files=1),
    "every-1-epoch": Case(dict(MONITOR, every_n_epochs=1, save_top_k=2, save_last=True)),
    "every-2-epochs": Case(dict(MONITOR, every_n_epochs=2, save_top_k=-1, save_last=True)),
    "every-2-epochs-no-monitor": Case(dict(every_n_epochs=2, save_top_k=-1), ckpt_files=2),
    # train_time_interval on the fake clock
    "time-1min-7s-batches": Case(dict(train_time_interval=timedelta(minutes=1), save_top_k=-1, filename="{step}"),
                                 trainer=TIMED, model=dict(seconds_per_batch=7.0), ckpt_files=14),
    "time-1min-last": Case(dict(train_time_interval=timedelta(minutes=1), save_top_k=1, save_last=True),
                           trainer=TIMED, model=dict(seconds_per_batch=7.0), ckpt_files=2),
    "time-20s-monitored-val": Case(dict(MONITOR, train_time_interval=timedelta(seconds=20), save_top_k=2,
                                        save_last=True),
                                   trainer=dict(EPOCHS, limit_train_batches=8),
                                   model=dict(val_values=VAL, seconds_per_batch=7.0)),
    # fractional val_check_interval, save_on_train_epoch_end
    "val-every-half-epoch": Case(dict(MONITOR, save_top_k=2, save_last=True),
                                 trainer=dict(EPOCHS, val_check_interval=0.5)),
    "val-every-half-epoch-on-train-epoch-end": Case(dict(MONITOR, save_top_k=2, save_on_train_epoch_end=True),
                                                    trainer=dict(EPOCHS, val_check_interval=0.5)),
    "train-epoch-end-true": Case(dict(MONITOR, save_top_k=2, save_last=True, save_on_train_epoch_end=True)),
    "train-epoch-end-false": Case(dict(MONITOR, save_top_k=2, save_last=True, save_on_train_epoch_end=False)),
    "train-epoch-end-false-no-monitor": Case(dict(save_top_k=-1, save_on_train_epoch_end=False), ckpt_files=4),
    # directories: the logger's, default_root_dir's
    "dirpath-none-csv-logger": Case(dict(MONITOR, save_top_k=2, save_last=True), dirpath=False, logger=True),
    "dirpath-none-no-logger": Case(dict(MONITOR, save_top_k=2, save_last="link"), dirpath=False),
    "dirpath-set-csv-logger": Case(dict(MONITOR, save_top_k=2, save_last=True), logger=True),
    # file names
    "slash-metric-auto-name": Case(dict(monitor="val/loss", save_top_k=2, save_last=True,
                                        filename="{epoch}-{val/loss:.2f}"), model=SLASH),
    "slash-metric-no-auto-name": Case(dict(monitor="val/loss", save_top_k=2, filename="e{epoch:02d}-l{val/loss:.2f}",
                                           auto_insert_metric_name=False), model=SLASH),
    "no-auto-name": Case(dict(MONITOR, save_top_k=-1, filename="{epoch}_{val_loss:.1f}",
                              auto_insert_metric_name=False)),
    # version counter: two fits into one directory
    "refit-version-counter": Case(dict(save_top_k=-1, save_last=True), fits=2, ckpt_files=10),
    "refit-no-version-counter": Case(dict(save_top_k=-1, save_last=True, enable_version_counter=False), fits=2,
                                     ckpt_files=5),
    "refit-monitored-version-counter": Case(dict(MONITOR, save_top_k=2, save_last=True), fits=2),
    "refit-monitored-no-version-counter": Case(dict(MONITOR, save_top_k=2, save_last=True,
                                                    enable_version_counter=False), fits=2),
    "refit-same-callback": Case(dict(MONITOR, save_top_k=2, save_last="link"), fits=2, same_callback=True),
    # weights only
    "weights-only": Case(dict(MONITOR, save_top_k=2, save_last=True, save_weights_only=True)),
    "weights-only-link": Case(dict(save_top_k=-1, save_last="link", save_weights_only=True), ckpt_files=5),
    # manual optimization
    "manual-every-2-steps": Case(dict(every_n_train_steps=2, save_top_k=-1, filename="{step}"),
                                 model=dict(val_values=VAL, manual=True), ckpt_files=8),
    "manual-every-3-steps-pre-step-state": Case(dict(every_n_train_steps=3, save_top_k=-1, save_last=True),
                                                model=dict(val_values=VAL, manual=True, keep_pre_step_state=True)),
    "manual-every-2-steps-monitored-train": Case(dict(monitor="train_metric", every_n_train_steps=2, save_top_k=2),
                                                 model=dict(val_values=VAL, train_values=STEPS, manual=True)),
    # a mocked trainer.save_checkpoint: the calls and the bookkeeping are all there is
    "mocked-save-monitored": Case(dict(MONITOR, save_top_k=2, save_last=True), mock_save=True, ckpt_files=0),
    "mocked-save-no-monitor": Case(dict(save_top_k=-1), mock_save=True, ckpt_files=0),
    "mocked-save-every-3-steps": Case(dict(every_n_train_steps=3, save_top_k=-1), trainer=NO_VAL, mock_save=True,
                                      ckpt_files=0),
    # an exception in fit
    "save-on-exception": Case(dict(MONITOR, save_top_k=2, save_last=True, save_on_exception=True),
                              model=dict(val_values=VAL, raise_at_step=10)),
}


def _observe(cls: type[ModelCheckpoint], case: Case, root: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    kwargs = dict(case.callback, verbose=True)
    if case.dirpath:
        kwargs["dirpath"] = os.path.join(root, "checkpoints")
    side = Side(
        root=root,
        make_callback=lambda: cls(**kwargs),
        trainer_kwargs=case.trainer,
        model_kwargs=case.model,
        fits=case.fits,
        same_callback=case.same_callback,
        logger=case.logger,
        mock_save=case.mock_save,
        guarded=cls is not ModelCheckpoint,
        resume=case.resume,
        later_trainer_kwargs=case.later_trainer,
        last_model_kwargs=case.last_model,
    )
    return observe(side, monkeypatch)


def _ckpt_files(observation: dict[str, Any]) -> list[str]:
    return [path for path in observation["tree"] if path.endswith(".ckpt")]


@pytest.mark.parametrize("case", [pytest.param(case, id=name) for name, case in CASES.items()])
def test_finite_run_is_indistinguishable_from_model_checkpoint(case: Case, tmp_path, monkeypatch):
    plain = _observe(ModelCheckpoint, case, str(tmp_path / "plain"), monkeypatch)
    guarded = _observe(FiniteGradCheckpoint, case, str(tmp_path / "guarded"), monkeypatch)

    # the reference itself: the case exercises what it says
    key = ModelCheckpoint(**case.callback).state_key
    assert plain["state_key"] == key
    if case.ckpt_files is not None:
        assert len(_ckpt_files(plain)) == case.ckpt_files, _ckpt_files(plain)
    assert case.mock_save or case.ckpt_files == 0 or _ckpt_files(plain), "the case writes nothing"
    keys = [] if case.callback.get("save_weights_only") else [key]  # weights-only checkpoints hold no callback state
    for path in _ckpt_files(plain):
        entry = plain["tree"][path]
        if "content" in entry:  # not a link
            assert entry["content"].get("callback_state_keys", []) == keys, path
    if case.mock_save:
        assert plain["mock_calls"], "the mocked save was never called"

    found = differences(plain, guarded)
    assert not found, (
        f"FiniteGradCheckpoint differs from ModelCheckpoint in {len(found)} place(s) (reference first; paths "
        f"relative to {ROOT}):\n" + "\n".join(found)
    )


def _derives_score(base: type[ModelCheckpoint]) -> type[ModelCheckpoint]:
    class DerivesScore(base):  # type: ignore[valid-type,misc]  # ranks a key it adds after ModelCheckpoint's
        def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
            candidates = super()._monitor_candidates(trainer)
            if "val_loss" in candidates:
                candidates["score"] = -candidates["val_loss"]
            return candidates
    return DerivesScore


def _rescales_loss(base: type[ModelCheckpoint]) -> type[ModelCheckpoint]:
    class RescalesLoss(base):  # type: ignore[valid-type,misc]  # ranks the monitored value it changed
        def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
            candidates = super()._monitor_candidates(trainer)
            if "val_loss" in candidates:
                candidates["val_loss"] = 10.0 - candidates["val_loss"]
            return candidates
    return RescalesLoss


def saves_without_super(base: type[ModelCheckpoint]) -> type[ModelCheckpoint]:
    class SavesItself(base):  # type: ignore[valid-type,misc]  # writes as ModelCheckpoint does, not through it
        def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
            trainer.save_checkpoint(filepath, self.save_weights_only)
            self._last_global_step_saved = trainer.global_step
            self._last_checkpoint_saved = filepath
    return SavesItself


SUBCLASSES = {
    "derived-key": (_derives_score, Case(dict(monitor="score", mode="max", save_top_k=2, save_last=True))),
    "rescaled-key": (_rescales_loss, Case(dict(MONITOR, save_top_k=2))),
    "save-without-super": (saves_without_super, Case(dict(MONITOR, save_top_k=2, save_last=True))),
}


@pytest.mark.parametrize("subclass", list(SUBCLASSES))
def test_a_subclass_of_each_class_behaves_alike(subclass, tmp_path, monkeypatch):
    # the top-K vote is the one taken on the value ModelCheckpoint ranks; a subclass's own save agrees and evicts
    derive, case = SUBCLASSES[subclass]
    plain = _observe(derive(ModelCheckpoint), case, str(tmp_path / "plain"), monkeypatch)
    guarded = _observe(derive(FiniteGradCheckpoint), case, str(tmp_path / "guarded"), monkeypatch)
    assert plain["attributes"]["best_k_models"], "the case ranks nothing"
    found = differences(plain, guarded)
    assert not found, "\n".join(found)


def removes_then_writes(base: type[ModelCheckpoint]) -> type[ModelCheckpoint]:
    class RemovesThenWrites(base):  # type: ignore[valid-type,misc]  # clears a name before writing it again
        def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
            if os.path.exists(filepath):
                self._remove_checkpoint(trainer, filepath)
            super()._save_checkpoint(trainer, filepath)
    return RemovesThenWrites


def test_a_subclass_removing_a_name_before_writing_it_again_keeps_the_newest_checkpoint(tmp_path, monkeypatch):
    # one boundary removes the name and writes it anew: the new checkpoint is no eviction, the name keeps it
    case = Case(dict(filename="fixed", save_top_k=-1, enable_version_counter=False, every_n_epochs=1),
                trainer=dict(max_epochs=2, limit_train_batches=2, limit_val_batches=1))
    plain = _observe(removes_then_writes(ModelCheckpoint), case, str(tmp_path / "plain"), monkeypatch)
    guarded = _observe(removes_then_writes(FiniteGradCheckpoint), case, str(tmp_path / "guarded"), monkeypatch)
    fixed = os.path.join("checkpoints", "fixed.ckpt")
    assert _ckpt_files(plain) == [fixed] and plain["tree"][fixed]["content"]["global_step"] == 4, "the reference"
    assert plain["io_removes"] == 1, "the case removes the name once, before the second epoch's write"
    assert _ckpt_files(guarded) == [fixed], guarded["tree"].keys()
    assert guarded["tree"][fixed]["content"]["global_step"] == 4  # the newest checkpoint, not the first epoch's
    # left out: the checkpoint IO's removals. ModelCheckpoint removes the name before writing it; FiniteGradCheckpoint
    # holds the removal until the boundary's writes succeeded, and a name written anew is no eviction
    found = differences({**plain, "io_removes": None, "io_removed": None},
                        {**guarded, "io_removes": None, "io_removed": None})
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------------------------------------- the classes


@pytest.mark.parametrize("eval_str", [False, True], ids=["as-written", "evaluated"])
def test_constructor_annotations_match_model_checkpoint(eval_str):
    # what tools reading the signature see (LightningCLI / jsonargparse, IDEs, docs)
    ours = inspect.signature(FiniteGradCheckpoint, eval_str=eval_str).parameters
    theirs = inspect.signature(ModelCheckpoint, eval_str=eval_str).parameters
    mismatched = {
        name: (parameter.annotation, ours[name].annotation if name in ours else "<missing>")
        for name, parameter in theirs.items()
        if name not in ours or ours[name].annotation != parameter.annotation
    }
    assert not mismatched, "annotation (ModelCheckpoint's, FiniteGradCheckpoint's):\n" + "\n".join(
        f"{name}: {theirs_!r} != {ours_!r}" for name, (theirs_, ours_) in mismatched.items()
    )


def _kind(attribute: Any) -> str:
    for kind in (staticmethod, classmethod, property):
        if isinstance(attribute, kind):
            return kind.__name__
    return "instance method" if inspect.isfunction(attribute) else type(attribute).__name__


def _callable_of(attribute: Any) -> Any:
    if isinstance(attribute, (staticmethod, classmethod)):
        return attribute.__func__
    if isinstance(attribute, property):
        return attribute.fget
    return attribute


def _parameter_mismatch(theirs: Any, ours: Any) -> str | None:
    """None if ``ours`` takes ModelCheckpoint's parameters (names, kinds, defaults, in order) and adds only keyword-only
    parameters with defaults; otherwise what differs."""
    theirs_p = list(inspect.signature(theirs).parameters.values())
    ours_p = list(inspect.signature(ours).parameters.values())
    shape = [(p.name, p.kind, p.default) for p in theirs_p]
    if [(p.name, p.kind, p.default) for p in ours_p[: len(theirs_p)]] != shape:
        return f"parameters {inspect.signature(theirs)} != {inspect.signature(ours)}"
    extra = [p for p in ours_p[len(theirs_p):] if p.kind is not p.KEYWORD_ONLY or p.default is p.empty]
    if extra:
        return f"extra parameters that are not keyword-only with a default: {[p.name for p in extra]}"
    return None


def test_every_model_checkpoint_method_keeps_its_kind_and_parameters():
    mismatched = []
    for name, theirs in vars(ModelCheckpoint).items():
        if not (inspect.isfunction(theirs) or isinstance(theirs, (staticmethod, classmethod, property))):
            continue
        ours = inspect.getattr_static(FiniteGradCheckpoint, name)
        if _kind(ours) != _kind(theirs):
            mismatched.append(f"{name}: {_kind(theirs)} in ModelCheckpoint, {_kind(ours)} in FiniteGradCheckpoint")
            continue
        if isinstance(theirs, property):
            for accessor in ("fget", "fset", "fdel"):
                if (getattr(theirs, accessor) is None) != (getattr(ours, accessor) is None):
                    mismatched.append(f"{name}: property {accessor} differs")
        mismatch = _parameter_mismatch(_callable_of(theirs), _callable_of(ours))
        if mismatch:
            mismatched.append(f"{name}: {mismatch}")
    assert not mismatched, "\n".join(mismatched)


COPIES = {"pickle": lambda cb: pickle.loads(pickle.dumps(cb)), "deepcopy": copy.deepcopy}


CONFIGURATIONS = {
    "defaults": dict(),
    "configured": dict(monitor="val_loss", save_top_k=2, save_last="link", train_time_interval=timedelta(seconds=30)),
}


@pytest.mark.parametrize("configuration", list(CONFIGURATIONS))
@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("cls", [ModelCheckpoint, FiniteGradCheckpoint], ids=lambda cls: cls.__name__)
def test_vars_survive_pickle_and_deepcopy(cls, how, configuration, tmp_path):
    # ModelCheckpoint's own test compares vars() of a callback and of its unpickled copy; tensors by value here.
    # (Not after a fit: Lightning then binds the LightningModule's `log` and `log_dict` onto every callback, and a
    # copied module is never == the original, for ModelCheckpoint as much as for any subclass.)
    callback = cls(dirpath=tmp_path, **CONFIGURATIONS[configuration])
    found = differences(vars(callback), vars(COPIES[how](callback)))
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------- beyond a plain fit (issue 24)
#
# Three ways a Lightning project meets a checkpoint callback outside the plain fit above: a bare Trainer driven by
# hand (Lightning's own unit tests of checkpoint logic), a logger whose call sequence is checked, and a user's own
# ``AsyncCheckpointIO``. Each compares what a user observes against the installed ModelCheckpoint.

#: Lightning's ``test_model_checkpoint_options``: the monitored value of each hand-driven validation end.
BARE_LOSSES = [10.0, 9.0, 2.8, 5.0, 2.5]


def _drive_bare_trainer(cls: type[ModelCheckpoint], root: str, **kwargs: Any) -> dict[str, Any]:
    """A ``Trainer()`` with no LightningModule, its ``save_checkpoint`` a function that creates the file, and the
    callback's ``on_validation_end`` called by hand once per epoch, as Lightning's own tests do."""
    os.makedirs(root)
    callback = cls(dirpath=root, filename="{epoch}", monitor="checkpoint_on", save_on_train_epoch_end=False, **kwargs)
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    trainer.state.fn = TrainerFn.FITTING
    saved: list[str] = []

    def save_checkpoint(filepath: Any, *args: Any) -> None:
        saved.append(os.path.basename(str(filepath)))
        open(filepath, "a").close()

    trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    for i, loss in enumerate(BARE_LOSSES, 1):
        # sets `trainer.global_step`
        trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = i
        trainer.callback_metrics.update({"checkpoint_on": torch.tensor(loss)})
        callback.on_validation_end(trainer, trainer.lightning_module)
        trainer.fit_loop.epoch_progress.current.completed = i  # sets `trainer.current_epoch`
    links = {name: os.readlink(os.path.join(root, name)) for name in os.listdir(root)
             if os.path.islink(os.path.join(root, name))}
    observation = {
        "files": sorted(os.listdir(root)),
        "links": links,
        "saved": saved,
        "attributes": {name: getattr(callback, name, "<missing>") for name in ATTRIBUTES},
        "state_dict": {k: v for k, v in callback.state_dict().items() if k != "ckguard_format_version"},
    }
    return normalize(observation, root)


@pytest.mark.parametrize(
    "kwargs",
    [dict(save_top_k=-1), dict(save_top_k=2, save_last=True), dict(save_top_k=1, save_last="link"),
     dict(save_top_k=3, mode="max"), dict(save_top_k=2, save_last=True, enable_version_counter=False)],
    ids=["all", "top2-last", "top1-link", "top3-max", "top2-last-no-version-counter"],
)
def test_a_bare_trainer_driven_by_hand_saves_and_evicts_as_model_checkpoint(kwargs, tmp_path):
    plain = _drive_bare_trainer(ModelCheckpoint, str(tmp_path / "plain"), **kwargs)
    guarded = _drive_bare_trainer(FiniteGradCheckpoint, str(tmp_path / "guarded"), **kwargs)
    assert plain["saved"], "the case saves nothing"
    found = differences(plain, guarded)
    assert not found, "\n".join(found)


MONITORED_EVERY_3_STEPS = dict(monitor="val_loss", save_top_k=2, save_last=True, every_n_train_steps=3)


def _logger_calls(cls: type[ModelCheckpoint], root: str, model_kwargs: dict[str, Any],
                  trainer_kwargs: dict[str, Any], callback_kwargs: dict[str, Any] = MONITORED_EVERY_3_STEPS
                  ) -> tuple[RecordingLogger, ModelCheckpoint]:
    seed_everything(0, verbose=False)
    logger = RecordingLogger()
    callback = cls(dirpath=root, **callback_kwargs)
    trainer = Trainer(callbacks=[callback], logger=logger, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, default_root_dir=root, **trainer_kwargs)
    trainer.fit(ScriptedModel(**model_kwargs))
    return logger, callback


def _without_guard_metrics(calls: list[tuple[int | None, dict[str, float]]]) -> list[tuple[int | None, Any]]:
    return [(step, {k: v for k, v in metrics.items() if not k.startswith(GUARD_METRIC_PREFIX)})
            for step, metrics in calls]


LOGGED_EVERY_STEP = dict(val_values=VAL, train_values=STEPS)


@pytest.mark.parametrize("log_every_n_steps", [1, 2, 5])
def test_loggers_receive_the_same_calls_at_the_same_steps_with_the_guard_metrics_riding_along(
    log_every_n_steps, tmp_path
):
    trainer_kwargs = dict(EPOCHS, log_every_n_steps=log_every_n_steps)
    plain, _ = _logger_calls(ModelCheckpoint, str(tmp_path / "plain"), LOGGED_EVERY_STEP, trainer_kwargs)
    guarded, callback = _logger_calls(FiniteGradCheckpoint, str(tmp_path / "guarded"), LOGGED_EVERY_STEP,
                                      trainer_kwargs)
    assert plain.calls, "the case logs nothing"
    # the same calls, at the same steps, with the same metrics of Lightning's own
    assert _without_guard_metrics(guarded.calls) == _without_guard_metrics(plain.calls)
    # the guard's values rode in those calls, and the last of them counts every boundary
    riding = [metrics for _, metrics in guarded.calls if "ckguard/accepted" in metrics]
    assert riding
    assert riding[-1]["ckguard/accepted"] == callback._decisions.counts["accepted"] > 0  # type: ignore[attr-defined]


def test_a_guard_metric_with_no_flush_left_is_logged_once_at_the_end(tmp_path):
    """A model that logs nothing gives Lightning nothing to flush: the loggers get no call from ModelCheckpoint,
    and one call from the guard, at the end of the fit, with every value it held (none is dropped)."""
    trainer_kwargs = dict(NO_VAL, log_every_n_steps=1)
    every_3_steps = dict(every_n_train_steps=3, save_top_k=-1, filename="{step}")
    plain, _ = _logger_calls(ModelCheckpoint, str(tmp_path / "plain"), dict(), trainer_kwargs, every_3_steps)
    guarded, callback = _logger_calls(FiniteGradCheckpoint, str(tmp_path / "guarded"), dict(), trainer_kwargs,
                                      every_3_steps)
    assert plain.calls == []
    assert len(os.listdir(tmp_path / "plain")) == 5  # five boundaries, none followed by a flush
    assert len(guarded.calls) == 1
    (_, metrics), = guarded.calls
    assert set(metrics) >= {"ckguard/accepted", "ckguard/rejected", "ckguard/non_finite_steps",
                            "ckguard/skipped_steps"}
    assert metrics["ckguard/accepted"] == callback._decisions.counts["accepted"] > 0  # type: ignore[attr-defined]


def test_steps_judged_when_training_ends_add_no_logger_call(tmp_path):
    """Every 5 of 12 steps: the last two are judged when training ends; accepted there, they add nothing the loggers
    see (``ModelCheckpoint``'s fit makes the same calls, and ``ckguard/accepted`` counts the published checkpoints)."""
    trainer_kwargs = dict(NO_VAL, max_steps=12, log_every_n_steps=1)
    every_5_steps = dict(every_n_train_steps=5, save_top_k=-1, filename="{step}")
    model_kwargs = dict(train_values=STEPS)
    plain, _ = _logger_calls(ModelCheckpoint, str(tmp_path / "plain"), model_kwargs, trainer_kwargs, every_5_steps)
    guarded, callback = _logger_calls(FiniteGradCheckpoint, str(tmp_path / "guarded"), model_kwargs, trainer_kwargs,
                                      every_5_steps)
    assert len(plain.calls) == 12
    assert _without_guard_metrics(guarded.calls) == _without_guard_metrics(plain.calls)
    assert [metrics["ckguard/accepted"] for _, metrics in guarded.calls if "ckguard/accepted" in metrics][-1] == 2


class RecordingAsyncIO(AsyncCheckpointIO):
    """A user's own ``AsyncCheckpointIO`` that records each call of its methods, then does what the plugin does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.calls.append(("save_checkpoint", os.path.basename(str(path)), storage_options,
                           checkpoint["global_step"]))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(("remove_checkpoint", os.path.basename(str(path))))
        super().remove_checkpoint(path)


def _async_plugin_calls(cls: type[ModelCheckpoint], root: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    seed_everything(0, verbose=False)
    plugin = RecordingAsyncIO()
    callback = cls(dirpath=root, filename="{step}", monitor="step", mode="max", every_n_train_steps=2, **kwargs)
    trainer = Trainer(callbacks=[callback], plugins=[plugin], max_steps=8, limit_val_batches=0, **QUIET)
    trainer.fit(ScriptedModel())
    kept = sorted(os.path.basename(path) for path in {*callback.best_k_models, callback.last_model_path} if path)
    if cls is not ModelCheckpoint:
        assert sorted(os.listdir(root)) == kept, "the files on disk are not the ones the ledger lists"
    return normalize({
        "calls": plugin.calls,
        # what the ledger keeps: ModelCheckpoint's own files vary from run to run, as its removal races the write it
        # queued a moment before (a file removed before it exists is written afterwards, and stays)
        "files": kept,
        # the clock is the real one here: the times of two fits differ
        "attributes": {name: getattr(callback, name, "<missing>") for name in ATTRIBUTES
                       if name != "_last_time_checked"},
    }, root)


# (`save_last="link"` is left out: ModelCheckpoint with AsyncCheckpointIO links before the directory exists, and fails)
@pytest.mark.parametrize("kwargs", [dict(save_top_k=2, save_last=True), dict(save_top_k=1)], ids=["top2-last", "top1"])
def test_a_users_own_async_checkpoint_io_is_called_exactly_as_model_checkpoint_calls_it(kwargs, tmp_path):
    plain = _async_plugin_calls(ModelCheckpoint, str(tmp_path / "plain"), kwargs)
    guarded = _async_plugin_calls(FiniteGradCheckpoint, str(tmp_path / "guarded"), kwargs)
    assert [call[0] for call in plain["calls"]].count("remove_checkpoint") >= 2, "the case evicts too little"
    found = differences(plain, guarded)
    assert not found, "\n".join(found)
