"""The state check: whether the local state a rank is about to write is finite, as a fixed-size part of its summary.

At a boundary that writes, each rank reads its state tensors (:mod:`lightning_ckguard.record.state_sources`) with the
same
exact per-tensor check as its gradients (:class:`~lightning_ckguard.record.finiteness.NonFiniteCheck`: ``1e30`` and the
largest finite values pass). The outcome rides in the boundary's one agreement, appended to the window's summary: the
number of non-finite tensors, and the names of the first of them as UTF-8 bytes packed into int64 words, so every
rank can name every other rank's tensors without a second collective.

Reading the per-tensor flags to name them is one device-to-host read per writing boundary, before the agreement; the
per-step path is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_ckguard.record.finiteness import NonFiniteCheck
from lightning_ckguard.record.state_sources import NamedTensor

#: int64 words of UTF-8 names each rank can report (8 bytes each).
NAME_WORDS = 40
#: Layout of the state part: the count of non-finite tensors, then the packed names.
STATE_SUMMARY_SIZE = 1 + NAME_WORDS
_SEPARATOR = "\n"


def _pack(names: Sequence[str]) -> list[int]:
    """The names, separated, truncated to whole characters that fit ``NAME_WORDS`` words, as signed int64 words."""
    budget = NAME_WORDS * 8
    data = b""
    for name in names:
        encoded = (_SEPARATOR if data else "").encode() + name.encode()
        if len(data) + len(encoded) > budget:
            break  # the count still says how many there are
        data += encoded
    data = data.ljust(budget, b"\0")
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, budget, 8)]


def decode_state_summary(words: Sequence[int]) -> tuple[int, tuple[str, ...]]:
    """``(number of non-finite state tensors, names of the first of them)`` from one rank's state part."""
    if len(words) < STATE_SUMMARY_SIZE:
        return 0, ()
    count = int(words[0])
    data = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:STATE_SUMMARY_SIZE]).rstrip(b"\0")
    names = tuple(data.decode("utf-8", errors="replace").split(_SEPARATOR)) if data else ()
    return count, names


class StateCheck:
    """Checks named state tensors and summarizes the outcome for the agreement (see the module docstring)."""

    def __init__(self) -> None:
        # caches a reading plan per layout (the state's layout rarely changes); aminmax for the large tensors: state
        # is read at writing boundaries only, and its magnitudes are anyone's (an optimizer moment that decays
        # towards 0 slows the probe down under 1e-34, aminmax never)
        self._check = NonFiniteCheck(large_reader="aminmax")

    def non_finite(self, state: Iterable[NamedTensor], device: torch.device | None = None) -> list[str]:
        """Names of the tensors in ``state`` that hold a NaN or an infinity. The flags are gathered on ``device``
        (default: the first tensor's) and read to the host once, a blocking read."""
        named = [(name, tensor) for name, tensor in state if tensor.numel()]
        if not named:
            return []
        flags = self._check([tensor for _, tensor in named], device or named[0][1].device).tolist()
        return [name for (name, _), bad in zip(named, flags, strict=True) if bad]

    def summary(self, state: Iterable[NamedTensor] | None, device: torch.device) -> Tensor:
        """This rank's state part of the agreement, ``STATE_SUMMARY_SIZE`` int64 values on ``device``."""
        names = self.non_finite(state, device) if state is not None else []
        return torch.tensor([len(names), *_pack(names)], dtype=torch.int64, device=device)


__all__ = ["NAME_WORDS", "STATE_SUMMARY_SIZE", "StateCheck", "decode_state_summary"]
