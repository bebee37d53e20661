"""What a malicious peer (one that holds the session keys) can make the receive side
spend: each packet costs work in proportion to its own messages, never to what earlier
packets left waiting, and everything kept is charged to a budget.

Work is counted in operations (lookups into the receiver's tables), not time."""

from __future__ import annotations

from typing import Any

from rudp import frames
from rudp.config import BUFFER_ENTRY_COST
from rudp.connection import State
from rudp.events import DisconnectReason
from rudp.receiving import PARTIAL_COST
from rudp.wire import GRAPH, RELIABLE_ORDERED, RELIABLE_SEQUENCED, DropReason
from tests.rudp.harness import inject_frames, pair, server_conn


class CountingDict(dict[Any, Any]):
    """A dict that counts the entries read through it by key and the walks over it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.reads = 0
        self.walks = 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return super().__getitem__(key)

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


# -- the dependency graph ------------------------------------------------------------------


def test_a_dependency_named_twice_ends_the_connection_naming_it() -> None:
    # Each copy of an id waited separately: 255 copies of one missing id in a message
    # of 274 reserved bytes put 255 entries on that id's list, walked in full for
    # every message with that id in a later packet.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    first = frames.message_frame(GRAPH, 0, 1, b"a", deps=(0,) * 255, fragment=(0, 2, 2))
    second = frames.message_frame(GRAPH, 0, 2, b"b", fragment=(1, 2, 2))
    inject_frames(net, server, first, second)
    assert sconn.state is State.CLOSED
    assert sconn.close_reason is not None
    assert sconn.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert sconn.close_reason.text == "a message names the same dependency twice"
    assert sconn._receiver.graph.waiters == {}


def test_an_unfragmented_message_naming_a_dependency_twice_ends_the_connection() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    inject_frames(net, server, frames.message_frame(GRAPH, 0, 5, b"a", deps=(3, 0, 3)))
    assert sconn.close_reason is not None
    assert sconn.close_reason.text == "a message names the same dependency twice"


def test_a_fragmented_graph_message_is_charged_for_each_dependency_it_waits_for() -> None:
    # It was charged its reassembly reservation only (total + 256 + 8 per fragment),
    # whatever the entries its dependency list added to the graph.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    deps = tuple(range(255))  # never sent
    reservation = 2 + PARTIAL_COST + 8 * 2
    first = frames.message_frame(GRAPH, 0, 300, b"a", deps=deps, fragment=(0, 2, 2))
    second = frames.message_frame(GRAPH, 0, 301, b"b", fragment=(1, 2, 2))
    assert inject_frames(net, server, first, second) is None
    assert rx.graph.reserved == reservation + 255 * BUFFER_ENTRY_COST
    # Second fragment first: the first one's dependencies are charged when it comes.
    second = frames.message_frame(GRAPH, 0, 303, b"b", fragment=(1, 2, 2))
    assert inject_frames(net, server, second) is None
    assert rx.reassembly_bytes == reservation
    first = frames.message_frame(GRAPH, 0, 302, b"a", deps=deps[:10], fragment=(0, 2, 2))
    assert inject_frames(net, server, first, first) is None  # a copy is charged once
    assert rx.graph.reserved == 2 * reservation + 265 * BUFFER_ENTRY_COST
    assert rx.reassembly_bytes == 0
    # Dependencies already run cost nothing; once they all have, nothing is held.
    for i in range(0, 255, 50):
        assert (
            inject_frames(
                net, server, *[frames.message_frame(GRAPH, 0, i + j, b"") for j in range(50)]
            )
            is None
        )
    assert (
        inject_frames(
            net, server, *[frames.message_frame(GRAPH, 0, j, b"") for j in range(250, 255)]
        )
        is None
    )
    assert rx.graph.nodes == {} and rx.graph.waiters == {} and rx.graph.frees == {}
    assert rx.reserved_bytes == 0 and rx.buffered_bytes == 0
    assert sconn.state is State.CONNECTED


def test_the_reassembly_budget_bounds_the_entries_dependency_lists_hold() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    deps = tuple(range(255))
    gid = 256
    refused = 0
    while gid + 1 < 4096 and refused < 3:
        first = frames.message_frame(GRAPH, 0, gid, b"a", deps=deps, fragment=(0, 2, 2))
        second = frames.message_frame(GRAPH, 0, gid + 1, b"b", fragment=(1, 2, 2))
        if inject_frames(net, server, first, second) is DropReason.RECV_BUFFER_FULL:
            refused += 1
        gid += 2
    assert refused == 3
    entries = sum(len(w) for w in rx.graph.waiters.values())
    assert entries > 60_000
    # Every entry is charged, within the budget (plus the room kept for the head).
    assert entries * BUFFER_ENTRY_COST <= rx.reserved_bytes <= rx._budget(True)
    assert sconn.state is State.CONNECTED


def test_can_buffer_costs_the_same_however_many_messages_wait_for_an_id() -> None:
    # With the reorder buffer nearly full, each graph message of a packet asked what
    # running it would free by walking every message waiting for it: a refused packet
    # (which changes nothing, so the peer sends it again) of 250 messages with one id
    # walked the list 250 times.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    graph = rx.graph
    for i in range(1, 201):  # 200 messages waiting for id 0, each for 1 and 0
        dep = frames.message_frame(GRAPH, 0, 1000 + i, b"w", deps=(0, 1000))
        assert inject_frames(net, server, dep) is None
    waiting = graph.buffered
    assert len(graph.waiters[0]) == 200
    limit = sconn.config.recv_buffer_bytes
    seq = 1
    while rx.buffered_bytes + 1364 < limit - 300:
        assert inject_frames(net, server, frames.reliable_frame(5, seq, b"B" * 1300)) is None
        seq += 1
    room = limit - rx.buffered_bytes
    # Running 0 would free an entry of each (12,800 bytes): an early message larger
    # than the room left but within that fits, with one copy of 0 or 250.
    early = frames.reliable_frame(5, seq, b"C" * (room + 5000))
    zeros = [frames.message_frame(GRAPH, 0, 0, b"") for _ in range(250)]
    messages = frames.decode_frames(early + b"".join(zeros), 0).messages
    graph.nodes = CountingDict(graph.nodes)
    assert rx.can_buffer(messages, 1324)
    assert graph.nodes.reads == 0
    # One larger than that is refused, however many copies of 0 come with it.
    early = frames.reliable_frame(5, seq, b"C" * (room + 200 * BUFFER_ENTRY_COST))
    messages = frames.decode_frames(early + b"".join(zeros), 0).messages
    assert not rx.can_buffer(messages, 1324)
    assert graph.nodes.reads == 0
    assert graph.buffered == waiting


def test_what_running_an_id_frees_follows_the_messages_as_they_wait_and_run() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    graph = sconn._receiver.graph
    entry = BUFFER_ENTRY_COST
    assert (
        inject_frames(net, server, frames.message_frame(GRAPH, 0, 10, b"xy", deps=(1, 2))) is None
    )
    assert inject_frames(net, server, frames.message_frame(GRAPH, 0, 11, b"abc", deps=(2,))) is None
    assert graph.releases(1) == entry
    assert graph.releases(2) == entry + entry + 3 + entry
    assert inject_frames(net, server, frames.message_frame(GRAPH, 0, 1, b"")) is None
    # 10 now waits for 2 alone: running 2 frees both whole.
    assert graph.releases(1) == 0
    assert graph.releases(2) == (entry + 2 + entry) + (entry + 3 + entry)
    assert graph.buffered == graph.releases(2)
    assert inject_frames(net, server, frames.message_frame(GRAPH, 0, 2, b"")) is None
    assert graph.buffered == 0 and graph.frees == {} and graph.nodes == {}


# -- reliable-sequenced fragments ----------------------------------------------------------


def test_reliable_sequenced_messages_cost_the_same_however_many_partials_are_held() -> None:
    # Every reliable-sequenced message (and every new fragment of one, twice) looked
    # for the channel's older partial messages by walking every partial message held,
    # of every mode and channel: 15,300 fit the budget, and none of them expires.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    for ch in range(2, 6):
        held = [
            frames.message_frame(RELIABLE_ORDERED, ch, s + 1, b"x", fragment=(1, 2, 2))
            for s in range(1, 170, 2)
        ]
        assert inject_frames(net, server, *held) is None
    assert len(rx.parts) == 4 * 85
    rx.parts = CountingDict(rx.parts)
    rs = [frames.message_frame(RELIABLE_SEQUENCED, 1, i, b"") for i in range(100)]
    assert inject_frames(net, server, *rs) is None
    assert rx.parts.walks == 0
    starts = [
        frames.message_frame(RELIABLE_SEQUENCED, 1, 100 + 2 * j, b"q", fragment=(0, 2, 2))
        for j in range(50)
    ]
    assert inject_frames(net, server, *starts) is None
    assert rx.parts.walks == 0
    # Each start dropped the one before: one is left, and the budget holds it alone.
    rs_parts = [k for k in dict(rx.parts) if k[0] == RELIABLE_SEQUENCED]
    assert rs_parts == [(RELIABLE_SEQUENCED, 1, 198)]
    assert rx.reassembly_bytes == (4 * 85 + 1) * (2 + PARTIAL_COST + 16)
    # A newer whole message makes it moot.
    assert inject_frames(net, server, frames.message_frame(RELIABLE_SEQUENCED, 1, 200, b"")) is None
    assert [k for k in dict(rx.parts) if k[0] == RELIABLE_SEQUENCED] == []
    assert rx.reassembly_bytes == 4 * 85 * (2 + PARTIAL_COST + 16)


# -- overlapping ordered messages ----------------------------------------------------------


def _fragments(channel: int, base: int, count: int) -> list[bytes]:
    return [
        frames.message_frame(RELIABLE_ORDERED, channel, base + i, b"x", fragment=(i, count, count))
        for i in range(count)
    ]


def test_an_early_message_inside_a_delivered_message_is_dropped_and_uncharged() -> None:
    # A message at b+1 waited early; a 3-fragment message at b..b+2 then completed and
    # was delivered, and the channel moved past b+1: that entry stayed, charged, for
    # the life of the connection. 1,971 such rounds filled the reorder buffer.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    for b in range(0, 300, 3):
        assert inject_frames(net, server, frames.reliable_frame(3, b + 1, b"L" * 1000)) is None
        assert rx.buffered == 1000 + BUFFER_ENTRY_COST
        assert inject_frames(net, server, *_fragments(3, b, 3)) is None
        assert rx.ch_next[3] == b + 3
        assert rx.ch_buf[3] == {} and rx.buffered == 0
    net.run(0.1)
    assert server.received() == [b"xxx"] * 100
    assert sconn.stats.duplicate_messages == 100


def test_an_early_message_inside_a_buffered_whole_message_is_dropped_when_it_goes() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    assert inject_frames(net, server, *_fragments(3, 1, 3)) is None  # complete, early
    assert inject_frames(net, server, frames.reliable_frame(3, 2, b"L" * 100)) is None
    assert inject_frames(net, server, frames.reliable_frame(3, 0, b"first")) is None
    net.run(0.1)
    assert server.received() == [b"first", b"xxx"]
    assert rx.ch_next[3] == 4 and rx.ch_buf[3] == {}
    assert rx.buffered == 0 and rx.reserved_bytes == 0


def test_a_partial_message_the_channel_moved_past_gives_its_reservation_back() -> None:
    # A message being reassembled at b (its second fragment in), then another message
    # at b delivered whole: the partial one could never complete, and held its
    # reservation for good.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    late = frames.message_frame(RELIABLE_ORDERED, 3, 1, b"y", fragment=(1, 2, 2))
    assert inject_frames(net, server, late) is None
    assert rx.reassembly_bytes > 0
    assert inject_frames(net, server, frames.reliable_frame(3, 0, b"first")) is None
    assert rx.parts == {} and rx.reassembly_bytes == 0
    # One the channel moves past inside a larger message, too.
    late = frames.message_frame(RELIABLE_ORDERED, 3, 3, b"y", fragment=(1, 2, 2))
    assert inject_frames(net, server, late) is None
    assert inject_frames(net, server, *_fragments(3, 1, 3)) is None
    assert rx.ch_next[3] == 4
    assert rx.parts == {} and rx.reassembly_bytes == 0
    net.run(0.1)
    assert server.received() == [b"first", b"xxx"]
    assert sconn.state is State.CONNECTED


def test_a_partial_graph_message_at_an_id_that_ran_gives_its_reservation_back() -> None:
    # The graph's own case: a message being reassembled at b+1 (its second fragment,
    # id b+2, in), then a 3-fragment message at b..b+2 ran. 15,307 such rounds held
    # the whole reassembly budget, and every later fragment but the head's was refused.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    rx = sconn._receiver
    for b in range(0, 300, 3):
        late = frames.message_frame(GRAPH, 0, b + 2, b"y", fragment=(1, 2, 2))
        assert inject_frames(net, server, late) is None
        assert rx.reassembly_bytes == 2 + PARTIAL_COST + 16
        whole = [frames.message_frame(GRAPH, 0, b + i, b"x", fragment=(i, 3, 3)) for i in range(3)]
        assert inject_frames(net, server, *whole) is None
        assert rx.graph.low == b + 3
        assert rx.parts == {} and rx.reserved_bytes == 0
    # One at an id that an unfragmented message then takes, waiting or not.
    late = frames.message_frame(GRAPH, 0, 301, b"y", fragment=(1, 2, 2))
    assert inject_frames(net, server, late) is None
    assert inject_frames(net, server, frames.message_frame(GRAPH, 0, 300, b"first")) is None
    late = frames.message_frame(GRAPH, 0, 303, b"y", fragment=(1, 2, 2))
    assert inject_frames(net, server, late) is None
    waits = frames.message_frame(GRAPH, 0, 302, b"second", deps=(301,))
    assert inject_frames(net, server, waits) is None
    assert len(rx.parts) == 1  # it cannot complete: it goes when 302 runs
    assert inject_frames(net, server, frames.message_frame(GRAPH, 0, 301, b"")) is None
    assert rx.parts == {} and rx.reserved_bytes == 0 and rx.buffered_bytes == 0
    net.run(0.1)
    assert server.received() == [b"xxx"] * 100 + [b"first", b"", b"second"]
    assert sconn.state is State.CONNECTED
