"""The application's callbacks run from the socket's read callback (a receiver, an
``on_query`` or ``on_foreign`` handler): what they raise stays in rudp, even a
``BaseException`` such as ``CancelledError``, and never reaches the event loop's
exception handler. Loopback only."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

import rudp


def cancelled_error() -> None:
    """Raise what ``result()`` of a cancelled future raises."""
    future = asyncio.get_running_loop().create_future()
    future.cancel()
    future.result()


@pytest.fixture
async def escaped() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the running loop's exception handler during the test."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(None)


@pytest.fixture
async def server() -> AsyncIterator[rudp.Server]:
    async def hold(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(hold, "127.0.0.1", 0) as server:
        yield server


async def test_a_receiver_raising_cancelled_error_is_removed_and_closes_its_connection(
    server: rudp.Server, escaped: list[dict[str, Any]]
) -> None:
    conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
    await asyncio.wait_for(conn.send(b"hello"), 5)  # queued for recv() until the receiver
    [accepted] = server.connections
    seen: list[bytes] = []

    def receiver(message: rudp.MessageReceived) -> None:
        seen.append(message.data)
        if message.data == b"boom":
            cancelled_error()

    accepted.set_receiver(receiver)
    for data in (b"a", b"boom", b"b"):
        conn.send(data)
    ended = await asyncio.wait_for(conn.wait_closed(), 5)
    assert ended.reason is rudp.DisconnectReason.CLOSED and ended.by_peer
    assert seen == [b"hello", b"a", b"boom"]  # removed: not called again
    assert escaped == []


async def test_a_query_handler_raising_cancelled_error_answers_nothing_and_rudp_goes_on(
    server: rudp.Server, escaped: list[dict[str, Any]]
) -> None:
    def failing(payload: bytes, address: object) -> bytes:
        cancelled_error()
        return payload

    server.on_query = failing
    with pytest.raises(TimeoutError):
        await server.query(server.address, b"q", timeout=0.2)
    server.on_query = lambda payload, address: b"answer"
    reply, _ = await asyncio.wait_for(server.query(server.address, b"q"), 5)
    assert reply == b"answer"
    assert escaped == []


async def test_a_foreign_handler_raising_cancelled_error_is_counted_and_rudp_goes_on(
    server: rudp.Server, escaped: list[dict[str, Any]]
) -> None:
    def failing(data: bytes, address: object) -> list[bytes]:
        cancelled_error()
        return []

    server.on_foreign = failing
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"\xff\xff\xff\xffTSource Engine Query\x00", server.address)
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        await asyncio.wait_for(conn.send(b"still here"), 5)
        await asyncio.wait_for(conn.close(), 5)
    assert server.endpoint.foreign_errors == 1
    assert escaped == []


async def test_handlers_that_fail_on_every_datagram_are_logged_at_doubling_counts(
    server: rudp.Server, caplog: pytest.LogCaptureFixture
) -> None:
    # Anyone can send queries and foreign datagrams: a handler failing on each logged
    # a traceback per datagram (800 bytes of log for a 32-byte datagram).
    def failing(data: bytes, address: object) -> Any:
        raise ValueError("bad input")

    server.on_query = failing
    server.on_foreign = failing
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(10):
            sock.sendto(b"\xff\xff\xff\xffTSource Engine Query\x00", server.address)
        for _ in range(10):
            with pytest.raises(TimeoutError):
                await server.query(server.address, b"q", timeout=0.05)
    for _ in range(100):
        if server.endpoint.foreign_errors == 10:
            break
        await asyncio.sleep(0.01)
    assert server.endpoint.foreign_errors == server.endpoint.query_errors == 10
    logged = [r.getMessage() for r in caplog.records if "handler_failed" in r.getMessage()]
    counts = sorted(int(m.rsplit("=", 1)[1]) for m in logged if m.startswith("foreign"))
    assert counts == [1, 2, 4, 8]
    assert sorted(int(m.rsplit("=", 1)[1]) for m in logged if m.startswith("query")) == counts
