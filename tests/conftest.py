import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


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
    # ``script`` is a path relative to tests/ (e.g. ``workers/ddp_scenarios.py``) or absolute
    """Run a worker script whose rank 0 launches the other ranks (Lightning's subprocess launcher).

    The whole process group is killed on timeout, so a deadlock fails the test instead of hanging CI.
    """
    full_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
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
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{script} did not finish within {timeout} s (deadlock?). Output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


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
