"""Every datagram of one source to one socket of a group (`matchmaker.steering`)."""

from __future__ import annotations

import ipaddress
import random
import socket
import struct
import time
from collections import Counter, defaultdict

import pytest

from matchmaker.steering import pick, program, steer_by_source

KEY = 0x5EED1234


def group(host: str, n: int, family: socket.AddressFamily) -> list[socket.socket]:
    socks: list[socket.socket] = []
    port = 0
    for _ in range(n):
        s = socket.socket(family, socket.SOCK_DGRAM)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        port = s.getsockname()[1]
        s.setblocking(False)
        socks.append(s)
    return socks


def where(socks: list[socket.socket], sources: list[str], ports_each: int) -> dict[str, set[int]]:
    """Which sockets each source's datagrams reached, from ``ports_each`` ports each
    (every datagram read: loopback queues them before ``sendto`` returns)."""
    port = socks[0].getsockname()[1]
    for source in sources:
        family = socket.AF_INET6 if ":" in source else socket.AF_INET
        target = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        for _ in range(ports_each):
            with socket.socket(family, socket.SOCK_DGRAM) as c:
                c.bind((source, 0))
                c.sendto(source.encode(), (target, port))
    reached: dict[str, set[int]] = defaultdict(set)
    count, expected = 0, len(sources) * ports_each
    deadline = time.monotonic() + 10
    while count < expected and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            while True:
                try:
                    data = s.recv(100)
                except BlockingIOError:
                    break
                reached[data.decode()].add(i)
                count += 1
        time.sleep(0.01)
    assert count == expected
    return reached


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_one_source_reaches_one_socket_whatever_its_port() -> None:
    socks = group("127.0.0.1", 4, socket.AF_INET)
    try:
        steer_by_source(socks[0], 4, KEY)
        sources = [f"127.0.{i // 200}.{i % 200 + 1}" for i in range(40)]
        reached = where(socks, sources, ports_each=5)
        # The kernel's own hash (the 4-tuple) would spread 5 ports over the group;
        # the program sends each source where the model says.
        assert reached == {s: {pick(ipaddress.ip_address(s), 4, KEY)} for s in sources}
        assert len(set.union(*reached.values())) == 4
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_a_dual_stack_group_steers_both_families() -> None:
    socks = group("::", 4, socket.AF_INET6)
    try:
        steer_by_source(socks[0], 4, KEY)
        sources = [f"127.0.0.{i}" for i in range(1, 21)] + ["::1"]
        reached = where(socks, sources, ports_each=5)
        assert reached == {s: {pick(ipaddress.ip_address(s), 4, KEY)} for s in sources}
    finally:
        for s in socks:
            s.close()


def run(instructions: list[bytes], header: bytes) -> int:
    """Classic BPF as the kernel runs it here: 32-bit A and X, loads relative to
    the network header (``SKF_NET_OFF``)."""
    a = x = pc = 0
    while True:
        code, jt, jf, k = struct.unpack("=HBBI", instructions[pc])
        pc += 1
        if code in (0x30, 0x20):  # LD B / LD W, ABS, at SKF_NET_OFF + offset
            offset = k - (1 << 32) + 0x100000
            size = 1 if code == 0x30 else 4
            a = int.from_bytes(header[offset : offset + size], "big")
        elif code == 0x07:
            x = a
        elif code == 0x16:
            return a
        elif code == 0x15:
            pc += jt if a == k else jf
        elif code == 0x05:
            pc += k
        else:
            operate = {0x74: a >> k, 0x24: a * k, 0xA4: a ^ k, 0xAC: a ^ x}
            a = operate[code] & 0xFFFFFFFF


def ipv6_header(source: ipaddress.IPv6Address) -> bytes:
    return b"\x60" + bytes(7) + source.packed + bytes(16)


def ipv4_header(source: ipaddress.IPv4Address, options: int = 0) -> bytes:
    return bytes([0x45 + options]) + bytes(11) + source.packed + bytes(4 + 4 * options)


def test_the_program_computes_the_model_for_both_families() -> None:
    rng = random.Random(3)
    for n in (2, 3, 4, 8, 65_535):
        instructions = program(n, KEY)
        for _ in range(200):
            v6 = ipaddress.IPv6Address(rng.getrandbits(128))
            v4 = ipaddress.IPv4Address(rng.getrandbits(32))
            assert run(instructions, ipv6_header(v6)) == pick(v6, n, KEY) < n
            assert run(instructions, ipv4_header(v4, options=rng.randrange(3))) == pick(v4, n, KEY)


def test_an_ipv6_64_is_one_source_and_sparse_prefixes_spread() -> None:
    prefix = int(ipaddress.IPv6Address("2001:db8:1:2::"))
    hosts = [ipaddress.IPv6Address(prefix | random.Random(i).getrandbits(64)) for i in range(50)]
    assert {pick(h, 4, KEY) for h in hosts} == {pick(hosts[0], 4, KEY)}
    # One /64 in each of 64 /48s (a sparse delegation): the worker depends on
    # every bit of the prefix, not the low ones alone.
    sparse = [ipaddress.IPv6Address(f"2001:db8:{i:x}::1") for i in range(64)]
    spread = Counter(pick(a, 4, KEY) for a in sparse)
    assert len(spread) == 4 and min(spread.values()) >= 8, spread


def test_the_key_changes_the_mapping() -> None:
    sources = [ipaddress.IPv4Address(f"198.51.100.{i}") for i in range(1, 101)]
    one = [pick(s, 4, KEY) for s in sources]
    other = [pick(s, 4, KEY ^ 0xFFFF) for s in sources]
    assert sum(a != b for a, b in zip(one, other, strict=True)) > 50


def test_the_program_is_checked() -> None:
    for n in (0, 65_536):
        with pytest.raises(ValueError, match="a group of 1 to 65535 sockets"):
            program(n, KEY)
