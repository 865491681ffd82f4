"""The boundary's state check against the write it guards, on the transformer and the MLP of ``end_to_end.py``.

At a boundary that writes, each rank checks the local state it is about to write (parameters, buffers, optimizer
state) before the agreement. This times that check, as the callback runs it (finding the tensors, the exact
per-tensor read, the one host read of the flags), against writing the same state to local disk the way Lightning
writes a checkpoint (``torch.save`` of the model's ``state_dict`` and the optimizer's ``state_dict`` into a file).
The write goes to the page cache with no ``fsync``, its fastest form, so the ratio is an upper bound of the check's
share of a real save (``--fsync`` adds the flush).

Both models carry AdamW state (one step taken): about 3x the parameters are checked and written.

    python benchmarks/state_check.py                  # ~1 min on 2 cores
    python benchmarks/state_check.py --repeats 20 --fsync
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, machine, median, ms, table  # noqa: E402
from end_to_end import MLP, TinyLM  # noqa: E402

from lightning_ckguard.record.state_check import StateCheck  # noqa: E402
from lightning_ckguard.record.state_sources import CheckpointState  # noqa: E402


def stepped(model: nn.Module) -> torch.optim.Optimizer:
    """``model``'s AdamW after one step, so its state (``exp_avg``, ``exp_avg_sq``) exists, as at a boundary."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "mlp"], choices=["transformer", "mlp"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fsync", action="store_true", help="flush each written checkpoint to the disk")
    args = parser.parse_args()
    print(machine())
    rows = []
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".state-check-bench-") as tmp:
        for name in args.models:
            torch.manual_seed(0)
            model = TinyLM() if name == "transformer" else MLP()
            optimizer = stepped(model)
            state = CheckpointState(model, (optimizer,))
            check = StateCheck()
            path = os.path.join(tmp, f"{name}.ckpt")

            def run_check(check: StateCheck = check, state: CheckpointState = state) -> None:
                assert check.non_finite(state.named_tensors()) == []

            def write(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer, path: str = path) -> None:
                with open(path, "wb") as f:
                    torch.save({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, f)
                    if args.fsync:
                        f.flush()
                        os.fsync(f.fileno())

            times = interleaved({"state check": run_check, "write": write}, repeats=args.repeats)
            tensors = sum(1 for _ in state.named_tensors())
            elements = sum(t.numel() for _, t in state.named_tensors())
            size = os.path.getsize(path) / 2**20
            check_ms, write_ms = median(times["state check"]), median(times["write"])
            rows.append([
                name, f"{tensors} tensors, {elements / 1e6:.1f}M elements", f"{size:.0f} MiB", ms(check_ms),
                ms(write_ms), f"{check_ms / write_ms:.3f}", f"{min(times['state check']) / min(times['write']):.3f}",
            ])
    print(table(["model", "state checked", "file", "check ms (median)", "write ms (median)", "check / write",
                 "check / write (min)"], rows))


if __name__ == "__main__":
    main()
