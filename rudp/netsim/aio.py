"""Asyncio glue: drive a :class:`~rudp.netsim.conditioner.LinkConditioner` from an event loop.

Theory of operation
-------------------
:class:`ConditionedPipe` sits in front of anything that takes datagrams, typically
``transport.sendto`` or a protocol's ``datagram_received``. :meth:`ConditionedPipe.send` stamps
each datagram with ``loop.time()`` and hands it to the sans-IO conditioner; whatever is due comes
out through the ``deliver`` callback. Datagrams due at once (always the case for a perfect
profile) are delivered synchronously, inside ``send``, so an unimpaired pipe adds no latency and no
extra loop iteration. Everything else waits for the pipe's single timer, one ``loop.call_at``
handle re-armed to the conditioner's ``next_deadline()`` after every call, however many datagrams
are in flight. When it fires, the pipe polls at the deadline it was armed for, so a loop that runs
timers a little early (within its clock resolution) does not make it spin.

``deliver`` may call ``send`` on the same pipe (an echo); such datagrams are queued and handed out
by the outer delivery loop, which keeps order and avoids unbounded recursion. An exception raised
by ``deliver`` goes to the loop's exception handler and does not stop the other deliveries.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Callable
from typing import Generic, TypeVar

from rudp.netsim.conditioner import LinkConditioner, LinkProfile, LinkStats, check_profile

__all__ = ["ConditionedPipe"]

T = TypeVar("T")


class ConditionedPipe(Generic[T]):
    """One impaired direction on an event loop. ``seed=None`` seeds from OS entropy."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        profile: LinkProfile,
        deliver: Callable[[bytes, T], None],
        *,
        seed: int | None = None,
    ) -> None:
        if not callable(deliver):
            raise TypeError(
                f"deliver must be a function taking (data, meta), not {type(deliver).__name__}"
            )
        if inspect.iscoroutinefunction(deliver):
            raise TypeError("deliver must be a plain function: a coroutine would never be awaited")
        check_profile(profile)
        self._loop = loop
        self._deliver = deliver
        self._conditioner: LinkConditioner[T] = LinkConditioner(profile, rng=random.Random(seed))
        # uvloop's call_at returns a plain Handle (no .when()) for a deadline already passed, so
        # the deadline the timer was armed for is kept alongside it.
        self._timer: asyncio.Handle | None = None
        self._timer_when = 0.0
        self._delivering = False
        self._closed = False

    @property
    def profile(self) -> LinkProfile:
        return self._conditioner.profile

    @profile.setter
    def profile(self, profile: LinkProfile) -> None:
        self._conditioner.profile = profile

    @property
    def stats(self) -> LinkStats:
        return self._conditioner.stats

    @property
    def pending(self) -> int:
        """Datagrams scheduled but not yet delivered."""
        return self._conditioner.pending

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, data: bytes, meta: T) -> None:
        """Submit one datagram now; silently ignored once the pipe is closed (like a lost one)."""
        if self._closed:
            return
        now = self._loop.time()
        self._conditioner.send(data, now, meta)
        if not self._delivering:  # else the delivery loop further up the stack picks it up
            self._flush(now)

    def close(self) -> None:
        """Cancel the timer and drop whatever is still in flight. Idempotent."""
        self._closed = True
        self._cancel_timer()
        self._conditioner.clear()

    def _on_timer(self) -> None:
        # The loop may run a timer up to its clock resolution early; it judged the deadline
        # reached, so poll at the deadline itself rather than re-arming for the same instant.
        now = max(self._loop.time(), self._timer_when)
        self._timer = None
        self._flush(now)

    def _flush(self, now: float) -> None:
        self._delivering = True
        try:
            # Re-read the clock each round: datagrams that deliver() sent into this pipe were
            # stamped with a later time than ours and must not be left for the timer.
            while not self._closed and (batch := self._poll(now)):
                for data, meta in batch:
                    if self._closed:  # deliver() closed the pipe: drop the rest, as close() says
                        break
                    self._deliver_one(data, meta)
        finally:
            self._delivering = False
            self._rearm()

    def _poll(self, now: float) -> list[tuple[bytes, T]]:
        return self._conditioner.poll(max(now, self._loop.time()))

    def _deliver_one(self, data: bytes, meta: T) -> None:
        try:
            self._deliver(data, meta)
        except Exception as exc:  # one faulty callback must not strand the other datagrams
            self._loop.call_exception_handler(
                {"message": "rudp.netsim: deliver callback failed", "exception": exc}
            )

    def _rearm(self) -> None:
        deadline = None if self._closed else self._conditioner.next_deadline()
        if deadline is None:
            self._cancel_timer()
            return
        if self._timer is not None:
            if self._timer_when == deadline:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(deadline, self._on_timer)
        self._timer_when = deadline

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
