"""The dependency graph of reliable-unordered and dependency-ordered messages, both
sides of it (as ``seqnum`` holds all of the wraparound arithmetic).

Theory of operation
-------------------
Every graph message takes the next *graph id* of its connection (one sequence
space for both modes, 16 bits on the wire, unwrapped on arrival). A
dependency-ordered message names the ids it depends on; the receiver runs
(delivers) a message as soon as every id it names has run, and makes it wait
otherwise. A reliable-unordered message names none, so it runs on arrival.

The receiver (``ReceiveGraph``) keeps every id below ``low`` as run, the run ids
above it in ``done``, the messages waiting in ``nodes`` (in arrival order, so the
oldest gives the ``dependency_timeout`` deadline) and, for each id still missing,
who waits for it. Running a message releases what waited only for it,
transitively. A dependency on an id at or after the message's own is a protocol
error (it could never run); so is one further back than the window.

The sender keeps its own copy of the graph (``GraphNode`` on each handle), to
send only the dependencies the receiver may not have run yet: a message is
*executed* once it was acknowledged and everything it depended on was executed
too (``mark_executed``). A dependency executed before its dependent goes out is
dropped from the frame (``refresh_deps``), so no id travels that could be
confused with a newer one after the 16-bit id wraps.

Judgement call: the receiver's graph counts its own bytes (``buffered`` for the
messages waiting, ``reserved`` for the reassembly budget of the reassembled ones)
rather than reaching into the receiver's counters; the receiver adds them to its
own when it checks a limit. Each part then owns exactly the state it changes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rudp import frames
from rudp.config import BUFFER_ENTRY_COST
from rudp.events import MessageReceived
from rudp.seqnum import SEQ_MASK, seq_diff
from rudp.wire import GRAPH

if TYPE_CHECKING:
    from rudp.connection import Connection
    from rudp.events import EndpointEvent, Event
    from rudp.sending import OutMessage


class GraphNode:
    """The sender's copy of a dependency-graph node (the seed article's local graph).

    ``executed`` becomes true once the peer must have executed the message: it
    was acknowledged and everything it depended on was executed too. From then
    on, a message that names it as a dependency sends nothing for it, so no
    dependency ever travels that could be confused after the 16-bit id wraps.
    """

    __slots__ = ("dependents", "deps", "executed", "gid", "owner", "waiting")

    def __init__(self, gid: int, owner: object) -> None:
        self.deps: list[OutMessage] = []  # dependencies named in the frame, until executed
        self.gid = gid
        self.owner = owner
        self.waiting = 0  # dependencies not yet executed
        self.executed = False
        self.dependents: list[OutMessage] = []


def mark_executed(msg: OutMessage) -> list[OutMessage]:
    """The peer must have executed ``msg`` (acknowledged, every dependency
    executed): so must every acknowledged message that waited only for it.
    Returns every message found executed, ``msg`` first; the caller drops their
    ``deps`` once it has charged them."""
    executed_now: list[OutMessage] = []
    ready = [msg]
    while ready:
        executed = ready.pop()
        node = executed.graph
        assert node is not None
        node.executed = True
        for successor in node.dependents:
            succ = successor.graph
            assert succ is not None
            succ.waiting -= 1
            if succ.waiting == 0 and successor.acked:
                ready.append(successor)
        node.dependents = []
        executed_now.append(executed)
    return executed_now


def refresh_deps(msg: OutMessage) -> bool:
    """Drop dependencies executed since send(): one executed long ago could lie
    beyond the receiver's window by now. Returns whether the frame changed."""
    parent = msg.parent
    owner = msg if parent is None else parent
    node = owner.graph
    if node is None or not node.deps or (parent is not None and msg.seq != parent.seq):
        return False
    keep = [d for d in node.deps if not d.graph.executed]  # type: ignore[union-attr]
    if len(keep) == len(node.deps):
        return False
    node.deps = keep
    fragment = None if parent is None else (0, len(parent.fragments), len(parent.data))  # type: ignore[arg-type]
    msg.frame = frames.message_frame(
        GRAPH,
        msg.channel,
        msg.seq,
        msg.data,
        deps=tuple(d.seq for d in keep),
        fragment=fragment,
    )
    return True


class Waiting:
    """A received graph message waiting for its dependencies."""

    __slots__ = ("arrived", "channel", "data", "reserved", "rest", "span", "waiting")

    def __init__(
        self,
        data: bytes,
        channel: int,
        span: int,
        reserved: int,
        waiting: int,
        rest: int,
        arrived: float,
    ) -> None:
        self.data = data
        self.channel = channel
        self.span = span
        self.reserved = reserved
        self.waiting = waiting  # dependencies not yet executed
        self.rest = rest  # the sum of their ids: the last one's id once one is left
        self.arrived = arrived


