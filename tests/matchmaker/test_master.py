"""The master-server protocols (Steam master query, Quake III getservers), ``GET
/servers`` without a game, and qstat against the daemon's master port."""

from __future__ import annotations

import asyncio
import fnmatch
import gc
import ipaddress
import random
import re
import shutil
import struct
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st

import matchmaker.master
import rudp
from matchmaker.addresses import Address
from matchmaker.catalog import EVERY_GAME, visible
from matchmaker.master import (
    LIST_SECONDS,
    MAX_NAME_PATTERN,
    MAX_VERSION_PATTERN,
    Q3_EOT,
    Q3_REPLY,
    STEAM_END,
    STEAM_REPLY,
    MasterResponder,
    decode_q3,
    decode_steam,
    wildcard_match,
    wildcard_pieces,
)
from matchmaker.messages import ListFilter
from matchmaker.ratelimit import Rate, RateLimiter
from matchmaker.registry import MemoryRegistry
from matchmaker.server import Matchmaker
from rudp.a2s import ServerInfo, serve_a2s
from tests.matchmaker.helpers import FakeClock, info, pub, settings

QSTAT = shutil.which("quakestat")
needs_qstat = pytest.mark.skipif(QSTAT is None, reason="qstat (quakestat) is not installed")
CLIENT = Address("198.51.100.1", 5000)


def steam_request(seed: str = "0.0.0.0:0", filters: str = "", region: int = 0xFF) -> bytes:
    return bytes((0x31, region)) + seed.encode() + b"\x00" + filters.encode() + b"\x00"


def steam_entries(reply: bytes) -> list[tuple[str, int]]:
    assert reply.startswith(STEAM_REPLY)
    body = reply[len(STEAM_REPLY) :]
    return [
        (str(ipaddress.IPv4Address(body[i : i + 4])), struct.unpack_from("!H", body, i + 4)[0])
        for i in range(0, len(body), 6)
    ]


async def registry_with(n: int, clock: FakeClock, **kw: object) -> MemoryRegistry:
    registry = MemoryRegistry(clock=clock)
    for i in range(n):
        host = info(f"h{i}", game="arena", players=1, **kw)  # type: ignore[arg-type]
        await registry.upsert(Address(pub(i + 1), 27000 + i), host, max_per_ip=99)
    return registry


def responder(
    registry: MemoryRegistry,
    clock: FakeClock,
    burst: float = 100.0,
    scans: float = 1e9,
    source_scans: float = 1e9,
) -> MasterResponder:
    """A master port with a rate of 2 a second per source (`burst` saved up), and
    `scans` passes over the hosts for all of them together, `source_scans` for one,
    made at once."""
    limiter = RateLimiter(Rate(rate=2.0, burst=burst), clock=clock)
    return MasterResponder(
        registry,
        limiter,
        page_hosts=32,
        rng=random.Random(1),
        scans=Rate(rate=scans, burst=scans),
        source_scans=Rate(rate=source_scans, burst=source_scans),
        clock=clock,
    )


# -- Steam master query -------------------------------------------------------------------


def test_decode_steam() -> None:
    query = decode_steam(steam_request("1.2.3.4:5", "\\gamedir\\arena\\map\\field"))
    assert query is not None
    assert query.seed == (0x01020304, 5) and query.region == 0xFF
    assert query.filters == (("gamedir", "arena"), ("map", "field"))
    # qstat 2.17's follow-up pages: a stray byte between the seed and its NUL.
    assert decode_steam(b"1\xff127.0.0.1:33341r\x00") is not None
    for bad in (b"1\xffnot an address\x00\x00", b"2\xff0.0.0.0:0\x00\x00", b"1\xff0.0.0.0:0"):
        assert decode_steam(bad) is None


