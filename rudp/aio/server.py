"""``serve()``, ``connect()`` and the ``Endpoint`` they share the socket code with."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import sys
from types import TracebackType
from typing import Any

from rudp.aio.connection import Connection, is_coroutine_function
from rudp.aio.endpoint import (
    AioEndpoint,
    ForeignHandler,
    Handler,
    QueryHandler,
    check_handler,
    check_query_timeout,
)
from rudp.aio.protocol import DatagramLink, open_protocol_endpoint, reads_with_add_reader
from rudp.config import Config
from rudp.connection import Address
from rudp.errors import check_address, check_port, format_address
from rudp.stats import EndpointStats


def _set_buffers(sock: socket.socket, size: int) -> None:
    if size <= 0:
        return
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        # The kernel clamps to its maximum; a smaller buffer still works.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


def _forbid_fragmentation(sock: socket.socket) -> None:
    """Set Don't Fragment on every datagram: path MTU discovery (``rudp.pmtu``) needs a
    datagram too large for the path to be lost, not cut into IP fragments; one too
    large for the interface then fails with EMSGSIZE, which the endpoint takes for a
    lost probe. Linux: IP_MTU_DISCOVER / IPV6_MTU_DISCOVER = PMTUDISC_DO; macOS and
    BSD: IP_DONTFRAG / IPV6_DONTFRAG; Windows: IP_DONTFRAGMENT. Where none exists the
    kernel may fragment, and probes only ever succeed up to the ceiling."""
    options: list[tuple[int, int, int]] = []
    v4 = sock.family == socket.AF_INET or (
        sock.family == socket.AF_INET6
        and not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    )
    if sys.platform.startswith("linux"):
        # Python names these only from 3.12 on: <linux/in.h> and <linux/in6.h> values.
        do = getattr(socket, "IP_PMTUDISC_DO", 2)
        if sock.family == socket.AF_INET6:
            options.append((socket.IPPROTO_IPV6, getattr(socket, "IPV6_MTU_DISCOVER", 23), do))
        if v4:
            options.append((socket.IPPROTO_IP, getattr(socket, "IP_MTU_DISCOVER", 10), do))
    else:
        if sock.family == socket.AF_INET6 and hasattr(socket, "IPV6_DONTFRAG"):
            options.append((socket.IPPROTO_IPV6, socket.IPV6_DONTFRAG, 1))
        if v4:
            name = getattr(socket, "IP_DONTFRAG", getattr(socket, "IP_DONTFRAGMENT", None))
            if name is not None:
                options.append((socket.IPPROTO_IP, name, 1))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


def _check_config(config: object) -> Config:
    if config is None:
        return Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a rudp.Config, not {type(config).__name__}")
    return config


def _check_keys(server_key: object, token: object, token_key: object) -> None:
    """A key or token given as a str (hex, base64) failed deep in the handshake
    ("can't concat str to bytes"): refused here, naming the argument."""
    for name, value in (("server_key", server_key), ("token", token), ("token_key", token_key)):
        if value is not None and not isinstance(value, bytes):
            raise TypeError(f"{name} must be bytes, not {type(value).__name__}")


def _check_destination_port(port: int) -> int:
    port = check_port(port)
    if port == 0:
        # Nothing listens there: the handshake would be resent until ConnectTimeout.
        raise ValueError("cannot connect to port 0")
    return port


async def _resolve(
    host: str, port: int, family: int = 0, flags: int = 0, name: str = "port"
) -> tuple[int, Address]:
    port = check_port(port, name)  # in 0..65535: getaddrinfo would take it modulo 65536
    given: object = host
    if type(given) in (ipaddress.IPv4Address, ipaddress.IPv6Address):
        host = str(given)  # not an IPv4Interface ("127.0.0.1/32"): that is no host
    if not isinstance(host, str):
        # getaddrinfo takes None as the loopback address and bytes as a name: a
        # connection would go somewhere the caller did not mean, or fail with a
        # TypeError that names no argument.
        raise TypeError(
            f"host must be a str (a name or an IP address), got {type(host).__name__}: {host!r}"
        )  # (an ipaddress address, turned into one above, is taken too)
    literal = _literal(host, port, family, flags)
    if literal is not None:
        return literal
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            host, port, family=family, type=socket.SOCK_DGRAM, flags=flags
        )
    except socket.gaierror as exc:
        raise socket.gaierror(
            exc.errno, f"cannot resolve {host!r}: {exc.strerror}{_hint(host)}"
        ) from exc
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    fam, _, _, _, sockaddr = infos[0]
    return fam, tuple(sockaddr)


def _is_own(destination: Address, local: Address) -> bool:
    """Whether ``destination`` is the address this socket is bound to (its own IP,
    or a loopback address when it is bound to every address), at its port."""
    if int(destination[1]) != int(local[1]):
        return False
    ips = []
    for raw in (destination[0], local[0]):
        ip = ipaddress.ip_address(str(raw).split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        ips.append(mapped if mapped is not None else ip)
    there, here = ips
    return there == here or (here.is_unspecified and there.is_loopback)


def _hint(host: str) -> str:
    """What a host that failed to resolve may have meant, for the error."""
    if host.startswith("[") and host.endswith("]"):
        return " (an IPv6 address goes without brackets: the port is its own argument)"
    inside, bracket, port = host.partition("]:")
    if bracket and inside.startswith("[") and port.isdigit():
        return f" (the port is its own argument: host {inside[1:]!r}, port {port})"
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        return f" (the port is its own argument: host {name!r}, port {port})"
    return ""


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
        _forbid_fragmentation(sock)
        _bind(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind(sock: socket.socket, address: Address) -> None:
    """``sock.bind(address)``; an error names the address (``[Errno 98] Address already
    in use`` alone does not say which), with the same errno and exception class."""
    try:
        sock.bind(address)
    except OSError as exc:
        if exc.errno is None:
            raise
        where = format_address((str(address[0]), int(address[1])))
        raise type(exc)(exc.errno, f"cannot bind {where}: {exc.strerror}") from exc


def _adopt_socket(sock: socket.socket, config: Config) -> None:
    if not isinstance(sock, socket.socket):
        raise TypeError(f"sock must be a socket.socket, not {type(sock).__name__}")
    if sock.type != socket.SOCK_DGRAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        raise ValueError("sock must be a UDP socket (SOCK_DGRAM, IPv4 or IPv6)")
    if sock.getsockname()[1] == 0:
        # The endpoint's address is the socket's: an unbound one would report port 0
        # (and bind to a port nobody chose at its first send).
        raise ValueError("sock must be bound: bind it before handing it over")
    sock.setblocking(False)
    _set_buffers(sock, config.socket_buffer_size)
    _forbid_fragmentation(sock)


class Endpoint:
    """One UDP socket: it connects out, and with a handler it accepts connections.

    What ``open_endpoint()`` and ``serve()`` return (``rudp.Server`` is the same
    class, the name a ``serve()`` caller may prefer). An async context manager:
    leaving the block closes every connection gracefully.
    """

    def __init__(self, endpoint: AioEndpoint, link: DatagramLink | None = None) -> None:
        self._endpoint = endpoint
        self._link = link
        self._closing: asyncio.Task[None] | None = None

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
        if handler is not None and not callable(handler):
            raise TypeError(f"on_query must be callable or None, got {handler!r}")
        if handler is not None and is_coroutine_function(handler):
            raise TypeError(
                "on_query is called, not awaited: an async def would answer nothing "
                "(return the reply from a plain def)"
            )
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
        if type(first_byte) is not int and (
            not isinstance(first_byte, int) or isinstance(first_byte, bool)
        ):
            raise TypeError(f"first_byte must be an int, not {type(first_byte).__name__}")
        self._endpoint.set_datagram_handler(first_byte, handler)

    def send_datagram(self, data: bytes | bytearray | memoryview, address: Address) -> None:
        """Send one datagram of another protocol from this socket (never rudp's:
        its first byte is checked). Nothing is sent once the socket is closed."""
        self._endpoint.send_datagram(data, address)

    async def connect(
        self,
        host: str,
        port: int,
        *,
        server_key: bytes | None = None,
        token: bytes | None = None,
        token_key: bytes | None = None,
    ) -> Connection:
        """Open an outgoing connection from this server's socket (NAT traversal).

        ``server_key`` (default ``Config.server_key``): the peer's public key to expect;
        ``token`` and ``token_key``: a connect token, as for ``rudp.connect``.
        """
        _check_keys(server_key, token, token_key)
        port = _check_destination_port(port)
        _, address = await _resolve(host, port, *self._endpoint.destination_family())
        if _is_own(address, self._endpoint.local_address):
            # Its CONNECTs would come back to itself, unanswered: a ConnectTimeout
            # saying "no answer" after connect_timeout.
            where = format_address((str(address[0]), int(address[1])))
            raise ValueError(f"cannot connect to {where}: it is this endpoint's own address")
        return await self._endpoint.connect(
            address, server_key=server_key, token=token, token_key=token_key
        )

    async def query(
        self,
        address: tuple[str, int],
        payload: bytes | bytearray | memoryview,
        timeout: float = 1.0,
    ) -> tuple[bytes, float]:
        """Send an unconnected query; returns (reply, round-trip seconds).

        ``timeout`` is a finite positive number of seconds (else ValueError at once).
        """
        seconds = check_query_timeout(timeout)
        check_address(address, "query() address")
        family, flags = self._endpoint.destination_family()
        _, resolved = await _resolve(address[0], address[1], family, flags, "query() address port")
        return await self._endpoint.query(resolved, payload, seconds)

    def close(self) -> asyncio.Future[None]:
        """Close every connection gracefully, then the socket.

        The closing starts at once, awaited or not (a task of its own, started by the
        first call); await the result to wait until it is done. Each call gives its own
        awaitable of that one closing: cancelling a wait (``asyncio.wait_for`` timing
        out) leaves the closing going for everyone else. Bounded: connections and
        handlers get ``Config.close_timeout`` plus a second; handlers still running
        then are cancelled (and get a second for their cleanup). Handlers may call it:
        a task that does is neither waited for nor cancelled by it, even one that goes
        on running without awaiting it.
        """
        caller = asyncio.current_task()
        if caller is not None:
            self._endpoint.exclude_from_close(caller)
        if self._closing is None:
            self._endpoint.refuse_new()  # at once: the task below starts a turn later
            self._closing = asyncio.get_running_loop().create_task(self._close(caller))
        return asyncio.shield(self._closing)

    async def _close(self, caller: asyncio.Task[Any] | None) -> None:
        await self._endpoint.close(exclude=caller)
        if self._link is not None:
            await self._link.released()

    async def wait_closed(self) -> None:
        await self._endpoint.wait_closed()
        if self._link is not None:
            await self._link.released()

    def __repr__(self) -> str:
        endpoint = self._endpoint
        if endpoint.is_closed:
            state = "closed"
        elif endpoint.accepting:
            state = f"accepting, {len(endpoint.connections())} connections"
        else:
            state = "connecting out"
        return f"<rudp.Endpoint {format_address(self.address)} {state}>"

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


Server = Endpoint
"""The same class as ``Endpoint``: what ``serve()`` returns reads as a server."""


async def open_endpoint(
    host: str | None = None,
    port: int = 0,
    *,
    handler: Handler | None = None,
    config: Config | None = None,
    family: int = 0,
    sock: socket.socket | None = None,
) -> Endpoint:
    """Bind a UDP socket; with ``handler`` it accepts connections, else it only connects out.

    ``handler`` must be an ``async def`` (``await handler(conn)`` runs per connection;
    a plain ``def`` is a TypeError at once). Its connection is closed when it returns.
    ``sock``: a UDP socket the caller has bound (one of an ``SO_REUSEPORT`` group, or
    one inherited from a parent process) to use instead of binding ``host:port``;
    the endpoint owns it from then on and closes it.
    """
    if handler is not None:
        check_handler(handler)
    loop = asyncio.get_running_loop()
    cfg = _check_config(config)
    if sock is None:
        sock = await _open_socket(host, port, family, cfg)
    else:
        _adopt_socket(sock, cfg)
    accept = handler is not None
    try:
        if reads_with_add_reader(loop, sock):
            return Endpoint(AioEndpoint(loop, sock, cfg, accept=accept, handler=handler))
        # Windows' Proactor loop
        endpoint, link = await open_protocol_endpoint(
            loop, sock, cfg, accept=accept, handler=handler
        )
    except BaseException:
        sock.close()
        raise
    return Endpoint(endpoint, link)


async def serve(
    handler: Handler,
    host: str | None,
    port: int,
    *,
    config: Config | None = None,
    sock: socket.socket | None = None,
) -> Endpoint:
    """Accept rudp connections on ``host:port``; run ``await handler(conn)`` for each.

    The connection lives as long as its handler: when the handler returns (or
    raises), its connection is closed gracefully, and the peer sees the text
    "server handler returned" (or "server handler failed"). A handler that hands
    the connection to a task of its own must wait for it (``await conn.wait_closed()``).
    A plain ``def`` handler is a TypeError at once. ``sock``: as for ``open_endpoint``.
    """
    return await open_endpoint(host, port, handler=handler, config=config, sock=sock)


async def connect(
    host: str,
    port: int,
    *,
    config: Config | None = None,
    local_addr: tuple[str, int] | None = None,
    server_key: bytes | None = None,
    token: bytes | None = None,
    token_key: bytes | None = None,
) -> Connection:
    """Connect to a rudp server. Raises ``ConnectRefused`` or ``ConnectTimeout``.

    ``server_key`` (default ``Config.server_key``) is the server's public key: the
    handshake then proves the server holds its private half (Noise NK), and
    ``conn.server_authenticated`` is True. Without it the connection is sealed all
    the same, but the server is not authenticated (Noise NN).

    ``token`` is a connect token (``rudp.tokens``) for a server that requires one,
    and ``token_key`` the private X25519 key it was issued for (its public half is
    the token's client key): the handshake uses it as this side's ephemeral key,
    which binds the token to this handshake. A server that requires a token refuses
    a client without one, or with one it does not accept, with ``ConnectRefused``
    naming why.
    """
    if local_addr is not None:
        check_address(local_addr, "local_addr")
        check_port(local_addr[1], "local_addr port")
    cfg = _check_config(config)
    _check_keys(server_key, token, token_key)
    port = _check_destination_port(port)
    family, address = await _resolve(host, port)
    local_host = local_addr[0] if local_addr else ("::" if family == socket.AF_INET6 else "0.0.0.0")
    server = await open_endpoint(
        local_host, local_addr[1] if local_addr else 0, config=cfg, family=family
    )
    try:
        return await server.endpoint.connect(
            address, owns_endpoint=True, server_key=server_key, token=token, token_key=token_key
        )
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
