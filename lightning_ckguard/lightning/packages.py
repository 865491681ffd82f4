"""The two Lightning packages: ``lightning.pytorch`` and ``pytorch_lightning`` hold separate copies of the same
classes, and a Trainer only treats a callback of its own package's ``ModelCheckpoint`` as a checkpoint callback."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

#: The public class name in either package; the state key and messages use it.
PUBLIC_NAME = "FiniteGradCheckpoint"

#: How each Lightning package's users import the callback.
IMPORT_FOR_PACKAGE = {
    "lightning.pytorch": "from lightning_ckguard import FiniteGradCheckpoint",
    "pytorch_lightning": "from lightning_ckguard.pytorch_lightning import FiniteGradCheckpoint",
}


@dataclass(frozen=True)
class LightningPackage:
    """The classes of one Lightning package that the callback checks against."""

    name: str  # "lightning.pytorch" or "pytorch_lightning"
    trainer: type
    torch_checkpoint_io: type
    async_checkpoint_io: type


def package_of(module: str) -> str | None:
    """The Lightning package a module belongs to, or None."""
    return next((name for name in IMPORT_FOR_PACKAGE if module == name or module.startswith(name + ".")), None)


def is_last_name(last: str, extension: str, name: str) -> bool:
    """Whether a file name is one ``ModelCheckpoint`` gives a ``last`` checkpoint (``last.ckpt``, ``last-v1.ckpt``) with
    its ``CHECKPOINT_NAME_LAST`` and ``FILE_EXTENSION``, as ``ModelCheckpoint._find_last_checkpoints`` tests it."""
    stem, suffix = os.path.splitext(name)
    return suffix == extension and re.match(rf"^{last}(-(\d+))?", stem) is not None


def wrong_package_error(here: str, module: str, trainer_class: str | None = None) -> TypeError:
    """The error of a ``here`` callback given a Trainer of another package: ``module`` is the Trainer's (or the Trainer
    code's) module."""
    other = package_of(module)
    user = f"`{module}.{trainer_class}`" if trainer_class else f"a `{other}` Trainer"
    hint = (f" For a `{other}` Trainer, use `{IMPORT_FOR_PACKAGE[other]}`." if other is not None and other != here
            else f" Import the Trainer (and your LightningModule) from `{here}`.")
    return TypeError(
        f"This {PUBLIC_NAME} (`{IMPORT_FOR_PACKAGE[here]}`) is a `{here}` callback and needs a `{here}.Trainer`, "
        f"got {user}.{hint}"
    )


__all__ = ["IMPORT_FOR_PACKAGE", "PUBLIC_NAME", "LightningPackage", "is_last_name", "package_of", "wrong_package_error"]
