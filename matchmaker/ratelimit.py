"""Token-bucket rate limits per source, in bounded memory.

Theory of operation
-------------------
Each key (an IPv4 address or an IPv6 /64, see `addresses.rate_key`) owns a
bucket of `burst` tokens refilled at `rate` tokens per second; a request
costs one token and is refused when the bucket is empty.  Buckets are created
lazily and kept in an LRU map of at most `max_keys` entries, so a flood of
spoofed source addresses costs at most `max_keys` small objects.

Evicting the least recently used bucket is nearly free of consequences: a
bucket idle for ``burst / rate`` seconds is full again anyway, so forgetting it
changes nothing.  Only when more than `max_keys` sources are active at once
can an evicted source come back with a fresh bucket; `evictions` counts that,
and the operator sizes `max_keys` above the expected number of active peers.

The clock is injected, so tests step it instead of sleeping.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Rate:
    """`rate` tokens per second, at most `burst` saved up."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst >= 1):
            raise ValueError("need rate > 0 and burst >= 1")


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class RateLimiter:
    """Token buckets keyed by source; `allow` is O(1)."""

    def __init__(
        self, rate: Rate, *, max_keys: int = 65536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.rate = rate
        self.max_keys = max_keys
        self.evictions = 0
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def allow(self, key: str, cost: float = 1.0) -> bool:
        """Take `cost` tokens from `key`'s bucket; False (and nothing taken) if short."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._new_bucket(key, now)
        else:
            self._buckets.move_to_end(key)
            elapsed = max(0.0, now - bucket.stamp)  # a clock step back refills nothing
            bucket.tokens = min(self.rate.burst, bucket.tokens + elapsed * self.rate.rate)
            bucket.stamp = now
        if bucket.tokens < cost:
            return False
        bucket.tokens -= cost
        return True

    def _new_bucket(self, key: str, now: float) -> _Bucket:
        if len(self._buckets) >= self.max_keys:
            self._buckets.popitem(last=False)
            self.evictions += 1
        bucket = _Bucket(self.rate.burst, now)
        self._buckets[key] = bucket
        return bucket
