"""Lockstep, deterministically: a fake clock and an in-memory reliable-ordered network.

``Lab`` wires one LockstepHost to several LockstepClients. Each link is
reliable and ordered (that is what rudp gives lockstep), so "loss" shows up
as delay: a lost datagram costs the retransmission time, and everything
behind it on the same link waits (head-of-line blocking). Delays come from a
seeded ``random.Random``; time advances in fixed steps; timers fire only when
their ``get_timer()`` deadline has passed, so a wrong deadline shows up as
wrong behaviour. Nothing here reads a real clock.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rudp.errors import LocalProtocolError
from rudp.lockstep import (
    PROTOCOL_VERSION,
    ClientJoined,
    ClientLeft,
    ClientResponsive,
    ClientState,
    ClientUnresponsive,
    DesyncDetected,
    Event,
    GameStarted,
    HostResponsive,
    HostState,
    HostUnresponsive,
    Joined,
    JoinRefused,
    LeaveReason,
    LockstepClient,
    LockstepConfig,
    LockstepHost,
    RefuseReason,
    TimeDropped,
    Turn,
    TurnClock,
)
from rudp.lockstep import messages as m
from rudp.lockstep.config import MAX_CLIENTS_LIMIT
from tests.rudp.harness import running_lockstep_pair

HOST = "host"


def sim_step(state: int, turn: int, commands: tuple[tuple[int, bytes], ...]) -> int:
    """A tiny deterministic simulation: integer-only, order-sensitive."""
    state = (state * 6364136223846793005 + turn + 1) % 2**64
    for client_id, data in commands:
        state = (state * 31 + client_id * 257 + int.from_bytes(data[:8].ljust(8, b"\0"))) % 2**64
    return state


@dataclass
class Player:
    name: str
    client: LockstepClient
    state: int = 0
    frozen: bool = False
    corrupt_at: int | None = None
    executed: list[Turn] = field(default_factory=list)
    events: list[tuple[float, Event]] = field(default_factory=list)
    sent: list[tuple[int, bytes]] = field(default_factory=list)

    def event_types(self) -> list[type]:
        return [type(e) for _, e in self.events]


class Lab:
    def __init__(
        self,
        *,
        seed: int = 0,
        config: LockstepConfig | None = None,
        delay: float = 0.02,
        jitter: float = 0.02,
        loss: float = 0.0,
        retransmit: float = 0.25,
        command_rate: float = 0.0,
        dt: float = 0.005,
    ) -> None:
        self.rng = random.Random(seed)
        self.config = config or LockstepConfig()
        self.now = 0.0
        self.dt = dt
        self.delay, self.jitter, self.loss, self.retransmit = delay, jitter, loss, retransmit
        self.command_rate = command_rate
        self.host = LockstepHost[str](config=self.config)
        self.players: dict[str, Player] = {}
        self.host_events: list[tuple[float, Event]] = []
        self.closed: set[str] = set()
        self.sent_turns: list[m.NetTurn] = []
        self._inflight: list[tuple[float, int, str, str, bytes]] = []
        self._link_free: dict[tuple[str, str], float] = {}
        self._seq = 0
        self._turns: dict[int, m.NetTurn] = {}

    # ---------------------------------------------------------------- network

    def _link_delay(self) -> float:
        delay = self.delay + self.rng.uniform(0, self.jitter)
        while self.rng.random() < self.loss:  # each loss costs one retransmission timeout
            delay += self.retransmit
        return delay

    def post(self, src: str, dst: str, data: bytes) -> None:
        # Ordered link: nothing overtakes what was sent before it.
        at = max(self.now + self._link_delay(), self._link_free.get((src, dst), 0.0))
        self._link_free[(src, dst)] = at
        self._seq += 1
        heapq.heappush(self._inflight, (at, self._seq, src, dst, data))

    def add(self, name: str, **kwargs: Any) -> Player:
        config = kwargs.pop("config", self.config)
        player = Player(name, LockstepClient(name=name, config=config), **kwargs)
        self.players[name] = player
        self.pump()
        return player

    def pump(self) -> None:
        for peer, data in self.host.messages_to_send():
            assert len(data) <= self.config.max_message_size  # fits one rudp message
            if peer in self.players:
                self._record(data)
                self.post(HOST, peer, data)
        self.closed.update(self.host.peers_to_close())
        while (event := self.host.next_event()) is not None:
            self.host_events.append((self.now, event))
        for p in self.players.values():
            for data in p.client.messages_to_send():
                self.post(p.name, HOST, data)
            while (event := p.client.next_event()) is not None:
                p.events.append((self.now, event))

    def _record(self, data: bytes) -> None:
        """Keep one copy of each NETTURN the host broadcasts."""
        msg = m.decode(data, self.config)
        if isinstance(msg, m.NetTurn) and msg.turn not in self._turns:
            self._turns[msg.turn] = msg
            self.sent_turns.append(msg)

    # ---------------------------------------------------------------- time

    def step(self) -> None:
        self.now = round(self.now + self.dt, 9)
        while self._inflight and self._inflight[0][0] <= self.now:
            _, _, src, dst, data = heapq.heappop(self._inflight)
            if dst == HOST:
                if src not in self.closed:  # a closed connection delivers nothing more
                    self.host.receive(src, data, self.now)
            else:
                self.players[dst].client.receive(data, self.now)
            self.pump()
        self._timers()
        for p in self.players.values():
            self._play(p)
        self.pump()

    def _timers(self) -> None:
        deadline = self.host.get_timer()
        if deadline is not None and deadline <= self.now:
            self.host.handle_timer(self.now)
            after = self.host.get_timer()
            assert after is None or after > self.now, "host timer would spin"
        for p in self.players.values():
            deadline = p.client.get_timer()
            if deadline is not None and deadline <= self.now:
                p.client.handle_timer(self.now)
                after = p.client.get_timer()
                assert after is None or after > self.now, "client timer would spin"

    def _play(self, p: Player) -> None:
        if p.frozen or p.client.state is not ClientState.RUNNING:
            return
        while (turn := p.client.next_turn()) is not None:
            p.state = sim_step(p.state, turn.number, turn.commands)
            if turn.number == p.corrupt_at:
                p.state ^= 1  # a float rounding differently on one machine
            p.executed.append(turn)
            p.client.complete_turn(turn.number, p.state)
        if self.command_rate and self.rng.random() < self.command_rate:
            data = f"{p.name}:{len(p.sent)}".encode()
            p.sent.append((p.client.send_command(data), data))

    def run_for(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.step()

    def run_until(self, predicate: Any, limit: float = 60.0) -> None:
        end = self.now + limit
        while not predicate():
            assert self.now < end, "condition never became true"
            self.step()

    def join(self, *names: str) -> list[Player]:
        """Add players one at a time, so ids follow the order of ``names``."""
        players = []
        for name in names:
            player = self.add(name)
            self.run_until(lambda p=player: p.client.state is not ClientState.JOINING)
            players.append(player)
        return players

    def start(self, *names: str) -> list[Player]:
        players = self.join(*names)
        self.host.start(self.now)
        self.pump()
        self.run_until(lambda: all(p.client.state is ClientState.RUNNING for p in players))
        return players

    def host_events_of(self, kind: type) -> list[Any]:
        return [e for _, e in self.host_events if isinstance(e, kind)]


def events_of(player: Player, kind: type) -> list[Any]:
    return [e for _, e in player.events if isinstance(e, kind)]


def first_time(events: list[tuple[float, Event]], kind: type) -> float:
    return next(t for t, e in events if isinstance(e, kind))


# ============================================================================ turn ordering


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_turns_run_in_order_everywhere_under_loss(seed: int) -> None:
    lab = Lab(seed=seed, loss=0.2, jitter=0.05, command_rate=0.05)
    alice, bob, carol = lab.start("alice", "bob", "carol")
    lab.run_for(8.0)
    lab.command_rate = 0.0
    lab.run_for(3.0)  # let every command and turn drain through

    sent = lab.sent_turns
    assert [t.turn for t in sent] == list(range(len(sent)))
    assert len(sent) >= 100
    for p in (alice, bob, carol):
        numbers = [t.number for t in p.executed]
        assert numbers == list(range(len(numbers)))  # strictly in order, none skipped
        assert len(numbers) >= len(sent) - 30  # kept up, give or take what is in flight
        assert [(t.number, t.commands) for t in p.executed] == [
            (t.turn, t.commands) for t in sent[: len(numbers)]
        ]
    # Every command ran exactly once, for its sender's id, never before its target turn.
    for p in (alice, bob, carol):
        cid = p.client.client_id
        ran = [(t.turn, data) for t in sent for c, data in t.commands if c == cid]
        assert [d for _, d in ran] == [d for _, d in p.sent]
        assert all(number >= target for (number, _), (target, _) in zip(ran, p.sent, strict=True))
    assert lab.host_events_of(DesyncDetected) == []
    assert lab.host.stats.malformed == lab.host.stats.unexpected == 0


def test_lobby_roster_and_start_events() -> None:
    lab = Lab()
    alice, bob = lab.start("alice", "bob")
    assert alice.client.client_id == 0 and bob.client.client_id == 1
    assert dict(alice.client.roster) == dict(bob.client.roster) == {0: "alice", 1: "bob"}
    assert events_of(alice, Joined) == [Joined(0, ((0, "alice"),))]
    assert events_of(alice, ClientJoined) == [ClientJoined(1, "bob")]
    assert events_of(bob, Joined) == [Joined(1, ((0, "alice"), (1, "bob")))]
    assert events_of(alice, GameStarted) == events_of(bob, GameStarted) == [GameStarted(0)]
    assert [type(e) for e in lab.host_events_of(ClientJoined)] == [ClientJoined] * 2


def test_first_turn_comes_one_interval_after_start() -> None:
    lab = Lab(delay=0.0, jitter=0.0)
    lab.start("alice")
    started = lab.now
    lab.run_until(lambda: lab.sent_turns != [])
    assert lab.now == pytest.approx(started + lab.config.turn_interval, abs=lab.dt)


def test_late_command_runs_in_next_unsent_turn() -> None:
    lab = Lab(delay=0.0, jitter=0.0)
    lab.start("alice")
    lab.run_until(lambda: lab.host.next_turn >= 5)
    lab.post("alice", HOST, m.encode(m.Command(1, b"late")))  # turn 1 is long gone
    lab.run_until(lambda: any(t.commands for t in lab.sent_turns))
    turn = next(t for t in lab.sent_turns if t.commands)
    assert turn.turn >= 5 and turn.commands == ((0, b"late"),)
    assert lab.host.stats.late_commands == 1


def test_full_turns_defer_commands_fairly_and_fit_one_message() -> None:
    lab = Lab(delay=0.0, jitter=0.0)
    alice, bob = lab.start("alice", "bob")
    big = [bytes([i]) * lab.config.max_command_size for i in range(10)]
    for data in big:  # alice floods: ten 256-byte commands for the same turn
        alice.client.send_command(data)
    bob.client.send_command(b"bob")
    lab.pump()
    lab.run_until(lambda: sum(len(t.commands) for t in lab.sent_turns) == 11)
    full = [t.commands for t in lab.sent_turns if t.commands]
    assert len(full) >= 3  # 2.5 KiB of commands cannot fit one 1100-byte message
    assert (1, b"bob") in full[0]  # bob is not starved by alice's flood
    assert [d for cmds in full for c, d in cmds if c == 0] == big  # alice's order kept
    assert lab.host.stats.deferred_commands > 0


def test_commands_too_far_ahead_are_refused() -> None:
    lab = Lab(delay=0.0, jitter=0.0)
    lab.start("alice")
    lab.post("alice", HOST, m.encode(m.Command(10_000, b"x")))
    lab.run_for(0.5)
    assert lab.host.stats.refused_commands == 1
    assert all(not t.commands for t in lab.sent_turns)


# ============================================================================ desync


def test_desync_detected_on_first_differing_turn_and_reported_everywhere() -> None:
    lab = Lab(seed=7, loss=0.1, command_rate=0.05)
    alice, bob, carol = lab.start("alice", "bob", "carol")
    carol.corrupt_at = 17
    lab.run_for(6.0)

    expected = {
        "turn": 17,
        "majority": frozenset({0, 1}),
        "diverged": frozenset({2}),
    }
    reported = lab.host_events_of(DesyncDetected)
    assert len(reported) == 1  # later turns differ too, but are not re-reported
    assert {k: getattr(reported[0], k) for k in expected} == expected
    assert lab.host.stats.desynced_turns > 1
    for p in (alice, bob, carol):
        (event,) = events_of(p, DesyncDetected)
        assert event == reported[0]


def test_two_player_desync_blames_nobody_in_particular() -> None:
    lab = Lab()
    _, bob = lab.start("alice", "bob")
    bob.corrupt_at = 3
    lab.run_for(2.0)
    (event,) = lab.host_events_of(DesyncDetected)
    assert (event.turn, event.majority, event.diverged) == (3, frozenset(), frozenset({0, 1}))


def test_desync_still_detected_after_a_player_leaves() -> None:
    lab = Lab()
    _, _, carol, dave = lab.start("alice", "bob", "carol", "dave")
    lab.run_for(1.0)
    dave.client.leave()
    lab.pump()
    lab.run_for(0.5)
    carol.corrupt_at = carol.executed[-1].number + 5
    lab.run_for(2.0)
    (event,) = lab.host_events_of(DesyncDetected)
    assert event.turn == carol.corrupt_at
    assert event.diverged == frozenset({2}) and event.majority == frozenset({0, 1})


# ============================================================================ laggers


def test_lagging_client_flagged_then_dropped_while_others_continue() -> None:
    cfg = LockstepConfig(unresponsive_after=1.0, drop_after=3.0)
    lab = Lab(config=cfg, delay=0.01, jitter=0.0)
    alice, bob, carol = lab.start("alice", "bob", "carol")
    lab.run_for(1.0)
    bob.frozen = True  # its simulation hangs: no more DONETURNs
    frozen_at = lab.now
    lab.run_for(4.0)

    flagged = first_time(lab.host_events, ClientUnresponsive)
    dropped = first_time(lab.host_events, ClientLeft)
    # Stalled from the first turn it did not answer, which is sent within one interval.
    assert frozen_at + 1.0 <= flagged <= frozen_at + 1.0 + cfg.turn_interval + 0.05
    assert flagged + 2.0 - 0.05 <= dropped <= frozen_at + 3.0 + cfg.turn_interval + 0.05
    assert lab.host_events_of(ClientUnresponsive) == [ClientUnresponsive(1)]
    assert lab.host_events_of(ClientLeft) == [ClientLeft(1, LeaveReason.TIMED_OUT)]
    assert "bob" in lab.closed
    for p in (alice, carol, bob):  # everyone, the lagger included, is told
        assert events_of(p, ClientUnresponsive) == [ClientUnresponsive(1)]
        assert events_of(p, ClientLeft) == [ClientLeft(1, LeaveReason.TIMED_OUT)]
    assert bob.client.state is ClientState.ENDED
    assert 1 not in alice.client.roster
    # The others never waited: they kept executing right up to the present.
    for p in (alice, carol):
        assert p.executed[-1].number >= lab.host.next_turn - 2
    assert alice.state == carol.state


def test_lagging_client_recovers_and_everyone_hears_it() -> None:
    cfg = LockstepConfig(unresponsive_after=0.5, drop_after=5.0)
    lab = Lab(config=cfg)
    alice, bob = lab.start("alice", "bob")
    lab.run_for(0.5)
    alice.frozen = True
    lab.run_for(1.0)
    alice.frozen = False
    lab.run_for(0.5)
    for events in (lab.host_events, alice.events, bob.events):
        kinds = [e for _, e in events if isinstance(e, ClientUnresponsive | ClientResponsive)]
        assert kinds == [ClientUnresponsive(0), ClientResponsive(0)]
    assert (
        alice.executed[-1].number == bob.executed[-1].number
        or abs(alice.client.backlog - bob.client.backlog) <= 1
    )
    assert lab.host_events_of(ClientLeft) == []


def test_idle_lobby_flags_nobody() -> None:
    cfg = LockstepConfig(unresponsive_after=0.2, drop_after=0.5)
    lab = Lab(config=cfg)
    alice = lab.add("alice")
    alice.frozen = True
    lab.run_for(3.0)
    assert lab.host.get_timer() is None
    assert lab.host_events_of(ClientUnresponsive) == []


def test_client_notices_silent_host() -> None:
    cfg = LockstepConfig(unresponsive_after=0.5, drop_after=5.0)
    lab = Lab(config=cfg, delay=0.0, jitter=0.0)
    (alice,) = lab.start("alice")
    lab.run_for(0.3)
    lab.host.clock.stop()  # the host machine hangs
    lab.run_for(1.0)
    assert events_of(alice, HostUnresponsive) == [HostUnresponsive()]
    lab.host.clock.start(lab.now)
    lab.run_for(0.3)
    assert events_of(alice, HostResponsive) == [HostResponsive()]


def test_leaving_does_not_stall_the_game() -> None:
    lab = Lab()
    alice, bob = lab.start("alice", "bob")
    lab.run_for(0.5)
    bob.client.leave()
    lab.pump()
    turn_at_leave = lab.host.next_turn
    lab.run_for(1.0)
    assert lab.host_events_of(ClientLeft) == [ClientLeft(1, LeaveReason.LEFT)]
    assert events_of(alice, ClientLeft) == [ClientLeft(1, LeaveReason.LEFT)]
    assert alice.executed[-1].number >= turn_at_leave + 5
    assert "bob" in lab.closed
    with pytest.raises(LocalProtocolError):
        bob.client.leave()


def test_transport_loss_and_kick_remove_clients() -> None:
    lab = Lab()
    lab.start("alice", "bob", "carol")
    lab.host.peer_disconnected("bob", lab.now)
    lab.host.kick(2, lab.now)
    lab.pump()
    lab.run_for(0.5)
    assert lab.host_events_of(ClientLeft) == [
        ClientLeft(1, LeaveReason.DISCONNECTED),
        ClientLeft(2, LeaveReason.KICKED),
    ]
    assert lab.closed == {"carol"}  # a lost transport needs no hang-up
    assert list(lab.host.clients) == [0]
    with pytest.raises(LocalProtocolError):
        lab.host.kick(2, lab.now)
    lab.host.peer_disconnected("nobody", lab.now)  # harmless


# ============================================================================ joining


def test_join_after_start_is_refused_with_game_started() -> None:
    lab = Lab()
    lab.start("alice")
    late = lab.add("late")
    lab.run_for(0.3)
    assert events_of(late, JoinRefused) == [JoinRefused(RefuseReason.GAME_STARTED)]
    assert late.client.state is ClientState.ENDED
    assert lab.host_events_of(JoinRefused) == [JoinRefused(RefuseReason.GAME_STARTED, "late")]
    assert "late" in lab.closed


def test_full_game_refuses_with_too_many_clients() -> None:
    lab = Lab(config=LockstepConfig(max_clients=2))
    a, b, c = lab.join("a", "b", "c")
    assert events_of(c, JoinRefused) == [JoinRefused(RefuseReason.TOO_MANY_CLIENTS)]
    assert [p.client.state for p in (a, b)] == [ClientState.LOBBY] * 2


def test_version_mismatch_is_refused() -> None:
    lab = Lab(config=LockstepConfig(game_version="1.2"))
    old = lab.add("old", config=LockstepConfig(game_version="1.1"))
    lab.run_for(0.3)
    assert events_of(old, JoinRefused) == [JoinRefused(RefuseReason.WRONG_VERSION)]


def test_host_adopts_pacing_on_clients() -> None:
    lab = Lab(config=LockstepConfig(turn_interval=0.05, input_delay=4))
    alice = lab.add("alice", config=LockstepConfig())
    lab.run_for(0.2)
    assert (alice.client.turn_interval, alice.client.input_delay) == (0.05, 4)


# ============================================================================ clock


def test_clock_ticks_on_a_fixed_grid() -> None:
    clock = TurnClock(0.1, max_catchup=5)
    clock.start(10.0)
    assert clock.advance(10.05) == (0, 0)
    assert clock.deadline == pytest.approx(10.1)
    assert clock.advance(10.25) == (2, 0)
    assert clock.deadline == pytest.approx(10.3)  # no drift from late polling


def test_clock_catches_up_at_most_max_catchup_and_drops_the_rest() -> None:
    clock = TurnClock(0.1, max_catchup=3)
    clock.start(0.0)
    assert clock.advance(5.0) == (3, 47)
    assert (clock.ticks, clock.dropped) == (3, 47)
    # The backlog is gone: the next tick is one interval later, not a burst.
    assert clock.advance(5.0) == (0, 0)
    assert clock.deadline == pytest.approx(5.1)
    deadline = clock.deadline
    assert deadline is not None and clock.advance(deadline) == (1, 0)


def test_clock_ignores_time_going_backwards_and_stopped_state() -> None:
    clock = TurnClock(0.1)
    assert clock.advance(1.0) == (0, 0) and clock.deadline is None
    clock.start(1.0)
    assert clock.advance(0.5) == (0, 0)
    with pytest.raises(ValueError):
        TurnClock(0.0)
    with pytest.raises(ValueError):
        TurnClock(0.1, max_catchup=0)


@given(
    interval=st.floats(0.001, 2.0),
    origin=st.floats(0.0, 1e6),
    polls=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=20),
)
@settings(max_examples=200, deadline=None)
def test_clock_waking_at_deadline_always_ticks(
    interval: float, origin: float, polls: list[float]
) -> None:
    clock = TurnClock(interval, max_catchup=4)
    clock.start(origin)
    now = origin
    for gap in polls:
        now += gap
        ticks, dropped = clock.advance(now)
        assert 0 <= ticks <= 4 and dropped >= 0
        deadline = clock.deadline
        assert deadline is not None and deadline > now
        assert clock.advance(deadline).ticks == 1  # exactly at the deadline: one tick
        now = deadline


def test_host_clock_bound_sends_at_most_max_catchup_turns() -> None:
    cfg = LockstepConfig(max_catchup=4, turn_interval=0.1)
    host = LockstepHost[str](config=cfg)
    host.receive("a", m.encode(m.Join(PROTOCOL_VERSION, "", "a")), 0.0)
    host.start(0.0)
    host.messages_to_send()
    host.handle_timer(3.0)  # a 3-second hitch: 30 turns were due
    turns = [msg for _, msg in host.messages_to_send() if msg[1] == m.MsgType.NETTURN]
    assert len(turns) == 4 and host.next_turn == 4
    events = []
    while (e := host.next_event()) is not None:
        events.append(e)
    assert TimeDropped(26) in events and host.stats.dropped_turns == 26


# ============================================================================ robustness


ALL_MESSAGES: list[m.Message] = [
    m.Join(1, "1.0", "alice"),
    m.Welcome(3, 0.1, 2, ((0, "a"), (3, "b"))),
    m.Refused(RefuseReason.TOO_MANY_CLIENTS),
    m.Joined(4, "bob"),
    m.Left(4, LeaveReason.TIMED_OUT),
    m.Start(0),
    m.Command(12, b"move 3 4"),
    m.NetTurn(12, ((0, b"a"), (1, b""))),
    m.DoneTurn(12, 2**64 - 1),
    m.StatusChanged(1, m.ClientStatus.UNRESPONSIVE),
    m.Desync(9, ((0, 1), (1, 2))),
    m.Leave(),
]
CFG = LockstepConfig()


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda x: type(x).__name__)
def test_message_roundtrip_and_truncation(msg: m.Message) -> None:
    data = m.encode(msg)
    assert m.decode(data, CFG) == msg
    for cut in range(len(data)):
        with pytest.raises(m.MalformedMessage):
            m.decode(data[:cut], CFG)
    with pytest.raises(m.MalformedMessage):
        m.decode(data + b"\x00", CFG)


@pytest.mark.parametrize(
    "fields",
    [
        [],
        [99],
        [True, 1, "", ""],  # bool is not a type code
        [m.MsgType.DONETURN, True, 5],  # bool is not a turn
        [m.MsgType.DONETURN, -1, 5],
        [m.MsgType.DONETURN, 1, -5],
        [m.MsgType.COMMAND, 1, "text, not bytes"],
        [m.MsgType.COMMAND, 1, b"x" * (CFG.max_command_size + 1)],
        [m.MsgType.NETTURN, 1, [[0, b"a", 1]]],
        [m.MsgType.NETTURN, 1, [[200, b"a"]]],
        [m.MsgType.WELCOME, 0, float("nan"), 2, []],
        [m.MsgType.WELCOME, 0, 0.1, 2, [[1, "a"], [1, "b"]]],
        [m.MsgType.LEFT, 1, 77],
        [m.MsgType.JOIN, 1, "", "n" * 33],
        [m.MsgType.LEAVE, 1],
    ],
)
def test_invalid_fields_are_malformed(fields: list[Any]) -> None:
    with pytest.raises(m.MalformedMessage):
        m.decode(msgpack.packb(fields), CFG)


def test_oversized_message_dropped_unparsed() -> None:
    host = LockstepHost[str]()
    host.receive("x", b"\x90" * (host.config.max_message_size + 1), 0.0)
    assert host.stats.malformed == 1


@given(st.lists(st.binary(max_size=40), max_size=10))
@settings(max_examples=200, deadline=None)
def test_garbage_never_raises(datagrams: list[bytes]) -> None:
    host, client = running_lockstep_pair()
    for data in datagrams:
        host.receive("a", data, 1.0)
        host.receive("stranger", data, 1.0)
        client.receive(data, 1.0)
    total = host.stats.malformed + host.stats.unexpected
    assert total + host.stats.refused_commands + host.stats.late_commands + len(
        host.clients
    ) >= len(datagrams)


@given(st.sampled_from(ALL_MESSAGES), st.integers(0, 40))
@settings(max_examples=100, deadline=None)
def test_valid_messages_in_the_wrong_place_never_raise(msg: m.Message, split: int) -> None:
    host, client = running_lockstep_pair()
    data = m.encode(msg)
    for part in (data[:split], data[split:], data):
        host.receive("a", part, 1.0)
        host.receive("stranger", part, 1.0)
        client.receive(part, 1.0)


def test_out_of_order_doneturn_and_netturn_are_counted() -> None:
    host, client = running_lockstep_pair()
    host.receive("a", m.encode(m.DoneTurn(0, 1)), 0.0)  # turn 0 not sent yet
    assert host.stats.unexpected == 1
    client.receive(m.encode(m.NetTurn(5, ())), 0.0)  # gap: 0..4 missing
    assert client.stats.unexpected == 1 and client.next_turn() is None


# ============================================================================ misuse


def test_misuse_raises_local_protocol_error() -> None:
    client = LockstepClient(name="a")
    with pytest.raises(LocalProtocolError):
        client.send_command(b"x")  # not running
    with pytest.raises(LocalProtocolError):
        client.complete_turn(0, 1)  # no such turn
    with pytest.raises(LocalProtocolError):
        LockstepClient(name="n" * 40)
    host, running = running_lockstep_pair()
    with pytest.raises(LocalProtocolError):
        host.start(1.0)
    with pytest.raises(LocalProtocolError):
        running.send_command(b"x" * 10_000)
    host.handle_timer(0.1)
    for _, data in host.messages_to_send():
        running.receive(data, 0.1)
    turn = running.next_turn()
    assert turn is not None and running.next_turn() == turn  # peeking is idempotent
    with pytest.raises(LocalProtocolError):
        running.complete_turn(turn.number, -1)
    with pytest.raises(LocalProtocolError):
        running.complete_turn(turn.number + 1, 0)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        LockstepConfig(turn_interval=0)
    with pytest.raises(ValueError):
        LockstepConfig(unresponsive_after=5, drop_after=1)
    with pytest.raises(ValueError):
        LockstepConfig(max_clients=0)
    with pytest.raises(ValueError):  # a 64-player roster cannot fit one 1100-byte message
        LockstepConfig(max_clients=64)
    assert LockstepConfig(max_clients=64, max_message_size=4000).max_clients == 64
    with pytest.raises(ValueError):
        LockstepConfig(max_command_size=2000)
    with pytest.raises(TypeError):
        LockstepConfig(0.1)  # type: ignore[call-arg]


# ============================================================================ over real rudp


async def test_asyncio_adapter_over_loopback_rudp() -> None:
    """Two clients and a host over real rudp sockets on 127.0.0.1, bounded by a timeout."""
    from rudp.lockstep.aio import LockstepServer, LockstepSession

    cfg = LockstepConfig(turn_interval=0.02)
    server = await LockstepServer.serve("127.0.0.1", 0, config=cfg)
    sessions: list[LockstepSession] = []
    try:

        async def play(session: LockstepSession, turns: int) -> list[tuple[int, int]]:
            state, done = 0, []
            session.send_command(b"hello")
            async for event in session.events():
                if isinstance(event, DesyncDetected):
                    raise AssertionError(event)
                while (turn := session.next_turn()) is not None:
                    state = sim_step(state, turn.number, turn.commands)
                    session.complete_turn(turn.number, state)
                    done.append((turn.number, state))
                if len(done) >= turns:
                    return done
            raise AssertionError("connection ended early")

        async def joined(n: int) -> None:
            count = 0
            async for event in server.events():
                count += isinstance(event, ClientJoined)
                if count == n:
                    return

        async def started(session: LockstepSession) -> None:
            async for event in session.events():
                if isinstance(event, GameStarted):
                    return

        async def scenario() -> None:
            host, port = server.address
            for name in ("alice", "bob"):
                sessions.append(await LockstepSession.connect(host, port, name=name, config=cfg))
            await joined(2)
            server.start()
            await asyncio.gather(*(started(s) for s in sessions))
            results = await asyncio.gather(*(play(s, 20) for s in sessions))
            assert results[0][:20] == results[1][:20]
            await sessions[1].leave()
            async for event in server.events():
                if isinstance(event, ClientLeft):
                    assert event == ClientLeft(1, LeaveReason.LEFT)
                    break

        await asyncio.wait_for(scenario(), timeout=10.0)
    finally:
        for session in sessions:
            await session.close()
        await server.close()


def test_lobby_reuses_ids_so_join_and_leave_cannot_lock_it() -> None:
    host: LockstepHost[object] = LockstepHost()
    for i in range(MAX_CLIENTS_LIMIT):  # far more joins in total than ids exist
        host.receive(("churn", i), m.encode(m.Join(PROTOCOL_VERSION, "", "x")), 0.0)
        host.receive(("churn", i), m.encode(m.Leave()), 0.0)
    host.messages_to_send()
    host.receive("real", m.encode(m.Join(PROTOCOL_VERSION, "", "alice")), 0.0)
    assert len(host.clients) == 1
    replies = [m.decode(data, host.config) for _, data in host.messages_to_send()]
    assert not any(isinstance(r, m.Refused) for r in replies)


def test_a_client_that_acks_slowly_is_dropped_by_its_lag() -> None:
    """Acking one turn every 1.9 s is progress, but it falls ever further behind and
    holds back the other clients' desync detection: its lag must end it."""
    cfg = LockstepConfig()
    host: LockstepHost[str] = LockstepHost(config=cfg)
    for peer in ("a", "b"):
        host.receive(peer, m.encode(m.Join(PROTOCOL_VERSION, "", peer)), 0.0)
    host.start(0.0)
    t, acked, next_slow = 0.0, {"a": -1, "b": -1}, 1.9
    while t < 120 and "b" in {c.peer for c in host.clients.values()}:
        t = round(t + 0.1, 6)
        host.handle_timer(t)
        while acked["a"] + 1 < host.next_turn:
            acked["a"] += 1
            host.receive("a", m.encode(m.DoneTurn(acked["a"], 1)), t)
        if t >= next_slow:
            acked["b"] += 1
            host.receive("b", m.encode(m.DoneTurn(acked["b"], 1)), t)
            next_slow += 1.9
        host.messages_to_send()
    assert [c.peer for c in host.clients.values()] == ["a"]
    assert t <= cfg.drop_after + 2.0
    assert len(host._reports) < 10  # the turns it held back were settled


