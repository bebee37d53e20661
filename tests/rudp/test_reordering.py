"""Loss detection on a reordering path (``rudp.recovery``): packets of one flush are not
each other's proof of loss, reordering seen widens the packet threshold, and the loss
timer wakes only for the tail of a burst.

Deterministic: two cores on the in-memory network and the stepped clock.
"""

from __future__ import annotations

from rudp.config import Config
from rudp.connection import Connection
from rudp.recovery import GRANULARITY, PacketRecovery

from .harness import Link, Network, Node, pair, server_conn


def bulk(link: Link, seed: int, count: int = 800) -> tuple[Network, Node, Connection, float]:
    """``count`` messages of 1,200 bytes handed over at once; seconds until all arrived."""
    net, server, _, conn = pair(link, seed, Config(max_datagram_size=1240))
    start = net.now
    for _ in range(count):
        conn.send(bytes(1200))
    receiver = server_conn(server)
    net.run_until(lambda: receiver.stats.messages_received >= count)
    took = net.now - start
    net.run_until(lambda: conn.queued == 0 and not conn._recovery.sent)
    return net, server, conn, took


def test_a_window_scrambled_by_jitter_is_not_declared_lost() -> None:
    # 20 +- 5 ms each way: the first acknowledgment of the first window (sent in one
    # flush) names a packet that overtook most of the others. Before, that declared
    # every packet 3 or more below it lost: about 200 spurious losses in this transfer
    # (6-23 now, from the time threshold early on, while the RTT estimate is low).
    for seed in (1, 2, 3):
        _, server, conn, _ = bulk(Link(delay=0.020, jitter=0.005), seed)
        assert conn.stats.spurious_losses <= 30
        assert conn.stats.messages_resent <= 30
        assert conn._recovery.reordering
        assert server_conn(server).stats.messages_received == 800


def test_the_loss_timer_wakes_only_for_the_tail_of_a_burst() -> None:
    # Acknowledgments of later packets run loss detection; a timer armed on every one
    # of them woke some 170 times in a lossy transfer like this one (12-20 now).
    _, _, conn, _ = bulk(Link(loss=0.05, delay=0.020, jitter=0.005), seed=4)
    assert conn.stats.packets_lost > 10
    assert conn.stats.timer_wakeups < 40
    assert conn.stats.spurious_losses <= 20


def test_losses_on_a_path_without_reordering_are_found_without_the_timer() -> None:
    _, _, conn, took = bulk(Link(loss=0.02, delay=0.020), seed=5)
    assert conn.stats.packets_lost > 5
    assert conn.stats.spurious_losses == 0
    assert conn.stats.timeouts <= 1
    assert not conn._recovery.reordering
    assert took < 0.5


def test_a_late_acknowledgment_widens_the_packet_threshold() -> None:
    _, _, conn, _ = bulk(Link(delay=0.020, jitter=0.005), seed=6, count=300)
    recovery = conn._recovery
    assert recovery.reorder_threshold > Config().reorder_threshold


def test_the_flush_window_is_half_an_rtt_at_least_and_an_rtt_at_most() -> None:
    _, _, conn, _ = bulk(Link(delay=0.020, jitter=0.005), seed=7, count=300)
    recovery: PacketRecovery = conn._recovery
    rtt = conn._rtt
    base = max(rtt.srtt, rtt.latest)
    assert base / 2 <= recovery.flush_window() <= base


def test_without_reordering_a_gap_in_a_flush_is_a_loss_at_once() -> None:
    # A path not seen to reorder keeps the packet threshold inside a flush: a packet
    # still missing when three later ones of its flush are acknowledged is lost then,
    # not 9/8 RTT after it was sent (which made a lossy path without jitter slower).
    net, _, client, conn = pair(Link(delay=0.020))
    big = [0]

    def drop(data: bytes, src: tuple[object, ...], dst: tuple[object, ...]) -> bool:
        if len(data) > 1000 and net.nodes.get(src) is client:
            big[0] += 1
            return big[0] == 3
        return False

    net.drop = drop
    sent_at = net.now
    for _ in range(8):
        conn.send(bytes(1100))  # one message per packet, all in one flush
    net.run_until(lambda: conn.stats.packets_lost > 0, timeout=1.0)
    assert 0.040 - 1e-9 <= net.now - sent_at <= 0.040 + 2 * GRANULARITY
    assert conn.stats.timeouts == 0 and conn.stats.spurious_losses == 0
    assert not conn._recovery.reordering
