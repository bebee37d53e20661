"""Several worker processes behind one address (``--workers N``): the supervisor.

Theory of operation
-------------------
One daemon process spends 400-480 us of CPU per registration (docs/performance.md),
so one replica on one core registers about 2,100-2,500 hosts a second.  With
``--workers N`` the replica is N processes: each **worker** is a whole daemon
(`matchmaker.server.Matchmaker`) and a replica of the shared Redis registry with a
replica id of its own (``<replica-id>-w<i>``), exactly as separate replicas are:
heartbeat secrets and cookies derive from the key replicas share, and
introductions for a host another worker holds are relayed through Redis.  A
host's datagrams reach its worker's socket only (see below), so a host whose
worker is down waits for the worker restarted on that socket, and a rudp
connection whose client's source port changes (NAT rebinding) lands on another
worker, which does not know it (docs/matchmaker.md, "Workers").

The **supervisor** (this module, the process ``python -m matchmaker`` runs)
binds every listening socket itself and hands them down (inherited file
descriptors), then only starts, watches and stops workers:

* the rudp port: N UDP sockets in one ``SO_REUSEPORT`` group, socket *i* to worker
  *i*.  A BPF program on the group (`matchmaker.steering`) picks the member by a
  keyed hash of the datagram's source address (an IPv4 address, an IPv6 /64),
  so everything one source sends, from any port, reaches the same worker: a
  NAT rebinding stays on its connection's worker, and the per-source limits
  hold for the replica.  The supervisor keeps its copy of every
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
seconds), logged (``worker_exited``) and counted (``matchmaker_worker_restarts_total``);
a start the system refuses (``fork`` failing: EAGAIN, ENOMEM) is logged
(``worker_spawn_failed``) and retried the same way.  One that exits
`START_ATTEMPTS` times in a row before serving (a bad config, a port, a crash at
start) ends the supervisor with exit status 1 and a line saying so; so does an
error of the supervisor itself, after draining the workers.

Three pipes tie a worker to its supervisor:

* the **beat pipe**: the worker writes a byte once serving, then one every `BEAT`
  seconds from its event loop.  A serving worker silent for `SILENT` seconds is
  reported down (``/healthz`` says ``degraded`` with ``workers_down``, ``/readyz``
  is 503, through the ``down`` file of the private directory), and one silent for
  ``--worker-watchdog`` seconds (a stuck loop, SIGSTOP) is killed (SIGKILL,
  ``worker_hung``) and restarted: its flows wait on its socket meanwhile;
* the **lifeline**: the worker inherits the read end of a pipe whose write end
  only the supervisor holds.  When the supervisor dies, however (SIGKILL
  included) and whenever (during the worker's start too: the EOF stays until
  read), a thread of the worker's sees EOF and stops it as SIGTERM does, and
  ends it (``worker_stop_overdue``, status 1) if it still runs
  ``shutdown_timeout`` + `KILL_MARGIN` seconds later, since no supervisor is
  left to kill it;
* with ``--ephemeral-issuer-key``, a pipe holding the one key the supervisor
  made, so every worker (and every restart) signs with the same key; secrets
  never go on a command line, where ``ps`` would show them.

Stopping.  SIGTERM, SIGINT or SIGHUP to the supervisor is forwarded once (SIGTERM)
to every worker; each drains as a stopping replica does and the supervisor exits 0
when all of them did, killing one still running ``shutdown_timeout`` +
`KILL_MARGIN` seconds later.  A worker takes one stop only: repeated signals
(systemd's default ``KillMode=control-group`` signals every process of the unit,
and the supervisor forwards its own) are logged (``stop_repeated``) and change
nothing.  A stop that reaches a worker before it serves ends it at once (nothing
to drain; one killed by SIGTERM during Python's start-up counts as a clean stop).
A supervisor killed outright leaves its private directory behind; the next
supervisor of the same user removes those whose supervisor is gone.
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
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from matchmaker import logging as mm_logging
from matchmaker.cli import parse_args
from matchmaker.metrics import Metrics
from matchmaker.registry.redis import default_replica_id
from matchmaker.server import STOP_SIGNALS, ListeningSockets, Matchmaker, stop_signals
from matchmaker.settings import Settings
from matchmaker.steering import new_key, steer_by_source
from matchmaker.stopping import stacks_on_request
from rudp.tokens import Issuer, generate_issuer_key

log = structlog.get_logger("matchmaker.workers")

BACKOFF_FIRST = 0.5
BACKOFF_MAX = 10.0
STABLE_AFTER = 30.0
"""Seconds a worker must serve before its next death restarts it after `BACKOFF_FIRST`."""
START_ATTEMPTS = 3
"""Exits in a row before serving after which the supervisor gives up."""
SIBLING_TIMEOUT = 2.0
"""Seconds to read one sibling's exposition for /metrics."""
BACKOFF_STEPS = 5
"""Doublings of the backoff at most: `BACKOFF_MAX` is reached before, and the
factor stays small after any number of deaths."""
POLL = 0.1
KILL_MARGIN = 20.0
"""Seconds past ``shutdown_timeout`` before a worker that does not stop is killed."""
BEAT = 1.0
"""Seconds between a serving worker's signs of life (a byte on its beat pipe)."""
SILENT = 3.0
"""Seconds without one after which /healthz and /readyz report the worker down
(``--worker-watchdog`` seconds, it is killed and restarted)."""
START_GRACE = 60.0
"""Seconds a worker that does not serve yet may go without a sign of life (or
``--worker-watchdog``, the longer): its start (interpreter, imports, the first
load of the registry, which holds its event loop) takes time a serving worker's
beat does not. A starting worker signs of life too (`STARTING`), so one waiting
on a Redis that does not answer keeps its place."""
STARTING = b"s"
"""A worker's sign of life before it serves (then ``SERVING``)."""
SERVING = b"1"
FROZEN = 1.0
"""A supervisor's poll this many seconds late: it was frozen or starved itself
(the whole replica paused, a stopped process group), and silence it did not see
is not held against the workers."""
DOWN_FILE = "down"
DIRECTORY_PREFIX = "matchmaker-"


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
    if n > 1:
        try:
            steer_by_source(group[0], n, new_key())
        except OSError as exc:
            log.warning("source_steering_unavailable", port=address[1], error=str(exc))
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

    def down(self) -> list[int]:
        """The siblings the supervisor last saw down (not serving, or silent)."""
        try:
            text = (self.directory / DOWN_FILE).read_text()
        except OSError:
            return []
        return [i for i in map(int, filter(None, text.split(","))) if i != self.index]

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
    """What the supervisor tells worker ``index`` on its command line (no secrets:
    the ephemeral issuer key comes through the inherited ``key_fd``)."""

    index: int
    workers: int
    replica_id: str
    udp_fd: int
    http_fd: int
    master_fd: int
    """-1: no --master."""
    beat_fd: int
    """Write end: one byte once serving, then one every `BEAT` (the watchdog's)."""
    lifeline_fd: int
    """Read end of a pipe whose write end only the supervisor holds: EOF means it is gone."""
    key_fd: int
    """-1, or a pipe holding the replica's ephemeral issuer key (32 bytes)."""
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


