"""Latency: round-trip time of one message in flight, rudp vs raw UDP and asyncio TCP.

A client process sends one message, waits for the echo from the server process,
and repeats; p50/p99 are taken over the round trips after a warm-up. Each side also
reports its CPU time (user + system, ``time.process_time``) per round trip: on a
shared machine the CPU cost is a steadier signal than the wall-clock latency, and
with one message in flight the two sides' CPU is most of the round trip.

* ``rudp`` -- reliable ``conn.send()``; the server handler echoes with ``conn.send()``.
  The "1200 B" case sends ``conn.max_datagram_payload`` bytes (largest single-datagram payload).
* ``rudp-cb`` -- the same, but both sides take messages with ``conn.set_receiver``
  (a callback run in the socket's read callback) instead of ``await conn.recv()``.
* ``udp``  -- raw datagrams through ``asyncio.DatagramProtocol`` on both sides.
* ``tcp``  -- 4-byte length prefix per message, TCP_NODELAY, ``asyncio.Protocol``.

Run ``python bench/latency.py --help``.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _common import (
    HOST,
    LEN_PREFIX,
    CaseFailed,
    Result,
    Role,
    RoleContext,
    environment,
    format_table,
    loop_name,
    parse_loops,
    run_pair,
    set_udp_buffers,
    summarize_rtts,
    udp_socket,
    write_json,
)

import rudp

PROTOCOLS = ("udp", "tcp", "rudp", "rudp-cb")


# -- rudp --------------------------------------------------------------------------------


async def _rudp_server(
    ctx: RoleContext, handler: Callable[[rudp.Connection], Awaitable[None]]
) -> Result:
    server = await rudp.serve(handler, HOST, 0)
    ctx.ready(server.address[1])
    cpu = time.process_time()
    await ctx.stop
    cpu = time.process_time() - cpu
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.close(), 5.0)
    return {"cpu_s": cpu}


async def rudp_echo(ctx: RoleContext) -> Result:
    async def handler(conn: rudp.Connection) -> None:
        recv, send = conn.recv, conn.send
        with contextlib.suppress(rudp.ConnectionClosed):
            while True:
                send((await recv()).data)

    return await _rudp_server(ctx, handler)


async def rudp_ping(ctx: RoleContext) -> Result:
    p = ctx.params
    conn = await rudp.connect(HOST, p["port"])
    data = bytes(min(p["size"], conn.max_datagram_payload))
    send, recv = conn.send, conn.recv
    clock = time.perf_counter_ns
    rtts: list[int] = []
    cpu = 0.0
    for i in range(p["warmup"] + p["rounds"]):
        if i == p["warmup"]:
            cpu = time.process_time()
        start = clock()
        send(data)
        await recv()
        if i >= p["warmup"]:
            rtts.append(clock() - start)
    cpu = time.process_time() - cpu
    stats = conn.stats.as_dict()
    await conn.close()
    return {"payload": len(data), "rtts_ns": rtts, "cpu_s": cpu, "stats": stats}


async def rudp_cb_echo(ctx: RoleContext) -> Result:
    async def handler(conn: rudp.Connection) -> None:
        send = conn.send
        conn.set_receiver(lambda msg: send(msg.data))
        await conn.wait_closed()

    return await _rudp_server(ctx, handler)


async def rudp_cb_ping(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    conn = await rudp.connect(HOST, p["port"])
    data = bytes(min(p["size"], conn.max_datagram_payload))
    waiter: asyncio.Future[None] = loop.create_future()

    def receiver(msg: rudp.MessageReceived) -> None:
        if not waiter.done():
            waiter.set_result(None)

    conn.set_receiver(receiver)
    send = conn.send
    clock = time.perf_counter_ns
    rtts: list[int] = []
    cpu = 0.0
    for i in range(p["warmup"] + p["rounds"]):
        if i == p["warmup"]:
            cpu = time.process_time()
        waiter = loop.create_future()
        start = clock()
        send(data)
        await waiter
        if i >= p["warmup"]:
            rtts.append(clock() - start)
    cpu = time.process_time() - cpu
    stats = conn.stats.as_dict()
    await conn.close()
    return {"payload": len(data), "rtts_ns": rtts, "cpu_s": cpu, "stats": stats}


# -- raw UDP -----------------------------------------------------------------------------


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.transport.sendto(data, addr)


async def udp_echo(ctx: RoleContext) -> Result:
    loop = asyncio.get_running_loop()
    sock = udp_socket()
    transport, _ = await loop.create_datagram_endpoint(_UdpEcho, sock=sock)
    ctx.ready(sock.getsockname()[1])
    cpu = time.process_time()
    await ctx.stop
    cpu = time.process_time() - cpu
    transport.close()
    return {"cpu_s": cpu}


class _UdpClient(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[bytes] | None = None

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(data)


async def udp_ping(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    sock = udp_socket()
    set_udp_buffers(sock)
    sock.connect((HOST, p["port"]))
    transport, protocol = await loop.create_datagram_endpoint(_UdpClient, sock=sock)
    data = bytes(p["size"])
    clock = time.perf_counter_ns
    rtts: list[int] = []
    lost = 0
    cpu = 0.0
    for i in range(p["warmup"] + p["rounds"]):
        if i == p["warmup"]:
            cpu = time.process_time()
        protocol.waiter = loop.create_future()
        start = clock()
        transport.sendto(data)
        try:
            await asyncio.wait_for(protocol.waiter, 1.0)
        except TimeoutError:
            lost += 1
            continue
        if i >= p["warmup"]:
            rtts.append(clock() - start)
    cpu = time.process_time() - cpu
    transport.close()
    return {"payload": len(data), "rtts_ns": rtts, "lost": lost, "cpu_s": cpu}


# -- TCP ---------------------------------------------------------------------------------


class _TcpFramed(asyncio.Protocol, abc.ABC):
    """Length-prefixed framing; ``on_message`` gets each message's bytes."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import socket

        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        offset = 0
        end = len(buffer)
        while end - offset >= LEN_PREFIX:
            length = int.from_bytes(buffer[offset : offset + LEN_PREFIX], "big")
            stop = offset + LEN_PREFIX + length
            if stop > end:
                break
            self.on_message(bytes(buffer[offset + LEN_PREFIX : stop]))
            offset = stop
        if offset:
            del buffer[:offset]

    @abc.abstractmethod
    def on_message(self, message: bytes) -> None:
        """Handle one complete message."""


