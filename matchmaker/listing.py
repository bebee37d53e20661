"""Server-list filtering, fair ordering and paging: pure functions, no I/O.

Theory of operation
-------------------
A list request is answered in three steps, all here so they are tested once
and shared by every registry implementation and by ``GET /servers``:

1. `matches` keeps the hosts that satisfy every filter in a `ListFilter`.
2. `shuffled` orders them at random, afresh for every request, so no host is
   always first in everybody's browser (the first rows get most joins).
3. `paginate` cuts the order into pages of at most `page_size` hosts with at
   most `per_ip_cap` hosts from one IP in any page: an operator running many
   servers on one machine (or someone registering many fake ones) cannot fill
   a page.  Hosts pushed out of a page keep their relative order and are
   offered to the next page first, so the shuffle stays fair.

The `limit` of a filter is applied after the shuffle: a capped answer is a
random sample, not always the same first N.

Indexed lists
-------------
A registry does not scan every host of a game per request.  It keeps an array
of hosts per game and per `IndexKey` (`index_keys`: version, map, region, each
tag, "not full", "not empty"), starts from the shortest array the filter
requires (`filter_keys`), and draws random positions in it until `limit`
hosts pass the rest of the filter (`sample_matching`).  A 1,000-host answer
then costs about 1,000 checks whatever the registry's size.  A `tags_any`
filter may be served from the arrays of its tags instead (`any_parts`: each
host once, from the array of the first of its tags the filter names), when they
hold fewer hosts.

No request examines more than `scan_budget` hosts: a filter that few hosts of
its arrays pass (a name substring, say) gets the matches a random draw of that
many found, and the answer says it is partial (`Drawn.complete` False: a list's
``limit_reached``), instead of a pass over every host of the game.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from matchmaker.addresses import Address, source_key
from matchmaker.messages import HostInfo, ListFilter


class Listed(Protocol):
    """Anything with an address and a HostInfo (registry records, list entries)."""

    @property
    def address(self) -> Address: ...
    @property
    def info(self) -> HostInfo: ...


T = TypeVar("T", bound=Listed)
U = TypeVar("U")  # anything: registry rows too
V = TypeVar("V")

SCAN_MIN = 4096
"""Hosts one list request may examine at least (`scan_budget`)."""
SCAN_PER_HOST = 8
"""...and per host it may answer with: a request for 1,000 hosts examines at most
8,000, whatever its filter and the registry's size."""


def scan_budget(limit: int) -> int:
    """The most candidate hosts one list request for at most `limit` hosts examines.

    An examined host that fails the filter costs a fraction of one that is sent
    (its entry copied, paged and sent), so a request that uses its whole budget
    costs about what a plain request for as many hosts does."""
    return max(SCAN_MIN, SCAN_PER_HOST * limit)


def matches(entry: Listed, f: ListFilter) -> bool:
    """True when `entry` satisfies every filter in `f` (`matcher` for many entries)."""
    h = entry.info
    # Cheapest and most selective tests first; each one can end the check.
    if h.game != f.game:
        return False
    if f.version is not None and h.version != f.version:
        return False
    if f.map is not None and h.map != f.map:
        return False
    if f.region is not None and h.region != f.region:
        return False
    if f.not_full and h.players >= h.max_players:
        return False
    if f.not_empty and h.players <= 0:
        return False
    if f.password is not None and h.password != f.password:
        return False
    if f.family is not None and entry.address.family != f.family:
        return False
    if f.tags_all and not all(t in h.tags for t in f.tags_all):
        return False
    if f.tags_any and not any(t in h.tags for t in f.tags_any):
        return False
    return f.name is None or f.name.casefold() in h.name.casefold()


def matcher(f: ListFilter) -> Callable[[Listed], bool]:
    """`matches` against `f`, with what depends on `f` alone worked out once (the
    name folded, the tags as sets), not once per entry checked."""
    game, version, map_, region = f.game, f.version, f.map, f.region
    not_full, not_empty, password, family = f.not_full, f.not_empty, f.password, f.family
    tags_all = frozenset(f.tags_all)
    tags_any = frozenset(f.tags_any)
    name = None if f.name is None else f.name.casefold()

    def test(entry: Listed) -> bool:
        h = entry.info
        if h.game != game:
            return False
        if version is not None and h.version != version:
            return False
        if map_ is not None and h.map != map_:
            return False
        if region is not None and h.region != region:
            return False
        if not_full and h.players >= h.max_players:
            return False
        if not_empty and h.players <= 0:
            return False
        if password is not None and h.password != password:
            return False
        if family is not None and entry.address.family != family:
            return False
        if tags_all and not tags_all.issubset(h.tags):
            return False
        if tags_any and tags_any.isdisjoint(h.tags):
            return False
        return name is None or name in h.name.casefold()

    return test


