"""Connection migration through a real NAT that rebinds mid-stream: network namespaces,
iptables, and the asyncio API on both ends.

Topology (every address is inside namespaces this test creates; the root namespace's
interfaces and iptables are never touched)::

    public segment 10.215.0.0/24:  server .10   NAT router .1 (then .2)
    LAN 10.215.1.0/24 behind it:   client .2

The router MASQUERADEs the LAN. Mid-stream the test rebinds it, as a home router whose
public address changes does: it gains 10.215.0.2, maps UDP to ports 40000-40999 of it
(an SNAT rule ahead of MASQUERADE), and loses 10.215.0.1, which drops the masqueraded
mappings with it. The client's next datagrams reach the server from another address
and port; the server must validate it and move the connection there, with every
message delivered once, in order, both ways.

Needs root, ``ip netns`` and iptables; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.netns import LabError, NetLab

SERVER_IP = "10.215.0.10"
OLD_IP = "10.215.0.1"
NEW_IP = "10.215.0.2"
CLIENT_IP = "10.215.1.2"
PORT = 27960
TOTAL = 1500
LINE_TIMEOUT = 30.0

SERVER = """
import asyncio, json, sys
import rudp

def say(kind, **fields):
    print("@@ " + json.dumps({"kind": kind, **fields}), flush=True)

async def main(ip, port):
    reports = asyncio.Queue()

    async def handler(conn):
        got, addresses = [], [list(conn.remote_address[:2])]
        async for msg in conn:
            got.append(int.from_bytes(msg.data[:4], "big"))
            conn.send(msg.data)
            if list(conn.remote_address[:2]) != addresses[-1]:
                addresses.append(list(conn.remote_address[:2]))
        await reports.put({"got": got, "addresses": addresses,
                           "migrations": conn.stats.migrations,
                           "challenges": conn.stats.path_challenges})

    server = await rudp.serve(handler, ip, int(port))
    say("serving")
    say("report", **(await asyncio.wait_for(reports.get(), 60)))
    await server.close()

asyncio.run(main(*sys.argv[1:]))
"""

CLIENT = """
import asyncio, json, sys
import rudp

def say(kind, **fields):
    print("@@ " + json.dumps({"kind": kind, **fields}), flush=True)

async def main(ip, port, total):
    total = int(total)
    conn = await rudp.connect(ip, int(port))
    echoes = []
    done = asyncio.Event()

    def on_echo(msg):
        echoes.append(int.from_bytes(msg.data[:4], "big"))
        if len(echoes) == total:
            done.set()

    conn.set_receiver(on_echo)
    for i in range(total):
        conn.send(i.to_bytes(4, "big") + bytes(60))
        if i == total // 4:
            say("midway")  # the test rebinds the NAT while the stream goes on
        await asyncio.sleep(0.002)
    await asyncio.wait_for(done.wait(), 30)
    say("echoes", echoes=echoes)
    await conn.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture
def lab() -> Iterator[NetLab]:
    NetLab.require()
    if shutil.which("iptables") is None:
        pytest.skip("iptables not installed (CI: apt-get install -y iptables)")
    with NetLab() as lab:
        yield lab


def _expect(lab: NetLab, proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    """The next "@@" line of ``proc``, which must be of ``kind``."""
    while True:
        line = lab.read_line(proc, LINE_TIMEOUT)
        if line.startswith("@@ "):
            record: dict[str, Any] = json.loads(line[3:])
            assert record["kind"] == kind, record
            return record


def _iptables(lab: NetLab, router: str, *rule: str) -> None:
    try:
        lab.exec(router, "iptables", *rule)
    except LabError as exc:
        pytest.skip(f"iptables unusable in a namespace: {exc}")


def test_a_nat_rebinding_mid_stream_moves_the_connection_losing_nothing(lab: NetLab) -> None:
    server_ns = lab.add_namespace("srv")
    lab.plug(server_ns, "br0", "eth0", f"{SERVER_IP}/24")
    router = lab.add_namespace("nat")
    lab.plug(router, "br0", "wan", f"{OLD_IP}/24")
    lab.add_bridge("br1")
    lab.plug(router, "br1", "lan", "10.215.1.1/24")
    lab.exec(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    lab.exec(router, "sysctl", "-qw", "net.ipv4.conf.wan.promote_secondaries=1")
    _iptables(lab, router, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
    client_ns = lab.add_namespace("cli")
    lab.plug(client_ns, "br1", "eth0", f"{CLIENT_IP}/24")
    lab.exec(client_ns, "ip", "route", "add", "default", "via", "10.215.1.1")

    server = lab.spawn_in(server_ns, SERVER, SERVER_IP, str(PORT))
    _expect(lab, server, "serving")
    client = lab.spawn_in(client_ns, CLIENT, SERVER_IP, str(PORT), str(TOTAL))
    _expect(lab, client, "midway")
    # The rebinding, while the client keeps sending: a new public address and port.
    lab.exec(router, "ip", "addr", "add", f"{NEW_IP}/24", "dev", "wan")
    _iptables(lab, router, "-t", "nat", "-I", "POSTROUTING", "1", "-o", "wan", "-p", "udp",
              "-j", "SNAT", "--to-source", f"{NEW_IP}:40000-40999")  # fmt: skip
    lab.exec(router, "ip", "addr", "del", f"{OLD_IP}/24", "dev", "wan")

    echoes = _expect(lab, client, "echoes")["echoes"]
    report = _expect(lab, server, "report")
    assert report["got"] == list(range(TOTAL))  # each message once, in order
    assert echoes == list(range(TOTAL))
    (old, new) = report["addresses"]
    assert old[0] == OLD_IP and new[0] == NEW_IP and 40000 <= new[1] <= 40999
    assert report["migrations"] == 1 and report["challenges"] >= 1
