"""Delayed acknowledgments, the resend timer that allows for them, and redundancy that
follows the measured loss. Fake clock and in-memory network only."""

from __future__ import annotations

import contextlib
import random

import pytest

from rudp import handshake, wire
from rudp.config import Config
from rudp.connection import Connection
from rudp.endpoint import Endpoint
from rudp.wire import PacketType
from tests.rudp.harness import CLIENT, SERVER, Link, Network, Node, pair, server_conn

DELAY = Config().max_ack_delay
ONE_WAY = Link().delay


def _record(net: Network) -> list[tuple[float, object, bytes]]:
    """Every datagram put on the wire from now on: (time, source, bytes)."""
    sent: list[tuple[float, object, bytes]] = []
    net.tap = lambda data, src, dst: sent.append((net.now, src, data))
    return sent


def _from(sent: list[tuple[float, object, bytes]], src: object) -> list[float]:
    return [t for t, s, _ in sent if s == src]


def _quiet_pair(
    link: Link | None = None, config: Config | None = None
) -> tuple[Network, Node, Node, Connection, Connection]:
    net, server, client, conn = pair(link, config=config)
    net.run(2 * DELAY)  # the handshake's own acknowledgments are out of the way
    return net, server, client, conn, server_conn(server)


def test_an_acknowledgment_waits_and_rides_on_the_next_packet() -> None:
    net, server, client, conn, sconn = _quiet_pair()
    alone = sconn.stats.acks_alone
    sent = _record(net)
    conn.send(b"input")
    start = net.now
    net.run(ONE_WAY + DELAY / 2)  # the input arrived; its acknowledgment waits
    assert _from(sent, SERVER) == []
    assert conn._recovery.sent  # not acknowledged yet
    sconn.send(b"snapshot", reliable=False)
    net.run(ONE_WAY + 0.001)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY + DELAY / 2)]
    assert not conn._recovery.sent  # the snapshot's packet carried the acknowledgment
    assert sconn.stats.acks_alone == alone


def test_an_acknowledgment_goes_alone_at_the_deadline() -> None:
    net, server, client, conn, sconn = _quiet_pair()
    alone = sconn.stats.acks_alone
    sent = _record(net)
    start = net.now
    conn.send(b"input")
    net.run(0.2)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY + DELAY)]
    assert sconn.stats.acks_alone == alone + 1
    assert not conn._recovery.sent
    # The ACK_DELAY frame took the wait off the RTT sample.
    assert conn.stats.srtt == pytest.approx(2 * ONE_WAY, abs=0.002)


def test_a_gap_is_acknowledged_at_once() -> None:
    net, server, client, conn, sconn = _quiet_pair()
    net.link.blackout = True
    conn.send(b"lost")
    net.flush()
    net.link.blackout = False
    sent = _record(net)
    start = net.now
    conn.send(b"after the gap")
    net.run(ONE_WAY + 0.001)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY)]


def test_every_second_packet_and_a_ping_are_acknowledged_at_once() -> None:
    net, server, client, conn, sconn = _quiet_pair()
    sent = _record(net)
    start = net.now
    conn.send(b"one")
    net.flush()
    conn.send(b"two")  # a second packet, sent in the same instant
    net.run(ONE_WAY + 0.001)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY)]
    net.run(1.0)
    sent.clear()
    start = net.now
    conn._builder.ping = True
    client.endpoint._sink.dirty[conn] = None
    net.run(ONE_WAY + 0.001)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY)]


def test_the_resend_timer_allows_for_the_peers_ack_delay() -> None:
    # Lone messages, each acknowledged only at the peer's deadline, on a clean path:
    # the resend timer (RFC 9002's PTO) waits for that delay and nothing is resent.
    net, server, client, conn, sconn = _quiet_pair()
    for i in range(40):
        conn.send(bytes([i]))
        net.run(0.1)
    assert len(server.received()) == 40
    assert conn.stats.timeouts == 0
    assert conn.stats.messages_resent == 0
    assert conn.stats.spurious_losses == 0
    # The samples are the path's (the ACK_DELAY frame took the wait off them) and the
    # timeout adds the delay the peer stated.
    assert conn.stats.srtt == pytest.approx(2 * ONE_WAY, abs=0.002)
    assert conn.stats.rto >= conn.stats.srtt + DELAY


@pytest.mark.parametrize("reliable_snapshot", [False, True], ids=["unreliable", "reliable"])
def test_a_60_hz_server_sends_one_datagram_per_client_per_tick(reliable_snapshot: bool) -> None:
    # Each tick the client sends a 32-byte reliable input and the server a 200-byte
    # snapshot: every acknowledgment rides on the other side's next packet, and traffic
    # both ways makes keepalives unnecessary.
    link = Link(delay=0.010, jitter=0.002)
    net, server, client, conn, sconn = _quiet_pair(link)
    tick = 1 / 60
    ticks, warmup = 300, 30
    start = net.now
    sent: list[tuple[float, object, bytes]] = []
    for n in range(ticks):
        net.run(max(0.0, start + n * tick - net.now))
        if n == warmup:
            sent = _record(net)
        conn.send(bytes(32))
        sconn.send(bytes(200), reliable=reliable_snapshot)
    net.run(0.001)
    net.tap = None
    net.run(0.1)
    measured = ticks - warmup
    assert len(_from(sent, CLIENT)) == measured
    assert len(_from(sent, SERVER)) == measured
    assert len(server.received(sconn)) == ticks
    for c in (conn, sconn):
        assert c.stats.timeouts == 0 and c.stats.messages_resent == 0
        # No wake-up for an acknowledgment that left with the next tick's data: an
        # entry armed for it is moved when it falls due, not run (it was every other
        # tick: 105 and 160 of these 300 ticks).
        assert c.stats.timer_wakeups < 10, c.stats.timer_wakeups


