"""examples/game_host.py and examples/game_client.py, as a user runs them, on loopback.

The matchmaker runs in the test's loop; the host and the clients are subprocesses. Every
wait is bounded; nothing is asserted about timing, only about what the programs did.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from matchmaker.addresses import Address
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import eventually

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE = 60.0


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
        "--name", "Test arena", "--exit-after", "2",
    )  # fmt: skip
    try:
        assert host.stdout is not None
        line = (await asyncio.wait_for(host.stdout.readline(), DEADLINE)).decode()
        assert line.startswith("listed as 127.0.0.1:"), line
        address = Address("127.0.0.1", int(line.split()[2].rpartition(":")[2]))
        entry = daemon.registry.get(address)
        assert entry is not None and entry.info.name == "Test arena"

        clients = [
            await start("game_client.py", "--name", name, "--matchmaker", mm,
                        "--seconds", "1.5", "--seed", str(seed))
            for seed, name in enumerate(("alice", "bob"))
        ]  # fmt: skip
        results = [await finish(proc) for proc in clients]
        for (code, out), name in zip(results, ("alice", "bob"), strict=True):
            assert code == 0, out
            assert f"'Test arena' at {address.ip}:{address.port}" in out  # browsed, pinged
            assert f"[chat] {name}: hello from {name}" in out  # the host relayed its chat
            assert " snapshots (last tick " in out and "position (" in out

        code, out = await finish(host)
        assert code == 0, out
        assert out.count("joined: ") == 2 and out.count("introduced to 127.0.0.1:") == 2
        assert "left: alice" in out and "left: bob" in out and "closed" in out
        # The host unregistered as it stopped.
        await eventually(lambda: daemon.registry.get(address) is None)
    finally:
        if host.returncode is None:
            host.kill()
            await host.wait()


async def test_client_without_a_host_says_so_and_fails(daemon: Matchmaker) -> None:
    client = await start("game_client.py", "--matchmaker", f"127.0.0.1:{daemon.udp_address[1]}")
    code, out = await finish(client)
    assert code == 1
    assert "no arena host answered" in out
