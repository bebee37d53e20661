"""A small, strict, GET-only HTTP/1.1 server for operators and web server browsers.

Endpoints
---------
``/metrics``   Prometheus text exposition (``prometheus_client.generate_latest``).
``/healthz``   200 while the process runs its event loop (liveness); with
               workers, ``"degraded"`` and ``workers_down`` name the siblings the
               supervisor sees down (not serving yet, or silent).
``/readyz``    200 once the registry is loaded, the daemon is not shutting
               down and no sibling worker is down, else 503; the JSON body
               says whether the list is stale.
``/servers``   The server list as JSON; query parameters are the list filters
               (without ``game``: every game's hosts, with the same limit and
               paging; ``tags_all``/``tags_any`` comma-separated or repeated;
               booleans as 1/0/true/false/yes/no), validated by the same code as the
               wire protocol; rate limited per source like list requests.
               ``{"total", "limit", "limit_reached", "servers"}``:
               ``limit_reached`` says the answer was cut at ``limit`` hosts, or
               is partial (``"partial": true``: the bounded search stopped first).

Why not a framework: this is four read-only endpoints, and a dependency for
them would be most of the daemon's attack surface.  The server here reads one
request per connection (``Connection: close``) with hard limits: a request
head of at most 8 KiB and 64 header lines, read within ``http_timeout``
seconds, at most ``http_max_connections`` connections at once, lingering ones
included (more are refused with 503), of which at most `MAX_CONNECTIONS_PER_IP`
from one source (more get 429).  A connection refused for want of a slot that asks for
``/healthz`` or ``/readyz`` within `PROBE_READ` is answered all the same, so slow
clients filling every slot cannot fail the probes; at most `MAX_PROBE_READERS` such
connections are read at once, and when they all are, a new one takes the place of
the one that has waited longest for its request (answered 503 and closed), so
silent connections cannot keep a probe from being read either.  Bodies are not accepted;
anything but GET/HEAD gets 405.  A refused connection (429, 503) is answered and
closed at once: it holds no descriptor while a client lingers.  An answered
connection lingers (`HttpServer._linger`: up to ``http_timeout`` for the client to
read and close) in its slot, so lingering descriptors are bounded by the slots too.

The answers that cost in proportion to the registry (``/servers``, ``/metrics``)
are built one at a time, so the event loop serves the UDP port (registrations,
heartbeats) between any two of them, however many arrive at once; at most
`MAX_WAITING_BUILDS` wait, more get 503.  Lists of every game take at most a
fifth of the time (`EVERY_GAME_SHARE`), with a burst of `EVERY_GAME_BURST`.
Every answer is counted in ``matchmaker_http_requests_total`` by path and status,
refusals included.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from matchmaker.addresses import from_sockaddr, rate_key
from matchmaker.catalog import EVERY_GAME
from matchmaker.messages import (
    ErrorReason,
    Limits,
    ListFilter,
    ListRequest,
    MessageError,
    filter_from_mapping,
)
from matchmaker.metrics import Metrics
from matchmaker.ratelimit import RateLimiter
from matchmaker.registry import Registry
from matchmaker.stopping import STOP_WITHIN, cancel_and_wait

log = structlog.get_logger("matchmaker.http")

MAX_HEAD_BYTES = 8192
MAX_HEADER_LINES = 64
MAX_QUERY_FIELDS = 32
MAX_CONNECTIONS_PER_IP = 8
"""Concurrent connections from one source (IPv6: one /64), lingering ones included."""
MAX_WAITING_BUILDS = 16
"""Requests for ``/servers`` or ``/metrics`` that may wait while another is built;
more are answered 503 at once."""
EVERY_GAME_SHARE = 0.2
"""The most of the daemon's time (a fifth) that ``/servers`` answers without ``game``
take, their cost growing with every host of every game.  Each adds its build time
divided by this to a debt that the clock pays off, during the build too; while the
debt is over `EVERY_GAME_BURST` such requests get 503, and cheap ones (a small
registry) go through back to back."""
EVERY_GAME_BURST = 0.5
"""Seconds of debt (see `EVERY_GAME_SHARE`) under which a list of every game is
built."""
PROBE_READ = 1.0
"""Seconds a connection refused for want of a slot has to name ``/healthz`` or
``/readyz``, which are answered all the same (slow clients filling every slot
must not fail the orchestrator's probes)."""
PROBES = ("/healthz", "/readyz")
"""The paths answered without queueing, even to a connection refused a slot."""
MAX_PROBE_READERS = 32
"""Refused connections read at once for a probe; one more takes the place of the
reader that has waited longest for its request head, which is answered 503 and
closed (a probe sends its request at once: silent connections arriving one after
another would otherwise hold every reader and fail it)."""
_BOOL_FIELDS = ("not_full", "not_empty", "password")
_INT_FIELDS = ("family", "limit")
_LIST_FIELDS = ("tags_all", "tags_any")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def json(cls, status: int, payload: object) -> Response:
        return cls(status, json.dumps(payload, separators=(",", ":")).encode())


_BUSY = Response.json(503, {"error": "busy"})


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.detail = detail


T = TypeVar("T")
ListServers = Callable[[ListRequest], Awaitable[list[dict[str, Any]]]]
"""The JSON entries answering a list request; a `Servers` says whether it is partial."""


class Servers(list[dict[str, Any]]):
    """A list answer's JSON entries, and whether the matchmaker stopped looking before
    it had ``limit`` hosts or every match (`listing.scan_budget`)."""

    def __init__(self, entries: Iterable[dict[str, Any]], *, partial: bool = False) -> None:
        super().__init__(entries)
        self.partial = partial


Exposition = Callable[[], Awaitable[bytes]]
"""The /metrics body: by default this process's registry; with several workers, every
worker's series with a ``worker`` label (`matchmaker.workers`)."""


class HttpApi:
    """Request routing; the socket side is `HttpServer`."""

    def __init__(
        self,
        *,
        registry: Registry,
        metrics: Metrics,
        list_servers: ListServers,
        limits: Limits,
        list_limiter: RateLimiter,
        is_shutting_down: Callable[[], bool],
        exposition: Exposition | None = None,
        workers_down: Callable[[], list[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._exposition = exposition
        self._clock = clock
        """Seconds, for the share of time lists of every game take (`EVERY_GAME_SHARE`)."""
        self._every_game_debt = 0.0
        self._every_game_paid = 0.0
        """What lists of every game owe (`EVERY_GAME_SHARE`), and when it was paid down."""
        # One costly answer built at a time (module doc), and how many wait for it.
        self._building = asyncio.Lock()
        self._waiting = 0
        self._registry = registry
        self._metrics = metrics
        self._list_servers = list_servers
        self._limits = limits
        self._limiter = list_limiter
        self._shutting_down = is_shutting_down
        self._workers_down = workers_down or (lambda: [])

    async def route(self, target: str, client_ip: str) -> tuple[str, Response]:
        """(path label, response) for a GET of `target`."""
        # Split by hand: urlsplit takes "//x/metrics" for a host and a path, and
        # raises on "//[/metrics" (which then answered 500 with a traceback).
        path, _, query = target.partition("#")[0].partition("?")
        if path == "/metrics":
            return path, await self._metrics_response()
        if path in PROBES:
            return path, self.probe(path)
        if path == "/servers":
            return path, await self._servers(query, client_ip)
        return "other", Response.json(404, {"error": "not_found"})

    def probe(self, path: str) -> Response:
        """The answer to ``/healthz`` or ``/readyz``: cheap, never queued."""
        if path == "/healthz":
            # 200 while a sibling worker is down too: the supervisor restarts it.
            down = self._workers_down()
            health: dict[str, object] = {"status": "degraded" if down else "ok"}
            if down:
                health["workers_down"] = down
            return Response.json(200, health)
        return self._ready()

    async def _metrics_response(self) -> Response:
        body = await self._one_at_a_time(self._metrics_exposition)
        return _BUSY if body is None else Response(200, body, CONTENT_TYPE_LATEST)

    def _ready(self) -> Response:
        down = self._workers_down()
        ready = self._registry.ready and not self._shutting_down() and not down
        body: dict[str, object] = {
            "ready": ready,
            "stale": self._registry.stale,
            "hosts": len(self._registry.index()),
        }
        if down:
            body["workers_down"] = down
        return Response.json(200 if ready else 503, body)

    async def _one_at_a_time(self, build: Callable[[], Awaitable[T]]) -> T | None:
        """``build()``'s result, built while no other costly answer is; None (answer
        503) when `MAX_WAITING_BUILDS` requests already wait."""
        if self._building.locked() and self._waiting >= MAX_WAITING_BUILDS:
            return None
        self._waiting += 1
        try:
            await self._building.acquire()
        finally:
            self._waiting -= 1
        try:
            # Built on a turn of the loop of its own: requests that arrived together
            # would otherwise each take the free lock and build, back to back, in one
            # turn. The next waiter runs on a later turn, after the loop's I/O.
            await asyncio.sleep(0)
            return await build()
        finally:
            self._building.release()

    async def _metrics_exposition(self) -> bytes:
        if self._exposition is not None:
            return await self._exposition()
        return generate_latest(self._metrics.registry)

    async def _servers(self, query: str, client_ip: str) -> Response:
        if not self._limiter.allow(rate_key(client_ip)):
            self._metrics.rate_limited.labels("list").inc()
            return Response.json(429, {"error": ErrorReason.RATE_LIMITED.value})
        try:
            f = parse_filter(query, self._limits)
        except MessageError as exc:
            return Response.json(400, {"error": exc.reason.value, "detail": exc.detail})
        if f.game != EVERY_GAME:
            answer = await self._one_at_a_time(lambda: self._servers_answer(f))
            return _BUSY if answer is None else answer
        if self._every_game_owed() > EVERY_GAME_BURST:
            return _BUSY
        answer = await self._one_at_a_time(lambda: self._every_game_answer(f))
        return _BUSY if answer is None else answer

    def _every_game_owed(self) -> float:
        now = self._clock()
        self._every_game_debt = max(0.0, self._every_game_debt - (now - self._every_game_paid))
        self._every_game_paid = now
        return self._every_game_debt

    async def _every_game_answer(self, f: ListFilter) -> Response:
        if self._every_game_owed() > EVERY_GAME_BURST:
            return _BUSY  # others were built while this one waited
        start = self._clock()
        try:
            return await self._servers_answer(f)
        finally:
            # The clock pays the debt off during the build too: a build of b seconds
            # owes b / share, so that it and the time paying it off span b / share.
            self._every_game_debt += (self._clock() - start) / EVERY_GAME_SHARE

    async def _servers_answer(self, f: ListFilter) -> Response:
        servers = await self._list_servers(ListRequest(filter=f))
        # The answer is a random sample of at most `limit` matches: at the limit, there
        # may be more (a narrower filter, or a higher --list-limit, would show them),
        # and so may there be when the search stopped first (partial).
        limit = min(f.limit, self._limits.list_limit)
        partial = isinstance(servers, Servers) and servers.partial
        body: dict[str, Any] = {
            "total": len(servers),
            "limit": limit,
            "limit_reached": partial or len(servers) >= limit,
        }
        if partial:
            body["partial"] = True
        return Response.json(200, body | {"servers": servers})


def parse_filter(query: str, limits: Limits) -> ListFilter:
    """A ListFilter from a URL query string; raises MessageError like the wire decoder.

    Without ``game`` the filter's game is ``catalog.EVERY_GAME``."""
    try:
        pairs = parse_qsl(query, strict_parsing=bool(query), max_num_fields=MAX_QUERY_FIELDS)
    except ValueError as exc:
        raise MessageError(ErrorReason.MALFORMED, str(exc)[:100]) from None
    fields: dict[str, object] = {}
    lists: dict[str, list[str]] = {}
    for key, value in pairs:
        if key in _LIST_FIELDS:
            lists.setdefault(key, []).extend(v for v in value.split(",") if v)
        elif key in fields:
            raise MessageError(ErrorReason.BAD_FIELD, f"{key}: given twice")
        else:
            fields[key] = _typed(key, value)
    if "game" in fields:
        return filter_from_mapping(fields | lists, limits)
    # Every game: validated with a stand-in name, as a filter for one game would be.
    f = filter_from_mapping(fields | lists | {"game": "every"}, limits)
    return replace(f, game=EVERY_GAME)


def _typed(key: str, value: str) -> object:
    if key in _BOOL_FIELDS:
        lowered = value.lower()
        if lowered in ("1", "true", "yes"):
            return True
        if lowered in ("0", "false", "no"):
            return False
        raise MessageError(ErrorReason.BAD_FIELD, f"{key}: boolean")
    if key in _INT_FIELDS:
        # isascii: str.isdigit() is also true for "²" and other digits int() refuses.
        if not (value.isascii() and value.isdigit()) or len(value) > 9:
            raise MessageError(ErrorReason.BAD_FIELD, f"{key}: integer")
        return int(value)
    return value


def entry_json(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe form of a wire list entry: the info blob as base64, the host key as hex
    (empty when the host gave none), the address as text."""
    out = dict(fields)
    ip, port = out.pop("addr")
    out["address"] = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    out["ip"], out["port"] = ip, port
    out["info"] = base64.b64encode(out["info"]).decode()
    out["key"] = out["key"].hex()
    return out


class HttpServer:
    """asyncio streams server in front of `HttpApi`."""

    def __init__(
        self, api: HttpApi, metrics: Metrics, *, timeout: float, max_connections: int
    ) -> None:
        self._api = api
        self._metrics = metrics
        self._timeout = timeout
        self._slots = asyncio.Semaphore(max_connections)
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._per_source: dict[str, int] = {}
        self._probe_readers: dict[asyncio.Timeout, None] = {}
        """The deadlines of the connections read for a probe, oldest first."""

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "not started"
        sockname = self._server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    async def start(self, host: str, port: int, *, sock: socket.socket | None = None) -> None:
        """Listen on ``host:port``, or accept on ``sock``, a listening socket the
        caller made (shared by every worker of a replica)."""
        if sock is not None:
            self._server = await asyncio.start_server(self._client, sock=sock, limit=MAX_HEAD_BYTES)
            return
        self._server = await asyncio.start_server(
            self._client, host, port, limit=MAX_HEAD_BYTES, reuse_address=True
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await cancel_and_wait(list(self._clients), STOP_WITHIN, "http")
        if self._server is not None:
            await self._server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._clients.add(task)
        peer = writer.get_extra_info("peername")
        source = rate_key(from_sockaddr(tuple(peer)).ip) if peer else ""
        count = self._per_source.get(source, 0)
        self._per_source[source] = count + 1
        done = False
        try:
            if count >= MAX_CONNECTIONS_PER_IP or self._slots.locked():
                # Refused: answered and closed at once, without lingering (a flood of
                # refused connections would otherwise hold a descriptor each); a
                # probe is answered all the same, if it says so within PROBE_READ.
                label, head = "other", False
                if count >= MAX_CONNECTIONS_PER_IP:
                    resp = Response.json(429, {"error": "too_many_connections"})
                else:
                    label, resp, head = await self._probe_or_busy(reader)
                self._metrics.observe_http(label, resp.status)
                await self._respond(writer, resp, head=head)
            else:
                # The slot is held through the linger: outside it, clients from many
                # sources that send a request and never read to the end nor close
                # would hold a descriptor each, up to the process's open-file limit.
                async with self._slots:
                    await self._serve_one(reader, writer)
                    await self._linger(reader, writer)
            done = True
        except (OSError, asyncio.IncompleteReadError):
            # The client went away (reset, or gone before its FIN could be sent: ENOTCONN
            # from write_eof): nothing to answer, and nothing for an operator to mend.
            pass
        except TimeoutError:
            pass  # the client does not read its response
        except Exception:
            log.exception("http_connection_failed")
        finally:
            if task is not None:
                self._clients.discard(task)
            if self._per_source[source] > 1:
                self._per_source[source] -= 1
            else:
                del self._per_source[source]
            if done:
                writer.close()
            else:
                _abort(writer)

    async def _probe_or_busy(self, reader: asyncio.StreamReader) -> tuple[str, Response, bool]:
        """For a connection refused for want of a slot: the probe it asks for, read
        within `PROBE_READ` (at most `MAX_PROBE_READERS` at once), else 503."""
        if len(self._probe_readers) >= MAX_PROBE_READERS:
            # Every reader taken: the one that has waited longest gives way (its read
            # times out now), so a flow of silent connections cannot starve a probe.
            oldest = next(iter(self._probe_readers))
            del self._probe_readers[oldest]
            oldest.reschedule(asyncio.get_running_loop().time())
        try:
            async with asyncio.timeout(PROBE_READ) as deadline:
                self._probe_readers[deadline] = None
                try:
                    method, target = await read_head(reader)
                finally:
                    self._probe_readers.pop(deadline, None)
        except (TimeoutError, BadRequest, asyncio.IncompleteReadError):
            return "other", _BUSY, False
        path = target.partition("?")[0]
        if method in ("GET", "HEAD") and path in PROBES:
            return path, self._api.probe(path), method == "HEAD"
        return "other", _BUSY, False

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Wait (at most ``timeout``) until the client has read the response and closed.

        Whatever the kernel has buffered is not ours to wait on after close():
        for a client that never reads, the socket would stay open (FIN-WAIT-1,
        with the whole response queued) long after this task ends.
        """
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(self._timeout):
            while await reader.read(4096):
                pass  # anything after the request head is ignored

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client_ip = from_sockaddr(tuple(peer)).ip if peer else "0.0.0.0"
        try:
            method, target = await asyncio.wait_for(read_head(reader), self._timeout)
        except TimeoutError:
            self._metrics.observe_http("other", 408)
            await self._respond(writer, Response.json(408, {"error": "timeout"}), head=False)
            return
        except BadRequest as exc:
            self._metrics.observe_http("other", exc.status)
            body = {"error": exc.reason, "detail": exc.detail}
            await self._respond(writer, Response.json(exc.status, body), head=False)
            return
        if method not in ("GET", "HEAD"):
            self._metrics.observe_http("other", 405)
            resp = Response.json(405, {"error": "method_not_allowed"})
            await self._respond(writer, resp, head=False, extra=b"Allow: GET, HEAD\r\n")
            return
        try:
            label, resp = await self._api.route(target, client_ip)
        except Exception:
            log.exception("http_request_failed", target=target[:200])
            label, resp = "other", Response.json(500, {"error": "internal"})
        self._metrics.observe_http(label, resp.status)
        await self._respond(writer, resp, head=method == "HEAD")

    async def _respond(
        self, writer: asyncio.StreamWriter, resp: Response, *, head: bool, extra: bytes = b""
    ) -> None:
        status_line = f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, 'Error')}\r\n"
        headers = (
            f"Content-Type: {resp.content_type}\r\n"
            f"Content-Length: {len(resp.body)}\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n"
        )
        writer.write(status_line.encode() + headers.encode() + extra + b"\r\n")
        if not head:
            writer.write(resp.body)
        await asyncio.wait_for(writer.drain(), self._timeout)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Drop a connection now, with a reset: no waiting on data the client will not read."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_head(reader: asyncio.StreamReader) -> tuple[str, str]:
    """(method, target) of one request; headers are read, bounded, and ignored.

    Raises `BadRequest` for a malformed head, one cut short by the client's end of
    stream included (``IncompleteReadError`` only when it sent nothing at all)."""
    try:
        line = await _read_line(reader)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise BadRequest(400, "incomplete_head") from None
        raise
    request = _request_line(line)
    try:
        await _skip_headers(reader, len(line))
    except asyncio.IncompleteReadError:
        raise BadRequest(400, "incomplete_head") from None
    return request


def _request_line(line: str) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(400, "bad_request_line")
    method, target, _version = parts
    if not target.startswith("/"):
        raise BadRequest(400, "bad_target")
    return method, target


async def _skip_headers(reader: asyncio.StreamReader, used: int) -> None:
    for _ in range(MAX_HEADER_LINES):
        header = await _read_line(reader)
        used += len(header) + 2
        if used > MAX_HEAD_BYTES:
            raise BadRequest(431, "head_too_large")
        if not header:
            return
        if ":" not in header:
            raise BadRequest(400, "bad_header")
    raise BadRequest(431, "too_many_headers")


async def _read_line(reader: asyncio.StreamReader) -> str:
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise BadRequest(431, "line_too_long") from None
    if not raw.endswith(b"\r\n"):
        # A bare LF: refused at once (it was read up to the timeout, waiting for CRLF).
        raise BadRequest(400, "bare_lf")
    try:
        return raw[:-2].decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "not_ascii") from None
