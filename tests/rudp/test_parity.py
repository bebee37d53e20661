"""Parity across packets (``rudp.parity``): REPAIR frames sized to the measured loss.

Deterministic: two cores on the in-memory network and the stepped clock, a thin
stream of 200-byte reliable messages over a jittered (reordering) path.
"""

from __future__ import annotations

import random
import struct

import pytest

from rudp import frames, parity
from rudp.config import Config
from rudp.connection import Connection
from rudp.events import MessageReceived
from rudp.handshake import TransportParams
from rudp.protection import ReplayWindow
from rudp.recovery import LOSS_WINDOW, PacketRecovery
from rudp.stats import ConnectionStats
from rudp.wire import DecodeError, Delivery

from .harness import SERVER, Link, Network, Node, frames_of, pair, server_conn

TAG = struct.Struct("!I")


def stream(
    loss: float, seed: int, config: Config, count: int = 1500, delivery: Delivery | None = None
) -> tuple[Network, Node, Connection, list[float]]:
    """One 200-byte message per millisecond, 20 +- 5 ms each way; latencies in ms."""
    net, server, _, conn = pair(Link(loss=loss, delay=0.020, jitter=0.005), seed, config)
    sent: dict[int, float] = {}
    got: dict[int, float] = {}
    seen = 0
    start = net.now
    for i in range(count):
        net.run(max(0.0, start + i * 0.001 - net.now))
        sent[i] = net.now
        data = TAG.pack(i) + bytes(196)
        conn.send(data) if delivery is None else conn.send(data, delivery=delivery, now=net.now)
        events = server.events
        for _, event in events[seen:]:
            if isinstance(event, MessageReceived) and len(event.data) == 200:
                got.setdefault(TAG.unpack_from(event.data)[0], net.now)
        seen = len(events)
    net.run(3.0)
    for _, event in server.events[seen:]:
        if isinstance(event, MessageReceived) and len(event.data) == 200:
            got.setdefault(TAG.unpack_from(event.data)[0], net.now)
    assert sorted(got) == list(range(count)), "a reliable message was lost"
    return net, server, conn, sorted(1e3 * (got[i] - sent[i]) for i in range(count))


