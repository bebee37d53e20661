"""The processes of bench/game_server.py: one game server, or a group of clients.

Run by game_server.py, not by hand: ``python _game_roles.py ROLE PARAMS_JSON``,
ROLE one of ``{rudp,enet,udp,tcp}-{server,client}``. A process talks to its parent in
JSON lines: it prints ``{"event": "ready", "port": P}`` (servers, once bound),
``{"event": "connected"}`` (once every client of the process, or every client of the
server, is connected), then reads one line ``{"t0": T}`` on stdin, plays the ticks
(tick k at ``t0 + (k + phase) / hz``, on ``time.monotonic()``, one clock for every
process of the machine) and prints ``{"event": "result", ...}``. A server then waits
for its stdin to close, so that it outlives its clients.

The tick loop is the same for every transport:

* ticks 0 .. warmup-1 warm up; CPU time (``time.process_time()``: user + system of
  the whole process) and the counters are read when tick ``warmup`` is due and
  again when tick ``warmup + measured`` is due: that window is what is reported;
* a tick that starts late is played at once (ticks are never skipped, so that the
  delivery counts stay exact), and counted as late when it started more than one
  period after it was due;
* after the last tick, the process keeps receiving (and servicing its transport)
  until everything it expects has arrived or ``drain_cap`` seconds have passed.

Payloads: an input is 32 bytes (client id, tick, padding), sent reliably where the
transport can; a snapshot is 200 bytes (tick, padding), unreliable. Nothing here
imports rudp unless the role is a rudp one (the baselines run without it).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
UDP_BUFFER = 4 * 1024 * 1024  # as rudp's Config.socket_buffer_size
HEADER = struct.Struct("!II")  # inputs: client id, tick; snapshots: tick, 0
LEN_PREFIX = struct.Struct("!I")  # TCP framing
HELLO = b"hello"

Result = dict[str, Any]
Counters = dict[str, int]


# -- talking to the parent ----------------------------------------------------------------


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def read_start(poll: Callable[[], None] | None = None) -> float:
    """Block until the parent's start line, calling ``poll`` every 5 ms meanwhile."""
    fd = sys.stdin.fileno()
    data = b""
    while b"\n" not in data:
        readable, _, _ = select.select([fd], [], [], 0.005)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise SystemExit("parent went away")
            data += chunk
        elif poll is not None:
            poll()
    return float(json.loads(data.split(b"\n", 1)[0])["t0"])


def wait_for_eof() -> None:
    while os.read(sys.stdin.fileno(), 4096):
        pass


def input_payload(cid: int, tick: int, size: int) -> bytes:
    return HEADER.pack(cid, tick) + bytes(size - HEADER.size)


def snapshot_payload(tick: int, size: int) -> bytes:
    return HEADER.pack(tick, 0) + bytes(size - HEADER.size)


# -- the tick schedule --------------------------------------------------------------------


