"""Guard your own checkpoints in a Fabric loop: ``GradientGuard`` without the Trainer.

Run it with ``python examples/fabric_guard.py``; Fabric starts rank 1 itself (2 CPU processes, gloo). The loop
records every optimizer step with ``guard.record(optimizer)`` (device-side: no host sync, no collective), and every
``--every`` steps all ranks publish with ``publisher.save(name, state)`` (a ``CheckpointPublisher``): they agree
first (each rank also checks its own part of ``state``), then the checkpoint is written into a hidden staging name,
every rank's write is agreed on, and rank 0 renames it into place. At ``--fault-step`` a NaN is written into one
gradient element on rank 1 only, after DDP's all-reduce, so rank 0 never sees it.

The save after the fault is rejected on both ranks with the same verdict; nothing is written for it. Both ranks rewind
in place to the last good checkpoint (``restore_fabric_state``: ``fabric.load`` of the model and optimizer, and a fresh
window of the guard) and train on, and the next saves are finite again::

    step 4: accepted, wrote step=4.ckpt
    step 8: rejected on every rank: NonFiniteGradientError(ranks=(1,), steps 7-7, parameters=['2.weight'])
            rank 1: 1 non-finite step; non-finite state rank 1: model: parameter 2.weight
            nothing written; rolled back to step=4.ckpt
    step 12: accepted, wrote step=12.ckpt
    on disk: step=12.ckpt (finite), step=4.ckpt (finite)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

from lightning_ckguard import (
    CheckpointPublisher,
    GradientGuard,
    NonFiniteGradientError,
    Verdict,
    restore_fabric_state,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps to run (default: 12)")
    parser.add_argument("--fault-step", type=int, default=7,
                        help="step whose gradient gets a NaN on rank 1 only; -1 for none (default: 7)")
    parser.add_argument("--every", type=int, default=4, help="save every N steps (default: 4)")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "fabric_guard"),
                        help="checkpoint directory, emptied first (default: %(default)s)")
    return parser.parse_args(argv)


def make_fabric() -> Fabric:
    # strategy="ddp", with a collective timeout: a rank waiting for a peer that decided alone would fail, not hang
    return Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=60)))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) / 4


def describe(verdict: Verdict) -> list[str]:
    if verdict.accepted:
        return []
    error = verdict.to_error()
    per_rank = "; ".join(  # the ranks the rejection names (the offending ones), each with its own report
        f"rank {r.rank}: {r.non_finite_steps} non-finite step{'' if r.non_finite_steps == 1 else 's'}"
        for r in verdict.reports
    )
    state = "; ".join(f"rank {rank}: {name}" for rank, name in error.non_finite_state)
    return [f"rejected on every rank: NonFiniteGradientError(ranks={error.ranks}, steps {error.first_step}-"
            f"{error.last_step}, parameters={list(error.parameters)})", per_rank + (f"; non-finite state {state}"
                                                                                   if state else "")]


def train(fabric: Fabric, steps: int, fault_step: int, every: int, out: str) -> list[dict[str, Any]]:
    """The training loop. Returns one event per checkpoint boundary (the same on every rank)."""
    fabric.seed_everything(0, verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    # the unwrapped module: same parameter objects, and its own parameter names ("2.weight") in reports
    guard = GradientGuard(model)  # looks through Fabric's wrapper: reports name your own parameters
    publisher = CheckpointPublisher(fabric.strategy, out, guard=guard)

    events: list[dict[str, Any]] = []
    last_good: str | None = None
    for step in range(steps):
        x, y = batch(step, fabric.global_rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)  # DDP all-reduces the gradients here
        if step == fault_step and fabric.global_rank == 1:
            model.module[2].weight.grad[0, 0] = float("nan")  # after the all-reduce: rank 1 alone sees it
        guard.record(optimizer, step=step)  # after backward, before the step
        optimizer.step()

        if (step + 1) % every and step + 1 != steps:
            continue
        name = f"step={step + 1}.ckpt"
        state = {"model": model, "optimizer": optimizer, "step": step + 1}
        # every rank, same point, same verdict (each rank also checks its own part of the state it is about to save);
        # accepted: written into a hidden staging name, every rank's write agreed on, renamed into place on rank 0
        try:
            publisher.save(name, state, global_step=step + 1)
        except NonFiniteGradientError:
            pass  # raised on every rank: nothing was written
        verdict = publisher.last_verdict
        assert verdict is not None
        event: dict[str, Any] = {"global_step": step + 1, "file": name, "verdict": verdict_fields(verdict)}
        if verdict.accepted:
            last_good = name  # the publisher started the guard's fresh window
            fabric.print(f"step {step + 1}: accepted, wrote {name}")
        else:
            lines = describe(verdict)
            if last_good is None:
                raise verdict.to_error()
            # the weights on rank 1 took the NaN step: every rank rewinds, in place and together, to the last
            # published state (through fabric.load: sharded strategies restore their own shards), with a fresh window
            restore_fabric_state(fabric, os.path.join(out, last_good), {"model": model, "optimizer": optimizer}, guard)
            event["rolled_back_to"] = last_good
            fabric.print(f"step {step + 1}: {lines[0]}\n        {lines[1]}\n        nothing written; "
                         f"rolled back to {last_good}")
        events.append(event)
    return events


def verdict_fields(verdict: Verdict) -> dict[str, Any]:
    fields: dict[str, Any] = {"accepted": verdict.accepted, "reason": verdict.reason, "ranks": list(verdict.ranks),
                              "global_step": verdict.global_step, "reports": [vars(r) for r in verdict.reports]}
    if not verdict.accepted:
        fields["error"] = verdict.to_error().fields()
    return fields


def on_disk(out: str) -> str:
    def state(name: str) -> str:
        weights = torch.load(os.path.join(out, name), map_location="cpu", weights_only=True)["model"]
        return "finite" if all(torch.isfinite(t).all() for t in weights.values()) else "NaN weights"

    return ", ".join(f"{name} ({state(name)})" for name in sorted(os.listdir(out)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    fabric = make_fabric()
    fabric.launch()  # starts rank 1 by re-running this script with the same arguments
    if fabric.global_rank == 0:
        shutil.rmtree(args.out, ignore_errors=True)
        os.makedirs(args.out)
    fabric.barrier()
    train(fabric, args.steps, args.fault_step, args.every, args.out)
    fabric.barrier()
    fabric.print(f"on disk: {on_disk(args.out) if fabric.global_rank == 0 else ''}")


if __name__ == "__main__":
    main()
