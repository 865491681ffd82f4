"""Strategy facts and the small collectives every concern shares: whether there are peers, one all-reduce of a
few integers, a broadcast of a Python value, and a named barrier. Each is a no-op (no collective) without peers.

The all-reduce sends and receives the same bytes at any world size: what a rank contributes is reduced with MAX (a
field reduced with MIN is sent negated), and the ranks a decision names ride as a :class:`RankMap`, a fixed number of
words. It runs on the process group of the Lightning or Fabric strategy (the default group, whose timeout applies)
through ``torch.distributed`` itself: the strategies' own ``reduce`` adds a barrier before it. Broadcasts and barriers
go through the strategy. Nothing here imports recording, agreement or publication code: every other module may import
this one.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")
#: What a field reduced with MIN is sent as by a rank that has no value for it (it then never wins the MAX).
NO_VALUE = -(2**62)


def is_multiprocess(strategy: Any) -> bool:
    """Whether ``strategy`` has peers to agree with (a world size above one)."""
    return int(getattr(strategy, "world_size", 1)) > 1


def is_rank_zero(collective: Any) -> bool:
    """Whether this rank is rank 0 of ``collective`` (a strategy, a process group's collectives), the one that writes,
    moves and evicts; the only one without peers (``None``)."""
    return bool(getattr(collective, "is_global_zero", True))


def require_collective(collective: Any) -> None:
    """Refuse, with a ``ValueError``, what is not a Lightning/Fabric strategy, a process group's collectives, a
    ``torch.distributed`` process group or ``None``: anything else would silently agree as a single process. The
    ``Fabric`` object (or a Trainer) is refused too, naming its ``.strategy``: it has a ``world_size`` and agrees, but
    writes through no strategy of its own (under FSDP2 the publisher would save only rank 0's shard)."""
    if collective is None or isinstance(collective, dist.ProcessGroup):
        return
    if _holds_a_strategy(collective):
        owner = "fabric" if _is_fabric(collective) else type(collective).__name__.lower()
        raise ValueError(
            f"`collective` must be a Lightning/Fabric strategy, a torch.distributed ProcessGroup or None, got the "
            f"{type(collective).__name__} object itself: pass its strategy, `{owner}.strategy`."
        )
    if hasattr(collective, "world_size"):
        return
    raise ValueError(
        f"`collective` must be a Lightning/Fabric strategy, a torch.distributed ProcessGroup or None, "
        f"got {type(collective).__name__}."
    )


def _is_fabric(collective: Any) -> bool:
    return any(cls.__name__ == "Fabric" for cls in type(collective).__mro__)


def _holds_a_strategy(collective: Any) -> bool:
    """Whether ``collective`` is a ``Fabric`` object (or anything holding a strategy: a Trainer), not a strategy."""
    if _is_fabric(collective):
        return True
    strategy = getattr(type(collective), "strategy", None)  # the class's: a strategy has none, a Fabric a property
    return isinstance(strategy, property) and hasattr(getattr(collective, "strategy", None), "world_size")


def default_collective(collective: Any) -> Any:
    """``collective``, or for ``None`` the default process group when ``torch.distributed`` is initialized with peers:
    a rank that asked for no collective while it has peers would decide alone."""
    if collective is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return collective


def rank_and_world(collective: Any) -> tuple[int, int]:
    """``(this rank, world size)`` of ``collective``: a strategy, a process group's collectives, a
    ``torch.distributed`` process group, or ``None`` (a single process)."""
    if collective is None:
        return 0, 1
    if isinstance(collective, dist.ProcessGroup):
        return dist.get_rank(collective), dist.get_world_size(collective)
    rank = getattr(collective, "global_rank", getattr(collective, "group_rank", 0))
    return int(rank), int(getattr(collective, "world_size", 1))


_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def all_reduce_values(collective: Any, values: Tensor, op: str = "max") -> Tensor:
    """``values`` (int64 words, or a spike gate's float64 step values) reduced over every rank of ``collective`` with
    ``op`` (``"max"`` or ``"sum"``), in place, in one ``torch.distributed.all_reduce``; the same bytes at any world
    size. Without peers, ``values`` and no collective."""
    if isinstance(collective, dist.ProcessGroup):
        group: Any = collective
    elif not is_multiprocess(collective):
        return values
    else:  # a process group's collectives name theirs; Lightning's and Fabric's strategies run on the default one
        group = getattr(collective, "group", None)
    dist.all_reduce(values, op=_REDUCE_OPS[op], group=group)
    return values


def reduce_ints(collective: Any, values: Sequence[int]) -> list[int]:
    """The largest of every rank's ``values``, field by field (the same length on every rank), from one all-reduce
    (:func:`all_reduce_values`). Without peers, ``list(values)`` and no collective."""
    device = getattr(collective, "root_device", torch.device("cpu"))
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    return all_reduce_values(collective, local).tolist()


@dataclass(frozen=True)
class RankMap:
    """A set of ranks in ``slots`` words, the same at any world size: the ranks are split into ``slots`` runs of
    consecutive ranks, and each word names the lowest member of its run (every member, up to ``slots`` ranks).

    Each rank sends :meth:`words` and the words are reduced with MAX; :meth:`ranks` reads the reduced words. Members
    of a higher ``priority`` win their run.
    """

    slots: int

    def words(self, rank: int, world_size: int, member: bool, priority: int = 0) -> list[int]:
        """This rank's words: zeros, or, if it is a ``member``, its key in the word of its run."""
        words = [0] * self.slots
        if member:
            words[rank * self.slots // world_size] = (priority + 1) * world_size - rank
        return words

    def ranks(self, words: Sequence[int], world_size: int) -> tuple[int, ...]:
        """The members named by the reduced ``words``, in rank order."""
        return tuple(-int(word) % world_size for word in words if word > 0)


#: Up to how many failing ranks (every one of them up to this world size) a failure names.
FAILING_RANKS = RankMap(8)


def broadcast_value(strategy: Any, value: T, src: int = 0) -> T:
    """``value`` as rank ``src`` has it, on every rank of ``strategy`` (a strategy, a process group's collectives, a
    ``torch.distributed`` process group). Without peers, ``value`` itself."""
    if isinstance(strategy, dist.ProcessGroup):
        return broadcast_in_group(strategy, value, src) if dist.get_world_size(strategy) > 1 else value
    if not is_multiprocess(strategy):
        return value
    return strategy.broadcast(value, src=src)


def broadcast_in_group(group: dist.ProcessGroup | None, value: T, src: int = 0) -> T:
    """``value`` as rank ``src`` of ``group`` (None: the default group) has it, on every rank of ``group``."""
    box = [value]
    global_src = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast_object_list(box, src=global_src, group=group)
    return box[0]


def barrier(strategy: Any, name: str) -> None:
    """Wait for every rank at ``name``. Without peers, returns at once."""
    if is_multiprocess(strategy):
        strategy.barrier(name)


def every_rank_arrives(name: str, timeout: timedelta) -> bool:
    """Whether every rank of the default process group reached ``name``, learned WITHOUT a collective: while an
    exception is handled, a peer may be inside another collective (DDP's gradient all-reduce), which an all-reduce
    would pair with (gloo aborts the process on a size mismatch; an equal size mixes the two silently). Each rank sets
    its key in the rendezvous store and waits up to ``timeout`` for every peer's, in two rounds, so that a rank that
    gave up the first never lets a peer go on alone. ``name`` must be the same on every rank for the same point and
    never used twice. False where the store cannot be asked (none, one without ``check``, its server gone).
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        for stage in ("arrived", "going"):
            store.set(f"ckguard/{name}/{stage}/{rank}", "1")
            deadline = time.monotonic() + timeout.total_seconds()
            keys = [f"ckguard/{name}/{stage}/{peer}" for peer in range(world_size)]
            while not store.check(keys):  # polled: the store's own wait takes the store's (long) timeout
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    except Exception:  # no default group or store, a store without `check`, or its server gone with its rank
        return False
    return True


def write_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a checkpoint write (or load) may fail with, held and agreed on instead of raised alone: every
    ``Exception``, and ``torch.distributed.checkpoint``'s ``CheckpointException``, a ``BaseException`` (an FSDP2
    distributed-checkpoint save or load that failed on some rank). That module is only looked up once imported: a
    distributed checkpoint that ran imported it, and one that never ran cannot have raised (nor may it exist)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    dcp_error = getattr(api, "CheckpointException", None)
    return (Exception,) if dcp_error is None else (Exception, dcp_error)


def own_write_failure(error: BaseException) -> BaseException | None:
    """What of a write's ``error`` (one of :func:`write_errors`) is this rank's own failure, to hold for the agreement.
    A distributed checkpoint's ``CheckpointException`` reaches every rank and names the ranks whose part failed: a
    rank among them holds its own original error (a full disk's ``OSError``), one whose part was written holds
    nothing (it learns of the others in the agreement, and raises ``CheckpointWriteError``); so does a rank that
    learned of another's failure at a :class:`DistributedCheckpointMeeting`. Any other is its own."""
    if isinstance(error, PeerFailedFirst):
        return None
    failures = getattr(error, "failures", None) if not isinstance(error, Exception) else None
    if not isinstance(failures, dict):
        return error
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0  # the default group's, as DCP's
    if rank not in failures:
        return None
    own = failures[rank][0] if isinstance(failures[rank], tuple) and failures[rank] else None
    return own if isinstance(own, BaseException) else error


class PeerFailedFirst(Exception):
    """Raised out of a distributed checkpoint's save or load on a rank whose own part was ready, when the
    :class:`DistributedCheckpointMeeting` before it found that another rank had failed: not this rank's failure."""


class DistributedCheckpointMeeting:
    """Agreements every rank joins right before each ``torch.distributed.checkpoint`` ``save`` (or ``load``) call of
    one sharded save or load (a ``with`` block), and with ``until_barrier`` in place of the strategy barrier that
    ends it (Fabric's load ends with one).

    A sharded strategy prepares each rank's part on its own (the modules' and optimizers' state dicts offloaded to the
    CPU, your objects' ``state_dict()``) before each of the distributed checkpoint's calls, and those calls are
    collective. A rank whose preparation failed would leave its peers waiting in the next call until the collective
    timeout. Instead it joins them at their next meeting point (:meth:`settle`), every rank learns of the failure
    there, and no rank goes past it: the peers leave with :class:`PeerFailedFirst`. The block's last point is the
    barrier, or without one its first distributed checkpoint call (what follows a save, the agreement on its outcome,
    hears of any later failure); a rank past its last point settles without meeting. Only the thread that entered the
    block meets (the replaced functions are module globals): other threads call through. Without peers, or not
    ``enabled``, nothing is replaced and nothing meets.
    """

    def __init__(self, strategy: Any, function: str, enabled: bool, until_barrier: bool = False) -> None:
        self._strategy, self._function, self._until_barrier = strategy, function, until_barrier
        self.enabled = enabled and is_multiprocess(strategy)
        self._done = False  # past the block's last meeting point, or a failure met at one
        self._found = Failures(())

    def __enter__(self) -> DistributedCheckpointMeeting:
        self._stack = ExitStack()
        self._thread = threading.get_ident()  # the one that meets
        if self.enabled:
            import torch.distributed.checkpoint as dcp

            self._meet_before(dcp, self._function, last=not self._until_barrier)
            if self._until_barrier:
                self._meet_before(self._strategy, "barrier", last=True, instead=True)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _meet_before(self, owner: Any, name: str, last: bool, instead: bool = False) -> None:
        """Replace ``owner.name`` for the block: meet first (or, ``instead``, only meet), then call it."""
        run = getattr(owner, name)

        def meeting_first(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                return run(*args, **kwargs)
            if not self._done:
                self._done = last  # before the collective: a rank whose meeting itself failed never meets twice
                if self._meet(None).ranks:
                    self._done = True
                    raise PeerFailedFirst(f"rank {self._found.ranks[0]} failed during the distributed checkpoint's "
                                          f"{self._function}: {self._found.cause}")
            return None if instead else run(*args, **kwargs)

        self._stack.enter_context(replaced_attribute(owner, name, meeting_first))

    def _meet(self, failure: BaseException | None) -> Failures:
        self._found = agree_on_failure(self._strategy, failure)
        return self._found

    def settle(self, failure: BaseException | None) -> bool:
        """Join the peers at their next meeting point, with this rank's ``failure`` (or None), if this rank left the
        block before its last one; return whether a meeting found a failure on some rank (then no rank went on)."""
        if self.enabled and not self._done:
            self._done = True
            self._meet(failure)
        return bool(self._found.ranks)


@contextmanager
def replaced_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name`` to ``value`` for the duration, then restore exactly what was there: the instance's (or
    module's) own attribute, or none (so the class's method shows through again)."""
    own = vars(owner).get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


_ABSENT = object()


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"``: how one rank's error is told to the others."""
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Failures:
    """What every rank learned, at the same point, of a step that may have failed on some ranks.

    Attributes:
        ranks: The ranks on which it failed (empty: it succeeded everywhere); beyond eight ranks, the lowest failing
            rank of each eighth of the ranks (:data:`FAILING_RANKS`).
        cause: The first failing rank's error, described (:func:`describe_error`); None when nothing failed.
        detail: What that rank sent along with it (a path, say); None when nothing failed.
        values: The largest of every rank's extra integers, field by field (what :func:`agree_on_failure` got as
            ``values``).
    """

    ranks: tuple[int, ...]
    cause: str | None = None
    detail: Any = None
    values: tuple[int, ...] = ()


def failure_words(collective: Any, failure: BaseException | None, values: Sequence[int] = ()) -> list[int]:
    """This rank's part of a failure agreement: which rank failed (:data:`FAILING_RANKS`), then ``values``."""
    rank, world_size = rank_and_world(collective)
    return [*FAILING_RANKS.words(rank, world_size, failure is not None), *values]


def agree_on_failure(
    strategy: Any, failure: BaseException | None, *, values: Sequence[int] = (), detail: Any = None
) -> Failures:
    """Tell every rank which ranks failed, and the first one's error: one all-reduce of which ranks failed (and
    ``values``, a few integers every rank sends alike, reduced with MAX), then, only on a failure, one broadcast from
    the first failing rank of its description and ``detail``. The same :class:`Failures` on every rank; without peers,
    no collective.

    The pattern behind every "it failed on some rank, so every rank raises": a rank that raised alone would leave its
    peers waiting in the next collective.
    """
    reduced = reduce_ints(strategy, failure_words(strategy, failure, values))
    return failures_from(strategy, reduced, failure, detail)


def failures_from(
    strategy: Any, reduced: Sequence[int], failure: BaseException | None, detail: Any = None
) -> Failures:
    """:func:`agree_on_failure` from its words already reduced (:func:`failure_words`, riding in another collective):
    only on a failure, one broadcast of the first failing rank's error."""
    _, world_size = rank_and_world(strategy)
    failed = FAILING_RANKS.ranks(reduced[: FAILING_RANKS.slots], world_size)
    extra = tuple(int(value) for value in reduced[FAILING_RANKS.slots :])
    if not failed:
        return Failures((), values=extra)
    mine = (describe_error(failure), detail) if failure is not None else None
    shared: tuple[str, Any] = broadcast_value(strategy, mine, src=failed[0])  # type: ignore[assignment]  # the failing rank sends it
    return Failures(failed, shared[0], shared[1], extra)


def _deepspeed_strategy_classes() -> tuple[type, ...]:
    # only packages already imported: a strategy of a package nobody imported cannot exist, and importing one (the
    # separate `pytorch_lightning` copy, say) would cost seconds at a save. The strategy modules import without
    # DeepSpeed itself.
    modules = ("lightning.fabric.strategies", "lightning.pytorch.strategies", "lightning_fabric.strategies",
               "pytorch_lightning.strategies")
    return tuple(cls for name in modules if (cls := getattr(sys.modules.get(name), "DeepSpeedStrategy", None)))


def is_deepspeed_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is a ``DeepSpeedStrategy`` (or a subclass) of Lightning or Fabric, in either package."""
    return isinstance(strategy, _deepspeed_strategy_classes())


__all__ = [
    "DistributedCheckpointMeeting",
    "FAILING_RANKS",
    "PeerFailedFirst",
    "every_rank_arrives",
    "NO_VALUE",
    "Failures",
    "RankMap",
    "agree_on_failure",
    "all_reduce_values",
    "barrier",
    "broadcast_in_group",
    "broadcast_value",
    "describe_error",
    "failure_words",
    "failures_from",
    "rank_and_world",
    "reduce_ints",
    "own_write_failure",
    "replaced_attribute",
    "require_collective",
    "write_errors",
    "is_deepspeed_strategy",
    "is_multiprocess",
    "is_rank_zero",
]
