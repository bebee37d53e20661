"""Noise Protocol Framework handshakes (revision 34), sans-IO.

Theory of operation
-------------------
A Noise handshake is a fixed script of tokens (``e``, ``s``, ``ee``, ``es``, ``se``,
``ss``, ``psk``) that both sides run in lock step. Every token either puts a public key
on the wire or mixes a Diffie-Hellman result into a chaining key; every byte sent is
also hashed into a transcript hash ``h``, and once a key exists every payload and
static key is encrypted with ``h`` as associated data. Tampering with any byte of
any message therefore makes the next decryption fail, and both sides end with the
same ``h`` (the *handshake hash*, a channel binding) and two transport keys, one per
direction (``split()``).

This module is the spec's ``CipherState`` / ``SymmetricState`` / ``HandshakeState``
and nothing else: no sockets, no clock, no framing. The randomness it needs (the
ephemeral key) comes from ``cryptography``'s X25519 key generation, or is given by
the caller (the published test vectors fix it). The primitives are the
``cryptography`` package's X25519 and ChaCha20-Poly1305 and the standard library's
SHA-256, BLAKE2s and HMAC: nothing here is a hand-written primitive.

Supported names: ``Noise_<pattern>_25519_ChaChaPoly_<BLAKE2s|SHA256>`` where
``<pattern>`` is one of the one-way-free interactive patterns below, optionally with
``pskN`` modifiers (``NNpsk0``, ``NKpsk2``, ``IKpsk1+psk2``...). rudp itself uses
``NK`` (the client knows the server's static key) and ``NN`` (it does not);
the others are here because they cost a table entry and the published vectors
cover them, which checks the token machinery from more sides.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

DHLEN: Final = 32
TAGLEN: Final = 16
KEYLEN: Final = 32
HASHLEN: Final = 32
# The spec reserves 2**64 - 1; a cipher state refuses to reach it.
MAX_NONCE: Final = (1 << 64) - 1

# (pre-messages of the initiator, pre-messages of the responder, messages); messages
# alternate, the initiator's first. Noise spec section 7.
_PATTERNS: Final[
    dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, ...], ...]]]
] = {
    "NN": ((), (), (("e",), ("e", "ee"))),
    "NK": ((), ("s",), (("e", "es"), ("e", "ee"))),
    "NX": ((), (), (("e",), ("e", "ee", "s", "es"))),
    "XN": ((), (), (("e",), ("e", "ee"), ("s", "se"))),
    "XK": ((), ("s",), (("e", "es"), ("e", "ee"), ("s", "se"))),
    "XX": ((), (), (("e",), ("e", "ee", "s", "es"), ("s", "se"))),
    "KN": (("s",), (), (("e",), ("e", "ee", "se"))),
    "KK": (("s",), ("s",), (("e", "es", "ss"), ("e", "ee", "se"))),
    "KX": (("s",), (), (("e",), ("e", "ee", "se", "s", "es"))),
    "IN": ((), (), (("e", "s"), ("e", "ee", "se"))),
    "IK": ((), ("s",), (("e", "es", "s", "ss"), ("e", "ee", "se"))),
    "IX": ((), (), (("e", "s"), ("e", "ee", "se", "s", "es"))),
}

# The hash constructors; both have a 64-byte block (HMAC's pads, RFC 2104).
_HASHES: Final[dict[str, Callable[[bytes], Any]]] = {
    "SHA256": hashlib.sha256,
    "BLAKE2s": hashlib.blake2s,
}
_BLOCKLEN: Final = 64
_IPAD: Final = bytes(x ^ 0x36 for x in range(256))
_OPAD: Final = bytes(x ^ 0x5C for x in range(256))


class NoiseError(Exception):
    """A handshake or transport message failed to authenticate, or the state was misused."""


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The 32-byte raw public key of a private key."""
    raw: bytes = key.public_key().public_bytes_raw()
    return raw


