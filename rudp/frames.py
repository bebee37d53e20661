"""The frames inside a sealed DATA packet: encoding and decoding. Pure functions.

A DATA packet's sealed part (``rudp.wire``) is its acknowledgment fields, then
frames, each starting with its type byte.

DATA frames (inside the seal)::

    0x00 PADDING                               the rest of the packet: zeros, not read
    0x01 PING                                  ack-eliciting, no body
    0x02 DISCONNECT  code u16, len u8, text    ack-eliciting
    0x03 PAUSE                                 ack-eliciting, no body: no new reliable messages
    0x04 RESUME                                ack-eliciting, no body: send them again
    0x05 ACK_DELAY   delay u16 (units of 100 us)  how long the acknowledgment in this
                                               header waited (only to a peer that
                                               states max_ack_delay in the handshake)
    0x06 REPAIR  mask u32, exponent u8,        parity over up to 32 earlier packets
                 len u16, data                 (bit i of mask: packet pn - 1 - i;
                                               ``rudp.parity``); to a peer that
                                               stated the parity extension only
    0x07 RECOVERED  total u16                  packets rebuilt from the peer's
                                               REPAIRs so far (mod 2**16)
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
REPAIR, ACK_DELAY and RECOVERED are *tail* frames: they follow every other frame
of a packet, and what precedes the first of them is what a REPAIR protects.
PADDING fills path MTU probes (``rudp.pmtu``) to the size tried; it only ever
follows PING there.
"""

from __future__ import annotations

import enum
import struct
from typing import Final, NamedTuple

from rudp.drops import DropReason
from rudp.errors import LocalProtocolError
from rudp.wire import (
    _ORDERED,
    _UNORDERED,
    _UNRELIABLE,
    ACK_SIZE,
    DATA_HEADER_SIZE,
    RELIABLE_SEQUENCED,
    U16,
    WIRE_MODES,
    DecodeError,
    clip_utf8,
)

MAX_CLOSE_TEXT: Final = 200
DISCONNECT_FRAME: Final = struct.Struct("!BHB")

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


class FrameType(enum.IntEnum):
    PADDING = 0x00
    PING = 0x01
    DISCONNECT = 0x02
    PAUSE = 0x03
    RESUME = 0x04
    ACK_DELAY = 0x05
    REPAIR = 0x06
    RECOVERED = 0x07
    PATH_CHALLENGE = 0x1A
    PATH_RESPONSE = 0x1B


# Plain-int twins of enum members used per message or per packet: compiled, a literal
# Final is inlined, while an enum member costs a lookup and a generic comparison (and
# comparing an int with an IntEnum member is a generic rich comparison, with another
# int one machine instruction). ``OutMessage.mode`` and decoded frame modes are these.


_PADDING: Final = 0x00
_PING: Final = 0x01
_DISCONNECT: Final = 0x02
_PAUSE: Final = 0x03
_RESUME: Final = 0x04
_ACK_DELAY: Final = 0x05
ACK_DELAY_UNIT: Final = 0.0001  # seconds per unit of an ACK_DELAY frame
_REPAIR: Final = 0x06
_RECOVERED: Final = 0x07
REPAIR_HEADER: Final = struct.Struct("!BIBH")  # type, mask, exponent, len
RECOVERED_SIZE: Final = 3
_PATH_CHALLENGE: Final = 0x1A
_PATH_RESPONSE: Final = 0x1B


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
        "recovered",
        "repair",
        "response",
        "special",
        "tail",
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
        tail: int = -1,
        repair: tuple[int, int, bytes] | None = None,
        recovered: int = -1,
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
        self.tail = tail  # offset of the first tail frame (REPAIR, ACK_DELAY, RECOVERED), or -1
        self.repair = repair  # the REPAIR frame's (mask, exponent, data), if any
        self.recovered = recovered  # the RECOVERED frame's total, -1 if none


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


def repair_frame(mask: int, exponent: int, data: bytes) -> bytes:
    """A REPAIR frame over the packets ``mask`` names (see ``rudp.parity``)."""
    return REPAIR_HEADER.pack(_REPAIR, mask, exponent, len(data)) + data


def recovered_frame(total: int) -> bytes:
    """A RECOVERED frame: ``total`` packets rebuilt from the peer's REPAIRs, mod 2**16."""
    return bytes((_RECOVERED, (total >> 8) & 0xFF, total & 0xFF))


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


def check_close_code(code: object) -> None:
    """Raise unless ``code`` can be a DISCONNECT's code: an int (TypeError: a float
    would fail only when the frame is built, after the state changed; a bool would
    pass for 0 or 1) in [0, 65535] (``LocalProtocolError``)."""
    if type(code) is not int and (not isinstance(code, int) or type(code) is bool):
        raise TypeError(f"close code must be an int, not {type(code).__name__}: {code!r}")
    if not 0 <= code <= 0xFFFF:
        raise LocalProtocolError(f"close code must be in [0, 65535], got {code}")


def check_close_text(text: object) -> None:
    """Raise unless ``text`` can be a DISCONNECT's text: a str (TypeError) that UTF-8
    encodes, with no lone surrogate (ValueError). A longer one than ``MAX_CLOSE_TEXT``
    bytes is clipped on a character boundary when the frame is built (an exception's
    message passed as the text must not make the close itself fail)."""
    if not isinstance(text, str):
        raise TypeError(f"close text must be a str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"close text cannot be encoded in UTF-8: {exc}") from None


def disconnect_frame(code: int, text: str) -> bytes:
    raw = clip_utf8(text, MAX_CLOSE_TEXT)
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
    tail = -1
    repair: tuple[int, int, bytes] | None = None
    recovered = -1
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
            if tail < 0:
                tail = off - 1
            off += 2
        elif kind == _REPAIR:
            if tail < 0:
                tail = off - 1
            mask = int.from_bytes(data[off : off + 4], "big")
            exponent = data[off + 4]
            n = (data[off + 5] << 8) | data[off + 6]
            off += 7
            if off + n > end:
                raise DecodeError(DropReason.TRUNCATED)
            repair = (mask, exponent, data[off : off + n])
            off += n
        elif kind == _RECOVERED:
            if tail < 0:
                tail = off - 1
            recovered = (data[off] << 8) | data[off + 1]
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
    return DataFrames(
        messages,
        ping,
        disconnect,
        special,
        flow,
        challenge,
        response,
        ack_delay,
        end if tail < 0 else tail,
        repair,
        recovered,
    )


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
