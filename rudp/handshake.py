"""The version-2 handshake: a Noise handshake and each side's limits, in two messages.

Theory of operation
-------------------
The client's CONNECT carries the first Noise message and the server's ACCEPT the
second, so sealing costs no round trip beyond the stateless cookie exchange the
handshake already had (the server computes no Diffie-Hellman and keeps no state
for an address before it echoes a valid cookie: the cookie check comes first).

* ``NK`` when the client knows the server's static public key: the first message
  is already encrypted to that key, and only the holder of the private key can
  answer, so the client knows whom it reached.
* ``NN`` otherwise: both directions are sealed with fresh keys, but the server is
  not authenticated; an on-path attacker who answers first can sit in the middle.
  ``conn.server_authenticated`` says which one a connection used.

The prologue binds the protocol version, the pattern and the client's salt, so a
message cannot be moved to another handshake or downgraded from NK to NN without
failing authentication; with extensions, also the lengths by which the CONNECT
splits the payload into parameters and connect token.

Each side's Noise payload is its :class:`TransportParams`: the connection id it
wants on the packets it receives, what it accepts (largest message, channels,
receive buffer, datagram size, idle timeout), and its reset token: the 16 bytes
an unauthenticated NOCONN about this connection must carry to be believed, which
an endpoint can recompute from the connection id after it forgot the connection.
A sender checks the peer's limits before it queues anything, so a mismatch
raises at once instead of stalling (``MessageTooLarge`` names the peer's limit).

Both messages are encrypted and authenticated except the client's parameters
under ``NN``: they travel in clear in the first message (there is no key yet),
but they are hashed into the transcript, so a change by an attacker makes the
server's answer fail to authenticate at the client.

A client may append a connect token (``rudp.tokens``) to its parameters in the
first message's payload: encrypted to the server's key under NK. The server reads
the first message (``read_first``), checks the token against the client's
ephemeral key, which the token names, and only then answers
(``FirstMessage.answer``) and spends anything on a connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from rudp.noise import DHLEN, TAGLEN, HandshakeState, NoiseError

if TYPE_CHECKING:
    from rudp.config import Config

PATTERN_NN: Final = 0
PATTERN_NK: Final = 1
_PROTOCOL_NAMES: Final = {
    PATTERN_NN: "Noise_NN_25519_ChaChaPoly_BLAKE2s",
    PATTERN_NK: "Noise_NK_25519_ChaChaPoly_BLAKE2s",
}
_PROLOGUE: Final = b"rudp/2"
RESET_TOKEN_SIZE: Final = 16
_U32: Final = 0xFFFFFFFF

# connection id u32, max message u32, channels u8, receive buffer u32,
# max datagram u16, idle timeout ms u32, reset token (16 bytes).
_PARAMS: Final = struct.Struct("!IIBIHI16s")
PARAMS_SIZE: Final = _PARAMS.size
# Extensions after the fixed part: id u8, length u8, value. A reader skips ids it does
# not know, so a later release can add one without a new wire version.
_EXTENSION: Final = struct.Struct("!BB")
EXT_MAX_ACK_DELAY: Final = 1  # u16: milliseconds an acknowledgment may wait
EXT_CHANNEL_WINDOW: Final = 2  # u16: how far ahead of its next message a channel takes one
EXT_PARITY: Final = 3  # empty: this side reads REPAIR and RECOVERED frames (``rudp.parity``)
EXT_AES_GCM: Final = 4  # empty: this side allows AES-256-GCM for the packets (``rudp.protection``)
MAX_ACK_DELAY_LIMIT_MS: Final = 16383  # as QUIC's max_ack_delay (2^14 and above are invalid)


def first_message_size(pattern: int, token_size: int = 0, extensions: int = 0) -> int:
    """Bytes of the client's Noise message (ephemeral key, parameters with
    ``extensions`` bytes of extensions, token, tags)."""
    tags = TAGLEN if pattern == PATTERN_NK else 0
    return DHLEN + PARAMS_SIZE + max(extensions, 0) + token_size + tags


SECOND_MESSAGE_SIZE: Final = DHLEN + PARAMS_SIZE + TAGLEN


@dataclass(frozen=True, slots=True)
class TransportParams:
    """What one side tells the other in the handshake."""

    connection_id: int
    """The id the peer must put on the packets it sends to this side."""
    max_message_size: int
    """The largest message this side accepts, in bytes."""
    channels: int
    """How many channels this side accepts (0..channels-1)."""
    recv_buffer_bytes: int
    """How many bytes of out-of-order and partial messages this side buffers."""
    max_datagram_size: int
    """The largest datagram this side accepts."""
    idle_timeout_ms: int
    """Silence after which this side ends the connection."""
    reset_token: bytes
    """A NOCONN about this connection must carry it to be believed."""
    max_ack_delay_ms: int | None = None
    """How long this side may hold an acknowledgment back, waiting for a packet to
    carry it (the peer adds it to its resend timeout); None when the side states no
    extensions (an earlier version-2 peer, which acknowledges at once)."""
    channel_window: int | None = None
    """How many reliable messages a channel (and the dependency graph) of this side
    takes ahead of the next one it delivers (``Config.channel_window``): the peer keeps
    no more in flight, nor sends a message of more fragments. None: not stated (the
    peer then assumes its own)."""
    parity: bool = False
    """This side reads REPAIR and RECOVERED frames (``rudp.parity``): the peer may
    protect its packets with parity instead of copies."""
    aes_gcm: bool = False
    """This side allows AES-256-GCM for the packets (``Config.aes_gcm``): when both
    sides state it, both directions use it instead of ChaCha20-Poly1305."""

    @property
    def extended(self) -> bool:
        """Whether the encoding carries extensions (see ``wire.PARAMS_EXTENDED``)."""
        return self.max_ack_delay_ms is not None

    def encode(self) -> bytes:
        if len(self.reset_token) != RESET_TOKEN_SIZE:
            raise ValueError(f"a reset token is {RESET_TOKEN_SIZE} bytes")
        fixed = _PARAMS.pack(
            self.connection_id,
            self.max_message_size,
            self.channels,
            self.recv_buffer_bytes,
            self.max_datagram_size,
            self.idle_timeout_ms,
            self.reset_token,
        )
        if self.max_ack_delay_ms is None:
            return fixed
        delay = min(max(self.max_ack_delay_ms, 0), MAX_ACK_DELAY_LIMIT_MS)
        out = fixed + _EXTENSION.pack(EXT_MAX_ACK_DELAY, 2) + delay.to_bytes(2, "big")
        if self.channel_window is not None:
            window = min(max(self.channel_window, 1), 0xFFFF)
            out += _EXTENSION.pack(EXT_CHANNEL_WINDOW, 2) + window.to_bytes(2, "big")
        if self.parity:
            out += _EXTENSION.pack(EXT_PARITY, 0)
        if self.aes_gcm:
            out += _EXTENSION.pack(EXT_AES_GCM, 0)
        return out

    @classmethod
    def decode(cls, data: bytes) -> TransportParams:
        """The parameters in ``data``; ValueError when they are malformed."""
        if len(data) < PARAMS_SIZE:
            raise ValueError("transport parameters have the wrong size")
        cid, message, channels, buffer, datagram, idle, token = _PARAMS.unpack_from(data)
        if channels == 0 or datagram < 576 or message == 0:
            raise ValueError("transport parameters out of range")
        ack_delay: int | None = None
        window: int | None = None
        parity = False
        aes_gcm = False
        offset = PARAMS_SIZE
        if len(data) > offset:
            ack_delay = 0  # extensions without this one: the side acknowledges at once
        while offset < len(data):
            if offset + _EXTENSION.size > len(data):
                raise ValueError("truncated transport parameter extension")
            ext, size = _EXTENSION.unpack_from(data, offset)
            offset += _EXTENSION.size
            value = data[offset : offset + size]
            if len(value) != size:
                raise ValueError("truncated transport parameter extension")
            offset += size
            if ext == EXT_MAX_ACK_DELAY:
                if size != 2 or int.from_bytes(value, "big") > MAX_ACK_DELAY_LIMIT_MS:
                    raise ValueError("max_ack_delay out of range")
                ack_delay = int.from_bytes(value, "big")
            elif ext == EXT_CHANNEL_WINDOW:
                if size != 2 or not int.from_bytes(value, "big"):
                    raise ValueError("channel_window out of range")
                window = int.from_bytes(value, "big")
            elif ext == EXT_PARITY:
                parity = True
            elif ext == EXT_AES_GCM:
                if size:
                    raise ValueError("the aes_gcm extension has no value")
                aes_gcm = True
        return cls(
            cid,
            message,
            channels,
            buffer,
            datagram,
            idle,
            token,
            ack_delay,
            window,
            parity=parity,
            aes_gcm=aes_gcm,
        )

    @classmethod
    def of(cls, config: Config, connection_id: int, reset_token: bytes) -> TransportParams:
        """What a side with ``config`` states, capped to the fields' sizes."""
        return cls(
            connection_id=connection_id,
            max_message_size=max(1, config.max_message_size),
            channels=config.channels,
            recv_buffer_bytes=min(config.recv_buffer_bytes, _U32),
            max_datagram_size=config.max_datagram_size,
            idle_timeout_ms=min(round(config.idle_timeout * 1000), _U32),
            reset_token=reset_token,
            max_ack_delay_ms=round(config.max_ack_delay * 1000),
            channel_window=config.channel_window,
            parity=config.parity,
            aes_gcm=config.aes_gcm,
        )

    def plain(self) -> TransportParams:
        """The same without extensions: what a server answers a client that stated none."""
        return replace(
            self, max_ack_delay_ms=None, channel_window=None, parity=False, aes_gcm=False
        )


