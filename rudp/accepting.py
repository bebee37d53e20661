"""The server's side of the handshake: a CONNECT in, a CHALLENGE, REJECT or ACCEPT out.

Theory of operation
-------------------
``receive_connect`` is what an endpoint does with a CONNECT, in the order that
keeps a spoofer from costing it anything:

1. Who may be answered: an endpoint that accepts connections, or one whose own
   CONNECT to that very peer crossed the peer's (a simultaneous open: two peers
   introduced to each other both connect; the larger salt wins on both sides, and a
   connection that names the server's key never answers in place).
2. A CONNECT shorter than ``wire.MIN_CONNECT_SIZE`` is ignored, so no reply is ever
   larger than what caused it.
3. Without a cookie: a CHALLENGE carrying one (``admission.CookieJar``), no state,
   no Diffie-Hellman. With one: it must be valid for this address and salt and
   unused; the per-source limits and the connection limit come next, before the
   cookie is spent, so a client refused as full is told again.
4. Only then the Noise message 1 is read (``read_first``: one DH under NK), a
   connect token verified when the server requires one (``admit``), and the
   connection made and answered (``answer``: ACCEPT, kept for a resent CONNECT).

Each refusal is a REJECT smaller than the CONNECT, naming its reason, and each
drop is counted. These are the endpoint's handshake half, kept beside it as
functions of the endpoint, as ``rudp.opening`` holds the connection's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from rudp import handshake, wire, wire_v1
from rudp.drops import DropReason
from rudp.events import DisconnectReason
from rudp.noise import NoiseError, ephemeral_key
from rudp.opening import answer_connect
from rudp.state import CONNECTED, CONNECTING
from rudp.tokens import PeerIdentity, TokenError, TokenRefusal

if TYPE_CHECKING:
    from rudp.connection import Address, Connection
    from rudp.endpoint import Endpoint

NO_STATIC_KEY: Final = "this server has no static key"
HANDSHAKE_FAILED: Final = "handshake failed: the client expects another server key"
V1_REFUSAL: Final = "this server speaks rudp protocol version 2; upgrade the client"
SOURCE_FULL: Final = "too many connections from your address"
SERVER_CLOSING: Final = "server closing"


def refuse_v1(ep: Endpoint, data: bytes, address: Address) -> None:
    """Tell a version-1 client why it gets no connection: its own REJECT format,
    smaller than its padded CONNECT."""
    salt = wire_v1.v1_connect_salt(data)
    if salt is not None:
        ep.stats.connections_refused += 1
        ep._send_unvalidated(wire_v1.encode_v1_reject(salt, V1_REFUSAL), address)


def receive_connect(
    ep: Endpoint, conn: Connection | None, data: bytes, address: Address, now: float
) -> DropReason | None:
    # A CONNECT from the very peer we are connecting to is a simultaneous open (two
    # peers introduced to each other both connect): answered even by an endpoint
    # that accepts no one else, and so are its duplicates once it was answered.
    answered = conn is not None and bool(conn._accept_datagram)
    # A connection that names the server's key (NK) never answers in place: the
    # side that answers cannot authenticate the other, so an attacker on the path
    # could otherwise win the tie-break with a spoofed CONNECT of his own and be
    # taken for the server. Its CONNECT from that address is not a simultaneous
    # open, nor (on an endpoint that accepts) a restart; the handshake completes
    # only with the key holder's ACCEPT.
    if conn is not None and conn.state is CONNECTING and conn.expects_server_key:
        return DropReason.UNEXPECTED
    opening = conn is not None and conn.state is CONNECTING and not answered
    if not ep.accept and not opening and not answered:
        return DropReason.UNEXPECTED
    if len(data) < wire.MIN_CONNECT_SIZE:
        return DropReason.MALFORMED
    request = wire.decode_connect(data)
    if answered and conn is not None and conn.salt == request.salt:
        if conn.state is CONNECTED:
            ep._out.append((conn._accept_datagram, address))  # our ACCEPT was lost
            return None
        return DropReason.DUPLICATE
    late_loser = conn is not None and conn.client and not opening and request.salt < conn.salt
    if late_loser and not ep.accept:
        # The losing handshake of a simultaneous open we won, late or duplicated (no
        # other handshake is ours to take: we accept no one).
        return DropReason.DUPLICATE
    if not ep.accept and not opening:
        return DropReason.UNEXPECTED  # a new handshake: not ours to accept
    if request.pattern not in (handshake.PATTERN_NN, handshake.PATTERN_NK):
        return DropReason.MALFORMED
    if request.pattern == handshake.PATTERN_NK and ep._static is None and not opening:
        # (In a simultaneous open our own handshake may win: decided after the cookie.)
        ep.stats.connections_refused += 1
        ep._send_unvalidated(wire.encode_reject(request.salt, NO_STATIC_KEY), address)
        return None
    if not request.cookie:
        ep._send_unvalidated(
            wire.encode_challenge(request.salt, ep._cookies.make(address, request.salt, now)),
            address,
        )
        return None
    if not ep._cookies.valid(request.cookie, address, request.salt, now):
        return DropReason.BAD_COOKIE
    if ep._cookies.used(address, request.salt):
        refusal = ep._cookies.refusal(address, request.salt)
        if refusal is None:
            return DropReason.REPLAYED_COOKIE
        # Its connect token was refused and the client resends: the REJECT was
        # lost. The same answer again (smaller than the CONNECT), with no DH and
        # no connection: the cookie stays spent.
        ep.stats.connections_refused += 1
        ep._send_unvalidated(wire.encode_reject(request.salt, refusal), address)
        return None
    if opening:
        assert conn is not None
        # Both handshakes are valid; both sides keep the one with the larger salt.
        # Ours: the peer, seeing our CONNECT, answers it the same way. Theirs: our
        # connection answers it, as a server would, and is established. A peer that
        # names our key (NK) never answers in place: its handshake is the one.
        names_our_key = request.pattern == handshake.PATTERN_NK and ep._static is not None
        if request.salt <= conn.salt and not names_our_key:
            return DropReason.UNEXPECTED
        first = read_first(ep, request, address)
        if first is None:
            return DropReason.BAD_HANDSHAKE
        answer(ep, conn, request, first, now)
        ep._cookies.remember(address, request.salt, now)
        ep.stats.simultaneous_opens += 1
        return None
    if late_loser and conn is not None:
        # From a peer we opened a connection to: the late losing handshake of a
        # simultaneous open (its parameters name the very connection id the peer's
        # ACCEPT gave us), or the peer restarted (a new id): worth one DH to tell.
        try:
            keys = handshake.answer(
                ep._static,
                request.pattern,
                request.salt,
                first_message(request),
                conn.transport_params(),
                ephemeral_key(ep._rng),
                request.token_size,
                request.extensions,
            )[1]
        except (NoiseError, ValueError):
            ep._cookies.remember(address, request.salt, now)  # one DH per cookie, at most
            return DropReason.BAD_HANDSHAKE
        if keys.peer.connection_id == conn.peer_cid:
            ep._cookies.remember(address, request.salt, now)  # a copy costs no second DH
            return DropReason.DUPLICATE
    if not ep._sources.may_start(address, now):
        # Unanswered, and the cookie stays unused: the client's next resend
        # of this CONNECT tries again once the source's bucket has refilled. (A
        # restart from a connection's own address counts too, or holding one
        # connection would lift the limit.)
        ep.stats.source_handshakes_limited += 1
        return None
    if ep.refusing:
        # Closing: a connection taken now would be cut off when the close ends,
        # unannounced. Told at once, the client can go elsewhere.
        ep.stats.connections_refused += 1
        ep._send_unvalidated(wire.encode_reject(request.salt, SERVER_CLOSING), address)
        return None
    if len(ep._conns) >= ep.config.max_connections + (conn is not None):
        # Before the cookie is spent: a client whose REJECT was lost gets it again
        # for its resent CONNECT, and once there is room that same CONNECT gets its
        # one connection (remembered below, so never a second).
        ep.stats.connections_refused += 1
        ep._send_unvalidated(wire.encode_reject(request.salt, "server full"), address)
        return None
    if conn is None and not ep._sources.may_hold(address):
        # Before the cookie is spent too, as "server full" above.
        ep.stats.connections_refused += 1
        ep.stats.source_connections_refused += 1
        ep._send_unvalidated(wire.encode_reject(request.salt, SOURCE_FULL), address)
        return None
    ep._cookies.remember(address, request.salt, now)  # one DH per cookie, at most
    first = read_first(ep, request, address)
    if first is None:
        return DropReason.BAD_HANDSHAKE
    identity = None
    if ep._tokens is not None:
        # After the cookie, before any per-connection state: a refused client
        # costs the DH of its first message, as a wrong server key does.
        identity = admit(ep, first, request.salt, address, now)
        if identity is None:
            return None
    fresh = ep._new_connection(address, now, client=False, salt=request.salt)
    fresh.peer_identity = identity
    answer(ep, fresh, request, first, now)
    if conn is not None:
        # The peer restarted: its old session is gone.
        conn.abort(DisconnectReason.NO_CONNECTION, by_peer=True)
        if address not in ep._conns:  # (forgotten by the abort)
            ep._sources.opened(address)
        ep._conns[address] = fresh
    ep.stats.connections_accepted += 1
    return None


def first_message(request: wire.Connect) -> bytes:
    """The Noise message 1 of a CONNECT: its size follows from the pattern, the size
    of the token it carries and that of the client's parameter extensions."""
    size = handshake.first_message_size(request.pattern, request.token_size, request.extensions)
    return request.rest[:size]


