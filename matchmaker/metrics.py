"""Every matchmaker metric, in one place, on an injectable CollectorRegistry.

Conventions (Prometheus naming): base units (seconds, bytes), ``_total`` on
counters, histograms for latencies, and only *bounded* label values: result
and reason codes from enums in the code, registry operation names, HTTP paths
from a fixed list.  Never an IP address or any other peer-chosen value: the one
peer-chosen label, ``game`` on the hosts-listed gauge, is capped to the
`max_games` largest games with everything else summed under ``_other``.

Gauges that mirror state (hosts listed, registry staleness, open connections)
are read at scrape time through callbacks, so they cost nothing between
scrapes.  The hosts-listed counts walk every listed host (~7 ms at 100,000
hosts), so they are counted at most once per `HOSTS_LISTED_MAX_AGE` seconds
(for a client scraping in a loop, under a hundredth of a core instead of most of
one; the rest of a scrape is ~1 ms) and the gauge is at most that much older
than the scrape.  The rudp transport's own counters (``rudp_*``: datagrams, drops
by reason, connections, retransmissions, RTT) come from
`rudp.metrics.RudpCollector`, also read at scrape time (`Metrics.bind_transport`).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from matchmaker import __version__
from matchmaker.messages import ErrorReason
from matchmaker.registry.base import RemovalReason
from rudp.metrics import RudpCollector

OTHER_GAME = "_other"

REGISTRATION_RESULTS = ("created", "replaced", "rejected", "rate_limited", "unavailable")
UPDATE_RESULTS = ("ok", "rejected", "not_registered", "rate_limited", "unavailable")
LIST_RESULTS = ("ok", "rate_limited", "busy", "unacknowledged", "failed")
INTRODUCTION_RESULTS = ("local", "relayed", "not_found", "rate_limited", "unavailable")
MASTER_RESULTS = ("answered", "rate_limited", "dropped")
RATE_LIMITED_KINDS = ("register", "list", "introduce")
HEARTBEAT_RESULTS = (
    "ok",
    "left",
    "not_registered",
    "bad_mac",
    "replayed",
    "wrong_address",
    "truncated",
    "malformed",
    "unknown_type",
    "stopping",
    "not_owner",
    "taken_over",
    "takeover_replayed",
    "takeover_unavailable",
    "takeover_limited",
    "takeover_superseded",
    "takeover_stopping",
)
INTRODUCTION_DELIVERIES = (
    "sent",
    "resent",
    "acked",
    "unacked",
    "bad_ack",
    "late_ack",
    "overflow",
    "coalesced",
    "host_gone",
)
REGISTRY_OPS = (
    "upsert",
    "update",
    "touch",
    "take_over",
    "remove",
    "expire",
    "publish",
    "xread",
    "xrevrange",
    "zrange",
    "load",
    "time",
)
REGISTRY_FULL_OPS = ("upsert", "update")
NOTICE_DROP_REASONS = ("queue_full", "host_gone", "forward_failed", "malformed", "other")
HTTP_PATHS = ("/metrics", "/healthz", "/readyz", "/servers", "other")
DROP_REASONS = (*(r.value for r in ErrorReason), "send_failed")

HOSTS_LISTED_MAX_AGE = 1.0
"""Seconds a count of the hosts listed per game serves scrapes before it is taken again."""

# Latency buckets: list requests and registry ops are sub-millisecond to ~1 s.
_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _StateCollector(Collector):
    """Scrape-time gauges: hosts listed per game, registry staleness, connections."""

    def __init__(
        self,
        hosts_by_game: Callable[[], dict[str, int]],
        stale: Callable[[], bool],
        connections: Callable[[], int],
        max_games: int,
        registry_dropped: Callable[[], dict[str, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hosts_by_game = hosts_by_game
        self._clock = clock
        self._counted: tuple[float, list[tuple[str, int]]] | None = None
        self._stale = stale
        self._connections = connections
        self._max_games = max_games
        self._registry_dropped = registry_dropped

    def collect(self) -> Iterable[Metric]:
        hosts = GaugeMetricFamily(
            "matchmaker_hosts_listed",
            "Hosts currently visible in server lists, by game (largest games; rest in _other).",
            labels=["game"],
        )
        for game, n in self._listed():
            hosts.add_metric([game], n)
        yield hosts
        yield GaugeMetricFamily(
            "matchmaker_registry_stale",
            "1 while the shared registry is unreachable and lists are served from the last copy.",
            value=1 if self._stale() else 0,
        )
        yield GaugeMetricFamily(
            "matchmaker_connections", "Open rudp connections.", value=self._connections()
        )
        dropped = CounterMetricFamily(
            "matchmaker_registry_entries_dropped",
            "Shared-registry entries not applied (malformed stream events, stored hosts"
            " a load skipped), by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(self._registry_dropped().items()):
            dropped.add_metric([reason], n)
        yield dropped

    def _listed(self) -> list[tuple[str, int]]:
        now = self._clock()
        counted = self._counted
        if counted is None or not 0.0 <= now - counted[0] < HOSTS_LISTED_MAX_AGE:
            counted = (now, capped_games(self._hosts_by_game(), self._max_games))
            self._counted = counted
        return counted[1]


def capped_games(counts: dict[str, int], max_games: int) -> list[tuple[str, int]]:
    """The `max_games` largest games by count, plus the sum of the rest as _other."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    top = ranked[:max_games]
    rest = sum(n for _, n in ranked[max_games:])
    return [*top, (OTHER_GAME, rest)] if rest else top


