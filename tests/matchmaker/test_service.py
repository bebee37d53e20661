"""The service over the in-memory fake transport, on a stepped clock."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import structlog

from matchmaker.addresses import Address, source_key
from matchmaker.logging import CONNECTION, merge_connection
from matchmaker.messages import (
    Error,
    ErrorReason,
    Heartbeat,
    HostEntry,
    HostInfo,
    HostUpdate,
    InfoReply,
    InfoRequest,
    Introduce,
    Introduction,
    ListFilter,
    ListPage,
    ListRequest,
    Message,
    Ok,
    Register,
    Registered,
    Role,
    Unregister,
    Update,
    WrongVersion,
    encode,
    encode_entry,
)
from matchmaker.registry import HostRecord, Notice, RegistryUnavailable, RemovalReason
from rudp.tokens import Issuer, decode_token, generate_issuer_key
from tests.matchmaker.fakes import Wire, pipe, settle
from tests.matchmaker.helpers import NONCE, Harness, collect_list, info, pub


async def error_of(wire: Wire, msg: Message) -> Error:
    reply = await wire.request(msg)
    assert isinstance(reply, Error), reply
    return reply


# ------------------------------------------------------------------ registration


async def test_register_replies_with_observed_address() -> None:
    h = Harness()
    wire = h.connect(pub(1), 4000)
    reply = await wire.request(Register(request_id=7, host=info(lan=Address("10.0.0.5", 4000))))
    assert isinstance(reply, Registered)
    record = h.registry.get(Address(pub(1), 4000))
    assert record is not None
    assert reply == Registered(
        request_id=7,
        address=Address(pub(1), 4000),
        keepalive=5.0,
        secret=h.service.liveness.secret(record),
    )
    assert len(reply.secret) == 32
    rec = h.registry.get(Address(pub(1), 4000))
    assert rec is not None and rec.info.lan == Address("10.0.0.5", 4000)
    assert h.sample("matchmaker_registrations_total", result="created") == 1
    await wire.request(Register(request_id=8, host=info("renamed")))
    assert h.sample("matchmaker_registrations_total", result="replaced") == 1


async def test_bad_messages_get_reasons_and_the_connection_survives() -> None:
    h = Harness()
    wire = h.connect(pub(1))
    wire.send_raw(b"\xc1garbage")
    assert (await wire.recv()) == Error(reason=ErrorReason.MALFORMED, detail="FormatError")
    wire.send_raw(msgpack.packb({"v": 1, "t": 8, "id": 3, "name": "x"}))
    reply = await wire.recv()
    assert isinstance(reply, Error) and reply.request_id == 3
    assert reply.reason is ErrorReason.MISSING_FIELD
    wire.send_raw(msgpack.packb({"v": 2, "t": 8, "id": 4}))
    assert await wire.recv() == WrongVersion(request_id=4)
    assert (await error_of(wire, Ok(request_id=5))).reason is ErrorReason.NOT_A_REQUEST
    wire.send_raw(b"x" * 5000)
    assert (await wire.recv()).reason is ErrorReason.TOO_LARGE  # type: ignore[union-attr]
    assert isinstance(await wire.request(Register(host=info())), Registered)
    assert h.sample("matchmaker_dropped_datagrams_total", reason="malformed") == 1
    assert h.sample("matchmaker_dropped_datagrams_total", reason="wrong_version") == 1


@pytest.mark.parametrize("ip", ["127.0.0.1", "10.1.1.1", "169.254.3.3", "::1", "100.64.0.9"])
async def test_non_public_addresses_are_refused_unless_allowed(ip: str) -> None:
    wire = Harness().connect(ip)
    err = await error_of(wire, Register(request_id=2, host=info()))
    assert (err.reason, err.request_id) == (ErrorReason.FORBIDDEN_ADDRESS, 2)
    lan = Harness(allow_private=True).connect(ip)
    assert isinstance(await lan.request(Register(host=info())), Registered)


async def test_per_ip_host_cap() -> None:
    h = Harness(max_hosts_per_ip=2)
    await h.host(pub(1), 1)
    await h.host(pub(1), 2)
    third = h.connect(pub(1), 3)
    assert (await error_of(third, Register(host=info()))).reason is ErrorReason.TOO_MANY_HOSTS
    await h.host(pub(2), 3)


async def test_registration_rate_limit_per_source() -> None:
    h = Harness(register_rate=1.0, register_burst=2.0)
    wire = await h.host(pub(1))
    assert isinstance(await wire.request(Update(changes=HostUpdate(players=1))), Ok)
    err = await error_of(wire, Update(request_id=5, changes=HostUpdate(players=2)))
    assert (err.reason, err.request_id) == (ErrorReason.RATE_LIMITED, 5)
    other = h.connect(pub(2))  # another source has its own bucket
    assert isinstance(await other.request(Register(host=info())), Registered)
    h.clock.advance(1.0)
    assert isinstance(await wire.request(Update(changes=HostUpdate(players=2))), Ok)
    assert h.sample("matchmaker_rate_limited_requests_total", kind="register") == 1


async def test_update_and_unregister() -> None:
    h = Harness()
    wire = h.connect(pub(1))
    err = await error_of(wire, Update(changes=HostUpdate(players=1)))
    assert err.reason is ErrorReason.NOT_REGISTERED
    await wire.request(Register(host=info(max_players=4)))
    assert isinstance(await wire.request(Update(changes=HostUpdate(players=3, map="dm6"))), Ok)
    rec = h.registry.get(Address(pub(1), 27960))
    assert rec is not None and (rec.info.players, rec.info.map) == (3, "dm6")
    err = await error_of(wire, Update(changes=HostUpdate(max_players=2)))
    assert err.reason is ErrorReason.BAD_FIELD
    assert await wire.request(Unregister(request_id=4)) == Ok(request_id=4)
    assert h.registry.get(Address(pub(1), 27960)) is None
    assert h.sample("matchmaker_removals_total", reason="unregistered") == 1
    assert await wire.request(Unregister(request_id=5)) == Ok(request_id=5)  # idempotent


async def test_the_end_of_the_connection_keeps_the_entry_until_it_expires() -> None:
    # A listed host holds no connection: it heartbeats with datagrams.
    h = Harness()
    wire = await h.host(pub(1))
    await wire.close()
    assert h.service.connections == 0
    assert h.registry.get(Address(pub(1), 27960)) is not None
    assert h.sample("matchmaker_removals_total", reason="disconnected") == 0
    h.clock.advance(h.settings.expire_after + 1)
    await h.service.expire()
    assert h.registry.get(Address(pub(1), 27960)) is None
    assert h.sample("matchmaker_removals_total", reason="expired") == 1


async def test_update_and_unregister_over_a_later_connection() -> None:
    h = Harness()
    first = await h.host(pub(1), name="old")
    await first.close()
    later = h.connect(pub(1))  # same observed address, a new connection
    assert await later.request(Update(request_id=2, changes=HostUpdate(name="new"))) == Ok(
        request_id=2
    )
    rec = h.registry.get(Address(pub(1), 27960))
    assert rec is not None and rec.info.name == "new"
    assert await later.request(Unregister(request_id=3)) == Ok(request_id=3)
    assert h.registry.get(Address(pub(1), 27960)) is None
    assert h.sample("matchmaker_removals_total", reason="unregistered") == 1
    other = h.connect(pub(2))  # another address cannot touch it
    reply = await other.request(Update(request_id=4, changes=HostUpdate(name="x")))
    assert isinstance(reply, Error) and reply.reason is ErrorReason.NOT_REGISTERED


async def test_restarted_host_replaces_its_entry() -> None:
    h = Harness()
    old = await h.host(pub(1), name="old")
    new = await h.host(pub(1), name="new")  # same address: the host restarted
    await old.close()
    rec = h.registry.get(Address(pub(1), 27960))
    assert rec is not None and rec.info.name == "new"
    assert h.sample("matchmaker_registrations_total", result="replaced") == 1
    assert await new.request(Unregister(request_id=5)) == Ok(request_id=5)
    assert h.registry.get(Address(pub(1), 27960)) is None


# ------------------------------------------------------------------ liveness


async def test_heartbeats_keep_hosts_listed() -> None:
    h = Harness()
    alive = await h.host(pub(1))
    await h.host(pub(2))
    for _ in range(4):
        h.clock.advance(5)
        alive.send(Heartbeat())
        await settle()
        await h.service.flush_heartbeats()
        await h.service.expire()
    listed = [r.address.ip for r in await h.registry.query(ListFilter(game="q3"))]
    assert listed == [pub(1)]  # pub(2) went silent 20 s ago: hidden
    h.clock.advance(11)
    await h.service.expire()
    assert h.registry.get(Address(pub(2), 27960)) is None
    assert h.sample("matchmaker_removals_total", reason="expired") == 1


async def test_heartbeat_for_an_expired_host_asks_it_to_register() -> None:
    h = Harness()
    wire = await h.host(pub(1))
    h.clock.advance(31)
    await h.service.expire()
    err = await error_of(wire, Heartbeat(request_id=3))
    assert (err.reason, err.request_id) == (ErrorReason.NOT_REGISTERED, 3)


async def test_flush_reports_hosts_the_registry_lost() -> None:
    h = Harness()
    wire = await h.host(pub(1))
    wire.send(Heartbeat())
    await settle()
    rec = h.registry.get(Address(pub(1), 27960))
    assert rec is not None
    await h.registry.remove(rec.address, RemovalReason.EXPIRED)  # e.g. by another replica
    await h.service.flush_heartbeats()
    err = await wire.recv()
    assert isinstance(err, Error) and err.reason is ErrorReason.NOT_REGISTERED


# ------------------------------------------------------------------ lists


async def test_list_pages_total_end_marker_and_per_ip_cap() -> None:
    h = Harness(page_hosts=16, page_per_ip=2, max_hosts_per_ip=10)
    for i in range(200):
        await h.registry.upsert(
            Address(pub(i // 10 + 1), 20000 + i), info(f"h{i}", players=i % 9 % 8), max_per_ip=10
        )
    client = h.connect(pub(250))
    pages = await collect_list(client)
    assert [p.seq for p in pages] == list(range(len(pages)))
    assert all(p.total == 200 and p.request_id == 9 for p in pages)
    assert [p.end for p in pages].count(True) == 1
    hosts = [e.address for p in pages for e in p.hosts]
    assert len(hosts) == len(set(hosts)) == 200
    for page in pages:
        assert len(page.hosts) <= 16
        per_ip: dict[str, int] = {}
        for e in page.hosts:
            per_ip[e.address.ip] = per_ip.get(e.address.ip, 0) + 1
        assert max(per_ip.values()) <= 2
        assert len(encode(page)) <= h.settings.page_bytes
        assert all(e.info.lan is None for e in page.hosts)
    # Filters and limit.
    pages = await collect_list(client, not_empty=True, limit=50)
    assert sum(len(p.hosts) for p in pages) == pages[0].total == 50
    assert all(e.info.players > 0 for p in pages for e in p.hosts)
    assert h.sample("matchmaker_list_requests_total", result="ok") == 2
    assert h.sample("matchmaker_list_request_duration_seconds_count") == 2


async def test_empty_list_is_one_end_page() -> None:
    pages = await collect_list(Harness().connect(pub(1)))
    assert pages == [ListPage(request_id=9, seq=0, total=0, end=True, hosts=())]


async def test_at_most_pages_in_flight_unacknowledged() -> None:
    h = Harness(page_hosts=1, pages_in_flight=3)
    for i in range(10):
        await h.registry.upsert(Address(pub(i + 1), 1), info(), max_per_ip=10)
    client = h.connect(pub(100))
    server_side = client.conn.other
    assert server_side is not None
    server_side.manual_acks = True
    client.send(ListRequest(filter=ListFilter(game="q3")))
    await settle()
    assert client.pending() == 3  # the window is full
    server_side.unacked.pop(0).set_result(None)
    await settle()
    assert client.pending() == 4
    while server_side.unacked:
        server_side.unacked.pop(0).set_result(None)
        await settle()
    assert client.pending() == 10


async def test_list_window_moves_on_any_ack_not_only_the_oldest() -> None:
    # A lost page (the oldest, unacked while rudp resends it) must not stall
    # the pages behind it.
    h = Harness(page_hosts=1, pages_in_flight=3)
    for i in range(6):
        await h.registry.upsert(Address(pub(i + 1), 1), info(), max_per_ip=10)
    client = h.connect(pub(100))
    server_side = client.conn.other
    assert server_side is not None
    server_side.manual_acks = True
    client.send(ListRequest(filter=ListFilter(game="q3")))
    await settle()
    assert client.pending() == 3
    oldest = server_side.unacked.pop(0)
    server_side.unacked.pop(0).set_result(None)  # page 1 acked, page 0 still out
    await settle()
    assert client.pending() == 4
    oldest.set_result(None)
    while server_side.unacked:
        server_side.unacked.pop(0).set_result(None)
        await settle()
    assert client.pending() == 6


async def test_list_shows_updated_info() -> None:
    # List entries are encoded once per host and cached: an update must show.
    h = Harness()
    host = await h.host(pub(1))
    client = h.connect(pub(2))
    assert (await collect_list(client))[0].hosts[0].info.players == 0
    assert isinstance(await host.request(Update(changes=HostUpdate(players=5))), Ok)
    assert (await collect_list(client))[0].hosts[0].info.players == 5


async def test_list_abandoned_when_connection_ends() -> None:
    h = Harness(page_hosts=1, pages_in_flight=1)
    for i in range(5):
        await h.registry.upsert(Address(pub(i + 1), 1), info(), max_per_ip=10)
    client = h.connect(pub(100))
    server_side = client.conn.other
    assert server_side is not None
    server_side.manual_acks = True
    client.send(ListRequest(filter=ListFilter(game="q3")))
    await settle()
    await client.close()
    await settle()
    assert h.sample("matchmaker_list_requests_total", result="failed") == 1


async def test_list_rate_limit() -> None:
    h = Harness(list_rate=1.0, list_burst=1.0)
    client = h.connect(pub(1))
    await collect_list(client)
    err = await error_of(client, ListRequest(request_id=4, filter=ListFilter(game="q3")))
    assert (err.reason, err.request_id) == (ErrorReason.RATE_LIMITED, 4)
    assert h.sample("matchmaker_list_requests_total", result="rate_limited") == 1


async def test_hidden_hosts_are_not_listed() -> None:
    h = Harness()
    await h.host(pub(1))
    h.clock.advance(16)
    assert (await collect_list(h.connect(pub(2))))[0].total == 0


# ------------------------------------------------------------------ introductions


async def test_introduction_sends_both_sides_the_other_address() -> None:
    h = Harness()
    host = await h.host(pub(1), lan=Address("192.168.0.10", 27960))
    client = h.connect(pub(2), 5555)
    reply = await client.request(
        Introduce(request_id=3, host=Address(pub(1), 27960), lan=Address("10.9.9.9", 1))
    )
    assert reply == Introduction(
        request_id=3, role=Role.CLIENT, peer=Address(pub(1), 27960), nonce=NONCE
    )
    assert await host.recv() == Introduction(
        role=Role.HOST, peer=Address(pub(2), 5555), nonce=NONCE
    )
    assert h.sample("matchmaker_introductions_total", result="local") == 1


async def test_introduction_goes_by_datagram_when_the_hosts_connection_just_ended() -> None:
    h = Harness()
    host = await h.host(pub(1))
    server_side = host.conn.other
    assert server_side is not None
    server_side.fail_sends = True  # the host released this connection a moment ago
    client = h.connect(pub(2), 5555)
    reply = await client.request(Introduce(request_id=3, host=Address(pub(1), 27960)))
    assert isinstance(reply, Introduction) and reply.role is Role.CLIENT
    assert h.service.liveness.pending == 1  # sent to the heartbeat address, resent until acked


async def test_introduction_behind_the_same_nat_includes_lan_addresses() -> None:
    h = Harness()
    host = await h.host(pub(1), lan=Address("192.168.0.10", 27960))
    client = h.connect(pub(1), 5555)  # same public IP
    reply = await client.request(
        Introduce(host=Address(pub(1), 27960), lan=Address("192.168.0.11", 5555))
    )
    assert isinstance(reply, Introduction)
    assert reply.peer_lan == Address("192.168.0.10", 27960)
    to_host = await host.recv()
    assert isinstance(to_host, Introduction) and to_host.peer_lan == Address("192.168.0.11", 5555)


@pytest.mark.parametrize(
    ("lan", "why"),
    [
        (Address("198.51.200.7", 27960), "global"),  # a third party on the Internet
        (Address("127.0.0.99", 27960), "loopback"),  # the client's own machine
        (Address("224.0.0.1", 27960), "not_private"),
    ],
)
async def test_a_lan_address_that_is_not_private_is_refused(lan: Address, why: str) -> None:
    """Only a client behind the host's public IP is given the host's LAN address and
    connects to it: one that is not private would aim those clients elsewhere."""
    h = Harness()
    wire = h.connect(pub(1), 4000)
    err = await error_of(wire, Register(request_id=4, host=info(lan=lan)))
    assert (err.reason, err.request_id) == (ErrorReason.BAD_FIELD, 4)
    assert err.detail == f"lan: not a private address ({why})"
    assert h.registry.get(Address(pub(1), 4000)) is None
    assert h.sample("matchmaker_registrations_total", result="rejected") == 1
    # Nor from a client, whose LAN address the host is given.
    host = await h.host(pub(1), lan=Address("192.168.0.10", 27960))
    client = h.connect(pub(1), 5555)
    err = await error_of(client, Introduce(request_id=5, host=Address(pub(1), 27960), lan=lan))
    assert (err.reason, err.request_id) == (ErrorReason.BAD_FIELD, 5)
    assert h.sample("matchmaker_introductions_total", result="local") == 0
    assert host.conn.inbox.empty()


async def test_a_lan_address_that_is_the_peers_own_public_ip_is_taken() -> None:
    """A host with a public IP of its own (a VPS) may name it as its LAN address: only
    a client behind that very address is given it, so it aims nobody elsewhere."""
    h = Harness()
    own = Address(pub(1), 9999)
    await h.host(pub(1), lan=own)
    assert h.registry.get(Address(pub(1), 27960)) is not None
    client = h.connect(pub(1), 5555)
    reply = await client.request(Introduce(request_id=5, host=Address(pub(1), 27960), lan=own))
    assert isinstance(reply, Introduction) and reply.peer_lan == own


async def test_a_lan_address_of_another_family_than_the_clients_is_not_given() -> None:
    """An IPv4 client's socket cannot reach an IPv6 LAN address (its connect would fail
    at once): it is given the host's public address only."""
    h = Harness()
    await h.host(pub(1), lan=Address("fd00::5", 27960))
    client = h.connect(pub(1), 5555)
    reply = await client.request(Introduce(request_id=5, host=Address(pub(1), 27960)))
    assert isinstance(reply, Introduction) and reply.peer_lan is None