@dataclass(frozen=True, slots=True)
class Keys:
    """A finished handshake: the peer's parameters and this side's packet keys."""

    peer: TransportParams
    send_key: bytes
    recv_key: bytes
    handshake_hash: bytes
    """Identical on both sides: a channel binding (for example for connect tokens)."""


def _prologue(pattern: int, salt: int, token_size: int = 0, extensions: int = -1) -> bytes:
    prologue = _PROLOGUE + bytes((pattern,)) + salt.to_bytes(8, "big")
    if extensions >= 0:
        # How the CONNECT splits the payload (extensions, token) travels outside the
        # message: bound here, a rewrite fails the handshake instead of making the
        # server read the parameters otherwise. A client that states no extensions (an
        # earlier version-2 release) keeps the prologue it had.
        prologue += bytes((extensions,)) + token_size.to_bytes(2, "big")
    return prologue


class ClientHandshake:
    """The client's side: the first message at once, the keys from the answer."""

    def __init__(
        self,
        params: TransportParams,
        salt: int,
        server_key: bytes | None,
        ephemeral: X25519PrivateKey | None = None,
        token: bytes = b"",
    ) -> None:
        if server_key is not None and len(server_key) != DHLEN:
            raise ValueError(f"a server key is {DHLEN} bytes (X25519 public key)")
        self.token_size = len(token)
        self.pattern = PATTERN_NN if server_key is None else PATTERN_NK
        self.extended = params.extended
        payload = params.encode()
        self.extensions = len(payload) - PARAMS_SIZE if self.extended else -1
        """Bytes of extensions in our parameters (the CONNECT says it), -1: none."""
        self._state = HandshakeState(
            _PROTOCOL_NAMES[self.pattern],
            initiator=True,
            prologue=_prologue(self.pattern, salt, self.token_size, self.extensions),
            remote_static=server_key,
            ephemeral=ephemeral,
        )
        # Computed once: every CONNECT of this attempt carries the same message.
        self.message = self._state.write_message(payload + token)

    def finish(self, answer: bytes) -> Keys:
        """The keys, from the server's message; NoiseError or ValueError if it is not genuine."""
        size = len(answer)
        if size != SECOND_MESSAGE_SIZE and not (self.extended and size > SECOND_MESSAGE_SIZE):
            raise NoiseError("handshake answer has the wrong size")
        # Read into a copy: a forged answer (from an on-path attacker who read the salt)
        # fails there and leaves the state able to take the genuine one.
        state = self._state.fork()
        peer = TransportParams.decode(state.read_message(answer))
        send_key, recv_key = state.split()
        self._state = state
        return Keys(peer, send_key, recv_key, state.handshake_hash)


