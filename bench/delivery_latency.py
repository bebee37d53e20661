"""Delivery latency: one-way latency of every message of a game-like stream over a lossy link.

A sender process streams 200-byte messages, one per millisecond, to a receiver process; each
message carries its sequence number and the sender's ``time.monotonic()`` at the moment it was
handed to the transport, and the receiver subtracts that from its own ``time.monotonic()`` when
the application gets the message (CLOCK_MONOTONIC is one clock for every process on a machine).
p50 / p99 / max are taken over the messages after a warm-up, for every case in the same run:

* ``udp``            -- raw datagrams, unreliable: the floor (and the loss it leaves).
* ``tcp``            -- asyncio TCP, 4-byte length prefix, TCP_NODELAY (needs the TUN link).
* ``ordered``        -- rudp ``conn.send(data)``: reliable, ordered, channel 0.
* ``unordered``      -- rudp ``delivery=rudp.Delivery.RELIABLE_UNORDERED``.
* ``dependency``     -- rudp, 8 entities: message i depends on the previous message of entity
                        i % 8 (``depends_on=[handle]``).
  These three run with the default ``rudp.Config`` (``redundancy=2``).
* ``ordered-r0``, ``unordered-r0``, ``dependency-r0`` -- the same with ``Config(redundancy=0)``:
  retransmission alone, no redundant copies.
* ``ordered-r3`` -- reliable-ordered with ``Config(redundancy=3)``.
* ``ordered-parity``, ``unordered-parity`` -- with ``Config(parity=True)`` on both sides:
  REPAIR frames (parity over recent packets, ``rudp.parity``) instead of copies.

The *B/msg* column is the sender's ``bytes_sent`` over the messages it sent: every DATA
datagram's bytes (headers, copies, REPAIRs and resends included; the payload is 200 B).

Cases whose API this rudp lacks are skipped with a message.

The link (``--link``): ``tun`` (the default where possible) joins two network namespaces created
for the run with a userspace bridge (bench/_tunlink.py) that runs every IP packet through
``rudp.netsim``'s LinkConditioner, each direction with its own: 5 % loss, 20 +- 5 ms delay
(uniform jitter, so packets reorder). Every case, the kernel's TCP included, crosses the same
impaired path, and each case restarts the conditioners from the same seed. ``netsim`` (the
fallback when not root or without /dev/net/tun) impairs in-process on 127.0.0.1 instead: rudp
through ``Config(netsim=...)`` on both sides, udp through a ConditionedPipe in front of the
sender's socket; tcp is then skipped, as loopback TCP cannot be impaired without netem.

Run from the repository root:

    .venv/bin/python bench/delivery_latency.py            # 5,000 messages per case (~1.5 min)
    .venv/bin/python bench/delivery_latency.py --quick    # 2,000 messages per case
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import (
    LEN_PREFIX,
    CaseFailed,
    Result,
    Role,
    RoleContext,
    environment,
    format_table,
    loop_name,
    percentile,
    run_pair,
    set_udp_buffers,
    write_json,
)
from _tunlink import TunLink, enter_namespace, unavailable

import rudp
from rudp.netsim import ConditionedPipe, LinkProfile

SIZE = 200
INTERVAL = 0.001
ENTITIES = 8
HEADER = struct.Struct("!Id")
"""Start of every message: sequence number, sender's time.monotonic() when it was sent."""

LOOPBACK = "127.0.0.1"
START_TIMEOUT = 15.0  # for the connection and the first message
UDP_IDLE = 1.0  # the udp receiver stops this long after its last datagram
RELIABLE_IDLE = 5.0  # a reliable receiver gives up after this long without progress
LATE_MS = 100.0  # messages later than this are counted ("over 100 ms")
STALL_MS = 15.0
"""A case in which a process (sender, receiver, bridge) was late by more than this is measured
again (``--retries``), and the least stalled run kept; a stall left is noted under the table."""


# -- both ends ---------------------------------------------------------------------------------


def _join(ctx: RoleContext, role: str) -> None:
    """Enter this role's network namespace (TUN link) before any socket is made."""
    namespace = ctx.params[f"{role}_ns"]
    if namespace:
        enter_namespace(namespace)


