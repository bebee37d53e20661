"""Every datagram of one source to one socket of a group (`matchmaker.steering`)."""

from __future__ import annotations

import socket
import time
from collections import defaultdict

import pytest

from matchmaker.steering import program, steer_by_source


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
    """Which sockets each source's datagrams reached, from ``ports_each`` ports each."""
    port = socks[0].getsockname()[1]
    for source in sources:
        family = socket.AF_INET6 if ":" in source else socket.AF_INET
        target = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        for _ in range(ports_each):
            with socket.socket(family, socket.SOCK_DGRAM) as c:
                c.bind((source, 0))
                c.sendto(source.encode(), (target, port))
    reached: dict[str, set[int]] = defaultdict(set)
    deadline = time.monotonic() + 10
    while sum(map(len, reached.values())) < len(sources) and time.monotonic() < deadline:
        for i, s in enumerate(socks):
            while True:
                try:
                    data = s.recv(100)
                except BlockingIOError:
                    break
                reached[data.decode()].add(i)
        time.sleep(0.01)
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
        steer_by_source(socks[0], 4)
        sources = [f"127.0.0.{i}" for i in range(1, 21)]
        reached = where(socks, sources, ports_each=5)
        assert set(reached) == set(sources)
        # The kernel's own hash (the 4-tuple) would spread 5 ports over the group.
        assert all(len(s) == 1 for s in reached.values()), dict(reached)
        assert len(set.union(*reached.values())) >= 3  # and the sources spread
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_a_dual_stack_group_steers_both_families() -> None:
    socks = group("::", 4, socket.AF_INET6)
    try:
        steer_by_source(socks[0], 4)
        sources = [f"127.0.0.{i}" for i in range(1, 11)] + ["::1"]
        reached = where(socks, sources, ports_each=5)
        assert set(reached) == set(sources)
        assert all(len(s) == 1 for s in reached.values()), dict(reached)
    finally:
        for s in socks:
            s.close()


def test_the_program_is_checked() -> None:
    assert len(program(2)) == 13
    for n in (0, 65_536):
        with pytest.raises(ValueError, match="a group of 1 to 65535 sockets"):
            program(n)
