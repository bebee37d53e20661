"""What the asyncio endpoint does with the application's mistakes and its callbacks: a
receiver is never re-entered, a handler's own bug is reported as one, an endpoint
that is closing takes nothing new, and a query that times out says what it waited
for. Loopback only."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Callable

import pytest

import rudp

# A close that waits for a peer gone without a word lasts this long: the test ends it
# first (close_now), so that it is still closing whatever the machine's pace.
PATIENT = rudp.Config(close_timeout=30.0)


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition()`` holds (bound the wait with wait_for)."""
    while not condition():
        await asyncio.sleep(0)


# -- a receiver is never re-entered ---------------------------------------------------------


async def test_a_receiver_that_closes_its_connection_gets_the_next_messages_after_it_returns() -> (
    None
):
    calls: list[tuple[str, bytes]] = []
    ready = asyncio.Event()
    got_all = asyncio.Event()

    async def handler(conn: rudp.Connection) -> None:
        def receiver(message: rudp.MessageReceived) -> None:
            calls.append(("enter", message.data))
            if message.data == b"1":
                conn.close(text="done")  # runs the core: its events wait for this call's end
            calls.append(("leave", message.data))
            if message.data == b"3":
                got_all.set()

        conn.set_receiver(receiver)
        ready.set()
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        client = await asyncio.wait_for(rudp.connect(*server.address), 5)
        await asyncio.wait_for(ready.wait(), 5)
        for data in (b"1", b"2", b"3"):
            client.send(data)  # the same loop turn: one datagram, three events at once
        await asyncio.wait_for(got_all.wait(), 5)
        ended = await asyncio.wait_for(client.wait_closed(), 5)  # the DISCONNECT left
    assert calls == [
        ("enter", b"1"),
        ("leave", b"1"),
        ("enter", b"2"),
        ("leave", b"2"),
        ("enter", b"3"),
        ("leave", b"3"),
    ]
    assert ended.by_peer and (ended.reason, ended.text) == (rudp.DisconnectReason.CLOSED, "done")


async def test_a_receiver_that_closes_another_connection_is_not_re_entered() -> None:
    calls: list[tuple[str, bytes]] = []
    accepted: asyncio.Queue[rudp.Connection] = asyncio.Queue()

    async def hold_accepted(conn: rudp.Connection) -> None:
        await accepted.put(conn)
        await conn.wait_closed()

    async with await rudp.serve(hold_accepted, "127.0.0.1", 0) as server:
        sender = await asyncio.wait_for(rudp.connect(*server.address), 5)
        one = await asyncio.wait_for(accepted.get(), 5)
        neighbour = await asyncio.wait_for(rudp.connect(*server.address), 5)
        other = await asyncio.wait_for(accepted.get(), 5)

        def receiver(message: rudp.MessageReceived) -> None:
            calls.append(("enter", message.data))
            if message.data == b"1":
                other.close(text="closed by a neighbour")
            calls.append(("leave", message.data))

        one.set_receiver(receiver)
        for data in (b"1", b"2"):
            sender.send(data)
        ended = await asyncio.wait_for(neighbour.wait_closed(), 5)
        await asyncio.wait_for(until(lambda: len(calls) == 4), 5)
        await asyncio.wait_for(sender.close(), 5)
    assert calls == [("enter", b"1"), ("leave", b"1"), ("enter", b"2"), ("leave", b"2")]
    assert ended.by_peer and ended.text == "closed by a neighbour"


# -- a handler's own bug is not a connection closed under it --------------------------------


def send_on_a_channel_that_does_not_exist(conn: rudp.Connection) -> None:
    conn.send(b"reply", channel=99)  # LocalProtocolError


def send_a_message_too_large(conn: rudp.Connection) -> None:
    conn.send(bytes(conn.max_message_size + 1))  # MessageTooLarge


def send_until_the_queue_is_full(conn: rudp.Connection) -> None:
    for _ in range(1_000_000):  # without awaiting drain(): SendQueueFull
        conn.send(b"x")


@pytest.mark.parametrize(
    ("misuse", "error"),
    [
        (send_on_a_channel_that_does_not_exist, rudp.LocalProtocolError),
        (send_a_message_too_large, rudp.MessageTooLarge),
        (send_until_the_queue_is_full, rudp.SendQueueFull),
    ],
    ids=["bad_channel", "too_large", "queue_full"],
)
async def test_a_handler_failing_with_a_rudp_misuse_error_is_logged_and_the_peer_told(
    caplog: pytest.LogCaptureFixture,
    misuse: Callable[[rudp.Connection], None],
    error: type[rudp.RudpError],
) -> None:
    caplog.set_level(logging.DEBUG, logger="rudp.aio.endpoint")

    async def buggy(conn: rudp.Connection) -> None:
        await conn.recv()
        misuse(conn)
        await conn.wait_closed()

    config = rudp.Config(send_queue_limit=64)
    async with await rudp.serve(buggy, "127.0.0.1", 0, config=config) as server:
        client = await asyncio.wait_for(rudp.connect(*server.address), 5)
        client.send(b"hello")
        ended = await asyncio.wait_for(client.wait_closed(), 5)
    assert ended.by_peer and ended.text == "server handler failed"
    [failed] = [r for r in caplog.records if r.getMessage().startswith("handler_failed")]
    assert failed.levelno == logging.ERROR and failed.exc_info is not None
    assert isinstance(failed.exc_info[1], error)
    assert not [r for r in caplog.records if r.getMessage().startswith("handler_ended")]