def _exit_now(event: str) -> None:
    """End a worker that has not served yet: nothing to drain."""
    with contextlib.suppress(Exception):
        log.info(event)
        sys.stdout.flush()
    os._exit(0)


def _watch_lifeline(fd: int, overdue_after: float) -> None:
    """SIGTERM ourselves when the supervisor is gone, whenever that happens: the
    pipe's EOF stays until read, so a death during our start is seen too.

    Nobody is left to kill a worker whose stop hangs, so this thread does it:
    still running ``overdue_after`` seconds after the SIGTERM, the worker logs
    ``worker_stop_overdue`` and exits with status 1."""

    def wait() -> None:
        # Signals go to the main thread only, which blocks them once it has drained.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        with contextlib.suppress(OSError):
            while os.read(fd, 64):
                pass
        # Armed first: a log line that blocks (a stalled output pipe) must not
        # keep the worker alive.
        timer = threading.Timer(overdue_after, overdue)
        timer.daemon = True
        timer.start()
        with contextlib.suppress(Exception):
            log.warning("supervisor_gone")
        os.kill(os.getpid(), signal.SIGTERM)

    def overdue() -> None:
        try:
            log.error("worker_stop_overdue", seconds=overdue_after)
            sys.stdout.flush()
        finally:
            os._exit(1)

    threading.Thread(target=wait, name="lifeline", daemon=True).start()


