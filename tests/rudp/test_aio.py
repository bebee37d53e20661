"""The asyncio API over real sockets on loopback (IPv4 and IPv6, default loop and uvloop)."""

from __future__ import annotations

import array
import asyncio
import dataclasses
import os
import random
import socket
import zlib
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
        reason = conn.disconnected
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


async def test_connect_errors_name_the_server_and_the_timeout() -> None:
    async with await rudp.serve(echo, "127.0.0.1", 0, config=rudp.Config(max_connections=1)) as srv:
        first = await rudp.connect(*srv.address)
        with pytest.raises(rudp.ConnectRefused) as refused:
            await rudp.connect(*srv.address)
        assert refused.value.address == srv.address[:2]
        assert f"127.0.0.1:{srv.address[1]}" in str(refused.value)
        await first.close()
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        config = rudp.Config(connect_timeout=0.3, connect_retry_interval=0.1)
        with pytest.raises(rudp.ConnectTimeout) as timed_out:
            await rudp.connect(*silent.getsockname(), config=config)
        port = silent.getsockname()[1]
        assert timed_out.value.address == ("127.0.0.1", port)
        assert timed_out.value.timeout == 0.3
        assert f"127.0.0.1:{port} within 0.3 s" in str(timed_out.value)
    finally:
        silent.close()


async def test_server_restart_is_noticed_within_a_round_trip() -> None:
    # The restarted server has the same static key: its NOCONN reset tokens derive from it.
    keyed = rudp.Config(static_key=rudp.generate_key())
    srv = await rudp.serve(echo, "127.0.0.1", 0, config=keyed)
    host, port = srv.address
    conn = await rudp.connect(host, port)
    srv.endpoint.close_now()  # crash: no DISCONNECT is sent
    restarted = await rudp.serve(echo, host, port, config=keyed)
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


async def test_a_memoryview_query_reply_is_measured_in_bytes(server: rudp.Server) -> None:
    # len() of a memoryview counts its items: an array of doubles as long as a query
    # may carry went out 8 times that size to an address nobody validated, and a
    # view that is not contiguous raised out of the read callback.
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    limit = server.endpoint.core.max_query_payload
    client = await rudp.open_endpoint("127.0.0.1", 0)
    async with client:
        server.on_query = lambda payload, addr: memoryview(array.array("d", [0.0] * limit))
        with pytest.raises(TimeoutError):
            await client.query(server.address, b"q", timeout=0.3)
        assert server.endpoint.queries_unanswered == 1
        server.on_query = lambda payload, addr: memoryview(b"abcdef")[::2]
        reply, _ = await client.query(server.address, b"q", timeout=5)
        assert reply == b"ace"
        server.on_query = lambda payload, addr: memoryview(array.array("d", [1.0] * 4))
        reply, _ = await client.query(server.address, b"q", timeout=5)
        assert reply == array.array("d", [1.0] * 4).tobytes()
    stats = server.stats
    assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received
    assert errors == []


async def test_a_query_payload_and_a_foreign_datagram_are_measured_in_bytes(
    server: rudp.Server,
) -> None:
    # A memoryview query payload was measured in items: 200 doubles (1,600 bytes)
    # passed a 1,188-byte limit, went out in a datagram over max_datagram_size, and
    # its length field said 200; a str failed late, its query already pending.
    seen: list[bytes] = []
    server.on_query = lambda payload, address: seen.append(payload) or b"ok"
    client = await rudp.open_endpoint("127.0.0.1", 0)
    async with client:
        limit = client.endpoint.core.max_query_payload
        with pytest.raises(rudp.MessageTooLarge):
            await client.query(server.address, memoryview(array.array("d", [1.5] * 200)))
        two = array.array("d", [1.5, 2.5])
        reply, _ = await client.query(server.address, memoryview(two), timeout=5)
        assert reply == b"ok" and seen == [two.tobytes()] and limit < 1600
        pending = len(client.endpoint.core._queries)
        with pytest.raises(TypeError, match="query payload must be bytes-like"):
            await client.query(server.address, "text")  # type: ignore[arg-type]
        assert len(client.endpoint.core._queries) == pending
        # A foreign datagram's first byte is checked, not its first item.
        with pytest.raises(rudp.LocalProtocolError):
            client.send_datagram(memoryview(b"\xa1\x00\x00\x01").cast("I"), server.address)


