"""Failover in the client library and a stopping replica's refusals, over the
in-memory transport; the first `register` against a daemon that is not up yet."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import rudp
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient, MatchmakerUnreachable
from matchmaker.server import Matchmaker
from tests.matchmaker.fakes import FakeConnection, pipe
from tests.matchmaker.helpers import HOST, Harness, eventually, free_udp_port, pub, settings


class Replicas:
    """Two services ("replicas" over one registry), each reachable by its own connector."""

    def __init__(self, **overrides: Any) -> None:
        self.a = Harness(**overrides)
        self.b = Harness(registry=self.a.registry, **overrides)
        self.links: dict[str, list[FakeConnection]] = {"a": [], "b": []}
        self.deaf: set[str] = set()
        """Replicas that stopped acknowledging (a dead process behind a live route)."""

    def connector(self, name: str, ip: str) -> Any:
        harness = self.a if name == "a" else self.b

        async def connect() -> FakeConnection:
            if name in self.deaf:
                raise ConnectionRefusedError(f"replica {name} is down")
            server_side, client_side = pipe((ip, 27960))
            asyncio.create_task(harness.service.handle(server_side))  # noqa: RUF006
            self.links[name].append(client_side)
            return client_side

        return connect

    def client(self, ip: str, **kw: Any) -> MatchmakerClient:
        kw.setdefault("reconnect_delay", 0.01)
        client = MatchmakerClient([self.connector("a", ip), self.connector("b", ip)], **kw)
        client._start = 0  # the first attempt goes to "a"
        return client

    def kill(self, name: str) -> None:
        """The replica's process dies: its connections go silent (no acks, no close)."""
        self.deaf.add(name)
        for link in self.links[name]:
            link.manual_acks = True
            assert link.other is not None
            link.other.closed = True  # the server end reads nothing more


async def test_a_dead_replica_is_left_for_the_other_one() -> None:
    replicas = Replicas(keepalive=0.05)
    async with replicas.client(pub(1), timeout=0.3) as host:
        await host.register(**HOST)
        assert host.route == "replica 1" and host.registrations == 1
        replicas.kill("a")
        await eventually(lambda: host.registrations == 2, timeout=5)
        assert host.route == "replica 2"
        record = replicas.b.registry.get(Address(pub(1), 27960))
        assert record is not None and record.info.name == HOST["name"]


async def test_shutting_down_sends_the_registration_to_the_other_replica() -> None:
    replicas = Replicas()
    replicas.a.service.stop_accepting()
    async with replicas.client(pub(1)) as host:
        await host.register(**HOST)
        assert host.route == "replica 2"
        assert replicas.b.registry.get(Address(pub(1), 27960)) is not None


async def test_a_replica_that_closes_sends_its_hosts_to_the_other() -> None:
    replicas = Replicas(keepalive=0.05)
    async with replicas.client(pub(1)) as host:
        await host.register(**HOST)
        replicas.a.service.stop_accepting()
        await replicas.a.service.close_all()
        await eventually(lambda: host.registrations == 2, timeout=5)
        assert host.route == "replica 2"


async def test_first_register_waits_for_a_matchmaker_that_comes_up_later() -> None:
    port = free_udp_port()
    game = await rudp.open_endpoint("127.0.0.1")
    client = MatchmakerClient.to("127.0.0.1", port, via=game, timeout=0.5, reconnect_delay=0.1)
    async with game, client:
        registering = asyncio.create_task(client.register(**HOST))
        await asyncio.sleep(1.5)
        assert not registering.done(), registering
        daemon = Matchmaker(settings(port=port))
        await daemon.start()
        try:
            address = await asyncio.wait_for(registering, 10)
            assert daemon.registry.get(address) is not None
            assert client.registrations == 1
        finally:
            await client.close()
            await daemon.shutdown()


async def test_first_register_gives_up_naming_every_address_tried() -> None:
    ports = [free_udp_port(), free_udp_port()]
    replicas = [("127.0.0.1", p) for p in ports]
    game = await rudp.open_endpoint("127.0.0.1")
    client = MatchmakerClient.to(replicas, via=game, timeout=0.2, register_timeout=1.0)
    async with game, client:
        started = asyncio.get_running_loop().time()
        with pytest.raises(MatchmakerUnreachable) as gave_up:
            await client.register(**HOST)
        # register_timeout (1 s), with room for a loaded machine: not for ever.
        assert asyncio.get_running_loop().time() - started < 10
    message = str(gave_up.value)
    assert all(f"127.0.0.1:{p}" in message for p in ports), message
    assert isinstance(gave_up.value, ConnectionError) and isinstance(gave_up.value, TimeoutError)


async def test_one_address_and_bare_connectors_still_work(daemon: Matchmaker) -> None:
    async with MatchmakerClient.to(*daemon.udp_address) as client:
        assert (await client.info()).hosts == 0
        assert client.route == f"127.0.0.1:{daemon.udp_address[1]}"
    with pytest.raises(TypeError):
        MatchmakerClient.to("127.0.0.1")


async def test_one_stopping_address_is_retried_with_backoff_not_in_a_loop() -> None:
    h = Harness()
    h.service.stop_accepting()
    opened: list[FakeConnection] = []

    async def connect() -> FakeConnection:
        server_side, client_side = pipe((pub(1), 27960))
        asyncio.create_task(h.service.handle(server_side))  # noqa: RUF006
        opened.append(client_side)
        return client_side

    client = MatchmakerClient(connect, reconnect_delay=0.1, register_timeout=1.0)
    async with client:
        with pytest.raises(MatchmakerUnreachable) as gave_up:
            await client.register(**HOST)
    assert "tried replica 1 (Connection" in str(gave_up.value)
    assert 2 <= len(opened) <= 8  # 0.1 + 0.2 + 0.4 s of backoff, not a busy loop
