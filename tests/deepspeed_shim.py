"""Run Lightning's and Fabric's ``DeepSpeedStrategy`` on CPU processes, for tests and the CPU demo only.

DeepSpeed is a CUDA strategy in Lightning: ``setup_environment`` refuses any other accelerator,
``setup_distributed`` validates CUDA device indices, and ``deepspeed.initialize`` is given the root device's index
(``None`` on CPU). :class:`CPUDeepSpeedStrategy` removes exactly those three things; everything else (the engine,
ZeRO partitioning, DeepSpeed's own checkpoint directories) is DeepSpeed's real code running on gloo.
:class:`CPUFabricDeepSpeedStrategy` removes the same three from Fabric's ``DeepSpeedStrategy``.

Import this module before DeepSpeed is imported anywhere: it selects DeepSpeed's CPU accelerator and turns off the
shared-memory communication op, which DeepSpeed would otherwise JIT-compile (~80 s of C++) on first use.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    DEEPSPEED_UNAVAILABLE: str | None = None
except Exception as error:  # pragma: no cover - depends on the environment
    deepspeed = None
    DEEPSPEED_UNAVAILABLE = f"DeepSpeed is not importable: {type(error).__name__}: {error}"

from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy  # noqa: E402
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.strategies.ddp import DDPStrategy  # noqa: E402


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on CPU processes (gloo). For tests and demonstrations, not for real training."""

    strategy_name = "deepspeed_cpu_shim"

    def setup_environment(self) -> None:
        # skips DeepSpeedStrategy's CUDAAccelerator check; DDPStrategy's own setup runs setup_distributed
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # DeepSpeedStrategy.setup_distributed without _validate_device_index_selection (CUDA device indices)
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: Any, optimizer: Any | None, lr_scheduler: Any | None = None
    ) -> tuple[Any, Any]:
        engine, ds_optimizer, _ = _initialize_on_cpu(self, model, optimizer, lr_scheduler)
        return engine, ds_optimizer


class CPUFabricDeepSpeedStrategy(FabricDeepSpeedStrategy):
    """Fabric's ``DeepSpeedStrategy`` on CPU processes (gloo). For tests and demonstrations, not for real training."""

    def setup_environment(self) -> None:
        # skips DeepSpeedStrategy's CUDAAccelerator check; DDPStrategy's own setup runs _setup_distributed
        FabricDDPStrategy.setup_environment(self)

    def _setup_distributed(self) -> None:
        # DeepSpeedStrategy._setup_distributed without _validate_device_index_selection (CUDA device indices)
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def _initialize_engine(self, model: Any, optimizer: Any | None = None, scheduler: Any | None = None
                           ) -> tuple[Any, Any, Any]:
        return _initialize_on_cpu(self, model, optimizer, scheduler)


def _initialize_on_cpu(strategy: Any, model: Any, optimizer: Any | None, scheduler: Any | None) -> tuple[Any, Any, Any]:
    """``deepspeed.initialize`` as Lightning's and Fabric's strategies call it, but with ``device_rank`` the local rank:
    they pass ``root_device.index``, which is None for a CPU device. Returns the engine, its optimizer and scheduler."""
    assert deepspeed is not None
    engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        args=argparse.Namespace(device_rank=strategy.local_rank),
        config=strategy.config,
        model=model,
        model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dist_init_required=False,
    )
    return engine, ds_optimizer, ds_scheduler


def deepspeed_config(
    stage: int,
    precision: str,
    check_grad_overflow: bool | None = None,
    offload: bool = False,
    grad_accum_dtype: str | None = None,
) -> dict[str, Any]:
    """A small DeepSpeed config for ``stage`` (0-3) and Lightning ``precision`` (``"32-true"``, ``"bf16-*"``).

    ``check_grad_overflow`` sets ``bf16.check_grad_overflow`` (DeepSpeed's default for bf16 is on). ``offload``
    offloads the optimizer to the CPU with a plain torch optimizer. ``grad_accum_dtype="fp32"`` with bf16 and stage 1
    selects DeepSpeed's ``BF16_Optimizer``.
    """
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if precision.startswith("bf16"):
        config["bf16"] = {"enabled": True}
        if check_grad_overflow is not None:
            config["bf16"]["check_grad_overflow"] = check_grad_overflow
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False  # DeepSpeedCPUAdam would JIT-compile C++
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return config


__all__ = ["CPUDeepSpeedStrategy", "CPUFabricDeepSpeedStrategy", "DEEPSPEED_UNAVAILABLE", "deepspeed_config"]
