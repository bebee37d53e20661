"""One connection's protocol state: sans-IO, no sockets, no clock, no asyncio.

Theory of operation
-------------------
Every DATA datagram is a *packet* with its own packet number (64 bits, counting
from 0 in each direction; the wire carries its low 32 bits) and, first in its
sealed body, an acknowledgment of the newest packet received (16 bits) plus a
32-bit bitfield of the 32 before it. Each packet therefore re-acknowledges 33 packets,
so a lost ack costs nothing; and a gap in the bitfield, with later packets
acknowledged, reveals a loss within one round trip (see ``recovery``).

Packets carry *frames*: messages, PING and DISCONNECT. Reliability is per
message, not per packet: when a packet is lost, the reliable messages in it
that were not acknowledged some other way go back to the front of the queue
and are sent again in a new packet, coalesced with whatever else is due. A
message is acknowledged when any packet carrying it is. Duplicate and replayed
packets are refused by the replay window (``protection.Opener``) before they are
opened; duplicate messages by their sequence numbers (``receiving``).

Sealing: the handshake (``rudp.handshake``; the client's attempt is driven by
``rudp.opening``, the server's by the endpoint) gives the connection its keys,
the peer's connection id, reset token and limits (``_establish``). The packet
builder produces the plaintext body and seals it, the 9-byte cleartext header
as associated data; the packet reader opens what
arrives, and a packet that fails authentication changes nothing at all, not even
the idle timer, so a forger can neither keep a dead connection alive nor disturb
a live one.

The data path, one module per idea::

    send()  -> sending.Sender           queues, delivery modes, fragmentation, OutMessage
            -> packet_builder           fills each datagram from the queues, acks, redundancy
            -> recovery.PacketRecovery  RTT, loss detection (tells us each packet's fate)
               congestion               how many bytes may be in flight
    DATA    -> packet_reader            opening, packet window, flow frames, acknowledgments
            -> receiving.Receiver       reorder buffers, sequenced modes, reassembly, delivery
               graph                    the dependency graph, both sides
    events, flush requests, our end     -> sink.EndpointSink (the endpoint's)

This module keeps what belongs to the connection as a whole: the handshake's
outcome and the limits it negotiated, the lifecycle and its state machine, the
timers, flow control, and the glue that tells each part what happened.

Flow control (PAUSE / RESUME): see ``pause_receiving`` and ``packet_reader``.

All state transitions happen in ``_set_state``; the states are in ``rudp.state``.

Sequence numbers are unwrapped into unbounded ints on arrival (``seqnum``), so
wraparound is handled in one place.

Judgement call: the parts are separate objects that own their state, as in
aioquic, and the connection holds one of each.
"""

from __future__ import annotations

import hmac
import random
from collections.abc import Iterable
from typing import Any

from rudp import wire
from rudp.config import Config
from rudp.congestion import CongestionController
from rudp.errors import ConnectionClosed, LocalProtocolError
from rudp.events import Connected, Disconnected, DisconnectReason
from rudp.handshake import ClientHandshake, Keys, TransportParams
from rudp.noise import ephemeral_key
from rudp.opening import Opening
from rudp.packet_builder import PacketBuilder
from rudp.packet_reader import PacketReader
from rudp.protection import Opener, Sealer
from rudp.receiving import NO_BUFFER as NO_BUFFER
from rudp.receiving import Receiver
from rudp.recovery import PacketRecovery, RttEstimator, SentPacket
from rudp.sending import OutMessage, Sender
from rudp.sink import EndpointSink
from rudp.state import CLOSED, CLOSING, CONNECTED, CONNECTING, DRAINING, TRANSITIONS, State
from rudp.stats import ConnectionStats
from rudp.wire import Delivery, DropReason

__all__ = ["NO_BUFFER", "Address", "Connection", "State"]

Address = tuple[Any, ...]


