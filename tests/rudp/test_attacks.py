"""Wire version 2 attacked from outside, on the stepped fake clock: an off-path spoofer,
an on-path observer who reads, copies, rewrites and replays datagrams, and a malicious
peer who holds the session keys.

test_security.py covers the sealed DATA packet; this module covers the other packet
types (CONNECT, CHALLENGE, ACCEPT, REJECT, NOCONN, QUERY_REPLY) under the same attacks,
floods spanning the whole handshake, and what a peer with the keys can make us spend.
Every attack is counted under its own drop reason and leaves the connection working."""

from __future__ import annotations

import array
import dataclasses
import random
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

import rudp
from rudp import frames, handshake, noise, wire
from rudp.accepting import HANDSHAKE_FAILED
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import MessageTooLarge
from rudp.events import DisconnectReason, QueryAnswered, QueryReceived
from rudp.opening import TIMEOUT_BAD_ANSWERS
from rudp.wire import DropReason, PacketType
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Address,
    Network,
    Node,
    pair,
    server_conn,
    still_flows,
)

# -- a malicious peer ----------------------------------------------------------------------


def test_a_peer_that_skips_packet_numbers_costs_no_memory() -> None:
    # A sender may skip packet numbers (nothing forbids it, and the nonce stays unique),
    # up to 2**31 - 1 ahead of the largest received per packet. Shifting the
    # acknowledgment bitfield by that much built a 256 MB integer for each such packet.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    ack = wire.ack_fields(0, 0)
    tracemalloc.start()
    try:
        for i in range(3):
            conn._builder.tx_next += (1 << 31) - 10
            packet = conn.seal_datagram(ack + frames.unreliable_frame(0, b"jump %d" % i))
            assert server.endpoint.receive_datagram(packet, CLIENT, net.now) is sconn
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 1e6:.0f} MB"
    assert sconn._reader.rx_largest == conn._builder.tx_next - 1 and sconn._reader.rx_bits == 1
    net.run(0.1)
    assert server.received() == [b"jump 0", b"jump 1", b"jump 2"]
    # The connection goes on: acknowledgments of the new numbers, messages both ways.
    conn.send(b"after the jumps")
    sconn.send(b"down after the jumps")
    net.run(1)
    assert b"after the jumps" in server.received()
    assert b"down after the jumps" in client.received()
    assert conn.state is State.CONNECTED and sconn.state is State.CONNECTED
    assert conn.queued == 0 and sconn.queued == 0


# -- every packet type: replayed, reflected, tampered, truncated, injected ------------------

STRANGER = ("10.6.6.6", 6666)
ALL_TYPES = {PacketType(t) for t in range(1, 9)}


def _snapshot(node: Node) -> tuple[Any, ...]:
    """What a datagram that is refused must leave as it was: every connection of the node,
    its packet-level state, its timer."""
    out: list[Any] = [len(node.endpoint.connections)]
    for conn in node.endpoint.connections:
        opener = conn._reader.opener
        out += [
            conn.state,
            conn.address,
            conn.salt,
            conn.cid,
            conn.peer_cid,
            conn.handshake_hash,
            None if opener is None else (opener.window.largest, opener.window.accepted),
            conn._reader.rx_largest,
            conn._reader.rx_bits,
            conn._last_recv,
            conn.get_timer(),
            conn.stats.packets_received,
            conn.stats.srtt,
            conn._builder.ack_pending,
            conn._migration.path,
        ]
    return tuple(out)


def _hit(
    net: Network, node: Node, data: bytes, src: Address
) -> tuple[DropReason | None, list[bytes]]:
    """Deliver ``data`` to ``node`` as if ``src`` sent it: the one reason it was dropped
    (None: taken or answered), and what the node answered ``src`` at once."""
    ep = node.endpoint
    before = ep.stats.dropped.copy()
    queued = len(ep._out)
    ep.receive_datagram(data, src, net.now)
    after = ep.stats.dropped
    changed = [r for r in after if after[r] != before.get(r, 0)]
    assert len(changed) <= 1 and sum(after.values()) - sum(before.values()) <= 1
    answers = [d for d, dst in ep._out[queued:] if dst == src]
    return (changed[0] if changed else None), answers