def test_a_lossy_jittered_stream_is_repaired_without_resends_for_a_fraction_of_copies() -> None:
    net, server, conn, latencies = stream(0.05, seed=3, config=Config(parity=True))
    receiver = server_conn(server)
    messages = len(latencies)
    assert conn.stats.repairs_sent > messages // 8
    assert receiver.stats.packets_recovered > 0
    # Within 1.5x the 200-byte payload per message, headers and REPAIRs included...
    assert conn.stats.bytes_sent / messages <= 1.5 * 200
    # ...while most losses never reach a resend: of ~5 % lost, few go back to a queue.
    assert conn.stats.messages_resent < 0.02 * messages
    # The sender learnt the loss from the receiver's RECOVERED frames (rebuilt packets
    # were acknowledged, so its own loss detection saw almost none of them).
    assert 0.02 < conn._recovery.loss_rate < 0.12
    assert receiver.stats.repairs_unusable == 0
    # Ordered delivery stays far from a round trip behind: p50 at the path's delay.
    assert latencies[len(latencies) // 2] < 23.0


def test_the_same_stream_with_copies_costs_twice_the_bytes() -> None:
    _, _, conn, _ = stream(0.05, seed=3, config=Config(parity=False))
    assert conn.stats.repairs_sent == 0
    assert conn.stats.messages_redundant > 0
    assert conn.stats.bytes_sent / 1500 > 2.5 * 200


def test_a_clean_path_carries_no_repair() -> None:
    _, server, conn, latencies = stream(0.0, seed=1, config=Config(parity=True), count=800)
    assert conn.stats.repairs_sent == 0
    assert conn.stats.messages_redundant == 0
    assert server_conn(server).stats.packets_recovered == 0
    assert conn.stats.bytes_sent / 800 < 1.2 * 200


def test_unordered_delivery_with_parity_stays_near_the_path_delay() -> None:
    _, _, _, latencies = stream(
        0.05, seed=2, config=Config(parity=True), delivery=Delivery.RELIABLE_UNORDERED
    )
    assert latencies[len(latencies) // 2] < 21.0
    assert latencies[int(0.95 * len(latencies))] < 30.0


def test_repair_frames_go_only_to_a_peer_that_stated_parity() -> None:
    net = Network(seed=4, link=Link(loss=0.05, delay=0.02, jitter=0.005))
    server = net.add(SERVER, Config(parity=False), accept=True)
    client = net.add(("10.0.0.2", 5000), Config(parity=True))
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state.name == "CONNECTED")
    kinds: list[int] = []
    net.tap = lambda data, src, dst: kinds.append(0 if frames_of(data).repair is None else 1)
    for i in range(600):
        conn.send(TAG.pack(i) + bytes(196))
        net.run(0.001)
    net.run(2.0)
    assert sum(kinds) == 0
    assert conn._reader.parity is None
    assert conn.stats.messages_redundant > 0  # the copies, as before
    assert len(server.received()) == 600


def test_transport_parameters_state_parity_and_an_earlier_peer_gets_none() -> None:
    params = TransportParams.of(Config(parity=True), 7, bytes(16))
    decoded = TransportParams.decode(params.encode())
    assert decoded.parity and decoded.max_ack_delay_ms == params.max_ack_delay_ms
    assert not TransportParams.decode(params.plain().encode()).parity
    assert not TransportParams.decode(TransportParams.of(Config(), 7, bytes(16)).encode()).parity


def test_repair_and_recovered_frames_decode_as_tail_frames() -> None:
    body = bytes(6) + frames.reliable_frame(0, 1, b"abc")
    repair = frames.repair_frame(0b101, 2, b"\x01\x02\x03")
    data = body + repair + frames.ack_delay_frame(0.001) + frames.recovered_frame(513)
    decoded = frames.decode_frames(data)
    assert decoded.tail == len(body)
    assert decoded.repair == (0b101, 2, b"\x01\x02\x03")
    assert decoded.recovered == 513
    assert [m[1:4] for m in decoded.messages] == [(0, 1, b"abc")]
    assert frames.decode_frames(body).tail == len(body)
    for cut in range(len(body) + 1, len(body) + len(repair)):
        with pytest.raises(DecodeError):
            frames.decode_frames(data[:cut])


def _recovery(loss_rate: float = 0.05) -> PacketRecovery:
    """A real connection's loss detection (the compiled build checks types), its loss
    rate set."""
    _, _, _, conn = pair()
    recovery: PacketRecovery = conn._recovery
    recovery.loss_rate = loss_rate
    return recovery


def _parity() -> parity.Parity:
    return parity.Parity(_recovery(), ConnectionStats())


def _sources(sender: parity.Parity, bodies: dict[int, bytes], upto: int) -> dict[int, bytes]:
    """Packets 0..upto-1 built by ``sender``; returns what each carried, REPAIR included."""
    wire_bodies: dict[int, bytes] = {}
    for pn in range(upto):
        parts = [bytes(6), bodies[pn]]
        sender.on_build(pn, parts, len(parts), 1000)
        wire_bodies[pn] = b"".join(parts)
    return wire_bodies


@pytest.mark.parametrize("lost", [(9,), (9, 10), (5, 9, 10)])
def test_missing_packets_are_rebuilt_from_enough_repairs(lost: tuple[int, ...]) -> None:
    sender, receiver = _parity(), _parity()
    bodies = {pn: frames.reliable_frame(0, pn, bytes([pn]) * (50 + pn)) for pn in range(40)}
    sent = _sources(sender, bodies, 40)
    window = ReplayWindow()
    for pn in range(40):
        if pn in lost:
            continue
        window.accept(pn)
        decoded = frames.decode_frames(sent[pn])
        receiver.on_packet(pn, sent[pn], decoded.tail, decoded.repair, window)
    rebuilt = dict(receiver.rebuilt)
    assert sorted(rebuilt) == sorted(lost)
    for pn in lost:
        assert rebuilt[pn] == bytes(6) + bodies[pn]


def test_a_repair_covering_packets_received_before_symbols_were_kept_is_no_use() -> None:
    sender, receiver = _parity(), _parity()
    bodies = {pn: frames.reliable_frame(0, pn, b"x" * 20) for pn in range(12)}
    sent = _sources(sender, bodies, 12)
    window = ReplayWindow()
    for pn in range(12):
        window.accept(pn)  # all arrived, none kept: REPAIRs only start keeping symbols
    decoded = frames.decode_frames(sent[11])
    receiver.on_packet(11, sent[11], decoded.tail, decoded.repair, window)
    assert not receiver.rebuilt and not receiver.equations


def test_a_rebuilt_packet_whose_original_comes_late_is_not_reported_lost() -> None:
    receiver = _parity()
    receiver.unconfirmed[5] = None
    assert receiver.arrived_late(5) and not receiver.arrived_late(5)
    receiver.unconfirmed[6] = None
    window = ReplayWindow()
    receiver.on_packet(6 + parity.CONFIRM, bytes(6), 6, None, window)
    assert receiver.recovered_total == 1
    assert receiver.report() == frames.recovered_frame(1) and receiver.report() == b""


def test_a_report_counts_each_rebuilt_packet_once_as_a_loss() -> None:
    recovery = _recovery(0.0)
    p = parity.Parity(recovery, ConnectionStats())
    p.on_report(3)
    p.on_report(2)  # an older report, overtaken: ignored
    p.on_report(3)
    expected = 0.0
    for _ in range(3):
        expected += (1.0 - expected) / LOSS_WINDOW
    assert recovery.loss_rate == pytest.approx(expected)


def test_interval_follows_the_loss_rate_with_hysteresis() -> None:
    recovery = _recovery()
    p = parity.Parity(recovery, ConnectionStats())
    for rate, k in ((0.0, 0), (0.004, 0), (0.05, 4), (0.01, 8), (0.003, 8), (0.0005, 0)):
        recovery.loss_rate = rate
        assert p.interval() == k


def test_the_recovery_hook_raises_the_loss_rate() -> None:
    recovery = _recovery(0.0)
    recovery.on_recovered(10)
    assert 0.03 < recovery.loss_rate < 0.04


# -- a peer's REPAIRs that lie ------------------------------------------------------

LIE = bytes(range(256)) * 5  # a REPAIR's data, 1,280 bytes that fit no packet


def _plain(receiver: parity.Parity, window: ReplayWindow, pn: int) -> None:
    window.accept(pn)
    receiver.on_packet(pn, bytes(6), 6, None, window)


def _lie(
    receiver: parity.Parity, window: ReplayWindow, pn: int, names: list[int], exponent: int
) -> None:
    """Packet ``pn`` arrives with a REPAIR over ``names`` (packets that never came)."""
    mask = 0
    for m in names:
        mask |= 1 << (pn - 1 - m)
    window.accept(pn)
    receiver.on_packet(pn, bytes(6), 6, (mask, exponent, LIE), window)


def test_a_repair_of_an_exponent_no_sender_uses_is_refused_and_counted() -> None:
    receiver, window = _parity(), ReplayWindow()
    for i, exponent in enumerate((parity.EXPONENTS, 8, 255)):
        _lie(receiver, window, 24 + i, list(range(24)), exponent)
    assert receiver.equations == []
    assert receiver._stats.repairs_unusable == 3
    _lie(receiver, window, 300, list(range(276, 299)), parity.EXPONENTS - 1)
    assert len(receiver.equations) == 1 and receiver._stats.repairs_unusable == 3


def test_equations_age_out_with_any_packet_not_only_a_repair() -> None:
    receiver, window = _parity(), ReplayWindow()
    for r in range(4):  # 24 packets skipped, 4 REPAIRs over them: nothing determined
        _lie(receiver, window, 24 + r, list(range(24)), 3 - r)
    assert len(receiver.equations) == 4
    steps = receiver.steps
    for pn in range(28, 29 + parity.KEEP):
        _plain(receiver, window, pn)
        if pn == 24 + parity.KEEP:
            assert len(receiver.equations) == 4  # kept while they may still complete
    assert receiver.equations == []  # the carriers are now KEEP packets behind
    assert receiver.steps == steps  # packets that changed no equation: no elimination


def test_pending_equations_are_bounded_and_the_oldest_goes() -> None:
    receiver, window = _parity(), ReplayWindow()
    pn = 0
    for r in range(40):  # each REPAIR over 3 packets of its own: 120 unknowns in all
        _lie(receiver, window, pn + 3, [pn, pn + 1, pn + 2], r % parity.EXPONENTS)
        assert len(receiver.equations) <= parity.PENDING_MAX
        pn += 4
    assert [seq for seq, _, _ in receiver.equations] == list(range(pn - 61, pn, 4))


def test_lying_repairs_cost_elimination_steps_their_packets_paid_for() -> None:
    """The densest systems the 32-packet span allows, over and over: 16 packets
    skipped, then 16 REPAIRs over about 3/4 of them each. Elimination takes at most
    STEP_CREDIT steps a packet in all, no more than PENDING_MAX equations wait, their
    factors stay those of the REPAIRs, and the equations age out."""
    receiver, window = _parity(), ReplayWindow()
    steps = receiver.steps
    stream = random.Random(5)
    pn = packets = 0
    for _ in range(12):
        skipped = list(range(pn, pn + 16))
        pn += 16
        for r in range(16):
            names = [m for m in skipped if stream.random() < 0.75]
            _lie(receiver, window, pn, names, r % parity.EXPONENTS)
            pn += 1
            packets += 1
            assert len(receiver.equations) <= parity.PENDING_MAX
            factors = [c for _, missing, _ in receiver.equations for c in missing.values()]
            assert max(factors, default=0) <= 64**3
            assert receiver.steps - steps <= parity.CREDIT_MAX + packets * parity.STEP_CREDIT
    assert receiver.steps > steps + 1000  # it did eliminate, as much as paid for
    assert receiver._stats.repairs_unusable > 0  # systems the lies determined refute them
    before = receiver.steps
    for _ in range(parity.KEEP + 1):
        _plain(receiver, window, pn)
        pn += 1
    # At most the elimination left waiting for credit, once; then nothing is pending.
    assert receiver.steps - before <= (parity.PENDING_MAX - 1) * parity.PENDING_MAX
    assert receiver.equations == []


def test_an_elimination_the_credit_does_not_cover_waits_for_more_packets() -> None:
    sender, receiver = _parity(), _parity()
    bodies = {pn: frames.reliable_frame(0, pn, bytes([pn]) * (50 + pn)) for pn in range(40)}
    sent = _sources(sender, bodies, 40)
    window = ReplayWindow()
    for pn in range(40):
        if pn in (5, 9, 10):
            continue
        receiver.credit = -100  # as if lying REPAIRs had just spent it
        window.accept(pn)
        decoded = frames.decode_frames(sent[pn])
        receiver.on_packet(pn, sent[pn], decoded.tail, decoded.repair, window)
    assert sorted(dict(receiver.rebuilt)) != [5, 9, 10] and receiver.changed
    for pn in range(40, 60):
        _plain(receiver, window, pn)
    rebuilt = dict(receiver.rebuilt)
    assert sorted(rebuilt) == [5, 9, 10]
    assert all(rebuilt[pn] == bytes(6) + bodies[pn] for pn in (5, 9, 10))
