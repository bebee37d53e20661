"""The shared registry: several matchmaker replicas over one Redis.

Theory of operation
-------------------
**Storage.**  All keys share one prefix (default ``{mm}:``; the braces are a
Redis Cluster hash tag, so every key lands in one slot):

==================  ======  =====================================================
key                 type    content
==================  ======  =====================================================
``h:<addr>``        hash    ``info`` (msgpack HostInfo), ``owner``, ``token``, ``reg``,
                            ``cap`` (the key of its ``ip:`` set), ``beat`` (the highest
                            heartbeat counter a replica accepted, 20 decimal digits)
``seen``            zset    addr -> last seen, ms of Redis ``TIME``
``ip:<source>``     set     addrs registered from one source, an IPv4 address or
                            an IPv6 /64 (the per-IP cap)
``events``          stream  every change, in commit order (``MAXLEN ~``)
``sweep``/``grace`` string  last expiry sweep, and end of a post-outage grace period
``epoch``           string  random, written by whoever finds it missing: a new value
                            means Redis lost its data
``hbkey``           string  32 random bytes, written by whoever finds it missing: the
                            key heartbeat secrets are derived from (`matchmaker.heartbeat`)
``notice:<id>``     pubsub  payloads for hosts connected to replica ``<id>``
==================  ======  =====================================================

Every write is one Lua script that reads ``TIME`` inside Redis, changes the
keys and appends the change to ``events`` atomically, so the stream order *is*
the commit order and replica clocks never matter.

**Takeover.**  A replica that accepts a heartbeat for a host another replica
owns makes itself the owner (``take_over``: one script per batch, which moves
``owner`` only for the registration the heartbeat proves and a counter above
the ``beat`` every replica wrote with its heartbeat batches, and appends one
``owner`` event); every replica changes the record's owner in place, and the
replica the host left stops counting it among the hosts it re-asserts.

**Reads.**  Each replica keeps a `LocalIndex`, loaded once at start (and after
every reconnection) and then fed by ``XREAD BLOCK`` on the stream.  List
queries read only the index: no Redis round trip, no SCAN per request.  A
replica's own writes are applied to its index at once (read-your-writes);
`_ahead` remembers the stream id of each such write so that older events
still in flight on the stream cannot roll the entry back.

Following is paid once per change by every other replica, so it is kept
cheap: a stored host is read back by `messages.decode_host` (the validation
of `decode`, on a fast path for a valid one), a touch or owner event's
addresses are looked up without being validated (a malformed one finds
nothing), no `Change` is made when nobody subscribed, and after a read that
found changes the follower waits ``follow_interval`` so that the next ones
come in one reply (a read costs ~150 µs beside its events).  Redis is shared,
not trusted: an entry that does not parse or validate is dropped and counted
in `dropped_events` by reason, and the follower goes on with the next one.

**Time.**  Scripts return Redis ``TIME``; the replica keeps the offset from
its monotonic clock, so `now()` estimates Redis time between calls.  Hiding
(``hide_after``) is evaluated locally against that estimate; expiry runs in
Redis (``expire`` script, run by every replica about once a second, idempotent).

**Connections.**  Operations share a pool of ``pool_size`` connections (plus
one for the follower and one for the notice subscription).  When all are in
use an operation waits for one, up to ``pool_timeout``; running out of that
time raises `RegistryBusy` and is *not* an outage: nothing turns stale and
nothing is written locally, the host is told "unavailable" and retries.

**Full.**  Redis over its ``maxmemory`` refuses the registration and update
scripts before they run (``#!lua``): `RegistryFull`, handled as `RegistryBusy`
(counted, the host retries).  Every other script is flagged ``allow-oom`` and
runs (heartbeats, takeovers, removals, expiry, the clock a reload reads), so a
full Redis turns no replica stale, and expiry makes room again.

**Outage.**  When a Redis call fails (no connection, or an error reply such as
READONLY) the registry turns *stale*: `now()` freezes
at the last known Redis time (so nobody gets hidden for silence that is our
fault), queries keep answering from the index, writes by this replica's own
hosts are applied to the index and remembered (`_owned`, `_pending_removals`),
and `expire()` does nothing.  A background task retries; on success it reloads
the index, re-asserts every host this replica still owns and replays removals
(again for a host that changes meanwhile, until nothing is left to write).
A removal is kept for what Redis may hold of the address, one per address, and
dropped when the address registers again: a host that registered here during
the outage and left is removed from Redis as the registration it replaced, if
any, so hosts that come and go meanwhile leave nothing to replay.  After a write
that failed without an answer Redis holds that registration or the one it
replaced, so a removal then replays both tokens (each removes only a match).
A re-assertion replaces whatever Redis holds for the address unless that was
registered *after* the host registered here (it moved on), so a host that
re-homed here from a dead replica ends up owned by this one.  It keeps the
registration's time, so the newest registration wins whichever replica writes
back first.  A host another replica took over meanwhile (the same token under
another owner in the copy loaded, or in Redis when written back) is not ours any
more: it is neither re-asserted nor counted as ours.  The loaded copy
replaces the index only once this replica's own hosts are merged into it; if
Redis came back empty (a new ``epoch``) every host listed before is carried
over too, until its replica writes it back or the grace period ends (a reload
meanwhile keeps carrying it): lists never shrink because Redis lost its data.

**No mass expiry.**  If Redis itself was down (or every replica was), the
hosts' ``seen`` scores are old when it returns.  The expiry script notices
that no sweep ran for ``sweep_gap`` seconds and opens a grace period of
``expire_after`` during which nothing expires: enough for every replica to
reconnect and re-assert its hosts.  A single replica cut off while the others
still sweep loses its hosts from the *shared* list after ``expire_after``
(they look dead from outside) and puts them back when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from matchmaker.addresses import Address, parse_key, source_key
from matchmaker.messages import (
    DEFAULT_LIMITS,
    HostInfo,
    Limits,
    MessageError,
    Register,
    decode_host,
    encode,
)
from matchmaker.registry.base import (
    Change,
    ChangeKind,
    HostRecord,
    LocalIndex,
    Notice,
    NotRegistered,
    Registry,
    RegistryBusy,
    RegistryFull,
    RegistryUnavailable,
    RemovalReason,
    Takeover,
    TakeoverResult,
    TooManyHosts,
    new_token,
)
from matchmaker.stopping import STOP_WITHIN, cancel_and_wait

log = structlog.get_logger("matchmaker.registry.redis")


class OpObserver(Protocol):
    """Called as (operation, seconds, failed) after every Redis operation (a write
    Redis refused over its ``maxmemory`` is told to ``on_full`` besides)."""

    def __call__(self, op: str, seconds: float, failed: bool, /) -> None: ...


_FULL_LOG_INTERVAL = 60.0
"""Seconds between two ``registry_full`` warnings at least."""

_GROWING_OPS = frozenset({"upsert", "update"})
"""The operations of the scripts Redis refuses over ``maxmemory`` (`_GROWS`)."""

StreamId = tuple[int, int]

_FOLLOW_COUNT = 1000
"""Stream entries one ``XREAD`` returns at most."""

# Connection-level failures end loops quietly; in `_op` every Redis error (these,
# and also READONLY, BUSY, ...) turns the registry stale, but for an OOM refusal.
_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, asyncio.TimeoutError)

# Every script starts with a shebang (Redis 7.0 or later), so that Redis checks its
# memory limit once, before the script runs, by what the script is for.  Without
# one Redis checks it at a script's first write command only, and never for a
# delete: a registration whose first write was an HDEL got past ``maxmemory``
# while the writes that keep hosts alive and expire them (a ZADD, a SET first)
# were refused, so a full Redis stayed full for good.
_GROWS = "#!lua"
"""The scripts that store new data (registrations, updates): refused up front while
Redis is over ``maxmemory`` (`RegistryFull`), so that nothing more lands."""
_ALLOW_OOM = "#!lua flags=allow-oom"
"""The scripts that keep hosts alive or free memory (heartbeats, takeovers, removals,
expiry), and the clock a resync reads: a few bytes each, they run over
``maxmemory`` too, so that hosts stay listed and expiry makes room again."""

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: h, seen, ip (the address's cap set), events, ip-of-the-address (the cap set of
# entries written before the sets were kept per source; the same key for IPv4).
# ARGV: addr, info, owner, token, max_per_ip, maxlen, mode, registered (ms).
# mode "new": a fresh registration.  mode "reassert": put back a registration
# this replica still holds after an outage, unless the address now belongs to
# a registration made after it (`registered`, the replica's estimate of Redis
# time when the host registered with it).  An older entry is replaced: the
# host left that replica (which may be dead, and cannot re-assert) for this one.
# A re-assertion keeps its registration time, so that whichever replica writes
# back first, the newest registration of an address wins; it never takes back a
# registration another replica took over.
# Returns {status, now, stream id, reg}; status 1 written, 0 over the cap, 2 lost.
_UPSERT = (
    _GROWS
    + _NOW
    + """
