"""Round-trip estimation, resend timeout and the record of a packet in flight.

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

from typing import Final

from rudp.config import Config
from rudp.congestion import GRANULARITY

# The asyncio layer reads the message record and its states here.
from rudp.sending import ACKED as ACKED
from rudp.sending import FAILED as FAILED
from rudp.sending import SUPERSEDED as SUPERSEDED
from rudp.sending import OutMessage as OutMessage
from rudp.wire import UNRELIABLE_MODES as UNRELIABLE_MODES

# The peer acknowledges at the end of its event-loop turn, which on a loaded
# machine can take a few milliseconds: on loopback a bare 9/8 RTT would declare
# packets lost that are merely waiting for that turn to end.
LOSS_DELAY_FLOOR: Final = 0.005


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
