"""A real Prometheus, configured from deploy/prometheus/, scraping the image's daemon.

The derived config keeps the repository's jobs, relabelling and alerting
rules; only the targets (the live daemon and Prometheus itself on loopback)
and the intervals (1 s) change. The dashboard's and the alerts' queries then
run against what was scraped.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from matchmaker.client import MatchmakerClient
from tests.deploy.conftest import ROOT, Container, free_port, http_get, wait_until

PROMETHEUS = shutil.which("prometheus")
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


@pytest.fixture
def prometheus(deploy_tools: None, container: Container, tmp_path: Path) -> Iterator[Prometheus]:
    assert PROMETHEUS is not None
    address = f"127.0.0.1:{free_port()}"
    config = derived_config(tmp_path, f"127.0.0.1:{container.http_port}", address)
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
        # rudp's transport metrics are scraped too: one connection per host.
        prometheus.wait_for('sum(rudp_connections{job="matchmaker"})', 3)
        prometheus.wait_for('sum(rudp_connections_accepted_total{job="matchmaker"})', 3)
        # The repository's metric relabelling is in force: no *_created series.
        assert prometheus.query('count({job="matchmaker", __name__=~".+_created"})') == []

    wait_until(
        lambda: prometheus.value('up{job="matchmaker"}') == 1.0,
        timeout=DEADLINE,
        what="up == 1",
        interval=0.25,
    )
    await asyncio.to_thread(check)

    # One host leaves: Prometheus sees 2 at its next scrape.
    await three_hosts[0].close()
    await asyncio.to_thread(prometheus.wait_for, hosts_listed, 2)
    await asyncio.to_thread(prometheus.wait_for, 'sum(rudp_connections{job="matchmaker"})', 2)


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


def test_dashboard_alerts_and_docs_use_exported_metric_names(container: Container) -> None:
    _, body = http_get(container.http + "/metrics")
    exported = _sample_names(body.decode()) | {"up"}
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
