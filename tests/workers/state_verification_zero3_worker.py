"""A ZeRO-3 resume scenario, repeated in one process group, run by ``tests/lightning/test_state_verification.py``:

    python state_verification_zero3_worker.py OUT_DIR MODE:ITERATIONS [MODE:ITERATIONS ...]

DeepSpeed ZeRO-3 on 2 CPU processes, bf16 with ``check_grad_overflow: false``, the default
``count_skipped_steps=False``: 3 clean epochs (4 steps each, ``save_top_k=2`` on a score that improves every epoch,
``save_last=True``), then a fit resuming from ``last`` to 6 epochs, ``ITERATIONS`` times per ``MODE``:

- ``gradient``: rank 1's local gradient of the first layer gets one NaN at global step 13 (DeepSpeed skips the step);
- ``master``: after step 13, one NaN is written straight into rank 1's fp32 master partition, the way a NaN that
  reached the master weights by any route other than an applied gradient would sit there. Every later step's
  gradients are then non-finite and DeepSpeed skips them all: the gradient history alone would accept.

Each iteration records every step (what the guard could read, whether DeepSpeed applied it, whether the master
partition stayed finite), the errors, and every non-finite floating tensor in the published checkpoint files.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, leave_without_finalizing  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
STAGE3_GRADS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t is not None and t.numel())


class Probe(Callback):
    """Per step: the gradient partitions the guard reads, DeepSpeed's own, the master partition, and the outcome."""

    def __init__(self, plant_master_after: int | None = None) -> None:
        self.steps: list[dict[str, Any]] = []
        self.plant_master_after = plant_master_after

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        opt = trainer.strategy.model.optimizer
        parts = getattr(opt, STAGE3_GRADS, {})
        avg = getattr(opt, "averaged_gradients", {})
        self._pre = {
            "step": trainer.global_step,
            "grad_partitions_finite": _finite(parts.values()),
            "averaged_finite": _finite([t for group in avg.values() for t in group]),
            "master_finite_before": _finite(opt.fp32_partitioned_groups_flat),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        engine = trainer.strategy.model
        opt = engine.optimizer
        entry = dict(getattr(self, "_pre", {}), applied=engine.was_step_applied(),
                     master_finite_after=_finite(opt.fp32_partitioned_groups_flat),
                     ds_tensor_finite=_finite([p.ds_tensor for p in pl_module.parameters()]))
        self.steps.append(entry)
        if trainer.global_step - 1 == self.plant_master_after and trainer.global_rank == 1:
            with torch.no_grad():
                opt.fp32_partitioned_groups_flat[0][0] = float("nan")


def fit(dirpath, epochs, fault_steps=(), ckpt_path=None, plant_master_after=None):
    seed_everything(7)
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True,
                                    filename="{epoch}-{step}")
    probe = Probe(plant_master_after)
    model = ShardedFaultModel(fault_steps=fault_steps, val_losses=[10.0 - e for e in range(10)])
    strategy = make_strategy("ds3", timeout=TIMEOUT, precision="bf16-mixed", check_grad_overflow=False)
    trainer = Trainer(strategy=strategy, devices=2, precision="bf16-mixed", callbacks=[callback, probe],
                      max_epochs=epochs, limit_train_batches=4, limit_val_batches=1, num_sanity_val_steps=0, **QUIET)
    error = None
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except NonFiniteGradientError as e:
        error = e.fields()
    except Exception as e:
        error = f"unexpected {type(e).__name__}: {e}\n{traceback.format_exc()}"
    return callback, probe, error


def _non_finite_keys(obj: Any, key: str) -> list[str]:
    if isinstance(obj, torch.Tensor):
        return [key] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, dict):
        return [k for name, value in obj.items() for k in _non_finite_keys(value, f"{key}/{name}")]
    if isinstance(obj, (list, tuple)):
        return [k for i, value in enumerate(obj) for k in _non_finite_keys(value, f"{key}[{i}]")]
    return []


def published_non_finite(dirpath: str) -> list[str]:
    bad = []
    for root, _, files in os.walk(dirpath):
        for name in files:
            if not name.endswith(".pt"):
                continue
            path = os.path.join(root, name)
            state = torch.load(path, map_location="cpu", weights_only=False)

            bad.extend(f"{os.path.relpath(path, dirpath)}:{key}" for key in _non_finite_keys(state, ""))
    return bad


def main() -> None:
    out, runs = sys.argv[1], [arg.split(":") for arg in sys.argv[2:]]  # MODE:ITERATIONS ...
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    results: dict[str, list[dict[str, Any]]] = {}
    for mode, iterations in runs:
        results[mode] = []
        for i in range(int(iterations)):
            dirpath = os.path.join(out, f"{mode}{i}")
            first, _, err1 = fit(dirpath, 3)
            last = first.last_model_path
            if mode == "gradient":
                second, probe, err2 = fit(dirpath, 6, fault_steps=(13,), ckpt_path=last)
            else:
                second, probe, err2 = fit(dirpath, 6, ckpt_path=last, plant_master_after=13)
            torch.distributed.barrier()
            bad = published_non_finite(dirpath) if rank == 0 else []
            results[mode].append({"iteration": i, "errors": [err1, err2], "bad": bad, "steps": probe.steps,
                                  "last_report": str(second.last_report), "files": sorted(os.listdir(dirpath))})
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump(results, f, indent=1)
            torch.distributed.barrier()
    leave_without_finalizing()


if __name__ == "__main__":
    main()
