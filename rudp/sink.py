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

Judgement call: a connection writes the sink's two containers directly
(``sink.events.append((conn, event))``, ``sink.dirty[conn] = None``) rather than
calling a method for each. Both happen per message (an event per message
received, a flush request per message sent), and a call per message costs about
1.5 % of the pure build's instructions per message, a sixth of that compiled:
measurably more than the write itself. The containers are the interface; the
sink owns them, and the endpoint reads them. The end of a connection, which
happens once, is a call (``closed``).
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
        # (connection, event), or (None, endpoint event), in the order they happened:
        # what ``Endpoint.next_event`` returns.
        self.events: deque[tuple[Connection | None, Event | EndpointEvent]] = deque()
        # Connections with something to send, in the order they asked (a dict used as
        # an ordered set): what ``Endpoint.datagrams_to_send`` visits.
        self.dirty: dict[Connection, None] = {}
        self._on_closed = on_closed

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
