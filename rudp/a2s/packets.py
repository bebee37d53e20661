"""Valve's A2S server-query packets: pure encoders and one request decoder.

Layouts (little-endian; strings are UTF-8 and NUL-terminated), from the Valve
Developer Community's "Server queries" page:

=================  ==========================================================
packet             layout after the ``FF FF FF FF`` header
=================  ==========================================================
A2S_INFO request   ``54`` ``"Source Engine Query\\0"`` [challenge u32]
A2S_PLAYER req.    ``55`` challenge u32 (``FFFFFFFF`` or 0: "send me one")
A2S_RULES req.     ``56`` challenge u32
S2C_CHALLENGE      ``41`` challenge u32
A2S_INFO reply     ``49`` protocol u8, name, map, folder, game, app id u16,
                   players u8, max players u8, bots u8, server type char,
                   environment char, visibility u8, VAC u8, version,
                   extra-data flags u8 [port u16 (0x80)] [keywords (0x20)]
                   [game id u64 (0x01)]
A2S_PLAYER reply   ``44`` count u8, then per player: index u8, name,
                   score i32, duration f32 (seconds connected)
A2S_RULES reply    ``45`` count u16, then per rule: name, value
=================  ==========================================================

A reply too large for one datagram is split (the Source engine's format): each
piece is ``FE FF FF FF``, message id u32 (bit 15 clear: not compressed), total
u8, number u8, piece size u16, then a slice of the whole reply, header included.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

HEADER = b"\xff\xff\xff\xff"
SPLIT_HEADER = b"\xfe\xff\xff\xff"
INFO_PAYLOAD = b"Source Engine Query\x00"
PROTOCOL = 17  # the Source engine's A2S_INFO protocol number
SPLIT = struct.Struct("<4sIBBH")
U16 = struct.Struct("<H")
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
PLAYER_TAIL = struct.Struct("<if")
INFO_COUNTS = struct.Struct("<HBBBccBB")
MAX_SPLIT_PIECES = 255


class Kind(IntEnum):
    INFO_REQUEST = 0x54
    PLAYER_REQUEST = 0x55
    RULES_REQUEST = 0x56
    CHALLENGE = 0x41
    INFO_REPLY = 0x49
    PLAYER_REPLY = 0x44
    RULES_REPLY = 0x45


class Edf(IntEnum):
    """Extra-data flags of an A2S_INFO reply."""

    PORT = 0x80
    KEYWORDS = 0x20
    GAME_ID = 0x01


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerInfo:
    """What A2S_INFO publishes (Valve's field names)."""

    name: str
    """Server name, as browsers list it."""
    map: str = ""
    folder: str = ""
    """The game directory: what Steam's ``\\gamedir\\`` filter matches."""
    game: str = ""
    """The game's full name."""
    app_id: int = 0
    """Steam application id (0: not a Steam game)."""
    players: int = 0
    max_players: int = 0
    bots: int = 0
    server_type: str = "d"
    """``d`` dedicated, ``l`` listen (a player hosts), ``p`` SourceTV relay."""
    environment: str = "l"
    """``l`` Linux, ``w`` Windows, ``m`` macOS."""
    password: bool = False
    vac: bool = False
    version: str = ""
    port: int | None = None
    """The game port, if browsers should see it."""
    keywords: str = ""
    """Tags, comma-separated (what browsers filter on)."""


@dataclass(frozen=True, slots=True)
class Player:
    """One row of A2S_PLAYER."""

    name: str
    score: int = 0
    duration: float = 0.0
    """Seconds since the player joined."""


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded A2S request."""

    kind: Kind
    challenge: bytes | None
    """The 4 challenge bytes the requester sent back, None when it sent none."""


def decode_request(data: bytes) -> Request | None:
    """The request in `data`, or None for anything that is not one."""
    if len(data) < 5 or data[:4] != HEADER:
        return None
    kind = data[4]
    if kind == Kind.INFO_REQUEST:
        end = 5 + len(INFO_PAYLOAD)
        if data[5:end] != INFO_PAYLOAD or len(data) not in (end, end + 4):
            return None
        return Request(Kind.INFO_REQUEST, data[end:] or None)
    if kind in (Kind.PLAYER_REQUEST, Kind.RULES_REQUEST) and len(data) == 9:
        return Request(Kind(kind), data[5:9])
    return None


def _str(text: object) -> bytes:
    # A NUL inside would end the string early and shift every later field. What the
    # game gives is written as text whatever it is (a rule's value of 30, or None).
    if type(text) is not str:
        text = "" if text is None else str(text)
    return text.replace("\x00", "").encode("utf-8", "replace") + b"\x00"


def _int(value: Any, low: int, high: int) -> int:
    """`value` as an int clamped to `low`..`high`: what the game gives (a float, a
    counter past 2**31, None) never makes a whole answer fail."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(low, min(high, number))


def _u8(value: Any) -> int:
    return _int(value, 0, 255)


_F32_MAX = 3.4028234663852886e38


def _f32(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    if number != number:  # NaN
        return 0.0
    return max(-_F32_MAX, min(_F32_MAX, number))


def encode_challenge(challenge: bytes) -> bytes:
    return HEADER + bytes((Kind.CHALLENGE,)) + challenge


def encode_info(info: ServerInfo) -> bytes:
    app_id = _int(info.app_id, 0, 0xFFFFFF)  # a Steam app id: 24 bits in the GameID
    edf = (Edf.PORT if info.port is not None else 0) | (Edf.KEYWORDS if info.keywords else 0)
    if app_id > 0xFFFF:
        edf |= Edf.GAME_ID  # the 16-bit field holds its low bits only
    parts = [
        HEADER,
        bytes((Kind.INFO_REPLY, PROTOCOL)),
        _str(info.name),
        _str(info.map),
        _str(info.folder),
        _str(info.game),
        INFO_COUNTS.pack(
            app_id & 0xFFFF,
            _u8(info.players),
            _u8(info.max_players),
            _u8(info.bots),
            str(info.server_type)[:1].encode("ascii", "replace") or b"d",
            str(info.environment)[:1].encode("ascii", "replace") or b"l",
            1 if info.password else 0,
            1 if info.vac else 0,
        ),
        _str(info.version),
        bytes((edf,)),
    ]
    if info.port is not None:
        parts.append(U16.pack(_int(info.port, 0, 0xFFFF)))
    if info.keywords:
        parts.append(_str(info.keywords))
    if app_id > 0xFFFF:
        parts.append(U64.pack(app_id))  # the GameID: the app id in its low 24 bits
    return b"".join(parts)


def encode_players(players: list[Player], limit: int) -> bytes:
    """A2S_PLAYER with as many of `players` (at most 255) as fit in `limit` bytes."""
    out = bytearray(HEADER + bytes((Kind.PLAYER_REPLY, 0)))
    count = 0
    for index, player in enumerate(players[:255]):
        score = _int(player.score, -(2**31), 2**31 - 1)
        row = bytes((index,)) + _str(player.name) + PLAYER_TAIL.pack(score, _f32(player.duration))
        if len(out) + len(row) > limit:
            break
        out += row
        count += 1
    out[5] = count
    return bytes(out)


def encode_rules(rules: list[tuple[str, str]], limit: int) -> bytes:
    """A2S_RULES with as many of `rules` (at most 65535) as fit in `limit` bytes."""
    out = bytearray(HEADER + bytes((Kind.RULES_REPLY,)) + U16.pack(0))
    count = 0
    for name, value in rules[:0xFFFF]:
        row = _str(name) + _str(value)
        if len(out) + len(row) > limit:
            break
        out += row
        count += 1
    out[5:7] = U16.pack(count)
    return bytes(out)


def split(message: bytes, message_id: int, max_datagram: int) -> list[bytes]:
    """`message` as one datagram, or as Source-format pieces of at most `max_datagram`."""
    if len(message) <= max_datagram:
        return [message]
    size = max_datagram - SPLIT.size
    pieces = [message[i : i + size] for i in range(0, len(message), size)]
    if len(pieces) > MAX_SPLIT_PIECES:
        raise ValueError("message too large to split")
    ident = message_id & 0x7FFF  # bit 15 set would mean "bzip2-compressed"
    return [
        SPLIT.pack(SPLIT_HEADER, ident, len(pieces), number, size) + piece
        for number, piece in enumerate(pieces)
    ]


def max_message(max_datagram: int) -> int:
    """The largest reply `split` can carry in datagrams of `max_datagram` bytes."""
    return (max_datagram - SPLIT.size) * MAX_SPLIT_PIECES
