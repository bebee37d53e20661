"""Prometheus export of transport statistics, read at scrape time.

Nothing here runs on the datagram path: the core keeps plain integer counters
and this collector reads them only when Prometheus scrapes. Counters of
connections that have ended are folded into per-endpoint totals so they never
go backwards. RTT is exported as a gauge histogram of the smoothed RTT of the
connections open at scrape time (a snapshot, not a history).

Usage::

    registry = prometheus_client.CollectorRegistry()
    collector = rudp.metrics.RudpCollector([server], registry=registry)
    collector.add(other_server)  # one collector for every endpoint of a registry

A registry takes one ``RudpCollector``: a second one (on the same registry)
would export every ``rudp_*`` family twice, which Prometheus rejects as an
invalid scrape, so registering it raises ``ValueError``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from weakref import WeakSet

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from rudp.connection import State
from rudp.errors import check_sequence
from rudp.stats import COUNTER_TABLE, ENDPOINT_COUNTER_TABLE
from rudp.tokens import TokenRefusal
from rudp.wire import DropReason

if TYPE_CHECKING:
    from rudp.endpoint import Endpoint

RTT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The exported connection counters: (attribute, Prometheus name, help), from the
# one table of counters.
_CONN_COUNTERS = tuple((name, metric, doc) for name, doc, metric in COUNTER_TABLE if metric)


class HasCoreEndpoint(Protocol):
    @property
    def endpoint(self) -> object: ...


class RudpCollector(Collector):
    """Collects from any number of endpoints (``Server`` objects or core ``Endpoint``s)."""

    def __init__(
        self,
        endpoints: Iterable[object] = (),
        *,
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        # Held weakly, so that a collector never keeps a closed endpoint alive: a
        # Server's asyncio endpoint through its MetricsHandle (which holds the core
        # read at scrape time, and which only the asyncio endpoint holds), or a core
        # Endpoint added directly. The mypyc-compiled classes cannot be weakly
        # referenced, so there a core Endpoint added directly is held strongly.
        check_sequence(endpoints, "endpoints")
        self._weak: WeakSet[Any] = WeakSet()
        self._strong: list[Endpoint] = []
        for endpoint in endpoints:
            self.add(endpoint)
        if registry is not None:
            try:
                registry.register(self)
            except ValueError as exc:  # DuplicateTimeseries, where prometheus_client has it
                raise ValueError(
                    "this registry already has rudp metrics (another RudpCollector?): "
                    "collect every endpoint with one collector, RudpCollector([a, b]) "
                    "or collector.add(b)"
                ) from exc

    def __repr__(self) -> str:
        return f"<RudpCollector endpoints={len(self._cores())}>"

    def add(self, endpoint: object) -> None:
        """Track an endpoint: a ``rudp.Server`` or a core ``rudp.endpoint.Endpoint``."""
        from rudp.endpoint import Endpoint

        if isinstance(endpoint, Endpoint):
            try:
                self._weak.add(endpoint)
            except TypeError:  # compiled core
                if not any(held is endpoint for held in self._strong):
                    self._strong.append(endpoint)
            return
        holder = getattr(endpoint, "endpoint", None)
        handle = getattr(holder, "metrics_handle", None)
        if not isinstance(getattr(handle, "core", None), Endpoint):
            raise TypeError(f"cannot collect rudp metrics from {endpoint!r}")
        self._weak.add(handle)

    def _cores(self) -> list[Endpoint]:
        """Each tracked core endpoint once (a Server and its core may both be added)."""
        from rudp.endpoint import Endpoint

        cores: dict[int, Endpoint] = {}
        for item in [*self._weak, *self._strong]:
            core = item if isinstance(item, Endpoint) else item.core
            cores[id(core)] = core
        return list(cores.values())

    def describe(self) -> Iterable[Metric]:
        """The families :meth:`collect` yields, without reading any endpoint: what a
        registry checks at ``register()`` time, so that a second collector on it (or
        any other ``rudp_*`` metric) is refused rather than scraped twice."""
        yield from _endpoint_counters(())
        yield from _connection_counters(())
        yield _rtt_histogram(())

    def collect(self) -> Iterable[Metric]:
        endpoints = self._cores()
        yield from _endpoint_counters(endpoints)
        yield from _connection_counters(endpoints)
        yield _rtt_histogram(endpoints)


def _endpoint_counters(endpoints: Sequence[Endpoint]) -> Iterable[Metric]:
    for attr, doc, name in ENDPOINT_COUNTER_TABLE:
        yield CounterMetricFamily(name, doc, value=sum(getattr(e.stats, attr) for e in endpoints))
    dropped = CounterMetricFamily(
        "rudp_datagrams_dropped_total", "Datagrams dropped, by reason.", labels=["reason"]
    )
    for reason in DropReason:
        dropped.add_metric([reason.value], sum(e.stats.dropped[reason] for e in endpoints))
    yield dropped
    refused = CounterMetricFamily(
        "rudp_tokens_refused_total", "Connect tokens refused, by reason.", labels=["reason"]
    )
    for refusal in TokenRefusal:
        refused.add_metric([refusal.value], sum(e.stats.tokens_refused[refusal] for e in endpoints))
    yield refused
    open_states = (State.CONNECTED, State.CLOSING)
    yield GaugeMetricFamily(
        "rudp_connections",
        "Open connections (connected or closing).",
        value=sum(1 for e in endpoints for c in e.connections if c.state in open_states),
    )


def _connection_counters(endpoints: Sequence[Endpoint]) -> Iterable[Metric]:
    for attr, name, doc in _CONN_COUNTERS:
        total = 0
        for endpoint in endpoints:
            total += endpoint.stats.closed_totals.get(attr, 0)
            total += sum(getattr(c.stats, attr) for c in endpoint.connections)
        yield CounterMetricFamily(name, doc, value=total)


def _rtt_histogram(endpoints: Sequence[Endpoint]) -> Metric:
    counts = [0] * (len(RTT_BUCKETS) + 1)
    total = 0.0
    for endpoint in endpoints:
        for conn in endpoint.connections:
            if conn.stats.rtt is None or not conn.stats.rtt.samples:
                continue
            srtt = conn.stats.srtt
            counts[bisect.bisect_left(RTT_BUCKETS, srtt)] += 1
            total += srtt
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*map(str, RTT_BUCKETS), "+Inf"), counts, strict=True):
        running += n
        buckets.append((bound, running))
    return GaugeHistogramMetricFamily(
        "rudp_rtt_seconds",
        "Smoothed round-trip time of the open connections.",
        buckets=buckets,
        gsum_value=total,
    )
