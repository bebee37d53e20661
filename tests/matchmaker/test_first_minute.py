"""What a newcomer meets in the first minute: misused arguments, a busy port, the
startup settings, a capped list, the examples' --help, a python without venv."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rudp
from matchmaker import listing
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.messages import HostInfo, HostUpdate, ListFilter, str_tuple
from matchmaker.server import Matchmaker
from matchmaker.serverinfo import query_server, query_servers
from matchmaker.settings import Settings
from tests.matchmaker.helpers import accepting_endpoint

ROOT = Path(__file__).resolve().parents[2]
HOST: dict[str, Any] = {"name": "h", "game": "q3", "version": "1", "max_players": 8}

# -- a str where a sequence belongs ---------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: HostInfo(**HOST, tags="ctf"),  # type: ignore[arg-type]
        lambda: HostUpdate(tags="ctf"),  # type: ignore[arg-type]
        lambda: ListFilter(game="q3", tags_all="ctf"),  # type: ignore[arg-type]
        lambda: ListFilter(game="q3", tags_any="ctf"),  # type: ignore[arg-type]
        lambda: ListFilter(game="q3", tags_any=b"ctf"),  # type: ignore[arg-type]
    ],
)
def test_a_lone_string_for_tags_is_a_type_error(build: Any) -> None:
    with pytest.raises(TypeError, match=r"must be a sequence of strings, not .*\['ctf'\]|b'ctf'"):
        build()


def test_any_sequence_of_tags_becomes_a_tuple() -> None:
    assert HostInfo(**HOST, tags=["ctf", "ffa"]).tags == ("ctf", "ffa")  # type: ignore[arg-type]
    assert ListFilter(game="q3", tags_any=iter(["a"])).tags_any == ("a",)  # type: ignore[arg-type]
    assert HostUpdate().tags is None
    assert str_tuple(("x",), "tags") == ("x",)
    with pytest.raises(TypeError, match="tags_any"):
        str_tuple("x", "tags_any")


async def test_the_client_refuses_a_str_where_an_address_or_a_list_belongs() -> None:
    with pytest.raises(TypeError, match=r"\(host, port\) tuple, not 'mm:27950'"):
        MatchmakerClient.to(["mm:27950"])
    with pytest.raises(TypeError, match="to\\(\\) host"):
        MatchmakerClient.to(b"mm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="connect takes a sequence"):
        MatchmakerClient("replica")  # type: ignore[arg-type]
    endpoint = await rudp.open_endpoint("127.0.0.1")
    async with endpoint, MatchmakerClient.to("127.0.0.1", 9, via=endpoint) as mm:
        with pytest.raises(TypeError, match="introduce\\(\\) host"):
            await mm.introduce("192.0.2.1:27960")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="lan takes a"):
            await mm.register(**HOST, lan="192.168.1.5:27960")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="addresses takes a sequence"):
            await query_servers(endpoint, "192.0.2.1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="each of addresses"):
            await query_servers(endpoint, ["192.0.2.1:27960"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="address takes a"):
            await query_server(endpoint, "192.0.2.1:27960")  # type: ignore[arg-type]
        assert mm.route is None  # nothing was sent anywhere


# -- registering from the wrong socket ------------------------------------------------------


async def test_register_without_the_game_socket_is_refused_before_anything_is_sent(
    daemon: Matchmaker,
) -> None:
    async with MatchmakerClient.to(*daemon.udp_address) as mm:
        with pytest.raises(TypeError, match=r"via=game_server"):
            await mm.register(**HOST)
        assert mm.registrations == 0 and mm.route is None  # not even connected
        # Listing from a socket of its own is fine.
        assert await mm.list_servers(game="q3") == []
    assert daemon.registry.count_by_game() == {}


async def test_register_through_the_game_socket_lists_the_game_port(daemon: Matchmaker) -> None:
    game, _ = await accepting_endpoint()
    try:
        async with MatchmakerClient.to(*daemon.udp_address, via=game) as mm:
            address = await mm.register(**HOST)
            assert (address.ip, address.port) == game.address
    finally:
        await game.close()


async def test_the_client_and_the_daemon_print_where_they_are(daemon: Matchmaker) -> None:
    udp_host, udp_port = daemon.udp_address
    assert repr(daemon).startswith(f"<Matchmaker udp {udp_host}:{udp_port} http ")
    assert repr(Matchmaker(Settings())) == "<Matchmaker not started>"
    game, _ = await accepting_endpoint()
    try:
        async with MatchmakerClient.to(udp_host, udp_port, via=game) as mm:
            assert repr(mm) == "<MatchmakerClient not connected>"
            address = await mm.register(**HOST)
            assert repr(mm) == f"<MatchmakerClient {udp_host}:{udp_port}, registered as {address}>"
    finally:
        await game.close()


# -- connect errors name the address and the timeout ----------------------------------------


def test_connect_timeout_names_the_address_and_the_timeout() -> None:
    exc = rudp.ConnectTimeout(address=("192.0.2.1", 27950), timeout=5.0)
    assert isinstance(exc, TimeoutError) and isinstance(exc, rudp.ConnectError)
    assert exc.address == ("192.0.2.1", 27950) and exc.timeout == 5.0
    assert str(exc) == "no answer from 192.0.2.1:27950 within 5 s (Config.connect_timeout)"
    ipv6 = rudp.ConnectTimeout(address=("2001:db8::1", 27950, 0, 0), timeout=0.5)  # type: ignore[arg-type]
    assert "[2001:db8::1]:27950 within 0.5 s" in str(ipv6)
    # The old form still works.
    old = rudp.ConnectTimeout("no answer")
    assert str(old) == "no answer" and old.address is None and old.timeout is None


def test_connect_refused_names_the_address() -> None:
    exc = rudp.ConnectRefused("server full", ("192.0.2.1", 27960))
    assert exc.reason == "server full" and exc.address == ("192.0.2.1", 27960)
    assert str(exc) == "connection refused by 192.0.2.1:27960: server full"
    assert str(rudp.ConnectRefused("server full")) == "connection refused: server full"


# -- the daemon's first lines ---------------------------------------------------------------


def run_daemon(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "matchmaker", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def records(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines()]


@pytest.mark.parametrize("kind", ["udp", "tcp", "master"])
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_busy_port_is_one_line_naming_it_and_exit_status_3(kind: str, loop: str) -> None:
    # (uvloop raises a bind failure of its own, without an errno, from the system's.)
    with socket.socket(
        socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM
    ) as taken:
        taken.bind(("127.0.0.1", 0))
        if kind == "tcp":
            taken.listen()
        port = str(taken.getsockname()[1])
        ports = {
            "udp": ["--port", port, "--http-port", "0"],
            "tcp": ["--http-port", port],
            "master": ["--http-port", "0", "--master", "--master-port", port],
        }[kind]
        env = {k: v for k, v in os.environ.items() if k != "RUDP_NO_UVLOOP"}
        if loop == "asyncio":
            env["RUDP_NO_UVLOOP"] = "1"
        done = run_daemon(
            "--bind", "127.0.0.1", "--http-bind", "127.0.0.1", "--port", "0", *ports, env=env
        )  # fmt: skip
    assert done.returncode == 3, done.stderr
    lines = records(done.stderr)
    failed = [r for r in lines if r["level"] == "error"]
    assert len(failed) == 1, done.stderr
    assert failed[0]["event"] == "port_unavailable"
    flag = {"udp": "--port", "tcp": "--http-port", "master": "--master-port"}[kind]
    proto = "tcp" if kind == "tcp" else "udp"
    assert failed[0]["port"] == f"{proto} 127.0.0.1:{port} ({flag})"
    assert failed[0]["error"] == os.strerror(errno.EADDRINUSE)  # the system's words, alone
    assert "Traceback" not in done.stderr
    # It never started, so it does not say it is stopping either.
    events = [r["event"] for r in lines]
    assert "matchmaker_started" not in events and "matchmaker_stopping" not in events
    assert "matchmaker_stopped" not in events


STOPS_THEN_SIGNALLED = """
import os, signal
from matchmaker.__main__ import run_daemon
from matchmaker.settings import Settings