def _still_flows(net: Network, server: Node, client: Node, conn: Connection) -> None:
    """`still_flows`, and neither side moved or gained a connection."""
    sconn = server_conn(server)
    assert sconn.address == CLIENT and conn.address == SERVER
    still_flows(net, server, client, conn)
    assert len(server.endpoint.connections) == 1 and len(client.endpoint.connections) == 1


Sent = tuple[bytes, Address, Address]


def _captured() -> tuple[Network, Node, Node, Connection, dict[PacketType, list[Sent]]]:
    """A connected pair, and a genuine packet of every type as it crossed the wire with
    its source and destination: the handshake, DATA both ways, a query and its reply,
    and the NOCONN and REJECT the server sent the same client's previous attempts."""
    net = Network(seed=31)
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    # A first connection the server forgets: the client's next packet draws a NOCONN.
    first = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: first.state is State.CONNECTED)
    server_conn(server).abort()
    first.send(b"to a forgotten connection")
    net.run_until(lambda: first.state is State.CLOSED)
    # A refused attempt: the server is full for a moment.
    server.endpoint.config = dataclasses.replace(server.endpoint.config, max_connections=0)
    refused = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: refused.state is State.CLOSED)
    server.endpoint.config = dataclasses.replace(server.endpoint.config, max_connections=64)
    start = len(net.sent)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    conn.send(b"up")
    server_conn(server).send(b"down")
    nonce = client.endpoint.query(SERVER, b"info?", net.now, reply_room=64)
    net.run_until(lambda: any(isinstance(e, QueryReceived) for _, e in server.events))
    (event,) = [e for _, e in server.events if isinstance(e, QueryReceived)]
    assert event.nonce == nonce
    server.endpoint.reply_query(event, b"info!")
    net.run(1)
    end = len(net.sent)
    net.run(0.1)  # what was still on its way has arrived
    seen: dict[PacketType, list[Sent]] = {}
    for i, (data, src, dst) in enumerate(net.sent[:end]):
        ptype = PacketType(data[0] & 0x0F)
        if i >= start or ptype in (PacketType.NOCONN, PacketType.REJECT):
            seen.setdefault(ptype, []).append((data, src, dst))
    assert set(seen) == ALL_TYPES
    client.events.clear()  # the first two attempts' ends: not the attacks'
    server.events.clear()
    return net, server, client, conn, seen


def _node(net: Network, address: Address) -> Node:
    return net.nodes[address]


# What each genuine packet draws when it is sent again, as it was (a replay), and when it
# is sent back to its sender from its receiver's address (a reflection). None: taken or
# answered, never with more bytes than it carried.
REPLAYED = {
    PacketType.CONNECT: None,  # CHALLENGE or the lost ACCEPT again, both smaller
    PacketType.CHALLENGE: DropReason.UNEXPECTED,
    PacketType.ACCEPT: DropReason.DUPLICATE,
    PacketType.REJECT: DropReason.UNEXPECTED,
    PacketType.DATA: DropReason.REPLAYED,
    PacketType.NOCONN: DropReason.BAD_TOKEN,  # about the connection it ended
    PacketType.QUERY: None,  # a new QueryReceived: the application answers, no larger
    PacketType.QUERY_REPLY: DropReason.UNEXPECTED,
}
REFLECTED = {
    PacketType.CONNECT: DropReason.UNEXPECTED,
    PacketType.CHALLENGE: DropReason.UNEXPECTED,
    PacketType.ACCEPT: DropReason.DUPLICATE,
    PacketType.REJECT: DropReason.UNEXPECTED,
    PacketType.DATA: DropReason.UNKNOWN_PEER,  # the peer's connection id, not ours
    PacketType.NOCONN: DropReason.UNEXPECTED,  # under NN the server believes none
    PacketType.QUERY: None,
    PacketType.QUERY_REPLY: DropReason.UNEXPECTED,
}


@pytest.mark.parametrize("attack", ["replayed", "reflected"])
def test_every_packet_type_replayed_or_reflected_is_counted_and_harmless(attack: str) -> None:
    net, server, client, conn, seen = _captured()
    expected = REPLAYED if attack == "replayed" else REFLECTED
    for ptype, packets in seen.items():
        for data, src, dst in packets[:20]:
            if attack == "reflected":
                src, dst = dst, src
            node = _node(net, dst)
            others = _snapshot(_node(net, src))
            before = _snapshot(node)
            reason, answers = _hit(net, node, data, src)
            assert reason is expected[ptype], (ptype, reason)
            assert sum(map(len, answers)) <= len(data), ptype
            assert _snapshot(node) == before and _snapshot(_node(net, src)) == others, ptype
    _still_flows(net, server, client, conn)


