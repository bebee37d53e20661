"""LAN discovery: codec, responder rules, the sans-IO search on a fake clock, loopback
plumbing, and a real LAN in namespaces.

Nothing here asserts on wall-clock timing. Where a test needs to know the responder has
processed earlier datagrams, it relies on loopback delivering datagrams to one
socket in order: once a later call is answered, every earlier one was handled.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import json
import logging
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rudp import lan
from rudp.lan import Kind, MalformedDatagram, decode_packet, encode_packet
from rudp.lan import aio as lan_aio
from rudp.lan.aio import _Collector
from tests.netns import NetLab, netlab_fixture  # noqa: F401  (provides fixture `netlab`)

GAME = "skirmish"
NONCE = bytes(range(8))


# ----------------------------------------------------------------------------- codec


def test_call_roundtrip_and_padding() -> None:
    data = encode_packet(Kind.CALL, NONCE, {"game": GAME}, pad_to=300)
    assert len(data) == 300
    packet = decode_packet(data)
    assert packet == lan.Packet(Kind.CALL, NONCE, {"game": GAME})


def test_answer_roundtrip() -> None:
    body = {"id": b"12345678", "game": GAME, "info": {"players": 3}}
    assert decode_packet(encode_packet(Kind.ANSWER, NONCE, body)).body == body


def test_every_truncation_is_malformed() -> None:
    data = encode_packet(Kind.ANSWER, NONCE, {"id": b"12345678", "game": GAME, "info": {}})
    for cut in range(len(data)):
        with pytest.raises(MalformedDatagram):
            decode_packet(data[:cut])


def test_answer_with_trailing_garbage_is_malformed() -> None:
    data = encode_packet(Kind.ANSWER, NONCE, {"id": b"12345678", "game": GAME, "info": {}})
    with pytest.raises(MalformedDatagram):
        decode_packet(data + b"\x00")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: b"XLAN" + d[4:],  # magic
        lambda d: d[:4] + b"\x09" + d[5:],  # version
        lambda d: d[:5] + b"\x07" + d[6:],  # kind
        lambda d: d[:16] + b"\xc1" + d[17:],  # msgpack: reserved byte
    ],
)
def test_header_defects_are_malformed(mutate: Any) -> None:
    data = encode_packet(Kind.CALL, NONCE, {"game": GAME}, pad_to=64)
    with pytest.raises(MalformedDatagram):
        decode_packet(mutate(data))


def test_body_must_be_a_map() -> None:
    raw = lan.HEADER.pack(lan.MAGIC, lan.VERSION, Kind.CALL, NONCE, 1) + b"\x01"
    with pytest.raises(MalformedDatagram):
        decode_packet(raw)


@given(st.binary(max_size=200))
def test_decoder_only_ever_raises_malformed(data: bytes) -> None:
    with contextlib.suppress(MalformedDatagram):
        decode_packet(data)


@given(st.binary(max_size=64))
def test_decoder_with_valid_header_and_garbage_body(body: bytes) -> None:
    raw = lan.HEADER.pack(lan.MAGIC, lan.VERSION, Kind.CALL, NONCE, len(body)) + body
    with contextlib.suppress(MalformedDatagram):
        decode_packet(raw)


# ----------------------------------------------------------------------------- responder rules


def _responder(info: Any = None) -> lan.DiscoveryResponder:
    return lan.DiscoveryResponder(info if info is not None else {"name": "h"}, game=GAME)


ADDR = ("127.0.0.1", 9)


def _call(game: str | None = GAME, size: int = lan.DEFAULT_REQUEST_SIZE) -> bytes:
    return encode_packet(Kind.CALL, NONCE, {"game": game}, pad_to=size)


def test_responder_answers_with_info_and_echoes_nonce() -> None:
    r = _responder({"name": "h", "players": 2})
    answer = r._answer_for(_call(), ADDR)
    assert answer is not None
    packet = decode_packet(answer)
    assert packet.kind == Kind.ANSWER and packet.nonce == NONCE
    assert packet.body == {"id": r.instance_id, "game": GAME, "info": {"name": "h", "players": 2}}
    assert r.stats.requests == 1


def test_responder_calls_info_callable_each_time() -> None:
    players = iter(range(10))
    r = _responder(lambda: {"players": next(players)})
    answers = [r._answer_for(_call(), ADDR) for _ in range(2)]
    assert [decode_packet(a).body["info"]["players"] for a in answers if a] == [0, 1]


def test_responder_never_amplifies() -> None:
    r = _responder({"blob": "x" * 500})
    assert r._answer_for(_call(size=200), ADDR) is None
    assert r.stats.oversize == 1
    assert r._answer_for(_call(size=1200), ADDR) is not None


def test_responder_filters_other_games_but_answers_any_game() -> None:
    r = _responder()
    assert r._answer_for(_call(game="chess"), ADDR) is None
    assert r._answer_for(_call(game=None), ADDR) is not None
    assert (r.stats.other_game, r.stats.answered + r.stats.requests) == (1, 2)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"rLAN",
        b"\xff" * 1200,
        encode_packet(Kind.ANSWER, NONCE, {"id": b"x" * 8, "game": GAME, "info": {}}),
        encode_packet(Kind.CALL, NONCE, {"game": 5}, pad_to=100),
        encode_packet(Kind.CALL, NONCE, {"game": "g" * 65}, pad_to=200),
    ],
)
def test_responder_counts_malformed(data: bytes) -> None:
    r = _responder()
    assert r._answer_for(data, ADDR) is None
    assert r.stats.malformed == 1 and r.stats.requests == 0


def test_failing_info_callable_is_counted_not_raised() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    r = _responder(broken)
    assert r._answer_for(_call(), ADDR) is None
    assert r.stats.info_errors == 1
    # (a static mapping that cannot be sent is refused at once: test_secondary_misuse.py)
    r2 = _responder(lambda: {"not-serialisable": object()})
    assert r2._answer_for(_call(), ADDR) is None
    assert r2.stats.info_errors == 1


def test_an_info_callable_raising_cancelled_error_is_counted_not_raised() -> None:
    # As the endpoint's on_query and a connection's receiver: a CancelledError (a
    # cancelled future's result()) is the callable's failure too. Only an interrupt
    # goes through.
    def cancelled() -> dict[str, Any]:
        raise asyncio.CancelledError

    r = _responder(cancelled)
    assert r._answer_for(_call(), ADDR) is None
    assert r.stats.info_errors == 1
    for interrupt in (KeyboardInterrupt, SystemExit):

        def interrupted(interrupt: type[BaseException] = interrupt) -> dict[str, Any]:
            raise interrupt

        with pytest.raises(interrupt):
            _responder(interrupted)._answer_for(_call(), ADDR)


def test_game_name_is_validated() -> None:
    with pytest.raises(ValueError):
        lan.DiscoveryResponder({}, game="")


# ----------------------------------------------------------------------------- client collector


def _answer(nonce: bytes, instance: bytes = b"A" * 8, game: str = GAME) -> bytes:
    return encode_packet(Kind.ANSWER, nonce, {"id": instance, "game": game, "info": {"n": 1}})


class _FakeLoop:
    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now


def _collector(game: str | None = None) -> tuple[_Collector, _FakeLoop]:
    loop = _FakeLoop()
    collector = _Collector(game, loop)  # type: ignore[arg-type]
    collector.sent_at[NONCE] = 0.0
    return collector, loop


def test_collector_ignores_unknown_nonce_and_calls() -> None:
    c, _ = _collector()
    c.datagram_received(_answer(b"\x99" * 8), ADDR)
    c.datagram_received(_call(), ADDR)
    assert c.hosts == {} and c.malformed == 0


def test_collector_keeps_fastest_answer_per_instance() -> None:
    c, loop = _collector()
    c.sent_at[b"second!!"] = 1.0
    loop.now = 1.5
    c.datagram_received(_answer(NONCE), ("10.0.0.1", 1))  # rtt 1.5
    c.datagram_received(_answer(b"second!!"), ("fe80::1", 1, 0, 0))  # rtt 0.5
    c.datagram_received(_answer(NONCE, instance=b"B" * 8), ("10.0.0.2", 1))
    assert sorted((h.address[0], h.rtt) for h in c.hosts.values()) == [
        ("10.0.0.2", 1.5),
        ("fe80::1", 0.5),
    ]


def test_collector_filters_game_and_counts_malformed() -> None:
    c, _ = _collector(game=GAME)
    c.datagram_received(_answer(NONCE, game="chess"), ADDR)
    c.datagram_received(encode_packet(Kind.ANSWER, NONCE, {"id": 3}), ADDR)
    c.datagram_received(b"junk", ADDR)
    assert c.hosts == {} and c.malformed == 2


# ----------------------------------------------------------------------------- sans-IO, fake clock


class _Nonces:
    """Deterministic stand-in for os.urandom: 8-byte counters, remembered in order."""

    def __init__(self) -> None:
        self.given: list[bytes] = []

    def __call__(self, size: int) -> bytes:
        self.given.append(len(self.given).to_bytes(size, "big"))
        return self.given[-1]


def _search(now: float = 100.0, **kwargs: Any) -> tuple[lan.Search, _Nonces]:
    nonces = _Nonces()
    return lan.Search(now=now, randbytes=nonces, **kwargs), nonces


def _core_responder(info: Any = None, instance: bytes = b"I" * 8) -> lan.Responder:
    return lan.Responder(info or {"name": "h"}, game=GAME, instance_id=instance)


def _step(search: lan.Search, now: float) -> bytes | None:
    """What the asyncio layer does when it wakes at ``now``."""
    search.handle_timer(now)
    return search.call_to_send(now)


def test_search_spreads_calls_over_the_first_half_then_waits_for_the_deadline() -> None:
    search, nonces = _search(timeout=1.2, attempts=3)
    sent: list[float] = []
    now = 100.0
    for _ in range(100):  # bounded: a broken timer fails the test instead of hanging it
        if (timer := search.get_timer()) is None:
            break
        now = max(now, timer)
        if _step(search, now) is not None:
            sent.append(now)
    assert sent == pytest.approx([100.0, 100.2, 100.4])
    assert now == pytest.approx(101.2) and search.finished
    assert len(nonces.given) == 3 and len(set(nonces.given)) == 3
    assert search.sent_at == dict(zip(nonces.given, sent, strict=True))


def test_search_sends_nothing_before_the_timer_and_ends_exactly_at_the_deadline() -> None:
    search, _ = _search(timeout=1.0, attempts=2)
    assert search.get_timer() == 100.0
    assert _step(search, 100.0) is not None
    assert _step(search, 100.0) is None  # one call per attempt, not per wake-up
    assert search.get_timer() == pytest.approx(100.25)
    assert _step(search, 100.2) is None and not search.finished  # early wake-up
    assert _step(search, 100.25) is not None
    assert search.get_timer() == pytest.approx(101.0)  # no attempt left: the deadline
    assert _step(search, 100.99) is None and not search.finished
    assert _step(search, 101.0) is None
    assert search.finished and search.get_timer() is None


def test_a_late_wake_up_past_the_deadline_sends_no_more_calls() -> None:
    search, nonces = _search(timeout=1.0, attempts=3)
    assert _step(search, 100.0) is not None
    assert _step(search, 105.0) is None
    assert search.finished and len(nonces.given) == 1


def test_search_call_is_padded_and_carries_the_game_filter() -> None:
    search, nonces = _search(game=GAME, request_size=300)
    call = _step(search, 100.0)
    assert call is not None and len(call) == 300
    assert decode_packet(call) == lan.Packet(Kind.CALL, nonces.given[0], {"game": GAME})


def test_search_measures_rtt_against_the_call_answered() -> None:
    search, nonces = _search(timeout=1.2, attempts=3)
    _step(search, 100.0)
    _step(search, 100.2)
    first, second = nonces.given
    # The answer to the second call arrives first; the late one to the first call
    # is slower and must not replace it.
    assert search.datagram_received(_answer(second), ("10.0.0.1", 47474), 100.25)
    assert not search.datagram_received(_answer(first), ("10.0.0.1", 47474), 100.3)
    [host] = search.results()
    assert host.rtt == pytest.approx(0.05) and host.address == ("10.0.0.1", 47474)
    assert host.instance_id == b"A" * 8 and host.info == {"n": 1} and host.game == GAME


def test_search_ignores_strays_and_counts_malformed_answers() -> None:
    search, nonces = _search(game=GAME)
    _step(search, 100.0)
    nonce = nonces.given[0]
    assert not search.datagram_received(_answer(b"\x99" * 8), ADDR, 100.1)  # not our nonce
    assert not search.datagram_received(_call(), ADDR, 100.1)  # a call, maybe our own
    assert not search.datagram_received(_answer(nonce, game="chess"), ADDR, 100.1)
    bad_body = encode_packet(Kind.ANSWER, nonce, {"id": b"short", "game": GAME, "info": {}})
    assert not search.datagram_received(bad_body, ADDR, 100.1)
    assert not search.datagram_received(b"\x00" * 40, ADDR, 100.1)
    assert search.hosts == {} and search.malformed == 2


def test_search_with_expected_ends_when_enough_hosts_answered() -> None:
    search, nonces = _search(timeout=1.0, expected=2)
    _step(search, 100.0)
    nonce = nonces.given[0]
    assert search.datagram_received(_answer(nonce, instance=b"A" * 8), ADDR, 100.1)
    assert search.get_timer() is not None
    assert search.datagram_received(_answer(nonce, instance=b"B" * 8), ADDR, 100.05)
    assert search.finished and search.get_timer() is None
    assert _step(search, 100.5) is None  # no call after the end
    assert [h.instance_id for h in search.results()] == [b"B" * 8, b"A" * 8]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0},
        {"timeout": -1.0},
        {"attempts": 0},
        {"request_size": 4},
        {"request_size": 70_000},
    ],
)
def test_search_arguments_are_checked(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _search(**kwargs)


def test_responder_core_answers_with_the_injected_instance_id() -> None:
    r = _core_responder({"players": 4}, instance=b"12345678")
    answer = r.answer_for(_call())
    assert answer is not None
    assert decode_packet(answer) == lan.Packet(
        Kind.ANSWER, NONCE, {"id": b"12345678", "game": GAME, "info": {"players": 4}}
    )
    assert (r.stats.requests, r.stats.answered) == (1, 0)  # sending is the caller's business


def test_responder_core_checks_its_arguments() -> None:
    with pytest.raises(ValueError):
        lan.Responder({}, game=GAME, instance_id=b"short")
    with pytest.raises(ValueError):
        lan.Responder({}, game="g" * 65, instance_id=b"I" * 8)


def test_search_and_responder_over_a_lossy_link_on_a_fake_clock() -> None:
    """Two responders, the first call lost on the way: found by the retry, RTT of the retry."""
    search, _ = _search(game=GAME, timeout=1.2, attempts=3)
    near = _core_responder({"name": "near"}, instance=b"N" * 8)
    far = _core_responder({"name": "far"}, instance=b"F" * 8)
    one_way = {near: 0.001, far: 0.010}
    in_flight: list[tuple[float, bytes, tuple[str, int]]] = []
    now, calls = 100.0, 0
    for _ in range(100):  # bounded: a broken timer fails the test instead of hanging it
        if (timer := search.get_timer()) is None:
            break
        arrivals = [t for t, _, _ in in_flight]
        now = max(now, min([timer, *arrivals]))
        for item in [i for i in in_flight if i[0] <= now]:
            in_flight.remove(item)
            search.datagram_received(item[1], item[2], now)
        call = _step(search, now)
        if call is None:
            continue
        calls += 1
        if calls == 1:
            continue  # the first broadcast is lost
        for responder, delay in one_way.items():
            answer = responder.answer_for(call, ("10.0.0.9", 5555))
            assert answer is not None
            addr = ("10.0.0.1" if responder is near else "10.0.0.2", 47474)
            in_flight.append((now + 2 * delay, answer, addr))
    assert calls == 3 and now == pytest.approx(101.2)
    hosts = search.results()
    assert [h.info["name"] for h in hosts] == ["near", "far"]
    assert [h.rtt for h in hosts] == pytest.approx([0.002, 0.020])
    assert near.stats.requests == far.stats.requests == 2


def test_debug_log_lines_are_event_names_with_key_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="rudp.lan")
    r = _core_responder()
    assert r.answer_for(b"junk", ADDR) is None
    search, _ = _search()
    search.datagram_received(b"junk", ADDR, 100.0)
    records = [(rec.name, rec.levelno, rec.getMessage()) for rec in caplog.records]
    peer = f"{ADDR[0]}:{ADDR[1]}"
    assert records == [
        ("rudp.lan.responder", logging.DEBUG, f"call_malformed peer={peer} reason='short header'"),
        ("rudp.lan.search", logging.DEBUG, f"answer_malformed peer={peer} reason='short header'"),
    ]


@pytest.mark.parametrize("module", ["rudp.lan.messages", "rudp.lan.responder", "rudp.lan.search"])
def test_sans_io_modules_import_no_io(module: str) -> None:
    tree = ast.parse(Path(importlib.import_module(module).__file__ or "").read_text())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        (n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
    }
    assert not imported & {"asyncio", "socket", "time", "selectors"}


# ----------------------------------------------------------------------------- loopback


@pytest.fixture
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Fails the test if anything reached the event loop's exception handler."""
    errors: list[dict[str, Any]] = []
    yield errors
    assert errors == []