def read_first(
    ep: Endpoint, request: wire.Connect, address: Address
) -> handshake.FirstMessage | None:
    """The client's Noise message 1, read; None, with a REJECT sent, when it is not
    genuine."""
    try:
        return handshake.read_first(
            ep._static,
            request.pattern,
            request.salt,
            first_message(request),
            ephemeral_key(ep._rng),
            request.token_size,
            request.extensions,
        )
    except (NoiseError, ValueError):
        # The address is proven (valid cookie) and the REJECT is smaller than the
        # CONNECT. Under NK the usual cause is a client configured with another key.
        # Remembered with the spent cookie: if this REJECT is lost, the client's
        # resent CONNECT gets it again (no second DH) instead of timing out.
        ep._cookies.refused(address, request.salt, HANDSHAKE_FAILED)
        ep._send_unvalidated(wire.encode_reject(request.salt, HANDSHAKE_FAILED), address)
        return None


def admit(
    ep: Endpoint, first: handshake.FirstMessage, salt: int, address: Address, now: float
) -> PeerIdentity | None:
    """The identity in the client's connect token; None, with a REJECT naming the
    reason sent (smaller than the CONNECT) and the reason counted, when refused."""
    assert ep._tokens is not None
    try:
        if not first.token:
            raise TokenError(TokenRefusal.MISSING)
        wall = ep.wall_clock() if ep.wall_clock is not None else now + ep.wall_offset
        identity = ep._tokens.verify(first.token, first.client_key, wall)
    except TokenError as exc:
        ep.stats.tokens_refused[exc.refusal] += 1
        ep.stats.connections_refused += 1
        ep._cookies.refused(address, salt, str(exc))  # for a resent CONNECT
        ep._send_unvalidated(wire.encode_reject(salt, str(exc)), address)
        return None
    ep.stats.tokens_accepted += 1
    return identity


def answer(
    ep: Endpoint, conn: Connection, request: wire.Connect, first: handshake.FirstMessage, now: float
) -> None:
    """Answer the client's first message into ``conn`` and send ACCEPT (kept for
    resending on a duplicate CONNECT); the connection is established."""
    answer, keys = first.answer(conn.transport_params())
    accept = answer_connect(
        conn,
        request.salt,
        answer,
        keys,
        now,
        token_sealed=request.pattern == handshake.PATTERN_NK,
    )
    ep._out.append((accept, conn.address))
    ep._schedule(conn)


# -- helpers -------------------------------------------------------------------
