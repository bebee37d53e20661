"""Opening a connection from the client's side: CONNECT, its retries, the cookie, the answer.

Theory of operation
-------------------
A client computes its Noise message 1 once per ``connect()`` (``rudp.handshake``)
and sends the same CONNECT until it is answered: first without a cookie, then,
after the server's CHALLENGE, with the cookie it echoes. The server's ACCEPT
carries message 2; once it authenticates, this object hands the connection its
``Keys`` and is dropped.

CONNECTs leave on the retry timer only (``connect_retry_interval``), never in
answer to a received packet, except the one that answers the first CHALLENGE:
later CHALLENGEs (a duplicate, or a flood from an on-path spoofer who read our
salt) wait for the timer, so no received packet turns into a 1,200-byte CONNECT
and a client cannot be made a reflector.

An ACCEPT that does not authenticate is dropped and the attempt goes on
(an unauthenticated packet never ends anything): ``ClientHandshake.finish``
reads it into a copy of the Noise state, so the genuine answer can still
complete the handshake. If only such answers came, the timeout says so.

RTT: when exactly one CONNECT went out with the current cookie, its ACCEPT gives
an unambiguous first sample (Karn's rule), so the first data packet does not wait
on ``rto_initial``.

The server's side of the handshake (cookies, the Noise answer) is the endpoint's
(``rudp.admission`` and ``rudp.endpoint``); a connection the endpoint answered keeps
its ACCEPT for resending, see ``Connection._answer_connect``.
"""

from __future__ import annotations

from rudp import wire
from rudp.config import Config
from rudp.handshake import PATTERN_NK, ClientHandshake, Keys
from rudp.noise import NoiseError
from rudp.wire import DropReason

TIMEOUT_BAD_ANSWERS = "the server's answers failed authentication (not the expected server key?)"


class Opening:
    """The client's handshake in progress: what to send, when, and what came back."""

    __slots__ = (
        "bad_answers",
        "cookie",
        "cookie_connect_at",
        "cookie_connects",
        "deadline",
        "handshake",
        "max_datagram_size",
        "next_connect",
        "retry_interval",
        "salt",
        "send_connect",
    )

    def __init__(self, config: Config, handshake: ClientHandshake, salt: int, now: float) -> None:
        self.handshake = handshake
        self.salt = salt
        self.cookie = b""
        self.cookie_connects = 0  # CONNECTs sent with the current cookie
        self.cookie_connect_at = now
        self.send_connect = True
        self.deadline = now + config.connect_timeout
        self.retry_interval = config.connect_retry_interval
        self.next_connect = now + self.retry_interval
        self.max_datagram_size = config.max_datagram_size
        self.bad_answers = 0  # ACCEPTs for our salt that failed authentication

    @property
    def expects_server_key(self) -> bool:
        """True when this handshake is NK: it names the server's static key."""
        return self.handshake.pattern == PATTERN_NK

    def timer(self) -> float:
        return min(self.deadline, self.next_connect)

    def connect_datagram(self, now: float) -> bytes | None:
        """The CONNECT to send now, if one is due."""
        if not self.send_connect:
            return None
        self.send_connect = False
        if self.cookie:
            self.cookie_connects += 1
            self.cookie_connect_at = now
        hs = self.handshake
        return wire.encode_connect(
            self.salt, hs.pattern, self.cookie, hs.message, self.max_datagram_size
        )

    def on_timer(self, now: float) -> str | None:
        """Retry when due; returns the text of the timeout once the attempt is over."""
        if now >= self.deadline:
            return TIMEOUT_BAD_ANSWERS if self.bad_answers else ""
        if now >= self.next_connect:
            self.next_connect = now + self.retry_interval
            self.send_connect = True
        return None

    def on_challenge(self, challenge: wire.Challenge) -> DropReason | None:
        """Take the server's cookie; None when a CONNECT with it is now due."""
        if challenge.salt != self.salt:
            return DropReason.UNEXPECTED
        answered = bool(self.cookie)
        self.cookie = challenge.cookie
        self.cookie_connects = 0
        if answered:
            return DropReason.DUPLICATE  # later CHALLENGEs wait for the retry timer
        self.send_connect = True
        return None

    def on_accept(self, accept: wire.Accept, now: float) -> tuple[Keys, float | None] | DropReason:
        """The keys of an ACCEPT that authenticates, with its RTT sample if unambiguous."""
        if accept.salt != self.salt:
            return DropReason.UNEXPECTED
        try:
            keys = self.handshake.finish(accept.message)
        except (NoiseError, ValueError):
            self.bad_answers += 1  # forged, tampered, or from another key: the attempt goes on
            return DropReason.BAD_HANDSHAKE
        sample = now - self.cookie_connect_at if self.cookie_connects == 1 else None
        return keys, sample
