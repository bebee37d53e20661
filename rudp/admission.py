"""What a server checks before it spends anything on a handshake: cookies, rates, reset tokens.

Theory of operation
-------------------
A server keeps no state for an address and computes no Diffie-Hellman until the
client has proven it receives packets there, like QUIC's Retry: the first CONNECT
gets a CHALLENGE carrying a cookie, and only a CONNECT that echoes a valid cookie
goes further (``Endpoint._receive_connect``).

Cookies: ``slot || HMAC-SHA256(key(slot), host, port, salt)[:16]`` where
``slot = floor(now / cookie_lifetime)`` and ``key(slot)`` is derived from a random
master secret, so the secret rotates every period with no state and the previous
period's cookies are still accepted. A cookie is used once: a replay cache
(bounded, expiring with the cookies) refuses a second connection from it.

Reset tokens: a NOCONN about connection id ``dcid`` carries
``HMAC-SHA256(reset secret, dcid)[:16]``, which the endpoint can recompute after
it forgot the connection; the peer learnt the token in the handshake and believes
no NOCONN without it. The reset secret derives from ``Config.static_key`` when
there is one, so a server that restarts with its key still ends its old clients'
connections at once.

Rates: NOCONNs are sent through a token bucket, so a flood of DATA for unknown
connection ids cannot make the endpoint a reflector of any size.

Sources (``SourceLimits``): a source is an IPv4 address or an IPv6 /64 (an end
site gets at least a /64, so single IPv6 addresses would let one machine rotate
through 2**64 of them). Each may hold at most ``max_connections_per_source``
connections, so that one source cannot take every slot of ``max_connections``,
and start at most ``handshake_rate_per_source`` handshakes a second (a token
bucket per source, in bounded memory), counted where a handshake starts to cost
a Diffie-Hellman: at the CONNECT with a valid cookie. Both are off (0) by
default.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import random
import struct
from collections import OrderedDict
from typing import Any, Final

COOKIE_MAC: Final = 16
REPLAY_CACHE_LIMIT: Final = 65536
_RESET_LABEL: Final = b"rudp reset secret"
_SLOT: Final = struct.Struct("!I")
_ROTATED_KEYS: Final = 4  # slot keys remembered before the cache starts over

Address = tuple[Any, ...]


class TokenBucket:
    """Classic token bucket on an injected clock."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def source_of(address: Address) -> str:
    """The unit of the per-source limits: an IPv4 address, or an IPv6 /64 (as text)."""
    ip = str(address[0])
    if ":" not in ip:
        return ip
    try:
        parsed = ipaddress.IPv6Address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)  # what a dual-stack socket reports for IPv4
    return parsed.packed[:8].hex() + "::/64"


class SourceLimits:
    """Connections held and handshakes started per source (module doc)."""

    def __init__(self, max_connections: int, rate: float, burst: int, max_keys: int) -> None:
        self.max_connections = max_connections
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._held: dict[str, int] = {}
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def may_start(self, address: Address, now: float) -> bool:
        """Whether the source of `address` may start one more handshake now."""
        if not self.rate:
            return True
        key = source_of(address)
        buckets = self._buckets
        bucket = buckets.get(key)
        if bucket is None:
            if len(buckets) >= self.max_keys:
                buckets.popitem(last=False)
            bucket = buckets[key] = TokenBucket(self.rate, self.burst, now)
        else:
            buckets.move_to_end(key)
        return bucket.take(now)

    def may_hold(self, address: Address) -> bool:
        """Whether the source of `address` may hold one more connection."""
        return not self.max_connections or (
            self._held.get(source_of(address), 0) < self.max_connections
        )

    def opened(self, address: Address) -> None:
        if self.max_connections:
            key = source_of(address)
            self._held[key] = self._held.get(key, 0) + 1

    def closed(self, address: Address) -> None:
        if self.max_connections:
            key = source_of(address)
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)


