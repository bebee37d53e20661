"""How long a server list takes, client side, from the request to the end marker.

The daemon runs in its own process (bench/matchmaker_common.py) with N hosts
inserted straight into its registry, each on its own public-looking IP (so the
per-IP page cap does not shrink pages, as it would with every host on
127.0.0.1). The listing client runs in this process: one rudp endpoint, one
`MatchmakerClient`, connection opened before timing starts; each sample is one
`list_servers(game=..., limit=N)` call, i.e. request sent -> every page in ->
the page marked ``end`` (the whole answer, ``total`` hosts).

Links: ``clean`` is plain loopback; ``lossy`` puts rudp's in-process network
simulator on the *client's* endpoint, 2% loss and 50 ms latency in each
direction (100 ms round trip, 4% of round trips lose a datagram), seed 1.

    .venv/bin/python bench/matchmaker_list.py                     # 1k and 10k, clean and lossy
    .venv/bin/python bench/matchmaker_list.py --sizes 10000 --links lossy --repeat 100
    .venv/bin/python bench/matchmaker_list.py --set pages_in_flight=4 --set page_hosts=32

``--set NAME=VALUE`` overrides a daemon setting (e.g. the paging ones) to
compare against the defaults. ``--registry N`` registers N hosts however
small the lists, and ``--filter NAME=VALUE`` adds a list filter (the hosts of
bench/matchmaker_common.host_info: ``region=eu`` matches a third of them), so
a 1,000-host filtered answer out of 100,000 hosts is

    .venv/bin/python bench/matchmaker_list.py --registry 100000 --sizes 1000 \
        --links clean --filter region=eu --repeat 50

Prints a table, writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from bench._common import environment, format_table, percentile, write_json
from bench.matchmaker_common import (
    GAME,
    DaemonProcess,
    bench_settings,
    settings_dict,
)
from matchmaker.client import MatchmakerClient
from rudp.netsim import LinkProfile

LINKS = {
    "clean": None,
    "lossy": rudp.NetsimConfig(
        outbound=LinkProfile(loss=0.02, latency=0.05),
        inbound=LinkProfile(loss=0.02, latency=0.05),
        seed=1,
    ),
}
TARGET_SECONDS = 1.0  # 10,000 hosts over 2% loss and 100 ms RTT, at p99


async def measure(
    address: tuple[str, int],
    link: str,
    size: int,
    repeat: int,
    timeout: float,
    filters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    config = rudp.Config(netsim=LINKS[link])
    endpoint = await rudp.open_endpoint("127.0.0.1", 0, config=config)
    client = MatchmakerClient.to(*address, via=endpoint, timeout=timeout)
    times: list[float] = []
    failures = 0
    try:
        await client.info()  # connect (and one round trip) before timing
        for _ in range(repeat):
            started = time.perf_counter()
            try:
                hosts = await client.list_servers(game=GAME, limit=size, **(filters or {}))
            except TimeoutError:
                failures += 1
                continue
            times.append(time.perf_counter() - started)
            if len(hosts) != size:
                raise RuntimeError(f"got {len(hosts)} hosts, expected {size}")
        # The client's side of the connection, for the analysis.
        conn_stats = [c.stats for c in endpoint.endpoint.core.connections]
        stats = conn_stats[0] if conn_stats else None
        resent = stats.messages_resent if stats else None
        srtt = stats.srtt if stats else None
    finally:
        await client.close()
        await endpoint.close()
    ordered = sorted(times)
    return {
        "link": link,
        "hosts": size,
        "samples": len(times),
        "failures": failures,
        "p50_s": percentile(ordered, 50),
        "p99_s": percentile(ordered, 99),
        "mean_s": statistics.fmean(times) if times else float("nan"),
        "min_s": ordered[0] if ordered else float("nan"),
        "max_s": ordered[-1] if ordered else float("nan"),
        "client_srtt_s": srtt,
        "client_messages_resent": resent,
        "times_s": times,
    }


def parse_filters(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        if name in ("not_full", "not_empty", "password"):
            out[name] = value in ("1", "true")
        elif name in ("tags_all", "tags_any"):
            out[name] = value.split(",")
        else:
            out[name] = value
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = float(value) if "." in value else int(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--links", default="clean,lossy")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--registry", type=int, default=0, help="hosts registered (default: size)")
    parser.add_argument("--filter", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    links = args.links.split(",")
    settings = bench_settings(**parse_set(args.set))
    results: list[dict[str, Any]] = []
    with DaemonProcess(settings, use_uvloop=not args.no_uvloop) as daemon:
        populated = 0
        filters = parse_filters(args.filter)
        for size in sorted(sizes):
            target = max(size, args.registry)
            if target > populated:
                info = daemon.populate(target - populated)
                populated = target
                print(f"registry: {info['hosts']} hosts", file=sys.stderr)
            for link in links:
                result = rudp.run(
                    measure(daemon.udp_address, link, size, args.repeat, args.timeout, filters),
                    use_uvloop=not args.no_uvloop,
                )
                result["registry"] = populated
                results.append(result)
                print(f"{link:6} {size:6} hosts: p50 {result['p50_s']:.3f} s", file=sys.stderr)
        daemon_stats = daemon.stats()
    rows = [
        [
            r["link"],
            r["hosts"],
            r["samples"],
            r["failures"],
            r["registry"],
            r["p50_s"] * 1000,
            r["p99_s"] * 1000,
            r["mean_s"] * 1000,
            r["min_s"] * 1000,
            r["max_s"] * 1000,
            r["client_messages_resent"],
        ]
        for r in results
    ]
    headers = ["link", "hosts", "n", "timeouts", "registry", "p50 ms", "p99 ms", "mean ms"]
    headers += ["min ms", "max ms", "resent"]
    print(format_table(headers, rows))
    paging = {k: getattr(settings, k) for k in ("page_hosts", "page_bytes", "pages_in_flight")}
    print(f"\npaging: {paging}; target: 10,000 hosts, lossy, p99 <= {TARGET_SECONDS} s")
    path = write_json(
        "matchmaker-list",
        {
            "environment": environment(),
            "args": vars(args),
            "settings": settings_dict(settings),
            "results": results,
            "daemon": daemon_stats,
        },
        args.json,
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
