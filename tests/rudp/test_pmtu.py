"""Path MTU discovery (``rudp.pmtu``): probing up, black holes, the ceiling, EMSGSIZE.

The core's tests run on the fake-clock network of ``harness``, whose ``Link.mtu``
drops longer datagrams silently (no ICMP: the hard case) and can change mid-run.
"""

from __future__ import annotations

import asyncio
import random
import socket
import sys

import pytest

import rudp
from rudp import wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.events import MessageReceived
from rudp.netsim import LinkConditioner, LinkProfile
from rudp.pmtu import MAX_PROBES, RAISE_INTERVAL, SEARCH_STEP
from rudp.wire import Delivery

from .harness import CLIENT, SERVER, Link, Network, frames_of, pair, searched, server_conn


def _data_from(net: Network, src: object, start: int) -> list[bytes]:
    """DATA datagrams ``src`` put on the wire since ``net.sent[start]`` that carry messages."""
    return [d for d, s, _ in net.sent[start:] if s == src and frames_of(d).messages]


def test_by_default_both_sides_probe_up_to_the_ethernet_limit() -> None:
    net, server, client, conn = pair()
    peer = server_conn(server)
    for side in (conn, peer):
        assert side.stats.path_mtu == 1472
        assert (side.stats.mtu_probes_sent, side.stats.mtu_probes_lost) == (1, 0)
        assert side.stats.packets_lost == 0
    probes = [d for d, s, _ in net.sent if s == CLIENT and len(d) == 1472]
    assert len(probes) == 1
    frames = frames_of(probes[0])
    assert frames.ping and not frames.messages  # PING and PADDING, no message


def test_a_1200_byte_message_then_travels_in_one_datagram() -> None:
    net, server, client, conn = pair()
    start = len(net.sent)
    payloads = [bytes([i]) * 1200 for i in range(50)]
    for data in payloads:
        conn.send(data)
    net.run_until(lambda: conn.queued == 0)
    assert server.received() == payloads
    sent = _data_from(net, CLIENT, start)
    assert len(sent) == 50
    assert all(len(d) == 1200 + 31 + 2 * 13 for d in sent)  # both fragments, one datagram


def test_without_discovery_the_same_message_takes_two_datagrams() -> None:
    net, server, client, conn = pair(config=Config(max_datagram_size=1200))
    assert conn.stats.path_mtu == 1200 and conn.stats.mtu_probes_sent == 0
    start = len(net.sent)
    conn.send(bytes(1200))
    net.run_until(lambda: conn.queued == 0)
    assert len(_data_from(net, CLIENT, start)) == 2


def test_over_ipv6_the_ceiling_is_20_bytes_lower() -> None:
    net = Network()
    server_address = ("fd00::1", 9000, 0, 0)
    server = net.add(server_address, accept=True)
    client = net.add(("fd00::2", 5000, 0, 0))
    conn = client.endpoint.connect(server_address, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED and searched(conn))
    (peer,) = server.endpoint.connections
    net.run_until(lambda: searched(peer))
    assert conn.stats.path_mtu == peer.stats.path_mtu == 1452


def test_the_smaller_max_datagram_size_of_the_two_sides_is_the_ceiling() -> None:
    net = Network()
    server = net.add(SERVER, Config(max_datagram_size=1350), accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED and searched(conn))
    peer = server_conn(server)
    net.run_until(lambda: searched(peer))
    assert conn.stats.path_mtu == peer.stats.path_mtu == 1350


def test_probing_finds_a_smaller_path_mtu_and_a_lost_probe_costs_nothing() -> None:
    net, server, client, conn = pair(Link(mtu=1400))
    assert 1400 - SEARCH_STEP < conn.stats.path_mtu <= 1400
    stats = conn.stats
    # The ceiling and the first midpoint above 1400 were each lost MAX_PROBES times.
    assert stats.mtu_probes_lost == 2 * MAX_PROBES
    # Lost probes are not lost packets: no resend, no timeout, no congestion signal.
    assert (stats.packets_lost, stats.timeouts, stats.congestion_events) == (0, 0, 0)
    assert net.mtu_drops == 2 * (2 * MAX_PROBES)  # the server searched too
    start = len(net.sent)
    payloads = [bytes([i]) * 1300 for i in range(20)]
    for data in payloads:
        conn.send(data)
    net.run_until(lambda: conn.queued == 0)
    assert server.received() == payloads
    assert all(len(d) <= 1400 for d in _data_from(net, CLIENT, start))
    assert net.mtu_drops == 4 * MAX_PROBES  # nothing but probes was ever too long


