"""Packet reading: opening each DATA datagram and telling every part what it said.

Theory of operation
-------------------
The endpoint routes a DATA datagram by its connection id to
``Connection._receive_sealed``, which hands it here. ``PacketReader.receive``:

1. reconstructs the 64-bit packet number from the 32 bits on the wire, refuses a
   replay or a packet older than the replay window before any decryption, and
   opens the packet (``protection.Opener``); one that fails authentication
   changes nothing at all: no acknowledgment, RTT sample, timer or idle refresh;
2. decodes its frames and applies a PAUSE or RESUME if the packet is newer than
   the last one that carried either (even from a packet refused below, so a
   RESUME that travels with messages we cannot take yet is not refused with them
   every time);
3. refuses, unacknowledged, a packet whose messages break a limit: a channel we
   do not have (a protocol error: the peer knew), a fragment that can never be
   reassembled, a full receive buffer, or a paused receiver's exhausted budget;
4. records the packet in the packet-level receive window (the newest number and a
   bitfield of those before it: what every header we send acknowledges), hands
   the acknowledgment it carries to loss detection (``recovery``) and its
   messages to the receiver (``receiving``), and asks for an acknowledgment if
   it elicits one.

Acknowledgments are delayed, as QUIC's are: one waits up to ``max_ack_delay`` (a
transport parameter, which the peer's resend timer allows for) for a packet that
goes out anyway to carry it, and goes alone only when none does. It goes at once
when the packet arrives out of order (reordering or loss: the sender learns
sooner), for every second ack-eliciting packet, and for a PING or DISCONNECT.

When more packets arrive between two flushes than one header can acknowledge
(33), the older ones are acknowledged at once in an ack-only packet, or the
sender would declare them lost and resend. A late packet more than 32 behind the
newest gets an ack-only packet about itself.

Flow control: a receiver whose application is not keeping up calls
``Connection.pause_receiving()``, which sends PAUSE; the peer then sends no new
reliable messages (resends, unreliable messages, acks, PING and DISCONNECT still
go) until RESUME. Both frames are ack-eliciting and, while they still describe
the current state, resent when lost; a receiver applies one only from a packet
newer than the last that carried one, so a late copy never undoes a newer
state. Messages already on their way when the receiver paused are accepted, up
to ``recv_buffer_bytes`` of datagrams (``pause_budget``); past that a paused
receiver refuses packets carrying messages, so a peer that ignores PAUSE cannot
make it hold more.

Limits: a message on a channel we do not have, or a message (or a fragment
announcing one) larger than our ``max_message_size``, in an authenticated packet, ends
the connection with ``protocol error`` naming the limit: the peer knew it from
the handshake, and dropping the packet would stall the channel for good.

Migration: PATH_CHALLENGE and PATH_RESPONSE frames are handed to the connection
(``Migration.on_frames``; see ``rudp.migration``) from any authenticated packet, even
one refused below, like PAUSE and RESUME.

Judgement call: the reader decides what a packet means; what follows from it for
the connection as a whole (a protocol error, the peer's DISCONNECT, the close we
were waiting for) is decided by the connection, whose lifecycle methods it calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from rudp import frames, wire
from rudp.parity import process_rebuilt
from rudp.protection import Opener
from rudp.state import CLOSED, DRAINING
from rudp.wire import ACK_SPAN, DropReason

if TYPE_CHECKING:
    from rudp.config import Config
    from rudp.connection import Connection
    from rudp.packet_builder import PacketBuilder
    from rudp.parity import Parity
    from rudp.receiving import Receiver
    from rudp.recovery import PacketRecovery
    from rudp.sending import Sender
    from rudp.sink import EndpointSink
    from rudp.stats import ConnectionStats

_PN_BITS: Final = 32  # the DATA header carries the packet number's low 32 bits
EARLY_ACK_SPAN: Final = ACK_SPAN // 2


class PacketReader:
    """Opens and processes the DATA packets of one connection."""

    __slots__ = (
        "_builder",
        "_conn",
        "_receiver",
        "_recovery",
        "_rx_mask",
        "_rx_window",
        "_sender",
        "_sink",
        "_stats",
        "opener",
        "parity",
        "pause_budget",
        "peer_flow_seq",
        "rx_bits",
        "rx_largest",
        "rx_largest_time",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self,
        conn: Connection,
        builder: PacketBuilder,
        recovery: PacketRecovery,
        sender: Sender,
        receiver: Receiver,
        sink: EndpointSink,
        stats: ConnectionStats,
        config: Config,
    ) -> None:
        self._conn = conn
        self._builder = builder
        self._recovery = recovery
        self._sender = sender
        self._receiver = receiver
        self._sink = sink
        self._stats = stats
        self.opener: Opener | None = None  # set when the handshake completes
        self.parity: Parity | None = None  # the peer's REPAIRs are read (rudp.parity)
        self.rx_largest = -1
        self.rx_bits = 0  # bit i: packet (largest - i) was received
        self.rx_largest_time = 0.0  # when it arrived (for the ACK_DELAY frame)
        # Packets remembered for acknowledgment; twice the window, so reordering
        # within a full window is never mistaken for staleness.
        self._rx_window = max(1024, 2 * config.window)
        self._rx_mask = (1 << self._rx_window) - 1
        self.peer_flow_seq = -1  # the newest packet whose PAUSE or RESUME we applied
        self.pause_budget = 0  # datagram bytes with messages still accepted while paused

    def peek(self, data: bytes) -> bytes | None:
        """The opened body of a DATA packet, or None, changing nothing."""
        opener = self.opener
        if opener is None or len(data) < wire.DATA_HEADER_SIZE:
            return None
        pn = opener.full_number(wire.decode_data_prefix(data)[1], _PN_BITS)
        cut = wire.DATA_PREFIX_SIZE
        return opener.peek(pn, data[:cut], data[cut:])

    def receive(self, data: bytes, pn32: int, now: float) -> DropReason | None:
        """Open one DATA packet, then process it."""
        opener = self.opener
        if opener is None:
            return DropReason.UNEXPECTED  # no keys yet: the ACCEPT was lost or overtaken
        pn = opener.full_number(pn32, _PN_BITS)
        if opener.window.seen(pn):
            if self.parity is not None and self.parity.arrived_late(pn):
                return DropReason.DUPLICATE  # rebuilt from parity before it came
            return DropReason.REPLAYED
        # (At least DATA_HEADER_SIZE long, so the tag is there: the endpoint checked.)
        body = opener.open_unseen(pn, data[: wire.DATA_PREFIX_SIZE], data[wire.DATA_PREFIX_SIZE :])
        if body is None:
            return DropReason.AUTH_FAILED
        # The ack fields (wire.ACK_FIELDS) read byte by byte: native when compiled,
        # where int.from_bytes of a slice cost two objects and a method call.
        ack = (body[0] << 8) | body[1]
        ack_bits = (body[2] << 24) | (body[3] << 16) | (body[4] << 8) | body[5]
        reason = self.process(body, pn, ack, ack_bits, now, len(data))
        if self.parity is not None and self.parity.rebuilt:
            process_rebuilt(self, self.parity, opener, now)
        return reason

    def process(
        self, data: bytes, seq: int, ack16: int, ack_bits: int, now: float, size: int
    ) -> DropReason | None:
        """Process the opened body of DATA packet number ``seq`` (``size`` bytes on the
        wire). The replay window already refused duplicates and packets too old."""
        conn = self._conn
        draining = conn.state is DRAINING
        delta = seq - self.rx_largest
        decoded = frames.decode_frames(data)  # DecodeError is counted by the endpoint
        parity = self.parity
        if parity is not None and self.opener is not None:
            parity.on_packet(seq, data, decoded.tail, decoded.repair, self.opener.window)
            if decoded.recovered >= 0:
                parity.on_report(decoded.recovered)
        receiver = self._receiver
        flow = decoded.flow
        if flow != frames.NO_FLOW and seq > self.peer_flow_seq and not draining:
            self.peer_flow_seq = seq
            conn._on_peer_flow(flow == 1, now)
        if decoded.messages:
            violation = receiver.channel_violation(decoded.messages)
            if violation:
                conn._protocol_error(violation)
                return None
        if decoded.special and not draining:
            if decoded.challenge or decoded.response:
                conn._migration.on_frames(decoded.challenge, decoded.response)
            violation = receiver.size_violation(decoded.messages)
            if violation:
                conn._protocol_error(violation)
                return None
            reason = receiver.check_fragments(decoded.messages)
            if reason is not None:
                return reason
        if decoded.messages:
            if not receiver.can_buffer(decoded.messages, size):
                return DropReason.RECV_BUFFER_FULL
            if conn.receiving_paused and not draining:
                if size > self.pause_budget:
                    return DropReason.RECV_QUEUE_FULL
                self.pause_budget -= size
        builder = self._builder
        low = builder.ack_low
        if low is not None and seq - low > EARLY_ACK_SPAN:
            # The older packets are about to leave what one header acknowledges. Sent at
            # half the span, so each packet of a burst is in two such acknowledgments: one
            # lost ack-only packet would otherwise leave packets that no later header
            # acknowledges, and the sender would resend them.
            builder.early_acks.append(builder.ack_only())
        if delta > 0:
            # A sender may skip numbers (up to 2**31 at once): a shift that far would
            # build a huge integer only for the mask to throw it away.
            bits = self.rx_bits << delta if delta < self._rx_window else 0
            self.rx_bits = (bits | 1) & self._rx_mask
            self.rx_largest = seq
            self.rx_largest_time = now
        elif -delta < self._rx_window:
            self.rx_bits |= 1 << -delta
        stats = self._stats
        stats.packets_received += 1
        stats.bytes_received += size
        if now >= stats.sample_due:
            stats.sample(now)
        conn._last_recv = now
        if conn._pmtu.probe_pn >= 0:
            conn._on_probe_ack(ack16, ack_bits, now)
        if self._recovery.on_ack_received(ack16, ack_bits, now, builder.tx_next, decoded.ack_delay):
            sender = self._sender
            if sender.rel_queue or sender.retx:
                # The ack opened the window: what waited for room can go out now, not at the
                # next timer (an ack-only packet does not otherwise schedule a flush).
                self._sink.dirty[conn] = None
            conn._on_acks(now)
        if conn.state is CLOSED:  # that ack completed our close
            return None
        eliciting = decoded.ping or decoded.disconnect is not None or flow != frames.NO_FLOW
        if decoded.messages and not draining:
            eliciting = receiver.deliver(decoded.messages, now) or eliciting
            violation = receiver.graph.violation
            if violation:  # the peer broke the protocol
                conn._protocol_error(violation)
                return None
        elif decoded.messages:
            eliciting = True
        if eliciting:
            # A packet out of order (it skips some, lost or overtaken, or it is a late
            # one filling a gap) is reported at once, as RFC 9000 says, and so is a
            # PING (a probe waits for its answer) or DISCONNECT; otherwise the
            # acknowledgment may wait for a packet that goes out anyway (see
            # PacketBuilder.on_eliciting). Either way the connection is flushed, which
            # re-arms its timer for the delayed acknowledgment.
            builder.on_eliciting(
                now,
                delta != 1 or decoded.ping or decoded.disconnect is not None or draining,
            )
            self._sink.dirty[conn] = None
            low = builder.ack_low
            if seq >= self.rx_largest - ACK_SPAN:
                if low is None or seq < low:
                    builder.ack_low = seq
            else:
                builder.early_acks.append(builder.ack_only(about=seq))
        if decoded.disconnect is not None:
            conn._on_peer_disconnect(decoded.disconnect, now)
        return None
