"""What game hosts and game clients import to talk to the matchmaker.

Theory of operation
-------------------
One `MatchmakerClient` holds one rudp connection to the matchmaker, opened
lazily and reopened when it ends.  Requests carry a fresh request id and wait
for the reply with that id, so several can be in flight; `list_servers`
collects `ListPage`s (which may arrive in any order) until the page marked
``end`` and all before it are in.

A host calls `register(...)` once.  From then on a background task keeps the
registration alive, every ``keepalive`` seconds (the interval comes from the
matchmaker's `Registered` reply).  A client given the host's socket
(``datagrams``, or ``to(..., via=server)``) closes the connection once
registered and sends connectionless heartbeats from that socket instead
(`matchmaker.heartbeat`, keyed by the secret `Registered` handed out): the
listed host then costs the matchmaker no connection, and the heartbeats keep
the host's NAT open for introductions, which arrive as datagrams too and are
acknowledged.  A heartbeat is resent every ``timeout / 4`` seconds until one
is acknowledged.  Without a socket the client keeps the connection and sends
`Heartbeat` messages over it.  A fresh `Register` with the latest info is sent
whenever the matchmaker says ``not_registered`` (the entry expired, or the
replica is stopping) or the connection (connection mode) ends, retrying with
exponential backoff; until one succeeds, a heartbeating host keeps
heartbeating the registration it has.  The host believes a NOT_REGISTERED
datagram only from the replica it heartbeats to, and only when it echoes the
counter of a heartbeat still waiting for an answer (none before the
registration's first heartbeat, none of a heartbeat acknowledged or older than
one), with the registration's MAC or without: each registration's counter starts at a
random 62-bit value, so no one off the path can guess it.  The keep-alive
interval is never below `MIN_KEEPALIVE`, whatever `Registered` says.
`update(...)` changes what is listed and what a re-registration sends; it
opens a connection for the time of the request.

Failover: the client knows one or more matchmaker addresses (`to` takes a
name, which may resolve to several replicas, or a list of addresses).  Each
connection attempt starts after the replica last used when that one's
connection ended, so a dead or stopping replica is tried last.  A replica is
taken for dead when a heartbeat stays unacknowledged for ``timeout / 2``
seconds (``timeout`` with one address); a stopping one closes its
connections, answers heartbeats with ``not_registered`` and refuses
registrations with ``shutting_down``.  Either way a heartbeating host then
sends its heartbeat, marked MOVING, to the other replicas in turn (from a
random one; a stopping one does not answer it, and is left after ``timeout /
2``): any replica can check it, and the first that answers takes the registration over
(`takeovers` counts it) and is the host's replica from then on, for one
datagram instead of a registration.  Only a replica that answers
NOT_REGISTERED (it does not list the host), or none answering, makes the host
register again, with the next replica.  A host holding a connection
re-registers with another replica at once.  A request left unanswered for
``timeout`` gives its replica's connection up too (`RequestTimeout`): the next
attempt goes to another replica.  So does, with another replica to turn to, a
replica that answers but refuses: ``unavailable`` or ``internal`` (any request),
a reply the client refused (`ReplyRefused`), `WrongVersion` or a reply of the
wrong type; the last two end a registration only once every replica has given
one.  With one replica the connection is kept, and the replica retried with
backoff; so is any request refused ``rate_limited``, a limit of the client's
own making.  A re-registration refused with
``too_many_hosts`` is retried at the longest backoff (the per-IP cap frees
up); one refused for good, or a closed game socket, ends the keep-alive task:
`host_info` turns None and `registration_error` says why.  The first `register`
retries too (with the same backoff) until ``register_timeout`` runs out, then
raises `MatchmakerUnreachable` naming every address it tried (each connection
attempt and request waits at most what is left of ``register_timeout``).

A host should open the client *via its game server's rudp socket*
(``MatchmakerClient.to(host, port, via=server)``) so that the address the
matchmaker observes, lists and introduces is the game port.  Introductions
for the host (a client wants to join) arrive on `introductions` (each one once,
however often the matchmaker had to send it); the host then
sends one datagram to ``peer`` (and ``peer_lan``) from that same server
(``server.query(...)``) to open its NAT, and does not connect back: the
client, having got its own `Introduction` from `introduce`, connects to the
host, and its connection reaches the host's ``serve`` handler (see
docs/matchmaker.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import random
import socket
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import rudp
from matchmaker import heartbeat as hb
from matchmaker.addresses import Address, make_address
from matchmaker.messages import (
    DEFAULT_LIMITS,
    MAX_REQUEST_ID,
    Error,
    ErrorReason,
    Heartbeat,
    HostEntry,
    HostInfo,
    HostUpdate,
    InfoReply,
    InfoRequest,
    Introduce,
    Introduction,
    Limits,
    ListFilter,
    ListPage,
    ListRequest,
    Message,
    MessageError,
    Ok,
    Register,
    Registered,
    Role,
    Unregister,
    Update,
    WrongVersion,
    decode,
    encode,
    str_tuple,
)
from matchmaker.tickets import Ticket, check_introduction
from matchmaker.transport import (
    TRANSPORT_ERRORS,
    Connector,
    DatagramPort,
    Peer,
    rudp_connector,
)
from rudp.errors import check_address, check_port, check_sequence

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")
_RETRYABLE = frozenset(
    {
        ErrorReason.RATE_LIMITED,
        ErrorReason.UNAVAILABLE,
        ErrorReason.INTERNAL,
        ErrorReason.SHUTTING_DOWN,
    }
)

Route = tuple[str, Connector]
"""One matchmaker address, as named in logs and errors, and how to connect to it."""

Routes = Callable[[], Awaitable[list[Route]]]
"""The matchmaker addresses to try, looked up afresh for every connection attempt."""


class MatchmakerError(Exception):
    """The matchmaker refused a request."""

    _replica_only = False
    """Set on an answer only the replica that gave it may be wrong about: `WrongVersion`
    (a replica of another protocol version, mid-upgrade), or a well-formed reply of
    the wrong type (``malformed``, "unexpected Ok").  Another replica may answer
    right: `register` and the keep-alive try the others before giving up."""

    def __init__(self, reason: ErrorReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class ConnectionLost(ConnectionError):
    """The connection ended before the reply arrived."""


class RequestTimeout(TimeoutError):
    """A replica did not answer a request within the client's ``timeout``: the
    client gave its connection up, so the next request goes to another replica."""

    def __init__(self, replica: str, seconds: float) -> None:
        super().__init__(f"matchmaker {replica} did not answer within {seconds:g} s")
        self.replica = replica
        self.seconds = seconds


class ReplyRefused(ConnectionError):
    """A replica answered a request with a reply this client could not accept (not a
    message it reads, or one past its `limits`: a matchmaker whose operator raised
    them, or of another version). The request fails at once; `detail` says what
    was wrong with the reply."""

    def __init__(self, replica: str, detail: str) -> None:
        super().__init__(f"matchmaker {replica} answered with a reply the client refused: {detail}")
        self.replica = replica
        self.detail = detail


def _wrong_reply(reason: ErrorReason, detail: str) -> MatchmakerError:
    """A `MatchmakerError` only the replica that answered may be wrong about."""
    error = MatchmakerError(reason, detail)
    error._replica_only = True
    return error


def _unexpected(reply: Message) -> MatchmakerError:
    return _wrong_reply(ErrorReason.MALFORMED, f"unexpected {type(reply).__name__}")


def _replica_only(exc: BaseException) -> bool:
    return isinstance(exc, MatchmakerError) and exc._replica_only


class MatchmakerUnreachable(ConnectionError, TimeoutError):
    """No matchmaker address answered (or, for `register`, took the registration):
    `tried` names each one and what went wrong there last; `seconds` is how long
    the attempts took."""

    def __init__(
        self, tried: Sequence[str], seconds: float, what: str = "no matchmaker answered"
    ) -> None:
        where = "; ".join(tried) or "no address"
        super().__init__(f"{what} in {seconds:.1f} s (tried {where})")
        self.tried = tuple(tried)
        self.seconds = seconds


_SOCKET_HOSTS: dict[int, weakref.ref[MatchmakerClient]] = {}
"""The client registering each game socket, by the socket object's id: the
matchmaker's datagrams on a socket go to one client (its heartbeat handlers), so a
second one would take them.  Keyed by id, not by a weak reference to the socket:
the compiled build's endpoint cannot be weakly referenced.  An entry whose client
is gone, or holds another socket now (an id reused), is free."""

_TROUBLED = frozenset({ErrorReason.UNAVAILABLE, ErrorReason.INTERNAL})
"""Refusals that say the replica is in trouble (its registry down, a failure of
its own): with another replica to turn to, the next attempt goes there."""

MIN_KEEPALIVE = 0.01
"""The shortest keep-alive interval the client uses, in seconds, whatever
`Registered` says: a matchmaker answering 0 (or next to it) would otherwise have
the host heartbeat in a busy loop.  A matchmaker's own is at least a second in
any real deployment; tests run theirs down to this."""

_CAPPED = frozenset({ErrorReason.TOO_MANY_HOSTS})
"""Refusals the keep-alive task retries at the longest backoff: a per-IP cap can
free up (another host of the address leaves, or its entry expires)."""

_KEEPER_ERRORS: tuple[type[BaseException], ...] = (
    MatchmakerError,
    ConnectionLost,
    TimeoutError,
    *TRANSPORT_ERRORS,
)


_CONNECT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *TRANSPORT_ERRORS)


class ServerList(list[HostEntry]):
    """What `MatchmakerClient.list_servers` returns: a list of `HostEntry`, and
    whether the answer reached its limit.

    An answer is a random sample of at most `limit` matching hosts (the request's
    ``limit``, 1,000 by default; the matchmaker refuses one above its ``--list-limit``).
    At the limit there may be more: a narrower filter or a higher limit shows them.
    So may there be when the matchmaker stopped looking first (`partial`: a filter
    few hosts pass, such as a rare name, examined as many hosts as one request may).
    """

    limit: int
    """The most hosts this answer could hold."""
    partial: bool
    """The matchmaker stopped looking before it had `limit` hosts or every match."""

    def __init__(self, hosts: Iterable[HostEntry], *, limit: int, partial: bool = False) -> None:
        super().__init__(hosts)
        self.limit = limit
        self.partial = partial

    @property
    def limit_reached(self) -> bool:
        """True when the answer holds `limit` hosts or is `partial`: it may have left
        some out."""
        return self.partial or len(self) >= self.limit

    def __repr__(self) -> str:
        more = ", partial=True" if self.partial else ""
        return f"ServerList({list.__repr__(self)}, limit={self.limit}{more})"


INTRODUCTIONS_REMEMBERED = 256
"""Introduction ids above `_IntroductionIds.floor` remembered one by one."""


class _IntroductionIds:
    """The introduction ids one replica sent us and we took, to take none twice for
    the life of the registration, in bounded memory.

    A replica numbers its introductions in increasing order (from the microseconds
    of the wall clock when its process started: a replica restarted at the same
    address, or a worker restarted behind it, goes on above the ids of the one
    before), and resends one only while it waits for its acknowledgement (a few
    seconds, 64 at most per host).  So the latest `INTRODUCTIONS_REMEMBERED` ids
    are kept one by one, and every id at or below the lowest one forgotten (the
    `floor`) is taken as seen: an INTRODUCTION carries no time, and its MAC stays
    good for the whole registration, so a copy sent again by anyone who saw it
    would otherwise be queued again once its id was forgotten.
    """

    __slots__ = ("_heap", "_ids", "floor")

    def __init__(self) -> None:
        self.floor = -1
        self._ids: set[int] = set()
        self._heap: list[int] = []

    def take(self, intro_id: int) -> bool:
        """True the first time `intro_id` comes, False for one taken (or forgotten) before."""
        if intro_id <= self.floor or intro_id in self._ids:
            return False
        self._ids.add(intro_id)
        heapq.heappush(self._heap, intro_id)
        if len(self._heap) > INTRODUCTIONS_REMEMBERED:
            self.floor = heapq.heappop(self._heap)
            self._ids.discard(self.floor)
        return True


@dataclass(slots=True)
class _Beats:
    """One registration's connectionless heartbeats."""

    secret: bytes
    address: Address
    """Our address as the matchmaker observed (and lists) it."""
    replica: tuple[Any, ...]
    """Where heartbeats go: the replica that took the registration, or the one
    that took it over since."""
    former: tuple[Any, ...] | None = None
    """The replica heartbeats went to before (a takeover): its introductions,
    sent before it learnt of the move, are still taken."""
    intros: list[tuple[tuple[Any, ...], _IntroductionIds]] = field(default_factory=list)
    """The introductions taken, per replica address (a record of its own each: each
    replica numbers its own; one per replica the client knows, at most)."""

    def intros_from(self, place: tuple[Any, ...]) -> _IntroductionIds:
        """The record of the introductions taken from the replica at `place`: one a
        takeover went to meanwhile keeps its own (whatever `replica` says then)."""
        for known, record in self.intros:
            if _same_place(known, place):
                return record
        record = _IntroductionIds()
        self.intros.append((place, record))
        return record

    counter: int = field(default_factory=hb.first_counter)
    """The last counter sent; starts at random so that no one off the path can
    guess the counters a NOT_REGISTERED must echo."""
    round_start: int = -1
    """The first counter of the heartbeats still waiting for an answer (those after
    the last acknowledged): past `counter` while none is (a new registration's,
    until its first heartbeat; every heartbeat acknowledged), so that no
    NOT_REGISTERED is taken then."""
    acked: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.round_start < 0:
            self.round_start = self.counter + 1  # no heartbeat sent yet: nothing to answer


