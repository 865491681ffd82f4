"""What a rewind drops of DeepSpeed's ZeRO-1/2 optimizer, recognised by attribute (no DeepSpeed here); the real one,
on two processes, is ``tests/recover/test_rewind.py`` (``test_a_zero2_rewind_between_micro_batches_...``).

These pin the duck typing: the buffers of a ZeRO-1/2 optimizer are dropped whether it comes bare (Lightning's
``trainer.optimizers``) or inside Fabric's optimizer wrapper, whose own attributes would otherwise take the writes,
and an optimizer without them (torch's, ZeRO-3's, which has ``averaged_gradients`` only) is left as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.wrappers import _FabricOptimizer

from lightning_ckguard.recover.rewind import _clear_gradients


class ZeroLike:
    """The attributes of DeepSpeed's ``DeepSpeedZeroOptimizer`` the rewind touches, holding a first micro-batch's
    reduced partition as ZeRO-2 does between two micro-batches (offload off)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.1)  # ZeRO's own `optimizer`: the base one
        self.param_groups = self.optimizer.param_groups
        self.all_grad_tensors: dict[int, Any] = {0: [torch.full((3,), float("nan"))]}
        self.averaged_gradients: dict[int, Any] = {}  # set at the accumulation boundary only
        self.micro_step_id = 0
        self.cpu_offload = False
        self.released = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def _release_preflattened_grad_buffers(self) -> None:
        self.released += 1


def test_a_zero_optimizers_buffers_are_dropped_bare_and_inside_fabrics_wrapper():
    for wrap in (False, True):
        module = torch.nn.Linear(3, 1)
        zero = ZeroLike(module)
        owner: Any = _FabricOptimizer(zero, strategy=None) if wrap else zero  # type: ignore[arg-type]
        _clear_gradients([owner, module])
        assert zero.all_grad_tensors == {0: None}, f"wrapped: {wrap}"
        assert (zero.micro_step_id, zero.released) == (-1, 1), f"wrapped: {wrap}"
        assert "micro_step_id" not in vars(owner) or owner is zero, "written on the wrapper, not the optimizer"


def test_other_optimizers_are_left_as_they_were():
    module = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    optimizer.averaged_gradients = {0: ["kept"]}  # type: ignore[attr-defined]  # as ZeRO-3's: no all_grad_tensors
    optimizer.micro_step_id = 1  # type: ignore[attr-defined]
    module(torch.ones(2, 3)).sum().backward()
    _clear_gradients([optimizer, module])
    assert all(p.grad is None for p in module.parameters())
    assert (optimizer.averaged_gradients, optimizer.micro_step_id) == ({0: ["kept"]}, 1)  # type: ignore[attr-defined]
