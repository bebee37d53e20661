"""Goodput and delivery latency of a bulk transfer under loss: rudp against TCP, same run.

A sender hands ``--count`` messages of ``--size`` bytes to the transport at once (a bulk
transfer) and a receiver timestamps each message as the application gets it; sender and
receiver share a process, so one clock. Reported per run: the time until the last message
arrived (and the goodput that makes), and the delivery latency (receive time minus the time the
message was handed to ``send``/``write``; queueing behind earlier messages included, identically
for both transports) at p50 / p99 / max; per loss rate a summary line with the median times over
``--repeat`` runs and their ratios. Only 127.0.0.1 is used.

rudp path: the real rudp client and server on loopback, each impairing what it sends with the
in-process netsim (``Config.netsim``, outbound): ``--latency`` +- ``--jitter`` (uniform, per
datagram, so datagrams sent close together are reordered, as netem's jitter does) and independent
loss of ``loss`` in each direction. (In-process rather than through ``start_proxy``: the proxy's
own sockets have default-sized buffers, and a 256-datagram window burst overflowing them would
add losses nobody asked for.) Datagrams are 1,240 bytes so that a 1,200-byte message fits one.

TCP path: there is no way to drop bytes out of a TCP stream on loopback without kernel netem
(which would impair every program on the machine), so a TCP relay *models* the path; both of
its sockets are ordinary loopback TCP:

* the relay forwards the stream in ``--tcp-mss`` segments, default 65,483 bytes, the loopback
  MTU's (that is how netem on ``lo`` would see TCP; with it the model reproduces the 0.85 s
  reference below; ``--tcp-mss 1448`` gives Ethernet-sized segments and a TCP that is ~10x
  slower at 5 % loss, as the Mathis formula predicts), each delayed by the same
  ``latency +- jitter`` draw as a rudp datagram, and released in order (head-of-line blocking
  included: a segment is never released before the one in front of it);
* a segment is lost with probability ``loss``; the loss costs one retransmission timeout
  (``--tcp-rto``, default 240 ms: Linux's 200 ms minimum + one round trip), doubled for each
  further loss of the same segment; the ``fast-retx`` variant recovers a first loss in one round
  trip instead (fast retransmit after three duplicate ACKs);
* a window emulates congestion control: 10 segments initially, +1 per acknowledged segment up
  to ``ssthresh``, then +1/cwnd; one halving per loss episode (NewReno-style). A segment is
  acknowledged one mean one-way delay after it arrived, even behind a hole (SACK); ACKs are
  never lost.

So the TCP figures come from a model, not a kernel. The reference measured on these machines
with the same impairment under netem (2,000 x 1,200 B, 5 % loss, 20 +- 5 ms each way) is printed
beside them: TCP 0.85 s, KCP 1.30 s, ENet 1.92 s.

    .venv/bin/python bench/loss_goodput.py                    # 1 %, 5 %, 20 % loss, 3 runs each
    .venv/bin/python bench/loss_goodput.py --loss 0.05 --repeat 5 --jitter 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
import sys
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rudp
from rudp.netsim import LinkProfile

STAMP = struct.Struct("!I")
REFERENCE_5PCT = {"tcp(netem)": 0.85, "kcp": 1.30, "enet": 1.92}


@dataclass
class Result:
    transport: str
    loss: float
    seconds: float
    latencies: list[float]
    extra: dict[str, float]

    def row(self, size: int) -> dict[str, object]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(1e3 * lat[min(len(lat) - 1, int(len(lat) * p))], 1)

        return {
            "transport": self.transport,
            "loss": self.loss,
            "seconds": round(self.seconds, 3),
            "goodput_kib_s": round(len(lat) * size / self.seconds / 1024, 1),
            "latency_p50_ms": pct(0.50),
            "latency_p99_ms": pct(0.99),
            "latency_max_ms": round(1e3 * lat[-1], 1),
            **self.extra,
        }


async def _wait(event: asyncio.Event, timeout: float, what: str) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        raise SystemExit(f"{what} did not finish within {timeout} s") from None


# -- rudp -----------------------------------------------------------------------------------------


async def run_rudp(args: argparse.Namespace, loss: float, seed: int) -> Result:
    profile = LinkProfile(loss=loss, latency=args.latency, jitter=args.jitter)
    arrivals: list[float] = []
    done = asyncio.Event()

    async def receiver(conn: rudp.Connection) -> None:
        async for msg in conn:
            (index,) = STAMP.unpack_from(msg.data)
            assert index == len(arrivals), "out of order"
            arrivals.append(perf_counter())
            if len(arrivals) == args.count:
                done.set()

    # 1,200-byte messages need a datagram above the 1,200-byte default. Each endpoint impairs
    # what it sends (in-process netsim): no proxy socket whose buffer could add losses of its own.
    base = rudp.Config(
        max_datagram_size=max(1200, args.size + 40), reorder_threshold=args.reorder_threshold
    )
    server_cfg = replace(base, netsim=rudp.NetsimConfig(outbound=profile, seed=seed))
    client_cfg = replace(base, netsim=rudp.NetsimConfig(outbound=profile, seed=seed + 1000))
    server = await rudp.serve(receiver, "127.0.0.1", 0, config=server_cfg)
    conn = await rudp.connect(*server.address, config=client_cfg)
    try:
        filler = bytes(args.size - STAMP.size)
        sent: list[float] = []
        start = perf_counter()
        for i in range(args.count):
            sent.append(perf_counter())
            conn.send(STAMP.pack(i) + filler)
        await _wait(done, args.timeout, "rudp transfer")
        stats = conn.stats
        extra = {
            "resent": stats.messages_resent,
            "lost": stats.packets_lost,
            "spurious": stats.spurious_losses,
            "rto_timeouts": stats.timeouts,
            "timer_wakeups": stats.timer_wakeups,
            "srtt_ms": round(stats.srtt * 1e3, 1),
        }
        return Result(
            "rudp",
            loss,
            arrivals[-1] - start,
            [a - s for a, s in zip(arrivals, sent, strict=True)],
            extra,
        )
    finally:
        await conn.close()
        await server.close()


# -- TCP through a modelling relay ------------------------------------------------------------


class TcpPathModel:
    """The relay's forward direction: delay, loss as RTO stalls, a congestion window."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        writer: asyncio.StreamWriter,
        args: argparse.Namespace,
        loss: float,
        rng: random.Random,
        fast: bool,
    ) -> None:
        self.loop = loop
        self.fast = fast
        self.writer = writer
        self.latency, self.jitter, self.loss, self.rto = (
            args.latency,
            args.jitter,
            loss,
            args.tcp_rto,
        )
        self.rng = rng
        self.cwnd = 10.0
        self.ssthresh = float("inf")
        self.in_flight = 0
        self.last_release = 0.0
        self.window_open = asyncio.Event()
        self.window_open.set()
        self.losses = 0
        self.recovery_until = 0.0
        self.releases: deque[tuple[float, bytes]] = deque()

    def submit(self, segment: bytes) -> None:
        now = self.loop.time()
        delay = max(0.0, self.latency + self.rng.uniform(-self.jitter, self.jitter))
        stall, rto = 0.0, self.rto
        first = True
        while self.rng.random() < self.loss:  # each transmission of it may be lost again
            if first and self.fast:  # three duplicate ACKs: resent one round trip later
                stall += 2 * self.latency
            else:
                stall += rto
                rto *= 2
            first = False
            self.losses += 1
            self.loop.call_at(now + stall, self._on_loss)
        arrival = now + stall + delay
        # In order: the application gets it no earlier than the segment before it.
        release = max(self.last_release, arrival)
        self.last_release = release
        self.in_flight += 1
        if self.in_flight >= self.cwnd:
            self.window_open.clear()
        self.releases.append((release, segment))
        self.loop.call_at(release, self._release, release)
        # SACK: a segment behind a hole is acknowledged when it arrives, not when released.
        self.loop.call_at(arrival + self.latency, self._on_ack)

    def _release(self, until: float) -> None:
        # One queue, released in order: timers due at (nearly) the same instant may fire in
        # any order on a millisecond-resolution loop, bytes of a stream may not.
        releases = self.releases
        while releases and releases[0][0] <= until:
            self.writer.write(releases.popleft()[1])

    def _on_ack(self) -> None:
        self.in_flight -= 1
        if self.cwnd < self.ssthresh:
            self.cwnd += 1.0
        else:
            self.cwnd += 1.0 / self.cwnd
        if self.in_flight < self.cwnd:
            self.window_open.set()

    def _on_loss(self) -> None:
        # One window reduction per recovery episode (a round trip), as NewReno/SACK do.
        now = self.loop.time()
        if now < self.recovery_until:
            return
        self.recovery_until = now + 2 * self.latency
        self.ssthresh = max(self.cwnd / 2.0, 2.0)
        self.cwnd = self.ssthresh


