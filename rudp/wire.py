"""The wire format, version 2: datagram layouts and integrity. Pure functions.

Every datagram's first byte is ``0xA0 | PacketType``. It is never ``0xFF``, so
the port can be shared with A2S / Quake-style queries (``FF FF FF FF ...``).

Sealed DATA (see ``rudp.protection``; the 9 cleartext bytes are the AEAD's
associated data, the rest is the packet cipher's ciphertext and its 16-byte tag:
AES-256-GCM when both sides allow it, ChaCha20-Poly1305 otherwise)::

    offset size field
    0      1    0xA5
    1      4    dcid     the connection id the receiver chose (its TransportParams)
    5      4    pn       low 32 bits of the 64-bit packet number (the AEAD nonce)
    9      ...  sealed:  ack u16, ack_bits u32, frames...   + 16-byte tag

NOCONN (21 bytes, no checksum: the reset token is its proof)::

    0xA6, dcid u32 (of the DATA that caused it), reset token (16 bytes)

Every other packet is unsealed: it carries no secret and authenticates nothing,
so a CRC-32 (seeded with PROTOCOL_ID) in its last 4 bytes catches corruption and
stray traffic from other UDP programs. Judgement call: the CRC trails, so every
table below reads from byte 0 as written and one CRC covers every byte before it::

    0xA0|type u8, version u8 (2), body..., crc32 u32

    CONNECT      salt u64, pattern u8 (0 NN, 1 NK; 0x80: a token; 0x40: parameter
                 extensions), cookie_len u8, cookie, [token_len u16 if 0x80],
                 [extensions_len u8 if 0x40], Noise message 1, zero padding to
                 the client's max datagram size
    CHALLENGE    salt u64, cookie_len u8, cookie
    ACCEPT       salt u64, Noise message 2 (``handshake.SECOND_MESSAGE_SIZE``)
    REJECT       salt u64, text_len u8, text (utf-8)
    QUERY        nonce u32, len u16, payload, zero padding
    QUERY_REPLY  nonce u32, len u16, payload

The Noise message 1 of a CONNECT runs to the padding; its size follows from the
pattern, the size of the connect token its payload carries, if any, and that of
the extensions of the client's parameters (``handshake.first_message_size``), so
the endpoint cuts it there.

Version 1 datagrams (CRC-32 first, byte 4 the version, 1) are recognised only to
be dropped as ``wrong_version``; a version-1 CONNECT is answered with a
version-1 REJECT (``encode_v1_reject``) that tells the client why.

The frames inside a sealed DATA packet are ``rudp.frames``.

Wire modes: 0 unreliable, 1 reliable-ordered, 2 unreliable-sequenced,
3 reliable-unordered (the dependency graph's messages: with flag 0x10 they
name earlier messages they depend on), 4 reliable-sequenced; 5-7 are invalid.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Final, NamedTuple

from rudp.drops import DropReason as DropReason
from rudp.wire_v1 import is_v1

PROTOCOL_ID: Final = 0x52554450  # "RUDP"
PROTOCOL_VERSION: Final = 2
MARKER: Final = 0xA0  # high nibble of every version-2 first byte

PREFIX: Final = struct.Struct("!BB")  # type byte, version (unsealed packets)
CRC: Final = struct.Struct("!I")
CRC_SIZE: Final = CRC.size
BODY_OFFSET: Final = PREFIX.size
# What an unsealed packet spends besides its body: type, version and CRC.
HEADER_SIZE: Final = PREFIX.size + CRC_SIZE
CONNECT_BODY: Final = struct.Struct("!QBB")
CHALLENGE_BODY: Final = struct.Struct("!QB")
ACCEPT_BODY: Final = struct.Struct("!Q")
REJECT_BODY: Final = struct.Struct("!QB")
QUERY_BODY: Final = struct.Struct("!IH")
U16: Final = struct.Struct("!H")

DATA_PREFIX: Final = struct.Struct("!BII")  # 0xA5, dcid, pn32: the associated data
DATA_PREFIX_SIZE: Final = DATA_PREFIX.size
ACK_FIELDS: Final = struct.Struct("!HI")  # ack u16, ack_bits u32: first in the sealed part
ACK_SIZE: Final = 6
TAG_SIZE: Final = 16  # the Poly1305 tag (``protection.TAG_SIZE``)
# What a DATA packet spends besides its frames: cleartext header, ack fields, tag.
# Every DATA is at least this long, and longer than a NOCONN: a NOCONN never amplifies.
DATA_HEADER_SIZE: Final = DATA_PREFIX_SIZE + ACK_SIZE + TAG_SIZE
RESET_TOKEN_SIZE: Final = 16
NOCONN: Final = struct.Struct("!BI16s")
NOCONN_SIZE: Final = NOCONN.size
MAX_REJECT_TEXT: Final = 96
MAX_COOKIE: Final = 64
CONNECT_TOKEN: Final = 0x80  # CONNECT pattern flag: a token_len u16 follows the cookie
PARAMS_EXTENDED: Final = 0x40  # CONNECT pattern flag: an extensions_len u8 follows
# The smallest CONNECT a server answers. Every handshake reply is smaller than
# this, so no spoofed CONNECT can make us send more than we received.
MIN_CONNECT_SIZE: Final = 256

ACK_SPAN: Final = 32  # a DATA header acknowledges its largest packet and this many before it


class PacketType(enum.IntEnum):
    CONNECT = 1
    CHALLENGE = 2
    ACCEPT = 3
    REJECT = 4
    DATA = 5
    NOCONN = 6
    QUERY = 7
    QUERY_REPLY = 8


UNRELIABLE: Final = 0
RELIABLE_ORDERED: Final = 1
UNRELIABLE_SEQUENCED: Final = 2
GRAPH: Final = 3  # the wire mode of RELIABLE_UNORDERED and DEPENDENCY_ORDERED
RELIABLE_SEQUENCED: Final = 4
DEPENDENCY_ORDERED: Final = 5  # sent as GRAPH with its dependencies
UNRELIABLE_MODES: Final = (UNRELIABLE, UNRELIABLE_SEQUENCED)
# This module's short names for the same values.
_UNRELIABLE: Final = UNRELIABLE
_ORDERED: Final = RELIABLE_ORDERED
_UNORDERED: Final = GRAPH


class Delivery(enum.IntEnum):
    """How a message is delivered; pass one to ``Connection.send(delivery=...)``.

    The values 0-4 are also the frame's wire mode; DEPENDENCY_ORDERED travels as
    RELIABLE_UNORDERED plus the list of its pending dependencies.
    """

    UNRELIABLE = UNRELIABLE
    """May be lost, never duplicated, delivered in arrival order."""
    RELIABLE_ORDERED = RELIABLE_ORDERED
    """Exactly once, in send order within its channel (the default)."""
    UNRELIABLE_SEQUENCED = UNRELIABLE_SEQUENCED
    """May be lost; one older than the newest already delivered on its channel is dropped."""
    RELIABLE_UNORDERED = GRAPH
    """Exactly once, delivered as soon as it arrives."""
    RELIABLE_SEQUENCED = RELIABLE_SEQUENCED
    """Latest wins: exactly the newest reaches the peer; an older one not yet
    acknowledged is superseded and never resent."""
    DEPENDENCY_ORDERED = DEPENDENCY_ORDERED
    """Exactly once, after every message named in ``depends_on``, otherwise at once."""


WIRE_MODES: Final = 5  # wire modes 0..4 are valid
_DATA: Final = 5


class DecodeError(Exception):
    """Internal: the datagram is not valid. Never escapes the endpoint."""

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Connect(NamedTuple):
    salt: int
    pattern: int
    cookie: bytes
    rest: bytes  # the Noise message 1, then the padding (the endpoint cuts it)
    token_size: int = 0  # bytes of connect token at the end of the Noise payload
    extensions: int = -1  # bytes of parameter extensions in the payload, -1: none stated


class Challenge(NamedTuple):
    salt: int
    cookie: bytes


class Accept(NamedTuple):
    salt: int
    message: bytes  # the Noise message 2


class Reject(NamedTuple):
    salt: int
    text: str


class NoConn(NamedTuple):
    dcid: int
    token: bytes


class Query(NamedTuple):
    nonce: int
    payload: bytes


_TYPES: Final = {MARKER | int(t): t for t in PacketType}  # a dict lookup per datagram
_NOCONN_BYTE: Final = MARKER | 6
DATA_BYTE: Final = MARKER | _DATA


def _crc(data: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(data, PROTOCOL_ID) & 0xFFFFFFFF


def _packet(ptype: PacketType, body: bytes) -> bytes:
    out = PREFIX.pack(MARKER | ptype, PROTOCOL_VERSION) + body
    return out + CRC.pack(_crc(out))


def decode_type(data: bytes) -> PacketType:
    """Check length, checksum and version; return the packet type or raise DecodeError.

    DATA and NOCONN are only checked for length here: their seal or token is their
    proof, checked by the endpoint.
    """
    n = len(data)
    if n == 0:
        raise DecodeError(DropReason.TRUNCATED)
    known = _TYPES.get(data[0])
    if known is None:
        if is_v1(data):
            raise DecodeError(DropReason.WRONG_VERSION)
        if data[0] & 0xF0 == MARKER:
            raise DecodeError(DropReason.UNKNOWN_TYPE)
        raise DecodeError(DropReason.TRUNCATED if n < HEADER_SIZE else DropReason.BAD_CHECKSUM)
    if known == PacketType.DATA:
        if n < DATA_HEADER_SIZE:
            raise DecodeError(_v1_or(data, DropReason.TRUNCATED))
        return known
    if known == PacketType.NOCONN:
        if n != NOCONN_SIZE:
            raise DecodeError(_v1_or(data, DropReason.MALFORMED))
        return known
    if n < HEADER_SIZE:
        raise DecodeError(DropReason.TRUNCATED)
    if CRC.unpack_from(data, n - CRC_SIZE)[0] != _crc(memoryview(data)[: n - CRC_SIZE]):
        raise DecodeError(_v1_or(data, DropReason.BAD_CHECKSUM))
    if data[1] != PROTOCOL_VERSION:
        raise DecodeError(DropReason.WRONG_VERSION)
    return known


def _v1_or(data: bytes, reason: DropReason) -> DropReason:
    # A version-1 CRC can start with a version-2 type byte (1 in 32): check it
    # only on this failure path, never per valid packet.
    return DropReason.WRONG_VERSION if is_v1(data) else reason


# -- handshake -----------------------------------------------------------------


def encode_connect(
    salt: int,
    pattern: int,
    cookie: bytes,
    message: bytes,
    pad_to: int,
    token_size: int = 0,
    extensions: int = -1,
) -> bytes:
    """A CONNECT; ``extensions`` (-1: none stated) is the length of the extensions of
    the client's parameters, which tells the server where the Noise message ends."""
    flags = (CONNECT_TOKEN if token_size else 0) | (PARAMS_EXTENDED if extensions >= 0 else 0)
    body = CONNECT_BODY.pack(salt, pattern | flags, len(cookie)) + cookie
    if token_size:
        body += U16.pack(token_size)
    if extensions >= 0:
        body += bytes((extensions,))
    body += message
    padding = max(0, pad_to - HEADER_SIZE - len(body))
    return _packet(PacketType.CONNECT, body + bytes(padding))


