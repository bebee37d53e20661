from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import matchmaker.listing as listing
from matchmaker.addresses import Address, source_key
from matchmaker.listing import (
    filter_keys,
    index_keys,
    matches,
    paginate,
    rest_of,
    sample_matching,
    select,
    shuffled,
    split_by_size,
)
from matchmaker.messages import ListFilter
from tests.matchmaker.helpers import (
    GAMES,
    HOSTS,
    MAPS,
    REGIONS,
    SINGLE_FILTERS,
    TAGS,
    VERSIONS,
    Entry,
    reference,
)


@pytest.mark.parametrize("f", SINGLE_FILTERS, ids=repr)
def test_each_filter_matches_reference(f: ListFilter) -> None:
    got = select(HOSTS, f)
    assert got == [e for e in HOSTS if reference(e, f)]


def test_every_filter_selects_something_and_not_everything() -> None:
    # Guards the dataset: a filter that matches all or nothing would test little.
    for f in SINGLE_FILTERS:
        if f.game == "none" or f.name == "zzz":
            continue
        n = len(select(HOSTS, f))
        assert 0 < n < len(HOSTS), f


filters = st.builds(
    ListFilter,
    game=st.sampled_from(GAMES),
    version=st.none() | st.sampled_from(VERSIONS),
    map=st.none() | st.sampled_from(MAPS),
    region=st.none() | st.sampled_from(REGIONS),
    not_full=st.booleans(),
    not_empty=st.booleans(),
    password=st.none() | st.booleans(),
    tags_all=st.lists(st.sampled_from(TAGS), max_size=2, unique=True).map(tuple),
    tags_any=st.lists(st.sampled_from(TAGS), max_size=3, unique=True).map(tuple),
    name=st.none() | st.sampled_from(("a", "ALPHA", "o #1", "x")),
    family=st.none() | st.sampled_from((4, 6)),
)


@settings(max_examples=150, deadline=None)
@given(filters)
def test_combined_filters_match_reference(f: ListFilter) -> None:
    assert all(matches(e, f) == reference(e, f) for e in HOSTS)


# ------------------------------------------------------------------ order and pages


def test_shuffle_is_fresh_and_fair() -> None:
    rng = random.Random(7)
    entries = HOSTS[:10]
    first = Counter(shuffled(entries, rng)[0].address for _ in range(5000))
    # Each of 10 hosts should be first ~500 times; 350..650 is > 6 sigma wide.
    assert set(first) == {e.address for e in entries}
    assert all(350 < n < 650 for n in first.values()), first


def test_limit_is_a_random_sample() -> None:
    rng = random.Random(3)
    a = shuffled(HOSTS, rng, limit=20)
    b = shuffled(HOSTS, rng, limit=20)
    assert len(a) == len(b) == 20 and a != b
    assert len(set(map(id, a))) == 20
    assert len(shuffled(HOSTS[:5], rng, limit=20)) == 5


def check_pages(entries: list[Entry], pages: list[list[Entry]], size: int, cap: int) -> None:
    flat = [e for p in pages for e in p]
    assert sorted(map(id, flat)) == sorted(map(id, entries))  # each exactly once
    for page in pages:
        assert 0 < len(page) <= size
        assert max(Counter(source_key(e.address.ip) for e in page).values()) <= cap


def test_paginate_1000_hosts() -> None:
    order = shuffled(HOSTS, random.Random(5))
    pages = paginate(order, 32, 2)
    check_pages(order, pages, 32, 2)
    # Plenty of distinct IPs: all pages but the tail are full.
    assert all(len(p) == 32 for p in pages[:-3])


def test_paginate_one_ip_floods() -> None:
    flood = [Entry(Address("198.51.100.1", p), HOSTS[0].info) for p in range(1, 41)]
    others = HOSTS[:20]
    order = flood + others  # the flooder came first in the shuffle
    pages = paginate(order, 10, 2)
    check_pages(order, pages, 10, 2)
    # The first page has 2 flood entries and is then filled by the others.
    assert sum(e.address.ip == "198.51.100.1" for e in pages[0]) == 2
    assert len(pages[0]) == 10


def test_paginate_counts_an_ipv6_slash_64_as_one_source() -> None:
    # A site rotating through its /64 is still one source for the page cap.
    flood = [Entry(Address(f"2001:db8:5:6::{i:x}", 27960), HOSTS[0].info) for i in range(1, 9)]
    pages = paginate(flood + HOSTS[:20], 10, 2)
    assert sum(e.address.ip.startswith("2001:db8:5:6:") for e in pages[0]) == 2
    assert len(pages[0]) == 10


