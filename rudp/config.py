"""Every tunable of rudp, in one frozen dataclass.

Each default is written down once, here, with the reason for it (the ENet habit
of one documented header of constants). Construct with keywords only and derive
variants with :func:`dataclasses.replace`::

    cfg = rudp.Config(idle_timeout=30.0)
    fast = dataclasses.replace(cfg, rto_min=0.01)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rudp.netsim.conditioner import LinkProfile

# Below this a CONNECT cannot carry our handshake replies without amplifying,
# and some paths would fragment nothing anyway; IPv6 guarantees 1280-byte
# packets, so 1200 leaves room for tunnel headers (QUIC uses the same figure).
MIN_DATAGRAM_SIZE = 576
MAX_DATAGRAM_SIZE = 65507


@dataclass(frozen=True, kw_only=True)
class NetsimConfig:
    """Impair this endpoint's own traffic in-process (see docs/netsim.md).

    ``outbound`` applies to datagrams we send, ``inbound`` to datagrams we
    receive; ``None`` means a perfect link in that direction.
    """

    outbound: LinkProfile | None = None
    inbound: LinkProfile | None = None
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class Config:
    """Connection and endpoint settings. Times are in seconds."""

    max_datagram_size: int = 1200
    """Largest datagram we send. 1200 bytes is safe on IPv6 and tunnelled paths."""

    window: int = 256
    """Ack-eliciting packets in flight at most. 256 x 1200 B covers 30 MB/s at 10 ms RTT."""

    channels: int = 32
    """Number of independent channels (0 .. channels-1). At most 256."""

    channel_window: int = 4096
    """Reliable messages in flight per channel; also the receiver's reorder span."""

    send_queue_limit: int = 65536
    """Messages queued or unacknowledged before ``send()`` raises ``SendQueueFull``."""

    drain_low_water: int | None = None
    """``drain()`` returns once the queue is at or below this many messages
    (None: a quarter of ``send_queue_limit``; see ``drain_threshold``)."""

    recv_buffer_bytes: int = 2 * 1024 * 1024
    """Bytes of out-of-order reliable data held per connection; a packet that would
    exceed it is dropped unacknowledged (and so resent later). An honest peer never
    gets near it: it cannot have more than ``window`` datagrams in flight."""

    rto_initial: float = 0.25
    """Resend timeout before the first round-trip sample (RFC 6298 says 1 s; games can't wait)."""

    rto_min: float = 0.025
    """Lower clamp of the resend timeout; RFC 6298's 1 s is far too slow for games."""

    rto_max: float = 2.0
    """Upper clamp of the resend timeout, backoff included."""

    max_backoff: int = 5
    """Consecutive timeouts double the RTO at most this many times (x32)."""

    reorder_threshold: int = 3
    """A packet is lost once this many later packets were acknowledged (fast resend)."""

    keepalive_interval: float = 1.0
    """Send a PING after this long without sending anything ack-eliciting."""

    idle_timeout: float = 10.0
    """End the connection with reason "timeout" after hearing nothing for this long."""

    connect_timeout: float = 5.0
    """``connect()`` gives up with ``ConnectTimeout`` after this long."""

    connect_retry_interval: float = 0.25
    """Resend CONNECT this often until the server answers."""

    close_timeout: float = 3.0
    """After sending DISCONNECT, end anyway if it is not acknowledged within this."""

    max_connections: int = 1024
    """A server refuses (reason "server full") past this many connections."""

    cookie_lifetime: float = 10.0
    """Handshake cookie secret rotation period; a cookie is valid for up to two periods."""

    noconn_rate: float = 200.0
    """NOCONN replies per second at most (token bucket), so they can't be used for floods."""

    noconn_burst: int = 50
    """Burst size of the NOCONN token bucket."""

    socket_buffer_size: int = 4 * 1024 * 1024
    """SO_RCVBUF / SO_SNDBUF requested; a burst larger than the kernel buffer is lost."""

    max_datagrams_per_read: int = 256
    """Datagrams drained from the socket per readiness event before yielding to the loop."""

    netsim: NetsimConfig | None = field(default=None)
    """In-process link conditioner for this endpoint (testing and demos). Off by default."""

    def __post_init__(self) -> None:
        _check_range(
            "max_datagram_size", self.max_datagram_size, MIN_DATAGRAM_SIZE, MAX_DATAGRAM_SIZE
        )
        _check_range("window", self.window, 1, 16384)
        _check_range("channels", self.channels, 1, 256)
        _check_range("channel_window", self.channel_window, 1, 16384)
        _check_range("send_queue_limit", self.send_queue_limit, 1, 1 << 30)
        if self.drain_low_water is not None:
            _check_range("drain_low_water", self.drain_low_water, 0, self.send_queue_limit)
        _check_range("recv_buffer_bytes", self.recv_buffer_bytes, self.max_datagram_size, 1 << 34)
        _check_range("max_backoff", self.max_backoff, 0, 16)
        _check_range("reorder_threshold", self.reorder_threshold, 1, 32)
        _check_range("max_connections", self.max_connections, 0, 1 << 24)
        _check_range("noconn_burst", self.noconn_burst, 1, 1 << 20)
        _check_range("max_datagrams_per_read", self.max_datagrams_per_read, 1, 1 << 16)
        for name in (
            "rto_initial",
            "rto_min",
            "rto_max",
            "keepalive_interval",
            "idle_timeout",
            "connect_timeout",
            "connect_retry_interval",
            "close_timeout",
            "cookie_lifetime",
            "noconn_rate",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.rto_min <= self.rto_initial <= self.rto_max:
            raise ValueError("Config needs rto_min <= rto_initial <= rto_max")
        if self.keepalive_interval >= self.idle_timeout:
            raise ValueError("Config.keepalive_interval must be shorter than idle_timeout")
        if self.socket_buffer_size < 0:
            raise ValueError("Config.socket_buffer_size must be >= 0")

    @property
    def drain_threshold(self) -> int:
        """The queue length at which ``drain()`` returns."""
        if self.drain_low_water is None:
            return self.send_queue_limit // 4
        return self.drain_low_water


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"Config.{name} must be an integer in [{low}, {high}], got {value!r}")
