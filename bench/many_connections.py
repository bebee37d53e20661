"""Many concurrent connections to one rudp server on loopback.

The server (this process) echoes every message. Client processes (``--processes``, each one
asyncio loop) open ``--connections`` connections between them, all at once; each connection does
``--rounds`` reliable round trips of ``--size`` bytes, then says "done" and waits. When every
connection has said "done" (so all of them are open at the same time) the server samples its RSS,
then sends "bye" to all and the clients close.

Reported: connections completed, the server's CPU seconds (user + system, this process only),
the server's RSS growth per connection at the moment all of them were open, and wall times.
Only 127.0.0.1 is used.

    .venv/bin/python bench/many_connections.py                       # 1000 connections
    .venv/bin/python bench/many_connections.py --connections 200 --processes 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp

DONE, BYE = b"done", b"bye"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- client processes --------------------------------------------------------------------------


async def client_main(host: str, port: int, count: int, rounds: int, size: int) -> None:
    started = time.perf_counter()
    failures: list[str] = []
    latencies: list[float] = []
    resends = {"timeouts": 0, "lost": 0}

    async def one(i: int) -> bool:
        try:
            conn = await rudp.connect(host, port, local_addr=("127.0.0.1", 0))
        except rudp.RudpError as exc:
            failures.append(f"connect: {exc}")
            return False
        try:
            for r in range(rounds):
                payload = (b"%d:%d:" % (i, r)).ljust(size, b".")
                t0 = time.perf_counter()
                conn.send(payload)
                reply = await conn.recv()
                latencies.append(time.perf_counter() - t0)
                if reply.data != payload:
                    failures.append(f"bad echo on {i}")
                    return False
            conn.send(DONE)
            while (await conn.recv()).data != BYE:
                pass
            resends["timeouts"] += conn.stats.timeouts
            resends["lost"] += conn.stats.packets_lost
            await conn.close()
            return True
        except rudp.RudpError as exc:
            failures.append(f"conn {i}: {exc}")
            return False

    results = await asyncio.gather(*(one(i) for i in range(count)))
    latencies.sort()
    print(
        json.dumps(
            {
                "completed": sum(results),
                "failures": failures[:5],
                "seconds": time.perf_counter() - started,
                "rtt_p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else None,
                "rtt_p99_ms": 1e3 * latencies[int(len(latencies) * 0.99)] if latencies else None,
                "cpu_seconds": cpu_seconds(),
                **resends,
            }
        ),
        flush=True,
    )


# -- server --------------------------------------------------------------------------------------


async def server_main(args: argparse.Namespace) -> dict[str, object]:
    total = args.connections
    done: set[rudp.Connection] = set()
    all_done = asyncio.Event()
    peak = {"connections": 0}

    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            if msg.data == DONE:
                done.add(conn)
                if len(done) == total:
                    all_done.set()
            else:
                conn.send(msg.data)

    config = rudp.Config(max_connections=max(total, 1024))
    server = await rudp.serve(echo, "127.0.0.1", 0, config=config)
    host, port = server.address
    rss0, cpu0 = rss_bytes(), cpu_seconds()
    wall0 = time.perf_counter()
    shares = [
        total // args.processes + (1 if i < total % args.processes else 0)
        for i in range(args.processes)
    ]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--client",
            host,
            str(port),
            str(n),
            str(args.rounds),
            str(args.size),
            stdout=subprocess.PIPE,
        )
        for n in shares
        if n
    ]
    try:
        await asyncio.wait_for(all_done.wait(), args.timeout)
        peak["connections"] = len(server.connections)
        rss_full = rss_bytes()
        cpu_full = cpu_seconds()
        wall_full = time.perf_counter() - wall0
        for conn in list(done):
            conn.send(BYE)
        outputs = await asyncio.wait_for(
            asyncio.gather(*(p.communicate() for p in procs)), args.timeout
        )
    except TimeoutError:
        for p in procs:
            p.kill()
        raise
    finally:
        await server.close()
    clients = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]
    return {
        "connections": total,
        "processes": len(procs),
        "rounds": args.rounds,
        "size": args.size,
        "completed": sum(c["completed"] for c in clients),
        "open_at_once": peak["connections"],
        "server_cpu_seconds": round(cpu_full - cpu0, 3),
        "server_cpu_ms_per_connection": round(1e3 * (cpu_full - cpu0) / total, 3),
        "server_rss_baseline_mib": round(rss0 / 2**20, 1),
        "server_rss_all_open_mib": round(rss_full / 2**20, 1),
        "server_rss_per_connection_kib": round((rss_full - rss0) / total / 1024, 1),
        "wall_seconds_until_all_done": round(wall_full, 3),
        "client_rtt_p50_ms": [round(c["rtt_p50_ms"], 2) for c in clients],
        "client_rtt_p99_ms": [round(c["rtt_p99_ms"], 2) for c in clients],
        "client_cpu_seconds": [round(c["cpu_seconds"], 2) for c in clients],
        "client_resend_timeouts": sum(c["timeouts"] for c in clients),
        "client_packets_lost": sum(c["lost"] for c in clients),
        "client_failures": [f for c in clients for f in c["failures"]],
        "datagrams_dropped": {r.value: n for r, n in server.stats.dropped.items()},
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        host, port, count, rounds, size = sys.argv[2:7]
        rudp.run(client_main(host, int(port), int(count), int(rounds), int(size)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    result = rudp.run(server_main(args))
    print(json.dumps(result, indent=2))
    if result["completed"] != args.connections:
        sys.exit(1)


if __name__ == "__main__":
    main()