async def test_loopback_lan_addresses_only_for_hosts_on_loopback() -> None:
    """A daemon that allows private hosts takes a loopback LAN address from a host it
    sees at a loopback address: any client behind that address shares its machine."""
    h = Harness(allow_private=True)
    host = await h.host("127.0.0.1", 4000, lan=Address("127.0.0.1", 4000))
    client = h.connect("127.0.0.1", 5555)
    reply = await client.request(
        Introduce(host=Address("127.0.0.1", 4000), lan=Address("127.0.0.1", 5555))
    )
    assert isinstance(reply, Introduction) and reply.peer_lan == Address("127.0.0.1", 4000)
    to_host = await host.recv()
    assert isinstance(to_host, Introduction) and to_host.peer_lan == Address("127.0.0.1", 5555)
    err = await error_of(h.connect("10.0.0.8"), Register(host=info(lan=Address("127.0.0.1", 1))))
    assert err.detail == "lan: not a private address (loopback)"


async def test_a_stored_lan_address_that_is_not_private_is_never_handed_out() -> None:
    """An entry written before LAN addresses were checked (a shared registry keeps
    it): its LAN address goes neither to the client nor into the token."""
    issuer = Issuer(generate_issuer_key())
    h = Harness(issuer=issuer)
    address = Address(pub(1), 27960)
    await h.registry.upsert(
        address, info(lan=Address("198.51.200.7", 27960), key=b"k" * 32), max_per_ip=16
    )
    client = h.connect(pub(1), 5555)  # behind the host's public IP
    reply = await client.request(Introduce(host=address, client_key=b"c" * 32))
    assert isinstance(reply, Introduction) and reply.peer_lan is None
    assert reply.token is not None
    assert decode_token(reply.token).addresses == ((pub(1), 27960),)


