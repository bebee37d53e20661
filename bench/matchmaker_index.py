"""Server time of a filtered list over a large registry, and the collector's pauses meanwhile.

No sockets: N hosts are registered straight into a `MemoryRegistry` in this
process and a `MatchmakerService` plans and encodes list answers, exactly the
work the daemon does for a ``ListRequest`` before the first page is handed to
rudp (filter, random sample, per-IP pages, pages by size, page encoding).
Each sample is one such answer, timed with ``perf_counter`` (wall time: what a
client waits for) and ``thread_time`` (CPU time: the same without the time the
process spent waiting for a core, which a shared machine adds to the tail).

Between lists the registry sees the traffic a live fleet sends: heartbeats
(``--touch`` hosts per list, as the sweeper's one batched ``touch``), updates
(``--updates`` per list, players joining and leaving) and hosts leaving while
new ones register (``--churn`` per list), so that records are replaced and
the collector has survivors to trace, as in production.  What makes the
collector run at all in a daemon is garbage in reference cycles (the event
loop's tasks, futures and exceptions with their tracebacks): ``--cycles``
small cycles per list stand in for it.

The collector's pauses are timed with ``gc.callbacks`` (start to stop of each
collection, per generation) for the whole listing phase.  At the end one full
collection is timed on its own (``gc.collect()``): the pause a full pass over
this many hosts costs whenever CPython decides to make one.  The objects the
collector tracks are counted (``gc.get_objects()``) before the hosts register
and after, per host: what each host adds to every full collection.

    .venv/bin/python bench/matchmaker_index.py                         # 100k hosts, 2000 lists
    .venv/bin/python bench/matchmaker_index.py --hosts 10000 --lists 500
    .venv/bin/python bench/matchmaker_index.py --gc default   # the interpreter's own GC settings

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry

from bench._common import environment, format_table, percentile, write_json
from bench.matchmaker_common import GAME, bench_settings, host_info, public_address, rss_bytes
from matchmaker.messages import ListFilter, ListRequest, encode_page
from matchmaker.metrics import Metrics
from matchmaker.registry import MemoryRegistry, RemovalReason
from matchmaker.service import MatchmakerService, _list_entry

# Filters of the bench hosts (bench/matchmaker_common.host_info): each matches
# from a sixth to a third of them, so every list is a 1,000-host sample.
FILTERS = {
    "region": ListFilter(game=GAME, region="eu"),
    "region+not_full": ListFilter(game=GAME, region="us", not_full=True),
    "tag": ListFilter(game=GAME, tags_all=("ctf",)),
    "map+not_empty": ListFilter(game=GAME, map="q3dm17", not_empty=True),
    "version+password": ListFilter(game=GAME, version="1.32c", password=False),
}


class GcTimer:
    """Durations of every collection, per generation, through ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self.cpu: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = self._cpu_started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started, self._cpu_started = time.perf_counter(), time.thread_time()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._started)
            self.cpu[info["generation"]].append(time.thread_time() - self._cpu_started)

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def populate(registry: MemoryRegistry, n: int) -> None:
    for i in range(n):
        await registry.upsert(public_address(i), host_info(i), max_per_ip=1_000_000)


