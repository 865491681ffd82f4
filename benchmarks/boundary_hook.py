"""The checkpoint callback's batch-end hook, timed in place: ``FiniteGradCheckpoint`` against ``ModelCheckpoint``.

Each row is one ``Trainer.fit`` of a small MLP (single process, CPU) whose checkpoint callback's
``on_train_batch_end`` is wrapped by a timer, so only that hook's own time is counted (the guard's recording hook
runs elsewhere and is measured by ``recording_cost.py`` and ``end_to_end.py``). Two kinds of boundary:

  not due    ``every_n_train_steps`` out of reach: the hook decides to write nothing (every step of a real run)
  writing    ``every_n_train_steps=1, save_top_k=2`` with a monitored value that improves every step: each hook
             saves one file and evicts one (into a temporary directory; the agreement, staging and rename included)

Rows alternate run by run (``--repeats`` rounds); the table gives the median and minimum per-hook time over all
timed steps of all rounds and the ratio to ``ModelCheckpoint``. To compare two versions of the package, run this
script under each (``PYTHONPATH=<other checkout>``) and compare the ratios.

    python benchmarks/boundary_hook.py                 # ~1 min on 2 cores
    python benchmarks/boundary_hook.py --steps 200 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, ms, table  # noqa: E402

import lightning_ckguard  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402


class ImprovingMLP(pl.LightningModule):
    """A 784-256-10 MLP that logs ``score``, which falls every step, so every writing boundary enters the top K."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("score", float(-self.global_step))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def timed_fit(callback: ModelCheckpoint, steps: int, warmup: int) -> list[float]:
    """Per-call seconds of ``callback.on_train_batch_end`` over ``steps`` timed steps after ``warmup`` steps."""
    times: list[float] = []
    hook = callback.on_train_batch_end

    def timed_hook(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        hook(*args, **kwargs)
        times.append(time.perf_counter() - start)

    callback.on_train_batch_end = timed_hook  # type: ignore[method-assign]
    data = TensorDataset(torch.randn(64, 784), torch.randint(0, 10, (64,)))
    seed_everything(0, verbose=False)
    trainer = Trainer(max_steps=steps + warmup, callbacks=[callback], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(ImprovingMLP(), DataLoader(data, batch_size=64))
    return times[warmup:]


def make_callback(name: str, kind: str, dirpath: str) -> ModelCheckpoint:
    cls = FiniteGradCheckpoint if name == "FiniteGradCheckpoint" else ModelCheckpoint
    if kind == "not due":
        return cls(dirpath=dirpath, every_n_train_steps=10**9)
    return cls(dirpath=dirpath, monitor="score", every_n_train_steps=1, save_top_k=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every row runs once per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    names = ["ModelCheckpoint", "FiniteGradCheckpoint"]
    print(f"# boundary hook, {machine()}")
    print(f"lightning_ckguard from {Path(lightning_ckguard.__file__).parent}\n")
    rows = []
    for kind in ("not due", "writing"):
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names if repeat % 2 == 0 else reversed(names):
                with tempfile.TemporaryDirectory() as dirpath:
                    times[name] += timed_fit(make_callback(name, kind, dirpath), args.steps, args.warmup)
        base, base_min = median(times["ModelCheckpoint"]), min(times["ModelCheckpoint"])
        for name in names:
            values = times[name]
            rows.append([kind, name, ms(median(values)), f"{median(values) / base:.2f}x", ms(min(values)),
                         f"{min(values) / base_min:.2f}x", len(values)])
    print(table(["boundary", "callback", "median ms", "ratio", "min ms", "min ratio", "hooks timed"], rows))


if __name__ == "__main__":
    main()
