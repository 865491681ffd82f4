"""Step time right after an accepted boundary, synchronous saves against ``AsyncCheckpointIO``.

Each row is one ``Trainer.fit`` (single process, CPU) of an MLP whose checkpoint (weights and Adam state, ~200 MB at
the default width) takes long enough to write to see it. Every ``--every`` steps a boundary is accepted and saves
one checkpoint (the previous one evicted). A timer callback reads the clock at every batch start, so a step's time
includes its batch-end hooks, where the checkpoint callback saves:

  boundary step   the step whose batch end saves (a synchronous save writes the whole file there)
  next step       the step right after it (a background write is still running then, competing for the CPU)
  other steps     the steps between boundaries, for reference

Rows: ``FiniteGradCheckpoint`` and ``ModelCheckpoint``, each without and with ``AsyncCheckpointIO``; they alternate
run by run (``--repeats`` rounds), and the table gives medians over all rounds with ratios to synchronous
``FiniteGradCheckpoint``. The total fit time per row includes waiting for the last background write at the end.

    python benchmarks/async_saves.py                  # ~2 min on 2 cores
    python benchmarks/async_saves.py --width 1024 --repeats 5
    python benchmarks/async_saves.py --threads 1      # training on one core, the other free for the write

On a machine with as many cores as training threads, a background write competes with the next steps for the CPU
(and for the GIL while ``torch.save`` pickles): the step right after a boundary is then slower, not faster. With a
core to spare (``--threads 1`` on 2 cores; on a GPU machine, where the step runs on the device) it is not.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, ms, table  # noqa: E402

from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402


class WideMLP(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class StepClock(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


ROWS = {
    "FiniteGradCheckpoint": (FiniteGradCheckpoint, False),
    "FiniteGradCheckpoint + AsyncCheckpointIO": (FiniteGradCheckpoint, True),
    "ModelCheckpoint": (ModelCheckpoint, False),
    "ModelCheckpoint + AsyncCheckpointIO": (ModelCheckpoint, True),
}


def run(row: str, args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    callback_class, asynchronous = ROWS[row]
    return timed_fit(lambda dirpath: callback_class(dirpath=dirpath, every_n_train_steps=args.every, save_top_k=1),
                     asynchronous, args, root)


def timed_fit(make_callback: Callable[[Path], Callback], asynchronous: bool, args: argparse.Namespace, root: Path
              ) -> dict[str, list[float]]:
    """One fit with the callback ``make_callback(dirpath)`` makes: the boundary steps, the steps right after them,
    the other steps (seconds), and the whole fit."""
    dirpath = Path(tempfile.mkdtemp(dir=root))
    clock = StepClock()
    callback = make_callback(dirpath)
    seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randn(args.steps * args.batch, args.width)), batch_size=args.batch)
    trainer = Trainer(max_steps=args.steps, callbacks=[callback, clock], plugins=[AsyncCheckpointIO()] if asynchronous
                      else None, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", enable_checkpointing=True)
    started = time.perf_counter()
    trainer.fit(WideMLP(args.width, args.depth), data)
    total = time.perf_counter() - started
    shutil.rmtree(dirpath)
    # step i: from its start to the next one's
    durations = [b - a for a, b in zip(clock.starts[:-1], clock.starts[1:], strict=True)]
    # the boundaries after the first (a warm-up: the first save opens files, starts threads)
    boundary = [i for i in range(len(durations)) if (i + 1) % args.every == 0 and i + 1 > args.every]
    return {
        "boundary step": [durations[i] for i in boundary],
        "next step": [durations[i + 1] for i in boundary if i + 1 < len(durations)],
        "other steps": [d for i, d in enumerate(durations) if i > 1 and i not in boundary and i - 1 not in boundary],
        "fit": [total],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    parameters = args.depth * (args.width * args.width + args.width)
    print(f"# {machine()}")
    print(f"# MLP {args.depth}x{args.width} ({parameters / 1e6:.1f}M parameters, checkpoint ~"
          f"{parameters * 12 / 1e6:.0f} MB with Adam), a save every {args.every} of {args.steps} steps, "
          f"{args.repeats} rounds")
    root = Path(tempfile.mkdtemp(prefix="ckguard-async-bench-"))
    results: dict[str, dict[str, list[float]]] = {row: {} for row in ROWS}
    names = list(ROWS)
    try:
        for repeat in range(args.repeats):
            for row in names if repeat % 2 == 0 else reversed(names):
                for key, values in run(row, args, root).items():
                    results[row].setdefault(key, []).extend(values)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    baseline = median(results["FiniteGradCheckpoint"]["boundary step"])
    rows = []
    for row in ROWS:
        r = results[row]
        step = median(r["boundary step"])
        rows.append([row, ms(step), f"{step / baseline:.2f}x", ms(median(r["next step"])), ms(median(r["other steps"])),
                     f"{median(r['fit']):.2f} s"])
    print(table(["row", "boundary step (ms)", "vs sync FiniteGradCheckpoint", "next step (ms)", "other steps (ms)",
                 "fit"], rows))


if __name__ == "__main__":
    main()
