"""The guard's ``ckguard/*`` metrics, held until Lightning flushes its own metrics to the loggers.

``ModelCheckpoint`` never calls a logger's ``log_metrics``: every call a logger gets comes from Lightning's logger
connector, at the steps ``log_every_n_steps`` and the epoch and validation ends imply. A tool or test that checks
that sequence (TensorBoard's event steps, ``assert_has_calls`` on a logger) must see the same calls with this
callback. So an agreement does not log on its own: its values are held here and ride in the next call Lightning makes
anyway (the same step, the same logger calls, a few more keys in the dict). Values that no flush picks up before the
fit ends are logged once, at the end, in one call (:meth:`HeldMetrics.flush_remaining`).

When several boundaries fall between two flushes, each key keeps what a single logged value should say about all of
them: counts that only grow (boundaries accepted, rejected, rewinds) and a spike gate's baselines keep their latest
value; per-boundary counts (non-finite and skipped steps) are summed, so no boundary's count is lost; a spike gate's
``*_window_max`` values keep the largest, so a spike between two flushes still reaches the loggers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Metrics summed over the boundaries held between two flushes.
SUMMED = frozenset({"ckguard/non_finite_steps", "ckguard/skipped_steps"})
#: Metrics whose name ends so keep the largest value held between two flushes (a spike gate's window maxima); every
#: key neither summed nor a window maximum keeps its latest value.
LARGEST_SUFFIX = "_window_max"


def combined(key: str, held: float | None, value: float) -> float:
    """What ``key`` holds once ``value`` joins ``held`` (None: nothing held since the last flush)."""
    if held is None:
        return value
    if key in SUMMED:
        return held + value
    if key.endswith(LARGEST_SUFFIX):
        return max(held, value)
    return value


class HeldMetrics:
    """Wraps one Trainer's logger connector ``log_metrics`` (Lightning's flush to every logger) and adds the values
    held since its last call.

    A flush Lightning skips (nothing of its own to log) stays skipped: held values never create a call of their own
    until :meth:`flush_remaining`.
    """

    def __init__(self, connector: Any) -> None:
        self._connector = connector
        self._flush = connector.log_metrics  # Lightning's own (bound) method, or what someone put there
        self._own = vars(connector).get("log_metrics", _ABSENT)
        self._pending: dict[str, float] = {}

    @classmethod
    def on(cls, trainer: Any) -> HeldMetrics | None:
        """The held metrics of ``trainer``, installed on its logger connector the first time; None for a Trainer
        without one."""
        connector = getattr(trainer, "_logger_connector", None)
        if connector is None:
            return None
        held = vars(connector).get("log_metrics")
        if not isinstance(held, cls):
            held = cls(connector)
            connector.log_metrics = held
        return held

    def __call__(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if metrics and self._pending:
            metrics = {**metrics, **self._pending}
            self._pending = {}
        self._flush(metrics, step)

    def hold(self, values: Mapping[str, float]) -> None:
        """Hold ``values`` for the next flush (see the module docstring for how held values combine)."""
        for key, value in values.items():
            self._pending[key] = combined(key, self._pending.get(key), value)

    def flush_remaining(self) -> None:
        """Log what no flush carried, in one call (the end of a fit); nothing if nothing is held."""
        if self._pending:
            pending, self._pending = self._pending, {}
            # at the step Lightning's own flush would use, given explicitly so the call carries only these values
            # (Lightning adds an `epoch` value to a call without one)
            loop = getattr(getattr(self._connector.trainer, "fit_loop", None), "epoch_loop", None)
            self._flush(pending, getattr(loop, "_batches_that_stepped", None))

    def uninstall(self) -> None:
        """Give the connector back its own ``log_metrics`` (held values are dropped: flush them first)."""
        if vars(self._connector).get("log_metrics") is not self:
            return
        if self._own is _ABSENT:
            del self._connector.log_metrics  # Lightning's method shows through again
        else:
            self._connector.log_metrics = self._own


_ABSENT = object()


def hold_metrics(trainer: Any, values: Mapping[str, float]) -> None:
    """Hold ``values`` for ``trainer``'s next flush to its loggers."""
    held = HeldMetrics.on(trainer)
    if held is not None:
        held.hold(values)


def flush_held_metrics(trainer: Any, uninstall: bool = False) -> None:
    """Log the held ``ckguard/*`` values no flush of Lightning's carried (once, at the end of a fit); with
    ``uninstall``, give the logger connector its own ``log_metrics`` back."""
    held = HeldMetrics.on(trainer)
    if held is None:
        return
    held.flush_remaining()
    if uninstall:
        held.uninstall()


__all__ = ["LARGEST_SUFFIX", "SUMMED", "HeldMetrics", "combined", "flush_held_metrics", "hold_metrics"]