async def test_introduction_to_unknown_or_hidden_host() -> None:
    h = Harness()
    await h.host(pub(1))
    client = h.connect(pub(2))
    err = await error_of(client, Introduce(request_id=2, host=Address(pub(9), 1)))
    assert (err.reason, err.request_id) == (ErrorReason.NOT_FOUND, 2)
    h.clock.advance(16)
    err = await error_of(client, Introduce(host=Address(pub(1), 27960)))
    assert err.reason is ErrorReason.NOT_FOUND
    assert h.sample("matchmaker_introductions_total", result="not_found") == 2


async def test_introduction_rate_limit() -> None:
    h = Harness(introduce_rate=1.0, introduce_burst=1.0)
    await h.host(pub(1))
    client = h.connect(pub(2))
    assert isinstance(await client.request(Introduce(host=Address(pub(1), 27960))), Introduction)
    err = await error_of(client, Introduce(host=Address(pub(1), 27960)))
    assert err.reason is ErrorReason.RATE_LIMITED


# ------------------------------------------------------------------ the rest


async def test_info_connected_and_unconnected() -> None:
    h = Harness()
    await h.host(pub(1))
    wire = h.connect(pub(2))
    reply = await wire.request(InfoRequest(request_id=5))
    assert isinstance(reply, InfoReply) and (reply.request_id, reply.hosts) == (5, 1)
    answer = h.service.answer_query(encode(InfoRequest(request_id=6)), (pub(3), 1))
    assert answer is not None and b"matchmaker/" in answer
    assert h.service.answer_query(b"junk", (pub(3), 1)) is None
    assert h.service.answer_query(encode(Heartbeat()), (pub(3), 1)) is None


