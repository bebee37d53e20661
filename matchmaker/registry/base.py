"""The Registry interface, and the pieces every implementation shares.

Theory of operation
-------------------
A registry maps a host's observed public `Address` to a `HostRecord`.  Each
record carries the id of the matchmaker replica that holds the host's rudp
connection (`owner`) and a random registration `token`.  The token makes
removal conditional: when a host restarts and registers again from the same
address, the old connection's belated "disconnected" removal names the old
token and leaves the new entry alone.

Liveness is a `last_seen` time on the registry's own clock (a monotonic clock
for the in-memory registry, Redis ``TIME`` for the shared one, so replica
clocks never matter).  A record not seen for `hide_after` seconds is left out
of lists; after `expire_after` seconds `expire()` removes it.

Queries never touch a network: every implementation answers from a
`LocalIndex` (records by address, by game, by IP, and in arrays per game and
per filterable field, see `listing.index_keys`).  The Redis registry keeps its
index current from a change stream; the memory one *is* its index.  A list
answer (`Registry.sample`) starts from the shortest array its filter requires
and draws random positions in it, so its cost follows the size of the answer,
not the number of hosts; it examines at most `listing.scan_budget` hosts
whatever the filter, and says when that left matches out (`Listing.complete`).

Two feeds leave a registry:

* `subscribe()` gives a bounded `Subscription` of `Change` events (upserts,
  updates and removals, from any replica).  A subscriber that falls more than
  its queue size behind is cut off (`FeedOverflow`) instead of making the
  registry buffer without bound.
* `next_notice()` yields opaque payloads another replica addressed to a host
  whose connection lives on this replica (NAT introductions across replicas).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
import random
import secrets
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from matchmaker.addresses import Address, source_key
from matchmaker.interning import share
from matchmaker.listing import (
    Drawn,
    IndexKey,
    Part,
    any_parts,
    draw_matching,
    filter_keys,
    index_keys,
    matcher,
    rest_of,
    scan_budget,
)
from matchmaker.messages import HostEntry, HostInfo, ListFilter, encode_entry


class RegistryError(Exception):
    """Base class of registry errors."""


class TooManyHosts(RegistryError):
    """The per-IP registration cap is reached."""


class NotRegistered(RegistryError):
    """No such registration (or it was replaced: the token does not match)."""


class RegistryUnavailable(RegistryError):
    """The backing store cannot be reached and the operation cannot be deferred."""


class RegistryBusy(RegistryUnavailable):
    """Every connection to the backing store stayed in use for the whole bounded wait.

    Not an outage: the registry stays fresh and nothing is written locally in
    its place; the caller answers "unavailable" and the host or client retries.
    """


class RegistryFull(RegistryBusy):
    """The backing store refused a write that would make it grow: it is at its
    memory limit (Redis over ``maxmemory``, with no eviction).

    Handled as `RegistryBusy` is: not an outage, the registry stays fresh and
    nothing is written locally in its place; the host is told "unavailable" and
    retries.  Heartbeats, removals and expiry still run, and expiry frees the room.
    """


class FeedOverflow(RegistryError):
    """A change subscriber fell too far behind and was dropped."""


class RemovalReason(enum.StrEnum):
    UNREGISTERED = "unregistered"
    DISCONNECTED = "disconnected"
    EXPIRED = "expired"


class ChangeKind(enum.StrEnum):
    UPSERT = "upsert"
    REMOVE = "remove"


class TakeoverResult(enum.StrEnum):
    """What became of a heartbeat another replica's host sent here (`Registry.take_over`)."""

    TAKEN = "taken_over"
    """This replica owns the host now."""
    REPLAYED = "takeover_replayed"
    """A replica accepted this counter or a later one already: nothing moved."""
    NOT_REGISTERED = "not_registered"
    """The registration the heartbeat proves is gone (removed, expired or replaced)."""


@dataclass(frozen=True, slots=True)
class Takeover:
    """A genuine heartbeat from a host another replica owns."""

    address: Address
    token: str
    """The registration its MAC proves (the secret derives from it)."""
    beat: int
    """Its counter."""


