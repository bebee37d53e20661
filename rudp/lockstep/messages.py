"""Lockstep messages: msgpack arrays with a type code first, validated field by field.

Every message is one msgpack array ``[type, field, ...]``, carried as one
reliable, ordered rudp message. :func:`decode` checks each field's type and
range (``bool`` is never accepted for an integer) and raises
:class:`MalformedMessage` on any defect; the host and client catch it, count it
and drop the message, so a peer can never raise into the caller.

=========  ====  =========  ==============================================  =======================
name       code  direction  fields after the code                          article name
=========  ====  =========  ==============================================  =======================
JOIN       1     c -> h     protocol: int, game_version: str, name: str     JOIN
WELCOME    2     h -> c     client_id, turn_interval: float, input_delay,   SELFCLIENT + ADDCLIENT
                            roster: [[client_id, name], ...],
                            max_command_size, max_message_size,
                            drop_after: float, max_catchup
REFUSED    3     h -> c     reason: RefuseReason                            GAMESTARTED, TOOMANYCL,
                                                                            WRONGVERSION
JOINED     4     h -> c     client_id, name                                 ADDCLIENT
LEFT       5     h -> c     client_id, reason: LeaveReason                  CLIENTLEFT
START      6     h -> c     first_turn                                      MAPSTART
COMMAND    7     c -> h     turn, data: bin                                 PLACEBL, MOVEORDER, ...
NETTURN    8     h -> c     turn, commands: [[client_id, data: bin], ...]   NETTURN
DONETURN   9     c -> h     turn, checksum: uint64                          DONETURN
CLSTATE    10    h -> c     client_id, status: ClientStatus                 CLSTATE
DESYNC     11    h -> c     turn, checksums: [[client_id, checksum], ...]   (none)
LEAVE      12    c -> h     (nothing)                                       DISCONNECT
=========  ====  =========  ==============================================  =======================
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import msgpack

from rudp.lockstep.config import (
    MAX_CATCHUP_LIMIT,
    MAX_CHECKSUM,
    MAX_CLIENTS_LIMIT,
    MAX_GAME_VERSION_LENGTH,
    MAX_NAME_LENGTH,
    MAX_TURN,
    MIN_TURN_INTERVAL,
    LockstepConfig,
)

#: Largest size limit a WELCOME may announce.
MAX_LIMIT = 2**32 - 1

__all__ = [
    "ClientStatus",
    "Command",
    "Desync",
    "DoneTurn",
    "Join",
    "Joined",
    "Leave",
    "LeaveReason",
    "Left",
    "MalformedMessage",
    "Message",
    "MsgType",
    "NetTurn",
    "RefuseReason",
    "Refused",
    "Start",
    "StatusChanged",
    "Welcome",
    "decode",
    "encode",
]


class MsgType(enum.IntEnum):
    JOIN = 1
    WELCOME = 2
    REFUSED = 3
    JOINED = 4
    LEFT = 5
    START = 6
    COMMAND = 7
    NETTURN = 8
    DONETURN = 9
    CLSTATE = 10
    DESYNC = 11
    LEAVE = 12


class RefuseReason(enum.IntEnum):
    """Why the host turned a JOIN away."""

    GAME_STARTED = 1
    """The game is running and late joins are not supported (GAMESTARTED)."""
    TOO_MANY_CLIENTS = 2
    """``max_clients`` are already in (TOOMANYCL)."""
    WRONG_VERSION = 3
    """Protocol or game version differs (WRONGVERSION)."""


class LeaveReason(enum.IntEnum):
    """Why a client is no longer in the game."""

    LEFT = 1
    """It said LEAVE."""
    DISCONNECTED = 2
    """Its transport connection ended."""
    TIMED_OUT = 3
    """It acknowledged no turn for ``drop_after`` seconds."""
    KICKED = 4
    """The host application removed it."""


class ClientStatus(enum.IntEnum):
    """A client's health as seen by the host (CLSTATE)."""

    RESPONSIVE = 0
    UNRESPONSIVE = 1


class MalformedMessage(ValueError):
    """A message failed to decode or validate (internal; always caught)."""


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Join:
    TYPE: ClassVar[MsgType] = MsgType.JOIN
    protocol: int
    game_version: str
    name: str


@dataclass(frozen=True, slots=True)
class Welcome:
    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    client_id: int
    turn_interval: float
    input_delay: int
    roster: tuple[tuple[int, str], ...]
    # The host's limits and drop pacing (LockstepConfig's defaults if not given).
    max_command_size: int = 256
    max_message_size: int = 1100
    drop_after: float = 10.0
    max_catchup: int = 5


@dataclass(frozen=True, slots=True)
class Refused:
    TYPE: ClassVar[MsgType] = MsgType.REFUSED
    reason: RefuseReason


@dataclass(frozen=True, slots=True)
class Joined:
    TYPE: ClassVar[MsgType] = MsgType.JOINED
    client_id: int
    name: str


