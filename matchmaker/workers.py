"""Several worker processes behind one address (``--workers N``): the supervisor.

Theory of operation
-------------------
One daemon process spends 400-480 us of CPU per registration (docs/performance.md),
so one replica on one core registers about 2,100-2,500 hosts a second.  With
``--workers N`` the replica is N processes: each **worker** is a whole daemon
(`matchmaker.server.Matchmaker`) and a replica of the shared Redis registry with a
replica id of its own (``<replica-id>-w<i>``), exactly as separate replicas are:
heartbeat secrets and cookies derive from the key replicas share, introductions
for a host another worker holds are relayed through Redis, and a host whose
worker does not answer moves to another by the MOVING-heartbeat takeover.

The **supervisor** (this module, the process ``python -m matchmaker`` runs)
binds every listening socket itself and hands them down (inherited file
descriptors), then only starts, watches and stops workers:

* the rudp port: N UDP sockets in one ``SO_REUSEPORT`` group, socket *i* to worker
  *i*.  The kernel picks a group member by a hash of the datagram's 4-tuple over
  the group's members, so one host's registration and heartbeats (one socket of
  the host's) all reach the same worker.  The supervisor keeps its copy of every
  socket open, so a worker's death does not shrink the group: its flows queue on
  its socket until the worker restarted on that socket reads them, and no other
  worker's flows move (tests/matchmaker/test_workers.py measures both cases);
* ``--master-port``: N UDP sockets in a group the same way (stateless queries);
* the HTTP port: one listening socket that every worker accepts on (the kernel
  hands each connection to one of them).  /metrics answered by any worker is the
  whole replica's: it reads its siblings' expositions over Unix sockets in a
  private directory of the supervisor's and adds a ``worker`` label to every
  series (`merge_expositions`).

A restarted worker keeps its index, its socket and its **replica id**: the hosts
its predecessor held in Redis heartbeat to that socket, so they are its own
again at once, with no takeover (a fresh id would make every one of them go
through NOT_REGISTERED, a MOVING heartbeat and a takeover write).  It only starts
once its predecessor has exited, so two processes never hold one id.

A worker that dies is restarted after a backoff (`BACKOFF_FIRST` doubling to
`BACKOFF_MAX`, back to the first once a worker has served `STABLE_AFTER`
seconds), logged (``worker_exited``) and counted (``matchmaker_worker_restarts``).
One that exits `START_ATTEMPTS` times in a row before serving (a bad config, a
port, a crash at start) ends the supervisor with exit status 1 and a line saying
so.  SIGTERM/SIGINT are forwarded: every worker drains as a stopping replica does,
and the supervisor exits 0 when all of them did.  A worker whose supervisor is
gone stops too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from matchmaker import logging as mm_logging
from matchmaker.cli import parse_args
from matchmaker.metrics import Metrics
from matchmaker.registry.redis import default_replica_id
from matchmaker.server import ListeningSockets, Matchmaker
from matchmaker.settings import Settings

log = structlog.get_logger("matchmaker.workers")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0
"""Seconds a worker must serve before its next death restarts it after `BACKOFF_FIRST`."""
START_ATTEMPTS = 3
"""Exits in a row before serving after which the supervisor gives up."""
SIBLING_TIMEOUT = 2.0
"""Seconds to read one sibling's exposition for /metrics."""
POLL = 0.1
KILL_MARGIN = 5.0
"""Seconds past ``shutdown_timeout`` before a worker that does not stop is killed."""
PARENT_CHECK = 1.0


# -- sockets -------------------------------------------------------------------------------


@dataclass
class SocketGroup:
    """Every listening socket of a replica, bound by the supervisor."""

    udp: list[socket.socket]
    http: socket.socket
    master: list[socket.socket]

    def all(self) -> list[socket.socket]:
        return [*self.udp, self.http, *self.master]

    def close(self) -> None:
        for sock in self.all():
            sock.close()


def bind_sockets(settings: Settings) -> SocketGroup:
    """The replica's sockets; raises OSError (as binding them in a daemon would)."""
    made: list[socket.socket] = []
    try:
        http = _listener(settings.http_bind, settings.http_port)
        made.append(http)
        udp = _udp_group(settings.bind, settings.port, settings.workers, made)
        master = (
            _udp_group(settings.bind, settings.master_port, settings.workers, made)
            if settings.master
            else []
        )
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return SocketGroup(udp, http, master)


