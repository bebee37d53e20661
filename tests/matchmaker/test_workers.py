"""Several worker processes behind one address (``--workers``): real supervisors and
workers on loopback sharing a real redis-server, game hosts on the stock client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import rudp
from matchmaker import workers as workers_module
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.master import STEAM_REPLY
from matchmaker.workers import (
    BACKOFF_MAX,
    SERVING,
    START_GRACE,
    STARTING,
    Supervisor,
    count_restarts,
    merge_expositions,
)
from tests.matchmaker.helpers import (
    HOST,
    DaemonProcess,
    RedisProcess,
    free_udp_port,
    settings,
)

N_HOSTS = 100
REHOME_WITHIN = 15.0
FLAGS = (
    "--workers", "2", "--max-hosts-per-ip", "10000", "--register-rate", "10000",
    "--register-burst", "10000", "--list-rate", "100", "--list-burst", "100",
    "--page-per-ip", "32", "--shutdown-timeout", "5",
    # A host heartbeats every second: a restarted worker's hosts are served again
    # within the 15 s bound with room to spare on a loaded machine.
    "--keepalive", "1",
)  # fmt: skip


def events(log: Path, name: str) -> list[dict[str, object]]:
    """The JSON log lines of one event."""
    return events_of(log.read_text(), name)


def events_of(text: str, name: str) -> list[dict[str, object]]:
    lines = [line for line in text.splitlines() if line.startswith("{") and line.endswith("}")]
    return [e for e in map(json.loads, lines) if e.get("event") == name]


async def until(check: object, timeout: float, what: str) -> None:
    """Poll an async predicate (bounded)."""
    deadline = time.monotonic() + timeout
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


@pytest.fixture
async def replica(redis_server: RedisProcess, tmp_path: Path) -> AsyncIterator[DaemonProcess]:
    master = ("--master", "--master-port", str(free_udp_port()))
    daemon = DaemonProcess(tmp_path, "r", redis_server.url, *FLAGS, *master)
    try:
        await daemon.start()

        async def both_up() -> bool:
            up = [await daemon.metric(f'matchmaker_worker_up{{worker="{i}"}}') for i in (0, 1)]
            return up == [1.0, 1.0]

        await until(both_up, 20, "both workers serving")
        yield daemon
    finally:
        # A SIGTERM first: a supervisor killed outright leaves its workers to notice
        # (within a second) and stop on their own.
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.signal(signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                await daemon.wait()
        daemon.kill()


async def register_hosts(
    daemon: DaemonProcess, n: int
) -> tuple[list[MatchmakerClient], list[rudp.Server], list[Address]]:
    # From 50 source addresses: the workers' group steers by source address.
    config = rudp.Config(channels=1)
    sockets = [
        await rudp.open_endpoint(f"127.0.0.{i % 50 + 1}", 0, config=config) for i in range(n)
    ]
    hosts = [MatchmakerClient.to([daemon.address], via=s) for s in sockets]
    addresses = list(await asyncio.gather(*(h.register(**HOST) for h in hosts)))
    return hosts, sockets, addresses


async def close_hosts(hosts: list[MatchmakerClient], sockets: list[rudp.Server]) -> None:
    await asyncio.gather(*(h.close() for h in hosts), return_exceptions=True)
    for s in sockets:
        s.endpoint.close_now()


async def listed(daemon: DaemonProcess) -> set[Address]:
    async with MatchmakerClient.to(*daemon.address, timeout=10.0) as lister:
        return {e.address for e in await lister.list_servers(game=HOST["game"], limit=N_HOSTS)}


async def lists_all(daemon: DaemonProcess, addresses: list[Address]) -> None:
    """Wait (bounded) until a list shows every host: the lister's worker follows the
    other's registrations through Redis."""

    async def every() -> bool:
        return await listed(daemon) == set(addresses)

    await until(every, 15, "a list does not show every registered host")


async def both_answered(daemon: DaemonProcess) -> dict[str, float]:
    """One scrape holding both workers' series (so an absent one is really absent).

    A sibling busy for longer than the scrape waits for it is left out of that
    scrape: on a loaded machine, scrape again (bounded)."""
    deadline = time.monotonic() + 20
    while True:
        samples = await daemon.samples()
        up = [samples.get(f'matchmaker_worker_up{{worker="{i}"}}') for i in (0, 1)]
        if up == [1.0, 1.0]:
            return samples
        assert time.monotonic() < deadline, f"workers up in every scrape: {up}"
        await asyncio.sleep(0.2)


