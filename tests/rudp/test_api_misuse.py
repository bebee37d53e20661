"""What a newcomer gets wrong in the public API is refused at once, with a message
that names the fix: a str where a sequence or an address belongs."""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import socket
import time
import warnings
from collections.abc import AsyncIterator, Callable
from fractions import Fraction
from typing import Any

import pytest

import rudp
from rudp.connection import State
from rudp.errors import check_address, check_sequence
from rudp.events import Disconnected, DisconnectReason
from rudp.lan.aio import discover
from rudp.netsim.conditioner import LinkProfile
from rudp.netsim.proxy import start_proxy
from tests.rudp.harness import pair as core_pair
from tests.rudp.harness import server_conn


async def hold(conn: rudp.Connection) -> None:
    await conn.wait_closed()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[rudp.Server, rudp.Connection]]:
    async with await rudp.serve(hold, "127.0.0.1", 0) as server:
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        yield server, conn
        await asyncio.wait_for(conn.close(), 5)


# -- a str where a sequence belongs ---------------------------------------------------------


@pytest.mark.parametrize("deps", ["spawn", b"spawn", bytearray(b"spawn")])
@pytest.mark.parametrize("delivery", [None, rudp.Delivery.DEPENDENCY_ORDERED])
async def test_depends_on_a_str_is_a_type_error_and_sends_nothing(
    pair: tuple[rudp.Server, rudp.Connection], deps: Any, delivery: Any
) -> None:
    _, conn = pair
    with pytest.raises(TypeError, match=r"depends_on takes a sequence .*write \["):
        conn.send(b"kill", depends_on=deps, delivery=delivery)
    assert conn.queued == 0 and conn.stats.messages_sent == 0


