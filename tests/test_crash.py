"""``kill -9`` during a directory checkpoint save (FSDP2, two real processes): every published name is a complete
checkpoint, and ``ckpt_path="last"`` resumes from the newest complete one."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_ranks


def _published(dirpath: str) -> list[str]:
    return sorted(name for name in os.listdir(dirpath) if not name.startswith("."))


def _complete(path: str) -> bool:
    # a distributed checkpoint is complete once the coordinator wrote `.metadata` and Lightning its `meta.pt`
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, "meta.pt"))


@pytest.mark.parametrize("phase", ["rank1-before-write", "all-after-write"])
def test_a_crash_during_a_save_publishes_nothing_partial_and_resumes_from_last(tmp_path, phase):
    crashed = run_ranks("workers/crash_scenarios.py", [str(tmp_path), phase], timeout=240)
    assert not (tmp_path / "rank1.json").exists(), f"rank 1 was not killed:\n{crashed.stdout[-3000:]}"
    if phase == "rank1-before-write":  # rank 0 survived, and its save failed instead of hanging
        assert json.loads((tmp_path / "rank0.json").read_text())["error"]
    dirpath = str(tmp_path / "ckpts")
    assert _published(dirpath) == ["last.ckpt", "step=2.ckpt"], os.listdir(dirpath)
    assert all(_complete(os.path.join(dirpath, name)) for name in _published(dirpath))
    leftovers = [name for name in os.listdir(dirpath) if name.endswith(".ckguard-staging")]
    # a surviving rank 0 discards the staging directory of its failed save; if all died, it is left for recovery
    assert len(leftovers) == (1 if phase == "all-after-write" else 0)

    resumed = run_ranks("workers/crash_scenarios.py", [str(tmp_path), "resume"], timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["error"] for r in ranks] == [None, None]
    assert [r["global_step"] for r in ranks] == [6, 6]
    recovered = any("removed the unpublished partial checkpoint" in w for w in ranks[0]["warnings"])
    assert recovered is (phase == "all-after-write")
    names = _published(dirpath)
    assert names == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert all(_complete(os.path.join(dirpath, name)) for name in names)
    assert not [name for name in os.listdir(dirpath) if name.startswith(".")]
    assert all(os.path.exists(path) for path in [*ranks[0]["best_k_models"], ranks[0]["last_model_path"]])
