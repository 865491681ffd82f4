"""``save_on_exception`` on two ranks (gloo, CPU), run by ``tests/lightning/test_exception_saves.py`` as ``python
exception_saves_worker.py OUT_DIR [SCENARIO ...]``. A checkpoint every 2 steps; at global step 3, ``training_step``
raises ``RuntimeError("boom on rank N")``:

- ``one-rank``: on rank 1 only. Rank 0 is then inside DDP's gradient all-reduce of that step: an agreement all-reduce
  run by rank 1's exception handler would pair with it (gloo aborts rank 0 on the size mismatch, or, at an equal size,
  sums rank 1's ballot into rank 0's gradients).
- ``every-rank``: on both ranks, as a SIGTERM or a deterministic error does: the checkpoint on exception is saved.
- ``every-rank-apart``: on both ranks, rank 0 before the guard records step 3 and rank 1 after, with a spike gate
  whose windows then differ by that step: the checkpoint on exception is saved all the same.
- ``again-on-one-rank``: ``every-rank``, then in the same processes a new callback and Trainer with ``one-rank``: the
  rendezvous store outlives Trainers, and the first fit's keys must not stand for the second's.

The rendezvous waits ``RENDEZVOUS`` here, not its 30 s. Each rank writes ``OUT_DIR/rank{N}.json``: how the fit ended,
its warnings, the checkpoint directory and the seconds the fit took.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from strategies import make_strategy  # noqa: E402

import lightning_ckguard.lightning.fit as fit_module  # noqa: E402
from helpers import QUIET, FaultyModel, fit_outcome, run_scenarios, tree_digest  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint, SpikeGate  # noqa: E402

torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
RENDEZVOUS = timedelta(seconds=3)
fit_module.EXCEPTION_RENDEZVOUS = RENDEZVOUS


class RaisesAtStep3(FaultyModel):
    def __init__(self, raising_ranks: tuple[int, ...]) -> None:
        super().__init__()
        self.raising_ranks = raising_ranks

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_step == 3 and self.global_rank in self.raising_ranks:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


class RaisesApartAtStep3(FaultyModel):
    """Both ranks raise at global step 3, rank 0 right after its backward (before the guard records the step), rank
    1 right after the guard recorded it: as a Ctrl-C to both ranks may leave them."""

    def on_after_backward(self) -> None:
        super().on_after_backward()
        if self.trainer.global_step == 3 and self.global_rank == 0:
            raise RuntimeError("boom on rank 0")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        super().on_before_optimizer_step(optimizer)
        if self.trainer.global_step == 3 and self.global_rank == 1:
            raise RuntimeError("boom on rank 1")


def _raising(root: str, name: str, raising_ranks: tuple[int, ...], apart: bool = False) -> dict[str, Any]:
    dirpath = os.path.join(root, name)
    gate = SpikeGate(warmup_steps=1, history=8) if apart else None  # the windows of the two ranks differ by a step
    callback = FiniteGradCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_on_exception=True,
                                    spike_gate=gate)
    seed_everything(7)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback], max_steps=6,
                      limit_val_batches=0, **QUIET)
    started = time.monotonic()
    model = RaisesApartAtStep3() if apart else RaisesAtStep3(raising_ranks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_outcome(lambda: trainer.fit(model))
    result.update(seconds=time.monotonic() - started, tree=tree_digest(dirpath),
                  warnings=[str(w.message) for w in caught if "FiniteGradCheckpoint" in str(w.message)])
    return result


def main() -> None:
    scenarios = {"one-rank": lambda root: _raising(root, "one-rank", (1,)),
                 "every-rank": lambda root: _raising(root, "every-rank", (0, 1)),
                 "every-rank-apart": lambda root: _raising(root, "every-rank-apart", (0, 1), apart=True),
                 "again-on-one-rank": lambda root: {"first": _raising(root, "first", (0, 1)),
                                                    "second": _raising(root, "second", (1,))}}
    run_scenarios(scenarios, sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
