"""The sans-IO core keeps a connection alive, and ends it when the peer is gone: keepalives,
timeouts, NOCONN replies, restarted peers. Stepped fake clock, in-memory network."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import State
from rudp.events import Disconnected, DisconnectReason
from rudp.wire import DropReason
from tests.rudp.harness import CLIENT, SERVER, Link, Network, frames_of, pair, server_conn

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


def _carries(payload: bytes) -> Callable[[bytes, object, object], bool]:
    """A targeted loss: every DATA datagram that carries ``payload``."""

    def drop(data: bytes, src: object, dst: object) -> bool:
        return wire.decode_type(data) is wire.PacketType.DATA and any(
            m[3] == payload for m in frames_of(data).messages
        )

    return drop


def test_a_message_the_peer_never_acknowledges_ends_the_connection() -> None:
    # The peer is heard all along (its keepalives and acknowledgments arrive), so no
    # idle timeout ends the connection; the one message it never takes does.
    net, server, client, conn = pair(config=Config(ack_timeout=30.0))
    net.drop = _carries(b"never taken")
    conn.send(b"delivered")
    net.run(0.5)
    handle = conn.send(b"never taken", channel=1)
    start = net.now
    for i in range(25):  # other messages keep flowing meanwhile
        net.run(1.0)
        conn.send(b"%d" % i, channel=2)
    net.run_until(lambda: conn.state is State.CLOSED, timeout=60)
    assert 30.0 <= net.now - start <= 30.5
    assert client.disconnects() == [Disconnected(DisconnectReason.UNACKNOWLEDGED)]
    assert handle.failed and b"never taken" not in server.received()
    # (A message that shared a datagram with it was lost with it, then resent apart.)
    assert {b"delivered", b"0", b"20"} <= set(server.received())


def test_messages_acknowledged_late_but_within_the_ack_timeout_keep_the_connection() -> None:
    net, server, client, conn = pair(config=Config(ack_timeout=30.0))
    net.drop = _carries(b"late")
    conn.send(b"late")
    net.run(25.0)
    net.drop = None  # the path heals: the next resend gets through
    net.run_until(lambda: server.received() == [b"late"], timeout=5)
    net.run(60.0)
    assert conn.state is State.CONNECTED


def test_a_message_unacknowledged_under_an_honest_pause_waits_for_the_resume() -> None:
    # A paused peer refuses what it cannot buffer, unacknowledged, until it resumes:
    # that is the pause's (peer_pause_timeout), and the message gets its whole
    # ack_timeout again from the resume.
    net, server, client, conn = pair(config=Config(ack_timeout=30.0))
    sconn = server_conn(server)
    net.drop = _carries(b"refused while paused")
    conn.send(b"refused while paused")
    net.run(0.1)
    sconn.pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    net.run(50.0)  # past ack_timeout, within peer_pause_timeout (60 s)
    assert conn.state is State.CONNECTED
    net.drop = None
    sconn.resume_receiving(net.now)
    net.run_until(lambda: server.received() == [b"refused while paused"], timeout=5)
    net.run(40.0)
    assert conn.state is State.CONNECTED


def test_a_peer_that_pauses_and_resumes_over_and_over_cannot_hold_a_message_for_good() -> None:
    # Each resume used to give the message a fresh ack_timeout: a receiver flapping
    # its pause (9 s paused, 1 s not) held a message the path never delivers for
    # good. The count is of the time the peer could take it: 5 s here, about 50 s
    # of flapping.
    net, server, client, conn = pair(config=Config(ack_timeout=5.0))
    sconn = server_conn(server)
    net.drop = _carries(b"never delivered")
    conn.send(b"never delivered")
    start = net.now
    while conn.state is State.CONNECTED and net.now - start < 200:
        sconn.pause_receiving()
        net.run(9.0)
        sconn.resume_receiving(net.now)
        net.run(1.0)
    assert client.disconnects() == [Disconnected(DisconnectReason.UNACKNOWLEDGED)]
    assert 45 <= net.now - start <= 60


@pytest.mark.parametrize("closing", [False, True])
def test_a_peer_resuming_for_a_moment_between_pauses_cannot_hold_a_message_for_good(
    closing: bool,
) -> None:
    # Pauses shorter than peer_pause_timeout (and than close_timeout when closing) with
    # a resume of 1 ms between them: each resume restarts both, and the unpaused time
    # crept on at 1 ms a pause, so a message the peer never takes (and a close waiting
    # for it) lasted for hours. At most peer_pause_timeout of pauses is left out of
    # its count now.
    config = Config(ack_timeout=30.0, peer_pause_timeout=60.0, close_timeout=3.0)
    net, server, client, conn = pair(config=config)
    sconn = server_conn(server)
    net.drop = _carries(b"never taken")
    conn.send(b"never taken")
    net.run(0.1)
    start = net.now
    if closing:
        conn.close(net.now)
    while conn.state is not State.CLOSED and net.now - start < 600:
        sconn.pause_receiving()
        net.run(2.5 if closing else 9.0)
        sconn.resume_receiving(net.now)
        net.run(0.001)
    assert client.disconnects() == [Disconnected(DisconnectReason.UNACKNOWLEDGED)]
    assert 85 <= net.now - start <= 100


def test_a_pause_that_holds_an_unacknowledged_message_is_timed_too() -> None:
    net, server, client, conn = pair(config=Config(ack_timeout=30.0, peer_pause_timeout=40.0))
    sconn = server_conn(server)
    net.drop = _carries(b"refused while paused")
    conn.send(b"refused while paused")
    net.run(0.1)
    sconn.pause_receiving()
    net.run_until(lambda: conn.state is State.CLOSED, timeout=60)
    assert client.disconnects() == [Disconnected(DisconnectReason.PEER_PAUSED)]


def test_the_oldest_unacknowledged_record_stays_bounded_behind_a_stuck_message() -> None:
    # Acknowledged messages behind one the peer never takes are not kept for its sake.
    net, server, client, conn = pair(config=Config(ack_timeout=30.0))
    net.drop = _carries(b"stuck")
    conn.send(b"stuck", channel=1)
    for i in range(2000):
        conn.send(b"m%d" % i, channel=2)
        if i % 100 == 0:
            net.run(0.2)
    net.run(2.0)
    assert conn.state is State.CONNECTED
    assert len(conn._sender.sent_order) <= 2 * conn.queued + 64


def test_ack_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ack_timeout"):
        Config(ack_timeout=0)


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


def test_a_reset_token_drawn_from_another_address_ends_nothing() -> None:
    # A token was HMAC(secret, id) alone: anyone could draw the NOCONN of any id not
    # in use (here from a server sharing the key, as after a restart), keep it, and
    # end whichever connection came to have that id. It is bound to the address now.
    evil = ("10.6.6.6", 4444)
    net, server, client, conn = pair(config=KEYED)
    other = net.add(("10.0.0.9", 9000), KEYED, accept=True)
    start = len(net.sent)
    net.inject(wire.data_prefix(conn.peer_cid, 1) + bytes(40), evil, ("10.0.0.9", 9000))
    net.run(0.01)
    noconns = [d for d, src, dst in net.sent[start:] if dst == evil and d[0] == 0xA6]
    assert len(noconns) == 1 and other.endpoint.stats.noconn_suppressed == 0
    net.inject(noconns[0], SERVER, CLIENT)  # replayed from the server's address
    net.run(1)
    assert conn.state is State.CONNECTED
    assert client.endpoint.stats.dropped[DropReason.BAD_TOKEN] == 1
    # The NOCONN the server itself would send after forgetting us is still believed.
    genuine = wire.encode_noconn(conn.peer_cid, server_conn(server).reset_token)
    net.inject(genuine, SERVER, CLIENT)
    net.run(0.1)
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


# -- the endpoint's timers -------------------------------------------------------------------


def test_connections_armed_at_one_instant_share_a_timer_entry_and_each_fires() -> None:
    """Connections that take a packet in the same read share its ``now`` and so their
    acknowledgment deadline: one heap entry for all of them, and each connection's
    acknowledgment still leaves alone when that deadline comes (nothing else to carry
    it); entries left by connections re-armed since are dropped as they surface."""
    net = Network(seed=3)
    config = Config(max_ack_delay=0.025, keepalive_interval=5.0)
    server = net.add(SERVER, config, accept=True)
    conns = [
        net.add((f"10.0.1.{i}", 6000), config).endpoint.connect(SERVER, net.now) for i in range(48)
    ]
    net.run_until(lambda: all(c.state is State.CONNECTED for c in conns))
    net.run(1.0)  # handshakes and path MTU probes settle
    core = server.endpoint
    before = {c: c.stats.acks_alone for c in core.connections}
    for conn in conns:
        conn.send(b"input")  # all arrive at the server at one instant
    net.run(0.010)
    assert len(server.received()) == 48
    deadline = core.get_timer()
    assert deadline is not None
    assert len(core._at[deadline]) == 48 and len(core._heap) <= 4
    net.run(0.030)  # past max_ack_delay: each connection's acknowledgment went alone
    assert all(c.stats.acks_alone == before[c] + 1 for c in core.connections)
    for _ in range(120):  # a minute of 60 Hz-ish traffic, every side re-armed often
        for conn in conns:
            conn.send(b"tick")
        for sconn in core.connections:
            sconn.send(b"snapshot", reliable=False)
        net.run(0.5)
    assert core._entries == sum(len(cids) for cids in core._at.values())
    assert core._entries <= 2 * len(core._armed) + 64
    assert len(core._heap) == len(core._at) and set(core._heap) == set(core._at)
