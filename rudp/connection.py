"""One connection's protocol state: sans-IO, no sockets, no clock, no asyncio.

Theory of operation
-------------------
Every DATA datagram is a *packet* with its own 16-bit sequence number and, in
its header, an acknowledgment of the newest packet received plus a 32-bit
bitfield of the 32 before it. Each packet therefore re-acknowledges 33 packets,
so a lost ack costs nothing; and a gap in the bitfield, with later packets
acknowledged, reveals a loss within one round trip (see ``recovery``).

Packets carry *frames*: messages, PING and DISCONNECT. Reliability is per
message, not per packet: when a packet is lost, the reliable messages in it
that were not acknowledged some other way go back to the front of the queue
and are sent again in a new packet, coalesced with whatever else is due. A
message is acknowledged when any packet carrying it is.

The receiver orders reliable messages per channel by a 16-bit per-channel
sequence number, buffering what arrives early (bounded by
``Config.recv_buffer_bytes``), so a loss on one channel never holds up another.
Duplicate packets are dropped by the packet-level window; duplicate messages by
the channel sequence. Unreliable messages are never resent, and the packet
window keeps them from ever being delivered twice.

The other delivery modes (see ``wire.Delivery`` and docs/protocol.md) each have
their own sequence space: sequenced modes keep the newest number delivered per
channel and drop anything older; reliable-unordered and dependency-ordered
messages share the connection's graph ids, which the receiver runs as soon as
every id they depend on has run, while the sender keeps its own copy of the
graph so that only dependencies the receiver may not have executed travel.
Reliable messages larger than a datagram are split into fragments, each an
ordinary reliable message of its mode, and reassembled within a reserved budget.

Flow control: a receiver whose application is not keeping up calls
``pause_receiving()``, which sends PAUSE; the peer then sends no new reliable
messages (resends, unreliable messages, acks, PING and DISCONNECT still go)
until RESUME. Both frames are ack-eliciting and, while they still describe the
current state, resent when lost; a receiver applies one only from a packet
newer than the last that carried one (even from a packet it refuses), so a
late copy never undoes a newer state. Messages already on
their way when the receiver paused are accepted, up to ``recv_buffer_bytes`` of
datagrams; past that a paused receiver refuses packets carrying messages, so a
peer that ignores PAUSE cannot make it hold more.

All state transitions happen in ``_set_state``; the states are::

    CONNECTING -> CONNECTED -> CLOSING (our close: flush, DISCONNECT, its ack) -> CLOSED
                           \\-> DRAINING (peer's DISCONNECT: linger to re-ack it) -> CLOSED
    any -> CLOSED (timeout, NOCONN, refusal, abort)

Sequence numbers are unwrapped into unbounded ints on arrival (``seqnum``), so
wraparound is handled in one place.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from rudp import wire
from rudp.config import BUFFER_ENTRY_COST, REDUNDANT_FRAME_MAX, Config
from rudp.congestion import CongestionController
from rudp.errors import ConnectionClosed, LocalProtocolError
from rudp.events import (
    Connected,
    Disconnected,
    DisconnectReason,
)
from rudp.graph import Waiting, refresh_deps
from rudp.receiving import NO_BUFFER as NO_BUFFER
from rudp.receiving import Partial, Receiver, Whole
from rudp.recovery import PacketRecovery, RttEstimator, SentPacket
from rudp.sending import FAILED, SENT, OutMessage, Sender, buffer_cost
from rudp.seqnum import SEQ_MASK, unwrap
from rudp.sink import EndpointSink
from rudp.stats import ConnectionStats
from rudp.wire import (
    ACK_SPAN,
    DEPENDENCY_ORDERED,
    GRAPH,
    RELIABLE_ORDERED,
    RELIABLE_SEQUENCED,
    UNRELIABLE,
    UNRELIABLE_SEQUENCED,
    Delivery,
    DropReason,
)

# The delivery modes as plain ints are the connection's vocabulary too.
__all__ = [
    "DEPENDENCY_ORDERED",
    "GRAPH",
    "NO_BUFFER",
    "RELIABLE_ORDERED",
    "RELIABLE_SEQUENCED",
    "UNRELIABLE",
    "UNRELIABLE_SEQUENCED",
    "Address",
    "Connection",
    "State",
]

Address = tuple[Any, ...]
# Module constants are ``Final``: compiled with mypyc, a literal one is inlined and any
# other is a C static, where a plain module global costs a dict lookup per use.
NOCONN_SPAN: Final = 4096  # a NOCONN must echo one of our last few thousand packets
RECENT_MAX: Final = 32  # recently sent small messages the redundancy option may repeat


class State(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSING = "closing"
    DRAINING = "draining"
    CLOSED = "closed"


CONNECTING: Final = State.CONNECTING
CONNECTED: Final = State.CONNECTED
CLOSING: Final = State.CLOSING
DRAINING: Final = State.DRAINING
CLOSED: Final = State.CLOSED

_TRANSITIONS = {
    CONNECTING: {CONNECTED, CLOSED},
    CONNECTED: {CLOSING, DRAINING, CLOSED},
    CLOSING: {DRAINING, CLOSED},
    DRAINING: {CLOSED},
    CLOSED: set(),
}


class Connection:
    """The protocol core of one connection. Created by ``Endpoint``."""

    def __init__(
        self,
        *,
        config: Config,
        address: Address,
        now: float,
        rng: random.Random,
        client: bool,
        salt: int,
        sink: EndpointSink | None = None,
    ) -> None:
        self.config = config
        self.address = address
        self.client = client
        self.salt = salt
        self.token = 0
        self.state = CONNECTING
        self.stats = ConnectionStats()
        self.close_reason: Disconnected | None = None
        # Where events, flush requests and our end go: the endpoint's (see ``sink``).
        self._sink = EndpointSink() if sink is None else sink
        self._rtt = RttEstimator(config)
        self.stats.rtt = self._rtt
        self._cc = CongestionController(config)
        self.stats.cc = self._cc
        # -- send side
        self._isn = rng.getrandbits(16)
        self.peer_isn = -1  # the peer's initial sequence number, once connected
        self._tx_next = self._isn
        self._recovery = PacketRecovery(self, config, self.stats, self._rtt, self._cc, self._isn)
        self._sender = Sender(self, self._sink, self.stats, config)
        self._control: list[bytes] = []
        self._ping = False
        self._ack_pending = False
        # Oldest ack-eliciting packet received since our last packet reported the receive
        # window, and ack-only packets built early because it was about to leave the 33
        # packets one header can acknowledge (see ``_receive_data``).
        self._ack_low: int | None = None
        self._early_acks: list[bytes] = []
        self._recent: deque[OutMessage] = deque()  # small messages redundancy may repeat
        self._redundancy = config.redundancy
        self._clock = now  # the latest time the core was given
        self._last_eliciting = now
        self._max_payload = config.max_datagram_size - wire.DATA_HEADER_SIZE
        self._window = config.channel_window
        # Config values read per packet, copied into native attributes (see RttEstimator).
        self._idle_timeout = config.idle_timeout
        self._keepalive_interval = config.keepalive_interval
        self._packet_window = config.window
        self._unreliable_max_age = config.unreliable_max_age
        # -- receive side
        self._rx_largest = 0
        self._rx_bits = 0  # bit i: packet (largest - i) was received
        # Packets remembered for duplicate detection; older ones are dropped as
        # stale (their reliable messages were resent anyway). Twice the window,
        # so reordering within a full window is never mistaken for staleness.
        self._rx_window = max(1024, 2 * config.window)
        self._rx_mask = (1 << self._rx_window) - 1
        self._receiver = Receiver(self, self._sink.events, self.stats, config)
        self._byte_window = config.recv_buffer_bytes
        self._last_recv = now
        # -- handshake and close
        self._cookie = b""
        self._cookie_connects = 0  # CONNECTs sent with the current cookie
        self._cookie_connect_at = now
        self._send_connect = client
        self._connect_deadline = now + config.connect_timeout
        self._next_connect = now + config.connect_retry_interval
        self._accept_datagram = b""  # our ACCEPT, if we answered a CONNECT (see _answer_connect)
        self._close_code = 0
        self._close_text = ""
        self._disconnect_queued = False
        self._deadline: float | None = None  # close or drain deadline
        # -- flow control (PAUSE / RESUME)
        self.receiving_paused = False  # we asked the peer to stop sending reliable messages
        self.peer_paused = False  # the peer asked us to
        self._flow_frame = b""  # PAUSE or RESUME waiting to go out
        self._flow_seq = -1  # the packet that carried our latest PAUSE or RESUME
        self._peer_flow_seq = -1  # the newest packet whose PAUSE or RESUME we applied
        self._pause_budget = 0  # datagram bytes with messages still accepted while paused

    # -- public API -----------------------------------------------------------------

    @property
    def isn(self) -> int:
        return self._isn

    @property
    def queued(self) -> int:
        """Messages not yet sent plus reliable messages not yet acknowledged."""
        return self._sender.queued

    @property
    def max_message_size(self) -> int:
        """The largest reliable message (``Config.max_message_size``)."""
        return self.config.max_message_size

    @property
    def max_datagram_payload(self) -> int:
        """The largest message sent in one datagram: the limit for unreliable
        messages; a larger reliable one is fragmented."""
        return self._sender.max_single

    def send(
        self,
        data: bytes | bytearray | memoryview,
        *,
        reliable: bool = True,
        channel: int = 0,
        delivery: Delivery | int | None = None,
        depends_on: Iterable[OutMessage] | None = None,
        now: float | None = None,
    ) -> OutMessage:
        """Queue a message; returns its handle. Raises at once on misuse or a full queue.

        ``delivery`` picks a ``Delivery`` mode (``reliable`` is then ignored, unless
        it contradicts it); ``depends_on`` lists handles of earlier graph messages
        (``RELIABLE_UNORDERED`` or ``DEPENDENCY_ORDERED``) and implies
        ``DEPENDENCY_ORDERED``. ``now`` stamps unreliable messages for
        ``Config.unreliable_max_age`` (without it, a message queued while connecting
        ages from the next ``datagrams_to_send``, and one queued later never expires).
        """
        if self.state is not CONNECTED:
            self._check_can_send()
        return self._sender.send(data, reliable, channel, delivery, depends_on, now)

    def _check_can_send(self) -> None:
        if self.state is CONNECTING:
            return  # queued until the handshake completes
        if self.close_reason is not None:
            reason = self.close_reason
            raise ConnectionClosed(reason.reason, reason.code, reason.text)
        # CLOSING: close() was called and the connection is ending gracefully.
        raise ConnectionClosed(DisconnectReason.CLOSED, self._close_code, self._close_text)

    def close(self, now: float, code: int = 0, text: str = "") -> None:
        """Start a graceful close: flush what is queued reliably, then DISCONNECT."""
        if not 0 <= code <= 0xFFFF:
            raise LocalProtocolError(f"close code must be in [0, 65535], got {code}")
        if self.state is CONNECTING:
            self._end(DisconnectReason.CLOSED, code, text, by_peer=False)
        elif self.state is CONNECTED:
            self._close_code, self._close_text = code, text
            self._set_state(CLOSING)
            self._sink.dirty[self] = None  # queued unreliable messages go first, then DISCONNECT
            if self.peer_paused:
                # What is queued may never be taken: a close must still end.
                self._deadline = now + self.config.close_timeout
            self._maybe_send_disconnect(now)

    def pause_receiving(self) -> None:
        """Ask the peer to stop sending new reliable messages: the application is not
        keeping up.

        Messages already on their way are still accepted, up to ``recv_buffer_bytes``
        of datagrams; past that, a packet carrying messages is refused unacknowledged
        (counted as ``recv_queue_full``) and comes back after ``resume_receiving()``.
        """
        if self.receiving_paused:
            return
        self.receiving_paused = True
        self._pause_budget = self._byte_window
        self.stats.receive_pauses += 1
        self._flow_frame = wire.PAUSE_FRAME
        self._sink.dirty[self] = None

    def resume_receiving(self) -> None:
        """Let the peer send messages again (undoes ``pause_receiving()``)."""
        if not self.receiving_paused:
            return
        self.receiving_paused = False
        self._flow_frame = wire.RESUME_FRAME
        self._sink.dirty[self] = None
        # While paused we may have refused the very dependencies these wait for: their
        # dependency_timeout counts from now, not from their arrival.
        self._receiver.graph.restart_clocks(self._clock)

    def abort(
        self, reason: DisconnectReason = DisconnectReason.ABORTED, *, by_peer: bool = False
    ) -> None:
        """End at once without telling the peer (it will learn by NOCONN or timeout)."""
        if self.state is DRAINING:
            self._set_state(CLOSED)  # its Disconnected was already reported
        elif self.state is not CLOSED:
            self._end(reason, 0, "", by_peer=by_peer)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next run, or None."""
        state = self.state
        if state is CLOSED:
            return None
        if state is CONNECTING:
            return min(self._connect_deadline, self._next_connect)
        if state is DRAINING:
            return self._deadline
        t = self._last_recv + self._idle_timeout
        recovery = self._recovery
        if recovery.sent:
            t = min(t, recovery.probe_deadline())
            if recovery.loss_time is not None:
                t = min(t, recovery.loss_time)
        elif not self._ping:  # a pending PING goes out with the next flush
            t = min(t, self._last_eliciting + self._keepalive_interval)
        if self._deadline is not None:
            t = min(t, self._deadline)
        graph = self._receiver.graph
        if graph.nodes and not self.receiving_paused:
            t = min(t, graph.deadline(self.config.dependency_timeout))
        return t

    def handle_timer(self, now: float) -> None:
        self._clock = now
        state = self.state
        if state is CONNECTING:
            self._connecting_timer(now)
        elif state is DRAINING:
            if self._deadline is not None and now >= self._deadline:
                self._set_state(CLOSED)
        elif state is not CLOSED:
            self._connected_timer(now)

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """Everything due now, coalesced into as few datagrams as possible."""
        self._clock = now
        out: list[bytes] = []
        if self.state is CONNECTING:
            for msg in self._sender.unrel_queue:
                if msg.queued_at is None:  # sent without a time: it ages from now
                    msg.queued_at = now
            if self._send_connect:
                self._send_connect = False
                if self._cookie:
                    self._cookie_connects += 1
                    self._cookie_connect_at = now
                cfg = self.config
                out.append(
                    wire.encode_connect(self.salt, self._isn, self._cookie, cfg.max_datagram_size)
                )
            return out
        if self.state is CLOSED:
            return out
        if self._early_acks:
            out.extend(self._early_acks)
            self._early_acks.clear()
        while True:
            datagram = self._build_packet(now)
            if datagram is None:
                break
            out.append(datagram)
        if out:
            self.stats.packets_sent += len(out)
            self.stats.bytes_sent += sum(map(len, out))
        return out

    # -- the endpoint's interface: handshake and DATA --------------------------------------------

    def _nudge_connect(self) -> None:
        """The server is already sending us data: our ACCEPT was lost or overtaken,
        so ask again now rather than at the next retry."""
        if self.state is CONNECTING and self._cookie:
            self._send_connect = True
            self._sink.dirty[self] = None

    def _receive_challenge(self, challenge: wire.Challenge) -> DropReason | None:
        if self.state is not CONNECTING or challenge.salt != self.salt:
            return DropReason.UNEXPECTED
        self._cookie = challenge.cookie
        self._cookie_connects = 0
        self._send_connect = True
        self._sink.dirty[self] = None
        return None

    def _receive_accept(self, accept: wire.Accept, now: float) -> DropReason | None:
        if accept.salt != self.salt:
            return DropReason.UNEXPECTED
        if self.state is not CONNECTING:
            return DropReason.DUPLICATE
        if self._cookie_connects == 1:
            # One CONNECT, one ACCEPT: an unambiguous first RTT sample (Karn's rule),
            # so the first data packet does not wait on rto_initial.
            self._rtt.on_sample(now - self._cookie_connect_at)
        self._establish(accept.token, accept.isn, now)
        return None

    def _receive_reject(self, reject: wire.Reject) -> DropReason | None:
        if self.state is not CONNECTING or reject.salt != self.salt:
            return DropReason.UNEXPECTED
        self._end(DisconnectReason.REFUSED, 0, reject.text, by_peer=True)
        return None

    def _answer_connect(self, salt: int, token: int, peer_isn: int, now: float) -> bytes:
        """The endpoint accepted the peer's CONNECT into this connection: a new one, or
        ours in a simultaneous open that the peer's handshake won (our own CONNECTs
        stop; the connection takes the peer's salt, so a duplicate of its CONNECT gets
        the ACCEPT again). Returns the ACCEPT to send; ``_accept_datagram`` keeps it."""
        self._accept_datagram = wire.encode_accept(salt, token, self._isn)
        self.salt = salt
        self._send_connect = False
        self._cookie = b""
        self._establish(token, peer_isn, now)
        return self._accept_datagram

    def _establish(self, token: int, peer_isn: int, now: float) -> None:
        """Handshake done: both sides know the token and each other's first sequence."""
        self.token = token
        self.peer_isn = peer_isn
        self._rx_largest = peer_isn - 1
        self._last_recv = now
        self._last_eliciting = now
        self._set_state(CONNECTED)
        self._sink.events.append((self, Connected()))
        self._sink.dirty[self] = None

    def _receive_noconn(self, noconn: wire.NoConn) -> DropReason | None:
        """The peer says it has no connection with us; believe it only if it echoes
        a packet we really sent, so an off-path attacker can't end connections."""
        seq = unwrap(noconn.seq, self._tx_next - 1)
        if self.state is CONNECTING or not self._tx_next - NOCONN_SPAN <= seq < self._tx_next:
            return DropReason.UNEXPECTED
        if self.state is CLOSING and self._disconnect_queued:
            # The peer already forgot us: our DISCONNECT has nothing left to do.
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)
        elif self.state is DRAINING:
            self._set_state(CLOSED)
        else:
            self._end(DisconnectReason.NO_CONNECTION, 0, "", by_peer=True)
        return None

    # -- receive path -------------------------------------------------------------------------

    def _receive_data(
        self, data: bytes, seq16: int, ack16: int, ack_bits: int, now: float
    ) -> DropReason | None:
        """Process one DATA packet whose CRC and token the endpoint checked."""
        state = self.state
        if state is CONNECTING or state is CLOSED:
            return DropReason.UNEXPECTED
        seq = unwrap(seq16, self._rx_largest)
        delta = seq - self._rx_largest
        if delta <= 0:
            if -delta >= self._rx_window:
                return DropReason.STALE
            if (self._rx_bits >> -delta) & 1:
                return DropReason.DUPLICATE
        frames = wire.decode_frames(data)  # DecodeError is counted by the endpoint
        self._clock = now
        flow = frames.flow
        if flow != wire.NO_FLOW and seq > self._peer_flow_seq and state is not DRAINING:
            # Applied even from a packet refused below: a RESUME that travels with
            # messages we cannot take yet must not be refused with them every time.
            self._peer_flow_seq = seq
            self._on_peer_flow(flow == 1, now)
        if frames.special and state is not DRAINING:
            reason = self._receiver.check_fragments(frames.messages)
            if reason is not None:
                return reason
        if frames.messages:
            if not self._receiver.can_buffer(frames.messages, len(data)):
                return DropReason.RECV_BUFFER_FULL
            if self.receiving_paused and state is not DRAINING:
                if len(data) > self._pause_budget:
                    return DropReason.RECV_QUEUE_FULL
                self._pause_budget -= len(data)
        low = self._ack_low
        if low is not None and seq - low > ACK_SPAN:
            # A header acknowledges its largest packet and the 32 before it. When more than
            # that arrive between two flushes (one socket read drains up to 256 datagrams),
            # acknowledge the older ones now, or the sender would declare them lost and resend.
            self._early_acks.append(self._ack_only_packet())
        if delta > 0:
            self._rx_bits = ((self._rx_bits << delta) | 1) & self._rx_mask
            self._rx_largest = seq
        else:
            self._rx_bits |= 1 << -delta
        stats = self.stats
        stats.packets_received += 1
        stats.bytes_received += len(data)
        self._last_recv = now
        if self._recovery.on_ack_received(ack16, ack_bits, now, self._tx_next):
            sender = self._sender
            if sender.rel_queue or sender.retx:
                # The ack opened the window: what waited for room can go out now, not at the
                # next timer (an ack-only packet does not otherwise schedule a flush).
                self._sink.dirty[self] = None
            if self.state is CLOSING:
                self._maybe_send_disconnect(now)
        if self.state is CLOSED:  # that ack completed our close
            return None
        eliciting = frames.ping or frames.disconnect is not None or flow != wire.NO_FLOW
        if frames.messages and state is not DRAINING:
            eliciting = self._receiver.deliver(frames.messages, now) or eliciting
            violation = self._receiver.graph.violation
            if violation:  # the peer broke the protocol
                self._protocol_error(violation)
                return None
        elif frames.messages:
            eliciting = True
        if eliciting:
            self._ack_pending = True
            self._sink.dirty[self] = None
            low = self._ack_low
            if seq >= self._rx_largest - ACK_SPAN:
                if low is None or seq < low:
                    self._ack_low = seq
            else:
                self._early_acks.append(self._ack_only_packet(about=seq))
        if frames.disconnect is not None:
            self._on_peer_disconnect(frames.disconnect, now)
        return None

    def _on_peer_flow(self, paused: bool, now: float) -> None:
        if paused == self.peer_paused:
            return
        self.peer_paused = paused
        if paused:
            self.stats.peer_pauses += 1
            if self.state is CLOSING and self._deadline is None:
                self._deadline = now + self.config.close_timeout
        else:
            self._sink.dirty[self] = None  # what waited goes out now
            if self.state is CLOSING and not self._disconnect_queued:
                self._deadline = None

    def _protocol_error(self, text: str) -> None:
        """The peer broke the protocol in a way that cannot be dropped and forgotten."""
        if self.state is not CLOSED:
            self._end(DisconnectReason.PROTOCOL_ERROR, 0, text, by_peer=False)

    # -- what became of our packets (called by recovery) ------------------------------------

    def _on_packet_acked(self, pkt: SentPacket) -> None:
        self._sender.on_acked(pkt)
        if pkt.disconnect and self.state is CLOSING:
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)

    def _on_packet_lost(self, pkt: SentPacket) -> None:
        self._sender.on_lost(pkt)
        if pkt.control and self.state is CLOSING:
            self._control.extend(pkt.control)
        if pkt.seq == self._flow_seq and not self._flow_frame:
            # Our latest PAUSE or RESUME was lost: tell the current state again.
            self._flow_frame = wire.PAUSE_FRAME if self.receiving_paused else wire.RESUME_FRAME
        self._sink.dirty[self] = None

    # -- send path ---------------------------------------------------------------------------

    def _build_packet(self, now: float) -> bytes | None:
        if not (
            self._ack_pending
            or self._ping
            or self._control
            or self._flow_frame
            or self._sender.retx
            or self._sender.unrel_queue
            or self._sender.rel_queue
        ):
            return None  # the common last call of a flush: nothing left to send
        budget = self._max_payload
        parts: list[bytes] = []
        messages: list[OutMessage] = []
        control: list[bytes] = []
        if self._control:
            control, self._control = self._control, []
            for frame in control:
                parts.append(frame)
                budget -= len(frame)
        flow = self._flow_frame
        if flow:
            self._flow_frame = b""
            parts.append(flow)
            budget -= 1
        # Reliable data goes out while both windows have room: ``window`` packets and
        # the congestion window's bytes (which a resend timeout's probe may exceed).
        recovery = self._recovery
        room = recovery.in_flight < self._packet_window and (
            self._cc.can_send() or recovery.probe_due
        )
        if room:
            budget = self._take_retransmissions(parts, messages, budget)
        if self._sender.unrel_queue:
            budget = self._take_unreliable(parts, budget, now)
            if not self._sender.unrel_queue and self.state is CLOSING:
                # The last unreliable messages queued before close() go out with the
                # DISCONNECT, not after it: the peer drops messages once it has one.
                self._maybe_send_disconnect(now)
                if self._control and budget >= len(self._control[-1]):
                    frame = self._control.pop()
                    parts.append(frame)
                    control.append(frame)
                    budget -= len(frame)
        if room and not self._sender.retx and not self.peer_paused:
            # A paused peer gets no new reliable messages; unreliable ones still go (they
            # expire rather than wait, and the peer bounds what it accepts while paused).
            budget = self._take_new_reliable(parts, messages, budget)
        if self._redundancy and messages:
            budget = self._take_redundant(parts, messages, budget)
        eliciting = bool(messages or control or flow)
        if self._ping and not eliciting and self.state is not DRAINING:
            parts.append(wire.PING_FRAME)
            eliciting = True
        if not parts and not self._ack_pending:
            return None
        self._ping = False
        self._ack_pending = False
        self._ack_low = None
        seq = self._tx_next
        self._tx_next = seq + 1
        rest = b"".join(
            [
                wire.data_header(
                    self.token,
                    seq & SEQ_MASK,
                    self._rx_largest & SEQ_MASK,
                    (self._rx_bits >> 1) & 0xFFFFFFFF,
                ),
                *parts,
            ]
        )
        datagram = wire.seal_rest(rest)
        if eliciting:
            recovery.on_packet_sent(
                SentPacket(
                    seq,
                    now,
                    messages,
                    control,
                    bool(control) and self._disconnect_in(control),
                    len(datagram),
                )
            )
            self._last_eliciting = now
            self.stats.eliciting_sent += 1
            if flow:
                self._flow_seq = seq
            for msg in messages:
                msg.copies += 1
        return datagram

    def _ack_only_packet(self, about: int | None = None) -> bytes:
        """A packet carrying nothing but an acknowledgment.

        By default it reports the newest packet and the 32 before it. With
        ``about``, it reports that (late) packet and the 32 before it instead: a
        packet that arrives after more than 32 later ones is outside every normal
        ack header, and without this the sender could never learn it arrived.
        """
        if about is None:
            self._ack_low = None
            ack, bits = self._rx_largest, self._rx_bits >> 1
        else:
            ack, bits = about, self._rx_bits >> (self._rx_largest - about + 1)
        seq = self._tx_next
        self._tx_next = seq + 1
        return wire.seal_rest(
            wire.data_header(self.token, seq & SEQ_MASK, ack & SEQ_MASK, bits & 0xFFFFFFFF)
        )

    def _disconnect_in(self, control: list[bytes]) -> bool:
        return any(frame[0] == wire.FrameType.DISCONNECT for frame in control)

    def _take_retransmissions(
        self, parts: list[bytes], messages: list[OutMessage], budget: int
    ) -> int:
        retx = self._sender.retx
        while retx:
            msg = retx[0]
            if msg.state > SENT or msg.copies:
                retx.popleft()
                continue
            frame = msg.frame
            size = len(frame)
            if size > budget:
                break
            retx.popleft()
            parts.append(frame)
            messages.append(msg)
            budget -= size
            self.stats.messages_resent += 1
        return budget

    def _take_unreliable(self, parts: list[bytes], budget: int, now: float) -> int:
        queue = self._sender.unrel_queue
        stale = now - self._unreliable_max_age
        while queue:
            msg = queue[0]
            queued_at = msg.queued_at
            if queued_at is not None and queued_at < stale:
                queue.popleft().state = FAILED
                self._sender.queued -= 1
                self.stats.messages_expired += 1
                continue
            frame = msg.frame
            size = len(frame)
            if size > budget:
                break
            if msg.mode == UNRELIABLE_SEQUENCED:
                # Numbered on the way out, not at send(): messages that expired in the
                # queue leave no gap, and only a run of 32,768 lost on the path could
                # make the receiver read a newer number as older.
                channel = msg.channel
                seq = msg.seq = self._sender.tx_useq[channel]
                self._sender.tx_useq[channel] = seq + 1
                frame = msg.frame = wire.message_frame(UNRELIABLE_SEQUENCED, channel, seq, msg.data)
            queue.popleft().state = SENT
            parts.append(frame)
            self._sender.queued -= 1
            budget -= size
            self.stats.messages_sent += 1
        return budget

    def _take_new_reliable(
        self, parts: list[bytes], messages: list[OutMessage], budget: int
    ) -> int:
        queue = self._sender.rel_queue
        window = self._window
        unacked = self._sender.tx_ch_unacked
        # Bytes that may still go into the peer's reorder buffer (see _unacked_bytes).
        room = self._byte_window - self._sender.unacked_bytes
        sent = 0
        while queue:
            msg = queue[0]
            frame = msg.frame
            size = len(frame)
            if size > budget:
                break  # the packet is full
            mode = msg.mode
            if mode == RELIABLE_ORDERED:
                oldest = unacked[msg.channel]
                assert oldest is not None  # created when msg was sent
                if msg.seq - oldest[0].seq >= window:
                    break  # the receiver could not buffer it yet
                cost = size + BUFFER_ENTRY_COST
                if cost > room:
                    break  # it might not fit the receiver's reorder buffer
                room -= cost
            elif msg.state > SENT:
                queue.popleft()  # superseded
                continue
            elif mode == GRAPH:
                if msg.seq - self._sender.tx_graph[0].seq >= window:
                    break  # beyond the ids the receiver accepts
                if refresh_deps(msg):
                    frame = msg.frame
                    size = len(frame)
                cost = buffer_cost(msg)
                if cost > room:
                    break
                room -= cost
            queue.popleft()
            msg.state = SENT
            parts.append(frame)
            messages.append(msg)
            budget -= size
            sent += 1
        self._sender.unacked_bytes = self._byte_window - room
        self.stats.messages_sent += sent
        return budget

    def _take_redundant(self, parts: list[bytes], messages: list[OutMessage], budget: int) -> int:
        """Fill the rest of a packet with copies of recent unacknowledged small messages
        (newest first), then remember this packet's own small messages for later ones.

        Only a thin stream remembers its messages (the send queue is empty after this
        packet): in a burst every packet is full anyway, so copies would find no room.
        """
        recent = self._recent
        fresh = len(messages)
        if recent:
            limit = self._redundancy
            while recent and (recent[0].state > SENT or recent[0].redundant >= limit):
                recent.popleft()
            if recent and budget > 3:
                here = set(map(id, messages))
                for msg in reversed(recent):
                    if msg.state > SENT or msg.redundant >= limit or id(msg) in here:
                        continue
                    size = len(msg.frame)
                    if size > budget:
                        continue
                    parts.append(msg.frame)
                    messages.append(msg)
                    msg.redundant += 1
                    budget -= size
                    self.stats.messages_redundant += 1
                    if budget <= 3:
                        break
        if not self._sender.rel_queue:
            for msg in messages[:fresh]:
                if len(msg.frame) <= REDUNDANT_FRAME_MAX:
                    recent.append(msg)
            while len(recent) > RECENT_MAX:
                recent.popleft()
        return budget

    # -- timers -----------------------------------------------------------------------------

    def _connecting_timer(self, now: float) -> None:
        if now >= self._connect_deadline:
            self._end(DisconnectReason.CONNECT_TIMEOUT, 0, "", by_peer=False)
        elif now >= self._next_connect:
            self._next_connect = now + self.config.connect_retry_interval
            self._send_connect = True
            self._sink.dirty[self] = None

    def _connected_timer(self, now: float) -> None:
        cfg = self.config
        # Every test below uses the very expression get_timer() returns: written as
        # ``now - last >= interval`` it can disagree in the last bit and spin the timer.
        if now >= self._last_recv + cfg.idle_timeout:
            self._end(DisconnectReason.TIMEOUT, 0, "", by_peer=False)
            return
        if self._deadline is not None and now >= self._deadline:
            # Our DISCONNECT was never acknowledged: end anyway, with our reason.
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)
            return
        graph = self._receiver.graph
        if (
            graph.nodes
            and not self.receiving_paused
            and now >= graph.deadline(cfg.dependency_timeout)
        ):
            self._protocol_error("a dependency never arrived")
            return
        recovery = self._recovery
        if recovery.on_timer(now, self._tx_next):
            self._ping = True  # a probe goes out even if nothing needed resending
        elif not recovery.sent and now >= self._last_eliciting + cfg.keepalive_interval:
            self._ping = True
            self._sink.dirty[self] = None

    # -- closing ----------------------------------------------------------------------------

    def _maybe_send_disconnect(self, now: float) -> None:
        if self._disconnect_queued or self._sender.unacked_reliable or self._sender.unrel_queue:
            return
        self._disconnect_queued = True
        self._control.append(wire.disconnect_frame(self._close_code, self._close_text))
        self._deadline = now + self.config.close_timeout
        self._sink.dirty[self] = None

    def _on_peer_disconnect(self, frame: wire.DisconnectFrame, now: float) -> None:
        if self.state is DRAINING:
            return
        if self.state is CLOSING:
            # Both sides closed at once; each reports its own close.
            event = Disconnected(DisconnectReason.CLOSED, self._close_code, self._close_text, False)
        else:
            event = Disconnected(DisconnectReason.CLOSED, frame.code, frame.text, True)
        self._fail_pending()
        self.close_reason = event
        self._sink.events.append((self, event))
        self._set_state(DRAINING)
        # Linger to re-acknowledge a resent DISCONNECT whose ack was lost.
        self._deadline = now + max(3 * self._rtt.rto, 0.05)

    def _end(self, reason: DisconnectReason, code: int, text: str, *, by_peer: bool) -> None:
        self._fail_pending()
        event = Disconnected(reason, code, text, by_peer)
        self.close_reason = event
        self._sink.events.append((self, event))
        self._set_state(CLOSED)

    def _fail_pending(self) -> None:
        recovery = self._recovery
        self._sender.fail_all(recovery.sent.values())
        self._recent.clear()
        self._control.clear()
        recovery.clear()
        self._receiver.clear()

    def _set_state(self, new: State) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise LocalProtocolError(f"illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new is CLOSED:
            self._sink.closed(self)

    def __repr__(self) -> str:
        return f"<Connection {self.address!r} {self.state.value}>"

    # -- the parts' state under the names it had here (read-only) ---------------------------

    @property
    def _reorder_threshold(self) -> int:
        return self._recovery.reorder_threshold

    @property
    def _retx(self) -> deque[OutMessage]:
        return self._sender.retx

    @property
    def _unacked_reliable(self) -> int:
        return self._sender.unacked_reliable

    @property
    def _unacked_bytes(self) -> int:
        return self._sender.unacked_bytes

    @property
    def _tx_graph(self) -> deque[OutMessage]:
        return self._sender.tx_graph

    @property
    def _tx_gid(self) -> int:
        return self._sender.tx_gid

    @property
    def _tx_ch_unacked(self) -> list[deque[OutMessage] | None]:
        return self._sender.tx_ch_unacked

    @property
    def _rx_ch_next(self) -> list[int]:
        return self._receiver.ch_next

    @property
    def _rx_ch_buf(self) -> list[dict[int, bytes | Whole]]:
        return self._receiver.ch_buf

    @property
    def _rx_buffered_bytes(self) -> int:
        return self._receiver.buffered_bytes

    @property
    def _rx_parts(self) -> dict[tuple[int, int, int], Partial]:
        return self._receiver.parts

    @property
    def _rx_reassembly_bytes(self) -> int:
        return self._receiver.reserved_bytes

    @property
    def _rx_g_nodes(self) -> dict[int, Waiting]:
        return self._receiver.graph.nodes

    @property
    def _rx_g_waiters(self) -> dict[int, list[int]]:
        return self._receiver.graph.waiters

    @property
    def _rx_g_done(self) -> set[int]:
        return self._receiver.graph.done
