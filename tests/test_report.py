"""The readable report of the last boundary, and the ``ckguard/...`` metrics every logger receives."""

from __future__ import annotations

import csv
import dataclasses

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from helpers import QUIET, CountOps, FaultyModel
from lightning_ckguard import BoundaryReport, FiniteGradCheckpoint, NonFiniteGradientError

STEPS = dict(limit_val_batches=0, log_every_n_steps=1)
NO_LOGGER = {k: v for k, v in QUIET.items() if k != "logger"}


def _metrics(log_dir: str) -> list[dict[str, str]]:
    with open(f"{log_dir}/metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("ckguard/accepted")]


def test_metrics_reach_the_csv_logger_at_every_agreed_boundary(tmp_path):
    seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1,
                                    on_non_finite="skip")
    trainer = Trainer(max_steps=8, callbacks=[callback], logger=logger, **STEPS, **NO_LOGGER)
    trainer.fit(FaultyModel(fault_steps=(5,)))
    rows = [
        (int(r["step"]), float(r["ckguard/accepted"]), float(r["ckguard/rejected"]),
         float(r["ckguard/non_finite_steps"]), float(r["ckguard/skipped_steps"]))
        for r in _metrics(logger.log_dir)
    ]
    assert rows == [(2, 1, 0, 0, 0), (4, 2, 0, 0, 0), (6, 2, 1, 1, 0), (8, 3, 1, 0, 0)]


def test_a_raised_rejection_is_still_logged(tmp_path):
    seed_everything(0)
    logger = CSVLogger(tmp_path / "logs")
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(max_steps=8, callbacks=[callback], logger=logger, **STEPS, **NO_LOGGER)
    with pytest.raises(NonFiniteGradientError):
        trainer.fit(FaultyModel(fault_steps=(3,)))
    assert [(r["step"], r["ckguard/rejected"]) for r in _metrics(logger.log_dir)] == [("2", "0.0"), ("4", "1.0")]


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
