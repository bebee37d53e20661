"""Connection migration: validating a peer's new address before moving to it.

Theory of operation
-------------------
DATA packets are routed by connection id, not by address, so a packet of a known
connection can arrive from an address that is not the connection's: the peer's NAT
rebound its mapping, or the peer moved from Wi-Fi to mobile. As in QUIC (RFC 9000,
section 9), the connection moves only after the new address has proven that it
receives our packets:

1. A sealed packet that authenticates from a new address, and is the
   highest-numbered packet received so far, starts a *path validation* of that
   address (``PathValidation``). A replayed packet is refused by the replay window
   before anything else, and an older packet (reordered, or a copy an attacker
   delayed) is processed as usual but moves nothing. A packet that does not
   authenticate changes nothing, whatever its address.
2. We send the new address a PATH_CHALLENGE frame: 8 random bytes, sealed in a
   packet of its own. The peer answers with a PATH_RESPONSE carrying the same
   bytes, in its next packet.
3. The connection moves (``Connection.address``, the endpoint's address index,
   a ``PathChanged`` event) when that response authenticates from the new address,
   on a packet from there that is the highest-numbered received so far. When the
   IP address changed (not only the port, as a NAT rebinding does), the path is
   another: the RTT estimate, the congestion controller and path MTU discovery
   start over (RFC 9000, section 9.4).

Until then the old path keeps carrying everything: our data, acknowledgments and
keepalives go to the old address; the new one gets nothing but challenges, and no
more bytes of them than authenticated packets brought from it (``budget``): the
anti-amplification rule, so a copy of a genuine packet sent from a spoofed source
draws at most its own size. A challenge waits for room when it has none (the
peer's next packets from there bring it).

A lost challenge is sent again after the resend timeout, doubling, at most
``CHALLENGE_TRIES`` times in all; then the validation is abandoned
(``path_validation_failures``) and the connection stays where it was. The next
highest-numbered packet from the new address starts a new one. A newer packet from
the connection's own address than any from the new one also abandons it at the
next try: the peer is still there, and the other address was a copy or a
straggler.

Each side validates the other's new address, so either side can move; a server
behind a fixed address never does. The peer does nothing special: it answers a
challenge from wherever it is.

Judgement call: the challenge packet is not ack-eliciting for loss detection (its
own timer resends it), so a path that may not work never disturbs the RTT
estimate or the congestion window of the one that does.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Any, Final

from rudp import frames, wire
from rudp.drops import DropReason
from rudp.events import PathChanged
from rudp.pmtu import ceiling_for
from rudp.protection import PacketNumbersExhausted
from rudp.state import CLOSED, CLOSING, CONNECTED

if TYPE_CHECKING:
    from rudp.connection import Connection

CHALLENGE_TRIES: Final = 3
"""PATH_CHALLENGEs sent for one validation before it is abandoned."""

Address = tuple[Any, ...]


class PathValidation:
    """The validation of one new peer address."""

    __slots__ = ("address", "answered", "data", "deadline", "newest", "received", "sent", "tries")

    def __init__(self, address: Address, data: bytes, newest: int) -> None:
        self.address = address
        """The address being validated."""
        self.data = data
        """The random bytes our PATH_CHALLENGE carries."""
        self.newest = newest
        """The highest packet number that authenticated from ``address``."""
        self.received = 0
        """Bytes of authenticated packets from ``address``: what we may send it."""
        self.sent = 0
        """Bytes we sent ``address`` (challenges)."""
        self.tries = 0
        """Challenges sent."""
        self.deadline: float | None = None
        """When to send the next challenge, or give up (None: one is due now)."""
        self.answered = False
        """A PATH_RESPONSE with our data authenticated from ``address``."""

    def budget(self) -> int:
        """Bytes we may still send ``address`` (anti-amplification: no more than it sent)."""
        return self.received - self.sent


class Migration:
    """One connection's side of migration: the validation in progress and its challenges.

    Like the other parts of a connection it holds its connection (``Connection``) and
    reads the parts it needs there: the packet reader's opener and the builder that
    seals a challenge.
    """

    __slots__ = ("_conn", "out", "path", "rx_path")
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.path: PathValidation | None = None  # the new address being validated
        self.rx_path: PathValidation | None = None  # the one the packet being read came from
        self.out: list[tuple[bytes, Address]] = []  # challenges, each to its own address

    def deadline(self) -> float | None:
        """When the current challenge is to be resent (or given up), if one is out."""
        path = self.path
        return None if path is None else path.deadline

    def take_datagrams(self) -> list[tuple[bytes, Address]]:
        out, self.out = self.out, []
        return out

    def receive(
        self, data: bytes, pn32: int, address: Address, now: float, movable: bool
    ) -> DropReason | None:
        """A DATA packet for the connection from ``address``, not the connection's.

        Opened like any other; if it authenticates and is the highest-numbered packet
        so far, it starts (or feeds) the validation of its address, which moves the
        connection once the address answered our challenge. ``movable`` is False when
        another connection of the endpoint has that address.
        """
        conn = self._conn
        state = conn.state
        reader = conn._reader
        opener = reader.opener
        if (state is not CONNECTED and state is not CLOSING) or opener is None:
            return DropReason.WRONG_ADDRESS  # nothing to move, or nothing left to say there
        conn._clock = now
        pn = opener.full_number(pn32, 32)
        if opener.window.seen(pn):
            return DropReason.REPLAYED
        newest = pn > opener.window.largest
        cut = wire.DATA_PREFIX_SIZE
        body = opener.open_unseen(pn, data[:cut], data[cut:])
        if body is None:
            return DropReason.AUTH_FAILED  # changes nothing, from anywhere
        path = self.path
        if path is None or path.address != address:
            path = None
            if newest and movable:
                path = self.path = PathValidation(address, conn._rng.randbytes(8), pn)
        if path is not None:
            path.received += len(data)
            if newest:
                path.newest = pn
        self.rx_path = path
        try:
            ack = (body[0] << 8) | body[1]
            bits = int.from_bytes(body[2:6], "big")
            reason = reader.process(body, pn, ack, bits, now, len(data))
        except PacketNumbersExhausted:
            conn._numbers_exhausted()
            return None
        finally:
            self.rx_path = None
        if path is not None and path is self.path and conn.state in (CONNECTED, CLOSING):
            if path.answered and newest and movable:
                self._migrate(path, now)
            elif path.deadline is None:
                self._send_challenge(path, now)
        return reason

    def on_frames(self, challenge: bytes, response: bytes) -> None:
        """An authenticated packet carried PATH_CHALLENGE and/or PATH_RESPONSE."""
        conn = self._conn
        if challenge:
            # Answered in our next packet, ack-eliciting like DISCONNECT: the peer
            # resends its challenge if the answer is lost.
            conn._builder.control.append(frames.path_response_frame(challenge))
            conn.stats.path_responses += 1
            conn._sink.dirty[conn] = None
        path = self.rx_path
        if response and path is not None and hmac.compare_digest(response, path.data):
            path.answered = True

    def on_timer(self, now: float) -> bool:
        """Resend a challenge that went unanswered; True if that ended the connection."""
        path = self.path
        if path is not None and path.deadline is not None and now >= path.deadline:
            self._send_challenge(path, now)  # the last one was lost, or never answered
            return self._conn.state is CLOSED
        return False

    def _send_challenge(self, path: PathValidation, now: float) -> None:
        """Send ``path`` its next PATH_CHALLENGE if its budget allows; arm the retry."""
        conn = self._conn
        opener = conn._reader.opener
        if path.tries >= CHALLENGE_TRIES or (
            path.tries and opener is not None and opener.window.largest > path.newest
        ):
            # Unanswered, or the peer's newer packets come from elsewhere: stay.
            self.path = None
            conn.stats.path_validation_failures += 1
            return
        size = wire.DATA_HEADER_SIZE + 1 + frames.PATH_DATA_SIZE
        if path.budget() < size:
            path.deadline = None  # the peer's next packets from there make room
            return
        try:
            datagram = conn._builder.path_packet(frames.path_challenge_frame(path.data))
        except PacketNumbersExhausted:
            conn._numbers_exhausted()
            return
        path.sent += len(datagram)
        path.tries += 1
        path.deadline = now + conn._rtt.rto * (1 << (path.tries - 1))
        self.out.append((datagram, path.address))
        conn.stats.path_challenges += 1
        conn._sink.dirty[conn] = None

    def _migrate(self, path: PathValidation, now: float) -> None:
        """The new address answered: everything goes there from now on."""
        conn = self._conn
        old = conn.address
        conn.address = path.address
        self.path = None
        if old[0] != path.address[0]:
            _new_path(conn, now)
        conn.stats.migrations += 1
        conn._sink.events.append((conn, PathChanged(old, path.address)))
        conn._sink.dirty[conn] = None


def _new_path(conn: Connection, now: float) -> None:
    """The peer's IP address changed: another network path, whose round-trip time,
    capacity and MTU nothing measured on the old one tells. As RFC 9000 (section 9.4)
    asks, the RTT estimate and the congestion controller start over, and path MTU
    discovery starts again at the base size, up to the new path's ceiling (an IPv6
    path carries 20 bytes less than an IPv4 one). A port-only change is a NAT
    rebinding on the same path, and keeps them all."""
    conn._rtt.reset()
    conn._cc.reset()
    pmtu = conn._pmtu
    ceiling = ceiling_for(conn.address, conn.config.max_datagram_size)
    peer = conn.peer_params
    if peer is not None:
        ceiling = min(ceiling, peer.max_datagram_size)
    pmtu.restart(ceiling, now)
    if conn.state is not CONNECTED:
        pmtu.stop()  # closing: no probes
    conn._use_datagram_size(pmtu.current)