def test_a_probe_that_goes_with_a_dead_path_is_not_counted_against_its_size() -> None:
    net = Network(link=Link(delay=0.01))
    net.add(SERVER, accept=True)
    client = net.add(CLIENT)
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    net.link.blackout = True  # the first probe and its witness are both lost
    net.run(1.0)
    assert conn.stats.mtu_probes_lost == 0
    net.link.blackout = False
    net.run_until(lambda: searched(conn))
    assert conn.stats.path_mtu == 1472


def _stream(net: Network, conn: Connection, count: int, change: dict[int, int]) -> list[bytes]:
    """Send ``count`` reliable messages (ordered on channels 0-2 and unordered; a
    1200-byte one in three), setting the link's MTU to ``change[i]`` before message
    ``i``; returns what was sent (each starts with its index)."""
    rng = random.Random(5)
    sent: list[bytes] = []
    for i in range(count):
        if i in change:
            net.link.mtu = change[i]
        size = 1200 if i % 3 == 0 else rng.randint(8, 400)
        data = i.to_bytes(4, "big") + rng.randbytes(size - 4)
        if i % 2:
            conn.send(data, delivery=Delivery.RELIABLE_UNORDERED)
        else:
            conn.send(data, channel=i % 3)
        sent.append(data)
        if i % 5 == 0:
            net.run(0.002)
    return sent


def test_a_black_hole_mid_connection_falls_back_and_loses_nothing() -> None:
    net, server, client, conn = pair(Link(delay=0.01, jitter=0.002))
    assert conn.stats.path_mtu == 1472
    sent = _stream(net, conn, 3000, {1000: 1300})
    net.run_until(lambda: conn.queued == 0, timeout=120)
    received = [(e.channel, e.data) for _, e in server.events if isinstance(e, MessageReceived)]
    assert sorted(d for _, d in received) == sorted(sent)  # every one, exactly once
    for channel in range(3):  # and each ordered channel in order
        ordered = [i for i in range(0, len(sent), 2) if i % 3 == channel]
        got = [int.from_bytes(d[:4], "big") for c, d in received if c == channel]
        assert [i for i in got if i % 2 == 0] == ordered
    stats = conn.stats
    assert stats.mtu_black_holes == 1
    assert stats.packets_lost >= 3  # what fell into the hole, resent in smaller datagrams
    net.run_until(lambda: searched(conn))
    assert 1300 - SEARCH_STEP < stats.path_mtu <= 1300  # searched again below the hole


def test_a_wider_path_is_found_again_by_the_raise_timer() -> None:
    net, server, client, conn = pair(Link(mtu=1300))
    assert conn.stats.path_mtu <= 1300
    net.link.mtu = None
    net.run(RAISE_INTERVAL + 1.0)
    assert conn.stats.path_mtu == 1472
    assert conn.state is State.CONNECTED


def test_emsgsize_loses_a_probe_at_once_and_drops_the_size_of_the_current_one() -> None:
    net, server, client, conn = pair(Link(delay=0.01))
    endpoint = client.endpoint
    # The interface refuses a datagram of the current size: fall back at once.
    endpoint.datagram_refused(SERVER, 1472, net.now)
    assert (conn.stats.path_mtu, conn.stats.mtu_black_holes) == (1200, 1)
    net.link.mtu = 1400
    net.flush()  # the search starts again: a probe is in flight
    pmtu = conn._pmtu
    assert pmtu.probe_pn >= 0
    size = pmtu.probe_size
    endpoint.datagram_refused(SERVER, size, net.now)
    assert conn.stats.mtu_probes_lost == 1  # at once, and the size is ruled out
    assert pmtu.high == size - 1
    endpoint.datagram_refused(("10.9.9.9", 1), 1472, net.now)  # no connection: ignored
    net.run_until(lambda: searched(conn))
    assert size - 1 - SEARCH_STEP < conn.stats.path_mtu < size  # below the refused size


