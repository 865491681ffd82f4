"""Recording: exact elementwise finiteness, attribution, and no host sync or collective per step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import HOST_READS, QUIET, CountOps, FaultyModel
from lightning_ckguard import FiniteGradCheckpoint, GradientGuard
from lightning_ckguard.record import finiteness
from lightning_ckguard.record.finiteness import NonFiniteCheck
from lightning_ckguard.record.squares import FlagsAndSquares


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("value", [1e30, -1e30, 3e38, torch.finfo(torch.float32).max])
def test_large_finite_gradients_are_not_flagged(value):
    grads = [torch.full((1000,), value), torch.full((3, 3), value)]
    # the 2-norm a naive guard would use overflows on exactly these inputs
    assert not torch.isfinite(torch.linalg.vector_norm(grads[0]))
    assert not NonFiniteCheck()(grads, torch.device("cpu")).any()


@pytest.mark.parametrize("copies", [1, finiteness.SMALL_BATCH_MIN], ids=["per-tensor", "batched"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_nan_and_both_infinities_are_flagged_per_tensor(value, dtype, copies):
    # one tensor of each shape is read by aminmax; SMALL_BATCH_MIN of one shape are stacked and probed
    grads = [torch.ones(shape, dtype=dtype) for shape in [(50,), (7, 7), (3,)] for _ in range(copies)]
    grads[copies][4, 2] = value
    flags = NonFiniteCheck()(grads, torch.device("cpu"))
    assert flags.tolist() == [i == copies for i in range(len(grads))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_batched_small_tensor_probe_never_overflows(dtype):
    # the largest finite values of the dtype, in the most elements the batched path takes
    largest = torch.finfo(dtype).max
    most = finiteness.SMALL_NUMEL if dtype in (torch.float32, torch.float64) else finiteness.SMALL_NUMEL_16BIT
    grads = [torch.full((most,), sign * largest, dtype=dtype)
             for sign in (1, -1) for _ in range(finiteness.SMALL_BATCH_MIN)]
    check = NonFiniteCheck()
    assert not check(grads, torch.device("cpu")).any()
    grads[5][-1] = float("inf")
    assert check(grads, torch.device("cpu")).tolist() == [i == 5 for i in range(len(grads))]


def test_mixed_dtypes_empty_sparse_and_complex_gradients():
    sparse = torch.sparse_coo_tensor([[0, 0]], [3e38, 3e38], (4,))  # duplicates sum to inf, as the optimizer sees
    complex_grad = torch.zeros(3, dtype=torch.complex64)
    complex_grad[1] = complex(0, float("nan"))
    grads = [torch.ones(3, dtype=torch.float16), torch.empty(0), sparse, complex_grad, torch.ones(2)]
    assert NonFiniteCheck()(grads, torch.device("cpu")).tolist() == [False, False, True, True, False]


def test_guard_attributes_steps_and_parameters():
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    guard.record(step=0)
    model[2].bias.grad[1] = float("-inf")
    guard.record(step=1)
    model[2].bias.grad[1] = 0.0
    model[0].weight.grad[0, 0] = float("nan")
    guard.record(step=2)
    model[0].weight.grad[0, 0] = 1e30
    guard.record(step=3)
    verdict = guard.agree(global_step=4)
    assert not verdict.accepted
    assert (verdict.ranks, verdict.first_step, verdict.last_step, verdict.num_steps) == ((0,), 1, 2, 2)
    assert verdict.parameters == ("0.weight", "2.bias")
    guard.reset()
    guard.record(step=4)
    assert guard.agree(global_step=5).accepted


@pytest.mark.parametrize("skip_flag", [True, torch.tensor(True), torch.tensor(1.0)], ids=["bool", "tensor", "float"])
def test_a_pending_rejection_outlives_steps_a_loss_scaler_skipped(skip_flag):
    # the weights are still the rejected ones until a step is applied: a skipped step changed nothing
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    guard.reset(pending_rejection=True)
    guard.record(step=7, skipped=skip_flag)
    guard.record(step=8, skipped=skip_flag)
    verdict = guard.agree(global_step=9)
    assert not verdict.accepted and verdict.to_error().pending_rejection
    guard.reset(pending_rejection=True)
    guard.record(step=9, skipped=skip_flag)
    guard.record(step=10, skipped=torch.tensor(False))  # applied
    assert guard.agree(global_step=11).accepted


def test_a_step_applied_before_a_skipped_one_ends_a_pending_rejection():
    # the weights changed at the applied step: a step a loss scaler skips afterwards does not make them the rejected
    # ones again
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    guard.reset(pending_rejection=True)
    guard.record(step=9, skipped=torch.tensor(False))  # applied
    guard.record(step=10, skipped=torch.tensor(True))
    verdict = guard.agree(global_step=11)
    assert verdict.accepted, verdict.to_error()


def test_a_ranks_report_counts_the_parameters_and_the_steps_it_saw_non_finite():
    # one step with a NaN in two parameters: the rank's report says two parameters in one step
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    model[0].weight.grad[0, 0] = model[2].bias.grad[0] = float("nan")
    guard.record(step=6)
    (report,) = guard.agree(global_step=7).reports
    assert (report.rank, report.non_finite_steps, report.num_parameters) == (0, 1, 2)
    assert (report.first_step, report.last_step) == (6, 6)


def test_frozen_and_gradless_parameters_are_ignored():
    model = _model()
    model[0].weight.requires_grad_(False)
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    model[2].bias.grad = None
    guard.record()
    assert guard.agree().accepted
    assert guard.steps_recorded == 1  # the step was read, with the two parameters that have gradients
    # and only those are read, under their own names: a NaN in one of them is attributed to it alone
    model[2].weight.grad[0, 0] = float("nan")
    guard.record()
    verdict = guard.agree()
    assert not verdict.accepted
    assert verdict.parameters == ("2.weight",)


def test_attribution_when_only_some_parameters_have_gradients():
    # the window maps flags to parameter indices with a scatter when not every parameter is present
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    model[0].bias.grad = None
    model[2].weight.grad[0, 0] = float("inf")
    guard.record(step=7)
    verdict = guard.agree(global_step=8)
    assert (verdict.accepted, verdict.first_step, verdict.parameters) == (False, 7, ("2.weight",))


def test_attribution_when_the_optimizer_holds_every_parameter_in_an_order_of_its_own():
    # param groups made by kind (no weight decay on the biases): every parameter has a gradient, but the optimizer
    # lists them in another order than the module
    model = _model()
    optimizer = torch.optim.SGD([{"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
                                 {"params": [model[0].weight, model[2].weight]}], lr=0.1)
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    model[2].weight.grad[0, 0] = float("nan")
    guard.record(optimizer, step=3)
    verdict = guard.agree(global_step=4)
    assert (verdict.accepted, verdict.first_step, verdict.parameters) == (False, 3, ("2.weight",))


def test_recording_a_step_reads_nothing_back_to_the_host():
    model = _model()
    guard = GradientGuard(model)
    model(torch.randn(5, 4)).sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    guard.record(step=0)  # warm the caches
    with CountOps() as ops:
        for step in range(1, 6):
            guard.record(step=step)
    assert ops.names, "the dispatch mode saw no ops at all"
    assert ops.host_reads == 0, [n for n in ops.names if n.split(".")[0] in HOST_READS]
    assert not any("c10d" in n or "all_reduce" in n or "allgather" in n for n in ops.names)


def _host_reads_in_fit(callback_cls, steps: int, tmp_path) -> int:
    seed_everything(0)
    callback = callback_cls(dirpath=tmp_path / f"{callback_cls.__name__}-{steps}", every_n_train_steps=10_000,
                            save_last=True)
    trainer = Trainer(max_steps=steps, limit_val_batches=0, callbacks=[callback], **QUIET)
    with CountOps() as ops:
        trainer.fit(FaultyModel(sanitize=False))
    return ops.host_reads


def test_guard_adds_zero_host_syncs_per_training_step(tmp_path):
    # Lightning itself reads some values per step; compare against plain ModelCheckpoint over N and 2N steps.
    n = 6
    extra_n = _host_reads_in_fit(FiniteGradCheckpoint, n, tmp_path) - _host_reads_in_fit(ModelCheckpoint, n, tmp_path)
    extra_2n = (_host_reads_in_fit(FiniteGradCheckpoint, 2 * n, tmp_path)
                - _host_reads_in_fit(ModelCheckpoint, 2 * n, tmp_path))
    assert extra_n == extra_2n, f"the guard's host reads grow with steps: {extra_n} for {n}, {extra_2n} for {2 * n}"
    assert extra_n <= 2, "expected only the boundary read(s) of the final save"


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
@pytest.mark.parametrize("shape", [(4096,), (5000,), (70_000,), (65_537,), (1024, 1536), (3, 100_003)])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_every_cpu_read_path_is_exact(shape, value, reader, monkeypatch):
    # small batched, small and mid-size aminmax, and large tensors read by either large-tensor reader; contiguous and
    # transposed
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    cpu = torch.device("cpu")
    big = torch.full(shape, torch.finfo(torch.float32).max)
    assert not NonFiniteCheck()([big, -big], cpu).any()
    same_shape = [big.clone() for _ in range(finiteness.SMALL_BATCH_MIN)]  # so that small shapes are batched
    for position in (0, big.numel() // 2, big.numel() - 1):
        grad = big.clone()
        grad.view(-1)[position] = value
        other = grad.t() if grad.dim() == 2 else grad
        flags = NonFiniteCheck()([torch.ones(3), grad, other, *same_shape], cpu)
        assert flags.tolist() == [False, True, True] + [False] * len(same_shape)


PIECE, WIDTH = finiteness.PIECE_NUMEL, finiteness.PROBE_WIDTH
# two full pieces and a last one of 3 full probe rows and a tail of 5 elements
PIECED = 2 * PIECE + 3 * WIDTH + 5


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
@pytest.mark.parametrize("position", [0, PIECE - 1, PIECE, 2 * PIECE + 3 * WIDTH - 1, PIECED - 1],
                         ids=["first", "end-of-piece", "next-piece", "last-full-row", "tail"])
def test_large_tensors_read_in_pieces_are_exact_and_give_their_squares(position, reader, monkeypatch):
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    cpu, largest = torch.device("cpu"), torch.finfo(torch.float32).max
    assert not NonFiniteCheck()([torch.full((PIECED,), largest), torch.full((PIECED,), -largest)], cpu).any()
    torch.manual_seed(0)
    grads = [torch.randn(PIECED), torch.randn(7), torch.randn(PIECED // 5, 5).t()]  # the last: transposed
    flags, taken = NonFiniteCheck().read(grads, cpu, squares=True)
    # the two large ones in pieces, the small one (read by aminmax) whole
    assert not flags.any() and taken is not None and sorted(taken.positions) == [0, 1, 2]
    expected = [float(grads[i].double().square().sum()) for i in taken.positions]
    assert taken.each().tolist() == pytest.approx(expected, rel=1e-5)
    assert float(taken.total()) == pytest.approx(sum(expected), rel=1e-5)
    for value in (float("nan"), float("inf"), float("-inf")):
        for bad in (0, 2):
            planted = list(grads)
            contiguous = grads[bad].clone() if bad == 0 else grads[2].t().clone()  # permuted back to contiguous
            contiguous.view(-1)[position] = value
            planted[bad] = contiguous if bad == 0 else contiguous.t()
            flags, taken = NonFiniteCheck().read(planted, cpu, squares=True)
            assert flags.tolist() == [bad == 0, False, bad == 2], (value, bad)
            assert not taken.each()[taken.positions.index(bad)].isfinite()


class _PieceReads(TorchDispatchMode):
    """The ATen ops that read part of ``grad``'s memory, in order: (op, first element, elements)."""

    def __init__(self, grad: torch.Tensor) -> None:
        super().__init__()
        self.storage, self.reads = grad.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() == self.storage and (
                    func.__name__.split(".")[0] not in ("view", "split", "slice", "permute")):
                self.reads.append((func.__name__.split(".")[0], arg.storage_offset(), arg.numel()))
                break
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
def test_the_squares_of_a_large_gradient_are_read_piece_by_piece_right_after_its_flags(reader, monkeypatch):
    # the point of reading in pieces: the dot of a piece follows the exact read of the same piece, in cache; a second
    # pass over the whole gradient would read it back from memory
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    grad, check = torch.randn(PIECED), NonFiniteCheck()
    check.read([grad], torch.device("cpu"), squares=True)  # the first read of a layout plans it
    with _PieceReads(grad) as mode:
        check.read([grad], torch.device("cpu"), squares=True)
    starts = [0, PIECE, 2 * PIECE]
    flag_ops = ["mv", "dot"] if reader == "probe" else ["aminmax"]
    flag_reads = [(r[0], r[1]) for r in mode.reads if r[0] != "dot" or r[2] <= 5]  # the tail's probe is a dot of 5
    assert [offset for _, offset in flag_reads if _ in flag_ops] and all(r[2] <= PIECE for r in mode.reads)
    squares = [i for i, r in enumerate(mode.reads) if r[0] == "dot" and r[2] > 5]
    assert [mode.reads[i][1:] for i in squares] == [(start, min(PIECE, PIECED - start)) for start in starts]
    for i, start in zip(squares, starts, strict=True):  # each dot right after the read of its own piece
        assert mode.reads[i - 1][0] in flag_ops and start <= mode.reads[i - 1][1] < start + PIECE
    # without squares, no dot of a whole piece
    with _PieceReads(grad) as mode:
        check([grad], torch.device("cpu"))
    assert not [r for r in mode.reads if r[0] == "dot" and r[2] > 5]


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
def test_a_transposed_large_gradient_is_read_in_place_piece_by_piece(reader, monkeypatch):
    # permuted back to its memory order, not copied: no read takes more than a piece, and each piece's dot reads
    # the gradient's own memory
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    grad, check = torch.randn(PIECED // 5, 5).t(), NonFiniteCheck()
    check.read([grad], torch.device("cpu"), squares=True)  # the first read of a layout plans it
    with _PieceReads(grad) as mode:
        flags, taken = check.read([grad], torch.device("cpu"), squares=True)
    assert not flags.any() and taken is not None and taken.positions == [0]
    assert mode.reads and all(r[2] <= PIECE for r in mode.reads), mode.reads
    squares = [r[1:] for r in mode.reads if r[0] == "dot" and r[2] > 5]
    assert squares == [(start, min(PIECE, PIECED - start)) for start in (0, PIECE, 2 * PIECE)]


def test_a_large_fp64_gradient_is_read_whole_by_aminmax_with_its_squares():
    # fp64 is not read in pieces: one aminmax and one dot of the whole tensor, exact at fp64's largest value
    cpu, largest = torch.device("cpu"), torch.finfo(torch.float64).max
    torch.manual_seed(0)
    grad = torch.randn(finiteness.LARGE_NUMEL + 1, dtype=torch.float64)
    flags, taken = NonFiniteCheck().read([grad], cpu, squares=True)
    assert not flags.any() and taken is not None and taken.positions == [0]
    assert taken.each().tolist() == pytest.approx([float(grad.square().sum())], rel=1e-12)
    assert not NonFiniteCheck()([torch.full_like(grad, largest), torch.full_like(grad, -largest)], cpu).any()
    grad[-1] = float("-inf")
    assert NonFiniteCheck()([grad], cpu).tolist() == [True]


def _sparse(values: list[float] | torch.Tensor, size: int) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float32)
    return torch.sparse_coo_tensor(torch.arange(len(values)).view(1, -1), values, (size,)).coalesce()