local cur = redis.call('HGET', KEYS[1], 'token')
local reg = now
if ARGV[7] == 'reassert' then
  if cur and cur ~= ARGV[4]
    and tonumber(redis.call('HGET', KEYS[1], 'reg') or '0') >= tonumber(ARGV[8]) then
    return {2, now, '', 0}
  end
  -- The same registration under another owner: taken over (`_TAKE_OVER`) meanwhile.
  if cur == ARGV[4] and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[3] then
    return {2, now, '', 0}
  end
  reg = math.min(now, tonumber(ARGV[8]))
end
if cur then
  -- Replacing an entry: it leaves the cap set it was counted in, if another.
  local was = redis.call('HGET', KEYS[1], 'cap') or KEYS[5]
  if was ~= KEYS[3] then redis.call('SREM', was, ARGV[1]) end
elseif redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[5]) then
  -- Members whose entry is gone (removed by a replica that kept the sets per IP)
  -- do not count; drop them before refusing.
  local hprefix = string.sub(KEYS[1], 1, #KEYS[1] - #ARGV[1])
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[3])) do
    if redis.call('EXISTS', hprefix .. member) == 0 then
      redis.call('SREM', KEYS[3], member)
    end
  end
  if redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[5]) then return {0, now, '', 0} end
end
-- A new registration's counters start afresh (at random): the old one's last is void.
if cur ~= ARGV[4] then redis.call('HDEL', KEYS[1], 'beat') end
redis.call('HSET', KEYS[1], 'info', ARGV[2], 'owner', ARGV[3], 'token', ARGV[4], 'reg', reg,
  'cap', KEYS[3])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
local id = redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'op', 'upsert',
  'addr', ARGV[1], 'info', ARGV[2], 'owner', ARGV[3], 'token', ARGV[4], 'reg', reg, 'seen', now)
return {1, now, id, reg}
"""
)

# KEYS: h, seen, events.  ARGV: addr, token, info, maxlen.
_UPDATE = (
    _GROWS
    + _NOW
    + """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then return {0, now, '', '', 0} end
redis.call('HSET', KEYS[1], 'info', ARGV[3])
redis.call('ZADD', KEYS[2], now, ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'owner', 'reg')
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'op', 'upsert',
  'addr', ARGV[1], 'info', ARGV[3], 'owner', h[1], 'token', ARGV[2], 'reg', h[2], 'seen', now)
return {1, now, id, h[1], tonumber(h[2])}
"""
)

# KEYS: seen, events.  ARGV: maxlen, prefix, then addr, beat pairs (beat: the
# heartbeat counter as 20 digits, so that strings compare as the numbers do; '' for none).
_TOUCH = (
    _ALLOW_OOM
    + _NOW
    + """