class Schedule:
    """When each tick is due, how late it started, and the measurement window."""

    def __init__(self, p: dict[str, Any], t0: float) -> None:
        self.t0 = t0
        self.period = 1.0 / float(p["hz"])
        self.phase = float(p["phase"])
        self.warmup = p["warmup"]
        self.measured = p["measured"]
        self.total = self.warmup + self.measured
        self.drain_cap = float(p["drain_cap"])
        self.lateness: list[float] = []  # of the measured ticks, seconds
        self.marks: list[dict[str, Any]] = []

    def due(self, tick: int) -> float:
        return self.t0 + (tick + self.phase) * self.period

    def started(self, tick: int, now: float) -> None:
        if self.warmup <= tick < self.total:
            self.lateness.append(now - self.due(tick))

    def mark(self, counters: Counters) -> None:
        """Read the clocks at a window boundary (the counters were read just before)."""
        self.marks.append({"cpu": time.process_time(), "wall": time.monotonic(), **counters})

    @property
    def deadline(self) -> float:
        return self.due(self.total) + self.drain_cap

    def result(self) -> Result:
        late = sorted(self.lateness)
        start, end = self.marks[0], self.marks[1]
        return {
            "cpu": end["cpu"] - start["cpu"],
            "wall": end["wall"] - start["wall"],
            "counters": {k: end[k] - start[k] for k in start if k not in ("cpu", "wall")},
            "ticks_late": sum(1 for x in late if x > self.period),
            "lateness_p50_ms": 1e3 * late[len(late) // 2] if late else 0.0,
            "lateness_p99_ms": 1e3 * late[min(len(late) - 1, int(len(late) * 0.99))]
            if late
            else 0.0,
            "lateness_max_ms": 1e3 * late[-1] if late else 0.0,
        }


def run_sync_ticks(
    sched: Schedule,
    tick: Callable[[int], None],
    service: Callable[[], None],
    counters: Callable[[], Counters],
    received: Inputs | Snapshots,
) -> None:
    """Play every tick on time (sleeping between them), then drain.

    ``tick(k)`` does tick k's work; ``service()`` is what the loop does once per tick
    period after the last tick (receive, and keep the transport's protocol going)."""
    for k in range(sched.total + 1):
        delay = sched.due(k) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if k in (sched.warmup, sched.total):
            sched.mark({**counters(), "received": received.total})
        if k == sched.total:
            break
        sched.started(k, time.monotonic())
        tick(k)
    while not received.done() and time.monotonic() < sched.deadline:
        service()
        time.sleep(sched.period)
    service()


async def run_async_ticks(
    sched: Schedule,
    tick: Callable[[int], None],
    counters: Callable[[], Counters],
    received: Inputs | Snapshots,
) -> None:
    """The same on an asyncio loop: the transport works between the ticks by itself."""
    for k in range(sched.total + 1):
        # Late or not, yield: what tick k queued is flushed before tick k + 1 runs.
        await asyncio.sleep(max(0.0, sched.due(k) - time.monotonic()))
        if k in (sched.warmup, sched.total):
            sched.mark({**counters(), "received": received.total})
        if k == sched.total:
            break
        sched.started(k, time.monotonic())
        tick(k)
    while not received.done() and time.monotonic() < sched.deadline:
        await asyncio.sleep(0.01)


class Inputs:
    """What a server received: inputs per client, and inputs out of order."""

    def __init__(self, n: int, expected: int) -> None:
        self.next = [0] * n
        self.count = [0] * n
        self.out_of_order = 0
        self.expected = expected
        self.total = 0

    def add(self, data: bytes) -> None:
        cid, tick = HEADER.unpack_from(data)
        if tick != self.next[cid]:
            self.out_of_order += 1
        self.next[cid] = tick + 1
        self.count[cid] += 1
        self.total += 1

    def done(self) -> bool:
        return self.total >= self.expected * len(self.count)

    def result(self) -> Result:
        return {
            "inputs_received": self.total,
            "inputs_expected": self.expected * len(self.count),
            "inputs_min_per_client": min(self.count),
            "inputs_out_of_order": self.out_of_order,
        }


class Snapshots:
    """What a group of clients received: snapshots per client, and repeats."""

    def __init__(self, cids: list[int], expected: int) -> None:
        self.count = dict.fromkeys(cids, 0)
        self.last = dict.fromkeys(cids, -1)
        self.repeated = 0
        self.expected = expected
        self.total = 0

    def add(self, cid: int, data: bytes) -> None:
        tick = HEADER.unpack_from(data)[0]
        if tick <= self.last[cid]:
            self.repeated += 1
        self.last[cid] = tick
        self.count[cid] += 1
        self.total += 1

    def done(self) -> bool:
        return self.total >= self.expected * len(self.count)

    def result(self) -> Result:
        return {
            "snapshots_received": self.total,
            "snapshots_expected": self.expected * len(self.count),
            "snapshots_min_per_client": min(self.count.values()),
            "snapshots_repeated_or_old": self.repeated,
        }


# -- rudp ---------------------------------------------------------------------------------


def _rudp_config(p: dict[str, Any], server: bool = False) -> Any:
    import rudp

    overrides = dict(p.get("rudp_config", {}))
    if server:
        overrides.update(p.get("rudp_server_config", {}))
    overrides.setdefault("max_connections", max(1024, p["n"]))
    return rudp.Config(**overrides)


def _rudp_build() -> Result:
    import rudp

    return {
        "compiled": bool(rudp.compiled),
        "version": rudp.__version__,
        "path": os.path.dirname(rudp.__file__ or ""),
    }


def _rudp_counter_names() -> tuple[str, ...]:
    try:
        from rudp.stats import COUNTERS
    except ImportError:  # an older or newer layout: count what is there
        return ()
    return tuple(COUNTERS)


def _sum_conn_stats(conns: list[Any], names: tuple[str, ...]) -> Counters:
    totals = dict.fromkeys(names, 0)
    for conn in conns:
        stats = conn.stats
        for name in names:
            totals[name] += getattr(stats, name, 0)
    return {f"conn.{k}": v for k, v in totals.items()}


async def rudp_server(p: dict[str, Any]) -> Result:
    import rudp

    n = p["n"]
    inputs = Inputs(n, p["warmup"] + p["measured"])
    conns: list[Any] = []
    all_in = asyncio.get_running_loop().create_future()

    async def handler(conn: Any) -> None:
        conns.append(conn)
        conn.set_receiver(lambda msg: inputs.add(msg.data))
        if len(conns) == n and not all_in.done():
            all_in.set_result(None)
        await conn.wait_closed()

    server = await rudp.serve(handler, HOST, 0, config=_rudp_config(p, server=True))
    emit(event="ready", port=server.address[1])
    await asyncio.wait_for(all_in, p["connect_timeout"])
    emit(event="connected")
    sched = Schedule(p, await _read_start_async())
    size = p["snapshot_size"]
    names = _rudp_counter_names()

    def tick(k: int) -> None:
        snapshot = snapshot_payload(k, size)
        for conn in conns:
            if not conn.closed:  # a client starved for idle_timeout is gone (counted below)
                conn.send(snapshot, reliable=False)

    def counters() -> Counters:
        st = server.stats
        return {
            "datagrams_in": st.datagrams_received,
            "datagrams_out": st.datagrams_sent,
            **_sum_conn_stats(conns, names),
        }

    await run_async_ticks(sched, tick, counters, inputs)
    totals = _sum_conn_stats(conns, names)
    lost = sum(1 for conn in conns if conn.closed)
    return {
        **sched.result(),
        **inputs.result(),
        "connections_lost": lost,
        "totals": totals,
        "build": _rudp_build(),
    }


async def rudp_clients(p: dict[str, Any]) -> Result:
    import rudp

    cids: list[int] = p["cids"]
    snaps = Snapshots(cids, p["warmup"] + p["measured"])
    config = _rudp_config(p)
    conns: list[Any] = []

    async def connect() -> Any:
        for attempt in range(5):
            try:
                return await rudp.connect(HOST, p["port"], config=config, local_addr=(HOST, 0))
            except OSError as exc:  # EADDRINUSE: other jobs holding thousands of UDP ports
                if exc.errno != errno.EADDRINUSE or attempt == 4:
                    raise
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    for start in range(0, len(cids), 64):  # at most 64 handshakes in flight
        batch = cids[start : start + 64]
        conns.extend(await asyncio.gather(*(connect() for _ in batch)))
    for cid, conn in zip(cids, conns, strict=True):
        conn.set_receiver(lambda msg, cid=cid: snaps.add(cid, msg.data))
    emit(event="connected")
    sched = Schedule(p, await _read_start_async())
    size = p["input_size"]
    pairs = list(zip(cids, conns, strict=True))
    names = _rudp_counter_names()

    def tick(k: int) -> None:
        for cid, conn in pairs:
            if not conn.closed:
                conn.send(input_payload(cid, k, size))

    def counters() -> Counters:
        return _sum_conn_stats(conns, names)

    await run_async_ticks(sched, tick, counters, snaps)
    totals = _sum_conn_stats(conns, names)
    return {**sched.result(), **snaps.result(), "totals": totals, "build": _rudp_build()}


async def _read_start_async() -> float:
    loop = asyncio.get_running_loop()
    got: asyncio.Future[float] = loop.create_future()
    fd = sys.stdin.fileno()
    buf = bytearray()

    def on_readable() -> None:
        chunk = os.read(fd, 4096)
        if not chunk:
            loop.remove_reader(fd)
            if not got.done():
                got.set_exception(SystemExit("parent went away"))
            return
        buf.extend(chunk)
        if b"\n" in buf:
            loop.remove_reader(fd)
            if not got.done():
                got.set_result(float(json.loads(bytes(buf).split(b"\n", 1)[0])["t0"]))

    loop.add_reader(fd, on_readable)
    return await got


def _run_rudp(role: Callable[[dict[str, Any]], Any], p: dict[str, Any]) -> Result:
    import rudp

    build = _rudp_build()
    want = p.get("build")
    if want is not None and build["compiled"] != (want == "compiled"):
        raise RuntimeError(f"expected the {want} build of rudp, imported {build}")
    result: Result = rudp.run(role(p), use_uvloop=p["loop"] == "uvloop")
    return result


# -- ENet (pyenet) ------------------------------------------------------------------------


def enet_server(p: dict[str, Any]) -> Result:
    import enet  # type: ignore[import-not-found]  # pyenet ships no types

    n = p["n"]
    inputs = Inputs(n, p["warmup"] + p["measured"])
    host = enet.Host(enet.Address(HOST.encode(), 0), n, 2, 0, 0)
    peers: list[Any] = []
    none, connect, receive = enet.EVENT_TYPE_NONE, enet.EVENT_TYPE_CONNECT, enet.EVENT_TYPE_RECEIVE

    def service() -> None:
        """Once per tick: every event waiting (ENet sends its acks from here)."""
        while True:
            event = host.service(0)
            kind = event.type
            if kind == none:
                return
            if kind == receive:
                inputs.add(event.packet.data)
            elif kind == connect:
                peer = event.peer
                if not p["enet_throttle"]:
                    # ENet's throttle drops unreliable packets while the RTT it measures
                    # rises above its recent mean; serviced once per tick, the RTT swings
                    # by up to a tick, and a trial run lost 10 % of its snapshots so.
                    # Kept at full rate, ENet sends what the others send.
                    peer.packetThrottleDeceleration = 0
                peers.append(peer)

    emit(event="ready", port=host.address.port)
    deadline = time.monotonic() + p["connect_timeout"]
    while len(peers) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(peers)} of {n} ENet clients connected")
        service()
        time.sleep(0.001)
    emit(event="connected")
    sched = Schedule(p, read_start(service))
    size = p["snapshot_size"]
    packet = enet.Packet

    def tick(k: int) -> None:
        service()
        snapshot = snapshot_payload(k, size)
        for peer in peers:
            peer.send(1, packet(snapshot, 0))  # unreliable (sequenced), channel 1
        host.flush()

    def counters() -> Counters:
        return {"datagrams_in": host.totalReceivedPackets, "datagrams_out": host.totalSentPackets}

    run_sync_ticks(sched, tick, service, counters, inputs)
    return {**sched.result(), **inputs.result()}


