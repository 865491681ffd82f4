"""Two-rank CPU/gloo scenarios for ``on_non_finite="rewind"``, run by ``tests/recover/test_rewind.py``:

    python rewind_worker.py KIND OUT_DIR [SCENARIO ...]

``KIND`` is ``ddp``, ``zero1`` (DDP + ``ZeroRedundancyOptimizer``), ``ds1``, ``ds2``, ``ds3`` (DeepSpeed through
``tests/deepspeed_shim.py``) or ``fsdp2``. A NaN reaches rank 1 only, at chosen steps: after DDP's all-reduce
(``FaultyModel``), or in rank 1's local gradient contribution before the reduction, so it lands in rank 1's
partition or shard (``ShardedFaultModel``). The optimizer is Adam with a per-step ``StepLR``, so optimizer and
scheduler state (and their step counts) must come back. Every rank runs every scenario in order in one process group
(60 s collective timeouts) and writes what it observed to ``OUT_DIR/rank{N}.json``.

- ``rewinds``: faults at steps 3, 7 and 11, ``max_rewinds=3``, a checkpoint every 2 steps (top 2 by step, plus
  ``last``), ``max_steps=14``: three rewinds, each compared on every rank with the file it went back to, right after
  the rewind (at the next batch start); then every checkpoint on disk must load and be finite.
- ``resumed``: a new fit resuming from ``rewinds``' ``last`` to step 22 with ``max_rewinds=1`` and faults at 17 and
  19: it counts from zero, so the first fault rewinds (compared with the file again) and the second raises with the
  history.
- ``no-checkpoint`` (DDP only): a fault before anything was published raises on every rank.
- ``accumulation`` (ZeRO-2 only): two micro-batches a step (``accumulate_grad_batches=2``, DeepSpeed's
  ``gradient_accumulation_steps``) and a validation every 3 batches, so the boundaries after batches 2 and 8 fall
  between the micro-batches of a step. Batch 7's NaN on rank 1 makes step 3's update NaN, batch 8 (the first
  micro-batch of step 4) backpropagates through the NaN weights, and the boundary after it rewinds to ``step=3``
  with ``max_rewinds=1``: what ZeRO-2's optimizer reduced of batch 8 must not join step 4, or the next boundary
  rejects again and raises. At every batch start, DeepSpeed's accumulation boundary against Lightning's.
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
from lightning.pytorch.callbacks import Callback  # noqa: E402
from rewind_helpers import checkpoint_loads_finite, compare_with_checkpoint  # noqa: E402
from sharded_helpers import ShardedFaultModel, weights_finite  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    FaultyModel,
    RecordingLogger,
    deepspeed_unavailable_reported,
    fit_outcome,
    ledger_state,
    rewind_log,
    run_scenarios,
)
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402
from lightning_ckguard.recover.rewind import REWIND_LOG_NAME  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
SHARDED = ("ds1", "ds2", "ds3", "fsdp2")


def _optimizers(module: Any, zero1: bool) -> Any:
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer: Any = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    else:
        optimizer = torch.optim.Adam(module.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DDPRewindModel(FaultyModel):
    def configure_optimizers(self) -> Any:
        return _optimizers(self, self.zero1)


class ShardedRewindModel(ShardedFaultModel):
    def configure_optimizers(self) -> Any:
        return _optimizers(self, False)


class RewindProbe(Callback):
    """Right after each rewind (at the next batch start, on every rank together): this rank's state against the file
    it went back to, and the loop counters, which go on."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.checks: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        # a value of Lightning's own every step: its flush to the loggers carries the guard's `ckguard/*` values
        pl_module.log("probe/global_step", float(trainer.global_step))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        callback = trainer.checkpoint_callback
        if len(callback.rewinds) > len(self.checks):
            rewind = callback.rewinds[-1]
            comparison = compare_with_checkpoint(trainer, rewind.checkpoint, self.kind)
            self.checks.append({"global_step": trainer.global_step, "rewind": rewind.as_dict(),
                                "weights_finite": weights_finite(pl_module), **comparison})


class MicroBatchFaultModel(ShardedRewindModel):
    """The NaN on rank 1 at chosen batches (micro-batches), not at every micro-batch of a global step."""

    def __init__(self, fault_batches: tuple[int, ...]) -> None:
        super().__init__()
        self.fault_batches = set(fault_batches)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # the forward plants the fault at the global steps in `fault_steps`: this batch's step, for this batch only
        self.fault_steps = {self.trainer.global_step} if batch_idx in self.fault_batches else set()
        super().on_train_batch_start(batch, batch_idx)


