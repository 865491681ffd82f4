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
from conformance_helpers import ROOT, Side, differences, observe
from lightning.pytorch.callbacks import ModelCheckpoint

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
