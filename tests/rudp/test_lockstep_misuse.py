"""Misusing the lockstep asyncio glue (and the metrics collector) fails at once and
cleanly: nothing is left open or running, and nothing waits forever.

Loopback rudp only; every wait is bounded by ``asyncio.wait_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import rudp
from rudp.errors import LocalProtocolError
from rudp.lockstep import (
    ClientJoined,
    ClientState,
    Event,
    GameStarted,
    HostState,
    LockstepClient,
    LockstepConfig,
    LockstepHost,
)
from rudp.lockstep.aio import LockstepServer, LockstepSession
from rudp.metrics import RudpCollector

TIMEOUT = 10.0


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[rudp.Connection]]:
    """Every connection ``rudp.connect`` makes during the test."""
    made: list[rudp.Connection] = []
    real = rudp.connect

    async def recording(*args: Any, **kwargs: Any) -> rudp.Connection:
        conn = await real(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(rudp, "connect", recording)
    yield made
    for conn in made:
        conn.close()


async def first(events: AsyncIterator[Event], kind: type) -> Event:
    async def find() -> Event:
        async for event in events:
            if isinstance(event, kind):
                return event
        raise AssertionError(f"events ended before {kind.__name__}")

    return await asyncio.wait_for(find(), TIMEOUT)


async def drain(events: AsyncIterator[Event]) -> list[Event]:
    async def collect() -> list[Event]:
        return [event async for event in events]

    return await asyncio.wait_for(collect(), TIMEOUT)


# ---------------------------------------------------------------------------- names


def test_a_name_that_is_not_a_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="name must be a str, not int"):
        LockstepClient(name=123)  # type: ignore[arg-type]


async def test_connect_with_a_bad_name_leaves_no_connection(
    connections: list[rudp.Connection],
) -> None:
    server = await LockstepServer.serve("127.0.0.1", 0)
    try:
        host, port = server.address
        with pytest.raises(LocalProtocolError, match="name longer"):
            await asyncio.wait_for(LockstepSession.connect(host, port, name="x" * 500), TIMEOUT)
        with pytest.raises(TypeError, match="name must be a str"):
            await asyncio.wait_for(
                LockstepSession.connect(host, port, name=123),  # type: ignore[arg-type]
                TIMEOUT,
            )
        assert [conn for conn in connections if not conn.closed] == []
    finally:
        await server.close()


# ---------------------------------------------------------------------------- channels


async def test_connect_refuses_a_bad_channel_before_connecting(
    connections: list[rudp.Connection],
) -> None:
    server = await LockstepServer.serve("127.0.0.1", 0)
    try:
        host, port = server.address
        with pytest.raises(ValueError, match=r"channel must be in \[0, 32\), got 999"):
            await asyncio.wait_for(LockstepSession.connect(host, port, channel=999), TIMEOUT)
        with pytest.raises(ValueError, match=r"\[0, 4\), got 4"):
            await asyncio.wait_for(
                LockstepSession.connect(host, port, rudp_config=rudp.Config(channels=4), channel=4),
                TIMEOUT,
            )
        for wrong in ("0", 1.0, None, True):
            with pytest.raises(TypeError, match="channel must be an int"):
                await asyncio.wait_for(
                    LockstepSession.connect(host, port, channel=wrong),  # type: ignore[arg-type]
                    TIMEOUT,
                )
        with pytest.raises(ValueError, match="got -1"):
            await asyncio.wait_for(LockstepSession.connect(host, port, channel=-1), TIMEOUT)
        assert connections == []
    finally:
        await server.close()


async def test_connect_closes_the_connection_when_the_server_lacks_the_channel(
    connections: list[rudp.Connection],
) -> None:
    # Our side has 32 channels, the server 4: only the connection can tell.
    server = await LockstepServer.serve("127.0.0.1", 0, rudp_config=rudp.Config(channels=4))
    try:
        tasks = asyncio.all_tasks()
        with pytest.raises(ValueError, match="channel 8 cannot be used on this connection"):
            await asyncio.wait_for(LockstepSession.connect(*server.address, channel=8), TIMEOUT)
        assert len(connections) == 1
        assert connections[0].closed
        await asyncio.wait_for(connections[0].wait_closed(), TIMEOUT)
        assert not any("LockstepSession" in repr(t.get_coro()) for t in asyncio.all_tasks() - tasks)
    finally:
        await server.close()


async def test_a_session_over_a_connection_refuses_a_channel_it_lacks() -> None:
    server = await LockstepServer.serve("127.0.0.1", 0)
    conn = await asyncio.wait_for(rudp.connect(*server.address), TIMEOUT)
    try:
        tasks = asyncio.all_tasks()
        for channel in (32, 300):
            with pytest.raises(ValueError, match="channel"):
                LockstepSession(conn, LockstepClient(), channel=channel)
        with pytest.raises(TypeError, match="channel must be an int"):
            LockstepSession(conn, LockstepClient(), channel="0")  # type: ignore[arg-type]
        assert asyncio.all_tasks() == tasks  # no reader was started
    finally:
        await asyncio.wait_for(conn.close(), TIMEOUT)
        await server.close()


async def test_server_refuses_a_bad_channel_before_serving() -> None:
    with pytest.raises(ValueError, match=r"channel must be in \[0, 32\), got 999"):
        await LockstepServer.serve("127.0.0.1", 0, channel=999)
    with pytest.raises(ValueError, match=r"\[0, 4\), got 4"):
        await LockstepServer.serve("127.0.0.1", 0, rudp_config=rudp.Config(channels=4), channel=4)
    with pytest.raises(TypeError, match="channel must be an int"):
        await LockstepServer.serve("127.0.0.1", 0, channel="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 256"):
        LockstepServer(LockstepHost(), channel=256)
    with pytest.raises(TypeError, match="channel must be an int, not bool"):
        LockstepServer(LockstepHost(), channel=True)


async def test_a_valid_channel_other_than_zero_plays() -> None:
    cfg = LockstepConfig(turn_interval=0.02)
    server = await LockstepServer.serve("127.0.0.1", 0, config=cfg, channel=31)
    session = await asyncio.wait_for(
        LockstepSession.connect(*server.address, name="a", config=cfg, channel=31), TIMEOUT
    )
    try:
        await first(server.events(), ClientJoined)
        server.start()
        await first(session.events(), GameStarted)
    finally:
        await session.close()
        await server.close()


# ---------------------------------------------------------------------------- after close


@contextlib.asynccontextmanager
async def started_game() -> AsyncIterator[tuple[LockstepServer, LockstepSession]]:
    """A host and one session, the game started; both closed on the way out."""
    cfg = LockstepConfig(turn_interval=0.02)
    server = await LockstepServer.serve("127.0.0.1", 0, config=cfg)
    session = await asyncio.wait_for(
        LockstepSession.connect(*server.address, name="a", config=cfg), TIMEOUT
    )
    try:
        await first(server.events(), ClientJoined)
        server.start()
        await first(session.events(), GameStarted)
        yield server, session
    finally:
        await session.close()
        await server.close()


async def test_a_closed_session_refuses_the_game_and_its_events_end() -> None:
    async with started_game() as (_, session):
        assert not session.closed
        await asyncio.wait_for(session.close(), TIMEOUT)
        assert session.closed
        assert session.client.state is ClientState.ENDED
        with pytest.raises(LocalProtocolError, match="session is closed"):
            session.send_command(b"fire")
        with pytest.raises(LocalProtocolError, match="session is closed"):
            session.complete_turn(0, 0)
        with pytest.raises(LocalProtocolError, match="session is closed"):
            session.next_turn()
        with pytest.raises(LocalProtocolError, match="session is closed"):
            await session.leave()
        await drain(session.events())
        # Ended for good: a new iteration ends at once rather than waiting forever.
        assert await drain(session.events()) == []
        await asyncio.wait_for(session.close(), TIMEOUT)  # closing again is harmless


async def test_a_session_its_host_ended_still_runs_the_turns_it_received() -> None:
    # The host's DISCONNECT can arrive while turns it sent wait in the session:
    # the documented loop (next_turn / complete_turn until events() ends, then
    # leave()) runs them and ends without an error.
    async with started_game() as (server, session):

        async def turns_wait() -> None:
            while session.client.backlog == 0:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(turns_wait(), TIMEOUT)
        await asyncio.wait_for(server.close(), TIMEOUT)
        await drain(session.events())  # they end with the connection
        assert session.conn.closed and not session.closed
        turn = session.next_turn()
        assert turn is not None
        session.complete_turn(turn.number, 0)
        session.send_command(b"fire")  # dropped: nobody hosts the game any more
        await asyncio.wait_for(session.leave(), TIMEOUT)
        assert session.closed


async def test_a_closed_server_refuses_to_start() -> None:
    # start() after close() started the host's clock and "sent" START to nobody.
    server = await LockstepServer.serve("127.0.0.1", 0)
    await server.close()
    with pytest.raises(LocalProtocolError, match=r"^the lockstep server is closed$"):
        server.start()
    assert server.host.state is HostState.LOBBY
    assert await drain(server.events()) == []


async def test_server_events_end_for_every_later_iteration() -> None:
    server = await LockstepServer.serve("127.0.0.1", 0)
    await server.close()
    assert await drain(server.events()) == []
    assert await drain(server.events()) == []


# ---------------------------------------------------------------------------- metrics


async def test_a_registry_refuses_a_second_rudp_collector() -> None:
    async def handler(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    registry = CollectorRegistry()
    async with (
        await rudp.serve(handler, "127.0.0.1", 0) as a,
        await rudp.serve(handler, "127.0.0.1", 0) as b,
    ):
        collector = RudpCollector([a], registry=registry)
        with pytest.raises(ValueError, match="already has rudp metrics"):
            RudpCollector([b], registry=registry)
        spare = RudpCollector([b], registry=None)
        with pytest.raises(ValueError):
            registry.register(spare)
        collector.add(b)  # the way to collect both
        text = generate_latest(registry).decode()
        assert text.count("# HELP rudp_connections ") == 1
        assert text.count("# HELP rudp_rtt_seconds ") == 1
