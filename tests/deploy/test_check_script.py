"""deploy/check.sh: hadolint, promtool (config, rules, rule unit tests), k8s schemas, compose."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.conftest import CHECK_SCRIPT, ROOT


def run_check(
    *args: str, cwd: Path = ROOT, script: Path = CHECK_SCRIPT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=cwd,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_check_script_passes(deploy_tools: None, tmp_path: Path) -> None:
    # Run from elsewhere: the script finds the repository by its own path.
    result = run_check(cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in ("hadolint", "promtool check config", "promtool test rules", "kubernetes-validate"):
        assert f"==> {step}" in result.stdout, result.stdout
    assert "all deployment checks passed" in result.stdout


def test_check_script_is_strict_shell() -> None:
    text = CHECK_SCRIPT.read_text()
    assert "set -euo pipefail" in text


def _copy_of_repo_files(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "deploy", root / "deploy")
    shutil.copy2(ROOT / "Dockerfile", root / "Dockerfile")
    return root


def test_check_script_fails_on_a_broken_file(deploy_tools: None, tmp_path: Path) -> None:
    root = _copy_of_repo_files(tmp_path)
    alerts = root / "deploy" / "prometheus" / "alerts.yml"
    alerts.write_text(alerts.read_text().replace("expr: up{", "expr: up{{", 1))
    deployment = root / "deploy" / "k8s" / "matchmaker.yaml"
    deployment.write_text(deployment.read_text().replace("replicas: 2", "replicaz: 2", 1))
    result = run_check(script=root / "deploy" / "check.sh")
    assert result.returncode != 0
    assert "FAILED: promtool check rules" in result.stderr
    assert "FAILED: kubernetes-validate (strict)" in result.stderr
    # Config and rule tests load the broken rules too; the other checks still ran and passed.
    assert "4 check(s) failed" in result.stderr
    assert "FAILED: hadolint" not in result.stderr
    assert "check_compose: ok" in result.stdout


def test_monitoring_published_on_loopback_only(tmp_path: Path) -> None:
    """Prometheus (its admin API) and Grafana (admin/admin unless set) must not be
    published on every address by the shipped compose file."""
    pytest.importorskip("yaml")
    root = _copy_of_repo_files(tmp_path)
    compose = root / "deploy" / "docker-compose.yml"
    text = compose.read_text()
    for published in ('"127.0.0.1:9090:9090"', '"127.0.0.1:3000:3000"'):
        assert published in text, published
    text = text.replace('"127.0.0.1:3000:3000"', '"3000:3000"')
    text = text.replace("--storage.tsdb.retention.time=15d", "--web.enable-lifecycle", 1)
    compose.write_text(text)
    result = subprocess.run(
        [sys.executable, str(root / "deploy" / "check_compose.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "services.grafana.ports: '3000:3000' is not bound to 127.0.0.1" in result.stderr
    assert "--web.enable-lifecycle" in result.stderr
    assert "prometheus.ports" not in result.stderr


@pytest.mark.parametrize("ci", ["true", None, "false"])
def test_ci_run_fails_without_redis_and_prometheus_only_in_ci(
    ci: str | None, tmp_path: Path
) -> None:
    """.ci/run refuses to go on in CI when the tests that need redis-server or
    prometheus would be skipped; a local run goes on (here, to `make`, which is absent
    too, as is apt-get: nothing is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    if ci is not None:
        env["CI"] = ci
    result = subprocess.run(
        [str(bin_dir / "bash"), str(ROOT / ".ci" / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if ci == "true":
        assert result.returncode == 1, result.stderr
        assert "CI is set but redis-server prometheus is missing" in result.stderr
    else:
        assert "CI is set" not in result.stderr
        assert result.returncode == 127 and "make" in result.stderr, result.stderr
