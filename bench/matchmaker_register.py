"""Registrations per second and memory per registered host, over real rudp on loopback.

The daemon runs in its own process (bench/matchmaker_common.py). ``--processes``
client processes each run ``--hosts / --processes`` game hosts; every host is
what a real one is: its own rudp socket (so its own observed address) and its
own `MatchmakerClient`. Two phases, each timed across all processes (one
system-wide monotonic clock):

1. connect: every host opens its rudp connection and does one request
   (``info``), at most ``--connect-concurrency`` handshakes in flight per process;
2. register: when every process is connected, every host sends ``register``
   at once; the phase ends when the last ``registered`` reply is in.

The rate is hosts / (last end - first start) of each phase. Memory per host is
the daemon's RSS growth from before phase 1 to after phase 2 divided by the
hosts (a registered host holds a rudp connection, a session and a registry
entry); the registry entry alone is measured separately with tracemalloc on
hosts inserted directly.

    .venv/bin/python bench/matchmaker_register.py                        # 4,000 hosts, 2 processes
    .venv/bin/python bench/matchmaker_register.py --hosts 10000 --processes 4

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from bench._common import environment, format_table, write_json
from bench.matchmaker_common import (
    DaemonProcess,
    bench_settings,
    register_host,
    settings_dict,
)
from matchmaker.client import MatchmakerClient


def _client_main(
    pipe: Pipe,
    address: tuple[str, int],
    first: int,
    count: int,
    timeout: float,
    connect_concurrency: int,
) -> None:
    async def main() -> None:
        endpoints = [await rudp.open_endpoint("127.0.0.1", 0) for _ in range(count)]
        clients = [
            MatchmakerClient.to(*address, via=e, timeout=timeout, reconnect_delay=5.0)
            for e in endpoints
        ]
        loop = asyncio.get_running_loop()
        try:
            # Handshakes are bounded (a real fleet does not arrive in one
            # instant; thousands at once would just hit the connect timeout).
            gate = asyncio.Semaphore(connect_concurrency)

            retries = 0

            async def connect(client: MatchmakerClient) -> None:
                nonlocal retries
                async with gate:
                    for attempt in range(3):
                        try:
                            await client.info()
                            return
                        except (TimeoutError, rudp.ConnectTimeout):
                            if attempt == 2:
                                raise
                            retries += 1

            start = time.monotonic()
            await asyncio.gather(*(connect(c) for c in clients))
            pipe.send(("connected", start, time.monotonic(), retries))
            await loop.run_in_executor(None, pipe.recv)  # "go"
            start = time.monotonic()
            results = await asyncio.gather(
                *(register_host(c, first + i) for i, c in enumerate(clients)),
                return_exceptions=True,
            )
            end = time.monotonic()
            failed = [repr(r) for r in results if isinstance(r, BaseException)]
            pipe.send(("registered", start, end, len(failed), failed[:3]))
            await loop.run_in_executor(None, pipe.recv)  # "close"
        finally:
            await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
            for e in endpoints:
                e.endpoint.close_now()
        pipe.send(("closed",))

    rudp.run(main())


def expect(pipe: Pipe, kind: str, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"client: no {kind!r} within {timeout} s")
    msg = pipe.recv()
    if msg[0] != kind:
        raise RuntimeError(f"client: expected {kind!r}, got {msg!r}")
    return msg


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = bench_settings()
    ctx = multiprocessing.get_context("spawn")
    with DaemonProcess(settings, use_uvloop=True) as daemon:
        before = daemon.stats()
        per = [args.hosts // args.processes] * args.processes
        per[-1] += args.hosts - sum(per)
        pipes, procs, first = [], [], 0
        for count in per:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client_main,
                args=(
                    child,
                    daemon.udp_address,
                    first,
                    count,
                    args.timeout,
                    args.connect_concurrency,
                ),
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
            first += count
        try:
            connected = [expect(p, "connected", args.timeout * 4) for p in pipes]
            for p in pipes:
                p.send("go")
            registered = [expect(p, "registered", args.timeout * 4) for p in pipes]
            after = daemon.stats()
            # All registered, nothing to do but keep alive: what does that cost?
            time.sleep(args.idle)
            idle = daemon.stats()
            for p in pipes:
                p.send("close")
            for p in pipes:
                expect(p, "closed", 60)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
        registry_only = daemon.populate(args.hosts)
    connect_s = max(m[2] for m in connected) - min(m[1] for m in connected)
    register_s = max(m[2] for m in registered) - min(m[1] for m in registered)
    failed = sum(m[3] for m in registered)
    connect_retries = sum(m[3] for m in connected)
    return {
        "hosts": args.hosts,
        "processes": args.processes,
        "connect_s": connect_s,
        "connect_per_s": args.hosts / connect_s,
        "connect_retries": connect_retries,
        "register_s": register_s,
        "register_per_s": (args.hosts - failed) / register_s,
        "failed": failed,
        "failures": [f for m in registered for f in m[4]],
        "daemon_hosts": after["hosts"],
        "daemon_connections": after["connections"],
        "daemon_cpu_s": after["cpu"] - before["cpu"],
        "idle_s": args.idle,
        "idle_cpu_fraction": (idle["cpu"] - after["cpu"]) / args.idle if args.idle else None,
        "idle_datagrams_per_s": (
            (idle["datagrams_received"] + idle["datagrams_sent"])
            - (after["datagrams_received"] + after["datagrams_sent"])
        )
        / args.idle
        if args.idle
        else None,
        "rss_before": before["rss"],
        "rss_after": after["rss"],
        "rss_per_host": (after["rss"] - before["rss"]) / args.hosts,
        "registry_bytes_per_host": registry_only["registry_bytes_per_host"],
        "settings": settings_dict(settings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--idle", type=float, default=5.0, help="seconds to measure the daemon with all hosts idle"
    )
    parser.add_argument(
        "--connect-concurrency", type=int, default=256, help="handshakes in flight per process"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    r = run(args)
    rows = [
        [
            r["hosts"],
            r["processes"],
            r["connect_per_s"],
            r["connect_retries"],
            r["register_per_s"],
            r["failed"],
            r["daemon_cpu_s"],
            r["rss_per_host"] / 1024,
            r["idle_datagrams_per_s"],
            (r["idle_cpu_fraction"] or 0) * 100,
            r["registry_bytes_per_host"],
        ]
    ]
    headers = [
        "hosts",
        "client procs",
        "connects/s",
        "connect retries",
        "registrations/s",
        "failed",
        "daemon CPU s",
        "RSS KiB/host",
        "idle datagrams/s",
        "idle CPU %",
        "registry B/host",
    ]
    print(format_table(headers, rows))
    if r["failures"]:
        print("failures:", r["failures"], file=sys.stderr)
    path = write_json(
        "matchmaker-register", {"environment": environment(), "args": vars(args), **r}, args.json
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