async def test_every_unanswered_query_is_counted_by_reason() -> None:
    h = Harness()
    queries = [
        (b"junk", "malformed"),
        (encode(Ok(request_id=1)), "not_a_request"),
        # Valid requests, but only an InfoRequest is answered unconnected.
        (encode(Heartbeat()), "unknown_type"),
        (encode(Register(host=info())), "unknown_type"),
        (encode(ListRequest(filter=ListFilter(game="q3"))), "unknown_type"),
    ]
    for payload, reason in queries:
        before = h.sample("matchmaker_dropped_datagrams_total", reason=reason)
        assert h.service.answer_query(payload, (pub(3), 1)) is None
        assert h.sample("matchmaker_dropped_datagrams_total", reason=reason) == before + 1
    assert len(h.registry.index()) == 0  # an unconnected Register registers nothing


async def test_a_handler_bug_costs_one_request_not_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness()
    wire = h.connect(pub(1))

    def broken(address: Address) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(h.registry, "get", broken)
    err = await error_of(wire, Introduce(request_id=8, host=Address(pub(2), 1)))
    assert (err.reason, err.request_id) == (ErrorReason.INTERNAL, 8)
    monkeypatch.undo()
    assert isinstance(await wire.request(InfoRequest()), InfoReply)


async def test_send_failure_closes_the_connection() -> None:
    h = Harness()
    wire = h.connect(pub(1))
    server_side = wire.conn.other
    assert server_side is not None
    server_side.fail_sends = True
    wire.send(InfoRequest())
    await asyncio.wait_for(wire.task, 2)
    assert h.sample("matchmaker_dropped_datagrams_total", reason="send_failed") == 1


