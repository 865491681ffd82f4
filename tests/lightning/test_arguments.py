"""Construction: the same arguments as ModelCheckpoint, clear ValueErrors for bad ones."""

import inspect
import os
from datetime import timedelta

import numpy as np
import pytest
import torch
from conformance_helpers import ScriptedModel
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import QUIET
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.ledger import TRACKED_ATTRIBUTES


def test_accepts_every_model_checkpoint_argument_with_the_same_default():
    ours = inspect.signature(FiniteGradCheckpoint.__init__).parameters
    theirs = inspect.signature(ModelCheckpoint.__init__).parameters
    for name, parameter in theirs.items():
        assert name in ours, f"missing ModelCheckpoint argument {name!r}"
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name
    assert list(ours)[: len(theirs)] == list(theirs), "positional order must match ModelCheckpoint"
    assert ours["on_non_finite"].default == "raise"
    assert ours["count_skipped_steps"].default is False


def test_configuration_matches_model_checkpoint(tmp_path):
    kwargs = dict(dirpath=tmp_path, filename="{epoch}", monitor="val_loss", save_top_k=3, save_last="link",
                  mode="max", every_n_train_steps=5)
    ours, theirs = FiniteGradCheckpoint(**kwargs), ModelCheckpoint(**kwargs)
    # ModelCheckpoint's state, plus the format version of ours
    assert ours.state_dict().keys() == theirs.state_dict().keys() | {"ckguard_format_version"}
    for attribute in ("dirpath", "filename", "monitor", "save_top_k", "save_last", "mode", "_every_n_train_steps",
                      "_every_n_epochs", "_train_time_interval", "kth_value"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute


def test_ledger_tracks_every_piece_of_model_checkpoint_state():
    configuration = {
        "monitor", "verbose", "save_last", "save_top_k", "save_on_exception", "save_weights_only",
        "auto_insert_metric_name", "_save_on_train_epoch_end", "_enable_version_counter", "mode", "dirpath",
        "filename", "_fs", "_train_time_interval", "_every_n_epochs", "_every_n_train_steps",
    }
    state = set(vars(ModelCheckpoint())) - configuration
    # a new Lightning version that adds bookkeeping must be added to the ledger, or rejections would leak it
    assert state == set(TRACKED_ATTRIBUTES)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(on_non_finite="ignore"), "on_non_finite"),
        (dict(on_non_finite=None), "on_non_finite"),
        (dict(count_skipped_steps="yes"), "count_skipped_steps"),
        (dict(save_top_k="3"), "save_top_k"),
        (dict(save_top_k=True), "save_top_k"),
        (dict(every_n_train_steps=2.5), "every_n_train_steps"),
        (dict(every_n_epochs="1"), "every_n_epochs"),
        (dict(every_n_epochs=float("inf")), "every_n_epochs"),
        (dict(save_top_k=-1.5), "save_top_k"),
        (dict(train_time_interval=60), "train_time_interval"),
        (dict(save_last="always"), "save_last"),
        (dict(save_last=2), "save_last"),
        (dict(monitor=3), "monitor"),
        (dict(filename=b"x"), "filename"),
        (dict(dirpath=5), "dirpath"),
        (dict(mode=1), "mode"),
        (dict(verbose=2), "verbose"),
        (dict(save_weights_only=np.int64(-1)), "save_weights_only"),
        (dict(save_on_train_epoch_end="no"), "save_on_train_epoch_end"),
        (dict(save_on_train_epoch_end=2), "save_on_train_epoch_end"),
        (dict(enable_version_counter=None), "enable_version_counter"),
        # the guard's own options stay strict
        (dict(count_skipped_steps=1), "count_skipped_steps"),
        (dict(durable=np.True_), "durable"),
        (dict(on_non_finite="rewind", max_rewinds=2.0), "max_rewinds"),
        (dict(on_non_finite="rewind", save_weights_only=1), "on_non_finite='rewind'"),
        (dict(on_non_finite="rewind", save_weights_only=np.True_), "on_non_finite='rewind'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`"):
        FiniteGradCheckpoint(**kwargs)


