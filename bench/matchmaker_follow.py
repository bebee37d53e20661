"""What a replica spends applying another replica's changes: CPU per stream event.

Every replica follows every other one's writes through the Redis stream
(`matchmaker.registry.redis`), so this cost, paid once per change per other
replica, caps what more replicas (or worker processes) buy.

A redis-server of the bench's own (``--redis-port``), a *writer* (a
`RedisRegistry` in this process, making real changes through the real scripts)
and a *follower* (a `RedisRegistry` in a process of its own, doing nothing else).
For each phase the follower is stopped (SIGSTOP), the writer makes its changes,
then the follower runs again and catches up on the backlog (``XREAD COUNT``
batches): the CPU it used meanwhile (its main thread's ``schedstat``) divided by
the events of the phase is the figure.  Phases:

==============  ====================================================================
register        ``--hosts`` new registrations (one ``upsert`` event each)
reregister      the same addresses registered again (new tokens: ``upsert``)
touch           heartbeat batches of ``--batch`` hosts (one ``touch`` event a batch)
owner           take-overs by a second writer, batches of ``--batch`` (``owner``)
remove          every host removed (one ``remove`` event each)
==============  ====================================================================

``--live`` lets the follower run while the writer writes (small batches, often one
event per ``XREAD``: the worst case, and the usual one at moderate load).

Compare two trees of the code by running the bench with each one first on
``PYTHONPATH``; ``--no-hiredis`` makes the follower parse replies in Python
even where hiredis is installed.  Prints one JSON line.

    python -m bench.matchmaker_follow --hosts 10000 --redis-port 26379
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.connection import Connection as Pipe
from typing import Any

PREFIX = "{mmf}:"


def _cpu_ns(pid: int) -> int:
    """CPU time of `pid`'s threads so far, ns (schedstat: its first field)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def _follower_main(url: str, pipe: Pipe, no_hiredis: bool, profile: str) -> None:
    if no_hiredis:
        sys.modules["hiredis"] = None  # type: ignore[assignment]
    from matchmaker.registry.redis import RedisRegistry, _sid

    async def main() -> None:
        reg = RedisRegistry(url, prefix=PREFIX, replica_id="follower", expire_after=3600.0)
        await reg.start()
        await reg.wait_synced()
        loop = asyncio.get_running_loop()
        got: asyncio.Queue[Any] = asyncio.Queue()
        loop.add_reader(pipe.fileno(), lambda: got.put_nowait(pipe.recv()))
        import redis

        pipe.send(("ready", os.getpid(), redis.utils.HIREDIS_AVAILABLE))
        while True:
            target = await got.get()
            if target is None:
                break
            want = _sid(target)
            while _sid(reg._last_id) < want:
                await asyncio.sleep(0.002)
            pipe.send(("done", len(reg.index())))
        await reg.close()

    if not profile:
        asyncio.run(main())
        return
    import cProfile

    cProfile.runctx("asyncio.run(main())", globals(), {"asyncio": asyncio, "main": main}, profile)


async def _writer(a: argparse.Namespace, url: str, pipe: Pipe, pid: int) -> dict[str, Any]:
    from matchmaker.addresses import Address
    from matchmaker.messages import HostInfo
    from matchmaker.registry.base import RemovalReason, Takeover
    from matchmaker.registry.redis import RedisRegistry

    w = RedisRegistry(url, prefix=PREFIX, replica_id="writer-a", expire_after=3600.0)
    w2 = RedisRegistry(url, prefix=PREFIX, replica_id="writer-b", expire_after=3600.0)
    for r in (w, w2):
        await r.start()
        await r.wait_synced()
    addrs = [Address(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 7777) for i in range(a.hosts)]

    def info(i: int, gen: int) -> HostInfo:
        return HostInfo(
            name=f"host {i} {gen}",
            game="bench",
            version="1.2",
            max_players=16,
            players=i % 16,
            map=("dust", "port", "mill")[i % 3],
            tags=("ranked", "eu") if i % 2 else ("casual",),
            region="eu",
        )

    tokens: dict[Address, str] = {}

    async def register(gen: int) -> int:
        for i, addr in enumerate(addrs):
            tokens[addr] = (await w.upsert(addr, info(i, gen), max_per_ip=10)).token
        return len(addrs)

    async def touch() -> int:
        n = 0
        for i in range(0, len(addrs), a.batch):
            await w.touch({x: 1_000 + i for x in addrs[i : i + a.batch]})
            n += 1
        return n

    async def owner() -> int:
        n = 0
        for i in range(0, len(addrs), a.batch):
            beats = [Takeover(x, tokens[x], 5_000_000) for x in addrs[i : i + a.batch]]
            await w2.take_over(beats)
            n += 1
        return n

    async def remove() -> int:
        for addr in addrs:
            await w.remove(addr, RemovalReason.DISCONNECTED)
        return len(addrs)

    phases = [
        ("register", lambda: register(0)),
        ("reregister", lambda: register(1)),
        ("touch", touch),
        ("owner", owner),
        ("remove", remove),
    ]
    out: dict[str, Any] = {}
    for name, make in phases:
        if not a.live:
            os.kill(pid, signal.SIGSTOP)
        before = _cpu_ns(pid)
        events = await make()
        last = await w._redis.xrevrange(w._k("events"), count=1)
        if not a.live:
            os.kill(pid, signal.SIGCONT)
        pipe.send(last[0][0].decode())
        _, listed = pipe.recv()
        used = _cpu_ns(pid) - before
        out[name] = {"events": events, "us_per_event": round(used / events / 1e3, 2)}
        if name in ("touch", "owner"):
            out[name]["us_per_host"] = round(used / len(addrs) / 1e3, 3)
        out[name]["listed"] = listed
    for r in (w, w2):
        await r.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=100, help="hosts per touch / take-over")
    p.add_argument("--redis-port", type=int, default=26379)
    p.add_argument("--live", action="store_true", help="follow while the writer writes")
    p.add_argument("--no-hiredis", action="store_true", help="follower without hiredis")
    p.add_argument("--label", default="")
    p.add_argument("--profile", default="", help="write the follower's cProfile stats here")
    a = p.parse_args()
    # Here, not at the top: the follower process must not import redis-py (and
    # hiredis) before it chose whether to (--no-hiredis).
    from bench.matchmaker_common import RedisServer

    server = RedisServer(a.redis_port)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_follower_main, args=(server.url, theirs, a.no_hiredis, a.profile))
    child.start()
    try:
        _, pid, hiredis = mine.recv()
        started = time.monotonic()
        phases = asyncio.run(_writer(a, server.url, mine, pid))
        mine.send(None)
        child.join(30)
        result = {
            "label": a.label,
            "hosts": a.hosts,
            "batch": a.batch,
            "live": a.live,
            "hiredis": hiredis,
            "seconds": round(time.monotonic() - started, 1),
            "loadavg": os.getloadavg()[0],
            "phases": phases,
        }
        print(json.dumps(result))
    finally:
        if child.is_alive():
            child.kill()
        server.close()


if __name__ == "__main__":
    main()
