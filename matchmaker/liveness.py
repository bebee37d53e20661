"""The daemon's half of the connectionless heartbeats (wire format: `matchmaker.heartbeat`).

Theory of operation
-------------------
`Liveness.receive` is the rudp socket's handler for the heartbeat bytes
(``0xB1``-``0xB7``).  A HEARTBEAT (or MOVING) is checked in this order, and every refusal
is counted in ``matchmaker_heartbeats_total`` under its reason:

1. it decodes (``truncated``, ``malformed``, ``unknown_type``);
2. the address it names is listed (``not_registered``: answered with a
   9-byte NOT_REGISTERED echoing the counter, so the host registers again at
   once);
3. its MAC is right for that registration's secret (``bad_mac``: a forgery,
   or a heartbeat of an older registration; no answer);
4. it comes from the address it names (``wrong_address``: a copy sent from
   elsewhere, or the host's NAT moved it; answered with a NOT_REGISTERED
   authenticated with the registration's secret, which a genuine host takes
   as "register again from where you are now");
5. its counter is above the last one accepted for this registration
   (``replayed``; no answer).

A stopping replica answers a genuine heartbeat with an authenticated
NOT_REGISTERED too (``stopping``).

NOT_REGISTERED replies are rate limited per source (`reply_limiter`, keyed like
every other per-source limit by `addresses.rate_key`): they go to wherever a
datagram claims to come from, so the matchmaker does not become a reflector of
them.  A heartbeat that would have had one beyond the limit is counted as
``unanswered`` instead.

Then the host is marked seen (written to the registry in one batch per
sweep, as before) and gets a HEARTBEAT_ACK, no larger than the heartbeat.  The
only per-host state is the registry entry itself: the secret is derived from
the shared key (`heartbeat.derive_secret`), the last counter lives in the
record (`HostRecord.beat`).  The counter is checked per replica: a heartbeat
recorded at one replica and replayed at another once can only keep a host
listed that was heartbeating anyway.  A shared registry also keeps the highest
counter accepted (written with the batch of each sweep), for takeovers.

**Takeover.**  A host whose replica does not answer (it died, or stopped, or
its answers were lost) sends its heartbeats to another replica as MOVING, a
kind only its move sends and its MAC covers: a genuine MOVING heartbeat makes
this replica the host's owner, for one datagram instead of a new registration.
It passed every check above (the MAC proves the registration, the address and
the intent to move; the counter is above the last one this replica accepted),
and `Registry.take_over` then checks, in one atomic step for a whole batch,
that the registration still stands (its token: a removed host is never put
back) and that its counter is above every one any replica accepted, and
writes that counter at once (``takeover_replayed`` otherwise).  Only then does
the host get its HEARTBEAT_ACK (``taken_over``); a registration that is gone
gets an authenticated NOT_REGISTERED (``not_registered``), and the host
registers.  While the registry cannot answer, the heartbeat goes unanswered
(``takeover_unavailable``) and the host's resend tries again.  A MOVING
heartbeat to the host's own replica goes the same way, so that one still in
flight when the host was taken over has its counter written too.

A plain HEARTBEAT never moves a host: one that reaches a replica that does not
own the host (a copy of a heartbeat on its way to the owner, replayed before
the owner wrote its counter at the next sweep) is counted ``not_owner`` and
answered like a stopping replica's (an authenticated NOT_REGISTERED, rate
limited per source, no larger than the heartbeat): the host only takes it from
the replica it heartbeats to, which then lost it, and moves.  A replayed MOVING
heartbeat is refused by the counter the takeover before it wrote.

Takeovers are limited per host (`takeover_limiter`, ``TAKEOVER_RATE``): each
costs a registry write and a stream event, and a host moving needs one or two;
the excess is counted ``takeover_limited`` and not answered (the host's resend
asks again).  A MOVING heartbeat replaced by a later one of the same host
before its batch ran is counted ``takeover_superseded`` (the later one is
answered).  A stopping replica neither takes a host over nor answers
(``takeover_stopping``): the host moves on to the next replica instead of
registering with one that would refuse it.

Introductions for a host go to its listed address as INTRODUCTION datagrams,
sent again every ``resend_interval`` seconds until the host acknowledges one
(INTRODUCTION_ACK, with a MAC) or ``attempts`` sends have gone out, or the host
is no longer listed or visible (``host_gone``: a host gone quiet is not sent
what it cannot answer).  Whoever asks for introductions chooses where these
datagrams go, among the listed hosts, so what one client's requests make the
daemon send is bounded:

- a client introduced again to a host that has not acknowledged its last
  introduction yet has one introduction waiting, not two: the newer replaces
  it (``coalesced``; the host gets the newest nonce), at its place in the
  resend schedule and with the sends it had left (one at least), so a host
  gets at most one datagram per ``resend_interval`` per client, however often
  that client asks;
- at most ``max_per_host`` introductions wait for one host, and
  ``max_per_source`` for the clients of one source (`addresses.rate_key`),
  each giving up its own oldest when full; at most ``max_pending`` wait in
  all, and when they do, the oldest of whichever host or source has the most
  is given up (a tie: the source's, all of whose introductions are its own
  asking), so a crowd of sources asking for one host (or one source asking
  for many) gives up its own introductions before anybody else's
  (``overflow``).

No I/O and no clock here: the caller passes ``now`` and a ``send`` function.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from matchmaker import heartbeat as hb
from matchmaker.addresses import Address, from_sockaddr, rate_key, source_key
from matchmaker.metrics import Metrics
from matchmaker.ratelimit import Rate, RateLimiter
from matchmaker.registry import HostRecord, Registry, Takeover, TakeoverResult

Send = Callable[[bytes, Address], None]
"""Sends one datagram from the daemon's rudp socket."""
REPLY_RATE = Rate(rate=2.0, burst=8.0)
"""NOT_REGISTERED replies per source: a genuine host needs one per re-registration."""
TAKEOVER_RATE = Rate(rate=1.0, burst=2.0)
"""Takeovers per host: a moving host needs one, two when a MOVING heartbeat was
still in flight when the first was taken."""


