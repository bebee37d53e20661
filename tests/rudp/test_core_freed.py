"""An ended connection is freed by reference counting, however it ended.

A connection's parts (sender, recovery, packet builder and reader, receiver, its
dependency graph, migration, path MTU) point back to it; an ended connection drops
those references (``Connection._release``), so the moment nothing outside holds it
the whole core goes, without waiting for the cyclic collector. Each test ends a
connection one way, with the collector off, drops every outside reference, and asks
the collector what it would have had to free: nothing, and the connections are gone.
What a user may still read of an ended connection (its stats, its close reason)
works after the release, and so does everything a late caller may do to it.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable

import pytest

from rudp import Delivery, frames, wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import ConnectionClosed
from rudp.events import Disconnected, DisconnectReason
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Link,
    Network,
    Node,
    inject_frames,
    pair,
    server_conn,
)

KEYED = Config(static_key=bytes(range(32)))  # a NOCONN is believed only under NK


pytestmark = pytest.mark.usefixtures("collector_off")


def live_connections() -> int:
    return sum(type(o) is Connection for o in gc.get_objects())


def cyclic_garbage() -> Counter[str]:
    """What a collection now would free, by type (nothing is freed: it is kept)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return found


def assert_freed(drop: Callable[[], None], connections: int) -> None:
    """``drop`` lets go of the last outside references to ``connections`` ended
    connections: they must be gone at once, leaving nothing to the collector."""
    gc.collect()  # what the set-up left
    before = live_connections()
    drop()
    assert cyclic_garbage() == Counter()
    assert live_connections() == before - connections


def check_readable_after_end(conn: Connection, reason: DisconnectReason) -> None:
    """What a user or a late datagram may still do to an ended connection."""
    assert conn.state is State.CLOSED
    assert conn._released  # by the call that ended it, not by the calls below
    assert conn.close_reason is not None and conn.close_reason.reason is reason
    stats = conn.stats
    assert stats.as_dict()["path_mtu"] >= 0
    assert stats.packets_missing >= 0 and 0.0 <= stats.inbound_loss <= 1.0
    assert repr(stats) and conn.queued == 0
    with pytest.raises(ConnectionClosed):
        conn.send(b"late")
    now = conn._clock + 1.0
    conn.close(now)
    conn.abort()
    conn.pause_receiving()
    conn.resume_receiving(now)
    assert conn.get_timer() is None
    conn.handle_timer(now)
    assert conn.datagrams_to_send(now) == []
    late = wire.data_prefix(conn.cid, 7) + bytes(wire.DATA_HEADER_SIZE)
    assert conn._receive_sealed(late, 7, now) is wire.DropReason.UNEXPECTED
    assert conn._receive_moved(late, 7, ("10.9.9.9", 1), now, movable=True) is (
        wire.DropReason.UNEXPECTED
    )
    conn._datagram_refused(1400, now)
    assert conn.peek_datagram(late) is None
    assert conn.take_path_datagrams() == []


def dropping(held: list[Connection], *nodes: Node) -> Callable[[], None]:
    """What lets go of ``held``, of the events ``nodes`` and their endpoints keep
    (they name their connections) and of the entries their timer heaps still have."""

    def drop() -> None:
        held.clear()
        for node in nodes:
            while node.endpoint.next_event() is not None:
                pass  # events not yet taken name their connections too
            node.events.clear()
            # Timer entries an ended connection left in the heap go at the next prune.
            node.endpoint._prune()

    return drop


def test_a_graceful_close_frees_both_sides() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    conn.send(b"before the close")
    sconn.send(b"and the other way")
    conn.close(net.now, 4001, "bye")
    net.run(5)
    check_readable_after_end(conn, DisconnectReason.CLOSED)
    check_readable_after_end(sconn, DisconnectReason.CLOSED)
    assert conn.stats.bytes_sent > 0 and sconn.stats.packets_received > 0
    # Late datagrams for the closed connections reach the endpoints, not the parts.
    for data, src, dst in net.sent[-4:]:
        net.inject(data, src, dst)
    net.run(1)
    held = [conn, sconn]
    del conn, sconn
    assert_freed(dropping(held, server, client), 2)


