"""The lockstep client: a sans-IO state machine that hands turns to the simulation in order.

Theory of operation
-------------------
The client sends JOIN as soon as it exists and waits in the lobby once
WELCOMEd. After START, the host streams NETTURNs; the transport is reliable and
ordered, so turn N+1 arriving before N is a protocol error (dropped and
counted). The application drives the simulation by pulling::

    while (turn := client.next_turn()) is not None:
        checksum = simulation.step(turn.number, turn.commands)
        client.complete_turn(turn.number, checksum)

so turns run strictly in order, each exactly once, only when they are here,
and the library never calls application code. :meth:`complete_turn` answers
the host with DONETURN and the checksum; the host compares checksums across
clients and broadcasts a DESYNC naming the turn and the clients that differ.

Commands (:meth:`send_command`) are scheduled ``input_delay`` turns after the
newest turn received, which hides the trip to the host. The host decides the
final turn; a command only takes effect when a NETTURN carries it back, for
every client alike, including its sender.

The simulation must be deterministic: same commands, same order, same
state, on every machine. Floats that differ in the last bit between CPUs or
compilers make clients drift apart (the "Networking Is Hard" seed); use integer
or fixed-point arithmetic and per-entity seeded random generators, and hash the
state for the checksum (e.g. ``int.from_bytes(blake2b(state, digest_size=8).digest())``).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from rudp.errors import LocalProtocolError, as_bytes
from rudp.lockstep import messages as m
from rudp.lockstep.config import (
    MAX_CHECKSUM,
    MAX_NAME_LENGTH,
    MAX_TURN,
    MIN_TURN_INTERVAL,
    PROTOCOL_VERSION,
    LockstepConfig,
    backlog_allowance,
)
from rudp.lockstep.events import (
    ClientJoined,
    ClientLeft,
    ClientResponsive,
    ClientUnresponsive,
    Event,
    FaultReason,
    GameStarted,
    HostFaulted,
    HostResponsive,
    HostUnresponsive,
    Joined,
    JoinRefused,
    TurnsExhausted,
    TurnsReady,
    split_checksums,
)

__all__ = ["ClientState", "ClientStats", "LockstepClient", "Turn"]

log = logging.getLogger(__name__)


class ClientState(enum.Enum):
    JOINING = "joining"
    LOBBY = "lobby"
    RUNNING = "running"
    ENDED = "ended"


@dataclass(slots=True)
class ClientStats:
    """Counters of dropped messages."""

    malformed: int = 0
    """Messages that failed to decode or validate."""
    unexpected: int = 0
    """Well-formed messages that made no sense now (wrong state, turn out of order)."""
    ignored: int = 0
    """Messages on other channels, ignored by the asyncio session."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn to execute."""

    number: int
    """Turn number; consecutive from the game's first turn."""
    commands: tuple[tuple[int, bytes], ...]
    """``(client_id, data)`` in the host's order, which is the same on every client."""


