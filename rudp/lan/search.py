"""One discovery round from the caller's side, sans-IO: when to call, what an answer means.

Theory of operation
-------------------
A :class:`Search` lasts ``timeout`` seconds from its creation. It asks for
``attempts`` calls, the first at once and the others ``timeout / (2 *
attempts)`` apart, so all of them leave in the first half of the round and the
last one still has time to be answered: a broadcast can be lost like any
datagram. Every call carries a fresh random nonce and the time it was sent;
an answer is only accepted for a nonce we sent, so stray, replayed or late
answers from an earlier round are ignored, and its round-trip time is measured
against the very send it answers (Karn's rule, for free).

Answers with the same responder instance id are merged, keeping the fastest,
when they come from the same address (a later call's answer, its info maybe
updated) or say exactly the same thing (the same host heard over IPv4 and
IPv6, or on two interfaces), so such a host is reported once. Two answers with
one instance id that differ, from different addresses, are both listed: the id
is no secret (any call reveals it), so a spoofer reusing it must not hide the
host it copies. The round ends at the deadline, or as soon as ``expected`` distinct hosts have
answered.

Anyone on the link can answer, so an answer is cheap to refuse: one longer
than ``request_size`` (no honest responder sends one, see
:mod:`rudp.lan.responder`) is dropped unparsed, and so is one whose nonce is
not ours (read from the header); at most ``max_hosts`` hosts are kept. Every
datagram that does not find a host or a faster route lands in one counter of
:class:`SearchStats`.

The aioquic pattern: every entry point takes ``now``. The caller sends what
:meth:`Search.call_to_send` returns to every destination, feeds every received
datagram to :meth:`Search.datagram_received`, wakes at :meth:`Search.get_timer`
and then calls :meth:`Search.handle_timer`; :meth:`Search.get_timer` returns
``None`` once the round is over, and :meth:`Search.results` gives the hosts,
fastest first. Where the calls go (broadcast, multicast, unicast) is the
asyncio layer's business (:mod:`rudp.lan.aio`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rudp.lan.messages import (
    DEFAULT_REQUEST_SIZE,
    HEADER,
    MAGIC,
    MAX_DATAGRAM,
    NONCE_SIZE,
    VERSION,
    Kind,
    MalformedDatagram,
    answer_fields,
    check_game,
    decode_packet,
    encode_call,
    log_address,
)

__all__ = ["DEFAULT_MAX_HOSTS", "DiscoveredHost", "Search", "SearchStats"]

log = logging.getLogger(__name__)

#: Hosts one search keeps at most; answers from further hosts are dropped.
DEFAULT_MAX_HOSTS = 256


@dataclass(slots=True)
class SearchStats:
    """Counters kept by a search: every datagram received lands in exactly one."""

    answers: int = 0
    """Answers that listed a new host, or a faster route to a known one."""
    slower: int = 0
    """Valid answers from a known host that were no faster than its best one."""
    malformed: int = 0
    """Datagrams that failed to parse."""
    oversize: int = 0
    """Datagrams longer than ``request_size``, dropped unparsed (no honest answer is)."""
    calls: int = 0
    """Calls: our own broadcast looping back, or another client's."""
    stray: int = 0
    """Answers to a nonce we never sent (late, replayed, or for another client)."""
    other_game: int = 0
    """Answers for a game other than the one searched for."""
    too_many_hosts: int = 0
    """Answers from a new host once ``max_hosts`` were listed."""


@dataclass(frozen=True, slots=True)
class DiscoveredHost:
    """One answering host."""

    address: tuple[str, int]
    """Where the answer came from: ``(ip, discovery port)``; IPv6 link-local keeps ``%iface``."""
    game: str
    """The game the responder serves."""
    info: dict[str, Any]
    """The responder's info mapping, as sent."""
    rtt: float
    """Round-trip time of the fastest answer, in seconds."""
    instance_id: bytes = field(repr=False)
    """Random id of the responder; answers under one id are merged when they come from one
    address or are identical (several routes to one host)."""


def _check_seconds(value: object, name: str) -> None:
    """A finite number of seconds > 0: NaN would never end the round (every comparison
    with it is false, so the loop would spin), infinity neither."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} takes a number of seconds, not {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")


def _check_count(value: object, name: str, low: int = 1, high: int | None = None) -> None:
    """An ``int`` in ``low..high``: 2.5 or NaN calls would be a count nobody asked for."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} takes an int, not {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, not {value!r}")


