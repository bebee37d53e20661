"""Shared plumbing for the matchmaker benchmarks: a daemon in its own process.

`DaemonProcess` starts a real `matchmaker.server.Matchmaker` (memory registry,
real rudp socket on 127.0.0.1) in a child process (``spawn``), so the
benchmark's clients never share a CPU core's event loop with it. The parent
drives it through a pipe with small commands:

- ``populate n``: insert n hosts straight into the registry (no connections),
  each on its own documentation-range public IP, measuring the memory the
  registry entries take with tracemalloc (the registry only, no rudp state);
- ``stats``: RSS, CPU seconds, hosts, connections, rudp counters, and the
  pause of every garbage collection since start, by generation (the
  collector is set as in production, `matchmaker.gctuning`);
- ``trim``: ``stats`` after gc.collect() and glibc's malloc_trim(0) (RSS
  without the free memory the allocator keeps from earlier peaks);
- ``trace`` / ``traced``: allocations held since ``trace`` (tracemalloc),
  for breakdowns of what a host costs;
- ``plan n limit filters``: n list answers planned and encoded in the daemon,
  as it does before handing pages to rudp, each timed (the server time of a
  list, under whatever load the daemon carries meanwhile);
- ``owners``: the hosts of its index by owning replica, and how many are visible;
- ``stop``.

Settings for benchmarks lift the abuse limits (every bench client is on
127.0.0.1, which is one rate-limit source and one IP) and the hide/expire
clocks (populated hosts never heartbeat); the list paging settings are the
daemon's defaults unless a benchmark overrides them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import ipaddress
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.messages import HostInfo
from matchmaker.settings import Settings

GAME = "bench"
UNLIMITED = 1e9


def bench_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "bind": "127.0.0.1",
        "port": 0,
        "http_bind": "127.0.0.1",
        "http_port": 0,
        "allow_private": True,
        "max_hosts_per_ip": 1_000_000,
        "max_connections": 100_000,
        "max_connections_per_source": 0,
        "handshake_rate": 0.0,
        "register_rate": UNLIMITED,
        "register_burst": UNLIMITED,
        "list_rate": UNLIMITED,
        "list_burst": UNLIMITED,
        "list_limit": 100_000,
        "hide_after": 3600.0,
        "expire_after": 3600.0,
        "keepalive": 5.0,
        "log_level": "warning",
        "log_format": "json",
    }
    values.update(overrides)
    return Settings(**values)


def host_info(i: int) -> HostInfo:
    """A typical listing: short name and map, two tags, a region, no info blob."""
    return HostInfo(
        name=f"Bench server #{i}",
        game=GAME,
        version="1.32c",
        max_players=16,
        players=i % 17,
        map=("q3dm17", "q3dm6", "q3tourney2", "ctf1")[i % 4],
        tags=("ctf", "eu") if i % 2 else ("ffa", "us"),
        region=("eu", "us", "asia")[i % 3],
    )


async def register_host(client: MatchmakerClient, i: int) -> None:
    """Register simulated host ``i`` (its listing from `host_info`) through ``client``."""
    h = host_info(i)
    await client.register(
        name=h.name,
        game=h.game,
        version=h.version,
        max_players=h.max_players,
        players=h.players,
        map=h.map,
        tags=h.tags,
        region=h.region,
    )


def public_address(i: int) -> Address:
    """One public-looking IPv4 per host (198.18.0.0/15, the benchmarking range)."""
    ip = ipaddress.IPv4Address(int(ipaddress.IPv4Address("198.18.0.0")) + i + 1)
    return Address(str(ip), 27960)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _daemon_main(pipe: Pipe, settings: Settings, use_uvloop: bool) -> None:
    import rudp
    from matchmaker.gctuning import tune_gc
    from matchmaker.logging import configure
    from matchmaker.server import Matchmaker

    configure(settings.log_level, settings.log_format)

    async def main() -> None:
        mm = Matchmaker(settings)
        await mm.start()
        tune_gc()  # as `Matchmaker.run` does once started
        gc.callbacks.append(_gc_pauses.observe)
        pipe.send(("ready", mm.udp_address, mm.http_address))
        loop = asyncio.get_running_loop()
        commands: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        traced: list[tracemalloc.Snapshot] = []
        loop.add_reader(pipe.fileno(), lambda: commands.put_nowait(pipe.recv()))
        try:
            while True:
                cmd = await commands.get()
                if cmd[0] == "stop":
                    break
                if cmd[0] == "populate":
                    pipe.send(("populated", await _populate(mm, cmd[1])))
                elif cmd[0] == "stats":
                    pipe.send(("stats", _stats(mm)))
                elif cmd[0] == "trim":
                    pipe.send(("trimmed", _trim(mm)))
                elif cmd[0] == "trace":
                    tracemalloc.start(cmd[1])
                    traced[:] = [tracemalloc.take_snapshot()]
                    pipe.send(("tracing",))
                elif cmd[0] == "traced":
                    pipe.send(("traced", _traced(traced[0], cmd[1])))
                elif cmd[0] == "plan":
                    pipe.send(("planned", await _plan_lists(mm, *cmd[1:])))
                elif cmd[0] == "owners":
                    pipe.send(("owners", _owners(mm)))
        finally:
            loop.remove_reader(pipe.fileno())
            await mm.shutdown()

    rudp.run(main(), use_uvloop=use_uvloop)
    pipe.send(("stopped",))


async def _populate(mm: Any, n: int) -> dict[str, Any]:
    start = len(mm.registry.index())
    infos = [host_info(start + i) for i in range(n)]
    addresses = [public_address(start + i) for i in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for address, info in zip(addresses, infos, strict=True):
        await mm.registry.upsert(address, info, max_per_ip=1_000_000)
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"hosts": len(mm.registry.index()), "registry_bytes_per_host": traced / max(n, 1)}


async def _plan_lists(mm: Any, n: int, limit: int, filters: list[dict[str, Any]]) -> list[float]:
    """Seconds per answer: planned and encoded as `MatchmakerService._send_list`
    does before rudp, a pause of 5 ms between answers (heartbeats go on)."""
    from matchmaker.messages import ListFilter, ListRequest, encode_page

    times = []
    for i in range(n):
        req = ListRequest(
            request_id=i + 1, filter=ListFilter(game=GAME, limit=limit, **filters[i % len(filters)])
        )
        started = time.perf_counter()
        total, pages = await mm.service._plan_list(req)
        for seq, (_, entries) in enumerate(pages):
            encode_page(
                request_id=i + 1, seq=seq, total=total, end=seq == len(pages) - 1, entries=entries
            )
        times.append(time.perf_counter() - started)
        await asyncio.sleep(0.005)
    return times


def _owners(mm: Any) -> dict[str, Any]:
    registry = mm.registry
    now = registry.now()
    owners: dict[str, int] = {}
    visible = 0
    for record in registry.index():
        owners[record.owner] = owners.get(record.owner, 0) + 1
        visible += registry.is_visible(record, now)
    return {"owners": owners, "visible": visible}


def _trim(mm: Any) -> dict[str, Any]:
    """Stats after a full collection and glibc's malloc_trim(0): what the process
    holds, without the free memory the allocator kept from earlier peaks (the
    handshakes of a registration storm)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the untrimmed figure
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _stats(mm)


