"""The client library against the real service, over the in-memory fake transport."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgpack
import pytest

import rudp
from matchmaker import heartbeat as hb
from matchmaker.addresses import Address
from matchmaker.client import (
    ConnectionLost,
    MatchmakerClient,
    MatchmakerError,
    MatchmakerUnreachable,
    ReplyRefused,
    RequestTimeout,
)
from matchmaker.messages import PROTOCOL_VERSION, ErrorReason, Role, decode
from matchmaker.registry import RemovalReason
from tests.matchmaker.fakes import SERVER_ADDRESS, DatagramNet, FakeConnection, pipe
from tests.matchmaker.helpers import HOST as LISTED
from tests.matchmaker.helpers import (
    Harness,
    accepting_endpoint,
    eventually,
    info,
    pub,
    settings,
)

T = TypeVar("T")

MODES = ["datagrams", "connection"]
"""How a host keeps its listing: heartbeat datagrams from its socket, or messages
over a connection it holds (a client given no socket)."""


class Switchboard:
    """Connects clients to whichever Harness is "the matchmaker" right now."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.links: list[FakeConnection] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.net = DatagramNet()
        self._plug()

    def _plug(self) -> None:
        liveness = self.harness.service.liveness
        liveness.send = self.net.serve(liveness.receive)

    def connector(self, ip: str, port: int = 27960) -> Any:
        async def connect() -> FakeConnection:
            server_side, client_side = pipe((ip, port))
            self.tasks.append(asyncio.create_task(self.harness.service.handle(server_side)))
            self.links.append(client_side)
            return client_side

        return connect

    async def restart(self) -> Harness:
        """The matchmaker restarts: every connection drops, the registry is empty.

        The new matchmaker is in place before the old connections drop: a client
        reconnects as soon as its link ends (on Python 3.12, where ``wait_for``
        runs no task of its own, before the old tasks have finished)."""
        old_links, old_tasks = self.links, self.tasks
        self.links, self.tasks = [], []
        self.harness = Harness(keepalive=self.harness.settings.keepalive)
        self._plug()
        for link in old_links:
            link.abort()
        await asyncio.gather(*old_tasks)
        return self.harness


def client(
    board: Switchboard, ip: str, port: int = 27960, mode: str = "datagrams", **kw: Any
) -> MatchmakerClient:
    kw.setdefault("reconnect_delay", 0.01)
    if mode == "datagrams":
        kw["datagrams"] = board.net.port((ip, port))
    return MatchmakerClient(board.connector(ip, port), **kw)


def heartbeats_flow(board: Switchboard, mode: str) -> bool:
    if mode == "datagrams":
        return board.harness.sample("matchmaker_heartbeats_total", result="ok") > 0
    return bool(board.harness.service._beats)


HOST: dict[str, Any] = {"name": "srv", "game": "q3", "version": "1", "max_players": 8}


@pytest.mark.parametrize("mode", MODES)
async def test_register_keepalive_update_unregister(mode: str) -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1), mode=mode) as host:
        address = await host.register(**HOST, tags=["ctf"], lan=("192.168.1.2", 27960))
        assert address == Address(pub(1), 27960) == host.address
        rec = board.harness.registry.get(address)
        assert rec is not None and rec.info.tags == ("ctf",)
        await eventually(lambda: heartbeats_flow(board, mode))
        # A heartbeating host holds no connection; one that has no socket does.
        await eventually(lambda: board.harness.service.connections == (mode == "connection"))
        await host.update(players=2, map="dm6")
        rec = board.harness.registry.get(address)
        assert rec is not None and (rec.info.players, rec.info.map) == (2, "dm6")
        with pytest.raises(MatchmakerError) as refused:
            await host.update(players=99)
        assert refused.value.reason is ErrorReason.BAD_FIELD
        await host.unregister()
        assert board.harness.registry.get(address) is None


