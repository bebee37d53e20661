"""Limits negotiated in the handshake: each side states what it accepts (largest message,
channels, receive buffer, datagram size, idle timeout) and the other keeps to it.

The rule under test: no silent stall. With every limit different on the two sides, each
one either raises at once (naming the peer's limit) or lets the message through within a
round trip; a peer that breaks a limit anyway ends the connection with a protocol error
that names it."""

from __future__ import annotations

import dataclasses

import pytest

import rudp
from rudp import frames, wire
from rudp.config import Config
from rudp.connection import Connection, State
from rudp.errors import LocalProtocolError, MessageTooLarge
from rudp.events import DisconnectReason
from rudp.wire import DropReason
from tests.rudp.harness import (
    CLIENT,
    SERVER,
    Link,
    Network,
    Node,
    frames_of,
    server_conn,
    tagged,
    tags,
)

DELAY = 0.02
RTT = 2 * DELAY
# The server (A) and the client (B) differ in every limit, each side smaller in some.
A = Config(
    max_message_size=5000,
    channels=16,
    recv_buffer_bytes=8000,
    max_datagram_size=1400,
    idle_timeout=8.0,
    channel_window=64,
)
B = Config(
    max_message_size=20_000,
    channels=4,
    recv_buffer_bytes=50_000,
    max_datagram_size=700,
    idle_timeout=4.0,
    channel_window=2048,
)


def _pair(
    a: Config = A, b: Config = B, before: list[bytes] | None = None, *, keyed: bool = False
) -> tuple[Network, Node, Node, Connection, Connection]:
    net = Network(seed=21, link=Link(delay=DELAY))
    key = bytes(range(32))
    server = net.add(SERVER, dataclasses.replace(a, static_key=key) if keyed else a, accept=True)
    client = net.add(CLIENT, b)
    conn = client.endpoint.connect(
        SERVER, net.now, server_key=rudp.public_key(key) if keyed else None
    )
    for data in before or []:
        conn.send(data)  # queued while connecting: checked against our limits only
    net.run_until(lambda: conn.state is not State.CONNECTING, timeout=10)
    net.run(0.01)
    sconn = server_conn(server) if server.endpoint.connections else conn
    return net, server, client, conn, sconn


def _arrives_within_a_round_trip(net: Network, node: Node, data: bytes) -> None:
    start = net.now
    net.run_until(lambda: data in node.received(), timeout=1)
    assert net.now - start <= RTT


def test_largest_message_raises_at_once_naming_the_peers_limit_or_arrives() -> None:
    net, a, b, to_a, to_b = _pair()
    with pytest.raises(MessageTooLarge, match=r"peer's largest message \(5000 bytes\)"):
        to_a.send(bytes(5001))  # B allows 20,000; A takes 5,000
    assert to_a.queued == 0
    big = b"m" * 5000
    to_a.send(big)
    _arrives_within_a_round_trip(net, a, big)
    with pytest.raises(MessageTooLarge, match=r"Config\.max_message_size"):
        to_b.send(bytes(5001))  # A's own limit, named as such
    fine = b"n" * 5000
    to_b.send(fine)
    _arrives_within_a_round_trip(net, b, fine)


def test_channels_raise_at_once_naming_the_peers_count_or_arrive() -> None:
    net, a, b, to_a, to_b = _pair()
    with pytest.raises(LocalProtocolError, match="beyond the 4 channels the peer accepts"):
        to_b.send(b"x", channel=5)  # A has 16 channels, B accepts 4
    with pytest.raises(LocalProtocolError, match=r"channel must be in \[0, 4\)"):
        to_a.send(b"x", channel=5)  # B's own count
    to_b.send(b"on 3", channel=3)
    _arrives_within_a_round_trip(net, b, b"on 3")
    to_a.send(b"on 3 up", channel=3)
    _arrives_within_a_round_trip(net, a, b"on 3 up")


