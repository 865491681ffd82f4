"""Two-rank CPU/gloo runs of ``GradientGuard`` without a Trainer, for ``tests/publish/test_fabric.py``.

``python fabric_worker.py fabric OUT STEPS FAULT_STEP EVERY``: the training loop of ``examples/fabric_guard.py`` under
Fabric (``strategy="ddp"``, 2 CPU processes, Fabric's own launcher starts rank 1 by re-running this script). Each rank
writes the events it observed to ``OUT/fabric-rank{N}.json``; checkpoints go to ``OUT/checkpoints``.

``python fabric_worker.py restore-fails OUT``: ``restore_fabric_state`` whose load fails on rank 1 only; each rank
writes what it raised to ``OUT/restore-rank{N}.json``.

``python fabric_worker.py process-group OUT``: a raw ``torch.distributed`` gloo process group (no Lightning at all),
two processes from ``torch.multiprocessing.spawn``, a ``DistributedDataParallel`` model and ``guard.agree(group)``
with a group from ``dist.new_group``. Each rank writes ``OUT/pg-rank{N}.json``; rank 0 saves to ``OUT/checkpoints``,
then a ``CheckpointPublisher`` over the group and one over the default group publish into ``OUT/published``.

Collectives time out after 60 s; the test adds a wall-clock timeout that kills the whole process group.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers import leave_without_finalizing  # noqa: E402
from lightning_ckguard import CheckpointPublisher, GradientGuard  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)


def write(out: str, name: str, result: Any) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=1)


def run_fabric(out: str, steps: int, fault_step: int, every: int) -> None:
    import fabric_guard

    fabric = fabric_guard.make_fabric()
    fabric.launch()
    checkpoints = os.path.join(out, "checkpoints")
    if fabric.global_rank == 0:
        os.makedirs(checkpoints, exist_ok=True)
    fabric.barrier()
    events = fabric_guard.train(fabric, steps, fault_step, every, checkpoints)
    write(out, f"fabric-rank{fabric.global_rank}.json", {"world_size": fabric.world_size, "events": events})
    leave_without_finalizing()  # this rank's part is written; gloo's objects are not left to the interpreter's exit


def run_restore_failing_on_rank_1(out: str) -> None:
    """``restore_fabric_state`` whose load fails on rank 1 only (a stale file handle): every rank must raise."""
    import fabric_guard

    from lightning_ckguard import CheckpointRestoreError, restore_fabric_state

    fabric = fabric_guard.make_fabric()
    fabric.launch()
    model, optimizer = fabric.setup(torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters()))
    path = os.path.join(out, "model.ckpt")
    fabric.save(path, {"model": model})
    if fabric.global_rank == 1:
        def stale(*args: Any, **kwargs: Any) -> Any:
            raise OSError(116, "Stale file handle")
        fabric.load = stale
    try:
        restore_fabric_state(fabric, path, {"model": model})
        result: dict[str, Any] = {"raised": None}
    except CheckpointRestoreError as error:
        result = {"raised": type(error).__name__, "ranks": list(error.ranks), "cause": error.cause,
                  "chained": type(error.__cause__).__name__ if error.__cause__ is not None else None}
    fabric.barrier()  # the ranks still meet: none was left waiting
    write(out, f"restore-rank{fabric.global_rank}.json", result)
    leave_without_finalizing()


def process_group_rank(rank: int, out: str) -> None:
    """One rank of the raw torch.distributed scenario: record, agree on a ProcessGroup, save on rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        _run_process_group(rank, out)
    finally:
        # The DDP model must be gone before the process group is destroyed. If its reducer held the last reference
        # to the gloo group, the group's destructor would join gloo's worker threads while holding the GIL, and a
        # worker thread releasing a finished all-reduce's tensors waits for the GIL: a deadlock at exit (seen once
        # in ten runs on a loaded machine). Released here, the reducer only drops a reference; the group goes last,
        # in ``destroy_process_group``, whose destructor releases the GIL.
        gc.collect()
        dist.destroy_process_group()


def _run_process_group(rank: int, out: str) -> None:
    """The scenario itself: its locals (the DDP model) are released when it returns, before the group is destroyed."""
    from fabric_guard import verdict_fields
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GradientGuard(net)
    # any ProcessGroup, not only the default one; a new group does not inherit the default group's timeout
    group = dist.new_group([0, 1], timeout=TIMEOUT)
    checkpoints = os.path.join(out, "checkpoints")
    events: list[dict[str, Any]] = []

    def boundary(step: int, collective: Any) -> None:
        verdict = guard.agree(collective, global_step=step)
        path = os.path.join(checkpoints, f"pg-step={step}.pt")
        if verdict.accepted:
            if rank == 0:
                torch.save(net.state_dict(), path)
            dist.barrier(group)
        # accepted: published; rejected: the offending gradients were zeroed before the step, weights are finite
        guard.reset()
        events.append({"global_step": step, "file": os.path.basename(path), "verdict": verdict_fields(verdict)})

    for step in range(4):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()  # DDP all-reduces here
        if step == 2 and rank == 1:
            net[2].bias.grad[0] = float("inf")  # after the all-reduce: rank 1 alone sees it
        guard.record(optimizer, step=step)
        for p in net.parameters():  # keep the weights finite, so that the next window is clean
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
        optimizer.step()
        if step == 1:
            boundary(2, group)  # steps 0-1: finite
        elif step == 2:
            boundary(3, None)  # step 2: +inf on rank 1 only; None with peers is the default group, not alone
    boundary(4, group)  # step 3 only: the rejected window was reset
    # the publisher over the same group, and over the default one (None): rank 0 writes the state dicts
    published = os.path.join(out, "published")
    CheckpointPublisher(group, published, guard=guard).save("group.pt", {"model": net, "step": 4})
    CheckpointPublisher(None, published, guard=guard).save("world.pt", {"model": net, "step": 4})
    write(out, f"pg-rank{rank}.json", {"world_size": dist.get_world_size(), "events": events})


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "fabric":
        run_fabric(out, *(int(a) for a in sys.argv[3:6]))
    elif mode == "restore-fails":
        run_restore_failing_on_rank_1(out)
    elif mode == "process-group":
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
        torch.multiprocessing.spawn(process_group_rank, args=(out,), nprocs=2, join=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
