"""What a list client that never acknowledges can make the daemon hold: the
service over the in-memory fake transport, acknowledgements held back by hand."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Generator
from typing import Any

from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient, MatchmakerError
from matchmaker.messages import (
    Error,
    ErrorReason,
    ListFilter,
    ListPage,
    ListRequest,
    Message,
    decode,
)
from tests.matchmaker.fakes import FakeConnection, Wire, pipe, settle
from tests.matchmaker.helpers import Harness, info, pub


async def listed(h: Harness, hosts: int) -> None:
    for i in range(hosts):
        await h.registry.upsert(Address(pub(i + 1), 1), info(), max_per_ip=10)


def deaf(wire: Wire) -> FakeConnection:
    """The daemon's side of `wire`, whose pages stay unacknowledged until the test says."""
    server_side = wire.conn.other
    assert server_side is not None
    server_side.manual_acks = True
    return server_side


def ask(wire: Wire, requests: int) -> None:
    for rid in range(1, requests + 1):
        wire.send(ListRequest(request_id=rid, filter=ListFilter(game="q3")))


def received(wire: Wire) -> list[Message]:
    """What reached the client so far."""
    out = []
    while not wire.conn.inbox.empty():
        data = wire.conn.inbox.get_nowait()
        assert data is not None, "connection closed"
        out.append(decode(data))
    return out


def budget_free(h: Harness) -> int:
    free: int = h.service.list_budget.free
    return free


def out_bytes(server_side: FakeConnection, sizes: dict[int, int]) -> int:
    return sum(sizes[id(f)] for f in server_side.unacked)


def sizing(server_side: FakeConnection) -> dict[int, int]:
    """Each unacknowledged page's size, by its acknowledgement's id."""
    sizes: dict[int, int] = {}
    send = server_side.send

    def send_sized(data: bytes, **kw: Any) -> Awaitable[None]:
        ack = send(data, **kw)
        sizes[id(ack)] = len(data)
        return ack

    server_side.send = send_sized  # type: ignore[method-assign]
    return sizes


async def ack_all(server_side: FakeConnection) -> None:
    """Acknowledge every page, those the acknowledgements let out too (bounded)."""
    for _ in range(10_000):
        if not server_side.unacked:
            return
        server_side.unacked.pop(0).set_result(None)
        await settle()
    raise AssertionError("pages kept coming")


async def test_a_deaf_connection_holds_one_answer_and_a_few_requests() -> None:
    # Ten requests (within the rate limit) from a client that acknowledges
    # nothing: every page of every answer used to be queued at once (500 here,
    # up to rudp's 65,536-message send queue); now one answer is out, three wait
    # as requests, and the rest are refused.
    h = Harness(page_hosts=1)
    await listed(h, 50)
    wire = h.connect(pub(100))
    server_side = deaf(wire)
    ask(wire, 10)
    await settle()
    replies = received(wire)
    pages = [m for m in replies if isinstance(m, ListPage)]
    errors = [m for m in replies if isinstance(m, Error)]
    assert len(pages) == 50  # the first answer's pages, no more
    assert {p.request_id for p in pages} == {1}
    assert len(server_side.unacked) == len(pages) + len(errors)
    assert [(e.reason, e.request_id) for e in errors] == [
        (ErrorReason.RATE_LIMITED, rid) for rid in range(5, 11)
    ]
    assert errors[0].detail == "lists: 4 unanswered on this connection"
    assert h.sample("matchmaker_list_requests_total", result="busy") == 6
    assert h.sample("matchmaker_list_requests_total", result="ok") == 0
    assert h.sample("matchmaker_list_hosts_sent_total") == 0
    # Acknowledged, the waiting ones are answered in turn, in full.
    await ack_all(server_side)
    pages = [m for m in received(wire) if isinstance(m, ListPage)]
    assert [p.request_id for p in pages if p.end] == [2, 3, 4]
    assert len(pages) == 3 * 50
    assert h.sample("matchmaker_list_requests_total", result="ok") == 4
    assert h.sample("matchmaker_list_hosts_sent_total") == 4 * 50
    assert budget_free(h) == h.settings.list_bytes_in_flight


async def test_a_list_counts_as_sent_once_every_page_is_acknowledged() -> None:
    h = Harness(page_hosts=1)
    await listed(h, 5)
    wire = h.connect(pub(100))
    server_side = deaf(wire)
    ask(wire, 1)
    await settle()
    assert wire.pending() == 5  # every page handed to the transport
    assert h.sample("matchmaker_list_requests_total", result="ok") == 0
    assert h.sample("matchmaker_list_hosts_sent_total") == 0
    for ack in server_side.unacked[:-1]:
        ack.set_result(None)
    await settle()
    assert h.sample("matchmaker_list_requests_total", result="ok") == 0
    server_side.unacked[-1].set_result(None)
    await settle()
    assert h.sample("matchmaker_list_requests_total", result="ok") == 1
    assert h.sample("matchmaker_list_hosts_sent_total") == 5
    assert h.sample("matchmaker_list_request_duration_seconds_count") == 1