class _TcpEcho(_TcpFramed):
    def on_message(self, message: bytes) -> None:
        assert self.transport is not None
        self.transport.write(len(message).to_bytes(LEN_PREFIX, "big") + message)


class _TcpClient(_TcpFramed):
    waiter: asyncio.Future[bytes] | None = None

    def on_message(self, message: bytes) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(message)


async def tcp_echo(ctx: RoleContext) -> Result:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_TcpEcho, HOST, 0)
    ctx.ready(server.sockets[0].getsockname()[1])
    cpu = time.process_time()
    await ctx.stop
    cpu = time.process_time() - cpu
    server.close()
    return {"cpu_s": cpu}


async def tcp_ping(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(_TcpClient, HOST, p["port"])
    frame = p["size"].to_bytes(LEN_PREFIX, "big") + bytes(p["size"])
    clock = time.perf_counter_ns
    rtts: list[int] = []
    cpu = 0.0
    for i in range(p["warmup"] + p["rounds"]):
        if i == p["warmup"]:
            cpu = time.process_time()
        protocol.waiter = loop.create_future()
        start = clock()
        transport.write(frame)
        await protocol.waiter
        if i >= p["warmup"]:
            rtts.append(clock() - start)
    cpu = time.process_time() - cpu
    transport.close()
    return {"payload": p["size"], "rtts_ns": rtts, "cpu_s": cpu}


ROLES: dict[str, tuple[Role, Role]] = {
    "udp": (udp_echo, udp_ping),
    "tcp": (tcp_echo, tcp_ping),
    "rudp": (rudp_echo, rudp_ping),
    "rudp-cb": (rudp_cb_echo, rudp_cb_ping),
}


# -- driver ------------------------------------------------------------------------------


def run_case(
    protocol: str, size: int, use_uvloop: bool, rounds: int, warmup: int, pin: bool = False
) -> Result:
    server, client = ROLES[protocol]
    params = {"size": size, "rounds": rounds, "warmup": warmup}
    server_result, result = run_pair(
        server, client, params, use_uvloop=use_uvloop, timeout=60.0, pin=pin
    )
    row: Result = {
        "protocol": protocol,
        "loop": loop_name(use_uvloop),
        "size": size,
        "payload": result["payload"],
        **summarize_rtts(result["rtts_ns"]),
        # CPU per round trip: the client's over the measured round trips, the server's
        # over its whole run (warm-up included; it is idle, and costs nothing, otherwise).
        "client_cpu_us": 1e6 * result["cpu_s"] / rounds,
        "server_cpu_us": 1e6 * server_result["cpu_s"] / (rounds + warmup),
    }
    row["cpu_us"] = row["client_cpu_us"] + row["server_cpu_us"]
    for key in ("lost", "stats"):
        if key in result:
            row[key] = result[key]
    return row


def render(results: list[Result]) -> str:
    index = {(r["loop"], r["size"], r["protocol"]): r for r in results}
    rows = []
    for r in results:
        rudp_row = index.get((r["loop"], r["size"], "rudp"))
        p50_ratio = rudp_row["p50_us"] / r["p50_us"] if rudp_row else float("nan")
        p99_ratio = rudp_row["p99_us"] / r["p99_us"] if rudp_row else float("nan")
        cpu_ratio = rudp_row["cpu_us"] / r["cpu_us"] if rudp_row else float("nan")
        rows.append(
            [
                r["loop"],
                r["size"],
                r["protocol"],
                r["payload"],
                r["p50_us"],
                r["p99_us"],
                r["mean_us"],
                r["cpu_us"],
                p50_ratio,
                p99_ratio,
                cpu_ratio,
            ]
        )
    headers = [
        "loop",
        "size",
        "protocol",
        "payload B",
        "p50 us",
        "p99 us",
        "mean us",
        "cpu us/rt",
        "rudp/this p50",
        "rudp/this p99",
        "rudp/this cpu",
    ]
    return format_table(headers, rows)


def _best_row(rows: list[Result]) -> Result:
    """The run with the lowest p50 (noise only ever adds delay), every run's p50 and CPU
    attached."""
    row = dict(min(rows, key=lambda r: r["p50_us"]))
    row["p50s_us"] = [r["p50_us"] for r in rows]
    row["cpus_us"] = [r["cpu_us"] for r in rows]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer round trips (< 1 minute)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    parser.add_argument("--sizes", default="64,1200", help="payload sizes, comma-separated")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--rounds", type=int, help="measured round trips per case")
    parser.add_argument("--warmup", type=int, help="round trips before measuring")
    parser.add_argument(
        "--repeat", type=int, help="runs per case; the run with the best p50 is reported"
    )
    parser.add_argument(
        "--pin", action="store_true", help="server on the first CPU, client on the second"
    )
    parser.add_argument("--json", help="result file (default bench/results/latency-*.json)")
    args = parser.parse_args(argv)

    rounds = args.rounds or (1000 if args.quick else 5000)
    warmup = args.warmup or (200 if args.quick else 1000)
    repeat = args.repeat or (1 if args.quick else 2)
    env = environment()
    print(
        f"# latency  {env['date_utc']} UTC  python {env['python']}  cpus {env['cpu_count']}  "
        f"uvloop {env['uvloop']}  rudp {env['git']} ({env['rudp_build']})  "
        f"rounds {rounds} (+{warmup} warm-up)  repeat {repeat}",
        file=sys.stderr,
    )
    runs: dict[tuple[str, int, str], list[Result]] = {}
    for _ in range(repeat):
        for use_uvloop in parse_loops(args.loop):
            for size in [int(s) for s in args.sizes.split(",")]:
                for protocol in args.protocols.split(","):
                    try:
                        row = run_case(protocol, size, use_uvloop, rounds, warmup, args.pin)
                    except CaseFailed as exc:
                        print(f"{protocol} {size} {loop_name(use_uvloop)}: {exc}", file=sys.stderr)
                        continue
                    print(
                        f"  {row['loop']:7} {size:5} B {protocol:5} p50 {row['p50_us']:7.1f} us"
                        f"  p99 {row['p99_us']:7.1f} us  cpu/rt {row['client_cpu_us']:6.1f}"
                        f" + {row['server_cpu_us']:6.1f} us",
                        file=sys.stderr,
                    )
                    runs.setdefault((row["loop"], size, protocol), []).append(row)
    results = [_best_row(rows) for rows in runs.values()]
    print(render(results))
    path = write_json(
        "latency",
        {
            "environment": env,
            "args": vars(args),
            "rounds": rounds,
            "warmup": warmup,
            "repeat": repeat,
            "results": results,
        },
        args.json,
    )
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