async def test_a_handler_ended_by_its_closed_connection_or_endpoint_is_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="rudp.aio.endpoint")
    raised: list[type[BaseException]] = []
    ended_handlers = asyncio.Event()

    async def read_until_closed(conn: rudp.Connection) -> None:
        try:
            while True:
                await conn.recv()  # ConnectionClosed once the peer has closed
        except BaseException as exc:
            raised.append(type(exc))
            raise

    async def query_after_the_close(conn: rudp.Connection) -> None:
        await conn.recv()
        server.endpoint.close_now()
        try:
            await server.query(server.address, b"q")  # EndpointClosed
        except BaseException as exc:
            raised.append(type(exc))
            ended_handlers.set()
            raise

    async with await rudp.serve(read_until_closed, "127.0.0.1", 0) as reader:
        client = await asyncio.wait_for(rudp.connect(*reader.address), 5)
        await asyncio.wait_for(client.close(), 5)
    server = await rudp.serve(query_after_the_close, "127.0.0.1", 0)
    async with await rudp.open_endpoint("127.0.0.1", 0) as own:
        client = await asyncio.wait_for(own.connect(*server.address), 5)
        client.send(b"close")
        await asyncio.wait_for(ended_handlers.wait(), 5)
        await asyncio.wait_for(server.close(), 5)
        own.endpoint.close_now()  # its peer is gone without a word: no close to wait for
    assert raised == [rudp.ConnectionClosed, rudp.EndpointClosed]
    ended = [r for r in caplog.records if r.getMessage().startswith("handler_ended")]
    assert [r.levelno for r in ended] == [logging.DEBUG, logging.DEBUG]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_handler_whose_connect_the_closing_endpoint_ends_is_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The close ends the handler's connect() with ConnectError ("closed locally before
    # the handshake completed"): the close's doing, logged as handler_failed before.
    caplog.set_level(logging.DEBUG, logger="rudp.aio.endpoint")
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    connecting = asyncio.Event()
    raised: list[BaseException] = []

    async def connect_out(conn: rudp.Connection) -> None:
        connecting.set()
        try:
            await server.connect(*silent.getsockname())
        except BaseException as exc:
            raised.append(exc)
            raise

    try:
        server = await rudp.serve(connect_out, "127.0.0.1", 0)
        client = await asyncio.wait_for(rudp.connect(*server.address), 5)
        await asyncio.wait_for(connecting.wait(), 5)
        await asyncio.wait_for(server.close(), 10)
        await asyncio.wait_for(client.wait_closed(), 5)
    finally:
        silent.close()
    assert [type(e) for e in raised] == [rudp.ConnectError]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r for r in caplog.records if r.getMessage().startswith("handler_ended")]


async def test_a_handler_bug_on_the_way_out_of_a_closing_endpoint_is_still_a_bug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Only a connect() the close cut short is the close's doing: a misuse in the
    # handler's own cleanup showed as handler_ended at DEBUG, never in shutdown logs.
    caplog.set_level(logging.DEBUG, logger="rudp.aio.endpoint")
    serving = asyncio.Event()
    async with await rudp.serve(hold, "127.0.0.1", 0) as backend_server:
        backend = await asyncio.wait_for(rudp.connect(*backend_server.address), 5)

        async def cleans_up_badly(conn: rudp.Connection) -> None:
            try:
                serving.set()
                await conn.wait_closed()
            finally:
                backend.send(b"bye", channel=200)  # no such channel: LocalProtocolError

        server = await rudp.serve(cleans_up_badly, "127.0.0.1", 0)
        client = await asyncio.wait_for(rudp.connect(*server.address), 5)
        await asyncio.wait_for(serving.wait(), 5)
        await asyncio.wait_for(server.close(), 10)
        await asyncio.wait_for(client.wait_closed(), 5)
        await asyncio.wait_for(backend.close(), 5)
    failed = [r for r in caplog.records if r.getMessage().startswith("handler_failed")]
    assert failed and failed[0].levelno == logging.ERROR
    assert failed[0].exc_info is not None
    assert isinstance(failed[0].exc_info[1], rudp.LocalProtocolError)


# -- an endpoint that is closing takes nothing new ------------------------------------------


async def hold(conn: rudp.Connection) -> None:
    await conn.wait_closed()


