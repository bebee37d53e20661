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
"""

from __future__ import annotations

import hashlib
import hmac
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


class CookieJar:
    """Stateless address-validation cookies, each good for one connection."""

    def __init__(self, lifetime: float, rng: random.Random) -> None:
        self._lifetime = lifetime
        self._master = rng.randbytes(32)
        self._keys: dict[int, bytes] = {}
        self._used: OrderedDict[tuple[Address, int], float] = OrderedDict()

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
            used.popitem(last=False)
        used[(address, salt)] = now + 2 * self._lifetime

    def _key(self, slot: int) -> bytes:
        key = self._keys.get(slot)
        if key is None:
            if len(self._keys) > _ROTATED_KEYS:
                self._keys.clear()
            key = hmac.digest(self._master, _SLOT.pack(slot & 0xFFFFFFFF), hashlib.sha256)
            self._keys[slot] = key
        return key

    def _mac(self, slot: int, address: Address, salt: int) -> bytes:
        msg = f"{address[0]}|{address[1]}|{salt}".encode()
        return hmac.digest(self._key(slot), msg, hashlib.sha256)[:COOKIE_MAC]

    def _slot(self, now: float) -> int:
        return int(now // self._lifetime) & 0xFFFFFFFF


class ResetTokens:
    """The reset token of each of our connection ids, recomputable after a restart."""

    def __init__(self, static_key: bytes | None, rng: random.Random) -> None:
        if static_key is not None:
            self._secret = hmac.digest(static_key, _RESET_LABEL, hashlib.sha256)
        else:
            self._secret = rng.randbytes(32)

    def token(self, cid: int) -> bytes:
        return hmac.digest(self._secret, _SLOT.pack(cid), hashlib.sha256)[:16]
