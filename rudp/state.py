"""The states of a connection and the transitions between them.

::

    CONNECTING -> CONNECTED -> CLOSING (our close: flush, DISCONNECT, its ack) -> CLOSED
                           \\-> DRAINING (peer's DISCONNECT: linger to re-ack it) -> CLOSED
    any -> CLOSED (timeout, NOCONN, refusal, abort)

Every transition happens in ``Connection._set_state``, which checks it against
``TRANSITIONS``; the parts of the data path only read the state.
"""

from __future__ import annotations

import enum
from typing import Final


class State(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSING = "closing"
    DRAINING = "draining"
    CLOSED = "closed"


CONNECTING: Final = State.CONNECTING
CONNECTED: Final = State.CONNECTED
CLOSING: Final = State.CLOSING
DRAINING: Final = State.DRAINING
CLOSED: Final = State.CLOSED

TRANSITIONS = {
    CONNECTING: {CONNECTED, CLOSED},
    CONNECTED: {CLOSING, DRAINING, CLOSED},
    CLOSING: {DRAINING, CLOSED},
    DRAINING: {CLOSED},
    CLOSED: set(),
}