def decode_connect(data: bytes) -> Connect:
    salt, pattern, n = _unpack(CONNECT_BODY, data)
    offset = BODY_OFFSET + CONNECT_BODY.size
    cookie = _take(data, offset, n, MAX_COOKIE)
    offset += n
    token_size = 0
    if pattern & CONNECT_TOKEN:
        (token_size,) = U16.unpack(_take(data, offset, U16.size, U16.size))
        offset += U16.size
    extensions = -1
    if pattern & PARAMS_EXTENDED:
        extensions = _take(data, offset, 1, 1)[0]
        offset += 1
    return Connect(
        salt,
        pattern & ~(CONNECT_TOKEN | PARAMS_EXTENDED),
        cookie,
        data[offset : len(data) - CRC_SIZE],
        token_size,
        extensions,
    )


def encode_challenge(salt: int, cookie: bytes) -> bytes:
    return _packet(PacketType.CHALLENGE, CHALLENGE_BODY.pack(salt, len(cookie)) + cookie)


def decode_challenge(data: bytes) -> Challenge:
    salt, n = _unpack(CHALLENGE_BODY, data)
    return Challenge(salt, _take(data, BODY_OFFSET + CHALLENGE_BODY.size, n, MAX_COOKIE))


def encode_accept(salt: int, message: bytes) -> bytes:
    return _packet(PacketType.ACCEPT, ACCEPT_BODY.pack(salt) + message)


