"""Misuse of the secondary modules (rudp.lan, rudp.netsim, rudp.a2s) and of ports: a bad
argument is refused at once, naming the parameter, instead of spinning, wrapping or failing
per datagram later; and a cancelled ``Proxy.close()`` still closes the proxy.

Loopback only: every discovery here passes ``broadcast=False, ipv6=False``.
"""

from __future__ import annotations

import asyncio
import math
import random
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rudp
from rudp import lan
from rudp.a2s import Player, Responder, ServerInfo, serve_a2s
from rudp.errors import check_port
from rudp.netsim import ConditionedPipe, LinkConditioner, LinkProfile, start_proxy

REPO_ROOT = Path(__file__).resolve().parents[2]
NAN, INF = math.nan, math.inf
LOOPBACK_ONLY: dict[str, Any] = {"broadcast": False, "ipv6": False}
KEY = bytes(range(32))
INFO = ServerInfo(name="Arena 1", map="field")


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def _wait_until(condition: Any, what: str, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


# -- Proxy.close() cancelled ---------------------------------------------------------------


async def test_a_cancelled_proxy_close_has_closed_it_and_a_second_close_finishes() -> None:
    target, client = _udp_socket(), _udp_socket()
    try:
        proxy = await start_proxy(
            ("127.0.0.1", 0),
            target.getsockname(),
            upstream=LinkProfile(),
            downstream=LinkProfile(),
        )
        port = proxy.address[1]
        # A client's first datagram, as the listening socket hands it over: its upstream
        # socket is being opened (a task, not yet run), so close() has something to wait for.
        proxy._from_client(b"hello", client.getsockname())
        assert proxy._opening and proxy.clients == 1
        closer = asyncio.create_task(proxy.close())
        await asyncio.sleep(0)  # close() is now waiting
        assert not closer.done()
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        # Cancelled while it waited, it has closed every socket all the same.
        assert proxy.closed and proxy.clients == 0
        assert proxy._transport is not None and proxy._transport.is_closing()
        # A second close() is not a no-op that skips what the first never finished.
        await asyncio.wait_for(proxy.close(), 5)
        assert all(f.done() for f in proxy._closing) and not proxy._opening

        def port_free() -> bool:
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            finally:
                probe.close()
            return True

        await _wait_until(port_free, "the proxy's listening port is released")
    finally:
        target.close()
        client.close()


async def test_proxy_close_twice_while_the_first_waits() -> None:
    target = _udp_socket()
    try:
        proxy = await start_proxy(
            ("127.0.0.1", 0), target.getsockname(), upstream=LinkProfile(), downstream=LinkProfile()
        )
        await asyncio.wait_for(asyncio.gather(proxy.close(), proxy.close()), 5)
        assert proxy.closed and proxy._transport is not None and proxy._transport.is_closing()
    finally:
        target.close()


# -- netsim: arguments of the wrong type ---------------------------------------------------


@pytest.mark.parametrize("which", ["upstream", "downstream"])
@pytest.mark.parametrize("profile", [None, {"loss": 0.1}, "lossy"])
async def test_start_proxy_refuses_a_profile_that_is_not_a_link_profile(
    which: str, profile: Any
) -> None:
    profiles: dict[str, Any] = {"upstream": LinkProfile(), "downstream": LinkProfile()}
    profiles[which] = profile
    with pytest.raises(TypeError, match=rf"^{which} must be a rudp\.netsim\.LinkProfile"):
        await asyncio.wait_for(start_proxy(("127.0.0.1", 0), ("127.0.0.1", 9), **profiles), 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_clients": 1.5}, r"^max_clients takes an int, not 1\.5$"),
        ({"max_clients": True}, r"^max_clients takes an int, not True$"),
        ({"max_clients": "8"}, r"^max_clients takes an int, not '8'$"),
        ({"idle_timeout": True}, r"^idle_timeout takes a number of seconds, not True$"),
        ({"idle_timeout": "60"}, r"^idle_timeout takes a number of seconds, not '60'$"),
    ],
)
async def test_start_proxy_refuses_a_count_or_timeout_that_is_not_one(
    kwargs: dict[str, Any], match: str
) -> None:
    # max_clients=1.5 or True was taken (a bool is an int); a str failed in a comparison.
    link = LinkProfile()
    with pytest.raises(TypeError, match=match):
        await asyncio.wait_for(
            start_proxy(
                ("127.0.0.1", 0), ("127.0.0.1", 9), upstream=link, downstream=link, **kwargs
            ),
            5,
        )


