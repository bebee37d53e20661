"""Connect tokens in the handshake, on the stepped fake clock: a server that requires
them admits a client with a good one, and refuses every bad one with a REJECT naming
the reason, counted under it, never larger than the CONNECT, before any state."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

import rudp
from rudp import tokens, wire
from rudp.config import Config
from rudp.connection import State
from rudp.endpoint import Endpoint
from rudp.errors import LocalProtocolError, MessageTooLarge
from rudp.events import Disconnected, DisconnectReason
from rudp.handshake import ClientHandshake, TransportParams
from rudp.noise import private_key
from rudp.tokens import (
    MAX_TOKEN_SIZE,
    REFUSAL_TEXT,
    SIGNATURE_SIZE,
    Issuer,
    TokenRefusal,
    generate_issuer_key,
)
from rudp.wire import PacketType
from tests.rudp.harness import CLIENT, SERVER, Network, server_conn

SERVER_KEY = bytes(range(1, 33))
ISSUER = Issuer(bytes(range(100, 132)))
NEXT_ISSUER = Issuer(bytes(range(50, 82)))
WALL = 1_800_000_000.0  # UNIX time at the network's start (its clock reads 1000)


def _server_config(*issuers: Issuer) -> Config:
    return Config(
        static_key=SERVER_KEY, token_issuers=tuple(i.public_key for i in issuers or (ISSUER,))
    )


def _token(handshake_key: bytes, issuer: Issuer = ISSUER, **overrides: Any) -> bytes:
    fields: dict[str, Any] = {
        "client_key": rudp.public_key(handshake_key),
        "host_key": rudp.public_key(SERVER_KEY),
        "addresses": [SERVER],
        "client_id": 7,
        "now": WALL,
        "user_data": b"player=ada",
    }
    fields.update(overrides)
    return issuer.issue(**fields)


def _network(config: Config | None = None) -> tuple[Network, Endpoint]:
    net = Network(seed=5)
    server = net.add(SERVER, config or _server_config(), accept=True).endpoint
    server.wall_offset = WALL - net.now
    return net, server


def test_a_client_with_a_token_is_admitted_with_its_identity() -> None:
    net, server = _network()
    client = net.add(CLIENT)
    key = rudp.generate_key()
    conn = client.endpoint.connect(
        SERVER,
        net.now,
        server_key=rudp.public_key(SERVER_KEY),
        token=_token(key),
        token_key=key,
    )
    net.run_until(lambda: conn.state is State.CONNECTED, timeout=10)
    identity = server_conn(net.nodes[SERVER]).peer_identity
    assert identity is not None and (identity.client_id, identity.user_data) == (7, b"player=ada")
    assert conn.peer_identity is None  # the client side learns nothing of the kind
    assert server.stats.tokens_accepted == 1 and not server.stats.tokens_refused


def test_a_client_without_a_token_is_refused_with_the_reason() -> None:
    net, server = _network()
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now, server_key=rudp.public_key(SERVER_KEY))
    net.run_until(lambda: conn.state is State.CLOSED, timeout=10)
    text = REFUSAL_TEXT[TokenRefusal.MISSING]
    assert client.disconnects() == [Disconnected(DisconnectReason.REFUSED, 0, text, by_peer=True)]
    assert server.stats.tokens_refused == {TokenRefusal.MISSING: 1}
    assert not server.connections
    # Every answer to the client was smaller than the CONNECT that caused it.
    connects = [len(d) for d, src, _ in net.sent if src == CLIENT]
    assert all(len(d) < min(connects) for d, src, _ in net.sent if src == SERVER)


# -- every refusal, with a hand-made CONNECT -----------------------------------------------


def _connect(
    server: Endpoint, token: bytes, key: bytes, now: float, salt: int = 9, src: Any = CLIENT
) -> tuple[bytes, list[bytes]]:
    """Run a CONNECT carrying ``token`` (Noise NK, message 1 made with ``key``) through
    the cookie exchange: (the CONNECT with the cookie, the server's replies to it)."""
    params = TransportParams(1, 1 << 20, 4, 1 << 20, 1200, 10_000, bytes(16))
    hs = ClientHandshake(params, salt, rudp.public_key(SERVER_KEY), private_key(key), token)
    first = wire.encode_connect(salt, hs.pattern, b"", hs.message, 1200, len(token))
    server.receive_datagram(first, src, now)
    (challenge, _), *_ = server.datagrams_to_send(now)
    cookie = wire.decode_challenge(challenge).cookie
    second = wire.encode_connect(salt, hs.pattern, cookie, hs.message, 1200, len(token))
    server.receive_datagram(second, src, now)
    return second, [d for d, _ in server.datagrams_to_send(now)]


def _refusal(server: Endpoint, token: bytes, key: bytes, now: float, **kw: Any) -> str:
    """The one REJECT text the server answered with, checked smaller than the CONNECT."""
    before = len(server.connections)
    request, replies = _connect(server, token, key, now, **kw)
    assert len(replies) == 1
    (reply,) = replies
    assert wire.decode_type(reply) == PacketType.REJECT and len(reply) < len(request)
    assert len(server.connections) == before  # no state for a refused client
    return wire.decode_reject(reply).text


CASES: list[tuple[str, TokenRefusal]] = [
    ("forged", TokenRefusal.FORGED),
    ("expired", TokenRefusal.EXPIRED),
    ("other client", TokenRefusal.WRONG_CLIENT),
    ("other host", TokenRefusal.WRONG_HOST),
    ("retired key", TokenRefusal.UNKNOWN_ISSUER),
    ("truncated", TokenRefusal.TRUNCATED),
    ("oversized", TokenRefusal.OVERSIZED),
    ("port 0, unsigned", TokenRefusal.MALFORMED),
]


@pytest.mark.parametrize("case,refusal", CASES)
def test_each_bad_token_is_refused_under_its_own_reason(case: str, refusal: TokenRefusal) -> None:
    # The host names its addresses: the token's are compared with them, before the
    # signature is checked (a port 0 there once raised out of the endpoint).
    config = dataclasses.replace(_server_config(), token_addresses=(SERVER,))
    server = Endpoint(config, now=0.0, rng=random.Random(3), accept=True)
    server.wall_offset = WALL
    key = rudp.generate_key()
    good = _token(key)
    port = tokens._HEAD.size + 1 + 4  # the first address's port (IPv4)
    port_0 = good[:port] + bytes(2) + good[port + 2 : -SIGNATURE_SIZE] + bytes(SIGNATURE_SIZE)
    token = {
        "forged": good[:15] + bytes([good[15] ^ 1]) + good[16:],  # in client_id
        "expired": _token(key, now=WALL - 31),
        "other client": _token(rudp.generate_key()),
        "other host": _token(key, host_key=rudp.public_key(rudp.generate_key())),
        "retired key": _token(key, issuer=Issuer(generate_issuer_key())),
        "truncated": good[:120],
        "oversized": good + bytes(MAX_TOKEN_SIZE),
        "port 0, unsigned": port_0,
    }[case]
    assert _refusal(server, token, key, 0.0) == REFUSAL_TEXT[refusal]
    assert server.stats.tokens_refused == {refusal: 1}
    assert server.stats.tokens_accepted == 0


def test_a_token_is_accepted_once_and_its_connect_resent_is_answered_again() -> None:
    server = Endpoint(_server_config(), now=0.0, rng=random.Random(3), accept=True)
    server.wall_offset = WALL
    key = rudp.generate_key()
    token = _token(key)
    request, replies = _connect(server, token, key, 0.0)
    assert [wire.decode_type(r) for r in replies] == [PacketType.ACCEPT]
    # The same CONNECT again (our ACCEPT was lost): the same ACCEPT, nothing spent.
    server.receive_datagram(request, CLIENT, 0.0)
    assert server.datagrams_to_send(0.0) == [(replies[0], CLIENT)]
    # The token from another address (someone who copied the whole CONNECT): refused.
    text = _refusal(server, token, key, 0.0, salt=10, src=("10.0.0.3", 5000))
    assert text == REFUSAL_TEXT[TokenRefusal.REPLAYED]
    assert server.stats.tokens_accepted == 1
    assert server.stats.tokens_refused == {TokenRefusal.REPLAYED: 1}


def test_tokens_of_both_keys_are_accepted_while_the_key_rotates() -> None:
    server = Endpoint(
        _server_config(ISSUER, NEXT_ISSUER), now=0.0, rng=random.Random(3), accept=True
    )
    server.wall_offset = WALL
    for salt, issuer in ((20, ISSUER), (21, NEXT_ISSUER)):
        key = rudp.generate_key()
        token = _token(key, issuer)
        _, replies = _connect(server, token, key, 0.0, salt=salt, src=("10.9.0.1", salt))
        assert [wire.decode_type(r) for r in replies] == [PacketType.ACCEPT]
    assert server.stats.tokens_accepted == 2


def test_a_server_that_requires_no_token_ignores_one() -> None:
    server = Endpoint(Config(static_key=SERVER_KEY), now=0.0, rng=random.Random(3), accept=True)
    key = rudp.generate_key()
    _, replies = _connect(server, _token(key), key, 0.0)
    assert [wire.decode_type(r) for r in replies] == [PacketType.ACCEPT]
    assert server.connections[0].peer_identity is None


def test_misuse_raises_at_once() -> None:
    with pytest.raises(ValueError, match="static_key"):
        Config(token_issuers=(ISSUER.public_key,))
    with pytest.raises(ValueError, match="at most 2"):
        Config(static_key=SERVER_KEY, token_issuers=(b"a" * 32, b"b" * 32, b"c" * 32))
    client = Endpoint(Config(), now=0.0, rng=random.Random(1))
    key = rudp.generate_key()
    with pytest.raises(LocalProtocolError, match="give both"):
        client.connect(SERVER, 0.0, token=_token(key))
    with pytest.raises(MessageTooLarge, match="does not fit"):
        client.connect(SERVER, 0.0, token=bytes(MAX_TOKEN_SIZE + 1), token_key=key)
    small = Endpoint(Config(max_datagram_size=576), now=0.0, rng=random.Random(1))
    with pytest.raises(MessageTooLarge, match="max_datagram_size"):
        small.connect(SERVER, 0.0, token=bytes(400), token_key=key)


def test_expiry_follows_a_stepped_wall_clock() -> None:
    # NTP steps the system clock while the monotonic one runs on: the expiry check
    # reads the wall clock each time, not an offset taken when the server started.
    server = Endpoint(_server_config(), now=0.0, rng=random.Random(3), accept=True)
    wall = [WALL - 3600.0]  # the clock was an hour slow when the server started
    server.wall_offset = wall[0]  # an offset frozen then would stay an hour slow
    server.wall_clock = lambda: wall[0]
    wall[0] = WALL + 31.0  # stepped: the token below expired a second ago
    key = rudp.generate_key()
    text = _refusal(server, _token(key), key, 1.0, salt=30)
    assert text == REFUSAL_TEXT[TokenRefusal.EXPIRED]
    wall[0] = WALL + 10.0  # stepped back: a fresh token is good
    key = rudp.generate_key()
    _, replies = _connect(server, _token(key), key, 2.0, salt=31, src=("10.9.0.2", 1))
    assert [wire.decode_type(r) for r in replies] == [PacketType.ACCEPT]


def test_a_refused_token_is_refused_again_when_the_connect_is_resent() -> None:
    # The REJECT was lost: the client resends its CONNECT (same cookie) and gets the
    # same REJECT again, not silence until its timeout; still no connection, and the
    # token is checked (and counted) once.
    server = Endpoint(_server_config(), now=0.0, rng=random.Random(3), accept=True)
    server.wall_offset = WALL
    key = rudp.generate_key()
    request, replies = _connect(server, _token(key, now=WALL - 31), key, 0.0, salt=40)
    assert [wire.decode_type(r) for r in replies] == [PacketType.REJECT]
    for _ in range(2):
        server.receive_datagram(request, CLIENT, 0.5)
        assert server.datagrams_to_send(0.5) == [(replies[0], CLIENT)]
    assert server.stats.tokens_refused == {TokenRefusal.EXPIRED: 1}
    assert not server.connections and server.stats.connections_accepted == 0
    # Another client with a good token still gets in.
    good = rudp.generate_key()
    request, replies = _connect(server, _token(good), good, 1.0, salt=41)
    assert [wire.decode_type(r) for r in replies] == [PacketType.ACCEPT]
    assert len(server.connections) == 1
