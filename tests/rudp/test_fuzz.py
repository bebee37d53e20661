"""Stateful fuzzing of two sans-IO endpoints (hypothesis RuleBasedStateMachine).

Hypothesis drives a client and a server ``rudp.endpoint.Endpoint`` on a fake clock, with every
datagram in flight under its control: it sends reliable and unreliable messages both ways on
several channels, delivers datagrams in any order, drops, duplicates and corrupts them, advances
the clock (far enough for resends, keepalives and timeouts), injects random bytes and well-formed
but forged packets, pauses and resumes either side's receiving (flow control), and closes
either side. After every step:

* no exception escaped the core (any would fail the test);
* per direction and channel, the reliable messages received are exactly a prefix of those sent:
  each delivered once, in order, byte-identical;
* unreliable messages are each delivered at most once and only if sent;
* dependency-graph messages (reliable-unordered and dependency-ordered, some large enough
  to be fragmented) are each delivered at most once, only if sent, and only after every
  message they depend on.

At teardown the network is healed and both sides resume; whatever is still connected must then
deliver every reliable message and learn that its peer resumed, and a peer that reported the
other side's graceful close must have received everything that side sent reliably. Examples are
bounded (see ``settings``) to keep CI fast.
"""

from __future__ import annotations

import dataclasses
import os
import random
import struct
import zlib
from collections import defaultdict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rudp import wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.endpoint import Endpoint
from rudp.events import Disconnected, DisconnectReason, MessageReceived
from rudp.sending import OutMessage
from rudp.wire import Delivery

SERVER = ("10.0.0.1", 9000)
CLIENT = ("10.0.0.2", 5000)
STRANGER = ("10.0.0.66", 6666)
CHANNELS = 3
CONFIG = Config(channels=CHANNELS, window=32, channel_window=64, max_message_size=32 * 1024)
CC_CONFIG = dataclasses.replace(CONFIG, congestion_control=True)
HEAD = struct.Struct("!BBI")  # sender side, channel, index: makes every message unique
GRAPH_SIDE = 2  # added to the sender byte of graph messages
SIDES = (0, 1)  # 0 = client, 1 = server

datagram_index = st.integers(min_value=0, max_value=1 << 30)