@dataclass(slots=True)
class _PendingList:
    future: asyncio.Future[list[ListPage]]
    pages: dict[int, ListPage]
    last: int | None = None
    """seq of the page marked ``end``, once it is in."""
    max_pages: int = 1
    """Pages an answer can have: each holds a host, but for an empty answer's one."""


class MatchmakerClient:
    def __init__(
        self,
        connect: Connector | Sequence[Connector] | None = None,
        *,
        timeout: float = 5.0,
        reconnect_delay: float = 0.5,
        max_reconnect_delay: float = 30.0,
        register_timeout: float = 60.0,
        limits: Limits = DEFAULT_LIMITS,
        max_introductions: int = 64,
        routes: Routes | None = None,
        issuer_keys: Sequence[bytes] = (),
        datagrams: DatagramPort | None = None,
    ) -> None:
        """`connect` opens a connection to the matchmaker (several: one per replica);
        `routes`, when given, replaces it with named addresses looked up per attempt.
        `issuer_keys` pins the matchmaker's token-issuing public key (two while it
        rotates): `ticket` believes only introductions it signed.
        `datagrams` is the socket those connections leave from (a game server's):
        with it, a registered host heartbeats without holding a connection.
        `limits` are the matchmaker's (the protocol's defaults unless its
        operator raised them): replies are read, and requests checked before
        they are sent, against them.

        A value out of range raises ValueError at once (a wrong type, TypeError)."""
        _check_number(timeout, "timeout", positive=True)
        _check_number(register_timeout, "register_timeout", positive=True)
        _check_number(reconnect_delay, "reconnect_delay")
        _check_number(max_reconnect_delay, "max_reconnect_delay")
        if not isinstance(max_introductions, int) or isinstance(max_introductions, bool):
            raise TypeError(f"max_introductions takes an int, not {max_introductions!r}")
        if max_introductions < 0:
            raise ValueError(
                f"max_introductions must be >= 0 (0: no bound), not {max_introductions}"
            )
        if routes is None:
            if connect is None:
                raise TypeError("MatchmakerClient needs connect or routes")
            if not callable(connect):
                check_sequence(connect, "connect")
            connectors = [connect] if callable(connect) else list(connect)
            routes = _fixed_routes([(f"replica {i + 1}", c) for i, c in enumerate(connectors)])
        self._routes = routes
        self._start = random.randrange(1 << 16)
        """Where the first attempt starts among the routes: spreads hosts over replicas."""
        self._route: str | None = None
        """The address of the current (or last) connection."""
        self._avoid: str | None = None
        """An address whose connection ended or refused: tried last next time."""
        self._tried: dict[str, str] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = asyncio.Event()
        """Set by `close()`: nothing registers, reconnects or keeps alive after it."""
        self._releasing: dict[str, asyncio.Task[None]] = {}
        """Connections being closed after their last request, by address: a new
        one to the same address waits for that (rudp allows one per address)."""
        self._route_count = 1
        self._wrong_replicas: set[str] = set()
        """Replicas that answered a registration with what only they may be wrong
        about (`MatchmakerError._replica_only`) since the last success: when every
        one has, the refusal is final."""
        self._moved = 0
        """Immediate retries on other replicas since the last success (at most one
        round of the addresses; then backoff)."""
        self._timeout = timeout
        self._register_timeout = register_timeout
        self._reconnect_delay = reconnect_delay
        self._max_reconnect_delay = max_reconnect_delay
        self._limits = limits
        self._issuer_keys = tuple(issuer_keys)
        self._conn: Peer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._ids = itertools.cycle(range(1, MAX_REQUEST_ID + 1))
        self._refused: tuple[str, str] | None = None
        """The last reply over a connection the client could not accept: (replica, why)."""
        self._refusals = 0
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._lists: dict[int, _PendingList] = {}
        self._host: HostInfo | None = None
        self._keepalive = 5.0
        self._needs_register = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._port = datagrams
        self._beats: _Beats | None = None
        self.address: Address | None = None
        """Our public address as the matchmaker sees it (after `register`)."""
        self.introductions: asyncio.Queue[Introduction] = asyncio.Queue(max_introductions)
        """Introductions for a registered host: clients that want to join."""
        self.registrations = 0
        """How many times `Register` succeeded (re-registrations included)."""
        self.registration_error: BaseException | None = None
        """Why the registration was given up for good, None while it is kept (or
        none was made): the matchmaker refused a re-registration for good (a
        `MatchmakerError`), or the game socket was closed (``rudp.EndpointClosed``).
        `host_info` is None then; `register()` again to be listed again."""
        self.takeovers = 0
        """How many times another replica took this host over on a heartbeat (no
        registration: see "Failover" in the module doc)."""
        self._replicas: dict[str, tuple[str, int]] = {}
        """The replicas' datagram addresses by route label, as looked up by `to()`
        (empty for bare connectors: heartbeats then have nowhere else to go)."""
        self.dropped: Counter[str] = Counter()
        """Datagrams on the host's socket dropped, by reason: ``wrong_source`` (not
        from the replica we heartbeat to), ``bad_mac``, ``stale`` (answers no
        heartbeat we sent), ``stale_ack`` (acknowledges a heartbeat acknowledged
        before), ``seen_introduction`` (an introduction taken before: acknowledged
        again, not queued)."""
        self._socket_of_its_own = False
        """Made by `to()` without ``via``: its ephemeral socket is no game's address."""

    @classmethod
    def to(
        cls,
        host: str | Iterable[tuple[str, int]],
        port: int | None = None,
        *,
        via: rudp.Server | None = None,
        config: rudp.Config | None = None,
        matchmaker_key: bytes | None = None,
        **kwargs: Any,
    ) -> MatchmakerClient:
        """A client for the matchmaker at host:port over rudp.

        `host` may be a name that resolves to several replicas (resolved again
        for every connection attempt), or a list of ``(host, port)`` replicas.

        `via` is the rudp socket to talk through: a game host's own server
        (``rudp.serve``), so that the address the matchmaker registers, lists and
        introduces is the game port; a game client's ``rudp.open_endpoint()``, so
        that the host is introduced to the address the client connects from.
        Without it the client opens a socket of its own, which can list servers
        and introduce, but `register` refuses (that socket is no game's address).

        `matchmaker_key` is the matchmaker's rudp static public key (the daemon's
        ``--static-key-file``; its startup line says ``static_public=``): with it
        every connection authenticates the matchmaker (Noise NK), so no one on the
        path can read the heartbeat secret `Registered` hands out.  Without it the
        connections are Noise NN (docs/security.md).
        """
        if isinstance(host, str):
            if port is None:
                raise TypeError("to(host, port): the port is missing")
            replicas = [(host, _check_port(port, "to() port"))]
        else:
            check_sequence(host, "to() host")
            replicas = []
            for replica in host:
                check_address(replica, "each replica of to()")
                replicas.append((replica[0], _check_port(replica[1], "each replica's port")))
            if not replicas:
                raise ValueError("to([]): no matchmaker address")
        if via is not None:
            kwargs.setdefault("datagrams", via)
        found: dict[str, tuple[str, int]] = {}
        routes = _resolving_routes(replicas, via, config, matchmaker_key, found)
        client = cls(routes=routes, **kwargs)
        client._replicas = found
        client._socket_of_its_own = via is None
        return client

    def __repr__(self) -> str:
        route = self._route or "not connected"
        if self._host is not None and self.address is not None:
            return f"<MatchmakerClient {route}, registered as {self.address}>"
        return f"<MatchmakerClient {route}>"

    @property
    def route(self) -> str | None:
        """The matchmaker address of the current (or last) connection."""
        return self._route

    async def __aenter__(self) -> MatchmakerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ hosts

    async def register(
        self,
        *,
        name: str,
        game: str,
        version: str,
        max_players: int,
        map: str = "",
        players: int = 0,
        password: bool = False,
        tags: Iterable[str] = (),
        region: str = "",
        info: bytes = b"",
        lan: tuple[str, int] | None = None,
        key: bytes | None = None,
    ) -> Address:
        """Register this host and keep it registered until `unregister`/`close`.

        `key` is the game server's static public key (``server.public_key``): the
        matchmaker lists it and issues connect tokens for it.

        Returns the public address the matchmaker observed.  Raises
        MatchmakerError at once if the matchmaker refuses for good (bad field,
        per-IP cap, forbidden address), and ``rudp.EndpointClosed`` if the
        game socket is closed.  A field the matchmaker would refuse raises
        ValueError before anything is sent; another client registering through
        the same game socket, RuntimeError.  Unreachable or stopping replicas, rate
        limits and outages are retried with backoff for ``register_timeout``
        seconds; then the last refusal is raised, or `MatchmakerUnreachable`.

        The matchmaker lists the address this client's connection comes from, so a
        client made by ``to()`` without ``via=`` (its own ephemeral socket, not the
        game's) raises TypeError at once instead of listing the wrong port.
        """
        self._check_open()
        if self._socket_of_its_own:
            raise TypeError(
                "register() lists the address the client talks from, and this client has "
                "a socket of its own (MatchmakerClient.to() without via=): pass the game "
                "server, MatchmakerClient.to(host, port, via=game_server)"
            )
        if lan is not None:
            check_address(lan, "lan")
        host = HostInfo(
            name=name,
            game=game,
            version=version,
            max_players=max_players,
            map=map,
            players=players,
            password=password,
            tags=str_tuple(tags, "tags"),
            region=region,
            info=info,
            lan=make_address(*lan) if lan else None,
            key=key or b"",
        )
        self._check_request(Register(host=host), host, "register()")
        self._claim_socket()
        try:
            address = await self._register_first(host)
        except BaseException:
            if self._host is None:
                self._free_socket()
            raise
        self._host = host
        self.registration_error = None
        if self._closed.is_set():
            # Closed while the reply was on its way: leave again at once.
            await self._leave()
            raise _closed_error()
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep_registered(), name="mm-keepalive")
        return address

    @property
    def host_info(self) -> HostInfo | None:
        """What this host is registered with (latest updates included), None when not.

        A ready source for `matchmaker.serverinfo.serve_info`.
        """
        return self._host

    async def update(self, **changes: Any) -> None:
        """Change what is listed: any of name, map, players, max_players,
        password, tags, region, info."""
        if self._host is None:
            raise MatchmakerError(ErrorReason.NOT_REGISTERED, "register first")
        if "tags" in changes:
            changes["tags"] = str_tuple(changes["tags"], "tags")
        upd = HostUpdate(**changes)
        try:
            merged = upd.apply(self._host)
        except MessageError as exc:
            raise MatchmakerError(exc.reason, exc.detail) from None
        try:
            await self._expect(Update(changes=upd), Ok)
        finally:
            self._release()
        self._host = merged

    async def unregister(self) -> None:
        """Leave the list now and stop keeping the registration alive."""
        self._host = None
        await self._stop_keeper()
        self._free_socket()
        beats, self._beats = self._beats, None
        if self._conn is not None or beats is not None:
            try:
                await self._expect(Unregister(), Ok)
            finally:
                self._release()

    async def _register_now(self, host: HostInfo, deadline: float | None = None) -> Address:
        reply, conn = await self._expect_on(Register(host=host), Registered, deadline)
        self._keepalive = max(reply.keepalive, MIN_KEEPALIVE)
        self.address = reply.address
        self.registrations += 1
        self._wrong_replicas.clear()
        self._needs_register.clear()
        self._beats = None
        if self._port is not None and reply.secret:
            self._listen()
            self._beats = _Beats(reply.secret, reply.address, conn.remote_address)
            self._release()  # the listing lives on heartbeats: no connection held
        return reply.address

    async def _register_first(self, host: HostInfo) -> Address:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self._register_timeout
        delay = self._reconnect_delay
        last = False
        self._tried.clear()
        self._wrong_replicas.clear()
        while True:
            try:
                address = await self._register_now(host, deadline)
                self._moved = 0
                return address
            except _KEEPER_ERRORS as exc:
                if self._closed.is_set():
                    raise _closed_error() from exc
                if _is_final(exc) and not self._other_replica_may(exc):
                    raise
                self._note_failure(exc)
                wait = 0.0 if self._moves_on(exc) else delay
                left = deadline - loop.time()
                if left <= 0 or last:
                    if isinstance(exc, MatchmakerError):
                        raise
                    tried = [f"{where} ({why})" for where, why in self._tried.items()]
                    elapsed = loop.time() - start
                    what = "no matchmaker took the registration"
                    raise MatchmakerUnreachable(tried, elapsed, what) from exc
                if left > self._timeout:
                    if wait + self._timeout > left:
                        # The backoff would leave the next attempt less than a full
                        # ``timeout``: one last attempt, started in time to get it.
                        wait = left - self._timeout
                        last = True
                elif wait >= left:
                    # Less than a ``timeout`` left, and the backoff would use it up:
                    # one last attempt now, with what is left.
                    wait = 0.0
                    last = True
                log.info("register_retry error=%s delay=%s", type(exc).__name__, wait)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), wait)
                self._check_open()
                if wait:
                    delay = min(delay * 2, self._max_reconnect_delay)

    async def _keep_registered(self) -> None:
        delay = self._reconnect_delay
        told = 0  # NOT_REGISTERED answers in a row from one replica
        teller: object = None  # that replica
        while self._host is not None and not self._closed.is_set():
            try:
                await self._keep_once()
                if not self._needs_register.is_set():
                    delay = self._reconnect_delay
                    self._moved = 0
                    told = 0
                    continue
                # Told NOT_REGISTERED: registered again at once the first time (a
                # replica that lost us), with the backoff when that replica refuses
                # the registration it just made that way again (one that cannot
                # keep us, or a hostile one: before, ~84 registrations a second).
                # Another replica's first NOT_REGISTERED (a rolling restart) is a
                # first time again.
                beats = self._beats
                where = beats.replica if beats is not None else self._route
                told = told + 1 if where == teller else 1
                teller = where
                if told > 1:
                    log.info("matchmaker_retry error=NotRegistered detail='' delay=%.1f", delay)
                    await self._pause(delay)
                    delay = min(delay * 2, self._max_reconnect_delay)
            except _KEEPER_ERRORS as exc:
                capped = isinstance(exc, MatchmakerError) and exc.reason in _CAPPED
                if _is_final(exc) and not capped and not self._other_replica_may(exc):
                    self._give_up(exc)
                    return
                self._note_failure(exc)
                self._needs_register.set()
                if capped:
                    delay = self._max_reconnect_delay
                elif self._moves_on(exc):
                    continue  # another replica at once
                log.info(
                    "matchmaker_retry error=%s detail=%r delay=%.1f",
                    type(exc).__name__,
                    str(exc),
                    delay,
                )
                await self._pause(delay)
                delay = min(delay * 2, self._max_reconnect_delay)

    def _give_up(self, exc: BaseException) -> None:
        """The registration cannot be kept (a final refusal, or the game socket is
        closed): stop, and say why in `registration_error`."""
        if isinstance(exc, MatchmakerError):
            log.warning("registration_refused reason=%s detail=%r", exc.reason, exc.detail)
        else:
            log.warning("keepalive_stopped error=%s detail=%r", type(exc).__name__, str(exc))
        self.registration_error = exc
        self._host = None
        self._free_socket()
        if self._beats is not None:
            self._beats = None
            self._listen(on=False)

    async def _pause(self, delay: float) -> None:
        """Wait `delay` seconds before registering again.  A heartbeating host keeps
        heartbeating its old registration meanwhile (one datagram per keepalive,
        answered or not): until a new registration succeeds, the old one is all
        the listing there is."""
        loop = asyncio.get_running_loop()
        end = loop.time() + delay
        beats, port = self._beats, self._port
        while True:
            if beats is not None and port is not None and beats is self._beats:
                beats.counter += 1
                data = hb.encode_beat(beats.secret, beats.address, beats.counter)
                with contextlib.suppress(*TRANSPORT_ERRORS):
                    port.send_datagram(data, beats.replica)
            left = end - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(max(self._keepalive, MIN_KEEPALIVE), left))

    def _moves_on(self, exc: BaseException) -> bool:
        """Whether to retry at once: the failure is one another replica may not
        share, and not every address has failed that way in a row."""
        if isinstance(exc, MatchmakerError):
            # A replica stopping, in trouble or wrong for us: the next may not be.
            # Not rate_limited: that limit is this client's doing, and two
            # addresses may be one replica.
            quick = exc.reason is ErrorReason.SHUTTING_DOWN or (
                self._route_count > 1 and (exc._replica_only or exc.reason in _TROUBLED)
            )
        elif isinstance(exc, MatchmakerUnreachable):
            quick = False  # every address failed already
        else:
            quick = isinstance(exc, TRANSPORT_ERRORS)  # the connection ended under us
        if not quick or self._moved >= self._route_count:
            return False
        self._moved += 1
        return True

    def _refused_by(self, conn: Peer, exc: BaseException) -> None:
        """The replica `conn` leads to answered, but not with what was asked: it is
        in trouble (``unavailable``, ``internal``), sent a reply the client could not
        accept (`ReplyRefused`) or only it may be wrong about (`_replica_only`).
        With another address to turn to, its connection is given up, so that the
        next attempt goes to the next address and this one is tried last (the
        rule counts addresses: one replica under two, IPv4 and IPv6, is tried
        under the other).  With one address there is nowhere else to go: the
        connection is kept, and the caller retries it after its backoff.  A request
        refused ``rate_limited`` keeps its connection whatever the addresses, and
        backs off: the limit is this client's doing (and the other answers in
        flight on the connection would be lost: given up, it fails them with
        `ConnectionLost`)."""
        if self._conn is not conn or self._route_count < 2:
            return
        if (
            isinstance(exc, MatchmakerError)
            and not exc._replica_only
            and exc.reason not in _TROUBLED
        ):
            return
        log.info("matchmaker_refused address=%s error=%s", self._route, _describe(exc))
        # A heartbeating host's listing does not live on the connection.
        self._abandon(register_again=self._beats is None)

    def _other_replica_may(self, exc: BaseException) -> bool:
        """Whether a refusal final from the replica that made it leaves another to
        try (`MatchmakerError._replica_only`): until each replica has answered so,
        it does not end `register` or the keep-alive."""
        if not _replica_only(exc):
            return False
        if self._route is not None:
            self._wrong_replicas.add(self._route)
        return len(self._wrong_replicas) < self._route_count

    def _note_failure(self, exc: BaseException) -> None:
        """Remember what went wrong where; a replica that refused is tried last."""
        if isinstance(exc, MatchmakerUnreachable):
            return  # already noted per address by _open
        if self._route is not None:
            self._tried[self._route] = _describe(exc)
        if isinstance(exc, MatchmakerError) and exc.reason is ErrorReason.SHUTTING_DOWN:
            self._abandon()

    async def _keep_once(self) -> None:
        host = self._host
        if host is None:
            return
        if self._needs_register.is_set():
            await self._register_now(host)
            log.info("reregistered")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._needs_register.wait(), self._keepalive)
        if self._needs_register.is_set():
            return
        if self._beats is not None:
            await self._heartbeat(self._beats)
        else:
            conn = await self._connection()
            acked = conn.send(encode(Heartbeat()))
            try:
                await asyncio.wait_for(acked, self._timeout)
            except _CONNECT_ERRORS:
                # A replica that does not ack is dead (or cut off): move on.
                if self._conn is conn:
                    self._abandon()
                raise ConnectionLost("heartbeat not acknowledged") from None

    async def _heartbeat(self, beats: _Beats) -> None:
        """One heartbeat, resent until acknowledged or ``timeout`` runs out.  A
        replica that does not answer (dead, cut off) or says NOT_REGISTERED
        (stopping) is replaced by the next that takes the heartbeat over."""
        # With another replica to turn to, two heartbeats unanswered for half of
        # ``timeout`` are enough: moving costs one datagram, and staying on a dead
        # replica costs the listing.
        patience = self._timeout / 2 if len(self._replicas) > 1 else self._timeout
        if await self._beat_round(beats, patience):
            return
        refused = self._needs_register.is_set()
        if await self._move(beats) or self._needs_register.is_set():
            return  # taken over; or to register with the replica that said NOT_REGISTERED
        if refused:
            self._needs_register.set()  # no other replica answered: register again
            return
        # A replica that does not answer is dead (or cut off), and no other took
        # the registration over: register again.
        self._abandon()
        raise ConnectionLost("heartbeat not acknowledged")

    async def _beat_round(
        self, beats: _Beats, patience: float, kind: hb.Kind = hb.Kind.HEARTBEAT
    ) -> bool:
        """Heartbeats of `kind` to `beats.replica`, one every ``timeout / 4``, until
        one is acknowledged (True), NOT_REGISTERED comes back or `patience` runs out."""
        port = self._port
        assert port is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        start = beats.counter + 1  # this round's first heartbeat
        while True:
            beats.counter += 1
            beats.answered.clear()
            data = hb.encode_beat(beats.secret, beats.address, beats.counter, kind)
            with contextlib.suppress(*TRANSPORT_ERRORS):
                port.send_datagram(data, beats.replica)
            wait = min(self._timeout / 4, deadline - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(beats.answered.wait(), max(wait, 0.0))
            if self._needs_register.is_set():
                return False
            if beats.acked >= start:
                return True  # answered (the window moved past what was acknowledged)
            if loop.time() >= deadline:
                return False

    async def _move(self, beats: _Beats) -> bool:
        """Heartbeat the other replicas in turn until one takes the registration
        over (True: it is our replica now, for heartbeats, requests and
        introductions).  Any replica can check our heartbeat: one datagram
        instead of a new registration.  Only these heartbeats are MOVING, the kind
        a replica takes a host over on (a copy of a plain one moves nothing).  One
        that does not list us answers NOT_REGISTERED: we register there (False);
        a stopping one does not answer, and the next is tried."""
        left = beats.replica
        others = [label for label in self._replicas if not _same_place(self._replicas[label], left)]
        # From a random one of them (fixed per client), so that the hosts of a
        # dead replica spread over the others.
        first = self._start % len(others) if others else 0
        order = others[first:] + others[:first]
        for n, label in enumerate(order):
            replica = self._replicas[label]
            self._needs_register.clear()
            beats.replica = replica
            # Half of ``timeout`` while another replica is left to try (a stopping
            # one stays silent), all of it for the last.
            patience = self._timeout / 2 if n + 1 < len(order) else self._timeout
            taken = await self._beat_round(beats, patience, hb.Kind.MOVING)
            if taken or self._needs_register.is_set():
                self._route, self._avoid = label, None  # a live replica: next requests go there
                if taken:
                    beats.former = left
                    self.takeovers += 1
                    log.info("taken_over address=%s", label)
                return taken
        beats.replica = left
        return False

    def _listen(self, on: bool = True) -> None:
        """Route the matchmaker's datagrams on the host's socket to this client
        (`on` False: give them back)."""
        if self._port is None:
            return
        for kind in (hb.Kind.HEARTBEAT_ACK, hb.Kind.NOT_REGISTERED, hb.Kind.INTRODUCTION):
            self._port.set_datagram_handler(kind, self._on_datagram if on else None)

    def _on_datagram(self, data: bytes, source: tuple[Any, ...]) -> list[bytes]:
        beats = self._beats
        if beats is None or not data:
            return []
        if not _same_place(source, beats.replica):
            former = beats.former
            if data[0] == hb.Kind.INTRODUCTION and former and _same_place(source, former):
                # Authenticated by its MAC; sent before that replica saw us move.
                return self._on_introduction_datagram(beats, data, beats.intros_from(former))
            # Only the replica we heartbeat to speaks for the registration.
            self.dropped["wrong_source"] += 1
            return []
        if data[0] == hb.Kind.HEARTBEAT_ACK:
            acked = hb.decode_ack(beats.secret, beats.address, data)
            if acked is None:
                self.dropped["bad_mac"] += 1
            elif acked > beats.counter:
                self.dropped["stale"] += 1
            elif acked < beats.round_start:
                # A heartbeat acknowledged already (a copy, or one overtaken by a
                # later acknowledgment), or one before the first: it moves nothing,
                # and must not wake the round into sending the next one early.
                self.dropped["stale_ack"] += 1
            else:
                beats.acked = max(beats.acked, acked)
                # Heartbeats up to the one acknowledged wait no longer (a NOT_REGISTERED
                # for one is stale); those sent after it still do, whatever the round.
                beats.round_start = max(beats.round_start, beats.acked + 1)
                beats.answered.set()
        elif data[0] == hb.Kind.NOT_REGISTERED:
            # Only an answer to a heartbeat still waiting counts.  Without a MAC
            # (the replica does not list us) the echoed counter is the proof:
            # it started at random, so no one off the path can know it.
            found = hb.decode_not_registered(beats.secret, beats.address, data)
            if found is None:
                self.dropped["bad_mac"] += 1
            elif not beats.round_start <= found[0] <= beats.counter:
                self.dropped["stale"] += 1
            else:
                log.info("heartbeat_not_registered authenticated=%s", found[1])
                self._needs_register.set()
                beats.answered.set()
        elif data[0] == hb.Kind.INTRODUCTION:
            return self._on_introduction_datagram(beats, data, beats.intros_from(source))
        return []

    def _on_introduction_datagram(
        self, beats: _Beats, data: bytes, seen: _IntroductionIds
    ) -> list[bytes]:
        found = hb.decode_introduction(beats.secret, beats.address, data)
        if found is None:
            self.dropped["bad_mac"] += 1
            return []
        intro_id, payload = found
        ack = hb.encode_introduction_ack(beats.secret, beats.address, intro_id)
        if not seen.take(intro_id):
            # Our acknowledgement was lost and the replica sent it again, or a copy
            # was replayed: acknowledged (the replica stops resending), not queued.
            self.dropped["seen_introduction"] += 1
            return [ack]
        self._on_message(payload)
        return [ack]

    async def _stop_keeper(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None

    # ------------------------------------------------------------------ clients

    async def list_servers(self, *, game: str, **filters: Any) -> ServerList:
        """Hosts of `game` matching the filters (see ListFilter), in the matchmaker's
        fair random order: a `ServerList`, whose ``limit_reached`` says the answer
        was cut at ``limit`` hosts (1,000 unless the filters say otherwise) or is
        partial (``ServerList.partial``)."""
        for key in ("tags_all", "tags_any"):
            if key in filters:
                filters[key] = str_tuple(filters[key], key)
        rid = next(self._ids)
        request = ListRequest(request_id=rid, filter=ListFilter(game=game, **filters))
        limit = request.filter.limit
        # How many hosts an answer may hold is the matchmaker's to say (--list-limit).
        lifted = max(limit, self._limits.list_limit) if type(limit) is int else 0
        self._check_request(request, request.filter, "list_servers()", list_limit=lifted)
        loop = asyncio.get_running_loop()
        pending = _PendingList(loop.create_future(), {}, max_pages=max(limit, 1))
        self._lists[rid] = pending
        try:
            conn = await self._connection()
            conn.send(encode(request))
            try:
                pages = await self._reply(pending.future, conn)
            except (MatchmakerError, ReplyRefused) as exc:
                self._refused_by(conn, exc)
                raise
        finally:
            self._lists.pop(rid, None)
        partial = any(page.partial for page in pages)
        return ServerList(_distinct(pages, limit), limit=limit, partial=partial)

    async def introduce(
        self, host: Address | tuple[str, int], *, lan: tuple[str, int] | None = None
    ) -> Introduction:
        """Ask to join `host`; returns where to connect (and the shared nonce)."""
        check_address(host, "introduce() host")
        if lan is not None:
            check_address(lan, "lan")
        target = make_address(*host)
        lan_address = make_address(*lan) if lan else None
        return await self._expect(Introduce(host=target, lan=lan_address), Introduction)

    async def ticket(
        self,
        host: Address | tuple[str, int],
        *,
        lan: tuple[str, int] | None = None,
        user_data: bytes = b"",
    ) -> Ticket:
        """Ask to join `host` with a connect token; `Ticket.connect` then joins it.

        `user_data` (at most 256 bytes) goes into the token, which the host reads as
        ``conn.peer_identity.user_data``. Raises UntrustedIntroduction when the
        pinned issuer key does not vouch for the answer (see `matchmaker.tickets`).
        """
        if not self._issuer_keys:
            raise ValueError(
                "ticket() needs the pinned issuer key: MatchmakerClient(issuer_keys=...)"
            )
        check_address(host, "ticket() host")
        if lan is not None:
            check_address(lan, "lan")
        handshake_key = rudp.generate_key()
        request = Introduce(
            host=make_address(*host),
            lan=make_address(*lan) if lan else None,
            client_key=rudp.public_key(handshake_key),
            user_data=user_data,
        )
        intro = await self._expect(request, Introduction)
        return check_introduction(intro, self._issuer_keys, handshake_key)

    async def info(self) -> InfoReply:
        return await self._expect(InfoRequest(), InfoReply)

    # ------------------------------------------------------------------ plumbing

    async def close(self) -> None:
        """Stop keeping alive and close the connection; a host leaves the list at once
        (a LEAVE datagram, or the connection's `Unregister`-less end).

        The client is done with then: a `register()` still under way, and every
        request waiting for its reply, raise `ConnectionLost` ("client closed"),
        and so does any later request."""
        self._closed.set()
        self._fail_all(_closed_error())
        await self._leave()
        conn, self._conn = self._conn, None
        if conn is not None:
            # A dead replica never answers the close: rudp would wait for its idle
            # timeout; the client's own ``timeout`` bounds it as everywhere else.
            await _close_quietly(conn, self._timeout, "")
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for closing in list(self._closing):
            closing.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _claim_socket(self) -> None:
        """Make this client the one registering through its game socket, or raise
        if another client registers through it."""
        if self._port is None:
            return
        other = self._socket_holder()
        if other is not None and other is not self:
            raise RuntimeError(
                f"the game socket already registers through another MatchmakerClient "
                f"({other!r}): its heartbeat and introduction datagrams go to one client; "
                f"close or unregister that one first"
            )
        _SOCKET_HOSTS[id(self._port)] = weakref.ref(self)

    def _free_socket(self) -> None:
        if self._port is not None and self._socket_holder() is self:
            del _SOCKET_HOSTS[id(self._port)]

    def _socket_holder(self) -> MatchmakerClient | None:
        """The live client registering through this client's game socket, if any."""
        ref = _SOCKET_HOSTS.get(id(self._port))
        holder = ref() if ref is not None else None
        if holder is None or holder._port is not self._port:
            return None
        return holder

    def _check_request(
        self, request: Message, fields: object, what: str, *, list_limit: int = 0
    ) -> None:
        """Refuse at once, with ValueError naming the field, what the matchmaker
        would refuse: its own reader checks the request, with its limits."""
        limits = self._limits
        if list_limit > limits.list_limit:
            limits = replace(limits, list_limit=list_limit)
        try:
            decode(encode(request), limits)
        except MessageError as exc:
            detail = exc.detail or exc.reason.value
            if exc.reason is ErrorReason.TOO_LARGE:
                detail = (
                    f"too large ({detail} bytes); the largest field is {_largest_field(fields)}"
                )
            raise ValueError(f"{what}: {detail}") from None

    async def _leave(self) -> None:
        """Stop keeping alive and take the host off the list, if it is on it."""
        was_host, self._host = self._host is not None, None
        await self._stop_keeper()
        self._free_socket()
        beats, self._beats = self._beats, None
        if was_host and beats is None and self._conn is not None:
            # Connection mode: the entry does not end with the connection.
            with contextlib.suppress(*TRANSPORT_ERRORS):
                self._conn.send(encode(Unregister(request_id=next(self._ids))))
        if beats is not None and self._port is not None:
            leave = hb.encode_beat(beats.secret, beats.address, beats.counter + 1, hb.Kind.LEAVE)
            with contextlib.suppress(*TRANSPORT_ERRORS):
                self._port.send_datagram(leave, beats.replica)
            self._listen(on=False)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise _closed_error()

    async def _connection(self, deadline: float | None = None) -> Peer:
        self._check_open()
        if deadline is None:
            await self._connecting.acquire()
        else:
            # Another request may be connecting (to a silent replica, for up to
            # ``timeout``): waiting for it counts against `deadline` too.
            try:
                await asyncio.wait_for(self._connecting.acquire(), self._budget(deadline))
            except TimeoutError:
                raise TimeoutError("out of time waiting for another connection attempt") from None
        try:
            if self._conn is None:
                conn = await self._open(deadline)
                if self._closed.is_set():
                    # Closed while connecting: this connection is not wanted.
                    await _close_quietly(conn, self._timeout)
                    raise _closed_error()
                self._conn = conn
                self._reader = asyncio.create_task(self._read(conn), name="mm-reader")
            return self._conn
        finally:
            self._connecting.release()

    async def _open(self, deadline: float | None = None) -> Peer:
        """Connect to the first address that answers, starting after the one last
        used (when its connection ended) so that a dead replica is tried last;
        by `deadline` (the loop's time) at the latest."""
        start = asyncio.get_running_loop().time()
        routes = await self._routes()
        self._route_count = len(routes)
        labels = [label for label, _ in routes]
        if self._route in labels:
            first = labels.index(self._route) + (1 if self._avoid == self._route else 0)
        else:
            first = self._start
        n = len(routes)
        order = [routes[(first + i) % n] for i in range(n)] if n else []
        failures: list[str] = []
        for label, connect in order:
            self._check_open()
            if self._budget(deadline) <= 0:
                failures.append(f"{label} (not tried: out of time)")
                continue
            self._route = label
            released = self._releasing.pop(label, None)
            if released is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(released), self._budget(deadline))
            try:
                conn = await self._connect_unless_closed(connect, self._budget(deadline))
            except rudp.EndpointClosed:
                raise  # our own socket is closed: no replica can help
            except _CONNECT_ERRORS as exc:
                if self._closed.is_set():
                    raise _closed_error() from None  # not the replica's doing
                self._tried[label] = _describe(exc)
                failures.append(f"{label} ({_describe(exc)})")
                log.info("matchmaker_unreachable address=%s error=%s", label, type(exc).__name__)
                continue
            self._avoid = None
            if len(routes) > 1:
                log.info("matchmaker_connected address=%s", label)
            return conn
        self._avoid = self._route
        raise MatchmakerUnreachable(failures, asyncio.get_running_loop().time() - start)

    async def _connect_unless_closed(self, connect: Connector, timeout: float) -> Peer:
        """``connect()`` within `timeout` (else TimeoutError), given up at once, with
        ``ConnectionLost("client closed")``, when `close()` comes first."""
        attempt = asyncio.ensure_future(connect())
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            done, _ = await asyncio.wait(
                (attempt, closed), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            attempt.cancel()
            raise
        finally:
            closed.cancel()
        if attempt in done:
            return attempt.result()
        attempt.cancel()
        await asyncio.wait((attempt,))  # its own cleanup (a connection aborted)
        if not attempt.cancelled() and attempt.exception() is None:
            # It connected just as it was given up: that connection is not wanted.
            await _close_quietly(attempt.result(), self._timeout)
        if self._closed.is_set():
            raise _closed_error()
        raise TimeoutError(f"no connection within {timeout:g} s")

    def _abandon(self, *, register_again: bool = True) -> None:
        """Give up the current connection (dead or stopping replica) without waiting.

        `register_again`: whether the host (if any) must register again; a request
        that timed out leaves a heartbeating host's listing alone (it does not
        depend on the connection, and heartbeats tell whether the replica lists
        it). A new connection to the same address waits for this one's close:
        rudp holds one connection per address until its close ends."""
        conn, self._conn = self._conn, None
        self._avoid = self._route
        if conn is None:
            return
        self._fail_all(ConnectionLost("matchmaker replica abandoned"))
        if self._host is not None and register_again:
            self._needs_register.set()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        closing = asyncio.create_task(_close_quietly(conn, self._timeout), name="mm-close")
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        if self._route is not None:
            self._releasing[self._route] = closing

    def _release(self) -> None:
        """Close the connection in the background when a heartbeating host has no
        request left on it (the registry entry does not depend on it)."""
        if self._beats is None and self._host is not None:
            return  # connection mode: the connection carries the heartbeats
        if self._port is None or self._pending or self._lists or self._conn is None:
            return
        conn, self._conn = self._conn, None
        reader, self._reader = self._reader, None
        if reader is not None:
            # Left to read until the connection ends: an introduction the matchmaker
            # sent over it before it closed still reaches `introductions`.
            self._closing.add(reader)
            reader.add_done_callback(self._closing.discard)
        closing = asyncio.create_task(_close_quietly(conn, self._timeout), name="mm-close")
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        if self._route is not None:
            self._releasing[self._route] = closing

    async def _expect(self, request: Message, reply_type: type[M]) -> M:
        reply, _ = await self._expect_on(request, reply_type)
        return reply

    async def _expect_on(
        self, request: Message, reply_type: type[M], deadline: float | None = None
    ) -> tuple[M, Peer]:
        """The reply, and the connection that carried it (by `deadline`, when given)."""
        reply, conn = await self._request(request, deadline)
        if not isinstance(reply, reply_type):
            error = _unexpected(reply)
            self._refused_by(conn, error)
            raise error
        return reply, conn

    async def _request(
        self, request: Message, deadline: float | None = None
    ) -> tuple[Message, Peer]:
        rid = next(self._ids)
        request = _with_id(request, rid)
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            conn = await self._connection(deadline)
            conn.send(encode(request))
            try:
                return await self._reply(future, conn, deadline), conn
            except (MatchmakerError, ReplyRefused) as exc:
                self._refused_by(conn, exc)
                raise
        finally:
            self._pending.pop(rid, None)
            # A rejection raised from the future holds this frame in its traceback,
            # and the frame the future: a cycle through the connection otherwise.
            del future

    async def _reply(
        self, future: asyncio.Future[T], conn: Peer, deadline: float | None = None
    ) -> T:
        """The reply `future` awaits, from the replica `conn` leads to, waited for
        ``timeout`` (less when `deadline` comes first).  A replica silent for all
        of ``timeout`` is given up (dead, cut off, or stuck): the next attempt goes
        to another."""
        route = self._route or "the matchmaker"
        wait = self._budget(deadline)
        refusals = self._refusals
        try:
            return await asyncio.wait_for(future, wait)
        except TimeoutError:
            if self._conn is conn and wait >= self._timeout:
                self._abandon(register_again=self._beats is None)
            if self._refusals != refusals and self._refused is not None:
                # The matchmaker answered, with a reply whose id could not be read.
                raise ReplyRefused(*self._refused) from None
            raise RequestTimeout(route, wait) from None

    def _budget(self, deadline: float | None) -> float:
        """How long the next wait may last: ``timeout``, or less to end by `deadline`."""
        if deadline is None:
            return self._timeout
        left = deadline - asyncio.get_running_loop().time()
        return max(0.0, min(self._timeout, left))

    async def _read(self, conn: Peer) -> None:
        try:
            async for received in conn:
                self._on_message(received.data, reply=True)
        finally:
            # A connection already given up (`_abandon`) no longer speaks for the client.
            if self._conn is conn:
                self._conn = None
                self._avoid = self._route
                self._fail_all(ConnectionLost("connection to the matchmaker ended"))
                if self._host is not None:
                    self._needs_register.set()

    def _on_message(self, data: bytes, *, reply: bool = False) -> None:
        """A message from the matchmaker: over the connection (`reply`), or an
        introduction's payload from a datagram."""
        try:
            msg = decode(data, self._limits)
        except MessageError as exc:
            log.warning("bad_reply reason=%s detail=%r", exc.reason, exc.detail)
            if reply:
                self._refuse_reply(exc)
            return
        if isinstance(msg, Introduction) and msg.role is Role.HOST:
            self._queue_introduction(msg)
        elif isinstance(msg, ListPage):
            self._on_page(msg)
        elif isinstance(msg, Error) and msg.reason is ErrorReason.NOT_REGISTERED:
            self._needs_register.set()
            self._resolve(msg)
        else:
            self._resolve(msg)

    def _refuse_reply(self, exc: MessageError) -> None:
        """A reply over the connection that the client could not accept fails the
        request it answers at once, when its id could be read; else a request that
        times out meanwhile says so (`_reply`): the matchmaker did answer."""
        detail = str(exc)
        if exc.reason is ErrorReason.TOO_LARGE or exc.reason is ErrorReason.BAD_FIELD:
            detail += " (past the client's limits: does the matchmaker have larger ones?)"
        self._refused = (self._route or "the matchmaker", detail)
        future: asyncio.Future[Any] | None = self._pending.get(exc.request_id)
        pending_list = self._lists.get(exc.request_id)
        if pending_list is not None:
            future = pending_list.future
        if future is not None and not future.done():
            future.set_exception(ReplyRefused(*self._refused))
        elif future is None:
            # Whose it was cannot be told: a request timing out meanwhile says so.
            self._refusals += 1

    def _resolve(self, msg: Message) -> None:
        future: asyncio.Future[Any] | None = self._pending.get(msg.request_id)
        pending_list = self._lists.get(msg.request_id)
        if pending_list is not None:
            future = pending_list.future
        if future is None or future.done():
            return
        if isinstance(msg, Error):
            future.set_exception(MatchmakerError(msg.reason, msg.detail))
        elif isinstance(msg, WrongVersion):
            future.set_exception(_wrong_reply(ErrorReason.WRONG_VERSION, str(msg.supported)))
        elif pending_list is not None:
            # A list is answered with pages (`_on_page`) or an error, nothing else.
            future.set_exception(_unexpected(msg))
        else:
            future.set_result(msg)

    def _on_page(self, page: ListPage) -> None:
        pending = self._lists.get(page.request_id)
        if pending is None or pending.future.done():
            return
        if page.seq >= pending.max_pages:
            # An answer of `limit` hosts has at most `limit` pages: past that the
            # replica is wrong (or hostile), and holding its pages until the timeout
            # let one answer fill the client's memory (1,800 pages in 5 s).
            pending.future.set_exception(
                _wrong_reply(
                    ErrorReason.MALFORMED,
                    f"list page {page.seq} of an answer of at most {pending.max_pages} pages",
                )
            )
            pending.future.exception()  # retrieved: list_servers() raises it anyway
            return
        pending.pages[page.seq] = page
        if page.end:
            pending.last = page.seq
        last = pending.last
        # >= and the check: a confused matchmaker may send a seq past the end.
        if last is not None and len(pending.pages) >= last + 1:
            pages = [pending.pages.get(i) for i in range(last + 1)]
            if all(p is not None for p in pages):
                pending.future.set_result([p for p in pages if p is not None])

    def _queue_introduction(self, intro: Introduction) -> None:
        if self.introductions.full():
            self.introductions.get_nowait()  # keep the newest: older ones are stale
        self.introductions.put_nowait(intro)

    def _fail_all(self, exc: Exception) -> None:
        futures: list[asyncio.Future[Any]] = [*self._pending.values()]
        futures += [p.future for p in self._lists.values()]
        for future in futures:
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: a request not yet awaiting it raises anyway


def _check_number(value: object, name: str, *, positive: bool = False) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name} takes a number of seconds, not {value!r}")
    if not (value > 0 if positive else value >= 0) or value != value:
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} seconds, not {value!r}")