async def test_loopback_discovery(loop_errors: list[dict[str, Any]]) -> None:
    asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: loop_errors.append(ctx))
    players = [1]
    info = lambda: {"name": "den", "port": 7777, "players": players[0]}  # noqa: E731
    async with await lan.serve_discovery(info, 0, game=GAME, host="127.0.0.1") as responder:
        target = [("127.0.0.1", responder.port)]
        kwargs: dict[str, Any] = {"targets": target, "broadcast": False, "ipv6": False}
        hosts = await lan.discover(responder.port, timeout=10.0, expected=1, **kwargs)
        assert len(hosts) == 1
        host = hosts[0]
        assert host.address == ("127.0.0.1", responder.port)
        assert host.info == {"name": "den", "port": 7777, "players": 1}
        assert host.game == GAME and host.rtt >= 0
        players[0] = 2
        hosts = await lan.discover(responder.port, timeout=10.0, expected=1, **kwargs)
        assert hosts[0].info["players"] == 2


async def test_loopback_bad_input_is_counted_and_service_continues(
    loop_errors: list[dict[str, Any]],
) -> None:
    asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: loop_errors.append(ctx))
    async with await lan.serve_discovery({"n": 1}, 0, game=GAME, host="127.0.0.1") as responder:
        addr = ("127.0.0.1", responder.port)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            for junk in (b"", b"garbage", b"rLAN\x01\x01" + b"\xff" * 30):
                raw.sendto(junk, addr)
            raw.sendto(_call(game="chess"), addr)
            raw.sendto(encode_packet(Kind.CALL, NONCE, {"game": GAME}), addr)  # unpadded
        # Loopback keeps order per socket: when this call is answered, the
        # datagrams above have all been handled.
        # One attempt only, so "answered" cannot depend on how fast the answer came.
        hosts = await lan.discover(
            responder.port,
            timeout=10.0,
            expected=1,
            attempts=1,
            targets=[addr],
            broadcast=False,
            ipv6=False,
        )
        assert len(hosts) == 1
        stats = responder.stats
        assert (stats.malformed, stats.other_game, stats.oversize) == (3, 1, 1)
        assert stats.answered == 1


