"""The seam between the matchmaker and rudp.

The service and the client library speak to connections through `Peer`, a
structural protocol that `rudp.Connection` satisfies as it is.  Tests plug in
an in-memory pair instead (tests/matchmaker/fakes.py), which keeps the
protocol logic testable without sockets or timers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import rudp

TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (rudp.RudpError, ConnectionError, OSError)
"""What sending or connecting may raise when the connection is over or refused."""


class Received(Protocol):
    @property
    def data(self) -> bytes: ...


class Peer(Protocol):
    """What the matchmaker needs from one connection."""

    @property
    def remote_address(self) -> tuple[Any, ...]: ...

    def send(self, data: bytes, *, reliable: bool = True, channel: int = 0) -> Awaitable[None]:
        """Queue `data` (never blocks); the awaitable completes when the peer acked it.

        Raises one of TRANSPORT_ERRORS, at once or when awaited, when the
        connection is over or its send queue is full.
        """
        ...

    def __aiter__(self) -> AsyncIterator[Received]:
        """Messages until the connection ends."""
        ...

    def close(
        self, code: int = 0, text: str = "", *, reason: str | None = None
    ) -> Awaitable[object]:
        """Start closing at once; the awaitable completes when the connection ended.
        (``reason=`` is the deprecated name of ``text``, as in ``rudp.Connection``.)"""
        ...


DatagramHandler = Callable[[bytes, tuple[Any, ...]], Sequence[bytes]]
"""``fn(datagram, source) -> replies`` (each reply goes back to ``source``)."""


class DatagramPort(Protocol):
    """The socket a host's connections leave from, for connectionless datagrams
    (heartbeats, introductions); `rudp.Server` is one."""

    def send_datagram(self, data: bytes, address: tuple[Any, ...]) -> None: ...

    def set_datagram_handler(self, first_byte: int, handler: DatagramHandler | None) -> None: ...


Connector = Callable[[], Awaitable[Peer]]
"""Opens a fresh connection to the matchmaker."""


def rudp_connector(
    host: str,
    port: int,
    *,
    via: rudp.Server | None = None,
    config: rudp.Config | None = None,
    server_key: bytes | None = None,
) -> Connector:
    """Connect with rudp; `via` a game server's own socket, so the matchmaker
    observes (and lists, and introduces) the game port itself.  `server_key`,
    the matchmaker's rudp static public key, authenticates it (Noise NK)."""

    async def connect() -> Peer:
        if via is not None:
            return await via.connect(host, port, server_key=server_key)
        return await rudp.connect(host, port, config=config, server_key=server_key)

    return connect
