"""Paths where one rank could leave a collective early, run by ``tests/agree/test_early_exit.py`` as

    python early_exit_worker.py OUT_DIR

Two ranks (gloo, CPU) in one process group whose timeout is ``TIMEOUT`` (``DDPStrategy(timeout=...)``), so a rank
left waiting in a collective fails after it instead of hanging. The scenarios run in this order:

- ``missing-after-validation``: the monitored ``val_metric`` is logged on rank 0 only (``rank_zero_only=True``, the
  documented way to make a metric unusable as a monitor); validation has run, so every rank must raise;
- ``missing-in-training``: the monitored ``train_metric`` is logged on rank 0 only and no validation runs, so every
  rank warns, saves nothing, and the fit completes;
- ``straggler``: rank 1 stalls before a boundary for longer than the timeout; rank 0's agreement must fail after
  the strategy's timeout (the process group breaks here, so this one runs last).

Each rank rewrites ``OUT_DIR/rank{N}.json`` after every scenario.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, ledger_state, run_scenarios, tree_digest  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=20)
STALL_STEP = 2


class RankZeroMetric(BoringModel):
    """Logs ``train_metric`` and ``val_metric`` from rank 0 only."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.global_rank == 0:
            self.log("train_metric", out["loss"].detach(), rank_zero_only=True)
        return out

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().validation_step(batch, batch_idx)
        if self.global_rank == 0:
            self.log("val_metric", out["x"], rank_zero_only=True)
        return out


class Straggler(Callback):
    """Rank 1 stalls at the end of ``STALL_STEP``'s batch, before the checkpoint callback's boundary (Lightning runs
    checkpoint callbacks last), until rank 0 has reported, or for ``10 x TIMEOUT`` at most."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.boundary_entered: float | None = None

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != STALL_STEP:
            return
        self.boundary_entered = time.monotonic()
        if trainer.global_rank == 1:
            deadline = time.monotonic() + 10 * TIMEOUT.total_seconds()
            while time.monotonic() < deadline and not os.path.exists(os.path.join(self.out, "straggler-rank0.done")):
                time.sleep(0.2)


def fit(out: str, name: str, callback: FiniteGradCheckpoint, extra: list[Callback], **trainer_kwargs: Any
        ) -> dict[str, Any]:
    seed_everything(7)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[*extra, callback], **QUIET,
                      **trainer_kwargs)
    result: dict[str, Any] = {"error": None, "warnings": []}
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(RankZeroMetric())
        except Exception as error:
            result["error"] = {"type": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}
    result.update(
        seconds=time.monotonic() - start,
        warnings=[str(w.message) for w in caught if "monitored key" in str(w.message)],
        global_step=trainer.global_step,
        state=ledger_state(callback),
        tree=tree_digest(callback.dirpath) if trainer.global_rank == 0 else None,
    )
    return result


def missing_after_validation(out: str) -> dict[str, Any]:
    callback = FiniteGradCheckpoint(dirpath=os.path.join(out, "validation"), monitor="val_metric", save_top_k=1)
    return fit(out, "validation", callback, [], max_epochs=2, limit_train_batches=2, limit_val_batches=1,
               num_sanity_val_steps=0)


def missing_in_training(out: str) -> dict[str, Any]:
    callback = FiniteGradCheckpoint(dirpath=os.path.join(out, "training"), monitor="train_metric", save_top_k=1,
                                    every_n_train_steps=2)
    return fit(out, "training", callback, [], max_steps=4, limit_val_batches=0)


def straggler(out: str) -> dict[str, Any]:
    stall = Straggler(out)
    # without the version counter ModelCheckpoint asks no `file_exists` vote first: the boundary's first collective
    # is the guard's agreement, at its first file operation
    callback = FiniteGradCheckpoint(dirpath=os.path.join(out, "straggler"), every_n_train_steps=STALL_STEP,
                                    enable_version_counter=False)
    result = fit(out, "straggler", callback, [stall], max_steps=4, limit_val_batches=0)
    # how long this rank waited in the boundary before it failed (rank 0) or stopped stalling (rank 1)
    result["waited"] = None if stall.boundary_entered is None else time.monotonic() - stall.boundary_entered
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        open(os.path.join(out, "straggler-rank0.done"), "w").close()
    return result


def main() -> None:
    scenarios = {
        "missing-after-validation": missing_after_validation,
        "missing-in-training": missing_in_training,
        "straggler": straggler,
    }
    run_scenarios(scenarios, sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