def _resolve(host: str, port: int, kind: socket.SocketKind) -> tuple[int, tuple[object, ...]]:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=kind, flags=socket.AI_PASSIVE)[0]
    return family, tuple(address)


def _new(family: int, kind: socket.SocketKind, address: tuple[object, ...]) -> socket.socket:
    sock = socket.socket(family, kind)
    if family == socket.AF_INET6 and address[0] == "::":
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack, as rudp
    return sock


def _listener(host: str, port: int) -> socket.socket:
    family, address = _resolve(host, port, socket.SOCK_STREAM)
    sock = _new(family, socket.SOCK_STREAM, address)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's start_server
    sock.bind(address)
    sock.listen(128)
    return sock


def _udp_group(host: str, port: int, n: int, made: list[socket.socket]) -> list[socket.socket]:
    family, address = _resolve(host, port, socket.SOCK_DGRAM)
    if port:
        # SO_REUSEPORT lets any socket of this user with the option join the group:
        # first make sure nobody holds the port, so that two replicas started on one
        # port fail (EADDRINUSE) rather than share its traffic.
        with _new(family, socket.SOCK_DGRAM, address) as probe:
            probe.bind(address)
    group: list[socket.socket] = []
    for _ in range(n):
        sock = _new(family, socket.SOCK_DGRAM, address)
        made.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if not group:
            # Port 0: the first socket picked one; the others join it there.
            address = (address[0], sock.getsockname()[1], *address[2:])
        group.append(sock)
    return group


# -- /metrics across workers -----------------------------------------------------------


def merge_expositions(parts: Sequence[tuple[str, bytes]], configured: int) -> bytes:
    """One exposition of every worker's series, each with its ``worker`` label.

    ``parts``: (worker index, that worker's own /metrics text) for each worker that
    answered; ``matchmaker_worker_up`` says which did.
    """
    families: dict[str, Metric] = {}
    for worker, text in parts:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples += [
                s._replace(labels={**s.labels, "worker": worker}) for s in family.samples
            ]
    up = GaugeMetricFamily(
        "matchmaker_worker_up",
        "1 for each worker process whose series this scrape holds.",
        labels=["worker"],
    )
    answered = {worker for worker, _ in parts}
    for i in range(configured):
        up.add_metric([str(i)], 1 if str(i) in answered else 0)
    workers = GaugeMetricFamily(
        "matchmaker_workers", "Worker processes the replica runs (--workers).", value=configured
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), up, workers]))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


@dataclass
class Siblings:
    """A worker's view of the replica's metrics: its own registry and its siblings'
    expositions, read over their Unix sockets in the supervisor's directory."""

    directory: Path
    index: int
    workers: int
    metrics: Metrics

    def path(self, index: int) -> Path:
        return self.directory / f"w{index}.sock"

    async def exposition(self) -> bytes:
        reads = [self._read(i) for i in range(self.workers) if i != self.index]
        others = await asyncio.gather(*reads)
        parts = [(str(self.index), generate_latest(self.metrics.registry))]
        parts += [(str(i), body) for i, body in others if body is not None]
        return merge_expositions(sorted(parts, key=lambda p: int(p[0])), self.workers)

    async def _read(self, index: int) -> tuple[int, bytes | None]:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(self.path(index))
                try:
                    return index, await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return index, None  # dead or restarting: matchmaker_worker_up says so

    async def serve(self) -> asyncio.Server:
        """Serve this worker's own exposition to its siblings."""
        path = self.path(self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by this worker's predecessor

        async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.write(generate_latest(self.metrics.registry))
                await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        return await asyncio.start_unix_server(answer, path)


# -- a worker process --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the supervisor tells worker ``index`` on its command line."""

    index: int
    workers: int
    replica_id: str
    udp_fd: int
    http_fd: int
    master_fd: int
    """-1: no --master."""
    ready_fd: int
    directory: str
    restarts: int

    def argv(self) -> list[str]:
        out: list[str] = []
        for f in dataclasses.fields(self):
            out += [f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))]
        return out

    @classmethod
    def parse(cls, argv: Sequence[str]) -> WorkerSpec:
        parser = argparse.ArgumentParser(prog="python -m matchmaker.workers")
        for f in dataclasses.fields(cls):
            kind = int if f.type in ("int", int) else str
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, required=True)
        return cls(**vars(parser.parse_args(argv)))


