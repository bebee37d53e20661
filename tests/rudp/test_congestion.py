"""Congestion control (``Config.congestion_control``): the controller on its own, then
the core through the in-memory network, with a bottleneck, on the stepped fake clock."""

from __future__ import annotations

import random

import pytest

from rudp.config import Config
from rudp.congestion import NO_SSTHRESH, CongestionController
from rudp.connection import Connection
from tests.rudp.harness import CLIENT, Address, Link, Network, pair, pump

D = Config().base_datagram_size
ON = Config(congestion_control=True)
QUEUED = 0.1  # a latest RTT twice the 50 ms minimum the tests use: a queue is building


def fill(cc: CongestionController, seq: int, size: int = D) -> list[int]:
    """Send packets while the window has room; return their numbers."""
    sent = []
    while cc.can_send():
        cc.on_sent(size)
        sent.append(seq)
        seq += 1
    return sent


# -- the controller --------------------------------------------------------------------------


def test_slow_start_doubles_the_window_per_round_trip() -> None:
    cc = CongestionController(ON)
    assert cc.cwnd == 10 * D  # RFC 9002's initial window
    seq, now = 0, 1.0
    for expected in (10, 20, 40, 80):
        sent = fill(cc, seq)
        assert len(sent) == expected
        now += 0.1
        for s in sent:
            cc.on_acked(s, D, now, 0.1)
        seq = sent[-1] + 1
        assert cc.cwnd == 2 * expected * D
        assert cc.bytes_in_flight == 0


def test_congestion_avoidance_adds_one_datagram_per_window() -> None:
    cc = CongestionController(ON)
    cc.ssthresh = cc.cwnd
    sent = fill(cc, 0)
    for s in sent:
        cc.on_acked(s, D, 1.1, 0.1)
    assert cc.cwnd == 11 * D


def test_the_window_is_capped_by_config_window() -> None:
    cc = CongestionController(Config(congestion_control=True, window=16))
    seq = 0
    for round_ in range(6):
        sent = fill(cc, seq)
        for s in sent:
            cc.on_acked(s, D, 1.0 + round_ * 0.1, 0.1)
        seq = sent[-1] + 1
    assert cc.cwnd == 16 * D


def test_an_application_limited_sender_does_not_grow_the_window() -> None:
    """A game's few small messages per tick never test the path: no growth."""
    cc = CongestionController(ON)
    now = 1.0
    for seq in range(500):
        cc.on_sent(100)
        now += 0.02
        cc.on_acked(seq, 100, now, 0.05)
    assert cc.cwnd == 10 * D


def test_a_loss_shrinks_the_window_to_what_the_path_delivered() -> None:
    """Westwood+: after a loss the window is the best recent delivery rate times the
    minimum RTT, not half of whatever it was."""
    cc = CongestionController(ON)
    cc.cwnd = 100 * D
    seq, now = 0, 1.0
    for _ in range(50):  # 40 datagrams acknowledged per 100 ms: 480 kB/s
        for _ in range(40):
            cc.on_sent(D)
        for _ in range(40):
            now += 0.1 / 40
            cc.on_acked(seq, D, now, 0.1)
            seq += 1
    assert cc.cwnd == 100 * D  # application-limited (40 of 100 in flight): no growth
    sent = fill(cc, seq)  # now the window is in use
    # The path's bare RTT is 50 ms: 480 kB/s x 50 ms = 24 kB, 20 datagrams.
    assert cc.on_lost(sent[0], D, sent[-1] + 1, 0.05, QUEUED)
    assert cc.ssthresh == cc.cwnd
    assert 19 * D <= cc.cwnd <= 21 * D


def test_a_loss_while_application_limited_leaves_the_window_alone() -> None:
    """A game's few messages lose one: the window (unused) is kept, so a bulk
    transfer started later begins from it, not from two datagrams."""
    cc = CongestionController(ON)
    now = 1.0
    for seq in range(100):
        cc.on_sent(100)
        now += 0.02
        cc.on_acked(seq, 100, now, 0.05)
    cc.on_sent(100)
    assert not cc.on_lost(100, 100, 101, 0.05, QUEUED)
    assert cc.cwnd == 10 * D
    assert cc.ssthresh > 100 * D  # still in slow start


def test_without_a_rate_sample_a_loss_halves_the_window() -> None:
    cc = CongestionController(ON)
    sent = fill(cc, 0)
    assert cc.on_lost(sent[0], D, sent[-1] + 1, 0.05, QUEUED)
    assert cc.cwnd == 5 * D
    assert cc.ssthresh == 5 * D


