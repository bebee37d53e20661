"""Counters, kept as plain attributes on the hot path and read at scrape time.

Every connection counter is named once, in ``COUNTER_TABLE``, with what it
counts and the Prometheus counter that exports it (``metrics`` reads the table);
``ConnectionStats`` declares one attribute per entry. The endpoint's counters
are named once likewise, in ``ENDPOINT_COUNTER_TABLE``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from rudp.congestion import CongestionController
    from rudp.recovery import RttEstimator
    from rudp.wire import DropReason


# Every counter of ``ConnectionStats``, named once: (attribute, what it counts, the
# Prometheus counter that exports it or "" if none). ``metrics`` exports from this
# table, and ended connections are folded into endpoint totals by it.
COUNTER_TABLE: Final = (
    ("bad_acks", "Acknowledgments of packets never sent, ignored.", ""),
    ("bytes_received", "Bytes of DATA packets accepted.", ""),
    ("bytes_sent", "Bytes of DATA packets sent.", ""),
    (
        "congestion_events",
        "Losses that shrank the congestion window (one per round trip of losses).",
        "rudp_congestion_events_total",
    ),
    ("congestion_events_undone", "Congestion events undone: the loss proved spurious.", ""),
    ("duplicate_messages", "Messages received again, dropped.", ""),
    ("eliciting_sent", "Ack-eliciting packets sent.", ""),
    (
        "fragments_dropped",
        "Fragments inconsistent with the rest of their message, dropped.",
        "rudp_fragments_dropped_total",
    ),
    (
        "messages_expired",
        "Unreliable messages dropped for waiting too long in the send queue.",
        "rudp_expired_messages_total",
    ),
    (
        "messages_redundant",
        "Extra copies of reliable messages sent by the redundancy option.",
        "rudp_redundant_messages_total",
    ),
    (
        "messages_superseded",
        "Reliable-sequenced messages replaced by a newer one before their ack.",
        "rudp_superseded_messages_total",
    ),
    ("messages_received", "Messages delivered.", "rudp_messages_received_total"),
    ("messages_resent", "Reliable messages sent again.", "rudp_retransmissions_total"),
    ("messages_sent", "Messages sent for the first time.", "rudp_messages_sent_total"),
    ("packets_dropped", "Datagrams from this peer dropped (duplicate, stale, bad...).", ""),
    ("packets_lost", "Ack-eliciting packets declared lost.", "rudp_packets_lost_total"),
    ("packets_received", "DATA packets accepted.", "rudp_packets_received_total"),
    ("packets_sent", "DATA packets sent.", "rudp_packets_sent_total"),
    (
        "peer_pauses",
        "Times the peer asked us to pause sending (its receive queue was full).",
        "rudp_peer_pauses_total",
    ),
    (
        "receive_pauses",
        "Times a full receive queue asked the peer to pause sending (flow control).",
        "rudp_receive_pauses_total",
    ),
    ("spurious_losses", "Losses disproved by a late acknowledgment.", ""),
    ("stale_messages", "Sequenced messages older than the newest delivered, dropped.", ""),
    ("timeouts", "Resend timer expirations.", "rudp_resend_timeouts_total"),
)
COUNTERS: Final = tuple(name for name, _, _ in COUNTER_TABLE)
"""The counters of ``ConnectionStats`` (not read from ``__slots__``, which compiled
builds do not expose)."""


class ConnectionStats:
    """Per-connection transport statistics (``Connection.stats``)."""

    __slots__ = (*COUNTERS, "cc", "rtt")

    def __init__(self) -> None:
        # One per name in COUNTER_TABLE, which says what each counts.
        self.bad_acks = 0
        self.bytes_received = 0
        self.bytes_sent = 0
        self.congestion_events = 0
        self.congestion_events_undone = 0
        self.duplicate_messages = 0
        self.eliciting_sent = 0
        self.fragments_dropped = 0
        self.messages_expired = 0
        self.messages_redundant = 0
        self.messages_superseded = 0
        self.messages_received = 0
        self.messages_resent = 0
        self.messages_sent = 0
        self.packets_dropped = 0
        self.packets_lost = 0
        self.packets_received = 0
        self.packets_sent = 0
        self.peer_pauses = 0
        self.receive_pauses = 0
        self.spurious_losses = 0
        self.stale_messages = 0
        self.timeouts = 0
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


# Every plain counter of ``EndpointStats``, named once: (attribute, what it counts,
# the Prometheus counter that exports it). Drops by reason are a labelled family
# of their own (``rudp_datagrams_dropped_total``).
ENDPOINT_COUNTER_TABLE: Final = (
    ("datagrams_received", "Datagrams read from the socket.", "rudp_datagrams_received_total"),
    ("datagrams_sent", "Datagrams written to the socket.", "rudp_datagrams_sent_total"),
    ("bytes_received", "Bytes read from the socket.", "rudp_received_bytes_total"),
    ("bytes_sent", "Bytes written to the socket.", "rudp_sent_bytes_total"),
    ("connections_accepted", "Handshakes accepted.", "rudp_connections_accepted_total"),
    ("connections_refused", "Handshakes refused.", "rudp_connections_refused_total"),
    (
        "simultaneous_opens",
        "Handshakes that crossed our own CONNECT to the same peer and won the tie-break.",
        "rudp_simultaneous_opens_total",
    ),
    (
        "source_connections_refused",
        "Handshakes refused: their source (IPv4 address, IPv6 /64) held its share of connections.",
        "rudp_source_connections_refused_total",
    ),
    (
        "source_handshakes_limited",
        "Handshakes left unanswered: their source started more than its rate allows.",
        "rudp_source_handshakes_limited_total",
    ),
    (
        "noconn_suppressed",
        "NOCONN replies held back by the rate limit.",
        "rudp_noconn_suppressed_total",
    ),
    (
        "unvalidated_bytes_received",
        "Bytes from addresses with no connection.",
        "rudp_unvalidated_received_bytes_total",
    ),
    (
        "unvalidated_bytes_sent",
        "Bytes sent to addresses with no connection (never more than received).",
        "rudp_unvalidated_sent_bytes_total",
    ),
)


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
        "source_connections_refused",
        "source_handshakes_limited",
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
        # Handshakes refused or left unanswered by the per-source limits
        # (the refused ones are in connections_refused too).
        self.source_connections_refused = 0
        self.source_handshakes_limited = 0
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
