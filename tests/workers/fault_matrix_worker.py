"""The bounded fault matrix, run by ``tests/lightning/test_fault_matrix.py`` as

    python fault_matrix_worker.py STRATEGY OUT_DIR [CELL ...]

``STRATEGY`` is ``ddp``, ``zero1`` (DDP + ``ZeroRedundancyOptimizer``), ``ds2`` / ``ds3`` (DeepSpeed ZeRO-2/3 through
``tests/deepspeed_shim.py``) or ``fsdp2`` (``ModelParallelStrategy`` with ``fully_shard``). A cell is
``{faulty}-{boundary}``: ``faulty`` in ``none``, ``0``, ``1``, ``all``; ``boundary`` in ``periodic``, ``val_topk``,
``last``, ``final``. Every cell trains 4 optimizer steps; a fault is planted at step 3, so the first boundary that
would write after it is at global step 4, and the boundaries at global step 2 (except ``final``) wrote before it.

Lightning's subprocess launcher starts rank 1 by re-running this script; both ranks run all 16 cells in order, in
one process group with a 60 s collective timeout, and write what they observed to ``OUT_DIR/rank{N}.json`` after
every cell.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    FaultyModel,
    deepspeed_unavailable_reported,
    fit_outcome,
    ledger_state,
    run_scenarios,
    tree_digest,
)
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

TIMEOUT = timedelta(seconds=60)
STRATEGIES = ("ddp", "zero1", "ds2", "ds3", "fsdp2")
FAULTY = ("none", "0", "1", "all")
BOUNDARIES = ("periodic", "val_topk", "last", "final")
FAULT_STEP = 3  # the last step before global step 4, where every boundary below would write next
SENTINEL = "earlier-run.txt"  # a file already in the `final` directory, so "unchanged" is not about an empty tree

STEPS = dict(max_steps=4, limit_val_batches=0)
# name -> (callback kwargs, trainer kwargs, model kwargs)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # keep the latest by step: global step 4 would write step=4 and evict step=2
    "periodic": (dict(every_n_train_steps=2, monitor="step", mode="max", save_top_k=1, filename="{step}"), STEPS, {}),
    # every epoch improves: epoch 1's validation (global step 4) would write epoch=1 and evict epoch=0
    "val_topk": (
        dict(monitor="val_loss", save_top_k=1, filename="{epoch}"),
        dict(max_epochs=2, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0),
        dict(val_losses=[10.0, 9.0]),
    ),
    # only `last`: global step 4 would overwrite last.ckpt
    "last": (dict(every_n_train_steps=2, save_top_k=0, save_last=True), STEPS, {}),
    # nothing is written during training; ModelCheckpoint.on_train_end writes last.ckpt (nothing was saved before),
    # so the fault in the last step meets its first writing boundary at train end
    "final": (dict(save_top_k=0, save_last=True), STEPS, {}),
}


def fault_ranks(faulty: str) -> tuple[int, ...]:
    return {"none": (), "0": (0,), "1": (1,), "all": (0, 1)}[faulty]


def run_cell(root: str, strategy: str, faulty: str, boundary: str) -> dict[str, Any]:
    callback_kwargs, trainer_kwargs, model_kwargs = CONFIGS[boundary]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    dirpath = os.path.join(root, strategy, f"{faulty}-{boundary}")
    if boundary == "final" and rank == 0:
        os.makedirs(dirpath, exist_ok=True)
        with open(os.path.join(dirpath, SENTINEL), "w") as f:
            f.write("a file the callback does not own\n")
    faults = (FAULT_STEP,) if faulty != "none" else ()
    # DeepSpeed 0.19.8 skips every non-finite step under ZeRO-3: only counting the skip rejects there
    guard_kwargs = dict(count_skipped_steps=True) if strategy == "ds3" else {}
    seed_everything(7)
    callback = FiniteGradCheckpoint(dirpath=dirpath, **callback_kwargs, **guard_kwargs)
    if strategy in ("ddp", "zero1"):
        # the NaN is written after DDP's all-reduce: only the faulty ranks' gradients hold it
        model: Any = FaultyModel(fault_steps=faults, fault_ranks=fault_ranks(faulty), zero1=strategy == "zero1",
                                 **model_kwargs)
        precision = "32-true"
    else:
        # the NaN is planted in the faulty ranks' local contribution; the reduction lands it in rank 1's partition
        model = ShardedFaultModel(fault_steps=faults, fault_ranks=fault_ranks(faulty), fsdp2=strategy == "fsdp2",
                                  **model_kwargs)
        precision = "32-true" if strategy == "fsdp2" else "bf16-mixed"
    # DeepSpeed: bf16 with its overflow check off, so ZeRO-2 applies the NaN step and the guard alone rejects it
    trainer = Trainer(
        strategy=make_strategy(strategy, timeout=TIMEOUT, precision=precision, check_grad_overflow=False),
        devices=2,
        precision=precision,  # type: ignore[arg-type]
        callbacks=[callback],
        **QUIET,
        **trainer_kwargs,
    )
    result = fit_outcome(lambda: trainer.fit(model))
    snapshot = model.snapshots.get(FAULT_STEP)
    result.update(
        # rank 0 owns the files; another rank's view may race rank 0's evictions
        tree=tree_digest(dirpath) if rank == 0 else None,
        state=ledger_state(callback),
        snapshot=None if snapshot is None else {"tree": snapshot["tree"] if rank == 0 else None,
                                                "state": snapshot["state"]},
        global_step=trainer.global_step,
        # the most recent agreement: where it was decided, and what (the same value on every rank)
        report=dataclasses.asdict(callback.last_report) if callback.last_report is not None else None,
    )
    return result


def main() -> None:
    strategy, out = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3:])
    if strategy.startswith("ds") and deepspeed_unavailable_reported(out):  # before any Trainer
        return
    cells = {
        f"{faulty}-{boundary}": lambda root, f=faulty, b=boundary: run_cell(root, strategy, f, b)
        for boundary in BOUNDARIES
        for faulty in FAULTY
    }
    run_scenarios(cells, out, only)


if __name__ == "__main__":
    main()
