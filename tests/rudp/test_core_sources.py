"""Per-source limits of the sans-IO core: connections held and handshakes started per
source (an IPv4 address or an IPv6 /64), on a stepped clock and an in-memory network."""

from __future__ import annotations

import pytest

from rudp.accepting import SOURCE_FULL
from rudp.admission import source_of
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.events import Disconnected, DisconnectReason
from tests.rudp.harness import SERVER, Address, Network, Node

FULL = Disconnected(DisconnectReason.REFUSED, 0, SOURCE_FULL, by_peer=True)


def connect_from(net: Network, addresses: list[Address]) -> list[tuple[Node, Connection]]:
    made = []
    for address in addresses:
        node = net.add(address)
        made.append((node, node.endpoint.connect(SERVER, net.now)))
    return made


def test_source_of_is_an_ipv4_address_or_an_ipv6_slash_64() -> None:
    assert source_of(("192.0.2.7", 1)) == source_of(("192.0.2.7", 2)) == "192.0.2.7"
    assert source_of(("::ffff:192.0.2.7", 1, 0, 0)) == "192.0.2.7"
    same = {source_of((ip, 1, 0, 0)) for ip in ("2001:db8::1", "2001:db8::ff:2", "2001:db8::3%1")}
    assert len(same) == 1
    assert source_of(("2001:db8:0:1::1", 1, 0, 0)) not in same


def test_one_source_filling_the_slots_is_capped_and_another_still_gets_in() -> None:
    net = Network()
    server = net.add(SERVER, Config(max_connections=10, max_connections_per_source=3), accept=True)
    greedy = connect_from(net, [("10.0.0.66", 5000 + i) for i in range(9)])
    net.run(1)
    states = [conn.state for _, conn in greedy]
    assert states.count(State.CONNECTED) == 3 and states.count(State.CLOSED) == 6
    assert all(node.disconnects() == [FULL] for node, c in greedy if c.state is State.CLOSED)
    stats = server.endpoint.stats
    assert (stats.source_connections_refused, stats.connections_refused) == (6, 6)
    # A legitimate host, from another source, still gets one of the free slots.
    ((_, host),) = connect_from(net, [("10.0.0.7", 27960)])
    net.run(1)
    assert host.state is State.CONNECTED
    # A slot the source gives back can be taken again by it.
    first = next(c for _, c in greedy if c.state is State.CONNECTED)
    first.close(net.now)
    net.run(5)
    ((_, again),) = connect_from(net, [("10.0.0.66", 6000)])
    net.run(1)
    assert again.state is State.CONNECTED
    assert stats.source_connections_refused == 6


def test_an_ipv6_slash_64_is_one_source() -> None:
    net = Network()
    server_address = ("2001:db8:ffff::1", 27950, 0, 0)
    net.add(server_address, Config(max_connections_per_source=2), accept=True)
    one_site = [(f"2001:db8:0:7::{i + 1:x}", 5000, 0, 0) for i in range(4)]
    other_site = ("2001:db8:0:8::1", 5000, 0, 0)
    made = []
    for address in [*one_site, other_site]:
        node = net.add(address)
        made.append(node.endpoint.connect(server_address, net.now))
    net.run(1)
    assert [c.state for c in made] == [State.CONNECTED] * 2 + [State.CLOSED] * 2 + [State.CONNECTED]


def test_the_handshake_rate_of_a_source_is_bounded_and_the_clients_get_in_later() -> None:
    net = Network()
    config = Config(handshake_rate_per_source=2.0, handshake_burst_per_source=2)
    server = net.add(SERVER, config, accept=True)
    burst = connect_from(net, [("10.0.0.66", 5000 + i) for i in range(6)])
    other = connect_from(net, [("10.0.0.7", 27960)])
    net.run(0.2)
    assert [c.state for _, c in burst].count(State.CONNECTED) == 2
    assert other[0][1].state is State.CONNECTED  # another source is not held back
    limited = server.endpoint.stats.source_handshakes_limited
    assert limited >= 4
    # Unanswered, not refused: the clients' own CONNECT resends get in as tokens come.
    net.run(3)
    assert all(c.state is State.CONNECTED for _, c in burst)
    assert server.endpoint.stats.connections_refused == 0


def test_limits_are_off_by_default_and_checked() -> None:
    net = Network()
    server = net.add(SERVER, accept=True)
    many = connect_from(net, [("10.0.0.66", 5000 + i) for i in range(50)])
    net.run(2)
    assert all(c.state is State.CONNECTED for _, c in many)
    assert server.endpoint.stats.source_handshakes_limited == 0
    for bad in (
        {"max_connections_per_source": -1},
        {"handshake_rate_per_source": -1.0},
        {"handshake_burst_per_source": 0},
        {"source_limit_keys": 0},
    ):
        with pytest.raises(ValueError):
            Config(**bad)  # type: ignore[arg-type]


def test_a_connection_never_moves_into_a_source_at_its_limit() -> None:
    net = Network()
    server = net.add(SERVER, Config(max_connections_per_source=2), accept=True)
    full = connect_from(net, [("10.0.0.66", 5000), ("10.0.0.66", 5001)])
    ((mover_node, mover),) = connect_from(net, [("10.0.0.7", 27960)])
    net.run(1)
    assert all(c.state is State.CONNECTED for _, c in [*full, (mover_node, mover)])
    sconn = server.endpoint.connection(("10.0.0.7", 27960))
    assert sconn is not None
    # The mover's NAT maps it into the full source: the server does not follow it.
    net.move(("10.0.0.7", 27960), ("10.0.0.66", 5002))
    mover.send(b"hello")
    net.run(2)
    assert sconn.address == ("10.0.0.7", 27960) and sconn.stats.path_challenges == 0
    assert sconn.stats.migrations == 0
    assert server.endpoint.connection(("10.0.0.66", 5002)) is None
    # A new port within the source it already counts against is a move it may make.
    net.move(("10.0.0.66", 5000), ("10.0.0.66", 5003))
    full[0][1].send(b"hello")
    net.run(2)
    moved = server.endpoint.connection(("10.0.0.66", 5003))
    assert moved is not None and moved.stats.migrations == 1