def private_key(raw: bytes) -> X25519PrivateKey:
    """An X25519 private key from its 32 raw bytes."""
    if len(raw) != DHLEN:
        raise ValueError(f"an X25519 private key is {DHLEN} bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


def generate_key() -> bytes:
    """A new X25519 private key (32 bytes) from the operating system's CSPRNG: a
    server's ``Config.static_key``."""
    raw: bytes = X25519PrivateKey.generate().private_bytes_raw()
    return raw


def public_key(private: bytes) -> bytes:
    """The public key (32 bytes) of an X25519 private key: what clients are given as
    ``server_key``."""
    return public_bytes(private_key(private))


def ephemeral_key(rng: random.Random) -> X25519PrivateKey:
    """A fresh X25519 key drawn from ``rng``: the sans-IO core's injected randomness.

    The asyncio layer passes ``random.SystemRandom`` (the operating system's CSPRNG);
    a seeded ``random.Random`` makes every key predictable, and is for tests only.
    """
    return X25519PrivateKey.from_private_bytes(rng.randbytes(DHLEN))


def _dh(key: X25519PrivateKey, public: bytes) -> bytes:
    try:
        shared: bytes = key.exchange(X25519PublicKey.from_public_bytes(public))
        return shared
    except ValueError as exc:  # a low-order point gives the all-zero secret
        raise NoiseError("invalid public key") from exc


def _nonce(n: int) -> bytes:
    # ChaChaPoly in Noise: 32 bits of zeros, then the counter as 64-bit little-endian.
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


class CipherState:
    """A key and a counter nonce (Noise section 5.1)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key: bytes | None = None
        self.n = 0
        self._aead: ChaCha20Poly1305 | None = None
        if key is not None:
            self.initialize_key(key)

    def copy(self) -> CipherState:
        twin = CipherState()
        twin.key = self.key
        twin.n = self.n
        twin._aead = self._aead  # stateless: the nonce is given with each call
        return twin

    def initialize_key(self, key: bytes) -> None:
        self.key = key
        self.n = 0
        self._aead = ChaCha20Poly1305(key)

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce exhausted: rekey or start a new session")
        out: bytes = self._aead.encrypt(_nonce(self.n), plaintext, ad)
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self._aead is None:
            return ciphertext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce exhausted: rekey or start a new session")
        try:
            out: bytes = self._aead.decrypt(_nonce(self.n), ciphertext, ad)
        except InvalidTag as exc:
            raise NoiseError("message failed authentication") from exc
        self.n += 1
        return out


def _hmac(new: Callable[[bytes], Any], key: bytes, data: bytes) -> bytes:
    """HMAC (RFC 2104) over the hash constructor ``new``: the same bytes as
    ``hmac.digest``, without its per-call lookup of the hash by name (a third of an
    HKDF's cost). Noise keys it with chaining and temporary keys, never longer
    than a block."""
    if len(key) > _BLOCKLEN:
        key = new(key).digest()
    key = key.ljust(_BLOCKLEN, b"\x00")
    inner: bytes = new(key.translate(_IPAD) + data).digest()
    outer: bytes = new(key.translate(_OPAD) + inner).digest()
    return outer


class SymmetricState:
    """The chaining key and transcript hash (Noise section 5.2)."""

    def __init__(self, protocol_name: bytes, hash_name: str) -> None:
        self._new = _HASHES[hash_name]
        if len(protocol_name) <= HASHLEN:
            self.h = protocol_name.ljust(HASHLEN, b"\x00")
        else:
            self.h = self._hash(protocol_name)
        self.ck = self.h
        self.cipher = CipherState()

    def copy(self) -> SymmetricState:
        twin = SymmetricState(b"", "BLAKE2s")
        twin._new = self._new
        twin.h = self.h
        twin.ck = self.ck
        twin.cipher = self.cipher.copy()
        return twin

    @staticmethod
    def starting(script: _Script) -> SymmetricState:
        """The state ``InitializeSymmetric`` gives for ``script``'s protocol name."""
        state = SymmetricState(b"", "BLAKE2s")
        state._new = script.new
        state.h = state.ck = script.h
        return state

    def _hash(self, data: bytes) -> bytes:
        digest: bytes = self._new(data).digest()
        return digest

    def _hkdf(self, ikm: bytes, outputs: int) -> list[bytes]:
        new = self._new
        temp = _hmac(new, self.ck, ikm)
        out: list[bytes] = []
        previous = b""
        for i in range(1, outputs + 1):
            previous = _hmac(new, temp, previous + bytes((i,)))
            out.append(previous)
        return out

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = self._hkdf(ikm, 2)
        self.cipher.initialize_key(temp_k[:KEYLEN])

    def mix_hash(self, data: bytes) -> None:
        self.h = self._hash(self.h + data)

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = self._hkdf(ikm, 3)
        self.mix_hash(temp_h)
        self.cipher.initialize_key(temp_k[:KEYLEN])

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[bytes, bytes]:
        k1, k2 = self._hkdf(b"", 2)
        return k1[:KEYLEN], k2[:KEYLEN]


def parse_protocol_name(
    name: str,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, ...], ...], str]:
    """The token script and hash of a protocol name; ValueError for anything unsupported."""
    parts = name.split("_")
    if len(parts) != 5 or parts[0] != "Noise" or parts[2] != "25519" or parts[3] != "ChaChaPoly":
        raise ValueError(f"unsupported Noise protocol name {name!r}")
    if parts[4] not in _HASHES:
        raise ValueError(f"unsupported Noise hash {parts[4]!r}")
    pattern = parts[1]
    base = pattern[:2]
    if base not in _PATTERNS:
        raise ValueError(f"unsupported Noise pattern {pattern!r}")
    pre_i, pre_r, messages = _PATTERNS[base]
    script = [list(m) for m in messages]
    modifiers = pattern[2:]
    if modifiers:
        for modifier in modifiers.split("+"):
            if not modifier.startswith("psk") or not modifier[3:].isdigit():
                raise ValueError(f"unsupported Noise modifier {modifier!r}")
            index = int(modifier[3:])
            if index > len(script):
                raise ValueError(f"{modifier} names a message the pattern does not have")
            # psk0 opens the first message; pskN closes message N (section 9.2).
            if index == 0:
                script[0].insert(0, "psk")
            else:
                script[index - 1].append("psk")
    return pre_i, pre_r, tuple(tuple(m) for m in script), parts[4]


