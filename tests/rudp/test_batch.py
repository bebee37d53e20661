"""``rudp._batch`` (recvmmsg / sendmmsg) against the per-datagram socket calls it replaces.

The extension must return what ``socket.recvfrom`` returns and send what ``sendto``
sends, byte for byte and address for address, and the asyncio endpoint must handle
the errors of a batch exactly as it handles ``sendto``'s. Skipped where the extension
is not built (a pure install, or not Linux); ``test_build.py`` checks it is there in
the compiled build.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import rudp

batch: Any = pytest.importorskip("rudp._batch")

V4 = "127.0.0.1"
V6 = "::1"


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind((V6, 0))
    except OSError:
        return False
    return True


FAMILIES = [
    pytest.param(socket.AF_INET, V4, id="ipv4"),
    pytest.param(
        socket.AF_INET6,
        V6,
        id="ipv6",
        marks=pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback"),
    ),
]


def _udp(family: int, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    sock.setblocking(False)
    return sock


def _payloads(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, 32, 200, 1200, 1472, 9000, 65_000] + [rng.randint(0, 1500) for _ in range(40)]
    return [rng.randbytes(size) for size in sizes]


def _recvfrom_all(sock: socket.socket) -> list[tuple[bytes, Any]]:
    out = []
    while True:
        try:
            out.append(sock.recvfrom(65536))
        except BlockingIOError:
            return out


def _recv_many_all(sock: socket.socket, limit: int, cache: dict[object, object]) -> list[Any]:
    out: list[Any] = []
    while True:
        got = batch.recv_many(sock.fileno(), limit, cache)
        out.extend(got)
        if len(got) < limit:
            return out


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


@pytest.mark.parametrize(("family", "host"), FAMILIES)
@pytest.mark.parametrize("limit", [1, 7, 64])
def test_recv_many_returns_what_recvfrom_returns(
    family: int, host: str, limit: int, sockets: list[socket.socket]
) -> None:
    sender, by_call, by_batch = (_udp(family, host) for _ in range(3))
    sockets += [sender, by_call, by_batch]
    payloads = _payloads(limit)
    for data in payloads:
        sender.sendto(data, by_call.getsockname())
        sender.sendto(data, by_batch.getsockname())
    cache: dict[object, object] = {}
    expected = _recvfrom_all(by_call)
    got = _recv_many_all(by_batch, limit, cache)
    assert [d for d, _ in expected] == payloads
    assert got == expected
    assert all(type(a) is tuple for _, a in got)
    # One tuple per peer, built once: its hash (and the core's lookups) are cached.
    assert len({id(a) for _, a in got}) == 1
    assert batch.recv_many(by_batch.fileno(), limit, cache) == []


def test_recv_many_raises_what_recvfrom_raises() -> None:
    sock = _udp(socket.AF_INET, V4)
    fd = sock.fileno()
    sock.close()
    with pytest.raises(OSError) as by_call:
        sock.recvfrom(65536)
    with pytest.raises(OSError) as by_batch:
        batch.recv_many(fd, 8, {})
    assert by_batch.value.errno == by_call.value.errno == errno.EBADF


@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_send_many_sends_what_sendto_sends(
    family: int, host: str, sockets: list[socket.socket]
) -> None:
    # Two senders, two receivers, more than one batch (BATCH per sendmmsg).
    a, b, by_call, by_batch = (_udp(family, host) for _ in range(4))
    other = _udp(family, host)
    sockets += [a, b, by_call, by_batch, other]
    payloads = _payloads(7) * 3
    targets = [by_call.getsockname(), other.getsockname()]
    for i, data in enumerate(payloads):
        a.sendto(data, targets[i % 2])
    direct = _recvfrom_all(by_call), _recvfrom_all(other)
    targets = [by_batch.getsockname(), other.getsockname()]
    datagrams = [(data, targets[i % 2]) for i, data in enumerate(payloads)]
    assert len(datagrams) > batch.BATCH
    cache: dict[object, object] = {}
    assert batch.send_many(b.fileno(), family, datagrams, 0, cache) == (len(datagrams), 0)
    batched = _recvfrom_all(by_batch), _recvfrom_all(other)
    for got, want in zip(batched, direct, strict=True):
        assert [d for d, _ in got] == [d for d, _ in want]
    assert {a for _, a in batched[0]} == {b.getsockname()}


def test_send_many_stops_at_a_refused_datagram_and_resumes_after_it(
    sockets: list[socket.socket],
) -> None:
    sender, receiver = _udp(socket.AF_INET, V4), _udp(socket.AF_INET, V4)
    sockets += [sender, receiver]
    to = receiver.getsockname()
    datagrams = [(b"one", to), (bytes(70_000), to), (b"two", to), (b"three", to)]
    with pytest.raises(OSError) as by_call:
        sender.sendto(bytes(70_000), to)
    fd, cache = sender.fileno(), {}
    assert batch.send_many(fd, socket.AF_INET, datagrams, 0, cache) == (1, by_call.value.errno)
    assert by_call.value.errno == errno.EMSGSIZE
    assert batch.send_many(fd, socket.AF_INET, datagrams, 2, cache) == (4, 0)
    assert [d for d, _ in _recvfrom_all(receiver)] == [b"one", b"two", b"three"]


def test_send_many_leaves_addresses_it_does_not_convert_to_sendto(
    sockets: list[socket.socket],
) -> None:
    sender, receiver = _udp(socket.AF_INET, V4), _udp(socket.AF_INET, V4)
    sockets += [sender, receiver]
    port = receiver.getsockname()[1]
    datagrams: list[Any] = [
        (b"a", (V4, port)),
        (b"b", ("localhost", port)),  # a name: the socket module resolves it
        (b"c", [V4, port]),  # not a tuple
        (b"d", (V4, 70_000)),  # out of range: sendto raises OverflowError
        (b"e", (V4, port)),
    ]
    fd, family, cache = sender.fileno(), socket.AF_INET, {}
    assert batch.send_many(fd, family, datagrams, 0, cache) == (1, -1)
    assert batch.send_many(fd, family, datagrams, 2, cache) == (2, -1)
    assert batch.send_many(fd, family, datagrams, 3, cache) == (3, -1)
    assert batch.send_many(fd, family, datagrams, 4, cache) == (5, 0)
    assert [d for d, _ in _recvfrom_all(receiver)] == [b"a", b"e"]


def test_the_address_cache_stays_bounded(sockets: list[socket.socket]) -> None:
    # One entry per address sent to (or received from); spoofed or scanned addresses
    # cannot grow it past CACHE_LIMIT: it is cleared then, and fills again.
    sender = _udp(socket.AF_INET, V4)
    sockets.append(sender)
    limit = batch.CACHE_LIMIT
    datagrams = [(b"", (V4, 1 + i % 65535)) for i in range(limit + 10)]
    cache: dict[object, object] = {}
    assert batch.send_many(sender.fileno(), socket.AF_INET, datagrams, 0, cache) == (
        len(datagrams),
        0,
    )
    assert len(cache) == 10


class _Shrinking(tuple):  # type: ignore[type-arg]
    """A cache key whose comparison empties the list being sent (a caller's misuse)."""

    victim: list[Any] = []

    def __eq__(self, other: object) -> bool:
        self.victim.clear()
        return tuple.__eq__(self, other)

    __hash__ = tuple.__hash__


def test_send_many_sends_from_a_snapshot_of_the_list(sockets: list[socket.socket]) -> None:
    # Python code may run inside send_many (a cache key's __eq__ in the lookup): a
    # list emptied under it must not be read past its end (it used to crash).
    sender, receiver = _udp(socket.AF_INET, V4), _udp(socket.AF_INET, V4)
    sockets += [sender, receiver]
    address = receiver.getsockname()
    datagrams: list[Any] = [(b"%d" % i, address) for i in range(40)]
    cache: dict[object, object] = {_Shrinking(address): None}
    _Shrinking.victim = datagrams
    assert batch.send_many(sender.fileno(), socket.AF_INET, datagrams, 0, cache) == (40, 0)
    assert datagrams == []
    got = [data for data, _ in _recvfrom_all(receiver)]
    assert got == [b"%d" % i for i in range(40)]


def test_an_address_equal_to_a_cached_one_but_not_plain_goes_to_sendto(
    sockets: list[socket.socket],
) -> None:
    # (host, 5000.0) and (host, True) hash and compare equal to ints; sendto refuses a
    # float port and reads True as 1, so the cached sockaddr must not be used for them.
    sender, receiver = _udp(socket.AF_INET, V4), _udp(socket.AF_INET, V4)
    sockets += [sender, receiver]
    host, port = receiver.getsockname()
    fd, cache = sender.fileno(), {}
    assert batch.send_many(fd, socket.AF_INET, [(b"a", (host, port))], 0, cache) == (1, 0)
    cache[(host, 1)] = cache[(host, port)]  # port 1's key now names the receiver's sockaddr
    odd: list[Any] = [
        (b"b", (host, float(port))),
        (b"c", (host, True)),
        (b"d", _Shrinking((host, port))),
    ]
    for i in range(len(odd)):
        assert batch.send_many(fd, socket.AF_INET, odd, i, cache) == (i, -1)
    assert [d for d, _ in _recvfrom_all(receiver)] == [b"a"]


# Run in a child: a cached sockaddr longer than sockaddr_storage used to be copied
# over send_many's stack, which crashed the interpreter.
_BAD_CACHE_VALUES = """
import socket, sys
from rudp import _batch

family, host = int(sys.argv[1]), sys.argv[2]
receiver = socket.socket(family, socket.SOCK_DGRAM)
receiver.bind((host, 0))
sender = socket.socket(family, socket.SOCK_DGRAM)
address = receiver.getsockname()
good = {}
assert _batch.send_many(sender.fileno(), family, [(b"", address)], 0, good) == (1, 0)
receiver.recvfrom(16)
for bad in (b"\\x02\\x00" + b"A" * 4094, bytes(good[address]) + b"A", b"\\x02\\x00", b"", None):
    cache = {address: bad}
    datagrams = [(b"%d" % i, address) for i in range(3 * _batch.BATCH)]
    assert _batch.send_many(sender.fileno(), family, datagrams, 0, cache) == (len(datagrams), 0)
    assert cache == good, (bad, cache)
    assert [receiver.recvfrom(16)[0] for _ in datagrams] == [d for d, _ in datagrams]
print("ok")
"""


@pytest.mark.parametrize(("family", "host"), FAMILIES)
def test_a_cached_sockaddr_of_the_wrong_length_is_converted_again(family: int, host: str) -> None:
    # The cache is a plain dict its caller can write to: send_many uses a cached value
    # only if it has the length it stores itself, and replaces any other.
    root = os.path.dirname(os.path.dirname(os.path.abspath(rudp.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _BAD_CACHE_VALUES, str(int(family)), host],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr


# -- the asyncio endpoint's handling of a batch's errors ------------------------------------


class ScriptedBatch:
    """rudp._batch whose send_many fails as told: {call number: (datagrams sent, errno)}."""

    BATCH = batch.BATCH

    def __init__(self, script: dict[int, tuple[int, int]]) -> None:
        self.script = script
        self.calls = 0
        self.recv_many = batch.recv_many

    def send_many(self, fd: int, family: int, datagrams: list[Any], start: int, cache: Any) -> Any:
        self.calls += 1
        if self.calls not in self.script:
            return batch.send_many(fd, family, datagrams, start, cache)
        sent, err = self.script[self.calls]
        done, ok = batch.send_many(fd, family, datagrams[: start + sent], start, cache)
        assert ok == 0
        return done, err


async def _received(sock: socket.socket, count: int) -> list[bytes]:
    got: list[bytes] = []
    async with asyncio.timeout(5):
        while len(got) < count:
            got += [d for d, _ in _recvfrom_all(sock)]
            await asyncio.sleep(0.005)
    return got


async def _idle(conn: rudp.Connection) -> None:
    await conn.wait_closed()


@pytest.mark.parametrize("batched", [True, False], ids=["sendmmsg", "sendto"])
async def test_a_refused_datagram_in_a_flush_is_counted_and_the_rest_leaves(batched: bool) -> None:
    async with await rudp.serve(_idle, V4, 0) as server:
        endpoint = server.endpoint
        endpoint._batch = batch if batched else None
        with _udp(socket.AF_INET, V4) as receiver:
            to = receiver.getsockname()
            datagrams = [(b"\xb1one", to), (bytes(70_000), to), (b"\xb1two", to)]
            endpoint._send_all(datagrams)
            assert await _received(receiver, 2) == [b"\xb1one", b"\xb1two"]
            assert endpoint.datagrams_too_large == 1 and endpoint.send_errors == 0


@pytest.mark.parametrize("err", [errno.EAGAIN, errno.EINTR])
async def test_a_batch_that_would_block_is_buffered_and_sent_in_order(err: int) -> None:
    async with await rudp.serve(_idle, V4, 0) as server:
        endpoint = server.endpoint
        endpoint._batch = ScriptedBatch({1: (2, err)})
        with _udp(socket.AF_INET, V4) as receiver:
            to = receiver.getsockname()
            datagrams = [(b"\xb1%d" % i, to) for i in range(6)]
            endpoint._send_all(datagrams)
            assert len(endpoint._send_buffer) == 4  # the loop sends them when writable
            assert await _received(receiver, 6) == [d for d, _ in datagrams]
            assert not endpoint._send_buffer and endpoint.send_errors == 0


@pytest.mark.parametrize("err", [errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENOBUFS])
async def test_a_batch_error_is_counted_for_its_datagram_and_the_rest_leaves(err: int) -> None:
    async with await rudp.serve(_idle, V4, 0) as server:
        endpoint = server.endpoint
        scripted = ScriptedBatch({1: (1, err)})
        endpoint._batch = scripted
        with _udp(socket.AF_INET, V4) as receiver:
            to = receiver.getsockname()
            datagrams = [(b"\xb1%d" % i, to) for i in range(100)]
            endpoint._send_all(datagrams)
            want = [d for i, (d, _) in enumerate(datagrams) if i != 1]
            assert await _received(receiver, 99) == want
            assert endpoint.send_errors == 1 and endpoint.datagrams_too_large == 0
            assert scripted.calls == 2  # the rest left in one more call (two sendmmsg)


async def test_an_address_left_to_sendto_is_sent_by_it() -> None:
    async with await rudp.serve(_idle, V4, 0) as server:
        endpoint = server.endpoint
        endpoint._batch = batch
        with _udp(socket.AF_INET, V4) as receiver:
            port = receiver.getsockname()[1]
            datagrams = [(b"\xb1a", (V4, port)), (b"\xb1b", ("localhost", port))]
            datagrams.append((b"\xb1c", (V4, port)))
            endpoint._send_all(datagrams)
            assert await _received(receiver, 3) == [b"\xb1a", b"\xb1b", b"\xb1c"]


async def test_a_read_takes_a_burst_in_batches_with_empty_datagrams() -> None:
    # recvmmsg reads an empty datagram like any other (the per-datagram path leaves it
    # for the next wake-up: see test_aio.py), and a burst larger than a batch whole.
    got: list[bytes] = []

    def mine(data: bytes, address: object) -> list[bytes]:
        got.append(data)
        return []

    async with await rudp.serve(_idle, V4, 0) as server:
        server.set_datagram_handler(0xB1, mine)
        endpoint = server.endpoint
        endpoint._batch = batch  # (whatever RUDP_NO_NATIVE says)
        with _udp(socket.AF_INET, V4) as sock:
            burst = [b"\xb1%d" % i for i in range(150)]
            for data in burst[:75]:
                sock.sendto(data, server.address)
            sock.sendto(b"", server.address)
            for data in burst[75:]:
                sock.sendto(data, server.address)
            endpoint._read_ready()
            assert got == burst
            assert sum(server.stats.dropped.values()) == 1  # the empty one, counted


async def test_a_read_stops_where_a_handler_closes_the_endpoint() -> None:
    # The rest of a batch read before the close goes nowhere, and the closed
    # descriptor is not read again.
    got: list[bytes] = []
    async with await rudp.serve(_idle, V4, 0) as server:
        endpoint = server.endpoint

        def mine(data: bytes, address: object) -> list[bytes]:
            got.append(data)
            endpoint.close_now()
            return []

        server.set_datagram_handler(0xB1, mine)
        endpoint._batch = batch  # (whatever RUDP_NO_NATIVE says)
        with _udp(socket.AF_INET, V4) as sock:
            for i in range(10):
                sock.sendto(b"\xb1%d" % i, server.address)
            endpoint._read_ready()
    assert got == [b"\xb10"]
