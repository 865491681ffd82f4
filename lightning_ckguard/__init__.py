"""Stop a diverged run from publishing checkpoints, on every rank.

Public API:

- :class:`FiniteGradCheckpoint`: drop-in ``ModelCheckpoint`` that agrees across ranks before any write.
- :class:`NonFiniteGradientError`: raised on every rank when a boundary is rejected.
- :class:`CheckpointWriteError`: raised on the other ranks when one rank failed to write an accepted checkpoint.
- :class:`CheckpointRestoreError`: raised on every rank when :func:`restore_fabric_state` failed on some rank.
- :class:`StateCheckError`: raised on every rank when checking the state about to be written raised on some rank.
- :class:`BoundaryReport`: what the last boundary decided, readable (``FiniteGradCheckpoint.last_report``).
- :class:`GradientGuard` and :class:`Verdict`: the recording and agreement core, usable without a Trainer;
  :class:`RankReport`: what one rank recorded in its window, as a ``Verdict`` holds it.
- :class:`GradientSource`: where a guard reads a rank's local gradients (``GradientGuard(..., source=...)``), and
  :class:`ParameterGradients`: ``param.grad`` of a module's parameters (the default, except under DeepSpeed).
- :class:`CheckpointPublisher`: the callback's publication guarantees (agree, stage, write, agree on the write, one
  rename) for a Fabric or ``torch.distributed`` loop.
- :class:`RewindRefusedError`, :class:`Rewind`: ``on_non_finite="rewind"``'s refusal (a ``NonFiniteGradientError``)
  and its record of one rewind; :func:`restore_fabric_state` rewinds a Fabric loop, :func:`restore_trainer_state`
  restores a Trainer's training state in place.
- :func:`scaler_skip_flag`: whether a ``GradScaler`` will skip the coming step, as a device tensor.
- :class:`SpikeGate`: also reject a window whose loss or global gradient norm spiked, though finite
  (``FiniteGradCheckpoint(spike_gate=SpikeGate())``, ``GradientGuard(..., spike_gate=...)``); :class:`Spike`: one
  spike, as the report and the error carry it.

``lightning_ckguard.pytorch_lightning`` exports every name above: its ``FiniteGradCheckpoint`` is that of the
``pytorch_lightning`` package, every other name the very same object.
"""

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
from lightning_ckguard.lightning.callback import FiniteGradCheckpoint
from lightning_ckguard.record.skips import scaler_skip_flag
from lightning_ckguard.record.sources import GradientSource, ParameterGradients
from lightning_ckguard.recover.rewind import Rewind, restore_fabric_state, restore_trainer_state

__version__ = "0.1.0"

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