def test_kick_takes_an_int_client_id_only() -> None:
    host: LockstepHost[str] = LockstepHost()
    for peer in ("a", "b"):
        host.receive(peer, m.encode(m.Join(PROTOCOL_VERSION, "", peer)), 0.0)
    host.start(0.0)
    host.messages_to_send()
    for bad in (True, 1.0):
        with pytest.raises(TypeError):
            host.kick(bad, 0.0)  # type: ignore[arg-type]
    assert sorted(host.clients) == [0, 1] and host.messages_to_send() == []
    host.kick(1, 0.0)
    assert sorted(host.clients) == [0]


def test_complete_turn_takes_an_int_turn_number_only() -> None:
    from fractions import Fraction

    host, running = running_lockstep_pair()
    host.handle_timer(0.1)
    for _, data in host.messages_to_send():
        running.receive(data, 0.1)
    running.messages_to_send()
    turn = running.next_turn()
    assert turn is not None and turn.number == 0
    for bad in (False, 0.0, Fraction(0)):
        with pytest.raises(TypeError):
            running.complete_turn(bad, 1)  # type: ignore[arg-type]
        assert running.next_turn() == turn and running.messages_to_send() == []
    running.complete_turn(0, 1)
    assert [m.decode(d, running.config) for d in running.messages_to_send()] == [m.DoneTurn(0, 1)]


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_catchup", 2.5, TypeError),
        ("input_delay", 1.5, TypeError),
        ("input_delay", 2.0, TypeError),
        ("max_command_size", 200.5, TypeError),
        ("max_clients", True, TypeError),
        ("max_message_size", 1100.0, TypeError),
        ("max_backlog", "1000", TypeError),
        ("turn_interval", True, TypeError),
        ("drop_after", "10", TypeError),
        ("game_version", 5, TypeError),
        ("game_version", b"1.0", TypeError),
        ("game_version", "v" * 65, ValueError),
        ("game_version", "é" * 33, ValueError),  # 66 UTF-8 bytes
    ],
)
def test_config_refuses_wrong_types_at_construction(field: str, value: Any, error: type) -> None:
    with pytest.raises(error):
        LockstepConfig(**{field: value})


