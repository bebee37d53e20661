"""The endpoint for loops without add_reader (Windows' Proactor): chosen when needed,
and A2S answers through it. test_aio.py runs whole through it too (see conftest.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

import rudp
from rudp.a2s import ServerInfo, serve_a2s
from rudp.aio.endpoint import AioEndpoint
from rudp.aio.protocol import reads_with_add_reader


async def echo(conn: rudp.Connection) -> None:
    async for msg in conn:
        conn.send(msg.data)


def refuse(*args: object) -> None:
    raise NotImplementedError  # what asyncio's Proactor loop does


async def test_add_reader_is_used_where_the_loop_has_it() -> None:
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        assert reads_with_add_reader(loop, sock)
    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        assert type(server.endpoint) is AioEndpoint and not server.datagram_protocol


async def test_without_add_reader_a_datagram_protocol_carries_rudp_and_a2s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(asyncio.get_running_loop(), "add_reader", refuse)
    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        assert server.datagram_protocol
        serve_a2s(server, ServerInfo(name="Arena"))
        conn = await rudp.connect(*server.address)
        conn.send(b"over the transport")
        assert (await asyncio.wait_for(conn.recv(), 5)).data == b"over the transport"
        a2s = pytest.importorskip("a2s")
        assert (await a2s.ainfo(server.address, timeout=5)).server_name == "Arena"
        await conn.close()
    # Closed: the port is free again at once.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(server.address)


async def test_send_errors_are_counted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(asyncio.get_running_loop(), "add_reader", refuse)
    server = await rudp.open_endpoint("127.0.0.1", 0)
    assert server.datagram_protocol and server._link is not None
    server._link.error_received(ConnectionRefusedError(111, "refused"))
    assert server.endpoint.send_errors == 1
    await server.close()
