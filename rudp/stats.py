"""Counters, kept as plain attributes on the hot path and read at scrape time."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from rudp.recovery import CongestionController, RttEstimator
    from rudp.wire import DropReason


COUNTERS: Final = (
    "bad_acks",
    "bytes_received",
    "bytes_sent",
    "congestion_events",
    "congestion_events_undone",
    "duplicate_messages",
    "eliciting_sent",
    "fragments_dropped",
    "messages_expired",
    "messages_redundant",
    "messages_superseded",
    "messages_received",
    "messages_resent",
    "messages_sent",
    "packets_dropped",
    "packets_lost",
    "packets_received",
    "packets_sent",
    "peer_pauses",
    "receive_pauses",
    "spurious_losses",
    "stale_messages",
    "timeouts",
)
"""The counters of ``ConnectionStats``, named once (not read from ``__slots__``,
which compiled builds do not expose)."""


class ConnectionStats:
    """Per-connection transport statistics (``Connection.stats``)."""

    __slots__ = (*COUNTERS, "cc", "rtt")

    def __init__(self) -> None:
        self.packets_sent = 0
        self.packets_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0
        self.messages_resent = 0
        self.eliciting_sent = 0
        self.packets_lost = 0
        self.packets_dropped = 0  # datagrams from this peer dropped (duplicate, stale, bad...)
        self.duplicate_messages = 0
        self.bad_acks = 0
        self.timeouts = 0
        self.spurious_losses = 0  # losses disproved by a late acknowledgment
        self.messages_expired = 0  # unreliable messages dropped for waiting too long to go out
        self.messages_redundant = 0  # extra copies sent by the redundancy option
        self.messages_superseded = 0  # reliable-sequenced messages replaced before their ack
        self.stale_messages = 0  # sequenced messages older than the newest delivered, dropped
        self.fragments_dropped = 0  # fragments inconsistent with the rest of their message
        self.receive_pauses = 0  # times we asked the peer to pause (our receive queue filled)
        self.peer_pauses = 0  # times the peer asked us to pause sending
        self.congestion_events = 0  # losses that shrank the congestion window
        self.congestion_events_undone = 0  # ... and proved spurious, so were undone
        self.rtt: RttEstimator | None = None
        self.cc: CongestionController | None = None

    @property
    def srtt(self) -> float:
        """Smoothed round-trip time in seconds (0 before the first sample)."""
        return self.rtt.srtt if self.rtt else 0.0

    @property
    def rttvar(self) -> float:
        """Round-trip time variation in seconds."""
        return self.rtt.rttvar if self.rtt else 0.0

    @property
    def min_rtt(self) -> float:
        return self.rtt.min_rtt if self.rtt else 0.0

    @property
    def rto(self) -> float:
        """The current resend timeout, backoff included."""
        return self.rtt.backed_off_rto if self.rtt else 0.0

    @property
    def congestion_window(self) -> int:
        """Bytes of ack-eliciting packets the congestion controller lets be in flight."""
        return self.cc.cwnd if self.cc else 0

    @property
    def random_losses(self) -> int:
        """Losses the congestion controller took for random, not congestion (no queue
        was building), so they left the window alone."""
        return self.cc.random_losses if self.cc else 0

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of ack-eliciting packets sent and neither acknowledged nor lost."""
        return self.cc.bytes_in_flight if self.cc else 0

    @property
    def loss_estimate(self) -> float:
        """Fraction of ack-eliciting packets declared lost."""
        return self.packets_lost / self.eliciting_sent if self.eliciting_sent else 0.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {n: getattr(self, n) for n in COUNTERS}
        out.update(
            srtt=self.srtt,
            rttvar=self.rttvar,
            rto=self.rto,
            loss_estimate=self.loss_estimate,
            congestion_window=self.congestion_window,
            bytes_in_flight=self.bytes_in_flight,
            random_losses=self.random_losses,
        )
        return out

    def __repr__(self) -> str:
        return f"ConnectionStats({self.as_dict()!r})"


class EndpointStats:
    """Per-socket statistics: traffic, drops by reason, handshakes."""

    __slots__ = (
        "bytes_received",
        "bytes_sent",
        "closed_totals",
        "connections_accepted",
        "connections_refused",
        "datagrams_received",
        "datagrams_sent",
        "dropped",
        "noconn_suppressed",
        "simultaneous_opens",
        "unvalidated_bytes_received",
        "unvalidated_bytes_sent",
    )

    def __init__(self) -> None:
        self.datagrams_received = 0
        self.datagrams_sent = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.dropped: Counter[DropReason] = Counter()
        self.unvalidated_bytes_received = 0
        self.unvalidated_bytes_sent = 0
        self.connections_accepted = 0
        self.connections_refused = 0
        # Handshakes that crossed our own CONNECT to the same peer and won the tie-break.
        self.simultaneous_opens = 0
        # NOCONN replies the token bucket held back (the datagram itself is counted
        # once, under its drop reason).
        self.noconn_suppressed = 0
        # Counters of connections that have ended, so exported totals never go back.
        self.closed_totals: Counter[str] = Counter()

    def absorb(self, conn: ConnectionStats) -> None:
        """Fold an ended connection's counters into the endpoint totals."""
        totals = self.closed_totals
        for name in COUNTERS:
            totals[name] += getattr(conn, name)

    @property
    def datagrams_dropped(self) -> int:
        return sum(self.dropped.values())
