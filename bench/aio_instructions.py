"""Instructions per message through the whole asyncio stack, for valgrind.

A client and a server ``rudp`` endpoint in one process and one event loop, talking
over loopback, in one of two patterns:

* ``stream``: the client sends N 64-byte (``--size``) reliable messages as ``bench/throughput.py``
  does (``await drain()`` every 256 sends), the server's handler takes them with
  ``recv()`` and ``recv_nowait()``;
* ``pingpong``: N round trips of one 64-byte message, as ``bench/latency.py`` does;
  with ``--receiver`` both sides take messages through ``Connection.set_receiver``
  instead of ``recv()`` (the ``rudp-cb`` case there);
* ``tick``: N ticks of ``bench/game_server.py``'s game with ``--clients`` clients
  (64), each its own endpoint: every client sends a 32-byte reliable input, the
  server, once it has them all, a 200-byte unreliable snapshot to every client,
  all through ``set_receiver``. Divide by N x clients for the instructions per
  client-tick, server and clients together.

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
import dataclasses

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
# At 60 Hz an acknowledgment waits less than max_ack_delay for the next tick's
# datagram; slowed down 50 times, a tick outlasts 25 ms, and every acknowledgment
# would leave alone from a timer. The tick pattern keeps them riding, as in the game.
TICK_CONFIG = dataclasses.replace(CONFIG, max_ack_delay=1.0)


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


async def tick(count: int, clients: int) -> None:
    loop = asyncio.get_running_loop()
    conns: list[rudp.Connection] = []
    inputs = 0
    snapshots = 0
    all_in: asyncio.Future[None] = loop.create_future()
    all_out: asyncio.Future[None] = loop.create_future()

    def on_input(msg: rudp.MessageReceived) -> None:
        nonlocal inputs
        inputs += 1
        if inputs == clients and not all_in.done():
            all_in.set_result(None)

    def on_snapshot(msg: rudp.MessageReceived) -> None:
        nonlocal snapshots
        snapshots += 1
        if snapshots == clients and not all_out.done():
            all_out.set_result(None)

    async def handler(conn: rudp.Connection) -> None:
        conns.append(conn)
        conn.set_receiver(on_input)
        await conn.wait_closed()

    async with await rudp.serve(handler, "127.0.0.1", 0, config=TICK_CONFIG) as server:
        players = [await rudp.connect(*server.address, config=TICK_CONFIG) for _ in range(clients)]
        for player in players:
            player.set_receiver(on_snapshot)
        data, snapshot = bytes(32), bytes(200)
        for _ in range(count):
            inputs = snapshots = 0
            all_in, all_out = loop.create_future(), loop.create_future()
            for player in players:
                player.send(data)
            await all_in
            for conn in conns:
                conn.send(snapshot, reliable=False)
            await all_out
        for player in players:
            await player.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pattern", choices=("stream", "pingpong", "tick"))
    parser.add_argument("count", type=int)
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--receiver", action="store_true", help="pingpong with set_receiver")
    parser.add_argument("--size", type=int, default=64, help="message size in bytes (64)")
    parser.add_argument("--clients", type=int, default=64, help="tick: clients (64)")
    args = parser.parse_args()
    global SIZE
    SIZE = args.size
    run = pingpong_receiver if args.receiver else pingpong
    if args.pattern == "stream":
        run = stream
    if args.pattern == "tick":
        rudp.run(tick(args.count, args.clients), use_uvloop=args.uvloop)
        return
    rudp.run(run(args.count), use_uvloop=args.uvloop)


if __name__ == "__main__":
    main()
