from __future__ import annotations

import asyncio
import gc
import random
import socket
import weakref

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from rudp.config import Config
from rudp.endpoint import Endpoint
from rudp.metrics import RudpCollector
from rudp.stats import COUNTER_TABLE, ENDPOINT_COUNTER_TABLE, ConnectionStats


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_collector_reads_live_and_ended_connections() -> None:
    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)

    registry = CollectorRegistry()
    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        collector = RudpCollector([server], registry=registry)
        conn = await rudp.connect(*server.address)
        for i in range(25):
            conn.send(b"%d" % i)
            await asyncio.wait_for(conn.recv(), 5)
        garbage = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(7):
            garbage.sendto(b"\x00" * 40, server.address)
        garbage.close()
        while server.stats.datagrams_dropped < 7:
            await asyncio.sleep(0.01)
        live = scrape(registry)
        assert live[("rudp_connections", ())] == 1
        assert live[("rudp_messages_received_total", ())] == 25
        assert live[("rudp_datagrams_dropped_total", (("reason", "bad_checksum"),))] == 7
        assert live[("rudp_rtt_seconds_gcount", ())] == 1
        await conn.close()
        while server.connections:
            await asyncio.sleep(0.01)
        ended = scrape(registry)
        assert ended[("rudp_connections", ())] == 0
        # Counters of ended connections are kept: totals never go backwards.
        assert ended[("rudp_messages_received_total", ())] == 25
        assert (
            ended[("rudp_packets_received_total", ())] >= live[("rudp_packets_received_total", ())]
        )
        assert collector is not None


def test_collector_rejects_what_it_cannot_read() -> None:
    with pytest.raises(TypeError):
        RudpCollector([object()], registry=None)


def test_collector_reads_a_core_endpoint_added_directly() -> None:
    # Pure Python: held weakly; the mypyc-compiled core cannot be weakly referenced
    # and is held strongly instead. Either way it is read, and only once.
    registry = CollectorRegistry()
    endpoint = Endpoint(Config(), now=0.0, rng=random.Random(1), accept=True)
    endpoint.receive_datagram(b"\x00" * 40, ("127.0.0.1", 9), 0.0)
    collector = RudpCollector([endpoint, endpoint], registry=registry)
    collector.add(endpoint)
    scraped = scrape(registry)
    assert scraped[("rudp_datagrams_received_total", ())] == 1
    assert scraped[("rudp_datagrams_dropped_total", (("reason", "bad_checksum"),))] == 1


def test_every_counter_in_the_tables_is_exported_with_its_value() -> None:
    registry = CollectorRegistry()
    endpoint = Endpoint(Config(), now=0.0, rng=random.Random(1), accept=True)
    for i, (attr, _, _) in enumerate(ENDPOINT_COUNTER_TABLE):
        setattr(endpoint.stats, attr, 100 + i)
    RudpCollector([endpoint], registry=registry)
    scraped = scrape(registry)
    for i, (_, _, metric) in enumerate(ENDPOINT_COUNTER_TABLE):
        assert scraped[(metric, ())] == 100 + i, metric
    for i, (attr, _, metric) in enumerate(COUNTER_TABLE):
        assert hasattr(ConnectionStats(), attr), attr
        if metric:
            endpoint.stats.closed_totals[attr] = 7 + i
    scraped = scrape(registry)
    for i, (_, _, metric) in enumerate(COUNTER_TABLE):
        if metric:
            assert scraped[(metric, ())] == 7 + i, metric


async def test_collector_does_not_keep_a_server_alive() -> None:
    # The compiled AioEndpoint cannot be weakly referenced; its MetricsHandle can, and
    # only the endpoint holds it: it is freed when, and only when, the endpoint is.
    server = await rudp.serve(lambda conn: asyncio.sleep(0), "127.0.0.1", 0)
    collector = RudpCollector([server], registry=None)
    await server.close()
    await asyncio.sleep(0)  # a flush still scheduled holds the endpoint until it runs
    ref = weakref.ref(server.endpoint.metrics_handle)
    del server
    gc.collect()
    assert ref() is None
    assert repr(collector) == "<RudpCollector endpoints=0>"
    assert list(collector.collect())  # every family is still there, with no endpoint


async def test_a_closed_endpoint_counts_until_it_is_dropped_then_leaves() -> None:
    """A server's counters stay in the collector while the server is held, closed or
    not (totals never go backwards under a scrape); once it is dropped they leave, and
    what another endpoint counts is unchanged."""

    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)

    registry = CollectorRegistry()
    collector = RudpCollector(registry=registry)
    kept = await rudp.serve(echo, "127.0.0.1", 0)
    dropped = await rudp.serve(echo, "127.0.0.1", 0)
    collector.add(kept)
    collector.add(dropped)
    collector.add(dropped)  # once only
    for server, n in ((kept, 3), (dropped, 5)):
        conn = await rudp.connect(*server.address)
        for i in range(n):
            conn.send(b"%d" % i)
            await asyncio.wait_for(conn.recv(), 5)
        await conn.close()
    assert repr(collector) == "<RudpCollector endpoints=2>"
    assert scrape(registry)[("rudp_messages_received_total", ())] == 8
    await dropped.close()
    assert scrape(registry)[("rudp_messages_received_total", ())] == 8
    await asyncio.sleep(0)  # a flush still scheduled holds the endpoint until it runs
    del dropped, server
    gc.collect()
    assert repr(collector) == "<RudpCollector endpoints=1>"
    assert scrape(registry)[("rudp_messages_received_total", ())] == 3
    await kept.close()


async def test_a_full_send_buffer_says_so_in_the_stats_and_the_metrics() -> None:
    from rudp.aio.endpoint import SEND_BUFFER_LIMIT

    server = await rudp.serve(lambda conn: conn.wait_closed(), "127.0.0.1", 0)
    try:
        registry = CollectorRegistry()
        RudpCollector([server], registry=registry)
        endpoint = server.endpoint
        # What the flush does while the socket would block: buffer, up to the limit.
        for _ in range(SEND_BUFFER_LIMIT + 3):
            endpoint._buffer(b"x", ("127.0.0.1", 9))
        assert server.stats.send_buffer_drops == 3 == endpoint.send_buffer_drops
        assert scrape(registry)[("rudp_send_buffer_drops_total", ())] == 3
    finally:
        endpoint._send_buffer.clear()
        await server.close()
