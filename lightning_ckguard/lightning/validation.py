"""Argument checks at construction (a clear ``ValueError`` that names the argument), and the check at setup that
``dirpath`` can be written to."""

from __future__ import annotations

import math
import os
import sys
import tempfile
from datetime import timedelta
from numbers import Integral, Real  # numpy's integers and floats too, as ModelCheckpoint takes them
from typing import Any

from lightning_ckguard.agree.spikes import SpikeGate
from lightning_ckguard.recover.policy import POLICIES


def _describe(value: Any) -> str:
    kind = type(value)
    module = kind.__module__.split(".")[0]  # numpy's `bool` is not Python's: say whose it is
    return f"{value!r} ({kind.__name__ if module == 'builtins' else f'{module}.{kind.__name__}'})"


def _is_flag(value: Any) -> bool:
    """Whether ``ModelCheckpoint`` reads ``value`` as the flag it means: a bool, numpy's bool, or an integer 0 or 1."""
    if isinstance(value, Integral):  # bool and numpy's integers included
        return value in (0, 1)
    numpy = sys.modules.get("numpy")  # without numpy imported, nothing is numpy's bool
    return numpy is not None and isinstance(value, numpy.bool_)


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a whole number ``ModelCheckpoint`` counts with as with an int: an integer that is not a
    bool, or a float with an integral value (``2.0``; ``ModelCheckpoint`` fits with it exactly as with ``2``)."""
    if isinstance(value, Integral):  # numpy's bool is neither Integral nor Real
        return not isinstance(value, bool)
    return isinstance(value, Real) and math.isfinite(value) and float(value).is_integer()


def _check_type(name: str, value: Any, expected: tuple[type, ...], description: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    # bool is an integer; an int argument given True/False is almost certainly a mistake
    if bool not in expected and isinstance(value, bool):
        raise ValueError(f"`{name}` must be {description}, got {_describe(value)}.")
    if not isinstance(value, expected):
        raise ValueError(f"`{name}` must be {description}, got {_describe(value)}.")


#: ``ModelCheckpoint``'s flags, taken as it reads them: a bool, numpy's bool, or an integer 0 or 1.
_FLAGS = ("verbose", "save_on_exception", "save_weights_only", "auto_insert_metric_name", "enable_version_counter")


def validate_arguments(arguments: dict[str, Any]) -> None:
    """Check the types of every ``FiniteGradCheckpoint`` argument. ``ModelCheckpoint``'s own arguments are taken
    wherever it takes them and fits with them alike (``save_last=1``, ``verbose=np.True_``, ``every_n_epochs=2.0``),
    and passed on as given; value ranges that it checks itself are left to it, so its errors stay exactly the same.
    The guard's own options are strict."""
    policy = arguments["on_non_finite"]
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"`on_non_finite` must be one of {', '.join(map(repr, POLICIES))}, got {_describe(policy)}.")
    for flag in ("count_skipped_steps", "durable"):
        _check_type(flag, arguments[flag], (bool,), "a bool")
    _check_model_checkpoint_flags(arguments)
    _check_rewind_arguments(arguments)
    _check_type("dirpath", arguments["dirpath"], (str, os.PathLike), "a path or None", True)
    dirpath = arguments["dirpath"]
    if dirpath is not None and os.path.isfile(dirpath):
        raise ValueError(f"`dirpath` must be a directory, but {os.fspath(dirpath)!r} is an existing file.")
    for text in ("filename", "monitor"):
        _check_type(text, arguments[text], (str,), "a str or None", True)
    _check_type("mode", arguments["mode"], (str,), "'min' or 'max'")
    _check_count("save_top_k", arguments["save_top_k"], "an int")
    for count in ("every_n_train_steps", "every_n_epochs"):
        _check_count(count, arguments[count], "an int or None", optional=True)
    _check_type("train_time_interval", arguments["train_time_interval"], (timedelta,), "a datetime.timedelta or None",
                True)
    _check_type("spike_gate", arguments["spike_gate"], (SpikeGate,), "a lightning_ckguard.SpikeGate or None", True)


