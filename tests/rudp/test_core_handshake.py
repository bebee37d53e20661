"""The sans-IO core's handshake, on a stepped fake clock and an in-memory lossy network:
cookies, refusals, restarts and simultaneous open."""

from __future__ import annotations

import heapq

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import LocalProtocolError
from rudp.events import Connected, Disconnected, DisconnectReason
from rudp.wire import DropReason, PacketType
from tests.rudp.harness import CLIENT, SERVER, Address, Link, Network, Node, pair, server_conn

# -- handshake -----------------------------------------------------------------------------


def test_handshake_takes_two_round_trips_and_reports_connected() -> None:
    net = Network()
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    assert net.now == pytest.approx(1000.04)  # CONNECT, CHALLENGE, CONNECT, ACCEPT at 10 ms each
    net.run(0.1)  # path MTU discovery's probes: no event
    assert [type(e) for _, e in client.events] == [Connected]
    assert [type(e) for _, e in server.events] == [Connected]
    sconn = server_conn(server)  # each side routes by the connection id it chose
    assert sconn.peer_cid == conn.cid != 0 and conn.peer_cid == sconn.cid != 0


def test_handshake_gives_the_client_its_first_rtt_sample() -> None:
    net, server, client, conn = pair(Link(delay=0.03))
    assert conn.stats.srtt == pytest.approx(0.06)
    assert conn.stats.rto < Config().rto_initial


def test_connect_times_out_without_a_server() -> None:
    net = Network()
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run(10)
    assert conn.state is State.CLOSED
    assert client.disconnects() == [Disconnected(DisconnectReason.CONNECT_TIMEOUT)]
    connects = [d for d, _, _ in net.sent if wire.decode_type(d) is PacketType.CONNECT]
    assert len(connects) == 20  # every 0.25 s for the 5 s connect timeout


def test_server_full_refuses_with_a_reason() -> None:
    net = Network()
    net.add(SERVER, Config(max_connections=1), accept=True)
    first = net.add(CLIENT).endpoint.connect(SERVER, net.now)
    second_node = net.add(("10.0.0.3", 5000))
    second = second_node.endpoint.connect(SERVER, net.now)
    net.run(1)
    assert first.state is State.CONNECTED
    assert second.state is State.CLOSED
    assert second_node.disconnects() == [
        Disconnected(DisconnectReason.REFUSED, 0, "server full", by_peer=True)
    ]


def test_a_client_refused_as_full_gets_the_refusal_again_and_one_connection_per_cookie() -> None:
    # The cookie is spent only when a connection is made: a resent CONNECT (its REJECT
    # was lost) is refused again, not dropped as a replay, and once there is room the
    # same CONNECT opens exactly one connection.
    net = Network()
    server = net.add(SERVER, Config(max_connections=1), accept=True)
    first = net.add(CLIENT).endpoint.connect(SERVER, net.now)
    late = ("10.0.0.3", 5000)
    net.add(late).endpoint.connect(SERVER, net.now)
    net.run(1)
    assert first.state is State.CONNECTED
    (request,) = [
        d
        for d, s, _ in net.sent
        if s == late and wire.decode_type(d) is PacketType.CONNECT and wire.decode_connect(d).cookie
    ]
    stats = server.endpoint.stats

    def rejects() -> int:
        return sum(1 for d, s, dst in net.sent if dst == late and d[0] == 0xA0 | PacketType.REJECT)

    assert rejects() == 1 and stats.connections_refused == 1
    net.inject(request, late, SERVER)  # its REJECT was lost: the same CONNECT again
    net.run(0.1)
    assert rejects() == 2 and stats.connections_refused == 2
    assert stats.dropped[DropReason.REPLAYED_COOKIE] == 0
    first.close(net.now)
    net.run_until(lambda: not server.endpoint.connections)
    net.inject(request, late, SERVER)  # room now: the cookie opens one connection
    net.run(0.1)
    assert stats.connections_accepted == 2
    assert [c.address for c in server.endpoint.connections] == [late]
    net.inject(request, late, SERVER)  # and never a second one
    net.run(0.1)
    assert stats.connections_accepted == 2 and len(server.endpoint.connections) == 1


def test_short_connect_gets_no_answer() -> None:
    net = Network()
    server = net.add(SERVER, accept=True)
    short = wire.encode_connect(1, 0, b"", bytes(67), pad_to=100)
    net.inject(short, CLIENT, SERVER)
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.MALFORMED] == 1
    assert not [s for s in net.sent if s[1] == SERVER]


def _captured_connect(net: Network) -> bytes:
    for data, _src, _ in net.sent:
        if wire.decode_type(data) is PacketType.CONNECT and wire.decode_connect(data).cookie:
            return data
    raise AssertionError("no CONNECT with a cookie was sent")


