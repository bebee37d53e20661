"""``serve()``, ``connect()`` and the ``Server`` they share the socket code with."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from types import TracebackType
from typing import Any

from rudp.aio.connection import Connection
from rudp.aio.endpoint import AioEndpoint, ForeignHandler, Handler, QueryHandler
from rudp.aio.protocol import DatagramLink, open_protocol_endpoint, reads_with_add_reader
from rudp.config import Config
from rudp.connection import Address
from rudp.stats import EndpointStats


def _set_buffers(sock: socket.socket, size: int) -> None:
    if size <= 0:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        # The kernel clamps to its maximum; a smaller buffer still works.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


async def _resolve(host: str, port: int, family: int = 0, flags: int = 0) -> tuple[int, Address]:
    if not 0 <= port <= 65535:  # getaddrinfo would silently take it modulo 65536
        raise ValueError(f"port must be in 0..65535, got {port}")
    literal = _literal(host, port, family, flags)
    if literal is not None:
        return literal
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM, flags=flags)
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    fam, _, _, _, sockaddr = infos[0]
    return fam, tuple(sockaddr)


def _literal(host: str, port: int, family: int, flags: int) -> tuple[int, Address] | None:
    """What getaddrinfo gives for an IP literal (what a game nearly always passes),
    without its round trip through the loop's thread pool; None for anything else."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None  # a name, or an IPv6 address with a zone: ask getaddrinfo
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            return None  # "%eth0": getaddrinfo turns the zone into an interface index
        if family in (0, socket.AF_INET6):
            return socket.AF_INET6, (ip.compressed, port, 0, 0)
    elif family in (0, socket.AF_INET):
        return socket.AF_INET, (ip.compressed, port)
    elif family == socket.AF_INET6 and flags & socket.AI_V4MAPPED:
        return socket.AF_INET6, (f"::ffff:{ip.compressed}", port, 0, 0)
    return None  # a family mismatch: getaddrinfo says what is wrong