async def test_shutdown_closes_connections_but_keeps_registrations() -> None:
    h = Harness()
    wire = await h.host(pub(1))
    await h.service.close_all()
    await asyncio.wait_for(wire.task, 2)
    assert h.registry.get(Address(pub(1), 27960)) is not None


async def test_log_events_carry_connection_context() -> None:
    h = Harness()
    with structlog.testing.capture_logs(processors=[merge_connection]) as logs:
        wire = await h.host(pub(1))
        wire.send_raw(b"\xc1")
        await wire.recv()
        await wire.request(Unregister(request_id=3))
        await wire.close()
    by_event = {e["event"]: e for e in logs}
    for event in ("host_registered", "request_rejected", "host_removed"):
        assert by_event[event]["peer"] == f"{pub(1)}:27960", event
        assert "conn" in by_event[event]
    assert by_event["host_removed"]["reason"] == "unregistered"
    assert by_event["request_rejected"]["reason"] == "malformed"


async def test_a_registration_keeps_the_list_entry_it_checked() -> None:
    # Encoded once, to check it fits a page; lists send those very bytes.
    h = Harness()
    await h.host(pub(1))
    record = h.registry.get(Address(pub(1), 27960))
    assert record is not None
    assert record.entry == encode_entry(HostEntry(address=record.address, info=record.info))
    assert record.source == source_key(pub(1))
    pages = await collect_list(h.connect(pub(2)))
    assert [e.address for p in pages for e in p.hosts] == [record.address]