@dataclass(frozen=True, slots=True)
class Left:
    TYPE: ClassVar[MsgType] = MsgType.LEFT
    client_id: int
    reason: LeaveReason


@dataclass(frozen=True, slots=True)
class Start:
    TYPE: ClassVar[MsgType] = MsgType.START
    first_turn: int


@dataclass(frozen=True, slots=True)
class Command:
    TYPE: ClassVar[MsgType] = MsgType.COMMAND
    turn: int
    data: bytes


@dataclass(frozen=True, slots=True)
class NetTurn:
    TYPE: ClassVar[MsgType] = MsgType.NETTURN
    turn: int
    commands: tuple[tuple[int, bytes], ...]


@dataclass(frozen=True, slots=True)
class DoneTurn:
    TYPE: ClassVar[MsgType] = MsgType.DONETURN
    turn: int
    checksum: int


@dataclass(frozen=True, slots=True)
class StatusChanged:
    TYPE: ClassVar[MsgType] = MsgType.CLSTATE
    client_id: int
    status: ClientStatus


@dataclass(frozen=True, slots=True)
class Desync:
    TYPE: ClassVar[MsgType] = MsgType.DESYNC
    turn: int
    checksums: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Leave:
    TYPE: ClassVar[MsgType] = MsgType.LEAVE


Message: TypeAlias = (
    Join
    | Welcome
    | Refused
    | Joined
    | Left
    | Start
    | Command
    | NetTurn
    | DoneTurn
    | StatusChanged
    | Desync
    | Leave
)


# --------------------------------------------------------------------------- encoding


def encode(msg: Message) -> bytes:
    """Encode one message (the caller built it, so it is trusted to be valid)."""
    fields: list[Any] = [int(msg.TYPE)]
    match msg:
        case Welcome():
            roster = [list(entry) for entry in msg.roster]
            fields += [msg.client_id, float(msg.turn_interval), msg.input_delay, roster]
            fields += [msg.max_command_size, msg.max_message_size]
            fields += [float(msg.drop_after), msg.max_catchup]
        case NetTurn():
            fields += [msg.turn, [list(entry) for entry in msg.commands]]
        case Desync():
            fields += [msg.turn, [list(entry) for entry in msg.checksums]]
        case Leave():
            pass
        case _:
            fields += [_plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
    return msgpack.packb(fields, use_bin_type=True)


def _plain(value: Any) -> Any:
    return int(value) if isinstance(value, enum.IntEnum) else value


# --------------------------------------------------------------------------- decoding


def decode(data: bytes, config: LockstepConfig) -> Message:
    """Decode and validate one message; raises :class:`MalformedMessage`, and nothing else.

    Error texts name types, never the peer's values: a repr of attacker data (a
    thousand nested arrays fit in 1,001 bytes) can itself raise ``RecursionError``.
    """
    if len(data) > config.max_message_size:
        raise MalformedMessage("message too large")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            # No lockstep message holds a map or an ext; no array or string is
            # longer than the message itself.
            max_str_len=len(data),
            max_bin_len=len(data),
            max_array_len=len(data),
            max_map_len=0,
            max_ext_len=0,
        )
        if type(obj) is not list or not obj:
            raise MalformedMessage("not a non-empty array")
        code, fields = obj[0], obj[1:]
        parser = _PARSERS.get(code) if type(code) is int else None
        if parser is None:
            raise MalformedMessage(f"unknown message type ({type(code).__name__})")
        return parser(fields, config)
    except MalformedMessage:
        raise
    except Exception as exc:  # msgpack's errors, and RecursionError on deep nesting
        raise MalformedMessage(f"bad msgpack: {type(exc).__name__}") from None


def _arity(fields: list[Any], n: int) -> None:
    if len(fields) != n:
        raise MalformedMessage(f"expected {n} fields, got {len(fields)}")


def _int(value: Any, lo: int, hi: int) -> int:
    # type() rather than isinstance(): True/False must not pass for 1/0.
    if type(value) is not int or not lo <= value <= hi:
        raise MalformedMessage(f"bad integer ({type(value).__name__})")
    return value


def _str(value: Any, max_len: int) -> str:
    """A string of at most ``max_len`` UTF-8 bytes (bytes bound the message size)."""
    if type(value) is not str or len(value.encode()) > max_len:
        raise MalformedMessage("bad string")
    return value


def _bytes(value: Any, max_len: int) -> bytes:
    if type(value) is not bytes or len(value) > max_len:
        raise MalformedMessage("bad binary")
    return value


def _list(value: Any, max_len: int) -> list[Any]:
    if type(value) is not list or len(value) > max_len:
        raise MalformedMessage("bad array")
    return value


def _pair(value: Any) -> tuple[Any, Any]:
    if type(value) is not list or len(value) != 2:
        raise MalformedMessage("bad pair")
    return value[0], value[1]


