"""Per-boundary preflight: the guard's one agreement collective, timed on 2- and 4-process gloo (CPU).

Each rank records a step, then every iteration starts from a barrier and times on every rank:

  guard.agree(pg)                  the whole preflight: window summary, ONE all_gather of 57 int64 per rank
                                   (16 for the window, 41 for the state check's outcome; 456 bytes x world size),
                                   the verdict (the state check's own read is timed by ``state_check.py``)
  all_gather(57 int64) alone       the collective inside it, without the summary and the verdict
  reduce_boolean_decision          what ModelCheckpoint runs per monitored boundary (the top-K vote): one
                                   all_reduce of one integer (DDPStrategy.reduce_boolean_decision)
  broadcast(file_exists)           what ModelCheckpoint runs per saved file (``file_exists``): broadcast_object_list
                                   of a bool, i.e. two broadcasts (size, then pickled payload)
  barrier                          Trainer.save_checkpoint's barrier before every save

The table shows, per world size, the median over iterations of the slowest rank's time, and the ratio to
ModelCheckpoint's own per-boundary collectives (vote + file_exists + barrier). This script starts processes: run it
alone (``flock /tmp/mp.lock python benchmarks/preflight.py``).

    python benchmarks/preflight.py                         # world sizes 2 and 4, ~30 s
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
from _common import machine, median, table  # noqa: E402

from lightning_ckguard import GradientGuard  # noqa: E402
from lightning_ckguard.record.state_check import STATE_SUMMARY_SIZE  # noqa: E402
from lightning_ckguard.record.window import SUMMARY_SIZE  # noqa: E402

PAYLOAD = SUMMARY_SIZE + STATE_SUMMARY_SIZE  # int64 per rank: the window's summary, then the state check's part
GATHER_ROW = f"all_gather({PAYLOAD} int64) alone"

ROWS = ["guard.agree(pg)", GATHER_ROW, "reduce_boolean_decision", "broadcast(file_exists)", "barrier"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, iterations: int, out: str) -> None:
    signal.alarm(300)  # a hung collective fails the benchmark instead of hanging it
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model(torch.randn(4, 64)).sum().backward()
    guard = GradientGuard(model)
    guard.record(step=0)
    pg = dist.group.WORLD

    def vote() -> None:  # DDPStrategy.reduce_boolean_decision
        decision = torch.tensor(1)
        dist.all_reduce(decision, op=dist.ReduceOp.SUM)
        bool(decision == world)

    summary = torch.zeros(PAYLOAD, dtype=torch.int64)
    gather = [torch.empty_like(summary) for _ in range(world)]
    ops = {
        "guard.agree(pg)": lambda: guard.agree(pg, global_step=1),
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
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    print(f"# Preflight agreement latency (gloo, CPU)\n\nMachine: {machine()}\n")
    print(f"Payload of the agreement: {PAYLOAD} int64 per rank ({PAYLOAD * 8} bytes x world size), "
          f"one all_gather per boundary; {args.iterations} iterations, median of the slowest rank.\n")
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
