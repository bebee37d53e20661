"""Shared plumbing for the rudp benchmarks: child processes, loops, sockets, output.

Every case runs a *server* role and a *client* role in two separate processes
(``multiprocessing`` with the ``spawn`` start method, so no loop or socket state
is inherited). The server binds port 0 on 127.0.0.1 and reports its port through
a pipe; the client is then started with that port. Whatever the roles return
(plain dicts) is sent back to the parent through the same pipes.
"""

from __future__ import annotations

import asyncio
import cProfile
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import rudp

HOST = "127.0.0.1"
SOCKET_BUFFER = 4 * 1024 * 1024
"""SO_RCVBUF/SO_SNDBUF for every UDP socket, rudp's own default included (the
kernel clamps it to net.core.rmem_max / wmem_max; the effective value is
reported in the results)."""

LEN_PREFIX = 4
"""TCP framing: a 4-byte big-endian length before each message."""

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Result = dict[str, Any]


@dataclass
class RoleContext:
    """What a role coroutine gets: its parameters, a way to publish its port, a stop signal."""

    params: dict[str, Any]
    ready: Callable[[int], None]
    stop: asyncio.Future[None]


Role = Callable[[RoleContext], Awaitable[Result]]


def set_udp_buffers(sock: socket.socket, size: int = SOCKET_BUFFER) -> dict[str, int]:
    """Request ``size`` bytes for both buffers; return what the kernel granted."""
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, size)
    return {
        "rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        "sndbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
    }


def udp_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    set_udp_buffers(sock)
    sock.bind((HOST, port))
    return sock


def loop_name(use_uvloop: bool) -> str:
    return "uvloop" if use_uvloop else "asyncio"


# -- child processes --------------------------------------------------------------


def _settle_malloc() -> None:
    """Let glibc's malloc serve 256 KiB buffers from its heap, in every child alike.

    asyncio's own transports read into a fresh ``max_size`` (256 KiB) buffer on each
    read. glibc serves a block that large with mmap, then mremap and munmap: three
    extra syscalls per datagram, until freeing a larger mmapped block has raised its
    dynamic mmap threshold, which depends on what the process happened to import.
    That made the asyncio UDP and TCP baselines about 2x slower in some runs and not
    in others (e.g. with rudp imported from another directory). Freeing one 1 MiB
    block raises the threshold at once. rudp's own 64 KiB reads are below the
    default threshold either way.
    """
    block = bytearray(1 << 20)
    del block


def _child_main(
    role: Role,
    params: dict[str, Any],
    pipe: Pipe,
    use_uvloop: bool,
    profile_path: str | None,
) -> None:
    _settle_malloc()

    async def main() -> Result:
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[None] = loop.create_future()

        def on_pipe() -> None:
            loop.remove_reader(pipe.fileno())
            if not stop.done():
                stop.set_result(None)

        loop.add_reader(pipe.fileno(), on_pipe)
        ctx = RoleContext(params=params, ready=lambda port: pipe.send(("ready", port)), stop=stop)
        try:
            return await role(ctx)
        finally:
            loop.remove_reader(pipe.fileno())

    try:
        profiler = cProfile.Profile() if profile_path else None
        if profiler is not None:
            profiler.enable()
        result = rudp.run(main(), use_uvloop=use_uvloop)
        if profiler is not None and profile_path is not None:
            profiler.disable()
            profiler.dump_stats(profile_path)
        pipe.send(("result", result))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))


class CaseFailed(RuntimeError):
    pass


def _expect(pipe: Pipe, kind: str, timeout: float, who: str) -> Any:
    if not pipe.poll(timeout):
        raise CaseFailed(f"{who}: no {kind!r} within {timeout:.0f}s")
    got, value = pipe.recv()
    if got == "error":
        raise CaseFailed(f"{who} failed:\n{value}")
    if got != kind:
        raise CaseFailed(f"{who}: expected {kind!r}, got {got!r}")
    return value


def run_pair(
    server: Role,
    client: Role,
    params: dict[str, Any],
    *,
    use_uvloop: bool,
    timeout: float,
    profile_prefix: str | None = None,
    pin: bool = False,
) -> tuple[Result, Result]:
    """Run ``server`` and ``client`` in two processes; return (server result, client result).

    ``pin`` puts the server on the first allowed CPU and the client on the second, so
    neither migrates between cores during a run (on a machine with at least two).
    """
    cpus = sorted(os.sched_getaffinity(0)) if pin and hasattr(os, "sched_getaffinity") else []
    if pin and len(cpus) < 2:
        raise CaseFailed("--pin needs two CPUs")
    mp = multiprocessing.get_context("spawn")
    s_parent, s_child = mp.Pipe()
    c_parent, c_child = mp.Pipe()
    prof_s = f"{profile_prefix}-server.prof" if profile_prefix else None
    prof_c = f"{profile_prefix}-client.prof" if profile_prefix else None
    sp = mp.Process(
        target=_child_main, args=(server, params, s_child, use_uvloop, prof_s), daemon=True
    )
    sp.start()
    if cpus and sp.pid is not None:
        os.sched_setaffinity(sp.pid, {cpus[0]})
    cp = None
    try:
        port = _expect(s_parent, "ready", 20.0, "server")
        cp = mp.Process(
            target=_child_main,
            args=(client, {**params, "port": port}, c_child, use_uvloop, prof_c),
            daemon=True,
        )
        cp.start()
        if cpus and cp.pid is not None:
            os.sched_setaffinity(cp.pid, {cpus[1]})
        client_result = _expect(c_parent, "result", timeout, "client")
        s_parent.send(("stop", None))
        server_result = _expect(s_parent, "result", 15.0, "server")
        return server_result, client_result
    finally:
        for proc in (cp, sp):
            if proc is None:
                continue
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)


