import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
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

    A test module calls it directly only for a script whose output is its result (the examples); every worker under
    ``workers/`` is launched through ``worker_results``, which calls this (``tests/docs/test_test_layout.py`` checks).
    """
    _require_multiprocess_marker(script)
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1"}  # a hang killed on the timeout prints every rank's Python stacks
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
        out = _dump_stacks_and_kill_session(proc)
        pytest.fail(f"{script} did not finish within {timeout} s (deadlock?). Output tail:\n{out[-4000:]}")
    except BaseException:
        _kill_session(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def _dump_stacks_and_kill_session(proc: subprocess.Popen) -> str:
    """SIGABRT the session first: each Python process's faulthandler (``PYTHONFAULTHANDLER``) prints where every
    thread of it waits, so a deadlock's output says where it is; then SIGKILL whatever is left. Returns the output."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_session(proc)  # any process the abort left, and whichever still holds the output pipe
    out, _ = proc.communicate()  # everything printed since the launch, the stacks included
    return out


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the session ``proc`` leads (rank 0, the ranks it launched, their children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every one of them has exited already
        pass


#: In the arguments (and string environment values) of a ``worker_results`` launch: the launch's own output directory.
OUT = "{out}"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One worker launch, as ``worker_results`` returns it."""

    #: the launch's own output directory (a fresh ``tmp_path_factory`` directory); ``output.txt`` holds its output
    out: Path
    #: the JSON each rank wrote to ``out/{prefix}rank{N}.json``, in rank order; ``None`` for a rank that wrote none
    #: (only with ``check=False``: otherwise a missing file fails the test)
    ranks: list[Any]
    returncode: int
    #: every rank's stdout and stderr, interleaved
    stdout: str


#: a value of ``env``: a string (``OUT`` in it replaced), or a function of the output directory that returns one, or
#: ``None`` to leave the variable as the test process has it (a function may also skip the test)
EnvValue = str | Callable[[str], "str | None"]


class WorkerResults:
    """The one way tests launch a worker script and read what its ranks wrote; the ``worker_results`` fixture.

    ``worker_results(script, args, timeout=...)`` runs ``script`` (relative to ``tests/``, e.g.
    ``workers/ddp_worker.py``) through ``run_ranks`` with ``OUT`` in ``args`` replaced by a fresh output directory,
    and returns its ``Launch``: by default every rank must have written ``{prefix}rank{N}.json`` and the launch must
    have exited 0, or the test fails with the output's tail; when rank 0 wrote ``{"unavailable": reason}`` (a
    strategy this machine cannot run), the test skips. ``check=False`` returns whatever the ranks left (a crash test
    kills some of them).

    Each launch runs once per session: a second call with the same script, arguments, environment, ``world_size``,
    ``prefix`` and ``check`` returns the first one's ``Launch``, or fails (skips) at once as the first one did,
    instead of launching again. A module's tests therefore share one launch per scenario set however they are
    parametrized, from a module fixture or a ``results_for(kind, worker_results)`` function alike.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._launches: dict[tuple[Any, ...], Launch | tuple[str, str]] = {}

    def __call__(self, script: str, args: list[str], *, timeout: float, env: dict[str, EnvValue] | None = None,
                 world_size: int = 2, prefix: str = "", check: bool = True) -> Launch:
        env = env or {}
        key = (script, tuple(args), tuple(sorted(env.items(), key=lambda item: item[0])), world_size, prefix, check)
        if key not in self._launches:
            try:
                self._launches[key] = self._launch(script, args, timeout, env, world_size, prefix, check)
            except pytest.skip.Exception as skipped:
                self._launches[key] = ("skip", str(skipped.msg))
                raise
            except (AssertionError, pytest.fail.Exception) as failed:
                self._launches[key] = ("fail", str(failed))
                raise
        launch = self._launches[key]
        if isinstance(launch, tuple):  # the first call's outcome, without launching again
            outcome, message = launch
            if outcome == "skip":
                pytest.skip(message)
            pytest.fail(f"the earlier launch of {script} {args} failed: {message[:4000]}")
        return launch

    def _launch(self, script: str, args: list[str], timeout: float, env: dict[str, EnvValue], world_size: int,
                prefix: str, check: bool) -> Launch:
        out = self._tmp_path_factory.mktemp(Path(script).stem)
        resolved = {name: value(str(out)) if callable(value) else value.replace(OUT, str(out))
                    for name, value in env.items()}
        proc = run_ranks(script, [arg.replace(OUT, str(out)) for arg in args], timeout=timeout,
                         env={name: value for name, value in resolved.items() if value is not None})
        (out / "output.txt").write_text(proc.stdout)  # every rank's output, for a scenario that failed unexpectedly
        ranks: list[Any] = []
        for rank in range(world_size):
            path = out / f"{prefix}rank{rank}.json"
            if not path.exists():
                assert not check, f"rank {rank} wrote no results (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                ranks.append(None)
                continue
            ranks.append(json.loads(path.read_text()))
            if check and rank == 0 and isinstance(ranks[0], dict) and ranks[0].get("unavailable"):
                pytest.skip(ranks[0]["unavailable"])
        if check:
            assert proc.returncode == 0, proc.stdout[-4000:]
        return Launch(out, ranks, proc.returncode, proc.stdout)


@pytest.fixture(scope="session")
def worker_results(tmp_path_factory: pytest.TempPathFactory) -> WorkerResults:
    """Launch a worker once per session and read every rank's results: see ``WorkerResults``."""
    return WorkerResults(tmp_path_factory)


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


@pytest.fixture(params=[True, False], ids=["exchange", "two-renames"])
def exchange(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Directories replace one another by ``renameat2(RENAME_EXCHANGE)`` (skipped where ``tmp_path``'s filesystem
    has none), or, as on NFS and off Linux, by two renames: the test runs once each way."""
    import lightning_ckguard.publish.staging as staging_module

    if not request.param:
        monkeypatch.setattr(staging_module, "supports_exchange", lambda directory: False)
    elif not staging_module.supports_exchange(str(tmp_path)):
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    return request.param
