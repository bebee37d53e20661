"""End to end at scale on loopback: 1,000 hosts over real rudp, every list filter, liveness.

Issue 5: "1,000 hosts register, clients list with each filter and get exactly
the right set".  Each host is its own rudp socket (a host's key is the
address the matchmaker observes), spread over 50 loopback IPv4 addresses so
the per-IP paging and caps are exercised, plus a few on ``::1`` (when the
machine has IPv6 loopback) for the ``family`` filter.  The expected answer of
every filter is computed here, from the generated data, by an oracle written
independently of ``matchmaker.listing``.

Then a tenth of the hosts die without unregistering (their sockets are
released with no DISCONNECT sent) and must leave the lists, and then the
registry, within the configured times.  Every wait is a poll with a deadline.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import rudp
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.server import Matchmaker
from matchmaker.settings import Settings

N_HOSTS = 1000
V4_IPS = 50  # 127.0.0.1 .. 127.0.0.50
V6_HOSTS = 30  # on ::1, when available
CONCURRENCY = 64  # registrations in flight at once
HIDE_AFTER = 6.0  # a live host heartbeats every second: 6 misses before it is hidden
EXPIRE_AFTER = 12.0
KEEPALIVE = 1.0
SLACK = 10.0  # scheduling slack on a loaded CI box, on top of a configured time

GAMES = ("alpha", "beta")
VERSIONS = ("1.0", "1.1", "2.0")
MAPS = ("dm1", "dm2", "ctf1", "ctf2", "")
REGIONS = ("eu", "us", "asia", "")
TAG_POOL = ("ctf", "ffa", "tdm", "insta")
WORDS = ("Friday Night", "CTF fun", "casual", "NIGHT owls", "Pro League", "newbies")


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Spec:
    """One host's registration, generated deterministically from its index."""

    bind: str
    name: str
    game: str
    version: str
    map: str
    region: str
    players: int
    max_players: int
    password: bool
    tags: tuple[str, ...]

    def register_args(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "game": self.game,
            "version": self.version,
            "map": self.map,
            "region": self.region,
            "players": self.players,
            "max_players": self.max_players,
            "password": self.password,
            "tags": self.tags,
        }


