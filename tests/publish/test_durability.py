"""Durable publication: every published name's data is flushed before its rename, and its directory after the rename
and before any eviction; traced at the system-call level (``strace``) during real fits. Plain ``ModelCheckpoint`` is
the control: it flushes nothing. A flush that fails fails the boundary, with nothing published or evicted and the
ledger as it was; ``durable=False`` flushes nothing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from durability_trace import Call, durability_violations, flushes_under, have_strace, parse, publications, traced
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import lightning_ckguard.publish.staging as staging_module
from helpers import QUIET, FaultyModel, ledger_state, refuse_flushes_of_staging, tree_digest
from lightning_ckguard import CheckpointPublisher, CheckpointWriteError, FiniteGradCheckpoint
from lightning_ckguard.publish.durability import durability

needs_strace = pytest.mark.skipif(not have_strace(), reason="strace is not installed")

# a new monitored best every step: each boundary writes step=N, replaces `last` and evicts the oldest of the top 2
TOP_2_EVERY_STEP = dict(monitor="step", mode="max", save_top_k=2, every_n_train_steps=1, filename="{step}")
STEPS = dict(max_steps=6, limit_val_batches=0)


def fit(callback: ModelCheckpoint, model: FaultyModel | None = None, plugins: list | None = None) -> Trainer:
    seed_everything(0)
    trainer = Trainer(callbacks=[callback], plugins=plugins, **QUIET, **STEPS)
    trainer.fit(model or FaultyModel())
    return trainer


def names(tree: dict[str, object]) -> list[str]:
    """The names in a checkpoint directory, from its ``tree_digest`` (whose keys are relative paths)."""
    return sorted({path.split("/")[0] for path in tree})


def visible(tree: dict[str, object]) -> dict[str, object]:
    return {path: digest for path, digest in tree.items() if not path.startswith(".")}


def traced_fit(tmp_path: Path, callback: ModelCheckpoint, plugins: list | None = None) -> list[Call]:
    trace = str(tmp_path / "trace.txt")
    with traced(trace):
        fit(callback, plugins=plugins)
    return parse(Path(trace).read_text())


# strace is a second process, and tracing costs seconds: the traced fits are out of the fast lane
@needs_strace
@pytest.mark.multiprocess
@pytest.mark.parametrize("setup", ["files", "link", "async"])
def test_every_name_is_flushed_before_its_rename_and_its_directory_before_any_eviction(setup, tmp_path):
    dirpath = str(tmp_path / "checkpoints")
    save_last = "link" if setup == "link" else True
    plugins = [AsyncCheckpointIO()] if setup == "async" else None
    calls = traced_fit(tmp_path, FiniteGradCheckpoint(dirpath=dirpath, save_last=save_last, **TOP_2_EVERY_STEP),
                       plugins)
    assert durability_violations(calls, dirpath) == []
    published = publications(calls, dirpath)
    assert published.count("last.ckpt") == 6 and len(published) == 12, published
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]  # four evictions, flushed first


def refuse_symbolic_links(source: str, link: str, *args: object, **kwargs: object) -> None:
    """``os.symlink`` on a filesystem without symbolic links (vfat, exFAT, some SMB and FUSE mounts)."""
    raise OSError(errno.EPERM, "Operation not permitted (no symbolic links on this filesystem)", link)


@needs_strace
@pytest.mark.multiprocess
@pytest.mark.parametrize("plugins", [None, "async"])
def test_a_last_copied_where_links_are_refused_is_flushed_before_its_rename(plugins, tmp_path, monkeypatch):
    """``save_last="link"`` where the filesystem refuses symbolic links: ``last`` is a copy, so it holds data, and
    that data is on disk before the copy takes the name and before the checkpoint it copies is evicted."""
    monkeypatch.setattr(os, "symlink", refuse_symbolic_links)
    dirpath = str(tmp_path / "checkpoints")
    callback = FiniteGradCheckpoint(dirpath=dirpath, save_last="link", **TOP_2_EVERY_STEP)
    calls = traced_fit(tmp_path, callback, [AsyncCheckpointIO()] if plugins else None)
    assert durability_violations(calls, dirpath) == []
    assert not any(call.name in ("symlink", "symlinkat") for call in calls)
    assert publications(calls, dirpath).count("last.ckpt") == 6
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=5.ckpt", "step=6.ckpt"]
    last = os.path.join(dirpath, "last.ckpt")
    assert not os.path.islink(last) and torch.load(last, weights_only=False)["global_step"] == 6


@needs_strace
@pytest.mark.multiprocess
@pytest.mark.parametrize("plugins", [None, "async"])
def test_each_directory_a_write_makes_is_flushed_in_its_parent_before_any_eviction(plugins, tmp_path):
    """A ``filename`` with a ``/`` puts each checkpoint in a directory of its own, made by its write, and the fit
    makes ``dirpath`` too: each new directory's entry, in its parent, is on disk before anything is evicted."""
    dirpath = str(tmp_path / "runs" / "checkpoints")  # two levels made by the first write
    # no `last`: its flush of dirpath would cover the new directories in it
    callback = FiniteGradCheckpoint(dirpath=dirpath, **{**TOP_2_EVERY_STEP, "filename": "{step}/model"})
    calls = traced_fit(tmp_path, callback, [AsyncCheckpointIO()] if plugins else None)
    assert durability_violations(calls, dirpath) == []
    assert publications(calls, dirpath) == [os.path.join(f"step={step}", "model.ckpt") for step in range(1, 7)]
    assert sorted(os.listdir(os.path.join(dirpath, "step=6"))) == ["model.ckpt"]
    assert os.listdir(os.path.join(dirpath, "step=4")) == []  # evicted: ModelCheckpoint leaves the directory
    flushed = flushes_under(calls, str(tmp_path))
    assert str(tmp_path) in flushed and str(tmp_path / "runs") in flushed, "the new dirpath's entries"