async def owners(url: str, addresses: list[Address]) -> list[str | None]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        async with client.pipeline(transaction=False) as pipe:
            for address in addresses:
                pipe.hget(f"{{mm}}:h:{address.key}", "owner")
            raw = await pipe.execute()
    finally:
        await client.aclose()
    return [None if r is None else r.decode() for r in raw]


def created(worker: int) -> str:
    return f'matchmaker_registrations_total{{result="created",worker="{worker}"}}'


async def test_registrations_land_on_both_workers_and_a_list_sees_every_host(
    replica: DaemonProcess, redis_server: RedisProcess
) -> None:
    hosts, sockets, addresses = await register_hosts(replica, N_HOSTS)
    try:
        first = await both_answered(replica)
        per_worker = [first.get(created(i), 0.0) for i in (0, 1)]
        assert sum(per_worker) == N_HOSTS
        assert min(per_worker) > 0, f"one worker got every host: {per_worker}"
        await lists_all(replica, addresses)
        found = await owners(redis_server.url, addresses)
        assert set(found) == {"r-w0", "r-w1"}
        # One source address, one worker: the hosts of an address (two each, on
        # other ports) all registered with the same worker.
        by_ip: dict[str, set[str | None]] = {}
        for address, owner in zip(addresses, found, strict=True):
            by_ip.setdefault(address.ip, set()).add(owner)
        assert all(len(o) == 1 for o in by_ip.values()), by_ip
        # Each host heartbeats to the worker it registered with: same source address.
        samples = await both_answered(replica)
        for i in (0, 1):
            sample = f'matchmaker_heartbeats_total{{result="not_owner",worker="{i}"}}'
            assert samples.get(sample, 0.0) == 0
        print(f"registrations per worker: {per_worker}")
    finally:
        await close_hosts(hosts, sockets)


async def test_a_killed_worker_is_restarted_and_its_hosts_stay_listed(
    replica: DaemonProcess, redis_server: RedisProcess
) -> None:
    """Worker 0 dies: a group that lost a member (a socket the supervisor did not
    hold) would move the last member into its slot and remap worker 1's flows."""
    hosts, sockets, addresses = await register_hosts(replica, N_HOSTS)
    try:
        victim = next(e for e in events(replica.log_path, "worker_started") if e["index"] == 0)
        held = sum(o == "r-w0" for o in await owners(redis_server.url, addresses))
        assert held > 0
        os.kill(int(str(victim["pid"])), signal.SIGKILL)
        killed = time.monotonic()

        async def restarted() -> bool:
            return await replica.metric('matchmaker_worker_restarts_total{worker="0"}', 0.0) == 1.0

        async def served_again() -> bool:
            # The restarted worker (same socket, same replica id) answers its hosts.
            samples = await replica.samples()
            beats = samples.get('matchmaker_heartbeats_total{result="ok",worker="0"}', 0.0)
            moved = samples.get('matchmaker_heartbeats_total{result="taken_over",worker="0"}', 0.0)
            return beats + moved > 0

        await until(restarted, REHOME_WITHIN, "worker 0 not restarted")
        await until(served_again, REHOME_WITHIN, "worker 0's hosts not served again")
        # Worker 0's hosts waited on its socket: none of them reached worker 1.
        samples = await both_answered(replica)
        for result in ("not_owner", "taken_over", "not_registered"):
            sample = f'matchmaker_heartbeats_total{{result="{result}",worker="1"}}'
            assert samples.get(sample, 0.0) == 0, result
        live = {"r-w0", "r-w1"}
        assert set(await owners(redis_server.url, addresses)) <= live
        await lists_all(replica, addresses)
        assert time.monotonic() - killed < REHOME_WITHIN
        exits = events(replica.log_path, "worker_exited")
        assert [(e["index"], e["status"]) for e in exits] == [(0, -signal.SIGKILL)]
        again = sum(h.registrations > 1 for h in hosts)
        print(f"{held} hosts on the killed worker, {again} registered again, "
              f"served again {time.monotonic() - killed:.1f} s after SIGKILL")  # fmt: skip
    finally:
        await close_hosts(hosts, sockets)


