"""Tests of rudp.netsim: the sans-IO conditioner, the asyncio pipe and the UDP proxy.

The conditioner is driven by a stepped fake clock and fixed seeds, so every statistical assertion
is deterministic. The pipe and proxy tests use real sockets on loopback only and wait for
conditions (with generous deadlines), never for fixed amounts of time.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, cast

import pytest

from rudp.netsim import (
    ConditionedPipe,
    GilbertElliott,
    LinkConditioner,
    LinkProfile,
    LinkStats,
    Proxy,
    format_address,
    parse_address,
    start_proxy,
)
from rudp.netsim.__main__ import build_parser, profile_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT = 5.0  # upper bound for conditions on loopback; reached only when something is broken

# -- helpers for the sans-IO conditioner ------------------------------------------------------


def make(profile: LinkProfile, seed: int = 1) -> LinkConditioner[int]:
    return LinkConditioner(profile, rng=random.Random(seed))


def drain(cond: LinkConditioner[int]) -> list[tuple[float, bytes, int]]:
    """Step a fake clock from deadline to deadline; return (delivery time, data, meta)."""
    out: list[tuple[float, bytes, int]] = []
    while (deadline := cond.next_deadline()) is not None:
        out.extend((deadline, data, meta) for data, meta in cond.poll(deadline))
    return out


def run(
    cond: LinkConditioner[int], sends: Iterable[tuple[float, bytes]]
) -> list[tuple[float, bytes, int]]:
    """Submit (time, data) in time order, meta = index, delivering everything due in between."""
    out: list[tuple[float, bytes, int]] = []
    for index, (now, data) in enumerate(sends):
        while (deadline := cond.next_deadline()) is not None and deadline <= now:
            out.extend((deadline, d, m) for d, m in cond.poll(deadline))
        cond.send(data, now, index)
    out.extend(drain(cond))
    return out


def payload(i: int) -> bytes:
    return i.to_bytes(4, "big")


def balanced(stats: LinkStats, pending: int = 0) -> bool:
    produced = stats.sent + stats.duplicated
    consumed = (
        stats.delivered + stats.dropped_mtu + stats.dropped_loss + stats.dropped_queue + pending
    )
    return produced == consumed


def loss_bursts(lost: list[bool]) -> list[int]:
    bursts: list[int] = []
    run_length = 0
    for is_lost in lost:
        if is_lost:
            run_length += 1
        elif run_length:
            bursts.append(run_length)
            run_length = 0
    if run_length:
        bursts.append(run_length)
    return bursts


# -- profiles ---------------------------------------------------------------------------------


def test_default_profile_is_perfect() -> None:
    assert LinkProfile().is_perfect
    assert not LinkProfile(loss=0.1).is_perfect
    assert not LinkProfile(bandwidth=1e6).is_perfect
    assert not LinkProfile(burst=GilbertElliott(p_good_to_bad=0.0, p_bad_to_good=1.0)).is_perfect


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": -0.1}, "loss"),
        ({"loss": 1.5}, "loss"),
        ({"loss": math.nan}, "loss"),
        ({"duplicate": 2.0}, "duplicate"),
        ({"reorder": -1.0}, "reorder"),
        ({"corrupt": 1.01}, "corrupt"),
        ({"latency": -0.001}, "latency"),
        ({"jitter": math.inf}, "jitter"),
        ({"reorder_delay": -1.0}, "reorder_delay"),
        ({"bandwidth": 0.0}, "bandwidth"),
        ({"bandwidth": -5.0}, "bandwidth"),
        ({"queue_limit": -1}, "queue_limit"),
    ],
)
def test_profile_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkProfile(**kwargs)


def test_gilbert_elliott_validation_and_derivation() -> None:
    with pytest.raises(ValueError, match="p_bad_to_good"):
        GilbertElliott(p_good_to_bad=0.1, p_bad_to_good=1.2)
    with pytest.raises(ValueError, match="loss_rate"):
        GilbertElliott.from_mean(1.0, 3.0)
    with pytest.raises(ValueError, match="mean_burst_length"):
        GilbertElliott.from_mean(0.1, 0.5)
    with pytest.raises(ValueError, match="unreachable"):
        GilbertElliott.from_mean(0.6, 1.0)  # bursts of 1 allow at most 50 % loss
    ge = GilbertElliott.from_mean(0.1, 5.0)
    assert ge.p_bad_to_good == pytest.approx(0.2)
    assert ge.loss_rate == pytest.approx(0.1)
    assert ge.mean_burst_length == pytest.approx(5.0)
    assert GilbertElliott.from_mean(0.0, 4.0).loss_rate == 0.0


# -- conditioner: loss ------------------------------------------------------------------------


def test_perfect_profile_passes_through_at_once() -> None:
    rng = random.Random(7)
    state = rng.getstate()
    cond: LinkConditioner[str] = LinkConditioner(LinkProfile(), rng=rng)
    data = b"hello"
    cond.send(data, 5.0, "meta")
    assert cond.next_deadline() == 5.0
    out = cond.poll(5.0)
    assert out == [(data, "meta")]
    assert out[0][0] is data  # not copied
    assert cond.next_deadline() is None
    assert rng.getstate() == state  # the fast path draws no random numbers
    assert cond.stats == LinkStats(sent=1, delivered=1)


def test_uniform_loss_rate() -> None:
    cond = make(LinkProfile(loss=0.2), seed=1)
    n = 100_000
    for i in range(n):
        cond.send(b"x", i * 0.001, i)
        cond.poll(i * 0.001)
    fraction = cond.stats.dropped_loss / n
    assert abs(fraction - 0.2) < 0.01
    assert cond.stats.delivered == n - cond.stats.dropped_loss
    assert balanced(cond.stats)


def test_gilbert_elliott_loss_rate_and_burst_length() -> None:
    cond = make(LinkProfile(burst=GilbertElliott.from_mean(0.1, 5.0)), seed=1)
    n = 200_000
    lost: list[bool] = []
    for i in range(n):
        cond.send(b"x", float(i), i)
        lost.append(not cond.poll(float(i)))
    bursts = loss_bursts(lost)
    assert abs(sum(lost) / n - 0.1) < 0.01
    assert abs(sum(bursts) / len(bursts) - 5.0) < 0.3
    # Uniform loss at the same rate has bursts barely longer than 1: the chain makes the difference.
    assert max(bursts) > 20


def test_burst_replaces_uniform_loss() -> None:
    never = GilbertElliott(p_good_to_bad=0.0, p_bad_to_good=1.0)
    cond = make(LinkProfile(loss=1.0, burst=never))
    out = run(cond, ((float(i), b"x") for i in range(100)))
    assert len(out) == 100


# -- conditioner: delay, order ----------------------------------------------------------------


def test_latency_without_jitter_is_exact_and_keeps_order() -> None:
    cond = make(LinkProfile(latency=0.05, loss=0.1), seed=3)
    sends = [(i * 0.001, payload(i)) for i in range(5000)]
    out = run(cond, sends)
    assert [meta for _, _, meta in out] == sorted(meta for _, _, meta in out)
    for when, _, meta in out:
        assert when == pytest.approx(sends[meta][0] + 0.05)


def test_same_instant_sends_keep_order() -> None:
    cond = make(LinkProfile(latency=0.02))
    out = run(cond, ((1.0, payload(i)) for i in range(100)))
    assert [meta for _, _, meta in out] == list(range(100))


def test_jitter_bounds_and_reordering() -> None:
    cond = make(LinkProfile(latency=0.05, jitter=0.02), seed=4)
    sends = [(i * 0.001, payload(i)) for i in range(10_000)]
    out = run(cond, sends)
    delays = [when - sends[meta][0] for when, _, meta in out]
    assert len(out) == len(sends)
    assert min(delays) >= 0.03 - 1e-9
    assert max(delays) <= 0.07 + 1e-9
    assert max(delays) - min(delays) > 0.035  # the whole span is used
    metas = [meta for _, _, meta in out]
    assert metas != sorted(metas)  # jitter larger than the send interval reorders (documented)


def test_jitter_never_makes_delay_negative() -> None:
    cond = make(LinkProfile(latency=0.005, jitter=0.02), seed=5)
    sends = [(i * 0.01, payload(i)) for i in range(2000)]
    delays = [when - sends[meta][0] for when, _, meta in run(cond, sends)]
    assert min(delays) >= 0.0
    assert delays.count(0.0) > 100  # clamped at zero, about a third of them


def test_reorder_holds_back_some_datagrams() -> None:
    cond = make(LinkProfile(latency=0.02, reorder=0.1, reorder_delay=0.01), seed=6)
    sends = [(i * 0.001, payload(i)) for i in range(10_000)]
    out = run(cond, sends)
    held = [meta for when, _, meta in out if when - sends[meta][0] > 0.025]
    assert len(held) == cond.stats.reordered
    assert abs(len(held) / len(sends) - 0.1) < 0.01
    for when, _, meta in out:
        expected = 0.03 if meta in held else 0.02
        assert when - sends[meta][0] == pytest.approx(expected)
    metas = [meta for _, _, meta in out]
    assert metas != sorted(metas)


# -- conditioner: duplication, corruption -----------------------------------------------------


def test_duplication() -> None:
    cond = make(LinkProfile(duplicate=0.1, latency=0.01), seed=7)
    out = run(cond, ((i * 0.001, payload(i)) for i in range(10_000)))
    counts: dict[int, int] = {}
    for _, data, meta in out:
        assert data == payload(meta)
        counts[meta] = counts.get(meta, 0) + 1
    assert len(counts) == 10_000
    assert set(counts.values()) == {1, 2}
    doubles = sum(1 for c in counts.values() if c == 2)
    assert doubles == cond.stats.duplicated
    assert abs(doubles / 10_000 - 0.1) < 0.01
    assert balanced(cond.stats)


def test_corruption_flips_one_to_three_bits_and_keeps_length() -> None:
    cond = make(LinkProfile(corrupt=1.0), seed=8)
    original = bytes(range(64))
    flipped_counts = set()
    for i in range(2000):
        cond.send(original, float(i), i)
        ((data, _),) = cond.poll(float(i))
        assert len(data) == len(original)
        flipped = sum(bin(a ^ b).count("1") for a, b in zip(data, original, strict=True))
        assert 1 <= flipped <= 3
        flipped_counts.add(flipped)
    assert flipped_counts == {1, 2, 3}
    assert cond.stats.corrupted == 2000


def test_corruption_rate_and_empty_datagram() -> None:
    cond = make(LinkProfile(corrupt=0.05), seed=9)
    for i in range(20_000):
        cond.send(b"\x00" * 8, float(i), i)
    assert abs(cond.stats.corrupted / 20_000 - 0.05) < 0.005
    damaged = sum(1 for data, _ in cond.poll(1e9) if data != b"\x00" * 8)
    assert damaged == cond.stats.corrupted
    empty = make(LinkProfile(corrupt=1.0))
    empty.send(b"", 0.0, 0)
    assert empty.poll(0.0) == [(b"", 0)]
    assert empty.stats.corrupted == 0  # nothing to flip


# -- conditioner: bandwidth -------------------------------------------------------------------


def test_bandwidth_serialisation_delay() -> None:
    cond = make(LinkProfile(bandwidth=1000.0, latency=0.05))
    out = run(cond, ((0.0, bytes(100)) for _ in range(10)))
    # 100 bytes at 1000 B/s take 0.1 s each, back to back, then 50 ms of propagation.
    assert [when for when, _, _ in out] == pytest.approx([0.1 * k + 0.05 for k in range(1, 11)])
    assert [meta for _, _, meta in out] == list(range(10))


def test_bandwidth_idle_link_sends_at_once() -> None:
    cond = make(LinkProfile(bandwidth=1000.0))
    out = run(cond, [(0.0, bytes(100)), (5.0, bytes(100))])
    assert [when for when, _, _ in out] == pytest.approx([0.1, 5.1])


def test_bandwidth_drop_tail() -> None:
    cond = make(LinkProfile(bandwidth=1000.0, queue_limit=300))
    for i in range(10):
        cond.send(bytes(100), 0.0, i)
    assert cond.stats.dropped_queue == 7  # 300 bytes fit: the one on the wire and two behind it
    assert [meta for _, meta in cond.poll(1.0)] == [0, 1, 2]
    cond.send(bytes(100), 1.0, 10)  # the queue drained meanwhile
    assert cond.stats.dropped_queue == 7
    assert cond.pending == 1


def test_bandwidth_queue_frees_as_datagrams_finish() -> None:
    cond = make(LinkProfile(bandwidth=1000.0, queue_limit=200))
    cond.send(bytes(100), 0.0, 0)
    cond.send(bytes(100), 0.0, 1)
    cond.send(bytes(100), 0.05, 2)  # first one is half sent: still occupies its buffer
    assert cond.stats.dropped_queue == 1
    cond.send(bytes(100), 0.1, 3)  # first one fully sent now
    assert cond.stats.dropped_queue == 1
    assert [when for when, _, _ in drain(cond)] == pytest.approx([0.1, 0.2, 0.3])


def test_oversized_datagram_accepted_on_idle_link() -> None:
    cond = make(LinkProfile(bandwidth=10_000.0, queue_limit=100))
    cond.send(bytes(1000), 0.0, 0)
    cond.send(bytes(10), 0.0, 1)
    assert cond.stats.dropped_queue == 1
    assert [when for when, _, _ in drain(cond)] == pytest.approx([0.1])


# -- conditioner: runtime changes, determinism, accounting ------------------------------------


def test_blackout_and_restore_at_runtime() -> None:
    cond = make(LinkProfile(latency=0.01))
    cond.send(b"before", 0.0, 0)
    cond.profile = LinkProfile(loss=1.0)
    for i in range(1, 51):
        cond.send(b"dark", 0.001 * i, i)
    cond.profile = LinkProfile()
    cond.send(b"after", 1.0, 99)
    out = drain(cond)
    assert [(data, meta) for _, data, meta in out] == [(b"before", 0), (b"after", 99)]
    assert out[0][0] == pytest.approx(0.01)  # scheduled before the change: keeps its due time
    assert out[1][0] == 1.0
    assert cond.stats.dropped_loss == 50
    assert cond.profile == LinkProfile()


def test_lowering_latency_lets_new_datagrams_overtake() -> None:
    cond = make(LinkProfile(latency=1.0))
    cond.send(b"slow", 0.0, 0)
    cond.profile = LinkProfile(latency=0.1)
    cond.send(b"fast", 0.1, 1)
    assert [meta for _, _, meta in drain(cond)] == [1, 0]


def test_removing_bandwidth_limit_clears_backlog() -> None:
    cond = make(LinkProfile(bandwidth=100.0, queue_limit=100))
    cond.send(bytes(100), 0.0, 0)
    cond.profile = LinkProfile()
    cond.profile = LinkProfile(bandwidth=100.0, queue_limit=100)
    cond.send(bytes(100), 0.0, 1)  # the old backlog is forgotten: an idle link again
    assert cond.stats.dropped_queue == 0


def test_seeded_runs_are_reproducible() -> None:
    profile = LinkProfile(loss=0.1, latency=0.02, jitter=0.01, duplicate=0.05, corrupt=0.05)
    sends = [(i * 0.002, payload(i)) for i in range(3000)]
    first = run(make(profile, seed=11), sends)
    assert run(make(profile, seed=11), sends) == first
    assert run(make(profile, seed=12), sends) != first


def test_accounting_balances_with_everything_on() -> None:
    profile = LinkProfile(
        loss=0.05,
        latency=0.02,
        jitter=0.01,
        duplicate=0.05,
        reorder=0.05,
        corrupt=0.01,
        bandwidth=50_000.0,
        queue_limit=2000,
    )
    cond = make(profile, seed=13)
    for i in range(5000):
        now = i * 0.001
        cond.send(bytes(100), now, i)
        cond.poll(now)
        assert balanced(cond.stats, cond.pending)
    assert cond.stats.dropped_queue > 0  # 100 kB/s offered into a 50 kB/s link
    drain(cond)
    assert balanced(cond.stats) and cond.pending == 0


def test_clear_drops_pending() -> None:
    cond = make(LinkProfile(latency=1.0))
    for i in range(5):
        cond.send(b"x", 0.0, i)
    assert cond.clear() == 5
    assert cond.next_deadline() is None and cond.poll(10.0) == []


def test_stats_add() -> None:
    total = LinkStats(sent=1, delivered=2, corrupted=3) + LinkStats(sent=10, dropped_queue=4)
    assert total == LinkStats(sent=11, delivered=2, dropped_queue=4, corrupted=3)


# -- ConditionedPipe --------------------------------------------------------------------------


async def test_pipe_perfect_profile_delivers_synchronously() -> None:
    got: list[tuple[bytes, str]] = []
    pipe: ConditionedPipe[str] = ConditionedPipe(
        asyncio.get_running_loop(), LinkProfile(), lambda d, m: got.append((d, m)), seed=1
    )
    pipe.send(b"a", "x")
    pipe.send(b"b", "y")
    assert got == [(b"a", "x"), (b"b", "y")]  # no await in between
    assert pipe.stats.delivered == 2 and pipe.pending == 0


async def test_pipe_latency_and_single_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    live: list[asyncio.TimerHandle] = []
    real_call_at = loop.call_at

    def spy_call_at(
        when: float, callback: Callable[[], None], *args: Any, **kwargs: Any
    ) -> asyncio.TimerHandle:
        if not isinstance(getattr(callback, "__self__", None), ConditionedPipe):
            return real_call_at(when, callback, *args, **kwargs)  # e.g. wait_for's timeout

        def fire() -> None:
            live.remove(handle)
            callback()

        handle = real_call_at(when, fire, *args, **kwargs)
        live[:] = [h for h in live if not h.cancelled()]
        live.append(handle)
        assert len(live) == 1, "the pipe armed a second timer"
        return handle

    monkeypatch.setattr(loop, "call_at", spy_call_at)
    done = loop.create_future()
    times: list[tuple[float, int]] = []

    def deliver(data: bytes, meta: int) -> None:
        times.append((loop.time(), meta))
        if len(times) == 20:
            done.set_result(None)

    pipe: ConditionedPipe[int] = ConditionedPipe(
        loop, LinkProfile(latency=0.03, jitter=0.01), deliver, seed=2
    )
    sent_at = {}
    for i in range(20):
        sent_at[i] = loop.time()
        pipe.send(payload(i), i)
    assert times == []  # nothing is due yet
    await asyncio.wait_for(done, WAIT)
    for when, meta in times:
        assert when - sent_at[meta] >= 0.02 - 1e-6
    assert pipe.pending == 0 and live == []


async def test_pipe_close_drops_queue_and_cancels_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    handles: list[asyncio.TimerHandle] = []
    real_call_at = loop.call_at

    def spy_call_at(
        when: float, callback: Callable[[], None], *args: Any, **kwargs: Any
    ) -> asyncio.TimerHandle:
        handles.append(real_call_at(when, callback, *args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(loop, "call_at", spy_call_at)
    got: list[bytes] = []
    pipe: ConditionedPipe[None] = ConditionedPipe(
        loop, LinkProfile(latency=0.01), lambda d, m: got.append(d)
    )
    pipe.send(b"x", None)
    assert len(handles) == 1 and not handles[0].cancelled()
    pipe.close()
    assert pipe.closed and pipe.pending == 0
    assert handles[0].cancelled()
    pipe.send(b"y", None)  # ignored, arms nothing
    pipe.close()  # idempotent
    assert pipe.pending == 0 and len(handles) == 1 and got == []


async def test_pipe_deliver_errors_reach_exception_handler() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    got: list[int] = []

    def deliver(data: bytes, meta: int) -> None:
        if meta == 0:
            raise RuntimeError("boom")
        got.append(meta)

    pipe: ConditionedPipe[int] = ConditionedPipe(loop, LinkProfile(), deliver)
    try:
        pipe.send(b"a", 0)
        pipe.send(b"b", 1)
    finally:
        loop.set_exception_handler(None)
    assert got == [1]
    assert len(errors) == 1 and isinstance(errors[0]["exception"], RuntimeError)


async def test_pipe_reentrant_send_keeps_order() -> None:
    loop = asyncio.get_running_loop()
    got: list[int] = []
    pipe: ConditionedPipe[int]

    def deliver(data: bytes, meta: int) -> None:
        got.append(meta)
        if meta < 3:
            pipe.send(data, meta + 10)  # echo into the same pipe from inside deliver()

    pipe = ConditionedPipe(loop, LinkProfile(), deliver)
    pipe.send(b"a", 0)
    pipe.send(b"b", 1)
    assert got == [0, 10, 1, 11]


async def test_pipe_profile_setter() -> None:
    loop = asyncio.get_running_loop()
    got: list[int] = []
    pipe: ConditionedPipe[int] = ConditionedPipe(loop, LinkProfile(), lambda d, m: got.append(m))
    pipe.profile = LinkProfile(loss=1.0)
    pipe.send(b"a", 0)
    assert pipe.profile == LinkProfile(loss=1.0)
    pipe.profile = LinkProfile()
    pipe.send(b"b", 1)
    assert got == [1] and pipe.stats.dropped_loss == 1


# -- proxy fixtures ---------------------------------------------------------------------------


class EchoServer(asyncio.DatagramProtocol):
    """Echoes every datagram and remembers where it came from."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.sources: list[tuple[Any, ...]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Python 3.11's selector transport does not subclass DatagramTransport: cast, not assert.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.sources.append(addr)
        assert self.transport is not None
        self.transport.sendto(data, addr)

    @property
    def address(self) -> tuple[str, int]:
        assert self.transport is not None
        host, port = self.transport.get_extra_info("sockname")[:2]
        return host, port


