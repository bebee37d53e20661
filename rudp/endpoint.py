"""Many connections on one UDP address: routing, handshake, NOCONN, queries, one timer.

Sans-IO like ``Connection``: ``receive_datagram(data, addr, now)`` in,
``datagrams_to_send(now)`` and ``next_event()`` out, ``get_timer()`` /
``handle_timer(now)`` for time.

Handshake (stateless until the client proves its address, like QUIC's Retry)::

    client                                   server
    CONNECT(salt, isn, no cookie, padded) ->
                                          <- CHALLENGE(salt, cookie)      no state kept
    CONNECT(salt, isn, cookie, padded)    ->                              cookie checked
                                          <- ACCEPT(salt, token, isn)     connection made

The cookie is ``slot || HMAC-SHA256(key(slot), host, port, salt)[:16]`` where
``slot = floor(now / cookie_lifetime)`` and ``key(slot)`` is derived from a
random master secret, so the secret rotates every period with no state and the
previous period's cookies are still accepted. A cookie is used once: a replay
cache (bounded, expiring with the cookies) refuses a second connection from it.

Amplification: the client pads CONNECT to its datagram size and the server
ignores a CONNECT shorter than ``wire.MIN_CONNECT_SIZE``; every reply to an
address we have no connection with (CHALLENGE, REJECT, NOCONN, QUERY_REPLY) is
no larger than the datagram that caused it. ``stats.unvalidated_bytes_*``
count both directions so tests can check it.

NOCONN: a DATA packet carrying frames from an address or token we don't know
gets NOCONN(token, seq) echoing its header, rate-limited by a token bucket; the
peer believes it only if it echoes a packet the peer really sent.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import random
import struct
from collections import OrderedDict
from typing import Final

from rudp import wire
from rudp.config import Config
from rudp.connection import CONNECTED, CONNECTING, Address, Connection
from rudp.errors import LocalProtocolError, MessageTooLarge
from rudp.events import DisconnectReason, EndpointEvent, Event, QueryAnswered, QueryReceived
from rudp.sink import EndpointSink
from rudp.stats import EndpointStats
from rudp.wire import DecodeError, DropReason, PacketType

COOKIE_MAC: Final = 16
_DATA: Final = PacketType.DATA  # decode_type returns the members themselves
_SLOT: Final = struct.Struct("!I")
REPLAY_CACHE_LIMIT: Final = 65536
QUERY_LIMIT: Final = 4096  # our own queries awaiting an answer


class TokenBucket:
    """Classic token bucket on an injected clock."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Endpoint:
    """All connections of one socket; ``accept=True`` makes it a server."""

    def __init__(
        self, config: Config, *, now: float, rng: random.Random, accept: bool = False
    ) -> None:
        self.config = config
        self.accept = accept
        self.stats = EndpointStats()
        self._rng = rng
        self._conns: dict[Address, Connection] = {}
        # The one object every connection reports to (events, flushes, closure).
        self._sink = EndpointSink(self._forget)
        self._events = self._sink.events
        self._out: list[tuple[bytes, Address]] = []
        # Timer entries (deadline, tiebreak, connection); ``_armed`` holds each
        # connection's earliest entry, so that entries it replaced are skipped.
        self._heap: list[tuple[float, int, Connection]] = []
        self._armed: dict[Connection, float] = {}
        self._ids = itertools.count()
        self._master = rng.randbytes(32)
        self._keys: dict[int, bytes] = {}
        self._used: OrderedDict[tuple[Address, int], float] = OrderedDict()
        self._noconn = TokenBucket(config.noconn_rate, config.noconn_burst, now)
        self._queries: dict[int, tuple[Address, float]] = {}

    # -- public API ------------------------------------------------------------

    @property
    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def connection(self, address: Address) -> Connection | None:
        return self._conns.get(address)

    def connect(self, address: Address, now: float) -> Connection:
        """Start a handshake to ``address``; the connection reports ``Connected``."""
        existing = self._conns.get(address)
        if existing is not None:
            if existing.client:
                raise LocalProtocolError(f"already connected or connecting to {address!r}")
            raise LocalProtocolError(
                f"{address!r} already connected to us (its connection was accepted, and "
                "goes to the serve handler): use that one"
            )
        conn = self._new_connection(address, now, client=True, salt=self._rng.getrandbits(64))
        self._sink.dirty[conn] = None
        self._schedule(conn)
        return conn

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
        armed = self._armed
        while heap and armed.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def handle_timer(self, now: float) -> None:
        heap = self._heap
        armed = self._armed
        due: list[Connection] = []
        while heap and heap[0][0] <= now:
            deadline, _, conn = heapq.heappop(heap)
            if armed.get(conn) == deadline:
                del armed[conn]
                due.append(conn)
        # Each due connection runs once per call, so a deadline that stays in the
        # past until the next flush can never spin this loop.
        for conn in due:
            conn.handle_timer(now)
            self._schedule(conn)

    def close(self, now: float) -> None:
        """Start a graceful close of every connection."""
        for conn in list(self._conns.values()):
            conn.close(now)
            self._schedule(conn)

    def abort(self) -> None:
        """End every connection at once, telling no one."""
        for conn in list(self._conns.values()):
            conn.abort()

    def query(
        self, address: Address, payload: bytes, now: float, *, reply_room: int | None = None
    ) -> int:
        """Send an unconnected QUERY; the answer comes as ``QueryAnswered``.

        The request is padded so the reply may carry ``reply_room`` bytes
        (default: as much as one datagram holds).
        """
        room = self.max_query_payload if reply_room is None else reply_room
        if len(payload) > self.max_query_payload or not 0 <= room <= self.max_query_payload:
            raise MessageTooLarge(
                f"query payload and reply room must be <= {self.max_query_payload}"
            )
        if len(self._queries) >= QUERY_LIMIT:
            oldest = next(iter(self._queries))
            del self._queries[oldest]
        nonce = self._rng.getrandbits(32)
        self._queries[nonce] = (address, now)
        pad_to = wire.HEADER_SIZE + wire.QUERY_BODY.size + max(room, len(payload))
        self._out.append((wire.encode_query(PacketType.QUERY, nonce, payload, pad_to), address))
        return nonce

    def cancel_query(self, nonce: int) -> None:
        self._queries.pop(nonce, None)

    def reply_query(self, event: QueryReceived, payload: bytes) -> None:
        """Answer a ``QueryReceived``; the reply may not exceed ``event.max_reply``."""
        if len(payload) > event.max_reply:
            raise MessageTooLarge(
                f"query reply of {len(payload)} bytes exceeds the {event.max_reply}"
                " bytes the request allows"
            )
        datagram = wire.encode_query(PacketType.QUERY_REPLY, event.nonce, payload)
        self._send_unvalidated(datagram, event.address)

    @property
    def max_query_payload(self) -> int:
        return self.config.max_datagram_size - wire.HEADER_SIZE - wire.QUERY_BODY.size

    # -- receive -----------------------------------------------------------------

    def receive_datagram(self, data: bytes, address: Address, now: float) -> Connection | None:
        """Process one datagram; returns the connection it concerned, if any.

        Never raises for anything the peer sent: bad input is dropped and counted.
        """
        stats = self.stats
        stats.datagrams_received += 1
        stats.bytes_received += len(data)
        conn = self._conns.get(address)
        if conn is None:
            stats.unvalidated_bytes_received += len(data)
        try:
            ptype = wire.decode_type(data)
            if ptype is _DATA:
                return self._receive_data(conn, data, address, now)
            self._receive_other(ptype, conn, data, address, now)
        except DecodeError as exc:
            stats.dropped[exc.reason] += 1
            if conn is not None:
                conn.stats.packets_dropped += 1
        return conn

    def _receive_data(
        self, conn: Connection | None, data: bytes, address: Address, now: float
    ) -> Connection | None:
        token, seq, ack, bits = wire.decode_data_header(data)
        if conn is not None and conn.state is CONNECTING:
            # DATA before our ACCEPT (lost, or overtaken). A NOCONN here would end the
            # server's brand-new connection; instead repeat the CONNECT now.
            self.stats.dropped[DropReason.UNEXPECTED] += 1
            conn._nudge_connect()
            return conn
        if conn is None or token != conn.token:
            self.stats.dropped[
                DropReason.UNKNOWN_PEER if conn is None else DropReason.BAD_TOKEN
            ] += 1
            if len(data) > wire.DATA_HEADER_SIZE:  # it carries frames: tell the sender
                self._send_noconn(token, seq, address, now)
            return conn
        reason = conn._receive_data(data, seq, ack, bits, now)
        if reason is not None:
            self.stats.dropped[reason] += 1
            conn.stats.packets_dropped += 1

        self._schedule(conn)
        return conn

    def _receive_other(
        self, ptype: PacketType, conn: Connection | None, data: bytes, address: Address, now: float
    ) -> None:
        reason: DropReason | None
        if ptype == PacketType.CONNECT:
            reason = self._receive_connect(conn, data, address, now)
        elif ptype == PacketType.QUERY:
            reason = self._receive_query(data, address)
        elif ptype == PacketType.QUERY_REPLY:
            reason = self._receive_query_reply(data, address, now)
        elif conn is None:
            reason = DropReason.UNKNOWN_PEER
        elif ptype == PacketType.CHALLENGE:
            reason = conn._receive_challenge(wire.decode_challenge(data))
        elif ptype == PacketType.ACCEPT:
            reason = conn._receive_accept(wire.decode_accept(data), now)
        elif ptype == PacketType.REJECT:
            reason = conn._receive_reject(wire.decode_reject(data))
        else:  # NOCONN
            noconn = wire.decode_noconn(data)
            reason = (
                DropReason.BAD_TOKEN if noconn.token != conn.token else conn._receive_noconn(noconn)
            )
        if reason is not None:
            self.stats.dropped[reason] += 1
        if conn is not None:
            self._schedule(conn)

    def _receive_connect(
        self, conn: Connection | None, data: bytes, address: Address, now: float
    ) -> DropReason | None:
        # A CONNECT from the very peer we are connecting to is a simultaneous open (two
        # peers introduced to each other both connect): answered even by an endpoint
        # that accepts no one else, and so are its duplicates once it was answered.
        answered = conn is not None and bool(conn._accept_datagram)
        opening = conn is not None and conn.state is CONNECTING and not answered
        if not self.accept and not opening and not answered:
            return DropReason.UNEXPECTED
        if len(data) < wire.MIN_CONNECT_SIZE:
            return DropReason.MALFORMED
        request = wire.decode_connect(data)
        if answered and conn is not None and conn.salt == request.salt:
            if conn.state is CONNECTED:
                self._out.append((conn._accept_datagram, address))  # our ACCEPT was lost
                return None
            return DropReason.DUPLICATE
        if (
            conn is not None
            and conn.client
            and not opening
            and request.isn == conn.peer_isn
            and request.salt < conn.salt
        ):
            # The losing handshake of a simultaneous open we won, late or duplicated:
            # its CONNECTs carry the very sequence number the peer's ACCEPT gave us. (A
            # restarted peer picks a new one; a 2^-17 clash costs it one connect().)
            return DropReason.DUPLICATE
        if not self.accept and not opening:
            return DropReason.UNEXPECTED  # a new handshake: not ours to accept
        if not request.cookie:
            self._send_unvalidated(
                wire.encode_challenge(request.salt, self._cookie(address, request.salt, now)),
                address,
            )
            return None
        if not self._cookie_valid(request.cookie, address, request.salt, now):
            return DropReason.BAD_COOKIE
        if (address, request.salt) in self._used:
            return DropReason.REPLAYED_COOKIE
        if opening:
            assert conn is not None
            # Both handshakes are valid; both sides keep the one with the larger salt.
            # Ours: the peer, seeing our CONNECT, answers it the same way. Theirs: our
            # connection answers it, as a server would, and is established.
            if request.salt <= conn.salt:
                return DropReason.UNEXPECTED
            self._remember_cookie(address, request.salt, now)
            self.stats.simultaneous_opens += 1
            self._answer(conn, request, now)
            return None
        self._remember_cookie(address, request.salt, now)
        if conn is not None:
            # The peer restarted: its old session is gone.
            conn.abort(DisconnectReason.NO_CONNECTION, by_peer=True)
        if len(self._conns) >= self.config.max_connections:
            self.stats.connections_refused += 1
            self._send_unvalidated(wire.encode_reject(request.salt, "server full"), address)
            return None
        conn = self._new_connection(address, now, client=False, salt=request.salt)
        self.stats.connections_accepted += 1
        self._answer(conn, request, now)
        return None

    def _answer(self, conn: Connection, request: wire.Connect, now: float) -> None:
        """Accept ``request`` into ``conn``: choose the token, send ACCEPT (kept for
        resending on a duplicate CONNECT), and the connection is established."""
        token = self._rng.getrandbits(32) or 1
        accept = conn._answer_connect(request.salt, token, request.isn, now)
        self._out.append((accept, conn.address))
        self._schedule(conn)

    def _receive_query(self, data: bytes, address: Address) -> DropReason | None:
        query = wire.decode_query(data)
        room = len(data) - wire.HEADER_SIZE - wire.QUERY_BODY.size
        self._events.append((None, QueryReceived(address, query.nonce, query.payload, room)))
        return None

    def _receive_query_reply(self, data: bytes, address: Address, now: float) -> DropReason | None:
        reply = wire.decode_query(data)
        pending = self._queries.get(reply.nonce)
        if pending is None or pending[0] != address:
            return DropReason.UNEXPECTED
        del self._queries[reply.nonce]
        self._events.append(
            (None, QueryAnswered(address, reply.nonce, reply.payload, now - pending[1]))
        )
        return None

    # -- helpers -------------------------------------------------------------------

    def _new_connection(
        self, address: Address, now: float, *, client: bool, salt: int
    ) -> Connection:
        conn = Connection(
            config=self.config,
            address=address,
            now=now,
            rng=self._rng,
            client=client,
            salt=salt,
            sink=self._sink,
        )
        self._conns[address] = conn
        return conn

    def _forget(self, conn: Connection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        self.stats.absorb(conn.stats)

    def _schedule(self, conn: Connection) -> None:
        """Keep one heap entry per connection at its earliest deadline.

        An entry is only pushed when the deadline moves earlier; one that fires
        too early costs a harmless ``handle_timer`` call and is re-pushed, so the
        heap never fills with stale entries on the per-datagram path.
        """
        t = conn.get_timer()
        if t is not None:
            armed = self._armed.get(conn)
            if armed is None or t < armed:
                self._armed[conn] = t
                heapq.heappush(self._heap, (t, next(self._ids), conn))

    def _send_unvalidated(self, datagram: bytes, address: Address) -> None:
        self.stats.unvalidated_bytes_sent += len(datagram)
        self._out.append((datagram, address))

    def _send_noconn(self, token: int, seq: int, address: Address, now: float) -> None:
        if self._noconn.take(now):
            self._send_unvalidated(wire.encode_noconn(token, seq), address)
        else:
            self.stats.noconn_suppressed += 1

    def _key(self, slot: int) -> bytes:
        key = self._keys.get(slot)
        if key is None:
            if len(self._keys) > 4:
                self._keys.clear()
            key = hmac.digest(self._master, _SLOT.pack(slot & 0xFFFFFFFF), hashlib.sha256)
            self._keys[slot] = key
        return key

    def _mac(self, slot: int, address: Address, salt: int) -> bytes:
        msg = f"{address[0]}|{address[1]}|{salt}".encode()
        return hmac.digest(self._key(slot), msg, hashlib.sha256)[:COOKIE_MAC]

    def _slot(self, now: float) -> int:
        return int(now // self.config.cookie_lifetime) & 0xFFFFFFFF

    def _cookie(self, address: Address, salt: int, now: float) -> bytes:
        slot = self._slot(now)
        return _SLOT.pack(slot) + self._mac(slot, address, salt)

    def _cookie_valid(self, cookie: bytes, address: Address, salt: int, now: float) -> bool:
        if len(cookie) != _SLOT.size + COOKIE_MAC:
            return False
        (slot,) = _SLOT.unpack_from(cookie)
        current = self._slot(now)
        if slot not in (current, (current - 1) & 0xFFFFFFFF):
            return False
        return hmac.compare_digest(cookie[_SLOT.size :], self._mac(slot, address, salt))

    def _remember_cookie(self, address: Address, salt: int, now: float) -> None:
        used = self._used
        while used and (next(iter(used.values())) < now or len(used) >= REPLAY_CACHE_LIMIT):
            used.popitem(last=False)
        used[(address, salt)] = now + 2 * self.config.cookie_lifetime
