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
then costs about 1,000 checks whatever the registry's size; only a filter that
few hosts of its shortest array pass (a name substring, say) falls back to a
pass over that array.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

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


def matches(entry: Listed, f: ListFilter) -> bool:
    """True when `entry` satisfies every filter in `f`."""
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


def sample_matching(
    items: Sequence[U], keep: Callable[[U], bool], limit: int, rng: random.Random
) -> list[U]:
    """A uniform random sample of at most `limit` of the `items` that `keep` accepts,
    in random order: what ``shuffled([i for i in items if keep(i)], rng, limit)`` gives,
    at a cost proportional to `limit` over the share of items kept, not to ``len(items)``.

    Random positions are drawn in batches, each a fresh uniform draw (with
    replacement; repeats dropped, which leaves a uniform draw without).  A batch
    holding at least `limit` kept items answers with its first `limit` of them:
    whether a batch answers depends only on how many it kept, so which of the
    kept items those are is uniform.  Otherwise a bigger batch is drawn (sized
    from the share kept so far), and past half of `items` one full pass is cheaper.
    """
    n = len(items)
    want = limit + limit // 4 + 8  # first guess: nearly everything is kept
    draw = rng.random
    while want <= n // 2:
        positions = dict.fromkeys([int(draw() * n) for _ in range(want)])
        got = list(itertools.islice(filter(keep, map(items.__getitem__, positions)), limit))
        if len(got) >= limit:
            return got
        share = max(len(got), 1) / want
        want = max(2 * want, int(limit / share * 1.25) + 8)
    return shuffled([x for x in items if keep(x)], rng, limit)


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
    if page_size < 1 or per_ip_cap < 1:
        raise ValueError("page_size and per_ip_cap must be >= 1")
    rest = list(entries)
    n, i = len(rest), 0
    carry: list[T] = []  # entries deferred from earlier pages, in order: they go first
    pages: list[list[T]] = []
    while carry or i < n:
        if not carry:
            # The common case, many sources: the next page_size entries fit as they
            # are, checked by one count (in C) instead of a step per entry.
            chunk = rest[i : i + page_size]
            if max(Counter(map(source_of, chunk)).values()) <= per_ip_cap:
                pages.append(chunk)
                i += len(chunk)
                continue
        page: list[T] = []
        per_ip: dict[str, int] = {}
        deferred: list[T] = []
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
