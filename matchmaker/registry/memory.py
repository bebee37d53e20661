"""The in-memory registry: the default, for a single matchmaker process.

Everything lives in one `RowIndex` on the event loop's thread, so every
operation is a few dict operations and needs no locking.  Time comes from an
injected monotonic clock, which is what the tests step.

Expiry runs about once a second on the event loop, so it must not read every
host each time (~6 ms at 100,000 hosts, a stall for every list meanwhile):
each `expire()` checks the next slice of a snapshot of the records, a tenth
of them (`SWEEP_MIN` when that is more), so every host is checked within ten
sweeps.

What a listed host costs the garbage collector
----------------------------------------------
Nothing to trace.  CPython's cyclic collector traces every container object it
tracks, and a full collection traces all of them: with a `HostRecord`, its
`Address` and its `HostInfo` per host (three tracked objects), one full
collection at 100,000 hosts paused the daemon 0.2-0.4 s of CPU, and a middle
one after a registration storm traced every host registered since the last.
So the index keeps a host as a *row*: one exact tuple of strings, ints,
floats, bytes and tuples of those (the tags; the LAN address), which CPython
stops tracking once a collection has seen it (``gc.is_tracked`` is then
False; a row met before its new tag tuple in one pass, by the next).  What
moves (the last heartbeat's time and counter, the player count) and what a
list reads (the encoded list entry, the source) live in lists and arrays
indexed by the row's *slot*, and the index's per-game and per-key arrays hold
slots as C ints (`array.array`), which the collector does not look into.  The
dict by address maps a string to a slot, so it is never tracked.  What a full
collection still walks is one pointer per host in each list by slot (rows,
entries, sources): ~10 ms at 100,000 hosts; a young or middle one, nothing of
the fleet.  Records are freed by reference counting alone (a row holds no
reference to anything that could lead back to it).

A list reads the rows in place: `MemoryRegistry.sample_listing` draws slots
and returns each one's entry and source, with no object per host (a view per
host sent made the young collections that fell inside a list dearer).  An
update encodes nothing: the service hands over the entry it encoded to check
the size (a registration too), and an entry nobody handed over is encoded
when first listed.  One that moves no index key keeps its slot, and one that
moves the player count alone (players joining and leaving, the common
update) leaves the row as it is and allocates nothing that survives it.

Callers that want one record get `StoredRecord`, a short-lived view of a row
with the interface of `HostRecord`: ``beat``, ``last_seen`` and ``entry`` read
and write the row's slot while the row is current (``info`` reads the player
count there), so the service and the heartbeat code do not know the
difference.
"""

from __future__ import annotations

import random
import sys
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

from matchmaker.addresses import Address, source_key
from matchmaker.listing import (
    Drawn,
    IndexKey,
    Part,
    any_parts,
    draw_matching,
    filter_keys,
    index_keys_of,
    rest_of,
    scan_budget,
)
from matchmaker.messages import HostEntry, HostInfo, ListFilter, encode_entry
from matchmaker.registry.base import (
    COMPACT_MIN,
    COMPACT_SHARE,
    Change,
    ChangeKind,
    HostRecord,
    Listing,
    LocalIndex,
    Notice,
    NotRegistered,
    Registry,
    RemovalReason,
    TooManyHosts,
    new_token,
    shared_strings,
)

SWEEP_MIN = 5_000
"""Records one `expire()` checks at least (all of them, in a smaller registry)."""
SWEEP_ROUNDS = 10
"""Sweeps in which every record is checked once, in a larger one."""


Row = tuple[Any, ...]
"""One host, as the index keeps it: see the ``_IP``... ``_SOURCE`` positions."""

# A row's fields, in order.  Every value is atomic or an exact tuple of atomic
# values (the tags; the LAN address as (ip, port) or None), so the row is untracked.
# The player count is not one: it lives in an array by slot (`RowIndex._players`).
_IP, _PORT, _SLOT, _OWNER, _TOKEN, _REGISTERED = 0, 1, 2, 3, 4, 5
_NAME, _GAME, _VERSION, _MAX_PLAYERS, _MAP, _PASSWORD = 6, 7, 8, 9, 10, 11
_TAGS, _REGION, _INFO, _LAN, _KEY, _SOURCE = 12, 13, 14, 15, 16, 17


