"""A deterministic in-memory network for the sans-IO core: a stepped fake clock,
seeded loss, duplication, reordering, corruption and delay. No sockets, no sleeps."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rudp.config import Config
from rudp.connection import Connection
from rudp.endpoint import Endpoint
from rudp.events import Disconnected, EndpointEvent, Event, MessageReceived

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


class Network:
    def __init__(self, seed: int = 1, link: Link | None = None) -> None:
        self.now = 1000.0
        self.rng = random.Random(seed)
        self.link = link or Link()
        self.nodes: dict[Address, Node] = {}
        self._wire: list[tuple[float, int, bytes, Address, Address]] = []
        self._ids = itertools.count()
        self.sent: list[tuple[bytes, Address, Address]] = []  # everything put on the wire
        self.tap: Callable[[bytes, Address, Address], None] | None = None
        self._idle_steps = 0
        self._busy_until: dict[tuple[Address, Address], float] = {}  # bottleneck per direction
        self.queue_drops = 0  # datagrams the bottleneck's full queue dropped

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

    def inject(self, data: bytes, src: Address, dst: Address) -> None:
        """Put a datagram on the wire as if ``src`` sent it (spoofing included)."""
        heapq.heappush(self._wire, (self.now, next(self._ids), data, src, dst))

    def _transmit(self, data: bytes, src: Address, dst: Address) -> None:
        self.sent.append((data, src, dst))
        if self.tap is not None:
            self.tap(data, src, dst)
        link, rng = self.link, self.rng
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
