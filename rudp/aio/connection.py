"""The user-facing connection: ``send``, ``recv``, ``drain``, ``close``."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from time import monotonic
from typing import TYPE_CHECKING

from rudp.connection import Address
from rudp.connection import Connection as CoreConnection
from rudp.errors import ConnectionClosed
from rudp.events import Disconnected, MessageReceived
from rudp.recovery import ACKED, FAILED, SUPERSEDED, UNRELIABLE_MODES, OutMessage
from rudp.stats import ConnectionStats
from rudp.wire import Delivery

if TYPE_CHECKING:
    from rudp.aio.endpoint import AioEndpoint

Message = MessageReceived
"""A received message: ``.data`` (bytes), ``.channel`` (int), ``.reliable`` (bool)."""


SendHandle = OutMessage
"""What ``send()`` returns: await it to know the peer acknowledged the message.

``.acked``, ``.superseded`` and ``.done()`` tell its state without waiting.
Awaiting is optional and costs nothing until you do it: no future is created
for a message nobody waits on. (It is the core's own message record, made
awaitable by the connection that sent it, so a send allocates one object, not two.)
"""


class Connection:
    """A reliable-UDP connection. Get one from ``rudp.connect`` or a ``serve`` handler."""

    def __init__(self, endpoint: AioEndpoint, core: CoreConnection) -> None:
        self._endpoint = endpoint
        self._core = core
        self._loop = endpoint._loop
        self._inbox: deque[MessageReceived] = deque()
        self._recv_waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._waiting: set[OutMessage] = set()
        self._established_future: asyncio.Future[None] = self._loop.create_future()
        self._closed_future: asyncio.Future[Disconnected] = self._loop.create_future()
        self.owns_endpoint = False

    # -- properties --------------------------------------------------------------

    @property
    def remote_address(self) -> Address:
        return self._core.address

    @property
    def local_address(self) -> Address:
        return self._endpoint.local_address

    @property
    def closed(self) -> bool:
        """True once the connection has ended (or is ending) on our side."""
        return self._closed_future.done() or self._core.state.value in ("closing", "closed")

    @property
    def close_reason(self) -> Disconnected | None:
        return self._core.close_reason

    @property
    def stats(self) -> ConnectionStats:
        return self._core.stats

    @property
    def max_message_size(self) -> int:
        """The largest reliable message (``Config.max_message_size``); larger than a
        datagram, it is fragmented."""
        return self._core.max_message_size

    @property
    def max_datagram_payload(self) -> int:
        """The largest message sent in one datagram (and so the largest unreliable one)."""
        return self._core.max_datagram_payload

    @property
    def queued(self) -> int:
        return self._core.queued

    # -- sending -------------------------------------------------------------------

    def send(
        self,
        data: bytes,
        *,
        reliable: bool = True,
        channel: int = 0,
        delivery: Delivery | None = None,
        depends_on: Iterable[SendHandle] | None = None,
    ) -> SendHandle:
        """Queue a message. Never blocks; raises ``SendQueueFull`` when the queue is full,
        ``ConnectionClosed`` after the end. Await the result to know it was acknowledged.

        ``delivery`` picks a ``rudp.Delivery`` mode (default: reliable-ordered, or
        unreliable with ``reliable=False``). ``depends_on`` lists handles returned by
        earlier ``send()`` calls of ``RELIABLE_UNORDERED`` or ``DEPENDENCY_ORDERED``
        messages: the peer delivers this message only after all of them, and
        otherwise as soon as it arrives (it implies ``DEPENDENCY_ORDERED``).
        """
        if delivery is None and depends_on is None:
            if reliable:
                msg = self._core.send(data, channel=channel)
            else:
                msg = self._core.send(data, reliable=False, channel=channel, now=monotonic())
        else:
            msg = self._core.send(
                data,
                reliable=reliable,
                channel=channel,
                delivery=delivery,
                depends_on=depends_on,
                now=monotonic(),
            )
        msg.waiter = self
        endpoint = self._endpoint
        if not endpoint._flush_pending:
            endpoint.wake()
        return msg

    async def _wait_for(self, msg: OutMessage) -> None:
        """What awaiting a handle of this connection does (see ``OutMessage.__await__``)."""
        if msg.mode in UNRELIABLE_MODES:  # nothing will acknowledge it
            return
        if msg.state == ACKED or msg.state == SUPERSEDED:
            return
        if msg.state == FAILED:
            raise self._closed_error()
        future = msg.user
        if future is None:
            future = self._loop.create_future()
            msg.user = future
            msg.notify = True
            self._waiting.add(msg)
        await asyncio.shield(future)  # type: ignore[arg-type]

    async def drain(self) -> None:
        """Wait until the send queue is at or below ``Config.drain_threshold``."""
        if self._closed_future.done():
            raise self._closed_error()
        if self._core.queued <= self._endpoint.config.drain_threshold:
            return
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()
            self._endpoint.draining.add(self)
        await asyncio.shield(self._drain_waiter)

    def _check_drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None and self._core.queued <= self._endpoint.config.drain_threshold:
            self._drain_waiter = None
            self._endpoint.draining.discard(self)
            if not waiter.done():
                waiter.set_result(None)

    # -- receiving -------------------------------------------------------------------

    async def recv(self) -> MessageReceived:
        """The next message; raises ``ConnectionClosed`` once the connection has ended
        and every message received before the end was returned."""
        while not self._inbox:
            if self._closed_future.done():
                raise self._closed_error()
            waiter = self._recv_waiter
            if waiter is None or waiter.done():  # done: a cancelled recv() left it
                waiter = self._recv_waiter = self._loop.create_future()
            await waiter
        return self._inbox.popleft()

    def recv_nowait(self) -> MessageReceived | None:
        """The next message if one is waiting, else None."""
        return self._inbox.popleft() if self._inbox else None

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> MessageReceived:
        try:
            return await self.recv()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    # -- closing ------------------------------------------------------------------------

    async def close(self, code: int = 0, reason: str = "") -> None:
        """Deliver what is queued, send DISCONNECT, wait for its ack (bounded)."""
        if not self._closed_future.done():
            self._core.close(monotonic(), code, reason)
            self._endpoint._after_io()
        await self.wait_closed()

    async def wait_closed(self) -> Disconnected:
        return await asyncio.shield(self._closed_future)

    # -- called by the endpoint ---------------------------------------------------------

    def _deliver(self, message: MessageReceived) -> None:
        self._inbox.append(message)
        waiter = self._recv_waiter
        if waiter is not None:
            self._recv_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _acked(self, msg: OutMessage) -> None:
        self._waiting.discard(msg)
        future = msg.user
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_result(None)

    def _established(self) -> None:
        if not self._established_future.done():
            self._established_future.set_result(None)

    async def _wait_established(self) -> None:
        await self._established_future

    def _ended(self, event: Disconnected) -> None:
        from rudp.aio.endpoint import connect_error

        if not self._established_future.done():
            self._established_future.set_exception(connect_error(event))
        error = self._closed_error(event)
        for msg in self._waiting:
            future = msg.user
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_exception(error)
                future.exception()  # an abandoned waiter must not log "never retrieved"
        self._waiting.clear()
        for waiter in (self._recv_waiter, self._drain_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._recv_waiter = self._drain_waiter = None
        self._endpoint.draining.discard(self)
        if not self._closed_future.done():
            self._closed_future.set_result(event)
        if self.owns_endpoint:
            self._loop.call_soon(self._endpoint.close_now)

    def _closed_error(self, event: Disconnected | None = None) -> ConnectionClosed:
        event = event or self._core.close_reason
        if event is None:
            return ConnectionClosed("closed")
        return ConnectionClosed(event.reason.value, event.code, event.text)

    def __repr__(self) -> str:
        return f"<rudp.Connection {self.remote_address!r} {self._core.state.value}>"
