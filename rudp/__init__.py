"""rudp: reliable UDP for asyncio game servers.

Quick look::

    import rudp

    async def handler(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)                   # echo, reliable and ordered

    server = await rudp.serve(handler, "127.0.0.1", 9000)
    conn = await rudp.connect("127.0.0.1", 9000)
    await conn.send(b"hello")                     # completes when acknowledged
    print((await conn.recv()).data)
    await conn.close()

The protocol core (``rudp.connection``, ``rudp.endpoint``) is sans-IO; the
asyncio layer lives in ``rudp.aio``. See docs/api.md and docs/protocol.md.
"""

from rudp.aio import Connection, Message, SendHandle, Server, connect, open_endpoint, run, serve
from rudp.config import Config, NetsimConfig
from rudp.errors import (
    ConnectError,
    ConnectionClosed,
    ConnectRefused,
    ConnectTimeout,
    LocalProtocolError,
    MessageTooLarge,
    RudpError,
    SendQueueFull,
)
from rudp.events import DisconnectReason
from rudp.stats import ConnectionStats, EndpointStats
from rudp.wire import Delivery, DropReason

__all__ = [
    "Config",
    "ConnectError",
    "ConnectRefused",
    "ConnectTimeout",
    "Connection",
    "ConnectionClosed",
    "ConnectionStats",
    "Delivery",
    "DisconnectReason",
    "DropReason",
    "EndpointStats",
    "LocalProtocolError",
    "Message",
    "MessageTooLarge",
    "NetsimConfig",
    "RudpError",
    "SendHandle",
    "SendQueueFull",
    "Server",
    "connect",
    "open_endpoint",
    "run",
    "serve",
]
