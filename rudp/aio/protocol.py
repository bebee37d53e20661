"""Moving an endpoint's datagrams through a ``DatagramProtocol``, where the loop has no
``add_reader``.

Windows' default event loop (the Proactor) has no ``add_reader``, so
``AioEndpoint``'s socket callback cannot be installed there.  `DatagramLink`
keeps everything else of ``AioEndpoint`` (the core, timers, one flush per loop
turn) and moves bytes through the loop's own datagram transport instead:

* reading: the transport calls ``datagram_received`` once per datagram (one per
  loop iteration on asyncio's transports, so no 256-datagram drain per wake-up);
* writing: ``transport.sendto``, which buffers when the socket would block; past
  ``SEND_BUFFER_LIMIT`` datagrams' worth of bytes buffered, datagrams are dropped
  and counted in ``stats.send_buffer_drops`` (reliable data is resent), as
  ``AioEndpoint`` does with its own buffer;
* closing: the transport closes the socket a loop turn after ``abort()``;
  `released` waits for that, so that a closed server's port is free.

The link becomes the endpoint's datagram path (``AioEndpoint.set_path``) rather
than a subclass of it: the compiled ``AioEndpoint`` is a native class, which
accepts no interpreted subclass and no patched methods.  `open_endpoint` uses it
when ``loop.add_reader`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from time import monotonic
from typing import Any, cast

from rudp.aio.endpoint import SEND_BUFFER_LIMIT, AioEndpoint, Handler
from rudp.config import Config
from rudp.connection import Address

log = logging.getLogger(__name__)


def reads_with_add_reader(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
    """Whether `loop` can watch `sock` with ``add_reader`` (not on Windows' Proactor)."""
    try:
        loop.add_reader(sock.fileno(), _ignore)
    except NotImplementedError:
        return False
    loop.remove_reader(sock.fileno())
    return True


def _ignore() -> None:
    return None


class DatagramLink(asyncio.DatagramProtocol):
    """The protocol of one endpoint's datagram transport."""

    def __init__(self, endpoint: AioEndpoint, sock: socket.socket) -> None:
        self._endpoint = endpoint
        self._sock = sock
        self._transport: asyncio.DatagramTransport | None = None
        self._lost = asyncio.Event()
        endpoint.set_path(self)

    # -- protocol callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not always a DatagramTransport subclass (asyncio's own on 3.11 is not).
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        endpoint = self._endpoint
        if endpoint.is_closed:
            return
        if endpoint._inbound is not None:
            endpoint._inbound.send(data, addr)
            return
        endpoint.receive_datagram(data, addr, monotonic())
        endpoint.after_core_call()

    def error_received(self, exc: Exception) -> None:
        # Send errors and ICMP errors queued on the socket both arrive here.
        self._endpoint.core.stats.send_errors += 1
        if getattr(exc, "errno", None) not in (
            errno.ECONNREFUSED,
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
        ):
            log.debug("socket_error error=%r", str(exc))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost.set()

    # -- what the endpoint calls -----------------------------------------------------

    def sendto(self, data: bytes, address: Address) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        limit = SEND_BUFFER_LIMIT * self._endpoint.config.max_datagram_size
        # Every loop's datagram transport has it; typeshed's DatagramTransport omits it.
        if transport.get_write_buffer_size() >= limit:  # type: ignore[attr-defined]
            self._endpoint.core.stats.send_buffer_drops += 1
            return
        transport.sendto(data, address)

    def release_socket(self) -> None:
        if self._transport is not None:
            self._transport.abort()
        else:
            self._lost.set()
        # The transport closes its socket a loop turn later; close ours now, so
        # that the port is free at once where the transport has not duplicated it.
        self._sock.close()

    async def released(self) -> None:
        """Return once the transport has let the socket go."""
        await self._lost.wait()


async def open_protocol_endpoint(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    config: Config,
    *,
    accept: bool,
    handler: Handler | None = None,
) -> tuple[AioEndpoint, DatagramLink]:
    """An endpoint on `sock` whose datagrams go through a `DatagramLink`."""
    endpoint = AioEndpoint(loop, sock, config, accept=accept, handler=handler, add_reader=False)
    link = DatagramLink(endpoint, sock)
    try:
        await loop.create_datagram_endpoint(lambda: link, sock=sock)
    except BaseException:
        endpoint.close_now()
        raise
    return endpoint, link
