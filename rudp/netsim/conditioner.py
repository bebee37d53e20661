"""Sans-IO link conditioner: loss, delay, jitter, duplication, reordering, corruption, bandwidth.

Theory of operation
-------------------
A :class:`LinkConditioner` models ONE direction of a network link. Datagrams are submitted with
:meth:`LinkConditioner.send` together with the current time; each one is either dropped at once
or given a *due time*, and :meth:`LinkConditioner.poll` hands back every datagram whose due time
has come, ordered by due time (ties broken by submission order). The module never reads a clock,
sleeps or touches a socket: time arrives as ``now`` (seconds, any monotonic origin, never going
backwards) and randomness comes from an injected :class:`random.Random`, so a fixed seed and a
stepped fake clock reproduce a run exactly. :mod:`rudp.netsim.aio` drives it from an event loop.

Each submitted datagram goes through this pipeline, in this order:

0. **Path MTU.** With ``mtu`` set, a datagram longer than ``mtu`` bytes (of UDP payload) is
   dropped, as a path with Don't Fragment set drops it (no ICMP error is modelled: a black
   hole). Setting a new profile mid-run changes the path's MTU from then on.
1. **Loss.** Uniform (``loss``), or bursty when ``burst`` holds a :class:`GilbertElliott` chain,
   which then *replaces* ``loss``. Lost datagrams never reach the queue (like netem).
2. **Duplication.** With probability ``duplicate`` a second copy is made. Every copy goes through
   the remaining steps on its own (its own queue slot, corruption draw and delay).
3. **Bottleneck queue.** With ``bandwidth`` set, copies are serialised one after another (FIFO) at
   ``bandwidth`` bytes/second. The queue holds at most ``queue_limit`` bytes of datagrams that are
   not yet fully serialised; a copy that would exceed it is dropped (drop-tail), except that an idle
   link always accepts one datagram, however large.
4. **Corruption.** With probability ``corrupt`` 1..3 distinct bits are flipped; the length is kept.
5. **Propagation delay.** ``latency`` plus a uniform jitter in ``[-jitter, +jitter]``, never below
   zero; with probability ``reorder`` a further ``reorder_delay`` holds the copy back, so later
   datagrams overtake it.

Ordering: with constant latency and no jitter or reordering, datagrams come out in the order they
went in. Jitter is applied independently per datagram, so it reorders datagrams sent closer
together than the jitter span, as on a real jittery path. Changing the profile affects only
datagrams submitted afterwards; lowering the latency at runtime lets new datagrams overtake queued
ones (as after a route change).

A perfect profile (every default) takes a fast path that draws no random numbers and makes each
datagram due at ``now`` itself, so ``poll(now)`` returns it straight away.

Accounting: ``sent + duplicated == delivered + dropped_mtu + dropped_loss + dropped_queue +
pending`` holds at all times (:meth:`LinkConditioner.clear` removes datagrams from ``pending``
without counting them).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

__all__ = ["GilbertElliott", "LinkConditioner", "LinkProfile", "LinkStats"]

T = TypeVar("T")


def _check_probability(owner: str, name: str, value: float) -> None:
    # `not (0 <= v <= 1)` also rejects NaN, which compares false with everything.
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a probability in [0, 1], got {value!r}")


def _check_duration(owner: str, name: str, value: float) -> None:
    if not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{owner}.{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class GilbertElliott:
    """Bursty loss: the two-state Gilbert-Elliott Markov chain, stepped once per datagram.

    The chain is either GOOD or BAD. For each datagram it first moves (GOOD->BAD with probability
    ``p_good_to_bad``, BAD->GOOD with probability ``p_bad_to_good``) and then drops the datagram
    with the loss probability of the state it is now in (``loss_good`` or ``loss_bad``). It starts
    GOOD. With the defaults ``loss_good=0`` and ``loss_bad=1`` ("simple Gilbert" model) every BAD
    sojourn is one burst of consecutive losses, geometrically distributed with mean
    ``1 / p_bad_to_good``, and the long-run loss rate is
    ``p_good_to_bad / (p_good_to_bad + p_bad_to_good)``.
    """

    p_good_to_bad: float
    p_bad_to_good: float
    loss_good: float = 0.0
    loss_bad: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_probability("GilbertElliott", f.name, getattr(self, f.name))

    @classmethod
    def from_mean(cls, loss_rate: float, mean_burst_length: float) -> GilbertElliott:
        """Derive a simple Gilbert chain (``loss_good=0``, ``loss_bad=1``) from two numbers.

        ``loss_rate`` is the long-run fraction of datagrams lost, in ``[0, 1)``;
        ``mean_burst_length`` the mean number of consecutive losses per burst, ``>= 1``.
        A BAD sojourn lasts ``1 / r`` datagrams on average (``r = p_bad_to_good``), so
        ``r = 1 / mean_burst_length``. The stationary probability of BAD is ``p / (p + r)``
        (``p = p_good_to_bad``); solving ``p / (p + r) = loss_rate`` gives
        ``p = loss_rate * r / (1 - loss_rate)``. That must itself be a probability, which limits
        the rate reachable with short bursts (at most ``L / (L + 1)`` for burst length ``L``);
        a ValueError says so.
        """
        if not 0.0 <= loss_rate < 1.0:
            raise ValueError(f"loss_rate must be in [0, 1), got {loss_rate!r}")
        if not (mean_burst_length >= 1.0 and math.isfinite(mean_burst_length)):
            raise ValueError(
                f"mean_burst_length must be a finite number >= 1, got {mean_burst_length!r}"
            )
        p_bad_to_good = 1.0 / mean_burst_length
        p_good_to_bad = loss_rate * p_bad_to_good / (1.0 - loss_rate)
        if p_good_to_bad > 1.0:
            limit = mean_burst_length / (mean_burst_length + 1.0)
            raise ValueError(
                f"loss_rate {loss_rate} is unreachable with mean_burst_length {mean_burst_length}"
                f" (at most {limit:.3f}); ask for longer bursts"
            )
        return cls(p_good_to_bad=p_good_to_bad, p_bad_to_good=p_bad_to_good)

    @property
    def loss_rate(self) -> float:
        """Long-run fraction of datagrams lost (stationary distribution of the chain)."""
        total = self.p_good_to_bad + self.p_bad_to_good
        if total == 0.0:
            return self.loss_good  # the chain never leaves its initial GOOD state
        p_bad = self.p_good_to_bad / total
        return p_bad * self.loss_bad + (1.0 - p_bad) * self.loss_good

    @property
    def mean_burst_length(self) -> float:
        """Mean number of datagrams per BAD sojourn (inf if BAD is absorbing)."""
        return math.inf if self.p_bad_to_good == 0.0 else 1.0 / self.p_bad_to_good


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """Impairments of ONE direction of a link. Every default describes a perfect link.

    Times are in seconds, ``bandwidth`` in bytes/second, ``queue_limit`` in bytes. See the module
    docstring for the order in which the impairments apply.
    """

    loss: float = 0.0
    latency: float = 0.0
    jitter: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_delay: float = 0.010
    corrupt: float = 0.0
    bandwidth: float | None = None
    queue_limit: int = 256 * 1024
    burst: GilbertElliott | None = None
    mtu: int | None = None  # larger datagrams are dropped (bytes of UDP payload); None: no limit

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate", "reorder", "corrupt"):
            _check_probability("LinkProfile", name, getattr(self, name))
        for name in ("latency", "jitter", "reorder_delay"):
            _check_duration("LinkProfile", name, getattr(self, name))
        if self.bandwidth is not None and not (
            self.bandwidth > 0.0 and math.isfinite(self.bandwidth)
        ):
            raise ValueError(
                f"LinkProfile.bandwidth must be None (unlimited) or a finite number of"
                f" bytes/second > 0, got {self.bandwidth!r}"
            )
        if self.mtu is not None and self.mtu < 1:
            raise ValueError(f"LinkProfile.mtu must be None or >= 1 bytes, got {self.mtu!r}")
        if self.queue_limit < 0:
            raise ValueError(
                f"LinkProfile.queue_limit must be >= 0 bytes, got {self.queue_limit!r}"
            )

    @property
    def is_perfect(self) -> bool:
        """True when the profile changes nothing: no loss, delay, duplication, reordering, etc."""
        return (
            self.loss == 0.0
            and self.latency == 0.0
            and self.jitter == 0.0
            and self.duplicate == 0.0
            and self.reorder == 0.0
            and self.corrupt == 0.0
            and self.bandwidth is None
            and self.burst is None
            and self.mtu is None
        )


def check_profile(profile: object, name: str = "profile") -> LinkProfile:
    """``profile`` itself when it is a :class:`LinkProfile`; anything else (a dict of its
    fields, a name such as ``"lossy"``, None for a perfect link) is a TypeError naming
    ``name``, at once rather than an AttributeError at the next datagram."""
    if not isinstance(profile, LinkProfile):
        raise TypeError(
            f"{name} must be a rudp.netsim.LinkProfile (LinkProfile() for a perfect link),"
            f" not {type(profile).__name__}: {profile!r:.60}"
        )
    return profile


MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024  # held in the delay line at most, whatever the profile


@dataclass
class LinkStats:
    """Counters of one conditioner (or, summed, of several). Copies count in ``delivered``."""

    sent: int = 0  # datagrams submitted to send()
    delivered: int = 0  # datagrams (copies included) handed out by poll()
    dropped_mtu: int = 0  # longer than the path MTU
    dropped_loss: int = 0  # dropped by random or burst loss
    dropped_queue: int = 0  # dropped because the bottleneck queue was full (drop-tail)
    duplicated: int = 0  # extra copies made
    reordered: int = 0  # copies held back by reorder_delay
    corrupted: int = 0  # copies with flipped bits

    def __add__(self, other: LinkStats) -> LinkStats:
        return LinkStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


class LinkConditioner(Generic[T]):
    """One direction of an impaired link; see the module docstring. Not thread-safe.

    ``meta`` travels with each datagram untouched (an address, a connection, ...).
    """

    def __init__(self, profile: LinkProfile, *, rng: random.Random) -> None:
        self._rng = rng
        self._profile = check_profile(profile)
        self._perfect = profile.is_perfect
        self.stats = LinkStats()
        # Min-heap of (due, seq, data, meta); seq is unique, so data/meta are never compared and
        # equal due times come out in submission order.
        self._heap: list[tuple[float, int, bytes, T]] = []
        self._heap_bytes = 0
        self._seq = 0
        self._burst_bad = False  # Gilbert-Elliott state, starts GOOD
        # Bottleneck: when the serialiser is next free, and (finish time, size) of datagrams not yet
        # fully serialised, whose sizes sum to _queued_bytes.
        self._link_free_at = -math.inf
        self._in_queue: deque[tuple[float, int]] = deque()
        self._queued_bytes = 0

    @property
    def profile(self) -> LinkProfile:
        return self._profile

    @profile.setter
    def profile(self, profile: LinkProfile) -> None:
        check_profile(profile)
        # Datagrams already scheduled keep their due times; the new profile applies from now on.
        if profile.burst != self._profile.burst:
            self._burst_bad = False
        if profile.bandwidth is None:
            self._reset_bottleneck()
        self._profile = profile
        self._perfect = profile.is_perfect

    @property
    def pending(self) -> int:
        """Datagrams (copies included) scheduled but not yet handed out by poll()."""
        return len(self._heap)

    def send(self, data: bytes, now: float, meta: T) -> None:
        """Submit one datagram at time ``now``; it may be dropped, delayed, duplicated, damaged."""
        self.stats.sent += 1
        if self._perfect:
            self._schedule(now, data, meta)
            return
        mtu = self._profile.mtu
        if mtu is not None and len(data) > mtu:
            self.stats.dropped_mtu += 1
            return
        if self._lose():
            self.stats.dropped_loss += 1
            return
        copies = 1
        if self._profile.duplicate and self._rng.random() < self._profile.duplicate:
            copies = 2
            self.stats.duplicated += 1
        for _ in range(copies):
            self._send_copy(data, now, meta)

    def poll(self, now: float) -> list[tuple[bytes, T]]:
        """Remove and return every datagram due at or before ``now``, in delivery order."""
        heap = self._heap
        out: list[tuple[bytes, T]] = []
        while heap and heap[0][0] <= now:
            _, _, data, meta = heapq.heappop(heap)
            self._heap_bytes -= len(data)
            out.append((data, meta))
        self.stats.delivered += len(out)
        return out

    def next_deadline(self) -> float | None:
        """Due time of the earliest scheduled datagram, or None when nothing is pending."""
        return self._heap[0][0] if self._heap else None

    def clear(self) -> int:
        """Forget every pending datagram (and the bottleneck backlog); return how many."""
        dropped = len(self._heap)
        self._heap.clear()
        self._heap_bytes = 0
        self._reset_bottleneck()
        return dropped

    # -- pipeline steps ---------------------------------------------------------------------

    def _lose(self) -> bool:
        burst = self._profile.burst
        if burst is None:
            loss = self._profile.loss
            return loss > 0.0 and self._rng.random() < loss
        # Step the chain first, then draw the loss in the state it moved to.
        flip = burst.p_bad_to_good if self._burst_bad else burst.p_good_to_bad
        if self._rng.random() < flip:
            self._burst_bad = not self._burst_bad
        loss = burst.loss_bad if self._burst_bad else burst.loss_good
        return self._rng.random() < loss

    def _send_copy(self, data: bytes, now: float, meta: T) -> None:
        profile = self._profile
        if self._heap_bytes + len(data) > MAX_IN_FLIGHT_BYTES:
            # Without a bandwidth limit nothing else bounds what a flood can park in
            # the delay line (netem caps it too: its "limit", 1000 packets by default).
            self.stats.dropped_queue += 1
            return
        leaves_at = now
        if profile.bandwidth is not None:
            finish = self._serialise(len(data), now, profile.bandwidth, profile.queue_limit)
            if finish is None:
                self.stats.dropped_queue += 1
                return
            leaves_at = finish
        if profile.corrupt and self._rng.random() < profile.corrupt and data:
            data = self._flip_bits(data)
            self.stats.corrupted += 1
        self._schedule(leaves_at + self._propagation_delay(), data, meta)

    def _serialise(self, size: int, now: float, bandwidth: float, limit: int) -> float | None:
        """Queue ``size`` bytes on the bottleneck; return when fully sent, or None if dropped."""
        queue = self._in_queue
        while queue and queue[0][0] <= now:  # fully serialised by now: out of the buffer
            self._queued_bytes -= queue.popleft()[1]
        if queue and self._queued_bytes + size > limit:
            return None
        finish = max(now, self._link_free_at) + size / bandwidth
        self._link_free_at = finish
        queue.append((finish, size))
        self._queued_bytes += size
        return finish

    def _propagation_delay(self) -> float:
        profile = self._profile
        delay = profile.latency
        if profile.jitter:
            delay = max(0.0, delay + self._rng.uniform(-profile.jitter, profile.jitter))
        if profile.reorder and self._rng.random() < profile.reorder:
            delay += profile.reorder_delay
            self.stats.reordered += 1
        return delay

    def _flip_bits(self, data: bytes) -> bytes:
        buf = bytearray(data)
        nbits = len(buf) * 8
        # Distinct bits, so two flips never cancel out and the datagram really is damaged.
        for bit in self._rng.sample(range(nbits), min(nbits, self._rng.randint(1, 3))):
            buf[bit >> 3] ^= 1 << (bit & 7)
        return bytes(buf)

    def _schedule(self, due: float, data: bytes, meta: T) -> None:
        self._heap_bytes += len(data)
        heapq.heappush(self._heap, (due, self._seq, data, meta))
        self._seq += 1

    def _reset_bottleneck(self) -> None:
        self._link_free_at = -math.inf
        self._in_queue.clear()
        self._queued_bytes = 0
