"""Exact, device-side, per-tensor finiteness of gradients.

Every element of every gradient is read exactly once per step, with a reduction that cannot overflow, so a large
finite gradient such as ``1e30`` or the largest fp32 value is never mistaken for an overflow, and ``NaN``, ``+inf``
and ``-inf`` are always caught. A 2-norm is not used anywhere: its squares overflow in fp32 above roughly ``1e19``.

How a tensor is read depends on where it lives (measured in ``benchmarks/``):

- **Accelerators**: one fused multi-tensor max-norm (``_foreach_norm(ord=inf)``, i.e. ``max |x|``) per device and
  dtype. It propagates ``NaN`` and cannot overflow.
- **CPU, large tensors** (fp32, more than :data:`LARGE_NUMEL` elements): read in pieces of :data:`PIECE_NUMEL` elements
  (1 MiB), each by one exact reader. The *scaled probe* is a matrix-vector product: the piece viewed as a
  :data:`PROBE_WIDTH`-column matrix times a constant vector of ``2**-13`` (a tail shorter than a row, by a dot with it),
  one scaled sum per row. A row holds at most :data:`PROBE_ROW_LIMIT` (``2**12``) elements, so every product ``x *
  2**-13`` of a finite ``x`` is finite, and every partial sum of a row, in any order of summation, is at most half the
  dtype's largest value; an infinite ``x`` stays infinite, ``+inf + -inf`` and anything with a ``NaN`` are ``NaN``. A
  row's sum is therefore finite exactly when its elements are. Rows are never added to one another: each is turned into
  ``0`` (finite) or ``NaN`` by ``x * 0`` first, and only those are summed per tensor. The scale is no smaller than that
  on purpose: a product that falls below the smallest normal number costs a CPU a microcode assist, and a scale of
  ``2**-100`` made every gradient element under ``2**-26`` (``1.5e-8``, most of a trained model's) such a product: the
  probe of a trained MLP's largest gradient took 15x a plain ``sum`` of it (``benchmarks/RESULTS.md``, A15). Elements
  under ``2**-113`` (``1e-34``) still give such products: the state check, which reads optimizer moments that can decay
  that far, reads its large tensors by ``aminmax`` (``NonFiniteCheck(large_reader=...)``). Which is faster, this probe
  or ``aminmax`` (the exact alternative), depends on the CPU and its BLAS: with MKL on an Intel Xeon the probe runs at
  the speed of a plain ``sum`` and ``aminmax`` at 1.4-1.8x that; on an AMD EPYC with 2 threads the probe costs 1.45x and
  ``aminmax`` 1.1-1.25x. So the first step of a gradient layout measures both on its own large gradients (when they hold
  at least :data:`CALIBRATION_MIN_NUMEL` elements; fewer are too close to time, and the probe reads them) (a warm-up
  read, then three timed reads each, once: the reading plan is cached) and keeps the faster
  (:func:`cpu_large_tensor_reader`); ``CKGUARD_CPU_READER=probe`` or ``=aminmax`` fixes the choice. Both are exact, so
  the choice only changes the speed. The probe needs true fp32 matrix products: when PyTorch is allowed to compute fp32
  matmuls in bf16/tf32 (``torch.backends.mkldnn.matmul.fp32_precision`` other than ``"ieee"``, e.g.
  ``torch.set_float32_matmul_precision("medium")``), rounding the inputs could turn ``3.4e38`` into ``inf``, so the
  pieces are read by ``aminmax``. Why pieces: a spike gate also needs the sum of squares, and no CPU kernel reads a
  tensor once for both an exact flag and squares that cannot overflow. A second pass over a whole gradient finds it
  evicted by then; a BLAS dot of each piece right after its read (:meth:`NonFiniteCheck.read` with ``squares``) finds it
  in the core's cache. Inside a training step of the benchmark MLP, the squares then cost 0.4 ms instead of 1.0
  (``benchmarks/spike_gate.py``), and the flags alone cost less read in pieces than whole.
- **CPU, small tensors** (at most :data:`SMALL_NUMEL` elements, fp32/fp64; :data:`SMALL_NUMEL_16BIT`, bf16/fp16,
  whose matrix products are slower than ``aminmax`` above that): tensors of one shape, when
  there are at least :data:`SMALL_BATCH_MIN` of them, are stacked into a small, bounded workspace
  (:data:`WORKSPACE_NUMEL` elements) and probed by one matrix-vector product per chunk, with the same scaling
  argument (a row is one tensor of at most :data:`SMALL_NUMEL` elements). This replaces thousands of tiny
  per-tensor reductions by a few batched ones. With squares, each member's sum of squares comes from the stacked copy
  right after its probe, one ``vecdot`` per chunk (16-bit rows made fp32 first).
- **Everything else** (mid-size tensors, small tensors of a rare shape, large fp64/bf16/fp16 tensors, tensors that
  no permutation makes contiguous, other dtypes): ``torch.aminmax`` per tensor, one read-only pass without
  temporaries, written straight into one preallocated ``(2, n)`` buffer per group, so a model of a few large tensors
  costs its reads plus a handful of tiny kernels. With squares, a dot follows the read of each fp32 or
  fp64 one that some permutation makes contiguous (a channels-last one too).

Per-parameter attribution is free: every probe is per tensor. Extra memory is O(number of gradient tensors and
pieces) plus two bounded constants per dtype (the workspace and a scale vector); no temporary is ever the size of a
gradient. Nothing here reads a value back to the host.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: Tensors with at most this many elements are batched into a workspace on CPU.
SMALL_NUMEL = 4096
#: The same for bf16 and fp16 tensors: batched, 64 tensors of 4096 elements take 2.4x the time of an ``aminmax`` each
#: (at 2048, 1.6x; at 1024 the same; at 512 and below, batching wins: 0.77x).
SMALL_NUMEL_16BIT = 512
#: Tensors with more elements than this are read by the matrix probe on CPU; between ``SMALL_NUMEL`` and this, by
#: ``aminmax``. BLAS goes multithreaded even for small products, and on a busy machine (data loader workers, other
#: jobs) a parallel region per mid-size tensor costs far more than it saves; PyTorch's own reductions stay on one
#: thread below 32768 elements, as the floor (a plain ``sum``) does.
LARGE_NUMEL = 1 << 16
#: Small tensors of one shape are batched when there are at least this many; fewer are cheaper read by ``aminmax``.
SMALL_BATCH_MIN = 4
#: Elements of the per-dtype CPU workspace that small tensors are stacked into. It stays below PyTorch's and BLAS's
#: thresholds for going multithreaded: on a busy machine, a parallel region per tiny chunk costs far more than it saves.
WORKSPACE_NUMEL = 1 << 15
#: Elements per piece of a large fp32 tensor on CPU (1 MiB): what a core's L2 cache holds on current server CPUs, so
#: that a second reduction of the piece right after the first (a spike gate's sum of squares) reads it from there.
#: Inside a training step (``benchmarks/spike_gate.py``), pieces of 256 KiB cost more calls than they save, 512 KiB
#: to 4 MiB about the same.
PIECE_NUMEL = 1 << 18
#: Columns of the matrix a piece is viewed as by the probe: its scale vector stays in L1.
PROBE_WIDTH = 1 << 10

#: The most elements one probe row sums (a large tensor's row, a small tensor): the probe's scale depends on it.
PROBE_ROW_LIMIT = max(PROBE_WIDTH, SMALL_NUMEL)
# The probe's scale, the same for every dtype it reads: the largest power of two that keeps a sum of
# PROBE_ROW_LIMIT scaled finite values at most half the dtype's largest value (so rounding cannot reach it). No
# smaller: a product below the dtype's smallest normal number is slow on a CPU (see the module docstring).
_PROBE_SCALE = 2.0 ** -PROBE_ROW_LIMIT.bit_length()
_PROBE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Dtypes whose squares are summed in their own precision (a dot of fp16 values overflows, of bf16 ones rounds twice:
#: they are made fp32 first) and whose small tensors are batched up to ``SMALL_NUMEL`` elements.
WIDE_DTYPES = (torch.float32, torch.float64)
# Dtypes whose large tensors are read in pieces on CPU; the others are read whole by aminmax there (benchmarks/).
_LARGE_PIECE_DTYPES = (torch.float32,)

_signature = attrgetter("dtype", "layout", "device", "shape")


def _layout_key(grad: Tensor) -> tuple[object, ...]:
    """What a reading plan depends on: the signature, and for a sparse gradient whether it holds any value (a plan
    made while it held none would not read it)."""
    if grad.layout == torch.strided:
        return _signature(grad)
    return (*_signature(grad), grad._nnz() > 0)

#: Large fp32 tensors on CPU are read by the "probe" or by "aminmax"; chosen by measuring both (see below).
CPU_READERS = ("probe", "aminmax")
#: Below this many elements in a step's large tensors, the two readers are too close to time reliably: the probe.
CALIBRATION_MIN_NUMEL = 1 << 20
_measured: dict[int, str] = {}  # torch.get_num_threads() -> the reader the latest measurement chose
# (threads, each large tensor's shape and strides) -> the reader measured for it: every reader of one layout in a
# process (a guard with and one without a spike gate, the state check) reads it the same way, measured once
_measured_layouts: dict[tuple[object, ...], str] = {}


def cpu_large_tensor_reader() -> str | None:
    """The reader for large fp32 gradients on CPU: ``"probe"`` or ``"aminmax"`` as forced by the environment variable
    ``CKGUARD_CPU_READER``, else the one the latest measurement in this process chose (at the current thread count),
    else None (nothing measured yet).

    Raises:
        ValueError: If ``CKGUARD_CPU_READER`` is set to something else than ``auto``, ``probe`` or ``aminmax``.
    """
    forced = _forced_reader()
    return forced if forced is not None else _measured.get(torch.get_num_threads())


def _forced_reader() -> str | None:
    forced = os.environ.get("CKGUARD_CPU_READER", "auto")
    if forced in CPU_READERS:
        return forced
    if forced != "auto":
        raise ValueError(f"CKGUARD_CPU_READER must be one of 'auto', 'probe', 'aminmax', got {forced!r}.")
    return None


def _calibrate(read_with_probe: Callable[[], object], read_with_aminmax: Callable[[], object], numel: int) -> str:
    """Time both exact readers on the same gradients (after one untimed read each, alternating, best of three) and
    return the faster one."""
    if numel < CALIBRATION_MIN_NUMEL:
        return "probe"
    timings: dict[str, list[float]] = {"probe": [], "aminmax": []}
    readers = {"probe": read_with_probe, "aminmax": read_with_aminmax}
    for read in readers.values():  # untimed: the first read of a layout pays for caches and allocations
        read()
    for repeat in range(3):
        for name in (CPU_READERS if repeat % 2 == 0 else CPU_READERS[::-1]):
            start = time.perf_counter()
            readers[name]()
            timings[name].append(time.perf_counter() - start)
    best = min(CPU_READERS, key=lambda name: min(timings[name]))
    _measured[torch.get_num_threads()] = best
    log.debug(
        "lightning_ckguard reads large fp32 CPU gradients with %s (best of 3 over %d elements: probe %.2f ms, "
        "aminmax %.2f ms, %d threads)", best, numel, 1e3 * min(timings["probe"]), 1e3 * min(timings["aminmax"]),
        torch.get_num_threads(),
    )
    return best


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
    """The stored values of a sparse or complex gradient, as a real strided tensor (a sparse one coalesced); any
    other gradient as it is."""
    if grad.is_sparse:
        # coalescing sums duplicate indices, as the optimizer will, so an overflow of the sum is caught too
        grad = grad.coalesce().values()
    elif grad.layout != torch.strided:  # compressed (CSR, CSC, BSR, BSC): one value per index
        grad = grad.values()
    if grad.is_complex():
        # autograd leaves a parameter used through ``.conj()`` a lazily conjugated gradient: made real first
        grad = torch.view_as_real(grad.resolve_conj().resolve_neg())
    return grad


def _fp32_matmul_is_ieee() -> bool:
    """Whether CPU fp32 matrix products are computed in fp32 (not rounded to bf16/tf32 first)."""
    try:
        return torch.backends.mkldnn.matmul.fp32_precision in ("ieee", "none")  # type: ignore[attr-defined]
    except AttributeError:  # older PyTorch: only the global setting exists
        return torch.get_float32_matmul_precision() == "highest"


def _flat_order(t: Tensor) -> tuple[int, ...] | None:
    """A permutation under which ``t`` is contiguous (``()`` if it already is), or None if there is none."""
    if t.is_contiguous():
        return ()
    strides, sizes = t.stride(), t.shape
    order = tuple(sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d])))
    return order if t.permute(order).is_contiguous() else None


@dataclass
class _Chunk:
    """Small tensors of one shape, stacked into the workspace and probed by one matrix-vector product; with squares,
    each one's sum of squares is taken from the stacked copy right after (:func:`_row_squares`)."""

    members: list[int]
    stacked: Tensor  # workspace view of shape (len(members), *shape)
    matrix: Tensor  # the same memory as (len(members), numel)
    column: Tensor  # scale vector, (numel, 1)
    dots: Tensor  # each member's sum of squares, when asked for: a view of its group's ``chunk_squares.dots``


