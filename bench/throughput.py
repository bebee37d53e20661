"""Throughput: messages/s of rudp reliable messages vs raw UDP and asyncio TCP, on loopback.

A sender process pushes N messages as fast as the protocol allows; a receiver
process counts them and reports the rate from the first arrival to the last.

* ``rudp``      -- ``conn.send()`` (reliable, channel 0) respecting back-pressure:
  ``await conn.drain()`` every 256 sends and on ``SendQueueFull``; the sender's
  own clock stops when the last message is acknowledged. Every size is sent as
  asked: a message larger than one datagram is fragmented (since path MTU
  discovery, a 1200 B message is one datagram once the path has been probed).
* ``udp-proto`` -- raw datagrams from a tight ``sendto`` loop, received by a plain
  ``asyncio.DatagramProtocol`` (CPython's selector loop reads one datagram per
  loop iteration). UDP drops: the *delivered* rate and the loss are reported.
* ``udp-drain`` -- the same sender, received by an ``add_reader`` callback that
  drains up to 256 datagrams per readiness, as rudp's endpoint does.
* ``enet``      -- ENet (pyenet, C; installed separately): reliable packets on
  channel 0, the host serviced in a tight loop (``service(0)``) between batches of
  64 sends, keeping about 256 KiB queued ahead of what ENet has sent (its queue
  is unbounded); the sender stops adding at the cap and services until nothing
  is in transit. ENet's default MTU is 1,400 bytes.
* ``tcp``       -- asyncio streams-level TCP: 4-byte length prefix per message,
  TCP_NODELAY, ``transport.write()`` per message, honouring pause/resume_writing;
  the receiver parses every frame out into its own ``bytes``.

Every UDP socket (rudp's included) asks for 4 MiB SO_RCVBUF/SO_SNDBUF.

Run ``python bench/throughput.py --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from typing import Any

from _common import (
    HOST,
    LEN_PREFIX,
    ArrivalCounter,
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
    udp_socket,
    write_json,
)

import rudp

PROTOCOLS = ("udp-proto", "udp-drain", "tcp", "rudp")
DRAIN_EVERY = 256
MAX_DATAGRAMS_PER_READ = 256  # as rudp.Config.max_datagrams_per_read
ENET_QUEUE = 256 * 1024  # bytes the ENet sender keeps queued ahead of its socket


# -- rudp --------------------------------------------------------------------------------


async def rudp_receiver(ctx: RoleContext) -> Result:
    p = ctx.params
    # Reliable: the count ends when the sender closes after its last ack. Stalls (resend
    # timeouts, keepalive-clocked progress) are part of the measurement; only a long
    # stall, or the sender giving up on its last ack, ends the case early.
    counter = ArrivalCounter(p["count"], p["tail"] / 2, p["cap"] + p["tail"])
    conns: list[rudp.Connection] = []

    async def handler(conn: rudp.Connection) -> None:
        conns.append(conn)
        recv, nowait, add = conn.recv, conn.recv_nowait, counter.add
        with contextlib.suppress(rudp.ConnectionClosed):
            while True:
                await recv()
                n = 1
                try:
                    while nowait() is not None:
                        n += 1
                finally:  # the messages before the end count (nowait() then raises)
                    add(n)
        counter.finish()

    server = await rudp.serve(handler, HOST, 0, config=rudp.Config(**p["rudp_config"]))
    ctx.ready(server.address[1])
    ended = await counter.wait(ctx.stop)
    result = counter.result(ended)
    if conns:  # keep acknowledging until the sender has its last ack and closes
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conns[0].wait_closed(), 5.0)
        result["stats"] = conns[0].stats.as_dict()
    result["drops"] = {str(k.value): v for k, v in server.stats.dropped.items()}
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.close(), 5.0)
    return result


async def rudp_sender(ctx: RoleContext) -> Result:
    p = ctx.params
    conn = await rudp.connect(HOST, p["port"], config=rudp.Config(**p["rudp_config"]))
    size = p["size"]
    data = bytes(size)
    n, send, drain = p["count"], conn.send, conn.drain
    sent = queue_full = 0
    handle: rudp.SendHandle | None = None
    start = time.perf_counter()
    deadline = start + p["cap"]
    while sent < n:
        try:
            handle = send(data)
        except rudp.SendQueueFull:
            queue_full += 1
            await drain()
            continue
        sent += 1
        if not sent % DRAIN_EVERY:
            await drain()
            if time.perf_counter() > deadline:
                break
    last_acked = False
    if handle is not None:  # bounded: a stalled tail must not hold the whole run
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(handle, p["tail"])
            last_acked = True
    elapsed = time.perf_counter() - start
    stats = conn.stats.as_dict()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.close(), 1.0)
    return {
        "last_acked": last_acked,
        "sent": sent,
        "payload": size,
        "sender_elapsed": elapsed,
        "queue_full": queue_full,
        "stats": stats,
    }


# -- raw UDP -----------------------------------------------------------------------------


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    future: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        loop.remove_writer(fd)
        if not future.done():
            future.set_result(None)

    loop.add_writer(fd, ready)
    await future


async def udp_sender(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    sock = udp_socket()
    buffers = set_udp_buffers(sock)
    address = (HOST, p["port"])
    data = bytes(p["size"])
    sendto = sock.sendto
    n = p["count"]
    sent = blocked = 0
    start = time.perf_counter()
    deadline = start + p["cap"]
    while sent < n:
        try:
            sendto(data, address)
        except BlockingIOError:
            blocked += 1
            await _writable(loop, sock.fileno())
            continue
        sent += 1
        if not sent % 1024 and time.perf_counter() > deadline:
            break
    elapsed = time.perf_counter() - start
    sock.close()
    return {
        "sent": sent,
        "payload": p["size"],
        "sender_elapsed": elapsed,
        "blocked": blocked,
        "buffers": buffers,
    }


class _CountingDatagramProtocol(asyncio.DatagramProtocol):
    def __init__(self, counter: ArrivalCounter) -> None:
        self.add = counter.add

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.add(1)


async def udp_proto_receiver(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    counter = ArrivalCounter(p["count"], p["idle"], p["cap"] + 10.0)
    sock = udp_socket()
    buffers = set_udp_buffers(sock)
    transport, _ = await loop.create_datagram_endpoint(
        lambda: _CountingDatagramProtocol(counter), sock=sock
    )
    ctx.ready(sock.getsockname()[1])
    result = counter.result(await counter.wait(ctx.stop))
    transport.close()
    result["buffers"] = buffers
    return result


async def udp_drain_receiver(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    counter = ArrivalCounter(p["count"], p["idle"], p["cap"] + 10.0)
    sock = udp_socket()
    buffers = set_udp_buffers(sock)
    recvfrom, add = sock.recvfrom, counter.add

    def read_ready() -> None:
        n = 0
        for _ in range(MAX_DATAGRAMS_PER_READ):
            try:
                recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                break
            n += 1
        if n:
            add(n)

    loop.add_reader(sock.fileno(), read_ready)
    ctx.ready(sock.getsockname()[1])
    result = counter.result(await counter.wait(ctx.stop))
    loop.remove_reader(sock.fileno())
    sock.close()
    result["buffers"] = buffers
    return result


# -- ENet (pyenet) -------------------------------------------------------------------------


async def enet_receiver(ctx: RoleContext) -> Result:
    import enet  # type: ignore[import-not-found]  # pyenet ships no types

    p = ctx.params
    counter = ArrivalCounter(p["count"], p["idle"], p["cap"] + 10.0)
    host = enet.Host(enet.Address(HOST.encode(), 0), 1, 1, 0, 0)
    none, receive = enet.EVENT_TYPE_NONE, enet.EVENT_TYPE_RECEIVE
    ctx.ready(host.address.port)
    watchdog = asyncio.ensure_future(counter.wait(ctx.stop))
    add, service = counter.add, host.service
    while not watchdog.done():
        n = 0
        event = service(1)
        while event.type != none:
            if event.type == receive:
                n += 1
            event = service(0)
        if n:
            add(n)
        await asyncio.sleep(0)
    for _ in range(200):  # acknowledge what is still arriving while the sender ends
        service(1)
    return counter.result(watchdog.result())


async def enet_sender(ctx: RoleContext) -> Result:
    import enet

    p = ctx.params
    host = enet.Host(None, 1, 1, 0, 0)
    peer = host.connect(enet.Address(HOST.encode(), p["port"]), 1)
    none, connect = enet.EVENT_TYPE_NONE, enet.EVENT_TYPE_CONNECT
    deadline = time.perf_counter() + 5.0
    while host.service(10).type != connect:
        if time.perf_counter() > deadline:
            raise CaseFailed("ENet did not connect")
    data = bytes(p["size"])
    packet, reliable, send, service = (
        enet.Packet,
        enet.PACKET_FLAG_RELIABLE,
        peer.send,
        host.service,
    )
    n = p["count"]
    sent = 0
    # ENet queues without limit, and its service call walks the queue: keep about
    # ENET_QUEUE bytes of payload queued beyond the bytes it has sent (headers
    # included, so the estimate only errs towards sending on).
    per_message = p["size"]
    start = time.perf_counter()
    deadline = start + p["cap"]
    while sent < n:
        for _ in range(min(64, n - sent)):
            send(0, packet(data, reliable))
        sent += min(64, n - sent)
        while service(0).type != none:
            pass
        while sent * per_message - host.totalSentData > ENET_QUEUE:
            service(1)
        if not sent % 1024 and time.perf_counter() > deadline:
            break
    quiet = 0
    tail = time.perf_counter() + p["tail"]
    while quiet < 20 and time.perf_counter() < tail:  # until nothing is left in transit
        service(1)
        quiet = quiet + 1 if peer.reliableDataInTransit == 0 else 0
    elapsed = time.perf_counter() - start
    peer.disconnect()
    host.flush()
    return {"sent": sent, "payload": p["size"], "sender_elapsed": elapsed}


# -- TCP ---------------------------------------------------------------------------------


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TcpCounter(asyncio.Protocol):
    """Splits the stream into length-prefixed messages (each copied out, as an app would)."""

    def __init__(self, counter: ArrivalCounter) -> None:
        self.counter = counter
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        end = len(buffer)
        offset = n = 0
        while end - offset >= LEN_PREFIX:
            length = int.from_bytes(buffer[offset : offset + LEN_PREFIX], "big")
            stop = offset + LEN_PREFIX + length
            if stop > end:
                break
            _message = bytes(buffer[offset + LEN_PREFIX : stop])
            offset = stop
            n += 1
        if offset:
            del buffer[:offset]
        if n:
            self.counter.add(n)


async def tcp_receiver(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    counter = ArrivalCounter(p["count"], p["idle"], p["cap"] + 10.0)
    server = await loop.create_server(lambda: _TcpCounter(counter), HOST, 0)
    ctx.ready(server.sockets[0].getsockname()[1])
    result = counter.result(await counter.wait(ctx.stop))
    server.close()
    return result


class _TcpSender(asyncio.Protocol):
    def __init__(self) -> None:
        self.resumed: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)

    def pause_writing(self) -> None:
        self.resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self.resumed = None


async def tcp_sender(ctx: RoleContext) -> Result:
    p = ctx.params
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(_TcpSender, HOST, p["port"])
    frame = p["size"].to_bytes(LEN_PREFIX, "big") + bytes(p["size"])
    write = transport.write
    n = p["count"]
    sent = paused = 0
    start = time.perf_counter()
    deadline = start + p["cap"]
    while sent < n:
        write(frame)
        sent += 1
        if not sent % DRAIN_EVERY:
            if protocol.resumed is not None:
                paused += 1
                await protocol.resumed
            if time.perf_counter() > deadline:
                break
    while transport.get_write_buffer_size():
        await asyncio.sleep(0.0005)
    elapsed = time.perf_counter() - start
    transport.close()
    return {"sent": sent, "payload": p["size"], "sender_elapsed": elapsed, "paused": paused}


ROLES: dict[str, tuple[Role, Role]] = {
    "udp-proto": (udp_proto_receiver, udp_sender),
    "udp-drain": (udp_drain_receiver, udp_sender),
    "tcp": (tcp_receiver, tcp_sender),
    "rudp": (rudp_receiver, rudp_sender),
    "enet": (enet_receiver, enet_sender),
}


# -- driver ------------------------------------------------------------------------------


def run_case(
    protocol: str,
    size: int,
    use_uvloop: bool,
    count: int,
    cap: float,
    rudp_config: dict[str, Any] | None = None,
    profile_prefix: str | None = None,
    tail: float = 5.0,
) -> Result:
    """One case; ``tail`` bounds the rudp sender's wait for its last ack (seconds)."""
    receiver, sender = ROLES[protocol]
    params = {
        "size": size,
        "count": count,
        "cap": cap,
        "idle": 0.5,
        "tail": tail,
        "rudp_config": rudp_config or {},
    }
    rx, tx = run_pair(
        receiver,
        sender,
        params,
        use_uvloop=use_uvloop,
        timeout=cap + 30.0,
        profile_prefix=profile_prefix,
    )
    loss = 1.0 - rx["received"] / tx["sent"] if tx["sent"] else 0.0
    row: Result = {
        "protocol": protocol,
        "loop": loop_name(use_uvloop),
        "size": size,
        "payload": tx["payload"],
        "sent": tx["sent"],
        "received": rx["received"],
        "loss_pct": 100.0 * max(0.0, loss),
        "rate": rx["rate"],
        "elapsed": rx["elapsed"],
        "ended": rx["ended"],
        "recv_batches": rx["batches"],
        "sender_rate": tx["sent"] / tx["sender_elapsed"] if tx["sender_elapsed"] else 0.0,
        "receiver": rx,
        "sender": tx,
    }
    if protocol == "rudp":
        stats = tx["stats"]
        copies = stats["messages_sent"] + stats["messages_resent"]
        row["msgs_per_datagram"] = (
            copies / stats["eliciting_sent"] if stats["eliciting_sent"] else 0.0
        )
        row["resent_pct"] = 100.0 * stats["messages_resent"] / max(1, stats["messages_sent"])
    return row


