"""Wire version 2 attacked from outside, on the stepped fake clock: an off-path spoofer,
an on-path observer who reads, copies, rewrites and replays datagrams, and a malicious
peer who holds the session keys.

test_security.py covers the sealed DATA packet; this module covers the other packet
types (CONNECT, CHALLENGE, ACCEPT, REJECT, NOCONN, QUERY_REPLY) under the same attacks,
floods spanning the whole handshake, and what a peer with the keys can make us spend.
Every attack is counted under its own drop reason and leaves the connection working."""

from __future__ import annotations

import tracemalloc

from rudp import frames, wire
from rudp.connection import State
from tests.rudp.harness import CLIENT, pair, server_conn

# -- a malicious peer ----------------------------------------------------------------------


def test_a_peer_that_skips_packet_numbers_costs_no_memory() -> None:
    # A sender may skip packet numbers (nothing forbids it, and the nonce stays unique),
    # up to 2**31 - 1 ahead of the largest received per packet. Shifting the
    # acknowledgment bitfield by that much built a 256 MB integer for each such packet.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    ack = wire.ack_fields(0, 0)
    tracemalloc.start()
    try:
        for i in range(3):
            conn._builder.tx_next += (1 << 31) - 10
            packet = conn.seal_datagram(ack + frames.unreliable_frame(0, b"jump %d" % i))
            assert server.endpoint.receive_datagram(packet, CLIENT, net.now) is sconn
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 1e6:.0f} MB"
    assert sconn._reader.rx_largest == conn._builder.tx_next - 1 and sconn._reader.rx_bits == 1
    net.run(0.1)
    assert server.received() == [b"jump 0", b"jump 1", b"jump 2"]
    # The connection goes on: acknowledgments of the new numbers, messages both ways.
    conn.send(b"after the jumps")
    sconn.send(b"down after the jumps")
    net.run(1)
    assert b"after the jumps" in server.received()
    assert b"down after the jumps" in client.received()
    assert conn.state is State.CONNECTED and sconn.state is State.CONNECTED
    assert conn.queued == 0 and sconn.queued == 0