@pytest.mark.parametrize("nonzeros", [(0, 3), (5, 7), (70_000, 80_000), (80_000, 70_000)],
                         ids=["empty-first", "small", "large-growing", "large-shrinking"])
def test_sparse_gradients_whose_values_change_size_stay_exact(nonzeros):
    # a sparse gradient's values change size from step to step, and a plan made at the first step must still read
    # every value of the next: four of them, so that small ones of one size would be batched if they were planned so
    cpu, size = torch.device("cpu"), 100_000
    check, reader = NonFiniteCheck(), FlagsAndSquares()
    torch.manual_seed(0)
    first, second = ([_sparse(torch.randn(n), size) for _ in range(4)] for n in nonzeros)
    for grads in (first, second):
        dense = [torch.ones(3), *grads]
        assert not check(dense, cpu).any()
        _, total = reader(dense, cpu)
        assert float(total) == pytest.approx(3 + sum(float(g.values().double().square().sum()) for g in grads),
                                             rel=1e-5)
    for value in (float("nan"), float("inf")):
        planted = list(second)
        values = second[2].values().clone()
        values[-1] = value
        planted[2] = _sparse(values, size)
        assert check([torch.ones(3), *planted], cpu).tolist() == [False, False, False, True, False]
        assert reader([torch.ones(3), *planted], cpu)[0].tolist() == [False, False, False, True, False]


