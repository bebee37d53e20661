"""Events the sans-IO core reports; small frozen dataclasses, named in the past tense."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar

from mypy_extensions import mypyc_attr

from rudp.wire import RELIABLE_ORDERED, UNRELIABLE, Delivery


class DisconnectReason(enum.StrEnum):
    """Why a connection ended. The string values appear in logs and exceptions."""

    CLOSED = "closed"
    """Closed gracefully by ``close()`` on one side; both sides report this."""
    TIMEOUT = "timeout"
    """Heard nothing from the peer for ``Config.idle_timeout``."""
    NO_CONNECTION = "peer has no connection"
    """The peer answered NOCONN: it forgot us (restart, or its own timeout)."""
    REFUSED = "refused"
    """The server refused the handshake."""
    CONNECT_TIMEOUT = "connect timed out"
    """The server never answered the handshake."""
    PROTOCOL_ERROR = "protocol error"
    """The peer broke the protocol in a way that cannot be dropped and forgotten."""
    ABORTED = "aborted"
    """Ended locally without a handshake (the endpoint was shut down)."""
    EXHAUSTED = "packet numbers exhausted"
    """2**62 packets were sent: another would reuse a nonce. Connect again."""
    UNACKNOWLEDGED = "message unacknowledged"
    """A reliable message went unacknowledged for ``Config.ack_timeout`` while the
    peer was heard."""
    PEER_PAUSED = "peer paused too long"
    """The peer's PAUSE kept our reliable messages waiting for
    ``Config.peer_pause_timeout``."""


@dataclass(frozen=True, slots=True)
class Connected:
    """The handshake completed."""


@mypyc_attr(acyclic=True)
class MessageReceived:
    """A message was delivered to the application.

    A plain class with slots rather than a frozen dataclass or a NamedTuple: one is
    made per message on the receive path, and compiled (``RUDP_COMPILE=1``) it is a
    native class whose construction costs a fraction of either. It holds only bytes
    and numbers, so it can never be part of a reference cycle: ``acyclic`` keeps the
    compiled class out of the garbage collector's bookkeeping.
    """

    __slots__ = ("_mode", "channel", "data", "reliable")
    __match_args__: ClassVar[tuple[str, ...]] = ("data", "channel", "reliable", "delivery")

    def __init__(self, data: bytes, channel: int, reliable: bool, delivery: int = -1) -> None:
        self.data = data
        """The payload, exactly as sent."""
        self.channel = channel
        """The channel it was sent on."""
        self.reliable = reliable
        """Whether it was sent reliably."""
        # The wire mode, kept as an int: the Delivery member is made when asked for.
        if delivery < 0:
            delivery = RELIABLE_ORDERED if reliable else UNRELIABLE
        self._mode = delivery

    @property
    def delivery(self) -> Delivery:
        """How it was sent (a ``rudp.Delivery``). A ``DEPENDENCY_ORDERED`` message
        arrives as ``RELIABLE_UNORDERED``: both are the same on the wire, and a message
        is delivered only once what it depended on was."""
        return Delivery(self._mode)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MessageReceived):
            return NotImplemented
        return (
            self.data == other.data
            and self.channel == other.channel
            and self.reliable == other.reliable
            and self._mode == other._mode
        )

    def __hash__(self) -> int:
        return hash((self.data, self.channel, self.reliable, self._mode))

    def __reduce__(self) -> tuple[type[MessageReceived], tuple[bytes, int, bool, int]]:
        # copy and pickle: a compiled (native) class cannot be rebuilt field by field.
        return MessageReceived, (self.data, self.channel, self.reliable, self._mode)

    def __repr__(self) -> str:
        return (
            f"MessageReceived(data={self.data!r}, channel={self.channel}, "
            f"reliable={self.reliable}, delivery=Delivery.{self.delivery.name})"
        )


@dataclass(frozen=True, slots=True)
class MessageAcked:
    """The peer acknowledged a reliable message whose sender asked to be told."""

    handle: Any
    """The object ``Connection.send`` returned."""


@dataclass(frozen=True, slots=True)
class PathChanged:
    """The peer moved to another address (a NAT rebinding, another network), which
    answered our path challenge; our packets go there from now on."""

    old: tuple[Any, ...]
    """The address it had."""
    address: tuple[Any, ...]
    """The address it has now (``Connection.address``)."""


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The connection ended. Nothing more will be delivered or sent."""

    reason: DisconnectReason
    """Why it ended."""
    code: int = 0
    """Application close code (graceful close only)."""
    text: str = ""
    """Application close text (graceful close only)."""
    by_peer: bool = False
    """True when the peer started the ending (its DISCONNECT, NOCONN or refusal)."""


@dataclass(frozen=True, slots=True)
class QueryReceived:
    """An unconnected QUERY arrived; answer with ``Endpoint.reply_query`` (optional)."""

    address: tuple[Any, ...]
    """Who asked."""
    nonce: int
    """Echo this in the reply."""
    payload: bytes
    """The application's request."""
    max_reply: int
    """The largest reply payload allowed (never larger than the request)."""


@dataclass(frozen=True, slots=True)
class QueryAnswered:
    """A reply to our ``Endpoint.query`` arrived."""

    address: tuple[Any, ...]
    """Who answered."""
    nonce: int
    """The nonce ``query()`` returned."""
    payload: bytes
    """The reply."""
    rtt: float
    """Seconds from the request to the reply."""


Event = Connected | MessageReceived | MessageAcked | PathChanged | Disconnected
EndpointEvent = QueryReceived | QueryAnswered
