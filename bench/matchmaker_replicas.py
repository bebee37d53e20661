"""Three replicas sharing a real redis-server: 50,000 hosts, replication lag, failover.

A redis-server of the bench's own (``--redis-port``, no persistence) and
three replica daemons (bench/matchmaker_common.py, each its own process,
uvloop, the collector set as in production) sharing it. ``--processes``
client processes share ``--hosts`` simulated game hosts, each with its own
rudp socket on 127.k.x.1 (at most ``--per-ip`` per address, 256: a list page
holds at most ``--page-per-ip`` hosts of one IP, so the hosts spread over many
addresses as real ones do, and pages stay full) and the stock
`MatchmakerClient` given every replica's address, which starts at a random
one of them (so hosts spread over the replicas). A host registers over a
connection, closes it and heartbeats with datagrams:

- the hosts registered on the replica the bench later kills (the *victim*,
  replica 1) keep the stock client's own keeper, which heartbeats, notices
  the death and sends its heartbeat to another replica, which takes it over
  (or, when none will, registers there): the failover measured is the
  client's own;
- the others are heartbeated by their process, as bench/matchmaker_heartbeat.py
  does (the stock keeper costs a task per host, which the bench cannot pay
  for 50,000 hosts on this machine beside the daemons).

Phases, each on the system-wide monotonic clock:

1. register every host at once, at most ``--concurrency`` in flight per
   process; registrations/s is hosts / (last reply - first request);
2. steady state, every host heartbeating: over ``--measure`` s, each
   replica's CPU per heartbeat it answered, the CPU per host of the three
   replicas and of Redis; each replica's RSS per host (every replica indexes
   every host), and Redis' ``used_memory`` growth per host;
3. lists: ``--lists`` answers of 1,000 hosts per replica (filters matching
   17-33 % of the hosts), planned and encoded in the daemon (server time),
   and ``--client-lists`` over loopback per replica (client time);
4. replication lag, ``--probes`` times: a probe host registers on replica A
   (its client knows A only), with a map no other host has; the lag is the
   time from the ``registered`` reply reaching the host until the first list
   from replica B (B != A; lists of that map sent back to back from a client
   connected to B beforehand, so the resolution is one such list, whose
   round trip is reported) holds it. Then the same for an ``update`` of the
   probe's map (the ``ok`` reply to the first list showing the new map);
5. failover: SIGKILL of the victim. Times until every one of its hosts has
   moved to another replica (client side: taken over, or registered again),
   until Redis names a live replica as the owner of each, and until the
   surviving replicas' indexes (what their lists draw from) do, with the count
   of hosts they list, how many moved by takeover, the survivors'
   registrations and the CPU of the survivors and of the host processes from
   the kill on. The host processes freeze their heap (``gc.freeze()``) at the
   kill: their own collections are no part of the failover.

GC pauses are every collection of each replica over the whole run.

``--hide-after`` is 30 minutes (production: 15 s), as in the other matchmaker
benchmarks: on a shared 2-core machine the three daemons fall tens of seconds
behind their heartbeats while 50,000 hosts register, and the hosts this bench
heartbeats itself would not register again once expired (the stock client
does). The acknowledged fraction says how many heartbeats were answered; the
failover is the clients' own (an unacknowledged heartbeat), whatever the
expiry.

    .venv/bin/python bench/matchmaker_replicas.py                 # 50,000 hosts, 4 processes
    .venv/bin/python bench/matchmaker_replicas.py --hosts 3000 --processes 2 --measure 10

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import rudp
from bench._common import environment, format_table, percentile, write_json
from bench.matchmaker_common import (
    GAME,
    DaemonProcess,
    RedisServer,
    bench_settings,
    cpu_seconds,
    host_info,
    register_host,
    settings_dict,
)
from bench.matchmaker_register import expect
from matchmaker import heartbeat as hb
from matchmaker.client import MatchmakerClient

FILTERS: list[dict[str, Any]] = [
    {"region": "eu"},
    {"region": "us", "not_full": True},
    {"tags_all": ("ctf", "eu")},
    {"map": "q3dm17", "not_empty": True},
    {"version": "1.32c", "tags_any": ("ffa",)},
]
MAX_SOCKETS = 60_000


# -- the client processes ---------------------------------------------------------------


class _Host:
    __slots__ = ("address", "client", "counter", "endpoint", "replica", "secret")

    def __init__(self, endpoint: rudp.Server) -> None:
        self.endpoint = endpoint
        self.client: MatchmakerClient | None = None
        self.secret = b""
        self.address: Any = None
        self.replica: Any = None
        self.counter = 0


def _client_main(
    pipe: Pipe, replicas: list[tuple[str, int]], index: int, first: int, count: int, a: Any
) -> None:
    victim = replicas[0]

    async def main() -> None:
        hosts = []
        for i in range(count):
            ip = f"127.{a.ip_base + index}.{i // a.per_ip}.1"
            hosts.append(_Host(await rudp.open_endpoint(ip, 0, config=rudp.Config(channels=1))))
        acks = [0]
        refused = [0]
        sent = [0]
        cursor = [0]
        beating: list[_Host] = []
        kept: list[_Host] = []  # the victim's hosts: the stock client keeps them
        stop = asyncio.Event()

        def on_ack(data: bytes, source: Any) -> list[bytes]:
            acks[0] += 1
            return []

        def on_not_registered(data: bytes, source: Any) -> list[bytes]:
            refused[0] += 1  # expired: the daemon fell behind its heartbeats
            return []

        async def heartbeats() -> None:
            # Every host once per keepalive, by the clock: a loop busy registering
            # wakes late, and then sends what fell due meanwhile.
            position, last = 0.0, time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.02)
                now = time.monotonic()
                elapsed, last = now - last, now
                if not beating:
                    continue
                position += len(beating) * elapsed / a.keepalive
                while position >= 1.0:
                    position -= 1.0
                    cursor[0] = (cursor[0] + 1) % len(beating)  # the list grows meanwhile
                    h = beating[cursor[0]]
                    sent[0] += 1
                    h.counter += 1
                    h.endpoint.send_datagram(
                        hb.encode_beat(h.secret, h.address, h.counter), h.replica
                    )

        gate = asyncio.Semaphore(a.concurrency)
        failures: list[str] = []

        async def register(i: int, h: _Host) -> None:
            async with gate:
                client = MatchmakerClient.to(replicas, via=h.endpoint)  # the stock defaults
                try:
                    await register_host(client, first + i)
                except Exception as exc:  # counted, the run goes on
                    failures.append(repr(exc))
                    await client.close()
                    return
                beats = client._beats
                assert beats is not None
                h.client = client
                h.address = beats.address
                if _same(beats.replica, victim):
                    kept.append(h)
                    return
                await client._stop_keeper()  # this process heartbeats for it
                h.secret, h.replica, h.counter = beats.secret, beats.replica, beats.counter
                h.endpoint.set_datagram_handler(hb.Kind.HEARTBEAT_ACK, on_ack)
                h.endpoint.set_datagram_handler(hb.Kind.NOT_REGISTERED, on_not_registered)
                beating.append(h)

        beater = asyncio.create_task(heartbeats())
        loop = asyncio.get_running_loop()
        pipe.send(("ready",))
        await loop.run_in_executor(None, pipe.recv)  # "go"
        start = time.monotonic()
        await asyncio.gather(*(register(i, h) for i, h in enumerate(hosts)))
        spread: dict[str, int] = {}
        for h in hosts:
            if h.client is not None and h.client.route is not None:
                spread[h.client.route] = spread.get(h.client.route, 0) + 1
        pipe.send(("registered", start, time.monotonic(), len(failures), failures[:3], spread))
        moved: dict[int, float] = {}
        cpu_at_kill = [0.0]
        watcher: asyncio.Task[None] | None = None

        async def watch(before: dict[int, int]) -> None:
            # When each of the victim's hosts has moved: another replica took its
            # heartbeat over, or (when none would) it registered again elsewhere.
            while len(moved) < len(kept):
                for n, h in enumerate(kept):
                    c = h.client
                    if n not in moved and c is not None and _moves(c) > before[n]:
                        moved[n] = time.monotonic()
                await asyncio.sleep(0.1)  # a pass over thousands of hosts: not too often

        while True:
            cmd = await loop.run_in_executor(None, pipe.recv)
            if cmd == "count":
                pipe.send(("count", sent[0], acks[0], len(beating), len(kept), refused[0]))
            elif cmd == "victims":
                # The simulated hosts' own collections are no part of what is measured.
                gc.collect()
                gc.freeze()
                cpu_at_kill[0] = cpu_seconds()
                base = {n: _moves(h.client) for n, h in enumerate(kept) if h.client}
                watcher = asyncio.create_task(watch(base))
                pipe.send(("victims", [h.address.key for h in kept]))
            elif cmd == "moved":
                clients = [h.client for h in kept if h.client is not None]
                routes = [c.route for c in clients]
                taken = sum(c.takeovers for c in clients)
                cpu = cpu_seconds() - cpu_at_kill[0]
                pipe.send(("moved", sorted(moved.values()), len(kept), routes, taken, cpu))
            else:
                break
        stop.set()
        await beater
        if watcher is not None:
            watcher.cancel()
        for h in kept:
            if h.client is not None:
                await h.client._stop_keeper()
        for h in hosts:
            h.endpoint.endpoint.close_now()
        pipe.send(("closed",))

    rudp.run(main())


def _moves(client: MatchmakerClient) -> int:
    """Registrations and takeovers: either is a move to another replica."""
    return client.registrations + client.takeovers


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return str(a[0]) == str(b[0]) and int(a[1]) == int(b[1])


# -- lists and replication lag, from the parent ------------------------------------------


async def _client_lists(replica: tuple[str, int], n: int) -> list[float]:
    """Client-side seconds per 1,000-host list (fewer when a filter matches fewer)."""
    times = []
    async with MatchmakerClient.to(*replica, timeout=30.0) as lister:
        await lister.info()
        for i in range(n):
            started = time.perf_counter()
            await lister.list_servers(game=GAME, limit=1000, **FILTERS[i % len(FILTERS)])
            times.append(time.perf_counter() - started)
    return times


async def _replication_lag(replicas: list[tuple[str, int]], probes: int, ip: str) -> dict[str, Any]:
    listers = [MatchmakerClient.to(*r, timeout=30.0) for r in replicas]
    register_lag: list[float] = []
    update_lag: list[float] = []
    polls: list[float] = []

    async def seen(lister: MatchmakerClient, map_name: str, since: float) -> float:
        deadline = since + 30
        while True:
            started = time.perf_counter()
            found = await lister.list_servers(game=GAME, map=map_name, limit=10)
            now = time.perf_counter()
            polls.append(now - started)
            if found:
                return now - since
            if now > deadline:
                raise RuntimeError(f"{map_name}: not listed within 30 s")

    try:
        for lister in listers:
            await lister.info()
        for i in range(probes):
            writer, reader = i % len(replicas), (i + 1 + i // len(replicas)) % len(replicas)
            if reader == writer:
                reader = (reader + 1) % len(replicas)
            endpoint = await rudp.open_endpoint(ip, 0, config=rudp.Config(channels=1))
            probe = MatchmakerClient.to(*replicas[writer], via=endpoint, timeout=30.0)
            try:
                info = host_info(i)
                await probe.register(
                    name=info.name,
                    game=GAME,
                    version=info.version,
                    max_players=info.max_players,
                    map=f"lag-r{i}",
                )
                register_lag.append(await seen(listers[reader], f"lag-r{i}", time.perf_counter()))
                await probe.update(map=f"lag-u{i}")
                update_lag.append(await seen(listers[reader], f"lag-u{i}", time.perf_counter()))
            finally:
                await probe.close()
                endpoint.endpoint.close_now()
    finally:
        for lister in listers:
            await lister.close()
    return {
        "register_s": register_lag,
        "update_s": update_lag,
        "poll_p50_s": statistics.median(polls) if polls else float("nan"),
        "polls": len(polls),
    }


# -- the run -------------------------------------------------------------------------------


def _split(hosts: int, processes: int) -> list[int]:
    per = [hosts // processes] * processes
    per[-1] += hosts - sum(per)
    return per


def _wait(check: Any, timeout: float, every: float = 0.5) -> float:
    """Seconds until check() is true (raises after timeout)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"not reached within {timeout} s")
        time.sleep(every)
    return time.monotonic() - start