async def test_garbage_flood_while_a_connection_keeps_working(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    rng = random.Random(7)
    attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    attacker.setblocking(False)
    sent_bytes = 0
    captured = wire.encode_connect(1, 0, b"", bytes(67), 1200)
    try:
        for round_ in range(40):
            for _ in range(50):
                kind = rng.random()
                if kind < 0.4:
                    data = rng.randbytes(rng.randint(0, 1400))
                elif kind < 0.7:  # valid CRC, random body
                    head = bytes([wire.MARKER | rng.randint(1, 8), 2]) + rng.randbytes(40)
                    data = head + wire.CRC.pack(zlib.crc32(head, wire.PROTOCOL_ID))
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


async def test_connections_have_fixed_attributes_and_room_for_application_data(
    server: rudp.Server,
) -> None:
    # The same in the pure and the compiled build (where Connection is a native class).
    conn = await rudp.connect(*server.address)
    assert conn.user_data is None
    conn.user_data = {"player": "alice"}
    with pytest.raises(AttributeError):
        conn.player = "alice"  # type: ignore[attr-defined]
    # Any bytes-like payload, in both builds (compiled, the argument types are checked).
    for data in (bytearray(b"array"), memoryview(b"view")):
        await asyncio.wait_for(conn.send(data), 5)
        assert (await asyncio.wait_for(conn.recv(), 5)).data == bytes(data)
    # delivery= takes a plain int as well as a rudp.Delivery, in both builds.
    handle = conn.send(b"int mode", delivery=int(rudp.Delivery.RELIABLE_UNORDERED))
    await asyncio.wait_for(handle, 5)
    assert (await asyncio.wait_for(conn.recv(), 5)).data == b"int mode"
    await conn.close()


def test_the_send_handle_is_the_core_message_and_only_asyncio_makes_it_awaitable() -> None:
    from rudp.config import Config
    from rudp.endpoint import Endpoint
    from rudp.sending import OutMessage

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


# No resend or keepalive for seconds: every datagram a test sees is one it caused.
QUIET = rudp.Config(
    rto_min=5.0,
    rto_initial=5.0,
    rto_max=10.0,
    keepalive_interval=30.0,
    idle_timeout=60.0,
    close_timeout=0.5,
)


async def _deafen(server: rudp.Server) -> None:
    """Let the handshake's last packets in, then stop the server reading its socket."""
    await asyncio.sleep(0.1)
    asyncio.get_running_loop().remove_reader(server.endpoint._sock.fileno())


# -- set_receiver ------------------------------------------------------------------------


async def test_a_receiver_gets_every_message_in_order_and_recv_says_so() -> None:
    got: list[bytes] = []
    arrived = asyncio.Event()

    async def handler(conn: rudp.Connection) -> None:
        first = await conn.recv()  # the first message is taken the usual way
        got.append(first.data)
        while len(conn._inbox) < 2:  # two more are queued before the receiver is set
            await asyncio.sleep(0.01)

        def receiver(msg: rudp.MessageReceived) -> None:
            got.append(msg.data)
            if len(got) == 12:
                arrived.set()

        conn.set_receiver(receiver)
        with pytest.raises(rudp.LocalProtocolError):
            await conn.recv()
        with pytest.raises(rudp.LocalProtocolError):
            conn.recv_nowait()
        await arrived.wait()
        conn.set_receiver(None)  # back to queueing
        assert (await conn.recv()).data == b"after"
        await conn.close()

    async with await rudp.serve(handler, "127.0.0.1", 0) as srv:
        conn = await rudp.connect(*srv.address)
        for i in range(3):
            conn.send(b"%d" % i)
        await asyncio.sleep(0.1)
        for i in range(3, 12):
            conn.send(b"%d" % i)
        await asyncio.wait_for(arrived.wait(), 5)
        conn.send(b"after")
        await asyncio.wait_for(conn.wait_closed(), 5)
    assert got == [b"%d" % i for i in range(12)]


async def test_setting_a_receiver_wakes_a_waiting_recv_with_an_error(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    waiting = asyncio.create_task(conn.recv())
    await asyncio.sleep(0)
    conn.set_receiver(lambda msg: None)
    with pytest.raises(rudp.LocalProtocolError):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(TypeError, match="receiver must be callable"):
        conn.set_receiver(b"not callable")  # type: ignore[arg-type]
    await conn.close()


async def test_a_reply_from_a_receiver_shares_the_datagram_of_the_acknowledgement() -> None:
    # Resends, keepalives and path MTU probes out of the way: every datagram the server
    # sends is a reply, or a tail-loss probe (a loaded machine can hold the client's
    # acknowledgement past the probe's timer), which is not what this test counts.
    config = dataclasses.replace(QUIET, max_datagram_size=1200)
    server_conns: list[rudp.Connection] = []

    async def handler(conn: rudp.Connection) -> None:
        server_conns.append(conn)
        conn.set_receiver(lambda msg: conn.send(msg.data))
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0, config=config) as srv:
        conn = await rudp.connect(*srv.address, config=config)
        conn.send(b"warm-up")
        await asyncio.wait_for(conn.recv(), 5)
        stats = server_conns[0].stats
        sent, probes = stats.packets_sent, stats.tail_probes
        for i in range(50):
            conn.send(b"%d" % i)
            assert (await asyncio.wait_for(conn.recv(), 5)).data == b"%d" % i
        assert stats.mtu_probes_sent == 0
        assert (stats.packets_sent - sent) - (stats.tail_probes - probes) == 50
        await conn.close()


async def test_a_failing_receiver_closes_its_connection_gracefully(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(conn: rudp.Connection) -> None:
        def receiver(msg: rudp.MessageReceived) -> None:
            raise RuntimeError("receiver bug")

        conn.set_receiver(receiver)
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0) as srv:
        conn = await rudp.connect(*srv.address)
        conn.send(b"boom")
        closed = await asyncio.wait_for(conn.wait_closed(), 5)
        assert closed.by_peer and closed.reason is rudp.DisconnectReason.CLOSED


# -- lifecycle regressions -------------------------------------------------------------------


async def test_connect_gives_back_its_socket_when_the_server_closes_at_once() -> None:
    # The server's ACCEPT and DISCONNECT arrive in one read. A long close_timeout: the
    # server's close() completes only because the client acknowledges its DISCONNECT.
    config = rudp.Config(close_timeout=60.0)
    closes: list[float] = []

    async def handler(conn: rudp.Connection) -> None:
        start = asyncio.get_running_loop().time()
        await conn.close(4, "go away")
        closes.append(asyncio.get_running_loop().time() - start)

    async with await rudp.serve(handler, "127.0.0.1", 0, config=config) as srv:
        for _ in range(3):
            try:
                conn = await rudp.connect(*srv.address)
            except rudp.ConnectError:
                continue
            closed = await asyncio.wait_for(conn.wait_closed(), 5)
            assert (closed.code, closed.text) == (4, "go away")
            await asyncio.wait_for(conn._endpoint.wait_closed(), 5)
        await asyncio.wait_for(_until(lambda: len(closes) == 3), 20)
    assert all(seconds < 20 for seconds in closes)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_server_close_from_inside_a_handler_returns_and_closes_the_socket() -> None:
    after: list[str] = []

    async def handler(conn: rudp.Connection) -> None:
        await conn.recv()
        await srv.close()
        after.append("handler went on")

    srv = await rudp.serve(handler, "127.0.0.1", 0, config=rudp.Config(close_timeout=60.0))
    conn = await rudp.connect(*srv.address)
    conn.send(b"shut down")
    await asyncio.wait_for(srv.wait_closed(), 20)
    await asyncio.wait_for(_until(lambda: bool(after)), 5)
    assert srv.endpoint.is_closed and after == ["handler went on"]
    await asyncio.wait_for(conn.wait_closed(), 5)


async def test_cancelling_one_of_two_recv_calls_leaves_the_other_waiting(
    server: rudp.Server,
) -> None:
    conn = await rudp.connect(*server.address)
    reader = asyncio.create_task(conn.recv())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(conn.recv(), 0.05)
    assert not reader.done()
    conn.send(b"still listening")
    assert (await asyncio.wait_for(reader, 5)).data == b"still listening"
    await conn.close()


async def test_drain_returns_once_unreliable_messages_have_left() -> None:
    # Unreliable packets elicit no acknowledgement: drain() has to notice the queue
    # emptied when it was sent, not at the next datagram or timer.
    config = rudp.Config(
        send_queue_limit=64, keepalive_interval=60.0, idle_timeout=120.0, close_timeout=0.5
    )

    async def silent(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(silent, "127.0.0.1", 0, config=config) as srv:
        conn = await rudp.connect(*srv.address, config=config)
        await _deafen(srv)

        async def burst() -> None:
            for _ in range(64):
                conn.send(b"u" * 100, reliable=False)
            assert conn.queued > config.drain_threshold
            await conn.drain()  # waits from before the flush that sends them

        sender = asyncio.create_task(burst())
        for _ in range(10):  # loop turns, not time: no timer or datagram is due
            await asyncio.sleep(0)
        assert sender.done() and conn.queued == 0
        await sender
        await conn.close()


async def test_send_while_closing_raises_connection_closed(server: rudp.Server) -> None:
    conn = await rudp.connect(*server.address)
    conn.send(b"queued")
    closing = conn.close(9, "done")  # closing from here on
    await asyncio.sleep(0)
    with pytest.raises(rudp.ConnectionClosed) as info:
        conn.send(b"too late")
    assert (info.value.reason, info.value.code) == ("closed", 9)
    await asyncio.wait_for(closing, 5)


async def test_a_pending_query_or_connect_fails_clearly_when_its_endpoint_closes() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        endpoint = await rudp.open_endpoint("127.0.0.1", 0)
        query = asyncio.create_task(endpoint.query(silent.getsockname(), b"?", timeout=30))
        connect = asyncio.create_task(endpoint.connect(*silent.getsockname()))
        await asyncio.sleep(0.05)
        await endpoint.close()
        with pytest.raises(rudp.EndpointClosed):
            await asyncio.wait_for(query, 5)
        with pytest.raises(rudp.ConnectError) as info:
            await asyncio.wait_for(connect, 5)
        assert not isinstance(info.value, rudp.ConnectRefused)
        with pytest.raises(rudp.EndpointClosed):
            await endpoint.query(silent.getsockname(), b"?", timeout=30)
        with pytest.raises(rudp.EndpointClosed):  # a LocalProtocolError, as ever
            await endpoint.connect(*silent.getsockname())
        assert issubclass(rudp.EndpointClosed, rudp.LocalProtocolError)
    finally:
        silent.close()


async def test_a_dual_stack_endpoint_reaches_ipv4_hosts(server: rudp.Server) -> None:
    try:
        dual = await rudp.open_endpoint("::", 0)
    except OSError as exc:
        pytest.skip(f"no dual-stack IPv6 here: {exc}")
    async with dual:
        conn = await asyncio.wait_for(dual.connect(*server.address), 5)
        assert conn.remote_address[0] == "::ffff:127.0.0.1"
        conn.send(b"mapped")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"mapped"
        await conn.close()


async def test_a_query_handler_returning_a_non_bytes_reply_is_logged_not_raised(
    server: rudp.Server,
) -> None:
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    server.on_query = lambda payload, address: "not bytes"  # type: ignore[assignment,return-value]
    client = await rudp.open_endpoint("127.0.0.1", 0)
    async with client:
        with pytest.raises(TimeoutError):
            await client.query(server.address, b"?" * 64, timeout=0.2)
    assert errors == []


async def test_a_waiter_on_a_superseded_message_wakes_in_the_same_turn() -> None:
    # The peer stops reading: only the flush that superseded the message can wake
    # whoever awaits it within a few loop turns.
    config = QUIET

    async def deaf(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(deaf, "127.0.0.1", 0, config=config) as srv:
        conn = await rudp.connect(*srv.address, config=config)
        await _deafen(srv)
        old = conn.send(b"v1", delivery=rudp.Delivery.RELIABLE_SEQUENCED)
        waiter = asyncio.ensure_future(old)
        await asyncio.sleep(0.01)  # v1 is out, unacknowledged, and awaited
        assert not waiter.done()
        conn.send(b"v2", delivery=rudp.Delivery.RELIABLE_SEQUENCED)  # supersedes v1
        for _ in range(10):  # loop turns, not time: no timer or datagram is due
            await asyncio.sleep(0)
        assert waiter.done() and old.superseded
        conn._endpoint.close_now()


@pytest.mark.parametrize("accepting", [(True, True), (True, False), (False, False)])
async def test_two_peers_connecting_to_each_other_at_once_share_one_connection(
    accepting: tuple[bool, bool],
) -> None:
    # What two players introduced by a matchmaker do. Neither handler may run: each
    # side's connection belongs to its connect() call.
    handled: list[rudp.Connection] = []

    async def handler(conn: rudp.Connection) -> None:
        handled.append(conn)

    a, b = [
        await rudp.open_endpoint("127.0.0.1", 0, handler=handler if accept else None)
        for accept in accepting
    ]
    try:
        both = asyncio.gather(a.connect(*b.address), b.connect(*a.address))
        # Both handshakes start in this loop turn, before any datagram is read (an IP
        # literal is resolved without the thread pool): the CONNECTs cross.
        await asyncio.sleep(0)
        for endpoint in (a, b):
            (conn,) = endpoint.endpoint.core.connections
            assert conn.state.value == "connecting"
        to_b, to_a = await asyncio.wait_for(both, 10)
        assert to_b.remote_address[:2] == b.address and to_a.remote_address[:2] == a.address
        to_b.send(b"from a")
        to_a.send(b"from b")
        assert (await asyncio.wait_for(to_a.recv(), 5)).data == b"from a"
        assert (await asyncio.wait_for(to_b.recv(), 5)).data == b"from b"
        assert a.stats.simultaneous_opens + b.stats.simultaneous_opens == 1
        assert handled == [] and a.connections == [] and b.connections == []
        await to_b.close(code=7, text="done")
        ended = await asyncio.wait_for(to_a.wait_closed(), 5)
        assert (ended.reason, ended.code, ended.by_peer) == (rudp.DisconnectReason.CLOSED, 7, True)
    finally:
        await a.close()
        await b.close()


async def test_ip_literals_resolve_without_the_thread_pool_and_ports_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rudp.aio.server import _resolve

    loop = asyncio.get_running_loop()
    for host, port, family, flags in [
        ("127.0.0.1", 5, 0, 0),
        ("2001:db8:0::1", 5, 0, 0),
        ("1.2.3.4", 5, socket.AF_INET6, socket.AI_V4MAPPED),
    ]:
        fam, _, _, _, sockaddr = (
            await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM, flags=flags)
        )[0]
        assert await _resolve(host, port, family, flags) == (fam, tuple(sockaddr))

    async def no_thread_pool(*args: object, **kwargs: object) -> object:
        raise AssertionError("getaddrinfo called for an IP literal")

    monkeypatch.setattr(loop, "getaddrinfo", no_thread_pool)
    assert await _resolve("::1", 9) == (socket.AF_INET6, ("::1", 9, 0, 0))
    with pytest.raises(AssertionError):  # a name still goes to getaddrinfo
        await _resolve("localhost", 9)
    with pytest.raises(ValueError, match=r"port must be in 0\.\.65535"):
        await rudp.connect("127.0.0.1", 70000)  # getaddrinfo would have made it 4464


async def test_a_read_drains_a_burst_and_stops_when_nothing_else_waits() -> None:
    # One datagram per system call (no rudp._batch): after the first datagram of a
    # wake-up the endpoint asks the socket whether another waits (FIONREAD) instead
    # of reading until a refused recvfrom. A burst is still read whole in one
    # callback; a datagram the probe cannot see (an empty one: FIONREAD reports its
    # size, 0) is left for the next wake-up, which the loop's level-triggered
    # readiness brings. (With rudp._batch, recvmmsg reads it at once: test_batch.py.)
    got: list[bytes] = []

    def mine(data: bytes, address: object) -> list[bytes]:
        got.append(data)
        return []

    async def idle(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(idle, "127.0.0.1", 0) as server:
        server.set_datagram_handler(0xB1, mine)
        endpoint = server.endpoint
        endpoint._batch = None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            # Loopback queues each datagram during sendto; no await below lets the
            # loop read before the endpoint's read callback is called here.
            for i in range(5):
                sock.sendto(b"\xb1%d" % i, server.address)
            endpoint._read_ready()
            assert got == [b"\xb1%d" % i for i in range(5)]
            sock.sendto(b"\xb1last", server.address)
            sock.sendto(b"", server.address)
            endpoint._read_ready()
            assert got[-1] == b"\xb1last"
            assert not server.stats.dropped  # the empty datagram still waits
            for _ in range(200):
                await asyncio.sleep(0.01)
                if server.stats.dropped:
                    break
            assert sum(server.stats.dropped.values()) == 1
            assert len(got) == 6


class _FailingLookup(dict[int, object]):
    """A handler table whose lookup raises for one first byte: a stand-in for a bug
    anywhere in a datagram's processing. (Compiled, neither the core nor this lookup
    can be patched: mypyc reads a dict's items without calling an override.)"""

    def get(self, key: int, default: object = None) -> object:  # type: ignore[override]
        if key == 0xB2:
            raise RuntimeError("a simulated bug")
        return super().get(key, default)


class _RecvMany:
    """``rudp._batch.recv_many`` in Python (the pure build has no C extension), so
    that the batched read path runs here too: up to ``want`` datagrams a call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv_many(self, fd: int, want: int, cache: object) -> list[tuple[bytes, object]]:
        got: list[tuple[bytes, object]] = []
        while len(got) < want:
            try:
                got.append(self.sock.recvfrom(65536))
            except BlockingIOError:
                break
        if not got:
            raise BlockingIOError
        return got


@pytest.mark.skipif(rudp.native, reason="compiled: no seam to simulate a failure (same source)")
@pytest.mark.parametrize("batched", [False, True], ids=["recvfrom", "recvmmsg"])
async def test_a_datagram_whose_processing_raises_is_counted_and_the_read_goes_on(
    batched: bool, caplog: pytest.LogCaptureFixture
) -> None:
    got: list[bytes] = []
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))

    def mine(data: bytes, address: object) -> list[bytes]:
        got.append(data)
        return []

    async def idle(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(idle, "127.0.0.1", 0) as server:
        server.set_datagram_handler(0xB1, mine)
        endpoint = server.endpoint
        endpoint._batch = _RecvMany(endpoint._sock) if batched else None
        endpoint._foreign = _FailingLookup(endpoint._foreign)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sent = [b"\xb1%d" % i for i in range(6)]
            for data in sent:  # every other datagram is one that raises
                sock.sendto(data, server.address)
                sock.sendto(b"\xb2", server.address)
            for _ in range(200):
                endpoint._read_ready()
                if len(got) == len(sent):
                    break
                await asyncio.sleep(0.01)
    assert got == sent
    assert server.stats.dropped == {DropReason.INTERNAL_ERROR: 6}
    logged = [r for r in caplog.records if r.getMessage().startswith("internal_error")]
    assert [r.getMessage().split("count=")[1].split()[0] for r in logged] == ["1", "2", "4"]
    assert all(r.exc_info and "a simulated bug" in str(r.exc_info[1]) for r in logged)
    assert not loop_errors