def _row_squares(matrix: Tensor, out: Tensor) -> None:
    """Each row's sum of squares into ``out``: fp32 and fp64 rows in their own precision, 16-bit ones made fp32 first
    (an fp16 square overflows fp16 above 256; a chunk is at most :data:`WORKSPACE_NUMEL` elements)."""
    rows = matrix if matrix.dtype in WIDE_DTYPES else matrix.to(torch.float32)
    torch.linalg.vecdot(rows, rows, out=out)


class _ProbePiece:
    """The scaled probe of one piece: the piece viewed as a ``PROBE_WIDTH``-column matrix times the scale vector, and
    the ``tail`` elements past its last full row as a dot with the scale. Each output is finite exactly where its
    elements are, and at most half the largest fp32 value (see the module docstring)."""

    def __init__(self, numel: int, outputs: Tensor, scale: Tensor) -> None:
        rows, self.tail = divmod(numel, PROBE_WIDTH)
        self.main = rows * PROBE_WIDTH  # the elements in full rows
        self.column, self.tail_scale = scale[:PROBE_WIDTH], scale[: self.tail]
        self.rows = outputs[:rows]
        self.tail_output = outputs[rows] if self.tail else None

    @staticmethod
    def outputs_for(numel: int) -> int:
        return -(-numel // PROBE_WIDTH)  # a row each, and one for a tail

    def __call__(self, piece: Tensor) -> None:
        if self.tail_output is None:
            torch.mv(piece.view(-1, PROBE_WIDTH), self.column, out=self.rows)
            return
        if self.main:
            torch.mv(piece[: self.main].view(-1, PROBE_WIDTH), self.column, out=self.rows)
        torch.dot(piece[self.main :], self.tail_scale, out=self.tail_output)


class _ExtremesPiece:
    """``aminmax`` of one piece, into its two outputs."""

    def __init__(self, numel: int, outputs: Tensor, scale: Tensor) -> None:
        self.low, self.high = outputs[0], outputs[1]

    @staticmethod
    def outputs_for(numel: int) -> int:
        return 2

    def __call__(self, piece: Tensor) -> None:
        torch.aminmax(piece, out=(self.low, self.high))


def _piece_numels(numel: int) -> list[int]:
    """The sizes of the pieces of :data:`PIECE_NUMEL` elements a large tensor of ``numel`` elements is read in."""
    return [min(PIECE_NUMEL, numel - start) for start in range(0, numel, PIECE_NUMEL)]


class _LargePieces:
    """The large fp32 tensors of a group, read in pieces of :data:`PIECE_NUMEL` elements by one exact reader (the
    probe or ``aminmax``). With ``squares``, a BLAS dot of each piece follows its read and finds it in cache: the
    sum of squares for a spike gate, for about half the price of a pass of its own inside a training step
    (``benchmarks/spike_gate.py``)."""

    def __init__(self, members: list[int], values: list[Tensor], reader: str, scale: Tensor, dots: Tensor) -> None:
        """``dots``: where each piece's sum of squares goes, one entry per piece (:meth:`piece_count`)."""
        self.members = members
        self.orders = [_flat_order(values[i]) or () for i in members]
        piece_type = _ProbePiece if reader == "probe" else _ExtremesPiece
        self.reader = reader
        numels = [_piece_numels(values[i].numel()) for i in members]
        counts = [[piece_type.outputs_for(n) for n in pieces] for pieces in numels]
        self.outputs = torch.empty(sum(map(sum, counts)), dtype=torch.float32)
        self.dots = dots
        self.readers: list[list[_ProbePiece | _ExtremesPiece]] = []
        self.dot_outputs: list[list[Tensor]] = []
        output_owners: list[int] = []
        dot_owners: list[int] = []
        start = 0
        for entry, (pieces, piece_counts) in enumerate(zip(numels, counts, strict=True)):
            readers: list[_ProbePiece | _ExtremesPiece] = []
            for numel, count in zip(pieces, piece_counts, strict=True):
                readers.append(piece_type(numel, self.outputs[start : start + count], scale))
                start += count
            self.readers.append(readers)
            output_owners += [entry] * sum(piece_counts)
            self.dot_outputs.append(list(self.dots[len(dot_owners) : len(dot_owners) + len(pieces)].unbind()))
            dot_owners += [entry] * len(pieces)
        self.output_owners = torch.tensor(output_owners, dtype=torch.int64)
        self.dot_owners = torch.tensor(dot_owners, dtype=torch.int64)
        self.probes = torch.zeros(len(members), dtype=torch.float32)

    @staticmethod
    def piece_count(members: list[int], values: list[Tensor]) -> int:
        return sum(len(_piece_numels(values[i].numel())) for i in members)

    def squares_taken(self) -> _SquaresPart:
        """After a read with squares: each piece's sum of squares, and the member each belongs to."""
        return _SquaresPart(self.members, self.dots, self.dot_owners)

    def read(self, values: list[Tensor], squares: bool = False) -> Tensor:
        """Per member: 0 where the tensor is finite, NaN where it is not. With ``squares``, :attr:`dots` holds each
        piece's sum of squares afterwards (in fp32)."""
        for i, order, readers, dot_outputs in zip(self.members, self.orders, self.readers, self.dot_outputs,
                                                  strict=True):
            flat = (values[i].permute(order) if order else values[i]).view(-1)
            for piece, read, dot_output in zip(flat.split(PIECE_NUMEL), readers, dot_outputs, strict=True):
                read(piece)
                if squares:
                    torch.dot(piece, piece, out=dot_output)  # the piece just read, still in this core's cache
        # each output as 0 (finite) or NaN before they are added up per tensor: a sum of rows could overflow
        return self.probes.zero_().index_add_(0, self.output_owners, self.outputs.mul_(0))


class _DotSlots:
    """One buffer for every sum of squares a group's reads take along (fp64 for fp64 tensors, else fp32), handed out
    as consecutive views, so that adding them all up is one kernel a step."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self._buffer = torch.empty(capacity, dtype=dtype, device=device)
        self._used = 0

    def take(self, count: int) -> Tensor:
        view = self._buffer[self._used : self._used + count]
        self._used += count
        return view

    def used(self) -> Tensor | None:
        """The slots handed out, as one view; None if none was."""
        return self._buffer[: self._used] if self._used else None


@dataclass
class _Extremes:
    """``aminmax`` of each member, written straight into one preallocated ``(2, members)`` buffer."""

    members: list[int]
    buffer: Tensor
    mins: list[Tensor] = field(init=False)
    maxs: list[Tensor] = field(init=False)
    #: per member, the output of the dot that follows its read when squares are asked for; None: no dot (see
    #: :meth:`take_squares`)
    dot_outputs: list[Tensor | None] = field(init=False)
    squared: list[int] = field(init=False, default_factory=list)  # the members with a dot
    dots: Tensor | None = field(init=False, default=None)
    flat_orders: list[tuple[int, ...]] = field(init=False)  # per member with a dot: the permutation that flattens it

    def __post_init__(self) -> None:
        self.mins, self.maxs = list(self.buffer[0].unbind()), list(self.buffer[1].unbind())
        self.dot_outputs = [None] * len(self.members)
        self.flat_orders = [()] * len(self.members)

    def take_squares(self, values: list[Tensor], slots: _DotSlots) -> None:
        """Plan a BLAS dot after the read of each fp32 or fp64 member that some permutation makes contiguous
        (channels-last ones too), while it is in cache, into ``slots`` (the others' squares are left to the caller: a
        dot of fp16 overflows, one of bf16 rounds twice)."""
        if self.buffer.dtype not in WIDE_DTYPES:
            return
        orders = {i: _flat_order(values[i]) for i in self.members}
        self.squared = [i for i in self.members if orders[i] is not None]
        self.dots = slots.take(len(self.squared))
        outputs = dict(zip(self.squared, self.dots.unbind(), strict=True))
        self.dot_outputs = [outputs.get(i) for i in self.members]
        self.flat_orders = [orders[i] or () for i in self.members]

    @classmethod
    def over(cls, members: list[int], dtype: torch.dtype, device: torch.device) -> _Extremes:
        """A reader of ``members`` (tensors of ``dtype`` on ``device``) with its own buffer."""
        return cls(members, torch.empty(2, len(members), dtype=dtype, device=device))

    def read(self, values: list[Tensor], squares: bool = False) -> Tensor:
        """Per member: True where the tensor holds a non-finite value. With ``squares``, :attr:`dots` holds the sum
        of squares of each member of :attr:`squared` afterwards."""
        for i, low, high, dot_output, order in zip(self.members, self.mins, self.maxs, self.dot_outputs,
                                                   self.flat_orders, strict=True):
            torch.aminmax(values[i], out=(low, high))
            if squares and dot_output is not None:
                value = values[i].permute(order) if order else values[i]
                flat = value if value.dim() == 1 else value.view(-1)
                torch.dot(flat, flat, out=dot_output)  # the tensor just read, still in cache
        return _non_finite(self.buffer).any(dim=0)

    def squares_taken(self) -> _SquaresPart | None:
        """After a read with squares: the members with a dot and their sums of squares."""
        return _SquaresPart(self.squared, self.dots, None) if self.dots is not None and self.squared else None


@dataclass
class _Group:
    """How to read the tensors of one (device, dtype) group. Entry order: large, small chunks, extremes."""

    device: torch.device
    positions: list[int] = field(default_factory=list)  # positions in the input, in entry order
    large: _LargePieces | None = None
    chunks: list[_Chunk] = field(default_factory=list)
    chunk_squares: _SquaresPart | None = None  # the chunks' members and their sums of squares, in chunk order
    squares: Tensor | None = None  # every sum of squares its reads take along (one buffer), when they take any
    extremes: _Extremes | None = None  # read by aminmax, in input order
    norms: list[int] = field(default_factory=list)  # accelerators
    index: dict[torch.device, Tensor] = field(default_factory=dict)  # ``positions`` as a tensor, per output device


@dataclass
class _Plan:
    groups: list[_Group]
    converted: list[int]  # positions of sparse or complex gradients
    identity: bool  # one group whose entry order is the input order, nothing empty
    taken: TakenSquares | None  # the squares its reads take along when asked


@dataclass(frozen=True)
class _SquaresPart:
    """Sums of squares one reader took along, in the gradients' own precision: ``dots[k]`` belongs to the gradient at
    ``positions[owners[k]]`` (several pieces to one gradient), or with ``owners`` None to ``positions[k]``."""

    positions: list[int]
    dots: Tensor
    owners: Tensor | None


@dataclass(frozen=True)
class TakenSquares:
    """The sums of squares :meth:`NonFiniteCheck.read` takes along, of the gradients at :attr:`positions`; the
    gradients at :attr:`rest` are the caller's to read. Made once per reading plan, over its buffers: the values are
    those of the latest read."""

    parts: list[_SquaresPart]
    positions: list[int]
    rest: list[int]
    buffers: list[Tensor]  # per group, the one buffer its parts' ``dots`` are views of

    def total(self) -> Tensor:
        """Their sum, a 0-d float64 tensor on the CPU (summed in float64: one kernel a group)."""
        total = self.buffers[0].sum(dtype=torch.float64)
        for buffer in self.buffers[1:]:
            total = total + buffer.sum(dtype=torch.float64)
        return total

    def each(self) -> Tensor:
        """Per gradient, in the order of :attr:`positions`: its sum of squares in float64 (a piece's in fp32)."""
        each = [part.dots.to(torch.float64) if part.owners is None else torch.zeros(
            len(part.positions), dtype=torch.float64).index_add_(0, part.owners, part.dots.to(torch.float64))
            for part in self.parts]
        return each[0] if len(each) == 1 else torch.cat(each)


def _squares_taken(groups: list[_Group], count: int) -> TakenSquares | None:
    """What a plan's reads take along, of ``count`` gradients: None when they take no squares."""
    parts = [part for g in groups for part in (None if g.large is None else g.large.squares_taken(), g.chunk_squares,
                                               None if g.extremes is None else g.extremes.squares_taken())
             if part is not None]
    if not parts:
        return None
    positions = [i for part in parts for i in part.positions]
    return TakenSquares(parts, positions, sorted(set(range(count)) - set(positions)),
                        [g.squares for g in groups if g.squares is not None])


class NonFiniteCheck:
    """Computes, per gradient tensor, whether it holds a NaN or an infinity.

    Gradients may live on several devices and in several dtypes; each (device, dtype) group is read with batched
    reductions chosen per device (see the module docstring). The reading plan is cached per layout of the gradient
    list, so a steady training loop decides nothing and allocates nothing on the host per step.
    """

    MAX_PLANS = 64  # bounded, like the index caches

    def __init__(self, large_reader: str | None = None) -> None:
        """``large_reader``: ``"aminmax"`` or ``"probe"`` fixes the reader of large fp32 CPU tensors for this check,
        whatever ``CKGUARD_CPU_READER`` says or a measurement chose (None: as they say). ``"aminmax"`` costs the same
        at every magnitude, where the probe slows down on elements under ``2**-113`` (``1e-34``: their scaled
        products are subnormal), such as the decayed optimizer moments of parameters that no longer get gradients:
        the state check's choice.

        Raises:
            ValueError: If ``large_reader`` is none of None, ``"probe"`` and ``"aminmax"``.
        """
        if large_reader is not None and large_reader not in CPU_READERS:
            raise ValueError(f"`large_reader` must be None, 'probe' or 'aminmax', got {large_reader!r}.")
        self._large_reader = large_reader
        self._plans: dict[tuple[object, ...], _Plan] = {}
        self._workspaces: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._scales: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def __call__(self, grads: Sequence[Tensor], out_device: torch.device) -> Tensor:
        """Return a bool tensor on ``out_device``: ``flags[i]`` is True when ``grads[i]`` is not finite."""
        return self.read(grads, out_device)[0]

    def read(self, grads: Sequence[Tensor], out_device: torch.device, squares: bool = False, *,
             converted: list[Tensor] | None = None) -> tuple[Tensor, TakenSquares | None]:
        """The flags, as calling this object gives them. With ``squares``, also the sums of squares of the CPU
        gradients whose squares a BLAS dot could take right after their exact read, from cache: the large fp32 ones
        (piece by piece), the small ones read in batches (from their stacked copy) and the contiguous fp32 and fp64
        ones read by ``aminmax``; None when there were none. The others' squares are the caller's to read:
        ``converted``, a list, is filled with the values read (sparse and complex gradients as real strided
        tensors, coalesced), so that the caller need not convert them a second time."""
        ieee = _fp32_matmul_is_ieee()
        key = (ieee, *map(_layout_key, grads))
        values = list(grads)
        taken = None
        with torch.no_grad():  # gradients of a backward with ``create_graph=True`` require grad themselves
            plan = self._plans.get(key)
            if plan is None:
                if len(self._plans) >= self.MAX_PLANS:
                    self._plans.clear()
                plan = self._plans[key] = self._plan(values, ieee)
            for i in plan.converted:
                values[i] = _dense_values(values[i])
            if converted is not None:
                converted[:] = values
            try:
                parts = [self._read(group, values, squares) for group in plan.groups]
                taken = plan.taken if squares else None
            except RuntimeError:
                # a gradient whose strides changed since the plan was made (no longer viewable as planned):
                # read everything with the plan-free exact reduction
                self._plans.pop(key, None)
                parts = [_extremes_non_finite([values[i] for i in g.positions], g.device) for g in plan.groups]
        if plan.identity:
            return parts[0].to(out_device, non_blocking=True), taken
        flags = torch.zeros(len(values), dtype=torch.bool, device=out_device)
        for group, bad in zip(plan.groups, parts, strict=True):
            index = group.index.get(out_device)
            if index is None:
                index = group.index[out_device] = torch.tensor(group.positions, dtype=torch.int64, device=out_device)
            flags.index_copy_(0, index, bad.to(out_device, non_blocking=True))
        return flags, taken

    # ------------------------------------------------------------------ reading

    def _read(self, group: _Group, values: list[Tensor], squares: bool = False) -> Tensor:
        """Per entry of ``group``: True where the tensor holds a non-finite value (``squares``: see :meth:`read`)."""
        if group.norms:
            return _extremes_non_finite([values[i] for i in group.norms], group.device)
        bad: list[Tensor] = []
        probes = [] if group.large is None else [group.large.read(values, squares)]
        for chunk in group.chunks:
            torch.stack([values[i] for i in chunk.members], out=chunk.stacked)
            probes.append(torch.mm(chunk.matrix, chunk.column).view(-1))
            if squares:
                _row_squares(chunk.matrix, chunk.dots)  # the stacked copy, in cache; the next chunk overwrites it
        if probes:
            bad.append(_non_finite(torch.cat(probes) if len(probes) > 1 else probes[0]))
        if group.extremes is not None:
            bad.append(group.extremes.read(values, squares))
        return torch.cat(bad) if len(bad) > 1 else bad[0]

    # ------------------------------------------------------------------ planning (once per layout)

    def _plan(self, grads: list[Tensor], ieee: bool) -> _Plan:
        converted = [i for i, g in enumerate(grads) if g.layout != torch.strided or g.is_complex()]
        values = list(grads)
        for i in converted:
            values[i] = _dense_values(values[i])
        members: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, value in enumerate(values):
            if value.numel() > 0:
                members.setdefault((value.device, value.dtype), []).append(i)
        groups = [self._plan_group(device, dtype, positions, values, ieee, set(converted))
                  for (device, dtype), positions in members.items()]
        identity = len(groups) == 1 and groups[0].positions == list(range(len(values)))
        return _Plan(groups, converted, identity, _squares_taken(groups, len(values)))

    def _plan_group(
        self, device: torch.device, dtype: torch.dtype, positions: list[int], values: list[Tensor], ieee: bool,
        converted: set[int],
    ) -> _Group:
        """``converted``: positions of sparse or complex gradients; a sparse one's values change size from step to
        step, so they are read whole by ``aminmax``, which takes any size."""
        if device.type != "cpu":
            return _Group(device, positions, norms=positions)
        group = _Group(device)
        probe = dtype in _PROBE_DTYPES and (dtype != torch.float32 or ieee)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        large: list[int] = []
        extremes: list[int] = []
        for i in positions:
            numel = values[i].numel()
            if i in converted:
                extremes.append(i)
            elif probe and numel <= (SMALL_NUMEL if dtype in WIDE_DTYPES else SMALL_NUMEL_16BIT):
                by_shape.setdefault(tuple(values[i].shape), []).append(i)
            elif numel > LARGE_NUMEL and dtype in _LARGE_PIECE_DTYPES and _flat_order(values[i]) is not None:
                large.append(i)
            else:
                extremes.append(i)
        # a shape with few members is cheaper read by aminmax than stacked and probed (benchmarks/)
        for shape in [shape for shape, indices in by_shape.items() if len(indices) < SMALL_BATCH_MIN]:
            extremes += by_shape.pop(shape)
        slots = _DotSlots(_LargePieces.piece_count(large, values) + sum(map(len, by_shape.values())) + len(extremes),
                          torch.float64 if dtype == torch.float64 else torch.float32, device)
        if large:
            group.large = self._plan_large_pieces(large, values, ieee, slots)
        if by_shape:
            group.chunks, group.chunk_squares = self._plan_chunks(device, dtype, by_shape, slots)
        if extremes:
            extremes.sort()
            group.extremes = _Extremes.over(extremes, dtype, device)
            group.extremes.take_squares(values, slots)
        group.squares = slots.used()
        group.positions = ([] if group.large is None else group.large.members) + [
            i for c in group.chunks for i in c.members] + extremes
        return group

    def _plan_large_pieces(self, members: list[int], values: list[Tensor], ieee: bool,
                           slots: _DotSlots) -> _LargePieces:
        """The large fp32 tensors' reader: the probe or ``aminmax`` as forced, else the faster of the two on these
        gradients (measured once per layout). Without exact fp32 matrix products, ``aminmax``."""
        scale = self._scale(torch.device("cpu"), torch.float32, PROBE_WIDTH)
        reader = (self._large_reader or _forced_reader()) if ieee else "aminmax"
        layout = (torch.get_num_threads(), *((values[i].shape, values[i].stride()) for i in members))
        reader = reader or _measured_layouts.get(layout)  # another reader of this layout measured it already
        dots = slots.take(_LargePieces.piece_count(members, values))
        if reader is None:
            if len(_measured_layouts) >= self.MAX_PLANS:  # bounded, like the plans (layouts can vary: MoE experts)
                _measured_layouts.clear()
            readers = {name: _LargePieces(members, values, name, scale, dots) for name in CPU_READERS}
            reader = _measured_layouts[layout] = _calibrate(
                partial(readers["probe"].read, values), partial(readers["aminmax"].read, values),
                sum(values[i].numel() for i in members))
            return readers[reader]
        return _LargePieces(members, values, reader, scale, dots)

    def _plan_chunks(
        self, device: torch.device, dtype: torch.dtype, by_shape: dict[tuple[int, ...], list[int]], slots: _DotSlots
    ) -> tuple[list[_Chunk], _SquaresPart]:
        """The chunks of ``by_shape``'s tensors, and where their sums of squares go (taken from ``slots``), with its
        members in chunk order."""
        workspace = self._workspace(device, dtype, max(min(len(m), max(1, WORKSPACE_NUMEL // math.prod(s)))
                                                       * math.prod(s) for s, m in by_shape.items()))
        scale = self._scale(device, dtype, max(math.prod(s) for s in by_shape))
        members_in_order = [i for indices in by_shape.values() for i in indices]
        dots = slots.take(len(members_in_order))
        chunks: list[_Chunk] = []
        offset = 0  # into ``dots``, of the next chunk's members
        for shape, indices in by_shape.items():
            numel = math.prod(shape)
            per_chunk = max(1, WORKSPACE_NUMEL // numel)
            for start in range(0, len(indices), per_chunk):
                members = indices[start : start + per_chunk]
                memory = workspace[: len(members) * numel]
                chunks.append(_Chunk(members, memory.view(len(members), *shape), memory.view(len(members), numel),
                                     scale[:numel].view(numel, 1), dots[offset : offset + len(members)]))
                offset += len(members)
        return chunks, _SquaresPart(members_in_order, dots, None)

    def _scale(self, device: torch.device, dtype: torch.dtype, length: int) -> Tensor:
        scale = self._scales.get((device, dtype))
        if scale is None or scale.numel() < length:
            scale = self._scales[(device, dtype)] = torch.full((length,), _PROBE_SCALE, dtype=dtype, device=device)
        return scale

    def _workspace(self, device: torch.device, dtype: torch.dtype, length: int) -> Tensor:
        workspace = self._workspaces.get((device, dtype))
        if workspace is None or workspace.numel() < length:
            workspace = self._workspaces[(device, dtype)] = torch.empty(length, dtype=dtype, device=device)
        return workspace


def _extremes_non_finite(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """Per tensor (all of one dtype): True where it holds a non-finite value. One read-only pass each, no
    gradient-sized temporaries; the plan-free reduction."""
    if device.type == "cpu":
        return _Extremes.over(list(range(len(tensors))), tensors[0].dtype, device).read(list(tensors))
    # accelerators: one fused multi-tensor launch; the max-norm is max(|x|) and propagates NaN
    norms = torch._foreach_norm(list(tensors), ord=float("inf"))
    return _non_finite(torch.stack(norms))


def _non_finite(values: Tensor) -> Tensor:
    """``~isfinite(values)`` in two elementwise ops (``isfinite`` is a composite of five): ``x * 0`` is ``0`` for
    every finite ``x``, however large, and ``NaN`` for ``NaN`` and both infinities."""
    return values.mul(0).ne(0)
