"""Valve's master server query and Quake III's ``getservers``, from the matchmaker's index.

Theory of operation
-------------------
Server browsers that predate us ask a *master server* for a list of addresses,
then query each game host themselves (A2S, see ``matchmaker.browsers``).  Two
protocols are answered on one UDP port (``--master``, off by default), both from
the registry's local index through `catalog.visible`, so they list what our own
lists do, with the same filters and the same per-source rate (``list_rate``):

=====================  =====================================================
request                layout
=====================  =====================================================
Steam master query     ``31`` region u8, seed ``"ip:port\\0"``, filter ``"\\k\\v...\\0"``
Steam reply            ``FF FF FF FF 66 0A``, then IPv4 u32 + port u16 (big-endian)
                       per host; ``0.0.0.0:0`` ends the list
Q3 ``getservers``      ``FF FF FF FF "getservers <protocol> [empty] [full]"``
Q3 ``getserversExt``   ``FF FF FF FF "getserversExt <game> <protocol> [ipv4]
                       [ipv6] [empty] [full]"``
Q3 reply               ``FF FF FF FF "getservers[Ext]Response"``, then ``\\`` + IPv4
                       u32 + port u16 per host (``/`` + IPv6 + port, Ext
                       only), ``\\EOT\\0\\0\\0`` at the end of the list
=====================  =====================================================

No reply to an unvalidated address may be larger than what caused it, and
neither protocol validates the requester.  So a reply holds only as many
entries as fit in the size of its request:

* Steam: clients page by seed (the last address they got), so they still get
  the whole list, in more round trips (``(request - 6) // 6`` hosts a page; a
  13-byte unfiltered request gets one host a page).  Hosts are in address
  order, so a seed names a place in the list.
* Quake III has no paging: a client gets a random sample of at most as many
  hosts as its request leaves room for, and ``EOT`` only when the rest of the
  list fit.  A stock ``getservers 68 empty full`` request (29 bytes) leaves room
  for one entry and no ``EOT``; longer requests (more keywords) get more.

A request too short for the smallest answer (the reply's header and one entry,
or the end of the list) is dropped (``no_room``) before anything else: it takes
no token and reads no host.

What a query costs, in total and not only per source (the sources may all be
spoofed, and each new one has a full bucket): reading the list is a pass over
every host of the games it covers (`catalog.visible`).  That pass is made at
most `SCAN_RATE` times a second for all sources together, and
`SOURCE_SCAN_RATE` times for one source (the rest are refused as rate limited),
and what it finds is kept for `LIST_SECONDS` (at most
`LISTS_KEPT` lists, the least recently used given up first), ready to answer:
the same query again, and each next page of it, costs a binary search and a
slice (Steam: the list is kept in reply form, 6 bytes a host in address order),
or a sample of as many hosts as fit (Quake III).  So a list may be up to
`LIST_SECONDS` old.

Steam filter keys understood: ``gamedir`` (the game), ``map``, ``empty``
(not empty), ``full`` (not full), ``noplayers``, ``password``, ``gametype``
(tags, all of them), ``name_match`` and ``version_match`` (``*`` wildcards).
Other keys are ignored; a request using ``nor``/``nand`` (negations we do not
evaluate) gets an empty list.  Only IPv4 hosts are listed (the format has no
room for IPv6).

A wildcard pattern is matched without regular expressions and without a cache:
split on ``*``, its pieces are found in order with `str.startswith`, `str.find`
and `str.endswith`, case-insensitively, so a query's cost is linear in the
pattern and the names, and nothing a query asks for is kept but the list it
made (above: the filter is its key).  A pattern is at
most as long as the longest name (or version) the registry accepts with a ``*``
before and after each of its characters; a query with a longer one is taken
for malformed and dropped (``pattern_too_long``).  The protocols have no error
reply: a request is answered or dropped, and each drop is counted by reason in
`MasterResponder.drops`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from matchmaker.addresses import Address, from_sockaddr, rate_key
from matchmaker.catalog import EVERY_GAME, visible
from matchmaker.messages import DEFAULT_LIMITS, ListFilter
from matchmaker.ratelimit import Rate, RateLimiter
from matchmaker.registry import Registry
from matchmaker.registry.base import HostRecord

log = logging.getLogger(__name__)

HEADER = b"\xff\xff\xff\xff"
STEAM_QUERY = 0x31
STEAM_REPLY = HEADER + b"\x66\x0a"
STEAM_END = b"\x00" * 6
Q3_REPLY = HEADER + b"getserversResponse"
Q3_EXT_REPLY = HEADER + b"getserversExtResponse"
Q3_EOT = b"\\EOT\x00\x00\x00"
IPV4_ENTRY = struct.Struct("!4sH")
IPV6_ENTRY = struct.Struct("!16sH")
MAX_REQUEST = 1024
UNSUPPORTED_STEAM_KEYS = frozenset({"nor", "nand"})
_SEED = re.compile(rb"(\d{1,3}(?:\.\d{1,3}){3}):(\d{1,5})")
# The longest wildcard pattern taken: a ``*`` around every character of the longest
# name (version) the registry accepts (messages.Limits, not configurable).
MAX_NAME_PATTERN = 2 * DEFAULT_LIMITS.name_chars + 1
MAX_VERSION_PATTERN = 2 * DEFAULT_LIMITS.ident_chars + 1
SCAN_RATE = Rate(rate=10.0, burst=10.0)
"""Passes over the hosts (`catalog.visible`) per second, all sources together.  A
pass over 20,000 hosts takes about 20 ms, so this caps the port at about a fifth
of a core however many sources ask; lists already made answer without one."""
SOURCE_SCAN_RATE = Rate(rate=1.0, burst=2.0)
"""Passes one source (an IPv4 address, an IPv6 /64) may have of `SCAN_RATE`: one
sender of distinct filters cannot spend them all (spoofed sources still can: they
share them with everyone)."""
LIST_SECONDS = 1.0
"""How long the list one pass made answers the same query (and its next pages)."""
LISTS_KEPT = 16
"""Lists kept at once, per protocol (a Steam one is 6 bytes a host)."""
DROP_REASONS = ("not_a_query", "no_room", "pattern_too_long")
"""Why a datagram got no answer (`MasterResponder.drops`): not a request we know,
no room in its size for any answer, a wildcard pattern over its cap."""


@dataclass(frozen=True, slots=True)
class SteamQuery:
    region: int
    seed: tuple[int, int]
    """(IPv4 as an integer, port) of the last host the client got; (0, 0) to start."""
    filters: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Q3Query:
    ext: bool
    game: str | None
    families: tuple[int, ...]
    empty: bool
    full: bool


# -- decoding ---------------------------------------------------------------------


def decode_steam(data: bytes) -> SteamQuery | None:
    """The Steam master query in `data`, or None.

    The seed is read as the leading ``ip:port``, and the filter as what follows its
    terminating NUL: qstat 2.17 sends its follow-up pages with a stray byte between
    the seed and its NUL and no filter, and those are answered too.
    """
    if len(data) < 4 or data[0] != STEAM_QUERY or len(data) > MAX_REQUEST:
        return None
    seed_match = _SEED.match(data, 2)
    if seed_match is None:
        return None
    end = data.find(b"\x00", seed_match.end())
    if end < 0:
        return None
    filter_end = data.find(b"\x00", end + 1)
    try:
        seed = (int(ipaddress.IPv4Address(seed_match[1].decode())), int(seed_match[2]))
        text = data[end + 1 : filter_end if filter_end >= 0 else len(data)].decode("utf-8")
    except ValueError:
        return None
    if not 0 <= seed[1] <= 65535:
        return None
    parts = text.split("\\")
    if parts and parts[0] == "":
        parts = parts[1:]
    pairs = tuple(zip(parts[0::2], parts[1::2], strict=False))
    return SteamQuery(region=data[1], seed=seed, filters=pairs)


def decode_q3(data: bytes) -> Q3Query | None:
    """The Quake III ``getservers``/``getserversExt`` request in `data`, or None."""
    if not data.startswith(HEADER) or len(data) > MAX_REQUEST:
        return None
    try:
        words = data[4:].decode("ascii").split()
    except UnicodeDecodeError:
        return None
    if not words:
        return None
    keywords = set(words[2:] if words[0] == "getservers" else words[3:])
    if words[0] == "getservers" and len(words) >= 2:
        game = None
        ext = False
    elif words[0] == "getserversExt" and len(words) >= 3:
        game = words[1]
        ext = True
    else:
        return None
    families = tuple(f for f, k in ((4, "ipv4"), (6, "ipv6")) if k in keywords) if ext else (4,)
    return Q3Query(
        ext=ext,
        game=game,
        families=families or (4,),
        empty="empty" in keywords,
        full="full" in keywords,
    )


# -- filters ---------------------------------------------------------------------


Predicate = Callable[[HostRecord], bool]


class MalformedFilter(ValueError):
    """A Steam filter dropped unanswered; `reason` is one of `DROP_REASONS`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def steam_filter(pairs: tuple[tuple[str, str], ...]) -> tuple[ListFilter, Predicate] | None:
    """The ListFilter and the extra test a Steam filter string asks for; None for one
    we cannot evaluate (negations).  Raises `MalformedFilter` for one to drop."""
    f = ListFilter(game=EVERY_GAME, family=4)
    tests: list[Predicate] = []
    for key, value in pairs:
        key = key.lower()
        if key in UNSUPPORTED_STEAM_KEYS:
            return None
        if key == "gamedir":
            f = replace(f, game=value)
        elif key == "map":
            f = replace(f, map=value)
        elif key == "empty" and value == "1":
            f = replace(f, not_empty=True)
        elif key == "full" and value == "1":
            f = replace(f, not_full=True)
        elif key == "password":
            f = replace(f, password=value == "1")
        elif key == "gametype":
            f = replace(f, tags_all=tuple(t for t in value.split(",") if t))
        elif key == "noplayers" and value == "1":
            tests.append(lambda r: r.info.players == 0)
        elif key == "name_match":
            tests.append(_wildcard(value, MAX_NAME_PATTERN, lambda r: r.info.name))
        elif key == "version_match":
            tests.append(_wildcard(value, MAX_VERSION_PATTERN, lambda r: r.info.version))
    return f, lambda r: all(test(r) for test in tests)


