"""The asyncio adapter: moves bytes and time between a UDP socket and the core.

It stays thin, as aioquic's does: one socket read callback that drains the
socket (up to ``Config.max_datagrams_per_read`` datagrams per readiness, since
CPython's own datagram transport reads one per loop iteration and a burst then
overflows the kernel buffer), one ``TimerHandle`` re-armed only when the core's
deadline moves earlier, and one flush per event-loop turn, scheduled with
``call_soon`` whenever something is queued, so everything sent during a turn
(messages, acks, keepalives) is coalesced into as few datagrams as possible.

Another protocol may share the socket (``on_foreign``): a datagram starting with
``FF FF FF FF`` (Valve's A2S queries, Quake's out-of-band packets) then goes to
that handler before any rudp decoding. Other first bytes that no rudp datagram
starts with can be handed elsewhere the same way (``set_datagram_handler``; the
matchmaker's heartbeats use ``0xB1``-``0xB6``). Without such a handler, the read
loop's only cost for the hook is one test of an empty dictionary per datagram;
compiled, the datagram then goes to the core by a direct call.

Where the C extension ``rudp._batch`` is present (Linux, built with
``RUDP_COMPILE``; ``rudp.native`` says so), the socket is read with ``recvmmsg``
(up to 64 datagrams per system call) and everything a flush sends leaves with
``sendmmsg`` (a game server's 256 snapshots of a tick: 4 system calls instead of
256). Errors are handled as the per-datagram path handles ``sendto``'s: a
datagram that would block is buffered with everything after it, one refused
(EMSGSIZE, ECONNREFUSED, ...) is counted and the rest of the batch still leaves.
``RUDP_NO_NATIVE=1`` in the environment keeps the per-datagram path.

On an event loop without ``add_reader`` (Windows' Proactor), ``rudp.aio.protocol``
reads and writes for this class through a ``DatagramProtocol`` instead.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import functools
import importlib
import inspect
import logging
import math
import numbers
import os
import random
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from time import monotonic, time
from typing import Any, Protocol

from mypy_extensions import mypyc_attr

from rudp.aio.connection import Connection, format_address, is_coroutine_function
from rudp.config import Config
from rudp.connection import Address
from rudp.connection import Connection as CoreConnection
from rudp.drops import DropReason
from rudp.endpoint import Endpoint as CoreEndpoint
from rudp.errors import (
    ConnectError,
    ConnectionClosed,
    EndpointClosed,
    LocalProtocolError,
    RudpError,
    as_bytes,
)
from rudp.events import (
    Connected,
    Disconnected,
    MessageAcked,
    MessageReceived,
    PathChanged,
    QueryAnswered,
    QueryReceived,
)

_ioctl: Callable[[int, int, array.array[int]], object] | None
try:
    import fcntl
    import termios

    _ioctl = fcntl.ioctl
    _FIONREAD = termios.FIONREAD
except ImportError:  # (Windows: no ioctl; the read loop drains as before)
    _ioctl = None
    _FIONREAD = 0


def _load_batch() -> Any:
    """``rudp._batch``, or None: a pure install, not Linux, or ``RUDP_NO_NATIVE=1``."""
    if os.environ.get("RUDP_NO_NATIVE", "").strip() not in ("", "0"):
        return None
    try:
        return importlib.import_module("rudp._batch")
    except ImportError:
        return None


_batch: Any = _load_batch()
_BATCH_SIZE = 64 if _batch is None else int(_batch.BATCH)
_WOULD_BLOCK = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)

log = logging.getLogger(__name__)

Handler = Callable[[Connection], Awaitable[None]]
QueryHandler = Callable[[bytes, Address], "bytes | bytearray | memoryview | None"]
ForeignHandler = Callable[[bytes, Address], "Sequence[bytes]"]
"""``fn(datagram, addr) -> replies``: each reply is sent to ``addr`` as one datagram."""
FOREIGN_PREFIX = b"\xff\xff\xff\xff"
"""What starts a datagram of another protocol sharing the socket (A2S, Quake)."""
RUDP_FIRST_BYTES = range(0xA0, 0xB0)
"""First bytes reserved for rudp's own datagrams (``0xA0 | type``)."""
SEND_BUFFER_LIMIT = 8192  # datagrams held while the socket would block
# The close text of a connection its serve handler ended (what the peer's
# ConnectionClosed and Disconnected say): returned, raised, or was no coroutine.
HANDLER_RETURNED = "server handler returned"
HANDLER_FAILED = "server handler failed"
HANDLER_NOT_AWAITABLE = "server handler is not a coroutine function"
HANDLER_CANCELLED = "server handler cancelled"