async def test_unacknowledged_pages_of_every_connection_share_one_budget() -> None:
    h = Harness(page_hosts=1, list_bytes_in_flight=4096)
    await listed(h, 100)  # ~9.6 KB of pages per answer
    first, second = h.connect(pub(200)), h.connect(pub(201))
    first_side, second_side = deaf(first), deaf(second)
    first_sizes, second_sizes = sizing(first_side), sizing(second_side)
    ask(first, 1)
    await settle()
    ask(second, 1)
    await settle()
    held = out_bytes(first_side, first_sizes)
    assert 4096 - 200 < held <= 4096  # full, to within a page (~100 bytes here)
    assert len(first_side.unacked) < 100
    assert second_side.unacked == []  # nothing left for it
    assert budget_free(h) == 4096 - held
    # The first connection's acknowledgements make room for the second's pages.
    first_side.unacked.pop(0).set_result(None)
    first_side.unacked.pop(0).set_result(None)
    await settle()
    assert second_side.unacked != []
    both = out_bytes(first_side, first_sizes) + out_bytes(second_side, second_sizes)
    assert both <= 4096
    assert budget_free(h) == 4096 - both
    # Every answer still arrives whole.
    for _ in range(1000):
        if not (first_side.unacked or second_side.unacked):
            break
        for side in (first_side, second_side):
            if side.unacked:
                side.unacked.pop(0).set_result(None)
        await settle()
    assert h.sample("matchmaker_list_requests_total", result="ok") == 2
    assert budget_free(h) == 4096


async def test_a_connection_that_acknowledges_nothing_is_closed() -> None:
    h = Harness(page_hosts=1, list_ack_timeout=0.01)
    await listed(h, 20)
    wire = h.connect(pub(100))
    deaf(wire)
    ask(wire, 3)
    await asyncio.wait_for(wire.task, 5.0)  # the daemon closed it
    assert h.sample("matchmaker_list_requests_total", result="unacknowledged") == 1
    assert h.sample("matchmaker_list_requests_total", result="failed") == 2
    assert h.sample("matchmaker_list_requests_total", result="ok") == 0
    assert budget_free(h) == h.settings.list_bytes_in_flight


class _Handle:
    """An acknowledgement that is only awaitable, as rudp's send handle is."""

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, None]:
        return self._future.__await__()


async def test_closing_a_connection_with_pages_queued_leaves_no_unretrieved_exception() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        h = Harness(page_hosts=1)
        await listed(h, 30)
        wire = h.connect(pub(100))
        server_side = deaf(wire)
        send = server_side.send

        def send_handle(data: bytes, **kw: Any) -> Awaitable[None]:
            future = send(data, **kw)
            assert isinstance(future, asyncio.Future)
            return _Handle(future)

        server_side.send = send_handle  # type: ignore[method-assign]
        ask(wire, 1)
        await settle()
        assert len(server_side.unacked) == 30
        await h.service.close_all()  # the daemon stops: every queued page fails
        await asyncio.wait_for(wire.task, 5.0)
        await settle()
        gc.collect()
        await settle()
    finally:
        loop.set_exception_handler(previous)
    assert [c.get("message") for c in reported] == []
    assert h.sample("matchmaker_list_requests_total", result="failed") == 1


async def test_the_stock_client_runs_a_few_lists_at_once_on_one_connection() -> None:
    h = Harness(page_hosts=2)
    await listed(h, 60)
    tasks: list[asyncio.Task[None]] = []

    async def connect() -> FakeConnection:
        server_side, client_side = pipe((pub(200), 27960))
        tasks.append(asyncio.create_task(h.service.handle(server_side)))
        return client_side

    mm = MatchmakerClient(connect)
    try:
        await mm.info()  # one connection, for every list below
        lists = [mm.list_servers(game="q3", limit=50 - i) for i in range(4)]
        answers = await asyncio.gather(*lists)
        assert [len({e.address for e in a}) for a in answers] == [50, 49, 48, 47]
        with_more = [mm.list_servers(game="q3") for _ in range(5)]
        outcomes = await asyncio.gather(*with_more, return_exceptions=True)
    finally:
        await mm.close()
        await asyncio.gather(*tasks)
    refused = [o for o in outcomes if isinstance(o, MatchmakerError)]
    assert [len(o) for o in outcomes if not isinstance(o, BaseException)] == [60] * 4
    assert [e.reason for e in refused] == [ErrorReason.RATE_LIMITED]
    assert len(tasks) == 1
    assert h.sample("matchmaker_list_requests_total", result="ok") == 8
    assert h.sample("matchmaker_list_requests_total", result="busy") == 1


async def test_a_client_that_has_a_whole_answer_may_ask_again_before_acknowledging_it() -> None:
    # One list at a time (--lists-per-connection 1): the client gets every page of an
    # answer and asks again before its acknowledgment of the last page is back. That
    # request used to be refused (the answer still counted as unanswered): every other
    # call of a client that lists one call at a time failed over real rudp.
    h = Harness(page_hosts=1, lists_per_connection=1)
    await listed(h, 5)
    wire = h.connect(pub(100))
    server_side = deaf(wire)
    ask(wire, 1)
    await settle()
    assert len([m for m in received(wire) if isinstance(m, ListPage)]) == 5
    wire.send(ListRequest(request_id=2, filter=ListFilter(game="q3")))
    await settle()
    assert not [m for m in received(wire) if isinstance(m, Error)]  # taken, waiting
    assert h.sample("matchmaker_list_requests_total", result="busy") == 0
    wire.send(ListRequest(request_id=3, filter=ListFilter(game="q3")))
    await settle()
    (refused,) = [m for m in received(wire) if isinstance(m, Error)]
    assert refused.request_id == 3 and refused.reason is ErrorReason.RATE_LIMITED
    await ack_all(server_side)
    pages = [m for m in received(wire) if isinstance(m, ListPage)]
    assert [p.request_id for p in pages if p.end] == [2]
    assert h.sample("matchmaker_list_requests_total", result="ok") == 2