def enet_clients(p: dict[str, Any]) -> Result:
    import enet

    cids: list[int] = p["cids"]
    snaps = Snapshots(cids, p["warmup"] + p["measured"])
    address = enet.Address(HOST.encode(), p["port"])
    hosts = [enet.Host(None, 1, 2, 0, 0) for _ in cids]
    peers = [h.connect(address, 2) for h in hosts]
    none, connect, receive = enet.EVENT_TYPE_NONE, enet.EVENT_TYPE_CONNECT, enet.EVENT_TYPE_RECEIVE
    connected: set[int] = set()
    entries = list(zip(cids, hosts, peers, strict=True))

    def service() -> None:
        for cid, host, _ in entries:
            while True:
                event = host.service(0)
                kind = event.type
                if kind == none:
                    break
                if kind == receive:
                    snaps.add(cid, event.packet.data)
                elif kind == connect:
                    connected.add(cid)

    deadline = time.monotonic() + p["connect_timeout"]
    while len(connected) < len(cids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(connected)} of {len(cids)} ENet clients connected")
        service()
        time.sleep(0.001)
    emit(event="connected")
    sched = Schedule(p, read_start(service))
    size = p["input_size"]
    packet, reliable = enet.Packet, enet.PACKET_FLAG_RELIABLE

    def tick(k: int) -> None:
        for cid, host, peer in entries:
            while True:  # one service per tick, as the server
                event = host.service(0)
                kind = event.type
                if kind == none:
                    break
                if kind == receive:
                    snaps.add(cid, event.packet.data)
            peer.send(0, packet(input_payload(cid, k, size), reliable))
            host.flush()

    run_sync_ticks(sched, tick, service, dict, snaps)
    return {**sched.result(), **snaps.result()}


