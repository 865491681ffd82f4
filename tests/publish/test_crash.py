"""``kill -9`` of one rank and of all ranks at points of a checkpoint save, on two real processes (gloo, CPU):
single files (DDP), DeepSpeed ZeRO-2 directories and FSDP2 distributed-checkpoint directories. The points include
right after the new ``last`` took its name (one ``os.replace`` for a file, the ``renameat2`` exchange for a directory),
between the two renames of the fallback where the exchange is unavailable (directories), and halfway through a
background write with ``AsyncCheckpointIO`` (single files).

After every crash, every published name is a complete checkpoint that loads, a surviving rank failed instead of
hanging, and ``ckpt_path="last"`` resumes from the newest complete ``last``; after the resume no ledger entry
points at a missing file and nothing the crash left is still there. The worker is ``workers/crash_worker.py``.
"""

from __future__ import annotations

import os

import pytest
from checkpoint_formats import loads_completely

from conftest import OUT, Launch, WorkerResults, deepspeed_missing
from helpers import cross_device_tmpdir, cross_device_tmpdir_or_skip

pytestmark = pytest.mark.multiprocess
DEEPSPEED_PARAMETERS = {"deepspeed"}  # their items are marked `deepspeed` (conftest)

COMMON_PHASES = ("rank1-before", "rank0-during", "all-during", "all-after", "rank0-after-exchange")
# files are replaced by one os.replace: only directories have the two-rename fallback (where RENAME_EXCHANGE is
# missing); the async write concerns single files (DeepSpeed and FSDP2 write directories themselves, synchronously)
PHASES = {
    "ddp": (*COMMON_PHASES, "rank0-during-async"),
    "deepspeed": (*COMMON_PHASES, "rank0-between-renames"),
    "fsdp2": (*COMMON_PHASES, "rank0-between-renames"),
}
# the ranks that survive each phase, and must have failed instead of hanging
SURVIVORS = {"rank1-before": [0], "rank0-during": [1], "all-during": [], "all-after": [], "rank0-after-exchange": [1],
             "rank0-between-renames": [1], "rank0-during-async": [1]}
# the global step of the newest complete `last` after each phase: step 4's where the crash came after it took the name
RESUMES_FROM = {phase: 2 for phase in SURVIVORS} | {"rank0-after-exchange": 4}
# a rank that writes nothing (DDP rank 1) dies at the post-save barrier in "all-during"; it never opens a file
BEFORE_STEP_4 = ["last.ckpt", "step=2.ckpt"]


def _published(dirpath: str) -> list[str]:
    return sorted(name for name in os.listdir(dirpath) if not name.startswith("."))


def _crash(worker_results: WorkerResults, strategy: str, phase: str, plain: bool = False) -> Launch:
    """One crash cell: what the ranks that were not killed wrote (``None`` for a killed rank); its ``out`` is the cell,
    the checkpoints are in ``out/ckpts``. Single files need ``$TMPDIR`` on another filesystem for the "during" points
    (the test skips where there is none); otherwise it is set only where there is one."""
    env = {}
    if strategy == "ddp":
        env = {"TMPDIR": cross_device_tmpdir_or_skip if "during" in phase else cross_device_tmpdir}
    args = [OUT, strategy, phase] + (["--plain"] if plain else [])
    return worker_results("workers/crash_worker.py", args, timeout=240, env=env, check=False)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed", "fsdp2"])
