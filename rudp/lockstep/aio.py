"""Thin asyncio glue: a lockstep host or client over rudp connections.

All protocol decisions live in the sans-IO :class:`LockstepHost` and
:class:`LockstepClient`; this module only moves bytes and time in and out, the
aioquic way. After every call into a core it *pumps*: sends the core's queued
messages (reliable, ordered, channel ``channel``), closes the connections it
asks to close, queues its events, and re-arms one ``TimerHandle`` for
``get_timer()``. Time is ``loop.time()`` (monotonic).

Host::

    server = await LockstepServer.serve("0.0.0.0", 9000, config=LockstepConfig())
    ...                      # wait for ClientJoined events
    server.start()
    async for event in server.events(): ...

Client::

    game = await LockstepSession.connect("192.168.1.10", 9000, name="alice")
    async for event in game.events():
        if isinstance(event, TurnsReady):
            while (turn := game.next_turn()) is not None:
                game.complete_turn(turn.number, sim.step(turn.number, turn.commands))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import rudp
from rudp.aio.connection import format_address
from rudp.errors import LocalProtocolError
from rudp.lockstep.client import ClientState, LockstepClient, Turn
from rudp.lockstep.config import LockstepConfig
from rudp.lockstep.events import Event
from rudp.lockstep.host import LockstepHost

__all__ = ["LockstepServer", "LockstepSession"]

log = logging.getLogger(__name__)

#: The most channels a rudp connection has (``rudp.Config.channels`` is at most 256).
_MAX_CHANNELS = 256


def _check_channel(channel: object, channels: int = _MAX_CHANNELS) -> None:
    """Refuse a lockstep ``channel`` that no message could be sent on, at once: sent
    anyway, every send would fail and the game would wait forever for a reply."""
    if type(channel) is bool or not isinstance(channel, int):
        raise TypeError(f"channel must be an int, not {type(channel).__name__}")
    if not 0 <= channel < channels:
        raise ValueError(f"channel must be in [0, {channels}), got {channel}")


def _config_channels(rudp_config: object) -> int:
    """The channel count of the connections made with ``rudp_config`` (not a
    ``rudp.Config``: the widest, and ``rudp`` refuses the config itself)."""
    if rudp_config is None:
        return rudp.Config().channels
    if isinstance(rudp_config, rudp.Config):
        return rudp_config.channels
    return _MAX_CHANNELS


def _check_message_size(conn: rudp.Connection, config: LockstepConfig) -> None:
    if conn.max_message_size < config.max_message_size:
        # Full NETTURNs would fail to send; the game would stall, so say why. (Messages
        # above conn.max_datagram_payload are fragmented, which works but costs latency.)
        log.warning(
            "message_size_too_large lockstep=%d rudp=%d",
            config.max_message_size,
            conn.max_message_size,
        )


class _Pump:
    """Shared plumbing: one timer, an event queue, and close tasks."""

    def __init__(
        self, get_timer: Callable[[], float | None], on_timer: Callable[[float], None]
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._get_timer = get_timer
        self._on_timer = on_timer
        self._timer: asyncio.TimerHandle | None = None
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: set[rudp.Connection] = set()
        self._stopped = False
        self._ended = False

    def now(self) -> float:
        return self._loop.time()

    def rearm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stopped:
            return  # closing: no more timers, or a dead game would tick forever
        deadline = self._get_timer()
        self._timer = None if deadline is None else self._loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._on_timer(self.now())

    def spawn_close(self, conn: rudp.Connection) -> None:
        """Close ``conn`` in the background; once, however often it is asked."""
        if conn in self._closing:
            return
        self._closing.add(conn)
        task = self._loop.create_task(self._close(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._closing.discard(conn))

    @staticmethod
    async def _close(conn: rudp.Connection) -> None:
        with contextlib.suppress(rudp.RudpError):
            await conn.close()

    def put(self, event: Event | None) -> None:
        self._events.put_nowait(event)

    async def events(self) -> AsyncIterator[Event]:
        """Events until the end (``None`` marks the end); after the end, none."""
        while not self._ended:
            event = await self._events.get()
            if event is None:
                # The end is for good: a later (or a concurrent) iteration ends at
                # once too, instead of waiting for an event that will never come.
                self._ended = True
                self._events.put_nowait(None)
                return
            yield event

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class LockstepServer:
    """A :class:`LockstepHost` serving rudp connections; peers are the connections."""

    def __init__(self, host: LockstepHost[rudp.Connection], *, channel: int = 0) -> None:
        _check_channel(channel)
        self.host = host
        self.channel = channel
        self._pump = _Pump(host.get_timer, self._handle_timer)
        self._server: rudp.Server | None = None
        self._closed = False

    @classmethod
    async def serve(
        cls,
        address: str | None,
        port: int,
        *,
        config: LockstepConfig | None = None,
        rudp_config: rudp.Config | None = None,
        channel: int = 0,
    ) -> LockstepServer:
        _check_channel(channel, _config_channels(rudp_config))
        self = cls(LockstepHost[rudp.Connection](config=config), channel=channel)
        self._server = await rudp.serve(self.handle, address, port, config=rudp_config)
        return self

    def __repr__(self) -> str:
        where = "not serving" if self._server is None else format_address(self.address)
        return f"<LockstepServer {where} {self.host!r}>"

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        host, port = self._server.address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Close the lobby and start the turn clock. After :meth:`close`,
        ``LocalProtocolError``: no client would hear the game start, nor its turns."""
        if self._closed:
            raise LocalProtocolError("the lockstep server is closed")
        self.host.start(self._pump.now())
        self._flush()

    def events(self) -> AsyncIterator[Event]:
        return self._pump.events()

    async def close(self) -> None:
        self._closed = True
        self._pump.stop()
        if self._server is not None:
            await self._server.close()
        self._pump.put(None)

    async def handle(self, conn: rudp.Connection) -> None:
        """The per-connection rudp handler (usable with any ``rudp.serve``)."""
        _check_message_size(conn, self.host.config)
        try:
            async for msg in conn:
                if msg.channel == self.channel:
                    self.host.receive(conn, msg.data, self._pump.now())
                    self._flush()
                else:
                    self.host.stats.ignored += 1
        finally:
            self.host.peer_disconnected(conn, self._pump.now())
            self._flush()

    def _handle_timer(self, now: float) -> None:
        self.host.handle_timer(now)
        self._flush()

    def _flush(self) -> None:
        while messages := self.host.messages_to_send():
            for conn, data in messages:
                try:
                    conn.send(data, channel=self.channel)
                except rudp.RudpError as exc:  # closed, or its queue is full: it is gone
                    peer = format_address(conn.remote_address)
                    log.info("send_failed peer=%s error=%r", peer, str(exc))
                    self.host.peer_disconnected(conn, self._pump.now())
                    self._pump.spawn_close(conn)  # or it lingers, forgotten but open
        for conn in self.host.peers_to_close():
            self._pump.spawn_close(conn)
        while (event := self.host.next_event()) is not None:
            self._pump.put(event)
        self._pump.rearm()