class AccumulationProbe(Callback):
    """At every batch start: whether DeepSpeed's engine takes this micro-batch as its accumulation boundary, as
    Lightning does; right after the rewind, what DeepSpeed's ZeRO optimizer still holds of the step under way."""

    def __init__(self) -> None:
        self.disagreements: list[dict[str, Any]] = []
        self.held_after_rewind: list[list[str]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = trainer.strategy.model
        lightning_steps = not trainer.fit_loop._should_accumulate()
        if engine.is_gradient_accumulation_boundary() != lightning_steps:
            self.disagreements.append({"batch": batch_idx, "micro_steps": engine.micro_steps})
        if len(trainer.checkpoint_callback.rewinds) > len(self.held_after_rewind):
            optimizer = engine.optimizer
            buffers = {name: getattr(optimizer, name, {}) for name in ("all_grad_tensors", "averaged_gradients")}
            self.held_after_rewind.append(sorted(f"{name}[{group}]" for name, held in buffers.items()
                                                 for group, value in held.items() if value is not None))


def accumulation(root: str) -> dict[str, Any]:
    seed_everything(7)
    dirpath = os.path.join(root, "ds2-accumulation")
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=-1, filename="{step}",
                                    on_non_finite="rewind", max_rewinds=1)
    probe, model = AccumulationProbe(), MicroBatchFaultModel(fault_batches=(7,))
    strategy = make_strategy("ds2", timeout=TIMEOUT, precision="bf16-mixed", check_grad_overflow=False)
    trainer = Trainer(strategy=strategy, devices=2, precision="bf16-mixed", callbacks=[probe, callback],
                      max_epochs=1, limit_train_batches=12, val_check_interval=3, limit_val_batches=1,
                      num_sanity_val_steps=0, accumulate_grad_batches=2, **QUIET)
    result = fit_outcome(lambda: trainer.fit(model))
    result.update(
        global_step=trainer.global_step,
        rewinds=[r.as_dict() for r in callback.rewinds],
        disagreements=probe.disagreements,
        held_after_rewind=probe.held_after_rewind,
        weights_finite=weights_finite(model),
    )
    if trainer.global_rank == 0:
        result["finite"] = {e: checkpoint_loads_finite(os.path.join(dirpath, e)) for e in sorted(os.listdir(dirpath))
                            if e != REWIND_LOG_NAME}
    return result


def run(root: str, name: str, kind: str, fault_steps: tuple[int, ...], max_steps: int, max_rewinds: int,
        ckpt_path: str | None = None) -> dict[str, Any]:
    seed_everything(7)
    dirpath = os.path.join(root, name)
    strict = {"count_skipped_steps": True} if kind == "ds3" else {}  # ZeRO-3 skips the NaN step itself
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, save_last=True,
                                    every_n_train_steps=2, filename="{step}", on_non_finite="rewind",
                                    max_rewinds=max_rewinds, **strict)
    probe, logger = RewindProbe(kind), RecordingLogger()
    callbacks: list[Any] = [probe, callback]
    if kind in SHARDED:
        precision = "32-true" if kind == "fsdp2" else "bf16-mixed"
        model: Any = ShardedRewindModel(fault_steps=fault_steps, fsdp2=kind == "fsdp2")
        # ZeRO-1/2 with bf16's overflow check off apply the NaN step; ZeRO-3 skips it whatever the check says
        strategy = make_strategy(kind, timeout=TIMEOUT, precision=precision,
                                 check_grad_overflow=False if kind in ("ds1", "ds2") else None)
    else:
        precision = "32-true"
        model = DDPRewindModel(fault_steps=fault_steps, fault_ranks=(1,), sanitize=False, zero1=kind == "zero1",
                               lr=0.01)
        strategy = make_strategy(kind, timeout=TIMEOUT)
        from lightning.pytorch.callbacks import EMAWeightAveraging

        if kind == "ddp":  # the average model comes back too
            callbacks.insert(0, EMAWeightAveraging(decay=0.5))
    quiet = {**QUIET, "logger": logger, "log_every_n_steps": 1}
    trainer = Trainer(strategy=strategy, devices=2, precision=precision,  # type: ignore[arg-type]
                      callbacks=callbacks, max_steps=max_steps, limit_val_batches=0, **quiet)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_outcome(lambda: trainer.fit(model, ckpt_path=ckpt_path))
    result["warnings"] = [str(w.message) for w in caught if "Rewound in place" in str(w.message)]
    result.update(
        global_step=trainer.global_step,
        checks=probe.checks,
        rewinds=[r.as_dict() for r in callback.rewinds],
        state=ledger_state(callback),
        last_model_path=callback.last_model_path,
        logged_rewinds=[(step, m["ckguard/rewinds"]) for step, m in logger.calls if "ckguard/rewinds" in m],
        weights_finite=weights_finite(model),
    )
    if trainer.global_rank == 0:
        entries = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
        result["entries"] = entries
        result["finite"] = {e: checkpoint_loads_finite(os.path.join(dirpath, e)) for e in entries
                            if e != REWIND_LOG_NAME}
        result["rewind_log"] = rewind_log(dirpath)
    return result


def scenarios(kind: str) -> dict[str, Any]:
    table: dict[str, Any] = {
        "rewinds": lambda root: run(root, f"{kind}-rewinds", kind, (3, 7, 11), max_steps=14, max_rewinds=3),
        # resumes from the previous scenario's `last` (a new directory: its own rewind log and top-K)
        "resumed": lambda root: run(root, f"{kind}-resumed", kind, (17, 19), max_steps=22, max_rewinds=1,
                                    ckpt_path=os.path.join(root, f"{kind}-rewinds", "last.ckpt")),
    }
    if kind == "ds2":
        table["accumulation"] = accumulation
    if kind == "ddp":
        table["no-checkpoint"] = lambda root: run(root, f"{kind}-no-checkpoint", kind, (1,), max_steps=6,
                                                  max_rewinds=3)
    return table


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind.startswith("ds") and deepspeed_unavailable_reported(out):  # before any Trainer
        return
    run_scenarios(scenarios(kind), out, set(sys.argv[3:]))


if __name__ == "__main__":
    main()