def test_valid_arguments_are_accepted(tmp_path):
    timed = FiniteGradCheckpoint(dirpath=str(tmp_path), train_time_interval=timedelta(minutes=5), save_last=True,
                                 on_non_finite="stop", count_skipped_steps=True)
    assert (timed.dirpath, timed.save_last, timed.on_non_finite, timed.count_skipped_steps) == (
        str(tmp_path), True, "stop", True)
    assert timed._train_time_interval == timedelta(minutes=5)
    linked = FiniteGradCheckpoint(save_last="link", on_non_finite="skip", save_on_train_epoch_end=False)
    assert (linked.save_last, linked.on_non_finite, linked._save_on_train_epoch_end) == ("link", "skip", False)
    assert linked.max_rewinds is None


def test_numpy_integers_are_taken_as_model_checkpoint_takes_them(tmp_path):
    # a sweep or a grid config often yields numpy integers
    kwargs = dict(monitor="val_loss", save_top_k=np.int64(2), every_n_epochs=np.int32(2))
    ours, theirs = FiniteGradCheckpoint(**kwargs), ModelCheckpoint(**kwargs)
    assert (ours.save_top_k, ours._every_n_epochs) == (theirs.save_top_k, theirs._every_n_epochs) == (2, 2)
    assert FiniteGradCheckpoint(on_non_finite="rewind", max_rewinds=np.int64(3)).max_rewinds == 3
    with pytest.raises(ValueError, match="`save_top_k`"):
        FiniteGradCheckpoint(save_top_k=np.bool_(True))


def test_a_numpy_bool_is_named_as_numpy_s_in_the_error():
    with pytest.raises(ValueError, match=r"`count_skipped_steps` must be a bool, got np.True_ \(numpy.bool_?\)"):
        FiniteGradCheckpoint(count_skipped_steps=np.True_)


VAL = [3.0, 1.0, 2.0, 0.5, 4.0, 0.25, 1.5, 0.75]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(verbose=1, save_last=1, save_weights_only=0, monitor="val_loss", save_top_k=2),
        dict(verbose=np.True_, save_last=np.True_, enable_version_counter=np.True_, monitor="val_loss"),
        dict(save_last=0, save_weights_only=1, auto_insert_metric_name=0, save_on_exception=np.False_, save_top_k=-1),
        dict(save_on_train_epoch_end=0, monitor="val_loss", save_last="link"),
        dict(every_n_epochs=2.0, save_top_k=-1.0),
        dict(every_n_train_steps=3.0, save_top_k=np.float64(2.0), monitor="val_loss"),
    ],
    ids=["ints-as-flags", "numpy-bools", "ints-weights-only", "int-epoch-end", "float-epochs", "float-steps"],
)
def test_values_model_checkpoint_fits_with_are_taken_and_fit_alike(tmp_path, kwargs):
    # 0/1 and numpy bools for its flags, integral floats for its counts: a config file or a sweep yields them
    published = {}
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        root = tmp_path / cls.__name__
        seed_everything(0)
        callback = cls(dirpath=root, **kwargs)
        trainer = Trainer(callbacks=[callback], max_epochs=4, limit_train_batches=4, limit_val_batches=2,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(ScriptedModel(val_values=VAL))
        files = sorted(os.listdir(root))
        weights_only = ["optimizer_states" not in torch.load(root / name, weights_only=False) for name in files]
        links = {name: os.readlink(root / name) for name in files if os.path.islink(root / name)}
        published[cls] = files, weights_only, links, os.path.basename(callback.best_model_path)
    assert published[FiniteGradCheckpoint] == published[ModelCheckpoint]
    assert published[ModelCheckpoint][0], "the case must publish something"
