"""A reader that stops reading under a flood: what the receiver holds, and who waits.

The sender floods 64 B reliable messages for ``--seconds`` (send until
``SendQueueFull``, then ``drain()``); the receiving handler does not read for
``--stall`` seconds, then reads everything. Sampled every 10 ms: the peak of the
receiver's unread queue (messages, and bytes of payload) and of the sender's own
queue. The baseline, in the same run, is asyncio TCP streams with the same
length-prefixed messages: ``StreamReader``'s own buffer plus the kernel's receive
queue (``FIONREAD``) on the reading side, the transport's write buffer on the other.

    python bench/slow_reader.py [--seconds 4] [--stall 3] [--uvloop]

Both sides share one process and loop (no throughput is measured here).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import socket
import struct
import termios
import time
from typing import Any

import rudp

SIZE = 64
PREFIX = struct.Struct("!I")


async def _sample(probe: Any, until: float, peaks: dict[str, int]) -> None:
    while time.monotonic() < until:
        for key, value in probe().items():
            peaks[key] = max(peaks.get(key, 0), value)
        await asyncio.sleep(0.01)


async def _flood_then_read(
    flood: Any, probe: Any, reading: asyncio.Event, end: float, stall: float
) -> dict[str, int]:
    """Run the flood until ``end``, let the reader start at ``end + stall``; the peaks."""
    peaks: dict[str, int] = {}
    sampler = asyncio.ensure_future(_sample(probe, end + stall, peaks))
    await asyncio.wait_for(flood(), end + stall + 10 - time.monotonic())
    await asyncio.sleep(max(0.0, end + stall - time.monotonic()))
    reading.set()
    await sampler
    return peaks


async def run_rudp(seconds: float, stall: float) -> dict[str, Any]:
    conns: list[rudp.Connection] = []
    got = 0
    reading = asyncio.Event()

    async def handler(conn: rudp.Connection) -> None:
        nonlocal got
        conns.append(conn)
        await reading.wait()
        async for _ in conn:
            got += 1

    async with await rudp.serve(handler, "127.0.0.1", 0) as server:
        conn = await rudp.connect(*server.address)
        payload = bytes(SIZE)
        sent = 0
        end = time.monotonic() + seconds

        async def flood() -> None:
            nonlocal sent
            while time.monotonic() < end:
                try:
                    for _ in range(1000):
                        conn.send(payload)
                        sent += 1
                except rudp.SendQueueFull:
                    pass
                if conn.queued <= 1000:
                    await asyncio.sleep(0)
                    continue
                try:  # a paused peer keeps the queue full: stop waiting at the end
                    await asyncio.wait_for(conn.drain(), max(0.0, end - time.monotonic()))
                except TimeoutError:
                    return

        def probe() -> dict[str, int]:
            inbox = len(conns[0]._inbox) if conns else 0
            return {
                "receiver_unread_messages": inbox,
                "receiver_unread_bytes": inbox * SIZE,
                "sender_queued_messages": conn.queued,
            }

        peaks = await _flood_then_read(flood, probe, reading, end, stall)
        await asyncio.wait_for(conn.drain(), 60)
        while got < sent - conn.queued:
            await asyncio.sleep(0.01)
        stats = conn.stats.as_dict()
        await conn.close()
    return {
        "protocol": "rudp",
        "sent": sent,
        "received": got,
        **peaks,
        "peer_pauses": stats.get("peer_pauses", "n/a"),
    }


async def run_tcp(seconds: float, stall: float) -> dict[str, Any]:
    got = 0
    readers: list[tuple[asyncio.StreamReader, socket.socket]] = []
    reading = asyncio.Event()
    finished = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal got
        readers.append((reader, writer.get_extra_info("socket")))
        await reading.wait()
        try:
            while True:
                (n,) = PREFIX.unpack(await reader.readexactly(4))
                await reader.readexactly(n)
                got += 1
        except asyncio.IncompleteReadError:
            pass
        writer.close()
        finished.set()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    frame = PREFIX.pack(SIZE) + bytes(SIZE)
    sent = 0
    end = time.monotonic() + seconds

    async def flood() -> None:
        nonlocal sent
        while time.monotonic() < end:
            for _ in range(1000):
                writer.write(frame)
                sent += 1
            try:
                await asyncio.wait_for(writer.drain(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                return

    def probe() -> dict[str, int]:
        if not readers:
            return {}
        stream, sock = readers[0]
        kernel = bytearray(4)
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, kernel)
        unread = len(stream._buffer) + int.from_bytes(kernel, "little")  # type: ignore[attr-defined]
        return {
            "receiver_unread_messages": unread // len(frame),
            "receiver_unread_bytes": unread // len(frame) * SIZE,
            "sender_queued_messages": writer.transport.get_write_buffer_size() // len(frame),
        }

    peaks = await _flood_then_read(flood, probe, reading, end, stall)
    writer.close()
    await writer.wait_closed()
    await asyncio.wait_for(finished.wait(), 60)
    server.close()
    await server.wait_closed()
    return {"protocol": "tcp", "sent": sent, "received": got, **peaks}


async def main(args: argparse.Namespace) -> None:
    rows = [
        await run_rudp(args.seconds, args.stall),
        await run_tcp(args.seconds, args.stall),
    ]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="how long the sender floods")
    parser.add_argument("--stall", type=float, default=3.0, help="how long the reader waits")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    rudp.run(main(args), use_uvloop=args.uvloop)
