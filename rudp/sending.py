"""The send side: the message record, the queues, delivery modes and fragmentation.

Theory of operation
-------------------
``Connection.send`` hands each message to ``Sender.send``, which gives it a
number in its mode's sequence space, encodes its frame once (a resend carries the
same frame), and queues it. ``OutMessage`` is that message's record and the
handle the caller gets back.

- Reliable messages wait in ``rel_queue`` for a packet; unreliable ones in
  ``unrel_queue`` (they expire after ``Config.unreliable_max_age``); reliable
  messages whose packet was lost go to ``retx`` and out before anything new.
  The packet builder (``packet_builder``) takes from these queues.
- Sequence spaces: reliable-ordered messages number per channel, reliable-
  sequenced ones per channel in a space of their own, unreliable-sequenced ones
  per channel when they go out (so expired ones leave no gap), and graph messages
  (reliable-unordered and dependency-ordered) share the connection's graph ids.
- A reliable message larger than one datagram becomes a *parent* handle, never
  sent itself, and fragments with consecutive numbers, each an ordinary reliable
  message of the same mode, resent on its own. The parent is acknowledged once
  every fragment is.
- A newer reliable-sequenced message *supersedes* the previous one on its
  channel: never sent again, reported done.
- ``unacked_bytes`` estimates what our unacknowledged reliable messages may hold
  of the peer's reorder buffer, charged as the receiver charges them (payload
  plus ``BUFFER_ENTRY_COST`` per entry); the packet builder keeps it below the
  buffer's size, so that an honest peer never refuses our packets for want of
  room.

What happens to a message when the packet carrying it is acknowledged or lost
is decided here too (``on_acked``, ``on_lost``); loss detection (``recovery``)
says which packets those are.

Judgement calls: ``OutMessage`` lives here, not with loss detection, because it
is the send queue's record (the message, its frame, its state); loss detection
only ever sees packets. And ``Connection.send`` keeps the one check that needs
the connection's state, then hands over: the sender knows nothing of the
lifecycle, and the connection nothing of sequence spaces. That costs one call
per message sent, which the per-message instruction counts allow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Generator, Iterable
from typing import TYPE_CHECKING, Any, Final, Protocol

from rudp import frames, wire
from rudp.config import BUFFER_ENTRY_COST, Config
from rudp.errors import (
    LocalProtocolError,
    MessageTooLarge,
    SendQueueFull,
    as_bytes,
    check_sequence,
)
from rudp.events import MessageAcked
from rudp.graph import GraphNode, mark_executed
from rudp.wire import (
    DEPENDENCY_ORDERED,
    GRAPH,
    RELIABLE_ORDERED,
    RELIABLE_SEQUENCED,
    UNRELIABLE,
    UNRELIABLE_MODES,
    UNRELIABLE_SEQUENCED,
    Delivery,
)

if TYPE_CHECKING:
    from rudp.connection import Connection
    from rudp.handshake import TransportParams
    from rudp.recovery import SentPacket
    from rudp.sink import EndpointSink
    from rudp.stats import ConnectionStats

# Message states, plain ints: they are compared on every ack. A message is
# pending while its state is <= SENT.
QUEUED: Final = 0
SENT: Final = 1
ACKED: Final = 2
FAILED: Final = 3
SUPERSEDED: Final = 4  # reliable-sequenced: a newer message on its channel replaced it
_STATE_NAMES: Final = ("queued", "sent", "acked", "failed", "superseded")


class Waiter(Protocol):
    """What makes a handle awaitable: the I/O layer's connection (the asyncio
    ``rudp.Connection``) sets itself as ``OutMessage.waiter``. Defined here so that
    the core names the one call it makes up into that layer, and imports none of it."""

    def wait_for_handle(self, msg: OutMessage, /) -> Awaitable[None]:
        """An awaitable that completes when ``msg`` is done (raises if it failed)."""
        ...


class OutMessage:
    """One message on its way out; ``Connection.send`` returns it as the handle
    (``rudp.SendHandle`` in the asyncio API).

    A message larger than one datagram is a *parent* that is never sent itself:
    its fragments are OutMessages whose ``parent`` points back to it, and it is
    acknowledged once every fragment is (``parts`` counts those still pending).
    """

    __slots__ = (
        "channel",
        "copies",
        "data",
        "first_sent",
        "fragments",
        "frame",
        "graph",
        "mode",
        "notify",
        "parent",
        "parts",
        "paused_before",
        "queued_at",
        "redundant",
        "seq",
        "state",
        "user",
        "waiter",
    )

    def __init__(self, data: bytes, mode: int, channel: int, seq: int, frame: bytes) -> None:
        self.data = data
        self.mode = mode
        self.channel = channel
        self.seq = seq  # the id on the wire, unwrapped: channel seq or graph id
        self.frame = frame  # encoded once; a resend carries the same frame
        self.state = QUEUED
        self.copies = 0  # packets in flight that carry it
        self.first_sent = 0.0  # when a reliable one first left (Config.ack_timeout)
        self.paused_before = 0.0  # the peer's pauses before then (Connection.paused_total)
        self.notify = False  # emit MessageAcked when acknowledged
        self.user: object = None  # free slot for the asyncio layer
        # What makes the handle awaitable (see ``Waiter`` and ``__await__``).
        self.waiter: Waiter | None = None
        self.parent: OutMessage | None = None
        self.parts = 0
        self.fragments: list[OutMessage] | None = None
        self.graph: GraphNode | None = None
        self.queued_at: float | None = None
        self.redundant = 0  # extra copies sent by the redundancy option

    @property
    def acked(self) -> bool:
        return self.state == ACKED

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    @property
    def superseded(self) -> bool:
        """A newer reliable-sequenced message on the channel replaced this one first."""
        return self.state == SUPERSEDED

    def done(self) -> bool:
        """Nothing more will happen to it: acknowledged, superseded or failed; for an
        unreliable message, sent or dropped."""
        state = self.state
        return state >= ACKED or (self.mode in UNRELIABLE_MODES and state != QUEUED)

    def __repr__(self) -> str:
        state = _STATE_NAMES[self.state] if 0 <= self.state < len(_STATE_NAMES) else self.state
        mode = Delivery(self.mode).name if 0 <= self.mode < len(Delivery) else self.mode
        return (
            f"<rudp.SendHandle {mode} channel={self.channel} seq={self.seq} "
            f"{len(self.data)} bytes {state}>"
        )

    def __await__(self) -> Generator[Any, None, None]:
        # One object per message instead of two: the asyncio layer returns the core's
        # handle itself and only sets ``waiter``; the core stays free of asyncio.
        waiter = self.waiter
        if waiter is None:
            raise TypeError(
                "only a handle returned by an asyncio rudp.Connection.send() can be awaited"
            )
        return waiter.wait_for_handle(self).__await__()


class Sender:
    """The send queues of one connection and the sequence spaces of every mode."""

    __slots__ = (
        "_byte_window",
        "_channels",
        "_config",
        "_conn",
        "_fragment_limit",
        "_fragment_payload",
        "_max_message",
        "_max_payload",
        "_peer_channels",
        "_peer_max_message",
        "_queue_limit",
        "_sink",
        "_stats",
        "max_single",
        "queued",
        "rel_queue",
        "retx",
        "room_wanted",
        "sent_order",
        "tx_ch_next",
        "tx_ch_unacked",
        "tx_gid",
        "tx_graph",
        "tx_rseq",
        "tx_rseq_last",
        "tx_useq",
        "unacked_bytes",
        "unacked_reliable",
        "unrel_queue",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self, conn: Connection, sink: EndpointSink, stats: ConnectionStats, config: Config
    ) -> None:
        self._conn = conn
        self._sink = sink
        self._stats = stats
        self._config = config
        # Sized for the base datagram, not the path MTU found later: every frame must
        # still fit if the path falls back to it (``rudp.pmtu``).
        self._max_payload = config.base_datagram_size - wire.DATA_HEADER_SIZE
        self.max_single = self._max_payload - frames.MESSAGE_OVERHEAD
        self._max_message = config.max_message_size
        self._fragment_payload = config.fragment_payload
        # Fragments of one message: they take consecutive numbers, and the receiver
        # holds them no further ahead than its channel window (the peer's, once known).
        self._fragment_limit = config.channel_window
        self._channels = config.channels
        # The peer's limits from the handshake (``apply_peer_limits``); until then ours,
        # and what was queued meanwhile is checked against the peer's when they arrive.
        self._peer_channels = config.channels
        self._peer_max_message = 1 << 62
        self._queue_limit = config.send_queue_limit
        self._byte_window = config.recv_buffer_bytes
        self.rel_queue: deque[OutMessage] = deque()
        self.unrel_queue: deque[OutMessage] = deque()
        self.retx: deque[OutMessage] = deque()  # reliable messages whose packet was lost
        self.queued = 0  # messages not yet sent, plus reliable ones not yet acked
        self.unacked_reliable = 0
        # The fragments of a message the last send() refused for want of room in the
        # queue (0: it was not such a refusal): the next drain() waits for that much
        # room, once.
        self.room_wanted = 0
        # Reliable bytes sent and not yet acknowledged that could sit in the peer's
        # reorder buffer: kept below the buffer's size, so that an honest peer's packets
        # are never refused for want of room (which could stall a channel head).
        self.unacked_bytes = 0
        self.tx_ch_next = [0] * config.channels
        # Reliable-ordered messages sent on each channel and not all acknowledged yet,
        # oldest first; a channel's deque is created by its first such message (32
        # empty deques would be most of an idle connection's memory).
        self.tx_ch_unacked: list[deque[OutMessage] | None] = [None] * config.channels
        self.tx_useq = [0] * config.channels  # unreliable-sequenced numbers
        self.tx_rseq = [0] * config.channels  # reliable-sequenced numbers
        self.tx_rseq_last: list[OutMessage | None] = [None] * config.channels
        self.tx_gid = 0  # next dependency-graph id
        self.tx_graph: deque[OutMessage] = deque()  # graph messages not known executed
        # Reliable messages in the order they first left; the head is the oldest one not
        # acknowledged (``Config.ack_timeout``) once those done with are popped.
        self.sent_order: deque[OutMessage] = deque()

    def _paused_note(self) -> str:
        """Why a full queue does not drain, when the peer is the cause."""
        if self._conn.peer_paused:
            return ": the peer paused receiving (Config.peer_pause_timeout ends that)"
        return ""

    def send(
        self,
        data: bytes | bytearray | memoryview,
        reliable: bool,
        channel: int,
        delivery: Delivery | int | None,
        depends_on: Iterable[OutMessage] | None,
        now: float | None,
    ) -> OutMessage:
        """Queue a message (see ``Connection.send``)."""
        self.room_wanted = 0  # set again only if this is a fragmented message refused
        if type(data) is not bytes:
            data = as_bytes(data, "message data")
        if channel and not 0 < channel < self._peer_channels:
            self._bad_channel(channel)
        if len(data) > self._peer_max_message:
            self._too_large_for_peer(len(data))
        if self.queued >= self._queue_limit:
            raise SendQueueFull(
                f"send queue is full ({self.queued} messages){self._paused_note()}; "
                "await drain() before sending"
            )
        if delivery is not None or depends_on is not None:
            return self._send_mode(data, channel, reliable, delivery, depends_on, now)
        if reliable:
            if len(data) > self.max_single:
                return self._send_fragmented(data, RELIABLE_ORDERED, channel, ())
            seq = self.tx_ch_next[channel]
            self.tx_ch_next[channel] = seq + 1
            msg = OutMessage(
                data, RELIABLE_ORDERED, channel, seq, frames.reliable_frame(channel, seq, data)
            )
            self.rel_queue.append(msg)
            self._unacked_on(channel).append(msg)
            self.unacked_reliable += 1
        else:
            self._check_unfragmented(data)
            msg = OutMessage(data, UNRELIABLE, channel, 0, frames.unreliable_frame(channel, data))
            msg.queued_at = now
            self.unrel_queue.append(msg)
        self.queued += 1
        self._sink.dirty[self._conn] = None
        return msg

    def _too_large_for_peer(self, size: int) -> None:
        if size > self._max_message and size > self.max_single:
            self._check_total(size)  # our own limit, named as such
        raise MessageTooLarge(
            f"message of {size} bytes exceeds the peer's largest message "
            f"({self._peer_max_message} bytes)"
        )

    def _bad_channel(self, channel: int) -> None:
        if not 0 < channel < self._channels:
            raise LocalProtocolError(f"channel must be in [0, {self._channels}), got {channel}")
        raise LocalProtocolError(
            f"channel {channel} is beyond the {self._peer_channels} channels the peer accepts"
        )

    def apply_peer_limits(self, peer: TransportParams, datagram_size: int) -> str:
        """Take the peer's limits from the handshake; ``datagram_size`` is the base size
        both sides take (what every frame must fit, whatever the path MTU). Returns why
        a message queued before the handshake can never be sent (it was checked against
        our limits only), or "".
        """
        self._peer_channels = min(self._channels, peer.channels)
        self._peer_max_message = peer.max_message_size
        self._byte_window = peer.recv_buffer_bytes
        self._max_payload = datagram_size - wire.DATA_HEADER_SIZE
        self.max_single = self._max_payload - frames.MESSAGE_OVERHEAD
        self._fragment_payload = datagram_size - frames.FRAGMENT_FRAME_OVERHEAD
        if peer.channel_window is not None:
            self._fragment_limit = min(self._fragment_limit, peer.channel_window)
        for queue in (self.rel_queue, self.unrel_queue):
            for msg in queue:
                if msg.parent is not None and msg.parent.parts > self._fragment_limit:
                    return (
                        f"a message queued before the handshake has {msg.parent.parts} "
                        f"fragments; the peer takes {self._fragment_limit} ahead "
                        "(channel_window)"
                    )
                if msg.channel >= peer.channels:
                    return (
                        f"a message queued before the handshake is on channel {msg.channel}; "
                        f"the peer accepts {peer.channels} channels"
                    )
                whole = msg.data if msg.parent is None else msg.parent.data
                if len(whole) > peer.max_message_size:
                    return (
                        f"a message queued before the handshake has {len(whole)} bytes; the "
                        f"peer's largest message is {peer.max_message_size} bytes"
                    )
                if len(msg.frame) > self._max_payload:
                    return (
                        "a message queued before the handshake does not fit the peer's "
                        f"{peer.max_datagram_size}-byte datagrams"
                    )
        return ""

    def _check_total(self, total: int) -> None:
        if total > self._max_message:
            raise MessageTooLarge(
                f"message of {total} bytes exceeds Config.max_message_size ({self._max_message})"
            )

    def _check_unfragmented(self, data: bytes) -> None:
        if len(data) > self.max_single:
            raise MessageTooLarge(
                f"unreliable message of {len(data)} bytes exceeds the {self.max_single}-byte "
                "datagram payload (unreliable messages are never fragmented; send it reliably)"
            )

    def _send_mode(
        self,
        data: bytes,
        channel: int,
        reliable: bool,
        delivery: Delivery | int | None,
        depends_on: Iterable[OutMessage] | None,
        now: float | None,
    ) -> OutMessage:
        if depends_on is not None:
            check_sequence(depends_on, "depends_on")  # a str would be its letters
        if delivery is not None and type(delivery) is not Delivery and type(delivery) is not int:
            # Delivery(True) and Delivery(1.0) are RELIABLE_ORDERED: refused as for channel.
            raise TypeError(f"delivery takes a rudp.Delivery, not {delivery!r}")
        try:
            kind = Delivery.DEPENDENCY_ORDERED if delivery is None else Delivery(delivery)
        except ValueError:
            raise LocalProtocolError(f"unknown delivery mode {delivery!r}") from None
        mode = int(kind)
        if depends_on is not None and mode != DEPENDENCY_ORDERED:
            raise LocalProtocolError(
                f"depends_on needs delivery=DEPENDENCY_ORDERED, not {kind.name}"
            )
        unreliable = mode in (UNRELIABLE, UNRELIABLE_SEQUENCED)
        if not reliable and not unreliable:
            raise LocalProtocolError(f"reliable=False contradicts delivery={kind.name}")
        if mode in (UNRELIABLE, RELIABLE_ORDERED):
            return self.send(data, mode == RELIABLE_ORDERED, channel, None, None, now)
        if mode == UNRELIABLE_SEQUENCED:
            self._check_unfragmented(data)
            # Numbered when it goes out (see PacketBuilder); the frame has its size.
            msg = OutMessage(data, mode, channel, 0, frames.message_frame(mode, channel, 0, data))
            msg.queued_at = now
            self.unrel_queue.append(msg)
            self.queued += 1
            self._sink.dirty[self._conn] = None
            return msg
        if mode == RELIABLE_SEQUENCED:
            previous = self.tx_rseq_last[channel]
            if previous is not None and previous.state <= SENT:
                pieces = previous.fragments or (previous,)
                # Refused before the previous one is superseded: a send that raises
                # must leave the last accepted state on its way.
                self._check_fits(data, mode, channel, sum(p.state <= SENT for p in pieces))
                if all(p.state == QUEUED for p in pieces):
                    # None of its numbers reached the wire: reuse them, so the receiver
                    # never sees a jump of 32768 or more (which reads as "older").
                    self.tx_rseq[channel] = previous.seq
                self._supersede(previous)
            msg = self._send_reliable(data, mode, channel, ())
            self.tx_rseq_last[channel] = msg
            return msg
        deps = self._pending_deps(depends_on) if depends_on is not None else []
        msg = self._send_reliable(data, GRAPH, channel, tuple(d.seq for d in deps))
        node = GraphNode(msg.seq, self)  # the sender: never the connection, see _release
        node.waiting = len(deps)
        node.deps = deps
        msg.graph = node
        for dep in deps:
            dep.graph.dependents.append(msg)  # type: ignore[union-attr]
        self.tx_graph.append(msg)
        return msg

    def _pending_deps(self, depends_on: Iterable[OutMessage]) -> list[OutMessage]:
        """The dependencies the peer may not have executed yet; the others cost nothing."""
        if isinstance(depends_on, OutMessage):
            raise LocalProtocolError("depends_on takes a list of handles, not a single handle")
        pending: list[OutMessage] = []
        for dep in depends_on:
            node = dep.graph if isinstance(dep, OutMessage) else None
            if node is None or node.owner is not self:
                raise LocalProtocolError(
                    "depends_on takes handles that send() returned on this connection for "
                    f"RELIABLE_UNORDERED or DEPENDENCY_ORDERED messages, got {dep!r}"
                )
            if not node.executed and dep not in pending:
                pending.append(dep)
        if len(pending) > frames.MAX_DEPS:
            raise LocalProtocolError(
                f"a message can wait for at most {frames.MAX_DEPS} unacknowledged messages, "
                f"got {len(pending)}"
            )
        return pending

    def _send_reliable(
        self, data: bytes, mode: int, channel: int, deps: tuple[int, ...]
    ) -> OutMessage:
        """Queue a graph or reliable-sequenced message, fragmented if it needs to be."""
        size = frames.message_frame_size(mode, channel, len(data), deps=len(deps))
        if size > self._max_payload:
            return self._send_fragmented(data, mode, channel, deps)
        seq = self._next_seq(mode, channel, 1)
        frame = frames.message_frame(mode, channel, seq, data, deps=deps)
        msg = OutMessage(data, mode, channel, seq, frame)
        self.rel_queue.append(msg)
        self.unacked_reliable += 1
        self.queued += 1
        self._sink.dirty[self._conn] = None
        return msg

    def _next_seq(self, mode: int, channel: int, n: int) -> int:
        """Take ``n`` consecutive numbers from the mode's sequence space."""
        if mode == RELIABLE_ORDERED:
            seq = self.tx_ch_next[channel]
            self.tx_ch_next[channel] = seq + n
        elif mode == GRAPH:
            seq = self.tx_gid
            self.tx_gid = seq + n
        else:
            seq = self.tx_rseq[channel]
            self.tx_rseq[channel] = seq + n
        return seq

    def _unacked_on(self, channel: int) -> deque[OutMessage]:
        """The channel's reliable-ordered messages not all acknowledged, created on use."""
        unacked = self.tx_ch_unacked[channel]
        if unacked is None:
            unacked = self.tx_ch_unacked[channel] = deque()
        return unacked

    def _check_fits(self, data: bytes, mode: int, channel: int, freed: int) -> None:
        """Raise what queueing ``data`` (a reliable-sequenced message, no dependencies)
        would raise once ``freed`` queued messages have made way for it."""
        if frames.message_frame_size(mode, channel, len(data)) <= self._max_payload:
            return  # one message: the send queue had room for it (Sender.send)
        total = len(data)
        step = self._fragment_payload
        count = 1 + (max(total - step, 0) + step - 1) // step
        self._check_fragments(total, count, step, self.queued - freed)

    def _check_fragments(self, total: int, count: int, step: int, queued: int) -> None:
        self._check_total(total)
        if count > self._fragment_limit:
            raise MessageTooLarge(
                f"a {total}-byte message needs {count} fragments of {step} bytes; the "
                f"receiver takes {self._fragment_limit} ahead (channel_window, ours or "
                "the peer's)"
            )
        if count > self._queue_limit:
            # No drain() would ever make room for it: it is too large for this queue.
            raise MessageTooLarge(
                f"a {total}-byte message needs {count} fragments of {step} bytes; the send "
                f"queue holds {self._queue_limit} messages (Config.send_queue_limit)"
            )
        if queued + count > self._queue_limit:
            self.room_wanted = count
            raise SendQueueFull(
                f"a {count}-fragment message does not fit the send queue ({queued} of "
                f"{self._queue_limit} messages){self._paused_note()}; await drain() before "
                "sending"
            )

    def _send_fragmented(
        self, data: bytes, mode: int, channel: int, deps: tuple[int, ...]
    ) -> OutMessage:
        """Split a reliable message into fragments with consecutive sequence numbers.

        The handle returned is a parent that is never sent itself; each fragment
        is an ordinary reliable message of the same mode, resent on its own.
        """
        total = len(data)
        self._check_total(total)  # before the slicing
        step = self._fragment_payload
        first = step - (1 + 2 * len(deps) if deps else 0)
        chunks = [data[:first]]
        chunks += [data[i : i + step] for i in range(first, total, step)]
        count = len(chunks)
        self._check_fragments(total, count, step, self.queued)
        base = self._next_seq(mode, channel, count)
        parent = OutMessage(data, mode, channel, base, b"")
        parent.parts = count
        fragments: list[OutMessage] = []
        unacked = self._unacked_on(channel) if mode == RELIABLE_ORDERED else None
        for index, chunk in enumerate(chunks):
            seq = base + index
            frame = frames.message_frame(
                mode,
                channel,
                seq,
                chunk,
                deps=deps if index == 0 else (),
                fragment=(index, count, total),
            )
            fragment = OutMessage(chunk, mode, channel, seq, frame)
            fragment.parent = parent
            fragments.append(fragment)
        if unacked is not None:
            # The whole message: the receiver waits at its first sequence number until
            # its last fragment arrives, so the window counts from there.
            unacked.append(parent)
        parent.fragments = fragments
        self.rel_queue.extend(fragments)
        self.unacked_reliable += count
        self.queued += count
        self._sink.dirty[self._conn] = None
        return parent

    def drain_level(self, threshold: int) -> int:
        """The queue length ``drain()`` waits for: ``threshold``, or lower right after
        a fragmented message was refused for want of room, so that it then fits (else
        a drain-and-retry loop found the queue low enough at once, was refused
        again, and never let the event loop run). Any later send() sets it back."""
        wanted = self.room_wanted
        return threshold if not wanted else min(threshold, self._queue_limit - wanted)

    def _supersede(self, msg: OutMessage) -> None:
        """A newer reliable-sequenced message replaces ``msg``: never send it again."""
        pieces = msg.fragments if msg.fragments is not None else [msg]
        dropped = 0
        for piece in pieces:
            if piece.state <= SENT:
                piece.state = SUPERSEDED
                dropped += 1
        self.queued -= dropped
        self.unacked_reliable -= dropped
        msg.state = SUPERSEDED
        self._stats.messages_superseded += 1
        if msg.notify:
            self._sink.events.append((self._conn, MessageAcked(msg)))

    # -- what the packets carrying them became ------------------------------------------

    def on_acked(self, pkt: SentPacket) -> None:
        """A packet carrying ``pkt.messages`` was acknowledged."""
        newly = 0
        freed = 0  # reorder-buffer bytes the peer no longer holds for us
        channels = self.tx_ch_unacked
        for msg in pkt.messages:
            msg.copies -= 1
            if msg.state <= SENT:
                msg.state = ACKED
                newly += 1
                parent = msg.parent
                if parent is not None:
                    parent.parts -= 1
                    if parent.parts or parent.state > SENT:
                        continue
                    parent.state = ACKED
                    msg = parent
                if msg.mode == RELIABLE_ORDERED:
                    unacked = channels[msg.channel]
                    assert unacked is not None  # created when msg was sent
                    if unacked[0] is msg:  # the channel's oldest: it and what follows
                        while unacked and unacked[0].state == ACKED:
                            head = unacked.popleft()
                            if head.fragments is None:
                                freed += len(head.frame) + BUFFER_ENTRY_COST
                            else:
                                freed += charged(head)
                elif msg.graph is not None and msg.graph.waiting == 0:
                    self._graph_executed(msg)
                if msg.notify:
                    self._sink.events.append((self._conn, MessageAcked(msg)))
        self.unacked_bytes -= freed
        self.queued -= newly
        self.unacked_reliable -= newly
        if newly:
            self.oldest_unacked()
            if len(self.sent_order) > 2 * self.queued + 64:
                self._compact_order()

    def oldest_unacked(self) -> OutMessage | None:
        """The reliable message sent longest ago and not acknowledged yet, if any."""
        order = self.sent_order
        while order and order[0].state > SENT:
            order.popleft()
        return order[0] if order else None

    def mark_sent(self, msg: OutMessage, now: float) -> None:
        """``msg`` (reliable) leaves for the first time."""
        msg.first_sent = now
        msg.paused_before = self._conn.paused_total
        order = self.sent_order
        order.append(msg)
        if len(order) > 2 * self.queued + 64:
            self._compact_order()

    def _compact_order(self) -> None:
        """Acknowledged messages behind an old unacknowledged one: keep only those still
        waiting, so that the order stays within twice what is queued (amortized: each
        compaction at least halves it)."""
        self.sent_order = deque(m for m in self.sent_order if m.state <= SENT)

    def _graph_executed(self, msg: OutMessage) -> None:
        for executed in mark_executed(msg):
            self.unacked_bytes -= charged(executed)  # it ran: it left the buffer
            node = executed.graph
            assert node is not None
            node.deps = []  # no chain of handles kept alive through executed nodes
        graph = self.tx_graph
        while graph and graph[0].graph.executed:  # type: ignore[union-attr]
            graph.popleft()
        if self.rel_queue:
            self._sink.dirty[self._conn] = None  # the graph window may have opened

    def on_lost(self, pkt: SentPacket) -> None:
        """A packet carrying ``pkt.messages`` was declared lost: resend the reliable
        ones that no other packet in flight carries."""
        for msg in pkt.messages:
            msg.copies -= 1
            if msg.state <= SENT and msg.copies == 0:
                self.retx.append(msg)

    def fail_all(self, in_flight: Iterable[SentPacket]) -> None:
        """The connection ended: every message not acknowledged yet failed."""
        self.sent_order.clear()
        for queue in (self.rel_queue, self.unrel_queue, self.retx, self.tx_graph):
            for msg in queue:
                _fail(msg)
            queue.clear()
        for unacked in self.tx_ch_unacked:
            if unacked is not None:
                for msg in unacked:
                    _fail(msg)
                unacked.clear()
        for pkt in in_flight:
            for msg in pkt.messages:
                _fail(msg)
        self.unacked_bytes = 0
        self.queued = 0
        self.unacked_reliable = 0


def buffer_cost(msg: OutMessage) -> int:
    """What an unfragmented reliable message may occupy in the peer's reorder buffer
    (the receiver's own charge: payload, entry, and one entry per dependency)."""
    node = msg.graph
    deps = len(node.deps) if node is not None else 0
    return len(msg.frame) + BUFFER_ENTRY_COST * (1 + deps)


def charged(msg: OutMessage) -> int:
    """What the packet builder charged for a message: nothing for a fragmented one,
    whose fragments the receiver holds in its reassembly budget (bounded by its
    ``max_message_size``), not in its reorder buffer."""
    return buffer_cost(msg) if msg.fragments is None else 0


def _fail(msg: OutMessage) -> None:
    """The connection ended before ``msg`` was acknowledged."""
    if msg.state <= SENT:
        msg.state = FAILED
    parent = msg.parent
    if parent is not None and parent.state <= SENT:
        parent.state = FAILED
