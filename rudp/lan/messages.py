"""LAN discovery datagrams: the CALL and the ANSWER, and the defaults they depend on.

Pure functions over bytes, no I/O. :func:`decode_packet` checks the header and
unpacks the msgpack body; :func:`call_game` and :func:`answer_fields` check the
body of each kind. Every defect raises :class:`MalformedDatagram`, which the
responder and the search catch, count and drop: a peer never raises into the
caller.

Wire format (network byte order, both directions)::

    offset  size  field
    0       4     magic  b"rLAN"
    4       1     version (1)
    5       1     kind   (1 = CALL, 2 = ANSWER)
    6       8     nonce  (random, chosen by the caller, echoed by the answer)
    14      2     body length N
    16      N     body: msgpack map
    16+N    ...   CALL only: zero padding up to the request size

    CALL body:    {"game": str | nil}            nil = any game
    ANSWER body:  {"id": bin(8), "game": str, "info": map}

An ANSWER must end exactly after its body; a CALL may be longer (its padding
is what caps the answer's size, see :mod:`rudp.lan.responder`). A CALL body is
at most :data:`MAX_CALL_BODY` bytes (the map with the longest game name): a
responder refuses a longer one before unpacking it, since it only ever reads
``game``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_DISCOVERY_PORT",
    "DEFAULT_IPV6_GROUP",
    "DEFAULT_REQUEST_SIZE",
    "HEADER",
    "INSTANCE_ID_SIZE",
    "MAGIC",
    "MAX_CALL_BODY",
    "MAX_DATAGRAM",
    "MAX_DEPTH",
    "MAX_GAME_NAME",
    "NONCE_SIZE",
    "VERSION",
    "Kind",
    "MalformedDatagram",
    "Packet",
    "answer_fields",
    "call_game",
    "check_game",
    "decode_packet",
    "encode_answer",
    "encode_call",
    "encode_packet",
]

#: UDP port responders listen on unless told otherwise.
DEFAULT_DISCOVERY_PORT = 47_474
#: Link-local IPv6 group the responders join ("rudp" in ASCII in the low bits).
DEFAULT_IPV6_GROUP = "ff02::7275:6470"
#: Size every call is padded to, and so the largest answer a responder may send.
#: 1200 bytes fits any IPv6 path MTU (RFC 8200 minimum is 1280) without fragments.
DEFAULT_REQUEST_SIZE = 1200

MAGIC = b"rLAN"
VERSION = 1
HEADER = struct.Struct("!4sBB8sH")
NONCE_SIZE = 8
INSTANCE_ID_SIZE = 8
MAX_GAME_NAME = 64
#: Upper bound on what we read from a socket: calls are never larger than this.
MAX_DATAGRAM = 65_507
#: Deepest nesting of lists and maps a body may have; info is handed to the application,
#: where comparing or printing a 500-deep structure raises RecursionError.
MAX_DEPTH = 32
#: Largest CALL body: ``{"game": str}`` with a game name of MAX_GAME_NAME characters
#: of 4 UTF-8 bytes each (map header 1, key 5, str16 header 3). An honest body is ~12 bytes.
MAX_CALL_BODY = 1 + 5 + 3 + 4 * MAX_GAME_NAME


class Kind(enum.IntEnum):
    CALL = 1
    ANSWER = 2


class MalformedDatagram(ValueError):
    """A discovery datagram failed to parse (internal; always caught)."""


@dataclass(frozen=True, slots=True)
class Packet:
    """A parsed discovery datagram."""

    kind: Kind
    nonce: bytes
    body: dict[str, Any]


def encode_packet(kind: Kind, nonce: bytes, body: Mapping[str, Any], *, pad_to: int = 0) -> bytes:
    """Encode a datagram; a CALL is zero-padded up to ``pad_to`` bytes."""
    payload = msgpack.packb(dict(body), use_bin_type=True)
    if len(payload) > 0xFFFF:
        raise ValueError("discovery body too large")
    data = HEADER.pack(MAGIC, VERSION, kind, nonce, len(payload)) + payload
    if len(data) < pad_to:
        data += bytes(pad_to - len(data))
    return data


def decode_packet(data: bytes, *, kind: Kind | None = None, max_body: int = 0xFFFF) -> Packet:
    """Parse a datagram, raising :class:`MalformedDatagram` on any defect.

    With ``kind``, any other kind is refused, and a body longer than ``max_body``
    bytes too, both from the header alone, before the body is unpacked.
    """
    if len(data) < HEADER.size:
        raise MalformedDatagram("short header")
    magic, version, found, nonce, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MalformedDatagram("bad magic")
    if version != VERSION:
        raise MalformedDatagram("unsupported version")
    if found not in (Kind.CALL, Kind.ANSWER):
        raise MalformedDatagram("unknown kind")
    if kind is not None and found != kind:
        raise MalformedDatagram(f"not a {kind.name.lower()}")
    if length > max_body:
        raise MalformedDatagram("body too large")
    end = HEADER.size + length
    if end > len(data):
        raise MalformedDatagram("truncated body")
    if found == Kind.ANSWER and end != len(data):
        raise MalformedDatagram("trailing bytes")
    body = _unpack_map(data[HEADER.size : end])
    return Packet(Kind(found), nonce, body)


def _unpack_map(raw: bytes) -> dict[str, Any]:
    n = len(raw)
    try:
        # No container or string can hold more items than the body has bytes.
        obj = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=n,
        )
    except Exception as exc:  # msgpack's errors, and RecursionError on deep nesting
        raise MalformedDatagram(f"bad msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise MalformedDatagram("body is not a map")
    _check_depth(obj)
    return obj


def _check_depth(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise MalformedDatagram("body nested too deep")
        items = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in items if isinstance(v, dict | list))


def check_game(game: object, name: str = "game", *, optional: bool = False) -> None:
    """A game name as a ``str`` of 1..MAX_GAME_NAME characters (or None when ``optional``):
    a responder drops a call with anything else as malformed, so nobody would answer."""
    if game is None and optional:
        return
    if not isinstance(game, str):
        none = " or None" if optional else ""
        raise TypeError(f"{name} takes a str{none}, not {type(game).__name__}: {game!r}")
    if not 1 <= len(game) <= MAX_GAME_NAME:
        raise ValueError(f"{name} must be 1..{MAX_GAME_NAME} characters, not {len(game)}")


def encode_call(nonce: bytes, game: str | None, request_size: int) -> bytes:
    """A CALL asking hosts of ``game`` (any game if ``None``), padded to ``request_size``."""
    return encode_packet(Kind.CALL, nonce, {"game": game}, pad_to=request_size)


def call_game(body: Mapping[str, Any]) -> str | None:
    """The game a CALL body asks for (``None``: any game)."""
    game = body.get("game")
    if game is not None and not (isinstance(game, str) and len(game) <= MAX_GAME_NAME):
        raise MalformedDatagram("bad game filter")
    return game


def encode_answer(nonce: bytes, instance_id: bytes, game: str, info: Mapping[str, Any]) -> bytes:
    """The ANSWER to the CALL that carried ``nonce``; raises if ``info`` cannot be packed."""
    return encode_packet(Kind.ANSWER, nonce, {"id": instance_id, "game": game, "info": dict(info)})


def answer_fields(body: Mapping[str, Any]) -> tuple[bytes, str, dict[str, Any]]:
    """``(instance id, game, info)`` of an ANSWER body."""
    instance, game, info = body.get("id"), body.get("game"), body.get("info")
    if not (isinstance(instance, bytes) and len(instance) == INSTANCE_ID_SIZE):
        raise MalformedDatagram("bad instance id")
    if not isinstance(game, str) or not isinstance(info, dict):
        raise MalformedDatagram("bad game or info")
    return instance, game, info


def log_address(address: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) for log lines, as the rest of rudp writes it."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)
