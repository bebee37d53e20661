"""The sans-IO core's graceful close, on a stepped fake clock and an in-memory lossy network."""

from __future__ import annotations

import gc

import pytest

from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import ConnectionClosed
from rudp.events import Disconnected, DisconnectReason
from tests.rudp.harness import CLIENT, SERVER, Link, Network, Node, frames_of, pair, server_conn

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
        if src == CLIENT and frames_of(data).disconnect and drops[0] < 3:
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


def _short_connection(net: Network, server: Node, first: Connection, i: int) -> None:
    """One client connects to ``server``, then closes; its node goes."""
    config = server.endpoint.config
    address = ("10.0.71.1", 6000 + i)
    conn = net.add(address, config).endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    (sconn,) = [c for c in server.endpoint.connections if c is not first]
    conn.close(net.now)
    net.run_until(lambda: sconn.state is State.CLOSED)
    net.remove(address)


def test_ended_connections_leave_the_timers_at_once() -> None:
    # A server of short connections (one registration each, say) beside a long one:
    # the timer entries of an ended connection (its keepalive, far ahead, behind the
    # long connection's) must not keep it in memory until they are due.
    gc.collect()  # what earlier tests left to the collector
    net = Network()
    config = Config(idle_timeout=86400.0, keepalive_interval=40000.0, max_datagram_size=1200)
    server = net.add(SERVER, config, accept=True)
    long = net.add(CLIENT, config).endpoint.connect(SERVER, net.now)
    net.run_until(lambda: long.state is State.CONNECTED)
    (first,) = server.endpoint.connections
    for i in range(300):
        _short_connection(net, server, first, i)
    deadline = first.get_timer()  # every keepalive entry is still ahead:
    assert deadline is not None and net.now < deadline < 42000.0
    assert len(server.endpoint._heap) > 1  # entries of ended connections among them
    server.events.clear()  # (events name their connections)
    # The server's ended connections are gone (reference counting: no cycle is left
    # to the collector either): the heap's entries name connections by id.
    ended = [o for o in gc.get_objects() if type(o) is Connection and o.address[0] == "10.0.71.1"]
    assert [c for c in ended if not c.client] == []


# -- a close text that cannot be sent ----------------------------------------------------------

# Compiled (mypyc), a text that is not a str is refused by the call itself, in mypyc's
# words ("str object expected; got int"): a TypeError at once all the same.
CLOSE_TEXT_REFUSED = r"close text|str object expected"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (5, TypeError),
        (b"bytes", TypeError),
        ("bad \udcff byte", ValueError),  # a lone surrogate, as os.fsdecode makes
    ],
)
@pytest.mark.parametrize("queued", [False, True])
def test_a_close_text_that_cannot_be_sent_is_refused_before_anything_changes(
    text: object, error: type[Exception], queued: bool
) -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    if queued:
        conn.send(b"queued")  # the DISCONNECT waits for its ack
    with pytest.raises(error, match=CLOSE_TEXT_REFUSED):
        conn.close(net.now, 4000, text)  # type: ignore[arg-type]
    assert conn.state is State.CONNECTED
    conn.send(b"still open")
    net.run(1.0)
    assert conn.state is State.CONNECTED and client.disconnects() == []
    # The same connection then closes as it would have.
    limit = "\u00e9" * 100  # exactly 200 bytes: taken whole
    conn.close(net.now, 4001, limit)
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED)
    assert server.received() == ([b"queued"] if queued else []) + [b"still open"]
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED, 4001, limit)]
    assert server.disconnects() == [
        Disconnected(DisconnectReason.CLOSED, 4001, limit, by_peer=True)
    ]


def test_a_long_close_text_is_clipped_on_a_character_boundary_not_refused() -> None:
    # An exception's message passed as the text must not make the close fail.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    text = "\u00e9" * 101  # 202 bytes in UTF-8
    conn.close(net.now, 4002, text)
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED)
    clipped = "\u00e9" * 100  # 200 bytes: the 101st character does not fit whole
    assert server.disconnects() == [
        Disconnected(DisconnectReason.CLOSED, 4002, clipped, by_peer=True)
    ]


def test_a_close_text_is_checked_while_connecting_too() -> None:
    net = Network()
    net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    with pytest.raises(TypeError, match=CLOSE_TEXT_REFUSED):
        conn.close(net.now, 0, 5)  # type: ignore[arg-type]
    assert conn.state is State.CONNECTING
    net.run_until(lambda: conn.state is State.CONNECTED)