def _wildcard(pattern: str, max_chars: int, field: Callable[[HostRecord], str]) -> Predicate:
    if len(pattern) > max_chars:
        raise MalformedFilter("pattern_too_long")
    pieces = wildcard_pieces(pattern)
    return lambda r: wildcard_match(pieces, field(r).casefold())


def wildcard_pieces(pattern: str) -> tuple[str, ...]:
    """`pattern` read as Steam's filters do: case-insensitive, ``*`` any run of
    characters (none too), every other character itself (``?`` and ``[`` too)."""
    return tuple(pattern.casefold().split("*"))


def wildcard_match(pieces: tuple[str, ...], text: str) -> bool:
    """Whether `text` (casefolded) matches the pattern split into `pieces`.

    The first piece must start `text` and the last end it; those between are
    found in order, each after the one before, at its leftmost place (any later
    place leaves less room for the rest).  Each character of `text` is scanned
    by at most one `str.find`: linear, no backtracking, nothing compiled.
    """
    if len(pieces) == 1:
        return text == pieces[0]
    first, last = pieces[0], pieces[-1]
    end = len(text) - len(last)
    if end < len(first) or not text.startswith(first) or not text.endswith(last):
        return False
    at = len(first)
    for piece in pieces[1:-1]:
        if piece:
            found = text.find(piece, at, end)
            if found < 0:
                return False
            at = found + len(piece)
    return True


