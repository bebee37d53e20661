"""What ``/metrics`` costs the daemon at a large registry, scraped in a loop.

No sockets: N hosts are registered straight into a `MemoryRegistry` in this
process, a `Metrics` is bound to it as the daemon binds its own (the
hosts-listed gauge reads the registry's counts per game), and the exposition is
built back to back for ``--seconds``, as a client scraping in a loop makes the
daemon build it (the HTTP server builds one answer at a time).  Each build is
timed with ``perf_counter``; the table gives the builds made, their p50 and
maximum, and how many of them counted the registry (at most one a second,
``HOSTS_LISTED_MAX_AGE``).  ``--count-every-scrape`` counts for every build, as
the daemon did before.

    .venv/bin/python bench/matchmaker_scrape.py                  # 100k hosts, 3 s
    .venv/bin/python bench/matchmaker_scrape.py --count-every-scrape

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest

from bench._common import environment, format_table, percentile, write_json
from bench.matchmaker_index import populate
from matchmaker.metrics import Metrics
from matchmaker.registry import MemoryRegistry


async def run(args: argparse.Namespace) -> dict[str, Any]:
    registry = MemoryRegistry(hide_after=3600.0, expire_after=3600.0)
    await populate(registry, args.hosts)
    counts = 0

    def hosts_by_game() -> dict[str, int]:
        nonlocal counts
        counts += 1
        return registry.count_by_game()

    metrics = Metrics(CollectorRegistry())
    # A clock that never advances counts once; one that always does, every time.
    clock = (lambda: counts * 1e9) if args.count_every_scrape else time.monotonic
    metrics.bind_state(
        hosts_by_game=hosts_by_game,
        stale=lambda: False,
        connections=lambda: 0,
        max_games=50,
        clock=clock,
    )
    load_before = os.getloadavg()
    times: list[float] = []
    end = time.perf_counter() + args.seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        generate_latest(metrics.registry)
        times.append(time.perf_counter() - began)
    times.sort()
    return {
        "hosts": args.hosts,
        "seconds": args.seconds,
        "count_every_scrape": args.count_every_scrape,
        "builds": len(times),
        "counts": counts,
        "p50_s": percentile(times, 0.5),
        "max_s": times[-1],
        "busy_s": sum(times),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "environment": environment(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--count-every-scrape", action="store_true", help="count the registry for every build"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    headers = ["hosts", "builds", "registry counts", "p50 ms", "max ms", "load before, after"]
    row = [
        result["hosts"],
        result["builds"],
        result["counts"],
        result["p50_s"] * 1000,
        result["max_s"] * 1000,
        f"{result['load_before'][0]:.2f}, {result['load_after'][0]:.2f}",
    ]
    print(format_table(headers, [row]))
    print(f"results: {write_json('matchmaker_scrape', result, args.json)}")


if __name__ == "__main__":
    main()
