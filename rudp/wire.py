"""The wire format, version 2: packet layouts, frames, integrity. Pure functions.

Every datagram's first byte is ``0xA0 | PacketType``. It is never ``0xFF``, so
the port can be shared with A2S / Quake-style queries (``FF FF FF FF ...``).

Sealed DATA (see ``rudp.protection``; the 9 cleartext bytes are the AEAD's
associated data, the rest is ChaCha20-Poly1305 ciphertext and its 16-byte tag)::

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

DATA frames (inside the seal)::

    0x00 PADDING                               the rest of the packet: zeros, not read
    0x01 PING                                  ack-eliciting, no body
    0x02 DISCONNECT  code u16, len u8, text    ack-eliciting
    0x03 PAUSE                                 ack-eliciting, no body: no new reliable messages
    0x04 RESUME                                ack-eliciting, no body: send them again
    0x05 ACK_DELAY   delay u16 (units of 100 us)  how long the acknowledgment in this
                                               header waited (only to a peer that
                                               states max_ack_delay in the handshake)
    0x1A PATH_CHALLENGE  data (8 bytes)        sent to a peer's new address (migration)
    0x1B PATH_RESPONSE   data (8 bytes)        ack-eliciting: echoes a PATH_CHALLENGE
    0x80|flags MESSAGE                         flags: bits 0-2 wire mode,
         [channel u8]   if flag 0x08           bit 3 (0x08) channel byte present,
         [seq u16]      unless mode 0          bit 4 (0x10) dependencies present,
         [index u16, count u16, total u32]     bit 6 (0x40) fragment,
                        if flag 0x40           bit 5 (0x20) reserved (must be 0)
         [n u8, n x dep u16]  if flag 0x10
         len u16, payload

PAUSE and RESUME are flow control: a receiver whose application falls behind
asks its peer to stop sending reliable messages, then to go on (see docs/protocol.md).
PATH_CHALLENGE and PATH_RESPONSE validate a peer's new address before the connection
moves there (``rudp.migration``; RFC 9000's frames of the same numbers).
PADDING fills path MTU probes (``rudp.pmtu``) to the size tried; it only ever
follows PING there.

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
DISCONNECT_FRAME: Final = struct.Struct("!BHB")

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
MAX_CLOSE_TEXT: Final = 200
MAX_COOKIE: Final = 64
CONNECT_TOKEN: Final = 0x80  # CONNECT pattern flag: a token_len u16 follows the cookie
PARAMS_EXTENDED: Final = 0x40  # CONNECT pattern flag: an extensions_len u8 follows
# The smallest CONNECT a server answers. Every handshake reply is smaller than
# this, so no spoofed CONNECT can make us send more than we received.
MIN_CONNECT_SIZE: Final = 256

FLAG_MESSAGE: Final = 0x80
FLAG_CHANNEL: Final = 0x08
FLAG_DEPS: Final = 0x10
FLAG_FRAGMENT: Final = 0x40
MODE_MASK: Final = 0x07
RESERVED_MASK: Final = 0x20
# Frame overhead upper bound of an unfragmented message without dependencies:
# flags, channel, seq, len.
MESSAGE_OVERHEAD: Final = 6
# What a fragment adds: index u16, count u16, total u32.
FRAGMENT: Final = struct.Struct("!HHI")
FRAGMENT_OVERHEAD: Final = FRAGMENT.size
# What a datagram holding one fragment spends besides the fragment's bytes: the DATA
# header, the message frame header and the fragment header (``Config.fragment_payload``).
FRAGMENT_FRAME_OVERHEAD: Final = DATA_HEADER_SIZE + MESSAGE_OVERHEAD + FRAGMENT_OVERHEAD
MAX_DEPS: Final = 255  # pending dependencies one message can carry (n is a u8)
MAX_FRAGMENTS: Final = 0xFFFF  # fragments of one message (the count is a u16)
PATH_DATA_SIZE: Final = 8  # the random bytes of a PATH_CHALLENGE, echoed in PATH_RESPONSE
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


class FrameType(enum.IntEnum):
    PADDING = 0x00
    PING = 0x01
    DISCONNECT = 0x02
    PAUSE = 0x03
    RESUME = 0x04
    ACK_DELAY = 0x05
    PATH_CHALLENGE = 0x1A
    PATH_RESPONSE = 0x1B


# Plain-int twins of enum members used per message or per packet: compiled, a literal
# Final is inlined, while an enum member costs a lookup and a generic comparison (and
# comparing an int with an IntEnum member is a generic rich comparison, with another
# int one machine instruction). ``OutMessage.mode`` and decoded frame modes are these.
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
_PADDING: Final = 0x00
_PING: Final = 0x01
_DISCONNECT: Final = 0x02
_PAUSE: Final = 0x03
_RESUME: Final = 0x04
_ACK_DELAY: Final = 0x05
ACK_DELAY_UNIT: Final = 0.0001  # seconds per unit of an ACK_DELAY frame
_PATH_CHALLENGE: Final = 0x1A
_PATH_RESPONSE: Final = 0x1B
_DATA: Final = 5


class DecodeError(Exception):
    """Internal: the datagram is not valid. Never escapes the endpoint."""

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class FrameExtra:
    """The rarer parts of a MESSAGE frame: fragment header and dependencies.

    A plain class with slots, not a NamedTuple: one is made per received fragment,
    and compiled it is a native class, built for a fraction of a NamedTuple's
    (interpreted) ``__new__``.
    """

    __slots__ = ("deps", "part", "parts", "total")

    def __init__(self, parts: int, part: int, total: int, deps: tuple[int, ...]) -> None:
        self.parts = parts  # fragments in the message, 0 when the frame is not a fragment
        self.part = part  # this fragment's index
        self.total = total  # the whole message's size in bytes
        self.deps = deps  # 16-bit ids of graph messages it depends on

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FrameExtra):
            return NotImplemented
        return (self.parts, self.part, self.total, self.deps) == (
            other.parts,
            other.part,
            other.total,
            other.deps,
        )

    def __hash__(self) -> int:
        return hash((self.parts, self.part, self.total, self.deps))

    def __repr__(self) -> str:
        return f"FrameExtra({self.parts}, {self.part}, {self.total}, {self.deps!r})"


# (mode, channel, seq, payload, extra): a plain tuple, one is made per received message.
MessageFrame = tuple[int, int, int, bytes, FrameExtra | None]


NO_FLOW: Final = -1


class DisconnectFrame(NamedTuple):
    code: int
    text: str


class DataFrames:
    """The frames of one DATA packet (a native class when compiled: one per packet)."""

    __slots__ = (
        "ack_delay",
        "challenge",
        "disconnect",
        "flow",
        "messages",
        "ping",
        "response",
        "special",
    )

    def __init__(
        self,
        messages: list[MessageFrame],
        ping: bool,
        disconnect: DisconnectFrame | None,
        special: bool,
        flow: int = NO_FLOW,
        challenge: bytes = b"",
        response: bytes = b"",
        ack_delay: float = 0.0,
    ) -> None:
        self.messages = messages
        self.ping = ping
        self.disconnect = disconnect
        # some message is a fragment, has dependencies or a mode other than 0/1, or the
        # packet carries a path frame: what the common packet needs no look at
        self.special = special
        self.flow = flow  # the packet's last PAUSE (1) or RESUME (0) frame, NO_FLOW if none
        self.challenge = challenge  # the data of the packet's last PATH_CHALLENGE, if any
        self.response = response  # the data of the packet's last PATH_RESPONSE, if any
        self.ack_delay = ack_delay  # how long the header's acknowledgment waited (ACK_DELAY)


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
    raw = _clip_utf8(text, MAX_REJECT_TEXT)
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


def _clip_utf8(text: str, limit: int) -> bytes:
    return text.encode("utf-8")[:limit].decode("utf-8", "ignore").encode("utf-8")


# -- DATA packets ----------------------------------------------------------------


def data_prefix(dcid: int, pn: int) -> bytes:
    """The cleartext header of a DATA packet: the AEAD's associated data."""
    return DATA_PREFIX.pack(DATA_BYTE, dcid, pn & 0xFFFFFFFF)


