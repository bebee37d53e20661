"""Delivery modes, the dependency graph and fragmentation, on the fake clock.

Every test drives two sans-IO endpoints through the deterministic in-memory
network of ``harness``: loss, duplication and reordering are seeded, time is
stepped, nothing sleeps.
"""

from __future__ import annotations

import random

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import NO_BUFFER, Connection, State
from rudp.errors import LocalProtocolError, MessageTooLarge
from rudp.events import DisconnectReason, MessageReceived
from rudp.sending import OutMessage
from rudp.wire import Delivery, DropReason, PacketType
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    TAG,
    Link,
    Network,
    Node,
    frames_of,
    inject_frames,
    pair,
    server_conn,
    settle,
    tagged,
    tags,
)

LOSSY = Link(loss=0.2, duplicate=0.1, reorder=0.2, delay=0.02, jitter=0.005)


def arrival_times(node: Node) -> dict[int, float]:
    """Tag -> the fake-clock time it was delivered (recorded by ``TimedNetwork``)."""
    return node.times  # type: ignore[attr-defined,no-any-return]


class TimedNetwork(Network):
    """Records when each message is delivered, on the fake clock."""

    def _drain_events(self) -> None:
        for node in self.nodes.values():
            times = node.__dict__.setdefault("times", {})
            while (item := node.endpoint.next_event()) is not None:
                node.events.append(item)
                event = item[1]
                if isinstance(event, MessageReceived) and len(event.data) >= TAG.size:
                    times.setdefault(TAG.unpack_from(event.data)[0], self.now)


def timed_pair(link: Link, config: Config | None = None) -> tuple[TimedNetwork, Node, Connection]:
    net = TimedNetwork(seed=3, link=link)
    server = net.add(SERVER, config, accept=True)
    client = net.add(CLIENT, config)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    return net, server, conn


def assert_sender_state_is_empty(conn: Connection) -> None:
    """Everything acknowledged: the sender's books balance."""
    assert conn.queued == 0
    assert conn._sender.unacked_reliable == 0
    assert conn._sender.unacked_bytes == 0
    assert not conn._sender.tx_graph
    assert not any(conn._sender.tx_ch_unacked)


def assert_receiver_state_is_empty(conn: Connection) -> None:
    """Nothing is held once everything was delivered: memory does not grow."""
    assert conn._receiver.graph.nodes == {}
    assert conn._receiver.graph.waiters == {}
    assert conn._receiver.graph.done == set()
    assert conn._receiver.parts == {}
    assert conn._receiver.reserved_bytes == 0
    assert conn._receiver.buffered_bytes == 0
    assert not any(conn._receiver.ch_buf)
    assert NO_BUFFER == {}  # the shared empty buffer was never written to


# -- every mode under loss, duplication and reordering ------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_unreliable_sequenced_drops_older_and_never_duplicates(seed: int) -> None:
    net, server, client, conn = pair(LOSSY, seed=seed)
    for i in range(2000):
        conn.send(tagged(i), delivery=Delivery.UNRELIABLE_SEQUENCED, channel=i % 2)
        net.step(net.now + 0.001)
    net.run(1.0)
    for channel in (0, 1):
        got = tags(server, channel)
        assert got == sorted(set(got)), "sequenced delivery went backwards or duplicated"
        assert 100 < len(got) < 1000  # some lost or stale, none resent
    assert server_conn(server).stats.stale_messages > 0  # reordering did happen


@pytest.mark.parametrize("seed", [1, 2])
def test_reliable_unordered_is_exactly_once_and_not_ordered(seed: int) -> None:
    net, server, client, conn = pair(LOSSY, seed=seed)
    for i in range(3000):
        conn.send(tagged(i), delivery=Delivery.RELIABLE_UNORDERED, channel=i % 3)
        if i % 10 == 0:
            net.step(net.now + 0.001)
    settle(net, conn)
    got = tags(server)
    assert sorted(got) == list(range(3000)), "lost or duplicated"
    assert got != sorted(got), "nothing was delivered early: unordered delivery waited"
    assert_receiver_state_is_empty(server_conn(server))
    assert_sender_state_is_empty(conn)