def test_datagrams_keep_to_the_smaller_size_both_ways() -> None:
    net, a, b, to_a, to_b = _pair()
    assert to_a.max_datagram_payload == to_b.max_datagram_payload
    assert to_b.max_datagram_payload == 700 - wire.DATA_HEADER_SIZE - frames.MESSAGE_OVERHEAD
    start = len(net.sent)
    to_b.send(bytes(4900))
    to_a.send(bytes(4900))
    to_b.send(bytes(to_b.max_datagram_payload), reliable=False)
    with pytest.raises(MessageTooLarge):
        to_b.send(bytes(to_b.max_datagram_payload + 1), reliable=False)
    net.run(RTT)
    assert len(a.received()) == 1 and len(b.received()) == 2
    data = [d for d, _, _ in net.sent[start:] if d[0] == wire.DATA_BYTE]
    assert data and max(map(len, data)) <= 700


def test_the_receive_buffer_of_the_peer_is_respected_and_nothing_is_refused() -> None:
    net, a, b, to_a, to_b = _pair()
    assert to_a._builder._byte_window == 8000 and to_b._builder._byte_window == 50_000
    for i in range(40):
        to_a.send(bytes([i]) * 600)
    net.run_until(lambda: len(a.received()) == 40, timeout=4 * RTT)
    assert a.endpoint.stats.dropped[DropReason.RECV_BUFFER_FULL] == 0


def test_a_message_larger_than_the_peers_whole_buffer_still_goes() -> None:
    # The server's reorder buffer is as small as allowed: one full datagram's message
    # and its entry cost do not fit it, yet it goes out (alone), and arrives.
    small = Config(max_datagram_size=600, recv_buffer_bytes=600)
    net, a, b, to_a, to_b = _pair(small, Config())
    payload = to_a.max_datagram_payload
    for i in range(5):
        to_a.send(bytes([i]) * payload)
    # One message in flight at a time, and each acknowledgment of a lone packet may wait
    # for the peer's ack delay (a packet that leaves the window blocked asks for it at
    # once, but this one fills its datagram and the next is held by the buffer).
    delay = Config().max_ack_delay
    net.run_until(lambda: len(a.received()) == 5, timeout=6 * RTT + 5 * delay)


def test_the_smaller_idle_timeout_ends_both_sides() -> None:
    net, a, b, to_a, to_b = _pair()
    assert to_a._idle_timeout == to_b._idle_timeout == 4.0
    net.link.blackout = True
    net.run(4.0 + 0.1)
    assert to_a.state is State.CLOSED and to_b.state is State.CLOSED
    for conn in (to_a, to_b):
        assert conn.close_reason is not None
        assert conn.close_reason.reason is DisconnectReason.TIMEOUT


def test_a_peer_that_breaks_the_channel_limit_ends_the_connection_naming_it() -> None:
    # NK: the client's reset token crossed the network sealed, so the server believes
    # the NOCONN that follows (under NN it would learn at its idle timeout).
    net, a, b, to_a, to_b = _pair(keyed=True)
    rogue = to_b.seal_datagram(wire.ack_fields(0, 0) + frames.reliable_frame(9, 0, b"x"))
    b.endpoint.receive_datagram(rogue, SERVER, net.now)
    assert to_a.state is State.CLOSED
    assert to_a.close_reason is not None
    assert to_a.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "channel 9" in to_a.close_reason.text and "4 channels" in to_a.close_reason.text
    # The other side learns within a round trip of its next packet.
    to_b.send(b"still there?")
    start = net.now
    net.run_until(lambda: to_b.state is State.CLOSED, timeout=1)
    assert net.now - start <= RTT + 1e-9


