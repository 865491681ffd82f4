"""PREPARED, NOT YET RUN: no GPU was lent to the task that wrote it, so no CUDA figure exists yet.

Recording overhead on CUDA for a >= 1B-parameter bf16 model: the guard's per-step read of every gradient against the
floor (one plain read: ``torch._foreach_norm(ord=1)``-free per-tensor ``sum``) and against a fused AdamW step over
the same parameters, which is what a training step pays anyway. Timed with CUDA events, interleaved, medians.
Also checks that recording issues no host sync (``torch.cuda.set_sync_debug_mode("error")``), with and without a
spike gate (whose one fused float64 2-norm gives both the flags and the sum of squares).

    python benchmarks/gpu_overhead.py                      # ~1.2B bf16 parameters (~2.4 GB grads + 2.4 GB params)
    python benchmarks/gpu_overhead.py --billions 0.3       # smaller GPUs

Issue 28's own cost figure on a GPU (the step time with the spike gate on against off, on the benchmark MLP and
transformer) is ``python benchmarks/spike_gate.py --parts cost --device cuda`` (also prepared, not yet run).

Expected on an H100/H200-class GPU (to be confirmed): the fused ``_foreach_norm(inf)`` streams the gradients once at
close to memory bandwidth, i.e. within ~1.25x of the per-tensor sum and a few percent of the AdamW step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, table  # noqa: E402

from lightning_ckguard import GradientGuard, SpikeGate  # noqa: E402
from lightning_ckguard.record.finiteness import NonFiniteCheck  # noqa: E402


def transformer_shapes(billions: float) -> list[tuple[int, ...]]:
    """Parameter shapes of a GPT-like model with about ``billions`` parameters (d_model 2048, vocab 50304)."""
    d, vocab = 2048, 50304
    per_layer = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    layer_params = sum(torch.Size(s).numel() for s in per_layer)
    layers = max(1, int((billions * 1e9 - 2 * vocab * d) / layer_params))
    return [(vocab, d)] + per_layer * layers + [(d,), (d,), (vocab, d)]


def cuda_time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--billions", type=float, default=1.2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_overhead.py needs a CUDA device")
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02)
              for s in transformer_shapes(args.billions)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(params)
    guard = GradientGuard(module)
    gated = GradientGuard(module, spike_gate=SpikeGate())  # one fused fp64 2-norm: the flags and the squares
    loss = torch.ones((), device=device)
    check = NonFiniteCheck()
    grads = [p.grad for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    rows = {
        "floor (per-tensor sum)": lambda: [g.sum() for g in grads],
        "NonFiniteCheck": lambda: check(grads, device),
        "GradientGuard.record": lambda: guard.record(),
        "GradientGuard.record, SpikeGate": lambda: gated.record(loss=loss),
        "AdamW step (fused)": optimizer.step,
    }
    for fn in rows.values():  # warm up, build plans and caches
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync while recording raises
    guard.record()
    gated.record(loss=loss)
    torch.cuda.set_sync_debug_mode(0)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for repeat in range(args.repeats):
        for name in rows if repeat % 2 == 0 else reversed(list(rows)):
            times[name] += cuda_time(rows[name], 1)
    floor = median(times["floor (per-tensor sum)"])
    step = median(times["AdamW step (fused)"])
    print(f"# GPU recording overhead\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{numel / 1e9:.2f}B bf16 parameters in {len(params)} tensors, {args.repeats} repeats\n")
    print(table(["row", "median ms", "vs floor", "vs AdamW step"],
                [[n, f"{median(t) * 1e3:.2f}", f"{median(t) / floor:.2f}x", f"{median(t) / step:.3f}"]
                 for n, t in times.items()]))


if __name__ == "__main__":
    main()