# -- raw UDP ------------------------------------------------------------------------------


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, UDP_BUFFER)
    sock.bind((HOST, 0))
    sock.setblocking(False)
    return sock


def udp_server(p: dict[str, Any]) -> Result:
    n = p["n"]
    inputs = Inputs(n, p["warmup"] + p["measured"])
    sock = _udp_socket()
    addresses: dict[Any, None] = {}  # insertion-ordered set
    recvfrom, sendto = sock.recvfrom, sock.sendto
    sent = received = 0

    def receive() -> None:
        nonlocal received
        while True:
            try:
                data, addr = recvfrom(2048)
            except BlockingIOError:
                return
            received += 1
            if data == HELLO:
                addresses[addr] = None
                sendto(HELLO, addr)
            else:
                inputs.add(data)

    emit(event="ready", port=sock.getsockname()[1])
    deadline = time.monotonic() + p["connect_timeout"]
    while len(addresses) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(addresses)} of {n} UDP clients said hello")
        receive()
        time.sleep(0.001)
    emit(event="connected")
    sched = Schedule(p, read_start(receive))
    size = p["snapshot_size"]
    targets = list(addresses)

    def tick(k: int) -> None:
        nonlocal sent
        receive()
        snapshot = snapshot_payload(k, size)
        for addr in targets:
            sendto(snapshot, addr)
        sent += len(targets)

    def counters() -> Counters:
        return {"datagrams_in": received, "datagrams_out": sent}

    run_sync_ticks(sched, tick, receive, counters, inputs)
    return {**sched.result(), **inputs.result()}


