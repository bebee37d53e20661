"""What ``conn.stats`` reports on a stepped clock: the path's loss counted from every
packet (unreliable ones too), and the recent byte rates each way."""

from __future__ import annotations

from rudp import Delivery
from rudp.stats import COUNTERS, RECENT_PACKETS, ConnectionStats
from tests.rudp.harness import CLIENT, SERVER, Address, Network, pair, server_conn

TICK = 1 / 30  # a 30 Hz snapshot stream


def drop_every(net: Network, nth: int) -> list[int]:
    """Lose every ``nth`` datagram from the client to the server; returns the count."""
    dropped = [0]
    seen = [0]
    transmit = net._transmit

    def lossy(data: bytes, src: Address, dst: Address) -> None:
        if src == CLIENT and dst == SERVER:
            seen[0] += 1
            if seen[0] % nth == 0:
                dropped[0] += 1
                return
        transmit(data, src, dst)

    net._transmit = lossy  # type: ignore[method-assign]
    return dropped


def test_loss_of_unreliable_snapshots_is_counted_where_packets_lost_sees_none() -> None:
    net, _, _, conn = pair()
    dropped = drop_every(net, 20)  # 5 %
    for tick in range(630):
        conn.send(b"snapshot %d" % tick + bytes(200), reliable=False)
        net.run(TICK)
    net.run(1.0)
    received = server_conn(net.nodes[SERVER]).stats
    assert dropped[0] >= 31
    # What the old counter sees: only the ack-eliciting packets (the keepalive pings).
    assert conn.stats.packets_lost <= 3
    # Every packet of the peer counts: snapshots, and the pings that keep it alive.
    assert received.packets_missing == dropped[0]
    sent = conn.stats.packets_sent
    assert received.inbound_loss == dropped[0] / sent
    assert 0.045 < received.inbound_loss < 0.055
    assert abs(received.recent_inbound_loss - 0.05) <= 0.01
    assert received.as_dict()["packets_missing"] == dropped[0]


def test_a_reordered_packet_is_missing_only_until_it_arrives() -> None:
    net, server, _, conn = pair()
    held: list[tuple[bytes, Address, Address]] = []
    transmit = net._transmit

    def hold_one(data: bytes, src: Address, dst: Address) -> None:
        if src == CLIENT and not held:
            held.append((data, src, dst))
            return
        transmit(data, src, dst)

    net._transmit = hold_one  # type: ignore[method-assign]
    for i in range(3):
        conn.send(b"%d" % i, reliable=False)
        net.run(0.01)
    stats = server_conn(server).stats
    assert stats.packets_missing == 1
    transmit(*held[0])
    net.run(0.1)
    assert stats.packets_missing == 0 and stats.inbound_loss == 0.0


def test_recent_loss_forgets_a_burst_after_its_window() -> None:
    net, server, _, conn = pair()
    dropped = drop_every(net, 2)  # a burst: half the packets
    for _ in range(50):
        conn.send(b"x", reliable=False)
        net.run(TICK)
    net._transmit = Network._transmit.__get__(net)  # type: ignore[method-assign]
    for _ in range(RECENT_PACKETS + 10):
        conn.send(b"x", reliable=False)
        net.run(TICK)
    stats = server_conn(server).stats
    assert stats.packets_missing == dropped[0] > 0
    assert stats.inbound_loss > 0 and stats.recent_inbound_loss == 0.0


def test_byte_rates_each_way_follow_the_recent_traffic() -> None:
    net, server, _, conn = pair()
    size = 1000
    for _ in range(90):  # 3 s at 30 Hz, one datagram each
        conn.send(bytes(size), delivery=Delivery.UNRELIABLE_SEQUENCED)
        net.run(TICK)
    sent = conn.stats.send_rate
    received = server_conn(server).stats.receive_rate
    expected = 30 * (size + 50)  # each datagram carries its header and frame too
    assert 0.9 * expected < sent < 1.1 * expected, sent
    assert 0.9 * expected < received < 1.1 * expected, received
    # The server only acknowledges: its send rate is a few small datagrams a second.
    assert server_conn(server).stats.send_rate < expected / 10
    net.run(5.0)  # silence but for keepalives: the rates come down with it
    assert conn.stats.send_rate < expected / 10
    assert server_conn(server).stats.receive_rate < expected / 10


def test_a_fresh_connection_reports_zeros() -> None:
    stats = ConnectionStats()
    assert stats.packets_missing == 0 and stats.inbound_loss == 0.0
    assert stats.recent_inbound_loss == 0.0
    assert stats.send_rate == 0.0 and stats.receive_rate == 0.0
    assert set(COUNTERS) <= set(stats.as_dict())