class _Script:
    """What a protocol name fixes, worked out once per name (``_script``): every
    handshake of the name starts from the same hash and chaining key."""

    def __init__(self, name: str) -> None:
        pre_i, pre_r, messages, hash_name = parse_protocol_name(name)
        self.pre_i = pre_i
        self.pre_r = pre_r
        self.messages = messages
        self.new = _HASHES[hash_name]
        self.psk_mode = any("psk" in m for m in messages)
        self.initiator_needs_s = bool(pre_i) or any("s" in m for m in messages[0::2])
        self.responder_needs_s = bool(pre_r) or any("s" in m for m in messages[1::2])
        protocol = name.encode("ascii")
        if len(protocol) <= HASHLEN:
            self.h: bytes = protocol.ljust(HASHLEN, b"\x00")
        else:
            self.h = self.new(protocol).digest()


_SCRIPTS: Final[dict[str, _Script]] = {}
# Names worked out once and kept. rudp uses two; an application may build
# HandshakeState with any valid name, and names beyond these are worked out each time.
_SCRIPTS_KEPT: Final = 64


def _script(name: str) -> _Script:
    script = _SCRIPTS.get(name)
    if script is None:
        script = _Script(name)
        if len(_SCRIPTS) < _SCRIPTS_KEPT:
            _SCRIPTS[name] = script
    return script


