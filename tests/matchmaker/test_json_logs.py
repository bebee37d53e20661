"""The daemon in JSON log mode: every line it writes on stderr is one JSON object.

Its own structlog events, rudp's stdlib records, asyncio's "Task exception was
never retrieved" and warnings all go through one handler (matchmaker/logging.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

import pytest

from matchmaker.client import MatchmakerClient, MatchmakerError
from matchmaker.logging import rudp_fields
from matchmaker.messages import ErrorReason, InfoRequest, encode
from tests.matchmaker.helpers import accepting_endpoint

# `python -m matchmaker`, with one fault injected where nothing from outside can
# reach an error: the info reply (asked over a connection, and as an unconnected
# query, which rudp's endpoint answers), plus a task nobody awaits and a warning.
DAEMON = """
import asyncio, runpy, sys, warnings
from matchmaker.server import Matchmaker
from matchmaker.service import MatchmakerService

def info_reply(self, request_id):
    raise RuntimeError("injected fault")

async def fail():
    raise RuntimeError("nobody awaits this task")

start = Matchmaker.start

async def start_then_misbehave(self):
    await start(self)
    asyncio.get_running_loop().create_task(fail())  # dropped: "never retrieved"
    warnings.warn("injected warning", UserWarning, stacklevel=1)

MatchmakerService.info_reply = info_reply
Matchmaker.start = start_then_misbehave
sys.argv = ["matchmaker", *sys.argv[1:]]
runpy.run_module("matchmaker", run_name="__main__")
"""

ARGS = ["--bind", "127.0.0.1", "--port", "0", "--http-bind", "127.0.0.1", "--http-port", "0"]
ARGS += ["--allow-private", "--shutdown-timeout", "3", "--log-format", "json"]
HOST: dict[str, Any] = {"name": "json host", "game": "q3", "version": "1", "max_players": 8}


async def run_daemon(*args: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, MATCHMAKER_STORE="memory://")
    return await asyncio.create_subprocess_exec(
        *args, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )


def parse(lines: list[bytes]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        record = json.loads(line)  # fails the test on any line that is not JSON
        assert isinstance(record, dict), line
        records.append(record)
    return records


async def test_every_stderr_line_is_json_from_start_to_sigterm() -> None:
    proc = await run_daemon(sys.executable, "-c", DAEMON, *ARGS)
    assert proc.stderr is not None
    lines: list[bytes] = []
    try:
        while True:  # the warning and the dropped task may come first
            line = await asyncio.wait_for(proc.stderr.readline(), 20)
            assert line, "the daemon exited"
            lines.append(line)
            started = json.loads(line)
            if started.get("event") == "matchmaker_started":
                break
        host_ip, port = started["udp"].rsplit(":", 1)
        game, _ = await accepting_endpoint()
        client = MatchmakerClient.to(host_ip, int(port), via=game)
        try:
            await asyncio.wait_for(client.register(**HOST), 10)
            with pytest.raises(MatchmakerError) as failed:
                await asyncio.wait_for(client.info(), 10)
            assert failed.value.reason is ErrorReason.INTERNAL
            request = encode(InfoRequest(request_id=7))
            with pytest.raises(TimeoutError):
                await game.query((host_ip, int(port)), request, timeout=0.5)
        finally:
            await client.close()
            await game.close()
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 20)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines += rest.splitlines()
    records = parse(lines)
    by_event = {r["event"]: r for r in records}
    for event in ("host_registered", "host_removed", "matchmaker_stopping", "matchmaker_stopped"):
        assert by_event[event]["level"] == "info", event
        assert by_event[event]["logger"].startswith("matchmaker."), event
    # The daemon's own error, with its connection's context and traceback.
    failed_request = by_event["request_failed"]
    assert failed_request["level"] == "error"
    assert "injected fault" in failed_request["exception"]
    assert failed_request["peer"] == f"127.0.0.1:{game.address[1]}"
    # rudp's (a stdlib record): its key=value pairs became fields.
    query_failed = by_event["query_handler_failed"]
    assert query_failed["logger"] == "rudp.aio.endpoint"
    assert query_failed["level"] == "error"
    assert query_failed["peer"] == f"127.0.0.1:{game.address[1]}"
    assert "injected fault" in query_failed["exception"]
    assert "timestamp" in query_failed
    # asyncio's and the warnings module's.
    (dropped,) = [r for r in records if "nobody awaits this task" in r.get("exception", "")]
    assert dropped["logger"] == "asyncio" and dropped["level"] == "error"
    assert dropped["event"].startswith("Task exception was never retrieved")
    (warned,) = [r for r in records if "injected warning" in r["event"]]
    assert warned["logger"] == "py.warnings" and warned["level"] == "warning"
    assert records[-1]["event"] == "matchmaker_stopped"


async def test_a_failed_start_is_logged_as_json_and_exits_3() -> None:
    # A real error, nothing injected: the UDP port is taken (exit status 3, one line).
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = str(taken.getsockname()[1])
        args = [*ARGS[:2], "--port", port, *ARGS[4:]]
        proc = await run_daemon(sys.executable, "-m", "matchmaker", *args)
        assert proc.stderr is not None
        out = await asyncio.wait_for(proc.stderr.read(), 20)
        assert await asyncio.wait_for(proc.wait(), 20) == 3
    records = parse(out.splitlines())
    assert records[-1]["event"] == "port_unavailable"
    assert records[-1]["level"] == "error"
    assert "Address already in use" in records[-1]["error"]


def fields(template: str, *args: object) -> dict[str, Any]:
    """What `rudp_fields` makes of a stdlib record (as ProcessorFormatter hands it over)."""
    record = logging.LogRecord("rudp.test", logging.INFO, __file__, 1, template, args, None)
    event = {"event": record.getMessage(), "_record": record, "positional_args": args}
    out = rudp_fields(None, "info", event)
    return {k: v for k, v in out.items() if k != "_record"}


def test_rudp_records_become_fields_and_others_keep_their_message() -> None:
    assert fields("send_error peer=%s error=%r", "192.0.2.1:5", "refused") == {
        "event": "send_error",
        "peer": "192.0.2.1:5",
        "error": "refused",
    }
    assert fields("desync turn=%d diverged=%s", 12, "1,3") == {
        "event": "desync",
        "turn": 12,
        "diverged": "1,3",
    }
    assert fields("bad peer=%s", ("192.0.2.1", 5))["peer"] == "('192.0.2.1', 5)"
    assert fields("nothing_else") == {"event": "nothing_else"}
    # Anything else (asyncio's, warnings, a sentence) keeps its whole message.
    assert fields("Task exception was never retrieved") == {
        "event": "Task exception was never retrieved"
    }
    assert fields("closing %s now", "x") == {"event": "closing x now"}
    assert fields("count n=%d more", 3) == {"event": "count n=3 more"}
