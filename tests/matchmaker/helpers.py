"""What the matchmaker tests share beyond the test doubles of ``fakes``: a real
redis-server, the service on the fake transport, settings for a daemon on loopback
and a game's own rudp socket, host records, and a bounded wait."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

import rudp
from matchmaker.addresses import Address
from matchmaker.messages import HostInfo, ListFilter, ListPage, ListRequest, Register, Registered
from matchmaker.metrics import Metrics
from matchmaker.registry import MemoryRegistry, Registry
from matchmaker.registry.redis import RedisRegistry
from matchmaker.service import MatchmakerService
from matchmaker.settings import Settings
from tests.matchmaker.fakes import FakeClock, Wire, attach

RegistryFactory = Callable[..., Awaitable[RedisRegistry]]
"""The `replica` fixture: ``await replica(replica_id=..., **options)``."""

# -- a redis-server of the test's own ------------------------------------------------------


REDIS_BINARY = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def synced_replica(url: str, **kw: object) -> RedisRegistry:
    """A RedisRegistry on ``url``, started and synced (bounded wait).

    2 s a call: a loaded machine's slow reply is not an outage (a killed Redis
    refuses at once)."""
    options: dict[str, object] = {"retry_interval": 0.05, "op_timeout": 2.0}
    options.update(kw)
    reg = RedisRegistry(url, **options)  # type: ignore[arg-type]
    await reg.start()
    await asyncio.wait_for(reg.wait_synced(), 5)
    return reg


class RedisProcess:
    """One redis-server we start, kill and restart (same port, same data dir).

    Appendonly, so a SIGKILL loses nothing: a restart comes back with the
    hosts' old `seen` scores, which is the case the no-mass-expiry logic
    exists for.  Redis writes its log before it replies, so the kernel holds
    every acknowledged write when the process dies; no fsync (``no``) keeps a
    loaded disk from slowing each reply (only a crash of the machine would
    lose data).
    """

    def __init__(self, directory: Path) -> None:
        assert REDIS_BINARY is not None
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_BINARY is not None
        args = [REDIS_BINARY, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "no", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._ping():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- a matchmaker daemon in a process of its own (``python -m matchmaker``) ---------------


class DaemonProcess:
    """One replica as operators run it: its own process, killed or stopped by signal.

    Its log goes to ``<directory>/<replica_id>.log`` (JSON lines).
    """

    def __init__(self, directory: Path, replica_id: str, store: str, *flags: str) -> None:
        self.replica_id = replica_id
        self.port = free_udp_port()
        self.http_port = free_port()
        self.log_path = directory / f"{replica_id}.log"
        self.args = [sys.executable, "-m", "matchmaker", "--replica-id", replica_id]
        self.args += ["--store", store, "--bind", "127.0.0.1", "--port", str(self.port)]
        self.args += ["--http-bind", "127.0.0.1", "--http-port", str(self.http_port)]
        self.args += ["--allow-private", "--log-format", "json", *flags]
        # Loopback is one source: the per-source limits would hold the tests' fleets.
        self.args += ["--max-connections-per-source", "0", "--handshake-rate", "0"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def launch(self) -> None:
        """Start the process, without waiting for it to serve."""
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen(self.args, stdout=log_file, stderr=subprocess.STDOUT)

    async def start(self, timeout: float = 20.0) -> None:
        self.launch()
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.replica_id} exited with {self.proc.returncode}")
            if loop.time() > deadline:
                raise RuntimeError(f"{self.replica_id} not ready within {timeout} s")
            await asyncio.sleep(0.1)

    async def ready(self) -> bool:
        """Whether /readyz answers 200."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.http_port)
        except OSError:
            return False
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 5)
            return status.split(b" ")[1:2] == [b"200"]
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 20.0) -> int:
        """Wait (without blocking the loop) for the process to end; its exit status."""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (code := self.proc.poll()) is None:
            if loop.time() > deadline:
                stacks = await self.stacks()
                raise AssertionError(
                    f"{self.replica_id} still running after {timeout} s; its threads:\n{stacks}"
                )
            await asyncio.sleep(0.05)
        return code

    async def stacks(self) -> str:
        """What the process and its children (a supervisor's workers) write on SIGUSR1,
        their threads' stacks: the end of the log, for a test that found one stuck."""
        assert self.proc is not None
        pids = [self.proc.pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            pids += [int(p) for p in children.read_text().split()]
        # Held by pidfd: a worker that ends meanwhile frees its pid for another process.
        pidfds = []
        for pid in pids:
            with contextlib.suppress(OSError):
                pidfds.append(os.pidfd_open(pid))
        try:
            for fd in pidfds:  # one at a time: their dumps share the log
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, signal.SIGUSR1)
                await asyncio.sleep(0.5)
        finally:
            for fd in pidfds:
                os.close(fd)
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(x for x in text.splitlines()[-400:] if not x.startswith("{"))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    async def metric(self, sample: str, default: float | None = None) -> float:
        """The value of one sample of /metrics, written as exposed (``name{labels}``);
        ``default`` when absent, an AssertionError if that is None."""
        found = (await self.samples()).get(sample, default)
        assert found is not None, f"no {sample} in /metrics"
        return found

    async def samples(self) -> dict[str, float]:
        """Every sample of one /metrics scrape, by ``name{labels}`` as exposed."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.http_port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            body = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        head, _, text = body.decode().partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 200"), head
        found = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                found[name] = float(value)
        return found


# -- a bounded wait ------------------------------------------------------------------------


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (bounded) for state another task or process is bringing about."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- host records --------------------------------------------------------------------------


def host(name: str = "h", game: str = "q3", **kw: object) -> HostInfo:
    return HostInfo(name=name, game=game, version="1", max_players=8, **kw)  # type: ignore[arg-type]


def pub(n: int) -> str:
    """A global (listable) IPv4 address."""
    return f"93.184.216.{n}"


def info(name: str = "srv", **kw: Any) -> HostInfo:
    fields: dict[str, Any] = {"name": name, "game": "q3", "version": "1", "max_players": 8}
    fields.update(kw)
    return HostInfo(**fields)


# -- the service over the fake transport, on a stepped clock -------------------------------


NONCE = b"N" * 16


WALL_CLOCK = 1_800_000_000.0
"""The UNIX time the service's tokens are issued at."""


