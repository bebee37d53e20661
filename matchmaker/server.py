"""Daemon lifecycle: `start()`, run until told to stop, bounded `shutdown()`.

Start order: registry (it may need to load), then the rudp port, then HTTP,
then the background loops (expiry sweeps, relayed notices).  Shutdown first
stops accepting (new connections are closed, registrations refused with
``shutting_down`` so hosts go to another replica, /readyz turns 503), then
runs the other way round, bounded by ``shutdown_timeout``: connections get a
graceful close first (their hosts re-register elsewhere; their entries stay
listed meanwhile); whatever is still running when the time is up is
cancelled.  Signal handlers only set the stop event (see `run`).
"""

from __future__ import annotations

import asyncio
import random
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog

import rudp
from matchmaker.addresses import Address
from matchmaker.catalog import EVERY_GAME, every_game_list
from matchmaker.gctuning import tune_gc
from matchmaker.heartbeat import FIRST_BYTES
from matchmaker.http import Exposition, HttpApi, HttpServer, Servers, entry_json
from matchmaker.master import MasterProtocol, MasterResponder
from matchmaker.messages import HostEntry, ListRequest, entry_fields
from matchmaker.metrics import MASTER_RESULTS, Metrics
from matchmaker.ratelimit import RateLimiter
from matchmaker.registry import MemoryRegistry, Registry
from matchmaker.registry.redis import RedisRegistry
from matchmaker.service import MatchmakerService
from matchmaker.settings import Settings
from matchmaker.stopping import STOP_WITHIN, cancel_and_wait
from rudp.config import BASE_DATAGRAM_SIZE
from rudp.tokens import Issuer, generate_issuer_key

log = structlog.get_logger("matchmaker.server")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What stops the daemon (drained); repeated, logged as ``stop_repeated``."""


def stop_signals() -> tuple[signal.Signals, ...]:
    """`STOP_SIGNALS` less SIGHUP when it is ignored (``nohup``, a container's
    PID 1 with no handler): a daemon started so must outlive its terminal."""
    return tuple(
        s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN
    )


def build_registry(settings: Settings, metrics: Metrics) -> Registry:
    if settings.uses_redis:
        return RedisRegistry(
            settings.store,
            hide_after=settings.hide_after,
            expire_after=settings.expire_after,
            replica_id=settings.replica_id or None,
            prefix=settings.redis_prefix,
            observer=metrics.observe_registry_op,
            on_full=metrics.count_registry_full,
            limits=settings.limits,
        )
    return MemoryRegistry(
        hide_after=settings.hide_after,
        expire_after=settings.expire_after,
        replica_id=settings.replica_id or "local",
    )


def build_issuer(settings: Settings) -> Issuer | None:
    """The connect-token issuer of ``settings`` (``matchmaker.keys``), if any."""
    private = settings.issuer_private_key()
    if private is None and settings.ephemeral_issuer_key:
        private = generate_issuer_key()
    return None if private is None else Issuer(private)


@dataclass(frozen=True, slots=True)
class ListeningSockets:
    """Sockets a worker process is handed, bound by its supervisor (`matchmaker.workers`)
    instead of the daemon binding ``--bind``/``--port`` and the others itself."""

    udp: socket.socket
    """This worker's own UDP socket of the ``SO_REUSEPORT`` group on ``--port``."""
    http: socket.socket
    """The HTTP port's listening socket, shared by every worker."""
    master: socket.socket | None
    """This worker's own UDP socket of the group on ``--master-port`` (with ``--master``)."""


