"""A seeded run replays bit for bit: same datagrams, same order, same times.

One server and several clients on the in-memory network, under loss, duplication
and reordering, with traffic both ways in several delivery modes. The digest covers
every datagram put on the wire with its addresses and the time it was sent. It must
not depend on where objects land in memory (a ``set`` of connections iterates in id
order) nor on the string hash seed (``PYTHONHASHSEED``), so the scenario runs twice
here and once more in a fresh interpreter with another hash seed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from rudp.config import Config
from rudp.connection import Connection, State
from rudp.wire import Delivery

from .harness import Link, Network

SERVER = ("10.0.0.1", 9000)
CLIENTS = 7


def scenario_digest(seed: int = 7) -> str:
    """Run the scenario; the sha256 of everything sent, in order, with its time."""
    net = Network(seed=seed, link=Link(loss=0.1, duplicate=0.05, reorder=0.2, jitter=0.004))
    digest = hashlib.sha256()

    def tap(data: bytes, src: tuple[object, ...], dst: tuple[object, ...]) -> None:
        digest.update(f"{net.now!r} {src!r} {dst!r} {len(data)} ".encode())
        digest.update(data)

    net.tap = tap
    config = Config(redundancy=1)
    server = net.add(SERVER, config, accept=True)
    conns: list[Connection] = []
    for i in range(CLIENTS):
        client = net.add((f"10.0.0.{10 + i}", 5000 + i), config)
        conns.append(client.endpoint.connect(SERVER, net.now))
    net.run_until(lambda: all(c.state is State.CONNECTED for c in conns))
    modes = (None, Delivery.UNRELIABLE, Delivery.RELIABLE_UNORDERED, Delivery.RELIABLE_SEQUENCED)
    for tick in range(60):
        for i, conn in enumerate(conns):
            mode = modes[(tick + i) % len(modes)]
            size = 40 + 50 * i if tick % 10 else 3000  # some fragmented messages
            if mode is Delivery.UNRELIABLE:
                size = min(size, conn.max_datagram_payload)
            data = bytes([tick, i]) * (size // 2)
            conn.send(data) if mode is None else conn.send(data, delivery=mode, now=net.now)
        # The server answers every client each tick: one flush covers many connections.
        for sconn in server.endpoint.connections:
            if sconn.state is State.CONNECTED:
                sconn.send(bytes([tick]) * 100)
        net.run(0.005)
    net.run(3.0)
    for conn in conns:
        conn.close(net.now)
    net.run(3.0)
    return digest.hexdigest()


def test_a_seeded_run_replays_in_process() -> None:
    assert scenario_digest() == scenario_digest()


def test_a_seeded_run_replays_with_another_hash_seed() -> None:
    here = scenario_digest()
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    root = Path(__file__).resolve().parents[2]  # the directory holding the tests package
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from tests.rudp.test_reproducible import scenario_digest; print(scenario_digest())",
        ],
        cwd=root,
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.strip() == here