async def test_loopback_info_cancelled_error_stays_in_the_responder(
    loop_errors: list[dict[str, Any]],
) -> None:
    asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: loop_errors.append(ctx))
    calls = [0]

    def info() -> dict[str, Any]:
        calls[0] += 1
        if calls[0] == 1:
            raise asyncio.CancelledError
        return {"n": 1}

    async with await lan.serve_discovery(info, 0, game=GAME, host="127.0.0.1") as responder:
        addr = ("127.0.0.1", responder.port)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.sendto(_call(), addr)
        # Loopback keeps order per socket: once a later call is answered, this one
        # was handled.
        hosts = await lan.discover(
            responder.port,
            timeout=10.0,
            expected=1,
            attempts=1,
            targets=[addr],
            broadcast=False,
            ipv6=False,
        )
        assert [h.info for h in hosts] == [{"n": 1}]
        assert (responder.stats.info_errors, responder.stats.answered) == (1, 1)


async def test_discover_argument_checks() -> None:
    with pytest.raises(ValueError):
        await lan.discover(timeout=0)
    with pytest.raises(ValueError):
        await lan.discover(request_size=4)


BAD_GROUPS = ["not-an-address", "", "fe80::1", "::1", "224.0.0.1", "ff02::1%lo", "ff02::1\x00"]