async def answer(service: MatchmakerService, req: ListRequest) -> int:
    """One list answer, planned and encoded as the daemon sends it; returns its host count."""
    total, pages = await service._plan_list(req)
    for seq, (_, entries) in enumerate(pages):
        encode_page(
            request_id=req.request_id,
            seq=seq,
            total=total,
            end=seq == len(pages) - 1,
            entries=entries,
        )
    return total


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.gc == "tuned":
        from matchmaker.gctuning import GC_THRESHOLDS, tune_gc

        # What the daemon does once started, before any host registers.
        tune_gc(tuple(args.thresholds) if args.thresholds else GC_THRESHOLDS)
    registry = MemoryRegistry(hide_after=3600.0, expire_after=3600.0)
    settings = bench_settings(list_limit=args.limit)
    service = MatchmakerService(settings, registry, Metrics(CollectorRegistry()))
    gc.collect()
    tracked_before = len(gc.get_objects())
    rss_before = rss_bytes()
    started = time.perf_counter()
    await populate(registry, args.hosts)
    populate_s = time.perf_counter() - started
    rss_after = rss_bytes()
    # What the registration left for the collector, per generation, before and after
    # a collection (rows are untracked once one has seen them).
    per_generation = [len(gc.get_objects(generation=g)) for g in range(3)]
    gc.collect()
    tracked_per_host = (len(gc.get_objects()) - tracked_before) / max(args.hosts, 1)
    rng = random.Random(1)
    # Host numbers, not addresses: 100,000 Address objects held here would be
    # traced by every full collection as if the registry held them.
    numbers = list(range(args.hosts))
    names = list(FILTERS)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: list[float] = []
    sizes: set[int] = set()
    # A daemon that has served lists for a while holds every host's encoded list
    # entry (re-encoded after an update): start from there.
    for record in registry.index():
        if not record.entry:
            _list_entry(record)
    rss_cached = rss_bytes()
    touch_s = update_s = 0.0
    touched = updated = fresh = 0
    with GcTimer() as timer:
        for i in range(args.lists):
            name = names[i % len(names)]
            req = ListRequest(request_id=i + 1, filter=replace(FILTERS[name], limit=args.limit))
            t0, c0 = time.perf_counter(), time.thread_time()
            sizes.add(await answer(service, req))
            times[name].append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            batch = [public_address(k) for k in rng.sample(numbers, args.touch)]
            t0 = time.perf_counter()
            await registry.touch(batch)
            touch_s += time.perf_counter() - t0
            touched += len(batch)
            for _ in range(args.churn):
                j = rng.randrange(len(numbers))
                gone = registry.get(public_address(numbers[j]))
                if gone is not None:
                    await registry.remove(gone.address, RemovalReason.UNREGISTERED)
                    k = args.hosts + fresh
                    fresh += 1
                    numbers[j] = k
                    await registry.upsert(public_address(k), host_info(k), max_per_ip=1_000_000)
            for _ in range(args.cycles):
                a: list[Any] = []
                a.append(a)
            for _ in range(args.updates):
                j = rng.randrange(args.hosts)
                rec = registry.get(public_address(numbers[j]))
                if rec is not None:
                    info = host_info(numbers[j])
                    info = _with_players(info, rng.randrange(info.max_players + 1))
                    t0 = time.perf_counter()
                    await registry.update(rec.address, rec.token, info)
                    update_s += time.perf_counter() - t0
                    updated += 1
    t0 = time.perf_counter()
    gc.collect()
    full_collection_s = time.perf_counter() - t0
    every = sorted(t for ts in times.values() for t in ts)
    cpu.sort()
    pauses = {g: sorted(p) for g, p in timer.pauses.items()}
    cpu_pauses = {g: sorted(p) for g, p in timer.cpu.items()}
    return {
        "hosts": args.hosts,
        "lists": args.lists,
        "limit": args.limit,
        "result_sizes": sorted(sizes),
        "gc": args.gc,
        "gc_threshold": gc.get_threshold(),
        "populate_s": populate_s,
        "rss_per_host_bytes": (rss_after - rss_before) / max(args.hosts, 1),
        "rss_bytes": rss_after,
        "entry_cache_per_host_bytes": (rss_cached - rss_after) / max(args.hosts, 1),
        "touch_us": touch_s / max(touched, 1) * 1e6,
        "update_us": update_s / max(updated, 1) * 1e6,
        "p50_s": percentile(every, 50),
        "p99_s": percentile(every, 99),
        "max_s": every[-1],
        "cpu_p50_s": percentile(cpu, 50),
        "cpu_p99_s": percentile(cpu, 99),
        "by_filter": {
            name: {"p50_s": percentile(sorted(ts), 50), "p99_s": percentile(sorted(ts), 99)}
            for name, ts in times.items()
        },
        "gc_pauses": {
            g: {
                "count": len(p),
                "p99_s": percentile(p, 99) if p else 0.0,
                "max_s": p[-1] if p else 0.0,
                "p50_s": percentile(p, 50) if p else 0.0,
                "cpu_p50_s": percentile(cpu_pauses[g], 50) if p else 0.0,
                "cpu_p99_s": percentile(cpu_pauses[g], 99) if p else 0.0,
                "cpu_max_s": cpu_pauses[g][-1] if p else 0.0,
            }
            for g, p in pauses.items()
        },
        "full_collection_s": full_collection_s,
        "tracked_objects_per_host": tracked_per_host,
        "tracked_by_generation_after_registering": per_generation,
        "tracked_objects_per_host_at_end": (len(gc.get_objects()) - tracked_before)
        / max(args.hosts, 1),
        "gc_all_p99_s": percentile(sorted(x for p in pauses.values() for x in p), 99),
    }


def _with_players(info: Any, players: int) -> Any:
    return replace(info, players=players)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100_000)
    parser.add_argument("--lists", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--touch", type=int, default=200, help="heartbeats written per list")
    parser.add_argument("--updates", type=int, default=20, help="info updates per list")
    parser.add_argument("--churn", type=int, default=2, help="hosts replaced per list")
    parser.add_argument("--cycles", type=int, default=50, help="reference cycles left per list")
    parser.add_argument("--gc", choices=("tuned", "default"), default="tuned")
    parser.add_argument(
        "--thresholds", type=int, nargs=3, metavar="N", help="with --gc tuned: other thresholds"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    rows = [[name, r["p50_s"] * 1000, r["p99_s"] * 1000] for name, r in result["by_filter"].items()]
    rows.append(["all", result["p50_s"] * 1000, result["p99_s"] * 1000])
    rows.append(["all, CPU time", result["cpu_p50_s"] * 1000, result["cpu_p99_s"] * 1000])
    print(format_table(["filter", "p50 ms", "p99 ms"], rows))
    gc_rows = [
        [
            g,
            p["count"],
            p["p50_s"] * 1000,
            p["p99_s"] * 1000,
            p["max_s"] * 1000,
            p["cpu_p50_s"] * 1000,
            p["cpu_p99_s"] * 1000,
        ]
        for g, p in result["gc_pauses"].items()
    ]
    print()
    headers = ["gc gen", "collections", "p50 ms", "p99 ms", "max ms", "CPU p50", "CPU p99"]
    print(format_table(headers, gc_rows))
    print(f"one full collection, timed alone: {result['full_collection_s'] * 1000:.1f} ms")
    print(
        f"objects the collector tracks, per host: {result['tracked_objects_per_host']:.3f} "
        f"after registering ({result['tracked_objects_per_host_at_end']:.3f} at the end); "
        f"by generation before the first collection: "
        f"{result['tracked_by_generation_after_registering']}"
    )
    print(
        f"\nhosts {result['hosts']}, answers of {result['result_sizes']} hosts, "
        f"max {result['max_s'] * 1000:.2f} ms, gc {result['gc']} {result['gc_threshold']}, "
        f"RSS {result['rss_bytes'] / 2**20:.0f} MiB, "
        f"{result['rss_per_host_bytes']:.0f} B/host (registry) "
        f"+ {result['entry_cache_per_host_bytes']:.0f} B/host (encoded entries); "
        f"heartbeat {result['touch_us']:.2f} us, update {result['update_us']:.1f} us per host"
    )
    path = write_json(
        "matchmaker-index", {"environment": environment(), "args": vars(args), **result}, args.json
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
