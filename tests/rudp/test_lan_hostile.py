"""LAN discovery against hostile datagrams: bodies built to cost CPU or memory,
answers larger than any responder sends, and floods of fake hosts.

Sans-IO on a fake clock, or loopback sockets; counters and sizes only.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import msgpack
import pytest

from rudp import lan
from rudp.lan import Kind, encode_packet
from rudp.lan import messages as lan_messages
from rudp.lan.messages import MAX_CALL_BODY, MAX_GAME_NAME

GAME = "skirmish"
NONCE = bytes(range(8))
ADDR = ("10.0.0.9", 47474)


class _Nonces:
    def __init__(self) -> None:
        self.given: list[bytes] = []

    def __call__(self, size: int) -> bytes:
        self.given.append(len(self.given).to_bytes(size, "big"))
        return self.given[-1]


def _responder(game: str = GAME) -> lan.Responder:
    return lan.Responder({"name": "h", "port": 7777}, game=game, instance_id=b"I" * 8)


def _hostile_call(size: int = 65_000) -> bytes:
    """A CALL whose body is mostly empty arrays: cheap to send, costly to unpack."""
    n = size - 40
    return encode_packet(Kind.CALL, NONCE, {"game": GAME, "x": [[]] * n})


def _count_unpacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = msgpack.unpackb

    def spy(data: Any, **kwargs: Any) -> Any:
        sizes.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(lan_messages.msgpack, "unpackb", spy)
    return sizes


# ----------------------------------------------------------------------------- responder


def test_responder_refuses_a_long_call_body_unparsed(monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked = _count_unpacks(monkeypatch)
    r = _responder()
    data = _hostile_call()
    assert len(data) > 60_000
    assert r.answer_for(data, ADDR) is None
    assert unpacked == []  # refused from the header
    assert (r.stats.malformed, r.stats.requests) == (1, 0)


def test_responder_refuses_answers_unparsed(monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked = _count_unpacks(monkeypatch)
    r = _responder()
    body = {"id": b"A" * 8, "game": GAME, "info": {"k": [{}] * 1000}}
    assert r.answer_for(encode_packet(Kind.ANSWER, NONCE, body), ADDR) is None
    assert unpacked == [] and r.stats.malformed == 1


def test_longest_honest_call_body_is_still_answered() -> None:
    game = "\U0001f3ae" * MAX_GAME_NAME  # 4 UTF-8 bytes per character
    call = encode_packet(Kind.CALL, NONCE, {"game": game}, pad_to=1200)
    assert int.from_bytes(call[14:16], "big") == MAX_CALL_BODY
    r = _responder(game)
    assert r.answer_for(call, ADDR) is not None
    longer = encode_packet(Kind.CALL, NONCE, {"game": game, "x": 0}, pad_to=1200)
    assert r.answer_for(longer, ADDR) is None and r.stats.malformed == 1


# ----------------------------------------------------------------------------- search


def _search(**kwargs: Any) -> tuple[lan.Search, bytes]:
    nonces = _Nonces()
    search = lan.Search(now=100.0, randbytes=nonces, timeout=1.0, **kwargs)
    assert search.call_to_send(100.0) is not None
    return search, nonces.given[0]


def _answer(nonce: bytes, instance: bytes, info: Any = None, game: str = GAME) -> bytes:
    body = {"id": instance, "game": game, "info": info if info is not None else {"n": 1}}
    return encode_packet(Kind.ANSWER, nonce, body)


def test_search_drops_answers_larger_than_the_request_size_unparsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    search, nonce = _search()
    unpacked = _count_unpacks(monkeypatch)
    big = _answer(nonce, b"B" * 8, {"k": [{}] * 64_000})
    assert len(big) > lan.DEFAULT_REQUEST_SIZE
    assert not search.datagram_received(big, ADDR, 100.1)
    assert unpacked == [] and search.hosts == {}
    assert search.stats.oversize == 1
    fits = _answer(nonce, b"A" * 8, {"k": "x" * (lan.DEFAULT_REQUEST_SIZE - 60)})
    assert len(fits) <= lan.DEFAULT_REQUEST_SIZE
    assert search.datagram_received(fits, ADDR, 100.1)
    assert search.stats.answers == 1


def test_search_keeps_at_most_max_hosts() -> None:
    search, nonce = _search(max_hosts=4)
    found = [
        search.datagram_received(_answer(nonce, os.urandom(8)), ADDR, 100.1) for _ in range(10)
    ]
    assert found.count(True) == 4 and len(search.results()) == 4
    assert search.stats.too_many_hosts == 6
    assert lan.Search(now=0.0).stats == lan.SearchStats()
    with pytest.raises(ValueError):
        lan.Search(now=0.0, max_hosts=0)


def test_search_default_host_cap() -> None:
    search, nonce = _search()
    for i in range(300):
        search.datagram_received(_answer(nonce, i.to_bytes(8, "big")), ADDR, 100.1)
    assert len(search.hosts) == 256 and search.stats.too_many_hosts == 44


def test_search_counts_every_dropped_datagram(monkeypatch: pytest.MonkeyPatch) -> None:
    search, nonce = _search(game=GAME)
    unpacked = _count_unpacks(monkeypatch)
    assert not search.datagram_received(_answer(b"\x99" * 8, b"A" * 8), ADDR, 100.1)  # stray
    assert not search.datagram_received(
        encode_packet(Kind.CALL, nonce, {"game": GAME}, pad_to=1200), ADDR, 100.1
    )  # a call: our own looping back
    assert unpacked == []  # both told from the header
    assert not search.datagram_received(_answer(nonce, b"A" * 8, game="chess"), ADDR, 100.1)
    assert not search.datagram_received(b"junk", ADDR, 100.1)
    assert search.datagram_received(_answer(nonce, b"A" * 8), ADDR, 100.2)
    assert not search.datagram_received(_answer(nonce, b"A" * 8), ADDR, 100.3)  # slower
    assert search.stats == lan.SearchStats(
        answers=1, slower=1, malformed=1, calls=1, stray=1, other_game=1
    )
    assert search.malformed == 1


# ----------------------------------------------------------------------------- asyncio responder


async def test_failed_answer_is_not_also_counted_as_answered() -> None:
    responder = await lan.serve_discovery({"name": "h"}, 0, game=GAME, host="127.0.0.1", ipv6=False)
    try:
        [transport] = responder._transports
        call = encode_packet(Kind.CALL, NONCE, {"game": GAME}, pad_to=1200)
        # Port 0 cannot be sent to: asyncio reports it to error_received(), not by raising.
        responder._handle(call, ("127.0.0.1", 0), transport)
        assert (responder.stats.answered, responder.stats.send_errors) == (0, 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        try:
            responder._handle(call, sock.getsockname(), transport)
            assert (responder.stats.answered, responder.stats.send_errors) == (1, 1)
            await asyncio.sleep(0)
        finally:
            sock.close()
    finally:
        responder.close()


# ----------------------------------------------------------------------------- instance ids


def test_a_spoofer_reusing_an_instance_id_does_not_hide_the_host() -> None:
    search, nonce = _search()
    real, spoof = ("10.0.0.5", 47474), ("10.0.0.66", 47474)
    assert search.datagram_received(_answer(nonce, b"R" * 8, {"port": 7777}), real, 100.2)
    # Faster, same id, its own info: listed too, never instead.
    assert search.datagram_received(_answer(nonce, b"R" * 8, {"port": 6666}), spoof, 100.1)
    ports = sorted(h.info["port"] for h in search.results())
    assert ports == [6666, 7777]
    assert {h.address for h in search.results()} == {real, spoof}


def test_one_host_heard_by_two_routes_or_twice_is_listed_once() -> None:
    search, nonce = _search()
    info = {"port": 7777}
    assert search.datagram_received(_answer(nonce, b"R" * 8, info), ("10.0.0.5", 47474), 100.3)
    # The same answer over IPv6: one host, the faster route kept.
    v6 = ("fe80::5%eth0", 47474)
    assert search.datagram_received(_answer(nonce, b"R" * 8, info), v6, 100.2)
    # A later answer from a known address with updated info: the same host.
    assert not search.datagram_received(_answer(nonce, b"R" * 8, {"port": 7777, "n": 2}), v6, 100.4)
    [host] = search.results()
    assert host.address == v6 and search.stats.slower == 1


def test_a_spoofer_merged_by_copying_a_host_cannot_then_replace_it() -> None:
    # A copy identical to the real host's answer, but slower, is merged with it; the
    # spoofer's next, faster answer with other info is listed beside the host, not
    # in its place (it does not come from the address kept for the host).
    search, nonce = _search()
    real, spoof = ("10.0.0.5", 47474), ("10.0.0.66", 47474)
    assert search.datagram_received(_answer(nonce, b"R" * 8, {"port": 7777}), real, 100.1)
    assert not search.datagram_received(_answer(nonce, b"R" * 8, {"port": 7777}), spoof, 100.2)
    assert search.datagram_received(_answer(nonce, b"R" * 8, {"port": 6666}), spoof, 100.05)
    assert sorted((h.address, h.info["port"]) for h in search.results()) == [
        (real, 7777),
        (spoof, 6666),
    ]


def test_deeply_nested_answers_are_malformed() -> None:
    search, nonce = _search()
    deep: Any = 1
    for _ in range(500):
        deep = [deep]
    assert not search.datagram_received(_answer(nonce, b"D" * 8, {"k": deep}), ADDR, 100.1)
    assert search.stats.malformed == 1
    ok: Any = 1
    for _ in range(lan_messages.MAX_DEPTH - 2):  # the body and info maps are two levels
        ok = [ok]
    assert search.datagram_received(_answer(nonce, b"D" * 8, {"k": ok}), ADDR, 100.1)
    repr(search.results())  # what an application does with it
