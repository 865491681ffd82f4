"""Which gradient source a strategy needs: DeepSpeed's optimizer partitions, or ``param.grad``.

The choice knows every source, so it lives above them: ``sources`` (``param.grad``) and ``deepspeed_sources`` (which
builds on it) stay unaware of each other's selection, and neither imports this module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_ckguard._distributed import is_deepspeed_strategy
from lightning_ckguard.record.deepspeed_sources import DeepSpeedGradients, is_deepspeed_engine
from lightning_ckguard.record.sources import GradientSource, ParameterGradients, unwrap_module


def gradient_source_for(strategy: Any, module: nn.Module) -> GradientSource:
    """Pick the gradient source for a Lightning (or Fabric) strategy.

    DeepSpeed (ZeRO 0-3) reads the optimizer's local gradient partitions from the engine: ``module`` itself when it
    is a ``DeepSpeedEngine`` (Fabric), else ``strategy.model`` (Lightning, after setup). Every other strategy
    (single device, DDP, FSDP, ``ModelParallelStrategy``) reads ``param.grad``, shard-locally for DTensors.

    Raises:
        ValueError: For a DeepSpeed strategy whose engine does not exist yet, rather than guarding nothing silently.
    """
    if is_deepspeed_engine(module):
        return DeepSpeedGradients(module)
    if is_deepspeed_strategy(strategy):
        engine = getattr(strategy, "model", None)
        if not is_deepspeed_engine(engine):
            raise ValueError(
                f"`{type(strategy).__name__}` has no DeepSpeed engine yet: create the gradient source after the "
                "strategy set up the model (in Lightning, from `on_fit_start` on), or pass the engine as `module`."
            )
        return DeepSpeedGradients(engine, module)
    return ParameterGradients(module)


def default_gradient_source(module: nn.Module) -> GradientSource:
    """What a guard given only ``module`` reads: a DeepSpeed engine's local gradient partitions when ``module`` is the
    engine or Fabric's wrapper of one (what ``fabric.setup`` returns under DeepSpeed), since ZeRO leaves nothing in
    ``param.grad``; else ``param.grad``. Parameters are named after your own module either way."""
    # Fabric's wrapper forwards attribute reads to your module; the engine is the module it runs forward through
    engine = module if is_deepspeed_engine(module) else getattr(module, "_forward_module", None)
    if is_deepspeed_engine(engine):
        return DeepSpeedGradients(engine, None if module is engine else unwrap_module(module))
    return ParameterGradients(unwrap_module(module))


__all__ = ["default_gradient_source", "gradient_source_for"]
