"""A stopping replica: it takes no new connection and refuses registrations with
``shutting_down`` from the moment its shutdown begins."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from matchmaker.addresses import Address
from matchmaker.messages import Error, ErrorReason, Register
from tests.matchmaker.fakes import settle
from tests.matchmaker.helpers import DaemonProcess, Harness, info, pub


async def test_a_stopping_replica_refuses_newcomers_and_registrations() -> None:
    h = Harness()
    early = h.connect(pub(1))
    await settle()  # connected before the stop
    h.service.stop_accepting()
    early.send(Register(request_id=7, host=info()))
    refused = await early.recv()
    assert isinstance(refused, Error) and refused.reason is ErrorReason.SHUTTING_DOWN
    assert refused.request_id == 7 and "another replica" in refused.detail
    late = h.connect(pub(2))
    late.send(Register(request_id=8, host=info()))
    assert await asyncio.wait_for(late.conn.inbox.get(), 2) is None  # closed, not served
    assert h.registry.get(Address(pub(2), 27960)) is None


async def test_close_all_takes_no_new_connection_after_it_began() -> None:
    h = Harness()
    await h.service.close_all()
    late = h.connect(pub(2))
    late.send(Register(request_id=1, host=info()))
    assert await asyncio.wait_for(late.conn.inbox.get(), 2) is None
    assert h.registry.get(Address(pub(2), 27960)) is None


LEFT_BEHIND = """
import asyncio, contextlib, sys
import matchmaker.__main__ as entry
from matchmaker.settings import Settings

entry.STOP_WITHIN = 0.5

async def serve():
    async def deaf():
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    async def polite():
        await asyncio.sleep(3600)

    if sys.argv[1] == "deaf":
        asyncio.get_running_loop().create_task(deaf(), name="deaf")
    asyncio.get_running_loop().create_task(polite(), name="polite")
    await asyncio.sleep(0.1)  # both started

sys.exit(entry.run_daemon(Settings(log_format="json"), serve))
"""


@pytest.mark.parametrize(("left", "status"), [("polite", 0), ("deaf", 1)])
def test_the_daemon_ends_whatever_its_tasks_do(left: str, status: int) -> None:
    """asyncio's own teardown waits for ever for a task that swallows its
    cancellation (redis-py can): the daemon's last step bounds it."""
    done = subprocess.run(
        [sys.executable, "-c", LEFT_BEHIND, left], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == status, done.stdout + done.stderr
    assert ("tasks_ignored_cancel" in done.stdout) == (left == "deaf"), done.stdout


HOLDER = """
import asyncio, sys
import rudp
from matchmaker.client import MatchmakerClient

async def main():
    game = await rudp.open_endpoint("127.0.0.1", 0)
    client = MatchmakerClient.to("127.0.0.1", int(sys.argv[1]), via=game, timeout=10.0)
    await client.info()
    print("connected", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def logged(daemon: DaemonProcess, name: str) -> int:
    text = daemon.log_path.read_text() if daemon.log_path.exists() else ""
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    return sum(e.get("event") == name for e in lines)


async def test_a_repeated_signal_does_not_cut_the_drain_short(tmp_path: Path) -> None:
    """SIGTERM, then SIGTERM and SIGHUP during the drain: still a clean stop (0)."""
    daemon = DaemonProcess(tmp_path, "r", "memory://", "--shutdown-timeout", "5")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(daemon.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        await daemon.start()
        assert holder.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 20)
        assert line == "connected\n"
        # A peer that answers nothing: the daemon's goodbye to it waits out the drain.
        holder.send_signal(signal.SIGSTOP)
        daemon.signal(signal.SIGTERM)
        for _ in range(200):
            if logged(daemon, "matchmaker_stopping"):
                break
            await asyncio.sleep(0.05)
        assert logged(daemon, "matchmaker_stopping") == 1
        daemon.signal(signal.SIGTERM)
        daemon.signal(signal.SIGHUP)
        assert await daemon.wait(30) == 0
        # At least the two sent: one run logged three (a signal handled twice),
        # which is a repeat like any other.
        assert logged(daemon, "stop_repeated") >= 2
        assert logged(daemon, "matchmaker_stopped") == 1
    finally:
        holder.kill()
        holder.wait()
        daemon.kill()


async def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """Started under ``nohup`` (SIGHUP ignored), the daemon outlives its terminal."""
    daemon = DaemonProcess(tmp_path, "r", "memory://")
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited by the daemon
    try:
        await daemon.start()
    finally:
        signal.signal(signal.SIGHUP, previous)
    try:
        daemon.signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
        assert await daemon.ready()
        assert logged(daemon, "stop_signal") == 0
        daemon.signal(signal.SIGTERM)
        assert await daemon.wait(30) == 0
        assert logged(daemon, "matchmaker_stopped") == 1
    finally:
        daemon.kill()


async def test_sigusr1_writes_every_threads_stack_and_changes_nothing(tmp_path: Path) -> None:
    """What to send a daemon that seems stuck: its stacks on stderr, and it serves on."""
    daemon = DaemonProcess(tmp_path, "r", "memory://")
    try:
        await daemon.start()
        stacks = await daemon.stacks()
        assert "most recent call first" in stacks, stacks
        assert "matchmaker" in stacks  # the daemon's own frames
        assert await daemon.ready()
        daemon.signal(signal.SIGTERM)
        assert await daemon.wait(30) == 0
        assert logged(daemon, "matchmaker_stopped") == 1
    finally:
        daemon.kill()
