"""Lockstep over a bad network: four players, one deterministic integer world, identical checksums.

A host (``LockstepServer``) and ``--clients`` players (``LockstepSession``) run in one process
over real rudp sockets on 127.0.0.1. Every player's rudp endpoint goes through the in-process
network simulator (``rudp.Config(netsim=...)``) with ``--loss`` and ``--delay-ms`` in *each*
direction, so every player-host link loses packets and has a round trip of twice the delay.

Each player runs its own copy of a small RTS-like world (units that move, wander and fight)
written with integers only: positions are fixed-point (1 tile = 256 units), distances use
``math.isqrt``, and every unit has its own seeded 64-bit generator (splitmix64). No floats, no
wall clock, no unordered iteration in the simulation: see docs/lockstep.md, "Why determinism".
Players issue random orders (move, attack-move, spawn) at random moments; the orders reach the
world only through the host's NETTURNs, so every copy applies the same orders on the same turn.

After every turn each player hashes its world (blake2b, 64 bits) and reports the checksum to
the host, as the protocol requires, and to this script, which checks that all players computed
the same checksum on every turn and exits 1 otherwise (also on a host-reported desync, a player
dropped or a timeout). It prints the turn rate and the input-to-execution latency (p50/p99):
the time from a player issuing an order to that order's turn being executed, on the issuing
player and on the last of all players.

Defaults: 4 clients, 1000 turns, 5 % loss and 50 ms one-way delay each way, turns of 50 ms
(20 turns/s, so about 50 s of game plus a second or two to connect and leave: well within two
minutes; the classic 100 ms would take 100 s). The input delay defaults to the smallest number
of turns whose span exceeds a round trip plus one turn, ``floor((2 * delay + turn) / turn) + 1``:
4 turns (200 ms) at the defaults, so an order is on time unless a loss delays it. Run::

    python examples/lockstep_demo.py
    python examples/lockstep_demo.py --clients 6 --turns 300 --loss 0.1 --delay-ms 80 --seed 7

``--inject-desync TURN`` makes player 0 nudge one unit by 1/256 of a tile after that turn
(what a float rounding differently on one machine does) to show detection; the run then fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import math
import random
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import rudp
from rudp.lockstep import (
    ClientJoined,
    ClientLeft,
    ClientState,
    ClientUnresponsive,
    DesyncDetected,
    Event,
    GameStarted,
    Joined,
    LeaveReason,
    LockstepConfig,
    TimeDropped,
    Turn,
)
from rudp.lockstep.aio import LockstepServer, LockstepSession
from rudp.netsim import LinkProfile

# ============================================================================ the simulation
#
# Integers only. Python's int arithmetic (floor division included) is exactly specified, so
# every machine computes the same world from the same orders.

FIXED = 256
"""Fixed-point scale: one tile is 256 units."""
MAP_TILES = 64
MAP_SIZE = MAP_TILES * FIXED
"""The map is MAP_SIZE x MAP_SIZE units; coordinates are in [0, MAP_SIZE)."""
SPEED = FIXED // 2
"""Units per turn a unit walks (half a tile)."""
ATTACK_RANGE = 2 * FIXED
START_UNITS = 4
MAX_UNITS = 8
"""Per player."""
MAX_HP = 100
COOLDOWN = 4
"""Turns between two attacks of one unit."""
WANDER = 4 * FIXED
"""How far an idle unit may wander from where it stands."""

MASK64 = (1 << 64) - 1

OP_MOVE = 1
OP_ATTACK = 2
OP_SPAWN = 3
COMMAND = struct.Struct(">BBHHH")
"""An order: op, unit slot, x, y (map units), and the player's order sequence number."""
UNIT = struct.Struct(">IBiiiiiiQ")
HEADER = struct.Struct(">iIQ")


def splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64: ``(new state, 64-bit output)``."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


