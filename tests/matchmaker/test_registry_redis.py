"""The shared registry against a real redis-server: replicas, Redis time, outages."""

from __future__ import annotations

import asyncio
import random
import shutil
from typing import Any
from unittest.mock import ANY

import msgpack
import pytest
import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry

from matchmaker.addresses import Address, parse_key
from matchmaker.heartbeat import derive_secret
from matchmaker.messages import Error, ErrorReason, HostInfo, ListFilter, Register, decode_host
from matchmaker.metrics import Metrics
from matchmaker.registry import (
    Notice,
    RegistryBusy,
    RegistryFull,
    RegistryUnavailable,
    RemovalReason,
    Takeover,
    TakeoverResult,
    TooManyHosts,
)
from matchmaker.registry.redis import RedisRegistry
from matchmaker.server import build_registry
from matchmaker.settings import Settings
from tests.matchmaker.fakes import FakeClock
from tests.matchmaker.helpers import (
    Harness,
    RedisProcess,
    RegistryFactory,
    eventually,
    free_port,
    host,
    pub,
)

Q3 = ListFilter(game="q3")
Factory = RegistryFactory


def addr(i: int, ip: str = "198.51.100.1") -> Address:
    return Address(ip, 20000 + i)


async def listed(reg: RedisRegistry) -> set[Address]:
    return {r.address for r in await reg.query(Q3)}