class Matchmaker:
    """The whole daemon: rudp port, HTTP port, registry and background loops."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        registry: Registry | None = None,
        rudp_config: rudp.Config | None = None,
        rng: random.Random | None = None,
        sockets: ListeningSockets | None = None,
        exposition: Exposition | None = None,
        issuer: Issuer | None = None,
        workers_down: Callable[[], list[int]] | None = None,
    ) -> None:
        self.settings = settings
        self._sockets = sockets
        self._exposition = exposition
        self._workers_down = workers_down
        self.metrics = metrics or Metrics()
        self.registry = registry or build_registry(settings, self.metrics)
        self.issuer = issuer or build_issuer(settings)
        self.service = MatchmakerService(
            settings, self.registry, self.metrics, rng=rng, issuer=self.issuer
        )
        # Listed hosts hold no connection (they heartbeat with datagrams); the
        # connections are clients' and registering hosts', and rudp's idle
        # timeout ends a silent one.  Peers keep talking (their own rudp
        # pings), so the daemon's own pings can be rare: at rudp's default
        # 1 s they were half of an idle fleet's datagrams.  The protocol uses
        # channel 0 only; rudp keeps per-channel queues for every connection,
        # and its default 32 channels cost ~20 KiB per connection.  Every message
        # fits the 1,200 bytes a path is assumed to carry (a list page is at most
        # 1,150), so path MTU discovery would only cost each registration's short
        # connection a probe each way and its acknowledgement.  The window is
        # what a connection's list answers may have in flight (`pages_in_flight`): at rudp's
        # 256 a 10,000-host list took 5 round trips instead of 2.
        idle = min(10.0, settings.hide_after)
        self._rudp_config = rudp_config or rudp.Config(
            idle_timeout=idle,
            keepalive_interval=idle / 3,
            max_connections=settings.max_connections,
            max_connections_per_source=settings.max_connections_per_source,
            handshake_rate_per_source=settings.handshake_rate,
            handshake_burst_per_source=settings.handshake_burst,
            source_limit_keys=settings.rate_limit_keys,
            channels=1,
            max_datagram_size=BASE_DATAGRAM_SIZE,
            window=max(256, settings.pages_in_flight),
            static_key=settings.static_private_key(),
        )
        self._udp: rudp.Server | None = None
        self._http: HttpServer | None = None
        self._master: asyncio.DatagramTransport | None = None
        self.master_responder: MasterResponder | None = None
        """What answers the master port (its counters), None when ``--master`` is off."""
        self._rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics.bind_state(
            hosts_by_game=self.registry.count_by_game,
            stale=lambda: self.registry.stale,
            connections=lambda: self.service.connections,
            max_games=settings.metrics_max_games,
            # The Redis registry's; the embedded store has no shared entries to drop.
            registry_dropped=lambda: getattr(self.registry, "dropped_events", {}),
        )
        # rudp_* series exist from the first scrape; the socket joins at start().
        self._transport_metrics = self.metrics.bind_transport(())

    @property
    def udp_address(self) -> tuple[str, int]:
        assert self._udp is not None, "not started"
        host, port = self._udp.address[:2]
        return str(host), int(port)

    @property
    def udp(self) -> rudp.Server:
        """The daemon's rudp socket (its ``stats``, its connections)."""
        assert self._udp is not None, "not started"
        return self._udp

    @property
    def master_address(self) -> tuple[str, int] | None:
        """The master-server port's address, None when ``--master`` is off."""
        if self._master is None:
            return None
        host, port = self._master.get_extra_info("sockname")[:2]
        return str(host), int(port)

    @property
    def http_address(self) -> tuple[str, int]:
        assert self._http is not None, "not started"
        return self._http.address

    def __repr__(self) -> str:
        if self._udp is None or self._http is None:
            return "<Matchmaker not started>"
        udp, http = self.udp_address, self.http_address
        return f"<Matchmaker udp {udp[0]}:{udp[1]} http {http[0]}:{http[1]}>"

    async def start(self) -> None:
        s = self.settings
        await self.registry.start()
        given = self._sockets
        self._udp = await rudp.serve(
            self.service.handle,
            s.bind,
            s.port,
            config=self._rudp_config,
            sock=given.udp if given else None,
        )
        self._udp.on_query = self.service.answer_query
        for first_byte in FIRST_BYTES:
            self._udp.set_datagram_handler(first_byte, self.service.liveness.receive)
        self.service.liveness.send = self._send_datagram
        self._transport_metrics.add(self._udp)
        api = HttpApi(
            registry=self.registry,
            metrics=self.metrics,
            list_servers=self._servers_json,
            limits=s.limits,
            list_limiter=RateLimiter(s.list_bucket, max_keys=s.rate_limit_keys),
            is_shutting_down=lambda: self.service.shutting_down,
            exposition=self._exposition,
            workers_down=self._workers_down,
        )
        self._http = HttpServer(
            api, self.metrics, timeout=s.http_timeout, max_connections=s.http_max_connections
        )
        await self._http.start(s.http_bind, s.http_port, sock=given.http if given else None)
        if s.master:
            await self._start_master()
        self._spawn(self.service.run_sweeper(), "sweeper")
        self._spawn(self.service.run_notices(), "notices")
        self._spawn(self.service.run_takeovers(), "takeovers")
        self._spawn(self.service.run_introductions(), "introductions")
        log.info(
            "matchmaker_started",
            udp=f"{self.udp_address[0]}:{self.udp_address[1]}",
            http=f"{self.http_address[0]}:{self.http_address[1]}",
            **s.startup_fields(),
            issuer_public=self.issuer.public_key.hex() if self.issuer else "",
            static_public=(self.static_public_key or b"").hex(),
        )
        if s.ephemeral_issuer_key:
            log.warning(
                "ephemeral_issuer_key",
                note="development only: a new key every start, which every host and client "
                "must be given again; production uses --issuer-key-file",
            )

    @property
    def static_public_key(self) -> bytes | None:
        """The rudp static public key (``--static-key-file``) clients authenticate
        the matchmaker with, once started; None without a static key."""
        return self._udp.public_key if self._udp is not None else None

    def _send_datagram(self, data: bytes, address: Address) -> None:
        """Send a heartbeat-protocol datagram (an introduction) from the rudp port."""
        udp = self._udp
        if udp is None:
            return
        ip = address.ip
        if len(udp.endpoint.local_address) == 4 and address.family == 4:
            ip = "::ffff:" + ip  # an IPv6 (dual-stack) socket names IPv4 peers so
        try:
            udp.send_datagram(data, (ip, address.port))
        except OSError:
            self.metrics.dropped.labels("send_failed").inc()

    async def _start_master(self) -> None:
        s = self.settings
        results = {r: self.metrics.master_queries.labels(r) for r in MASTER_RESULTS}
        responder = MasterResponder(
            self.registry,
            RateLimiter(s.list_bucket, max_keys=s.rate_limit_keys),
            page_hosts=s.page_hosts,
            rng=self._rng,
            on_rate_limited=self.metrics.rate_limited.labels("list").inc,
            on_result=lambda result: results[result].inc(),
        )
        loop = asyncio.get_running_loop()
        given = self._sockets.master if self._sockets else None
        if given is not None:
            given.setblocking(False)
            transport, _ = await loop.create_datagram_endpoint(
                lambda: MasterProtocol(responder), sock=given
            )
        else:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: MasterProtocol(responder), local_addr=(s.bind, s.master_port)
            )
        self._master = transport
        self.master_responder = responder
        host, port = self.master_address or ("", 0)
        log.info("master_started", udp=f"{host}:{port}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _servers_json(self, req: ListRequest) -> list[dict[str, Any]]:
        if req.filter.game == EVERY_GAME:
            s = self.settings
            records = every_game_list(
                self.registry,
                req.filter,
                self._rng,
                list_limit=s.list_limit,
                page_hosts=s.page_hosts,
                page_per_ip=s.page_per_ip,
            )
            entries = [HostEntry(address=r.address, info=r.info) for page in records for r in page]
            return [entry_json(entry_fields(e)) for e in entries]
        pages = await self.service.build_pages(req)
        rows = (entry_json(entry_fields(e)) for page in pages for e in page.hosts)
        return Servers(rows, partial=pages[0].partial)

    async def shutdown(self) -> None:
        """Stop serving, bounded by ``shutdown_timeout``; safe to call twice."""
        log.info("matchmaker_stopping")
        # Refuse newcomers before anything closes, so that no host registers
        # here (or reconnects here) while the others are being sent away.
        self.service.stop_accepting()
        try:
            await asyncio.wait_for(self._close_gracefully(), self.settings.shutdown_timeout)
        except TimeoutError:
            log.warning("shutdown_timeout", seconds=self.settings.shutdown_timeout)
        finally:
            await self._close_now()
        log.info("matchmaker_stopped")

    async def _close_gracefully(self) -> None:
        await self.service.close_all()
        if self._udp is not None:
            await self._udp.close()

    async def _close_now(self) -> None:
        self.service.stop_loops()
        await cancel_and_wait(self._tasks, STOP_WITHIN, "matchmaker")
        self._tasks.clear()
        if self._http is not None:
            await self._http.close()
        if self._master is not None:
            self._master.close()
        if self._udp is not None:
            self._udp.endpoint.close_now()  # no-op after a graceful close
        await self.registry.close()

    async def run(
        self,
        stop: asyncio.Event | None = None,
        on_started: Callable[[], None] | None = None,
        *,
        signals: bool = True,
    ) -> None:
        """Start, wait for SIGTERM, SIGINT or SIGHUP (or `stop`), shut down;
        ``on_started`` is called once serving.  ``signals=False``: the caller
        handles the signals and sets `stop` (a worker, whose stop before it
        serves ends it at once)."""
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = stop_signals() if signals else ()

        def on_signal(sig: signal.Signals) -> None:
            # Only the flag: the shutdown itself runs here.  A repeated signal
            # (an impatient operator, a terminal's hangup after Ctrl-C) is
            # logged and does not cut the drain short.  The handlers stay until
            # the loop closes, through the process's last step (`__main__`).
            if stop.is_set():
                log.info("stop_repeated", signal=sig.name)
            else:
                log.info("stop_signal", signal=sig.name)
            stop.set()

        for sig in handled:
            loop.add_signal_handler(sig, on_signal, sig)
        started = False
        try:
            await self.start()
            started = True
            tune_gc()  # once started: see matchmaker/gctuning.py
            if on_started is not None:
                on_started()
            await stop.wait()
        finally:
            if started:
                await self.shutdown()
            else:
                # It never served: release what did open, without stopping/stopped
                # lines for a daemon that never logged matchmaker_started.
                await self._close_now()
