"""Shared helpers for the benchmarks: alternating timed runs, medians, ratio tables, the machine description.

Every benchmark measures all of its rows in one process and one run, interleaved (row A, row B, ..., row A, ...),
so that drift and noise from other processes hit every row alike; it reports medians and ratios to a named baseline
row. Nothing here is a test.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def machine() -> str:
    """One line describing where the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load:.2f} at start"
    )


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Time every function ``repeats`` times, alternating between them; returns seconds per call per row."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for repeat in range(repeats):
        # alternate the order too, so no row always runs right after the same neighbour
        for name in names if repeat % 2 == 0 else reversed(names):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def ratio_rows(times: dict[str, list[float]], baseline: str, notes: dict[str, str] | None = None) -> list[list[str]]:
    """Rows ``name, median ms, median ratio, min ms, min ratio, note``.

    On a machine shared with other jobs the minimum (best of the repeats) is the least disturbed estimate of a
    row's own cost; both are shown.
    """
    base, base_min = median(times[baseline]), min(times[baseline])
    rows = []
    for name, values in times.items():
        rows.append([name, ms(median(values)), f"{median(values) / base:.2f}x", ms(min(values)),
                     f"{min(values) / base_min:.2f}x", (notes or {}).get(name, "")])
    return rows


# ---------------------------------------------------------------------- readers compared with the guard


def floor_read(grads: Sequence[Tensor]) -> list[Tensor]:
    """The floor: one plain read of every gradient (a per-tensor ``sum``); not exact (overflows), just a read."""
    return [g.sum() for g in grads]


def previous_reader(grads: Sequence[Tensor]) -> Tensor:
    """What lightning_ckguard 0.1.0 did on CPU: ``torch.aminmax`` per tensor (exact, one pass, ~1.4x the floor)."""
    extremes = [torch.aminmax(g) for g in grads]
    mins = torch.stack([e.min for e in extremes])
    maxs = torch.stack([e.max for e in extremes])
    return ~(torch.isfinite(mins) & torch.isfinite(maxs))


def naive_reader(grads: Sequence[Tensor]) -> list[bool]:
    """The naive guard: ``torch.isfinite(g).all().item()`` per tensor (a bool temporary and a host sync each)."""
    return [bool(torch.isfinite(g).all().item()) for g in grads]


def foreach_inf_norm(grads: Sequence[Tensor]) -> Tensor:
    """``_foreach_norm(ord=inf)``: what the guard uses on accelerators; exact, but slow on CPU."""
    return ~torch.isfinite(torch.stack(torch._foreach_norm(list(grads), ord=float("inf"))))


def amp_unscale_check(grads: Sequence[Tensor]) -> Tensor:
    """GradScaler's fused ``_amp_foreach_non_finite_check_and_unscale_`` with scale 1: one flag for all tensors (no
    attribution) and it writes every gradient back."""
    found = torch.zeros(1, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(list(grads), found, torch.ones(1, device=grads[0].device))
    return found


def make_grads(num_tensors: int, total: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[Tensor]:
    """``num_tensors`` gradient-like tensors with ``total`` elements in all, as 2-D matrices where possible."""
    generator = torch.Generator().manual_seed(seed)
    per = max(1, total // num_tensors)
    grads = []
    for _ in range(num_tensors):
        cols = 1 << max(0, (per.bit_length() - 1) // 2)
        shape = (per // cols, cols) if per % cols == 0 and per >= 64 else (per,)
        grads.append(torch.randn(shape, generator=generator).to(dtype))
    return grads


def recorded_guard(nan: bool) -> tuple[torch.nn.Module, Any]:
    """A small model and a ``GradientGuard`` that recorded one step of it (with a NaN gradient if ``nan``)."""
    from lightning_ckguard import GradientGuard

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model(torch.randn(4, 64)).sum().backward()
    if nan:
        model[0].weight.grad[0, 0] = float("nan")
    guard = GradientGuard(model)
    guard.record(step=0)
    return model, guard


# ---------------------------------------------------------------------- counting host reads and collectives

#: ATen ops that copy a value to the host (a host sync on an accelerator); the same list as ``tests/helpers.py``.
HOST_READS = ("_local_scalar_dense", "is_nonzero", "nonzero", "equal", "allclose")
#: ``torch.distributed`` functions counted as collectives by :class:`CountOps`.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "barrier",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "scatter", "send", "recv", "isend", "irecv")


class CountOps:
    """Counts, while active, the ATen ops dispatched (by name; ``host_reads`` those of :data:`HOST_READS`) and the
    calls of ``torch.distributed``'s collectives (``collectives``: those patched by name, plus any ``c10d`` op seen
    by the dispatcher). A small equivalent of ``tests/helpers.CountOps``; the benchmarks do not import the tests."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.collective_calls: list[str] = []
        self._mode: Any = None
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CountOps:
        import torch.distributed as dist
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                counter.names.append(func.__name__)
                if "c10d" in getattr(func, "namespace", ""):
                    counter.collective_calls.append(func.__name__)
                return func(*args, **(kwargs or {}))

        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                counter.collective_calls.append(_name)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    @property
    def host_reads(self) -> int:
        return sum(1 for n in self.names if n.split(".")[0] in HOST_READS)

    @property
    def collectives(self) -> int:
        return len(self.collective_calls)
