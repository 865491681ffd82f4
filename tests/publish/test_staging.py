"""Directory checkpoints are published by one rename, and what an interrupted publication leaves is recovered."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_ckguard.publish.staging as staging_module
import lightning_ckguard.publish.storage as storage_module
from conftest import LAST_AT_EVERY_BOUNDARY
from helpers import QUIET, DirectoryCheckpointStrategy, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint
from lightning_ckguard.publish.staging import (
    checkpoint_is_complete,
    move_into_place,
    published_path,
    recover,
    release_all_retired,
    release_retired,
    staging_path,
)


def _checkpoint_dir(path, content: str) -> None:
    os.makedirs(path)
    for shard in ("shard0", "shard1"):
        with open(os.path.join(path, shard), "w") as f:
            f.write(content)


def _content(path) -> set[str]:
    return {open(os.path.join(path, name)).read() for name in os.listdir(path)}


def test_move_into_place_replaces_a_published_directory_whole(tmp_path):
    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "old")
    staging = staging_path(final)
    _checkpoint_dir(staging, "new")
    move_into_place(staging, final)
    assert _content(final) == {"new"}
    retired = ".last.ckpt.ckguard-retired"
    assert sorted(os.listdir(tmp_path)) == [retired, "last.ckpt"]  # the old one, kept for readers inside it
    assert _content(tmp_path / retired) == {"old"}
    assert release_all_retired(str(tmp_path)) == [str(tmp_path / retired)]
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_the_end_of_a_fit_keeps_a_retired_copy_whose_replacement_never_arrived(tmp_path):
    # two renames (no exchange): `last` moved aside, then the move of the new one in failed (held, raised at the next
    # agreement). The retired copy is the only copy of the last good checkpoint: the fit's end must not remove it,
    # and the next setup puts it back under its name
    _checkpoint_dir(tmp_path / ".last.ckpt.ckguard-retired", "good last")
    _checkpoint_dir(tmp_path / "step=4.ckpt", "step 4")
    assert release_all_retired(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == [".last.ckpt.ckguard-retired", "step=4.ckpt"]
    recover(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=4.ckpt"]
    assert _content(tmp_path / "last.ckpt") == {"good last"}


def test_a_reader_inside_the_old_directory_when_it_is_replaced_still_finds_all_of_it(tmp_path, monkeypatch, exchange):
    """A reader resolves ``last.ckpt/checkpoint/shard`` one component at a time: one that entered the old directory
    just before the swap goes on reading there. Removing the old directory right after the swap left it an empty
    listing (CI: a ZeRO-2 reader's failed load); it is kept until the name is written again."""
    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "old")
    inside = os.open(final, os.O_RDONLY | os.O_DIRECTORY)  # where a reader's lookup stands, mid-path
    try:
        _checkpoint_dir(staging_path(final), "new")
        move_into_place(staging_path(final), final)
        assert sorted(os.listdir(inside)) == ["shard0", "shard1"]
        for shard in ("shard0", "shard1"):
            with open(os.open(shard, os.O_RDONLY, dir_fd=inside)) as f:
                assert f.read() == "old"
        assert _content(final) == {"new"}
        # the next write of the name releases it, so at most two copies exist at any time
        release_retired(final)
        assert os.listdir(inside) == []
        assert os.listdir(tmp_path) == ["last.ckpt"]
    finally:
        os.close(inside)