def test_every_packet_type_tampered_or_truncated_is_dropped_and_counted() -> None:
    net, server, client, conn, seen = _captured()
    for ptype, packets in seen.items():
        data, src, dst = packets[-1]
        node = _node(net, dst)
        before = _snapshot(node)
        for i in range(len(data)):
            flipped = bytearray(data)
            flipped[i] ^= 0x5A
            reason, answers = _hit(net, node, bytes(flipped), src)
            assert reason is not None and sum(map(len, answers)) <= len(data), (ptype, i)
        for n in range(len(data)):
            reason, answers = _hit(net, node, data[:n], src)
            assert reason is not None and sum(map(len, answers)) <= n, (ptype, n)
        assert _snapshot(node) == before, ptype
    _still_flows(net, server, client, conn)


def _rewritten(data: bytes, offset: int, value: bytes) -> bytes:
    """``data`` with ``value`` at ``offset`` and its CRC made right again: what an
    attacker on the path can do to any unsealed packet."""
    body = data[:offset] + value + data[offset + len(value) : -4]
    return body + struct.pack("!I", zlib.crc32(body, wire.PROTOCOL_ID))


U, T, A = DropReason.UNEXPECTED, DropReason.BAD_TOKEN, DropReason.AUTH_FAILED


def test_every_packet_type_forged_or_rewritten_on_the_path_is_counted_and_harmless() -> None:
    net, server, client, conn, seen = _captured()
    sconn = server_conn(server)
    rng = random.Random(32)
    salt = rng.getrandbits(64).to_bytes(8, "big")
    connect = seen[PacketType.CONNECT][-1][0]
    # (datagram, its claimed source, the node it goes to, the reason from that source)
    forged: list[tuple[bytes, Address, Node, DropReason | None]] = [
        # The CONNECT with another salt (CRC made right): not this attempt's cookie.
        (_rewritten(connect, 2, salt), CLIENT, server, DropReason.BAD_COOKIE),
        # Same salt, another cookie: the attempt is answered, so the ACCEPT again (it may
        # have been lost), to the connection's own address and smaller than the CONNECT.
        (_rewritten(connect, 12, rng.randbytes(20)), CLIENT, server, None),
        (wire.encode_challenge(rng.getrandbits(64), bytes(20)), SERVER, client, U),
        (wire.encode_accept(conn.salt, rng.randbytes(83)), SERVER, client, DropReason.DUPLICATE),
        (wire.encode_reject(conn.salt, "go away"), SERVER, client, U),
        (wire.encode_noconn(conn.peer_cid, rng.randbytes(16)), SERVER, client, T),
        (wire.encode_noconn(sconn.peer_cid, rng.randbytes(16)), CLIENT, server, U),  # NN
        (wire.encode_query(PacketType.QUERY_REPLY, 7, b"?"), SERVER, client, U),
        (wire.data_prefix(sconn.cid, 1 << 20) + rng.randbytes(60), CLIENT, server, A),
        (wire.data_prefix(conn.cid, 1 << 20) + rng.randbytes(60), SERVER, client, A),
    ]
    for data, src, node, want in forged:
        for source in (src, STRANGER):
            before = _snapshot(node)
            reason, answers = _hit(net, node, data, source)
            if source == STRANGER and data[0] not in (0xA1, 0xA5):
                # Not from the connection's peer: nothing to match it with, or the
                # query it would answer was never sent to that address.
                assert reason in (DropReason.UNKNOWN_PEER, DropReason.UNEXPECTED), data[0]
            elif source == STRANGER and data[0] == 0xA1:
                assert reason is DropReason.BAD_COOKIE  # bound to the client's address
            else:
                assert reason is want, (hex(data[0]), reason)
            assert sum(map(len, answers)) <= len(data)
            assert _snapshot(node) == before
    _still_flows(net, server, client, conn)


# -- amplification through the whole handshake ---------------------------------------------

VICTIM = ("10.9.9.9", 999)
PEERS = ((CLIENT, SERVER), (SERVER, CLIENT))


