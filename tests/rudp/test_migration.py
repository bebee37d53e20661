"""Connection migration on the stepped fake clock: a peer whose address changes (a NAT
rebinding) keeps its connection once the new address answers a path challenge; replays,
reordered packets and spoofed copies never move it, and a new address never gets more
bytes than it sent before it is validated."""

from __future__ import annotations

from typing import Any

import pytest

from rudp import frames, wire
from rudp.config import Config
from rudp.congestion import CongestionController
from rudp.connection import Connection, State
from rudp.events import PathChanged
from rudp.migration import CHALLENGE_TRIES
from rudp.wire import DropReason
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Network,
    Node,
    frames_of,
    pair,
    server_conn,
    settle,
    tagged,
    tags,
)

NEW = ("10.0.0.99", 40000)  # where the moving side's NAT maps it after the rebinding
ATTACKER = ("10.6.6.6", 6666)


def _challenges(net: Network, dst: tuple[Any, ...]) -> list[bytes]:
    return [d for d, _, to in net.sent if to == dst and frames_of(d).challenge]


def _bytes(net: Network, src: tuple[Any, ...] | None, dst: tuple[Any, ...] | None) -> int:
    return sum(
        len(d) for d, s, to in net.sent if (src is None or s == src) and (dst is None or to == dst)
    )


def _stream(net: Network, a: Connection, b: Connection, n: int, start: int = 0) -> None:
    """``n`` tagged reliable messages each way, one every 5 ms."""
    for i in range(start, start + n):
        a.send(tagged(i))
        b.send(tagged(i))
        net.run(0.005)


@pytest.mark.parametrize("mover", ["client", "server"])
def test_a_rebinding_mid_stream_moves_the_connection_and_nothing_is_lost_or_duplicated(
    mover: str,
) -> None:
    # Symmetric: either side may move; the other validates its new address.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    old, (watcher, moved_conn, watching_conn) = (
        (CLIENT, (server, conn, sconn)) if mover == "client" else (SERVER, (client, sconn, conn))
    )
    _stream(net, conn, sconn, 100)
    net.move(old, NEW)
    moved_at = len(net.sent)
    _stream(net, conn, sconn, 200, start=100)
    settle(net, conn)
    settle(net, sconn)
    assert tags(server) == list(range(300)) and tags(client) == list(range(300))
    assert conn.state is State.CONNECTED and sconn.state is State.CONNECTED
    assert watching_conn.address == NEW and moved_conn.address != NEW
    assert watching_conn.stats.migrations == 1 and watching_conn.stats.path_challenges >= 1
    assert moved_conn.stats.path_responses >= 1
    assert [e for _, e in watcher.events if isinstance(e, PathChanged)] == [PathChanged(old, NEW)]
    assert watcher.endpoint.connection(NEW) is watching_conn
    assert watcher.endpoint.connection(old) is None
    # Before the move, the new address got challenges only, never more than it sent.
    validated = next(
        i
        for i, (_, s, to) in enumerate(net.sent)
        if i > moved_at and to == NEW and not (frames_of(net.sent[i][0]).challenge)
    )
    before = net.sent[:validated]
    to_new = sum(len(d) for d, _, to in before[moved_at:] if to == NEW)
    from_new = sum(len(d) for d, s, _ in before[moved_at:] if s == NEW)
    assert 0 < to_new <= from_new
    stats = watcher.endpoint.stats
    assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received


def test_a_replayed_packet_from_another_address_moves_nothing() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    conn.send(b"once")
    net.run(1)
    old = [d for d, s, _ in net.sent if s == CLIENT and d[0] == wire.DATA_BYTE]
    net.run(0.1)  # the last of them (a keepalive) may still be on its way
    for packet in old:
        net.inject(packet, ATTACKER, SERVER)
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.REPLAYED] == len(old)
    assert not [d for d, _, to in net.sent if to == ATTACKER]
    assert sconn.address == CLIENT and sconn._migration.path is None
    assert sconn.stats.path_challenges == sconn.stats.migrations == 0
    assert server.received() == [b"once"]


