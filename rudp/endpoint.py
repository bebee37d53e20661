"""Many connections on one UDP address: routing, handshake, NOCONN, queries, one timer.

Sans-IO like ``Connection``: ``receive_datagram(data, addr, now)`` in,
``datagrams_to_send(now)`` and ``next_event()`` out, ``get_timer()`` /
``handle_timer(now)`` for time.

Handshake (stateless until the client proves its address, like QUIC's Retry; the
Noise handshake of ``rudp.handshake`` rides in the last two messages)::

    client                                   server
    CONNECT(salt, pattern, no cookie, msg1, padded) ->
                                          <- CHALLENGE(salt, cookie)      no state, no DH
    CONNECT(salt, pattern, cookie, msg1, padded)    ->                    cookie checked
                                          <- ACCEPT(salt, msg2)           connection made

The client's side is ``rudp.opening``; the server's is ``rudp.accepting``
(``receive_connect``), and the checks before any work is spent on a handshake
(cookies, their replay cache, reset tokens, rates) are ``rudp.admission``. Only
after a valid, unused cookie does the server spend a Diffie-Hellman on the
client's message (``handshake.answer``); a message that is
not genuine is dropped as ``bad_handshake`` and answered with a short REJECT
that names the likely cause (the client expects another server key).

Connect tokens: a server with ``Config.token_issuers`` reads the client's Noise
message after the cookie checks (``handshake.read_first``) and verifies the token
its payload carries (``rudp.tokens``) before it makes a connection; a refusal is a
REJECT naming the reason, counted in ``stats.tokens_refused``. The verified
identity becomes the connection's ``peer_identity``. Expiry is in UNIX time: the
``wall_clock`` callable, when set (the asyncio layer gives ``time.time``), is read
once per token checked, so a stepped system clock counts at once; without it,
``wall_offset`` turns ``now`` into UNIX time.

Routing: connections are indexed by address (handshake packets) and by the
connection id each side chose for the packets it receives (DATA). A DATA that
does not authenticate is dropped as ``auth_failed`` and changes nothing. A DATA
for a known id from another address goes to the connection's
``_receive_moved``: if it authenticates and is the newest packet, the connection
validates the new address and moves there once it answered (``rudp.migration``);
the address index follows (``_moved``). The challenges go to the new address,
never more bytes than authenticated packets brought from it, and are counted as
unvalidated bytes.

Amplification and reflection: the client pads CONNECT to its datagram size and
the server ignores a CONNECT shorter than ``wire.MIN_CONNECT_SIZE``; every reply
to an address we have no connection with (CHALLENGE, REJECT, NOCONN,
QUERY_REPLY) is no larger than the datagram that caused it, and no received
packet makes a connecting client send a CONNECT: they go out on the retry timer
only, so a spoofer cannot turn a client into a reflector.
``stats.unvalidated_bytes_*`` count both directions so tests can check it.

NOCONN: a DATA for a connection id we do not know gets NOCONN(dcid, token),
rate-limited by a token bucket; the token (``admission.ResetTokens``) is the
one we gave the peer in the handshake, so only we can end its connection, and
a server that restarts with its static key still can (see docs/security.md).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Final

from rudp import wire
from rudp.accepting import receive_connect, refuse_v1
from rudp.admission import CookieJar, ResetTokens, SourceLimits, TokenBucket, source_of
from rudp.config import Config
from rudp.connection import Address, Connection
from rudp.errors import LocalProtocolError, MessageTooLarge, as_bytes, check_now
from rudp.events import EndpointEvent, Event, QueryReceived
from rudp.noise import private_key, public_bytes
from rudp.opening import receive_accept, receive_challenge, receive_reject
from rudp.queries import Queries
from rudp.sink import EndpointSink
from rudp.state import CLOSING, DRAINING
from rudp.stats import EndpointStats
from rudp.tokens import MAX_TOKEN_SIZE, TokenVerifier
from rudp.wire import DecodeError, DropReason, PacketType

_DATA_BYTE: Final = wire.DATA_BYTE
_DATA_MIN: Final = wire.DATA_HEADER_SIZE


class Endpoint:
    """All connections of one socket; ``accept=True`` makes it a server."""

    def __init__(
        self, config: Config, *, now: float, rng: random.Random, accept: bool = False
    ) -> None:
        self.config = config
        self.accept = accept
        self.refusing = False  # closing: new handshakes get REJECT "server closing"
        self.stats = EndpointStats()
        self._rng = rng
        self._conns: dict[Address, Connection] = {}
        self._by_cid: dict[int, Connection] = {}  # DATA routing: our connection ids
        # The one object every connection reports to (events, flushes, closure).
        self._sink = EndpointSink(self._forget)
        self._events = self._sink.events
        self._out: list[tuple[bytes, Address]] = []
        # Timers: ``_heap`` holds each deadline once (plain floats), ``_at`` the ids of
        # the connections armed at it, in the order they were armed (so a seeded run
        # replays). Connections that took a packet in one read share its ``now``, and
        # so their deadlines: at 60 Hz a server's hundreds of acknowledgment timers
        # are a few heap entries, and the heap compares floats, not tuples.
        # ``_armed`` holds each connection's earliest deadline, so that entries it
        # replaced are skipped. An entry names its connection by id, not by
        # reference: an ended connection leaves ``_armed`` and ``_by_cid`` at once,
        # so the entries it left hold nothing of it (holding it, they kept it in
        # memory until the next ``_prune``, long enough to be promoted and traversed
        # by the collector); they go when they reach the top or at the next ``_prune``.
        self._heap: list[float] = []
        self._at: dict[float, list[int]] = {}
        self._entries = 0  # ids in ``_at``, stale ones included
        self._armed: dict[Connection, float] = {}
        self._cookies = CookieJar(config.cookie_lifetime, rng)
        self._static = None if config.static_key is None else private_key(config.static_key)
        self._reset_tokens = ResetTokens(config.static_key, rng)
        self._noconn = TokenBucket(config.noconn_rate, config.noconn_burst, now)
        self._sources = SourceLimits(
            config.max_connections_per_source,
            config.handshake_rate_per_source,
            config.handshake_burst_per_source,
            config.source_limit_keys,
        )
        self._queries = Queries(config.base_datagram_size)
        # Connect tokens (``rudp.tokens``): required when the config names issuers.
        self._tokens = (
            TokenVerifier(config.token_issuers, public_bytes(self._static), config.token_addresses)
            if config.token_issuers and self._static is not None
            else None
        )
        self.wall_offset = 0.0
        """UNIX time minus ``now``, used when ``wall_clock`` is None: tokens expire in
        wall-clock time, while the core's clock may be any monotonic one."""
        self.wall_clock: Callable[[], float] | None = None
        """The current UNIX time, read once per token checked (the asyncio layer sets
        it to ``time.time``): an offset taken once would keep a stepped clock's error
        for the life of the process."""

    # -- public API ------------------------------------------------------------

    def __repr__(self) -> str:
        role = "accepting" if self.accept else "connecting out"
        return f"<rudp.endpoint.Endpoint {role}, {len(self._conns)} connections>"

    @property
    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def connection(self, address: Address) -> Connection | None:
        return self._conns.get(address)

    def datagram_refused(self, address: Address, size: int, now: float) -> None:
        """The local interface refused to send a datagram of ``size`` bytes to
        ``address`` as too large (EMSGSIZE): its connection learns it (a lost path
        MTU probe, or a path that no longer carries its datagrams)."""
        conn = self._conns.get(address)
        if conn is not None:
            conn._datagram_refused(size, now)

    @property
    def public_key(self) -> bytes | None:
        """Our static public key (what clients pass as ``server_key``), if we have one."""
        return None if self._static is None else public_bytes(self._static)

    def connect(
        self,
        address: Address,
        now: float,
        *,
        server_key: bytes | None = None,
        token: bytes | None = None,
        token_key: bytes | None = None,
    ) -> Connection:
        """Start a handshake to ``address``; the connection reports ``Connected``.

        ``server_key`` (default ``Config.server_key``) is the public key the peer must
        prove it holds (Noise NK); without one the handshake is NN: sealed, but the
        peer is not authenticated. ``token`` is a connect token for a server that
        requires one, and ``token_key`` the X25519 private key it was issued for,
        which the handshake then uses as this side's ephemeral key.
        """
        self._check_token(token, token_key)
        existing = self._conns.get(address)
        if existing is not None and existing.state is DRAINING:
            # Ended, lingering only to acknowledge a resent DISCONNECT: a reconnect right
            # after the end takes its place. The peer's close then ends by our NOCONN
            # (when it holds our reset token), or by the new handshake from this
            # address, as a restart (reason "peer has no connection"), or by its timer.
            existing.abort()
            existing = self._conns.get(address)
        if existing is not None:
            if existing.state is CLOSING:
                raise LocalProtocolError(
                    f"the connection to {address!r} is still closing: wait for its end "
                    "(wait_closed()) before connecting again"
                )
            if existing.client:
                raise LocalProtocolError(f"already connected or connecting to {address!r}")
            raise LocalProtocolError(
                f"{address!r} already connected to us (its connection was accepted, and "
                "goes to the serve handler): use that one"
            )
        key = self.config.server_key if server_key is None else server_key
        conn = self._new_connection(
            address,
            now,
            client=True,
            salt=self._rng.getrandbits(64),
            server_key=key,
            token=token or b"",
            token_key=token_key,
        )
        self._sink.dirty[conn] = None
        self._schedule(conn)
        return conn

    def _check_token(self, token: bytes | None, token_key: bytes | None) -> None:
        if (token is None) != (token_key is None):
            raise LocalProtocolError("a connect token needs the key it was issued for: give both")
        if token_key is not None and len(token_key) != 32:
            raise LocalProtocolError("token_key is the 32-byte X25519 private key of the token")
        room = self.config.max_datagram_size - wire.MIN_CONNECT_SIZE
        if token is not None and len(token) > min(MAX_TOKEN_SIZE, room):
            raise MessageTooLarge(
                f"a connect token of {len(token)} bytes does not fit a CONNECT of "
                f"{self.config.max_datagram_size} bytes (max_datagram_size)"
            )

    @property
    def has_events(self) -> bool:
        """Whether ``next_event`` has something to return."""
        return bool(self._events)

    def next_event(self) -> tuple[Connection | None, Event | EndpointEvent] | None:
        """The next event, with the connection it belongs to (None for endpoint events)."""
        return self._events.popleft() if self._events else None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        out, self._out = self._out, []
        if self._sink.dirty:
            # In the order the connections asked to be flushed: a seeded run replays.
            for conn in self._sink.take_dirty():
                address = conn.address
                for datagram in conn.datagrams_to_send(now):
                    out.append((datagram, address))
                if conn.path_out:  # path challenges, each to the address it validates
                    for item in conn.take_path_datagrams():
                        self.stats.unvalidated_bytes_sent += len(item[0])
                        out.append(item)
                self._schedule(conn)
        if out:
            size = 0
            for datagram, _ in out:
                size += len(datagram)
            stats = self.stats
            stats.datagrams_sent += len(out)
            stats.bytes_sent += size
        return out

    def get_timer(self) -> float | None:
        heap = self._heap
        at = self._at
        armed = self._armed
        by_cid = self._by_cid
        while heap:
            deadline = heap[0]
            cids = at[deadline]
            for i, cid in enumerate(cids):
                conn = by_cid.get(cid)
                if conn is not None and armed.get(conn) == deadline:
                    if i:
                        del cids[:i]  # the stale ones before it
                        self._entries -= i
                    return deadline
            heapq.heappop(heap)
            del at[deadline]
            self._entries -= len(cids)
        return None

    def handle_timer(self, now: float) -> None:
        heap = self._heap
        at = self._at
        armed = self._armed
        by_cid = self._by_cid
        due: list[Connection] = []
        while heap and heap[0] <= now:
            deadline = heapq.heappop(heap)
            cids = at.pop(deadline)
            self._entries -= len(cids)
            for cid in cids:
                conn = by_cid.get(cid)
                if conn is not None and armed.get(conn) == deadline:
                    del armed[conn]
                    due.append(conn)
        # Each due connection runs once per call, so a deadline that stays in the
        # past until the next flush can never spin this loop. One whose deadline
        # moved later since it was armed (``_schedule``) is only armed again.
        for conn in due:
            t = conn.get_timer()
            if t is None or t <= now:
                conn.handle_timer(now)
            self._schedule(conn)

    def close(self, now: float) -> None:
        """Start a graceful close of every connection; new ones are refused from now on
        (REJECT "server closing")."""
        if type(now) is not float:
            now = check_now(now)
        self.refusing = True
        for conn in list(self._conns.values()):
            conn.close(now)
            self._schedule(conn)

    def abort(self) -> None:
        """End every connection at once, telling no one."""
        for conn in list(self._conns.values()):
            conn.abort()

    def query(
        self,
        address: Address,
        payload: bytes | bytearray | memoryview,
        now: float,
        *,
        reply_room: int | None = None,
    ) -> int:
        """Send an unconnected QUERY; the answer comes as ``QueryAnswered``.

        The request is padded so the reply may carry ``reply_room`` bytes
        (default: as much as one datagram holds).
        """
        payload = as_bytes(payload, "a query payload")  # before anything changes
        nonce = self._rng.getrandbits(32)
        self._out.append((self._queries.request(address, nonce, payload, now, reply_room), address))
        return nonce

    def cancel_query(self, nonce: int) -> None:
        self._queries.cancel(nonce)

    def reply_query(self, event: QueryReceived, payload: bytes | bytearray | memoryview) -> None:
        """Answer a ``QueryReceived``; the reply may not exceed ``event.max_reply``."""
        self._send_unvalidated(Queries.reply(event, payload), event.address)

    @property
    def max_query_payload(self) -> int:
        return self._queries.max_payload

    # -- receive -----------------------------------------------------------------

    def receive_datagram(self, data: bytes, address: Address, now: float) -> Connection | None:
        """Process one datagram; returns the connection it concerned, if any.

        Never raises for anything the peer sent: bad input is dropped and counted.
        """
        stats = self.stats
        stats.datagrams_received += 1
        stats.bytes_received += len(data)
        if data and data[0] == _DATA_BYTE and len(data) >= _DATA_MIN:
            return self._receive_data(data, address, now)
        conn = self._conns.get(address)
        if conn is None:
            stats.unvalidated_bytes_received += len(data)
        try:
            ptype = wire.decode_type(data)
            self._receive_other(ptype, conn, data, address, now)
        except DecodeError as exc:
            stats.dropped[exc.reason] += 1
            if conn is not None:
                conn.stats.packets_dropped += 1
            elif exc.reason is DropReason.WRONG_VERSION and self.accept:
                refuse_v1(self, data, address)
        return conn

    def _receive_data(self, data: bytes, address: Address, now: float) -> Connection | None:
        dcid, pn32 = wire.decode_data_prefix(data)
        conn = self._by_cid.get(dcid)
        stats = self.stats
        if conn is None:
            stats.unvalidated_bytes_received += len(data)
            stats.dropped[DropReason.UNKNOWN_PEER] += 1
            self._send_noconn(dcid, address, now)
            return None
        if conn.address != address:
            # Not the connection's path: never answered but by a path challenge no
            # larger than what authenticated from there (``rudp.migration``).
            stats.unvalidated_bytes_received += len(data)
            return self._receive_moved(conn, data, pn32, address, now)
        try:
            reason = conn._receive_sealed(data, pn32, now)
        except DecodeError as exc:  # authenticated, yet malformed: the peer's bug
            reason = exc.reason
        if reason is not None:
            stats.dropped[reason] += 1
            conn.stats.packets_dropped += 1
        self._schedule(conn)
        return conn

    def _receive_moved(
        self, conn: Connection, data: bytes, pn32: int, address: Address, now: float
    ) -> Connection:
        old = conn.address
        try:
            reason = conn._receive_moved(
                data, pn32, address, now, movable=self._movable(conn, address)
            )
        except DecodeError as exc:  # authenticated, yet malformed: the peer's bug
            reason = exc.reason
        if reason is not None:
            self.stats.dropped[reason] += 1
            conn.stats.packets_dropped += 1
        if conn.address != old:
            self._moved(conn, old)
        self._schedule(conn)
        return conn

    def _movable(self, conn: Connection, address: Address) -> bool:
        """Whether ``conn`` may move to ``address``: no other connection has it, and
        its source may hold one more connection (``max_connections_per_source``),
        unless it is the source ``conn`` already counts against (a new port)."""
        if address in self._conns:
            return False
        return self._sources.may_hold(address) or source_of(address) == source_of(conn.address)

    def _moved(self, conn: Connection, old: Address) -> None:
        """``conn`` migrated from ``old``: the address index follows it."""
        if self._conns.get(old) is conn:
            del self._conns[old]
            self._sources.closed(old)
        if conn.address not in self._conns:
            self._sources.opened(conn.address)  # per-source counts follow it too
        self._conns[conn.address] = conn

    def _receive_other(
        self, ptype: PacketType, conn: Connection | None, data: bytes, address: Address, now: float
    ) -> None:
        reason: DropReason | None
        if ptype == PacketType.CONNECT:
            reason = receive_connect(self, conn, data, address, now)
        elif ptype == PacketType.QUERY:
            self._events.append((None, Queries.received(data, address)))
            reason = None
        elif ptype == PacketType.QUERY_REPLY:
            answered = self._queries.answered(data, address, now)
            if isinstance(answered, DropReason):
                reason = answered
            else:
                self._events.append((None, answered))
                reason = None
        elif ptype == PacketType.DATA:
            reason = DropReason.TRUNCATED  # shorter than any sealed packet (decode_type)
        elif conn is None:
            reason = DropReason.UNKNOWN_PEER
        elif ptype == PacketType.CHALLENGE:
            reason = receive_challenge(conn, wire.decode_challenge(data))
        elif ptype == PacketType.ACCEPT:
            reason = receive_accept(conn, wire.decode_accept(data), now)
        elif ptype == PacketType.REJECT:
            reason = receive_reject(conn, wire.decode_reject(data))
        else:  # NOCONN
            reason = conn._receive_noconn(wire.decode_noconn(data))
        if reason is not None:
            self.stats.dropped[reason] += 1
        if conn is not None:
            self._schedule(conn)

    def _new_connection(
        self,
        address: Address,
        now: float,
        *,
        client: bool,
        salt: int,
        server_key: bytes | None = None,
        token: bytes = b"",
        token_key: bytes | None = None,
    ) -> Connection:
        cid = self._new_cid()
        conn = Connection(
            config=self.config,
            address=address,
            now=now,
            rng=self._rng,
            client=client,
            salt=salt,
            sink=self._sink,
            cid=cid,
            reset_token=self._reset_tokens.token(cid, address),
            server_key=server_key,
            token=token,
            token_key=token_key,
        )
        self._by_cid[cid] = conn
        if address not in self._conns:
            self._conns[address] = conn
            self._sources.opened(address)
        return conn

    def _new_cid(self) -> int:
        """A random nonzero connection id no connection of ours uses."""
        while True:
            cid = self._rng.getrandbits(32)
            if cid and cid not in self._by_cid:
                return cid

    def _forget(self, conn: Connection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
            self._sources.closed(conn.address)
        if self._by_cid.get(conn.cid) is conn:
            del self._by_cid[conn.cid]
        self.stats.absorb(conn.stats)
        self._armed.pop(conn, None)
        if self._entries > 2 * len(self._armed) + 64:
            self._prune()

    def _prune(self) -> None:
        """Drop the timer entries no connection is armed at (in place: callers hold
        the heap and the table)."""
        armed = self._armed
        by_cid = self._by_cid
        live: dict[float, list[int]] = {}
        for deadline, cids in self._at.items():
            kept = [
                cid
                for cid in cids
                if (c := by_cid.get(cid)) is not None and armed.get(c) == deadline
            ]
            if kept:
                live[deadline] = kept
        self._at.clear()
        self._at.update(live)
        self._entries = sum(len(cids) for cids in live.values())
        self._heap[:] = list(live)
        heapq.heapify(self._heap)

    def _schedule(self, conn: Connection) -> None:
        """Keep one heap entry per connection at its earliest deadline.

        An entry is only pushed when the deadline moves earlier, so the heap never
        fills with stale entries on the per-datagram path (a deadline moves later
        with nearly every packet: the idle timeout's, say). One left too early is
        checked against the connection's deadline when it falls due
        (``handle_timer``) and armed again there: the connection is not woken
        for nothing (at 60 Hz that was one wake-up every other tick per
        connection, for an acknowledgment that had left with data).
        """
        t = conn.get_timer()
        if t is not None:
            armed = self._armed.get(conn)
            if armed is None or t < armed:
                self._armed[conn] = t
                self._entries += 1
                cids = self._at.get(t)
                if cids is None:
                    self._at[t] = [conn.cid]
                    heapq.heappush(self._heap, t)
                else:
                    cids.append(conn.cid)

    def _send_unvalidated(self, datagram: bytes, address: Address) -> None:
        self.stats.unvalidated_bytes_sent += len(datagram)
        self._out.append((datagram, address))

    def _send_noconn(self, dcid: int, address: Address, now: float) -> None:
        if self._noconn.take(now):
            self._send_unvalidated(
                wire.encode_noconn(dcid, self._reset_tokens.token(dcid, address)), address
            )
        else:
            self.stats.noconn_suppressed += 1