def decode_accept(data: bytes) -> Accept:
    (salt,) = _unpack(ACCEPT_BODY, data)
    return Accept(salt, data[BODY_OFFSET + ACCEPT_BODY.size : len(data) - CRC_SIZE])


def encode_reject(salt: int, text: str) -> bytes:
    raw = clip_utf8(text, MAX_REJECT_TEXT)
    return _packet(PacketType.REJECT, REJECT_BODY.pack(salt, len(raw)) + raw)


def decode_reject(data: bytes) -> Reject:
    salt, n = _unpack(REJECT_BODY, data)
    raw = _take(data, BODY_OFFSET + REJECT_BODY.size, n, MAX_REJECT_TEXT)
    return Reject(salt, raw.decode("utf-8", "replace"))


def encode_noconn(dcid: int, token: bytes) -> bytes:
    return NOCONN.pack(_NOCONN_BYTE, dcid, token)


def decode_noconn(data: bytes) -> NoConn:
    if len(data) != NOCONN_SIZE:
        raise DecodeError(DropReason.MALFORMED)
    _, dcid, token = NOCONN.unpack(data)
    return NoConn(dcid, token)


def encode_query(ptype: PacketType, nonce: int, payload: bytes, pad_to: int = 0) -> bytes:
    body = QUERY_BODY.pack(nonce, len(payload)) + payload
    padding = max(0, pad_to - HEADER_SIZE - len(body))
    return _packet(ptype, body + bytes(padding))


