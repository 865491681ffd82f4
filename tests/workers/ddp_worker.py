"""Two-rank CPU/gloo scenarios, run by ``tests/lightning/test_ddp.py`` as ``python ddp_worker.py OUT_DIR``; also
used by ``tests/agree/test_four_ranks.py`` and ``tests/agree/test_eight_ranks.py``, which run some of them on 4 and
8 ranks (``python ddp_worker.py OUT_DIR SCENARIO ...`` with ``CKGUARD_TEST_DEVICES=4`` or ``8``); one scenario is only
for 4 ranks (``hsdp-spike-gate-norm``: 2 replicas of 2 shards; ``tp-spike-gate-norm``: 2 data-parallel shards of 2
tensor-parallel ranks).

Lightning's subprocess script launcher starts rank 1 by re-running this script. Every rank runs every scenario
in order, in one process group, and writes what it observed to ``OUT_DIR/rank{N}.json``. A scenario that hangs
fails through the 60 s collective timeout; the test adds its own wall-clock timeout on top.

The Trainer, the callbacks and the strategy come from ``$CKGUARD_TEST_LIGHTNING`` (``tests/lightning_namespace.py``):
``lightning.pytorch`` with ``from lightning_ckguard import FiniteGradCheckpoint`` by default, ``pytorch_lightning``
with ``from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint`` when it says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning_namespace import ckguard_module, lightning_module  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    FailingWrites,
    FaultyModel,
    HookFailsAt,
    ModelCheckpoint,
    fit_outcome,
    ledger_state,
    refuse_moves_to,
    run_scenarios,
    tree_digest,
    unsharded_gradient_norm,
)

Trainer, seed_everything = lightning_module().Trainer, lightning_module().seed_everything
# Lightning 2.6 added EMAWeightAveraging: with 2.5 the EMA scenarios are not run (their test skips)
EMAWeightAveraging = getattr(lightning_module("callbacks"), "EMAWeightAveraging", None)
FiniteGradCheckpoint = ckguard_module().FiniteGradCheckpoint

warnings.filterwarnings("ignore")
DEVICES = int(os.environ.get("CKGUARD_TEST_DEVICES", "2"))  # test_four_ranks.py, test_eight_ranks.py: a subset
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)

# name -> (callback kwargs, trainer kwargs, model kwargs); the fault is added per scenario
PERIODIC = (dict(every_n_train_steps=2, save_top_k=-1), dict(max_steps=8, limit_val_batches=0), {})
VAL_TOPK = (
    dict(monitor="val_loss", save_top_k=2),
    dict(max_epochs=4, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0),
    dict(val_losses=[10.0, 9.0, 8.0, 7.0]),
)
LAST_ONLY = (dict(every_n_train_steps=2, save_top_k=0, save_last=True), dict(max_steps=8, limit_val_batches=0), {})
# epoch 1 is worse than epoch 0, so its boundary writes nothing; epoch 2 enters the top-1
UNSELECTED_THEN_SELECTED = (
    dict(monitor="val_loss", save_top_k=1),
    dict(max_epochs=3, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0),
    dict(val_losses=[5.0, 6.0, 4.0]),
)
# the callback itself never writes; user code saves by hand at every epoch end
MANUAL = (dict(every_n_epochs=100), dict(max_epochs=3, limit_train_batches=2, limit_val_batches=0), {})
# two micro-batches per optimizer step: DDP runs the first one under no_sync, so its gradient is local to its rank
ACCUMULATE = (dict(every_n_train_steps=2, save_top_k=-1),
              dict(max_steps=4, accumulate_grad_batches=2, limit_val_batches=0), dict(snapshot_steps=(2,)))
# validation runs on the EMA weights, so the top-K is chosen by the averaged model ("EMA-best")
EMA_BEST = (VAL_TOPK[0] | dict(save_last=True), VAL_TOPK[1], VAL_TOPK[2])
# epoch 1 improves: it writes the top-1 file, evicts epoch 0's and moves `last`
TOP1_LAST = (dict(monitor="val_loss", save_top_k=1, save_last=True), VAL_TOPK[1],
             dict(val_losses=[10.0, 9.0, 8.0, 7.0], snapshot_steps=(3,)))
# saves at global steps 3 and 6 of 8: steps 6 and 7 come after the last boundary, judged at train end
TRAILING = (dict(every_n_train_steps=3, save_top_k=-1), dict(max_steps=8, limit_val_batches=0), {})
CONFIGS = {"periodic": PERIODIC, "trailing": TRAILING, "top1_last": TOP1_LAST, "val_topk": VAL_TOPK, "last": LAST_ONLY,
           "unselected": UNSELECTED_THEN_SELECTED, "manual": MANUAL, "accumulate": ACCUMULATE, "ema_best": EMA_BEST}


def run(root: str, name: str, config: str, zero1: bool, guarded: bool, fault_steps: tuple[int, ...] = (),
        on_non_finite: str = "raise", fault_batches: tuple[int, ...] = (), fail_write: str | None = None,
        refuse_move: str | None = None, failing_hook: tuple[str, int] | None = None) -> dict[str, Any]:
    callback_kwargs, trainer_kwargs, model_kwargs = CONFIGS[config]
    seed_everything(7)
    dirpath = os.path.join(root, name)
    if guarded:
        callback: ModelCheckpoint = FiniteGradCheckpoint(dirpath=dirpath, on_non_finite=on_non_finite,
                                                         **callback_kwargs)
    else:
        callback = ModelCheckpoint(dirpath=dirpath, **callback_kwargs)
    if config == "manual":
        model_kwargs = dict(model_kwargs, manual_save_dir=dirpath)
    model = FaultyModel(fault_steps=fault_steps, fault_batches=fault_batches, fault_ranks=(1,), zero1=zero1,
                        **model_kwargs)
    callbacks = [EMAWeightAveraging(decay=0.5), callback] if config == "ema_best" else [callback]
    if failing_hook:  # (hook, rank): fails in epoch 1's save
        callbacks.append(HookFailsAt(*failing_hook, epoch=1))
    trainer = Trainer(
        strategy=make_strategy("zero1" if zero1 else "ddp", timeout=TIMEOUT), devices=DEVICES, callbacks=callbacks,
        **QUIET, **trainer_kwargs
    )
    if refuse_move:  # rank 0's rename into place, after the boundary's last collective
        model.on_train_epoch_start = lambda: (  # type: ignore[method-assign]
            undo.append(refuse_moves_to(refuse_move)) if trainer.current_epoch == 1 else None)
    undo: list[Callable[[], None]] = []
    # under DDP only rank 0 writes, so a full disk there is the failure its peers cannot see
    failing = FailingWrites(fail_write) if fail_write else contextlib.nullcontext()
    try:
        with failing:
            result = fit_outcome(lambda: trainer.fit(model), write_errors=True,
                                 also=(RuntimeError,) if failing_hook else ())
    finally:
        for restore in undo:
            restore()
    result.update(
        trainer=type(trainer).__module__,  # which Lightning package this scenario ran under
        tree=tree_digest(dirpath),
        state=ledger_state(callback),
        snapshots={str(k): v for k, v in model.snapshots.items()},
        global_step=trainer.global_step,
        consolidations=model.consolidations,
        should_stop=trainer.should_stop,
        report=dataclasses.asdict(callback.last_report) if isinstance(callback, FiniteGradCheckpoint)
        and callback.last_report is not None else None,
    )
    return result


def guard_without_trainer(root: str) -> dict[str, Any]:
    """The core on a raw ``torch.distributed`` process group, no Trainer: rank 1 alone sees a NaN."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Linear(4, 2)
    guard = GradientGuard(model)
    model(torch.ones(3, 4)).sum().backward()
    if torch.distributed.get_rank() == 1:
        model.bias.grad[0] = float("nan")
    guard.record(step=0)
    verdict = guard.agree(torch.distributed.group.WORLD, global_step=1)
    return {"error": verdict.to_error().fields() if not verdict.accepted else None}


