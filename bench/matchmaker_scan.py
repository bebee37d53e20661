"""CPU of one list request by filter, over a large game: filters an index array
serves against filters none does (a name substring, ``password``, many unknown
``tags_any``), which a request answers from a bounded number of hosts.

A daemon on loopback, N hosts registered straight into its `MemoryRegistry`.
Each case times the daemon's planning of an answer (``MatchmakerService._plan``:
what a ``ListRequest`` and ``GET /servers`` both run before the first page
goes out) in process CPU time, averaged over ``--repeat`` requests.  Then one
client sends a burst of 10 list requests with a name no host has (the burst
the default ``--list-rate`` allows one source) over rudp while a ticker
measures how late the event loop runs.

    .venv/bin/python bench/matchmaker_scan.py                 # 20,000 hosts
    .venv/bin/python bench/matchmaker_scan.py --hosts 100000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import rudp
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.messages import HostInfo, ListFilter, ListRequest
from matchmaker.server import Matchmaker
from matchmaker.settings import Settings

TAGS = ("ctf", "ffa", "insta", "mod", "ranked")
UNKNOWN_16 = tuple(f"zz{k:02d}" + "q" * 28 for k in range(16))
CASES = {
    "plain, limit 1000": ListFilter(game="q3"),
    "plain, limit 50": ListFilter(game="q3", limit=50),
    "name no host has, limit 1000": ListFilter(game="q3", name="\u00df" * 64),
    "name no host has, limit 1": ListFilter(game="q3", name="Q" * 64, limit=1),
    "tags_any 16 unknown, limit 1": ListFilter(game="q3", tags_any=UNKNOWN_16, limit=1),
    "tags_any 16 unknown + name": ListFilter(game="q3", tags_any=UNKNOWN_16, name="Q", limit=1),
    "not_full + name, limit 1": ListFilter(game="q3", not_full=True, name="Q" * 64, limit=1),
    "password=true (none), limit 1": ListFilter(game="q3", password=True, limit=1),
    "tags_any ctf,mod, limit 1000": ListFilter(game="q3", tags_any=("ctf", "mod")),
}


async def main(hosts: int, repeat: int) -> None:
    settings = Settings(
        bind="127.0.0.1",
        port=0,
        http_bind="127.0.0.1",
        http_port=0,
        allow_private=True,
        max_connections_per_source=0,
        handshake_rate=0.0,
        list_burst=1000.0,  # the burst below is one source's, ten requests
        lists_per_connection=10,  # on one connection, all unanswered at once
        log_level="warning",
    )
    mm = Matchmaker(settings)
    await mm.start()
    rng = random.Random(1)
    for i in range(hosts):
        ip = f"93.{184 + i // 65000}.{(i // 250) % 256}.{i % 250 + 1}"
        info = HostInfo(
            name=f"Server number {i} " + "x" * 40,
            game="q3",
            version="1",
            max_players=16,
            players=rng.randrange(0, 17),
            map="dm1",
            region="eu",
            tags=tuple(t for t in TAGS if rng.random() < 0.5),
        )
        await mm.registry.upsert(Address(ip, 27960), info, max_per_ip=10**9)
    print(f"{hosts} hosts; CPU per request, mean of {repeat}")
    for label, f in CASES.items():
        req = ListRequest(request_id=1, filter=f)
        t0 = time.process_time()
        for _ in range(repeat):
            listing, _ = await mm.service._plan(req)
        ms = (time.process_time() - t0) / repeat * 1000
        # (getattr: the same bench runs on a build from before partial answers)
        partial = "" if getattr(listing, "complete", True) else "  partial"
        print(f"  {label:32s} {ms:8.2f} ms  {len(listing.entries):5d} hosts{partial}")

    endpoint = await rudp.serve(lambda c: c.wait_closed(), "127.0.0.1", 0)
    client = MatchmakerClient.to(*mm.udp_address, via=endpoint)
    await client.list_servers(game="q3", limit=1)  # connected
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.001)
            lags.append(time.monotonic() - t - 0.001)

    ticks = asyncio.create_task(ticker())
    cpu, wall = time.process_time(), time.monotonic()
    answers = await asyncio.gather(
        *(client.list_servers(game="q3", name="Q" * 64) for _ in range(10))
    )
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    stop.set()
    await ticks
    print(
        f"burst of 10 lists (name no host has, limit 1000) over rudp: wall {wall * 1000:.0f} ms, "
        f"process CPU {cpu * 1000:.0f} ms, worst loop lag {max(lags) * 1000:.0f} ms, "
        f"limit_reached {all(a.limit_reached for a in answers)}"
    )
    await client.close()
    await endpoint.close()
    await mm.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.hosts, args.repeat))