async def test_steam_pages_by_seed_each_no_larger_than_its_request() -> None:
    clock = FakeClock()
    registry = await registry_with(20, clock)
    master = responder(registry, clock)
    seen: list[tuple[str, int]] = []
    seed = "0.0.0.0:0"
    for _ in range(100):
        request = steam_request(seed, "\\gamedir\\arena")
        reply = master.datagram_received(request, CLIENT)
        assert reply is not None and len(reply) <= len(request)
        entries = steam_entries(reply)
        if entries[-1] == ("0.0.0.0", 0):
            seen.extend(entries[:-1])
            break
        seen.extend(entries)
        seed = f"{entries[-1][0]}:{entries[-1][1]}"
    assert sorted(seen) == sorted((pub(i + 1), 27000 + i) for i in range(20))
    assert len(seen) == len(set(seen))


async def test_steam_filters() -> None:
    clock = FakeClock()
    registry = await registry_with(3, clock)
    await registry.upsert(
        Address(pub(9), 1), info("Other", game="ut", players=0, tags=("ctf",)), max_per_ip=9
    )
    await registry.upsert(Address("2606:4700::1", 2), info("six", game="ut"), max_per_ip=9)
    master = responder(registry, clock)
    pad = "\\pad\\" + "x" * 200  # room for every entry

    def listed(filters: str) -> set[tuple[str, int]]:
        reply = master.datagram_received(steam_request(filters=filters + pad), CLIENT)
        assert reply is not None and reply.endswith(STEAM_END)
        return set(steam_entries(reply)[:-1])

    assert len(listed("")) == 4  # every game, IPv4 only
    assert listed("\\gamedir\\ut") == {(pub(9), 1)}
    assert listed("\\gamedir\\ut\\noplayers\\1\\gametype\\ctf") == {(pub(9), 1)}
    assert listed("\\empty\\1\\gamedir\\ut") == set()
    assert len(listed("\\name_match\\H*")) == 3
    assert listed("\\version_match\\2*") == set()
    assert listed("\\nor\\1\\map\\x") == set()  # negations are not evaluated


WILDCARDS = [
    # (pattern, name, matches)
    ("", "", True),
    ("", "a", False),
    ("abc", "abc", True),
    ("abc", "ABC", True),  # case-insensitive
    ("abc", "abcd", False),
    ("abc", "xabc", False),
    ("*", "", True),
    ("*", "any name", True),
    ("**", "", True),
    ("***", "abc", True),
    ("a*", "abc", True),
    ("a*", "a", True),
    ("a*", "ba", False),
    ("*c", "abc", True),
    ("*c", "cb", False),
    ("*abc*", "xxabcxx", True),
    ("*abc*", "abc", True),
    ("*abc*", "ab c", False),
    ("a*c", "ac", True),
    ("a*c", "abbbc", True),
    ("a*c", "acb", False),
    ("a**c", "abc", True),
    ("a*b*c", "aXbYc", True),
    ("a*b*c", "acb", False),
    ("*b*a*", "abba", True),
    ("*b*a*", "ab", False),
    ("ab*ba", "aba", False),  # the first and the last piece may not overlap
    ("ab*ba", "abba", True),
    ("a*a*a", "aa", False),
    ("a*a*a", "aaa", True),
    ("*aab", "aaaab", True),  # a piece found after a false start
    ("?", "?", True),  # ? and [ are plain characters
    ("?", "a", False),
    ("[ab]", "a", False),
    ("[AB]*", "[ab] server", True),
    ("*ss*", "Straße", True),  # casefolded: ß is ss
    ("*ß*", "STRASSE", True),
    ("*\\*", "a\\", True),
]


@pytest.mark.parametrize(("pattern", "name", "matches"), WILDCARDS)
def test_wildcard_semantics(pattern: str, name: str, matches: bool) -> None:
    assert wildcard_match(wildcard_pieces(pattern), name.casefold()) is matches


