"""Two-rank CPU/gloo scenarios for the spike gate (``SpikeGate``, issue 28), run by
``tests/recover/test_spike_gate.py``:

    python spike_gate_worker.py KIND OUT_DIR [SCENARIO ...]

``KIND`` is ``ddp`` (replicated gradients, all-reduced), ``fsdp2`` (``ModelParallelStrategy`` with ``fully_shard``:
each rank holds DTensor shards of the averaged gradients) or ``ds2`` (DeepSpeed ZeRO-2 through
``tests/deepspeed_shim.py``, bf16-mixed as in the rewind worker: each rank holds its partition of the flat gradients,
and DeepSpeed reports its own global gradient norm, ``engine.get_global_grad_norm()``).

The model is a small regression MLP with an MSE loss, trained with Adam; each rank's batch ``i`` is a deterministic
function of ``(rank, i)`` (no sampler, no shuffle), so any run can be replayed in one process on the concatenated
global batches. At step ``SPIKE_STEP`` rank 1's targets are multiplied by 1e3: every value stays finite, but the
step's loss (the mean over the ranks) and its global gradient norm jump far above their baselines. A checkpoint every
step (``every_n_train_steps=1``, ``save_top_k=-1``) makes every window one step; the gate warms up in 3 steps. Every
rank runs every scenario in one process group (60 s collective timeouts) and writes what it observed to
``OUT_DIR/rank{N}.json``:

- ``reference``: the data without batch ``SPIKE_STEP`` (on every rank), ``max_steps=STEPS - 1``: nothing spikes;
- ``rewind``: the spiked data, ``on_non_finite="rewind"``, ``max_steps=STEPS``: the boundary after the spike is
  rejected, every rank goes back to the checkpoint published before it and trains on with the next batch, so every
  later checkpoint should be ``reference``'s (one global step later);
- ``raise``: the spiked data, ``on_non_finite="raise"``: every rank raises the same error at the boundary after it;
- ``resume``: a fit of 4 steps, then one resumed from its last checkpoint: the gate's history at the resumed fit's
  first batch and at its end;
- ``unlike-gates`` (DDP only, Trainer-free): a history loaded on rank 0 only raises the same error on every rank; a
  window one slot shorter on rank 0 is judged on the slots every rank holds;
- ``negative-loss`` (DDP only, Trainer-free): a ``GradientGuard`` per rank on the process group, one agreement per
  step, with negative losses (a log-likelihood's, say): what the gate reads as the global loss of each step.

Each scenario records per boundary what the gate measured (its levels' window maxima: with one-step windows, the
step's global loss and gradient norm); per step the 2-norm of the full, unsharded gradients (``full_tensor()`` of
each shard, then ``clip_grad_norm_``), or under DeepSpeed its own global norm; and, for comparison, the same steps
replayed in one process without any distribution on the concatenated global batches (``clip_grad_norm_`` of plain
gradients).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import warnings
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from strategies import make_strategy  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from helpers import (  # noqa: E402
    QUIET,
    deepspeed_unavailable_reported,
    fit_outcome,
    ledger_state,
    run_scenarios,
    unsharded_gradient_norm,
    whole,
)
from lightning_ckguard import FiniteGradCheckpoint, SpikeGate  # noqa: E402
from lightning_ckguard.recover.rewind import REWIND_LOG_NAME  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)

SPIKE_STEP = 5  # the optimizer step (and batch index) whose targets rank 1 multiplies
SPIKE_FACTOR = 1e3
STEPS = 10
ROWS, FEATURES, HIDDEN, OUTPUTS = 4, 8, 16, 2
LR = 0.01
WORLD_SIZE = 2


def gate() -> SpikeGate:
    return SpikeGate(warmup_steps=3, history=50)


def batch(rank: int, index: int, spiked: bool) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s batch ``index``: a noisy linear teacher; rank 1's targets times 1e3 at the spike."""
    generator = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    teacher = torch.linspace(-1.0, 1.0, FEATURES * OUTPUTS).reshape(FEATURES, OUTPUTS)
    y = x @ teacher + 0.1 * torch.randn(ROWS, OUTPUTS, generator=generator)
    if spiked and rank == 1 and index == SPIKE_STEP:
        y = y * SPIKE_FACTOR
    return x, y


class Batches(Dataset):
    """Rank ``rank``'s batches at ``indices``, in order (one item is one whole batch)."""

    def __init__(self, rank: int, indices: list[int], spiked: bool) -> None:
        self.rank, self.indices, self.spiked = rank, indices, spiked

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return batch(self.rank, self.indices[i], self.spiked)


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