def test_a_silence_that_times_both_sides_out_frees_them() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    net.link.blackout = True
    net.run(20)
    check_readable_after_end(conn, DisconnectReason.TIMEOUT)
    check_readable_after_end(sconn, DisconnectReason.TIMEOUT)
    held = [conn, sconn]
    del conn, sconn
    assert_freed(dropping(held, server, client), 2)


def test_a_reset_by_noconn_frees_the_connection() -> None:
    net, server, client, conn = pair(Link(delay=0.02), config=KEYED)
    net.remove(SERVER)
    fresh = net.add(SERVER, KEYED, accept=True)  # restarted: it knows nobody
    conn.send(b"are you there?")
    net.run(1)
    check_readable_after_end(conn, DisconnectReason.NO_CONNECTION)
    held = [conn]
    del conn
    assert_freed(dropping(held, client, fresh), 1)
    assert server_conn(server).state is State.CONNECTED  # the old server's, not ended


def test_a_refused_connection_is_freed() -> None:
    net = Network()
    server = net.add(SERVER, Config(max_connections=1), accept=True)
    first = net.add(CLIENT).endpoint.connect(SERVER, net.now)
    other = net.add(("10.0.0.3", 5000))
    second = other.endpoint.connect(SERVER, net.now)
    net.run(1)
    assert first.state is State.CONNECTED
    check_readable_after_end(second, DisconnectReason.REFUSED)
    held = [second]
    del second
    assert_freed(dropping(held, other, server), 1)


def test_a_connect_timeout_frees_the_attempt() -> None:
    net = Network()
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    conn.send(b"queued while connecting")
    net.run(10)
    check_readable_after_end(conn, DisconnectReason.CONNECT_TIMEOUT)
    held = [conn]
    del conn
    assert_freed(dropping(held, client), 1)


def test_aborted_connections_are_freed_connecting_or_connected() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    late = net.add(("10.0.0.4", 5000))
    attempt = late.endpoint.connect(SERVER, net.now)
    conn.send(b"never acknowledged")
    attempt.abort()
    conn.abort()
    check_readable_after_end(conn, DisconnectReason.ABORTED)
    check_readable_after_end(attempt, DisconnectReason.ABORTED)
    sconn.close(net.now)  # the server's side learnt nothing: its close goes unanswered
    net.run(30)
    check_readable_after_end(sconn, DisconnectReason.CLOSED)
    held = [conn, sconn, attempt]
    del conn, sconn, attempt
    assert_freed(dropping(held, server, client, late), 3)


def test_a_protocol_error_frees_both_sides() -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    inject_frames(net, server, frames.message_frame(3, 0, 5, b"x", deps=(9,)))
    net.run(30)
    check_readable_after_end(sconn, DisconnectReason.PROTOCOL_ERROR)
    assert conn.state is State.CLOSED
    held = [conn, sconn]
    del conn, sconn
    assert_freed(dropping(held, server, client), 2)


def test_a_connection_closed_while_connecting_is_freed() -> None:
    net = Network()
    server = net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    conn.close(net.now, 7, "changed my mind")
    net.run(5)
    check_readable_after_end(conn, DisconnectReason.CLOSED)
    assert conn.close_reason == Disconnected(DisconnectReason.CLOSED, 7, "changed my mind")
    held = [conn]
    del conn
    assert_freed(dropping(held, client, server), 1)


def garbage_holding(*conns: Connection) -> int:
    """How many objects of the cyclic garbage point at ``conns``: such garbage keeps
    them alive until the collector runs, however they end."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        ids = {id(c) for c in conns}
        return sum(any(id(r) in ids for r in gc.get_referents(o)) for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def test_graph_messages_leave_no_cycle_through_the_connection() -> None:
    # A graph message's node, its fragments and its dependents point at each other,
    # and become garbage once acknowledged: none of them may point at the connection.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    gc.collect()
    first = conn.send(b"a", delivery=Delivery.DEPENDENCY_ORDERED)
    conn.send(b"b", depends_on=[first])
    conn.send(b"x" * 5000, delivery=Delivery.DEPENDENCY_ORDERED)  # fragmented
    del first
    net.run(2)
    assert garbage_holding(conn, sconn) == 0
    conn.close(net.now)
    net.run(5)
    check_readable_after_end(conn, DisconnectReason.CLOSED)
    held = [conn, sconn]
    del conn, sconn
    assert_freed(dropping(held, server, client), 2)