def make_spec(i: int, v6: bool) -> Spec:
    max_players = 2 + 4 * (i % 4)  # 2, 6, 10, 14
    # (i * 7) % (max + 1) walks 0..max: empty, partly full and full hosts.
    players = (i * 7) % (max_players + 1)
    bits = (i // 2) % 16  # every tag combination within each game
    return Spec(
        bind="::1" if v6 else f"127.0.0.{1 + i % V4_IPS}",
        name=f"{WORDS[i % len(WORDS)]} #{i:04d}",
        game=GAMES[i % 2],
        version=VERSIONS[i % 3],
        map=MAPS[i % 5],
        region=REGIONS[i % 7 % 4],
        players=players,
        max_players=max_players,
        password=i % 11 == 0,
        tags=tuple(t for k, t in enumerate(TAG_POOL) if bits >> k & 1),
    )


def expected(specs: dict[Address, Spec], game: str, **f: Any) -> set[Address]:
    """The oracle: which hosts a list with these filters must return."""

    def ok(address: Address, s: Spec) -> bool:
        if s.game != game:
            return False
        for field in ("version", "map", "region"):
            if field in f and getattr(s, field) != f[field]:
                return False
        if f.get("not_full") and s.players >= s.max_players:
            return False
        if f.get("not_empty") and s.players == 0:
            return False
        if "password" in f and s.password != f["password"]:
            return False
        if not set(f.get("tags_all", ())) <= set(s.tags):
            return False
        if f.get("tags_any") and not set(f["tags_any"]) & set(s.tags):
            return False
        if "name" in f and f["name"].lower() not in s.name.lower():
            return False
        want_family = f.get("family")
        family = 6 if ":" in address.ip else 4
        return want_family is None or family == want_family

    return {a for a, s in specs.items() if ok(a, s)}


FILTERS: list[dict[str, Any]] = [
    {},
    *({"version": v} for v in VERSIONS),
    *({"map": m} for m in MAPS if m),
    *({"region": r} for r in REGIONS if r),
    {"not_full": True},
    {"not_empty": True},
    {"not_full": True, "not_empty": True},
    {"password": True},
    {"password": False},
    {"tags_all": ["ctf"]},
    {"tags_all": ["ctf", "ffa"]},
    {"tags_all": ["ctf", "ffa", "tdm", "insta"]},
    {"tags_any": ["tdm", "insta"]},
    {"tags_any": ["nosuchtag"]},
    {"name": "night"},  # case-insensitive: "Friday Night" and "NIGHT owls"
    {"name": "#0042"},
    {"name": "no such server"},
    {"family": 4},
    {"family": 6},
    {"version": "1.1", "map": "ctf1", "not_full": True, "tags_any": ["ctf", "insta"]},
]


@dataclass
class Fleet:
    daemon: Matchmaker
    specs: dict[Address, Spec]
    clients: dict[Address, MatchmakerClient]
    sockets: dict[Address, rudp.Server]


def settings(v6: bool) -> Settings:
    return Settings(
        # Dual stack when ::1 exists: IPv4 hosts arrive as ::ffff:127.0.0.x,
        # which the matchmaker normalises back to 127.0.0.x.
        bind="::" if v6 else "127.0.0.1",
        port=0,
        http_bind="127.0.0.1",
        http_port=0,
        allow_private=True,  # loopback hosts
        hide_after=HIDE_AFTER,
        expire_after=EXPIRE_AFTER,
        keepalive=KEEPALIVE,
        sweep_interval=0.25,
        max_hosts_per_ip=max(V6_HOSTS, N_HOSTS // V4_IPS),
        register_rate=1000.0,
        register_burst=1000.0,
        list_rate=1000.0,
        list_burst=1000.0,
        max_connections_per_source=0,  # 20 hosts per loopback IP, 30 on ::1
        handshake_rate=0.0,
        shutdown_timeout=5.0,
    )


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    v6 = ipv6_loopback()
    daemon = Matchmaker(settings(v6))
    await daemon.start()
    port = daemon.udp_address[1]
    specs: dict[Address, Spec] = {}
    clients: dict[Address, MatchmakerClient] = {}
    sockets: dict[Address, rudp.Server] = {}
    opened: list[tuple[rudp.Server, MatchmakerClient]] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    # One game socket per host; fewer channels keep 1,000 of them light.
    config = rudp.Config(channels=1)

    async def start_host(i: int) -> None:
        spec = make_spec(i, v6 and i < V6_HOSTS)
        async with gate:
            server = await rudp.open_endpoint(spec.bind, 0, config=config)
            target = "::1" if spec.bind == "::1" else "127.0.0.1"
            client = MatchmakerClient.to(target, port, via=server, timeout=15.0)
            opened.append((server, client))
            address = await client.register(**spec.register_args())
        assert address.ip == spec.bind and address.port == server.address[1]
        specs[address] = spec
        clients[address] = client
        sockets[address] = server

    try:
        await asyncio.gather(*(start_host(i) for i in range(N_HOSTS)))
        yield Fleet(daemon, specs, clients, sockets)
    finally:
        await asyncio.gather(*(c.close() for _, c in opened), return_exceptions=True)
        for server, _ in opened:
            server.endpoint.close_now()
        await daemon.shutdown()


async def listed(lister: MatchmakerClient, game: str, **f: Any) -> set[Address]:
    entries = await lister.list_servers(game=game, **f)
    addresses = [e.address for e in entries]
    assert len(addresses) == len(set(addresses)), "a host was listed twice"
    return set(addresses)


async def poll(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Await `check()` until it is true; returns the seconds it took."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.25)
    return time.monotonic() - start


async def test_thousand_hosts_every_filter_then_dead_hosts_leave(fleet: Fleet) -> None:
    daemon, specs = fleet.daemon, fleet.specs
    assert len(specs) == N_HOSTS
    lister = MatchmakerClient.to("127.0.0.1", daemon.udp_address[1], timeout=10.0)
    try:
        # Every host and its listed fields (never `lan`), through real list pages.
        total = 0
        for game in GAMES:
            entries = await lister.list_servers(game=game)
            total += len(entries)
            assert {e.address for e in entries} == expected(specs, game)
            for e in entries:
                s = specs[e.address]
                assert (e.info.name, e.info.version, e.info.map, e.info.region) == (
                    s.name,
                    s.version,
                    s.map,
                    s.region,
                )
                assert (e.info.players, e.info.max_players, e.info.password) == (
                    s.players,
                    s.max_players,
                    s.password,
                )
                assert set(e.info.tags) == set(s.tags) and e.info.lan is None
        assert total == N_HOSTS
        assert await listed(lister, "gamma") == set()

        for game in GAMES:
            for f in FILTERS:
                want = expected(specs, game, **f)
                got = await listed(lister, game, **f)
                assert got == want, f"game={game} {f}: {len(got)} listed, {len(want)} expected"
        # The data set makes every filter meaningful: each one selects a strict,
        # non-empty part of some game (apart from the deliberately empty ones).
        has_v6 = any(a.family == 6 for a in specs)
        for f in FILTERS[1:]:
            sizes = [len(expected(specs, g, **f)) for g in GAMES]
            if not has_v6 and "family" in f:
                continue
            if "nosuchtag" in f.get("tags_any", ()) or f.get("name") == "no such server":
                assert max(sizes) == 0, f
            else:
                assert 0 < max(sizes) < N_HOSTS // len(GAMES), (f, sizes)

        # A tenth of the hosts die: their sockets go away without a DISCONNECT
        # or an unregister, as when a game process is killed.
        dead = {a for i, a in enumerate(sorted(specs, key=str)) if i % 10 == 3}
        for address in dead:
            fleet.sockets[address].endpoint.close_now()
            await fleet.clients[address].close()  # its socket is gone: nothing is sent
        alive = {a: s for a, s in specs.items() if a not in dead}

        async def lists_are_alive() -> bool:
            got: set[Address] = set()
            for game in GAMES:
                got |= await listed(lister, game)
            assert got <= set(specs)
            return got == set(alive)

        took = await poll(lists_are_alive, HIDE_AFTER + SLACK, "dead hosts left the lists")
        assert took <= HIDE_AFTER + SLACK
        # ...and the registry forgets them (connection timeout or expiry).
        registry = daemon.registry

        async def forgotten() -> bool:
            return all(registry.get(a) is None for a in dead)

        await poll(forgotten, EXPIRE_AFTER + SLACK, "dead hosts removed from the registry")
        assert all(registry.get(a) is not None for a in alive)
        # The survivors kept heartbeating all along and are still listed, filters too.
        for game in GAMES:
            assert await listed(lister, game, not_empty=True) == expected(
                alive, game, not_empty=True
            )
    finally:
        await lister.close()
