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

The multiprocess test fits ``CKGUARD_FUZZ_DDP_CASES`` (120) of the same cases under DDP on 2 ranks, in one process
group (``workers/conformance_fuzz_worker.py``): rank 0's observations (it logs, writes and removes) must match
``ModelCheckpoint``'s as above, and every rank must end each fit with the same error and the same callback state.

``test_a_drawn_run_with_a_nan_publishes_nothing_from_the_nan_on`` fits the guard alone on the same cases with a
``NaN`` gradient in one step of the last fit (on rank 1 alone in the multiprocess test): from that step on nothing it
published changes, and the fit raises ``NonFiniteGradientError`` (or the case's own scripted failure first).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from conformance_helpers import ROOT, differences
from lightning.pytorch.callbacks import ModelCheckpoint
from test_conformance import Case, _observe

from conftest import OUT
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


def _drawn(seed: int, trainer_extra: dict[str, Any] | None) -> Case:
    """Case ``seed``, with ``trainer_extra`` added to every fit's Trainer arguments."""
    case = draw(seed)
    if not trainer_extra:
        return case
    later = case.later_trainer and {**case.later_trainer, **trainer_extra}
    return dataclasses.replace(case, trainer={**case.trainer, **trainer_extra}, later_trainer=later)


def _refusal(cls: type[ModelCheckpoint], kwargs: dict[str, Any]) -> str | None:
    try:
        cls(**kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


@dataclass
class Compared:
    """One drawn case, fitted both ways."""

    case: Case
    #: where the guard differs from ``ModelCheckpoint`` beyond its documented differences (empty: it does not)
    differences: list[str]
    #: per side (``"plain"``, ``"guarded"``): each fit's error and the callback's state at the end, as text; every rank
    #: of a fit must end with the same (under DDP; a refused case has none)
    ends: dict[str, dict[str, Any]]


def compared(seed: int, root: str, monkeypatch: Any, trainer_extra: dict[str, Any] | None = None) -> Compared:
    """Draw case ``seed``, fit ``ModelCheckpoint`` and ``FiniteGradCheckpoint`` side by side under ``root`` (with
    ``trainer_extra`` added to every Trainer's arguments) and compare what a user observes."""
    case = _drawn(seed, trainer_extra)
    refused, refused_here = _refusal(ModelCheckpoint, case.callback), _refusal(FiniteGradCheckpoint, case.callback)
    if refused is not None or refused_here is not None:
        return Compared(case, [] if refused_here == refused else [f"refused: {refused}, here {refused_here}"], {})
    plain = _observe(ModelCheckpoint, case, os.path.join(root, "plain"), monkeypatch)
    guarded = _observe(FiniteGradCheckpoint, case, os.path.join(root, "guarded"), monkeypatch)
    ends = {name: {"errors": side["errors"], "state": repr(side["state_dict"])}
            for name, side in (("plain", plain), ("guarded", guarded))}
    deviation = _documented_deviation(plain, guarded)
    if deviation == _DROPPED_ENTRIES:
        # from there on the top-K choices may differ; what the guard promises instead must hold
        missing = _missing_from_disk(guarded)
        return Compared(case, [f"({deviation}) listed or resumed from, not on disk: {path}" for path in missing], ends)
    if deviation == _KEPT:
        # the same in every other way: only the file stays, which ModelCheckpoint removed
        kept = _evicted_resumed_from(plain)
        plain, guarded = ({**side, "io_removes": None, "io_removed": None} for side in (plain, guarded))
        guarded["tree"] = {path: _as_if_removed(path, entry, kept) for path, entry in guarded["tree"].items()
                           if os.path.join(ROOT, path) not in kept}
    return Compared(case, differences(plain, guarded), ends)


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in range(FIRST, FIRST + CASES)])
def test_a_drawn_finite_run_is_indistinguishable_from_model_checkpoint(seed: int, tmp_path, monkeypatch):
    outcome = compared(seed, str(tmp_path), monkeypatch)
    assert not outcome.differences, (
        f"seed {seed}: {outcome.case}\nFiniteGradCheckpoint differs from ModelCheckpoint in "
        f"{len(outcome.differences)} place(s) (reference first; paths relative to {ROOT}):\n"
        + "\n".join(outcome.differences)
    )


@dataclass
class Rejected:
    """One drawn case fitted with ``FiniteGradCheckpoint`` alone and a ``NaN`` gradient in its last fit."""

    case: Case
    nan_at_step: int
    #: what the callback had published right before the NaN (None: the fit never reached that step)
    before: dict[str, Any] | None
    #: what it had published at the end, as ``before``
    after: dict[str, Any] | None
    #: how the last fit ended (None: normally)
    error: str | None


def rejected(seed: int, root: str, monkeypatch: Any, trainer_extra: dict[str, Any] | None = None,
             nan_ranks: tuple[int, ...] = (0,)) -> Rejected | None:
    """Draw case ``seed`` (None where ``ModelCheckpoint`` refuses its arguments), put a ``NaN`` gradient into one
    step of its last fit on ``nan_ranks``, and fit ``FiniteGradCheckpoint`` (``on_non_finite="raise"``)."""
    case = _drawn(seed, trainer_extra)
    if _refusal(ModelCheckpoint, case.callback) is not None:
        return None
    loop = case.later_trainer or case.trainer
    steps = min(loop.get("max_steps") or 10**6, loop["max_epochs"] * loop["limit_train_batches"])
    nan_at_step = random.Random(f"nan {seed}").randrange(steps)
    case = dataclasses.replace(case, last_model=dict(nan_at_step=nan_at_step, nan_ranks=nan_ranks))
    seen = _observe(FiniteGradCheckpoint, case, root, monkeypatch)
    return Rejected(case, nan_at_step, seen["before_nan"], seen["published"], seen["errors"][-1])