@pytest.mark.parametrize("group", BAD_GROUPS)
async def test_a_bad_ipv6_group_is_refused_before_a_socket_is_opened(
    group: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It used to fail in inet_pton after the IPv6 socket was bound: logged as "IPv6
    # unavailable" (the caller's mistake never raised), and that socket never closed.
    bound: list[Any] = []
    monkeypatch.setattr(lan_aio, "_bind_udp", lambda *args: bound.append(args))
    for ipv6 in (True, False):
        with pytest.raises(ValueError, match="ipv6_group"):
            await lan.serve_discovery({}, 0, game=GAME, ipv6=ipv6, ipv6_group=group)
    with pytest.raises(ValueError, match="ipv6_group"):
        await lan.discover(0, targets=[("127.0.0.1", 9)], ipv6_group=group)
    with pytest.raises(TypeError, match="ipv6_group"):
        await lan.serve_discovery({}, 0, game=GAME, ipv6_group=b"ff02::1")  # type: ignore[arg-type]
    assert bound == []


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6(), reason="no IPv6")
@pytest.mark.parametrize("error", [OSError(19, "no interface"), RuntimeError("boom")])
async def test_a_failed_group_join_closes_the_ipv6_socket(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unavailable IPv6 (an OSError) is logged and skipped, anything else raised, and
    # either way no socket is left open.
    sockets: list[socket.socket] = []
    bind = lan_aio._bind_udp

    def recording_bind(*args: Any) -> socket.socket:
        sockets.append(bind(*args))
        return sockets[-1]

    def failing_join(sock: socket.socket, group: bytes) -> None:
        raise error

    monkeypatch.setattr(lan_aio, "_bind_udp", recording_bind)
    monkeypatch.setattr(lan_aio, "_join_group", failing_join)
    if isinstance(error, OSError):
        responder = await lan.serve_discovery({}, 0, game=GAME, ipv6=True)
        assert [host for host, _ in responder.addresses] == ["0.0.0.0"]
        responder.close()
    else:
        with pytest.raises(RuntimeError, match="boom"):
            await lan.serve_discovery({}, 0, game=GAME, ipv6=True)
    for _ in range(3):  # a transport closes its socket on a later turn of the loop
        await asyncio.sleep(0)
    assert [s.family for s in sockets] == [socket.AF_INET, socket.AF_INET6]
    assert [s.fileno() for s in sockets] == [-1, -1]


def test_list_interfaces_includes_loopback() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("interface enumeration is Linux-only")
    names = {i.name for i in lan.list_interfaces()}
    assert "lo" in names


# ----------------------------------------------------------------------------- real LAN (netns)

RESPONDER = """
import asyncio, dataclasses, json, sys
from rudp import lan
args = json.loads(sys.argv[1])
async def main():
    r = await lan.serve_discovery(args["info"], args["port"], game=args["game"])
    print(json.dumps({"ready": r.addresses}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    r.close()
    print(json.dumps(dataclasses.asdict(r.stats)), flush=True)
asyncio.run(main())
"""

CLIENT = """
import asyncio, json, sys
from rudp import lan
args = json.loads(sys.argv[1])
async def main():
    hosts = await lan.discover(**args)
    print(json.dumps([[list(h.address), h.game, h.info] for h in hosts]))
asyncio.run(main())
"""

PORT = 47474


@pytest.fixture
def lan_with_two_hosts(netlab: NetLab) -> tuple[NetLab, list[Any]]:
    """Hosts in nodes 1 and 2 answering for GAME, a client node 3; all on one bridge."""
    host_a, host_b, client = netlab.add_node(), netlab.add_node(), netlab.add_node()
    procs = []
    for node, name in ((host_a, "alpha"), (host_b, "beta")):
        args = {"info": {"name": name, "port": 7000}, "port": PORT, "game": GAME}
        proc = netlab.spawn(node, RESPONDER, json.dumps(args))
        assert "ready" in json.loads(netlab.read_line(proc))
        procs.append(proc)
    return netlab, [host_a, host_b, client, procs]


def _discover_in(lab: NetLab, node: Any, **kwargs: Any) -> list[Any]:
    args = {"port": PORT, "timeout": 10.0, "game": GAME, "expected": 2, **kwargs}
    out = lab.run(node, CLIENT, json.dumps(args)).stdout
    return sorted(json.loads(out), key=lambda h: h[2]["name"])


@pytest.mark.netns
def test_netns_ipv4_broadcast_finds_both_hosts(
    lan_with_two_hosts: tuple[NetLab, list[Any]],
) -> None:
    lab, (host_a, host_b, client, procs) = lan_with_two_hosts
    hosts = _discover_in(lab, client, ipv6=False)
    assert [(h[0][0], h[2]["name"]) for h in hosts] == [
        (host_a.ipv4, "alpha"),
        (host_b.ipv4, "beta"),
    ]
    assert all(h[0][1] == PORT and h[1] == GAME for h in hosts)
    for proc in procs:  # each responder saw at least one well-formed call
        proc.stdin.write("\n")
        proc.stdin.flush()
        stats = json.loads(lab.read_line(proc))
        assert stats["requests"] >= 1 and stats["malformed"] == 0


@pytest.mark.netns
def test_netns_ipv6_multicast_finds_both_hosts(
    lan_with_two_hosts: tuple[NetLab, list[Any]],
) -> None:
    lab, (host_a, host_b, client, _) = lan_with_two_hosts
    hosts = _discover_in(lab, client, broadcast=False)
    assert [(h[0][0], h[2]["name"]) for h in hosts] == [
        (f"{host_a.ipv6}%eth0", "alpha"),
        (f"{host_b.ipv6}%eth0", "beta"),
    ]


@pytest.mark.netns
def test_netns_game_filter_crosses_the_lan(lan_with_two_hosts: tuple[NetLab, list[Any]]) -> None:
    lab, (_, _, client, _) = lan_with_two_hosts
    # Nobody serves "chess": every call is filtered, so this waits out its short timeout.
    assert _discover_in(lab, client, game="chess", timeout=0.3, expected=None) == []