def check_handler(handler: object) -> None:
    """Refuse at ``serve()`` time a handler that cannot be awaited.

    A plain ``def`` (or a method, or an object whose ``__call__`` is one) is a
    TypeError at once instead of a failure on every connection. A lambda is let
    through: it may return a coroutine (``lambda conn: play(world, conn)``), and
    what it returns is checked on the first connection (``handler_not_awaitable``).
    """
    if not callable(handler):
        raise TypeError(f"serve() takes an async def handler, got {handler!r}")
    target = handler if inspect.isroutine(handler) else type(handler).__call__
    if is_coroutine_function(handler):
        return
    if isinstance(handler, functools.partial):
        check_handler(handler.func)
        return
    if getattr(target, "__name__", "") == "<lambda>":
        return
    name = getattr(handler, "__qualname__", None) or repr(handler)
    raise TypeError(
        f"serve() runs `await handler(conn)` for each connection, and {name} is a plain "
        "function: define it with `async def`"
    )


def check_query_timeout(timeout: object) -> float:
    """A query timeout in seconds, as a float; refused if it is not a finite positive
    real number: -1, 0 or NaN gave a bare TimeoutError, None a query waiting forever."""
    if timeout is None:
        raise ValueError(
            "query() needs a timeout in seconds (None is not 'no timeout': an unanswered "
            "query would wait forever)"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"query() timeout must be a number of seconds, not {timeout!r}")
    seconds = float(timeout)
    if not 0 < seconds < math.inf:
        raise ValueError(f"query() timeout must be finite and positive, got {timeout!r}")
    return seconds


class DatagramPath(Protocol):
    """Where an endpoint's datagrams go instead of its socket (``AioEndpoint.set_path``):
    ``rudp.aio.protocol``'s datagram transport, on loops without ``add_reader``."""

    def sendto(self, data: bytes, address: Address) -> None:
        """Send one datagram (what the endpoint's own ``sendto`` would)."""

    def release_socket(self) -> None:
        """Let the socket go (the endpoint is closing)."""


@mypyc_attr(native_class=False)
class MetricsHandle:
    """What ``rudp.metrics.RudpCollector`` holds of an asyncio endpoint, weakly.

    Compiled, ``AioEndpoint`` is a native class, which cannot be weakly referenced;
    this small ordinary object can. It holds the core endpoint (whose counters the
    collector reads at scrape time), never the asyncio endpoint, and only that
    endpoint holds it: it goes, and leaves every collector, with the endpoint.
    """

    def __init__(self, core: CoreEndpoint) -> None:
        self.core = core


