"""Path MTU discovery: how large a datagram the path carries (DPLPMTUD, RFC 8899).

Theory of operation
-------------------
Every connection starts at its *base* size, ``Config.base_datagram_size`` (1200
bytes, QUIC's figure, or the peer's limit if smaller), and never goes below it.
After the handshake it searches upward, one probe at a time, up to the *ceiling*:
the smaller of both sides' ``max_datagram_size`` (1,472 bytes by default, 20 less
over IPv6, whose header is 20 bytes longer).

- **Probes.** A probe is a DATA packet of exactly the size tried, carrying PING
  and PADDING: ack-eliciting, but with no message in it, and kept out of loss
  detection and congestion control (``recovery`` never sees it). A lost probe
  loses nothing and is no congestion signal. With each probe a PING goes in an
  ordinary packet (or rides on data), so that the loss of the probe alone can be
  told from a path that lost everything: a probe counts as lost only if a packet
  sent with it was acknowledged within one resend timeout and the probe was not.
- **Search.** The first probe tries the ceiling (most paths carry a full Ethernet
  frame: one round trip and the search is over); a size lost ``MAX_PROBES`` times
  in a row (RFC 8899's MAX_PROBES), or refused at once by the local interface
  (EMSGSIZE), is ruled out, and the search goes on by halving the interval
  between the largest size confirmed and the smallest not yet ruled out, until
  it is narrower than ``SEARCH_STEP``.
- **Use.** A confirmed size becomes the size the packet builder fills datagrams
  to. Messages are still cut into fragments that fit the base size
  (``Config.fragment_payload``), and unreliable messages may not exceed it, so
  every frame in flight fits a base-size datagram: whatever the path does later,
  nothing has to be re-cut and nothing is lost. A larger path packs more frames
  per datagram, e.g. both fragments of a 1,200-byte message.
- **Black holes.** ``BLACK_HOLE_LOSSES`` packets larger than the base declared
  lost with none acknowledged in between mean the path no longer carries them
  (a route change, a tunnel, ICMP filtered): the size falls back to the base at
  once, their messages are resent in base-size datagrams, and the search starts
  again below the size that failed. The local interface refusing a packet of
  the current size (EMSGSIZE) falls back at once.
- **Raise timer.** Once the search is over below the ceiling, it is tried again
  after ``RAISE_INTERVAL`` (RFC 8899's PMTU_RAISE_TIMER, 600 s): the path may
  have changed for the better.

Judgement call: the state is kept here, as plain numbers; the connection glues
it to the packet builder (probes, the datagram size) and to loss detection
(which packets were lost or acknowledged), as it does for every other part.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from rudp.config import IPV6_EXTRA_HEADER
from rudp.seqnum import unwrap
from rudp.wire import ACK_SPAN

if TYPE_CHECKING:
    from rudp.stats import ConnectionStats

MAX_PROBES: Final = 3  # losses in a row that rule a size out (RFC 8899's MAX_PROBES)
SEARCH_STEP: Final = 16  # the search ends once the sizes left span fewer bytes than this
BLACK_HOLE_LOSSES: Final = 3  # large packets lost in a row that make the size fall back
RAISE_INTERVAL: Final = 600.0  # seconds before searching above a completed search again
NEVER: Final = float("inf")


def ceiling_for(address: tuple[Any, ...], max_datagram_size: int) -> int:
    """The largest datagram ``max_datagram_size`` allows towards ``address``: an IPv6
    path (a 4-tuple socket address, or a host with a colon) carries 20 bytes less."""
    if len(address) == 4 or ":" in str(address[0]):
        return max_datagram_size - IPV6_EXTRA_HEADER
    return max_datagram_size


class PathMtu:
    """The path MTU search of one connection; sizes are UDP payloads in bytes."""

    __slots__ = (
        "_stats",
        "base",
        "big_losses",
        "ceiling",
        "current",
        "deadline",
        "failures",
        "high",
        "low",
        "next_probe",
        "optimistic",
        "probe_deadline",
        "probe_pn",
        "probe_size",
        "witness",
    )
    # Dropped when the connection ends (``Connection._release``): the stats point here.
    __deletable__ = ("_stats",)

    def __init__(self, base: int, stats: ConnectionStats) -> None:
        self._stats = stats
        self.base = base
        self.ceiling = base
        self.current = base  # the size datagrams are filled to
        self.low = base  # the largest size confirmed
        self.high = base  # the largest size not ruled out
        self.optimistic = True  # try ``high`` itself first, not the middle
        self.failures = 0  # losses in a row of the size being probed
        self.big_losses = 0  # packets larger than the base lost since one was acknowledged
        self.probe_pn = -1  # the probe in flight, -1 if none
        self.probe_size = 0
        self.probe_deadline = NEVER  # when the probe in flight counts as lost
        self.witness = 0  # our largest acknowledged packet when the probe left
        self.next_probe = NEVER  # when the next probe is due
        self.deadline = NEVER  # the earlier of the two: what the connection's timer reads

    def start(self, base: int, ceiling: int, now: float) -> None:
        """The handshake is done: search between ``base`` and ``ceiling``."""
        self.base = self.current = self.low = base
        self.ceiling = self.high = max(base, ceiling)
        self.optimistic = True
        self._schedule(now if self.high > self.low else NEVER)

    def restart(self, ceiling: int, now: float) -> None:
        """The peer moved to another network path: what was learned of the old one
        says nothing of it; back to the base size, a probe in flight forgotten, and
        search again up to the new path's ``ceiling``."""
        self.failures = self.big_losses = 0
        self.probe_pn = -1
        self.probe_size = 0
        self.probe_deadline = NEVER
        self.start(self.base, ceiling, now)

    def stop(self) -> None:
        """The connection is closing: no more probes."""
        self.probe_pn = -1
        self.probe_deadline = self.next_probe = self.deadline = NEVER

    def _schedule(self, at: float) -> None:
        self.next_probe = at
        self.deadline = min(at, self.probe_deadline)

    def due(self, now: float) -> int:
        """The size to probe now (the caller checked ``now >= next_probe``), or 0."""
        if self.high - self.low < SEARCH_STEP:  # the raise timer: look above again
            self.high = self.ceiling
            self.optimistic = True
            if self.high - self.low < SEARCH_STEP:
                self._schedule(NEVER)
                return 0
        if self.optimistic:
            return self.high
        return (self.low + self.high + 1) // 2

    def probe_sent(self, pn: int, size: int, now: float, timeout: float, witness: int) -> None:
        """Probe ``pn`` of ``size`` bytes left; ``witness`` is our largest acknowledged
        packet number then (an acknowledgment beyond it proves the path alive)."""
        self.probe_pn = pn
        self.probe_size = size
        self.witness = witness
        self.probe_deadline = now + timeout
        self._stats.mtu_probes_sent += 1
        self._schedule(NEVER)

    def on_ack(self, ack16: int, bits: int, tx_next: int, now: float) -> bool:
        """An acknowledgment arrived while a probe is in flight; True if it confirmed
        the probe's size (``current`` changed)."""
        largest = unwrap(ack16, tx_next - 1)
        behind = largest - self.probe_pn
        if behind != 0 and not (0 < behind <= ACK_SPAN and (bits >> (behind - 1)) & 1):
            return False
        self.low = self.current = self.probe_size
        self.failures = 0
        self.big_losses = 0
        self._end_probe()
        self._next(now)
        return True

    def on_timeout(self, now: float, largest_acked: int, retry: float) -> None:
        """The probe was not acknowledged in time. It counts as lost only if a packet
        sent with it was (``largest_acked`` moved past ``witness``); otherwise the path
        lost everything, and the same size is tried again after ``retry`` seconds."""
        self._end_probe()
        if largest_acked <= self.witness:
            self._schedule(now + retry)
            return
        self._lost(now, refused=False)

    def on_refused(self, size: int, now: float) -> bool:
        """The local interface refused a datagram of ``size`` bytes (EMSGSIZE); True if
        the size datagrams are filled to fell back."""
        if self.probe_pn >= 0 and size == self.probe_size:
            self._end_probe()
            self._lost(now, refused=True)
            return False
        if size > self.base and size <= self.current:
            self._fall_back(size, now)
            return True
        return False

    def on_big_lost(self, now: float) -> bool:
        """A packet larger than the base was declared lost; True if that made the size
        fall back (a black hole)."""
        self.big_losses += 1
        if self.big_losses < BLACK_HOLE_LOSSES or self.current <= self.base:
            return False
        self._fall_back(self.current, now)
        return True

    def _fall_back(self, failed: int, now: float) -> None:
        self._stats.mtu_black_holes += 1
        self.current = self.low = self.base
        self.high = max(self.base, failed - 1)
        self.optimistic = False
        self.failures = 0
        self.big_losses = 0
        self._end_probe()
        self._next(now)

    def _lost(self, now: float, *, refused: bool) -> None:
        self._stats.mtu_probes_lost += 1
        self.failures += 1
        if refused or self.failures >= MAX_PROBES:
            self.high = max(self.low, self.probe_size - 1)
            self.failures = 0
            self.optimistic = False
        self._next(now)

    def _end_probe(self) -> None:
        self.probe_pn = -1
        self.probe_deadline = NEVER

    def _next(self, now: float) -> None:
        if self.high - self.low >= SEARCH_STEP:
            self._schedule(now)
        elif self.low < self.ceiling:
            self._schedule(now + RAISE_INTERVAL)
        else:
            self._schedule(NEVER)