class CookieJar:
    """Stateless address-validation cookies, each good for one connection."""

    def __init__(self, lifetime: float, rng: random.Random) -> None:
        self._lifetime = lifetime
        self._master = rng.randbytes(32)
        self._keys: dict[int, hmac.HMAC] = {}
        self._used: OrderedDict[tuple[Address, int], float] = OrderedDict()
        # The REJECT text of the cookies whose connection was refused (a connect
        # token's refusal), to answer a resent CONNECT again: a subset of _used.
        self._refusals: dict[tuple[Address, int], str] = {}

    def make(self, address: Address, salt: int, now: float) -> bytes:
        slot = self._slot(now)
        return _SLOT.pack(slot) + self._mac(slot, address, salt)

    def valid(self, cookie: bytes, address: Address, salt: int, now: float) -> bool:
        """True for a cookie this jar made for ``address`` and ``salt``, this period or the last."""
        if len(cookie) != _SLOT.size + COOKIE_MAC:
            return False
        (slot,) = _SLOT.unpack_from(cookie)
        current = self._slot(now)
        if slot not in (current, (current - 1) & 0xFFFFFFFF):
            return False
        return hmac.compare_digest(cookie[_SLOT.size :], self._mac(slot, address, salt))

    def used(self, address: Address, salt: int) -> bool:
        """True when a connection was already made from this cookie."""
        return (address, salt) in self._used

    def remember(self, address: Address, salt: int, now: float) -> None:
        """A connection was made from this cookie: refuse it from now on (until it expires)."""
        used = self._used
        while used and (next(iter(used.values())) < now or len(used) >= REPLAY_CACHE_LIMIT):
            self._refusals.pop(used.popitem(last=False)[0], None)
        used[(address, salt)] = now + 2 * self._lifetime

    def refused(self, address: Address, salt: int, text: str) -> None:
        """The connection of this (remembered) cookie was refused with ``text``."""
        if (address, salt) in self._used:
            self._refusals[(address, salt)] = text

    def refusal(self, address: Address, salt: int) -> str | None:
        """The REJECT text this used cookie was refused with; None if it made a
        connection (or was not used)."""
        return self._refusals.get((address, salt))

    def _key(self, slot: int) -> hmac.HMAC:
        key = self._keys.get(slot)
        if key is None:
            if len(self._keys) > _ROTATED_KEYS:
                self._keys.clear()
            raw = hmac.digest(self._master, _SLOT.pack(slot & 0xFFFFFFFF), hashlib.sha256)
            key = self._keys[slot] = hmac.new(raw, digestmod=hashlib.sha256)
        return key

    def _mac(self, slot: int, address: Address, salt: int) -> bytes:
        msg = f"{address[0]}|{address[1]}|{salt}".encode()
        return _keyed_digest(self._key(slot), msg)[:COOKIE_MAC]

    def _slot(self, now: float) -> int:
        return int(now // self._lifetime) & 0xFFFFFFFF


class ResetTokens:
    """The reset token of each of our connection ids, recomputable after a restart.

    Bound to the peer's address too: a token of the id alone could be collected
    ahead of time, by anyone, from the NOCONNs answering DATA for ids not in use
    (2^32 of them, at the NOCONN rate), and then end whichever connection came to
    have that id. Bound to the address, it comes only in a NOCONN sent to that
    address. (A peer whose address changed since the handshake learns of our
    restart by its idle timeout instead.)"""

    def __init__(self, static_key: bytes | None, rng: random.Random) -> None:
        if static_key is not None:
            secret = hmac.digest(static_key, _RESET_LABEL, hashlib.sha256)
        else:
            secret = rng.randbytes(32)
        self._key = hmac.new(secret, digestmod=hashlib.sha256)

    def token(self, cid: int, address: Address) -> bytes:
        msg = f"{cid}|{address[0]}|{address[1]}".encode()
        return _keyed_digest(self._key, msg)[:16]


def _keyed_digest(key: hmac.HMAC, msg: bytes) -> bytes:
    """HMAC-SHA256 of ``msg`` under ``key``, an HMAC object keyed once and never fed:
    a copy of it is keyed already, which makes each MAC a third cheaper than
    ``hmac.digest`` keying OpenSSL's HMAC anew (one per CONNECT, spoofed or not)."""
    mac = key.copy()
    mac.update(msg)
    return mac.digest()
