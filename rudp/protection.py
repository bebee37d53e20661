"""Packet protection: sealing with per-direction keys, packet numbers, replay window.

Theory of operation
-------------------
After a Noise handshake each side holds two 32-byte keys, one per direction
(``rudp.noise.HandshakeState.split``). Every packet is sealed under the sending
direction's key with AES-256-GCM when both sides allow it (``Config.aes_gcm``, stated
in the handshake), with ChaCha20-Poly1305 otherwise:

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

Why two ciphers: both take a 32-byte key, a 12-byte nonce and give a 16-byte tag,
so the wire is the same, but a call costs what OpenSSL spends setting the cipher
up, which is most of a small packet's cost: on a processor with AES instructions
(x86-64 since 2010, ARMv8 with its cryptography extension) an AES-256-GCM call
on a 200-byte packet takes about a third of a ChaCha20-Poly1305 one (0.43 against
1.24 us here, sealing or opening). Without those instructions ChaCha20-Poly1305 is
the faster, and a side turns ``Config.aes_gcm`` off. A nonce is never used twice
with one key under either, for the reason above.

**Key epochs (AES-256-GCM only).** AES-GCM's confidentiality bound wears with the
packets sealed under one key (RFC 9001, section 6.6, sets 2**23 for QUIC's largest
packets; ChaCha20-Poly1305's is past 2**62 numbers). So under AES-256-GCM the key
changes every ``KEY_EPOCH`` (2**22) packet numbers, both sides on their own with no
signal: packet ``n`` is sealed under the key of epoch ``n >> 22``, epoch 0's being
the handshake's and epoch ``e``'s HKDF-Expand (SHA-256) of it and ``e``, so any epoch
costs one derivation (a sender may skip numbers, 2**31 at a time). A receiver opens
its current epoch and the one before (late packets), and a later one up to
``MAX_EPOCH_SKIP`` ahead, entered once a packet authenticates under it; it keeps the
last such key it derived, so a forged number costs at most one derivation.

Why ``encrypt`` and ``decrypt``, not ``encrypt_into`` / ``decrypt_into``
(cryptography 47.0 and later): each call costs about 9,000 instructions whichever
it is (a cipher context set up, run and wiped per call), and sealing straight into
a datagram's buffer needs a bytearray, a memoryview and two slices of it per packet,
which cost more than the one allocation saved (callgrind, compiled: 17,100
instructions per 1,200-byte seal with ``encrypt`` and a concatenation, 20,800 with
``encrypt_into``). Opening into a reused buffer would save no call either, and
would hand out views of memory the next packet overwrites; ``decrypt`` returns
bytes of the packet's own, which the messages delivered are sliced from.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

KEY_SIZE: Final = 32
TAG_SIZE: Final = 16
# Packet numbers older than this much below the largest received are refused
# as possible replays. 1,024 packets is over a second of a busy 60 Hz stream with
# 16 packets per tick; a legitimate packet reordered by more than that is rare
# enough to count as lost (it is resent under a new number if reliable).
REPLAY_WINDOW: Final = 1024
# The sender stops before the nonce space ends; the connection must end first
# (2**62 packets: centuries at any real rate, but never a nonce reuse).
MAX_PACKET_NUMBER: Final = (1 << 62) - 1
# Under AES-256-GCM the key changes every 2**KEY_EPOCH_BITS packet numbers (above).
KEY_EPOCH_BITS: Final = 22
KEY_EPOCH: Final = 1 << KEY_EPOCH_BITS
# How many epochs ahead of its own a receiver follows: any number a 32-bit truncated
# number can decode to (a sender may skip numbers, up to 2**31 at a time).
MAX_EPOCH_SKIP: Final = 1 << (32 - KEY_EPOCH_BITS)
_KEY_UPDATE_INFO: Final = b"rudp/2 aes-256-gcm key epoch"
AES_256_GCM: Final = "aes-256-gcm"
CHACHA20_POLY1305: Final = "chacha20-poly1305"


def packet_aead(key: bytes, aes_gcm: bool) -> AESGCM | ChaCha20Poly1305:
    """The packet cipher under ``key``: AES-256-GCM or ChaCha20-Poly1305."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"a packet key is {KEY_SIZE} bytes")
    return AESGCM(key) if aes_gcm else ChaCha20Poly1305(key)


def epoch_key(key: bytes, epoch: int) -> bytes:
    """The AES-256-GCM key of packet-number epoch ``epoch`` (``key`` is the handshake's)."""
    if not epoch:
        return key
    info = _KEY_UPDATE_INFO + epoch.to_bytes(8, "big")
    derived: bytes = HKDFExpand(hashes.SHA256(), KEY_SIZE, info).derive(key)
    return derived


