"""Congestion control: how many bytes of ack-eliciting packets may be in flight.

Theory of operation
-------------------
Loss detection (``recovery``) tells this module what happened to each
ack-eliciting packet: sent, acknowledged, declared lost, declared lost by
mistake, or lost with everything else for several resend timeouts (persistent
congestion). From that alone it keeps ``cwnd``; the packet builder sends new
reliable data only while ``bytes_in_flight < cwnd``.

The algorithm is NewReno's window (RFC 9002 section 7) with Westwood+'s answer to
a loss; ``CongestionController`` explains both. It sits in a module of its own,
as aioquic's ``congestion/`` does, because it has its own state and rules and
nothing else reads them: a different algorithm replaces this one module.
``Config.congestion_control=False`` keeps the bookkeeping (bytes in flight) and
fixes the window at ``Config.window`` datagrams.
"""

from __future__ import annotations

from typing import Final

from rudp.config import Config

GRANULARITY: Final = 0.001  # clock granularity floor for timers (RFC 9002's kGranularity)
NO_SSTHRESH: Final = 1 << 62  # slow start until the first loss
RATE_SAMPLES: Final = 8  # delivery-rate samples (one per RTT or more) a loss looks back on
# A loss is taken for random, not congestion, while the latest RTT is within this
# fraction of the minimum RTT (no queue is building) and the losses of the current
# rate sample stay within RANDOM_LOSS_SHARE of the window (at least two datagrams).
QUEUE_FREE_FRACTION: Final = 0.125
RANDOM_LOSS_SHARE: Final = 16  # a sixteenth


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
        "_initial",
        "_initial_datagram",
        "_max_datagram",
        "_max_window",
        "_min_window",
        "_packet_window",
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
        size = config.base_datagram_size
        self._initial_datagram = size
        self._packet_window = config.window
        self.enabled = config.congestion_control
        self._initial = min(10 * size, max(14720, 2 * size))
        self.bytes_in_flight = 0
        self.random_losses = 0  # losses taken for random, not congestion
        self.reset()

    def reset(self) -> None:
        """Back to the state of a new connection, but for what is in flight: the peer
        moved to another network path (RFC 9000, section 9.4), whose capacity nothing
        measured yet tells."""
        self._max_datagram = self._initial_datagram
        self._min_window = 2 * self._initial_datagram
        self._max_window = self._packet_window * self._initial_datagram
        self.cwnd = min(self._initial, self._max_window) if self.enabled else self._max_window
        self.ssthresh = NO_SSTHRESH
        # The most in flight this sample round and the last: the window was in use
        # (worth growing) if either reached half of it.
        self._flight_peak = 0
        self._flight_peak_prev = 0
        self.recovery_seq = 0  # packets numbered below it were sent before recovery began
        self._acc = 0  # bytes acknowledged towards the next congestion-avoidance step
        self._round_start = -1.0  # when the current delivery-rate sample began
        self._round_acked = 0
        self._round_lost = 0  # bytes lost during the current rate sample
        self._rates = [0.0] * RATE_SAMPLES  # the last delivery-rate samples, bytes/s
        self._rate_next = 0
        self._undo_seq = -1  # the packet whose loss began the current recovery
        self._undo_cwnd = 0
        self._undo_ssthresh = 0
        self._undo_recovery = 0

    def set_datagram_size(self, size: int) -> None:
        """Path MTU discovery changed the datagram size: the limits counted in datagrams
        follow it (RFC 9002 counts its windows in the current maximum datagram size);
        the window itself moves only by what is acknowledged and lost."""
        self._max_datagram = size
        self._min_window = 2 * size
        self._max_window = self._packet_window * size
        if not self.enabled:
            self.cwnd = self._max_window
        else:
            self.cwnd = min(max(self.cwnd, self._min_window), self._max_window)

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

    def on_abandoned(self, size: int) -> None:
        """A packet left the flight without news of it: a tail-loss probe sent its
        data again (``recovery``). Neither an acknowledgment nor a loss."""
        self.bytes_in_flight -= size

    def reset_flight(self) -> None:
        """Everything in flight was forgotten (the connection ended)."""
        self.bytes_in_flight = 0