IndexKey = tuple[str, str]
"""A (field, value) pair a registry keeps an array of hosts for, within a game."""

_OPEN: IndexKey = ("open", "")  # players < max_players: what not_full asks for
_BUSY: IndexKey = ("busy", "")  # players > 0: what not_empty asks for


def index_keys(info: HostInfo) -> list[IndexKey]:
    """The index keys a host is listed under (besides its game)."""
    return index_keys_of(
        info.version, info.map, info.region, info.tags, info.players, info.max_players
    )


def index_keys_of(
    version: str, map_: str, region: str, tags: tuple[str, ...], players: int, max_players: int
) -> list[IndexKey]:
    """`index_keys` from the fields it reads (a registry keeping hosts as rows)."""
    keys = [("version", version), ("map", map_), ("region", region)]
    keys += [("tag", t) for t in dict.fromkeys(tags)]
    if players < max_players:
        keys.append(_OPEN)
    if players > 0:
        keys.append(_BUSY)
    return keys


def filter_keys(f: ListFilter) -> list[tuple[IndexKey, ListFilter | None]]:
    """The index keys every host matching `f` is listed under, each with the rest of
    `f` (what a host under that key must still be checked for; None: nothing)."""
    out: list[tuple[IndexKey, ListFilter | None]] = []
    if f.version is not None:
        out.append((("version", f.version), rest_of(dataclasses.replace(f, version=None))))
    if f.map is not None:
        out.append((("map", f.map), rest_of(dataclasses.replace(f, map=None))))
    if f.region is not None:
        out.append((("region", f.region), rest_of(dataclasses.replace(f, region=None))))
    for tag in dict.fromkeys(f.tags_all):
        others = tuple(t for t in f.tags_all if t != tag)
        out.append((("tag", tag), rest_of(dataclasses.replace(f, tags_all=others))))
    if f.not_full:
        out.append((_OPEN, rest_of(dataclasses.replace(f, not_full=False))))
    if f.not_empty:
        out.append((_BUSY, rest_of(dataclasses.replace(f, not_empty=False))))
    return out


def rest_of(f: ListFilter) -> ListFilter | None:
    """`f`, or None when it asks for nothing but the game (and a limit)."""
    return None if f == ListFilter(game=f.game, limit=f.limit) else f


Part = tuple[Sequence[U], "ListFilter | None", frozenset[str]]
"""Candidates from one index array: the array, the rest of the filter its hosts must
still be checked for (None: nothing), and tags a host kept from it must not have
(it is kept from the array of one of those: see `any_parts`)."""


def any_parts(
    f: ListFilter,
    best: Sequence[U],
    rest: ListFilter | None,
    lookup: Callable[[IndexKey], Sequence[U] | None],
) -> list[Part[U]]:
    """Where to draw the candidates for `f` from: the shortest array its `filter_keys`
    require (`best`, to be checked for `rest`), or, when they hold fewer hosts, the
    arrays of the tags of `tags_any` (`lookup` gives the array of a key, None if no
    host has it).  A host with several of those tags is in several arrays: it
    counts in the array of the first of them that `f` names only, so every host
    is a candidate once and a uniform draw stays uniform.  No array for any of
    them: nothing can match."""
    if not f.tags_any or not best:
        return [(best, rest, frozenset())]
    arrays = [(t, a) for t in dict.fromkeys(f.tags_any) if (a := lookup(("tag", t))) is not None]
    if sum(len(a) for _, a in arrays) >= len(best):
        return [(best, rest, frozenset())]
    others = rest_of(dataclasses.replace(f, tags_any=()))
    return [(a, others, frozenset(t for t, _ in arrays[:i])) for i, (_, a) in enumerate(arrays)]


def select(entries: Iterable[T], f: ListFilter) -> list[T]:
    """The entries matching `f`, in input order, without `limit` applied."""
    return [e for e in entries if matches(e, f)]


def shuffled(entries: Sequence[U], rng: random.Random, limit: int | None = None) -> list[U]:
    """A fresh random order of `entries`, cut to `limit` (a random sample)."""
    if limit is not None and limit < len(entries):
        return rng.sample(list(entries), limit)
    out = list(entries)
    rng.shuffle(out)
    return out


