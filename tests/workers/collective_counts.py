"""Counts every ``torch.distributed`` collective of real 2-process fits, run by ``tests/test_collective_counts.py`` as

    python collective_counts.py OUT_DIR

The functions of ``torch.distributed`` that Lightning and this package call are wrapped before Lightning is imported,
so every call through them is counted, by name (DDP's gradient all-reduce runs in its C++ reducer and is not: it is
the same for both classes anyway). Each class fits the same model twice, for ``EPOCHS`` epochs, validating every
epoch with ``monitor="val_loss"``, ``save_top_k=2``, ``save_last=True`` (a falling loss: every boundary saves, and
evicts from the third on). Two fits of different lengths separate what each boundary costs from what the fit costs
once (setup, teardown, train end).

Each rank writes ``OUT_DIR/rank{N}.json``: per class and epoch count, the calls per function.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COUNTED = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
           "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "gather", "gather_object", "scatter",
           "reduce_scatter", "all_to_all")
CALLS: Counter[str] = Counter()


def _counted(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        return function(*args, **kwargs)

    return counted


for _name in COUNTED:  # before Lightning imports anything of torch.distributed by name
    if hasattr(dist, _name):
        setattr(dist, _name, _counted(_name, getattr(dist, _name)))

from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, FaultyModel, run_scenarios  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
EPOCHS = (2, 4)
#: a falling validation loss: every epoch's checkpoint enters the top 2
VAL_LOSSES = [5.0 - epoch for epoch in range(max(EPOCHS))]


def count_fit(out: str, cls: type[ModelCheckpoint], epochs: int) -> dict[str, int]:
    seed_everything(7)
    callback = cls(dirpath=os.path.join(out, f"{cls.__name__}-{epochs}"), monitor="val_loss", save_top_k=2,
                   save_last=True)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, callbacks=[callback],
                      max_epochs=epochs, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, **QUIET)
    model = FaultyModel(val_losses=VAL_LOSSES)
    CALLS.clear()
    trainer.fit(model)
    return dict(CALLS)


def scenario(cls: type[ModelCheckpoint], epochs: int) -> Callable[[str], dict[str, int]]:
    return lambda out: count_fit(out, cls, epochs)


def main() -> None:
    scenarios = {f"{cls.__name__}-{epochs}": scenario(cls, epochs)
                 for cls in (ModelCheckpoint, FiniteGradCheckpoint) for epochs in EPOCHS}
    run_scenarios(scenarios, sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