def test_gradients_that_require_grad_are_read_and_measured_without_autograd(monkeypatch):
    # backward(create_graph=True), as second-order optimizers run it, leaves gradients that require grad; the first
    # step of a large layout times both readers on them (a shape of its own here, so that it is measured)
    monkeypatch.delenv("CKGUARD_CPU_READER", raising=False)
    layer = torch.nn.Linear(1024, 1031, bias=False)
    layer(torch.randn(2, 1024)).pow(2).sum().backward(create_graph=True)
    assert layer.weight.grad.requires_grad and layer.weight.grad.numel() >= finiteness.CALIBRATION_MIN_NUMEL
    flags, total = FlagsAndSquares()([layer.weight.grad], torch.device("cpu"))
    assert not flags.any() and float(total) == pytest.approx(float(layer.weight.grad.double().square().sum()), rel=1e-5)
    layer.weight.grad = None  # the reference cycle create_graph makes


def test_a_lazily_conjugated_complex_gradient_is_read():
    # a complex parameter used through .conj(): autograd leaves its gradient a conjugated view
    weight = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    (torch.randn(8, dtype=torch.complex64) * weight.conj()).real.sum().backward()
    grad = weight.grad
    assert grad.is_conj()
    flags, total = FlagsAndSquares()([grad], torch.device("cpu"))
    assert not flags.any() and float(total) == pytest.approx(float(grad.abs().double().square().sum()), rel=1e-6)
    planted = grad.clone()
    planted[3] = complex(float("nan"), 0.0)
    assert NonFiniteCheck()([planted.conj()], torch.device("cpu")).tolist() == [True]