async def serve():
    pass

status = run_daemon(Settings(), serve)
os.kill(os.getpid(), signal.SIGTERM)  # a second stop signal, after the daemon stopped
os.kill(os.getpid(), signal.SIGINT)
print("exiting with", status, flush=True)
"""


def test_a_stop_signal_after_the_daemon_stopped_does_not_change_its_exit_status() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STOPS_THEN_SIGNALLED],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting with 0"


def test_startup_fields_are_what_an_operator_checks() -> None:
    fields = Settings(allow_private=True, list_limit=5000).startup_fields()
    assert fields["allow_private"] is True and fields["list_limit"] == 5000
    assert fields["max_connections"] == 20000 and fields["max_hosts_per_ip"] == 16
    assert fields["register_rate"] == "1/s burst 10" and fields["master"] == "off"
    assert Settings(master=True).startup_fields()["master"] == 27011


def test_startup_fields_mask_only_a_password() -> None:
    assert Settings().startup_fields()["store"] == "memory://"
    masked = Settings(store="redis://user:pw@redis:6379/0").startup_fields()["store"]
    assert masked == "redis://user:***@redis:6379/0"
    assert (
        Settings(store="redis://redis:6379/0").startup_fields()["store"] == "redis://redis:6379/0"
    )


# -- a capped list says so ------------------------------------------------------------------


async def http_get(address: tuple[str, int], target: str) -> Any:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return json.loads(data.partition(b"\r\n\r\n")[2])


async def test_servers_says_when_the_answer_reached_its_limit(daemon: Matchmaker) -> None:
    udp_host, udp_port = daemon.udp_address
    hosts = []
    try:
        for i in range(3):
            game, _ = await accepting_endpoint()
            mm = MatchmakerClient.to(udp_host, udp_port, via=game)
            hosts.append((game, mm))
            await mm.register(**(HOST | {"name": f"h{i}"}))
        capped = await http_get(daemon.http_address, "/servers?game=q3&limit=2")
        assert capped["total"] == 2 and capped["limit"] == 2 and capped["limit_reached"] is True
        whole = await http_get(daemon.http_address, "/servers?game=q3")
        assert whole["total"] == 3 and whole["limit"] == 1000 and whole["limit_reached"] is False
        every = await http_get(daemon.http_address, "/servers")
        assert every["total"] == 3 and every["limit_reached"] is False
        lister = hosts[0][1]
        cut = await lister.list_servers(game="q3", limit=2)
        assert len(cut) == 2 and cut.limit == 2 and cut.limit_reached is True
        full = await lister.list_servers(game="q3")
        assert len(full) == 3 and full.limit == 1000 and full.limit_reached is False
        assert "limit=1000" in repr(full)
    finally:
        for game, mm in hosts:
            await mm.close()
            await game.close()


async def test_a_list_that_stopped_looking_says_so(
    daemon: Matchmaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request examines at most scan_budget(limit) hosts; here 16 (of 40), and 5
    # hosts match: an answer for at most 10 that examined 16 may have left some out.
    monkeypatch.setattr(listing, "SCAN_MIN", 16)
    monkeypatch.setattr(listing, "SCAN_PER_HOST", 1)
    for i in range(40):
        name = f"match {i}" if i % 8 == 0 else f"other {i}"
        info = HostInfo(**(HOST | {"name": name}))
        await daemon.registry.upsert(Address(f"198.51.100.{i + 1}", 27960), info, max_per_ip=9)
    partial = await http_get(daemon.http_address, "/servers?game=q3&name=MATCH&limit=10")
    assert partial["total"] <= 5 and partial["limit"] == 10
    assert partial["limit_reached"] is True and partial["partial"] is True
    assert all(s["name"].startswith("match") for s in partial["servers"])
    # Few enough candidates for a pass (a budget of 40): every match, and no flag.
    whole = await http_get(daemon.http_address, "/servers?game=q3&name=MATCH&limit=40")
    assert whole["total"] == 5 and whole["limit_reached"] is False and "partial" not in whole
    game, _ = await accepting_endpoint()
    lister = MatchmakerClient.to(*daemon.udp_address, via=game)
    try:
        cut = await lister.list_servers(game="q3", name="match", limit=10)
        assert len(cut) <= 5 and cut.partial is True and cut.limit_reached is True
        assert "partial=True" in repr(cut)
        full = await lister.list_servers(game="q3", name="match", limit=40)
        assert len(full) == 5 and full.partial is False and full.limit_reached is False
    finally:
        await lister.close()
        await game.close()


# -- the examples and the Makefile ----------------------------------------------------------


@pytest.mark.parametrize("script", ["game_host.py", "game_client.py"])
def test_the_examples_help_shows_their_defaults(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "(default: 127.0.0.1:27950)" in " ".join(done.stdout.split())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_names_the_package_when_python_has_no_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-s", "PYTHON=false", f"VENV={venv}", f"{venv}/.created"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode != 0
    assert "apt-get install python3-venv" in done.stderr
    assert not venv.exists()


# -- addresses: IPv6 ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bind", "families"),
    [
        ("127.0.0.1", {socket.AF_INET}),
        ("::1", {socket.AF_INET6}),
        ("::", {socket.AF_UNSPEC}),
        (None, {socket.AF_UNSPEC}),  # no via: the client's own socket follows the address
    ],
)
async def test_replica_names_are_resolved_for_what_the_game_socket_reaches(
    bind: str | None, families: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: set[int] = set()
    loop = asyncio.get_running_loop()

    async def getaddrinfo(host: str, port: int, *, family: int = 0, **kw: Any) -> Any:
        asked.add(family)
        v4 = (socket.AF_INET, socket.SOCK_DGRAM, 0, "", ("192.0.2.1", port))
        v6 = (socket.AF_INET6, socket.SOCK_DGRAM, 0, "", ("2001:db8::1", port, 0, 0))
        return {socket.AF_INET: [v4], socket.AF_INET6: [v6]}.get(family, [v6, v4])

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    game = await rudp.open_endpoint(bind) if bind is not None else None
    try:
        mm = MatchmakerClient.to("mm.example.net", 27950, via=game)
        routes = [label for label, _ in await mm._routes()]
        assert asked == families
        want = {
            socket.AF_INET: ["192.0.2.1:27950"],
            socket.AF_INET6: ["[2001:db8::1]:27950"],
            socket.AF_UNSPEC: ["[2001:db8::1]:27950", "192.0.2.1:27950"],
        }[next(iter(families))]
        assert routes == want
    finally:
        if game is not None:
            await game.close()


async def test_ipv6_addresses_are_socket_addresses_and_address_is_host_and_port() -> None:
    async def hold(conn: rudp.Connection) -> None:
        await conn.wait_closed()

    async with await rudp.serve(hold, "::1", 0) as server:
        assert server.address == ("::1", server.address[1])
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        host, port, flowinfo, scope_id = conn.remote_address  # what the socket module gives
        assert (host, port) == server.address and conn.remote_address[:2] == server.address
        assert len(conn.local_address) == 4
        await asyncio.wait_for(conn.close(), 5)