@dataclass(slots=True, kw_only=True)
class HostRecord:
    """One registered host.

    Every field but `last_seen` and `beat` (and the lists' cache, `entry`) is fixed once
    made: a change of info is a new record.  `last_seen` moves in place
    (`LocalIndex.touch`): a heartbeat allocates nothing and touches none of
    the index's arrays (a new record per heartbeat, re-inserted everywhere,
    cost ~11 µs at 100,000 hosts; this costs ~1.5 µs).
    """

    address: Address
    """Observed public address: the key."""
    info: HostInfo
    owner: str
    """Id of the replica the host heartbeats to (where it registered, or the one
    that took it over: `Registry.take_over`, the one change made in place)."""
    token: str
    """Registration id; removal by a stale connection must name it."""
    registered_at: float
    """Registry clock, seconds."""
    last_seen: float
    """Registry clock, seconds."""
    beat: int = field(default=0, compare=False, repr=False)
    """The counter of the last heartbeat datagram this replica accepted for this
    registration (replay protection, `matchmaker.liveness`); moves in place."""
    entry: bytes = field(default=b"", compare=False, repr=False)
    """What lists send of this host: its encoded entry (`messages.encode_entry`),
    made once, by the registration that checked it fits a page, or by the first
    list.  Kept with the record, which is replaced whenever the info changes, so
    it can never be out of date."""
    source: str = field(default="", compare=False, repr=False)
    """Its `addresses.source_key` (the unit of the per-IP page cap), with `entry`."""
    home: LocalIndex | None = field(default=None, compare=False, repr=False)
    """The `LocalIndex` this record is current in; readers skip a record found in
    an index that is not its home (a ghost, see `LocalIndex`)."""
    left: LocalIndex | None = field(default=None, compare=False, repr=False)
    """The index it was last removed from, where it may still be a ghost."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One change, as seen by subscribers."""

    kind: ChangeKind
    address: Address
    record: HostRecord | None = None
    """The new record for UPSERT."""
    reason: RemovalReason | None = None
    """Why, for REMOVE."""


@dataclass(frozen=True, slots=True)
class Notice:
    """A payload for the host at `target`, delivered to the replica that owns it."""

    target: Address
    payload: bytes
    forwarded: bool = False
    """Sent on by a replica that no longer owned the host (it moved): not again."""


_TAG_SETS: dict[tuple[str, ...], tuple[str, ...]] = {(): ()}
_TAG_SETS_MAX = 4096
"""Distinct tag tuples shared (beyond that, each host keeps its own)."""


def shared_strings(info: HostInfo) -> HostInfo:
    """`info` with its game, version, map, region and tags shared (`interning.share`),
    and its tags tuple too: most hosts share them, and each decoded copy would cost ~50
    bytes (~350 B a host)."""
    tags = _TAG_SETS.get(info.tags)
    if tags is None:
        tags = tuple(share(t) for t in info.tags)
        if all(a is b for a, b in zip(tags, info.tags, strict=True)):
            tags = info.tags  # already shared (`messages.decode_host`): share this one
        if len(_TAG_SETS) < _TAG_SETS_MAX:
            _TAG_SETS[tags] = tags
    if (
        tags is info.tags
        and share(info.game) is info.game
        and share(info.version) is info.version
        and share(info.map) is info.map
        and share(info.region) is info.region
    ):
        return info  # shared already: a copy would cost ~5 us
    return dataclasses.replace(
        info,
        game=share(info.game),
        version=share(info.version),
        map=share(info.map),
        region=share(info.region),
        tags=tags,
    )


def list_entry(record: HostRecord, data: bytes | None = None) -> None:
    """Keep a host's list entry in its record (`HostRecord.entry`), encoded once,
    and its `source_key` (`HostRecord.source`).

    Encoding dominated the daemon's cost of a long list.  The bytes stay valid
    as long as the record: a heartbeat keeps it, an update or a new registration
    makes a new record.  A registration or an update hands over the entry it
    encoded to check its size (`data`); a record from elsewhere (another
    replica's, through Redis) is encoded when first listed.
    """
    if data is None:
        data = encode_entry(HostEntry(address=record.address, info=record.info))
    record.entry = data
    record.source = source_key(record.address.ip)


