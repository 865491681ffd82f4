"""Counts every ``torch.distributed`` collective of real 2-process fits, run by
``tests/agree/test_collective_counts.py`` as

    python collective_counts_worker.py OUT_DIR

The functions of ``torch.distributed`` that Lightning and this package call are wrapped before Lightning is imported,
so every call through them is counted, by name (DDP's gradient all-reduce runs in its C++ reducer and is not: it is
the same for both classes anyway). Each class fits the same model for ``EPOCHS`` epochs, validating every epoch with
``monitor="val_loss"``, ``save_top_k=2``, ``save_last=True`` (a falling loss: every boundary saves, and evicts from
the third on). The callback's boundary hooks count their own collectives, call by call; the rest is the fit's
(setup, teardown, the data loaders' checks).

Each rank writes ``OUT_DIR/rank{N}.json``: per class, each boundary hook call that ran a collective (its hook, epoch
and calls per function) and the calls outside them.
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
from sharded_helpers import ShardedFaultModel  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, FaultyModel, run_scenarios  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint, SpikeGate  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
EPOCHS = 4
#: a falling validation loss: every epoch's checkpoint enters the top 2, and from the third on one is evicted
VAL_LOSSES = [5.0 - epoch for epoch in range(EPOCHS)]
#: the checkpoint callback's hooks in which ModelCheckpoint may save: each call is counted on its own
BOUNDARY_HOOKS = ("on_train_batch_end", "on_train_epoch_end", "on_validation_end", "on_train_end")


def counting_boundaries(cls: type[ModelCheckpoint], boundaries: list[dict[str, Any]]) -> type[ModelCheckpoint]:
    """``cls`` whose boundary hooks each record the collectives they ran (a hook that ran none is left out)."""

    def counted_hook(name: str) -> Callable[..., None]:
        def hook(self: Any, trainer: Any, *args: Any) -> None:
            before = Counter(CALLS)
            getattr(super(counted, self), name)(trainer, *args)
            ran = dict(Counter(CALLS) - before)
            if ran:
                boundaries.append({"hook": name, "epoch": trainer.current_epoch, "calls": ran})

        return hook

    counted = type(cls.__name__, (cls,), {name: counted_hook(name) for name in BOUNDARY_HOOKS})
    return counted


#: how a fit ends, each for both classes: its last boundary ranks the value and writes nothing (the last epoch's loss
#: makes no top 2, no ``last``); or steps come after its last boundary (saves every 3 of its 8 steps, no monitor)
END_SCENARIOS: dict[str, dict[str, Any]] = {
    "last-unwritten": dict(save_last=False, val_losses=[4.0, 3.0, 2.0, 5.0]),
    "trailing-steps": dict(monitor=None, save_top_k=-1, save_last=False, every_n_train_steps=3),
}


def count_fit(out: str, cls: type[ModelCheckpoint], name: str, val_losses: list[float] = VAL_LOSSES,
              kind: str = "ddp", **options: Any) -> dict[str, Any]:
    seed_everything(7)
    boundaries: list[dict[str, Any]] = []
    options = {"monitor": "val_loss", "save_top_k": 2, "save_last": True, **options}
    callback = counting_boundaries(cls, boundaries)(dirpath=os.path.join(out, name), **options)
    trainer = Trainer(strategy=make_strategy(kind, timeout=TIMEOUT), devices=2, callbacks=[callback],
                      max_epochs=EPOCHS, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, **QUIET)
    model = ShardedFaultModel(val_losses=val_losses, fsdp2=True) if kind == "fsdp2" else FaultyModel(
        val_losses=val_losses)
    CALLS.clear()
    trainer.fit(model)
    in_boundaries = sum((Counter(b["calls"]) for b in boundaries), Counter())
    return {"boundaries": boundaries, "outside": dict(Counter(CALLS) - in_boundaries)}


def main() -> None:
    scenarios = {cls.__name__: (lambda out, cls=cls: count_fit(out, cls, cls.__name__)) for cls in (
        ModelCheckpoint, FiniteGradCheckpoint)}
    # the spike gate adds its one all-reduce of the step values to each agreement, and nothing else
    scenarios["SpikeGate"] = lambda out: count_fit(out, FiniteGradCheckpoint, "SpikeGate", spike_gate=SpikeGate())
    # FSDP2's distributed checkpoint (ModelParallelStrategy, fully_shard): directories every rank writes
    for cls in (ModelCheckpoint, FiniteGradCheckpoint):
        scenarios[f"{cls.__name__}/fsdp2"] = lambda out, cls=cls: count_fit(out, cls, f"{cls.__name__}-fsdp2",
                                                                            kind="fsdp2")
    for ending, options in END_SCENARIOS.items():
        for cls in (ModelCheckpoint, FiniteGradCheckpoint):
            name = f"{cls.__name__}/{ending}"
            scenarios[name] = lambda out, cls=cls, name=name, options=options: count_fit(
                out, cls, name.replace("/", "-"), **options)
    run_scenarios(scenarios, sys.argv[1], set(sys.argv[2:]))


if __name__ == "__main__":
    main()