def test_a_loss_with_no_queue_building_is_random_and_leaves_the_window_alone() -> None:
    cc = CongestionController(ON)
    cc.cwnd = 64 * D
    sent = fill(cc, 0)
    # Latest RTT within an eighth of the minimum: nothing queues, so not congestion.
    assert not cc.on_lost(sent[0], D, sent[-1] + 1, 0.05, 0.05 * 1.1)
    assert not cc.on_lost(sent[1], D, sent[-1] + 1, 0.05, 0.05)
    assert not cc.on_lost(sent[2], D, sent[-1] + 1, 0.05, 0.05)
    assert not cc.on_lost(sent[3], D, sent[-1] + 1, 0.05, 0.05)
    assert (cc.cwnd, cc.ssthresh, cc.random_losses) == (64 * D, NO_SSTHRESH, 4)
    # A sixteenth of the window lost in one rate sample: past that, losses are
    # congestion whatever the RTT says (a queue too shallow to show in it).
    assert cc.on_lost(sent[4], D, sent[-1] + 1, 0.05, 0.05)
    assert cc.cwnd == 32 * D  # no rate sample yet: halved
    assert cc.random_losses == 4


def test_a_loss_with_a_queue_building_is_congestion() -> None:
    cc = CongestionController(ON)
    sent = fill(cc, 0)
    assert cc.on_lost(sent[0], D, sent[-1] + 1, 0.05, 0.05 * 1.15)
    assert cc.random_losses == 0


