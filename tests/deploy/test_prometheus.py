"""A real Prometheus, configured from deploy/prometheus/, scraping the image's daemon.

The derived config keeps the repository's jobs, relabelling and alerting
rules; only the targets (the live daemon and Prometheus itself on loopback)
and the intervals (1 s) change. The dashboard's and the alerts' queries then
run against what was scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from matchmaker.client import MatchmakerClient
from matchmaker.workers import KILL_MARGIN
from tests.deploy.conftest import ROOT, Container, free_port, http_get, wait_until

PROMETHEUS = shutil.which("prometheus")
REDIS_SERVER = shutil.which("redis-server")
DEPLOY = ROOT / "deploy"
DEADLINE = 30.0

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus binary not found (apt-get install -y prometheus; .ci/run installs it)",
)


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        status, body = http_get(f"{self.url}/api/v1/{path}?{query}", timeout=5)
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", (path, params, payload)
        return payload["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def wait_for(self, expr: str, expected: float) -> None:
        wait_until(
            lambda: self.value(expr) == expected,
            timeout=DEADLINE,
            what=f"{expr} == {expected} (last: {self.query(expr)})",
            interval=0.25,
        )


def derived_config(tmp: Path, matchmaker: str, prometheus: str) -> Path:
    """deploy/prometheus/prometheus.yml with loopback targets and 1 s intervals."""
    import yaml  # type: ignore[import-untyped, unused-ignore]

    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
    targets = {"matchmaker": [matchmaker], "prometheus": [prometheus]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def container(run_container: Callable[..., Container]) -> Container:
    # Everything here is loopback, which the daemon refuses to list by default.
    return run_container(MATCHMAKER_ALLOW_PRIVATE="true")


@contextlib.contextmanager
def running_prometheus(http_port: int, tmp_path: Path) -> Iterator[Prometheus]:
    """A Prometheus with the repository's config, scraping the daemon on `http_port`."""
    assert PROMETHEUS is not None
    address = f"127.0.0.1:{free_port()}"
    config = derived_config(tmp_path, f"127.0.0.1:{http_port}", address)
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={address}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://{address}", proc, log)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return http_get(server.url + "/-/ready", timeout=0.5)[0] == 200
        except OSError:
            return False

    try:
        wait_until(ready, timeout=DEADLINE, what="prometheus /-/ready")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def prometheus(deploy_tools: None, container: Container, tmp_path: Path) -> Iterator[Prometheus]:
    with running_prometheus(container.http_port, tmp_path) as server:
        yield server


@pytest.fixture
async def three_hosts(container: Container) -> AsyncIterator[list[MatchmakerClient]]:
    """Three registered game hosts (each its own rudp socket, so its own address)."""
    games = [await rudp.open_endpoint("127.0.0.1") for _ in range(3)]
    hosts = [MatchmakerClient.to("127.0.0.1", container.udp_port, via=g) for g in games]
    try:
        for i, host in enumerate(hosts):
            await host.register(name=f"host {i}", game="q3", version="1.32c", max_players=8)
        yield hosts
    finally:
        for host in hosts:
            await host.close()
        for game in games:
            await game.close()


def dashboard() -> dict[str, Any]:
    path = DEPLOY / "grafana" / "dashboards" / "matchmaker.json"
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def dashboard_queries() -> dict[str, str]:
    """Panel title (and target ref) -> PromQL, with Grafana's variables filled in."""
    out: dict[str, str] = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
            out[f"{panel['title']} [{target['refId']}]"] = expr
    return out


def alert_queries() -> dict[str, str]:
    import yaml  # type: ignore[import-untyped, unused-ignore]

    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


async def test_prometheus_scrapes_what_the_daemon_did(
    prometheus: Prometheus, container: Container, three_hosts: list[MatchmakerClient]
) -> None:
    hosts_listed = dashboard_queries()["Hosts listed [A]"]

    def check() -> None:
        up = prometheus.query('up{job="matchmaker"}')
        assert [(s["metric"]["replica"], s["value"][1]) for s in up] == [("127.0.0.1", "1")]
        prometheus.wait_for(hosts_listed, 3)
        prometheus.wait_for('sum(matchmaker_registrations_total{result="created"})', 3)
        # rudp's transport metrics are scraped too: each host registered over a
        # connection, then closed it (listed hosts heartbeat with datagrams).
        prometheus.wait_for('sum(rudp_connections_accepted_total{job="matchmaker"})', 3)
        prometheus.wait_for('sum(rudp_connections{job="matchmaker"})', 0)
        # The repository's metric relabelling is in force: no *_created series.
        assert prometheus.query('count({job="matchmaker", __name__=~".+_created"})') == []

    wait_until(
        lambda: prometheus.value('up{job="matchmaker"}') == 1.0,
        timeout=DEADLINE,
        what="up == 1",
        interval=0.25,
    )
    await asyncio.to_thread(check)

    # One host leaves (its LEAVE datagram): Prometheus sees 2 at its next scrape.
    await three_hosts[0].close()
    await asyncio.to_thread(prometheus.wait_for, hosts_listed, 2)
    left = 'sum(matchmaker_heartbeats_total{job="matchmaker", result="left"})'
    await asyncio.to_thread(prometheus.wait_for, left, 1)


