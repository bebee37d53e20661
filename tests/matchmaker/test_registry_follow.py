"""Following other replicas' writes through the Redis stream: what a follower ends up
with, the stored-host decoder it uses, and what it does with a hostile entry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from matchmaker.addresses import Address
from matchmaker.messages import (
    HostInfo,
    MessageError,
    Register,
    decode,
    decode_host,
    encode,
)
from matchmaker.messages._readers import _decode_slow
from matchmaker.metrics import Metrics
from matchmaker.registry import RemovalReason
from matchmaker.registry.base import Takeover, TakeoverResult
from matchmaker.registry.redis import RedisRegistry
from tests.matchmaker.helpers import RedisProcess, RegistryFactory, eventually, host

Factory = RegistryFactory

KEY = bytes(range(32))
HOSTS = [
    host("plain"),
    host("full", map="dm6", players=3, password=True, tags=("ctf", "eu"), region="eu"),
    host("lan", lan=Address("192.168.1.20", 27960), info=b"\x00\xff" * 10, key=KEY),
    host("ünïcode ✓", game="q3", tags=("b", "a")),
]


def addr(i: int) -> Address:
    return Address("198.51.100.7", 20000 + i)


def state(reg: RedisRegistry) -> dict[Address, tuple[object, ...]]:
    return {
        r.address: (r.info, r.owner, r.token, r.registered_at, r.last_seen) for r in reg.index()
    }


async def caught_up(follower: RedisRegistry, writer: RedisRegistry) -> None:
    last = await writer._redis.xrevrange(writer._k("events"), count=1)
    want = last[0][0].decode()
    await eventually(lambda: follower._last_id == want)


async def test_follower_converges_to_what_redis_holds(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    follower = await replica(replica_id="f")
    recs = [await a.upsert(addr(i), h, max_per_ip=100) for i, h in enumerate(HOSTS)]
    again = await a.upsert(addr(0), host("registered again"), max_per_ip=100)  # new token
    await a.update(addr(1), recs[1].token, host("updated", players=5, tags=("ctf",)))
    await a.touch({addr(1): 7, addr(2): 9})
    taken = await b.take_over([Takeover(addr(2), recs[2].token, 10)])
    assert taken == [TakeoverResult.TAKEN]
    await a.remove(addr(3), RemovalReason.UNREGISTERED, token=recs[3].token)
    await caught_up(follower, a)
    # What a replica loads from Redis is the truth the stream must lead to.
    fresh = await replica(replica_id="g")
    assert state(follower) == state(fresh) == state(a)
    assert set(state(follower)) == {addr(0), addr(1), addr(2)}
    got = follower.get(addr(0))
    assert got is not None and got.token == again.token
    got = follower.get(addr(2))
    assert got is not None and got.owner == "b" and got.info.lan == HOSTS[2].lan
    assert follower.dropped_events == {}


async def test_events_keep_the_fields_older_releases_read(replica: Factory) -> None:
    """A replica of the previous release shares the stream during a rolling upgrade:
    an upsert carries every field it reads, the info in the encoding it decodes."""
    a = await replica(replica_id="a")
    rec = await a.upsert(addr(1), HOSTS[1], max_per_ip=10)
    await a.touch([addr(1)])
    await a.remove(addr(1), RemovalReason.DISCONNECTED)
    events = await a._redis.xrange(a._k("events"))
    ops = {f[b"op"]: f for _sid, f in events}
    assert set(ops[b"upsert"]) >= {b"op", b"addr", b"info", b"owner", b"token", b"reg", b"seen"}
    msg = decode(ops[b"upsert"][b"info"])
    assert isinstance(msg, Register) and msg.host == rec.info
    assert set(ops[b"touch"]) >= {b"op", b"addrs", b"seen"}
    assert set(ops[b"remove"]) >= {b"op", b"addr", b"reason", b"token"}


async def test_hostile_entries_are_dropped_and_counted(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    follower = await replica(replica_id="f")
    rec = await a.upsert(addr(1), host("kept"), max_per_ip=10)
    await caught_up(follower, a)
    raw = aioredis.Redis.from_url(redis_server.url)
    stream = a._k("events")
    good = {"op": "upsert", "addr": addr(2).key, "owner": "x", "token": "t", "reg": 1, "seen": 1}
    bad_events: list[dict[str, object]] = [
        {"op": "upsert", "addr": "no address"},
        {"op": "touch", "addrs": addr(1).key},  # no 'seen'
        {"op": "touch", "addrs": "a:b c:", "seen": 5},
        {"op": "owner", "owner": "x", "addrs": f"{addr(1).key}", "seen": 5},  # no token
        {"op": "remove", "addr": addr(1).key, "reason": "because", "token": rec.token},
        {"op": "\xff"},
    ]
    bad_records: list[dict[str, object]] = [
        {**good, "info": b"\xc1garbage"},
        {**good, "info": encode(Register(host=host("x")))[:-1]},
        {**good, "info": encode(Register(host=host("x"))), "reg": "soon"},
        {**good, "info": encode(Register(host=host("x"))), "reg": "1" + "0" * 400},  # no float
        {"op": "upsert", "addr": addr(3).key, "info": encode(Register(host=host("x")))},
    ]
    try:
        for fields in [*bad_events, *bad_records]:
            await raw.xadd(stream, fields)  # type: ignore[arg-type]
    finally:
        await raw.aclose()
    await a.upsert(addr(4), host("after"), max_per_ip=10)
    await caught_up(follower, a)
    assert follower.dropped_events == {"bad_event": 6, "bad_record": 5}
    assert not follower.stale  # the follower went on: no resync for a bad entry
    assert set(state(follower)) == {addr(1), addr(4)}


async def test_a_new_replica_loads_past_hostile_stored_hosts(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # One bad key must not keep every replica that loads from ever syncing.
    a = await replica(replica_id="a")
    await a.upsert(addr(1), host("kept"), max_per_ip=10)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        stored = {"info": encode(Register(host=host("x"))), "owner": "x", "token": "t"}
        await raw.hset(a._k("h", addr(2).key), mapping={**stored, "reg": "1" + "0" * 400})
        await raw.hset(a._k("h", addr(3).key), mapping={**stored, "reg": "soon"})
        await raw.zadd(a._k("seen"), {addr(2).key: 1, addr(3).key: 1, b"\xff\xfe": 1})
    finally:
        await raw.aclose()
    fresh = await replica(replica_id="g")  # synced within the factory's bound
    assert set(state(fresh)) == {addr(1)}
    assert fresh.dropped_events == {"bad_stored": 3}
    assert not fresh.stale
    # ... and operators see them.
    metrics = Metrics()
    metrics.bind_state(
        hosts_by_game=fresh.count_by_game,
        stale=lambda: fresh.stale,
        connections=lambda: 0,
        max_games=10,
        registry_dropped=lambda: fresh.dropped_events,
    )
    got = metrics.registry.get_sample_value(
        "matchmaker_registry_entries_dropped_total", {"reason": "bad_stored"}
    )
    assert got == 3


def blobs() -> list[bytes]:
    out = [encode(Register(host=h)) for h in HOSTS]
    out += [encode(Register(request_id=9, host=host("id")))]
    return out


@pytest.mark.parametrize("blob", blobs())
def test_decode_host_is_decode(blob: bytes) -> None:
    """The fast reader gives what `decode` gives, for the whole message, every
    truncation, and every single byte changed: the same host or a MessageError."""

    def outcome(f: Callable[[bytes], object], data: bytes) -> object:
        try:
            return f(data)
        except MessageError:
            return MessageError

    def via_decode(data: bytes) -> HostInfo:
        msg = _decode_slow(data)  # the readers alone: `decode` takes the fast path too
        if not isinstance(msg, Register):
            raise MessageError(msg.__class__.__name__, "not a Register")  # type: ignore[arg-type]
        return msg.host

    variants = [blob] + [blob[:i] for i in range(len(blob))]
    for i in range(len(blob)):
        for b in (0x00, 0x7F, 0xA0, 0xC0, 0xC2, 0xFF, blob[i] ^ 1):
            variants.append(blob[:i] + bytes([b]) + blob[i + 1 :])
    for data in variants:
        assert outcome(decode_host, data) == outcome(via_decode, data), data
        assert outcome(decode, data) == outcome(_decode_slow, data), data
    info = decode_host(blob)
    if info.lan is None:  # the fast path (a LAN address takes `decode`)
        assert info.game is decode_host(blob).game  # interned: hosts share it