def ack_fields(ack: int, ack_bits: int) -> bytes:
    """The acknowledgment that starts every DATA packet's sealed part."""
    return ((ack << 32) | ack_bits).to_bytes(6, "big")


def decode_data_prefix(data: bytes) -> tuple[int, int]:
    """(dcid, pn32) of a DATA packet at least ``DATA_HEADER_SIZE`` long."""
    _, dcid, pn = DATA_PREFIX.unpack_from(data)
    return dcid, pn


def message_frame(
    mode: int,
    channel: int,
    seq: int,
    data: bytes,
    *,
    deps: tuple[int, ...] = (),
    fragment: tuple[int, int, int] | None = None,
) -> bytes:
    """Encode one MESSAGE frame of any wire mode (the caller checked the sizes).

    ``fragment`` is ``(index, count, total)``; ``deps`` are 16-bit graph ids.
    """
    if not deps and fragment is None:
        if mode == _UNRELIABLE:
            return unreliable_frame(channel, data)
        if mode == _ORDERED:
            return reliable_frame(channel, seq, data)
    # The header as one int, written with one int.to_bytes (see reliable_frame).
    flags = FLAG_MESSAGE | mode
    head = 0
    size = 1
    if channel:
        flags |= FLAG_CHANNEL
        head = channel
        size = 2
    if mode != _UNRELIABLE:
        head = (head << 16) | (seq & 0xFFFF)
        size += 2
    if fragment is not None:
        flags |= FLAG_FRAGMENT
        index, count, total = fragment
        head = (head << 64) | (index << 48) | (count << 32) | total
        size += FRAGMENT_OVERHEAD
    if deps:
        flags |= FLAG_DEPS
        head = (head << 8) | len(deps)
        size += 1 + 2 * len(deps)
        for dep in deps:
            head = (head << 16) | (dep & 0xFFFF)
    head = (head << 16) | len(data)
    size += 2
    return ((flags << (8 * size - 8)) | head).to_bytes(size, "big") + data


