"""Fixtures: a real redis-server on a free loopback port, in a temporary directory, and a
matchmaker daemon on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import REDIS_BINARY, RedisProcess, settings


@pytest.fixture
async def daemon() -> AsyncIterator[Matchmaker]:
    """A matchmaker on loopback, in the test's loop, on its in-memory store."""
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
