"""Checkpoints on object storage: a real S3-compatible server (moto's server mode, started by the ``s3`` fixture on
127.0.0.1), reached through s3fs as a user would, with ``dirpath="s3://bucket/run"``.

``ckpt_path="last"`` resumes from the newest ``last``; the checkpoint a fit resumed from and checkpoints outside its
``dirpath`` are never removed (Lightning issue #21813), while top-K eviction works as on local disk; a rejected
boundary leaves the bucket as it was; an upload that fails rolls the ledger back and leaves the evicted checkpoint in
place; a reader never sees part of a checkpoint; a strategy that would write to the local disk instead is refused.
"""

from __future__ import annotations

import io
import json
import os
import threading
import warnings
from typing import Any

import fsspec
import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from s3_server import S3Server, ballast_for_a_refused_upload, environment

from helpers import QUIET, FaultyModel, ledger_state
from lightning_ckguard import FiniteGradCheckpoint, NonFiniteGradientError

# the `s3` fixture runs the server as a second process: not for the fast lane
pytestmark = pytest.mark.multiprocess

LOSSES = [3.0, 2.0, 1.0, 0.5]
EPOCHS = dict(limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)


def _trainer(callback: ModelCheckpoint, max_epochs: int | None = None, **kwargs: Any) -> Trainer:
    return Trainer(callbacks=[callback, *kwargs.pop("callbacks", [])], max_epochs=max_epochs, **QUIET,
                   **{**EPOCHS, **kwargs})


def _names(root: str, s3: S3Server) -> set[str]:
    """The checkpoint names under ``root``: a local directory or an ``s3://`` URL."""
    if root.startswith("s3://"):
        return set(s3.listing(root))
    return set(os.listdir(root)) if os.path.isdir(root) else set()


class BucketSnapshots(Callback):
    """Records the objects under ``url`` (key -> ETag, size) at the start of each of ``steps`` (global steps)."""

    def __init__(self, s3: S3Server, url: str, steps: set[int]) -> None:
        self.s3, self.url, self.steps = s3, url, steps
        self.listings: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step in self.steps:
            self.listings[trainer.global_step] = self.s3.listing(self.url)


