"""GETSVINFO/SVINFO between game clients and game hosts, without the matchmaker.

Theory of operation
-------------------
A server browser lists hosts through the matchmaker, then asks every host
directly for its current state and measures the ping, as the seed article's
GETSVINFO/SVINFO exchange does.  Both run over rudp *unconnected queries*, so
no handshake and no connection state on the host:

- A game host embeds `InfoResponder` as its rudp server's ``on_query``
  (`serve_info`).  A `ServerQuery` gets a `ServerInfo` with the host's public
  info (never its LAN address).  rudp only sends a reply that is no larger
  than the request, and queriers pad their requests, so the responder can
  never be used to amplify traffic towards a spoofed address.  The query
  says how much room it padded for; a reply that would not fit leaves out the
  opaque ``info`` blob, and one that still would not fit is not sent.
  Anything else is handed to the handler that was there before (or dropped).
- A game client calls `query_servers(endpoint, addresses)`: all queries in
  flight at once (at most ``concurrency``), each with its own timeout; the
  result keeps the input order and reports the round-trip time rudp measured,
  or why there is no answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import rudp
from matchmaker.addresses import Address, make_address
from matchmaker.messages import (
    DEFAULT_LIMITS,
    HostInfo,
    Limits,
    MessageError,
    ServerInfo,
    ServerQuery,
    WrongVersion,
    WrongVersionError,
    decode,
    encode,
)
from rudp.errors import check_address, check_sequence

log = logging.getLogger(__name__)

QueryHandler = Callable[[bytes, Any], "bytes | bytearray | memoryview | None"]
InfoSource = Callable[[], HostInfo | None]


class InfoResponder:
    """``on_query`` handler answering `ServerQuery` with the host's `ServerInfo`.

    `info` returns what to publish, or None to stay silent (not hosting now);
    ``MatchmakerClient.host_info`` is a natural source.
    """

    def __init__(
        self,
        info: InfoSource,
        *,
        fallback: QueryHandler | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._info = info
        self._fallback = fallback
        self._limits = limits
        self.answered = 0
        """Queries answered."""

    def __repr__(self) -> str:
        return f"<InfoResponder answered={self.answered}>"

    def __call__(self, payload: bytes, address: Any) -> bytes | bytearray | memoryview | None:
        try:
            query = decode(payload, self._limits)
        except WrongVersionError as exc:
            return encode(WrongVersion(request_id=exc.request_id))
        except MessageError:
            return self._fallback(payload, address) if self._fallback else None
        if not isinstance(query, ServerQuery):
            return self._fallback(payload, address) if self._fallback else None
        host = self._info()
        if host is None:
            return None
        public = ServerInfo(request_id=query.request_id, host=_public(host))
        reply = encode(public)
        if len(reply) > query.room and host.info:
            # Too big for the querier's padding: the opaque blob is what gives.
            no_blob = ServerInfo(request_id=query.request_id, host=_public(host, blob=False))
            reply = encode(no_blob)
        if len(reply) > query.room:
            return None
        self.answered += 1
        return reply


def _public(host: HostInfo, *, blob: bool = True) -> HostInfo:
    return replace(host, lan=None, info=host.info if blob else b"")


def serve_info(server: rudp.Server, info: InfoSource | HostInfo) -> InfoResponder:
    """Answer server-browser queries on `server` (a game host's rudp socket).

    Queries the host already answered (e.g. its own ``on_query``) keep working:
    whatever is not a `ServerQuery` goes to the previous handler.
    """
    source: InfoSource = (lambda: info) if isinstance(info, HostInfo) else info
    responder = InfoResponder(source, fallback=server.on_query)
    server.on_query = responder
    return responder


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """One host's answer to `query_servers`."""

    address: Address
    info: HostInfo | None = None
    """The host's info, None without an answer."""
    ping: float | None = None
    """Round-trip time in seconds (rudp's measurement), None without an answer."""
    error: str | None = None
    """Why there is no answer: ``timeout``, ``wrong_version``, ``bad_reply`` or a socket error."""


async def query_server(
    endpoint: rudp.Server,
    address: Address | tuple[str, int],
    *,
    timeout: float = 1.0,
    limits: Limits = DEFAULT_LIMITS,
) -> ServerStatus:
    """Ask one host for its info and measure the ping (never raises for the host's sake)."""
    check_address(address, "address")
    target = make_address(*address)
    room = endpoint.endpoint.core.max_query_payload
    payload = encode(ServerQuery(room=room))
    try:
        reply, rtt = await endpoint.query((target.ip, target.port), payload, timeout)
    except TimeoutError:
        return ServerStatus(target, error="timeout")
    except (OSError, rudp.RudpError) as exc:
        return ServerStatus(target, error=type(exc).__name__)
    try:
        msg = decode(reply, limits)
    except MessageError as exc:
        log.debug("bad_server_info host=%s reason=%s detail=%r", target.key, exc.reason, exc.detail)
        return ServerStatus(target, error="bad_reply")
    if isinstance(msg, WrongVersion):
        return ServerStatus(target, ping=rtt, error="wrong_version")
    if not isinstance(msg, ServerInfo):
        return ServerStatus(target, ping=rtt, error="bad_reply")
    return ServerStatus(target, info=msg.host, ping=rtt)


async def query_servers(
    endpoint: rudp.Server,
    addresses: Iterable[Address | tuple[str, int]],
    *,
    timeout: float = 1.0,
    concurrency: int = 64,
    limits: Limits = DEFAULT_LIMITS,
) -> list[ServerStatus]:
    """`query_server` for many hosts at once, at most `concurrency` in flight; one
    status per address given, in input order. An address given several times is
    queried once (its status repeated): a list naming one address many times, from
    a faulty or hostile matchmaker, must not make this client send it a query per
    copy."""
    check_sequence(addresses, "addresses")
    addresses = list(addresses)
    for address in addresses:
        check_address(address, "each of addresses")  # before any query goes out
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    targets = [make_address(*a) for a in addresses]
    gate = asyncio.Semaphore(concurrency)

    async def one(target: Address) -> ServerStatus:
        async with gate:
            return await query_server(endpoint, target, timeout=timeout, limits=limits)

    distinct = list(dict.fromkeys(targets))
    statuses = await asyncio.gather(*(one(t) for t in distinct))
    found = dict(zip(distinct, statuses, strict=True))
    return [found[t] for t in targets]
