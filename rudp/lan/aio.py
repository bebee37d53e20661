"""Thin asyncio glue for LAN discovery: the sockets, and time in and out.

The rules live in the sans-IO :class:`~rudp.lan.responder.Responder` and
:class:`~rudp.lan.search.Search`; this module only owns sockets and the loop.

* :func:`serve_discovery` binds one IPv4 socket to ``host:port`` (the
  wildcard hears directed and limited broadcasts) and, when IPv6 works, one
  IPv6 socket on the same port that joins the link-local group on every
  multicast-capable interface. Each datagram goes to the responder's rules;
  an answer goes back to its source.
* :func:`discover` works out the destinations (every interface's IPv4
  broadcast address, the IPv6 group once per multicast interface with the
  interface as scope id, and the caller's unicast ``targets``), opens one
  sender socket per address family, then loops: send the call the search
  asks for to every destination, wait for an answer or the search's timer,
  hand the search ``loop.time()``. Several games on one machine may share the
  discovery port (``SO_REUSEADDR``); each responder gets its own copy of every
  broadcast.

Nothing raises out of the event loop: malformed datagrams are counted by the
sans-IO parts, failed sends are counted (``send_errors``) or, for a sender,
reported to ``error_received`` and logged at debug level.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from typing import Any, cast

from rudp.errors import check_address, check_port, check_sequence
from rudp.lan.interfaces import format_address, list_interfaces
from rudp.lan.messages import (
    DEFAULT_DISCOVERY_PORT,
    DEFAULT_IPV6_GROUP,
    DEFAULT_REQUEST_SIZE,
    INSTANCE_ID_SIZE,
)
from rudp.lan.responder import DiscoveryStats, InfoSource, Responder
from rudp.lan.search import DEFAULT_MAX_HOSTS, DiscoveredHost, Search

__all__ = ["DiscoveryResponder", "discover", "serve_discovery"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- responder


class _ResponderProtocol(asyncio.DatagramProtocol):
    def __init__(self, responder: DiscoveryResponder) -> None:
        self._responder = responder
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not every loop's datagram transport subclasses DatagramTransport
        # (the selector one does not), so no isinstance check here.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.transport is not None:
            self._responder._handle(data, addr, self.transport)

    def error_received(self, exc: Exception) -> None:
        # asyncio reports a failed sendto here rather than raising it (and ICMP
        # errors from earlier answers, e.g. port unreachable, land here too).
        self._responder.stats.send_errors += 1
        log.debug("responder_error_received error=%r", str(exc))


class DiscoveryResponder:
    """Answers discovery calls with this host's info. Create with :func:`serve_discovery`."""

    def __init__(self, info: InfoSource, *, game: str) -> None:
        self._rules = Responder(info, game=game, instance_id=os.urandom(INSTANCE_ID_SIZE))
        self._transports: list[asyncio.DatagramTransport] = []
        self._port = 0
        self._closed = asyncio.Event()

    @property
    def game(self) -> str:
        """The game this responder answers for."""
        return self._rules.game

    @property
    def instance_id(self) -> bytes:
        """Random id sent in every answer."""
        return self._rules.instance_id

    @property
    def stats(self) -> DiscoveryStats:
        """What happened to every datagram received so far."""
        return self._rules.stats

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Local addresses the responder listens on."""
        return [format_address(t.get_extra_info("sockname")) for t in self._transports]

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``); 0 before binding."""
        return self._port

    def __repr__(self) -> str:
        where = " ".join(f"{a[0]}:{a[1]}" for a in self.addresses) or "closed"
        return f"<DiscoveryResponder game={self.game!r} {where}>"

    def close(self) -> None:
        """Stop answering. Idempotent."""
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def __aenter__(self) -> DiscoveryResponder:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def _handle(
        self, data: bytes, addr: tuple[Any, ...], transport: asyncio.DatagramTransport
    ) -> None:
        answer = self._answer_for(data, addr)
        if answer is None:
            return
        # asyncio reports a failed sendto to error_received() (which counts it in
        # send_errors) from inside sendto() rather than raising; either way the
        # answer was not sent and is not counted as answered.
        errors = self.stats.send_errors
        try:
            transport.sendto(answer, addr)
        except OSError as exc:
            self.stats.send_errors += 1
            log.debug("answer_send_failed peer=%s error=%r", format_address(addr), str(exc))
            return
        if self.stats.send_errors == errors:
            self.stats.answered += 1

    def _answer_for(self, data: bytes, addr: tuple[Any, ...]) -> bytes | None:
        """The answer to send for ``data``, or ``None`` (and a counter bumped)."""
        return self._rules.answer_for(data, addr)