async def _paced(p: dict[str, Any], send: Callable[[int, bytes], object]) -> Result:
    """Call ``send(seq, message)`` for every message, one per interval, each freshly stamped.

    The schedule is absolute (message ``seq`` is due ``seq * interval`` after the start), so a
    late wake-up does not slow the stream down; the stamp is the actual send time.
    """
    pad = bytes(p["size"] - HEADER.size)
    interval = p["interval"]
    pack = HEADER.pack
    clock = time.monotonic
    start = clock()
    worst_lag = 0.0
    for seq in range(p["total"]):
        due = start + seq * interval
        await asyncio.sleep(max(0.0, due - clock()))
        now = clock()
        worst_lag = max(worst_lag, now - due)
        send(seq, pack(seq, now) + pad)
    return {"send_seconds": clock() - start, "max_send_lag_ms": 1e3 * worst_lag}


class Arrivals:
    """The receiver's record: one latency per sequence number, plus ordering checks."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.latency: list[float | None] = [None] * total
        self.count = 0
        self.duplicates = 0
        self.out_of_order = 0  # delivered after a higher sequence number
        self.entity_out_of_order = 0  # ... after a higher one of the same entity (seq % 8)
        self._highest = -1
        self._entity_highest = [-1] * ENTITIES
        self.started = time.monotonic()
        self.last = 0.0
        self.max_loop_lag = 0.0  # the receiver's event loop was busy (or descheduled)

    def record(self, message: bytes) -> None:
        now = time.monotonic()
        seq, sent = HEADER.unpack_from(message)
        if self.latency[seq] is not None:
            self.duplicates += 1
            return
        self.latency[seq] = now - sent
        self.count += 1
        self.last = now
        if seq < self._highest:
            self.out_of_order += 1
        else:
            self._highest = seq
        entity = seq % ENTITIES
        if seq < self._entity_highest[entity]:
            self.entity_out_of_order += 1
        else:
            self._entity_highest[entity] = seq

    async def wait(self, idle: float, cap: float) -> str:
        """Return why receiving ended: "complete", "idle", "cap" or "no data"."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.02)
            now = time.monotonic()
            self.max_loop_lag = max(self.max_loop_lag, now - before - 0.02)
            if self.count == self.total:
                return "complete"
            if now - self.started > cap:
                return "cap"
            if self.count == 0:
                if now - self.started > START_TIMEOUT:
                    return "no data"
            elif now - self.last > idle:
                return "idle"

    def result(self, ended: str) -> Result:
        return {
            "latencies": self.latency,
            "received": self.count,
            "duplicates": self.duplicates,
            "out_of_order": self.out_of_order,
            "entity_out_of_order": self.entity_out_of_order,
            "max_recv_lag_ms": 1e3 * self.max_loop_lag,
            "ended": ended,
        }


# -- raw UDP -----------------------------------------------------------------------------------


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    set_udp_buffers(sock)
    return sock


class _UdpSender(asyncio.DatagramProtocol):
    """Learns the receiver's address from its hello datagrams."""

    def __init__(self, peer: asyncio.Future[Any]) -> None:
        self.peer = peer

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if not self.peer.done():
            self.peer.set_result(addr)


async def udp_sender(ctx: RoleContext) -> Result:
    _join(ctx, "server")
    p = ctx.params
    loop = asyncio.get_running_loop()
    sock = _udp_socket()
    sock.bind((p["host"], 0))
    peer_future: asyncio.Future[Any] = loop.create_future()
    transport, _ = await loop.create_datagram_endpoint(lambda: _UdpSender(peer_future), sock=sock)
    ctx.ready(sock.getsockname()[1])
    peer = await asyncio.wait_for(peer_future, START_TIMEOUT)
    pipe: ConditionedPipe[Any] | None = None
    if p["link"] == "netsim":
        pipe = conditioned = ConditionedPipe(loop, p["profile"], transport.sendto, seed=p["seed"])
        result = await _paced(p, lambda _, data: conditioned.send(data, peer))
    else:
        result = await _paced(p, lambda _, data: transport.sendto(data, peer))
    await ctx.stop
    if pipe is not None:
        result["netsim"] = asdict(pipe.stats)
        pipe.close()
    transport.close()
    return result


class _UdpReceiver(asyncio.DatagramProtocol):
    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        self.arrivals.record(data)


