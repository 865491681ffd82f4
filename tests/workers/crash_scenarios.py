"""Crashes during a directory checkpoint save, run by ``tests/test_crash.py``:

    python crash_scenarios.py OUT_DIR PHASE

Two ranks (gloo, CPU) train FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) and save a distributed-checkpoint
directory every 2 steps, plus ``last``. At the save of global step 4 the process(es) die by ``SIGKILL``:

- ``rank1-before-write``: rank 1 dies as its write starts; rank 0 is left mid-save and fails in the collective;
- ``all-after-write``: every rank dies in Lightning's post-save barrier: everything is written, nothing published;
- ``resume``: no crash; a new fit resumes from ``ckpt_path="last"`` and trains to step 6.

Each rank writes ``rank{N}.json`` when it finishes; the killed ones write nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402

from helpers import QUIET  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
CRASH_STEP = 4


class CrashingStrategy(ModelParallelStrategy):
    """FSDP2 on CPU that kills its own process at one point of the save at ``CRASH_STEP``."""

    def __init__(self, phase: str) -> None:
        super().__init__(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=30))
        self.phase = phase

    def _crash_now(self) -> bool:
        return self.lightning_module.trainer.global_step == CRASH_STEP

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.phase == "rank1-before-write" and self._crash_now() and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def barrier(self, name: str | None = None) -> None:
        if self.phase == "all-after-write" and name == "Trainer.save_checkpoint" and self._crash_now():
            os.kill(os.getpid(), signal.SIGKILL)
        super().barrier(name)


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    dirpath = os.path.join(out, "ckpts")
    seed_everything(7)
    callback = FiniteGradCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True,
                                    filename="{step}")
    trainer = Trainer(strategy=CrashingStrategy(phase), devices=2, callbacks=[callback], max_steps=6,
                      limit_val_batches=0, **QUIET)
    result: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(ShardedFaultModel(fsdp2=True), ckpt_path="last" if phase == "resume" else None)
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"
    result.update(
        global_step=trainer.global_step,
        warnings=[str(w.message) for w in caught if "FiniteGradCheckpoint" in str(w.message)],
        best_k_models=sorted(callback.best_k_models),
        last_model_path=callback.last_model_path,
    )
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