async def run_tcp(args: argparse.Namespace, loss: float, seed: int, fast: bool) -> Result:
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    done = asyncio.Event()
    models: list[TcpPathModel] = []

    async def receiver(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(args.count):
            data = await reader.readexactly(args.size)
            (index,) = STAMP.unpack_from(data)
            assert index == len(arrivals), "out of order"
            arrivals.append(perf_counter())
        done.set()
        writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, up_writer = await asyncio.open_connection(*sink_addr)
        model = TcpPathModel(loop, up_writer, args, loss, random.Random(seed), fast)
        models.append(model)
        try:
            while True:
                await model.window_open.wait()
                segment = await reader.read(args.tcp_mss)
                if not segment:
                    break
                model.submit(segment)
            await done.wait()
        finally:
            up_writer.close()
            writer.close()

    sink = await asyncio.start_server(receiver, "127.0.0.1", 0)
    sink_addr = sink.sockets[0].getsockname()[:2]
    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    _, writer = await asyncio.open_connection(*proxy.sockets[0].getsockname()[:2])
    try:
        filler = bytes(args.size - STAMP.size)
        sent: list[float] = []
        start = perf_counter()
        for i in range(args.count):
            sent.append(perf_counter())
            writer.write(STAMP.pack(i) + filler)
        await _wait(done, args.timeout, "TCP transfer")
        extra = {"segments_lost": models[0].losses if models else 0}
        return Result(
            "tcp(model,fast-retx)" if fast else "tcp(model,rto)",
            loss,
            arrivals[-1] - start,
            [a - s for a, s in zip(arrivals, sent, strict=True)],
            extra,
        )
    finally:
        writer.close()
        for server in (proxy, sink):
            server.close()


# -- main --------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for loss in args.loss:
        seconds: dict[str, list[float]] = {}
        for rep in range(args.repeat):
            seed = args.seed + rep
            results = [
                await run_rudp(args, loss, seed),
                await run_tcp(args, loss, seed, fast=False),
                await run_tcp(args, loss, seed, fast=True),
            ]
            for result in results:
                row = result.row(args.size)
                seconds.setdefault(result.transport, []).append(result.seconds)
                print(json.dumps(row), flush=True)
                rows.append(row)
        # The TCP model with loopback-sized segments has few of them (~40), so whether a loss
        # hits is luck: compare medians over the repeats.
        median = {name: sorted(v)[len(v) // 2] for name, v in seconds.items()}
        summary: dict[str, object] = {"summary": True, "loss": loss, "repeats": args.repeat}
        summary.update({f"{name}_median_s": round(v, 3) for name, v in median.items()})
        for name, value in median.items():
            if name != "rudp":
                summary[f"rudp/{name}"] = round(median["rudp"] / value, 2)
        if loss == 0.05:
            summary["rudp/tcp(netem_reference)"] = round(
                median["rudp"] / REFERENCE_5PCT["tcp(netem)"], 2
            )
        print(json.dumps(summary), flush=True)
        rows.append(summary)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", type=float, nargs="+", default=[0.01, 0.05, 0.20])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--size", type=int, default=1200)
    parser.add_argument("--latency", type=float, default=0.020, help="one-way, seconds")
    parser.add_argument("--jitter", type=float, default=0.005, help="+- seconds, uniform")
    parser.add_argument("--tcp-rto", type=float, default=0.24, help="TCP model's RTO, seconds")
    parser.add_argument(
        "--tcp-mss", type=int, default=65483, help="TCP model segment size (loopback MTU)"
    )
    parser.add_argument(
        "--reorder-threshold", type=int, default=3, help="rudp Config.reorder_threshold"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per loss rate (median)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    print(f"# reference at 5 % loss, 20 +- 5 ms (netem): {REFERENCE_5PCT}", flush=True)
    rudp.run(main(arguments))
