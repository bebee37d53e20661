"""Connectionless heartbeats and introductions between a listed host and the matchmaker.

Theory of operation
-------------------
A host registers over a rudp connection (authenticated, rate limited); the
`Registered` reply hands it a 32-byte ``secret``, and the host closes the
connection.  From then on it stays listed with one small datagram every
``keepalive`` seconds, sent from its game socket to the matchmaker's rudp
port: an HMAC-SHA256 (cut to 16 bytes) keyed by the secret over the host's
address and a counter that only grows.  The same datagram keeps the host's NAT
mapping towards the matchmaker open, and that is the path introductions take:
the matchmaker sends them to the address the heartbeats come from, and repeats
them until the host acknowledges.

The secret is never stored: it is derived from a key the replicas share
(`Registry.heartbeat_key`) and the registration's token and address, so every
replica can check a heartbeat without a per-host secret in memory or in Redis.

Every datagram starts with a byte no rudp datagram (``0xA1``-``0xA8``), no
A2S or Quake out-of-band packet (``FF FF FF FF``) and no master-server query
(``0x31``, ``FF FF FF FF getservers``) starts with, so they share the rudp
port (`rudp.Server.set_datagram_handler`).  Network byte order throughout:

====  ==================  ========================================================
byte  name                layout after the first byte
====  ==================  ========================================================
B1    HEARTBEAT           counter (8), address (7 or 19), mac (16): 32 or 44 bytes
B2    HEARTBEAT_ACK       counter (8), mac (16): 25 bytes
B3    NOT_REGISTERED      counter (8), and mac (16) when the matchmaker lists the
                          address: 9 or 25 bytes
B4    LEAVE               as HEARTBEAT; the host leaves the list
B5    INTRODUCTION        id (8), payload (an `Introduction` message), mac (16)
B6    INTRODUCTION_ACK    id (8), mac (16): 25 bytes
B7    MOVING              as HEARTBEAT; sent only by a host moving to another
                          replica (its own did not answer), which may take it over
====  ==================  ========================================================

``address`` is the host's public address as the matchmaker told it in
`Registered`: family (1 byte, 4 or 6), port (2), IP (4 or 16).  Each ``mac`` is
the first 16 bytes of HMAC-SHA256(secret, first byte + the fields before the
mac + address), so a MAC made for one kind, one address or one host is
worthless for another: a HEARTBEAT can never pass for a MOVING one, which is
what keeps a replayed heartbeat from moving a host (`matchmaker.liveness`).
Replies to a heartbeat are never larger than it (no amplification towards a
spoofed source): an ACK is 25 bytes, NOT_REGISTERED 9 or 25.  NOT_REGISTERED
carries a MAC when the matchmaker lists the address (the heartbeat came from
elsewhere, the replica is stopping or does not own the host); for an address
it does not list it knows no secret, and the reply only echoes the counter.  That
echo is no proof by itself: anyone can send the matchmaker a heartbeat naming
an unlisted address with a chosen counter from a spoofed source.  What makes
it hard to forge is that each registration's counter starts at a random
62-bit value (`first_counter`), so a host takes an unauthenticated
NOT_REGISTERED only when it echoes one of the counters it just sent, and only
from the replica it heartbeats to.  An on-path attacker who sees the
heartbeats can still forge it; all it wins is a re-registration.

No I/O here: pure encoders and decoders.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import socket
import struct
from typing import NamedTuple

from matchmaker.addresses import Address, make_address

SECRET_BYTES = 32
MAC_BYTES = 16
_COUNTER = struct.Struct("!Q")
_ADDRESS_HEAD = struct.Struct("!BH")
_BEAT_KINDS = frozenset({0xB1, 0xB4, 0xB7})
"""HEARTBEAT, LEAVE, MOVING: one layout."""
MAX_COUNTER = (1 << 63) - 1
"""The largest heartbeat counter taken: the registries store it as a signed 64-bit
integer (an array of them, a Redis integer), and a registration's counter starts
below 2**62 (`COUNTER_START_BITS`), so an honest host never gets near it."""


class Kind(enum.IntEnum):
    """The first byte of each datagram."""

    HEARTBEAT = 0xB1
    HEARTBEAT_ACK = 0xB2
    NOT_REGISTERED = 0xB3
    LEAVE = 0xB4
    INTRODUCTION = 0xB5
    INTRODUCTION_ACK = 0xB6
    MOVING = 0xB7


_KINDS: dict[int, Kind] = {int(k): k for k in Kind}
_ACK_KIND = bytes((Kind.HEARTBEAT_ACK,))
FIRST_BYTES: tuple[int, ...] = tuple(int(k) for k in Kind)
"""Every first byte this module uses (what a socket routes here)."""
ACK_BYTES = 1 + _COUNTER.size + MAC_BYTES
"""Size of HEARTBEAT_ACK and INTRODUCTION_ACK."""
COUNTER_START_BITS = 62
"""A registration's first counter is random below 2**62: not guessable, and
2**62 heartbeats from the ceiling."""


def first_counter() -> int:
    """Where a new registration's heartbeat counter starts (random, never 0)."""
    return secrets.randbits(COUNTER_START_BITS) + 1