class PacketNumbersExhausted(Exception):
    """Internal: a packet would need a number past ``MAX_PACKET_NUMBER``. The
    connection catches it and ends (``DisconnectReason.EXHAUSTED``)."""


def decode_packet_number(expected: int, truncated: int, bits: int) -> int:
    """The full packet number closest to ``expected`` whose low ``bits`` are ``truncated``.

    ``expected`` is one more than the largest number received so far (RFC 9000,
    appendix A.3, where it is called ``expected_pn``).
    """
    window = 1 << bits
    half = window >> 1
    mask = window - 1
    candidate = (expected & ~mask) | truncated
    # RFC 9000's ``candidate < 2**62 - window``, written so that no operand needs more
    # than 62 bits: compiled, every number here stays a native integer.
    if candidate <= expected - half and candidate + window <= MAX_PACKET_NUMBER:
        return candidate + window
    if candidate > expected + half and candidate >= window:
        return candidate - window
    return candidate


def _nonce(number: int) -> bytes:
    return b"\x00\x00\x00\x00" + number.to_bytes(8, "little")


class ReplayWindow:
    """Which recent packet numbers were already accepted.

    ``largest`` is the largest accepted number (-1 before the first). ``_gaps`` holds
    the numbers below it that were skipped and have not arrived since, as half-open
    ranges flattened into one ascending list (``[start, end, start, end, ...]``):
    a number within the window (``largest - n < REPLAY_WINDOW``) was accepted exactly
    when it is in no range, i.e. when an even count of bounds is at or below it.

    Packets mostly arrive in order, and then there is nothing to record but
    ``largest``: no per-packet write to a table (the table of 1,024 slots this
    replaced, one boxed number per slot, cost a server a cache miss or two per
    packet: 3.4 % of its CPU in a 256-player game). A skip adds one range whatever
    its length, a late packet splits or trims one (a bisection), and ranges that
    fell out of the window are dropped as it moves: every packet costs a bounded
    number of steps, and the list at most ``REPLAY_WINDOW`` bounds plus the ranges
    that straddle the window's edge.
    ``accepted`` counts the numbers accepted: with ``largest``, what arrived of what
    the peer sent (its numbers start at 0 and count every packet), which
    ``ConnectionStats`` reports.
    """

    __slots__ = ("_gaps", "accepted", "largest")

    def __init__(self) -> None:
        self.largest = -1
        self._gaps: list[int] = []
        self.accepted = 0

    def seen(self, number: int) -> bool:
        """True when ``number`` must be refused: already accepted or too old to tell."""
        largest = self.largest
        if number > largest:
            return False
        if largest - number >= REPLAY_WINDOW:
            return True
        gaps = self._gaps
        if not gaps or number >= gaps[-1]:
            return True  # above every gap: it arrived
        return not bisect_right(gaps, number) & 1

    def accept(self, number: int) -> None:
        """Record ``number`` as received (after it authenticated, and ``seen`` was False)."""
        self.accepted += 1
        largest = self.largest
        gaps = self._gaps
        if number > largest:
            if number > largest + 1:
                gaps.append(largest + 1)
                gaps.append(number)
            self.largest = number
            if gaps and gaps[1] <= number - REPLAY_WINDOW:
                self._forget_old(number - REPLAY_WINDOW)
            return
        i = bisect_right(gaps, number)
        if not i & 1:
            return  # not in a gap: already recorded
        start = gaps[i - 1]
        end = gaps[i]
        if start == number:
            if end == number + 1:
                del gaps[i - 1 : i + 1]  # the gap was this number alone
            else:
                gaps[i - 1] = number + 1
        elif end == number + 1:
            gaps[i] = number
        else:
            gaps.insert(i, number + 1)  # split: [start, number) and [number + 1, end)
            gaps.insert(i, number)

    def _forget_old(self, floor: int) -> None:
        """Drop the ranges that end at or below ``floor``: out of the window."""
        gaps = self._gaps
        cut = 0
        while cut < len(gaps) and gaps[cut + 1] <= floor:
            cut += 2
        del gaps[:cut]

    @property
    def bits(self) -> int:
        """Bit ``i`` set when ``largest - i`` was accepted (for tests and tools)."""
        largest = self.largest
        out = 0
        for i in range(min(REPLAY_WINDOW, largest + 1)):
            if self.seen(largest - i):
                out |= 1 << i
        return out


