"""A deterministic in-memory network for the sans-IO core: a stepped fake clock,
seeded loss, duplication, reordering, corruption and delay. No sockets, no sleeps.

Also what the core's tests share: ``pair()`` (a client connected to a server),
``server_conn``, ``pump``, and tagged messages (``tagged``, ``tags``)."""

from __future__ import annotations

import heapq
import itertools
import random
import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rudp import frames, wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.endpoint import Endpoint
from rudp.events import Disconnected, EndpointEvent, Event, MessageReceived
from rudp.lockstep import ClientState, LockstepClient, LockstepHost
from rudp.wire import DropReason

Address = tuple[Any, ...]


@dataclass
class Link:
    """Impairments applied to every datagram (each direction alike)."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    corrupt: float = 0.0
    delay: float = 0.010
    jitter: float = 0.0
    blackout: bool = False
    # A bottleneck in each direction: datagrams are serialised at ``bandwidth`` bytes/s
    # through a drop-tail queue of ``queue_limit`` bytes (None: no bottleneck).
    bandwidth: float | None = None
    queue_limit: int = 64 * 1024
    # The path MTU: a longer datagram is dropped (a black hole, no ICMP). None: no limit.
    mtu: int | None = None


@dataclass
class Node:
    endpoint: Endpoint
    events: list[tuple[Connection | None, Event | EndpointEvent]] = field(default_factory=list)

    def received(self, conn: Connection | None = None) -> list[bytes]:
        return [
            e.data
            for c, e in self.events
            if isinstance(e, MessageReceived) and (conn is None or c is conn)
        ]

    def disconnects(self) -> list[Disconnected]:
        return [e for _, e in self.events if isinstance(e, Disconnected)]


_NETWORKS: weakref.WeakSet[Network] = weakref.WeakSet()


class Network:
    def __init__(self, seed: int = 1, link: Link | None = None) -> None:
        _NETWORKS.add(self)
        self.now = 1000.0
        self.rng = random.Random(seed)
        self.link = link or Link()
        self.nodes: dict[Address, Node] = {}
        self._wire: list[tuple[float, int, bytes, Address, Address]] = []
        self._ids = itertools.count()
        self.sent: list[tuple[bytes, Address, Address]] = []  # everything put on the wire
        self.tap: Callable[[bytes, Address, Address], None] | None = None
        # Datagrams for which this returns True are lost on the wire (a targeted loss).
        self.drop: Callable[[bytes, Address, Address], bool] | None = None
        self._idle_steps = 0
        self._busy_until: dict[tuple[Address, Address], float] = {}  # bottleneck per direction
        self.queue_drops = 0  # datagrams the bottleneck's full queue dropped
        self.mtu_drops = 0  # datagrams longer than the link's MTU

    def add(self, address: Address, config: Config | None = None, *, accept: bool = False) -> Node:
        ep = Endpoint(
            config or Config(),
            now=self.now,
            rng=random.Random(self.rng.getrandbits(64)),
            accept=accept,
        )
        node = Node(ep)
        self.nodes[address] = node
        return node

    def remove(self, address: Address) -> None:
        del self.nodes[address]

    def move(self, old: Address, new: Address) -> None:
        """The node at ``old`` is reached at ``new`` from now on (a NAT rebinding):
        what it sends comes from ``new``; what is sent to ``old`` is lost."""
        self.nodes[new] = self.nodes.pop(old)

    def inject(self, data: bytes, src: Address, dst: Address) -> None:
        """Put a datagram on the wire as if ``src`` sent it (spoofing included)."""
        heapq.heappush(self._wire, (self.now, next(self._ids), data, src, dst))

    def _transmit(self, data: bytes, src: Address, dst: Address) -> None:
        self.sent.append((data, src, dst))
        if self.tap is not None:
            self.tap(data, src, dst)
        link, rng = self.link, self.rng
        if self.drop is not None and self.drop(data, src, dst):
            return
        if link.mtu is not None and len(data) > link.mtu:
            self.mtu_drops += 1
            return
        if link.blackout or rng.random() < link.loss:
            return
        copies = 2 if rng.random() < link.duplicate else 1
        for _ in range(copies):
            start = self.now
            if link.bandwidth is not None:
                busy = max(self._busy_until.get((src, dst), start), start)
                if (busy - start) * link.bandwidth + len(data) > link.queue_limit:
                    self.queue_drops += 1
                    continue
                busy += len(data) / link.bandwidth
                self._busy_until[(src, dst)] = busy
                start = busy
            payload = data
            if rng.random() < link.corrupt:
                buf = bytearray(data)
                bit = rng.randrange(len(buf) * 8)
                buf[bit // 8] ^= 1 << (bit % 8)
                payload = bytes(buf)
            delay = link.delay + rng.uniform(-link.jitter, link.jitter)
            if rng.random() < link.reorder:
                delay += link.delay * 2
            heapq.heappush(
                self._wire, (start + max(delay, 0.0), next(self._ids), payload, src, dst)
            )

    def flush(self) -> None:
        for address, node in list(self.nodes.items()):
            for data, dst in node.endpoint.datagrams_to_send(self.now):
                self._transmit(data, address, dst)

    def _drain_events(self) -> None:
        for node in self.nodes.values():
            while (item := node.endpoint.next_event()) is not None:
                node.events.append(item)

    def _next_time(self) -> float | None:
        times = [t for n in self.nodes.values() if (t := n.endpoint.get_timer()) is not None]
        if self._wire:
            times.append(self._wire[0][0])
        return min(times) if times else None

    def step(self, limit: float) -> bool:
        """Advance to the next delivery or timer (not past ``limit``); False when idle."""
        self.flush()
        t = self._next_time()
        if t is None or t > limit:
            self.now = max(self.now, limit)
            self._drain_events()  # what a test fed an endpoint directly caused
            return False
        if t <= self.now and not (self._wire and self._wire[0][0] <= self.now):
            # A timer that is due but changes nothing would spin forever: fail instead.
            self._idle_steps += 1
            if self._idle_steps > 100_000:
                raise AssertionError(f"a timer at {t} keeps firing without effect")
        else:
            self._idle_steps = 0
        self.now = max(self.now, t)
        while self._wire and self._wire[0][0] <= self.now:
            _, _, data, src, dst = heapq.heappop(self._wire)
            node = self.nodes.get(dst)
            if node is not None:
                node.endpoint.receive_datagram(data, src, self.now)
        for node in self.nodes.values():
            timer = node.endpoint.get_timer()
            if timer is not None and timer <= self.now:
                node.endpoint.handle_timer(self.now)
        self._drain_events()
        self.flush()
        return True

    def run(self, duration: float) -> None:
        end = self.now + duration
        while self.step(end):
            pass

    def run_until(self, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        end = self.now + timeout
        while not predicate():
            if not self.step(end) and self.now >= end:
                raise AssertionError(f"condition not met within {timeout} simulated seconds")


# -- two connected endpoints: the tests of the core start from here ----------------------


SERVER = ("10.0.0.1", 9000)
CLIENT = ("10.0.0.2", 5000)


def pair(
    link: Link | None = None, seed: int = 1, config: Config | None = None
) -> tuple[Network, Node, Node, Connection]:
    net = Network(seed=seed, link=link)
    server = net.add(SERVER, config, accept=True)
    client = net.add(CLIENT, config)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED, timeout=30)
    # Tests that count packets or step event by event start once path MTU discovery
    # has settled on both sides (its probes are then over).
    net.run_until(lambda: searched(conn) and all(searched(c) for c in server.endpoint.connections))
    return net, server, client, conn


def searched(conn: Connection) -> bool:
    """True when the connection's path MTU search is over (no probe in flight or due
    before the raise timer)."""
    pmtu = conn._pmtu
    return pmtu.probe_pn < 0 and pmtu.next_probe > conn._clock + 1.0


def server_conn(server: Node) -> Connection:
    (conn,) = server.endpoint.connections
    return conn


def still_flows(net: Network, server: Node, client: Node, conn: Connection) -> None:
    """Messages go both ways between ``client`` (``conn``) and its one connection on
    ``server``, and neither side saw a disconnect: what an attack must leave intact."""
    sconn = server_conn(server)
    assert conn.state is State.CONNECTED and sconn.state is State.CONNECTED
    conn.send(b"up after the attack")
    sconn.send(b"down after the attack")
    net.run(1)
    assert b"up after the attack" in server.received()
    assert b"down after the attack" in client.received()
    assert not client.disconnects() and not server.disconnects()


def pump(net: Network, conn: Connection, payloads: list[bytes], **kwargs: object) -> None:
    """Send every payload, respecting the send queue, until all are acknowledged."""
    pending = list(payloads)
    pending.reverse()
    while pending or conn.queued:
        while pending and conn.queued < 1000:
            conn.send(pending.pop(), **kwargs)  # type: ignore[arg-type]
        assert net.step(net.now + 5), "network went idle with messages outstanding"


# -- tagged messages, and frames injected as the client ----------------------------------


TAG = struct.Struct("!I")


def tagged(i: int, size: int = 8) -> bytes:
    return TAG.pack(i) + bytes(size - TAG.size)


def tags(node: Node, channel: int | None = None) -> list[int]:
    return [
        TAG.unpack_from(e.data)[0]
        for _, e in node.events
        if isinstance(e, MessageReceived) and (channel is None or e.channel == channel)
    ]


def settle(net: Network, conn: Connection, timeout: float = 120.0) -> None:
    net.run_until(lambda: conn.queued == 0, timeout=timeout)
    net.run(1.0)


def inject_frames(net: Network, server: Node, *frames: bytes) -> DropReason | None:
    """Deliver a DATA packet carrying ``frames`` to the server's connection as the client:
    sealed with the client connection's real keys as its next packet."""
    conn = server_conn(server)
    peer = net.nodes[CLIENT].endpoint.connection(SERVER)
    assert peer is not None, "the client's connection is gone: nothing can seal for it"
    ack = (conn._builder.tx_next - 1) & 0xFFFF
    packet = peer.seal_datagram(wire.ack_fields(ack, 0) + b"".join(frames))
    before = server.endpoint.stats.dropped.copy()
    server.endpoint.receive_datagram(packet, CLIENT, net.now)
    after = server.endpoint.stats.dropped
    changed = [reason for reason in after if after[reason] != before.get(reason, 0)]
    return changed[0] if changed else None


