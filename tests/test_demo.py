"""The README's demo runs end to end on 2 CPU processes and tells the story it promises."""

import os

import pytest

from conftest import TESTS, run_ranks

pytestmark = pytest.mark.multiprocess

DEMO = os.path.join(os.path.dirname(TESTS), "examples", "ddp_nan_demo.py")


def test_demo_shows_rejection_intact_checkpoints_and_resume(tmp_path):
    proc = run_ranks(DEMO, [], timeout=280, env={"CKGUARD_DEMO_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("[", "    "))]
    text = "\n".join(lines)
    assert "[1] ModelCheckpoint" in text and "step=40.ckpt (NaN weights)" in text
    assert "NonFiniteGradientError(ranks=(1,), steps 23-23, boundary at step 24" in text
    assert "last.ckpt (finite), step=16.ckpt (finite), step=8.ckpt (finite)" in text
    assert "[3] resumed from last.ckpt and finished at step 40" in text
    assert "NaN weights" not in lines[-1]
