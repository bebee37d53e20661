"""The container image: its Dockerfile's promises, and its command run as the image runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from matchmaker.client import MatchmakerClient
from matchmaker.settings import Settings
from matchmaker.workers import KILL_MARGIN
from tests.deploy.conftest import ROOT, Container, Image, http_get
from tests.deploy.dockerfile import Dockerfile

# `docker stop`'s default grace period before SIGKILL.
DOCKER_STOP_TIMEOUT = 10.0


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert m, text
    return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m.group(2)]


# ------------------------------------------------------------------ static


def test_multi_stage_slim_python_311(dockerfile: Dockerfile) -> None:
    assert len(dockerfile.stages) >= 2
    build_args = Path(__file__).resolve().parents[2].joinpath("Dockerfile").read_text()
    m = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", build_args, re.M)
    assert m and re.fullmatch(r"python:3\.11-slim(-\w+)?", m.group(1)), "base: python:3.11-slim"
    assert dockerfile.final.base in ("${PYTHON_IMAGE}", m.group(1)), "the runtime stage is slim"
    # The build stage may use the full image of the same Python and Debian release
    # (for its C compiler): the venv it builds must run unchanged in the slim one.
    b = re.search(r"^ARG BUILD_IMAGE=(\S+)$", build_args, re.M)
    slim_release = m.group(1).removeprefix("python:3.11-slim")
    if b:
        assert b.group(1) == "python:3.11" + slim_release, "same Python and Debian release"
    bases = {"${PYTHON_IMAGE}", m.group(1)} | ({"${BUILD_IMAGE}", b.group(1)} if b else set())
    assert all(stage.base in bases for stage in dockerfile.stages)
    copy_from = [i.flags().get("from") for i in dockerfile.final.all("COPY")]
    assert dockerfile.stages[0].name in copy_from, "the runtime stage copies the built venv"


def test_dockerignore_lets_the_copied_files_in(dockerfile: Dockerfile) -> None:
    root = Path(__file__).resolve().parents[2]
    lines = [ln.strip() for ln in (root / ".dockerignore").read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert patterns[0] == "**", "allow-list: everything else stays out of the build context"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for ins in dockerfile.stages[0].all("COPY"):
        for source in ins.args.split()[:-1]:
            assert source in included, f"{source} is copied but excluded by .dockerignore"
            assert (root / source).exists(), source


def test_runs_as_non_root(dockerfile: Dockerfile) -> None:
    user = dockerfile.final.last("USER").args.split(":")[0]
    assert user not in ("root", "0"), user


def test_exposes_the_default_ports(dockerfile: Dockerfile) -> None:
    exposed = set(dockerfile.final.last("EXPOSE").args.split())
    defaults = Settings()
    assert exposed == {f"{defaults.port}/udp", f"{defaults.http_port}/tcp"}
    env = dockerfile.final_env
    assert env["MATCHMAKER_PORT"] == str(defaults.port)
    assert env["MATCHMAKER_HTTP_PORT"] == str(defaults.http_port)


def test_every_env_setting_is_a_real_setting(dockerfile: Dockerfile) -> None:
    known = {"MATCHMAKER_" + f.name.upper() for f in dataclasses.fields(Settings)}
    configured = {k for k in dockerfile.final_env if k.startswith("MATCHMAKER_")}
    assert configured <= known, configured - known
    # And together they are valid settings.
    Settings.from_sources({}, dockerfile.final_env)


def test_graceful_stop_fits_in_docker_stop_timeout(dockerfile: Dockerfile) -> None:
    assert dockerfile.final.last("STOPSIGNAL").args == "SIGTERM"
    cmd = dockerfile.final.last("CMD")
    assert cmd.args.startswith("["), "exec form: the daemon is PID 1 and gets the signal"
    assert not dockerfile.final.all("ENTRYPOINT"), "no shell wrapper in front of the daemon"
    shutdown = float(dockerfile.final_env["MATCHMAKER_SHUTDOWN_TIMEOUT"])
    assert shutdown < DOCKER_STOP_TIMEOUT


def _deploy_yaml(*parts: str) -> list[Any]:
    yaml = pytest.importorskip("yaml")
    return list(yaml.safe_load_all(ROOT.joinpath("deploy", *parts).read_text()))


def _k8s_deployment() -> dict[str, Any]:
    docs = _deploy_yaml("k8s", "matchmaker.yaml")
    deployment: dict[str, Any] = next(d for d in docs if d["kind"] == "Deployment")
    return deployment


def test_stop_grace_periods_cover_a_workers_supervisor(dockerfile: Dockerfile) -> None:
    """With workers the supervisor may wait the shutdown timeout + KILL_MARGIN for a
    draining worker before it kills it: the orchestrator's SIGKILL must come later."""
    (compose,) = _deploy_yaml("docker-compose.yml")
    shutdown = float(dockerfile.final_env["MATCHMAKER_SHUTDOWN_TIMEOUT"])
    for name, service in compose["services"].items():
        if "build" in service:  # the matchmaker replicas
            assert "MATCHMAKER_SHUTDOWN_TIMEOUT" not in service["environment"], name
            grace = _duration(service["stop_grace_period"])
            assert grace > shutdown + KILL_MARGIN, (name, grace, shutdown)
    (configmap,) = _deploy_yaml("k8s", "configmap.yaml")
    k8s_shutdown = float(configmap["data"]["MATCHMAKER_SHUTDOWN_TIMEOUT"])
    grace = _k8s_deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > k8s_shutdown + KILL_MARGIN, (grace, k8s_shutdown)