def udp_clients(p: dict[str, Any]) -> Result:
    cids: list[int] = p["cids"]
    snaps = Snapshots(cids, p["warmup"] + p["measured"])
    server = (HOST, p["port"])
    entries = [(cid, _udp_socket()) for cid in cids]
    waiting = {cid for cid, _ in entries}
    deadline = time.monotonic() + p["connect_timeout"]
    while waiting:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} UDP clients got no hello back")
        for cid, sock in entries:
            if cid in waiting:
                sock.sendto(HELLO, server)
        time.sleep(0.05)
        for cid, sock in entries:
            try:
                while sock.recv(2048) == HELLO:
                    waiting.discard(cid)
            except BlockingIOError:
                pass

    def drain(cid: int, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(2048)
            except BlockingIOError:
                return
            if data != HELLO:
                snaps.add(cid, data)

    def service() -> None:
        for cid, sock in entries:
            drain(cid, sock)

    emit(event="connected")
    sched = Schedule(p, read_start())
    size = p["input_size"]

    def tick(k: int) -> None:
        for cid, sock in entries:
            drain(cid, sock)
            sock.sendto(input_payload(cid, k, size), server)

    run_sync_ticks(sched, tick, service, dict, snaps)
    return {**sched.result(), **snaps.result()}


# -- TCP ----------------------------------------------------------------------------------


class _Stream:
    """One TCP connection's framing: length-prefixed messages in, a write backlog out."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.closed = False

    def read(self) -> list[bytes]:
        """What one recv() brings, as whole messages (the rest waits in the buffer)."""
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return []
        except ConnectionResetError:  # a client that left with snapshots unread
            chunk = b""
        if not chunk:  # the peer is done (a client leaves once it has every snapshot)
            self.closed = True
            return []
        buf = self.inbuf
        buf += chunk
        out = []
        pos = 0
        while len(buf) - pos >= LEN_PREFIX.size:
            (length,) = LEN_PREFIX.unpack_from(buf, pos)
            end = pos + LEN_PREFIX.size + length
            if end > len(buf):
                break
            out.append(bytes(buf[pos + LEN_PREFIX.size : end]))
            pos = end
        del buf[:pos]
        return out

    def write(self, frame: bytes) -> None:
        if self.outbuf:
            self.outbuf += frame
            frame = bytes(self.outbuf)
            self.outbuf.clear()
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            self.outbuf += frame[sent:]

    def segments(self) -> tuple[int, int]:
        """tcpi_segs_out and tcpi_segs_in of Linux's struct tcp_info (0, 0 elsewhere)."""
        if not hasattr(socket, "TCP_INFO"):
            return 0, 0
        raw = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(raw) < 144:
            return 0, 0
        segs_out, segs_in = struct.unpack_from("2I", raw, 136)
        return segs_out, segs_in


def tcp_server(p: dict[str, Any]) -> Result:
    n = p["n"]
    inputs = Inputs(n, p["warmup"] + p["measured"])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, 0))
    listener.listen(max(128, n))
    listener.setblocking(False)
    streams: dict[int, _Stream] = {}
    poller = select.epoll()

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            stream = _Stream(sock)
            streams[sock.fileno()] = stream
            poller.register(sock.fileno(), select.EPOLLIN)

    def receive() -> None:
        for fd, _ in poller.poll(0):
            stream = streams[fd]
            for message in stream.read():
                inputs.add(message)
            if stream.closed:
                poller.unregister(fd)

    emit(event="ready", port=listener.getsockname()[1])
    deadline = time.monotonic() + p["connect_timeout"]
    while len(streams) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(streams)} of {n} TCP clients connected")
        accept()
        time.sleep(0.001)
    emit(event="connected")
    sched = Schedule(p, read_start(receive))
    size = p["snapshot_size"]
    targets = list(streams.values())

    def tick(k: int) -> None:
        receive()
        frame = LEN_PREFIX.pack(size) + snapshot_payload(k, size)
        for stream in targets:
            if not stream.closed:
                stream.write(frame)

    def counters() -> Counters:
        out = inn = 0
        for stream in targets:
            o, i = stream.segments()
            out += o
            inn += i
        return {"datagrams_in": inn, "datagrams_out": out}

    run_sync_ticks(sched, tick, receive, counters, inputs)
    return {**sched.result(), **inputs.result()}


