"""The sans-IO core on a stepped fake clock and an in-memory lossy network."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import tracemalloc

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import NO_BUFFER, Connection, State
from rudp.errors import ConnectionClosed, LocalProtocolError, MessageTooLarge, SendQueueFull
from rudp.events import Connected, Disconnected, DisconnectReason, MessageAcked
from rudp.wire import DropReason, PacketType
from tests.rudp.harness import Address, Link, Network, Node

SERVER = ("10.0.0.1", 9000)
CLIENT = ("10.0.0.2", 5000)


def pair(
    link: Link | None = None, seed: int = 1, config: Config | None = None
) -> tuple[Network, Node, Node, Connection]:
    net = Network(seed=seed, link=link)
    server = net.add(SERVER, config, accept=True)
    client = net.add(CLIENT, config)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED, timeout=30)
    return net, server, client, conn


def server_conn(server: Node) -> Connection:
    (conn,) = server.endpoint.connections
    return conn


def pump(net: Network, conn: Connection, payloads: list[bytes], **kwargs: object) -> None:
    """Send every payload, respecting the send queue, until all are acknowledged."""
    pending = list(payloads)
    pending.reverse()
    while pending or conn.queued:
        while pending and conn.queued < 1000:
            conn.send(pending.pop(), **kwargs)  # type: ignore[arg-type]
        assert net.step(net.now + 5), "network went idle with messages outstanding"


# -- handshake -----------------------------------------------------------------------------


def test_handshake_takes_two_round_trips_and_reports_connected() -> None:
    net, server, client, conn = pair()
    assert net.now == pytest.approx(1000.04)  # CONNECT, CHALLENGE, CONNECT, ACCEPT at 10 ms each
    assert [type(e) for _, e in client.events] == [Connected]
    assert [type(e) for _, e in server.events] == [Connected]
    assert server_conn(server).token == conn.token != 0


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


def test_short_connect_gets_no_answer() -> None:
    net = Network()
    server = net.add(SERVER, accept=True)
    short = wire.encode_connect(1, 2, b"", pad_to=100)
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
    net.inject(wire.encode_connect(99, 1, bytes(forged), 1200), ("10.0.0.9", 1), SERVER)
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
    assert to_b.token == to_a.token != 0
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
    assert to_b.token == to_a.token
    # The winner's retried CONNECT got the same ACCEPT again.
    accepts = [d for d, _, _ in net.sent if wire.decode_type(d) is PacketType.ACCEPT]
    assert len(accepts) == 2 and accepts[0] == accepts[1]


# -- delivery --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exactly_once_in_order_under_loss_duplication_and_reordering(seed: int) -> None:
    link = Link(loss=0.3, duplicate=0.1, reorder=0.1, delay=0.02, jitter=0.005)
    net, server, client, conn = pair(link, seed=seed)
    rng = random.Random(seed)
    payloads = [rng.randbytes(rng.randint(0, 1100)) for _ in range(3000)]
    pump(net, conn, payloads)
    assert server.received() == payloads
    assert conn.stats.messages_resent > 0
    sconn = server_conn(server)
    assert sconn.stats.packets_dropped == sum(server.endpoint.stats.dropped.values()) > 0


def test_both_directions_and_every_channel_keep_their_own_order() -> None:
    net, server, client, conn = pair(Link(loss=0.2, reorder=0.2, duplicate=0.05))
    sconn = server_conn(server)
    sent: dict[int, list[bytes]] = {ch: [] for ch in range(32)}
    for i in range(2000):
        ch = i % 32
        data = f"{ch}:{i}".encode()
        sent[ch].append(data)
        conn.send(data, channel=ch)
        sconn.send(data, channel=ch)
    net.run_until(lambda: not conn.queued and not sconn.queued)
    for node, peer in ((server, sconn), (client, conn)):
        got: dict[int, list[bytes]] = {ch: [] for ch in range(32)}
        for c, e in node.events:
            if c is peer and hasattr(e, "channel"):
                got[e.channel].append(e.data)  # type: ignore[union-attr]
        assert got == sent


def test_a_loss_on_one_channel_does_not_hold_up_another() -> None:
    net, server, client, conn = pair(Link(delay=0.05), config=Config(redundancy=0))
    victim: list[bytes] = []

    def drop_first_data_packet(data: bytes, src: object, dst: object) -> None:
        is_data = wire.decode_type(data) is PacketType.DATA
        if src == CLIENT and not victim and is_data and wire.decode_frames(data).messages:
            victim.append(data)
            net.link.blackout = True

    net.tap = drop_first_data_packet
    conn.send(b"a0", channel=0)
    net.flush()  # this datagram is lost
    net.link.blackout = False
    net.tap = None
    conn.send(b"b0", channel=1)
    conn.send(b"a1", channel=0)
    net.step(net.now + 1)
    # After one delay: channel 1 is delivered; a1 waits for a0's retransmission.
    assert server.received() == [b"b0"]
    buffers = server_conn(server)._rx_ch_buf
    assert list(buffers[0].values()) == [b"a1"]  # channel 0 got a reorder buffer of its own
    assert buffers[1] is NO_BUFFER and NO_BUFFER == {}  # the others share the empty one
    net.run_until(lambda: len(server.received()) == 3)
    assert server.received() == [b"b0", b"a0", b"a1"]


def test_an_idle_connection_is_small() -> None:
    # Per-channel state is created by use. 32 empty deques and dicts per connection
    # were 26 of its 39 KB (pure build); a server holds one connection per player.
    config = Config()
    rng = random.Random(1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        conns = [
            Connection(
                config=config, address=("10.0.0.3", 5000 + i), now=0.0, rng=rng,
                client=False, salt=i,
            )
            for i in range(100)
        ]  # fmt: skip
        per_connection = (tracemalloc.get_traced_memory()[0] - before) / len(conns)
    finally:
        tracemalloc.stop()
    assert per_connection < 16_000


def test_unreliable_messages_are_never_duplicated() -> None:
    net, server, client, conn = pair(Link(loss=0.2, duplicate=0.5, reorder=0.3))
    for i in range(3000):
        conn.send(i.to_bytes(4, "big"), reliable=False)
        if i % 50 == 0:
            net.step(net.now + 0.001)
    net.run(2)
    got = [int.from_bytes(d, "big") for d in server.received()]
    assert len(got) == len(set(got))
    assert 1500 < len(got) < 3000


def test_packet_and_channel_sequences_wrap_around() -> None:
    cfg = Config(max_datagram_size=600)
    net, server, client, conn = pair(Link(loss=0.05, duplicate=0.02, delay=0.001), config=cfg)
    payloads = [i.to_bytes(4, "big") * 100 for i in range(70_000)]  # one message per packet
    start_seq = conn._tx_next
    pump(net, conn, payloads)
    assert conn._tx_next - start_seq > 65536 + 1000  # the packet sequence wrapped
    assert server_conn(server)._rx_ch_next[0] == 70_000  # and so did channel 0's
    assert server.received() == payloads


def test_fast_resend_repairs_a_single_loss_before_the_timeout() -> None:
    net, server, client, conn = pair(Link(delay=0.05))
    for _ in range(20):  # settle the RTT estimate at 100 ms
        conn.send(b"warm")
        net.run(0.2)
    dropped = []

    def drop_one(data: bytes, src: object, dst: object) -> None:
        if src == CLIENT and not dropped and wire.decode_frames(data).messages:
            dropped.append(net.now)
            net.link.blackout = True

    net.tap = drop_one
    conn.send(b"lost")
    net.flush()
    net.link.blackout = False
    net.tap = None
    sent_at = net.now
    for i in range(5):  # later packets get acknowledged and reveal the gap
        conn.send(f"after{i}".encode())
        net.flush()
        net.now += 0.002
    net.run_until(lambda: b"lost" in server.received())
    # One RTT to see the later acks, half an RTT for the resend: well under RTO+RTT.
    assert net.now - sent_at < 0.2
    assert conn.stats.timeouts == 0


def test_rtt_estimate_tracks_the_path() -> None:
    net, server, client, conn = pair(Link(delay=0.03))
    for _ in range(30):
        conn.send(b"x")
        net.run(0.1)
    assert conn.stats.srtt == pytest.approx(0.06, abs=0.005)
    assert conn.stats.rto == pytest.approx(0.06 + max(4 * conn.stats.rttvar, 0.06 / 8), abs=0.01)


def test_jittery_path_gives_an_unbiased_rtt_and_few_spurious_timeouts() -> None:
    """Every newly acknowledged packet is an RTT sample: with jitter, the packets that
    others overtook are the slow ones, and sampling only the largest acknowledged
    would miss them (SRTT too low, RTO inside the path's normal range)."""
    net, server, client, conn = pair(Link(delay=0.02, jitter=0.005), config=Config(redundancy=0))
    for _ in range(3000):
        conn.send(b"x" * 100)
        net.run(0.001)
    net.run(1.0)
    assert conn.stats.srtt == pytest.approx(0.04, abs=0.003)
    assert conn.stats.rttvar > 0.002
    assert conn.stats.timeouts < 30  # was ~100 with largest-only samples


def test_a_late_ack_of_a_packet_declared_lost_is_a_spurious_loss() -> None:
    """A packet held back long enough to be declared lost, then delivered: its ack comes
    in a later header's bitfield, not as the largest, and must still be recognised."""
    net, server, client, conn = pair(Link(delay=0.01), config=Config(redundancy=0))
    for _ in range(20):
        conn.send(b"warm")
        net.run(0.05)
    held: list[bytes] = []

    def hold_one(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        if src == CLIENT and not held and wire.decode_frames(data).messages:
            held.append(data)
            net.link.blackout = True

    net.tap = hold_one
    for _ in range(10):
        conn.send(b"m")
        net.run(0.001)
    net.tap = None
    net.run(0.03)  # the held packet is declared lost (packet and time thresholds)
    assert conn.stats.packets_lost == 1
    threshold = conn._reorder_threshold
    net.inject(held[0], CLIENT, SERVER)  # ... but it was only late
    conn.send(b"after")
    net.run(0.1)
    assert conn.stats.spurious_losses == 1
    assert conn._reorder_threshold > threshold


def test_resend_timeout_backs_off_and_is_clamped() -> None:
    cfg = Config(rto_max=1.0)
    net, server, client, conn = pair(config=cfg)
    net.link.blackout = True
    conn.send(b"into the void")
    times = []
    net.tap = lambda data, src, dst: times.append(net.now) if src == CLIENT else None
    net.run(6)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == sorted(gaps)  # each wait at least as long as the one before
    assert max(gaps) <= 1.0 + 1e-9


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


def test_forgotten_peer_learns_by_noconn_within_a_round_trip() -> None:
    net, server, client, conn = pair(Link(delay=0.02))
    net.remove(SERVER)
    net.add(SERVER, accept=True)  # the server restarted: it knows nobody
    conn.send(b"are you there?")
    sent_at = net.now
    net.run_until(lambda: conn.state is State.CLOSED)
    assert net.now - sent_at == pytest.approx(0.04)
    assert client.disconnects() == [Disconnected(DisconnectReason.NO_CONNECTION, by_peer=True)]


def test_spoofed_noconn_is_ignored() -> None:
    net, server, client, conn = pair()
    for seq in range(0, 65536, 997):  # echoes of packets never sent
        if not conn._tx_next - 4096 <= seq <= conn._tx_next:
            net.inject(wire.encode_noconn(conn.token, seq), SERVER, CLIENT)
    net.inject(wire.encode_noconn(conn.token ^ 1, conn._tx_next - 1), SERVER, CLIENT)
    net.run(1)
    assert conn.state is State.CONNECTED
    assert client.endpoint.stats.dropped[DropReason.UNEXPECTED] > 50
    assert client.endpoint.stats.dropped[DropReason.BAD_TOKEN] == 1


def test_noconn_replies_are_rate_limited_and_never_larger_than_the_trigger() -> None:
    net = Network()
    server = net.add(SERVER, Config(noconn_burst=10, noconn_rate=1.0), accept=True)
    packet = wire.seal_rest(wire.data_header(5, 1, 0, 0) + wire.PING_FRAME)
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


# -- graceful close ---------------------------------------------------------------------------


def test_close_delivers_everything_queued_then_both_sides_report_the_same_reason() -> None:
    net, server, client, conn = pair(Link(loss=0.25, duplicate=0.05, reorder=0.1))
    payloads = [f"m{i}".encode() for i in range(500)]
    for p in payloads:
        conn.send(p)
    conn.close(net.now, 4001, "game over")
    assert conn.state is State.CLOSING
    with pytest.raises(ConnectionClosed) as closing:  # as the connection reads: closed
        conn.send(b"too late")
    assert closing.value.reason == "closed" and closing.value.code == 4001
    sconn = server_conn(server)
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED)
    assert server.received() == payloads
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED, 4001, "game over")]
    assert server.disconnects() == [
        Disconnected(DisconnectReason.CLOSED, 4001, "game over", by_peer=True)
    ]
    with pytest.raises(ConnectionClosed) as info:
        conn.send(b"after")
    assert info.value.reason == "closed" and info.value.code == 4001


