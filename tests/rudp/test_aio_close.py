"""Closing through the asyncio layer: an endpoint's close awaited from several tasks,
and what a connection says once it has ended. Loopback only."""

from __future__ import annotations

import asyncio

import pytest

import rudp

QUICK = rudp.Config(close_timeout=0.5)


async def test_a_server_closed_from_two_handlers_and_main_ends_for_all_of_them() -> None:
    ended: dict[bytes, str] = {}

    async def close_on_request(conn: rudp.Connection) -> None:
        request = await conn.recv()
        try:
            await server.close()
        except asyncio.CancelledError:
            ended[request.data] = "cancelled"
            raise
        ended[request.data] = "returned"

    server = await rudp.serve(close_on_request, "127.0.0.1", 0, config=QUICK)
    a = await asyncio.wait_for(rudp.connect(*server.address), 5)
    b = await asyncio.wait_for(rudp.connect(*server.address), 5)
    a.send(b"a")
    b.send(b"b")
    both = asyncio.gather(a.wait_closed(), b.wait_closed())
    await asyncio.wait_for(both, 10)
    await asyncio.wait_for(server.close(), 10)  # main as well
    assert ended == {b"a": "returned", b"b": "returned"}
    assert server.endpoint.is_closed


async def test_a_wait_on_a_server_close_that_times_out_leaves_the_close_to_the_others() -> None:
    started = asyncio.Event()

    async def never_ends(conn: rudp.Connection) -> None:
        started.set()
        await asyncio.Event().wait()  # cancelled by the close, past its deadline

    server = await rudp.serve(never_ends, "127.0.0.1", 0, config=QUICK)
    conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
    await asyncio.wait_for(started.wait(), 5)

    async def close_too() -> None:
        await server.close()

    other = asyncio.create_task(close_too())
    await asyncio.sleep(0)  # it awaits the close first
    with pytest.raises(TimeoutError):
        # Shorter than any close: handlers get close_timeout plus a second first.
        await asyncio.wait_for(server.close(), 0.05)
    await asyncio.wait_for(other, 10)  # not cancelled with the wait above
    assert server.endpoint.is_closed
    ended = await asyncio.wait_for(conn.wait_closed(), 5)
    assert ended.reason is rudp.DisconnectReason.CLOSED and ended.by_peer


async def test_recv_nowait_raises_connection_closed_once_the_inbox_is_empty_after_the_end() -> None:
    async def send_and_return(conn: rudp.Connection) -> None:
        await conn.send(b"last")  # acknowledged: received before the end

    async with await rudp.serve(send_and_return, "127.0.0.1", 0) as server:
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        ended = await asyncio.wait_for(conn.wait_closed(), 5)
        message = conn.recv_nowait()  # what came before the end first
        assert message is not None and message.data == b"last"
        with pytest.raises(rudp.ConnectionClosed) as info:
            conn.recv_nowait()
        assert (info.value.reason, info.value.text) == ("closed", ended.text)
        with pytest.raises(rudp.ConnectionClosed):  # as recv() says
            await asyncio.wait_for(conn.recv(), 5)


async def test_a_client_connecting_while_the_server_closes_is_refused_at_once() -> None:
    # It was accepted, given a handler, then cut off unannounced when the close ended
    # (its recv() waited out idle_timeout), and the close waited for its handler.
    cleaning = asyncio.Event()

    async def slow_cleanup(conn: rudp.Connection) -> None:
        try:
            async for _ in conn:
                pass
        finally:
            cleaning.set()
            await asyncio.sleep(0.5)  # saving the player's state, say

    server = await rudp.serve(slow_cleanup, "127.0.0.1", 0, config=QUICK)
    first = await asyncio.wait_for(rudp.connect(*server.address), 5)
    closing = server.close()
    await asyncio.wait_for(cleaning.wait(), 5)  # the close is under way
    with pytest.raises(rudp.ConnectRefused, match="server closing"):
        await asyncio.wait_for(rudp.connect(*server.address), 5)
    await asyncio.wait_for(closing, 5)
    assert first.closed and server.endpoint.is_closed
    assert server.endpoint.core.stats.connections_refused == 1


async def test_connecting_again_right_after_the_end_is_taken() -> None:
    # The ended connection lingers a few RTOs to acknowledge a resent DISCONNECT; a
    # connect() to the same peer then raised "already connected or connecting".
    async def one_message(conn: rudp.Connection) -> None:
        await conn.recv()

    async with (
        await rudp.serve(one_message, "127.0.0.1", 0, config=QUICK) as server,
        await rudp.open_endpoint("127.0.0.1", 0, config=QUICK) as endpoint,
    ):
        first = await asyncio.wait_for(endpoint.connect(*server.address), 5)
        first.send(b"bye")
        ended = await asyncio.wait_for(first.wait_closed(), 5)
        assert ended.reason is rudp.DisconnectReason.CLOSED and ended.by_peer
        again = await asyncio.wait_for(endpoint.connect(*server.address), 5)
        again.send(b"again")
        assert (await asyncio.wait_for(again.wait_closed(), 5)).by_peer


async def test_a_connection_reads_closed_from_the_peers_disconnect_on() -> None:
    # A message that came with the DISCONNECT reaches the receiver before the
    # Disconnected event: conn.closed said False there, yet send() raised.
    seen: list[tuple[bytes, bool, str]] = []

    async def handler(conn: rudp.Connection) -> None:
        def receive(message: rudp.Message) -> None:
            closed = conn.closed
            try:
                conn.send(b"echo")
                seen.append((message.data, closed, "sent"))
            except rudp.ConnectionClosed:
                seen.append((message.data, closed, "refused"))

        conn.set_receiver(receive)
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0, config=QUICK) as server:
        client = await asyncio.wait_for(rudp.connect(*server.address), 5)
        client.send(b"bye", reliable=False)
        await asyncio.wait_for(client.close(), 5)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
    assert seen in ([(b"bye", True, "refused")], [(b"bye", False, "sent")])
