"""Where the time goes: cProfile the rudp throughput sender and receiver processes.

Runs one rudp throughput case (``bench/throughput.py``'s roles) with cProfile
enabled in both processes, writes the ``.prof`` files to bench/results/ and
prints the top functions by own time and by cumulative time. Percentages are of
the process's *busy* time: profiled wall time minus the time spent blocked in
the selector (``select.epoll.poll``), so profile with the default asyncio loop
(under uvloop the wait happens inside C code cProfile cannot separate out).

    python bench/hotspots.py --size 64 --count 60000
    python -m pstats bench/results/hotspots-*-client.prof   # explore further
"""

from __future__ import annotations

import argparse
import pstats
import sys
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, loop_name
from throughput import parse_config_overrides, run_case

IDLE_FUNCTIONS = ("<method 'poll' of 'select.epoll' objects>", "<method 'select' of")


def _label(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    path = Path(filename)
    parts = path.parts
    if "rudp" in parts:
        short = "/".join(parts[len(parts) - 1 - parts[::-1].index("rudp") :])
    elif "asyncio" in parts:
        short = "asyncio/" + path.name
    else:
        short = path.name
    return f"{short}:{line}:{name}"


def summarize(prof_path: str, top: int, only_rudp: bool) -> dict[str, Any]:
    stats = pstats.Stats(prof_path)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values())
    idle = sum(
        entry[2]
        for func, entry in raw.items()
        if any(_label(func).startswith(marker) for marker in IDLE_FUNCTIONS)
    )
    busy = max(total - idle, 1e-9)
    rows = []
    for func, (_cc, ncalls, tottime, cumtime, _callers) in raw.items():
        label = _label(func)
        if only_rudp and (not label.startswith("rudp/") or label.endswith(":run")):
            continue
        rows.append(
            {
                "function": label,
                "calls": ncalls,
                "own_s": tottime,
                "own_pct": 100.0 * tottime / busy,
                "cum_s": cumtime,
                "cum_pct": 100.0 * cumtime / busy,
            }
        )
    return {
        "total_s": total,
        "idle_s": idle,
        "busy_s": busy,
        "by_own": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "by_cum": sorted(rows, key=lambda r: -r["cum_s"])[:top],
    }


def print_summary(title: str, summary: dict[str, Any]) -> None:
    print(
        f"\n## {title}: busy {summary['busy_s']:.2f} s "
        f"(profiled {summary['total_s']:.2f} s, idle in poll {summary['idle_s']:.2f} s)"
    )
    for key, heading in (("by_own", "own time"), ("by_cum", "cumulative time")):
        print(f"\n### top by {heading}\n")
        print("| function | calls | own % | cum % |")
        print("|---|---:|---:|---:|")
        for r in summary[key]:
            print(f"| {r['function']} | {r['calls']} | {r['own_pct']:.1f} | {r['cum_pct']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--count", type=int, default=60_000)
    parser.add_argument("--cap", type=float, default=3.0)
    parser.add_argument("--uvloop", action="store_true", help="profile under uvloop instead")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--all", action="store_true", help="include non-rudp functions")
    parser.add_argument("--rudp-config", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    prefix = str(RESULTS_DIR / f"hotspots-{time.strftime('%Y%m%d-%H%M%S')}-{args.size}")
    row = run_case(
        "rudp",
        args.size,
        args.uvloop,
        args.count,
        args.cap,
        parse_config_overrides(args.rudp_config),
        profile_prefix=prefix,
    )
    print(
        f"# rudp {args.size} B, {loop_name(args.uvloop)}, under cProfile: "
        f"{row['rate']:,.0f} msg/s delivered, {row['sent']} sent, "
        f"resent {row.get('resent_pct', 0):.1f}%"
    )
    for role, title in (("client", "sender"), ("server", "receiver")):
        print_summary(title, summarize(f"{prefix}-{role}.prof", args.top, not args.all))
    print(f"\nprofiles: {prefix}-client.prof (sender), {prefix}-server.prof (receiver)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