def test_a_fragment_of_a_message_past_our_largest_ends_the_connection_naming_it() -> None:
    # The peer knew our limit from the handshake: a counted drop would leave the rest of
    # that message, and its channel, stalled for good.
    net, a, b, to_a, to_b = _pair(keyed=True)
    fragment = frames.message_frame(1, 0, 0, b"z" * 100, fragment=(0, 2, 5001))
    rogue = to_a.seal_datagram(wire.ack_fields(0, 0) + fragment)
    a.endpoint.receive_datagram(rogue, CLIENT, net.now)
    assert to_b.state is State.CLOSED
    assert to_b.close_reason is not None
    assert to_b.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "5001-byte message" in to_b.close_reason.text
    assert "at most 5000 bytes" in to_b.close_reason.text
    assert a.endpoint.stats.dropped[DropReason.MALFORMED] == 0
    assert to_b._receiver.parts == {} and to_b._receiver.reserved_bytes == 0
    # The client learns within a round trip of its next packet (NOCONN, believed: NK).
    to_a.send(b"still there?")
    start = net.now
    net.run_until(lambda: to_a.state is State.CLOSED, timeout=1)
    assert net.now - start <= RTT + 1e-9
    assert to_a.close_reason is not None
    assert to_a.close_reason.reason is DisconnectReason.NO_CONNECTION


def test_messages_keep_within_the_smaller_channel_window_and_none_is_lost() -> None:
    # The channel window was not stated: a sender with a larger one ran further ahead
    # than the receiver takes, which took those messages for old copies (their 16-bit
    # numbers could have wrapped), dropped them and acknowledged the packets. The
    # sender counted them delivered: lost for good, and the channel stalled silently.
    net, a, b, to_a, to_b = _pair()
    assert to_a._builder._window == 64 and to_b._builder._window == 64
    lost: list[bytes] = []

    def first_message_lost(data: bytes, src: tuple[object, ...], dst: object) -> bool:
        if not lost and src == CLIENT and frames_of(data).messages:
            lost.append(data)
            return True
        return False

    net.drop = first_message_lost
    for i in range(300):
        to_a.send(tagged(i))
        net.flush()  # a packet each: the ones after the lost one run ahead
    net.run_until(lambda: len(a.received()) == 300, timeout=5)
    assert tags(a) == list(range(300)) and lost
    assert a.endpoint.stats.dropped[DropReason.RECV_BUFFER_FULL] == 0
    assert to_b.stats.duplicate_messages == 0


def test_a_fragmented_message_larger_than_the_peers_reorder_buffer_arrives() -> None:
    # The receiver holds fragments in its reassembly budget, not its reorder buffer; the
    # sender charged them to the reorder buffer all the same, and freed nothing until
    # the whole message was acknowledged: a message larger than the peer's buffer never
    # went past the first ones, and the connection stayed open with it stuck.
    net, a, b, to_a, to_b = _pair(
        dataclasses.replace(A, max_message_size=60_000),
        dataclasses.replace(B, max_message_size=60_000),
    )
    big = bytes(range(256)) * 160  # 40,960 bytes: five times A's 8,000-byte buffer
    to_a.send(big)
    to_a.send(b"after it")
    net.run_until(lambda: len(a.received()) == 2, timeout=20 * RTT)
    assert a.received() == [big, b"after it"]
    net.run_until(lambda: to_a.queued == 0, timeout=4 * RTT)
    assert to_a._sender.unacked_bytes == 0


def test_a_message_of_more_fragments_than_the_peers_window_raises_at_once() -> None:
    # B's 700-byte datagrams cut a message into 655-byte fragments; A takes 64 ahead.
    net, a, b, to_a, to_b = _pair(
        dataclasses.replace(A, max_message_size=60_000),
        dataclasses.replace(B, max_message_size=60_000),
    )
    fits = 64 * 655
    with pytest.raises(MessageTooLarge, match=r"takes 64 ahead \(channel_window"):
        to_a.send(bytes(fits + 1))
    assert to_a.queued == 0
    to_a.send(b"f" * fits)
    net.run_until(lambda: b"f" * fits in a.received(), timeout=5)