async def _open_socket(host: str | None, port: int, family: int, config: Config) -> socket.socket:
    if host is None:
        host = "::" if family == socket.AF_INET6 else "0.0.0.0"
    fam, sockaddr = await _resolve(host, port, family)
    sock = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        if fam == socket.AF_INET6 and sockaddr[0] == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        _set_buffers(sock, config.socket_buffer_size)
        sock.bind(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


class Server:
    """A UDP socket accepting rudp connections; also connects out from the same socket.

    An async context manager: leaving the block closes every connection gracefully.
    """

    def __init__(self, endpoint: AioEndpoint, link: DatagramLink | None = None) -> None:
        self._endpoint = endpoint
        self._link = link

    @property
    def datagram_protocol(self) -> bool:
        """True where the loop has no ``add_reader`` (Windows' Proactor): datagrams then
        go through a ``DatagramProtocol`` (``rudp.aio.protocol``)."""
        return self._link is not None

    @property
    def address(self) -> Address:
        """The bound (host, port); port 0 was replaced by the one the OS picked."""
        return self._endpoint.local_address[:2]

    @property
    def connections(self) -> list[Connection]:
        """The accepted connections that are still open."""
        return self._endpoint.connections()

    @property
    def stats(self) -> EndpointStats:
        return self._endpoint.core.stats

    @property
    def endpoint(self) -> AioEndpoint:
        return self._endpoint

    @property
    def public_key(self) -> bytes | None:
        """This endpoint's static public key (``Config.static_key``'s public half), the
        ``server_key`` its clients use to authenticate it; None without a static key."""
        return self._endpoint.core.public_key

    @property
    def on_query(self) -> QueryHandler | None:
        """``fn(payload, addr) -> bytes | None`` answering unconnected queries.

        A reply larger than the request is not sent (no amplification).
        """
        return self._endpoint.on_query

    @on_query.setter
    def on_query(self, handler: QueryHandler | None) -> None:
        self._endpoint.on_query = handler

    @property
    def on_foreign(self) -> ForeignHandler | None:
        """``fn(datagram, addr) -> replies`` for another protocol sharing the socket.

        While set, a datagram starting with ``FF FF FF FF`` (A2S, Quake's
        out-of-band packets; never a rudp packet) goes to it instead of rudp; each
        datagram it returns is sent back to ``addr``. It must bound its replies
        itself (see ``rudp.a2s``); an exception it raises is logged and counted.
        """
        return self._endpoint.on_foreign

    @on_foreign.setter
    def on_foreign(self, handler: ForeignHandler | None) -> None:
        self._endpoint.set_foreign_handler(handler)

    def set_datagram_handler(self, first_byte: int, handler: ForeignHandler | None) -> None:
        """Like `on_foreign`, for datagrams starting with `first_byte` (one no rudp
        datagram starts with: not ``0xA0``-``0xAF``); None gives them back to rudp."""
        self._endpoint.set_datagram_handler(first_byte, handler)

    def send_datagram(self, data: bytes, address: Address) -> None:
        """Send one datagram of another protocol from this socket (never rudp's:
        its first byte is checked). Nothing is sent once the socket is closed."""
        self._endpoint.send_datagram(data, address)

    async def connect(self, host: str, port: int, *, server_key: bytes | None = None) -> Connection:
        """Open an outgoing connection from this server's socket (NAT traversal).

        ``server_key`` (default ``Config.server_key``): the peer's public key to expect.
        """
        _, address = await _resolve(host, port, *self._endpoint.destination_family())
        return await self._endpoint.connect(address, server_key=server_key)

    async def query(
        self, address: tuple[str, int], payload: bytes, timeout: float = 1.0
    ) -> tuple[bytes, float]:
        """Send an unconnected query; returns (reply, round-trip seconds)."""
        _, resolved = await _resolve(address[0], address[1], *self._endpoint.destination_family())
        return await self._endpoint.query(resolved, payload, timeout)

    async def close(self) -> None:
        """Close every connection gracefully, then the socket.

        Bounded: connections and handlers get ``Config.close_timeout`` plus a second;
        handlers still running then are cancelled (and get a second for their cleanup).
        A handler may call it; it is not waited for.
        """
        await self._endpoint.close()
        if self._link is not None:
            await self._link.released()

    async def wait_closed(self) -> None:
        await self._endpoint.wait_closed()
        if self._link is not None:
            await self._link.released()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def open_endpoint(
    host: str | None = None,
    port: int = 0,
    *,
    handler: Handler | None = None,
    config: Config | None = None,
    family: int = 0,
) -> Server:
    """Bind a UDP socket; with ``handler`` it accepts connections, else it only connects out."""
    loop = asyncio.get_running_loop()
    cfg = config or Config()
    sock = await _open_socket(host, port, family, cfg)
    accept = handler is not None
    try:
        if reads_with_add_reader(loop, sock):
            return Server(AioEndpoint(loop, sock, cfg, accept=accept, handler=handler))
        # Windows' Proactor loop
        endpoint, link = await open_protocol_endpoint(
            loop, sock, cfg, accept=accept, handler=handler
        )
    except BaseException:
        sock.close()
        raise
    return Server(endpoint, link)


async def serve(
    handler: Handler, host: str | None, port: int, *, config: Config | None = None
) -> Server:
    """Accept rudp connections on ``host:port``; run ``await handler(conn)`` for each.

    When the handler returns, its connection is closed gracefully.
    """
    return await open_endpoint(host, port, handler=handler, config=config)


async def connect(
    host: str,
    port: int,
    *,
    config: Config | None = None,
    local_addr: tuple[str, int] | None = None,
    server_key: bytes | None = None,
) -> Connection:
    """Connect to a rudp server. Raises ``ConnectRefused`` or ``ConnectTimeout``.

    ``server_key`` (default ``Config.server_key``) is the server's public key: the
    handshake then proves the server holds its private half (Noise NK), and
    ``conn.server_authenticated`` is True. Without it the connection is sealed all
    the same, but the server is not authenticated (Noise NN).
    """
    cfg = config or Config()
    family, address = await _resolve(host, port)
    local_host = local_addr[0] if local_addr else ("::" if family == socket.AF_INET6 else "0.0.0.0")
    server = await open_endpoint(
        local_host, local_addr[1] if local_addr else 0, config=cfg, family=family
    )
    try:
        return await server.endpoint.connect(address, owns_endpoint=True, server_key=server_key)
    except BaseException:
        server.endpoint.close_now()
        raise


def run(main: Any, *, use_uvloop: bool | None = None) -> Any:
    """Run a coroutine like ``asyncio.run``, on uvloop where installed.

    Opt out with ``use_uvloop=False`` or the environment variable ``RUDP_NO_UVLOOP=1``.
    """
    from rudp.aio.loop import new_event_loop

    with asyncio.Runner(loop_factory=lambda: new_event_loop(use_uvloop)) as runner:
        return runner.run(main)
