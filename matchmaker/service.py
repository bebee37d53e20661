"""The matchmaker service: rudp connections in, registry operations and replies out.

Theory of operation
-------------------
`MatchmakerService.handle` is the rudp ``serve`` handler: it runs once per
accepted connection, reads messages until the connection ends, and answers
each one.  The transport is anything shaped like `Peer` (a `rudp.Connection`
is one; the tests use an in-memory fake), so this module never touches a
socket.

Per message: decode and validate (`messages.decode_request`; a bad message
gets an `Error` with the reason code, a foreign protocol version gets
`WrongVersion`), apply the per-source rate limit, then one handler per type.
A host is keyed by the connection's *observed* address, so a host can only
register itself, and a restarted host replaces its own old entry.  That is
the address the connection has at each request: a rudp connection can move
(a NAT rebinding, validated by rudp), and its requests then act at its new
address.

Liveness: a host registers over a connection, gets a heartbeat secret in
`Registered`, and may then close the connection: it stays listed with
connectionless heartbeat datagrams on the same port (`matchmaker.liveness`,
wire format in `matchmaker.heartbeat`), so a listed host costs the daemon its
registry entry and nothing else.  A `Heartbeat` message over a connection
still counts too.  Heartbeats are batched and written to the registry once
per sweep (one registry call per second, not one per host); a host the
registry no longer knows gets ``not_registered`` back and re-registers.  The
end of a connection removes nothing: a host leaves with `Unregister`, a LEAVE
datagram, or by going silent until ``expire_after``.  `Update` and
`Unregister` act on the entry at the connection's observed address, whichever
connection carried the registration.  On shutdown the replica first stops
accepting (new connections are closed at once, `Register` is refused with
``shutting_down``), then closes its connections and no longer acknowledges
heartbeats: the hosts send their heartbeats to another replica, which takes
the entry over (`run_takeovers`), or register there, and lists do not flicker
meanwhile.

List answers are cut into pages (`listing.paginate_positions`, then by encoded
size) and sent by a task of their own, so a long list does not block the
connection's other requests.  A connection's answers go one at a time, in the
order asked: at most ``lists_per_connection`` may be unanswered (one being sent,
the rest waiting as their requests, nothing planned yet), and one more is refused
with ``rate_limited`` (counted as ``busy``).  An answer whose pages are all handed
to rudp no longer counts as unanswered (the client may have it whole and ask
again before its acknowledgment is back), though the next one still waits for
that acknowledgment; it counts as sent (``ok``) once its last page is
acknowledged.  What a client has not acknowledged is what the daemon
holds for it, so it is bounded three ways: ``pages_in_flight`` pages per
connection, ``list_bytes_in_flight`` bytes of pages for every connection together
(`_ListBudget`), and ``list_ack_timeout``: a connection whose pages go that long
without any acknowledgement is closed (``unacknowledged``).  A client that keeps
its connection alive but never acknowledges (never reads, or drops what it
receives) thus holds one window of one answer, for a while, not every answer it
asks for until rudp's send queue overflows.

Introductions: the client and the host each get an `Introduction` with the
other's public address, the LAN address too when both share a public IP, and
the same random nonce.  A LAN address must be a private one
(`addresses.lan_reason`, checked at `Register` and `Introduce`): the peer
behind the same public IP connects to it, and must not be aimed elsewhere.
The client's also carries the host's registered key and, when it sent its
handshake key and the daemon has an issuing key, a connect token for that host
(`rudp.tokens`, signed with the key of `matchmaker.keys`).  The host's copy
goes out as a datagram to its heartbeat address, repeated until the host
acknowledges it (`matchmaker.liveness` bounds what that sends); when the host
heartbeats another replica (its ``owner``) the registry relays the payload
there (`Registry.deliver`), since only that replica's datagrams pass the
host's NAT.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import random
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from matchmaker import __version__
from matchmaker.addresses import (
    Address,
    from_sockaddr,
    lan_reason,
    non_public_reason,
    same_public_ip,
    source_key,
)
from matchmaker.listing import paginate_positions, size_cuts
from matchmaker.liveness import REPLY_RATE, TAKEOVER_RATE, Liveness
from matchmaker.logging import CONNECTION
from matchmaker.messages import (
    DEFAULT_LIMITS,
    NONCE_BYTES,
    Error,
    ErrorReason,
    Heartbeat,
    HostEntry,
    HostInfo,
    InfoReply,
    InfoRequest,
    Introduce,
    Introduction,
    ListPage,
    ListRequest,
    Message,
    MessageError,
    Ok,
    Register,
    Registered,
    Request,
    Role,
    Unregister,
    Update,
    WrongVersion,
    WrongVersionError,
    decode,
    decode_request,
    encode,
    encode_entry,
    encode_page,
)
from matchmaker.metrics import Metrics
from matchmaker.ratelimit import RateLimiter
from matchmaker.registry import (
    HostRecord,
    Notice,
    NotRegistered,
    Registry,
    RegistryUnavailable,
    RemovalReason,
    TooManyHosts,
)
from matchmaker.registry.base import Listing, list_entry
from matchmaker.settings import Settings
from matchmaker.transport import TRANSPORT_ERRORS, Peer
from rudp.tokens import Issuer

log = structlog.get_logger("matchmaker.service")

SOFTWARE = f"matchmaker/{__version__}"
_LIST_ABANDONED: tuple[type[BaseException], ...] = (*TRANSPORT_ERRORS, asyncio.CancelledError)
# msgpack overhead of a page around its entries (envelope, seq, total, end).
_STOPPING = "matchmaker shutting down: use another replica"
_PAGE_OVERHEAD = 48
_PARTIAL_BYTES = 9  # "partial": true, on the pages of a partial answer
_TOO_BIG = "host: too large to list (shorter name, map, tags or info)"

_Page = tuple[list[int], list[bytes]]
"""One list page: its hosts' positions in the answer's `Listing`, and their encoded entries."""


class _Session:
    """One connection's state."""

    __slots__ = (
        "address",
        "conn",
        "handed",
        "listing",
        "lists",
        "peer",
        "sockaddr",
        "source",
        "tasks",
    )

    def __init__(self, peer: Peer, address: Address, conn: int) -> None:
        self.peer = peer
        self.address = address
        self.conn = conn
        """The connection's number, in its log lines (``conn``)."""
        self.sockaddr: tuple[Any, ...] = peer.remote_address
        """What `address` was made from (a move shows as a different tuple)."""
        self.source = source_key(address.ip)
        """The unit of the per-source rate limits (`addresses.rate_key`)."""
        self.tasks: set[asyncio.Task[None]] | None = None
        """Its background replies (list pages), made on the first one."""
        self.lists: deque[ListRequest] | None = None
        """List requests unanswered: the one being sent first, then those waiting."""
        self.listing = False
        """Whether an answer is being sent (by `MatchmakerService._send_lists`)."""
        self.handed = False
        """Whether every page of the answer being sent (the head of ``lists``) is handed
        to rudp: the client may have it all, and ask again, before its acknowledgment
        of the last page is back; it no longer counts as unanswered."""