@pytest.mark.parametrize("seed", [1, 2])
def test_reliable_sequenced_delivers_the_latest_and_drops_superseded(seed: int) -> None:
    net, server, client, conn = pair(LOSSY, seed=seed)
    handles = []
    for i in range(1000):
        handles.append(conn.send(tagged(i), delivery=Delivery.RELIABLE_SEQUENCED, channel=4))
        if i % 5 == 0:
            net.step(net.now + 0.002)
    settle(net, conn)
    got = tags(server, 4)
    assert got == sorted(set(got))
    assert got[-1] == 999, "the newest message must always arrive"
    assert conn.stats.messages_superseded > 0
    assert all(h.acked or h.superseded for h in handles)
    assert sum(h.superseded for h in handles) == conn.stats.messages_superseded
    # A superseded message is never sent again.
    assert conn.stats.messages_resent < conn.stats.packets_lost * 2


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dependency_ordered_random_graph_under_loss(seed: int) -> None:
    """Each message depends on a random few earlier ones; each is delivered exactly once
    and only after everything it depends on."""
    rng = random.Random(seed)
    net, server, client, conn = pair(LOSSY, seed=seed)
    handles: list[OutMessage] = []
    deps_of: dict[int, list[int]] = {}
    for i in range(1500):
        picks = sorted(set(rng.sample(range(max(0, i - 40), i), min(i, rng.randint(0, 3)))))
        deps_of[i] = picks
        handles.append(
            conn.send(tagged(i), depends_on=[handles[j] for j in picks], channel=rng.randrange(4))
        )
        if i % 8 == 0:
            net.step(net.now + 0.001)
    settle(net, conn)
    got = tags(server)
    assert sorted(got) == list(range(1500))
    position = {tag: n for n, tag in enumerate(got)}
    for i, picks in deps_of.items():
        for j in picks:
            assert position[j] < position[i], f"{i} ran before its dependency {j}"
    assert got != sorted(got), "no message overtook another: independent ones waited"
    assert_receiver_state_is_empty(server_conn(server))
    assert_sender_state_is_empty(conn)
    assert not conn._sender.tx_graph, "the sender's graph keeps executed nodes"


# -- head-of-line blocking -------------------------------------------------------------------


