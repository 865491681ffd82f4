"""Two-rank FSDP2 scenarios for durable publication, run by ``tests/publish/test_durability.py``:

    python durability_worker.py OUT_DIR [SCENARIO ...]

- ``traced``: a fit that publishes distributed-checkpoint directories (every rank writes its part) every 2 steps,
  keeps the latest 2 and ``last``, under ``strace`` attached by rank 0 before the fit (rank 1, which Lightning's
  launcher starts during it, is traced from its start), into ``OUT_DIR/trace.txt``;
- ``flush-fails``: the same fit, where rank 1's flushes of ``step=6``'s staging directory fail (the directories
  only: the distributed checkpoint's writer flushes its own files, and would fail first), so the boundary at step 6
  (which would write ``step=6``, move ``last`` and evict ``step=2``) fails.

Each rank writes ``OUT_DIR/rank{N}.json`` after each scenario.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from durability_trace import have_strace, traced  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, fit_outcome, ledger_state, refuse_flushes_of_staging, run_scenarios, tree_digest  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

REFUSED_FROM = 5  # the step whose end is the boundary at global step 6


class RefusesFlushes(ShardedFaultModel):
    """From ``REFUSED_FROM`` on, rank 1's flushes of ``step=6``'s staging directory fail."""

    undo: Any = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.trainer.global_step == REFUSED_FROM and self.global_rank == 1 and self.undo is None:
            self.undo = refuse_flushes_of_staging("step=6", directories_only=True)


def run(out: str, name: str, model: ShardedFaultModel, trace: bool) -> dict[str, Any]:
    seed_everything(7)
    dirpath = os.path.join(out, name)
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2,
                                    save_last=True, filename="{step}")
    trainer = Trainer(strategy=make_strategy("fsdp2", timeout=timedelta(seconds=60)), devices=2, callbacks=[callback],
                      max_steps=8, limit_val_batches=0, **QUIET)
    rank_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
    with traced(os.path.join(out, "trace.txt")) if trace and rank_zero and have_strace() else nullcontext():
        result = fit_outcome(lambda: trainer.fit(model), write_errors=True)
    if getattr(model, "undo", None) is not None:
        model.undo()
    result.update(dirpath=dirpath, tree=tree_digest(dirpath) if trainer.global_rank == 0 else None,
                  state=ledger_state(callback), snapshots={str(k): v for k, v in model.snapshots.items()})
    return result


SCENARIOS = {
    "traced": lambda out: run(out, "traced", ShardedFaultModel(fsdp2=True), trace=True),
    "flush-fails": lambda out: run(out, "flush-fails", RefusesFlushes(fsdp2=True, snapshot_steps=[REFUSED_FROM]),
                                   trace=False),
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv[1], set(sys.argv[2:]))