def _a_directory_fit(dirpath, guarded: bool) -> tuple[list[list[str]], list[tuple[str, list[str]]], list[str]]:
    """A fit writing directory checkpoints: `last` (named per epoch) replaced at every step, one top-K checkpoint.
    Returns the hidden entries of ``dirpath`` at every batch end, each write's path with the hidden entries as it
    began, and the files after the fit."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    hidden: list[list[str]] = []

    class Look(Callback):  # runs before the checkpoint callback (Lightning orders those last): the previous save's
        def on_train_batch_end(self, *args):
            hidden.append(sorted(n for n in os.listdir(dirpath) if n.startswith(".")) if os.path.isdir(dirpath) else [])

    checkpoint_class = FiniteGradCheckpoint if guarded else ModelCheckpoint
    checkpoint = checkpoint_class(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    checkpoint.CHECKPOINT_NAME_LAST = "last-{epoch}"
    seed_everything(0)
    strategy = DirectoryCheckpointStrategy()
    trainer = Trainer(strategy=strategy, callbacks=[Look(), checkpoint], max_epochs=2, limit_train_batches=3,
                      limit_val_batches=0, **QUIET)
    trainer.fit(FaultyModel())
    return hidden, strategy.writes, sorted(os.listdir(dirpath))


def test_a_directory_fit_keeps_one_retired_copy_of_last_and_ends_with_model_checkpoints_files(tmp_path):
    """The replaced `last` stays retired until the name is written again: never more than two copies of a name.
    Evicting a name takes its retired copy too (else a crash would have recovery restore the evicted checkpoint),
    and the fit ends with exactly ``ModelCheckpoint``'s files."""
    hidden, writes, files = _a_directory_fit(str(tmp_path / "guarded"), guarded=True)
    *_, plain_files = _a_directory_fit(str(tmp_path / "plain"), guarded=False)
    retired_0 = [".last-epoch=0.ckpt.ckguard-retired"]
    # batch ends 1..6, each after the previous step's save: last-epoch=0 written at steps 1-3, last-epoch=1 at 4-6
    assert hidden == [[], [], retired_0, retired_0, [], [".last-epoch=1.ckpt.ckguard-retired"]]
    # the retired copy goes before its name is written again; the top-K write comes first at each step
    retired_beside = [(os.path.basename(published_path(path)), beside) for path, beside in writes]
    assert retired_beside[4:6] == [("epoch=0-step=3.ckpt", retired_0), ("last-epoch=0.ckpt", [])]
    assert len(writes) == 12 and all(f".{name}.ckguard-retired" not in beside for name, beside in retired_beside)
    assert files == plain_files == ["epoch=1-step=6.ckpt", "last-epoch=1.ckpt"]


def _recorded_renames(monkeypatch) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []
    replace, exchange = os.replace, staging_module._exchange

    def recorded_replace(src, dst, *args, **kwargs):
        calls.append(("replace", os.path.basename(src), os.path.basename(dst)))
        return replace(src, dst, *args, **kwargs)

    def recorded_exchange(a, b):
        calls.append(("exchange", os.path.basename(a), os.path.basename(b)))
        return exchange(a, b)

    monkeypatch.setattr(os, "replace", recorded_replace)
    monkeypatch.setattr(staging_module, "_exchange", recorded_exchange)
    return calls


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_is_replaced_by_one_os_replace_so_its_name_is_never_absent(tmp_path, monkeypatch, kind):
    final = str(tmp_path / "last.ckpt")
    staging = staging_path(final)
    (tmp_path / "step=2.ckpt").write_text("old")
    (tmp_path / "step=4.ckpt").write_text("new")
    if kind == "file":
        (tmp_path / "last.ckpt").write_text("old")
        (tmp_path / os.path.basename(staging)).write_text("new")
    else:
        os.symlink("step=2.ckpt", final)
        os.symlink("step=4.ckpt", staging)
    calls = _recorded_renames(monkeypatch)
    move_into_place(staging, final)
    assert calls == [("replace", ".last.ckpt.ckguard-staging", "last.ckpt")]
    assert open(final).read() == "new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]


RENAMES = {
    # published in one step; then the old directory (now under the staging name) is retired, and kept
    True: [("exchange", ".last.ckpt.ckguard-staging", "last.ckpt"),
           ("replace", ".last.ckpt.ckguard-staging", ".last.ckpt.ckguard-retired")],
    # where the exchange is missing: the old one renamed aside to the retired name, then the new one moved in
    False: [("replace", "last.ckpt", ".last.ckpt.ckguard-retired"),
            ("replace", ".last.ckpt.ckguard-staging", "last.ckpt")],
}


def test_a_directory_is_swapped_in_one_exchange_where_the_filesystem_supports_it_else_by_two_renames(
    tmp_path, monkeypatch, exchange
):
    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "old")
    staging = staging_path(final)
    _checkpoint_dir(staging, "new")
    calls = _recorded_renames(monkeypatch)
    move_into_place(staging, final)
    assert calls == RENAMES[exchange]
    assert _content(final) == {"new"}
    assert _content(tmp_path / ".last.ckpt.ckguard-retired") == {"old"}