@dataclass(frozen=True, slots=True)
class Listing:
    """A list answer's hosts as a list sends them, without a record per host: each
    one's encoded entry (`HostRecord.entry`) and `source_key`, in the sample's
    order, and the record of the i-th for a caller that wants one (``GET /servers``)."""

    entries: list[bytes]
    sources: list[str]
    record: Callable[[int], HostRecord]
    complete: bool = True
    """False when the registry stopped looking before it had `limit` hosts or every
    match (`listing.scan_budget`): more hosts may match.  A list says so
    (``limit_reached``) as it does for an answer cut at its limit."""


def new_token() -> str:
    return secrets.token_hex(8)


COMPACT_MIN = 64
"""An array is compacted once an eighth of it, and at least this many slots, are
records no longer current (see `LocalIndex`)."""
COMPACT_SHARE = 8
"""...that eighth: a list draws past ghosts, and `listing.sample_matching` sizes
its first batch for a kept share of about 4/5; compacting costs each removal
about this many checks per array, amortised."""


class _Array:
    """Records in a list, for random access when sampling.  A record that leaves
    the index stays in its slot (a *ghost*: its `HostRecord.home` is not the
    index) until ghosts fill an eighth of the array, which is then compacted:
    no per-record position is kept anywhere."""

    __slots__ = ("dead", "items")

    def __init__(self) -> None:
        self.items: list[HostRecord] = []
        self.dead = 0
        """Ghosts in `items`."""

    def bury(self, home: LocalIndex) -> None:
        """One of the records left the index `home`; compact if ghosts are now too many."""
        self.dead += 1
        if self.dead >= COMPACT_MIN and COMPACT_SHARE * self.dead > len(self.items):
            self.compact(home)

    def compact(self, home: LocalIndex) -> None:
        self.items = [r for r in self.items if r.home is home]
        self.dead = 0


class _Game:
    """One game's records: all of them, and one `_Array` per index key."""

    __slots__ = ("all", "keys")

    def __init__(self) -> None:
        self.all = _Array()
        self.keys: dict[IndexKey, _Array] = {}

    def add(self, record: HostRecord, keys: list[IndexKey]) -> None:
        self.all.items.append(record)
        for key in keys:
            array = self.keys.get(key)
            if array is None:
                array = self.keys[key] = _Array()
            array.items.append(record)

    def bury(self, keys: list[IndexKey], home: LocalIndex) -> None:
        self.all.bury(home)
        for key in keys:
            array = self.keys[key]
            array.bury(home)
            if not array.items:
                del self.keys[key]

    def compact(self, home: LocalIndex) -> None:
        self.all.compact(home)
        for key, array in list(self.keys.items()):
            array.compact(home)
            if not array.items:
                del self.keys[key]


