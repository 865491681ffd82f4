"""Two-rank CPU/gloo scenarios against a real S3-compatible server, run by
``tests/publish/test_object_storage_ddp.py`` as ``python object_storage_ddp_worker.py OUT_DIR BUCKET``; the server's
address and fake credentials come from the environment (``FSSPEC_S3_ENDPOINT_URL``, ``AWS_*``), its process id from
``CKGUARD_TEST_S3_PID``.

Every rank runs every scenario in order, in one process group, and writes what it observed to ``OUT_DIR/rank{N}.json``.
Only rank 0 touches the bucket under DDP (it writes, evicts, and looks for existing names), so only rank 0 lists it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from s3_server import ballast_for_a_refused_upload, environment  # noqa: E402
from strategies import make_strategy  # noqa: E402

from helpers import QUIET, FaultyModel, fit_outcome, ledger_state, run_scenarios  # noqa: E402
from lightning_ckguard import FiniteGradCheckpoint  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
TIMEOUT = timedelta(seconds=60)
RANK = int(os.environ.get("LOCAL_RANK", "0"))
# each request times out after 0.25 s (s3fs tries 5 times), well within the strategy's collective timeout
IMPATIENT_S3FS = {"FSSPEC_S3": json.dumps({"config_kwargs": {
    "connect_timeout": 0.25, "read_timeout": 0.25, "retries": {"max_attempts": 1, "mode": "standard"}}})}


def listing(url: str) -> dict[str, Any]:
    """Rank 0's view of the objects under ``url``: key -> [ETag, size]."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=os.environ["FSSPEC_S3_ENDPOINT_URL"])
    try:
        contents = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    except client.exceptions.NoSuchBucket:
        return {"<no bucket>": True}
    return {entry["Key"][len(prefix) + 1:]: [entry["ETag"], entry["Size"]] for entry in contents}


class Observe(Callback):
    """At the start of optimizer step ``step``: the ledger on every rank, the bucket on rank 0. When ``stop_server``,
    rank 0 makes the server stop answering after that step (until the scenario ends); with ``refuse``, the checkpoint
    of the step after it is one the server refuses (``s3_server.MIN_PART_SIZE``)."""

    def __init__(self, url: str, step: int, stop_server: bool = False, refuse: bool = False) -> None:
        self.url, self.step, self.stop_server, self.refuse = url, step, stop_server, refuse
        self.before: dict[str, Any] = {}
        self.stopped = False

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and not self.before:
            self.before = {"state": ledger_state(trainer.checkpoint_callback),
                           "bucket": listing(self.url) if RANK == 0 else None}

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self.stop_server and RANK == 0 and trainer.global_step == self.step + 1 and not self.stopped:
            os.kill(int(os.environ["CKGUARD_TEST_S3_PID"]), signal.SIGSTOP)
            self.stopped = True

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.refuse and trainer.global_step == self.step + 1:
            checkpoint["ballast"] = ballast_for_a_refused_upload()

    def answer_again(self) -> None:
        if self.stopped:
            os.kill(int(os.environ["CKGUARD_TEST_S3_PID"]), signal.SIGCONT)
            self.stopped = False


def _fit(url: str, model: FaultyModel, observe: Observe | None = None, ckpt_path: str | None = None,
         **callback_kwargs: Any) -> dict[str, Any]:
    callback = FiniteGradCheckpoint(dirpath=url, **callback_kwargs)
    trainer = Trainer(strategy=make_strategy("ddp", timeout=TIMEOUT), devices=2, max_steps=8, limit_val_batches=0,
                      callbacks=[callback, *([observe] if observe else [])], **QUIET)
    try:
        result = fit_outcome(lambda: trainer.fit(model, ckpt_path=ckpt_path), write_errors=True)
    finally:
        if observe is not None:
            observe.answer_again()
    trainer.strategy.barrier()
    result.update(state=ledger_state(callback), global_step=trainer.global_step,
                  ckpt_path=None if trainer.ckpt_path is None else str(trainer.ckpt_path),
                  before=observe.before if observe else None, bucket=listing(url) if RANK == 0 else None)
    return result


ARGS = dict(every_n_train_steps=2, save_top_k=1, save_last=True)


def nan_then_resume_last(root: str, bucket: str) -> dict[str, Any]:
    """A NaN on rank 1 at step 5 rejects the boundary at step 6 on every rank; then a new fit with
    ``ckpt_path="last"`` resumes from the checkpoint of step 4."""
    url = f"s3://{bucket}/nan"
    seed_everything(7)
    rejected = _fit(url, FaultyModel(fault_steps=(5,), fault_ranks=(1,)), Observe(url, 5), **ARGS)
    seed_everything(7)
    resumed = _fit(url, FaultyModel(), ckpt_path="last", **ARGS)
    return {"rejected": rejected, "resumed": resumed}


def refused_upload(root: str, bucket: str) -> dict[str, Any]:
    """The server refuses the upload of step 6's checkpoint (which would evict step 4's)."""
    url = f"s3://{bucket}/refused"
    seed_everything(7)
    return _fit(url, FaultyModel(), Observe(url, 5, refuse=True), **ARGS)


def server_stops_answering(root: str, bucket: str) -> dict[str, Any]:
    """After step 4's save the server stops answering; the save at step 6 (which would evict step 4's) fails."""
    url = f"s3://{bucket}/silent"
    seed_everything(7)
    with environment(IMPATIENT_S3FS):
        return _fit(url, FaultyModel(), Observe(url, 5, stop_server=True), **ARGS)


def main() -> None:
    out, bucket = sys.argv[1], sys.argv[2]
    table = {"nan-then-resume-last": nan_then_resume_last, "refused-upload": refused_upload,
             "server-stops-answering": server_stops_answering}
    run_scenarios({name: (lambda root, f=f: f(root, bucket)) for name, f in table.items()}, out, set(sys.argv[3:]))


if __name__ == "__main__":
    main()