def test_the_exchange_is_probed_once_per_filesystem_and_refused_where_unsupported(tmp_path, monkeypatch):
    import errno

    calls: list[tuple[str, str]] = []

    def refusing(a, b):
        calls.append((a, b))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(staging_module, "_renameat2", refusing)
    monkeypatch.setattr(staging_module, "_exchange_support", {})
    (tmp_path / "sub").mkdir()
    assert staging_module.supports_exchange(str(tmp_path)) is False
    assert staging_module.supports_exchange(str(tmp_path / "sub")) is False  # same filesystem: cached
    assert len(calls) == 1
    assert sorted(os.listdir(tmp_path)) == ["sub"]  # the probes are gone


def test_recover_removes_staging_and_restores_an_interrupted_replacement(tmp_path):
    # a crash before the rename: only the staging directory
    _checkpoint_dir(staging_path(str(tmp_path / "step=4.ckpt")), "partial")
    # a crash between moving the old `last` aside and moving the new one in
    _checkpoint_dir(tmp_path / ".last.ckpt.ckguard-retired", "old last")
    # a crash after the new one arrived, before the old copy was deleted
    _checkpoint_dir(tmp_path / "step=2.ckpt", "new step 2")
    _checkpoint_dir(tmp_path / ".step=2.ckpt.ckguard-retired", "old step 2")
    # a crash right after an exchange: the old directory is under the staging name
    _checkpoint_dir(tmp_path / "step=6.ckpt", "new step 6")
    _checkpoint_dir(staging_path(str(tmp_path / "step=6.ckpt")), "old step 6")
    actions = recover(str(tmp_path))
    assert len(actions) == 4
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=2.ckpt", "step=6.ckpt"]
    assert _content(tmp_path / "step=6.ckpt") == {"new step 6"}
    assert _content(tmp_path / "last.ckpt") == {"old last"}
    assert _content(tmp_path / "step=2.ckpt") == {"new step 2"}


