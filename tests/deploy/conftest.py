"""Fixtures for the deployment tests: the image's install and command, run without Docker.

There is no Docker engine in CI, so `dockerfile.py` reads the Dockerfile and
these fixtures replay it on the host: the build stage's ENV, WORKDIR, COPY and
RUN instructions run in a temporary directory (the image's absolute paths
mapped into it), which yields a fresh virtual environment with the package
installed by the Dockerfile's own pip command; the runtime stage's ENV and CMD
start the daemon from that environment, with ports overridden to free
loopback ports as ``docker run -e`` would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy.dockerfile import Dockerfile, Instruction, parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = ROOT / "deploy" / "check.sh"
STARTUP_DEADLINE = 30.0


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (good enough for loopback tests)."""
    import socket

    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port: int = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(
    check: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.1
) -> None:
    """Poll `check` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------ the "image"


@dataclass
class Image:
    """The Dockerfile replayed into `root`: a fresh venv and the runtime config."""

    dockerfile: Dockerfile
    root: Path
    path_map: dict[str, str]
    pip_commands: list[str]

    def host_path(self, text: str) -> str:
        """`text` with the image's absolute paths replaced by their places under `root`."""
        for image_path, host in sorted(self.path_map.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(image_path, host)
        return text

    @property
    def venv(self) -> Path:
        return Path(self.host_path(self.dockerfile.final_env["VIRTUAL_ENV"]))

    def env(self, **overrides: str) -> dict[str, str]:
        """The container's environment: host basics, the image's ENV, then overrides."""
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("MATCHMAKER_", "PYTHON", "VIRTUAL_ENV", "RUDP_"))
        }
        for key, value in self.dockerfile.final_env.items():
            base[key] = self.host_path(value).replace("$PATH", os.environ.get("PATH", ""))
        base.update(overrides)
        return base

    def argv(self, exec_form: list[str], env: dict[str, str]) -> list[str]:
        """An exec-form command with its program looked up on the container's PATH."""
        program = shutil.which(exec_form[0], path=env["PATH"])
        assert program is not None, f"{exec_form[0]} not on the image's PATH"
        return [program, *exec_form[1:]]


def _build(dockerfile: Dockerfile, root: Path) -> Image:
    """Run the build stage's instructions the way `docker build` would, under `root`."""
    stage = dockerfile.stages[0]
    path_map = {p: str(root / p.lstrip("/")) for p in dockerfile.absolute_paths()}
    image = Image(dockerfile, root, path_map, [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    # The image's `python` is the base image's interpreter: ours, outside any venv.
    python_dir = root / "base-python"
    python_dir.mkdir()
    (python_dir / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env["PATH"] = f"{python_dir}{os.pathsep}{env.get('PATH', '')}"
    workdir = root
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            env.update({k: image.host_path(v) for k, v in ins.env_pairs().items()})
        elif ins.keyword == "WORKDIR":
            workdir = Path(image.host_path(ins.args))
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            _copy(ins, workdir)
        elif ins.keyword == "RUN":
            command = image.host_path(ins.shell_command())
            if " pip install" in command:
                image.pip_commands.append(command)
            subprocess.run(["/bin/sh", "-c", command], cwd=workdir, env=env, check=True)
    return image


def _copy(ins: Instruction, workdir: Path) -> None:
    *sources, dest = ins.args.split()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for source in sources:
        src = ROOT / source
        target = workdir / dest if not dest.endswith("/") else workdir / dest / src.name
        if dest in ("./", "."):
            target = workdir / src.name
        if src.is_dir():
            shutil.copytree(src, target, ignore=ignore)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


@pytest.fixture(scope="session")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(ROOT / "Dockerfile")


@pytest.fixture(scope="session")
def image(dockerfile: Dockerfile, tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The image's build stage, replayed once per session (a fresh venv, ~20-60 s)."""
    return _build(dockerfile, tmp_path_factory.mktemp("image"))


# ------------------------------------------------------------------ the "container"


@dataclass
class Container:
    """The image's CMD running on loopback, like ``docker run -e ...``."""

    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    udp_port: int
    http_port: int
    log_path: Path
    stopped: bool = field(default=False)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return http_get(self.http + "/healthz", timeout=0.5)[0] == 200
        except OSError:
            return False

    def stop(self, timeout: float) -> int:
        """`docker stop`: the STOPSIGNAL, then the exit status within `timeout` (else kill)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            pytest.fail(f"no exit within {timeout} s of SIGTERM:\n{self.log()}")
        finally:
            self.stopped = True


@pytest.fixture
def run_container(image: Image, tmp_path: Path) -> Iterator[Callable[..., Container]]:
    """Factory: start the image's CMD with extra environment; stopped at teardown."""
    started: list[Container] = []

    def start(**env_overrides: str) -> Container:
        udp_port, http_port = free_port(), free_port()
        env = image.env(
            MATCHMAKER_BIND="127.0.0.1",
            MATCHMAKER_PORT=str(udp_port),
            MATCHMAKER_HTTP_BIND="127.0.0.1",
            MATCHMAKER_HTTP_PORT=str(http_port),
            **env_overrides,
        )
        workdir = tmp_path / f"container-{len(started)}"
        workdir.mkdir()
        log_path = workdir / "output.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                image.argv(image.dockerfile.cmd, env),
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        container = Container(proc, env, udp_port, http_port, log_path)
        started.append(container)
        wait_until(container.healthy, timeout=STARTUP_DEADLINE, what="/healthz to answer 200")
        return container

    yield start
    for container in started:
        if container.proc.poll() is None:
            container.proc.kill()
            container.proc.wait(5)


# ------------------------------------------------------------------ tools


@pytest.fixture(scope="session")
def deploy_tools() -> None:
    """promtool, docker-compose, hadolint, kubernetes-validate and PyYAML: check.sh
    installs whichever is missing (a no-op when all are there)."""
    subprocess.run(
        ["bash", str(CHECK_SCRIPT), "--install-only"],
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
        timeout=600,
    )
