"""``agree_on_failure``: every rank learns which ranks failed and the first one's error, from the same collectives.

One rank's view of a 2-rank world, with the collectives answered by a stand-in that holds what the peers send (the
real 2-process paths run in ``test_ddp.py``, ``test_rewind.py`` and ``test_publication_readers.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ckguard._distributed import agree_on_failure


class TwoRankView:
    """Rank ``rank`` of 2; ``peer`` is what the other rank sends to the gather, ``peer_broadcast`` its broadcast."""

    world_size = 2
    root_device = torch.device("cpu")

    def __init__(self, rank: int, peer: list[int], peer_broadcast: Any = None) -> None:
        self.rank, self.peer, self.peer_broadcast = rank, peer, peer_broadcast
        self.calls: list[str] = []

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_gather")
        rows = [tensor.tolist(), self.peer] if self.rank == 0 else [self.peer, tensor.tolist()]
        return torch.tensor(rows)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        self.calls.append(f"broadcast from {src}")
        return value if src == self.rank else self.peer_broadcast


def test_no_failure_costs_one_gather_and_carries_every_ranks_values():
    view = TwoRankView(rank=0, peer=[0, 7])
    found = agree_on_failure(view, None, values=[3])
    assert (found.ranks, found.cause, found.values) == ((), None, ((3,), (7,)))
    assert view.calls == ["all_gather"]


def test_the_failing_rank_and_its_peer_learn_the_same_cause_and_detail():
    failing = TwoRankView(rank=1, peer=[0])
    mine = agree_on_failure(failing, OSError("No space left on device"), detail="step=4.ckpt")
    peer = TwoRankView(rank=0, peer=[1], peer_broadcast=("OSError: No space left on device", "step=4.ckpt"))
    theirs = agree_on_failure(peer, None)
    assert mine == theirs
    assert (mine.ranks, mine.cause, mine.detail) == ((1,), "OSError: No space left on device", "step=4.ckpt")
    assert failing.calls == peer.calls == ["all_gather", "broadcast from 1"]


def test_without_peers_there_is_no_collective():
    class Single:
        world_size = 1

    found = agree_on_failure(Single(), RuntimeError("x"))
    assert (found.ranks, found.cause) == ((0,), "RuntimeError: x")
