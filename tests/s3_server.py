"""A real S3-compatible HTTP server for the object-storage tests: moto's server mode, run as a subprocess on
127.0.0.1 with a free port, reached by s3fs through ``FSSPEC_S3_ENDPOINT_URL`` with fake credentials.

Nothing is patched: the callback, Lightning and s3fs talk HTTP to the server exactly as they would to S3. The tests
observe the bucket through boto3 (keys, ETags, sizes), as a user would with ``aws s3 ls``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from typing import Any

REGION = "us-east-1"
#: The server refuses every multipart upload: its minimum part size is above the 50 MiB parts s3fs sends, so it answers
#: the upload's completion with ``EntityTooSmall`` (as an S3-compatible store with other limits would). s3fs uploads a
#: checkpoint of :data:`REFUSED_UPLOAD_BYTES` or more that way; smaller ones go in one ``PUT``, which it accepts.
MIN_PART_SIZE = 64 * 2**20
REFUSED_UPLOAD_BYTES = 101 * 2**20
#: fake credentials: moto's server accepts any
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


def missing() -> str | None:
    """Why the object-storage tests cannot run here, or None."""
    import importlib.util

    for module, package in (("moto", "moto[server]"), ("flask", "moto[server]"), ("s3fs", "s3fs"), ("boto3", "boto3")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install -e '.[test]'): the object-storage tests need it"
    return None


class S3Server:
    """``python -m moto.server`` on 127.0.0.1:``port``, in a process session of its own."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self._buckets = count()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART_SIZE)},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through fsspec/s3fs and boto3."""
        return {"FSSPEC_S3_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": REGION, **CREDENTIALS,
                "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def new_bucket(self, name: str = "ckguard") -> str:
        """Create a new, empty bucket; returns its name."""
        bucket = f"{name}-{next(self._buckets)}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def pending_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads begun and neither completed nor aborted."""
        return [upload["Key"] for upload in self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]

    def listing(self, url: str) -> dict[str, tuple[str, int]]:
        """Every object under ``url`` (``s3://bucket/prefix``): key relative to the prefix -> (ETag, size)."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        objects: dict[str, tuple[str, int]] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for entry in page.get("Contents", []):
                objects[entry["Key"][len(prefix):]] = (entry["ETag"], entry["Size"])
        return objects

    @contextmanager
    def not_answering(self) -> Iterator[None]:
        """The server stops answering (its process is stopped; connections are accepted by the kernel and hang) and
        answers again, with everything it stored, when the block ends."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (restored afterwards), and have fsspec read its ``FSSPEC_*`` settings again:
    it reads them once, at import."""
    import fsspec.config

    saved = {key: os.environ.get(key) for key in values}
    saved_conf = {key: dict(value) for key, value in fsspec.config.conf.items()}
    os.environ.update(values)
    fsspec.config.set_conf_env(fsspec.config.conf)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved_conf)


def ballast_for_a_refused_upload() -> Any:
    """A tensor that makes a checkpoint big enough for s3fs to upload it in parts, which this server refuses."""
    import torch

    return torch.zeros(REFUSED_UPLOAD_BYTES // 4, dtype=torch.float32)