def worker_main(argv: Sequence[str]) -> int:
    """A worker: ``python -m matchmaker.workers <spec> -- <the daemon's flags>``."""
    # Here, not at the top: the supervisor runs as ``__main__`` and imports this module.
    from matchmaker.__main__ import run_daemon

    args = list(argv)
    split = args.index("--") if "--" in args else len(args)
    spec = WorkerSpec.parse(args[:split])
    settings = Settings.from_sources(parse_args(args[split + 1 :]), os.environ)
    settings = dataclasses.replace(settings, replica_id=spec.replica_id)
    mm_logging.configure(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(worker=spec.index)
    sockets = ListeningSockets(
        udp=socket.socket(fileno=spec.udp_fd),
        http=socket.socket(fileno=spec.http_fd),
        master=socket.socket(fileno=spec.master_fd) if spec.master_fd >= 0 else None,
    )
    metrics = Metrics()
    restarts = Gauge(
        "matchmaker_worker_restarts",
        "Times the supervisor restarted this worker (its index) after it died.",
        registry=metrics.registry,
    )
    restarts.set(spec.restarts)
    siblings = Siblings(Path(spec.directory), spec.index, spec.workers, metrics)

    def serve() -> Coroutine[Any, Any, None]:
        mm = Matchmaker(settings, metrics=metrics, sockets=sockets, exposition=siblings.exposition)
        return _serve_worker(mm, siblings, spec.ready_fd)

    return run_daemon(settings, serve)


async def _serve_worker(mm: Matchmaker, siblings: Siblings, ready_fd: int) -> None:
    stop = asyncio.Event()
    parent = os.getppid()

    def started() -> None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, b"1")
            os.close(ready_fd)

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(PARENT_CHECK)
        log.warning("supervisor_gone")
        stop.set()

    server = await siblings.serve()
    watcher = asyncio.create_task(watch_parent(), name="watch-supervisor")
    try:
        await mm.run(stop, on_started=started)
    finally:
        watcher.cancel()
        server.close()
        with contextlib.suppress(FileNotFoundError):
            siblings.path(siblings.index).unlink()


# -- the supervisor ----------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    replica_id: str
    proc: subprocess.Popen[bytes] | None = None
    ready_fd: int | None = None
    started: float = 0.0
    serving: float | None = None
    """When it said it was serving (None: not yet)."""
    failed_starts: int = 0
    quick_deaths: int = 0
    restarts: int = 0
    restart_at: float | None = field(default=None)