class LocalIndex:
    """Records by address, with per-game, per-index-key and per-IP indexes.

    Not thread-safe; no I/O.  A record is in its game's array and in one array
    per index key (`listing.index_keys`), by reference: 8 bytes a slot.  A
    removed or replaced record is not looked for in them (its `HostRecord.home`
    is cleared, an attribute every reader checks): it stays there as a
    ghost until its array is compacted (`_Array`: ghosts are at most an eighth
    of an array; at 100,000 hosts that is a pass of a few ms every 12,500
    removals or updates), and every reader skips
    records whose home is not this index (`current`).  So
    an index costs a host one pointer per array, not a position in a dict per
    array (~560 bytes a host at 8 arrays), and a removal stays O(1) amortised.
    A heartbeat changes nothing in the arrays (`touch`).
    """

    def __init__(self) -> None:
        self._records: dict[Address, HostRecord] = {}
        self._by_game: dict[str, _Game] = {}
        self._by_source: dict[str, int] = {}  # hosts per source, see addresses.source_key

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[HostRecord]:
        return iter(list(self._records.values()))

    def get(self, address: Address) -> HostRecord | None:
        return self._records.get(address)

    def current(self, record: HostRecord) -> bool:
        """Whether `record` is listed here (not a ghost)."""
        return record.home is self

    def put(self, record: HostRecord) -> HostRecord | None:
        """Insert or replace; returns the replaced record."""
        old = self._records.get(record.address)
        if old is record:
            return old
        record.info = shared_strings(record.info)
        if old is not None:
            if old.token == record.token:
                record.beat = max(record.beat, old.beat)  # an update: same registration
            self.pop(record.address)
        game = self._by_game.get(record.info.game)
        if game is None:
            game = self._by_game[record.info.game] = _Game()
        elif record.left is self:
            # Put back after its removal from here: it may still be a ghost in
            # these arrays, where it must not appear twice (rare: a registry reloading).
            game.compact(self)
        record.home = self
        self._records[record.address] = record
        game.add(record, index_keys(record.info))
        source = source_key(record.address.ip)
        self._by_source[source] = self._by_source.get(source, 0) + 1
        return old

    def pop(self, address: Address) -> HostRecord | None:
        old = self._records.pop(address, None)
        if old is None:
            return None
        old.home, old.left = None, self
        game = self._by_game[old.info.game]
        game.bury(index_keys(old.info), self)
        if len(game.all.items) == game.all.dead:
            del self._by_game[old.info.game]
        source = source_key(address.ip)
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]
        return old

    def touch(self, address: Address, now: float) -> bool:
        old = self._records.get(address)
        if old is None:
            return False
        if now > old.last_seen:
            old.last_seen = now
        return True

    def source_count(self, ip: str) -> int:
        """Hosts registered from `ip`'s source: the IPv4 address, or the IPv6 /64."""
        return self._by_source.get(source_key(ip), 0)

    def game(self, game: str) -> Collection[HostRecord]:
        found = self._by_game.get(game)
        return self._live(found.all.items) if found is not None else ()

    def games(self) -> Iterator[tuple[str, Collection[HostRecord]]]:
        return ((g, self._live(recs.all.items)) for g, recs in list(self._by_game.items()))

    def _live(self, items: list[HostRecord]) -> list[HostRecord]:
        return [r for r in items if r.home is self]

    def candidates(self, f: ListFilter) -> tuple[Sequence[HostRecord], ListFilter | None]:
        """The shortest array holding every record matching `f`, and the rest of `f`
        its records must still be checked for (None: nothing but visibility).  The
        array may hold ghosts: keep only the records `current` says are."""
        game = self._by_game.get(f.game)
        if game is None:
            return (), None
        best: Sequence[HostRecord] = game.all.items
        rest = rest_of(f)
        for key, narrowed in filter_keys(f):
            array = game.keys.get(key)
            if array is None:
                return (), None
            if len(array.items) < len(best):
                best, rest = array.items, narrowed
        return best, rest

    def candidate_parts(self, f: ListFilter) -> list[Part[HostRecord]]:
        """`candidates`, or the arrays of `f`'s `tags_any` when they are shorter
        (`listing.any_parts`)."""
        best, rest = self.candidates(f)
        game = self._by_game.get(f.game)
        keys = {} if game is None else game.keys
        return any_parts(f, best, rest, lambda k: None if (a := keys.get(k)) is None else a.items)

    def clear(self) -> None:
        self._records.clear()
        self._by_game.clear()
        self._by_source.clear()


def _keep(
    index: LocalIndex, now: float, hide: float, rest: ListFilter | None, excluded: frozenset[str]
) -> Callable[[HostRecord], bool]:
    """The test of a candidate: current in `index`, visible, matching `rest`, and
    none of the `excluded` tags (see `listing.any_parts`)."""
    # The arrays may hold ghosts (LocalIndex): records whose home is not the index.
    if rest is None and not excluded:
        return lambda r: now - r.last_seen <= hide and r.home is index
    test = (lambda r: True) if rest is None else matcher(rest)
    if not excluded:
        return lambda r: now - r.last_seen <= hide and r.home is index and test(r)
    return lambda r: (
        now - r.last_seen <= hide
        and r.home is index
        and excluded.isdisjoint(r.info.tags)
        and test(r)
    )