def tcp_clients(p: dict[str, Any]) -> Result:
    cids: list[int] = p["cids"]
    snaps = Snapshots(cids, p["warmup"] + p["measured"])
    entries = []
    for cid in cids:
        sock = socket.create_connection((HOST, p["port"]), timeout=p["connect_timeout"])
        entries.append((cid, _Stream(sock)))

    def drain(cid: int, stream: _Stream) -> None:
        for message in stream.read():
            snaps.add(cid, message)

    def service() -> None:
        for cid, stream in entries:
            drain(cid, stream)

    emit(event="connected")
    sched = Schedule(p, read_start())
    size = p["input_size"]

    def tick(k: int) -> None:
        for cid, stream in entries:
            drain(cid, stream)
            stream.write(LEN_PREFIX.pack(size) + input_payload(cid, k, size))

    run_sync_ticks(sched, tick, service, dict, snaps)
    return {**sched.result(), **snaps.result()}


# -- entry point --------------------------------------------------------------------------

SYNC_ROLES: dict[str, Callable[[dict[str, Any]], Result]] = {
    "enet-server": enet_server,
    "enet-client": enet_clients,
    "udp-server": udp_server,
    "udp-client": udp_clients,
    "tcp-server": tcp_server,
    "tcp-client": tcp_clients,
}
RUDP_ROLES = {"rudp-server": rudp_server, "rudp-client": rudp_clients}


def main() -> None:
    role, params = sys.argv[1], json.loads(sys.argv[2])
    if params.get("cpu") is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {params["cpu"]})
    # asyncio's transports read into a fresh 256 KiB buffer; let glibc serve it from
    # its heap in every process alike (see _settle_malloc in _common.py).
    block = bytearray(1 << 20)
    del block
    try:
        if role in RUDP_ROLES:
            result = _run_rudp(RUDP_ROLES[role], params)
        else:
            result = SYNC_ROLES[role](params)
    except BaseException:
        emit(event="error", traceback=traceback.format_exc())
        sys.exit(1)
    emit(event="result", role=role, **result)
    if role.endswith("-server"):
        wait_for_eof()
    os._exit(0)  # no graceful closes: the parent has what it measured


if __name__ == "__main__":
    main()
