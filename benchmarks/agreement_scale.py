"""The agreement at scale, simulated: collectives and bytes per rank of one boundary, from 2 to 16,384 ranks.

No processes are started: PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``) stands in
for the world, so this one process is rank 0 of N, and the real agreement code runs (``GradientGuard.agree_carrying``
with what the Lightning callback carries in it: the top-K vote and the staged writer's report). Every
``torch.distributed`` collective it calls is recorded with its tensors' sizes. The fake group answers an all-reduce
with this rank's own tensor, so the rejected boundary is one where rank 0 recorded the NaN: the roll call runs, as it
would on every rank.

Per world size it prints the collectives of an accepted and of a rejected boundary, and the bytes one rank sends and
receives in them: the payload (what it hands to the collective and gets back), and on the wire under the ring
algorithm (an all-reduce of B bytes sends and receives 2B(N-1)/N; an all-gather of B bytes per rank, B(N-1)). The
previous agreement's one all_gather (57 int64 and 3 carried, per rank) is shown alongside, from its layout.

    python benchmarks/agreement_scale.py                     # world sizes 2 8 64 1024 16384, a few seconds
    python benchmarks/agreement_scale.py --world-sizes 2 131072
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, recorded_guard, table  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402

from lightning_ckguard.agree.top_k_vote import local_vote  # noqa: E402
from lightning_ckguard.publish.durability import durability  # noqa: E402
from lightning_ckguard.publish.storage import storage_for  # noqa: E402
from lightning_ckguard.publish.writers import StagedWriter  # noqa: E402
from lightning_ckguard.record.state_check import STATE_SUMMARY_SIZE  # noqa: E402
from lightning_ckguard.record.window import SUMMARY_SIZE  # noqa: E402

#: int64 per rank the previous agreement gathered from every rank: the summary, the vote (2), the writer's report (1)
BEFORE_WORDS = SUMMARY_SIZE + STATE_SUMMARY_SIZE + 3


class Recorder:
    """Wraps ``torch.distributed``'s collectives: each call is recorded as ``(name, bytes in, bytes out)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._originals: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Recorder:
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "broadcast_object_list",
                     "barrier"):
            original = self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._recording(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _recording(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            size = sum(t.numel() * t.element_size() for t in tensors)
            world = dist.get_world_size()
            self.calls.append((name, size, size * world if name.startswith("all_gather") else size))
            return original(*args, **kwargs)

        return recorded


def wire_bytes(name: str, size: int, world: int) -> int:
    """Bytes one rank sends (and receives) under the ring algorithm."""
    if name == "all_reduce":
        return 2 * size * (world - 1) // world
    if name.startswith("all_gather"):
        return size * (world - 1)
    return size


def boundary(world: int, nan: bool) -> list[tuple[str, int, int]]:
    """One boundary's agreement on rank 0 of ``world``, as the callback runs it; its collectives."""
    model, guard = recorded_guard(nan)
    group = dist.group.WORLD
    # the staged writer's own report, as the callback carries it on local disk: which rank failed, and whether a
    # boundary went unpublished
    writer = StagedWriter(group, storage_for(get_filesystem(".")), durability(True))
    carry = [*local_vote(group, True, True), *writer.report()]
    state = {"model": model}  # the state check runs too, and names a non-finite tensor on a rejection
    with Recorder() as recorder:
        verdict, _ = guard.agree_carrying(group, carry, global_step=1, state=state)
    assert verdict.accepted is not nan
    return recorder.calls


def describe(calls: list[tuple[str, int, int]], world: int) -> list[str]:
    names = " + ".join(f"{name}({size // 8} int64)" for name, size, _ in calls)
    payload = f"{sum(s for _, s, _ in calls):,} / {sum(o for _, _, o in calls):,}"
    wire = sum(wire_bytes(name, size, world) for name, size, _ in calls)
    return [str(len(calls)), names, payload, f"{wire:,}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64, 1024, 16384])
    args = parser.parse_args()
    print(f"# The agreement at scale, simulated (fake process group, rank 0 of N)\n\nMachine: {machine()}\n")
    rows = []
    for world in args.world_sizes:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            accepted, rejected = boundary(world, nan=False), boundary(world, nan=True)
        finally:
            dist.destroy_process_group()
        before = BEFORE_WORDS * 8
        rows.append([f"{world:,}", "accepted", *describe(accepted, world),
                     f"{before:,} / {before * world:,}", f"{before * (world - 1):,}"])
        rows.append([f"{world:,}", "rejected", *describe(rejected, world), "same", "same"])
    print(table(["ranks", "boundary", "collectives", "which", "payload bytes per rank (sent / received)",
                 "on the wire per rank (ring)", "before: payload (sent / received)", "before: on the wire"], rows))


if __name__ == "__main__":
    main()
