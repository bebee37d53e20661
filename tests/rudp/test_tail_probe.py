"""The tail-loss probe (``recovery.PacketRecovery.tail_probe_deadline``): a loss at the
tail of a burst, where no later packet's acknowledgment can reveal it, is repaired by
a probe sent ``2 * SRTT + max_ack_delay`` after the newest packet (that packet's
messages again, or a PING), whose acknowledgment shows what else is missing, not by
the resend timeout. Stepped fake clock, in-memory network."""

from __future__ import annotations

from rudp.config import Config
from rudp.connection import Connection
from rudp.recovery import TAIL_PROBE_FLOOR

from .harness import CLIENT, SERVER, Link, Network, frames_of, pair, server_conn

DELAY = 0.05  # each way: a 100 ms round trip
# A resend timeout well above the probe's deadline (as a busy peer's late
# acknowledgments make it on a real path): the probe must come first.
SLOW_RTO = Config(rto_min=0.6, rto_initial=0.6)


def _warm(net: Network, conn: Connection) -> None:
    """A few round trips, so that the RTT estimate is the path's."""
    for i in range(10):
        conn.send(f"warm{i}".encode())
        net.run(0.2)
    assert conn.stats.srtt > 0.09


def _drop_next(net: Network, src: object, *, data: bool, count: int = 1) -> list[float]:
    """Lose the next ``count`` datagrams ``src`` sends (carrying messages if ``data``,
    else acknowledgments alone); returns the list the times of those losses go in."""
    dropped: list[float] = []

    def drop(datagram: bytes, from_: object, to: object) -> bool:
        if from_ != src or len(dropped) >= count:
            return False
        if bool(frames_of(datagram).messages) != data:
            return False
        dropped.append(net.now)
        return True

    net.drop = drop
    return dropped


def test_a_lost_last_packet_is_found_by_the_probe_before_the_resend_timeout() -> None:
    net, server, _client, conn = pair(Link(delay=DELAY), config=SLOW_RTO)
    _warm(net, conn)
    stats = conn.stats
    before = (stats.packets_lost, stats.timeouts, stats.tail_probes)
    dropped = _drop_next(net, CLIENT, data=True)
    conn.send(b"the tail")
    net.run_until(lambda: b"the tail" in server.received(), timeout=5)
    assert dropped
    # The probe at 2 SRTT + max_ack_delay carries the lost packet's message: it
    # arrives half an RTT later, well before RTO + half an RTT.
    assert net.now - dropped[0] < 2.5 * stats.srtt + Config().max_ack_delay + 0.02
    assert net.now - dropped[0] < stats.rto
    # The packet left the flight unjudged: no loss counted, no congestion signal.
    assert (stats.packets_lost, stats.timeouts, stats.tail_probes) == (
        before[0],
        before[1],
        before[2] + 1,
    )


def test_the_probes_acknowledgment_shows_the_rest_of_a_lost_tail() -> None:
    net, server, _client, conn = pair(Link(delay=DELAY), config=SLOW_RTO)
    _warm(net, conn)
    stats = conn.stats
    lost, probes = stats.packets_lost, stats.tail_probes
    dropped = _drop_next(net, CLIENT, data=True, count=2)
    conn.send(b"first")
    net.flush()  # two packets: the probe resends the second; the first is found lost
    conn.send(b"second")
    net.run_until(lambda: {b"first", b"second"} <= set(server.received()), timeout=5)
    assert len(dropped) == 2
    # The probe, its acknowledgment an RTT later, the resend half an RTT after that.
    assert net.now - dropped[0] < 3.5 * stats.srtt + Config().max_ack_delay + 0.02
    assert net.now - dropped[0] < stats.rto
    assert (stats.packets_lost, stats.timeouts, stats.tail_probes) == (lost + 1, 0, probes + 1)


def test_a_probe_that_finds_nothing_lost_tells_congestion_control_nothing() -> None:
    net, server, _client, conn = pair(Link(delay=DELAY), config=SLOW_RTO)
    _warm(net, conn)
    stats = conn.stats
    lost, events, probes = stats.packets_lost, stats.congestion_events, stats.tail_probes
    # The data arrives; its acknowledgment is lost: only the probe's brings the news.
    dropped = _drop_next(net, SERVER, data=False)
    handle = conn.send(b"arrives")
    net.run_until(lambda: handle.acked, timeout=5)
    assert dropped and b"arrives" in server.received()
    assert stats.tail_probes == probes + 1
    assert (stats.packets_lost, stats.congestion_events, stats.timeouts) == (lost, events, 0)
    assert stats.spurious_losses == 0


def test_probes_are_bounded_while_nothing_is_acknowledged() -> None:
    net, _server, _client, conn = pair(Link(delay=DELAY), config=SLOW_RTO)
    _warm(net, conn)
    stats = conn.stats
    probes, timeouts = stats.tail_probes, stats.timeouts
    net.link.blackout = True  # the path goes dark with data in flight
    conn.send(b"into the dark")
    net.run(5.0)
    # One probe, then the resend timer backs off alone: no probe per RTT.
    assert stats.tail_probes == probes + 1
    assert stats.timeouts >= timeouts + 2
    net.link.blackout = False
    net.run_until(lambda: b"into the dark" in net.nodes[SERVER].received(), timeout=30)
    # Once new data is acknowledged, the next tail may be probed again.
    dropped = _drop_next(net, CLIENT, data=True)
    conn.send(b"next tail")
    net.run_until(lambda: b"next tail" in net.nodes[SERVER].received(), timeout=5)
    assert dropped and stats.tail_probes == probes + 2


def test_no_probe_when_the_resend_timeout_comes_first() -> None:
    # A steady path: the resend timeout (SRTT + its variance + max_ack_delay) is shorter
    # than 2 SRTT + max_ack_delay, so it resends the lost tail itself, as before.
    net, server, _client, conn = pair(Link(delay=DELAY))
    _warm(net, conn)
    stats = conn.stats
    assert stats.rto < 2 * stats.srtt + Config().max_ack_delay
    probes, timeouts = stats.tail_probes, stats.timeouts
    _drop_next(net, CLIENT, data=True)
    conn.send(b"the tail")
    net.run_until(lambda: b"the tail" in server.received(), timeout=5)
    assert (stats.tail_probes, stats.timeouts) == (probes, timeouts + 1)
    assert server_conn(server).stats.tail_probes == 0


def test_on_a_fast_path_the_probe_waits_at_least_the_floor() -> None:
    # On loopback 2 SRTT is a millisecond or two: under load the event loop's timers
    # run later than that, and a probe at 2 SRTT + max_ack_delay would resend
    # messages whose acknowledgment is merely on its way.
    net, server, _client, conn = pair(Link(delay=0.0002))
    for i in range(10):
        conn.send(f"warm{i}".encode())
        net.run(0.05)
    recovery = conn._recovery
    assert 0 < 2 * recovery.rtt.srtt < TAIL_PROBE_FLOOR
    conn.send(b"one")
    net.run(0.0001)  # sent, not yet acknowledged
    assert recovery.sent
    wait = recovery.tail_probe_deadline() - recovery.last_eliciting
    assert wait >= TAIL_PROBE_FLOOR + recovery.rtt.peer_ack_delay - 1e-9
    net.run(0.1)
    assert b"one" in server.received()
    assert conn.stats.tail_probes == 0