class LockstepClient:
    """One player's end of host-authoritative lockstep."""

    def __init__(self, *, name: str = "", config: LockstepConfig | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        if len(name.encode()) > MAX_NAME_LENGTH:
            raise LocalProtocolError(f"name longer than {MAX_NAME_LENGTH} UTF-8 bytes")
        self.config = config or LockstepConfig()
        self.name = name
        self.state = ClientState.JOINING
        self.stats = ClientStats()
        self.client_id: int | None = None
        self.turn_interval = self.config.turn_interval
        """Adopted from the host's WELCOME."""
        self.input_delay = self.config.input_delay
        """Adopted from the host's WELCOME."""
        self.max_command_size = self.config.max_command_size
        """Ours, or the host's from WELCOME if smaller: larger commands are refused."""
        self.max_backlog = self.config.max_backlog
        """Turns held at most before ``HostFaulted(BACKLOG_FULL)``: ``config.max_backlog``,
        or more if the host's WELCOME says it keeps a stalled client longer (up to
        ``config.max_backlog_seconds`` of its turns)."""
        self.fault: FaultReason | None = None
        """Why the client gave up on the host, if it did (see :class:`HostFaulted`)."""
        self.latest_turn = -1
        """Newest turn received."""
        self.executed_turn = -1
        """Newest turn completed by the application."""
        self.host_unresponsive = False
        self._roster: dict[int, str] = {}
        self._lagging: set[int] = set()
        self._pending: deque[Turn] = deque()
        self._last_heard = 0.0
        self._outbox: list[bytes] = []
        self._events: deque[Event] = deque()
        self._send(m.Join(PROTOCOL_VERSION, self.config.game_version, name))

    def __repr__(self) -> str:
        return (
            f"<LockstepClient {self.name!r} {self.state.name.lower()} id={self.client_id} "
            f"executed_turn={self.executed_turn}>"
        )

    # ------------------------------------------------------------------ pulled outputs

    @property
    def roster(self) -> Mapping[int, str]:
        """Clients in the game (us included) by id, with their names."""
        return self._roster

    @property
    def lagging(self) -> frozenset[int]:
        """Clients the host currently reports unresponsive."""
        return frozenset(self._lagging)

    @property
    def backlog(self) -> int:
        """Turns received but not yet completed: how far behind the host we run."""
        return len(self._pending)

    def messages_to_send(self) -> list[bytes]:
        """Messages for the host, to send reliably and in order; clears the queue."""
        out, self._outbox = self._outbox, []
        return out

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` next has work (host silence check), or ``None``."""
        if self.state is not ClientState.RUNNING or self.host_unresponsive:
            return None
        if self.latest_turn >= MAX_TURN:
            return None  # the last turn came: the host's silence is expected
        return self._last_heard + self.config.unresponsive_after

    # ------------------------------------------------------------------ the application's side

    def next_turn(self) -> Turn | None:
        """The next turn to execute, or ``None`` until it arrives. Returns the
        same turn until :meth:`complete_turn` is called for it."""
        return self._pending[0] if self._pending else None

    def complete_turn(self, number: int, checksum: int) -> None:
        """Report turn ``number`` executed, with a checksum of the resulting state (uint64)."""
        if type(number) is not int:
            # Checked first: 1.0, True or a numpy integer compare equal to the turn but
            # would be sent malformed, or fail to encode once the turn is consumed.
            raise TypeError(f"turn number must be an int, not {type(number).__name__}")
        if not self._pending or self._pending[0].number != number:
            raise LocalProtocolError(f"turn {number} is not the next turn to complete")
        if type(checksum) is not int or not 0 <= checksum <= MAX_CHECKSUM:
            raise LocalProtocolError("checksum must be an int in [0, 2**64)")
        self._pending.popleft()
        self.executed_turn = number
        self._send(m.DoneTurn(number, checksum))

    def send_command(self, data: bytes | bytearray | memoryview) -> int:
        """Queue a command (bytes-like, at most ``max_command_size`` bytes); returns the
        turn it is scheduled for (the host may delay it)."""
        # Measured in bytes (a memoryview's len() counts its items); bytes() would
        # turn a list of ints, or an int, into some other command.
        payload = as_bytes(data, "command")
        if self.state is not ClientState.RUNNING:
            raise LocalProtocolError(f"cannot send commands while {self.state.value}")
        if len(payload) > self.max_command_size:
            raise LocalProtocolError(f"command larger than {self.max_command_size} bytes")
        turn = self.latest_turn + self.input_delay
        if turn > MAX_TURN:
            raise LocalProtocolError("no turn left to schedule a command for")
        self._send(m.Command(turn, payload))
        return turn

    def leave(self) -> None:
        """Tell the host we are leaving; the client then ends."""
        if self.state is ClientState.ENDED:
            raise LocalProtocolError("already ended")
        self._send(m.Leave())
        self.state = ClientState.ENDED

    # ------------------------------------------------------------------ inputs

    def receive(self, data: bytes, now: float) -> None:
        """Handle one message from the host. Never raises on bad input."""
        try:
            msg = m.decode(data, self.config)
        except m.MalformedMessage as exc:
            self.stats.malformed += 1
            log.debug("malformed_message reason=%r", str(exc))
            if self.state is not ClientState.ENDED:
                # Ordered and reliable: whatever it was, we are now out of step.
                self._fail(FaultReason.MALFORMED_MESSAGE)
            return
        if not self._dispatch(msg, now):
            self.stats.unexpected += 1
            log.debug("unexpected_message type=%s state=%s", msg.TYPE.name, self.state.value)

    def handle_timer(self, now: float) -> None:
        """Notice a silent host."""
        deadline = self.get_timer()
        if deadline is not None and now >= deadline:
            self.host_unresponsive = True
            self._events.append(HostUnresponsive())

    # ------------------------------------------------------------------ message handlers

    def _dispatch(self, msg: m.Message, now: float) -> bool:
        """Apply ``msg``; False if it makes no sense in the current state."""
        state = self.state
        match msg:
            case m.Welcome() if state is ClientState.JOINING:
                self._on_welcome(msg)
            case m.Refused() if state is ClientState.JOINING:
                self.state = ClientState.ENDED
                self._events.append(JoinRefused(msg.reason))
            case m.Start() if state is ClientState.LOBBY:
                self._on_start(msg, now)
            case m.NetTurn() if state is ClientState.RUNNING:
                return self._on_netturn(msg, now)
            case m.Joined() if state in (ClientState.LOBBY, ClientState.RUNNING):
                self._roster[msg.client_id] = msg.name
                self._events.append(ClientJoined(msg.client_id, msg.name))
            case m.Left() if state in (ClientState.LOBBY, ClientState.RUNNING):
                self._on_left(msg)
            case m.StatusChanged() if state is ClientState.RUNNING:
                self._on_status(msg)
            case m.Desync() if state is ClientState.RUNNING:
                desync = split_checksums(msg.turn, msg.checksums)
                if desync is None:
                    return False
                self._events.append(desync)
            case _:
                return False
        return True

    def _on_welcome(self, msg: m.Welcome) -> None:
        if (
            msg.max_command_size > self.config.max_command_size
            or msg.max_message_size > self.config.max_message_size
        ):
            self._fail(FaultReason.LIMITS_MISMATCH)
            return
        self.max_command_size = msg.max_command_size
        self.state = ClientState.LOBBY
        self.client_id = msg.client_id
        self.turn_interval = msg.turn_interval
        self.input_delay = msg.input_delay
        # An honest host drops a stalled client after sending it this many turns at
        # most; a hostile one may state any drop_after, so it counts up to our own
        # max_backlog_seconds (and the decoder bounds the interval and catch-up).
        drop_after = min(msg.drop_after, self.config.max_backlog_seconds)
        interval = max(msg.turn_interval, MIN_TURN_INTERVAL)
        honest = backlog_allowance(interval, drop_after, msg.max_catchup)
        self.max_backlog = max(self.config.max_backlog, honest)
        self._roster = dict(msg.roster)
        self._roster.setdefault(msg.client_id, self.name)
        self._events.append(Joined(msg.client_id, tuple(sorted(self._roster.items()))))

    def _on_start(self, msg: m.Start, now: float) -> None:
        self.state = ClientState.RUNNING
        self.latest_turn = self.executed_turn = msg.first_turn - 1
        self._last_heard = now
        self._events.append(GameStarted(msg.first_turn))

    def _on_netturn(self, msg: m.NetTurn, now: float) -> bool:
        if msg.turn != self.latest_turn + 1:
            return False  # the transport is ordered: a gap or repeat is a broken peer
        if len(self._pending) >= self.max_backlog:
            self._fail(FaultReason.BACKLOG_FULL)
            return True
        self.latest_turn = msg.turn
        self._pending.append(Turn(msg.turn, msg.commands))
        self._last_heard = now
        if self.host_unresponsive:
            self.host_unresponsive = False
            self._events.append(HostResponsive())
        self._events.append(TurnsReady(msg.turn))
        if msg.turn == MAX_TURN:
            self._events.append(TurnsExhausted(msg.turn))
        return True

    def _on_left(self, msg: m.Left) -> None:
        self._roster.pop(msg.client_id, None)
        self._lagging.discard(msg.client_id)
        self._events.append(ClientLeft(msg.client_id, msg.reason))
        if msg.client_id == self.client_id:
            self.state = ClientState.ENDED

    def _on_status(self, msg: m.StatusChanged) -> None:
        if msg.status is m.ClientStatus.UNRESPONSIVE:
            self._lagging.add(msg.client_id)
            self._events.append(ClientUnresponsive(msg.client_id))
        else:
            self._lagging.discard(msg.client_id)
            self._events.append(ClientResponsive(msg.client_id))

    def _fail(self, reason: FaultReason) -> None:
        """Give up on the host: say LEAVE, end, and report why."""
        log.info("host_fault reason=%s state=%s", reason.value, self.state.value)
        self._send(m.Leave())
        self.state = ClientState.ENDED
        self.fault = reason
        self._pending.clear()
        self._events.append(HostFaulted(reason))

    def _send(self, msg: m.Message) -> None:
        self._outbox.append(m.encode(msg))
