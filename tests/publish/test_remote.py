"""A ``dirpath`` on a non-local fsspec filesystem, without a server: fsspec's in-memory filesystem (``memory://``) is
not the local one, so ``ModelCheckpoint`` treats it as it treats S3. ``ckpt_path="last"`` resumes there, the
checkpoint a fit resumed from and the previous run's files elsewhere stay, as on local disk; and the removal rule
itself (``lightning_ckguard.publish.remote.removal_allowed``) on the paths a listing and a user give.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from functools import partial
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from lightning.pytorch import Trainer, seed_everything
from test_object_storage import EXPECTED_AFTER_RESUME, _resume_scenario

from helpers import QUIET, AtStepEnd, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.lightning.packages import is_last_name
from lightning_ckguard.publish.remote import newest_last_checkpoint, removal_allowed

EPOCHS = dict(limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
LOSSES = [3.0, 2.0, 1.0, 0.5]


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh directory on fsspec's in-memory filesystem (one store per process: a unique name per test)."""
    root = f"memory://ckguard-{uuid.uuid4().hex[:12]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _names(url: str) -> set[str]:
    fs = fsspec.filesystem("memory")
    return {path.rsplit("/", 1)[-1] for path in fs.ls(url, detail=False)} if fs.exists(url) else set()


