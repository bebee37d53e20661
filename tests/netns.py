"""Network-namespace lab for tests that need a real (but private) LAN.

``NetLab`` builds, for one test, a "switch" namespace holding a Linux bridge
and any number of node namespaces, each plugged into the bridge by a veth pair
whose node end is called ``eth0``. Every interface is created from inside the
switch namespace, so the host's own network stack is never touched, and nodes
get addresses only from ``10.213.0.0/24`` and ``fe80::213:0:0:N`` on their private
link. Broadcasts and link-local multicast cross the bridge exactly as on a LAN.

Code runs inside a node with the same interpreter as the tests
(``sys.executable``), via ``ip netns exec``. Everything is torn down on exit,
even when the test fails: processes are killed, then the namespaces deleted
(deleting a namespace destroys its veth ends and the bridge).

Usage::

    with NetLab() as lab:           # or the ``netlab`` fixture (import netlab_fixture)
        a = lab.add_node()
        proc = lab.spawn(a, "print('hi')")
        lab.run(a, "import socket; print(socket.gethostname())")

Needs root and a kernel with network namespaces; ``NetLab.require()`` (and the
fixture) turn their absence into ``pytest.skip`` with the reason.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pytest

SUBNET = "10.213.0"
#: Upper bound for any single setup command; they normally take milliseconds.
COMMAND_TIMEOUT = 10.0
REPO_ROOT = Path(__file__).resolve().parents[1]


class LabError(RuntimeError):
    """A lab command failed."""


@dataclass(frozen=True)
class Node:
    """One namespace plugged into the lab's bridge."""

    namespace: str
    """The ``ip netns`` name."""
    number: int
    """1-based node number; the last byte of its addresses."""

    @property
    def ipv4(self) -> str:
        return f"{SUBNET}.{self.number}"

    @property
    def ipv6(self) -> str:
        """Link-local address; append ``%eth0`` to use it."""
        return f"fe80::213:0:0:{self.number:x}"

    @property
    def broadcast(self) -> str:
        return f"{SUBNET}.255"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
    )
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