class Supervisor:
    """Starts, watches, restarts and stops the workers of one replica."""

    def __init__(
        self,
        settings: Settings,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        worker_command: Sequence[str] = (),
    ) -> None:
        """``argv``: the daemon's flags, passed on to every worker;
        ``worker_command``: what runs a worker (tests), by default this module."""
        self.settings = settings
        self._argv = list(argv)
        self._command = list(worker_command) or [sys.executable, "-m", "matchmaker.workers"]
        self._env = {**os.environ, **(env or {})}
        base = settings.replica_id or default_replica_id()
        self._slots = [_Slot(i, f"{base}-w{i}") for i in range(settings.workers)]
        self._stop = threading.Event()
        self._directory = Path(tempfile.mkdtemp(prefix="matchmaker-"))
        self._sockets: SocketGroup | None = None

    def run(self) -> int:
        """Run until SIGTERM/SIGINT (0 when every worker drained) or a failed start (1)."""
        previous = {
            sig: signal.signal(sig, lambda *_: self._stop.set())
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            self._sockets = bind_sockets(self.settings)
            self._log_started()
            for slot in self._slots:
                self._spawn(slot)
            failed = self._watch()
            return self._stop_all(failed)
        finally:
            for slot in self._slots:
                self._kill(slot)
            if self._sockets is not None:
                self._sockets.close()
            shutil.rmtree(self._directory, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _log_started(self) -> None:
        assert self._sockets is not None
        udp = self._sockets.udp[0].getsockname()
        http = self._sockets.http.getsockname()
        fields: dict[str, object] = {
            "udp": f"{udp[0]}:{udp[1]}",
            "http": f"{http[0]}:{http[1]}",
            "workers": len(self._slots),
            "replica_ids": ",".join(s.replica_id for s in self._slots),
        }
        if self._sockets.master:
            master = self._sockets.master[0].getsockname()
            fields["master"] = f"{master[0]}:{master[1]}"
        log.info("workers_started", **fields)

    def _spawn(self, slot: _Slot) -> None:
        assert self._sockets is not None
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        master = self._sockets.master[slot.index].fileno() if self._sockets.master else -1
        spec = WorkerSpec(
            index=slot.index,
            workers=len(self._slots),
            replica_id=slot.replica_id,
            udp_fd=self._sockets.udp[slot.index].fileno(),
            http_fd=self._sockets.http.fileno(),
            master_fd=master,
            ready_fd=write_end,
            directory=str(self._directory),
            restarts=slot.restarts,
        )
        fds = [spec.udp_fd, spec.http_fd, write_end] + ([master] if master >= 0 else [])
        cmd = [*self._command, *spec.argv(), "--", *self._argv]
        try:
            # A session of its own: a terminal's Ctrl-C reaches the supervisor alone,
            # which forwards one SIGTERM (a second signal would end a drain early).
            slot.proc = subprocess.Popen(cmd, env=self._env, pass_fds=fds, start_new_session=True)
        finally:
            os.close(write_end)
        slot.ready_fd, slot.started, slot.serving, slot.restart_at = (
            read_end,
            time.monotonic(),
            None,
            None,
        )
        log.info("worker_started", index=slot.index, pid=slot.proc.pid, replica_id=slot.replica_id)

    def _watch(self) -> str | None:
        """Supervise until told to stop (None) or a worker cannot start (why)."""
        while not self._stop.wait(POLL):
            now = time.monotonic()
            for slot in self._slots:
                self._check_ready(slot, now)
                if slot.proc is not None and (code := slot.proc.poll()) is not None:
                    failure = self._exited(slot, code, now)
                    if failure is not None:
                        return failure
                if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                    self._spawn(slot)
        return None

    def _check_ready(self, slot: _Slot, now: float) -> None:
        if slot.ready_fd is None:
            return
        try:
            got = os.read(slot.ready_fd, 1)
        except BlockingIOError:
            return
        os.close(slot.ready_fd)
        slot.ready_fd = None
        if got:
            slot.serving, slot.failed_starts = now, 0

    def _exited(self, slot: _Slot, code: int, now: float) -> str | None:
        self._check_ready(slot, now)
        if slot.ready_fd is not None:
            os.close(slot.ready_fd)
            slot.ready_fd = None
        pid = slot.proc.pid if slot.proc else 0
        slot.proc = None
        if slot.serving is None:
            slot.failed_starts += 1
            if slot.failed_starts >= START_ATTEMPTS:
                return (
                    f"worker {slot.index} exited {slot.failed_starts} times in a row before "
                    f"serving (last exit status {code}); its log lines above say why"
                )
        if slot.serving is not None and now - slot.serving >= STABLE_AFTER:
            slot.quick_deaths = 0
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2**slot.quick_deaths)
        slot.quick_deaths += 1
        slot.restarts += 1
        slot.restart_at = now + delay
        log.warning(
            "worker_exited", index=slot.index, pid=pid, status=code, restart_in=delay,
            restarts=slot.restarts, serving=slot.serving is not None,
        )  # fmt: skip
        return None

    def _stop_all(self, failed: str | None) -> int:
        """Forward the stop to every worker, wait for them to drain; the exit status."""
        if failed is not None:
            log.error("workers_failed", reason=failed)
            print(f"matchmaker: {failed}", file=sys.stderr)
        log.info("workers_stopping")
        live = [s for s in self._slots if s.proc is not None]
        for slot in live:
            with contextlib.suppress(ProcessLookupError):
                assert slot.proc is not None
                slot.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout + KILL_MARGIN
        codes: list[int] = []
        for slot in live:
            assert slot.proc is not None
            try:
                codes.append(slot.proc.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                log.warning("worker_killed", index=slot.index, pid=slot.proc.pid)
                self._kill(slot)
                codes.append(-signal.SIGKILL)
        clean = all(code == 0 for code in codes)
        log.info("workers_stopped", statuses=",".join(map(str, codes)))
        return 1 if failed is not None or not clean else 0

    @staticmethod
    def _kill(slot: _Slot) -> None:
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.kill()
            slot.proc.wait()


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