def worker_main(argv: Sequence[str]) -> int:
    """A worker: ``python -m matchmaker.workers <spec> -- <the daemon's flags>``."""
    stacks_on_request()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # blocked by the spawn
    args = list(argv)
    split = args.index("--") if "--" in args else len(args)
    spec = WorkerSpec.parse(args[:split])
    settings = Settings.from_sources(parse_args(args[split + 1 :]), os.environ)
    settings = dataclasses.replace(settings, replica_id=spec.replica_id)
    mm_logging.configure(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(worker=spec.index)
    # Until the event loop serves, a stop (the supervisor's, or its death) ends us at once.
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: _exit_now("worker_stopped_starting"))
    _watch_lifeline(spec.lifeline_fd, settings.shutdown_timeout + KILL_MARGIN)
    # Here, not at the top: the supervisor runs as ``__main__`` and imports this module.
    from matchmaker.__main__ import run_daemon

    issuer = Issuer(_read_key(spec.key_fd)) if spec.key_fd >= 0 else None
    sockets = ListeningSockets(
        udp=socket.socket(fileno=spec.udp_fd),
        http=socket.socket(fileno=spec.http_fd),
        master=socket.socket(fileno=spec.master_fd) if spec.master_fd >= 0 else None,
    )
    metrics = Metrics()
    count_restarts(metrics.registry, spec.restarts)
    siblings = Siblings(Path(spec.directory), spec.index, spec.workers, metrics)

    def serve() -> Coroutine[Any, Any, None]:
        mm = Matchmaker(
            settings, metrics=metrics, sockets=sockets, exposition=siblings.exposition,
            issuer=issuer, workers_down=siblings.down,
        )  # fmt: skip
        return _serve_worker(mm, siblings, spec.beat_fd)

    return run_daemon(settings, serve)


def count_restarts(registry: CollectorRegistry, restarts: int) -> Counter:
    """``matchmaker_worker_restarts_total``: times the supervisor restarted this worker
    after it died, as the supervisor counted them. A counter: each process of the
    worker starts it at that count, which only grows, so ``increase()`` over a window
    gives the restarts within it."""
    counter = Counter(
        "matchmaker_worker_restarts",
        "Times the supervisor restarted this worker (its index) after it died.",
        registry=registry,
    )
    counter.inc(restarts)
    return counter


