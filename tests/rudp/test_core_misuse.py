"""The sans-IO core: the caller's misuse raises at once, and what it asks for is bounded."""

from __future__ import annotations

import dataclasses
import re

import pytest

import rudp
from rudp import frames, wire
from rudp.config import Config
from rudp.connection import State
from rudp.errors import LocalProtocolError, MessageTooLarge, SendQueueFull
from rudp.events import MessageAcked
from rudp.wire import DropReason
from tests.rudp.harness import CLIENT, SERVER, Link, pair, server_conn

# -- the caller's misuse raises at once --------------------------------------------------------


def test_misuse_raises_clear_errors() -> None:
    net, server, client, conn = pair(config=Config(send_queue_limit=10, drain_low_water=5))
    with pytest.raises(MessageTooLarge):
        conn.send(bytes(conn.max_datagram_payload + 1), reliable=False)
    conn.send(bytes(conn.max_datagram_payload), reliable=False)
    with pytest.raises(LocalProtocolError):
        conn.send(b"x", channel=32)
    with pytest.raises(TypeError):
        conn.send("text")  # type: ignore[arg-type]
    for _ in range(9):
        conn.send(b"x")
    with pytest.raises(SendQueueFull):
        conn.send(b"x")
    with pytest.raises(LocalProtocolError):
        conn.close(net.now, code=70000)
    with pytest.raises(LocalProtocolError):
        client.endpoint.connect(SERVER, net.now)


@pytest.mark.parametrize("code", [1.5, "1", None])
def test_a_close_code_that_is_not_an_int_is_refused_before_the_state_changes(code: object) -> None:
    # A float passed the range check, the state turned CLOSING, and building the
    # DISCONNECT failed: the connection never ended, and every later datagram failed.
    # (Compiled, the call itself refuses a non-int, in mypyc's words.)
    net, _, _, conn = pair()
    with pytest.raises(TypeError, match=r"^close code must be an int, not |int object expected"):
        conn.close(net.now, code=code)  # type: ignore[arg-type]
    assert conn.state is State.CONNECTED
    conn.close(net.now, code=7)
    net.run_until(lambda: conn.state is State.CLOSED)
    assert conn.close_reason is not None and conn.close_reason.code == 7


@pytest.mark.skipif(rudp.compiled, reason="compiled, mypyc takes a bool for an int at the call")
def test_a_bool_channel_or_close_code_is_a_type_error_and_changes_nothing() -> None:
    # A bool is an int: channel=True went out on channel 1, close(code=True) as code 1.
    net, _, _, conn = pair()
    for channel in (True, False):
        with pytest.raises(TypeError, match=r"^channel must be an int, not bool$"):
            conn.send(b"x", channel=channel)
        with pytest.raises(TypeError, match=r"^channel must be an int, not bool$"):
            conn.send(b"x", reliable=False, channel=channel, now=net.now)
    assert conn.queued == 0
    with pytest.raises(TypeError, match=r"^close code must be an int, not bool: True$"):
        conn.close(net.now, code=True)
    assert conn.state is State.CONNECTED


def test_a_message_needing_more_fragments_than_the_send_queue_holds_is_too_large() -> None:
    # It raised SendQueueFull on an empty queue: drain() returned at once and the
    # documented drain-and-retry loop never ended.
    net, _, _, conn = pair(config=Config(send_queue_limit=20))
    size = 30 * conn.max_datagram_payload
    with pytest.raises(MessageTooLarge, match=r"the send queue holds 20 messages"):
        conn.send(bytes(size))
    assert conn.queued == 0
    conn.send(bytes(10 * conn.max_datagram_payload))  # what fits still goes
    assert conn.queued > 0


def test_acked_event_only_for_messages_that_asked() -> None:
    net, server, client, conn = pair()
    quiet = conn.send(b"a")
    loud = conn.send(b"b")
    loud.notify = True
    net.run(1)
    acked = [e.handle for _, e in client.events if isinstance(e, MessageAcked)]
    assert acked == [loud]
    assert quiet.acked and loud.acked