async def test_assigning_a_proxy_profile_that_is_not_one_is_a_type_error() -> None:
    target = _udp_socket()
    try:
        proxy = await start_proxy(
            ("127.0.0.1", 0), target.getsockname(), upstream=LinkProfile(), downstream=LinkProfile()
        )
        async with proxy:
            lossy = LinkProfile(loss=0.5)
            proxy.upstream = lossy
            with pytest.raises(TypeError, match=r"^Proxy\.upstream must be a rudp\.netsim"):
                proxy.upstream = "lossy"  # type: ignore[assignment]
            with pytest.raises(TypeError, match=r"^Proxy\.downstream must be a rudp\.netsim"):
                proxy.downstream = None  # type: ignore[assignment]
            assert proxy.upstream is lossy and proxy.downstream == LinkProfile()
    finally:
        target.close()


async def test_conditioned_pipe_refuses_a_deliver_or_profile_it_cannot_use() -> None:
    loop = asyncio.get_running_loop()
    for deliver in (None, "sendto"):
        with pytest.raises(TypeError, match=r"^deliver must be a function"):
            ConditionedPipe(loop, LinkProfile(), deliver)  # type: ignore[arg-type]

    async def coroutine(data: bytes, meta: object) -> None:
        pass

    with pytest.raises(TypeError, match=r"^deliver must be a plain function"):
        ConditionedPipe(loop, LinkProfile(), coroutine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^profile must be a rudp\.netsim\.LinkProfile"):
        ConditionedPipe(loop, None, lambda data, meta: None)  # type: ignore[arg-type]
    pipe: ConditionedPipe[None] = ConditionedPipe(loop, LinkProfile(), lambda data, meta: None)
    with pytest.raises(TypeError, match=r"^profile must be a rudp\.netsim\.LinkProfile"):
        pipe.profile = {"loss": 1.0}  # type: ignore[assignment]
    assert pipe.profile == LinkProfile()
    with pytest.raises(TypeError, match=r"^profile must be a rudp\.netsim\.LinkProfile"):
        LinkConditioner("lossy", rng=random.Random(1))  # type: ignore[arg-type]


def test_netsim_cli_refuses_an_infinite_idle_timeout_with_exit_status_2() -> None:
    for value in ("inf", "nan", "0", "-1"):
        args = ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:9", "--idle-timeout", value]
        proc = subprocess.run(
            [sys.executable, "-m", "rudp.netsim", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2, (value, proc.stderr.decode())
        assert b"Traceback" not in proc.stderr
        assert b"error: --idle-timeout must be a finite number of seconds > 0" in proc.stderr


# -- ports outside 0..65535 ----------------------------------------------------------------


def test_check_port_refuses_a_port_outside_0_to_65535_naming_the_parameter() -> None:
    assert check_port(0) == 0 and check_port(65535, "listen port") == 65535
    for port in (65536, 74536, -1, 2**64):
        with pytest.raises(ValueError, match=rf"^listen port must be in 0\.\.65535, got {port}$"):
            check_port(port, "listen port")
    with pytest.raises(TypeError, match=r"^port takes an int"):
        check_port(9000.0)


async def test_start_proxy_refuses_ports_that_would_wrap() -> None:
    with pytest.raises(ValueError, match=r"^target port must be in 0\.\.65535, got 74536"):
        await asyncio.wait_for(
            start_proxy(
                ("127.0.0.1", 0),
                ("127.0.0.1", 65536 + 9000),  # would forward to port 9000
                upstream=LinkProfile(),
                downstream=LinkProfile(),
            ),
            5,
        )
    with pytest.raises(ValueError, match=r"^listen port must be in 0\.\.65535, got -5"):
        await asyncio.wait_for(
            start_proxy(
                ("127.0.0.1", -5),
                ("127.0.0.1", 9),
                upstream=LinkProfile(),
                downstream=LinkProfile(),
            ),
            5,
        )


async def test_lan_refuses_ports_that_would_wrap() -> None:
    with pytest.raises(ValueError, match=r"^port must be in 0\.\.65535, got 70000"):
        await asyncio.wait_for(
            lan.discover(70000, timeout=0.2, targets=[("127.0.0.1", 9)], **LOOPBACK_ONLY), 5
        )
    with pytest.raises(ValueError, match=r"^each of targets' port must be in 0\.\.65535"):
        await asyncio.wait_for(
            lan.discover(9, timeout=0.2, targets=[("127.0.0.1", 65536 + 9)], **LOOPBACK_ONLY), 5
        )
    with pytest.raises(ValueError, match=r"^port must be in 0\.\.65535, got 70000"):
        await asyncio.wait_for(
            lan.serve_discovery({"n": 1}, 70000, game="g", host="127.0.0.1", ipv6=False), 5
        )


async def test_rudp_refuses_ports_that_would_wrap() -> None:
    async def handler(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    with pytest.raises(ValueError, match=r"^port must be in 0\.\.65535, got 70000"):
        await asyncio.wait_for(rudp.serve(handler, "127.0.0.1", 70000), 5)
    with pytest.raises(ValueError, match=r"^port must be in 0\.\.65535, got 70000"):
        await asyncio.wait_for(rudp.connect("127.0.0.1", 70000), 5)
    with pytest.raises(ValueError, match=r"^local_addr port must be in 0\.\.65535"):
        await asyncio.wait_for(rudp.connect("127.0.0.1", 9, local_addr=("127.0.0.1", 70000)), 5)


# -- discover / Search: timeout, attempts and the counts -----------------------------------

BAD_SEARCH_ARGUMENTS = [
    ({"timeout": NAN}, ValueError, "timeout"),  # spun a core for ever
    ({"timeout": INF}, ValueError, "timeout"),  # never returned
    ({"timeout": -INF}, ValueError, "timeout"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": "1"}, TypeError, "timeout"),
    ({"timeout": True}, TypeError, "timeout"),
    ({"attempts": NAN}, TypeError, "attempts"),  # thousands of calls in half a second
    ({"attempts": 2.5}, TypeError, "attempts"),  # five calls
    ({"attempts": True}, TypeError, "attempts"),
    ({"attempts": 0}, ValueError, "attempts"),
    ({"max_hosts": NAN}, TypeError, "max_hosts"),
    ({"max_hosts": 1.5}, TypeError, "max_hosts"),
    ({"max_hosts": 0}, ValueError, "max_hosts"),
    ({"expected": NAN}, TypeError, "expected"),
    ({"expected": 1.5}, TypeError, "expected"),
    ({"expected": 0}, ValueError, "expected"),
    ({"request_size": 1200.0}, TypeError, "request_size"),
    ({"request_size": 15}, ValueError, "request_size"),
    ({"game": 123}, TypeError, "game"),  # every responder dropped the call as malformed
    ({"game": b"skirmish"}, TypeError, "game"),
    ({"game": ""}, ValueError, "game"),
    ({"game": "x" * 65}, ValueError, "game"),
]


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_SEARCH_ARGUMENTS)
def test_search_refuses_bad_arguments_naming_them(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=rf"^{name} "):
        lan.Search(now=0.0, **kwargs)


@pytest.mark.parametrize(("kwargs", "error", "name"), BAD_SEARCH_ARGUMENTS)
async def test_discover_refuses_bad_arguments_at_once(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    sink = _udp_socket()
    try:
        with pytest.raises(error, match=rf"^{name} "):
            await asyncio.wait_for(
                lan.discover(
                    sink.getsockname()[1],
                    targets=[sink.getsockname()],
                    **{"timeout": 0.3, **kwargs},
                    **LOOPBACK_ONLY,
                ),
                5,
            )
        with pytest.raises(BlockingIOError):
            sink.recv(2048)  # not one call was sent
    finally:
        sink.close()


@pytest.mark.parametrize("targets", [(), [], iter(())])
async def test_discover_with_no_destination_raises_at_once(targets: Any) -> None:
    # It waited its whole timeout, calling no one, and returned [].
    with pytest.raises(ValueError, match=r"^discover\(\) has no destination: targets is empty"):
        await asyncio.wait_for(lan.discover(timeout=600, targets=targets, **LOOPBACK_ONLY), 5)


async def test_discover_still_takes_good_counts() -> None:
    sink = _udp_socket()
    try:
        found = await asyncio.wait_for(
            lan.discover(
                sink.getsockname()[1],
                targets=[sink.getsockname()],
                timeout=0.2,
                attempts=2,
                expected=1,
                max_hosts=1,
                game="g",
                **LOOPBACK_ONLY,
            ),
            5,
        )
        assert found == []
        calls = 0
        while True:
            try:
                sink.recv(2048)
            except BlockingIOError:
                break
            calls += 1
        assert calls == 2
    finally:
        sink.close()


# -- serve_discovery / lan.Responder: info and game ----------------------------------------


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


async def _async_info() -> dict[str, Any]:
    return {"players": 3}


class _AsyncCallable:
    async def __call__(self) -> dict[str, Any]:
        return {"players": 3}


BAD_INFO = [
    (42, TypeError, r"^info takes a mapping"),
    (["a"], TypeError, r"^info takes a mapping"),
    ("name", TypeError, r"^info takes a mapping"),
    ({1: object()}, TypeError, r"^info cannot be sent"),
    ({"when": object()}, TypeError, r"^info cannot be sent"),
    ({1: 2}, TypeError, r"^info's map keys must be str"),  # the searcher's decoder drops it
    ({"a": [{"b": {3: 4}}]}, TypeError, r"^info's map keys must be str"),
    ({"deep": _nested(31)}, ValueError, r"^info nests maps and lists 31 levels deep at most"),
    ({"big": "x" * 70_000}, ValueError, r"^info cannot be sent"),
    (_async_info, TypeError, r"^info must be a mapping or a plain function"),
    (_AsyncCallable(), TypeError, r"^info must be a mapping or a plain function"),
]


@pytest.mark.parametrize(("info", "error", "match"), BAD_INFO)
async def test_serve_discovery_refuses_an_info_no_call_could_be_answered_with(
    info: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        responder = await asyncio.wait_for(
            lan.serve_discovery(info, 0, game="g", host="127.0.0.1", ipv6=False), 5
        )
        responder.close()  # (only reached when it was wrongly accepted)
    with pytest.raises(error, match=match):
        lan.Responder(info, game="g", instance_id=b"I" * 8)


async def test_serve_discovery_still_takes_a_mapping_or_a_plain_function() -> None:
    for info in ({"n": 1, "deep": _nested(30), b"raw": (1, 2)}, lambda: {"n": 1}):
        responder = await asyncio.wait_for(
            lan.serve_discovery(info, 0, game="g", host="127.0.0.1", ipv6=False), 5
        )
        async with responder:
            hosts = await asyncio.wait_for(
                lan.discover(
                    responder.port,
                    timeout=2.0,
                    expected=1,
                    targets=[("127.0.0.1", responder.port)],
                    **LOOPBACK_ONLY,
                ),
                5,
            )
        assert [h.info["n"] for h in hosts] == [1]
        assert responder.stats.info_errors == 0


@pytest.mark.parametrize(
    ("game", "error"), [(123, TypeError), (b"g", TypeError), (None, TypeError), ("", ValueError)]
)
async def test_serve_discovery_refuses_a_game_that_is_not_a_name(
    game: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=r"^game "):
        responder = await asyncio.wait_for(
            lan.serve_discovery({"n": 1}, 0, game=game, host="127.0.0.1", ipv6=False), 5
        )
        responder.close()


# -- serve_a2s / a2s.Responder: info, players, rules and challenge_period ------------------


@pytest.fixture
async def server() -> AsyncIterator[rudp.Server]:
    async def handler(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        yield server


async def _async_server_info() -> ServerInfo:
    return INFO


BAD_A2S = [
    ({"info": {"name": "x"}}, TypeError, r"^info must be a ServerInfo, or a function"),
    ({"info": "Arena"}, TypeError, r"^info must be a ServerInfo, or a function"),
    ({"info": None}, TypeError, r"^info must be a ServerInfo, or a function"),
    ({"info": _async_server_info}, TypeError, r"^info must be .*not a coroutine function"),
    ({"players": [Player("alice", 1, 2.0)]}, TypeError, r"^players must be a function"),
    ({"rules": {"mode": "ctf"}}, TypeError, r"^rules must be a function"),
    ({"challenge_period": NAN}, ValueError, r"^challenge_period must be a finite number"),
    ({"challenge_period": INF}, ValueError, r"^challenge_period must be a finite number"),
    ({"challenge_period": 0}, ValueError, r"^challenge_period must be a finite number"),
    ({"challenge_period": "30"}, TypeError, r"^challenge_period takes a number"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_A2S)
async def test_serve_a2s_refuses_sources_it_cannot_use_at_once(
    server: rudp.Server, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    kwargs = {"info": INFO, **kwargs}
    with pytest.raises(error, match=match):
        serve_a2s(server, **kwargs)
    assert server.on_foreign is None  # nothing was installed


async def test_serve_a2s_refuses_a_server_that_is_closing_or_closed() -> None:
    # It installed a responder on the closed server and returned it: nothing answered.
    async def handler(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    server = await rudp.serve(handler, "127.0.0.1", 0)
    closing = server.close()
    with pytest.raises(rudp.EndpointClosed, match=r"^serve_a2s\(\) on a server that is closing"):
        serve_a2s(server, INFO)
    await asyncio.wait_for(closing, 5)
    with pytest.raises(rudp.EndpointClosed, match=r"^serve_a2s\(\) on a server that is closed"):
        serve_a2s(server, INFO)
    assert server.on_foreign is None


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_A2S)
def test_a2s_responder_refuses_sources_it_cannot_use_at_once(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    kwargs = {"info": lambda: INFO, **kwargs}
    with pytest.raises(error, match=match):
        Responder(key=KEY, **kwargs)


def test_an_a2s_responder_with_a_nan_challenge_period_is_never_made() -> None:
    # It was made, and its first request needing a challenge raised ValueError.
    with pytest.raises(ValueError, match="challenge_period"):
        Responder(lambda: INFO, key=KEY, challenge_period=NAN)
    responder = Responder(INFO, key=KEY, challenge_period=30)  # a ServerInfo, as serve_a2s
    assert (
        len(responder.datagram_received(b"\xff\xff\xff\xffU\xff\xff\xff\xff", ("::1", 5), 100.0))
        == 1
    )


def test_a2s_replies_are_split_at_the_base_datagram_size() -> None:
    # What docs/api.md says (tests/test_api_docs.py checks the text): pieces of
    # base_datagram_size, not max_datagram_size.
    config = rudp.Config()
    assert config.max_datagram_size > config.base_datagram_size
    responder = Responder(
        lambda: INFO,
        key=KEY,
        players=lambda: [Player("p" * 40, 1, 1.0)] * 60,
        max_datagram=config.base_datagram_size,
    )
    address = ("127.0.0.1", 5)
    challenge = responder.datagram_received(b"\xff\xff\xff\xffU\xff\xff\xff\xff", address, 100.0)
    pieces = responder.datagram_received(b"\xff\xff\xff\xffU" + challenge[0][5:9], address, 100.0)
    assert len(pieces) > 1 and max(map(len, pieces)) == config.base_datagram_size