class TwoEndpoints(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.endpoints = (
            # The client runs congestion control, the server a fixed window: both paths.
            Endpoint(CC_CONFIG, now=self.now, rng=random.Random(1)),
            Endpoint(CONFIG, now=self.now, rng=random.Random(2), accept=True),
        )
        self.addresses = (CLIENT, SERVER)
        self.wire: list[tuple[bytes, int, tuple[str, int]]] = []  # data, destination side, source
        self.sent_rel: dict[tuple[int, int], list[bytes]] = defaultdict(list)
        self.sent_unrel: set[bytes] = set()
        self.got_rel: dict[tuple[int, int], list[bytes]] = defaultdict(list)
        self.got_unrel: list[bytes] = []
        self.graph_sent: dict[int, list[int]] = {}  # index -> indices it depends on
        self.graph_handles: dict[int, list[tuple[int, OutMessage]]] = {0: [], 1: []}
        self.graph_got: list[int] = []
        self.ended: dict[int, Disconnected] = {}
        self.counter = 0
        client_conn = self.endpoints[0].connect(SERVER, self.now)
        # A clean handshake, so most steps exercise an established connection.
        for _ in range(10):
            self._flush()
            self._deliver_all()
            if client_conn.state is State.CONNECTED:
                break
        assert client_conn.state is State.CONNECTED
        self.conns: tuple[Connection, Connection] = (
            client_conn,
            self.endpoints[1].connections[0],
        )

    # -- plumbing ---------------------------------------------------------------------------

    def _flush(self) -> None:
        for side, ep in enumerate(self.endpoints):
            for data, address in ep.datagrams_to_send(self.now):
                dest = 1 if address == SERVER else 0
                if address in self.addresses:
                    self.wire.append((data, dest, self.addresses[side]))
        self._collect()

    def _collect(self) -> None:
        for side, ep in enumerate(self.endpoints):
            while (item := ep.next_event()) is not None:
                _, event = item
                if isinstance(event, MessageReceived):
                    if event.data[0] >= GRAPH_SIDE:
                        self.graph_got.append(HEAD.unpack_from(event.data)[2])
                    elif event.reliable:
                        sender, channel, _ = HEAD.unpack_from(event.data)
                        assert sender != side and channel == event.channel
                        self.got_rel[(sender, channel)].append(event.data)
                    else:
                        self.got_unrel.append(event.data)
                elif isinstance(event, Disconnected):
                    assert side not in self.ended, "two Disconnected events for one connection"
                    self.ended[side] = event

    def _receive(self, data: bytes, dest: int, source: tuple[str, int]) -> None:
        self.endpoints[dest].receive_datagram(data, source, self.now)
        self._flush()

    def _deliver_all(self) -> None:
        while self.wire:
            self._receive(*self.wire.pop(0))

    def _tick(self) -> None:
        for ep in self.endpoints:
            timer = ep.get_timer()
            if timer is not None and timer <= self.now:
                ep.handle_timer(self.now)
        self._flush()

    # -- rules ------------------------------------------------------------------------------

    @rule(
        side=st.sampled_from(SIDES),
        channel=st.integers(0, CHANNELS - 1),
        reliable=st.booleans(),
        size=st.integers(0, CONFIG.max_datagram_size),
        count=st.integers(1, 40),
    )
    def send(self, side: int, channel: int, reliable: bool, size: int, count: int) -> None:
        conn = self.conns[side]
        if conn.state is not State.CONNECTED:
            return
        size = min(size, conn.max_datagram_payload - HEAD.size)
        for _ in range(count):
            self.counter += 1
            data = HEAD.pack(side, channel, self.counter) + bytes([self.counter & 0xFF]) * size
            conn.send(data, reliable=reliable, channel=channel)
            if reliable:
                self.sent_rel[(side, channel)].append(data)
            else:
                self.sent_unrel.add(data)
        self._flush()

    @rule(
        side=st.sampled_from(SIDES),
        size=st.sampled_from([0, 10, 1500, 5000]),
        deps=st.lists(st.integers(0, 1 << 20), max_size=3),
        unordered=st.booleans(),
    )
    def send_graph(self, side: int, size: int, deps: list[int], unordered: bool) -> None:
        """A reliable-unordered or dependency-ordered message, fragmented when large."""
        conn = self.conns[side]
        if conn.state is not State.CONNECTED:
            return
        self.counter += 1
        data = HEAD.pack(side + GRAPH_SIDE, 0, self.counter) + bytes(size)
        earlier = self.graph_handles[side]
        picked = {earlier[d % len(earlier)] for d in deps} if earlier and not unordered else set()
        if unordered:
            handle = conn.send(data, delivery=Delivery.RELIABLE_UNORDERED)
        else:
            handle = conn.send(data, depends_on=[h for _, h in picked])
        self.graph_sent[self.counter] = [i for i, _ in picked]
        earlier.append((self.counter, handle))
        self._flush()

    @precondition(lambda self: bool(self.wire))
    @rule(i=datagram_index)
    def deliver(self, i: int) -> None:  # any one in flight: reordering
        self._receive(*self.wire.pop(i % len(self.wire)))

    @precondition(lambda self: bool(self.wire))
    @rule(n=st.integers(1, 50))
    def deliver_oldest(self, n: int) -> None:
        for _ in range(min(n, len(self.wire))):
            self._receive(*self.wire.pop(0))

    @precondition(lambda self: bool(self.wire))
    @rule(i=datagram_index)
    def drop(self, i: int) -> None:
        self.wire.pop(i % len(self.wire))

    @precondition(lambda self: bool(self.wire))
    @rule(fraction=st.floats(0.0, 1.0))
    def drop_many(self, fraction: float) -> None:
        keep = len(self.wire) - int(len(self.wire) * fraction)
        self.wire = self.wire[:keep]

    @precondition(lambda self: bool(self.wire))
    @rule(i=datagram_index)
    def duplicate(self, i: int) -> None:
        self.wire.append(self.wire[i % len(self.wire)])

    @precondition(lambda self: bool(self.wire))
    @rule(i=datagram_index, bits=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=3))
    def corrupt(self, i: int, bits: list[int]) -> None:
        i %= len(self.wire)
        data, dest, source = self.wire[i]
        if not data:
            return
        buf = bytearray(data)
        for bit in {b % (len(buf) * 8) for b in bits}:
            buf[bit >> 3] ^= 1 << (bit & 7)
        self.wire[i] = (bytes(buf), dest, source)

    @precondition(lambda self: bool(self.wire))
    @rule(i=datagram_index, cut=st.integers(0, 2000))
    def truncate(self, i: int, cut: int) -> None:
        i %= len(self.wire)
        data, dest, source = self.wire[i]
        self.wire[i] = (data[: cut % (len(data) or 1)], dest, source)

    @rule(dt=st.one_of(st.floats(0.0, 0.3), st.floats(0.3, 3.0), st.just(11.0)))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._tick()

    @rule(
        dest=st.sampled_from(SIDES),
        from_peer=st.booleans(),
        data=st.binary(max_size=1300),
    )
    def inject_random(self, dest: int, from_peer: bool, data: bytes) -> None:
        source = self.addresses[1 - dest] if from_peer else STRANGER
        self._receive(data, dest, source)

    @rule(
        dest=st.sampled_from(SIDES),
        from_peer=st.booleans(),
        ptype=st.integers(0, 10),
        body=st.binary(max_size=1300),
        pad=st.integers(0, 1200),
    )
    def inject_sealed(self, dest: int, from_peer: bool, ptype: int, body: bytes, pad: int) -> None:
        """A packet that passes the checksum and version check but whose contents are
        forged; a DATA names the real connection id (it cannot authenticate)."""
        source = self.addresses[1 - dest] if from_peer else STRANGER
        if ptype == wire.PacketType.DATA:
            pn = int.from_bytes(body[:4], "big")
            buf = bytearray(wire.data_prefix(self.conns[dest].cid, pn) + body[4:])
            buf += bytes(max(0, pad - len(buf)))
            self._receive(bytes(buf), dest, source)
            return
        buf = bytearray(bytes([wire.MARKER | ptype, wire.PROTOCOL_VERSION]) + body)
        buf += bytes(max(0, pad - len(buf)))
        self._receive(bytes(buf) + wire.CRC.pack(zlib.crc32(buf, wire.PROTOCOL_ID)), dest, source)

    @rule(side=st.sampled_from(SIDES), code=st.integers(0, 0xFFFF), text=st.text(max_size=300))
    def close(self, side: int, code: int, text: str) -> None:
        self.conns[side].close(self.now, code, text)  # over 200 bytes: clipped
        self._flush()

    @rule(side=st.sampled_from(SIDES))
    def pause(self, side: int) -> None:
        self.conns[side].pause_receiving()
        self._flush()

    @rule(side=st.sampled_from(SIDES))
    def resume(self, side: int) -> None:
        self.conns[side].resume_receiving(self.now)
        self._flush()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def reliable_exactly_once_in_order(self) -> None:
        for key, got in self.got_rel.items():
            assert got == self.sent_rel[key][: len(got)], f"stream {key} out of order or damaged"

    @invariant()
    def graph_at_most_once_after_dependencies(self) -> None:
        got = self.graph_got
        assert len(got) == len(set(got)), "a graph message was delivered twice"
        position = {index: n for n, index in enumerate(got)}
        for index in got:
            for dep in self.graph_sent[index]:
                assert position.get(dep, len(got)) < position[index], "ran before a dependency"

    @invariant()
    def unreliable_at_most_once(self) -> None:
        assert len(self.got_unrel) == len(set(self.got_unrel))
        assert set(self.got_unrel) <= self.sent_unrel

    def teardown(self) -> None:
        # Heal the network and let time run; in-flight datagrams are all delivered.
        for conn in self.conns:
            conn.resume_receiving(self.now)
        self._flush()
        for _ in range(3000):
            self._deliver_all()
            if all(c.state is State.CLOSED for c in self.conns) or (
                all(c.state is State.CONNECTED for c in self.conns) and self._complete()
            ):
                break
            self.now += 0.01
            self._tick()
        self.reliable_exactly_once_in_order()
        self.unreliable_at_most_once()
        self.graph_at_most_once_after_dependencies()
        if all(c.state is State.CONNECTED for c in self.conns):
            assert self._complete(), "a healed network did not deliver everything"
            for _ in range(500):  # a lost RESUME is resent: both sides learn it
                if not any(c.peer_paused for c in self.conns):
                    break
                self._deliver_all()
                self.now += 0.01
                self._tick()
            assert not any(c.peer_paused for c in self.conns), "a RESUME never arrived"
        for side in SIDES:
            event = self.ended.get(side)
            if event is not None and event.reason is DisconnectReason.CLOSED and event.by_peer:
                peer = 1 - side
                for channel in range(CHANNELS):
                    key = (peer, channel)
                    assert self.got_rel[key] == self.sent_rel[key], "graceful close lost data"

    def _complete(self) -> bool:
        return all(self.got_rel[key] == sent for key, sent in self.sent_rel.items()) and len(
            self.graph_got
        ) == len(self.graph_sent)


# RUDP_FUZZ_EXAMPLES=5000 for a long local hunt; CI runs the bounded default.
TwoEndpoints.TestCase.settings = settings(
    max_examples=int(os.environ.get("RUDP_FUZZ_EXAMPLES", "75")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_two_endpoints = TwoEndpoints.TestCase
