"""Per-boundary preflight: the guard's agreement, timed on 2- and 8-process gloo (CPU), against ModelCheckpoint's own
collectives of the same boundary, in one run.

Each rank records a step (a second guard records a NaN on rank 1), then every iteration starts from a barrier and
times on every rank:

  guard.agree(pg)                  an accepted boundary: the rank's own summary read, ONE all_reduce (MAX) of the
                                   tally (TALLY_SIZE int64, the same at any world size), the verdict
  guard.agree(pg), rejected        a rejected boundary (NaN on rank 1): the tally, then the roll call (one more
                                   all_reduce, SUM, of the named ranks' reports), the verdict
  all_reduce(tally) alone          the accepted boundary's collective, without the summary and the verdict
  all_gather(57 int64) (before)    the collective of the previous agreement (456 bytes x world size per rank)
  reduce_boolean_decision          what ModelCheckpoint runs per monitored boundary (the top-K vote): a barrier,
                                   then one all_reduce of one integer (DDPStrategy.reduce_boolean_decision)
  broadcast(file_exists)           what ModelCheckpoint runs per saved file (``file_exists``): broadcast_object_list
                                   of a bool, i.e. two broadcasts (size, then pickled payload)
  barrier                          Trainer.save_checkpoint's barrier before every save

The table shows, per world size, the median over iterations of the slowest rank's time, and the ratio to
ModelCheckpoint's own per-boundary collectives (vote + file_exists + barrier). This script starts processes: run it
alone (``flock /tmp/mp.lock python benchmarks/preflight.py``).

    python benchmarks/preflight.py                         # world sizes 2 and 8, ~1 min on 2 cores
    python benchmarks/preflight.py --world-sizes 2 4 8 --iterations 500
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, recorded_guard, table  # noqa: E402

from lightning_ckguard import GradientGuard  # noqa: E402
from lightning_ckguard.agree.agreement import TALLY_SIZE  # noqa: E402
from lightning_ckguard.record.state_check import STATE_SUMMARY_SIZE  # noqa: E402
from lightning_ckguard.record.window import SUMMARY_SIZE  # noqa: E402

BEFORE = SUMMARY_SIZE + STATE_SUMMARY_SIZE  # int64 per rank the previous agreement gathered from every rank
REDUCE_ROW = f"all_reduce({TALLY_SIZE} int64) alone"
GATHER_ROW = f"all_gather({BEFORE} int64) (before)"

ROWS = ["guard.agree(pg)", "guard.agree(pg), rejected", REDUCE_ROW, GATHER_ROW, "reduce_boolean_decision",
        "broadcast(file_exists)", "barrier"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _guard(nan: bool) -> GradientGuard:
    """A guard that recorded one step of a small model (with a NaN gradient if ``nan``)."""
    return recorded_guard(nan)[1]


def _worker(rank: int, world: int, port: int, iterations: int, out: str) -> None:
    signal.alarm(300)  # a hung collective fails the benchmark instead of hanging it
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    guard, diverged = _guard(nan=False), _guard(nan=rank == 1)
    pg = dist.group.WORLD

    def vote() -> None:  # DDPStrategy.reduce_boolean_decision, through Lightning's _sync_ddp: a barrier first
        decision = torch.tensor(1)
        dist.barrier()
        dist.all_reduce(decision, op=dist.ReduceOp.SUM)
        bool(decision == world)

    tally, summary = torch.zeros(TALLY_SIZE, dtype=torch.int64), torch.zeros(BEFORE, dtype=torch.int64)
    gather = [torch.empty_like(summary) for _ in range(world)]
    ops = {
        "guard.agree(pg)": lambda: guard.agree(pg, global_step=1),
        "guard.agree(pg), rejected": lambda: diverged.agree(pg, global_step=1),
        REDUCE_ROW: lambda: dist.all_reduce(tally, op=dist.ReduceOp.MAX),
        GATHER_ROW: lambda: dist.all_gather(gather, summary),
        "reduce_boolean_decision": vote,
        "broadcast(file_exists)": lambda: dist.broadcast_object_list([os.path.exists(out)], src=0),
        "barrier": dist.barrier,
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for i in range(iterations + 10):
        for name in ROWS if i % 2 == 0 else reversed(ROWS):
            dist.barrier()
            start = time.perf_counter()
            ops[name]()
            if i >= 10:
                times[name].append(time.perf_counter() - start)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, iterations: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.spawn(_worker, args=(world, _free_port(), iterations, out), nprocs=world, join=True)
        per_rank = []
        for rank in range(world):
            with open(f"{out}.{rank}") as f:
                per_rank.append(json.load(f))
    # per iteration, the slowest rank decides when the boundary can go on
    return {name: median([max(r[name][i] for r in per_rank) for i in range(iterations)]) for name in ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    print(f"# Preflight agreement latency (gloo, CPU)\n\nMachine: {machine()}\n")
    print(f"The agreement: one all_reduce of {TALLY_SIZE} int64 per accepted boundary ({TALLY_SIZE * 8} bytes at any "
          f"world size; before: one all_gather of {BEFORE} int64, {BEFORE * 8} bytes x world size); "
          f"{args.iterations} iterations, median of the slowest rank.\n")
    rows = []
    for world in args.world_sizes:
        result = measure(world, args.iterations)
        own = result["reduce_boolean_decision"] + result["broadcast(file_exists)"] + result["barrier"]
        for name in ROWS:
            rows.append([world, name, f"{result[name] * 1e6:.0f}", f"{result[name] / own:.2f}"])
        rows.append([world, "ModelCheckpoint's own (vote + file_exists + barrier)", f"{own * 1e6:.0f}", "1.00"])
    print(table(["world", "collective", "median us", "vs ModelCheckpoint's own"], rows))


if __name__ == "__main__":
    main()