def test_forged_cookie_is_rejected() -> None:
    net, server, client, conn = pair()
    request = wire.decode_connect(_captured_connect(net))
    forged = bytearray(request.cookie)
    forged[-1] ^= 1
    forgery = wire.encode_connect(99, request.pattern, bytes(forged), request.rest, 1200)
    net.inject(forgery, ("10.0.0.9", 1), SERVER)
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.BAD_COOKIE] == 1
    assert len(server.endpoint.connections) == 1


def test_cookie_is_bound_to_the_address() -> None:
    net, server, client, conn = pair()
    stolen = _captured_connect(net)
    net.inject(stolen, ("10.0.0.66", 5000), SERVER)  # same bytes, other source
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.BAD_COOKIE] == 1
    assert len(server.endpoint.connections) == 1


def test_expired_cookie_is_rejected() -> None:
    net, server, client, conn = pair()
    captured = _captured_connect(net)
    conn.close(net.now)
    net.run(5)
    net.now += 2 * Config().cookie_lifetime + 1  # two rotations later
    net.inject(captured, CLIENT, SERVER)
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.BAD_COOKIE] == 1
    assert not server.endpoint.connections


def test_replayed_cookie_does_not_open_a_second_connection() -> None:
    net, server, client, conn = pair()
    captured = _captured_connect(net)
    conn.close(net.now)
    net.run_until(lambda: conn.state is State.CLOSED)
    net.run(1)
    assert not server.endpoint.connections
    net.inject(captured, CLIENT, SERVER)  # within the cookie's lifetime
    net.run(1)
    assert server.endpoint.stats.dropped[DropReason.REPLAYED_COOKIE] == 1
    assert not server.endpoint.connections


def test_duplicate_connect_resends_accept_without_a_new_connection() -> None:
    net, server, client, conn = pair()
    net.inject(_captured_connect(net), CLIENT, SERVER)
    net.run(1)
    accepts = [
        d for d, s, _ in net.sent if s == SERVER and wire.decode_type(d) is PacketType.ACCEPT
    ]
    assert len(accepts) == 2
    assert len(server.endpoint.connections) == 1
    assert client.endpoint.stats.dropped[DropReason.DUPLICATE] == 1


def test_handshake_survives_heavy_loss() -> None:
    for seed in range(5):
        net, server, client, conn = pair(Link(loss=0.4, duplicate=0.1), seed=seed)
        assert conn.state is State.CONNECTED
        assert server_conn(server).state is State.CONNECTED


def _simultaneous_open(
    net: Network, accept: tuple[bool, bool]
) -> tuple[Node, Node, Connection, Connection, Node]:
    """Both peers connect at once; returns them, their connections and the one whose
    handshake must win (the larger salt)."""
    a = net.add(SERVER, accept=accept[0])
    b = net.add(CLIENT, accept=accept[1])
    to_b = a.endpoint.connect(CLIENT, net.now)
    to_a = b.endpoint.connect(SERVER, net.now)
    winner = a if to_b.salt > to_a.salt else b
    net.run_until(
        lambda: to_b.state is not State.CONNECTING and to_a.state is not State.CONNECTING,
        timeout=30,
    )
    return a, b, to_b, to_a, winner