@dataclass(slots=True)
class Unit:
    uid: int
    owner: int
    x: int
    y: int
    tx: int
    """Target position."""
    ty: int
    hp: int = MAX_HP
    cooldown: int = 0
    rng: int = 0
    """This unit's own generator state, so units never disturb each other's randomness."""

    def roll(self, n: int) -> int:
        """A number in ``[0, n)`` from this unit's generator."""
        self.rng, out = splitmix64(self.rng)
        return out % n


class World:
    """The game state every player keeps a copy of; :meth:`step` advances it one turn."""

    def __init__(self, seed: int, players: Sequence[int]) -> None:
        self.seed = seed & MASK64
        self.turn = -1
        self.players = tuple(sorted(players))
        self.units: dict[int, Unit] = {}  # by uid; always iterated in uid order
        self.next_uid = 0
        self.losses: dict[int, int] = dict.fromkeys(self.players, 0)
        count = len(self.players)
        self.bases = {p: self._base(i, count) for i, p in enumerate(self.players)}
        for player in self.players:
            for _ in range(START_UNITS):
                self._spawn(player)

    @staticmethod
    def _base(index: int, count: int) -> tuple[int, int]:
        """Bases spread evenly around a square ring (no trigonometry, hence no floats)."""
        margin = 8 * FIXED
        side = MAP_SIZE - 2 * margin
        along = index * 4 * side // count
        edge, offset = divmod(along, side)
        corners = [
            (margin + offset, margin),
            (margin + side, margin + offset),
            (margin + side - offset, margin + side),
            (margin, margin + side - offset),
        ]
        return corners[edge]

    def _spawn(self, owner: int) -> None:
        uid = self.next_uid
        self.next_uid += 1
        rng, _ = splitmix64(self.seed ^ (uid * 0xD1B54A32D192ED03 & MASK64))
        bx, by = self.bases[owner]
        unit = Unit(uid, owner, bx, by, bx, by, rng=rng)
        unit.tx = clamp(bx + unit.roll(2 * WANDER + 1) - WANDER, 0, MAP_SIZE - 1)
        unit.ty = clamp(by + unit.roll(2 * WANDER + 1) - WANDER, 0, MAP_SIZE - 1)
        self.units[uid] = unit

    def units_of(self, owner: int) -> list[Unit]:
        return [u for u in self.units.values() if u.owner == owner]

    # ---------------------------------------------------------------- one turn

    def step(self, turn: int, commands: Sequence[tuple[int, bytes]]) -> int:
        """Apply ``commands`` in the host's order, advance one turn, return the checksum."""
        self.turn = turn
        for client_id, data in commands:
            self._apply(client_id, data)
        for uid in sorted(self.units):
            self._move(self.units[uid])
        self._fight()
        return self.checksum()

    def _apply(self, owner: int, data: bytes) -> None:
        if owner not in self.bases or len(data) != COMMAND.size:
            return  # ignored identically everywhere
        op, slot, x, y, _seq = COMMAND.unpack(data)
        if op == OP_SPAWN:
            if len(self.units_of(owner)) < MAX_UNITS:
                self._spawn(owner)
            return
        own = self.units_of(owner)
        if not own or op not in (OP_MOVE, OP_ATTACK):
            return
        unit = own[slot % len(own)]
        unit.tx, unit.ty = clamp(x, 0, MAP_SIZE - 1), clamp(y, 0, MAP_SIZE - 1)
        if op == OP_ATTACK:
            for other in own:  # the whole army follows, a few tiles apart
                other.tx = clamp(unit.tx + (other.uid % 5 - 2) * FIXED, 0, MAP_SIZE - 1)
                other.ty = clamp(unit.ty + (other.uid % 3 - 1) * FIXED, 0, MAP_SIZE - 1)

    def _move(self, unit: Unit) -> None:
        dx, dy = unit.tx - unit.x, unit.ty - unit.y
        dist = math.isqrt(dx * dx + dy * dy)
        if dist <= SPEED:
            unit.x, unit.y = unit.tx, unit.ty
            if unit.roll(4) == 0:  # idle: wander a little
                unit.tx = clamp(unit.x + unit.roll(2 * WANDER + 1) - WANDER, 0, MAP_SIZE - 1)
                unit.ty = clamp(unit.y + unit.roll(2 * WANDER + 1) - WANDER, 0, MAP_SIZE - 1)
        else:
            unit.x += dx * SPEED // dist
            unit.y += dy * SPEED // dist

    def _fight(self) -> None:
        """Every ready unit hits the nearest enemy in range; damage lands simultaneously."""
        order = sorted(self.units)
        damage: dict[int, int] = {}
        for uid in order:
            unit = self.units[uid]
            if unit.cooldown > 0:
                unit.cooldown -= 1
                continue
            best: tuple[int, int] | None = None
            for other_uid in order:
                other = self.units[other_uid]
                if other.owner == unit.owner:
                    continue
                d2 = (other.x - unit.x) ** 2 + (other.y - unit.y) ** 2
                if d2 <= ATTACK_RANGE * ATTACK_RANGE and (best is None or (d2, other_uid) < best):
                    best = (d2, other_uid)
            if best is not None:
                damage[best[1]] = damage.get(best[1], 0) + 8 + unit.roll(8)
                unit.cooldown = COOLDOWN
        for uid in sorted(damage):
            unit = self.units[uid]
            unit.hp -= damage[uid]
            if unit.hp <= 0:
                del self.units[uid]
                self.losses[unit.owner] += 1

    def checksum(self) -> int:
        """64-bit hash of the whole state, in a fixed byte layout."""
        h = hashlib.blake2b(digest_size=8)
        h.update(HEADER.pack(self.turn, self.next_uid, self.seed))
        for uid in sorted(self.units):
            u = self.units[uid]
            h.update(UNIT.pack(u.uid, u.owner, u.x, u.y, u.tx, u.ty, u.hp, u.cooldown, u.rng))
        for player in self.players:
            h.update(struct.pack(">BI", player, self.losses[player]))
        return int.from_bytes(h.digest(), "big")