def _flood_handshake(flood: bool) -> tuple[Network, Connection, dict[tuple[Address, Address], int]]:
    """A client connects and exchanges a message while (if ``flood``) a spoofer sends, every
    5 ms from before the first CONNECT until a second after the connection is up, the
    victim's address on every packet type to both sides, and, as an attacker on the path
    who read the salt and the connection ids, right-salt handshake packets and DATA as
    the server to the client and copies of the client's CONNECTs as the client to the
    server. Returns the network, the connection, and the bytes spoofed per (src, dst)."""
    net = Network(seed=33)
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    rng = random.Random(34)
    spoofed: dict[tuple[Address, Address], int] = {}

    def spoof(data: bytes, src: Address, dst: Address) -> None:
        net.inject(data, src, dst)
        spoofed[(src, dst)] = spoofed.get((src, dst), 0) + len(data)

    def junk(cid: int) -> list[bytes]:
        salt = rng.getrandbits(64)
        message = rng.randbytes(67)
        return [
            wire.encode_connect(salt, 0, b"", message, 1200),
            wire.encode_connect(salt, 0, b"", message, 200),
            wire.encode_connect(salt, 0, rng.randbytes(20), message, 1200),
            wire.encode_challenge(salt, rng.randbytes(20)),
            wire.encode_accept(salt, rng.randbytes(83)),
            wire.encode_reject(salt, "no"),
            wire.encode_noconn(rng.getrandbits(32), rng.randbytes(16)),
            wire.data_prefix(cid, rng.getrandbits(32)) + rng.randbytes(rng.randint(22, 300)),
            wire.data_prefix(rng.getrandbits(32), 0) + rng.randbytes(rng.randint(22, 300)),
            wire.encode_query(PacketType.QUERY_REPLY, rng.getrandbits(32), b"x"),
        ]

    end: float | None = None
    while end is None or net.now < end:
        if flood:
            sconns = server.endpoint.connections
            scid = sconns[0].cid if sconns else rng.getrandbits(32)
            for data in junk(scid):
                spoof(data, VICTIM, SERVER)
            for data in junk(conn.cid):
                spoof(data, VICTIM, CLIENT)
            # On the path: the attempt's salt and the client's connection id are known, and
            # every handshake packet so far is copied back at its receiver. (Right-salt
            # CHALLENGEs with a cookie of the attacker's would make the attempt fail, as
            # dropping its packets would: docs/security.md. test_security.py floods a
            # client with those.)
            spoof(wire.encode_accept(conn.salt, rng.randbytes(83)), SERVER, CLIENT)
            data = wire.data_prefix(conn.cid, rng.getrandbits(32)) + rng.randbytes(60)
            spoof(data, SERVER, CLIENT)
            for data, src, dst in list(net.sent):
                if data[0] in (0xA1, 0xA2, 0xA3) and (src, dst) in PEERS:
                    spoof(data, src, dst)
        net.run(0.005)
        if end is None and conn.state is State.CONNECTED:
            conn.send(b"hello")
            end = net.now + 1.0
        assert net.now < 1000.0 + 30, "the handshake never completed"
    assert server.received() == [b"hello"]
    return net, conn, spoofed


def test_a_spoofed_flood_through_the_whole_handshake_draws_no_more_than_it_sends() -> None:
    quiet, _, _ = _flood_handshake(flood=False)
    net, conn, spoofed = _flood_handshake(flood=True)
    assert conn.state is State.CONNECTED

    def sent(n: Network, src: Address, dst: Address) -> int:
        return sum(len(d) for d, s, to in n.sent if s == src and to == dst)

    # To the victim, from either side: at most what was sent in its name.
    for address in (SERVER, CLIENT):
        drawn = sent(net, address, VICTIM)
        assert 0 < drawn <= spoofed[(VICTIM, address)], address
    # To the real peers, beyond what the same handshake sends unattacked: at most what the
    # attacker sent in the other peer's name (no packet turns into a CONNECT, a CHALLENGE
    # or an ACCEPT larger than itself, and the CONNECTs stay on the retry timer).
    for src, dst in ((CLIENT, SERVER), (SERVER, CLIENT)):
        extra = sent(net, src, dst) - sent(quiet, src, dst)
        assert extra <= spoofed[(dst, src)], (src, dst)
    for peer in net.nodes.values():
        stats = peer.endpoint.stats
        assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received
    total = sum(spoofed.values())
    drawn = sum(sent(net, n, VICTIM) for n in (SERVER, CLIENT))
    print(f"spoofed {total} B, drew {drawn} B to the victim ({drawn / total:.3f}x)")


