"""Heartbeat takeover: a host's MOVING heartbeat sent to another replica of a shared
registry moves the host there in one datagram, and nothing else does (a real
redis-server, two services on the fake transport)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import redis.asyncio as aioredis

from matchmaker import heartbeat as hb
from matchmaker.addresses import Address
from matchmaker.messages import Introduce, Introduction, Register, Registered, Role, decode
from matchmaker.registry import Notice, RemovalReason, Takeover, TakeoverResult
from matchmaker.registry.redis import RedisRegistry
from tests.matchmaker.fakes import Wire
from tests.matchmaker.helpers import Harness, RedisProcess, eventually, info, pub

HOST = Address(pub(1), 27960)
SOURCE = (HOST.ip, HOST.port)


@dataclass
class Replica:
    """One replica: a service on its own registry, its datagrams collected."""

    h: Harness
    sent: list[tuple[bytes, Address]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def registry(self) -> RedisRegistry:
        assert isinstance(self.h.registry, RedisRegistry)
        return self.h.registry

    def beat(self, data: bytes, source: tuple[Any, ...] = SOURCE) -> list[bytes]:
        return self.h.service.liveness.receive(data, source)

    def result(self, name: str) -> float:
        return self.h.sample("matchmaker_heartbeats_total", result=name)

    def owner(self) -> str | None:
        rec = self.registry.get(HOST)
        return None if rec is None else rec.owner


@dataclass
class Pair:
    a: Replica
    b: Replica
    redis: aioredis.Redis

    async def owner_in_redis(self, address: Address = HOST) -> str | None:
        raw = await self.redis.hget(f"{{mm}}:h:{address.key}", "owner")
        return None if raw is None else bytes(raw).decode()

    async def register(self, ip: str = HOST.ip, port: int = HOST.port) -> tuple[bytes, Wire]:
        """A host registered on replica a, known to b too; its secret."""
        wire = self.a.h.connect(ip, port)
        reply = await wire.request(Register(request_id=1, host=info()))
        assert isinstance(reply, Registered), reply
        address = Address(ip, port)
        await eventually(lambda: self.b.registry.get(address) is not None)
        return reply.secret, wire


@pytest.fixture
async def pair(redis_server: RedisProcess) -> AsyncIterator[Pair]:
    replicas = []
    for name in ("a", "b"):
        registry = RedisRegistry(redis_server.url, replica_id=name, retry_interval=0.05)
        await registry.start()
        await asyncio.wait_for(registry.wait_synced(), 5)
        replica = Replica(Harness(registry=registry))
        liveness = replica.h.service.liveness
        liveness.send = lambda data, to, sent=replica.sent: sent.append((data, to))
        replica.tasks = [
            asyncio.create_task(replica.h.service.run_takeovers()),
            asyncio.create_task(replica.h.service.run_notices()),
        ]
        replicas.append(replica)
    client = aioredis.Redis.from_url(redis_server.url)
    yield Pair(replicas[0], replicas[1], client)
    for replica in replicas:
        for task in replica.tasks:
            task.cancel()
        await asyncio.gather(*replica.tasks, return_exceptions=True)
        await replica.registry.close()
    await client.aclose()


def moving(secret: bytes, counter: int) -> bytes:
    """The heartbeat a host sends only while it moves to another replica."""
    return hb.encode_beat(secret, HOST, counter, hb.Kind.MOVING)


async def heartbeat_on_a(pair: Pair, secret: bytes, counter: int) -> bytes:
    """A heartbeat its replica accepts, and flushes to Redis (counter included)."""
    data = hb.encode_beat(secret, HOST, counter)
    assert pair.a.beat(data) == [hb.encode_ack(secret, HOST, counter)]
    await pair.a.h.service.flush_heartbeats()
    return data


async def test_a_heartbeat_to_another_replica_moves_the_host_without_a_registration(
    pair: Pair,
) -> None:
    secret, _ = await pair.register()
    await heartbeat_on_a(pair, secret, 100)
    assert pair.a.registry.owned()[0].address == HOST

    assert pair.b.beat(moving(secret, 101)) == []  # answered once taken
    await eventually(lambda: len(pair.b.sent) == 1)
    # The acknowledgement the host authenticates, no larger than its heartbeat.
    assert pair.b.sent == [(hb.encode_ack(secret, HOST, 101), HOST)]
    assert len(pair.b.sent[0][0]) < len(moving(secret, 101))
    assert await pair.owner_in_redis() == "b"
    assert pair.b.owner() == "b"
    assert pair.b.result("taken_over") == 1
    assert pair.b.h.sample("matchmaker_registrations_total", result="created") == 0
    # The old owner follows through the stream: the host is not its own any more,
    # so it would neither re-assert it after an outage nor keep introductions.
    await eventually(lambda: pair.a.owner() == "b")
    assert pair.a.registry.owned() == []
    assert [r.address for r in pair.b.registry.owned()] == [HOST]
    # From now on b answers as the host's own replica.
    assert pair.b.beat(hb.encode_beat(secret, HOST, 102)) == [hb.encode_ack(secret, HOST, 102)]
    assert pair.b.result("ok") == 1


async def test_the_old_owner_alive_takes_the_host_back_on_its_next_heartbeat(
    pair: Pair,
) -> None:
    """A host that only lost a few answers: ownership follows its heartbeats."""
    secret, _ = await pair.register()
    assert pair.b.beat(moving(secret, 10)) == []
    await eventually(lambda: pair.a.owner() == "b")
    assert pair.a.beat(moving(secret, 11)) == []
    await eventually(lambda: len(pair.a.sent) == 1)
    assert pair.a.sent == [(hb.encode_ack(secret, HOST, 11), HOST)]
    assert await pair.owner_in_redis() == "a"
    await eventually(lambda: pair.b.owner() == "a")
    assert pair.b.registry.owned() == []


async def test_replayed_forged_and_misaddressed_heartbeats_move_nothing(pair: Pair) -> None:
    secret, _ = await pair.register()
    await heartbeat_on_a(pair, secret, 500)
    older = moving(secret, 400)  # recorded on an earlier move

    # b never saw this counter, so its own check passes; Redis knows better.
    assert pair.b.beat(older) == []
    await eventually(lambda: pair.b.result("takeover_replayed") == 1)
    assert pair.b.beat(moving(b"x" * 32, 10**6)) == []  # forged
    assert pair.b.result("bad_mac") == 1
    elsewhere = (pub(9), HOST.port)  # a copy sent from another address
    wrong = pair.b.beat(moving(secret, 10**6), elsewhere)
    assert pair.b.result("wrong_address") == 1
    assert [len(r) for r in wrong] == [hb.ACK_BYTES]  # the authenticated NOT_REGISTERED
    assert hb.decode_not_registered(secret, HOST, wrong[0]) == (10**6, True)

    await asyncio.sleep(0.2)  # a takeover, if any had slipped through, would be done
    assert await pair.owner_in_redis() == "a"
    assert pair.b.owner() == "a" and pair.a.owner() == "a"
    assert pair.b.result("taken_over") == 0
    assert pair.b.sent == []  # no answer to a replay or a forgery
    # The genuine next MOVING heartbeat still moves it.
    assert pair.b.beat(moving(secret, 501)) == []
    await eventually(lambda: pair.b.result("taken_over") == 1)
    assert await pair.owner_in_redis() == "b"


async def test_a_replayed_plain_heartbeat_moves_nothing(pair: Pair) -> None:
    """A copy of a heartbeat accepted by the owner, replayed at another replica before
    the owner's sweep writes its counter: the counter check passes everywhere, but a
    plain heartbeat is no request to move."""
    secret, _ = await pair.register()
    recorded = hb.encode_beat(secret, HOST, 100)
    assert pair.a.beat(recorded) == [hb.encode_ack(secret, HOST, 100)]  # not flushed yet

    replies = pair.b.beat(recorded)
    assert pair.b.result("not_owner") == 1
    # Answered as a stopping replica would (the host drops it: not its replica),
    # authenticated and no larger than the heartbeat.
    assert [hb.decode_not_registered(secret, HOST, r) for r in replies] == [(100, True)]
    assert len(replies[0]) < len(recorded)
    await asyncio.sleep(0.2)  # a takeover, if one had started, would be done
    assert await pair.owner_in_redis() == "a"
    assert pair.b.owner() == "a" and pair.a.owner() == "a"
    assert pair.b.result("taken_over") == 0 and pair.b.sent == []
    # The owner goes on answering its host.
    assert pair.a.beat(hb.encode_beat(secret, HOST, 101)) == [hb.encode_ack(secret, HOST, 101)]


async def test_a_moving_heartbeat_still_in_flight_when_taken_over_moves_nothing_back(
    pair: Pair,
) -> None:
    """The host sent MOVING 11 before the answer to 10 came: the new owner writes 11
    at once too, so a copy of 11 replayed at the old owner is refused."""
    secret, _ = await pair.register()
    assert pair.b.beat(moving(secret, 10)) == []
    await eventually(lambda: pair.b.result("taken_over") == 1)
    assert pair.b.beat(moving(secret, 11)) == []  # b owns the host already
    await eventually(lambda: pair.b.result("taken_over") == 2)
    assert [d for d, _ in pair.b.sent] == [hb.encode_ack(secret, HOST, c) for c in (10, 11)]

    assert pair.a.beat(moving(secret, 11)) == []
    await eventually(lambda: pair.a.result("takeover_replayed") == 1)
    assert await pair.owner_in_redis() == "b"
    assert pair.a.result("taken_over") == 0 and pair.a.sent == []


async def test_takeovers_are_limited_per_host(pair: Pair) -> None:
    secret, _ = await pair.register()
    for counter in (10, 11):
        assert pair.b.beat(moving(secret, counter)) == []
        await eventually(lambda c=counter: len(pair.b.sent) == c - 9)
    before = await pair.redis.xlen("{mm}:events")
    assert pair.b.beat(moving(secret, 12)) == []  # the burst is spent
    assert pair.b.result("takeover_limited") == 1
    await asyncio.sleep(0.2)
    assert len(pair.b.sent) == 2  # not answered
    assert await pair.redis.xlen("{mm}:events") == before  # nor written
    pair.b.h.clock.advance(1.0)
    assert pair.b.beat(moving(secret, 13)) == []
    await eventually(lambda: pair.b.result("taken_over") == 3)
    assert pair.b.sent[-1][0] == hb.encode_ack(secret, HOST, 13)


async def test_a_superseded_takeover_is_counted(pair: Pair) -> None:
    """Two MOVING heartbeats before the batch runs: the later one is answered."""
    secret, _ = await pair.register()
    assert pair.b.beat(moving(secret, 10)) == []
    assert pair.b.beat(moving(secret, 11)) == []
    assert pair.b.result("takeover_superseded") == 1
    await eventually(lambda: pair.b.result("taken_over") == 1)
    await asyncio.sleep(0.1)
    assert pair.b.sent == [(hb.encode_ack(secret, HOST, 11), HOST)]


async def test_a_stopping_replica_neither_takes_over_nor_answers(pair: Pair) -> None:
    """The host moves on to the next replica instead of registering with this one."""
    secret, _ = await pair.register()
    pair.b.h.service.liveness.stopping = True
    assert pair.b.beat(moving(secret, 10)) == []
    assert pair.b.result("takeover_stopping") == 1
    await asyncio.sleep(0.2)
    assert pair.b.sent == []
    assert pair.b.result("stopping") == 0 and pair.b.result("taken_over") == 0
    assert await pair.owner_in_redis() == "a"


async def test_notices_stay_readable_by_the_previous_release(pair: Pair) -> None:
    """A replica of the previous release unpacks exactly two fields: only a notice
    forwarded after a takeover (which that release never sends on) has a third."""
    pubsub = pair.redis.pubsub()
    await pubsub.subscribe("{mm}:notice:a")
    try:
        confirmed = await pubsub.get_message(timeout=5)  # subscribed before publishing
        assert confirmed is not None and confirmed["type"] == "subscribe"
        await pair.b.registry.deliver("a", Notice(HOST, b"intro"))
        await pair.b.registry.deliver("a", Notice(HOST, b"moved", forwarded=True))
        got: list[list[Any]] = []
        for _ in range(2):
            message = await pubsub.get_message(timeout=5)
            assert message is not None
            got.append(msgpack.unpackb(message["data"], raw=False))
    finally:
        await pubsub.aclose()
    assert got == [[HOST.key, b"intro"], [HOST.key, b"moved", True]]


async def test_a_removed_or_replaced_host_is_never_put_back(pair: Pair) -> None:
    secret, _ = await pair.register()
    token = pair.a.registry.owned()[0].token
    assert await pair.a.registry.remove(HOST, RemovalReason.UNREGISTERED, token=token)
    # However late b hears of the removal, the heartbeat of the removed
    # registration does not bring it back.
    late = await pair.b.registry.take_over([Takeover(HOST, token, 10**9)])
    assert late == [TakeoverResult.NOT_REGISTERED]
    assert not await pair.redis.exists(f"{{mm}}:h:{HOST.key}")
    await eventually(lambda: pair.b.registry.get(HOST) is None)

    # Registered again (a new token): the old registration's heartbeats are void.
    await pair.register()
    new = pair.a.registry.owned()[0]
    assert new.token != token
    assert await pair.b.registry.take_over([Takeover(HOST, token, 10**10)]) == [
        TakeoverResult.NOT_REGISTERED
    ]
    assert await pair.owner_in_redis() == "a"


async def test_a_late_heartbeat_of_a_removed_host_gets_not_registered(pair: Pair) -> None:
    """The same through the liveness path: b still lists the host when the heartbeat
    comes, Redis does not; the host is told (authenticated) to register again."""
    secret, _ = await pair.register()
    await pair.redis.eval(  # removed behind b's back: no stream event tells b
        "redis.call('DEL', KEYS[1]) redis.call('ZREM', KEYS[2], ARGV[1])",
        2,
        f"{{mm}}:h:{HOST.key}",
        "{mm}:seen",
        HOST.key,
    )
    assert pair.b.registry.get(HOST) is not None
    assert pair.b.beat(moving(secret, 7)) == []
    await eventually(lambda: len(pair.b.sent) == 1)
    reply, to = pair.b.sent[0]
    assert to == HOST and hb.decode_not_registered(secret, HOST, reply) == (7, True)
    assert pair.b.result("not_registered") == 1
    assert not await pair.redis.exists(f"{{mm}}:h:{HOST.key}")


async def test_introductions_reach_a_host_that_was_taken_over(pair: Pair) -> None:
    secret, _ = await pair.register()
    assert pair.b.beat(moving(secret, 10)) == []
    await eventually(lambda: pair.a.owner() == "b")

    # A client of the old owner asks: the introduction goes to the new owner,
    # which sends it to the host's heartbeat address.
    client = pair.a.h.connect(pub(2), 5000)
    reply = await client.request(Introduce(request_id=3, host=HOST))
    assert isinstance(reply, Introduction) and reply.role is Role.CLIENT
    await eventually(lambda: any(d[0] == hb.Kind.INTRODUCTION for d, _ in pair.b.sent))
    datagram, to = next((d, t) for d, t in pair.b.sent if d[0] == hb.Kind.INTRODUCTION)
    assert to == HOST
    found = hb.decode_introduction(secret, HOST, datagram)
    assert found is not None
    intro = decode(found[1])
    assert isinstance(intro, Introduction) and intro.role is Role.HOST
    assert intro.peer == Address(pub(2), 5000)
    assert not any(d[0] == hb.Kind.INTRODUCTION for d, _ in pair.a.sent)


async def test_an_introduction_that_reached_the_old_owner_is_sent_on(pair: Pair) -> None:
    """Relayed to the old owner by a replica that had not yet seen the move: the old
    owner sends it on once, and the new owner delivers it."""
    secret, _ = await pair.register()
    assert pair.b.beat(moving(secret, 10)) == []
    await eventually(lambda: pair.a.owner() == "b")
    await pair.b.registry.deliver("a", Notice(HOST, b"late introduction"))
    await eventually(lambda: any(d[0] == hb.Kind.INTRODUCTION for d, _ in pair.b.sent))
    datagram = next(d for d, _ in pair.b.sent if d[0] == hb.Kind.INTRODUCTION)
    found = hb.decode_introduction(secret, HOST, datagram)
    assert found is not None and found[1] == b"late introduction"
    assert not any(d[0] == hb.Kind.INTRODUCTION for d, _ in pair.a.sent)