async def test_depends_on_a_str_is_a_type_error_even_with_another_mode(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    _, conn = pair
    with pytest.raises(TypeError, match="depends_on"):
        conn.send(b"x", depends_on="x", delivery=rudp.Delivery.RELIABLE_ORDERED)  # type: ignore[arg-type]


async def test_depends_on_a_list_of_handles_still_works(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    _, conn = pair
    spawn = conn.send(b"spawn", delivery=rudp.Delivery.RELIABLE_UNORDERED)
    kill = conn.send(b"kill", depends_on=(spawn,))
    await asyncio.wait_for(kill, 5)
    assert kill.acked


def test_metrics_collector_refuses_a_str() -> None:
    from rudp.metrics import RudpCollector

    with pytest.raises(TypeError, match="endpoints"):
        RudpCollector("server", registry=None)  # type: ignore[arg-type]


async def test_discover_refuses_a_str_for_targets_and_for_one_target() -> None:
    with pytest.raises(TypeError, match="targets takes a sequence"):
        await discover(targets="127.0.0.1", broadcast=False, ipv6=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"targets takes a \(host, port\) tuple"):
        await discover(targets=["127.0.0.1:27961"], broadcast=False, ipv6=False)  # type: ignore[list-item]


# -- a str where an address belongs ---------------------------------------------------------


async def test_query_refuses_an_address_written_as_one_string(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, _ = pair
    with pytest.raises(TypeError, match=r"\(host, port\) tuple, not '127.0.0.1:9'"):
        await server.query("127.0.0.1:9", b"ping")  # type: ignore[arg-type]


async def test_connect_refuses_a_local_addr_written_as_one_string() -> None:
    with pytest.raises(TypeError, match="local_addr"):
        await rudp.connect("127.0.0.1", 9, local_addr="127.0.0.1")  # type: ignore[arg-type]


async def test_proxy_refuses_an_address_written_as_one_string() -> None:
    link = LinkProfile()
    with pytest.raises(TypeError, match="listen"):
        await start_proxy("127.0.0.1:0", ("127.0.0.1", 9), upstream=link, downstream=link)  # type: ignore[arg-type]


def test_the_checks_accept_what_the_api_documents() -> None:
    check_sequence([], "x")
    check_sequence((), "x")
    check_sequence(iter([1]), "x")
    check_address(("127.0.0.1", 1), "x")
    check_address(("::1", 1, 0, 0), "x")
    check_address(["127.0.0.1", 1], "x")
    for wrong in ("127.0.0.1", ("127.0.0.1",), (1, 2), None):
        with pytest.raises(TypeError):
            check_address(wrong, "x")


# -- asyncio habits: handlers and close() ---------------------------------------------------


def plain_handler(conn: rudp.Connection) -> None:
    conn.send(b"hi")


class PlainCallable:
    def __call__(self, conn: rudp.Connection) -> None:
        pass


class AsyncCallable:
    async def __call__(self, conn: rudp.Connection) -> None:
        await conn.wait_closed()


async def takes_world(world: object, conn: rudp.Connection) -> None:
    await conn.wait_closed()


@pytest.mark.parametrize("handler", [plain_handler, PlainCallable(), functools.partial(print)])
async def test_serve_refuses_a_plain_function_at_once(handler: Any) -> None:
    with pytest.raises(TypeError, match="async def"):
        await rudp.serve(handler, "127.0.0.1", 0)
    with pytest.raises(TypeError, match="async def"):
        await rudp.open_endpoint("127.0.0.1", handler=handler)


@pytest.mark.parametrize(
    "handler",
    [
        hold,
        AsyncCallable(),
        functools.partial(takes_world, None),
        lambda conn: takes_world(None, conn),
    ],
)
async def test_serve_takes_what_can_be_awaited(handler: Any) -> None:
    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        await asyncio.wait_for(conn.close(), 5)


async def closed_by_the_server(handler: Any) -> rudp.Disconnected:
    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        with pytest.raises(rudp.ConnectionClosed) as info:
            await asyncio.wait_for(conn.recv(), 5)
        ended = await asyncio.wait_for(conn.wait_closed(), 5)
        assert info.value.text == ended.text
        return ended


async def test_a_handler_that_returns_closes_its_connection_and_the_client_is_told() -> None:
    tasks: list[asyncio.Task[None]] = []

    async def spawn_and_return(conn: rudp.Connection) -> None:
        tasks.append(asyncio.create_task(hold(conn)))  # the asyncio.start_server habit

    ended = await closed_by_the_server(spawn_and_return)
    assert ended.reason is rudp.DisconnectReason.CLOSED and ended.by_peer
    assert ended.text == "server handler returned"
    await asyncio.wait_for(asyncio.gather(*tasks), 5)


async def test_a_handler_that_raises_or_returns_no_awaitable_says_so() -> None:
    async def fail(conn: rudp.Connection) -> None:
        raise ValueError("bug")

    assert (await closed_by_the_server(fail)).text == "server handler failed"
    not_awaitable = await closed_by_the_server(lambda conn: None)
    assert not_awaitable.text == "server handler is not a coroutine function"


async def test_a_handler_that_ends_cancelled_closes_its_connection() -> None:
    # It awaited something another task cancelled (a game room shut down): the
    # CancelledError ends the handler, and its connection with it.
    async def wait_for_room(conn: rudp.Connection) -> None:
        room = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(room.cancel)
        await room

    ended = await closed_by_the_server(wait_for_room)
    assert ended.reason is rudp.DisconnectReason.CLOSED and ended.by_peer
    assert ended.text == "server handler cancelled"


async def test_close_starts_at_once_even_when_not_awaited(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, conn = pair
    [accepted] = server.connections
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        conn.close(4000, "bye")  # not awaited
        assert conn.closed
    ended = await asyncio.wait_for(accepted.wait_closed(), 5)
    assert (ended.reason, ended.code, ended.text) == (rudp.DisconnectReason.CLOSED, 4000, "bye")
    mine = await asyncio.wait_for(conn.close(), 5)  # awaiting gives the Disconnected
    assert mine == conn.disconnected and mine.code == 4000


async def test_the_old_spellings_of_close_still_work_with_a_deprecation_warning(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, conn = pair
    [accepted] = server.connections
    with pytest.warns(DeprecationWarning, match="text="):
        closing = conn.close(7, reason="old")
    await asyncio.wait_for(closing, 5)
    with pytest.warns(DeprecationWarning, match="disconnected"):
        old = conn.close_reason
    assert old == conn.disconnected and old is not None and old.text == "old"
    assert (await asyncio.wait_for(accepted.wait_closed(), 5)).text == "old"


async def test_endpoint_close_starts_at_once_even_when_not_awaited() -> None:
    server = await rudp.serve(hold, "127.0.0.1", 0)
    conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        closing = server.close()  # not awaited
    ended = await asyncio.wait_for(conn.wait_closed(), 5)
    assert ended.by_peer and ended.reason is rudp.DisconnectReason.CLOSED
    await asyncio.wait_for(server.wait_closed(), 5)
    assert server.endpoint.is_closed and closing.done()


# Compiled (mypyc), a text that is not a str is refused by the call itself, in mypyc's
# words ("str object expected; got int"): a TypeError at once all the same.
CLOSE_TEXT_REFUSED = r"close text|str object expected"


@pytest.mark.parametrize(
    ("text", "error"), [(5, TypeError), (b"bytes", TypeError), ("bad \udcff byte", ValueError)]
)
async def test_a_close_text_that_cannot_be_sent_is_refused_at_once_and_the_close_still_works(
    pair: tuple[rudp.Server, rudp.Connection], text: Any, error: type[Exception]
) -> None:
    server, conn = pair
    [accepted] = server.connections
    conn.send(b"queued")  # the DISCONNECT waits for its ack
    with pytest.raises(error, match=CLOSE_TEXT_REFUSED):
        conn.close(text=text)
    assert not conn.closed
    assert (await asyncio.wait_for(accepted.recv(), 5)).data == b"queued"
    ended = await asyncio.wait_for(conn.close(4000, text="bye"), 5)
    assert (ended.code, ended.text) == (4000, "bye")
    assert (await asyncio.wait_for(accepted.wait_closed(), 5)).text == "bye"
    with pytest.raises(error, match=CLOSE_TEXT_REFUSED):  # refused after the end as well
        conn.close(text=text)


class AsyncCall:
    async def __call__(self, message: rudp.MessageReceived) -> None:
        pass


async def on_message(message: rudp.MessageReceived) -> None:
    pass


async def on_message_of(world: object, message: rudp.MessageReceived) -> None:
    pass


@pytest.mark.parametrize(
    "receiver", [on_message, AsyncCall(), functools.partial(on_message_of, object())]
)
async def test_set_receiver_refuses_an_async_def_at_once_and_messages_still_queue(
    pair: tuple[rudp.Server, rudp.Connection], receiver: Any
) -> None:
    server, conn = pair
    [accepted] = server.connections
    with pytest.raises(TypeError, match="async def"):
        accepted.set_receiver(receiver)
    await asyncio.wait_for(conn.send(b"kept"), 5)
    assert (await asyncio.wait_for(accepted.recv(), 5)).data == b"kept"
    got: list[bytes] = []
    accepted.set_receiver(lambda message: got.append(message.data))  # a plain callable
    await asyncio.wait_for(conn.send(b"handed"), 5)
    assert got == [b"handed"]


async def test_a_receiver_that_returns_an_awaitable_fails_as_one_that_raises(
    pair: tuple[rudp.Server, rudp.Connection], caplog: pytest.LogCaptureFixture
) -> None:
    # A lambda calling an async def looks like a plain callable: each message went to
    # a coroutine nobody awaited, acknowledged and lost without a word.
    server, conn = pair
    [accepted] = server.connections
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited"
        accepted.set_receiver(lambda message: on_message(message))
        await asyncio.wait_for(conn.send(b"lost?"), 5)
        ended = await asyncio.wait_for(accepted.wait_closed(), 5)
    assert ended.reason is rudp.DisconnectReason.CLOSED and not ended.by_peer
    assert any("receiver_failed" in r.getMessage() for r in caplog.records)


# -- refused at once, not later or never ----------------------------------------------------


async def test_a_handler_that_cannot_be_called_is_refused_where_it_is_set(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, _ = pair
    with pytest.raises(TypeError, match="on_query must be callable"):
        server.on_query = 5  # type: ignore[assignment]
    with pytest.raises(TypeError, match="must be callable"):
        server.on_foreign = 5  # type: ignore[assignment]
    with pytest.raises(TypeError, match="must be callable"):
        server.set_datagram_handler(0xB1, 5)  # type: ignore[arg-type]

    async def answer(payload: bytes, address: object) -> list[bytes]:
        return [payload]

    with pytest.raises(TypeError, match="async def"):
        server.on_query = answer  # type: ignore[assignment]
    with pytest.raises(TypeError, match="async def"):
        server.on_foreign = answer
    with pytest.raises(TypeError, match="async def"):
        server.set_datagram_handler(0xB1, answer)
    assert server.on_query is None and server.on_foreign is None
    server.on_query = None  # None is what turns them off
    server.set_datagram_handler(0xB1, None)


@pytest.mark.parametrize("channel", [1.5, None, "1"])
async def test_a_channel_that_is_not_an_int_is_a_type_error_and_sends_nothing(
    pair: tuple[rudp.Server, rudp.Connection], channel: Any
) -> None:
    _, conn = pair
    # Compiled (mypyc), the call itself refuses a non-int, in mypyc's words.
    with pytest.raises(TypeError, match=r"channel must be an int|int object expected"):
        conn.send(b"x", channel=channel)
    with pytest.raises(TypeError, match=r"channel must be an int|int object expected"):
        conn.send(b"x", channel=channel, delivery=rudp.Delivery.RELIABLE_UNORDERED)
    assert conn.queued == 0 and conn.stats.messages_sent == 0


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (None, ValueError),
        (-1, ValueError),
        (0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
    ],
)
async def test_a_query_timeout_that_is_not_a_positive_number_is_refused_at_once(
    pair: tuple[rudp.Server, rudp.Connection], timeout: Any, error: type[Exception]
) -> None:
    server, _ = pair
    server.on_query = lambda payload, address: b"answer"
    with pytest.raises(error, match="timeout"):
        # At once: bounded far below any wait the timeout could have meant.
        await asyncio.wait_for(server.query(server.address, b"q", timeout=timeout), 5)
    reply, _ = await asyncio.wait_for(server.query(server.address, b"q", timeout=5), 5)
    assert reply == b"answer"


@pytest.mark.parametrize("timeout", [5, 5.0, Fraction(5, 1)])
async def test_a_query_timeout_may_be_any_real_number(
    pair: tuple[rudp.Server, rudp.Connection], timeout: Any
) -> None:
    server, _ = pair
    server.on_query = lambda payload, address: b"answer"
    reply, _ = await asyncio.wait_for(server.query(server.address, b"q", timeout=timeout), 5)
    assert reply == b"answer"


async def test_connect_refuses_a_config_that_is_not_a_config_and_port_0_at_once(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, _ = pair
    with pytest.raises(TypeError, match=r"rudp\.Config, not dict"):
        await asyncio.wait_for(rudp.connect(*server.address, config={}), 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rudp\.Config"):
        await asyncio.wait_for(rudp.serve(hold, "127.0.0.1", 0, config={}), 5)  # type: ignore[arg-type]
    # Nothing listens on port 0: it would retry until ConnectTimeout.
    with pytest.raises(ValueError, match="port 0"):
        await asyncio.wait_for(rudp.connect("127.0.0.1", 0), 1)
    with pytest.raises(ValueError, match="port 0"):
        await asyncio.wait_for(server.connect("127.0.0.1", 0), 1)


# -- a port that is not an int, a port in use, a reliable that is not a bool ----------------


@pytest.mark.parametrize("port", ["9000", 9000.0, None, True])
async def test_a_port_that_is_not_an_int_is_a_type_error_naming_the_parameter(
    pair: tuple[rudp.Server, rudp.Connection], port: Any
) -> None:
    server, _ = pair
    with pytest.raises(TypeError, match=r"^port takes an int, not "):
        await asyncio.wait_for(rudp.connect("127.0.0.1", port), 5)
    with pytest.raises(TypeError, match=r"^port takes an int, not "):
        await asyncio.wait_for(rudp.serve(hold, "127.0.0.1", port), 5)
    with pytest.raises(TypeError, match=r"^port takes an int, not "):
        await asyncio.wait_for(rudp.open_endpoint("127.0.0.1", port), 5)
    with pytest.raises(TypeError, match=r"^port takes an int, not "):
        await asyncio.wait_for(server.connect("127.0.0.1", port), 5)
    with pytest.raises(TypeError, match=r"^local_addr port takes an int"):
        await asyncio.wait_for(rudp.connect(*server.address, local_addr=("127.0.0.1", port)), 5)
    with pytest.raises(TypeError, match=r"^query\(\) address port takes an int"):
        await asyncio.wait_for(server.query(("127.0.0.1", port), b"q"), 5)
    with pytest.raises(TypeError, match=r"^port takes an int"):
        await discover(port, broadcast=False, ipv6=False, timeout=0.01)
    with pytest.raises(TypeError, match=r"targets' port takes an int"):
        await discover(targets=[("127.0.0.1", port)], broadcast=False, ipv6=False, timeout=0.01)
    link = LinkProfile()
    with pytest.raises(TypeError, match=r"^target port takes an int"):
        await start_proxy(("127.0.0.1", 0), ("127.0.0.1", port), upstream=link, downstream=link)


async def test_serve_on_a_port_in_use_names_the_address_and_keeps_the_errno(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, _ = pair
    host, port = server.address
    with pytest.raises(OSError, match=rf"cannot bind 127\.0\.0\.1:{port}: ") as caught:
        await asyncio.wait_for(rudp.serve(hold, host, port), 5)
    assert caught.value.errno == errno.EADDRINUSE and type(caught.value) is OSError
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}") as caught:
        await asyncio.wait_for(rudp.open_endpoint(host, port), 5)
    assert caught.value.errno == errno.EADDRINUSE
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}") as caught:
        await asyncio.wait_for(rudp.connect(host, port, local_addr=(host, port)), 5)
    assert caught.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize("reliable", ["no", "", 0, 1, None])
@pytest.mark.parametrize("delivery", [None, rudp.Delivery.RELIABLE_UNORDERED])
async def test_a_reliable_that_is_not_a_bool_is_a_type_error_and_sends_nothing(
    pair: tuple[rudp.Server, rudp.Connection], reliable: Any, delivery: Any
) -> None:
    _, conn = pair
    # Compiled (mypyc), the core's call itself refuses a non-bool, in mypyc's words.
    with pytest.raises(TypeError, match=r"reliable must be True or False|bool object expected"):
        conn.send(b"x", reliable=reliable, delivery=delivery)
    assert conn.queued == 0 and conn.stats.messages_sent == 0
    await asyncio.wait_for(conn.send(b"x", reliable=True, delivery=delivery), 5)


@pytest.mark.parametrize(
    "host", [("127.0.0.1", 5000), b"127.0.0.1", None, ipaddress.ip_interface("127.0.0.1/8")]
)
async def test_a_host_that_is_not_a_str_is_a_type_error_naming_it(
    pair: tuple[rudp.Server, rudp.Connection], host: Any
) -> None:
    # getaddrinfo takes None as the loopback address and bytes as a name: the
    # connection went where the caller did not mean (or a TypeError named nothing).
    server, _ = pair
    with pytest.raises(TypeError, match=r"^host must be a str \(a name or an IP address\), got "):
        await asyncio.wait_for(rudp.connect(host, server.address[1]), 5)
    with pytest.raises(TypeError, match=r"^host must be a str"):
        await asyncio.wait_for(server.connect(host, server.address[1]), 5)
    if host is not None:  # None binds every address: documented
        with pytest.raises(TypeError, match=r"^host must be a str"):
            await asyncio.wait_for(rudp.open_endpoint(host, 0), 5)


@pytest.mark.parametrize(
    ("host", "hint"),
    [
        ("127.0.0.1:5000", "the port is its own argument: host '127.0.0.1', port 5000"),
        ("game.example:27960", "the port is its own argument: host 'game.example', port 27960"),
        ("[::1]", "an IPv6 address goes without brackets"),
        ("[::1]:27960", "the port is its own argument: host '::1', port 27960"),
        ("game.example", None),
    ],
)
async def test_a_host_that_does_not_resolve_is_named_with_what_it_may_have_meant(
    monkeypatch: pytest.MonkeyPatch, host: str, hint: str | None
) -> None:
    # No name lookup leaves the machine: the loop's resolver fails as a resolver would.
    async def unknown(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", unknown)
    with pytest.raises(socket.gaierror) as caught:
        await asyncio.wait_for(rudp.connect(host, 5000), 5)
    text = str(caught.value)
    assert f"cannot resolve {host!r}: Name or service not known" in text
    assert caught.value.errno == socket.EAI_NONAME
    assert (hint in text) if hint is not None else "(" not in text


@pytest.mark.parametrize("code", [1.5, "1", None])
async def test_a_close_code_that_is_not_an_int_is_a_type_error_and_the_connection_stays(
    pair: tuple[rudp.Server, rudp.Connection], code: Any
) -> None:
    # A float passed the range check and left the connection CLOSING for good.
    # (Compiled, the call itself refuses a non-int, in mypyc's words.)
    _, conn = pair
    with pytest.raises(TypeError, match=r"^close code must be an int, not |int object expected"):
        conn.close(code=code)
    assert not conn.closed
    assert (await asyncio.wait_for(conn.send(b"still open"), 5)) is None
    ended = await asyncio.wait_for(conn.close(code=3), 5)
    assert ended.code == 3


@pytest.mark.skipif(rudp.compiled, reason="compiled, mypyc takes a bool for an int at the call")
async def test_a_bool_channel_or_close_code_is_a_type_error_and_the_connection_stays(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    # A bool is an int: channel=True went out on channel 1, close(code=True) as code 1.
    _, conn = pair
    with pytest.raises(TypeError, match=r"^channel must be an int, not bool$"):
        conn.send(b"x", channel=True)
    with pytest.raises(TypeError, match=r"^channel must be an int, not bool$"):
        conn.send(b"x", reliable=False, channel=False)
    with pytest.raises(TypeError, match=r"^channel must be an int, not bool$"):
        conn.send(b"x", channel=True, delivery=rudp.Delivery.RELIABLE_UNORDERED)
    assert conn.queued == 0 and conn.stats.messages_sent == 0
    with pytest.raises(TypeError, match=r"^close code must be an int, not bool: True$"):
        conn.close(code=True)
    assert not conn.closed
    ended = await asyncio.wait_for(conn.close(code=1), 5)
    assert ended.code == 1


async def test_a_connection_refuses_calls_from_another_event_loop(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    # From another thread's loop send() went through (touching the core from the
    # wrong thread) and recv() failed late, leaving its waiter behind.
    _, conn = pair
    outcomes: dict[str, str] = {}
    handle = conn.send(b"acknowledged here")
    await asyncio.wait_for(handle, 5)

    async def elsewhere() -> None:
        calls: dict[str, Callable[[], Any]] = {
            "async for": lambda: asyncio.ensure_future(conn.__anext__()),
            "await handle": lambda: asyncio.ensure_future(handle),
            "send": lambda: conn.send(b"x"),
            "recv_nowait": conn.recv_nowait,
            "set_receiver": lambda: conn.set_receiver(None),
            "close": conn.close,
            "recv": lambda: asyncio.ensure_future(conn.recv()),
            "drain": lambda: asyncio.ensure_future(conn.drain()),
        }
        for name, call in calls.items():
            try:
                result = call()
                if isinstance(result, asyncio.Future):
                    await result
            except RuntimeError as exc:
                outcomes[name] = str(exc)
            else:
                outcomes[name] = "accepted"

    await asyncio.wait_for(asyncio.to_thread(asyncio.run, elsewhere()), 5)
    assert set(outcomes) == {
        "send", "recv_nowait", "set_receiver", "close", "recv", "drain", "async for",
        "await handle",
    }  # fmt: skip
    for name, text in outcomes.items():
        assert text.startswith("this connection belongs to the event loop it was opened on"), name
    assert not conn.closed and conn.queued == 0
    assert (await asyncio.wait_for(conn.send(b"here"), 5)) is None


@pytest.mark.parametrize("name", ["server_key", "token", "token_key"])
@pytest.mark.parametrize("value", ["ab" * 16, bytearray(32)], ids=["str", "bytearray"])
async def test_a_key_or_token_that_is_not_bytes_is_a_type_error_naming_it(
    pair: tuple[rudp.Server, rudp.Connection], name: str, value: Any
) -> None:
    # A str failed deep in the handshake ("can't concat str to bytes"), a bytearray
    # in cryptography, naming no argument.
    server, _ = pair
    given = {name: value}
    kind = type(value).__name__
    with pytest.raises(TypeError, match=rf"^{name} must be bytes, not {kind}$"):
        await asyncio.wait_for(rudp.connect(*server.address, **given), 5)
    with pytest.raises(TypeError, match=rf"^{name} must be bytes, not {kind}$"):
        await asyncio.wait_for(server.connect(*server.address, **given), 5)


async def test_an_ip_address_object_is_taken_as_a_host(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, _ = pair
    conn = await asyncio.wait_for(
        rudp.connect(ipaddress.ip_address("127.0.0.1"), server.address[1]), 5
    )
    await asyncio.wait_for(conn.close(), 5)
    async with await rudp.open_endpoint(ipaddress.ip_address("127.0.0.1"), 0) as endpoint:
        assert endpoint.address[0] == "127.0.0.1"


async def test_a_connection_refuses_a_plain_thread_while_its_loop_runs(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    # No loop runs in that thread, but the connection's does, in another: neither
    # the core nor call_soon may be touched from there.
    _, conn = pair

    def from_a_thread() -> str:
        try:
            conn.send(b"x")
        except RuntimeError as exc:
            return str(exc)
        return "accepted"

    said = await asyncio.wait_for(asyncio.to_thread(from_a_thread), 5)
    assert said.startswith("this connection belongs to the event loop it was opened on")
    assert conn.queued == 0


def test_a_connection_is_used_between_two_runs_of_its_own_loop() -> None:
    # With no loop running, a call from the loop's own thread goes on (as before the
    # check for calls from another loop).
    async def hold(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    loop = asyncio.new_event_loop()
    try:
        server = loop.run_until_complete(rudp.serve(hold, "127.0.0.1", 0))
        conn = loop.run_until_complete(rudp.connect(*server.address))
        handle = conn.send(b"between two runs")
        loop.run_until_complete(asyncio.wait_for(handle, 5))
        ended = loop.run_until_complete(asyncio.wait_for(conn.close(), 5))
        assert conn.close() is not None and ended.reason == "closed"

        async def stop() -> None:
            await server.close()

        loop.run_until_complete(asyncio.wait_for(stop(), 5))
    finally:
        loop.close()


async def test_open_endpoint_refuses_a_socket_it_cannot_serve_on() -> None:
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unbound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(ValueError, match=r"^sock must be a UDP socket \(SOCK_DGRAM, IPv4"):
            await rudp.open_endpoint(sock=unix)
        with pytest.raises(ValueError, match=r"^sock must be bound"):
            await rudp.open_endpoint(sock=unbound)
        with pytest.raises(TypeError, match=r"^sock must be a socket\.socket, not int"):
            await rudp.open_endpoint(sock=5)  # type: ignore[arg-type]
    finally:
        unix.close()
        unbound.close()


async def test_a_receiver_or_first_byte_of_the_wrong_type_is_a_type_error(
    pair: tuple[rudp.Server, rudp.Connection],
) -> None:
    server, conn = pair
    with pytest.raises(TypeError, match=r"^receiver must be callable, got 5"):
        conn.set_receiver(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^first_byte must be an int, not str"):
        server.set_datagram_handler("x", lambda data, address: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^first_byte must be an int, not bool"):
        server.set_datagram_handler(True, lambda data, address: None)  # type: ignore[arg-type]


async def test_an_endpoint_connecting_to_its_own_address_is_refused_at_once() -> None:
    # Its CONNECTs came back to itself: "no answer" after connect_timeout (5 s).
    async with await rudp.open_endpoint("127.0.0.1", 0) as endpoint:
        port = endpoint.address[1]
        with pytest.raises(ValueError, match=rf"^cannot connect to 127\.0\.0\.1:{port}: it is "):
            await asyncio.wait_for(endpoint.connect("127.0.0.1", port), 1)
    async with await rudp.open_endpoint("0.0.0.0", 0) as everywhere:
        port = everywhere.address[1]
        with pytest.raises(ValueError, match="this endpoint's own address"):
            await asyncio.wait_for(everywhere.connect("127.0.0.2", port), 1)
        async with await rudp.serve(hold, "127.0.0.1", 0) as other:  # another port: fine
            conn = await asyncio.wait_for(everywhere.connect(*other.address), 5)
            await asyncio.wait_for(conn.close(), 5)


# -- the sans-IO core's clock and delivery arguments ----------------------------------------


@pytest.mark.parametrize("bad", [time.monotonic, "12.5", True])
def test_a_clock_reading_that_is_not_a_number_is_refused_by_send_and_close(bad: object) -> None:
    # send(now=time.monotonic) was stored with the message and broke every later flush
    # of the endpoint; close(None) raised only after the state had changed.
    if bad is True and rudp.compiled:
        pytest.skip("compiled, mypyc takes a bool for a float at the call")
    net, server, client, conn = core_pair()
    with pytest.raises(TypeError, match=r"now takes a float|float (or None )?object expected"):
        conn.send(b"x", reliable=False, now=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"now takes a float|float (or None )?object expected"):
        conn.close(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"now takes a float|float (or None )?object expected"):
        client.endpoint.close(bad)  # type: ignore[arg-type]
    assert conn.state is State.CONNECTED and conn.queued == 0
    assert not client.endpoint.refusing
    sconn = server_conn(server)
    sconn.pause_receiving()
    with pytest.raises(TypeError, match=r"now takes a float|float (or None )?object expected"):
        sconn.resume_receiving(bad)  # type: ignore[arg-type]
    assert sconn.receiving_paused  # unchanged: a retry with a good clock resumes
    sconn.resume_receiving(net.now)
    conn.send(b"after", reliable=False, now=net.now)
    net.run(0.5)
    assert server.received() == [b"after"]
    conn.close(net.now)
    net.run_until(lambda: conn.state is State.CLOSED, timeout=5)
    assert client.disconnects() == [Disconnected(DisconnectReason.CLOSED)]


@pytest.mark.parametrize("delivery", [True, 1.0, "RELIABLE_ORDERED"])
async def test_a_delivery_that_is_not_a_mode_is_a_type_error(
    pair: tuple[rudp.Server, rudp.Connection], delivery: object
) -> None:
    # Delivery(True) and Delivery(1.0) are RELIABLE_ORDERED: both were taken as it.
    if delivery is True and rudp.compiled:
        pytest.skip("compiled, mypyc takes a bool for an int at the call")
    _, conn = pair
    with pytest.raises(TypeError, match=r"delivery takes a rudp.Delivery|expected"):
        conn.send(b"x", delivery=delivery)  # type: ignore[arg-type]
    assert conn.queued == 0 and conn.stats.messages_sent == 0
    assert (await asyncio.wait_for(conn.send(b"x", delivery=1), 5)) is None