class Index(Protocol):
    """What the service, the HTTP endpoint and the catalog read from a registry's
    index: `LocalIndex`, or the memory registry's `memory.RowIndex`."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[HostRecord]: ...
    def get(self, address: Address) -> HostRecord | None: ...
    def put(self, record: HostRecord) -> HostRecord | None: ...
    def touch(self, address: Address, now: float) -> bool: ...
    def source_count(self, ip: str) -> int: ...
    def game(self, game: str) -> Collection[HostRecord]: ...
    def games(self) -> Iterator[tuple[str, Collection[HostRecord]]]: ...


class Subscription:
    """A bounded queue of changes; iterate with ``async for``."""

    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.Queue[Change | None] = asyncio.Queue(maxsize)
        self.overflowed = False

    def _offer(self, change: Change) -> bool:
        """False when full: the subscription is then finished with FeedOverflow."""
        try:
            self._queue.put_nowait(change)
        except asyncio.QueueFull:
            self.overflowed = True
            return False
        return True

    def _close(self) -> None:
        # Drop one queued item if needed so the end marker always fits.
        if self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Change:
        item = await self._queue.get()
        if item is None:
            if self.overflowed:
                raise FeedOverflow("subscriber fell behind")
            raise StopAsyncIteration
        return item


class Registry(abc.ABC):
    """What the service and the HTTP endpoint need from a host registry."""

    def __init__(self, *, replica_id: str, hide_after: float, expire_after: float) -> None:
        if not 0 < hide_after <= expire_after:
            raise ValueError("need 0 < hide_after <= expire_after")
        self.replica_id = replica_id
        self.heartbeat_key = secrets.token_bytes(32)
        """Key the heartbeat secrets are derived from (`matchmaker.heartbeat`); a
        shared registry replaces it at start with the one every replica uses."""
        self.hide_after = hide_after
        self.expire_after = expire_after
        self._subscriptions: list[Subscription] = []
        self._notices: asyncio.Queue[Notice] = asyncio.Queue(maxsize=10_000)
        self.notices_dropped: dict[str, int] = {}
        """Notices for this replica's hosts dropped before they reached the service,
        by reason (``queue_full``: 10,000 waiting; ``malformed``: a relayed payload
        that does not parse)."""
        self.on_notice_dropped: Callable[[str], None] | None = None
        """Called with the reason of each such drop (the service counts them)."""

    # -- lifecycle

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect / load / start background work."""

    async def close(self) -> None:
        """Release resources and end every subscription."""
        for sub in self._subscriptions:
            sub._close()
        self._subscriptions.clear()

    # -- state

    @property
    def stale(self) -> bool:
        """True while the list may be out of date (backing store unreachable)."""
        return False

    @property
    def ready(self) -> bool:
        """True when the registry can serve (for /readyz)."""
        return True

    @abc.abstractmethod
    def now(self) -> float:
        """The registry clock, seconds (frozen at the last known value while stale)."""

    # -- writes

    @abc.abstractmethod
    async def upsert(self, address: Address, info: HostInfo, *, max_per_ip: int) -> HostRecord:
        """Register (or replace the entry at) `address`; raises TooManyHosts."""

    @abc.abstractmethod
    async def update(self, address: Address, token: str, info: HostInfo) -> HostRecord:
        """Replace the info of registration `token`; raises NotRegistered."""

    @abc.abstractmethod
    async def touch(self, addresses: Collection[Address]) -> set[Address]:
        """Mark hosts as alive now; returns those that are not registered.  Given a
        mapping, its values are the hosts' last heartbeat counters (0: none), which
        a shared registry keeps for `take_over`'s replay check."""

    async def take_over(self, beats: Sequence[Takeover]) -> list[TakeoverResult]:
        """Make this replica the owner of hosts another one owned, one result per
        heartbeat.  A registry of one replica owns every host, so nothing here
        names another owner; this only checks that each registration still stands."""
        results = []
        for t in beats:
            rec = self.get(t.address)
            if rec is None or rec.token != t.token:
                results.append(TakeoverResult.NOT_REGISTERED)
                continue
            if rec.owner != self.replica_id:  # (the memory registry's owner is read-only,
                rec.owner = self.replica_id  # and always this replica)
            results.append(TakeoverResult.TAKEN)
        return results

    @abc.abstractmethod
    async def remove(
        self, address: Address, reason: RemovalReason, *, token: str | None = None
    ) -> bool:
        """Remove `address` (only if its token is `token`, when given)."""

    @abc.abstractmethod
    async def expire(self) -> list[HostRecord]:
        """Remove the records not seen for `expire_after`; returns what this call removed."""

    # -- reads (from the local index: no I/O per request)

    @abc.abstractmethod
    def index(self) -> Index:
        """The local index queries read from."""

    def get(self, address: Address) -> HostRecord | None:
        return self.index().get(address)

    def is_visible(self, record: HostRecord, now: float) -> bool:
        return now - record.last_seen <= self.hide_after

    def hidden_after(self, now: float) -> float:
        """The silence after which `is_visible` is False at `now` (for checks in bulk)."""
        return self.hide_after

    def _parts(
        self, f: ListFilter
    ) -> list[tuple[Sequence[HostRecord], Callable[[HostRecord], bool]]]:
        """The arrays the candidates for `f` are in, each with the test its records
        must pass (one call per record)."""
        index = self.index()
        # A registry keeping another kind of index overrides query and sample.
        assert isinstance(index, LocalIndex)
        now = self.now()
        hide = self.hidden_after(now)
        out: list[tuple[Sequence[HostRecord], Callable[[HostRecord], bool]]] = []
        for candidates, rest, excluded in index.candidate_parts(f):
            out.append((candidates, _keep(index, now, hide, rest, excluded)))
        return out

    async def query(self, f: ListFilter) -> list[HostRecord]:
        """Visible records of `f.game` matching `f` (unordered, `limit` not applied)."""
        return [r for candidates, keep in self._parts(f) for r in candidates if keep(r)]

    async def sample(self, f: ListFilter, limit: int, rng: random.Random) -> list[HostRecord]:
        """At most `limit` visible records matching `f`: a uniform random sample, in
        random order (the fair order of `listing.shuffled`), without a pass over them all
        (`draw` says whether it left matches out)."""
        return (await self.draw(f, limit, rng)).items

    async def draw(self, f: ListFilter, limit: int, rng: random.Random) -> Drawn[HostRecord]:
        """`sample`, examining at most `listing.scan_budget` candidates: ``complete``
        False when that left matches out."""
        return draw_matching(self._parts(f), limit, rng, scan_budget(limit))

    async def sample_listing(self, f: ListFilter, limit: int, rng: random.Random) -> Listing:
        """`draw`, as a list sends it: each host's entry (encoded now if it has none)
        and source.  The memory registry reads them from its rows instead."""
        drawn = await self.draw(f, limit, rng)
        chosen = drawn.items
        for r in chosen:
            if not r.entry:
                list_entry(r)
        return Listing(
            [r.entry for r in chosen],
            [r.source for r in chosen],
            chosen.__getitem__,
            drawn.complete,
        )

    def visible(self, f: ListFilter) -> list[HostRecord]:
        """Visible records of `f.game` matching `f`, in index order, `limit` not
        applied: a pass over every host of the game (the master protocols' lists)."""
        now, test = self.now(), matcher(f)
        return [r for r in self.index().game(f.game) if self.is_visible(r, now) and test(r)]

    def game_names(self) -> list[str]:
        """The games with hosts in the index (some may have none visible)."""
        return [g for g, _ in self.index().games()]

    def count_by_game(self) -> dict[str, int]:
        """Visible hosts per game (for the hosts-listed gauge)."""
        now = self.now()
        counts = {
            g: sum(1 for r in recs if self.is_visible(r, now)) for g, recs in self.index().games()
        }
        return {g: n for g, n in counts.items() if n}

    # -- feeds

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        sub = Subscription(maxsize)
        self._subscriptions.append(sub)
        return sub

    def _publish(self, change: Change) -> None:
        for sub in list(self._subscriptions):
            if not sub._offer(change):
                self._subscriptions.remove(sub)
                sub._close()

    @abc.abstractmethod
    async def deliver(self, owner: str, notice: Notice) -> None:
        """Hand `notice` to replica `owner` (possibly this one)."""

    def _receive_notice(self, notice: Notice) -> None:
        # Introductions are retried by clients; dropping under overload is fine,
        # as long as it is counted.
        if self._notices.full():
            self._drop_notice("queue_full")
        else:
            self._notices.put_nowait(notice)

    def _drop_notice(self, reason: str) -> None:
        self.notices_dropped[reason] = self.notices_dropped.get(reason, 0) + 1
        if self.on_notice_dropped is not None:
            self.on_notice_dropped(reason)

    async def next_notice(self) -> Notice:
        """The next payload addressed to a host on this replica."""
        return await self._notices.get()
