import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
from packaging.version import Version

TESTS = os.path.dirname(os.path.abspath(__file__))

# read from the metadata: importing the top-level `lightning` package here would change its loggers' setup
LIGHTNING_2_5 = Version(importlib.metadata.version("lightning")) < Version("2.6")
#: Lightning 2.5's ModelCheckpoint writes `last` at every validation end with `save_last=True`; 2.6 only where it
#: also saved a top-K file. Tests that count writes or agreements say which one they expect.
LAST_AT_EVERY_BOUNDARY = LIGHTNING_2_5


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed tests cannot run here, or None when DeepSpeed is installed."""
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install --no-build-isolation deepspeed): the DeepSpeed tests need it"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a worker script whose rank 0 launches the other ranks (Lightning's subprocess launcher).

    ``script`` is a path relative to ``tests/`` (e.g. ``workers/ddp_worker.py``) or absolute. The ranks run in a
    session of their own, which is killed whole on the wall-clock ``timeout``, so a deadlock fails the test instead
    of hanging CI; it is killed too when the wait is interrupted (pytest-timeout, Ctrl-C), so no rank outlives its
    test and keeps the CPUs busy under the next one.
    """
    _require_multiprocess_marker(script)
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    # a worker builds from lightning.pytorch unless its test asks otherwise (tests/lightning_namespace.py)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "CKGUARD_TEST_LIGHTNING"):
        full_env.pop(key, None)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {timeout} s (deadlock?). Output tail:\n{out[-4000:]}")
    except BaseException:
        _kill_session(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the session ``proc`` leads (rank 0, the ranks it launched, their children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every one of them has exited already
        pass


def read_rank_results(out: Any, proc: subprocess.CompletedProcess, world_size: int = 2,
                      prefix: str = "") -> list[dict[str, Any]]:
    """The JSON each rank of a worker run wrote to ``out/{prefix}rank{N}.json``; fails with the output tail."""
    results = []
    for rank in range(world_size):
        path = os.path.join(out, f"{prefix}rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no results (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
        with open(path) as f:
            results.append(json.load(f))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return results


# The lanes: `multiprocess` marks every test that starts more than one process (each module or test says so
# itself; `run_ranks` refuses to launch for an unmarked test, so none can slip into the fast lane), `deepspeed` every
# test that needs DeepSpeed (parametrized ones from the module's `DEEPSPEED_PARAMETERS`).
_running_test: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: a module fixture's launch belongs to this test
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _running_test
    _running_test = item


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        deepspeed_parameters = getattr(getattr(item, "module", None), "DEEPSPEED_PARAMETERS", ())
        callspec = getattr(item, "callspec", None)
        if callspec is not None and set(map(str, callspec.params.values())) & set(deepspeed_parameters):
            item.add_marker(pytest.mark.deepspeed)


def _require_multiprocess_marker(script: str) -> None:
    if _running_test is not None and _running_test.get_closest_marker("multiprocess") is None:
        pytest.fail(f"{_running_test.nodeid} launches {script} but is not marked `multiprocess`: mark it "
                    "(`pytestmark = pytest.mark.multiprocess`), so that the fast lane starts no processes")


@pytest.fixture(scope="session")
def s3() -> Any:
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, for the whole session; ``os.environ`` points
    fsspec/s3fs at it (``FSSPEC_S3_ENDPOINT_URL``, fake credentials), and so do the workers a test launches."""
    from s3_server import S3Server, environment, missing

    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    server = S3Server(free_port())
    try:
        with environment(server.env()):
            yield server
    finally:
        server.stop()