def _hol_run(independent: bool) -> tuple[dict[str, float], int]:
    """Chains A and B and dependency-free messages F, one per packet, 10 % loss.

    Returns the worst delivery delay of F and of B messages whose first transmission
    arrived (and, for B, whose chain predecessors' did), and how many A were lost.
    """
    delay = 0.05
    # Without redundancy: this measures what the graph alone does for a lost message.
    net, server, conn = timed_pair(Link(delay=delay), Config(redundancy=0))
    rng = random.Random(7)
    lost_tags: set[int] = set()

    def lose_ten_percent(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        if src != CLIENT or wire.decode_type(data) is not PacketType.DATA:
            return
        frames = frames_of(data).messages
        if frames and rng.random() < 0.10:
            net.link.blackout = True
            lost_tags.update(TAG.unpack_from(f[3])[0] for f in frames)

    net.tap = lose_ten_percent
    sent_at: dict[int, float] = {}
    kind: dict[int, str] = {}
    last: dict[str, OutMessage] = {}
    tag = 0
    for _ in range(300):
        for stream in ("A", "B", "F"):
            sent_at[tag], kind[tag] = net.now, stream
            if not independent:
                conn.send(tagged(tag))  # everything on one ordered channel
            elif stream == "F":
                conn.send(tagged(tag), delivery=Delivery.RELIABLE_UNORDERED)
            else:
                prev = [last[stream]] if stream in last else []
                last[stream] = conn.send(tagged(tag), depends_on=prev)
            tag += 1
            net.flush()  # one message per datagram
            net.step(net.now + 0.002)
    net.tap = None
    net.link.blackout = False
    settle(net, conn)
    times = arrival_times(server)
    assert sorted(times) == list(range(tag))
    worst = {"F": 0.0, "B": 0.0}
    b_chain_intact = True
    for t in range(tag):
        if kind[t] == "B":
            b_chain_intact = b_chain_intact and t not in lost_tags
        if t in lost_tags or kind[t] == "A" or (kind[t] == "B" and not b_chain_intact):
            continue
        worst[kind[t]] = max(worst[kind[t]], times[t] - sent_at[t])
    a_lost = sum(1 for t in lost_tags if kind[t] == "A")
    return worst, a_lost


def test_a_lost_message_of_one_chain_never_delays_the_others() -> None:
    worst, a_lost = _hol_run(independent=True)
    assert a_lost >= 10
    # Every F message and every B message whose chain arrived intact was delivered
    # exactly one link delay after it was sent, whatever happened to chain A.
    assert worst["F"] == pytest.approx(0.05)
    assert worst["B"] == pytest.approx(0.05)


def test_the_same_traffic_on_one_ordered_channel_is_held_up() -> None:
    """The control experiment: the measurement above does catch head-of-line blocking."""
    worst, a_lost = _hol_run(independent=False)
    assert a_lost >= 10
    assert worst["F"] > 0.1  # waited for at least one resend round trip


# -- the sender's graph: old dependencies and wire cost ---------------------------------------


def test_a_dependency_sent_more_than_65536_messages_earlier() -> None:
    """The article's "old dependencies" problem: ids wrap, yet the dependency on the
    first message is resolved by the sender (executed long ago: nothing is sent)."""
    cfg = Config(max_datagram_size=600, send_queue_limit=4096)
    net, server, client, conn = pair(Link(loss=0.05, duplicate=0.02, delay=0.001), config=cfg)
    spawn = conn.send(tagged(0), delivery=Delivery.RELIABLE_UNORDERED)
    settle(net, conn)
    assert spawn.graph is not None and spawn.graph.executed
    n = 70_000
    i = 1
    while i <= n:
        while i <= n and conn.queued < 2000:
            conn.send(tagged(i, 200), delivery=Delivery.RELIABLE_UNORDERED)
            i += 1
        net.step(net.now + 5)
    settle(net, conn)
    assert conn._sender.tx_gid > 65536 + 1000  # the 16-bit id wrapped
    sizes: list[int] = []
    net.tap = lambda data, src, dst: sizes.append(len(data)) if src == CLIENT else None
    kill = conn.send(tagged(n + 1), depends_on=[spawn])
    settle(net, conn)
    assert kill.acked
    assert sizes[0] == wire.DATA_HEADER_SIZE + len(wire.reliable_frame(0, 1, tagged(n + 1)))
    got = tags(server)
    assert got[0] == 0 and got[-1] == n + 1
    assert sorted(got) == list(range(n + 2))
    assert_receiver_state_is_empty(server_conn(server))
    assert_sender_state_is_empty(conn)


def test_a_chain_across_the_id_wraparound_under_loss() -> None:
    """Pending dependencies do travel, and resolve to the right message after wrap."""
    cfg = Config(send_queue_limit=4096)
    net, server, client, conn = pair(Link(loss=0.1, reorder=0.1, delay=0.002), config=cfg)
    prev: list[OutMessage] = []
    n = 70_000
    i = 0
    while i < n:
        while i < n and conn.queued < 2000:
            handle = conn.send(tagged(i), depends_on=prev[-2:])
            prev = [*prev[-1:], handle]
            i += 1
        net.step(net.now + 5)
    settle(net, conn)
    assert tags(server) == list(range(n))  # a chain: delivered in order
    assert_receiver_state_is_empty(server_conn(server))
    assert_sender_state_is_empty(conn)


def test_pending_dependencies_cost_two_bytes_each_and_executed_ones_nothing() -> None:
    net, server, client, conn = pair(Link(delay=0.05))
    sizes: list[int] = []
    net.tap = lambda data, src, dst: sizes.append(len(data)) if src == CLIENT else None
    a = conn.send(b"a", delivery=Delivery.RELIABLE_UNORDERED)
    b = conn.send(b"b", depends_on=[a])
    c = conn.send(b"c", depends_on=[a, b])
    net.flush()
    base = wire.DATA_HEADER_SIZE + 3 * len(wire.reliable_frame(0, 0, b"a"))
    assert sizes == [base + 3 + 5]  # b: n + 1 id; c: n + 2 ids
    settle(net, conn)
    assert c.graph is not None and c.graph.executed
    sizes.clear()
    conn.send(b"d", depends_on=[a, b, c])
    conn.send(b"e")
    net.flush()
    assert sizes == [wire.DATA_HEADER_SIZE + 2 * len(wire.reliable_frame(0, 0, b"d"))]


# -- receiver bounds and protocol errors ----------------------------------------------------


def test_a_dependency_on_a_later_message_is_a_protocol_error() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    inject_frames(net, server, wire.message_frame(3, 0, 5, b"x", deps=(9,)))
    assert sconn.state is State.CLOSED
    assert sconn.close_reason is not None
    assert sconn.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "later" in sconn.close_reason.text


def test_a_dependency_beyond_the_window_is_a_protocol_error() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    inject_frames(net, server, wire.message_frame(3, 0, 5, b"x", deps=(40_000,)))
    reason = sconn.close_reason
    assert reason is not None and reason.reason is DisconnectReason.PROTOCOL_ERROR


def test_a_dependency_that_never_arrives_ends_the_connection_after_the_timeout() -> None:
    cfg = Config(dependency_timeout=3.0)
    net, server, client, conn = pair(config=cfg)
    sconn = server_conn(server)
    inject_frames(net, server, wire.message_frame(3, 0, 5, b"waits", deps=(4,)))
    assert len(sconn._receiver.graph.nodes) == 1
    net.run(2.9)
    assert sconn.state is State.CONNECTED
    net.run(0.2)
    reason = sconn.close_reason
    assert reason is not None and reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "never arrived" in reason.text
    assert sconn._receiver.graph.nodes == {}


def test_malformed_fragment_streams_are_dropped_without_growth() -> None:
    cfg = Config(max_message_size=100_000, max_reassembly_bytes=200_000)
    net, server, client, conn = pair(config=cfg)
    sconn = server_conn(server)

    def frag(seq: int, index: int, count: int, total: int, body: bytes = b"z" * 10) -> bytes:
        return wire.message_frame(3, 0, seq, body, fragment=(index, count, total))

    # (Larger than max_message_size: a protocol error, see test_limits.py.)
    # A fragment longer than the whole it claims to be part of.
    assert inject_frames(net, server, frag(0, 0, 3, 5)) is DropReason.MALFORMED
    # A start, then a fragment of the same message that disagrees on count or total.
    assert inject_frames(net, server, frag(0, 0, 3, 30)) is None
    assert sconn._receiver.reserved_bytes == 30 + 256 + 3 * 8
    assert inject_frames(net, server, frag(1, 1, 4, 30)) is DropReason.MALFORMED
    assert inject_frames(net, server, frag(1, 1, 3, 31)) is DropReason.MALFORMED
    # Duplicate fragments are counted, not stored twice.
    assert inject_frames(net, server, frag(0, 0, 3, 30)) is None
    assert sconn.stats.duplicate_messages == 1
    # Fragments that do not add up to the total are thrown away at the end.
    assert inject_frames(net, server, frag(1, 1, 3, 30)) is None
    assert inject_frames(net, server, frag(2, 2, 3, 30, b"short")) is None
    assert sconn._receiver.parts == {} and sconn._receiver.reserved_bytes == 0
    assert sconn.stats.fragments_dropped >= 3
    assert not [e for c, e in server.events if isinstance(e, MessageReceived)]
    # A flood of message starts never holds more than max_reassembly_bytes.
    refused = 0
    for n in range(100):
        if inject_frames(net, server, frag(100 + 10 * n, 0, 5, 90_000)) is not None:
            refused += 1
    assert sconn._receiver.reserved_bytes <= cfg.max_reassembly_bytes
    assert len(sconn._receiver.parts) == 2 and refused == 98
    assert sconn.state is State.CONNECTED


# -- large messages -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "delivery",
    [Delivery.RELIABLE_ORDERED, Delivery.RELIABLE_UNORDERED, Delivery.DEPENDENCY_ORDERED],
)
def test_one_mebibyte_messages_under_ten_percent_loss(delivery: Delivery) -> None:
    rng = random.Random(5)
    net, server, client, conn = pair(Link(loss=0.1, duplicate=0.02, reorder=0.05, delay=0.01))
    big = [rng.randbytes(1 << 20) for _ in range(3)]
    handles: list[OutMessage] = []
    for i, data in enumerate(big):
        kwargs: dict[str, object] = {"delivery": delivery}
        if delivery is Delivery.DEPENDENCY_ORDERED and handles:
            kwargs["depends_on"] = [handles[-1]]
        handles.append(conn.send(data, **kwargs))  # type: ignore[arg-type]
        conn.send(tagged(i), delivery=delivery)  # small ones in between
    settle(net, conn, timeout=600)
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert sorted(d for d in got if len(d) > 100) == sorted(big)
    assert len(got) == 6
    assert all(h.acked for h in handles)
    if delivery is not Delivery.RELIABLE_UNORDERED:
        assert [d for d in got if len(d) > 100] == big
    if delivery is Delivery.RELIABLE_ORDERED:
        assert [len(d) > 100 for d in got] == [True, False] * 3
    assert_receiver_state_is_empty(server_conn(server))
    assert_sender_state_is_empty(conn)


