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
    from rudp.pmtu import PathMtu
    from rudp.protection import ReplayWindow
    from rudp.recovery import RttEstimator
    from rudp.wire import DropReason


# Every counter of ``ConnectionStats``, named once: (attribute, what it counts, the
# Prometheus counter that exports it or "" if none). ``metrics`` exports from this
# table, and ended connections are folded into endpoint totals by it.
COUNTER_TABLE: Final = (
    ("acks_alone", "Packets sent carrying nothing but an acknowledgment.", ""),
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
    (
        "migrations",
        "Times the peer moved to a new address that answered our path challenge.",
        "rudp_migrations_total",
    ),
    (
        "mtu_black_holes",
        "Times the datagram size fell back to the base: larger packets stopped arriving.",
        "",
    ),
    ("mtu_probes_lost", "Path MTU probes lost (or refused by the local interface).", ""),
    ("mtu_probes_sent", "Path MTU probes sent (padded packets of the size tried).", ""),
    ("packets_dropped", "Datagrams from this peer dropped (duplicate, stale, bad...).", ""),
    ("packets_lost", "Ack-eliciting packets declared lost.", "rudp_packets_lost_total"),
    ("packets_received", "DATA packets accepted.", "rudp_packets_received_total"),
    (
        "packets_recovered",
        "The peer's lost packets rebuilt from its REPAIR frames (counted as received too).",
        "",
    ),
    ("packets_sent", "DATA packets sent.", "rudp_packets_sent_total"),
    (
        "path_challenges",
        "PATH_CHALLENGEs sent to a peer's new address (first tries and resends).",
        "rudp_path_challenges_total",
    ),
    ("path_responses", "PATH_RESPONSEs sent: challenges of the peer answered.", ""),
    (
        "path_validation_failures",
        "New peer addresses given up on: challenges unanswered, or the peer stayed.",
        "rudp_path_validation_failures_total",
    ),
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
    ("repairs_sent", "REPAIR frames sent (parity over recent packets).", ""),
    ("repairs_unusable", "The peer's REPAIR frames that rebuilt nothing valid, dropped.", ""),
    ("spurious_losses", "Losses disproved by a late acknowledgment.", ""),
    ("stale_messages", "Sequenced messages older than the newest delivered, dropped.", ""),
    (
        "tail_probes",
        "Tail-loss probes: the newest packet resent (or a PING) when unacknowledged for 2 RTT.",
        "rudp_tail_probes_total",
    ),
    ("timeouts", "Resend timer expirations (probe timeouts).", "rudp_resend_timeouts_total"),
    (
        "timer_wakeups",
        "Times the connection's timer ran (resend, loss, delayed ack, keepalive, close).",
        "",
    ),
)
COUNTERS: Final = tuple(name for name, _, _ in COUNTER_TABLE)

# The byte rates: when it sends or receives, the connection samples its byte counters
# once SAMPLE_INTERVAL seconds have passed since the last sample; the rates are the
# change over that interval (longer while the traffic is sparse: a silent connection
# still pings every keepalive interval, so they come down within a few seconds).
SAMPLE_INTERVAL: Final = 1.0
# The recent inbound loss is read over this many of the peer's latest packet numbers
# (at most the replay window's 1,024): a few seconds of a game's traffic.
RECENT_PACKETS: Final = 256
"""The counters of ``ConnectionStats`` (not read from ``__slots__``, which compiled
builds do not expose)."""


