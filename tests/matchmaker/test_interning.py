"""Strings that hosts repeat are shared in bounded memory, never through sys.intern
(immortal on Python 3.12: every name a host registered under would stay for good)."""

from __future__ import annotations

import sys
import uuid

import pytest

from matchmaker import interning
from matchmaker.addresses import Address
from matchmaker.messages import Register, decode, decode_host, encode
from matchmaker.registry import MemoryRegistry
from tests.matchmaker.helpers import info


def fresh(prefix: str) -> str:
    """A string no earlier test made, built at run time (so not one of the code's constants)."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def test_equal_strings_share_one_copy() -> None:
    a = "".join(["de_", "dust", "2"])
    b = "".join(["de_d", "ust2"])
    assert a == b and a is not b
    assert interning.share(a) is interning.share(b)


def test_the_table_starts_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interning, "_TABLE", {})
    monkeypatch.setattr(interning, "LIMIT", 8)
    kept = [interning.share(fresh("m")) for _ in range(8)]
    assert interning.held() == 8
    late = fresh("m")
    assert interning.share(late) is late
    assert interning.held() == 1  # it started over: the first eight are no longer held
    assert all(interning.share(s) is s for s in kept)  # each comes back as its own copy


def test_the_table_never_holds_more_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interning, "_TABLE", {})
    for i in range(interning.LIMIT + 1000):
        interning.share(f"map-{i}")
    assert 0 < interning.held() <= interning.LIMIT


@pytest.mark.asyncio
async def test_host_strings_never_reach_sys_intern(monkeypatch: pytest.MonkeyPatch) -> None:
    interned: list[str] = []
    real = sys.intern

    def spy(text: str) -> str:
        interned.append(text)
        return real(text)

    monkeypatch.setattr(sys, "intern", spy)
    monkeypatch.setattr(interning, "_TABLE", {})  # no start-over between two asserts
    registry = MemoryRegistry()
    sent: set[str] = set()
    for n in range(3):
        host = info(
            f"srv{n}",
            game=fresh("g"),
            version=fresh("v"),
            map=fresh("m"),
            region=fresh("r"),
            tags=(fresh("t"), fresh("t")),
        )
        sent.update((host.game, host.version, host.map, host.region, *host.tags))
        blob = encode(Register(host=host))
        fast = decode_host(blob)  # the fast reader of stored hosts
        slow = decode(blob)  # the reader of requests
        assert isinstance(slow, Register)
        assert fast == slow.host == host
        record = await registry.upsert(Address(f"93.184.216.{n + 1}", 27015), fast, max_per_ip=10)
        assert record.info == host
        assert record.info.map is interning.share(host.map)
        assert record.info.tags[0] is interning.share(host.tags[0])
        stored = record.info
    monkeypatch.undo()
    assert not sent & set(interned), "a host's strings would stay for good on Python 3.12"
    # Caught too when sys.intern was bound before the spy: an equal string, interned
    # now, is the stored one only if the stored one was interned.
    for text in (stored.game, stored.version, stored.map, stored.region, *stored.tags):
        assert sys.intern("".join(list(text))) is not text
