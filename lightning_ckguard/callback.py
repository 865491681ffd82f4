"""The import path of earlier releases: the callback now lives in :mod:`lightning_ckguard.lightning.callback`, and
these names stay importable from here (``class_path: lightning_ckguard.callback.FiniteGradCheckpoint`` included)."""

from lightning_ckguard.lightning.callback import FiniteGradCheckpoint, GuardedCheckpoint
from lightning_ckguard.recover.policy import NonFinitePolicy

__all__ = ["FiniteGradCheckpoint", "GuardedCheckpoint", "NonFinitePolicy"]
