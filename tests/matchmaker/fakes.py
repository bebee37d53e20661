"""Test doubles: a stepped clock and an in-memory connection pair shaped like rudp's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import rudp
from matchmaker.messages import Message, decode, encode


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Received:
    data: bytes


class FakeConnection:
    """One end of an in-memory, reliable, ordered link.

    `send` delivers to the other end at once.  Its return value is a future
    for the peer's acknowledgement: resolved at once unless `manual_acks`,
    in which case the test resolves `unacked` futures itself.
    """

    def __init__(self, local: tuple[str, int], remote: tuple[str, int]) -> None:
        self.local_address = local
        self.remote_address = remote
        self.other: FakeConnection | None = None
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closed = False
        self.manual_acks = False
        self.unacked: list[asyncio.Future[None]] = []
        self.fail_sends = False
        self.sent = 0

    def send(self, data: bytes, *, reliable: bool = True, channel: int = 0) -> Awaitable[None]:
        if self.closed or self.fail_sends:
            raise rudp.ConnectionClosed("closed")
        assert self.other is not None
        self.sent += 1
        self.other.inbox.put_nowait(bytes(data))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.manual_acks:
            self.unacked.append(future)
        else:
            future.set_result(None)
        return future

    def __aiter__(self) -> AsyncIterator[Received]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Received]:
        while True:
            data = await self.inbox.get()
            if data is None:
                return
            yield Received(data)

    async def close(self, code: int = 0, text: str = "", *, reason: str | None = None) -> None:
        self.abort()

    def abort(self) -> None:
        """End both directions at once (like an idle timeout on both sides)."""
        for end in (self, self.other):
            if end is not None and not end.closed:
                end.closed = True
                end.inbox.put_nowait(None)
                for f in end.unacked:
                    if not f.done():
                        f.set_exception(rudp.ConnectionClosed("closed"))
                        f.exception()


def pipe(
    client: tuple[str, int], server: tuple[str, int] = ("203.0.113.1", 27950)
) -> tuple[FakeConnection, FakeConnection]:
    """(server side, client side) of one connection from `client` to `server`."""
    server_side = FakeConnection(server, client)
    client_side = FakeConnection(client, server)
    server_side.other, client_side.other = client_side, server_side
    return server_side, client_side


class Wire:
    """A test's view of one client connection to a service: send requests, read replies."""

    def __init__(self, conn: FakeConnection, task: asyncio.Task[None]) -> None:
        self.conn = conn
        self.task = task

    def send(self, msg: Message) -> None:
        self.conn.send(encode(msg))

    def send_raw(self, data: bytes) -> None:
        self.conn.send(data)

    async def recv(self, timeout: float = 2.0) -> Message:
        data = await asyncio.wait_for(self.conn.inbox.get(), timeout)
        assert data is not None, "connection closed"
        return decode(data)

    def pending(self) -> int:
        return self.conn.inbox.qsize()

    async def request(self, msg: Message) -> Message:
        self.send(msg)
        return await self.recv()

    async def close(self) -> None:
        self.conn.abort()
        await asyncio.wait_for(self.task, 2.0)


Handler = Callable[[Any], Coroutine[Any, Any, None]]


def attach(handler: Handler, address: tuple[str, int]) -> Wire:
    """Open a fake connection from `address` served by `handler`."""
    server_side, client_side = pipe(address)
    task = asyncio.create_task(handler(server_side))
    return Wire(client_side, task)


async def settle() -> None:
    """Let every ready task run (a few loop turns; no wall-clock wait)."""
    for _ in range(20):
        await asyncio.sleep(0)