class Regression(LightningModule):
    def __init__(self, indices: list[int], spiked: bool, fsdp2: bool) -> None:
        super().__init__()
        self.net = make_net()
        self.indices, self.spiked, self.fsdp2 = indices, spiked, fsdp2

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers():
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def layers(self) -> list[nn.Module]:
        return [layer for layer in self.net.children() if isinstance(layer, nn.Linear)]

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Batches(self.global_rank, self.indices, self.spiked), batch_size=None, shuffle=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=LR)


class GateProbe(Callback):
    """What the gate measured at each boundary, and the full gradients' norm of each step (under DeepSpeed, whose
    gradients are not in ``param.grad``, the norm DeepSpeed computed itself)."""

    def __init__(self) -> None:
        self.verdicts: dict[int, dict[str, Any]] = {}
        self.unsharded_norms: dict[int, float] = {}
        self.deepspeed_norms: dict[int, float] = {}

    def note_verdict(self, trainer: Any) -> None:
        verdict = trainer.checkpoint_callback.last_verdict
        if verdict is not None and verdict.global_step not in self.verdicts:
            self.verdicts[verdict.global_step] = {
                "accepted": verdict.accepted,
                "levels": {level.measure: level.window_max for level in verdict.spike_check.levels},
                "baselines": {level.measure: level.baseline for level in verdict.spike_check.levels},
            }

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.note_verdict(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is not None:  # before the checkpoint callback's boundary (Lightning runs those last)
            self.deepspeed_norms[int(trainer.global_step) - 1] = float(engine.get_global_grad_norm())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if hasattr(trainer.strategy, "deepspeed_engine"):
            return  # no param.grad: DeepSpeed's own norm is read after the step
        self.unsharded_norms[int(trainer.global_step)] = unsharded_gradient_norm(pl_module.parameters())


def replay(initial: dict[str, Tensor], indices: list[int], spiked: bool) -> list[dict[str, float]]:
    """The same training in this one process, no distribution: each step on the concatenation of every rank's batch
    (the mean over it is the mean of the ranks' means). Returns each step's loss and gradient norm."""
    net = make_net()
    net.load_state_dict(initial)
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    steps = []
    for index in indices:
        xs, ys = zip(*(batch(rank, index, spiked) for rank in range(WORLD_SIZE)), strict=True)
        loss = F.mse_loss(net(torch.cat(xs)), torch.cat(ys))
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=float("inf"))
        optimizer.step()
        steps.append({"loss": float(loss), "grad_norm": float(norm)})
    return steps


def _lists(state: dict[str, Tensor]) -> dict[str, Any]:
    return {name: tensor.detach().float().cpu().tolist() for name, tensor in state.items()}


def checkpoint_weights(path: str) -> dict[str, Any]:
    """The model weights a checkpoint on disk holds (a file, or FSDP2's distributed checkpoint), read here alone."""
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    elif os.path.isdir(os.path.join(path, "checkpoint")):  # DeepSpeed ZeRO-2: the (bf16) module, whole
        module_file = os.path.join(path, "checkpoint", "mp_rank_00_model_states.pt")
        state = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            converted = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(path, converted)
            state = torch.load(converted, map_location="cpu", weights_only=False)["state_dict"]
    return _lists(state)


def _strategy_and_precision(kind: str) -> dict[str, Any]:
    if kind == "ds2":  # as the rewind worker: bf16 with DeepSpeed's overflow check off
        precision = "bf16-mixed"
        return {"strategy": make_strategy(kind, timeout=TIMEOUT, precision=precision, check_grad_overflow=False),
                "precision": precision}
    return {"strategy": make_strategy(kind, timeout=TIMEOUT), "precision": "32-true"}


class HistoryAtFirstBatch(Callback):
    """How many loss values the running guard's gate holds at the fit's first training batch."""

    def __init__(self) -> None:
        self.values: int | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        fit = trainer.checkpoint_callback._fit  # type: ignore[union-attr]
        if self.values is None and fit is not None and fit.guard is not None:
            self.values = len(fit.guard.state_dict()["spike_history"]["loss"])


def resume(root: str, kind: str) -> dict[str, Any]:
    """A fit of 4 steps (a checkpoint each, every window learned), then one resumed from its last checkpoint: the
    resumed fit's gate holds the 4 values from its first batch (FSDP2 and DeepSpeed load the callback's state after
    the guard is made)."""
    dirpath = os.path.join(root, f"{kind}-resume")
    histories = []
    for max_steps, ckpt_path in ((4, None), (6, os.path.join(dirpath, "step=4.ckpt"))):
        seed_everything(7)
        callback = FiniteGradCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=1, filename="{step}",
                                        spike_gate=gate())
        probe = HistoryAtFirstBatch()
        trainer = Trainer(**_strategy_and_precision(kind), devices=2, callbacks=[probe, callback],
                          max_steps=max_steps, limit_val_batches=0, use_distributed_sampler=False, **QUIET)
        model = Regression(list(range(STEPS)), spiked=False, fsdp2=kind == "fsdp2")
        outcome = fit_outcome(lambda trainer=trainer, model=model, path=ckpt_path: trainer.fit(model, ckpt_path=path))
        histories.append({"error": outcome["error"], "at_first_batch": probe.values,
                          "at_end": len(callback.state_dict()["spike_history"]["loss"])})
    return {"fits": histories}


