"""The staged writer's clean-ups after a boundary (putting back what a failed boundary replaced, releasing what a
published one kept, removing what a failed one created): one that fails is a warning naming its path, and the others
still run; the boundary's own outcome is what surfaces. One process, a local directory, the writer's own protocol."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from lightning_ckguard.publish.durability import durability
from lightning_ckguard.publish.staging import RETIRED_SUFFIX
from lightning_ckguard.publish.storage import LocalStorage
from lightning_ckguard.publish.writers import StagedWriter

WRITERS_LOG = "lightning_ckguard.publish.writers"


class RefusingStorage(LocalStorage):
    """Local storage whose release of the kept copy of :attr:`refuse` fails (a reader holding it open, on NFS)."""

    refuse: str | None = None

    def release_retired(self, path: str) -> None:
        if path == self.refuse:
            raise OSError(16, "Device or resource busy", path)
        super().release_retired(path)


def _replace_both(tmp_path: Path) -> tuple[StagedWriter, RefusingStorage, list[str]]:
    """A boundary whose two writes replaced ``best.ckpt`` and ``last.ckpt``, each kept under a second name."""
    storage = RefusingStorage(LocalFileSystem())
    writer = StagedWriter(None, storage, durability(False))
    paths = [str(tmp_path / "best.ckpt"), str(tmp_path / "last.ckpt")]
    for path in paths:
        Path(path).write_text("old")
    writer.open(None)
    for path in paths:
        writer.save(path, lambda staging, flush: Path(staging).write_text("new"))
    return writer, storage, paths


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == WRITERS_LOG and r.levelno == logging.WARNING]


def test_a_replaced_file_that_cannot_be_put_back_is_named_and_the_others_are_put_back(tmp_path, caplog):
    writer, _, (best, last) = _replace_both(tmp_path)
    Path(tmp_path / f".last.ckpt{RETIRED_SUFFIX}").unlink()  # newest first: `last` is put back first, and fails
    with caplog.at_level(logging.WARNING, logger=WRITERS_LOG):
        writer.close(False, (), lambda path: None)
    assert Path(best).read_text() == "old"  # put back after `last` failed
    assert Path(last).read_text() == "new"
    [warning] = _warnings(caplog)
    assert warning.startswith(f"Could not put back the checkpoint {last} after a failed checkpoint write: ")


def test_a_kept_copy_that_cannot_be_released_is_named_and_the_others_are_released(tmp_path, caplog):
    writer, storage, (best, last) = _replace_both(tmp_path)
    storage.refuse = best
    with caplog.at_level(logging.WARNING, logger=WRITERS_LOG):
        writer.close(True, (), lambda path: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".best.ckpt{RETIRED_SUFFIX}", "best.ckpt", "last.ckpt"]
    assert [Path(p).read_text() for p in (best, last)] == ["new", "new"]
    [warning] = _warnings(caplog)
    assert warning.startswith(f"Could not remove the replaced copy of {best}: ")


def test_a_created_checkpoint_that_cannot_be_removed_is_named_and_the_others_are_removed(tmp_path, caplog):
    writer = StagedWriter(None, LocalStorage(LocalFileSystem()), durability(False))
    created = [str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]
    for path in created:
        Path(path).write_text("new")

    def remove(path: str) -> Any:
        if path.endswith("b.ckpt"):  # the newest goes first, and fails
            raise OSError(13, "Permission denied", path)
        Path(path).unlink()

    writer.open(None)
    with caplog.at_level(logging.WARNING, logger=WRITERS_LOG):
        writer.close(False, created, remove)
    assert [p.name for p in tmp_path.iterdir()] == ["b.ckpt"]
    [warning] = _warnings(caplog)
    assert warning.startswith(f"Could not remove {created[1]} after a failed checkpoint write: ")
