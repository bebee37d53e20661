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
compiled with mypyc (``RUDP_COMPILE=1 pip install .``), False for pure Python;
``rudp.native``, whether the C extension that batches system calls came with it.

The submodules outside the import path of the API above (``rudp.metrics``,
``rudp.lan``, ``rudp.lockstep``, ``rudp.netsim``) are imported on first use, so
``import rudp`` stays light and ``rudp.metrics`` needs prometheus-client (the
``aiorudp[metrics]`` extra) only when it is used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from rudp.aio import (
    DEPRECATED,
    Connection,
    Endpoint,
    MessageReceived,
    SendHandle,
    Server,
    connect,
    open_endpoint,
    run,
    serve,
)
from rudp.config import Config, NetsimConfig
from rudp.errors import (
    ConnectError,
    ConnectionClosed,
    ConnectRefused,
    ConnectTimeout,
    EndpointClosed,
    LocalProtocolError,
    MessageTooLarge,
    RudpError,
    SendQueueFull,
)
from rudp.events import Disconnected, DisconnectReason
from rudp.noise import generate_key, public_key
from rudp.stats import ConnectionStats, EndpointStats
from rudp.wire import Delivery, DropReason

__version__ = "0.1.0"  # the package's one version (pyproject.toml reads it from here)

# Imported on first attribute access, not by ``import rudp``.
_LAZY_SUBMODULES = ("lan", "lockstep", "metrics", "netsim")
# What a lazy submodule needs beyond the plain install: module -> (import name, extra).
_EXTRAS = {"metrics": ("prometheus_client", "metrics")}


def __getattr__(name: str) -> Any:
    """Import ``rudp.metrics``, ``rudp.lan``, ... on first use (PEP 562); old
    spellings (``rudp.MessageReceived``) warn, then give the object under its new name."""
    if name in DEPRECATED:
        value, instead = DEPRECATED[name]
        warnings.warn(
            f"rudp.{name} is deprecated: use rudp.{instead}", DeprecationWarning, stacklevel=2
        )
        return value
    if name not in _LAZY_SUBMODULES:
        raise AttributeError(f"module 'rudp' has no attribute {name!r}")
    try:
        return importlib.import_module(f"rudp.{name}")
    except ModuleNotFoundError as exc:
        needed, extra = _EXTRAS.get(name, ("", ""))
        if not needed or exc.name != needed:
            raise
        message = f"rudp.{name} needs {needed}, which the '{extra}' extra installs: "
        message += f"pip install 'aiorudp[{extra}]'"
        raise ModuleNotFoundError(message, name=exc.name) from exc


def _core_is_compiled() -> bool:
    from importlib.machinery import EXTENSION_SUFFIXES

    from rudp import wire

    return (getattr(wire, "__file__", None) or "").endswith(tuple(EXTENSION_SUFFIXES))


compiled: bool = _core_is_compiled()
"""True when the sans-IO core is the mypyc-compiled build, False when it is pure Python."""


def _native_is_present() -> bool:
    from importlib.util import find_spec

    return find_spec("rudp._batch") is not None


native: bool = _native_is_present()
"""True when the C extension ``rudp._batch`` (``recvmmsg``/``sendmmsg``, Linux) is
installed. The asyncio layer then moves many datagrams per system call, unless
``RUDP_NO_NATIVE=1`` was set when it was imported."""

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
    "Endpoint",
    "EndpointClosed",
    "EndpointStats",
    "LocalProtocolError",
    "MessageReceived",
    "MessageTooLarge",
    "NetsimConfig",
    "RudpError",
    "SendHandle",
    "SendQueueFull",
    "Server",
    "compiled",
    "connect",
    "generate_key",
    "native",
    "open_endpoint",
    "public_key",
    "run",
    "serve",
]
