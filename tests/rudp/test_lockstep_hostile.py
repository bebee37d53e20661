"""Lockstep against hostile peers: inputs crafted to raise, to grow memory or to desynchronise.

Everything here is sans-IO on a stepped clock, or over loopback rudp; counters and
sizes are asserted, never wall-clock times.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator

import msgpack
import pytest

from rudp.errors import LocalProtocolError
from rudp.lockstep import (
    PROTOCOL_VERSION,
    ClientJoined,
    ClientLeft,
    ClientState,
    FaultReason,
    HostFaulted,
    HostUnresponsive,
    JoinRefused,
    LockstepClient,
    LockstepConfig,
    LockstepHost,
    TurnsExhausted,
)
from rudp.lockstep import messages as m
from rudp.lockstep.config import MAX_TURN, backlog_allowance

CFG = LockstepConfig()

#: 1,000 nested one-element arrays in 1,001 bytes: msgpack accepts about 1,024 levels.
DEEP_TYPE = b"\x91" * 1000 + b"\x01"
#: A JOIN whose ``protocol`` field is 999 arrays deep.
DEEP_JOIN = b"\x94\x01" + b"\x91" * 999 + b"\x01" + b"\xa0\xa1x"


# ============================================================================ decoding


@pytest.mark.parametrize("data", [DEEP_TYPE, DEEP_JOIN], ids=["type", "join-protocol"])
def test_deep_nesting_is_malformed_not_an_exception(data: bytes) -> None:
    with pytest.raises(m.MalformedMessage):
        m.decode(data, CFG)
    host = LockstepHost[str]()
    host.receive("x", data, 0.0)
    assert host.stats.malformed == 1
    client = LockstepClient(name="a")
    client.receive(data, 0.0)
    assert client.stats.malformed == 1


@pytest.mark.parametrize(
    "fields",
    [
        [m.MsgType.JOIN, {"a": 1}, "", ""],  # maps never appear in lockstep messages
        [m.MsgType.COMMAND, 1, msgpack.ExtType(1, b"x")],
        [m.MsgType.DONETURN, [[[[[1]]]]], 5],
        [m.MsgType.LEFT, 1, [[[[1]]]]],
    ],
)
def test_values_of_the_wrong_shape_are_malformed(fields: list[object]) -> None:
    with pytest.raises(m.MalformedMessage) as info:
        m.decode(msgpack.packb(fields), CFG)
    assert "[" not in str(info.value)  # the peer's values are never echoed


def test_undecodable_msgpack_is_malformed() -> None:
    for data in (b"\xc1", b"\xdd\xff\xff\xff\xff", b"\xc7\x01\xff"):
        with pytest.raises(m.MalformedMessage):
            m.decode(data, CFG)


def _started_client(config: LockstepConfig = CFG) -> LockstepClient:
    client = LockstepClient(name="v", config=config)
    client.messages_to_send()
    client.receive(m.encode(m.Welcome(0, 0.1, 2, ((0, "v"),))), 0.0)
    client.receive(m.encode(m.Start(0)), 0.0)
    assert client.state is ClientState.RUNNING
    return client


def _events(client: LockstepClient) -> list[object]:
    out = []
    while (event := client.next_event()) is not None:
        out.append(event)
    return out


# ============================================================================ turn backlog


def test_a_host_flooding_turns_ends_the_client_at_max_backlog() -> None:
    client = _started_client(LockstepConfig(max_backlog=50))
    # The host's default pacing (0.1 s, drop_after 10 s, max_catchup 5) needs more.
    assert client.max_backlog == backlog_allowance(0.1, 10.0, 5) == 111
    dense = tuple((i % 128, b"") for i in range(200))
    for turn in range(500):
        client.receive(m.encode(m.NetTurn(turn, dense)), 0.0)
        assert client.backlog <= 111
    assert client.state is ClientState.ENDED
    assert client.fault is FaultReason.BACKLOG_FULL
    assert HostFaulted(FaultReason.BACKLOG_FULL) in _events(client)
    assert client.backlog == 0  # what it held is released
    assert client.messages_to_send()[-1] == m.encode(m.Leave())
    assert client.stats.unexpected == 500 - 112  # everything after the fault


def _stalled_game(
    host_cfg: LockstepConfig,
    client_cfg: LockstepConfig,
    *,
    stall_until: float,
    end: float,
    steps: list[float] | None = None,
) -> tuple[LockstepHost[str], LockstepClient, list[object], int]:
    """A host and a client on a stepped clock; the client runs no turn before
    ``stall_until``. Returns the client's events (turn events left out) and its
    largest backlog."""
    host = LockstepHost[str](config=host_cfg)
    client = LockstepClient(name="p", config=client_cfg)
    now, events, peak = 0.0, [], 0
    step_iter = iter(steps or [])

    def pump() -> None:
        for data in client.messages_to_send():
            host.receive("p", data, now)
        for _, data in host.messages_to_send():
            client.receive(data, now)

    pump()
    host.start(now)
    pump()
    while now < end and client.state is not ClientState.ENDED:
        now = round(now + next(step_iter, 0.01), 6)
        timer = host.get_timer()
        if timer is not None and timer <= now:
            host.handle_timer(now)
        pump()
        peak = max(peak, client.backlog)
        if now >= stall_until:
            while (turn := client.next_turn()) is not None:
                client.complete_turn(turn.number, 0)
            pump()
        while (event := client.next_event()) is not None:
            if type(event).__name__ not in ("TurnsReady", "HostUnresponsive", "HostResponsive"):
                events.append(event)
    return host, client, events, peak


def test_an_honest_host_keeping_a_long_stall_is_not_a_backlog_fault() -> None:
    """50 turns/s and drop_after 30 s: a 25 s stall is 1,250 turns, more than the
    default max_backlog, and the host accepts it; so must the client."""
    host_cfg = LockstepConfig(turn_interval=0.02, drop_after=30.0)
    host, client, events, peak = _stalled_game(
        host_cfg, LockstepConfig(), stall_until=25.0, end=27.0
    )
    assert client.max_backlog == backlog_allowance(0.02, 30.0, 5) == 1511
    assert peak > LockstepConfig().max_backlog
    assert client.fault is None and client.state is ClientState.RUNNING
    assert not any(isinstance(e, (HostFaulted, ClientLeft)) for e in events)
    assert list(host.clients) == [client.client_id]


def test_a_client_stalled_for_good_is_dropped_by_the_host_not_faulted() -> None:
    """100 turns/s, drop_after 10 s: the host's own TIMED_OUT comes first."""
    host_cfg = LockstepConfig(turn_interval=0.01)
    host, client, events, _ = _stalled_game(
        host_cfg, LockstepConfig(), stall_until=math.inf, end=20.0
    )
    assert client.fault is None and client.state is ClientState.ENDED
    assert events[-1] == ClientLeft(0, m.LeaveReason.TIMED_OUT)
    assert not any(isinstance(e, HostFaulted) for e in events)
    assert host.clients == {}