def test_a_burst_is_acknowledged_without_holes_when_an_ack_is_lost() -> None:
    # Packets arriving faster than one header acknowledges them are acknowledged in
    # ack-only packets, each packet in two of them: one lost ack leaves none behind.
    # (No path MTU probes: their packets are accounted apart.)
    config = Config(max_datagram_size=Config().base_datagram_size)
    net, server, client, conn, sconn = _quiet_pair(Link(delay=0.02, loss=0.02), config)
    for i in range(2000):
        conn.send(bytes([i % 256]) * 1000)
    net.run_until(lambda: conn.queued == 0, timeout=30)
    assert conn.stats.spurious_losses == 0
    # Every loss declared was a datagram the link dropped.
    assert conn.stats.packets_lost == conn.stats.packets_sent - sconn.stats.packets_received


def test_redundancy_follows_the_measured_loss() -> None:
    net, server, client, conn, sconn = _quiet_pair(Link(delay=0.02))

    def stream(seconds: float) -> None:
        for _ in range(int(seconds * 1000)):
            conn.send(bytes(200))
            net.run(0.001)

    stream(1.0)  # a clean path: no copies at all
    assert conn._builder.redundancy_level() == 0
    assert conn.stats.messages_redundant == 0
    net.link.loss = 0.05
    net.link.jitter = 0.005
    stream(2.0)
    assert conn._builder.redundancy_level() == 2
    assert conn.stats.messages_redundant > 1000
    net.link.loss = net.link.jitter = 0.0
    stream(2.0)  # the path heals: the copies stop
    assert conn._builder.redundancy_level() == 0
    copies = conn.stats.messages_redundant
    stream(0.5)
    assert conn.stats.messages_redundant == copies
    net.run(1.0)
    assert len(server.received()) == 5500


def test_a_client_that_states_no_extensions_gets_immediate_acks() -> None:
    # An earlier version-2 client: 35-byte parameters, no max_ack_delay. The server
    # answers in kind and acknowledges at once, as that client's resend timer expects.
    net = Network(seed=3)
    server = net.add(SERVER, Config(), accept=True)
    endpoint: Endpoint = server.endpoint
    params = handshake.TransportParams(77, 1 << 20, 4, 1 << 20, 1200, 30_000, b"T" * 16)
    old = handshake.ClientHandshake(params, 5, None, None)
    assert not old.extended and old.extensions == -1
    connect = wire.encode_connect(5, old.pattern, b"", old.message, 1200)
    assert connect[10] == handshake.PATTERN_NN  # no flag in the pattern byte
    endpoint.receive_datagram(connect, CLIENT, net.now)
    (challenge, _), *_ = endpoint.datagrams_to_send(net.now)
    cookie = wire.decode_challenge(challenge).cookie
    connect = wire.encode_connect(5, old.pattern, cookie, old.message, 1200)
    endpoint.receive_datagram(connect, CLIENT, net.now)
    accepts = [d for d, _ in endpoint.datagrams_to_send(net.now)]
    accepts = [d for d in accepts if wire.decode_type(d) is PacketType.ACCEPT]
    (accept,) = accepts
    message = wire.decode_accept(accept).message
    assert len(message) == handshake.SECOND_MESSAGE_SIZE
    keys = old.finish(message)
    assert keys.peer.max_ack_delay_ms is None
    sconn = server_conn(server)
    assert sconn._builder.ack_delay == 0.0 and sconn._rtt.peer_ack_delay == 0.0


def test_two_current_peers_state_and_use_their_ack_delay() -> None:
    config = Config(max_ack_delay=0.010)
    net, server, client, conn = pair(config=config)
    sconn = server_conn(server)
    for c in (conn, sconn):
        assert c.peer_params is not None and c.peer_params.max_ack_delay_ms == 10
        assert c._builder.ack_delay == 0.010 and c._rtt.peer_ack_delay == 0.010


def test_max_ack_delay_zero_acknowledges_at_once() -> None:
    net, server, client, conn = pair(config=Config(max_ack_delay=0.0))
    net.run(0.1)
    sent = _record(net)
    start = net.now
    conn.send(b"x")
    net.run(ONE_WAY + 0.001)
    assert _from(sent, SERVER) == [pytest.approx(start + ONE_WAY)]


def test_transport_parameter_extensions_round_trip_and_unknown_ones_are_skipped() -> None:
    params = handshake.TransportParams(1, 1000, 2, 5000, 1200, 10_000, bytes(16), 25)
    data = params.encode()
    assert len(data) == handshake.PARAMS_SIZE + 4
    assert handshake.TransportParams.decode(data) == params
    unknown = bytes((200, 3)) + b"abc"
    assert handshake.TransportParams.decode(data + unknown) == params
    plain = handshake.TransportParams.decode(data[: handshake.PARAMS_SIZE])
    assert plain.max_ack_delay_ms is None and plain.encode() == data[: handshake.PARAMS_SIZE]
    for bad in (data[:-1], data + b"\x07", data[: handshake.PARAMS_SIZE] + b"\x01\x02\xff\xff"):
        with pytest.raises(ValueError):
            handshake.TransportParams.decode(bad)
    rng = random.Random(1)
    for _ in range(200):  # garbage after the fixed part: a value or ValueError, never more
        tail = bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        with contextlib.suppress(ValueError):
            handshake.TransportParams.decode(data[: handshake.PARAMS_SIZE] + tail)


def test_config_refuses_a_max_ack_delay_out_of_range() -> None:
    for bad in (-0.001, 17.0):
        with pytest.raises(ValueError, match="max_ack_delay"):
            Config(max_ack_delay=bad)