@hypothesis.settings(max_examples=400, deadline=None)
@given(st.text("ab*?[]A", max_size=8), st.text("ab?[]AB*", max_size=10))
def test_wildcard_matches_what_fnmatch_did(pattern: str, name: str) -> None:
    # fnmatch as the matcher used to call it: every character but * escaped, both
    # sides casefolded.
    escaped = "".join(c if c == "*" else f"[{c}]" if c in "[]?" else c for c in pattern)
    expected = fnmatch.fnmatchcase(name.casefold(), escaped.casefold())
    assert wildcard_match(wildcard_pieces(pattern), name.casefold()) is expected


class Scanned(str):
    """A text that records what each `find` on it was asked for and found."""

    finds: list[tuple[int, int, int, int]]

    def find(self, sub: str, start: Any = None, end: Any = None) -> int:
        found = super().find(sub, start, end)
        self.finds.append((start, end, found, len(sub)))
        return found


@pytest.mark.parametrize("seed", range(20))
def test_wildcard_scans_each_character_once(seed: int) -> None:
    rng = random.Random(seed)
    text = Scanned("".join(rng.choice("ab") for _ in range(64)))
    text.finds = []
    pattern = "".join(rng.choice(["*", "a", "b", "*a", "*b", "**"]) for _ in range(40))
    pieces = wildcard_pieces(pattern)
    wildcard_match(pieces, text)
    assert len(text.finds) <= len(pieces)
    at = 0
    for start, end, found, size in text.finds:
        assert start >= at  # never back over a character already scanned
        assert end <= len(text)
        if found < 0:
            break
        at = found + size


