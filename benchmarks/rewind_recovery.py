"""Time to recover from a non-finite step, 2-process CPU DDP: rewind in place vs raise and restart from ``last``.

Each round runs three 2-process jobs (Lightning's subprocess launcher, gloo) of the same 2.4M-parameter MLP with Adam
and a checkpoint every 10 steps (top 2 plus ``last``); a NaN reaches rank 1 only at step 25, so the boundary at step
30 is rejected:

  rewind    ``on_non_finite="rewind"``: every rank restores ``step=20.ckpt`` in place and trains on. Time to recover:
            from the start of the rejected boundary to the start of the next training batch, inside the same job
            (the agreement, the restore through the strategy's load path, the rank-0 log line).
  restart   ``on_non_finite="raise"``: every rank raises; the job exits, and a new 2-process job is launched with
            ``ckpt_path="last"``. Time to recover: from the start of the rejected boundary in the first job to the
            first training batch of the new one (teardown and exit, process launch and imports, process-group setup
            and DDP wrapping, the restore, the data loader's first batch). A scheduler's own reaction time comes on
            top and is not counted.

Rounds alternate the order of the two rows. The table gives the median and the minimum over the rounds and the
ratio restart / rewind; the restart column is split into its phases (rank 0's clock).

    flock /tmp/ckguard-mp.lock python benchmarks/rewind_recovery.py             # ~2 min on 2 cores, 3 rounds
    flock /tmp/ckguard-mp.lock python benchmarks/rewind_recovery.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

STARTED = time.time()  # this process's start, after the interpreter itself (the imports below are timed)

import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, table  # noqa: E402

import lightning_ckguard.recover.rewind as rewind_module  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError  # noqa: E402

IMPORTED = time.time()
FAULT_STEP, EVERY, MAX_STEPS = 25, 10, 40


class MLP(LightningModule):
    def __init__(self, inject_fault: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                                       torch.nn.Tanh(), torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                                       torch.nn.Linear(1024, 1))
        self.inject_fault = inject_fault

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_after_backward(self) -> None:
        if self.inject_fault and self.global_step == FAULT_STEP and self.global_rank == 1:
            self.net[-1].weight.grad[0, 0] = float("nan")  # after DDP's all-reduce: rank 1 alone

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 256, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=32)


class Clock(Callback):
    """Rank 0's wall clock at the rejected boundary, at fit start and at the first batch after either."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.times["fit_start"] = time.time()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.times.setdefault("first_batch", time.time())
        if "rejected" in self.times:
            self.times.setdefault("next_batch", time.time())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # runs before the checkpoint callback's own hook (Lightning runs checkpoint callbacks last)
        if trainer.global_step == FAULT_STEP + (EVERY - FAULT_STEP % EVERY):
            self.times.setdefault("rejected", time.time())


def job(kind: str, out: str) -> None:
    """One 2-process job (this script re-run by Lightning's launcher for rank 1)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    dirpath = os.path.join(out, "checkpoints")
    policy = "rewind" if kind == "rewind" else "raise"
    callback = FiniteGradCheckpoint(dirpath=dirpath, filename="{step}", monitor="step", mode="max", save_top_k=2,
                                    every_n_train_steps=EVERY, save_last=True, on_non_finite=policy)
    clock = Clock()
    restore_seconds: list[float] = []
    original = rewind_module.restore_trainer_state

    def timed_restore(trainer: Any, path: str) -> Any:
        start = time.perf_counter()
        try:
            return original(trainer, path)
        finally:
            restore_seconds.append(time.perf_counter() - start)

    rewind_module.restore_trainer_state = timed_restore  # type: ignore[assignment]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)),
                      max_steps=MAX_STEPS, callbacks=[clock, callback], logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    outcome = "finished"
    try:
        trainer.fit(MLP(inject_fault=kind != "resume"), ckpt_path="last" if kind == "resume" else None)
    except NonFiniteGradientError:
        outcome = "raised"
    if trainer.is_global_zero:
        with open(os.path.join(out, f"{kind}.json"), "w") as f:
            json.dump({"started": STARTED, "imported": IMPORTED, **clock.times, "outcome": outcome,
                       "global_step": trainer.global_step, "restore_s": restore_seconds}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, out: str) -> tuple[dict[str, Any], float, float]:
    """Run one job to its end; returns rank 0's record, and the driver's clock at launch and at exit."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        env.pop(key, None)
    launched = time.time()
    proc = subprocess.run([sys.executable, __file__, "--job", kind, "--out", out], env=env, capture_output=True,
                          text=True, timeout=600)
    exited = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"the {kind} job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, f"{kind}.json")) as f:
        return json.load(f), launched, exited


def round_of(kind: str, root: str) -> dict[str, float]:
    out = tempfile.mkdtemp(dir=root)
    if kind == "rewind":
        record, _, _ = launch("rewind", out)
        assert record["outcome"] == "finished" and record["global_step"] == MAX_STEPS, record
        return {"recover": record["next_batch"] - record["rejected"], "restore": sum(record["restore_s"])}
    failed, _, exited = launch("raise", out)
    assert failed["outcome"] == "raised", failed
    resumed, launched, _ = launch("resume", out)
    assert resumed["outcome"] == "finished" and resumed["global_step"] == MAX_STEPS, resumed
    return {
        "recover": resumed["first_batch"] - failed["rejected"],
        "teardown": exited - failed["rejected"],
        "launch": resumed["imported"] - launched,  # interpreter start and imports, rank 0
        "setup_restore": resumed["fit_start"] - resumed["imported"],  # process group, DDP, ckpt_path restore
        "first_batch": resumed["first_batch"] - resumed["fit_start"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", choices=("rewind", "raise", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job, args.out)
        return
    root = tempfile.mkdtemp(prefix="ckguard-rewind-bench-")
    results: dict[str, list[dict[str, float]]] = {"rewind": [], "restart": []}
    try:
        for index in range(args.rounds):
            for kind in ("rewind", "restart") if index % 2 == 0 else ("restart", "rewind"):
                results[kind].append(round_of(kind, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in MLP(False).parameters())
    print(f"{machine()}; 2-process CPU DDP, {params / 1e6:.1f}M parameters (Adam), {args.rounds} rounds\n")

    def column(kind: str, key: str) -> tuple[float, float]:
        values = [r[key] for r in results[kind]]
        return median(values), min(values)

    rewind, restart = column("rewind", "recover"), column("restart", "recover")
    print(table(["row", "time to recover, median s", "min s", "ratio to rewind (median)"], [
        ["rewind in place", f"{rewind[0]:.2f}", f"{rewind[1]:.2f}", "1.00x"],
        ["raise + restart from last", f"{restart[0]:.2f}", f"{restart[1]:.2f}", f"{restart[0] / rewind[0]:.1f}x"],
    ]))
    print()
    rows = [["rewind: restore through the strategy's load path", *(f"{v:.2f}" for v in column("rewind", "restore"))]]
    for key, label in (("teardown", "restart: the failed job tears down and exits"),
                       ("launch", "restart: new job's launch and imports (rank 0)"),
                       ("setup_restore", "restart: process group, DDP setup, restore from last"),
                       ("first_batch", "restart: fit start to the first batch")):
        rows.append([label, *(f"{v:.2f}" for v in column("restart", key))])
    print(table(["phase", "median s", "min s"], rows))


if __name__ == "__main__":
    main()
