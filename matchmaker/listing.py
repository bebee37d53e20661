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
"""

from __future__ import annotations

import random
from collections import Counter, deque
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


def matches(entry: Listed, f: ListFilter) -> bool:
    """True when `entry` satisfies every filter in `f`."""
    h = entry.info
    if h.game != f.game:
        return False
    checks = (
        f.version is None or h.version == f.version,
        f.map is None or h.map == f.map,
        f.region is None or h.region == f.region,
        not f.not_full or h.players < h.max_players,
        not f.not_empty or h.players > 0,
        f.password is None or h.password == f.password,
        f.family is None or entry.address.family == f.family,
    )
    if not all(checks):
        return False
    if f.tags_all and not set(f.tags_all).issubset(h.tags):
        return False
    if f.tags_any and set(f.tags_any).isdisjoint(h.tags):
        return False
    return f.name is None or f.name.casefold() in h.name.casefold()


def select(entries: Iterable[T], f: ListFilter) -> list[T]:
    """The entries matching `f`, in input order, without `limit` applied."""
    return [e for e in entries if matches(e, f)]


def shuffled(entries: Sequence[T], rng: random.Random, limit: int | None = None) -> list[T]:
    """A fresh random order of `entries`, cut to `limit` (a random sample)."""
    if limit is not None and limit < len(entries):
        return rng.sample(list(entries), limit)
    out = list(entries)
    rng.shuffle(out)
    return out


def paginate(entries: Sequence[T], page_size: int, per_ip_cap: int) -> list[list[T]]:
    """Pages of at most `page_size` entries, at most `per_ip_cap` per IP each.

    Order is preserved as far as the cap allows: an entry deferred from one
    page goes before any entry that had not been reached yet.  Every entry
    lands in exactly one page.  Cost is O(n + deferrals), where an entry is
    deferred at most once per page its IP fills: bounded in practice by the
    per-IP registration cap.
    """
    if page_size < 1 or per_ip_cap < 1:
        raise ValueError("page_size and per_ip_cap must be >= 1")
    pending: deque[T] = deque(entries)
    pages: list[list[T]] = []
    while pending:
        page: list[T] = []
        per_ip: Counter[str] = Counter()
        deferred: deque[T] = deque()
        while pending and len(page) < page_size:
            e = pending.popleft()
            source = source_key(e.address.ip)
            if per_ip[source] < per_ip_cap:
                per_ip[source] += 1
                page.append(e)
            else:
                deferred.append(e)
        # Deferred entries go first next time; touching only them (not the
        # whole rest) keeps a long list O(n).
        pending.extendleft(reversed(deferred))
        pages.append(page)
    return pages


def split_by_size(page: Sequence[T], max_bytes: int, size_of: Callable[[T], int]) -> list[list[T]]:
    """Split one page so the sum of `size_of` stays within `max_bytes`.

    Splitting never raises a per-IP count, so `paginate`'s guarantee holds for
    the pieces.  An entry larger than `max_bytes` on its own gets a page alone.
    """
    out: list[list[T]] = []
    current: list[T] = []
    used = 0
    for e in page:
        size = size_of(e)
        if current and used + size > max_bytes:
            out.append(current)
            current, used = [], 0
        current.append(e)
        used += size
    if current:
        out.append(current)
    return out