async def test_sigterm_drains_every_worker_and_exits_0(replica: DaemonProcess) -> None:
    hosts, sockets, _ = await register_hosts(replica, 10)
    try:
        replica.signal(signal.SIGTERM)
        assert await replica.wait() == 0
    finally:
        await close_hosts(hosts, sockets)
    stopped = events(replica.log_path, "matchmaker_stopped")
    assert sorted(e["worker"] for e in stopped) == [0, 1]  # type: ignore[type-var]
    assert events(replica.log_path, "workers_stopped")[0]["statuses"] == "0,0"


def master_port(daemon: DaemonProcess) -> int:
    return int(daemon.args[daemon.args.index("--master-port") + 1])


async def test_the_master_port_answers_from_every_worker(replica: DaemonProcess) -> None:
    """Its sockets are a group like the rudp port's: a worker that did not read
    its own would leave about half of these queries unanswered."""
    hosts, sockets, _ = await register_hosts(replica, 5)

    async def both_see_them() -> bool:
        # Absent until a worker counts them (at most once a second, HOSTS_LISTED_MAX_AGE).
        name = f'matchmaker_hosts_listed{{game="{HOST["game"]}",worker='
        return [await replica.metric(f'{name}"{i}"}}', 0.0) for i in (0, 1)] == [5.0, 5.0]

    await until(both_see_them, 10, "a worker does not list the hosts the other registered")
    queries = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(16)]
    try:
        for i, q in enumerate(queries):
            q.bind((f"127.0.0.{i + 1}", 0))  # 16 sources: both workers get some
            q.settimeout(10)
            q.sendto(b"\x31\xff0.0.0.0:0\x00\x00", ("127.0.0.1", master_port(replica)))
        replies = [await asyncio.to_thread(q.recv, 1400) for q in queries]
        samples = await both_answered(replica)
        answered = [
            samples[f'matchmaker_master_queries_total{{result="answered",worker="{i}"}}']
            for i in (0, 1)
        ]
        assert sum(answered) == len(queries) and min(answered) > 0, answered
        # Each answer is no larger than its query (no amplification): one entry here.
        assert [r[: len(STEAM_REPLY)] for r in replies] == [STEAM_REPLY] * len(queries)
    finally:
        for q in queries:
            q.close()
        await close_hosts(hosts, sockets)


def test_workers_need_the_redis_store() -> None:
    cmd = [sys.executable, "-m", "matchmaker", "--workers", "2", "--port", "0", "--http-port", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--workers (MATCHMAKER_WORKERS): more than 1 needs a redis:// store" in done.stderr


def test_a_port_another_group_holds_is_refused_not_shared() -> None:
    """A second replica started on the port of a running one (its group set
    SO_REUSEPORT) fails at once instead of taking half its traffic."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        port = str(held.getsockname()[1])
        cmd = [sys.executable, "-m", "matchmaker", "--workers", "2", "--bind", "127.0.0.1"]
        cmd += ["--port", port, "--http-bind", "127.0.0.1", "--http-port", "0"]
        cmd += ["--store", "redis://127.0.0.1:1/0", "--log-format", "json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    line = events_of(done.stdout + done.stderr, "port_unavailable")[0]
    assert line["port"] == f"udp 127.0.0.1:{port} (--port)"


def test_workers_that_keep_dying_at_start_end_the_supervisor(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    config = settings(workers=2, store=redis_server.url, port=0, http_port=0)
    crash = [sys.executable, "-c", "import sys; sys.exit(7)"]
    supervisor = Supervisor(config, [], worker_command=crash)
    assert supervisor.run() == 1
    err = capsys.readouterr().err
    assert "exited 3 times in a row before serving (last exit status 7)" in err


def test_a_worker_starts_with_sigusr1_blocked_until_its_handler_is_in(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stack dump asked of a worker still starting cannot kill it (SIGUSR1's
    default action): the worker unblocks it once its handler is in place."""
    config = settings(workers=2, store=redis_server.url, port=0, http_port=0)
    blocked = "signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, [])"
    probe = [sys.executable, "-c", f"import signal, sys; sys.exit(8 if {blocked} else 9)"]
    supervisor = Supervisor(config, [], worker_command=probe)
    assert supervisor.run() == 1
    assert "(last exit status 8)" in capsys.readouterr().err
    assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # ours again


def test_reuseport_keeps_flows_on_their_member_while_the_group_keeps_its_size() -> None:
    """Why the supervisor holds every worker's socket: measured on this kernel."""

    def member(n: int, port: int = 0) -> list[socket.socket]:
        out = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", port))
            port = s.getsockname()[1]
            s.settimeout(5)
            out.append(s)
        return out

    def mapping(group: list[socket.socket], flows: list[socket.socket]) -> list[int]:
        port = group[0].getsockname()[1]
        where = {}
        for f in flows:
            f.sendto(b"x", ("127.0.0.1", port))
        for i, s in enumerate(group):
            s.setblocking(False)
            while True:
                try:
                    _, source = s.recvfrom(16)
                except BlockingIOError:
                    break
                where[source] = i
        return [where[f.getsockname()] for f in flows]

    group = member(3)
    flows = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(64)]
    try:
        for f in flows:
            f.bind(("127.0.0.1", 0))
        before = mapping(group, flows)
        assert set(before) == {0, 1, 2}
        # A worker dies, its socket held: the group keeps its size, no flow moves.
        assert mapping(group, flows) == before
        # Closed and bound again instead: the kernel remaps flows of members that lived.
        group[0].close()
        group[0] = member(1, group[1].getsockname()[1])[0]
        after = mapping(group, flows)
        moved = sum(a != b for a, b in zip(before, after, strict=True) if b != 0)
        assert moved > 0
    finally:
        for s in group + flows:
            s.close()