def _best_row(rows: list[Result]) -> Result:
    """The run with the best receive rate (noise only ever slows a run down),
    with every run's rate attached."""
    row = dict(max(rows, key=lambda r: r["rate"]))
    row["rates"] = [r["rate"] for r in rows]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer messages (< 1 minute)")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both")
    parser.add_argument("--sizes", default="64,1200", help="payload sizes, comma-separated")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--count", type=int, help="messages per case (default by size)")
    parser.add_argument("--cap", type=float, help="seconds of sending per case at most")
    parser.add_argument("--repeat", type=int, help="runs per case; the best is reported")
    parser.add_argument(
        "--rudp-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a rudp.Config field on both sides (repeatable)",
    )
    parser.add_argument("--json", help="result file (default bench/results/throughput-*.json)")
    args = parser.parse_args(argv)

    sizes = [int(s) for s in args.sizes.split(",")]
    rudp_config = parse_config_overrides(args.rudp_config)
    protocols = args.protocols.split(",")
    repeat = args.repeat or (1 if args.quick else 2)
    cap = args.cap or (1.0 if args.quick else 2.0)
    env = environment()
    print(
        f"# throughput  {env['date_utc']} UTC  python {env['python']}  "
        f"cpus {env['cpu_count']}  uvloop {env['uvloop']}  "
        f"rudp {env['git']} ({env['rudp_build']})  repeat {repeat}",
        file=sys.stderr,
    )
    runs: dict[tuple[str, int, str], list[Result]] = {}
    for _ in range(repeat):
        for use_uvloop in parse_loops(args.loop):
            for size in sizes:
                count = args.count or _default_count(size, args.quick)
                for protocol in protocols:
                    try:
                        row = run_case(
                            protocol,
                            size,
                            use_uvloop,
                            count,
                            cap,
                            rudp_config,
                            tail=2.0 if args.quick else 5.0,
                        )
                    except CaseFailed as exc:
                        print(f"{protocol} {size} {loop_name(use_uvloop)}: {exc}", file=sys.stderr)
                        continue
                    print(
                        f"  {row['loop']:7} {size:5} B {protocol:9} {row['rate']:>10,.0f} msg/s"
                        f"  loss {row['loss_pct']:5.1f}%  ({row['ended']})",
                        file=sys.stderr,
                    )
                    runs.setdefault((row["loop"], size, protocol), []).append(row)

    results = [_best_row(rows) for rows in runs.values()]
    print(render(results))
    path = write_json(
        "throughput",
        {"environment": env, "args": vars(args), "repeat": repeat, "results": results},
        args.json,
    )
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def parse_config_overrides(items: list[str]) -> dict[str, Any]:
    """``["window=512", "rto_min=0.01"]`` -> keyword arguments for ``rudp.Config``."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        value: Any
        try:
            value = int(raw)
        except ValueError:
            value = float(raw)
        out[key.strip()] = value
    rudp.Config(**out)  # fail early on a bad name or value
    return out


def _default_count(size: int, quick: bool) -> int:
    count = 400_000 if size <= 256 else 200_000
    return count // 4 if quick else count


def render(results: list[Result]) -> str:
    """Absolute rates plus rudp's ratios to each baseline, per loop and size."""
    index = {(r["loop"], r["size"], r["protocol"]): r for r in results}
    rows = []
    for r in results:
        rudp_row = index.get((r["loop"], r["size"], "rudp"))
        ratio = rudp_row["rate"] / r["rate"] if rudp_row and r["rate"] else float("nan")
        rows.append(
            [
                r["loop"],
                r["size"],
                r["protocol"],
                r["payload"],
                r["rate"],
                r["receiver"]["peak_rate"],
                r["rate"] * r["payload"] / 1e6,
                r["loss_pct"],
                r["sender_rate"],
                r.get("msgs_per_datagram"),
                r.get("resent_pct"),
                ratio,
            ]
        )
    headers = [
        "loop",
        "size",
        "protocol",
        "payload B",
        "delivered msg/s",
        "peak msg/s",
        "MB/s",
        "loss %",
        "sender msg/s",
        "msgs/dgram",
        "resent %",
        "rudp / this",
    ]
    return format_table(headers, rows)


if __name__ == "__main__":
    sys.exit(main())
