"""The user-facing connection: ``send``, ``recv``, ``drain``, ``close``.

At run time the dependency between this module and ``rudp.aio.endpoint`` goes one
way: the endpoint creates connections and calls the methods grouped under "called
by the endpoint" below. A connection uses a few members of its ``AioEndpoint``
(``loop``, ``config``, ``local_address``, ``flush_pending``, ``draining``,
``wake()``, ``after_core_call()``, ``close_after_flush()``), and is typed with that
class (imported for type checking only), so that the compiled build reads and
calls them as fields and methods of a native class, not by name.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import warnings
from asyncio.events import _get_running_loop
from collections import deque
from collections.abc import Callable, Iterable
from time import monotonic
from typing import TYPE_CHECKING, Any

from rudp.config import BUFFER_ENTRY_COST
from rudp.connection import Address
from rudp.connection import Connection as CoreConnection
from rudp.errors import (
    ConnectError,
    ConnectionClosed,
    ConnectRefused,
    ConnectTimeout,
    LocalProtocolError,
)
from rudp.events import Disconnected, DisconnectReason, MessageReceived
from rudp.frames import check_close_code, check_close_text
from rudp.sending import ACKED, FAILED, SUPERSEDED, OutMessage
from rudp.stats import ConnectionStats
from rudp.tokens import PeerIdentity
from rudp.wire import UNRELIABLE_MODES, Delivery

if TYPE_CHECKING:
    from rudp.aio.endpoint import AioEndpoint

log = logging.getLogger(__name__)

Receiver = Callable[[MessageReceived], object]
"""What ``Connection.set_receiver`` takes: called with each message as it arrives."""


SendHandle = OutMessage
"""What ``send()`` returns: await it to know the peer acknowledged the message.