class HandshakeState:
    """One side of a Noise handshake (section 5.3).

    ``write_message(payload)`` and ``read_message(message)`` alternate as the
    pattern says, the initiator first. After the last message, ``complete`` is
    True, ``handshake_hash`` is the channel binding and ``split()`` gives the
    transport keys as (sending, receiving) for this side.
    """

    def __init__(
        self,
        protocol_name: str,
        *,
        initiator: bool,
        prologue: bytes = b"",
        static: X25519PrivateKey | None = None,
        remote_static: bytes | None = None,
        ephemeral: X25519PrivateKey | None = None,
        psks: Sequence[bytes] = (),
    ) -> None:
        script = _script(protocol_name)
        self._name = protocol_name
        self.initiator = initiator
        self._messages = script.messages
        self._index = 0
        self._symmetric = SymmetricState.starting(script)
        self._s = static
        self._e = ephemeral
        self._rs = remote_static
        self._re: bytes | None = None
        self._psks = list(psks)
        self._psk_mode = script.psk_mode
        for psk in self._psks:
            if len(psk) != 32:
                raise ValueError("a Noise pre-shared key is 32 bytes")
        self._symmetric.mix_hash(prologue)
        # Pre-messages: the initiator's keys are hashed first (section 7.1).
        for owner_is_initiator, tokens in ((True, script.pre_i), (False, script.pre_r)):
            for _static in tokens:  # every supported pre-message is one "s"
                mine = owner_is_initiator == initiator
                key = self._local_static_public() if mine else self._remote_static()
                self._symmetric.mix_hash(key)
        needs_s = script.initiator_needs_s if initiator else script.responder_needs_s
        if needs_s and static is None:
            raise ValueError(f"{protocol_name} needs this side's static key")

    def fork(self) -> HandshakeState:
        """An independent copy: read a message into it, and keep it only if the
        message authenticated (a forged message must not spoil the real state)."""
        # Field by field: a compiled (native) class cannot be copied by ``copy.copy``.
        twin = HandshakeState(
            self._name,
            initiator=self.initiator,
            static=self._s,
            remote_static=self._rs,
            ephemeral=self._e,
            psks=self._psks,
        )
        twin._index = self._index
        twin._re = self._re
        twin._symmetric = self._symmetric.copy()
        return twin

    def _local_static_public(self) -> bytes:
        if self._s is None:
            raise ValueError("this pattern needs this side's static key")
        return public_bytes(self._s)

    def _remote_static(self) -> bytes:
        if self._rs is None:
            raise ValueError("this pattern needs the peer's static public key")
        return self._rs

    @property
    def complete(self) -> bool:
        return self._index >= len(self._messages)

    @property
    def handshake_hash(self) -> bytes:
        return self._symmetric.h

    @property
    def remote_static(self) -> bytes | None:
        return self._rs

    @property
    def remote_ephemeral(self) -> bytes | None:
        return self._re

    def _my_turn(self) -> bool:
        return (self._index % 2 == 0) == self.initiator

    def write_message(self, payload: bytes = b"") -> bytes:
        if self.complete or not self._my_turn():
            raise NoiseError("not this side's turn to write a handshake message")
        sym = self._symmetric
        out = bytearray()
        for token in self._messages[self._index]:
            if token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.generate()
                pub = public_bytes(self._e)
                out += pub
                sym.mix_hash(pub)
                if self._psk_mode:
                    sym.mix_key(pub)
            elif token == "s":
                out += sym.encrypt_and_hash(self._local_static_public())
            elif token == "psk":
                sym.mix_key_and_hash(self._next_psk())
            else:
                sym.mix_key(self._dh_token(token))
        out += sym.encrypt_and_hash(payload)
        self._index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        if self.complete or self._my_turn():
            raise NoiseError("not this side's turn to read a handshake message")
        sym = self._symmetric
        pos = 0
        for token in self._messages[self._index]:
            if token == "e":
                if len(message) - pos < DHLEN:
                    raise NoiseError("handshake message truncated")
                self._re = message[pos : pos + DHLEN]
                pos += DHLEN
                sym.mix_hash(self._re)
                if self._psk_mode:
                    sym.mix_key(self._re)
            elif token == "s":
                size = DHLEN + TAGLEN if sym.cipher.has_key else DHLEN
                if len(message) - pos < size:
                    raise NoiseError("handshake message truncated")
                self._rs = sym.decrypt_and_hash(message[pos : pos + size])
                pos += size
            elif token == "psk":
                sym.mix_key_and_hash(self._next_psk())
            else:
                sym.mix_key(self._dh_token(token))
        if sym.cipher.has_key and len(message) - pos < TAGLEN:
            raise NoiseError("handshake message truncated")
        payload = sym.decrypt_and_hash(message[pos:])
        self._index += 1
        return payload

    def _next_psk(self) -> bytes:
        if not self._psks:
            raise ValueError("this pattern needs a pre-shared key")
        return self._psks.pop(0)

    def _dh_token(self, token: str) -> bytes:
        # The first letter names the initiator's key, the second the responder's.
        first, second = token[0], token[1]
        local, remote = (first, second) if self.initiator else (second, first)
        key = self._e if local == "e" else self._s
        peer = self._re if remote == "e" else self._rs
        if key is None or peer is None:
            raise NoiseError(f"token {token} needs a key this side does not have")
        return _dh(key, peer)

    def split(self) -> tuple[bytes, bytes]:
        """The transport keys for this side: (sending, receiving)."""
        if not self.complete:
            raise NoiseError("the handshake is not complete")
        k1, k2 = self._symmetric.split()
        return (k1, k2) if self.initiator else (k2, k1)