def test_large_reliable_sequenced_messages_supersede_each_other() -> None:
    rng = random.Random(6)
    net, server, client, conn = pair(Link(loss=0.1, delay=0.02))
    versions = [rng.randbytes(50_000) for _ in range(5)]
    handles = [conn.send(v, delivery=Delivery.RELIABLE_SEQUENCED) for v in versions]
    settle(net, conn)
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert got == [versions[-1]]
    assert [h.superseded for h in handles] == [True] * 4 + [False]
    assert handles[-1].acked
    assert server_conn(server)._receiver.reserved_bytes == 0


# -- sending side: redundancy, expiry and misuse --------------------------------------------


@pytest.mark.parametrize("redundancy", [0, 3])
def test_redundancy_repairs_a_lost_packet_with_the_next_one(redundancy: int) -> None:
    """At 1 message per ms, the message in a lost packet arrives with the next packet,
    1 ms late, instead of a round trip (40 ms) late with a fast resend (once the path
    has been seen to lose packets: redundancy follows the measured loss)."""
    net, server, conn = timed_pair(Link(delay=0.02, loss=0.05), Config(redundancy=redundancy))
    for i in range(500):  # settle the RTT estimate and measure the loss
        conn.send(tagged(1000 + i))
        net.run(0.001)
    net.link.loss = 0.0
    net.run(0.2)
    resent = conn.stats.messages_resent
    sent_at = {}
    victim: list[bytes] = []

    def drop_one(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        frames = frames_of(data).messages if src == CLIENT else []
        if frames and TAG.unpack_from(frames[0][3])[0] == 20 and not victim:
            victim.append(data)
            net.link.blackout = True

    net.tap = drop_one
    for i in range(40):
        sent_at[i] = net.now
        conn.send(tagged(i))
        net.run(0.001)
    net.tap = None
    settle(net, conn)
    assert victim
    late = arrival_times(server)[20] - sent_at[20] - 0.02
    if redundancy:
        assert late == pytest.approx(0.001, abs=0.0005)
        assert conn.stats.messages_redundant > 0
        assert conn.stats.messages_resent == resent
    else:
        assert late > 0.04


def test_unreliable_messages_that_waited_too_long_are_dropped_and_counted() -> None:
    cfg = Config(unreliable_max_age=0.1)
    net = Network(seed=1, link=Link(delay=0.05))
    server = net.add(SERVER, cfg, accept=True)
    client = net.add(CLIENT, cfg)
    conn = client.endpoint.connect(SERVER, net.now)
    conn.send(b"stale", reliable=False, now=net.now)  # queued while connecting (~200 ms)
    conn.send(b"kept")
    net.run_until(lambda: conn.state is State.CONNECTED)
    net.run(1.0)
    assert server.received() == [b"kept"]
    assert conn.stats.messages_expired == 1


def test_sequenced_numbers_are_taken_on_the_way_out() -> None:
    """40,000 unreliable-sequenced messages expire in the queue: they use no numbers,
    so the next one is not read as older than the last one delivered."""
    net, server, client, conn = pair(Link(delay=0.05), config=Config(unreliable_max_age=0.1))
    conn.send(b"first", delivery=Delivery.UNRELIABLE_SEQUENCED)
    net.run(0.2)
    for _ in range(40_000):
        conn.send(b"stale", delivery=Delivery.UNRELIABLE_SEQUENCED, now=net.now - 1.0)
    conn.send(b"fresh", delivery=Delivery.UNRELIABLE_SEQUENCED)
    net.run(0.5)
    assert conn.stats.messages_expired == 40_000
    assert server.received() == [b"first", b"fresh"]


def test_misuse_of_modes_raises_at_once() -> None:
    net, server, client, conn = pair()
    ordered = conn.send(b"o")
    graph = conn.send(b"g", delivery=Delivery.RELIABLE_UNORDERED)
    with pytest.raises(LocalProtocolError, match="depends_on"):
        conn.send(b"x", depends_on=[ordered])
    with pytest.raises(LocalProtocolError, match="DEPENDENCY_ORDERED"):
        conn.send(b"x", delivery=Delivery.RELIABLE_ORDERED, depends_on=[graph])
    with pytest.raises(LocalProtocolError, match="contradicts"):
        conn.send(b"x", reliable=False, delivery=Delivery.RELIABLE_UNORDERED)
    with pytest.raises(LocalProtocolError, match="list"):
        conn.send(b"x", depends_on=graph)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError, match="unknown delivery"):
        conn.send(b"x", delivery=9)
    with pytest.raises(MessageTooLarge, match="never fragmented"):
        conn.send(bytes(conn.max_datagram_payload + 1), delivery=Delivery.UNRELIABLE_SEQUENCED)
    with pytest.raises(MessageTooLarge, match="max_message_size"):
        conn.send(bytes(conn.max_message_size + 1))
    many = [conn.send(b"d", delivery=Delivery.RELIABLE_UNORDERED) for _ in range(256)]
    with pytest.raises(LocalProtocolError, match="at most 255"):
        conn.send(b"x", depends_on=many)
    _, other_server, _, other = pair(seed=2)
    foreign = other.send(b"f", delivery=Delivery.RELIABLE_UNORDERED)
    with pytest.raises(LocalProtocolError, match="this connection"):
        conn.send(b"x", depends_on=[foreign])
    with pytest.raises(ValueError, match="fragments"):
        Config(channel_window=64)