class MatchmakerService:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        metrics: Metrics,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
        issuer: Issuer | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metrics = metrics
        self._limits = settings.limits
        self._rng = rng or random.Random()
        self._clock = clock
        self._nonce = nonce
        self._issuer = issuer
        """Signs the connect token of every introduction (None: introductions carry none)."""
        self._wall = wall
        """UNIX time, for token expiry (hosts check it against their own clocks)."""
        keys = settings.rate_limit_keys
        self._register_limit = RateLimiter(settings.register_bucket, max_keys=keys, clock=clock)
        self._list_limit = RateLimiter(settings.list_bucket, max_keys=keys, clock=clock)
        self.list_budget = _ListBudget(settings.list_bytes_in_flight)
        """Unacknowledged list page bytes, every connection's together."""
        self._introduce_limit = RateLimiter(settings.introduce_bucket, max_keys=keys, clock=clock)
        self._sessions: dict[Address, _Session] = {}
        self._takeover_due = asyncio.Event()
        self._beats: set[Address] = set()
        """Hosts that sent a `Heartbeat` message since the last flush."""
        self.liveness = Liveness(
            registry,
            metrics,
            on_leave=self._leave,
            on_takeover=self._takeover_due.set,
            reply_limiter=RateLimiter(REPLY_RATE, max_keys=keys, clock=clock),
            takeover_limiter=RateLimiter(TAKEOVER_RATE, max_keys=keys, clock=clock),
        )
        """The connectionless heartbeats and introductions (the socket's handler)."""
        self._background: set[asyncio.Task[None]] = set()
        self._intro_due = asyncio.Event()
        self._ids = itertools.count(1)
        self._registrations = {
            result: metrics.registrations.labels(result)
            for result in ("created", "replaced", "rejected", "unavailable", "rate_limited")
        }
        self.shutting_down = False
        # Set once the background loops must end (`stop_loops`): each looks at it
        # between two rounds, since redis-py can swallow their cancellation.
        self.loops_stopped = False

    @property
    def connections(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ connections

    async def handle(self, peer: Peer) -> None:
        """Serve one connection until it ends (the rudp ``serve`` handler)."""
        if self.shutting_down:
            # A stopping replica takes no one new: the host goes to another replica.
            await peer.close(text=_STOPPING)
            return
        address = from_sockaddr(peer.remote_address)
        session = _Session(peer, address, next(self._ids))
        self._sessions[address] = session
        # Every line this connection causes carries peer and conn.  (No line per
        # connection opened or closed: with a connection per registration, they
        # and the context manager were a tenth of its cost; metrics count them.)
        bound = CONNECTION.set((address.key, session.conn))
        try:
            async for received in peer:
                if peer.remote_address is not session.sockaddr:
                    self._follow(session)
                await self._on_data(session, received.data)
        finally:
            self._end(session)
            CONNECTION.reset(bound)

    def _follow(self, session: _Session) -> None:
        """Take the peer's current address: a rudp connection can migrate (a NAT
        rebinding), and a request speaks for where it comes from now."""
        sockaddr = session.peer.remote_address
        try:
            current = from_sockaddr(sockaddr)
        except ValueError:
            return
        session.sockaddr = sockaddr
        if current == session.address:
            return
        if self._sessions.get(session.address) is session:
            del self._sessions[session.address]
        log.info("connection_moved", to=current.key)
        session.address = current
        session.source = source_key(current.ip)
        self._sessions[current] = session

    def _end(self, session: _Session) -> None:
        # The host's entry stays: it lives on heartbeat datagrams (module doc).
        for task in session.tasks or ():
            task.cancel()
        if self._sessions.get(session.address) is session:
            del self._sessions[session.address]

    def _leave(self, record: HostRecord) -> None:
        """A host's LEAVE datagram: remove its registration (in the background)."""
        task = asyncio.create_task(self._remove(record, RemovalReason.UNREGISTERED))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _remove(self, record: HostRecord, reason: RemovalReason) -> None:
        try:
            removed = await self.registry.remove(record.address, reason, token=record.token)
        except RegistryUnavailable:
            return  # the entry expires on its own
        if removed:
            self.metrics.removals.labels(reason.value).inc()
            log.info("host_removed", host=record.address.key, game=record.info.game, reason=reason)

    # ------------------------------------------------------------------ dispatch

    async def _on_data(self, session: _Session, data: bytes) -> None:
        try:
            request = decode_request(data, self._limits)
        except WrongVersionError as exc:
            self._drop(exc, data)
            self._send(session, WrongVersion(request_id=exc.request_id))
            return
        except MessageError as exc:
            self._drop(exc, data)
            self._send(session, _error(exc))
            return
        try:
            await self._dispatch(session, request)
        except MessageError as exc:
            self._drop(exc, data)
            self._send(session, _error(exc))
        # A bug in a handler must cost one request, not the connection or the daemon.
        except Exception:
            log.exception("request_failed", type=type(request).__name__)
            reply = Error(request_id=request.request_id, reason=ErrorReason.INTERNAL)
            self._send(session, reply)

    def _drop(self, exc: MessageError, data: bytes) -> None:
        self.metrics.dropped.labels(exc.reason.value).inc()
        # Rate-limited requests come in floods: the counter is enough at info level.
        level = log.debug if exc.reason is ErrorReason.RATE_LIMITED else log.info
        level("request_rejected", reason=exc.reason, detail=exc.detail, size=len(data))

    async def _dispatch(self, session: _Session, request: Request) -> None:
        match request:
            case Register():
                await self._register(session, request)
            case Update():
                await self._update(session, request)
            case Unregister():
                await self._unregister(session, request)
            case Heartbeat():
                self._heartbeat(session, request)
            case ListRequest():
                self._list(session, request)
            case InfoRequest():
                self._send(session, self.info_reply(request.request_id))
            case Introduce():
                await self._introduce(session, request)

    def _send(self, session: _Session, msg: Message) -> Awaitable[None] | None:
        """Queue `msg`; None (and the connection closed) if the transport refused it."""
        return self._send_bytes(session, encode(msg))

    def _send_bytes(self, session: _Session, data: bytes) -> Awaitable[None] | None:
        try:
            return session.peer.send(data)
        # Queue full or connection over: this connection cannot be served any more.
        except TRANSPORT_ERRORS as exc:
            self.metrics.dropped.labels("send_failed").inc()
            log.info("send_failed", error=type(exc).__name__)
            self._spawn(session, session.peer.close(text="send failed"))
            return None

    def _spawn(self, session: _Session, coro: Awaitable[object]) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception:  # a background reply must not fail silently
                log.exception("background_reply_failed")

        task = asyncio.create_task(run())
        if session.tasks is None:
            session.tasks = set()
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)
        if isinstance(coro, Coroutine):
            # Cancelled before it ran (the connection ended first): not a leak.
            task.add_done_callback(lambda _: coro.close())

    def _rate_limited(self, limiter: RateLimiter, kind: str, session: _Session) -> bool:
        if limiter.allow(session.source):
            return False
        self.metrics.rate_limited.labels(kind).inc()
        return True

    # ------------------------------------------------------------------ hosts

    async def _register(self, session: _Session, req: Register) -> None:
        rid = req.request_id
        counted = self._registrations
        if self.shutting_down:
            counted["rejected"].inc()
            raise MessageError(ErrorReason.SHUTTING_DOWN, _STOPPING, request_id=rid)
        if not self.registry.ready:
            # A shared registry not loaded yet does not know the replicas' heartbeat
            # key: a secret handed out now would not be the one they check.
            counted["unavailable"].inc()
            raise MessageError(ErrorReason.UNAVAILABLE, "registry loading", request_id=rid)
        if self._rate_limited(self._register_limit, "register", session):
            counted["rate_limited"].inc()
            raise MessageError(ErrorReason.RATE_LIMITED, "registrations", request_id=rid)
        why = None if self.settings.allow_private else non_public_reason(session.address.ip)
        if why is not None:
            counted["rejected"].inc()
            raise MessageError(ErrorReason.FORBIDDEN_ADDRESS, why, request_id=rid)
        if req.host.lan is not None:
            why = lan_reason(req.host.lan.ip, session.address.ip)
            if why is not None:
                counted["rejected"].inc()
                raise MessageError(ErrorReason.BAD_FIELD, _lan_refused(why), request_id=rid)
        entry = self._listable(session.address, req.host)
        if entry is None:
            counted["rejected"].inc()
            raise MessageError(ErrorReason.BAD_FIELD, _TOO_BIG, request_id=rid)
        previous = self.registry.get(session.address)
        # A new key is a new host identity: a new registration, not a replacement.
        replacing = previous is not None and previous.info.key == req.host.key
        try:
            record = await self.registry.upsert(
                session.address, req.host, max_per_ip=self.settings.max_hosts_per_ip
            )
        except TooManyHosts:
            counted["rejected"].inc()
            raise MessageError(ErrorReason.TOO_MANY_HOSTS, request_id=rid) from None
        except RegistryUnavailable:
            counted["unavailable"].inc()
            raise MessageError(ErrorReason.UNAVAILABLE, request_id=rid) from None
        if not record.entry:
            list_entry(record, entry)  # what lists will send: encoded once, here
        result = "replaced" if replacing else "created"
        counted[result].inc()
        log.info("host_registered", host=record.address.key, game=req.host.game, result=result)
        reply = Registered(
            request_id=rid,
            address=session.address,
            keepalive=self.settings.keepalive,
            secret=self.liveness.secret(record),
        )
        self._send(session, reply)

    def _listable(self, address: Address, info: HostInfo) -> bytes | None:
        """The host's list entry, if it fits one page (one datagram); else None.

        Every field has its own cap, but all of them at their caps add up to
        more than a datagram; such an entry could never be sent, and would
        break every list it falls into.
        """
        entry = encode_entry(HostEntry(address=address, info=info))
        # Room for the mark of a partial answer too: an entry between the two bounds
        # went alone on a page over `page_bytes`, which a list budget of `page_bytes`
        # could never send (the answer waited for good).
        room = self.settings.page_bytes - _PAGE_OVERHEAD - _PARTIAL_BYTES
        return entry if len(entry) <= room else None

    async def _update(self, session: _Session, req: Update) -> None:
        rid = req.request_id
        if self.shutting_down:
            self.metrics.registrations.labels("rejected").inc()
            raise MessageError(ErrorReason.SHUTTING_DOWN, _STOPPING, request_id=rid)
        if self._rate_limited(self._register_limit, "register", session):
            self.metrics.updates.labels("rate_limited").inc()
            raise MessageError(ErrorReason.RATE_LIMITED, "updates", request_id=rid)
        record = self.registry.get(session.address)
        if record is None:
            self.metrics.updates.labels("not_registered").inc()
            raise MessageError(ErrorReason.NOT_REGISTERED, request_id=rid)
        try:
            info = req.changes.apply(record.info)
            entry = self._listable(session.address, info)
            if entry is None:
                raise MessageError(ErrorReason.BAD_FIELD, _TOO_BIG)
        except MessageError as exc:
            self.metrics.updates.labels("rejected").inc()
            raise MessageError(exc.reason, exc.detail, request_id=rid) from None
        try:
            updated = await self.registry.update(session.address, record.token, info)
        except NotRegistered:
            self.metrics.updates.labels("not_registered").inc()
            raise MessageError(ErrorReason.NOT_REGISTERED, request_id=rid) from None
        except RegistryUnavailable:
            self.metrics.updates.labels("unavailable").inc()
            raise MessageError(ErrorReason.UNAVAILABLE, request_id=rid) from None
        if not updated.entry:
            list_entry(updated, entry)  # encoded once, as a registration's
        self.metrics.updates.labels("ok").inc()
        self._send(session, Ok(request_id=rid))

    async def _unregister(self, session: _Session, req: Unregister) -> None:
        record = self.registry.get(session.address)
        self._beats.discard(session.address)
        if record is not None:
            await self._remove(record, RemovalReason.UNREGISTERED)
        self._send(session, Ok(request_id=req.request_id))

    def _heartbeat(self, session: _Session, req: Heartbeat) -> None:
        if self.registry.get(session.address) is None:
            raise MessageError(ErrorReason.NOT_REGISTERED, request_id=req.request_id)
        self._beats.add(session.address)

    async def flush_heartbeats(self) -> None:
        """Write the heartbeats received since the last flush; tell unknown hosts."""
        beats, self._beats = self._beats, set()
        live = dict.fromkeys(beats, 0)  # a `Heartbeat` message has no counter
        live.update(self.liveness.take_seen())
        if not live:
            return
        try:
            missing = await self.registry.touch(live)
        except RegistryUnavailable:
            return
        # A datagram heartbeater learns it from its next heartbeat (NOT_REGISTERED).
        for address in missing:
            session = self._sessions.get(address)
            if session is not None:
                self._send(session, Error(reason=ErrorReason.NOT_REGISTERED, detail="expired"))

    async def expire(self) -> None:
        """One expiry sweep; local sessions of expired hosts forget their registration."""
        try:
            expired = await self.registry.expire()
        except RegistryUnavailable:
            return
        for record in expired:
            self.metrics.removals.labels(RemovalReason.EXPIRED.value).inc()
            log.info("host_removed", host=record.address.key, reason=RemovalReason.EXPIRED)

    async def run_sweeper(self) -> None:
        """Flush heartbeats and expire hosts every ``sweep_interval`` until cancelled."""
        while not self.loops_stopped:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await self.flush_heartbeats()
                await self.expire()
            except Exception:  # one failed sweep must not end sweeping for good
                log.exception("sweep_failed")

    # ------------------------------------------------------------------ lists

    def _list(self, session: _Session, req: ListRequest) -> None:
        waiting = session.lists
        if waiting is None:
            waiting = session.lists = deque()
        # The one being sent is the head, unless the client may already have all of it.
        unanswered = len(waiting) - session.handed
        if unanswered >= self.settings.lists_per_connection:
            # Refused before the rate limit: it costs nothing, so it takes no token.
            self.metrics.list_requests.labels("busy").inc()
            detail = f"lists: {unanswered} unanswered on this connection"
            raise MessageError(ErrorReason.RATE_LIMITED, detail, request_id=req.request_id)
        if self._rate_limited(self._list_limit, "list", session):
            self.metrics.list_requests.labels("rate_limited").inc()
            raise MessageError(ErrorReason.RATE_LIMITED, "lists", request_id=req.request_id)
        waiting.append(req)
        if not session.listing:
            session.listing = True
            self._spawn(session, self._send_lists(session, waiting))

    async def build_pages(self, req: ListRequest) -> list[ListPage]:
        """The pages answering `req` (also what ``GET /servers`` uses, joined)."""
        listing, pages = await self._plan(req)
        records = [[listing.record(i) for i in page] for page, _ in pages]
        return [
            ListPage(
                request_id=req.request_id,
                seq=i,
                total=len(listing.entries),
                end=i == len(pages) - 1,
                hosts=tuple(HostEntry(address=r.address, info=r.info) for r in page),
                partial=not listing.complete,
            )
            for i, page in enumerate(records)
        ]

    async def _plan_list(self, req: ListRequest) -> tuple[int, list[_Page], bool]:
        """(total, each page's hosts and their encoded entries, whether the answer is
        partial): see `_plan`."""
        listing, pages = await self._plan(req)
        return len(listing.entries), pages, not listing.complete

    async def _plan(self, req: ListRequest) -> tuple[Listing, list[_Page]]:
        """A random sample of the matching hosts (from the registry's index, without a
        pass over every host, nor a record per host sent), cut into per-IP pages,
        then by encoded size.  The registry examines a bounded number of hosts
        (`listing.scan_budget`): the listing says when that left matches out."""
        limit = min(req.filter.limit, self._limits.list_limit)
        listing = await self.registry.sample_listing(req.filter, limit, self._rng)
        everything = listing.entries
        s = self.settings
        budget = s.page_bytes - _PAGE_OVERHEAD - (0 if listing.complete else _PARTIAL_BYTES)
        pages: list[_Page] = []
        for page in paginate_positions(listing.sources, s.page_hosts, s.page_per_ip):
            entries = [everything[i] for i in page]
            for a, b in size_cuts([len(e) for e in entries], budget):
                pages.append((page[a:b], entries[a:b]))
        return listing, pages or [([], [])]

    async def _send_lists(self, session: _Session, waiting: deque[ListRequest]) -> None:
        """Answer the connection's list requests one after the other, each in full
        (its last page acknowledged) before the next."""
        s = self.settings
        window = _PageWindow(s.pages_in_flight, self.list_budget, s.list_ack_timeout)
        result = "failed"
        try:
            while waiting:
                await self._send_list(session, window, waiting[0])
                waiting.popleft()
                session.handed = False
        except _ListUnacknowledged:
            result = "unacknowledged"
            log.info("list_unacknowledged", pages=window.pages, size=window.size)
            self._spawn(session, session.peer.close(text="list not acknowledged"))
        # The ack of a page fails when the connection ends (or the end of the
        # connection cancels this task): the rest cannot be sent.
        except _LIST_ABANDONED as exc:
            log.debug("list_abandoned", error=type(exc).__name__)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            session.listing = False
            session.handed = False
            window.close()
            if waiting:
                # The one being sent, and those that waited behind it: none is answered.
                self.metrics.list_requests.labels(result).inc()
                self.metrics.list_requests.labels("failed").inc(len(waiting) - 1)
                waiting.clear()

    async def _send_list(self, session: _Session, window: _PageWindow, req: ListRequest) -> None:
        started = self._clock()
        total, pages, partial = await self._plan_list(req)
        for seq, (_, entries) in enumerate(pages):
            data = encode_page(
                request_id=req.request_id,
                seq=seq,
                total=total,
                end=seq == len(pages) - 1,
                entries=entries,
                partial=partial,
            )
            await window.slot(len(data))  # raises if the connection ended
            pending = self._send_bytes(session, data)
            if pending is None:
                raise ConnectionError("page refused")
            window.add(pending, len(data))
        # The daemon's part (what the latency alert watches): no client round trip.
        handed = self._clock() - started
        session.handed = True
        await window.drained()
        self.metrics.list_requests.labels("ok").inc()
        self.metrics.list_hosts_sent.inc(total)
        self.metrics.list_duration.observe(handed)

    # ------------------------------------------------------------------ info

    def info_reply(self, request_id: int = 0) -> InfoReply:
        # len(index) is O(1); counting only visible hosts would cost O(hosts)
        # per request, and unconnected info queries are anyone's to send.
        hosts = len(self.registry.index())
        return InfoReply(
            request_id=request_id, software=SOFTWARE, hosts=hosts, keepalive=self.settings.keepalive
        )

    def answer_query(self, payload: bytes, sockaddr: tuple[Any, ...]) -> bytes | None:
        """rudp ``on_query``: answers an unconnected `InfoRequest` (a server-browser ping)."""
        try:
            request = decode_request(payload, self._limits)
        except MessageError as exc:
            self.metrics.dropped.labels(exc.reason.value).inc()
            return None
        if not isinstance(request, InfoRequest):
            # A request of a type not answered unconnected (as decode_host counts
            # a message that is not a Register).
            self.metrics.dropped.labels(ErrorReason.UNKNOWN_TYPE.value).inc()
            return None
        return encode(self.info_reply(request.request_id))

    # ------------------------------------------------------------------ introductions

    async def _introduce(self, session: _Session, req: Introduce) -> None:
        rid = req.request_id
        if self._rate_limited(self._introduce_limit, "introduce", session):
            self.metrics.introductions.labels("rate_limited").inc()
            raise MessageError(ErrorReason.RATE_LIMITED, "introductions", request_id=rid)
        if req.lan is not None:
            why = lan_reason(req.lan.ip, session.address.ip)
            if why is not None:
                raise MessageError(ErrorReason.BAD_FIELD, _lan_refused(why), request_id=rid)
        target = self.registry.get(req.host)
        if target is None or not self.registry.is_visible(target, self.registry.now()):
            self.metrics.introductions.labels("not_found").inc()
            raise MessageError(ErrorReason.NOT_FOUND, req.host.key, request_id=rid)
        nonce = self._nonce(NONCE_BYTES)
        shared = same_public_ip(session.address, target.address)
        host_lan = target.info.lan if shared else None
        if host_lan is not None and lan_reason(host_lan.ip, target.address.ip) is not None:
            host_lan = None  # registered before LAN addresses were checked (a shared registry)
        if host_lan is not None and (":" in host_lan.ip) != (":" in session.address.ip):
            host_lan = None  # the client could not reach it from its socket's family
        to_host = Introduction(
            role=Role.HOST, peer=session.address, peer_lan=req.lan if shared else None, nonce=nonce
        )
        to_client = Introduction(
            request_id=rid,
            role=Role.CLIENT,
            peer=target.address,
            peer_lan=host_lan,
            nonce=nonce,
            peer_key=target.info.key or None,
            token=self._token(req, target, host_lan),
        )
        result = await self._reach_host(target, encode(to_host), session.address, rid)
        self.metrics.introductions.labels(result).inc()
        log.info("introduced", host=target.address.key, result=result)
        self._send(session, to_client)

    def _token(self, req: Introduce, target: HostRecord, host_lan: Address | None) -> bytes | None:
        """A connect token for this client and this host (``rudp.tokens``), when the
        client asked for one, the host gave its key and we have an issuing key; it
        names the host's public address and `host_lan`, the LAN address the client
        is given."""
        if self._issuer is None or req.client_key is None or not target.info.key:
            return None
        addresses = [(target.address.ip, target.address.port)]
        if host_lan is not None:
            addresses.append((host_lan.ip, host_lan.port))
        return self._issuer.issue(
            client_key=req.client_key,
            host_key=target.info.key,
            addresses=addresses,
            client_id=int.from_bytes(self._nonce(8), "big"),
            now=self._wall(),
            lifetime=self.settings.token_lifetime,
            user_data=req.user_data,
        )

    async def _reach_host(
        self, target: HostRecord, payload: bytes, client: Address, rid: int
    ) -> str:
        if target.owner == self.registry.replica_id:
            self._deliver(target, payload, client)
            return "local"
        try:
            await self.registry.deliver(target.owner, Notice(target.address, payload))
        except RegistryUnavailable:
            self.metrics.introductions.labels("unavailable").inc()
            raise MessageError(ErrorReason.UNAVAILABLE, request_id=rid) from None
        return "relayed"

    def _deliver(self, target: HostRecord, payload: bytes, client: Address | None) -> None:
        """Send an introduction of `client` to the host's heartbeat address, until it
        acknowledges; over the host's connection instead while it holds one, unless
        that connection has just ended (a host that updated its entry and released
        it): then by datagram all the same, never lost."""
        session = self._sessions.get(target.address)
        if session is not None and self._send_bytes(session, payload) is not None:
            return
        self.liveness.introduce(target, payload, self._clock(), client)
        self._intro_due.set()

    async def run_notices(self) -> None:
        """Deliver payloads relayed by other replicas to local hosts, until cancelled.

        Every payload dropped on the way is counted, by reason
        (``matchmaker_notices_dropped_total``): the registry's own drops (a full
        queue, a malformed payload) through its `on_notice_dropped`."""
        dropped = self.metrics.count_notice_dropped
        self.registry.on_notice_dropped = dropped
        while not self.loops_stopped:
            notice = await self.registry.next_notice()
            try:
                target = self.registry.get(notice.target)
                if target is None:
                    dropped("host_gone")
                    continue
                if target.owner != self.registry.replica_id and not notice.forwarded:
                    # The host moved to another replica (a takeover) after the sender
                    # looked: only the new owner's datagrams are sure to pass its NAT.
                    moved = Notice(notice.target, notice.payload, forwarded=True)
                    try:
                        await self.registry.deliver(target.owner, moved)
                    except RegistryUnavailable:
                        dropped("forward_failed")
                    continue
                self._deliver(target, notice.payload, _introduced(notice.payload))
            except Exception:  # one bad notice must not end relayed introductions
                dropped("other")
                log.exception("notice_failed")

    async def run_takeovers(self) -> None:
        """Take over the hosts whose heartbeats came here instead of to their
        replica (`matchmaker.liveness`), until cancelled: what waits is written in
        one registry call, answered when it returns, while the next batch gathers."""
        while not self.loops_stopped:
            await self._takeover_due.wait()
            self._takeover_due.clear()
            waiting = self.liveness.take_takeovers()
            if not waiting:
                continue
            try:
                results = await self.registry.take_over([t for t, _ in waiting])
            except RegistryUnavailable:
                results = None
            except Exception:  # a bug must cost this batch, not every later takeover
                log.exception("takeover_failed", hosts=len(waiting))
                results = None
            self.liveness.settle(waiting, results)

    async def run_introductions(self) -> None:
        """Send unacknowledged introductions again when due, until cancelled."""
        interval = self.liveness.resend_interval
        while not self.loops_stopped:
            if not self.liveness.pending:
                self._intro_due.clear()
                await self._intro_due.wait()
            await asyncio.sleep(interval / 2)
            self.liveness.resend(self._clock())

    # ------------------------------------------------------------------ shutdown

    def stop_accepting(self) -> None:
        """From now on refuse new connections, and registrations with
        ``shutting_down`` (which sends hosts to another replica)."""
        self.shutting_down = True
        self.liveness.stopping = True

    def stop_loops(self) -> None:
        """The background loops (``run_*``) end at their next round."""
        self.loops_stopped = True
        self._takeover_due.set()
        self._intro_due.set()

    async def close_all(self) -> None:
        """Stop accepting, then close every connection gracefully, keeping
        registrations (see module doc)."""
        self.stop_accepting()
        sessions = list(self._sessions.values())
        await asyncio.gather(
            *(s.peer.close(text=_STOPPING) for s in sessions),
            return_exceptions=True,
        )


