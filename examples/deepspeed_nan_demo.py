"""DeepSpeed ZeRO-2 demo: a NaN in one rank's gradient partition is caught before it reaches a checkpoint.

In real use DeepSpeed runs on CUDA GPUs (``Trainer(accelerator="cuda", devices=2, strategy=DeepSpeedStrategy(...))``)
and this script does exactly that when two GPUs are available. Without them, it runs for demonstration only on 2 CPU
processes (gloo) through ``CPUDemoDeepSpeedStrategy`` below: Lightning's ``DeepSpeedStrategy`` minus its CUDA checks,
with DeepSpeed's CPU accelerator. That is not a supported way to train; it lets you watch the real DeepSpeed engine,
its ZeRO partitions and its checkpoint directories without a GPU. Run it with ``python examples/deepspeed_nan_demo.py``;
Lightning starts rank 1 itself.

Under ZeRO-2 no rank holds the whole gradient: ``param.grad`` is ``None`` and each rank keeps its partition in the
optimizer. At step 23 rank 1's own gradient contribution for the first layer gets a NaN, before DeepSpeed's
reduction; after the reduction it sits only in the partition rank 1 applies. bf16 runs with DeepSpeed's overflow
check off (``"check_grad_overflow": false``), so DeepSpeed applies the step: the weights are poisoned.

1. ``ModelCheckpoint`` keeps saving: the poisoned checkpoint directories evict the good ones and ``last`` is
   overwritten.
2. ``FiniteGradCheckpoint``: every rank reads its own partition, all ranks agree at the next boundary (step 24), and
   every rank raises the same ``NonFiniteGradientError``; no directory is written, deleted or replaced.
3. A fresh run resumes from the intact ``last.ckpt`` directory and finishes.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import torch

CUDA = torch.cuda.is_available() and torch.cuda.device_count() >= 2
if not CUDA:
    # demonstration on CPU: DeepSpeed's CPU accelerator, and no JIT build of its shared-memory op (~80 s of C++)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError  # noqa: E402

FAULT_STEP = 23
MAX_STEPS = 40
DEEPSPEED_CONFIG = {
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True, "check_grad_overflow": False},  # DeepSpeed applies non-finite steps
    "train_micro_batch_size_per_gpu": 32,
    "steps_per_print": 10**9,
}


class CPUDemoDeepSpeedStrategy(DeepSpeedStrategy):
    """For this demonstration only: Lightning's ``DeepSpeedStrategy`` on CPU processes. Use CUDA for real training."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # without DeepSpeedStrategy's CUDAAccelerator check

    def setup_distributed(self) -> None:
        reset_seed()  # without the CUDA device-index validation
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),  # the parent passes the CUDA index (None on CPU)
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


def _nan_in_rank_1(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[..., -1] = float("nan")  # the last feature: its stem rows lie in the last (rank 1's) partition
    return grad


class Regression(LightningModule):
    def __init__(self, inject_fault: bool) -> None:
        super().__init__()
        # registered last, so ZeRO-2 puts the first layer's gradients in the last rank's partition
        self.head = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.stem = torch.nn.Linear(8, 32)
        self.inject_fault = inject_fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(x)
        if self.inject_fault and self.training and self.global_step == FAULT_STEP and self.global_rank == 1:
            # rank 1's own contribution, before DeepSpeed reduces it into the partition that owns it
            hidden.register_hook(_nan_in_rank_1)
        return self.head(hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:  # an optimizer DeepSpeed's ZeRO lists as tested
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) / 4), batch_size=32)


def fit(callback: ModelCheckpoint, inject_fault: bool, ckpt_path: str | None = None) -> Trainer:
    seed_everything(0, verbose=False)
    strategy_cls = DeepSpeedStrategy if CUDA else CPUDemoDeepSpeedStrategy
    trainer = Trainer(
        accelerator="cuda" if CUDA else "cpu",
        devices=2,
        strategy=strategy_cls(config=dict(DEEPSPEED_CONFIG), timeout=timedelta(seconds=60)),
        precision="bf16-mixed",
        max_steps=MAX_STEPS,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(inject_fault), ckpt_path=ckpt_path)
    return trainer


def latest_two_and_last(cls: type[ModelCheckpoint], dirpath: str) -> ModelCheckpoint:
    return cls(dirpath=dirpath, filename="{step}", monitor="step", mode="max", save_top_k=2, every_n_train_steps=8,
               save_last=True)


def on_disk(dirpath: str) -> str:
    """Each checkpoint directory and whether the weights in it are finite (ZeRO-2 saves the full module weights)."""
    if rank_zero_only.rank != 0:  # rank 0 owns the directories; other ranks could race its evictions
        return ""

    def state(name: str) -> str:
        path = os.path.join(dirpath, name, "checkpoint", "mp_rank_00_model_states.pt")
        weights = torch.load(path, map_location="cpu", weights_only=False)["module"]
        return "finite" if all(torch.isfinite(t).all() for t in weights.values()) else "NaN weights"

    return ", ".join(f"{name}/ ({state(name)})" for name in sorted(os.listdir(dirpath)))


@rank_zero_only
def say(*lines: str) -> None:
    print("\n".join(lines))


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    root = os.environ.setdefault("CKGUARD_DEMO_DIR", tempfile.mkdtemp(prefix="ckguard-deepspeed-demo-"))
    plain_dir, guarded_dir = os.path.join(root, "plain"), os.path.join(root, "guarded")
    say("DeepSpeed ZeRO-2, bf16, 2 GPUs" if CUDA else "DeepSpeed ZeRO-2, bf16, 2 CPU processes (demonstration only)")

    fit(latest_two_and_last(ModelCheckpoint, plain_dir), inject_fault=True)
    say(f"[1] ModelCheckpoint, NaN in rank 1's partition at step {FAULT_STEP}:", f"    {on_disk(plain_dir)}")

    guarded = latest_two_and_last(FiniteGradCheckpoint, guarded_dir)
    try:
        fit(guarded, inject_fault=True)
        raise SystemExit("the NaN was not caught")
    except NonFiniteGradientError as error:  # the same error, with the same fields, on every rank
        say(f"[2] FiniteGradCheckpoint, same fault: every rank raised NonFiniteGradientError(ranks={error.ranks}, "
            f"steps {error.first_step}-{error.last_step}, boundary at step {error.global_step}, "
            f"parameters={list(error.parameters)})", f"    {on_disk(guarded_dir)}")

    last = guarded.last_model_path
    trainer = fit(latest_two_and_last(FiniteGradCheckpoint, guarded_dir), inject_fault=False, ckpt_path=last)
    say(f"[3] resumed from {os.path.basename(last)}/ and finished at step {trainer.global_step}:",
        f"    {on_disk(guarded_dir)}")
    if trainer.is_global_zero and "CKGUARD_KEEP" not in os.environ:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