@pytest.mark.parametrize(
    "frame",
    [
        frames.reliable_frame(0, 1, b"r" * 101),
        frames.unreliable_frame(0, b"u" * 101),
        frames.message_frame(wire.GRAPH, 0, 0, b"g" * 101),
    ],
    ids=["reliable", "unreliable", "graph"],
)
def test_a_whole_message_past_our_largest_ends_the_connection_naming_it(frame: bytes) -> None:
    # A message small enough for one datagram needs no fragment to break our limit: a
    # peer with the keys sent it anyway (send() would have raised at an honest one).
    # It was delivered, larger than the application said it takes.
    small = dataclasses.replace(A, max_message_size=100)
    net, a, b, to_a, to_b = _pair(small, keyed=True)
    to_a.send(b"within" + bytes(94))
    net.run(RTT)
    a.endpoint.receive_datagram(to_a.seal_datagram(wire.ack_fields(0, 0) + frame), CLIENT, net.now)
    net.run(RTT)
    assert a.received() == [b"within" + bytes(94)]
    assert to_b.state is State.CLOSED
    assert to_b.close_reason is not None
    assert to_b.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "101-byte message" in to_b.close_reason.text
    assert "at most 100 bytes" in to_b.close_reason.text


def test_a_fragment_of_more_fragments_than_our_window_ends_the_connection_naming_it() -> None:
    # Its fragments take consecutive numbers and we take none further ahead than our
    # channel window (stated in the handshake): the message could never complete, and
    # its budget and channel would stay held for good.
    net, a, b, to_a, to_b = _pair(keyed=True)
    fragment = frames.message_frame(1, 0, 0, b"z" * 60, fragment=(0, 65, 4000))
    a.endpoint.receive_datagram(
        to_a.seal_datagram(wire.ack_fields(0, 0) + fragment), CLIENT, net.now
    )
    assert to_b.state is State.CLOSED
    assert to_b.close_reason is not None
    assert to_b.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "65 fragments" in to_b.close_reason.text
    assert "64 ahead (channel_window)" in to_b.close_reason.text
    assert to_b._receiver.parts == {} and to_b._receiver.reserved_bytes == 0


def test_a_fragment_within_our_largest_message_is_taken() -> None:
    net, a, b, to_a, to_b = _pair()
    first = frames.message_frame(1, 0, 0, b"y" * 2500, fragment=(0, 2, 5000))
    second = frames.message_frame(1, 0, 1, b"z" * 2500, fragment=(1, 2, 5000))
    for frame in (first, second):
        a.endpoint.receive_datagram(
            to_a.seal_datagram(wire.ack_fields(0, 0) + frame), CLIENT, net.now
        )
    net.run(RTT)
    assert a.received() == [b"y" * 2500 + b"z" * 2500]
    assert to_b.state is State.CONNECTED


def test_a_message_queued_before_the_handshake_past_the_peers_limit_ends_it_at_once() -> None:
    net, a, b, to_a, _ = _pair(before=[b"ok", bytes(6000)])
    assert to_a.state is State.CLOSED
    assert to_a.close_reason is not None
    assert to_a.close_reason.reason is DisconnectReason.PROTOCOL_ERROR
    assert "largest message is 5000 bytes" in to_a.close_reason.text


def test_the_reported_mismatch_raises_at_once_and_the_connection_goes_on() -> None:
    # As reported against version 1: 4 MiB on one side, the default on the other, a
    # 2 MiB reliable message refused fragment by fragment, send() never completing,
    # a message on another channel never arriving, and no error on either side.
    big = Config(max_message_size=4 << 20, max_reassembly_bytes=4 << 20)
    net, a, b, to_a, to_b = _pair(Config(), big)
    with pytest.raises(MessageTooLarge, match=r"peer's largest message \(1048576 bytes\)"):
        to_a.send(bytes(2 << 20))
    to_a.send(b"other channel", channel=1)
    _arrives_within_a_round_trip(net, a, b"other channel")
    whole = bytes(range(256)) * 4096  # 1 MiB: the server's limit, taken both ways
    to_a.send(whole)
    to_b.send(whole)
    net.run_until(lambda: whole in a.received() and whole in b.received(), timeout=30)
    assert to_a.state is State.CONNECTED and to_b.state is State.CONNECTED
