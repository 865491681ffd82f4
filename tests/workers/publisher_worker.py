"""``CheckpointPublisher`` under Fabric on two CPU processes (gloo), run by ``tests/publish/test_publisher.py`` as

    python publisher_worker.py OUT_DIR [SCENARIO ...]

Fabric's launcher starts rank 1 by re-running this script. Every scenario gets its own Fabric (one process group per
strategy, collectives time out after 60 s) and its own checkpoint directory under ``OUT_DIR``; each rank rewrites
``OUT_DIR/rank{N}.json`` after each scenario:

- ``nan-on-rank-1`` (DDP): saves at steps 4, 8, 12; a NaN in one gradient element on rank 1 only at step 7, after
  the all-reduce. Step 8's save raises on both ranks and writes nothing; every rank rewinds in place to step 4's
  checkpoint (``restore_fabric_state``) and step 12's save publishes.
- ``refused-write-on-rank-0`` (DDP): rank 0's write of step 8 writes half a file, then fails with ``ENOSPC``.
- ``unmakeable-dirpath`` (DDP): ``dirpath`` under a regular file, which rank 0 cannot create.
- ``fsdp2-directory`` (``ModelParallelStrategy``, ``fully_shard``): each save writes a distributed-checkpoint
  directory, one shard file per rank; the directory is published whole, by one rename, after every rank wrote.
- ``fsdp2-fails-before-its-part`` (``ModelParallelStrategy``): rank 1 fails before the distributed checkpoint starts,
  once in a save (an object's ``state_dict()`` raises) and once in a restore (the model's ``state_dict()``, which the
  load fills, raises), and in a restore between the model's load and the optimizer's (the optimizer's
  ``state_dict()``); each is timed, then the same save and restore are done again without the failure.
"""

from __future__ import annotations

import errno
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402

from helpers import run_scenarios, tree_digest  # noqa: E402
from lightning_ckguard import CheckpointPublisher, GradientGuard, restore_fabric_state  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
FAULT_STEP = 7
EVERY = 4
STEPS = 12


def _error(error: BaseException) -> dict[str, Any]:
    return {"type": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}


def _fsdp2(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=device_mesh["data_parallel"])
    return model