def test_an_older_packet_from_another_address_is_delivered_but_moves_nothing() -> None:
    # Reordered, or delayed by an attacker and sent from elsewhere: authentic and new, so
    # its messages count, but it is not the newest packet: no challenge, no move.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    ack = wire.ack_fields(0, 0)
    older = conn.seal_datagram(ack + frames.unreliable_frame(0, b"older"))
    newer = conn.seal_datagram(ack + frames.unreliable_frame(0, b"newer"))
    server.endpoint.receive_datagram(newer, CLIENT, net.now)
    server.endpoint.receive_datagram(older, ATTACKER, net.now)
    net.run(0.5)
    assert server.received() == [b"newer", b"older"]
    assert sconn._migration.path is None and sconn.stats.path_challenges == 0
    assert not [d for d, _, to in net.sent if to == ATTACKER]
    assert sconn.address == CLIENT


def test_a_spoofed_copy_of_a_genuine_packet_draws_at_most_its_size_and_cannot_hijack() -> None:
    # An on-path attacker copies a genuine packet and races it from another source. It is
    # the newest and authenticates, so the server challenges that source: with at most
    # the copy's size. The client never sees the challenge, the genuine path carries on.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    copies: list[bytes] = []

    def race(data: bytes, src: tuple[Any, ...], dst: tuple[Any, ...]) -> None:
        if src == CLIENT and data[0] == wire.DATA_BYTE and not copies and len(data) > 100:
            copies.append(data)
            net.inject(data, ATTACKER, dst)  # arrives first: the link delays the genuine one

    net.tap = race
    conn.send(bytes(200))
    net.run(0.5)
    net.tap = None
    (copy,) = copies
    assert server.endpoint.stats.dropped[DropReason.REPLAYED] == 1  # the genuine one, late
    assert server.received() == [bytes(200)]  # delivered once, from the copy
    _stream(net, conn, sconn, 50)
    settle(net, conn)
    settle(net, sconn)
    assert 0 < _bytes(net, SERVER, ATTACKER) <= len(copy)
    assert len(_challenges(net, ATTACKER)) == sconn.stats.path_challenges >= 1
    assert sconn.address == CLIENT and sconn.stats.migrations == 0
    assert sconn.stats.path_validation_failures == 1 and sconn._migration.path is None
    assert tags(server)[1:] == list(range(50)) and tags(client) == list(range(50))
    assert not client.disconnects() and not server.disconnects()


def test_lost_challenges_are_resent_and_the_move_completes() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    lost: list[bytes] = []

    def lose_two_challenges(data: bytes, src: tuple[Any, ...], dst: tuple[Any, ...]) -> bool:
        if dst == NEW and frames_of(data).challenge and len(lost) < 2:
            lost.append(data)
            return True
        return False

    net.drop = lose_two_challenges
    _stream(net, conn, sconn, 50)
    net.move(CLIENT, NEW)
    _stream(net, conn, sconn, 150, start=50)
    settle(net, conn)
    settle(net, sconn)
    assert len(lost) == 2
    assert sconn.stats.path_challenges == 3 and sconn.stats.migrations == 1
    assert sconn.stats.path_validation_failures == 0
    assert sconn.address == NEW
    assert tags(server) == list(range(200)) and tags(client) == list(range(200))


def test_unanswered_challenges_are_bounded_and_never_amplify() -> None:
    # The new address never answers (the return path is broken): each validation sends
    # at most CHALLENGE_TRIES challenges, then gives up; a later packet from there may
    # start another, but what goes there never exceeds what came from there.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    net.drop = lambda data, src, dst: dst == NEW
    net.move(CLIENT, NEW)
    for i in range(30):
        conn.send(tagged(i))
        net.run(0.1)
    challenges = sconn.stats.path_challenges
    failures = sconn.stats.path_validation_failures
    assert failures >= 1
    assert challenges <= CHALLENGE_TRIES * (failures + 1)
    assert _bytes(net, SERVER, NEW) <= _bytes(net, NEW, SERVER)
    assert sconn.address == CLIENT and sconn.stats.migrations == 0
    assert tags(server) == list(range(30))  # its packets still arrive, from there
    # Once the way back works, the next validation completes and nothing is lost.
    net.drop = None
    for i in range(30, 40):
        conn.send(tagged(i))
        net.run(0.1)
    settle(net, conn)
    assert sconn.address == NEW and sconn.stats.migrations == 1
    assert tags(server) == list(range(40))