def test_setup_recovers_leftovers_with_a_warning(tmp_path):
    _checkpoint_dir(staging_path(str(tmp_path / "epoch=0-step=4.ckpt")), "partial")
    callback = FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    seed_everything(0)
    with pytest.warns(UserWarning, match="removed the unpublished partial checkpoint"):
        Trainer(callbacks=[callback], max_steps=4, limit_val_batches=0, **QUIET).fit(FaultyModel())
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_ledger_entries_whose_files_are_gone_or_incomplete_are_dropped_on_resume(tmp_path, damage):
    def fit(max_epochs: int, ckpt_path: str | None = None) -> FiniteGradCheckpoint:
        callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
        seed_everything(0)
        trainer = Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(FaultyModel(val_losses=[3.0, 2.0, 4.0, 5.0]), ckpt_path=ckpt_path)
        return callback

    fit(2)
    best = tmp_path / "epoch=1-step=4.ckpt"
    assert best.exists()
    if damage == "deleted":
        best.unlink()  # lost: deleted by hand, or in a crash
    else:
        best.write_bytes(best.read_bytes()[:1000])  # cut off, e.g. copied by hand and interrupted
    with pytest.warns(UserWarning, match=r"dropped 1 checkpoint\(s\).*epoch=1-step=4.ckpt"):
        callback = fit(4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert str(best) not in callback.best_k_models
    # epoch 0 stays the best left; epochs 2 and 3 are worse but fill the free slot of the top-2
    assert callback.best_model_path == str(tmp_path / "epoch=0-step=2.ckpt")
    kept = ["epoch=1-step=4.ckpt"] if damage == "truncated" else []  # forgotten, not deleted: it is the user's file
    expected = sorted(["epoch=0-step=2.ckpt", "epoch=2-step=6.ckpt", "last.ckpt", *kept])
    assert sorted(p.name for p in tmp_path.iterdir()) == expected
    # `last` moves with the top-K (Lightning 2.5: at every validation end)
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == (8 if LAST_AT_EVERY_BOUNDARY else 6)


@pytest.mark.parametrize(("mode", "val_losses", "lost", "best_left"), [
    ("min", [3.0, 1.0, 2.0], "epoch=1-step=4.ckpt", ("epoch=2-step=6.ckpt", 2.0)),
    ("max", [1.0, 3.0, 2.0], "epoch=1-step=4.ckpt", ("epoch=2-step=6.ckpt", 2.0)),
])
def test_a_resume_that_drops_the_best_entry_names_the_best_one_left(tmp_path, mode, val_losses, lost, best_left):
    # top-3 of three published values; the best file is lost before a resume that trains no further (to evaluate
    # with ckpt_path="best", say): the best of the two left, by the monitor's mode, becomes the best
    def fit(ckpt_path: str | None = None) -> FiniteGradCheckpoint:
        callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", mode=mode, save_top_k=3, save_last=True)
        seed_everything(0)
        trainer = Trainer(callbacks=[callback], max_epochs=3, limit_train_batches=2, limit_val_batches=1,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(FaultyModel(val_losses=val_losses), ckpt_path=ckpt_path)
        return callback

    fit()
    (tmp_path / lost).unlink()
    with pytest.warns(UserWarning, match=rf"dropped 1 checkpoint\(s\).*{lost}"):
        callback = fit(ckpt_path=str(tmp_path / "last.ckpt"))
    assert (os.path.basename(callback.best_model_path), float(callback.best_model_score)) == best_left
    assert sorted(os.path.basename(path) for path in callback.best_k_models) == sorted(
        ["epoch=0-step=2.ckpt", "epoch=2-step=6.ckpt"])


def test_a_last_checkpoint_gone_before_a_resume_is_dropped_from_the_state(tmp_path):
    def fit(ckpt_path: str | None = None) -> FiniteGradCheckpoint:
        callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, save_last=True)
        seed_everything(0)
        trainer = Trainer(callbacks=[callback], max_epochs=2, limit_train_batches=2, limit_val_batches=1,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(FaultyModel(val_losses=[3.0, 2.0]), ckpt_path=ckpt_path)
        return callback

    best = fit().best_model_path
    (tmp_path / "last.ckpt").unlink()  # deleted by hand; the best checkpoint's state still names it
    with pytest.warns(UserWarning, match=r"dropped 1 checkpoint\(s\).*last.ckpt"):
        callback = fit(ckpt_path=best)  # trains no further (to evaluate, say)
    assert callback.last_model_path == "" and callback.best_model_path == best
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=4.ckpt"]


def test_completeness_is_judged_from_the_markers_a_writer_puts_down_last(tmp_path):
    torch.save({"x": torch.ones(3)}, tmp_path / "whole.ckpt")
    (tmp_path / "cut.ckpt").write_bytes((tmp_path / "whole.ckpt").read_bytes()[:200])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "custom.ckpt").write_bytes(b"a format of a custom CheckpointIO")
    for name, files in {
        "dcp-whole": [".metadata", "__0_0.distcp"], "dcp-cut": ["__0_0.distcp"],
        "deepspeed-whole": ["latest", "zero_to_fp32.py"], "deepspeed-cut": ["zero_to_fp32.py"], "empty-dir": [],
    }.items():
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("x")
    complete = {p.name for p in tmp_path.iterdir() if checkpoint_is_complete(str(p))}
    assert complete == {"whole.ckpt", "custom.ckpt", "dcp-whole", "deepspeed-whole"}
    assert not checkpoint_is_complete(str(tmp_path / "absent.ckpt"))


def test_a_single_file_is_serialized_in_memory_written_by_fsspec_and_renamed_into_place(tmp_path, monkeypatch):
    """Lightning's own write path is kept (``torch.save`` into memory, an fsspec transaction that writes a temporary
    file and moves it), and its target is the staging sibling, which one rename then publishes."""
    events: list[tuple[str, ...]] = []
    save, move, replace = torch.save, shutil.move, os.replace

    def recorded_save(obj, f, *args, **kwargs):
        events.append(("torch.save into", type(f).__name__))
        return save(obj, f, *args, **kwargs)

    def recorded_move(src, dst, *args, **kwargs):
        events.append(("fsspec moves", os.path.dirname(src), os.path.basename(dst)))
        return move(src, dst, *args, **kwargs)

    def recorded_replace(src, dst, *args, **kwargs):
        events.append(("rename", os.path.basename(src), os.path.basename(dst)))
        return replace(src, dst, *args, **kwargs)

    temporary = tmp_path / "tmpdir"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where fsspec's transaction writes first
    monkeypatch.setattr(torch, "save", recorded_save)
    monkeypatch.setattr(shutil, "move", recorded_move)
    monkeypatch.setattr(os, "replace", recorded_replace)
    seed_everything(0)
    callback = FiniteGradCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    Trainer(callbacks=[callback], max_steps=2, limit_val_batches=0, **QUIET).fit(FaultyModel())
    name = "epoch=0-step=2.ckpt"
    assert events == [
        ("torch.save into", "BytesIO"),
        ("fsspec moves", str(temporary), f".{name}.ckguard-staging"),
        ("rename", f".{name}.ckguard-staging", name),
    ]
    assert os.listdir(tmp_path / "ckpts") == [name] and os.listdir(temporary) == []


def test_a_staging_path_is_reported_under_the_name_it_would_be_published_as(tmp_path):
    final = str(tmp_path / "epoch=0-step=4.ckpt")
    assert published_path(staging_path(final)) == final
    assert published_path(final) == final


def _kinds(root) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): ``link``, ``dir`` or ``file``."""
    kinds = {}
    for directory, subdirectories, files in os.walk(root):
        for name in subdirectories + files:
            path = os.path.join(directory, name)
            kind = "link" if os.path.islink(path) else "dir" if os.path.isdir(path) else "file"
            kinds[os.path.relpath(path, root)] = kind
    return kinds


def _fit(dirpath: str, cls: type, directories: bool, max_epochs: int = 2, **kwargs) -> None:
    seed_everything(0)
    strategy = DirectoryCheckpointStrategy() if directories else "auto"
    Trainer(strategy=strategy, callbacks=[cls(dirpath=dirpath, **kwargs)], max_epochs=max_epochs,
            limit_train_batches=2, limit_val_batches=0, **QUIET).fit(FaultyModel())


@pytest.mark.parametrize("directories", [False, True], ids=["file", "directory"])
def test_a_last_link_to_the_checkpoint_itself_leaves_the_checkpoint_as_model_checkpoint_does(tmp_path, directories):
    # `last` is the name the top-1 checkpoint was just saved under: ModelCheckpoint's link does nothing to it
    same_name = dict(filename="last", save_last="link", save_top_k=1, enable_version_counter=False)
    _fit(str(tmp_path / "plain"), ModelCheckpoint, directories, **same_name)
    _fit(str(tmp_path / "guarded"), FiniteGradCheckpoint, directories, **same_name)
    assert _kinds(tmp_path / "guarded") == _kinds(tmp_path / "plain")
    assert not os.path.islink(tmp_path / "guarded" / "last.ckpt")
    last = tmp_path / "guarded" / "last.ckpt"
    loaded = torch.load(last / "state.pt" if directories else last, weights_only=False)
    assert loaded["global_step"] == 4


def test_a_filename_in_a_subdirectory_leaves_no_retired_copy_there(tmp_path):
    # a directory fit whose name `sub/model` is replaced at every epoch: its retired copy sits in `sub/`
    kwargs = dict(filename="sub/model", save_top_k=1, save_last=True, enable_version_counter=False)
    _fit(str(tmp_path / "plain"), ModelCheckpoint, True, max_epochs=3, **kwargs)
    _fit(str(tmp_path / "guarded"), FiniteGradCheckpoint, True, max_epochs=3, **kwargs)
    assert sorted(os.listdir(tmp_path / "guarded" / "sub")) == ["model.ckpt"]
    assert _kinds(tmp_path / "guarded") == _kinds(tmp_path / "plain")


def test_recover_resolves_leftovers_in_subdirectories_and_follows_no_link(tmp_path):
    dirpath = tmp_path / "ckpts"
    # a crash between the two renames of `sub/model.ckpt`, and a staging entry two levels down
    _checkpoint_dir(dirpath / "sub" / ".model.ckpt.ckguard-retired", "old model")
    _checkpoint_dir(dirpath / "sub" / ".model.ckpt.ckguard-staging", "new model, unpublished")
    _checkpoint_dir(staging_path(str(dirpath / "sub" / "deeper" / "step=2.ckpt")), "partial")
    # what a link leads to is not this fit's: left alone
    _checkpoint_dir(tmp_path / "elsewhere" / ".other.ckpt.ckguard-staging", "someone else's")
    os.symlink(tmp_path / "elsewhere", dirpath / "link")
    actions = recover(str(dirpath))
    assert len(actions) == 3, actions
    assert sorted(os.listdir(dirpath / "sub")) == ["deeper", "model.ckpt"]
    assert _content(dirpath / "sub" / "model.ckpt") == {"old model"}
    assert os.listdir(dirpath / "sub" / "deeper") == []
    assert os.listdir(tmp_path / "elsewhere") == [".other.ckpt.ckguard-staging"]
    # a retired copy whose replacement arrived, in a subdirectory: released at the end of a fit
    _checkpoint_dir(dirpath / "sub" / ".model.ckpt.ckguard-retired", "replaced")
    assert release_all_retired(str(dirpath)) == [str(dirpath / "sub" / ".model.ckpt.ckguard-retired")]
    assert sorted(os.listdir(dirpath / "sub")) == ["deeper", "model.ckpt"]


def test_a_checkpoint_file_never_replaces_a_directory_it_did_not_write(tmp_path):
    # a directory of the user's at the checkpoint's name: ModelCheckpoint writes into it; swapping it out would delete
    # data no fit wrote, so the publication is refused (held, then raised) and the directory is left as it is
    users = tmp_path / "last.ckpt"
    users.mkdir()
    (users / "notes.txt").write_text("user data")
    with pytest.raises(IsADirectoryError, match="left as it is"):
        _fit(str(tmp_path), FiniteGradCheckpoint, directories=False, save_top_k=0, save_last=True,
             enable_version_counter=False)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert os.listdir(users) == ["notes.txt"] and (users / "notes.txt").read_text() == "user data"


def test_a_refused_move_over_a_published_file_puts_it_back_and_leaves_no_retired_name(tmp_path, monkeypatch):
    """The file kept to be put back is a second name of the published one: once the move over it is refused, the
    name still is that file, and only the hidden retired name goes (a rename between two names of one file does
    nothing), not left beside the checkpoint for good."""
    from lightning_ckguard import CheckpointPublisher

    publisher = CheckpointPublisher(None, tmp_path)
    publisher.save("a.pt", {"value": torch.tensor(1.0)})

    def refused(staging: str, filepath: str, keep_retired: bool = False) -> bool:
        raise PermissionError(13, "Permission denied (injected)", filepath)

    monkeypatch.setattr(staging_module, "move_into_place", refused)
    with pytest.raises(PermissionError, match="injected"):
        publisher.save("a.pt", {"value": torch.tensor(2.0)})
    assert os.listdir(tmp_path) == ["a.pt"]
    assert torch.load(tmp_path / "a.pt", weights_only=True)["value"] == 1.0
    monkeypatch.undo()
    publisher.save("a.pt", {"value": torch.tensor(3.0)})  # and the name is published again as before
    assert os.listdir(tmp_path) == ["a.pt"]
    assert torch.load(tmp_path / "a.pt", weights_only=True)["value"] == 3.0


def test_resuming_from_an_older_checkpoint_of_the_run_says_why_its_evicted_entries_are_dropped(tmp_path):
    """The routine case of the drop: the best checkpoint's state still lists a top-K file the run removed later."""
    def fit(max_epochs: int, ckpt_path: str | None = None) -> FiniteGradCheckpoint:
        callback = FiniteGradCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2)
        seed_everything(0)
        trainer = Trainer(callbacks=[callback], max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=1,
                          num_sanity_val_steps=0, **QUIET)
        trainer.fit(FaultyModel(val_losses=[3.0, 1.0, 2.0, 5.0]), ckpt_path=ckpt_path)
        return callback

    first = fit(3)  # epoch 0 (3.0) is removed at epoch 2, after epoch 1's checkpoint (the best) was written
    assert first.best_model_path == str(tmp_path / "epoch=1-step=4.ckpt")
    assert not (tmp_path / "epoch=0-step=2.ckpt").exists()
    with pytest.warns(UserWarning, match=r"dropped 1 checkpoint\(s\).*epoch=0-step=2.ckpt\. Expected when resuming "
                                         r"from a checkpoint older than the run's latest"):
        second = fit(4, ckpt_path=first.best_model_path)
    assert str(tmp_path / "epoch=0-step=2.ckpt") not in second.best_k_models


