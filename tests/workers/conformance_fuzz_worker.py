"""Drawn cases of ``tests/lightning/test_conformance_fuzz.py`` under DDP on 2 ranks, run by its multiprocess test as
``python conformance_fuzz_worker.py OUT_DIR FIRST COUNT``: seeds ``FIRST`` to ``FIRST + COUNT - 1``.

Lightning's subprocess script launcher starts rank 1 by re-running this script. Every rank fits every case both ways
(``ModelCheckpoint``, then ``FiniteGradCheckpoint``, into ``OUT_DIR/seed-N/``) in one process group and writes to
``OUT_DIR/rank{N}.json``, per seed, what it found different (rank 0's is the comparison: it logs, writes and removes)
and how each side's fits ended on it (each fit's error and the callback's state), which every rank must share; then
fits the guard again with a ``NaN`` gradient on rank 1 alone (``OUT_DIR/seed-N-nan/``) and writes what the rejection
changed, as each rank saw it, and how the fit ended there. The Trainer's default DDP timeout applies; the test's
wall-clock kill turns a deadlock into a failure.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.join(TESTS, "lightning")]

import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from test_conformance_fuzz import compared, rejected, what_the_rejection_changed  # noqa: E402

from helpers import QUIET, run_scenarios  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
DDP = dict(strategy="ddp", accelerator="cpu", devices=2)  # what every fit of the cases adds


def case(seed: int, out: str) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        outcome = compared(seed, os.path.join(out, f"seed-{seed}"), monkeypatch, DDP)
    with pytest.MonkeyPatch.context() as monkeypatch:  # the same case with a NaN on rank 1 alone
        nan = rejected(seed, os.path.join(out, f"seed-{seed}-nan"), monkeypatch, DDP, nan_ranks=(1,))
    return {"case": repr(outcome.case), "differences": outcome.differences, "ends": outcome.ends,
            "nan": nan and {"step": nan.nan_at_step, "reached": nan.before is not None, "error": nan.error,
                            "changed": what_the_rejection_changed(nan)}}


def start_process_group(out: str) -> dict[str, Any]:
    """A first fit, which starts the process group (and logs so, once per process), before either side's."""
    Trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False, default_root_dir=out,
            **{**QUIET, **DDP}).fit(BoringModel())
    return {}


def main() -> None:
    out, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    scenarios: dict[str, Callable[[str], dict[str, Any]]] = {"process-group": start_process_group}
    scenarios.update({f"seed-{seed}": lambda root, s=seed: case(s, root) for seed in range(first, first + count)})
    run_scenarios(scenarios, out, set())


if __name__ == "__main__":
    main()
