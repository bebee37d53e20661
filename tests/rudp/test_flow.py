"""Flow control: a receiver that is not keeping up pauses its peer (PAUSE / RESUME).

The sans-IO core on the stepped fake clock first, then the asyncio layer, whose
receive queue decides when to pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

import rudp
from rudp import frames, wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import SendQueueFull
from rudp.events import Disconnected, DisconnectReason
from rudp.wire import DropReason
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Address,
    Link,
    Network,
    Node,
    frames_of,
    pair,
    server_conn,
)


def _flow_frames(data: bytes) -> int:
    if wire.decode_type(data) is not wire.PacketType.DATA:
        return frames.NO_FLOW
    return frames_of(data).flow


def test_flow_frames_round_trip() -> None:
    body = wire.ack_fields(3, 0) + frames.PAUSE_FRAME + frames.PING_FRAME
    assert frames.decode_frames(body).flow == 1
    body = wire.ack_fields(3, 0) + frames.PAUSE_FRAME + frames.RESUME_FRAME
    assert frames.decode_frames(body).flow == 0  # the last one counts
    assert frames.decode_frames(wire.ack_fields(3, 0)).flow == frames.NO_FLOW


def test_a_paused_receiver_stops_new_messages_and_resuming_delivers_the_rest() -> None:
    net, server, client, conn = pair(Link(delay=0.01), config=Config(window=16))
    sconn = server_conn(server)
    payloads = [i.to_bytes(4, "big") + bytes(60) for i in range(3000)]
    for p in payloads:
        conn.send(p)
    net.run_until(lambda: len(server.received()) >= 200)
    sconn.pause_receiving()
    assert sconn.receiving_paused and sconn.stats.receive_pauses == 1
    net.run_until(lambda: conn.peer_paused)
    at_pause = len(server.received())
    net.run(5.0)  # far longer than any resend timeout: nothing new may come
    held = len(server.received())
    # What was in flight when the PAUSE arrived still lands; nothing sent after it.
    assert held < len(payloads)
    assert held - at_pause <= conn.config.window * 20
    net.run(5.0)
    assert len(server.received()) == held
    assert conn.stats.peer_pauses == 1 and conn.queued == len(payloads) - held
    assert server.endpoint.stats.dropped[DropReason.RECV_QUEUE_FULL] == 0  # an honest peer
    assert conn.state is State.CONNECTED and sconn.state is State.CONNECTED  # kept alive

    sconn.resume_receiving(net.now)
    net.run_until(lambda: conn.queued == 0)
    assert not conn.peer_paused
    assert server.received() == payloads  # exactly once, in order


def test_the_send_queue_fills_while_the_peer_is_paused() -> None:
    cfg = Config(send_queue_limit=500)
    net, server, client, conn = pair(config=cfg)
    server_conn(server).pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    for i in range(500):
        conn.send(i.to_bytes(2, "big"))
    net.run(3.0)
    assert server.received() == []
    with pytest.raises(SendQueueFull):
        conn.send(b"one too many")
    server_conn(server).resume_receiving(net.now)
    net.run_until(lambda: conn.queued == 0)
    assert server.received() == [i.to_bytes(2, "big") for i in range(500)]


def test_unreliable_messages_still_reach_a_paused_peer() -> None:
    # They expire rather than wait: held back, they would only go out stale, and keep a
    # close from ever sending its DISCONNECT.
    net, server, client, conn, _ = _paused_server()
    conn.send(b"u", reliable=False, now=net.now)
    conn.send(b"r")
    net.run(0.1)
    assert server.received() == [b"u"]
    server_conn(server).resume_receiving(net.now)
    net.run(0.1)
    assert server.received() == [b"u", b"r"]


def test_close_with_only_unreliable_messages_queued_toward_a_paused_peer_is_graceful() -> None:
    net, server, client, conn, sconn = _paused_server()
    conn.send(b"last words", reliable=False, now=net.now)
    conn.close(net.now, 4000, "bye")
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED, timeout=1)
    assert server.received() == [b"last words"]
    assert server.disconnects() == [Disconnected(DisconnectReason.CLOSED, 4000, "bye", True)]


@pytest.mark.parametrize("which", [1, 0])
def test_a_lost_pause_or_resume_is_sent_again(which: int) -> None:
    net, server, client, conn = pair()
    sconn = server_conn(server)
    dropped: list[bytes] = []
    real = net._transmit

    def lose_first_flow_frame(data: bytes, src: Address, dst: Address) -> None:
        if src == SERVER and not dropped and _flow_frames(data) == which:
            dropped.append(data)
            return
        real(data, src, dst)

    net._transmit = lose_first_flow_frame  # type: ignore[method-assign]
    sconn.pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    sconn.resume_receiving(net.now)
    net.run_until(lambda: not conn.peer_paused)
    assert dropped, "the frame was never sent"
    conn.send(b"after")
    net.run_until(lambda: conn.queued == 0)
    assert server.received() == [b"after"]


def test_a_late_pause_never_undoes_a_newer_resume() -> None:
    net, server, client, conn = pair(Link(delay=0.01))
    sconn = server_conn(server)
    held: list[tuple[bytes, Address, Address]] = []
    real = net._transmit

    def delay_pause(data: bytes, src: Address, dst: Address) -> None:
        if src == SERVER and _flow_frames(data) == 1 and not held:
            held.append((data, src, dst))
            return
        real(data, src, dst)

    net._transmit = delay_pause  # type: ignore[method-assign]
    sconn.pause_receiving()
    net.flush()
    sconn.resume_receiving(net.now)
    net.run(0.05)  # RESUME arrives (the peer was never paused)
    assert held and not conn.peer_paused
    net._transmit = real  # type: ignore[method-assign]
    net.inject(*held[0])  # the old PAUSE, long after
    net.run(0.05)
    assert not conn.peer_paused
    conn.send(b"still flowing")
    net.run_until(lambda: conn.queued == 0)
    assert server.received() == [b"still flowing"]


def test_a_peer_that_ignores_pause_is_refused_past_the_budget() -> None:
    cfg = Config(recv_buffer_bytes=20_000)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    sconn.pause_receiving()
    # The client never hears of it: every PAUSE from the server is lost.
    real = net._transmit

    def lose_flow(data: bytes, src: Address, dst: Address) -> None:
        if src == SERVER and _flow_frames(data) != frames.NO_FLOW:
            return
        real(data, src, dst)

    net._transmit = lose_flow  # type: ignore[method-assign]
    payloads = [i.to_bytes(4, "big") + bytes(500) for i in range(400)]  # 200 kB
    for p in payloads:
        conn.send(p)
    net.run(3.0)
    got = len(server.received())
    assert 0 < got < len(payloads)
    accepted = sconn.stats.bytes_received
    assert got * 500 <= 20_000 + 2_000  # bounded by the budget (plus the first packet)
    assert server.endpoint.stats.dropped[DropReason.RECV_QUEUE_FULL] > 0
    assert not conn.peer_paused
    net._transmit = real  # type: ignore[method-assign]
    assert sconn.stats.bytes_received == accepted
    sconn.resume_receiving(net.now)
    net.run_until(lambda: conn.queued == 0, timeout=120)
    assert server.received() == payloads  # the refused packets were resent


def test_a_resume_travelling_with_refused_messages_still_arrives() -> None:
    # Both sides paused; the client's PAUSE was lost, so the server overran the
    # client's budget and the client refuses its packets. The server's RESUME goes out
    # with resends the client refuses: it must still be heard, or the client would hold
    # its messages for good (and, waiting in drain(), perhaps never read again).
    cfg = Config(recv_buffer_bytes=20_000)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    real = net._transmit
    drop_client_pause = False

    def tap(data: bytes, src: Address, dst: Address) -> None:
        if drop_client_pause and src == CLIENT and _flow_frames(data) == 1:
            return
        real(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]
    sconn.pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    for i in range(100):
        conn.send(b"c%d" % i)
    drop_client_pause = True
    conn.pause_receiving()
    for i in range(400):
        sconn.send(i.to_bytes(4, "big") + bytes(500))
    net.run(0.3)
    drop_client_pause = False
    net.run_until(lambda: sconn.peer_paused)
    assert client.endpoint.stats.dropped[DropReason.RECV_QUEUE_FULL] > 0
    # The server's application reads again in the loop turn where a resend fires, so
    # its RESUME shares a packet with resends the client refuses. (Stepped by hand: the
    # compiled core's methods cannot be patched.)
    for _ in range(100):
        due = server.endpoint.get_timer()
        assert due is not None
        net.run(max(0.0, due - net.now - 1e-6))  # everything up to the server's timer
        due = server.endpoint.get_timer()
        assert due is not None
        if due > net.now + 1e-5:
            continue  # it moved (an ack arrived): try again
        net.now = max(net.now, due)
        server.endpoint.handle_timer(net.now)
        if sconn._sender.retx:
            sconn.resume_receiving(net.now)
            net.flush()
            break
        net.flush()
    assert not sconn.receiving_paused, "no resend timer fired"
    net.run_until(lambda: not conn.peer_paused, timeout=10)
    net.run_until(lambda: conn.queued == 0, timeout=10)
    assert server.received() == [b"c%d" % i for i in range(100)]
    conn.resume_receiving(net.now)
    net.run_until(lambda: sconn.queued == 0, timeout=60)
    assert client.received() == [i.to_bytes(4, "big") + bytes(500) for i in range(400)]


def test_a_dependency_refused_while_paused_does_not_time_out() -> None:
    # B depends on A; A's first copy is lost and its resends are refused once the
    # paused server's budget is spent. That is our own doing, not a missing dependency:
    # no protocol error, and A then B after the resume.
    cfg = Config(recv_buffer_bytes=20_000, redundancy=0, dependency_timeout=5.0)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    real = net._transmit
    drop_pause = True

    def tap(data: bytes, src: Address, dst: Address) -> None:
        if wire.decode_type(data) is wire.PacketType.DATA:
            frames = frames_of(data)
            if drop_pause and src == SERVER and frames.flow == 1:
                return
            if (
                src == CLIENT
                and any(m[3] == b"A" for m in frames.messages)
                and sconn._reader.pause_budget > 1300
            ):
                return
        real(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]
    sconn.pause_receiving()
    a = conn.send(b"A", delivery=wire.Delivery.RELIABLE_UNORDERED, now=net.now)
    net.flush()
    conn.send(b"B", depends_on=[a], now=net.now)
    filler = [i.to_bytes(4, "big") + bytes(500) for i in range(100)]
    for p in filler:
        conn.send(p)
    net.run(0.5)
    drop_pause = False
    net.run(12.0)  # well past dependency_timeout
    assert server.endpoint.stats.dropped[DropReason.RECV_QUEUE_FULL] > 0
    assert sconn.state is State.CONNECTED and b"B" not in server.received()
    sconn.resume_receiving(net.now)
    net.run_until(lambda: conn.queued == 0, timeout=30)
    got = server.received()
    assert got.index(b"A") < got.index(b"B")
    assert sorted(got) == sorted([b"A", b"B", *filler])
    assert server.disconnects() == [] and client.disconnects() == []


def test_dependency_timeout_counts_from_the_resume_not_from_the_last_datagram() -> None:
    # B waits for A, which never arrives; the server paused, then heard nothing for
    # 4 s (no datagram, no timer of its own) before resuming. The wait starts again at
    # the resume: an older clock would end the connection 4 s early.
    cfg = Config(redundancy=0, dependency_timeout=5.0, keepalive_interval=20.0, idle_timeout=60.0)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    silent = False

    def drop(data: bytes, src: Address, dst: Address) -> bool:
        if src != CLIENT:
            return False
        if silent:
            return True
        return wire.decode_type(data) is wire.PacketType.DATA and any(
            m[3] == b"A" for m in frames_of(data).messages
        )

    net.drop = drop
    sconn.pause_receiving()
    a = conn.send(b"A", delivery=wire.Delivery.RELIABLE_UNORDERED, now=net.now)
    net.flush()
    conn.send(b"B", depends_on=[a], now=net.now)
    net.run(0.5)
    assert sconn._receiver.graph.nodes and conn.peer_paused
    silent = True
    net.run(4.0)
    sconn.resume_receiving(net.now)
    silent = False
    net.run(4.9)
    assert sconn.state is State.CONNECTED and server.disconnects() == []
    net.run(0.2)
    assert [d.reason for d in server.disconnects()] == [DisconnectReason.PROTOCOL_ERROR]


def _paused_server(
    cfg: Config | None = None,
) -> tuple[Network, Node, Node, Connection, Connection]:
    """A connected pair whose server has paused the client (and the client knows)."""
    net, server, client, conn = pair(config=cfg)
    sconn = server_conn(server)
    sconn.pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    return net, server, client, conn, sconn


def test_close_with_the_peer_paused_ends_after_the_close_timeout() -> None:
    net, server, client, conn, _ = _paused_server(Config(close_timeout=2.0))
    handle = conn.send(b"never read")
    start = net.now
    conn.close(net.now, 4000, "bye")
    net.run_until(lambda: conn.state is State.CLOSED, timeout=10)
    assert 2.0 <= net.now - start <= 2.5
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED, 4000, "bye")]
    assert not handle.acked
    assert server.received() == []


def test_a_pause_that_holds_messages_back_too_long_ends_the_connection() -> None:
    net, server, client, conn, _ = _paused_server(Config(peer_pause_timeout=30.0))
    net.run(100.0)  # a pause that holds nothing back is not timed
    assert conn.state is State.CONNECTED
    handle = conn.send(b"held")
    start = net.now
    net.run_until(lambda: conn.state is State.CLOSED, timeout=60)
    assert 30.0 <= net.now - start <= 30.5
    assert client.disconnects() == [Disconnected(DisconnectReason.PEER_PAUSED)]
    assert not handle.acked and server.received() == []
    # The paused server learns as after any local end of a client: by its idle
    # timeout (only a server states a reset token that would make a NOCONN proof).
    ended = net.now
    net.run_until(lambda: bool(server.disconnects()), timeout=30)
    assert server.disconnects() == [Disconnected(DisconnectReason.TIMEOUT)]
    assert net.now - ended <= conn.config.idle_timeout + 0.5


def test_a_resume_before_the_pause_timeout_keeps_the_connection() -> None:
    net, server, client, conn, sconn = _paused_server(Config(peer_pause_timeout=30.0))
    conn.send(b"first")
    net.run(29.0)
    sconn.resume_receiving(net.now)
    net.run_until(lambda: server.received() == [b"first"])
    sconn.pause_receiving()
    net.run_until(lambda: conn.peer_paused)
    conn.send(b"second")  # the count starts again from this wait
    net.run(29.0)
    assert conn.state is State.CONNECTED
    net.run_until(lambda: conn.state is State.CLOSED, timeout=5)
    assert client.disconnects() == [Disconnected(DisconnectReason.PEER_PAUSED)]


def test_a_full_send_queue_names_the_peers_pause() -> None:
    net, server, client, conn, _ = _paused_server(Config(send_queue_limit=10))
    for i in range(10):
        conn.send(b"%d" % i)
    with pytest.raises(SendQueueFull, match="the peer paused receiving"):
        conn.send(b"one too many")
    with pytest.raises(SendQueueFull, match="the peer paused receiving"):
        conn.send(bytes(5000))  # fragmented: its own check


def test_peer_pause_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="peer_pause_timeout"):
        Config(peer_pause_timeout=0)


def test_a_resume_during_close_lets_the_close_finish_gracefully() -> None:
    net, server, client, conn, sconn = _paused_server(Config(close_timeout=2.0))
    conn.send(b"late but delivered")
    conn.close(net.now)
    net.run(1.5)
    sconn.resume_receiving(net.now)
    net.run_until(lambda: conn.state is State.CLOSED and sconn.state is State.CLOSED)
    assert server.received() == [b"late but delivered"]
    assert server.disconnects() == [Disconnected(DisconnectReason.CLOSED, by_peer=True)]


def test_flow_state_survives_loss_duplication_and_reordering() -> None:
    link = Link(loss=0.2, duplicate=0.05, reorder=0.1)
    net, server, client, conn = pair(link, seed=7, config=Config(window=8))
    sconn = server_conn(server)
    payloads = [i.to_bytes(4, "big") + bytes(100) for i in range(2000)]
    for p in payloads:
        conn.send(p)
    for _ in range(6):
        sconn.pause_receiving()
        net.run(1.0)
        sconn.resume_receiving(net.now)
        net.run(0.3)
    net.run_until(lambda: conn.queued == 0 and not conn.peer_paused, timeout=30)
    assert server.received() == payloads
    assert sconn.stats.receive_pauses == 6 and conn.stats.peer_pauses >= 3


# -- the asyncio layer ------------------------------------------------------------------

QUIET = rudp.Config(keepalive_interval=5.0, idle_timeout=30.0)


async def test_a_slow_reader_pauses_its_peer_and_its_queue_stays_bounded() -> None:
    limit = 64 * 1024
    cfg = dataclasses.replace(QUIET, recv_queue_bytes=limit, recv_buffer_bytes=limit)
    conns: list[rudp.Connection] = []
    got: list[bytes] = []
    reading = asyncio.Event()
    payloads = [i.to_bytes(4, "big") + bytes(196) for i in range(3000)]

    async def handler(conn: rudp.Connection) -> None:
        conns.append(conn)
        await reading.wait()
        got.extend([msg.data async for msg in conn])

    async with await rudp.serve(handler, "127.0.0.1", 0, config=cfg) as server:
        conn = await rudp.connect(*server.address, config=cfg)
        for p in payloads:
            conn.send(p)
        async with asyncio.timeout(10):
            while not conn.stats.peer_pauses:
                await asyncio.sleep(0.001)
        (sconn,) = conns
        for _ in range(50):  # every chance to overrun the reader: it must not
            await asyncio.sleep(0.002)
        # The limit, what was in flight when it was crossed, and the budget for
        # what was on its way after the PAUSE: each at most ``limit``.
        assert limit <= sconn._inbox_bytes <= 3 * limit + 1300
        assert sconn._core.receiving_paused and conn._core.peer_paused
        assert conn.peer_paused and not sconn.peer_paused
        assert conn.queued > 0  # held at the sender, not piled up at the receiver
        reading.set()
        await asyncio.wait_for(conn.drain(), 10)
        await asyncio.wait_for(conn.close(), 10)
        await asyncio.wait_for(sconn.wait_closed(), 10)
    assert got == payloads
    assert sconn.stats.receive_pauses >= 1


async def test_the_receive_queue_resumes_at_half_and_a_receiver_empties_it() -> None:
    cfg = dataclasses.replace(QUIET, recv_queue_bytes=10 * (100 + 64))
    got: list[bytes] = []
    conns: list[rudp.Connection] = []
    arrived = asyncio.Event()

    async def handler(conn: rudp.Connection) -> None:
        conns.append(conn)
        arrived.set()
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0, config=cfg) as server:
        conn = await rudp.connect(*server.address, config=cfg)
        await arrived.wait()
        (sconn,) = conns
        for i in range(10):
            conn.send(bytes([i]) * 100)
        await asyncio.wait_for(conn.drain(), 5)
        while not conn._core.peer_paused:
            await asyncio.sleep(0.001)
        assert sconn._core.receiving_paused
        for _ in range(4):
            assert sconn.recv_nowait() is not None
        assert sconn._core.receiving_paused  # 6 left: above half
        assert sconn.recv_nowait() is not None
        assert not sconn._core.receiving_paused  # 5 left: half
        sconn.set_receiver(lambda m: got.append(m.data))
        assert sconn._inbox_bytes == 0 and len(got) == 5
        while conn._core.peer_paused:
            await asyncio.sleep(0.001)
        conn.send(b"after")
        await asyncio.wait_for(conn.drain(), 5)
        await asyncio.wait_for(conn.close(), 5)
        assert got == [bytes([i]) * 100 for i in range(5, 10)] + [b"after"]


def test_config_checks_recv_queue_bytes() -> None:
    with pytest.raises(ValueError, match="recv_queue_bytes"):
        Config(recv_queue_bytes=0)


def test_a_message_refused_for_room_sets_how_low_a_drain_waits() -> None:
    net, _, _, conn = pair(config=Config(send_queue_limit=64))  # drain threshold 16
    for _ in range(40):
        conn.send(b"x")
    big = bytes(59 * conn.config.fragment_payload - 100)  # 59 fragments
    assert conn.drain_level(16) == 16
    with pytest.raises(SendQueueFull):
        conn.send(big)
    assert conn.drain_level(16) == 64 - 59  # room for it, not the threshold
    net.run_until(lambda: conn.queued <= conn.drain_level(16))
    conn.send(big)
    assert conn.drain_level(16) == 16


ROOMY = Config(send_queue_limit=64)  # drain threshold 16
BIG = bytes(59 * ROOMY.fragment_payload - 100)  # 59 fragments of the 64 places


@contextlib.asynccontextmanager
async def forty_queued() -> AsyncIterator[rudp.Connection]:
    """A connection of `ROOMY`'s queue, 40 small reliable messages in it."""

    async def hold(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(hold, "127.0.0.1", 0) as server:
        conn = await asyncio.wait_for(rudp.connect(*server.address, config=ROOMY), 5)
        for _ in range(40):
            conn.send(b"x")
        yield conn
        await asyncio.wait_for(conn.close(), 5)


async def test_the_drain_and_retry_loop_sends_a_message_of_many_fragments() -> None:
    # drain() returned once the queue was at the threshold (16), but the message needed
    # 59 of the 64 places: refused again, drain() returned at once, and the loop spun
    # without ever letting the acknowledgments in.
    async with forty_queued() as conn:
        big = BIG
        for _attempt in range(50):  # bounded: the spin this was never ended
            try:
                handle = conn.send(big)
                break
            except SendQueueFull:
                await asyncio.wait_for(conn.drain(), 5)
        else:
            pytest.fail("the message never went in: drain() did not wait for room")
        await asyncio.wait_for(handle, 10)


async def test_a_drain_waits_for_a_refused_messages_room_once() -> None:
    # Left set after the message was given up (or a smaller send went in), the lower
    # level made every later drain() wait for a queue that other traffic kept above
    # it: for good.
    async with forty_queued() as conn:
        core = conn._core
        with pytest.raises(SendQueueFull):
            conn.send(BIG)
        assert core.drain_level(16) == 64 - 59
        conn.send(b"a smaller one instead")  # any later send sets the level back
        assert core.drain_level(16) == 16
        with pytest.raises(SendQueueFull):
            conn.send(BIG)
        await asyncio.wait_for(conn.drain(), 5)  # waits for room for it, once
        assert core.queued <= 64 - 59 and core.drain_level(16) == 16
