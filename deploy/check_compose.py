"""Consistency checks of the compose file, Prometheus and Grafana configs.

Run by deploy/check.sh (``docker compose config`` needs a Docker engine; this
needs only PyYAML). Prints every problem and exits 1 if there is any.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped, unused-ignore]

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
REQUIRED_SERVICES = ("redis", "prometheus", "grafana")
# Published on loopback only: Prometheus's API and Grafana (admin/admin by default)
# are not for every address that reaches the host (docs/operations.md).
LOOPBACK_ONLY = ("prometheus", "grafana")
PORT_RE = re.compile(r"^(?:(?:\d{1,3}\.){3}\d{1,3}:)?(\d+):(\d+)(?:/(tcp|udp))?$")


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def dockerfile_exposed(path: Path) -> set[str]:
    exposed: set[str] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("EXPOSE "):
            exposed.update(p if "/" in p else f"{p}/tcp" for p in line.split()[1:])
    return exposed


def check_compose(problems: list[str]) -> list[str]:
    """Problems are appended; returns the matchmaker services' names."""
    compose = load_yaml(DEPLOY / "docker-compose.yml")
    if not isinstance(compose, dict) or not isinstance(compose.get("services"), dict):
        problems.append("docker-compose.yml: no services mapping")
        return []
    services: dict[str, Any] = compose["services"]
    volumes = set((compose.get("volumes") or {}).keys())
    networks = set((compose.get("networks") or {}).keys())
    problems += [f"service {name!r} missing" for name in REQUIRED_SERVICES if name not in services]
    host_ports: dict[str, str] = {}
    matchmakers: list[str] = []
    replica_ids: set[str] = set()
    for name, svc in services.items():
        where = f"services.{name}"
        if not isinstance(svc, dict):
            problems.append(f"{where}: not a mapping")
            continue
        if "image" not in svc and "build" not in svc:
            problems.append(f"{where}: needs image or build")
        build = svc.get("build")
        if isinstance(build, dict):
            context = (DEPLOY / build.get("context", ".")).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not dockerfile.is_file():
                problems.append(f"{where}.build: {dockerfile} does not exist")
            elif dockerfile.resolve() == (ROOT / "Dockerfile").resolve():
                matchmakers.append(name)
        for dep in svc.get("depends_on") or []:
            if dep not in services:
                problems.append(f"{where}.depends_on: unknown service {dep!r}")
        for net in svc.get("networks") or []:
            if net not in networks:
                problems.append(f"{where}.networks: {net!r} not declared")
        for port in svc.get("ports") or []:
            m = PORT_RE.match(str(port))
            if not m:
                problems.append(f"{where}.ports: cannot parse {port!r}")
                continue
            if name in LOOPBACK_ONLY and not str(port).startswith("127.0.0.1:"):
                problems.append(f"{where}.ports: {port!r} is not bound to 127.0.0.1")
            key = f"{m.group(1)}/{m.group(3) or 'tcp'}"
            if key in host_ports:
                problems.append(f"{where}.ports: host port {key} also used by {host_ports[key]}")
            host_ports[key] = name
        for volume in svc.get("volumes") or []:
            source = str(volume).split(":", 1)[0]
            if source.startswith((".", "/")):
                if not (DEPLOY / source).exists():
                    problems.append(f"{where}.volumes: {source} does not exist")
            elif source not in volumes:
                problems.append(f"{where}.volumes: named volume {source!r} not declared")
        if name in matchmakers:
            check_matchmaker(where, svc, services, replica_ids, problems)
        if name == "prometheus" and "--web.enable-lifecycle" in (svc.get("command") or []):
            problems.append(f"{where}.command: --web.enable-lifecycle lets anyone POST /-/quit")
    if len(matchmakers) < 2:
        problems.append(f"expected at least 2 matchmaker replicas, found {matchmakers}")
    return matchmakers


def check_matchmaker(
    where: str,
    svc: dict[str, Any],
    services: dict[str, Any],
    replica_ids: set[str],
    problems: list[str],
) -> None:
    env = svc.get("environment") or {}
    if not isinstance(env, dict):
        problems.append(f"{where}.environment: use a mapping")
        return
    store = str(env.get("MATCHMAKER_STORE", ""))
    m = re.match(r"redis://([^:/]+)", store)
    if not m or m.group(1) not in services:
        problems.append(f"{where}: MATCHMAKER_STORE {store!r} is not a redis:// compose service")
    replica = str(env.get("MATCHMAKER_REPLICA_ID", ""))
    if not replica or replica in replica_ids:
        problems.append(f"{where}: MATCHMAKER_REPLICA_ID must be set and unique")
    replica_ids.add(replica)
    exposed = dockerfile_exposed(ROOT / "Dockerfile")
    for port in svc.get("ports") or []:
        m2 = PORT_RE.match(str(port))
        if m2 and f"{m2.group(2)}/{m2.group(3) or 'tcp'}" not in exposed:
            problems.append(f"{where}.ports: {port} is not a port the image EXPOSEs {exposed}")


def check_prometheus(matchmakers: list[str], problems: list[str]) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config.get("scrape_configs", [])}
    job = jobs.get("matchmaker")
    if job is None:
        problems.append("prometheus.yml: no 'matchmaker' scrape job")
        return
    targets = {t for sc in job.get("static_configs", []) for t in sc.get("targets", [])}
    wanted = {f"{name}:27951" for name in matchmakers}
    if targets != wanted:
        problems.append(f"prometheus.yml: matchmaker targets {sorted(targets)} != {sorted(wanted)}")


def check_grafana(problems: list[str]) -> None:
    datasources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    uids = {ds.get("uid") for ds in datasources.get("datasources", [])}
    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "matchmaker.yml")
    if not providers.get("providers"):
        problems.append("grafana dashboards provisioning: no providers")
    for path in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        try:
            dash = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            problems.append(f"{path.name}: {exc}")
            continue
        ds_var = [v for v in dash["templating"]["list"] if v.get("type") == "datasource"]
        if not ds_var or ds_var[0].get("current", {}).get("value") not in uids:
            problems.append(f"{path.name}: datasource variable does not default to {uids}")
        exprs = dashboard_exprs(dash)
        if not exprs:
            problems.append(f"{path.name}: no PromQL queries")


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard's panels (rows included)."""
    out: list[str] = []
    for panel in dash.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in inner.get("targets", []) if t.get("expr")]
    return out


def check_kustomization(problems: list[str]) -> None:
    kustomization = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    for resource in kustomization.get("resources", []):
        if not (DEPLOY / "k8s" / resource).is_file():
            problems.append(f"k8s/kustomization.yaml: {resource} does not exist")


def main() -> int:
    problems: list[str] = []
    matchmakers = check_compose(problems)
    check_prometheus(matchmakers, problems)
    check_grafana(problems)
    check_kustomization(problems)
    for problem in problems:
        print(f"check_compose: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_compose: ok (matchmaker replicas: {', '.join(matchmakers)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