def q3_filter(query: Q3Query) -> ListFilter:
    # Quake III masters leave out empty and full servers unless asked for them.
    return ListFilter(
        game=query.game or EVERY_GAME, not_empty=not query.empty, not_full=not query.full
    )


# -- encoding ---------------------------------------------------------------------


def steam_list(records: Iterable[HostRecord]) -> bytes:
    """The IPv4 `records` as Steam replies list them: 6 bytes each, in address order
    (the bytes sort as the (address, port) pairs do)."""
    return b"".join(
        sorted(
            IPV4_ENTRY.pack(socket.inet_pton(socket.AF_INET, r.address.ip), r.address.port)
            for r in records
        )
    )


def steam_page(listed: bytes, seed: tuple[int, int], room: int) -> bytes | None:
    """The reply page of `listed` (a `steam_list`) after `seed` holding at most `room`
    bytes, or None if none fits."""
    size = IPV4_ENTRY.size
    slots = (room - len(STEAM_REPLY)) // size
    if slots < 1:
        return None
    start = _first_after(listed, IPV4_ENTRY.pack(seed[0].to_bytes(4, "big"), seed[1]))
    page = listed[start : start + slots * size]
    end = STEAM_END if len(listed) - start < slots * size else b""
    return STEAM_REPLY + page + end


def _first_after(listed: bytes, key: bytes) -> int:
    """Where the first entry of `listed` (sorted, each as long as `key`) above `key` starts."""
    size = len(key)
    lo, hi = 0, len(listed) // size
    while lo < hi:
        mid = (lo + hi) // 2
        if listed[mid * size : (mid + 1) * size] <= key:
            lo = mid + 1
        else:
            hi = mid
    return lo * size


def q3_entry(address: Address) -> bytes:
    if address.family == 4:
        return b"\\" + IPV4_ENTRY.pack(socket.inet_pton(socket.AF_INET, address.ip), address.port)
    return b"/" + IPV6_ENTRY.pack(socket.inet_pton(socket.AF_INET6, address.ip), address.port)