def test_unreliable_messages_queued_before_close_go_out_before_the_disconnect() -> None:
    # The peer drops messages once it has the DISCONNECT: it must not be sent ahead of
    # unreliable messages that were queued first (several datagrams' worth here).
    net, server, client, conn = pair()
    payloads = [i.to_bytes(2, "big") + bytes(300) for i in range(40)]
    for p in payloads:
        conn.send(p, reliable=False)
    conn.close(net.now)
    sconn = server_conn(server)
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED)
    assert server.received() == payloads
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED)]


def test_lost_disconnect_is_resent_until_acknowledged() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    drops = [0]

    def drop_disconnects(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        if src == CLIENT and wire.decode_frames(data).disconnect and drops[0] < 3:
            drops[0] += 1
            net.link.blackout = True

    net.tap = drop_disconnects
    conn.close(net.now, 1, "x")
    net.run_until(lambda: conn.state is State.CLOSED)
    assert drops[0] == 3
    assert sconn.state in (State.DRAINING, State.CLOSED)
    assert client.disconnects()[0].reason is DisconnectReason.CLOSED
    assert server.disconnects()[0].by_peer


def test_unacknowledged_disconnect_ends_after_the_close_timeout() -> None:
    net, server, client, conn = pair()
    net.link.blackout = True
    conn.close(net.now)
    start = net.now
    net.run_until(lambda: conn.state is State.CLOSED)
    assert net.now - start == pytest.approx(Config().close_timeout, abs=0.01)
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED)]


