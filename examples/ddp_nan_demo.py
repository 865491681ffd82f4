"""Two-process CPU DDP demo: a NaN on rank 1 is caught before it reaches a checkpoint.

Run it with ``python examples/ddp_nan_demo.py``; Lightning starts rank 1 itself (gloo, CPU). The checkpoint config is
the usual "keep the latest 2 plus ``last``, every 8 steps". At step 23 a NaN is written into one gradient element on
rank 1 only, after DDP's all-reduce, so rank 0 never sees it.

1. ``ModelCheckpoint`` keeps saving: the poisoned checkpoints evict the good ones and ``last`` moves onto them.
2. ``FiniteGradCheckpoint``: every rank raises the same ``NonFiniteGradientError`` at the next boundary (step 24);
   nothing is written, deleted or linked.
3. A fresh run resumes from the intact ``last.ckpt`` and finishes.

It runs on ``lightning.pytorch`` (``import lightning as L``) by default. ``python examples/ddp_nan_demo.py --lightning
pytorch_lightning`` (or ``CKGUARD_DEMO_LIGHTNING=pytorch_lightning``) runs the same demo on the ``pytorch_lightning``
package, with ``from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import tempfile
import warnings
from datetime import timedelta

import torch
from torch.utils.data import DataLoader, TensorDataset


def chosen_lightning() -> str:
    """``--lightning``, else ``$CKGUARD_DEMO_LIGHTNING``, else ``lightning.pytorch``. Rank 1 is started with the same
    command line and environment, so every rank chooses the same package."""
    parser = argparse.ArgumentParser(description="Two-process CPU DDP demo of FiniteGradCheckpoint.")
    parser.add_argument("--lightning", choices=("lightning.pytorch", "pytorch_lightning"),
                        default=os.environ.get("CKGUARD_DEMO_LIGHTNING") or "lightning.pytorch",
                        help="the Lightning package to train with (default: lightning.pytorch)")
    return parser.parse_known_args()[0].lightning


LIGHTNING = chosen_lightning()
if LIGHTNING == "pytorch_lightning":
    from pytorch_lightning import LightningModule, Trainer, seed_everything
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import DDPStrategy
    from pytorch_lightning.utilities import rank_zero_only

    from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint, NonFiniteGradientError
else:
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError

FAULT_STEP = 23
MAX_STEPS = 40


class Regression(LightningModule):
    def __init__(self, inject_fault: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.inject_fault = inject_fault

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self):
        # DDP has already all-reduced the gradients here, so only rank 1 holds the NaN
        if self.inject_fault and self.global_step == FAULT_STEP and self.global_rank == 1:
            self.net[2].weight.grad[0, 0] = float("nan")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) / 4), batch_size=32)


def fit(callback: ModelCheckpoint, inject_fault: bool, ckpt_path: str | None = None) -> Trainer:
    seed_everything(0, verbose=False)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=60)),
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
    if rank_zero_only.rank != 0:  # rank 0 owns the files; other ranks could race its evictions
        return ""

    def state(name: str) -> str:
        weights = torch.load(os.path.join(dirpath, name), map_location="cpu", weights_only=False)["state_dict"]
        return "finite" if all(torch.isfinite(t).all() for t in weights.values()) else "NaN weights"

    return ", ".join(f"{name} ({state(name)})" for name in sorted(os.listdir(dirpath)))


@rank_zero_only
def say(*lines: str) -> None:
    print("\n".join(lines))


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    root = os.environ.setdefault("CKGUARD_DEMO_DIR", tempfile.mkdtemp(prefix="ckguard-demo-"))
    plain_dir, guarded_dir = os.path.join(root, "plain"), os.path.join(root, "guarded")
    if LIGHTNING != "lightning.pytorch":
        say(f"[0] {LIGHTNING}: {Trainer.__module__.split('.')[0]}.Trainer with "
            f"{FiniteGradCheckpoint.__module__}.FiniteGradCheckpoint")

    fit(latest_two_and_last(ModelCheckpoint, plain_dir), inject_fault=True)
    say(f"[1] ModelCheckpoint, NaN on rank 1 at step {FAULT_STEP}:", f"    {on_disk(plain_dir)}")

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
    say(f"[3] resumed from {os.path.basename(last)} and finished at step {trainer.global_step}:",
        f"    {on_disk(guarded_dir)}")
    if trainer.is_global_zero and "CKGUARD_KEEP" not in os.environ:
        shutil.rmtree(root, ignore_errors=True)
    # Lightning leaves the process group to the interpreter's exit, where destroying gloo's objects in whatever order
    # it frees them can abort a rank ("terminate called without an active exception"): destroyed here, every rank
    if torch.distributed.is_initialized():
        gc.collect()  # a DDP reducer a garbage cycle keeps alive must not hold the group's last reference
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