def _row(
    a: Address, info: HostInfo, owner: str, token: str, registered_at: float, slot: int, source: str
) -> Row:
    """One host's fields as a row (`source`: its `source_key`)."""
    h = shared_strings(info)
    lan = None if h.lan is None else (h.lan.ip, h.lan.port)
    return (
        a.ip, a.port, slot, owner, token, registered_at,
        h.name, h.game, h.version, h.max_players, h.map, h.password,
        h.tags, h.region, h.info, lan, h.key, source,
    )  # fmt: skip


_NEVER = float("-inf")
"""``last_seen`` of a slot that holds no row: never visible."""


def _key(ip: str, port: int) -> str:
    """A row's key in `RowIndex`'s dict by address: a string, not a tuple (see there)."""
    return f"{ip} {port}"


def _row_keys(row: Row, players: int) -> list[IndexKey]:
    """`listing.index_keys` of the row's info, with `players`."""
    return index_keys_of(
        row[_VERSION], row[_MAP], row[_REGION], row[_TAGS], players, row[_MAX_PLAYERS]
    )


def _info(row: Row, players: int) -> HostInfo:
    lan = row[_LAN]
    return HostInfo(
        name=row[_NAME],
        game=row[_GAME],
        version=row[_VERSION],
        max_players=row[_MAX_PLAYERS],
        map=row[_MAP],
        players=players,
        password=row[_PASSWORD],
        tags=row[_TAGS],
        region=row[_REGION],
        info=row[_INFO],
        lan=None if lan is None else Address(*lan),
        key=row[_KEY],
    )


def _row_matcher(
    f: ListFilter, excluded: frozenset[str] = frozenset()
) -> Callable[[Row, int], bool]:
    """`listing.matcher` on a row and its player count (the same tests, in the same
    order), and rows with any of the `excluded` tags refused (`listing.any_parts`)."""
    game, version, map_, region = f.game, f.version, f.map, f.region
    not_full, not_empty, password, family = f.not_full, f.not_empty, f.password, f.family
    tags_all = frozenset(f.tags_all)
    tags_any = frozenset(f.tags_any)
    name = None if f.name is None else f.name.casefold()

    def test(row: Row, players: int) -> bool:
        if row[_GAME] != game:
            return False
        if version is not None and row[_VERSION] != version:
            return False
        if map_ is not None and row[_MAP] != map_:
            return False
        if region is not None and row[_REGION] != region:
            return False
        if not_full and players >= row[_MAX_PLAYERS]:
            return False
        if not_empty and players <= 0:
            return False
        if password is not None and row[_PASSWORD] != password:
            return False
        if family is not None and (6 if ":" in row[_IP] else 4) != family:
            return False
        tags = row[_TAGS]
        if excluded and not excluded.isdisjoint(tags):
            return False
        if tags_all and not tags_all.issubset(tags):
            return False
        if tags_any and tags_any.isdisjoint(tags):
            return False
        return name is None or name in row[_NAME].casefold()

    return test


def _without_players(
    test: Callable[[Row, int], bool],
    rows: list[Row | None],
    seen: array[float],
    now: float,
    hide: float,
) -> Callable[[int], bool]:
    """A slot's test: visible, and its row passes `test` (which reads no player count)."""
    return lambda s: now - seen[s] <= hide and test(rows[s], 0)  # type: ignore[arg-type]


def _with_players(
    test: Callable[[Row, int], bool],
    rows: list[Row | None],
    seen: array[float],
    players: array[int],
    now: float,
    hide: float,
) -> Callable[[int], bool]:
    """A slot's test: visible, and its row passes `test` with its player count."""
    return lambda s: now - seen[s] <= hide and test(rows[s], players[s])  # type: ignore[arg-type]


