"""The readable report of the last boundary, and the ``ckguard/...`` metrics every logger receives."""

from __future__ import annotations

import csv
import dataclasses
from typing import Any

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from helpers import QUIET, CountOps, FaultyModel
from lightning_ckguard import BoundaryReport, FiniteGradCheckpoint, NonFiniteGradientError
from lightning_ckguard.agree.spikes import Level

STEPS = dict(limit_val_batches=0, log_every_n_steps=1)
NO_LOGGER = {k: v for k, v in QUIET.items() if k != "logger"}


def _metrics(log_dir: str) -> list[dict[str, str]]:
    with open(f"{log_dir}/metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("ckguard/accepted")]


class LoggingFaultyModel(FaultyModel):
    """Logs its training loss every step: Lightning then flushes metrics to the loggers every ``log_every_n_steps``."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out


def test_metrics_ride_in_lightnings_flush_after_every_agreed_boundary(tmp_path):
    """A boundary at the end of a training batch rides in that batch's own flush, which Lightning logs at its
    ``_batches_that_stepped`` count (the global step less one)."""
    seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1,
                                    on_non_finite="skip")
    trainer = Trainer(max_steps=8, callbacks=[callback], logger=logger, **STEPS, **NO_LOGGER)
    trainer.fit(LoggingFaultyModel(fault_steps=(5,)))
    rows = [
        (int(r["step"]), float(r["ckguard/accepted"]), float(r["ckguard/rejected"]),
         float(r["ckguard/non_finite_steps"]), float(r["ckguard/skipped_steps"]), bool(r["train_loss"]))
        for r in _metrics(logger.log_dir)
    ]
    assert rows == [(1, 1, 0, 0, 0, True), (3, 2, 0, 0, 0, True), (5, 2, 1, 1, 0, True), (7, 3, 1, 0, 0, True)]


def test_boundaries_between_two_flushes_add_up_their_step_counts(tmp_path):
    """With a flush every 4 steps and a boundary every 2, each row carries two boundaries: the running counts as they
    are after the second, the non-finite steps of both."""
    seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1,
                                    on_non_finite="skip")
    trainer = Trainer(max_steps=8, callbacks=[callback], logger=logger, **dict(STEPS, log_every_n_steps=4),
                      **NO_LOGGER)
    trainer.fit(LoggingFaultyModel(fault_steps=(1,)))
    rows = [(int(r["step"]), float(r["ckguard/accepted"]), float(r["ckguard/rejected"]),
             float(r["ckguard/non_finite_steps"])) for r in _metrics(logger.log_dir)]
    assert rows == [(3, 1, 1, 1), (7, 3, 1, 0)]


def test_a_raised_rejection_is_still_logged(tmp_path):
    """The rejection raises before the batch's flush: its values are logged once, as the fit fails."""
    seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(max_steps=8, callbacks=[callback], logger=logger, **STEPS, **NO_LOGGER)
    with pytest.raises(NonFiniteGradientError):
        trainer.fit(LoggingFaultyModel(fault_steps=(3,)))
    assert [(r["step"], r["ckguard/rejected"]) for r in _metrics(logger.log_dir)] == [("1", "0.0"), ("3", "1.0")]


def _host_reads(cls: type[ModelCheckpoint], steps: int, tmp_path) -> int:
    seed_everything(0)
    logger = CSVLogger(tmp_path / f"logs-{cls.__name__}-{steps}")
    callback = cls(dirpath=tmp_path / f"{cls.__name__}-{steps}", every_n_train_steps=10_000, save_last=True)
    trainer = Trainer(max_steps=steps, callbacks=[callback], logger=logger, **STEPS, **NO_LOGGER)
    with CountOps() as ops:
        trainer.fit(FaultyModel(sanitize=False))
    return ops.host_reads


def test_logging_adds_no_host_sync_per_step(tmp_path):
    extra = [_host_reads(FiniteGradCheckpoint, n, tmp_path) - _host_reads(ModelCheckpoint, n, tmp_path) for n in (4, 8)]
    assert extra[0] == extra[1] <= 2


def test_last_report_is_an_immutable_description_of_the_last_boundary(tmp_path):
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, on_non_finite="stop")
    trainer = Trainer(callbacks=[callback], max_epochs=3, limit_train_batches=2, limit_val_batches=1,
                      num_sanity_val_steps=0, **QUIET)
    with pytest.warns(UserWarning) as warned:
        trainer.fit(FaultyModel(fault_steps=(3,), val_losses=[3.0, 2.0, 1.0]))
    report = callback.last_report
    assert report == BoundaryReport(boundary="train epoch end", global_step=4, accepted=False, ranks=(0,),
                                    first_step=3, last_step=3, num_steps=1, parameters=("layer.weight",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.accepted = True  # type: ignore[misc]
    # the warning and the error are the report's own words
    assert str(report.to_error()) in report.message
    assert any(report.message in str(w.message) for w in warned)
    assert "rejected the checkpoint at train epoch end" in report.message


def test_a_baseline_or_a_window_maximum_of_zero_is_logged():
    # a loss that sits at exactly 0 has a baseline of 0: a value, not a missing one
    levels = (Level("loss", 0.0, 0.0), Level("grad_norm", None, None))
    report = BoundaryReport("train batch end", 5, True, levels=levels)
    assert report.metrics() == {"ckguard/loss_baseline": 0.0, "ckguard/loss_window_max": 0.0}
