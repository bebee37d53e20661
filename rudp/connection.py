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
from collections.abc import Callable
from typing import Any

from rudp import wire
from rudp.config import Config
from rudp.errors import ConnectionClosed, LocalProtocolError, MessageTooLarge, SendQueueFull
from rudp.events import (
    Connected,
    Disconnected,
    DisconnectReason,
    Event,
    MessageAcked,
    MessageReceived,
)
from rudp.recovery import ACKED, FAILED, SENT, OutMessage, RttEstimator, SentPacket
from rudp.seqnum import SEQ_MASK, seq_diff, unwrap
from rudp.stats import ConnectionStats
from rudp.wire import Delivery, DropReason

Address = tuple[Any, ...]
ACK_SPAN = 32  # a header acknowledges its largest packet and this many before it
NOCONN_SPAN = 4096  # a NOCONN must echo one of our last few thousand packets
BUFFER_ENTRY_COST = 64  # bytes charged per buffered message besides its payload
LOST_MEMORY = 1024  # packets declared lost that are remembered to detect spurious losses
MAX_REORDER_THRESHOLD = 256
UNRELIABLE = Delivery.UNRELIABLE
RELIABLE_ORDERED = Delivery.RELIABLE_ORDERED


class State(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSING = "closing"
    DRAINING = "draining"
    CLOSED = "closed"


_TRANSITIONS = {
    State.CONNECTING: {State.CONNECTED, State.CLOSED},
    State.CONNECTED: {State.CLOSING, State.DRAINING, State.CLOSED},
    State.CLOSING: {State.DRAINING, State.CLOSED},
    State.DRAINING: {State.CLOSED},
    State.CLOSED: set(),
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
        events: deque[tuple[Connection, Event]] | None = None,
        dirty: set[Connection] | None = None,
        on_closed: Callable[[Connection], None] | None = None,
    ) -> None:
        self.config = config
        self.address = address
        self.client = client
        self.salt = salt
        self.token = 0
        self.state = State.CONNECTING
        self.stats = ConnectionStats()
        self.close_reason: Disconnected | None = None
        self._events: deque[tuple[Connection, Event]] = deque() if events is None else events
        self._dirty: set[Connection] = set() if dirty is None else dirty
        self._on_closed = on_closed
        self._rtt = RttEstimator(config)
        self.stats.rtt = self._rtt
        self.armed: float | None = None  # the endpoint's timer bookkeeping
        # -- send side
        self._isn = rng.getrandbits(16)
        self._tx_next = self._isn
        self._sent: dict[int, SentPacket] = {}
        self._in_flight = 0
        self._largest_acked = self._isn - 1
        self._loss_time: float | None = None
        self._last_probe = 0.0  # when the resend timer last fired
        self._reorder_threshold = config.reorder_threshold  # widened by spurious losses
        self._lost_recently: dict[int, None] = {}  # seqs declared lost, to spot late acks
        self._rel_queue: deque[OutMessage] = deque()
        self._unrel_queue: deque[OutMessage] = deque()
        self._retx: deque[OutMessage] = deque()
        self._control: list[bytes] = []
        self._ping = False
        self._ack_pending = False
        # Oldest ack-eliciting packet received since our last packet reported the receive
        # window, and ack-only packets built early because it was about to leave the 33
        # packets one header can acknowledge (see ``receive_data``).
        self._ack_low: int | None = None
        self._early_acks: list[bytes] = []
        self._queued = 0  # messages not yet sent, plus reliable ones not yet acked
        self._unacked_reliable = 0
        self._tx_ch_next = [0] * config.channels
        self._tx_ch_unacked: list[deque[OutMessage]] = [deque() for _ in range(config.channels)]
        self._last_eliciting = now
        self._max_payload = config.max_datagram_size - wire.DATA_HEADER_SIZE
        self._max_message = self._max_payload - wire.MESSAGE_OVERHEAD
        self._channels = config.channels
        self._queue_limit = config.send_queue_limit
        # -- receive side
        self._rx_largest = 0
        self._rx_bits = 0  # bit i: packet (largest - i) was received
        # Packets remembered for duplicate detection; older ones are dropped as
        # stale (their reliable messages were resent anyway). Twice the window,
        # so reordering within a full window is never mistaken for staleness.
        self._rx_window = max(1024, 2 * config.window)
        self._rx_mask = (1 << self._rx_window) - 1
        self._rx_ch_next = [0] * config.channels
        self._rx_ch_buf: list[dict[int, bytes]] = [{} for _ in range(config.channels)]
        self._rx_buffered_bytes = 0
        self._last_recv = now
        # -- handshake and close
        self._cookie = b""
        self._cookie_connects = 0  # CONNECTs sent with the current cookie
        self._cookie_connect_at = now
        self._send_connect = client
        self._connect_deadline = now + config.connect_timeout
        self._next_connect = now + config.connect_retry_interval
        self.accept_datagram = b""  # server side: the ACCEPT, resent on duplicate CONNECTs
        self._close_code = 0
        self._close_text = ""
        self._disconnect_queued = False
        self._deadline: float | None = None  # close or drain deadline

    # -- public API -----------------------------------------------------------------

    @property
    def isn(self) -> int:
        return self._isn

    @property
    def queued(self) -> int:
        """Messages not yet sent plus reliable messages not yet acknowledged."""
        return self._queued

    @property
    def max_message_size(self) -> int:
        return self._max_message

    def send(self, data: bytes, *, reliable: bool = True, channel: int = 0) -> OutMessage:
        """Queue a message; returns its handle. Raises at once on misuse or a full queue."""
        if self.state is not State.CONNECTED:
            self._check_can_send()
        if type(data) is not bytes:
            data = _as_bytes(data)
        if channel and not 0 < channel < self._channels:
            raise LocalProtocolError(f"channel must be in [0, {self._channels}), got {channel}")
        if len(data) > self._max_message:
            raise MessageTooLarge(
                f"message of {len(data)} bytes exceeds the {self._max_message}-byte limit"
            )
        if self._queued >= self._queue_limit:
            raise SendQueueFull(
                f"send queue is full ({self._queued} messages); await drain() before sending"
            )
        if reliable:
            seq = self._tx_ch_next[channel]
            self._tx_ch_next[channel] = seq + 1
            msg = OutMessage(
                data, RELIABLE_ORDERED, channel, seq, wire.reliable_frame(channel, seq, data)
            )
            self._rel_queue.append(msg)
            self._tx_ch_unacked[channel].append(msg)
            self._unacked_reliable += 1
        else:
            msg = OutMessage(data, UNRELIABLE, channel, 0, wire.unreliable_frame(channel, data))
            self._unrel_queue.append(msg)
        self._queued += 1
        self._dirty.add(self)
        return msg

    def _check_can_send(self) -> None:
        if self.state is State.CONNECTING:
            return  # queued until the handshake completes
        if self.close_reason is not None:
            reason = self.close_reason
            raise ConnectionClosed(reason.reason, reason.code, reason.text)
        raise LocalProtocolError(f"cannot send on a connection that is {self.state.value}")

    def close(self, now: float, code: int = 0, text: str = "") -> None:
        """Start a graceful close: flush what is queued reliably, then DISCONNECT."""
        if not 0 <= code <= 0xFFFF:
            raise LocalProtocolError(f"close code must be in [0, 65535], got {code}")
        if self.state is State.CONNECTING:
            self._end(DisconnectReason.CLOSED, code, text, by_peer=False)
        elif self.state is State.CONNECTED:
            self._close_code, self._close_text = code, text
            self._set_state(State.CLOSING)
            self._maybe_send_disconnect(now)

    def abort(
        self, reason: DisconnectReason = DisconnectReason.ABORTED, *, by_peer: bool = False
    ) -> None:
        """End at once without telling the peer (it will learn by NOCONN or timeout)."""
        if self.state is State.DRAINING:
            self._set_state(State.CLOSED)  # its Disconnected was already reported
        elif self.state is not State.CLOSED:
            self._end(reason, 0, "", by_peer=by_peer)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next run, or None."""
        state = self.state
        if state is State.CLOSED:
            return None
        if state is State.CONNECTING:
            return min(self._connect_deadline, self._next_connect)
        if state is State.DRAINING:
            return self._deadline
        t = self._last_recv + self.config.idle_timeout
        if self._sent:
            t = min(t, self._probe_deadline())
            if self._loss_time is not None:
                t = min(t, self._loss_time)
        elif not self._ping:  # a pending PING goes out with the next flush
            t = min(t, self._last_eliciting + self.config.keepalive_interval)
        if self._deadline is not None:
            t = min(t, self._deadline)
        return t

    def handle_timer(self, now: float) -> None:
        state = self.state
        if state is State.CONNECTING:
            self._connecting_timer(now)
        elif state is State.DRAINING:
            if self._deadline is not None and now >= self._deadline:
                self._set_state(State.CLOSED)
        elif state is not State.CLOSED:
            self._connected_timer(now)

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """Everything due now, coalesced into as few datagrams as possible."""
        out: list[bytes] = []
        if self.state is State.CONNECTING:
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
        if self.state is State.CLOSED:
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

    # -- handshake (called by the endpoint) ----------------------------------------------

    def nudge_connect(self) -> None:
        """The server is already sending us data: our ACCEPT was lost or overtaken,
        so ask again now rather than at the next retry."""
        if self.state is State.CONNECTING and self._cookie:
            self._send_connect = True
            self._dirty.add(self)

    def receive_challenge(self, challenge: wire.Challenge) -> DropReason | None:
        if self.state is not State.CONNECTING or challenge.salt != self.salt:
            return DropReason.UNEXPECTED
        self._cookie = challenge.cookie
        self._cookie_connects = 0
        self._send_connect = True
        self._dirty.add(self)
        return None

    def receive_accept(self, accept: wire.Accept, now: float) -> DropReason | None:
        if accept.salt != self.salt:
            return DropReason.UNEXPECTED
        if self.state is not State.CONNECTING:
            return DropReason.DUPLICATE
        if self._cookie_connects == 1:
            # One CONNECT, one ACCEPT: an unambiguous first RTT sample (Karn's rule),
            # so the first data packet does not wait on rto_initial.
            self._rtt.on_sample(now - self._cookie_connect_at)
        self.establish(accept.token, accept.isn, now)
        return None

    def receive_reject(self, reject: wire.Reject) -> DropReason | None:
        if self.state is not State.CONNECTING or reject.salt != self.salt:
            return DropReason.UNEXPECTED
        self._end(DisconnectReason.REFUSED, 0, reject.text, by_peer=True)
        return None

    def establish(self, token: int, peer_isn: int, now: float) -> None:
        """Handshake done: both sides know the token and each other's first sequence."""
        self.token = token
        self._rx_largest = peer_isn - 1
        self._last_recv = now
        self._last_eliciting = now
        self._set_state(State.CONNECTED)
        self._events.append((self, Connected()))
        self._dirty.add(self)

    def receive_noconn(self, noconn: wire.NoConn) -> DropReason | None:
        """The peer says it has no connection with us; believe it only if it echoes
        a packet we really sent, so an off-path attacker can't end connections."""
        seq = unwrap(noconn.seq, self._tx_next - 1)
        if self.state is State.CONNECTING or not self._tx_next - NOCONN_SPAN <= seq < self._tx_next:
            return DropReason.UNEXPECTED
        if self.state is State.CLOSING and self._disconnect_queued:
            # The peer already forgot us: our DISCONNECT has nothing left to do.
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)
        elif self.state is State.DRAINING:
            self._set_state(State.CLOSED)
        else:
            self._end(DisconnectReason.NO_CONNECTION, 0, "", by_peer=True)
        return None

    # -- receive path -------------------------------------------------------------------------

    def receive_data(
        self, data: bytes, seq16: int, ack16: int, ack_bits: int, now: float
    ) -> DropReason | None:
        """Process one DATA packet whose CRC and token the endpoint checked."""
        state = self.state
        if state is State.CONNECTING or state is State.CLOSED:
            return DropReason.UNEXPECTED
        seq = unwrap(seq16, self._rx_largest)
        delta = seq - self._rx_largest
        if delta <= 0:
            if -delta >= self._rx_window:
                return DropReason.STALE
            if (self._rx_bits >> -delta) & 1:
                return DropReason.DUPLICATE
        frames = wire.decode_frames(data)  # DecodeError is counted by the endpoint
        if frames.messages and not self._can_buffer(frames.messages, len(data)):
            return DropReason.RECV_BUFFER_FULL
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
        self._process_ack(ack16, ack_bits, now)
        if self.state is State.CLOSED:  # that ack completed our close
            return None
        eliciting = frames.ping or frames.disconnect is not None
        if frames.messages and state is not State.DRAINING:
            eliciting = self._deliver(frames.messages) or eliciting
        elif frames.messages:
            eliciting = True
        if eliciting:
            self._ack_pending = True
            self._dirty.add(self)
            low = self._ack_low
            if seq >= self._rx_largest - ACK_SPAN:
                if low is None or seq < low:
                    self._ack_low = seq
            else:
                self._early_acks.append(self._ack_only_packet(about=seq))
        if frames.disconnect is not None:
            self._on_peer_disconnect(frames.disconnect, now)
        return None

    def _can_buffer(self, messages: list[wire.MessageFrame], size: int) -> bool:
        """Whether the packet's early reliable messages fit the reorder buffer.

        A packet is accepted whole or not at all: acknowledging it while dropping a
        message in it would lose that message for good. Each buffered message is
        charged ``BUFFER_ENTRY_COST`` on top of its payload, so empty messages
        cannot fill the buffer with entries for free. The common case, a packet
        that fits even if every message in it were early, is decided at once.
        """
        limit = self.config.recv_buffer_bytes
        if self._rx_buffered_bytes + size + BUFFER_ENTRY_COST * len(messages) <= limit:
            return self._channels_ok(messages)
        if not self._channels_ok(messages):
            return False
        # Replay the packet's in-order deliveries: a message right behind one that
        # is delivered is not buffered, and buffered ones it releases free space.
        # Counting them as early would refuse, forever, the very packet that
        # unblocks the channel.
        running: dict[int, int] = {}
        extra = 0
        for mode, channel, seq16, payload in messages:
            if mode != RELIABLE_ORDERED:
                continue
            expected = running.get(channel, self._rx_ch_next[channel])
            ahead = self._ahead(seq16, expected)
            if ahead == 0:
                expected += 1
                buf = self._rx_ch_buf[channel]
                while expected in buf:
                    extra -= len(buf[expected]) + BUFFER_ENTRY_COST
                    expected += 1
                running[channel] = expected
            elif ahead > 0:
                extra += len(payload) + BUFFER_ENTRY_COST
        return self._rx_buffered_bytes + extra <= limit

    def _ahead(self, seq16: int, expected: int) -> int:
        """How far a reliable message is ahead of the next expected one; -1 if it is
        a duplicate. Within ``channel_window`` only: an honest sender never runs
        further ahead, so anything else is an old copy whose 16-bit number wrapped
        (a long-delayed packet), and unwrapping it would deliver it in place of a
        newer message."""
        ahead = seq_diff(seq16, expected & SEQ_MASK)
        return ahead if 0 <= ahead < self.config.channel_window else -1

    def _channels_ok(self, messages: list[wire.MessageFrame]) -> bool:
        channels = self._channels
        return all(m[1] < channels for m in messages)

    def _deliver(self, messages: list[wire.MessageFrame]) -> bool:
        """Deliver or buffer each message; returns whether any was reliable."""
        events = self._events
        rx_next = self._rx_ch_next
        delivered = 0
        reliable_seen = False
        for mode, channel, seq16, payload in messages:
            if mode == UNRELIABLE:
                events.append((self, MessageReceived(payload, channel, False)))
                delivered += 1
                continue
            reliable_seen = True
            expected = rx_next[channel]
            if seq16 == expected & SEQ_MASK:  # the common case: next in order
                events.append((self, MessageReceived(payload, channel, True)))
                delivered += 1
                expected += 1
                buf = self._rx_ch_buf[channel]
                if buf:
                    delivered += self._flush_buffered(channel, expected, buf)
                    expected = rx_next[channel]
                else:
                    rx_next[channel] = expected
                continue
            ahead = self._ahead(seq16, expected)
            buf = self._rx_ch_buf[channel]
            if ahead > 0 and expected + ahead not in buf:
                buf[expected + ahead] = payload
                self._rx_buffered_bytes += len(payload) + BUFFER_ENTRY_COST
            else:
                self.stats.duplicate_messages += 1
        self.stats.messages_received += delivered
        return reliable_seen

    def _flush_buffered(self, channel: int, expected: int, buf: dict[int, bytes]) -> int:
        """Deliver the buffered messages that are now in order; returns how many."""
        events = self._events
        n = 0
        while buf:
            early = buf.pop(expected, None)
            if early is None:
                break
            self._rx_buffered_bytes -= len(early) + BUFFER_ENTRY_COST
            events.append((self, MessageReceived(early, channel, True)))
            expected += 1
            n += 1
        self._rx_ch_next[channel] = expected
        return n

    def _process_ack(self, ack16: int, bits: int, now: float) -> None:
        sent = self._sent
        largest = unwrap(ack16, self._tx_next - 1)
        if largest >= self._tx_next:
            self.stats.bad_acks += 1
            return
        if not sent:
            if largest in self._lost_recently:  # a late ack after everything else was acked
                self._on_spurious_loss(largest)
            return
        newly = False
        pkt = sent.pop(largest, None)
        if pkt is not None:
            if largest >= self._largest_acked:  # a late ack's delay includes reordering
                self._rtt.on_sample(now - pkt.time_sent)
            self._on_acked(pkt, now)
            newly = True
        elif largest in self._lost_recently:
            self._on_spurious_loss(largest)
        oldest = next(iter(sent)) if sent else largest
        span = min(32, largest - oldest)
        i = 1
        while bits and i <= span:
            if bits & 1:
                pkt = sent.pop(largest - i, None)
                if pkt is not None:
                    self._on_acked(pkt, now)
                    newly = True
            bits >>= 1
            i += 1
        if newly:
            self._rtt.backoff = 0
            if largest > self._largest_acked:
                self._largest_acked = largest
            self._detect_losses(now)
            if self._rel_queue or self._retx:
                # The ack opened the window: what waited for room can go out now, not at the
                # next timer (an ack-only packet does not otherwise schedule a flush).
                self._dirty.add(self)
            if self.state is State.CLOSING:
                self._maybe_send_disconnect(now)

    def _on_acked(self, pkt: SentPacket, now: float) -> None:
        self._in_flight -= 1
        newly = 0
        for msg in pkt.messages:
            msg.copies -= 1
            if msg.state != ACKED:
                msg.state = ACKED
                newly += 1
                if msg.notify:
                    self._events.append((self, MessageAcked(msg)))
                unacked = self._tx_ch_unacked[msg.channel]
                while unacked and unacked[0].state == ACKED:
                    unacked.popleft()
        self._queued -= newly
        self._unacked_reliable -= newly
        if pkt.disconnect and self.state is State.CLOSING:
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)

    def _detect_losses(self, now: float) -> None:
        largest = self._largest_acked
        delay = self._rtt.loss_delay
        threshold = largest - self._reorder_threshold
        self._loss_time = None
        lost: list[int] = []
        for seq, pkt in self._sent.items():
            if seq >= largest:
                break
            # One expression for the test and the deadline: a deadline computed
            # differently could round to ``now`` and never be reached.
            deadline = pkt.time_sent + delay
            if seq <= threshold or deadline <= now:
                lost.append(seq)
            else:
                self._loss_time = deadline
                break
        for seq in lost:
            self._on_lost(self._sent.pop(seq))

    def _on_spurious_loss(self, seq: int) -> None:
        """A packet we declared lost was acknowledged after all: the path reorders.

        Widen the packet and time thresholds to the reordering we saw (as RACK,
        RFC 8985, adapts its reordering window), so it stops causing resends.
        """
        del self._lost_recently[seq]
        self.stats.spurious_losses += 1
        depth = self._largest_acked - seq + 1
        self._reorder_threshold = min(max(self._reorder_threshold, depth), MAX_REORDER_THRESHOLD)
        self._rtt.widen_reorder_window()

    def _on_lost(self, pkt: SentPacket) -> None:
        self._in_flight -= 1
        self.stats.packets_lost += 1
        lost = self._lost_recently
        lost[pkt.seq] = None
        if len(lost) > LOST_MEMORY:
            del lost[next(iter(lost))]
        for msg in pkt.messages:
            msg.copies -= 1
            if msg.state != ACKED and msg.copies == 0:
                self._retx.append(msg)
        if pkt.control and self.state is State.CLOSING:
            self._control.extend(pkt.control)
        self._dirty.add(self)

    # -- send path ---------------------------------------------------------------------------

    def _build_packet(self, now: float) -> bytes | None:
        if not (
            self._ack_pending
            or self._ping
            or self._control
            or self._retx
            or self._unrel_queue
            or self._rel_queue
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
        if self._in_flight < self.config.window:
            budget = self._take_retransmissions(parts, messages, budget)
        budget = self._take_unreliable(parts, budget)
        if self._in_flight < self.config.window and not self._retx:
            budget = self._take_new_reliable(parts, messages, budget)
        eliciting = bool(messages or control)
        if self._ping and not eliciting and self.state is not State.DRAINING:
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
            self._sent[seq] = SentPacket(
                seq, now, messages, control, self._disconnect_in(control), len(datagram)
            )
            self._in_flight += 1
            self._last_eliciting = now
            self.stats.eliciting_sent += 1
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
        retx = self._retx
        while retx:
            msg = retx[0]
            if msg.state == ACKED or msg.copies:
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

    def _take_unreliable(self, parts: list[bytes], budget: int) -> int:
        queue = self._unrel_queue
        while queue:
            frame = queue[0].frame
            size = len(frame)
            if size > budget:
                break
            queue.popleft().state = SENT
            parts.append(frame)
            self._queued -= 1
            budget -= size
            self.stats.messages_sent += 1
        return budget

    def _take_new_reliable(
        self, parts: list[bytes], messages: list[OutMessage], budget: int
    ) -> int:
        queue = self._rel_queue
        window = self.config.channel_window
        unacked = self._tx_ch_unacked
        sent = 0
        while queue:
            msg = queue[0]
            frame = msg.frame
            size = len(frame)
            if size > budget or msg.seq - unacked[msg.channel][0].seq >= window:
                break  # the packet is full, or the receiver could not buffer it yet
            queue.popleft()
            msg.state = SENT
            parts.append(frame)
            messages.append(msg)
            budget -= size
            sent += 1
        self.stats.messages_sent += sent
        return budget

    # -- timers -----------------------------------------------------------------------------

    def _probe_deadline(self) -> float:
        """When the resend timer fires: one backed-off RTO after the oldest packet in
        flight was sent, or after the last probe if that was later. Without the
        latter, once the backoff is capped every packet behind the first would be
        overdue at once after an outage, and fire in one burst."""
        first = next(iter(self._sent.values()))
        return max(first.time_sent, self._last_probe) + self._rtt.backed_off_rto

    def _connecting_timer(self, now: float) -> None:
        if now >= self._connect_deadline:
            self._end(DisconnectReason.CONNECT_TIMEOUT, 0, "", by_peer=False)
        elif now >= self._next_connect:
            self._next_connect = now + self.config.connect_retry_interval
            self._send_connect = True
            self._dirty.add(self)

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
        if self._loss_time is not None and now >= self._loss_time:
            self._detect_losses(now)
        if self._sent:
            first = next(iter(self._sent.values()))
            if now >= self._probe_deadline():
                # Only the oldest packet is declared lost: its messages go out again as
                # a probe. Declaring every expired packet lost at once turns a queue
                # that grew faster than the RTO estimate into a resend storm; once the
                # probe is acknowledged, the packet threshold finds any real losses
                # behind it (RFC 9002's probe timeout works the same way).
                self.stats.timeouts += 1
                self._on_lost(self._sent.pop(first.seq))
                self._ping = True  # a probe goes out even if nothing needed resending
                self._last_probe = now
                self._rtt.on_timeout()
        elif now >= self._last_eliciting + cfg.keepalive_interval:
            self._ping = True
            self._dirty.add(self)

    # -- closing ----------------------------------------------------------------------------

    def _maybe_send_disconnect(self, now: float) -> None:
        if self._disconnect_queued or self._unacked_reliable:
            return
        self._disconnect_queued = True
        self._control.append(wire.disconnect_frame(self._close_code, self._close_text))
        self._deadline = now + self.config.close_timeout
        self._dirty.add(self)

    def _on_peer_disconnect(self, frame: wire.DisconnectFrame, now: float) -> None:
        if self.state is State.DRAINING:
            return
        if self.state is State.CLOSING:
            # Both sides closed at once; each reports its own close.
            event = Disconnected(DisconnectReason.CLOSED, self._close_code, self._close_text, False)
        else:
            event = Disconnected(DisconnectReason.CLOSED, frame.code, frame.text, True)
        self._fail_pending()
        self.close_reason = event
        self._events.append((self, event))
        self._set_state(State.DRAINING)
        # Linger to re-acknowledge a resent DISCONNECT whose ack was lost.
        self._deadline = now + max(3 * self._rtt.rto, 0.05)

    def _end(self, reason: DisconnectReason, code: int, text: str, *, by_peer: bool) -> None:
        self._fail_pending()
        event = Disconnected(reason, code, text, by_peer)
        self.close_reason = event
        self._events.append((self, event))
        self._set_state(State.CLOSED)

    def _fail_pending(self) -> None:
        for queue in (self._rel_queue, self._unrel_queue, self._retx):
            for msg in queue:
                if msg.state != ACKED:
                    msg.state = FAILED
            queue.clear()
        for unacked in self._tx_ch_unacked:
            for msg in unacked:
                if msg.state != ACKED:
                    msg.state = FAILED
            unacked.clear()
        self._sent.clear()
        self._control.clear()
        self._in_flight = 0
        self._queued = 0
        self._unacked_reliable = 0
        self._rx_ch_buf = [{} for _ in range(self.config.channels)]
        self._rx_buffered_bytes = 0

    def _set_state(self, new: State) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise LocalProtocolError(f"illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new is State.CLOSED:
            self._dirty.discard(self)
            if self._on_closed is not None:
                self._on_closed(self)

    def __repr__(self) -> str:
        return f"<Connection {self.address!r} {self.state.value}>"


def _as_bytes(data: object) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"message data must be bytes-like, not {type(data).__name__}")
    return bytes(data)