class StoredRecord(HostRecord):
    """A `HostRecord` read from a `RowIndex` row (see the module docstring).

    The fixed fields come from the row (``source`` copied, the rest read when
    asked); ``last_seen``, ``beat``, ``entry`` and the player count from the row's
    slot while the row is current in its index, written through to it; once the
    row has left, what they were when it left (if the view was the one
    `RowIndex.pop` returned) or its registration time, 0, what was written to
    this view and the count when it was made.
    """

    __slots__ = ("_address", "_entry", "_index", "_info", "_left_at", "_players", "_row")

    def __init__(self, index: RowIndex, row: Row) -> None:  # no super(): fields are views
        self._index = index
        self._row = row
        self._info: HostInfo | None = None
        self._address: Address | None = None
        self._left_at: tuple[float, int] | None = None  # (last_seen, beat), set by pop
        self._entry = b""
        self._players: int = index._players[row[_SLOT]]  # as it was: for once it has left
        self.source = row[_SOURCE]

    def _slot(self) -> int:
        """The row's slot if it is current, else -1."""
        slot: int = self._row[_SLOT]
        return slot if self._index._rows[slot] is self._row else -1

    @property
    def address(self) -> Address:  # type: ignore[override]
        if self._address is None:
            self._address = Address(self._row[_IP], self._row[_PORT])
        return self._address

    @property
    def info(self) -> HostInfo:  # type: ignore[override]
        slot = self._slot()
        players = self._index._players[slot] if slot >= 0 else self._players
        if self._info is None or self._info.players != players:
            self._info = _info(self._row, players)
        return self._info

    @property
    def owner(self) -> str:  # type: ignore[override]
        return self._row[_OWNER]  # type: ignore[no-any-return]

    @property
    def token(self) -> str:  # type: ignore[override]
        return self._row[_TOKEN]  # type: ignore[no-any-return]

    @property
    def registered_at(self) -> float:  # type: ignore[override]
        return self._row[_REGISTERED]  # type: ignore[no-any-return]

    @property
    def last_seen(self) -> float:
        slot = self._slot()
        if slot >= 0:
            return self._index._seen[slot]
        if self._left_at is None:
            registered: float = self._row[_REGISTERED]
            return registered
        return self._left_at[0]

    @last_seen.setter
    def last_seen(self, value: float) -> None:
        slot = self._slot()
        if slot >= 0:
            self._index._seen[slot] = value

    @property
    def beat(self) -> int:
        slot = self._slot()
        if slot >= 0:
            return self._index._beat[slot]
        return 0 if self._left_at is None else self._left_at[1]

    @beat.setter
    def beat(self, value: int) -> None:
        slot = self._slot()
        if slot >= 0:
            self._index._beat[slot] = value

    @property
    def entry(self) -> bytes:
        slot = self._slot()
        return self._index._entries[slot] if slot >= 0 else self._entry

    @entry.setter
    def entry(self, value: bytes) -> None:
        self._entry = value
        slot = self._slot()
        if slot >= 0:
            self._index._entries[slot] = value

    @property
    def home(self) -> LocalIndex | None:  # type: ignore[override]
        return None  # a row's index is a RowIndex: see `RowIndex.current`

    @property
    def left(self) -> LocalIndex | None:  # type: ignore[override]
        return None


class _Slots:
    """Slots of rows in an array of C ints, for random access when sampling: nothing
    for the collector to trace.  A row that leaves the index stays (a *ghost*: its
    slot holds no row) until ghosts are an eighth of the array, which is then
    compacted (as `base._Array`); its slot is reused once no array holds it."""

    __slots__ = ("dead", "items")

    def __init__(self) -> None:
        self.items = array("i")
        self.dead = 0

    def bury(self, index: RowIndex) -> None:
        self.dead += 1
        if self.dead >= COMPACT_MIN and COMPACT_SHARE * self.dead > len(self.items):
            self.compact(index)

    def compact(self, index: RowIndex) -> None:
        rows = index._rows
        live = array("i", [s for s in self.items if rows[s] is not None])
        if len(live) < len(self.items):
            index._release(s for s in self.items if rows[s] is None)
        self.items = live
        self.dead = 0


class _Game:
    __slots__ = ("all", "keys")

    def __init__(self) -> None:
        self.all = _Slots()
        self.keys: dict[IndexKey, _Slots] = {}