@pytest.mark.parametrize("layout", ["every-other", "column-slice", "expanded", "channels-last"])
def test_the_squares_of_gradients_no_dot_can_take_are_summed_without_drift(layout):
    torch.manual_seed(0)
    grad = {"every-other": lambda: torch.randn(8_000_000)[::2],
            "column-slice": lambda: torch.randn(4000, 1024)[:, :1000],
            "expanded": lambda: torch.randn(1, 4096).expand(1024, 4096),
            "channels-last": lambda: torch.randn(64, 64, 4, 4).to(memory_format=torch.channels_last)}[layout]()
    flags, total = FlagsAndSquares()([grad], torch.device("cpu"))
    # a float32 sum over 4M strided elements drifts by 1e-3; the accumulation in float64 does not
    assert not flags.any() and float(total) == pytest.approx(float(grad.double().square().sum()), rel=1e-6)
    # a channels-last one is contiguous once permuted: a dot takes its squares right after its read
    _, taken = NonFiniteCheck().read([grad], torch.device("cpu"), squares=True)
    assert (taken is not None and taken.positions == [0]) == (layout == "channels-last")


@contextlib.contextmanager
def _fp32_matmuls_in_bf16() -> Iterator[None]:
    """PyTorch allowed to compute CPU fp32 matmuls in bf16 (a property of a torch backend object: set and restored
    by hand)."""
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def test_reduced_fp32_matmul_precision_stays_exact():
    # bf16 matmuls would turn fp32 max into inf: the check must not use them, also with a plan made before the
    # precision changed (the large tensor's probe) and for small tensors read in batches
    cpu, largest = torch.device("cpu"), torch.finfo(torch.float32).max
    grads = [torch.full((1 << 20,), largest), *(torch.full((256,), largest) for _ in range(4))]
    planned_before = NonFiniteCheck(large_reader="probe")
    assert not planned_before(grads, cpu).any()
    with _fp32_matmuls_in_bf16():
        assert not planned_before(grads, cpu).any()
        assert not NonFiniteCheck()(grads, cpu).any()


