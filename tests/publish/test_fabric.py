"""``GradientGuard`` without the Trainer: Fabric on 2 real CPU processes, a raw ``torch.distributed`` gloo group, and
a single process (``guard.agree(None)`` and a single-device Fabric strategy).

A non-finite value is written into one gradient element on rank 1 only, after DDP's all-reduce. Every rank must
reach the same rejected verdict naming rank 1, nothing may be written for the rejected save, and the finite saves
around it must be on disk with finite weights.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from conftest import OUT, TESTS, Launch, WorkerResults, run_ranks
from lightning_ckguard import GradientGuard, NonFiniteGradientError

EXAMPLE = os.path.join(os.path.dirname(TESTS), "examples", "fabric_guard.py")
TIMEOUT = 240  # wall clock for a whole 2-process run; collectives time out after 60 s inside it


def finite_file(path: Any, key: str | None = None) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=True)
    weights = state[key] if key else state
    return all(torch.isfinite(t).all() for t in weights.values())


@pytest.fixture(scope="module")
def fabric_run(worker_results: WorkerResults) -> Launch:
    # 12 steps, NaN on rank 1 at step 7, saves every 4 steps: 4 accepted, 8 rejected, 12 accepted
    return worker_results("workers/fabric_worker.py", ["fabric", OUT, "12", "7", "4"], timeout=TIMEOUT,
                          prefix="fabric-")


@pytest.mark.multiprocess
def test_fabric_every_rank_rejects_with_the_same_verdict(fabric_run):
    ranks = fabric_run.ranks
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["events"] == ranks[1]["events"], "the ranks reached different verdicts"
    events = ranks[0]["events"]
    assert [(e["global_step"], e["verdict"]["accepted"]) for e in events] == [(4, True), (8, False), (12, True)]
    rejected = events[1]["verdict"]
    assert rejected["ranks"] == [1]
    assert rejected["error"] == {
        "ranks": [1],
        "first_step": 7,
        "last_step": 7,
        "num_steps": 1,
        "global_step": 8,
        "parameters": ["2.weight"],
        "skipped_steps": 0,
        "pending_rejection": False,
        "non_finite_state": [[1, "model: parameter 2.weight"]],  # the NaN step was applied on rank 1
    }
    # rank 0 never saw the NaN itself and still rejected: the decision was made from both ranks' ballots, and the
    # rejection brought the report of the one rank it names
    assert [(r["rank"], r["non_finite_steps"]) for r in rejected["reports"]] == [(1, 1)]
    assert events[1]["rolled_back_to"] == "step=4.ckpt"


@pytest.mark.multiprocess
def test_fabric_rejected_save_writes_nothing_and_finite_saves_are_on_disk(fabric_run):
    out = fabric_run.out
    checkpoints = out / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step=12.ckpt", "step=4.ckpt"]  # no step=8.ckpt
    for name in ("step=4.ckpt", "step=12.ckpt"):
        assert finite_file(checkpoints / name, "model"), name
    assert torch.load(checkpoints / "step=12.ckpt", weights_only=True)["step"] == 12


@pytest.mark.multiprocess
def test_fabric_example_prints_once_from_rank_zero(fabric_run):
    stdout = fabric_run.stdout
    lines = stdout.splitlines()
    assert lines.count("step 4: accepted, wrote step=4.ckpt") == 1
    assert sum("rejected on every rank" in line for line in lines) == 1
    assert "NonFiniteGradientError(ranks=(1,), steps 7-7, parameters=['2.weight'])" in stdout


@pytest.mark.multiprocess
def test_fabric_example_script_with_its_command_line(tmp_path):
    out = tmp_path / "ckpts"
    proc = run_ranks(EXAMPLE, ["--steps", "8", "--fault-step", "3", "--every", "2", "--out", str(out)],
                     timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("step ", "        ", "on disk"))]
    assert lines == [
        "step 2: accepted, wrote step=2.ckpt",
        "step 4: rejected on every rank: NonFiniteGradientError(ranks=(1,), steps 3-3, parameters=['2.weight'])",
        "        rank 1: 1 non-finite step; non-finite state rank 1: model: parameter 2.weight",
        "        nothing written; rolled back to step=2.ckpt",
        "step 6: accepted, wrote step=6.ckpt",
        "step 8: accepted, wrote step=8.ckpt",
        "on disk: step=2.ckpt (finite), step=6.ckpt (finite), step=8.ckpt (finite)",
    ]
    assert sorted(os.listdir(out)) == ["step=2.ckpt", "step=6.ckpt", "step=8.ckpt"]


@pytest.mark.multiprocess
def test_a_restore_failing_on_one_rank_raises_on_every_rank(worker_results):
    # rank 1's load fails alone: rank 0 must not go on to wait for it in the next collective
    launch = worker_results("workers/fabric_worker.py", ["restore-fails", OUT], timeout=TIMEOUT, prefix="restore-")
    expected = {"raised": "CheckpointRestoreError", "ranks": [1], "cause": "OSError: [Errno 116] Stale file handle"}
    assert launch.ranks == [{**expected, "chained": None}, {**expected, "chained": "OSError"}]


@pytest.mark.multiprocess
def test_raw_torch_distributed_process_group(worker_results):
    launch = worker_results("workers/fabric_worker.py", ["process-group", OUT], timeout=TIMEOUT, prefix="pg-")
    ranks, out = launch.ranks, launch.out
    assert ranks[0]["events"] == ranks[1]["events"], "the ranks reached different verdicts"
    events = ranks[0]["events"]
    assert [(e["global_step"], e["verdict"]["accepted"], e["verdict"]["ranks"]) for e in events] == [
        (2, True, []),
        (3, False, [1]),
        (4, True, []),
    ]
    error = events[1]["verdict"]["error"]
    assert (error["first_step"], error["last_step"], error["parameters"]) == (2, 2, ["2.bias"])
    assert sorted(os.listdir(out / "checkpoints")) == ["pg-step=2.pt", "pg-step=4.pt"]  # nothing at step 3
    assert all(finite_file(out / "checkpoints" / name) for name in ("pg-step=2.pt", "pg-step=4.pt"))
    # CheckpointPublisher over a raw process group: agreed, written by rank 0, renamed into place, nothing hidden left
    assert sorted(os.listdir(out / "published")) == ["group.pt", "world.pt"]
    assert all(finite_file(out / "published" / name, key="model") for name in ("group.pt", "world.pt"))


def _step(model: torch.nn.Module, guard: GradientGuard, optimizer: torch.optim.Optimizer, step: int,
          fault: bool = False) -> None:
    optimizer.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    if fault:
        model.bias.grad[1] = float("-inf")
    guard.record(optimizer, step=step)


def test_single_process_agree_none():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GradientGuard(model)
    _step(model, guard, optimizer, 0)
    verdict = guard.agree(None, global_step=1)
    assert verdict.accepted and verdict.ranks == () and verdict.reason == "finite"
    guard.reset()
    _step(model, guard, optimizer, 1, fault=True)
    _step(model, guard, optimizer, 2)
    verdict = guard.agree(None, global_step=3)
    assert not verdict.accepted and verdict.ranks == (0,)
    error = verdict.to_error()
    assert isinstance(error, NonFiniteGradientError)
    assert (error.first_step, error.last_step, error.num_steps, error.parameters) == (1, 1, 1, ("bias",))
    # agreeing does not reset: the same window rejects again until the caller resets after recovering
    assert not guard.agree(None, global_step=3).accepted
    guard.reset()
    _step(model, guard, optimizer, 3)
    assert guard.agree(None, global_step=4).accepted


def test_single_device_fabric_strategy():
    fabric = Fabric(accelerator="cpu", devices=1)
    module = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    guard = GradientGuard(model)  # Fabric's wrapper is looked through: the names are the module's own
    _step(model.module, guard, optimizer, 0, fault=True)
    verdict = guard.agree(fabric.strategy, global_step=1)  # a single-device strategy: no collective at all
    assert not verdict.accepted and verdict.ranks == (0,) and verdict.parameters == ("bias",)
    guard.reset()
    _step(model.module, guard, optimizer, 1)
    assert guard.agree(fabric.strategy, global_step=2).accepted
