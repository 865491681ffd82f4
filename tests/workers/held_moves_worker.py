"""What rank 0 does alone after a boundary's last collective, failing there, on two ranks (gloo, CPU), run by
``tests/publish/test_held_moves.py`` as ``python held_moves_worker.py OUT_DIR [SCENARIO ...]``. Scenarios:

- ``evict-fails``: DDP, the top-1 checkpoint by ``val_loss``; epoch 1's boundary publishes its checkpoint, then rank 0's
  eviction of epoch 0's (only rank 0 removes) fails like a busy file (``EBUSY``). Every rank should raise at epoch 2's
  agreement, not leave rank 1 waiting in it.

- ``held-then-exception``: DDP, a checkpoint every 2 steps; rank 0's move of step 2's checkpoint into place is refused
  (held), then every rank raises at step 3, so the held failure is learned while the exception is handled, where no
  collective is safe. A second fit with the same callback, on a new Trainer, must start from the same ledger on every
  rank (rank 0 rolling back alone made it save at step 2 while rank 1 skipped that save: a hang).

Each rank writes ``OUT_DIR/rank{N}.json``: how the fit ended, the checkpoint directory, the callback's ledger, and both
as they were before epoch 2's boundary (step 5).
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    BusyRemovalIO,
    FaultyModel,
    RaisesAtStep3,
    fit_outcome,
    ledger_state,
    refuse_moves_to,
    run_scenarios,
    tree_digest,
)
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)


def evict_fails(root: str) -> dict[str, Any]:
    dirpath = os.path.join(root, "evict-fails")
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=1)
    model = FaultyModel(val_losses=[3.0, 2.0, 1.0], snapshot_steps=[5])  # step 5: before epoch 2's boundary
    seed_everything(7)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback],
                      plugins=[BusyRemovalIO()], max_epochs=3, limit_train_batches=2, limit_val_batches=1,
                      num_sanity_val_steps=0, **QUIET)
    result = fit_outcome(lambda: trainer.fit(model), write_errors=True)
    result.update(tree=tree_digest(dirpath), state=ledger_state(callback), global_step=trainer.global_step,
                  snapshots={str(k): v for k, v in model.snapshots.items()})
    return result


def held_then_exception(root: str) -> dict[str, Any]:
    dirpath = os.path.join(root, "held-then-exception")
    callback = FiniteGradCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    seed_everything(7)
    undo = refuse_moves_to("step=2")  # only rank 0 moves: rank 1's is never used
    try:
        first = fit_outcome(lambda: _steps_trainer(callback, 6).fit(RaisesAtStep3()))
    finally:
        undo()
    first.update(state=ledger_state(callback))
    second = fit_outcome(lambda: _steps_trainer(callback, 4).fit(FaultyModel()), write_errors=True)
    second.update(state=ledger_state(callback), tree=tree_digest(dirpath))
    return {"first": first, "second": second}


def _steps_trainer(callback: FiniteGradCheckpoint, max_steps: int) -> Trainer:
    return Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback],
                   max_steps=max_steps, limit_val_batches=0, **QUIET)


def main() -> None:
    run_scenarios({"evict-fails": evict_fails, "held-then-exception": held_then_exception}, sys.argv[1],
                  set(sys.argv[2:]))


if __name__ == "__main__":
    main()