local touched, missing = {}, {}
for i = 3, #ARGV, 2 do
  local addr, beat = ARGV[i], ARGV[i + 1]
  if redis.call('ZSCORE', KEYS[1], addr) then
    redis.call('ZADD', KEYS[1], now, addr)
    if beat ~= '' then
      local hk = ARGV[2] .. 'h:' .. addr
      local last = redis.call('HGET', hk, 'beat')
      if not last or last < beat then redis.call('HSET', hk, 'beat', beat) end
    end
    touched[#touched + 1] = addr
  else
    missing[#missing + 1] = addr
  end
end
if #touched > 0 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'op', 'touch',
    'addrs', table.concat(touched, ' '), 'seen', now)
end
return {now, missing}
"""
)

# KEYS: seen, events.  ARGV: prefix, maxlen, owner, then addr, token, beat triples.
# A heartbeat taken over (`RedisRegistry.take_over`): the registration must still be
# the one the heartbeat's MAC proves (its token: a removed or replaced host is never
# put back), and its counter above every one accepted before, by any replica (a
# replayed heartbeat moves nothing).  Result per host: 1 taken, 0 not registered,
# 2 replayed.
_TAKE_OVER = (
    _ALLOW_OOM
    + _NOW
    + """
local out, moved, first = {}, {}, nil
for i = 4, #ARGV, 3 do
  local addr, token, beat = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local hk = ARGV[1] .. 'h:' .. addr
  local h = redis.call('HMGET', hk, 'token', 'beat')
  if h[1] ~= token then
    out[#out + 1] = 0
  elseif h[2] and h[2] >= beat then
    out[#out + 1] = 2
  else
    redis.call('HSET', hk, 'owner', ARGV[3], 'beat', beat)
    redis.call('ZADD', KEYS[1], now, addr)
    moved[#moved + 1] = addr .. ' ' .. token
    first = first or addr
    out[#out + 1] = 1
  end
end
local id = ''
if #moved > 0 then
  -- 'addr' (the first host) only lets a replica of an older release, which knows no
  -- 'owner' op, read past the event during a rolling upgrade.
  id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'owner', 'addr', first,
    'owner', ARGV[3], 'addrs', table.concat(moved, ' '), 'seen', now)
end
return {now, out, id}
"""
)

_REMOVE_ONE = """
local function remove_one(prefix, seen, events, maxlen, addr, reason, token)
  local hk = prefix .. 'h:' .. addr
  local cur = redis.call('HGET', hk, 'token')
  if not cur or (token ~= '' and cur ~= token) then return false end
  local h = redis.call('HMGET', hk, 'info', 'owner', 'reg', 'cap')
  local cap = h[4]
  if not cap then  -- written before the cap set was kept per source: one per IP
    local ip = string.match(addr, '^%[(.*)%]:%d+$') or string.match(addr, '^(.*):%d+$')
    cap = prefix .. 'ip:' .. ip
  end
  local last = redis.call('ZSCORE', seen, addr) or '0'
  redis.call('DEL', hk)
  redis.call('ZREM', seen, addr)
  redis.call('SREM', cap, addr)
  local id = redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 'op', 'remove',
    'addr', addr, 'reason', reason, 'token', cur)
  return {id, h[1], h[2], cur, h[3], last}
end
"""

# KEYS: seen, events.  ARGV: prefix, maxlen, addr, reason, token ('' = any).
_REMOVE = (
    _ALLOW_OOM
    + _NOW
    + _REMOVE_ONE
    + """
local gone = remove_one(ARGV[1], KEYS[1], KEYS[2], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if gone then return {1, now, gone[1]} end
return {0, now, ''}
"""
)

# KEYS: seen, events, sweep, grace.  ARGV: prefix, maxlen, expire_ms, gap_ms, batch.
_EXPIRE = (
    _ALLOW_OOM
    + _NOW
    + _REMOVE_ONE
    + """
local last = tonumber(redis.call('GET', KEYS[3]) or '0')
redis.call('SET', KEYS[3], now)
if now - last > tonumber(ARGV[4]) then
  redis.call('SET', KEYS[4], now + tonumber(ARGV[3]))
  return {now, {}, now + tonumber(ARGV[3])}
end
local grace = tonumber(redis.call('GET', KEYS[4]) or '0')
if now < grace then return {now, {}, grace} end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]),
  'LIMIT', 0, tonumber(ARGV[5]))
local out = {}
for _, addr in ipairs(dead) do
  local gone = remove_one(ARGV[1], KEYS[1], KEYS[2], ARGV[2], addr, 'expired', '')
  if gone then
    out[#out + 1] = addr
    for _, v in ipairs(gone) do out[#out + 1] = v end
  end
end
return {now, out, 0}
"""
)


# KEYS: sweep, grace, epoch, hbkey.  ARGV: an epoch and a heartbeat key, written
# only where missing.  Returns TIME's two fields, then the four keys' values.
_CLOCK = (
    _ALLOW_OOM
    + """
local t = redis.call('TIME')
redis.call('SET', KEYS[3], ARGV[1], 'NX')
redis.call('SET', KEYS[4], ARGV[2], 'NX')
return {t[1], t[2], redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]),
  redis.call('GET', KEYS[3]), redis.call('GET', KEYS[4])}
"""
)

MIN_REDIS_VERSION = (7, 0)
"""Script flags (``#!lua flags=...``) are new in Redis 7.0."""


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{new_token()[:6]}"


def _sid(raw: bytes | str) -> StreamId:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _pack_info(info: HostInfo) -> bytes:
    # The wire encoding of a Register message is the one validated schema we
    # have; storing it means a record read back is re-validated like input.
    return encode(Register(host=info))


def _unpack_info(blob: bytes, limits: Limits) -> HostInfo:
    return decode_host(blob, limits)


def _lookup_key(key: str) -> Address:
    """The address an ``addrs`` word of a touch or owner event names, to look up
    in the index only: not validated (`parse_key` is, ~1.7 us), as a word that is
    no normalised address finds nothing there.  Raises ValueError."""
    host, _, port = key.rpartition(":")
    if not (port.isascii() and port.isdigit()):
        raise ValueError("not an address key")
    if host[:1] == "[":
        host = host[1:-1]
    return Address(host, int(port))


class RedisRegistry(Registry):
    def __init__(
        self,
        url: str,
        *,
        hide_after: float = 15.0,
        expire_after: float = 30.0,
        replica_id: str | None = None,
        prefix: str = "{mm}:",
        clock: Callable[[], float] = time.monotonic,
        op_timeout: float = 2.0,
        retry_interval: float = 1.0,
        sweep_gap: float | None = None,
        stream_maxlen: int = 100_000,
        observer: OpObserver | None = None,
        on_full: Callable[[str], None] | None = None,
        limits: Limits = DEFAULT_LIMITS,
        pool_size: int = 32,
        pool_timeout: float = 10.0,
        follow_interval: float = 0.01,
    ) -> None:
        super().__init__(
            replica_id=replica_id or default_replica_id(),
            hide_after=hide_after,
            expire_after=expire_after,
        )
        self.url = url
        self._p = prefix
        self._clock = clock
        self._retry_interval = retry_interval
        # A sweep gap longer than this means nobody could sweep: open a grace period.
        self._sweep_gap = sweep_gap if sweep_gap is not None else max(expire_after / 3, 2.0)
        self._maxlen = stream_maxlen
        self._observer = observer
        self._on_full = on_full  # told the operation Redis refused over its maxmemory
        # Stored info is re-validated when read back, with the limits it was accepted under.
        self._limits = limits
        # Operations wait (bounded) for one of `pool_size` connections instead of
        # failing: a thousand hosts registering at once is load, not an outage.
        # The gate does the waiting, so that running out of time is told apart
        # from a connection error (redis-py reports both as ConnectionError).
        # The pool has two more connections, for the stream follower's blocking
        # read and the notice subscription, which do not pass the gate; it
        # blocks too (bounded), never raising at once when full.
        if pool_size < 1 or pool_timeout <= 0:
            raise ValueError("need pool_size >= 1 and pool_timeout > 0")
        self._gate = asyncio.Semaphore(pool_size)
        self._pool_timeout = pool_timeout
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=pool_size + 2,
            timeout=pool_timeout,
            # No socket timeout: with one, redis-py sends each command through
            # ``asyncio.wait_for``, which on Python 3.11 drops a cancellation
            # landing as the send completes (`matchmaker.stopping`).  `_op`
            # bounds each call by ``op_timeout`` itself.
            socket_timeout=None,
            socket_connect_timeout=op_timeout,
            # One immediate retry on a fresh connection: after Redis restarts,
            # every pooled socket is dead once.  More retries would only delay
            # noticing a real outage (each costs up to op_timeout).
            retry=Retry(NoBackoff(), 1),
        )
        self._redis: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        self._scripts = {
            name: self._redis.register_script(src)
            for name, src in (
                ("upsert", _UPSERT),
                ("update", _UPDATE),
                ("touch", _TOUCH),
                ("take_over", _TAKE_OVER),
                ("remove", _REMOVE),
                ("expire", _EXPIRE),
                ("clock", _CLOCK),
            )
        }
        self._index = LocalIndex()
        self._owned: dict[Address, HostRecord] = {}
        self._pending_removals: dict[Address, str] = {}
        """Removals to replay, by address: the tokens of what Redis may hold of it,
        space-separated (two after a write that failed without an answer)."""
        self._unwritten: dict[str, str] = {}
        """Registrations made here while Redis was out of reach and not written back yet,
        by token: the tokens of what Redis may hold of the address instead ("" for
        nothing), which removing them leaves to remove (`remove`)."""
        self._ahead: dict[Address, StreamId] = {}
        self._offset = 0.0
        self._frozen_now: float | None = 0.0  # stale until the first sync
        self._synced = asyncio.Event()
        self._went_stale = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_id = "0-0"
        self._loaded_once = False
        self._told_unreachable = False  # the first failure before a load was logged
        self._closing = False
        self._grace_until = 0.0
        self._epoch: bytes | None = None
        self._carried: dict[Address, HostRecord] = {}
        self.refused_full: dict[str, int] = {}
        """Writes Redis refused over ``maxmemory``, by operation (``upsert``, ``update``)."""
        self._told_full = False  # registry_full logged; registry_not_full not yet
        self._full_told_at = -math.inf
        self._version_checked = False
        self._told_version = False
        self.dropped_events: dict[str, int] = {}
        """Stream events not applied, by reason (``bad_event``: a field missing or
        malformed; ``bad_record``: an upsert whose record does not validate), and
        stored hosts a load skipped (``bad_stored``: a key or a hash that does not
        validate; the rest of the registry loads)."""
        self._op_timeout = op_timeout
        self._block_ms = max(1, min(1000, int(op_timeout * 500)))
        # After a read that found changes, wait this long before the next one, so
        # that changes made meanwhile come in one reply (see `_follow`).
        self._follow_interval = follow_interval

    # ------------------------------------------------------------------ state

    @property
    def stale(self) -> bool:
        return self._frozen_now is not None

    @property
    def ready(self) -> bool:
        # Stale but loaded still serves its last known list; never loaded has nothing.
        return self._loaded_once

    def now(self) -> float:
        if self._frozen_now is not None:
            return self._frozen_now
        return self._clock() + self._offset

    def index(self) -> LocalIndex:
        return self._index

    def is_visible(self, record: HostRecord, now: float) -> bool:
        # During a post-outage grace period silence is not the hosts' fault.
        return now < self._grace_until or super().is_visible(record, now)

    def hidden_after(self, now: float) -> float:
        return math.inf if now < self._grace_until else self.hide_after

    def owned(self) -> list[HostRecord]:
        """Registrations this replica holds (and re-asserts after an outage)."""
        return list(self._owned.values())

    async def wait_synced(self) -> None:
        await self._synced.wait()

    async def wait_stale(self) -> None:
        await self._went_stale.wait()

    def _set_redis_now(self, now_ms: int) -> None:
        self._offset = now_ms / 1000.0 - self._clock()

    def _mark_stale(self, exc: BaseException) -> None:
        if self._frozen_now is None:
            self._frozen_now = self._clock() + self._offset
            log.warning("registry_stale", error=type(exc).__name__, detail=str(exc)[:200])
        elif not self._loaded_once and not self._told_unreachable:
            # Stale from the start (never loaded): the first failure says why, once.
            self._told_unreachable = True
            log.warning(
                "registry_stale", error=type(exc).__name__, detail=str(exc)[:200], loaded=False
            )
        self._synced.clear()
        self._went_stale.set()

    def _mark_fresh(self) -> None:
        if self._frozen_now is not None and self._loaded_once:
            log.info("registry_resynced", hosts=len(self._index))
        self._frozen_now = None
        self._loaded_once = True
        self._went_stale.clear()
        self._synced.set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start syncing in the background; returns at once (stale until loaded)."""
        self._tasks = [
            asyncio.create_task(self._sync_loop(), name="registry-sync"),
            asyncio.create_task(self._notice_loop(), name="registry-notices"),
        ]

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        pool = self._redis.connection_pool
        try:
            # redis-py can hold a cancelled blocking read until its socket closes;
            # dropping the pool's connections ends such reads at once.  It can
            # also swallow a cancellation outright (`matchmaker.stopping`), and
            # the task reconnects: hence the bound, and the second disconnect.
            with contextlib.suppress(*_DOWN, RedisError):
                await pool.disconnect()
            await cancel_and_wait(self._tasks, STOP_WITHIN, "registry")
            self._tasks.clear()
        finally:
            with contextlib.suppress(*_DOWN, RedisError):
                await self._redis.aclose()
            with contextlib.suppress(*_DOWN, RedisError):
                await pool.disconnect()  # ours: the client does not close a pool given to it
            await super().close()

    # ------------------------------------------------------------------ redis calls

    async def _op(self, name: str, call: Awaitable[Any], *, gated: bool = True) -> Any:
        """Run one Redis call, timing it; any Redis failure turns us stale.

        Not only connection failures: an error reply (READONLY after a
        failover, BUSY script) also means the write did not happen, and stale
        mode plus the resync afterwards is what repairs that.  Two refusals are
        not failures of Redis, raise a `RegistryBusy` and leave the registry
        fresh: waiting too long for a free connection, and Redis over its
        ``maxmemory`` refusing a registration or an update (`RegistryFull`; every
        other write is allowed over it, see `_GROWS`).  A stale registry would
        stop expiring hosts, the one thing that makes room again.
        """
        if gated:
            try:
                async with asyncio.timeout(self._pool_timeout):
                    await self._gate.acquire()
            except BaseException as exc:  # timed out, or cancelled while waiting
                if asyncio.iscoroutine(call):
                    call.close()  # never started: nothing was sent
                if not isinstance(exc, TimeoutError):
                    raise
                log.info("registry_busy", op=name, waited=self._pool_timeout)
                raise RegistryBusy(name) from None
        start = self._clock()
        try:
            # A call cut short drops its connection (redis-py disconnects on any
            # exception mid-read), so no late reply is read by the next call.
            async with asyncio.timeout(self._op_timeout):
                result = await call
        except OutOfMemoryError as exc:
            # A script flagged to grow Redis, refused before it ran: nothing written.
            self._observe(name, start, failed=True, full=True)
            self.refused_full[name] = self.refused_full.get(name, 0) + 1
            now = self._clock()
            if not self._told_full and now - self._full_told_at >= _FULL_LOG_INTERVAL:
                # Once, until a registration goes through again; at most once a
                # minute when memory hovers at the limit.
                self._told_full = True
                self._full_told_at = now
                log.warning("registry_full", op=name, detail=str(exc)[:200])
            raise RegistryFull(name) from exc
        except (*_DOWN, RedisError) as exc:
            self._observe(name, start, failed=True)
            self._mark_stale(exc)
            raise RegistryUnavailable(name) from exc
        finally:
            if gated:
                self._gate.release()
        self._observe(name, start, failed=False)
        if self._told_full and name in _GROWING_OPS:
            self._told_full = False
            log.info("registry_not_full", op=name)
        return result

    def _observe(self, name: str, start: float, *, failed: bool, full: bool = False) -> None:
        if self._observer is not None:
            self._observer(name, self._clock() - start, failed)
        if full and self._on_full is not None:
            self._on_full(name)

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._op(name, self._scripts[name](keys=keys, args=args))

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    # ------------------------------------------------------------------ writes

    async def upsert(self, address: Address, info: HostInfo, *, max_per_ip: int) -> HostRecord:
        token = new_token()
        if self.stale:
            return self._upsert_local(address, info, token, max_per_ip)
        try:
            rec, _ = await self._upsert_remote(address, info, token, max_per_ip, "new")
        except RegistryBusy:
            raise
        except RegistryUnavailable:
            # The script may have run (its reply lost): Redis may hold this token.
            return self._upsert_local(address, info, token, max_per_ip, maybe_written=True)
        if rec is None:
            raise TooManyHosts(address.ip)
        return rec

    async def _upsert_remote(
        self,
        address: Address,
        info: HostInfo,
        token: str,
        max_per_ip: int,
        mode: str,
        registered_at: float = 0.0,
        reasserting: HostRecord | None = None,
    ) -> tuple[HostRecord | None, int]:
        """Write one registration; the record written, or None and the status.

        `reasserting` is the record a re-assertion writes back: if another is ours
        (or none) by the time the reply comes, the host changed meanwhile, and the
        reply must not undo that; the next pass of `_resync` writes the change."""
        keys = [
            self._k("h", address.key),
            self._k("seen"),
            self._k("ip", source_key(address.ip)),
            self._k("events"),
            self._k("ip", address.ip),
        ]
        args = [address.key, _pack_info(info), self.replica_id, token, max_per_ip, self._maxlen]
        args += [mode, int(registered_at * 1000)]
        status, now_ms, sid, reg_ms = await self._script("upsert", keys, args)
        self._set_redis_now(now_ms)
        if status != 1:
            return None, status
        rec = HostRecord(
            address=address,
            info=info,
            owner=self.replica_id,
            token=token,
            registered_at=reg_ms / 1000.0,
            last_seen=now_ms / 1000.0,
        )
        if reasserting is None or self._owned.get(address) is reasserting:
            self._apply_own(rec, _sid(sid))
        return rec, status

    def _upsert_local(
        self,
        address: Address,
        info: HostInfo,
        token: str,
        max_per_ip: int,
        *,
        maybe_written: bool = False,
    ) -> HostRecord:
        """A registration made while Redis is out of reach. ``maybe_written``: a write
        of it failed without an answer, so Redis may hold it, or what it replaced: its
        removal replays both tokens (each removes only a match)."""
        prior = self._index.get(address)
        if prior is None and self._index.source_count(address.ip) >= max_per_ip:
            raise TooManyHosts(address.ip)
        if prior is None:
            stored = self._pending_removals.get(address, "")
        else:
            stored = self._unwritten.pop(prior.token, prior.token)
        rec = HostRecord(
            address=address,
            info=info,
            owner=self.replica_id,
            token=token,
            # Not the frozen clock: when this registration is re-asserted, it
            # replaces an entry registered in Redis before it (see _UPSERT).
            registered_at=self._clock() + self._offset,
            last_seen=self.now(),
        )
        self._apply_own(rec, None)
        self._unwritten[token] = f"{token} {stored}".strip() if maybe_written else stored
        return rec

    def _apply_own(self, rec: HostRecord, sid: StreamId | None) -> None:
        if sid is not None and sid <= self._last_id_tuple():
            # The reply came late: the follower has applied this write already,
            # and maybe newer ones on top (another replica took the address).
            cur = self._index.get(rec.address)
            if cur is not None and cur.token == rec.token:
                self._owned[rec.address] = cur
                self._pending_removals.pop(rec.address, None)
            return
        # The follower may have applied this very write from the stream while
        # the script's reply was on its way: then there is nothing new to tell.
        known = self._index.put(rec) == rec
        self._owned[rec.address] = rec
        self._pending_removals.pop(rec.address, None)
        if sid is not None and self._last_id_tuple() < sid:
            self._ahead[rec.address] = sid
        if not known:
            self._publish(Change(kind=ChangeKind.UPSERT, address=rec.address, record=rec))

    def _last_id_tuple(self) -> StreamId:
        return _sid(self._last_id)

    async def update(self, address: Address, token: str, info: HostInfo) -> HostRecord:
        cur = self._index.get(address)
        if cur is None or cur.token != token:
            raise NotRegistered(str(address))
        if not self.stale:
            keys = [self._k("h", address.key), self._k("seen"), self._k("events")]
            args = [address.key, token, _pack_info(info), self._maxlen]
            try:
                ok, now_ms, sid, _owner, _reg = await self._script("update", keys, args)
            except RegistryBusy:
                raise
            except RegistryUnavailable:
                pass
            else:
                self._set_redis_now(now_ms)
                if not ok:
                    raise NotRegistered(str(address))
                rec = _replace(cur, info=info, last_seen=now_ms / 1000.0)
                self._apply_own(rec, _sid(sid))
                return rec
        rec = _replace(cur, info=info, last_seen=self.now())
        self._apply_own(rec, None)
        return rec

    async def touch(self, addresses: Collection[Address]) -> set[Address]:
        if not addresses:
            return set()
        if not self.stale:
            try:
                return await self._touch_remote(addresses)
            except RegistryBusy:
                raise
            except RegistryUnavailable:
                pass
        now = self.now()
        return {a for a in addresses if not self._index.touch(a, now)}

    async def _touch_remote(self, addresses: Collection[Address]) -> set[Address]:
        # A mapping gives each host's last heartbeat counter, kept in Redis so that
        # another replica taking the host over refuses it replayed (`take_over`).
        beats: Mapping[Address, int] = addresses if isinstance(addresses, Mapping) else {}
        args: list[Any] = [self._maxlen, self._p]
        for a in addresses:
            beat = beats.get(a, 0)
            args += [a.key, _beat_text(beat) if beat else ""]
        now_ms, missing = await self._script("touch", [self._k("seen"), self._k("events")], args)
        self._set_redis_now(now_ms)
        gone = {parse_key(m.decode()) for m in missing}
        for a in addresses:
            if a not in gone:
                self._index.touch(a, now_ms / 1000.0)
        return gone

    async def take_over(self, beats: Sequence[Takeover]) -> list[TakeoverResult]:
        """Make this replica the owner of each host whose heartbeat it accepted,
        in one script (`_TAKE_OVER`): only for the registration the heartbeat
        proves, and only with a counter above every one accepted before."""
        if not beats:
            return []
        if self.stale:
            raise RegistryUnavailable("take_over")
        args: list[Any] = [self._p, self._maxlen, self.replica_id]
        for t in beats:
            args += [t.address.key, t.token, _beat_text(t.beat)]
        now_ms, codes, sid = await self._script(
            "take_over", [self._k("seen"), self._k("events")], args
        )
        self._set_redis_now(now_ms)
        results = [_TAKEOVER_CODES[int(c)] for c in codes]
        taken = [t for t, r in zip(beats, results, strict=True) if r is TakeoverResult.TAKEN]
        if taken and _sid(sid) > self._last_id_tuple():
            # Not yet applied by the follower (which may be past it already: then
            # newer writes are in the index and must stay).
            pairs = [(t.address, t.token) for t in taken]
            self._apply_owner(self.replica_id, pairs, now_ms / 1000.0)
        return results

    def _apply_owner(self, owner: str, pairs: list[tuple[Address, str]], seen: float) -> None:
        """Hosts taken over by replica `owner` (the same registrations: their token)."""
        for address, token in pairs:
            rec = self._index.get(address)
            if rec is None or rec.token != token:
                continue  # replaced or removed since
            rec.owner = owner
            self._index.touch(address, seen)
            if owner == self.replica_id:
                self._owned[address] = rec
            else:
                mine = self._owned.get(address)
                if mine is not None and mine.token == token:
                    del self._owned[address]  # not ours to re-assert any more

    async def remove(
        self, address: Address, reason: RemovalReason, *, token: str | None = None
    ) -> bool:
        cur = self._index.get(address)
        if not self.stale:
            keys = [self._k("seen"), self._k("events")]
            args = [self._p, self._maxlen, address.key, reason.value, token or ""]
            try:
                ok, now_ms, sid = await self._script("remove", keys, args)
            except RegistryBusy:
                raise
            except RegistryUnavailable:
                pass
            else:
                self._set_redis_now(now_ms)
                if ok:
                    self._remove_local(address, reason, _sid(sid))
                return bool(ok)
        if cur is None or (token is not None and cur.token != token):
            return False
        # Replayed for what Redis may hold only: a registration made here meanwhile
        # never reached it (the one it replaced may have), so the removals kept never
        # outnumber the hosts Redis held, however many come and go during the outage.
        stored = self._unwritten.pop(cur.token, cur.token)
        if stored:
            self._pending_removals[address] = stored
        self._remove_local(address, reason, None)
        return True

    def _remove_local(self, address: Address, reason: RemovalReason, sid: StreamId | None) -> None:
        if sid is not None and sid <= self._last_id_tuple():
            return  # the follower applied this removal already, maybe newer writes too
        self._owned.pop(address, None)
        if sid is not None and self._last_id_tuple() < sid:
            self._ahead[address] = sid
        if self._index.pop(address) is not None:
            self._publish(Change(kind=ChangeKind.REMOVE, address=address, reason=reason))

    async def expire(self) -> list[HostRecord]:
        if self.stale:
            return []  # never expire on a clock we cannot see
        keys = [self._k("seen"), self._k("events"), self._k("sweep"), self._k("grace")]
        args = [self._p, self._maxlen, int(self.expire_after * 1000)]
        args += [int(self._sweep_gap * 1000), 1000]
        try:
            now_ms, dead, grace = await self._script("expire", keys, args)
        except RegistryUnavailable:
            return []
        self._set_redis_now(now_ms)
        # The grace period Redis keeps (its end, 0 for none): this replica's ends with
        # it. Extending its own by expire_after from whenever it saw Redis's still
        # running kept hosts listed up to twice as long as the grace meant.
        if grace and self._grace_until < grace / 1000.0:
            if self._grace_until < now_ms / 1000.0:
                log.info("expiry_grace", seconds=round(grace / 1000.0 - now_ms / 1000.0, 3))
            self._grace_until = grace / 1000.0
        self._drop_carried(now_ms / 1000.0)
        # Records come from the script, not the index: the follower may
        # already have applied these removals.
        out: list[HostRecord] = []
        for i in range(0, len(dead), 7):
            key, sid, info, owner, token, reg, seen = dead[i : i + 7]
            row = {b"info": info, b"owner": owner, b"token": token, b"reg": reg}
            rec = _record(key.decode(), row, float(seen) / 1000.0, self._limits)
            if rec is not None:
                out.append(rec)
                self._remove_local(rec.address, RemovalReason.EXPIRED, _sid(sid))
        return out

    # ------------------------------------------------------------------ notices

    async def deliver(self, owner: str, notice: Notice) -> None:
        if owner == self.replica_id:
            self._receive_notice(notice)
            return
        # Two fields unless forwarded: what a replica of the previous release reads
        # (it unpacks exactly two), so that introductions cross a rolling upgrade.
        fields: list[Any] = [notice.target.key, notice.payload]
        if notice.forwarded:
            fields.append(True)
        payload = msgpack.packb(fields, use_bin_type=True)
        await self._op("publish", self._redis.publish(self._k("notice", owner), payload))

    async def _notice_loop(self) -> None:
        channel = self._k("notice", self.replica_id)
        up = True
        while not self._closing:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                up = True
                # Not ``while True``: a cancellation redis-py swallowed must not
                # keep this loop alive (`matchmaker.stopping`).
                while not self._closing:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None:
                        self._on_notice(msg.get("data"))
            except (*_DOWN, RedisError) as exc:
                if up:  # once per outage, not once per retry
                    log.info("notice_channel_down", error=type(exc).__name__)
                up = False
                await asyncio.sleep(self._retry_interval)
            finally:
                with contextlib.suppress(*_DOWN, RedisError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _on_notice(self, data: object) -> None:
        try:
            key, payload, *rest = msgpack.unpackb(data, raw=False)  # type: ignore[arg-type]
            if not isinstance(payload, bytes):
                raise TypeError(f"a notice's payload is bytes, not {type(payload).__name__}")
            forwarded = bool(rest[0]) if rest else False  # a replica of an older release
            notice = Notice(parse_key(key), payload, forwarded)
        except Exception as exc:  # another replica's bug must not kill the loop
            self._drop_notice("malformed")
            log.warning("bad_notice", error=type(exc).__name__)
            return
        self._receive_notice(notice)

    # ------------------------------------------------------------------ sync

    def _check_closing(self) -> None:
        """Between two Redis calls of a long job: stop if closing.  A cancellation
        redis-py swallowed (`matchmaker.stopping`) must not leave it running."""
        if self._closing:
            raise RegistryUnavailable("closing")

    async def _sync_loop(self) -> None:
        while not self._closing:
            try:
                await self._resync()
                self._mark_fresh()
                await self._follow()
            except (RegistryUnavailable, *_DOWN) as exc:
                if self._closing:
                    return
                self._mark_stale(exc)
                await asyncio.sleep(self._retry_interval)
            except Exception as exc:  # a bug or odd reply must not end syncing for good
                log.exception("registry_sync_failed")
                self._mark_stale(exc)
                await asyncio.sleep(self._retry_interval)

    async def _resync(self) -> None:
        """Reload the index, then replay removals and re-assert what we own.

        The stream position is read *before* the load, so every change made
        during the load is also replayed afterwards; replaying an upsert,
        remove or touch over a state that already has it changes nothing.
        Hosts may register or leave on this replica while this runs (the
        registry is still stale), hence the loop until nothing is left to do.

        The loaded copy is merged before it replaces the index, so that a list
        never shows fewer hosts than before (`_merge`).
        """
        if not self._version_checked:
            await self._check_version()
        last = await self._op("xrevrange", self._redis.xrevrange(self._k("events"), count=1))
        self._last_id = last[0][0].decode() if last else "0-0"
        fresh, lost = await self._load()
        self._drop_taken_over(fresh)
        # What Redis holds of ours, before our own records are merged in.
        stored = {a: fresh.get(a) for a in self._owned}
        self._merge(fresh, lost)
        _carry_beats(self._index, fresh)
        self._index = fresh
        self._ahead.clear()
        # The registration and info each host was written back with: one updated
        # or registered again meanwhile is written back again.
        done: dict[Address, tuple[str, HostInfo]] = {}
        while True:
            self._check_closing()
            removals = dict(self._pending_removals)
            todo = {a: r for a, r in self._owned.items() if done.get(a) != (r.token, r.info)}
            if not removals and not todo:
                self._unwritten.clear()  # written back, or replaced by others meanwhile
                return
            for address, token in removals.items():
                await self._replay_removal(address, token)
            await self._reassert(todo, stored)
            done.update((a, (r.token, r.info)) for a, r in todo.items())

    async def _check_version(self) -> None:
        """Refuse, with one clear log line, a Redis older than `MIN_REDIS_VERSION`:
        it cannot run the scripts (their flags).  The replica stays stale (never
        ready) and checks again at each retry."""
        try:
            async with asyncio.timeout(self._op_timeout):
                server = await self._redis.info("server")
        except ResponseError:
            self._version_checked = True  # INFO renamed away: not checked
            return
        text = str(server.get("redis_version", ""))
        try:
            version = tuple(int(part) for part in text.split(".")[:2])
        except ValueError:
            version = MIN_REDIS_VERSION  # not a number: a compatible server's own scheme
        if version < MIN_REDIS_VERSION:
            if not self._told_version:
                self._told_version = True
                need = ".".join(map(str, MIN_REDIS_VERSION))
                log.error("redis_unsupported", version=text[:32], need=need)
            raise RegistryUnavailable("redis_unsupported")
        self._version_checked = True

    def _drop_taken_over(self, fresh: LocalIndex) -> None:
        """Stop counting as ours the hosts another replica took over while we were
        cut off: `fresh` (the copy just loaded) holds the same registration (its
        token) under another owner.  The follower would have dropped them on the
        ``owner`` event, which came while it was not reading."""
        for address, rec in list(self._owned.items()):
            there = fresh.get(address)
            if there is not None and there.token == rec.token and there.owner != self.replica_id:
                del self._owned[address]
                log.info("reassert_lost", host=address.key, owner=there.owner[:64])

    def _merge(self, fresh: LocalIndex, lost: bool) -> None:
        """Put into `fresh` (the copy just loaded) what it lacks and must not lose.

        * Our own hosts: written back by `_reassert` right after, listed meanwhile.
        * When Redis lost its data (it came back empty: `_load` saw a new
          epoch), every other host we listed too.  Their replicas write them
          back within the grace period that an empty Redis opens; whatever is
          still only here when it ends is dropped (`_drop_carried`).

        * The hosts carried over since an earlier loss that Redis still lacks: a
          short outage within the grace period does not end it for them.

        Otherwise a host absent from Redis was removed or expired while we were
        away, and is not carried over.
        """
        for address, rec in self._owned.items():
            if fresh.get(address) is None and address not in self._pending_removals:
                fresh.put(rec)
        # Still listed as carried: not written back, removed or replaced since.
        carried = [r for a, r in self._carried.items() if self._index.get(a) is r]
        self._carried.clear()
        for rec in self._index if lost else carried:
            if fresh.get(rec.address) is None and rec.address not in self._pending_removals:
                fresh.put(rec)
                self._carried[rec.address] = rec
        if lost and self._carried:
            log.info("registry_refilled", carried=len(self._carried))

    def _drop_carried(self, now: float) -> None:
        """After the grace period, forget carried hosts nobody wrote back."""
        if not self._carried or now < self._grace_until:
            return
        carried, self._carried = self._carried, {}
        for address, rec in carried.items():
            if self._index.get(address) is rec:
                self._index.pop(address)
                self._publish(
                    Change(kind=ChangeKind.REMOVE, address=address, reason=RemovalReason.EXPIRED)
                )

    async def _replay_removal(self, address: Address, tokens: str) -> None:
        """Remove what Redis holds of ``address`` if it is one of ``tokens``."""
        keys = [self._k("seen"), self._k("events")]
        names = tokens.split()
        for token in names:
            args = [self._p, self._maxlen, address.key, RemovalReason.DISCONNECTED.value, token]
            await self._script("remove", keys, args)
        if self._pending_removals.get(address) == tokens:
            del self._pending_removals[address]
        there = self._index.get(address)
        if there is not None and there.token in names:
            self._index.pop(address)

    async def _load(self) -> tuple[LocalIndex, bool]:
        """The stored hosts, and whether Redis lost its data since the last load."""
        seen = await self._op("zrange", self._redis.zrange(self._k("seen"), 0, -1, withscores=True))
        fresh = LocalIndex()
        batch = 500
        for i in range(0, len(seen), batch):
            self._check_closing()
            chunk: list[tuple[str, float]] = []
            for member, score in seen[i : i + batch]:
                try:
                    chunk.append((member.decode(), score))
                except UnicodeDecodeError as exc:
                    self._drop_event("bad_stored", member[:64], exc)
            pipe = self._redis.pipeline(transaction=False)
            for key, _score in chunk:
                pipe.hgetall(self._k("h", key))
            rows = await self._op("load", pipe.execute())
            for (key, score), row in zip(chunk, rows, strict=True):
                rec = _record(key, row, score / 1000.0, self._limits)
                if rec is not None:
                    fresh.put(rec)
                else:
                    self.dropped_events["bad_stored"] = self.dropped_events.get("bad_stored", 0) + 1
        lost = await self._load_clock()
        return fresh, lost

    async def _load_clock(self) -> bool:
        """Redis time, whether expiry is (or is about to be) in a grace period, and
        whether Redis lost its data since the last load.

        The ``epoch`` key holds a random value, written by whichever replica
        finds it missing: a different value than last time means the data
        this replica loaded before is gone (a restart without persistence, a
        flush, a failover to an empty replica).

        One script (`_CLOCK`), allowed over ``maxmemory``: a replica must resync
        while Redis is full, since only fresh replicas expire hosts and so make
        room again.
        """
        keys = [self._k("sweep"), self._k("grace"), self._k("epoch"), self._k("hbkey")]
        # Every replica derives heartbeat secrets from the same key (written back
        # by the first replica to reload after Redis lost its data).
        args: list[Any] = [new_token(), self.heartbeat_key]
        call = self._scripts["clock"](keys=keys, args=args)
        secs, usecs, sweep, grace, epoch, key = await self._op("time", call)
        if isinstance(key, bytes) and len(key) == len(self.heartbeat_key):
            self.heartbeat_key = key
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        now_ms = int(secs) * 1000 + int(usecs) // 1000
        self._set_redis_now(now_ms)
        grace_ms = int(grace or 0)
        if now_ms - int(sweep or 0) > self._sweep_gap * 1000:
            # Nobody swept for a while: the next sweep opens a grace period.
            grace_ms = max(grace_ms, now_ms + int(self.expire_after * 1000))
        self._grace_until = grace_ms / 1000.0
        return lost

    async def _reassert(
        self, todo: dict[Address, HostRecord], stored: dict[Address, HostRecord | None]
    ) -> None:
        """Write back the registrations in `todo`; `stored` is what Redis holds of
        them, kept up to date with what this writes."""
        still_ours: list[Address] = []
        for address, rec in todo.items():
            self._check_closing()
            there = stored.get(address)
            # Written back unless Redis holds it, ours, as it is here (other info:
            # updated locally during the outage).
            if (
                there is not None
                and there.token == rec.token
                and there.owner == self.replica_id
                and there.info == rec.info
            ):
                still_ours.append(address)
                continue
            # Redis may hold it from now on: removing it removes it, not the one before.
            self._unwritten.pop(rec.token, None)
            # 10**6: the host was accepted under the cap once; do not evict it
            # because others registered from its IP while we were away.
            try:
                got, status = await self._upsert_remote(
                    address, rec.info, rec.token, 10**6, "reassert", rec.registered_at, rec
                )
            except RegistryFull:
                self._refused_reassert(address, rec, there)
                continue
            if got is not None:
                stored[address] = got
                continue
            log.info("reassert_lost", host=address.key, status=status)
            if self._owned.get(address) is rec:  # not registered again meanwhile
                del self._owned[address]
        if still_ours:
            await self._touch_remote(still_ours)

    def _refused_reassert(
        self, address: Address, rec: HostRecord, there: HostRecord | None
    ) -> None:
        """A registration made here while Redis was out of reach, refused on the way
        back because Redis is full: as if it had never been accepted.  Lists drop it
        and the host, told `not_registered` by its next heartbeat, registers again
        (and is told "unavailable" while Redis stays full).  A resync must not fail
        for it: a stale replica expires nothing, and Redis would stay full."""
        log.info("reassert_refused", host=address.key, reason="registry_full")
        if self._owned.get(address) is not rec:
            return  # registered again or removed meanwhile: that is written next
        if there is not None and there.token == rec.token and there.owner == self.replica_id:
            # Redis holds this registration still, with older info: it stays ours.
            self._owned[address] = there
            return
        del self._owned[address]
        if self._index.get(address) is rec:
            self._index.pop(address)
            self._publish(
                Change(kind=ChangeKind.REMOVE, address=address, reason=RemovalReason.EXPIRED)
            )

    async def _follow(self) -> None:
        stream = self._k("events")
        while not self._closing:
            if self.stale:
                # Another operation failed meanwhile: what we have may have
                # missed writes (ours went local only), so start over.
                raise RegistryUnavailable("resync")
            resp = await self._op(
                "xread",
                self._redis.xread(
                    {stream: self._last_id}, count=_FOLLOW_COUNT, block=self._block_ms
                ),
                gated=False,  # a connection of its own (see __init__)
            )
            read = 0
            for _name, entries in resp or ():
                read += len(entries)
                for sid, fields in entries:
                    self._last_id = sid.decode()
                    try:
                        self._apply_event(_sid(sid), fields)
                    except _BAD_DATA as exc:  # Redis is shared, not trusted: drop, go on
                        self._drop_event("bad_event", sid, exc)
            if 0 < read < _FOLLOW_COUNT:
                # A read costs ~150 us of CPU beside its events: woken for each
                # change, a replica spent more on reading than on applying them.
                # Waiting lets the changes of the next interval come in one reply
                # (at most 1 / follow_interval reads a second), for that much lag.
                await asyncio.sleep(self._follow_interval)

    def _drop_event(self, reason: str, sid: bytes | str, exc: BaseException) -> None:
        self.dropped_events[reason] = self.dropped_events.get(reason, 0) + 1
        where = sid.decode(errors="replace") if isinstance(sid, bytes) else sid
        log.warning(reason, id=where[:64], error=type(exc).__name__)

    def _apply_event(self, sid: StreamId, fields: dict[bytes, bytes]) -> None:
        op = fields.get(b"op")
        if op == b"touch":
            seen = int(fields[b"seen"]) / 1000.0
            touch = self._index.touch
            for key in fields[b"addrs"].decode().split():
                touch(_lookup_key(key), seen)
            return
        if op == b"owner":
            words = fields[b"addrs"].decode().split()
            pairs = [(_lookup_key(k), t) for k, t in zip(words[::2], words[1::2], strict=True)]
            self._apply_owner(fields[b"owner"].decode(), pairs, int(fields[b"seen"]) / 1000.0)
            return
        address = parse_key(fields[b"addr"].decode())
        mine = self._ahead.get(address)
        if mine is not None:
            if sid == mine:
                del self._ahead[address]
            if sid <= mine:
                return  # our own write (or an older one): already applied locally
            del self._ahead[address]
        if op == b"upsert":
            self._apply_upsert_event(address, fields)
        elif op == b"remove":
            # Everything read before anything changes: a bad field changes nothing.
            reason = RemovalReason(fields[b"reason"].decode())
            token = fields.get(b"token", b"").decode()
            owned = self._owned.get(address)
            if owned is not None and owned.token == token:
                self._owned.pop(address)
            if self._index.pop(address) is not None and self._subscriptions:
                self._publish(Change(kind=ChangeKind.REMOVE, address=address, reason=reason))

    def _apply_upsert_event(self, address: Address, fields: dict[bytes, bytes]) -> None:
        try:
            rec = HostRecord(
                address=address,
                info=_unpack_info(fields[b"info"], self._limits),
                owner=fields[b"owner"].decode(),
                token=fields[b"token"].decode(),
                registered_at=int(fields[b"reg"]) / 1000.0,
                last_seen=int(fields[b"seen"]) / 1000.0,
            )
        except _BAD_DATA as exc:
            self._drop_event("bad_record", address.key, exc)
            return
        owned = self._owned.get(address)
        if owned is not None and owned.token != rec.token:
            self._owned.pop(address)  # re-registered elsewhere: not ours any more
        self._index.put(rec)
        if self._subscriptions:  # none in the daemon: no Change per event
            self._publish(Change(kind=ChangeKind.UPSERT, address=address, record=rec))


def _carry_beats(old: LocalIndex, fresh: LocalIndex) -> None:
    """Give `fresh`'s records the heartbeat counters `old` accepted for the same
    registrations: Redis does not store them, and a counter back at its start
    would take a recorded heartbeat again."""
    for rec in fresh:
        before = old.get(rec.address)
        if before is not None and before.token == rec.token:
            rec.beat = max(rec.beat, before.beat)


def _beat_text(beat: int) -> str:
    """A heartbeat counter as Redis keeps it: 20 digits, so that Lua compares the
    strings as the numbers (its numbers are doubles, short of 64 bits)."""
    return f"{beat:020d}"


_TAKEOVER_CODES = {
    0: TakeoverResult.NOT_REGISTERED,
    1: TakeoverResult.TAKEN,
    2: TakeoverResult.REPLAYED,
}


_BAD_DATA = (KeyError, ValueError, ArithmeticError, MessageError)
"""What a malformed stored host or stream entry raises (a missing field, bytes that
are not UTF-8 or not a number, a number too large for a float, an invalid info);
anything else is a bug, and goes up to force a reload."""


def _record(key: str, row: dict[bytes, bytes], seen: float, limits: Limits) -> HostRecord | None:
    """A HostRecord from a stored hash, or None if it is incomplete or invalid."""
    try:
        return HostRecord(
            address=parse_key(key),
            info=_unpack_info(row[b"info"], limits),
            owner=row[b"owner"].decode(),
            token=row[b"token"].decode(),
            registered_at=int(row[b"reg"]) / 1000.0,
            last_seen=seen,
            beat=int(row.get(b"beat", b"0")),
        )
    except _BAD_DATA as exc:
        log.warning("bad_record", host=key[:64], error=type(exc).__name__)
        return None


def _replace(r: HostRecord, *, info: HostInfo, last_seen: float) -> HostRecord:
    return HostRecord(
        address=r.address,
        info=info,
        owner=r.owner,
        token=r.token,
        registered_at=r.registered_at,
        last_seen=last_seen,
    )
