"""NAT introductions through real NATs: network namespaces and iptables MASQUERADE.

Topology (every address is inside namespaces this test creates; the root
namespace's interfaces and iptables are never touched)::

    public segment 10.214.0.0/24:  matchmaker .10   router A .1   router B .2
    LAN A 10.214.1.0/24 behind A:  game host .2 (and, in the one-NAT case, the client .3)
    LAN B 10.214.2.0/24 behind B:  the client .2 (two-NAT case)

Each router forwards, MASQUERADEs its LAN out of its public interface, and,
like a home router, drops unsolicited inbound packets addressed to itself
(``INPUT ... ctstate NEW -j DROP``).  That rule matters for hole punching
through Linux NAT: a punch that arrives before the other side's own has left
is dropped *without* a conntrack entry.  Otherwise the kernel would remember
it as a local flow and the later outbound punch would be NATed to another
port.  Real NATs drop such packets too.

The game host registers from its own game socket; the client lists, asks for
an introduction, and connects to the address it was given while the host
punches towards the client's address from the game socket.  The host must
accept the connection and see the nonce.  The matchmaker sees 10.214.0.x,
which is private space, hence ``--allow-private``.

Needs root, ``ip netns`` and iptables (``apt-get install -y iptables``);
skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.netns import LabError, NetLab

MM_IP = "10.214.0.10"
MM_PORT = 27950
LINE_TIMEOUT = 20.0

DAEMON = """
import runpy, sys
sys.stderr = sys.stdout  # the JSON log lines, read by the test
sys.argv = ["matchmaker", *sys.argv[1:]]
runpy.run_module("matchmaker", run_name="__main__")
"""

# Lines for the test start with "@@ " and hold JSON; anything else is log noise.
HOST = """
import asyncio, contextlib, json, sys
import rudp
from matchmaker.client import MatchmakerClient

def say(kind, **fields):
    print("@@ " + json.dumps({"kind": kind, **fields}), flush=True)

async def main(mm_ip, mm_port, lan_ip, idle="0"):
    joined = asyncio.Queue()

    async def handler(conn):
        msg = await conn.recv()
        await joined.put((conn.remote_address, msg.data))
        await conn.send(b"welcome:" + msg.data)
        async for _ in conn:  # until the client closes
            pass

    game = await rudp.serve(handler, "0.0.0.0", 0)
    port = game.address[1]
    mm = MatchmakerClient.to(mm_ip, int(mm_port), via=game)
    addr = await mm.register(name="nat host", game="q3", version="1", max_players=8,
                             lan=(lan_ip, port))
    say("registered", addr=[addr.ip, addr.port], lan=[lan_ip, port])
    if float(idle):
        # Listed on heartbeat datagrams alone: no connection to the matchmaker is
        # left, and the NAT's mapping outlives its own timeout only through them.
        for _ in range(100):
            if not game.connections:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(float(idle))
        say("idle", connections=len(game.connections), address=[mm.address.ip, mm.address.port],
            registrations=mm.registrations)
    intro = await asyncio.wait_for(mm.introductions.get(), 30)
    # The punch: one datagram from the game socket towards each of the client's
    # addresses opens this side's NAT (a rudp unconnected query; no answer comes).
    targets = [intro.peer] + ([intro.peer_lan] if intro.peer_lan else [])
    for t in targets:
        with contextlib.suppress(TimeoutError):
            await game.query((t.ip, t.port), b"punch", 0.05)
    lan = [intro.peer_lan.ip, intro.peer_lan.port] if intro.peer_lan else None
    say("introduced", peer=[intro.peer.ip, intro.peer.port], peer_lan=lan,
        nonce=intro.nonce.hex())
    remote, data = await asyncio.wait_for(joined.get(), 30)
    say("joined", remote=list(remote[:2]), data=data.hex())
    await mm.close()
    await game.close()

asyncio.run(main(*sys.argv[1:]))
"""

CLIENT = """
import asyncio, json, sys
import rudp
from matchmaker.client import MatchmakerClient

def say(kind, **fields):
    print("@@ " + json.dumps({"kind": kind, **fields}), flush=True)

async def main(mm_ip, mm_port, lan_ip, mode="invited"):
    endpoint = await rudp.open_endpoint("0.0.0.0", 0, config=rudp.Config(connect_timeout=2.0))
    mm = MatchmakerClient.to(mm_ip, int(mm_port), via=endpoint)
    servers = await mm.list_servers(game="q3")
    say("listed", hosts=[[s.address.ip, s.address.port] for s in servers])
    if mode == "uninvited":  # straight to the listed address, with no introduction
        try:
            await endpoint.connect(servers[0].address.ip, servers[0].address.port)
            say("uninvited", result="connected")
        except rudp.ConnectError as exc:
            say("uninvited", result=type(exc).__name__)
        await mm.close()
        await endpoint.close()
        return
    intro = await mm.introduce(servers[0].address, lan=(lan_ip, endpoint.address[1]))
    lan = [intro.peer_lan.ip, intro.peer_lan.port] if intro.peer_lan else None
    say("introduced", peer=[intro.peer.ip, intro.peer.port], peer_lan=lan,
        nonce=intro.nonce.hex(), local_port=endpoint.address[1])
    # Behind the same NAT the LAN address is the way in; otherwise the public one.
    # The client's punch is its CONNECT itself, resent by rudp until the host's
    # punch has opened the host's NAT.
    target = intro.peer_lan or intro.peer
    conn = await endpoint.connect(target.ip, target.port)
    await conn.send(intro.nonce)
    reply = await asyncio.wait_for(conn.recv(), 10)
    say("connected", remote=list(conn.remote_address[:2]), reply=reply.data.hex())
    await conn.close()
    await mm.close()
    await endpoint.close()

