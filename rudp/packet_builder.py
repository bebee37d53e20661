"""Packet building: filling each DATA datagram from the queues, acks and redundancy.

Theory of operation
-------------------
``Connection.datagrams_to_send`` calls ``PacketBuilder.build`` until it returns
None. Each call fills one datagram of at most ``max_datagram_size`` bytes, in
this order:

1. control frames (DISCONNECT, and its resends), then PAUSE or RESUME;
2. reliable messages whose packet was lost, while both windows have room
   (``Config.window`` packets in flight, and the congestion window's bytes,
   which a resend timeout's probe may exceed);
3. unreliable messages, which expire after ``Config.unreliable_max_age``; an
   unreliable-sequenced one takes its number only now, so expired ones leave no
   gap;
4. new reliable messages, unless the peer paused us, while they fit the
   receiver's channel window, its graph-id window and what we estimate of its
   reorder buffer (``Sender.unacked_bytes``);
5. with ``Config.redundancy``, copies of recent small reliable messages not
   acknowledged yet, newest first, in the room left;
6. a PING if nothing else in it asks for an acknowledgment and one is due.

Every packet, even an empty one, carries our acknowledgment of the peer's
packets in its header: the newest one and a bitfield of the 32 before it. An
*ack-only* packet (``ack_only``) carries nothing else; the connection builds one
early when packets arrive faster than one header can acknowledge them.

Each packet takes the next packet number (``tx_next``); ack-eliciting ones go to
loss detection (``recovery.PacketRecovery``), which reports their fate back.

Judgement call: which packets we received (the acknowledgment every header
carries) is the packet reader's state (``PacketReader.rx_largest`` and
``rx_bits``, updated as each packet is accepted); the builder reads it there rather than
keeping a copy that could disagree. Likewise it asks the connection to queue its
DISCONNECT (``_maybe_send_disconnect``) when the last unreliable message before a
close goes out, since when to say goodbye is a lifecycle decision.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from rudp import frames, wire
from rudp.config import BUFFER_ENTRY_COST, REDUNDANT_FRAME_MAX, Config
from rudp.errors import LocalProtocolError
from rudp.graph import refresh_deps
from rudp.protection import Sealer
from rudp.recovery import PacketRecovery, SentPacket
from rudp.sending import FAILED, SENT, OutMessage, Sender, buffer_cost
from rudp.seqnum import SEQ_MASK
from rudp.wire import GRAPH, RELIABLE_ORDERED, UNRELIABLE_SEQUENCED

if TYPE_CHECKING:
    from rudp.congestion import CongestionController
    from rudp.connection import Connection
    from rudp.parity import Parity
    from rudp.stats import ConnectionStats

RECENT_MAX: Final = 32  # recently sent small messages the redundancy option may repeat
# Redundancy adds copies until a message is lost with every packet carrying it at most
# this often (at the measured loss rate p, a message in 1 + n packets: p ** (1 + n)).
REDUNDANCY_RESIDUAL: Final = 0.001
# Below this measured loss rate no copies go at all: a lone loss (or a loss declared on
# a reordering path before it proved spurious) is left to retransmission.
REDUNDANCY_MIN_LOSS: Final = 0.005
ACK_EVERY: Final = 2  # ack-eliciting packets received that are acknowledged at once (RFC 9000)
NO_DEADLINE: Final = float("inf")
ACK_DELAY_FRAME_SIZE: Final = 3
_NO_CONTROL: Final[list[bytes]] = []  # a packet's control frames when it has none (never changed)


class PacketBuilder:
    """Builds the DATA packets of one connection and numbers them."""

    __slots__ = (
        "_byte_window",
        "_cc",
        "_conn",
        "_level",
        "_max_payload",
        "_packet_window",
        "_prefix",
        "_recovery",
        "_redundancy",
        "_sealer",
        "_sender",
        "_stats",
        "_unreliable_max_age",
        "_window",
        "ack_deadline",
        "ack_delay",
        "ack_low",
        "ack_pending",
        "ack_unsent",
        "control",
        "early_acks",
        "flow_frame",
        "flow_seq",
        "last_sent",
        "parity",
        "ping",
        "recent",
        "tx_next",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self,
        conn: Connection,
        sender: Sender,
        recovery: PacketRecovery,
        cc: CongestionController,
        stats: ConnectionStats,
        config: Config,
        isn: int,
        now: float,
    ) -> None:
        self._conn = conn
        self._sender = sender
        self._recovery = recovery
        self._cc = cc
        self._stats = stats
        self._max_payload = config.base_datagram_size - wire.DATA_HEADER_SIZE
        # Config values read per packet, copied into native attributes (see RttEstimator).
        self._packet_window = config.window
        self._window = config.channel_window
        self._byte_window = config.recv_buffer_bytes
        self._unreliable_max_age = config.unreliable_max_age
        self._redundancy = config.redundancy
        self._level = 0  # the redundancy level in use (see redundancy_level)
        self.tx_next = isn  # the number of our next packet
        self._sealer: Sealer | None = None  # set when the handshake completes
        self._prefix = b""  # a DATA header's first five bytes (wire.data_prefix_start)
        self.control: list[bytes] = []  # DISCONNECT, to go out (again)
        self.flow_frame = b""  # PAUSE or RESUME waiting to go out
        self.flow_seq = -1  # the packet that carried our latest PAUSE or RESUME
        self.ping = False
        self.ack_pending = False  # an acknowledgment must go now, alone if need be
        # A delayed acknowledgment: it rides on the next packet that goes out anyway, or
        # goes alone at ``ack_deadline`` (see ``packet_reader``). ``ack_delay`` is 0 until
        # the peer states in the handshake that its resend timer allows for one.
        self.ack_delay = 0.0
        self.ack_deadline = NO_DEADLINE
        self.ack_unsent = 0  # ack-eliciting packets received since our last acknowledgment
        # Oldest ack-eliciting packet received since our last packet reported the receive
        # window, and ack-only packets built early because it was about to leave the 33
        # packets one header can acknowledge (see ``packet_reader``).
        self.ack_low: int | None = None
        self.early_acks: list[bytes] = []
        self.recent: deque[OutMessage] = deque()  # small messages redundancy may repeat
        self.last_sent = now  # when our last packet of any kind went out
        self.parity: Parity | None = None  # REPAIR frames instead of copies (rudp.parity)

    def set_keys(self, sealer: Sealer, peer_cid: int) -> None:
        """The handshake is done: seal with ``sealer``, address packets to ``peer_cid``."""
        self._sealer = sealer
        self._prefix = wire.data_prefix_start(peer_cid)

    def seal(self, pn: int, body: bytes) -> bytes:
        """``body`` sealed as packet ``pn``: the cleartext header is associated data."""
        sealer = self._sealer
        if sealer is None:
            raise LocalProtocolError("no packet keys before the handshake completes")
        # = wire.data_prefix(peer_cid, pn), without a struct packed per packet.
        header = self._prefix + (pn & 0xFFFFFFFF).to_bytes(4, "big")
        return header + sealer.seal(pn, header, body)

    def seal_next(self, body: bytes) -> bytes:
        """``body`` (acknowledgment fields, then frames) sealed as our next packet."""
        if self._sealer is None:
            raise LocalProtocolError("no packet keys before the handshake completes")
        pn = self.tx_next
        self.tx_next = pn + 1
        return self.seal(pn, body)

    def path_packet(self, frame: bytes) -> bytes:
        """A packet carrying our acknowledgment and ``frame`` (a PATH_CHALLENGE), for
        another address than the peer's: not tracked by loss detection (the migration's
        own timer resends it; see ``rudp.migration``)."""
        reader = self._conn._reader
        seq = self.tx_next
        self.tx_next = seq + 1
        ack = wire.ack_fields(reader.rx_largest & SEQ_MASK, (reader.rx_bits >> 1) & 0xFFFFFFFF)
        return self.seal(seq, ack + frame)

    def apply_peer_limits(
        self, datagram_size: int, recv_buffer_bytes: int, channel_window: int | None = None
    ) -> None:
        """Build datagrams of at most ``datagram_size`` bytes (the smaller of the two
        sides'), keep what may sit in the peer's reorder buffer below the size it
        stated in the handshake, and run no further ahead on a channel than it takes."""
        self._max_payload = datagram_size - wire.DATA_HEADER_SIZE
        self._byte_window = recv_buffer_bytes
        if channel_window is not None:
            self._window = min(self._window, channel_window)

    def set_datagram_size(self, size: int) -> None:
        """Fill datagrams up to ``size`` bytes (the size path MTU discovery confirmed)."""
        self._max_payload = size - wire.DATA_HEADER_SIZE

    def probe(self, size: int) -> bytes:
        """A path MTU probe of exactly ``size`` bytes: PING and PADDING, no message. It is
        not loss detection's to track (``rudp.pmtu``): a lost probe loses nothing."""
        reader = self._conn._reader
        ack = wire.ack_fields(reader.rx_largest & SEQ_MASK, (reader.rx_bits >> 1) & 0xFFFFFFFF)
        return self.seal_next(ack + frames.probe_frames(size - wire.DATA_HEADER_SIZE))

    def build(self, now: float, closing: bool, draining: bool) -> bytes | None:
        """The next datagram due now, or None; ``closing`` and ``draining`` say
        whether the connection is in that state."""
        sender = self._sender
        if now >= self.ack_deadline:
            self.ack_pending = True  # the delayed acknowledgment waited long enough
        if not (
            self.ack_pending
            or self.ping
            or self.control
            or self.flow_frame
            or sender.retx
            or sender.unrel_queue
            or sender.rel_queue
        ):
            return None  # the common last call of a flush: nothing left to send
        conn = self._conn
        recovery = self._recovery
        budget = self._max_payload
        # Room for an ACK_DELAY frame if this packet carries an acknowledgment that waited.
        delayed = self.ack_unsent > 0 and self.ack_delay > 0.0
        if delayed:
            budget -= ACK_DELAY_FRAME_SIZE
        parity = self.parity
        if parity is not None and parity.report_due:
            budget -= frames.RECOVERED_SIZE
        # parts[0] is the acknowledgment, filled in last: one list per datagram, joined once.
        parts: list[bytes] = [b""]
        messages: list[OutMessage] = []
        control = _NO_CONTROL  # shared and never changed: most packets carry none
        if self.control:
            control, self.control = self.control, []
            for frame in control:
                parts.append(frame)
                budget -= len(frame)
        flow = self.flow_frame
        if flow:
            self.flow_frame = b""
            parts.append(flow)
            budget -= 1
        # Reliable data goes out while both windows have room: ``window`` packets and
        # the congestion window's bytes (which a resend timeout's probe may exceed).
        room = recovery.in_flight < self._packet_window and (
            self._cc.can_send() or recovery.probe_due
        )
        if room:
            budget = self._take_retransmissions(parts, messages, budget)
        if sender.unrel_queue:
            budget = self._take_unreliable(parts, budget, now)
            if not sender.unrel_queue and closing:
                # The last unreliable messages queued before close() go out with the
                # DISCONNECT, not after it: the peer drops messages once it has one.
                conn._maybe_send_disconnect(now)
                if self.control and budget >= len(self.control[-1]):
                    frame = self.control.pop()
                    parts.append(frame)
                    control = [*control, frame]
                    budget -= len(frame)
        if room and not sender.retx and not conn.peer_paused:
            # A paused peer gets no new reliable messages; unreliable ones still go (they
            # expire rather than wait, and the peer bounds what it accepts while paused).
            budget = self._take_new_reliable(parts, messages, budget, now)
        if self._redundancy and messages:
            level = self.redundancy_level()
            if level:
                budget = self._take_redundant(parts, messages, budget, level)
        eliciting = bool(messages or control or flow)
        if self.ping and not eliciting and not draining:
            parts.append(frames.PING_FRAME)
            eliciting = True
        elif messages and budget and sender.rel_queue and not conn.peer_paused:
            queued = sender.rel_queue[0]
            if not room or len(queued.frame) <= budget:
                # A window holds the rest back until this packet is acknowledged: a PING
                # asks the peer to do so at once rather than after its ack delay (as
                # QUIC's IMMEDIATE_ACK does), or a window-limited sender would wait that
                # long every round trip.
                parts.append(frames.PING_FRAME)
        if len(parts) == 1:
            if not self.ack_pending:
                return None
            self._stats.acks_alone += 1
        reader = conn._reader
        protected = len(parts)  # what a REPAIR covers: the frames before the tail frames
        if delayed:
            # The peer takes it off its RTT sample (RFC 9002, section 5.3).
            waited = now - reader.rx_largest_time
            if waited >= frames.ACK_DELAY_UNIT:
                parts.append(frames.ack_delay_frame(waited))
        if parity is not None and parity.report_due:
            parts.append(parity.report())
        self.ping = False
        self._acked()
        self.last_sent = now
        seq = self.tx_next
        self.tx_next = seq + 1
        parts[0] = wire.ack_fields(reader.rx_largest & SEQ_MASK, (reader.rx_bits >> 1) & 0xFFFFFFFF)
        if parity is not None and eliciting and not sender.rel_queue:
            parity.on_build(seq, parts, protected, budget)  # a thin stream's packet
        datagram = self.seal(seq, b"".join(parts))
        if eliciting:
            recovery.on_packet_sent(
                SentPacket(
                    seq,
                    now,
                    messages,
                    control,
                    bool(control) and _disconnect_in(control),
                    len(datagram),
                )
            )
            self._stats.eliciting_sent += 1
            if flow:
                self.flow_seq = seq
            for msg in messages:
                msg.copies += 1
        return datagram

    def ack_only(self, about: int | None = None) -> bytes:
        """A packet carrying nothing but an acknowledgment.

        By default it reports the newest packet and the 32 before it. With
        ``about``, it reports that (late) packet and the 32 before it instead: a
        packet that arrives after more than 32 later ones is outside every normal
        ack header, and without this the sender could never learn it arrived.
        """
        conn = self._conn
        reader = conn._reader
        if about is None:
            self._acked()
            ack, bits = reader.rx_largest, reader.rx_bits >> 1
        else:
            ack, bits = about, reader.rx_bits >> (reader.rx_largest - about + 1)
        seq = self.tx_next
        self.tx_next = seq + 1
        self._stats.acks_alone += 1
        return self.seal(seq, wire.ack_fields(ack & SEQ_MASK, bits & 0xFFFFFFFF))

    def _acked(self) -> None:
        """A packet carrying our acknowledgment of everything received is going out."""
        self.ack_pending = False
        self.ack_deadline = NO_DEADLINE
        self.ack_unsent = 0
        self.ack_low = None

    def on_eliciting(self, now: float, at_once: bool) -> bool:
        """An ack-eliciting packet arrived; ``at_once`` when its acknowledgment must not
        wait (it shows a gap, carries a PING or DISCONNECT, or the peer did not state a
        delay). Returns whether the acknowledgment is due now.

        Otherwise it waits for a packet that goes out anyway, at most ``ack_delay``, as
        QUIC's does (RFC 9000, section 13.2.1): every second ack-eliciting packet is
        acknowledged at once, so a burst's sender sees its window move as before.
        """
        self.ack_unsent += 1
        if at_once or self.ack_unsent >= ACK_EVERY or self.ack_delay <= 0.0:
            self.ack_pending = True
        elif self.ack_deadline == NO_DEADLINE:
            self.ack_deadline = now + self.ack_delay
        return self.ack_pending

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
            self._stats.messages_resent += 1
        return budget

    def _take_unreliable(self, parts: list[bytes], budget: int, now: float) -> int:
        sender = self._sender
        queue = sender.unrel_queue
        stale = now - self._unreliable_max_age
        while queue:
            msg = queue[0]
            queued_at = msg.queued_at
            if queued_at is not None and queued_at < stale:
                queue.popleft().state = FAILED
                sender.queued -= 1
                self._stats.messages_expired += 1
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
                seq = msg.seq = sender.tx_useq[channel]
                sender.tx_useq[channel] = seq + 1
                frame = msg.frame = frames.message_frame(
                    UNRELIABLE_SEQUENCED, channel, seq, msg.data
                )
            queue.popleft().state = SENT
            parts.append(frame)
            sender.queued -= 1
            budget -= size
            self._stats.messages_sent += 1
        return budget

    def _take_new_reliable(
        self, parts: list[bytes], messages: list[OutMessage], budget: int, now: float
    ) -> int:
        sender = self._sender
        queue = sender.rel_queue
        window = self._window
        unacked = sender.tx_ch_unacked
        # Bytes that may still go into the peer's reorder buffer (see unacked_bytes).
        room = self._byte_window - sender.unacked_bytes
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
                # (A fragment waits in the receiver's reassembly budget, not in the
                # reorder buffer: it costs none of it.)
                cost = size + BUFFER_ENTRY_COST if msg.parent is None else 0
                if cost > room and (cost <= self._byte_window or sender.unacked_bytes):
                    # It might not fit the receiver's reorder buffer. One larger than the
                    # whole buffer goes when nothing else is unacknowledged: it is then
                    # the next of its channel, delivered at once, never buffered.
                    break
                room -= cost
            elif msg.state > SENT:
                queue.popleft()  # superseded
                continue
            elif mode == GRAPH:
                if msg.seq - sender.tx_graph[0].seq >= window:
                    break  # beyond the ids the receiver accepts
                if refresh_deps(msg):
                    frame = msg.frame
                    size = len(frame)
                cost = buffer_cost(msg) if msg.parent is None else 0
                if cost > room and (cost <= self._byte_window or sender.unacked_bytes):
                    break
                room -= cost
            queue.popleft()
            msg.state = SENT
            sender.mark_sent(msg, now)
            parts.append(frame)
            messages.append(msg)
            budget -= size
            sent += 1
        sender.unacked_bytes = self._byte_window - room
        self._stats.messages_sent += sent
        return budget

    def redundancy_level(self) -> int:
        """How many later packets repeat each small message, from the loss rate loss
        detection measures: none on a clean path (below ``REDUNDANCY_MIN_LOSS``), then
        as many as keep a message lost with all its copies below ``REDUNDANCY_RESIDUAL``
        (1 from 0.5 %, 2 from 3.2 %), at most ``Config.redundancy``.

        With hysteresis: a level is left only once it would not be chosen at twice the
        rate. The average wanders by about a fifth of the rate either way over its 256
        packets, and a path losing 5 % would otherwise fall to one copy whenever it
        dipped below 3.2 %, leaving 1 message in 400 to wait a round trip.
        """
        rate = self._recovery.loss_rate
        level = self._level_for(rate)
        if level < self._level and self._level_for(2 * rate) >= self._level:
            level = self._level
        self._level = level
        return level

    def _level_for(self, rate: float) -> int:
        if rate < REDUNDANCY_MIN_LOSS:
            return 0
        level = 1
        residual = rate * rate
        while residual > REDUNDANCY_RESIDUAL and level < self._redundancy:
            level += 1
            residual *= rate
        return min(level, self._redundancy)

    def _take_redundant(
        self, parts: list[bytes], messages: list[OutMessage], budget: int, limit: int
    ) -> int:
        """Fill the rest of a packet with copies of recent unacknowledged small messages
        (newest first), then remember this packet's own small messages for later ones.

        Only a thin stream remembers its messages (the send queue is empty after this
        packet): in a burst every packet is full anyway, so copies would find no room.
        """
        recent = self.recent
        fresh = len(messages)
        if recent:
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
                    self._stats.messages_redundant += 1
                    if budget <= 3:
                        break
        if not self._sender.rel_queue:
            for msg in messages[:fresh]:
                if len(msg.frame) <= REDUNDANT_FRAME_MAX:
                    recent.append(msg)
            while len(recent) > RECENT_MAX:
                recent.popleft()
        return budget

    def use_parity(self, parity: Parity) -> None:
        """The peer reads REPAIR frames: protect thin streams with them, not copies."""
        self.parity = parity
        self._redundancy = 0

    def clear(self) -> None:
        """The connection ended: nothing more to send."""
        self.recent.clear()
        self.control.clear()


def _disconnect_in(control: list[bytes]) -> bool:
    return any(frame[0] == frames.FrameType.DISCONNECT for frame in control)