# ============================================================================ the demo


@dataclass(frozen=True, kw_only=True)
class Options:
    clients: int = 4
    turns: int = 1000
    loss: float = 0.05
    delay_ms: float = 50.0
    turn_ms: float = 50.0
    seed: int = 1
    input_delay: int | None = None
    """Turns; ``None`` picks ``floor((2 * delay + turn) / turn) + 1``."""
    print_every: int = 100
    inject_desync: int | None = None
    timeout: float | None = None
    """Seconds for the whole run; ``None`` allows twice the nominal game time plus 30 s."""

    @property
    def turn_interval(self) -> float:
        return self.turn_ms / 1000

    @property
    def effective_input_delay(self) -> int:
        if self.input_delay is not None:
            return self.input_delay
        # The smallest D with D * turn > 2 * delay + turn: an order issued just before the
        # next turn arrives still reaches the host before its turn is sent, if not lost.
        return int((2 * self.delay_ms + self.turn_ms) // self.turn_ms) + 1

    @property
    def effective_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        return 30.0 + 2 * self.turns * self.turn_interval


def percentile(values: Sequence[float], pct: int) -> float:
    """Nearest-rank percentile of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, (pct * len(ordered) + 99) // 100)
    return ordered[rank - 1]


@dataclass
class Report:
    """What the run found; ``ok`` decides the exit status."""

    clients: int
    turns: int
    verified_turns: int = 0
    """Turns every client executed with the same checksum."""
    first_mismatch: int | None = None
    final_checksum: int | None = None
    problems: list[str] = field(default_factory=list)
    turn_rate: float = 0.0
    """Turns per second of the slowest client, from its first turn to its last."""
    game_time: float = 0.0
    """Seconds from START to the last turn executed on the last client."""
    elapsed: float = 0.0
    latency_own: list[float] = field(default_factory=list)
    """Seconds from issuing an order to executing its turn, on the issuing client."""
    latency_all: list[float] = field(default_factory=list)
    """Seconds from issuing an order to its turn being executed on every client."""
    orders_issued: int = 0

    @property
    def identical(self) -> bool:
        return self.first_mismatch is None and self.verified_turns == self.turns

    @property
    def ok(self) -> bool:
        return self.identical and not self.problems


class Referee:
    """Collects every client's checksum for every turn and compares them as they complete."""

    def __init__(self, opts: Options, out: TextIO, report: Report) -> None:
        self.opts = opts
        self.out = out
        self.report = report
        self.checksums: dict[int, dict[int, int]] = {}
        self.started_at = 0.0
        self.issued: dict[tuple[int, int], float] = {}
        self.executed: dict[tuple[int, int], list[float]] = {}

    def done_turn(self, index: int, turn: int, checksum: int, units: int) -> None:
        reports = self.checksums.setdefault(turn, {})
        reports[index] = checksum
        if len(reports) < self.opts.clients:
            return
        values = set(reports.values())
        if len(values) > 1:
            if self.report.first_mismatch is None or turn < self.report.first_mismatch:
                self.report.first_mismatch = turn
                listing = ", ".join(f"client {i}: {c:#018x}" for i, c in sorted(reports.items()))
                print(f"DESYNC at turn {turn}: {listing}", file=self.out)
            return
        if (turn + 1) % self.opts.print_every == 0 or turn + 1 == self.opts.turns:
            elapsed = time.monotonic() - self.started_at
            print(
                f"turn {turn + 1:>5}/{self.opts.turns}  checksum {checksum:#018x}  identical on"
                f" {len(reports)}/{self.opts.clients} clients  units {units:>2}  {elapsed:6.1f} s",
                file=self.out,
                flush=True,
            )

    def finish(self) -> None:
        report = self.report
        verified = 0
        for turn in range(self.opts.turns):
            reports = self.checksums.get(turn, {})
            if len(reports) < self.opts.clients:
                break
            if len(set(reports.values())) > 1:
                if report.first_mismatch is None or turn < report.first_mismatch:
                    report.first_mismatch = turn
                break
            verified += 1
            report.final_checksum = next(iter(reports.values()))
        report.verified_turns = verified
        report.orders_issued = len(self.issued)
        for key, issued_at in self.issued.items():
            times = self.executed.get(key, [])
            if len(times) == self.opts.clients:
                report.latency_all.append(max(times) - issued_at)


class Player:
    """One client: its own world, its own random orders, and the turn loop."""

    def __init__(
        self, index: int, session: LockstepSession, opts: Options, referee: Referee
    ) -> None:
        self.index = index
        self.session = session
        self.opts = opts
        self.referee = referee
        self.world: World | None = None
        self.roster: set[int] = set()
        self.client_id: int | None = None
        self.executed = 0
        self.first_turn_at = 0.0
        self.last_turn_at = 0.0
        self.seq = 0
        self.orders = random.Random(f"{opts.seed}/{index}")  # inputs, not simulation
        self.issued: dict[int, float] = {}
        self.done = asyncio.Event()
        self.inputs: asyncio.Task[None] | None = None

    async def play(self) -> None:
        """Run turns until ``opts.turns`` are done, then leave the game."""
        try:
            async for event in self.session.events():
                if not self._on_event(event):
                    return
                if self.world is not None:
                    self._run_turns(self.world)
                if self.executed >= self.opts.turns:
                    break
            else:
                self._problem(f"connection ended after {self.executed} turns")
        finally:
            self.done.set()
            if self.inputs is not None:
                self.inputs.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.inputs
        if self.session.client.state is not ClientState.ENDED:
            await self.session.leave()

    def _on_event(self, event: Event) -> bool:
        """Track the roster and the start; False when this player is out of the game."""
        match event:
            case Joined(client_id, roster):
                self.client_id = client_id
                self.roster = {cid for cid, _ in roster}
            case ClientJoined(client_id, _):
                self.roster.add(client_id)
            case ClientLeft(client_id, reason):
                self.roster.discard(client_id)
                if client_id == self.client_id:
                    self._problem(f"removed by the host ({reason.name})")
                    return False
            case GameStarted():
                # The roster at START, taken in event order, is the same on every client.
                self.world = World(self.opts.seed, sorted(self.roster))
                self.inputs = asyncio.create_task(self._issue_orders())
            case DesyncDetected(turn, _, diverged, _):
                self._problem(f"host reported a desync at turn {turn}: {sorted(diverged)}")
            case _:
                pass
        return True

    def _problem(self, text: str) -> None:
        self.referee.report.problems.append(f"client {self.index}: {text}")

    def _run_turns(self, world: World) -> None:
        while self.executed < self.opts.turns and (turn := self.session.next_turn()) is not None:
            checksum = world.step(turn.number, turn.commands)
            if turn.number == self.opts.inject_desync and self.index == 0 and world.units:
                world.units[min(world.units)].x += 1  # one machine rounding differently
                checksum = world.checksum()
            self.session.complete_turn(turn.number, checksum)
            self.executed += 1
            self.last_turn_at = time.monotonic()
            if self.executed == 1:
                self.first_turn_at = self.last_turn_at
            self._record_orders(turn)
            self.referee.done_turn(self.index, turn.number, checksum, len(world.units))

    def _record_orders(self, turn: Turn) -> None:
        now = time.monotonic()
        for client_id, data in turn.commands:
            if len(data) != COMMAND.size:
                continue
            seq = COMMAND.unpack(data)[4]
            self.referee.executed.setdefault((client_id, seq), []).append(now)
            if client_id == self.client_id and seq in self.issued:
                self.referee.report.latency_own.append(now - self.issued.pop(seq))

    async def _issue_orders(self) -> None:
        """A player clicking about once every two turns, at random moments between turns."""
        rng = self.orders
        turn_ms = max(1, round(self.opts.turn_ms))
        # Stop early enough that orders land before the end (a late order runs a turn later).
        last_target = self.opts.turns - 1 - max(5, self.opts.turns // 20)
        while not self.done.is_set():
            await asyncio.sleep(rng.randrange(turn_ms, 3 * turn_ms) / 1000)
            world, client = self.world, self.session.client
            if world is None or client.client_id is None:
                continue
            if client.latest_turn + client.input_delay > last_target:
                return
            self._issue(world, client.client_id, rng)

    def _issue(self, world: World, me: int, rng: random.Random) -> None:
        roll = rng.randrange(20)
        mine = world.units_of(me)
        enemies = [u for u in world.units.values() if u.owner != me]
        slot = rng.randrange(256)
        if roll < 3 or not mine:
            op, x, y = OP_SPAWN, 0, 0
        elif roll < 9 and enemies:
            target = enemies[rng.randrange(len(enemies))]
            op, x, y = OP_ATTACK, target.x, target.y
        else:
            op, x, y = OP_MOVE, rng.randrange(MAP_SIZE), rng.randrange(MAP_SIZE)
        self.seq = (self.seq + 1) & 0xFFFF
        data = COMMAND.pack(op, slot, x, y, self.seq)
        now = time.monotonic()
        self.session.send_command(data)
        self.issued[self.seq] = now
        self.referee.issued[(me, self.seq)] = now


class HostWatch:
    """Consumes the host's events: counts joins, flags desyncs and dropped players."""

    def __init__(self, server: LockstepServer, clients: int, report: Report) -> None:
        self.server = server
        self.clients = clients
        self.report = report
        self.all_joined = asyncio.Event()
        self.joined = 0
        self.unresponsive = 0
        self.time_dropped = 0
        self.closing = False
        """Set when the demo shuts down; players leaving then are no news."""

    async def run(self) -> None:
        async for event in self.server.events():
            match event:
                case ClientJoined():
                    self.joined += 1
                    if self.joined == self.clients:
                        self.all_joined.set()
                case DesyncDetected(turn, _, diverged, _):
                    self.report.problems.append(
                        f"host: desync at turn {turn}, diverged {sorted(diverged)}"
                    )
                case ClientLeft(client_id, reason) if (
                    reason is not LeaveReason.LEFT and not self.closing
                ):
                    self.report.problems.append(f"host: client {client_id} out ({reason.name})")
                case ClientUnresponsive():
                    self.unresponsive += 1
                case TimeDropped(turns):
                    self.time_dropped += turns
                case _:
                    pass


async def run_demo(opts: Options, out: TextIO | None = None) -> Report:
    """Run one game; everything is printed to ``out`` and summarised in the returned report."""
    out = sys.stdout if out is None else out
    report = Report(clients=opts.clients, turns=opts.turns)
    referee = Referee(opts, out, report)
    delay = opts.delay_ms / 1000
    input_delay = opts.effective_input_delay
    config = LockstepConfig(
        turn_interval=opts.turn_interval,
        input_delay=input_delay,
        max_clients=opts.clients,
        max_command_lead=max(64, input_delay),
    )
    link = LinkProfile(loss=opts.loss, latency=delay)
    print(
        f"lockstep demo: {opts.clients} clients, {opts.turns} turns of {opts.turn_ms:g} ms"
        f" ({1000 / opts.turn_ms:.1f} turns/s), input delay {input_delay} turns"
        f" ({input_delay * opts.turn_ms:g} ms), seed {opts.seed}",
        file=out,
    )
    started = time.monotonic()
    server = await LockstepServer.serve("127.0.0.1", 0, config=config)
    watch = HostWatch(server, opts.clients, report)
    watcher = asyncio.create_task(watch.run())
    sessions: list[LockstepSession] = []
    players: list[Player] = []
    try:
        host, port = server.address
        print(
            f"network: each client <-> host {host}:{port} link: {opts.loss:.1%} loss and"
            f" {opts.delay_ms:g} ms delay each way (rudp netsim in-process, real UDP on loopback)",
            file=out,
        )

        async def scenario() -> None:
            for index in range(opts.clients):
                netsim = rudp.NetsimConfig(
                    outbound=link, inbound=link, seed=opts.seed * 1000 + 2 * index
                )
                session = await LockstepSession.connect(
                    host,
                    port,
                    name=f"player{index}",
                    config=config,
                    rudp_config=rudp.Config(netsim=netsim),
                )
                sessions.append(session)
                players.append(Player(index, session, opts, referee))
            games = [asyncio.create_task(p.play()) for p in players]
            try:
                await watch.all_joined.wait()
                referee.started_at = time.monotonic()
                server.start()
                await asyncio.gather(*games)
            finally:
                for game in games:
                    game.cancel()

        try:
            await asyncio.wait_for(scenario(), timeout=opts.effective_timeout)
        except TimeoutError:
            behind = ", ".join(f"client {p.index}: {p.executed}" for p in players)
            report.problems.append(
                f"timed out after {opts.effective_timeout:g} s (turns done: {behind or 'none'})"
            )
    finally:
        watch.closing = True
        for session in sessions:
            await session.close()
        await server.close()
        await watcher

    referee.finish()
    report.elapsed = time.monotonic() - started
    if players and all(p.executed == opts.turns for p in players):
        report.game_time = max(p.last_turn_at for p in players) - referee.started_at
        if opts.turns > 1:
            report.turn_rate = min(
                (opts.turns - 1) / (p.last_turn_at - p.first_turn_at) for p in players
            )
    _summarise(opts, report, watch, server, sessions, out)
    return report


def _summarise(
    opts: Options,
    report: Report,
    watch: HostWatch,
    server: LockstepServer,
    sessions: Sequence[LockstepSession],
    out: TextIO,
) -> None:
    def say(text: str) -> None:
        print(text, file=out)

    if report.identical:
        say(
            f"checksums: identical on all {opts.clients} clients on every one of"
            f" {opts.turns} turns; final state {report.final_checksum:#018x}"
        )
    elif report.first_mismatch is not None:
        say(f"checksums: DIFFER from turn {report.first_mismatch} on")
    else:
        say(f"checksums: only {report.verified_turns} of {opts.turns} turns verified")
    if report.turn_rate:
        say(
            f"turn rate: {report.turn_rate:.2f} turns/s on the slowest client"
            f" (target {1000 / opts.turn_ms:.2f}); all {opts.turns} turns done on every client"
            f" {report.game_time:.1f} s after START"
        )
    for label, values in (
        ("issuing client", report.latency_own),
        ("all clients", report.latency_all),
    ):
        if values:
            say(
                f"input-to-execution latency ({label}): p50 {percentile(values, 50) * 1000:.0f} ms,"
                f" p99 {percentile(values, 99) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"
                f" ({len(values)} orders)"
            )
    sent = sum(s.conn.stats.packets_sent for s in sessions)
    lost = sum(s.conn.stats.packets_lost for s in sessions)
    resent = sum(s.conn.stats.messages_resent for s in sessions)
    srtt = [s.conn.stats.srtt * 1000 for s in sessions]
    stats = server.host.stats
    say(
        f"transport: clients sent {sent} packets, {lost} declared lost, {resent} messages resent;"
        f" srtt {min(srtt, default=0):.0f}-{max(srtt, default=0):.0f} ms"
    )
    say(
        f"host: {server.host.next_turn} turns sent, {report.orders_issued} orders issued,"
        f" {stats.late_commands} late (run in the next unsent turn),"
        f" {stats.desynced_turns} desynced turns,"
        f" {watch.unresponsive} unresponsive reports, {stats.dropped_turns} dropped turns"
    )
    for problem in report.problems:
        say(f"problem: {problem}")
    say(f"result: {'OK' if report.ok else 'FAILED'} ({report.elapsed:.1f} s)")


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        description="Deterministic lockstep game over rudp with simulated loss and delay."
    )
    parser.add_argument("--clients", type=int, default=4, help="players (1-16; default 4)")
    parser.add_argument("--turns", type=int, default=1000, help="turns to play (default 1000)")
    parser.add_argument(
        "--loss", type=float, default=0.05, help="loss probability each way (default 0.05)"
    )
    parser.add_argument(
        "--delay-ms", type=float, default=50.0, help="one-way delay each way (default 50)"
    )
    parser.add_argument(
        "--turn-ms", type=float, default=50.0, help="turn interval in ms (default 50: 20 turns/s)"
    )
    parser.add_argument("--seed", type=int, default=1, help="world and netsim seed (default 1)")
    parser.add_argument(
        "--input-delay",
        type=int,
        default=None,
        help="turns between an order and its turn (default floor((2*delay + turn) / turn) + 1)",
    )
    parser.add_argument(
        "--print-every",
        type=int,
        default=100,
        help="print a checksum line every N turns (default 100)",
    )
    parser.add_argument(
        "--inject-desync",
        type=int,
        default=None,
        metavar="TURN",
        help="make client 0 diverge after TURN, to see detection (the run then fails)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds for the whole run (default auto)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.clients <= 16:
        parser.error("--clients must be between 1 and 16")
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if not 0.0 <= args.loss < 1.0:
        parser.error("--loss must be in [0, 1)")
    if not (math.isfinite(args.delay_ms) and args.delay_ms >= 0):
        parser.error("--delay-ms must be >= 0")
    if not (math.isfinite(args.turn_ms) and 1 <= args.turn_ms <= 10_000):
        parser.error("--turn-ms must be between 1 and 10000")
    if args.input_delay is not None and not 1 <= args.input_delay <= 64:
        parser.error("--input-delay must be between 1 and 64")
    if args.print_every < 1:
        parser.error("--print-every must be at least 1")
    return Options(
        clients=args.clients,
        turns=args.turns,
        loss=args.loss,
        delay_ms=args.delay_ms,
        turn_ms=args.turn_ms,
        seed=args.seed,
        input_delay=args.input_delay,
        print_every=args.print_every,
        inject_desync=args.inject_desync,
        timeout=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every client computed identical checksums on every turn, else 1."""
    report = asyncio.run(run_demo(parse_args(argv)))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
