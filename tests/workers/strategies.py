"""The Lightning strategies the two-rank CPU workers train under, built in one place.

``make_strategy(kind, timeout=...)`` for every ``kind`` a worker uses:

- ``ddp`` and ``zero1``: ``DDPStrategy``. ZeRO-1 is the optimizer (``ZeroRedundancyOptimizer``, chosen by the
  model), not the strategy, so both kinds build the same strategy;
- ``fsdp2``: ``ModelParallelStrategy`` with every rank in the data-parallel mesh (``fully_shard``, no tensor
  parallelism);
- ``ds1``, ``ds2``, ``ds3``: DeepSpeed ZeRO stage 1, 2 or 3 on CPU processes, through ``tests/deepspeed_shim.py``.

Every strategy gets the collective ``timeout``, which is required: a rank left waiting for a peer fails after it
instead of hanging (``run_ranks`` adds the wall-clock kill on top).

The strategy classes come from the worker's Lightning namespace (``tests/lightning_namespace.py``:
``lightning.pytorch`` by default, ``pytorch_lightning`` with ``CKGUARD_TEST_LIGHTNING=pytorch_lightning``), so they fit
its Trainer. The DeepSpeed shim subclasses ``lightning.pytorch``'s ``DeepSpeedStrategy``: the DeepSpeed kinds exist
for ``lightning.pytorch`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning_namespace import ENV, lightning_module, namespace

DDP_KINDS = ("ddp", "zero1")
DEEPSPEED_STAGES = {"ds1": 1, "ds2": 2, "ds3": 3}
KINDS = (*DDP_KINDS, "fsdp2", *DEEPSPEED_STAGES)


def make_strategy(
    kind: str,
    *,
    timeout: timedelta,
    precision: str = "bf16-mixed",
    check_grad_overflow: bool | None = None,
    wrap: Callable[[type], type] | None = None,
    **deepspeed_config: Any,
) -> Any:
    """A new strategy of ``kind`` whose collectives time out after ``timeout``.

    ``precision`` and ``check_grad_overflow`` go into the DeepSpeed config (its ``bf16`` section; ``None`` keeps
    DeepSpeed's default, which is on), and so do ``deepspeed_config``'s keywords (``offload``, ``grad_accum_dtype``,
    see ``deepspeed_shim.deepspeed_config``); the other kinds take their precision from the ``Trainer`` alone.
    ``wrap`` receives the strategy class and returns the class to instantiate (e.g. a subclass with probes).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown strategy kind {kind!r}; expected one of {KINDS}")
    if deepspeed_config and kind not in DEEPSPEED_STAGES:
        # a DeepSpeed option on another kind would be silently ignored, and the scenario would not test what it says
        raise ValueError(f"DeepSpeed config {sorted(deepspeed_config)} given for the {kind!r} strategy")
    wrap = wrap or (lambda cls: cls)
    strategies = lightning_module("strategies")
    if kind in DDP_KINDS:
        return wrap(strategies.DDPStrategy)(timeout=timeout)
    if kind == "fsdp2":
        return wrap(strategies.ModelParallelStrategy)(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout)
    if namespace() != "lightning.pytorch":
        raise ValueError(f"the {kind!r} strategy (tests/deepspeed_shim.py) is a lightning.pytorch strategy; this "
                         f"worker builds from {namespace()} ({ENV})")
    # imported only here, and so first here unless the worker imported it already: it selects DeepSpeed's CPU
    # accelerator and avoids a JIT build, which must happen before DeepSpeed is imported anywhere
    import deepspeed_shim

    config = deepspeed_shim.deepspeed_config(DEEPSPEED_STAGES[kind], precision, check_grad_overflow,
                                             **deepspeed_config)
    return wrap(deepspeed_shim.CPUDeepSpeedStrategy)(config=config, timeout=timeout)