@pytest.mark.parametrize("seed", range(8))
def test_a_late_polled_host_stays_within_its_stated_backlog(seed: int) -> None:
    """A host woken late sends catch-up bursts; still it drops a stalled client
    before sending more than backlog_allowance(), so the client's limit (max_backlog
    1: the allowance alone) never fires."""
    rng = random.Random(seed)
    steps = [rng.choice((0.001, 0.004, 0.01, 0.013, 0.03, 0.049, 0.07)) for _ in range(5000)]
    host_cfg = LockstepConfig(turn_interval=0.01, unresponsive_after=0.2, drop_after=0.5)
    _, client, events, peak = _stalled_game(
        host_cfg, LockstepConfig(max_backlog=1), stall_until=math.inf, end=5.0, steps=steps
    )
    assert client.max_backlog == backlog_allowance(0.01, 0.5, 5) == 61
    assert client.fault is None, (peak, events)
    assert events[-1] == ClientLeft(0, m.LeaveReason.TIMED_OUT)
    assert 30 <= peak <= 61


def test_the_backlog_allowance_covers_a_burst_at_each_end_of_the_stall() -> None:
    """The oldest owed turn leaves in a catch-up burst, and the tick that drops the
    client comes late and sends one more: the worst an honest host does."""
    steps = [0.05] + [0.01] * 49 + [0.005, 0.055]  # 0.05, 0.06 ... 0.54, 0.545, 0.6
    host_cfg = LockstepConfig(turn_interval=0.01, unresponsive_after=0.2, drop_after=0.5)
    _, client, events, peak = _stalled_game(
        host_cfg, LockstepConfig(max_backlog=1), stall_until=math.inf, end=1.0, steps=steps
    )
    assert peak == 5 + 49 + 5 <= client.max_backlog
    assert client.fault is None and events[-1] == ClientLeft(0, m.LeaveReason.TIMED_OUT)