class Harness:
    def __init__(self, registry: Registry | None = None, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.registry = registry or MemoryRegistry(clock=self.clock)
        self.metrics = Metrics(CollectorRegistry())
        options: dict[str, Any] = {"register_burst": 100.0, "list_burst": 100.0}
        options["introduce_burst"] = 100.0
        issuer = overrides.pop("issuer", None)
        options.update(overrides)
        self.settings = Settings(**options)
        self.service = MatchmakerService(
            self.settings,
            self.registry,
            self.metrics,
            rng=random.Random(1),
            clock=self.clock,
            nonce=lambda n: NONCE[:n],
            issuer=issuer,
            wall=lambda: WALL_CLOCK,
        )

    def connect(self, ip: str, port: int = 27960) -> Wire:
        return attach(self.service.handle, (ip, port))

    async def host(self, ip: str, port: int = 27960, **kw: Any) -> Wire:
        wire = self.connect(ip, port)
        reply = await wire.request(Register(request_id=1, host=info(**kw)))
        assert isinstance(reply, Registered), reply
        return wire

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def collect_list(wire: Wire, request_id: int = 9, **filters: Any) -> list[ListPage]:
    wire.send(ListRequest(request_id=request_id, filter=ListFilter(game="q3", **filters)))
    pages = []
    while True:
        page = await wire.recv()
        assert isinstance(page, ListPage), page
        pages.append(page)
        if page.end:
            return pages


# -- a daemon on loopback ------------------------------------------------------------------


HOST: dict[str, Any] = {"name": "e2e", "game": "q3", "version": "1", "max_players": 8}


def settings(**kw: Any) -> Settings:
    options: dict[str, Any] = {
        "bind": "127.0.0.1",
        "port": 0,
        "http_bind": "127.0.0.1",
        "http_port": 0,
        "allow_private": True,  # everything here is loopback
        # Loopback is one source: the per-source limits would hold the tests' fleets.
        "max_connections_per_source": 0,
        "handshake_rate": 0.0,
        "keepalive": 0.2,
        "sweep_interval": 0.1,
        "shutdown_timeout": 3.0,
    }
    options.update(kw)
    return Settings(**options)


async def accepting_endpoint() -> tuple[rudp.Server, asyncio.Queue[rudp.Connection]]:
    """A game's own rudp socket: accepts peers and talks to the matchmaker."""
    accepted: asyncio.Queue[rudp.Connection] = asyncio.Queue()

    async def handler(conn: rudp.Connection) -> None:
        await accepted.put(conn)
        await conn.wait_closed()

    server = await rudp.serve(handler, "127.0.0.1", 0)
    return server, accepted


# -- a synthetic population of hosts for the list and index tests ------------------

GAMES = ("q3", "ut", "cs")
VERSIONS = ("1.0", "1.1", "2.0")
MAPS = ("dm1", "dm2", "ctf1", "")
REGIONS = ("eu", "us", "asia", "")
TAGS = ("ctf", "ffa", "insta", "mod", "ranked")
NAMES = ("Alpha", "bravo", "CHARLIE", "Delta Force", "echo")


@dataclass(frozen=True)
class Entry:
    address: Address
    info: HostInfo


def make_hosts(n: int = 1000, seed: int = 1) -> list[Entry]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.3:
            ip = f"2001:db8:{rng.randrange(1, 60):x}::1"  # one /64 each
        else:
            ip = f"198.51.100.{rng.randrange(1, 120)}"
        max_players = rng.choice((2, 8, 16))
        info = HostInfo(
            name=f"{rng.choice(NAMES)} #{i}",
            game=rng.choice(GAMES),
            version=rng.choice(VERSIONS),
            map=rng.choice(MAPS),
            max_players=max_players,
            players=rng.choice((0, max_players, rng.randrange(0, max_players + 1))),
            password=rng.random() < 0.25,
            tags=tuple(t for t in TAGS if rng.random() < 0.3),
            region=rng.choice(REGIONS),
        )
        out.append(Entry(Address(ip, 20000 + i), info))
    return out


HOSTS = make_hosts()


def reference(e: Entry, f: ListFilter) -> bool:
    """The filter semantics, written out longhand and independently of listing.py."""
    h = e.info
    ok = h.game == f.game
    if f.version is not None:
        ok = ok and h.version == f.version
    if f.map is not None:
        ok = ok and h.map == f.map
    if f.region is not None:
        ok = ok and h.region == f.region
    if f.not_full:
        ok = ok and h.players < h.max_players
    if f.not_empty:
        ok = ok and h.players != 0
    if f.password is True:
        ok = ok and h.password
    if f.password is False:
        ok = ok and not h.password
    for t in f.tags_all:
        ok = ok and t in h.tags
    if f.tags_any:
        ok = ok and any(t in h.tags for t in f.tags_any)
    if f.name is not None:
        ok = ok and f.name.lower() in h.name.lower()
    if f.family == 4:
        ok = ok and ":" not in e.address.ip
    if f.family == 6:
        ok = ok and ":" in e.address.ip
    return ok


SINGLE_FILTERS = (
    [ListFilter(game=g) for g in (*GAMES, "none")]
    + [ListFilter(game="q3", version=v) for v in VERSIONS]
    + [ListFilter(game="q3", map=m) for m in MAPS]
    + [ListFilter(game="q3", region=r) for r in REGIONS]
    + [ListFilter(game="q3", not_full=True), ListFilter(game="q3", not_empty=True)]
    + [ListFilter(game="q3", password=p) for p in (True, False)]
    + [ListFilter(game="q3", tags_all=(t,)) for t in TAGS]
    + [ListFilter(game="q3", tags_all=("ctf", "insta")), ListFilter(game="q3", tags_any=TAGS[:2])]
    + [ListFilter(game="q3", name=n) for n in ("alpha", "FORCE", "#99", "zzz")]
    + [ListFilter(game="q3", family=4), ListFilter(game="q3", family=6)]
)
