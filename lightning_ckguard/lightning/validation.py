"""Argument checks at construction (a clear ``ValueError`` that names the argument), and the check at setup that
``dirpath`` can be written to."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from numbers import Integral  # numpy's integers too, as ModelCheckpoint takes them
from typing import Any

from lightning_ckguard.agree.spikes import SpikeGate
from lightning_ckguard.recover.policy import POLICIES


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_type(name: str, value: Any, expected: tuple[type, ...], description: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    # bool is an integer; an int argument given True/False is almost certainly a mistake
    if bool not in expected and isinstance(value, bool):
        raise ValueError(f"`{name}` must be {description}, got {_describe(value)}.")
    if not isinstance(value, expected):
        raise ValueError(f"`{name}` must be {description}, got {_describe(value)}.")


def validate_arguments(arguments: dict[str, Any]) -> None:
    """Check the types of every ``FiniteGradCheckpoint`` argument. Value ranges that ``ModelCheckpoint`` itself
    checks are left to it, so its errors stay exactly the same."""
    policy = arguments["on_non_finite"]
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"`on_non_finite` must be one of {', '.join(map(repr, POLICIES))}, got {_describe(policy)}.")
    _check_rewind_arguments(arguments)
    for flag in ("count_skipped_steps", "durable", "verbose", "save_on_exception", "save_weights_only",
                 "auto_insert_metric_name", "enable_version_counter"):
        _check_type(flag, arguments[flag], (bool,), "a bool")
    _check_type("save_on_train_epoch_end", arguments["save_on_train_epoch_end"], (bool,), "a bool or None", True)
    _check_type("dirpath", arguments["dirpath"], (str, os.PathLike), "a path or None", True)
    dirpath = arguments["dirpath"]
    if dirpath is not None and os.path.isfile(dirpath):
        raise ValueError(f"`dirpath` must be a directory, but {os.fspath(dirpath)!r} is an existing file.")
    for text in ("filename", "monitor"):
        _check_type(text, arguments[text], (str,), "a str or None", True)
    _check_type("mode", arguments["mode"], (str,), "'min' or 'max'")
    save_last = arguments["save_last"]
    if not (save_last is None or isinstance(save_last, bool) or save_last == "link"):
        raise ValueError(f"`save_last` must be None, True, False or 'link', got {_describe(save_last)}.")
    _check_type("save_top_k", arguments["save_top_k"], (Integral,), "an int")
    for count in ("every_n_train_steps", "every_n_epochs"):
        _check_type(count, arguments[count], (Integral,), "an int or None", True)
    _check_type("train_time_interval", arguments["train_time_interval"], (timedelta,), "a datetime.timedelta or None",
                True)
    _check_type("spike_gate", arguments["spike_gate"], (SpikeGate,), "a lightning_ckguard.SpikeGate or None", True)


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
    if policy == "rewind" and arguments["save_weights_only"] is True:
        raise ValueError(
            "`on_non_finite='rewind'` restores the optimizer state from the last published checkpoint, but "
            "`save_weights_only=True` leaves it out of the files: use `save_weights_only=False` to rewind."
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
