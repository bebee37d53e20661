"""What a newcomer gets wrong in the public API is refused at once, with a message
that names the fix: a str where a sequence or an address belongs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import rudp
from rudp.errors import check_address, check_sequence
from rudp.lan.aio import discover
from rudp.netsim.conditioner import LinkProfile
from rudp.netsim.proxy import start_proxy


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