_K = TypeVar("_K", bound=Hashable)


@dataclass(slots=True)
class _Pending:
    address: Address
    """The host's."""
    client: Address | None
    """Whom it introduces (None: a relayed payload that does not say)."""
    source: str
    """The client's `rate_key` ("" when unknown)."""
    datagram: bytes
    left: int
    """Sends still allowed."""
    due: float


class _Groups(Generic[_K]):
    """The ids of the introductions waiting, by group (a host, a source), oldest
    first; the group with the most is found in O(1)."""

    __slots__ = ("_by_size", "_largest", "_members")

    def __init__(self) -> None:
        self._members: dict[_K, dict[int, None]] = {}
        self._by_size: dict[int, dict[_K, None]] = {}
        """Each size with the groups of that size."""
        self._largest = 0

    def count(self, key: _K) -> int:
        ids = self._members.get(key)
        return 0 if ids is None else len(ids)

    def oldest(self, key: _K) -> int:
        return next(iter(self._members[key]))

    def largest(self) -> tuple[_K, int]:
        """A group with the most (there must be one), and its size."""
        return next(iter(self._by_size[self._largest])), self._largest

    def add(self, key: _K, intro_id: int) -> None:
        ids = self._members.get(key)
        if ids is None:
            ids = self._members[key] = {}
        n = len(ids)
        if n:
            self._resize(key, n, None)
        ids[intro_id] = None
        self._resize(key, None, n + 1)
        self._largest = max(self._largest, n + 1)

    def discard(self, key: _K, intro_id: int) -> None:
        ids = self._members[key]
        n = len(ids)
        del ids[intro_id]
        if n > 1:
            self._resize(key, n, n - 1)
        else:
            del self._members[key]
            self._resize(key, n, None)
        if n == self._largest and n not in self._by_size:
            self._largest = n - 1  # the group just shrunk is of that size now, if any

    def _resize(self, key: _K, old: int | None, new: int | None) -> None:
        if old is not None:
            keys = self._by_size[old]
            del keys[key]
            if not keys:
                del self._by_size[old]
        if new is not None:
            self._by_size.setdefault(new, {})[key] = None