def _check_model_checkpoint_flags(arguments: dict[str, Any]) -> None:
    """``ModelCheckpoint``'s flags (and ``save_last``, also ``"link"``; ``save_on_train_epoch_end``, also None)."""
    for flag in _FLAGS:
        if not _is_flag(arguments[flag]):
            raise ValueError(f"`{flag}` must be a bool, got {_describe(arguments[flag])}.")
    on_epoch_end = arguments["save_on_train_epoch_end"]
    if not (on_epoch_end is None or _is_flag(on_epoch_end)):
        raise ValueError(f"`save_on_train_epoch_end` must be a bool or None, got {_describe(on_epoch_end)}.")
    save_last = arguments["save_last"]
    if not (save_last is None or (isinstance(save_last, str) and save_last == "link") or _is_flag(save_last)):
        raise ValueError(f"`save_last` must be None, True, False or 'link', got {_describe(save_last)}.")


def _check_count(name: str, value: Any, description: str, optional: bool = False) -> None:
    if not ((optional and value is None) or _is_count(value)):
        raise ValueError(f"`{name}` must be {description}, got {_describe(value)}.")


def _check_rewind_arguments(arguments: dict[str, Any]) -> None:
    """``max_rewinds`` belongs to ``on_non_finite="rewind"``, and a rewind needs the optimizer state in the file."""
    policy, max_rewinds = arguments["on_non_finite"], arguments["max_rewinds"]
    if max_rewinds is not None and policy != "rewind":
        raise ValueError(
            f"`max_rewinds` is only used with `on_non_finite='rewind'`, but `on_non_finite={policy!r}`: "
            "drop `max_rewinds` or choose the 'rewind' policy."
        )
    _check_type("max_rewinds", max_rewinds, (Integral,), "an int >= 0 or None", True)
    if max_rewinds is not None and max_rewinds < 0:
        raise ValueError(f"`max_rewinds` must be an int >= 0 or None, got {_describe(max_rewinds)}.")
    if policy == "rewind" and arguments["save_weights_only"]:  # a flag by now: True, numpy's True or 1
        raise ValueError(
            "`on_non_finite='rewind'` restores the optimizer state from the last published checkpoint, but "
            f"`save_weights_only={arguments['save_weights_only']!r}` leaves it out of the files: use "
            "`save_weights_only=False` to rewind."
        )


def unwritable_dirpath_error(dirpath: str, rank: int, global_step: int) -> PermissionError | None:
    """Try to create, and remove, an entry where checkpoints will go: in ``dirpath`` if it exists, otherwise in its
    nearest existing ancestor, where the missing directories would be created. Returns the error to raise, if any.

    A real attempt rather than ``os.access``, which says yes to root (tests, containers) whatever the filesystem
    allows, and which cannot see read-only mounts or immutable directories.
    """
    target = os.path.abspath(dirpath)
    while not os.path.exists(target) and os.path.dirname(target) != target:
        target = os.path.dirname(target)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ckguard-probe-", dir=target))
    except OSError as error:
        return PermissionError(
            f"FiniteGradCheckpoint cannot write checkpoints to dirpath {dirpath!r} (rank {rank}, at global step "
            f"{global_step}, before training starts): creating an entry in {target!r} failed: "
            f"{error.strerror or error}."
        )
    return None


#: The arguments ``ModelCheckpoint`` takes, passed on as given.
MODEL_CHECKPOINT_ARGUMENTS = (
    "dirpath", "filename", "monitor", "verbose", "save_last", "save_top_k", "save_on_exception", "save_weights_only",
    "mode", "auto_insert_metric_name", "every_n_train_steps", "train_time_interval", "every_n_epochs",
    "save_on_train_epoch_end", "enable_version_counter",
)


#: Version of the callback state this release writes; states without one are ``ModelCheckpoint``'s format (version 1).
STATE_FORMAT_VERSION = 1
_FORMAT_KEY = "ckguard_format_version"


def with_format_version(state: dict[str, Any]) -> dict[str, Any]:
    """``ModelCheckpoint``'s state with the format version of this release."""
    return {**state, _FORMAT_KEY: STATE_FORMAT_VERSION}


def without_format_version(state: dict[str, Any]) -> dict[str, Any]:
    """``ModelCheckpoint``'s state from a state this or an earlier release wrote (or a plain ``ModelCheckpoint``).

    Raises:
        ValueError: If the state comes from a newer, unknown format: loading it could silently drop bookkeeping.
    """
    version = state.get(_FORMAT_KEY, 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= STATE_FORMAT_VERSION:
        raise ValueError(
            f"The checkpoint's FiniteGradCheckpoint state has format version {version!r}, but this "
            f"lightning_ckguard reads versions 1 to {STATE_FORMAT_VERSION}. It was written by a newer release: "
            "upgrade lightning_ckguard to resume from it."
        )
    return {key: value for key, value in state.items() if key != _FORMAT_KEY}