def test_a_hostile_host_stating_a_huge_drop_after_is_capped() -> None:
    client = LockstepClient(name="v", config=LockstepConfig(max_backlog_seconds=2.0))
    welcome = m.Welcome(0, 0.001, 2, ((0, "v"),), 256, 1100, math.inf, 1000)
    client.receive(m.encode(welcome), 0.0)
    client.receive(m.encode(m.Start(0)), 0.0)
    limit = backlog_allowance(0.001, 2.0, 1000)
    assert client.max_backlog == limit == 4001
    for turn in range(limit + 10):
        client.receive(m.encode(m.NetTurn(turn, ())), 0.0)
    assert client.fault is FaultReason.BACKLOG_FULL
    assert client.stats.unexpected == 10 - 1
    with pytest.raises(ValueError):
        LockstepConfig(max_backlog_seconds=math.nan)
    with pytest.raises(ValueError):
        LockstepConfig(max_catchup=1001)


@pytest.mark.parametrize(
    "fields",
    [
        [0, 0.0005, 2, [], 256, 1100, 10.0, 5],  # faster than any config allows
        [0, 0.1, 2, [], 256, 1100, 0.0, 5],
        [0, 0.1, 2, [], 256, 1100, -1.0, 5],
        [0, 0.1, 2, [], 256, 1100, math.nan, 5],
        [0, 0.1, 2, [], 256, 1100, 10, 5],  # an int, not a float
        [0, 0.1, 2, [], 256, 1100, 10.0, 0],
        [0, 0.1, 2, [], 256, 1100, 10.0, 1001],
        [0, 0.1, 2, [], 256, 1100],  # without drop_after and max_catchup
    ],
)
def test_welcome_pacing_fields_are_validated(fields: list[object]) -> None:
    with pytest.raises(m.MalformedMessage):
        m.decode(msgpack.packb([m.MsgType.WELCOME, *fields]), CFG)


def test_a_client_running_its_turns_never_hits_max_backlog() -> None:
    client = _started_client(LockstepConfig(max_backlog=3))
    for turn in range(100):
        client.receive(m.encode(m.NetTurn(turn, ())), 0.0)
        if turn % 3 == 2:
            while (t := client.next_turn()) is not None:
                client.complete_turn(t.number, 1)
    assert client.state is ClientState.RUNNING and client.fault is None


def test_default_max_backlog_is_bounded() -> None:
    client = _started_client()
    for turn in range(CFG.max_backlog + 10):
        client.receive(m.encode(m.NetTurn(turn, ())), 0.0)
    assert client.fault is FaultReason.BACKLOG_FULL and CFG.max_backlog == 1000
    with pytest.raises(ValueError):
        LockstepConfig(max_backlog=0)


# ============================================================================ limits and faults


def _lobby(host: LockstepHost[str], clients: dict[str, LockstepClient]) -> None:
    for _ in range(5):
        for peer, client in clients.items():
            for data in client.messages_to_send():
                host.receive(peer, data, 0.0)
        for peer, data in host.messages_to_send():
            clients[peer].receive(data, 0.0)


