"""The daemon's CPU per registration, end to end, and where it goes.

One registration is what a host does with the stock client given its socket
(``MatchmakerClient.to(..., via=socket)``): a version-2 rudp handshake (Noise
NN, or NK with ``--static-key``), the ``register`` message and its
``registered`` reply, then the host closes the connection and stays listed on
heartbeat datagrams. The daemon (`matchmaker.server.Matchmaker`, memory
registry, uvloop, the collector set as in production) runs in this process;
``--processes`` client processes register ``--hosts`` hosts, each host its
own rudp socket on 127.k.x.2, at most ``--concurrency`` registrations in
flight per process. Nothing heartbeats here (bench/matchmaker_heartbeat.py
measures registrations while the listed hosts heartbeat).

Measured from the first datagram the daemon reads until every connection is
gone (closed and drained): the daemon process's CPU time (user + system) over
the hosts registered, and the registrations per second that implies on one
core. ``--profile FILE`` runs the daemon under cProfile for the same window
(slower: for the breakdown, not the rate) and prints the top functions by
cumulative time. ``--log-level info`` adds the production log line of each
registration (to /dev/null). The collector's share is reported too: the CPU
time of the collections that ran in the window, per registration, by generation.
``--service-only`` leaves rudp out: the service's own work on ``--hosts``
`register` requests handed to it directly (decoding, the registry, the list
entry, the heartbeat secret, the reply), and decoding alone.

    .venv/bin/python bench/matchmaker_register_cost.py --hosts 6000 --processes 2
    .venv/bin/python bench/matchmaker_register_cost.py --hosts 4000 --profile reg.prof

Prints the figures, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import multiprocessing
import os
import pstats
import resource
import sys
import tempfile
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from bench._common import environment, write_json
from bench.matchmaker_common import bench_settings, host_info, register_host, rss_bytes
from matchmaker.client import MatchmakerClient


def _client_main(
    address: tuple[str, int], index: int, count: int, a: Any, key: bytes | None, out: Queue[Any]
) -> None:
    async def main() -> None:
        gate = asyncio.Semaphore(a.concurrency)
        sockets = [
            await rudp.open_endpoint(f"127.{index + 1}.{i // 16_000}.2", 0) for i in range(count)
        ]
        failures: list[str] = []

        async def register(i: int) -> None:
            async with gate:
                client = MatchmakerClient.to(
                    *address,
                    via=sockets[i],
                    timeout=a.timeout,
                    register_timeout=a.timeout * 3,
                    matchmaker_key=key,
                )
                try:
                    await register_host(client, index * count + i)
                except Exception as exc:  # counted, the run goes on
                    failures.append(repr(exc))
                    return
                await client._stop_keeper()  # no heartbeats here (module doc)

        start = time.monotonic()
        await asyncio.gather(*(register(i) for i in range(count)))
        out.put((time.monotonic() - start, len(failures), failures[:3]))
        for s in sockets:
            s.endpoint.close_now()

    rudp.run(main())


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Collections:
    """The collector's CPU time and count by generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.cpu = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.cpu[info["generation"]] += time.thread_time() - self._start
            self.count[info["generation"]] += 1


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    from matchmaker.gctuning import tune_gc
    from matchmaker.keys import write_key_file
    from matchmaker.logging import configure
    from matchmaker.server import Matchmaker
    from rudp.noise import generate_key, public_key

    static = generate_key() if a.static_key else None
    key_file = ""
    if static is not None:
        key_file = str(Path(tempfile.mkdtemp()) / "static.key")
        write_key_file(key_file, static)
    settings = bench_settings(
        keepalive=10.0, max_connections=20_000, log_level=a.log_level, static_key_file=key_file
    )
    configure(settings.log_level, "json", stream=open(os.devnull, "w"))  # noqa: SIM115
    mm = Matchmaker(settings)
    await mm.start()
    tune_gc()
    key = public_key(static) if static is not None else None
    ctx = multiprocessing.get_context("spawn")
    out: Queue[Any] = ctx.Queue()
    per = a.hosts // a.processes
    procs = [
        ctx.Process(target=_client_main, args=(mm.udp_address, k, per, a, key, out))
        for k in range(a.processes)
    ]
    rss0 = rss_bytes()
    for p in procs:
        p.start()
    while mm.udp.stats.datagrams_received == 0:
        await asyncio.sleep(0.005)
    profile = cProfile.Profile() if a.profile else None
    collections = _Collections()
    gc.callbacks.append(collections)
    cpu0, t0 = _cpu(), time.monotonic()
    if profile is not None:
        profile.enable()
    loop = asyncio.get_running_loop()
    reports = [await loop.run_in_executor(None, out.get) for _ in procs]
    while mm.service.connections or mm.udp.endpoint.core._conns:
        await asyncio.sleep(0.005)
    if profile is not None:
        profile.disable()
    cpu, wall = _cpu() - cpu0, time.monotonic() - t0
    gc.callbacks.remove(collections)
    hosts = len(mm.registry.index())
    for p in procs:
        p.join(30)
    await mm.shutdown()
    top = ""
    if profile is not None:
        profile.dump_stats(a.profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(a.top)
        top = text.getvalue()
    return {
        "hosts": hosts,
        "failed": sum(r[1] for r in reports),
        "failures": [f for r in reports for f in r[2]],
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_us_per_registration": cpu / max(hosts, 1) * 1e6,
        "registrations_per_core_s": hosts / cpu if cpu else None,
        "rss_growth_per_host": (rss_bytes() - rss0) / max(hosts, 1),
        "gc_us_per_registration": [c / max(hosts, 1) * 1e6 for c in collections.cpu],
        "gc_collections": collections.count,
        "profile_top": top,
    }


class _Peer:
    """What the service sees of a connection: its address; replies go nowhere."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.remote_address = address

    def send(self, data: bytes) -> None:
        return None


async def _service_only(a: argparse.Namespace) -> dict[str, Any]:
    from matchmaker.addresses import Address
    from matchmaker.gctuning import tune_gc
    from matchmaker.logging import configure
    from matchmaker.messages import Register, decode_request, encode
    from matchmaker.server import Matchmaker
    from matchmaker.service import _Session

    settings = bench_settings(keepalive=10.0, max_connections=20_000, log_level=a.log_level)
    configure(settings.log_level, "json", stream=open(os.devnull, "w"))  # noqa: SIM115
    mm = Matchmaker(settings)
    await mm.start()
    tune_gc()
    n = a.hosts
    requests = [encode(Register(request_id=1, host=host_info(i))) for i in range(n)]
    ips = [f"127.{1 + i // 60_000}.{(i // 250) % 240}.{i % 250 + 1}" for i in range(n)]
    peers: list[Any] = [_Peer((ip, 5000)) for ip in ips]  # (the few members a register uses)
    sessions = [_Session(peers[i], Address(ip, 5000), i) for i, ip in enumerate(ips)]
    t = time.thread_time()
    for data in requests:
        decode_request(data)
    decode = time.thread_time() - t
    t = time.thread_time()
    for session, data in zip(sessions, requests, strict=True):
        await mm.service._on_data(session, data)
    service = time.thread_time() - t
    hosts = len(mm.registry.index())
    await mm.shutdown()
    return {"hosts": hosts, "decode_us": decode / n * 1e6, "service_us": service / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=6000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="per client process")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--static-key", action="store_true", help="Noise NK (else NN)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning"))
    parser.add_argument("--profile", help="cProfile the daemon into this file")
    parser.add_argument("--top", type=int, default=40, help="functions printed with --profile")
    parser.add_argument("--service-only", action="store_true", help="no rudp: the service alone")
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.service_only:
        out = rudp.run(_service_only(a), use_uvloop=True)
        print(
            f"{out['hosts']} registrations handed to the service: {out['service_us']:.1f} µs "
            f"each, of which decoding {out['decode_us']:.1f} µs; load average {os.getloadavg()}"
        )
        return
    if a.hosts / a.processes > 19_000:
        parser.error("more than 19,000 sockets per process (20,000 open files each)")
    load_before = os.getloadavg()
    result = rudp.run(_run(a), use_uvloop=True)
    load_after = os.getloadavg()
    print(result.pop("profile_top"))
    print(
        f"{result['hosts']} hosts ({result['failed']} failed) in {result['wall_s']:.1f} s: "
        f"{result['cpu_us_per_registration']:.0f} µs of daemon CPU per registration, "
        f"{result['registrations_per_core_s']:.0f} registrations/s on one core; "
        f"load average before {load_before}, after {load_after}"
    )
    young, middle, old = result["gc_us_per_registration"]
    print(
        f"of which the collector: {young:.0f} + {middle:.0f} + {old:.0f} µs per registration "
        f"(generations 0, 1, 2: {result['gc_collections']} collections)"
    )
    if result["failures"]:
        print("failures:", result["failures"], file=sys.stderr)
    path = write_json(
        "matchmaker-register-cost",
        {
            "environment": environment(),
            "args": vars(a),
            "load_before": load_before,
            "load_after": load_after,
            "result": result,
        },
        a.json,
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
