"""The asyncio layer over the sans-IO core."""

from __future__ import annotations

import warnings
from typing import Any

from rudp.aio.connection import Connection, SendHandle
from rudp.aio.server import Endpoint, Server, connect, open_endpoint, run, serve
from rudp.events import MessageReceived

# Old names that still work, with a DeprecationWarning: name -> (object, use instead).
DEPRECATED: dict[str, tuple[Any, str]] = {
    "Message": (MessageReceived, "MessageReceived (what recv() returns, and its repr)"),
}


def __getattr__(name: str) -> Any:
    """Old spellings (PEP 562): warn, then give the object under its new name."""
    if name in DEPRECATED:
        value, instead = DEPRECATED[name]
        warnings.warn(
            f"rudp.{name} is deprecated: use rudp.{instead}", DeprecationWarning, stacklevel=2
        )
        return value
    raise AttributeError(f"module 'rudp.aio' has no attribute {name!r}")


__all__ = [
    "Connection",
    "Endpoint",
    "MessageReceived",
    "SendHandle",
    "Server",
    "connect",
    "open_endpoint",
    "run",
    "serve",
]