def test_merge_expositions_labels_every_series_by_worker() -> None:
    a = b'# HELP x_total X.\n# TYPE x_total counter\nx_total{r="a"} 1.0\n'
    b = b'# HELP x_total X.\n# TYPE x_total counter\nx_total{r="a"} 2.0\n'
    text = merge_expositions([("0", a), ("2", b)], 3).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [(s.labels, s.value) for s in families["x"].samples] == [
        ({"r": "a", "worker": "0"}, 1.0),
        ({"r": "a", "worker": "2"}, 2.0),
    ]
    up = {s.labels["worker"]: s.value for s in families["matchmaker_worker_up"].samples}
    assert up == {"0": 1.0, "1": 0.0, "2": 1.0}
    assert text.count("# TYPE x_total counter") == 1


def test_worker_restarts_are_a_counter_with_the_total_suffix() -> None:
    registry = CollectorRegistry()
    count_restarts(registry, 3)
    text = merge_expositions([("1", generate_latest(registry))], 2).decode()
    family = {f.name: f for f in text_string_to_metric_families(text)}["matchmaker_worker_restarts"]
    assert family.type == "counter"
    totals = [(s.name, s.labels, s.value) for s in family.samples if s.name.endswith("_total")]
    assert totals == [("matchmaker_worker_restarts_total", {"worker": "1"}, 3.0)]
    assert "matchmaker_worker_restarts{" not in text


# -- the supervisor's death, stops, the watchdog ------------------------------------------


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def is_worker(pid: int) -> bool:
    """Whether ``pid`` is still a worker (not a process that reused its pid)."""
    try:
        return b"matchmaker.workers" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


async def started_workers(daemon: DaemonProcess) -> list[int]:
    """The pids of both workers once the supervisor started them (bounded wait)."""

    async def both() -> bool:
        return len(events(daemon.log_path, "worker_started")) >= 2

    await until(both, 20, "the supervisor did not start its workers")
    return [int(str(e["pid"])) for e in events(daemon.log_path, "worker_started")]


async def gone(pids: list[int], what: str) -> None:
    async def none_alive() -> bool:
        return not any(map(alive, pids))

    await until(none_alive, 30, what)


