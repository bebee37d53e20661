"""The receive side: reorder buffers, sequenced modes, reassembly and delivery.

Theory of operation
-------------------
The connection hands ``Receiver`` the message frames of each DATA packet it
accepted (``deliver``), after asking whether the packet may be accepted at all
(``check_fragments`` and ``can_buffer``: a packet is taken whole or refused
unacknowledged, so that none of its messages is lost for good).

- Reliable-ordered messages are delivered per channel in sequence order. One
  that arrives early waits in its channel's reorder buffer (bounded by
  ``Config.recv_buffer_bytes``, each entry charged ``BUFFER_ENTRY_COST`` besides
  its payload) until the gap before it fills; a loss on one channel never holds
  up another. Anything more than ``channel_window`` ahead is an old copy whose
  16-bit number wrapped, and is dropped.
- Sequenced modes keep the newest number delivered per channel and drop anything
  older (unreliable- and reliable-sequenced have a sequence space each).
- Graph messages (reliable-unordered, dependency-ordered) go to the dependency
  graph (``graph.ReceiveGraph``), which runs each once its dependencies ran.
- A fragment of any reliable mode goes through the one reassembly
  (``_reassemble``): its message is keyed by (mode, channel, first sequence
  number), reserves its announced size in the reassembly budget
  (``Config.max_reassembly_bytes``) when its first fragment arrives, and is
  handed on as a whole (``Whole``) when its last one does, to be delivered like
  an unfragmented message of its mode, spanning as many sequence numbers as it
  had fragments. The message every other one waits for (a channel's next, the
  graph's lowest) may exceed the budget by one largest message, so it can always
  complete.

Every delivered message becomes a ``MessageReceived`` in the sink's event queue.

Judgement call: the packet-level window (which packet numbers arrived, for
acknowledgments and duplicate packets) stays with the connection, which checks
it before anything here runs; this module only sees messages.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from rudp import frames
from rudp.config import BUFFER_ENTRY_COST, Config
from rudp.events import MessageReceived
from rudp.frames import FrameExtra
from rudp.graph import ReceiveGraph
from rudp.seqnum import SEQ_MASK, seq_diff
from rudp.wire import (
    GRAPH,
    RELIABLE_ORDERED,
    RELIABLE_SEQUENCED,
    UNRELIABLE,
    UNRELIABLE_SEQUENCED,
    DropReason,
)

if TYPE_CHECKING:
    from rudp.connection import Connection
    from rudp.events import EndpointEvent, Event
    from rudp.stats import ConnectionStats

PARTIAL_COST: Final = 256  # bytes charged per reassembly besides its data and chunk slots
# A message that is not fragmented fits one UDP datagram: a limit at least this large
# can only be broken by a fragment, which ``size_violation`` checks where it is needed.
_LARGEST_PAYLOAD: Final = 65535


class Partial:
    """A fragmented message being reassembled."""

    __slots__ = ("channel", "chunks", "count", "deps", "have", "reserved", "size", "total")

    def __init__(self, count: int, total: int, channel: int) -> None:
        self.reserved = 0
        self.count = count
        self.total = total
        self.channel = channel
        self.chunks: list[bytes | None] = [None] * count
        self.have = 0
        self.size = 0
        self.deps: tuple[int, ...] = ()


def _reservation(more: FrameExtra) -> int:
    """What a fragmented message holds of the reassembly budget: its size, plus its
    bookkeeping, so that many tiny "messages" cannot hold memory for free."""
    return more.total + PARTIAL_COST + 8 * more.parts


class Whole:
    """A reassembled message: ``span`` sequence numbers from ``base``, ``reserved``
    bytes of the reassembly budget held until it is delivered."""

    __slots__ = ("base", "data", "deps", "reserved", "span")

    def __init__(
        self, data: bytes, base: int, span: int, reserved: int, deps: tuple[int, ...]
    ) -> None:
        self.data = data
        self.base = base
        self.span = span
        self.reserved = reserved
        self.deps = deps


# The reorder buffer of every channel that has nothing buffered: never written (the
# two places that buffer a message give the channel a dict of its own first), so an
# idle connection's 32 channels share one empty dict instead of holding 32.
NO_BUFFER: Final[dict[int, bytes | Whole]] = {}


class Receiver:
    """Reorder buffers, sequenced modes, reassembly and delivery of one connection."""

    __slots__ = (
        "_byte_window",
        "_channels",
        "_conn",
        "_events",
        "_max_fragments",
        "_max_message",
        "_max_reassembly",
        "_stats",
        "_window",
        "buffered",
        "ch_buf",
        "ch_next",
        "graph",
        "parts",
        "reassembly_bytes",
        "rseq_floor",
        "rseq_last",
        "useq_last",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self,
        conn: Connection,
        events: deque[tuple[Connection | None, Event | EndpointEvent]],
        stats: ConnectionStats,
        config: Config,
    ) -> None:
        self._conn = conn
        self._events = events
        self._stats = stats
        self._channels = config.channels
        self._window = config.channel_window
        self._byte_window = config.recv_buffer_bytes
        self._max_message = max(1, config.max_message_size)  # as stated (TransportParams.of)
        self._max_reassembly = config.max_reassembly_bytes
        self._max_fragments = config.max_fragments
        self.graph = ReceiveGraph(conn, events, config.channel_window)
        self.ch_next = [0] * config.channels
        self.ch_buf: list[dict[int, bytes | Whole]] = [NO_BUFFER] * config.channels
        self.buffered = 0  # reorder-buffer bytes of the channels (see buffered_bytes)
        self.useq_last = [-1] * config.channels  # newest sequenced number delivered
        self.rseq_last = [-1] * config.channels
        self.rseq_floor = [0] * config.channels  # base of the newest message started
        self.parts: dict[tuple[int, int, int], Partial] = {}
        self.reassembly_bytes = 0  # budget held by messages being reassembled or buffered

    @property
    def buffered_bytes(self) -> int:
        """What the receive buffer holds: early messages and waiting graph messages."""
        return self.buffered + self.graph.buffered

    @property
    def reserved_bytes(self) -> int:
        """What the reassembly budget holds, wherever the messages wait."""
        return self.reassembly_bytes + self.graph.reserved

    # -- accepting a packet --------------------------------------------------------------

    def can_buffer(self, messages: list[frames.MessageFrame], size: int) -> bool:
        """Whether the packet's early reliable messages fit the reorder buffer.

        A packet is accepted whole or not at all: acknowledging it while dropping a
        message in it would lose that message for good. Each buffered message is
        charged ``BUFFER_ENTRY_COST`` on top of its payload, so empty messages
        cannot fill the buffer with entries for free. The common case, a packet
        that fits even if every message in it were early, is decided at once.
        """
        limit = self._byte_window
        graph = self.graph
        buffered = self.buffered + graph.buffered
        if buffered + size + BUFFER_ENTRY_COST * len(messages) <= limit:
            return True
        # Replay the packet's in-order deliveries: a message right behind one that
        # is delivered is not buffered, and buffered ones it releases free space.
        # Counting them as early would refuse, forever, the very packet that
        # unblocks the channel.
        extra = 0
        # (channel, first seq, span, cost if buffered): replayed in sequence order per
        # channel, since a message later in the packet may release earlier ones.
        ordered: list[tuple[int, int, int, int]] = []
        seen: set[int] = set()  # graph ids of the packet: a copy in it counts once
        for mode, channel, seq16, payload, more in messages:
            if mode == GRAPH:
                if more is not None and more.parts:
                    continue
                low = graph.low
                gid = low + seq_diff(seq16, low & SEQ_MASK)
                if gid in seen or graph.known(gid):
                    continue  # a copy of one already here: it costs nothing
                seen.add(gid)
                if more is not None and graph.pending(more.deps):
                    # It may wait for its dependencies (see ReceiveGraph.arrive's cost).
                    extra += len(payload) + BUFFER_ENTRY_COST * (1 + len(more.deps))
                else:
                    extra -= graph.releases(gid)
                continue
            if mode != RELIABLE_ORDERED:
                continue
            expected = self.ch_next[channel]
            if more is not None and more.parts:
                # Held in the reassembly budget; but the last missing fragment of a
                # message completes it, and it may be the one the channel waits for.
                key = self._fragment_key(mode, channel, seq16, more.part)
                part = self.parts.get(key) if key is not None else None
                if (
                    part is not None
                    and part.have == part.count - 1
                    and part.chunks[more.part] is None
                ):
                    ordered.append((channel, key[2], part.count, 0))  # type: ignore[index]
                continue
            ahead = self._ahead(seq16, expected)
            if ahead == 0 or (ahead > 0 and expected + ahead not in self.ch_buf[channel]):
                ordered.append((channel, expected + ahead, 1, len(payload) + BUFFER_ENTRY_COST))
        ordered = sorted(set(ordered))  # a message can be in a packet twice (redundancy)
        running: dict[int, int] = {}
        for channel, seq, span, cost in ordered:
            expected = running.get(channel, self.ch_next[channel])
            if seq > expected:
                extra += cost
            elif seq == expected:
                expected += span
                buf = self.ch_buf[channel]
                while expected in buf:
                    early = buf[expected]
                    if isinstance(early, bytes):
                        extra -= len(early) + BUFFER_ENTRY_COST
                        expected += 1
                    else:
                        expected += early.span
                running[channel] = expected
        return buffered + extra <= limit

    def channel_violation(self, messages: list[frames.MessageFrame]) -> str:
        """Why the packet's messages break the channel count we stated in the handshake,
        or (under a limit small enough for that) the largest message, or "". The
        packet authenticated, so its sender broke the protocol: the
        connection ends (the sender knew the limit, and could never get such a message
        through: dropping it would stall the channel for good)."""
        channels = self._channels
        for m in messages:
            if m[1] >= channels:
                return f"message on channel {m[1]}; this side accepts {channels} channels"
        if self._max_message < _LARGEST_PAYLOAD:  # else no whole message can exceed it
            return self.size_violation(messages)
        return ""

    def size_violation(self, messages: list[frames.MessageFrame]) -> str:
        """Why a message of the packet, or the message a fragment announces, breaks the
        largest message we stated in the handshake, or "". As for channels, the packet
        authenticated and its sender knew the limit: the connection ends (the message
        could never be taken)."""
        limit = self._max_message
        for m in messages:
            more = m[4]
            if more is not None and more.parts and more.total > limit:
                return (
                    f"fragment of a {more.total}-byte message; this side accepts messages"
                    f" of at most {limit} bytes (max_message_size)"
                )
            if more is not None and more.parts > self._window:
                # Consecutive numbers, none taken further ahead than the window: the
                # message could never complete.
                return (
                    f"fragment of a message of {more.parts} fragments; this side takes"
                    f" {self._window} ahead (channel_window)"
                )
            if (more is None or not more.parts) and len(m[3]) > limit:
                return (
                    f"a {len(m[3])}-byte message; this side accepts messages"
                    f" of at most {limit} bytes (max_message_size)"
                )
        return ""

    def check_fragments(self, messages: list[frames.MessageFrame]) -> DropReason | None:
        """Check a packet's fragments before accepting it (all or nothing).

        A fragment that disagrees with the rest of its message is malformed (one
        larger than ``max_message_size`` is ``size_violation``'s). A fragment that
        starts a message reserves its whole size in the reassembly budget; if
        that does not fit, the packet is dropped unacknowledged and will be
        resent, once messages already started have completed and freed room
        (they always can: their room is reserved).
        """
        new_bytes = 0
        head = False
        starting: dict[tuple[int, int, int], tuple[int, int]] = {}
        credited: set[tuple[int, int, int]] = set()
        with_deps: set[tuple[int, int, int]] = set()
        for mode, channel, seq16, payload, more in messages:
            if more is None or not more.parts or channel >= self._channels:
                continue
            if len(payload) > more.total:
                self._stats.fragments_dropped += 1
                return DropReason.MALFORMED
            key = self._fragment_key(mode, channel, seq16, more.part)
            if key is None:
                continue
            part = self.parts.get(key)
            if more.deps and key not in with_deps and (part is None or part.chunks[0] is None):
                with_deps.add(key)
                new_bytes += BUFFER_ENTRY_COST * self.graph.pending_count(more.deps)
            if part is None:
                shape = starting.get(key)
                if shape is None:
                    starting[key] = (more.parts, more.total)
                    new_bytes += _reservation(more)
                    head = head or self._is_head(key)
                    if mode == RELIABLE_SEQUENCED:
                        old = self._older_rs_part(channel, key[2])
                        if old is not None and old not in credited:
                            credited.add(old)
                            new_bytes -= self.parts[old].reserved
                elif shape != (more.parts, more.total):
                    self._stats.fragments_dropped += 1
                    return DropReason.MALFORMED
            elif part.count != more.parts or part.total != more.total:
                self._stats.fragments_dropped += 1
                return DropReason.MALFORMED
        if new_bytes > 0 and self.reserved_bytes + new_bytes > self._budget(head):
            return DropReason.RECV_BUFFER_FULL
        return None

    # -- delivery ------------------------------------------------------------------------

    def deliver(self, messages: list[frames.MessageFrame], now: float) -> bool:
        """Deliver or buffer each message; returns whether any was reliable.

        Stops early if the peer broke the protocol (``graph.violation`` says how).
        """
        conn = self._conn
        events = self._events
        rx_next = self.ch_next
        delivered = 0
        reliable_seen = False
        skip = 0
        for i, (mode, channel, seq16, payload, more) in enumerate(messages):
            if skip:  # taken whole with the first fragment of its message
                skip -= 1
                continue
            if more is None:
                if mode == UNRELIABLE:
                    events.append((conn, MessageReceived(payload, channel, False, UNRELIABLE)))
                    delivered += 1
                    continue
                if mode == RELIABLE_ORDERED:
                    reliable_seen = True
                    expected = rx_next[channel]
                    if seq16 == expected & SEQ_MASK:  # the common case: next in order
                        events.append(
                            (conn, MessageReceived(payload, channel, True, RELIABLE_ORDERED))
                        )
                        delivered += 1
                        if self.parts:
                            self._drop_covered(channel, expected, 1)
                        expected += 1
                        buf = self.ch_buf[channel]
                        if buf:
                            delivered += self._flush_buffered(channel, expected, buf)
                        else:
                            rx_next[channel] = expected
                        continue
                    ahead = self._ahead(seq16, expected)
                    buf = self.ch_buf[channel]
                    if ahead > 0 and expected + ahead not in buf:
                        if buf is NO_BUFFER:
                            buf = self.ch_buf[channel] = {}
                        buf[expected + ahead] = payload
                        self.buffered += len(payload) + BUFFER_ENTRY_COST
                    else:
                        self._stats.duplicate_messages += 1
                    continue
            if mode != UNRELIABLE_SEQUENCED:
                reliable_seen = True
            if mode == GRAPH:
                delivered += self._graph_message(channel, seq16, payload, more, now)
                if self.graph.violation:
                    break
            elif mode == RELIABLE_ORDERED:
                assert more is not None
                skip = self._whole_in_packet(messages, i, more)
                if skip:
                    delivered += self._deliver_in_order(channel, messages, i, skip + 1)
                else:
                    delivered += self._ordered_fragment(channel, seq16, payload, more)
            else:
                delivered += self._sequenced(mode, channel, seq16, payload, more)
        self._stats.messages_received += delivered
        return reliable_seen

    def _whole_in_packet(
        self, messages: list[frames.MessageFrame], i: int, more: FrameExtra
    ) -> int:
        """Whether the reliable-ordered fragment ``messages[i]`` starts a message whose
        every fragment follows it in this packet and which is the next its channel
        delivers, with nothing being reassembled: then it needs no reassembly (a path
        MTU larger than the fragments packs them so). Returns how many fragments
        follow it (``count - 1``), or 0 to take the general path."""
        count = more.parts
        if more.part or self.parts or i + count > len(messages):
            return 0
        channel = messages[i][1]
        seq16 = messages[i][2]
        if seq16 != self.ch_next[channel] & SEQ_MASK:
            return 0
        size = len(messages[i][3])
        for j in range(1, count):
            mode, ch, seq, payload, extra = messages[i + j]
            if (
                mode != RELIABLE_ORDERED
                or ch != channel
                or seq != (seq16 + j) & SEQ_MASK
                or extra is None
                or extra.parts != count
                or extra.part != j
                or extra.total != more.total
            ):
                return 0
            size += len(payload)
        return count - 1 if size == more.total else 0

    def _deliver_in_order(
        self, channel: int, messages: list[frames.MessageFrame], i: int, count: int
    ) -> int:
        """Deliver the message whose ``count`` fragments are ``messages[i:i + count]``
        (see ``_whole_in_packet``); returns how many messages were delivered."""
        data = b"".join([m[3] for m in messages[i : i + count]])
        self._events.append((self._conn, MessageReceived(data, channel, True)))
        base = self.ch_next[channel]
        expected = base + count
        buf = self.ch_buf[channel]
        if buf:
            self._drop_covered(channel, base, count)
            return 1 + self._flush_buffered(channel, expected, buf)
        self.ch_next[channel] = expected
        return 1

    def _ahead(self, seq16: int, expected: int) -> int:
        """How far a reliable message is ahead of the next expected one; -1 if it is
        a duplicate. Within ``channel_window`` only: an honest sender never runs
        further ahead, so anything else is an old copy whose 16-bit number wrapped
        (a long-delayed packet), and unwrapping it would deliver it in place of a
        newer message."""
        ahead = seq_diff(seq16, expected & SEQ_MASK)
        return ahead if 0 <= ahead < self._window else -1

    def _flush_buffered(self, channel: int, expected: int, buf: dict[int, bytes | Whole]) -> int:
        """Deliver the buffered messages that are now in order; returns how many."""
        conn = self._conn
        events = self._events
        n = 0
        while buf:
            early = buf.pop(expected, None)
            if early is None:
                break
            if isinstance(early, bytes):
                self.buffered -= len(early) + BUFFER_ENTRY_COST
                events.append((conn, MessageReceived(early, channel, True, RELIABLE_ORDERED)))
                span = 1
            else:
                self.reassembly_bytes -= early.reserved
                events.append((conn, MessageReceived(early.data, channel, True, RELIABLE_ORDERED)))
                span = early.span
            if span > 1 or self.parts:
                self._drop_covered(channel, expected, span)
            expected += span
            n += 1
        self.ch_next[channel] = expected
        return n

    def _drop_covered(self, channel: int, base: int, span: int) -> None:
        """The message of ``span`` numbers from ``base`` was delivered: whatever else
        claims one of those numbers (an early message or a message being reassembled,
        only from a sender whose messages overlap) can never be delivered, and gives
        its room back. Costs its span, which the message's fragments paid for."""
        buf = self.ch_buf[channel]
        if buf:
            for seq in range(base + 1, base + span):
                early = buf.pop(seq, None)
                if early is None:
                    continue
                self._stats.duplicate_messages += 1
                if isinstance(early, bytes):
                    self.buffered -= len(early) + BUFFER_ENTRY_COST
                else:
                    self.reassembly_bytes -= early.reserved
        parts = self.parts
        if parts:
            for seq in range(base, base + span):
                part = parts.pop((RELIABLE_ORDERED, channel, seq), None)
                if part is not None:
                    self._stats.fragments_dropped += part.have
                    self.reassembly_bytes -= part.reserved

    def _ordered_fragment(self, channel: int, seq16: int, payload: bytes, more: FrameExtra) -> int:
        whole = self._reassemble(RELIABLE_ORDERED, channel, seq16, payload, more)
        if whole is None:
            return 0
        base = whole.base
        buf = self.ch_buf[channel]
        if base != self.ch_next[channel]:
            if buf is NO_BUFFER:
                buf = self.ch_buf[channel] = {}
            buf[base] = whole  # complete, but earlier messages are still missing
            return 0
        self.reassembly_bytes -= whole.reserved
        self._events.append(
            (self._conn, MessageReceived(whole.data, channel, True, RELIABLE_ORDERED))
        )
        self._drop_covered(channel, base, whole.span)
        return 1 + self._flush_buffered(channel, base + whole.span, buf)

    def _sequenced(
        self, mode: int, channel: int, seq16: int, payload: bytes, more: FrameExtra | None
    ) -> int:
        """Unreliable- and reliable-sequenced: deliver only what is newer than the
        newest delivered on the channel."""
        lasts = self.useq_last if mode == UNRELIABLE_SEQUENCED else self.rseq_last
        last = lasts[channel]
        diff = seq_diff(seq16, (last + 1) & SEQ_MASK)
        if diff < 0:
            self._stats.stale_messages += 1
            return 0
        if more is not None and more.parts:
            whole = self._reassemble(mode, channel, seq16, payload, more)
            if whole is None:
                return 0
            self.reassembly_bytes -= whole.reserved
            payload = whole.data
            newest = whole.base + whole.span - 1
        else:
            newest = last + 1 + diff
        lasts[channel] = newest
        if self.parts and mode == RELIABLE_SEQUENCED:
            self._drop_superseded_parts(channel, newest)
        self._events.append(
            (self._conn, MessageReceived(payload, channel, mode == RELIABLE_SEQUENCED, mode))
        )
        return 1

    def _drop_superseded_parts(self, channel: int, newest: int) -> None:
        """An incomplete reliable-sequenced message older than one delivered is moot."""
        key = self._older_rs_part(channel, newest + 1)
        if key is not None:
            self.reassembly_bytes -= self.parts.pop(key).reserved

    def _graph_message(
        self, channel: int, seq16: int, payload: bytes, more: FrameExtra | None, now: float
    ) -> int:
        """A reliable-unordered or dependency-ordered message (or fragment) arrived."""
        graph = self.graph
        if more is not None and more.parts:
            whole = self._reassemble(GRAPH, channel, seq16, payload, more)
            if whole is None:
                return 0
            self.reassembly_bytes -= whole.reserved  # the graph holds it from here
            if not self.parts:
                return graph.arrive(
                    whole.base, whole.span, whole.data, whole.deps, channel, whole.reserved, now
                )
            graph.ran = []
            n = graph.arrive(
                whole.base, whole.span, whole.data, whole.deps, channel, whole.reserved, now
            )
            self._ran()
            return n
        low = graph.low
        diff = seq_diff(seq16, low & SEQ_MASK)
        gid = low + diff
        if not 0 <= diff < self._window or gid in graph.done or gid in graph.nodes:
            self._stats.duplicate_messages += 1
            return 0
        deps = more.deps if more is not None else ()
        if not self.parts:
            return graph.arrive(gid, 1, payload, deps, channel, 0, now)
        graph.ran = []
        n = graph.arrive(gid, 1, payload, deps, channel, 0, now)
        self._ran()
        return n

    def _ran(self) -> None:
        """Graph messages ran (``graph.ran`` says which): a message being reassembled at
        one of their ids (only from a sender whose messages overlap) can never complete
        now, and gives its room back, as on an ordered channel (``_drop_covered``)."""
        ran = self.graph.ran
        assert ran is not None
        self.graph.ran = None
        parts = self.parts
        for gid, span in ran:
            for seq in range(gid, gid + span):
                part = parts.pop((GRAPH, 0, seq), None)
                if part is not None:
                    self._stats.fragments_dropped += part.have
                    self.reassembly_bytes -= part.reserved

    # -- reassembly ----------------------------------------------------------------------

    def _reassemble(
        self, mode: int, channel: int, seq16: int, payload: bytes, more: FrameExtra
    ) -> Whole | None:
        """Add a fragment of any mode to its message; the whole message once its last
        fragment is in, else None (a copy of a delivered message is counted)."""
        key = self._fragment_key(mode, channel, seq16, more.part)
        if key is None:
            if mode in (RELIABLE_ORDERED, GRAPH):
                self._stats.duplicate_messages += 1
            else:  # sequenced: older than the newest delivered
                self._stats.stale_messages += 1
            return None
        return self._assemble(key, payload, more, channel)

    def _fragment_key(
        self, mode: int, channel: int, seq16: int, index: int
    ) -> tuple[int, int, int] | None:
        """The reassembly key (mode, channel, first sequence number) of a fragment, or
        None if its message was already delivered (a duplicate or a stale copy)."""
        if mode == RELIABLE_ORDERED:
            expected = self.ch_next[channel]
            ahead = self._ahead(seq16, expected)
            base = expected + ahead - index
            if ahead < 0 or base < expected or base in self.ch_buf[channel]:
                return None
            return (mode, channel, base)
        if mode == GRAPH:
            graph = self.graph
            low = graph.low
            diff = seq_diff(seq16, low & SEQ_MASK)
            base = low + diff - index
            if not 0 <= diff < self._window or base < low:
                return None
            if base in graph.nodes or low + diff in graph.done:
                return None
            return (mode, 0, base)
        last = self.rseq_last[channel]
        diff = seq_diff(seq16, (last + 1) & SEQ_MASK)
        base = last + 1 + diff - index
        if diff < 0 or base <= last or base < self.rseq_floor[channel]:
            return None
        return (mode, channel, base)

    def _budget(self, head: bool) -> int:
        """The reassembly budget; one more largest message for the message every
        other one waits for, which can always complete and be delivered."""
        if not head:
            return self._max_reassembly
        return self._max_reassembly + self._max_message + PARTIAL_COST + 8 * self._max_fragments

    def _is_head(self, key: tuple[int, int, int]) -> bool:
        mode, channel, base = key
        if mode == RELIABLE_ORDERED:
            return base == self.ch_next[channel]
        if mode == GRAPH:
            return base == self.graph.low
        return True  # reliable-sequenced: delivered as soon as it completes

    def _older_rs_part(self, channel: int, base: int) -> tuple[int, int, int] | None:
        """The incomplete reliable-sequenced message of ``channel`` older than ``base``,
        if any. A channel has at most one: starting a message drops the older ones
        and raises ``rseq_floor`` to its first number, below which none starts, so
        the one left is the one that starts at the floor (a lookup, not a search)."""
        key = (RELIABLE_SEQUENCED, channel, self.rseq_floor[channel])
        return key if key[2] < base and key in self.parts else None

    def _assemble(
        self, key: tuple[int, int, int], payload: bytes, more: FrameExtra, channel: int
    ) -> Whole | None:
        """Add a fragment; the whole message once the last one is in, else None."""
        parts = self.parts
        part = parts.get(key)
        # A dependency list (on the first fragment of a graph message) is charged an
        # entry per dependency it will wait for, as a message that is not fragmented.
        deps_cost = 0
        if more.deps and (part is None or part.chunks[0] is None):
            deps_cost = BUFFER_ENTRY_COST * self.graph.pending_count(more.deps)
        if part is None:
            reserved = _reservation(more) + deps_cost
            if key[0] == RELIABLE_SEQUENCED:
                old = self._older_rs_part(channel, key[2])
                if old is not None:
                    self.reassembly_bytes -= parts.pop(old).reserved
                self.rseq_floor[channel] = key[2]
            if self.reserved_bytes + reserved > self._budget(self._is_head(key)):
                # Not reserved by check_fragments (it was outside the window then):
                # only a hostile peer sends that.
                self._stats.fragments_dropped += 1
                return None
            part = parts[key] = Partial(more.parts, more.total, channel)
            part.reserved = reserved
            self.reassembly_bytes += reserved
        elif part.count != more.parts or part.total != more.total:
            self._stats.fragments_dropped += 1
            return None
        elif part.chunks[more.part] is not None:
            self._stats.duplicate_messages += 1
            return None
        elif deps_cost:
            part.reserved += deps_cost
            self.reassembly_bytes += deps_cost
        part.chunks[more.part] = payload
        part.have += 1
        part.size += len(payload)
        if more.part == 0:
            part.deps = more.deps
        if part.have < part.count and part.size < part.total:
            return None
        del parts[key]
        if part.have < part.count or part.size != part.total:
            # The sizes of the fragments do not add up to the announced total.
            self.reassembly_bytes -= part.reserved
            self._stats.fragments_dropped += part.have
            return None
        data = b"".join(part.chunks)  # type: ignore[arg-type]
        return Whole(data, key[2], part.count, part.reserved, part.deps)

    def clear(self) -> None:
        """The connection ended: drop everything buffered or half reassembled."""
        self.ch_buf = [NO_BUFFER] * self._channels
        self.buffered = 0
        self.graph.clear()
        self.parts.clear()
        self.reassembly_bytes = 0
