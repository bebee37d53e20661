"""deploy/podman/: the stand-ins cover what the Dockerfile and the compose file name, and
the probes that ci.sh runs against the containers pass and fail as they should.

The containers themselves run only in ci.sh (root, podman); these tests need neither.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import threading
import tomllib
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from matchmaker.server import Matchmaker
from matchmaker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PODMAN = ROOT / "deploy" / "podman"
CI_SCRIPT = PODMAN / "ci.sh"


def _load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("podman_probe", PODMAN / "probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _load_probe()


def _compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    compose: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    return compose


# ------------------------------------------------------------------ static


def test_script_parses() -> None:
    subprocess.run(["bash", "-n", str(CI_SCRIPT)], check=True)


def test_every_compose_service_but_grafana_is_started() -> None:
    m = re.search(r"^SERVICES=\(([^)]*)\)$", CI_SCRIPT.read_text(), re.M)
    assert m, "SERVICES=(...) in ci.sh"
    started = set(m.group(1).split())
    # Grafana has no Debian package to build a stand-in from.
    assert started == set(_compose()["services"]) - {"grafana"}


def test_every_pulled_image_has_a_stand_in() -> None:
    script = CI_SCRIPT.read_text()
    for name, service in _compose()["services"].items():
        if name == "grafana" or "build" in service:
            continue
        # ci.sh reads the image's name from the compose file and builds the stand-in.
        assert (PODMAN / "standins" / f"{name}.Containerfile").is_file(), name
        assert f"compose_image {name})" in script, name


def test_dockerfile_bases_are_the_stand_ins_names() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (PYTHON_IMAGE|BUILD_IMAGE)=(\S+)$", dockerfile, re.M))
    assert "PYTHON_IMAGE" in args
    bases = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert set(bases) <= {"${PYTHON_IMAGE}", "${BUILD_IMAGE}"}, bases
    # Each stand-in is built on the imported slim base, whatever its name.
    for path in (PODMAN / "standins").glob("*.Containerfile"):
        text = path.read_text()
        assert "ARG BASE=" + args["PYTHON_IMAGE"] in text and "FROM ${BASE}" in text, path.name


def test_containers_conf() -> None:
    conf = tomllib.loads((PODMAN / "containers.conf").read_text())
    assert conf["engine"]["runtime"] == "runc"
    ulimits = dict(u.split("=") for u in conf["containers"]["default_ulimits"])
    assert set(ulimits) == {"nofile", "nproc"}


# ------------------------------------------------------------------ probes


@pytest.fixture
async def daemon() -> AsyncIterator[Matchmaker]:
    mm = Matchmaker(
        Settings(
            bind="127.0.0.1",
            port=0,
            http_bind="127.0.0.1",
            http_port=0,
            allow_private=True,
            shutdown_timeout=3.0,
        )
    )
    await mm.start()
    yield mm
    await mm.shutdown()


def _at(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


async def test_http_and_register_list_pass_against_a_daemon(
    daemon: Matchmaker, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://{_at(daemon.http_address)}"
    await asyncio.to_thread(probe.http, url + "/readyz", 10.0)
    udp = _at(daemon.udp_address)
    await probe.register_list(udp, udp, 10.0)
    out = capsys.readouterr().out
    assert "/readyz: 200" in out
    assert re.search(r"listed by 127\.0\.0\.1:\d+: 'podman-ci-\d+'", out), out


async def test_register_list_fails_naming_the_step(daemon: Matchmaker) -> None:
    nobody = _at(daemon.udp_address).rsplit(":", 1)[0] + ":9"  # discard: no matchmaker
    with pytest.raises(probe.CheckFailed, match=r"registering at 127\.0\.0\.1:9: not within"):
        await probe.register_list(nobody, nobody, 1.0)


async def test_a_refused_registration_fails_at_once() -> None:
    strict = Matchmaker(Settings(bind="127.0.0.1", port=0, http_bind="127.0.0.1", http_port=0))
    await strict.start()
    try:
        udp = _at(strict.udp_address)
        with pytest.raises(probe.CheckFailed, match="refused: forbidden_address"):
            await asyncio.wait_for(probe.register_list(udp, udp, 30.0), 10)
    finally:
        await strict.shutdown()


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[str]]]:
    """A stand-in for Prometheus's query API answering `up` with the values in the list."""
    values: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            assert self.path.startswith("/api/v1/query?")
            result = [
                {
                    "metric": {"instance": f"matchmaker-{i}:27951", "replica": f"matchmaker-{i}"},
                    "value": [0, v],
                }
                for i, v in enumerate(values, 1)
            ]
            body = json.dumps({"status": "success", "data": {"result": result}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", values
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_up(prometheus: tuple[str, list[str]]) -> None:
    url, values = prometheus
    values[:] = ["1", "1"]
    probe.prometheus_up(url, "matchmaker", 2, 5.0)
    values[:] = ["1", "0"]
    with pytest.raises(probe.CheckFailed, match="2 targets of job 'matchmaker' not up"):
        probe.prometheus_up(url, "matchmaker", 2, 1.0)
    values[:] = ["1"]
    with pytest.raises(probe.CheckFailed):
        probe.prometheus_up(url, "matchmaker", 2, 1.0)