async def serve_discovery(
    info: InfoSource,
    port: int = DEFAULT_DISCOVERY_PORT,
    *,
    game: str,
    host: str = "0.0.0.0",
    ipv6: bool | None = None,
    ipv6_group: str = DEFAULT_IPV6_GROUP,
) -> DiscoveryResponder:
    """Answer discovery calls on ``port`` with ``info`` until ``close()``.

    ``info`` is a msgpack-able mapping, or a callable returning one, called per
    call so it can report live player counts. ``game`` names the game; calls
    filtered on another game are ignored. ``host`` is the IPv4 address to bind
    (``0.0.0.0`` to hear broadcasts). With ``ipv6`` (default: only when
    ``host`` is the wildcard), a second socket on the same port joins
    ``ipv6_group`` on every multicast interface; if IPv6 is unavailable this is
    logged and skipped. ``port=0`` picks a free port (the IPv6 socket then
    reuses that number). ``ipv6_group`` must be an IPv6 multicast address
    (``ValueError`` at once, before a socket is opened, whether ``ipv6`` is on
    or not).
    """
    port = check_port(port)
    group = _check_ipv6_group(ipv6_group)
    responder = DiscoveryResponder(info, game=game)
    loop = asyncio.get_running_loop()
    try:
        sock4 = _bind_udp(socket.AF_INET, host, port)
        await _attach(loop, responder, sock4)
        if ipv6 if ipv6 is not None else host in ("0.0.0.0", ""):
            sock6 = _group_socket(sock4.getsockname()[1], group)
            if sock6 is not None:
                await _attach(loop, responder, sock6)
    except BaseException:
        responder.close()  # the sockets attached so far
        raise
    return responder


def _check_ipv6_group(group: object) -> bytes:
    """``group`` packed, or a ValueError (a TypeError for what is not a str) naming
    ``ipv6_group``: an IPv6 multicast address, without a ``%scope`` (each interface
    gets its own)."""
    if not isinstance(group, str):
        raise TypeError(f"ipv6_group takes a str, not {group!r}: write {DEFAULT_IPV6_GROUP!r}")
    try:
        packed = socket.inet_pton(socket.AF_INET6, group)
    except (OSError, ValueError):
        packed = b""
    if packed[:1] != b"\xff":
        raise ValueError(f"ipv6_group must be an IPv6 multicast address (ff00::/8), not {group!r}")
    return packed


def _group_socket(port: int, group: bytes) -> socket.socket | None:
    """An IPv6 socket on ``port`` that joined ``group``, or None (logged) when IPv6 or
    the group is unavailable here. Closed on any failure."""
    try:
        sock = _bind_udp(socket.AF_INET6, "::", port)
    except OSError as exc:
        log.info("responder_ipv6_unavailable error=%r", str(exc))
        return None
    try:
        _join_group(sock, group)
    except BaseException as exc:
        sock.close()
        if not isinstance(exc, OSError):
            raise
        log.info("responder_ipv6_unavailable error=%r", str(exc))
        return None
    return sock


async def _attach(
    loop: asyncio.AbstractEventLoop, responder: DiscoveryResponder, sock: socket.socket
) -> None:
    try:
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _ResponderProtocol(responder), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    responder._transports.append(transport)
    responder._port = responder._port or sock.getsockname()[1]


def _bind_udp(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        # Several games on one machine may share the discovery port: with
        # SO_REUSEADDR every socket gets its own copy of each broadcast.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setblocking(False)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _join_group(sock: socket.socket, packed: bytes) -> None:
    """Join the group ``packed`` on every multicast interface (a join is per interface)."""
    joined = 0
    for iface in list_interfaces():
        if not iface.multicast:
            continue
        try:
            mreq = packed + struct.pack("@I", iface.index)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq)
            joined += 1
        except OSError as exc:
            log.debug("group_join_failed iface=%s error=%r", iface.name, str(exc))
    if not joined:
        raise OSError(errno.ENODEV, "no interface could join the IPv6 discovery group")


# --------------------------------------------------------------------------- client


class _Collector(asyncio.DatagramProtocol):
    """Client side: feeds answers to a :class:`Search` on the loop's clock."""

    def __init__(
        self,
        game: str | None,
        loop: asyncio.AbstractEventLoop,
        *,
        timeout: float = 1.0,
        attempts: int = 3,
        request_size: int = DEFAULT_REQUEST_SIZE,
        expected: int | None = None,
        max_hosts: int = DEFAULT_MAX_HOSTS,
    ) -> None:
        self.loop = loop
        self.search = Search(
            now=loop.time(),
            game=game,
            timeout=timeout,
            attempts=attempts,
            request_size=request_size,
            expected=expected,
            max_hosts=max_hosts,
        )
        self.changed = asyncio.Event()

    @property
    def sent_at(self) -> dict[bytes, float]:
        """The search's send time of every call, by nonce."""
        return self.search.sent_at

    @property
    def hosts(self) -> dict[tuple[bytes, int], DiscoveredHost]:
        """The search's fastest answer of every host, by ``(instance id, n)``."""
        return self.search.hosts

    @property
    def malformed(self) -> int:
        """Datagrams the search dropped as malformed."""
        return self.search.malformed

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        if self.search.datagram_received(data, format_address(addr), self.loop.time()):
            self.changed.set()

    def error_received(self, exc: Exception) -> None:
        log.debug("discover_error_received error=%r", str(exc))


