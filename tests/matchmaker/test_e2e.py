"""End to end over real rudp sockets on loopback: daemon, client library, HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from matchmaker import __version__
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient, MatchmakerUnreachable
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import (
    HOST,
    RedisProcess,
    accepting_endpoint,
    eventually,
    free_port,
    settings,
)


async def http_get(address: tuple[str, int], target: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_register_list_introduce_join(daemon: Matchmaker) -> None:
    mm_host, mm_port = daemon.udp_address
    game, game_accepted = await accepting_endpoint()
    joiner_ep, _ = await accepting_endpoint()
    host = MatchmakerClient.to(mm_host, mm_port, via=game)
    joiner = MatchmakerClient.to(mm_host, mm_port, via=joiner_ep)
    try:
        address = await host.register(**HOST, lan=("127.0.0.1", game.address[1]))
        assert address == Address("127.0.0.1", game.address[1])  # the game port itself
        listed = await joiner.list_servers(game="q3")
        assert [e.address for e in listed] == [address]

        intro = await joiner.introduce(address)
        to_host = await asyncio.wait_for(host.introductions.get(), 5)
        assert to_host.peer == Address("127.0.0.1", joiner_ep.address[1])
        assert to_host.nonce == intro.nonce and intro.peer_lan is not None
        # What a NAT punch amounts to on loopback: both sides connect out.
        conn = await joiner_ep.connect(intro.peer.ip, intro.peer.port)
        await conn.send(intro.nonce)
        inbound = await asyncio.wait_for(game_accepted.get(), 5)
        assert (await asyncio.wait_for(inbound.recv(), 5)).data == intro.nonce
        await conn.close()

        status, body = await http_get(daemon.http_address, "/servers?game=q3")
        assert status == 200 and json.loads(body)["total"] == 1
        assert (await http_get(daemon.http_address, "/readyz"))[0] == 200
        _, metrics = await http_get(daemon.http_address, "/metrics")
        names = {f.name for f in text_string_to_metric_families(metrics.decode())}
        assert {"matchmaker_registrations", "matchmaker_hosts_listed"} <= names

        await host.close()
        await eventually(lambda: daemon.registry.get(address) is None)
    finally:
        await host.close()
        await joiner.close()
        await game.close()
        await joiner_ep.close()


async def test_host_reregisters_after_matchmaker_restart() -> None:
    first = Matchmaker(settings())
    await first.start()
    port = first.udp_address[1]
    game, _ = await accepting_endpoint()
    host = MatchmakerClient.to("127.0.0.1", port, via=game, reconnect_delay=0.05)
    second: Matchmaker | None = None
    try:
        address = await host.register(**HOST)
        await first.shutdown()  # graceful: the host's connection is closed
        second = Matchmaker(settings(port=port))
        await second.start()
        registry = second.registry
        # The Registered reply reaches the client just after the entry exists.
        await eventually(lambda: registry.get(address) is not None and host.registrations == 2, 15)
    finally:
        await host.close()
        await game.close()
        if second is not None:
            await second.shutdown()


async def test_two_daemons_share_redis(redis_server: RedisProcess) -> None:
    a = Matchmaker(settings(store=redis_server.url, replica_id="a"))
    b = Matchmaker(settings(store=redis_server.url, replica_id="b"))
    await a.start()
    await b.start()
    game, _ = await accepting_endpoint()
    host = MatchmakerClient.to(*a.udp_address, via=game)
    joiner = MatchmakerClient.to(*b.udp_address)
    try:
        address = await host.register(**HOST)
        await eventually(lambda: b.registry.get(address) is not None)
        assert [e.address for e in await joiner.list_servers(game="q3")] == [address]
        # b relays the introduction to a, which holds the host's connection.
        intro = await joiner.introduce(address)
        to_host = await asyncio.wait_for(host.introductions.get(), 5)
        assert to_host.nonce == intro.nonce
        assert (
            b.metrics.registry.get_sample_value(
                "matchmaker_introductions_total", {"result": "relayed"}
            )
            == 1
        )
    finally:
        await host.close()
        await joiner.close()
        await game.close()
        await a.shutdown()
        await b.shutdown()


async def test_metrics_export_rudp_transport_counters(daemon: Matchmaker) -> None:
    game, _ = await accepting_endpoint()
    host = MatchmakerClient.to(*daemon.udp_address, via=game)
    browser = MatchmakerClient.to(*daemon.udp_address)
    garbage = 7
    try:
        await host.register(**HOST)
        # Garbage at the matchmaker's UDP port: long enough for a header, wrong CRC.
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, remote_addr=daemon.udp_address
        )
        for i in range(garbage):
            transport.sendto(bytes([i]) * 40)
        transport.close()
        stats = daemon.udp.stats
        await eventually(lambda: stats.dropped[rudp.DropReason.BAD_CHECKSUM] == garbage)
        await browser.info()  # an acked round trip: an RTT sample on both sides
        # The host heartbeats with datagrams: the browser's is the one connection.
        await eventually(lambda: len(daemon.udp.endpoint.core.connections) == 1)

        status, body = await http_get(daemon.http_address, "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families.values()
            for s in f.samples
        }
        assert samples[("rudp_datagrams_received_total", ())] > garbage
        assert samples[("rudp_connections", ())] == 1
        assert samples[("rudp_datagrams_dropped_total", (("reason", "bad_checksum"),))] == garbage
        # A gauge histogram (text format 0.0.4 writes it as a histogram plus
        # _gcount/_gsum); one open connection has an RTT sample: the browser's.
        assert samples[("rudp_rtt_seconds_bucket", (("le", "+Inf"),))] == 1
        assert samples[("rudp_rtt_seconds_gcount", ())] == 1
        assert ("rudp_retransmissions_total", ()) in samples
        build = (("python", platform.python_version()), ("version", __version__))
        assert samples[("matchmaker_build_info", build)] == 1
    finally:
        await browser.close()
        await host.close()
        await game.close()


def test_daemon_rudp_config_fits_the_protocol() -> None:
    # One channel (the protocol uses channel 0; rudp's per-channel queues cost
    # ~20 KiB a host at 32) and rare daemon-side pings (hosts keep talking).
    config = Matchmaker(settings())._rudp_config
    assert config.channels == 1
    assert config.keepalive_interval * 3 <= config.idle_timeout <= 10.0
    # A list answer's pages in flight are rudp's to carry: its window follows.
    assert config.window == settings().pages_in_flight == 1024
    assert Matchmaker(settings(pages_in_flight=16))._rudp_config.window == 256


async def test_a_registration_costs_no_path_mtu_probe(daemon: Matchmaker) -> None:
    # Every matchmaker message fits 1,200 bytes: a registration's short connection
    # spends no 1,472-byte probe either way (nor the acknowledgement of one).
    game, _ = await accepting_endpoint()
    host = MatchmakerClient.to(*daemon.udp_address, via=game)
    try:
        await host.register(**HOST)
        await eventually(lambda: not daemon.udp.endpoint.core.connections)
        await eventually(lambda: not game.endpoint.core.connections)
        # Both ends' connection ended, its counters folded into the endpoint's.
        for stats in (game.stats, daemon.udp.stats):
            assert stats.closed_totals["packets_received"] > 0
            assert stats.closed_totals["mtu_probes_sent"] == 0
        # CHALLENGE, ACCEPT, the reply, the DISCONNECT's ack: ~300 bytes in all.
        # (Not counted on the daemon's side: a loaded machine may resend a
        # 1,200-byte CONNECT, which is not a probe.)
        assert game.stats.bytes_received < 1200
        (record,) = daemon.registry.index()
        assert record.entry  # the registration's encoded list entry, kept
    finally:
        await host.close()
        await game.close()


def test_daemon_process_stops_on_sigterm() -> None:
    port, http_port = free_port(), free_port()
    env = dict(os.environ, MATCHMAKER_HTTP_PORT=str(http_port), MATCHMAKER_LOG_FORMAT="json")
    args = [sys.executable, "-m", "matchmaker", "--bind", "127.0.0.1", "--port", str(port)]
    args += ["--http-bind", "127.0.0.1", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        started = json.loads(proc.stderr.readline())
        assert started["event"] == "matchmaker_started"
        assert started["http"] == f"127.0.0.1:{http_port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        events = [json.loads(line)["event"] for line in proc.stderr.read().splitlines()]
        assert events[-2:] == ["matchmaker_stopping", "matchmaker_stopped"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_one_source_filling_the_slots_is_capped_and_a_host_still_gets_in() -> None:
    daemon = Matchmaker(settings(max_connections=40, max_connections_per_source=8))
    await daemon.start()
    greedy = [await rudp.open_endpoint("127.0.0.1", 0) for _ in range(12)]

    async def players(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    game = await rudp.serve(players, "127.0.0.2", 0)  # the legitimate host: another source
    host = MatchmakerClient.to(*daemon.udp_address, via=game)
    try:
        results = await asyncio.gather(
            *(e.connect(*daemon.udp_address) for e in greedy), return_exceptions=True
        )
        held = [r for r in results if isinstance(r, rudp.Connection)]
        refused = [r for r in results if isinstance(r, rudp.ConnectRefused)]
        assert (len(held), len(refused)) == (8, 4), results
        assert all("too many connections from your address" in str(r) for r in refused)
        address = await host.register(**HOST)
        assert daemon.registry.get(address) is not None
        _, body = await http_get(daemon.http_address, "/metrics")
        assert "rudp_source_connections_refused_total 4.0" in body.decode()
    finally:
        await host.close()
        await game.close()
        for e in greedy:
            await e.close()
        await daemon.shutdown()


async def test_a_client_given_the_matchmaker_key_authenticates_it(tmp_path: Path) -> None:
    key_file = tmp_path / "static.key"
    key_file.write_text("# rudp static key\n" + secrets.token_hex(32) + "\n")
    mm = Matchmaker(settings(static_key_file=str(key_file)))
    await mm.start()
    game, _ = await accepting_endpoint()
    try:
        public = mm.static_public_key
        assert public is not None and len(public) == 32
        mm_host, mm_port = mm.udp_address
        async with MatchmakerClient.to(mm_host, mm_port, via=game, matchmaker_key=public) as host:
            address = await host.register(**HOST)
            assert mm.registry.get(address) is not None
        # A key that is not the matchmaker's: no connection completes.
        wrong = bytes(31) + b"\x09"
        async with MatchmakerClient.to(
            mm_host, mm_port, matchmaker_key=wrong, timeout=1.0
        ) as stranger:
            with pytest.raises(MatchmakerUnreachable):
                await stranger.list_servers(game="q3")
    finally:
        await game.close()
        await mm.shutdown()
