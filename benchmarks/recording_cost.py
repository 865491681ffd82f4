"""Per-step recording cost on CPU against the floor, and against other ways of checking gradients.

The floor is one plain read of the same gradient tensors (a per-tensor ``sum``), timed in the same process. Every
row is timed interleaved with the others; the table shows medians and the ratio to the floor.

    python benchmarks/recording_cost.py                 # 28M fp32 elements in 15 tensors, 2 threads (~1 min)
    python benchmarks/recording_cost.py --dtypes float32 bfloat16 float16 float64 --repeats 21
    python benchmarks/recording_cost.py --magnitude 1e-11 --no-naive   # a trained model's gradient sizes

Rows:
  floor                       per-tensor sum (not exact: a sum of large finite values overflows)
  NonFiniteCheck              what the guard runs per step (exact, per-tensor attribution, no host sync)
  GradientGuard.record        the whole per-step path: source, check, window update
  previous (aminmax)          lightning_ckguard 0.1.0 on CPU: torch.aminmax per tensor
  _foreach_norm(inf)          the accelerator path, run on CPU
  amp unscale (scale 1)       GradScaler's fused check: no attribution, and it writes every gradient
  naive isfinite().item()     per tensor: a bool temporary of gradient size and a host sync each
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    amp_unscale_check,
    floor_read,
    foreach_inf_norm,
    interleaved,
    machine,
    make_grads,
    naive_reader,
    previous_reader,
    ratio_rows,
    table,
)

from lightning_ckguard import GradientGuard  # noqa: E402
from lightning_ckguard.record.finiteness import (
    NonFiniteCheck,  # noqa: E402
    cpu_large_tensor_reader,  # noqa: E402
)

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=float, default=28e6)
    parser.add_argument("--tensors", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--no-naive", action="store_true", help="skip the slow naive row")
    parser.add_argument("--magnitude", type=float, default=1.0,
                        help="multiply the gradients by this (1e-11: the size of most of a trained MLP's, where a "
                             "scaled product can fall below the smallest normal number, which a CPU computes slowly)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# Recording cost per step\n\nMachine: {machine()}\n")
    for dtype_name in args.dtypes:
        measure(getattr(torch, dtype_name), args)


NOTES = {
    "floor": "not exact (overflows)",
    "NonFiniteCheck": "exact, per tensor, 0 host syncs",
    "GradientGuard.record": "exact, per tensor, 0 host syncs",
    "previous (aminmax)": "exact, per tensor",
    "_foreach_norm(inf)": "exact, per tensor",
    "amp unscale (scale 1)": "exact, ONE flag, writes grads",
    "naive isfinite().item()": "exact, grad-size temp, 1 sync/tensor",
}


def measure(dtype: torch.dtype, args: argparse.Namespace) -> None:
    grads = [g.mul_(args.magnitude) for g in make_grads(args.tensors, int(args.elements), dtype)]
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(g)) for g in grads])
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    guard = GradientGuard(model)
    check = NonFiniteCheck()
    rows = {
        "floor": lambda: floor_read(grads),
        "NonFiniteCheck": lambda: check(grads, CPU),
        "GradientGuard.record": lambda: guard.record(),
        "previous (aminmax)": lambda: previous_reader(grads),
        "_foreach_norm(inf)": lambda: foreach_inf_norm(grads),
        "amp unscale (scale 1)": lambda: amp_unscale_check(grads),
    }
    if not args.no_naive:
        rows["naive isfinite().item()"] = lambda: naive_reader(grads)
    times = interleaved(rows, args.repeats)
    numel = sum(g.numel() for g in grads)
    print(f"## {str(dtype).removeprefix('torch.')}: {numel / 1e6:.1f}M elements in {len(grads)} tensors, "
          f"{args.repeats} repeats, magnitude {args.magnitude:g}\n")
    headers = ["row", "median ms", "vs floor", "min ms", "min vs floor min", "notes"]
    print(table(headers, ratio_rows(times, "floor", NOTES)))
    print()
    print(f"Large fp32 tensors are read with: {cpu_large_tensor_reader()} (measured at the first large step, or forced "
          "by CKGUARD_CPU_READER)\n")

if __name__ == "__main__":
    main()
