"""What the rewind tests observe: the live training state of a rank compared, tensor by tensor, with the checkpoint
it went back to, read from the files; and whether checkpoints on disk load and hold only finite tensors.

Each strategy stores its state its own way, and each rank compares what it holds itself:

- DDP: the one ``.ckpt`` file (``state_dict``, ``optimizer_states``; with EMA ``current_model_state`` is the live
  weights and ``state_dict`` the average);
- DDP + ``ZeroRedundancyOptimizer``: the weights as above; the optimizer state of the parameters this rank owns,
  against their entries of the consolidated state in the file;
- DeepSpeed: the engine's directory, ``checkpoint/*model_states.pt`` (the module, for ZeRO-1/2) and this rank's
  ``checkpoint/*zero_pp_rank_{rank}_*optim_states.pt`` (its optimizer partition: fp32 master weights and moments);
- FSDP2: the distributed checkpoint, read with ``torch.distributed.checkpoint`` into copies of this rank's shards.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of nested dicts, lists and tuples, with its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}/{index}")
    else:
        yield prefix, value


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def compare_tensors(live: Any, stored: Any) -> dict[str, Any]:
    """Compare every tensor of ``live`` with the tensor at the same path in ``stored`` (exactly, ``torch.equal``,
    on the CPU). Returns how many were compared, the paths that differ and the paths missing on either side."""
    live_tensors = {path: t for path, t in flatten(live) if isinstance(t, Tensor)}
    stored_tensors = {path: t for path, t in flatten(stored) if isinstance(t, Tensor)}
    different = [
        path for path in sorted(live_tensors.keys() & stored_tensors.keys())
        if not torch.equal(_local(live_tensors[path]).detach().cpu(), _local(stored_tensors[path]).detach().cpu())
    ]
    return {
        "compared": len(live_tensors.keys() & stored_tensors.keys()),
        "different": different[:10],
        "missing": sorted(live_tensors.keys() ^ stored_tensors.keys())[:10],
    }


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _ddp_state(trainer: Any, path: str) -> dict[str, Any]:
    checkpoint = _load(path)
    module = trainer.lightning_module
    optimizer = trainer.optimizers[0]
    weights = checkpoint.get("current_model_state", checkpoint["state_dict"])  # with EMA, the live weights
    result = {"weights": compare_tensors(module.state_dict(), weights)}
    stored_optimizer = checkpoint["optimizer_states"][0]
    if hasattr(optimizer, "_param_to_index"):  # ZeroRedundancyOptimizer: this rank's own parameters
        own = {optimizer._param_to_index[p]: state for p, state in optimizer.optim.state.items()}
        result["optimizer"] = compare_tensors(own, {i: stored_optimizer["state"][i] for i in own})
    else:
        result["optimizer"] = compare_tensors(optimizer.state_dict(), stored_optimizer)
    result["schedulers"] = [config.scheduler.state_dict() == stored for config, stored in
                            zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"], strict=True)]
    averaging = [c for c in trainer.callbacks if type(c).__name__ == "EMAWeightAveraging"]
    if averaging:  # the average model: "state_dict" holds its weights, "averaging_state" its counters
        stored_average = {"module." + k: v for k, v in checkpoint["state_dict"].items()}
        stored_average |= checkpoint["averaging_state"]
        result["average"] = compare_tensors(averaging[0]._average_model.state_dict(), stored_average)
    return result


def _deepspeed_state(trainer: Any, path: str) -> dict[str, Any]:
    engine = trainer.strategy.deepspeed_engine
    rank = trainer.global_rank
    tag = os.path.join(path, "checkpoint")
    optimizer_files = glob.glob(os.path.join(tag, f"*zero_pp_rank_{rank}_*optim_states.pt"))
    assert len(optimizer_files) == 1, sorted(os.listdir(tag))
    stored_optimizer = _load(optimizer_files[0])["optimizer_state_dict"]
    result = {"optimizer": compare_tensors(engine.optimizer.state_dict(), stored_optimizer)}
    if getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        # ZeRO-3: this rank's weights are its partitions, restored from the fp32 master partitions in its file
        stored = stored_optimizer["fp32_flat_groups"]
        partitions = engine.optimizer.fp16_partitioned_groups_flat
        live = [p.detach().float() for p in partitions]
        result["weights"] = compare_tensors(live, [s[: p.numel()].to(p.dtype).float() for s, p in
                                                   zip(stored, partitions, strict=True)])
    else:
        module_file = os.path.join(tag, "mp_rank_00_model_states.pt")
        result["weights"] = compare_tensors(engine.module.state_dict(), _load(module_file)["module"])
    return result


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _fsdp2_state(trainer: Any, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = trainer.strategy.model, trainer.optimizers[0]
    live = {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizer)}
    stored = _clone(live)  # copies of this rank's shards, so loading into them leaves the live state alone
    dcp.load(stored, checkpoint_id=path)  # every rank, together
    return {"weights": compare_tensors(live["state_dict"], stored["state_dict"]),
            "optimizer": compare_tensors(live["optimizer_0"], stored["optimizer_0"])}


def compare_with_checkpoint(trainer: Any, path: str, kind: str) -> dict[str, Any]:
    """This rank's weights and optimizer state against the checkpoint at ``path`` (every rank calls it together)."""
    if kind in ("ddp", "zero1"):
        return _ddp_state(trainer, path)
    if kind.startswith("ds"):
        return _deepspeed_state(trainer, path)
    return _fsdp2_state(trainer, path)


def all_finite(value: Any) -> bool:
    """Whether every floating-point tensor of the training state is finite. Callback state is left out: the
    checkpoint callback's own ``kth_value`` is -inf or inf by design while its top-K is not full."""
    return all(bool(torch.isfinite(t.float()).all()) for path, t in flatten(value)
               if isinstance(t, Tensor) and t.is_floating_point() and t.numel() and not path.startswith("/callbacks"))


def checkpoint_loads_finite(path: str) -> bool:
    """Whether the checkpoint at ``path`` (a file, a DeepSpeed directory or a distributed checkpoint) loads, here in
    one process, and holds only finite floating-point tensors."""
    if os.path.isfile(path):
        return all_finite(_load(path))
    files = sorted(glob.glob(os.path.join(path, "**", "*.pt"), recursive=True))
    if glob.glob(os.path.join(path, "*.distcp")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            converted = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(path, converted)
            return all_finite(_load(converted))
    return bool(files) and all(all_finite(_load(f)) for f in files)


__all__ = ["all_finite", "checkpoint_loads_finite", "compare_tensors", "compare_with_checkpoint", "flatten"]