def _until(check: Any, timeout: float, every: float) -> float | None:
    """`_wait`, but None after timeout: a failover that takes longer is a figure too."""
    try:
        return _wait(check, timeout, every)
    except RuntimeError:
        return None


def _owned_by(r: RedisServer, keys: list[str], prefix: str = "{mm}:") -> list[str | None]:
    out: list[str | None] = []
    for at in range(0, len(keys), 5000):
        with r.client.pipeline(transaction=False) as pipe:
            for key in keys[at : at + 5000]:
                pipe.hget(f"{prefix}h:{key}", "owner")
            out += [None if v is None else v.decode() for v in pipe.execute()]
    return out


def _quantiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    ordered = sorted(values) or [float("nan")]
    return {
        "n": len(values),
        "p50": percentile(ordered, 50) * scale,
        "p99": percentile(ordered, 99) * scale,
        "max": ordered[-1] * scale if ordered else float("nan"),
    }


def run(a: argparse.Namespace) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"load": [os.getloadavg()]}
    store = RedisServer(a.redis_port)
    daemons: list[DaemonProcess] = []
    procs: list[Any] = []
    try:
        redis_before = store.info()
        for i in range(3):
            settings = bench_settings(
                store=store.url,
                replica_id=f"r{i + 1}",
                keepalive=a.keepalive,
                hide_after=a.hide_after,
                expire_after=a.hide_after * 2,
                max_connections=20_000,
            )
            daemon = DaemonProcess(settings)
            daemon.__enter__()
            daemons.append(daemon)
        out["settings"] = settings_dict(settings)
        replicas = [d.udp_address for d in daemons]
        names = {f"{ip}:{port}": f"r{i + 1}" for i, (ip, port) in enumerate(replicas)}
        pipes = []
        first = 0
        for index, count in enumerate(_split(a.hosts, a.processes)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child, replicas, index, first, count, a))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
            first += count
        for p in pipes:
            expect(p, "ready", 600)
        before = [d.stats() for d in daemons]

        # 1. registrations
        for p in pipes:
            p.send("go")
        registered = [expect(p, "registered", a.register_budget) for p in pipes]
        reg_s = max(m[2] for m in registered) - min(m[1] for m in registered)
        failed = sum(m[3] for m in registered)
        spread: dict[str, int] = {}
        for m in registered:
            for route, n in m[5].items():
                spread[names.get(route, route)] = spread.get(names.get(route, route), 0) + n
        after_register = [d.stats() for d in daemons]
        out["register"] = {
            "seconds": reg_s,
            "per_s": (a.hosts - failed) / reg_s,
            "failed": failed,
            "failures": [f for m in registered for f in m[4]],
            "by_replica": spread,
            "daemon_cpu_s": [
                s1["cpu"] - s0["cpu"] for s0, s1 in zip(before, after_register, strict=True)
            ],
        }
        print(f"registered: {out['register']}", file=sys.stderr)
        out["load"].append(os.getloadavg())
        listed = a.hosts - failed
        try:
            out["replicated_s"] = _wait(
                lambda: all(d.stats()["hosts"] >= listed for d in daemons), 120
            )
            _wait(lambda: all(d.stats()["connections"] == 0 for d in daemons), 60)
        except RuntimeError:  # said, and measured as it is
            out["not_settled"] = [(d.stats()["hosts"], d.stats()["connections"]) for d in daemons]
            print(f"not settled: {out['not_settled']}", file=sys.stderr)
            listed = min(h for h, _ in out["not_settled"])

        # 2. steady state
        time.sleep(a.keepalive)
        c0 = [_count(p) for p in pipes]
        s0 = [d.stats() for d in daemons]
        r0 = store.cpu()
        time.sleep(a.measure)
        r1 = store.cpu()
        s1 = [d.stats() for d in daemons]
        c1 = [_count(p) for p in pipes]
        redis_after = store.info()
        trimmed = [d.trimmed() for d in daemons]
        out["load"].append(os.getloadavg())
        beats = sum(c[1] for c in c1) - sum(c[1] for c in c0)
        acked = sum(c[2] for c in c1) - sum(c[2] for c in c0)
        kept = sum(c[4] for c in c1)
        cpu = [b["cpu"] - a_["cpu"] for a_, b in zip(s0, s1, strict=True)]
        # The victim's hosts heartbeat through the stock client: one per keepalive.
        beats_total = beats + kept * a.measure / a.keepalive
        out["steady"] = {
            "hosts_listed": [s["hosts"] for s in s1],
            "heartbeats_per_s": beats_total / a.measure,
            "bench_heartbeats_acked_fraction": acked / beats if beats else None,
            "not_registered_answers": sum(c[5] for c in c1),
            "replica_cpu_fraction": [c / a.measure for c in cpu],
            "cpu_us_per_heartbeat": sum(cpu) / beats_total * 1e6,
            "replicas_cpu_us_per_host_per_s": sum(cpu) / a.measure / listed * 1e6,
            "redis_cpu_fraction": (r1 - r0) / a.measure,
            "redis_cpu_us_per_host_per_s": (r1 - r0) / a.measure / listed * 1e6,
            "rss_before": [b["rss"] for b in before],
            "rss": [s["rss"] for s in s1],
            "rss_per_host": [
                (s["rss"] - b["rss"]) / listed for s, b in zip(s1, before, strict=True)
            ],
            "rss_trimmed_per_host": [
                (t["rss"] - b["rss"]) / listed for t, b in zip(trimmed, before, strict=True)
            ],
            "redis_used_memory_before": redis_before["used_memory"],
            "redis_used_memory": redis_after["used_memory"],
            "redis_bytes_per_host": (redis_after["used_memory"] - redis_before["used_memory"])
            / listed,
            "redis_rss": redis_after["used_memory_rss"],
            "redis_keys": {
                name: store.client.memory_usage(f"{{mm}}:{name}", samples=0)
                for name in ("events", "seen")
            },
        }
        print(f"steady: {out['steady']}", file=sys.stderr)

        # 3. lists
        out["lists"] = {
            "server_ms": [_quantiles(d.plan(a.lists, 1000, FILTERS)) for d in daemons],
            "client_ms": [_quantiles(rudp.run(_client_lists(r, a.client_lists))) for r in replicas],
        }
        print(f"lists: {out['lists']}", file=sys.stderr)

        # 4. replication lag
        lag = rudp.run(_replication_lag(replicas, a.probes, f"127.{a.ip_base + a.processes}.0.1"))
        out["lag"] = {
            "register_ms": _quantiles(lag["register_s"]),
            "update_ms": _quantiles(lag["update_s"]),
            "poll_p50_ms": lag["poll_p50_s"] * 1e3,
            "raw": lag,
        }
        print(f"lag: {out['lag']}", file=sys.stderr)
        out["load"].append(os.getloadavg())

        # 5. failover
        victims: list[str] = []
        for p in pipes:
            p.send("victims")
            victims += expect(p, "victims", 60)[1]
        survivors = daemons[1:]
        gc_before_kill = [d.stats()["gc"] for d in daemons]
        cpu_at_kill = [d.stats()["cpu"] for d in survivors]
        registrations_before_kill = [d.stats()["registrations"] for d in survivors]
        daemons[0].kill()
        killed = time.monotonic()
        timeline: list[tuple[float, int]] = []

        def redis_rehomed() -> bool:
            owners = _owned_by(store, victims)
            left = sum(o == "r1" for o in owners)
            timeline.append((time.monotonic() - killed, left))
            return left == 0

        done = _until(redis_rehomed, a.failover_budget, 0.5)
        redis_s = None if done is None else time.monotonic() - killed
        done = _until(
            lambda: all(d.owners()["owners"].get("r1", 0) == 0 for d in survivors), 60, 0.25
        )
        index_s = None if done is None or redis_s is None else time.monotonic() - killed
        views = [d.owners() for d in survivors]
        moved: list[float] = []
        routes: list[str] = []
        taken = 0
        clients_cpu: list[float] = []
        for p in pipes:
            p.send("moved")
            _, times, _n, rts, took, cpu = expect(p, "moved", 60)
            moved += [t - killed for t in times]
            routes += rts
            taken += took
            clients_cpu.append(cpu)
        survivors_cpu = [d.stats()["cpu"] - c for d, c in zip(survivors, cpu_at_kill, strict=True)]
        out["failover"] = {
            "victim_hosts": len(victims),
            "client_moved_s": _quantiles(moved, 1.0),
            "client_still_on_victim": sum(names.get(r or "", "") == "r1" for r in routes),
            "redis_all_rehomed_s": redis_s,
            "redis_timeline": timeline,
            "survivor_indexes_rehomed_s": index_s,
            "survivor_views": views,
            "client_taken_over": taken,
            "survivors_cpu_s": survivors_cpu,
            "client_processes_cpu_s": clients_cpu,
            "survivor_heartbeats": [d.stats()["heartbeats"] for d in survivors],
            "survivor_registrations": {
                "before": registrations_before_kill,
                "after": [d.stats()["registrations"] for d in survivors],
            },
        }
        print(f"failover: {out['failover']}", file=sys.stderr)
        out["load"].append(os.getloadavg())
        final = [d.stats() for d in survivors]
        out["gc"] = [g for g in gc_before_kill[:1]] + [s["gc"] for s in final]
        for p in pipes:
            p.send("close")
        for p in pipes:
            expect(p, "closed", 120)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for d in daemons:
            with contextlib.suppress(Exception):
                d.__exit__(None, None, None)
        store.close()
    return out