# -- measurement helpers ------------------------------------------------------------


class ArrivalCounter:
    """Counts received messages; a watchdog ends the count on completion, idle or cap.

    ``elapsed`` runs from the first arrival to the last; the messages of the first
    batch are not counted in the rate (they arrived at time zero).
    """

    def __init__(self, target: int, idle: float, cap: float) -> None:
        self.target = target
        self.idle = idle
        self.cap = cap  # a safety net: senders stop on their own cap first
        self.count = 0
        self.first_batch = 0
        self.first = 0.0
        self.last = 0.0
        self.batches = 0
        self.timeline: list[int] = []
        self.reached = False

    def add(self, n: int) -> None:
        now = time.perf_counter()
        if self.count == 0:
            self.first = now
            self.first_batch = n
        self.count += n
        self.last = now
        self.batches += 1
        bucket = int((now - self.first) * 10)  # arrivals per 100 ms, to spot stalls
        timeline = self.timeline
        while len(timeline) <= bucket:
            timeline.append(0)
        timeline[bucket] += n
        if self.count >= self.target:
            self.reached = True

    def peak_rate(self) -> float:
        """The best 100 ms bucket (first and last excluded), in msgs/s.

        Shows the rate while data flows, apart from start-up and stalls; NaN when too short.
        """
        inner = self.timeline[1:-1]
        return 10.0 * max(inner) if inner else float("nan")

    def finish(self) -> None:
        """The sender is known to be done (e.g. it closed the connection)."""
        self.reached = True

    async def wait(self, stop: asyncio.Future[None], start_timeout: float = 15.0) -> str:
        """Return why counting ended: "complete", "idle", "cap" or "no data".

        ``stop`` (the sender has finished) does not end a count in progress: the
        receiver goes on until it is idle, so nothing still queued is missed."""
        started = time.perf_counter()
        while True:
            await asyncio.sleep(0.02)
            now = time.perf_counter()
            if self.reached:
                return "complete"
            if self.count == 0:
                # The sender is done (stop) or never started: nothing will come.
                if stop.done() or now - started > start_timeout:
                    return "no data"
            elif now - self.last > self.idle:
                return "idle"
            elif now - self.first > self.cap:
                return "cap"

    def result(self, ended: str) -> Result:
        elapsed = self.last - self.first
        counted = self.count - self.first_batch
        return {
            "received": self.count,
            "elapsed": elapsed,
            "rate": counted / elapsed if elapsed > 0 else 0.0,
            "batches": self.batches,
            "timeline_100ms": self.timeline,
            "peak_rate": self.peak_rate(),
            "ended": ended,
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def summarize_rtts(rtts_ns: list[int]) -> Result:
    values = sorted(v / 1000 for v in rtts_ns)  # microseconds
    return {
        "samples": len(values),
        "p50_us": percentile(values, 50),
        "p90_us": percentile(values, 90),
        "p99_us": percentile(values, 99),
        "min_us": values[0] if values else float("nan"),
        "mean_us": sum(values) / len(values) if values else float("nan"),
    }


# -- environment and output ------------------------------------------------------------


def environment() -> Result:
    try:
        uvloop_version: str | None = importlib.metadata.version("uvloop")
    except importlib.metadata.PackageNotFoundError:  # uvloop is a dependency on POSIX
        uvloop_version = None
    info: Result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "uvloop": uvloop_version,
        "git": _git_describe(),
        "rudp_build": "mypyc" if rudp.compiled else "pure",
        "rmem_max": _read_sysctl("net/core/rmem_max"),
        "wmem_max": _read_sysctl("net/core/wmem_max"),
    }
    return info


def _git_describe() -> str | None:
    """The commit measured, with "+dirty" when rudp/ has uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "rudp"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _read_sysctl(name: str) -> int | None:
    try:
        return int(Path("/proc/sys", name).read_text().strip())
    except (OSError, ValueError):
        return None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if value is None:
        return "-"
    return str(value)


def _finite(value: Any) -> Any:
    """NaN and infinities become null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(name: str, payload: Result, path: str | None) -> Path:
    target = Path(path) if path else RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_finite(payload), indent=2, sort_keys=True) + "\n")
    return target


@dataclass
class Plan:
    """Which loops and sizes to run."""

    loops: list[bool] = field(default_factory=lambda: [False, True])
    sizes: list[int] = field(default_factory=lambda: [64, 1200])


def parse_loops(value: str) -> list[bool]:
    return {"asyncio": [False], "uvloop": [True], "both": [False, True]}[value]
