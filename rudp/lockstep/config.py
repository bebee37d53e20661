"""Every tunable of the lockstep layer, in one frozen dataclass.

The host is authoritative for the pacing values (``turn_interval``,
``input_delay``): it sends them to each client in WELCOME and clients adopt
them, so only the host's copy of those matters. It sends its message limits
(``max_command_size``, ``max_message_size``) too: a client whose own limits
are smaller ends at once (``HostFaulted(LIMITS_MISMATCH)``) rather than
dropping a turn it cannot decode later, and one whose limits are larger
adopts the host's for the commands it sends. The other limits apply on
whichever side receives the message they bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Bumped whenever the message layout changes; JOIN carries it. 2: WELCOME carries
#: the host's max_command_size, max_message_size, drop_after and max_catchup.
PROTOCOL_VERSION = 2
#: Client ids are small integers so they fit one msgpack byte.
MAX_CLIENTS_LIMIT = 128
#: Turn numbers stay below 2**31 (68 years at 1 turn/s): no wraparound to handle.
MAX_TURN = 2**31 - 1
#: Checksums are unsigned 64-bit integers (a truncated hash or a CRC).
MAX_CHECKSUM = 2**64 - 1
#: Player names longer than this many UTF-8 bytes are refused as malformed.
MAX_NAME_LENGTH = 32
#: Game versions longer than this many UTF-8 bytes are refused as malformed.
MAX_GAME_VERSION_LENGTH = 64
#: Worst-case msgpack bytes around the commands of a NETTURN (array, type, turn, list).
NETTURN_OVERHEAD = 16
#: Worst-case msgpack bytes around one command in a NETTURN (pair, client id, bin header)
#: of less than 65,536 bytes; see `command_overhead`.
COMMAND_OVERHEAD = 6


def command_overhead(size: int) -> int:
    """Worst-case msgpack bytes around a command of ``size`` bytes in a NETTURN: a
    command of 65,536 bytes or more has a 5-byte bin header, not 3."""
    return COMMAND_OVERHEAD if size <= 0xFFFF else COMMAND_OVERHEAD + 2


#: Worst-case msgpack bytes of one WELCOME roster or DESYNC entry.
ROSTER_ENTRY_MAX = MAX_NAME_LENGTH + 8
#: Shortest turn interval, and largest ``max_catchup``, a config (and a WELCOME) may have.
MIN_TURN_INTERVAL = 0.001
MAX_CATCHUP_LIMIT = 1000


def backlog_allowance(turn_interval: float, drop_after: float, max_catchup: int) -> int:
    """Most turns a host with these settings sends a client before dropping it as stalled.

    The host drops a client once the oldest turn it owes was sent ``drop_after``
    ago. Turns leave on a fixed grid, ``turn_interval`` apart, at most
    ``max_catchup`` per tick after the host itself fell behind: the burst that
    carried the oldest owed turn, the grid points in the next ``drop_after``
    seconds, and one last burst on the tick that drops the client. One more
    turn covers rounding.
    """
    return math.ceil(drop_after / turn_interval) + 2 * max_catchup + 1


@dataclass(frozen=True, kw_only=True)
class LockstepConfig:
    """Lockstep settings. Times are in seconds, turns are counts of turns."""

    turn_interval: float = 0.1
    """Wall time between NETTURNs. 100 ms (10 turns/s) is the classic RTS figure:
    orders feel immediate enough and the command stream stays tiny."""

    input_delay: int = 2
    """A command issued while the latest received turn is ``t`` is scheduled for
    ``t + input_delay``. Two turns (200 ms) hide a typical Internet one-way
    latency; commands that still arrive late run in the next unsent turn."""

    max_catchup: int = 5
    """Most turns the host's :class:`TurnClock` emits in one tick after falling
    behind; older time is dropped (the game slows down) rather than sending a
    burst that makes every client fall behind too (the "well of despair")."""

    max_clients: int = 8
    """Players admitted before further JOINs get TOOMANYCL."""

    unresponsive_after: float = 2.0
    """A client with unacknowledged turns that has acknowledged nothing for this
    long is flagged unresponsive to everyone (the article's CLSTATE). Clients use
    it too: no NETTURN from the host for this long reports the host unresponsive."""

    drop_after: float = 10.0
    """A client is dropped once the oldest turn it has not acknowledged was sent this
    long ago, even if it acknowledges now and then; the others never wait for it."""

    game_version: str = ""
    """The application's version; a JOIN with a different one gets WRONGVERSION."""

    max_command_size: int = 256
    """Largest single command payload, in bytes. RTS orders are tens of bytes."""

    max_command_lead: int = 64
    """Commands for turns further ahead than this are refused (bounds host memory)."""

    max_pending_commands: int = 256
    """Commands one client may have queued for unsent turns; more are refused."""

    max_message_size: int = 1100
    """Largest lockstep message, either way. Within one datagram
    (``rudp.Connection.max_datagram_payload``, 1176 bytes with the default
    1200-byte datagrams) a turn is never fragmented, so one lost packet never
    delays it behind its other fragments; rudp would fragment a larger one (up to
    ``rudp.Connection.max_message_size``). The host fills each
    NETTURN up to this size and defers the remaining commands to the next
    turn; incoming messages larger than this are dropped unparsed."""

    max_backlog: int = 1000
    """Client: most turns received but not yet completed by the application, at
    least. WELCOME states the host's ``turn_interval``, ``drop_after`` and
    ``max_catchup``, so the client also knows how many turns an honest host
    sends before it drops a stalled client (:func:`backlog_allowance`: 111 at
    the defaults) and holds that many if it is more, counting ``drop_after`` up
    to ``max_backlog_seconds``. A host that sends more ends the client with
    ``HostFaulted(BACKLOG_FULL)``; each turn held costs up to about 16 times
    ``max_message_size`` of memory."""

    max_backlog_seconds: float = 60.0
    """Client: the longest host ``drop_after`` the backlog limit honours. The host
    states its ``drop_after``, so a hostile one could state a huge one to make
    the client hold turns without end; the client counts at most this many
    seconds of turns (at the host's interval, no shorter than 1 ms) beyond
    ``max_backlog``. With a host whose ``drop_after`` is longer, a stall longer
    than this ends the client with ``BACKLOG_FULL`` before the host drops it."""

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, not {type(value).__name__}")
        if not isinstance(self.game_version, str):
            raise TypeError(f"game_version must be a str, not {type(self.game_version).__name__}")
        if len(self.game_version.encode()) > MAX_GAME_VERSION_LENGTH:
            raise ValueError(f"game_version longer than {MAX_GAME_VERSION_LENGTH} UTF-8 bytes")
        if not (
            math.isfinite(self.turn_interval) and MIN_TURN_INTERVAL <= self.turn_interval <= 10.0
        ):
            raise ValueError("turn_interval must be between 0.001 and 10 seconds")
        if not 1 <= self.input_delay <= 1000:
            raise ValueError("input_delay must be between 1 and 1000 turns")
        if not 1 <= self.max_catchup <= MAX_CATCHUP_LIMIT:
            raise ValueError(f"max_catchup must be between 1 and {MAX_CATCHUP_LIMIT}")
        if not 1 <= self.max_clients <= MAX_CLIENTS_LIMIT:
            raise ValueError(f"max_clients must be between 1 and {MAX_CLIENTS_LIMIT}")
        if not 0 < self.unresponsive_after <= self.drop_after:
            raise ValueError("need 0 < unresponsive_after <= drop_after")
        if self.max_command_lead < self.input_delay:
            raise ValueError("max_command_lead must be at least input_delay")
        if not (math.isfinite(self.max_backlog_seconds) and self.max_backlog_seconds >= 0):
            raise ValueError("max_backlog_seconds must be a finite number of seconds, at least 0")
        if min(self.max_command_size, self.max_pending_commands, self.max_backlog) < 1:
            raise ValueError("size limits must be positive")
        command = self.max_command_size + command_overhead(self.max_command_size)
        if command + NETTURN_OVERHEAD > self.max_message_size:
            raise ValueError("max_message_size must fit a NETTURN carrying one largest command")
        if self.max_clients * ROSTER_ENTRY_MAX + NETTURN_OVERHEAD > self.max_message_size:
            raise ValueError("max_message_size must fit a roster of max_clients players")


#: Counts and sizes: a float or a bool here breaks joins or the host's timer later.
_INT_FIELDS = (
    "input_delay",
    "max_catchup",
    "max_clients",
    "max_command_size",
    "max_command_lead",
    "max_pending_commands",
    "max_message_size",
    "max_backlog",
)
#: Times in seconds (ints are fine; bools are not).
_FLOAT_FIELDS = (
    "turn_interval",
    "unresponsive_after",
    "drop_after",
    "max_backlog_seconds",
)