``.acked``, ``.superseded`` and ``.done()`` tell its state without waiting.
Awaiting is optional and costs nothing until you do it: no future is created
for a message nobody waits on. (It is the core's own message record, made
awaitable by the connection that sent it, so a send allocates one object, not two.)
"""


class Connection:
    """A reliable-UDP connection. Get one from ``rudp.connect`` or a ``serve`` handler.

    Its attributes are fixed (slots; compiled, a native class): keep the application's
    own state in ``user_data``, or in a dict keyed by the connection.
    """

    __slots__ = (
        "_closed_future",
        "_core",
        "_drain_waiter",
        "_endpoint",
        "_established_future",
        "_inbox",
        "_inbox_bytes",
        "_loop",
        "_receiver",
        "_recv_limit",
        "_recv_waiters",
        "_waiting",
        "owns_endpoint",
        "user_data",
    )

    def __init__(self, endpoint: AioEndpoint, core: CoreConnection) -> None:
        self._endpoint = endpoint
        self._core = core
        self._loop = endpoint.loop
        self._inbox: deque[MessageReceived] = deque()
        # Bytes the inbox holds, each message charged BUFFER_ENTRY_COST besides its payload:
        # past ``Config.recv_queue_bytes`` the peer is asked to pause (see ``_take``).
        self._inbox_bytes = 0
        self._recv_limit = endpoint.config.recv_queue_bytes
        # One future per task waiting in recv(): a shared one would be cancelled with
        # the first waiter cancelled (a wait_for timeout), and fail the others.
        self._recv_waiters: list[asyncio.Future[None]] = []
        self._receiver: Receiver | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._waiting: set[OutMessage] = set()
        self._established_future: asyncio.Future[None] = self._loop.create_future()
        self._closed_future: asyncio.Future[Disconnected] = self._loop.create_future()
        self.owns_endpoint = False
        self.user_data: Any = None
        """Free for the application (a player object, say); rudp never reads it."""

    # -- properties --------------------------------------------------------------

    @property
    def remote_address(self) -> Address:
        return self._core.address

    @property
    def local_address(self) -> Address:
        return self._endpoint.local_address

    @property
    def closed(self) -> bool:
        """True once the connection has ended (or is ending): ``send()`` then raises
        ``ConnectionClosed``. The peer's DISCONNECT counts from its arrival (a message
        that came with it reaches a receiver before the ``Disconnected`` event)."""
        return self._closed_future.done() or self._core.state.value in (
            "closing",
            "draining",
            "closed",
        )

    @property
    def disconnected(self) -> Disconnected | None:
        """How the connection ended (``.reason``, ``.code``, ``.text``, ``.by_peer``),
        or None while it has not: what ``wait_closed()`` returns, without waiting."""
        return self._core.close_reason

    @property
    def close_reason(self) -> Disconnected | None:
        """Deprecated: ``disconnected`` (it was never a reason, but the whole event)."""
        warnings.warn(
            "Connection.close_reason is deprecated: use Connection.disconnected "
            "(a Disconnected: .reason, .code, .text, .by_peer)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._core.close_reason

    @property
    def stats(self) -> ConnectionStats:
        return self._core.stats

    @property
    def server_authenticated(self) -> bool:
        """True when the handshake proved the server holds the key we expected
        (``server_key``, Noise NK); False under NN and on the accepting side."""
        return self._core.server_authenticated

    @property
    def packet_cipher(self) -> str:
        """The AEAD sealing this connection's packets: ``"aes-256-gcm"`` when both
        sides allow it (``Config.aes_gcm``), ``"chacha20-poly1305"`` otherwise."""
        return self._core.packet_cipher

    @property
    def peer_identity(self) -> PeerIdentity | None:
        """On a server that requires connect tokens (``Config.token_issuers``): the
        client id and user data of the token this client was admitted with, verified
        against the issuer's key. None on a server that requires none, and on clients."""
        return self._core.peer_identity

    @property
    def handshake_hash(self) -> bytes:
        """The Noise handshake hash, the same on both sides: a channel binding (for
        example to sign into an application-level login)."""
        return self._core.handshake_hash

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

    @property
    def peer_paused(self) -> bool:
        """The peer asked us to stop sending new reliable messages (its application is
        behind): they wait in the send queue, and ``drain()`` waits, until it resumes.
        ``Config.peer_pause_timeout`` ends a pause that keeps them waiting too long."""
        return self._core.peer_paused

    # -- sending -------------------------------------------------------------------

    def send(
        self,
        data: bytes | bytearray | memoryview,
        *,
        reliable: bool = True,
        channel: int = 0,
        delivery: Delivery | int | None = None,
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
        self._check_loop()
        if delivery is None and depends_on is None:
            if reliable is True:
                msg = self._core.send(data, channel=channel)
            else:  # False, or not a bool: the core refuses that with a TypeError
                msg = self._core.send(data, reliable=reliable, channel=channel, now=monotonic())
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
        if not endpoint.flush_pending:
            endpoint.wake()
        return msg

    async def wait_for_handle(self, msg: OutMessage) -> None:
        """Internal: what awaiting a handle of this connection does.

        The core's one call up into this layer (``rudp.sending.Waiter``, made by
        ``OutMessage.__await__``); applications await the handle instead.
        """
        self._check_loop()
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
        """Wait until the send queue is at or below ``Config.drain_threshold``; raises
        ``ConnectionClosed`` if the connection has ended or ends first."""
        self._check_loop()
        if self._closed_future.done():
            raise self._closed_error()
        if self._core.queued <= self._core.drain_level(self._endpoint.config.drain_threshold):
            self._core.room_found()
            return
        if self._drain_waiter is None:
            self._drain_waiter = self._loop.create_future()
            self._endpoint.draining.add(self)
        await asyncio.shield(self._drain_waiter)
        if self._closed_future.done():
            raise self._closed_error()  # ended while waiting: the queue never drained

    def check_drain(self) -> None:
        """Called by the endpoint: wake a ``drain()`` waiter once the queue is low enough."""
        waiter = self._drain_waiter
        if waiter is None:
            return
        if self._core.queued <= self._core.drain_level(self._endpoint.config.drain_threshold):
            self._core.room_found()
            self._drain_waiter = None
            self._endpoint.draining.discard(self)
            if not waiter.done():
                waiter.set_result(None)

    # -- receiving -------------------------------------------------------------------

    async def recv(self) -> MessageReceived:
        """The next message; raises ``ConnectionClosed`` once the connection has ended
        and every message received before the end was returned."""
        self._check_loop()
        while not self._inbox:
            if self._receiver is not None:
                raise self._receiver_set()
            if self._closed_future.done():
                raise self._closed_error()
            await self._message_arrival()
        return self._take()

    async def _message_arrival(self) -> None:
        waiter = self._loop.create_future()
        self._recv_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._recv_waiters:
                self._recv_waiters.remove(waiter)
            raise

    def recv_nowait(self) -> MessageReceived | None:
        """The next message if one is waiting, else None; raises ``ConnectionClosed``
        once the connection has ended and every message received before the end was
        returned (as ``recv()`` does: None would read as "nothing yet" forever)."""
        self._check_loop()
        if self._inbox:
            return self._take()
        if self._receiver is not None:
            raise self._receiver_set()
        if self._closed_future.done():
            raise self._closed_error()
        return None

    def set_receiver(self, receiver: Receiver | None) -> None:
        """Hand each message to ``receiver(message)`` as it arrives, instead of queueing
        it for ``recv()``; ``None`` goes back to queueing.

        The receiver runs inside the socket's read callback, before any task is woken:
        no task switch per message, so a reply sent from it goes out in the flush that
        follows the read (one ``call_soon`` later), in one datagram with the
        acknowledgement (the lowest-latency way to answer).
        Messages already queued are handed over at once, in order. Keep it short and
        non-blocking, as an ``asyncio.Protocol`` callback. While one is set, ``recv()``
        and ``recv_nowait()`` raise ``LocalProtocolError`` (a ``recv()`` already waiting
        too). An ``async def`` receiver is a TypeError at once (nothing would await
        what it returns). If the receiver raises, the exception is logged, the receiver
        removed and the connection closed gracefully, as when a ``serve`` handler fails.
        A ``serve`` handler that sets one must still not return before the connection
        should end (``await conn.wait_closed()``): its return closes the connection.
        """
        self._check_loop()
        if receiver is not None and not callable(receiver):
            raise TypeError(f"receiver must be callable, got {receiver!r}")
        if receiver is not None and is_coroutine_function(receiver):
            # Called, it would only make a coroutine that nobody awaits: every
            # message would be lost without a word.
            raise TypeError(
                f"set_receiver() calls receiver(message) and does not await it, and "
                f"{getattr(receiver, '__qualname__', None) or receiver!r} is an async "
                "def: define it with plain `def`, or read with `async for` / recv()"
            )
        self._receiver = receiver
        if receiver is None:
            return
        inbox = self._inbox
        while inbox and self._receiver is receiver:
            self._call_receiver(receiver, self._take())
        self._wake_receivers()

    def _take(self) -> MessageReceived:
        message = self._inbox.popleft()
        left = self._inbox_bytes - len(message.data) - BUFFER_ENTRY_COST
        self._inbox_bytes = left
        core = self._core
        if core.receiving_paused and left <= self._recv_limit >> 1:
            core.resume_receiving(monotonic())
            endpoint = self._endpoint
            if not endpoint.flush_pending:
                endpoint.wake()
        return message

    def _call_receiver(self, receiver: Receiver, message: MessageReceived) -> None:
        try:
            result: object = receiver(message)
            if result is not None and inspect.iscoroutine(result):
                # An async callable set_receiver() could not see (a lambda calling an
                # async def): its message would be lost without a word. (Other results,
                # a send()'s handle from ``lambda m: conn.send(...)``, are left alone.)
                result.close()
                raise TypeError(
                    "the receiver returned a coroutine, which set_receiver() does not "
                    "await: its message is lost; use a plain def, or read with recv()"
                )
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            # A CancelledError (a cancelled future's result()) included: raised into
            # the read callback, it would reach the loop's exception handler.
            log.exception("receiver_failed peer=%s", format_address(self.remote_address))
            if self._receiver is receiver:
                self._receiver = None
            if not self._closed_future.done():
                self._core.close(monotonic())
                self._endpoint.wake()

    def _receiver_set(self) -> LocalProtocolError:
        return LocalProtocolError("messages go to the receiver set with set_receiver()")

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> MessageReceived:
        # recv()'s loop, ending the iteration without the ConnectionClosed it would
        # build and raise through two coroutines only to be dropped here.
        self._check_loop()
        while not self._inbox:
            if self._receiver is not None:
                raise self._receiver_set()
            if self._closed_future.done():
                raise StopAsyncIteration
            await self._message_arrival()
        return self._take()

    # -- closing ------------------------------------------------------------------------

    def close(
        self, code: int = 0, text: str = "", *, reason: str | None = None
    ) -> asyncio.Future[Disconnected]:
        """Start a graceful close at once: deliver what is queued, send DISCONNECT with
        ``code`` and ``text``, wait for its ack. ``Config.close_timeout`` bounds that
        last wait only, from the DISCONNECT's first sending: the queued reliable
        messages are acknowledged first, however long that takes (but toward a peer
        that paused its receiving, where it counts from now).
        ``text`` is a str (the peer gets at most 200 bytes of it in UTF-8, clipped on a
        character boundary): anything else, or one UTF-8 cannot encode, raises at once
        (TypeError, ValueError), and the connection is left as it was.

        The closing has begun when this returns, awaited or not; awaiting the result
        waits until the connection has ended and gives its ``Disconnected`` (as
        ``wait_closed()`` does). ``reason=`` is the deprecated name of ``text``.
        """
        self._check_loop()
        if reason is not None:
            warnings.warn(
                "close(reason=...) is deprecated: the text is close(code, text=...), as "
                "Disconnected.text and ConnectionClosed.text report it",
                DeprecationWarning,
                stacklevel=2,
            )
            text = reason
        check_close_code(code)
        # Checked here as well: after the end the core is not called, and a wrong text
        # must not pass unnoticed because the connection happened to end first.
        check_close_text(text)
        if not self._closed_future.done():
            self._core.close(monotonic(), code, text)
            self._endpoint.after_core_call()
        return self.wait_closed()

    def _check_loop(self) -> None:
        """Refuse a call from another running event loop than the connection's: from
        another thread's loop, ``send()`` went through (touching the core from the
        wrong thread) and ``recv()`` failed late with asyncio's own error, leaving
        its waiter behind; from a plain thread while the loop runs, the same. With
        no loop running at all (between two ``run_until_complete`` calls of the
        connection's own loop, say), the call goes on as before."""
        running = _get_running_loop()
        if running is not self._loop and (running is not None or self._loop.is_running()):
            raise RuntimeError(
                "this connection belongs to the event loop it was opened on; call it "
                "from that loop's thread (loop.call_soon_threadsafe, "
                "asyncio.run_coroutine_threadsafe)"
            )

    def wait_closed(self) -> asyncio.Future[Disconnected]:
        """An awaitable for the connection's end, giving its ``Disconnected``.

        Cancelling a wait (``asyncio.wait_for``) leaves the connection as it is.
        """
        return asyncio.shield(self._closed_future)

    # -- called by the endpoint ---------------------------------------------------------
    # Public names so that the endpoint need not reach into privates; they are not part
    # of the documented API (docs/api.md), and an application has no reason to call them.

    def message_received(self, message: MessageReceived) -> None:
        """Called by the endpoint: a message arrived (to the receiver, or queued)."""
        receiver = self._receiver
        if receiver is not None:
            self._call_receiver(receiver, message)
            return
        self._inbox.append(message)
        queued = self._inbox_bytes + len(message.data) + BUFFER_ENTRY_COST
        self._inbox_bytes = queued
        if queued >= self._recv_limit and not self._core.receiving_paused:
            # The application is not keeping up: the peer stops sending new messages
            # until recv() has taken the queue down to half.
            self._core.pause_receiving()
            self._endpoint.wake()
        if self._recv_waiters:
            self._wake_receivers()

    def _wake_receivers(self) -> None:
        waiters, self._recv_waiters = self._recv_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def message_acked(self, msg: OutMessage) -> None:
        """Called by the endpoint: the peer acknowledged ``msg``, which has waiters."""
        self._waiting.discard(msg)
        future = msg.user
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_result(None)

    def handshake_completed(self) -> None:
        """Called by the endpoint: the handshake completed."""
        if not self._established_future.done():
            self._established_future.set_result(None)

    async def wait_established(self) -> None:
        """Used by the endpoint's ``connect()``: until the handshake completes, or raise
        what ``connect()`` raises when it does not."""
        try:
            await self._established_future
        except BaseException:
            # What is raised holds this frame, and so this connection, in its
            # traceback, and the future holds what is raised: a cycle that only the
            # cyclic collector would free. The ended attempt keeps a future without it.
            ended: asyncio.Future[None] = self._loop.create_future()
            ended.cancel()
            self._established_future = ended
            raise

    @property
    def closed_future(self) -> asyncio.Future[Disconnected]:
        """Used by the endpoint's ``close()``: done once the connection has ended."""
        return self._closed_future

    def connection_ended(self, event: Disconnected) -> None:
        """Called by the endpoint: the connection ended (``event`` says why)."""
        if not self._established_future.done():
            self._established_future.set_exception(
                connect_error(event, self.remote_address, self._endpoint.config.connect_timeout)
            )
        if self._waiting:
            error = self._closed_error(event)
            for msg in self._waiting:
                future = msg.user
                if isinstance(future, asyncio.Future) and not future.done():
                    future.set_exception(error)
                    future.exception()  # an abandoned waiter must not log "never retrieved"
            self._waiting.clear()
        if not self._closed_future.done():
            self._closed_future.set_result(event)
        self._wake_receivers()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None
        self._endpoint.draining.discard(self)
        if self.owns_endpoint:
            # After the flush that acknowledges the peer's DISCONNECT, if that is what
            # ended it; closing the socket at once would leave the peer resending it.
            self._endpoint.close_after_flush()

    def _closed_error(self, event: Disconnected | None = None) -> ConnectionClosed:
        event = event or self._core.close_reason
        if event is None:
            return ConnectionClosed("closed")
        return ConnectionClosed(event.reason.value, event.code, event.text)

    def __repr__(self) -> str:
        return f"<rudp.Connection {format_address(self.remote_address)} {self._core.state.value}>"


def connect_error(event: Disconnected, address: Address, timeout: float) -> Exception:
    """The exception ``connect()`` raises when the handshake ends without success;
    it names the server's ``address`` and, for a timeout, the ``timeout`` waited."""
    if event.reason is DisconnectReason.REFUSED:
        return ConnectRefused(event.text or "refused", (address[0], address[1]))
    if event.reason is DisconnectReason.CONNECT_TIMEOUT:
        where = (address[0], address[1])
        plain = ConnectTimeout(address=where, timeout=timeout)
        if not event.text:
            return plain
        return ConnectTimeout(f"{plain} ({event.text})", address=where, timeout=timeout)
    if not event.by_peer and event.reason in (DisconnectReason.ABORTED, DisconnectReason.CLOSED):
        return ConnectError(f"closed locally before the handshake completed ({event.reason})")
    return ConnectRefused(event.reason.value)


def is_coroutine_function(fn: object) -> bool:
    """True for what gives a coroutine when called: an ``async def`` function or
    method, an object whose ``__call__`` is one, or a ``functools.partial`` of one."""
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)


def format_address(address: Address) -> str:
    """``host:port`` (``[host]:port`` for IPv6), as log lines write addresses."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