def test_peer_that_already_forgot_us_completes_our_close() -> None:
    net, server, client, conn = pair()
    net.remove(SERVER)
    net.add(SERVER, accept=True)
    conn.close(net.now, 2, "bye")
    net.run_until(lambda: conn.state is State.CLOSED)
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED, 2, "bye")]


# -- the caller's misuse raises at once --------------------------------------------------------


def test_misuse_raises_clear_errors() -> None:
    net, server, client, conn = pair(config=Config(send_queue_limit=10, drain_low_water=5))
    with pytest.raises(MessageTooLarge):
        conn.send(bytes(conn.max_datagram_payload + 1), reliable=False)
    conn.send(bytes(conn.max_datagram_payload), reliable=False)
    with pytest.raises(LocalProtocolError):
        conn.send(b"x", channel=32)
    with pytest.raises(TypeError):
        conn.send("text")  # type: ignore[arg-type]
    for _ in range(9):
        conn.send(b"x")
    with pytest.raises(SendQueueFull):
        conn.send(b"x")
    with pytest.raises(LocalProtocolError):
        conn.close(net.now, code=70000)
    with pytest.raises(LocalProtocolError):
        client.endpoint.connect(SERVER, net.now)


def test_acked_event_only_for_messages_that_asked() -> None:
    net, server, client, conn = pair()
    quiet = conn.send(b"a")
    loud = conn.send(b"b")
    loud.notify = True
    net.run(1)
    acked = [e.handle for _, e in client.events if isinstance(e, MessageAcked)]
    assert acked == [loud]
    assert quiet.acked and loud.acked


