"""Delivery latency on the fake clock: a deterministic replica of delivery_latency.py.

The same game stream (200-byte messages, one per millisecond, 5 % loss and 20 +- 5 ms each
way) between two sans-IO endpoints on the in-memory network of ``tests/rudp/harness.py``:
no sockets, no processes, no machine noise, and the same numbers on every run. It is the
quick way to compare protocol variants (loss detection, redundancy) before measuring them
for real with ``delivery_latency.py``.

``--clients N`` adds N - 1 more clients sending the same stream to the same server (the
figures are the first client's). The runs stay reproducible: an endpoint flushes its
connections in the order they asked, never in the memory order of a set.

    .venv/bin/python bench/delivery_sim.py                       # every mode, redundancy 0 and 2
    .venv/bin/python bench/delivery_sim.py --modes ordered --redundancy 0,1,2,3 --seeds 1,2,3
    .venv/bin/python bench/delivery_sim.py --modes ordered --clients 6
    .venv/bin/python bench/delivery_sim.py --bulk --seeds 1,2,3 --loss 0,0.01,0.05

``--bulk`` runs the other workload instead: 2,000 messages of 1,200 bytes handed over at
once (a bulk transfer, ``max_datagram_size=1240`` so one message fills one datagram) on
the same path, and reports when the receiver had them all, when the sender had every
acknowledgment, the packets declared lost and how many of those proved spurious, resend
timeouts and timer wake-ups.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rudp.config import Config
from rudp.connection import Connection, State
from rudp.events import MessageReceived
from rudp.sending import OutMessage
from rudp.wire import Delivery
from tests.rudp.harness import Link, Network

TAG = struct.Struct("!I")
SERVER = ("10.0.0.1", 9000)
CLIENT = ("10.0.0.2", 5000)
ENTITIES = 8


class _TimedNetwork(Network):
    """Records, on the fake clock, when each tagged message reached the application."""

    def __init__(self, seed: int, link: Link) -> None:
        super().__init__(seed=seed, link=link)
        self.delivered: dict[int, float] = {}

    def _drain_events(self) -> None:
        for node in self.nodes.values():
            while (item := node.endpoint.next_event()) is not None:
                conn, event = item
                if (
                    isinstance(event, MessageReceived)
                    and conn is not None
                    and conn.address == CLIENT
                    and len(event.data) >= TAG.size
                ):
                    self.delivered.setdefault(TAG.unpack_from(event.data)[0], self.now)


def run(
    mode: str,
    redundancy: int,
    seed: int,
    count: int,
    warmup: int,
    clients: int = 1,
    loss: float = 0.05,
    parity: bool = False,
) -> dict[str, Any]:
    net = _TimedNetwork(seed, Link(loss=loss, delay=0.020, jitter=0.005))
    config = Config(redundancy=redundancy, parity=parity)
    net.add(SERVER, config, accept=True)
    conns: list[Connection] = []
    for n in range(clients):
        address = CLIENT if n == 0 else (f"10.0.1.{n}", 5000)
        conns.append(net.add(address, config).endpoint.connect(SERVER, net.now))
    net.run_until(lambda: all(c.state is State.CONNECTED for c in conns))
    conn = conns[0]
    sent: dict[int, float] = {}
    last: list[list[OutMessage | None]] = [[None] * ENTITIES for _ in conns]
    start = net.now
    for i in range(warmup + count):
        net.run(max(0.0, start + i * 0.001 - net.now))
        data = TAG.pack(i) + bytes(196)
        sent[i] = net.now
        for c, previous in zip(conns, last, strict=True):
            if mode == "ordered":
                c.send(data)
            elif mode == "udp":  # the floor: what arrives of an unreliable stream
                c.send(data, delivery=Delivery.UNRELIABLE)
            elif mode == "unordered":
                c.send(data, delivery=Delivery.RELIABLE_UNORDERED)
            else:
                prev = previous[i % ENTITIES]
                previous[i % ENTITIES] = c.send(data, depends_on=[prev] if prev else [])
    net.run(3.0)
    measured = range(warmup, warmup + count)
    latencies = sorted(1e3 * (net.delivered[i] - sent[i]) for i in measured if i in net.delivered)
    assert mode == "udp" or len(latencies) == count, "a reliable message was not delivered"
    count = len(latencies)
    stats = conn.stats

    def q(p: float) -> float:
        return latencies[min(count - 1, int(p * count))]

    return {
        "p50": q(0.50),
        "p99": q(0.99),
        "max": latencies[-1],
        "kB": stats.bytes_sent / 1e3,
        # What the sender put on the wire per message (all its packets, headers included).
        "B/msg": stats.bytes_sent / len(sent),
        "alone": stats.acks_alone,
        "wakeups": stats.timer_wakeups,
        "receiver acks alone": sum(
            c.stats.acks_alone for c in net.nodes[SERVER].endpoint.connections
        ),
        "lost": stats.packets_lost,
        "resent": stats.messages_resent,
        "spurious": stats.spurious_losses,
        "timeouts": stats.timeouts,
        "srtt": stats.srtt * 1e3,
        "repairs": stats.repairs_sent,
        "rebuilt": sum(c.stats.packets_recovered for c in net.nodes[SERVER].endpoint.connections),
        "loss_rate": conn._recovery.loss_rate,
    }


def bulk(
    seed: int, loss: float, jitter: float = 0.005, count: int = 2000, size: int = 1200
) -> dict[str, Any]:
    """A bulk transfer of ``count`` messages of ``size`` bytes, sent at once."""
    net = Network(seed=seed, link=Link(loss=loss, delay=0.020, jitter=jitter))
    config = Config(max_datagram_size=1240)
    server = net.add(SERVER, config, accept=True)
    conn = net.add(CLIENT, config).endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    start = net.now
    handles = [conn.send(bytes(size)) for _ in range(count)]
    delivered = acked = 0.0
    while not delivered or not acked:
        assert net.step(net.now + 5), "the transfer stalled"
        received = sum(c.stats.messages_received for c in server.endpoint.connections)
        if not delivered and received >= count:
            delivered = net.now - start
        if not acked and all(h.acked for h in handles[-64:]) and conn.queued == 0:
            acked = net.now - start
    stats = conn.stats
    return {
        "delivered": delivered,
        "acked": acked,
        "lost": stats.packets_lost,
        "spurious": stats.spurious_losses,
        "resent": stats.messages_resent,
        "timeouts": stats.timeouts,
        "wakeups": stats.timer_wakeups,
    }


def main_bulk(args: argparse.Namespace) -> None:
    print(
        "| loss | seed | delivered s | acked s | packets lost | spurious | resent "
        "| resend timeouts | timer wake-ups |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for loss in map(float, args.loss.split(",")):
        for seed in map(int, args.seeds.split(",")):
            r = bulk(seed, loss, args.jitter_ms / 1e3)
            print(
                f"| {loss:g} | {seed} | {r['delivered']:.3f} | {r['acked']:.3f} | {r['lost']} "
                f"| {r['spurious']} | {r['resent']} | {r['timeouts']} | {r['wakeups']} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="ordered,unordered,dependency")
    parser.add_argument("--redundancy", default="0,2")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--clients", type=int, default=1, help="clients of the one server")
    parser.add_argument("--loss", default="0.05", help="loss each way (a list: 0,0.01,0.05)")
    parser.add_argument("--bulk", action="store_true", help="the bulk transfer instead")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="--bulk: +- jitter each way")
    parser.add_argument("--parity", action="store_true", help="Config(parity=True) both sides")
    args = parser.parse_args()
    if args.bulk:
        main_bulk(args)
        return
    print(
        "| loss | mode | redundancy | seed | p50 ms | p99 ms | max ms | kB sent | B/msg "
        "| packets lost | resent | spurious | timeouts | timer wake-ups | receiver's acks "
        "alone | SRTT ms | REPAIRs | rebuilt |"
    )
    print(
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for loss in map(float, args.loss.split(",")):
        for mode in args.modes.split(","):
            for redundancy in map(int, args.redundancy.split(",")):
                for seed in map(int, args.seeds.split(",")):
                    r = run(
                        mode,
                        redundancy,
                        seed,
                        args.count,
                        args.warmup,
                        args.clients,
                        loss,
                        args.parity,
                    )
                    print(
                        f"| {loss:g} | {mode} | {redundancy} | {seed} | {r['p50']:.1f} "
                        f"| {r['p99']:.1f} | {r['max']:.1f} | {r['kB']:.0f} | {r['B/msg']:.0f} "
                        f"| {r['lost']} | {r['resent']} | {r['spurious']} | {r['timeouts']} "
                        f"| {r['wakeups']} | {r['receiver acks alone']} | {r['srtt']:.1f} "
                        f"| {r['repairs']} | {r['rebuilt']} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
