"""Fixtures: a real redis-server on a free loopback port, in a temporary directory, and a
matchmaker daemon on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from matchmaker.server import Matchmaker

REDIS_BINARY = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisProcess:
    """One redis-server we start, kill and restart (same port, same data dir).

    Appendonly with fsync on every write, so a SIGKILL loses nothing: a
    restart comes back with the hosts' old `seen` scores, which is the case
    the no-mass-expiry logic exists for.
    """

    def __init__(self, directory: Path) -> None:
        assert REDIS_BINARY is not None
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_BINARY is not None
        args = [REDIS_BINARY, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "always", "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._ping():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


@pytest.fixture
async def daemon() -> AsyncIterator[Matchmaker]:
    """A matchmaker on loopback, in the test's loop, on its in-memory store."""
    from tests.matchmaker.test_e2e import settings  # that module imports this one

    mm = Matchmaker(settings())
    await mm.start()
    yield mm
    await mm.shutdown()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    if REDIS_BINARY is None:
        pytest.skip("redis-server binary not found (apt-get install -y redis-server)")
    server = RedisProcess(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()