# -- the CONNECT's cleartext layout fields ---------------------------------------------------


def _as_token(connect: bytes) -> bytes:
    """An on-path rewrite of a CONNECT whose parameters carry extensions: the same Noise
    message, its extensions declared as a connect token instead (CRC made right)."""
    request = wire.decode_connect(connect)
    assert request.extensions > 0 and not request.token_size
    size = handshake.first_message_size(request.pattern, 0, request.extensions)
    return wire.encode_connect(
        request.salt,
        request.pattern,
        request.cookie,
        request.rest[:size],
        len(connect),
        token_size=request.extensions,
    )


@pytest.mark.parametrize("keyed", [False, True], ids=["NN", "NK"])
def test_a_rewritten_split_of_the_first_message_fails_the_handshake(keyed: bool) -> None:
    # What the CONNECT says about its Noise message (extensions, token) travels outside
    # it. Rewritten, the server read the client's extensions as a token it does not
    # require, answered without extensions, and the handshake completed with them
    # silently dropped on both sides (no delayed acknowledgments): a downgrade.
    key = bytes(range(32))
    net = Network(seed=35)
    net.add(SERVER, Config(static_key=key), accept=True)
    client = net.add(CLIENT)

    def rewrite(data: bytes, src: Address, dst: Address) -> bool:
        if data[0] != 0xA1 or src != CLIENT:
            return False
        net.inject(_as_token(data), src, dst)
        return True  # the genuine one is dropped

    net.drop = rewrite
    server_key = rudp.public_key(key) if keyed else None
    conn = client.endpoint.connect(SERVER, net.now, server_key=server_key)
    net.run_until(lambda: conn.state is not State.CONNECTING, timeout=20)
    assert conn.state is State.CLOSED
    assert conn.peer_params is None
    (end,) = client.disconnects()
    if keyed:  # the server could not open the client's message
        assert end.reason is DisconnectReason.REFUSED and end.text == HANDSHAKE_FAILED
    else:  # the server's answers failed at the client, which waited for a genuine one
        assert end.reason is DisconnectReason.CONNECT_TIMEOUT and end.text == TIMEOUT_BAD_ANSWERS


# -- no Diffie-Hellman, no state, before a valid cookie ---------------------------------------


