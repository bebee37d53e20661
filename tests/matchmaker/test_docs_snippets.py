"""Code blocks of docs/matchmaker.md, run as written against a matchmaker on loopback.

Each block is executed with top-level ``await`` in a namespace of its own; only the
addresses are rewritten (the matchmaker's port, loopback, a free game port), so the
snippets a reader copies are the ones tested.
"""

from __future__ import annotations

import ast
import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rudp
from matchmaker.server import Matchmaker
from tests.matchmaker.helpers import eventually, settings

DOC = (Path(__file__).parents[2] / "docs" / "matchmaker.md").read_text()
DEADLINE = 10.0


def python_block(containing: str) -> str:
    """The one ```python block of the doc that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC, re.S) if containing in b]
    assert len(blocks) == 1, containing
    return blocks[0]


def localize(source: str, mm_port: int) -> str:
    return source.replace('"mm.example.net", 27950', f'"127.0.0.1", {mm_port}').replace(
        '"0.0.0.0", 27960', '"127.0.0.1", 0'
    )


async def run(source: str, namespace: dict[str, Any]) -> None:
    code = compile(source, "docs/matchmaker.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # the doc's own snippet, with top-level await
    if result is not None:
        await result


@pytest.fixture
async def daemon() -> AsyncIterator[Matchmaker]:
    """A matchmaker on loopback that signs connect tokens."""
    mm = Matchmaker(settings(ephemeral_issuer_key=True))
    await mm.start()
    yield mm
    await mm.shutdown()


async def test_host_and_client_snippets_join_through_the_serve_handler(
    daemon: Matchmaker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = daemon.udp_address[1]
    players: asyncio.Queue[rudp.Connection] = asyncio.Queue()
    # The files the snippets read: the matchmaker's public key and the host's key.
    assert daemon.issuer is not None
    (tmp_path / "issuer.key.pub").write_text(daemon.issuer.public_key.hex() + "\n")
    (tmp_path / "host.key").write_bytes(rudp.generate_key())
    monkeypatch.chdir(tmp_path)

    async def handle_player(conn: rudp.Connection) -> None:
        identity = conn.peer_identity
        assert identity is not None and identity.user_data == b"player=ada"
        await players.put(conn)
        async for msg in conn:
            conn.send(b"echo:" + msg.data)

    host: dict[str, Any] = {"handle_player": handle_player}
    client: dict[str, Any] = {}
    hosting = asyncio.create_task(run(localize(python_block("rudp.serve("), port), host))
    try:

        def listed() -> bool:
            info = host["mm"].host_info if "mm" in host else None
            return hosting.done() or (info is not None and info.players == 3)

        await eventually(listed)
        assert not hosting.done(), hosting.exception()

        block = python_block("rudp.open_endpoint(")
        await asyncio.wait_for(run(localize(block, port), client), DEADLINE)
        assert not hosting.done(), hosting.exception()
        # The client's connection reached the host's serve handler, not a connect() call.
        joined = await asyncio.wait_for(players.get(), DEADLINE)
        assert joined.remote_address[1] == client["endpoint"].address[1]
        conn: rudp.Connection = client["conn"]
        conn.send(b"hi")
        reply = await asyncio.wait_for(conn.recv(), DEADLINE)
        assert reply.data == b"echo:hi"
        await eventually(lambda: "intro" in host)  # the host was told, and punched
        assert host["intro"].nonce == client["ticket"].introduction.nonce
        assert conn.server_authenticated  # NK to the key the matchmaker vouched for
        assert client["ticket"].host_key == host["game"].public_key
        # A plain connect() to the host is refused: it requires a token.
        with pytest.raises(rudp.ConnectRefused, match="requires a connect token"):
            await rudp.connect(*host["game"].address[:2])

        # "Server info from the hosts themselves": its two halves, host and client.
        browser = host | {k: client[k] for k in ("endpoint", "servers")}
        await asyncio.wait_for(run(python_block("query_servers("), browser), DEADLINE)
        (status,) = browser["statuses"]
        assert status.info is not None and status.info.name == "Friday night"
        assert status.info.players == 3 and status.ping is not None
        assert status.info.key == host["game"].public_key  # server info carries the key
        await conn.close()
        await client["mm"].close()
        await client["endpoint"].close()
    finally:
        hosting.cancel()
        await asyncio.gather(hosting, return_exceptions=True)
        if "mm" in host:
            await host["mm"].close()
        if "game" in host:
            await host["game"].close()
