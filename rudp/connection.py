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
timers, flow control, the peer's address and its migration (``rudp.migration``
says when a connection moves), and the glue that tells each part what happened.

Packet numbers: a sender that reached the last one (2**62 - 1,
``protection.MAX_PACKET_NUMBER``) ends the connection
(``DisconnectReason.EXHAUSTED``) rather than seal under a nonce again.

Flow control (PAUSE / RESUME): see ``pause_receiving`` and ``packet_reader``.

All state transitions happen in ``_set_state``; the states are in ``rudp.state``.
Once CLOSED, the connection drops its parts' references back to it
(``_release``), so that reference counting frees an ended connection at once
instead of the cyclic collector, and nothing reaches a part through it again.

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

from rudp import frames, wire
from rudp.config import Config
from rudp.congestion import CongestionController
from rudp.errors import ConnectionClosed, LocalProtocolError, check_now
from rudp.events import Disconnected, DisconnectReason
from rudp.handshake import ClientHandshake, TransportParams
from rudp.migration import Migration
from rudp.noise import ephemeral_key, private_key
from rudp.opening import Opening
from rudp.packet_builder import PacketBuilder
from rudp.packet_reader import PacketReader
from rudp.pmtu import PathMtu
from rudp.protection import PacketNumbersExhausted
from rudp.receiving import NO_BUFFER as NO_BUFFER
from rudp.receiving import Receiver
from rudp.recovery import PacketRecovery, RttEstimator, SentPacket
from rudp.sending import OutMessage, Sender
from rudp.sink import EndpointSink
from rudp.state import CLOSED, CLOSING, CONNECTED, CONNECTING, DRAINING, TRANSITIONS, State
from rudp.stats import ConnectionStats
from rudp.tokens import PeerIdentity
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
        token: bytes = b"",
        token_key: bytes | None = None,
    ) -> None:
        self.config = config
        self.address = address
        """The peer's address: where our packets go. It changes when the peer migrates."""
        self.client = client
        self._rng = rng
        self.salt = salt
        self.cid = cid  # the connection id the peer puts on packets to us (ours to route)
        self.peer_cid = 0  # the one we put on packets to the peer, from its parameters
        self.reset_token = reset_token  # what a NOCONN about ``cid`` carries (we tell the peer)
        self.peer_params: TransportParams | None = None
        self.server_authenticated = False
        """True when the handshake proved the server holds the key we expected (NK)."""
        self.packet_cipher = ""
        """The AEAD sealing the packets once connected: ``"aes-256-gcm"`` when both
        sides allow it (``Config.aes_gcm``), ``"chacha20-poly1305"`` otherwise."""
        self.handshake_hash = b""
        """The Noise handshake hash, identical on both sides (a channel binding)."""
        self.peer_identity: PeerIdentity | None = None
        """On a server that requires connect tokens: the client's verified token."""
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
        self._pmtu = PathMtu(config.base_datagram_size, self.stats)
        self.stats.pmtu = self._pmtu
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
        # A connect token is bound to the key it was issued for: then that key is ours.
        # A server's connection gets none: its handshake was answered with the key
        # ``rudp.accepting`` drew (making one here cost an X25519 key per accept).
        self._opening: Opening | None = None
        if client:
            ephemeral = ephemeral_key(rng) if token_key is None else private_key(token_key)
            handshake = ClientHandshake(self.transport_params(), salt, server_key, ephemeral, token)
            self._opening = Opening(config, handshake, salt, now)
        # -- migration: the validation of a new peer address (``rudp.migration``)
        self._migration = Migration(self)  # a new peer address being validated
        self._close_code = 0
        self._close_text = ""
        self._disconnect_queued = False
        self._deadline: float | None = None  # close or drain deadline
        # -- flow control (PAUSE / RESUME)
        self.receiving_paused = False  # we asked the peer to stop sending reliable messages
        self.peer_paused = False  # the peer asked us to
        # Since when the peer's PAUSE has held back reliable messages of ours (None:
        # it holds back nothing): the connection ends at ``peer_pause_timeout``.
        self._held_since: float | None = None
        # Config.ack_timeout counts time the peer could take our messages: time it
        # paused us is left out, up to peer_pause_timeout (``_ack_deadline``).
        self.paused_total = 0.0  # the peer's pauses so far, ended ones
        self._paused_at = 0.0  # when the current one began
        self._released = False  # the parts' references back to us are gone (``_release``)

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

    def drain_level(self, threshold: int) -> int:
        """The queue length at which a wait for room ends: ``threshold``, or lower
        right after a fragmented message was refused for want of room."""
        return self._sender.drain_level(threshold)

    def room_found(self) -> None:
        """A drain() for a refused fragmented message is over: the next waits for
        the threshold again, unless a retry is refused again."""
        self._sender.room_wanted = 0

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
        if now is not None and type(now) is not float:
            now = check_now(now)  # stored with an unreliable message, read at each flush
        if type(channel) is not int and (not isinstance(channel, int) or type(channel) is bool):
            # A float or None would fail deep in the sender ("list indices must be
            # integers"); compiled, the call itself refuses it. A bool is an int to
            # both, and True would go out on channel 1.
            raise TypeError(f"channel must be an int, not {type(channel).__name__}")
        if reliable is not True and reliable is not False:
            # Truthiness would send "no" reliably; compiled, the call itself refuses it.
            raise TypeError(
                f"reliable must be True or False, not {reliable!r} (a delivery mode goes "
                "in delivery=rudp.Delivery...)"
            )
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
        """Start a graceful close: flush what is queued reliably, then DISCONNECT.

        ``text`` must be a str that UTF-8 encodes: anything else raises (TypeError,
        ValueError) before the state changes, not later when the DISCONNECT is built.
        The peer gets at most ``frames.MAX_CLOSE_TEXT`` bytes of it, clipped on a
        character boundary.
        """
        if type(now) is not float:
            now = check_now(now)
        frames.check_close_code(code)
        frames.check_close_text(text)
        if self.state is CONNECTING:
            self._end(DisconnectReason.CLOSED, code, text, by_peer=False)
            self._release()
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
        self._builder.flow_frame = frames.PAUSE_FRAME
        if self.state is not CLOSED:
            self._sink.dirty[self] = None

    def resume_receiving(self, now: float) -> None:
        """Let the peer send messages again (undoes ``pause_receiving()``).

        While paused we may have refused the very dependencies the waiting messages
        need: their ``dependency_timeout`` counts again from ``now``.
        """
        if type(now) is not float:
            now = check_now(now)
        if not self.receiving_paused:
            return
        self.receiving_paused = False
        self._clock = max(self._clock, now)
        self._builder.flow_frame = frames.RESUME_FRAME
        if self.state is not CLOSED:
            self._sink.dirty[self] = None
        self._receiver.graph.restart_clocks(now)

    def abort(
        self, reason: DisconnectReason = DisconnectReason.ABORTED, *, by_peer: bool = False
    ) -> None:
        """End at once without telling the peer (it will learn by NOCONN or timeout)."""
        if self.state is DRAINING:
            self._set_state(CLOSED)  # its Disconnected was already reported
        elif self.state is not CLOSED:
            self._end(reason, 0, "", by_peer=by_peer)
        self._release()

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
        pmtu_at = self._pmtu.deadline
        if pmtu_at < t:
            t = pmtu_at
        recovery = self._recovery
        if recovery.sent:
            t = min(t, recovery.probe_deadline())
            if recovery.loss_time is not None:
                t = min(t, recovery.loss_time)
        elif not self._builder.ping:  # a pending PING goes out with the next flush
            t = min(t, self._keepalive_due())
        t = min(t, self._builder.ack_deadline)
        if self._deadline is not None:
            t = min(t, self._deadline)
        path_at = self._migration.deadline()
        if path_at is not None:
            t = min(t, path_at)
        graph = self._receiver.graph
        if graph.nodes and not self.receiving_paused:
            t = min(t, graph.deadline(self.config.dependency_timeout))
        if self._held_since is not None:
            t = min(t, self._held_since + self.config.peer_pause_timeout)
        order = self._sender.sent_order
        if order:
            # The head may be done with already: the timer then only pops it.
            t = min(t, self._ack_deadline(order[0]))
        return t

    def _ack_deadline(self, msg: OutMessage) -> float:
        """When ``msg`` has gone unacknowledged too long: ``ack_timeout`` after it first
        left, plus the time the peer paused us since (it may refuse what it cannot
        buffer until it resumes), but never more than ``peer_pause_timeout`` of it: a
        peer that resumes for a moment between pauses cannot put it off for good."""
        cfg = self.config
        base = msg.first_sent + cfg.ack_timeout
        cap = cfg.peer_pause_timeout
        paused = min(self.paused_total - msg.paused_before, cap)
        if self.peer_paused and base + paused > self._paused_at:
            # Paused now, and not overdue when the pause began: the count stands
            # still until the pauses reach the cap.
            return base + cap
        return base + paused

    def handle_timer(self, now: float) -> None:
        self._clock = now
        state = self.state
        if state is CONNECTING:
            self._connecting_timer(now)
        elif state is DRAINING:
            if self._deadline is not None and now >= self._deadline:
                self._set_state(CLOSED)
        elif state is not CLOSED:
            self.stats.timer_wakeups += 1
            self._connected_timer(now)
        if self.state is CLOSED:
            self._release()

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
        pmtu = self._pmtu
        probe = 0
        if now >= pmtu.next_probe:
            probe = pmtu.due(now)
            if probe:
                builder.ping = True  # the probe's witness that the path is alive (rudp.pmtu)
        try:
            while True:
                datagram = builder.build(now, closing, draining)
                if datagram is None:
                    break
                out.append(datagram)
            if probe:
                out.append(builder.probe(probe))
                pmtu.probe_sent(
                    builder.tx_next - 1, probe, now, self._rtt.rto, self._recovery.largest_acked
                )
        except PacketNumbersExhausted:
            self._numbers_exhausted()
            self._release()
        if self.peer_paused and (
            self._sender.rel_queue or self._sender.oldest_unacked() is not None
        ):
            if self._held_since is None:
                self._held_since = now
        elif self._held_since is not None:
            self._held_since = None
        if out:
            stats = self.stats
            stats.packets_sent += len(out)
            stats.bytes_sent += sum(map(len, out))
            if now >= stats.sample_due:
                stats.sample(now)
        return out

    # -- the endpoint's interface: handshake and DATA --------------------------------------

    @property
    def expects_server_key(self) -> bool:
        """True while this connection's own handshake is NK: it names the server's key."""
        opening = self._opening
        return opening is not None and opening.expects_server_key

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
        self._release()
        return None

    def _receive_sealed(self, data: bytes, pn32: int, now: float) -> DropReason | None:
        """A DATA packet routed here by its connection id (see ``packet_reader``)."""
        if self.state is CLOSED:
            return DropReason.UNEXPECTED
        self._clock = now
        try:
            reason = self._reader.receive(data, pn32, now)
        except PacketNumbersExhausted:  # an early ack-only packet had no number left
            self._numbers_exhausted()
            reason = None
        self._release()  # if that ended it
        return reason

    def _receive_moved(
        self, data: bytes, pn32: int, address: Address, now: float, *, movable: bool
    ) -> DropReason | None:
        """A DATA packet for this connection from another address (``rudp.migration``);
        ``movable`` is False when another connection of the endpoint has that address,
        or its source holds as many connections as it may."""
        if self.state is CLOSED:
            return DropReason.UNEXPECTED
        reason = self._migration.receive(data, pn32, address, now, movable)
        self._release()  # if that ended it
        return reason

    @property
    def path_out(self) -> list[tuple[bytes, Address]]:
        """Path challenges waiting to be sent, each to its own address."""
        return self._migration.out

    def take_path_datagrams(self) -> list[tuple[bytes, Address]]:
        """The challenges to send, each with its own address (not ``address``)."""
        return self._migration.take_datagrams()

    def _numbers_exhausted(self) -> None:
        """Our next packet would need number 2**62: end before a nonce could repeat."""
        if self.state is not CLOSED:
            self._end(
                DisconnectReason.EXHAUSTED,
                0,
                "packet numbers exhausted: 2**62 packets sent on this connection",
                by_peer=False,
            )

    def _on_probe_ack(self, ack16: int, bits: int, now: float) -> None:
        """An acknowledgment arrived while a path MTU probe is in flight."""
        pmtu = self._pmtu
        if pmtu.on_ack(ack16, bits, self._builder.tx_next, now):
            self._use_datagram_size(pmtu.current)
            self._sink.dirty[self] = None  # the next probe may be due at once

    def _use_datagram_size(self, size: int) -> None:
        """Path MTU discovery moved the size datagrams are filled to."""
        self._builder.set_datagram_size(size)
        self._cc.set_datagram_size(size)

    def _datagram_refused(self, size: int, now: float) -> None:
        """The local interface refused to send one of our datagrams of ``size`` bytes
        as too large (EMSGSIZE): a probe is lost at once; a packet of the current
        size makes the size fall back (its messages are resent when it is declared
        lost)."""
        if self.state is CLOSED:
            return
        pmtu = self._pmtu
        if pmtu.on_refused(size, now):
            self._use_datagram_size(pmtu.current)
        self._sink.dirty[self] = None

    def _on_acks(self, now: float) -> None:
        """The peer acknowledged new packets of ours: a close may now go on."""
        if self.state is CLOSING:
            self._maybe_send_disconnect(now)

    def _on_peer_flow(self, paused: bool, now: float) -> None:
        if paused == self.peer_paused:
            return
        self.peer_paused = paused
        if paused:
            self._paused_at = now
            self.stats.peer_pauses += 1
            if self.state is CLOSING and self._deadline is None:
                self._deadline = now + self.config.close_timeout
        else:
            self.paused_total += now - self._paused_at
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
        pmtu = self._pmtu
        if pkt.size > pmtu.base:
            pmtu.big_losses = 0  # the path still carries large packets
        if pkt.disconnect and self.state is CLOSING:
            self._end(DisconnectReason.CLOSED, self._close_code, self._close_text, by_peer=False)

    def _on_packet_resent(self, pkt: SentPacket) -> None:
        """A tail-loss probe sends ``pkt``'s messages again (``recovery``): not a loss,
        but nothing will be learnt of ``pkt`` any more."""
        self._sender.on_lost(pkt)
        self._flow_again(pkt)
        self._sink.dirty[self] = None

    def _flow_again(self, pkt: SentPacket) -> None:
        builder = self._builder
        if pkt.seq == builder.flow_seq and not builder.flow_frame:
            # Our latest PAUSE or RESUME went with it: tell the current state again.
            builder.flow_frame = (
                frames.PAUSE_FRAME if self.receiving_paused else frames.RESUME_FRAME
            )

    def _on_packet_lost(self, pkt: SentPacket) -> None:
        self._sender.on_lost(pkt)
        builder = self._builder
        pmtu = self._pmtu
        if pkt.size > pmtu.base and pmtu.on_big_lost(self._clock):
            self._use_datagram_size(pmtu.current)  # a black hole: back to the base size
        if pkt.control and self.state is CLOSING:
            builder.control.extend(pkt.control)
        self._flow_again(pkt)  # our latest PAUSE or RESUME may have been lost with it
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
        if self._held_since is not None and now >= self._held_since + cfg.peer_pause_timeout:
            # Not a close: the peer keeps us from sending a DISCONNECT's queued messages
            # first. It learns from the NOCONN its next packet gets.
            self._end(DisconnectReason.PEER_PAUSED, 0, "", by_peer=False)
            return
        # A paused peer may refuse what it cannot buffer, unacknowledged, until it
        # resumes: the pause is timed by peer_pause_timeout, and ack_timeout counts
        # only the time the peer could take the message (up to peer_pause_timeout of
        # its pauses left out).
        oldest = self._sender.oldest_unacked()
        if oldest is not None and now >= self._ack_deadline(oldest):
            self._end(DisconnectReason.UNACKNOWLEDGED, 0, "", by_peer=False)
            return
        if self._migration.on_timer(now):
            return  # the connection ended (packet numbers exhausted)
        builder = self._builder
        recovery = self._recovery
        if now >= builder.ack_deadline:
            builder.ack_pending = True  # nothing went out to carry it: it goes alone
            self._sink.dirty[self] = None
        pmtu = self._pmtu
        if now >= pmtu.deadline:
            if now >= pmtu.probe_deadline:
                pmtu.on_timeout(now, recovery.largest_acked, self._rtt.backed_off_rto)
            self._sink.dirty[self] = None  # a probe is due
        if recovery.on_timer(now, builder.tx_next):
            builder.ping = True  # a probe goes out even if nothing needed resending
            self._sink.dirty[self] = None  # a tail-loss probe resends nothing to flag it
        elif not recovery.sent and now >= self._keepalive_due():
            builder.ping = True
            self._sink.dirty[self] = None

    def _keepalive_due(self) -> float:
        """When a PING is due: after ``keepalive_interval`` without sending anything (the
        peer's idle timer needs our packets) or without hearing anything (ours needs the
        peer's answer). Traffic both ways, even unreliable or acknowledgments only,
        needs none."""
        return min(self._last_recv, self._builder.last_sent) + self._keepalive_interval

    # -- closing ----------------------------------------------------------------------------

    def _maybe_send_disconnect(self, now: float) -> None:
        sender = self._sender
        if self._disconnect_queued or sender.unacked_reliable or sender.unrel_queue:
            return
        # Built before the flag is set: nothing may leave the close half done.
        frame = frames.disconnect_frame(self._close_code, self._close_text)
        self._disconnect_queued = True
        self._builder.control.append(frame)
        self._deadline = now + self.config.close_timeout
        self._sink.dirty[self] = None

    def _on_peer_disconnect(self, frame: frames.DisconnectFrame, now: float) -> None:
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

    def _release(self) -> None:
        """An ended connection drops its parts' references back to it, so that
        reference counting frees it the moment the last outside reference goes: each
        part of the data path points back to the connection, a cycle of some forty
        objects that would otherwise wait for the cyclic collector (and, having lived
        long enough to be promoted, for a middle-generation collection).

        Called by each way in (the endpoint's calls, ``close``, ``abort``) once the
        connection is CLOSED, never from within a part: a part that ended the
        connection may still be running. Nothing touches a part's ``_conn`` after
        CLOSED: a closed connection receives, sends and times nothing; what stays
        readable (``stats``, ``close_reason``, ``queued``) needs no part's reference.
        """
        if self._released or self.state is not CLOSED:
            return
        self._released = True
        receiver = self._receiver
        del self._sender._conn
        del self._recovery._conn
        del self._builder._conn
        del self._reader._conn
        del receiver._conn
        del receiver.graph._conn
        del self._migration._conn
        del self._pmtu._stats

    def _set_state(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise LocalProtocolError(f"illegal transition {self.state.value} -> {new.value}")
        self.state = new
        if new is not CONNECTED:
            self._pmtu.stop()
        if new is CLOSED:
            self._sink.closed(self)

    def __repr__(self) -> str:
        return f"<Connection {self.address!r} {self.state.value}>"
