"""How the recording cost scales with the number of gradient tensors and with their total size (CPU, fp32).

For each configuration the floor (a per-tensor ``sum``), the guard's ``NonFiniteCheck`` and the previous per-tensor
``aminmax`` are timed interleaved in one process; the table shows medians and ratios to the floor, plus the cost per
tensor, which shows whether per-tensor Python overhead dominates.

    python benchmarks/scaling.py                         # ~1-2 min on 2 cores
    python benchmarks/scaling.py --fixed-total 28e6 --sizes 1e6 1e7 1e8 --repeats 9
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import floor_read, interleaved, machine, make_grads, median, ms, previous_reader, table  # noqa: E402

from lightning_ckguard.record.finiteness import (
    NonFiniteCheck,  # noqa: E402
    cpu_large_tensor_reader,  # noqa: E402
)

CPU = torch.device("cpu")


def measure(num_tensors: int, total: int, repeats: int) -> list[str]:
    grads = make_grads(num_tensors, total)
    check = NonFiniteCheck()
    times = interleaved(
        {
            "floor": lambda: floor_read(grads),
            "check": lambda: check(grads, CPU),
            "previous": lambda: previous_reader(grads),
        },
        repeats,
    )
    floor, new, old = (median(times[k]) for k in ("floor", "check", "previous"))
    best = {k: min(v) for k, v in times.items()}
    row = [
        f"{len(grads)}",
        f"{sum(g.numel() for g in grads) / 1e6:.1f}M",
        ms(floor),
        ms(new),
        f"{new / floor:.2f}x",
        f"{best['check'] / best['floor']:.2f}x",
        ms(old),
        f"{old / floor:.2f}x",
        f"{new / len(grads) * 1e6:.1f}",
    ]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--fixed-total", type=float, default=28e6, help="total elements for the tensor-count sweep")
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--fixed-count", type=int, default=100, help="tensor count for the total-size sweep")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    headers = ["tensors", "elements", "floor ms", "check ms", "check/floor", "check/floor (min)", "aminmax ms",
               "aminmax/floor", "check us/tensor"]
    print(f"# Scaling of the recording cost\n\nMachine: {machine()}\n")
    print(f"## Number of tensors at {args.fixed_total / 1e6:.0f}M elements in all, fp32, {args.repeats} repeats\n")
    rows = []
    for n in args.counts:
        rows.append(measure(n, int(args.fixed_total), args.repeats))
        gc.collect()
    print(table(headers, rows))
    print(f"\n## Total size with {args.fixed_count} tensors, fp32, {args.repeats} repeats\n")
    rows = []
    for size in args.sizes:
        rows.append(measure(args.fixed_count, int(size), args.repeats))
        gc.collect()
    print(table(headers, rows))
    print(f"Large fp32 tensors are read with: {cpu_large_tensor_reader()} (measured at the first large step, or forced "
          "by CKGUARD_CPU_READER)\n")


if __name__ == "__main__":
    main()