async def test_connect_and_query_are_refused_at_once_while_the_endpoint_closes() -> None:
    async with await rudp.serve(hold, "127.0.0.1", 0) as other:
        other.on_query = lambda payload, address: b"answer"
        gone = await rudp.serve(hold, "127.0.0.1", 0)
        endpoint = await rudp.open_endpoint("127.0.0.1", 0, config=PATIENT)
        to_gone = await asyncio.wait_for(endpoint.connect(*gone.address), 5)
        gone.endpoint.close_now()  # that peer vanishes: the close waits for its ack
        closing = endpoint.close()
        await asyncio.wait_for(until(lambda: to_gone.closed), 5)  # the close has begun
        assert not endpoint.endpoint.is_closed
        with pytest.raises(rudp.EndpointClosed, match="closing"):
            await asyncio.wait_for(endpoint.connect(*other.address), 5)
        with pytest.raises(rudp.EndpointClosed, match="closing"):
            await asyncio.wait_for(endpoint.query(other.address, b"q"), 5)
        assert other.connections == []  # nothing reached the peer
        endpoint.endpoint.close_now()  # rather than wait out the close_timeout
        await asyncio.wait_for(closing, 5)
        with pytest.raises(rudp.EndpointClosed):  # and the same once it has closed
            await endpoint.connect(*other.address)
        with pytest.raises(rudp.EndpointClosed):
            await endpoint.query(other.address, b"q")
        await asyncio.wait_for(gone.close(), 5)


async def test_a_connect_or_query_right_after_close_is_refused() -> None:
    # Server.close() runs the close in a task of its own: before that task's first
    # step, a connect (to an IP literal: nothing to wait for) went through.
    async with await rudp.serve(hold, "127.0.0.1", 0) as other:
        other.on_query = lambda payload, address: b"answer"
        endpoint = await rudp.open_endpoint("127.0.0.1", 0)
        closing = endpoint.close()
        # Awaited in this task (wait_for would start a task after the close's own).
        async with asyncio.timeout(5):
            with pytest.raises(rudp.EndpointClosed, match="closing"):
                await endpoint.connect(*other.address)
            with pytest.raises(rudp.EndpointClosed, match="closing"):
                await endpoint.query(other.address, b"q")
        await asyncio.wait_for(closing, 5)
        assert other.connections == []


async def test_a_second_close_waits_for_the_first_instead_of_closing_again() -> None:
    # A close while one ran did the whole close again: its timeout=0 aborted the
    # connection the first was closing gracefully, and cancelled its handlers.
    gone = await rudp.serve(hold, "127.0.0.1", 0)
    endpoint = (await rudp.open_endpoint("127.0.0.1", 0, config=PATIENT)).endpoint
    to_gone = await asyncio.wait_for(endpoint.connect(gone.address), 5)
    gone.endpoint.close_now()  # that peer vanishes: the close waits for its ack
    first = asyncio.ensure_future(endpoint.close())
    await asyncio.wait_for(until(lambda: to_gone.closed), 5)  # the close has begun
    second = asyncio.ensure_future(endpoint.close(timeout=0))
    for _ in range(100):  # loop turns: a close of its own with timeout 0 ends in a few
        await asyncio.sleep(0)
    assert not second.done() and to_gone.disconnected is None  # still closing gracefully
    endpoint.close_now()  # rather than wait out the close_timeout
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert to_gone.disconnected is not None
    await asyncio.wait_for(endpoint.close(timeout=0), 5)  # once closed, a close returns
    await asyncio.wait_for(gone.close(), 5)


async def test_a_cancelled_handler_whose_cleanup_awaits_the_close_is_not_waited_for() -> None:
    # The close gave cancelled handlers a second, and waited it out for one whose
    # cleanup awaits that very close (each waiting for the other until then).
    started = asyncio.Event()
    cleaned: list[bool] = []

    async def handler(conn: rudp.Connection) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await server.endpoint.close()
            cleaned.append(True)
            raise

    server = await rudp.serve(handler, "127.0.0.1", 0, config=PATIENT)
    client = await asyncio.wait_for(rudp.connect(*server.address), 5)
    await asyncio.wait_for(started.wait(), 5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(server.endpoint.close(timeout=0), 5)
    took = loop.time() - began
    await asyncio.wait_for(until(lambda: bool(cleaned)), 5)
    assert took < 0.9, took  # the old way: the whole second, every time
    await asyncio.wait_for(client.close(), 5)


# -- a query that times out says what it waited for -------------------------------------------


async def test_a_query_timeout_names_the_address_and_the_timeout() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        async with await rudp.open_endpoint("127.0.0.1", 0) as endpoint:
            port = silent.getsockname()[1]
            expected = f"no answer to the query from 127.0.0.1:{port} within 0.2 s"
            with pytest.raises(TimeoutError, match=re.escape(expected)) as info:
                await asyncio.wait_for(endpoint.query(("127.0.0.1", port), b"?", timeout=0.2), 5)
    finally:
        silent.close()
    assert type(info.value) is TimeoutError  # what `except TimeoutError` has always caught
    assert isinstance(info.value.__cause__, TimeoutError)