class ReceiveGraph:
    """The receiver's dependency graph: runs each message once its dependencies ran."""

    __slots__ = (
        "_conn",
        "_events",
        "_window",
        "buffered",
        "done",
        "frees",
        "low",
        "nodes",
        "ran",
        "reserved",
        "violation",
        "waiters",
    )
    # Dropped when the connection ends (``Connection._release``): no cycle outlives it.
    __deletable__ = ("_conn",)

    def __init__(
        self,
        conn: Connection,
        events: deque[tuple[Connection | None, Event | EndpointEvent]],
        window: int,
    ) -> None:
        self._conn = conn
        self._events = events
        self._window = window
        # Every id below ``low`` was executed; ``done`` holds executed ids above it,
        # ``nodes`` the messages waiting for dependencies (in arrival order),
        # ``waiters`` who waits for which id, ``frees`` what executing that id would
        # free of the receive buffer (see ``releases``).
        self.low = 0
        self.done: set[int] = set()
        self.nodes: dict[int, Waiting] = {}
        self.waiters: dict[int, list[int]] = {}
        self.frees: dict[int, int] = {}
        self.buffered = 0  # receive-buffer bytes charged for the waiting messages
        self.reserved = 0  # reassembly budget held by reassembled messages not yet run
        self.violation = ""  # what the peer did wrong, if it broke the protocol
        # (id, span) of each message run, while the receiver asks (see Receiver._ran).
        self.ran: list[tuple[int, int]] | None = None

    def known(self, gid: int) -> bool:
        """Whether ``gid`` already ran or is waiting: a copy of it costs nothing."""
        return gid < self.low or gid in self.done or gid in self.nodes

    def pending(self, deps: tuple[int, ...]) -> bool:
        """Whether a message naming ``deps`` would have to wait."""
        low = self.low
        done = self.done
        for dep16 in deps:
            back = seq_diff(dep16, low & SEQ_MASK)
            if back >= 0 and low + back not in done:
                return True
        return False

    def pending_count(self, deps: tuple[int, ...]) -> int:
        """How many of ``deps`` a message naming them would wait for."""
        low = self.low
        done = self.done
        n = 0
        for dep16 in deps:
            back = seq_diff(dep16, low & SEQ_MASK)
            if back >= 0 and low + back not in done:
                n += 1
        return n

    def releases(self, gid: int) -> int:
        """Receive-buffer bytes freed by executing ``gid`` (one level, a lower bound):
        an entry of each message waiting for it, and the whole of each one waiting
        for it alone. Kept up to date as messages wait and run, so that asking costs
        the same however many wait (``Receiver.can_buffer`` asks per message)."""
        return self.frees.get(gid, 0)

    def deadline(self, timeout: float) -> float:
        """When the oldest waiting message has waited ``timeout`` (some must wait)."""
        oldest = next(iter(self.nodes.values()))
        return oldest.arrived + timeout

    def restart_clocks(self, now: float) -> None:
        """Waiting starts again from ``now``: while we were paused we may have refused
        the very dependencies these wait for."""
        for node in self.nodes.values():
            node.arrived = max(node.arrived, now)

    def arrive(
        self,
        gid: int,
        span: int,
        data: bytes,
        deps: tuple[int, ...],
        channel: int,
        reserved: int,
        now: float,
    ) -> int:
        """Run the message if every dependency was executed, else make it wait;
        returns how many messages were delivered. ``reserved`` bytes of the
        reassembly budget move here until the message runs."""
        self.reserved += reserved
        if len(deps) > 1 and len(set(deps)) < len(deps):
            # An honest sender names each dependency once; a repeated one would cost
            # an entry per copy, and its release a walk over them all.
            self.violation = "a message names the same dependency twice"
            return 0
        low = self.low
        done = self.done
        frees = self.frees
        waiting = 0
        rest = 0
        for dep16 in deps:
            back = seq_diff(dep16, low & SEQ_MASK)
            dep = low + back
            if back < -self._window:
                self.violation = "a dependency lies beyond the window"
                return 0
            if dep >= gid:
                self.violation = "a message depends on itself or a later message"
                return 0
            if back < 0 or dep in done:
                continue  # executed already
            self.waiters.setdefault(dep, []).append(gid)
            waiting += 1
            rest += dep
            if not reserved:
                frees[dep] = frees.get(dep, 0) + BUFFER_ENTRY_COST
        if waiting:
            self.nodes[gid] = Waiting(data, channel, span, reserved, waiting, rest, now)
            if not reserved:
                self.buffered += len(data) + BUFFER_ENTRY_COST * (1 + waiting)
                if waiting == 1:
                    frees[rest] += len(data) + BUFFER_ENTRY_COST
            return 0
        return self._execute(gid, span, data, channel, reserved)

    def _execute(self, gid: int, span: int, data: bytes, channel: int, reserved: int) -> int:
        """Deliver a ready message and every waiting message it was the last
        dependency of, transitively; returns how many were delivered."""
        conn = self._conn
        events = self._events
        done = self.done
        nodes = self.nodes
        waiters = self.waiters
        frees = self.frees
        ready: deque[tuple[int, int, bytes, int, int]] = deque()
        ready.append((gid, span, data, channel, reserved))
        n = 0
        while ready:
            gid, span, data, channel, reserved = ready.popleft()
            events.append((conn, MessageReceived(data, channel, True, GRAPH)))
            n += 1
            self.reserved -= reserved
            if self.ran is not None:
                self.ran.append((gid, span))
            if span == 1:
                done.add(gid)
            else:
                done.update(range(gid, gid + span))
            # Every id of a fragmented message ran with it: a message that named one
            # after its first waited for it too (and is released, as it would have
            # run had it come after).
            dep = gid
            end = gid + span
            while dep < end:
                frees.pop(dep, None)
                for successor in waiters.pop(dep, ()):
                    node = nodes[successor]
                    node.waiting -= 1
                    node.rest -= dep
                    if not node.reserved:
                        self.buffered -= BUFFER_ENTRY_COST
                        if node.waiting == 1:  # what is left is waiting for ``rest`` alone
                            frees[node.rest] += len(node.data) + BUFFER_ENTRY_COST
                    if node.waiting == 0:
                        del nodes[successor]
                        if not node.reserved:
                            self.buffered -= len(node.data) + BUFFER_ENTRY_COST
                        ready.append((successor, node.span, node.data, node.channel, node.reserved))
                dep += 1
        low = self.low
        while low in done:
            done.remove(low)
            low += 1
        self.low = low
        return n

    def clear(self) -> None:
        """The connection ended: forget every waiting message."""
        self.nodes.clear()
        self.waiters.clear()
        self.frees.clear()
        self.buffered = 0
        self.reserved = 0
