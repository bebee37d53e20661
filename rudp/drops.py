"""Why an incoming datagram was dropped: one reason, one counter.

Every datagram the core refuses is counted under exactly one of these reasons
(``EndpointStats.dropped``, the ``rudp_dropped_total`` metric's ``reason`` label),
so an operator can tell garbage from an attack from a bug.
"""

from __future__ import annotations

import enum


class DropReason(enum.StrEnum):
    """Why an incoming datagram was dropped; each has its own counter."""

    TRUNCATED = "truncated"
    BAD_CHECKSUM = "bad_checksum"
    WRONG_VERSION = "wrong_version"
    UNKNOWN_TYPE = "unknown_type"
    MALFORMED = "malformed"
    UNKNOWN_PEER = "unknown_peer"
    BAD_TOKEN = "bad_token"
    BAD_COOKIE = "bad_cookie"
    REPLAYED_COOKIE = "replayed_cookie"
    STALE = "stale"
    DUPLICATE = "duplicate"
    BAD_ACK = "bad_ack"
    RECV_BUFFER_FULL = "recv_buffer_full"
    RECV_QUEUE_FULL = "recv_queue_full"
    UNEXPECTED = "unexpected"
    REPLAYED = "replayed"
    """A sealed packet whose number was already received, or is older than the replay window."""
    AUTH_FAILED = "auth_failed"
    """A sealed packet that does not authenticate under the connection's key (forged,
    tampered, truncated, or reflected back at its sender)."""
    WRONG_ADDRESS = "wrong_address"
    """A sealed packet for a known connection id from another address than the
    connection's, while the connection cannot move (not established, or draining); an
    established one validates the new address instead (``rudp.migration``)."""
    BAD_HANDSHAKE = "bad_handshake"
    """A CONNECT or ACCEPT whose Noise message is not genuine (wrong key, tampered)."""
    INTERNAL_ERROR = "internal_error"
    """A datagram whose processing raised inside rudp: a bug, never the peer's doing
    by design. The asyncio layer counts it, logs the traceback, and reads on."""