def test_read_only_root_with_an_in_memory_tmp() -> None:
    """A workers' supervisor keeps its sockets in a directory under /tmp: the
    deployments give it an in-memory /tmp and keep the root read-only."""
    (compose,) = _deploy_yaml("docker-compose.yml")
    replicas = {n: s for n, s in compose["services"].items() if "build" in s}
    assert replicas
    for name, service in replicas.items():
        assert service["read_only"] is True, name
        tmpfs = [str(t) for t in service.get("tmpfs", [])]
        tmp = [t for t in tmpfs if t.split(":")[0] == "/tmp"]
        assert tmp and "size=" in tmp[0], (name, tmpfs)
    pod = _k8s_deployment()["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "matchmaker"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert "/tmp" in mounts, mounts
    (volume,) = [v for v in pod.get("volumes", []) if v["name"] == mounts["/tmp"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]


def test_healthcheck_is_exec_form_python(dockerfile: Dockerfile) -> None:
    check = dockerfile.final.last("HEALTHCHECK")
    argv = check.exec_form()
    assert argv[:2] == ["python", "-c"] and "/healthz" in argv[2]
    flags = check.flags()
    assert _duration(flags["timeout"]) < _duration(flags["interval"])


# ------------------------------------------------------------------ installed


def test_install_is_regular_compiled_and_has_uvloop(image: Image) -> None:
    assert image.pip_commands, "the build stage installs with pip"
    assert all("-e " not in c and "--editable" not in c for c in image.pip_commands)
    assert all("--no-deps" not in c for c in image.pip_commands)
    python = str(image.venv / "bin" / "python")
    code = "import matchmaker, rudp, uvloop; print(matchmaker.__file__); print(rudp.__file__)"
    code += "; print(rudp.compiled)"
    out = subprocess.run(
        [python, "-c", code], env=image.env(), cwd=image.root, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    *files, compiled = out.stdout.split()
    assert compiled == "True", "the image runs the mypyc-compiled build"
    for line in files:
        assert Path(line).is_relative_to(image.venv), f"imported from outside the venv: {line}"


# ------------------------------------------------------------------ running


async def _info(container: Container) -> int:
    async with MatchmakerClient.to("127.0.0.1", container.udp_port, timeout=5.0) as client:
        reply = await asyncio.wait_for(client.info(), 10)
    return reply.hosts


def test_container_serves_and_stops_cleanly_on_sigterm(
    dockerfile: Dockerfile, image: Image, run_container: Callable[..., Container]
) -> None:
    container = run_container()

    # UDP: a rudp connection and an info request.
    assert asyncio.run(_info(container)) == 0
    # HTTP.
    status, body = http_get(container.http + "/healthz")
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    assert http_get(container.http + "/readyz")[0] == 200
    # The image's HEALTHCHECK command, run in the container's environment.
    check = dockerfile.final.last("HEALTHCHECK")
    timeout = _duration(check.flags()["timeout"])
    argv = image.argv(check.exec_form(), container.env)
    probe = subprocess.run(argv, env=container.env, capture_output=True, timeout=timeout + 5)
    assert probe.returncode == 0, probe.stderr

    status = container.stop(timeout=DOCKER_STOP_TIMEOUT)
    assert status == 0, container.log()
    events = [json.loads(line)["event"] for line in container.log().splitlines() if line]
    assert events[0] == "matchmaker_started" and events[-1] == "matchmaker_stopped", events

    # Once the daemon is gone the healthcheck fails, as Docker must see it.
    probe = subprocess.run(argv, env=container.env, capture_output=True, timeout=timeout + 5)
    assert probe.returncode != 0


def test_invalid_environment_fails_fast(image: Image, tmp_path: Path) -> None:
    env = image.env(MATCHMAKER_PORT="not-a-port")
    out = subprocess.run(
        image.argv(image.dockerfile.cmd, env),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "MATCHMAKER_PORT" in out.stderr


def test_sigint_also_stops_cleanly(run_container: Callable[..., Container]) -> None:
    container = run_container()
    container.proc.send_signal(signal.SIGINT)
    assert container.proc.wait(DOCKER_STOP_TIMEOUT) == 0, container.log()
