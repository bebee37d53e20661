"""``Config.read_interval``: a server that reads its socket at most so often under traffic."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

import rudp


async def _serve(config: rudp.Config) -> tuple[rudp.Server, asyncio.Queue[bytes]]:
    got: asyncio.Queue[bytes] = asyncio.Queue()

    async def handler(conn: rudp.Connection) -> None:
        async for msg in conn:
            got.put_nowait(msg.data)

    return await rudp.serve(handler, "127.0.0.1", 0, config=config), got


async def test_after_a_read_the_socket_waits_the_interval_then_everything_is_read() -> None:
    server, got = await _serve(rudp.Config(read_interval=0.05))
    async with server:
        conn = await rudp.connect(*server.address)
        loop = asyncio.get_running_loop()
        sent_at = loop.time()
        conn.send(b"first")
        assert await asyncio.wait_for(got.get(), 5) == b"first"
        for i in range(20):
            conn.send(b"next %d" % i)
        # Not read before the interval has passed since the read that took "first",
        # which came after it was sent (the pause's timer cannot fire early, however
        # slow the machine).
        later = [await asyncio.wait_for(got.get(), 5) for _ in range(20)]
        assert loop.time() - sent_at >= 0.045
        assert later == [b"next %d" % i for i in range(20)]
        await conn.close()


async def test_without_an_interval_a_message_is_read_at_once() -> None:
    server, got = await _serve(rudp.Config())
    async with server:
        conn = await rudp.connect(*server.address)
        conn.send(b"first")
        assert await asyncio.wait_for(got.get(), 5) == b"first"
        conn.send(b"second")
        assert await asyncio.wait_for(got.get(), 5) == b"second"
        await conn.close()


async def test_closing_while_paused_cancels_the_pause_and_reports_nothing() -> None:
    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        server, got = await _serve(rudp.Config(read_interval=0.05))
        conn = await rudp.connect(*server.address)
        conn.send(b"first")
        assert await asyncio.wait_for(got.get(), 5) == b"first"
        conn.send(b"unread")
        await server.close()  # while the socket is not watched
        await asyncio.sleep(0.1)  # past the pause: nothing re-watches a closed socket
        assert errors == []
        await asyncio.wait_for(conn.wait_closed(), 15)
    finally:
        loop.set_exception_handler(None)


@pytest.mark.parametrize("value", [-0.001, 0.051, float("nan")])
def test_the_interval_is_checked(value: float) -> None:
    with pytest.raises(ValueError, match="read_interval"):
        rudp.Config(read_interval=value)
    with pytest.raises(TypeError, match="read_interval"):
        rudp.Config(read_interval=True)


async def test_a_read_cut_short_by_the_cap_goes_on_at_once_not_after_the_interval() -> None:
    """The pause comes after a read that emptied the socket only: with 200 datagrams
    waiting and 16 read per turn, the endpoint reads on until none is left, then
    pauses once (pausing after each 16 capped it at 16 per interval, and the socket
    overflowed under load)."""
    loop = asyncio.get_running_loop()
    pauses = 0
    call_later = loop.call_later

    def counting(delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        nonlocal pauses
        if getattr(callback, "__name__", "") == "_resume_reading":
            pauses += 1
        return call_later(delay, callback, *args)

    server, _ = await _serve(rudp.Config(read_interval=0.05, max_datagrams_per_read=16))
    async with server:
        loop.call_later = counting  # type: ignore[method-assign]
        try:
            stats = server.stats
            before = stats.datagrams_received
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
                for i in range(200):  # junk, dropped and counted; all queued at once
                    sender.sendto(b"\xa5" + bytes(20) + i.to_bytes(2, "big"), server.address)
            for _ in range(500):
                if stats.datagrams_received - before >= 200:
                    break
                await asyncio.sleep(0.01)
            assert stats.datagrams_received - before == 200
            assert pauses <= 2
        finally:
            del loop.call_later  # type: ignore[method-assign]
