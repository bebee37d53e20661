"""The asyncio layer over the sans-IO core."""

from rudp.aio.connection import Connection, Message, SendHandle
from rudp.aio.server import Server, connect, open_endpoint, run, serve

__all__ = [
    "Connection",
    "Message",
    "SendHandle",
    "Server",
    "connect",
    "open_endpoint",
    "run",
    "serve",
]