def test_receive_buffer_is_bounded_and_drops_whole_packets() -> None:
    cfg = Config(recv_buffer_bytes=4000, window=64)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    # Forge early messages far ahead on channel 0 straight into the server core.
    seq = conn._tx_next
    for i in range(1, 20):
        frame = wire.message_frame(1, 0, i * 10, bytes(1000))
        packet = wire.seal_rest(wire.data_header(sconn.token, (seq + i) & 0xFFFF, 0, 0) + frame)
        server.endpoint.receive_datagram(packet, CLIENT, net.now)
    assert sconn._rx_buffered_bytes <= 4000
    assert server.endpoint.stats.dropped[DropReason.RECV_BUFFER_FULL] > 0


def test_illegal_state_transition_raises_and_keeps_the_state() -> None:
    net, server, client, conn = pair()
    with pytest.raises(LocalProtocolError):
        conn._set_state(State.CONNECTING)
    assert conn.state is State.CONNECTED


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_datagram_size"):
        Config(max_datagram_size=100)
    with pytest.raises(ValueError, match="keepalive_interval"):
        Config(keepalive_interval=20.0, idle_timeout=10.0)
    with pytest.raises(ValueError, match="rto"):
        Config(rto_min=1.0, rto_initial=0.5)
    assert dataclasses.replace(Config(), window=8).window == 8