@pytest.mark.parametrize("mode", MODES)
async def test_reregisters_after_matchmaker_restart_with_latest_info(mode: str) -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1), mode=mode) as host:
        await host.register(**HOST)
        await host.update(players=5)
        fresh = await board.restart()
        address = Address(pub(1), 27960)
        await eventually(lambda: fresh.registry.get(address) is not None)
        rec = fresh.registry.get(address)
        assert rec is not None and rec.info.players == 5
        # The entry is made before the reply reaches the client.
        await eventually(lambda: host.registrations >= 2)
        assert host.registrations == 2


@pytest.mark.parametrize("mode", MODES)
async def test_reregisters_when_told_not_registered(mode: str) -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1), mode=mode) as host:
        await host.register(**HOST)
        address = Address(pub(1), 27960)
        rec = board.harness.registry.get(address)
        assert rec is not None
        await board.harness.registry.remove(address, RemovalReason.EXPIRED)
        # The next heartbeat is answered with not_registered: at once for a
        # datagram, at the next flush for a message (the registry says so).
        if mode == "connection":
            await eventually(lambda: bool(board.harness.service._beats))
            await board.harness.service.flush_heartbeats()
        await eventually(lambda: board.harness.registry.get(address) is not None)
        await eventually(lambda: host.registrations >= 2)  # the reply comes after the entry
        assert host.registrations == 2


@pytest.mark.parametrize("mode", MODES)
async def test_close_removes_the_host(mode: str) -> None:
    board = Switchboard(Harness())
    host = client(board, pub(1), mode=mode)
    await host.register(**HOST)
    await host.close()
    await eventually(lambda: board.harness.registry.get(Address(pub(1), 27960)) is None)
    reason = "unregistered"
    assert board.harness.sample("matchmaker_removals_total", reason=reason) == 1


async def test_list_servers_collects_every_page() -> None:
    board = Switchboard(Harness(page_hosts=2, max_hosts_per_ip=20))
    for i in range(15):
        await board.harness.registry.upsert(
            Address(pub(i % 5 + 1), 20000 + i), info(players=i % 3), max_per_ip=20
        )
    async with client(board, pub(100)) as browser:
        hosts = await browser.list_servers(game="q3")
        assert len({h.address for h in hosts}) == 15
        busy = await browser.list_servers(game="q3", not_empty=True, tags_all=[])
        assert len(busy) == 10 and all(h.info.players for h in busy)
        assert await browser.list_servers(game="ut") == []
        with pytest.raises(ValueError, match="limit"):
            await browser.list_servers(game="q3", limit=0)


@pytest.mark.parametrize("mode", MODES)
async def test_introduce_reaches_both_sides(mode: str) -> None:
    board = Switchboard(Harness())
    async with (
        client(board, pub(1), mode=mode) as host,
        client(board, pub(2), 5000) as joiner,
    ):
        address = await host.register(**HOST)
        if mode == "datagrams":
            await eventually(lambda: board.harness.service.connections == 0)
        intro = await joiner.introduce(address)
        assert intro.role is Role.CLIENT and intro.peer == address
        to_host = await asyncio.wait_for(host.introductions.get(), 2)
        assert to_host.role is Role.HOST and to_host.peer == Address(pub(2), 5000)
        assert to_host.nonce == intro.nonce
        with pytest.raises(MatchmakerError) as refused:
            await joiner.introduce((pub(9), 1))
        assert refused.value.reason is ErrorReason.NOT_FOUND


async def test_refusals_are_errors_and_permanent_ones_stop_the_keeper() -> None:
    board = Switchboard(Harness())
    async with client(board, "127.0.0.1") as host:
        with pytest.raises(MatchmakerError) as refused:
            await host.register(**HOST)
        assert refused.value.reason is ErrorReason.FORBIDDEN_ADDRESS
        assert (await host.info()).hosts == 0  # the client is still usable


async def test_request_timeout_and_connection_loss() -> None:
    async def silent() -> FakeConnection:
        _server_side, client_side = pipe((pub(1), 1))
        return client_side  # nobody serves the other end

    async with MatchmakerClient(silent, timeout=0.05) as c:
        with pytest.raises(TimeoutError):
            await c.info()

    links: list[FakeConnection] = []

    async def dropping() -> FakeConnection:
        _server_side, client_side = pipe((pub(1), 1))
        links.append(client_side)
        return client_side

    async with MatchmakerClient(dropping, timeout=2) as c:
        pending = asyncio.create_task(c.info())
        await eventually(lambda: bool(links))
        links[0].abort()
        with pytest.raises(ConnectionLost):
            await pending


