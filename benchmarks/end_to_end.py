"""End-to-end training step time: ``FiniteGradCheckpoint`` against ``ModelCheckpoint`` and the alternatives (CPU).

Each configuration trains the same model from the same seed with ``Trainer.fit``; a timing callback records the
interval between consecutive ``on_train_batch_start`` calls, so a step includes forward, backward, every callback
hook (the guard records in ``on_before_optimizer_step``), the optimizer step and the checkpoint callback's
batch-end hook. Configurations alternate run by run (``--repeats`` rounds); the table shows the median step time
over all timed steps of all rounds and the ratio to ``ModelCheckpoint`` alone. No checkpoint is due inside the timed
steps (``every_n_train_steps`` is out of reach): the per-boundary cost is measured by ``preflight.py``.

Models:
  transformer  causal LM, 6 layers, d_model 512, vocabulary 8192 (~27M parameters), AdamW, batch 8 x 128 tokens
  mlp          784-2048-2048-10 MLP (~5.8M parameters), AdamW, batch 256

Rows:
  ModelCheckpoint                 the baseline
  FiniteGradCheckpoint            this package
  MC + naive isfinite callback    ``torch.isfinite(p.grad).all().item()`` per parameter, every step
  MC + SpikeDetection             Lightning's loss-spike callback (loss only, gradients are not looked at)
  MC + detect_anomaly=True        autograd anomaly mode

The paired runs (``--paired-steps``) are the precise figure: one fit runs its steps in pairs, a coin picking the step
of each pair that runs the guard's hooks (the other runs ``ModelCheckpoint``'s alone), and a null control with the
same coins runs ``ModelCheckpoint``'s alone throughout.

    python benchmarks/end_to_end.py                                  # both models, ~14 min on 2 cores
    python benchmarks/end_to_end.py --models mlp --repeats 5 --steps 30
    # the precise transformer figure (~45 min): 1 thread, because with 2 threads on 2 vCPUs neighbouring steps
    # differ by 5-7% (against 2%), so the same number of pairs gives a wider interval
    python benchmarks/end_to_end.py --models transformer --threads 1 --configs ModelCheckpoint \
        FiniteGradCheckpoint --repeats 1 --paired-steps 400
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.callbacks.spike import SpikeDetection
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, ms, table  # noqa: E402

from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 8192, d_model: int = 512, layers: int = 6, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        x = self.embed(tokens[:, :-1]) + self.position[: tokens.shape[1] - 1]
        t = x.shape[1]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


TRANSFORMER_BATCH = 8  # sequences of 128 tokens: large enough that the step is compute-bound


def data(model: str, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    if model == "transformer":
        batch = TRANSFORMER_BATCH
        return DataLoader(TensorDataset(torch.randint(0, 8192, (batch * steps, 129), generator=g)), batch_size=batch)
    x, y = torch.randn(256 * steps, 784, generator=g), torch.randint(0, 10, (256 * steps,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=256)


class StepTimer(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())

    def steps(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts[warmup:], self.starts[warmup + 1 :], strict=False)]


class NaiveFiniteCheck(Callback):
    """The naive guard: one host sync per parameter per step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for p in pl_module.parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all().item():
                raise RuntimeError("non-finite gradient")


CONFIGS = ["ModelCheckpoint", "FiniteGradCheckpoint", "MC + naive isfinite callback", "MC + SpikeDetection",
           "MC + detect_anomaly=True"]


class TimedHook:
    """Wraps the guard's recording hook and keeps its wall time per call: the guard's own per-step cost, measured
    inside the same steps, free of the step-to-step noise that dominates the end-to-end ratio on a shared machine."""

    def __init__(self, hook) -> None:
        self.hook = hook
        self.times: list[float] = []

    def __call__(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        self.hook(*args, **kwargs)
        self.times.append(time.perf_counter() - start)


RECORDING: list[float] = []


def run(model_name: str, config: str, steps: int, warmup: int, root: str) -> list[float]:
    seed_everything(0, verbose=False)
    model = TinyLM() if model_name == "transformer" else MLP()
    kwargs = dict(dirpath=f"{root}/{model_name}-{CONFIGS.index(config)}", every_n_train_steps=10**9)
    checkpoint = FiniteGradCheckpoint(**kwargs) if config == "FiniteGradCheckpoint" else ModelCheckpoint(**kwargs)
    timer = StepTimer()
    callbacks: list[Callback] = [timer, checkpoint]
    recording = None
    if isinstance(checkpoint, FiniteGradCheckpoint):
        recording = TimedHook(checkpoint.on_before_optimizer_step)
        checkpoint.on_before_optimizer_step = recording  # type: ignore[method-assign]
    if config == "MC + naive isfinite callback":
        callbacks.append(NaiveFiniteCheck())
    if config == "MC + SpikeDetection":
        callbacks.append(SpikeDetection())
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=warmup + steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, detect_anomaly=config == "MC + detect_anomaly=True",
        default_root_dir=root, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, data(model_name, warmup + steps))
    if recording is not None:
        RECORDING.extend(recording.times[warmup:])
    return timer.steps(warmup)