def _node_of(net: Network, conn: Connection) -> Node:
    return next(n for n in net.nodes.values() if conn in n.endpoint.connections)


def test_a_new_address_held_by_another_connection_is_never_taken() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    other = net.add(NEW).endpoint.connect(SERVER, net.now)
    net.run_until(lambda: other.state is State.CONNECTED)
    # The first client's genuine packet arrives from the other client's address.
    packet = conn.seal_datagram(wire.ack_fields(0, 0) + frames.unreliable_frame(0, b"x"))
    server.endpoint.receive_datagram(packet, NEW, net.now)
    net.run(1)
    assert sconn.address == CLIENT and sconn._migration.path is None
    assert sconn.stats.path_challenges == 0
    assert server.endpoint.connection(NEW) is not sconn
    assert _node_of(net, other) is net.nodes[NEW]


def _bulk(net: Network, sender: Connection) -> None:
    """Enough data from ``sender`` to open its congestion window."""
    for _ in range(40):
        sender.send(bytes(20_000))
        net.run(0.005)


@pytest.mark.parametrize(
    ("new", "path_mtu"),
    [(("2001:db8::2", 5000, 0, 0), 1452), (("10.0.0.77", 5000), 1472)],
    ids=["ipv4-to-ipv6", "another-ipv4"],
)
def test_a_move_to_another_ip_starts_the_path_over(new: tuple[Any, ...], path_mtu: int) -> None:
    # Another IP is another network path (RFC 9000, section 9.4): the RTT estimate,
    # the congestion window and the path MTU learned on the old one are dropped.
    config = Config(congestion_control=True)
    initial = CongestionController(config).cwnd
    net, server, client, conn = pair(config=config)
    sconn = server_conn(server)
    _stream(net, conn, sconn, 200)
    _bulk(net, sconn)
    settle(net, conn)
    settle(net, sconn)
    assert sconn.stats.path_mtu == 1472 and sconn._rtt.samples > 10
    assert sconn._cc.cwnd > initial
    net.move(CLIENT, new)
    conn.send(tagged(200))
    net.run_until(lambda: sconn.stats.migrations == 1)
    assert sconn.address == new
    assert sconn.stats.path_mtu == 1200  # back to the base size
    assert sconn._rtt.samples <= 1 and sconn._cc.cwnd == initial
    _stream(net, conn, sconn, 100, start=201)
    settle(net, conn)
    settle(net, sconn)
    assert tags(server) == list(range(301))
    assert sconn.stats.path_mtu == path_mtu  # searched again, up to the new path's ceiling


def test_a_port_only_move_keeps_the_path() -> None:
    # A NAT rebinding: same IP, another port, the same network path.
    config = Config(congestion_control=True)
    net, server, client, conn = pair(config=config)
    sconn = server_conn(server)
    _stream(net, conn, sconn, 200)
    _bulk(net, sconn)
    settle(net, conn)
    settle(net, sconn)
    assert sconn._cc.cwnd > CongestionController(config).cwnd
    samples, cwnd, srtt = sconn._rtt.samples, sconn._cc.cwnd, sconn._rtt.srtt
    probes = sconn.stats.mtu_probes_sent
    net.move(CLIENT, (CLIENT[0], 40001))
    conn.send(tagged(200))
    net.run_until(lambda: sconn.stats.migrations == 1)
    assert sconn.address == (CLIENT[0], 40001)
    assert sconn._rtt.samples >= samples and sconn._rtt.srtt > 0
    assert sconn._cc.cwnd >= cwnd and sconn.stats.path_mtu == 1472
    settle(net, sconn)
    assert sconn.stats.mtu_probes_sent == probes  # nothing searched again
    assert abs(sconn._rtt.srtt - srtt) < srtt