def _read_key(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as pipe:
        key = pipe.read()
    if len(key) != 32:
        raise RuntimeError(f"the supervisor handed down a key of {len(key)} bytes, not 32")
    return key


async def _serve_worker(mm: Matchmaker, siblings: Siblings, beat_fd: int) -> None:
    """Serve until SIGTERM/SIGINT or the supervisor's death, then drain.

    A repeated signal (systemd's default ``KillMode=control-group`` signals every
    process of the unit, and the supervisor forwards its own) is logged and does
    not cut the drain short; before serving, a stop ends the worker at once."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    serving = False
    os.set_blocking(beat_fd, False)

    def on_signal(sig: signal.Signals) -> None:
        if not serving:
            _exit_now("worker_stopped_starting")
        elif stop.is_set():
            log.info("stop_repeated", signal=sig.name)
        else:
            stop.set()

    def beat() -> None:
        with contextlib.suppress(OSError):  # full (a stuck supervisor) or gone
            os.write(beat_fd, SERVING if serving else STARTING)

    async def beating() -> None:
        while True:
            beat()
            await asyncio.sleep(BEAT)

    def started() -> None:
        nonlocal serving
        serving = True
        beat()  # at once: the supervisor counts it as serving from now

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    # Alive while starting too (a Redis slow to answer), serving once started.
    beats: list[asyncio.Task[None]] = [asyncio.create_task(beating(), name="watchdog-beat")]
    server = await siblings.serve()
    try:
        await mm.run(stop, on_started=started, signals=False)
    finally:
        for task in beats:
            task.cancel()
        server.close()
        with contextlib.suppress(FileNotFoundError):
            siblings.path(siblings.index).unlink()
        # Drained: a stop arriving from now on stays pending until the exit.  The
        # loop's handlers stay: closing the loop restores the default action (to
        # die of the signal), by when no thread that does not block it is left
        # (the default executor's are joined first, the lifeline's blocks it).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


# -- the supervisor ----------------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    replica_id: str
    proc: subprocess.Popen[bytes] | None = None
    beat_fd: int | None = None
    lifeline_fd: int | None = None
    """The write end the supervisor holds (never writes) while the worker runs."""
    started: float = 0.0
    serving: float | None = None
    """When it said it was serving (None: not yet)."""
    last_beat: float = 0.0
    last_status: int = 0
    killed: bool = False
    """Killed by the watchdog (it exits -9 soon)."""
    failed_starts: int = 0
    quick_deaths: int = 0
    restarts: int = 0
    restart_at: float | None = field(default=None)

    def down(self, now: float) -> bool:
        """Not serving, or silent for longer than a few beats."""
        return self.proc is None or self.serving is None or now - self.last_beat > SILENT


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
        # A plain flag, not a threading.Event: the signal handler runs in the main
        # thread, between two bytecodes of whatever it was doing, and Event.set()
        # takes the lock that the main thread's own Event.wait() may hold then.
        self._stopping = False
        # One key for every worker and every restart (--ephemeral-issuer-key).
        self._issuer_key = generate_issuer_key() if settings.ephemeral_issuer_key else None
        self._directory: Path | None = None
        self._sockets: SocketGroup | None = None
        self._down: list[int] | None = None

    @property
    def directory(self) -> Path:
        """The private directory of the siblings' sockets and the ``down`` file."""
        if self._directory is None:
            remove_stale_directories()
            self._directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX))
            (self._directory / "pid").write_text(str(os.getpid()))
        return self._directory

    def run(self) -> int:
        """Run until SIGTERM/SIGINT/SIGHUP (0 when every worker drained) or a failed
        start (1)."""
        try:
            self.directory  # noqa: B018 (made here: a failure is said, not a spawn's)
        except OSError as exc:
            why = (
                f"--workers needs a writable temporary directory (TMPDIR, /tmp) for the "
                f"workers' sockets: {exc}"
            )
            log.error("workers_failed", reason=why)
            print(f"matchmaker: {why}", file=sys.stderr)
            return 1
        previous = {sig: signal.signal(sig, self._on_stop) for sig in stop_signals()}
        try:
            self._sockets = bind_sockets(self.settings)
            self._log_started()
            now = time.monotonic()
            for slot in self._slots:
                self._spawn(slot, now)
            try:
                failed = self._watch()
            except Exception:
                # Drain the workers that serve rather than kill them with the supervisor.
                log.exception("supervisor_failed")
                failed = "the supervisor failed (its traceback is logged as supervisor_failed)"
            return self._stop_all(failed)
        finally:
            for slot in self._slots:
                self._kill(slot)
                self._closed(slot)
            if self._sockets is not None:
                self._sockets.close()
            if self._directory is not None:
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

    def _spawn(self, slot: _Slot, now: float) -> None:
        """Start worker ``slot``; if the system refuses (EAGAIN, ENOMEM, EMFILE...),
        log it and try again after the backoff, as after a death."""
        assert self._sockets is not None
        child: list[int] = []  # the ends the worker inherits: closed here once it has them
        ours: list[int] = []
        try:
            beat_read, beat_write = _pipe(child, ours, keep="read")
            life_read, life_write = _pipe(child, ours, keep="write")
            key_read = -1
            if self._issuer_key is not None:
                key_read, key_write = _pipe(child, ours, keep="write")
                ours.remove(key_write)
                with os.fdopen(key_write, "wb") as pipe:
                    pipe.write(self._issuer_key)
            master = self._sockets.master[slot.index].fileno() if self._sockets.master else -1
            spec = WorkerSpec(
                index=slot.index, workers=len(self._slots), replica_id=slot.replica_id,
                udp_fd=self._sockets.udp[slot.index].fileno(),
                http_fd=self._sockets.http.fileno(), master_fd=master, beat_fd=beat_write,
                lifeline_fd=life_read, key_fd=key_read, directory=str(self.directory),
                restarts=slot.restarts,
            )  # fmt: skip
            fds = [spec.udp_fd, spec.http_fd, *child] + ([master] if master >= 0 else [])
            cmd = [*self._command, *spec.argv(), "--", *self._argv]
            # A session of its own: a terminal's Ctrl-C reaches the supervisor alone,
            # which forwards one SIGTERM. SIGUSR1 (a stack dump) is blocked until the
            # worker's handler is in place: its default would kill a starting worker.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            try:
                slot.proc = subprocess.Popen(
                    cmd, env=self._env, pass_fds=fds, start_new_session=True
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except OSError as exc:
            for fd in ours:
                os.close(fd)
            log.error("worker_spawn_failed", index=slot.index, error=str(exc))
            slot.failed_starts += 1
            self._schedule(slot, now, exc.errno or 0)
            return
        finally:
            for fd in child:
                os.close(fd)
        slot.beat_fd, slot.lifeline_fd = beat_read, life_write
        slot.started, slot.last_beat, slot.serving = now, now, None
        slot.restart_at, slot.killed = None, False
        log.info("worker_started", index=slot.index, pid=slot.proc.pid, replica_id=slot.replica_id)

    def _on_stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _watch(self) -> str | None:
        """Supervise until told to stop (None) or a worker cannot start (why)."""
        polled = time.monotonic()
        while not self._stopping:
            time.sleep(POLL)  # a signal's handler runs at once; the loop looks next round
            if self._stopping:
                break
            now = time.monotonic()
            late = now - polled - POLL
            polled = now
            if late > FROZEN:
                # Frozen or starved with the workers (a paused container): their beats
                # are still on their way; what was not seen counts for nothing.
                for slot in self._slots:
                    slot.last_beat += late
                    slot.started += late
            for slot in self._slots:
                self._read_beats(slot, now)
                if slot.proc is not None and (code := slot.proc.poll()) is not None:
                    self._exited(slot, code, now)
                elif slot.proc is not None:
                    self._watchdog(slot, now)
                if slot.failed_starts >= START_ATTEMPTS:
                    return (
                        f"worker {slot.index} exited {slot.failed_starts} times in a row "
                        f"before serving (last exit status {slot.last_status}); its log "
                        "lines above say why"
                    )
                if slot.proc is None and slot.restart_at is not None and now >= slot.restart_at:
                    self._spawn(slot, now)
            self._publish_down(now)
        return None

    def _read_beats(self, slot: _Slot, now: float) -> None:
        if slot.beat_fd is None:
            return
        try:
            got = os.read(slot.beat_fd, 4096)
        except BlockingIOError:
            return
        if not got:  # the worker is exiting
            os.close(slot.beat_fd)
            slot.beat_fd = None
            return
        slot.last_beat = now
        if slot.serving is None and SERVING in got:
            slot.serving, slot.failed_starts = now, 0

    def _watchdog(self, slot: _Slot, now: float) -> None:
        """SIGKILL a serving worker silent for ``--worker-watchdog`` seconds (a stuck
        event loop, SIGSTOP), a starting one silent for `START_GRACE` (since its start
        or its last sign of life): its flows wait on its socket for the restart (a
        starting one counts as a failed start)."""
        assert slot.proc is not None
        if slot.killed:
            return
        limit = self.settings.worker_watchdog
        if slot.serving is None:
            limit = max(limit, START_GRACE)
        silent = now - slot.last_beat
        if silent < limit:
            return
        log.error(
            "worker_hung", index=slot.index, pid=slot.proc.pid, silent=round(silent, 1),
            serving=slot.serving is not None,
        )  # fmt: skip
        slot.killed = True
        with contextlib.suppress(ProcessLookupError):
            slot.proc.kill()

    def _publish_down(self, now: float) -> None:
        """Write the indices of the workers that are down for /healthz and /readyz."""
        down = [s.index for s in self._slots if s.down(now)]
        if down == self._down:
            return
        path = self.directory / DOWN_FILE
        partial = path.with_suffix(".new")
        partial.write_text(",".join(map(str, down)))
        partial.replace(path)
        self._down = down

    def _exited(self, slot: _Slot, code: int, now: float) -> None:
        self._read_beats(slot, now)
        pid = slot.proc.pid if slot.proc else 0
        self._closed(slot)
        slot.proc = None
        slot.last_status = code
        if slot.serving is None:
            slot.failed_starts += 1
        if slot.serving is not None and now - slot.serving >= STABLE_AFTER:
            slot.quick_deaths = 0
        delay = self._schedule(slot, now, code)
        log.warning(
            "worker_exited", index=slot.index, pid=pid, status=code, restart_in=delay,
            restarts=slot.restarts, serving=slot.serving is not None,
        )  # fmt: skip

    @staticmethod
    def _schedule(slot: _Slot, now: float, status: int) -> float:
        """Restart ``slot`` after the backoff; the delay."""
        delay = min(BACKOFF_MAX, BACKOFF_FIRST * (1 << min(slot.quick_deaths, BACKOFF_STEPS)))
        slot.quick_deaths += 1
        slot.restarts += 1
        slot.restart_at = now + delay
        slot.last_status = status
        return delay

    @staticmethod
    def _closed(slot: _Slot) -> None:
        """Close the supervisor's ends of a worker's pipes (it has exited)."""
        for fd in (slot.beat_fd, slot.lifeline_fd):
            if fd is not None:
                os.close(fd)
        slot.beat_fd = slot.lifeline_fd = None

    def _stop_all(self, failed: str | None) -> int:
        """Forward the stop once to every worker, wait for them to drain; the exit
        status.  More signals to the supervisor meanwhile change nothing: a worker
        still running ``shutdown_timeout`` + `KILL_MARGIN` seconds on is killed."""
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
        clean = True
        for slot in live:
            assert slot.proc is not None
            try:
                code = slot.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker_killed", index=slot.index, pid=slot.proc.pid)
                self._kill(slot)
                code = -signal.SIGKILL
            self._read_beats(slot, time.monotonic())
            codes.append(code)
            # One still in Python's start-up dies of the signal: it had nothing to drain.
            clean = clean and (code == 0 or (code == -signal.SIGTERM and slot.serving is None))
        log.info("workers_stopped", statuses=",".join(map(str, codes)))
        return 1 if failed is not None or not clean else 0

    @staticmethod
    def _kill(slot: _Slot) -> None:
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.kill()
            slot.proc.wait()


def _pipe(child: list[int], ours: list[int], keep: str) -> tuple[int, int]:
    """A pipe whose ``keep`` end ("read"/"write") the supervisor keeps (non-blocking
    when it reads) and whose other end the worker inherits."""
    read_end, write_end = os.pipe()
    mine, theirs = (read_end, write_end) if keep == "read" else (write_end, read_end)
    ours.append(mine)
    child.append(theirs)
    if keep == "read":
        os.set_blocking(read_end, False)
    return read_end, write_end


def remove_stale_directories() -> None:
    """Remove the private directories that supervisors of this user which died
    without cleaning up (SIGKILL) left in the temporary directory."""
    for path in Path(tempfile.gettempdir()).glob(DIRECTORY_PREFIX + "*"):
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int((path / "pid").read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours, being created, or its supervisor lives


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