async def test_register_on_one_list_on_the_other(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    rec = await a.upsert(addr(1), host("from a"), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    seen = b.get(addr(1))
    assert seen is not None and (seen.owner, seen.token, seen.info) == ("a", rec.token, rec.info)
    assert await listed(b) == {addr(1)}
    # Updates and removals travel too.
    await a.update(addr(1), rec.token, host("renamed", players=2))
    await eventually(lambda: (r := b.get(addr(1))) is not None and r.info.players == 2)
    await a.remove(addr(1), RemovalReason.UNREGISTERED, token=rec.token)
    await eventually(lambda: b.get(addr(1)) is None)
    # A replica started later loads what exists.
    await b.upsert(addr(2), host(), max_per_ip=10)
    c = await replica(replica_id="c")
    assert await listed(c) == {addr(2)}


async def test_per_ip_cap_is_global(replica: Factory) -> None:
    a = await replica()
    b = await replica()
    await a.upsert(addr(1), host(), max_per_ip=2)
    await b.upsert(addr(2), host(), max_per_ip=2)
    with pytest.raises(Exception, match=r"198\.51\.100\.1"):
        await a.upsert(addr(3), host(), max_per_ip=2)


async def test_notices_reach_the_owning_replica(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    await asyncio.sleep(0)  # let b's subscriber task subscribe
    notice = Notice(addr(1), b"introduction bytes")

    async def deliver_until_received() -> Notice:
        # Pub/sub drops what is published before the subscription exists.
        while True:
            await a.deliver("b", notice)
            try:
                return await asyncio.wait_for(b.next_notice(), 0.2)
            except TimeoutError:
                continue

    assert await asyncio.wait_for(deliver_until_received(), 5) == notice


async def test_queries_do_not_touch_redis(replica: Factory, redis_server: RedisProcess) -> None:
    a = await replica()
    for i in range(50):
        await a.upsert(addr(i, f"198.51.100.{i + 1}"), host(), max_per_ip=10)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        before = await admin.info("commandstats")
        for _ in range(200):
            assert len(await a.query(Q3)) == 50
        after = await admin.info("commandstats")
    finally:
        await admin.aclose()
    reads = ("cmdstat_scan", "cmdstat_keys", "cmdstat_hgetall", "cmdstat_zrange")
    for name in reads:
        assert before.get(name) == after.get(name), name


async def test_local_clocks_do_not_matter(replica: Factory) -> None:
    # Two replicas whose clocks disagree by a year and do not move at all:
    # ages are measured in Redis time, so both agree on what is visible.
    a = await replica(clock=FakeClock(0.0), hide_after=5, expire_after=10)
    b = await replica(clock=FakeClock(3.2e7), hide_after=5, expire_after=10)
    await a.upsert(addr(1), host(), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    assert await listed(a) == await listed(b) == {addr(1)}


async def test_hide_and_expire_follow_redis_time(replica: Factory) -> None:
    # addr(2) is touched every 50 ms: hidden only after a stall of 1.5 s.
    a = await replica(hide_after=1.5, expire_after=3.0, sweep_gap=5.0)
    b = await replica(hide_after=1.5, expire_after=3.0, sweep_gap=5.0)
    await a.expire()  # the very first sweep opens a grace period: let it pass
    await a.upsert(addr(1), host(), max_per_ip=10)
    await a.upsert(addr(2), host(), max_per_ip=10)

    async def keep_two_alive() -> None:
        while True:
            await a.touch([addr(2)])
            await asyncio.sleep(0.05)

    keeper = asyncio.create_task(keep_two_alive())
    try:
        await eventually(lambda: b.is_visible(b.get(addr(1)), b.now()) is False)  # type: ignore[arg-type]
        assert await listed(b) == {addr(2)}
        removed: list[Address] = []

        async def sweep() -> bool:
            removed.extend(r.address for r in await b.expire())
            return bool(removed)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not await sweep():
            assert loop.time() < deadline, "never expired"
            await asyncio.sleep(0.05)
        assert removed == [addr(1)]
        await eventually(lambda: a.get(addr(1)) is None)
        assert a.get(addr(2)) is not None
    finally:
        keeper.cancel()


async def test_outage_stale_mode_no_mass_expiry_and_resync(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # After the outage, the grace period lasts expire_after: long enough for the
    # checks below on a loaded machine.
    opts = {"hide_after": 1.5, "expire_after": 3.0, "sweep_gap": 1.2}
    a = await replica(replica_id="a", **opts)
    b = await replica(replica_id="b", **opts)
    await a.expire()
    rec_a = await a.upsert(addr(1), host("on a"), max_per_ip=10)
    rec_b = await b.upsert(addr(2, "198.51.100.2"), host("on b"), max_per_ip=10)
    gone = await b.upsert(addr(3, "198.51.100.3"), host("leaves"), max_per_ip=10)
    await eventually(lambda: len(a.index()) == len(b.index()) == 3)

    redis_server.kill()
    await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
    assert a.stale and b.stale and a.ready
    # Stale mode: lists are still served, from the last known copy...
    assert await listed(a) == await listed(b) == {addr(1), addr(2, "198.51.100.2"), gone.address}
    # ...hosts keep registering, leaving and heartbeating on their own replica...
    late = await a.upsert(addr(4, "198.51.100.4"), host("registered during outage"), max_per_ip=10)
    assert await b.remove(gone.address, RemovalReason.UNREGISTERED, token=gone.token)
    assert await a.touch([addr(1), late.address]) == set()
    # ...and nothing expires on a clock nobody can read.
    assert await a.expire() == [] and await b.expire() == []

    await asyncio.sleep(3.5)  # longer than expire_after: every `seen` in Redis is now too old
    redis_server.start()
    await asyncio.wait_for(asyncio.gather(a.wait_synced(), b.wait_synced()), 10)
    assert not a.stale and not b.stale

    # The first sweeps after the outage open a grace period instead of expiring everyone.
    assert await a.expire() == [] and await b.expire() == []
    want = {addr(1), addr(2, "198.51.100.2"), late.address}
    await eventually(lambda: {r.address for r in a.index()} == want)
    await eventually(lambda: {r.address for r in b.index()} == want)
    assert await listed(a) == await listed(b) == want
    # Tokens survived, so the owners can still update and remove their hosts.
    await a.update(addr(1), rec_a.token, host("still a"))
    assert await b.remove(rec_b.address, RemovalReason.UNREGISTERED, token=rec_b.token)
    await eventually(lambda: a.get(rec_b.address) is None)


async def test_redis_data_loss_is_repaired_by_owners(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    await a.upsert(addr(1), host(), max_per_ip=10)
    await b.upsert(addr(2, "198.51.100.2"), host(), max_per_ip=10)
    redis_server.kill()
    await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
    shutil.rmtree(redis_server.directory)
    redis_server.directory.mkdir()
    redis_server.start()  # empty
    await asyncio.wait_for(asyncio.gather(a.wait_synced(), b.wait_synced()), 10)
    want = {addr(1), addr(2, "198.51.100.2")}
    await eventually(lambda: {r.address for r in a.index()} == want)
    await eventually(lambda: {r.address for r in b.index()} == want)


async def test_reassert_yields_to_a_newer_registration(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    await a.upsert(addr(1), host("old"), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    # The host moves to replica b while a is cut off from Redis.
    a._mark_stale(ConnectionError("test partition"))
    newer = await b.upsert(addr(1), host("new"), max_per_ip=10)
    await a._resync()
    a._mark_fresh()
    await eventually(lambda: (r := a.get(addr(1))) is not None and r.token == newer.token)
    assert a.owned() == []


def restart_empty(server: RedisProcess) -> None:
    """Start `server` again without its data (no persistence survived)."""
    shutil.rmtree(server.directory)
    server.directory.mkdir()
    server.start()


def hold_resync(reg: RedisRegistry) -> tuple[asyncio.Event, asyncio.Event]:
    """Make `reg`'s next reloads wait until the second event returned is set; the
    first is set when one starts waiting."""
    real = reg._resync
    entered, gate = asyncio.Event(), asyncio.Event()

    async def held() -> None:
        entered.set()
        await gate.wait()
        await real()

    reg._resync = held  # type: ignore[method-assign]
    return entered, gate


async def stored_hash(server: RedisProcess, address: Address) -> dict[bytes, bytes]:
    r = aioredis.Redis.from_url(server.url)
    try:
        return await r.hgetall(f"{{mm}}:h:{address.key}")  # type: ignore[no-any-return]
    finally:
        await r.aclose()


async def test_the_newest_registration_wins_whoever_writes_back_first_after_data_loss(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    old = await a.upsert(addr(1), host("old"), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    _, gate = hold_resync(b)  # b writes back last
    redis_server.kill()
    await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
    newer = await b.upsert(addr(1), host("new"), max_per_ip=10)  # the host moved to b
    assert newer.registered_at > old.registered_at
    restart_empty(redis_server)
    await asyncio.wait_for(a.wait_synced(), 10)
    # a wrote its (older) registration back first...
    assert (await stored_hash(redis_server, addr(1)))[b"token"] == old.token.encode()
    gate.set()
    await asyncio.wait_for(b.wait_synced(), 10)
    # ...and b's newer one replaced it all the same.
    got = await stored_hash(redis_server, addr(1))
    assert (got[b"owner"], got[b"token"]) == (b"b", newer.token.encode())
    await eventually(lambda: (r := a.get(addr(1))) is not None and r.token == newer.token)
    assert a.owned() == [] and [r.token for r in b.owned()] == [newer.token]


async def test_a_host_taken_over_while_its_replica_was_cut_off_is_not_its_own_after(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    rec = await a.upsert(addr(1), host(), max_per_ip=10)
    await a.touch({addr(1): 5})
    await eventually(lambda: b.get(addr(1)) is not None)
    entered, gate = hold_resync(a)
    a._mark_stale(ConnectionError("test partition"))  # a alone is cut off...
    await asyncio.wait_for(entered.wait(), 5)  # ...and no longer reads the stream
    # The host's heartbeats now reach b, which takes it over.
    assert await b.take_over([Takeover(addr(1), rec.token, 7)]) == [TakeoverResult.TAKEN]
    gate.set()
    await asyncio.wait_for(a.wait_synced(), 10)
    assert a.owned() == [] and [r.token for r in b.owned()] == [rec.token]
    got = a.get(addr(1))
    assert got is not None and got.owner == "b"
    assert (await stored_hash(redis_server, addr(1)))[b"owner"] == b"b"
    # Nor does a late re-assertion of the same registration take it back.
    late = await a._upsert_remote(
        addr(1), rec.info, rec.token, 10**6, "reassert", rec.registered_at
    )
    assert late == (None, 2)
    assert (await stored_hash(redis_server, addr(1)))[b"owner"] == b"b"


async def test_removals_kept_during_an_outage_are_only_those_redis_may_hold(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    old = await a.upsert(addr(1), host("before"), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    entered, gate = hold_resync(a)
    a._mark_stale(ConnectionError("test partition"))  # a alone is cut off
    await asyncio.wait_for(entered.wait(), 5)
    # Hosts that register and leave while a is cut off: Redis never saw them, and a
    # removal kept for each grew with the churn for as long as the outage lasted.
    for i in range(2, 52):
        rec = await a.upsert(addr(i), host("passing"), max_per_ip=100)
        assert await a.remove(rec.address, RemovalReason.UNREGISTERED, token=rec.token)
    assert a._pending_removals == {}
    # The host listed before registers again here and leaves: what Redis holds of it
    # (the earlier registration) is what the replay removes; the replay of the later
    # one found nothing, and the earlier stayed listed everywhere until it expired.
    again = await a.upsert(addr(1), host("again"), max_per_ip=10)
    assert await a.remove(addr(1), RemovalReason.UNREGISTERED, token=again.token)
    assert a._pending_removals == {addr(1): old.token}
    gate.set()
    await asyncio.wait_for(a.wait_synced(), 10)
    assert a._pending_removals == {}
    assert await stored_hash(redis_server, addr(1)) == {}
    await eventually(lambda: b.get(addr(1)) is None)
    assert a.get(addr(1)) is None and a.owned() == []


@pytest.mark.parametrize("ran", [True, False], ids=["redis ran it", "it never arrived"])
async def test_a_registration_whose_write_went_unanswered_is_removed_at_the_replay(
    ran: bool, replica: Factory, redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A host registers again just as the replica is cut off: the write fails without
    # an answer, so Redis holds the new registration (it ran the write) or the earlier
    # one (it never got it). The host leaves during the outage: the replay must remove
    # whichever Redis holds (a first version of the removals kept through an outage
    # replayed only the earlier one, a second only the new one; the other stayed
    # listed everywhere until it expired).
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    earlier = await a.upsert(addr(1), host("earlier"), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) == earlier)
    entered, gate = hold_resync(a)
    script = a._script
    raw = aioredis.Redis.from_url(redis_server.url)

    async def unanswered(name: str, keys: list[str], args: list[Any]) -> Any:
        if name != "upsert":
            return await script(name, keys, args)
        monkeypatch.setattr(a, "_script", script)  # once
        a._mark_stale(TimeoutError("test: the link fails"))
        await asyncio.wait_for(entered.wait(), 5)  # a follows nothing any more
        if ran:
            await raw.eval(a._scripts[name].script, len(keys), *keys, *args)
        raise RegistryUnavailable("test: no answer")

    monkeypatch.setattr(a, "_script", unanswered)
    try:
        again = await a.upsert(addr(1), host("again"), max_per_ip=10)
        assert a.stale and a.get(addr(1)) == again
        held = (await stored_hash(redis_server, addr(1)))[b"token"].decode()
        assert held == (again.token if ran else earlier.token)
        assert await a.remove(addr(1), RemovalReason.UNREGISTERED, token=again.token)
        assert a._pending_removals == {addr(1): f"{again.token} {earlier.token}"}
        gate.set()
        await asyncio.wait_for(a.wait_synced(), 10)
        assert await stored_hash(redis_server, addr(1)) == {}
        await eventually(lambda: b.get(addr(1)) is None)
        assert a.get(addr(1)) is None and a._pending_removals == {}
    finally:
        await raw.aclose()


@pytest.mark.parametrize("change", ["update", "register again"])
@pytest.mark.parametrize("when", ["after its write", "while its write is answered"])
async def test_a_host_changed_during_a_resync_is_written_back_as_changed(
    replica: Factory, redis_server: RedisProcess, change: str, when: str
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    recs = {h: await a.upsert(h, host("before"), max_per_ip=10) for h in (addr(1), addr(2))}
    await eventually(lambda: len(b.index()) == 2)
    real = a._scripts["upsert"]
    first: list[Address] = []
    changed: list[str] = []

    async def change_first(address: Address) -> None:
        if change == "update":
            await a.update(address, recs[address].token, host("after"))
            changed.append(recs[address].token)
        else:
            assert await a.remove(address, RemovalReason.UNREGISTERED, token=recs[address].token)
            changed.append((await a.upsert(address, host("after"), max_per_ip=10)).token)

    async def hooked(keys: list[str], args: list[object]) -> object:
        # Both hosts are written back (their info changed); the first one
        # changes again while the resync still runs (the registry is stale).
        if args[6] != "reassert" or changed:
            return await real(keys=keys, args=args)
        if first and when == "after its write":
            await change_first(first[0])
        got = await real(keys=keys, args=args)
        first.append(parse_key(str(args[0])))
        if when == "while its write is answered":
            await change_first(first[0])
        return got

    entered, gate = hold_resync(a)
    a._mark_stale(ConnectionError("test partition"))
    await asyncio.wait_for(entered.wait(), 5)
    for h, rec in recs.items():
        await a.update(h, rec.token, host("during"))
    a._scripts["upsert"] = hooked  # type: ignore[assignment]
    gate.set()
    await asyncio.wait_for(a.wait_synced(), 10)
    assert len(changed) == 1
    h = first[0]
    got = await stored_hash(redis_server, h)
    assert (got[b"owner"], got[b"token"]) == (b"a", changed[0].encode())
    assert decode_host(got[b"info"]).name == "after"
    mine = a.get(h)
    assert mine is not None and (mine.token, mine.info.name) == (changed[0], "after")
    await eventually(lambda: (r := b.get(h)) is not None and r.info.name == "after")
    assert [(r.token, r.info.name) for r in a.owned() if r.address == h] == [(changed[0], "after")]


async def test_observer_sees_operations_and_failures(
    replica: Factory, redis_server: RedisProcess
) -> None:
    seen: list[tuple[str, bool]] = []
    a = await replica(observer=lambda op, seconds, failed: seen.append((op, failed)))
    await a.upsert(addr(1), host(), max_per_ip=10)
    assert ("upsert", False) in seen
    redis_server.kill()
    await asyncio.wait_for(a.wait_stale(), 5)
    assert any(failed for _, failed in seen)


async def test_redis_error_replies_turn_stale_and_resync(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    await a.upsert(addr(1), host(), max_per_ip=10)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        # A replica of a master that is not there: every write now fails (READONLY).
        await r.replicaof("127.0.0.1", free_port())
        assert await a.touch([addr(1)]) == set()  # answered locally, not raised
        assert a.stale
        await r.replicaof("NO", "ONE")
        await asyncio.wait_for(a.wait_synced(), 5)
        assert not a.stale and a.get(addr(1)) is not None
    finally:
        await r.replicaof("NO", "ONE")
        await r.aclose()


async def test_unexpected_error_does_not_end_syncing(
    replica: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await replica(replica_id="a")
    real = a._follow
    failures = []

    async def broken() -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("bug")
        await real()

    monkeypatch.setattr(a, "_follow", broken)
    a._mark_stale(ConnectionError("test"))  # make the loop go round again
    await eventually(lambda: bool(failures) and not a.stale)
    b = await replica(replica_id="b")
    await b.upsert(addr(1), host(), max_per_ip=10)
    await eventually(lambda: a.get(addr(1)) is not None)


async def test_stored_info_is_read_back_with_the_configured_limits(
    redis_server: RedisProcess,
) -> None:
    settings = Settings(store=redis_server.url, max_info_bytes=1024, max_tags=24)
    a, b = (build_registry(settings, Metrics(CollectorRegistry())) for _ in range(2))
    assert isinstance(a, RedisRegistry) and isinstance(b, RedisRegistry)
    try:
        for reg in (a, b):
            await reg.start()
            await asyncio.wait_for(reg.wait_synced(), 5)
        big = host("big", info=b"x" * 600)  # over the default 512
        tagged = host("tagged", tags=tuple(f"t{i}" for i in range(20)))  # default 16
        await a.upsert(addr(1), big, max_per_ip=10)
        await a.upsert(addr(2), tagged, max_per_ip=10)
        await eventually(lambda: b.get(addr(1)) is not None and b.get(addr(2)) is not None)
        await b.close()
        b = build_registry(settings, Metrics(CollectorRegistry()))  # type: ignore[assignment]
        await b.start()
        await asyncio.wait_for(b.wait_synced(), 5)  # a full load, not the stream
        assert b.get(addr(1)) is not None and b.get(addr(2)) is not None
    finally:
        await a.close()
        await b.close()


async def test_update_during_an_outage_is_sent_at_resync(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    rec = await a.upsert(addr(1), host("before", players=0), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    a._mark_stale(ConnectionError("test partition"))
    await a.update(addr(1), rec.token, host("during", players=7))  # local only
    await asyncio.wait_for(a.wait_synced(), 5)
    await eventually(lambda: (r := b.get(addr(1))) is not None and r.info.players == 7)
    assert (r := a.get(addr(1))) is not None and r.info.name == "during"


async def test_a_late_script_reply_does_not_undo_newer_stream_state(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    rec = await a.upsert(addr(1), host(), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    real = a._scripts["remove"]
    b_done = asyncio.Event()

    async def late(keys: list[str], args: list[object]) -> object:
        result = await real(keys=keys, args=args)
        await b_done.wait()  # the reply arrives after newer events were followed
        return result

    a._scripts["remove"] = late  # type: ignore[assignment]
    removal = asyncio.create_task(a.remove(addr(1), RemovalReason.DISCONNECTED, token=rec.token))
    await eventually(lambda: b.get(addr(1)) is None)
    newer = await b.upsert(addr(1), host("moved"), max_per_ip=10)  # reconnected to b
    await eventually(lambda: (r := a.get(addr(1))) is not None and r.token == newer.token)
    b_done.set()
    assert await removal
    assert (r := a.get(addr(1))) is not None and r.token == newer.token


async def test_the_cap_sets_are_per_slash_64_and_entries_without_one_still_leave_theirs(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica()
    v6 = Address("2001:db8:7:8::1", 27960)
    old = Address("2001:db8:7:9::1", 27960)
    await a.upsert(v6, host(), max_per_ip=10)
    await a.upsert(old, host(), max_per_ip=10)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await r.smembers("{mm}:ip:2001:db8:7:8::/64") == {v6.key.encode()}
        assert await r.hget(f"{{mm}}:h:{old.key}", "cap") == b"{mm}:ip:2001:db8:7:9::/64"
        # An entry as an older replica wrote it: no cap field, its address in a per-IP set.
        await r.hdel(f"{{mm}}:h:{old.key}", "cap")
        await r.delete("{mm}:ip:2001:db8:7:9::/64")
        await r.sadd(f"{{mm}}:ip:{old.ip}", old.key)
        assert await a.remove(old, RemovalReason.UNREGISTERED)
        assert await a.remove(v6, RemovalReason.UNREGISTERED)
        assert await r.keys("{mm}:ip:*") == []  # both left their sets
    finally:
        await r.aclose()


async def test_a_legacy_entry_registered_again_leaves_its_per_ip_set(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica()
    h = Address("2001:db8:7:b::1", 27960)
    await a.upsert(h, host(), max_per_ip=10)
    r = aioredis.Redis.from_url(redis_server.url)
    try:  # make it an entry as an older replica wrote it
        await r.hdel(f"{{mm}}:h:{h.key}", "cap")
        await r.delete("{mm}:ip:2001:db8:7:b::/64")
        await r.sadd(f"{{mm}}:ip:{h.ip}", h.key)
        await a.upsert(h, host("again"), max_per_ip=10)  # the host registers again
        assert await r.smembers(f"{{mm}}:ip:{h.ip}") == set()
        assert await r.smembers("{mm}:ip:2001:db8:7:b::/64") == {h.key.encode()}
        assert await a.remove(h, RemovalReason.UNREGISTERED)
        assert await r.keys("{mm}:ip:*") == []
    finally:
        await r.aclose()


async def test_a_member_whose_entry_is_gone_does_not_hold_a_slot(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # An older replica removes entries from the per-IP set only: the /64 set keeps the
    # address, which must not count against the cap for good.
    a = await replica()
    first = Address("2001:db8:7:c::1", 27960)
    await a.upsert(first, host(), max_per_ip=1)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await r.delete(f"{{mm}}:h:{first.key}")  # what the older replica's removal leaves
        await r.zrem("{mm}:seen", first.key)
        second = Address("2001:db8:7:c::2", 27960)
        await a.upsert(second, host(), max_per_ip=1)
        assert await r.smembers("{mm}:ip:2001:db8:7:c::/64") == {second.key.encode()}
        with pytest.raises(TooManyHosts):  # a live member still counts
            await a.upsert(Address("2001:db8:7:c::3", 27960), host(), max_per_ip=1)
    finally:
        await r.aclose()


# ------------------------------------------------------------------ load, ownership, refill


def many(n: int) -> list[Address]:
    return [Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960) for i in range(n)]


async def owners_in_redis(server: RedisProcess, addresses: list[Address]) -> list[str]:
    r = aioredis.Redis.from_url(server.url)
    try:
        pipe = r.pipeline(transaction=False)
        for a in addresses:
            pipe.hget(f"{{mm}}:h:{a.key}", "owner")
        return [(o or b"").decode() for o in await pipe.execute()]
    finally:
        await r.aclose()


def test_the_pool_is_bounded_and_blocks() -> None:
    reg = RedisRegistry("redis://127.0.0.1:1/0", pool_size=8, pool_timeout=3.0)
    pool = reg._redis.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool)
    assert pool.max_connections == 8 + 2  # + the follower's and the subscription's
    with pytest.raises(ValueError):
        RedisRegistry("redis://127.0.0.1:1/0", pool_size=0)


async def test_a_thousand_hosts_re_homing_at_once_are_owned_by_their_new_replica(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # Replica x dies; its 1,000 hosts reconnect to y within the same instant.
    hosts = many(1000)
    x = await replica(replica_id="x")
    for a in hosts:
        await x.upsert(a, host(), max_per_ip=10)
    await x.close()
    y = await replica(replica_id="y", op_timeout=2.0)
    await eventually(lambda: len(y.index()) == 1000)
    got = await asyncio.gather(*(y.upsert(a, host("moved"), max_per_ip=10) for a in hosts))
    assert all(r.owner == "y" for r in got)
    went_stale = y.stale
    await asyncio.wait_for(y.wait_synced(), 10)
    assert set(await owners_in_redis(redis_server, hosts)) == {"y"}
    assert {r.owner for r in y.index()} == {"y"} and len(y.owned()) == 1000
    assert not went_stale  # load is not an outage


async def test_hosts_re_homed_during_an_outage_are_owned_by_the_replica_serving_them(
    replica: Factory, redis_server: RedisProcess
) -> None:
    hosts = many(200)
    x = await replica(replica_id="x")
    for a in hosts:
        await x.upsert(a, host(), max_per_ip=10)
    y = await replica(replica_id="y")
    await eventually(lambda: len(y.index()) == 200)
    await x.close()  # x dies...
    y._mark_stale(ConnectionError("test partition"))  # ...while y cannot write
    for a in hosts:  # its hosts register with y, which keeps them locally
        await y.upsert(a, host("moved"), max_per_ip=10)
    await asyncio.wait_for(y.wait_synced(), 10)
    assert set(await owners_in_redis(redis_server, hosts)) == {"y"}
    assert {r.owner for r in y.index()} == {"y"} and len(y.owned()) == 200


async def test_a_busy_pool_waits_then_answers_busy_and_is_not_an_outage(
    replica: Factory,
) -> None:
    a = await replica(replica_id="a", pool_size=1, pool_timeout=0.3)
    real = a._scripts["upsert"]
    release = asyncio.Event()

    async def slow(keys: list[str], args: list[object]) -> object:
        await release.wait()  # holds the only connection
        return await real(keys=keys, args=args)

    a._scripts["upsert"] = slow  # type: ignore[assignment]
    first = asyncio.create_task(a.upsert(addr(1), host(), max_per_ip=10))
    await asyncio.sleep(0.05)
    with pytest.raises(RegistryBusy):
        await a.upsert(addr(2), host(), max_per_ip=10)
    assert not a.stale and a.get(addr(2)) is None  # nothing written locally in its place
    release.set()
    assert (await first).owner == "a"
    a._scripts["upsert"] = real
    # A wait shorter than the bound succeeds (a bound a loaded machine keeps to).
    a._pool_timeout = 10.0
    release.clear()
    a._scripts["upsert"] = slow  # type: ignore[assignment]
    first = asyncio.create_task(a.upsert(addr(3), host(), max_per_ip=10))
    second = asyncio.create_task(a.upsert(addr(4), host(), max_per_ip=10))
    await eventually(lambda: a._gate.locked() and not second.done())
    await asyncio.sleep(0.1)  # second waits at the gate meanwhile
    release.set()
    await asyncio.gather(first, second)
    assert not a.stale and a.get(addr(4)) is not None


async def test_lists_never_shrink_while_an_empty_redis_is_refilled(
    replica: Factory, redis_server: RedisProcess
) -> None:
    mine, theirs = many(600)[:400], many(600)[400:]
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    for h in mine:
        await a.upsert(h, host(), max_per_ip=10)
    for h in theirs:
        await b.upsert(h, host(), max_per_ip=10)
    await eventually(lambda: len(a.index()) == len(b.index()) == 600)
    counts: list[int] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            counts.append(len(await a.query(Q3)))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        redis_server.kill()
        await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
        shutil.rmtree(redis_server.directory)
        redis_server.directory.mkdir()
        redis_server.start()  # empty: no persistence survived
        await asyncio.wait_for(asyncio.gather(a.wait_synced(), b.wait_synced()), 15)
        everyone = set(mine + theirs)
        # Until every host is back in Redis, and every replica has followed it.
        r = aioredis.Redis.from_url(redis_server.url)
        try:

            async def stored() -> int:
                return int(await r.zcard("{mm}:seen"))

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 15
            while await stored() < 600:
                assert loop.time() < deadline
                await asyncio.sleep(0.01)
        finally:
            await r.aclose()
        await eventually(lambda: {x.address for x in a.index()} == everyone)
        await eventually(lambda: all(a.get(h).owner == "b" for h in theirs))  # type: ignore[union-attr]
    finally:
        done.set()
        await watcher
    assert len(counts) > 10
    assert min(counts) == 600, [c for c in counts if c < 600][:5]


async def test_carried_hosts_nobody_writes_back_are_dropped_after_the_grace_period(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # After the outage, the grace period lasts expire_after: long enough for the
    # checks below on a loaded machine.
    opts = {"hide_after": 1.5, "expire_after": 3.0, "sweep_gap": 1.2}
    a = await replica(replica_id="a", **opts)
    b = await replica(replica_id="b", **opts)
    await a.upsert(addr(1), host(), max_per_ip=10)
    await b.upsert(addr(2), host(), max_per_ip=10)
    await eventually(lambda: len(a.index()) == 2)
    await b.close()  # b is gone for good: nobody will write its host back
    redis_server.kill()
    await asyncio.wait_for(a.wait_stale(), 5)
    shutil.rmtree(redis_server.directory)
    redis_server.directory.mkdir()
    redis_server.start()
    await asyncio.wait_for(a.wait_synced(), 10)
    assert {r.address for r in await a.query(Q3)} == {addr(1), addr(2)}  # carried
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while a.get(addr(2)) is not None:
        assert loop.time() < deadline, "carried host never dropped"
        await a.touch([addr(1)])
        await a.expire()
        await asyncio.sleep(0.1)
    assert a.get(addr(1)) is not None


async def test_a_grace_period_ends_when_the_one_redis_keeps_ends(
    replica: Factory, redis_server: RedisProcess
) -> None:
    # A replica whose own grace period had ended (the one its resync opened) while
    # Redis's, opened by the first sweep a moment later, still ran took it for a new
    # one and extended its own by expire_after from then: carried hosts stayed, and
    # nothing expired, up to twice as long as meant.
    a = await replica(replica_id="a", expire_after=60.0)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        now_ms = int(a.now() * 1000)
        await r.set(a._k("sweep"), now_ms)  # swept just now: no new grace period opens
        await r.set(a._k("grace"), now_ms + 20_000)  # Redis's ends in 20 s
        a._grace_until = a.now() - 1.0  # this replica's own has just ended
        await a.expire()
        assert a.now() + 19.0 < a._grace_until <= now_ms / 1000.0 + 20.0
        await r.set(a._k("grace"), 0)  # none in Redis: this replica's is not cut short
        await a.expire()
        assert a._grace_until == now_ms / 1000.0 + 20.0
    finally:
        await r.aclose()


async def test_a_second_short_outage_within_the_grace_period_keeps_carrying_hosts(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    await a.upsert(addr(1), host(), max_per_ip=10)
    await b.upsert(addr(2), host(), max_per_ip=10)
    await eventually(lambda: len(a.index()) == 2)
    hold_resync(b)  # b is slow to come back: nobody writes its host back meanwhile
    redis_server.kill()
    await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
    restart_empty(redis_server)
    await asyncio.wait_for(a.wait_synced(), 10)
    assert {r.address for r in await a.query(Q3)} == {addr(1), addr(2)}  # carried
    assert a.now() < a._grace_until
    # A second, short outage of a alone, well within the grace period.
    a._mark_stale(ConnectionError("test partition"))
    await asyncio.wait_for(a.wait_synced(), 10)
    assert a.now() < a._grace_until
    assert {r.address for r in await a.query(Q3)} == {addr(1), addr(2)}


async def test_every_replica_derives_the_same_heartbeat_secrets(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    assert len(a.heartbeat_key) == 32 and a.heartbeat_key == b.heartbeat_key
    rec = await a.upsert(addr(1), host(), max_per_ip=10)
    await eventually(lambda: b.get(addr(1)) is not None)
    seen = b.get(addr(1))
    assert seen is not None
    assert derive_secret(b.heartbeat_key, seen.token, seen.address) == derive_secret(
        a.heartbeat_key, rec.token, rec.address
    )
    # Redis loses its data: the key is written back, and stays the same.
    key = a.heartbeat_key
    redis_server.kill()
    await asyncio.wait_for(asyncio.gather(a.wait_stale(), b.wait_stale()), 5)
    shutil.rmtree(redis_server.directory)
    redis_server.directory.mkdir()
    redis_server.start()  # empty
    await asyncio.wait_for(asyncio.gather(a.wait_synced(), b.wait_synced()), 10)
    c = await replica(replica_id="c")
    assert a.heartbeat_key == b.heartbeat_key == c.heartbeat_key == key


async def test_a_reload_keeps_the_heartbeat_counters(replica: Factory) -> None:
    a = await replica(replica_id="a")
    b = await replica(replica_id="b")
    await a.upsert(addr(1), host(), max_per_ip=10)
    theirs = await b.upsert(addr(2), host(), max_per_ip=10)
    await eventually(lambda: a.get(addr(2)) is not None)
    for address in (addr(1), addr(2)):
        record = a.get(address)
        assert record is not None
        record.beat = 1000 + address.port
    # A reload builds a fresh index from Redis, which does not store counters.
    await a._resync()
    for address in (addr(1), addr(2)):
        record = a.get(address)
        assert record is not None and record.beat == 1000 + address.port
    # A new registration at the same address starts its counter afresh.
    assert await b.remove(addr(2), RemovalReason.UNREGISTERED, token=theirs.token)
    await b.upsert(addr(2), host("again"), max_per_ip=10)
    await eventually(lambda: (r := a.get(addr(2))) is not None and r.info.name == "again")
    await a._resync()
    again = a.get(addr(2))
    assert again is not None and again.beat == 0


async def test_close_ends_a_notice_loop_whose_cancellation_redis_py_swallowed(
    replica: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py 8.1 turns a cancellation that lands while it connects into a
    # retried connection error; its read then returns None at its timeout, as
    # if nothing had happened.  A worker stuck this way outlived its supervisor.
    swallowed: list[bool] = []
    reading = asyncio.Event()
    real = aioredis.client.PubSub.get_message

    async def swallowing(self: aioredis.client.PubSub, *args: object, **kw: object) -> object:
        reading.set()
        try:
            return await real(self, *args, **kw)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)
            return None

    monkeypatch.setattr(aioredis.client.PubSub, "get_message", swallowing)
    reg = await replica(replica_id="x")
    notices = next(t for t in reg._tasks if t.get_name() == "registry-notices")
    await asyncio.wait_for(reading.wait(), 10)  # the subscription reads
    await asyncio.wait_for(reg.close(), 10)
    assert swallowed == [True]
    assert notices.done()


async def test_a_closing_registry_stops_a_reload_between_two_redis_calls(replica: Factory) -> None:
    # Its sync task may have lost its cancellation inside redis-py: the reload
    # (one Redis call per 500 hosts, then one per host written back) stops anyway.
    x = await replica(replica_id="x")
    for a in many(600):
        await x.upsert(a, host(), max_per_ip=10)
    loads: list[int] = []
    real_op = x._op

    async def op(name: str, call: object, **kw: object) -> object:
        if name == "load":
            loads.append(1)
            x._closing = True  # close() began while the first batch was read
        return await real_op(name, call, **kw)  # type: ignore[arg-type]

    x._op = op  # type: ignore[method-assign]
    with pytest.raises(RegistryUnavailable, match="closing"):
        await x._resync()
    assert loads == [1]


async def test_a_loop_of_redis_calls_ends_at_its_first_cancellation(replica: Factory) -> None:
    # With a socket timeout, redis-py sent each command through asyncio.wait_for,
    # which on Python 3.11 dropped about one cancellation in two of such a loop.
    x = await replica(replica_id="x")
    rng = random.Random(7)

    async def calls() -> None:
        while True:
            await x._op("ping", x._redis.ping())

    for _ in range(5):  # the connection made first: connecting is another matter
        await x._op("ping", x._redis.ping())
    lost = 0
    for _ in range(40):
        task = asyncio.create_task(calls())
        for _ in range(rng.randrange(40)):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        if not done:
            lost += 1
            task.cancel()
            await asyncio.wait([task], timeout=5)
    assert lost == 0


async def test_a_redis_unreachable_from_the_start_is_logged_once_with_its_cause() -> None:
    # Stale from the start, the registry used to say nothing: the warning for going
    # stale was only ever logged by a registry that had been fresh.
    reg = RedisRegistry("redis://127.0.0.1:1/0", retry_interval=0.01, op_timeout=0.5)
    with structlog.testing.capture_logs() as logs:
        await reg.start()
        try:
            for _ in range(500):
                await asyncio.sleep(0.01)
                if any(e["event"] == "registry_stale" for e in logs):
                    break
            await asyncio.sleep(0.2)  # more failed attempts (every 0.01 s): not logged again
        finally:
            await reg.close()
    stale = [e for e in logs if e["event"] == "registry_stale"]
    assert len(stale) == 1, logs
    assert stale[0]["log_level"] == "warning" and stale[0]["loaded"] is False
    assert stale[0]["error"] and stale[0]["detail"]


def big(name: str) -> HostInfo:
    """A host entry of ~1 KB stored (its hash, and again in the change stream)."""
    return host(name, info=b"i" * 512, map="m" * 64)


async def fill_redis(
    a: RedisRegistry, admin: aioredis.Redis, room: int, first: int = 1000
) -> list[Address]:
    """Caps Redis at its memory now plus `room` bytes and registers large hosts until
    Redis refuses one (bounded); returns the hosts that got in."""
    used = int((await admin.info("memory"))["used_memory"])
    await admin.config_set("maxmemory", used + room)
    filler: list[Address] = []
    for i in range(first, first + 20_000):
        try:
            await a.upsert(addr(i, "203.0.113.7"), big(f"filler {i}"), max_per_ip=10**6)
        except RegistryFull:
            return filler
        filler.append(addr(i, "203.0.113.7"))
    raise AssertionError("Redis never refused a registration")


async def test_a_full_redis_refuses_registrations_but_keeps_hosts_alive_and_expiring(
    replica: Factory, redis_server: RedisProcess
) -> None:
    metrics = Metrics(CollectorRegistry())
    kw: dict[str, object] = {"hide_after": 0.5, "expire_after": 1.0, "sweep_gap": 30.0}
    # An observer of three arguments, as OpObserver always took: Redis being full is
    # told to on_full, not through it.
    a = await replica(
        replica_id="a",
        stream_maxlen=100,
        observer=lambda op, seconds, failed: metrics.observe_registry_op(op, seconds, failed),
        on_full=metrics.count_registry_full,
        **kw,
    )
    b = await replica(replica_id="b", stream_maxlen=100, **kw)
    honest = (await a.upsert(addr(1), host("honest"), max_per_ip=10)).address
    await a.expire()  # the very first sweep opens a grace period
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        filler = await fill_redis(a, admin, 256 * 1024)
        assert len(filler) > 10
        # Refused up front, counted, nothing written, nobody stale.
        with pytest.raises(RegistryFull):
            await b.upsert(addr(2), host("late"), max_per_ip=10)
        assert await admin.exists(f"{{mm}}:h:{addr(2).key}") == 0
        mine = a.get(honest)
        assert mine is not None
        with pytest.raises(RegistryFull):
            await a.update(honest, mine.token, host("renamed"))
        # A host registering over the wire is told, and the refusal counted.
        h = Harness(registry=a)
        reply = await h.connect(pub(3)).request(Register(request_id=1, host=host("wire")))
        assert isinstance(reply, Error) and reply.reason is ErrorReason.UNAVAILABLE
        assert h.sample("matchmaker_registrations_total", result="unavailable") == 1
        assert not a.stale and not b.stale
        assert a.refused_full == {"upsert": 2, "update": 1}
        full = metrics.registry.get_sample_value
        assert full("matchmaker_registry_full_total", {"op": "upsert"}) == 2
        assert full("matchmaker_registry_full_total", {"op": "update"}) == 1
        # Heartbeats still land; the filler stops heartbeating and expires, which
        # makes room: registrations are taken again.
        for _ in range(400):
            assert await a.touch({honest: 7}) == set()
            await a.expire()
            await b.expire()
            if await admin.zcard("{mm}:seen") == 1:
                break
            await asyncio.sleep(0.02)
        assert not a.stale and not b.stale
        assert [m async for m in admin.zscan_iter("{mm}:seen")] == [(honest.key.encode(), ANY)]
        assert await admin.hget(f"{{mm}}:h:{honest.key}", "beat") == b"%020d" % 7
        assert not any([await admin.exists(f"{{mm}}:h:{f.key}") for f in filler])
        await eventually(lambda: a.get(filler[0]) is None and b.get(filler[-1]) is None)
        await b.upsert(addr(2), host("late"), max_per_ip=10)
        await eventually(lambda: a.get(addr(2)) is not None)
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()


async def test_a_replica_resyncs_while_redis_is_full(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a", stream_maxlen=100)
    b = await replica(replica_id="b", stream_maxlen=100)
    kept = await a.upsert(addr(1), host("kept"), max_per_ip=10)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await admin.config_set("maxmemory", 1)  # over it from now on
        # Cut off a moment (any failure): what registers meanwhile is kept locally.
        a._mark_stale(RuntimeError("cut off"))
        local = await a.upsert(addr(2), host("while stale"), max_per_ip=10)
        assert a.get(local.address) is not None
        # It reloads over maxmemory; the registration Redis cannot take is dropped
        # (the host registers again), the one Redis holds stays ours.
        await asyncio.wait_for(a.wait_synced(), 10)
        assert not a.stale
        assert a.get(addr(2)) is None and a.get(addr(1)) is not None
        assert [r.address for r in a.owned()] == [kept.address]
        assert await a.touch([addr(1), addr(2)]) == {addr(2)}
        assert await a.expire() == [] and not a.stale and not b.stale
    finally:
        await admin.config_set("maxmemory", 0)
        await admin.aclose()


async def test_relayed_notices_dropped_are_counted(
    replica: Factory, redis_server: RedisProcess
) -> None:
    a = await replica(replica_id="a")
    seen: list[str] = []
    a.on_notice_dropped = seen.append
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        garbage = b"\x93\x01"  # a msgpack array cut short

        async def published() -> bool:
            await admin.publish("{mm}:notice:a", garbage)
            return bool(a.notices_dropped)

        for _ in range(250):  # pub/sub drops what comes before the subscription
            if await published():
                break
            await asyncio.sleep(0.02)
        assert a.notices_dropped.get("malformed", 0) >= 1
        assert seen and set(seen) == {"malformed"}
        # Well formed, but its payload is not bytes: malformed too, never queued.
        # (Handed to the subscription's reader directly: garbage published above may
        # still be on its way, so counting published ones would depend on timing.)
        before = a.notices_dropped["malformed"]
        a._on_notice(msgpack.packb([addr(1).key, 123]))
        assert a.notices_dropped["malformed"] == before + 1
        assert a._notices.empty()
    finally:
        await admin.aclose()
