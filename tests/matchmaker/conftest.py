"""Fixtures: a real redis-server on a free loopback port, in a temporary directory, and a
matchmaker daemon on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from matchmaker.registry.redis import RedisRegistry
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import (
    REDIS_BINARY,
    RedisProcess,
    RegistryFactory,
    settings,
    synced_replica,
)


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


@pytest.fixture
async def replica(redis_server: RedisProcess) -> AsyncIterator[RegistryFactory]:
    """Makes RedisRegistry replicas on `redis_server`, each synced; closed at the end."""
    made: list[RedisRegistry] = []

    async def make(**kw: object) -> RedisRegistry:
        reg = await synced_replica(redis_server.url, **kw)
        made.append(reg)
        return reg

    yield make
    for reg in made:
        await reg.close()
