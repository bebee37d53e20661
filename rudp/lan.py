"""LAN game discovery: the article's LANCALL / LANANSWER, over plain asyncio UDP.

Theory of operation
-------------------
A host that wants to be found runs a *responder* (:func:`serve_discovery`): one
IPv4 socket bound to ``0.0.0.0:port`` (receives directed and limited
broadcasts) and, when IPv6 works, one IPv6 socket bound to ``[::]:port`` that
joins the link-local group :data:`DEFAULT_IPV6_GROUP` on every multicast-capable
interface. A client (:func:`discover`) sends one *call* to every target:

* the IPv4 broadcast address of every interface that has ``IFF_BROADCAST``
  (found with ``SIOCGIFFLAGS`` / ``SIOCGIFBRDADDR`` on Linux; elsewhere only the
  limited broadcast ``255.255.255.255``, which leaves on one interface only);
* the IPv6 group, once per multicast-capable interface (the scope id picks the
  link, since ``ff02::`` addresses mean nothing without one);
* any unicast ``targets`` the caller names (e.g. ``127.0.0.1`` on one machine).

Calls are re-sent ``attempts`` times, each with a fresh random nonce, because a
broadcast can be lost like any datagram. A responder answers each call with its
info; the nonce ties an answer to the call it answers, so stray or replayed
answers are ignored and the round-trip time is measured against the right send
time (Karn's rule, for free). Answers are de-duplicated by the responder's
random instance id, keeping the fastest one, so a host reached over IPv4 and
IPv6 is reported once.

Anti-amplification: a call is padded to ``request_size`` bytes and a responder
never sends an answer larger than the call it answers (it drops and counts it
instead), so spoofing the source address of a call buys an attacker nothing.

Peers never crash us: malformed datagrams are counted in
:class:`DiscoveryStats` and dropped; nothing raises out of the event loop.

Wire format (network byte order, both directions)::

    offset  size  field
    0       4     magic  b"rLAN"
    4       1     version (1)
    5       1     kind   (1 = CALL, 2 = ANSWER)
    6       8     nonce  (random, chosen by the caller, echoed by the answer)
    14      2     body length N
    16      N     body: msgpack map
    16+N    ...   CALL only: zero padding up to the request size

    CALL body:    {"game": str | nil}            nil = any game
    ANSWER body:  {"id": bin(8), "game": str, "info": map}
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack

__all__ = [
    "DEFAULT_DISCOVERY_PORT",
    "DEFAULT_IPV6_GROUP",
    "DEFAULT_REQUEST_SIZE",
    "DiscoveredHost",
    "DiscoveryResponder",
    "DiscoveryStats",
    "Interface",
    "discover",
    "list_interfaces",
    "serve_discovery",
]

log = logging.getLogger(__name__)

#: UDP port responders listen on unless told otherwise.
DEFAULT_DISCOVERY_PORT = 47_474
#: Link-local IPv6 group the responders join ("rudp" in ASCII in the low bits).
DEFAULT_IPV6_GROUP = "ff02::7275:6470"
#: Size every call is padded to, and so the largest answer a responder may send.
#: 1200 bytes fits any IPv6 path MTU (RFC 8200 minimum is 1280) without fragments.
DEFAULT_REQUEST_SIZE = 1200

MAGIC = b"rLAN"
VERSION = 1
HEADER = struct.Struct("!4sBB8sH")
NONCE_SIZE = 8
INSTANCE_ID_SIZE = 8
MAX_GAME_NAME = 64
#: Upper bound on what we read from a socket: calls are never larger than this.
MAX_DATAGRAM = 65_507


class Kind(enum.IntEnum):
    CALL = 1
    ANSWER = 2


class MalformedDatagram(ValueError):
    """A discovery datagram failed to parse (internal; always caught)."""


@dataclass(frozen=True, slots=True)
class Packet:
    """A parsed discovery datagram."""

    kind: Kind
    nonce: bytes
    body: dict[str, Any]


def encode_packet(kind: Kind, nonce: bytes, body: Mapping[str, Any], *, pad_to: int = 0) -> bytes:
    """Encode a datagram; a CALL is zero-padded up to ``pad_to`` bytes."""
    payload = msgpack.packb(dict(body), use_bin_type=True)
    if len(payload) > 0xFFFF:
        raise ValueError("discovery body too large")
    data = HEADER.pack(MAGIC, VERSION, kind, nonce, len(payload)) + payload
    if len(data) < pad_to:
        data += bytes(pad_to - len(data))
    return data


def decode_packet(data: bytes) -> Packet:
    """Parse a datagram, raising :class:`MalformedDatagram` on any defect."""
    if len(data) < HEADER.size:
        raise MalformedDatagram("short header")
    magic, version, kind, nonce, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedDatagram("bad magic")
    if version != VERSION:
        raise MalformedDatagram("unsupported version")
    if kind not in (Kind.CALL, Kind.ANSWER):
        raise MalformedDatagram("unknown kind")
    end = HEADER.size + length
    if end > len(data):
        raise MalformedDatagram("truncated body")
    if kind == Kind.ANSWER and end != len(data):
        raise MalformedDatagram("trailing bytes")
    body = _unpack_map(data[HEADER.size : end])
    return Packet(Kind(kind), nonce, body)


def _unpack_map(raw: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedDatagram(f"bad msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedDatagram("body is not a map")
    return obj


def _call_game(body: Mapping[str, Any]) -> str | None:
    game = body.get("game")
    if game is not None and not (isinstance(game, str) and len(game) <= MAX_GAME_NAME):
        raise MalformedDatagram("bad game filter")
    return game


# --------------------------------------------------------------------------- interfaces


@dataclass(frozen=True, slots=True)
class Interface:
    """A network interface as far as discovery cares."""

    name: str
    """Kernel name, e.g. ``eth0``."""
    index: int
    """Interface index, the IPv6 scope id."""
    broadcast: str | None
    """IPv4 broadcast address, or ``None`` if the interface has none."""
    multicast: bool
    """Whether IPv6 link-local multicast can be sent out of it."""


# <linux/if.h> flags and <linux/sockios.h> requests.
IFF_UP = 0x1
IFF_BROADCAST = 0x2
IFF_LOOPBACK = 0x8
IFF_MULTICAST = 0x1000
SIOCGIFFLAGS = 0x8913
SIOCGIFBRDADDR = 0x8919
IFREQ = struct.Struct("16s24x")  # struct ifreq: name, then a 24-byte union


def list_interfaces() -> list[Interface]:
    """Enumerate interfaces with their IPv4 broadcast address and multicast ability.

    Uses ``ioctl`` on Linux; on other systems returns an empty list (discovery
    then falls back to the limited broadcast address).
    """
    if not sys.platform.startswith("linux"):
        return []
    import fcntl  # Unix-only module; imported here so the rest works elsewhere.

    result: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for index, name in socket.if_nameindex():
            try:
                req = IFREQ.pack(name.encode())
                flags = struct.unpack_from("H", fcntl.ioctl(probe, SIOCGIFFLAGS, req), 16)[0]
            except OSError:
                continue  # vanished between listing and asking
            if not flags & IFF_UP:
                continue
            broadcast = None
            if flags & IFF_BROADCAST:
                broadcast = _broadcast_address(fcntl.ioctl, probe, req)
            multicast = bool(flags & IFF_MULTICAST) and not flags & IFF_LOOPBACK
            result.append(Interface(name, index, broadcast, multicast))
    return result


def _broadcast_address(
    ioctl: Callable[[socket.socket, int, bytes], bytes], probe: socket.socket, req: bytes
) -> str | None:
    try:
        reply = ioctl(probe, SIOCGIFBRDADDR, req)
    except OSError:
        return None  # no IPv4 address on this interface
    # struct sockaddr_in starts at offset 16: family(2) port(2) addr(4).
    addr = socket.inet_ntoa(reply[20:24])
    return None if addr == "0.0.0.0" else addr


def _format_address(addr: tuple[Any, ...]) -> tuple[str, int]:
    """``(host, port)`` from a socket address; link-local IPv6 keeps its ``%scope``."""
    host, port = str(addr[0]), int(addr[1])
    if len(addr) == 4 and addr[3] and "%" not in host:
        try:
            host = f"{host}%{socket.if_indextoname(addr[3])}"
        except OSError:
            host = f"{host}%{addr[3]}"
    return host, port


# --------------------------------------------------------------------------- responder


@dataclass(slots=True)
class DiscoveryStats:
    """Counters kept by a responder. Every dropped datagram lands in exactly one."""

    requests: int = 0
    """Well-formed calls received."""
    answered: int = 0
    """Answers sent."""
    malformed: int = 0
    """Datagrams that failed to parse (wrong magic, version, truncated, bad body)."""
    oversize: int = 0
    """Answers withheld because they would be larger than the call (anti-amplification)."""
    other_game: int = 0
    """Calls filtered on a different game."""
    info_errors: int = 0
    """Calls left unanswered because the info callable raised or gave bad data."""
    send_errors: int = 0
    """Answers the kernel refused to send."""


InfoSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


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
        log.debug("lan.responder.error_received error=%r", exc)


class DiscoveryResponder:
    """Answers discovery calls with this host's info. Create with :func:`serve_discovery`."""

    def __init__(self, info: InfoSource, *, game: str) -> None:
        if not game or len(game) > MAX_GAME_NAME:
            raise ValueError(f"game must be 1..{MAX_GAME_NAME} characters")
        self.game = game
        self.stats = DiscoveryStats()
        self.instance_id = os.urandom(INSTANCE_ID_SIZE)
        self._info = info
        self._transports: list[asyncio.DatagramTransport] = []
        self._port = 0
        self._closed = asyncio.Event()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Local addresses the responder listens on."""
        return [_format_address(t.get_extra_info("sockname")) for t in self._transports]

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``); 0 before binding."""
        return self._port

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
        try:
            transport.sendto(answer, addr)
        except OSError as exc:
            self.stats.send_errors += 1
            log.debug("lan.responder.send_failed addr=%s error=%r", addr, exc)
            return
        self.stats.answered += 1

    def _answer_for(self, data: bytes, addr: tuple[Any, ...]) -> bytes | None:
        """The answer to send for ``data``, or ``None`` (and a counter bumped)."""
        try:
            packet = decode_packet(data)
            if packet.kind != Kind.CALL:
                raise MalformedDatagram("not a call")
            wanted = _call_game(packet.body)
        except MalformedDatagram as exc:
            self.stats.malformed += 1
            log.debug("lan.responder.malformed addr=%s reason=%s", addr, exc)
            return None
        self.stats.requests += 1
        if wanted is not None and wanted != self.game:
            self.stats.other_game += 1
            return None
        answer = self._encode_answer(packet.nonce)
        if answer is None:
            return None
        if len(answer) > len(data):
            self.stats.oversize += 1
            log.debug(
                "lan.responder.oversize addr=%s answer=%d call=%d", addr, len(answer), len(data)
            )
            return None
        return answer

    def _encode_answer(self, nonce: bytes) -> bytes | None:
        try:
            info = self._info() if callable(self._info) else self._info
            body = {"id": self.instance_id, "game": self.game, "info": dict(info)}
            return encode_packet(Kind.ANSWER, nonce, body)
        except Exception:
            # The info callable is user code; its failure must not kill the loop.
            self.stats.info_errors += 1
            log.exception("lan.responder.info_failed")
            return None


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
    reuses that number).
    """
    responder = DiscoveryResponder(info, game=game)
    loop = asyncio.get_running_loop()
    sock4 = _bind_udp(socket.AF_INET, host, port)
    await _attach(loop, responder, sock4)
    if ipv6 if ipv6 is not None else host in ("0.0.0.0", ""):
        try:
            sock6 = _bind_udp(socket.AF_INET6, "::", sock4.getsockname()[1])
            _join_group(sock6, ipv6_group)
        except OSError as exc:
            log.info("lan.responder.ipv6_unavailable error=%r", exc)
        else:
            await _attach(loop, responder, sock6)
    return responder


async def _attach(
    loop: asyncio.AbstractEventLoop, responder: DiscoveryResponder, sock: socket.socket
) -> None:
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _ResponderProtocol(responder), sock=sock
    )
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


def _join_group(sock: socket.socket, group: str) -> None:
    """Join ``group`` on every multicast interface (a join is per interface)."""
    packed = socket.inet_pton(socket.AF_INET6, group)
    joined = 0
    for iface in list_interfaces():
        if not iface.multicast:
            continue
        try:
            mreq = packed + struct.pack("@I", iface.index)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq)
            joined += 1
        except OSError as exc:
            log.debug("lan.responder.join_failed iface=%s error=%r", iface.name, exc)
    if not joined:
        sock.close()
        raise OSError(errno.ENODEV, "no interface could join the IPv6 discovery group")


# --------------------------------------------------------------------------- client


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
    """Random id of the responder, used to merge answers that arrived by several routes."""


class _Collector(asyncio.DatagramProtocol):
    """Client side: matches answers to outstanding nonces and keeps the fastest per host."""

    def __init__(self, game: str | None, loop: asyncio.AbstractEventLoop) -> None:
        self.game = game
        self.loop = loop
        self.sent_at: dict[bytes, float] = {}
        self.hosts: dict[bytes, DiscoveredHost] = {}
        self.malformed = 0
        self.changed = asyncio.Event()

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        now = self.loop.time()
        try:
            host = self._parse(data, addr, now)
        except MalformedDatagram as exc:
            self.malformed += 1
            log.debug("lan.discover.malformed addr=%s reason=%s", addr, exc)
            return
        if host is None:
            return
        best = self.hosts.get(host.instance_id)
        if best is None or host.rtt < best.rtt:
            self.hosts[host.instance_id] = host
            self.changed.set()

    def error_received(self, exc: Exception) -> None:
        log.debug("lan.discover.error_received error=%r", exc)

    def _parse(self, data: bytes, addr: tuple[Any, ...], now: float) -> DiscoveredHost | None:
        packet = decode_packet(data)
        if packet.kind != Kind.ANSWER:
            return None  # our own broadcast call looping back, or another client's
        sent = self.sent_at.get(packet.nonce)
        if sent is None:
            return None  # not an answer to any of our calls
        body = packet.body
        instance, game, info = body.get("id"), body.get("game"), body.get("info")
        if not (isinstance(instance, bytes) and len(instance) == INSTANCE_ID_SIZE):
            raise MalformedDatagram("bad instance id")
        if not isinstance(game, str) or not isinstance(info, dict):
            raise MalformedDatagram("bad game or info")
        if self.game is not None and game != self.game:
            return None
        return DiscoveredHost(_format_address(addr), game, info, max(0.0, now - sent), instance)


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
) -> list[DiscoveredHost]:
    """Find discovery responders; returns them fastest first.

    Calls go to every interface's IPv4 broadcast address (``broadcast``), to the
    IPv6 group on every multicast interface (``ipv6``) and to each unicast
    ``targets`` address; they are repeated ``attempts`` times spread over the
    first half of ``timeout``. Answers are collected for ``timeout`` seconds, or
    until ``expected`` distinct hosts have answered. ``game`` asks responders of
    other games to stay silent. ``request_size`` pads each call, and so caps
    the answer size (answers larger than the call are never sent).
    """
    if timeout <= 0 or attempts < 1:
        raise ValueError("timeout must be positive and attempts at least 1")
    if request_size < HEADER.size or request_size > MAX_DATAGRAM:
        raise ValueError(f"request_size must be in {HEADER.size}..{MAX_DATAGRAM}")
    loop = asyncio.get_running_loop()
    collector = _Collector(game, loop)
    destinations = _destinations(port, targets, broadcast, ipv6, ipv6_group)
    async with contextlib.AsyncExitStack() as stack:
        senders: dict[int, asyncio.DatagramTransport] = {}
        for family in _families(destinations):
            sender = await _open_sender(loop, collector, family, stack)
            if sender is not None:
                senders[family] = sender
        interval = timeout / (2 * attempts)
        deadline = loop.time() + timeout
        for attempt in range(attempts):
            _send_calls(collector, senders, destinations, game, request_size)
            await _wait(collector, expected, min(deadline, loop.time() + interval))
            if _enough(collector, expected) or attempt == attempts - 1:
                break
        await _wait(collector, expected, deadline)
    return sorted(collector.hosts.values(), key=lambda h: h.rtt)


Destination = tuple[socket.AddressFamily, tuple[Any, ...]]


def _destinations(
    port: int,
    targets: Iterable[tuple[str, int]],
    broadcast: bool,
    ipv6: bool,
    group: str,
) -> list[Destination]:
    result: list[Destination] = []
    for host, target_port in targets:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        result.append((family, _resolve(family, host, target_port)))
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
        log.debug("lan.discover.socket_failed family=%s error=%r", family.name, exc)
        return None
    stack.callback(transport.close)
    return transport


def _send_calls(
    collector: _Collector,
    senders: Mapping[int, asyncio.DatagramTransport],
    destinations: list[Destination],
    game: str | None,
    request_size: int,
) -> None:
    # A fresh nonce per attempt: an answer then tells exactly which send it
    # answers, so the RTT is never measured against a retransmission.
    nonce = os.urandom(NONCE_SIZE)
    call = encode_packet(Kind.CALL, nonce, {"game": game}, pad_to=request_size)
    collector.sent_at[nonce] = collector.loop.time()
    for family, addr in destinations:
        sender = senders.get(family)
        if sender is None:
            continue
        # A datagram transport reports a failed send (no route out of one
        # interface) to error_received() rather than raising, so one bad
        # interface never stops the calls to the others.
        sender.sendto(call, addr)


def _enough(collector: _Collector, expected: int | None) -> bool:
    return expected is not None and len(collector.hosts) >= expected


async def _wait(collector: _Collector, expected: int | None, until: float) -> None:
    """Wait until ``until`` (loop time) or until ``expected`` hosts answered."""
    loop = collector.loop
    while not _enough(collector, expected):
        remaining = until - loop.time()
        if remaining <= 0:
            return
        collector.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(collector.changed.wait(), remaining)
