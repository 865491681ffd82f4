"""What makes a checkpoint complete, per format: only ``torch`` and the standard library, so that a process that
only reads checkpoints (``workers/poll_last.py``, polling while training saves) starts in the time of ``import torch``
instead of also importing Lightning."""

from __future__ import annotations

import os

import torch


def loads_completely(strategy: str, path: str) -> bool:
    """Whether ``path`` is a complete checkpoint of ``strategy``'s format (``ddp``: a file; ``deepspeed``, ``fsdp2``:
    a two-rank directory): every file it needs is there and loads."""
    try:
        if strategy == "ddp":
            return "state_dict" in torch.load(path, map_location="cpu", weights_only=False)
        if strategy == "fsdp2":
            from torch.distributed.checkpoint import FileSystemReader

            metadata = FileSystemReader(path).read_metadata()
            shards = {info.relative_path for info in metadata.storage_data.values()}
            torch.load(os.path.join(path, "meta.pt"), weights_only=False)
            return bool(shards) and all(os.path.getsize(os.path.join(path, shard)) > 0 for shard in shards)
        # DeepSpeed: the tag named by `latest`, holding the model states and both ranks' optimizer partitions
        with open(os.path.join(path, "latest")) as f:
            tag_dir = os.path.join(path, f.read().strip())
        names = os.listdir(tag_dir)
        partitions = [[n for n in names if n.endswith(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")] for r in (0, 1)]
        if "mp_rank_00_model_states.pt" not in names or not all(len(p) == 1 for p in partitions):
            return False
        needed = ["mp_rank_00_model_states.pt", *(p[0] for p in partitions)]
        return all(torch.load(os.path.join(tag_dir, n), map_location="cpu", weights_only=False) for n in needed)
    except Exception:
        return False