async def test_a_lone_string_for_tags_is_refused_not_split_into_letters() -> None:
    board = Switchboard(Harness())
    async with client(board, pub(1)) as host:
        with pytest.raises(TypeError, match="tags"):
            await host.register(**HOST, tags="ctf")
        await host.register(**HOST, tags=["ctf"])
        with pytest.raises(TypeError, match="tags"):
            await host.update(tags="ffa")
        with pytest.raises(TypeError, match="tags_any"):
            await host.list_servers(game="q3", tags_any="ctf")
        assert [e.info.tags for e in await host.list_servers(game="q3", tags_any=["ctf"])] == [
            ("ctf",)
        ]


async def test_forged_not_registered_leaves_the_host_registered_and_heartbeating() -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1)) as host:
        await host.register(**HOST)
        port = board.net.port((pub(1), 27960))
        beats = host._beats
        assert beats is not None

        def acked() -> float:
            return board.harness.sample("matchmaker_heartbeats_total", result="ok")

        await eventually(lambda: acked() >= 1)
        # From another source, even echoing the counter the host sent last.
        port.deliver(hb.encode_not_registered(beats.counter), ("198.51.100.66", 27950))
        assert host.dropped["wrong_source"] == 1
        # From the replica's address, with counters a forger would guess (a
        # registration's first ones) ...
        for guess in range(1, 9):
            port.deliver(hb.encode_not_registered(guess), SERVER_ADDRESS)
        # ... or signed with a key that is not the registration's.
        port.deliver(
            hb.encode_not_registered(beats.counter, b"x" * 32, beats.address), SERVER_ADDRESS
        )
        # Or made by the matchmaker itself: a heartbeat naming an unlisted
        # address, sent from the host's address with a guessed counter.
        stranger = hb.encode_beat(b"k" * 32, Address(pub(7), 27960), 1)
        board.net.send_to_server(stranger, (pub(1), 27960))
        await eventually(lambda: host.dropped["stale"] == 9)
        assert host.dropped["bad_mac"] == 1
        seen = acked()
        await eventually(lambda: acked() >= seen + 2)
        assert host.registrations == 1 and host._beats is beats
        assert board.harness.registry.get(Address(pub(1), 27960)) is not None


async def test_an_authenticated_not_registered_from_the_replica_is_believed() -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1)) as host:
        await host.register(**HOST)
        port = board.net.port((pub(1), 27960))
        beats = host._beats
        assert beats is not None
        beats.round_start = 0  # whatever the counter, this one answers a heartbeat of ours
        port.deliver(
            hb.encode_not_registered(beats.counter, beats.secret, beats.address), SERVER_ADDRESS
        )
        await eventually(lambda: host.registrations >= 2)


async def test_the_old_registration_keeps_heartbeating_while_registering_again_fails() -> None:
    board = Switchboard(Harness(keepalive=0.02))
    async with client(board, pub(1), reconnect_delay=0.05) as host:
        await host.register(**HOST)
        beats = host._beats
        assert beats is not None
        board.harness.service.stop_accepting()  # registrations are refused from now on
        board.harness.service.liveness.stopping = False  # but heartbeats are still taken
        host._needs_register.set()
        start = beats.counter
        # Registering again fails (shutting_down), and meanwhile the old
        # registration's heartbeats go on.
        await eventually(lambda: beats.counter >= start + 3)
        assert host._beats is beats and host.registrations == 1
        assert board.harness.registry.get(Address(pub(1), 27960)) is not None


def silent_connector(ip: str) -> Any:
    """A replica that takes the connection and never answers a request."""

    async def connect() -> FakeConnection:
        _server_side, client_side = pipe((ip, 27960))
        return client_side

    return connect


