"""Connect tokens: a signed permission to connect to one host, for one client key.

Theory of operation
-------------------
An *issuer* (the matchmaker, or any backend holding its key) signs, with Ed25519,
a short statement: "the client whose Noise handshake key is ``client_key`` may
connect, until ``expires``, to the host whose static key is ``host_key``, at one
of ``addresses``; it is ``client_id`` and says ``user_data``". The client carries
the token in its first handshake message; the host checks it alone, with only the
issuer's *public* key: no call to the issuer, no shared secret a host could use to
mint tokens of its own (docs/security.md says why Ed25519 rather than netcode.io's
shared AEAD key).

* **Bound to the client.** ``client_key`` is the X25519 public key the client uses
  as its ephemeral key in the Noise handshake, so the host checks it against the
  key the handshake actually used. A copied token replayed by someone else either
  names a key that is not theirs (refused, ``token_wrong_client``) or makes the host
  answer a handshake that only the holder of the private key can finish.
* **Bound to the host.** ``host_key`` is the host's static X25519 key (the one the
  client authenticates with Noise NK); ``addresses`` lists where the issuer
  listed it. A host refuses a token naming another key, or (when it knows its own
  public addresses) none of its addresses.
* **Accepted once per host.** A bounded replay cache remembers a digest of every
  token accepted until the token expires.
* **Rotation.** A host accepts the tokens of up to two issuer keys at once
  (``MAX_ISSUERS``); each token names its key by a 4-byte id, so the host verifies
  one signature, never two.

Layout (version 1; integers in network byte order)::

    offset size  field
    0      1     version      1
    1      4     key_id       SHA-256(issuer public key)[:4]
    5      8     expires_ms   UNIX time in milliseconds after which it is refused
    13     8     client_id    chosen by the issuer
    21     32    client_key   the client's Noise handshake (ephemeral) public key
    53     32    host_key     the host's static public key
    85     1     n            number of addresses, 1..8
    86     ...   n x address  family u8 (4 or 6), 4 or 16 bytes, port u16
    ...    2     user_len     0..256
    ...    ...   user_data
    end-64 64    signature    Ed25519 over "rudp connect token" || every byte before it

This module is sans-IO: the wall-clock time comes in as ``now`` (UNIX seconds),
and nothing here touches a socket.
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

TOKEN_VERSION: Final = 1
MAX_USER_DATA: Final = 256
MAX_ADDRESSES: Final = 8
MAX_ISSUERS: Final = 2
KEY_SIZE: Final = 32
KEY_ID_SIZE: Final = 4
SIGNATURE_SIZE: Final = 64
REPLAY_CACHE_SIZE: Final = 16384
"""Tokens a host remembers at most; at 30-second tokens, 540 connections a second."""
DEFAULT_LIFETIME: Final = 30.0
"""Seconds a token stays good: enough for a handshake through loss, short enough that
a leaked token is soon worthless (netcode.io's default is the same order)."""
_CONTEXT: Final = b"rudp connect token"
_HEAD: Final = struct.Struct("!B4sQQ32s32sB")
_PORT: Final = struct.Struct("!H")
_LEN: Final = struct.Struct("!H")
_ADDRESS_SIZES: Final = {4: 4, 6: 16}
MIN_TOKEN_SIZE: Final = _HEAD.size + 1 + 4 + 2 + 2 + SIGNATURE_SIZE
MAX_TOKEN_SIZE: Final = _HEAD.size + MAX_ADDRESSES * 19 + 2 + MAX_USER_DATA + SIGNATURE_SIZE

Address = tuple[str, int]


class TokenRefusal(enum.StrEnum):
    """Why a host refused a connect token; each has its own counter."""

    MISSING = "token_missing"
    """The host requires a token and the client sent none."""
    TRUNCATED = "token_truncated"
    """Shorter than its layout says."""
    OVERSIZED = "token_oversized"
    """Longer than any valid token, or with too much user data or too many addresses."""
    MALFORMED = "token_malformed"
    """A field out of range (address family, port 0, no address, trailing bytes)."""
    UNKNOWN_VERSION = "token_version"
    """A token format this host does not know."""
    UNKNOWN_ISSUER = "token_unknown_issuer"
    """Signed by a key the host does not accept (never known, or retired)."""
    FORGED = "token_forged"
    """The signature does not verify: made or changed by someone without the key."""
    EXPIRED = "token_expired"
    """Past its expiry."""
    WRONG_CLIENT = "token_wrong_client"
    """Issued for another client's handshake key."""
    WRONG_HOST = "token_wrong_host"
    """Issued for another host (another static key, or none of this host's addresses)."""
    REPLAYED = "token_replayed"
    """Already accepted by this host."""


# What a refused client is told (REJECT text, at most 96 bytes): short, and enough to
# tell a missing token from a bad one and from an expired one.
REFUSAL_TEXT: Final = {
    TokenRefusal.MISSING: "this server requires a connect token",
    TokenRefusal.TRUNCATED: "connect token refused: truncated",
    TokenRefusal.OVERSIZED: "connect token refused: oversized",
    TokenRefusal.MALFORMED: "connect token refused: malformed",
    TokenRefusal.UNKNOWN_VERSION: "connect token refused: unknown version",
    TokenRefusal.UNKNOWN_ISSUER: "connect token refused: unknown or retired issuer key",
    TokenRefusal.FORGED: "connect token refused: bad signature",
    TokenRefusal.EXPIRED: "connect token refused: expired",
    TokenRefusal.WRONG_CLIENT: "connect token refused: issued for another client key",
    TokenRefusal.WRONG_HOST: "connect token refused: issued for another server",
    TokenRefusal.REPLAYED: "connect token refused: already used",
}


class TokenError(Exception):
    """A token was refused; ``refusal`` says why."""

    def __init__(self, refusal: TokenRefusal) -> None:
        super().__init__(REFUSAL_TEXT[refusal])
        self.refusal = refusal


@dataclass(frozen=True, slots=True)
class Token:
    """A decoded token; ``body`` is what the signature covers."""

    key_id: bytes
    expires: float
    """UNIX time (seconds) after which the token is refused."""
    client_id: int
    client_key: bytes
    host_key: bytes
    addresses: tuple[Address, ...]
    user_data: bytes
    body: bytes
    signature: bytes


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """What a host learned from a client's verified token (``conn.peer_identity``)."""

    client_id: int
    """The id the issuer gave the client (the matchmaker: random per introduction)."""
    user_data: bytes
    """Up to 256 bytes the issuer signed (account id, player name, team...)."""
    expires: float
    """UNIX time at which the token expired or expires."""
    key_id: bytes
    """Which issuer key signed it (``key_id(public)``)."""


def key_id(public: bytes) -> bytes:
    """The 4-byte id a token names its issuer key by."""
    return hashlib.sha256(public).digest()[:KEY_ID_SIZE]


def generate_issuer_key() -> bytes:
    """A new Ed25519 issuing key (32 private bytes) from the operating system's CSPRNG."""
    raw: bytes = Ed25519PrivateKey.generate().private_bytes_raw()
    return raw


def issuer_public_key(private: bytes) -> bytes:
    """The 32-byte public half of an issuing key: what hosts and clients are given."""
    raw: bytes = _private(private).public_key().public_bytes_raw()
    return raw


def _private(raw: bytes) -> Ed25519PrivateKey:
    if len(raw) != KEY_SIZE:
        raise ValueError(f"an Ed25519 private key is {KEY_SIZE} bytes, got {len(raw)}")
    return Ed25519PrivateKey.from_private_bytes(raw)


def normal_address(address: Address) -> Address:
    """``address`` with its host written one way: ``ipaddress``'s compressed lower-case
    form, an IPv4-mapped IPv6 address as the IPv4 address it maps. ValueError if the
    host is not an IP address or the port is out of range."""
    host, port = address
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port out of range in {address!r}")
    return (str(ip), port)


def _encode_address(address: Address) -> bytes:
    ip = ipaddress.ip_address(address[0])
    port = address[1]
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {address!r}")
    return bytes((ip.version,)) + ip.packed + _PORT.pack(port)


class Issuer:
    """Signs tokens with one Ed25519 key (the matchmaker, or a game backend)."""

    def __init__(self, private: bytes) -> None:
        self._key = _private(private)
        self.public_key: bytes = self._key.public_key().public_bytes_raw()
        self.key_id = key_id(self.public_key)

    def issue(
        self,
        *,
        client_key: bytes,
        host_key: bytes,
        addresses: Sequence[Address],
        client_id: int,
        now: float,
        lifetime: float = DEFAULT_LIFETIME,
        user_data: bytes = b"",
    ) -> bytes:
        """A token good until ``now + lifetime`` (UNIX seconds). ValueError on misuse."""
        if len(client_key) != KEY_SIZE or len(host_key) != KEY_SIZE:
            raise ValueError(f"client_key and host_key are {KEY_SIZE}-byte X25519 public keys")
        if not 1 <= len(addresses) <= MAX_ADDRESSES:
            raise ValueError(f"a token names 1 to {MAX_ADDRESSES} host addresses")
        if len(user_data) > MAX_USER_DATA:
            raise ValueError(f"user_data is at most {MAX_USER_DATA} bytes, got {len(user_data)}")
        if not 0 <= client_id < 1 << 64 or lifetime <= 0:
            raise ValueError("client_id must fit 64 bits and lifetime be > 0")
        expires_ms = int((now + lifetime) * 1000)
        body = bytearray(
            _HEAD.pack(
                TOKEN_VERSION,
                self.key_id,
                expires_ms,
                client_id,
                client_key,
                host_key,
                len(addresses),
            )
        )
        for address in addresses:
            body += _encode_address(address)
        body += _LEN.pack(len(user_data)) + user_data
        signature: bytes = self._key.sign(_CONTEXT + bytes(body))
        return bytes(body) + signature


def decode_token(data: bytes) -> Token:
    """The fields of a token, its signature unchecked; TokenError if malformed."""
    if len(data) > MAX_TOKEN_SIZE:
        raise TokenError(TokenRefusal.OVERSIZED)
    if len(data) < 1:
        raise TokenError(TokenRefusal.TRUNCATED)
    if data[0] != TOKEN_VERSION:
        raise TokenError(TokenRefusal.UNKNOWN_VERSION)
    if len(data) < MIN_TOKEN_SIZE:
        raise TokenError(TokenRefusal.TRUNCATED)
    _, kid, expires_ms, client_id, client_key, host_key, count = _HEAD.unpack_from(data)
    if count > MAX_ADDRESSES:
        raise TokenError(TokenRefusal.OVERSIZED)
    if count == 0:
        raise TokenError(TokenRefusal.MALFORMED)
    end = len(data) - SIGNATURE_SIZE
    pos = _HEAD.size
    addresses: list[Address] = []
    for _ in range(count):
        if pos >= end:
            raise TokenError(TokenRefusal.TRUNCATED)
        size = _ADDRESS_SIZES.get(data[pos])
        if size is None:
            raise TokenError(TokenRefusal.MALFORMED)
        if pos + 1 + size + 2 > end:
            raise TokenError(TokenRefusal.TRUNCATED)
        raw = data[pos + 1 : pos + 1 + size]
        host = str(ipaddress.IPv4Address(raw) if size == 4 else ipaddress.IPv6Address(raw))
        (port,) = _PORT.unpack_from(data, pos + 1 + size)
        if port == 0:
            raise TokenError(TokenRefusal.MALFORMED)
        addresses.append((host, port))
        pos += 1 + size + 2
    if pos + 2 > end:
        raise TokenError(TokenRefusal.TRUNCATED)
    (user_len,) = _LEN.unpack_from(data, pos)
    if user_len > MAX_USER_DATA:
        raise TokenError(TokenRefusal.OVERSIZED)
    pos += 2
    if pos + user_len > end:
        raise TokenError(TokenRefusal.TRUNCATED)
    if pos + user_len < end:
        raise TokenError(TokenRefusal.MALFORMED)
    return Token(
        key_id=kid,
        expires=expires_ms / 1000.0,
        client_id=client_id,
        client_key=client_key,
        host_key=host_key,
        addresses=tuple(addresses),
        user_data=data[pos:end],
        body=data[:end],
        signature=data[end:],
    )


def _issuer_keys(issuers: Sequence[bytes]) -> dict[bytes, Ed25519PublicKey]:
    if len(issuers) > MAX_ISSUERS:
        raise ValueError(f"at most {MAX_ISSUERS} issuer keys at once (the current and the next)")
    keys: dict[bytes, Ed25519PublicKey] = {}
    for public in issuers:
        if len(public) != KEY_SIZE:
            raise ValueError(f"an issuer key is {KEY_SIZE} bytes (Ed25519 public key)")
        kid = key_id(public)
        if kid in keys:
            raise ValueError("two issuer keys with the same key id: give two different keys")
        keys[kid] = Ed25519PublicKey.from_public_bytes(public)
    return keys


def open_token(data: bytes, issuers: Sequence[bytes]) -> Token:
    """A token whose signature verifies under one of ``issuers``; TokenError if not.

    What a client does with the token it was given, to learn the host key the
    issuer vouches for; hosts use ``TokenVerifier``, which checks the rest too.
    """
    return _signed(decode_token(data), _issuer_keys(issuers))


def _signed(token: Token, keys: dict[bytes, Ed25519PublicKey]) -> Token:
    public = keys.get(token.key_id)
    if public is None:
        raise TokenError(TokenRefusal.UNKNOWN_ISSUER)
    try:
        public.verify(token.signature, _CONTEXT + token.body)
    except InvalidSignature:
        raise TokenError(TokenRefusal.FORGED) from None
    return token


class TokenVerifier:
    """A host's check of connect tokens: signature, expiry, binding, replay.

    ``issuers``: the accepted issuer public keys (one, or two while rotating).
    ``host_key``: this host's static public key. ``addresses``: this host's public
    addresses, if it knows them (a token must then name one of them); empty,
    the host key alone binds the token to this host.
    """

    def __init__(
        self,
        issuers: Sequence[bytes],
        host_key: bytes,
        addresses: Sequence[Address] = (),
        *,
        cache_size: int = REPLAY_CACHE_SIZE,
    ) -> None:
        if not issuers:
            raise ValueError("a token verifier needs at least one issuer key")
        self._keys = _issuer_keys(issuers)
        self._host_key = host_key
        # Written one way, as the token's are when compared: "2001:DB8::1" and
        # "::ffff:192.0.2.1" name the same hosts as "2001:db8::1" and "192.0.2.1".
        self._addresses = frozenset(normal_address(address) for address in addresses)
        self._cache_size = cache_size
        # digest -> expiry; insertion order, so the oldest entries go first.
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self.evicted = 0
        """Unexpired entries pushed out by a full cache (see docs/security.md)."""

    def verify(self, data: bytes, client_key: bytes, now: float) -> PeerIdentity:
        """The identity in ``data``, presented by the handshake key ``client_key`` at
        UNIX time ``now``; the token is then spent. TokenError says why not."""
        token = decode_token(data)
        if token.key_id not in self._keys:
            raise TokenError(TokenRefusal.UNKNOWN_ISSUER)
        # The cheap checks before the signature's, so junk costs no Ed25519
        # verification; none of them accepts anything, the signature still decides.
        if now > token.expires:
            raise TokenError(TokenRefusal.EXPIRED)
        if token.client_key != client_key:
            raise TokenError(TokenRefusal.WRONG_CLIENT)
        if token.host_key != self._host_key:
            raise TokenError(TokenRefusal.WRONG_HOST)
        if self._addresses and self._addresses.isdisjoint(map(normal_address, token.addresses)):
            raise TokenError(TokenRefusal.WRONG_HOST)
        _signed(token, self._keys)
        digest = hashlib.blake2s(token.body, digest_size=16).digest()
        self._prune(now)
        if digest in self._seen:
            raise TokenError(TokenRefusal.REPLAYED)
        self._seen[digest] = token.expires
        return PeerIdentity(token.client_id, token.user_data, token.expires, token.key_id)

    def _prune(self, now: float) -> None:
        seen = self._seen
        while seen:
            oldest, expires = next(iter(seen.items()))
            if expires < now:
                del seen[oldest]
            elif len(seen) >= self._cache_size:
                # Full of live tokens: the oldest goes. It stays bound to its client's
                # key, so only that client could use it a second time.
                del seen[oldest]
                self.evicted += 1
            else:
                break

    def __len__(self) -> int:
        return len(self._seen)
