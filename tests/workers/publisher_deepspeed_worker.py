"""``CheckpointPublisher`` under Fabric's DeepSpeed (ZeRO-2, fp32) on two CPU processes (gloo), run by
``tests/publish/test_publisher_deepspeed.py`` as

    python publisher_deepspeed_worker.py OUT_DIR

Fabric's launcher starts rank 1 by re-running this script; DeepSpeed runs on CPU through ``tests/deepspeed_shim.py``
(``CPUFabricDeepSpeedStrategy``), its collectives time out after 30 s. A ``GradientGuard`` and a
``CheckpointPublisher`` save every 2 steps, each save a DeepSpeed checkpoint directory (every rank writes its own
optimizer partition file):

- step 2 publishes;
- step 4: rank 1's write runs under a file-size limit (``RLIMIT_FSIZE``, ``SIGXFSZ`` ignored), so the kernel refuses
  the rest of its partition file partway, as a full disk would: the write fails inside DeepSpeed's
  ``engine.save_checkpoint``, which still has a barrier to run on every rank;
- step 6 publishes again, in the same process group.

Each rank writes ``OUT_DIR/rank{N}.json``: per save, what it raised (if anything) and how long it took, its guard's
recorded steps before and after, and (rank 0) the directory's listing and whether its contents changed.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from helpers import deepspeed_unavailable_reported, run_scenarios, tree_digest  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=30)
STEPS = 6
EVERY = 2
REFUSED_STEP = 4
#: rank 1's file-size limit at the refused save: far below its partition file's size (a few KiB)
SIZE_LIMIT = 512


@contextmanager
def files_limited_to(limit: int) -> Iterator[None]:
    """While inside, a write that would make a file of this process larger than ``limit`` bytes fails (``EFBIG``):
    the kernel refuses it partway, the bytes before the limit stay written, as on a disk that fills up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # ignored, the signal lets the write fail with an error instead of killing the process
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


_FABRIC: list[Any] = []  # launched once, shared by the scenarios (a second launch would start a second rank 1)


def _fabric() -> Any:
    import deepspeed_shim
    from lightning.fabric import Fabric

    if _FABRIC:
        return _FABRIC[0]
    config = deepspeed_shim.deepspeed_config(2, "32-true")
    strategy = deepspeed_shim.CPUFabricDeepSpeedStrategy(config=config, timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    _FABRIC.append(fabric)
    return fabric


def _save(fabric: Any, publisher: Any, guard: Any, state: dict[str, Any], step: int) -> dict[str, Any]:
    """One save of the loop, and what each rank observed of it."""
    rank_zero = fabric.global_rank == 0
    before = tree_digest(publisher.dirpath) if rank_zero else None
    refused = step == REFUSED_STEP and fabric.global_rank == 1
    event: dict[str, Any] = {"step": step, "error": None, "recorded_before": guard.steps_recorded}
    started = time.monotonic()
    try:
        with files_limited_to(SIZE_LIMIT) if refused else nullcontext():
            publisher.save(f"step={step}.ckpt", state, global_step=step)
    except Exception as error:
        event["error"] = {"type": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}
    event["seconds"] = time.monotonic() - started
    event["recorded_after"] = guard.steps_recorded
    event["last_verdict_accepted"] = publisher.last_verdict.accepted if publisher.last_verdict else None
    if rank_zero:
        event["unchanged"] = before == tree_digest(publisher.dirpath)
        event["listing"] = sorted(os.listdir(publisher.dirpath))
        event["contents"] = {name: sorted(os.listdir(os.path.join(publisher.dirpath, name, "checkpoint")))
                             for name in event["listing"] if not name.startswith(".")}
    return event


def rank_1_write_fails(out: str) -> dict[str, Any]:
    """Train, saving every ``EVERY`` steps; rank 1's write of the step-``REFUSED_STEP`` save fails."""
    from lightning_ckguard import CheckpointPublisher, GradientGuard

    fabric = _fabric()
    fabric.seed_everything(0, verbose=False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(fabric.strategy, os.path.join(out, "checkpoints"), guard=guard)
    events = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * fabric.global_rank + step)
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) / 4)
        fabric.backward(loss)
        guard.record(optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % EVERY == 0:
            state = {"model": model, "optimizer": optimizer, "step": step + 1}
            events.append(_save(fabric, publisher, guard, state, step + 1))
    return {"events": events}


def nan_gradient_on_rank_1(out: str) -> dict[str, Any]:
    """The documented loop, ``GradientGuard(model)`` on what ``fabric.setup`` returned: step 0 clean, step 1 a NaN in
    rank 1's batch. ZeRO-2 leaves nothing in ``param.grad``; the guard must read the optimizer's partitions. Only
    the gradients decide (``agree`` without ``state``), before the optimizer applies anything."""
    from lightning_ckguard import GradientGuard

    fabric = _fabric()
    fabric.seed_everything(0, verbose=False)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    try:  # built on the bare module, before its engine existed: it could only read the empty param.grad
        GradientGuard(net).record(optimizer)
        refused = None
    except ValueError as error:
        refused = str(error)
    guard = GradientGuard(model)
    verdicts = []
    for step in range(2):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * fabric.global_rank + step))
        if step == 1 and fabric.global_rank == 1:
            x[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) / 4)
        fabric.backward(loss, model=model)  # a second engine in this process: Fabric asks which
        guard.record(optimizer, step=step)
        verdict = guard.agree(fabric.strategy)
        verdicts.append({"accepted": verdict.accepted, "ranks": list(verdict.ranks), "reason": verdict.reason})
        if verdict.accepted:
            optimizer.step()
            guard.reset()
        optimizer.zero_grad()
    return {"source": type(guard.source).__name__, "verdicts": verdicts, "bare_module_refused": refused}


def main() -> None:
    out = sys.argv[1]
    if deepspeed_unavailable_reported(out):  # imports the CPU shim before anything imports DeepSpeed
        return
    run_scenarios({"rank-1-write-fails": rank_1_write_fails, "nan-gradient-on-rank-1": nan_gradient_on_rank_1}, out,
                  set())


if __name__ == "__main__":
    main()
