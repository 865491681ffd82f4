"""The README's demo runs end to end on 2 CPU processes and tells the story it promises, on both Lightning packages:
``lightning.pytorch`` (the README's command, no argument) and ``pytorch_lightning`` (``--lightning pytorch_lightning``).
"""

import importlib
import importlib.util
import os
import sys

import pytest
from lightning_namespace import CKGUARD_MODULES, IDS, NAMESPACES

from conftest import TESTS, run_ranks

pytestmark = pytest.mark.multiprocess

DEMO = os.path.join(os.path.dirname(TESTS), "examples", "ddp_nan_demo.py")


@pytest.mark.parametrize("lightning", NAMESPACES, ids=[IDS[name] for name in NAMESPACES])
def test_demo_shows_rejection_intact_checkpoints_and_resume(tmp_path, lightning):
    # the README's command line is `python examples/ddp_nan_demo.py`: the default package gets no argument
    args = [] if lightning == "lightning.pytorch" else ["--lightning", lightning]
    proc = run_ranks(DEMO, args, timeout=280, env={"CKGUARD_DEMO_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("[", "    "))]
    text = "\n".join(lines)
    if lightning == "lightning.pytorch":
        assert lines[0].startswith("[1] "), "the README's output starts with [1]"
    else:
        assert lines[0] == ("[0] pytorch_lightning: pytorch_lightning.Trainer with "
                            "lightning_ckguard.pytorch_lightning.FiniteGradCheckpoint"), lines[0]
    assert "[1] ModelCheckpoint" in text and "step=40.ckpt (NaN weights)" in text
    assert "NonFiniteGradientError(ranks=(1,), steps 23-23, boundary at step 24" in text
    assert "last.ckpt (finite), step=16.ckpt (finite), step=8.ckpt (finite)" in text
    assert "[3] resumed from last.ckpt and finished at step 40" in text
    assert "NaN weights" not in lines[-1]


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], None, "lightning.pytorch"),
        (["--lightning", "pytorch_lightning"], None, "pytorch_lightning"),
        ([], "pytorch_lightning", "pytorch_lightning"),
        (["--lightning", "lightning.pytorch"], "pytorch_lightning", "lightning.pytorch"),
    ],
)
def test_the_demo_imports_from_the_chosen_package(monkeypatch, argv, env, expected):
    # in this process, no ranks: only which package the demo's module imports its Trainer and callback from
    monkeypatch.setattr(sys, "argv", [DEMO, *argv])
    if env is None:
        monkeypatch.delenv("CKGUARD_DEMO_LIGHTNING", raising=False)
    else:
        monkeypatch.setenv("CKGUARD_DEMO_LIGHTNING", env)
    spec = importlib.util.spec_from_file_location("ddp_nan_demo", DEMO)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    ckguard = importlib.import_module(CKGUARD_MODULES[expected])
    assert demo.LIGHTNING == expected
    assert demo.Trainer is importlib.import_module(expected).Trainer
    assert demo.FiniteGradCheckpoint is ckguard.FiniteGradCheckpoint
    assert demo.NonFiniteGradientError is ckguard.NonFiniteGradientError