def paired(
    model_name: str, steps: int, warmup: int, root: str, guard_on: bool = True, seed: int = 0
) -> tuple[list[float], list[float], list[float]]:
    """One ``FiniteGradCheckpoint`` run whose steps come in pairs: in each pair a coin picks which step runs the
    guard's own hooks; the other runs only ``ModelCheckpoint``'s (no recording). Neighbouring steps share the
    machine's state of the moment, so the ratio within a pair is free of the drift that dominates run-to-run
    comparisons, and the coin keeps any alternating effect (e.g. the allocator reusing memory every other step) out
    of the ratio. ``guard_on=False`` is the null control: the same coins, but every step runs ``ModelCheckpoint``'s
    hooks only, so its ratio shows what the method reads when nothing differs. Returns (step times of the picked
    steps, of the others, per-pair ratios picked / other)."""
    seed_everything(0, verbose=False)
    model = TinyLM() if model_name == "transformer" else MLP()
    checkpoint = FiniteGradCheckpoint(dirpath=f"{root}/{model_name}-paired", every_n_train_steps=10**9)
    record, batch_end = checkpoint.on_before_optimizer_step, checkpoint.on_train_batch_end
    warmup += warmup % 2  # pairs start at an even global step
    coins = random.Random(seed)
    picked = {2 * pair + coins.randrange(2) for pair in range((warmup + steps) // 2)}  # global steps

    def picked_record(trainer, pl_module, optimizer) -> None:
        if guard_on and trainer.global_step in picked:
            record(trainer, pl_module, optimizer)

    def picked_batch_end(trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the optimizer step has already advanced global_step
        if guard_on and trainer.global_step - 1 in picked:
            batch_end(trainer, pl_module, outputs, batch, batch_idx)
        else:
            ModelCheckpoint.on_train_batch_end(checkpoint, trainer, pl_module, outputs, batch, batch_idx)

    checkpoint.on_before_optimizer_step = picked_record  # type: ignore[method-assign]
    checkpoint.on_train_batch_end = picked_batch_end  # type: ignore[method-assign]
    timer = StepTimer()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=warmup + steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer, checkpoint], default_root_dir=root, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, data(model_name, warmup + steps))
    times = timer.steps(warmup)
    chosen, others, ratios = [], [], []
    for first in range(0, len(times) - 1, 2):
        pair = times[first : first + 2]
        which = 0 if warmup + first in picked else 1
        chosen.append(pair[which])
        others.append(pair[1 - which])
        ratios.append(pair[which] / pair[1 - which])
    return chosen, others, ratios


def bootstrap_interval(ratios: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of ``ratios``: how far the paired figure can move by chance alone."""
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return medians[int(0.05 * rounds)], medians[int(0.95 * rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["transformer", "mlp"], choices=["transformer", "mlp"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; every configuration runs once per round")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per run (default: 6 transformer, 25 mlp)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--paired-steps", type=int, default=-1,
                        help="steps of each paired run (default: 160 transformer, 400 mlp; 0: skip them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print(f"# End-to-end step time\n\nMachine: {machine()}\n")
    with tempfile.TemporaryDirectory() as root:
        for model_name in args.models:
            steps = args.steps or (6 if model_name == "transformer" else 25)
            params = sum(p.numel() for p in (TinyLM() if model_name == "transformer" else MLP()).parameters())
            times: dict[str, list[float]] = {c: [] for c in args.configs}
            RECORDING.clear()
            for repeat in range(args.repeats):
                order = args.configs if repeat % 2 == 0 else list(reversed(args.configs))
                for config in order:
                    times[config] += run(model_name, config, steps, args.warmup, root)
            base = median(times["ModelCheckpoint"])
            rows = [[c, ms(median(t)), f"{median(t) / base:.3f}", ms(min(t)), f"{median(t) / base - 1:+.1%}"]
                    for c, t in times.items()]
            print(f"## {model_name}: {params / 1e6:.1f}M parameters, {args.repeats} rounds x {steps} timed steps\n")
            print(table(["configuration", "median step ms", "ratio to MC", "min step ms", "overhead"], rows))
            if RECORDING:
                share = median(RECORDING) / base
                print(f"\nThe guard's recording hook, timed inside the same steps: median {ms(median(RECORDING))} ms "
                      f"per step = {share:.2%} of the median ModelCheckpoint step (implied ratio {1 + share:.3f}).")
            default_paired = 160 if model_name == "transformer" else 400
            paired_steps = args.paired_steps if args.paired_steps >= 0 else default_paired
            if paired_steps:
                guarded, plain, ratios = paired(model_name, paired_steps, args.warmup, root)
                _, _, null = paired(model_name, paired_steps, args.warmup, root, guard_on=False)
                print(f"\nPaired runs, {paired_steps} steps each ({len(ratios)} pairs of neighbouring steps; a coin "
                      "picks the step of each pair that runs the guard):\n")
                low, high = bootstrap_interval(ratios)
                null_low, null_high = bootstrap_interval(null)
                print(table(
                    ["run", "guarded-step median ms", "other-step median ms", "median paired ratio", "90% interval"],
                    [["guard on the picked step, ModelCheckpoint alone on the other", ms(median(guarded)),
                      ms(median(plain)),
                      f"{median(ratios):.4f}", f"{low:.4f}-{high:.4f}"],
                     ["null control: the same coins, ModelCheckpoint alone on every step", "", "",
                      f"{median(null):.4f}",
                      f"{null_low:.4f}-{null_high:.4f}"]],
                ))
                print(f"\n**Paired step-time ratio, FiniteGradCheckpoint / ModelCheckpoint: {median(ratios):.4f}** "
                      f"(90% bootstrap interval {low:.4f}-{high:.4f}; the null control, where nothing differs, reads "
                      f"{median(null):.4f}).")
            print()


if __name__ == "__main__":
    main()