Q3_IPV4_BYTES = 1 + IPV4_ENTRY.size
Q3_IPV6_BYTES = 1 + IPV6_ENTRY.size


@dataclass(frozen=True, slots=True)
class Q3List:
    """Hosts as a Quake III reply lists them, IPv4 entries then IPv6 ones."""

    ipv4: bytes
    """``\\`` + IPv4 + port per host."""
    ipv6: bytes
    """``/`` + IPv6 + port per host."""

    def __len__(self) -> int:
        return len(self.ipv4) // Q3_IPV4_BYTES + len(self.ipv6) // Q3_IPV6_BYTES

    def entry(self, i: int) -> bytes:
        """The `i`-th host's entry."""
        at = i * Q3_IPV4_BYTES
        if at < len(self.ipv4):
            return self.ipv4[at : at + Q3_IPV4_BYTES]
        at = (i - len(self.ipv4) // Q3_IPV4_BYTES) * Q3_IPV6_BYTES
        return self.ipv6[at : at + Q3_IPV6_BYTES]


def q3_list(records: Iterable[HostRecord]) -> Q3List:
    entries = [q3_entry(r.address) for r in records]
    return Q3List(
        b"".join(e for e in entries if len(e) == Q3_IPV4_BYTES),
        b"".join(e for e in entries if len(e) == Q3_IPV6_BYTES),
    )


def q3_reply(listed: Q3List, ext: bool, room: int, rng: random.Random) -> bytes | None:
    """A random sample of `listed` in a reply of at most `room` bytes (None if no
    entry fits); ``EOT`` when every host is in it.  Only as many hosts are drawn
    as the smallest entries would fit: the work is the reply's, not the list's."""
    head = Q3_EXT_REPLY if ext else Q3_REPLY
    hosts = len(listed)
    drawn = rng.sample(range(hosts), min(hosts, max(0, (room - len(head)) // Q3_IPV4_BYTES)))
    body = bytearray()
    taken = 0
    for i in drawn:
        entry = listed.entry(i)
        if len(head) + len(body) + len(entry) > room:
            break
        body += entry
        taken += 1
    if taken == hosts and len(head) + len(body) + len(Q3_EOT) <= room:
        body += Q3_EOT
    if not body:
        return None
    return head + bytes(body)


# -- lists kept ---------------------------------------------------------------------------

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentLists(Generic[K, V]):
    """The lists the latest passes made, by query, each kept for `max_age` seconds;
    at most `max_lists` of them, the least recently used given up first."""

    def __init__(self, max_age: float, max_lists: int) -> None:
        self.max_age = max_age
        self.max_lists = max_lists
        self._lists: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lists)

    def get(self, key: K, now: float) -> V | None:
        """The list kept for `key`, None if there is none or it is too old."""
        kept = self._lists.get(key)
        if kept is None:
            return None
        made, value = kept
        if not 0.0 <= now - made < self.max_age:  # a clock step back: made anew
            del self._lists[key]
            return None
        self._lists.move_to_end(key)
        return value

    def put(self, key: K, value: V, now: float) -> None:
        self._lists[key] = (now, value)
        self._lists.move_to_end(key)
        while len(self._lists) > self.max_lists:
            self._lists.popitem(last=False)


# -- the responder ---------------------------------------------------------------------


class MasterResponder:
    """Answers Steam master and Quake III ``getservers`` requests (sans-IO but for
    the registry's clock and `clock`)."""

    def __init__(
        self,
        registry: Registry,
        limiter: RateLimiter,
        *,
        page_hosts: int,
        rng: random.Random | None = None,
        scans: Rate = SCAN_RATE,
        source_scans: Rate = SOURCE_SCAN_RATE,
        clock: Callable[[], float] = time.monotonic,
        on_rate_limited: Callable[[], None] | None = None,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self._registry = registry
        self._limiter = limiter
        self._page_hosts = page_hosts
        self._rng = rng or random.Random()
        self._clock = clock
        # One bucket for every source: the passes over the hosts it allows.
        self._scans = RateLimiter(scans, max_keys=1, clock=clock)
        self._source_scans = RateLimiter(source_scans, clock=clock)
        self._steam_lists: RecentLists[tuple[tuple[str, str], ...], bytes] = RecentLists(
            LIST_SECONDS, LISTS_KEPT
        )
        self._q3_lists: RecentLists[Q3Query, Q3List] = RecentLists(LIST_SECONDS, LISTS_KEPT)
        self._on_rate_limited = on_rate_limited
        # Told each datagram's result: "answered", "rate_limited" or "dropped".
        self._on_result = on_result
        self.answered = 0
        """Requests answered."""
        self.rate_limited = 0
        """Requests refused by the rate limit, the source's or `scans_refused` (no reply)."""
        self.scans = 0
        """Passes made over the hosts (`catalog.visible`): queries no kept list answered."""
        self.scans_refused = 0
        """Requests refused for want of a pass (over `SCAN_RATE`, all sources together)."""
        self.dropped = 0
        """Datagrams that were no request we know, too short for any answer, or
        malformed (each of them counted in `drops` too)."""
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        """Datagrams dropped, by reason (`DROP_REASONS`)."""

    def datagram_received(self, data: bytes, address: Address) -> bytes | None:
        """The reply to send back to `address`, or None."""
        steam = decode_steam(data)
        if steam is not None:
            return self._steam(steam, len(data), address)
        q3 = decode_q3(data)
        if q3 is not None:
            return self._q3(q3, len(data), address)
        self._drop("not_a_query", address)
        return None

    def _steam(self, query: SteamQuery, room: int, address: Address) -> bytes | None:
        try:
            parsed = steam_filter(query.filters)
        except MalformedFilter as exc:
            self._drop(exc.reason, address)
            return None
        if room < len(STEAM_REPLY) + IPV4_ENTRY.size:  # one host, or the list's end
            self._drop("no_room", address)
            return None
        # A first page costs what a list request does; the next ones, paging by
        # seed, share one list request's cost between `page_hosts` hosts.
        first = query.seed == (0, 0)
        entries = max(1, (room - len(STEAM_REPLY)) // IPV4_ENTRY.size)
        if not self._allow(address, 1.0 if first else min(1.0, entries / self._page_hosts)):
            return None
        if parsed is None:
            listed = b""
        else:
            now = self._clock()
            found = self._steam_lists.get(query.filters, now)
            if found is None:
                if not self._scan(address):
                    return None
                f, test = parsed
                found = steam_list(r for r in visible(self._registry, f) if test(r))
                self._steam_lists.put(query.filters, found, now)
            listed = found
        return self._answered(steam_page(listed, query.seed, room), address)

    def _q3(self, query: Q3Query, room: int, address: Address) -> bytes | None:
        head = Q3_EXT_REPLY if query.ext else Q3_REPLY
        if room < len(head) + min(Q3_IPV4_BYTES, len(Q3_EOT)):  # one host, or the end
            self._drop("no_room", address)
            return None
        if not self._allow(address, 1.0):
            return None
        now = self._clock()
        listed = self._q3_lists.get(query, now)
        if listed is None:
            if not self._scan(address):
                return None
            records = visible(self._registry, q3_filter(query))
            listed = q3_list(r for r in records if r.address.family in query.families)
            self._q3_lists.put(query, listed, now)
        return self._answered(q3_reply(listed, query.ext, room, self._rng), address)

    def _scan(self, address: Address) -> bool:
        """Whether a pass over the hosts may be made now (counted): this source's share
        first, then all sources' together."""
        if self._source_scans.allow(rate_key(address.ip)) and self._scans.allow(""):
            self.scans += 1
            return True
        self.scans_refused += 1
        log.debug("master_scans_spent peer=%s", address)
        self._refused()
        return False

    def _allow(self, address: Address, cost: float) -> bool:
        if self._limiter.allow(rate_key(address.ip), cost):
            return True
        self._refused()
        return False

    def _refused(self) -> None:
        self.rate_limited += 1
        if self._on_rate_limited is not None:
            self._on_rate_limited()
        self._tell("rate_limited")

    def _answered(self, reply: bytes | None, address: Address) -> bytes | None:
        if reply is None:
            self._drop("no_room", address)
            return None
        self.answered += 1
        self._tell("answered")
        return reply

    def _drop(self, reason: str, address: Address) -> None:
        self.dropped += 1
        self.drops[reason] += 1
        log.debug("master_dropped reason=%s peer=%s", reason, address)
        self._tell("dropped")

    def _tell(self, result: str) -> None:
        if self._on_result is not None:
            self._on_result(result)


class MasterProtocol(asyncio.DatagramProtocol):
    """The UDP socket of the master port, in front of a `MasterResponder`."""

    def __init__(self, responder: MasterResponder) -> None:
        self._responder = responder
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            address = from_sockaddr(tuple(addr))
            reply = self._responder.datagram_received(data, address)
        except Exception:  # peers never crash the daemon
            log.exception("master_request_failed")
            return
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("master_socket_error error=%r", str(exc))