class Sealer:
    """The sending direction: numbers packets and seals them."""

    __slots__ = ("_aead", "_epoch", "_key", "next_number")

    def __init__(self, key: bytes, aes_gcm: bool = False) -> None:
        self._aead = packet_aead(key, aes_gcm)
        self._key = key if aes_gcm else b""  # the handshake's key (AES-256-GCM only)
        self._epoch = 0
        self.next_number = 0

    def seal(self, number: int, header: bytes, payload: bytes) -> bytes:
        """``payload`` sealed under packet ``number``, with ``header`` authenticated.

        Raises ``PacketNumbersExhausted`` past ``MAX_PACKET_NUMBER``: every packet is
        sealed here, whoever numbered it, so no nonce is ever used twice.
        """
        if number > MAX_PACKET_NUMBER:
            raise PacketNumbersExhausted("packet numbers exhausted: the connection must end")
        if self._key and number >> KEY_EPOCH_BITS > self._epoch:
            self._epoch = number >> KEY_EPOCH_BITS
            self._aead = AESGCM(epoch_key(self._key, self._epoch))
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

    __slots__ = ("_aead", "_ahead", "_ahead_epoch", "_epoch", "_key", "_previous", "window")

    def __init__(self, key: bytes, aes_gcm: bool = False) -> None:
        self._aead = packet_aead(key, aes_gcm)
        self._key = key if aes_gcm else b""  # the handshake's key (AES-256-GCM only)
        self._epoch = 0
        # The cipher of the epoch before, for late packets.
        self._previous: AESGCM | ChaCha20Poly1305 | None = None
        # The last later epoch a packet asked for, and its cipher.
        self._ahead_epoch = -1
        self._ahead: AESGCM | ChaCha20Poly1305 | None = None
        self.window = ReplayWindow()

    def _cipher(self, number: int) -> AESGCM | ChaCha20Poly1305 | None:
        """The cipher packet ``number`` is sealed under, None when its epoch is not
        one this side opens (nothing is derived for it)."""
        if not self._key:
            return self._aead
        epoch = number >> KEY_EPOCH_BITS
        current = self._epoch
        if epoch == current:
            return self._aead
        if epoch == current - 1:
            return self._previous
        if 0 < epoch - current <= MAX_EPOCH_SKIP:
            if epoch != self._ahead_epoch:
                self._ahead_epoch = epoch
                self._ahead = AESGCM(epoch_key(self._key, epoch))
            return self._ahead
        return None

    def _entered_epoch(self, number: int, aead: AESGCM | ChaCha20Poly1305) -> None:
        """A packet of a later epoch authenticated under ``aead``: that epoch is now
        the current one."""
        epoch = number >> KEY_EPOCH_BITS
        self._previous = (
            self._aead if epoch == self._epoch + 1 else AESGCM(epoch_key(self._key, epoch - 1))
        )
        self._aead = aead
        self._epoch = epoch
        self._ahead_epoch = -1
        self._ahead = None

    def full_number(self, truncated: int, bits: int) -> int:
        return decode_packet_number(self.window.largest + 1, truncated, bits)

    def open(self, number: int, header: bytes, sealed: bytes) -> bytes | None:
        """The payload, or None when the packet is a replay or fails authentication.

        Nothing changes unless the packet authenticated; then its number is
        recorded in the replay window.
        """
        if self.window.seen(number) or len(sealed) < TAG_SIZE:
            return None
        return self.open_unseen(number, header, sealed)

    def open_unseen(self, number: int, header: bytes, sealed: bytes) -> bytes | None:
        """``open`` for a caller that already refused replays (``window.seen``)."""
        aead = self._aead
        if self._key and number >> KEY_EPOCH_BITS != self._epoch:
            other = self._cipher(number)  # another epoch: the one before, or a later one
            if other is None:
                return None
            aead = other
        try:
            payload: bytes = aead.decrypt(_nonce(number), sealed, header)
        except InvalidTag:
            return None
        if aead is not self._aead and aead is not self._previous:
            self._entered_epoch(number, aead)
        self.window.accept(number)
        return payload

    def peek(self, number: int, header: bytes, sealed: bytes) -> bytes | None:
        """The payload if the packet authenticates, changing nothing (not even the
        replay window): for tools and tests that watch a link."""
        aead = self._cipher(number)
        if aead is None:
            return None
        try:
            payload: bytes = aead.decrypt(_nonce(number), sealed, header)
        except InvalidTag:
            return None
        return payload

    def is_replay(self, number: int) -> bool:
        return self.window.seen(number)