def _check_port(port: object, name: str) -> int:
    port = check_port(port, name)
    if not 1 <= port <= 0xFFFF:
        raise ValueError(f"{name} must be in 1..65535, not {port}")
    return port


def _largest_field(fields: object) -> str:
    """The name of the longest str, bytes or sequence field of a dataclass."""
    sizes = {
        name: len(value)
        for name in getattr(fields, "__dataclass_fields__", {})
        if isinstance(value := getattr(fields, name), str | bytes | tuple)
    }
    return max(sizes, key=lambda name: sizes[name]) if sizes else "its fields"


def _is_final(exc: BaseException) -> bool:
    """Whether retrying cannot help: a refusal for good, or our own socket closed
    (``rudp.EndpointClosed``: the game server is gone). Any other
    ``LocalProtocolError`` from a connect (the address's previous connection still
    closing, say) passes: it is retried as a failed connection."""
    if isinstance(exc, MatchmakerError):
        return exc.reason not in _RETRYABLE
    return isinstance(exc, rudp.EndpointClosed)


def _closed_error() -> ConnectionLost:
    return ConnectionLost("client closed")


def _same_place(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two socket addresses name the same IP and port."""
    try:
        return make_address(str(a[0]), int(a[1])) == make_address(str(b[0]), int(b[1]))
    except (ValueError, IndexError, TypeError):
        return False


def _distinct(pages: Iterable[ListPage], limit: int) -> list[HostEntry]:
    """The pages' hosts in order, each address once (the first entry of it kept), and
    at most `limit` of them: a matchmaker lists each host once and no more than was
    asked, so what a faulty or hostile one sends beyond that is dropped (a client
    querying every listed host would otherwise send one address a query per copy)."""
    hosts: list[HostEntry] = []
    seen: set[Address] = set()
    for page in pages:
        for entry in page.hosts:
            if len(hosts) >= limit:
                return hosts
            if entry.address not in seen:
                seen.add(entry.address)
                hosts.append(entry)
    return hosts


def _with_id(msg: Message, rid: int) -> Message:
    return replace(msg, request_id=rid)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _close_quietly(conn: Peer, timeout: float, text: str = "failover") -> None:
    """Close `conn`, waiting `timeout` at most (a dead peer never answers)."""
    with contextlib.suppress(*_CONNECT_ERRORS):
        await asyncio.wait_for(conn.close(text=text), timeout)


def _fixed_routes(routes: list[Route]) -> Routes:
    async def lookup() -> list[Route]:
        return routes

    return lookup


def _resolving_routes(
    replicas: list[tuple[str, int]],
    via: rudp.Server | None,
    config: rudp.Config | None,
    server_key: bytes | None = None,
    found: dict[str, tuple[str, int]] | None = None,
) -> Routes:
    """Every address each replica name resolves to, looked up per attempt (DNS
    round robin, a name whose records change as replicas come and go)."""

    # An IPv4 game socket cannot reach the replicas' IPv6 addresses, nor an IPv6-only
    # one their IPv4 addresses; a dual-stack one reaches both (IPv4 as v4-mapped).
    family: int = socket.AF_UNSPEC
    if via is not None:
        sock_family, flags = via.endpoint.destination_family()
        if not flags & socket.AI_V4MAPPED:
            family = sock_family

    async def lookup() -> list[Route]:
        loop = asyncio.get_running_loop()
        routes: list[Route] = []
        seen: set[tuple[str, int]] = set()
        for host, port in replicas:
            try:
                infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
                ips = [str(info[4][0]) for info in infos]
            except OSError:
                ips = [host]  # let the connect attempt report it
            for ip in ips:
                if (ip, port) in seen:
                    continue
                seen.add((ip, port))
                label = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if found is not None:
                    found[label] = (ip, port)  # where heartbeats go on failover
                connector = rudp_connector(ip, port, via=via, config=config, server_key=server_key)
                routes.append((label, connector))
        return routes

    return lookup