def _count(pipe: Pipe) -> tuple[Any, ...]:
    pipe.send("count")
    result: tuple[Any, ...] = expect(pipe, "count", 60)
    return result


def _pq(q: dict[str, float], digits: int = 1) -> str:
    return f"{q['p50']:.{digits}f} / {q['p99']:.{digits}f}"


def _rows(a: argparse.Namespace, r: dict[str, Any]) -> list[list[Any]]:
    reg, st, li, lag, fo = r["register"], r["steady"], r["lists"], r["lag"], r["failover"]
    again = fo["client_moved_s"]
    cpu_per_host = st["replicas_cpu_us_per_host_per_s"], st["redis_cpu_us_per_host_per_s"]
    return [
        ["hosts / failed registrations", f"{a.hosts} / {reg['failed']}"],
        ["hosts per replica", str(reg["by_replica"])],
        ["registrations/s (3 replicas)", reg["per_s"]],
        ["registration CPU per replica, s", [round(c, 1) for c in reg["daemon_cpu_s"]]],
        ["heartbeats/s", st["heartbeats_per_s"]],
        ["replica CPU %", [round(c * 100, 1) for c in st["replica_cpu_fraction"]]],
        ["CPU µs per heartbeat (3 replicas)", st["cpu_us_per_heartbeat"]],
        ["CPU µs/s per host: replicas, Redis", "{:.2f}, {:.2f}".format(*cpu_per_host)],
        ["RSS KiB per host per replica", [round(x / 1024, 2) for x in st["rss_per_host"]]],
        ["trimmed", [round(x / 1024, 2) for x in st["rss_trimmed_per_host"]]],
        ["Redis bytes per host (used_memory)", st["redis_bytes_per_host"]],
        ["list server ms p50 / p99", [_pq(q, 2) for q in li["server_ms"]]],
        ["list client ms p50 / p99", [_pq(q) for q in li["client_ms"]]],
        ["replication lag ms p50 / p99, register", _pq(lag["register_ms"])],
        ["replication lag ms p50 / p99, update", _pq(lag["update_ms"])],
        ["lag poll round trip p50 ms", lag["poll_p50_ms"]],
        ["failover: victim hosts", fo["victim_hosts"]],
        ["moved to a live replica, s p50 / p99, max", f"{_pq(again)}, {again['max']:.1f}"],
        ["taken over on a heartbeat (no registration)", fo["client_taken_over"]],
        ["all owned by a live replica in Redis, s", fo["redis_all_rehomed_s"]],
        ["CPU s from the kill on: survivors", [round(c, 1) for c in fo["survivors_cpu_s"]]],
        ["... client processes", [round(c, 1) for c in fo["client_processes_cpu_s"]]],
        ["... and in the survivors' indexes, s", fo["survivor_indexes_rehomed_s"]],
        ["GC p99 ms by generation, per replica", [g["p99_ms"] for g in r["gc"]]],
        ["load average by phase", [tuple(round(x, 1) for x in load) for load in r["load"]]],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=50_000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--per-ip", type=int, default=256, help="sockets per loopback IP")
    parser.add_argument(
        "--ip-base", type=int, default=101, help="client process k: 127.(base+k).x.1"
    )
    parser.add_argument("--redis-port", type=int, default=21379)
    parser.add_argument("--keepalive", type=float, default=5.0)
    parser.add_argument(
        "--hide-after",
        type=float,
        default=1800.0,
        help="the daemons' (expiry: twice that); 15 in production",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="registrations in flight")
    parser.add_argument("--measure", type=float, default=20.0, help="seconds of steady state")
    parser.add_argument("--lists", type=int, default=300, help="server-side lists per replica")
    parser.add_argument("--client-lists", type=int, default=50, help="client lists per replica")
    parser.add_argument("--probes", type=int, default=100, help="replication lag samples")
    parser.add_argument("--register-budget", type=float, default=900.0)
    parser.add_argument("--failover-budget", type=float, default=180.0)
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.hosts / a.processes > 16_000:
        parser.error("more than 16,000 sockets per process (20,000 open files each)")
    if a.hosts + a.probes + 10 > MAX_SOCKETS:
        parser.error(f"more than {MAX_SOCKETS} sockets at once")
    r = run(a)
    print(format_table(["", "measured"], _rows(a, r)))
    path = write_json(
        "matchmaker-replicas",
        {"environment": environment(), "args": vars(a), **r},
        a.json,
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
