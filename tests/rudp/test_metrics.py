from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from rudp.metrics import RudpCollector


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
