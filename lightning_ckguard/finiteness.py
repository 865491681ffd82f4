"""Exact, device-side, per-tensor finiteness of gradients.

Each tensor is read once with a reduction that cannot overflow (min/max, or the max-norm), so a large finite gradient
such as ``1e30`` is never mistaken for an overflow, and ``NaN``, ``+inf`` and ``-inf`` are always caught. A 2-norm is
not used on purpose: its squares overflow in fp32 above roughly ``1e19``.

Nothing here reads a value back to the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor


class IndexTensors:
    """Device index tensors for lists of positions, cached so a steady training loop copies nothing per step."""

    MAX_LAYOUTS = 256  # bounded: which parameters have gradients can vary per step (e.g. MoE experts)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cache: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, positions: Sequence[int]) -> Tensor:
        key = tuple(positions)
        index = self._cache.get(key)
        if index is None:
            if len(self._cache) >= self.MAX_LAYOUTS:
                self._cache.clear()
            index = self._cache[key] = torch.tensor(key, dtype=torch.int64, device=self.device)
        return index


def _dense_values(grad: Tensor) -> Tensor:
    if grad.is_sparse:
        # coalescing sums duplicate indices, as the optimizer will, so an overflow of the sum is caught too
        grad = grad.coalesce().values()
    if grad.is_complex():
        grad = torch.view_as_real(grad)
    return grad


def _extremes_finite(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Per-tensor flag: every element is finite. One read-only pass per tensor, no temporaries of gradient size."""
    if device.type == "cpu":
        # CPU: a single fused min/max pass is the cheapest exact reduction
        extremes = [torch.aminmax(t) for t in tensors]
        mins = torch.stack([e.min for e in extremes])
        maxs = torch.stack([e.max for e in extremes])
        return torch.isfinite(mins) & torch.isfinite(maxs)
    # accelerators: one fused multi-tensor launch; the max-norm is max(|x|) and propagates NaN
    norms = torch._foreach_norm(list(tensors), ord=float("inf"))
    return torch.isfinite(torch.stack(norms))


class NonFiniteCheck:
    """Computes, per gradient tensor, whether it holds a NaN or an infinity.

    Gradients may live on several devices and in several dtypes; they are grouped so that each group is one batched
    reduction. Index tensors for the grouping are cached, so a steady training loop allocates nothing on the host.
    """

    def __init__(self) -> None:
        self._indices: dict[torch.device, IndexTensors] = {}

    def __call__(self, grads: Sequence[Tensor], out_device: torch.device) -> Tensor:
        """Return a bool tensor on ``out_device``: ``flags[i]`` is True when ``grads[i]`` is not finite."""
        values = [_dense_values(g) for g in grads]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
        for i, value in enumerate(values):
            if value.numel() > 0:
                groups[(value.device, value.dtype)].append(i)
        if len(groups) == 1:
            ((device, _), positions), = groups.items()
            if len(positions) == len(values):
                return ~_extremes_finite(values, device).to(out_device, non_blocking=True)
        flags = torch.zeros(len(values), dtype=torch.bool, device=out_device)
        for (device, _), positions in groups.items():
            finite = _extremes_finite([values[i] for i in positions], device)
            flags.index_copy_(0, self._index(out_device, positions), ~finite.to(out_device, non_blocking=True))
        return flags

    def _index(self, device: torch.device, positions: list[int]) -> Tensor:
        indices = self._indices.get(device)
        if indices is None:
            indices = self._indices[device] = IndexTensors(device)
        return indices(positions)