NO_FRAMES = frames.DataFrames([], False, None, False)


def open_data(data: bytes) -> bytes | None:
    """The opened body of a sealed DATA datagram of any live test network, or None: the
    receiving connection (found by the datagram's connection id) peeks at it."""
    if not data or data[0] != wire.DATA_BYTE or len(data) < wire.DATA_HEADER_SIZE:
        return None
    dcid = wire.decode_data_prefix(data)[0]
    for net in list(_NETWORKS):
        for node in net.nodes.values():
            conn = node.endpoint._by_cid.get(dcid)
            body = None if conn is None else conn.peek_datagram(data)
            if body is not None:
                return body
    return None


def frames_of(data: bytes) -> frames.DataFrames:
    """The frames of a DATA datagram on a test network (none for other packets)."""
    body = open_data(data)
    return NO_FRAMES if body is None else frames.decode_frames(body)


def running_lockstep_pair() -> tuple[LockstepHost[str], LockstepClient]:
    """A lockstep host and one client ("a"), joined and started, sans-IO at time 0."""
    host = LockstepHost[str]()
    client = LockstepClient(name="a")
    for data in client.messages_to_send():
        host.receive("a", data, 0.0)
    host.start(0.0)
    for _, data in host.messages_to_send():
        client.receive(data, 0.0)
    assert client.state is ClientState.RUNNING
    return host, client