class AioEndpoint:
    """One UDP socket, its core ``Endpoint`` and the user-facing connections.

    Its connections use ``loop``, ``config``, ``local_address``, ``flush_pending``,
    ``draining``, ``wake()``, ``after_core_call()`` and ``close_after_flush()``.

    The core's clock is ``time.monotonic()``, not ``loop.time()``: uvloop's
    loop time has millisecond resolution, too coarse for loopback RTTs. Both
    read CLOCK_MONOTONIC, so deadlines handed to ``call_at`` still line up.

    Compiled (``RUDP_COMPILE=1``), it is a native class: what the read, flush and
    timer callbacks and its connections read and write of it are struct fields, not
    dictionary lookups. Such a class cannot be weakly referenced, monkeypatched or
    subclassed by interpreted code: ``RudpCollector`` holds its `MetricsHandle`
    instead, and ``rudp.aio.protocol`` moves its datagrams through `set_path`.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        config: Config,
        *,
        accept: bool,
        handler: Handler | None = None,
        add_reader: bool = True,
    ) -> None:
        # add_reader=False: the caller moves datagrams in and out instead (see
        # rudp.aio.protocol, for loops without add_reader).
        self.loop = loop
        self._sock = sock
        self.config = config
        self.core = CoreEndpoint(config, now=monotonic(), rng=random.SystemRandom(), accept=accept)
        # Connect tokens expire in UNIX time; the core's clock is the monotonic one.
        # Read per token checked, so an NTP step counts at once.
        self.core.wall_clock = time
        self.metrics_handle = MetricsHandle(self.core)
        self._handler = handler
        self.on_query: QueryHandler | None = None
        # Handlers of other protocols by first byte (0xFF: FF FF FF FF), see
        # set_foreign_handler() and set_datagram_handler().
        self._foreign: dict[int, ForeignHandler] = {}
        self.foreign_errors = 0  # foreign handlers that raised
        self.query_errors = 0  # on_query handlers that raised
        self._conns: dict[CoreConnection, Connection] = {}
        # Connections with a drain() waiter, re-checked after each flush.
        self.draining: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Tasks the close does not wait for, those waiting for the close itself
        # (exclude_from_close), and what wakes a close waiting for handlers when one
        # more is named.
        self._close_excluded: set[asyncio.Task[Any]] = set()
        self._exclusion_added: asyncio.Future[None] | None = None
        self._queries: dict[int, asyncio.Future[tuple[bytes, float]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        # A flush is scheduled for the end of this loop turn, so wake() would do
        # nothing: read before calling wake() on the per-message path, to save the call.
        self.flush_pending = False
        # Inside the read callback: what its message callbacks queue leaves at its end.
        self._reading = False
        self._queued_in_read = False
        # Config.read_interval: after a read the socket is not watched until
        # ``_resume_reading`` (``_read_pause`` is its timer).
        self._read_interval = config.read_interval
        self._read_pause: asyncio.TimerHandle | None = None
        self._close_after_flush = False
        # Inside _dispatch_events: what a callback it runs causes (a receiver calling
        # close()) is left to its loop, so that no callback is re-entered.
        self._dispatching = False
        self._send_buffer: deque[tuple[bytes, Address]] = deque()
        # Where datagrams go instead of the socket (set_path), None: the socket.
        self._path: DatagramPath | None = None
        self._closed = False
        # Set when close() (or close_now()) begins: connect() and query() are refused.
        self._closing = False
        # Set by close() itself: a second call waits for the first one's end.
        self._close_begun = False
        self._closed_event = asyncio.Event()
        self._max_read = config.max_datagrams_per_read
        # How many bytes wait on the socket, asked after the first datagram of a read:
        # a refused recvfrom ends the drain too, but it raises, and building that
        # exception costs more than the ioctl (both are one system call).
        self._pending = array.array("i", [0])
        self._probe = _ioctl is not None and sock.type == socket.SOCK_DGRAM
        # recvmmsg / sendmmsg (rudp._batch) on a UDP socket this class reads itself.
        self._batch: Any = (
            _batch
            if add_reader
            and sock.type == socket.SOCK_DGRAM
            and sock.family in (socket.AF_INET, socket.AF_INET6)
            else None
        )
        self._fd = sock.fileno()
        self._family = int(sock.family)
        # rudp._batch's address conversions, both ways (see rudp/_batch.c).
        self._addresses: dict[object, object] = {}
        self._inbound: Any = None
        self._outbound: Any = None
        self._setup_netsim()
        self.local_address: Address = sock.getsockname()
        if add_reader:
            loop.add_reader(sock.fileno(), self._read_ready)

    # -- I/O ------------------------------------------------------------------

    def _setup_netsim(self) -> None:
        sim = self.config.netsim
        if sim is None:
            return
        from rudp.netsim.aio import ConditionedPipe

        if sim.inbound is not None:
            self._inbound = ConditionedPipe(
                self.loop, sim.inbound, self._receive_one, seed=sim.seed
            )
        if sim.outbound is not None:
            self._outbound = ConditionedPipe(
                self.loop, sim.outbound, self._sendto, seed=sim.seed + 1
            )

    def _read_ready(self) -> None:
        drained = self._read_batches() if self._batch is not None else self._read_each()
        if self._read_interval > 0.0 and drained and not self._closed and self._read_pause is None:
            # (A read cut short by max_datagrams_per_read goes on at the next loop
            # turn: pausing then would cap the rate at that many per interval.)
            self.loop.remove_reader(self._fd)
            self._read_pause = self.loop.call_later(self._read_interval, self._resume_reading)
        self._reading = True
        try:
            self._dispatch_events()
        finally:
            self._reading = False
            if self._queued_in_read:
                # A receiver answered from inside this callback (``set_receiver``):
                # the answer leaves now, with the acknowledgment, instead of a loop
                # turn later.
                self._queued_in_read = False
                self._flush()
            else:
                self._schedule_flush()

    def _read_each(self) -> bool:
        """One ``recvfrom`` per datagram (no ``rudp._batch``). False when the read
        stopped at ``max_datagrams_per_read`` rather than on an empty socket."""
        sock = self._sock
        core = self.core
        foreign = self._foreign
        inbound = self._inbound
        now = monotonic()
        first = self._probe
        for _ in range(self._max_read):
            try:
                data, address = sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # e.g. an ICMP error queued on the socket
                log.debug("recv_error error=%r", str(exc))
                return True
            if inbound is not None:
                inbound.send(data, address)
            else:
                try:
                    if foreign:
                        self._receive_checked(data, address, now)
                    else:
                        core.receive_datagram(data, address, now)
                except Exception:
                    self._core_failed(address)
            if first:
                # One datagram per wake-up is the common case (a round trip, a game
                # tick): stop when nothing else waits. The loop polls the socket
                # level-triggered, so one arriving meanwhile calls us again.
                first = False
                if not self._more_waiting():
                    return True
        return False

    def _read_batches(self) -> bool:
        """``recvmmsg``: up to ``rudp._batch.BATCH`` datagrams per system call. A call that
        returns fewer than it asked for found the socket empty, so no probe is needed.
        False when the read stopped at ``max_datagrams_per_read``."""
        recv_many = self._batch.recv_many
        core = self.core
        # (A handler may set or clear a foreign handler in mid-batch: the dictionary
        # itself is tested, per datagram.)
        foreign = self._foreign
        inbound = self._inbound
        fd = self._fd
        cache = self._addresses
        now = monotonic()
        left = self._max_read
        while left > 0:
            want = min(left, _BATCH_SIZE)
            try:
                got = recv_many(fd, want, cache)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as exc:  # e.g. an ICMP error queued on the socket
                log.debug("recv_error error=%r", str(exc))
                return True
            # A handler may close the endpoint in the middle of a batch: the rest of
            # the batch is dropped with it, and its descriptor is not read again.
            if inbound is not None:
                for data, address in got:
                    if self._closed:
                        return True
                    inbound.send(data, address)
            else:
                for data, address in got:
                    if self._closed:
                        return True
                    try:
                        if foreign:
                            self._receive_checked(data, address, now)
                        else:
                            core.receive_datagram(data, address, now)
                    except Exception:
                        self._core_failed(address)
            if len(got) < want:
                return True
            left -= want
        return False

    def _resume_reading(self) -> None:
        """Watch the socket again (``Config.read_interval``): what arrived meanwhile
        is read on this loop turn, the socket being ready already."""
        self._read_pause = None
        if not self._closed:
            self.loop.add_reader(self._fd, self._read_ready)

    def _more_waiting(self) -> bool:
        """Whether a datagram waits on the socket (FIONREAD: the size of the next
        one, 0 when none; an empty datagram is read on the next wake-up)."""
        assert _ioctl is not None
        try:
            _ioctl(self._sock.fileno(), _FIONREAD, self._pending)
        except OSError:
            return True  # let recvfrom tell
        return self._pending[0] > 0

    def _receive_one(self, data: bytes, address: Address) -> None:
        """Deliver one datagram released by the inbound link conditioner."""
        if not self._closed:
            self.receive_datagram(data, address, monotonic())
            self.after_core_call()

    @property
    def on_foreign(self) -> ForeignHandler | None:
        return self._foreign.get(0xFF)

    def set_foreign_handler(self, handler: ForeignHandler | None) -> None:
        """Send datagrams starting with ``FF FF FF FF`` to `handler` (None: to rudp)."""
        # A method, not a property setter: mypyc compiles no setters in this class.
        self.set_datagram_handler(0xFF, handler)

    def set_datagram_handler(self, first_byte: int, handler: ForeignHandler | None) -> None:
        """Send datagrams starting with `first_byte` to `handler` (None: to rudp).

        ``0xFF`` means ``FF FF FF FF`` (see `set_foreign_handler`); rudp's own
        first bytes (``0xA0``-``0xAF``) cannot be taken.
        """
        if not 0 <= first_byte <= 0xFF or first_byte in RUDP_FIRST_BYTES:
            raise LocalProtocolError(f"first byte {first_byte:#x} is not free for another protocol")
        if handler is not None and not callable(handler):
            raise TypeError(f"a datagram handler must be callable or None, got {handler!r}")
        if handler is not None and is_coroutine_function(handler):
            raise TypeError(
                "a datagram handler is called, not awaited: an async def would answer "
                "nothing (return the replies from a plain def)"
            )
        if handler is None:
            self._foreign.pop(first_byte, None)
        else:
            self._foreign[first_byte] = handler

    def receive_datagram(self, data: bytes, address: Address, now: float) -> None:
        """One datagram read: to the handler of its first byte if another protocol has
        one (see `set_datagram_handler`), else to the core."""
        try:
            if self._foreign:
                self._receive_checked(data, address, now)
            else:
                self.core.receive_datagram(data, address, now)
        except Exception:
            self._core_failed(address)

    def _core_failed(self, address: Address) -> None:
        """The core raised on a datagram: a bug in rudp, since it drops and counts
        whatever a peer sends. The datagram is counted as ``internal_error`` and the
        read goes on with the rest of its batch; the traceback is logged for the 1st,
        2nd, 4th, 8th... such datagram, so that a peer repeating it cannot flood the
        log."""
        dropped = self.core.stats.dropped
        dropped[DropReason.INTERNAL_ERROR] += 1
        count = dropped[DropReason.INTERNAL_ERROR]
        if count & (count - 1) == 0:
            log.exception(
                "internal_error peer=%s count=%d",
                format_address(address),
                count,
            )

    def send_datagram(self, data: bytes | bytearray | memoryview, address: Address) -> None:
        """Send one datagram of another protocol sharing the socket (not rudp).

        Its first byte must not be one of rudp's (the peer's rudp would read it).
        The caller bounds what it sends to unvalidated addresses.
        """
        data = as_bytes(data, "a foreign datagram")  # its first byte, not its first item
        if not data or data[0] in RUDP_FIRST_BYTES:
            raise LocalProtocolError("a foreign datagram must not start with a rudp byte")
        if self._closed:
            return
        send = self._outbound.send if self._outbound is not None else self._sendto
        send(data, address)

    def _receive_checked(self, data: bytes, address: Address, now: float) -> None:
        # Checked before any rudp decoding: a version-1 rudp packet starts with its
        # CRC-32, which is FF FF FF FF once in 2**32; a version-2 one never starts
        # with a byte outside 0xA1-0xA8.
        handler = self._foreign.get(data[0]) if data else None
        if handler is not None and (data[0] != 0xFF or data[:4] == FOREIGN_PREFIX):
            self._foreign_datagram(handler, data, address)
        else:
            self.core.receive_datagram(data, address, now)

    def _foreign_datagram(self, handler: ForeignHandler, data: bytes, address: Address) -> None:
        # Whatever the handler does wrong (raises, even a CancelledError, returns
        # something that is not a sequence of bytes) stays here: it is the user's
        # code, called from a read that still has other datagrams to give the core.
        try:
            replies = list(handler(data, address))
            for reply in replies:
                if not isinstance(reply, bytes | bytearray | memoryview):
                    raise TypeError(f"a reply must be bytes, got {type(reply).__name__}")
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self.foreign_errors += 1
            count = self.foreign_errors
            if count & (count - 1) == 0:
                # Logged the 1st, 2nd, 4th, 8th... time: a sender that makes the
                # handler fail on every datagram cannot fill the log with tracebacks.
                log.exception(
                    "foreign_handler_failed peer=%s count=%d", format_address(address), count
                )
            return
        send = self._outbound.send if self._outbound is not None else self._sendto
        for reply in replies:
            send(reply, address)

    def after_core_call(self) -> None:
        """Dispatch the core's events and schedule a flush: after every call into the
        core (a read, a timer, or a connection's ``close()``)."""
        # The flush this schedules (or one already pending) re-arms the timer after it
        # has sent; a closed endpoint has no timer. Re-arming here as well would only
        # add work before the reply goes out.
        self._dispatch_events()
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._reading:
            # Flushed at the end of the read callback (``_read_ready``); until then
            # ``flush_pending`` spares the per-message path its ``wake()`` calls.
            self._queued_in_read = True
            self.flush_pending = True
            return
        if not self.flush_pending and not self._closed:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        if self._closed:
            return
        self._send_all(self.core.datagrams_to_send(monotonic()))
        if self._close_after_flush:
            self.close_now()
            return
        self._rearm_timer()
        # What sending changed: unreliable messages left the queue (drain() waiters),
        # a newer send superseded a message (its waiters).
        if self.draining or self.core.has_events:
            self._dispatch_events()

    def close_after_flush(self) -> None:
        """Close once what is queued now (an acknowledgement, say) has been sent."""
        self._close_after_flush = True
        self._schedule_flush()

    def set_path(self, path: DatagramPath | None) -> None:
        """Send datagrams and release the socket through `path` (None: the socket);
        every datagram then goes through it, batched sends (``sendmmsg``) included."""
        self._path = path

    def _sendto(self, data: bytes, address: Address) -> None:
        if self._path is not None:
            self._path.sendto(data, address)
        else:
            self.sendto_socket(data, address)

    def sendto_socket(self, data: bytes, address: Address) -> None:
        """Send one datagram on the socket: buffered while it would block, a refusal
        counted (what every send does unless `set_path` chose another way)."""
        if self._send_buffer:
            self._buffer(data, address)
            return
        try:
            self._sock.sendto(data, address)
        except (BlockingIOError, InterruptedError):
            self._buffer(data, address)
            self.loop.add_writer(self._sock.fileno(), self._write_ready)
        except OSError as exc:
            self._send_failed(exc, data, address)

    def _send_all(self, datagrams: list[tuple[bytes, Address]]) -> None:
        """What one flush sends: through the link conditioner, ``sendmmsg`` or ``sendto``."""
        if self._outbound is not None:
            for data, address in datagrams:
                self._outbound.send(data, address)
        elif (
            self._batch is not None
            and self._path is None
            and len(datagrams) > 1
            and not self._send_buffer
        ):
            self._send_batches(datagrams)
        else:
            for data, address in datagrams:
                self._sendto(data, address)

    def _send_batches(self, datagrams: list[tuple[bytes, Address]]) -> None:
        """``sendmmsg``, resumed after each datagram that fails as ``_sendto`` would
        handle it: one that would block is buffered with every one after it, any other
        error is counted (``_send_failed``) and the rest still leaves."""
        send_many = self._batch.send_many
        fd, family, cache = self._fd, self._family, self._addresses
        i, total = 0, len(datagrams)
        while i < total:
            i, err = send_many(fd, family, datagrams, i, cache)
            if err == 0:
                return
            data, address = datagrams[i]
            if err in _WOULD_BLOCK:
                for data, address in datagrams[i:]:
                    self._buffer(data, address)
                self.loop.add_writer(fd, self._write_ready)
                return
            if err < 0:  # an address form only the socket module converts
                self._sendto(data, address)
                if self._send_buffer:
                    for data, address in datagrams[i + 1 :]:
                        self._buffer(data, address)
                    return
            else:
                self._send_failed(OSError(err, os.strerror(err)), data, address)
            i += 1

    def _buffer(self, data: bytes, address: Address) -> None:
        if len(self._send_buffer) >= SEND_BUFFER_LIMIT:
            # Reliable data in it will be resent; the count says what happened.
            self.core.stats.send_buffer_drops += 1
            return
        self._send_buffer.append((data, address))

    def _write_ready(self) -> None:
        buffer = self._send_buffer
        while buffer:
            data, address = buffer[0]
            try:
                self._sock.sendto(data, address)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._send_failed(exc, data, address)
            buffer.popleft()
        self.loop.remove_writer(self._sock.fileno())

    def _send_failed(self, exc: OSError, data: bytes, address: Address) -> None:
        if exc.errno == errno.EMSGSIZE:
            # Larger than the interface (or the kernel's path MTU) allows: the socket
            # never fragments (see rudp.aio.server). Expected of path MTU probes, so
            # the connection is told, and nothing is logged or raised.
            self.core.stats.datagrams_too_large += 1
            self.core.datagram_refused(address, len(data), monotonic())
            self._schedule_flush()
            return
        self.core.stats.send_errors += 1
        if exc.errno not in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
            log.warning("send_error peer=%s error=%r", format_address(address), str(exc))

    # -- timers ---------------------------------------------------------------

    def _rearm_timer(self) -> None:
        deadline = self.core.get_timer()
        if deadline is None or self._closed:
            return
        if self._timer_at is None or deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        deadline = self._timer_at or 0.0
        self._timer = None
        self._timer_at = None
        # call_at may fire within the clock resolution before the deadline.
        self.core.handle_timer(max(monotonic(), deadline))
        self.after_core_call()

    # -- events ----------------------------------------------------------------

    def _dispatch_events(self) -> None:
        if self._dispatching:
            # Called from a callback that the loop of _dispatch_all runs (a receiver or
            # an on_query handler closing a connection): that loop takes the events the
            # call queued once the callback has returned, so that no callback is
            # re-entered (as an asyncio.Protocol's is not). The caller still schedules
            # the flush.
            return
        self._dispatching = True
        try:
            self._dispatch_all()
        finally:
            self._dispatching = False

    def _dispatch_all(self) -> None:
        next_event = self.core.next_event
        conns = self._conns
        while (item := next_event()) is not None:
            core_conn, event = item
            if core_conn is None:
                self._endpoint_event(event)
                continue
            conn = conns.get(core_conn)
            if conn is None:
                if type(event) is not Connected:
                    continue
                conn = self._adopt(core_conn)
            # ``type(event) is`` (not isinstance): what mypy narrows on, and the
            # cheapest test interpreted (a specialised call) and compiled alike.
            if type(event) is MessageReceived:
                conn.message_received(event)
            elif type(event) is MessageAcked:
                conn.message_acked(event.handle)
            elif type(event) is Connected:
                conn.handshake_completed()
            elif type(event) is Disconnected:
                del conns[core_conn]
                conn.connection_ended(event)
            elif type(event) is PathChanged:
                # ``conn.remote_address`` is the core's address: it has followed already.
                log.info(
                    "path_changed peer=%s old=%s",
                    format_address(event.address),
                    format_address(event.old),
                )
        if self.draining:
            for conn in list(self.draining):
                conn.check_drain()

    def _adopt(self, core_conn: CoreConnection) -> Connection:
        conn = Connection(self, core_conn)
        self._conns[core_conn] = conn
        if not core_conn.client and self._handler is not None:
            task = self.loop.create_task(self._run_handler(conn, self._handler))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return conn

    async def _run_handler(self, conn: Connection, handler: Handler) -> None:
        # The connection lives as long as its handler (asyncio's start_server differs:
        # there the handler may return and leave the stream open). The close text says
        # so to the peer, and to whoever reads the Disconnected on this side.
        text = HANDLER_RETURNED
        try:
            running = handler(conn)
            if not inspect.isawaitable(running):
                text = HANDLER_NOT_AWAITABLE
                log.error(
                    "handler_not_awaitable peer=%s type=%s",
                    format_address(conn.remote_address),
                    type(running).__name__,
                )
            else:
                await running
        except (ConnectionClosed, EndpointClosed) as exc:
            # A connection or the endpoint closed under it (recv() after the peer's close,
            # say). Any other error, a RudpError such as SendQueueFull included, is a bug
            # in the handler: below.
            log.debug(
                "handler_ended peer=%s error=%r", format_address(conn.remote_address), str(exc)
            )
        except Exception as exc:
            if type(exc) is ConnectError and (self._closing or self._closed):
                # A connect() the handler had started, cut short by this endpoint's
                # close ("closed locally"): the close's doing, not a bug. Any other
                # error while closing is still the handler's.
                log.debug(
                    "handler_ended peer=%s error=%r", format_address(conn.remote_address), str(exc)
                )
            else:
                text = HANDLER_FAILED
                log.exception("handler_failed peer=%s", format_address(conn.remote_address))
        except BaseException as exc:
            # Cancelled (it awaited a task someone else cancelled, asyncio.timeout, a
            # TaskGroup) or interrupted: the connection still ends with it. The close
            # starts here, not awaited: this task is ending.
            if not conn.closed:
                cancelled = isinstance(exc, asyncio.CancelledError)
                conn.close(text=HANDLER_CANCELLED if cancelled else HANDLER_FAILED)
            raise
        if not conn.closed:
            with contextlib.suppress(RudpError):
                await conn.close(text=text)

    def _endpoint_event(self, event: object) -> None:
        if isinstance(event, QueryReceived):
            self._answer_query(event)
        elif isinstance(event, QueryAnswered):
            future = self._queries.pop(event.nonce, None)
            if future is not None and not future.done():
                future.set_result((event.payload, event.rtt))

    def _answer_query(self, event: QueryReceived) -> None:
        if self.on_query is None or self._closing:
            return  # (closing: a server going away does not say it is there)
        try:
            reply = self.on_query(event.payload, event.address)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            self.query_errors += 1
            count = self.query_errors
            if count & (count - 1) == 0:  # the 1st, 2nd, 4th... (anyone can send queries)
                log.exception(
                    "query_handler_failed peer=%s count=%d", format_address(event.address), count
                )
            return
        if reply is None:
            return
        if not isinstance(reply, bytes | bytearray | memoryview):
            if inspect.iscoroutine(reply):
                reply.close()  # an async callable the setter could not see: never awaited
            log.error("query_handler_bad_reply type=%s", type(reply).__name__)
            return
        if type(reply) is not bytes:
            reply = bytes(reply)  # a memoryview's len() counts items, not bytes
        if len(reply) > event.max_reply:
            # The request was not padded enough: answering would amplify. Anyone can
            # send such requests, so this is counted, not logged as an error.
            self.core.stats.queries_unanswered += 1
            log.debug("query_reply_too_large size=%d allowed=%d", len(reply), event.max_reply)
            return
        self.core.reply_query(event, reply)

    # -- operations used by Server / Connection ------------------------------------

    def wake(self) -> None:
        """Something was queued: flush at the end of this loop turn."""
        self._schedule_flush()

    async def connect(
        self,
        address: Address,
        *,
        owns_endpoint: bool = False,
        server_key: bytes | None = None,
        token: bytes | None = None,
        token_key: bytes | None = None,
    ) -> Connection:
        """Connect out; with ``owns_endpoint`` the connection closes this endpoint when it
        ends (set before the handshake: the server may close it in the same datagram).
        ``server_key`` overrides ``Config.server_key`` for this connection; ``token``
        and ``token_key`` present a connect token (see ``rudp.connect``). Refused with
        ``EndpointClosed`` once ``close()`` has begun."""
        self._check_open()
        core_conn = self.core.connect(
            address, monotonic(), server_key=server_key, token=token, token_key=token_key
        )
        conn = Connection(self, core_conn)
        conn.owns_endpoint = owns_endpoint
        self._conns[core_conn] = conn
        self.after_core_call()
        try:
            await conn.wait_established()
        except asyncio.CancelledError:
            core_conn.abort()
            self.after_core_call()
            raise
        return conn

    async def query(
        self, address: Address, payload: bytes | bytearray | memoryview, timeout: float
    ) -> tuple[bytes, float]:
        """Send one unconnected query and wait ``timeout`` seconds for its answer: a
        ``TimeoutError`` naming the address and the timeout without one."""
        timeout = check_query_timeout(timeout)
        self._check_open()
        nonce = self.core.query(address, payload, monotonic())
        future: asyncio.Future[tuple[bytes, float]] = self.loop.create_future()
        self._queries[nonce] = future
        self._schedule_flush()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            # wait_for's own is bare: say what was not answered, and within how long.
            # (The cause is set by hand: compiled, ``raise ... from`` in a coroutine
            # left it unset.)
            error = TimeoutError(
                f"no answer to the query from {format_address(address)} within {timeout:g} s"
            )
            error.__cause__ = exc
            raise error  # noqa: B904 (its cause is set above)
        finally:
            self._queries.pop(nonce, None)
            self.core.cancel_query(nonce)

    def refuse_new(self) -> None:
        """From now on refuse new connects and queries (`EndpointClosed`): a close is
        starting (``Server.close()`` runs it in a task of its own, which starts a loop
        turn later), and new handshakes (REJECT "server closing")."""
        self._closing = True
        self.core.refusing = True

    def _check_open(self) -> None:
        """Refuse something new (a connect, a query) once the close has begun: the close
        would end it before it could serve, without telling the peer."""
        if self._closed:
            raise EndpointClosed("endpoint is closed")
        if self._closing:
            raise EndpointClosed("endpoint is closing")

    def connections(self) -> list[Connection]:
        return [c for core, c in self._conns.items() if core.client is False]

    async def close(
        self, timeout: float | None = None, *, exclude: asyncio.Task[Any] | None = None
    ) -> None:
        """Close every connection gracefully, then the socket.

        Connections get ``timeout`` (default ``Config.close_timeout`` plus a second) to
        finish their close handshake; handlers still running then are cancelled and
        get one more second for their cleanup. It may be called from a handler: that
        handler is not waited for (it is the one waiting), nor is any other task named
        to ``exclude_from_close()`` while the close runs. ``exclude`` names the caller's
        task when the close runs in a task of its own (default: the current task).
        A call while a close runs waits for that one to end (its ``timeout`` is not
        used): closing again would cut the first close's waits short.
        """
        current = exclude or asyncio.current_task()
        if self._closed or self._close_begun:
            if current is not None and not self._closed:
                self.exclude_from_close(current)  # the running close must not wait for it
            await self._closed_event.wait()
            return
        self._close_begun = self._closing = True
        loop = self.loop
        limit = timeout if timeout is not None else self.config.close_timeout + 1.0
        deadline = loop.time() + limit
        if current is not None:
            self.exclude_from_close(current)
        try:
            self.core.close(monotonic())
            self.after_core_call()
            closing = [c.closed_future for c in self._conns.values()]
            if closing:
                await asyncio.wait(closing, timeout=limit)
            self.core.abort()
            self._dispatch_events()
            await self._end_handlers(deadline)
        finally:
            self.close_now()

    def exclude_from_close(self, task: asyncio.Task[Any]) -> None:
        """``task`` waits for this endpoint's close: the close must not wait for it (it
        would wait until its deadline, then cancel a task nobody meant to cancel)."""
        if task in self._close_excluded:
            return
        self._close_excluded.add(task)
        task.add_done_callback(self._close_excluded.discard)
        added = self._exclusion_added
        if added is not None and not added.done():
            added.set_result(None)

    async def _end_handlers(self, deadline: float) -> None:
        """Wait until ``deadline`` for the handlers not excluded, then cancel those left
        and give them a second for their cleanup."""
        pending = await self._wait_for_handlers(self._tasks, deadline)
        for task in pending:
            task.cancel()
        if pending:
            await self._wait_for_handlers(pending, self.loop.time() + 1.0)

    async def _wait_for_handlers(
        self, tasks: Iterable[asyncio.Task[Any]], deadline: float
    ) -> list[asyncio.Task[Any]]:
        """Wait until ``deadline`` for ``tasks``, those excluded from the close left out,
        also those excluded meanwhile (a cancelled handler whose cleanup awaits this
        close); return those still running."""
        loop = self.loop
        while True:
            excluded = self._close_excluded
            running = [t for t in tasks if t not in excluded and not t.done()]
            left = deadline - loop.time()
            if not running or left <= 0:
                return running
            added: asyncio.Future[None] = loop.create_future()
            self._exclusion_added = added
            # One future for them all (return_exceptions: it never fails), raced with
            # an exclusion, which changes what is waited for.
            ended = asyncio.gather(*running, return_exceptions=True)
            done, _ = await asyncio.wait(
                (ended, added), timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            self._exclusion_added = None
            if not done:
                excluded = self._close_excluded
                return [t for t in tasks if t not in excluded and not t.done()]

    def close_now(self) -> None:
        """Release the socket; connections still open end with reason "aborted"."""
        if self._closed:
            return
        self._closing = True
        self.core.abort()
        self._dispatch_events()
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for pipe in (self._inbound, self._outbound):
            if pipe is not None:
                pipe.close()
        self._release_socket()
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EndpointClosed("endpoint closed before the answer"))
        self._closed_event.set()

    def _release_socket(self) -> None:
        if self._path is not None:
            self._path.release_socket()
        else:
            self.release_own_socket()

    def release_own_socket(self) -> None:
        """Stop watching the socket and close it."""
        if self._read_pause is not None:
            self._read_pause.cancel()
            self._read_pause = None
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self._sock.fileno())
        with contextlib.suppress(Exception):
            self.loop.remove_writer(self._sock.fileno())
        self._sock.close()

    def destination_family(self) -> tuple[int, int]:
        """The address family (and getaddrinfo flags) of destinations for this socket: a
        dual-stack IPv6 socket reaches IPv4 hosts through v4-mapped addresses."""
        sock = self._sock
        if sock.family == socket.AF_INET6 and not sock.getsockopt(
            socket.IPPROTO_IPV6, socket.IPV6_V6ONLY
        ):
            return sock.family, socket.AI_V4MAPPED
        return sock.family, 0

    @property
    def accepting(self) -> bool:
        """True when it accepts connections (it has a handler)."""
        return self._handler is not None

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_closing(self) -> bool:
        """True once a close has begun (or ended): nothing new is taken."""
        return self._closing or self._closed

    # What the socket could not send, kept in the core's ``stats`` (so exported with
    # them: ``rudp_send_errors_total`` and the like); read here as well.

    @property
    def send_errors(self) -> int:
        return self.core.stats.send_errors

    @property
    def datagrams_too_large(self) -> int:
        return self.core.stats.datagrams_too_large

    @property
    def send_buffer_drops(self) -> int:
        return self.core.stats.send_buffer_drops

    @property
    def queries_unanswered(self) -> int:
        return self.core.stats.queries_unanswered

    async def wait_closed(self) -> None:
        await self._closed_event.wait()