_REL_FLAGS: Final = FLAG_MESSAGE | _ORDERED
_REL_CH_FLAGS: Final = _REL_FLAGS | FLAG_CHANNEL
_UNREL_CH_FLAGS: Final = FLAG_MESSAGE | FLAG_CHANNEL


# The two frames made per message are packed into one int and written with
# int.to_bytes: compiled, that is about half the cost of a Struct.pack call.


def reliable_frame(channel: int, seq: int, data: bytes) -> bytes:
    """A reliable-ordered MESSAGE frame (``seq`` is truncated to 16 bits)."""
    if channel:
        head = (_REL_CH_FLAGS << 40) | (channel << 32) | ((seq & 0xFFFF) << 16) | len(data)
        return head.to_bytes(6, "big") + data
    return ((_REL_FLAGS << 32) | ((seq & 0xFFFF) << 16) | len(data)).to_bytes(5, "big") + data


def unreliable_frame(channel: int, data: bytes) -> bytes:
    """An unreliable MESSAGE frame."""
    if channel:
        head = (_UNREL_CH_FLAGS << 24) | (channel << 16) | len(data)
        return head.to_bytes(4, "big") + data
    return ((FLAG_MESSAGE << 16) | len(data)).to_bytes(3, "big") + data


def message_frame_size(
    mode: int, channel: int, size: int, *, deps: int = 0, fragment: bool = False
) -> int:
    """The encoded size of a MESSAGE frame carrying ``size`` payload bytes."""
    n = 3 + (1 if channel else 0) + (2 if mode != _UNRELIABLE else 0) + size
    if fragment:
        n += FRAGMENT_OVERHEAD
    if deps:
        n += 1 + 2 * deps
    return n


PING_FRAME: Final = bytes((FrameType.PING,))


def ack_delay_frame(delay: float) -> bytes:
    """An ACK_DELAY frame saying the header's acknowledgment waited ``delay`` seconds."""
    units = min(int(delay / ACK_DELAY_UNIT), 0xFFFF)
    return bytes((_ACK_DELAY, units >> 8, units & 0xFF))


PAUSE_FRAME: Final = bytes((FrameType.PAUSE,))
RESUME_FRAME: Final = bytes((FrameType.RESUME,))


def path_challenge_frame(data: bytes) -> bytes:
    """A PATH_CHALLENGE carrying ``data`` (``PATH_DATA_SIZE`` random bytes)."""
    return bytes((_PATH_CHALLENGE,)) + data


def path_response_frame(data: bytes) -> bytes:
    """The PATH_RESPONSE that answers a PATH_CHALLENGE carrying ``data``."""
    return bytes((_PATH_RESPONSE,)) + data


def probe_frames(size: int) -> bytes:
    """PING, then PADDING filling ``size`` bytes of frames in all (``size >= 2``): what
    a path MTU probe carries."""
    return _PING_PADDING + bytes(size - 2)


_PING_PADDING: Final = bytes((FrameType.PING, FrameType.PADDING))


def disconnect_frame(code: int, text: str) -> bytes:
    raw = _clip_utf8(text, MAX_CLOSE_TEXT)
    return DISCONNECT_FRAME.pack(FrameType.DISCONNECT, code, len(raw)) + raw


