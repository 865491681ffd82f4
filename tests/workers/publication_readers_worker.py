"""What readers and background writes see of publication, on two ranks (gloo, CPU), run by
``tests/publish/test_publication_readers.py``:

    python publication_readers_worker.py STRATEGY OUT_DIR [SCENARIO ...]

``STRATEGY`` is ``ddp`` (single files written by rank 0), ``ds2`` (DeepSpeed ZeRO-2 directories through
``tests/deepspeed_shim.py``) or ``fsdp2`` (distributed-checkpoint directories). Scenarios:

- ``reader``, ``reader-plain``: a save at every step for ``SAVES`` steps (the two newest kept, ``save_last=True``),
  with ``FiniteGradCheckpoint`` or plain ``ModelCheckpoint`` (the control), while rank 0 runs
  ``workers/poll_last.py`` in a separate process, polling ``last.ckpt`` and the best checkpoint; its counts are the
  result;
- ``async-fail-next``, ``async-fail-end`` (``ddp``): ``AsyncCheckpointIO`` over a checkpoint IO that fails like a full
  disk for step 4's (step 6's) checkpoint, keeping only the newest; the failure is noticed at step 6's boundary
  (at the end of training);
- ``async-ok`` (``ddp``): ``AsyncCheckpointIO``, nothing failing.

Each rank writes ``OUT_DIR/rank{N}.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, FailingWrites, FaultyModel, SleepsAtStep, ledger_state, run_scenarios  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
SAVES = int(os.environ.get("CKGUARD_READER_SAVES", "200"))
RANK = int(os.environ.get("LOCAL_RANK", "0"))


class BestFile(Callback):
    """Rank 0 writes the checkpoint callback's ``best_model_path`` to ``best.txt`` at each step's start (one rename,
    so the reader never sees half a path)."""

    def __init__(self, dirpath: str) -> None:
        self.path = os.path.join(dirpath, "best.txt")

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
        if trainer.is_global_zero and best:
            with open(self.path + ".tmp", "w") as f:
                f.write(best)
            os.replace(self.path + ".tmp", self.path)


def _trainer(strategy: str, callbacks: list, max_steps: int, plugins: list | None = None) -> Trainer:
    kind = {"ddp": "ddp", "ds2": "ds2", "fsdp2": "fsdp2"}[strategy]
    return Trainer(
        strategy=make_strategy(kind, timeout=TIMEOUT, precision="bf16-mixed", check_grad_overflow=False),
        devices=2,
        precision="bf16-mixed" if strategy == "ds2" else "32-true",
        callbacks=callbacks,
        max_steps=max_steps,
        limit_val_batches=0,
        plugins=plugins,
        **QUIET,
    )


def _model(strategy: str) -> Any:
    return FaultyModel() if strategy == "ddp" else ShardedFaultModel(fsdp2=strategy == "fsdp2")


def reader(strategy: str, out: str, plain: bool) -> dict[str, Any]:
    dirpath = os.path.join(out, "reader-plain" if plain else "reader")
    os.makedirs(dirpath, exist_ok=True)
    kwargs: dict[str, Any] = dict(dirpath=dirpath, filename="{step}", monitor="step", mode="max", save_top_k=2,
                                  save_last=True, every_n_train_steps=1)
    callback = ModelCheckpoint(**kwargs) if plain else FiniteGradCheckpoint(**kwargs)
    stop, counts_file = os.path.join(dirpath, "..", f"stop-{plain}"), os.path.join(out, f"counts-{plain}.json")
    poller = None
    if RANK == 0:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "poll_last.py")
        strategy_format = {"ddp": "ddp", "ds2": "deepspeed", "fsdp2": "fsdp2"}[strategy]
        poller = subprocess.Popen([sys.executable, script, dirpath, strategy_format, stop, counts_file])
        deadline = time.monotonic() + 50  # within rank 1's 60 s wait at the Trainer's first barrier
        while not os.path.exists(stop + ".ready") and time.monotonic() < deadline and poller.poll() is None:
            time.sleep(0.05)
    seed_everything(7)
    trainer = _trainer(strategy, [callback, BestFile(dirpath)], max_steps=SAVES)
    started = time.monotonic()
    trainer.fit(_model(strategy))
    result: dict[str, Any] = {"saves": trainer.global_step, "fit_seconds": time.monotonic() - started}
    if poller is not None:
        open(stop, "w").close()
        poller.wait(timeout=60)
        with open(counts_file) as f:
            result["counts"] = json.load(f)
    return result


def async_scenario(strategy: str, out: str, failing: str | None, max_steps: int) -> dict[str, Any]:
    dirpath = os.path.join(out, f"async-{failing}")
    callback = FiniteGradCheckpoint(dirpath=dirpath, filename="{step}", monitor="step", mode="max",
                                    save_top_k=1 if failing else 2, save_last=failing is None, every_n_train_steps=2)
    trainer = _trainer(strategy, [callback], max_steps=max_steps, plugins=[AsyncCheckpointIO()])
    seed_everything(7)
    result: dict[str, Any] = {"error": None}
    try:
        with FailingWrites(failing) if failing else contextlib.nullcontext():
            trainer.fit(SleepsAtStep(4))
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["trace"] = traceback.format_exc()
    result.update(global_step=trainer.global_step, state=ledger_state(callback), files=sorted(os.listdir(dirpath)),
                  last_step=torch.load(os.path.join(dirpath, "last.ckpt"), weights_only=False)["global_step"]
                  if os.path.exists(os.path.join(dirpath, "last.ckpt")) else None)
    return result


def main() -> None:
    strategy, out, *only = sys.argv[1:]
    scenarios = {
        "reader": lambda o: reader(strategy, o, plain=False),
        "reader-plain": lambda o: reader(strategy, o, plain=True),
        "async-fail-next": lambda o: async_scenario(strategy, o, "step=4", max_steps=8),
        "async-fail-end": lambda o: async_scenario(strategy, o, "step=6", max_steps=6),
        "async-ok": lambda o: async_scenario(strategy, o, None, max_steps=6),
    }
    run_scenarios(scenarios, out, set(only))


if __name__ == "__main__":
    main()