def test_a_long_burst_read_at_once_is_acknowledged_whole() -> None:
    """A header acks 33 packets; a receiver that reads a longer burst before it
    flushes (the socket is drained up to 256 datagrams at a time) must still
    acknowledge every packet, or the sender would resend them all."""
    net, server, client, conn = pair()
    for _ in range(200):
        conn.send(bytes(1000))
    burst = [d for d, _ in client.endpoint.datagrams_to_send(net.now)]
    assert len(burst) > 150
    for datagram in burst:
        server.endpoint.receive_datagram(datagram, CLIENT, net.now)
    acks = server.endpoint.datagrams_to_send(net.now)
    assert len(acks) >= len(burst) // 33
    for ack, _ in acks:
        client.endpoint.receive_datagram(ack, SERVER, net.now + 0.001)
    assert conn.queued == 0  # every message acknowledged
    assert conn.stats.packets_lost == 0  # and none declared lost


def test_deep_reordering_is_learned_instead_of_resent() -> None:
    """Per-datagram jitter reorders far past the 33 packets one header acks. A late
    packet gets its own ack; the sender sees its loss was spurious and widens its
    reordering thresholds, so jitter stops turning into resends."""
    link = Link(delay=0.02, jitter=0.005, loss=0.05)
    net, server, client, conn = pair(link, seed=4)
    payloads = [bytes([i % 256]) * 1000 for i in range(2000)]
    start = net.now
    pump(net, conn, payloads)
    assert server.received() == payloads
    stats = conn.stats
    assert stats.spurious_losses > 0
    assert conn._reorder_threshold > Config().reorder_threshold
    # Without this, the same transfer resent every message about 7 times over.
    assert stats.messages_resent < 0.5 * stats.messages_sent
    assert net.now - start < 1.0


def _hold_nth_data_packet(net: Network, n: int, hold: float | None) -> None:
    """Delay (or, with ``hold=None``, lose) the n-th data-carrying packet from CLIENT."""
    count = [0]
    transmit = net._transmit

    def tap(data: bytes, src: Address, dst: Address) -> None:
        if src == CLIENT and wire.decode_type(data) is PacketType.DATA and len(data) > 100:
            count[0] += 1
            if count[0] == n:
                net.sent.append((data, src, dst))
                if hold is not None:
                    heapq.heappush(net._wire, (net.now + hold, 10**12, data, src, dst))
                return
        transmit(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]


def test_a_long_delayed_packet_is_never_delivered_as_a_newer_message() -> None:
    """Small messages, one packet held 0.25 s: by then the channel sequence has moved
    more than 32768 on, and unwrapping its old numbers would read them as early."""
    net, server, client, conn = pair(seed=3)
    _hold_nth_data_packet(net, 5, hold=0.25)
    payloads = [i.to_bytes(3, "big") for i in range(120_000)]
    sent = 0

    def keep_sending() -> bool:
        nonlocal sent
        while sent < len(payloads) and conn.queued < 60_000:  # a deep queue: fast channel
            conn.send(payloads[sent])
            sent += 1
        return len(server.received()) >= len(payloads)

    net.run_until(keep_sending, timeout=120)
    assert server.received() == payloads


def test_a_full_reorder_buffer_never_refuses_the_packet_that_unblocks_it() -> None:
    # A buffer that holds the window's early messages only just not: the packet
    # carrying the lost message and the next one must still be taken.
    cfg = Config(recv_buffer_bytes=19676)
    net, server, client, conn = pair(config=cfg, seed=3)
    _hold_nth_data_packet(net, 1, hold=None)  # lose the first data packet
    payloads = [bytes([i % 256]) * 500 for i in range(200)]
    for p in payloads:
        conn.send(p)
    net.run_until(lambda: len(server.received()) == len(payloads), timeout=30)
    assert server.received() == payloads


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


def test_after_an_outage_the_resend_timer_probes_one_packet_at_a_time() -> None:
    net, server, client, conn = pair()
    net.run(0.5)
    net.link.blackout = True
    for _ in range(2000):
        conn.send(b"x" * 500)
    net.run(4.0)
    # One probe per backed-off RTO, not a burst of every packet in flight.
    assert conn.stats.timeouts <= 8
    assert conn.stats.messages_resent <= 20