class RowIndex:
    """Hosts as untracked rows by address, with per-game, per-index-key and per-source
    indexes: `LocalIndex`'s interface, and its design (arrays per game and index key
    that readers sample, ghosts compacted at an eighth), without an object per host
    for the collector to trace.  Not thread-safe; no I/O.

    Each row has a *slot*: its position in ``_rows`` and in the arrays and lists
    of what moves or what lists read (``_seen``, ``_beat``, ``_players``,
    ``_entries``, ``_sources``); the index's arrays hold slots.  A removed row's
    slot holds None (and was seen `_NEVER`) until every array that held it has
    been compacted (``_ghosts`` counts those), and only then takes another row: a
    slot found in an array is current if it holds a row.
    """

    def __init__(self) -> None:
        # Address key to slot: strings and ints, so the collector never tracks the
        # dict.  With tuples in it, it was untracked by a collection and tracked
        # again, as a young object, by the next registration or update, and every
        # young collection then walked its 100,000 entries (~2 ms).
        self._by_address: dict[str, int] = {}
        self._rows: list[Row | None] = []  # by slot; None: removed, or free
        self._free: list[int] = []
        self._seen = array("d")  # last_seen, by slot
        self._beat = array("q")  # the last heartbeat counter accepted, by slot
        self._players = array("q")  # the player count, by slot: an update moves it in place
        self._entries: list[bytes] = []  # the list entry (b"": none yet), by slot
        self._sources: list[str] = []  # the row's source, by slot: what a list reads
        self._ghosts = array("i")  # arrays still holding a removed row's slot, by slot
        self._by_game: dict[str, _Game] = {}
        self._by_source: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_address)

    def __iter__(self) -> Iterator[HostRecord]:
        return (StoredRecord(self, row) for row in self.rows())  # one view at a time

    def rows(self) -> list[Row]:
        """Every current row (a snapshot)."""
        rows = self._rows
        return [rows[s] for s in self._by_address.values()]  # type: ignore[misc]

    def slots(self) -> array[int]:
        """The slot of every current row (a snapshot the collector does not look into)."""
        return array("i", self._by_address.values())

    def view(self, row: Row) -> StoredRecord:
        return StoredRecord(self, row)

    def get(self, address: Address) -> HostRecord | None:
        row = self._find(address)
        return None if row is None else StoredRecord(self, row)

    def _find(self, address: Address) -> Row | None:
        slot = self._by_address.get(f"{address.ip} {address.port}")
        return None if slot is None else self._rows[slot]

    def current(self, record: HostRecord) -> bool:
        """Whether `record` is listed here (a view of a current row)."""
        return isinstance(record, StoredRecord) and record._index is self and record._slot() >= 0

    def put(self, record: HostRecord) -> HostRecord | None:
        """Insert or replace (`record`'s fields are copied into a row, its ``entry``
        with them); returns the replaced record."""
        address = record.address
        old = self.get(address)
        beat = record.beat
        if old is not None:
            if old.token == record.token:
                beat = max(beat, old.beat)  # an update: same registration
            self.pop(address)
        fields = (record.owner, record.token, record.registered_at)
        row = self._add(address, record.info, fields, source_key(address.ip))
        slot = row[_SLOT]
        self._seen[slot] = record.last_seen
        self._beat[slot] = beat
        self._entries[slot] = record.entry
        return old

    def update(
        self, address: Address, token: str, info: HostInfo, now: float
    ) -> StoredRecord | None:
        """Give the registration `token` at `address` a new info, seen at `now`; None
        if it is not listed.  Its list entry is cleared: the caller sets the one it
        encoded (`StoredRecord.entry`), or the first list encodes it.  Nothing else is
        encoded again.  A row that stays in the same index arrays (a change of
        players, name or info that moves no `listing.index_keys`) keeps its slot, and
        one whose player count alone moved stays as it is: nothing is left for the
        collector to see."""
        old = self._find(address)
        if old is None or old[_TOKEN] != token:
            return None
        slot = old[_SLOT]
        fields = (old[_OWNER], token, old[_REGISTERED])
        row = _row(address, info, *fields, slot, old[_SOURCE])
        players = self._players
        if row[_GAME] == old[_GAME] and _row_keys(row, info.players) == _row_keys(
            old, players[slot]
        ):
            if row != old:
                self._rows[slot] = row
            else:
                row = old  # the player count moved, or nothing: the row stays
            players[slot] = info.players
            self._entries[slot] = b""
        else:
            beat = self._beat[slot]
            self._drop(old)
            row = self._add(address, info, fields, old[_SOURCE])
            slot = row[_SLOT]
            self._beat[slot] = beat
        self._seen[slot] = now
        return StoredRecord(self, row)

    def _add(
        self, address: Address, info: HostInfo, fields: tuple[str, str, float], source: str
    ) -> Row:
        """A new row in a free slot, in every array it belongs to."""
        slot = self._free.pop() if self._free else self._grow()
        row = _row(address, info, *fields, slot, source)
        self._rows[slot] = row
        self._players[slot] = info.players
        self._sources[slot] = source
        self._by_address[_key(address.ip, address.port)] = slot
        game = self._by_game.get(row[_GAME])
        if game is None:
            game = self._by_game[row[_GAME]] = _Game()
        game.all.items.append(slot)
        for key in _row_keys(row, info.players):
            keyed = game.keys.get(key)
            if keyed is None:
                keyed = game.keys[key] = _Slots()
            keyed.items.append(slot)
        self._by_source[source] = self._by_source.get(source, 0) + 1
        return row

    def _grow(self) -> int:
        self._rows.append(None)
        self._seen.append(0.0)
        self._beat.append(0)
        self._players.append(0)
        self._ghosts.append(0)
        self._entries.append(b"")
        self._sources.append("")
        return len(self._rows) - 1

    def _release(self, slots: Iterable[int]) -> None:
        """One array no longer holds each of these removed rows' slots."""
        ghosts, free = self._ghosts, self._free
        for slot in slots:
            ghosts[slot] -= 1
            if not ghosts[slot]:
                free.append(slot)

    def pop(self, address: Address) -> HostRecord | None:
        row = self._find(address)
        if row is None:
            return None
        slot = row[_SLOT]
        view = StoredRecord(self, row)
        view._left_at = (self._seen[slot], self._beat[slot])  # what it was when it left
        view._entry = self._entries[slot]
        self._drop(row)
        return view

    def _drop(self, row: Row) -> None:
        """Remove a current row: its slot a ghost in every array that holds it."""
        del self._by_address[_key(row[_IP], row[_PORT])]
        slot = row[_SLOT]
        self._rows[slot] = None
        self._seen[slot] = _NEVER  # readers' visibility test fails for its ghosts
        self._entries[slot] = b""
        keys = _row_keys(row, self._players[slot])
        self._ghosts[slot] = 1 + len(keys)  # its game's array and one per key
        game = self._by_game[row[_GAME]]
        game.all.bury(self)
        for key in keys:
            keyed = game.keys[key]
            keyed.bury(self)
            if len(keyed.items) == keyed.dead:
                # No row left under this key (tags, map, region and version are the
                # host's to choose): the array goes, not only once it is compacted.
                self._release(keyed.items)
                del game.keys[key]
        if len(game.all.items) == game.all.dead:
            # Every row of the game left: its arrays hold ghosts only.
            del self._by_game[row[_GAME]]
            for arr in (game.all, *game.keys.values()):
                self._release(arr.items)
        source = row[_SOURCE]
        left = self._by_source[source] - 1
        if left:
            self._by_source[source] = left
        else:
            del self._by_source[source]

    def entries(self, slots: list[int]) -> list[bytes]:
        """The list entries of the rows in these slots (all current), in order; one a
        row has not yet is encoded now, and kept."""
        entries = self._entries
        found = [entries[s] for s in slots]
        if b"" in found:
            rows = self._rows
            for i, slot in enumerate(slots):
                if not found[i]:
                    row: Row = rows[slot]  # type: ignore[assignment]
                    a = Address(row[_IP], row[_PORT])
                    info = _info(row, self._players[slot])
                    found[i] = entries[slot] = encode_entry(HostEntry(address=a, info=info))
        return found

    def touch(self, address: Address, now: float) -> bool:
        slot = self._by_address.get(f"{address.ip} {address.port}")
        if slot is None:
            return False
        if now > self._seen[slot]:
            self._seen[slot] = now
        return True

    def source_count(self, ip: str) -> int:
        """Hosts registered from `ip`'s source: the IPv4 address, or the IPv6 /64."""
        return self._by_source.get(source_key(ip), 0)

    def game_rows(self, game: str) -> list[Row]:
        found = self._by_game.get(game)
        if found is None:
            return []
        rows = self._rows
        return [r for s in found.all.items if (r := rows[s]) is not None]

    def game(self, game: str) -> Collection[HostRecord]:
        return [StoredRecord(self, r) for r in self.game_rows(game)]

    def games(self) -> Iterator[tuple[str, Collection[HostRecord]]]:
        return ((g, self.game(g)) for g in list(self._by_game))

    def game_names(self) -> list[str]:
        return list(self._by_game)

    def candidates(self, f: ListFilter) -> tuple[Sequence[int], ListFilter | None]:
        """The shortest array of slots holding every row matching `f`, and the rest
        of `f` its rows must still be checked for (None: nothing but visibility).
        The array may hold ghosts: keep only the slots that hold a row."""
        game = self._by_game.get(f.game)
        if game is None:
            return (), None
        best: Sequence[int] = game.all.items
        rest = rest_of(f)
        for key, narrowed in filter_keys(f):
            keyed = game.keys.get(key)
            if keyed is None:
                return (), None
            if len(keyed.items) < len(best):
                best, rest = keyed.items, narrowed
        return best, rest

    def candidate_parts(self, f: ListFilter) -> list[Part[int]]:
        """`candidates`, or the arrays of `f`'s `tags_any` when they are shorter
        (`listing.any_parts`)."""
        best, rest = self.candidates(f)
        game = self._by_game.get(f.game)
        keys = {} if game is None else game.keys
        return any_parts(f, best, rest, lambda k: None if (a := keys.get(k)) is None else a.items)

    def clear(self) -> None:
        self._by_address.clear()
        self._rows.clear()
        self._free.clear()
        del self._seen[:]
        del self._beat[:]
        del self._players[:]
        del self._ghosts[:]
        self._entries.clear()
        self._sources.clear()
        self._by_game.clear()
        self._by_source.clear()