def test_longest_game_version_still_joins() -> None:
    cfg = LockstepConfig(game_version="é" * 32)  # 64 UTF-8 bytes: the most JOIN carries
    assert LockstepConfig(turn_interval=1, drop_after=10).turn_interval == 1
    lab = Lab(config=cfg)
    (alice,) = lab.join("alice")
    assert alice.client.state is ClientState.LOBBY and len(lab.host.clients) == 1


@pytest.mark.parametrize(
    ("now", "error"),
    [(math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError), ("0", TypeError)],
)
def test_start_refuses_a_time_that_is_not_a_finite_number(now: Any, error: type) -> None:
    host: LockstepHost[str] = LockstepHost()
    host.receive("a", m.encode(m.Join(PROTOCOL_VERSION, "", "a")), 0.0)
    host.messages_to_send()
    with pytest.raises(error):
        host.start(now)
    assert host.state is HostState.LOBBY and host.messages_to_send() == []
    host.start(0.0)  # still in the lobby: a valid start works
    host.handle_timer(0.1)
    assert host.next_turn == 1


def test_send_command_takes_bytes_like_data_measured_in_bytes() -> None:
    import array

    _, running = running_lockstep_pair()
    running.messages_to_send()
    size = running.max_command_size
    doubles = memoryview(array.array("d", [0.0] * size))  # size items, 8 * size bytes
    with pytest.raises(LocalProtocolError):
        running.send_command(doubles)
    for bad in ([1, 2, 3], 3, "abc"):
        with pytest.raises(TypeError):
            running.send_command(bad)  # type: ignore[arg-type]
    assert running.messages_to_send() == []
    fits = memoryview(array.array("d", [1.0] * (size // 8)))
    running.send_command(fits)
    running.send_command(bytearray(b"ab"))
    sent = [m.decode(d, running.config) for d in running.messages_to_send()]
    assert [c.data for c in sent if isinstance(c, m.Command)] == [fits.tobytes(), b"ab"]


@pytest.mark.parametrize("how", ["kick", "leave", "disconnect", "time_out"])
def test_a_removed_players_queued_commands_are_not_sent(how: str) -> None:
    lab = Lab(delay=0.0, jitter=0.0, config=LockstepConfig(unresponsive_after=0.2, drop_after=0.5))
    alice, bob = lab.start("alice", "bob")
    for i in range(100):  # 20 turns' worth: most are deferred, some past bob's removal
        bob.client.send_command(bytes([i]) * 200)
    lab.pump()
    lab.run_until(lambda: any(c == 1 for t in lab.sent_turns for c, _ in t.commands))
    assert lab.host.stats.deferred_commands > 0
    if how == "kick":
        lab.host.kick(1, lab.now)
    elif how == "leave":
        lab.host.receive("bob", m.encode(m.Leave()), lab.now)
    elif how == "disconnect":
        lab.host.peer_disconnected("bob", lab.now)
    else:
        bob.frozen = True
        lab.run_until(lambda: 1 not in lab.host.clients, limit=30)
    lab.pump()
    assert 1 not in lab.host.clients
    removed_after = lab.host.next_turn
    lab.run_for(2.0)
    later = [t for t in lab.sent_turns if t.turn >= removed_after]
    assert later and not any(c == 1 for t in later for c, _ in t.commands)


def test_a_flood_of_full_size_commands_cannot_starve_another_player() -> None:
    """Each of alice's commands fills a whole NETTURN and she keeps her queue full;
    bob's small command still goes out within as many turns as there are players."""
    cfg = LockstepConfig(max_command_size=1078, max_message_size=1100)
    lab = Lab(delay=0.0, jitter=0.0, config=cfg)
    alice, bob = lab.start("alice", "bob")
    for _ in range(10):
        alice.client.send_command(b"F" * 1078)
    target = bob.client.send_command(b"honest")
    lab.pump()
    for _ in range(30):
        sent = lab.host.next_turn
        lab.run_until(lambda s=sent: lab.host.next_turn > s)
        alice.client.send_command(b"F" * 1078)  # keep the flood going
        lab.pump()
    carried = [t.turn for t in lab.sent_turns if (1, b"honest") in t.commands]
    assert carried and carried[0] < target + len(lab.players)
    assert all(len(m.encode(t)) <= cfg.max_message_size for t in lab.sent_turns)


def test_turns_of_commands_over_64_kib_fit_the_message_size() -> None:
    # A command of 65,536 bytes or more has a 5-byte bin header, not 3: a NETTURN
    # packed "to fit" came out a byte over max_message_size, and every client ended
    # with MALFORMED_MESSAGE.
    size, count = 65536, 13
    config = LockstepConfig(
        max_command_size=size,
        max_message_size=count * (size + 6) + 16,
        max_pending_commands=count,
    )
    host: LockstepHost[str] = LockstepHost(config=config)
    client = LockstepClient(name="p0", config=config)

    def pump(now: float) -> None:
        for _ in range(20):
            moved = False
            for data in client.messages_to_send():
                host.receive("p0", data, now)
                moved = True
            for _peer, data in host.messages_to_send():
                assert len(data) <= config.max_message_size
                client.receive(data, now)
                moved = True
            if not moved:
                return

    pump(0.0)
    host.start(0.0)
    pump(0.0)
    for _ in range(count):
        client.send_command(b"x" * size)
    pump(0.0)
    for tick in range(1, 40):
        host.handle_timer(tick * config.turn_interval)
        pump(tick * config.turn_interval)
    assert client.fault is None and host.stats.deferred_commands > 0
