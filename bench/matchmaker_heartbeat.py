"""Hosts listed on heartbeat datagrams: memory and CPU per host, registrations per second.

The daemon runs in its own process (bench/matchmaker_common.py), with its
garbage collector set as in production (`matchmaker.gctuning`). ``--processes``
client processes share ``--hosts`` simulated game hosts. Each host has its own
rudp socket (its own observed address: the processes bind on 127.0.k.x, at
most ``--per-ip`` sockets per address, and stay under 20,000 open files) and
registers with a real `MatchmakerClient` over a real rudp connection, which
the client then closes. From then on the process sends the host's heartbeat
datagrams itself (the client's own keeper would cost the bench a task per
host): every ``--keepalive`` seconds, spread evenly, from the host's socket,
counting the acknowledgements. Registrations go on while the hosts
registered before them heartbeat.

Phases, each timed across all processes on one system-wide monotonic clock:

1. register, in two waves: ``--first-wave`` of the hosts, then (once their
   connections are closed) the rest, at most ``--concurrency`` registrations
   in flight per process. The rate is the second wave's hosts / (its last end
   - its first start), registered while the first wave heartbeats;
2. steady: every host heartbeating and no connection left; over
   ``--measure`` seconds: the daemon's CPU per second and per heartbeat, the
   acknowledged fraction, and its RSS per listed host: RSS growth from
   before the first host over the hosts (it includes the peak of the
   handshakes in flight, which the allocator keeps), the same after
   gc.collect() and malloc_trim(0) ("trimmed"), and the *marginal* RSS, from
   the end of the first wave to the end (both trimmed) over the second
   wave's hosts: what one more listed host costs.

``--baseline-hosts`` first runs the same with hosts that keep their
connection (a client given no socket: heartbeat messages over the
connection, what every listed host cost before), in a daemon of its own, for
the ratio of memory per host. GC pauses (every collection the daemon ran,
timed by gc.callbacks) are reported as p50/p99/max per generation.

    .venv/bin/python bench/matchmaker_heartbeat.py                          # 100,000 hosts
    .venv/bin/python bench/matchmaker_heartbeat.py --hosts 20000 --processes 2 --baseline-hosts 5000

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from bench._common import environment, format_table, write_json
from bench.matchmaker_common import DaemonProcess, bench_settings, register_host, settings_dict
from bench.matchmaker_register import expect
from matchmaker import heartbeat as hb
from matchmaker.client import MatchmakerClient


class _Host:
    __slots__ = ("address", "counter", "endpoint", "replica", "secret")

    def __init__(self, endpoint: rudp.Server) -> None:
        self.endpoint = endpoint
        self.secret = b""
        self.address: Any = None
        self.replica: Any = None
        self.counter = 0


def _client_main(
    pipe: Pipe, address: tuple[str, int], index: int, first: int, count: int, a: Any
) -> None:
    async def main() -> None:
        hosts: list[_Host] = []
        for i in range(count):
            ip = f"127.{index + 1}.{i // a.per_ip}.1"
            hosts.append(_Host(await rudp.open_endpoint(ip, 0)))
        acks = [0]

        def on_ack(data: bytes, source: Any) -> list[bytes]:
            acks[0] += 1
            return []

        beating: list[_Host] = []
        stop = asyncio.Event()
        sent = [0]

        async def heartbeats() -> None:
            # Every host once per keepalive, in ticks of 20 ms.
            tick, position = 0.02, 0.0
            while not stop.is_set():
                await asyncio.sleep(tick)
                if not beating:
                    continue
                position += len(beating) * tick / a.keepalive
                while position >= 1.0:
                    position -= 1.0
                    h = beating[sent[0] % len(beating)]
                    sent[0] += 1
                    h.counter += 1
                    data = hb.encode_beat(h.secret, h.address, h.counter)
                    h.endpoint.send_datagram(data, h.replica)

        beater = asyncio.create_task(heartbeats())
        gate = asyncio.Semaphore(a.concurrency)
        failures: list[str] = []

        async def register(i: int, h: _Host) -> None:
            async with gate:
                client = MatchmakerClient.to(
                    *address,
                    via=h.endpoint,
                    timeout=a.timeout,
                    reconnect_delay=1.0,
                    register_timeout=a.timeout * 3,
                    **({"datagrams": None} if a.mode == "connection" else {}),
                )
                try:
                    await register_host(client, first + i)
                except Exception as exc:  # counted, the run goes on
                    failures.append(repr(exc))
                    return
                if a.mode == "connection":
                    clients.append(client)  # it heartbeats over its connection
                    return
                beats = client._beats
                assert beats is not None
                await client._stop_keeper()  # the process heartbeats for it (module doc)
                h.secret, h.address, h.replica = beats.secret, beats.address, beats.replica
                h.counter = beats.counter
                h.endpoint.set_datagram_handler(hb.Kind.HEARTBEAT_ACK, on_ack)
                beating.append(h)

        clients: list[MatchmakerClient] = []
        loop = asyncio.get_running_loop()
        first_wave = int(count * a.first_wave)
        pipe.send(("ready",))
        for wave in (range(first_wave), range(first_wave, count)):
            await loop.run_in_executor(None, pipe.recv)  # "go"
            start = time.monotonic()
            await asyncio.gather(*(register(i, hosts[i]) for i in wave))
            pipe.send(("registered", start, time.monotonic(), len(failures), failures[:3]))
        while True:
            cmd = await loop.run_in_executor(None, pipe.recv)
            if cmd == "count":
                pipe.send(("count", sent[0], acks[0]))
            else:
                break
        stop.set()
        await beater
        for c in clients:
            await c._stop_keeper()
        for h in hosts:
            h.endpoint.endpoint.close_now()
        pipe.send(("closed",))

    rudp.run(main())


def _wait_idle_connections(daemon: DaemonProcess, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        stats = daemon.stats()
        if stats["connections"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def run_mode(a: argparse.Namespace, mode: str, hosts: int) -> dict[str, Any]:
    a.mode = mode
    settings = bench_settings(keepalive=a.keepalive, max_connections=max(hosts + 1000, 20_000))
    ctx = multiprocessing.get_context("spawn")
    with DaemonProcess(settings, use_uvloop=True) as daemon:
        per = _split(hosts, a.processes)
        pipes, procs, first = [], [], 0
        for index, count in enumerate(per):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client_main, args=(child, daemon.udp_address, index, first, count, a)
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
            first += count
        try:
            for p in pipes:
                expect(p, "ready", 600)
            if a.trace:
                daemon.trace()
            before = daemon.stats()
            for p in pipes:
                p.send("go")
            budget = a.timeout * 20 + hosts / 10
            first = [expect(p, "registered", budget) for p in pipes]
            if mode == "datagrams":
                _wait_idle_connections(daemon, 60)
            mid = daemon.trimmed()  # the handshakes' peak is behind: the slope starts here
            for p in pipes:
                p.send("go")
            registered = [expect(p, "registered", budget) for p in pipes]
            after_register = daemon.stats()
            if mode == "datagrams":
                after_register = _wait_idle_connections(daemon, 60)
            time.sleep(a.keepalive)  # every host has heartbeaten at least once since
            counts0 = [expect_count(p) for p in pipes]
            s0 = daemon.stats()
            time.sleep(a.measure)
            s1 = daemon.stats()
            counts1 = [expect_count(p) for p in pipes]
            trimmed = daemon.trimmed()
            traced = daemon.traced() if a.trace else None
            for p in pipes:
                p.send("close")
            for p in pipes:
                expect(p, "closed", 120)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    # The second wave's rate: registrations while the first wave's hosts heartbeat.
    register_s = max(m[2] for m in registered) - min(m[1] for m in registered)
    failed = sum(m[3] for m in registered)
    second = hosts - sum(int(n * a.first_wave) for n in _split(hosts, a.processes))
    sent = sum(c[1] for c in counts1) - sum(c[1] for c in counts0)
    acked = sum(c[2] for c in counts1) - sum(c[2] for c in counts0)
    cpu = s1["cpu"] - s0["cpu"]
    listed = s1["hosts"]
    beats = sent if mode == "datagrams" else listed * a.measure / a.keepalive
    return {
        "mode": mode,
        "hosts": hosts,
        "listed": listed,
        "failed": failed,
        "failures": [f for m in registered for f in m[4]],
        "register_s": register_s,
        "first_wave_failed": sum(m[3] for m in first),
        "second_wave": second,
        "register_per_s": (second - (failed - sum(m[3] for m in first))) / register_s,
        "register_daemon_cpu_s": after_register["cpu"] - before["cpu"],
        "connections_after": s1["connections"],
        "heartbeats_per_s": beats / a.measure,
        "acked_fraction": acked / sent if sent else None,
        "daemon_cpu_fraction": cpu / a.measure,
        "cpu_us_per_heartbeat": cpu / beats * 1e6 if beats else None,
        "cpu_us_per_host_per_s": cpu / a.measure / listed * 1e6 if listed else None,
        "rss_before": before["rss"],
        "rss_after": s1["rss"],
        "rss_per_host": (s1["rss"] - before["rss"]) / max(listed, 1),
        "rss_trimmed": trimmed["rss"],
        "rss_trimmed_per_host": (trimmed["rss"] - before["rss"]) / max(listed, 1),
        "rss_mid": mid["rss"],
        "hosts_mid": mid["hosts"],
        "rss_marginal_per_host": (trimmed["rss"] - mid["rss"]) / max(listed - mid["hosts"], 1),
        "gc": s1.get("gc"),
        "traced_bytes_per_host": traced["bytes"] / max(listed, 1) if traced else None,
        "traced_top": traced["top"] if traced else None,
        "dropped": s1["dropped"],
        "settings": settings_dict(settings),
    }


def _split(hosts: int, processes: int) -> list[int]:
    per = [hosts // processes] * processes
    per[-1] += hosts - sum(per)
    return per


def expect_count(pipe: Pipe) -> tuple[Any, ...]:
    pipe.send("count")
    result: tuple[Any, ...] = expect(pipe, "count", 60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--per-ip", type=int, default=16_000, help="sockets per loopback IP")
    parser.add_argument("--keepalive", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64, help="registrations in flight")
    parser.add_argument("--measure", type=float, default=30.0, help="seconds of steady state")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument(
        "--first-wave",
        type=float,
        default=0.3,
        help="fraction registered first; the rate and the marginal RSS are the rest's",
    )
    parser.add_argument("--baseline-hosts", type=int, default=10_000, help="0: no baseline")
    parser.add_argument(
        "--trace", action="store_true", help="tracemalloc breakdown (slow: not for rates)"
    )
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.hosts / a.processes > 19_000:
        parser.error("more than 19,000 sockets per process (20,000 open files each)")
    load_before = os.getloadavg()
    results = []
    if a.baseline_hosts:
        results.append(run_mode(a, "connection", a.baseline_hosts))
    results.append(run_mode(a, "datagrams", a.hosts))
    load_after = os.getloadavg()
    rows = [
        [
            r["mode"],
            r["hosts"],
            r["failed"],
            r["register_per_s"],
            r["connections_after"],
            r["heartbeats_per_s"],
            (r["acked_fraction"] or 0) * 100,
            r["daemon_cpu_fraction"] * 100,
            r["cpu_us_per_heartbeat"],
            r["rss_per_host"] / 1024,
            r["rss_trimmed_per_host"] / 1024,
            r["rss_marginal_per_host"] / 1024,
            (r["gc"] or {}).get("p99_ms", {}).get("2"),
        ]
        for r in results
    ]
    headers = [
        "listed by",
        "hosts",
        "failed",
        "registrations/s",
        "connections",
        "heartbeats/s",
        "acked %",
        "daemon CPU %",
        "CPU µs/heartbeat",
        "RSS KiB/host",
        "trimmed KiB/host",
        "marginal KiB/host",
        "gen-2 GC p99 ms",
    ]
    print(format_table(headers, rows))
    if len(results) == 2:
        for key in ("rss_per_host", "rss_trimmed_per_host"):
            ratio = results[1][key] / results[0][key]
            print(f"{key}, datagrams / connection: {ratio:.3f}")
    print(f"load average before {load_before}, after {load_after}")
    for r in results:
        if r["traced_top"]:
            print(f"{r['mode']}: traced {r['traced_bytes_per_host']:.0f} B/host; top lines:")
            for where, size, count in r["traced_top"]:
                print(f"  {size / max(r['listed'], 1):8.1f} B/host {count:8d} blocks  {where}")
        if r["failures"]:
            print(r["mode"], "failures:", r["failures"], file=sys.stderr)
    path = write_json(
        "matchmaker-heartbeat",
        {
            "environment": environment(),
            "args": vars(a),
            "load_before": load_before,
            "load_after": load_after,
            "results": results,
        },
        a.json,
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