def never_connecting(calls: list[int]) -> Any:
    """A replica that never answers a handshake; each attempt is noted in `calls`."""

    async def connect() -> FakeConnection:
        calls.append(1)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return connect


@pytest.mark.parametrize("mode", MODES)
async def test_a_replica_silent_to_a_request_is_left_for_the_next(mode: str) -> None:
    board = Switchboard(Harness())
    kw: dict[str, Any] = {"timeout": 0.05, "register_timeout": 30, "reconnect_delay": 0.01}
    if mode == "datagrams":
        kw["datagrams"] = board.net.port((pub(1), 27960))
    host = MatchmakerClient([silent_connector(pub(1)), board.connector(pub(1))], **kw)
    host._start = 0  # the silent replica first
    async with host:
        address = await asyncio.wait_for(host.register(**HOST), 10)
        assert address == Address(pub(1), 27960) and host.route == "replica 2"
    browser = MatchmakerClient([silent_connector(pub(2)), board.connector(pub(2))], timeout=0.05)
    browser._start = 0
    async with browser:
        with pytest.raises(RequestTimeout, match=r"replica 1 did not answer within 0.05 s"):
            await asyncio.wait_for(browser.info(), 10)
        assert (await asyncio.wait_for(browser.info(), 10)).hosts == 0
        assert browser.route == "replica 2"


async def test_close_stops_a_register_still_retrying() -> None:
    async def refused() -> FakeConnection:
        raise ConnectionRefusedError("nobody there")

    host = MatchmakerClient(refused, reconnect_delay=0.01, max_reconnect_delay=0.05)
    registering = asyncio.create_task(host.register(**HOST))
    await eventually(lambda: bool(host._tried))  # it failed once and is retrying
    await host.close()
    with pytest.raises(ConnectionLost, match="client closed"):
        await asyncio.wait_for(registering, 5)
    assert host._keeper is None and host.host_info is None


async def test_close_while_connecting_registers_nothing() -> None:
    board = Switchboard(Harness())
    gate = asyncio.Event()
    calls: list[int] = []
    connect = board.connector(pub(1))

    async def slow() -> FakeConnection:
        calls.append(1)
        await gate.wait()
        conn: FakeConnection = await connect()
        return conn

    host = MatchmakerClient(slow, datagrams=board.net.port((pub(1), 27960)))
    registering = asyncio.create_task(host.register(**HOST))
    await eventually(lambda: bool(calls))
    await asyncio.wait_for(host.close(), 5)
    gate.set()
    with pytest.raises(ConnectionLost, match="client closed"):
        await asyncio.wait_for(registering, 5)
    assert host._keeper is None
    assert board.harness.registry.get(Address(pub(1), 27960)) is None
    with pytest.raises(ConnectionLost, match="client closed"):
        await host.info()


async def test_close_ends_a_register_whose_connection_never_completes_at_once() -> None:
    # Three replicas that never answer a handshake: the close must not wait for the
    # attempt under way (its timeout) nor try the others.
    calls: list[int] = []
    never = never_connecting(calls)
    host = MatchmakerClient([never, never, never], timeout=30, register_timeout=60)
    registering = asyncio.create_task(host.register(**HOST))
    await eventually(lambda: bool(calls))
    await asyncio.wait_for(host.close(), 5)
    with pytest.raises(ConnectionLost, match="client closed"):
        await asyncio.wait_for(registering, 2)
    assert calls == [1]


async def test_register_timeout_bounds_the_wait_for_another_requests_connection() -> None:
    # A list request is connecting to a replica that never answers (for up to its
    # 30 s timeout): a register() given 1 s must not wait for that attempt to end.
    calls: list[int] = []
    never = never_connecting(calls)
    host = MatchmakerClient(never, timeout=30, register_timeout=1, reconnect_delay=0.05)
    listing = asyncio.create_task(host.list_servers(game="q3"))
    await eventually(lambda: bool(calls))
    try:
        with pytest.raises(MatchmakerUnreachable, match="no matchmaker took the registration"):
            await asyncio.wait_for(host.register(**HOST), 5)
    finally:
        await host.close()
        with pytest.raises(ConnectionLost, match="client closed"):
            await asyncio.wait_for(listing, 5)


