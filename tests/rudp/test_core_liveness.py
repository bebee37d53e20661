"""The sans-IO core keeps a connection alive, and ends it when the peer is gone: keepalives,
timeouts, NOCONN replies, restarted peers. Stepped fake clock, in-memory network."""

from __future__ import annotations

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import State
from rudp.events import Disconnected, DisconnectReason
from rudp.wire import DropReason
from tests.rudp.harness import CLIENT, SERVER, Link, Network, pair, server_conn

# -- liveness ---------------------------------------------------------------------------------


def test_keepalive_holds_an_idle_connection_open() -> None:
    net, server, client, conn = pair(Link(loss=0.3))
    net.run(120)
    assert conn.state is State.CONNECTED
    assert server_conn(server).state is State.CONNECTED


def test_silence_ends_both_sides_with_timeout() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    net.link.blackout = True
    start = net.now
    net.run(20)
    assert conn.state is State.CLOSED and sconn.state is State.CLOSED
    assert client.disconnects() == [Disconnected(DisconnectReason.TIMEOUT)]
    assert server.disconnects() == [Disconnected(DisconnectReason.TIMEOUT)]
    assert conn.close_reason is not None
    assert net.now - start >= 10


# A server that restarts keeps its static key, from which its NOCONN reset tokens derive:
# that is what lets its old clients believe it (without a key they time out instead).
KEYED = Config(static_key=bytes(range(32)))


def test_forgotten_peer_learns_by_noconn_within_a_round_trip() -> None:
    net, server, client, conn = pair(Link(delay=0.02), config=KEYED)
    net.remove(SERVER)
    net.add(SERVER, KEYED, accept=True)  # the server restarted: it knows nobody
    conn.send(b"are you there?")
    sent_at = net.now
    net.run_until(lambda: conn.state is State.CLOSED)
    assert net.now - sent_at == pytest.approx(0.04)
    assert client.disconnects() == [Disconnected(DisconnectReason.NO_CONNECTION, by_peer=True)]


def test_spoofed_noconn_is_ignored() -> None:
    net, server, client, conn = pair()
    for i in range(60):  # the right connection id, guessed tokens
        net.inject(wire.encode_noconn(conn.peer_cid, i.to_bytes(16, "big")), SERVER, CLIENT)
    # The right token about another connection id: a NOCONN names the packet that caused it.
    net.inject(wire.encode_noconn(conn.peer_cid ^ 1, conn._peer_reset_token), SERVER, CLIENT)
    net.run(1)
    assert conn.state is State.CONNECTED
    assert client.endpoint.stats.dropped[DropReason.BAD_TOKEN] == 61


def test_noconn_replies_are_rate_limited_and_never_larger_than_the_trigger() -> None:
    net = Network()
    server = net.add(SERVER, Config(noconn_burst=10, noconn_rate=1.0), accept=True)
    packet = wire.data_prefix(5, 1) + bytes(wire.DATA_HEADER_SIZE)  # no connection 5 here
    for i in range(100):
        net.inject(packet, ("10.0.0.7", 1000 + i), SERVER)
    net.run(0.5)
    replies = [d for d, s, _ in net.sent if s == SERVER]
    assert len(replies) == 10
    assert all(len(r) <= len(packet) for r in replies)
    assert server.endpoint.stats.noconn_suppressed == 90
    # Each datagram is counted once, under its own drop reason.
    assert server.endpoint.stats.datagrams_dropped == 100


def test_restarted_client_replaces_its_old_session() -> None:
    net, server, client, conn = pair()
    old = server_conn(server)
    net.remove(CLIENT)
    again = net.add(CLIENT)  # same address, new process
    fresh = again.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: fresh.state is State.CONNECTED)
    assert old.state is State.CLOSED
    assert server.disconnects() == [Disconnected(DisconnectReason.NO_CONNECTION, by_peer=True)]
    assert server_conn(server) is not old