async def udp_receiver(ctx: RoleContext) -> Result:
    _join(ctx, "client")
    p = ctx.params
    loop = asyncio.get_running_loop()
    sock = _udp_socket()
    sock.connect((p["host"], p["port"]))
    arrivals = Arrivals(p["total"])
    transport, _ = await loop.create_datagram_endpoint(lambda: _UdpReceiver(arrivals), sock=sock)

    async def hello() -> None:  # until the stream starts: a hello can be lost too
        while arrivals.count == 0:
            transport.sendto(b"hello")
            await asyncio.sleep(0.1)

    hellos = asyncio.create_task(hello())
    ended = await arrivals.wait(UDP_IDLE, p["cap"])
    hellos.cancel()
    transport.close()
    return arrivals.result(ended)


# -- TCP ---------------------------------------------------------------------------------------


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _tcp_info(transport: asyncio.BaseTransport) -> Result:
    """A few fields of Linux's struct tcp_info for the sending socket."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return {}
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(raw) < 144:
        return {}
    fields = struct.unpack_from("8B24I", raw)[8:]  # the u8 head, then u32s up to total_retrans
    segs_out, segs_in = struct.unpack_from("2I", raw, 136)  # after four u64 counters
    return {
        "rto_ms": fields[0] / 1e3,
        "rtt_ms": fields[15] / 1e3,
        "rttvar_ms": fields[16] / 1e3,
        "snd_cwnd": fields[18],
        "total_retrans": fields[23],
        "segs_out": segs_out,
        "segs_in": segs_in,
    }


class _TcpSender(asyncio.Protocol):
    def __init__(self, connected: asyncio.Future[asyncio.Transport]) -> None:
        self.connected = connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)
        if not self.connected.done():
            self.connected.set_result(transport)  # type: ignore[arg-type]


async def tcp_sender(ctx: RoleContext) -> Result:
    _join(ctx, "server")
    p = ctx.params
    loop = asyncio.get_running_loop()
    connected: asyncio.Future[asyncio.Transport] = loop.create_future()
    server = await loop.create_server(lambda: _TcpSender(connected), p["host"], 0)
    ctx.ready(server.sockets[0].getsockname()[1])
    transport = await asyncio.wait_for(connected, START_TIMEOUT)
    prefix = p["size"].to_bytes(LEN_PREFIX, "big")
    result = await _paced(p, lambda _, data: transport.write(prefix + data))
    await ctx.stop
    result["tcp_info"] = _tcp_info(transport)
    transport.close()
    server.close()
    return result


class _TcpReceiver(asyncio.Protocol):
    """Length-prefixed framing; every complete message goes to ``arrivals``."""

    def __init__(self, arrivals: Arrivals) -> None:
        self.arrivals = arrivals
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        offset, end = 0, len(buffer)
        while end - offset >= LEN_PREFIX:
            stop = offset + LEN_PREFIX + int.from_bytes(buffer[offset : offset + LEN_PREFIX], "big")
            if stop > end:
                break
            self.arrivals.record(bytes(buffer[offset + LEN_PREFIX : stop]))
            offset = stop
        del buffer[:offset]


async def tcp_receiver(ctx: RoleContext) -> Result:
    _join(ctx, "client")
    p = ctx.params
    loop = asyncio.get_running_loop()
    arrivals = Arrivals(p["total"])
    transport, _ = await asyncio.wait_for(
        loop.create_connection(lambda: _TcpReceiver(arrivals), p["host"], p["port"]),
        START_TIMEOUT,
    )
    ended = await arrivals.wait(RELIABLE_IDLE, p["cap"])
    transport.close()
    return arrivals.result(ended)


# -- rudp --------------------------------------------------------------------------------------


def _rudp_config(p: dict[str, Any], seed_offset: int) -> rudp.Config:
    options: dict[str, Any] = {}
    if p["redundancy"] is not None:
        options["redundancy"] = p["redundancy"]
    if p.get("parity"):
        options["parity"] = True
    if p["link"] == "netsim":
        options["netsim"] = rudp.NetsimConfig(outbound=p["profile"], seed=p["seed"] + seed_offset)
    return rudp.Config(**options)


def _rudp_send(conn: rudp.Connection, mode: str) -> Callable[[int, bytes], object]:
    """The send call of a delivery mode, as ``send(seq, data)``."""
    if mode == "ordered":
        return lambda _, data: conn.send(data)
    if mode == "unordered":
        unordered = rudp.Delivery.RELIABLE_UNORDERED
        return lambda _, data: conn.send(data, delivery=unordered)
    if mode == "dependency":
        graph = rudp.Delivery.DEPENDENCY_ORDERED
        previous: list[rudp.SendHandle | None] = [None] * ENTITIES  # each entity's last handle

        def send(seq: int, data: bytes) -> object:
            entity = seq % ENTITIES
            before = previous[entity]
            previous[entity] = conn.send(
                data, delivery=graph, depends_on=[] if before is None else [before]
            )
            return previous[entity]

        return send
    raise ValueError(f"unknown rudp mode {mode!r}")


async def rudp_sender(ctx: RoleContext) -> Result:
    _join(ctx, "server")
    p = ctx.params
    outcome: Result = {}
    conns: list[rudp.Connection] = []

    async def handler(conn: rudp.Connection) -> None:
        conns.append(conn)
        try:
            outcome.update(await _paced(p, _rudp_send(conn, p["mode"])))
        except Exception as exc:  # reported to the parent below
            outcome["error"] = repr(exc)
        await ctx.stop  # stay connected (resends go on) until the receiver has finished

    server = await rudp.serve(handler, p["host"], 0, config=_rudp_config(p, 0))
    ctx.ready(server.address[1])
    await ctx.stop
    if conns:
        outcome["stats"] = conns[0].stats.as_dict()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.close(), 5.0)
    if "error" in outcome:
        raise RuntimeError(f"rudp sender failed: {outcome['error']}")
    return outcome


async def rudp_receiver(ctx: RoleContext) -> Result:
    _join(ctx, "client")
    p = ctx.params
    conn = await rudp.connect(p["host"], p["port"], config=_rudp_config(p, 1))
    arrivals = Arrivals(p["total"])

    async def read() -> None:
        recv, record = conn.recv, arrivals.record
        with contextlib.suppress(rudp.ConnectionClosed):
            while True:
                record((await recv()).data)

    reader = asyncio.create_task(read())
    ended = await arrivals.wait(RELIABLE_IDLE, p["cap"])
    reader.cancel()
    stats = conn.stats.as_dict()
    with contextlib.suppress(TimeoutError, rudp.RudpError):
        await asyncio.wait_for(conn.close(), 3.0)
    return {**arrivals.result(ended), "stats": stats}


# -- cases -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    protocol: str  # "udp", "tcp" or "rudp"
    mode: str = ""  # rudp delivery mode: "ordered", "unordered", "dependency"
    redundancy: int | None = None  # None: the Config default
    parity: bool = False  # Config(parity=True) on both sides


CASES = [
    Case("udp", "udp (unreliable)", "udp"),
    Case("tcp", "tcp", "tcp"),
    Case("ordered", "rudp reliable-ordered", "rudp", "ordered"),
    Case("unordered", "rudp reliable-unordered", "rudp", "unordered"),
    Case("dependency", "rudp dependency-ordered", "rudp", "dependency"),
    Case("ordered-r0", "rudp reliable-ordered, redundancy=0", "rudp", "ordered", 0),
    Case("unordered-r0", "rudp reliable-unordered, redundancy=0", "rudp", "unordered", 0),
    Case("dependency-r0", "rudp dependency-ordered, redundancy=0", "rudp", "dependency", 0),
    Case("ordered-r3", "rudp reliable-ordered, redundancy=3", "rudp", "ordered", 3),
    Case("ordered-parity", "rudp reliable-ordered, parity", "rudp", "ordered", parity=True),
    Case("unordered-parity", "rudp reliable-unordered, parity", "rudp", "unordered", parity=True),
]

ROLES: dict[str, tuple[Role, Role]] = {
    "udp": (udp_sender, udp_receiver),
    "tcp": (tcp_sender, tcp_receiver),
    "rudp": (rudp_sender, rudp_receiver),
}


def missing(case: Case, link: str, tun_problem: str | None) -> str | None:
    """Why ``case`` cannot run here, or None."""
    if case.protocol == "tcp" and link != "tun":
        return f"tcp needs the TUN link: {tun_problem or '--link netsim chosen'}"
    if case.mode == "unordered" and not hasattr(rudp.Delivery, "RELIABLE_UNORDERED"):
        return "this rudp has no rudp.Delivery.RELIABLE_UNORDERED"
    if case.mode == "dependency" and not (
        hasattr(rudp.Delivery, "DEPENDENCY_ORDERED")
        and "depends_on" in inspect.signature(rudp.Connection.send).parameters
    ):
        return "this rudp has no Delivery.DEPENDENCY_ORDERED / send(depends_on=...)"
    if case.redundancy is not None:
        try:
            rudp.Config(redundancy=case.redundancy)
        except TypeError:
            return "this rudp's Config has no redundancy field"
    return None


def summarize(case: Case, sender: Result, receiver: Result, warmup: int) -> Result:
    measured = receiver["latencies"][warmup:]
    values = sorted(1e3 * v for v in measured if v is not None)
    row: Result = {
        "case": case.key,
        "label": case.label,
        "sent": len(measured),
        "sent_total": len(receiver["latencies"]),  # warm-up included
        "delivered": len(values),
        "lost": len(measured) - len(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
        "p99_ms": percentile(values, 99),
        "max_ms": values[-1] if values else float("nan"),
        "mean_ms": sum(values) / len(values) if values else float("nan"),
        "over_100ms": sum(v > LATE_MS for v in values),
        "ended": receiver["ended"],
        "duplicates": receiver["duplicates"],
        "out_of_order": receiver["out_of_order"],
        "entity_out_of_order": receiver["entity_out_of_order"],
        "max_send_lag_ms": sender.get("max_send_lag_ms"),
        "max_recv_lag_ms": receiver["max_recv_lag_ms"],
        "latencies_ms": [None if v is None else round(1e3 * v, 3) for v in measured],
    }
    for key in ("tcp_info", "netsim"):
        if key in sender:
            row[key] = sender[key]
    if "stats" in sender:
        row["sender_stats"] = sender["stats"]
    if "stats" in receiver:
        row["receiver_stats"] = receiver["stats"]
    return row


def run_case(case: Case, params: dict[str, Any], use_uvloop: bool) -> Result:
    server, client = ROLES[case.protocol]
    params = {
        **params,
        "mode": case.mode,
        "redundancy": case.redundancy,
        "parity": case.parity,
    }
    sender, receiver = run_pair(
        server, client, params, use_uvloop=use_uvloop, timeout=params["cap"] + 30.0
    )
    return summarize(case, sender, receiver, params["warmup"])


def _bytes_per_message(row: Result) -> str:
    """What the rudp sender put on the wire per message it sent, headers included."""
    stats = row.get("sender_stats")
    if not stats or not row.get("sent_total"):
        return "-"
    return f"{stats['bytes_sent'] / row['sent_total']:.0f}"


def _recovery(row: Result) -> str:
    """The "lost / resent" cell: what the protocol lost or did to recover."""
    if row["case"] == "udp":
        return f"lost {row['lost']} ({100 * row['lost'] / max(1, row['sent']):.1f} %)"
    if "tcp_info" in row:
        info = row["tcp_info"]
        return f"retrans {info.get('total_retrans')} of {info.get('segs_out')} segs"
    stats = row.get("sender_stats")
    if not stats:
        return "-"
    dup = row.get("receiver_stats", {}).get("duplicate_messages", "-")
    text = (
        f"resent {stats['messages_resent']} (dup {dup}), pkts lost {stats['packets_lost']}"
        f"/{stats['eliciting_sent']}, RTO {stats['timeouts']}"
    )
    if row["lost"]:
        text = f"LOST {row['lost']}; " + text
    return text


def _link_drops(row: Result) -> str:
    link = row.get("link")
    if not link:
        netsim = row.get("netsim")
        return f"{netsim['dropped_loss']}/{netsim['sent']}" if netsim else "-"
    data, back = link["b->a"], link["a->b"]  # the sender is side b
    return f"{data['dropped_loss']}/{data['sent']}, {back['dropped_loss']}/{back['sent']}"


def stalls(row: Result) -> dict[str, float]:
    """The longest a process of the case was late (ms): a busy machine shows here."""
    found = {"sender": row["max_send_lag_ms"], "receiver": row["max_recv_lag_ms"]}
    if "link" in row:
        found["bridge"] = max(d["max_late_ms"] for d in row["link"].values())
    return found


def worst_stall(row: Result) -> float:
    return max(stalls(row).values())


def order_notes(results: list[Result]) -> list[str]:
    """Guarantees broken: reliable cases that lost messages, ordered ones out of order."""
    notes = []
    for row in results:
        if row["case"] == "udp":
            continue
        if row["lost"]:
            notes.append(f"{row['case']}: {row['lost']} messages never delivered ({row['ended']})")
        if row["case"].startswith("ordered") or row["case"] == "tcp":
            broken = row["out_of_order"]
        elif row["case"].startswith("dependency"):
            broken = row["entity_out_of_order"]
        else:
            broken = 0
        if broken:
            notes.append(f"{row['case']}: {broken} messages delivered out of order")
        if row["duplicates"]:
            notes.append(f"{row['case']}: {row['duplicates']} messages delivered twice")
    return notes


def stall_notes(results: list[Result]) -> list[str]:
    notes = []
    for row in results:
        late = {who: ms for who, ms in stalls(row).items() if ms > STALL_MS}
        if late:
            who = ", ".join(f"{name} {ms:.0f} ms" for name, ms in late.items())
            runs = len(row.get("attempts", [row]))
            kept = f", the least stalled of {runs} runs" if runs > 1 else ""
            notes.append(f"{row['case']}: a process was late by up to {who} (busy machine?){kept}")
    return notes


def render(results: list[Result]) -> str:
    index = {r["case"]: r for r in results}
    udp, tcp = index.get("udp"), index.get("tcp")

    def ratio(row: Result, base: Result | None, key: str) -> float:
        return row[key] / base[key] if base and base[key] else float("nan")

    rows = [
        [
            r["label"],
            r["p50_ms"],
            r["p99_ms"],
            r["max_ms"],
            f"{r['delivered']}/{r['sent']}",
            r["over_100ms"],
            _recovery(r),
            _bytes_per_message(r),
            _link_drops(r),
            ratio(r, udp, "p50_ms"),
            ratio(r, udp, "p99_ms"),
            ratio(r, tcp, "p50_ms"),
            ratio(r, tcp, "p99_ms"),
        ]
        for r in results
    ]
    headers = [
        "case",
        "p50 ms",
        "p99 ms",
        "max ms",
        "delivered",
        "> 100 ms",
        "lost / resent",
        "B/msg",
        "link drops data, back",
        "p50 / udp",
        "p99 / udp",
        "p50 / tcp",
        "p99 / tcp",
    ]
    return format_table(headers, rows)


def measure(
    case: Case,
    params: dict[str, Any],
    tun: TunLink | None,
    profile: LinkProfile,
    seed: int,
    use_uvloop: bool,
) -> Result:
    """One run of ``case``, from freshly seeded conditioners; progress on stderr."""
    if tun is not None:
        tun.reset(profile, seed)
    started = time.monotonic()
    row = run_case(case, params, use_uvloop)
    if tun is not None:
        row["link"] = tun.stats()
    row["seconds"] = time.monotonic() - started
    print(
        f"  {case.key:14} p50 {row['p50_ms']:6.1f}  p99 {row['p99_ms']:6.1f}  "
        f"max {row['max_ms']:6.1f} ms  delivered {row['delivered']}/{row['sent']}  "
        f"({row['ended']}, {row['seconds']:.0f} s; late up to "
        + ", ".join(f"{who} {ms:.1f}" for who, ms in stalls(row).items())
        + " ms)",
        file=sys.stderr,
    )
    return row


def _select_cases(value: str) -> list[Case]:
    by_key = {c.key: c for c in CASES}
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(by_key)}")
    return [by_key[k] for k in keys]


@contextlib.contextmanager
def _link(kind: str) -> Iterator[TunLink | None]:
    if kind != "tun":
        yield None
        return
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the namespaces are removed either way.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig in previous:
        signal.signal(sig, _raise_exit)
    try:
        with TunLink() as tun:
            yield tun
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,000 measured messages per case")
    parser.add_argument("--messages", type=int, help="measured messages per case (5,000)")
    parser.add_argument("--warmup", type=int, help="messages sent before measuring (500)")
    parser.add_argument("--cases", default=",".join(c.key for c in CASES))
    parser.add_argument(
        "--link",
        choices=["auto", "tun", "netsim"],
        default="auto",
        help="impairment: TUN bridge between namespaces, or rudp's in-process netsim",
    )
    parser.add_argument("--loss", type=float, default=0.05, help="loss each way")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="uniform +- jitter")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help=f"runs again a case in which a process stalled > {STALL_MS:g} ms (busy machine)",
    )
    parser.add_argument(
        "--json", help="result file (default bench/results/delivery_latency-*.json)"
    )
    args = parser.parse_args(argv)

    messages = args.messages or (2000 if args.quick else 5000)
    warmup = args.warmup if args.warmup is not None else (300 if args.quick else 500)
    use_uvloop = args.loop == "uvloop"
    profile = LinkProfile(loss=args.loss, latency=args.delay_ms / 1e3, jitter=args.jitter_ms / 1e3)
    tun_problem = unavailable()
    link = args.link
    if link == "auto":
        link = "netsim" if tun_problem else "tun"
    elif link == "tun" and tun_problem:
        raise SystemExit(f"--link tun: {tun_problem}")
    cases = _select_cases(args.cases)

    env = environment()
    env["rudp_path"] = str(Path(rudp.__file__).parent)  # PYTHONPATH may point at a snapshot
    link_text = (
        "TUN bridge between two network namespaces (every case, tcp included)"
        if link == "tun"
        else f"rudp in-process netsim on 127.0.0.1 (TUN link unavailable: {tun_problem})"
        if tun_problem
        else "rudp in-process netsim on 127.0.0.1"
    )
    print(
        f"# delivery_latency  {env['date_utc']} UTC  python {env['python']}  "
        f"cpus {env['cpu_count']}  rudp {env['git']} ({env['rudp_path']})  "
        f"loop {loop_name(use_uvloop)}\n"
        f"# {SIZE} B every {INTERVAL * 1e3:g} ms, {messages} measured after {warmup} warm-up; "
        f"each way: loss {args.loss:g}, {args.delay_ms:g} +- {args.jitter_ms:g} ms; "
        f"seed {args.seed}\n# link: {link_text}",
        file=sys.stderr,
    )
    total = warmup + messages
    params: dict[str, Any] = {
        "size": SIZE,
        "interval": INTERVAL,
        "total": total,
        "warmup": warmup,
        "cap": total * INTERVAL + 30.0,
        "profile": profile,
        "seed": args.seed,
        "link": link,
    }
    results: list[Result] = []
    skipped: dict[str, str] = {}
    with _link(link) as tun:
        if tun is not None:
            params.update(host=tun.b.address, server_ns=tun.b.namespace, client_ns=tun.a.namespace)
        else:
            params.update(host=LOOPBACK, server_ns=None, client_ns=None)
        for case in cases:
            reason = missing(case, link, tun_problem)
            if reason:
                print(f"  {case.key:14} skipped: {reason}", file=sys.stderr)
                skipped[case.key] = reason
                continue
            attempts: list[Result] = []
            for attempt in range(1 + args.retries):
                if attempt:
                    print(f"  {case.key:14} a process stalled: measuring again", file=sys.stderr)
                try:
                    attempts.append(measure(case, params, tun, profile, args.seed, use_uvloop))
                except CaseFailed as exc:
                    print(f"  {case.key:14} failed: {exc}", file=sys.stderr)
                    if not attempts:
                        skipped[case.key] = f"failed: {exc}"
                    break
                if worst_stall(attempts[-1]) <= STALL_MS:
                    break
            if attempts:
                row = min(attempts, key=worst_stall)
                row["attempts"] = [stalls(r) for r in attempts]
                results.append(row)

    print(f"link: {link_text}\n")
    print(render(results))
    notes = order_notes(results) + stall_notes(results)
    if notes:
        print("\n" + "\n".join(f"note: {note}" for note in notes))
    for key, reason in skipped.items():
        print(f"\n{key}: skipped ({reason})")
    path = write_json(
        "delivery_latency",
        {
            "environment": env,
            "args": vars(args),
            "link": link,
            "profile": asdict(profile),
            "messages": messages,
            "warmup": warmup,
            "skipped": skipped,
            "results": results,
        },
        args.json,
    )
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
