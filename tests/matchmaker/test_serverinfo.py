"""GETSVINFO/SVINFO: the responder a game host embeds and the client's concurrent pinger."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import msgpack
import pytest

import rudp
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.messages import (
    PROTOCOL_VERSION,
    HostInfo,
    InfoRequest,
    ServerInfo,
    ServerQuery,
    WrongVersion,
    decode,
    encode,
)
from matchmaker.server import Matchmaker
from matchmaker.serverinfo import InfoResponder, query_servers, serve_info
from tests.matchmaker.helpers import HOST, settings

GAME = HostInfo(
    name="Friday night",
    game="q3",
    version="1.32c",
    max_players=16,
    players=3,
    map="q3dm17",
    tags=("ctf",),
    lan=Address("192.168.1.5", 27960),
    info=b"i" * 400,
)
ADDR = ("198.51.100.7", 27960)


def test_responder_answers_with_public_info_only() -> None:
    responder = InfoResponder(lambda: GAME)
    reply = responder(encode(ServerQuery(request_id=3, room=1100)), ADDR)
    assert reply is not None and len(reply) <= 1100
    msg = decode(reply)
    assert isinstance(msg, ServerInfo) and msg.request_id == 3
    assert msg.host.lan is None and msg.host.info == GAME.info and msg.host.players == 3
    assert responder.answered == 1


def test_responder_fits_the_reply_to_the_room_the_querier_padded_for() -> None:
    responder = InfoResponder(lambda: GAME)
    reply = responder(encode(ServerQuery(room=300)), ADDR)
    assert reply is not None and len(reply) <= 300
    msg = decode(reply)
    assert isinstance(msg, ServerInfo) and msg.host.info == b""  # the blob gave way
    assert responder(encode(ServerQuery(room=20)), ADDR) is None  # nothing fits: silence


def test_responder_stays_silent_or_delegates_for_anything_else() -> None:
    seen: list[bytes] = []

    def previous(payload: bytes, address: object) -> bytes | None:
        seen.append(payload)
        return b"lan"

    responder = InfoResponder(lambda: GAME, fallback=previous)
    assert responder(b"\xc1garbage", ADDR) == b"lan"
    assert responder(encode(InfoRequest()), ADDR) == b"lan"
    assert len(seen) == 2
    assert InfoResponder(lambda: GAME)(b"\xc1garbage", ADDR) is None
    assert InfoResponder(lambda: None)(encode(ServerQuery(room=1100)), ADDR) is None
    future = msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": 47, "id": 4, "room": 1100})
    assert decode(InfoResponder(lambda: GAME)(future, ADDR) or b"") == WrongVersion(request_id=4)


@pytest.fixture
async def client_endpoint() -> AsyncIterator[rudp.Server]:
    endpoint = await rudp.open_endpoint("127.0.0.1", 0)
    yield endpoint
    await endpoint.close()


async def test_query_servers_reports_info_and_ping_in_input_order(
    client_endpoint: rudp.Server,
) -> None:
    hosts = [await rudp.serve(lambda conn: conn.wait_closed(), "127.0.0.1", 0) for _ in range(3)]
    try:
        for i, host in enumerate(hosts[:2]):
            serve_info(host, HostInfo(name=f"h{i}", game="q3", version="1", max_players=8))
        # hosts[2] runs no responder; a closed port answers nothing either.
        silent = await rudp.open_endpoint("127.0.0.1", 0)
        dead = silent.address
        await silent.close()
        targets = [h.address for h in hosts] + [dead]
        # 3 s: a live host's answer is not "timeout" on a loaded machine either.
        statuses = await query_servers(client_endpoint, targets, timeout=3.0, concurrency=2)
        assert [s.address for s in statuses] == [Address(*t) for t in targets]
        assert [s.info.name if s.info else None for s in statuses] == ["h0", "h1", None, None]
        assert all(s.ping is not None and 0 <= s.ping < 3.0 for s in statuses[:2])
        assert [s.error for s in statuses] == [None, None, "timeout", "timeout"]
    finally:
        for host in hosts:
            await host.close()


async def test_an_address_given_many_times_is_queried_once(client_endpoint: rudp.Server) -> None:
    # A list naming one address 192 times (a hostile matchmaker's) made every browsing
    # client send it 192 padded queries.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as victim:
        victim.bind(("127.0.0.1", 0))
        victim.setblocking(False)
        target = victim.getsockname()
        statuses = await query_servers(client_endpoint, [target] * 5, timeout=0.3)
        assert [s.address for s in statuses] == [Address(*target)] * 5
        assert [s.error for s in statuses] == ["timeout"] * 5
        received = 0
        with contextlib.suppress(BlockingIOError):
            while victim.recv(2048):
                received += 1
    assert received == 1


async def test_a_registered_host_answers_with_its_latest_info(
    client_endpoint: rudp.Server,
) -> None:
    daemon = Matchmaker(settings())
    await daemon.start()
    game = await rudp.serve(lambda conn: conn.wait_closed(), "127.0.0.1", 0)
    mm = MatchmakerClient.to(*daemon.udp_address, via=game)
    try:
        serve_info(game, lambda: mm.host_info)
        [before] = await query_servers(client_endpoint, [game.address], timeout=0.3)
        assert before.error == "timeout"  # not registered yet: silent
        await mm.register(**HOST)
        await mm.update(players=2)
        [status] = await query_servers(client_endpoint, [game.address], timeout=2)
        assert status.info is not None and status.info.players == 2
        assert status.info.name == HOST["name"]
        # The daemon's own unconnected info query still works beside it.
        reply, _ = await client_endpoint.query(daemon.udp_address, encode(InfoRequest()), 2)
        assert type(decode(reply)).__name__ == "InfoReply"
    finally:
        await mm.close()
        await game.close()
        await daemon.shutdown()


async def test_concurrency_must_be_positive(client_endpoint: rudp.Server) -> None:
    with pytest.raises(ValueError):
        await query_servers(client_endpoint, [], concurrency=0)
    assert await query_servers(client_endpoint, []) == []
