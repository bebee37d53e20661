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

``rudp.compiled`` tells which build is installed: True when the sans-IO core was
compiled with mypyc (``RUDP_COMPILE=1 pip install .``), False for pure Python.
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
from rudp.events import Disconnected, DisconnectReason
from rudp.stats import ConnectionStats, EndpointStats
from rudp.wire import Delivery, DropReason


def _core_is_compiled() -> bool:
    from importlib.machinery import EXTENSION_SUFFIXES

    from rudp import wire

    return (getattr(wire, "__file__", None) or "").endswith(tuple(EXTENSION_SUFFIXES))


compiled: bool = _core_is_compiled()
"""True when the sans-IO core is the mypyc-compiled build, False when it is pure Python."""

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
    "Disconnected",
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
    "compiled",
    "connect",
    "open_endpoint",
    "run",
    "serve",
]
