"""A2S answers on a rudp socket: the sans-IO responder, the socket hook, and clients
nobody here wrote (python-a2s, qstat)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

import rudp
from rudp.a2s import Player, Responder, ServerInfo, serve_a2s
from rudp.a2s.packets import (
    HEADER,
    SPLIT,
    SPLIT_HEADER,
    Kind,
    decode_request,
    encode_info,
    split,
)

KEY = bytes(range(32))
ALICE = ("192.0.2.1", 27015)
MALLORY = ("192.0.2.2", 27015)
INFO = ServerInfo(name="Arena 1", map="field", folder="arena", game="arena", max_players=8)
INFO_REQUEST = HEADER + b"TSource Engine Query\x00"
QSTAT = shutil.which("quakestat")
needs_qstat = pytest.mark.skipif(QSTAT is None, reason="qstat (quakestat) is not installed")


def responder(**kwargs: object) -> Responder:
    rules = {f"rule{i:03d}": "x" * 40 for i in range(200)}
    return Responder(
        lambda: INFO,
        key=KEY,
        players=lambda: [Player("alice", 3, 12.5)],
        rules=lambda: rules,
        **kwargs,  # type: ignore[arg-type]
    )


def challenge_of(reply: bytes) -> bytes:
    assert reply[:5] == HEADER + bytes((Kind.CHALLENGE,))
    assert len(reply) == 9
    return reply[5:]


def reassemble(datagrams: list[bytes]) -> bytes:
    if len(datagrams) == 1:
        return datagrams[0]
    parts = []
    for number, piece in enumerate(datagrams):
        header, _, total, index, _ = SPLIT.unpack_from(piece)
        assert (header, total, index) == (SPLIT_HEADER, len(datagrams), number)
        parts.append(piece[SPLIT.size :])
    return b"".join(parts)


# -- the responder ---------------------------------------------------------------


def test_info_without_challenge_gets_a_challenge_no_larger_than_the_request() -> None:
    r = responder()
    (reply,) = r.datagram_received(INFO_REQUEST, ALICE, 100.0)
    challenge = challenge_of(reply)
    assert len(reply) <= len(INFO_REQUEST)
    (info,) = r.datagram_received(INFO_REQUEST + challenge, ALICE, 101.0)
    assert info == encode_info(INFO)
    assert (r.challenged, r.answered) == (1, 1)


@pytest.mark.parametrize("kind", [b"U", b"V"])
@pytest.mark.parametrize("asking", [b"\xff\xff\xff\xff", b"\x00\x00\x00\x00"])
def test_players_and_rules_ask_for_a_challenge_first(kind: bytes, asking: bytes) -> None:
    r = responder()
    (reply,) = r.datagram_received(HEADER + kind + asking, ALICE, 0.0)
    challenge = challenge_of(reply)
    assert challenge not in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x00")
    answer = reassemble(r.datagram_received(HEADER + kind + challenge, ALICE, 0.0))
    assert answer[4] == (Kind.PLAYER_REPLY if kind == b"U" else Kind.RULES_REPLY)


def test_a_challenge_is_bound_to_the_address_and_expires() -> None:
    r = responder(challenge_period=30.0)
    challenge = challenge_of(r.datagram_received(HEADER + b"U" + b"\xff" * 4, ALICE, 10.0)[0])
    request = HEADER + b"U" + challenge
    # Someone else echoing Alice's challenge (a spoofer) gets a challenge of its own.
    assert challenge_of(r.datagram_received(request, MALLORY, 10.0)[0]) != challenge
    assert r.datagram_received(request, ALICE, 59.0)[0][4] == Kind.PLAYER_REPLY
    assert challenge_of(r.datagram_received(request, ALICE, 60.0)[0]) != challenge


def test_nothing_stored_per_requester() -> None:
    r = responder()
    before = dict(vars(r)) if hasattr(r, "__dict__") else None
    for port in range(1000):
        r.datagram_received(INFO_REQUEST, ("198.51.100.7", port), 0.0)
    if before is not None:
        assert set(vars(r)) == set(before)
    assert r.challenged == 1000


def test_large_rules_are_split_into_datagrams_of_at_most_max_datagram() -> None:
    r = responder(max_datagram=1200)
    challenge = challenge_of(r.datagram_received(HEADER + b"V" + b"\xff" * 4, ALICE, 0.0)[0])
    pieces = r.datagram_received(HEADER + b"V" + challenge, ALICE, 0.0)
    assert len(pieces) > 1
    assert all(len(p) <= 1200 for p in pieces)
    ident = {SPLIT.unpack_from(p)[1] for p in pieces}
    assert len(ident) == 1 and not ident.pop() & 0x8000  # not "compressed"
    whole = reassemble(pieces)
    assert whole[:5] == HEADER + b"E"
    assert struct.unpack_from("<H", whole, 5)[0] == 200


def test_split_refuses_more_than_255_pieces() -> None:
    assert len(split(b"x" * 1000, 1, 1200)) == 1
    with pytest.raises(ValueError):
        split(b"x" * 400_000, 1, 1200)


def test_a_padded_request_is_answered_at_once() -> None:
    r = responder()
    padded = INFO_REQUEST + b"\x00" * 4
    # The 4 extra bytes are read as a (wrong) challenge; the reply is still larger.
    assert challenge_of(r.datagram_received(padded, ALICE, 0.0)[0])
    small = Responder(lambda: ServerInfo(name="", folder="x"), key=KEY)
    reply = small.datagram_received(INFO_REQUEST, ALICE, 0.0)
    assert len(reply[0]) <= len(INFO_REQUEST) and reply[0][4:5] == b"I"  # fits: answered


def test_players_and_rules_for_a_source_not_validated_run_no_game_code() -> None:
    # They ran the game's lists and encoded them just to send a 9-byte challenge (and a
    # list that raised lost the challenge too).
    calls: list[str] = []

    def players() -> list[Player]:
        calls.append("players")
        return [Player(name="p")]

    def rules() -> dict[str, str]:
        calls.append("rules")
        return {"a": "b"}

    r = Responder(lambda: INFO, key=KEY, players=players, rules=rules)
    for kind in (b"U", b"V"):
        reply = r.datagram_received(HEADER + kind + b"\xff" * 4, ALICE, 0.0)
        assert challenge_of(reply[0]) and len(reply[0]) == 9
    assert calls == [] and r.challenged == 2


def test_silent_when_not_hosting_and_for_what_is_not_a2s() -> None:
    assert Responder(lambda: None, key=KEY).datagram_received(INFO_REQUEST, ALICE, 0.0) == []
    r = responder()
    for junk in (HEADER, HEADER + b"W", HEADER + b"TSource", HEADER + b"U\x01", b"\x00" * 9):
        assert r.datagram_received(junk, ALICE, 0.0) == []
    assert r.dropped == 5


def test_what_is_not_answered_is_counted_by_reason() -> None:
    hosting: list[ServerInfo | None] = [None]
    r = Responder(lambda: hosting[0], key=KEY)
    for request in (INFO_REQUEST, HEADER + b"U" + b"\xff" * 4, HEADER + b"V" + b"\xff" * 4):
        assert r.datagram_received(request, ALICE, 0.0) == []
    assert r.datagram_received(HEADER + b"W", ALICE, 0.0) == []
    assert r.drops == {"not_a2s": 1, "too_short": 0, "not_hosting": 3, "source_failed": 0}
    assert (r.answered, r.challenged, r.dropped) == (0, 0, 4)
    hosting[0] = INFO
    assert challenge_of(r.datagram_received(INFO_REQUEST, ALICE, 0.0)[0])
    assert (r.answered, r.challenged, r.dropped) == (0, 1, 4)


@given(
    st.lists(
        st.tuples(st.sampled_from(b"TUVW\x00"), st.binary(max_size=24), st.booleans()),
        max_size=20,
    )
)
def test_every_datagram_is_counted_once(datagrams: list[tuple[int, bytes, bool]]) -> None:
    hosting = [True]
    r = Responder(lambda: INFO if hosting[0] else None, key=KEY)
    for kind, rest, hosts in datagrams:
        hosting[0] = hosts
        r.datagram_received(HEADER + bytes((kind,)) + rest, ALICE, 0.0)
    assert r.answered + r.challenged + r.dropped == len(datagrams)
    assert sum(r.drops.values()) == r.dropped


def test_strings_lose_their_nuls() -> None:
    info = encode_info(ServerInfo(name="a\x00b", keywords="x,y", port=27015))
    assert info.startswith(HEADER + b"I\x11ab\x00")
    assert info.endswith(b"\xa0" + struct.pack("<H", 27015) + b"x,y\x00")


def test_decode_request() -> None:
    assert decode_request(INFO_REQUEST) is not None
    assert decode_request(INFO_REQUEST + b"\x01\x02\x03\x04") is not None
    assert decode_request(INFO_REQUEST + b"\x01") is None
    assert decode_request(HEADER + b"U\x01\x02\x03\x04\x05") is None


@given(st.binary(max_size=64), st.integers(0, 65535), st.floats(0, 1e9))
def test_never_more_to_an_unvalidated_address_than_it_sent(
    data: bytes, port: int, now: float
) -> None:
    r = responder()
    request = HEADER + data
    replies = r.datagram_received(request, ("203.0.113.9", port), now)
    assert sum(map(len, replies)) <= len(request)


# -- on a rudp socket ----------------------------------------------------------------


async def echo(conn: rudp.Connection) -> None:
    async for msg in conn:
        conn.send(msg.data)


@pytest.fixture
async def host() -> AsyncIterator[rudp.Server]:
    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        serve_a2s(
            server,
            ServerInfo(
                name="Arena 1",
                map="field",
                folder="arena",
                game="Arena",
                players=1,
                max_players=8,
                version="1.2",
                port=server.address[1],
                keywords="ctf,eu",
                app_id=0x80,  # see test_qstat_reads_split_rules
            ),
            players=lambda: [Player("alice", 3, 12.5), Player("bob", 1, 3.0)],
            rules=lambda: {f"rule{i:03d}": "x" * 40 for i in range(200)},
        )
        yield server


class _Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received.put_nowait(data)


async def test_a2s_and_rudp_share_the_socket(host: rudp.Server) -> None:
    loop = asyncio.get_running_loop()
    transport, client = await loop.create_datagram_endpoint(
        _Client, remote_addr=host.address, family=socket.AF_INET
    )
    try:
        conn = await rudp.connect(*host.address)
        transport.sendto(INFO_REQUEST)
        conn.send(b"ping")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"ping"
        challenge = challenge_of(await asyncio.wait_for(client.received.get(), 5))
        transport.sendto(INFO_REQUEST + challenge)
        assert (await asyncio.wait_for(client.received.get(), 5))[4] == Kind.INFO_REPLY
        await conn.close()
    finally:
        transport.close()
    # The core never saw them: nothing dropped as malformed.
    assert not host.stats.dropped


async def test_without_a_handler_ffffffff_goes_to_rudp_and_is_dropped() -> None:
    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(INFO_REQUEST, server.address)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if server.stats.dropped:
                    break
        assert sum(server.stats.dropped.values()) == 1
        assert server.on_foreign is None


async def test_a_failing_handler_is_counted_and_rudp_goes_on(host: rudp.Server) -> None:
    def broken(data: bytes, address: object) -> list[bytes]:
        raise RuntimeError("bug")

    host.on_foreign = broken
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(INFO_REQUEST, host.address)
        conn = await rudp.connect(*host.address)
        conn.send(b"still here")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"still here"
        await conn.close()
    assert host.endpoint.foreign_errors == 1


@pytest.mark.parametrize("returned", [None, [b"ok", 7], 3], ids=["none", "not-bytes", "not-a-list"])
async def test_a_handler_returning_no_list_of_bytes_is_counted_and_the_read_goes_on(
    host: rudp.Server, returned: object
) -> None:
    # Its foreign datagram and three rudp datagrams arrive in one read: the bad return
    # value is counted, nothing escapes to the loop, and the core still sees the rest.
    loop = asyncio.get_running_loop()
    escaped: list[object] = []
    loop.set_exception_handler(lambda _loop, context: escaped.append(context))
    host.on_foreign = lambda data, address: returned  # type: ignore[assignment,return-value]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(INFO_REQUEST, host.address)
            for _ in range(3):
                sock.sendto(b"\xa5" + bytes(40), host.address)  # DATA for no connection
            for _ in range(500):
                await asyncio.sleep(0.01)
                if sum(host.stats.dropped.values()) >= 3:
                    break
    finally:
        loop.set_exception_handler(None)
    assert host.endpoint.foreign_errors == 1
    assert sum(host.stats.dropped.values()) == 3
    assert escaped == []


# -- python-a2s (PyPI) ----------------------------------------------------------------


async def test_python_a2s_reads_info_players_and_split_rules(host: rudp.Server) -> None:
    a2s = pytest.importorskip("a2s")
    info = await a2s.ainfo(host.address, timeout=5)
    assert (info.server_name, info.map_name, info.folder, info.game) == (
        "Arena 1",
        "field",
        "arena",
        "Arena",
    )
    assert (info.player_count, info.max_players, info.version) == (1, 8, "1.2")
    assert (info.port, info.keywords) == (host.address[1], "ctf,eu")
    players = await a2s.aplayers(host.address, timeout=5)
    assert [(p.name, p.score, p.duration) for p in players] == [
        ("alice", 3, 12.5),
        ("bob", 1, 3.0),
    ]
    rules = await a2s.arules(host.address, timeout=5)
    assert len(rules) == 200 and rules["rule199"] == "x" * 40


# -- qstat (Debian) -------------------------------------------------------------------


async def quakestat(*args: str) -> list[str]:
    assert QSTAT is not None
    proc = await asyncio.create_subprocess_exec(
        QSTAT, *args, "-raw", "\t", "-timeout", "5", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return out.decode().splitlines()


@needs_qstat
async def test_qstat_reads_info_and_players(host: rudp.Server) -> None:
    target = f"{host.address[0]}:{host.address[1]}"
    lines = await quakestat("-a2s", target, "-P")
    fields = lines[0].split("\t")
    assert fields[:6] == ["A2S", target, "Arena 1", "field", "8", "1"]
    assert sorted(line.split("\t")[0] for line in lines[1:] if line) == ["alice", "bob"]


@needs_qstat
async def test_qstat_reads_split_rules(host: rudp.Server) -> None:
    # qstat takes a split reply for the Source engine's format only when the low
    # byte of the app id is >= 0x80 (its test for "not GoldSrc"), hence 0x80 above.
    target = f"{host.address[0]}:{host.address[1]}"
    lines = await quakestat("-a2s", target, "-R")
    rules = dict(item.split("=", 1) for item in lines[1].split("\t") if "=" in item)
    assert rules["gamedir"] == "arena"
    assert rules["game_tags"] == "ctf,eu"
    assert rules["rule199"] == "x" * 40


# -- other first bytes (set_datagram_handler, send_datagram) ------------------------------


async def test_other_first_bytes_reach_their_handler_beside_a2s() -> None:
    got: list[tuple[bytes, object]] = []

    def mine(data: bytes, address: object) -> list[bytes]:
        got.append((data, address))
        return [b"\xb2" + data[1:3]]

    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        server.set_datagram_handler(0xB1, mine)
        server.on_foreign = lambda data, address: [b"\xff\xff\xff\xffa2s"]
        loop = asyncio.get_running_loop()

        async def reply() -> bytes:
            data, _ = await asyncio.wait_for(loop.sock_recvfrom(sock, 64), 5)
            return data

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            sock.bind(("127.0.0.1", 0))
            sock.sendto(b"\xb1abc", server.address)
            assert await reply() == b"\xb2ab"
            sock.sendto(INFO_REQUEST, server.address)
            assert await reply() == b"\xff\xff\xff\xffa2s"
            server.send_datagram(b"\xb5unprompted", sock.getsockname())
            assert await reply() == b"\xb5unprompted"
            # Handed back to rudp: dropped and counted there, like any stray byte.
            server.set_datagram_handler(0xB1, None)
            sock.sendto(b"\xb1abc", server.address)
            for _ in range(100):
                await asyncio.sleep(0.01)
                if server.stats.dropped:
                    break
        assert [data for data, _ in got] == [b"\xb1abc"]
        assert sum(server.stats.dropped.values()) == 1
        # rudp's own first bytes are not for the taking, nor for sending.
        for first in (0xA0, 0xA5, 0xAF):
            with pytest.raises(rudp.LocalProtocolError):
                server.set_datagram_handler(first, mine)
            with pytest.raises(rudp.LocalProtocolError):
                server.send_datagram(bytes([first]) + b"x", ("127.0.0.1", 9))
        conn = await rudp.connect(*server.address)  # rudp itself is untouched
        conn.send(b"still rudp")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"still rudp"
        await conn.close()


def _validated(r: Responder, kind: bytes) -> list[bytes]:
    """Ask with the challenge `r` gives ALICE: the answer itself."""
    challenge = r.challenge_for(ALICE, 0.0)
    request = INFO_REQUEST + challenge if kind == b"T" else HEADER + kind + challenge
    return r.datagram_received(request, ALICE, 0.0)


def test_what_the_game_gives_out_of_range_is_clamped_not_raised() -> None:
    # A score past 2**31, a float score or count, None, a rule value of 30: one bad
    # row lost the whole answer (struct.error) for everyone, for as long as it stayed.
    players = [
        Player("big", 2**40, 1e39),  # type: ignore[arg-type]
        Player("float", 3.7, float("nan")),  # type: ignore[arg-type]
        Player(None, None, None),  # type: ignore[arg-type]
    ]
    rules = {"count": 30, "none": None, 7: "seven"}
    info = ServerInfo(name="x", players=3.0, max_players=None, port=70000)  # type: ignore[arg-type]
    r = Responder(lambda: info, key=KEY, players=lambda: players, rules=lambda: rules)  # type: ignore[arg-type,return-value]
    (reply,) = _validated(r, b"U")
    assert reply[4:6] == bytes((Kind.PLAYER_REPLY, 3))
    (rules_reply,) = _validated(r, b"V")
    assert b"count\x0030\x00none\x00\x007\x00seven\x00" in rules_reply
    (info_reply,) = _validated(r, b"T")
    assert info_reply[4:5] == b"I" and r.dropped == 0 and r.answered == 3


def test_a_game_callable_that_raises_is_counted_and_answers_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> ServerInfo:
        raise RuntimeError("game bug")

    r = Responder(broken, key=KEY)
    for _ in range(5):
        assert r.datagram_received(INFO_REQUEST, ALICE, 0.0) == []
    assert r.drops["source_failed"] == 5 and r.answered == 0
    assert len([rec for rec in caplog.records if "a2s_source_failed" in rec.getMessage()]) == 3
    huge = Responder(lambda: ServerInfo(name="n" * 400_000), key=KEY)  # too large to split
    assert _validated(huge, b"T") == []
    assert huge.drops["source_failed"] == 1 and huge.answered == 0


def test_an_app_id_over_16_bits_is_sent_whole_in_the_game_id() -> None:
    # It was cut to its low 16 bits (252490 became 55882) and the GameID never sent.
    reply = encode_info(ServerInfo(name="x", app_id=252490))
    # Header, kind, protocol, four strings ("x", "", "", ""), then the 16-bit app id.
    assert struct.unpack_from("<H", reply, 4 + 2 + 5)[0] == 252490 & 0xFFFF
    edf = reply[-9]
    assert edf & 0x01 and struct.unpack("<Q", reply[-8:])[0] == 252490
    small = encode_info(ServerInfo(name="x", app_id=440))
    assert small[-1] & 0x01 == 0


async def test_a_closing_server_answers_no_browser() -> None:
    # Installed before the close, the responder answered through the whole graceful
    # close: browsers listed a server that was going away.
    server = await rudp.serve(lambda conn: conn.wait_closed(), "127.0.0.1", 0)
    responder = serve_a2s(server, INFO)
    handler = server.on_foreign
    assert handler is not None and handler(INFO_REQUEST, ALICE) != []
    closing = server.close()
    assert handler(INFO_REQUEST, ALICE) == []
    assert responder.drops["not_hosting"] == 1
    await asyncio.wait_for(closing, 5)