class NetLab:
    """A bridge in its own namespace plus node namespaces. Use as a context manager."""

    def __init__(self) -> None:
        # Unique per lab so parallel or crashed runs never collide.
        self.token = f"{os.getpid() % 10000:04d}{secrets.token_hex(3)}"
        self.switch = f"rudp-{self.token}-sw"
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[str]] = []
        self._buffers: dict[int, bytearray] = {}
        self._ports = 0

    @staticmethod
    def require() -> None:
        """Skip the calling test unless namespaces can be made here."""
        if not sys.platform.startswith("linux"):
            pytest.skip("network namespaces need Linux")
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        if shutil.which("ip") is None:
            pytest.skip("iproute2 'ip' command not found")
        probe = f"rudp-probe-{secrets.token_hex(4)}"
        try:
            result = _run("ip", "netns", "add", probe, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"ip netns unusable: {exc}")
        if result.returncode != 0:
            pytest.skip(f"ip netns add failed: {result.stderr.strip()}")
        _run("ip", "netns", "delete", probe, check=False)

    # ------------------------------------------------------------------ setup

    def __enter__(self) -> NetLab:
        try:
            self._add_namespace(self.switch)
            self._exec(self.switch, "ip", "link", "add", "br0", "type", "bridge",
                       "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0")  # fmt: skip
            self._exec(self.switch, "ip", "link", "set", "br0", "up")
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

    def add_node(self) -> Node:
        """A new namespace with ``eth0`` on the bridge, addressed and up."""
        node = Node(f"rudp-{self.token}-n{len(self.nodes) + 1}", len(self.nodes) + 1)
        self._add_namespace(node.namespace)
        port = f"p{node.number}"
        self._exec(self.switch, "ip", "link", "add", port, "type", "veth",
                   "peer", "name", "eth0", "netns", node.namespace)  # fmt: skip
        self._exec(self.switch, "ip", "link", "set", port, "master", "br0", "up")
        ns = node.namespace
        self._exec(ns, "ip", "link", "set", "lo", "up")
        # A fixed link-local address without DAD: usable at once, so no
        # waiting for duplicate-address detection to finish.
        self._exec(ns, "ip", "link", "set", "eth0", "addrgenmode", "none")
        self._exec(ns, "ip", "addr", "add", f"{node.ipv4}/24", "brd", "+", "dev", "eth0")
        self._exec(ns, "ip", "-6", "addr", "add", f"{node.ipv6}/64", "dev", "eth0", "nodad")
        self._exec(ns, "ip", "link", "set", "eth0", "up")
        self._wait_forwarding(port)
        self.nodes.append(node)
        return node

    # ------------------------------------------------------------------ routed topologies

    def add_namespace(self, role: str) -> str:
        """A bare namespace (only ``lo`` up) named after ``role``; deleted at lab exit.

        With `add_bridge` and `plug` this builds routed topologies (routers, NATs)
        next to the default bridge; `Node` helpers are for the flat LAN only.
        """
        name = f"rudp-{self.token}-{role}"
        self._add_namespace(name)
        self._exec(name, "ip", "link", "set", "lo", "up")
        return name

    def add_bridge(self, name: str) -> None:
        """Another bridge (segment) in the switch namespace, besides ``br0``."""
        self._exec(self.switch, "ip", "link", "add", name, "type", "bridge",
                   "stp_state", "0", "forward_delay", "0", "mcast_snooping", "0")  # fmt: skip
        self._exec(self.switch, "ip", "link", "set", name, "up")

    def plug(self, namespace: str, bridge: str, ifname: str, cidr: str) -> None:
        """Give ``namespace`` an interface ``ifname`` on ``bridge``, addressed ``cidr``, up."""
        self._ports += 1
        port = f"x{self._ports}"
        self._exec(self.switch, "ip", "link", "add", port, "type", "veth",
                   "peer", "name", ifname, "netns", namespace)  # fmt: skip
        self._exec(self.switch, "ip", "link", "set", port, "master", bridge, "up")
        self._exec(namespace, "ip", "link", "set", ifname, "addrgenmode", "none")
        self._exec(namespace, "ip", "addr", "add", cidr, "dev", ifname)
        self._exec(namespace, "ip", "link", "set", ifname, "up")
        self._wait_forwarding(port)

    def exec(self, namespace: str, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run a command in ``namespace``; LabError if it fails."""
        return self._exec(namespace, *argv)

    def spawn_in(self, namespace: str, code: str, *args: str) -> subprocess.Popen[str]:
        """`spawn`, in a namespace made by `add_namespace`."""
        return self.spawn(Node(namespace, 0), code, *args)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)

    def _exec(self, namespace: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", namespace, *argv)

    def _wait_forwarding(self, port: str) -> None:
        """Poll (bounded) until the bridge forwards on ``port``; with STP off this is at once."""
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while time.monotonic() < deadline:
            state = self._exec(self.switch, "cat", f"/sys/class/net/{port}/brport/state")
            if state.stdout.strip() == "3":  # BR_STATE_FORWARDING
                return
            time.sleep(0.01)
        raise LabError(f"bridge port {port} never reached forwarding")

    # ------------------------------------------------------------------ running code

    def command(self, node: Node, code: str, *args: str) -> list[str]:
        """argv running ``code`` in ``node`` with this interpreter; ``args`` go to sys.argv[1:]."""
        return ["ip", "netns", "exec", node.namespace, sys.executable, "-c", code, *args]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        return env

    def run(
        self, node: Node, code: str, *args: str, timeout: float = 20.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in ``node`` to completion; raises LabError if it fails."""
        proc = subprocess.run(
            self.command(node, code, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._env(),
            check=False,
        )
        if proc.returncode != 0:
            raise LabError(f"snippet failed in {node.namespace}:\n{proc.stderr}")
        return proc

    def spawn(self, node: Node, code: str, *args: str) -> subprocess.Popen[str]:
        """Start ``code`` in ``node`` in the background (stdin/stdout are pipes).

        The process is killed at lab exit if still running.
        """
        proc = subprocess.Popen(
            self.command(node, code, *args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self._env(),
        )
        self._procs.append(proc)
        return proc

    def read_line(self, proc: subprocess.Popen[str], timeout: float = 20.0) -> str:
        """The next stdout line of ``proc``; LabError after ``timeout`` or at EOF.

        Reads the pipe's file descriptor directly (with our own buffer), since a
        buffered ``readline`` could swallow a second line the selector then
        never reports.
        """
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buffer = self._buffers.setdefault(proc.pid, bytearray())
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    raise LabError(f"no line from {proc.args!r} within {timeout}s")
                chunk = os.read(fd, 4096)
                if not chunk:
                    stderr = proc.stderr.read() if proc.stderr else ""
                    raise LabError(f"process exited early (rc={proc.wait()}):\n{stderr}")
                buffer += chunk
        line, _, rest = bytes(buffer).partition(b"\n")
        buffer[:] = rest
        return line.decode()

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kill our processes and delete our namespaces. Idempotent; never raises."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                proc.communicate(timeout=COMMAND_TIMEOUT)
        self._procs.clear()
        for name in reversed(self._namespaces):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _run("ip", "netns", "delete", name, check=False)
        self._namespaces.clear()


@pytest.fixture(name="netlab")
def netlab_fixture() -> Iterator[NetLab]:
    """A fresh :class:`NetLab` as fixture ``netlab``; skips where namespaces are unavailable.

    Import ``netlab_fixture`` into a test module to make ``netlab`` available there.
    """
    NetLab.require()
    with NetLab() as lab:
        yield lab
