"""The sans-IO core's reliable delivery, on a stepped fake clock and an in-memory lossy
network: exactly once and in order, per channel, acknowledgements, RTT and resends."""

from __future__ import annotations

import heapq
import itertools
import random
import tracemalloc

import pytest

from rudp import wire
from rudp.config import Config
from rudp.connection import NO_BUFFER, Connection
from rudp.wire import PacketType
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Address,
    Link,
    Network,
    frames_of,
    pair,
    pump,
    server_conn,
)

# -- delivery --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_exactly_once_in_order_under_loss_duplication_and_reordering(seed: int) -> None:
    link = Link(loss=0.3, duplicate=0.1, reorder=0.1, delay=0.02, jitter=0.005)
    net, server, client, conn = pair(link, seed=seed)
    rng = random.Random(seed)
    payloads = [rng.randbytes(rng.randint(0, 1100)) for _ in range(3000)]
    pump(net, conn, payloads)
    assert server.received() == payloads
    assert conn.stats.messages_resent > 0
    sconn = server_conn(server)
    assert sconn.stats.packets_dropped == sum(server.endpoint.stats.dropped.values()) > 0


def test_both_directions_and_every_channel_keep_their_own_order() -> None:
    net, server, client, conn = pair(Link(loss=0.2, reorder=0.2, duplicate=0.05))
    sconn = server_conn(server)
    sent: dict[int, list[bytes]] = {ch: [] for ch in range(32)}
    for i in range(2000):
        ch = i % 32
        data = f"{ch}:{i}".encode()
        sent[ch].append(data)
        conn.send(data, channel=ch)
        sconn.send(data, channel=ch)
    net.run_until(lambda: not conn.queued and not sconn.queued)
    for node, peer in ((server, sconn), (client, conn)):
        got: dict[int, list[bytes]] = {ch: [] for ch in range(32)}
        for c, e in node.events:
            if c is peer and hasattr(e, "channel"):
                got[e.channel].append(e.data)  # type: ignore[union-attr]
        assert got == sent


def test_a_loss_on_one_channel_does_not_hold_up_another() -> None:
    net, server, client, conn = pair(Link(delay=0.05), config=Config(redundancy=0))
    victim: list[bytes] = []

    def drop_first_data_packet(data: bytes, src: object, dst: object) -> None:
        is_data = wire.decode_type(data) is PacketType.DATA
        if src == CLIENT and not victim and is_data and frames_of(data).messages:
            victim.append(data)
            net.link.blackout = True

    net.tap = drop_first_data_packet
    conn.send(b"a0", channel=0)
    net.flush()  # this datagram is lost
    net.link.blackout = False
    net.tap = None
    conn.send(b"b0", channel=1)
    conn.send(b"a1", channel=0)
    net.step(net.now + 1)
    # After one delay: channel 1 is delivered; a1 waits for a0's retransmission.
    assert server.received() == [b"b0"]
    buffers = server_conn(server)._receiver.ch_buf
    assert list(buffers[0].values()) == [b"a1"]  # channel 0 got a reorder buffer of its own
    assert buffers[1] is NO_BUFFER and NO_BUFFER == {}  # the others share the empty one
    net.run_until(lambda: len(server.received()) == 3)
    assert server.received() == [b"b0", b"a0", b"a1"]


