"""Regression tests for delivery modes, fragmentation and the dependency graph.

Each reproduces a bug in the first version of that code and failed before its fix.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from collections.abc import Callable

import pytest

from rudp import frames, wire
from rudp.config import Config
from rudp.connection import State
from rudp.errors import MessageTooLarge, SendQueueFull
from rudp.events import DisconnectReason, MessageReceived
from rudp.wire import Delivery
from tests.rudp.harness import (
    CLIENT,
    Link,
    Network,
    frames_of,
    inject_frames,
    pair,
    server_conn,
    settle,
    tagged,
    tags,
)


def test_two_disagreeing_first_fragments_in_one_packet_are_malformed() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    a = frames.message_frame(3, 0, 0, b"x" * 5, fragment=(0, 2, 10))
    b = frames.message_frame(3, 0, 5, b"y" * 5, fragment=(5, 10, 100))
    inject_frames(net, server, a, b)  # IndexError escapes receive_datagram
    assert sconn.state is State.CONNECTED


@pytest.mark.parametrize("dependent_first", [True, False])
def test_a_dependency_on_an_id_inside_a_fragmented_message_is_met_when_it_runs(
    dependent_first: bool,
) -> None:
    # Ids 0-2 are one fragmented graph message; a message naming id 1 ran at once if
    # it came after it, but waited for good (then a protocol error) if it came first.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    parts = [frames.message_frame(3, 0, i, b"ab", fragment=(i, 3, 6)) for i in range(3)]
    dependent = frames.message_frame(3, 0, 5, b"waits for id 1", deps=(1,))
    if dependent_first:
        inject_frames(net, server, dependent)
        inject_frames(net, server, *parts)
    else:
        inject_frames(net, server, *parts)
        inject_frames(net, server, dependent)
    got = [e.data for _, e in server.endpoint._sink.events if isinstance(e, MessageReceived)]
    assert got == [b"ababab", b"waits for id 1"]
    graph = sconn._receiver.graph
    assert not graph.nodes and not graph.waiters and not graph.frees and graph.buffered == 0
    net.run(30)
    assert sconn.close_reason is None, sconn.close_reason


def test_more_dependents_of_one_message_than_the_window() -> None:
    net, server, client, conn = pair(Link(delay=0.02))
    root = conn.send(b"root", delivery=Delivery.RELIABLE_UNORDERED)
    for i in range(5000):
        conn.send(tagged(i), depends_on=[root])
    settle(net, conn)
    sconn = server_conn(server)
    assert sconn.close_reason is None, sconn.close_reason
    assert len(tags(server)) == 5001


def drop_once(net: Network, pred: Callable[[list[frames.MessageFrame]], bool]) -> list[int]:
    """Lose, once, each client DATA packet for which pred(frames) is true."""
    dropped = [0]
    transmit = net._transmit

    def tap(data: bytes, src: tuple[object, ...], dst: tuple[object, ...]) -> None:
        if src == CLIENT and wire.decode_type(data) is wire.PacketType.DATA and not dropped[0]:
            frames = frames_of(data)
            if pred(frames.messages):
                dropped[0] += 1
                net.sent.append((data, src, dst))
                return
        transmit(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]
    return dropped


def test_ordered_window_counts_from_a_large_message_still_incomplete() -> None:
    net, server, client, conn = pair(Link(delay=0.05))
    big = bytes(300 * 1168)  # 300 fragments, seqs 0..299
    d = drop_once(net, lambda ms: any(m[4] is not None and m[4].part == m[4].parts - 1 for m in ms))
    conn.send(big)
    for i in range(5000):
        conn.send(tagged(i))
    net.run(30)
    assert d[0] == 1
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert conn.queued == 0  # the sender believes everything was delivered ...
    assert len(got) == 5001  # ... and so did the receiver


def test_superseded_large_sequenced_messages_free_their_reassembly() -> None:
    rng = random.Random(1)
    net, server, client, conn = pair(Link(delay=0.01))
    versions = [rng.randbytes(1 << 20) for _ in range(6)]
    for v in versions:
        conn.send(v, delivery=Delivery.RELIABLE_SEQUENCED)
        net.run(0.015)  # a new version before the previous one completed
    net.run(60)
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert got and got[-1] == versions[-1]


def drop_n(net: Network, pred: Callable[[list[frames.MessageFrame]], bool], n: int) -> list[int]:
    dropped = [0]
    transmit = net._transmit

    def tap(data: bytes, src: tuple[object, ...], dst: tuple[object, ...]) -> None:
        is_data = wire.decode_type(data) is wire.PacketType.DATA
        if src == CLIENT and is_data and dropped[0] < n and pred(frames_of(data).messages):
            dropped[0] += 1
            net.sent.append((data, src, dst))
            return
        transmit(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]
    return dropped


def test_completed_messages_waiting_in_order_never_block_the_head() -> None:
    cfg = Config(max_message_size=10_000, max_reassembly_bytes=20_000)
    net, server, client, conn = pair(Link(delay=0.02), config=cfg)
    # lose both fragments of message 0 once: messages 1.. complete first and sit in the
    # reorder buffer holding their reservation, and message 0 can never start
    d = drop_n(net, lambda ms: any(m[4] is not None and m[2] in (0, 1) for m in ms), 2)
    msgs = [struct.pack("!I", i) + bytes(1996) for i in range(20)]  # 2 fragments each
    for m in msgs:
        conn.send(m)
    net.run(60)
    assert d[0] >= 1  # the loss did happen
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert len(got) == len(msgs)


def test_waiting_graph_messages_never_refuse_the_unblocking_packet() -> None:
    cfg = Config(recv_buffer_bytes=64_000)
    net, server, client, conn = pair(Link(delay=0.02), config=cfg)
    w = conn.send(b"w", delivery=Delivery.RELIABLE_UNORDERED)
    net.flush()
    # x depends on w: it carries a dependency while w's ack is in flight
    d = drop_n(net, lambda ms: any(m[0] == 3 and m[3][:1] == b"X" for m in ms), 1)
    x = conn.send(b"X" + bytes(100), depends_on=[w])
    for i in range(200):
        conn.send(tagged(i, 1000), depends_on=[x])
    net.run(15)
    assert d[0] >= 1  # the loss did happen
    net.run(10)
    got = [e.data for _, e in server.events if isinstance(e, MessageReceived)]
    assert len(got) == 202


def test_a_message_as_large_as_the_whole_reassembly_budget() -> None:
    cfg = Config(max_message_size=100_000, max_reassembly_bytes=100_000)  # accepted
    net, server, client, conn = pair(Link(delay=0.02), config=cfg)
    conn.send(bytes(100_000))
    net.run(30)
    assert server.received() == [bytes(100_000)]


def test_a_resent_last_fragment_with_followers_is_accepted() -> None:
    cfg = Config(recv_buffer_bytes=20_000)
    net, server, client, conn = pair(Link(delay=0.02), config=cfg)
    big = b"B" * (1168 + 40)  # 2 fragments; the last one is 40 bytes
    d = drop_n(net, lambda ms: any(m[4] is not None and m[4].part == 1 for m in ms), 1)
    conn.send(big)
    for i in range(300):
        conn.send(tagged(i, 100))
    net.run(30)
    assert d[0] >= 1  # the loss did happen
    assert len(server.received()) == 301


def test_a_last_fragment_lost_many_times_under_a_full_stream() -> None:
    net, server, client, conn = pair(Link(delay=0.02))
    big = b"B" * (1168 + 40)
    d = drop_n(net, lambda ms: any(m[4] is not None and m[4].part == 1 for m in ms), 25)
    conn.send(big)
    for i in range(4000):
        conn.send(tagged(i, 500))
    net.run(60)
    assert d[0] >= 1  # the loss did happen
    assert len(server.received()) == 4001


def test_more_than_32767_sequenced_messages_superseded_before_sending() -> None:
    net, server, client, conn = pair(Link(delay=0.02))
    for i in range(40_000):
        h = conn.send(tagged(i), delivery=Delivery.RELIABLE_SEQUENCED)
    net.run(5)
    assert h.acked and conn.queued == 0
    assert tags(server) == [39_999]


def test_unreliable_send_without_now_on_an_idle_connection_is_sent() -> None:
    net, server, client, conn = pair(Link(delay=0.02))
    net.run(0.8)  # idle: no event reaches the client core for 0.8 s (keepalive is 1 s)
    conn.send(b"u", reliable=False)
    net.run(0.5)
    assert server.received() == [b"u"]


@pytest.mark.parametrize("seed", range(12))
def test_every_mode_and_size_then_graceful_close_under_loss(seed: int) -> None:
    rng = random.Random(seed)
    link = Link(loss=0.15, duplicate=0.05, reorder=0.1, delay=0.02, jitter=0.005)
    cfg = Config(redundancy=rng.choice([0, 2]), max_message_size=60_000, channel_window=512)
    net, server, client, conn = pair(link, seed=seed, config=cfg)
    graph = []
    expect_reliable = []
    last_rs = {}
    for i in range(1500):
        kind = rng.random()
        size = rng.choice([8, 8, 8, 300, 2000, 20_000])
        data = tagged(i, size)
        if kind < 0.3:
            conn.send(data, channel=rng.randrange(3))
            expect_reliable.append(i)
        elif kind < 0.6:
            deps = rng.sample(graph[-50:], min(len(graph[-50:]), rng.randrange(3)))
            h = (
                conn.send(data, depends_on=deps)
                if deps
                else conn.send(data, delivery=Delivery.RELIABLE_UNORDERED)
            )
            graph.append(h)
            expect_reliable.append(i)
        elif kind < 0.8:
            ch = rng.randrange(3)
            conn.send(data, delivery=Delivery.RELIABLE_SEQUENCED, channel=ch)
            last_rs[ch] = i
        else:
            conn.send(
                tagged(i), delivery=rng.choice([Delivery.UNRELIABLE, Delivery.UNRELIABLE_SEQUENCED])
            )
        if rng.random() < 0.05:
            net.run(rng.random() * 0.05)
    conn.close(net.now, 7, "bye")
    net.run(120)
    got = tags(server)
    assert len(got) == len(set(got))
    missing = set(expect_reliable) - set(got)
    assert not missing, sorted(missing)[:10]
    assert set(last_rs.values()) <= set(got)
    ds = server.disconnects()
    assert ds and ds[0].code == 7 and ds[0].by_peer, ds
    assert client.disconnects()[0].reason is DisconnectReason.CLOSED


def test_fragments_entering_the_window_mid_packet_respect_the_budget() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    tracemalloc.start()
    base_mem = tracemalloc.get_traced_memory()[0]
    for e in range(200):
        inorder = frames.reliable_frame(0, e, b"m")
        # beyond the window when the packet is checked, inside it once `inorder` was delivered
        # (4096 fragments: the most our channel window lets complete; more is a
        # protocol error, test_limits.py)
        frag = frames.message_frame(1, 0, e + 4096, b"z", fragment=(0, 4096, 1_000_000))
        assert inject_frames(net, server, inorder, frag) is None
    mem = tracemalloc.get_traced_memory()[0] - base_mem
    tracemalloc.stop()
    assert mem < 2_000_000  # a 4096-slot partial per packet would be 6.5 MB (65535: 100)
    assert sconn._receiver.reserved_bytes <= sconn.config.max_reassembly_bytes


@pytest.mark.parametrize("refusal", ["too_large", "queue_full"])
def test_a_refused_reliable_sequenced_send_leaves_the_previous_one_on_its_way(
    refusal: str,
) -> None:
    # The previous message was superseded before the new one was checked: the send
    # raised, and neither arrived.
    net, server, client, conn = pair(config=Config(send_queue_limit=16))
    mode = Delivery.RELIABLE_SEQUENCED
    kept = conn.send(b"score=1", delivery=mode, channel=2)
    if refusal == "queue_full":
        for i in range(10):
            conn.send(b"fill%d" % i)
        with pytest.raises(SendQueueFull):
            conn.send(b"t" * 8000, delivery=mode, channel=2)  # 7 fragments: 11 + 7 > 16
    else:
        with pytest.raises(MessageTooLarge):
            conn.send(b"s" * 30000, delivery=mode, channel=2)  # more fragments than 16
    assert not kept.superseded and conn.queued == (11 if refusal == "queue_full" else 1)
    net.run(1.0)
    assert kept.acked
    assert [m.data for m in tagged_messages(server, 2)] == [b"score=1"]
    # A newer one that fits still replaces it while it waits.
    conn.send(b"score=2", delivery=mode, channel=2)
    net.run(1.0)
    assert [m.data for m in tagged_messages(server, 2)][-1] == b"score=2"


def tagged_messages(node: object, channel: int) -> list[MessageReceived]:
    events = node.events  # type: ignore[attr-defined]
    return [e for _, e in events if isinstance(e, MessageReceived) and e.channel == channel]