def test_welcome_carries_the_host_limits_and_a_stricter_client_refuses() -> None:
    host = LockstepHost[str](config=LockstepConfig(max_command_size=512))
    client = LockstepClient(name="a")  # 256-byte commands: could not decode a 300-byte one
    _lobby(host, {"a": client})
    assert client.state is ClientState.ENDED
    assert client.fault is FaultReason.LIMITS_MISMATCH
    assert HostFaulted(FaultReason.LIMITS_MISMATCH) in _events(client)
    assert host.clients == {}  # its LEAVE reached the host


def test_the_host_welcome_states_its_drop_pacing() -> None:
    cfg = LockstepConfig(turn_interval=0.02, drop_after=30.0, max_catchup=7)
    host = LockstepHost[str](config=cfg)
    client = LockstepClient(name="a")
    client_data = client.messages_to_send()
    host.receive("a", client_data[0], 0.0)
    [(_, data)] = host.messages_to_send()
    welcome = m.decode(data, CFG)
    assert isinstance(welcome, m.Welcome)
    assert (welcome.turn_interval, welcome.drop_after, welcome.max_catchup) == (0.02, 30.0, 7)


def test_a_client_adopts_smaller_host_limits() -> None:
    host = LockstepHost[str](config=LockstepConfig(max_command_size=128))
    client = LockstepClient(name="a")
    _lobby(host, {"a": client})
    host.start(0.0)
    _lobby(host, {"a": client})
    assert client.state is ClientState.RUNNING and client.max_command_size == 128
    with pytest.raises(LocalProtocolError):
        client.send_command(b"x" * 200)  # the host would have dropped it as malformed
    client.send_command(b"x" * 128)


def test_welcome_roundtrip_carries_limits() -> None:
    welcome = m.Welcome(1, 0.05, 3, ((1, "a"),), 100, 900, 7.5, 9)
    assert m.decode(m.encode(welcome), CFG) == welcome
    never_drops = m.Welcome(1, 0.05, 3, ((1, "a"),), 100, 900, math.inf, 9)
    assert m.decode(m.encode(never_drops), CFG) == never_drops
    old_layout = msgpack.packb([m.MsgType.WELCOME, 1, 0.05, 3, [[1, "a"]]])
    with pytest.raises(m.MalformedMessage):
        m.decode(old_layout, CFG)
    assert PROTOCOL_VERSION == 2


def test_a_malformed_message_from_the_host_ends_the_client_with_a_reason() -> None:
    client = _started_client()
    too_big = m.encode(m.NetTurn(0, ((1, b"x" * (CFG.max_command_size + 1)),)))
    client.receive(too_big, 0.0)
    assert client.stats.malformed == 1
    assert client.fault is FaultReason.MALFORMED_MESSAGE
    assert HostFaulted(FaultReason.MALFORMED_MESSAGE) in _events(client)
    assert client.get_timer() is None  # no HostUnresponsive blaming a host that is fine


async def test_session_hangs_up_on_a_faulty_host_and_events_end() -> None:
    """A hostile host over loopback rudp: the session ends with a named event, close() is quiet."""
    import rudp
    from rudp.lockstep.aio import LockstepSession

    async def evil_host(conn: rudp.Connection) -> None:
        await conn.recv()  # the JOIN
        conn.send(b"\x00", channel=1)  # another channel: ignored, counted
        conn.send(DEEP_TYPE)
        await asyncio.sleep(5)

    server = await rudp.serve(evil_host, "127.0.0.1", 0)
    session = await LockstepSession.connect("127.0.0.1", server.address[1], name="victim")
    try:
        seen = [event async for event in _bounded(session.events())]
        assert seen == [HostFaulted(FaultReason.MALFORMED_MESSAGE)]
        assert session.client.stats.malformed == 1 and session.client.stats.ignored == 1
    finally:
        await session.close()
        server.close()


async def _bounded(events: AsyncIterator[object]) -> AsyncIterator[object]:
    async with asyncio.timeout(10):
        async for event in events:
            yield event


# ============================================================================ hanging up


def _host_events(host: LockstepHost[str]) -> list[object]:
    out = []
    while (event := host.next_event()) is not None:
        out.append(event)
    return out