async def stop(daemon: DaemonProcess) -> None:
    """SIGTERM (its workers drain and exit with it), then SIGKILL if need be."""
    if daemon.proc is not None and daemon.proc.poll() is None:
        daemon.signal(signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            await daemon.wait()
    daemon.kill()


def same_ports(daemon: DaemonProcess, tmp_path: Path, redis_url: str) -> DaemonProcess:
    again = DaemonProcess(tmp_path, "r2", redis_url)
    again.args, again.port, again.http_port = daemon.args, daemon.port, daemon.http_port
    return again


HUNG_STOP = """
import os, signal, time
from matchmaker.workers import _watch_lifeline
signal.signal(signal.SIGTERM, lambda *_: None)  # a stop that never ends
read, write = os.pipe()
_watch_lifeline(read, 0.5)
os.close(write)  # the supervisor is gone
time.sleep(60)
"""


def test_a_worker_whose_stop_hangs_ends_once_its_supervisor_is_gone() -> None:
    """No supervisor is left to kill it: the lifeline does, after the bound."""
    done = subprocess.run(
        [sys.executable, "-c", HUNG_STOP], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1, done.stderr
    assert "supervisor_gone" in done.stdout
    assert "worker_stop_overdue" in done.stdout


@pytest.mark.parametrize("when", ["starting", "serving"])
async def test_workers_stop_when_their_supervisor_is_killed(
    when: str, redis_server: RedisProcess, tmp_path: Path
) -> None:
    """Whenever the supervisor dies (before its workers serve, too), they stop and
    free the port for the next supervisor."""
    daemon = DaemonProcess(tmp_path, "r", redis_server.url, *FLAGS)
    again = same_ports(daemon, tmp_path, redis_server.url)
    pids: list[int] = []
    try:
        if when == "starting":
            daemon.launch()
            pids = await started_workers(daemon)
        else:
            await daemon.start()
            pids = await started_workers(daemon)
        daemon.kill()
        await gone(pids, f"a worker outlived its supervisor killed while {when}")
        await again.start()
    finally:
        for pid in filter(is_worker, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        daemon.kill()
        await stop(again)
    supervisor_gone = events(daemon.log_path, "supervisor_gone")
    assert len(supervisor_gone) == 2


async def test_a_stop_to_every_process_at_once_still_drains(replica: DaemonProcess) -> None:
    """systemd's default KillMode=control-group signals the supervisor and every
    worker: the forwarded second SIGTERM must not cut a worker's drain short."""
    hosts, sockets, _ = await register_hosts(replica, 10)
    pids = [int(str(e["pid"])) for e in events(replica.log_path, "worker_started")]
    try:
        replica.signal(signal.SIGTERM)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        replica.signal(signal.SIGTERM)
        assert await replica.wait() == 0
    finally:
        await close_hosts(hosts, sockets)
    assert events(replica.log_path, "workers_stopped")[0]["statuses"] == "0,0"
    assert len(events(replica.log_path, "matchmaker_stopped")) == 2


async def test_sigusr1_writes_the_stacks_of_the_supervisor_and_each_worker(
    replica: DaemonProcess,
) -> None:
    """Every process of a replica writes its threads' stacks on SIGUSR1, and serves on."""
    pids = [int(str(e["pid"])) for e in events(replica.log_path, "worker_started")]
    stacks = await replica.stacks()
    assert stacks.count("most recent call first") >= 1 + len(pids), stacks
    assert stacks.count(" in worker_main") == len(pids), stacks
    assert await replica.ready()
    assert all(os.kill(pid, 0) is None for pid in pids)  # none ended


async def test_a_stop_while_the_workers_start_exits_0(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    daemon = DaemonProcess(tmp_path, "r", redis_server.url, *FLAGS)
    try:
        daemon.launch()
        pids = await started_workers(daemon)
        daemon.signal(signal.SIGTERM)
        assert await daemon.wait() == 0
        await gone(pids, "a worker outlived a stop during its start")
    finally:
        daemon.kill()


# 6 s: a loaded machine can hold the other worker's loop for a few seconds too.
@pytest.mark.parametrize("watchdog", ["6", "600"])
async def test_a_hung_worker_is_reported_and_killed_by_the_watchdog(
    watchdog: str, redis_server: RedisProcess, tmp_path: Path
) -> None:
    """SIGSTOP: its flows black-holed; /healthz and /readyz say so, and after
    --worker-watchdog seconds the supervisor kills and restarts it."""
    daemon = DaemonProcess(tmp_path, "r", redis_server.url, *FLAGS, "--worker-watchdog", watchdog)
    pids: list[int] = []
    try:
        await daemon.start()
        pids = await started_workers(daemon)
        os.kill(pids[1], signal.SIGSTOP)
        if watchdog == "600":

            async def reported() -> bool:
                return await http_json(daemon, "/healthz") == (
                    200,
                    {"status": "degraded", "workers_down": [1]},
                )

            await until(reported, 20, "/healthz does not report the stopped worker")

            # Polled too: on a starved machine worker 1 may have been reported silent
            # before the SIGSTOP, and the beat it wrote just before it stopped read
            # after /healthz's answer (down, up, then down for good).
            async def not_ready() -> bool:
                status, ready = await http_json(daemon, "/readyz")
                return (status, ready.get("workers_down")) == (503, [1])

            await until(not_ready, 20, "/readyz does not report the stopped worker")
            os.kill(pids[1], signal.SIGCONT)

            async def healthy() -> bool:
                return await http_json(daemon, "/healthz") == (200, {"status": "ok"})

            await until(healthy, 20, "/healthz still reports the resumed worker")
            assert not events(daemon.log_path, "worker_hung")
        else:

            async def restarted() -> bool:
                return await daemon.metric('matchmaker_worker_restarts_total{worker="1"}', 0.0) == 1

            await until(restarted, 30, "the stopped worker was not restarted")
            await both_answered(daemon)
            # Worker 1's record (worker 0 is judged by the same rule: not asserted here).
            assert [e["index"] for e in events(daemon.log_path, "worker_hung")].count(1) == 1
            exits = events(daemon.log_path, "worker_exited")
            assert [e["status"] for e in exits if e["index"] == 1] == [-signal.SIGKILL]
    finally:
        for pid in filter(is_worker, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        await stop(daemon)


async def http_json(daemon: DaemonProcess, path: str) -> tuple[int, dict[str, object]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.http_port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        body = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, text = body.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), json.loads(text)


# -- the supervisor's own failures -------------------------------------------------------


def test_the_backoff_stays_bounded_after_any_number_of_deaths(
    redis_server: RedisProcess,
) -> None:
    supervisor = Supervisor(settings(workers=2, store=redis_server.url), [])
    slot = supervisor._slots[0]
    slot.serving, slot.quick_deaths = 100.0, 1024
    supervisor._exited(slot, -signal.SIGKILL, 101.0)
    assert slot.restart_at == 101.0 + BACKOFF_MAX


def test_a_worker_that_cannot_be_spawned_is_retried_then_ends_the_supervisor(
    redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    config = settings(workers=2, store=redis_server.url, port=0, http_port=0)
    supervisor = Supervisor(config, [], worker_command=["/nonexistent/python"])
    assert supervisor.run() == 1
    err = capsys.readouterr().err
    assert "exited 3 times in a row before serving" in err


# -- what every worker shares --------------------------------------------------------------


async def test_an_ephemeral_issuer_key_is_the_same_in_every_worker(
    redis_server: RedisProcess, tmp_path: Path
) -> None:
    flags = (*FLAGS, "--ephemeral-issuer-key")
    daemon = DaemonProcess(tmp_path, "r", redis_server.url, *flags)
    try:
        await daemon.start()
        pids = await started_workers(daemon)

        async def both_started() -> bool:
            return len(events(daemon.log_path, "matchmaker_started")) == 2

        await until(both_started, 20, "a worker did not log matchmaker_started")
        keys = {e["issuer_public"] for e in events(daemon.log_path, "matchmaker_started")}
        assert len(keys) == 1 and "" not in keys
        # Neither on a command line (ps) nor in the environment: an inherited pipe.
        for pid in pids:
            for source in ("cmdline", "environ"):
                text = Path(f"/proc/{pid}/{source}").read_bytes()
                assert not re.search(rb"[0-9a-fA-F]{64}", text), source
    finally:
        await stop(daemon)


async def test_rudp_series_carry_the_worker_label(replica: DaemonProcess) -> None:
    samples = await both_answered(replica)
    rudp_samples = [name for name in samples if name.startswith("rudp_")]
    assert rudp_samples
    for i in (0, 1):
        assert any(f'worker="{i}"' in name for name in rudp_samples), i
    assert all("worker=" in name for name in rudp_samples)


# -- the watchdog before serving, and silence the supervisor did not see -------------------


class _Running:
    """A worker process that runs until killed (as `_watchdog` and `_watch` see one)."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = False

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        self.killed = True


def test_a_worker_hung_before_its_first_sign_of_life_is_killed_after_the_start_grace(
    redis_server: RedisProcess,
) -> None:
    # The watchdog looked at serving workers only: one stopped or stuck while starting
    # was never killed, and its share of the sources was dropped for good.
    supervisor = Supervisor(settings(workers=2, store=redis_server.url), [])
    slot = supervisor._slots[1]
    proc = _Running()
    slot.proc, slot.started, slot.last_beat = proc, 0.0, 0.0  # type: ignore[assignment]
    supervisor._watchdog(slot, START_GRACE - 1.0)
    assert not proc.killed
    supervisor._watchdog(slot, START_GRACE + 1.0)
    assert proc.killed and slot.killed


def test_a_starting_worker_signs_of_life_and_is_watched_before_it_serves(
    redis_server: RedisProcess,
) -> None:
    supervisor = Supervisor(settings(workers=2, store=redis_server.url), [])
    slot = supervisor._slots[0]
    proc = _Running()
    read, write = os.pipe()
    os.set_blocking(read, False)
    try:
        slot.proc, slot.beat_fd = proc, read  # type: ignore[assignment]
        os.write(write, STARTING)
        supervisor._read_beats(slot, 5.0)
        assert slot.last_beat == 5.0 and slot.serving is None and slot.down(5.0)
        watchdog = supervisor.settings.worker_watchdog
        supervisor._watchdog(slot, 5.0 + START_GRACE - 0.5)
        assert not proc.killed  # alive, not serving yet: a long first load, say
        os.write(write, STARTING + SERVING)
        supervisor._read_beats(slot, 6.0)
        assert slot.serving == 6.0 and not slot.down(6.0)
        supervisor._watchdog(slot, 6.0 + watchdog + 0.5)
        assert proc.killed  # silent for the watchdog's time: killed as ever
    finally:
        os.close(write)
        os.close(read)
        slot.beat_fd = None


def test_silence_the_supervisor_did_not_see_is_not_held_against_the_workers(
    redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole replica frozen (a paused container) longer than --worker-watchdog:
    # the supervisor's first poll after the thaw came before the workers' beats and
    # killed healthy workers.
    supervisor = Supervisor(settings(workers=2, store=redis_server.url), [])
    clock = [1000.0]
    polls = [0]

    def sleep(seconds: float) -> None:
        polls[0] += 1
        clock[0] += seconds + (60.0 if polls[0] == 3 else 0.0)  # frozen for a minute
        if polls[0] == 6:
            supervisor._stopping = True

    monkeypatch.setattr(workers_module.time, "sleep", sleep)
    monkeypatch.setattr(workers_module.time, "monotonic", lambda: clock[0])
    procs = [_Running(), _Running()]
    for slot, proc in zip(supervisor._slots, procs, strict=True):
        slot.proc = proc  # type: ignore[assignment]
        slot.started = slot.last_beat = slot.serving = clock[0]
    try:
        assert supervisor._watch() is None
    finally:
        if supervisor._directory is not None:
            shutil.rmtree(supervisor._directory, ignore_errors=True)
    assert not any(proc.killed for proc in procs)
    # A worker silent while the supervisor watched is still killed.
    slot = supervisor._slots[0]
    supervisor._watchdog(slot, slot.last_beat + supervisor.settings.worker_watchdog + 1)
    assert procs[0].killed


async def test_a_stop_repeated_until_the_supervisor_exits_still_exits_0(
    replica: DaemonProcess,
) -> None:
    # After the drain the supervisor put the default actions back: a SIGTERM during
    # its exit ended it with status 143 although every worker had drained.
    assert replica.proc is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while replica.proc.poll() is None and loop.time() < deadline:
        with contextlib.suppress(ProcessLookupError):
            replica.signal(signal.SIGTERM)
        await asyncio.sleep(0.002)
    assert await replica.wait() == 0
    assert events(replica.log_path, "workers_stopped")[0]["statuses"] == "0,0"


def test_workers_without_a_writable_temporary_directory_are_refused_clearly(
    redis_server: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A read-only root filesystem without a /tmp: the supervisor logged a spawn failure
    # and a traceback, and exited.
    def no_tmp(prefix: str = "") -> str:
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.setattr(workers_module.tempfile, "mkdtemp", no_tmp)
    supervisor = Supervisor(settings(workers=2, store=redis_server.url), [])
    assert supervisor.run() == 1
    assert "needs a writable temporary directory" in capsys.readouterr().err
    assert all(slot.proc is None for slot in supervisor._slots)