class Connection:
    """The protocol core of one connection. Created by ``Endpoint``."""

    def __init__(
        self,
        *,
        config: Config,
        address: Address,
        now: float,
        rng: random.Random,
        client: bool,
        salt: int,
        sink: EndpointSink | None = None,
        cid: int = 1,
        reset_token: bytes = bytes(16),
        server_key: bytes | None = None,
    ) -> None:
        self.config = config
        self.address = address
        self.client = client
        self.salt = salt
        self.cid = cid  # the connection id the peer puts on packets to us (ours to route)
        self.peer_cid = 0  # the one we put on packets to the peer, from its parameters
        self.reset_token = reset_token  # what a NOCONN about ``cid`` carries (we tell the peer)
        self.peer_params: TransportParams | None = None
        self.server_authenticated = False
        """True when the handshake proved the server holds the key we expected (NK)."""
        self.handshake_hash = b""
        """The Noise handshake hash, identical on both sides (a channel binding)."""
        self._peer_reset_token = b""
        self._limits_error = ""  # why something queued before the handshake cannot go
        self.state = CONNECTING
        self.stats = ConnectionStats()
        self.close_reason: Disconnected | None = None
        # Where events, flush requests and our end go: the endpoint's (see ``sink``).
        self._sink = EndpointSink() if sink is None else sink
        self._rtt = RttEstimator(config)
        self.stats.rtt = self._rtt
        self._cc = CongestionController(config)
        self.stats.cc = self._cc
        # Packet numbers start at 0 in each direction: with every packet sealed nothing is
        # guessable from them, so no random initial number is needed (it was version 1's
        # defence against blind injection).
        # -- the parts of the data path
        self._sender = Sender(self, self._sink, self.stats, config)
        self._recovery = PacketRecovery(self, config, self.stats, self._rtt, self._cc, 0)
        self._builder = PacketBuilder(
            self, self._sender, self._recovery, self._cc, self.stats, config, 0, now
        )
        self._receiver = Receiver(self, self._sink.events, self.stats, config)
        self._clock = now  # the latest time the core was given
        # Config values read per packet, copied into native attributes (see RttEstimator).
        self._idle_timeout = config.idle_timeout
        self._keepalive_interval = config.keepalive_interval
        self._byte_window = config.recv_buffer_bytes
        self._reader = PacketReader(
            self,
            self._builder,
            self._recovery,
            self._sender,
            self._receiver,
            self._sink,
            self.stats,
            config,
        )
        self._last_recv = now
        # -- handshake and close
        self._accept_datagram = b""  # our ACCEPT, if we answered a CONNECT (see _answer_connect)
        # The client's side of the handshake, until it is answered (``rudp.opening``).
        self._opening = (
            Opening(
                config,
                ClientHandshake(self.transport_params(), salt, server_key, ephemeral_key(rng)),
                salt,
                now,
            )
            if client
            else None
        )
        self._close_code = 0
        self._close_text = ""
        self._disconnect_queued = False
        self._deadline: float | None = None  # close or drain deadline
        # -- flow control (PAUSE / RESUME)
        self.receiving_paused = False  # we asked the peer to stop sending reliable messages
        self.peer_paused = False  # the peer asked us to

    # -- public API -----------------------------------------------------------------

    def transport_params(self) -> TransportParams:
        """What this side tells the peer in the handshake (``rudp.handshake``)."""
        return TransportParams.of(self.config, self.cid, self.reset_token)

    def seal_datagram(self, body: bytes) -> bytes:
        """``body`` (acknowledgment fields, then frames) sealed as our next DATA packet.

        The packet builder's last step; public for tests that play a peer and forge
        its packets with its real keys. Raises LocalProtocolError before the handshake.
        """
        return self._builder.seal_next(body)

    def peek_datagram(self, data: bytes) -> bytes | None:
        """The opened body of a DATA packet sent to this connection, or None, without
        receiving it: nothing changes. For tools and tests that watch a link."""
        return self._reader.peek(data)

    @property
    def queued(self) -> int:
        """Messages not yet sent plus reliable messages not yet acknowledged."""
        return self._sender.queued

    @property
    def max_message_size(self) -> int:
        """The largest reliable message (``Config.max_message_size``)."""
        return self.config.max_message_size

    @property
    def max_datagram_payload(self) -> int:
        """The largest message sent in one datagram: the limit for unreliable
        messages; a larger reliable one is fragmented."""
        return self._sender.max_single

    def send(
        self,
        data: bytes | bytearray | memoryview,
        *,
        reliable: bool = True,
        channel: int = 0,
        delivery: Delivery | int | None = None,
        depends_on: Iterable[OutMessage] | None = None,
        now: float | None = None,
    ) -> OutMessage:
        """Queue a message; returns its handle. Raises at once on misuse or a full queue.

        ``delivery`` picks a ``Delivery`` mode (``reliable`` is then ignored, unless
        it contradicts it); ``depends_on`` lists handles of earlier graph messages
        (``RELIABLE_UNORDERED`` or ``DEPENDENCY_ORDERED``) and implies
        ``DEPENDENCY_ORDERED``. ``now`` stamps unreliable messages for
        ``Config.unreliable_max_age`` (without it, a message queued while connecting
        ages from the next ``datagrams_to_send``, and one queued later never expires).
        """
        if self.state is not CONNECTED:
            self._check_can_send()
        return self._sender.send(data, reliable, channel, delivery, depends_on, now)

    def _check_can_send(self) -> None:
        if self.state is CONNECTING:
            return  # queued until the handshake completes
        if self.close_reason is not None:
            reason = self.close_reason
            raise ConnectionClosed(reason.reason, reason.code, reason.text)
        # CLOSING: close() was called and the connection is ending gracefully.
        raise ConnectionClosed(DisconnectReason.CLOSED, self._close_code, self._close_text)

    def close(self, now: float, code: int = 0, text: str = "") -> None:
        """Start a graceful close: flush what is queued reliably, then DISCONNECT."""
        if not 0 <= code <= 0xFFFF:
            raise LocalProtocolError(f"close code must be in [0, 65535], got {code}")
        if self.state is CONNECTING:
            self._end(DisconnectReason.CLOSED, code, text, by_peer=False)
        elif self.state is CONNECTED:
            self._close_code, self._close_text = code, text
            self._set_state(CLOSING)
            self._sink.dirty[self] = None  # queued unreliable messages go first, then DISCONNECT
            if self.peer_paused:
                # What is queued may never be taken: a close must still end.
                self._deadline = now + self.config.close_timeout
            self._maybe_send_disconnect(now)

    def pause_receiving(self) -> None:
        """Ask the peer to stop sending new reliable messages: the application is not
        keeping up.

        Messages already on their way are still accepted, up to ``recv_buffer_bytes``
        of datagrams; past that, a packet carrying messages is refused unacknowledged
        (counted as ``recv_queue_full``) and comes back after ``resume_receiving()``.
        """
        if self.receiving_paused:
            return
        self.receiving_paused = True
        self._reader.pause_budget = self._byte_window
        self.stats.receive_pauses += 1
        self._builder.flow_frame = wire.PAUSE_FRAME
        self._sink.dirty[self] = None

    def resume_receiving(self) -> None:
        """Let the peer send messages again (undoes ``pause_receiving()``)."""
        if not self.receiving_paused:
            return
        self.receiving_paused = False
        self._builder.flow_frame = wire.RESUME_FRAME
        self._sink.dirty[self] = None
        # While paused we may have refused the very dependencies these wait for: their
        # dependency_timeout counts from now, not from their arrival.
        self._receiver.graph.restart_clocks(self._clock)

    def abort(
        self, reason: DisconnectReason = DisconnectReason.ABORTED, *, by_peer: bool = False
    ) -> None:
        """End at once without telling the peer (it will learn by NOCONN or timeout)."""
        if self.state is DRAINING:
            self._set_state(CLOSED)  # its Disconnected was already reported
        elif self.state is not CLOSED:
            self._end(reason, 0, "", by_peer=by_peer)

    def get_timer(self) -> float | None:
        """When ``handle_timer`` must next run, or None."""
        state = self.state
        if state is CLOSED:
            return None
        if state is CONNECTING:
            assert self._opening is not None  # only a client connects
            return self._opening.timer()
        if state is DRAINING:
            return self._deadline
        t = self._last_recv + self._idle_timeout
        recovery = self._recovery
        if recovery.sent:
            t = min(t, recovery.probe_deadline())
            if recovery.loss_time is not None:
                t = min(t, recovery.loss_time)
        elif not self._builder.ping:  # a pending PING goes out with the next flush
            t = min(t, self._builder.last_eliciting + self._keepalive_interval)
        if self._deadline is not None:
            t = min(t, self._deadline)
        graph = self._receiver.graph
        if graph.nodes and not self.receiving_paused:
            t = min(t, graph.deadline(self.config.dependency_timeout))
        return t

    def handle_timer(self, now: float) -> None:
        self._clock = now
        state = self.state
        if state is CONNECTING:
            self._connecting_timer(now)
        elif state is DRAINING:
            if self._deadline is not None and now >= self._deadline:
                self._set_state(CLOSED)
        elif state is not CLOSED:
            self._connected_timer(now)

    def datagrams_to_send(self, now: float) -> list[bytes]:
        """Everything due now, coalesced into as few datagrams as possible."""
        self._clock = now
        out: list[bytes] = []
        state = self.state
        if state is CONNECTING:
            for msg in self._sender.unrel_queue:
                if msg.queued_at is None:  # sent without a time: it ages from now
                    msg.queued_at = now
            assert self._opening is not None
            connect = self._opening.connect_datagram(now)
            if connect is not None:
                out.append(connect)
            return out
        if state is CLOSED:
            return out
        builder = self._builder
        if builder.early_acks:
            out.extend(builder.early_acks)
            builder.early_acks.clear()
        closing = state is CLOSING
        draining = state is DRAINING
        while True:
            datagram = builder.build(now, closing, draining)
            if datagram is None:
                break
            out.append(datagram)
        if out:
            self.stats.packets_sent += len(out)
            self.stats.bytes_sent += sum(map(len, out))
        return out

    # -- the endpoint's interface: handshake and DATA --------------------------------------

    def _receive_challenge(self, challenge: wire.Challenge) -> DropReason | None:
        opening = self._opening
        if self.state is not CONNECTING or opening is None:
            return DropReason.UNEXPECTED
        reason = opening.on_challenge(challenge)
        if reason is None:
            self._sink.dirty[self] = None  # the CONNECT with the cookie goes out now
        return reason

    def _receive_accept(self, accept: wire.Accept, now: float) -> DropReason | None:
        opening = self._opening
        if self.state is not CONNECTING or opening is None:
            return DropReason.DUPLICATE if accept.salt == self.salt else DropReason.UNEXPECTED
        result = opening.on_accept(accept, now)
        if isinstance(result, DropReason):
            return result
        keys, sample = result
        if sample is not None:
            self._rtt.on_sample(sample)
        self.server_authenticated = opening.expects_server_key
        self._opening = None
        self._establish(keys, now)
        return None

    def _receive_reject(self, reject: wire.Reject) -> DropReason | None:
        if self.state is not CONNECTING or reject.salt != self.salt:
            return DropReason.UNEXPECTED
        self._end(DisconnectReason.REFUSED, 0, reject.text, by_peer=True)
        return None

    def _answer_connect(
        self, salt: int, answer: bytes, keys: Keys, now: float, *, token_sealed: bool
    ) -> bytes:
        """The endpoint accepted the peer's CONNECT into this connection: a new one, or
        ours in a simultaneous open that the peer's handshake won (our own CONNECTs and
        our Noise state are dropped; the connection takes the peer's salt, so a duplicate
        of its CONNECT gets the ACCEPT again). ``answer`` is our Noise message 2.
        Returns the ACCEPT to send; ``_accept_datagram`` keeps it.

        ``token_sealed`` is False under NN, where the peer's parameters, its reset token
        among them, crossed the network in clear: anyone who saw the CONNECT could then
        forge its NOCONN, so this side believes none (the peer that forgot us is noticed
        at the idle timeout instead)."""
        self._accept_datagram = wire.encode_accept(salt, answer)
        self.salt = salt
        self._opening = None
        self.server_authenticated = False
        self._establish(keys, now)
        if not token_sealed:
            self._peer_reset_token = b""
        return self._accept_datagram

    @property
    def expects_server_key(self) -> bool:
        """True while this connection's own handshake is NK: it names the server's key."""
        opening = self._opening
        return opening is not None and opening.expects_server_key

    def _establish(self, keys: Keys, now: float) -> None:
        """Handshake done: packet keys, and the peer's connection id, token and limits."""
        peer = keys.peer
        self.peer_params = peer
        self.peer_cid = peer.connection_id
        self._peer_reset_token = peer.reset_token
        self.handshake_hash = keys.handshake_hash
        self._builder.set_keys(Sealer(keys.send_key), peer.connection_id)
        self._reader.opener = Opener(keys.recv_key)
        self._apply_peer_limits(peer)
        self._reader.rx_largest = -1
        self._last_recv = now
        self._builder.last_eliciting = now
        self._set_state(CONNECTED)
        self._sink.events.append((self, Connected()))
        self._sink.dirty[self] = None
        if self._limits_error:
            self._protocol_error(self._limits_error)

    def _apply_peer_limits(self, peer: TransportParams) -> None:
        """What the peer stated it accepts, from the handshake: its largest message and
        channel count (``send()`` raises at once past them, naming the peer's limit),
        its receive buffer (what we let sit in it), the smaller datagram size and the
        smaller idle timeout of the two sides (either side's silence limit ends the
        connection, so both keep it alive within the smaller).

        A message queued before the handshake was checked against our limits only; if
        it breaks the peer's, it can never be sent, and the connection ends at once
        (protocol error, naming the limit) rather than stall.
        """
        idle = peer.idle_timeout_ms / 1000.0
        if 0 < idle < self._idle_timeout:
            self._idle_timeout = idle
            self._keepalive_interval = min(self._keepalive_interval, idle / 2)
        datagram = min(self.config.max_datagram_size, peer.max_datagram_size)
        self._builder.apply_peer_limits(datagram, peer.recv_buffer_bytes)
        self._limits_error = self._sender.apply_peer_limits(peer, datagram)

    def _receive_noconn(self, noconn: wire.NoConn) -> DropReason | None:
        """The peer says it has no connection with us; believe it only if it carries
        the reset token the peer gave us in the handshake, so that no one who did not
        see that handshake can end the connection (the peer recomputes the token from
        the connection id after it forgot us)."""
        if self.state is CONNECTING or not self._peer_reset_token:
            return DropReason.UNEXPECTED
        if noconn.dcid != self.peer_cid or not hmac.compare_digest(
            noconn.token, self._peer_reset_token
        ):
            return DropReason.BAD_TOKEN
        if self.state is CLOSING and self._disconnect_queued:
            # The peer already forgot us: our DISCONNECT has nothing left to do.
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)
        elif self.state is DRAINING:
            self._set_state(CLOSED)
        else:
            self._end(DisconnectReason.NO_CONNECTION, 0, "", by_peer=True)
        return None

    def _receive_sealed(self, data: bytes, pn32: int, now: float) -> DropReason | None:
        """A DATA packet routed here by its connection id (see ``packet_reader``)."""
        if self.state is CLOSED:
            return DropReason.UNEXPECTED
        self._clock = now
        return self._reader.receive(data, pn32, now)

    def _on_acks(self, now: float) -> None:
        """The peer acknowledged new packets of ours: a close may now go on."""
        if self.state is CLOSING:
            self._maybe_send_disconnect(now)

    def _on_peer_flow(self, paused: bool, now: float) -> None:
        if paused == self.peer_paused:
            return
        self.peer_paused = paused
        if paused:
            self.stats.peer_pauses += 1
            if self.state is CLOSING and self._deadline is None:
                self._deadline = now + self.config.close_timeout
        else:
            self._sink.dirty[self] = None  # what waited goes out now
            if self.state is CLOSING and not self._disconnect_queued:
                self._deadline = None

    def _protocol_error(self, text: str) -> None:
        """The peer broke the protocol in a way that cannot be dropped and forgotten."""
        if self.state is not CLOSED:
            self._end(DisconnectReason.PROTOCOL_ERROR, 0, text, by_peer=False)

    # -- what became of our packets (called by recovery) ------------------------------------

    def _on_packet_acked(self, pkt: SentPacket) -> None:
        self._sender.on_acked(pkt)
        if pkt.disconnect and self.state is CLOSING:
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)

    def _on_packet_lost(self, pkt: SentPacket) -> None:
        self._sender.on_lost(pkt)
        builder = self._builder
        if pkt.control and self.state is CLOSING:
            builder.control.extend(pkt.control)
        if pkt.seq == builder.flow_seq and not builder.flow_frame:
            # Our latest PAUSE or RESUME was lost: tell the current state again.
            builder.flow_frame = wire.PAUSE_FRAME if self.receiving_paused else wire.RESUME_FRAME
        self._sink.dirty[self] = None

    # -- timers -----------------------------------------------------------------------------

    def _connecting_timer(self, now: float) -> None:
        opening = self._opening
        assert opening is not None  # only a client connects
        timeout = opening.on_timer(now)
        if timeout is not None:
            self._end(DisconnectReason.CONNECT_TIMEOUT, 0, timeout, by_peer=False)
        elif opening.send_connect:
            self._sink.dirty[self] = None

    def _connected_timer(self, now: float) -> None:
        cfg = self.config
        # Every test below uses the very expression get_timer() returns: written as
        # ``now - last >= interval`` it can disagree in the last bit and spin the timer.
        if now >= self._last_recv + self._idle_timeout:
            self._end(DisconnectReason.TIMEOUT, 0, "", by_peer=False)
            return
        if self._deadline is not None and now >= self._deadline:
            # Our DISCONNECT was never acknowledged: end anyway, with our reason.
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)
            return
        graph = self._receiver.graph
        if (
            graph.nodes
            and not self.receiving_paused
            and now >= graph.deadline(cfg.dependency_timeout)
        ):
            self._protocol_error("a dependency never arrived")
            return
        builder = self._builder
        recovery = self._recovery
        if recovery.on_timer(now, builder.tx_next):
            builder.ping = True  # a probe goes out even if nothing needed resending
        elif not recovery.sent and now >= builder.last_eliciting + self._keepalive_interval:
            builder.ping = True
            self._sink.dirty[self] = None

    # -- closing ----------------------------------------------------------------------------

    def _maybe_send_disconnect(self, now: float) -> None:
        sender = self._sender
        if self._disconnect_queued or sender.unacked_reliable or sender.unrel_queue:
            return
        self._disconnect_queued = True
        self._builder.control.append(wire.disconnect_frame(self._close_code, self._close_text))
        self._deadline = now + self.config.close_timeout
        self._sink.dirty[self] = None

    def _on_peer_disconnect(self, frame: wire.DisconnectFrame, now: float) -> None:
        if self.state is DRAINING:
            return
        if self.state is CLOSING:
            # Both sides closed at once; each reports its own close.
            event = Disconnected(DisconnectReason.CLOSED, self._close_code, self._close_text, False)
        else:
            event = Disconnected(DisconnectReason.CLOSED, frame.code, frame.text, True)
        self._fail_pending()
        self.close_reason = event
        self._sink.events.append((self, event))
        self._set_state(DRAINING)
        # Linger to re-acknowledge a resent DISCONNECT whose ack was lost.
        self._deadline = now + max(3 * self._rtt.rto, 0.05)

    def _end(self, reason: DisconnectReason, code: int, text: str, *, by_peer: bool) -> None:
        self._fail_pending()
        event = Disconnected(reason, code, text, by_peer)
        self.close_reason = event
        self._sink.events.append((self, event))
        self._set_state(CLOSED)

    def _fail_pending(self) -> None:
        recovery = self._recovery
        self._sender.fail_all(recovery.sent.values())
        self._builder.clear()
        recovery.clear()
        self._receiver.clear()

    def _set_state(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise LocalProtocolError(f"illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new is CLOSED:
            self._sink.closed(self)

    def __repr__(self) -> str:
        return f"<Connection {self.address!r} {self.state.value}>"
