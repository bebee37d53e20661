"""The lockstep host: a sans-IO state machine that paces turns and referees checksums.

Theory of operation
-------------------
This is the article's client-server lockstep. The host runs no simulation; it
is the clock and the referee. (A playing host runs a :class:`LockstepClient`
in-process and talks to its own host through a local peer id.)

* **Lobby.** Peers JOIN; the host admits them (WELCOME to the joiner, JOINED to
  the rest) until ``max_clients`` (then REFUSED TOO_MANY_CLIENTS). A version
  mismatch gets WRONG_VERSION. :meth:`start` closes the lobby and sends START;
  later JOINs get GAME_STARTED (late join would need a state snapshot, which
  lockstep cannot produce without the application).
* **Turns.** A :class:`TurnClock` ticks every ``turn_interval``. Each tick
  bundles every command scheduled for the next turn number into one NETTURN
  and sends it to every client, whether or not anyone has acknowledged older
  turns: the slowest player never holds the others back. Clients target a
  turn ``input_delay`` ahead; a command that arrives after its turn was sent
  runs in the next unsent turn instead (counted as ``late_commands``).
* **Acknowledgements.** Each client answers every NETTURN, in order, with a
  DONETURN carrying a checksum of its simulation state after that turn. When
  all clients that were in the game at send time have answered turn N (or
  left), the checksums are compared; any difference is a desync, reported once
  per newly diverging client, starting from the first differing turn.
* **Laggers.** A client is *stalled* while it has unacknowledged turns; stalled
  since ``max(last acknowledgement, send time of its oldest unacknowledged
  turn)``. Past ``unresponsive_after`` everyone is told (CLSTATE); past
  ``drop_after`` it is dropped (LEFT, TIMED_OUT) and its peer listed in
  :meth:`peers_to_close`. Leaving, kicking and transport loss take the same path.
* **Hanging up.** A peer refused, or removed other than by transport loss, is
  listed in :meth:`peers_to_close` once and then barred: whatever it sends
  until :meth:`peer_disconnected` is dropped unread (``unexpected``), so a JOIN
  already in flight behind a LEAVE is not admitted again.

Every entry point takes ``now``; :meth:`get_timer` gives the one deadline to
wake at and :meth:`handle_timer` acts on it. Output is pulled: messages with
:meth:`messages_to_send`, events with :meth:`next_event`, peers to hang up on
with :meth:`peers_to_close`. Bad input is dropped and counted in :attr:`stats`.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rudp.errors import LocalProtocolError
from rudp.lockstep import messages as m
from rudp.lockstep.clock import TurnClock
from rudp.lockstep.config import (
    MAX_CLIENTS_LIMIT,
    MAX_TURN,
    NETTURN_OVERHEAD,
    PROTOCOL_VERSION,
    LockstepConfig,
    command_overhead,
)
from rudp.lockstep.events import (
    ClientJoined,
    ClientLeft,
    ClientResponsive,
    ClientUnresponsive,
    Event,
    GameStarted,
    JoinRefused,
    TimeDropped,
    TurnsExhausted,
    split_checksums,
)

__all__ = ["ClientRecord", "HostState", "HostStats", "LockstepHost"]

log = logging.getLogger(__name__)

P = TypeVar("P", bound=Hashable)


class HostState(enum.Enum):
    LOBBY = "lobby"
    RUNNING = "running"


@dataclass(slots=True)
class HostStats:
    """Counters; every dropped message lands in exactly one of the first three."""

    malformed: int = 0
    """Messages that failed to decode or validate."""
    unexpected: int = 0
    """Well-formed messages that made no sense now (wrong sender, state or turn), and
    any message from a peer refused or removed whose connection has not ended yet."""
    refused_commands: int = 0
    """Commands beyond ``max_command_lead`` or ``max_pending_commands``."""
    late_commands: int = 0
    """Commands whose turn was already sent; they ran in the next turn."""
    deferred_commands: int = 0
    """Commands moved to a later turn because a NETTURN was full (``max_message_size``)."""
    desynced_turns: int = 0
    """Turns whose checksums differed (reported or not)."""
    dropped_turns: int = 0
    """Turn intervals of wall time the clock dropped (see :class:`TimeDropped`)."""
    ignored: int = 0
    """Messages on other channels, ignored by the asyncio server."""


@dataclass(slots=True)
class ClientRecord(Generic[P]):
    """What the host knows of one admitted client (read-only for callers)."""

    client_id: int
    peer: P
    name: str
    acked: int = -1
    """Newest turn acknowledged (turns are acknowledged strictly in order)."""
    last_ack_at: float = 0.0
    """When it last acknowledged a turn (or joined, or the game started)."""
    unresponsive: bool = False
    pending_commands: int = 0
    """Commands it has queued for turns not yet sent."""


@dataclass(slots=True)
class _TurnReports:
    """Checksums for one sent turn, until every expected client reported or left."""

    sent_at: float
    expected: set[int]
    checksums: dict[int, int] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.expected <= self.checksums.keys()


class LockstepHost(Generic[P]):
    """Host-authoritative lockstep; peers are any hashable ids the caller chooses."""

    def __init__(self, *, config: LockstepConfig | None = None) -> None:
        self.config = config or LockstepConfig()
        self.state = HostState.LOBBY
        self.stats = HostStats()
        self.clock = TurnClock(self.config.turn_interval, max_catchup=self.config.max_catchup)
        self.next_turn = 0
        """The number the next NETTURN will carry."""
        self._clients: dict[int, ClientRecord[P]] = {}
        self._by_peer: dict[P, int] = {}
        self._scheduled: dict[int, list[tuple[int, bytes]]] = {}
        self._first_packed = -1
        """The client whose command went first in the last NETTURN with commands."""
        self._reports: dict[int, _TurnReports] = {}
        self._blamed: set[int] = set()
        self._outbox: list[tuple[P, bytes]] = []
        self._to_close: list[P] = []
        self._closing: set[P] = set()
        """Peers listed to close whose connection has not ended yet: barred."""
        self._events: deque[Event] = deque()

    def __repr__(self) -> str:
        return (
            f"<LockstepHost {self.state.name.lower()} next_turn={self.next_turn} "
            f"clients={len(self._clients)}>"
        )

    # ------------------------------------------------------------------ pulled outputs

    @property
    def clients(self) -> Mapping[int, ClientRecord[P]]:
        """Admitted clients by id."""
        return self._clients

    def messages_to_send(self) -> list[tuple[P, bytes]]:
        """Messages to send reliably and in order, as ``(peer, data)``; clears the queue."""
        out, self._outbox = self._outbox, []
        return out

    def peers_to_close(self) -> list[P]:
        """Peers whose connection should be closed once their messages are sent."""
        out, self._to_close = self._to_close, []
        return out

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        """The next time :meth:`handle_timer` has work to do, or ``None``."""
        deadlines = [d for d in (self.clock.deadline,) if d is not None]
        for client in self._clients.values():
            stalled = self._stalled_since(client)
            if stalled is not None:
                progress_since, lag_since = stalled
                deadlines.append(lag_since + self.config.drop_after)
                if not client.unresponsive:
                    deadlines.append(progress_since + self.config.unresponsive_after)
        return min(deadlines, default=None)

    # ------------------------------------------------------------------ inputs

    def start(self, now: float) -> None:
        """Close the lobby and start sending turns (the first one interval from now)."""
        if not isinstance(now, (int, float)) or isinstance(now, bool):
            raise TypeError(f"now must be a number, not {type(now).__name__}")
        if not math.isfinite(now):
            raise ValueError("now must be finite")  # every turn deadline counts from it
        if self.state is not HostState.LOBBY:
            raise LocalProtocolError("the game has already started")
        self.state = HostState.RUNNING
        self.clock.start(now)
        for client in self._clients.values():
            client.last_ack_at = now
            client.acked = self.next_turn - 1  # nothing owed before the first turn
        self._broadcast(m.Start(self.next_turn))
        self._events.append(GameStarted(self.next_turn))

    def kick(self, client_id: int, now: float) -> None:
        """Remove a client (it is told LEFT/KICKED, then its peer is listed to close)."""
        if type(client_id) is not int:
            # True == 1 and 1.0 == 1 would find client 1 and send a LEFT nobody can decode.
            raise TypeError(f"client_id must be an int, not {type(client_id).__name__}")
        if client_id not in self._clients:
            raise LocalProtocolError(f"no client {client_id}")
        self._remove(client_id, m.LeaveReason.KICKED, now)

    def peer_disconnected(self, peer: P, now: float) -> None:
        """The transport lost ``peer``; harmless for unknown peers. Call it for every
        connection that ends, including those listed by :meth:`peers_to_close`."""
        self._closing.discard(peer)
        client_id = self._by_peer.get(peer)
        if client_id is not None:
            self._remove(client_id, m.LeaveReason.DISCONNECTED, now)

    def receive(self, peer: P, data: bytes, now: float) -> None:
        """Handle one message from ``peer``. Never raises on bad input."""
        if peer in self._closing:
            # Refused or removed, its close under way: nothing it says counts now.
            self.stats.unexpected += 1
            return
        try:
            msg = m.decode(data, self.config)
        except m.MalformedMessage as exc:
            self.stats.malformed += 1
            log.debug("malformed_message peer=%r reason=%r", peer, str(exc))
            return
        client_id = self._by_peer.get(peer)
        if client_id is None:
            if isinstance(msg, m.Join):
                self._on_join(peer, msg, now)
            else:
                self._unexpected(peer, msg)
            return
        match msg:
            case m.Command():
                self._on_command(self._clients[client_id], msg)
            case m.DoneTurn():
                self._on_done_turn(self._clients[client_id], msg, now)
            case m.Leave():
                self._remove(client_id, m.LeaveReason.LEFT, now)
            case _:
                self._unexpected(peer, msg)

    def handle_timer(self, now: float) -> None:
        """Send due turns and act on stalled clients."""
        if self.state is HostState.RUNNING:
            ticks, dropped = self.clock.advance(now)
            for _ in range(ticks):
                self._send_turn(now)
                if self.next_turn > MAX_TURN:
                    # Turn numbers end here (the wire caps them): stop, and say so.
                    self.clock.stop()
                    self._events.append(TurnsExhausted(MAX_TURN))
                    log.info("turns_exhausted last_turn=%d", MAX_TURN)
                    break
            if dropped:
                self.stats.dropped_turns += dropped
                self._events.append(TimeDropped(dropped))
        self._check_stalled(now)

    # ------------------------------------------------------------------ joining

    def _on_join(self, peer: P, msg: m.Join, now: float) -> None:
        reason = self._refusal(msg)
        if reason is not None:
            self._send(peer, m.Refused(reason))
            self._hang_up(peer)
            self._events.append(JoinRefused(reason, msg.name))
            return
        # Joins happen only in the lobby, where the lowest free id is reused: the
        # ordered stream delivers a LEFT before the JOINED that reuses its id, and
        # a host that never reused ids would refuse everyone after 128 joins.
        client_id = next(i for i in range(MAX_CLIENTS_LIMIT) if i not in self._clients)
        client = ClientRecord(client_id, peer, msg.name, last_ack_at=now)
        roster = tuple((c.client_id, c.name) for c in self._clients.values())
        self._broadcast(m.Joined(client.client_id, client.name))
        self._clients[client.client_id] = client
        self._by_peer[peer] = client.client_id
        welcome = m.Welcome(
            client.client_id,
            self.config.turn_interval,
            self.config.input_delay,
            (*roster, (client.client_id, client.name)),
            self.config.max_command_size,
            self.config.max_message_size,
            self.config.drop_after,
            self.config.max_catchup,
        )
        self._send(peer, welcome)
        self._events.append(ClientJoined(client.client_id, client.name))

    def _refusal(self, msg: m.Join) -> m.RefuseReason | None:
        if msg.protocol != PROTOCOL_VERSION or msg.game_version != self.config.game_version:
            return m.RefuseReason.WRONG_VERSION
        if self.state is not HostState.LOBBY:
            return m.RefuseReason.GAME_STARTED
        if len(self._clients) >= self.config.max_clients:
            return m.RefuseReason.TOO_MANY_CLIENTS
        return None

    # ------------------------------------------------------------------ commands and turns

    def _on_command(self, client: ClientRecord[P], msg: m.Command) -> None:
        if self.state is not HostState.RUNNING:
            self._unexpected(client.peer, msg)
            return
        turn = msg.turn
        if turn > self.next_turn + self.config.max_command_lead or (
            client.pending_commands >= self.config.max_pending_commands
        ):
            self.stats.refused_commands += 1
            return
        if turn < self.next_turn:
            # Already sent: run it as soon as possible rather than lose it.
            self.stats.late_commands += 1
            turn = self.next_turn
        self._scheduled.setdefault(turn, []).append((client.client_id, msg.data))
        client.pending_commands += 1

    def _send_turn(self, now: float) -> None:
        turn = self.next_turn
        self.next_turn += 1
        commands, deferred = self._pack(self._scheduled.pop(turn, []))
        if deferred:
            # Too many to fit one message: the rest go first in the next turn.
            self.stats.deferred_commands += len(deferred)
            self._scheduled[turn + 1] = deferred + self._scheduled.get(turn + 1, [])
        for client_id, _ in commands:
            self._clients[client_id].pending_commands -= 1
        self._broadcast(m.NetTurn(turn, tuple(commands)))
        if self._clients:  # with nobody to answer there is nothing to compare
            self._reports[turn] = _TurnReports(now, set(self._clients))

    def _pack(
        self, commands: list[tuple[int, bytes]]
    ) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """Split into what fits one NETTURN and what must wait.

        Clients take turns, one command each, so a client flooding commands
        cannot push everyone else's out of the turn; each client's own order is
        kept. A client whose next command does not fit waits for the next turn
        while the others' commands that still fit go on. The client that goes
        first moves on each turn, cyclically by id, so a client whose commands
        fill a whole NETTURN cannot keep another's out for more than as many
        turns as there are clients.
        """
        queues: dict[int, deque[bytes]] = {}
        for client_id, data in commands:
            queues.setdefault(client_id, deque()).append(data)
        start = self._first_packed + 1
        order = sorted(queues, key=lambda client_id: (client_id - start) % MAX_CLIENTS_LIMIT)
        if order:
            self._first_packed = order[0]
        budget = self.config.max_message_size - NETTURN_OVERHEAD
        taken: list[tuple[int, bytes]] = []
        active = order
        while active:
            still: list[int] = []
            for client_id in active:
                queue = queues[client_id]
                cost = len(queue[0]) + command_overhead(len(queue[0]))
                if cost > budget:
                    continue  # it waits for the next turn; smaller commands may still fit
                budget -= cost
                taken.append((client_id, queue.popleft()))
                if queue:
                    still.append(client_id)
            active = still
        return taken, [(c, d) for c in order for d in queues[c]]

    def _on_done_turn(self, client: ClientRecord[P], msg: m.DoneTurn, now: float) -> None:
        if msg.turn != client.acked + 1 or msg.turn >= self.next_turn:
            self._unexpected(client.peer, msg)  # DONETURNs come in order, for sent turns
            return
        client.acked = msg.turn
        client.last_ack_at = now
        if client.unresponsive:
            client.unresponsive = False
            self._broadcast(m.StatusChanged(client.client_id, m.ClientStatus.RESPONSIVE))
            self._events.append(ClientResponsive(client.client_id))
        reports = self._reports.get(msg.turn)
        if reports is not None and client.client_id in reports.expected:
            reports.checksums[client.client_id] = msg.checksum
        self._settle_turns()

    # ------------------------------------------------------------------ desync

    def _settle_turns(self) -> None:
        """Compare checksums of complete turns, oldest first.

        Each client acknowledges in order, so turns complete in order and the
        first incomplete turn ends the scan.
        """
        while self._reports:
            turn = next(iter(self._reports))  # dicts keep insertion order: the oldest
            reports = self._reports[turn]
            if not reports.complete:
                return
            del self._reports[turn]
            self._compare(turn, reports)

    def _compare(self, turn: int, reports: _TurnReports) -> None:
        desync = split_checksums(turn, tuple(sorted(reports.checksums.items())))
        if desync is None:
            return
        self.stats.desynced_turns += 1
        if desync.diverged <= self._blamed:
            return  # already reported; a desync never heals by itself
        self._blamed |= desync.diverged
        diverged = ",".join(map(str, sorted(desync.diverged)))
        log.info("desync turn=%d diverged=%s", turn, diverged)
        self._broadcast(m.Desync(turn, desync.checksums))
        self._events.append(desync)

    # ------------------------------------------------------------------ laggers

    def _stalled_since(self, client: ClientRecord[P]) -> tuple[float, float] | None:
        """``(progress_since, lag_since)``, or ``None`` if the client owes no turn.

        ``progress_since``: since when it has acknowledged nothing it owed; this
        flags it unresponsive, and an ack clears the flag, so a client catching up
        after a hiccup does not flap. ``lag_since``: when the oldest turn it owes
        was sent; this drops it. A client acking one turn now and then makes
        progress but falls ever further behind, holding back every other
        client's desync detection; its lag still ends it.
        """
        oldest = self._reports.get(client.acked + 1)
        if client.acked + 1 >= self.next_turn:
            return None
        lag_since = oldest.sent_at if oldest is not None else client.last_ack_at
        return max(client.last_ack_at, lag_since), lag_since

    def _check_stalled(self, now: float) -> None:
        for client in list(self._clients.values()):
            stalled = self._stalled_since(client)
            if stalled is None:
                continue
            progress_since, lag_since = stalled
            # Compare against the same sums get_timer() returns, so waking
            # exactly at a deadline always acts on it.
            if now >= lag_since + self.config.drop_after:
                self._remove(client.client_id, m.LeaveReason.TIMED_OUT, now)
            elif not client.unresponsive and now >= progress_since + self.config.unresponsive_after:
                client.unresponsive = True
                log.info("client_unresponsive client=%d", client.client_id)
                self._broadcast(m.StatusChanged(client.client_id, m.ClientStatus.UNRESPONSIVE))
                self._events.append(ClientUnresponsive(client.client_id))

    def _remove(self, client_id: int, reason: m.LeaveReason, now: float) -> None:
        client = self._clients[client_id]
        left = m.Left(client_id, reason)
        if reason is not m.LeaveReason.DISCONNECTED:
            self._send(client.peer, left)  # tell it why before hanging up
            self._hang_up(client.peer)
        del self._clients[client_id]
        del self._by_peer[client.peer]
        self._broadcast(left)
        self._events.append(ClientLeft(client_id, reason))
        # Its commands for unsent turns (deferred ones included) go with it: a later
        # NETTURN must not carry orders from a player nobody has in the game any more.
        for turn, commands in list(self._scheduled.items()):
            kept = [(cid, data) for cid, data in commands if cid != client_id]
            if kept:
                self._scheduled[turn] = kept
            else:
                del self._scheduled[turn]
        for reports in self._reports.values():
            reports.expected.discard(client_id)
        self._settle_turns()  # its departure may complete turns it was holding up

    # ------------------------------------------------------------------ plumbing

    def _hang_up(self, peer: P) -> None:
        if peer not in self._closing:
            self._closing.add(peer)
            self._to_close.append(peer)

    def _send(self, peer: P, msg: m.Message) -> None:
        self._outbox.append((peer, m.encode(msg)))

    def _broadcast(self, msg: m.Message) -> None:
        data = m.encode(msg)
        self._outbox.extend((client.peer, data) for client in self._clients.values())

    def _unexpected(self, peer: P, msg: m.Message) -> None:
        self.stats.unexpected += 1
        log.debug("unexpected_message peer=%r type=%s", peer, msg.TYPE.name)