class Metrics:
    """The matchmaker's metrics; pass a fresh CollectorRegistry in tests."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.registrations = Counter(
            "matchmaker_registrations", "Host registrations, by result.", ["result"], registry=r
        )
        self.updates = Counter(
            "matchmaker_updates", "Host info updates, by result.", ["result"], registry=r
        )
        self.removals = Counter(
            "matchmaker_removals",
            "Hosts removed from the registry, by reason.",
            ["reason"],
            registry=r,
        )
        self.list_requests = Counter(
            "matchmaker_list_requests", "Server list requests, by result.", ["result"], registry=r
        )
        self.list_duration = Histogram(
            "matchmaker_list_request_duration_seconds",
            "Time from a list answer's turn to its last page handed to the transport.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.list_hosts_sent = Counter(
            "matchmaker_list_hosts_sent",
            "Host entries in list answers acknowledged in full.",
            registry=r,
        )
        self.introductions = Counter(
            "matchmaker_introductions", "NAT introductions, by result.", ["result"], registry=r
        )
        self.heartbeats = Counter(
            "matchmaker_heartbeats",
            "Connectionless heartbeat datagrams (and leaves), by result.",
            ["result"],
            registry=r,
        )
        self.introduction_datagrams = Counter(
            "matchmaker_introduction_datagrams",
            "Introductions sent to hosts as datagrams, and their acknowledgements.",
            ["result"],
            registry=r,
        )
        self.rate_limited = Counter(
            "matchmaker_rate_limited_requests",
            "Requests refused by a rate limit, by kind.",
            ["kind"],
            registry=r,
        )
        self.master_queries = Counter(
            "matchmaker_master_queries",
            "Master-server queries on --master-port, by result.",
            ["result"],
            registry=r,
        )
        self.dropped = Counter(
            # The name says datagrams, for the alert rules and dashboards built on it.
            "matchmaker_dropped_datagrams",
            "Matchmaker messages (not datagrams: rudp_datagrams_dropped_total counts those) "
            "refused or dropped, by reason: requests and unconnected queries refused with "
            "an error reason, and replies or introductions the socket would not send "
            "(send_failed).",
            ["reason"],
            registry=r,
        )
        self.registry_latency = Histogram(
            "matchmaker_registry_operation_duration_seconds",
            "Latency of shared-registry operations, by operation.",
            ["op"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.registry_errors = Counter(
            "matchmaker_registry_errors",
            "Failed registry operations, by operation.",
            ["op"],
            registry=r,
        )
        self.registry_full = Counter(
            "matchmaker_registry_full",
            "Registrations and updates Redis refused over its maxmemory (the host is"
            " told unavailable), by operation.",
            ["op"],
            registry=r,
        )
        self.notices_dropped = Counter(
            "matchmaker_notices_dropped",
            "Introductions relayed between replicas and dropped before reaching their"
            " host, by reason.",
            ["reason"],
            registry=r,
        )
        self.http_requests = Counter(
            "matchmaker_http_requests",
            "HTTP requests, by path and status.",
            ["path", "code"],
            registry=r,
        )
        build = Info("matchmaker_build", "Build information.", registry=r)
        build.info({"version": __version__, "python": platform.python_version()})
        self._init_series()

    def _init_series(self) -> None:
        # Create every known series at zero, so rates work from the first scrape.
        for label in REGISTRATION_RESULTS:
            self.registrations.labels(label)
        for label in UPDATE_RESULTS:
            self.updates.labels(label)
        for reason in RemovalReason:
            self.removals.labels(reason.value)
        for label in LIST_RESULTS:
            self.list_requests.labels(label)
        for label in INTRODUCTION_RESULTS:
            self.introductions.labels(label)
        for label in RATE_LIMITED_KINDS:
            self.rate_limited.labels(label)
        for label in HEARTBEAT_RESULTS:
            self.heartbeats.labels(label)
        for label in INTRODUCTION_DELIVERIES:
            self.introduction_datagrams.labels(label)
        for label in DROP_REASONS:
            self.dropped.labels(label)
        for label in MASTER_RESULTS:
            self.master_queries.labels(label)
        for label in REGISTRY_FULL_OPS:
            self.registry_full.labels(label)
        for label in NOTICE_DROP_REASONS:
            self.notices_dropped.labels(label)

    def bind_state(
        self,
        *,
        hosts_by_game: Callable[[], dict[str, int]],
        stale: Callable[[], bool],
        connections: Callable[[], int],
        max_games: int,
        registry_dropped: Callable[[], dict[str, int]] = dict,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Register the scrape-time gauges (once, when the daemon's parts exist)."""
        self.registry.register(
            _StateCollector(hosts_by_game, stale, connections, max_games, registry_dropped, clock)
        )

    def bind_transport(self, endpoints: Iterable[object]) -> RudpCollector:
        """Export rudp's transport counters (``rudp_*``) for `endpoints` (``rudp.Server``s).

        Read at scrape time from the endpoints' own counters: datagrams, bytes,
        connections, retransmissions, datagrams dropped by reason, RTT.
        """
        return RudpCollector(endpoints, registry=self.registry)

    def observe_registry_op(self, op: str, seconds: float, failed: bool) -> None:
        """The Redis registry's OpObserver."""
        label = op if op in REGISTRY_OPS else "other"
        self.registry_latency.labels(label).observe(seconds)
        if failed:
            self.registry_errors.labels(label).inc()

    def count_registry_full(self, op: str) -> None:
        """The Redis registry's ``on_full``: Redis refused the write over its
        ``maxmemory``."""
        self.registry_full.labels(op if op in REGISTRY_OPS else "other").inc()

    def count_notice_dropped(self, reason: str) -> None:
        """A relayed introduction dropped (`NOTICE_DROP_REASONS`)."""
        self.notices_dropped.labels(reason if reason in NOTICE_DROP_REASONS else "other").inc()

    def observe_http(self, path: str, code: int) -> None:
        self.http_requests.labels(path if path in HTTP_PATHS else "other", str(code)).inc()
