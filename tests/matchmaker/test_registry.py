"""The Registry contract, run against both implementations, plus the memory
registry's time rules on a stepped clock.  Redis-only behaviour (replicas,
outages) is in test_registry_redis.py."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from matchmaker.addresses import Address, source_key
from matchmaker.listing import matches
from matchmaker.messages import HostEntry, HostInfo, ListFilter, encode_entry
from matchmaker.registry import (
    ChangeKind,
    FeedOverflow,
    HostRecord,
    MemoryRegistry,
    Notice,
    NotRegistered,
    Registry,
    RemovalReason,
    TooManyHosts,
)
from matchmaker.registry.base import COMPACT_MIN, LocalIndex
from matchmaker.registry.memory import SWEEP_ROUNDS, RowIndex
from tests.matchmaker.fakes import FakeClock
from tests.matchmaker.helpers import (
    HOSTS,
    SINGLE_FILTERS,
    TAGS,
    RedisProcess,
    host,
    reference,
    synced_replica,
)

A = Address("198.51.100.1", 27960)
A2 = Address("198.51.100.1", 27961)
A3 = Address("198.51.100.1", 27962)
B = Address("2001:db8::b", 27960)


RegistryFactory = Callable[..., Awaitable[Registry]]


@pytest.fixture(params=["memory", "redis"])
async def make_registry(request: pytest.FixtureRequest) -> AsyncIterator[RegistryFactory]:
    made: list[Registry] = []
    server: RedisProcess | None = None
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")

    async def make(**kw: object) -> Registry:
        reg: Registry
        if server is None:
            reg = MemoryRegistry(**kw)  # type: ignore[arg-type]
            await reg.start()
        else:
            reg = await synced_replica(server.url, **kw)
        made.append(reg)
        return reg

    yield make
    for reg in made:
        await reg.close()


async def test_upsert_get_query(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    rec = await reg.upsert(A, host("one", tags=("ctf",)), max_per_ip=5)
    assert rec.owner == reg.replica_id and rec.token
    assert reg.get(A) == rec
    await reg.upsert(B, host("two", game="ut"), max_per_ip=5)
    assert [r.address for r in await reg.query(ListFilter(game="q3"))] == [A]
    assert await reg.query(ListFilter(game="q3", tags_all=("ffa",))) == []
    assert reg.count_by_game() == {"q3": 1, "ut": 1}
    assert reg.ready and not reg.stale


async def test_restart_replaces_and_old_token_cannot_remove(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    old = await reg.upsert(A, host("old"), max_per_ip=5)
    new = await reg.upsert(A, host("new"), max_per_ip=5)
    assert new.token != old.token
    assert not await reg.remove(A, RemovalReason.DISCONNECTED, token=old.token)
    got = reg.get(A)
    assert got is not None and got.info.name == "new"
    assert await reg.remove(A, RemovalReason.DISCONNECTED, token=new.token)
    assert reg.get(A) is None
    assert not await reg.remove(A, RemovalReason.DISCONNECTED)


async def test_per_ip_cap(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    await reg.upsert(A, host(), max_per_ip=2)
    await reg.upsert(A2, host(), max_per_ip=2)
    with pytest.raises(TooManyHosts):
        await reg.upsert(A3, host(), max_per_ip=2)
    await reg.upsert(A2, host("again"), max_per_ip=2)  # replacing is not adding
    await reg.upsert(B, host(), max_per_ip=2)  # another IP
    await reg.remove(A, RemovalReason.UNREGISTERED)
    await reg.upsert(A3, host(), max_per_ip=2)


async def test_the_host_cap_counts_an_ipv6_slash_64_as_one_source(
    make_registry: RegistryFactory,
) -> None:
    # One IPv6 site holds a whole /64: a cap per address would be no cap at all.
    reg = await make_registry()
    site = [Address(f"2001:db8:1:2::{i:x}", 27960) for i in range(1, 4)]
    await reg.upsert(site[0], host(), max_per_ip=2)
    await reg.upsert(site[1], host(), max_per_ip=2)
    with pytest.raises(TooManyHosts):
        await reg.upsert(site[2], host(), max_per_ip=2)
    await reg.upsert(Address("2001:db8:1:3::1", 27960), host(), max_per_ip=2)  # another /64
    # Leaving frees the slot: the entry left its /64's set too.
    await reg.remove(site[0], RemovalReason.UNREGISTERED)
    await reg.upsert(site[2], host(), max_per_ip=2)


async def test_update(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    rec = await reg.upsert(A, host("before"), max_per_ip=5)
    updated = await reg.update(A, rec.token, host("after", players=3))
    assert updated.info.players == 3 and updated.token == rec.token
    assert [r.info.name for r in await reg.query(ListFilter(game="q3", not_empty=True))] == [
        "after"
    ]
    with pytest.raises(NotRegistered):
        await reg.update(A, "wrong-token", host())
    with pytest.raises(NotRegistered):
        await reg.update(B, rec.token, host())


async def test_touch_reports_unknown_hosts(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    await reg.upsert(A, host(), max_per_ip=5)
    assert await reg.touch([A, B]) == {B}
    assert await reg.touch([]) == set()


async def test_change_feed(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    feed = reg.subscribe()
    rec = await reg.upsert(A, host(), max_per_ip=5)
    await reg.remove(A, RemovalReason.UNREGISTERED, token=rec.token)
    first = await asyncio.wait_for(anext(feed), 2)
    second = await asyncio.wait_for(anext(feed), 2)
    assert (first.kind, first.address, first.record) == (ChangeKind.UPSERT, A, rec)
    assert (second.kind, second.reason) == (ChangeKind.REMOVE, RemovalReason.UNREGISTERED)
    await reg.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(feed), 2)


async def test_slow_subscriber_is_cut_off(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    feed = reg.subscribe(maxsize=3)
    for port in range(1, 6):
        await reg.upsert(Address("198.51.100.9", port), host(), max_per_ip=10)
    with pytest.raises(FeedOverflow):
        for _ in range(5):
            await asyncio.wait_for(anext(feed), 2)


async def test_notice_to_self(make_registry: RegistryFactory) -> None:
    reg = await make_registry()
    await reg.deliver(reg.replica_id, Notice(A, b"payload"))
    assert await asyncio.wait_for(reg.next_notice(), 2) == Notice(A, b"payload")


# ------------------------------------------------------------------ time, on a stepped clock


async def test_hide_then_expire() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(hide_after=15, expire_after=30, clock=clock)
    await reg.upsert(A, host(), max_per_ip=5)
    await reg.upsert(B, host(), max_per_ip=5)
    clock.advance(10)
    await reg.touch([B])
    clock.advance(5.5)  # A silent for 15.5 s, B for 5.5 s
    assert [r.address for r in await reg.query(ListFilter(game="q3"))] == [B]
    assert reg.count_by_game() == {"q3": 1}
    assert await reg.expire() == []  # hidden, not removed
    assert reg.get(A) is not None
    clock.advance(15)  # A silent for 30.5 s
    assert [r.address for r in await reg.expire()] == [A]
    assert reg.get(A) is None and reg.get(B) is not None


async def test_update_counts_as_alive() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(hide_after=15, expire_after=30, clock=clock)
    rec = await reg.upsert(A, host(), max_per_ip=5)
    clock.advance(14)
    await reg.update(A, rec.token, host("renamed"))
    clock.advance(14)
    assert len(await reg.query(ListFilter(game="q3"))) == 1


def test_hide_must_not_exceed_expire() -> None:
    with pytest.raises(ValueError):
        MemoryRegistry(hide_after=30, expire_after=15)


# ------------------------------------------------------------------ the list index


async def test_a_heartbeat_moves_last_seen_in_place() -> None:
    # No new record per heartbeat: a view of the host sees its new time.
    clock = FakeClock()
    reg = MemoryRegistry(clock=clock)
    rec = await reg.upsert(A, host(), max_per_ip=5)
    clock.advance(3)
    assert await reg.touch([A]) == set()
    again = reg.get(A)
    assert again is not None and again.last_seen == rec.last_seen == clock.now
    rec.beat = 7  # written through to the row's slot, as the heartbeat code does
    assert again.beat == 7


async def test_a_listed_host_is_nothing_for_the_collector_to_trace() -> None:
    # Its row is a tuple of atomic values, untracked once a collection has seen it:
    # collections do not grow with the fleet (memory.py, "What a listed host costs").
    reg = MemoryRegistry()
    gc.collect()
    before = len(gc.get_objects())
    n = 2_000
    for e in HOSTS[:n]:
        rec = await reg.upsert(e.address, e.info, max_per_ip=10**6)
        rec.entry = b"listed"  # what a registration keeps
    first = reg.get(HOSTS[0].address)
    assert first is not None
    await reg.update(first.address, first.token, replace(first.info, players=1))
    del rec, first
    # A collection untracks a tuple once the tuples it holds are untracked: a row
    # met before its (new) tag tuple in one pass is untracked by the next.
    gc.collect()
    gc.collect()
    assert len(gc.get_objects()) - before < n // 10  # was 3 objects per host: 6,000
    assert not any(gc.is_tracked(row) for row in reg.index().rows())


async def test_a_listing_reads_entries_and_sources_from_the_rows() -> None:
    # What a list sends, without a record per host: the same sample as `sample`,
    # each entry the one kept (or encoded now, and kept), each source its host's.
    reg = MemoryRegistry()
    for i, e in enumerate(HOSTS[:300]):
        rec = await reg.upsert(e.address, e.info, max_per_ip=10**6)
        if i % 2:
            rec.entry = encode_entry(HostEntry(address=rec.address, info=rec.info))
    kept = reg.get(HOSTS[1].address)
    assert kept is not None
    await reg.update(kept.address, kept.token, replace(kept.info, players=2))
    for f in (ListFilter(game="q3"), *SINGLE_FILTERS):
        records = await reg.sample(f, 50, random.Random(3))
        listing = await reg.sample_listing(f, 50, random.Random(3))
        assert [listing.record(i).address for i in range(len(records))] == [
            r.address for r in records
        ]
        assert listing.entries == [
            encode_entry(HostEntry(address=r.address, info=r.info)) for r in records
        ]
        assert listing.sources == [source_key(r.address.ip) for r in records]
        assert all(r.entry == e for r, e in zip(records, listing.entries, strict=True))


async def test_an_update_moves_a_host_between_index_arrays_only_when_its_keys_move() -> None:
    reg = MemoryRegistry()
    for e in HOSTS[:50]:
        info = replace(e.info, game="q3", region="eu", players=1, max_players=8)
        await reg.upsert(e.address, info, max_per_ip=10**6)
    rec = reg.get(HOSTS[0].address)
    assert rec is not None
    rec.beat = 9
    slot = reg.index()._by_address[f"{rec.address.ip} {rec.address.port}"]
    await reg.update(rec.address, rec.token, replace(rec.info, players=2, name="renamed"))
    assert reg.index()._by_address[f"{rec.address.ip} {rec.address.port}"] == slot  # same arrays
    renamed = reg.get(rec.address)
    assert renamed is not None and renamed.info.players == 2
    row = reg.index()._rows[slot]
    await reg.update(rec.address, rec.token, replace(renamed.info, players=3))
    assert reg.index()._rows[slot] is row  # the player count alone: the row stays
    assert renamed.info.players == 3  # read from the slot, as last_seen
    await reg.update(rec.address, rec.token, replace(renamed.info, region="us"))
    moved = reg.get(rec.address)
    assert moved is not None and moved.beat == 9 and moved.info.name == "renamed"
    for region, want in (("eu", 49), ("us", 1)):
        listed = await reg.query(ListFilter(game="q3", region=region))
        assert len(listed) == want and len({r.address for r in listed}) == want


async def test_the_index_agrees_with_a_scan_through_registrations_updates_and_removals() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(hide_after=15, expire_after=30, clock=clock)
    rng = random.Random(4)
    tokens: dict[Address, str] = {}
    for e in HOSTS[:600]:
        tokens[e.address] = (await reg.upsert(e.address, e.info, max_per_ip=10**6)).token
    for step in range(900):
        e = rng.choice(HOSTS)
        op = rng.random()
        if e.address not in tokens or op < 0.2:
            tokens[e.address] = (await reg.upsert(e.address, e.info, max_per_ip=10**6)).token
        elif op < 0.6:
            cur = reg.get(e.address)
            assert cur is not None
            info = replace(cur.info, players=rng.randrange(cur.info.max_players + 1))
            info = replace(info, tags=tuple(rng.sample(TAGS, rng.randrange(3))))
            await reg.update(e.address, tokens[e.address], info)
        elif op < 0.8:
            await reg.remove(e.address, RemovalReason.UNREGISTERED, token=tokens.pop(e.address))
        else:
            await reg.touch([e.address])
        if step % 100 == 0:
            clock.advance(4)  # some hosts go hidden
    now = reg.now()
    records = list(reg.index())
    for f in SINGLE_FILTERS:
        want = {r.address for r in records if reg.is_visible(r, now) and reference(r, f)}
        assert {r.address for r in await reg.query(f)} == want, f
        sample = await reg.sample(f, 20, rng)
        assert len(sample) == min(20, len(want)) == len({r.address for r in sample})
        assert {r.address for r in sample} <= want


def _index_record(i: int, seen: float = 0.0, **kw: object) -> HostRecord:
    address = Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960)
    info = host(f"h{i}", **kw)  # type: ignore[arg-type]
    return HostRecord(
        address=address, info=info, owner="r", token=f"t{i}", registered_at=seen, last_seen=seen
    )


def _slots(index: LocalIndex, game: str) -> list[list[HostRecord]]:
    found = index._by_game.get(game)
    return [] if found is None else [found.all.items, *(a.items for a in found.keys.values())]


def test_the_index_keeps_no_position_per_host_and_compacts_what_left() -> None:
    # A removed or replaced record stays in its arrays as a ghost until ghosts are
    # an eighth of an array; readers skip ghosts, so lists never show a host twice or gone.
    index = LocalIndex()
    rng = random.Random(7)
    regions = ("eu", "us")
    live: dict[int, HostRecord] = {}
    for step in range(6_000):
        i = rng.randrange(400)
        if i in live and rng.random() < 0.5:
            assert index.pop(live.pop(i).address) is not None
        else:
            live[i] = _index_record(i, region=rng.choice(regions), players=rng.randrange(3))
            index.put(live[i])
        if step % 500 == 0:
            for items in _slots(index, "q3"):
                assert len(items) <= len(live) + len(live) // 7 + COMPACT_MIN
    assert sorted(map(id, index.game("q3"))) == sorted(map(id, live.values()))
    for f in (ListFilter(game="q3"), ListFilter(game="q3", region="eu", not_empty=True)):
        candidates, rest = index.candidates(f)
        current = [r for r in candidates if index.current(r) and (rest is None or matches(r, rest))]
        assert len(current) == len(set(map(id, current)))  # no host twice
        assert {id(r) for r in current} == {
            id(r) for r in live.values() if reference(r, replace(f, limit=10**6))
        }
    for r in list(live.values()):
        index.pop(r.address)
    assert index._by_game == {} and index._by_source == {} and len(index) == 0


def test_a_record_put_back_after_its_removal_is_listed_once() -> None:
    # (A registry reloading puts records it had back: the ghost of its first stay
    # must not make it appear twice.)
    index = LocalIndex()
    records = [_index_record(i) for i in range(3 * COMPACT_MIN)]
    for r in records:
        index.put(r)
    again = records[5]
    index.pop(again.address)
    assert again.home is None and index.source_count(again.address.ip) == 0
    index.put(again)
    assert again.home is index and index.source_count(again.address.ip) == 1
    candidates, _ = index.candidates(ListFilter(game="q3"))
    assert sorted(id(r) for r in candidates if index.current(r)) == sorted(map(id, records))
    assert sum(r is again for items in _slots(index, "q3") for r in items) == len(
        _slots(index, "q3")
    )


async def test_a_host_registered_again_after_its_removal_is_listed_once() -> None:
    # Its new row may take the slot its old one left, whose ghost is still in the
    # arrays: readers tell them apart.
    reg = MemoryRegistry()
    hosts = HOSTS[: 3 * COMPACT_MIN]
    for e in hosts:
        await reg.upsert(e.address, e.info, max_per_ip=10**6)
    for e in hosts[:5]:
        await reg.remove(e.address, RemovalReason.UNREGISTERED)
        await reg.upsert(e.address, e.info, max_per_ip=10**6)
    for f in SINGLE_FILTERS:
        listed = await reg.sample(f, 10**6, random.Random(1))
        want = [e.address for e in hosts if reference(e, f)]
        assert sorted(r.address for r in listed) == sorted(want), f


def test_the_row_index_compacts_what_left_and_lists_each_host_once() -> None:
    index = RowIndex()
    rng = random.Random(7)
    regions = ("eu", "us")
    live: dict[int, HostRecord] = {}
    for step in range(6_000):
        i = rng.randrange(400)
        if i in live and rng.random() < 0.5:
            assert index.pop(live.pop(i).address) is not None
        else:
            live[i] = _index_record(i, region=rng.choice(regions), players=rng.randrange(3))
            index.put(live[i])
        if step % 500 == 0:
            found = index._by_game["q3"]
            for rows in [found.all, *found.keys.values()]:
                assert len(rows.items) <= len(live) + len(live) // 7 + COMPACT_MIN
    for f in (ListFilter(game="q3"), ListFilter(game="q3", region="eu", not_empty=True)):
        candidates, _ = index.candidates(f)
        rows = [index._rows[s] for s in candidates]
        current = [index.view(r) for r in rows if r is not None]
        current = [r for r in current if reference(r, replace(f, limit=10**6))]
        assert len(current) == len({r.address for r in current})  # no host twice
        assert {r.address for r in current} == {
            r.address for r in live.values() if reference(r, replace(f, limit=10**6))
        }
    for r in list(live.values()):
        index.pop(r.address)
    assert index._by_game == {} and index._by_source == {} and len(index) == 0
    # Every slot is free again (none held by a ghost), and reused before the table grows.
    assert sorted(index._free) == list(range(len(index._rows)))
    assert max(index._ghosts) == 0


def test_a_key_no_row_holds_any_more_leaves_the_index() -> None:
    # Tags, map and region are the host's to choose: one host that keeps changing
    # them (while another keeps its game alive) must not leave an array per value.
    index = RowIndex()
    index.put(_index_record(0, region="eu"))
    for step in range(500):
        r = _index_record(1, region=f"r{step}", map=f"m{step}", tags=(f"t{step}",))
        index.pop(r.address)
        index.put(r)
    game = index._by_game["q3"]
    assert len(game.keys) <= 16  # host 0's keys and host 1's current ones
    assert len(index._rows) <= 2 * COMPACT_MIN  # slots are reused once compacted


async def test_a_list_sample_reads_about_limit_hosts_whatever_the_registry_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = MemoryRegistry()
    regions = ("eu", "us", "asia")
    for i in range(20_000):
        info = host(f"h{i}", region=regions[i % 3], players=i % 9)
        await reg.upsert(Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960), info, max_per_ip=5)
    read = 0
    real = reg.index().candidates

    class Counted(Sequence[HostRecord]):
        def __init__(self, items: Sequence[HostRecord]) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> HostRecord:  # type: ignore[override]
            nonlocal read
            read += 1
            return self.items[i]

    def counting(f: ListFilter) -> tuple[Sequence[HostRecord], ListFilter | None]:
        candidates, rest = real(f)
        return Counted(candidates), rest

    monkeypatch.setattr(reg.index(), "candidates", counting)
    rng = random.Random(1)
    for f in (ListFilter(game="q3", region="eu"), ListFilter(game="q3", not_full=True)):
        read = 0
        got = await reg.sample(f, 100, rng)
        assert len(got) == 100 and all(reference(r, f) for r in got)
        assert read < 300, (f, read)  # of 6,667 and 20,000 candidates


async def test_one_expiry_sweep_reads_a_slice_of_a_large_registry_and_all_within_ten() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(hide_after=15, expire_after=30, clock=clock)
    n = 60_000
    for i in range(n):
        await reg.upsert(Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960), host(), max_per_ip=5)
    clock.advance(31)
    first = await reg.expire()
    assert len(first) == n // SWEEP_ROUNDS  # not everyone at once: a bounded stall
    removed = len(first)
    for _ in range(SWEEP_ROUNDS - 1):
        removed += len(await reg.expire())
    assert removed == n and len(reg.index()) == 0


# -- a list examines a bounded number of hosts, whatever its filter


class _Counted(Sequence[object]):
    """An index array that counts the candidates read from it."""

    def __init__(self, items: Sequence[object], counter: list[int]) -> None:
        self.items = items
        self.counter = counter

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> object:  # type: ignore[override]
        self.counter[0] += 1
        return self.items[i]


class _CountedSeen:
    """The memory index's last-seen array, counting the reads: every slot a list
    examines is read there first, from whichever array it was drawn."""

    def __init__(self, seen: Sequence[float]) -> None:
        self.seen = seen
        self.reads = 0

    def __len__(self) -> int:
        return len(self.seen)

    def __getitem__(self, slot: int) -> float:
        self.reads += 1
        return self.seen[slot]


# Filters no index array covers, none of which any host passes.
NO_MATCH = [
    ListFilter(game="q3", name="\u00df" * 64),
    ListFilter(game="q3", password=True),
    ListFilter(game="q3", tags_any=tuple(f"zz{k:02d}" for k in range(16))),
    ListFilter(game="q3", tags_any=tuple(f"zz{k:02d}" for k in range(16)), name="Q" * 64),
    ListFilter(game="q3", not_full=True, name="Q" * 64),
]


async def _fleet(reg: Registry, n: int) -> None:
    rng = random.Random(n)
    for i in range(n):
        info = host(
            f"Server number {i}",
            players=rng.randrange(0, 9),
            tags=tuple(t for t in ("ctf", "ffa", "insta") if rng.random() < 0.5),
        )
        address = Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960)
        await reg.upsert(address, info, max_per_ip=10**6)


@pytest.mark.parametrize("limit", [1, 100])
async def test_a_list_examines_at_most_its_budget_whatever_the_filter(
    make_registry: RegistryFactory, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    # 6,000 hosts, a filter none passes: a pass over the game read them all (plus
    # the batches before it). A request for at most 100 hosts examines 4,096.
    reg = await make_registry()
    await _fleet(reg, 6000)
    read = [0]
    index: Any = reg.index()
    real = index.candidates
    monkeypatch.setattr(index, "candidates", lambda f: (_Counted(real(f)[0], read), real(f)[1]))
    for f in NO_MATCH:
        read[0] = 0
        assert await reg.sample(f, limit, random.Random(1)) == []
        assert read[0] <= 4096, (f, read[0])
        listing = await reg.sample_listing(f, limit, random.Random(1))
        assert listing.entries == []
        # The name and password filters stopped looking: the answer says it may
        # have left matches out. No host has any of those tags: nothing was left.
        assert listing.complete is bool(f.tags_any), f


async def test_a_list_examines_at_most_its_budget_in_the_memory_registry() -> None:
    # Counted where every examined slot is read, whichever array it came from.
    reg = MemoryRegistry()
    await _fleet(reg, 20_000)
    rare = Address("198.51.100.7", 1)
    await reg.upsert(rare, host("rare", tags=("rare1", "ctf")), max_per_ip=10)
    index = reg.index()
    seen = index._seen
    try:
        counted = index._seen = _CountedSeen(seen)  # type: ignore[assignment]
        for f in NO_MATCH:
            for limit in (1, 1000):
                counted.reads = 0
                assert await reg.sample(f, limit, random.Random(1)) == []
                assert counted.reads <= max(4096, 8 * limit), (f, limit, counted.reads)
        # A rare tag among unknown ones: read from its array, not from the game's.
        counted.reads = 0
        f = ListFilter(game="q3", tags_any=("nope", "rare1", "other"))
        assert [r.address for r in await reg.sample(f, 1000, random.Random(1))] == [rare]
        assert counted.reads <= 8
    finally:
        index._seen = seen


async def test_tags_any_lists_what_a_scan_of_every_host_finds(
    make_registry: RegistryFactory,
) -> None:
    # Hosts with several tags are in several tag arrays: each is listed once, and
    # every list agrees with a filter of every host, through updates and removals
    # (ghosts in the arrays).
    reg = await make_registry()
    rng = random.Random(21)
    pool = ("a", "b", "c", "d", "e", "f")
    weights = (0.5, 0.3, 0.1, 0.05, 0.02, 0.0)  # "f": no host; "e": a few
    tokens: dict[Address, str] = {}

    def random_info(i: int) -> HostInfo:
        return host(
            f"h{i} {rng.choice(('alpha', 'beta'))}",
            game=rng.choice(("q3", "q3", "q3", "ut")),
            region=rng.choice(("eu", "us")),
            players=rng.randrange(0, 9),
            tags=tuple(t for t, w in zip(pool, weights, strict=True) if rng.random() < w),
        )

    addresses = [Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960) for i in range(500)]
    for i, a in enumerate(addresses):
        tokens[a] = (await reg.upsert(a, random_info(i), max_per_ip=10**6)).token
    for _ in range(300):
        a = rng.choice(addresses)
        if a not in tokens:
            tokens[a] = (await reg.upsert(a, random_info(0), max_per_ip=10**6)).token
        elif rng.random() < 0.5:
            await reg.update(a, tokens[a], random_info(1))
        else:
            await reg.remove(a, RemovalReason.UNREGISTERED, token=tokens.pop(a))
    current = [r for r in (reg.get(a) for a in addresses) if r is not None]
    for _ in range(60):
        tags_any = tuple(rng.sample((*pool, "nope"), rng.randrange(1, 5)))
        extra: dict[str, Any] = rng.choice(
            [{}, {"region": "eu"}, {"not_full": True}, {"name": "ALPHA"}, {"tags_all": ("a",)}]
        )
        f = ListFilter(game="q3", tags_any=tags_any, **extra)
        want = {r.address for r in current if matches(r, f)}
        assert {r.address for r in await reg.query(f)} == want, f
        for limit in (1, 7, 1000):
            got = [r.address for r in await reg.sample(f, limit, rng)]
            assert len(got) == len(set(got)) == min(limit, len(want)), (f, limit)
            assert set(got) <= want


async def test_tags_any_from_the_tag_arrays_draws_every_host_as_often() -> None:
    # 40 hosts with both tags are in both arrays, 40 in one each: each one is
    # drawn ~1/4 of the time (10 of 120), whichever arrays it is in.
    reg = MemoryRegistry()
    tags = [("a", "b")] * 40 + [("a",)] * 40 + [("b",)] * 40 + [()] * 400
    both = set()
    for i, t in enumerate(tags):
        address = Address(f"198.18.{i // 250}.{i % 250 + 1}", 27960)
        await reg.upsert(address, host(f"h{i}", tags=t), max_per_ip=10**6)
        if len(t) == 2:
            both.add(address)
    rng = random.Random(3)
    drawn: dict[Address, int] = {}
    f = ListFilter(game="q3", tags_any=("a", "b"))
    for _ in range(2000):
        for r in await reg.sample(f, 10, rng):
            drawn[r.address] = drawn.get(r.address, 0) + 1
    assert len(drawn) == 120
    assert all(110 < n < 230 for n in drawn.values()), sorted(drawn.values())
    assert 6000 < sum(drawn[a] for a in both) < 7400  # a third of the 20,000 draws
