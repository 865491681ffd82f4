"""The record call on configurations off the common path, with and without a spike gate, against a plain read.

Each row: ``GradientGuard(model).record()`` and ``GradientGuard(model, spike_gate=SpikeGate(measures=("grad_norm",)))
.record()`` on the same gradients, timed interleaved with the floor (a per-tensor ``sum``; a sparse gradient's stored
values), medians of the repeats and their ratio to the floor.

    python benchmarks/recording_configs.py            # 2 threads, 15 repeats (~1 min)

Configurations: a sparse embedding gradient (``nn.Embedding(50000, 256, sparse=True)``, 32,768 lookups), an fp16 MLP
(2048x2048 and 2048x1024), 200 bf16 ``Linear(64, 64)``, 10,000 fp32 tensors of 64 elements, and the benchmark MLP's
shapes at a trained model's magnitude (``randn * 1e-11``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, machine, median, table  # noqa: E402

from lightning_ckguard import GradientGuard, SpikeGate  # noqa: E402


def _with_grads(module: nn.Module, scale: float = 1.0) -> nn.Module:
    for parameter in module.parameters():
        parameter.grad = torch.randn_like(parameter) * scale
    return module


def configurations() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    embedding = nn.Embedding(50000, 256, sparse=True)
    embedding(torch.randint(0, 50000, (64, 512))).sum().backward()
    return {
        "sparse embedding 50000x256, 32768 lookups": embedding,
        "fp16 MLP 2048x2048 + 2048x1024": _with_grads(nn.Sequential(nn.Linear(2048, 2048),
                                                                    nn.Linear(2048, 1024)).half(), 1e-3),
        "200 bf16 Linear(64, 64)": _with_grads(nn.ModuleList([nn.Linear(64, 64, bias=False)
                                                              for _ in range(200)]).bfloat16()),
        "10,000 fp32 tensors of 64": _with_grads(nn.ParameterList([nn.Parameter(torch.zeros(64))
                                                                  for _ in range(10000)])),
        "MLP 784-2048-2048-10 at 1e-11": _with_grads(nn.Sequential(nn.Linear(784, 2048), nn.Linear(2048, 2048),
                                                                   nn.Linear(2048, 10)), 1e-11),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# The record call off the common path\n\nMachine: {machine()}\n")
    rows = []
    for name, model in configurations().items():
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        values = [g.coalesce().values() if g.is_sparse else g for g in grads]
        off, on = GradientGuard(model), GradientGuard(model, spike_gate=SpikeGate(measures=("grad_norm",)))
        times = interleaved({"floor": lambda values=values: [v.sum() for v in values], "off": off.record,
                             "on": on.record},
                            args.repeats)
        floor = median(times["floor"])
        rows.append([name, f"{1e3 * floor:.2f}", f"{1e3 * median(times['off']):.2f}",
                     f"{median(times['off']) / floor:.2f}x", f"{1e3 * median(times['on']):.2f}",
                     f"{median(times['on']) / floor:.2f}x"])
    print(table(["configuration", "floor ms", "record ms", "vs floor", "record with gate ms", "vs floor"], rows))


if __name__ == "__main__":
    main()
