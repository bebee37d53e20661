"""The asyncio API over real sockets on loopback (IPv4 and IPv6, default loop and uvloop)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

import rudp
from rudp import wire
from rudp.wire import DropReason

Handler = Callable[[rudp.Connection], Awaitable[None]]


async def echo(conn: rudp.Connection) -> None:
    async for msg in conn:
        conn.send(msg.data, reliable=msg.reliable, channel=msg.channel)


@pytest.fixture
async def server() -> AsyncIterator[rudp.Server]:
    async with await rudp.serve(echo, "127.0.0.1", 0) as srv:
        yield srv


async def test_echo_round_trip_and_acknowledgement(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    handle = conn.send(b"hello", channel=3)
    await asyncio.wait_for(handle, 5)
    assert handle.acked
    msg = await asyncio.wait_for(conn.recv(), 5)
    assert (msg.data, msg.channel, msg.reliable) == (b"hello", 3, True)
    assert conn.stats.srtt > 0
    assert conn.remote_address[:2] == server.address
    await conn.close()


async def test_many_messages_arrive_in_order_with_back_pressure(server: rudp.Server) -> None:
    config = rudp.Config(send_queue_limit=512, drain_low_water=128)
    conn = await rudp.connect(*server.address, config=config)
    payloads = [random.Random(i).randbytes(i % 1000) for i in range(5000)]
    received: list[bytes] = []

    async def reader() -> None:
        while len(received) < len(payloads):
            received.append((await conn.recv()).data)

    task = asyncio.create_task(reader())
    for data in payloads:
        if conn.queued >= 512:
            await conn.drain()
        conn.send(data)
    await asyncio.wait_for(task, 30)
    assert received == payloads
    await conn.close()


async def test_full_queue_raises_instead_of_dropping(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address, config=rudp.Config(send_queue_limit=8))
    for _ in range(8):
        conn.send(b"x")
    with pytest.raises(rudp.SendQueueFull):
        conn.send(b"x")
    await asyncio.wait_for(conn.drain(), 5)
    await conn.close()


async def test_graceful_close_reaches_both_sides_with_the_same_reason() -> None:
    seen: asyncio.Future[rudp.ConnectionClosed] = asyncio.get_running_loop().create_future()

    async def handler(conn: rudp.Connection) -> None:
        try:
            while True:
                await conn.recv()
        except rudp.ConnectionClosed as exc:
            seen.set_result(exc)

    async with await rudp.serve(handler, "127.0.0.1", 0) as srv:
        conn = await rudp.connect(*srv.address)
        for i in range(200):
            conn.send(b"%d" % i)
        await conn.close(4000, "match over")
        exc = await asyncio.wait_for(seen, 5)
        assert (exc.reason, exc.code, exc.text) == ("closed", 4000, "match over")
        reason = conn.close_reason
        assert reason is not None and (reason.code, reason.text) == (4000, "match over")
        with pytest.raises(rudp.ConnectionClosed):
            conn.send(b"late")
        with pytest.raises(rudp.ConnectionClosed):
            await conn.recv()


async def test_async_iteration_ends_when_the_server_closes() -> None:
    async def greet_then_leave(conn: rudp.Connection) -> None:
        await conn.send(b"hi")

    async with await rudp.serve(greet_then_leave, "127.0.0.1", 0) as srv:
        conn = await rudp.connect(*srv.address)
        got = [msg.data async for msg in conn]
        assert got == [b"hi"]
        closed = await conn.wait_closed()
        assert closed.reason is rudp.DisconnectReason.CLOSED and closed.by_peer


async def test_awaiting_a_send_fails_when_the_connection_ends(server: rudp.Server) -> None:
    config = rudp.Config(idle_timeout=1.0, keepalive_interval=0.2)
    conn = await rudp.connect(*server.address, config=config)
    server.endpoint.close_now()  # the server vanishes without a word
    handle = conn.send(b"lost")
    with pytest.raises(rudp.ConnectionClosed) as info:
        await asyncio.wait_for(handle, 5)
    assert info.value.reason == "timeout"
    assert not handle.acked


async def test_refused_when_full_and_timeout_when_nobody_answers() -> None:
    async with await rudp.serve(echo, "127.0.0.1", 0, config=rudp.Config(max_connections=1)) as srv:
        first = await rudp.connect(*srv.address)
        with pytest.raises(rudp.ConnectRefused, match="server full"):
            await rudp.connect(*srv.address)
        await first.close()
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        config = rudp.Config(connect_timeout=0.5, connect_retry_interval=0.1)
        with pytest.raises(rudp.ConnectTimeout):
            await rudp.connect(*silent.getsockname(), config=config)
    finally:
        silent.close()


async def test_server_restart_is_noticed_within_a_round_trip() -> None:
    srv = await rudp.serve(echo, "127.0.0.1", 0)
    host, port = srv.address
    conn = await rudp.connect(host, port)
    srv.endpoint.close_now()  # crash: no DISCONNECT is sent
    restarted = await rudp.serve(echo, host, port)
    conn.send(b"anyone?")
    closed = await asyncio.wait_for(conn.wait_closed(), 5)
    assert closed.reason is rudp.DisconnectReason.NO_CONNECTION
    again = await rudp.connect(host, port)
    await again.send(b"back")
    await again.close()
    await restarted.close()


async def test_ipv6() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        srv = await rudp.serve(echo, "::1", 0)
    except OSError as exc:
        pytest.skip(f"cannot bind ::1: {exc}")
    async with srv:
        conn = await rudp.connect("::1", srv.address[1])
        conn.send(b"six")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"six"
        await conn.close()


async def test_one_socket_serves_many_connections(server: rudp.Server) -> None:
    conns = await asyncio.gather(*(rudp.connect(*server.address) for _ in range(20)))
    for i, conn in enumerate(conns):
        conn.send(b"c%d" % i)
    replies = await asyncio.gather(*(asyncio.wait_for(c.recv(), 5) for c in conns))
    assert [r.data for r in replies] == [b"c%d" % i for i in range(20)]
    assert len(server.connections) == 20
    await asyncio.gather(*(c.close() for c in conns))


async def test_unconnected_query_never_amplifies(server: rudp.Server) -> None:
    server.on_query = lambda payload, addr: b"info:" + payload
    client = await rudp.open_endpoint("127.0.0.1", 0)
    reply, rtt = await client.query(server.address, b"who", timeout=5)
    assert reply == b"info:who" and rtt >= 0
    server.on_query = lambda payload, addr: b"x" * 2000  # larger than any request
    with pytest.raises(TimeoutError):
        await client.query(server.address, b"big?", timeout=0.3)
    assert server.endpoint.queries_unanswered == 1
    stats = server.stats
    assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received
    await client.close()


async def test_garbage_flood_while_a_connection_keeps_working(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    rng = random.Random(7)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.setblocking(False)
    sent_bytes = 0
    captured = wire.encode_connect(1, 2, b"", 1200)
    try:
        for round_ in range(40):
            for _ in range(50):
                kind = rng.random()
                if kind < 0.4:
                    data = rng.randbytes(rng.randint(0, 1400))
                elif kind < 0.7:  # valid CRC, random body
                    data = wire.seal_rest(bytes([1, rng.randint(1, 8)]) + rng.randbytes(40))
                else:  # CONNECT flood: stateless challenges only
                    data = captured
                sent_bytes += len(data)
                try:
                    attacker.sendto(data, server.address)
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            conn.send(b"%d" % round_)
            assert (await asyncio.wait_for(conn.recv(), 5)).data == b"%d" % round_
    finally:
        attacker.close()
    stats = server.stats
    assert stats.datagrams_dropped > 0
    assert stats.dropped[DropReason.BAD_CHECKSUM] > 0
    assert len(server.connections) == 1
    # Bytes sent to addresses that never completed a handshake stay below what they sent us.
    assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received
    await conn.close()


async def test_handler_exception_closes_only_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def faulty(conn: rudp.Connection) -> None:
        msg = await conn.recv()
        if msg.data == b"boom":
            raise RuntimeError("handler bug")
        conn.send(msg.data)
        await conn.recv()

    async with await rudp.serve(faulty, "127.0.0.1", 0) as srv:
        bad = await rudp.connect(*srv.address)
        good = await rudp.connect(*srv.address)
        bad.send(b"boom")
        closed = await asyncio.wait_for(bad.wait_closed(), 5)
        assert closed.by_peer
        good.send(b"fine")
        assert (await asyncio.wait_for(good.recv(), 5)).data == b"fine"
        await good.close()


def test_run_uses_uvloop_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    async def loop_name() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert rudp.run(loop_name()).startswith("uvloop")
    assert not rudp.run(loop_name(), use_uvloop=False).startswith("uvloop")
    monkeypatch.setenv("RUDP_NO_UVLOOP", "1")
    assert not rudp.run(loop_name()).startswith("uvloop")
    assert os.environ["RUDP_NO_UVLOOP"] == "1"


async def test_recv_works_again_after_a_cancelled_recv() -> None:
    async def late(conn: rudp.Connection) -> None:
        await asyncio.sleep(0.3)
        await conn.send(b"late")
        await conn.recv()

    async with await rudp.serve(late, "127.0.0.1", 0) as srv:
        conn = await rudp.connect(*srv.address)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(conn.recv(), 0.05)
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"late"
        await conn.close()


async def test_delivery_modes_dependencies_and_large_messages_over_sockets(
    server: rudp.Server,
) -> None:
    """The asyncio API passes ``delivery`` and ``depends_on`` (handles) through; a 1 MiB
    message is fragmented and echoed back whole; awaiting a superseded message returns."""
    conn = await rudp.connect(*server.address)
    Delivery = rudp.Delivery
    spawn = conn.send(b"spawn", delivery=Delivery.RELIABLE_UNORDERED, channel=2)
    kill = conn.send(b"kill", depends_on=[spawn], channel=2)
    old = conn.send(b"v1", delivery=Delivery.RELIABLE_SEQUENCED, channel=5)
    new = conn.send(b"v2", delivery=Delivery.RELIABLE_SEQUENCED, channel=5)
    conn.send(b"pos", delivery=Delivery.UNRELIABLE_SEQUENCED, channel=6)
    big = random.Random(1).randbytes(1 << 20)
    conn.send(big)
    await asyncio.wait_for(asyncio.gather(spawn, kill, old, new), 5)
    assert old.superseded and not old.acked and new.acked and old.done()
    got: list[bytes] = []
    while not {b"spawn", b"kill", b"v2", big} <= set(got):  # "pos" may be lost: unreliable
        got.append((await asyncio.wait_for(conn.recv(), 10)).data)
    assert got.index(b"spawn") < got.index(b"kill")
    assert b"v1" not in got and b"v2" in got and big in got
    with pytest.raises(rudp.LocalProtocolError):
        conn.send(b"x", depends_on=kill)  # type: ignore[arg-type]
    with pytest.raises(rudp.MessageTooLarge):
        conn.send(bytes(conn.max_datagram_payload + 1), reliable=False)
    await conn.close()


def test_the_send_handle_is_the_core_message_and_only_asyncio_makes_it_awaitable() -> None:
    from rudp.config import Config
    from rudp.endpoint import Endpoint
    from rudp.recovery import OutMessage

    assert rudp.SendHandle is OutMessage
    core = Endpoint(Config(), now=0.0, rng=random.Random(3))
    conn = core.connect(("127.0.0.1", 9), 0.0)
    reliable = conn.send(b"x")
    unreliable = conn.send(b"y", reliable=False)
    assert not reliable.done() and not unreliable.done()
    core.datagrams_to_send(0.0)
    # Not connected yet: both still queued. A sans-IO handle has no event loop to wait on.
    with pytest.raises(TypeError, match="asyncio"):
        reliable.__await__()


async def test_awaiting_handles_of_every_outcome(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    acked = conn.send(b"a")
    sent = conn.send(b"b", reliable=False)
    await asyncio.wait_for(acked, 5)
    await asyncio.wait_for(sent, 5)  # unreliable: returns once sent
    assert acked.acked and acked.done() and sent.done() and not sent.acked
    pending = conn.send(b"c" * 100)
    await asyncio.wait_for(conn.close(), 5)
    await asyncio.wait_for(pending, 5)  # delivered before the graceful close completed
    assert pending.acked
    with pytest.raises(rudp.ConnectionClosed):
        conn.send(b"d")
