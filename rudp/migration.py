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
   on a packet from there that is the highest-numbered received so far.

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

from typing import Any, Final

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
