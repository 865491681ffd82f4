"""The spike gate (issue 28): false positives on clean runs, the margin to the thresholds, and the per-step cost.

Part 1, false positives (not a timing). Clean training runs in a plain PyTorch loop, each watched at once by three
``GradientGuard(model, spike_gate=SpikeGate())`` (the DEFAULT gate) with a boundary every 1, 50 and 500 steps (agree,
then reset on acceptance, when the gate learns the window; 500 steps fold the window once, resolution 256). Every
judged value's ratio to the baseline and its deviations are recomputed from the same baseline the gate used, so the
margin of the steps that did not spike is shown too. A step spikes only when both exceed their thresholds, so the
"joint" score ``min(ratio / factor, deviations / deviations_threshold)`` above 1 is a false positive. Tasks:

  lm        2-layer causal transformer decoder (d_model 128, 4 heads), vocabulary 64, on a token stream drawn from a
            fixed random sparse Markov chain (learnable), batch 16 x 64 tokens, AdamW 1e-3, 100-step linear warm-up
            then cosine decay to 10%
  mlp-cls   32-256-256-10 MLP classifying 10 Gaussian clusters with 10% of the labels flipped, a fixed set of 8,192
            samples in reshuffled epochs, batch 64, SGD with momentum 0.9, lr 0.05, warm-up then cosine decay
  mlp-reg   16-256-256-1 MLP regressing a smooth nonlinear target with Gaussian noise (sigma 0.1), fixed 8,192
            samples in epochs, batch 64, Adam 1e-3 constant

A sanity row per task injects one real spike in a separate run (seed 0, boundary every 50 steps): the LM's logits
times 30 for one step, the classifier's inputs times 100, the regression targets times 1,000. The injected step is
recorded, then not applied (a rewind would drop it); its window must be rejected.

Part 2, cost (timed, take the lock): the training step (forward, backward, ``guard.record(optimizer, loss=...)``,
optimizer step) with no guard, ``GradientGuard(model)`` (gate off) and ``GradientGuard(model, spike_gate=SpikeGate())``
(gate on), and a fourth row, a proposal measured here only (``OnePassSquares``: on CPU, flags and squares from one
fp32 norm pass), on one model and one optimizer, the rows taking turns step by step (order alternating), a boundary
every 50 steps of each guard outside the timed step. Reported: median step times, the median of the per-round ratio
gate on / gate off with a bootstrap 90% interval, and the record call timed inside the same steps (the precise
figure: the implied step ratio). Host reads and collectives of the gate-on step are counted with a dispatch mode.
Then where the gate's record cost goes: the same gradients read by each piece, interleaved (hot: the same gradients
again and again, so a second pass over them looks cheaper here than inside a training step, where the backward
has just written them).

  transformer  end_to_end.py's causal LM (6 layers, d_model 512, vocabulary 8192, 27.4M parameters), batch 8 x 128,
               AdamW, 40 rounds
  mlp          end_to_end.py's 784-2048-2048-10 MLP (5.8M parameters), batch 256, AdamW, 200 rounds

Part 3, reads (timed, take the lock): why the gate's second read costs what it does inside a training step. In each
training step of the model (forward, backward, then this, then the optimizer step), every full piece of the large fp32
gradients is read by a sequence of kernels, one after the other on the same piece, and each position of the sequence
is timed, summed over the pieces. The library's gate-on order is "probe, dot" or "aminmax, dot" (its exact read,
whichever its calibration chose, then the squares from cache); a third read of the same piece shows what a read from
the core's cache costs there; the sequences take turns step by step.

    python benchmarks/spike_gate.py --threads 1 --parts fp sanity     # part 1, ~15 min (not timed: no lock)
    python benchmarks/spike_gate.py --parts fp --steps 300 --seeds 0  # a quick look
    flock /tmp/mp.lock python benchmarks/spike_gate.py --parts cost   # part 2, timed, ~5 min on 2 cores
    flock /tmp/mp.lock python benchmarks/spike_gate.py --parts reads --models mlp  # part 3, ~1 min
    python benchmarks/spike_gate.py --parts cost --device cuda --mlp-rounds 400 --transformer-rounds 100

``--device cuda`` (prepared, not yet run: no GPU was lent to the task that wrote it) trains part 2's models on the GPU,
times the steps and the record call with CUDA events read after each step, and counts the host syncs of the counted
record calls (``torch.cuda.set_sync_debug_mode("warn")``); there the gate is one fused float64 norm pass.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CountOps, interleaved, machine, median, ms, ratio_rows, table  # noqa: E402

from lightning_ckguard import GradientGuard  # noqa: E402
from lightning_ckguard.agree.spikes import SpikeGate, global_values, scores  # noqa: E402
from lightning_ckguard.record.finiteness import (  # noqa: E402
    _PROBE_SCALE,
    PIECE_NUMEL,
    PROBE_WIDTH,
    NonFiniteCheck,
    _ExtremesPiece,
    _ProbePiece,
)
from lightning_ckguard.record.squares import FlagsAndSquares, _squares_in_own_precision  # noqa: E402
from lightning_ckguard.record.step_values import StepValues  # noqa: E402

MEASURES = ("loss", "grad_norm")


# ---------------------------------------------------------------------- part 1: tasks


class CausalLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(context, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def schedule(optimizer: torch.optim.Optimizer, steps: int, warmup: int = 100, floor: float = 0.1) -> object:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class Task:
    """A model, its optimizer and schedule, and ``loss(step, spike)``: the step's loss (``spike``: inject one)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    loss: object