def _lan_refused(why: str) -> str:
    return f"lan: not a private address ({why})"


def _introduced(payload: bytes) -> Address | None:
    """The client a relayed introduction for a host introduces (None: not one we can
    read, delivered all the same)."""
    try:
        msg = decode(payload)
    except MessageError:
        return None
    return msg.peer if isinstance(msg, Introduction) else None


def _error(exc: MessageError) -> Error:
    detail = exc.detail[: DEFAULT_LIMITS.detail_chars]
    return Error(request_id=exc.request_id, reason=exc.reason, detail=detail)


class _ListUnacknowledged(Exception):
    """No page of a connection's list answer was acknowledged for ``list_ack_timeout``."""


class _ListBudget:
    """The bytes of list pages every connection may have unacknowledged together.

    A window that finds it spent waits (`_PageWindow.slot`) until another's pages
    are acknowledged, or that connection ends or is closed for not acknowledging.
    """

    __slots__ = ("free", "size", "waiting")

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self.waiting: set[_PageWindow] = set()

    def cost(self, size: int) -> int:
        """What a page of ``size`` bytes takes: at most the whole budget, so that a page
        larger than it (an entry another replica's larger ``--page-bytes`` let in)
        waits for the budget to be free, not for good."""
        return min(size, self.size)

    def give(self, size: int) -> None:
        self.free += size
        for window in self.waiting:
            window.wake()


