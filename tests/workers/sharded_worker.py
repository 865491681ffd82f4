"""Two-rank CPU/gloo scenarios for sharded gradients, run by ``tests/lightning/test_sharded.py``:

    python sharded_worker.py KIND OUT_DIR [SCENARIO ...]

``KIND`` is ``zero1``, ``zero2``, ``zero3`` (Lightning's ``DeepSpeedStrategy`` on CPU through
``tests/deepspeed_shim.py``) or ``fsdp2`` (``ModelParallelStrategy`` with ``fully_shard``). Lightning's subprocess
launcher starts rank 1 by re-running this script; every rank runs every scenario of the kind in order, in one process
group with a 60 s collective timeout, and writes what it observed to ``OUT_DIR/rank{N}.json`` after each scenario.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from sharded_helpers import (  # noqa: E402
    ShardedFaultModel,
    StepCollectives,
    count_collections,
    verdict_fields,
    weights_finite,
)
from strategies import make_strategy  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    HookFailsAt,
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
FAULT_STEP = 5  # the last step before the boundary at global step 6

# name -> (callback kwargs, trainer kwargs, model kwargs)
# keep the latest 2 by step, plus `last`: the boundary at step 6 would write step=6, move `last` and evict step=2
PERIODIC = (
    dict(monitor="step", mode="max", save_top_k=2, every_n_train_steps=2, save_last=True, filename="{step}"),
    dict(max_steps=8, limit_val_batches=0),
    {},
)
# every epoch improves: epoch 2's validation (global step 6) would write, move `last` and evict epoch 0's checkpoint
VAL_TOPK = (
    dict(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}"),
    dict(max_epochs=4, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0),
    dict(val_losses=[10.0, 9.0, 8.0, 7.0]),
)
# no validation, so the per-batch op counts cover exactly one training batch each
COUNTING = (
    dict(every_n_train_steps=2, save_top_k=-1),
    dict(max_steps=4, limit_val_batches=0, accumulate_grad_batches=2),
    {},
)
CONFIGS = {"periodic": PERIODIC, "val_topk": VAL_TOPK, "counting": COUNTING}

# the worker's KIND -> the kind of strategy it trains under (here ``zero1`` is DeepSpeed's ZeRO-1, not DDP's)
STRATEGY_KINDS = {"zero1": "ds1", "zero2": "ds2", "zero3": "ds3", "fsdp2": "fsdp2"}


def run(
    root: str,
    name: str,
    kind: str,
    config: str,
    guarded: bool = True,
    fault_steps: tuple[int, ...] = (),
    precision: str = "bf16-mixed",
    check_grad_overflow: bool | None = False,
    ckpt_path: str | None = None,
    max_steps: int | None = None,
    count_ops: bool = False,
    config_kwargs: dict[str, Any] | None = None,
    failing_hook: HookFailsAt | None = None,
    **guard_kwargs: Any,
) -> dict[str, Any]:
    callback_kwargs, trainer_kwargs, model_kwargs = CONFIGS[config]
    if max_steps is not None:
        trainer_kwargs = dict(trainer_kwargs, max_steps=max_steps)
    if kind == "fsdp2":
        precision = "32-true"
    seed_everything(7)
    dirpath = os.path.join(root, name)
    if guarded:
        callback: ModelCheckpoint = FiniteGradCheckpoint(dirpath=dirpath, **callback_kwargs, **guard_kwargs)
    else:
        callback = ModelCheckpoint(dirpath=dirpath, **callback_kwargs)
    callbacks: list[Any] = [callback]
    counter = None
    if count_ops:
        counter = StepCollectives()
        counter.attach(callback)
        callbacks.insert(0, counter)
    if failing_hook is not None:
        callbacks.append(failing_hook)
        model_kwargs = dict(model_kwargs, snapshot_steps=(5,))  # before epoch 2's boundary
    model = ShardedFaultModel(fault_steps=fault_steps, fsdp2=kind == "fsdp2", **model_kwargs)
    strategy = make_strategy(STRATEGY_KINDS[kind], timeout=TIMEOUT, precision=precision,
                             check_grad_overflow=check_grad_overflow, **(config_kwargs or {}))
    count_collections(strategy, model.collections)
    trainer = Trainer(
        strategy=strategy,
        devices=2,
        precision=precision,  # type: ignore[arg-type]
        callbacks=callbacks,
        **QUIET,
        **trainer_kwargs,
    )
    result = fit_outcome(lambda: trainer.fit(model, ckpt_path=ckpt_path), write_errors=failing_hook is not None,
                         also=(RuntimeError,) if failing_hook is not None else ())
    result.update(
        tree=tree_digest(dirpath) if trainer.global_rank == 0 else None,  # rank 0 owns the files (see the model)
        state=ledger_state(callback),
        snapshots={str(k): v for k, v in model.snapshots.items()},
        verdicts={str(k): v for k, v in model.verdicts.items()},
        global_step=trainer.global_step,
        collections=dict(model.collections),
        weights_finite=weights_finite(model),
        last_model_path=callback.last_model_path,
    )
    last_verdict = getattr(callback, "last_verdict", None)
    result["last_verdict"] = verdict_fields(last_verdict) if last_verdict is not None else None
    if counter is not None:
        result["ops_per_batch"] = [dict(c) for c in counter.per_batch]
    return result


def resume(root: str, name: str, kind: str, guarded: bool, precision: str) -> dict[str, Any]:
    """A finite run to step 6, then a new Trainer resuming from its ``last`` checkpoint to step 10."""
    first = run(root, name, kind, "periodic", guarded, precision=precision, max_steps=6)
    last = first["last_model_path"]
    resumed = run(root, name, kind, "periodic", guarded, precision=precision, max_steps=10, ckpt_path=last or None)
    return {"first": first, "resumed": resumed, "error": first["error"] or resumed["error"]}


Scenario = Callable[[str], dict[str, Any]]


def scenarios(kind: str) -> dict[str, Scenario]:
    table: dict[str, Scenario] = {}
    # ZeRO-3 (and fp32 ZeRO-1/2) always skip a step whose global gradient norm is not finite, whatever
    # check_grad_overflow says: there the NaN step is never applied, and only count_skipped_steps=True rejects
    strict = {"count_skipped_steps": True} if kind == "zero3" else {}
    for config in ("periodic", "val_topk"):
        table[f"{config}-reject"] = lambda root, n=f"{kind}-{config}-reject", c=config: run(
            root, n, kind, c, True, (FAULT_STEP,), **strict
        )
    resume_precision = {"zero1": "bf16-true", "zero2": "32-true", "zero3": "bf16-mixed", "fsdp2": "32-true"}[kind]
    table["resume-guarded"] = lambda root, n=f"{kind}-resume-guarded": resume(root, n, kind, True, resume_precision)
    table["resume-plain"] = lambda root, n=f"{kind}-resume-plain": resume(root, n, kind, False, resume_precision)
    if kind in ("zero2", "fsdp2"):
        # a hook of yours fails on rank 1 in epoch 2's save, before a save that starts with a broadcast and is
        # collective: every rank still runs it, into staging, and raises after it
        table["val_topk-hook-fails"] = lambda root, n=f"{kind}-val_topk-hook-fails": run(
            root, n, kind, "val_topk", failing_hook=HookFailsAt("on_save_checkpoint", rank=1, epoch=2))
    if kind in ("zero2", "zero3"):
        # DeepSpeed's overflow check on: the NaN step is skipped, never applied; publication goes on, and reports it
        check = None if kind == "zero3" else True
        table["overflow-skipped"] = lambda root, n=f"{kind}-overflow-skipped": run(
            root, n, kind, "periodic", True, (FAULT_STEP,), check_grad_overflow=check
        )
    if kind in ("zero2", "zero3"):
        # optimizer offloaded to the CPU: the partition is read where DeepSpeed keeps it
        table["offload-reject"] = lambda root, n=f"{kind}-offload-reject": run(
            root, n, kind, "periodic", True, (FAULT_STEP,), config_kwargs={"offload": True}, **strict
        )
    if kind == "zero1":
        # bf16 with fp32 gradient accumulation selects BF16_Optimizer, which skips non-finite steps itself
        table["bf16-optimizer-reject"] = lambda root, n=f"{kind}-bf16-optimizer-reject": run(
            root, n, kind, "periodic", True, (FAULT_STEP,), config_kwargs={"grad_accum_dtype": "fp32"},
            count_skipped_steps=True,
        )
    if kind == "zero2":
        table["overflow-counted"] = lambda root, n=f"{kind}-overflow-counted": run(
            root, n, kind, "periodic", True, (FAULT_STEP,), check_grad_overflow=True, count_skipped_steps=True
        )
        for guarded in (True, False):
            label = "guarded" if guarded else "plain"
            table[f"collectives-{label}"] = lambda root, n=f"{kind}-collectives-{label}", g=guarded: run(
                root, n, kind, "counting", g, count_ops=True
            )
    return table


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3:])
    if kind != "fsdp2" and deepspeed_unavailable_reported(out):  # before any Trainer
        return
    run_scenarios(scenarios(kind), out, only)


if __name__ == "__main__":
    main()
