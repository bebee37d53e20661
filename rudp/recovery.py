"""Round-trip estimation, resend timeout and the records loss detection works on.

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
  arrives after it was declared lost), as RACK (RFC 8985) adapts to reordering;
- the resend timeout, for the tail of a burst where nothing later is acked:
  it declares only the oldest packet lost, and its resend probes the path.

How much may be in flight is the smaller of ``Config.window`` packets and a
NewReno congestion window (``CongestionController``), so that a sender on a
slower path stops losing packets in the bottleneck's queue instead of resending
at the rate that filled it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from typing import Any, Final, Protocol

from rudp.config import Config

# The asyncio layer reads UNRELIABLE_MODES here.
from rudp.wire import UNRELIABLE_MODES as UNRELIABLE_MODES

GRANULARITY: Final = 0.001  # clock granularity floor for timers (RFC 9002's kGranularity)
# The peer acknowledges at the end of its event-loop turn, which on a loaded
# machine can take a few milliseconds: on loopback a bare 9/8 RTT would declare
# packets lost that are merely waiting for that turn to end.
LOSS_DELAY_FLOOR: Final = 0.005
NO_SSTHRESH: Final = 1 << 62  # slow start until the first loss
RATE_SAMPLES: Final = 8  # delivery-rate samples (one per RTT or more) a loss looks back on
# A loss is taken for random, not congestion, while the latest RTT is within this
# fraction of the minimum RTT (no queue is building) and the losses of the current
# rate sample stay within RANDOM_LOSS_SHARE of the window (at least two datagrams).
QUEUE_FREE_FRACTION: Final = 0.125
RANDOM_LOSS_SHARE: Final = 16  # a sixteenth


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
        self.srtt = 0.0
        self.rttvar = 0.0
        self.latest = 0.0
        self.min_rtt = 0.0
        self.samples = 0
        self.backoff = 0
        self.reorder_factor = 1.125  # RFC 9002's kTimeThreshold; widened on spurious losses

    def on_sample(self, rtt: float) -> None:
        rtt = max(rtt, 0.0)
        self.latest = rtt
        if self.samples == 0:
            self.srtt = rtt
            self.rttvar = rtt / 2
            self.min_rtt = rtt
        else:
            self.min_rtt = min(self.min_rtt, rtt)
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
        return min(max(base, self._rto_min), self._rto_max)

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


class CongestionController:
    """Congestion control in bytes of ack-eliciting packets: NewReno's window
    (RFC 9002 section 7) with Westwood+'s answer to a loss.

    The window starts at ten datagrams (RFC 9002's initial window). While it is in
    use, each acknowledged byte adds a byte (slow start, doubling per round trip)
    until ``ssthresh``, then each window's worth of acknowledged bytes adds one
    datagram (congestion avoidance).

    A loss does not simply halve the window, as NewReno's does: that treats every
    loss as congestion, and a path that loses packets at random (a radio link, say)
    would cut a reliable transfer to a fraction of what it carries. Instead, as
    TCP Westwood+ does, the window becomes what the path has been delivering: the
    best delivery rate of the last few round trips (bytes acknowledged per smoothed
    RTT) times the minimum RTT. Behind a bottleneck that is its capacity times the
    bare round trip, so the queue the sender built drains; on a path that only
    loses packets at random it is about the window already in use, which is kept.
    Before the first rate sample a loss halves the window.

    A loss is not congestion at all when nothing queues: while the latest RTT is
    within an eighth of the minimum RTT, a full queue cannot be why a packet went
    missing, so such a loss leaves the window alone (``random_losses`` counts them;
    TCP Veno tells the two kinds apart the same way). Only a few are taken for
    random per rate sample, at most a sixteenth of the window (and at least two
    datagrams): a sender that overflows a queue too shallow to show in the RTT loses
    more than that in one round trip, and the rest of those losses count.

    A loss begins a recovery period: losses of packets sent before it began are the
    same congestion event, and their acks do not grow the window. Periods are told
    apart by packet number, not time, so a packet sent in the very instant a period
    began is never mistaken for an older one. A loss that proves spurious (the
    packet is acknowledged after all) is undone, as Linux does. Persistent
    congestion drops the window to two datagrams.

    An application-limited sender (less than half the window in flight at any time
    in the last round trip or two, like a game sending a few small messages per
    tick) does not grow the window: growth would
    only record that the path was never tested.
    """

    __slots__ = (
        "_acc",
        "_flight_peak",
        "_flight_peak_prev",
        "_max_datagram",
        "_max_window",
        "_min_window",
        "_rate_next",
        "_rates",
        "_round_acked",
        "_round_lost",
        "_round_start",
        "_undo_cwnd",
        "_undo_recovery",
        "_undo_seq",
        "_undo_ssthresh",
        "bytes_in_flight",
        "cwnd",
        "enabled",
        "random_losses",
        "recovery_seq",
        "ssthresh",
    )

    def __init__(self, config: Config) -> None:
        size = config.max_datagram_size
        self._max_datagram = size
        self._min_window = 2 * size
        self._max_window = config.window * size
        self.enabled = config.congestion_control
        initial = min(10 * size, max(14720, 2 * size))
        self.cwnd = min(initial, self._max_window) if self.enabled else self._max_window
        self.ssthresh = NO_SSTHRESH
        self.bytes_in_flight = 0
        # The most in flight this sample round and the last: the window was in use
        # (worth growing) if either reached half of it.
        self._flight_peak = 0
        self._flight_peak_prev = 0
        self.recovery_seq = 0  # packets numbered below it were sent before recovery began
        self._acc = 0  # bytes acknowledged towards the next congestion-avoidance step
        self._round_start = -1.0  # when the current delivery-rate sample began
        self._round_acked = 0
        self._round_lost = 0  # bytes lost during the current rate sample
        self.random_losses = 0  # losses taken for random, not congestion
        self._rates = [0.0] * RATE_SAMPLES  # the last delivery-rate samples, bytes/s
        self._rate_next = 0
        self._undo_seq = -1  # the packet whose loss began the current recovery
        self._undo_cwnd = 0
        self._undo_ssthresh = 0
        self._undo_recovery = 0

    def can_send(self) -> bool:
        """Whether another packet of reliable data may go out (it may overshoot the
        window by less than one datagram)."""
        return self.bytes_in_flight < self.cwnd

    def on_sent(self, size: int) -> None:
        in_flight = self.bytes_in_flight + size
        self.bytes_in_flight = in_flight
        if in_flight > self._flight_peak:
            self._flight_peak = in_flight

    def on_acked(self, seq: int, size: int, now: float, srtt: float) -> None:
        self.bytes_in_flight -= size
        if not self.enabled:
            return
        # Delivery rate: bytes acknowledged over at least one smoothed RTT.
        start = self._round_start
        if start < 0.0:
            self._round_start = now
        else:
            self._round_acked += size
            elapsed = now - start
            if elapsed >= srtt and elapsed >= GRANULARITY:
                self._rates[self._rate_next] = self._round_acked / elapsed
                self._rate_next = (self._rate_next + 1) % RATE_SAMPLES
                self._round_start = now
                self._round_acked = 0
                self._round_lost = 0
                self._flight_peak_prev = self._flight_peak
                self._flight_peak = self.bytes_in_flight
        if seq < self.recovery_seq:
            return
        if 2 * max(self._flight_peak, self._flight_peak_prev) < self.cwnd:
            return  # application-limited
        cwnd = self.cwnd
        if cwnd < self.ssthresh:
            cwnd += size
        else:
            self._acc += size
            if self._acc >= cwnd:
                self._acc -= cwnd
                cwnd += self._max_datagram
        self.cwnd = min(cwnd, self._max_window)

    def on_lost(
        self, seq: int, size: int, next_seq: int, min_rtt: float, latest_rtt: float
    ) -> bool:
        """A packet was declared lost; ``next_seq`` is the number the next packet will
        get. Returns whether this began a congestion event (a new recovery period)."""
        self.bytes_in_flight -= size
        if seq < self.recovery_seq or not self.enabled:
            return False
        if 2 * max(self._flight_peak, self._flight_peak_prev) < self.cwnd:
            # Application-limited: the loss says nothing about the window, and the
            # rate samples only measure the application. Shrinking here would leave a
            # game's later bulk transfer starting from two datagrams.
            return False
        lost = self._round_lost + size
        self._round_lost = lost
        if (
            min_rtt > 0.0
            and latest_rtt - min_rtt <= min_rtt * QUEUE_FREE_FRACTION
            and lost <= max(self.cwnd // RANDOM_LOSS_SHARE, self._min_window)
        ):
            self.random_losses += 1
            return False
        self._undo_seq = seq
        self._undo_cwnd = self.cwnd
        self._undo_ssthresh = self.ssthresh
        self._undo_recovery = self.recovery_seq
        self.recovery_seq = next_seq
        rate = max(self._rates)
        target = int(rate * min_rtt) if rate > 0.0 and min_rtt > 0.0 else self.cwnd // 2
        self.ssthresh = max(target, self._min_window)
        self.cwnd = min(self.cwnd, self.ssthresh)
        self._acc = 0
        return True

    def on_spurious_loss(self, seq: int) -> bool:
        """A packet declared lost was acknowledged: if its loss began the current
        recovery, that congestion event never happened. Returns whether it was undone."""
        if seq != self._undo_seq:
            return False
        self._undo_seq = -1
        self.cwnd = max(self.cwnd, self._undo_cwnd)
        self.ssthresh = self._undo_ssthresh
        self.recovery_seq = self._undo_recovery
        return True

    def on_persistent_congestion(self, next_seq: int) -> None:
        """Nothing was acknowledged over several resend timeouts: start again from
        the minimum window (slow start back up to ``ssthresh``)."""
        if not self.enabled:
            return
        self.cwnd = self._min_window
        self.recovery_seq = next_seq
        self._undo_seq = -1
        self._acc = 0

    def reset_flight(self) -> None:
        """Everything in flight was forgotten (the connection ended)."""
        self.bytes_in_flight = 0


# Message states, plain ints: they are compared on every ack. A message is
# pending while its state is <= SENT.
QUEUED: Final = 0
SENT: Final = 1
ACKED: Final = 2
FAILED: Final = 3
SUPERSEDED: Final = 4  # reliable-sequenced: a newer message on its channel replaced it


class Waiter(Protocol):
    """What makes a handle awaitable: the I/O layer's connection (the asyncio
    ``rudp.Connection``) sets itself as ``OutMessage.waiter``. Defined here so that
    the core names the one call it makes up into that layer, and imports none of it."""

    def _wait_for(self, msg: OutMessage, /) -> Awaitable[None]:
        """An awaitable that completes when ``msg`` is done (raises if it failed)."""
        ...


class OutMessage:
    """One message on its way out; ``Connection.send`` returns it as the handle
    (``rudp.SendHandle`` in the asyncio API).

    A message larger than one datagram is a *parent* that is never sent itself:
    its fragments are OutMessages whose ``parent`` points back to it, and it is
    acknowledged once every fragment is (``parts`` counts those still pending).
    """

    __slots__ = (
        "channel",
        "copies",
        "data",
        "fragments",
        "frame",
        "graph",
        "mode",
        "notify",
        "parent",
        "parts",
        "queued_at",
        "redundant",
        "seq",
        "state",
        "user",
        "waiter",
    )

    def __init__(self, data: bytes, mode: int, channel: int, seq: int, frame: bytes) -> None:
        self.data = data
        self.mode = mode
        self.channel = channel
        self.seq = seq  # the id on the wire, unwrapped: channel seq or graph id
        self.frame = frame  # encoded once; a resend carries the same frame
        self.state = QUEUED
        self.copies = 0  # packets in flight that carry it
        self.notify = False  # emit MessageAcked when acknowledged
        self.user: object = None  # free slot for the asyncio layer
        # What makes the handle awaitable (see ``Waiter`` and ``__await__``).
        self.waiter: Waiter | None = None
        self.parent: OutMessage | None = None
        self.parts = 0
        self.fragments: list[OutMessage] | None = None
        self.graph: GraphNode | None = None
        self.queued_at: float | None = None
        self.redundant = 0  # extra copies sent by the redundancy option

    @property
    def acked(self) -> bool:
        return self.state == ACKED

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    @property
    def superseded(self) -> bool:
        """A newer reliable-sequenced message on the channel replaced this one first."""
        return self.state == SUPERSEDED

    def done(self) -> bool:
        """Nothing more will happen to it: acknowledged, superseded or failed; for an
        unreliable message, sent or dropped."""
        state = self.state
        return state >= ACKED or (self.mode in UNRELIABLE_MODES and state != QUEUED)

    def __await__(self) -> Generator[Any, None, None]:
        # One object per message instead of two: the asyncio layer returns the core's
        # handle itself and only sets ``waiter``; the core stays free of asyncio.
        waiter = self.waiter
        if waiter is None:
            raise TypeError(
                "only a handle returned by an asyncio rudp.Connection.send() can be awaited"
            )
        return waiter._wait_for(self).__await__()


class GraphNode:
    """The sender's copy of a dependency-graph node (the seed article's local graph).

    ``executed`` becomes true once the peer must have executed the message: it
    was acknowledged and everything it depended on was executed too. From then
    on, a message that names it as a dependency sends nothing for it, so no
    dependency ever travels that could be confused after the 16-bit id wraps.
    """

    __slots__ = ("dependents", "deps", "executed", "gid", "owner", "waiting")

    def __init__(self, gid: int, owner: object) -> None:
        self.deps: list[OutMessage] = []  # dependencies named in the frame, until executed
        self.gid = gid
        self.owner = owner
        self.waiting = 0  # dependencies not yet executed
        self.executed = False
        self.dependents: list[OutMessage] = []


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
