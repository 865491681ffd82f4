"""``FiniteGradCheckpoint`` for the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

``lightning`` installs two packages that hold separate copies of the same classes, ``lightning.pytorch`` and
``pytorch_lightning``, and a Trainer only treats a callback of its own package's ``ModelCheckpoint`` as a checkpoint
callback. This module combines the one implementation
(:class:`~lightning_ckguard.lightning.callback.GuardedCheckpoint`) with
``pytorch_lightning``'s ``ModelCheckpoint``; behaviour, arguments, errors and guarantees are the same::

    import pytorch_lightning as pl
    from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint, NonFiniteGradientError

    trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[FiniteGradCheckpoint(monitor="val_loss")])

Every other name of ``lightning_ckguard.__all__`` (the errors, the reports, the Trainer-free core:
:class:`~lightning_ckguard.GradientGuard`, :class:`~lightning_ckguard.CheckpointPublisher`, the gradient sources,
:func:`~lightning_ckguard.scaler_skip_flag`, and the rewind's :class:`~lightning_ckguard.Rewind`,
:func:`~lightning_ckguard.restore_trainer_state` and :func:`~lightning_ckguard.restore_fabric_state`) is re-exported
here as the very same object as in ``lightning_ckguard``; :func:`~lightning_ckguard.restore_trainer_state` takes a
``pytorch_lightning`` Trainer as well.
"""

import logging

import pytorch_lightning as pl
from lightning_fabric.plugins.io import TorchCheckpointIO
from lightning_utilities.core import rank_zero as _rank_zero
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO

from lightning_ckguard.agree.agreement import RankReport, Verdict
from lightning_ckguard.agree.guard import GradientGuard
from lightning_ckguard.agree.report import BoundaryReport
from lightning_ckguard.agree.spikes import SpikeGate
from lightning_ckguard.core.publisher import CheckpointPublisher
from lightning_ckguard.errors import (
    CheckpointRestoreError,
    CheckpointWriteError,
    NonFiniteGradientError,
    RewindRefusedError,
    Spike,
    StateCheckError,
)
from lightning_ckguard.lightning.callback import GuardedCheckpoint
from lightning_ckguard.lightning.fit import link_in_boundary
from lightning_ckguard.lightning.packages import LightningPackage
from lightning_ckguard.record.skips import scaler_skip_flag
from lightning_ckguard.record.sources import GradientSource, ParameterGradients
from lightning_ckguard.recover.rewind import Rewind, restore_fabric_state, restore_trainer_state

# Each Lightning package points the rank-zero logger at its own when imported. `lightning_ckguard` imports
# `lightning.pytorch`, which took it over from `pytorch_lightning` if that was imported first: give it back, so that a
# `pytorch_lightning` user's logging setup (levels, handlers) still applies to its lines, ModelCheckpoint's included.
_rank_zero.log = logging.getLogger("pytorch_lightning.utilities.rank_zero")


class FiniteGradCheckpoint(GuardedCheckpoint, ModelCheckpoint):  # type: ignore[misc]  # two copies of one API
    __doc__ = GuardedCheckpoint.__doc__
    _lightning = LightningPackage("pytorch_lightning", pl.Trainer, TorchCheckpointIO, AsyncCheckpointIO)

    @staticmethod
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        link_in_boundary(ModelCheckpoint._link_checkpoint, trainer, filepath, linkpath, GuardedCheckpoint)


__all__ = [
    "BoundaryReport",
    "CheckpointPublisher",
    "CheckpointRestoreError",
    "CheckpointWriteError",
    "FiniteGradCheckpoint",
    "GradientGuard",
    "GradientSource",
    "NonFiniteGradientError",
    "ParameterGradients",
    "RankReport",
    "Rewind",
    "RewindRefusedError",
    "Spike",
    "SpikeGate",
    "StateCheckError",
    "Verdict",
    "restore_fabric_state",
    "restore_trainer_state",
    "scaler_skip_flag",
]