async def test_an_update_keeps_the_list_entry_it_checked() -> None:
    h = Harness()
    wire = await h.host(pub(1))
    assert isinstance(await wire.request(Update(changes=HostUpdate(players=3))), Ok)
    record = h.registry.get(Address(pub(1), 27960))
    assert record is not None and record.info.players == 3
    assert record.entry == encode_entry(HostEntry(address=record.address, info=record.info))


async def test_a_connection_served_in_the_callers_task_leaves_its_log_context_behind() -> None:
    # rudp runs each handler in a task of its own; called directly, the handler's
    # peer and conn must not stay bound to the caller's later log lines.
    h = Harness()
    server_side, client_side = pipe((pub(1), 27960))
    client_side.abort()  # the peer is gone: the handler returns at once
    await h.service.handle(server_side)
    assert CONNECTION.get() is None


async def test_a_host_too_large_for_one_list_page_is_refused() -> None:
    # Each field within its cap, all of them together more than a datagram.
    h = Harness()
    huge = info(
        "é" * 64,
        map="é" * 64,
        tags=tuple(f"{i:02d}" + "t" * 30 for i in range(16)),
        info=b"i" * 512,
    )
    wire = h.connect(pub(1))
    err = await error_of(wire, Register(host=huge))
    assert (err.reason, err.detail.startswith("host: too large")) == (ErrorReason.BAD_FIELD, True)
    assert h.sample("matchmaker_registrations_total", result="rejected") == 1
    await wire.request(Register(host=info()))
    err = await error_of(wire, Update(changes=HostUpdate(info=b"i" * 512, tags=huge.tags)))
    assert err.reason is ErrorReason.BAD_FIELD
    assert h.sample("matchmaker_updates_total", result="rejected") == 1
    # What is listed still fits one page.
    pages = await collect_list(h.connect(pub(2)))
    assert all(len(encode(p)) <= h.settings.page_bytes for p in pages)