def test_an_idle_connection_is_small() -> None:
    # Per-channel state is created by use. 32 empty deques and dicts per connection
    # were 26 of its 39 KB (pure build); a server holds one connection per player.
    config = Config()
    rng = random.Random(1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        conns = [
            Connection(
                config=config, address=("10.0.0.3", 5000 + i), now=0.0, rng=rng,
                client=False, salt=i,
            )
            for i in range(100)
        ]  # fmt: skip
        per_connection = (tracemalloc.get_traced_memory()[0] - before) / len(conns)
    finally:
        tracemalloc.stop()
    assert per_connection < 16_000


def test_unreliable_messages_are_never_duplicated() -> None:
    net, server, client, conn = pair(Link(loss=0.2, duplicate=0.5, reorder=0.3))
    for i in range(3000):
        conn.send(i.to_bytes(4, "big"), reliable=False)
        if i % 50 == 0:
            net.step(net.now + 0.001)
    net.run(2)
    got = [int.from_bytes(d, "big") for d in server.received()]
    assert len(got) == len(set(got))
    assert 1500 < len(got) < 3000


def test_packet_and_channel_sequences_wrap_around() -> None:
    cfg = Config(max_datagram_size=600)
    net, server, client, conn = pair(Link(loss=0.05, duplicate=0.02, delay=0.001), config=cfg)
    payloads = [i.to_bytes(4, "big") * 100 for i in range(70_000)]  # one message per packet
    start_seq = conn._builder.tx_next
    pump(net, conn, payloads)
    assert conn._builder.tx_next - start_seq > 65536 + 1000  # the packet sequence wrapped
    assert server_conn(server)._receiver.ch_next[0] == 70_000  # and so did channel 0's
    assert server.received() == payloads


def test_fast_resend_repairs_a_single_loss_before_the_timeout() -> None:
    net, server, client, conn = pair(Link(delay=0.05))
    for _ in range(20):  # settle the RTT estimate at 100 ms
        conn.send(b"warm")
        net.run(0.2)
    dropped = []

    def drop_one(data: bytes, src: object, dst: object) -> None:
        if src == CLIENT and not dropped and frames_of(data).messages:
            dropped.append(net.now)
            net.link.blackout = True

    net.tap = drop_one
    conn.send(b"lost")
    net.flush()
    net.link.blackout = False
    net.tap = None
    sent_at = net.now
    for i in range(5):  # later packets get acknowledged and reveal the gap
        conn.send(f"after{i}".encode())
        net.flush()
        net.now += 0.002
    net.run_until(lambda: b"lost" in server.received())
    # One RTT to see the later acks, half an RTT for the resend: well under RTO+RTT.
    assert net.now - sent_at < 0.2
    assert conn.stats.timeouts == 0


def test_rtt_estimate_tracks_the_path() -> None:
    net, server, client, conn = pair(Link(delay=0.03))
    for _ in range(30):
        conn.send(b"x")
        net.run(0.1)
    assert conn.stats.srtt == pytest.approx(0.06, abs=0.005)
    # The resend timeout also waits for the peer's stated acknowledgment delay (RFC 9002).
    delay = Config().max_ack_delay
    assert conn.stats.rto == pytest.approx(
        0.06 + max(4 * conn.stats.rttvar, 0.06 / 8) + delay, abs=0.01
    )


def test_jittery_path_gives_an_unbiased_rtt_and_few_spurious_timeouts() -> None:
    """Every newly acknowledged packet is an RTT sample: with jitter, the packets that
    others overtook are the slow ones, and sampling only the largest acknowledged
    would miss them (SRTT too low, RTO inside the path's normal range)."""
    net, server, client, conn = pair(Link(delay=0.02, jitter=0.005), config=Config(redundancy=0))
    for _ in range(3000):
        conn.send(b"x" * 100)
        net.run(0.001)
    net.run(1.0)
    assert conn.stats.srtt == pytest.approx(0.04, abs=0.003)
    assert conn.stats.rttvar > 0.002
    assert conn.stats.timeouts < 30  # was ~100 with largest-only samples


def test_a_late_ack_of_a_packet_declared_lost_is_a_spurious_loss() -> None:
    """A packet held back long enough to be declared lost, then delivered: its ack comes
    in a later header's bitfield, not as the largest, and must still be recognised."""
    net, server, client, conn = pair(Link(delay=0.01), config=Config(redundancy=0))
    for _ in range(20):
        conn.send(b"warm")
        net.run(0.05)
    held: list[bytes] = []

    def hold_one(data: bytes, src: object, dst: object) -> None:
        net.link.blackout = False
        if src == CLIENT and not held and frames_of(data).messages:
            held.append(data)
            net.link.blackout = True

    net.tap = hold_one
    for _ in range(10):
        conn.send(b"m")
        net.run(0.001)
    net.tap = None
    net.run(0.03)  # the held packet is declared lost (packet and time thresholds)
    assert conn.stats.packets_lost == 1
    threshold = conn._recovery.reorder_threshold
    net.inject(held[0], CLIENT, SERVER)  # ... but it was only late
    conn.send(b"after")
    net.run(0.1)
    assert conn.stats.spurious_losses == 1
    assert conn._recovery.reorder_threshold > threshold


def test_resend_timeout_backs_off_and_is_clamped() -> None:
    cfg = Config(rto_max=1.0)
    net, server, client, conn = pair(config=cfg)
    net.link.blackout = True
    conn.send(b"into the void")
    times = []
    net.tap = lambda data, src, dst: times.append(net.now) if src == CLIENT else None
    net.run(6)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == sorted(gaps)  # each wait at least as long as the one before
    assert max(gaps) <= 1.0 + 1e-9


def test_a_long_burst_read_at_once_is_acknowledged_whole() -> None:
    """A header acks 33 packets; a receiver that reads a longer burst before it
    flushes (the socket is drained up to 256 datagrams at a time) must still
    acknowledge every packet, or the sender would resend them all."""
    net, server, client, conn = pair()
    for _ in range(200):
        conn.send(bytes(1000))
    burst = [d for d, _ in client.endpoint.datagrams_to_send(net.now)]
    assert len(burst) > 150
    for datagram in burst:
        server.endpoint.receive_datagram(datagram, CLIENT, net.now)
    acks = server.endpoint.datagrams_to_send(net.now)
    assert len(acks) >= len(burst) // 33
    for ack, _ in acks:
        client.endpoint.receive_datagram(ack, SERVER, net.now + 0.001)
    assert conn.queued == 0  # every message acknowledged
    assert conn.stats.packets_lost == 0  # and none declared lost


def test_deep_reordering_is_learned_instead_of_resent() -> None:
    """Per-datagram jitter reorders far past the 33 packets one header acks. A late
    packet gets its own ack; the sender sees its loss was spurious and widens its
    reordering thresholds, so jitter stops turning into resends."""
    link = Link(delay=0.02, jitter=0.005, loss=0.05)
    net, server, client, conn = pair(link, seed=4)
    payloads = [bytes([i % 256]) * 1000 for i in range(2000)]
    start = net.now
    pump(net, conn, payloads)
    assert server.received() == payloads
    stats = conn.stats
    assert stats.spurious_losses > 0
    assert conn._recovery.reorder_threshold > Config().reorder_threshold
    # Without this, the same transfer resent every message about 7 times over.
    assert stats.messages_resent < 0.5 * stats.messages_sent
    assert net.now - start < 1.0


def _hold_nth_data_packet(net: Network, n: int, hold: float | None) -> None:
    """Delay (or, with ``hold=None``, lose) the n-th data-carrying packet from CLIENT."""
    count = [0]
    transmit = net._transmit

    def tap(data: bytes, src: Address, dst: Address) -> None:
        if src == CLIENT and wire.decode_type(data) is PacketType.DATA and len(data) > 100:
            count[0] += 1
            if count[0] == n:
                net.sent.append((data, src, dst))
                if hold is not None:
                    heapq.heappush(net._wire, (net.now + hold, 10**12, data, src, dst))
                return
        transmit(data, src, dst)

    net._transmit = tap  # type: ignore[method-assign]


def test_a_long_delayed_packet_is_never_delivered_as_a_newer_message() -> None:
    """Small messages, one packet held 0.25 s: by then the channel sequence has moved
    more than 32768 on, and unwrapping its old numbers would read them as early."""
    net, server, client, conn = pair(seed=3)
    _hold_nth_data_packet(net, 5, hold=0.25)
    payloads = [i.to_bytes(3, "big") for i in range(120_000)]
    sent = 0

    def keep_sending() -> bool:
        nonlocal sent
        while sent < len(payloads) and conn.queued < 60_000:  # a deep queue: fast channel
            conn.send(payloads[sent])
            sent += 1
        return len(server.received()) >= len(payloads)

    net.run_until(keep_sending, timeout=120)
    assert server.received() == payloads


def test_a_full_reorder_buffer_never_refuses_the_packet_that_unblocks_it() -> None:
    # A buffer that holds the window's early messages only just not: the packet
    # carrying the lost message and the next one must still be taken.
    cfg = Config(recv_buffer_bytes=19676)
    net, server, client, conn = pair(config=cfg, seed=3)
    _hold_nth_data_packet(net, 1, hold=None)  # lose the first data packet
    payloads = [bytes([i % 256]) * 500 for i in range(200)]
    for p in payloads:
        conn.send(p)
    net.run_until(lambda: len(server.received()) == len(payloads), timeout=30)
    assert server.received() == payloads


def test_after_an_outage_the_resend_timer_probes_one_packet_at_a_time() -> None:
    net, server, client, conn = pair()
    net.run(0.5)
    net.link.blackout = True
    for _ in range(2000):
        conn.send(b"x" * 500)
    net.run(4.0)
    # One probe per backed-off RTO, not a burst of every packet in flight.
    assert conn.stats.timeouts <= 8
    assert conn.stats.messages_resent <= 20