def test_ckpt_path_last_resumes_on_a_non_local_fsspec_filesystem(memory_root):
    url = f"{memory_root}/run"
    args = dict(dirpath=url, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    first = Trainer(callbacks=[FiniteGradCheckpoint(**args)], max_epochs=2, **QUIET, **EPOCHS)
    first.fit(FaultyModel(val_losses=LOSSES))
    trainer = Trainer(callbacks=[FiniteGradCheckpoint(**args)], max_epochs=3, **QUIET, **EPOCHS)
    trainer.fit(FaultyModel(val_losses=LOSSES), ckpt_path="last")
    assert str(trainer.ckpt_path).startswith("memory://") and str(trainer.ckpt_path).endswith("/run/last.ckpt")
    assert trainer.global_step == 6
    assert _names(url) == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"}  # no `last-v1.ckpt`


def test_ckpt_path_last_takes_only_checkpoint_files_on_a_non_local_filesystem(memory_root):
    # a newer object whose name starts with `last` but is not a checkpoint (the run's own notes) is not resumed from
    url = f"{memory_root}/run"
    args = dict(dirpath=url, save_last=True)
    seed_everything(0)
    Trainer(callbacks=[FiniteGradCheckpoint(**args)], max_epochs=1, **QUIET, **EPOCHS).fit(FaultyModel())
    fsspec.filesystem("memory").pipe(f"{url}/last.json", b'{"note": "written after the fit"}')
    trainer = Trainer(callbacks=[FiniteGradCheckpoint(**args)], max_epochs=2, **QUIET, **EPOCHS)
    trainer.fit(FaultyModel(), ckpt_path="last")
    assert str(trainer.ckpt_path).endswith("/run/last.ckpt") and trainer.global_step == 4


@pytest.mark.parametrize("case", list(EXPECTED_AFTER_RESUME))
def test_resuming_on_a_non_local_fsspec_filesystem_keeps_what_local_disk_keeps(case, memory_root, tmp_path):
    local = _resume_scenario(str(tmp_path), case)
    remote = _resume_scenario(memory_root, case)
    first_names, second_names = EXPECTED_AFTER_RESUME[case]
    local_names = [{p.name for p in tmp_path.joinpath(d.rsplit("/", 1)[-1]).iterdir()} for d in local]
    assert local_names[0] == _names(remote[0]) == first_names
    if second_names is not None:
        assert local_names[1] == _names(remote[1]) == second_names


class FlakyMemoryFileSystem(MemoryFileSystem):
    """fsspec's in-memory filesystem (one store with ``memory://``) that, for a while, fails some looks at a name
    (``looks``: per name, whether each next look answers) and refuses its uploads (``refused``)."""

    protocol = "flakymemory"
    looks: dict[str, list[bool]] = {}
    refused: set[str] = set()

    def exists(self, path: str, **kwargs: Any) -> bool:
        pending = self.looks.get(path.rsplit("/", 1)[-1])
        if pending and not pending.pop(0):
            raise ConnectionError(f"no answer about {path}")
        return super().exists(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "w" in mode and path.rsplit("/", 1)[-1] in self.refused:
            raise OSError(f"upload of {path} refused")
        return super()._open(path, mode, **kwargs)


def _storage_fails(looks: list[bool], refuse: bool) -> Callable[[Trainer], None]:
    """From now on, the next looks the storage is asked for ``last.ckpt``'s name answer or not as ``looks`` says
    (``FlakyMemoryFileSystem.looks``), and with ``refuse`` its upload is refused."""

    def fail(trainer: Trainer) -> None:
        FlakyMemoryFileSystem.looks["last.ckpt"] = list(looks)
        if refuse:
            FlakyMemoryFileSystem.refused.add("last.ckpt")

    return fail


def _flaky_fit(memory_root: str, monkeypatch: Any, failing: AtStepEnd) -> tuple[Trainer, str]:
    """A fit to be run on a ``FlakyMemoryFileSystem`` directory that fails as ``failing`` says: a checkpoint every 2
    steps, the newest kept, and ``last``; and that directory's URL."""
    fsspec.register_implementation("flakymemory", FlakyMemoryFileSystem, clobber=True)
    monkeypatch.setattr(FlakyMemoryFileSystem, "looks", {})
    monkeypatch.setattr(FlakyMemoryFileSystem, "refused", set())
    url = memory_root.replace("memory://", "flakymemory://") + "/run"
    callback = FiniteGradCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=1, save_last=True,
                                    filename="{step}")
    seed_everything(0)
    return Trainer(callbacks=[failing, callback], max_steps=4, limit_val_batches=0, **QUIET), url


def test_a_name_the_storage_cannot_say_exists_is_never_removed_by_a_rollback(memory_root, monkeypatch):
    # at step 4 `last.ckpt` exists (step 2's), but the storage cannot say so, and its upload fails: the boundary rolls
    # back what it created, and must assume `last.ckpt` was there before it, not remove the only `last`
    trainer, url = _flaky_fit(memory_root, monkeypatch, AtStepEnd(3, _storage_fails(looks=[True, False], refuse=True)))
    with pytest.raises(OSError, match="upload of .*last.ckpt refused"):
        trainer.fit(FaultyModel())
    FlakyMemoryFileSystem.refused.clear()
    fs = fsspec.filesystem("flakymemory")
    assert {path.rsplit("/", 1)[-1] for path in fs.ls(url, detail=False)} == {"step=2.ckpt", "last.ckpt"}
    with fs.open(f"{url}/last.ckpt", "rb") as f:
        assert torch.load(f, weights_only=False)["global_step"] == 2


def test_a_look_the_storage_cannot_answer_raises_the_storages_own_error_in_one_process(memory_root, monkeypatch):
    # at step 4 ModelCheckpoint's look for `last.ckpt`'s name gets no answer: the error a user sees is the storage's
    trainer, _ = _flaky_fit(memory_root, monkeypatch, AtStepEnd(3, _storage_fails(looks=[False], refuse=False)))
    with pytest.raises(ConnectionError, match="no answer about .*last.ckpt"):
        trainer.fit(FaultyModel())


class StampedMemoryFileSystem(MemoryFileSystem):
    """fsspec's in-memory filesystem whose listing gives modification times as an object store does: ``LastModified``,
    in whole seconds, here set per name in ``stamps``."""

    protocol = "stampedmemory"
    stamps: dict[str, datetime] = {}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        entries = super().ls(path, detail=True, **kwargs)
        for entry in entries:
            entry["LastModified"] = self.stamps[entry["name"].rsplit("/", 1)[-1]]
        return entries if detail else [entry["name"] for entry in entries]


def test_ckpt_path_last_on_object_storage_takes_the_newest_whole_last(memory_root, monkeypatch):
    fs = StampedMemoryFileSystem()
    url = f"{memory_root}/run"
    day = lambda d: datetime(2026, 1, d, tzinfo=timezone.utc)  # noqa: E731
    monkeypatch.setattr(StampedMemoryFileSystem, "stamps", {"last-v1.ckpt": day(1), "last.ckpt": day(2)})
    for name in StampedMemoryFileSystem.stamps:
        fs.pipe(f"{url}/{name}", b"checkpoint")
    is_last = partial(is_last_name, "last", ".ckpt")
    # a later fit rewrote `last.ckpt`: newer than the version an earlier fit left
    newest = lambda: {os.path.basename(path) for path in newest_last_checkpoint(fs, url, is_last)}  # noqa: E731
    assert newest() == {"last.ckpt"}
    # in the same second, the higher version counter was written later
    StampedMemoryFileSystem.stamps["last-v1.ckpt"] = day(2)
    assert newest() == {"last-v1.ckpt"}
    # an empty object is no checkpoint (an upload of nothing, a marker a tool left), however new
    StampedMemoryFileSystem.stamps["last-v2.ckpt"] = day(3)
    fs.pipe(f"{url}/last-v2.ckpt", b"")
    assert newest() == {"last-v1.ckpt"}


def test_the_removal_rule_on_listing_paths_and_urls():
    fs = fsspec.filesystem("memory")
    run = "memory://bucket/run"
    allowed = lambda previous, resumed=None, current="memory://bucket/run/new.ckpt": removal_allowed(  # noqa: E731
        fs, previous, current, run, resumed)
    assert allowed("memory://bucket/run/old.ckpt")
    assert allowed("/bucket/run/old.ckpt")  # the protocol-less form a listing gives: the same object
    assert allowed("memory://bucket/run/sub/old.ckpt")
    assert not allowed("memory://bucket/run/new.ckpt")  # the name being written
    assert not allowed("memory://bucket/run/old.ckpt", resumed="/bucket/run/old.ckpt")  # the fit resumed from it
    assert not allowed("memory://bucket/run-2/old.ckpt")  # a sibling directory whose name starts alike
    assert not allowed("memory://bucket/other/old.ckpt")
    assert not removal_allowed(fs, "memory://bucket/run/old.ckpt", "memory://bucket/run/new.ckpt", None, None)
