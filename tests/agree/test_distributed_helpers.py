"""``agree_on_failure``: every rank learns which ranks failed and the first one's error, from the same collectives.

One rank's view of a 2-rank world, with the all-reduce answered by a stand-in that holds what the peer sends (the real
2-process paths run in ``test_ddp.py``, ``test_rewind.py`` and ``test_publication_readers.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from helpers import reducing_with_peers
from lightning_ckguard._distributed import FAILING_RANKS, RankMap, agree_on_failure, failure_words, own_write_failure


class RankView:
    """Rank ``rank`` of ``world_size``; ``peer_broadcast`` is what a peer broadcasts."""

    root_device = torch.device("cpu")

    def __init__(self, rank: int, world_size: int = 2, peer_broadcast: Any = None) -> None:
        self.global_rank, self.world_size, self.peer_broadcast = rank, world_size, peer_broadcast
        self.calls: list[str] = []

    def broadcast(self, value: Any, src: int = 0) -> Any:
        self.calls.append(f"broadcast from {src}")
        return value if src == self.global_rank else self.peer_broadcast


def test_no_failure_costs_one_all_reduce_and_carries_the_largest_values(monkeypatch):
    view = RankView(rank=0)
    ops = reducing_with_peers(monkeypatch, [failure_words(RankView(1), None, [7])])
    found = agree_on_failure(view, None, values=[3])
    assert (found.ranks, found.cause, found.values) == ((), None, (7,))
    assert ops == ["max"] and view.calls == []


def test_the_failing_rank_and_its_peer_learn_the_same_cause_and_detail(monkeypatch):
    failing, peer = RankView(rank=1), RankView(rank=0, peer_broadcast=("OSError: No space left on device",
                                                                         "step=4.ckpt"))
    ops = reducing_with_peers(monkeypatch, [failure_words(peer, None)], [failure_words(failing, OSError())])
    mine = agree_on_failure(failing, OSError("No space left on device"), detail="step=4.ckpt")
    theirs = agree_on_failure(peer, None)
    assert mine == theirs
    assert (mine.ranks, mine.cause, mine.detail) == ((1,), "OSError: No space left on device", "step=4.ckpt")
    assert failing.calls == peer.calls == ["broadcast from 1"] and ops == ["max", "max"]


def test_without_peers_there_is_no_collective(monkeypatch):
    ops = reducing_with_peers(monkeypatch)

    class Single:
        world_size = 1

    found = agree_on_failure(Single(), RuntimeError("x"))
    assert (found.ranks, found.cause) == ((0,), "RuntimeError: x")
    assert ops == []


def test_a_rank_map_names_every_member_up_to_its_size_and_the_lowest_of_each_run_beyond():
    def members(rank_map: RankMap, world_size: int, ranks: set[int]) -> tuple[int, ...]:
        words = torch.tensor([rank_map.words(r, world_size, r in ranks) for r in range(world_size)])
        return rank_map.ranks(words.amax(0).tolist(), world_size)

    assert members(FAILING_RANKS, 8, {0, 3, 7}) == (0, 3, 7)
    assert members(FAILING_RANKS, 1024, {5, 6, 700}) == (5, 700)  # 5 and 6 share the first eighth
    assert members(FAILING_RANKS, 1024, set(range(1024))) == tuple(range(0, 1024, 128))
    assert members(RankMap(4), 4, set()) == ()


def test_a_distributed_checkpoint_meeting_is_held_by_the_thread_that_entered_it_only(monkeypatch):
    """The replaced function is a module global: another thread's distributed checkpoint call inside the block (a
    save of its own, on its own group) calls straight through, and takes nothing of the meeting away."""
    import threading

    import torch.distributed.checkpoint as dcp

    from lightning_ckguard._distributed import DistributedCheckpointMeeting

    ran: list[str] = []
    monkeypatch.setattr(dcp, "save", lambda *args, **kwargs: ran.append(threading.current_thread().name))
    ops = reducing_with_peers(monkeypatch, [failure_words(RankView(1), None)])
    with DistributedCheckpointMeeting(RankView(rank=0), "save", enabled=True) as meeting:
        side = threading.Thread(target=dcp.save, args=({},), name="side")
        side.start()
        side.join()
        assert ops == []  # the side thread's call met nobody
        dcp.save({})
        assert ops == ["max"]  # this thread's call met its peers first, once
    assert ran == ["side", threading.current_thread().name]
    assert not meeting.settle(None) and ops == ["max"]  # past its one meeting point: no second meeting


def _distributed_checkpoint_failure(ranks: tuple[int, ...]) -> BaseException:
    """What ``torch.distributed.checkpoint`` raises on every rank when the parts of ``ranks`` failed."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.utils import _wrap_exception

    failures = {}
    for rank in ranks:
        try:
            raise OSError(28, f"No space left on device (rank {rank})")
        except OSError as error:
            failures[rank] = _wrap_exception(error)
    return CheckpointException("CheckpointException", failures)


def test_a_distributed_checkpoint_failure_is_this_ranks_own_only_where_it_names_this_rank():
    # this process is rank 0: a failure of rank 1's part alone is learned in the agreement, not held as its own
    # (it would count rank 0 among the failed ranks and raise the raw CheckpointException, a BaseException)
    assert own_write_failure(_distributed_checkpoint_failure((1,))) is None
    own = own_write_failure(_distributed_checkpoint_failure((0, 1)))
    assert isinstance(own, OSError) and "rank 0" in str(own)
    plain = OSError(28, "No space left on device")
    assert own_write_failure(plain) is plain
