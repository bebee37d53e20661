"""What a connection tells its endpoint: the one seam between ``Connection`` and
``Endpoint``.

Theory of operation
-------------------
A connection produces three things its endpoint must act on: events for the
application, a wish to be flushed (something is due to go out), and its end.
The endpoint creates one ``EndpointSink`` and hands it to every connection it
makes; connections never see the endpoint itself, nor each other.

Connections wanting a flush are kept in a dict used as an ordered set, so the
endpoint visits them in the order they asked. A ``set`` of objects iterates in
the order of their ids (memory addresses), which differ from run to run: two
runs of one seeded scenario would put the same datagrams on the wire in a
different order, and nothing downstream could be replayed bit for bit.

Judgement call: the sink is a concrete class, not a ``typing.Protocol``. It sits
on the per-message path (one ``event`` per message received, one
``wants_flush`` per message sent), and compiled with mypyc a call to a native
class in the same compile group is a direct C call, where a call through a
protocol is a generic Python method call. There is one endpoint implementation;
a second would subclass this one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rudp.connection import Connection
    from rudp.events import EndpointEvent, Event


class EndpointSink:
    """Events, flush requests and closures from an endpoint's connections."""

    __slots__ = ("_on_closed", "dirty", "events")

    def __init__(self, on_closed: Callable[[Connection], None] | None = None) -> None:
        # (connection, event), or (None, endpoint event), in the order they happened.
        self.events: deque[tuple[Connection | None, Event | EndpointEvent]] = deque()
        # Connections with something to send, in the order they asked (an ordered set).
        self.dirty: dict[Connection, None] = {}
        self._on_closed = on_closed

    def event(self, conn: Connection, event: Event) -> None:
        """Report an event of ``conn`` to the application."""
        self.events.append((conn, event))

    def wants_flush(self, conn: Connection) -> None:
        """``conn`` has something to send at the endpoint's next flush."""
        self.dirty[conn] = None

    def closed(self, conn: Connection) -> None:
        """``conn`` reached CLOSED: it sends nothing more and its endpoint forgets it."""
        self.dirty.pop(conn, None)
        if self._on_closed is not None:
            self._on_closed(conn)

    def take_dirty(self) -> list[Connection]:
        """The connections that asked for a flush, in the order they asked; forgets them."""
        dirty = list(self.dirty)
        self.dirty.clear()
        return dirty