def _enum(cls: type[enum.IntEnum], value: Any) -> Any:
    try:
        return cls(_int(value, 0, 255))
    except ValueError:
        raise MalformedMessage(f"bad {cls.__name__}") from None


def _client_id(value: Any) -> int:
    return _int(value, 0, MAX_CLIENTS_LIMIT - 1)


def _turn(value: Any) -> int:
    return _int(value, 0, MAX_TURN)


def _unique_ids(pairs: list[tuple[int, Any]]) -> None:
    ids = [cid for cid, _ in pairs]
    if len(set(ids)) != len(ids):
        raise MalformedMessage("duplicate client id")


def _join(f: list[Any], c: LockstepConfig) -> Join:
    _arity(f, 3)
    return Join(
        _int(f[0], 0, 0xFFFF), _str(f[1], MAX_GAME_VERSION_LENGTH), _str(f[2], MAX_NAME_LENGTH)
    )


def _welcome(f: list[Any], c: LockstepConfig) -> Welcome:
    _arity(f, 8)
    interval = f[1]
    if type(interval) is not float or not (
        math.isfinite(interval) and MIN_TURN_INTERVAL <= interval <= 10
    ):
        raise MalformedMessage("bad turn interval")
    drop_after = f[6]
    # Infinite is a host that never drops a stalled client; NaN fails the comparison.
    if type(drop_after) is not float or not drop_after > 0:
        raise MalformedMessage("bad drop_after")
    roster = [_pair(e) for e in _list(f[3], MAX_CLIENTS_LIMIT)]
    entries = [(_client_id(cid), _str(name, MAX_NAME_LENGTH)) for cid, name in roster]
    _unique_ids(entries)
    return Welcome(
        _client_id(f[0]),
        interval,
        _int(f[2], 1, 1000),
        tuple(entries),
        _int(f[4], 1, MAX_LIMIT),
        _int(f[5], 1, MAX_LIMIT),
        drop_after,
        _int(f[7], 1, MAX_CATCHUP_LIMIT),
    )


def _refused(f: list[Any], c: LockstepConfig) -> Refused:
    _arity(f, 1)
    return Refused(_enum(RefuseReason, f[0]))


def _joined(f: list[Any], c: LockstepConfig) -> Joined:
    _arity(f, 2)
    return Joined(_client_id(f[0]), _str(f[1], MAX_NAME_LENGTH))


def _left(f: list[Any], c: LockstepConfig) -> Left:
    _arity(f, 2)
    return Left(_client_id(f[0]), _enum(LeaveReason, f[1]))


def _start(f: list[Any], c: LockstepConfig) -> Start:
    _arity(f, 1)
    return Start(_turn(f[0]))


def _command(f: list[Any], c: LockstepConfig) -> Command:
    _arity(f, 2)
    return Command(_turn(f[0]), _bytes(f[1], c.max_command_size))


def _netturn(f: list[Any], c: LockstepConfig) -> NetTurn:
    _arity(f, 2)
    # Each command takes at least 3 bytes: the message size bounds their number, whatever
    # the receiver's own max_pending_commands.
    pairs = [_pair(e) for e in _list(f[1], c.max_message_size // 3)]
    commands = tuple((_client_id(cid), _bytes(data, c.max_command_size)) for cid, data in pairs)
    return NetTurn(_turn(f[0]), commands)


def _doneturn(f: list[Any], c: LockstepConfig) -> DoneTurn:
    _arity(f, 2)
    return DoneTurn(_turn(f[0]), _int(f[1], 0, MAX_CHECKSUM))


def _clstate(f: list[Any], c: LockstepConfig) -> StatusChanged:
    _arity(f, 2)
    return StatusChanged(_client_id(f[0]), _enum(ClientStatus, f[1]))


def _desync(f: list[Any], c: LockstepConfig) -> Desync:
    _arity(f, 2)
    pairs = [_pair(e) for e in _list(f[1], MAX_CLIENTS_LIMIT)]
    checksums = [(_client_id(cid), _int(s, 0, MAX_CHECKSUM)) for cid, s in pairs]
    _unique_ids(checksums)
    return Desync(_turn(f[0]), tuple(checksums))


def _leave(f: list[Any], c: LockstepConfig) -> Leave:
    _arity(f, 0)
    return Leave()


_PARSERS: dict[int, Callable[[list[Any], LockstepConfig], Message]] = {
    MsgType.JOIN: _join,
    MsgType.WELCOME: _welcome,
    MsgType.REFUSED: _refused,
    MsgType.JOINED: _joined,
    MsgType.LEFT: _left,
    MsgType.START: _start,
    MsgType.COMMAND: _command,
    MsgType.NETTURN: _netturn,
    MsgType.DONETURN: _doneturn,
    MsgType.CLSTATE: _clstate,
    MsgType.DESYNC: _desync,
    MsgType.LEAVE: _leave,
}
