"""The in-memory registry: the default, for a single matchmaker process.

Everything lives in one `LocalIndex` on the event loop's thread, so every
operation is a few dict operations and needs no locking.  Time comes from an
injected monotonic clock, which is what the tests step.

Expiry runs about once a second on the event loop, so it must not read every
host each time (~6 ms at 100,000 hosts, a stall for every list meanwhile):
each `expire()` checks the next slice of a snapshot of the records, a tenth
of them (`SWEEP_MIN` when that is more), so every host is checked within ten
sweeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from matchmaker.addresses import Address
from matchmaker.messages import HostInfo
from matchmaker.registry.base import (
    Change,
    ChangeKind,
    HostRecord,
    LocalIndex,
    Notice,
    NotRegistered,
    Registry,
    RemovalReason,
    TooManyHosts,
    new_token,
)

SWEEP_MIN = 5_000
"""Records one `expire()` checks at least (all of them, in a smaller registry)."""
SWEEP_ROUNDS = 10
"""Sweeps in which every record is checked once, in a larger one."""


class MemoryRegistry(Registry):
    def __init__(
        self,
        *,
        hide_after: float = 15.0,
        expire_after: float = 30.0,
        replica_id: str = "local",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(replica_id=replica_id, hide_after=hide_after, expire_after=expire_after)
        self._clock = clock
        self._index = LocalIndex()
        self._sweep: list[HostRecord] = []  # the snapshot expire() works through
        self._sweep_at = 0

    async def start(self) -> None:
        """Nothing to connect to or load."""

    def now(self) -> float:
        return self._clock()

    def index(self) -> LocalIndex:
        return self._index

    async def upsert(self, address: Address, info: HostInfo, *, max_per_ip: int) -> HostRecord:
        existing = self._index.get(address)
        if existing is None and self._index.source_count(address.ip) >= max_per_ip:
            raise TooManyHosts(address.ip)
        now = self.now()
        record = HostRecord(
            address=address,
            info=info,
            owner=self.replica_id,
            token=new_token(),
            registered_at=now,
            last_seen=now,
        )
        self._index.put(record)
        self._publish(Change(kind=ChangeKind.UPSERT, address=address, record=record))
        return record

    async def update(self, address: Address, token: str, info: HostInfo) -> HostRecord:
        old = self._index.get(address)
        if old is None or old.token != token:
            raise NotRegistered(str(address))
        record = HostRecord(
            address=address,
            info=info,
            owner=old.owner,
            token=token,
            registered_at=old.registered_at,
            last_seen=self.now(),
        )
        self._index.put(record)
        self._publish(Change(kind=ChangeKind.UPSERT, address=address, record=record))
        return record

    async def touch(self, addresses: Collection[Address]) -> set[Address]:
        now = self.now()
        return {a for a in addresses if not self._index.touch(a, now)}

    async def remove(
        self, address: Address, reason: RemovalReason, *, token: str | None = None
    ) -> bool:
        old = self._index.get(address)
        if old is None or (token is not None and old.token != token):
            return False
        self._index.pop(address)
        self._publish(Change(kind=ChangeKind.REMOVE, address=address, reason=reason))
        return True

    async def expire(self) -> list[HostRecord]:
        cutoff = self.now() - self.expire_after
        if self._sweep_at >= len(self._sweep):
            self._sweep, self._sweep_at = list(self._index), 0
        n = max(SWEEP_MIN, len(self._sweep) // SWEEP_ROUNDS)
        chunk = self._sweep[self._sweep_at : self._sweep_at + n]
        self._sweep_at += n
        # A record replaced since the snapshot is checked as its replacement, next round.
        dead = [r for r in chunk if r.last_seen < cutoff and self._index.get(r.address) is r]
        for r in dead:
            await self.remove(r.address, RemovalReason.EXPIRED, token=r.token)
        return dead

    async def deliver(self, owner: str, notice: Notice) -> None:
        # One process: every owner is us.
        self._receive_notice(notice)