class LockstepSession:
    """A :class:`LockstepClient` talking to its host over one rudp connection."""

    def __init__(self, conn: rudp.Connection, client: LockstepClient, *, channel: int = 0) -> None:
        _check_channel(channel)
        self.conn = conn
        self.client = client
        self.channel = channel
        self._pump = _Pump(client.get_timer, self._handle_timer)
        self._hung_up = False
        self._closed = False
        _check_message_size(conn, client.config)
        # JOIN goes out before the reader starts: a channel this connection (or its
        # peer) lacks raises here, leaving nothing running.
        self._flush(first=True)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        name: str = "",
        config: LockstepConfig | None = None,
        rudp_config: rudp.Config | None = None,
        channel: int = 0,
    ) -> LockstepSession:
        # Everything that can be checked is checked before connecting, and the
        # connection is closed if the session fails anyway (a channel the server
        # lacks): it must not stay open with nobody reading it.
        client = LockstepClient(name=name, config=config)
        _check_channel(channel, _config_channels(rudp_config))
        conn = await rudp.connect(host, port, config=rudp_config)
        try:
            return cls(conn, client, channel=channel)
        except BaseException:
            with contextlib.suppress(rudp.RudpError):
                conn.close()
            raise

    def __repr__(self) -> str:
        return f"<LockstepSession {self.conn!r} {self.client!r}>"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` (or :meth:`leave`) was called."""
        return self._closed

    def events(self) -> AsyncIterator[Event]:
        """Events until the connection ends; once they ended, a new iteration ends at once."""
        return self._pump.events()

    def _check_open(self) -> None:
        if self._closed:
            raise LocalProtocolError("the lockstep session is closed")

    def next_turn(self) -> Turn | None:
        self._check_open()
        return self.client.next_turn()

    def complete_turn(self, number: int, checksum: int) -> None:
        self._check_open()
        self.client.complete_turn(number, checksum)
        self._flush()

    def send_command(self, data: bytes | bytearray | memoryview) -> int:
        self._check_open()
        turn = self.client.send_command(data)
        self._flush()
        return turn

    async def leave(self) -> None:
        """Say LEAVE, then close the connection gracefully (LEAVE is delivered first)."""
        self._check_open()
        self.client.leave()
        self._flush()
        await self.close()

    async def close(self) -> None:
        """Close the connection and end the session: :meth:`events` ends, and the
        game's calls (:meth:`send_command`, :meth:`complete_turn`, :meth:`next_turn`,
        :meth:`leave`) raise ``LocalProtocolError``. Closing again does nothing more."""
        self._closed = True
        self.client.state = ClientState.ENDED
        self._pump.stop()
        with contextlib.suppress(rudp.RudpError):
            await self.conn.close()
        await self._reader

    async def _read(self) -> None:
        try:
            async for msg in self.conn:
                if msg.channel == self.channel:
                    self.client.receive(msg.data, self._pump.now())
                    self._flush()
                else:
                    self.client.stats.ignored += 1
        finally:
            self._pump.stop()
            self._pump.put(None)

    def _handle_timer(self, now: float) -> None:
        self.client.handle_timer(now)
        self._flush()

    def _flush(self, *, first: bool = False) -> None:
        for data in self.client.messages_to_send():
            try:
                self.conn.send(data, channel=self.channel)
            except rudp.RudpError as exc:
                if first and type(exc) is LocalProtocolError:
                    # Not a closed connection (EndpointClosed, ConnectionClosed): the
                    # channel is beyond this connection's channels or its peer's.
                    raise ValueError(
                        f"channel {self.channel} cannot be used on this connection: {exc}"
                    ) from exc
                log.info("send_failed error=%r", str(exc))
        while (event := self.client.next_event()) is not None:
            self._pump.put(event)
        if self.client.fault is not None and not self._hung_up:
            # The client gave up on a broken host (HostFaulted, queued above): hang up
            # once its LEAVE is sent; the reader then ends events().
            self._hung_up = True
            self._pump.spawn_close(self.conn)
        self._pump.rearm()