def test_a_recovery_that_fails_at_setup_raises_before_training(tmp_path, monkeypatch):
    # the filesystem refuses to put back a retired copy: training must not go on over a `dirpath` left half recovered
    def refused(dirpath: str, subdirectories: bool = True) -> list[str]:
        raise PermissionError(13, "Permission denied (injected)", os.path.join(dirpath, ".last.ckpt.ckguard-retired"))

    monkeypatch.setattr(storage_module, "recover", refused)
    model = FaultyModel()
    with pytest.raises(PermissionError, match="injected"):
        Trainer(callbacks=[FiniteGradCheckpoint(dirpath=tmp_path, every_n_train_steps=2)], max_steps=4,
                limit_val_batches=0, **QUIET).fit(model)
    assert model.global_step == 0 and os.listdir(tmp_path) == []


def _write_directory(content: str):
    """A write for ``StagedWriter.save`` (a strategy's save) that makes a checkpoint directory holding ``content``."""
    return lambda staging, flush: _checkpoint_dir(staging, content)


@pytest.mark.parametrize("published", [True, False], ids=["published", "failed"])
def test_a_directory_written_twice_in_one_boundary_keeps_the_one_before_the_boundary_to_put_back(
    tmp_path, exchange, published
):
    """The second write of a directory name in one boundary replaces the first write, not the retired copy of the
    checkpoint before the boundary: a failed boundary puts that one back, with no hidden entry left; a published one
    keeps it retired for readers inside it (until the name is written again), and the first write is gone."""
    from fsspec.implementations.local import LocalFileSystem

    from lightning_ckguard.publish.durability import durability
    from lightning_ckguard.publish.storage import LocalStorage
    from lightning_ckguard.publish.writers import StagedWriter

    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "before")
    writer = StagedWriter(None, LocalStorage(LocalFileSystem()), durability(False))
    writer.open(None)
    writer.save(final, _write_directory("first"))
    writer.save(final, _write_directory("second"))
    writer.close(published, (), lambda path: None)
    retired = ".last.ckpt.ckguard-retired"
    if published:
        assert sorted(os.listdir(tmp_path)) == [retired, "last.ckpt"]
        assert (_content(final), _content(tmp_path / retired)) == ({"second"}, {"before"})
    else:
        assert os.listdir(tmp_path) == ["last.ckpt"]
        assert _content(final) == {"before"}


def test_a_directory_move_that_fails_half_way_leaves_the_old_checkpoint_at_its_name(tmp_path, monkeypatch, exchange):
    """The move's second step fails (with an exchange, the rename of the old directory from the staging name to the
    retired one; without, the rename of the new one in after the old one was renamed aside): the first is undone,
    so the old checkpoint is under its name again, and the new one stays staged (the caller discards it)."""
    final = str(tmp_path / "last.ckpt")
    _checkpoint_dir(final, "old")
    staging = staging_path(final)
    _checkpoint_dir(staging, "new")
    replace = os.replace

    def refuse_the_move_in(src, dst, *args, **kwargs):
        if src == staging:
            raise OSError(5, "Input/output error (injected)", src)
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", refuse_the_move_in)
    with pytest.raises(OSError, match="injected"):
        move_into_place(staging, final)
    monkeypatch.setattr(os, "replace", replace)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(staging), "last.ckpt"]
    assert (_content(final), _content(staging)) == ({"old"}, {"new"})
