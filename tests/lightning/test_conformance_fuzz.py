"""A differential fuzzer against ``ModelCheckpoint``: random combinations of its arguments, fitted side by side.

Each case draws ``ModelCheckpoint``'s arguments, the Trainer's loop settings and the scripted monitored values (ties
and ``NaN`` among them) from a random generator seeded with the case's number, then does what
``test_conformance.py`` does for its named cases: fits a plain ``ModelCheckpoint`` and a ``FiniteGradCheckpoint`` with
the same arguments into roots of their own and compares everything a user observes (``conformance_helpers.observe``).
Arguments ``ModelCheckpoint`` refuses must be refused alike, with the same error. On finite runs nothing may differ.

The suite runs seeds ``0`` to ``CASES - 1`` (about 0.2 s each). More, from any seed::

    CKGUARD_FUZZ_FIRST=1000 CKGUARD_FUZZ_CASES=2000 python -m pytest -q tests/lightning/test_conformance_fuzz.py

A failing case names its seed (``seed-1234``) and the arguments it drew; ``-k seed-1234`` with the same
``CKGUARD_FUZZ_FIRST`` reruns it.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Any

import pytest
from conformance_helpers import ROOT, differences
from lightning.pytorch.callbacks import ModelCheckpoint
from test_conformance import Case, _observe

from lightning_ckguard import FiniteGradCheckpoint

CASES = int(os.environ.get("CKGUARD_FUZZ_CASES", "120"))
FIRST = int(os.environ.get("CKGUARD_FUZZ_FIRST", "0"))
NAN = float("nan")
#: monitored values: ties (1.0 twice), a NaN, and values either mode ranks differently
VALUES = [3.0, 1.0, 2.0, 0.5, 4.0, 1.0, 0.25, NAN]


def draw(seed: int) -> Case:
    """One case: what a user might pass, valid or not, drawn from ``seed``."""
    rng = random.Random(seed)
    monitor = rng.choice([None, "val_loss", "val_loss", "train_metric"])
    callback: dict[str, Any] = {"save_top_k": rng.choice([-1, 0, 1, 1, 2, 3])}
    if monitor is not None:
        callback.update(monitor=monitor, mode=rng.choice(["min", "max"]))
    callback["save_last"] = rng.choice([None, False, True, "link"])
    trigger = rng.choice(["default", "steps", "epochs", "time"])
    if trigger == "steps":
        callback["every_n_train_steps"] = rng.choice([1, 2, 3, 5])
    elif trigger == "epochs":
        callback["every_n_epochs"] = rng.choice([0, 1, 2])
    elif trigger == "time":
        callback["train_time_interval"] = timedelta(seconds=rng.choice([10, 20, 45]))
    if rng.random() < 0.3:
        callback["save_on_train_epoch_end"] = rng.choice([True, False])
    names = [None, None, "{epoch}-{step}", "{step}", "{epoch}", "best", "last"]
    if monitor is not None:
        names.append("{epoch}-{" + monitor + ":.2f}")
    callback["filename"] = rng.choice(names)
    for name, chance in (("auto_insert_metric_name", 0.3), ("enable_version_counter", 0.3)):
        if rng.random() < chance:
            callback[name] = False
    if rng.random() < 0.2:
        callback["save_weights_only"] = True
    trainer: dict[str, Any] = dict(max_epochs=rng.choice([1, 2, 3, 4]), limit_train_batches=rng.choice([2, 3, 4, 6]),
                                   limit_val_batches=rng.choice([0, 1, 2]))
    if trainer["limit_val_batches"] and rng.random() < 0.3:
        trainer["val_check_interval"] = 0.5
    if rng.random() < 0.2:
        trainer["max_steps"] = rng.choice([3, 5, 7])
    manual = rng.random() < 0.15
    if not manual and rng.random() < 0.2:
        trainer["accumulate_grad_batches"] = 2
    model: dict[str, Any] = dict(val_values=[rng.choice(VALUES) for _ in range(8)],
                                 train_values=[rng.choice(VALUES) for _ in range(16)],
                                 seconds_per_batch=7.0, manual=manual)
    if rng.random() < 0.1:
        model["raise_at_step"] = rng.choice([2, 5])
        callback["save_on_exception"] = rng.random() < 0.7
    fits = rng.choice([1, 1, 1, 2])
    # not "last" where the checkpoint name holds "last" (a `last` link then has its target's time, and Lightning
    # takes either of the two newest: whichever its directory listing gives first, not the same in two roots)
    resumes = [None, "best"] + ([] if "last" in (callback["filename"] or "") else ["last"])
    resume = rng.choice(resumes) if fits == 2 else None
    # "best" needs the callback that knows it (a new one refuses it, alike): mostly the same one, fitted again
    same_callback = fits == 2 and rng.random() < (0.9 if resume == "best" else 0.5)
    # a resumed fit trains on: one or two epochs more, or steps
    later = None
    if resume is not None:
        later = dict(trainer, max_epochs=trainer["max_epochs"] + rng.choice([1, 2]))
        if "max_steps" in later:
            later["max_steps"] += rng.choice([2, 4])
    return Case(callback, trainer=trainer, model=model, dirpath=rng.random() < 0.85, logger=rng.random() < 0.2,
                fits=fits, same_callback=same_callback, resume=resume, later_trainer=later)


def _refusal(cls: type[ModelCheckpoint], kwargs: dict[str, Any]) -> str | None:
    try:
        cls(**kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in range(FIRST, FIRST + CASES)])
def test_a_drawn_finite_run_is_indistinguishable_from_model_checkpoint(seed: int, tmp_path, monkeypatch):
    case = draw(seed)
    refused = _refusal(ModelCheckpoint, case.callback)
    assert _refusal(FiniteGradCheckpoint, case.callback) == refused, f"seed {seed}: {case}"
    if refused is not None:
        return
    plain = _observe(ModelCheckpoint, case, str(tmp_path / "plain"), monkeypatch)
    guarded = _observe(FiniteGradCheckpoint, case, str(tmp_path / "guarded"), monkeypatch)
    deviation = _documented_deviation(plain, guarded)
    if deviation == _DROPPED_ENTRIES:
        # from there on the top-K choices may differ; what the guard promises instead must hold
        _assert_the_guards_ledger_is_on_disk(guarded, f"seed {seed} ({deviation}): {case}")
        return
    if deviation == _KEPT:
        # the same in every other way: only the file stays, which ModelCheckpoint removed
        kept = set(plain["resumed_from"]) & set(plain["io_removed"])
        plain, guarded = ({**side, "io_removes": None, "io_removed": None} for side in (plain, guarded))
        guarded["tree"] = {path: _as_if_removed(path, entry, kept) for path, entry in guarded["tree"].items()
                           if os.path.join(ROOT, path) not in kept}
    found = differences(plain, guarded)
    assert not found, (
        f"seed {seed}: {case}\nFiniteGradCheckpoint differs from ModelCheckpoint in {len(found)} place(s) (reference "
        f"first; paths relative to {ROOT}):\n" + "\n".join(found)
    )


def _as_if_removed(path: str, entry: dict[str, Any], kept: set[str]) -> dict[str, Any]:
    """A tree entry as it would be had ``kept`` been removed: a link to one of them dangles (and stays: a dangling
    link's removal removes nothing)."""
    if "link" not in entry:
        return entry
    target = os.path.normpath(os.path.join(os.path.dirname(os.path.join(ROOT, path)), entry["link"]))
    return {**entry, "resolves": entry["resolves"] and target not in kept}


#: How the guard's warning that it dropped ledger entries at a resume begins (``drop_missing_checkpoints``).
_DROPPED = "UserWarning: FiniteGradCheckpoint dropped"


def _documented_deviation(plain: dict[str, Any], guarded: dict[str, Any]) -> str | None:
    """Which of the guard's two documented differences from ``ModelCheckpoint`` on a resumed fit this case met, if
    any: ``ModelCheckpoint`` evicted the checkpoint its fit resumed from (the guard keeps it: nothing a fit resumed
    from is deleted), or the resumed state listed checkpoints gone from disk (the guard drops them, with a warning,
    where ``ModelCheckpoint`` keeps them in its top K)."""
    if any(warning.startswith(_DROPPED) for warning in guarded["warnings"]):
        return _DROPPED_ENTRIES
    if {path for path in plain["resumed_from"] if path} & set(plain["io_removed"]):
        return _KEPT
    return None


_KEPT = "ModelCheckpoint evicted the checkpoint it resumed from"
_DROPPED_ENTRIES = "the resumed state listed checkpoints gone from disk"


def _assert_the_guards_ledger_is_on_disk(guarded: dict[str, Any], where: str) -> None:
    """Every checkpoint the guard's ledger lists, and every checkpoint a fit resumed from, is on disk (a ``last``
    link resolving)."""
    def on_disk(path: str) -> bool:
        entry = guarded["tree"].get(os.path.relpath(path, ROOT))
        return entry is not None and entry.get("resolves", True)

    state = guarded["state_dict"]
    listed = [*state["best_k_models"], state["best_model_path"], state["last_model_path"]]
    resumed = [path for path in guarded["resumed_from"] if path]
    missing = [path for path in [*listed, *resumed] if path and not on_disk(path)]
    assert not missing, f"{where}\nlisted or resumed from, not on disk: {missing}"
