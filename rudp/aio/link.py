"""What a connection of the asyncio layer needs from its endpoint, as a type.

``rudp.aio.connection.Connection`` holds its ``AioEndpoint`` typed as this
``Protocol``, so that the connection module never imports the endpoint module
(the endpoint imports the connection module, and the dependency goes one way).
It is for type checking only: nothing imports it at run time, and the calls it
types cost what they did (in the compiled build the endpoint is an ordinary
Python class either way).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from rudp.config import Config
from rudp.connection import Address

if TYPE_CHECKING:
    from rudp.aio.connection import Connection


class EndpointLink(Protocol):
    """The members of ``AioEndpoint`` its connections use."""

    loop: asyncio.AbstractEventLoop
    """The event loop the endpoint runs in."""
    config: Config
    """The endpoint's configuration (shared by its connections)."""
    local_address: Address
    """The bound socket address."""
    flush_pending: bool
    """A flush is scheduled for the end of this loop turn: ``wake()`` would do nothing.
    Read before calling ``wake()`` on the per-message path, to save the call."""
    draining: set[Connection]
    """The connections with a ``drain()`` waiter, re-checked after each flush."""

    def wake(self) -> None:
        """Something was queued in the core: flush at the end of this loop turn."""

    def after_core_call(self) -> None:
        """The core was called outside the socket and timer callbacks: dispatch its
        events and schedule a flush."""

    def close_after_flush(self) -> None:
        """Close the endpoint once what is queued now has been sent."""
