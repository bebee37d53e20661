"""Connectionless queries: one datagram out, at most one datagram back.

Theory of operation
-------------------
A QUERY carries a random nonce and a payload, and is padded so that the answer may
carry ``reply_room`` bytes: the QUERY_REPLY is never larger than the QUERY that
caused it, so an endpoint that answers queries from anyone (server info, LAN
discovery) cannot be used as an amplifier. A reply is believed only from the
address the query went to and with its nonce; each is taken once.

The queries awaiting an answer are bounded (``QUERY_LIMIT``): past it the oldest
is forgotten, and its late answer is dropped as ``unexpected``.
"""

from __future__ import annotations

from typing import Any, Final

from rudp import wire
from rudp.drops import DropReason
from rudp.errors import MessageTooLarge, as_bytes
from rudp.events import QueryAnswered, QueryReceived
from rudp.wire import PacketType

QUERY_LIMIT: Final = 4096  # our own queries awaiting an answer

Address = tuple[Any, ...]


class Queries:
    """The queries one endpoint sent and awaits answers to."""

    def __init__(self, datagram_size: int) -> None:
        self.max_payload = datagram_size - wire.HEADER_SIZE - wire.QUERY_BODY.size
        self._pending: dict[int, tuple[Address, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def request(
        self,
        address: Address,
        nonce: int,
        payload: bytes | bytearray | memoryview,
        now: float,
        reply_room: int | None,
    ) -> bytes:
        """The QUERY datagram for ``address``, remembered under ``nonce``."""
        payload = as_bytes(payload, "a query payload")
        limit = self.max_payload
        room = limit if reply_room is None else reply_room
        if len(payload) > limit or not 0 <= room <= limit:
            raise MessageTooLarge(f"query payload and reply room must be <= {limit}")
        pending = self._pending
        if len(pending) >= QUERY_LIMIT:
            del pending[next(iter(pending))]
        pending[nonce] = (address, now)
        pad_to = wire.HEADER_SIZE + wire.QUERY_BODY.size + max(room, len(payload))
        return wire.encode_query(PacketType.QUERY, nonce, payload, pad_to)

    def cancel(self, nonce: int) -> None:
        self._pending.pop(nonce, None)

    @staticmethod
    def reply(event: QueryReceived, payload: bytes | bytearray | memoryview) -> bytes:
        """The QUERY_REPLY answering ``event``; no larger than its request allows."""
        payload = as_bytes(payload, "a query reply")
        if len(payload) > event.max_reply:
            raise MessageTooLarge(
                f"query reply of {len(payload)} bytes exceeds the {event.max_reply}"
                " bytes the request allows"
            )
        return wire.encode_query(PacketType.QUERY_REPLY, event.nonce, payload)

    @staticmethod
    def received(data: bytes, address: Address) -> QueryReceived:
        """A QUERY from ``address``: how much its answer may carry follows from its size."""
        query = wire.decode_query(data)
        room = len(data) - wire.HEADER_SIZE - wire.QUERY_BODY.size
        return QueryReceived(address, query.nonce, query.payload, room)

    def answered(self, data: bytes, address: Address, now: float) -> QueryAnswered | DropReason:
        """A QUERY_REPLY from ``address``: the answer to one of ours, or a drop reason."""
        reply = wire.decode_query(data)
        pending = self._pending.get(reply.nonce)
        if pending is None or pending[0] != address:
            return DropReason.UNEXPECTED
        del self._pending[reply.nonce]
        return QueryAnswered(address, reply.nonce, reply.payload, now - pending[1])
