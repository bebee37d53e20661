"""Events the lockstep host and client report; small frozen dataclasses, past tense.

Pull them with ``next_event()`` after every call into the host or client.
Events marked "both" are reported by the host and by every client, so all
sides learn the same facts (the article's CLSTATE idea: pin the blame on the
lagger, everywhere).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass

from rudp.lockstep.messages import LeaveReason, RefuseReason

__all__ = [
    "ClientJoined",
    "ClientLeft",
    "ClientResponsive",
    "ClientUnresponsive",
    "DesyncDetected",
    "Event",
    "FaultReason",
    "GameStarted",
    "HostFaulted",
    "HostResponsive",
    "HostUnresponsive",
    "JoinRefused",
    "Joined",
    "TimeDropped",
    "TurnsExhausted",
    "TurnsReady",
    "split_checksums",
]


@dataclass(frozen=True, slots=True)
class Joined:
    """Client: the host admitted us."""

    client_id: int
    """Our id in this game."""
    roster: tuple[tuple[int, str], ...]
    """Everyone in the game, us included, as ``(client_id, name)``."""


@dataclass(frozen=True, slots=True)
class JoinRefused:
    """Host: a JOIN was turned away. Client: we were (the client then ends)."""

    reason: RefuseReason
    """GAME_STARTED, TOO_MANY_CLIENTS or WRONG_VERSION."""
    name: str = ""
    """Host side: the name the refused peer gave."""


@dataclass(frozen=True, slots=True)
class ClientJoined:
    """Both: a client was admitted (on a client: someone other than us)."""

    client_id: int
    """Its id."""
    name: str
    """The name it gave."""


@dataclass(frozen=True, slots=True)
class ClientLeft:
    """Both: a client is out of the game. On a client, our own id means we were removed."""

    client_id: int
    """Its id (never reused within a game)."""
    reason: LeaveReason
    """LEFT, DISCONNECTED, TIMED_OUT or KICKED."""


@dataclass(frozen=True, slots=True)
class GameStarted:
    """Both: the lobby closed and turns begin."""

    first_turn: int
    """The number of the first NETTURN."""


@dataclass(frozen=True, slots=True)
class TurnsReady:
    """Client: new turns can be taken with ``next_turn()``."""

    last_turn: int
    """The newest turn received so far."""


@dataclass(frozen=True, slots=True)
class ClientUnresponsive:
    """Both: a client has acknowledged no turn for ``unresponsive_after`` seconds."""

    client_id: int
    """The lagger."""


@dataclass(frozen=True, slots=True)
class ClientResponsive:
    """Both: a client flagged unresponsive acknowledged a turn again."""

    client_id: int
    """The former lagger."""


@dataclass(frozen=True, slots=True)
class DesyncDetected:
    """Both: clients reported different checksums for the same turn.

    Reported for the first turn that differs, then again only when a client
    not yet named diverges; later differing turns only count in the host's stats.
    """

    turn: int
    """The turn whose checksums differ."""
    majority: frozenset[int]
    """Clients agreeing on the most common checksum; empty if no group is strictly largest."""
    diverged: frozenset[int]
    """Every other reporting client: the suspects."""
    checksums: tuple[tuple[int, int], ...]
    """Every report for that turn, as ``(client_id, checksum)``."""


@dataclass(frozen=True, slots=True)
class TimeDropped:
    """Host: the turn clock fell more than ``max_catchup`` turns behind and skipped time."""

    turns: int
    """Turn intervals of wall time dropped; the game ran that much slower."""


@dataclass(frozen=True, slots=True)
class HostUnresponsive:
    """Client: no NETTURN from the host for ``unresponsive_after`` seconds."""


@dataclass(frozen=True, slots=True)
class HostResponsive:
    """Client: turns flow again after :class:`HostUnresponsive`."""


@dataclass(frozen=True, slots=True)
class TurnsExhausted:
    """Both: turn ``MAX_TURN`` (2**31 - 1) was sent; the host sends no more turns.

    That is 24.9 days at the smallest ``turn_interval`` (1 ms), 6.8 years at the
    default. The game is over: the host keeps its clients (and still collects
    their checksums) until the application ends the game."""

    last_turn: int
    """The last turn, ``MAX_TURN``."""


class FaultReason(enum.Enum):
    """Why a client gave up on its host (:class:`HostFaulted`)."""

    MALFORMED_MESSAGE = "malformed_message"
    """A message from the host failed to decode or validate. The stream is
    reliable and ordered, so a dropped message (a turn, above all) would leave
    this client stalled or diverged for good."""
    BACKLOG_FULL = "backlog_full"
    """The host sent more turns ahead of the application than an honest one would
    before dropping this client as stalled (``LockstepClient.max_backlog``: from the
    host's WELCOME, at least ``LockstepConfig.max_backlog``)."""
    LIMITS_MISMATCH = "limits_mismatch"
    """The host's ``max_command_size`` or ``max_message_size`` (in WELCOME) exceeds
    ours: it would send turns this client cannot decode."""


@dataclass(frozen=True, slots=True)
class HostFaulted:
    """Client: the host broke the protocol; the client said LEAVE and has ended
    (the asyncio session then closes the connection)."""

    reason: FaultReason


Event = (
    Joined
    | JoinRefused
    | ClientJoined
    | ClientLeft
    | GameStarted
    | TurnsReady
    | ClientUnresponsive
    | ClientResponsive
    | DesyncDetected
    | TimeDropped
    | HostUnresponsive
    | HostResponsive
    | HostFaulted
    | TurnsExhausted
)


def split_checksums(turn: int, checksums: tuple[tuple[int, int], ...]) -> DesyncDetected | None:
    """Group reports by checksum: ``None`` if all agree, else who is in the majority.

    The host has no simulation of its own, so it has no reference checksum; the
    largest group is presumed right only when it is strictly the largest (with
    two players who disagree, nobody can be blamed and both are named).
    """
    counts = Counter(checksum for _, checksum in checksums)
    if len(counts) <= 1:
        return None
    (top, top_n), (_, second_n) = counts.most_common(2)
    majority = (
        frozenset(cid for cid, s in checksums if s == top) if top_n > second_n else frozenset()
    )
    diverged = frozenset(cid for cid, _ in checksums) - majority
    return DesyncDetected(turn, majority, diverged, checksums)