@dataclass(frozen=True, slots=True)
class Drawn(Generic[U]):
    """What `draw_matching` found."""

    items: list[U]
    """A uniform random sample of the kept items, in random order."""
    complete: bool
    """True when `items` holds `limit` items or every kept item: False when the
    budget ran out first, and some kept items may have been left out."""
    examined: int
    """Items read and tested, at most (the budget, when one was given)."""


def sample_matching(
    items: Sequence[U], keep: Callable[[U], bool], limit: int, rng: random.Random
) -> list[U]:
    """A uniform random sample of at most `limit` of the `items` that `keep` accepts,
    in random order: what ``shuffled([i for i in items if keep(i)], rng, limit)`` gives,
    at a cost proportional to `limit` over the share of items kept, not to ``len(items)``.
    Without a budget: `draw_matching` says what a budget changes."""
    return draw_matching([(items, keep)], limit, rng).items


def draw_matching(
    parts: Sequence[tuple[Sequence[U], Callable[[U], bool]]],
    limit: int,
    rng: random.Random,
    budget: int | None = None,
) -> Drawn[U]:
    """`sample_matching` over several arrays, as if they were one (each with its own
    `keep`), testing at most `budget` items (None: no bound).

    Random positions are drawn in batches (uniformly, with replacement; repeats and
    positions an earlier batch drew are dropped), and every item drawn counts: the
    items examined so far, in the order first drawn, are a uniform random order of
    a uniform random subset of the items.  The answer is the first `limit` kept
    items in that order.  When to stop depends only on how many items were drawn
    and kept, never on which, so the answer is a uniform random sample of the kept
    items in random order.  A batch is sized from the share kept so far, for the
    kept items still missing; past half of the items one full pass is cheaper.
    When that pass would take the items tested past `budget`, the last batches
    draw as many new positions as the budget still covers, and the answer holds
    the kept items among everything examined: a uniform sample too, but maybe of
    fewer than `limit` while more exist (``complete`` False).
    """
    if len(parts) == 1:
        items, keep = parts[0]

        def kept_items() -> Iterable[U]:
            return filter(keep, items)

        return _draw(len(items), items.__getitem__, keep, kept_items, limit, rng, budget)
    starts = list(itertools.accumulate((len(a) for a, _ in parts), initial=0))
    keeps = [k for _, k in parts]

    def at(p: int) -> tuple[int, U]:
        i = bisect.bisect_right(starts, p) - 1
        return i, parts[i][0][p - starts[i]]

    def kept(pair: tuple[int, U]) -> bool:
        return keeps[pair[0]](pair[1])

    def every() -> Iterable[tuple[int, U]]:
        return ((i, x) for i, (a, k) in enumerate(parts) for x in a if k(x))

    found = _draw(starts[-1], at, kept, every, limit, rng, budget)
    return Drawn([x for _, x in found.items], found.complete, found.examined)


