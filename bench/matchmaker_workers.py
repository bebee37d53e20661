"""Registrations per second and daemon CPU per registration by worker count.

For each ``--workers`` count (default ``1,2``), in the same run: a fresh replica
(``python -m matchmaker --workers W``, uvloop, JSON logs to a file) on a
redis-server of the benchmark's own, emptied before each count; ``--processes``
client processes register ``--hosts`` hosts, each host its own rudp socket on
127.k.x.2 (the stock client, ``MatchmakerClient.to(..., via=socket)``), at most
``--concurrency`` registrations in flight per process; hosts stop heartbeating
once registered (bench/matchmaker_heartbeat.py measures registrations while
listed hosts heartbeat).

Measured from the clients' start until the last registration answered, plus
``--settle`` seconds for the connections to close: the wall time (registrations
per second), and the CPU time (user + system, from /proc) of the supervisor, of
each worker and of redis-server over the hosts registered.  On a machine with
fewer free cores than workers + client processes the rate measures the machine;
the CPU per registration per worker and the ratio between counts in one run are
the figures to compare (docs/performance.md).

    .venv/bin/python bench/matchmaker_workers.py --hosts 6000 --processes 2

Prints the figures, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from bench._common import environment, write_json
from bench.matchmaker_common import RedisServer, register_host
from matchmaker.client import MatchmakerClient

TICK = os.sysconf("SC_CLK_TCK")


def _client_main(address: tuple[str, int], index: int, count: int, a: Any, out: Queue[Any]) -> None:
    async def main() -> None:
        gate = asyncio.Semaphore(a.concurrency)
        # A source address per host: the workers' group steers by source address,
        # so hosts sharing one would all reach the same worker.
        sockets = [
            await rudp.open_endpoint(
                f"127.{index * 4 + 1 + i // 62_500}.{i // 250 % 250}.{i % 250 + 1}", 0
            )
            for i in range(count)
        ]
        failures: list[str] = []

        async def register(i: int) -> None:
            async with gate:
                client = MatchmakerClient.to(
                    *address, via=sockets[i], timeout=a.timeout, register_timeout=a.timeout * 3
                )
                try:
                    await register_host(client, index * count + i)
                except Exception as exc:  # counted, the run goes on
                    failures.append(repr(exc))
                    return
                await client._stop_keeper()  # no heartbeats here (module doc)

        out.put(("ready", 0.0, 0, []))
        start = time.monotonic()
        await asyncio.gather(*(register(i) for i in range(count)))
        out.put(("done", time.monotonic() - start, len(failures), failures[:3]))
        for s in sockets:
            s.endpoint.close_now()

    rudp.run(main(), use_uvloop=True)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def _sample(text: str, name: str) -> float:
    return sum(
        float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name)
    )


def _worker_pids(workers: int, supervisor: int) -> list[int]:
    """The worker processes, in the order the supervisor started them (index order)."""
    if workers == 1:
        return [supervisor]
    with open(f"/proc/{supervisor}/task/{supervisor}/children") as f:
        children = sorted(int(pid) for pid in f.read().split())
    assert len(children) == workers, children
    return children


def _start_replica(
    a: Any, workers: int, store: str, directory: Path, name: str = ""
) -> tuple[Any, int, int, Path]:
    for _ in range(5):
        try:
            return _try_replica(a, workers, store, directory, name)
        except _PortTaken:
            continue  # a free port picked was taken before the replica bound it
    raise RuntimeError("no free ports")


class _PortTaken(Exception):
    pass


def _try_replica(
    a: Any, workers: int, store: str, directory: Path, name: str
) -> tuple[Any, int, int, Path]:
    udp, http = _free_port(socket.SOCK_DGRAM), _free_port(socket.SOCK_STREAM)
    log = directory / f"workers-{workers}{name}.log"
    cmd = [sys.executable, "-m", "matchmaker", "--workers", str(workers), "--store", store]
    cmd += ["--bind", "127.0.0.1", "--port", str(udp), "--http-bind", "127.0.0.1"]
    cmd += ["--http-port", str(http), "--allow-private", "--log-format", "json"]
    cmd += ["--log-level", "warning", "--max-hosts-per-ip", "1000000"]
    cmd += ["--register-rate", "1000000000", "--register-burst", "1000000000"]
    cmd += ["--max-connections", "100000", "--max-connections-per-source", "0"]
    cmd += ["--handshake-rate", "0", "--hide-after", "3600", "--expire-after", "3600"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        time.sleep(0.2)
        if proc.poll() == 3:
            raise _PortTaken
        if proc.poll() is not None:
            raise RuntimeError(f"the replica exited with {proc.returncode}: see {log}")
        try:
            up = _sample(_get(http, "/metrics"), "matchmaker_worker_up")
            ready = " 200 " in _get(http, "/readyz").split("\r\n")[0] + " "
        except OSError:
            continue
        if ready and (workers == 1 or up == workers):
            return proc, udp, http, log
        if time.monotonic() > deadline:
            raise RuntimeError("the replica did not come up within 60 s")


def _run_one(a: Any, workers: int, redis_port: int, directory: Path) -> dict[str, Any]:
    subprocess.run(
        ["redis-cli", "-p", str(redis_port), "flushall"], check=True, capture_output=True
    )
    store = f"redis://127.0.0.1:{redis_port}/0"
    proc, udp, http, _ = _start_replica(a, workers, store, directory)
    # Idle replicas on the same Redis: what following the change stream costs.
    followers = [_start_replica(a, 1, store, directory, f"-f{i}")[0] for i in range(a.followers)]
    redis_pid = int(subprocess.run(
        ["redis-cli", "-p", str(redis_port), "info", "server"], capture_output=True, text=True
    ).stdout.split("process_id:")[1].split()[0])  # fmt: skip
    try:
        pids = _worker_pids(workers, proc.pid)
        ctx = multiprocessing.get_context("spawn")
        out: Queue[Any] = ctx.Queue()
        per = a.hosts // a.processes
        clients = [
            ctx.Process(target=_client_main, args=(("127.0.0.1", udp), k, per, a, out))
            for k in range(a.processes)
        ]
        for c in clients:
            c.start()
        for _ in clients:
            out.get(timeout=120)  # sockets open
        watched = [f.pid for f in followers]
        watched += [proc.pid, *pids, redis_pid] if workers > 1 else [*pids, redis_pid]
        cpu0 = [_cpu(p) for p in watched]
        load0 = os.getloadavg()
        reports = [out.get(timeout=600) for _ in clients]
        wall = max(r[1] for r in reports)
        time.sleep(a.settle)
        cpu = [_cpu(p) - c for p, c in zip(watched, cpu0, strict=True)]
        follower_cpu, cpu = cpu[: len(followers)], cpu[len(followers) :]
        load1 = os.getloadavg()
        for c in clients:
            c.join(30)
        metrics = _get(http, "/metrics")
    finally:
        for p in [proc, *followers]:
            p.terminate()
            p.wait(60)
    name = "matchmaker_registrations_total"
    if workers == 1:
        created = [_sample(metrics, f'{name}{{result="created"}}')]
    else:
        created = [
            _sample(metrics, f'{name}{{result="created",worker="{i}"}}') for i in range(workers)
        ]
    hosts = int(sum(created))
    worker_cpu = cpu[-1 - workers : -1]
    daemon_cpu = sum(cpu[:-1])
    return {
        "workers": workers,
        "hosts": hosts,
        "failed": sum(r[2] for r in reports),
        "failures": [f for r in reports for f in r[3]],
        "wall_s": wall,
        "registrations_per_s": hosts / wall,
        "registrations_per_worker": created,
        "daemon_cpu_s": daemon_cpu,
        "daemon_cpu_us_per_registration": daemon_cpu / max(hosts, 1) * 1e6,
        "worker_cpu_us_per_own_registration": [
            c / max(n, 1) * 1e6 for c, n in zip(worker_cpu, created, strict=True)
        ],
        "supervisor_cpu_s": cpu[0] if workers > 1 else 0.0,
        "redis_cpu_us_per_registration": cpu[-1] / max(hosts, 1) * 1e6,
        "follower_cpu_us_per_registration": [c / max(hosts, 1) * 1e6 for c in follower_cpu],
        "load_before": load0,
        "load_after": load1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=6000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="per client process")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--workers", default="1,2", help="worker counts, in this order")
    parser.add_argument("--rounds", type=int, default=1, help="each count this many times")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument(
        "--followers", type=int, default=0, help="idle replicas following the same Redis"
    )
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.hosts / a.processes > 19_000:
        parser.error("more than 19,000 sockets per process (20,000 open files each)")
    directory = Path(tempfile.mkdtemp(prefix="mm-workers-bench-"))
    redis = RedisServer(_free_port(socket.SOCK_STREAM))
    redis_port = redis.port
    results = []
    try:
        counts = [int(w) for w in a.workers.split(",")]
        for _ in range(a.rounds):
            for workers in counts:
                r = _run_one(a, workers, redis_port, directory)
                results.append(r)
                per_worker = ", ".join(f"{c:.0f}" for c in r["worker_cpu_us_per_own_registration"])
                print(
                    f"workers={workers}: {r['hosts']} hosts ({r['failed']} failed) in "
                    f"{r['wall_s']:.2f} s = {r['registrations_per_s']:.0f}/s; daemon CPU "
                    f"{r['daemon_cpu_us_per_registration']:.0f} µs per registration (per worker, "
                    f"over its own registrations: {per_worker}; split "
                    f"{[int(c) for c in r['registrations_per_worker']]}), supervisor "
                    f"{r['supervisor_cpu_s']:.2f} s, redis {r['redis_cpu_us_per_registration']:.0f}"
                    f" µs/registration; idle followers "
                    f"{[round(c) for c in r['follower_cpu_us_per_registration']]} µs/registration;"
                    f" load {r['load_before']} -> {r['load_after']}",
                    flush=True,
                )
    finally:
        redis.close()
        shutil.rmtree(directory, ignore_errors=True)
    for workers in sorted({r["workers"] for r in results}):
        rates = [r["registrations_per_s"] for r in results if r["workers"] == workers]
        print(f"workers={workers}: median {sorted(rates)[len(rates) // 2]:.0f}/s over {rates}")
    path = write_json(
        "matchmaker-workers", {"environment": environment(), "args": vars(a), "results": results},
        a.json,
    )  # fmt: skip
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