def decode_query(data: bytes) -> Query:
    nonce, n = _unpack(QUERY_BODY, data)
    offset = BODY_OFFSET + QUERY_BODY.size
    return Query(nonce, _take(data, offset, n, len(data) - CRC_SIZE - offset))


def _unpack(fmt: struct.Struct, data: bytes) -> tuple[int, ...]:
    if len(data) < HEADER_SIZE + fmt.size:
        raise DecodeError(DropReason.TRUNCATED)
    return fmt.unpack_from(data, BODY_OFFSET)


def _take(data: bytes, offset: int, n: int, limit: int) -> bytes:
    if n > limit:
        raise DecodeError(DropReason.MALFORMED)
    if offset + n > len(data) - CRC_SIZE:
        raise DecodeError(DropReason.TRUNCATED)
    return data[offset : offset + n]


def clip_utf8(text: str, limit: int) -> bytes:
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore").encode("utf-8")


# -- DATA packets ----------------------------------------------------------------


def data_prefix(dcid: int, pn: int) -> bytes:
    """The cleartext header of a DATA packet: the AEAD's associated data."""
    return DATA_PREFIX.pack(DATA_BYTE, dcid, pn & 0xFFFFFFFF)


def data_prefix_start(dcid: int) -> bytes:
    """The first five bytes of every DATA packet's header to ``dcid``: a sender keeps
    them and adds each packet's number (``data_prefix``, a struct packed per packet,
    costs twice as much compiled)."""
    return data_prefix(dcid, 0)[:5]


def ack_fields(ack: int, ack_bits: int) -> bytes:
    """The acknowledgment that starts every DATA packet's sealed part."""
    return ((ack << 32) | ack_bits).to_bytes(6, "big")


def decode_data_prefix(data: bytes) -> tuple[int, int]:
    """(dcid, pn32) of a DATA packet at least ``DATA_HEADER_SIZE`` long.

    Read byte by byte, as ``DATA_PREFIX`` lays them out: compiled, each index is
    native and the pair is returned unboxed, where ``unpack_from`` built a tuple of
    three objects for every datagram received.
    """
    dcid = (data[1] << 24) | (data[2] << 16) | (data[3] << 8) | data[4]
    pn = (data[5] << 24) | (data[6] << 16) | (data[7] << 8) | data[8]
    return dcid, pn
