"""The ``ckguard/*`` values held between two of Lightning's flushes: with several boundaries between two flushes, a
spike gate's ``*_window_max`` keeps the largest (a spike reaches the loggers), its baselines and the running counts the
latest, the per-window counts their sum. Single process."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything

from helpers import QUIET, RecordingLogger
from lightning_ckguard import FiniteGradCheckpoint, SpikeGate
from lightning_ckguard.lightning.held_metrics import HeldMetrics

BAD_BATCH = 12


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic regression batches; ``BAD_BATCH``'s targets are scaled by 1e3 (finite: a spike)."""
    weight = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    data = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(8, 4, generator=generator)
        y = x @ weight + 0.1 * torch.randn(8, 1, generator=generator)
        data.append((x, y * 1e3 if index == BAD_BATCH else y))
    return data


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = (self.layer(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(batches(40), batch_size=None, shuffle=False)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def test_a_spike_between_two_flushes_reaches_the_logger(tmp_path):
    # a boundary at every step, Lightning's flush at every 5th: four boundaries are held between two flushes
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=os.path.join(tmp_path, "checkpoints"), filename="{step}",
                                    every_n_train_steps=1, save_top_k=-1, on_non_finite="skip",
                                    spike_gate=SpikeGate(warmup_steps=8, history=200))
    logger = RecordingLogger()
    trainer = Trainer(max_steps=20, limit_val_batches=0, callbacks=[callback], **{**QUIET, "logger": logger},
                      log_every_n_steps=5)
    with pytest.warns(UserWarning, match="rejected the checkpoint"):
        trainer.fit(Regression())
    assert callback.last_report is not None and callback.last_report.accepted
    calls = [(step, metrics) for step, metrics in logger.calls if "ckguard/loss_window_max" in metrics]
    assert [step for step, _ in calls] == [4, 9, 14, 19]
    # the spike (the bad batch's step, 12) rides in the flush at step 14, though the boundaries after it were calm
    spiked = {step: metrics["ckguard/loss_window_max"] / metrics["ckguard/loss_baseline"] for step, metrics in calls
              if "ckguard/loss_baseline" in metrics}
    assert spiked[14] > 1e4, spiked
    assert max(spiked[9], spiked[19]) < 10, spiked
    assert calls[2][1]["ckguard/grad_norm_window_max"] > 100 * calls[1][1]["ckguard/grad_norm_window_max"], calls
    # the running counts are the latest: one rejection, every other boundary accepted
    assert (calls[-1][1]["ckguard/accepted"], calls[-1][1]["ckguard/rejected"]) == (19.0, 1.0)


class _Connector:
    def __init__(self) -> None:
        self.calls: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append(dict(metrics))


def test_each_held_key_combines_as_the_metrics_page_says():
    connector = _Connector()
    held = HeldMetrics(connector)
    held.hold({"ckguard/loss_window_max": 5.0, "ckguard/loss_baseline": 1.0, "ckguard/non_finite_steps": 1.0,
               "ckguard/skipped_steps": 2.0, "ckguard/accepted": 1.0})
    held.hold({"ckguard/loss_window_max": -3.0, "ckguard/loss_baseline": 2.0, "ckguard/non_finite_steps": 2.0,
               "ckguard/skipped_steps": 1.0, "ckguard/accepted": 2.0, "ckguard/grad_norm_window_max": 0.5})
    held({"train_loss": 0.25}, 4)
    assert connector.calls == [{"train_loss": 0.25, "ckguard/loss_window_max": 5.0, "ckguard/loss_baseline": 2.0,
                                "ckguard/non_finite_steps": 3.0, "ckguard/skipped_steps": 3.0,
                                "ckguard/accepted": 2.0, "ckguard/grad_norm_window_max": 0.5}]
    held.hold({"ckguard/loss_window_max": -3.0})  # after a flush, nothing of before is held
    held({"train_loss": 0.5}, 9)
    assert connector.calls[-1] == {"train_loss": 0.5, "ckguard/loss_window_max": -3.0}
