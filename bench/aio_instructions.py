"""Instructions per message through the whole asyncio stack, for valgrind.

A client and a server ``rudp`` endpoint in one process and one event loop, talking
over loopback, in one of two patterns:

* ``stream``: the client sends N 64-byte (``--size``) reliable messages as ``bench/throughput.py``
  does (``await drain()`` every 256 sends), the server's handler takes them with
  ``recv()`` and ``recv_nowait()``;
* ``pingpong``: N round trips of one 64-byte message, as ``bench/latency.py`` does;
  with ``--receiver`` both sides take messages through ``Connection.set_receiver``
  instead of ``recv()`` (the ``rudp-cb`` case there).

It counts what wall-clock benchmarks on a shared machine cannot count steadily: the
user-space instructions of the core, the asyncio layer, the event loop and the
garbage collector together. Compare builds or commits with the difference of two
runs divided by N (the handshake and start-up cancel out):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/aio_instructions.py stream 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        python bench/aio_instructions.py stream 20000

``--uvloop`` runs it on uvloop. Resend timers are pushed out of the way (valgrind
runs the code some 50 times slower, so a loopback RTT no longer looks like one):
a run counts the protocol's work, not the resends that the slow-down would cause.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import rudp

SIZE = 64
DRAIN_EVERY = 256
# No resend, keepalive or timeout fires during a run under valgrind.
CONFIG = rudp.Config(
    rto_initial=30.0,
    rto_min=30.0,
    rto_max=60.0,
    keepalive_interval=60.0,
    idle_timeout=120.0,
)


async def stream(count: int) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handler(conn: rudp.Connection) -> None:
        got = 0
        with contextlib.suppress(rudp.ConnectionClosed):
            while got < count:
                await conn.recv()
                got += 1
                while got < count and conn.recv_nowait() is not None:
                    got += 1
        done.set_result(got)

    async with await rudp.serve(handler, "127.0.0.1", 0, config=CONFIG) as server:
        conn = await rudp.connect(*server.address, config=CONFIG)
        data = bytes(SIZE)
        handle = None
        for i in range(count):
            handle = conn.send(data)
            if not (i + 1) % DRAIN_EVERY:
                await conn.drain()
        if handle is not None:
            await handle
        if count:
            assert await done == count
        await conn.close()


async def pingpong(count: int) -> None:
    async def handler(conn: rudp.Connection) -> None:
        with contextlib.suppress(rudp.ConnectionClosed):
            async for msg in conn:
                conn.send(msg.data)

    async with await rudp.serve(handler, "127.0.0.1", 0, config=CONFIG) as server:
        conn = await rudp.connect(*server.address, config=CONFIG)
        data = bytes(SIZE)
        for _ in range(count):
            conn.send(data)
            await conn.recv()
        await conn.close()


async def pingpong_receiver(count: int) -> None:
    loop = asyncio.get_running_loop()

    async def handler(conn: rudp.Connection) -> None:
        send = conn.send
        conn.set_receiver(lambda msg: send(msg.data))
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0, config=CONFIG) as server:
        conn = await rudp.connect(*server.address, config=CONFIG)
        data = bytes(SIZE)
        waiter: asyncio.Future[None] | None = None

        def receiver(msg: rudp.MessageReceived) -> None:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

        conn.set_receiver(receiver)
        for _ in range(count):
            waiter = loop.create_future()
            conn.send(data)
            await waiter
        await conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pattern", choices=("stream", "pingpong"))
    parser.add_argument("count", type=int)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--receiver", action="store_true", help="pingpong with set_receiver")
    parser.add_argument("--size", type=int, default=64, help="message size in bytes (64)")
    args = parser.parse_args()
    global SIZE
    SIZE = args.size
    run = pingpong_receiver if args.receiver else pingpong
    if args.pattern == "stream":
        run = stream
    rudp.run(run(args.count), use_uvloop=args.uvloop)


if __name__ == "__main__":
    main()