def test_one_congestion_event_per_recovery_period() -> None:
    """Losses of packets sent before the recovery began are the same event; a loss of
    one sent after it is a new one. Acks of the older packets do not grow the window."""
    cc = CongestionController(ON)
    sent = fill(cc, 0)
    next_seq = sent[-1] + 1
    assert cc.on_lost(sent[0], D, next_seq, 0.05, QUEUED)
    window = cc.cwnd
    assert not cc.on_lost(sent[1], D, next_seq, 0.05, QUEUED)
    assert not cc.on_lost(sent[2], D, next_seq, 0.05, QUEUED)
    for s in sent[3:]:
        cc.on_acked(s, D, 1.1, 0.1)
    assert cc.cwnd == window
    later = fill(cc, next_seq)
    assert cc.on_lost(later[0], D, later[-1] + 1, 0.05, QUEUED)
    assert cc.cwnd == max(window // 2, 2 * D)


def test_a_spurious_loss_is_undone() -> None:
    cc = CongestionController(ON)
    sent = fill(cc, 0)
    assert cc.on_lost(sent[0], D, sent[-1] + 1, 0.05, QUEUED)
    assert cc.cwnd == 5 * D
    assert not cc.on_spurious_loss(sent[1])  # not the loss that began the recovery
    assert cc.on_spurious_loss(sent[0])
    assert cc.cwnd == 10 * D
    assert cc.recovery_seq == 0  # and the next real loss counts again
    assert cc.on_lost(sent[1], D, sent[-1] + 1, 0.05, QUEUED)


def test_persistent_congestion_drops_to_two_datagrams() -> None:
    cc = CongestionController(ON)
    fill(cc, 0)
    cc.on_persistent_congestion(10)
    assert cc.cwnd == 2 * D


def test_turned_off_the_window_is_fixed() -> None:
    cc = CongestionController(Config(window=64))
    assert not cc.enabled
    assert cc.cwnd == 64 * D
    sent = fill(cc, 0)
    assert len(sent) == 64
    assert not cc.on_lost(sent[0], D, 64, 0.05, QUEUED)
    cc.on_persistent_congestion(64)
    assert cc.cwnd == 64 * D


def test_config_rejects_a_non_boolean() -> None:
    with pytest.raises(ValueError, match="congestion_control"):
        Config(congestion_control=1)  # type: ignore[arg-type]


# -- the core, through the in-memory network --------------------------------------------------


def _data_sends(net: Network, src: Address) -> list[float]:
    """Record when ``src`` puts a DATA packet carrying a message on the wire."""
    times: list[float] = []

    def tap(data: bytes, s: Address, dst: Address) -> None:
        if s == src and len(data) > 500:
            times.append(net.now)

    net.tap = tap
    return times


def test_the_first_round_trips_send_10_20_40_datagrams() -> None:
    net, server, client, conn = pair(Link(delay=0.05), config=ON)
    times = _data_sends(net, CLIENT)
    start = net.now
    for _ in range(400):
        conn.send(bytes(1000))
    net.run(0.35)
    # Each round trip's packets leave in one burst, when the previous round's acks arrive.
    rounds = [sum(1 for t in times if abs(t - start - 0.1 * r) < 0.05) for r in range(3)]
    # Byte counting: 12,000 bytes of ~1,030-byte datagrams is 11.6, so 12 go out.
    assert rounds[0] == 12
    assert 1.8 <= rounds[1] / rounds[0] <= 2.2
    assert 1.8 <= rounds[2] / rounds[1] <= 2.2


@pytest.mark.parametrize("seed", [1, 2])
def test_exactly_once_in_order_under_loss_duplication_and_reordering(seed: int) -> None:
    link = Link(loss=0.3, duplicate=0.1, reorder=0.1, delay=0.02, jitter=0.005)
    net, server, client, conn = pair(link, seed=seed, config=ON)
    rng = random.Random(seed)
    payloads = [rng.randbytes(rng.randint(0, 1100)) for _ in range(1000)]
    pump(net, conn, payloads)
    assert server.received() == payloads
    assert conn.stats.congestion_events > 0
    # Nothing but a keepalive or probe PING may still be in flight, and it is counted.
    in_flight = conn._recovery.sent.values()
    assert all(not p.messages for p in in_flight)
    assert conn.stats.bytes_in_flight == sum(p.size for p in in_flight)


def _lossy_transfer(cc: bool, seed: int) -> tuple[float, Connection]:
    """2 MB over a 40 ms path that loses 2 % of datagrams at random, with no queue.

    Datagrams stay at 1200 bytes: the seeds were picked against that run's losses
    (the controller's time here has a long tail over seeds, e.g. 1.6 s for seed 2 once
    the link's random stream is shifted by a single draw, such as a path MTU probe's)."""
    net, server, client, conn = pair(
        Link(delay=0.02, loss=0.02),
        seed=seed,
        config=Config(congestion_control=cc, max_datagram_size=1200),
    )
    payloads = [bytes([i % 256]) * 1000 for i in range(2000)]
    start = net.now
    pump(net, conn, payloads)
    assert server.received() == payloads
    return net.now - start, conn


@pytest.mark.parametrize("seed", [1, 2])
def test_random_loss_without_a_queue_does_not_shrink_the_window(seed: int) -> None:
    # Every loss used to be congestion: this transfer took 3.7-5x as long with
    # congestion control as without (1.32 and 1.80 s against 0.36 s). What is left
    # is slow start from the initial window (the fixed window starts full).
    fixed_time, _ = _lossy_transfer(False, seed)
    cc_time, conn = _lossy_transfer(True, seed)
    assert conn.stats.random_losses >= 20
    assert conn.stats.congestion_events <= 2
    assert cc_time < 1.6 * fixed_time


def _bottleneck_transfer(cc: bool) -> tuple[float, Connection, Network, list[bytes]]:
    """3 MB through 1 MB/s, 40 ms RTT and a 16 kB drop-tail queue (under half the
    path's bandwidth-delay product): the fixed 256-datagram window overflows it."""
    link = Link(delay=0.02, bandwidth=1e6, queue_limit=16 * 1024)
    net, server, client, conn = pair(link, config=Config(congestion_control=cc))
    payloads = [i.to_bytes(4, "big") * 250 for i in range(3000)]
    start = net.now
    pump(net, conn, payloads)
    return net.now - start, conn, net, server.received()


def test_behind_a_bottleneck_the_window_stops_filling_its_queue() -> None:
    fixed_time, fixed, fixed_net, fixed_got = _bottleneck_transfer(False)
    cc_time, conn, net, got = _bottleneck_transfer(True)
    payloads = [i.to_bytes(4, "big") * 250 for i in range(3000)]
    assert got == payloads and fixed_got == payloads
    # Without it, the queue drops about 3 of every 4 datagrams the sender puts on the
    # link; with it, about 1 %, and the transfer ends sooner (the link stays busy).
    assert fixed_net.queue_drops > 5000
    assert net.queue_drops < fixed_net.queue_drops / 50
    assert conn.stats.congestion_events > 0
    assert cc_time < fixed_time
    assert cc_time < 3.0 * 1.15  # within 15 % of the link's 3 s for 3 MB


def test_timeouts_in_a_row_drop_to_two_datagrams_and_the_probe_still_goes() -> None:
    link = Link(delay=0.01)
    net, server, client, conn = pair(link, config=ON)
    for _ in range(3000):
        conn.send(bytes(1000))
    net.run(0.05)
    link.blackout = True
    net.run_until(lambda: conn.stats.timeouts >= 2, timeout=30)
    cc = conn._cc
    assert cc.cwnd == 2 * conn.stats.path_mtu
    assert cc.bytes_in_flight >= 10 * cc.cwnd  # so only a timeout's probe may go
    probes = _data_sends(net, CLIENT)
    net.run_until(lambda: conn.stats.timeouts >= 3, timeout=30)
    assert probes == [net.now]  # one message resent although the window was full
    link.blackout = False
    net.run_until(lambda: conn.queued == 0, timeout=120)
    assert server.received() == [bytes(1000)] * 3000
    assert conn.stats.congestion_window > 2 * conn.stats.path_mtu  # acknowledged data reopened it


def test_stats_and_metrics_report_the_window() -> None:
    from prometheus_client import CollectorRegistry

    from rudp.metrics import RudpCollector

    net, server, client, conn = pair(Link(delay=0.01, loss=0.1), config=ON, seed=2)
    pump(net, conn, [bytes(1000)] * 500)
    stats = conn.stats
    assert stats.congestion_events > 0
    assert stats.as_dict()["congestion_window"] == stats.congestion_window > 0
    assert stats.bytes_in_flight == 0
    registry = CollectorRegistry()
    RudpCollector([client.endpoint], registry=registry)
    assert registry.get_sample_value("rudp_congestion_events_total") == stats.congestion_events