def test_no_probe_while_closing() -> None:
    net, server, client, conn = pair(Link(mtu=1300))
    conn._pmtu.start(1200, 1472, net.now)  # a search would start now
    conn.close(net.now)
    net.run(5.0)
    assert conn.state is State.CLOSED
    assert conn._pmtu.deadline == float("inf")


# -- wire and simulator --------------------------------------------------------------------


def test_padding_ends_the_frames_of_a_packet() -> None:
    body = wire.ack_fields(0, 0) + wire.probe_frames(100)
    assert len(body) == 106
    frames = wire.decode_frames(body)
    assert frames.ping and not frames.messages and frames.disconnect is None
    # Whatever follows PADDING is not read.
    frames = wire.decode_frames(wire.ack_fields(0, 0) + b"\x00\xff\xfe")
    assert not frames.ping and not frames.messages


def test_the_link_conditioner_drops_datagrams_longer_than_its_mtu() -> None:
    link: LinkConditioner[int] = LinkConditioner(LinkProfile(mtu=1300), rng=random.Random(1))
    link.send(bytes(1300), 0.0, 1)
    link.send(bytes(1301), 0.0, 2)
    assert [meta for _, meta in link.poll(0.0)] == [1]
    assert (link.stats.dropped_mtu, link.stats.delivered) == (1, 1)
    link.profile = LinkProfile(mtu=1200)  # the path changes mid-run
    link.send(bytes(1300), 1.0, 3)
    assert link.poll(1.0) == [] and link.stats.dropped_mtu == 2
    assert not LinkProfile(mtu=1500).is_perfect
    with pytest.raises(ValueError, match="mtu"):
        LinkProfile(mtu=0)


# -- the asyncio layer ---------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="IP_MTU_DISCOVER is Linux's")
async def test_the_socket_never_fragments_and_emsgsize_is_not_raised() -> None:
    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data)

    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        endpoint = server.endpoint
        sock = endpoint._sock
        ip_mtu_discover, ip_pmtudisc_do = 10, 2  # <linux/in.h>; Python names them from 3.12
        assert sock.getsockopt(socket.IPPROTO_IP, ip_mtu_discover) == ip_pmtudisc_do
        conn = await rudp.connect(*server.address)
        # Loopback carries 65,535-byte packets: the search ends at the ceiling.
        async with asyncio.timeout(10):
            while conn.stats.path_mtu != 1472:
                await asyncio.sleep(0.01)
        conn.send(bytes(1200))
        assert (await asyncio.wait_for(conn.recv(), 10)).data == bytes(1200)
        # Larger than any IPv4 datagram: EMSGSIZE, counted, nothing raised.
        endpoint._sendto(bytes(70_000), conn.remote_address)
        assert endpoint.datagrams_too_large == 1 and endpoint.send_errors == 0
        await conn.close()


def test_messages_whose_fragments_share_a_packet_mix_with_reassembled_ones() -> None:
    # In order and complete in one packet, a message skips reassembly; a loss, a
    # reordering or a duplicate sends its fragments through reassembly instead.
    net, server, client, conn = pair(Link(loss=0.1, reorder=0.1, duplicate=0.05, jitter=0.003))
    rng = random.Random(3)
    payloads = [rng.randbytes(rng.choice((1200, 1300, 2500, 40))) for _ in range(400)]
    for data in payloads:
        conn.send(data, channel=1)
    net.run_until(lambda: conn.queued == 0, timeout=120)
    assert server.received() == payloads
    receiver = server_conn(server)._receiver
    assert receiver.parts == {} and receiver.reassembly_bytes == 0