def state_check_failing_on_one_rank(root: str) -> dict[str, Any]:
    """The core on a raw process group: rank 1's state holds a tensor left on the meta device (a deferred
    initialization never materialized there), so checking it raises on rank 1 alone. Then the next agreement."""
    from lightning_ckguard import GradientGuard, StateCheckError

    model = torch.nn.Linear(4, 2)
    guard = GradientGuard(model)
    model(torch.ones(3, 4)).sum().backward()
    guard.record(step=0)
    extra = torch.empty(2, device="meta") if torch.distributed.get_rank() == 1 else torch.zeros(2)
    result: dict[str, Any] = {"error": None}
    try:
        guard.agree(torch.distributed.group.WORLD, global_step=1, state={"model": model, "extra": extra})
    except StateCheckError as error:
        result["error"] = {"ranks": list(error.ranks), "global_step": error.global_step, "cause": error.cause,
                           "message": str(error), "raised_from": type(error.__cause__).__name__}
    verdict = guard.agree(torch.distributed.group.WORLD, global_step=1, state={"model": model})
    return {**result, "next_agreement_accepted": verdict.accepted}


def _gate_norms(model: torch.nn.Module, batch_seed: int, outputs: int) -> dict[str, Any]:
    """Three steps of ``model`` (already sharded) under a ``GradientGuard`` with a spike gate, one agreement per step,
    batches drawn from ``batch_seed``. Per step: the gate's global gradient norm, and ``clip_grad_norm_`` of the full
    gradients (``full_tensor()``)."""
    from lightning_ckguard import GradientGuard, SpikeGate

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = GradientGuard(model, spike_gate=SpikeGate(warmup_steps=1, history=10))
    measured, full = [], []
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * batch_seed + step)
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, outputs, generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.record(optimizer, step=step, loss=loss.detach())
        full.append(unsharded_gradient_norm(model.parameters()))
        verdict = guard.agree(torch.distributed.group.WORLD, global_step=step + 1)
        measured.append({level.measure: level.window_max for level in verdict.spike_check.levels})
        guard.reset()
        optimizer.step()
    return {"measured": measured, "full": full}