class Liveness:
    def __init__(
        self,
        registry: Registry,
        metrics: Metrics,
        *,
        on_leave: Callable[[HostRecord], None],
        on_takeover: Callable[[], None] = lambda: None,
        resend_interval: float = 0.5,
        attempts: int = 8,
        max_pending: int = 10_000,
        max_per_host: int = 64,
        max_per_source: int = 32,
        reply_limiter: RateLimiter | None = None,
        takeover_limiter: RateLimiter | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self._on_leave = on_leave
        self._on_takeover = on_takeover
        """Called when a takeover starts waiting (`take_takeovers` has work)."""
        self.resend_interval = resend_interval
        self.attempts = attempts
        if min(max_pending, max_per_host, max_per_source) < 1:
            raise ValueError("max_pending, max_per_host and max_per_source must be at least 1")
        self.max_pending = max_pending
        self.max_per_host = max_per_host
        self.max_per_source = max_per_source
        # `is None`, not `or`: an empty RateLimiter is falsy (it has a length).
        self.reply_limiter = RateLimiter(REPLY_RATE) if reply_limiter is None else reply_limiter
        """NOT_REGISTERED replies per source (module doc)."""
        self.takeover_limiter = (
            RateLimiter(TAKEOVER_RATE) if takeover_limiter is None else takeover_limiter
        )
        """Takeovers per host, keyed by its address (module doc)."""
        self.send: Send | None = None
        """Set once the socket exists; until then introductions are not sent."""
        self._seen: dict[Address, int] = {}
        """Hosts that proved themselves since the last flush, and their last counter."""
        self._takeovers: dict[Address, tuple[Takeover, tuple[Any, ...]]] = {}
        """Heartbeats of hosts another replica owns, waiting for `Registry.take_over`,
        with the source to answer."""
        self._pending: dict[int, _Pending] = {}
        self._pairs: dict[tuple[Address, Address | None], int] = {}
        """(host, client) -> the id of the introduction waiting for that host."""
        self._hosts: _Groups[Address] = _Groups()
        self._sources: _Groups[str] = _Groups()
        # Ids start at the wall clock's microseconds: a host keeps one record of the
        # ids each replica address sent it (taking none twice), and a process that
        # took the place of another there (a restart, a worker restarted behind the
        # same socket) must number above the ids the one before it sent; it would
        # take a million introductions a second to catch up with the clock. (A step
        # back of the wall clock between the two makes the hosts refuse the new one's
        # introductions until its ids pass the old ones.)
        self._ids = itertools.count(time.time_ns() // 1000 + 1)
        self.stopping = False
        """Set when the replica stops: heartbeats get NOT_REGISTERED, so that their
        hosts move to another replica at once; MOVING heartbeats get no answer."""
        self._counters: dict[str, Any] = {}
        self._ok = self._count("ok")
        self._deliveries = metrics.introduction_datagrams.labels

    def secret(self, record: HostRecord) -> bytes:
        """The heartbeat secret of `record`'s registration (what `Registered` hands out)."""
        return hb.derive_secret(self.registry.heartbeat_key, record.token, record.address)

    def take_seen(self) -> dict[Address, int]:
        """The hosts that proved themselves since the last call, with the counter of
        the last heartbeat accepted (kept by a shared registry for takeovers)."""
        seen, self._seen = self._seen, {}
        return seen

    def take_takeovers(self) -> list[tuple[Takeover, tuple[Any, ...]]]:
        """The takeovers waiting (each host once, its latest heartbeat), for one
        `Registry.take_over`; `settle` answers them."""
        waiting, self._takeovers = self._takeovers, {}
        return list(waiting.values())

    def settle(
        self,
        waiting: list[tuple[Takeover, tuple[Any, ...]]],
        results: list[TakeoverResult] | None,
    ) -> None:
        """Answer the heartbeats of `waiting` (None: the registry could not say)."""
        for n, (t, sockaddr) in enumerate(waiting):
            if results is None:
                self._count("takeover_unavailable").inc()  # the host's resend asks again
                continue
            secret = hb.derive_secret(self.registry.heartbeat_key, t.token, t.address)
            if results[n] is TakeoverResult.TAKEN:
                self._count("taken_over").inc()
                self._reply(hb.encode_ack(secret, t.address, t.beat), sockaddr)
            elif results[n] is TakeoverResult.REPLAYED:
                self._count("takeover_replayed").inc()
            else:
                for reply in self._not_registered(
                    "not_registered", sockaddr, t.beat, secret, t.address, proven=True
                ):
                    self._reply(reply, sockaddr)

    def _count(self, reason: str) -> Any:
        """The heartbeat counter of `reason`, looked up once (a label lookup costs
        more than the increment)."""
        counter = self._counters.get(reason)
        if counter is None:
            counter = self._counters[reason] = self.metrics.heartbeats.labels(reason)
        return counter

    def _reply(self, datagram: bytes, sockaddr: tuple[Any, ...]) -> None:
        source = _source(sockaddr)
        if source is not None:
            self._send(datagram, source)

    # -- incoming

    def receive(self, data: bytes, sockaddr: tuple[Any, ...]) -> list[bytes]:
        """The socket's handler for the heartbeat bytes: the replies to send back."""
        if data[:1] == bytes((hb.Kind.INTRODUCTION_ACK,)):
            self._introduction_ack(data)
            return []
        try:
            beat = hb.decode_beat(data)
        except hb.BeatError as exc:
            self._count(exc.reason).inc()
            return []
        return self._beat(beat, sockaddr)

    def _beat(self, beat: hb.Beat, sockaddr: tuple[Any, ...]) -> list[bytes]:
        record = self.registry.get(beat.address)
        if record is None:
            return self._not_registered("not_registered", sockaddr, beat.counter)
        secret = self.secret(record)
        if not hb.mac_ok(secret, beat.signed, beat.mac):
            self._count("bad_mac").inc()
            return []
        if not _from(sockaddr, beat.address):
            return self._not_registered(
                "wrong_address", sockaddr, beat.counter, secret, record.address
            )
        if beat.counter <= record.beat:
            self._count("replayed").inc()
            return []
        record.beat = beat.counter
        if beat.kind is hb.Kind.MOVING:
            return self._moving(beat, record, sockaddr)
        if self.stopping and beat.kind is hb.Kind.HEARTBEAT:
            return self._not_registered(
                "stopping", sockaddr, beat.counter, secret, record.address, proven=True
            )
        if beat.kind is hb.Kind.LEAVE:
            self._count("left").inc()
            self._on_leave(record)
        elif record.owner != self.registry.replica_id:
            # Only a MOVING heartbeat moves a host: this may be a copy of one on
            # its way to the owner (module doc).
            return self._not_registered(
                "not_owner", sockaddr, beat.counter, secret, record.address, proven=True
            )
        else:
            self._ok.inc()
            self._seen[record.address] = beat.counter
        return [hb.ack_of(secret, beat)]

    def _moving(self, beat: hb.Beat, record: HostRecord, sockaddr: tuple[Any, ...]) -> list[bytes]:
        """A genuine MOVING heartbeat: queued for `Registry.take_over` (module doc)."""
        if self.stopping:
            self._count("takeover_stopping").inc()  # the host tries the next replica
            return []
        if not self.takeover_limiter.allow(record.address.key):
            self._count("takeover_limited").inc()
            return []
        if record.address in self._takeovers:
            self._count("takeover_superseded").inc()  # the later one is answered
        self._takeovers[record.address] = (
            Takeover(record.address, record.token, beat.counter),
            sockaddr,
        )
        self._on_takeover()
        return []

    def _not_registered(
        self,
        reason: str,
        sockaddr: tuple[Any, ...],
        counter: int,
        secret: bytes | None = None,
        address: Address | None = None,
        *,
        proven: bool = False,
    ) -> list[bytes]:
        """A NOT_REGISTERED for `sockaddr` (authenticated for the registration at
        `address` with `secret`), unless that source had its share.  One that answers
        a heartbeat `proven` (its MAC good, its counter new, from the host's own
        address: only the host can send it) is never refused: a spoofer sending junk
        from the host's IP would otherwise spend the share and keep the host from
        learning it must move (a stopping replica) or register again."""
        source = _source(sockaddr)
        if source is None or (not proven and not self.reply_limiter.allow(rate_key(source.ip))):
            self._count("unanswered").inc()
            return []
        self._count(reason).inc()
        return [hb.encode_not_registered(counter, secret, address)]

    def _introduction_ack(self, data: bytes) -> None:
        try:
            intro_id, _ = hb.decode_introduction_ack(data)
        except hb.BeatError:
            self._count("malformed").inc()
            return
        pending = self._pending.get(intro_id)
        if pending is None:
            self._deliveries("late_ack").inc()
            return
        record = self.registry.get(pending.address)
        if record is None or not hb.introduction_ack_ok(self.secret(record), record.address, data):
            self._deliveries("bad_ack").inc()
            return
        self._drop(intro_id)
        self._deliveries("acked").inc()

    # -- introductions

    def introduce(
        self, record: HostRecord, payload: bytes, now: float, client: Address | None
    ) -> None:
        """Send `payload` (an encoded `Introduction` of `client`) to the host, until it
        acknowledges (module doc)."""
        intro_id = next(self._ids)
        datagram = hb.encode_introduction(self.secret(record), record.address, intro_id, payload)
        waiting = None if client is None else self._pairs.get((record.address, client))
        if waiting is not None:
            old = self._drop(waiting)  # its acknowledgement now counts as late
            self._add(
                intro_id,
                _Pending(record.address, client, old.source, datagram, max(old.left, 1), old.due),
            )
            self._deliveries("coalesced").inc()
            return
        source = "" if client is None else source_key(client.ip)
        self._make_room(record.address, source)
        self._add(
            intro_id,
            _Pending(
                record.address,
                client,
                source,
                datagram,
                self.attempts - 1,
                now + self.resend_interval,
            ),
        )
        self._send(datagram, record.address)
        self._deliveries("sent").inc()

    def _make_room(self, host: Address, source: str) -> None:
        """Give up what must go for one more introduction of `source` to `host`."""
        if self._hosts.count(host) >= self.max_per_host:
            self._overflow(self._hosts.oldest(host))
        if self._sources.count(source) >= self.max_per_source:
            self._overflow(self._sources.oldest(source))
        while len(self._pending) >= self.max_pending:
            busiest_host, host_count = self._hosts.largest()
            busiest_source, source_count = self._sources.largest()
            # A tie goes to the source: all of its introductions are its own asking,
            # whereas a host's may be anybody's.
            if source_count >= host_count:
                self._overflow(self._sources.oldest(busiest_source))
            else:
                self._overflow(self._hosts.oldest(busiest_host))

    def _overflow(self, intro_id: int) -> None:
        self._drop(intro_id)
        self._deliveries("overflow").inc()

    def _add(self, intro_id: int, p: _Pending) -> None:
        self._pending[intro_id] = p
        if p.client is not None:
            self._pairs[(p.address, p.client)] = intro_id
        self._hosts.add(p.address, intro_id)
        self._sources.add(p.source, intro_id)

    def _drop(self, intro_id: int) -> _Pending:
        p = self._pending.pop(intro_id)
        if p.client is not None:
            del self._pairs[(p.address, p.client)]
        self._hosts.discard(p.address, intro_id)
        self._sources.discard(p.source, intro_id)
        return p

    @property
    def pending(self) -> int:
        """Introductions waiting for their host's acknowledgement."""
        return len(self._pending)

    def resend(self, now: float) -> None:
        """Send again what is due; give up what has had all its sends, and what is
        for a host no longer listed or visible."""
        listed: dict[Address, bool] = {}
        registry_now = self.registry.now()
        for intro_id, p in list(self._pending.items()):
            if p.due > now:
                continue
            if p.left <= 0:
                self._drop(intro_id)
                self._deliveries("unacked").inc()
                continue
            visible = listed.get(p.address)
            if visible is None:
                record = self.registry.get(p.address)
                visible = record is not None and self.registry.is_visible(record, registry_now)
                listed[p.address] = visible
            if not visible:
                self._drop(intro_id)
                self._deliveries("host_gone").inc()
                continue
            p.left -= 1
            p.due = now + self.resend_interval
            self._send(p.datagram, p.address)
            self._deliveries("resent").inc()

    def _send(self, datagram: bytes, address: Address) -> None:
        if self.send is not None:
            self.send(datagram, address)


def _from(sockaddr: tuple[Any, ...], address: Address) -> bool:
    """Whether `sockaddr` is `address` (normalised, as `_source` gives it)."""
    if len(sockaddr) == 2 and sockaddr[0] == address.ip and sockaddr[1] == address.port:
        return True  # the kernel's text of an IPv4 source is the canonical one
    return _source(sockaddr) == address


def _source(sockaddr: tuple[Any, ...]) -> Address | None:
    try:
        return from_sockaddr(sockaddr)
    except ValueError:
        return None