def test_ckpt_path_last_resumes_from_the_newest_last_in_the_bucket(s3):
    url = f"s3://{s3.new_bucket()}/run"
    args = dict(dirpath=url, monitor="val_loss", save_top_k=2, save_last=True)
    seed_everything(0)
    _trainer(FiniteGradCheckpoint(**args), 2).fit(FaultyModel(val_losses=LOSSES))
    assert set(s3.listing(url)) == {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"}
    # resumed from epoch 0's file, whose state knows no `last` yet: this fit writes `last-v1.ckpt` beside `last.ckpt`
    resume_from = f"{url}/epoch=0-step=2.ckpt"
    _trainer(FiniteGradCheckpoint(**args), 3).fit(FaultyModel(val_losses=LOSSES), ckpt_path=resume_from)
    assert {"last.ckpt", "last-v1.ckpt"} <= set(s3.listing(url))

    # what a new process does: a new callback, a new Trainer, "resume from last"
    trainer = _trainer(FiniteGradCheckpoint(**args), 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no last checkpoint available.*")
        trainer.fit(FaultyModel(val_losses=LOSSES), ckpt_path="last")
    assert trainer.ckpt_path == f"{url}/last-v1.ckpt"  # the newest, with its protocol
    assert trainer.global_step == 8  # one more epoch after the 6 steps it resumed from
    assert not any(name.startswith("last-v2") for name in s3.listing(url))  # `last-v1` was replaced


def test_a_rejected_boundary_leaves_the_bucket_unchanged_and_last_resumes_from_the_good_checkpoint(s3):
    url = f"s3://{s3.new_bucket()}/run"
    args = dict(dirpath=url, every_n_train_steps=2, save_top_k=1, save_last=True)
    snapshots = BucketSnapshots(s3, url, {3})
    seed_everything(0)
    guard = FiniteGradCheckpoint(**args)
    trainer = _trainer(guard, max_steps=8, limit_val_batches=0, callbacks=[snapshots])
    with pytest.raises(NonFiniteGradientError) as info:
        trainer.fit(FaultyModel(fault_steps=[3]))
    assert (info.value.first_step, info.value.global_step) == (3, 4)
    before = snapshots.listings[3]
    assert set(before) == {"epoch=0-step=2.ckpt", "last.ckpt"}
    assert s3.listing(url) == before  # same keys, same ETags and sizes: nothing written, evicted or replaced

    # the way out: a new fit from the last good checkpoint
    trainer = _trainer(FiniteGradCheckpoint(**args), max_steps=6, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no last checkpoint available.*")
        trainer.fit(FaultyModel(), ckpt_path="last")
    assert trainer.ckpt_path == f"{url}/last.ckpt"
    assert trainer.global_step == 6
    assert not any(name.startswith("last-v") for name in s3.listing(url))


def _resume_scenario(root: str, case: str) -> tuple[str, str]:
    """Run two fits under ``root`` (a local directory or an ``s3://`` URL); returns (first run's dirpath, second's)."""
    first, second = f"{root}/first", f"{root}/second" if case == "another-dirpath" else f"{root}/first"
    seed_everything(0)
    if case == "another-dirpath":
        # the first run's best stays in its own directory; the second run starts from its `last`
        _trainer(FiniteGradCheckpoint(dirpath=first, save_last=True), 2).fit(FaultyModel(val_losses=LOSSES))
        _trainer(FiniteGradCheckpoint(dirpath=second, save_last=True), 4).fit(
            FaultyModel(val_losses=LOSSES), ckpt_path=f"{first}/last.ckpt")
    elif case == "resumed-from-would-be-evicted":
        # resumed from epoch 0 (3.0), whose ledger lists only itself: epoch 2 (1.0) would evict it from the top 2
        args = dict(dirpath=first, monitor="val_loss", save_top_k=2)
        _trainer(FiniteGradCheckpoint(**args), 2).fit(FaultyModel(val_losses=LOSSES))
        _trainer(FiniteGradCheckpoint(**args), 4).fit(
            FaultyModel(val_losses=LOSSES), ckpt_path=f"{first}/epoch=0-step=2.ckpt")
    else:  # "continued-top-k": the resumed ledger evicts what the first run wrote in the same dirpath, as on disk
        args = dict(dirpath=first, monitor="val_loss", save_top_k=2, save_last=True)
        _trainer(FiniteGradCheckpoint(**args), 2).fit(FaultyModel(val_losses=[3.0, 2.0, 2.5, 1.0]))
        _trainer(FiniteGradCheckpoint(**args), 4).fit(
            FaultyModel(val_losses=[3.0, 2.0, 2.5, 1.0]), ckpt_path=f"{first}/last.ckpt")
    return first, second


EXPECTED_AFTER_RESUME = {
    # the first run's files all stay; the second run's top-1 replaced its own files only
    "another-dirpath": ({"epoch=1-step=4.ckpt", "last.ckpt"}, {"epoch=3-step=8.ckpt", "last.ckpt"}),
    # the resumed-from file stays though it left the top 2 (ModelCheckpoint on S3 removes it)
    "resumed-from-would-be-evicted": (
        {"epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt"}, None),
    # epoch 0 (3.0) and epoch 2 (2.5) were evicted: the first one by the resumed ledger, in the same dirpath
    "continued-top-k": ({"epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"}, None),
}


@pytest.mark.parametrize("case", list(EXPECTED_AFTER_RESUME))
def test_resuming_keeps_what_the_fit_did_not_write_exactly_as_on_local_disk(s3, case, tmp_path):
    """Lightning #21813: on a remote filesystem ModelCheckpoint removes any path it evicts, including the checkpoint
    the fit resumed from and the previous run's files in another directory. The callback keeps them, as on disk."""
    local = _resume_scenario(str(tmp_path), case)
    remote = _resume_scenario(f"s3://{s3.new_bucket()}", case)
    first_names, second_names = EXPECTED_AFTER_RESUME[case]
    assert _names(local[0], s3) == first_names, "the local-disk reference changed"
    assert _names(remote[0], s3) == first_names
    if second_names is not None:
        assert _names(local[1], s3) == _names(remote[1], s3) == second_names


def test_top_k_eviction_on_object_storage_matches_local_disk(s3, tmp_path):
    listings = {}
    for root in (str(tmp_path), f"s3://{s3.new_bucket()}/run"):
        seed_everything(0)
        callback = FiniteGradCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2, save_last=True)
        _trainer(callback, 4).fit(FaultyModel(val_losses=[3.0, 2.0, 2.5, 1.0]))
        listings[root] = (_names(root, s3), os.path.basename(callback.best_model_path))
    first = next(iter(listings.values()))
    assert all(listing == first for listing in listings.values()), listings  # S3 and local disk alike
    assert listings[str(tmp_path)] == ({"epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"},
                                       "epoch=3-step=8.ckpt")


class RefusedAt(Callback):
    """Makes the checkpoint saved at global step ``step`` one the server refuses (see ``s3_server.MIN_PART_SIZE``),
    and records the ledger right before that step's boundary."""

    def __init__(self, step: int) -> None:
        self.step, self.ledger = step, None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step - 1:
            self.ledger = ledger_state(trainer.checkpoint_callback)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_step == self.step:
            checkpoint["ballast"] = ballast_for_a_refused_upload()


def test_an_upload_the_server_refuses_raises_rolls_back_and_keeps_the_evicted_checkpoint(s3):
    url = f"s3://{s3.new_bucket()}/run"
    guard = FiniteGradCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=1, save_last=True)
    refused = RefusedAt(step=4)
    seed_everything(0)
    with pytest.raises(OSError, match="smaller than the minimum allowed"):  # the server's EntityTooSmall
        _trainer(guard, max_steps=8, limit_val_batches=0, callbacks=[refused]).fit(FaultyModel())
    assert ledger_state(guard) == refused.ledger, "the ledger did not roll back"
    # step 4's top-1 file would have evicted step 2's: it is there, and nothing of step 4, not even a part
    assert set(s3.listing(url)) == {"epoch=0-step=2.ckpt", "last.ckpt"}
    assert s3.pending_uploads(url.removeprefix("s3://").split("/")[0]) == []
    assert guard.best_model_path == f"{url}/epoch=0-step=2.ckpt"


class LastRefusedAt(RefusedAt):
    """Only the second save at global step ``step`` (``last``, after the top-K file) is refused."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_step == self.step:
            self.saves = getattr(self, "saves", 0) + 1
            if self.saves == 2:
                checkpoint["ballast"] = ballast_for_a_refused_upload()


def test_an_object_a_failed_boundary_replaced_before_its_failure_is_named_on_rank_0(s3, caplog):
    """A constant top-K name is replaced, then ``last``'s upload is refused: the ledger rolls back, but the bucket
    keeps no copy to put back (it would cost a server-side copy of every replaced object): rank 0 says which
    object now holds the unpublished boundary's state."""
    url = f"s3://{s3.new_bucket()}/run"
    guard = FiniteGradCheckpoint(dirpath=url, monitor="val_loss", save_top_k=1, filename="best", save_last=True)
    refused = LastRefusedAt(step=4)
    seed_everything(0)
    with caplog.at_level("WARNING", logger="lightning_ckguard"), pytest.raises(OSError, match="minimum allowed"):
        _trainer(guard, 3, callbacks=[refused]).fit(FaultyModel(val_losses=LOSSES))
    assert ledger_state(guard) == refused.ledger, "the ledger did not roll back"
    assert set(s3.listing(url)) == {"best.ckpt", "last.ckpt"}
    with fsspec.filesystem("s3").open(f"{url}/best.ckpt", "rb") as f:
        assert torch.load(f, weights_only=False)["global_step"] == 4
    (warning,) = [r.getMessage() for r in caplog.records if "replaced in the same boundary" in r.getMessage()]
    assert f"after {url}/best.ckpt had been replaced" in warning and "it holds the checkpoint of that" in warning


class StopAnswering(Callback):
    """Makes the server stop answering after optimizer step ``step``, until the test lets it answer again."""

    def __init__(self, s3: S3Server, step: int) -> None:
        self.s3, self.step, self.stopped = s3, step, None

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self.stopped is None:
            self.stopped = self.s3.not_answering()
            self.stopped.__enter__()
            self.ledger = ledger_state(trainer.checkpoint_callback)


# each request times out after 0.25 s (s3fs tries 5 times), well within a strategy's collective timeout
IMPATIENT_S3FS = {"FSSPEC_S3": json.dumps({"config_kwargs": {
    "connect_timeout": 0.25, "read_timeout": 0.25, "retries": {"max_attempts": 1, "mode": "standard"}}})}


def test_an_upload_the_server_never_answers_raises_rolls_back_and_keeps_the_evicted_checkpoint(s3):
    url = f"s3://{s3.new_bucket()}/run"
    with environment(IMPATIENT_S3FS):
        guard = FiniteGradCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=1, save_last=True)
        stopper = StopAnswering(s3, step=3)
        trainer = _trainer(guard, max_steps=8, limit_val_batches=0, callbacks=[stopper])
        seed_everything(0)
        try:
            with pytest.raises(OSError):  # s3fs's timeout, translated to an OSError
                trainer.fit(FaultyModel())
        finally:
            if stopper.stopped is not None:
                stopper.stopped.__exit__(None, None, None)
    assert ledger_state(guard) == stopper.ledger, "the ledger did not roll back"
    # the top-1 file of step 2 that step 4's would have evicted is there, and nothing of step 4
    assert set(s3.listing(url)) == {"epoch=0-step=2.ckpt", "last.ckpt"}
    assert guard.best_model_path == f"{url}/epoch=0-step=2.ckpt"