class FirstMessage:
    """The server's side, half way: the client's first message read, not yet answered."""

    def __init__(self, state: HandshakeState, payload: bytes, extensions: int = -1) -> None:
        self._state = state
        size = PARAMS_SIZE + max(extensions, 0)
        self.peer = TransportParams.decode(payload[:size])
        self.token = payload[size:]
        """The connect token the client appended to its parameters (empty: none)."""
        client_key = state.remote_ephemeral
        assert client_key is not None  # every first message starts with "e"
        self.client_key = client_key
        """The client's ephemeral public key: what its token must name."""

    def answer(self, params: TransportParams) -> tuple[bytes, Keys]:
        """(the server's message 2, its keys)."""
        state = self._state
        if not self.peer.extended:
            params = params.plain()  # an earlier version-2 client reads no extensions
        reply = state.write_message(params.encode())
        send_key, recv_key = state.split()
        return reply, Keys(self.peer, send_key, recv_key, state.handshake_hash)


def read_first(
    static: X25519PrivateKey | None,
    pattern: int,
    salt: int,
    message: bytes,
    ephemeral: X25519PrivateKey | None = None,
    token_size: int = 0,
    extensions: int = -1,
) -> FirstMessage:
    """The client's first message, read and authenticated (under NK), not answered.

    Raises NoiseError or ValueError when the message is not a genuine first message
    for this server (too short, wrong key, tampered), and ValueError when the
    client asks for NK and this server has no static key. ``ephemeral`` (default: a
    fresh key from the operating system) lets a caller draw it from its own
    cryptographically secure source; both sides' ``ephemeral`` exist for that.
    ``token_size``: the bytes of connect token the CONNECT says the payload carries;
    ``extensions``: the bytes of parameter extensions it says they have (-1: the
    client states none, as an earlier version-2 client; it is then answered without
    extensions of ours).
    """
    if pattern not in _PROTOCOL_NAMES:
        raise ValueError(f"unknown handshake pattern {pattern}")
    if len(message) != first_message_size(pattern, token_size, extensions):
        raise NoiseError("handshake message has the wrong size")
    if pattern == PATTERN_NK and static is None:
        raise ValueError("the client expects a server key and this server has none")
    state = HandshakeState(
        _PROTOCOL_NAMES[pattern],
        initiator=False,
        prologue=_prologue(pattern, salt, token_size, extensions),
        static=static if pattern == PATTERN_NK else None,
        ephemeral=ephemeral,
    )
    return FirstMessage(state, state.read_message(message), extensions)


def answer(
    static: X25519PrivateKey | None,
    pattern: int,
    salt: int,
    message: bytes,
    params: TransportParams,
    ephemeral: X25519PrivateKey | None = None,
    token_size: int = 0,
    extensions: int = -1,
) -> tuple[bytes, Keys]:
    """The server's side in one call: (its answer, its keys) for a client's first
    message (``read_first``, then ``FirstMessage.answer``)."""
    first = read_first(static, pattern, salt, message, ephemeral, token_size, extensions)
    return first.answer(params)