def test_paginate_keeps_order_of_deferred_entries() -> None:
    a = [Entry(Address("198.51.100.1", p), HOSTS[0].info) for p in (1, 2, 3)]
    b = [Entry(Address("198.51.100.2", p), HOSTS[0].info) for p in (1, 2)]
    pages = paginate([a[0], a[1], a[2], b[0], b[1]], 3, 2)
    assert pages == [[a[0], a[1], b[0]], [a[2], b[1]]]


def test_paginate_edge_cases() -> None:
    assert paginate([], 10, 2) == []
    with pytest.raises(ValueError):
        paginate(HOSTS, 0, 1)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=60),
    st.integers(1, 8),
    st.integers(1, 3),
)
def test_paginate_properties(ips: list[int], size: int, cap: int) -> None:
    entries = [
        Entry(Address(f"198.51.100.{ip + 1}", i + 1), HOSTS[0].info) for i, ip in enumerate(ips)
    ]
    check_pages(entries, paginate(entries, size, cap), size, cap)


def test_split_by_size() -> None:
    entries = HOSTS[:10]
    pages = split_by_size(entries, 100, lambda e: 30)
    assert [len(p) for p in pages] == [3, 3, 3, 1]
    assert [e for p in pages for e in p] == entries
    assert split_by_size(entries[:2], 10, lambda e: 50) == [[entries[0]], [entries[1]]]
    assert split_by_size([], 10, lambda e: 1) == []


# ------------------------------------------------------------------ indexed lists


@settings(max_examples=150, deadline=None)
@given(filters)
def test_filter_keys_narrow_without_losing_a_match(f: ListFilter) -> None:
    # A host matches f exactly when it is listed under the key and passes the rest.
    for key, rest in filter_keys(f):
        for e in HOSTS:
            if e.info.game != f.game:
                continue
            listed = key in index_keys(e.info)
            assert matches(e, f) == (listed and (rest is None or matches(e, rest))), (key, e)


def test_a_filter_on_the_game_alone_has_no_rest() -> None:
    assert rest_of(ListFilter(game="q3", limit=5)) is None
    assert rest_of(ListFilter(game="q3", password=True)) is not None
    assert filter_keys(ListFilter(game="q3", family=4, name="x")) == []


class CountingKeep:
    def __init__(self, keep: Callable[[int], bool]) -> None:
        self.keep = keep
        self.calls = 0

    def __call__(self, x: int) -> bool:
        self.calls += 1
        return self.keep(x)


@pytest.mark.parametrize(
    ("n", "every", "limit"),
    [(100_000, 1, 1000), (100_000, 3, 1000), (50_000, 50, 100), (30, 2, 10), (1000, 1, 5000)],
)
def test_sample_matching_is_exact(n: int, every: int, limit: int) -> None:
    rng = random.Random(n + every + limit)
    items = list(range(n))
    kept = n // every if n % every == 0 else n // every + 1
    for _ in range(3):
        got = sample_matching(items, lambda x: x % every == 0, limit, rng)
        assert len(got) == min(limit, kept) == len(set(got))
        assert all(x % every == 0 for x in got)


def test_sample_matching_reads_about_limit_items_not_all_of_them() -> None:
    rng = random.Random(2)
    items = list(range(100_000))
    everything = CountingKeep(lambda x: True)
    sample_matching(items, everything, 1000, rng)
    assert everything.calls <= 1300
    # A third kept: a second, bigger batch, still far from a full pass.
    third = CountingKeep(lambda x: x % 3 == 0)
    assert len(sample_matching(items, third, 1000, rng)) == 1000
    assert third.calls <= 10_000


def test_sample_matching_is_uniform() -> None:
    # 40 kept of 120; samples of 5. Every kept item should be drawn 5/40 of the
    # time and come first 1/40 of the time (4000 samples: 500 and 100 expected).
    rng = random.Random(11)
    items = list(range(120))
    drawn: Counter[int] = Counter()
    first: Counter[int] = Counter()
    for _ in range(4000):
        got = sample_matching(items, lambda x: x % 3 == 0, 5, rng)
        drawn.update(got)
        first[got[0]] += 1
    assert set(drawn) == set(range(0, 120, 3))
    assert all(400 < c < 600 for c in drawn.values()), drawn
    assert all(55 < c < 150 for c in first.values()), first
    # And through the batch path: 10 of 100,000, everything kept.
    big = list(range(100_000))
    halves = Counter(x < 50_000 for _ in range(500) for x in sample_matching(big, bool, 10, rng))
    assert 2300 < halves[True] < 2700, halves


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.integers(1, 20), st.integers(0, 400), st.integers(0, 2**32))
def test_sample_matching_properties(n: int, every: int, limit: int, seed: int) -> None:
    items = list(range(n))
    got = sample_matching(items, lambda x: x % every == 0, limit, random.Random(seed))
    kept = len(range(0, n, every))
    assert len(got) == min(limit, kept) == len(set(got))
    assert all(x % every == 0 for x in got)


