from __future__ import annotations

import pytest

from matchmaker.ratelimit import Rate, RateLimiter
from tests.matchmaker.fakes import FakeClock


def test_burst_then_refill() -> None:
    clock = FakeClock()
    rl = RateLimiter(Rate(rate=2.0, burst=3), clock=clock)
    assert [rl.allow("a") for _ in range(4)] == [True, True, True, False]
    clock.advance(0.49)
    assert not rl.allow("a")  # 0.98 tokens
    clock.advance(0.01)
    assert rl.allow("a") and not rl.allow("a")
    clock.advance(100)  # refill is capped at the burst
    assert [rl.allow("a") for _ in range(4)] == [True, True, True, False]


def test_keys_are_independent() -> None:
    rl = RateLimiter(Rate(rate=1.0, burst=1), clock=FakeClock())
    assert rl.allow("a") and not rl.allow("a")
    assert rl.allow("b")


def test_refused_requests_cost_nothing() -> None:
    clock = FakeClock()
    rl = RateLimiter(Rate(rate=1.0, burst=1), clock=clock)
    assert rl.allow("a")
    for _ in range(100):
        assert not rl.allow("a")
    clock.advance(1.0)
    assert rl.allow("a")


def test_cost() -> None:
    rl = RateLimiter(Rate(rate=1.0, burst=5), clock=FakeClock())
    assert rl.allow("a", cost=5) and not rl.allow("a", cost=1)


def test_clock_going_back_refills_nothing() -> None:
    clock = FakeClock()
    rl = RateLimiter(Rate(rate=1.0, burst=1), clock=clock)
    assert rl.allow("a")
    clock.advance(-50)
    assert not rl.allow("a")
    clock.advance(1.0)
    assert rl.allow("a")


def test_memory_is_bounded_under_a_flood_of_sources() -> None:
    rl = RateLimiter(Rate(rate=1.0, burst=1), max_keys=100, clock=FakeClock())
    for i in range(100_000):
        rl.allow(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert len(rl) == 100
    assert rl.evictions == 100_000 - 100


def test_lru_keeps_active_sources() -> None:
    rl = RateLimiter(Rate(rate=1.0, burst=1), max_keys=3, clock=FakeClock())
    rl.allow("hot")
    for i in range(10):
        assert not rl.allow("hot")  # touching it keeps it recent
        rl.allow(f"cold{i}")
    assert not rl.allow("hot")  # still drained: it was never evicted


def test_validation() -> None:
    with pytest.raises(ValueError):
        Rate(rate=0, burst=1)
    with pytest.raises(ValueError):
        Rate(rate=1, burst=0.5)
    with pytest.raises(ValueError):
        RateLimiter(Rate(rate=1, burst=1), max_keys=0)