class BeatError(ValueError):
    """A datagram that is not a well-formed heartbeat; `reason` names the drop."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Beat(NamedTuple):
    """A decoded HEARTBEAT, MOVING or LEAVE (its MAC not yet checked). A named tuple:
    one is made per heartbeat received, and a tuple is made in a third of the time
    of a frozen dataclass."""

    kind: Kind
    counter: int
    address: Address
    """The address the host says it was registered at."""
    signed: bytes
    """What the MAC covers."""
    mac: bytes


def derive_secret(key: bytes, token: str, address: Address) -> bytes:
    """The secret of registration `token` at `address`, from the replicas' shared key."""
    label = b"matchmaker heartbeat\0" + token.encode() + b"\0" + address.key.encode()
    return hmac.digest(key, label, "sha256")


def pack_address(address: Address) -> bytes:
    family = socket.AF_INET6 if address.family == 6 else socket.AF_INET
    return _ADDRESS_HEAD.pack(address.family, address.port) + socket.inet_pton(family, address.ip)


def _unpack_address(data: bytes, offset: int) -> tuple[Address, int]:
    """The address at `offset`, and where it ends; raises BeatError."""
    if len(data) < offset + _ADDRESS_HEAD.size:
        raise BeatError("truncated")
    family, port = _ADDRESS_HEAD.unpack_from(data, offset)
    size = {4: 4, 6: 16}.get(family)
    if size is None:
        raise BeatError("malformed")
    start = offset + _ADDRESS_HEAD.size
    raw = data[start : start + size]
    if len(raw) != size:
        raise BeatError("truncated")
    if family == 4:
        # inet_ntop's text of four bytes is already the canonical form make_address
        # would give: only the port needs its check.
        if not port:
            raise BeatError("malformed")
        return Address(socket.inet_ntop(socket.AF_INET, raw), port), start + size
    ip = socket.inet_ntop(socket.AF_INET6, raw)
    try:
        return make_address(ip, port), start + size
    except ValueError:
        raise BeatError("malformed") from None


def mac(secret: bytes, signed: bytes) -> bytes:
    return hmac.digest(secret, signed, "sha256")[:MAC_BYTES]


