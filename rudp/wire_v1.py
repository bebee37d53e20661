"""Version 1 of the wire format, recognised only to be refused.

Version 1 datagrams start with a CRC-32 (seeded with ``"RUDP"``) of the bytes
after it, then the version (1) and the type. A version-2 endpoint drops them as
``wrong_version``, and answers a version-1 CONNECT with a version-1 REJECT that
tells the client why: its own format, smaller than the padded CONNECT.
"""

from __future__ import annotations

import struct
import zlib
from typing import Final

_SEED: Final = 0x52554450  # "RUDP": both versions seed their CRC with it
MAX_REJECT_TEXT: Final = 96
_REJECT_BODY: Final = struct.Struct("!QB")
_CRC: Final = struct.Struct("!I")


def _crc(data: bytes | memoryview) -> int:
    return zlib.crc32(data, _SEED) & 0xFFFFFFFF


V1_HEADER: Final = struct.Struct("!IBB")  # crc32 of bytes 4.., version, type
V1_CONNECT_SIZE: Final = 256  # version 1's MIN_CONNECT_SIZE
_V1_CONNECT: Final = 1
_V1_REJECT: Final = 4
_V1_SALT: Final = struct.Struct("!Q")


def is_v1(data: bytes) -> bool:
    """Whether ``data`` is a well-formed version-1 datagram (its CRC checks)."""
    if len(data) < V1_HEADER.size or data[4] != 1:
        return False
    return bool(V1_HEADER.unpack_from(data)[0] == _crc(memoryview(data)[4:]))


def v1_connect_salt(data: bytes) -> int | None:
    """The salt of a version-1 CONNECT large enough to answer, else None."""
    if len(data) < V1_CONNECT_SIZE or not is_v1(data) or data[5] != _V1_CONNECT:
        return None
    return int(_V1_SALT.unpack_from(data, V1_HEADER.size)[0])


def _v1_packet(ptype: int, body: bytes) -> bytes:
    rest = bytes((1, ptype)) + body
    return _CRC.pack(_crc(rest)) + rest


def encode_v1_reject(salt: int, text: str) -> bytes:
    """A version-1 REJECT: what a version-1 client understands as a refusal."""
    raw = text.encode("utf-8")[:MAX_REJECT_TEXT].decode("utf-8", "ignore").encode("utf-8")
    return _v1_packet(_V1_REJECT, _REJECT_BODY.pack(salt, len(raw)) + raw)


def encode_v1_connect(salt: int, pad_to: int = 1200) -> bytes:
    """A version-1 CONNECT without cookie (what a version-1 client sends first)."""
    body = struct.pack("!QHB", salt, 0, 0)
    return _v1_packet(_V1_CONNECT, body + bytes(max(0, pad_to - V1_HEADER.size - len(body))))
