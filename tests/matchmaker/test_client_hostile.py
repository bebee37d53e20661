"""The client library against replicas that answer wrong: forged datagrams, refusals
from one replica of several, absurd keep-alive intervals, replies of the wrong type,
lists past their limit, and a replica that dies before the client closes."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgpack
import pytest

from matchmaker import heartbeat as hb
from matchmaker import liveness
from matchmaker.addresses import Address
from matchmaker.client import (
    MIN_KEEPALIVE,
    MatchmakerClient,
    MatchmakerError,
    ReplyRefused,
    _Beats,
)
from matchmaker.liveness import Liveness
from matchmaker.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorReason,
    Heartbeat,
    HostEntry,
    InfoReply,
    InfoRequest,
    Introduction,
    ListPage,
    ListRequest,
    Message,
    Ok,
    Register,
    Registered,
    Role,
    WrongVersion,
    decode,
    encode,
)
from matchmaker.metrics import Metrics
from matchmaker.registry.memory import MemoryRegistry
from tests.matchmaker.fakes import SERVER_ADDRESS, DatagramNet, FakeConnection, pipe
from tests.matchmaker.helpers import Harness, eventually, info, pub

HOST: dict[str, Any] = {"name": "srv", "game": "q3", "version": "1", "max_players": 8}
INFO: dict[str, Any] = {"software": "scripted", "hosts": 0, "keepalive": 1.0}
LISTED = Address(pub(1), 27960)
"""Where the hosts of these tests connect from, and are listed at."""

Answer = Callable[[Message], Message | bytes | None]
"""What a scripted replica sends back for a request: a message (its request id
set to the request's), raw bytes, or nothing."""


class Board:
    """One matchmaker (a `Harness`) the clients connect to, and its datagram socket."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.net = DatagramNet()
        liveness = harness.service.liveness
        liveness.send = self.net.serve(liveness.receive)
        self.tasks: set[asyncio.Task[None]] = set()

    def connector(self, ip: str = pub(1), port: int = 27960) -> Any:
        async def connect() -> FakeConnection:
            server_side, client_side = pipe((ip, port))
            self.tasks.add(asyncio.create_task(self.harness.service.handle(server_side)))
            return client_side

        return connect

    def port(self, ip: str = pub(1), port: int = 27960) -> Any:
        return self.net.port((ip, port))


class Scripted:
    """A replica that answers each request as `answer` says, and notes them all."""

    def __init__(self, answer: Answer, ip: str = pub(1)) -> None:
        self.answer = answer
        self.ip = ip
        self.requests: list[Message] = []
        self.connections = 0
        self.stuck_close = False
        """Its connections' close never completes (the replica died meanwhile)."""
        self.tasks: set[asyncio.Task[None]] = set()

    async def connect(self) -> FakeConnection:
        server_side, client_side = pipe((self.ip, 27960))
        self.connections += 1
        self.tasks.add(asyncio.create_task(self._serve(server_side)))
        if self.stuck_close:

            async def never(*args: Any, **kwargs: Any) -> None:
                await asyncio.Event().wait()

            client_side.close = never  # type: ignore[method-assign]
        return client_side

    async def _serve(self, conn: FakeConnection) -> None:
        async for received in conn:
            request = decode(received.data)
            self.requests.append(request)
            reply = self.answer(request)
            if isinstance(reply, bytes):
                conn.send(reply)
            elif reply is not None:
                conn.send(encode(replace(reply, request_id=request.request_id)))  # type: ignore[type-var]

    def count(self, kind: type[Message]) -> int:
        return sum(isinstance(r, kind) for r in self.requests)


def registered(keepalive: float = 5.0) -> Registered:
    return Registered(address=LISTED, keepalive=keepalive)


def refusing(reason: ErrorReason) -> Error:
    return Error(reason=reason, detail="scripted")


def over_its_limits(request: Message) -> bytes:
    """A `registered` with a keepalive past what the client reads (its id readable)."""
    fields = {"v": PROTOCOL_VERSION, "t": 9, "id": request.request_id}
    return bytes(msgpack.packb({**fields, "addr": [pub(1), 27960], "keepalive": 4000}))


def page_with_a_stray_field(request: Message) -> bytes:
    fields = {"v": PROTOCOL_VERSION, "t": 11, "id": request.request_id}
    page = {"seq": 0, "total": 0, "end": True, "hosts": [], "extra": 1}
    return bytes(msgpack.packb({**fields, **page}))


# -- heartbeat datagrams: a forged NOT_REGISTERED ------------------------------------------


async def test_a_forged_not_registered_before_the_first_heartbeat_is_dropped() -> None:
    # No heartbeat has left yet (keepalive 5 s): nothing waits for an answer, so no
    # NOT_REGISTERED without a MAC can be one, whatever counter it echoes.  A
    # registration's window used to start at 0, so counter 0 always passed, and each
    # forced registration opened the same hole again.
    board = Board(Harness(keepalive=5.0))
    host = MatchmakerClient(board.connector(), datagrams=board.port(), reconnect_delay=0.01)
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        beats = host._beats
        assert beats is not None
        port = board.port()
        for counter in (0, 1, beats.counter, beats.counter + 1):
            port.deliver(hb.encode_not_registered(counter), SERVER_ADDRESS)
        assert host.dropped["stale"] == 4
        assert not host._needs_register.is_set()
        assert host.registrations == 1 and host._beats is beats


async def test_a_not_registered_for_a_heartbeat_already_acknowledged_is_dropped() -> None:
    board = Board(Harness(keepalive=5.0))
    host = MatchmakerClient(board.connector(), datagrams=board.port(), reconnect_delay=0.01)
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        beats = host._beats
        assert beats is not None
        assert await asyncio.wait_for(host._beat_round(beats, 2.0), 5)  # acknowledged
        board.port().deliver(hb.encode_not_registered(beats.counter), SERVER_ADDRESS)
        assert host.dropped["stale"] == 1
        assert not host._needs_register.is_set() and host.registrations == 1


async def test_a_not_registered_for_a_heartbeat_sent_after_the_last_acknowledged_counts() -> None:
    # Heartbeat N's acknowledgment came late, after N+1 had left, and the replica
    # lost the host meanwhile and answered N+1 NOT_REGISTERED: the round had closed
    # the whole window at N's acknowledgment, so that answer was dropped as stale
    # and the host stayed unlisted a keepalive longer.
    board = Board(Harness(keepalive=5.0))
    host = MatchmakerClient(
        board.connector(), datagrams=board.port(), timeout=0.4, reconnect_delay=0.01
    )
    loop = asyncio.get_running_loop()
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        beats = host._beats
        assert beats is not None
        first = beats.counter + 1
        port = board.port()

        def replica(data: bytes, source: tuple[str, int]) -> list[bytes]:
            beat = hb.decode_beat(data)
            if beat.counter == first:  # acknowledged late, after the resend left
                ack = hb.encode_ack(beats.secret, beats.address, beat.counter)
                loop.call_later(0.15, port.deliver, ack, SERVER_ADDRESS)
            else:  # the host is lost by then
                told = hb.encode_not_registered(beat.counter)
                loop.call_later(0.2, port.deliver, told, SERVER_ADDRESS)
            return []

        board.net.server = replica
        assert await asyncio.wait_for(host._beat_round(beats, 2.0), 5)
        assert beats.counter == first + 1  # the resend left before the acknowledgment
        await eventually(lambda: host.registrations == 2)  # registered again at once
        assert host.dropped["stale"] == 0


async def test_a_replayed_acknowledgment_does_not_hurry_the_next_heartbeat() -> None:
    # An acknowledgment seen on the path and sent again moves nothing: it used to
    # wake the waiting round, which sent its next heartbeat at once, one heartbeat
    # for every replayed acknowledgment that found the round waiting.
    board = Board(Harness(keepalive=5.0))
    host = MatchmakerClient(board.connector(), datagrams=board.port(), timeout=40.0)
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        beats = host._beats
        assert beats is not None
        assert await asyncio.wait_for(host._beat_round(beats, 2.0), 5)  # acknowledged
        old = hb.encode_ack(beats.secret, beats.address, beats.counter)
        board.net.server = lambda data, source: []  # the replica goes quiet
        sent = len(board.net.to_server)
        waiting = asyncio.ensure_future(host._beat_round(beats, 20.0))
        await eventually(lambda: len(board.net.to_server) == sent + 1)  # the round's first
        port = board.port()
        for _ in range(100):
            port.deliver(old, SERVER_ADDRESS)
            await asyncio.sleep(0)
        # The next heartbeat of the round is due timeout / 4 = 10 s later.
        assert len(board.net.to_server) == sent + 1
        assert host.dropped["stale_ack"] == 100 and not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting


# -- heartbeat datagrams: replayed introductions ---------------------------------------------

SECRET = b"s" * 32
OTHER_REPLICA = ("198.51.100.2", 27950)


def introduction(intro_id: int) -> bytes:
    """An INTRODUCTION as a replica sends it to `LISTED` (MAC'd, no time in it)."""
    peer = Address(pub(2 + intro_id % 200), 5000 + intro_id % 1000)
    message = Introduction(role=Role.HOST, peer=peer, nonce=intro_id.to_bytes(16, "big"))
    return hb.encode_introduction(SECRET, LISTED, intro_id, encode(message))


def heartbeating(**kw: Any) -> tuple[MatchmakerClient, _Beats, Any, DatagramNet]:
    """A host's client heartbeating to `SERVER_ADDRESS`, with no connection."""
    net = DatagramNet()
    port = net.port((LISTED.ip, LISTED.port))
    host = MatchmakerClient(lambda: None, datagrams=port, **kw)  # type: ignore[arg-type]
    beats = host._beats = _Beats(SECRET, LISTED, SERVER_ADDRESS)
    host._listen()
    return host, beats, port, net


def queued(host: MatchmakerClient) -> list[int]:
    out = []
    while not host.introductions.empty():
        out.append(int.from_bytes(host.introductions.get_nowait().nonce, "big"))
    return out


async def test_an_introduction_replayed_after_many_newer_ones_is_not_queued_again() -> None:
    # An on-path observer sends old INTRODUCTION datagrams again: the MAC is good
    # for the whole registration and there is no time in them.  Once 256 newer
    # ones had pushed its id out of what the client remembered, each was queued
    # again, and 64 of them pushed a genuine introduction out of the queue.
    host, _, port, net = heartbeating()
    for intro_id in range(1000, 1600):
        port.deliver(introduction(intro_id), SERVER_ADDRESS)
        assert queued(host) == [intro_id]
    acks = len(net.to_server)
    port.deliver(introduction(1600), SERVER_ADDRESS)  # a genuine new one
    for intro_id in range(1000, 1601):
        port.deliver(introduction(intro_id), SERVER_ADDRESS)
    assert queued(host) == [1600]
    # Each copy is acknowledged again, so that a replica still resending stops.
    assert len(net.to_server) == acks + 1 + 601
    assert host.dropped["seen_introduction"] == 601


async def test_a_replica_that_takes_the_host_over_numbers_its_introductions_anew() -> None:
    # Each replica numbers introductions from a start of its own: the one that took
    # the host over may number below what the former one reached.
    host, beats, port, _ = heartbeating(timeout=2.0)
    host._replicas = {"a": SERVER_ADDRESS, "b": OTHER_REPLICA}
    loop = asyncio.get_running_loop()

    def send(data: bytes, address: tuple[Any, ...]) -> None:
        if tuple(address) == OTHER_REPLICA and data[0] == hb.Kind.MOVING:  # it takes us over
            ack = hb.encode_ack(SECRET, LISTED, hb.decode_beat(data).counter)
            loop.call_soon(port.deliver, ack, OTHER_REPLICA)

    port.send_datagram = send
    for intro_id in range(1000, 1300):
        port.deliver(introduction(intro_id), SERVER_ADDRESS)
    queued(host)
    assert await asyncio.wait_for(host._move(beats), 5)
    assert beats.replica == OTHER_REPLICA and beats.former == SERVER_ADDRESS
    port.deliver(introduction(7), OTHER_REPLICA)  # the new replica's first
    port.deliver(introduction(1300), SERVER_ADDRESS)  # the former one's last, late
    port.deliver(introduction(1000), SERVER_ADDRESS)  # and an old one, replayed
    port.deliver(introduction(7), OTHER_REPLICA)  # resent
    assert queued(host) == [7, 1300]


@pytest.mark.parametrize("intro_id", [7, 5000])
async def test_an_introduction_from_the_next_replica_during_the_move_is_its_own(
    intro_id: int,
) -> None:
    # While the MOVING round waits (its first acknowledgment lost), the replica taking
    # the host over already introduces a client: that introduction was checked against
    # the former replica's record (below its floor: acknowledged and lost; above it:
    # queued, and queued again when resent after the move).
    host, beats, port, _ = heartbeating(timeout=2.0)
    host._replicas = {"a": SERVER_ADDRESS, "b": OTHER_REPLICA}
    loop = asyncio.get_running_loop()
    movings: list[bytes] = []

    def send(data: bytes, address: tuple[Any, ...]) -> None:
        if tuple(address) == OTHER_REPLICA and data[0] == hb.Kind.MOVING:
            movings.append(data)
            if len(movings) == 1:  # its acknowledgment lost; an introduction comes
                loop.call_soon(port.deliver, introduction(intro_id), OTHER_REPLICA)
            else:
                ack = hb.encode_ack(SECRET, LISTED, hb.decode_beat(data).counter)
                loop.call_soon(port.deliver, ack, OTHER_REPLICA)

    port.send_datagram = send
    for old in range(1000, 1300):
        port.deliver(introduction(old), SERVER_ADDRESS)
    queued(host)
    assert await asyncio.wait_for(host._move(beats), 5)
    assert len(movings) >= 2 and queued(host) == [intro_id]
    port.deliver(introduction(intro_id), OTHER_REPLICA)  # resent: our ack was lost
    assert queued(host) == []


def test_a_replica_process_numbers_its_introductions_above_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host keeps one record per replica address: a process restarted there (or a
    # worker restarted behind the same socket) numbering from a random start below
    # the one before had every introduction taken for a replay, and lost.
    wall = [1_795_000_000 * 10**9]
    monkeypatch.setattr(liveness.time, "time_ns", lambda: wall[0])
    before = Liveness(MemoryRegistry(), Metrics(), on_leave=lambda record: None)
    sent = [next(before._ids) for _ in range(100_000)]  # 100,000 in its life
    wall[0] += 10**9  # restarted a second later
    after = Liveness(MemoryRegistry(), Metrics(), on_leave=lambda record: None)
    assert next(after._ids) > max(sent)


# -- a replica that answers but refuses is left for the next --------------------------------

REFUSALS: dict[str, Answer] = {
    "unavailable": lambda r: refusing(ErrorReason.UNAVAILABLE) if isinstance(r, Register) else None,
    "internal": lambda r: refusing(ErrorReason.INTERNAL) if isinstance(r, Register) else None,
    "rate_limited": lambda r: (
        refusing(ErrorReason.RATE_LIMITED) if isinstance(r, Register) else None
    ),
    "refused_reply": lambda r: over_its_limits(r) if isinstance(r, Register) else None,
    "wrong_version": lambda r: WrongVersion(supported=(2,)) if isinstance(r, Register) else None,
    "wrong_type": lambda r: Ok() if isinstance(r, Register) else None,
}


@pytest.mark.parametrize("answer", [a for a in REFUSALS if a != "rate_limited"])
async def test_register_moves_on_from_a_replica_that_refuses(answer: str) -> None:
    # Staying with the first replica would wait out the 30 s backoff (or, for the
    # replies only it may be wrong about, give up at once).
    board = Board(Harness())
    first = Scripted(REFUSALS[answer])
    host = MatchmakerClient(
        [first.connect, board.connector()],
        datagrams=board.port(),
        timeout=1,
        reconnect_delay=30,
        max_reconnect_delay=30,
        register_timeout=60,
    )
    host._start = 0  # the refusing replica first
    async with host:
        assert await asyncio.wait_for(host.register(**HOST), 5) == LISTED
        assert host.route == "replica 2"
        assert first.count(Register) == 1 and first.connections == 1
        assert board.harness.registry.get(LISTED) is not None


async def test_a_registration_refused_as_rate_limited_backs_off_on_its_connection() -> None:
    # The limit is per source, the same at every replica, and two addresses may be
    # one replica (IPv4 and IPv6): moving on at once hammered it, on new connections.
    limited = Scripted(REFUSALS["rate_limited"])
    host = MatchmakerClient(
        [limited.connect, limited.connect],
        timeout=0.2,
        reconnect_delay=0.2,
        max_reconnect_delay=0.2,
        register_timeout=0.5,
    )
    async with host:
        with pytest.raises(MatchmakerError) as refused:
            await asyncio.wait_for(host.register(**HOST), 5)
    assert refused.value.reason is ErrorReason.RATE_LIMITED
    assert limited.connections == 1 and 2 <= limited.count(Register) <= 4


async def test_a_lone_replica_that_refuses_is_retried_on_its_connection() -> None:
    refuses = Scripted(REFUSALS["unavailable"])
    host = MatchmakerClient(
        refuses.connect,
        timeout=0.1,
        reconnect_delay=0.01,
        max_reconnect_delay=0.01,
        register_timeout=0.3,
    )
    async with host:
        with pytest.raises(MatchmakerError) as refused:
            await asyncio.wait_for(host.register(**HOST), 5)
        assert refused.value.reason is ErrorReason.UNAVAILABLE
        assert refuses.count(Register) >= 2 and refuses.connections == 1


@pytest.mark.parametrize("answer", ["wrong_version", "wrong_type"])
async def test_an_answer_only_a_replica_may_be_wrong_about_ends_register_once_each_gave_it(
    answer: str,
) -> None:
    lone = Scripted(REFUSALS[answer])
    async with MatchmakerClient(lone.connect, register_timeout=60) as host:
        with pytest.raises(MatchmakerError) as refused:
            await asyncio.wait_for(host.register(**HOST), 5)
        assert lone.count(Register) == 1
    first, second = Scripted(REFUSALS[answer]), Scripted(REFUSALS[answer])
    both = MatchmakerClient([first.connect, second.connect], register_timeout=60)
    async with both:
        with pytest.raises(MatchmakerError) as again:
            await asyncio.wait_for(both.register(**HOST), 5)
        assert again.value.reason is refused.value.reason
        assert first.count(Register) == second.count(Register) == 1
    expected = ErrorReason.WRONG_VERSION if answer == "wrong_version" else ErrorReason.MALFORMED
    assert refused.value.reason is expected


async def test_the_keepalive_moves_on_from_a_replica_that_lost_the_host_and_refuses() -> None:
    # Connection mode: the first replica forgets the host and refuses every
    # registration (its registry is down); the host registers with the other.
    broken = asyncio.Event()

    def first_answer(request: Message) -> Message | None:
        if isinstance(request, Register):
            return refusing(ErrorReason.UNAVAILABLE) if broken.is_set() else registered(0.02)
        if isinstance(request, Heartbeat) and broken.is_set():
            return refusing(ErrorReason.NOT_REGISTERED)
        return None

    board = Board(Harness(keepalive=0.02))
    first = Scripted(first_answer)
    host = MatchmakerClient(
        [first.connect, board.connector()],
        timeout=1,
        reconnect_delay=30,
        max_reconnect_delay=30,
    )
    host._start = 0
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        assert host.route == "replica 1"
        broken.set()
        await eventually(lambda: board.harness.registry.get(LISTED) is not None)
        assert host.route == "replica 2" and host.registrations == 2
        assert first.count(Register) == 2  # the first registration, and one refused
        assert host.registration_error is None and host.host_info is not None


LIST_REFUSALS: dict[str, Answer] = {
    "unavailable": lambda r: refusing(ErrorReason.UNAVAILABLE),
    "internal": lambda r: refusing(ErrorReason.INTERNAL),
    "refused_reply": page_with_a_stray_field,
}


@pytest.mark.parametrize("answer", list(LIST_REFUSALS))
async def test_the_next_list_goes_to_the_next_replica_after_a_refusal(answer: str) -> None:
    board = Board(Harness())
    first = Scripted(LIST_REFUSALS[answer], ip=pub(2))
    browser = MatchmakerClient([first.connect, board.connector(pub(2))], timeout=1)
    browser._start = 0
    async with browser:
        with pytest.raises((MatchmakerError, ReplyRefused)):
            await asyncio.wait_for(browser.list_servers(game="q3"), 5)
        assert await asyncio.wait_for(browser.list_servers(game="q3"), 5) == []
        assert browser.route == "replica 2" and len(first.requests) == 1


async def test_a_list_refused_as_rate_limited_keeps_its_connection() -> None:
    # The per-connection cap on lists is the client's own doing: another replica
    # would not change it, and the answers in flight on the connection go on.
    first = Scripted(lambda r: refusing(ErrorReason.RATE_LIMITED), ip=pub(2))
    second = Scripted(lambda r: None, ip=pub(2))
    browser = MatchmakerClient([first.connect, second.connect], timeout=1)
    browser._start = 0
    async with browser:
        for _ in range(2):
            with pytest.raises(MatchmakerError, match="rate_limited"):
                await asyncio.wait_for(browser.list_servers(game="q3"), 5)
        assert len(first.requests) == 2 and first.connections == 1
        assert second.connections == 0


# -- keep-alive intervals ---------------------------------------------------------------------


async def test_a_keepalive_of_zero_does_not_make_the_host_heartbeat_in_a_busy_loop() -> None:
    replica = Scripted(lambda r: registered(0.0) if isinstance(r, Register) else None)
    loop = asyncio.get_running_loop()
    async with MatchmakerClient(replica.connect) as host:
        await asyncio.wait_for(host.register(**HOST), 5)
        start = loop.time()
        await eventually(lambda: replica.count(Heartbeat) >= 5)
        # Four intervals at least between the first heartbeat and the fifth.
        assert loop.time() - start >= 4 * MIN_KEEPALIVE * 0.9


async def test_a_replica_that_forgets_each_registration_at_once_is_retried_with_backoff() -> None:
    # Registered with keepalive 0, then NOT_REGISTERED to the first heartbeat, again
    # and again: the host registered anew every round trip (~84 a second), each over
    # a new connection, the backoff reset by every round.
    def forgetful(request: Message) -> Message | None:
        if isinstance(request, Register):
            return registered(0.0)
        return refusing(ErrorReason.NOT_REGISTERED) if isinstance(request, Heartbeat) else None

    replica = Scripted(forgetful)
    loop = asyncio.get_running_loop()
    host = MatchmakerClient(replica.connect, reconnect_delay=0.05, max_reconnect_delay=0.4)
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        start = loop.time()
        await asyncio.sleep(1.0)
        elapsed = loop.time() - start
    # Once at once, then after 0.05, 0.1, 0.2, 0.4, 0.4 ... s: a handful a second.
    assert replica.count(Register) <= 2 + elapsed / 0.05, replica.count(Register)
    assert replica.count(Register) <= 10


async def test_another_replicas_first_not_registered_is_a_first_time_again() -> None:
    # A rolling restart: A, then B, then A again each lost the host once. Counted
    # across replicas, B's and A's first answers backed off (unlisted meanwhile);
    # only a replica refusing the registration it just made backs off.
    host = MatchmakerClient(lambda: None, reconnect_delay=0.5)  # type: ignore[arg-type,return-value]
    tellers = ["A", "B", "A", "A"]
    pauses: list[float] = []

    async def keep_once() -> None:
        host._beats = types.SimpleNamespace(replica=tellers.pop(0))  # type: ignore[assignment]
        host._needs_register.set()  # told NOT_REGISTERED
        if not tellers:
            host._host = None  # and stop there

    async def pause(delay: float) -> None:
        pauses.append(delay)

    host._host = object()  # type: ignore[assignment]
    host._keep_once = keep_once  # type: ignore[method-assign]
    host._pause = pause  # type: ignore[method-assign]
    await asyncio.wait_for(host._keep_registered(), 5)
    assert pauses == [0.5]  # A's second in a row only


async def test_waiting_to_register_again_heartbeats_once_per_interval_at_most() -> None:
    board = Board(Harness(keepalive=5.0))
    host = MatchmakerClient(board.connector(), datagrams=board.port())
    async with host:
        await asyncio.wait_for(host.register(**HOST), 5)
        host._keepalive = 0.0  # as a `registered` of keepalive 0 once left it
        sent = len(board.net.to_server)
        await asyncio.wait_for(host._pause(0.05), 5)
        assert len(board.net.to_server) - sent <= 0.05 / MIN_KEEPALIVE + 2


# -- list answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("reply", [Ok(), InfoReply(**INFO)], ids=["ok", "info_reply"])
async def test_a_list_answered_with_another_reply_type_fails_as_malformed(reply: Message) -> None:
    def answer(request: Message) -> Message:
        return reply if isinstance(request, ListRequest) else InfoReply(**INFO)

    replica = Scripted(answer, ip=pub(2))
    async with MatchmakerClient(replica.connect, timeout=1) as browser:
        with pytest.raises(MatchmakerError, match=f"unexpected {type(reply).__name__}") as caught:
            await asyncio.wait_for(browser.list_servers(game="q3"), 5)
        assert caught.value.reason is ErrorReason.MALFORMED
        assert isinstance(await asyncio.wait_for(browser.info(), 5), InfoReply)


async def test_a_list_keeps_each_address_once_and_at_most_limit_hosts() -> None:
    a, b, c, d = (HostEntry(address=Address(pub(n), 27960), info=info()) for n in (5, 6, 7, 8))

    def pages(request: Message) -> Message | None:
        if not isinstance(request, ListRequest):
            return None
        return ListPage(seq=0, total=9, end=True, hosts=(a, a, b, a, b, c, d, d, c))

    replica = Scripted(pages, ip=pub(2))
    async with MatchmakerClient(replica.connect, timeout=1) as browser:
        everything = await asyncio.wait_for(browser.list_servers(game="q3"), 5)
        assert [h.address for h in everything] == [a.address, b.address, c.address, d.address]
        capped = await asyncio.wait_for(browser.list_servers(game="q3", limit=3), 5)
        assert [h.address for h in capped] == [a.address, b.address, c.address]
        assert capped.limit == 3 and capped.limit_reached


class Endless(Scripted):
    """A replica that answers a list with page after page, none marked the end."""

    async def _serve(self, conn: FakeConnection) -> None:
        host = HostEntry(address=Address(pub(5), 27960), info=info())
        async for received in conn:
            request = decode(received.data)
            self.requests.append(request)
            for seq in range(50):
                page = ListPage(seq=seq, total=50, end=False, hosts=(host,))
                conn.send(encode(replace(page, request_id=request.request_id)))


async def test_a_list_answer_of_more_pages_than_it_can_have_fails_at_once() -> None:
    # Held until the timeout before: one such answer filled the client's memory with
    # pages (1,800 in 5 s), and failed only as a timeout.
    replica = Endless(lambda request: None, ip=pub(2))
    async with MatchmakerClient(replica.connect, timeout=30) as browser:
        with pytest.raises(MatchmakerError, match="page 3 of an answer of at most 3") as caught:
            await asyncio.wait_for(browser.list_servers(game="q3", limit=3), 5)
        assert caught.value.reason is ErrorReason.MALFORMED


# -- close ----------------------------------------------------------------------------------


async def test_close_is_bounded_by_timeout_when_the_replica_died() -> None:
    replica = Scripted(
        lambda r: InfoReply(**INFO) if isinstance(r, InfoRequest) else None,
        ip=pub(2),
    )
    replica.stuck_close = True
    browser = MatchmakerClient(replica.connect, timeout=0.1)
    await asyncio.wait_for(browser.info(), 5)
    await asyncio.wait_for(browser.close(), 5)