def test_a_draw_tests_at_most_its_budget_and_says_when_it_left_matches_out() -> None:
    rng = random.Random(5)
    items = list(range(100_000))
    rare = CountingKeep(lambda x: x % 1000 == 0)  # 100 kept
    found = listing.draw_matching([(items, rare)], 50, rng, 5000)
    assert rare.calls <= 5000 and found.examined <= 5000
    assert not found.complete and len(found.items) < 50
    assert all(x % 1000 == 0 for x in found.items) and len(set(found.items)) == len(found.items)
    # None kept: the budget, not a pass over the 100,000.
    nothing = CountingKeep(lambda x: False)
    found = listing.draw_matching([(items, nothing)], 1, rng, 4096)
    assert (found.items, found.complete) == ([], False) and nothing.calls <= 4096
    # Enough kept within the budget, or few enough items for a pass: complete.
    common = CountingKeep(lambda x: x % 2 == 0)
    found = listing.draw_matching([(items, common)], 100, rng, 5000)
    assert found.complete and len(found.items) == 100 and common.calls <= 5000
    small = list(range(4000))
    rare = CountingKeep(lambda x: x % 1000 == 0)
    found = listing.draw_matching([(small, rare)], 50, rng, 4096)
    assert found.complete and sorted(found.items) == [0, 1000, 2000, 3000]
    assert rare.calls <= 4096


def test_a_request_may_examine_a_small_multiple_of_its_limit() -> None:
    assert listing.scan_budget(1) == listing.SCAN_MIN
    assert listing.scan_budget(1000) == 1000 * listing.SCAN_PER_HOST
    assert listing.scan_budget(10_000) <= 100_000


def test_a_partial_draw_is_uniform_too() -> None:
    # 100 kept of 200, 50 positions examined: each kept item found 25 % of the time.
    rng = random.Random(8)
    items = list(range(200))
    found: Counter[int] = Counter()
    for _ in range(2000):
        drawn = listing.draw_matching([(items, lambda x: x % 2 == 0)], 1000, rng, 50)
        assert not drawn.complete and len(drawn.items) <= 50
        found.update(drawn.items)
    assert set(found) == set(range(0, 200, 2))
    assert all(420 < c < 580 for c in found.values()), found


class RecordingKeep(CountingKeep):
    """A keep that also remembers which of the items it tested it kept."""

    def __init__(self, keep: Callable[[int], bool]) -> None:
        super().__init__(keep)
        self.kept: set[int] = set()

    def __call__(self, x: int) -> bool:
        ok = super().__call__(x)
        if ok:
            self.kept.add(x)
        return ok