def _traced(before: tracemalloc.Snapshot, top: int) -> dict[str, Any]:
    """Memory allocated since `before` and still held, in all and by source line."""
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    diff = after.compare_to(before, "lineno")
    return {
        "bytes": sum(d.size_diff for d in diff),
        "top": [(str(d.traceback), d.size_diff, d.count_diff) for d in diff[:top]],
    }


class _GcPauses:
    """Every collection's pause, by generation (a gc.callbacks hook)."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0.0

    def observe(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._start)

    def summary(self) -> dict[str, Any]:
        def pick(values: list[float], q: float) -> float | None:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if values else None

        return {
            "count": {str(g): len(v) for g, v in self.pauses.items()},
            "p50_ms": {str(g): pick(v, 0.5) for g, v in self.pauses.items()},
            "p99_ms": {str(g): pick(v, 0.99) for g, v in self.pauses.items()},
            "max_ms": {str(g): max(v) * 1e3 if v else None for g, v in self.pauses.items()},
        }


_gc_pauses = _GcPauses()


def _stats(mm: Any) -> dict[str, Any]:
    stats = mm.udp.stats
    return {
        "gc": _gc_pauses.summary(),
        "rss": rss_bytes(),
        "cpu": cpu_seconds(),
        "hosts": len(mm.registry.index()),
        "connections": mm.service.connections,
        "datagrams_received": stats.datagrams_received,
        "datagrams_sent": stats.datagrams_sent,
        "dropped": {str(k): v for k, v in stats.dropped.items() if v},
        "messages_resent": stats.closed_totals.get("messages_resent", 0)
        + sum(c.stats.messages_resent for c in mm.udp.endpoint.core.connections),
        "heartbeats": _by_label(mm.metrics.heartbeats),
        "registrations": _by_label(mm.metrics.registrations),
    }


def _by_label(counter: Any) -> dict[str, float]:
    """A one-label counter's totals by label value."""
    return {
        next(iter(s.labels.values())): s.value
        for metric in counter.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


class DaemonProcess:
    """A matchmaker daemon in a child process; a context manager."""

    def __init__(self, settings: Settings, *, use_uvloop: bool = True) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_daemon_main, args=(child, settings, use_uvloop))
        self.udp_address: tuple[str, int] = ("", 0)
        self.http_address: tuple[str, int] = ("", 0)

    def __enter__(self) -> DaemonProcess:
        self._proc.start()
        _, self.udp_address, self.http_address = self._expect("ready", 30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.is_alive():
            self._pipe.send(("stop",))
            self._proc.join(15)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def _expect(self, kind: str, timeout: float) -> Any:
        if not self._pipe.poll(timeout):
            raise RuntimeError(f"daemon: no {kind!r} within {timeout} s")
        msg = self._pipe.recv()
        if msg[0] != kind:
            raise RuntimeError(f"daemon: expected {kind!r}, got {msg!r}")
        return msg

    def populate(self, n: int) -> dict[str, Any]:
        self._pipe.send(("populate", n))
        result: dict[str, Any] = self._expect("populated", 300)[1]
        return result

    def trace(self, frames: int = 1) -> None:
        """Start tracing allocations (slows the daemon: for memory breakdowns only)."""
        self._pipe.send(("trace", frames))
        self._expect("tracing", 30)

    def traced(self, top: int = 15) -> dict[str, Any]:
        """Allocations since `trace` still held, total and the `top` source lines."""
        self._pipe.send(("traced", top))
        result: dict[str, Any] = self._expect("traced", 300)[1]
        return result

    def trimmed(self) -> dict[str, Any]:
        """`stats` after a full collection and malloc_trim (see ``_trim``)."""
        self._pipe.send(("trim",))
        result: dict[str, Any] = self._expect("trimmed", 120)[1]
        return result

    def plan(self, n: int, limit: int, filters: list[dict[str, Any]]) -> list[float]:
        """Server time of `n` list answers (see ``_plan_lists``), seconds each."""
        self._pipe.send(("plan", n, limit, filters))
        result: list[float] = self._expect("planned", 600)[1]
        return result

    def owners(self) -> dict[str, Any]:
        """Hosts of the daemon's index by owner, and the visible count."""
        self._pipe.send(("owners",))
        result: dict[str, Any] = self._expect("owners", 60)[1]
        return result

    def kill(self) -> None:
        """SIGKILL: the replica dies without a word to anyone."""
        self._proc.kill()
        self._proc.join(10)

    def stats(self) -> dict[str, Any]:
        self._pipe.send(("stats",))
        result: dict[str, Any] = self._expect("stats", 30)[1]
        return result


def settings_dict(settings: Settings) -> dict[str, Any]:
    return dataclasses.asdict(settings)


def now() -> float:
    return time.monotonic()


class RedisServer:
    """A redis-server of our own on loopback, no persistence."""

    def __init__(self, port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server missing (apt-get install -y redis-server)")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"port {port} is taken: --redis-port")
        self.port = port
        self._dir = tempfile.mkdtemp(prefix="mm-redis-")
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", self._dir]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=port, socket_timeout=30)
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(redis.ConnectionError):
                if self.client.ping():
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer within 10 s")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.client.info()
        return info

    def cpu(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