class MemoryRegistry(Registry):
    def __init__(
        self,
        *,
        hide_after: float = 15.0,
        expire_after: float = 30.0,
        replica_id: str = "local",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(replica_id=replica_id, hide_after=hide_after, expire_after=expire_after)
        self._clock = clock
        self._index = RowIndex()
        self._sweep = array("i")  # the slots expire() works through (a snapshot)
        self._sweep_at = 0

    async def start(self) -> None:
        """Nothing to connect to or load."""

    def now(self) -> float:
        return self._clock()

    def index(self) -> RowIndex:
        return self._index

    async def upsert(self, address: Address, info: HostInfo, *, max_per_ip: int) -> HostRecord:
        index = self._index
        if index.get(address) is None and index.source_count(address.ip) >= max_per_ip:
            raise TooManyHosts(address.ip)
        now = self.now()
        index.put(
            HostRecord(
                address=address,
                info=info,
                owner=self.replica_id,
                token=new_token(),
                registered_at=now,
                last_seen=now,
            )
        )
        record = index.get(address)
        assert record is not None
        self._publish(Change(kind=ChangeKind.UPSERT, address=address, record=record))
        return record

    async def update(self, address: Address, token: str, info: HostInfo) -> HostRecord:
        record = self._index.update(address, token, info, self.now())
        if record is None:
            raise NotRegistered(str(address))
        self._publish(Change(kind=ChangeKind.UPSERT, address=address, record=record))
        return record

    async def touch(self, addresses: Collection[Address]) -> set[Address]:
        now = self.now()
        return {a for a in addresses if not self._index.touch(a, now)}

    async def remove(
        self, address: Address, reason: RemovalReason, *, token: str | None = None
    ) -> bool:
        old = self._index.get(address)
        if old is None or (token is not None and old.token != token):
            return False
        self._index.pop(address)
        self._publish(Change(kind=ChangeKind.REMOVE, address=address, reason=reason))
        return True

    async def expire(self) -> list[HostRecord]:
        index = self._index
        cutoff = self.now() - self.expire_after
        if self._sweep_at >= len(self._sweep):
            self._sweep, self._sweep_at = index.slots(), 0
        n = max(SWEEP_MIN, len(self._sweep) // SWEEP_ROUNDS)
        chunk = self._sweep[self._sweep_at : self._sweep_at + n]
        self._sweep_at += n
        # A slot's row replaced since the snapshot is checked as it is now.
        rows, seen = index._rows, index._seen
        dead: list[HostRecord] = [
            index.view(row) for s in chunk if (row := rows[s]) is not None and seen[s] < cutoff
        ]
        for r in dead:
            await self.remove(r.address, RemovalReason.EXPIRED, token=r.token)
        return dead

    # -- reads: straight from the rows

    def _slot_tests(self, f: ListFilter) -> list[tuple[Sequence[int], Callable[[int], bool]]]:
        """The arrays of slots the candidates for `f` are in, each with the test its
        slots must pass."""
        index = self._index
        now = self.now()
        # A ghost's slot was seen _NEVER, which fails the visibility test first: no
        # look at the row (an infinite hide_after is capped for that).
        hide = min(self.hidden_after(now), sys.float_info.max)
        rows, seen, players = index._rows, index._seen, index._players
        out: list[tuple[Sequence[int], Callable[[int], bool]]] = []
        for candidates, rest, excluded in index.candidate_parts(f):
            if rest is None and not excluded:
                out.append((candidates, lambda s: now - seen[s] <= hide))
                continue
            test = _row_matcher(rest or ListFilter(game=f.game), excluded)
            if rest is None or not (rest.not_full or rest.not_empty):
                out.append((candidates, _without_players(test, rows, seen, now, hide)))
            else:
                out.append((candidates, _with_players(test, rows, seen, players, now, hide)))
        return out

    async def query(self, f: ListFilter) -> list[HostRecord]:
        index = self._index
        rows = index._rows
        return [
            StoredRecord(index, rows[s])  # type: ignore[arg-type]
            for candidates, keep in self._slot_tests(f)
            for s in candidates
            if keep(s)
        ]

    def _draw(self, f: ListFilter, limit: int, rng: random.Random) -> Drawn[int]:
        return draw_matching(self._slot_tests(f), limit, rng, scan_budget(limit))

    async def draw(self, f: ListFilter, limit: int, rng: random.Random) -> Drawn[HostRecord]:
        drawn = self._draw(f, limit, rng)
        index = self._index
        rows = index._rows
        chosen: list[HostRecord] = [StoredRecord(index, rows[s]) for s in drawn.items]  # type: ignore[arg-type]
        return Drawn(chosen, drawn.complete, drawn.examined)

    async def sample_listing(self, f: ListFilter, limit: int, rng: random.Random) -> Listing:
        """`draw` read straight from the rows: each host's entry and source, and a
        record made only for a caller that asks for one."""
        drawn = self._draw(f, limit, rng)
        index = self._index
        rows, sources = index._rows, index._sources
        chosen = drawn.items
        return Listing(
            index.entries(chosen),
            [sources[s] for s in chosen],
            # Called before the next await (nothing has left the index since).
            lambda i: StoredRecord(index, rows[chosen[i]]),  # type: ignore[arg-type]
            drawn.complete,
        )

    def visible(self, f: ListFilter) -> list[HostRecord]:
        index = self._index
        now, hide, seen = self.now(), self.hidden_after(self.now()), index._seen
        players, view, test = index._players, index.view, _row_matcher(f)
        return [
            view(r)
            for r in index.game_rows(f.game)
            if now - seen[s := r[_SLOT]] <= hide and test(r, players[s])
        ]

    def game_names(self) -> list[str]:
        return self._index.game_names()

    def count_by_game(self) -> dict[str, int]:
        index = self._index
        hide = self.hidden_after(self.now())
        now, seen = self.now(), index._seen
        counts = {
            g: sum(1 for r in index.game_rows(g) if now - seen[r[_SLOT]] <= hide)
            for g in index.game_names()
        }
        return {g: n for g, n in counts.items() if n}

    async def deliver(self, owner: str, notice: Notice) -> None:
        # One process: every owner is us.
        self._receive_notice(notice)