async def test_close_fails_the_requests_in_flight() -> None:
    browser = MatchmakerClient(silent_connector(pub(2)), timeout=30)
    asking = asyncio.create_task(browser.info())
    listing = asyncio.create_task(browser.list_servers(game="q3"))
    await eventually(lambda: len(browser._pending) + len(browser._lists) == 2)
    await browser.close()
    for request in (asking, listing):
        with pytest.raises(ConnectionLost, match="client closed"):
            await asyncio.wait_for(request, 5)


async def test_a_host_over_the_per_ip_cap_registers_again_once_a_slot_frees() -> None:
    board = Switchboard(Harness(keepalive=0.02, max_hosts_per_ip=1))
    async with client(board, pub(1), max_reconnect_delay=0.05) as host:
        address = await host.register(**HOST)
        registry = board.harness.registry
        # The entry expires and another host of the same IP takes the one slot:
        # re-registering is refused with too_many_hosts.
        await registry.remove(address, RemovalReason.EXPIRED)
        other = Address(pub(1), 27961)
        await registry.upsert(other, info(), max_per_ip=1)
        await eventually(lambda: host._tried.get("replica 1", "").endswith("too_many_hosts"))
        await registry.remove(other, RemovalReason.UNREGISTERED)
        await eventually(lambda: registry.get(address) is not None)
        assert host.registration_error is None and host.host_info is not None


def switching_connector(board: Switchboard, to: Any) -> tuple[Any, list[bool]]:
    """Connects from pub(1) until the switch is flipped, then calls `to`."""
    switch = [False]
    first = board.connector(pub(1))

    async def connect() -> FakeConnection:
        if switch[0]:
            conn: FakeConnection = await to()
            return conn
        conn = await first()
        return conn

    return connect, switch


async def test_a_final_refusal_stops_the_keeper_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    board = Switchboard(Harness(keepalive=0.02))
    connect, switch = switching_connector(board, board.connector("127.0.0.1"))
    async with MatchmakerClient(connect, reconnect_delay=0.01) as host:
        await host.register(**HOST)
        switch[0] = True  # re-registering now comes from a forbidden address
        board.links[0].abort()
        await eventually(lambda: host._keeper is not None and host._keeper.done())
        refused = host.registration_error
        assert isinstance(refused, MatchmakerError)
        assert refused.reason is ErrorReason.FORBIDDEN_ADDRESS and host.host_info is None
        assert "registration_refused reason=forbidden_address" in caplog.text


