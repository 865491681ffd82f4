"""Construction: the same arguments as ModelCheckpoint, clear ValueErrors for bad ones."""

import inspect
from datetime import timedelta

import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

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
        (dict(train_time_interval=60), "train_time_interval"),
        (dict(save_last="always"), "save_last"),
        (dict(monitor=3), "monitor"),
        (dict(filename=b"x"), "filename"),
        (dict(dirpath=5), "dirpath"),
        (dict(mode=1), "mode"),
        (dict(verbose=1), "verbose"),
        (dict(save_on_train_epoch_end="no"), "save_on_train_epoch_end"),
        (dict(enable_version_counter=None), "enable_version_counter"),
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