def _fabric(kind: str) -> Fabric:
    if kind == "fsdp2":
        strategy: Any = ModelParallelStrategy(_fsdp2, data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    else:
        strategy = DDPStrategy(timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _train(out: str, name: str, kind: str, fault_rank: int | None, refuse_on_rank_0_at: int | None
           ) -> dict[str, Any]:
    fabric = _fabric(kind)
    fabric.seed_everything(0, verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = fabric.setup_module(model)  # sharded first (fully_shard): the optimizer then holds the shards
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    guard = GradientGuard(model)
    dirpath = os.path.join(out, name)
    publisher = CheckpointPublisher(fabric.strategy, dirpath, guard=guard)
    events: list[dict[str, Any]] = []
    last_good: str | None = None
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * fabric.global_rank + step)
        x = torch.randn(32, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) / 4)
        optimizer.zero_grad()
        fabric.backward(loss)
        if step == FAULT_STEP and fabric.global_rank == fault_rank:
            grad = model.module[0].weight.grad  # under fully_shard a DTensor: this rank's shard of it
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("nan")  # after the all-reduce: this rank alone sees it
        guard.record(optimizer, step=step)
        optimizer.step()
        if (step + 1) % EVERY:
            continue
        ckpt = f"step={step + 1}.ckpt"
        state = {"model": model, "optimizer": optimizer, "step": step + 1}
        before = tree_digest(dirpath) if fabric.global_rank == 0 else None
        event: dict[str, Any] = {"step": step + 1, "error": None}
        restore = None
        if refuse_on_rank_0_at == step + 1 and fabric.global_rank == 0:
            restore = _refuse_next_write(fabric)
        try:
            publisher.save(ckpt, state, global_step=step + 1)
            last_good = ckpt
        except Exception as error:
            event["error"] = _error(error)
            if last_good is not None:  # rewind in place, on every rank together, and train on
                restore_fabric_state(fabric, os.path.join(dirpath, last_good), {"model": model, "optimizer": optimizer},
                                     guard)
        finally:
            if restore is not None:
                restore()
        event["unchanged"] = before == tree_digest(dirpath) if fabric.global_rank == 0 else None
        event["listing"] = sorted(os.listdir(dirpath)) if fabric.global_rank == 0 else None
        event["published_is_directory"] = os.path.isdir(os.path.join(dirpath, ckpt)) if fabric.global_rank == 0 \
            else None
        events.append(event)
    loaded = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(os.path.join(dirpath, last_good), loaded) if last_good else {}
    return {"events": events, "loaded_step": remainder.get("step"), "shards": _shards(dirpath, last_good, fabric),
            "kept": _twice_under_one_name(publisher, {"model": model, "optimizer": optimizer}, fabric, dirpath)}


def _twice_under_one_name(publisher: CheckpointPublisher, state: dict[str, Any], fabric: Fabric, dirpath: str
                          ) -> dict[str, list[str]] | None:
    """``last.ckpt`` saved three times, then ``close()``: the listing after each (rank 0)."""
    listings: dict[str, list[str]] = {}
    for when in ("first", "second", "third"):
        publisher.save("last.ckpt", state)
        listings[when] = sorted(os.listdir(dirpath))
    publisher.close()
    fabric.barrier()
    listings["closed"] = sorted(os.listdir(dirpath))
    return listings if fabric.global_rank == 0 else None


def _shards(dirpath: str, name: str | None, fabric: Fabric) -> list[str] | None:
    path = os.path.join(dirpath, name) if name else None
    if fabric.global_rank != 0 or path is None or not os.path.isdir(path):
        return None
    return sorted(os.listdir(path))


def _refuse_next_write(fabric: Fabric) -> Any:
    """Rank 0's next checkpoint write puts half a file down, then fails as a full disk would."""
    checkpoint_io = fabric.strategy.checkpoint_io
    save = checkpoint_io.save_checkpoint

    def half_then_full(checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        with open(path, "wb") as f:
            f.write(b"\0" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    checkpoint_io.save_checkpoint = half_then_full

    def restore() -> None:
        checkpoint_io.save_checkpoint = save

    return restore


class _FailingOnRank1:
    """An object saved with the checkpoint whose ``state_dict()`` raises on rank 1 while ``failing`` is set."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failing = rank, False

    def state_dict(self) -> dict[str, Any]:
        if self.failing and self.rank == 1:
            raise RuntimeError("this object's state_dict fails on rank 1")
        return {"rank": self.rank}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _timed(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
        error = None
    except Exception as caught:
        error = _error(caught)
    return {"error": error, "seconds": time.monotonic() - start}


def _fails_before_its_part(out: str) -> dict[str, Any]:
    """Rank 1 fails before the distributed checkpoint's collectives, in a save and in a restore; rank 0 is inside
    them by then, and must not wait there until the 60 s timeout."""
    fabric = _fabric("fsdp2")
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    dirpath = os.path.join(out, "fails-before")
    publisher = CheckpointPublisher(fabric.strategy, dirpath, guard=GradientGuard(model))
    extra = _FailingOnRank1(fabric.global_rank)
    state = {"model": model, "optimizer": optimizer, "extra": extra}
    publisher.save("good.ckpt", state)
    extra.failing = True
    failed_save = _timed(lambda: publisher.save("bad.ckpt", state))
    fabric.barrier()
    listing = sorted(os.listdir(dirpath))
    extra.failing = False
    failing_load = [fabric.global_rank == 1]

    def fails_on_rank_1(*args: Any) -> None:
        if failing_load[0]:
            raise RuntimeError("the model's state_dict fails on rank 1")

    model.module.register_state_dict_pre_hook(fails_on_rank_1)
    path = os.path.join(dirpath, "good.ckpt")
    failed_restore = _timed(lambda: restore_fabric_state(fabric, path, {"model": model, "optimizer": optimizer}))
    failing_load[0] = False
    # between the model's distributed-checkpoint load and the optimizer's: the optimizer's state_dict, on rank 1
    failing_optimizer = [fabric.global_rank == 1]

    def optimizer_fails_on_rank_1(*args: Any) -> None:
        if failing_optimizer[0]:
            raise RuntimeError("the optimizer's state_dict fails on rank 1")

    optimizer.optimizer.register_state_dict_pre_hook(optimizer_fails_on_rank_1)
    failed_optimizer_restore = _timed(
        lambda: restore_fabric_state(fabric, path, {"model": model, "optimizer": optimizer}))
    failing_optimizer[0] = False
    return {"failed_save": failed_save, "listing": listing, "failed_restore": failed_restore,
            "failed_optimizer_restore": failed_optimizer_restore,
            "save_again": _timed(lambda: publisher.save("again.ckpt", state)),
            "restore_again": _timed(lambda: restore_fabric_state(fabric, path, {"model": model})),
            "final_listing": sorted(os.listdir(dirpath))}


def _unmakeable_dirpath(out: str) -> dict[str, Any]:
    """``dirpath`` under a regular file: rank 0 cannot create it, and every rank must hear of it at construction."""
    fabric = _fabric("ddp")
    blocker = os.path.join(out, "a-file")
    if fabric.global_rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    fabric.barrier()
    try:
        CheckpointPublisher(fabric.strategy, os.path.join(blocker, "checkpoints"))
        error = None
    except Exception as caught:
        error = _error(caught)
    fabric.barrier()  # every rank is still here: none was left waiting
    return {"error": error}


def main() -> None:
    scenarios = {
        "unmakeable-dirpath": _unmakeable_dirpath,
        "nan-on-rank-1": lambda out: _train(out, "nan", "ddp", fault_rank=1, refuse_on_rank_0_at=None),
        "refused-write-on-rank-0": lambda out: _train(out, "refused", "ddp", fault_rank=None, refuse_on_rank_0_at=8),
        "fsdp2-directory": lambda out: _train(out, "fsdp2", "fsdp2", fault_rank=1, refuse_on_rank_0_at=None),
        "fsdp2-fails-before-its-part": _fails_before_its_part,
    }
    run_scenarios(scenarios, sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