def _draw(
    n: int,
    at: Callable[[int], V],
    keep: Callable[[V], bool],
    every: Callable[[], Iterable[V]],
    limit: int,
    rng: random.Random,
    budget: int | None,
) -> Drawn[V]:
    if limit <= 0:
        return Drawn([], True, 0)
    cap = sys.maxsize if budget is None else budget
    # Within the budget, a batch is drawn only if the pass after it still fits: a
    # game of at most `budget` candidates always gets a complete answer.
    whole = n <= cap
    reserve = n if whole else 0
    # Every position drawn so far is examined once, in the order first drawn: those
    # of the batches before the last in `seen`, the last one's in `last` (added to
    # `seen` only if another batch follows: most answers take one).
    seen: set[int] = set()
    last: list[int] = []
    got: list[V] = []  # the kept items among them, in the same order
    want = limit + limit // 4 + 8  # first guess: nearly everything is kept
    draw = rng.random

    def more(k: int, most: int | None = None) -> None:
        # k positions drawn, the first `most` new ones kept (None: all), then the
        # new ones examined until `limit` items are kept.
        seen.update(last)
        drawn = dict.fromkeys([int(draw() * n) for _ in range(k)])
        fresh = itertools.filterfalse(seen.__contains__, drawn) if seen else iter(drawn)
        last[:] = itertools.islice(fresh, most)
        got.extend(itertools.islice(filter(keep, map(at, last)), limit - len(got)))

    while len(seen) + len(last) + want <= min(n // 2, cap - reserve):
        more(want)
        examined = len(seen) + len(last)
        if len(got) >= limit:
            return Drawn(got, True, examined)
        # Enough draws for the kept items still missing, at the share kept so far
        # and the share of positions not drawn yet; never a smaller batch.
        share = max(len(got), 1) / examined * (n - examined) / n
        want = max(want, int((limit - len(got)) / share * 1.25) + 8)
    if whole:
        return Drawn(shuffled(list(every()), rng, limit), True, len(seen) + len(last) + n)
    # A pass would cost more than the budget: as many new positions as it still
    # covers (n > cap, so there are that many), drawn as above with a margin for
    # the repeats expected (more rounds only when the items are barely more than
    # the budget, or a round drew more repeats than expected).
    for _ in range(_LAST_ROUNDS):
        examined = len(seen) + len(last)
        room = cap - examined
        if room <= 0 or len(got) >= limit:
            break
        more(int(room * n / (n - examined - room / 2) * 1.02) + 32, room)
    return Drawn(got, len(got) >= limit, len(seen) + len(last))


_LAST_ROUNDS = 4
"""Rounds of draws that spend what a request's budget still covers once a pass is
out of reach: the first nearly always spends it all, unless the items are barely
more than the budget."""


def _source(entry: Listed) -> str:
    return source_key(entry.address.ip)


def paginate(
    entries: Sequence[T],
    page_size: int,
    per_ip_cap: int,
    source_of: Callable[[T], str] = _source,
) -> list[list[T]]:
    """Pages of at most `page_size` entries, at most `per_ip_cap` per IP each.

    Order is preserved as far as the cap allows: an entry deferred from one
    page goes before any entry that had not been reached yet.  Every entry
    lands in exactly one page.  Cost is O(n + deferrals), where an entry is
    deferred at most once per page its IP fills: bounded in practice by the
    per-IP registration cap.  `source_of` gives an entry's `source_key` (a
    registry index has it at hand; computing it again per listed host is not free).
    """
    return _pages(entries, page_size, per_ip_cap, source_of)


def paginate_positions(sources: Sequence[str], page_size: int, per_ip_cap: int) -> list[list[int]]:
    """`paginate` of the positions of hosts whose `source_key` are `sources`, in order:
    for a caller holding the hosts as it will send them, not as records."""
    return _pages(range(len(sources)), page_size, per_ip_cap, sources.__getitem__)


def _pages(
    entries: Sequence[U], page_size: int, per_ip_cap: int, source_of: Callable[[U], str]
) -> list[list[U]]:
    if page_size < 1 or per_ip_cap < 1:
        raise ValueError("page_size and per_ip_cap must be >= 1")
    rest = list(entries)
    n, i = len(rest), 0
    carry: list[U] = []  # entries deferred from earlier pages, in order: they go first
    pages: list[list[U]] = []
    while carry or i < n:
        if not carry:
            # The common case, many sources: the next page_size entries fit as they
            # are, checked by one count (in C) instead of a step per entry.
            chunk = rest[i : i + page_size]
            if max(Counter(map(source_of, chunk)).values()) <= per_ip_cap:
                pages.append(chunk)
                i += len(chunk)
                continue
        page: list[U] = []
        per_ip: dict[str, int] = {}
        deferred: list[U] = []
        j = 0
        while len(page) < page_size and (j < len(carry) or i < n):
            if j < len(carry):
                e, j = carry[j], j + 1
            else:
                e, i = rest[i], i + 1
            source = source_of(e)
            seen = per_ip.get(source, 0)
            if seen < per_ip_cap:
                per_ip[source] = seen + 1
                page.append(e)
            else:
                deferred.append(e)
        # Deferred entries go first next time, before the carried ones not reached.
        carry = deferred + carry[j:]
        pages.append(page)
    return pages


def split_by_size(page: Sequence[T], max_bytes: int, size_of: Callable[[T], int]) -> list[list[T]]:
    """Split one page so the sum of `size_of` stays within `max_bytes`.

    Splitting never raises a per-IP count, so `paginate`'s guarantee holds for
    the pieces.  An entry larger than `max_bytes` on its own gets a page alone.
    """
    return [list(page[a:b]) for a, b in size_cuts([size_of(e) for e in page], max_bytes)]


def size_cuts(sizes: Sequence[int], max_bytes: int) -> list[tuple[int, int]]:
    """`split_by_size` on the sizes alone: the (start, end) of each piece."""
    out: list[tuple[int, int]] = []
    start = used = 0
    for i, size in enumerate(sizes):
        if i > start and used + size > max_bytes:
            out.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out