def test_rules_load_and_queries_run(prometheus: Prometheus) -> None:
    prometheus.wait_for('up{job="matchmaker"}', 1)

    def all_rules_evaluated() -> bool:
        groups = prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert {r["name"] for r in rules} == set(alert_queries())
        bad = [r for r in rules if r["health"] == "err"]
        assert not bad, bad
        return all(r["health"] == "ok" for r in rules)

    wait_until(all_rules_evaluated, timeout=DEADLINE, what="every alerting rule evaluated")
    firing = [a for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"]
    assert firing == []
    # Every dashboard query is valid PromQL against the scraped data.
    for title, expr in dashboard_queries().items():
        assert isinstance(prometheus.api("query", query=expr)["result"], list), title


SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "info": ("_info",),
    "summary": ("", "_count", "_sum"),
}


def _sample_names(text: str) -> set[str]:
    """Every series name an exposition's families can have (labelled ones may have none yet)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def _worker_series_names() -> set[str]:
    """The series only a replica with workers exports: its supervisor's workers merge
    their expositions (matchmaker.workers) and add the workers' own series."""
    from prometheus_client import CollectorRegistry, generate_latest

    from matchmaker.workers import count_restarts, merge_expositions

    registry = CollectorRegistry()
    count_restarts(registry, 0)
    return _sample_names(merge_expositions([("0", generate_latest(registry))], 2).decode())


def test_dashboard_alerts_and_docs_use_exported_metric_names(container: Container) -> None:
    _, body = http_get(container.http + "/metrics")
    worker_series = _worker_series_names()
    assert {"matchmaker_worker_up", "matchmaker_worker_restarts_total"} <= worker_series
    exported = _sample_names(body.decode()) | worker_series | {"up"}
    # The transport metrics the dashboard is built on come from the daemon itself.
    transport = {"rudp_retransmissions_total", "rudp_rtt_seconds_bucket"}
    assert transport | {"rudp_datagrams_dropped_total"} <= exported
    queries = {**dashboard_queries(), **alert_queries()}
    for where, expr in queries.items():
        used = set(re.findall(r"\b((?:matchmaker|rudp)_[a-z0-9_]+|up)\b(?=\s*[{\[)])", expr))
        assert used, f"{where}: no metric found in {expr}"
        assert used <= exported, f"{where}: unknown metrics {used - exported}"
    docs = (ROOT / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"`((?:matchmaker|rudp)_[a-z0-9_]+)", docs))
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert documented <= exported | families, documented - exported - families


# ------------------------------------------------------------------ workers


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server of the test's own: MATCHMAKER_WORKERS needs a redis:// store."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not found (apt-get install -y redis-server; .ci/run installs it)")
    port = free_port()
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    args += ["--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def pong() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"redis-server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    try:
        wait_until(pong, timeout=10, what="redis-server to answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_worker_alerts_follow_each_worker(
    deploy_tools: None,
    run_container: Callable[..., Container],
    redis_url: str,
    tmp_path: Path,
) -> None:
    """With workers, `up` is 1 while any worker answers: the worker alerts read
    matchmaker_worker_up and matchmaker_worker_restarts_total, one series per worker."""
    container = run_container(
        MATCHMAKER_ALLOW_PRIVATE="true", MATCHMAKER_STORE=redis_url, MATCHMAKER_WORKERS="2"
    )
    # 200 only once no worker is down.
    wait_until(
        lambda: http_get(container.http + "/readyz")[0] == 200,
        timeout=DEADLINE,
        what="/readyz 200 with both workers serving",
    )
    up = 'matchmaker_worker_up{job="matchmaker"}'
    restarts = 'sum(matchmaker_worker_restarts_total{job="matchmaker", worker="1"})'
    with running_prometheus(container.http_port, tmp_path) as prometheus:

        def workers_up() -> list[tuple[str, str, str]]:
            series = prometheus.query(up)
            return sorted(
                (s["metric"]["replica"], s["metric"]["worker"], s["value"][1]) for s in series
            )

        both = [("127.0.0.1", "0", "1"), ("127.0.0.1", "1", "1")]
        wait_until(lambda: workers_up() == both, timeout=DEADLINE, what=f"{up} for each worker")
        prometheus.wait_for(restarts, 0)

        # Worker 1 dies: its supervisor restarts it, and the restart is counted.
        events = [json.loads(line) for line in container.log().splitlines() if line.startswith("{")]
        pids = {e["index"]: e["pid"] for e in events if e["event"] == "worker_started"}
        os.kill(pids[1], signal.SIGKILL)
        prometheus.wait_for(restarts, 1)
        wait_until(lambda: workers_up() == both, timeout=DEADLINE, what="worker 1 up again")

        # Every rule, the workers' included, evaluates against these series; none fires.
        def all_rules_evaluated() -> bool:
            rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            assert not [r for r in rules if r["health"] == "err"]
            return all(r["health"] == "ok" for r in rules)

        wait_until(all_rules_evaluated, timeout=DEADLINE, what="every alerting rule evaluated")
        for name in ("MatchmakerWorkerDown", "MatchmakerWorkerRestarting"):
            expr = alert_queries()[name]
            assert prometheus.query(expr) == [], (name, expr)
        restarted = prometheus.query(
            'increase(matchmaker_worker_restarts_total{job="matchmaker"}[1m]) > 0'
        )
        assert [s["metric"]["worker"] for s in restarted] == ["1"], restarted

    # SIGTERM drains every worker within the compose file's stop grace period.
    shutdown = float(container.env["MATCHMAKER_SHUTDOWN_TIMEOUT"])
    assert container.stop(timeout=shutdown + KILL_MARGIN) == 0, container.log()