class Search:
    """Calls to send and answers collected during one discovery round (sans-IO)."""

    def __init__(
        self,
        *,
        now: float,
        game: str | None = None,
        timeout: float = 1.0,
        attempts: int = 3,
        request_size: int = DEFAULT_REQUEST_SIZE,
        expected: int | None = None,
        max_hosts: int = DEFAULT_MAX_HOSTS,
        randbytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        _check_seconds(timeout, "timeout")
        _check_count(attempts, "attempts")
        _check_count(request_size, "request_size", HEADER.size, MAX_DATAGRAM)
        _check_count(max_hosts, "max_hosts")
        if expected is not None:
            _check_count(expected, "expected")
        check_game(game, "game", optional=True)
        self.game = game
        """Only answers for this game are kept (``None``: any game)."""
        self.sent_at: dict[bytes, float] = {}
        """Send time of every call, by nonce."""
        self.hosts: dict[tuple[bytes, int], DiscoveredHost] = {}
        """The fastest answer of every host so far, by ``(instance id, n)``: ``n`` is 0
        for the first answer listed under that id, 1 for the next distinct one, ..."""
        self._by_instance: dict[bytes, list[tuple[bytes, int]]] = {}
        self.stats = SearchStats()
        """What happened to every datagram received."""
        self._request_size = request_size
        self._max_hosts = max_hosts
        self._expected = expected
        self._randbytes = randbytes
        self._deadline = now + timeout
        self._interval = timeout / (2 * attempts)
        self._calls_left = attempts
        self._next_call: float | None = now
        self._over = self._enough()

    @property
    def malformed(self) -> int:
        """Datagrams dropped because they failed to parse (``stats.malformed``)."""
        return self.stats.malformed

    @property
    def finished(self) -> bool:
        """Whether the round is over (deadline passed, or ``expected`` hosts found)."""
        return self._over

    def get_timer(self) -> float | None:
        """When to call :meth:`handle_timer` next; ``None`` once the round is over."""
        if self._over:
            return None
        if self._next_call is None:
            return self._deadline
        return min(self._next_call, self._deadline)

    def handle_timer(self, now: float) -> None:
        """Act on the timer: end the round at its deadline. Early calls do nothing."""
        if now >= self._deadline:
            self._over = True

    def call_to_send(self, now: float) -> bytes | None:
        """The call to send now to every destination, or ``None`` if none is due."""
        if self._over or self._next_call is None or now < self._next_call:
            return None
        # A fresh nonce per attempt: an answer then tells exactly which send it
        # answers, so the RTT is never measured against a retransmission.
        nonce = self._randbytes(NONCE_SIZE)
        self.sent_at[nonce] = now
        self._calls_left -= 1
        self._next_call = now + self._interval if self._calls_left else None
        return encode_call(nonce, self.game, self._request_size)

    def datagram_received(self, data: bytes, address: tuple[str, int], now: float) -> bool:
        """Take in a datagram from ``address``; ``True`` if it found a host or a faster route."""
        stats = self.stats
        if len(data) > self._request_size:
            # A responder never answers with more than the call it got.
            stats.oversize += 1
            log.debug("answer_oversize peer=%s size=%d", log_address(address), len(data))
            return False
        try:
            host = self._parse(data, address, now)
        except MalformedDatagram as exc:
            stats.malformed += 1
            log.debug("answer_malformed peer=%s reason=%r", log_address(address), str(exc))
            return False
        if host is None:
            return False
        keys = self._by_instance.setdefault(host.instance_id, [])
        key = next((k for k in keys if self._same_host(self.hosts[k], host)), None)
        if key is not None and self.hosts[key].rtt <= host.rtt:
            stats.slower += 1
            return False
        if key is None:
            if len(self.hosts) >= self._max_hosts:
                stats.too_many_hosts += 1
                if not keys:
                    del self._by_instance[host.instance_id]
                return False
            key = (host.instance_id, len(keys))
            keys.append(key)
        stats.answers += 1
        self.hosts[key] = host
        self._over = self._over or self._enough()
        return True

    def results(self) -> list[DiscoveredHost]:
        """The hosts found so far, fastest first."""
        return sorted(self.hosts.values(), key=lambda h: h.rtt)

    @staticmethod
    def _same_host(known: DiscoveredHost, new: DiscoveredHost) -> bool:
        """Whether two answers with one instance id are one host (see the module doc)."""
        return known.address == new.address or (known.game, known.info) == (new.game, new.info)

    def _enough(self) -> bool:
        return self._expected is not None and len(self.hosts) >= self._expected

    def _parse(self, data: bytes, address: tuple[str, int], now: float) -> DiscoveredHost | None:
        if len(data) >= HEADER.size:
            # Calls and strays are told from the header alone, before any unpacking.
            magic, version, kind, nonce, _ = HEADER.unpack_from(data)
            if (magic, version, kind) == (MAGIC, VERSION, Kind.CALL):
                self.stats.calls += 1  # our own broadcast call looping back, or another client's
                return None
            if (magic, version, kind) == (MAGIC, VERSION, Kind.ANSWER) and (
                nonce not in self.sent_at
            ):
                self.stats.stray += 1  # not an answer to any of our calls
                return None
        packet = decode_packet(data, kind=Kind.ANSWER)
        sent = self.sent_at[packet.nonce]
        instance, game, info = answer_fields(packet.body)
        if self.game is not None and game != self.game:
            self.stats.other_game += 1
            return None
        return DiscoveredHost(address, game, info, max(0.0, now - sent), instance)
