"""Which Lightning package the test models, strategies and workers are built from.

``lightning`` installs two full copies of the same classes: ``lightning.pytorch`` and ``pytorch_lightning``. A worker
process picks one from the environment variable ``CKGUARD_TEST_LIGHTNING`` (``"lightning.pytorch"``, the default, or
``"pytorch_lightning"``); ``tests/helpers.py`` and ``tests/workers/strategies.py`` import from it, so a worker's
``FaultyModel`` and strategy belong to the Trainer it builds. The test that launches the worker sets the variable in
the worker's environment (``worker_results(..., env=lightning_env(name))``); the pytest process itself leaves it unset.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

ENV = "CKGUARD_TEST_LIGHTNING"
DEFAULT = "lightning.pytorch"
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
# test ids: `lightning` (the `lightning.pytorch` namespace, `import lightning as L`) and `pytorch_lightning`
IDS = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch_lightning"}
# the lightning_ckguard import whose FiniteGradCheckpoint fits each namespace's Trainer
CKGUARD_MODULES = {"lightning.pytorch": "lightning_ckguard", "pytorch_lightning": "lightning_ckguard.pytorch_lightning"}


_building_from: str | None = None


@contextmanager
def building_from(name: str) -> Iterator[None]:
    """Within the block, ``namespace()`` is ``name`` in this process (to import a second copy of a test module
    built from the other package, see ``helpers.helpers_for``); the environment is left alone."""
    global _building_from
    lightning_env(name)  # validates the name
    previous, _building_from = _building_from, name
    try:
        yield
    finally:
        _building_from = previous


def namespace() -> str:
    """The namespace this process builds from: ``$CKGUARD_TEST_LIGHTNING``, or ``lightning.pytorch``."""
    name = _building_from or os.environ.get(ENV) or DEFAULT
    if name not in NAMESPACES:
        raise ValueError(f"{ENV}={name!r}: expected one of {NAMESPACES}")
    return name


def lightning_module(submodule: str = "") -> ModuleType:
    """``namespace()`` itself, or its ``submodule`` (e.g. ``"callbacks"``, ``"strategies"``)."""
    return importlib.import_module(f"{namespace()}.{submodule}" if submodule else namespace())


def ckguard_module() -> ModuleType:
    """``lightning_ckguard`` or ``lightning_ckguard.pytorch_lightning``: the one whose callback fits ``namespace()``."""
    return importlib.import_module(CKGUARD_MODULES[namespace()])


def lightning_env(name: str) -> dict[str, str]:
    """The environment a worker needs to build from namespace ``name``."""
    if name not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {name!r}; expected one of {NAMESPACES}")
    return {ENV: name}