async def discover(
    port: int = DEFAULT_DISCOVERY_PORT,
    *,
    timeout: float = 1.0,
    game: str | None = None,
    targets: Iterable[tuple[str, int]] = (),
    broadcast: bool = True,
    ipv6: bool = True,
    ipv6_group: str = DEFAULT_IPV6_GROUP,
    attempts: int = 3,
    request_size: int = DEFAULT_REQUEST_SIZE,
    expected: int | None = None,
    max_hosts: int = DEFAULT_MAX_HOSTS,
) -> list[DiscoveredHost]:
    """Find discovery responders; returns them fastest first.

    Calls go to every interface's IPv4 broadcast address (``broadcast``), to the
    IPv6 group on every multicast interface (``ipv6``) and to each unicast
    ``targets`` address; they are repeated ``attempts`` times spread over the
    first half of ``timeout``. Answers are collected for ``timeout`` seconds, or
    until ``expected`` distinct hosts have answered. ``game`` asks responders of
    other games to stay silent. ``request_size`` pads each call, and so caps
    the answer size: answers larger than the call are never sent, and any
    larger datagram is dropped unread. At most ``max_hosts`` hosts are listed.
    What happened to each datagram is not returned; a :class:`Search` driven
    directly keeps it in ``stats``. No ``targets`` with ``broadcast`` and ``ipv6``
    off is a ValueError at once (nothing would be called), and so is an
    ``ipv6_group`` that is not an IPv6 multicast address.
    """
    port = check_port(port)
    _check_ipv6_group(ipv6_group)
    loop = asyncio.get_running_loop()
    collector = _Collector(
        game,
        loop,
        timeout=timeout,
        attempts=attempts,
        request_size=request_size,
        expected=expected,
        max_hosts=max_hosts,
    )
    destinations = _destinations(port, targets, broadcast, ipv6, ipv6_group)
    async with contextlib.AsyncExitStack() as stack:
        senders: dict[int, asyncio.DatagramTransport] = {}
        for family in _families(destinations):
            sender = await _open_sender(loop, collector, family, stack)
            if sender is not None:
                senders[family] = sender
        await _run(collector, senders, destinations)
    return collector.search.results()


async def _run(
    collector: _Collector,
    senders: Mapping[int, asyncio.DatagramTransport],
    destinations: list[Destination],
) -> None:
    """Drive the search until it is over: send what it asks, wake when it asks."""
    loop, search = collector.loop, collector.search
    while True:
        now = loop.time()
        search.handle_timer(now)
        call = search.call_to_send(now)
        if call is not None:
            _send_call(senders, destinations, call)
        timer = search.get_timer()
        if timer is None:
            return
        collector.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collector.changed.wait(), max(0.0, timer - loop.time()))


Destination = tuple[socket.AddressFamily, tuple[Any, ...]]


def _destinations(
    port: int,
    targets: Iterable[tuple[str, int]],
    broadcast: bool,
    ipv6: bool,
    group: str,
) -> list[Destination]:
    check_sequence(targets, "targets")
    result: list[Destination] = []
    for target in targets:
        check_address(target, "each of targets")
        host, target_port = target[0], check_port(target[1], "each of targets' port")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        result.append((family, _resolve(family, host, target_port)))
    if not result and not broadcast and not ipv6:
        # Nothing would be called: the whole timeout would pass for an empty list.
        raise ValueError("discover() has no destination: targets is empty, broadcast and ipv6 off")
    interfaces = list_interfaces() if broadcast or ipv6 else []
    if broadcast:
        addrs = sorted({i.broadcast for i in interfaces if i.broadcast}) or ["255.255.255.255"]
        result.extend((socket.AF_INET, (a, port)) for a in addrs)
    if ipv6:
        result.extend(
            (socket.AF_INET6, (group, port, 0, i.index)) for i in interfaces if i.multicast
        )
    return result


def _resolve(family: socket.AddressFamily, host: str, port: int) -> tuple[Any, ...]:
    """Numeric resolution only (no DNS from a discovery loop); keeps ``%scope``."""
    flags = socket.AI_NUMERICHOST
    infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM, 0, flags)
    return infos[0][4]


def _families(destinations: list[Destination]) -> list[socket.AddressFamily]:
    return sorted({family for family, _ in destinations})


async def _open_sender(
    loop: asyncio.AbstractEventLoop,
    collector: _Collector,
    family: socket.AddressFamily,
    stack: contextlib.AsyncExitStack,
) -> asyncio.DatagramTransport | None:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if family == socket.AF_INET:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            sock.bind(("0.0.0.0", 0))
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(("::", 0))
        transport, _ = await loop.create_datagram_endpoint(lambda: collector, sock=sock)
    except OSError as exc:
        sock.close()
        log.debug("sender_socket_failed family=%s error=%r", family.name, str(exc))
        return None
    stack.callback(transport.close)
    return transport


def _send_call(
    senders: Mapping[int, asyncio.DatagramTransport],
    destinations: list[Destination],
    call: bytes,
) -> None:
    for family, addr in destinations:
        sender = senders.get(family)
        if sender is None:
            continue
        # A datagram transport reports a failed send (no route out of one
        # interface) to error_received() rather than raising, so one bad
        # interface never stops the calls to the others.
        sender.sendto(call, addr)