async def test_a_failing_sweep_does_not_end_the_sweeper(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(sweep_interval=0.01)
    calls: list[int] = []

    async def broken() -> list[Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("e.g. an unexpected Redis error reply")
        return []

    monkeypatch.setattr(h.registry, "expire", broken)
    sweeper = asyncio.create_task(h.service.run_sweeper())
    try:
        for _ in range(200):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        assert not sweeper.done() and len(calls) >= 3
    finally:
        sweeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweeper


async def test_the_background_loops_end_by_themselves_once_stopped() -> None:
    """Not only by cancellation, which redis-py can swallow (`matchmaker.stopping`)."""
    h = Harness(sweep_interval=0.01)
    service = h.service
    runs = [service.run_sweeper, service.run_takeovers, service.run_introductions]
    tasks = [asyncio.create_task(run()) for run in [*runs, service.run_notices]]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in tasks)
    service.stop_loops()
    # The notices loop waits for the next notice: one comes, for nobody here.
    await h.registry.deliver(h.registry.replica_id, Notice(Address(pub(9), 1), b"x"))
    done, pending = await asyncio.wait(tasks, timeout=10)
    for task in pending:
        task.cancel()
    assert not pending, [t.get_coro() for t in pending]
    assert [t.result() for t in done] == [None] * 4


async def test_requests_follow_a_migrated_connection() -> None:
    h = Harness()
    wire = h.connect(pub(1), 4000)
    assert isinstance(await wire.request(Register(host=info())), Registered)
    # The connection moves (a NAT rebinding): the server side's peer address follows.
    assert wire.conn.other is not None
    wire.conn.other.remote_address = (pub(1), 5000)
    assert isinstance(await wire.request(Register(request_id=2, host=info("moved"))), Registered)
    moved = h.registry.get(Address(pub(1), 5000))
    assert moved is not None and moved.info.name == "moved"
    assert isinstance(await wire.request(Update(changes=HostUpdate(players=2))), Ok)
    moved = h.registry.get(Address(pub(1), 5000))
    assert moved is not None and moved.info.players == 2
    assert h.service.connections == 1
    await wire.close()
    assert h.service.connections == 0


async def test_relayed_notices_dropped_are_counted_and_a_bug_does_not_end_relaying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness()
    reg = h.registry
    relay = asyncio.create_task(h.service.run_notices())
    await asyncio.sleep(0)

    def dropped(reason: str) -> float:
        return h.sample("matchmaker_notices_dropped_total", reason=reason)

    try:
        assert [dropped(r) for r in ("queue_full", "host_gone", "forward_failed")] == [0] * 3
        there = Address(pub(2), 1)
        # A host that moved to another replica meanwhile.
        moved = HostRecord(
            address=there, info=info(), owner="elsewhere", token="t", registered_at=0, last_seen=0
        )
        calls: list[Address] = []

        def get_failing_once(address: Address) -> HostRecord | None:
            calls.append(address)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return moved if address == there else None

        monkeypatch.setattr(reg, "get", get_failing_once)
        reg._receive_notice(Notice(Address(pub(8), 1), b"bug"))
        # For a host no longer here.
        reg._receive_notice(Notice(Address(pub(9), 1), b"gone"))
        for _ in range(100):
            if dropped("host_gone"):
                break
            await asyncio.sleep(0.01)
        assert dropped("host_gone") == 1 and not relay.done()

        # For a host that moved to a replica out of reach.
        async def unreachable(owner: str, notice: Notice) -> None:
            raise RegistryUnavailable("publish")

        monkeypatch.setattr(reg, "deliver", unreachable)
        reg._receive_notice(Notice(there, b"moved"))
        for _ in range(100):
            if dropped("forward_failed"):
                break
            await asyncio.sleep(0.01)
        assert dropped("forward_failed") == 1 and not relay.done()
    finally:
        relay.cancel()
        with pytest.raises(asyncio.CancelledError):
            await relay
    # More than the queue holds, at once.
    for i in range(10_001):
        reg._receive_notice(Notice(Address(pub(9), 1), b"%d" % i))
    assert dropped("queue_full") == 1 and reg.notices_dropped == {"queue_full": 1}


def _entry_of_size(address: Address, size: int) -> HostInfo:
    """A host whose list entry at ``address`` encodes to exactly ``size`` bytes."""
    for pad in range(size):
        host = info("big", info=b"x" * pad)
        if len(encode_entry(HostEntry(address=address, info=host))) == size:
            return host
    raise AssertionError(f"no entry of {size} bytes")


async def test_a_host_is_listable_only_if_it_fits_a_page_of_a_partial_answer() -> None:
    # Entries up to page_bytes - 48 were taken, but the page of a partial answer also
    # carries its mark (9 bytes): such an entry went alone on a page over page_bytes.
    h = Harness(page_bytes=256, list_bytes_in_flight=256)
    a, b = Address(pub(1), 27960), Address(pub(2), 27960)
    err = await error_of(h.connect(pub(1)), Register(host=_entry_of_size(a, 256 - 48)))
    assert err.reason is ErrorReason.BAD_FIELD
    await h.connect(pub(2)).request(Register(host=_entry_of_size(b, 256 - 57)))


async def test_a_page_larger_than_the_list_budget_is_still_sent() -> None:
    # Such a page (an entry a replica with a larger --page-bytes let in, sharing the
    # registry) waited for a budget that could never hold it: the answer hung, with no
    # page out for list_ack_timeout to time.
    h = Harness(page_bytes=256, list_bytes_in_flight=256, max_hosts_per_ip=100)
    for i in range(6):
        address = Address(pub(1), 20000 + i)
        await h.registry.upsert(address, _entry_of_size(address, 400), max_per_ip=100)
    pages = await asyncio.wait_for(collect_list(h.connect(pub(9))), 5)
    assert sum(len(p.hosts) for p in pages) == 6
    assert max(len(encode(p)) for p in pages) > 256
    assert h.service.list_budget.free == 256
