"""Loss detection: round-trip time, the resend timeout, and which packets were lost.

Theory of operation
-------------------
Every ack-eliciting packet we send is remembered (``SentPacket``, in sending
order) until it is acknowledged or declared lost. Each DATA header we receive
acknowledges the peer's newest packet and, in a bitfield, the 32 before it
(``wire.ACK_SPAN``); ``PacketRecovery.on_ack_received`` walks it and tells the
connection, per packet, what became of it.

The seed article resends every 30 ms, then 60, 90... whatever the path. We
measure instead, as TCP does (RFC 6298): a smoothed RTT and its variance give
the resend timeout ``RTO = SRTT + max(4 * RTTVAR, SRTT / 8)``, clamped to
``[rto_min, rto_max]`` and doubled on each consecutive timeout (capped).

Karn's rule says never to take an RTT sample from a retransmitted packet,
because its ack is ambiguous. Our retransmissions are *messages* carried in new
packets with new sequence numbers, so every packet is sent exactly once and
every sample is unambiguous: Karn's rule holds by construction.

Loss is detected three ways (as in QUIC, RFC 9002):
- packet threshold: a packet is lost once ``reorder_threshold`` packets sent
  after it were acknowledged (the ack bitfield shows the gap: this is the NACK
  the article leaves as a TODO, with no extra packet type);
- time threshold: an unacknowledged packet sent 9/8 RTT before one that was
  acknowledged is lost;
- both thresholds widen when a loss proves spurious (a late packet's own ack
  arrives after it was declared lost), as RACK (RFC 8985) adapts to reordering,
  and the packet threshold also when a packet is acknowledged after a later one;
- on a path seen to reorder, packets of one flush (one send time) are lost only
  by time, RACK's way (``detect_losses``), and the loss timer waits for the tail
  of a burst;
- a tail-loss probe, for the tail of a burst where nothing later is acked
  (RFC 8985's TLP, the idea of RFC 9002's probe timeout): ``2 * SRTT`` plus the
  peer's ``max_ack_delay`` after the newest ack-eliciting packet, that packet's
  messages go out again in a new packet (the tail lost is most often the
  newest packet itself, which this repairs at once), or a PING if it carried
  none; the probe's acknowledgment shows what is missing before it, and the
  time threshold declares that lost. The newest packet leaves the flight
  without being declared lost (no loss counted, nothing told to congestion
  control; its late acknowledgment is ignored, its messages' copy answers for
  them); at most ``TAIL_PROBES`` probes go out per acknowledgment of new
  data, none while the resend timer backs off;
- the resend timeout, for the tail of a burst where nothing later is acked
  even after the probe: it declares only the oldest packet lost, and its resend
  probes the path. It runs from the newest ack-eliciting packet sent and allows
  for the peer's ``max_ack_delay`` (RFC 9002's probe timeout); RTT samples have
  the delay the peer reports (its ACK_DELAY frame) taken off.

Loss detection also keeps ``loss_rate``, an exponential average of the share of
ack-eliciting packets declared lost (spurious losses taken back), which the
packet builder's redundancy follows.

Every acknowledgment and loss is also reported to congestion control
(``congestion``), which decides how many bytes may be in flight.

Judgement call: what a packet's acknowledgment or loss *means* (its messages are
done or go back to a queue, a DISCONNECT was received, a PAUSE must be said
again) is the connection's business, so this module calls back
``Connection._on_packet_acked`` and ``_on_packet_lost`` per packet, as aioquic's
recovery calls each packet's delivery handlers. It never looks inside a packet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from rudp.config import Config
from rudp.congestion import GRANULARITY, CongestionController
from rudp.sending import OutMessage
from rudp.seqnum import unwrap
from rudp.wire import ACK_SPAN

if TYPE_CHECKING:
    from rudp.connection import Connection
    from rudp.stats import ConnectionStats

LOSS_WINDOW: Final = 256  # packet outcomes the loss rate averages over (an EWMA)
LOST_MEMORY: Final = 1024  # packets declared lost that are remembered to detect spurious losses
MAX_REORDER_THRESHOLD: Final = 256
# Packets of the 32 before an acknowledgment's newest that it shows missing, while still in
# flight, which make it evidence of reordering rather than loss.
REORDER_EVIDENCE: Final = 8
_NEVER: Final = float("inf")

# The peer acknowledges at the end of its event-loop turn, which on a loaded
# machine can take a few milliseconds: on loopback a bare 9/8 RTT would declare
# packets lost that are merely waiting for that turn to end.
LOSS_DELAY_FLOOR: Final = 0.005

# Tail-loss probes sent before an acknowledgment of new data allows another (RFC 8985
# sends one; the resend timeout takes over when its acknowledgment does not come).
TAIL_PROBES: Final = 1

# The least a tail-loss probe waits past ``2 * SRTT`` and the peer's ack delay: on a
# path of a millisecond, event-loop timers run later than that under load, and the
# probe would resend what merely waits for its acknowledgment (Linux's TLP keeps
# the same floor).
TAIL_PROBE_FLOOR: Final = 0.010


class RttEstimator:
    """RFC 6298 smoothed RTT, variance, RTO and backoff."""

    __slots__ = (
        "_max_backoff",
        "_rto_initial",
        "_rto_max",
        "_rto_min",
        "backoff",
        "latest",
        "min_rtt",
        "peer_ack_delay",
        "reorder_factor",
        "rttvar",
        "samples",
        "srtt",
    )

    def __init__(self, config: Config) -> None:
        # Copied out of the (interpreted) Config: read per packet, a native attribute
        # costs far less than a dataclass attribute lookup.
        self._rto_initial = config.rto_initial
        self._rto_min = config.rto_min
        self._rto_max = config.rto_max
        self._max_backoff = config.max_backoff
        # How long the peer may delay an acknowledgment (its max_ack_delay, from the
        # handshake): the resend timeout waits for it, as RFC 9002's PTO does.
        self.peer_ack_delay = 0.0
        self.reset()

    def reset(self) -> None:
        """No sample yet: a new connection, or the peer moved to another network path
        (RFC 9000, section 9.4); the peer's ack delay stays, it is the peer's."""
        self.srtt = 0.0
        self.rttvar = 0.0
        self.latest = 0.0
        self.min_rtt = 0.0
        self.samples = 0
        self.backoff = 0
        self.reorder_factor = 1.125  # RFC 9002's kTimeThreshold; widened on spurious losses

    def on_sample(self, rtt: float, ack_delay: float = 0.0) -> None:
        """One RTT sample; ``ack_delay`` is how long the peer says it held the ack back.

        As RFC 9002 (section 5.3): the minimum RTT takes the raw sample; the rest take
        it less the ack delay (at most the peer's ``max_ack_delay``), unless that would
        go below the minimum RTT.
        """
        rtt = max(rtt, 0.0)
        if self.samples == 0:
            self.latest = rtt
            self.srtt = rtt
            self.rttvar = rtt / 2
            self.min_rtt = rtt
        else:
            self.min_rtt = min(self.min_rtt, rtt)
            ack_delay = min(ack_delay, self.peer_ack_delay)
            if rtt - ack_delay >= self.min_rtt:
                rtt -= ack_delay
            self.latest = rtt
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.samples += 1

    @property
    def rto(self) -> float:
        """The resend timeout without backoff."""
        if self.samples == 0:
            base = self._rto_initial
        else:
            # The variance term never falls below SRTT/8: on a steady path RTTVAR
            # decays towards zero and an RTO equal to the RTT would fire just
            # before every ack (Linux keeps a similar floor under RTTVAR).
            base = self.srtt + max(GRANULARITY, 4 * self.rttvar, self.srtt / 8)
        return min(max(base, self._rto_min) + self.peer_ack_delay, self._rto_max)

    @property
    def backed_off_rto(self) -> float:
        return min(self.rto * (1 << self.backoff), self._rto_max)

    def on_timeout(self) -> None:
        self.backoff = min(self.backoff + 1, self._max_backoff)

    @property
    def loss_delay(self) -> float:
        """How long after a later packet was acked an earlier one counts as lost."""
        if self.samples == 0:
            return self._rto_initial
        return max(self.reorder_factor * max(self.srtt, self.latest), LOSS_DELAY_FLOOR)

    def widen_reorder_window(self) -> None:
        """A loss turned out spurious: wait longer before the time threshold fires."""
        self.reorder_factor = min(self.reorder_factor + 0.125, 2.0)


class SentPacket:
    """An ack-eliciting packet in flight."""

    __slots__ = ("control", "disconnect", "messages", "seq", "size", "time_sent")

    def __init__(
        self,
        seq: int,
        time_sent: float,
        messages: list[OutMessage],
        control: list[bytes],
        disconnect: bool,
        size: int,
    ) -> None:
        self.seq = seq
        self.time_sent = time_sent
        self.messages = messages
        self.control = control
        self.disconnect = disconnect
        self.size = size


class PacketRecovery:
    """The ack-eliciting packets in flight, and what became of each."""

    __slots__ = (
        "_cc",
        "_conn",
        "_stats",
        "in_flight",
        "largest_acked",
        "last_eliciting",
        "last_probe",
        "loss_rate",
        "loss_time",
        "lost_max",
        "lost_recently",
        "newest_acked_at",
        "newest_acked_sent",
        "probe_due",
        "reorder_threshold",
        "reordering",
        "rtt",
        "sent",
        "tail_probes",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self,
        conn: Connection,
        config: Config,
        stats: ConnectionStats,
        rtt: RttEstimator,
        cc: CongestionController,
        isn: int,
    ) -> None:
        self._conn = conn
        self._stats = stats
        self.rtt = rtt
        self._cc = cc
        self.sent: dict[int, SentPacket] = {}  # in sending order
        self.in_flight = 0
        self.largest_acked = isn - 1
        self.loss_time: float | None = None  # when the time threshold next fires
        self.last_probe = 0.0  # when the resend timer last fired
        self.last_eliciting = 0.0  # when the newest ack-eliciting packet went out
        self.probe_due = False  # a resend timeout's probe may exceed the congestion window
        self.tail_probes = 0  # tail-loss probes sent since new data was last acknowledged
        self.reorder_threshold = config.reorder_threshold  # widened by spurious losses
        self.lost_recently: dict[int, None] = {}  # seqs declared lost, to spot late acks
        self.lost_max = -1  # the newest packet ever declared lost
        # The acknowledged ack-eliciting packet sent last: when it was sent and when its
        # acknowledgment came (RACK's reference packet, RFC 8985; see detect_losses).
        self.newest_acked_sent = -1.0
        self.newest_acked_at = 0.0
        self.reordering = False  # the path was seen to reorder (sticky, as RACK's flag)
        # Share of recent ack-eliciting packets declared lost (not found spurious), an
        # exponential average over about LOSS_WINDOW outcomes: what redundancy follows.
        self.loss_rate = 0.0

    def on_packet_sent(self, pkt: SentPacket) -> None:
        self.sent[pkt.seq] = pkt
        self.last_eliciting = pkt.time_sent
        self.in_flight += 1
        self._cc.on_sent(pkt.size)
        self.probe_due = False

    def on_ack_received(
        self, ack16: int, bits: int, now: float, tx_next: int, ack_delay: float = 0.0
    ) -> bool:
        """Process a DATA header's acknowledgment; ``tx_next`` is the number our next
        packet will get, ``ack_delay`` how long the peer held the acknowledgment back
        (its ACK_DELAY frame). Returns whether it acknowledged anything new."""
        sent = self.sent
        largest = unwrap(ack16, tx_next - 1)
        if largest >= tx_next:
            self._stats.bad_acks += 1
            return False
        lost = self.lost_recently
        if not sent and not lost:
            return False
        newly = False
        if not self.reordering:
            self._look_for_reordering(largest, bits)
        # Every newly acknowledged packet gives an RTT sample: a packet number is used
        # once, so none is ambiguous, and sampling only the largest would leave out
        # exactly the slow packets that jitter overtakes, making RTTVAR (and so the
        # resend timeout) too small for the path.
        rtt = self.rtt
        pkt = sent.pop(largest, None)
        if pkt is not None:
            rtt.on_sample(now - pkt.time_sent, ack_delay)
            self._on_acked(pkt, now)
            newly = True
        elif largest in lost:
            self._on_spurious_loss(largest)
        # Walk the bits only as far back as a packet still in flight (``sent`` is in
        # sending order), or all 32 while a packet declared lost may be among them, so
        # that a late ack of one is seen (and the reordering it shows learnt). Most acks
        # then walk a few bits, not 32 (each costs a dict lookup).
        span = min(ACK_SPAN, largest - next(iter(sent))) if sent else 0
        if lost and self.lost_max >= largest - ACK_SPAN:
            span = ACK_SPAN
        i = 1
        while bits and i <= span:
            if bits & 1:
                seq = largest - i
                if seq in sent:
                    pkt = sent.pop(seq)
                    rtt.on_sample(now - pkt.time_sent, ack_delay)
                    self._on_acked(pkt, now)
                    newly = True
                    if seq < self.largest_acked:
                        self._on_reordered(seq)
                elif lost and seq in lost:
                    self._on_spurious_loss(seq)
            bits >>= 1
            i += 1
        if newly:
            rtt.backoff = 0
            self.tail_probes = 0
            if largest > self.largest_acked:
                self.largest_acked = largest
            self.detect_losses(now, tx_next)
        return newly

    def _look_for_reordering(self, largest: int, bits: int) -> None:
        """Whether this acknowledgment shows the path reordering: it newly acknowledges
        a packet older than one acknowledged before, or its newest packet overtook
        ``REORDER_EVIDENCE`` or more of the 32 before it that are still in flight (a
        path would have to lose all of them, yet not the newest)."""
        sent = self.sent
        if not sent:
            return
        # Only packets still in flight count; the oldest bounds the walk (``sent`` is
        # in packet-number order), so a thin stream costs a step or two per ack.
        span = min(ACK_SPAN, largest - next(iter(sent)))
        prior = self.largest_acked
        missing = 0
        for i in range(1, span + 1):
            seq = largest - i
            if seq in sent:
                if (bits >> (i - 1)) & 1:
                    if seq < prior:
                        self.reordering = True
                        return
                elif largest in sent:
                    missing += 1
        if missing >= REORDER_EVIDENCE:
            self.reordering = True

    def _on_reordered(self, seq: int) -> None:
        """Packet ``seq`` was acknowledged after a later one was: widen the packet
        threshold to that depth before it declares such a packet lost (as Linux does
        from SACK), not only once one proved a spurious loss."""
        self.reordering = True
        depth = self.largest_acked - seq + 1
        if depth > self.reorder_threshold:
            self.reorder_threshold = min(depth, MAX_REORDER_THRESHOLD)

    def flush_window(self) -> float:
        """On a path seen to reorder, how long after the acknowledgment of the newest
        acknowledged packet one sent in the same flush counts as lost: half an RTT or
        twice RTTVAR (the spread of the round trips), widened like the time threshold
        by spurious losses, at most an RTT."""
        rtt = self.rtt
        base = max(rtt.srtt, rtt.latest)
        window = max(2 * rtt.rttvar, base / 2) * rtt.reorder_factor / 1.125
        return min(window, base)

    def _on_acked(self, pkt: SentPacket, now: float) -> None:
        self.in_flight -= 1
        if pkt.time_sent > self.newest_acked_sent:
            self.newest_acked_sent = pkt.time_sent
            self.newest_acked_at = now
        self.loss_rate -= self.loss_rate / LOSS_WINDOW
        self._cc.on_acked(pkt.seq, pkt.size, now, self.rtt.srtt)
        self._conn._on_packet_acked(pkt)

    def detect_losses(self, now: float, tx_next: int) -> None:
        """Declare lost what the acknowledgments prove lost.

        A packet is lost past either threshold (``reorder_threshold`` later packets
        acknowledged, or ``loss_delay`` since it was sent). On a path seen to reorder,
        a packet sent in the same flush as the newest acknowledged one (one send time:
        the packets of a flush race each other through the jitter) is never proved
        lost by a packet count, only by time, ``flush_window`` after that packet's
        acknowledgment, as RACK (RFC 8985) orders packets by send time. Without this,
        the first acknowledgment of a window sent in one flush on a reordering path
        declares every packet it overtook lost. (That acknowledgment is itself the
        evidence of reordering: see ``_look_for_reordering``.) A path not seen to
        reorder keeps the thresholds alone: a gap there is a loss.

        On a path seen to reorder, the loss timer is armed only when no
        acknowledgment of a later packet is expected before the deadline (the tail of
        a burst): otherwise that acknowledgment runs this again, and a timer armed on
        every acknowledgment (each moves the deadline of the oldest packet in flight,
        which the jitter holds back) would mostly wake for a packet acknowledged
        meanwhile. Without reordering, a gap is a loss and the timer is armed as the
        thresholds say.
        """
        largest = self.largest_acked
        rtt = self.rtt
        delay = rtt.loss_delay
        threshold = largest - self.reorder_threshold
        reordering = self.reordering
        # No packet is a flush-mate (sent at or after this) on a path not seen to reorder.
        flush = self.newest_acked_sent if reordering else _NEVER
        flush_deadline = self.newest_acked_at + self.flush_window()
        self.loss_time = None
        lost: list[int] = []
        for seq, pkt in self.sent.items():
            if seq >= largest:
                break
            # One expression for the test and the deadline: a deadline computed
            # differently could round to ``now`` and never be reached.
            sent_at = pkt.time_sent
            deadline = flush_deadline if sent_at >= flush else sent_at + delay
            if deadline <= now or (seq <= threshold and sent_at < flush):
                lost.append(seq)
            else:
                if not reordering or self.last_eliciting + rtt.srtt < deadline:
                    self.loss_time = deadline
                break
        for seq in lost:
            self._on_lost(self.sent.pop(seq), tx_next)

    def _on_spurious_loss(self, seq: int) -> None:
        """A packet we declared lost was acknowledged after all: the path reorders.

        Widen the packet and time thresholds to the reordering we saw (as RACK,
        RFC 8985, adapts its reordering window), so it stops causing resends.
        """
        del self.lost_recently[seq]
        self._stats.spurious_losses += 1
        self.loss_rate = max(0.0, self.loss_rate - 1.0 / LOSS_WINDOW)
        if self._cc.on_spurious_loss(seq):
            self._stats.congestion_events_undone += 1
        depth = self.largest_acked - seq + 1
        self.reorder_threshold = min(max(self.reorder_threshold, depth), MAX_REORDER_THRESHOLD)
        self.rtt.widen_reorder_window()

    def on_recovered(self, count: int) -> None:
        """The peer rebuilt ``count`` more of our packets from parity (``rudp.parity``):
        they were acknowledged, but they were lost, and parity is sized to the loss."""
        for _ in range(min(count, LOSS_WINDOW)):
            self.loss_rate += (1.0 - self.loss_rate) / LOSS_WINDOW

    def _on_lost(self, pkt: SentPacket, tx_next: int) -> None:
        self.in_flight -= 1
        self._stats.packets_lost += 1
        self.loss_rate += (1.0 - self.loss_rate) / LOSS_WINDOW
        rtt = self.rtt
        if self._cc.on_lost(pkt.seq, pkt.size, tx_next, rtt.min_rtt, rtt.latest):
            self._stats.congestion_events += 1
        lost = self.lost_recently
        lost[pkt.seq] = None
        if pkt.seq > self.lost_max:
            self.lost_max = pkt.seq
        if len(lost) > LOST_MEMORY:
            del lost[next(iter(lost))]
        self._conn._on_packet_lost(pkt)

    def probe_deadline(self) -> float:
        """When the probe timer fires: the tail-loss probe's deadline if one is allowed
        and comes first (``tail_probe_deadline``), else the resend timeout's
        (``resend_deadline``)."""
        return min(self.tail_probe_deadline(), self.resend_deadline())

    def resend_deadline(self) -> float:
        """When the resend timer fires: one backed-off RTO after the newest ack-eliciting
        packet was sent (RFC 9002's probe timeout, section 6.2.1), or after the last
        probe if that was later (after an outage, one probe per backed-off RTO).

        Armed from the newest packet, not the oldest: while packets keep going out,
        the acknowledgments of later ones find a loss (the packet and time thresholds)
        first. The backed-off RTO includes the peer's ``max_ack_delay``, so a delayed
        acknowledgment does not fire it."""
        return max(self.last_eliciting, self.last_probe) + self.rtt.backed_off_rto

    def tail_probe_deadline(self) -> float:
        """When a tail-loss probe is due: ``2 * SRTT`` (at least ``TAIL_PROBE_FLOOR``)
        plus the peer's ``max_ack_delay`` after the newest ack-eliciting packet (RFC
        8985, section 7.2: long enough that the acknowledgment of a packet that
        arrived would have come), or never: before
        the first RTT sample, once ``TAIL_PROBES`` went out with no new data
        acknowledged since, and while the resend timer backs off (it probes then)."""
        rtt = self.rtt
        if self.tail_probes >= TAIL_PROBES or rtt.backoff or not rtt.samples:
            return _NEVER
        return self.last_eliciting + max(2 * rtt.srtt, TAIL_PROBE_FLOOR) + rtt.peer_ack_delay

    def on_timer(self, now: float, tx_next: int) -> bool:
        """The loss timers; returns whether a probe is due (the tail-loss probe's or the
        resend timer's: the connection sends an ack-eliciting packet either way)."""
        if self.loss_time is not None and now >= self.loss_time:
            self.detect_losses(now, tx_next)
        if not self.sent:
            return False
        if now < self.resend_deadline():
            if now < self.tail_probe_deadline():
                return False
            # Nothing is declared lost: the probe's acknowledgment shows the gap, and
            # detect_losses declares what it proves lost, as for any acknowledgment.
            self.tail_probes += 1
            self._stats.tail_probes += 1
            self._resend_newest()
            return True
        # Only the oldest packet is declared lost: its messages go out again as a
        # probe. Declaring every expired packet lost at once turns a queue that grew
        # faster than the RTO estimate into a resend storm; once the probe is
        # acknowledged, the packet threshold finds any real losses behind it (RFC
        # 9002's probe timeout works the same way).
        first = next(iter(self.sent.values()))
        self._stats.timeouts += 1
        if self.rtt.backoff >= 1:
            # Two timeouts in a row: nothing acknowledged for three RTOs, so the path
            # is congested or gone (RFC 9002's persistent congestion).
            self._cc.on_persistent_congestion(tx_next)
        self._on_lost(self.sent.pop(first.seq), tx_next)
        self.probe_due = True
        self.last_probe = now
        self.rtt.on_timeout()
        return True

    def _resend_newest(self) -> None:
        """A tail-loss probe's content: the newest packet's messages, if it carried
        messages and nothing else (control frames keep their own resend rules), sent
        again in a new packet that may exceed the congestion window. The packet
        leaves the flight unjudged: a late acknowledgment of it is ignored."""
        pkt = self.sent[next(reversed(self.sent))]
        if not pkt.messages or pkt.control or pkt.disconnect:
            return  # the PING the connection adds is the probe
        del self.sent[pkt.seq]
        self.in_flight -= 1
        self._cc.on_abandoned(pkt.size)
        self._conn._on_packet_resent(pkt)
        self.probe_due = True

    def clear(self) -> None:
        """The connection ended: nothing is in flight any more."""
        self.sent.clear()
        self.in_flight = 0
        self._cc.reset_flight()