@pytest.mark.parametrize("accept", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_simultaneous_open_gives_each_side_one_connection(
    accept: tuple[bool, bool], seed: int
) -> None:
    # Two peers introduced to each other both connect. Before, each side took the
    # other's CONNECT for a restart, dropped its own connection and accepted a new
    # one, and both ended with "peer has no connection".
    net = Network(seed=seed, link=Link(loss=0.2, duplicate=0.1, reorder=0.1))
    a, b, to_b, to_a, winner = _simultaneous_open(net, accept)
    assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED
    assert to_b.peer_cid == to_a.cid != 0 and to_a.peer_cid == to_b.cid != 0
    assert a.endpoint.connections == [to_b] and b.endpoint.connections == [to_a]
    for node, conn in ((a, to_b), (b, to_a)):
        assert [e for c, e in node.events if c is conn] == [Connected()]
    # The larger salt's handshake won on both sides: the other peer answered it.
    assert to_b.salt == to_a.salt
    loser = b if winner is a else a
    assert loser.endpoint.stats.simultaneous_opens == 1
    assert winner.endpoint.stats.simultaneous_opens == 0
    assert a.endpoint.stats.connections_accepted == b.endpoint.stats.connections_accepted == 0
    payloads = [f"m{i}".encode() for i in range(50)]
    for p in payloads:
        to_b.send(p)
        to_a.send(p[::-1])
    net.run_until(lambda: len(a.received()) == len(b.received()) == 50, timeout=30)
    assert b.received() == payloads and a.received() == [p[::-1] for p in payloads]


def test_a_late_copy_of_the_losing_connect_does_not_end_the_opened_connection() -> None:
    # The winner drops the loser's cookie CONNECT while connecting; a copy delayed or
    # duplicated past the handshake once looked like a restart of the peer: both
    # connections ended with "peer has no connection".
    net = Network(seed=1)
    a, b, to_b, to_a, winner = _simultaneous_open(net, (True, True))
    loser, winner_address = (CLIENT, SERVER) if winner is a else (SERVER, CLIENT)
    losing = [
        d
        for d, src, _ in net.sent
        if src == loser
        and wire.decode_type(d) is PacketType.CONNECT
        and wire.decode_connect(d).cookie
    ]
    assert losing
    net.inject(losing[-1], loser, winner_address)
    net.run(5)
    assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED
    assert winner.endpoint.stats.dropped[DropReason.DUPLICATE] >= 1
    assert not a.disconnects() and not b.disconnects()


@pytest.mark.parametrize("accept", [(True, True), (True, False), (False, True), (False, False)])
def test_simultaneous_opens_under_duplication_and_reordering_all_hold(
    accept: tuple[bool, bool],
) -> None:
    for seed in range(40):
        net = Network(seed=seed, link=Link(loss=0.2, duplicate=0.1, reorder=0.1))
        a, b, to_b, to_a, _ = _simultaneous_open(net, accept)
        net.run(3)
        assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED, seed
        assert not a.disconnects() and not b.disconnects(), seed


def test_an_endpoint_that_accepts_no_one_still_refuses_strangers_after_an_open() -> None:
    net = Network(seed=1)
    a, b, to_b, to_a, winner = _simultaneous_open(net, (False, False))
    assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED
    answering = SERVER if winner is b else CLIENT  # the side that answered the other's
    stranger = net.add(("10.0.0.9", 7000))
    attempt = stranger.endpoint.connect(answering, net.now)
    net.run_until(lambda: attempt.state is State.CLOSED, timeout=30)
    assert attempt.close_reason is not None
    assert attempt.close_reason.reason is DisconnectReason.CONNECT_TIMEOUT
    assert len((a if answering == SERVER else b).endpoint.connections) == 1


def test_connecting_to_a_peer_already_connected_says_which_connection_exists() -> None:
    # A peer's CONNECT that arrives before we connect to it is an ordinary inbound
    # connection (no simultaneous open); connecting then must say where it went.
    net, server, client, conn = pair()
    with pytest.raises(LocalProtocolError, match="accepted, and goes to the serve handler"):
        server.endpoint.connect(CLIENT, net.now)
    with pytest.raises(LocalProtocolError, match="already connected or connecting"):
        client.endpoint.connect(SERVER, net.now)


def test_simultaneous_open_survives_a_lost_accept() -> None:
    net = Network(seed=1)
    lost: list[bytes] = []

    def drop_first_accept(data: bytes, src: object, dst: object) -> None:
        if not lost and wire.decode_type(data) is PacketType.ACCEPT:
            lost.append(data)
            net.link.blackout = True

    def restore(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        drop_first_accept(data, src, dst)

    net.tap = restore
    a, b, to_b, to_a, _ = _simultaneous_open(net, (True, True))
    assert lost, "no ACCEPT was sent"
    assert to_b.state is State.CONNECTED and to_a.state is State.CONNECTED
    assert to_b.peer_cid == to_a.cid and to_a.peer_cid == to_b.cid
    # The winner's retried CONNECT got the same ACCEPT again.
    accepts = [d for d, _, _ in net.sent if wire.decode_type(d) is PacketType.ACCEPT]
    assert len(accepts) == 2 and accepts[0] == accepts[1]


@pytest.mark.parametrize("accept_fate", ["lost", "overtaken"])
def test_data_before_accept_does_not_kill_the_new_connection(accept_fate: str) -> None:
    net = Network(seed=3)
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    transmit = net._transmit
    held: list[int] = []

    def tap(data: bytes, src: Address, dst: Address) -> None:
        if wire.decode_type(data) is PacketType.ACCEPT and not held:
            held.append(1)
            net.sent.append((data, src, dst))
            if accept_fate == "overtaken":  # arrives after the greeting
                heapq.heappush(net._wire, (net.now + 0.05, 10**12, data, src, dst))
            return
        transmit(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: bool(server.endpoint.connections))
    server_conn(server).send(b"hello")  # the server greets at once
    net.run_until(lambda: b"hello" in client.received(), timeout=10)
    assert conn.state is State.CONNECTED
    assert not client.disconnects() and not server.disconnects()
