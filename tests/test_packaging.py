"""The plain install: a pure wheel, installed without extras into a fresh venv, carries the
transport and nothing of the daemon's (structlog, redis, prometheus-client), and works.

Builds from a copy of what the sdist and the image hold, so the source tree gets no build/
or egg-info of this test's. Needs pip to reach an index for setuptools and for msgpack and
mypy-extensions: skipped, with pip's reason, when it cannot.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import matchmaker
import rudp

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "MANIFEST.in", "build_backend", "rudp"]
SOURCES += ["matchmaker"]
DAEMON_ONLY = ["structlog", "redis", "prometheus_client", "uvloop"]
# pip's words when it could not reach an index (or the index lacks a package).
OFFLINE = re.compile(
    r"No matching distribution|Could not find a version|NewConnectionError|"
    r"Failed to establish a new connection|Temporary failure in name resolution|"
    r"Network is unreachable|ConnectTimeoutError|ReadTimeoutError|ProxyError"
)

ECHO = textwrap.dedent(
    """
    import asyncio
    import importlib.util
    import sys

    import rudp


    async def handler(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)


    async def main() -> None:
        async with await rudp.serve(handler, "127.0.0.1", 0) as server:
            conn = await rudp.connect(*server.address)
            for i in range(20):
                await conn.send(b"ping %d" % i)
                assert (await conn.recv()).data == b"ping %d" % i
            await conn.close()
        # Imported on first use, and fails naming the extra that brings what it needs.
        assert rudp.lan.__name__ == "rudp.lan" and rudp.lockstep and rudp.netsim
        try:
            rudp.metrics
        except ModuleNotFoundError as exc:
            assert "aiorudp[metrics]" in str(exc), exc
        else:
            raise AssertionError("rudp.metrics imported without prometheus-client")
        absent = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]
        assert not absent, f"installed without an extra: {absent}"
        print("echo ok", rudp.__version__)


    asyncio.run(main())
    """
)


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.pop("RUDP_COMPILE", None)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _pip(python: Path, args: list[str], cwd: Path) -> None:
    out = _run([str(python), "-m", "pip", *args], cwd)
    if out.returncode != 0:
        if OFFLINE.search(out.stdout + out.stderr):
            pytest.skip(f"pip could not reach an index: {out.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")


def test_one_version_everywhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project["dynamic"] and "version" not in project
    assert rudp.__version__ == matchmaker.__version__
    assert importlib.metadata.version("aiorudp") == rudp.__version__


@pytest.mark.timeout(180)
def test_plain_install_is_the_transport_alone_and_echoes(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", "*.egg-info")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    dist = tmp_path / "dist"
    _pip(Path(sys.executable), ["wheel", "--quiet", "--no-deps", "-w", str(dist), "."], source)
    (wheel,) = dist.glob("aiorudp-*.whl")
    assert wheel.name.startswith(f"aiorudp-{rudp.__version__}-py3-none-any"), wheel.name

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The outer pip installs into the venv (--python): no pip of its own to set up.
    _pip(
        Path(sys.executable), ["--python", str(python), "install", "--quiet", str(wheel)], tmp_path
    )

    script = tmp_path / "echo.py"
    script.write_text(ECHO)
    out = _run([str(python), "-P", str(script), *DAEMON_ONLY], tmp_path, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["echo", "ok", rudp.__version__]
