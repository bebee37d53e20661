"""Every tunable of rudp, in one frozen dataclass.

Each default is written down once, here, with the reason for it (the ENet habit
of one documented header of constants). Construct with keywords only and derive
variants with :func:`dataclasses.replace`::

    cfg = rudp.Config(idle_timeout=30.0)
    fast = dataclasses.replace(cfg, rto_min=0.01)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Final

from rudp.frames import FRAGMENT_FRAME_OVERHEAD, MAX_FRAGMENTS
from rudp.tokens import normal_address

if TYPE_CHECKING:
    from rudp.netsim.conditioner import LinkProfile

# Below this a CONNECT cannot carry our handshake replies without amplifying,
# and some paths would fragment nothing anyway; IPv6 guarantees 1280-byte
# packets, so 1200 leaves room for tunnel headers (QUIC uses the same figure).
MIN_DATAGRAM_SIZE: Final = 576
MAX_DATAGRAM_SIZE: Final = 65507
BASE_DATAGRAM_SIZE: Final = 1200
"""Every connection starts at this datagram size and never goes below it (QUIC's
figure, RFC 9000 section 14): path MTU discovery probes upward from here."""
ETHERNET_DATAGRAM_SIZE: Final = 1472
"""The largest UDP payload of a 1,500-byte Ethernet path over IPv4 (20-byte IP and
8-byte UDP headers)."""
IPV6_EXTRA_HEADER: Final = 20
"""IPv6's header is 20 bytes longer than IPv4's: over IPv6 the ceiling of path MTU
discovery is ``max_datagram_size`` less this (1,452 bytes by default)."""
REDUNDANT_FRAME_MAX: Final = 256
"""Largest message frame (payload plus 3-6 header bytes) that ``redundancy`` repeats."""
BUFFER_ENTRY_COST: Final = 64
"""Bytes charged per buffered message besides its payload (the receiver's reorder
buffer, the sender's estimate of it, the asyncio receive queue), so that empty
messages cannot fill a buffer with entries for free."""


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

    max_datagram_size: int = ETHERNET_DATAGRAM_SIZE
    """Largest datagram we send or take: the ceiling of path MTU discovery. Every
    connection starts at 1200 bytes (safe on IPv6 and tunnelled paths) and probes
    upward to the smaller of this and the peer's value, then packs its datagrams up to the size the
    path confirmed. Messages are still split into fragments that fit 1200 bytes
    (``base_datagram_size``), so a path whose MTU shrinks loses none of them.
    The default is the largest UDP payload of a 1,500-byte Ethernet path over IPv4;
    it counts as an IPv4 size, so over IPv6 (20 more bytes of IP header) the ceiling
    is 20 bytes less (1,452 by default). 1200 or less turns the discovery off."""

    window: int = 256
    """Ack-eliciting packets in flight at most. 256 x 1200 B covers 30 MB/s at 10 ms RTT."""

    congestion_control: bool = False
    """Limit the reliable data in flight to a congestion window that adapts to the
    path (see ``rudp.recovery.CongestionController``): it starts at ten datagrams,
    doubles every round trip while nothing is lost, then grows by one datagram per
    round trip; a loss while a queue builds (the RTT above its minimum) shrinks it
    to what the path has been delivering (Westwood+), a loss with no queue building
    leaves it alone, and two resend timeouts in a row drop it to two datagrams.
    ``window`` still caps it.

    Turn it on for bulk reliable transfers over a path slower than ``window``
    datagrams per round trip (a home uplink, a mobile link): without it the sender
    keeps ``window`` packets in flight whatever the path carries, fills the
    bottleneck's queue and loses there most of what it sends, unreliable messages
    included, then resends at the same rate. It is off by default: a bulk transfer
    starts from ten datagrams instead of the full window, and random loss with
    jitter still slows it (1.6x as long at 2 % loss and 40 ms RTT), while a game's
    own traffic (a few small messages per tick) never fills even the initial
    window. docs/protocol.md has the figures. Unreliable messages, acks and
    keepalives are never held back by it."""

    channels: int = 32
    """Number of independent channels (0 .. channels-1). At most 256."""

    channel_window: int = 4096
    """Reliable messages in flight per channel; also the receiver's reorder span,
    stated in the handshake: each side keeps to the smaller of the two."""

    send_queue_limit: int = 65536
    """Messages queued or unacknowledged before ``send()`` raises ``SendQueueFull``."""

    drain_low_water: int | None = None
    """``drain()`` returns once the queue is at or below this many messages
    (None: a quarter of ``send_queue_limit``; see ``drain_threshold``)."""

    max_message_size: int = 1024 * 1024
    """Largest message this side takes, stated in the handshake: the peer's
    ``send()`` raises ``MessageTooLarge`` past it, and a peer that sends a larger
    one anyway ends the connection (protocol error). A reliable message that does
    not fit a datagram is split into fragments and reassembled. Unreliable
    messages are never fragmented: one larger than a datagram is refused at
    ``send()`` (see ``Connection.max_datagram_payload``)."""

    max_reassembly_bytes: int = 4 * 1024 * 1024
    """Bytes of fragmented messages a connection holds while they are incomplete or
    waiting for their turn. A message reserves its whole size when its first
    fragment arrives; a packet whose fragment would start a message that does not
    fit is dropped unacknowledged and resent later, once others have completed."""

    redundancy: int = 2
    """At most this many later packets repeat each small reliable message (frame of
    at most ``REDUNDANT_FRAME_MAX`` bytes) while it is unacknowledged, so that a
    lost packet is repaired by the next one instead of by a resend a round trip
    later (the "several frames per packet" trick; TCP's thin-stream redundant data
    bundling is the same idea). How many follows the loss rate loss detection
    measures: none below 0.5 % (a clean path pays nothing), one from 0.5 %, two from
    3.2 % (see ``PacketBuilder.redundancy_level``). Copies only fill room left in
    packets that go out anyway, and only in thin streams (the send queue is empty):
    a bulk transfer fills its packets and pays nothing; a stream of small messages
    on a lossy path pays in bytes (up to ``1 + redundancy`` times its payload) for
    an ordered-channel p99 close to the path's one-way delay (see
    docs/performance.md). 0 turns it off."""

    parity: bool = False
    """Protect a thin stream on a lossy path with parity instead of copies, when the
    peer supports it (it says so in the handshake): every few packets one also
    carries a REPAIR frame, a combination of the packets sent before it, from which
    the receiver rebuilds one it is missing without waiting a round trip. Like the
    copies it follows the measured loss rate (nothing below 0.5 %; at 5 %, one
    REPAIR per 4 packets) and only fills room in packets that go out anyway; it
    costs a fraction of the copies (1.40-1.46x the payload of a stream of 200-byte
    messages at 5 % loss, against 3.1x with two copies), but a REPAIR rebuilds a
    packet only once the others it covers have arrived, so on a jittery path a
    repaired message waits a few milliseconds longer than a copy would (the p99 of
    that stream, reliable-ordered, is 1.2-1.6x the path's instead of at it; see
    ``rudp.parity`` and docs/performance.md). Off by default for that reason: it
    is for links that pay by the byte. Without it on both sides, the
    ``redundancy`` copies are used."""

    aes_gcm: bool = True
    """Seal packets with AES-256-GCM instead of ChaCha20-Poly1305 when the peer
    allows it too (each side says so in the handshake; the handshake's own messages
    stay ChaCha20-Poly1305, as Noise names them). Both are 256-bit AEADs with the
    same nonce, tag and wire size; what differs is the CPU: on a processor with AES
    instructions (x86-64 since 2010, ARMv8 with its cryptography extension) an
    AES-256-GCM call on a small packet costs about a third of a ChaCha20-Poly1305
    one, and every packet is sealed once and opened once. Turn it off on a processor
    without them, where ChaCha20-Poly1305 is the faster (see ``rudp.protection``)."""

    unreliable_max_age: float = 0.25
    """An unreliable message that waited longer than this in the send queue (while
    connecting, for instance) is dropped and counted, not sent stale."""

    dependency_timeout: float = 20.0
    """A dependency-ordered message still waiting for its dependencies after this
    long ends the connection with a protocol error: an honest peer resends them
    long before, so they will never come."""

    ack_timeout: float = 30.0
    """A reliable message that the peer has not acknowledged this long after it first
    left ends the connection (reason "message unacknowledged"): the peer is heard
    (else ``idle_timeout`` ends it sooner) yet never takes the message, so waiting
    longer cannot help. ENet's peers give up after 30 s too (``timeoutMaximum``).
    Time the peer pauses us is not counted (``peer_pause_timeout`` times that); the
    count goes on at its resume. At most ``peer_pause_timeout`` of pauses is left out
    for one message: a peer that resumes for a moment between pauses cannot hold it
    (nor a close waiting for it) past ``ack_timeout + peer_pause_timeout``."""

    peer_pause_timeout: float = 60.0
    """A peer whose PAUSE has kept our reliable messages waiting (queued, or sent and
    not acknowledged) for this long ends the connection (reason "peer paused too
    long"): a stall that a peer could otherwise hold for good, pinning our send
    queue, ends with a reason."""

    recv_buffer_bytes: int = 2 * 1024 * 1024
    """Bytes of out-of-order reliable data held per connection; a packet that would
    exceed it is dropped unacknowledged (and so resent later). An honest peer never
    gets near it: it cannot have more than ``window`` datagrams in flight."""

    recv_queue_bytes: int = 1024 * 1024
    """Bytes of received messages waiting for ``recv()`` per connection (each charged
    64 bytes besides its payload) before the peer is asked to pause (flow control):
    it then sends no new reliable messages until ``recv()`` has taken the queue down
    to half of this. Messages already on their way still arrive, up to ``recv_buffer_bytes``
    more; a peer that ignores the pause gets its packets refused unacknowledged and
    resends them later, so an application that stops reading holds a bounded amount
    of memory per connection and the sender's ``drain()`` waits instead."""

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

    max_ack_delay: float = 0.025
    """How long an acknowledgment may wait for a packet that goes out anyway to carry
    it, stated in the handshake so the peer's resend timer allows for it (QUIC's
    ``max_ack_delay``, with its default). A gap in the packets received, every second
    ack-eliciting packet, a PING and a DISCONNECT are acknowledged at once; so is
    everything when the peer states no delay of its own (an earlier version-2 peer).
    A 60 Hz game then answers each input in the next tick's packet instead of a
    datagram of its own. 0 acknowledges at the end of every event-loop turn."""

    keepalive_interval: float = 1.0
    """Send a PING after this long without sending anything, or without hearing from
    the peer: a connection that carries traffic both ways never needs one."""

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

    max_connections_per_source: int = 0
    """A server refuses (reason "too many connections from your address") a new
    connection from a source, an IPv4 address or an IPv6 /64, that already holds this
    many (0: no limit). Keeps one source from taking every slot of ``max_connections``;
    players behind one NAT share a source, so leave room for them."""

    handshake_rate_per_source: float = 0.0
    """Handshakes per second one source (IPv4 address, IPv6 /64) may start, counted at
    the CONNECT with a valid cookie, the first one that costs a Diffie-Hellman (0: no
    limit). One over it is dropped unanswered; the client's own CONNECT resends try
    again."""

    handshake_burst_per_source: int = 32
    """Burst size of each source's handshake token bucket."""

    source_limit_keys: int = 65536
    """Sources whose handshake buckets are remembered (least recently used forgotten)."""

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

    read_interval: float = 0.0
    """For a server that handles its traffic in ticks: after each read of the socket
    (asyncio endpoint), wait this long before the next, so that one wake-up drains
    what many clients sent meanwhile instead of waking for each few datagrams, as a
    C game server polls once per tick. An idle endpoint still reads the first
    datagram at once; under traffic, arrivals wait up to this long (and the round
    trips the peers measure grow by as much). 0 (the default) reads whenever a
    datagram is there; at most 0.05 s. A 256-player server at 60 Hz spends 15-20 %
    less CPU with 0.002-0.004 (docs/performance.md); a client, which gets one
    datagram per tick, only pays the extra latency. A read cut short by
    ``max_datagrams_per_read`` goes on at once: the pause comes only once the socket
    is empty. No effect on loops without ``add_reader`` (Windows' Proactor), where
    the loop's datagram transport reads the socket."""

    static_key: bytes | None = None
    """This endpoint's X25519 private key (32 bytes, ``rudp.generate_key()``). A server
    needs one for clients that authenticate it (Noise NK, ``server_key``); its public
    half (``rudp.public_key(key)``, ``Server.public_key``) is what they are given. It
    also seeds the NOCONN reset tokens, so a server that restarts with the same key
    tells its old clients at once that their connection is gone. Keep it secret
    (see docs/security.md)."""

    server_key: bytes | None = None
    """The server's public key (32 bytes) a client expects: with it, the handshake is
    Noise NK and only the holder of the matching ``static_key`` can complete it;
    without it, NN: every packet is still sealed, but the server is not
    authenticated (an on-path attacker could sit in the middle)."""

    token_issuers: tuple[bytes, ...] = ()
    """Connect-token issuers' public keys (Ed25519, 32 bytes; two while a key rotates).
    With any, this server admits only clients that present a token one of them signed
    for this server's ``static_key`` (which it then needs); the verified client id and
    user data are ``conn.peer_identity``. See docs/security.md, "Connect tokens"."""

    token_addresses: tuple[tuple[str, int], ...] = ()
    """This server's public addresses, when it knows them: a token must then name one.
    Empty, the token's host key alone binds it to this server."""

    netsim: NetsimConfig | None = field(default=None)
    """In-process link conditioner for this endpoint (testing and demos). Off by default."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("static_key", "server_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, bytes) or len(key) != 32):
                raise ValueError(f"Config.{name} must be 32 bytes (an X25519 key)")
        _check_tokens(self)
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
        _check_range("recv_queue_bytes", self.recv_queue_bytes, 1, 1 << 34)
        _check_range("max_backoff", self.max_backoff, 0, 16)
        _check_range("reorder_threshold", self.reorder_threshold, 1, 32)
        _check_range("max_connections", self.max_connections, 0, 1 << 24)
        _check_range("noconn_burst", self.noconn_burst, 1, 1 << 20)
        _check_range("max_datagrams_per_read", self.max_datagrams_per_read, 1, 1 << 16)
        if not 0.0 <= self.read_interval <= 0.05:
            raise ValueError(
                f"Config.read_interval must be in [0, 0.05] seconds, got {self.read_interval!r}"
            )
        _check_range("max_message_size", self.max_message_size, 0, 1 << 30)
        _check_range(
            "max_reassembly_bytes", self.max_reassembly_bytes, self.max_message_size, 1 << 34
        )
        _check_range("redundancy", self.redundancy, 0, 16)
        fragments = self.max_fragments
        if fragments > min(self.channel_window, MAX_FRAGMENTS):
            raise ValueError(
                f"Config.max_message_size of {self.max_message_size} bytes needs up to "
                f"{fragments} fragments of a {self.base_datagram_size}-byte datagram; at most "
                f"min(channel_window, {MAX_FRAGMENTS}) = "
                f"{min(self.channel_window, MAX_FRAGMENTS)} are allowed"
            )
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
            "unreliable_max_age",
            "dependency_timeout",
            "peer_pause_timeout",
            "ack_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"Config.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.max_ack_delay <= 16.383:
            raise ValueError(
                f"Config.max_ack_delay must be in [0, 16.383] seconds, got {self.max_ack_delay!r}"
            )
        _check_range("max_connections_per_source", self.max_connections_per_source, 0, 1 << 24)
        if not self.handshake_rate_per_source >= 0:
            raise ValueError("Config.handshake_rate_per_source must be >= 0")
        _check_range("handshake_burst_per_source", self.handshake_burst_per_source, 1, 1 << 24)
        _check_range("source_limit_keys", self.source_limit_keys, 1, 1 << 24)
        if not self.rto_min <= self.rto_initial <= self.rto_max:
            raise ValueError("Config needs rto_min <= rto_initial <= rto_max")
        if self.keepalive_interval >= self.idle_timeout:
            raise ValueError("Config.keepalive_interval must be shorter than idle_timeout")
        if not isinstance(self.congestion_control, bool):
            raise ValueError(
                f"Config.congestion_control must be True or False, got {self.congestion_control!r}"
            )
        if not isinstance(self.aes_gcm, bool):
            raise ValueError(f"Config.aes_gcm must be True or False, got {self.aes_gcm!r}")
        if self.socket_buffer_size < 0:
            raise ValueError("Config.socket_buffer_size must be >= 0")

    @cached_property
    def base_datagram_size(self) -> int:
        """The datagram size every path is assumed to carry: what connections start
        with, what fragments and unreliable messages are sized for, and what
        CONNECTs and queries are padded to."""
        return min(BASE_DATAGRAM_SIZE, self.max_datagram_size)

    @cached_property
    def fragment_payload(self) -> int:
        """Payload bytes of every fragment but the first (which also carries the
        dependencies) and the last. Sized for ``base_datagram_size``: a fragment in
        flight must still fit if the path MTU falls back."""
        return self.base_datagram_size - FRAGMENT_FRAME_OVERHEAD

    @cached_property
    def max_fragments(self) -> int:
        """Fragments the largest message can need (one more when dependencies
        shorten the first)."""
        return -(-self.max_message_size // self.fragment_payload) + 1

    @cached_property
    def drain_threshold(self) -> int:
        """The queue length at which ``drain()`` returns."""
        if self.drain_low_water is None:
            return self.send_queue_limit // 4
        return self.drain_low_water


_NUMBER_KINDS: Final = {
    "int": "an int",
    "int | None": "an int or None",
    "float": "a number (int or float)",
}
"""What each numeric field's annotation takes, as a wrong type's TypeError words it."""


def _check_types(config: Config) -> None:
    """A numeric field given something that is not a number is a TypeError naming the
    field and the type, before any comparison fails on it without naming either. As
    ``congestion_control`` takes only a bool, a bool is no number here."""
    for item in fields(config):
        kind = _NUMBER_KINDS.get(str(item.type))
        if kind is None:
            continue
        value = getattr(config, item.name)
        if type(value) is int or (value is None and item.type == "int | None"):
            continue
        if type(value) is float and item.type == "float":
            continue
        if isinstance(value, bool) or not isinstance(
            value, numbers.Integral if item.type != "float" else numbers.Real
        ):
            raise TypeError(f"Config.{item.name} takes {kind}, not {value!r}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"Config.{name} must be an integer in [{low}, {high}], got {value!r}")


def _check_tokens(config: Config) -> None:
    issuers = config.token_issuers
    if not isinstance(issuers, tuple) or len(issuers) > 2:
        raise ValueError("Config.token_issuers must be a tuple of at most 2 keys")
    if any(not isinstance(key, bytes) or len(key) != 32 for key in issuers):
        raise ValueError("Config.token_issuers: each key is 32 bytes (an Ed25519 public key)")
    if issuers and config.static_key is None:
        raise ValueError(
            "Config.token_issuers needs Config.static_key: a token names the server's key"
        )
    for address in config.token_addresses:
        try:
            normal_address(address)
        except (TypeError, ValueError):
            raise ValueError(
                f"Config.token_addresses: each is (IP address, port in 1..65535), got {address!r}"
            ) from None