def test_a_write_flushes_the_parent_of_each_directory_it_made_and_no_other(tmp_path, monkeypatch):
    """Without a tracer: what exists before the write is noted, and only the directories made since are flushed in
    their parents; not durable, nothing is looked at."""
    flushed: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    staging = tmp_path / "runs" / "step=1" / ".model.ckpt.ckguard-staging"
    for made in ([str(staging), str(tmp_path / "runs"), str(tmp_path)], [str(staging)]):
        flush = durability(True).before_writing(str(staging))
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.write_bytes(b"checkpoint")
        flush(str(staging))
        assert flushed == made
        flushed.clear()
    with monkeypatch.context() as looking:
        looking.setattr(os, "stat", None)  # any look at the disk would raise
        durability(False).before_writing(str(staging))(str(staging))
    assert flushed == []


@needs_strace
@pytest.mark.multiprocess
def test_plain_model_checkpoint_flushes_nothing(tmp_path):
    """The control: the same fit with ``ModelCheckpoint`` breaks both rules for every name it publishes."""
    dirpath = str(tmp_path / "checkpoints")
    calls = traced_fit(tmp_path, ModelCheckpoint(dirpath=dirpath, save_last=True, **TOP_2_EVERY_STEP))
    violations = durability_violations(calls, dirpath)
    assert any("without a flush after its last write" in v for v in violations), violations
    assert any("was removed" in v and "before the directory was flushed" in v for v in violations), violations
    assert flushes_under(calls, dirpath) == []


@needs_strace
@pytest.mark.multiprocess
def test_durable_false_flushes_nothing(tmp_path):
    dirpath = str(tmp_path / "checkpoints")
    calls = traced_fit(tmp_path, FiniteGradCheckpoint(dirpath=dirpath, save_last=True, durable=False,
                                                      **TOP_2_EVERY_STEP))
    assert len(publications(calls, dirpath)) == 12
    assert flushes_under(calls, dirpath) == []
    violations = durability_violations(calls, dirpath)
    for name in [f"step={step}.ckpt" for step in range(1, 7)] + ["last.ckpt"]:
        assert any(v.startswith(os.path.join(dirpath, name)) or v.startswith(name) for v in violations), name


@pytest.mark.parametrize("plugins", [None, "async"])
def test_a_flush_that_fails_publishes_nothing_keeps_the_evicted_checkpoint_and_rolls_the_ledger_back(plugins,
                                                                                                    tmp_path):
    """The data flush of the step-4 boundary fails (an I/O error on ``fsync``): nothing of it is published, the
    checkpoint it would have evicted is still there, and the ledger is the one before it."""
    dirpath = str(tmp_path / "checkpoints")
    callback = FiniteGradCheckpoint(dirpath=dirpath, save_last=True, **TOP_2_EVERY_STEP)
    model = FaultyModel(snapshot_steps=[3])  # after step 3's boundary, before step 4's
    undo: list = []
    model.on_train_batch_start = lambda batch, batch_idx: (  # type: ignore[method-assign]
        undo.append(refuse_flushes_of_staging("step=4")) if model.trainer.global_step == 3 else None)
    try:
        with pytest.raises((OSError, CheckpointWriteError), match="injected flush failure"):
            fit(callback, model, [AsyncCheckpointIO()] if plugins else None)
    finally:
        for restore in undo:
            restore()
    assert ledger_state(callback) == model.snapshots[3]["state"]
    assert sorted(os.listdir(dirpath)) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]  # step=2 was to be evicted
    assert torch.load(os.path.join(dirpath, "last.ckpt"), weights_only=False)["global_step"] == 3
    if plugins is None:  # byte for byte (in the background, step 3's own write may still run at the snapshot)
        assert tree_digest(dirpath) == model.snapshots[3]["tree"]


def test_durable_must_be_a_bool():
    with pytest.raises(ValueError, match="`durable` must be a bool, got 'yes'"):
        FiniteGradCheckpoint(durable="yes")  # type: ignore[arg-type]


def durability_launch(worker_results):
    """One launch of both 2-process scenarios (the traced fit first: rank 1 starts under the tracer during it)."""
    return worker_results("workers/durability_worker.py", ["{out}"], timeout=300)


