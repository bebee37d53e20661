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
`LocalIndex` (records by address, by game and by IP).  The Redis registry
keeps its index current from a change stream; the memory one *is* its index.

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
import enum
import secrets
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from matchmaker.addresses import Address, source_key
from matchmaker.listing import matches
from matchmaker.messages import HostInfo, ListFilter


class RegistryError(Exception):
    """Base class of registry errors."""


class TooManyHosts(RegistryError):
    """The per-IP registration cap is reached."""


class NotRegistered(RegistryError):
    """No such registration (or it was replaced: the token does not match)."""


class RegistryUnavailable(RegistryError):
    """The backing store cannot be reached and the operation cannot be deferred."""


class FeedOverflow(RegistryError):
    """A change subscriber fell too far behind and was dropped."""


class RemovalReason(enum.StrEnum):
    UNREGISTERED = "unregistered"
    DISCONNECTED = "disconnected"
    EXPIRED = "expired"


class ChangeKind(enum.StrEnum):
    UPSERT = "upsert"
    REMOVE = "remove"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRecord:
    """One registered host."""

    address: Address
    """Observed public address: the key."""
    info: HostInfo
    owner: str
    """Id of the replica holding the host's connection."""
    token: str
    """Registration id; removal by a stale connection must name it."""
    registered_at: float
    """Registry clock, seconds."""
    last_seen: float
    """Registry clock, seconds."""


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


def new_token() -> str:
    return secrets.token_hex(8)


class LocalIndex:
    """Records by address, with per-game and per-IP indexes.  Not thread-safe; no I/O."""

    def __init__(self) -> None:
        self._records: dict[Address, HostRecord] = {}
        self._by_game: dict[str, dict[Address, HostRecord]] = {}
        self._by_source: dict[str, set[Address]] = {}  # see addresses.source_key

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[HostRecord]:
        return iter(list(self._records.values()))

    def get(self, address: Address) -> HostRecord | None:
        return self._records.get(address)

    def put(self, record: HostRecord) -> HostRecord | None:
        """Insert or replace; returns the replaced record."""
        old = self.pop(record.address)
        self._records[record.address] = record
        self._by_game.setdefault(record.info.game, {})[record.address] = record
        self._by_source.setdefault(source_key(record.address.ip), set()).add(record.address)
        return old

    def pop(self, address: Address) -> HostRecord | None:
        old = self._records.pop(address, None)
        if old is None:
            return None
        game = self._by_game[old.info.game]
        del game[address]
        if not game:
            del self._by_game[old.info.game]
        source = source_key(address.ip)
        same = self._by_source[source]
        same.discard(address)
        if not same:
            del self._by_source[source]
        return old

    def touch(self, address: Address, now: float) -> bool:
        old = self._records.get(address)
        if old is None:
            return False
        if now > old.last_seen:
            self.put(_with_seen(old, now))
        return True

    def source_count(self, ip: str) -> int:
        """Hosts registered from `ip`'s source: the IPv4 address, or the IPv6 /64."""
        return len(self._by_source.get(source_key(ip), ()))

    def game(self, game: str) -> Collection[HostRecord]:
        return self._by_game.get(game, {}).values()

    def games(self) -> Iterator[tuple[str, Collection[HostRecord]]]:
        return ((g, recs.values()) for g, recs in self._by_game.items())

    def clear(self) -> None:
        self._records.clear()
        self._by_game.clear()
        self._by_source.clear()


def _with_seen(r: HostRecord, seen: float) -> HostRecord:
    return HostRecord(
        address=r.address,
        info=r.info,
        owner=r.owner,
        token=r.token,
        registered_at=r.registered_at,
        last_seen=seen,
    )


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
        self.hide_after = hide_after
        self.expire_after = expire_after
        self._subscriptions: list[Subscription] = []
        self._notices: asyncio.Queue[Notice] = asyncio.Queue(maxsize=10_000)

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
        """Mark hosts as alive now; returns those that are not registered."""

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
    def index(self) -> LocalIndex:
        """The local index queries read from."""

    def get(self, address: Address) -> HostRecord | None:
        return self.index().get(address)

    def is_visible(self, record: HostRecord, now: float) -> bool:
        return now - record.last_seen <= self.hide_after

    async def query(self, f: ListFilter) -> list[HostRecord]:
        """Visible records of `f.game` matching `f` (unordered, `limit` not applied)."""
        now = self.now()
        return [r for r in self.index().game(f.game) if self.is_visible(r, now) and matches(r, f)]

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
        # Introductions are retried by clients; dropping under overload is fine.
        if not self._notices.full():
            self._notices.put_nowait(notice)

    async def next_notice(self) -> Notice:
        """The next payload addressed to a host on this replica."""
        return await self._notices.get()