def _count_dh(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, count the X25519 exchanges in the returned cell: each reads the
    peer's public key once (``noise._dh``), through the name patched here, which the
    compiled build looks up at each call as the interpreted one does."""
    calls = [0]
    real = X25519PublicKey

    class CountingPublicKey:
        @staticmethod
        def from_public_bytes(data: bytes) -> Any:
            calls[0] += 1
            return real.from_public_bytes(data)

    monkeypatch.setattr(noise, "X25519PublicKey", CountingPublicKey)
    return calls


def test_no_diffie_hellman_and_no_state_before_a_valid_unused_cookie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = bytes(range(32))
    net = Network(seed=36)
    server = net.add(SERVER, Config(static_key=key), accept=True)
    ep = server.endpoint
    rng = random.Random(37)
    params = handshake.TransportParams(7, 1 << 20, 4, 1 << 20, 1200, 10_000, bytes(16), 25)
    nn = handshake.ClientHandshake(params, 5, None)
    nk = handshake.ClientHandshake(params, 5, rudp.public_key(key))

    def connect(salt: int, cookie: bytes, size: int = 1200, hs: Any = nn) -> bytes:
        return wire.encode_connect(salt, hs.pattern, cookie, hs.message, size, 0, hs.extensions)

    dh_calls = _count_dh(monkeypatch)  # (now that the clients' messages are written)

    good = ep._cookies.make(CLIENT, 5, net.now)
    attempts: list[tuple[bytes, Address, DropReason | None]] = [
        (connect(5, b""), CLIENT, None),  # a CHALLENGE, nothing else
        (connect(5, b"", size=200), CLIENT, DropReason.MALFORMED),
        (connect(5, rng.randbytes(20)), CLIENT, DropReason.BAD_COOKIE),
        (connect(5, good[:4] + rng.randbytes(16)), CLIENT, DropReason.BAD_COOKIE),
        (connect(6, good), CLIENT, DropReason.BAD_COOKIE),  # another salt
        (connect(5, good), STRANGER, DropReason.BAD_COOKIE),  # another address
        (connect(5, ep._cookies.make(CLIENT, 5, net.now - 25.0)), CLIENT, DropReason.BAD_COOKIE),
    ]
    for i in range(200):  # and a spoofed flood of fresh CONNECTs from many sources
        attempts.append((connect(rng.getrandbits(64), b""), (f"10.7.0.{i % 250}", i), None))
        hs = nn if i % 2 else nk
        forged = connect(rng.getrandbits(64), rng.randbytes(20), hs=hs)
        attempts.append((forged, CLIENT, DropReason.BAD_COOKIE))
    for data, src, want in attempts:
        reason, answers = _hit(net, server, data, src)
        assert reason is want
        assert sum(map(len, answers)) < len(data)
    assert dh_calls[0] == 0 and not ep.connections and not ep._cookies._used
    # The valid cookie: one connection, the responder's one DH of NN (ee).
    reason, answers = _hit(net, server, connect(5, good), CLIENT)
    assert reason is None and [a[0] for a in answers] == [0xA3]
    assert dh_calls[0] == 1 and len(ep.connections) == 1
    # Used: the same cookie with the same salt from elsewhere, or a new salt, opens nothing.
    assert _hit(net, server, connect(5, good), STRANGER)[0] is DropReason.BAD_COOKIE
    assert _hit(net, server, connect(6, good), CLIENT)[0] is DropReason.BAD_COOKIE
    assert dh_calls[0] == 1 and len(ep.connections) == 1


def test_a_replayed_losing_connect_of_a_simultaneous_open_costs_one_diffie_hellman(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two hosts that accept connections open one to each other at once; the side whose
    # salt won takes a late copy of the other's CONNECT apart (one DH) to tell it from a
    # restart. An attacker on the path who copied that CONNECT (its cookie is valid for
    # the sender's address) replayed it, and every copy cost another DH: a cookie is
    # worth one at most.
    net = Network(seed=38)
    a = net.add(SERVER, accept=True)
    b = net.add(CLIENT, accept=True)
    to_b = a.endpoint.connect(CLIENT, net.now)
    to_a = b.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: State.CONNECTING not in (to_b.state, to_a.state))
    winner, loser = (a, CLIENT) if to_b.salt > to_a.salt else (b, SERVER)
    losing = [
        d
        for d, src, _ in net.sent
        if src == loser and d[0] == 0xA1 and wire.decode_connect(d).cookie
    ][-1]
    dh_calls = _count_dh(monkeypatch)
    reasons = [_hit(net, winner, losing, loser)[0] for _ in range(50)]
    assert reasons[0] is DropReason.DUPLICATE
    assert set(reasons[1:]) == {DropReason.REPLAYED_COOKIE}
    assert dh_calls[0] == 1
    net.run(1)
    assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED
    assert not a.disconnects() and not b.disconnects()


def test_restarting_in_place_is_held_to_the_per_source_handshake_rate() -> None:
    # A source that holds a connection could start handshakes as fast as it liked by
    # "restarting" it (a new salt with a valid cookie from the connection's address):
    # the per-source rate was only counted for sources without a connection.
    net = Network(seed=39)
    limited = Config(handshake_rate_per_source=1.0, handshake_burst_per_source=2)
    server = net.add(SERVER, limited, accept=True)
    ep = server.endpoint
    params = handshake.TransportParams(7, 1 << 20, 4, 1 << 20, 1200, 10_000, bytes(16), 25)
    accepted = []
    for salt in range(1, 11):  # ten handshakes from one address within 0.1 s
        hs = handshake.ClientHandshake(params, salt, None)

        def connect(cookie: bytes, hs: Any = hs, salt: int = salt) -> bytes:
            return wire.encode_connect(salt, hs.pattern, cookie, hs.message, 1200, 0, 4)

        _, answers = _hit(net, server, connect(b""), CLIENT)
        (challenge,) = answers
        cookie = wire.decode_challenge(challenge).cookie
        _, answers = _hit(net, server, connect(cookie), CLIENT)
        accepted.append(bool(answers) and answers[0][0] == 0xA3)
        net.run(0.01)
    assert accepted[:2] == [True, True]  # the burst
    assert sum(accepted) == 2 and ep.stats.source_handshakes_limited == 8
    assert len(ep.connections) == 1


# -- a connection that names the server's key answers no CONNECT -----------------------------


def _settled(*conns: Connection) -> Callable[[], bool]:
    return lambda: all(c.state is not State.CONNECTING for c in conns)


def test_an_accepting_endpoint_connecting_with_nk_takes_no_connect_from_that_address() -> None:
    # The rule held only on endpoints that accept no one. On one that accepts, an
    # attacker on the path sent a CONNECT as the server, read the CHALLENGE it drew, and
    # his CONNECT with that cookie was taken for a restart of the server: our connect()
    # ended ("peer has no connection") and his unauthenticated handshake took its place.
    key = bytes(range(32))
    net = Network(seed=40)
    server = net.add(SERVER, Config(static_key=key), accept=True)
    host = net.add(CLIENT, accept=True)  # a host: it serves, and connects out too
    conn = host.endpoint.connect(SERVER, net.now, server_key=rudp.public_key(key))
    params = handshake.TransportParams(0x1234, 1 << 20, 4, 1 << 20, 1200, 30_000, b"A" * 16)
    attacker = handshake.ClientHandshake(params, (1 << 64) - 1, None)
    spoofed = wire.encode_connect((1 << 64) - 1, 0, b"", attacker.message, 1200)
    assert _hit(net, host, spoofed, SERVER) == (DropReason.UNEXPECTED, [])
    cookie = host.endpoint._cookies.make(SERVER, (1 << 64) - 1, net.now)  # as if read
    with_cookie = wire.encode_connect((1 << 64) - 1, 0, cookie, attacker.message, 1200)
    assert _hit(net, host, with_cookie, SERVER) == (DropReason.UNEXPECTED, [])
    assert host.endpoint.connections == [conn] and conn.state is State.CONNECTING
    net.run_until(_settled(conn), timeout=5)
    assert conn.server_authenticated and conn.state is State.CONNECTED  # type: ignore[comparison-overlap]
    assert not host.disconnects() and server.endpoint.stats.connections_accepted == 1


@pytest.mark.parametrize("accept", [(False, False), (True, False), (False, True), (True, True)])
def test_a_simultaneous_open_with_nk_on_one_side_completes(accept: tuple[bool, bool]) -> None:
    # A names B's key (NK) and never answers in place; B connects too, without a key.
    # When B's salt was the larger, B waited for A to answer its handshake and A for B
    # to answer A's: both timed out (or, A accepting, A's connect() was ended by B's
    # CONNECT). B holds the key A names, so B answers A's handshake whatever the salts.
    key = bytes(range(32))
    for seed in range(8):
        net = Network(seed=seed)
        a = net.add(SERVER, accept=accept[0])
        b = net.add(CLIENT, Config(static_key=key), accept=accept[1])
        to_b = a.endpoint.connect(CLIENT, net.now, server_key=rudp.public_key(key))
        to_a = b.endpoint.connect(SERVER, net.now)
        net.run_until(_settled(to_b, to_a), timeout=10)
        assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED, seed
        assert to_b.server_authenticated and to_b.handshake_hash == to_a.handshake_hash, seed
        assert a.endpoint.connections == [to_b] and b.endpoint.connections == [to_a], seed
        to_b.send(b"a to b")
        to_a.send(b"b to a")
        net.run(1)
        assert b.received() == [b"a to b"] and a.received() == [b"b to a"], seed
        assert not a.disconnects() and not b.disconnects(), seed


def test_a_query_reply_is_bytes_like_and_measured_in_bytes() -> None:
    # bytes(40) is forty zero bytes: an int was sent as such a reply; a memoryview's
    # len() counts its items.
    net = Network(seed=3)
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    client.endpoint.query(SERVER, b"info?", net.now, reply_room=64)
    net.run_until(lambda: any(isinstance(e, QueryReceived) for _, e in server.events))
    (event,) = [e for _, e in server.events if isinstance(e, QueryReceived)]
    with pytest.raises(TypeError):
        server.endpoint.reply_query(event, 40)  # type: ignore[arg-type]
    with pytest.raises(MessageTooLarge):  # 9 doubles: 72 bytes, 9 items
        server.endpoint.reply_query(event, memoryview(array.array("d", [0.0] * 9)))
    server.endpoint.reply_query(event, memoryview(b"abcdef")[::2])
    net.run(0.1)
    answers = [e for _, e in client.events if isinstance(e, QueryAnswered)]
    assert [a.payload for a in answers] == [b"ace"]
