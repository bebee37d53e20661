"""A userspace impaired link between two network namespaces, through TUN devices.

Kernel netem is not always available (containers, CI), yet a benchmark against TCP needs the
real kernel TCP stack (its retransmission timers, SACK, tail-loss probes) to run over the same
lossy, jittery path as everything else. This module builds that path out of parts that need only
root and ``/dev/net/tun``::

    namespace A                 bridge process (root namespace)                namespace B
    10.77.0.1 [tun a] <--fd--> LinkConditioner a->b, LinkConditioner b->a <--fd--> [tun b] 10.77.0.2

Every IPv4 packet that namespace A routes to 10.77.0.2 leaves through its TUN device; the bridge
reads it from the device's file descriptor, runs it through the A->B
:class:`~rudp.netsim.conditioner.LinkConditioner` (loss, delay, jitter...) and writes it, when
due, into B's TUN device, where B's kernel receives it as if from a wire; the other direction has
its own conditioner. Anything that isn't IPv4 (IPv6 neighbour discovery and the like) is dropped
without touching the conditioners, so their random streams only ever see the benchmark's traffic.

Processes join a side with :func:`enter_namespace` (``setns(2)``) before opening any socket.
:class:`TunLink` creates the namespaces and devices and removes them on exit, error included;
:func:`unavailable` says why the link cannot be built here (not root, no TUN device, no ``ip``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import multiprocessing
import os
import random
import re
import select
import shutil
import struct
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection as Pipe
from types import TracebackType
from typing import Any

from rudp.netsim import LinkConditioner, LinkProfile

TUN_PATH = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_PACKET = 65536

SUBNET_PREFIX = "10.77.0"  # private; it only exists inside the namespaces created here
PREFIX_LEN = 24


@dataclass(frozen=True)
class Side:
    """One end of the link: a namespace, its TUN device and its address."""

    namespace: str
    device: str
    address: str


def unavailable() -> str | None:
    """Why a TUN link cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "not root (network namespaces and TUN devices need CAP_NET_ADMIN)"
    if not os.path.exists(TUN_PATH):
        return f"no {TUN_PATH}"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    try:
        os.close(os.open(TUN_PATH, os.O_RDWR))
    except OSError as exc:
        return f"cannot open {TUN_PATH}: {exc.strerror}"
    return None


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (made by ``ip netns add``).

    Call it before creating sockets and threads: existing sockets stay where they were made.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _open_tun(name: str) -> int:
    fd = os.open(TUN_PATH, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


# -- the bridge process ------------------------------------------------------------------------


class _Direction:
    """One direction of the bridge: a TUN to read from, a conditioner, a TUN to write to."""

    def __init__(self, name: str, src: int, dst: int) -> None:
        self.name = name
        self.src = src
        self.dst = dst
        self.conditioner: LinkConditioner[None] = LinkConditioner(
            LinkProfile(), rng=random.Random(0)
        )
        self.not_ipv4 = 0
        self.write_errors = 0
        self.max_late = 0.0

    def reset(self, profile: LinkProfile, seed: int) -> None:
        self.conditioner = LinkConditioner(profile, rng=random.Random(seed))
        self.not_ipv4 = 0
        self.write_errors = 0
        self.max_late = 0.0

    def read_all(self, now: float) -> None:
        send = self.conditioner.send
        while True:
            try:
                packet = os.read(self.src, MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            if not packet or packet[0] >> 4 != 4:
                self.not_ipv4 += 1
                continue
            send(packet, now, None)

    def write_due(self, now: float) -> None:
        due = self.conditioner.next_deadline()
        if due is None or due > now:
            return
        # The earliest packet is the latest of the batch: the bridge's own delay (a busy CPU).
        self.max_late = max(self.max_late, now - due)
        for packet, _ in self.conditioner.poll(now):
            try:
                os.write(self.dst, packet)
            except OSError:  # device not up yet, or its queue full: the packet is lost
                self.write_errors += 1

    def stats(self) -> dict[str, float]:
        return {
            **asdict(self.conditioner.stats),
            "pending": self.conditioner.pending,
            "not_ipv4": self.not_ipv4,
            "write_errors": self.write_errors,
            "max_late_ms": 1e3 * self.max_late,
        }


def _bridge_main(devices: tuple[str, str], pipe: Pipe) -> None:
    """Open both TUN devices, then forward packets until told to stop.

    Commands on ``pipe``: ("reset", (profile, seed)) installs fresh conditioners (seeded ``seed``
    for a->b, ``seed + 1`` for b->a) and drops what was in flight; ("stats", None) answers with
    both directions' counters; ("stop", None) ends the process.
    """
    try:
        fd_a, fd_b = _open_tun(devices[0]), _open_tun(devices[1])
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ready", None))
    directions = {fd_a: _Direction("a->b", fd_a, fd_b), fd_b: _Direction("b->a", fd_b, fd_a)}
    control = pipe.fileno()
    watched = [fd_a, fd_b, control]
    clock = time.monotonic
    try:
        while True:
            deadlines = [
                t for d in directions.values() if (t := d.conditioner.next_deadline()) is not None
            ]
            timeout = max(0.0, min(deadlines) - clock()) if deadlines else None
            readable, _, _ = select.select(watched, [], [], timeout)
            now = clock()
            for fd in readable:
                if fd != control:
                    directions[fd].read_all(now)
            now = clock()
            for direction in directions.values():
                direction.write_due(now)
            if control in readable:
                command, arg = pipe.recv()
                if command == "stop":
                    return
                if command == "reset":
                    profile, seed = arg
                    for offset, direction in enumerate(directions.values()):
                        direction.reset(profile, seed + offset)
                    pipe.send(("ok", None))
                elif command == "stats":
                    pipe.send(("ok", {d.name: d.stats() for d in directions.values()}))
    finally:
        os.close(fd_a)
        os.close(fd_b)


def _remove_stale() -> None:
    """Delete namespaces left by runs that were killed outright (their process is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        match = re.fullmatch(r"rudpbench-(\d+)-[ab]", line.split(" ")[0])
        if match and not os.path.exists(f"/proc/{match[1]}"):
            subprocess.run(["ip", "netns", "del", match[0]], capture_output=True)


# -- the link ----------------------------------------------------------------------------------


class TunLink:
    """Two namespaces joined by the bridge; a context manager that cleans everything up.

    Side ``a`` is 10.77.0.1, side ``b`` 10.77.0.2. Call :meth:`reset` before each measurement to
    restart both directions' conditioners from the same seed.
    """

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())  # devices: "rb" + 7 digits + "a" < 16 characters
        self.a = Side(f"rudpbench-{tag}-a", f"rb{tag}a", f"{SUBNET_PREFIX}.1")
        self.b = Side(f"rudpbench-{tag}-b", f"rb{tag}b", f"{SUBNET_PREFIX}.2")
        self._made: list[str] = []
        self._bridge: multiprocessing.process.BaseProcess | None = None
        self._pipe: Pipe | None = None

    def __enter__(self) -> TunLink:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        _remove_stale()
        for side in (self.a, self.b):
            _ip("netns", "add", side.namespace)
            self._made.append(side.namespace)
        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe()
        self._pipe = parent
        self._bridge = mp.Process(
            target=_bridge_main,
            args=((self.a.device, self.b.device), child),
            name="tunlink-bridge",
            daemon=True,
        )
        self._bridge.start()
        self._expect("ready", 20.0)
        # The devices were created in this (the root) namespace by the bridge, which keeps their
        # file descriptors; moving them resets their configuration, so configure them after.
        for side in (self.a, self.b):
            _ip("link", "set", side.device, "netns", side.namespace)
            _ip("-n", side.namespace, "link", "set", "lo", "up")
            _ip(
                "-n",
                side.namespace,
                "addr",
                "add",
                f"{side.address}/{PREFIX_LEN}",
                "dev",
                side.device,
            )
            _ip("-n", side.namespace, "link", "set", side.device, "up")

    def _expect(self, kind: str, timeout: float) -> Any:
        assert self._pipe is not None
        if not self._pipe.poll(timeout):
            raise RuntimeError(f"tunlink bridge: no {kind!r} within {timeout:.0f}s")
        got, value = self._pipe.recv()
        if got == "error":
            raise RuntimeError(f"tunlink bridge failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"tunlink bridge: expected {kind!r}, got {got!r}")
        return value

    def reset(self, profile: LinkProfile, seed: int) -> None:
        """Fresh conditioners for both directions (a->b seeded ``seed``, b->a ``seed + 1``)."""
        assert self._pipe is not None
        self._pipe.send(("reset", (profile, seed)))
        self._expect("ok", 10.0)

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters of both directions since the last reset: {"a->b": {...}, "b->a": {...}}.

        Besides the conditioner's counters: ``max_late_ms``, the most a packet was released
        after its due time (the bridge process was busy), ``not_ipv4`` and ``write_errors``.
        """
        assert self._pipe is not None
        self._pipe.send(("stats", None))
        stats: dict[str, dict[str, float]] = self._expect("ok", 10.0)
        return stats

    def close(self) -> None:
        """Stop the bridge and delete the namespaces (their devices go with them). Idempotent."""
        if self._bridge is not None:
            if self._pipe is not None and self._bridge.is_alive():
                with contextlib.suppress(OSError):
                    self._pipe.send(("stop", None))
            self._bridge.join(5.0)
            if self._bridge.is_alive():
                self._bridge.terminate()
                self._bridge.join(2.0)
            self._bridge = None
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        while self._made:
            namespace = self._made.pop()
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
