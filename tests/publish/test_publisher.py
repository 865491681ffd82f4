"""``CheckpointPublisher``: the callback's publication guarantees in a Fabric loop, without a Trainer.

Two real processes (gloo), ``workers/publisher_worker.py``: a NaN on rank 1 only is rejected on both ranks with
nothing written; a write refused on rank 0 raises on both and leaves no partial file; an FSDP2 (``fully_shard``)
distributed checkpoint is published whole, as one directory. Single-process cases run in the fast lane, with a Fabric
strategy whose checkpoint IO is a user's own among them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from conftest import OUT, WorkerResults
from helpers import hook_writes
from lightning_ckguard import CheckpointPublisher, GradientGuard, NonFiniteGradientError, StateCheckError


@pytest.fixture(scope="module")
def ranks(worker_results: WorkerResults) -> list[dict[str, Any]]:
    return worker_results("workers/publisher_worker.py", [OUT], timeout=300).ranks


def _errors(ranks: list[dict[str, Any]], scenario: str, step: int) -> list[str | None]:
    found = []
    for rank in ranks:
        event = next(e for e in rank[scenario]["events"] if e["step"] == step)
        found.append(None if event["error"] is None else event["error"]["type"])
    return found


def _event(ranks: list[dict[str, Any]], scenario: str, step: int) -> dict[str, Any]:
    return next(e for e in ranks[0][scenario]["events"] if e["step"] == step)


@pytest.mark.multiprocess
def test_a_nan_on_rank_1_is_rejected_on_both_ranks_and_nothing_is_written(ranks):
    assert _errors(ranks, "nan-on-rank-1", 4) == [None, None]
    assert _errors(ranks, "nan-on-rank-1", 8) == ["NonFiniteGradientError"] * 2
    messages = [next(e for e in r["nan-on-rank-1"]["events"] if e["step"] == 8)["error"]["message"] for r in ranks]
    assert messages[0] == messages[1] and "recorded on rank 1 " in messages[0], messages
    rejected = _event(ranks, "nan-on-rank-1", 8)
    assert rejected["unchanged"], "the directory changed at a rejected save"
    assert rejected["listing"] == ["step=4.ckpt"]
    # rewound in place to step 4 and trained on: step 12 publishes
    assert _errors(ranks, "nan-on-rank-1", 12) == [None, None]
    assert _event(ranks, "nan-on-rank-1", 12)["listing"] == ["step=12.ckpt", "step=4.ckpt"]
    assert [r["nan-on-rank-1"]["loaded_step"] for r in ranks] == [12, 12]


@pytest.mark.multiprocess
def test_a_dirpath_rank_0_cannot_create_raises_on_every_rank_at_construction(ranks):
    errors = [rank["unmakeable-dirpath"]["error"] for rank in ranks]
    assert [e and e["type"] for e in errors] == ["NotADirectoryError", "CheckpointWriteError"], errors
    assert "failed on rank 0" in errors[1]["message"]


@pytest.mark.multiprocess
def test_a_write_refused_on_rank_0_raises_on_both_ranks_and_leaves_no_partial_file(ranks):
    # rank 0 raises its own error, rank 1 the CheckpointWriteError that names rank 0
    assert _errors(ranks, "refused-write-on-rank-0", 8) == ["OSError", "CheckpointWriteError"]
    refused = _event(ranks, "refused-write-on-rank-0", 8)
    assert refused["unchanged"], "a partial file or a staging entry was left behind"
    assert refused["listing"] == ["step=4.ckpt"]
    assert _errors(ranks, "refused-write-on-rank-0", 12) == [None, None]
    assert _event(ranks, "refused-write-on-rank-0", 12)["listing"] == ["step=12.ckpt", "step=4.ckpt"]


@pytest.mark.multiprocess
def test_an_fsdp2_distributed_checkpoint_is_published_whole_as_one_directory(ranks):
    assert _errors(ranks, "fsdp2-directory", 4) == [None, None]
    assert _event(ranks, "fsdp2-directory", 4)["published_is_directory"]
    assert _errors(ranks, "fsdp2-directory", 8) == ["NonFiniteGradientError"] * 2
    assert _event(ranks, "fsdp2-directory", 8)["unchanged"]
    assert _event(ranks, "fsdp2-directory", 12)["listing"] == ["step=12.ckpt", "step=4.ckpt"]  # nothing hidden left
    shards = ranks[0]["fsdp2-directory"]["shards"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(shards), shards  # both ranks' shards
    assert [r["fsdp2-directory"]["loaded_step"] for r in ranks] == [12, 12]


@pytest.mark.multiprocess
def test_a_sharded_save_that_fails_on_one_rank_before_the_distributed_checkpoint_raises_on_both_at_once(ranks):
    """Rank 1's own part fails before the distributed checkpoint's collectives (an object's ``state_dict()``), while
    rank 0 is about to enter them: the ranks meet first, so both raise at once (not at the 60 s collective timeout,
    with a raw gloo error), and nothing is published."""
    results = [rank["fsdp2-fails-before-its-part"] for rank in ranks]
    errors = [r["failed_save"]["error"] for r in results]
    assert [e and e["type"] for e in errors] == ["CheckpointWriteError", "RuntimeError"], errors
    assert "failed on rank 1" in errors[0]["message"] and "state_dict fails on rank 1" in errors[0]["message"]
    assert max(r["failed_save"]["seconds"] for r in results) < 20
    assert results[0]["listing"] == ["good.ckpt"]  # nothing hidden left
    assert [r["save_again"]["error"] for r in results] == [None, None]
    assert results[0]["final_listing"] == ["again.ckpt", "good.ckpt"]


@pytest.mark.multiprocess
def test_a_sharded_restore_that_fails_on_one_rank_before_the_distributed_checkpoint_raises_on_both_at_once(ranks):
    results = [rank["fsdp2-fails-before-its-part"] for rank in ranks]
    for failed in ("failed_restore", "failed_optimizer_restore"):  # before the model's load, and after it
        errors = [r[failed]["error"] for r in results]
        assert [e and e["type"] for e in errors] == ["CheckpointRestoreError"] * 2, (failed, errors)
        assert all("failed on rank 1" in e["message"] for e in errors)
        assert max(r[failed]["seconds"] for r in results) < 20
    assert [r["restore_again"]["error"] for r in results] == [None, None]


@pytest.mark.multiprocess
def test_a_directory_replaced_under_its_name_is_kept_for_readers_until_the_next_save_or_close(ranks):
    kept = ranks[0]["fsdp2-directory"]["kept"]
    published = ["last.ckpt", "step=12.ckpt", "step=4.ckpt"]
    assert kept["first"] == published  # nothing replaced yet
    # the replaced directory is kept under a hidden name while a reader may still be inside it; one copy at most
    assert kept["second"] == kept["third"] == [".last.ckpt.ckguard-retired", *published]
    assert kept["closed"] == published


# ------------------------------------------------------------------------------------------ one process


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_one_process_publishes_the_state_dicts_by_one_rename(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(None, tmp_path / "ckpt", guard=guard)
    model(torch.randn(3, 4)).sum().backward()
    guard.record(optimizer)
    optimizer.step()
    verdict = publisher.save("step=1.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    assert verdict is not None and verdict.accepted
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step=1.ckpt"]
    loaded = torch.load(tmp_path / "ckpt" / "step=1.ckpt", weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["0.weight"], model[0].weight)
    assert guard.steps_recorded == 0  # a fresh window once published


def test_one_process_rejection_writes_nothing_and_keeps_the_window(tmp_path):
    model = _model()
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(None, tmp_path, guard=guard)
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("inf")
    guard.record()
    with pytest.raises(NonFiniteGradientError, match="0.weight"):
        publisher.save("step=1.ckpt", {"model": model})
    assert os.listdir(tmp_path) == []
    assert guard.steps_recorded == 1


def test_one_process_failed_write_leaves_the_published_name_as_it_was(tmp_path):
    publisher = CheckpointPublisher(None, tmp_path)
    publisher.save("last.ckpt", {"value": torch.tensor(1.0)})
    with pytest.raises(Exception, match="pickle"):
        publisher.save("last.ckpt", {"value": lambda: None})  # torch.save cannot pickle a lambda
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["value"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(dirpath=""), "dirpath"), (dict(dirpath=3), "dirpath"), (dict(guard=object()), "guard"),
     (dict(collective="ddp"), "collective"), (dict(collective=object()), "collective")],
)
def test_bad_arguments_are_a_value_error(tmp_path, kwargs, match):
    # a collective that is none would publish as a single process on every rank
    with pytest.raises(ValueError, match=match):
        CheckpointPublisher(**{"collective": None, "dirpath": tmp_path, **kwargs})


@pytest.mark.parametrize("name", ["", "..", "sub/step=1.ckpt", "/abs.ckpt"])
def test_a_name_outside_dirpath_is_a_value_error(tmp_path, name):
    with pytest.raises(ValueError, match="name"):
        CheckpointPublisher(None, tmp_path).save(name, {})


@pytest.mark.parametrize("name", [".model.ckguard-staging", ".step=1.ckpt.ckguard-retired",
                                  ".ckguard-probe-1-a.ckguard-staging"])
def test_a_name_shaped_like_a_hidden_entry_is_a_value_error_and_writes_nothing(tmp_path, name):
    """The next publisher's recovery would remove it (or rename it over another checkpoint)."""
    publisher = CheckpointPublisher(None, tmp_path)
    with pytest.raises(ValueError, match="hidden staging or retired entry"):
        publisher.save(name, {"x": torch.ones(1)})
    assert os.listdir(tmp_path) == []
    publisher.save("keep.ckguard-retired", {"x": torch.ones(1)})  # no leading '.': no hidden entry, kept by recovery
    CheckpointPublisher(None, tmp_path)
    assert os.listdir(tmp_path) == ["keep.ckguard-retired"]


def test_a_path_like_name_is_published_under_its_string(tmp_path):
    CheckpointPublisher(None, tmp_path).save(Path("step=1.ckpt"), {"step": 1})
    assert os.listdir(tmp_path) == ["step=1.ckpt"]
    assert torch.load(tmp_path / "step=1.ckpt", weights_only=True)["step"] == 1
    with pytest.raises(ValueError, match="name"):
        CheckpointPublisher(None, tmp_path).save(Path("sub") / "step=2.ckpt", {"step": 2})


def test_the_signature_of_save_says_a_path_like_name_is_taken():
    import typing

    assert typing.get_type_hints(CheckpointPublisher.save)["name"] == str | os.PathLike[str]


@pytest.mark.parametrize("name", [5, None, b"step=1.ckpt", ["step=1.ckpt"]], ids=["int", "None", "bytes", "list"])
def test_a_name_that_is_no_string_is_a_value_error(tmp_path, name):
    with pytest.raises(ValueError, match="name"):
        CheckpointPublisher(None, tmp_path).save(name, {})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("with_fabric", [False, True], ids=["process", "fabric"])
def test_a_file_url_dirpath_publishes_as_its_plain_path_does(tmp_path, with_fabric):
    """fsspec writes the staging entry at the URL's path; the check for it, the rename and the recovery go through
    ``os``, which knows no URLs: the published name must be there, and nothing hidden left."""
    model = _model()
    collective = None
    if with_fabric:
        fabric = Fabric(accelerator="cpu", devices=1)
        model, collective = fabric.setup(model), fabric.strategy
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".old.ckpt.ckguard-staging").write_bytes(b"cut off")  # what a crash left: recovered
    guard = GradientGuard(model)
    with pytest.warns(UserWarning, match="removed the unpublished partial checkpoint"):
        publisher = CheckpointPublisher(collective, f"file://{tmp_path}/ckpt", guard=guard)
    model(torch.randn(3, 4)).sum().backward()
    guard.record()
    verdict = publisher.save("step=1.ckpt", {"model": model, "step": 1})
    assert verdict is not None and verdict.accepted
    assert os.listdir(tmp_path / "ckpt") == ["step=1.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "step=1.ckpt", weights_only=True)["step"] == 1
    assert guard.steps_recorded == 0  # a fresh window: it was published


def test_object_storage_with_a_strategy_that_writes_local_paths_is_a_value_error():
    from lightning.fabric.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="writes checkpoints through local paths"):
        CheckpointPublisher(FSDPStrategy(), "s3://bucket/run")