def test_receive_buffer_is_bounded_and_drops_whole_packets() -> None:
    cfg = Config(recv_buffer_bytes=4000, window=64)
    net, server, client, conn = pair(Link(delay=0.01), config=cfg)
    sconn = server_conn(server)
    # Forge early messages far ahead on channel 0 straight into the server core.
    for i in range(1, 20):
        frame = frames.message_frame(1, 0, i * 10, bytes(1000))
        packet = conn.seal_datagram(wire.ack_fields(0, 0) + frame)  # the client's real keys
        server.endpoint.receive_datagram(packet, CLIENT, net.now)
    assert sconn._receiver.buffered_bytes <= 4000
    assert server.endpoint.stats.dropped[DropReason.RECV_BUFFER_FULL] > 0


def test_illegal_state_transition_raises_and_keeps_the_state() -> None:
    net, server, client, conn = pair()
    with pytest.raises(LocalProtocolError):
        conn._set_state(State.CONNECTING)
    assert conn.state is State.CONNECTED


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_datagram_size"):
        Config(max_datagram_size=100)
    with pytest.raises(ValueError, match="keepalive_interval"):
        Config(keepalive_interval=20.0, idle_timeout=10.0)
    with pytest.raises(ValueError, match="rto"):
        Config(rto_min=1.0, rto_initial=0.5)
    assert dataclasses.replace(Config(), window=8).window == 8


@pytest.mark.parametrize("reliable", ["no", "", 0, 1, None, b"x"])
def test_a_reliable_that_is_not_a_bool_is_a_type_error_and_sends_nothing(reliable: object) -> None:
    net, server, client, conn = pair()
    sent = conn.stats.messages_sent
    # Compiled (mypyc), the call itself refuses a non-bool, in mypyc's words.
    with pytest.raises(TypeError, match=r"reliable must be True or False|bool object expected"):
        conn.send(b"x", reliable=reliable)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"reliable must be True or False|bool object expected"):
        conn.send(b"x", reliable=reliable, now=net.now)  # type: ignore[arg-type]
    assert conn.queued == 0 and conn.stats.messages_sent == sent
    conn.send(b"x", reliable=True)
    conn.send(b"x", reliable=False, now=net.now)


def _numeric_fields() -> list[tuple[str, str]]:
    kinds = {"int": "an int", "int | None": "an int or None", "float": r"a number \(int or float\)"}
    return [(f.name, kinds[f.type]) for f in dataclasses.fields(Config) if f.type in kinds]


def test_derived_sizes_follow_the_fields_of_each_config() -> None:
    # Worked out once per Config (every connection reads them as it starts); a
    # Config made by replace() from another must not keep the other's values.
    small = Config(max_datagram_size=600, send_queue_limit=400)
    base = Config()
    for cfg in (small, base, dataclasses.replace(small, max_datagram_size=1400)):
        assert cfg.base_datagram_size == min(1200, cfg.max_datagram_size)
        assert cfg.fragment_payload == cfg.base_datagram_size - frames.FRAGMENT_FRAME_OVERHEAD
        assert cfg.max_fragments == -(-cfg.max_message_size // cfg.fragment_payload) + 1
    assert small.drain_threshold == 100
    assert dataclasses.replace(small, drain_low_water=7).drain_threshold == 7
    assert base.base_datagram_size == 1200 and small.base_datagram_size == 600


@pytest.mark.parametrize(("name", "kind"), _numeric_fields())
@pytest.mark.parametrize("wrong", ["5", b"5", [5], True])
def test_a_numeric_config_field_given_no_number_is_a_type_error_naming_it(
    name: str, kind: str, wrong: object
) -> None:
    message = rf"Config\.{name} takes {kind}, not {re.escape(repr(wrong))}$"
    with pytest.raises(TypeError, match=message):
        Config(**{name: wrong})  # type: ignore[arg-type]


def test_every_numeric_config_field_is_checked_and_numbers_still_pass() -> None:
    names = {name for name, _ in _numeric_fields()}
    assert {"idle_timeout", "window", "drain_low_water", "max_ack_delay"} <= names
    assert len(names) >= 36
    with pytest.raises(TypeError, match=r"Config\.window takes an int, not 1\.5"):
        Config(window=1.5)  # type: ignore[arg-type]
    config = Config(idle_timeout=20, rto_max=3, window=64, drain_low_water=None)
    assert (config.idle_timeout, config.rto_max, config.window) == (20, 3, 64)