@pytest.mark.timeout(1920)  # six 240 s launches and a 420 s resume, each with its own wall-clock kill
def test_kill_9_during_a_save_publishes_nothing_partial_and_resumes_from_last(worker_results, strategy):
    if strategy == "deepspeed" and (reason := deepspeed_missing()):
        pytest.skip(reason)
    cells = {}
    leftovers: dict[str, list[str]] = {}
    for phase in PHASES[strategy]:
        crashed = _crash(worker_results, strategy, phase)
        cells[phase] = cell = crashed.out
        survivors = SURVIVORS[phase]
        for rank in (0, 1):
            result = crashed.ranks[rank]
            if rank in survivors:  # it failed in a collective with the dead rank, instead of hanging
                assert result is not None, f"{phase}: rank {rank} neither finished nor died:\n{crashed.stdout[-3000:]}"
                assert result["error"], f"{phase}: rank {rank} did not see the crash"
            else:
                assert result is None, f"{phase}: rank {rank} was not killed:\n{crashed.stdout[-3000:]}"
        dirpath = str(cell / "ckpts")
        published = _published(dirpath)
        step_4_published = phase in ("rank0-between-renames", "rank0-after-exchange")
        expected = BEFORE_STEP_4 + (["step=4.ckpt"] if step_4_published else [])
        # between the renames of `last`, the old one is renamed aside: not published until recovery restores it
        if phase == "rank0-between-renames":
            expected.remove("last.ckpt")
        assert published == expected, f"{phase}: {os.listdir(dirpath)}"
        leftovers[phase] = sorted(name for name in os.listdir(dirpath) if name.startswith("."))
        if phase in ("all-after", "rank0-between-renames", "rank0-during-async"):  # written (in part), never published
            assert leftovers[phase], phase
        if phase == "rank0-after-exchange":
            # a file's os.replace leaves the replaced file's second name, kept until the boundary is published (a
            # failure later in it puts the file back); an exchange leaves the old directory
            expected_left = [".last.ckpt.ckguard-retired"] if strategy == "ddp" else [".last.ckpt.ckguard-staging"]
            assert leftovers[phase] == expected_left, phase
        incomplete = [name for name in published if not loads_completely(strategy, os.path.join(dirpath, name))]
        assert not incomplete, f"{phase}: published but incomplete: {incomplete}"

    ranks = worker_results(
        "workers/crash_worker.py", [OUT, strategy, "resume", *map(str, cells.values())], timeout=420
    ).ranks
    for phase, cell in cells.items():
        dirpath = str(cell / "ckpts")
        runs = [rank[str(cell)] for rank in ranks]
        assert [r["error"] for r in runs] == [None, None], f"{phase}: {runs[0].get('trace') or runs[1].get('trace')}"
        # the newest complete `last`: global step 2's, except where step 4's had taken the name before the crash
        assert [r["ckpt_path"] for r in runs] == [os.path.join(dirpath, "last.ckpt")] * 2, phase
        assert [r["start_step"] for r in runs] == [RESUMES_FROM[phase]] * 2, phase
        assert [r["global_step"] for r in runs] == [6, 6], phase
        names = _published(dirpath)
        step_4 = ["step=4-v1.ckpt", "step=4.ckpt"] if phase == "rank0-between-renames" else ["step=4.ckpt"]
        assert names == sorted(["last.ckpt", "step=2.ckpt", *step_4, "step=6.ckpt"]), f"{phase}: {names}"
        assert all(loads_completely(strategy, os.path.join(dirpath, name)) for name in names), phase
        assert not [name for name in os.listdir(dirpath) if name.startswith(".")], f"{phase}: leftovers"
        ledger = [*runs[0]["best_k_models"], runs[0]["last_model_path"]]
        assert all(os.path.exists(path) for path in ledger), f"{phase}: {ledger}"
        # what the crash left (a staging entry, the `last` renamed aside) was resolved, and that was said; every
        # rank resolves leftovers before `last` is looked up, and whichever got there first says so
        said = [w for run in runs for w in run["warnings"] if "FiniteGradCheckpoint (rank" in w]
        assert bool(said) == bool(leftovers[phase]), f"{phase}: left {leftovers[phase]}, said {said}"


def test_plain_model_checkpoint_publishes_a_truncated_file_when_tmpdir_is_another_filesystem(worker_results):
    """The control for single files: Lightning's fsspec transaction writes its temporary file in ``$TMPDIR`` and, on
    another filesystem, copies it into place under the final name; a crash during that copy publishes a truncated
    checkpoint. ``FiniteGradCheckpoint`` stages in the checkpoint's own directory instead (test above)."""
    crashed = _crash(worker_results, "ddp", "rank0-during", plain=True)
    assert crashed.ranks[0] is None, crashed.stdout[-3000:]
    dirpath = str(crashed.out / "ckpts")
    assert "step=4.ckpt" in _published(dirpath), os.listdir(dirpath)
    assert 0 < os.path.getsize(os.path.join(dirpath, "step=4.ckpt"))  # half of it
    assert not loads_completely("ddp", os.path.join(dirpath, "step=4.ckpt"))


@pytest.mark.parametrize("strategy", ["deepspeed", "fsdp2"])
def test_a_write_failing_on_rank_1_of_a_sharded_save_raises_on_every_rank_and_rolls_back(worker_results, strategy):
    """Disk full on a non-zero rank while every rank writes its part of a directory checkpoint.

    FSDP2's distributed checkpoint agrees on write failures itself. DeepSpeed's save runs collectives after the files
    are written (it ends with a barrier), so the seal holds the failed write instead of letting rank 1 leave the save
    early; every rank then raises right after, rank 0 with ``CheckpointWriteError`` naming rank 1, long before the
    strategy's 30 s timeout."""
    if strategy == "deepspeed" and (reason := deepspeed_missing()):
        pytest.skip(reason)
    run = _crash(worker_results, strategy, "rank1-disk-full")
    ranks = run.ranks
    assert all(rank is not None for rank in ranks), f"a rank wrote no results:\n{run.stdout[-3000:]}"
    assert "No space left on device" in ranks[1]["error"], ranks[1]["error"]  # its own error
    assert "No space left on device" in ranks[0]["error"], f"rank 0 did not learn of it:\n{run.stdout[-3000:]}"
    if strategy == "deepspeed":
        assert ranks[0]["error"].startswith("CheckpointWriteError: Writing the checkpoint"), ranks[0]["error"]
        assert "step=4.ckpt failed on rank 1" in ranks[0]["error"], ranks[0]["error"]  # the name it would have had
    assert all(rank["fit_seconds"] < 25 for rank in ranks), "a rank waited for the 30 s collective timeout"
    assert [r["global_step"] for r in ranks] == [4, 4]
    dirpath = str(run.out / "ckpts")
    step_2 = os.path.join(dirpath, "step=2.ckpt")
    for rank in ranks:  # the ledger rolled back to what global step 2 published
        assert list(rank["state"]["best_k_models"]) == [step_2], rank["state"]
        assert rank["state"]["best_model_path"] == step_2
        assert rank["last_model_path"] == os.path.join(dirpath, "last.ckpt")
    # the checkpoint step 4 would have evicted is still there, nothing partial is published or left behind
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=2.ckpt"], os.listdir(dirpath)
    assert all(loads_completely(strategy, os.path.join(dirpath, name)) for name in ("last.ckpt", "step=2.ckpt"))
