"""Two-rank CPU/gloo scenarios for the state check, run by ``tests/lightning/test_state_verification.py``:

    python state_verification_worker.py OUT_DIR KIND [KIND ...]

Every rank runs each ``KIND`` in order, in one process group (a Trainer per kind, each with its own strategy), and
writes what it observed to ``OUT_DIR/rank{N}.json`` after each one. ``KIND`` says where rank 1's state is poisoned,
with finite gradients throughout:

- ``ddp-buffer``: a BatchNorm running statistic (DDP);
- ``zero1-moment``: the momentum buffer of rank 1's shard of a ``ZeroRedundancyOptimizer`` (DDP + ZeRO-1);
- ``zero2-master``: rank 1's fp32 master partition (DeepSpeed ZeRO-2);
- ``fsdp2-shard``: rank 1's shard of a parameter (FSDP2);
- ``ema-copy``: the averaged copy of ``EMAWeightAveraging`` only (DDP).

The poison is written at the end of the batch that brings ``global_step`` to 4, right before the checkpoint
callback's own hook of that batch would write ``step=4.ckpt`` and move ``last``.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from strategies import make_strategy  # noqa: E402
from torch import nn  # noqa: E402

from helpers import QUIET, fit_outcome, ledger_state, run_scenarios, tree_digest  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

TIMEOUT = timedelta(seconds=60)
POISON_STEP = 4
STRATEGY = {"ddp-buffer": "ddp", "zero1-moment": "zero1", "zero2-master": "ds2", "fsdp2-shard": "fsdp2",
            "ema-copy": "ddp"}


class StateModel(BoringModel):
    """``stem -> BatchNorm -> tanh -> out``, trained with SGD with momentum (ZeRO-1 for ``zero1``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        del self.layer
        self.kind = kind
        self.stem = nn.Linear(32, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def configure_model(self) -> None:
        if self.kind == "fsdp2-shard":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.stem, self.out):
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.bn(self.stem(x))))

    def train_dataloader(self) -> Any:
        # BatchNorm needs more than one sample per batch
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32)), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch[0], batch_idx)

    def configure_optimizers(self) -> Any:
        if self.kind == "zero1-moment":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def poison(kind: str, trainer: Trainer, module: StateModel) -> None:
    """Write one NaN into rank 1's state where ``kind`` says."""
    nan = float("nan")
    with torch.no_grad():
        if kind == "ddp-buffer":
            module.bn.running_var[2] = nan
        elif kind == "zero1-moment":
            local = trainer.optimizers[0].optim  # this rank's shard
            moments = [local.state[p]["momentum_buffer"] for g in local.param_groups for p in g["params"]]
            moments[0].view(-1)[0] = nan
        elif kind == "zero2-master":
            trainer.strategy.model.optimizer.single_partition_of_fp32_groups[0][0] = nan
        elif kind == "fsdp2-shard":
            module.stem.weight.to_local().view(-1)[0] = nan
        elif kind == "ema-copy":
            ema = next(c for c in trainer.callbacks if type(c).__name__ == "EMAWeightAveraging")
            next(ema._average_model.parameters()).view(-1)[0] = nan


class PoisonRankOne(Callback):
    """At the end of the batch that reaches ``POISON_STEP``: snapshot the directory and ledger, then poison rank 1."""

    def __init__(self, kind: str, checkpoint: FiniteGradCheckpoint) -> None:
        self.kind = kind
        self.checkpoint = checkpoint
        self.snapshot: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != POISON_STEP or self.snapshot is not None:
            return
        self.snapshot = {"tree": tree_digest(self.checkpoint.dirpath) if trainer.global_rank == 0 else None,
                         "state": ledger_state(self.checkpoint)}
        if trainer.global_rank == 1:
            poison(self.kind, trainer, pl_module)


def run(kind: str, out: str) -> dict[str, Any]:
    seed_everything(7)
    dirpath = os.path.join(out, kind)
    checkpoint = FiniteGradCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2,
                                      every_n_train_steps=2, save_last=True, filename="{step}")
    probe = PoisonRankOne(kind, checkpoint)
    callbacks: list[Any] = [probe, checkpoint]
    if kind == "ema-copy":
        from lightning.pytorch.callbacks import EMAWeightAveraging

        callbacks.insert(0, EMAWeightAveraging(decay=0.5))
    precision = "32-true"
    strategy = make_strategy(STRATEGY[kind], timeout=TIMEOUT, precision=precision, check_grad_overflow=False)
    trainer = Trainer(strategy=strategy, devices=2, precision=precision, callbacks=callbacks,  # type: ignore[arg-type]
                      max_steps=8, limit_val_batches=0, **QUIET)
    result = fit_outcome(lambda: trainer.fit(StateModel(kind)))
    result.update(
        snapshot=probe.snapshot,
        tree=tree_digest(dirpath) if trainer.global_rank == 0 else None,
        state=ledger_state(checkpoint),
        global_step=trainer.global_step,
    )
    return result


def main() -> None:
    out, kinds = sys.argv[1], sys.argv[2:]
    if any(STRATEGY[kind].startswith("ds") for kind in kinds):
        import deepspeed_shim  # before DeepSpeed is imported anywhere (see the shim)

        if deepspeed_shim.DEEPSPEED_UNAVAILABLE:
            kinds = [kind for kind in kinds if not STRATEGY[kind].startswith("ds")]
    run_scenarios({kind: lambda root, kind=kind: run(kind, root) for kind in kinds}, out, set())


if __name__ == "__main__":
    main()
