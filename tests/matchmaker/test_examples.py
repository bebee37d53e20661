"""examples/game_host.py and examples/game_client.py, as a user runs them, on loopback:
the clients list, get an introduction with a connect token and join; a plain
``rudp.connect()`` to the host is refused.

The matchmaker runs in the test's loop; the host and the clients are subprocesses. Every
wait is bounded; nothing is asserted about timing, only about what the programs did.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rudp
from matchmaker.addresses import Address
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import eventually, settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE = 60.0


@pytest.fixture
async def daemon() -> AsyncIterator[Matchmaker]:
    """A matchmaker on loopback that signs connect tokens (the example host requires them)."""
    mm = Matchmaker(settings(ephemeral_issuer_key=True))
    await mm.start()
    yield mm
    await mm.shutdown()


def issuer(daemon: Matchmaker) -> list[str]:
    """The examples' flag naming the daemon's issuing public key."""
    assert daemon.issuer is not None
    return ["--issuer-key", daemon.issuer.public_key.hex()]


async def start(script: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def finish(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), DEADLINE)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_two_players_find_the_host_through_the_matchmaker_and_play(
    daemon: Matchmaker,
) -> None:
    mm = f"127.0.0.1:{daemon.udp_address[1]}"
    host = await start(
        "game_host.py", "--bind", "127.0.0.1", "--port", "0", "--matchmaker", mm,
        "--name", "Test arena", "--exit-after", "2", *issuer(daemon),
    )  # fmt: skip
    try:
        assert host.stdout is not None
        line = (await asyncio.wait_for(host.stdout.readline(), DEADLINE)).decode()
        assert line.startswith("listed as 127.0.0.1:"), line
        address = Address("127.0.0.1", int(line.split()[2].rpartition(":")[2]))
        entry = daemon.registry.get(address)
        assert entry is not None and entry.info.name == "Test arena"
        assert len(entry.info.key) == 32  # the host registered its key

        # A plain connect() is refused: the host requires a token.
        with pytest.raises(rudp.ConnectRefused, match="requires a connect token"):
            await rudp.connect(address.ip, address.port)
        with pytest.raises(rudp.ConnectRefused, match="requires a connect token"):
            await rudp.connect(address.ip, address.port, server_key=entry.info.key)

        clients = [
            # A host process just started can take over a second to answer on a
            # loaded machine: the wait is bounded, not short.
            await start("game_client.py", "--name", name, "--matchmaker", mm,
                        "--seconds", "1.5", "--seed", str(seed), "--query-timeout", "10",
                        *issuer(daemon))
            for seed, name in enumerate(("alice", "bob"))
        ]  # fmt: skip
        results = [await finish(proc) for proc in clients]
        for (code, out), name in zip(results, ("alice", "bob"), strict=True):
            assert code == 0, out
            assert f"'Test arena' at {address.ip}:{address.port}" in out  # browsed, pinged
            assert f"[chat] {name}: hello from {name}" in out  # the host relayed its chat
            assert " snapshots (last tick " in out and "position (" in out
            # Joined on its token: the host read back the user data the client sent.
            sent = repr(f"name={name}".encode())
            assert f"joined with a token for user data {sent}; the host read {sent}" in out

        code, out = await finish(host)
        assert code == 0, out
        assert out.count("joined: ") == 2 and out.count("introduced to 127.0.0.1:") == 2
        assert "user data b'name=alice'" in out and "user data b'name=bob'" in out
        assert "left: alice" in out and "left: bob" in out and "closed" in out
        # The host unregistered as it stopped.
        await eventually(lambda: daemon.registry.get(address) is None)
    finally:
        if host.returncode is None:
            host.kill()
            await host.wait()


async def test_client_without_a_host_says_so_and_fails(daemon: Matchmaker) -> None:
    mm = f"127.0.0.1:{daemon.udp_address[1]}"
    client = await start("game_client.py", "--matchmaker", mm, *issuer(daemon))
    code, out = await finish(client)
    assert code == 1
    assert "no arena host answered" in out
