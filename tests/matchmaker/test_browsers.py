"""A game host seen by server browsers: A2S answers fed from its listing, and the
README's example host as python-a2s and qstat see it."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest

import rudp
from matchmaker.browsers import a2s_info, listing_rules, serve_browsers
from matchmaker.server import Matchmaker
from rudp.a2s import Player
from rudp.tokens import generate_issuer_key, issuer_public_key
from tests.matchmaker.helpers import info

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QSTAT = shutil.which("quakestat")


def test_a2s_info_says_what_the_listing_says() -> None:
    host = info("Arena 1", game="arena", map="field", players=3, password=True, tags=("ctf", "eu"))
    a2s = a2s_info(host, 27960, app_id=480)
    assert (a2s.name, a2s.map, a2s.folder, a2s.game) == ("Arena 1", "field", "arena", "arena")
    assert (a2s.players, a2s.max_players, a2s.password, a2s.version) == (3, 8, True, "1")
    assert (a2s.port, a2s.keywords, a2s.app_id) == (27960, "ctf,eu", 480)
    assert listing_rules(host) == {"game": "arena", "version": "1", "tags": "ctf,eu"}


async def test_serve_browsers_follows_the_listing_and_the_game() -> None:
    a2s = pytest.importorskip("a2s")
    current = [info("Before", game="arena", region="eu")]
    async with await rudp.serve(lambda conn: conn.close(), "127.0.0.1", 0) as server:
        serve_browsers(
            server,
            lambda: current[0],
            players=lambda: [Player("alice", 7, 1.0)],
            rules=lambda: {"mode": "ctf"},
        )
        assert (await a2s.ainfo(server.address, timeout=5)).server_name == "Before"
        current[0] = info("After", game="arena", region="eu")
        assert (await a2s.ainfo(server.address, timeout=5)).server_name == "After"
        assert [p.name for p in await a2s.aplayers(server.address, timeout=5)] == ["alice"]
        rules = await a2s.arules(server.address, timeout=5)
        assert rules == {"game": "arena", "version": "1", "region": "eu", "mode": "ctf"}


async def test_the_example_host_as_server_browsers_see_it(daemon: Matchmaker) -> None:
    a2s = pytest.importorskip("a2s")
    mm = f"127.0.0.1:{daemon.udp_address[1]}"
    host = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLES / "game_host.py"), "--bind", "127.0.0.1", "--port", "0",
        "--matchmaker", mm, "--name", "Browsed arena",
        "--issuer-key", issuer_public_key(generate_issuer_key()).hex(),  # (it requires tokens)
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert host.stdout is not None
        line = (await asyncio.wait_for(host.stdout.readline(), 60)).decode()
        assert line.startswith("listed as 127.0.0.1:"), line
        port = int(line.split()[2].rpartition(":")[2])
        seen = await a2s.ainfo(("127.0.0.1", port), timeout=5)
        assert (seen.server_name, seen.folder, seen.map_name) == ("Browsed arena", "arena", "field")
        assert (seen.player_count, seen.max_players, seen.port) == (0, 8, port)
        if QSTAT is not None:
            proc = await asyncio.create_subprocess_exec(
                QSTAT, "-a2s", f"127.0.0.1:{port}", "-raw", "\t", "-timeout", "5",
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            fields = out.decode().splitlines()[0].split("\t")
            assert fields[2:5] == ["Browsed arena", "field", "8"]
    finally:
        host.terminate()
        await host.wait()