async def test_a_closed_game_socket_is_raised_at_once_and_stops_the_keeper(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def closed_socket() -> FakeConnection:
        raise rudp.EndpointClosed("endpoint is closed")

    host = MatchmakerClient(closed_socket, register_timeout=60)
    with pytest.raises(rudp.EndpointClosed, match="endpoint is closed"):
        await asyncio.wait_for(host.register(**HOST), 5)
    await host.close()

    board = Switchboard(Harness(keepalive=0.02))
    connect, switch = switching_connector(board, closed_socket)
    async with MatchmakerClient(connect, reconnect_delay=0.01) as host:
        await host.register(**HOST)
        switch[0] = True  # the game stops: its socket closes
        board.links[0].abort()
        await eventually(lambda: host._keeper is not None and host._keeper.done())
        assert isinstance(host.registration_error, rudp.EndpointClosed)
        assert host.host_info is None
        assert "keepalive_stopped error=EndpointClosed" in caplog.text


async def test_a_connect_refused_by_our_own_socket_for_a_closing_connection_is_retried() -> None:
    # rudp holds one connection per address until its close ends: a connect to the
    # replica just given up is refused locally for a moment, not for good.
    board = Switchboard(Harness())
    first = board.connector(pub(1))
    refusals = [0]

    async def connect() -> FakeConnection:
        if refusals[0] < 2:
            refusals[0] += 1
            raise rudp.LocalProtocolError("already connected or connecting to the matchmaker")
        conn: FakeConnection = await first()
        return conn

    async with MatchmakerClient(connect, reconnect_delay=0.01, register_timeout=10) as host:
        await asyncio.wait_for(host.register(**HOST), 5)
        assert refusals[0] == 2 and host.registrations == 1
        assert host.registration_error is None


async def test_misuse_is_refused_at_once_naming_what_is_wrong() -> None:
    async def unreachable() -> FakeConnection:
        raise ConnectionRefusedError("nobody there")

    for kw, error, what in [
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": "5"}, TypeError, "timeout"),
        ({"register_timeout": -5}, ValueError, "register_timeout"),
        ({"reconnect_delay": -1}, ValueError, "reconnect_delay"),
        ({"max_reconnect_delay": -1}, ValueError, "max_reconnect_delay"),
        ({"max_introductions": -3}, ValueError, "max_introductions"),
    ]:
        with pytest.raises(error, match=what):
            MatchmakerClient(unreachable, **kw)
    for port, error in [("27960", TypeError), (0, ValueError), (70000, ValueError)]:
        with pytest.raises(error, match="port"):
            MatchmakerClient.to("127.0.0.1", port)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="port"):
        MatchmakerClient.to([("127.0.0.1", "27960")])  # type: ignore[list-item]
    # The matchmaker cannot be reached: only a check of our own can fail these.
    async with MatchmakerClient(unreachable, register_timeout=60, issuer_keys=[b"k" * 32]) as c:
        for fields, what in [
            ({"max_players": -1}, "max_players"),
            ({"name": "x" * 5000}, "name"),
            ({"game": ""}, "game"),
            ({"players": 9}, "players"),
        ]:
            with pytest.raises(ValueError, match=what):
                await asyncio.wait_for(c.register(**{**HOST, **fields}), 5)
        with pytest.raises(ValueError, match="limit"):
            await asyncio.wait_for(c.list_servers(game="q3", limit=-1), 5)
        with pytest.raises(TypeError, match=r"ticket\(\) host"):
            await asyncio.wait_for(c.ticket("1.2.3.4:5"), 5)  # type: ignore[arg-type]


async def test_register_timeout_bounds_the_whole_call() -> None:
    never = asyncio.Event()

    async def silent() -> FakeConnection:
        await never.wait()  # an address where nothing answers the handshake
        raise AssertionError("unreachable")

    # Each connection attempt would wait 30 s: four of them, 120 s.
    host = MatchmakerClient([silent] * 4, timeout=30, register_timeout=0.2)
    async with host:
        with pytest.raises(MatchmakerUnreachable, match="no matchmaker took the registration"):
            await asyncio.wait_for(host.register(**HOST), 10)


class _Unreferenceable:
    """A game socket that cannot be weakly referenced, as the compiled rudp endpoint."""

    __slots__ = ("_port",)

    def __init__(self, port: Any) -> None:
        self._port = port

    def send_datagram(self, data: bytes, address: tuple[Any, ...]) -> None:
        self._port.send_datagram(data, address)

    def set_datagram_handler(self, first_byte: int, handler: Any) -> None:
        self._port.set_datagram_handler(first_byte, handler)


async def test_the_one_client_per_socket_rule_holds_for_a_socket_without_weak_references() -> None:
    board = Switchboard(Harness())
    port = _Unreferenceable(board.net.port((pub(1), 27960)))
    first = MatchmakerClient(board.connector(pub(1), 27960), datagrams=port)
    second = MatchmakerClient(board.connector(pub(1), 27960), datagrams=port)
    try:
        await asyncio.wait_for(first.register(**HOST), 5)
        with pytest.raises(RuntimeError, match="another MatchmakerClient"):
            await asyncio.wait_for(second.register(**HOST), 5)
        await first.unregister()
        await asyncio.wait_for(second.register(**HOST), 5)
        assert second.registrations == 1
    finally:
        await first.close()
        await second.close()


async def test_a_second_client_registering_through_the_same_socket_is_refused() -> None:
    board = Switchboard(Harness())
    async with client(board, pub(1)) as first, client(board, pub(1)) as second:
        await first.register(**HOST)
        with pytest.raises(RuntimeError, match="another MatchmakerClient"):
            await asyncio.wait_for(second.register(**HOST), 5)
        assert first.registrations == 1 and first.host_info is not None
        await first.unregister()  # the socket is free again
        await asyncio.wait_for(second.register(**HOST), 5)
        assert second.registrations == 1