def lm_task(seed: int, steps: int) -> Task:
    vocab, context, batch = 64, 64, 16
    g = torch.Generator().manual_seed(1000 + seed)
    torch.manual_seed(1000 + seed)
    # a sparse random Markov chain: each token has a few likely successors
    transitions = torch.distributions.Dirichlet(torch.full((vocab,), 0.1)).sample((vocab,))
    transitions = (transitions + 1e-4) / (transitions + 1e-4).sum(1, keepdim=True)
    torch.manual_seed(seed)
    model = CausalLM(vocab, 128, 2, 4, context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def loss(step: int, spike: bool) -> Tensor:
        tokens = torch.empty(batch, context + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, context + 1):
            tokens[:, t] = torch.multinomial(transitions[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        logits = model(tokens[:, :-1])
        if spike:
            logits = logits * 30
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return Task(model, optimizer, schedule(optimizer, steps), loss)


def epochs(x: Tensor, y: Tensor, batch: int, g: torch.Generator):
    while True:
        order = torch.randperm(len(x), generator=g)
        for start in range(0, len(x) - batch + 1, batch):
            index = order[start : start + batch]
            yield x[index], y[index]


def mlp_cls_task(seed: int, steps: int) -> Task:
    g = torch.Generator().manual_seed(2000 + seed)
    centres = torch.randn(10, 32, generator=g) * 1.5
    labels = torch.randint(0, 10, (8192,), generator=g)
    x = centres[labels] + torch.randn(8192, 32, generator=g)
    flip = torch.rand(8192, generator=g) < 0.1
    labels = torch.where(flip, torch.randint(0, 10, (8192,), generator=g), labels)
    batches = epochs(x, labels, 64, g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss(step: int, spike: bool) -> Tensor:
        inputs, targets = next(batches)
        return nn.functional.cross_entropy(model(inputs * 100 if spike else inputs), targets)

    return Task(model, optimizer, schedule(optimizer, steps), loss)


def mlp_reg_task(seed: int, steps: int) -> Task:
    g = torch.Generator().manual_seed(3000 + seed)
    w = torch.randn(16, 8, generator=g)
    x = torch.randn(8192, 16, generator=g)
    y = (torch.sin(x @ w).sum(1, keepdim=True) / 2 + 0.1 * (x[:, :1] ** 2)) + 0.1 * torch.randn(8192, 1, generator=g)
    batches = epochs(x, y, 64, g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss(step: int, spike: bool) -> Tensor:
        inputs, targets = next(batches)
        return nn.functional.mse_loss(model(inputs), targets * 1000 if spike else targets)

    return Task(model, optimizer, None, loss)


TASKS = {"lm": lm_task, "mlp-cls": mlp_cls_task, "mlp-reg": mlp_reg_task}


# ---------------------------------------------------------------------- part 1: watching


@dataclass
class Margin:
    """The largest ratio, deviations and joint score of the judged values of one task, measure and boundary."""

    ratio: float = 0.0
    deviations: float = -math.inf
    joint: float = -math.inf
    joint_at: str = ""
    judged: int = 0
    spikes: list[str] = field(default_factory=list)
    rejections: int = 0
    boundaries: int = 0


class Watch:
    """One guard with a boundary every ``every`` steps, and the margins of everything it judged."""

    def __init__(self, model: nn.Module, gate: SpikeGate, every: int) -> None:
        self.guard = GradientGuard(model, spike_gate=gate)
        self.gate, self.every = gate, every
        self.margins = {m: Margin() for m in gate.measures}
        self.rejected_windows: list[tuple[int, list[str]]] = []

    def record(self, optimizer: torch.optim.Optimizer, step: int, loss: Tensor) -> None:
        self.guard.record(optimizer, step=step, loss=loss.detach())

    def boundary(self, step: int, label: str) -> None:
        guard = self.guard
        history = guard._spike_history
        baselines = {m: history.baseline(m) for m in self.gate.measures}  # judge's: it changes only at reset
        values = guard.window.step_values
        verdict = guard.agree(None, global_step=step)
        measures = global_values(values.summary().tolist(), values.capacity, values.labels, 1)
        for m in self.gate.measures:
            margin = self.margins[m]
            margin.boundaries += 1
            if baselines[m] is None:
                continue
            median_, spread = baselines[m]
            for value, (first, _last) in zip(measures.values[m], measures.labels, strict=True):
                if value is None:
                    continue
                ratio, dev = scores(value, median_, spread)
                joint = min(ratio / self.gate.factor, dev / self.gate.deviations)
                margin.judged += 1
                margin.ratio = max(margin.ratio, ratio)
                margin.deviations = max(margin.deviations, dev)
                if joint > margin.joint:
                    margin.joint, margin.joint_at = joint, f"{label} step {first}"
        spikes = [f"{s.measure}@{s.first_step} x{s.ratio:.3g} {s.deviations:.3g}sd" for s in verdict.spike_check.spikes]
        for s in verdict.spike_check.spikes:
            self.margins[s.measure].spikes.append(f"{label} {s.measure}@{s.first_step}")
        if verdict.accepted:
            guard.reset()
        else:
            for m in self.gate.measures:
                self.margins[m].rejections += 1
            self.rejected_windows.append((step, spikes))
            guard.reset()  # the window is dropped, not learned (a rewind would train past it)


def train(task_name: str, seed: int, steps: int, everies: list[int], gate: SpikeGate,
          spike_at: int | None = None) -> tuple[list[Watch], list[float]]:
    task = TASKS[task_name](seed, steps)
    watches = [Watch(task.model, gate, every) for every in everies]
    losses: list[float] = []
    for step in range(steps):
        spike = step == spike_at
        loss = task.loss(step, spike)
        loss.backward()
        for watch in watches:
            watch.record(task.optimizer, step, loss)
        if spike:
            task.optimizer.zero_grad()  # recorded, not applied
        else:
            task.optimizer.step()
            task.optimizer.zero_grad()
            if task.scheduler is not None:
                task.scheduler.step()
        if step % 100 == 0 or step == steps - 1:
            losses.append(float(loss.detach()))
        for watch in watches:
            if (step + 1) % watch.every == 0:
                watch.boundary(step, f"seed {seed}")
    return watches, losses


def false_positives(args: argparse.Namespace) -> None:
    gate = SpikeGate()
    print(f"## 1. False positives with the default gate: factor {gate.factor:g}, deviations {gate.deviations:g}, "
          f"warmup_steps {gate.warmup_steps}, history {gate.history}, resolution {gate.resolution}\n")
    print(f"{args.steps} steps per run, seeds {args.seeds}, boundaries every {args.every} steps "
          f"(one guard each, watching the same run)\n")
    rows = []
    worst: dict[tuple[str, str], float] = {}
    for task_name in args.tasks:
        merged: dict[tuple[int, str], Margin] = {}
        start = time.perf_counter()
        curves = []
        for seed in args.seeds:
            watches, losses = train(task_name, seed, args.steps, args.every, gate)
            curves.append(losses)
            for watch in watches:
                for m, margin in watch.margins.items():
                    into = merged.setdefault((watch.every, m), Margin())
                    into.judged += margin.judged
                    into.boundaries += margin.boundaries
                    into.rejections += margin.rejections
                    into.ratio = max(into.ratio, margin.ratio)
                    into.deviations = max(into.deviations, margin.deviations)
                    into.spikes += margin.spikes
                    if margin.joint > into.joint:
                        into.joint, into.joint_at = margin.joint, margin.joint_at
        elapsed = time.perf_counter() - start
        shown = ", ".join(f"{c[0]:.3g} -> {c[-1]:.3g}" for c in curves)
        print(f"{task_name}: loss first -> last step per seed: {shown} ({elapsed:.0f} s)")
        for (every, m), margin in sorted(merged.items()):
            worst[(task_name, m)] = max(worst.get((task_name, m), -math.inf), margin.joint)
            judged = margin.judged > 0
            rows.append([task_name, every, m, margin.boundaries, margin.judged, margin.rejections,
                         f"{margin.ratio:.2f}" if judged else "-", f"{margin.deviations:.2f}" if judged else "-",
                         f"{margin.joint:.3f}" if judged else "-",
                         f"{1 / margin.joint:.1f}x" if margin.joint > 0 else "-", margin.joint_at or "-",
                         "; ".join(margin.spikes[:4]) or "none"])
    print()
    print(table(["task", "every", "measure", "boundaries", "judged values", "rejected", "max ratio",
                 "max deviations", "max joint", "margin (1/joint)", "joint max at", "spikes"], rows))
    print(f"\nThresholds: ratio > {gate.factor:g} AND deviations > {gate.deviations:g}; joint > 1 is a spike.\n")


def sanity(args: argparse.Namespace) -> None:
    gate = SpikeGate()
    print("## 1b. Sanity: one injected spike per task (seed 0, boundary every 50 steps)\n")
    rows = []
    for task_name in args.tasks:
        at = min(args.spike_at, args.steps - 1)
        watches, _ = train(task_name, 0, min(args.steps, at + 101), [50], gate, spike_at=at)
        watch = watches[0]
        window = next((w for w in watch.rejected_windows if w[0] >= at), None)
        others = [w for w in watch.rejected_windows if w is not window]
        rows.append([task_name, at, "rejected" if window else "NOT rejected",
                     "; ".join(window[1]) if window else "-", len(others)])
    print(table(["task", "injected at step", "its window", "spikes found (measure@step, ratio, deviations)",
                 "other rejections"], rows))
    print()


# ---------------------------------------------------------------------- part 2: cost


class TinyLM(nn.Module):
    """end_to_end.py's transformer (6 layers, d_model 512, vocabulary 8192)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = CausalLM(8192, 512, 6, 8, 128)

    def forward(self, tokens: Tensor) -> Tensor:
        logits = self.lm(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class MLP(nn.Module):
    """end_to_end.py's MLP (784-2048-2048-10)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def cost_model(name: str, device: torch.device | str = "cpu") -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "transformer":
        batches: list = [torch.randint(0, 8192, (8, 129), generator=g).to(device) for _ in range(4)]
        return TinyLM().to(device), batches
    batches = [(torch.randn(256, 784, generator=g).to(device), torch.randint(0, 10, (256,), generator=g).to(device))
               for _ in range(4)]
    return MLP().to(device), batches


class StepClock:
    """Marks inside a training step and the seconds between them: the host's clock on a CPU; on CUDA, events on the
    current stream, read once the step has finished, so that timing adds no host sync inside the step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: object, end: object) -> float:
        """Between two marks; on CUDA this waits for ``end``."""
        if not self.cuda:
            return end - start  # type: ignore[operator]
        end.synchronize()  # type: ignore[attr-defined]
        return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]

    def settled(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn``, and on CUDA a wait for what it launched, for a host clock to time it."""
        if not self.cuda:
            return fn

        def run() -> object:
            result = fn()
            torch.cuda.synchronize()
            return result

        return run


class OnePassSquares:
    """A PROPOSAL, measured here only and not taken (it would break exact finiteness, invariant 7): on CPU, for fp32
    gradients, the flags and the sum of squares from ONE fp32 ``_foreach_norm`` pass, as the accelerator path does
    in float64. A tensor with a NaN or an inf has a non-finite norm, so every non-finite gradient is still flagged;
    what is lost is exactness the other way: a finite fp32 gradient whose norm overflows fp32 (above ~1.8e19) is
    flagged as non-finite (in the library it is a value of inf for the gate, which rejects the boundary as a spike:
    a rejection either way, with another name)."""

    def __init__(self, fallback: object) -> None:
        self.fallback = fallback

    def __call__(self, grads: list[Tensor], out_device: torch.device,
                 replicas: object = None) -> tuple[Tensor, Tensor]:
        if not grads or any(g.dtype != torch.float32 or g.layout != torch.strided or g.device.type != "cpu"
                            for g in grads):
            return self.fallback(grads, out_device)
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm(list(grads), 2))
        flags = norms.mul(0).ne(0)
        squares = torch.where(flags, 0.0, norms.to(torch.float64).square()).sum()
        return flags, squares


def one_pass_guard(model: nn.Module) -> GradientGuard:
    guard = GradientGuard(model, spike_gate=SpikeGate())
    guard.window._flags_and_squares = OnePassSquares(guard.window._flags_and_squares)
    return guard


ROWS = ("no guard", "gate off", "gate on", "gate on, one pass (proposal)")


def for_each_model(heading: str, part: Callable[[str, argparse.Namespace], None], args: argparse.Namespace) -> None:
    print(f"{heading}\n")
    for name in args.models:
        part(name, args)


@contextmanager
def host_syncs(clock: StepClock) -> Iterator[list[warnings.WarningMessage]]:
    """On CUDA, the host syncs inside, as the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (counted, so that
    one found is a figure, not a run lost); elsewhere none are looked for."""
    if not clock.cuda:
        yield []
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)


def training(name: str, args: argparse.Namespace) -> tuple[nn.Module, object, torch.optim.Optimizer]:
    """A cost model on ``--device``, its batches and its optimizer (AdamW)."""
    model, batches = cost_model(name, args.device)
    return model, batches, torch.optim.AdamW(model.parameters(), lr=1e-4)


def cost_one(name: str, args: argparse.Namespace) -> None:
    model, batches, optimizer = training(name, args)
    clock = StepClock(torch.device(args.device))
    guards = {"no guard": None, "gate off": GradientGuard(model),
              "gate on": GradientGuard(model, spike_gate=SpikeGate()),
              "gate on, one pass (proposal)": one_pass_guard(model)}
    recorded = {row: 0 for row in ROWS}
    record_times: dict[str, list[float]] = {row: [] for row in ROWS[1:]}
    counter = [0]

    def step(row: str, timed_record: bool = True) -> float:
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        start = clock.mark()
        loss = model(batch)
        loss.backward()
        guard = guards[row]
        if guard is not None:
            before = clock.mark()
            guard.record(optimizer, step=recorded[row], loss=loss.detach())
            after = clock.mark()
        optimizer.step()
        optimizer.zero_grad()
        elapsed = clock.seconds(start, clock.mark())
        if guard is not None and timed_record:
            record_times[row].append(clock.seconds(before, after))
        if guard is not None:
            recorded[row] += 1
            if recorded[row] % 50 == 0:  # a boundary, outside the timed step
                verdict = guard.agree(None, global_step=recorded[row])
                assert verdict.accepted, verdict
                guard.reset()
        return elapsed

    rounds = args.mlp_rounds if name == "mlp" else args.transformer_rounds
    for _ in range(args.cost_warmup):
        for row in ROWS:
            step(row, timed_record=False)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for repeat in range(rounds):
        for row in ROWS if repeat % 2 == 0 else reversed(ROWS):
            times[row].append(step(row))
    # host reads and collectives, over a few steps of each row
    counts = {}
    record_syncs: dict[str, int] = {}
    for row in ROWS:
        guard = guards[row]
        with CountOps() as whole:
            for _ in range(args.count_steps):
                step(row, timed_record=False)
        record_ops = CountOps()
        if guard is not None:
            loss = model(batches[0])
            loss.backward()
            with record_ops, host_syncs(clock) as syncs:
                for i in range(args.count_steps):
                    guard.record(optimizer, step=10**6 + i, loss=loss.detach())
            record_syncs[row] = sum("synchroniz" in str(w.message) for w in syncs)
            optimizer.zero_grad()
            guard.agree(None, global_step=10**6)
            guard.reset()
        counts[row] = (whole, record_ops)
    params = sum(p.numel() for p in model.parameters())
    print(f"### {name}: {params / 1e6:.1f}M parameters, {rounds} rounds of the {len(ROWS)} rows "
          f"(+{args.cost_warmup} warm-up)\n")
    rows = ratio_rows(times, "gate off", {"no guard": "reference", "gate on": "SpikeGate() defaults",
                                          "gate on, one pass (proposal)": "not the library's code"})
    for row in rows:
        name_, whole_ops = row[0], counts[row[0]][0]
        row.append(f"{whole_ops.host_reads / args.count_steps:g} / {whole_ops.collectives / args.count_steps:g}")
        record_ops = counts[name_][1]
        row.append("-" if guards[name_] is None else
                   f"{record_ops.host_reads / args.count_steps:g} / {record_ops.collectives / args.count_steps:g}"
                   f" ({len(record_ops.names) / args.count_steps:g} ops)"
                   + (f", {record_syncs[name_] / args.count_steps:g} CUDA syncs" if clock.cuda else ""))
        row.append(ms(median(record_times[name_])) if name_ in record_times else "-")
    print(table(["row", "median step ms", "vs gate off", "min ms", "min vs gate off", "note",
                 "host reads / collectives per step (whole step)", "per record call", "record ms (median)"],
                rows))
    paired = [on / off for on, off in zip(times["gate on"], times["gate off"], strict=True)]
    low, high = bootstrap(paired)
    extra = median(record_times["gate on"]) - median(record_times["gate off"])
    implied = 1 + extra / median(times["gate off"])
    print(f"\nPer-round ratio gate on / gate off: median {median(paired):.4f} (90% bootstrap interval "
          f"{low:.4f}-{high:.4f}). The record call timed inside the same steps: gate off "
          f"{ms(median(record_times['gate off']))} ms, gate on {ms(median(record_times['gate on']))} ms, "
          f"+{ms(extra)} ms = implied step ratio {implied:.4f}.")
    proposal = ROWS[3]
    paired = [on / off for on, off in zip(times[proposal], times["gate off"], strict=True)]
    low, high = bootstrap(paired)
    extra = median(record_times[proposal]) - median(record_times["gate off"])
    print(f"The one-pass proposal: per-round ratio {median(paired):.4f} ({low:.4f}-{high:.4f}), record "
          f"{ms(median(record_times[proposal]))} ms, +{ms(extra)} ms = implied step ratio "
          f"{1 + extra / median(times['gate off']):.4f}.\n")
    pieces(model, batches, args, clock)


def bootstrap(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def pieces(model: nn.Module, batches: object, args: argparse.Namespace, clock: StepClock) -> None:
    """Where the gate's record cost goes, on this model's own gradients: each piece timed interleaved."""
    loss = model(batches[0])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    device = grads[0].device
    check = NonFiniteCheck()
    flags = check(grads, device)
    one_pass = OnePassSquares(FlagsAndSquares())  # the library's path where the proposal does not apply
    flags_and_squares = FlagsAndSquares()
    off = GradientGuard(model)
    on = GradientGuard(model, spike_gate=SpikeGate())
    values = StepValues(device)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    invalid = flags.any()
    steps = [0]
    detached = loss.detach()

    def record_on() -> None:
        on.record(step=steps[0], loss=detached)
        steps[0] += 1
        if on.steps_recorded >= 200:
            on.reset()

    def step_values() -> None:
        values.add_loss(detached)
        values.record_step(None, squares, invalid, steps[0])
        if len(values.labels) >= 200:
            values.reset()

    rows = {
        "record, gate off": lambda: off.record(step=0),
        "record, gate on": record_on,
        "NonFiniteCheck (flags; the gate off)": lambda: check(grads, device),
        "flags and squares (the gate on: a dot per piece)": lambda: flags_and_squares(grads, device),
        "squares in a pass of their own (whole tensors)": lambda: _squares_in_own_precision(grads, device),
        "squares: _foreach_norm fp32": lambda: torch._foreach_norm(grads, 2),
        "squares: _foreach_norm fp64": lambda: torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)),
        "proposal: flags and squares, one fp32 pass": lambda: one_pass(grads, device),
        "squares: per-tensor dot (BLAS sdot), fp32": lambda: torch.stack([torch.dot(g.view(-1), g.view(-1))
                                                                          for g in grads]),
        "StepValues record_step + loss": step_values,
        "floor: per-tensor sum": lambda: [g.sum() for g in grads],
    }
    times = interleaved({row: clock.settled(fn) for row, fn in rows.items()}, args.piece_repeats, warmup=3)
    print(f"Where the gate's record cost goes ({args.piece_repeats} interleaved repeats on this model's gradients):\n")
    print(table(["piece", "median ms", "vs record gate off", "min ms", "min vs", "note"],
                ratio_rows(times, "record, gate off")))
    print()
    model.zero_grad()


# ---------------------------------------------------------------------- part 3: reads


def reads_one(name: str, args: argparse.Namespace) -> None:
    if torch.device(args.device).type != "cpu":
        print(f"### {name}: not measured on {args.device} (the pieces and their reads are the CPU path's)\n")
        return
    model, batches, optimizer = training(name, args)
    # the library's own readers of a full piece, and the gate's dot as the library takes it
    scale = torch.full((PROBE_WIDTH,), _PROBE_SCALE)
    dot_out = torch.empty(())

    def dot(piece: Tensor) -> None:
        torch.dot(piece, piece, out=dot_out)

    kernels = {"probe": _ProbePiece(PIECE_NUMEL, torch.empty(_ProbePiece.outputs_for(PIECE_NUMEL)), scale),
               "dot": dot, "aminmax": _ExtremesPiece(PIECE_NUMEL, torch.empty(2), scale)}
    sequences = [("probe", "dot", "dot"), ("dot", "probe", "dot"), ("dot", "dot"), ("aminmax", "dot", "dot"),
                 ("probe", "probe")]
    times: dict[tuple[str, ...], list[list[float]]] = {seq: [[] for _ in seq] for seq in sequences}
    steps: list[float] = []
    for repeat in range(args.cost_warmup + args.read_rounds):
        for seq in sequences if repeat % 2 == 0 else reversed(sequences):
            start = time.perf_counter()
            model(batches[repeat % len(batches)]).backward()
            spent = [0.0] * len(seq)
            for param in model.parameters():
                if param.grad is None or param.grad.dtype != torch.float32 or param.grad.numel() < PIECE_NUMEL:
                    continue
                for piece in param.grad.view(-1).split(PIECE_NUMEL):
                    if piece.numel() != PIECE_NUMEL:
                        continue
                    for position, kernel in enumerate(seq):
                        before = time.perf_counter()
                        kernels[kernel](piece)
                        spent[position] += time.perf_counter() - before
            optimizer.step()
            optimizer.zero_grad()
            if repeat >= args.cost_warmup:
                steps.append(time.perf_counter() - start)
                for position, seconds in enumerate(spent):
                    times[seq][position].append(seconds)
    full = sum(p.numel() // PIECE_NUMEL for p in model.parameters() if p.dtype == torch.float32)
    step = median(steps)
    print(f"### {name}: {full} full pieces of {PIECE_NUMEL * 4 >> 20} MiB, {args.read_rounds} rounds, median step "
          f"{ms(step)} ms (with the reads)\n")
    rows = []
    for seq in sequences:
        cells = [f"{kernel} {ms(median(times[seq][i]))}" for i, kernel in enumerate(seq)]
        second = median(times[seq][1])
        rows.append([", ".join(seq), " / ".join(cells), ms(second), f"{100 * second / step:.2f}%"])
    print(table(["sequence", "median ms per position (all pieces)", "second read ms", "second read / step"], rows))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["fp", "sanity", "cost"],
                        choices=["fp", "sanity", "cost", "reads"])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per false-positive run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--every", nargs="+", type=int, default=[1, 50, 500], help="boundary intervals watched")
    parser.add_argument("--spike-at", type=int, default=1234)
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=["mlp", "transformer"])
    parser.add_argument("--mlp-rounds", type=int, default=200, help="timed rounds of the rows, mlp")
    parser.add_argument("--transformer-rounds", type=int, default=40, help="timed rounds of the rows, transformer")
    parser.add_argument("--cost-warmup", type=int, default=3)
    parser.add_argument("--count-steps", type=int, default=3)
    parser.add_argument("--piece-repeats", type=int, default=25)
    parser.add_argument("--read-rounds", type=int, default=60, help="timed rounds of the read sequences")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where parts 2 and 3 train: cpu, or cuda (timed by events)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    where = f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"# The spike gate\n\nMachine: {machine()}{where}\n")
    if "fp" in args.parts:
        false_positives(args)
    if "sanity" in args.parts:
        sanity(args)
    if "cost" in args.parts:
        for_each_model("## 2. Cost per training step: the gate on vs off", cost_one, args)
    if "reads" in args.parts:
        for_each_model("## 3. One piece read after another, inside a training step", reads_one, args)


if __name__ == "__main__":
    main()