class BigModel(FaultyModel):
    """A few megabytes of weights, so that each upload takes long enough for a reader to look in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(2_000_000))


def test_a_reader_never_sees_part_of_a_checkpoint_on_object_storage(s3):
    """Single-object uploads are atomic: a reader polling ``last.ckpt`` while it is replaced at every step sees no
    object, or a whole checkpoint (it loads), never a part."""
    url = f"s3://{s3.new_bucket()}/run"
    reader = fsspec.filesystem("s3", skip_instance_cache=True)  # a client of its own, as another process would be
    seen: list[int] = []
    failures: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                data = reader.cat_file(f"{url}/last.ckpt")
            except FileNotFoundError:
                continue
            try:
                seen.append(torch.load(io.BytesIO(data), weights_only=False)["global_step"])
            except Exception as error:  # a partial object would fail to load
                failures.append(f"{len(data)} bytes: {error}")

    thread = threading.Thread(target=read)
    thread.start()
    try:
        seed_everything(0)
        _trainer(FiniteGradCheckpoint(dirpath=url, every_n_train_steps=1, save_top_k=0, save_last=True),
                 max_steps=6, limit_val_batches=0, limit_train_batches=6).fit(BigModel())
    finally:
        done.set()
        thread.join()
    assert not failures
    assert len(set(seen)) >= 2, f"the reader saw only {sorted(set(seen))}: it did not read while `last` was replaced"


def test_a_strategy_writing_through_local_paths_is_refused_for_object_storage(s3):
    """Lightning's ModelParallelStrategy (FSDP2) turns the checkpoint path into a ``pathlib.Path`` before it writes
    (so do FSDPStrategy and DeepSpeed): ``s3://bucket/run/x.ckpt`` would be written to the local directory
    ``s3:/bucket/run/x.ckpt``, and ``ModelCheckpoint`` says nothing. The callback refuses it at setup."""
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import ModelParallelStrategy

    url = f"s3://{s3.new_bucket()}/run"
    guard = FiniteGradCheckpoint(dirpath=url)
    trainer = Trainer(strategy=ModelParallelStrategy(), devices=1, callbacks=[guard], **QUIET)
    with pytest.raises(ValueError, match=r"`ModelParallelStrategy` writes checkpoints through local paths.*'s3:/"):
        guard.setup(trainer, BoringModel(), "fit")
    plain = ModelCheckpoint(dirpath=url)
    plain.setup(Trainer(strategy=ModelParallelStrategy(), devices=1, callbacks=[plain], **QUIET), BoringModel(), "fit")


def test_the_trainer_free_publisher_publishes_to_a_bucket_and_a_rejection_leaves_it_as_it_was(s3):
    # CheckpointPublisher over object storage: the same DirectWriter as the callback's (one upload publishes a whole
    # object), the agreement first
    from lightning_ckguard import CheckpointPublisher, GradientGuard

    url = f"s3://{s3.new_bucket()}/run"
    model = torch.nn.Linear(2, 1)
    guard = GradientGuard(model)
    publisher = CheckpointPublisher(None, url, guard=guard)
    model(torch.ones(1, 2)).sum().backward()
    guard.record()
    publisher.save("step=1.ckpt", {"model": model, "step": 1})
    with fsspec.open(f"{url}/step=1.ckpt", "rb") as f:
        loaded = torch.load(io.BytesIO(f.read()), weights_only=True)
    assert loaded["step"] == 1 and torch.equal(loaded["model"]["weight"], model.weight.detach())
    before = s3.listing(url)
    assert set(before) == {"step=1.ckpt"}, "nothing but the checkpoint: no staging object on object storage"
    model.weight.grad[0, 0] = float("nan")
    guard.record()
    with pytest.raises(NonFiniteGradientError):
        publisher.save("step=2.ckpt", {"model": model, "step": 2})
    assert s3.listing(url) == before