def opcodes(fn: Callable[[], object]) -> int:
    """The bytecode instructions `fn` runs in Python code (regex compilation is Python)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return tracer

    # The cyclic collector stays out of the count: run during ``fn``, it would
    # count the finalizers of whatever earlier tests left behind.
    gc.collect()
    gc.disable()
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
        gc.enable()
    return count


async def test_a_worst_case_pattern_costs_a_bounded_multiple_of_a_plain_query() -> None:
    clock = FakeClock()
    registry = MemoryRegistry(clock=clock)
    for i in range(8):
        await registry.upsert(Address(pub(i + 1), 1), info("a" * 64, game="arena"), max_per_ip=9)
    master = responder(registry, clock, burst=1e9)

    def query(filters: str) -> Callable[[], object]:
        request = steam_request(filters="\\gamedir\\arena" + filters)
        return lambda: master.datagram_received(request, CLIENT)

    query("")()
    clock.advance(LIST_SECONDS)  # the list made above is given up: this one is made anew
    plain = opcodes(query(""))
    # The longest pattern taken, a piece to find after every *, each found at the
    # far end of what is left; new every time (nothing a query asked for is cached).
    for last in "ab":
        pattern = "*a" * (MAX_NAME_PATTERN // 2 - 1) + "*" + last
        assert len(pattern) == MAX_NAME_PATTERN - 1
        cost = opcodes(query("\\name_match\\" + pattern))
        # A generous 40 instructions per pattern character and host on top of the
        # plain query (about 15 are run); compiling the pattern to a regular
        # expression alone cost about 100,000.
        assert plain < cost <= plain + 8 * len(pattern) * 40
    assert master.answered == 4


async def test_unique_patterns_compile_nothing_and_keep_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not hasattr(matchmaker.master, "fnmatch")

    def no_regex(*args: object, **kw: object) -> object:
        raise AssertionError("a regular expression compiled for a query")

    clock = FakeClock()
    master = responder(await registry_with(1, clock), clock, burst=1e9)
    rng = random.Random(3)

    def queries(n: int) -> None:
        for _ in range(n):
            pattern = "".join("*" + rng.choice("abcdefgh0123") for _ in range(20))
            request = steam_request(filters=f"\\name_match\\{pattern}\\version_match\\{pattern}")
            assert master.datagram_received(request, CLIENT) is not None

    tracemalloc.start()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(re, "_compile", no_regex)
            queries(100)
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            queries(3000)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert master.answered == 3100
    # fnmatch's cache kept each compiled pattern: several KB each, MBs here.
    assert grown < 64 * 1024


async def test_a_pattern_over_its_cap_is_dropped_and_counted() -> None:
    clock = FakeClock()
    master = responder(await registry_with(1, clock), clock)
    for key, cap in (("name_match", MAX_NAME_PATTERN), ("version_match", MAX_VERSION_PATTERN)):
        assert master.datagram_received(steam_request(filters=f"\\{key}\\" + "*" * cap), CLIENT)
        request = steam_request(filters=f"\\{key}\\" + "*" * (cap + 1))
        assert master.datagram_received(request, CLIENT) is None
    assert master.drops == {"not_a_query": 0, "no_room": 0, "pattern_too_long": 2}
    assert (master.answered, master.dropped, master.rate_limited) == (2, 2, 0)
    assert master.datagram_received(b"not a query", CLIENT) is None
    assert master.datagram_received(b"\xff\xff\xff\xffgetservers 68", CLIENT) is None
    assert master.drops == {"not_a_query": 1, "no_room": 1, "pattern_too_long": 2}


async def test_the_shortest_steam_request_gets_one_entry() -> None:
    clock = FakeClock()
    master = responder(await registry_with(2, clock), clock)
    request = b"1\xff0.0.0.0:0\x00"  # no filter, not even its NUL: 12 bytes
    reply = master.datagram_received(request, CLIENT)
    assert reply is not None and len(reply) == len(request) and len(steam_entries(reply)) == 1


async def test_first_pages_cost_a_list_request_and_next_pages_a_share() -> None:
    clock = FakeClock()
    master = responder(await registry_with(5, clock), clock, burst=3.0)
    first = steam_request()
    assert all(master.datagram_received(first, CLIENT) for _ in range(3))
    assert master.datagram_received(first, CLIENT) is None
    assert master.rate_limited == 1
    clock.advance(0.5)  # one token back: 32 hosts' worth of paging (page_hosts)
    page = steam_request(f"{pub(1)}:1")  # 19 bytes: room for two hosts a page
    assert all(master.datagram_received(page, CLIENT) for _ in range(16))
    assert master.datagram_received(page, CLIENT) is None


# -- what the port can be made to do, all sources together --------------------------------


def count_scans(monkeypatch: pytest.MonkeyPatch) -> list[ListFilter]:
    """The filters of the passes over the hosts the master port makes from now on."""
    scans: list[ListFilter] = []

    def counted(registry: MemoryRegistry, f: ListFilter) -> list[object]:
        scans.append(f)
        return visible(registry, f)  # type: ignore[return-value]

    monkeypatch.setattr(matchmaker.master, "visible", counted)
    return scans


def spoofed(i: int) -> Address:
    return Address(f"203.0.{i // 250}.{i % 250 + 1}", 1000 + i)


async def test_a_request_too_short_for_any_answer_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 17 bytes of "getservers 68" leave no room for the reply's header and one
    # entry: it used to take a token and make the whole pass before it was dropped.
    clock = FakeClock()
    master = responder(await registry_with(3, clock), clock, burst=1.0, scans=1.0)
    scans = count_scans(monkeypatch)
    for i in range(100):
        assert master.datagram_received(b"\xff\xff\xff\xffgetservers 68", spoofed(i)) is None
        assert master.datagram_received(b"\xff\xff\xff\xffgetserversExt a 68", CLIENT) is None
    assert scans == [] and master.drops["no_room"] == 200 and master.rate_limited == 0
    # The shortest request with room for an answer (22 bytes of header, 7 of entry).
    stock = b"\xff\xff\xff\xffgetservers 68 empty full\n"
    assert len(stock) == 29 and master.datagram_received(stock, CLIENT) is not None
    assert len(scans) == 1


async def test_next_pages_from_spoofed_sources_cost_at_most_the_passes_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A next page costs a source 1/32 of a token, and each spoofed source has a
    # full bucket: each one used to make a whole pass over the hosts and sort them.
    clock = FakeClock()
    master = responder(await registry_with(40, clock), clock, burst=1.0, scans=5.0)
    scans = count_scans(monkeypatch)
    seed = f"{pub(1)}:27000"
    for i in range(100):  # a filter of its own each: no list made for one serves another
        request = steam_request(seed, f"\\gamedir\\arena\\map\\m{i}")
        master.datagram_received(request, spoofed(i))
    for i in range(100, 200):
        request = b"\xff\xff\xff\xffgetservers 68 empty full" + b" x" * i
        master.datagram_received(request, spoofed(i))
    assert len(scans) == 5 and master.scans == 5
    assert master.scans_refused == master.rate_limited == 195
    assert master.answered == 5 and master.dropped == 0
    clock.advance(1.0)  # five more passes a second
    for i in range(10):
        master.datagram_received(steam_request(seed, f"\\gamedir\\arena\\map\\n{i}"), spoofed(i))
    assert len(scans) == 10 and master.answered == 10


async def test_one_source_of_distinct_filters_leaves_passes_for_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The passes are shared by every source: one sender of a new filter each time
    # spent all of them, and everyone else's new queries went unanswered.
    clock = FakeClock()
    master = responder(await registry_with(40, clock), clock, scans=10.0, source_scans=2.0)
    scans = count_scans(monkeypatch)
    flood = Address(pub(200), 5000)
    for i in range(40):
        master.datagram_received(steam_request("0.0.0.0:0", f"\\gamedir\\arena\\map\\m{i}"), flood)
    assert len(scans) == 2 and master.answered == 2
    honest = [Address(pub(210 + i), 27005) for i in range(4)]
    for i, source in enumerate(honest):
        master.datagram_received(steam_request("0.0.0.0:0", f"\\gamedir\\arena\\map\\h{i}"), source)
    assert len(scans) == 6 and master.answered == 6


async def test_a_list_made_once_answers_its_next_pages_and_every_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    registry = await registry_with(20, clock)
    master = responder(registry, clock, burst=1.0, scans=2.0)  # a pass for each protocol
    scans = count_scans(monkeypatch)
    every = [(pub(i + 1), 27000 + i) for i in range(20)]  # in address order
    # 100 sources page through the same list, each from where the one before stopped.
    seed, seen = "0.0.0.0:0", []
    for i in range(100):
        reply = master.datagram_received(steam_request(seed, "\\gamedir\\arena"), spoofed(i))
        assert reply is not None
        entries = steam_entries(reply)
        seen += [e for e in entries if e != ("0.0.0.0", 0)]
        ip, port = entries[-1]
        seed = f"{ip}:{port}" if port else "0.0.0.0:0"  # the list's end: from the start
    assert len(seen) > 2 * len(every) and seen == (every * 100)[: len(seen)]
    # Quake III: a sample of the list made once, each as large as its request allows.
    padded = b"\xff\xff\xff\xffgetservers 68 empty full" + b" pad" * 20
    fits = (len(padded) - len(Q3_REPLY)) // 7
    samples = set()
    for i in range(100, 150):
        reply = master.datagram_received(padded, spoofed(i))
        assert reply is not None and len(reply) == len(Q3_REPLY) + fits * 7
        samples.add(reply)
    assert len(samples) > 1  # a new sample each time
    assert len(scans) == 2 and master.rate_limited == 0
    # A list is kept for LIST_SECONDS: a host registered since shows after that.
    await registry.upsert(Address(pub(30), 1), info("new", game="arena"), max_per_ip=9)
    request = steam_request(f"{pub(20)}:27019", "\\gamedir\\arena")
    clock.advance(LIST_SECONDS)
    assert steam_entries(master.datagram_received(request, CLIENT) or b"")[0] == (pub(30), 1)
    assert len(scans) == 3


# -- Quake III getservers ------------------------------------------------------------------


def test_decode_q3() -> None:
    query = decode_q3(b"\xff\xff\xff\xffgetservers 68 empty full\n")
    assert query is not None and (query.game, query.empty, query.full) == (None, True, True)
    ext = decode_q3(b"\xff\xff\xff\xffgetserversExt arena 68 ipv6")
    assert ext is not None and (ext.game, ext.families, ext.ext) == ("arena", (6,), True)
    assert decode_q3(b"\xff\xff\xff\xffgetstatus") is None
    assert decode_q3(b"\xff\xff\xff\xffgetservers") is None


async def test_q3_replies_hold_what_fits_in_the_request_and_eot_only_when_complete() -> None:
    clock = FakeClock()
    master = responder(await registry_with(4, clock), clock)
    stock = b"\xff\xff\xff\xffgetservers 68 empty full\n"
    reply = master.datagram_received(stock, CLIENT)
    assert reply is not None and len(reply) <= len(stock)
    assert reply.startswith(Q3_REPLY) and reply.count(b"\\") == 1 and Q3_EOT not in reply
    padded = b"\xff\xff\xff\xffgetservers 68 empty full" + b" pad" * 20
    reply = master.datagram_received(padded, CLIENT)
    assert reply is not None and len(reply) <= len(padded)
    assert reply.endswith(Q3_EOT) and len(reply) == len(Q3_REPLY) + 4 * 7 + len(Q3_EOT)
    # Empty servers are left out unless asked for.
    no_empty = b"\xff\xff\xff\xffgetservers 68 full" + b" pad" * 20
    assert master.datagram_received(no_empty, CLIENT) is not None
    short = b"\xff\xff\xff\xffgetservers 68"
    assert master.datagram_received(short, CLIENT) is None


async def test_q3_ext_lists_ipv6_entries() -> None:
    clock = FakeClock()
    registry = MemoryRegistry(clock=clock)
    await registry.upsert(
        Address("2606:4700::1", 2), info("six", game="arena", players=1), max_per_ip=9
    )
    master = responder(registry, clock)
    request = b"\xff\xff\xff\xffgetserversExt arena 68 ipv6 empty full" + b" pad" * 10
    reply = master.datagram_received(request, CLIENT)
    assert reply is not None and b"/" + ipaddress.IPv6Address("2606:4700::1").packed in reply


# -- every game ------------------------------------------------------------------------------


async def test_visible_every_game_applies_the_same_filters() -> None:
    clock = FakeClock()
    registry = await registry_with(2, clock)
    await registry.upsert(Address(pub(9), 1), info("ut", game="ut", players=8), max_per_ip=9)
    assert len(visible(registry, ListFilter(game=EVERY_GAME))) == 3
    assert len(visible(registry, ListFilter(game=EVERY_GAME, not_full=True))) == 2
    clock.advance(60)  # hidden once silent
    assert visible(registry, ListFilter(game=EVERY_GAME)) == []


# -- the daemon ------------------------------------------------------------------------------


async def get_json(address: tuple[str, int], target: str) -> tuple[int, object]:
    import json

    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


@pytest.fixture
async def master_daemon() -> AsyncIterator[tuple[Matchmaker, list[rudp.Server]]]:
    """A daemon with --master, listing five real A2S hosts on loopback."""
    mm = Matchmaker(settings(master=True, master_port=0))
    await mm.start()
    hosts = []
    for i in range(5):
        host = await rudp.serve(lambda conn: conn.close(), "127.0.0.1", 0)
        serve_a2s(host, ServerInfo(name=f"Arena {i}", map="field", folder="arena", max_players=8))
        hosts.append(host)
        address = Address("127.0.0.1", host.address[1])
        game = "arena" if i < 4 else "other"
        await mm.registry.upsert(address, info(f"Arena {i}", game=game, players=1), max_per_ip=99)
    yield mm, hosts
    for host in hosts:
        await host.close()
    await mm.shutdown()


async def test_servers_without_game_lists_every_game(
    master_daemon: tuple[Matchmaker, list[rudp.Server]],
) -> None:
    mm, _ = master_daemon
    status, body = await get_json(mm.http_address, "/servers")
    assert status == 200
    assert isinstance(body, dict) and body["total"] == 5
    assert {s["game"] for s in body["servers"]} == {"arena", "other"}
    status, body = await get_json(mm.http_address, "/servers?limit=2&not_full=1")
    assert status == 200 and isinstance(body, dict) and body["total"] == 2
    status, body = await get_json(mm.http_address, "/servers?bogus=1")
    assert status == 400


async def test_every_master_query_is_counted_in_metrics(
    master_daemon: tuple[Matchmaker, list[rudp.Server]],
) -> None:
    mm, _ = master_daemon
    assert mm.master_address is not None
    loop = asyncio.get_running_loop()
    replies: asyncio.Queue[bytes] = asyncio.Queue()

    class Query(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            replies.put_nowait(data)

    transport, _ = await loop.create_datagram_endpoint(
        Query, remote_addr=("127.0.0.1", mm.master_address[1])
    )
    try:
        transport.sendto(b"\x31\xff0.0.0.0:0\x00\x00")  # a Steam query: answered
        assert (await asyncio.wait_for(replies.get(), 10)).startswith(STEAM_REPLY)
        transport.sendto(b"not a query")  # dropped, and told
        sample = mm.metrics.registry.get_sample_value

        def count(result: str) -> float | None:
            return sample("matchmaker_master_queries_total", {"result": result})

        for _ in range(200):
            if count("dropped") == 1.0:
                break
            await asyncio.sleep(0.01)
        assert [count(r) for r in ("answered", "rate_limited", "dropped")] == [1.0, 0.0, 1.0]
    finally:
        transport.close()


async def test_master_is_off_by_default(daemon: Matchmaker) -> None:
    assert daemon.master_address is None and daemon.master_responder is None


async def quakestat(*args: str) -> list[str]:
    assert QSTAT is not None
    proc = await asyncio.create_subprocess_exec(
        QSTAT, *args, "-raw", "\t", "-timeout", "20", "-retry", "1",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return [line for line in out.decode().splitlines() if line]


@needs_qstat
async def test_qstat_lists_the_hosts_of_the_steam_master_and_queries_them(
    master_daemon: tuple[Matchmaker, list[rudp.Server]],
) -> None:
    mm, hosts = master_daemon
    assert mm.master_address is not None
    master = f"127.0.0.1:{mm.master_address[1]}"
    # Unfiltered: one host a page (qstat's 13-byte request), all five in the end.
    lines = await quakestat("-stm", master)
    assert lines[0].split("\t")[:3] == ["STM", master, "5"]
    names = sorted(line.split("\t")[2] for line in lines[1:])
    assert names == [f"Arena {i}" for i in range(5)]  # each queried over A2S
    lines = await quakestat("-stm,game=arena", master)
    assert lines[0].split("\t")[:3] == ["STM", master, "4"]


@needs_qstat
async def test_qstat_lists_what_fits_of_the_quake3_master(
    master_daemon: tuple[Matchmaker, list[rudp.Server]],
) -> None:
    mm, _ = master_daemon
    assert mm.master_address is not None
    master = f"127.0.0.1:{mm.master_address[1]}"
    # qstat needs a byte after the last entry: a stock request (room for one entry
    # and no EOT) lists nothing; a padded one gets the whole list and its EOT.
    lines = await quakestat("-q3m,68" + " ipv4" * 10, master)
    assert lines[0].split("\t")[:3] == ["Q3M", master, "5"]