def test_many_small_tensors_in_one_chunk_stay_exact_under_reduced_fp32_matmul_precision():
    # 512 tensors of 64 elements: one chunk, a product large enough for oneDNN to round its inputs to bf16 (fp32's
    # largest value becomes inf) when the precision allows it
    cpu, largest = torch.device("cpu"), torch.finfo(torch.float32).max
    grads = [torch.full((8, 8), largest) for _ in range(512)]
    with _fp32_matmuls_in_bf16():
        assert not NonFiniteCheck()(grads, cpu).any()
        grads[300][7, 7] = float("nan")
        assert NonFiniteCheck()(grads, cpu).tolist() == [i == 300 for i in range(len(grads))]


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
@pytest.mark.parametrize("last", [WIDTH + 5, WIDTH, 5], ids=["one-row-and-a-tail", "one-row", "a-tail"])
def test_a_last_piece_of_one_row_or_less_is_read_whole(last, reader, monkeypatch):
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    for position in (PIECE, PIECE + last // 2, PIECE + last - 1):
        grad = torch.zeros(PIECE + last)
        grad[position] = float("nan")
        assert NonFiniteCheck()([grad], torch.device("cpu")).tolist() == [True], position


@pytest.mark.parametrize("reader", ["probe", "aminmax"])
@pytest.mark.parametrize("last", [1, WIDTH + 1], ids=["one-element", "one-row-and-one-element"])
def test_a_last_piece_ending_in_one_element_is_read_by_its_plan_with_its_squares(last, reader, monkeypatch):
    # the plan reads it piece by piece and takes each piece's squares along; the plan-free fallback takes none
    monkeypatch.setenv("CKGUARD_CPU_READER", reader)
    cpu, check = torch.device("cpu"), NonFiniteCheck()
    torch.manual_seed(0)
    grad = torch.randn(PIECE + last)
    flags, taken = check.read([grad], cpu, squares=True)
    assert not flags.any() and taken is not None and taken.positions == [0]
    assert float(taken.total()) == pytest.approx(float(grad.double().square().sum()), rel=1e-5)
    grad[-1] = float("nan")
    flags, taken = check.read([grad], cpu, squares=True)
    assert flags.tolist() == [True] and taken is not None and not taken.each()[0].isfinite()


def test_the_large_tensor_reader_is_measured_once_per_layout_and_kept(monkeypatch):
    monkeypatch.delenv("CKGUARD_CPU_READER", raising=False)
    monkeypatch.setattr(finiteness, "_measured", {})
    monkeypatch.setattr(finiteness, "_measured_layouts", {})
    grads = [torch.randn(1024, 1024), torch.randn(1024, 512)]
    grads[1][7, 7] = float("nan")
    check = NonFiniteCheck()
    assert finiteness.cpu_large_tensor_reader() is None  # nothing measured yet
    assert check(grads, torch.device("cpu")).tolist() == [False, True]
    chosen = finiteness.cpu_large_tensor_reader()
    assert chosen in ("probe", "aminmax")
    finiteness._measured.clear()
    grads[1][7, 7] = 0.0
    assert check(grads, torch.device("cpu")).tolist() == [False, False]
    assert finiteness.cpu_large_tensor_reader() is None  # the cached plan kept its reader: nothing was measured again
    # another reader of the same layout (a second guard, the state check) takes the same reader, unmeasured
    planned = {}
    for reader in (NonFiniteCheck(), FlagsAndSquares()):
        reader(grads, torch.device("cpu"))
        checker = reader if isinstance(reader, NonFiniteCheck) else reader._check
        (plan,) = checker._plans.values()
        planned[type(reader).__name__] = plan.groups[0].large.reader
    assert finiteness.cpu_large_tensor_reader() is None
    assert set(planned.values()) == {chosen}


def test_an_unknown_forced_reader_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CKGUARD_CPU_READER", "fastest")
    with pytest.raises(ValueError, match="CKGUARD_CPU_READER must be one of 'auto', 'probe', 'aminmax'"):
        NonFiniteCheck()([torch.randn(1024, 1024)], torch.device("cpu"))


def test_the_probe_keeps_the_products_of_a_trained_models_gradients_normal():
    """Speed, pinned without a timing: a product below fp32's smallest normal number costs a CPU a microcode assist.
    With a scale of ``2**-100`` a trained MLP's gradients (most under ``1e-8``) made the read 4-15x slower
    (``benchmarks/RESULTS.md`` A15)."""
    tiny = torch.finfo(torch.float32).tiny
    for magnitude in (1e-11, 1e-20, 1e-30):
        assert magnitude * finiteness._PROBE_SCALE >= tiny


def test_the_state_check_reads_large_tensors_by_aminmax_at_any_setting(monkeypatch):
    """The state's magnitudes are anyone's (optimizer moments decaying under 1e-34 slow the probe down): the state
    check fixes ``aminmax`` for its large tensors, whatever the environment forces; it stays exact."""
    from lightning_ckguard.record.state_check import StateCheck

    monkeypatch.setenv("CKGUARD_CPU_READER", "probe")
    state = [("exp_avg", torch.full((1 << 19,), 1e-36)), ("weight", torch.full((1 << 19,), 3e38))]
    check = StateCheck()
    assert check.non_finite(state) == []
    (plan,) = check._check._plans.values()
    assert plan.groups[0].large.reader == "aminmax"
    state[0][1][-1] = float("nan")
    assert check.non_finite(state) == ["exp_avg"]
    with pytest.raises(ValueError, match="`large_reader` must be None, 'probe' or 'aminmax'"):
        NonFiniteCheck(large_reader="fastest")