class _PageWindow:
    """The pages of one connection's list answers sent and not yet acknowledged:
    at most `limit` pages, and no more bytes than the shared `_ListBudget` has.

    The window moves on *any* page's ack, not the oldest: a lost page is resent
    by rudp while the pages behind it keep going.  Each ack costs O(1) (a
    callback), so a window of a thousand pages costs no more per page than one
    of ten.  Every ack's outcome is retrieved, the failures too (the connection
    ended: every page still out fails); the first one is raised by `slot` and
    `drained`.  With pages out and none acknowledged for `timeout` seconds, they
    raise `_ListUnacknowledged`.
    """

    __slots__ = (
        "_budget",
        "_closed",
        "_error",
        "_last_ack",
        "_limit",
        "_moved",
        "_timeout",
        "pages",
        "size",
    )

    def __init__(self, limit: int, budget: _ListBudget, timeout: float) -> None:
        self._limit = limit
        self._budget = budget
        self._timeout = timeout
        self.pages = 0
        """Pages out (sent, not acknowledged)."""
        self.size = 0
        """Their bytes, taken from the budget."""
        self._error: BaseException | None = None
        self._moved = asyncio.Event()
        self._last_ack = 0.0
        self._closed = False

    def add(self, ack: Awaitable[None], size: int) -> None:
        size = self._budget.cost(size)
        if self.pages == 0:
            self._last_ack = asyncio.get_running_loop().time()  # the clock starts now
        self.pages += 1
        self.size += size
        self._budget.free -= size
        # A future as it is; rudp's send handle becomes a task (it is only awaitable).
        future = asyncio.ensure_future(ack)
        future.add_done_callback(functools.partial(self._on_ack, size))

    def _on_ack(self, size: int, ack: asyncio.Future[None]) -> None:
        # Retrieved whatever happens: an unretrieved failure is logged by the loop.
        error = asyncio.CancelledError() if ack.cancelled() else ack.exception()
        if self._closed:
            return  # its bytes went back to the budget already
        self.pages -= 1
        self.size -= size
        self._budget.give(size)
        if error is None:
            self._last_ack = asyncio.get_running_loop().time()
        elif self._error is None:
            self._error = error
        self._moved.set()

    def wake(self) -> None:
        self._moved.set()

    def close(self) -> None:
        """The connection's answers are over: what is still out goes back to the
        budget now (the connection is ending, and its queue with it)."""
        if not self._closed:
            self._closed = True
            self._budget.give(self.size)
            self.pages = self.size = 0

    async def slot(self, size: int) -> None:
        """Return once a page of `size` bytes may be sent; raise what ended the
        connection, or `_ListUnacknowledged`."""
        budget = self._budget
        size = budget.cost(size)
        while self.pages >= self._limit or budget.free < size:
            if budget.free < size:  # woken by any connection's acks, not only ours
                budget.waiting.add(self)
            try:
                await self._wait()
            finally:
                budget.waiting.discard(self)
        if self._error is not None:
            raise self._error

    async def drained(self) -> None:
        """Return once every page sent is acknowledged (raises as `slot` does)."""
        while self.pages:
            await self._wait()
        if self._error is not None:
            raise self._error

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._moved.clear()
        if not self.pages:  # waiting for the budget alone: others' acks free it
            await self._moved.wait()
            return
        left = self._last_ack + self._timeout - asyncio.get_running_loop().time()
        if left <= 0:
            raise _ListUnacknowledged
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._moved.wait(), left)