def mac_ok(secret: bytes, signed: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(mac(secret, signed), tag)


# -- host -> matchmaker


def encode_beat(
    secret: bytes, address: Address, counter: int, kind: Kind = Kind.HEARTBEAT
) -> bytes:
    """A HEARTBEAT (or LEAVE, or MOVING) for the host registered at `address`."""
    if kind not in _BEAT_KINDS:
        raise ValueError(f"not a heartbeat kind: {kind!r}")
    signed = bytes((kind,)) + _COUNTER.pack(counter) + pack_address(address)
    return signed + mac(secret, signed)


def decode_beat(data: bytes) -> Beat:
    """A HEARTBEAT, MOVING or LEAVE, its MAC unchecked; raises BeatError."""
    if not data or data[0] not in _BEAT_KINDS:
        raise BeatError("unknown_type")
    if len(data) < 1 + _COUNTER.size:
        raise BeatError("truncated")
    (counter,) = _COUNTER.unpack_from(data, 1)
    if counter > MAX_COUNTER:
        # Signed with the host's secret or not, the registries could not store it.
        raise BeatError("malformed")
    address, end = _unpack_address(data, 1 + _COUNTER.size)
    if len(data) != end + MAC_BYTES:
        raise BeatError("truncated" if len(data) < end + MAC_BYTES else "malformed")
    return Beat(_KINDS[data[0]], counter, address, data[:end], data[end:])


def encode_introduction_ack(secret: bytes, address: Address, intro_id: int) -> bytes:
    head = bytes((Kind.INTRODUCTION_ACK,)) + _COUNTER.pack(intro_id)
    return head + mac(secret, head + pack_address(address))


def decode_introduction_ack(data: bytes) -> tuple[int, bytes]:
    """(introduction id, mac); raises BeatError."""
    if len(data) != ACK_BYTES or data[0] != Kind.INTRODUCTION_ACK:
        raise BeatError("malformed")
    return _COUNTER.unpack_from(data, 1)[0], data[1 + _COUNTER.size :]


def introduction_ack_ok(secret: bytes, address: Address, data: bytes) -> bool:
    return mac_ok(secret, data[: 1 + _COUNTER.size] + pack_address(address), data[-MAC_BYTES:])


# -- matchmaker -> host


def encode_ack(secret: bytes, address: Address, counter: int) -> bytes:
    head = _ACK_KIND + _COUNTER.pack(counter)
    return head + mac(secret, head + pack_address(address))


def ack_of(secret: bytes, beat: Beat) -> bytes:
    """``encode_ack(secret, beat.address, beat.counter)``, from the beat's own bytes
    where they are what packing its address gives (an IPv4 address; an IPv6 one
    may be a mapped IPv4 address, which its Address no longer is)."""
    signed = beat.signed
    if signed[1 + _COUNTER.size] != 4:
        return encode_ack(secret, beat.address, beat.counter)
    head = _ACK_KIND + signed[1 : 1 + _COUNTER.size]
    return head + mac(secret, head + signed[1 + _COUNTER.size :])


def decode_ack(secret: bytes, address: Address, data: bytes) -> int | None:
    """The counter a genuine HEARTBEAT_ACK acknowledges, None for anything else."""
    if len(data) != ACK_BYTES or data[0] != Kind.HEARTBEAT_ACK:
        return None
    head = data[: 1 + _COUNTER.size]
    if not mac_ok(secret, head + pack_address(address), data[len(head) :]):
        return None
    return int(_COUNTER.unpack_from(data, 1)[0])


def encode_not_registered(
    counter: int, secret: bytes | None = None, address: Address | None = None
) -> bytes:
    """A NOT_REGISTERED; with the registration's `secret` and `address`, authenticated."""
    head = bytes((Kind.NOT_REGISTERED,)) + _COUNTER.pack(counter)
    if secret is None or address is None:
        return head
    return head + mac(secret, head + pack_address(address))


def decode_not_registered(secret: bytes, address: Address, data: bytes) -> tuple[int, bool] | None:
    """(counter, authenticated) of a NOT_REGISTERED for the host at `address`; None
    for anything else, a MAC that is wrong included."""
    head_size = 1 + _COUNTER.size
    if not data or data[0] != Kind.NOT_REGISTERED:
        return None
    counter = int(_COUNTER.unpack_from(data, 1)[0]) if len(data) >= head_size else 0
    if len(data) == head_size:
        return counter, False
    if len(data) != ACK_BYTES:
        return None
    head = data[:head_size]
    if not mac_ok(secret, head + pack_address(address), data[head_size:]):
        return None
    return counter, True


def encode_introduction(secret: bytes, address: Address, intro_id: int, payload: bytes) -> bytes:
    head = bytes((Kind.INTRODUCTION,)) + _COUNTER.pack(intro_id) + payload
    return head + mac(secret, head + pack_address(address))


def decode_introduction(secret: bytes, address: Address, data: bytes) -> tuple[int, bytes] | None:
    """(id, payload) of a genuine INTRODUCTION for the host at `address`, else None."""
    if len(data) < 1 + _COUNTER.size + MAC_BYTES or data[0] != Kind.INTRODUCTION:
        return None
    head = data[:-MAC_BYTES]
    if not mac_ok(secret, head + pack_address(address), data[-MAC_BYTES:]):
        return None
    return int(_COUNTER.unpack_from(data, 1)[0]), head[1 + _COUNTER.size :]