def what_the_rejection_changed(outcome: Rejected) -> list[str]:
    """Where a run with a ``NaN`` breaks the guard's promise: from the step of the ``NaN`` on, nothing it published
    changes (files, links, ledger: the fit's next saving boundary is rejected, and so is a save at an exception), and
    the fit does not end normally (the ``NaN`` is judged at the latest when training ends). ``ModelCheckpoint``'s
    ``_defer_save_until_validation`` is left out: a step boundary that saves nothing (before validation) sets it,
    and a rejection leaves it as that boundary did."""
    if outcome.before is None:
        return []
    before, after = ({**published, "ledger": {**published["ledger"], "defer_save_until_validation": None}}
                     for published in (outcome.before, outcome.after))
    found = differences(before, after)
    scripted = outcome.case.model.get("raise_at_step") is not None and (outcome.error or "").startswith(
        "RuntimeError: scripted failure")
    if not (outcome.error or "").startswith("NonFiniteGradientError") and not scripted:
        found.append(f"the fit ended with {outcome.error!r}, not a NonFiniteGradientError")
    return found


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed-{seed}") for seed in range(FIRST, FIRST + CASES)])
def test_a_drawn_run_with_a_nan_publishes_nothing_from_the_nan_on(seed: int, tmp_path, monkeypatch):
    outcome = rejected(seed, str(tmp_path), monkeypatch)
    found = [] if outcome is None else what_the_rejection_changed(outcome)
    assert not found, f"seed {seed}, NaN at step {outcome.nan_at_step}: {outcome.case}\n" + "\n".join(found)


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
    if _evicted_resumed_from(plain):
        return _KEPT
    return None


def _evicted_resumed_from(plain: dict[str, Any]) -> set[str]:
    """The checkpoints ``ModelCheckpoint``'s fits resumed from that its checkpoint IO then removed."""
    return {path for path in plain["resumed_from"] if path} & set(plain["io_removed"])


_KEPT = "ModelCheckpoint evicted the checkpoint it resumed from"
_DROPPED_ENTRIES = "the resumed state listed checkpoints gone from disk"


def _missing_from_disk(guarded: dict[str, Any]) -> list[str]:
    """What the guard's ledger lists, or a fit resumed from, that is not on disk (a ``last`` link must resolve)."""
    def on_disk(path: str) -> bool:
        entry = guarded["tree"].get(os.path.relpath(path, ROOT))
        return entry is not None and entry.get("resolves", True)

    state = guarded["state_dict"]
    listed = [*state["best_k_models"], state["best_model_path"], state["last_model_path"]]
    resumed = [path for path in guarded["resumed_from"] if path]
    return [path for path in [*listed, *resumed] if path and not on_disk(path)]


#: Seeds fitted under DDP on 2 ranks (about 0.3 s each): ``CKGUARD_FUZZ_DDP_CASES``, from ``CKGUARD_FUZZ_FIRST``.
DDP_CASES = int(os.environ.get("CKGUARD_FUZZ_DDP_CASES", "120"))


@pytest.mark.multiprocess
def test_drawn_runs_under_ddp_are_indistinguishable_from_model_checkpoint_and_end_alike_on_every_rank(worker_results):
    launch = worker_results("workers/conformance_fuzz_worker.py", [OUT, str(FIRST), str(DDP_CASES)],
                            timeout=120 + 3 * DDP_CASES)
    first, second = ({name: result for name, result in rank.items() if name != "process-group"}
                     for rank in launch.ranks)
    assert list(first) == list(second) == [f"seed-{seed}" for seed in range(FIRST, FIRST + DDP_CASES)]
    found = [f"{seed}: {result['case']}\n" + "\n".join(result["differences"])
             for seed, result in first.items() if result["differences"]]
    assert not found, "FiniteGradCheckpoint differs from ModelCheckpoint under DDP (rank 0):\n" + "\n".join(found)
    for seed in first:
        assert first[seed]["ends"] == second[seed]["ends"], f"{seed}: the ranks ended differently"
    assert sum(bool(result["ends"]) for result in first.values()) >= DDP_CASES // 2  # most cases are fitted
    # with a NaN on rank 1 alone: nothing published from it on, as each rank sees it, and every rank ends alike
    for seed in first:
        nan, nan_on_1 = first[seed]["nan"], second[seed]["nan"]
        assert (nan and nan["changed"], nan_on_1 and nan_on_1["changed"]) in ((None, None), ([], [])), (
            f"{seed}, NaN on rank 1 at step {nan['step']}: {first[seed]['case']}\nrank 0: {nan['changed']}\n"
            f"rank 1: {nan_on_1['changed']}")
        assert nan == nan_on_1, f"{seed}: the ranks ended differently"
    assert sum(bool(result["nan"] and result["nan"]["reached"]) for result in first.values()) >= DDP_CASES // 2