def hsdp_spike_gate_norm(root: str) -> dict[str, Any]:
    """The core on 4 ranks, no Trainer: FSDP2 with HSDP (``fully_shard`` on a 2 x 2 mesh: 2 replicas of 2 shards,
    every rank its own batch); the gate's norm against the full gradients' (:func:`_gate_norms`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fully_shard(model, mesh=mesh)
    return _gate_norms(model, torch.distributed.get_rank(), outputs=1)


def tp_spike_gate_norm(root: str) -> dict[str, Any]:
    """The core on 4 ranks, no Trainer: tensor parallelism on a 2 x 2 mesh (column- then row-wise linear layers on
    the ``tp`` dimension; the row-wise layer's bias replicated there), then FSDP2 over the ``dp`` dimension (every dp
    rank its own batch, the tp ranks of one dp rank the same); the gate's norm against the full gradients'
    (:func:`_gate_norms`), and each parameter's placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    results = _gate_norms(model, mesh["dp"].get_local_rank(), outputs=4)
    results["placements"] = {
        name: ["replicate" if placement.is_replicate() else "shard" if placement.is_shard() else str(placement)
               for placement in param.placements] for name, param in model.named_parameters()}
    return results


def scenarios() -> dict[str, Callable[[str], dict[str, Any]]]:
    table: dict[str, Callable[[str], dict[str, Any]]] = {}
    for zero1 in (False, True):
        opt = "zero1" if zero1 else "ddp"
        for config in ("periodic", "val_topk", "last"):
            fault = (5,)  # the last step before the boundary at global step 6
            table[f"{opt}-{config}-reject"] = lambda root, n=f"{opt}-{config}-reject", c=config, z=zero1, f=fault: run(
                root, n, c, z, True, f)
            table[f"{opt}-{config}-finite"] = lambda root, n=f"{opt}-{config}-finite", c=config, z=zero1: run(
                root, n, c, z, True)
            table[f"{opt}-{config}-plain"] = lambda root, n=f"{opt}-{config}-plain", c=config, z=zero1: run(
                root, n, c, z, False)
        for policy in ("skip", "stop"):
            table[f"{opt}-periodic-{policy}"] = lambda root, n=f"{opt}-periodic-{policy}", z=zero1, p=policy: run(
                root, n, "periodic", z, True, (5,), p)
        table[f"{opt}-manual-reject"] = lambda root, n=f"{opt}-manual-reject", z=zero1: run(
            root, n, "manual", z, True, (3,))
        table[f"{opt}-unselected-reject"] = lambda root, n=f"{opt}-unselected-reject", z=zero1: run(
            root, n, "unselected", z, True, (3,))
    table["ddp-trailing-reject"] = lambda root: run(root, "ddp-trailing-reject", "trailing", False, True, (6,))
    # batch 4 is the first micro-batch of optimizer step 2, run under no_sync on rank 1 only
    table["ddp-accumulate-reject"] = lambda root: run(root, "ddp-accumulate-reject", "accumulate", False, True,
                                                      fault_batches=(4,))
    if EMAWeightAveraging is not None:
        table["ddp-ema_best-reject"] = lambda root: run(root, "ddp-ema_best-reject", "ema_best", False, True, (5,))
        table["ddp-ema_best-finite"] = lambda root: run(root, "ddp-ema_best-finite", "ema_best", False, True)
    # rank 0's disk is full for epoch 1's top-1 file
    table["ddp-val_topk-write-fails"] = lambda root: run(root, "ddp-val_topk-write-fails", "top1_last", False, True,
                                                         fail_write="epoch=1")
    # rank 0's rename of epoch 1's top-1 file into place fails, after the boundary's last collective
    table["ddp-val_topk-move-fails"] = lambda root: run(root, "ddp-val_topk-move-fails", "top1_last", False, True,
                                                        refuse_move="epoch=1")
    # a hook of yours fails on one rank in epoch 1's save, before the strategy writes: on rank 1 under DDP, on rank 0
    # (the writer) in ZeRO-1, before the optimizer-state consolidation every rank must join
    table["ddp-val_topk-hook-fails"] = lambda root: run(root, "ddp-val_topk-hook-fails", "top1_last", False, True,
                                                        failing_hook=("on_save_checkpoint", 1))
    table["zero1-val_topk-hook-fails"] = lambda root: run(root, "zero1-val_topk-hook-fails", "top1_last", True, True,
                                                          failing_hook=("state_dict", 0))
    table["process-group-guard"] = guard_without_trainer
    table["process-group-state-check-fails"] = state_check_failing_on_one_rank
    if DEVICES == 4:
        table["hsdp-spike-gate-norm"] = hsdp_spike_gate_norm
        table["tp-spike-gate-norm"] = tp_spike_gate_norm
    return table


def main() -> None:
    run_scenarios(scenarios(), sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
