"""Finiteness and the sum of squares of a step's gradients, for a spike gate: in one pass where one pass serves both.

- **Accelerators**, gradients in fp32, bf16 or fp16: one fused multi-tensor 2-norm per device accumulated in
  float64 (``_foreach_norm(dtype=float64)``). Its squares cannot overflow: the largest fp32 value squared is about
  ``1.2e77``, and float64 holds sums of ``1e231`` of those. So a norm is finite exactly when its tensor is, and the
  same pass gives the exact per-tensor finiteness flags and the sum of squares.
- **Everything else** (CPU, fp64 gradients): the finiteness flags come from :class:`NonFiniteCheck`, exact as ever. The
  fp32 and fp64 gradients it reads by the probe in pieces (the large fp32 ones) or by ``aminmax`` give their squares
  too: a BLAS dot of each piece or tensor right after its exact read, which finds it in the core's cache; so do the
  small ones it stacks and probes in batches, from the stacked copy (:meth:`NonFiniteCheck.read`). The other gradients'
  squares (fp16 and bf16 ones read by ``aminmax``, ones that no permutation makes contiguous) take a pass of their own,
  in their own precision (fp16 in fp32): a BLAS dot per fp32 or fp64 contiguous tensor above :data:`DOT_NUMEL` elements,
  a dot per piece made fp32 of an fp16 one, a fused ``_foreach_norm`` for the rest, accumulated in float64 for CPU fp32
  and fp16 ones above that size (an fp32 sum over a strided 4M-element tensor drifts by 1e-3). A sparse gradient is
  coalesced once per step, by the flags' read. A float64 norm of every gradient would cost several times more on a CPU
  (7x the whole record at 2 threads, ``benchmarks/spike_gate.py``), an fp32 one over bf16 gradients 70x; a bf16 norm is
  rounded to bf16 (a relative error of at most ``2**-8`` in the norm), then squared in float64. A tensor whose squares
  overflow that precision (an fp32 gradient or piece whose norm is above about ``1.8e19``) has a sum of squares of
  ``inf`` although it is finite: it is not flagged (the flags are exact), and a spike gate sees a value above every
  baseline, which it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_ckguard.record.finiteness import PIECE_NUMEL, WIDE_DTYPES, NonFiniteCheck, _dense_values

# dtypes whose float64 2-norm cannot overflow, so that its finiteness is the tensor's (complex ones: of their real
# and imaginary parts, read as a real tensor)
_ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.complex64, torch.complex32)


@dataclass(frozen=True)
class SquaresLayout:
    """How one rank's sum of squares of the gradients it read adds up to the global one, over the ranks.

    Attributes:
        sharded: This rank alone applies these gradients (a ZeRO partition, an FSDP shard): the ranks' sums add up as
            they are. Otherwise every rank holds the same whole gradients (DDP), which count once.
        scale: What the gradients are still multiplied by (a loss scale the optimizer divides out in its step),
            divided out of their squares.
        replicas: Per gradient read, how many ranks hold the same shard of it (HSDP's replicate dimension, a
            parameter replicated over tensor-parallel ranks), so that its squares count once; None: each one rank.
    """

    sharded: bool = False
    scale: float | Tensor = 1.0
    replicas: tuple[int, ...] | None = None


#: gradients every rank holds alike, as DDP's, carrying no loss scale
REPLICATED = SquaresLayout()


class FlagsAndSquares:
    """Per step: a bool tensor of per-gradient non-finite flags (as :class:`NonFiniteCheck` gives them) and the sum
    of squares of the gradients, a 0-d float64 tensor (not finite when a flag is set: a spike gate leaves such a step
    to the finiteness check); both on ``out_device``, nothing read to the host."""

    def __init__(self, check: NonFiniteCheck | None = None) -> None:
        self._check = check if check is not None else NonFiniteCheck()

    def __call__(self, grads: Sequence[Tensor], out_device: torch.device,
                 replicas: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """``replicas``: per gradient, how many ranks hold the same one (:attr:`SquaresLayout.replicas`); its squares
        are divided by that count."""
        weights = [1.0 / count for count in replicas] if replicas is not None else None
        if _one_pass(grads):
            with torch.no_grad():
                norm_list = torch._foreach_norm([_dense_values(g) for g in grads], 2, dtype=torch.float64)
                norms = torch.stack(norm_list)
                flags = norms.mul(0).ne(0)  # ~isfinite, as NonFiniteCheck computes it
                # not finite with any flag set: the step is the finiteness check's, and a spike gate skips it
                squares = norms.square().sum() if weights is None else _summed(
                    list(torch._foreach_mul(norm_list, norm_list)), weights, out_device)
            return flags.to(out_device, non_blocking=True), squares.to(out_device, non_blocking=True)
        read: list[Tensor] = []  # what the read made of them: a sparse gradient is coalesced once per step
        flags, taken = self._check.read(grads, out_device, squares=True, converted=read)
        rest = range(len(grads)) if taken is None else taken.rest
        rest_values = [read[i] for i in rest]
        rest_weights = None if weights is None else [weights[i] for i in rest]
        if taken is None:
            return flags, _squares_in_own_precision(rest_values, out_device, rest_weights)
        squares = (taken.total() if weights is None else _summed(
            list(taken.each().unbind()), [weights[i] for i in taken.positions], torch.device("cpu")))
        if not rest_values:
            return flags, squares.to(out_device, non_blocking=True)
        return flags, squares.to(out_device, non_blocking=True) + _squares_in_own_precision(
            rest_values, out_device, rest_weights)


class FlagsWithoutSquares:
    """What :class:`FlagsAndSquares` gives when nothing needs the squares (no spike gate, or one that watches only the
    loss): :class:`NonFiniteCheck`'s flags, and a constant zero for the squares (no kernel, no read)."""

    def __init__(self, check: NonFiniteCheck, zero: Tensor) -> None:
        self._check, self._zero = check, zero

    def __call__(self, grads: Sequence[Tensor], out_device: torch.device,
                 replicas: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        return self._check(grads, out_device), self._zero


def _one_pass(grads: Sequence[Tensor]) -> bool:
    if not grads:
        return False
    device = grads[0].device
    return device.type != "cpu" and all(g.device == device and g.dtype in _ONE_PASS_DTYPES for g in grads)


#: CPU tensors of :data:`~lightning_ckguard.record.finiteness.WIDE_DTYPES` and more elements than this have their
#: squares summed by one BLAS dot each: about 1.1-1.35x a plain ``sum`` at 2 threads, where a fused ``_foreach_norm``
#: takes about 2x (``benchmarks/spike_gate.py``)
DOT_NUMEL = 1 << 12
#: CPU tensors of these dtypes and more elements than :data:`DOT_NUMEL` are summed in pieces made fp32, a dot each:
#: their float64 norm (the only one that neither overflows nor drifts over millions of elements) costs 15-30x a plain
#: ``sum`` of them, the pieces about 3x.
_PIECE_DOT_DTYPES = (torch.float16,)


def _squares_in_own_precision(values: Sequence[Tensor], out_device: torch.device,
                              weights: Sequence[float] | None = None) -> Tensor:
    """The sum of squares of ``values``, each tensor's in its own precision (fp16 in fp32) and times its weight (all 1
    without ``weights``), summed in float64. A large contiguous CPU tensor: a BLAS dot (fp32, fp64), or a dot of each
    piece of :data:`~lightning_ckguard.record.finiteness.PIECE_NUMEL` elements made fp32 (fp16: one piece-sized
    temporary at a time). The rest: a fused norm per (device, dtype, precision), whose norms are stacked and squared
    in float64 at once, so that 10,000 small gradients cost a few kernels, not a tensor each. Then one weighting
    (only with ``weights``) and one reduction."""
    dots: list[Tensor] = []  # a tensor's sum of squares each, 0-d
    blocks: list[Tensor] = []  # a group's squares, 1-d float64
    order: list[int] = []  # the position in ``values`` of each entry of ``dots``, then of ``blocks``
    block_order: list[int] = []
    by_group: dict[tuple[torch.device, torch.dtype, torch.dtype | None], list[tuple[int, Tensor]]] = {}
    with torch.no_grad():
        for position, value in enumerate(values):
            large_on_cpu = value.device.type == "cpu" and value.numel() > DOT_NUMEL and value.is_contiguous()
            if large_on_cpu and value.dtype in WIDE_DTYPES:
                flat = value.view(-1)
                dots.append(torch.dot(flat, flat))
            elif large_on_cpu and value.dtype in _PIECE_DOT_DTYPES:
                dots.append(_piece_dots(value))
            else:
                by_group.setdefault((value.device, value.dtype, _norm_precision(value)), []).append((position, value))
                continue
            order.append(position)
        for (_, _, precision), group in by_group.items():
            norms = torch.stack(torch._foreach_norm([v for _, v in group], 2, dtype=precision)).to(torch.float64)
            blocks.append(norms.mul(norms).to(out_device, non_blocking=True))  # bf16 norms: rounded once, not twice
            block_order += [position for position, _ in group]
        parts = ([torch.stack(dots).to(out_device, torch.float64, non_blocking=True)] if dots else []) + blocks
        if not parts:
            return torch.zeros((), dtype=torch.float64, device=out_device)
        squares = torch.cat(parts) if len(parts) > 1 else parts[0]
        if weights is None:
            return squares.sum()
        return _summed(list(squares.unbind()), [weights[position] for position in order + block_order], out_device)


def _piece_dots(value: Tensor) -> Tensor:
    """The sum of squares of a contiguous fp16 CPU tensor: a dot of each piece made fp32 (an fp16 value's square is at
    most ``4.3e9``, a piece's sum of them ``1.2e15``: nothing overflows), summed in float64. An fp32 sum over a piece
    drifts by up to about ``3e-5`` relative on near-constant values (as the large fp32 gradients' piece dots do),
    far inside a spike gate's thresholds."""
    dots = []
    for piece in value.view(-1).split(PIECE_NUMEL):
        wide = piece.to(torch.float32)
        dots.append(torch.dot(wide, wide))
    return torch.stack(dots).sum(dtype=torch.float64)


def _norm_precision(value: Tensor) -> torch.dtype | None:
    """What a norm of ``value`` accumulates in (None: its own dtype). On a CPU, fp32 and fp16 tensors too large for
    short sums (non-contiguous ones: no dot takes them) in float64: an fp32 sum over a strided or expanded tensor of
    4M elements drifts by 1e-3 (``tests/agree/test_spike_judgement.py``); small fp16 ones in fp32."""
    if value.device.type == "cpu" and value.dtype in (torch.float32, torch.float16) and value.numel() > DOT_NUMEL:
        return torch.float64
    return torch.float32 if value.dtype == torch.float16 else None


def _summed(squares: list[Tensor], weights: Sequence[float] | None, out_device: torch.device) -> Tensor:
    """``sum(weights[i] * squares[i])`` in float64 on ``out_device`` (all weights 1 without ``weights``); the weights
    go to one fused multiply as scalars, so no host tensor is made."""
    if weights is not None:
        torch._foreach_mul_(squares, list(weights))
    if any(square.device != out_device for square in squares):
        squares = [square.to(out_device, non_blocking=True) for square in squares]
    # stack promotes to the widest dtype; the sum accumulates in float64
    return torch.stack(squares).sum(dtype=torch.float64)


__all__ = ["REPLICATED", "FlagsAndSquares", "FlagsWithoutSquares", "SquaresLayout"]