class ConnectionStats:
    """Per-connection transport statistics (``Connection.stats``)."""

    __slots__ = (
        *COUNTERS,
        "_sampled_at",
        "_sampled_received",
        "_sampled_sent",
        "cc",
        "pmtu",
        "receive_rate",
        "rtt",
        "sample_due",
        "send_rate",
        "window",
    )

    def __init__(self) -> None:
        # One per name in COUNTER_TABLE, which says what each counts.
        self.acks_alone = 0
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
        self.migrations = 0
        self.mtu_black_holes = 0
        self.mtu_probes_lost = 0
        self.mtu_probes_sent = 0
        self.packets_dropped = 0
        self.packets_lost = 0
        self.packets_received = 0
        self.packets_recovered = 0
        self.packets_sent = 0
        self.path_challenges = 0
        self.path_responses = 0
        self.path_validation_failures = 0
        self.peer_pauses = 0
        self.receive_pauses = 0
        self.repairs_sent = 0
        self.repairs_unusable = 0
        self.spurious_losses = 0
        self.stale_messages = 0
        self.tail_probes = 0
        self.timeouts = 0
        self.timer_wakeups = 0
        self.rtt: RttEstimator | None = None
        self.cc: CongestionController | None = None
        self.pmtu: PathMtu | None = None
        # The replay window of the packets we open (set by the handshake): not the
        # packet reader, which points back to its connection (see Connection._release).
        self.window: ReplayWindow | None = None
        # The byte counters at the last sample, and the rates measured up to it.
        self.sample_due = 0.0
        self._sampled_at = -1.0
        self._sampled_sent = 0
        self._sampled_received = 0
        self.send_rate = 0.0
        """Bytes per second of DATA packets sent, over the last second or so."""
        self.receive_rate = 0.0
        """Bytes per second of DATA packets received, over the last second or so."""

    def sample(self, now: float) -> None:
        """Measure the byte rates since the last sample (the connection calls it, at
        most every ``SAMPLE_INTERVAL`` seconds, when it sends or receives)."""
        elapsed = now - self._sampled_at
        if self._sampled_at >= 0 and elapsed > 0:
            self.send_rate = (self.bytes_sent - self._sampled_sent) / elapsed
            self.receive_rate = (self.bytes_received - self._sampled_received) / elapsed
        self._sampled_at = now
        self._sampled_sent = self.bytes_sent
        self._sampled_received = self.bytes_received
        self.sample_due = now + SAMPLE_INTERVAL

    def _window(self) -> tuple[int, int, int]:
        """(packets the peer sent us so far, of which arrived, the replay bits)."""
        window = self.window
        if window is None:
            return 0, 0, 0
        return window.largest + 1, window.accepted, window.bits

    @property
    def packets_missing(self) -> int:
        """The peer's packets that have not arrived: the gaps in its packet numbers up
        to the newest received. Every packet counts, unreliable-only and ack-only ones
        too; a packet reordered behind later ones counts until it arrives."""
        sent, arrived, _ = self._window()
        return max(0, sent - arrived)

    @property
    def inbound_loss(self) -> float:
        """Fraction of the peer's packets that never arrived (``packets_missing`` over
        the packets it sent us), since the connection opened."""
        sent, arrived, _ = self._window()
        return max(0, sent - arrived) / sent if sent else 0.0

    @property
    def recent_inbound_loss(self) -> float:
        """``inbound_loss`` over the peer's latest ``RECENT_PACKETS`` (256) packet numbers."""
        sent, _, bits = self._window()
        span = min(sent, RECENT_PACKETS)
        if span == 0:
            return 0.0
        arrived = (bits & ((1 << span) - 1)).bit_count()
        return (span - arrived) / span

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
    def path_mtu(self) -> int:
        """The datagram size the path is known to carry (path MTU discovery), in bytes
        of UDP payload: what datagrams are filled to."""
        return self.pmtu.current if self.pmtu else 0

    @property
    def loss_estimate(self) -> float:
        """Fraction of our ack-eliciting packets declared lost (the outbound path, as
        the reliable traffic measures it; ``inbound_loss`` counts every packet the
        peer sent us)."""
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
            packets_missing=self.packets_missing,
            inbound_loss=self.inbound_loss,
            recent_inbound_loss=self.recent_inbound_loss,
            send_rate=self.send_rate,
            receive_rate=self.receive_rate,
            path_mtu=self.path_mtu,
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
    ("tokens_accepted", "Connect tokens verified and spent.", "rudp_tokens_accepted_total"),
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
    (
        "send_buffer_drops",
        "Datagrams dropped because the socket's send buffer was full (reliable data is resent).",
        "rudp_send_buffer_drops_total",
    ),
    (
        "send_errors",
        "Datagrams the socket refused to send (ICMP errors and send failures).",
        "rudp_send_errors_total",
    ),
    (
        "datagrams_too_large",
        "Datagrams refused by the socket as larger than the path allows (EMSGSIZE).",
        "rudp_datagrams_too_large_total",
    ),
    (
        "queries_unanswered",
        "Query replies withheld because they were larger than the query.",
        "rudp_queries_unanswered_total",
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
        "datagrams_too_large",
        "dropped",
        "noconn_suppressed",
        "queries_unanswered",
        "send_buffer_drops",
        "send_errors",
        "simultaneous_opens",
        "source_connections_refused",
        "source_handshakes_limited",
        "tokens_accepted",
        "tokens_refused",
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
        # Connect tokens (``rudp.tokens``): accepted, and refused by reason (each refusal
        # is answered with a REJECT naming it).
        self.tokens_accepted = 0
        self.tokens_refused: Counter[str] = Counter()
        # What the socket layer (``rudp.aio``) could not send: a full send buffer,
        # send and ICMP errors, EMSGSIZE; and query replies withheld as larger than
        # their query.
        self.send_buffer_drops = 0
        self.send_errors = 0
        self.datagrams_too_large = 0
        self.queries_unanswered = 0
        # Counters of connections that have ended, so exported totals never go back.
        self.closed_totals: Counter[str] = Counter()

    def absorb(self, conn: ConnectionStats) -> None:
        """Fold an ended connection's counters into the endpoint totals."""
        totals = self.closed_totals
        for name in COUNTERS:
            # Most of a short connection's counters are zero: no dict update for them.
            value = getattr(conn, name)
            if value:
                totals[name] += value

    @property
    def datagrams_dropped(self) -> int:
        return sum(self.dropped.values())

    def __repr__(self) -> str:
        counters = ", ".join(
            f"{name}={getattr(self, name)}" for name, _, _ in ENDPOINT_COUNTER_TABLE
        )
        dropped = {str(reason): n for reason, n in self.dropped.items()}
        return f"EndpointStats({counters}, dropped={dropped!r})"