def test_join_leave_churn_on_one_connection_is_admitted_once() -> None:
    host = LockstepHost[str]()
    join = m.encode(m.Join(PROTOCOL_VERSION, "", "x" * 32))
    for _ in range(300):  # pipelined: all arrive before the host's close completes
        host.receive("bad", join, 0.0)
        host.receive("bad", m.encode(m.Leave()), 0.0)
    events = _host_events(host)
    assert sum(isinstance(e, ClientJoined) for e in events) == 1
    assert sum(isinstance(e, ClientLeft) for e in events) == 1
    assert host.peers_to_close() == ["bad"]
    assert host.stats.unexpected == 598 and host.clients == {}


def test_a_refused_burst_gets_one_answer_and_one_close() -> None:
    host = LockstepHost[str]()
    join = m.encode(m.Join(PROTOCOL_VERSION, "other-version", "x"))
    for _ in range(2000):
        host.receive("bad", join, 0.0)
    sent = host.messages_to_send()
    assert sent == [("bad", m.encode(m.Refused(m.RefuseReason.WRONG_VERSION)))]
    assert sum(isinstance(e, JoinRefused) for e in _host_events(host)) == 1
    assert host.peers_to_close() == ["bad"] and host.stats.unexpected == 1999


def test_a_kicked_peer_cannot_rejoin_until_its_connection_ends() -> None:
    host = LockstepHost[str]()
    join = m.encode(m.Join(PROTOCOL_VERSION, "", "mallory"))
    host.receive("bad", join, 0.0)
    [client_id] = host.clients
    host.kick(client_id, 0.0)
    host.receive("bad", join, 0.0)
    assert host.clients == {} and host.stats.unexpected == 1
    assert host.peers_to_close() == ["bad"]
    host.peer_disconnected("bad", 1.0)  # the close completed; the id may be reused
    host.receive("bad", join, 1.0)
    assert list(host.clients) == [0]


# ============================================================================ the last turn


def test_the_game_stops_at_max_turn_with_a_named_event() -> None:
    cfg = LockstepConfig(turn_interval=0.001)
    host = LockstepHost[str](config=cfg)
    clients = {"a": LockstepClient(name="a", config=cfg), "b": LockstepClient(name="b", config=cfg)}
    host_events: list[object] = []
    client_events: list[object] = []

    def pump(now: float) -> None:
        for _ in range(20):
            moved = False
            for peer, client in clients.items():
                for data in client.messages_to_send():
                    host.receive(peer, data, now)
                    moved = True
            for peer, data in host.messages_to_send():
                clients[peer].receive(data, now)
                moved = True
            for client in clients.values():
                while (turn := client.next_turn()) is not None:
                    client.complete_turn(turn.number, 1)
                client_events.extend(_events(client))
            host_events.extend(_host_events(host))
            if not moved:
                return

    pump(0.0)
    host.next_turn = MAX_TURN - 3  # stands in for 24.9 days of 1 ms turns
    host.start(0.0)
    pump(0.0)
    now = 0.0
    while now < 12.0:  # past unresponsive_after and drop_after
        now = round(now + 0.01, 4)
        if (deadline := host.get_timer()) is not None and deadline <= now:
            host.handle_timer(now)
        for client in clients.values():
            if (deadline := client.get_timer()) is not None and deadline <= now:
                client.handle_timer(now)
        pump(now)
    assert host_events.count(TurnsExhausted(MAX_TURN)) == 1
    assert client_events.count(TurnsExhausted(MAX_TURN)) == 2
    assert not any(
        isinstance(e, ClientLeft | HostUnresponsive) for e in host_events + client_events
    )
    assert [c.executed_turn for c in clients.values()] == [MAX_TURN, MAX_TURN]
    assert host.clock.deadline is None and host.get_timer() is None
    assert host.stats.malformed == host.stats.unexpected == 0
    with pytest.raises(LocalProtocolError):
        clients["a"].send_command(b"x")  # no turn left to carry it
