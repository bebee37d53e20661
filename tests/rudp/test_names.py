"""Names that say what they are: a received message tells its delivery mode, the
public objects print something useful, old spellings warn and still work."""

from __future__ import annotations

import asyncio
import copy
import pickle

import pytest

import rudp
from rudp import Delivery
from rudp.events import MessageReceived
from tests.rudp.harness import Link, pair


async def hold(conn: rudp.Connection) -> None:
    await conn.wait_closed()


MODES = [
    Delivery.UNRELIABLE,
    Delivery.RELIABLE_ORDERED,
    Delivery.UNRELIABLE_SEQUENCED,
    Delivery.RELIABLE_UNORDERED,
    Delivery.RELIABLE_SEQUENCED,
]


def test_a_received_message_tells_its_delivery_mode_on_every_path() -> None:
    # Loss and reordering: in-order, buffered and reassembled deliveries all happen.
    link = Link(loss=0.2, reorder=0.2, delay=0.01, jitter=0.005)
    net, server, _, conn = pair(link, seed=4)
    sent: dict[bytes, Delivery] = {}
    for i in range(200):
        for channel, mode in enumerate(MODES):
            size = 3000 if i % 7 == 0 and mode not in (0, 2) else 20
            data = bytes([channel, i]) + bytes(size - 2)
            conn.send(data, channel=channel, delivery=mode)
            sent[data] = mode
        if i % 10 == 0:
            net.run(0.05)
    spawn = conn.send(b"spawn", delivery=Delivery.RELIABLE_UNORDERED)
    conn.send(b"kill", depends_on=[spawn])
    sent[b"spawn"] = sent[b"kill"] = Delivery.RELIABLE_UNORDERED  # one mode on the wire
    net.run(30)
    got = [e for _, e in server.events if isinstance(e, MessageReceived)]
    assert {m.delivery for m in got} == set(MODES)
    assert any(len(m.data) == 3000 for m in got if m.delivery is Delivery.RELIABLE_ORDERED)
    for message in got:
        assert message.delivery is sent[message.data], message
        assert message.reliable == (message.delivery not in (0, 2))


def test_a_message_built_the_old_way_is_reliable_ordered_or_unreliable() -> None:
    assert MessageReceived(b"x", 0, True).delivery is Delivery.RELIABLE_ORDERED
    assert MessageReceived(b"x", 0, False).delivery is Delivery.UNRELIABLE
    match MessageReceived(b"x", 2, True, Delivery.RELIABLE_SEQUENCED):
        case MessageReceived(data, channel, reliable, Delivery.RELIABLE_SEQUENCED):
            assert (data, channel, reliable) == (b"x", 2, True)
        case _:
            pytest.fail("no match")


@pytest.mark.parametrize("mode", MODES)
def test_a_message_copies_pickles_compares_and_prints_with_its_mode(mode: Delivery) -> None:
    message = MessageReceived(b"hi", 3, mode not in (0, 2), mode)
    assert pickle.loads(pickle.dumps(message)) == message == copy.copy(message)
    assert copy.copy(message).delivery is mode
    assert message != MessageReceived(b"hi", 3, message.reliable, (mode + 1) % 5)
    assert repr(message) == (
        f"MessageReceived(data=b'hi', channel=3, reliable={message.reliable}, "
        f"delivery=Delivery.{mode.name})"
    )


# -- reprs ----------------------------------------------------------------------------------


async def test_the_public_objects_print_what_they_are() -> None:
    async with await rudp.serve(hold, "127.0.0.1", 0) as server:
        port = server.address[1]
        assert repr(server) == f"<rudp.Endpoint 127.0.0.1:{port} accepting, 0 connections>"
        assert type(server) is rudp.Endpoint is rudp.Server
        conn = await asyncio.wait_for(rudp.connect(*server.address), 5)
        handle = conn.send(b"spawn", delivery=rudp.Delivery.RELIABLE_UNORDERED, channel=2)
        assert repr(handle) == "<rudp.SendHandle RELIABLE_UNORDERED channel=2 seq=0 5 bytes queued>"
        await asyncio.wait_for(handle, 5)
        assert repr(handle).endswith(" acked>")
        await asyncio.sleep(0)
        assert repr(server) == f"<rudp.Endpoint 127.0.0.1:{port} accepting, 1 connections>"
        assert "datagrams_received=" in repr(server.stats)
        assert repr(conn) == f"<rudp.Connection 127.0.0.1:{port} connected>"
        # Inside an error message too: a handle of another connection.
        other = await asyncio.wait_for(rudp.connect(*server.address), 5)
        with pytest.raises(rudp.LocalProtocolError, match=r"got <rudp.SendHandle RELIABLE_"):
            other.send(b"kill", depends_on=[handle])
        await asyncio.wait_for(asyncio.gather(conn.close(), other.close()), 5)
    assert repr(server) == f"<rudp.Endpoint 127.0.0.1:{port} closed>"
    out = await rudp.open_endpoint("127.0.0.1")
    async with out:
        assert repr(out).endswith(" connecting out>")


async def test_every_public_object_has_a_repr_of_its_own() -> None:
    from rudp.a2s import Responder as A2sResponder
    from rudp.a2s import ServerInfo
    from rudp.lan.aio import serve_discovery
    from rudp.lockstep import LockstepClient, LockstepHost
    from rudp.metrics import RudpCollector
    from rudp.netsim.conditioner import LinkProfile
    from rudp.netsim.proxy import start_proxy

    responder = await serve_discovery({"x": 1}, 0, game="g", host="127.0.0.1", ipv6=False)
    proxy = await start_proxy(
        ("127.0.0.1", 0), ("127.0.0.1", 9), upstream=LinkProfile(), downstream=LinkProfile()
    )
    objects = [
        responder,
        proxy,
        A2sResponder(ServerInfo(name="n"), key=bytes(16)),
        LockstepHost[object](),
        LockstepClient(name="ann"),
        RudpCollector(registry=None),
        rudp.EndpointStats(),
        rudp.ConnectionStats(),
    ]
    try:
        for obj in objects:
            text = repr(obj)
            assert " object at 0x" not in text, text
            assert type(obj).__name__ in text, text
        assert "game='g' 127.0.0.1:" in repr(responder)
        assert "-> 127.0.0.1:9" in repr(proxy)
        assert "'ann' joining" in repr(LockstepClient(name="ann"))
        _, server, client, _ = pair()
        assert repr(server.endpoint) == "<rudp.endpoint.Endpoint accepting, 1 connections>"
        assert repr(client.endpoint) == "<rudp.endpoint.Endpoint connecting out, 1 connections>"
    finally:
        responder.close()
        await proxy.close()


def test_rudp_message_is_the_old_name_of_message_received() -> None:
    import rudp.aio

    with pytest.warns(DeprecationWarning, match="rudp.MessageReceived"):
        assert rudp.Message is MessageReceived  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="rudp.MessageReceived"):
        assert rudp.aio.Message is MessageReceived  # type: ignore[attr-defined]
    assert rudp.MessageReceived is MessageReceived
    with pytest.raises(AttributeError):
        rudp.aio.Nothing  # type: ignore[attr-defined]  # noqa: B018