asyncio.run(main(*sys.argv[1:]))
"""


@dataclass
class Site:
    """A private LAN behind a MASQUERADE router."""

    router: str
    subnet: str  # "10.214.1"


@pytest.fixture
def lab() -> Iterator[NetLab]:
    NetLab.require()
    if shutil.which("iptables") is None:
        pytest.skip("iptables not installed (CI: apt-get install -y iptables)")
    with NetLab() as lab:
        yield lab


def make_router(lab: NetLab, role: str, public_ip: str, subnet: str) -> Site:
    router = lab.add_namespace(role)
    lab.plug(router, "br0", "wan", f"{public_ip}/24")
    bridge = f"br{subnet.rsplit('.', 1)[1]}"
    lab.add_bridge(bridge)
    lab.plug(router, bridge, "lan", f"{subnet}.1/24")
    lab.exec(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    rules = [
        ["-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE"],
        ["-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "NEW,INVALID", "-j", "DROP"],
    ]
    for rule in rules:
        try:
            lab.exec(router, "iptables", *rule)
        except LabError as exc:
            pytest.skip(
                f"iptables unusable in a namespace (CI: apt-get install -y iptables): {exc}"
            )
    return Site(router, subnet)


def add_lan_node(lab: NetLab, role: str, site: Site, number: int) -> tuple[str, str]:
    ns = lab.add_namespace(role)
    ip = f"{site.subnet}.{number}"
    bridge = f"br{site.subnet.rsplit('.', 1)[1]}"
    lab.plug(ns, bridge, "eth0", f"{ip}/24")
    lab.exec(ns, "ip", "route", "add", "default", "via", f"{site.subnet}.1")
    return ns, ip


def expect(lab: NetLab, proc: subprocess.Popen[str], kind: str) -> dict[str, Any]:
    """The next "@@" line of `proc`, which must be of `kind`."""
    while True:
        line = lab.read_line(proc, LINE_TIMEOUT)
        if line.startswith("@@ "):
            record: dict[str, Any] = json.loads(line[3:])
            assert record["kind"] == kind, record
            return record


def start_matchmaker(lab: NetLab, *flags: str) -> None:
    mm = lab.add_namespace("mm")
    lab.plug(mm, "br0", "eth0", f"{MM_IP}/24")
    args = ["--bind", MM_IP, "--port", str(MM_PORT), "--http-bind", "127.0.0.1"]
    args += ["--http-port", "0", "--allow-private", "--log-format", "json", *flags]
    proc = lab.spawn_in(mm, DAEMON, *args)
    while True:
        line = lab.read_line(proc, LINE_TIMEOUT)
        if line.startswith("{") and json.loads(line).get("event") == "matchmaker_started":
            return


def run_join(
    lab: NetLab, host: tuple[str, str], client: tuple[str, str], idle: float = 0.0
) -> tuple[dict[str, Any], ...]:
    """Host registers (then stays idle for `idle` seconds: "idle" record), client
    lists + is introduced + joins; every record of both."""
    host_proc = lab.spawn_in(host[0], HOST, MM_IP, str(MM_PORT), host[1], str(idle))
    registered = expect(lab, host_proc, "registered")
    idled = expect(lab, host_proc, "idle") if idle else registered
    client_proc = lab.spawn_in(client[0], CLIENT, MM_IP, str(MM_PORT), client[1])
    listed = expect(lab, client_proc, "listed")
    client_intro = expect(lab, client_proc, "introduced")
    host_intro = expect(lab, host_proc, "introduced")
    joined = expect(lab, host_proc, "joined")
    connected = expect(lab, client_proc, "connected")
    for proc in (host_proc, client_proc):
        assert proc.wait(LINE_TIMEOUT) == 0
    return registered, listed, client_intro, host_intro, joined, connected, idled


def test_introduction_through_two_nats(lab: NetLab) -> None:
    start_matchmaker(lab)
    site_a = make_router(lab, "rta", "10.214.0.1", "10.214.1")
    site_b = make_router(lab, "rtb", "10.214.0.2", "10.214.2")
    host = add_lan_node(lab, "host", site_a, 2)
    client = add_lan_node(lab, "client", site_b, 2)

    registered, listed, client_intro, host_intro, joined, connected, _ = run_join(lab, host, client)

    # The matchmaker saw, listed and introduced router A's public side, not the LAN.
    public_host = registered["addr"]
    assert public_host[0] == "10.214.0.1"
    assert listed["hosts"] == [public_host]
    assert client_intro["peer"] == public_host
    # Different public IPs: no LAN addresses are handed out.
    assert client_intro["peer_lan"] is None and host_intro["peer_lan"] is None
    # The host was told the client's public (router B) address.
    assert host_intro["peer"][0] == "10.214.0.2"
    assert host_intro["nonce"] == client_intro["nonce"]
    # The join came in through both NATs, from that very address, carrying the nonce.
    assert joined["remote"] == host_intro["peer"]
    assert joined["data"] == client_intro["nonce"]
    assert connected["remote"] == public_host
    assert bytes.fromhex(connected["reply"]) == b"welcome:" + bytes.fromhex(client_intro["nonce"])


def test_nat_blocks_a_client_without_introduction(lab: NetLab) -> None:
    # The control experiment: the NATs really filter, so the test above
    # passes because of the introduction and the punches.
    start_matchmaker(lab)
    site_a = make_router(lab, "rta", "10.214.0.1", "10.214.1")
    site_b = make_router(lab, "rtb", "10.214.0.2", "10.214.2")
    host = add_lan_node(lab, "host", site_a, 2)
    client = add_lan_node(lab, "client", site_b, 2)
    host_proc = lab.spawn_in(host[0], HOST, MM_IP, str(MM_PORT), host[1])
    registered = expect(lab, host_proc, "registered")
    client_proc = lab.spawn_in(client[0], CLIENT, MM_IP, str(MM_PORT), client[1], "uninvited")
    assert expect(lab, client_proc, "listed")["hosts"] == [registered["addr"]]
    assert expect(lab, client_proc, "uninvited")["result"] == "ConnectTimeout"
    assert client_proc.wait(LINE_TIMEOUT) == 0


def test_introduction_behind_one_nat_uses_lan_addresses(lab: NetLab) -> None:
    start_matchmaker(lab)
    site = make_router(lab, "rta", "10.214.0.1", "10.214.1")
    host = add_lan_node(lab, "host", site, 2)
    client = add_lan_node(lab, "client", site, 3)

    registered, listed, client_intro, host_intro, joined, connected, _ = run_join(lab, host, client)

    public_host = registered["addr"]
    assert public_host[0] == "10.214.0.1"
    assert listed["hosts"] == [public_host]  # LAN addresses are never listed
    assert client_intro["peer"] == public_host
    # Same public IP: each side gets the other's LAN address as well.
    assert client_intro["peer_lan"] == registered["lan"]
    assert host_intro["peer"][0] == "10.214.0.1"
    assert host_intro["peer_lan"] == [client[1], client_intro["local_port"]]
    assert host_intro["nonce"] == client_intro["nonce"]
    # The client went straight across the LAN.
    assert joined["remote"] == [client[1], client_intro["local_port"]]
    assert joined["data"] == client_intro["nonce"]
    assert connected["remote"] == registered["lan"]
    assert bytes.fromhex(connected["reply"]) == b"welcome:" + bytes.fromhex(client_intro["nonce"])


def test_introduction_reaches_a_host_through_heartbeats_alone(lab: NetLab) -> None:
    # The host's registration connection is closed; router A forgets an idle
    # UDP mapping after 2 s.  Only the host's heartbeat datagrams (every 1 s)
    # keep it listed and keep the way in open for the introduction.
    start_matchmaker(lab, "--keepalive", "1", "--hide-after", "3", "--expire-after", "6")
    site_a = make_router(lab, "rta", "10.214.0.1", "10.214.1")
    site_b = make_router(lab, "rtb", "10.214.0.2", "10.214.2")
    for router in (site_a.router, site_b.router):
        for key in ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
            try:
                lab.exec(router, "sysctl", "-qw", f"net.netfilter.{key}=2")
            except LabError as exc:
                pytest.skip(f"conntrack timeouts not settable in a namespace: {exc}")
    host = add_lan_node(lab, "host", site_a, 2)
    client = add_lan_node(lab, "client", site_b, 2)

    registered, listed, client_intro, host_intro, joined, connected, idled = run_join(
        lab, host, client, idle=8.0
    )

    public_host = registered["addr"]
    # Idle for 4 mapping timeouts and 2 hide-after periods, with no connection:
    # still registered once, at the same public address, and listed there.
    assert idled["connections"] == 0
    assert idled["registrations"] == 1 and idled["address"] == public_host
    assert listed["hosts"] == [public_host]
    assert client_intro["peer"] == public_host
    assert host_intro["peer"][0] == "10.214.0.2"
    assert host_intro["nonce"] == client_intro["nonce"]
    assert joined["remote"] == host_intro["peer"]
    assert joined["data"] == client_intro["nonce"]
    assert bytes.fromhex(connected["reply"]) == b"welcome:" + bytes.fromhex(client_intro["nonce"])
