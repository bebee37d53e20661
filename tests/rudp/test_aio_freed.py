"""An ended asyncio connection, with its core, is freed by reference counting.

A server that serves short connections (a request, a reply, the client closes)
must not leave each one to the cyclic collector: the connection's core, the
asyncio ``Connection`` around it and what its handler held go the moment the
connection ends and nothing holds them. With the collector off, each way a
connection ends runs over loopback, and the collector then finds none of them
among what it would free. (Endpoints live on: they are made once.)
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest

import rudp
from rudp.aio.connection import Connection as AioConnection
from rudp.connection import Connection as CoreConnection

PER_CONNECTION = (CoreConnection, AioConnection)


def per_connection_garbage() -> Counter[str]:
    """The connections (core or asyncio) a collection now would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(type(o).__qualname__ for o in gc.garbage if isinstance(o, PER_CONNECTION))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return found


def live(*, servers_only: bool = False) -> int:
    """The connections (core or asyncio) alive now, or only a server's."""
    count = 0
    for o in gc.get_objects():
        if isinstance(o, CoreConnection):
            count += not (servers_only and o.client)
        elif isinstance(o, AioConnection):
            count += not (servers_only and o._core.client)
    return count


async def until_gone(server: rudp.Endpoint, client: rudp.Endpoint) -> None:
    async def gone() -> None:  # closed and drained: the cores too
        while server.endpoint.core.connections or client.endpoint.core.connections:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(gone(), 10)
    await asyncio.sleep(0)  # the handler's task ends after its connection


async def answer(conn: rudp.Connection) -> None:
    async for msg in conn:
        conn.send(msg.data)


async def answer_and_close(conn: rudp.Connection) -> None:
    msg = await conn.recv()
    conn.send(msg.data)
    await conn.close(text="served")


Ending = Callable[[rudp.Endpoint, rudp.Endpoint, list[object]], Awaitable[None]]


async def client_closes(server: rudp.Endpoint, client: rudp.Endpoint, keep: list[object]) -> None:
    conn = await client.connect(*server.address)
    conn.send(b"register")
    assert (await asyncio.wait_for(conn.recv(), 5)).data == b"register"
    await conn.close()
    assert conn.stats.packets_received > 0 and conn.disconnected is not None


async def server_closes(server: rudp.Endpoint, client: rudp.Endpoint, keep: list[object]) -> None:
    conn = await client.connect(*server.address)
    conn.send(b"register")
    assert (await asyncio.wait_for(conn.recv(), 5)).data == b"register"
    await asyncio.wait_for(conn.wait_closed(), 5)
    reason = conn.disconnected
    assert reason is not None and reason.text == "served"


async def client_vanishes(server: rudp.Endpoint, client: rudp.Endpoint, keep: list[object]) -> None:
    """The client's process goes away: the server's side times out. (The client's
    endpoint is kept, with what it holds: an endpoint is a cycle, made once per
    process in real use.)"""
    gone = await rudp.open_endpoint("127.0.0.1", 0)
    conn = await gone.connect(*server.address)
    conn.send(b"register")
    await asyncio.wait_for(conn.recv(), 5)
    gone.endpoint.close_now()
    keep.append(gone)


async def refused(server: rudp.Endpoint, client: rudp.Endpoint, keep: list[object]) -> None:
    try:  # (pytest.raises would keep the exception, and with it the connection)
        await client.connect(*server.address)
    except rudp.ConnectRefused:
        return
    pytest.fail("a full server accepted a connection")


@pytest.mark.parametrize(
    ("handler", "config", "ending"),
    [
        (answer, rudp.Config(), client_closes),
        (answer_and_close, rudp.Config(), server_closes),
        (answer, rudp.Config(idle_timeout=0.5, keepalive_interval=0.1), client_vanishes),
        (answer, rudp.Config(max_connections=0), refused),
    ],
    ids=["client-closes", "server-closes", "timed-out", "refused"],
)
@pytest.mark.usefixtures("collector_off")
async def test_an_ended_connection_leaves_nothing_to_the_collector(
    handler: Callable[[rudp.Connection], Awaitable[None]], config: rudp.Config, ending: Ending
) -> None:
    server = await rudp.serve(handler, "127.0.0.1", 0, config=config)
    client = await rudp.open_endpoint("127.0.0.1", 0)
    keep: list[object] = []
    try:
        await ending(server, client, keep)  # once to warm up, then counted
        await until_gone(server, client)
        gc.collect()
        before = live(servers_only=True)
        for _ in range(3):
            await ending(server, client, keep)
            await until_gone(server, client)
        assert per_connection_garbage() == Counter()
        assert live(servers_only=True) == before
    finally:
        client.endpoint.close_now()
        await server.close()


@pytest.mark.usefixtures("collector_off")
async def test_a_connect_timeout_leaves_nothing_to_the_collector() -> None:
    silent = await rudp.open_endpoint("127.0.0.1", 0)  # binds a port, never answers
    client = await rudp.open_endpoint("127.0.0.1", 0, config=rudp.Config(connect_timeout=0.3))
    try:
        gc.collect()
        before = live()
        try:
            await client.connect(*silent.address)
        except rudp.ConnectTimeout:
            pass
        else:
            pytest.fail("a silent port answered")
        await asyncio.sleep(0)  # the loop lets go of the task's last wake-up
        assert per_connection_garbage() == Counter()
        assert live() == before
    finally:
        client.endpoint.close_now()
        silent.endpoint.close_now()