async def test_a_request_timing_out_leaves_a_heartbeating_hosts_listing_alone() -> None:
    # A replica slow to answer one update() is given up for requests; the host's
    # listing lives on heartbeats, so it must not register again for that.
    from matchmaker.server import Matchmaker

    mm = Matchmaker(settings())
    await mm.start()
    game, _ = await accepting_endpoint()
    host = MatchmakerClient.to(*mm.udp_address, via=game, timeout=0.3, reconnect_delay=0.05)
    try:
        await asyncio.wait_for(host.register(**LISTED), 10)
        update = mm.service._update

        async def slow(session: Any, request: Any) -> None:
            await asyncio.sleep(0.6)
            await update(session, request)

        mm.service._update = slow  # type: ignore[method-assign]
        with pytest.raises(RequestTimeout):
            await host.update(players=1)
        await asyncio.sleep(1.0)  # a re-registration would have come by now
        assert host.registrations == 1 and host.host_info is not None
        assert host.registration_error is None
    finally:
        await host.close()
        await game.close()
        await mm.shutdown()


# -- what register() and requests say when they fail ------------------------------------------


class _SkippingSelector(selectors.DefaultSelector):  # type: ignore[valid-type,misc]
    """Never sleeps: with nothing ready, the loop's clock jumps to its next timer."""

    def __init__(self, loop: _VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> Any:
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.virtual_now += timeout
        return events


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: a minute of backoff runs at once, and
    every wait ends exactly when it is due (in-memory connections only)."""

    def __init__(self) -> None:
        self.virtual_now = 0.0
        super().__init__(selector=_SkippingSelector(self))

    def time(self) -> float:
        return self.virtual_now


def in_virtual_time(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with asyncio.Runner(loop_factory=_VirtualTimeLoop) as runner:
        return runner.run(main())


def test_register_retries_for_all_of_register_timeout_and_says_how_long_it_took() -> None:
    # A closed port: no handshake is ever answered. Each attempt waits `timeout`
    # (5 s), then backs off 0.5, 1, 2, 4, 8 s; the next backoff (16 s) would end past
    # the 60 s deadline, so it is cut to leave the last attempt its full 5 s.
    attempts: list[float] = []

    async def main() -> MatchmakerUnreachable:
        loop = asyncio.get_running_loop()

        async def closed_port() -> FakeConnection:
            attempts.append(loop.time())
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async with MatchmakerClient(closed_port) as host:
            with pytest.raises(MatchmakerUnreachable) as caught:
                await host.register(**HOST)
            assert loop.time() == 60.0
            return caught.value

    error = in_virtual_time(main)
    assert attempts == [0.0, 5.5, 11.5, 18.5, 27.5, 40.5, 55.0]
    assert error.seconds == 60.0
    assert str(error) == (
        "no matchmaker took the registration in 60.0 s "
        "(tried replica 1 (TimeoutError: no connection within 5 s))"
    )


def test_the_last_register_attempt_always_gets_a_full_timeout() -> None:
    # register_timeout 30 s: after the attempt at 18.5 s the 8 s backoff would leave
    # the next one 1.5 s, not 5: it starts at 25 s instead (it used to start at 27.5 s
    # with 2.5 s left).
    attempts: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def closed_port() -> FakeConnection:
            attempts.append(loop.time())
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async with MatchmakerClient(closed_port, register_timeout=30.0) as host:
            with pytest.raises(MatchmakerUnreachable):
                await host.register(**HOST)
            assert loop.time() == 30.0

    in_virtual_time(main)
    assert attempts == [0.0, 5.5, 11.5, 18.5, 25.0]


def refusing_connector(ip: str, reply: Callable[[int], bytes]) -> Any:
    """A replica that answers every request with `reply(request id)`."""

    async def connect() -> FakeConnection:
        server_side, client_side = pipe((ip, 27960))

        async def answer() -> None:
            async for received in server_side:
                request = decode(received.data)
                server_side.send(reply(request.request_id))

        tasks.add(asyncio.create_task(answer()))
        return client_side

    tasks: set[asyncio.Task[None]] = set()
    return connect


def unknown_type(rid: int) -> bytes:
    return bytes(msgpack.packb({"v": PROTOCOL_VERSION, "t": 99, "id": rid}))


def too_large(rid: int) -> bytes:
    return bytes(msgpack.packb({"v": PROTOCOL_VERSION, "t": 99, "id": rid, "x": "y" * 5000}))


def test_a_reply_the_client_refuses_fails_its_request_at_once_naming_why() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with MatchmakerClient(refusing_connector(pub(2), unknown_type)) as browser:
            with pytest.raises(ReplyRefused) as caught:
                await browser.info()
            assert loop.time() == 0.0  # not after the client's timeout
            assert str(caught.value) == (
                "matchmaker replica 1 answered with a reply the client refused: unknown_type: 99"
            )
            with pytest.raises(ReplyRefused, match="unknown_type"):
                await browser.list_servers(game="q3")

    in_virtual_time(main)


def test_a_reply_whose_id_cannot_be_read_is_named_when_its_request_times_out() -> None:
    async def main() -> None:
        async with MatchmakerClient(refusing_connector(pub(2), too_large)) as browser:
            with pytest.raises(ReplyRefused) as caught:
                await browser.info()
            assert "did not answer" not in str(caught.value)
            assert caught.value.detail.startswith("too_large: ")
            assert "limits" in caught.value.detail

    in_virtual_time(main)


def test_quick_failures_are_retried_at_once_until_register_timeout_even_near_it() -> None:
    # register_timeout below timeout: every failure is within a timeout of the
    # deadline. Failures that move on at once (a replica refusing at once) are
    # retried at once, not given up after two.
    attempts: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        good = Harness()
        serving: set[asyncio.Task[None]] = set()

        async def refuses_twice_then_answers() -> FakeConnection:
            attempts.append(loop.time())
            if len(attempts) <= 3:
                raise ConnectionRefusedError("shutting down")
            server_side, client_side = pipe((pub(1), 27960))
            serving.add(asyncio.create_task(good.service.handle(server_side)))
            return client_side

        async with MatchmakerClient(
            refuses_twice_then_answers, register_timeout=4.0, timeout=5.0
        ) as host:
            await host.register(**HOST)

    in_virtual_time(main)
    assert len(attempts) == 4


def test_a_request_never_answered_times_out_even_if_another_reply_was_refused() -> None:
    # Only the first request is answered, with a reply the client refuses (its id
    # readable: that request fails at once). The second is never answered: a timeout,
    # not a refusal it never got.
    tasks: set[asyncio.Task[None]] = set()

    async def connect() -> FakeConnection:
        server_side, client_side = pipe((pub(2), 27960))

        async def answer_the_first() -> None:
            async for received in server_side:
                server_side.send(unknown_type(decode(received.data).request_id))
                break
            await asyncio.Event().wait()  # the rest: silence

        tasks.add(asyncio.create_task(answer_the_first()))
        return client_side

    async def main() -> None:
        async with MatchmakerClient(connect) as browser:
            first = asyncio.ensure_future(browser.info())
            second = asyncio.ensure_future(browser.info())
            with pytest.raises(ReplyRefused):
                await first
            with pytest.raises(RequestTimeout):
                await second

    in_virtual_time(main)


def test_register_names_a_refused_reply_as_its_last_cause_not_silence() -> None:
    async def main() -> MatchmakerUnreachable:
        connect = refusing_connector(pub(1), too_large)
        async with MatchmakerClient(connect, register_timeout=20) as host:
            with pytest.raises(MatchmakerUnreachable) as caught:
                await host.register(**HOST)
            return caught.value

    error = in_virtual_time(main)
    assert "did not answer" not in str(error)
    assert "replica 1 (ReplyRefused: matchmaker replica 1 answered with a reply the client" in str(
        error
    )