class Client(asyncio.DatagramProtocol):
    """A UDP client connected to one address; received datagrams land in a queue."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Python 3.11's selector transport does not subclass DatagramTransport: cast, not assert.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self.received.put_nowait(data)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.sendto(data)

    async def recv(self) -> bytes:
        return await asyncio.wait_for(self.received.get(), WAIT)

    async def roundtrip(self, data: bytes) -> bytes:
        self.send(data)
        return await self.recv()


async def open_echo(host: str) -> tuple[EchoServer, asyncio.DatagramTransport]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(EchoServer, local_addr=(host, 0))
    return protocol, transport


async def open_client(address: tuple[str, int]) -> Client:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(Client, remote_addr=address)
    return protocol


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll a condition; fail (not hang) if it does not hold within WAIT seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await asyncio.sleep(0.002)


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    protocol, transport = await open_echo("127.0.0.1")
    yield protocol
    transport.close()


@pytest.fixture
async def clients() -> AsyncIterator[list[Client]]:
    opened: list[Client] = []
    yield opened
    for client in opened:
        if client.transport is not None:
            client.transport.close()


async def proxy_for(echo: EchoServer, **kwargs: Any) -> Proxy:
    kwargs.setdefault("upstream", LinkProfile())
    kwargs.setdefault("downstream", LinkProfile())
    return await start_proxy(("127.0.0.1", 0), echo.address, **kwargs)


# -- proxy ------------------------------------------------------------------------------------


async def test_proxy_gives_each_client_its_own_upstream_socket(
    echo: EchoServer, clients: list[Client]
) -> None:
    async with await proxy_for(echo) as proxy:
        assert proxy.address[0] == "127.0.0.1" and proxy.address[1] != 0
        clients.extend([await open_client(proxy.address) for _ in range(4)])
        for round_ in range(3):
            for i, client in enumerate(clients):
                client.send(f"{i}:{round_}".encode())
            for i, client in enumerate(clients):
                assert await client.recv() == f"{i}:{round_}".encode()
        assert proxy.clients == 4
        assert len(set(echo.sources)) == 4  # one source port per client, stable across rounds
        assert len(echo.sources) == 12
        stats = proxy.stats
        assert stats.clients_created == 4
        assert stats.upstream.delivered == 12 and stats.downstream.delivered == 12
    assert proxy.closed and proxy.clients == 0


async def test_proxy_upstream_blackout_and_restore(echo: EchoServer, clients: list[Client]) -> None:
    async with await proxy_for(echo) as proxy:
        client = await open_client(proxy.address)
        clients.append(client)
        assert await client.roundtrip(b"before") == b"before"
        proxy.upstream = LinkProfile(loss=1.0)
        for _ in range(20):
            client.send(b"dark")
        # The loss decision is made on arrival, so once the proxy has seen all 20 they are gone.
        await wait_until(lambda: proxy.stats.upstream.sent == 21, "the proxy saw 21 datagrams")
        assert proxy.stats.upstream.dropped_loss == 20
        assert len(echo.sources) == 1
        proxy.upstream = LinkProfile()
        assert await client.roundtrip(b"after") == b"after"
        assert client.received.empty()


async def test_proxy_downstream_blackout_and_restore(
    echo: EchoServer, clients: list[Client]
) -> None:
    async with await proxy_for(echo) as proxy:
        client = await open_client(proxy.address)
        clients.append(client)
        proxy.downstream = LinkProfile(loss=1.0)
        client.send(b"dark")
        await wait_until(lambda: proxy.stats.downstream.sent == 1, "the echo came back")
        assert proxy.stats.downstream.dropped_loss == 1 and len(echo.sources) == 1
        proxy.downstream = LinkProfile()
        assert await client.roundtrip(b"after") == b"after"
        assert client.received.empty()


async def test_proxy_adds_latency(echo: EchoServer, clients: list[Client]) -> None:
    delayed = LinkProfile(latency=0.02)
    async with await proxy_for(echo, upstream=delayed, downstream=delayed) as proxy:
        client = await open_client(proxy.address)
        clients.append(client)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await client.roundtrip(b"ping") == b"ping"
        assert loop.time() - start >= 0.04 - 1e-3  # a lower bound: cannot fail by being slow


async def test_proxy_expires_idle_clients(echo: EchoServer, clients: list[Client]) -> None:
    async with await proxy_for(echo, idle_timeout=0.05) as proxy:
        client = await open_client(proxy.address)
        clients.append(client)
        assert await client.roundtrip(b"one") == b"one"
        await wait_until(lambda: proxy.clients == 0, "the idle client expired")
        assert proxy.stats.clients_expired == 1
        assert await client.roundtrip(b"two") == b"two"
        assert echo.sources[0] != echo.sources[1]  # a fresh upstream socket
        assert proxy.stats.clients_created == 2


async def test_proxy_max_clients(echo: EchoServer, clients: list[Client]) -> None:
    async with await proxy_for(echo, max_clients=1) as proxy:
        first, second = await open_client(proxy.address), await open_client(proxy.address)
        clients.extend([first, second])
        assert await first.roundtrip(b"a") == b"a"
        second.send(b"b")
        await wait_until(lambda: proxy.stats.clients_rejected == 1, "the second was refused")
        assert proxy.clients == 1 and len(echo.sources) == 1


async def test_proxy_survives_unreachable_target(clients: list[Client]) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    # Bind then close a socket to get a loopback port with nobody listening.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()
    try:
        empty = LinkProfile()
        proxy = await start_proxy(("127.0.0.1", 0), dead, upstream=empty, downstream=empty)
        async with proxy:
            client = await open_client(proxy.address)
            clients.append(client)
            for _ in range(5):
                client.send(b"anyone?")
            # ICMP port unreachable comes back to the connected upstream socket as an error.
            await wait_until(lambda: proxy.stats.errors >= 1, "a socket error was counted")
            assert proxy.stats.upstream.sent == 5
    finally:
        loop.set_exception_handler(None)
    assert errors == []


async def test_proxy_ipv6(clients: list[Client]) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        echo, transport = await open_echo("::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    try:
        empty = LinkProfile()
        proxy = await start_proxy(("::1", 0), echo.address, upstream=empty, downstream=empty)
        async with proxy:
            assert proxy.address[0] == "::1"
            client = await open_client(proxy.address)
            clients.append(client)
            assert await client.roundtrip(b"six") == b"six"
            assert format_address(proxy.address) == f"[::1]:{proxy.address[1]}"
    finally:
        transport.close()


async def test_start_proxy_validation(echo: EchoServer) -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        await proxy_for(echo, idle_timeout=0.0)
    with pytest.raises(ValueError, match="max_clients"):
        await proxy_for(echo, max_clients=0)


async def test_proxy_close_is_idempotent(echo: EchoServer) -> None:
    proxy = await proxy_for(echo, upstream=LinkProfile(latency=10.0))
    await proxy.close()
    await proxy.close()
    assert proxy.closed


# -- command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("localhost:0", ("localhost", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("[fe80::1%lo]:1", ("fe80::1%lo", 1)),
    ],
)
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["9000", ":9000", "host:", "host:x", "host:70000", "::1:9000"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


def test_profile_from_args() -> None:
    parser = build_parser()
    base = ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:9"]
    impairments = ["--loss", "0.05", "--delay-ms", "20", "--jitter-ms", "5", "--dup", "0.01"]
    impairments += ["--reorder", "0.02", "--corrupt", "0.001", "--bandwidth-kbps", "800"]
    args = parser.parse_args([*base, *impairments])
    profile = profile_from_args(args)
    assert profile.loss == 0.05 and profile.duplicate == 0.01 and profile.corrupt == 0.001
    assert profile.latency == pytest.approx(0.02) and profile.jitter == pytest.approx(0.005)
    assert profile.reorder == 0.02 and profile.bandwidth == pytest.approx(100_000.0)
    burst = profile_from_args(parser.parse_args([*base, "--burst-loss", "0.1", "--burst-len", "4"]))
    assert burst.burst == GilbertElliott.from_mean(0.1, 4.0)
    with pytest.raises(ValueError, match="either"):
        profile_from_args(parser.parse_args([*base, "--loss", "0.1", "--burst-loss", "0.1"]))
    with pytest.raises(ValueError, match="burst-loss"):
        profile_from_args(parser.parse_args([*base, "--burst-len", "3"]))


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rudp.netsim",
        *args,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_cli_runs_and_stops_on_signal(
    echo: EchoServer, clients: list[Client], signum: int
) -> None:
    target = format_address(echo.address)
    proc = await _spawn("--listen", "127.0.0.1:0", "--target", target, "--delay-ms", "1")
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 15.0)).decode()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+), forwarding to (\S+)", line)
        assert match, line
        assert match.group(2) == target
        client = await open_client(("127.0.0.1", int(match.group(1))))
        clients.append(client)
        assert await client.roundtrip(b"via cli") == b"via cli"
        proc.send_signal(signum)
        out, err = await asyncio.wait_for(proc.communicate(), 15.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    summary = out.decode()
    assert "clients: 1 created" in summary
    assert re.search(r"upstream\s+sent=1 delivered=1", summary), summary
    assert re.search(r"downstream\s+sent=1 delivered=1", summary), summary


async def test_cli_rejects_bad_arguments() -> None:
    proc = await _spawn("--listen", "nowhere", "--target", "127.0.0.1:9")
    _, err = await asyncio.wait_for(proc.communicate(), 15.0)
    assert proc.returncode == 2
    assert b"HOST:PORT" in err


def test_delay_line_is_bounded_without_a_bandwidth_limit() -> None:
    from rudp.netsim.conditioner import MAX_IN_FLIGHT_BYTES

    cond = make(LinkProfile(latency=60.0), seed=1)
    datagram = bytes(1200)
    n = MAX_IN_FLIGHT_BYTES // len(datagram) + 500
    for i in range(n):
        cond.send(datagram, i * 1e-6, i)
    assert cond.pending * len(datagram) <= MAX_IN_FLIGHT_BYTES
    assert cond.stats.dropped_queue == 500
