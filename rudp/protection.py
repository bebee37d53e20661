"""Packet protection: sealing with per-direction keys, packet numbers, replay window.

Theory of operation
-------------------
After a Noise handshake each side holds two 32-byte keys, one per direction
(``rudp.noise.HandshakeState.split``). Every packet is sealed with
ChaCha20-Poly1305 under the sending direction's key:

* the **nonce** is the packet's full 64-bit packet number, as Noise's transport
  nonce (four zero bytes, then the number as 64-bit little-endian). A number is
  never used twice with one key, because the sender only counts up;
* the wire carries only the low ``bits`` of the number. The receiver rebuilds
  the full number as the one closest to the next it expects (RFC 9000,
  appendix A.3), which is right as long as fewer than half the number space
  (2**(bits-1)) packets are in flight or lost in a row;
* the **associated data** is the cleartext header the receiver reads before it
  can decrypt (type, connection id, truncated number). Changing one bit of it,
  or of the ciphertext, makes authentication fail; the 16-byte tag replaces a
  checksum.

A packet that fails authentication changes nothing: the largest number seen and
the replay window move only after a packet authenticated. The **replay window**
remembers which of the last ``REPLAY_WINDOW`` numbers below the largest were
received; a duplicate, or a packet older than the window, is refused before any
decryption (it costs a few integer operations, not an AEAD call). Because the
sender's key is its own direction's, a packet reflected back at its sender
never authenticates.

The module is compiled with mypyc in the optional build (setup.py): the replay
window and the packet-number arithmetic run for every packet, native; the AEAD
itself is cryptography's (OpenSSL), called the same way either way.
"""

from __future__ import annotations

from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

KEY_SIZE: Final = 32
TAG_SIZE: Final = 16
# Packet numbers older than this much below the largest received are refused
# as possible replays. 1,024 packets is over a second of a busy 60 Hz stream with
# 16 packets per tick; a legitimate packet reordered by more than that is rare
# enough to count as lost (it is resent under a new number if reliable).
REPLAY_WINDOW: Final = 1024
_WINDOW_MASK: Final = (1 << REPLAY_WINDOW) - 1
# The sender stops before the nonce space ends; the connection must end first
# (2**62 packets: centuries at any real rate, but never a nonce reuse).
MAX_PACKET_NUMBER: Final = (1 << 62) - 1


def decode_packet_number(expected: int, truncated: int, bits: int) -> int:
    """The full packet number closest to ``expected`` whose low ``bits`` are ``truncated``.

    ``expected`` is one more than the largest number received so far (RFC 9000,
    appendix A.3, where it is called ``expected_pn``).
    """
    window = 1 << bits
    half = window >> 1
    mask = window - 1
    candidate = (expected & ~mask) | truncated
    if candidate <= expected - half and candidate < (1 << 62) - window:
        return candidate + window
    if candidate > expected + half and candidate >= window:
        return candidate - window
    return candidate


def _nonce(number: int) -> bytes:
    return b"\x00\x00\x00\x00" + number.to_bytes(8, "little")


class ReplayWindow:
    """Which recent packet numbers were already accepted.

    ``largest`` is the largest accepted number (-1 before the first); bit ``i``
    of ``bits`` is set when ``largest - i`` was accepted. ``accepted`` counts the
    numbers accepted: with ``largest``, what arrived of what the peer sent (its
    numbers start at 0 and count every packet), which ``ConnectionStats`` reports.
    """

    __slots__ = ("accepted", "bits", "largest")

    def __init__(self) -> None:
        self.largest = -1
        self.bits = 0
        self.accepted = 0

    def seen(self, number: int) -> bool:
        """True when ``number`` must be refused: already accepted or too old to tell."""
        if number > self.largest:
            return False
        offset = self.largest - number
        if offset >= REPLAY_WINDOW:
            return True
        return bool((self.bits >> offset) & 1)

    def accept(self, number: int) -> None:
        """Record ``number`` as received (after it authenticated)."""
        self.accepted += 1
        if number > self.largest:
            shift = number - self.largest
            self.bits = ((self.bits << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            self.largest = number
        else:
            self.bits |= 1 << (self.largest - number)


class Sealer:
    """The sending direction: numbers packets and seals them."""

    __slots__ = ("_aead", "next_number")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a packet key is {KEY_SIZE} bytes")
        self._aead = ChaCha20Poly1305(key)
        self.next_number = 0

    def seal(self, number: int, header: bytes, payload: bytes) -> bytes:
        """``payload`` sealed under packet ``number``, with ``header`` authenticated."""
        sealed: bytes = self._aead.encrypt(_nonce(number), payload, header)
        return sealed

    def take_number(self) -> int:
        """The next packet number; raises when the nonce space would end."""
        number = self.next_number
        if number > MAX_PACKET_NUMBER:
            raise OverflowError("packet numbers exhausted: the connection must end")
        self.next_number = number + 1
        return number


class Opener:
    """The receiving direction: rebuilds packet numbers, refuses replays, opens packets."""

    __slots__ = ("_aead", "window")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a packet key is {KEY_SIZE} bytes")
        self._aead = ChaCha20Poly1305(key)
        self.window = ReplayWindow()

    def full_number(self, truncated: int, bits: int) -> int:
        return decode_packet_number(self.window.largest + 1, truncated, bits)

    def open(self, number: int, header: bytes, sealed: bytes) -> bytes | None:
        """The payload, or None when the packet is a replay or fails authentication.

        Nothing changes unless the packet authenticated; then its number is
        recorded in the replay window.
        """
        if self.window.seen(number) or len(sealed) < TAG_SIZE:
            return None
        try:
            payload: bytes = self._aead.decrypt(_nonce(number), sealed, header)
        except InvalidTag:
            return None
        self.window.accept(number)
        return payload

    def peek(self, number: int, header: bytes, sealed: bytes) -> bytes | None:
        """The payload if the packet authenticates, changing nothing (not even the
        replay window): for tools and tests that watch a link."""
        try:
            payload: bytes = self._aead.decrypt(_nonce(number), sealed, header)
        except InvalidTag:
            return None
        return payload

    def is_replay(self, number: int) -> bool:
        return self.window.seen(number)
