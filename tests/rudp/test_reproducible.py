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
import random
import subprocess
import sys
from pathlib import Path

from rudp.config import Config
from rudp.connection import Connection, State
from rudp.events import Disconnected, MessageReceived
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


# -- one transcript, one constant: the pure and the compiled build alike -------------------

# The sha256 of ``transcript_digest()``. The compiled build (``make compiled-test``) runs
# this same test against the mypyc-compiled core, so both builds put byte-identical
# datagrams on the wire and report identical events. A change that alters what goes on
# the wire on purpose changes it: the failure message prints the new value.
TRANSCRIPT = "204040f96afa036509b7c2f215f99ecdfc5673b45a718407f06ebc9d258dee1d"
# The same run with ChaCha20-Poly1305 sealing the packets (``Config.aes_gcm=False``):
# the wire of the releases before AES-256-GCM was offered (byte for byte but for the
# reset tokens in the handshakes, bound to the peer's address since; their value is
# each endpoint's own business).
TRANSCRIPT_CHACHA = "0a9c93867c5f7bcaa9bc8dc6b455270c525bce4ed0bb610cb9d53fed090f0962"


def _event_line(address: tuple[object, ...], event: object) -> bytes:
    if isinstance(event, MessageReceived):
        fields = f"{event.channel} {event.reliable} {len(event.data)}"
        return f"{address!r} MessageReceived {fields} ".encode() + event.data
    if isinstance(event, Disconnected):
        fields = f"{event.reason.value} {event.code} {event.text!r} {event.by_peer}"
        return f"{address!r} Disconnected {fields}".encode()
    return f"{address!r} {type(event).__name__}".encode()


def transcript_digest(seed: int = 11, aes_gcm: bool = True) -> str:
    """Every delivery mode both ways under loss, duplication, reordering and jitter, a
    channel's 16-bit sequence numbers wrapping around, fragmented and path-sized
    messages, a path MTU black hole, then closes: the sha256 of every datagram (time,
    addresses, bytes) and of every event each endpoint reported, in order."""
    link = Link(loss=0.05, duplicate=0.03, reorder=0.1, delay=0.01, jitter=0.003)
    net = Network(seed=seed, link=link)
    digest = hashlib.sha256()

    def tap(data: bytes, src: tuple[object, ...], dst: tuple[object, ...]) -> None:
        digest.update(f"{net.now!r} {src!r} {dst!r} {len(data)} ".encode())
        digest.update(data)

    net.tap = tap
    config = Config(redundancy=1, send_queue_limit=1 << 20, aes_gcm=aes_gcm)
    server = net.add(SERVER, config, accept=True)
    clients = [net.add((f"10.0.0.{10 + i}", 5000 + i), config) for i in range(2)]
    conns = [c.endpoint.connect(SERVER, net.now) for c in clients]
    net.run_until(lambda: all(c.state is State.CONNECTED for c in conns))
    rng = random.Random(seed)
    for tick in range(80):
        if tick == 50:
            link.mtu = 1300  # a black hole: datagrams above 1300 bytes vanish from now on
        for i, conn in enumerate(conns):
            blob = rng.randbytes(3000 if tick % 10 == 0 else 1200 if tick % 3 == 0 else 40)
            conn.send(blob, channel=i)
            conn.send(rng.randbytes(60), reliable=False, channel=1, now=net.now)
            conn.send(rng.randbytes(30), delivery=Delivery.UNRELIABLE_SEQUENCED, channel=2)
            first = conn.send(rng.randbytes(50), delivery=Delivery.RELIABLE_UNORDERED)
            conn.send(rng.randbytes(70), delivery=Delivery.RELIABLE_SEQUENCED, channel=3)
            conn.send(rng.randbytes(20), depends_on=[first])
        for sconn in server.endpoint.connections:
            if sconn.state is State.CONNECTED:
                sconn.send(rng.randbytes(100), channel=5)
        net.run(0.005)
    # Channel 7's sequence numbers wrap around 65,536 (they travel as 16 bits).
    wrapping = conns[0]
    for batch in range(33):
        for k in range(2000):
            wrapping.send((batch * 2000 + k).to_bytes(3, "big"), channel=7)
        net.run(0.05)
    net.run(3.0)
    for conn in conns:
        conn.close(net.now)
    net.run(5.0)
    for address, node in net.nodes.items():
        for _, event in node.events:
            digest.update(_event_line(address, event))
    return digest.hexdigest()


def test_the_transcript_is_the_same_constant_in_every_build() -> None:
    assert transcript_digest() == TRANSCRIPT, "the transcript changed"


def test_the_chacha20_poly1305_transcript_is_the_earlier_releases() -> None:
    assert transcript_digest(aes_gcm=False) == TRANSCRIPT_CHACHA, "the transcript changed"