def run(root: str, name: str, kind: str, indices: list[int], spiked: bool, on_non_finite: Literal["raise", "rewind"],
        max_steps: int, replayed: bool = True) -> dict[str, Any]:
    seed_everything(7)
    dirpath = os.path.join(root, name)
    model = Regression(indices, spiked, fsdp2=kind == "fsdp2")
    initial = copy.deepcopy(model.net.state_dict())
    callback = FiniteGradCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=-1,
                                    every_n_train_steps=1, filename="{step}", on_non_finite=on_non_finite,
                                    spike_gate=gate())
    probe = GateProbe()
    trainer = Trainer(**_strategy_and_precision(kind), devices=2, callbacks=[probe, callback], max_steps=max_steps,
                      limit_val_batches=0, use_distributed_sampler=False, **QUIET)
    result = fit_outcome(lambda: trainer.fit(model))
    probe.note_verdict(trainer)
    report = callback.last_report
    result.update(
        global_step=trainer.global_step,
        verdicts={str(step): fields for step, fields in sorted(probe.verdicts.items())},
        unsharded_norms={str(step): norm for step, norm in sorted(probe.unsharded_norms.items())},
        deepspeed_norms={str(step): norm for step, norm in sorted(probe.deepspeed_norms.items())},
        # a run without a rewind replayed in one process, as far as it trained
        replay=replay(initial, indices[: len(probe.verdicts)], spiked) if replayed else None,
        last_report={"accepted": report.accepted, "global_step": report.global_step, "ranks": list(report.ranks),
                     "spikes": [asdict(s) for s in report.spikes]} if report is not None else None,
        rewinds=[r.as_dict() for r in callback.rewinds],
        state=ledger_state(callback),
        weights=_lists({n: whole(p.detach()) for n, p in model.named_parameters()}),
    )
    if trainer.global_rank == 0:
        entries = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []
        result["entries"] = entries
        result["files"] = {e: checkpoint_weights(os.path.join(dirpath, e)) for e in entries if e != REWIND_LOG_NAME}
    return result


NEGATIVE_LOSSES = [-2.0, -1.5, -1.8, -1.7, -1.6, 0.5]  # rank r gives each plus 0.1 * r


def negative_loss(root: str) -> dict[str, Any]:
    """Each rank records a step per loss of ``NEGATIVE_LOSSES`` (plus ``0.1 * rank``) and agrees after each, on the
    process group the earlier scenarios left (no Trainer): the gate's global loss per step, and its verdicts."""
    from lightning_ckguard import GradientGuard

    torch.manual_seed(0)
    rank = torch.distributed.get_rank()
    module = nn.Linear(2, 1)
    guard = GradientGuard(module, spike_gate=gate())
    steps = []
    for step, loss in enumerate(NEGATIVE_LOSSES):
        module(torch.ones(1, 2)).sum().backward()
        guard.record(None, step=step, loss=torch.tensor(loss + 0.1 * rank))
        verdict = guard.agree(torch.distributed.group.WORLD, global_step=step + 1)
        levels = {level.measure: level.window_max for level in verdict.spike_check.levels}
        steps.append({"loss": levels["loss"], "accepted": verdict.accepted,
                      "spikes": [spike.measure for spike in verdict.spike_check.spikes]})
        guard.reset()
        module.zero_grad()
    return {"steps": steps}


def unlike_gates(root: str) -> dict[str, Any]:
    """Ranks whose windows or gates differ: a history loaded on rank 0 only (a Trainer-free resume that loads on rank
    0 and broadcasts the weights), then a window with one slot fewer on rank 0 (reset there after the first step, as
    where an exception stops one rank before its step is recorded). Each agreement must reach the same outcome on
    every rank, not a verdict per rank (rank 0 rejecting a spike its own baseline sees, rank 1 accepting it and
    waiting in the next collective): the same error for the histories, the same verdict on the slots both hold.
    Then a step more on rank 1 that folds its window of two slots and not rank 0's: their slots hold different steps,
    so the same error again."""
    from lightning_ckguard import GradientGuard

    rank = torch.distributed.get_rank()
    module = nn.Linear(2, 1)
    outcomes = []
    for misuse in ("history loaded on rank 0", "window reset on rank 0", "a step more on rank 1, folded"):
        folding = misuse.endswith("folded")  # two slots: rank 1's third step folds its window, rank 0's does not
        guard = GradientGuard(module, spike_gate=SpikeGate(warmup_steps=3, history=50, resolution=2) if folding
                              else gate())
        if misuse.startswith("history") and rank == 0:
            guard.load_state_dict({"spike_history": {"loss": [1.0, 1.1, 0.9, 1.0], "grad_norm": [1.0] * 4}})
        for step, loss in enumerate((1.0, 1e4, 1.0) if folding and rank == 1 else (1.0, 1e4)):
            module(torch.ones(1, 2)).sum().backward()
            guard.record(None, step=step, loss=torch.tensor(loss))
            module.zero_grad()
            if misuse.startswith("window") and rank == 0 and step == 0:
                guard.reset()
        try:
            verdict = guard.agree(torch.distributed.group.WORLD, global_step=2)
            outcomes.append({"misuse": misuse, "accepted": verdict.accepted, "error": None,
                             "window_max": [level.window_max for level in verdict.spike_check.levels]})
        except RuntimeError as error:
            outcomes.append({"misuse": misuse, "accepted": None, "error": str(error), "window_max": None})
    return {"outcomes": outcomes}


