"""Finiteness and the sum of squares of a step's gradients, for a spike gate: in one pass where one pass serves both.

- **Accelerators**, gradients in fp32, bf16 or fp16: one fused multi-tensor 2-norm per device accumulated in
  float64 (``_foreach_norm(dtype=float64)``). Its squares cannot overflow: the largest fp32 value squared is about
  ``1.2e77``, and float64 holds sums of ``1e231`` of those. So a norm is finite exactly when its tensor is, and the
  same pass gives the exact per-tensor finiteness flags and the sum of squares.
- **Everything else** (CPU, fp64 gradients): the finiteness flags come from :class:`NonFiniteCheck`, exact as ever,
  and the sum of squares from a second pass in the gradients' own precision (fp16 in fp32): one BLAS dot per large
  fp32 or fp64 tensor, a fused ``_foreach_norm`` for the rest. A float64 norm costs several times more on a CPU (7x
  the whole record at 2 threads, ``benchmarks/spike_gate.py``), an fp32 one over bf16 gradients 70x; a bf16 norm is
  rounded to bf16, a relative error of at most ``2**-8`` in the squares. A tensor whose squares overflow that
  precision (an fp32 gradient whose norm is above about ``1.8e19``) has a sum of squares of ``inf`` although it is
  finite: it is not flagged (the flags are exact), and a spike gate sees a value above every baseline, which it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_ckguard.record.finiteness import IndexTensors, NonFiniteCheck, _dense_values

# dtypes whose float64 2-norm cannot overflow, so that its finiteness is the tensor's
_ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FlagsAndSquares:
    """Per step: a bool tensor of per-gradient non-finite flags (as :class:`NonFiniteCheck` gives them) and the sum
    of squares of the finite gradients, a 0-d float64 tensor; both on ``out_device``, nothing read to the host."""

    def __init__(self, check: NonFiniteCheck | None = None) -> None:
        self._check = check if check is not None else NonFiniteCheck()
        self._indices: dict[torch.device, IndexTensors] = {}

    def __call__(self, grads: Sequence[Tensor], out_device: torch.device) -> tuple[Tensor, Tensor]:
        values = [_dense_values(g) if g.layout != torch.strided or g.is_complex() else g for g in grads]
        if _one_pass(values):
            with torch.no_grad():
                norms = torch.stack(torch._foreach_norm(values, 2, dtype=torch.float64))
            flags = norms.mul(0).ne(0)  # ~isfinite, as NonFiniteCheck computes it
            squares = torch.where(flags, 0.0, norms.square()).sum()
            return flags.to(out_device, non_blocking=True), squares.to(out_device, non_blocking=True)
        flags = self._check(grads, out_device)
        indices = self._indices.setdefault(out_device, IndexTensors(out_device))
        return flags, _squares_in_own_precision(values, flags, out_device, indices)


def _one_pass(values: Sequence[Tensor]) -> bool:
    if not values:
        return False
    device = values[0].device
    return device.type != "cpu" and all(v.device == device and v.dtype in _ONE_PASS_DTYPES for v in values)


#: CPU tensors of these dtypes and more elements than this have their squares summed by one BLAS dot each: about
#: 1.1-1.35x a plain ``sum`` at 2 threads, where a fused ``_foreach_norm`` takes about 2x (``benchmarks/spike_gate.py``)
_DOT_DTYPES = (torch.float32, torch.float64)
DOT_NUMEL = 1 << 12


def _squares_in_own_precision(values: Sequence[Tensor], flags: Tensor, out_device: torch.device,
                              indices: IndexTensors) -> Tensor:
    """The sum of squares of the finite ``values``, each tensor's in its own precision (fp16 in fp32): a BLAS dot for
    a large contiguous CPU tensor, a fused norm per (device, dtype) for the rest."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=out_device)
    dots: list[int] = []
    by_group: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, value in enumerate(values):
        if value.device.type == "cpu" and value.dtype in _DOT_DTYPES and value.numel() > DOT_NUMEL and (
                value.is_contiguous()):
            dots.append(i)
        else:
            by_group.setdefault((value.device, value.dtype), []).append(i)
    squares = torch.empty(len(values), dtype=torch.float64, device=out_device)
    with torch.no_grad():
        if dots:
            flat = [values[i].view(-1) for i in dots]
            part = torch.stack([torch.dot(v, v) for v in flat]).to(out_device, torch.float64, non_blocking=True)
            squares.index_copy_(0, indices(dots), part)
        for (_, dtype), members in by_group.items():
            squares.index_copy_(0, indices(members), _group_squares([values[i] for i in members], dtype, out_device))
    return torch.where(flags, 0.0, squares).sum()


def _group_squares(values: Sequence[Tensor], dtype: torch.dtype, out_device: torch.device) -> Tensor:
    precision = torch.float32 if dtype == torch.float16 else None
    norms = torch._foreach_norm(list(values), 2, dtype=precision)
    return torch.stack(norms).to(out_device, torch.float64, non_blocking=True).square()


__all__ = ["FlagsAndSquares"]