@needs_strace
@pytest.mark.multiprocess
def test_a_directory_written_by_two_ranks_is_flushed_whole_before_its_exchange(worker_results):
    """FSDP2 distributed checkpoints: every file and directory of a staging directory flushed before it takes its
    name, the checkpoint directory flushed before anything is evicted; rank 1 is traced too."""
    launch = durability_launch(worker_results)
    result = launch.ranks[0]["traced"]
    assert result["error"] is None and launch.ranks[1]["traced"]["error"] is None
    calls = parse((launch.out / "trace.txt").read_text())
    assert durability_violations(calls, result["dirpath"]) == []
    published = publications(calls, result["dirpath"])
    assert published.count("last.ckpt") == 4 and len(published) == 8, published
    flushed = flushes_under(calls, result["dirpath"])
    assert any(path.endswith(".distcp") for path in flushed), "the shards were not flushed"
    assert names(result["tree"]) == ["last.ckpt", "step=6.ckpt", "step=8.ckpt"]


@pytest.mark.multiprocess
def test_a_flush_failing_on_rank_1_fails_the_boundary_on_every_rank_and_rolls_back(worker_results):
    launch = durability_launch(worker_results)
    rank0, rank1 = (rank["flush-fails"] for rank in launch.ranks)
    assert rank1["error"]["type"] == "OSError" and "injected flush failure" in rank1["error"]["message"]
    assert rank0["error"]["type"] == "CheckpointWriteError" and "rank 1" in rank0["error"]["message"]
    before = rank0["snapshots"]["5"]
    # the retired copy of `last` kept for readers (a hidden name) is released when the fit ends, as always
    assert visible(rank0["tree"]) == visible(before["tree"]), "something was published or evicted"
    assert names(visible(before["tree"])) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    for rank in (rank0, rank1):
        assert rank["state"] == rank["snapshots"]["5"]["state"], "the ledger was not rolled back"


@needs_strace
@pytest.mark.multiprocess
@pytest.mark.parametrize("durable", [True, False])
def test_the_trainer_free_publisher_flushes_as_the_callback_does(durable, tmp_path):
    dirpath = str(tmp_path / "checkpoints")
    publisher = CheckpointPublisher(None, dirpath, durable=durable)
    model = torch.nn.Linear(4, 2)
    trace = str(tmp_path / "trace.txt")
    with traced(trace):
        for step in (1, 2):
            publisher.save("last.ckpt", {"model": model, "step": step})
    calls = parse(Path(trace).read_text())
    assert publications(calls, dirpath) == ["last.ckpt", "last.ckpt"]
    if durable:
        assert durability_violations(calls, dirpath) == []
    else:
        assert flushes_under(calls, dirpath) == []
        assert durability_violations(calls, dirpath) != []


@pytest.mark.parametrize("durable", [True, False])
def test_the_publishers_new_dirpath_is_flushed_in_each_parent_it_was_made_in(tmp_path, monkeypatch, durable):
    """``CheckpointPublisher`` makes its ``dirpath`` when it is made, before any write: a machine crash must not take
    the new directory (and every checkpoint later published in it) along."""
    from lightning_ckguard import CheckpointPublisher

    flushed: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    CheckpointPublisher(None, str(tmp_path / "runs" / "checkpoints"), durable=durable)
    assert flushed == ([str(tmp_path / "runs"), str(tmp_path)] if durable else [])


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_checkpoint_put_back_is_flushed_in_its_directory(tmp_path, monkeypatch, kind):
    """A failed boundary puts back what it replaced by a rename: the directory holding the name is flushed after it,
    as after any move into place, so that a machine crash cannot bring the failed boundary's checkpoint back."""
    from fsspec.implementations.local import LocalFileSystem

    from lightning_ckguard.publish.storage import LocalStorage
    from lightning_ckguard.publish.writers import StagedWriter

    def make(path: str, content: str) -> None:
        if kind == "file":
            Path(path).write_text(content)
        else:
            os.makedirs(path)
            Path(path, "shard").write_text(content)

    best = str(tmp_path / "best.ckpt")
    make(best, "before")
    writer = StagedWriter(None, LocalStorage(LocalFileSystem()), durability(True))
    writer.open(None)
    writer.save(best, lambda staging, flush: make(staging, "failed"))
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("flush", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    exchange = staging_module._exchange
    monkeypatch.setattr(os, "replace", lambda source, destination: (
        events.append(("rename", os.path.basename(destination))), replace(source, destination))[1])
    monkeypatch.setattr(staging_module, "_exchange", lambda a, b: (  # a directory where the filesystem swaps names
        events.append(("rename", os.path.basename(b))), exchange(a, b))[1])
    writer.close(False, (), lambda path: None)
    monkeypatch.undo()
    assert Path(best if kind == "file" else os.path.join(best, "shard")).read_text() == "before"
    renamed_back = max(i for i, event in enumerate(events) if event == ("rename", "best.ckpt"))
    assert ("flush", str(tmp_path)) in events[renamed_back:], events
