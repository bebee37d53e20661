"""A UDP impairment proxy: put a bad network between any UDP client and any UDP server.

Theory of operation
-------------------
The proxy listens on one UDP socket. Each client address seen there gets its own *session* with
its own upstream socket, connected to the target and opened on that client's first datagram, so
the target sees one distinct source port per client, exactly as if the clients talked to it
directly (through a NAT). A session expires after ``idle_timeout`` seconds without traffic in
either direction; its upstream socket is then closed and a later datagram from the same client
opens a fresh one (with a new source port, as after a NAT rebinding).

Impairments come from two :class:`~rudp.netsim.aio.ConditionedPipe` objects, one per direction:
``upstream`` (client -> target) and ``downstream`` (target -> client). Each pipe is shared by all
sessions, so the proxy models one link, like netem on the server's interface: the clients share
its bandwidth and its loss bursts. The two pipes draw from independent random streams, both derived
from ``seed``, so a run is reproducible for a given arrival order of datagrams. Both profiles can
be replaced at runtime (e.g. ``loss=1.0`` for a blackout and back).

Nothing escapes into the event loop on bad input: socket errors (ICMP port unreachable, oversized
datagrams) are counted in ``stats.errors`` and logged at debug level; failures to open an upstream
socket are logged and cost only that client's datagram.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from rudp.errors import check_address, check_port
from rudp.netsim.aio import ConditionedPipe
from rudp.netsim.conditioner import LinkProfile, LinkStats, check_profile

__all__ = ["Proxy", "ProxyStats", "format_address", "parse_address", "start_proxy"]

log = logging.getLogger(__name__)

# A socket address as asyncio reports it: (host, port) for IPv4, (host, port, flow, scope) for IPv6.
Address = tuple[Any, ...]

# Datagrams that come out of the upstream pipe before the client's socket is open are parked here;
# opening a socket takes one or two loop iterations, so a handful is plenty.
_MAX_PARKED = 64
_CLOSE_TIMEOUT = 2.0


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` or ``[IPV6]:PORT`` into ``(host, port)``; ValueError when malformed."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT or [IPV6]:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"write IPv6 addresses in brackets, e.g. [::1]:9000, got {text!r}")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {text!r}")
    return host, int(port_text)


def format_address(address: Address) -> str:
    """``HOST:PORT``, with IPv6 hosts in brackets."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _derive_seed(seed: int, label: str) -> int:
    # Independent, reproducible streams per direction without correlating Random(seed) sequences.
    digest = hashlib.sha256(f"rudp.netsim/{seed}/{label}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class ProxyStats:
    """A snapshot of the proxy's counters."""

    upstream: LinkStats = field(default_factory=LinkStats)  # client -> target
    downstream: LinkStats = field(default_factory=LinkStats)  # target -> client
    clients: int = 0  # live sessions
    clients_created: int = 0
    clients_expired: int = 0
    clients_rejected: int = 0  # datagrams from new clients refused because max_clients was reached
    errors: int = 0  # socket errors and failed upstream socket opens


class _Session:
    """One client address and its upstream socket (None while it is being opened)."""

    def __init__(self, client: Address, now: float, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.last_active = now
        self.transport: asyncio.DatagramTransport | None = None
        self.parked: list[bytes] = []
        self.dead = False
        self.lost: asyncio.Future[None] = loop.create_future()

    def attach(self, transport: asyncio.DatagramTransport) -> None:
        self.transport = transport
        parked, self.parked = self.parked, []
        for data in parked:
            transport.sendto(data)

    def send(self, data: bytes) -> None:
        if self.dead:
            return
        if self.transport is None:
            if len(self.parked) < _MAX_PARKED:
                self.parked.append(data)
        elif not self.transport.is_closing():
            self.transport.sendto(data)

    def close(self) -> None:
        self.dead = True
        self.parked.clear()
        if self.transport is not None:
            self.transport.close()
        elif not self.lost.done():
            self.lost.set_result(None)  # never opened: nothing to wait for


class _Protocol(asyncio.DatagramProtocol):
    """Forwards events of one socket to the proxy; ``session`` is None for the listen socket."""

    def __init__(self, proxy: Proxy, session: _Session | None, lost: asyncio.Future[None]) -> None:
        self._proxy = proxy
        self._session = session
        self._lost = lost

    def datagram_received(self, data: bytes, addr: Address) -> None:
        try:
            if self._session is None:
                self._proxy._from_client(data, addr)
            else:
                self._proxy._from_target(data, self._session)
        except Exception:  # a proxy bug must cost one datagram, not the event loop
            log.exception("forward_failed peer=%s", format_address(addr))

    def error_received(self, exc: Exception) -> None:
        self._proxy._note_error(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)


class Proxy:
    """A running impairment proxy. Create it with :func:`start_proxy`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        target: Address,
        target_family: int,
        *,
        upstream: LinkProfile,
        downstream: LinkProfile,
        seed: int,
        idle_timeout: float,
        max_clients: int,
    ) -> None:
        self._loop = loop
        self._target = target
        self._target_family = target_family
        self._idle_timeout = idle_timeout
        self._max_clients = max_clients
        self._up: ConditionedPipe[_Session] = ConditionedPipe(
            loop, upstream, self._deliver_upstream, seed=_derive_seed(seed, "upstream")
        )
        self._down: ConditionedPipe[Address] = ConditionedPipe(
            loop, downstream, self._deliver_downstream, seed=_derive_seed(seed, "downstream")
        )
        self._sessions: dict[Address, _Session] = {}
        self._opening: set[asyncio.Task[None]] = set()
        self._transport: asyncio.DatagramTransport | None = None
        self._lost: asyncio.Future[None] = loop.create_future()
        self._address: tuple[str, int] = ("", 0)
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        # What close() waits for: the listen socket's and each session's connection_lost.
        self._closing: list[asyncio.Future[None]] = []
        self._counts = ProxyStats()

    # -- public API ---------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the proxy listens on; the real port when 0 was asked."""
        return self._address

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<rudp.netsim Proxy {format_address(self.address)} -> "
            f"{format_address(self.target)}{state}>"
        )

    @property
    def target(self) -> tuple[str, int]:
        """The resolved (host, port) datagrams are forwarded to."""
        return str(self._target[0]), int(self._target[1])

    @property
    def upstream(self) -> LinkProfile:
        """Impairments from clients to the target; assign to change them at once."""
        return self._up.profile

    @upstream.setter
    def upstream(self, profile: LinkProfile) -> None:
        self._up.profile = check_profile(profile, "Proxy.upstream")

    @property
    def downstream(self) -> LinkProfile:
        """Impairments from the target back to clients; assign to change them at once."""
        return self._down.profile

    @downstream.setter
    def downstream(self, profile: LinkProfile) -> None:
        self._down.profile = check_profile(profile, "Proxy.downstream")

    @property
    def clients(self) -> int:
        """Number of live client sessions (each with its own upstream socket)."""
        return len(self._sessions)

    @property
    def stats(self) -> ProxyStats:
        """A snapshot; later traffic does not change the returned object."""
        return replace(
            self._counts,
            upstream=replace(self._up.stats),
            downstream=replace(self._down.stats),
            clients=len(self._sessions),
        )

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Stop forwarding, drop datagrams in flight and close every socket. Idempotent.

        Every socket is closed before the first await, so a ``close()`` cancelled while it
        waits for them to go has closed the proxy all the same; a later ``close()`` waits
        again for whatever is still going.
        """
        if not self._closed:
            self._closed = True
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._up.close()
            self._down.close()
            for task in self._opening:
                task.cancel()  # _open_upstream closes its socket on the way out
            self._closing = [self._lost] + [s.lost for s in self._sessions.values()]
            for session in list(self._sessions.values()):
                session.close()
            self._sessions.clear()
            if self._transport is not None:
                self._transport.close()
            elif not self._lost.done():
                self._lost.set_result(None)  # never bound: nothing to wait for
        # connection_lost arrives on a later loop iteration; bounded in case a transport
        # misbehaves. asyncio.wait cancels none of them, on a timeout or when close() is
        # cancelled, so a later close() can wait for them again.
        pending = {f for f in (*self._opening, *self._closing) if not f.done()}
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_TIMEOUT)

    async def __aenter__(self) -> Proxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- setup --------------------------------------------------------------------------------

    async def _bind(self, listen: tuple[str, int]) -> None:
        transport, _ = await self._loop.create_datagram_endpoint(
            lambda: _Protocol(self, None, self._lost), local_addr=listen
        )
        self._transport = transport
        sockname = transport.get_extra_info("sockname")
        self._address = (str(sockname[0]), int(sockname[1]))
        self._arm_sweeper()

    # -- forwarding -------------------------------------------------------------------------

    def _from_client(self, data: bytes, addr: Address) -> None:
        if self._closed:
            return
        session = self._sessions.get(addr) or self._open_session(addr)
        if session is None:
            return
        session.last_active = self._loop.time()
        self._up.send(data, session)

    def _from_target(self, data: bytes, session: _Session) -> None:
        if self._closed or session.dead:
            return
        session.last_active = self._loop.time()
        self._down.send(data, session.client)

    def _deliver_upstream(self, data: bytes, session: _Session) -> None:
        session.send(data)  # a no-op if the session expired while the datagram was in flight

    def _deliver_downstream(self, data: bytes, client: Address) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(data, client)

    def _note_error(self, exc: Exception) -> None:
        self._counts.errors += 1
        log.debug("socket_error error=%r", str(exc))

    # -- sessions -----------------------------------------------------------------------------

    def _open_session(self, client: Address) -> _Session | None:
        if len(self._sessions) >= self._max_clients:
            self._counts.clients_rejected += 1
            return None
        session = _Session(client, self._loop.time(), self._loop)
        self._sessions[client] = session
        self._counts.clients_created += 1
        task = self._loop.create_task(self._open_upstream(session))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)
        return session

    async def _open_upstream(self, session: _Session) -> None:
        sock: socket.socket | None = None
        try:
            # Connect the socket ourselves: asyncio's remote_addr only takes a 2-tuple, which would
            # lose an IPv6 scope id. Connecting a UDP socket does no I/O, so it cannot block. A
            # connected socket also ignores datagrams from anyone but the target.
            sock = socket.socket(self._target_family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.connect(self._target)
            transport, _ = await self._loop.create_datagram_endpoint(
                lambda: _Protocol(self, session, session.lost), sock=sock
            )
        except asyncio.CancelledError:  # close() while opening
            if sock is not None:
                sock.close()
            raise
        except Exception as exc:  # out of descriptors, unreachable family, ...: lose this client
            if sock is not None:
                sock.close()
            client = format_address(session.client)
            log.warning("upstream_socket_failed client=%s error=%r", client, str(exc))
            self._counts.errors += 1
            self._forget(session)
            return
        if session.dead:  # expired or proxy closed while the socket was being opened
            transport.close()
            return
        session.attach(transport)

    def _forget(self, session: _Session) -> None:
        session.close()
        if self._sessions.get(session.client) is session:
            del self._sessions[session.client]

    def _arm_sweeper(self) -> None:
        # Checking a few times per timeout bounds how late a session expires (by a quarter of it).
        interval = min(max(self._idle_timeout / 4.0, 0.01), 1.0)
        self._sweeper = self._loop.call_later(interval, self._sweep)

    def _sweep(self) -> None:
        now = self._loop.time()
        for session in list(self._sessions.values()):
            if now - session.last_active >= self._idle_timeout:
                log.debug("session_idle client=%s", format_address(session.client))
                self._forget(session)
                self._counts.clients_expired += 1
        self._arm_sweeper()


async def start_proxy(
    listen: tuple[str, int],
    target: tuple[str, int],
    *,
    upstream: LinkProfile,
    downstream: LinkProfile,
    seed: int = 0,
    idle_timeout: float = 60.0,
    max_clients: int = 4096,
) -> Proxy:
    """Resolve ``target``, bind ``listen`` (port 0 picks a free port) and start forwarding.

    ``upstream`` impairs client -> target traffic, ``downstream`` target -> client traffic.
    ``max_clients`` bounds the number of upstream sockets; datagrams from further new clients are
    dropped and counted in ``stats.clients_rejected``. An argument of the wrong type (a float or
    a bool for ``max_clients``, a bool for ``idle_timeout``) is a TypeError, one out of range a
    ValueError. Raises OSError when binding or resolving fails.
    """
    check_address(listen, "listen")
    check_address(target, "target")
    check_port(listen[1], "listen port")
    check_port(target[1], "target port")
    check_profile(upstream, "upstream")
    check_profile(downstream, "downstream")
    # A bool is an int: True would pass for one second, or for one client.
    if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, int | float):
        raise TypeError(f"idle_timeout takes a number of seconds, not {idle_timeout!r}")
    if not (idle_timeout > 0.0 and math.isfinite(idle_timeout)):
        raise ValueError(
            f"idle_timeout must be a finite number of seconds > 0, got {idle_timeout!r}"
        )
    if isinstance(max_clients, bool) or not isinstance(max_clients, int):
        raise TypeError(f"max_clients takes an int, not {max_clients!r}")
    if max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients!r}")
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target[0], target[1], type=socket.SOCK_DGRAM)
    if not infos:
        raise OSError(f"cannot resolve target {format_address(target)}")
    family, _, _, _, target_addr = infos[0]
    proxy = Proxy(
        loop,
        tuple(target_addr),
        family,
        upstream=upstream,
        downstream=downstream,
        seed=seed,
        idle_timeout=idle_timeout,
        max_clients=max_clients,
    )
    await proxy._bind(listen)
    return proxy