def test_a_draw_answers_with_every_match_it_examined() -> None:
    # 13.5 % of 100,000 kept, limit 1,000, budget 8,000: the budget holds ~1,080
    # matches, so (nearly) every answer is complete; one that is not holds every
    # match the draw tested.  (Keeping only the last batch's matches, no answer of
    # 50 was complete: ~880 hosts each.)
    n, limit, budget = 100_000, 1000, listing.scan_budget(1000)
    chosen = set(random.Random(1).sample(range(n), n * 135 // 1000))
    items = list(range(n))
    complete = 0
    for seed in range(50):
        keep = RecordingKeep(chosen.__contains__)
        drawn = listing.draw_matching([(items, keep)], limit, random.Random(seed), budget)
        assert keep.calls <= budget and drawn.examined <= budget
        assert len(set(drawn.items)) == len(drawn.items) and set(drawn.items) <= keep.kept
        if drawn.complete:
            assert len(drawn.items) == limit
            complete += 1
        else:
            assert set(drawn.items) == keep.kept and keep.calls == budget
    assert complete >= 48, complete
    # A filter no examined item passes often enough still spends the whole budget.
    keep = RecordingKeep(lambda x: x % 10 == 0)
    drawn = listing.draw_matching([(items, keep)], limit, random.Random(99), budget)
    assert not drawn.complete and keep.calls == drawn.examined == budget
    assert set(drawn.items) == keep.kept and 700 < len(drawn.items) < 900


def test_a_draw_over_several_batches_is_uniform() -> None:
    # 2,000 kept of 20,000 (every tenth), limit 40, budget 4,096: the answer takes
    # several batches, and their matches together.  Every tenth of the items should
    # be drawn equally often, and as often first.
    rng = random.Random(12)
    items = list(range(20_000))
    drawn_in: Counter[int] = Counter()
    first: Counter[int] = Counter()
    for _ in range(2000):
        drawn = listing.draw_matching([(items, lambda x: x % 10 == 0)], 40, rng, 4096)
        assert drawn.complete and len(drawn.items) == 40
        drawn_in.update(x // 2000 for x in drawn.items)
        first[drawn.items[0] // 2000] += 1
    assert all(7400 < c < 8600 for c in drawn_in.values()), drawn_in  # 8,000 expected
    assert all(150 < c < 250 for c in first.values()), first  # 200 expected
    # 50 kept of 400, budget 160: ~20 matches examined, so some answers are
    # complete and some partial; every kept item is drawn as often either way.
    small = list(range(400))
    found: Counter[int] = Counter()
    outcomes: Counter[bool] = Counter()
    for _ in range(3000):
        drawn = listing.draw_matching([(small, lambda x: x % 8 == 0)], 20, rng, 160)
        outcomes[drawn.complete] += 1
        found.update(drawn.items)
    assert outcomes[True] > 300 and outcomes[False] > 300, outcomes
    assert set(found) == set(range(0, 400, 8))
    mean = sum(found.values()) / 50
    assert all(abs(c - mean) < 0.15 * mean for c in found.values()), (mean, found)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 400), min_size=1, max_size=4),
    st.integers(1, 7),
    st.integers(0, 300),
    st.one_of(st.none(), st.integers(0, 600)),
    st.integers(0, 2**32),
)
def test_draw_matching_over_several_arrays_properties(
    sizes: list[int], every: int, limit: int, budget: int | None, seed: int
) -> None:
    # Several arrays drawn as one, each with its own test; within the budget (or
    # without one) the answer is exact, and it never tests more than the budget.
    parts: list[tuple[list[int], CountingKeep]] = []
    kept: set[int] = set()
    start = 0
    for k, n in enumerate(sizes):
        items = list(range(start, start + n))
        parts.append((items, CountingKeep(lambda x, k=k: x % every == k % every)))
        kept |= {x for x in items if x % every == k % every}
        start += n
    drawn = listing.draw_matching(parts, limit, random.Random(seed), budget)
    calls = sum(keep.calls for _, keep in parts)
    assert set(drawn.items) <= kept and len(set(drawn.items)) == len(drawn.items)
    assert len(drawn.items) <= limit
    if budget is not None:
        assert calls <= budget and drawn.examined <= budget
    if budget is None or start <= budget:
        assert drawn.complete
    if drawn.complete:
        assert len(drawn.items) == min(limit, len(kept))


def test_paginate_takes_the_source_from_the_caller() -> None:
    entries = HOSTS[:6]
    # Every entry declared to come from one source: at most 2 per page.
    pages = paginate(entries, 4, 2, lambda e: "one")
    assert [len(p) for p in pages] == [2, 2, 2]
    assert [e for p in pages for e in p] == entries


def paginate_one_step_at_a_time(entries: list[Entry], size: int, cap: int) -> list[list[Entry]]:
    """`paginate` as first written: one entry at a time, deferred ones first next page."""
    pending = deque(entries)
    pages = []
    while pending:
        page: list[Entry] = []
        per_ip: Counter[str] = Counter()
        deferred: deque[Entry] = deque()
        while pending and len(page) < size:
            e = pending.popleft()
            if per_ip[source_key(e.address.ip)] < cap:
                per_ip[source_key(e.address.ip)] += 1
                page.append(e)
            else:
                deferred.append(e)
        pending.extendleft(reversed(deferred))
        pages.append(page)
    return pages


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 6), max_size=80),
    st.integers(1, 9),
    st.integers(1, 3),
)
def test_paginate_gives_the_pages_of_the_one_step_version(
    ips: list[int], size: int, cap: int
) -> None:
    entries = [
        Entry(Address(f"198.51.100.{ip + 1}", i + 1), HOSTS[0].info) for i, ip in enumerate(ips)
    ]
    assert paginate(entries, size, cap) == paginate_one_step_at_a_time(entries, size, cap)
