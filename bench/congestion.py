"""Congestion control on a slow path: a bulk reliable transfer next to a game's
unreliable state stream, with ``Config.congestion_control`` off (the baseline, same
run) and on.

The client's own link conditioner (``Config.netsim``) impairs its traffic over
loopback. Two paths:

* ``bottleneck``: 1 MB/s toward the server through a 16 kB drop-tail queue, 20 ms
  each way (under half the bandwidth-delay product of queue: a shallow buffer);
* ``lossy``: 2 % random loss each way, 20 ms each way, no bandwidth limit.

The client sends ``--count`` reliable 1000-byte messages (``SendQueueFull`` ->
``drain()``) and, all along, one 100-byte unreliable message per 1/60 s on channel
1, stamped with the send time. Reported per case: transfer time and goodput, the
datagrams the client sent per message delivered, how many the bottleneck queue
dropped, and how many of the game's updates arrived and how late (one-way, p50 and
p95; the 20 ms latency is part of it).

    python bench/congestion.py [--count 2000] [--uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import struct
import time
from typing import Any

import rudp
from rudp.netsim import LinkProfile

STAMP = struct.Struct("!d")
TICK = 1 / 60
PATHS: dict[str, tuple[LinkProfile, LinkProfile]] = {
    "bottleneck": (
        LinkProfile(latency=0.02, bandwidth=1_000_000, queue_limit=16 * 1024),
        LinkProfile(latency=0.02),
    ),
    "lossy": (LinkProfile(latency=0.02, loss=0.02), LinkProfile(latency=0.02, loss=0.02)),
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def case(path: str, cc: bool, count: int) -> dict[str, Any]:
    outbound, inbound = PATHS[path]
    got_reliable = 0
    done = asyncio.get_running_loop().create_future()
    delays: list[float] = []

    async def handler(conn: rudp.Connection) -> None:
        nonlocal got_reliable
        with contextlib.suppress(rudp.ConnectionClosed):
            async for msg in conn:
                if msg.channel == 1:
                    delays.append(time.monotonic() - STAMP.unpack_from(msg.data)[0])
                    continue
                got_reliable += 1
                if got_reliable == count and not done.done():
                    done.set_result(time.monotonic())

    config = rudp.Config(
        congestion_control=cc,
        netsim=rudp.NetsimConfig(outbound=outbound, inbound=inbound, seed=7),
    )
    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        conn = await rudp.connect(*server.address, config=config)

        async def game() -> int:
            sent = 0
            while not done.done():
                conn.send(STAMP.pack(time.monotonic()) + bytes(92), reliable=False, channel=1)
                sent += 1
                await asyncio.sleep(TICK)
            return sent

        game_task = asyncio.create_task(game())
        start = time.monotonic()
        data = bytes(1000)
        for _ in range(count):
            while True:
                try:
                    conn.send(data)
                    break
                except rudp.SendQueueFull:
                    await conn.drain()
        end = await asyncio.wait_for(done, 300)
        updates = await game_task
        stats = conn.stats
        pipe = conn._endpoint._outbound  # the client's own conditioner
        result = {
            "path": path,
            "congestion_control": cc,
            "seconds": end - start,
            "goodput_kB_s": count * 1000 / (end - start) / 1000,
            "datagrams_per_message": stats.packets_sent / count,
            "queue_drops": pipe.stats.dropped_queue,
            "resent": stats.messages_resent,
            "congestion_events": stats.congestion_events,
            "updates_delivered": len(delays) / updates if updates else float("nan"),
            "update_p50_ms": percentile(delays, 0.5) * 1000,
            "update_p95_ms": percentile(delays, 0.95) * 1000,
        }
        await conn.close()
    return result


async def main(count: int) -> list[dict[str, Any]]:
    results = []
    for path in PATHS:
        for cc in (False, True):
            results.append(await case(path, cc, count))
    return results


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| path | congestion control | transfer s | goodput kB/s | datagrams/msg"
        " | queue drops | resent | game updates delivered | update p50 ms | p95 ms |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['path']} | {'on' if r['congestion_control'] else 'off'}"
            f" | {r['seconds']:.2f} | {r['goodput_kB_s']:.0f} | {r['datagrams_per_message']:.2f}"
            f" | {r['queue_drops']:,} | {r['resent']:,} | {r['updates_delivered']:.1%}"
            f" | {r['update_p50_ms']:.1f} | {r['update_p95_ms']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = rudp.run(main(args.count), use_uvloop=args.uvloop)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
