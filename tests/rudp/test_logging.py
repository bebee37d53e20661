"""rudp logs through the standard library only, one convention everywhere (docs/api.md)."""

from __future__ import annotations

import ast
import asyncio
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rudp

ROOT = Path(rudp.__file__).parent
# "event_name key=%s key=%r ...": the event, then one placeholder per key.
TEMPLATE = re.compile(r"[a-z][a-z0-9_]*(?: [a-z][a-z0-9_]*=%[sdr])*")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}

USE_WITHOUT_STRUCTLOG = """
import asyncio, sys
import rudp, rudp.lockstep, rudp.netsim, rudp.netsim.proxy

async def main():
    async def echo(conn):
        async for msg in conn:
            conn.send(msg.data)

    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        conn = await rudp.connect(*server.address)
        conn.send(b"ping")
        assert (await conn.recv()).data == b"ping"
        await conn.close()

rudp.run(main())
assert "structlog" not in sys.modules, "rudp imported structlog"
"""


def test_rudp_never_imports_structlog() -> None:
    # A fresh interpreter: this one has imported the matchmaker (and structlog).
    subprocess.run([sys.executable, "-c", USE_WITHOUT_STRUCTLOG], check=True, timeout=60)


def log_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "log"
        and node.func.attr in LEVELS
    ]


MODULES = sorted(
    p for package in ("aio", "lan", "lockstep", "netsim") for p in (ROOT / package).rglob("*.py")
)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_log_calls_follow_the_convention(path: Path) -> None:
    source = path.read_text()
    assert "structlog" not in source
    if "log = " in source:
        assert "log = logging.getLogger(__name__)" in source
    for call in log_calls(path):
        where = f"{path.name}:{call.lineno}"
        assert call.args and isinstance(call.args[0], ast.Constant), where
        template = call.args[0].value
        assert isinstance(template, str) and TEMPLATE.fullmatch(template), where
        assert template.count("=") == len(call.args) - 1, where
        assert not call.keywords, where  # values go in the message, not in extra=


def failing_query(payload: bytes, address: tuple[Any, ...]) -> bytes | None:
    raise RuntimeError("query handler bug")


async def test_records_reach_stdlib_logging(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="rudp")

    async def handler(conn: rudp.Connection) -> None:
        def receiver(msg: rudp.MessageReceived) -> None:
            raise RuntimeError("receiver bug")

        conn.set_receiver(receiver)
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        server.on_query = failing_query
        conn = await rudp.connect(*server.address)
        conn.send(b"boom")
        await asyncio.wait_for(conn.wait_closed(), 5)
        with pytest.raises(TimeoutError):
            await server.query(server.address, b"q", timeout=0.2)
        peer = f"127.0.0.1:{conn.local_address[1]}"
    by_event = {r.msg.split(" ")[0]: r for r in caplog.records if isinstance(r.msg, str)}
    failed = by_event["receiver_failed"]
    assert failed.name == "rudp.aio.connection"
    assert failed.levelno == logging.ERROR and failed.exc_info is not None
    assert failed.getMessage() == f"receiver_failed peer={peer}"
    query_failed = by_event["query_handler_failed"]
    assert query_failed.name == "rudp.aio.endpoint"
    assert query_failed.levelno == logging.ERROR and query_failed.exc_info is not None
    assert (
        query_failed.getMessage()
        == f"query_handler_failed peer={server.address[0]}:{server.address[1]} count=1"
    )


async def test_nothing_is_logged_at_info_on_the_message_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="rudp")

    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)

    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        conn = await rudp.connect(*server.address)
        for i in range(100):
            conn.send(b"%d" % i)
            assert (await asyncio.wait_for(conn.recv(), 5)).data == b"%d" % i
        await conn.close()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("rudp")] == []
