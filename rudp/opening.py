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
(``rudp.admission`` and ``rudp.endpoint``). What either side's handshake then does
to its connection is here too, as functions of the connection the endpoint calls:
``receive_challenge``, ``receive_accept``, ``receive_reject``, ``answer_connect``
(the endpoint answered a CONNECT into this connection; it keeps its ACCEPT for
resending) and ``establish``, which gives the connection its keys and applies the
limits the peer stated (``apply_peer_limits``). They are the connection's
handshake half, kept beside the client's attempt rather than in ``connection``,
and touch only what the handshake decides: keys, the peer's parameters, the state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rudp import wire
from rudp.config import Config
from rudp.events import Connected, DisconnectReason
from rudp.handshake import PATTERN_NK, ClientHandshake, Keys, TransportParams
from rudp.noise import NoiseError
from rudp.parity import Parity
from rudp.pmtu import ceiling_for
from rudp.protection import AES_256_GCM, CHACHA20_POLY1305, Opener, Sealer
from rudp.state import CONNECTED, CONNECTING
from rudp.wire import DropReason

if TYPE_CHECKING:
    from rudp.connection import Connection

TIMEOUT_BAD_ANSWERS = "the server's answers failed authentication (not the expected server key?)"


class Opening:
    """The client's handshake in progress: what to send, when, and what came back."""

    __slots__ = (
        "bad_answers",
        "challenged",
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
        self.challenged = False  # a CHALLENGE was answered at once already
        self.cookie_connects = 0  # CONNECTs sent with the current cookie
        self.cookie_connect_at = now
        self.send_connect = True
        self.deadline = now + config.connect_timeout
        self.retry_interval = config.connect_retry_interval
        self.next_connect = now + self.retry_interval
        # Padded to the base size: a larger CONNECT could be lost on a path that would
        # carry the connection (path MTU discovery starts after the handshake).
        self.max_datagram_size = config.base_datagram_size
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
            self.salt,
            hs.pattern,
            self.cookie,
            hs.message,
            self.max_datagram_size,
            hs.token_size,
            hs.extensions,
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
        # A flag, not ``bool(self.cookie)``: CHALLENGEs with an empty cookie, each
        # taken for the first, were each answered with a 1,200-byte CONNECT.
        answered = self.challenged
        self.cookie = challenge.cookie
        self.cookie_connects = 0
        if answered:
            return DropReason.DUPLICATE  # later CHALLENGEs wait for the retry timer
        self.challenged = True
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


def receive_challenge(conn: Connection, challenge: wire.Challenge) -> DropReason | None:
    opening = conn._opening
    if conn.state is not CONNECTING or opening is None:
        return DropReason.UNEXPECTED
    reason = opening.on_challenge(challenge)
    if reason is None:
        conn._sink.dirty[conn] = None  # the CONNECT with the cookie goes out now
    return reason


def receive_accept(conn: Connection, accept: wire.Accept, now: float) -> DropReason | None:
    opening = conn._opening
    if conn.state is not CONNECTING or opening is None:
        return DropReason.DUPLICATE if accept.salt == conn.salt else DropReason.UNEXPECTED
    result = opening.on_accept(accept, now)
    if isinstance(result, DropReason):
        return result
    keys, sample = result
    if sample is not None:
        conn._rtt.on_sample(sample)
    conn.server_authenticated = opening.expects_server_key
    conn._opening = None
    establish(conn, keys, now)
    return None


def receive_reject(conn: Connection, reject: wire.Reject) -> DropReason | None:
    if conn.state is not CONNECTING or reject.salt != conn.salt:
        return DropReason.UNEXPECTED
    conn._end(DisconnectReason.REFUSED, 0, reject.text, by_peer=True)
    conn._release()
    return None


def answer_connect(
    conn: Connection, salt: int, answer: bytes, keys: Keys, now: float, *, token_sealed: bool
) -> bytes:
    """The endpoint accepted the peer's CONNECT into this connection: a new one, or
    ours in a simultaneous open that the peer's handshake won (our own CONNECTs and
    our Noise state are dropped; the connection takes the peer's salt, so a duplicate
    of its CONNECT gets the ACCEPT again). ``answer`` is our Noise message 2.
    Returns the ACCEPT to send; ``_accept_datagram`` keeps it.

    ``token_sealed`` is False under NN, where the peer's parameters, its reset token
    among them, crossed the network in clear: anyone who saw the CONNECT could then
    forge its NOCONN, so this side believes none (the peer that forgot us is noticed
    at the idle timeout instead)."""
    conn._accept_datagram = wire.encode_accept(salt, answer)
    conn.salt = salt
    conn._opening = None
    conn.server_authenticated = False
    establish(conn, keys, now)
    if not token_sealed:
        conn._peer_reset_token = b""
    return conn._accept_datagram


def establish(conn: Connection, keys: Keys, now: float) -> None:
    """Handshake done: packet keys, and the peer's connection id, token and limits."""
    peer = keys.peer
    conn.peer_params = peer
    conn.peer_cid = peer.connection_id
    conn._peer_reset_token = peer.reset_token
    conn.handshake_hash = keys.handshake_hash
    # AES-256-GCM when both sides stated it (rudp.protection), both ways.
    aes_gcm = peer.aes_gcm and conn.config.aes_gcm
    conn.packet_cipher = AES_256_GCM if aes_gcm else CHACHA20_POLY1305
    conn._builder.set_keys(Sealer(keys.send_key, aes_gcm), peer.connection_id)
    opener = conn._reader.opener = Opener(keys.recv_key, aes_gcm)
    conn.stats.window = opener.window  # what arrived of the peer's packets
    apply_peer_limits(conn, peer, now)
    conn._reader.rx_largest = -1
    conn._last_recv = now
    conn._builder.last_sent = now
    conn._set_state(CONNECTED)
    conn._sink.events.append((conn, Connected()))
    conn._sink.dirty[conn] = None
    if conn._limits_error:
        conn._protocol_error(conn._limits_error)
        conn._release()


def apply_peer_limits(conn: Connection, peer: TransportParams, now: float) -> None:
    """What the peer stated it accepts, from the handshake: its largest message and
    channel count (``send()`` raises at once past them, naming the peer's limit),
    its receive buffer (what we let sit in it), its acknowledgment delay (our resend
    timer allows for it; we delay ours only if it stated one, and so reads ours),
    the smaller datagram size of the two sides (the ceiling of path MTU discovery,
    which starts now) and the smaller idle timeout of the two sides (either side's
    silence limit ends the connection, so both keep it alive within the smaller).

    A message queued before the handshake was checked against our limits only; if
    it breaks the peer's, it can never be sent, and the connection ends at once
    (protocol error, naming the limit) rather than stall.
    """
    idle = peer.idle_timeout_ms / 1000.0
    if 0 < idle < conn._idle_timeout:
        conn._idle_timeout = idle
        conn._keepalive_interval = min(conn._keepalive_interval, idle / 2)
    config = conn.config
    if peer.max_ack_delay_ms is not None:
        # The peer reads our delay and allows for it; one that states none does not.
        conn._builder.ack_delay = config.max_ack_delay
    conn._rtt.peer_ack_delay = (peer.max_ack_delay_ms or 0) / 1000.0
    if peer.parity and config.parity:
        # Both read REPAIR frames: parity instead of copies, both ways (rudp.parity).
        parity = Parity(conn._recovery, conn.stats)
        conn._builder.use_parity(parity)
        conn._reader.parity = parity
    base = min(config.base_datagram_size, peer.max_datagram_size)
    ceiling = min(ceiling_for(conn.address, config.max_datagram_size), peer.max_datagram_size)
    conn._builder.apply_peer_limits(base, peer.recv_buffer_bytes, peer.channel_window)
    conn._limits_error = conn._sender.apply_peer_limits(peer, base)
    conn._pmtu.start(base, ceiling, now)