class SidecarIO(TorchCheckpointIO):
    """A user's subclass of Fabric's checkpoint IO: ``super()`` writes, then a manifest goes beside the path it got."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        Path(f"{path}.json").write_text(json.dumps({"step": checkpoint["step"], "path": str(path)}))


class RefusedUploadIO(SidecarIO):
    """The same, uploading what it wrote; the upload of ``step=2.ckpt`` is refused. Its removal takes the sidecar."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if os.path.basename(str(path)) == "step=2.ckpt":
            raise ConnectionError("the upload was refused")

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        Path(f"{path}.json").unlink(missing_ok=True)


def _fabric_publisher(tmp_path: Any, io: TorchCheckpointIO) -> tuple[CheckpointPublisher, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(_model())
    return CheckpointPublisher(fabric.strategy, tmp_path, guard=GradientGuard(model)), model


def _fabric_save(tmp_path: Any, io: TorchCheckpointIO) -> None:
    publisher, model = _fabric_publisher(tmp_path, io)
    verdict = publisher.save("step=1.ckpt", {"model": model, "step": 1})
    assert verdict is not None and verdict.accepted


def test_a_fabric_checkpoint_io_that_overrides_save_gets_the_real_name(tmp_path):
    """A user's ``save_checkpoint`` is handed the checkpoint's real name, as the callback hands it: what it puts
    beside the checkpoint is named after it, and the path it was given is the published one."""
    _fabric_save(tmp_path, SidecarIO())
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt", "step=1.ckpt.json"]  # no hidden sidecar left behind
    manifest = json.loads((tmp_path / "step=1.ckpt.json").read_text())
    assert manifest == {"step": 1, "path": str(tmp_path / "step=1.ckpt")}
    assert torch.load(tmp_path / "step=1.ckpt", weights_only=True)["step"] == 1


def test_fabrics_own_checkpoint_io_still_writes_into_staging(tmp_path):
    """The control: Fabric's own ``save_checkpoint`` writes only the path it is given, so it stays staged and the
    name is published by one rename."""
    written: list[str] = []
    undo = hook_writes(before=written.append)
    try:
        _fabric_save(tmp_path, TorchCheckpointIO())
    finally:
        undo()
    assert len(written) == 1 and os.path.basename(written[0]).startswith(".step=1.ckpt"), written
    assert os.listdir(tmp_path) == ["step=1.ckpt"]
    assert torch.load(tmp_path / "step=1.ckpt", weights_only=True)["step"] == 1


def test_a_fabric_checkpoint_io_whose_write_fails_leaves_nothing_under_a_new_name(tmp_path):
    """Written at the real name, a failed write is removed again through the IO's own removal, as the callback's
    rollback removes it; what was published before stays."""
    publisher, model = _fabric_publisher(tmp_path, RefusedUploadIO())
    publisher.save("step=1.ckpt", {"model": model, "step": 1})
    with pytest.raises(ConnectionError, match="refused"):
        publisher.save("step=2.ckpt", {"model": model, "step": 2})
    assert sorted(os.listdir(tmp_path)) == ["step=1.ckpt", "step=1.ckpt.json"]


def test_the_fabric_object_instead_of_its_strategy_is_a_value_error_naming_fabric_strategy(tmp_path):
    """``fabric`` has a world size but saves through no strategy of its own: under FSDP2 the publisher would write
    rank 0's shard only. It is refused, by the publisher and the guard alike, before anything is made."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_model())
    with pytest.raises(ValueError, match=r"`fabric\.strategy`"):
        CheckpointPublisher(fabric, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"`fabric\.strategy`"):
        GradientGuard(model).agree(fabric)
    assert not (tmp_path / "ckpt").exists()
    CheckpointPublisher(fabric.strategy, tmp_path / "ckpt").save("step=1.ckpt", {"model": model})  # the strategy
    assert os.listdir(tmp_path / "ckpt") == ["step=1.ckpt"]


@pytest.mark.parametrize("state", [None, [("step", 1)], "model"], ids=["None", "list", "str"])
def test_a_state_that_is_no_dict_is_a_value_error_at_the_call_and_writes_nothing(tmp_path, state):
    model = _model()
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(None, tmp_path, guard=guard)
    model(torch.randn(3, 4)).sum().backward()
    guard.record()
    with pytest.raises(ValueError, match="`state` must be a dict"):
        publisher.save("step=1.ckpt", state)
    assert os.listdir(tmp_path) == []
    assert guard.steps_recorded == 1 and publisher.last_verdict is None  # nothing agreed: the window stands


def test_a_save_whose_state_check_raises_leaves_no_earlier_verdict_as_its_own(tmp_path):
    model = _model()
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(None, tmp_path, guard=guard)
    model(torch.randn(3, 4)).sum().backward()
    guard.record()
    publisher.save("step=1.ckpt", {"model": model})
    assert publisher.last_verdict is not None and publisher.last_verdict.accepted
    with pytest.raises(StateCheckError):  # a tensor left on the meta device: the check itself fails
        publisher.save("step=2.ckpt", {"model": model, "extra": torch.empty(3, device="meta")})
    assert publisher.last_verdict is None, "the verdict of the most recent save: it reached none"
    assert os.listdir(tmp_path) == ["step=1.ckpt"]


def _distributed_checkpoint_failure(rank: int) -> BaseException:
    """What ``torch.distributed.checkpoint`` raises on every rank when ``rank``'s part of a save or load failed: a
    ``CheckpointException``, which is a ``BaseException``, carrying that rank's own error."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    try:
        raise OSError(28, "No space left on device (injected)")
    except OSError as error:
        return CheckpointException("CheckpointException", {rank: _wrap_exception(error)})


def test_a_distributed_checkpoint_failure_is_held_and_raised_as_this_ranks_own_error(tmp_path, monkeypatch):
    """A distributed checkpoint's failure is held like any write error: the failing rank raises its own error (a
    full disk), not the raw ``CheckpointException`` that ``except Exception`` would not catch, and nothing is left."""
    import lightning_ckguard.core.publisher as publisher_module

    publisher = CheckpointPublisher(None, tmp_path)
    publisher.save("last.ckpt", {"value": torch.tensor(1.0)})

    def failing_save(state: Any, path: Any) -> None:
        Path(path).write_bytes(b"part of it")
        raise _distributed_checkpoint_failure(rank=0)

    monkeypatch.setattr(publisher_module, "_atomic_save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        publisher.save("last.ckpt", {"value": torch.tensor(2.0)})
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["value"] == 1.0


def test_a_fabric_restore_whose_distributed_checkpoint_load_fails_raises_checkpoint_restore_error(tmp_path):
    from lightning_ckguard import CheckpointRestoreError, restore_fabric_state

    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_model())
    CheckpointPublisher(fabric.strategy, tmp_path).save("good.ckpt", {"model": model})

    def failing_load(*args: Any, **kwargs: Any) -> Any:
        raise _distributed_checkpoint_failure(rank=0)

    fabric.load = failing_load  # type: ignore[method-assign]
    with pytest.raises(CheckpointRestoreError, match="No space left") as raised:
        restore_fabric_state(fabric, str(tmp_path / "good.ckpt"), {"model": model})
    assert list(raised.value.ranks) == [0]


def test_the_recovery_at_construction_leaves_what_another_writer_left_in_a_subdirectory(tmp_path):
    # a publisher's names never lie in a subdirectory: another job's in-flight entries there are not its own
    (tmp_path / "other").mkdir()
    theirs = [tmp_path / "other" / ".step=10.ckpt.ckguard-staging", tmp_path / "other" / ".last.ckpt.ckguard-retired"]
    for path in [*theirs, tmp_path / ".a.pt.ckguard-staging"]:
        path.write_bytes(b"partial")
    with pytest.warns(UserWarning, match="CheckpointPublisher removed the unpublished partial checkpoint") as caught:
        CheckpointPublisher(None, tmp_path)
    assert all(path.exists() for path in theirs), "the recovery reached into a subdirectory"
    assert not (tmp_path / ".a.pt.ckguard-staging").exists() and len(caught) == 1


def test_the_recoverys_warnings_name_the_line_that_made_the_publisher(tmp_path):
    """Not a line of the package's own: the warning points at the caller, where ``dirpath`` was given."""
    (tmp_path / ".a.ckpt.ckguard-staging").write_bytes(b"partial")
    (tmp_path / "b.ckpt").write_bytes(b"published")
    (tmp_path / ".b.ckpt.ckguard-retired").write_bytes(b"replaced")
    with pytest.warns(UserWarning, match="CheckpointPublisher") as caught:
        CheckpointPublisher(None, tmp_path)
    assert len(caught) == 2 and [warning.filename for warning in caught] == [__file__] * 2, [
        (warning.filename, warning.lineno) for warning in caught]


def test_a_kept_copy_that_cannot_be_removed_is_warned_at_the_line_of_save_or_close(tmp_path, monkeypatch):
    publisher = CheckpointPublisher(None, tmp_path)
    for _ in range(2):
        publisher.save("last.ckpt", {"value": torch.tensor(1.0)})  # the second replaces it: a copy is kept

    release = publisher._storage.release_retired

    def refused_once(path: str) -> None:  # the publisher's own release; the writer's, later in the save, goes on
        monkeypatch.setattr(publisher._storage, "release_retired", release)
        raise PermissionError(f"refused: {path}")

    monkeypatch.setattr(publisher._storage, "release_retired", refused_once)
    with pytest.warns(UserWarning, match="could not remove the copies kept for readers") as at_save:
        publisher.save("last.ckpt", {"value": torch.tensor(2.0)})
    monkeypatch.setattr(publisher._storage, "release_retired", refused_once)
    with pytest.warns(UserWarning, match="could not remove the copies kept for readers") as at_close:
        publisher.close()
    assert [warning.filename for warning in [*at_save, *at_close]] == [__file__] * 2