def decode_frames(data: bytes, offset: int = ACK_SIZE) -> DataFrames:
    """Parse every frame of an opened DATA packet, or raise DecodeError; all or nothing."""
    try:
        return _decode_frames(data, offset)
    except (IndexError, struct.error):
        raise DecodeError(DropReason.TRUNCATED) from None


def _decode_frames(data: bytes, off: int) -> DataFrames:
    messages: list[MessageFrame] = []
    ping = False
    special = False
    flow = NO_FLOW
    challenge = response = b""
    disconnect: DisconnectFrame | None = None
    ack_delay = 0.0
    end = len(data)
    while off < end:
        kind = data[off]
        off += 1
        if kind & FLAG_MESSAGE:
            if kind & RESERVED_MASK:
                raise DecodeError(DropReason.MALFORMED)
            mode = kind & MODE_MASK
            channel = 0
            if kind & FLAG_CHANNEL:
                channel = data[off]
                off += 1
            seq = 0
            if mode == _ORDERED:
                seq = (data[off] << 8) | data[off + 1]
                off += 2
            elif mode:
                if mode >= WIRE_MODES:
                    raise DecodeError(DropReason.MALFORMED)
                seq = (data[off] << 8) | data[off + 1]
                off += 2
                special = True
            extra = None
            if kind & _EXTRA_FLAGS:
                extra, off = _decode_extra(data, off, kind, mode)
                special = True
            n = (data[off] << 8) | data[off + 1]
            off += 2
            if off + n > end:
                raise DecodeError(DropReason.TRUNCATED)
            messages.append((mode, channel, seq, data[off : off + n], extra))
            off += n
        elif kind == _PING:
            ping = True
        elif kind == _PADDING:
            break  # the rest of the packet is padding
        elif kind == _DISCONNECT:
            code, n = U16.unpack_from(data, off)[0], data[off + 2]
            off += 3
            if off + n > end:
                raise DecodeError(DropReason.TRUNCATED)
            disconnect = DisconnectFrame(code, data[off : off + n].decode("utf-8", "replace"))
            off += n
        elif kind == _PAUSE:
            flow = 1
        elif kind == _RESUME:
            flow = 0
        elif kind == _ACK_DELAY:
            ack_delay = ((data[off] << 8) | data[off + 1]) * ACK_DELAY_UNIT
            off += 2
        elif kind == _PATH_CHALLENGE:
            challenge = _path_data(data, off)
            off += PATH_DATA_SIZE
            special = True
        elif kind == _PATH_RESPONSE:
            response = _path_data(data, off)
            off += PATH_DATA_SIZE
            special = True
        else:
            raise DecodeError(DropReason.MALFORMED)
    return DataFrames(messages, ping, disconnect, special, flow, challenge, response, ack_delay)


def _path_data(data: bytes, off: int) -> bytes:
    if off + PATH_DATA_SIZE > len(data):
        raise DecodeError(DropReason.TRUNCATED)
    return data[off : off + PATH_DATA_SIZE]


_EXTRA_FLAGS: Final = FLAG_FRAGMENT | FLAG_DEPS


def _decode_extra(data: bytes, off: int, kind: int, mode: int) -> tuple[FrameExtra, int]:
    """The fragment header and dependency list of a MESSAGE frame."""
    count = index = total = 0
    if kind & FLAG_FRAGMENT:
        if mode != _ORDERED and mode != _UNORDERED and mode != RELIABLE_SEQUENCED:
            raise DecodeError(DropReason.MALFORMED)
        index = (data[off] << 8) | data[off + 1]
        count = (data[off + 2] << 8) | data[off + 3]
        total = (data[off + 4] << 24) | (data[off + 5] << 16) | (data[off + 6] << 8) | data[off + 7]
        off += FRAGMENT_OVERHEAD
        if count < 2 or index >= count or total < count:
            raise DecodeError(DropReason.MALFORMED)
    deps: tuple[int, ...] = ()
    if kind & FLAG_DEPS:
        # Only a graph message has dependencies, and only on its first fragment.
        if mode != _UNORDERED or index:
            raise DecodeError(DropReason.MALFORMED)
        n = data[off]
        off += 1
        if n == 0:
            raise DecodeError(DropReason.MALFORMED)
        deps = struct.unpack_from(f"!{n}H", data, off)
        off += 2 * n
    return FrameExtra(count, index, total, deps), off
