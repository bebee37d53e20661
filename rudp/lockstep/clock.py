"""A fixed-timestep clock that cannot spiral.

Ticks fall on ``origin + k * interval`` for k = 1, 2, ... so they never drift,
however late the caller polls. :meth:`TurnClock.advance` says how many ticks
are due; when more than ``max_catchup`` are, it runs only that many and drops
the rest of the backlog (the grid position jumps to the present). That is "lie about time"
from the fixed-update-loop seed: after a long stall the game slows down
instead of trying to run every missed tick at once, which would make the next
frame even later (the "well of despair").

Sans-IO: time comes in as ``now``; the clock never reads one.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["Advance", "TurnClock"]


class Advance(NamedTuple):
    """The result of one :meth:`TurnClock.advance`."""

    ticks: int
    """Ticks to run now (at most ``max_catchup``)."""
    dropped: int
    """Ticks that were due but were dropped to stay within ``max_catchup``."""


class TurnClock:
    """Emits fixed-interval ticks, at most ``max_catchup`` per :meth:`advance`."""

    def __init__(self, interval: float, *, max_catchup: int = 5) -> None:
        if not (math.isfinite(interval) and interval > 0):
            raise ValueError("interval must be a positive number of seconds")
        if max_catchup < 1:
            raise ValueError("max_catchup must be at least 1")
        self.interval = interval
        self.max_catchup = max_catchup
        self.ticks = 0
        """Ticks emitted since :meth:`start`."""
        self.dropped = 0
        """Ticks dropped since :meth:`start` (each is ``interval`` seconds of lost time)."""
        self._origin: float | None = None
        self._index = 0  # grid position of the last tick run or dropped

    @property
    def running(self) -> bool:
        return self._origin is not None

    def start(self, now: float) -> None:
        """Start (or restart) counting; the first tick is due at ``now + interval``."""
        self._origin = now
        self._index = 0
        self.ticks = 0
        self.dropped = 0

    def stop(self) -> None:
        self._origin = None

    @property
    def deadline(self) -> float | None:
        """When the next tick is due, or ``None`` if stopped."""
        if self._origin is None:
            return None
        return self._tick_time(self._index + 1)

    def advance(self, now: float) -> Advance:
        """Account for time up to ``now``; returns the ticks to run and those dropped."""
        if self._origin is None:
            return Advance(0, 0)
        elapsed = self._elapsed_ticks(now)
        due = elapsed - self._index
        if due <= 0:
            return Advance(0, 0)  # early, or time went backwards: nothing to do
        ran = min(due, self.max_catchup)
        # Skipping the grid index past the dropped ticks means they never come
        # due again: the backlog is forgiven, not repaid later.
        self._index = elapsed
        self.ticks += ran
        self.dropped += due - ran
        return Advance(ran, due - ran)

    def _tick_time(self, k: int) -> float:
        assert self._origin is not None
        return self._origin + k * self.interval

    def _elapsed_ticks(self, now: float) -> int:
        """Largest k with ``tick_time(k) <= now``, using the same expression as
        :attr:`deadline`, so waking exactly at the deadline always runs a tick
        (a division alone can round down and leave the caller spinning)."""
        assert self._origin is not None
        k = max(0, math.floor((now - self._origin) / self.interval))
        while self._tick_time(k + 1) <= now:
            k += 1
        while k > 0 and self._tick_time(k) > now:
            k -= 1
        return k
