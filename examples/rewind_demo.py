"""Two-process CPU DDP demo of ``on_non_finite="rewind"``: a NaN on rank 1 is undone in place, and the run finishes.

Run it with ``python examples/rewind_demo.py``; Lightning starts rank 1 itself (gloo, CPU). A checkpoint every 5 steps
(the latest 2 plus ``last``). At step 11 a NaN is written into one gradient element on rank 1 only, after DDP's
all-reduce, so rank 0 never sees it and rank 1's weights take the NaN step: the ranks have diverged.

1. At the next boundary (step 15) every rank rejects the checkpoint, together.
2. Instead of raising, every rank restores ``step=10.ckpt`` in place (weights, Adam's moments and step counts, the LR
   scheduler), publishes nothing for the rejected boundary, and goes on with the next batch: the batches of steps 10
   to 14 are skipped, not replayed. ``trainer.global_step`` goes on counting (15, 16, ...). Rank 0 warns, and appends
   one JSON line to ``ckguard-rewinds.jsonl`` next to the checkpoints.
3. The fit reaches ``max_steps`` in the same processes, without a restart, and every checkpoint on disk is finite
   (``last`` is step 24's; the rejected step 15 was never written, so the top 2 are steps 10 and 20)::

    [1] rank 1 sees a NaN at step 11; the boundary at step 15 is rejected on every rank
    [2] rewound in place to step=10.ckpt (global step 10)
        discarded the updates of steps 10 to 14; batches 10 to 14 skipped, not replayed
        ckguard-rewinds.jsonl: {"number": 1, "boundary": "train batch end", "global_step": 15, ...}
    [3] finished at global step 24 with finite weights on every rank
        last.ckpt (finite), step=10.ckpt (finite), step=20.ckpt (finite)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import warnings
from datetime import timedelta

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.recover.rewind import REWIND_LOG_NAME

FAULT_STEP = 11
MAX_STEPS = 24


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self):
        # DDP has already all-reduced the gradients here, so only rank 1 holds the NaN
        if self.global_step == FAULT_STEP and self.global_rank == 1:
            self.net[2].weight.grad[0, 0] = float("nan")

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True) / 4), batch_size=16)


def finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def on_disk(dirpath: str) -> str:
    def state(name: str) -> str:
        weights = torch.load(os.path.join(dirpath, name), map_location="cpu", weights_only=False)["state_dict"]
        return "finite" if all(torch.isfinite(t).all() for t in weights.values()) else "NaN weights"

    return ", ".join(f"{name} ({state(name)})" for name in sorted(os.listdir(dirpath)) if name.endswith(".ckpt"))


@rank_zero_only
def say(*lines: str) -> None:
    print("\n".join(lines))


def main() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    root = os.environ.setdefault("CKGUARD_DEMO_DIR", tempfile.mkdtemp(prefix="ckguard-rewind-demo-"))
    dirpath = os.path.join(root, "checkpoints")
    seed_everything(0, verbose=False)
    checkpoint = FiniteGradCheckpoint(dirpath=dirpath, filename="{step}", monitor="step", mode="max", save_top_k=2,
                                      every_n_train_steps=5, save_last=True, on_non_finite="rewind", max_rewinds=3)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)),
                      max_steps=MAX_STEPS, callbacks=[checkpoint], logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    model = Regression()
    trainer.fit(model)  # no exception: the rewind happens inside the fit, on every rank

    (rewind,) = checkpoint.rewinds  # the same record on every rank
    say(f"[1] rank 1 sees a NaN at step {rewind.first_step}; the boundary at step {rewind.global_step} is rejected "
        f"on every rank")
    assert rewind.discarded_steps is not None and rewind.skipped_batches is not None
    say(f"[2] rewound in place to {os.path.basename(rewind.checkpoint)} (global step {rewind.checkpoint_global_step})",
        f"    discarded the updates of steps {rewind.discarded_steps[0]} to {rewind.discarded_steps[1]}; batches "
        f"{rewind.skipped_batches[0]} to {rewind.skipped_batches[1]} skipped, not replayed")
    if trainer.is_global_zero:
        with open(os.path.join(dirpath, REWIND_LOG_NAME)) as f:
            line = json.loads(f.readline())
        say(f"    {REWIND_LOG_NAME}: {json.dumps({k: line[k] for k in ('number', 'boundary', 'global_step')})[:-1]}, "
            "...}")
    # every rank's own weights: rank 1's took the NaN step before the rewind
    everywhere = trainer.strategy.reduce_boolean_decision(finite(model), all=True)
    # read by rank 0 alone: it removes the directory right after (another rank reading it then would find it gone)
    listing = on_disk(dirpath) if trainer.is_global_zero else ""
    say(f"[3] finished at global step {trainer.global_step} with "
        f"{'finite weights on every rank' if everywhere else 'NaN weights on some rank'}",
        f"    {listing}")
    if trainer.is_global_zero and "CKGUARD_KEEP" not in os.environ:
        shutil.rmtree(root, ignore_errors=True)
    # Lightning leaves the process group to the interpreter's exit, where destroying gloo's objects in whatever order
    # it frees them can abort a rank ("terminate called without an active exception"): destroyed here, every rank
    if torch.distributed.is_initialized():
        gc.collect()  # a DDP reducer a garbage cycle keeps alive must not hold the group's last reference
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