def unlogged_monitor(root: str) -> dict[str, Any]:
    """A monitored key no rank ever logs: each due boundary's top-K vote (an agreement, with peers) finds it missing,
    nothing is written, and no window is published, so the gate has learned nothing when the fit ends; and no rank
    checks its state for those votes (nothing with state is written)."""
    import lightning_ckguard.lightning.fit as guarded_fit

    seed_everything(7)
    checked: list[int] = []  # the state checks the fit ran (a pass over every parameter and optimizer state)
    real_state = guarded_fit.lightning_checkpoint_state
    guarded_fit.lightning_checkpoint_state = lambda trainer: (checked.append(1), real_state(trainer))[1]
    callback = FiniteGradCheckpoint(dirpath=os.path.join(root, "unlogged-monitor"), monitor="never_logged",
                                    every_n_train_steps=2, spike_gate=gate())
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback],
                      max_steps=6, limit_val_batches=0, use_distributed_sampler=False, **QUIET)
    try:
        result = fit_outcome(lambda: trainer.fit(Regression(list(range(STEPS)), spiked=False, fsdp2=False)))
    finally:
        guarded_fit.lightning_checkpoint_state = real_state
    result["state_checks"] = len(checked)
    result["history"] = {measure: len(values) for measure, values in
                         callback.state_dict().get("spike_history", {}).items()}
    result["entries"] = sorted(os.listdir(callback.dirpath)) if os.path.isdir(callback.dirpath) else []
    return result


class BufferGoesNaN(Regression):
    """Its gradients stay finite; a buffer of its state goes NaN at step 1 (a running statistic gone bad)."""

    def __init__(self) -> None:
        super().__init__(list(range(STEPS)), spiked=False, fsdp2=False)
        self.register_buffer("stat", torch.zeros(3))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.trainer.global_step == 1:
            self.stat.fill_(float("nan"))
        return super().training_step(batch, batch_idx)


def unlogged_monitor_last(root: str) -> dict[str, Any]:
    """The monitored key is never logged, `save_last=True`: train end still writes `last`, whose agreement must check
    every rank's state (the votes before it left the state out)."""
    seed_everything(7)
    callback = FiniteGradCheckpoint(dirpath=os.path.join(root, "unlogged-monitor-last"), monitor="never_logged",
                                    save_last=True)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback],
                      max_steps=3, limit_val_batches=0, use_distributed_sampler=False, **QUIET)
    result = fit_outcome(lambda: trainer.fit(BufferGoesNaN()))
    result["entries"] = sorted(os.listdir(callback.dirpath)) if os.path.isdir(callback.dirpath) else []
    return result


def scenarios(kind: str) -> dict[str, Any]:
    everything = list(range(STEPS))
    without_spike = [i for i in everything if i != SPIKE_STEP]
    table: dict[str, Any] = {
        "reference": lambda root: run(root, f"{kind}-reference", kind, without_spike, spiked=False,
                                      on_non_finite="rewind", max_steps=STEPS - 1),
        "rewind": lambda root: run(root, f"{kind}-rewind", kind, everything, spiked=True, on_non_finite="rewind",
                                   max_steps=STEPS, replayed=False),
        "raise": lambda root: run(root, f"{kind}-raise", kind, everything, spiked=True, on_non_finite="raise",
                                  max_steps=STEPS),
        "resume": lambda root: resume(root, kind),
    }
    if kind == "ddp":
        table["negative-loss"] = negative_loss
        table["unlike-gates"] = unlike_gates
        table["unlogged-monitor"] = unlogged_monitor
        table["unlogged-monitor-last"] = unlogged_monitor_last
    return table


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind.startswith("ds") and deepspeed_unavailable_reported(out):  # before any Trainer
        return
    run_scenarios(scenarios(kind), out, set(sys.argv[3:]))


if __name__ == "__main__":
    main()
