"""Network addresses as the matchmaker sees them.

Every host in the registry is keyed by its *observed* public address: the
source address of its rudp connection, never what the host claims.  A
restarted host that comes back from the same address therefore replaces its
old entry (issue 5), and nobody can register on somebody else's behalf.

Addresses are normalised once, here: IPv4-mapped IPv6 (``::ffff:a.b.c.d``,
what a dual-stack socket reports for IPv4 peers) becomes plain IPv4, and IPv6
is written in its compressed form, so the same peer always gets the same key.

`non_public_reason` is the bogon check: loopback, link-local, private,
shared (CGNAT), multicast, unspecified and reserved ranges never appear in a
public list unless the operator runs a LAN/dev matchmaker.

`lan_reason` is the opposite check, for the LAN address a host registers and a
client sends with an introduction: only the other side of an introduction behind
the same public IP is given it, and connects to it, so it must name a machine of
that LAN, never a third party on the Internet.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from typing import NamedTuple

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Address(NamedTuple):
    """A normalised (ip, port) pair."""

    ip: str
    port: int

    @property
    def family(self) -> int:
        """4 or 6."""
        return 6 if ":" in self.ip else 4

    @property
    def key(self) -> str:
        """``1.2.3.4:5`` or ``[2001:db8::1]:5``: the registry key."""
        return f"[{self.ip}]:{self.port}" if self.family == 6 else f"{self.ip}:{self.port}"

    def __str__(self) -> str:
        return self.key


def normalise_ip(ip: str) -> str:
    """Canonical text form of an IP; raises ValueError if `ip` is not one."""
    # Fast path, ~20x cheaper than ipaddress (a 10,000-host list decodes
    # 10,000 addresses): an IPv4 address already in canonical form.
    try:
        if socket.inet_ntop(socket.AF_INET, socket.inet_pton(socket.AF_INET, ip)) == ip:
            return ip
    except (OSError, ValueError, TypeError):
        pass
    parsed = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    return parsed.compressed


def make_address(ip: str, port: int) -> Address:
    """Validated, normalised Address; raises ValueError."""
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    return Address(normalise_ip(ip), port)


def from_sockaddr(sockaddr: tuple[object, ...]) -> Address:
    """Address from what asyncio reports (2-tuple for IPv4, 4-tuple for IPv6)."""
    ip, port = sockaddr[0], sockaddr[1]
    if not isinstance(ip, str) or not isinstance(port, int):
        raise ValueError(f"not a socket address: {sockaddr!r}")
    return make_address(ip, port)


def parse_key(key: str) -> Address:
    """Inverse of `Address.key`; raises ValueError."""
    host, sep, port = key.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not an address key: {key!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return make_address(host, int(port))


def non_public_reason(ip: str) -> str | None:
    """Why `ip` must not be listed publicly, or None if it is a global unicast address."""
    parsed: IPAddress = ipaddress.ip_address(normalise_ip(ip))
    # Order matters: the most specific explanation first, for the logs.
    checks = (
        ("unspecified", parsed.is_unspecified),
        ("loopback", parsed.is_loopback),
        ("link_local", parsed.is_link_local),
        ("multicast", parsed.is_multicast),
        ("private", parsed.is_private),
        ("reserved", parsed.is_reserved),
    )
    for reason, hit in checks:
        if hit:
            return reason
    # is_global is False for what is left of the special-purpose registry,
    # e.g. 100.64.0.0/10 (shared address space, carrier-grade NAT).
    return None if parsed.is_global else "bogon"


_LAN_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8",  # RFC 1918
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # shared address space (carrier-grade NAT, RFC 6598)
        "169.254.0.0/16",  # link-local
        "fc00::/7",  # unique local (RFC 4193)
        "fe80::/10",  # link-local
    )
)


def lan_reason(lan_ip: str, public_ip: str) -> str | None:
    """Why `lan_ip` cannot be the LAN address of a peer the matchmaker sees at
    `public_ip`, or None if it can.

    A LAN address is private (RFC 1918, 100.64.0.0/10, link-local, unique local
    IPv6): it is handed only to a peer behind the same public IP, which connects
    to it, so a global address (``"global"``) would aim that peer at a third
    party, and a special-purpose one (multicast, unspecified, documentation,
    ...: ``"not_private"``) names no LAN machine.  Loopback (``"loopback"``) is
    one only for a peer seen at a loopback address itself (a daemon run with
    ``--allow-private`` on one machine): both sides then share that machine,
    whereas the other side of a NAT would take it for its own.  The peer's own
    public address is one too (a machine with a public IP of its own names it):
    only a peer behind that very address gets it.
    """
    parsed: IPAddress = ipaddress.ip_address(normalise_ip(lan_ip))
    if parsed == ipaddress.ip_address(normalise_ip(public_ip)):
        return None  # the peer's own address (a host with a public IP of its own)
    if parsed.is_loopback:
        return None if ipaddress.ip_address(normalise_ip(public_ip)).is_loopback else "loopback"
    if any(parsed in net for net in _LAN_NETWORKS):
        return None
    return "global" if parsed.is_global and not parsed.is_multicast else "not_private"


def same_public_ip(a: Address, b: Address) -> bool:
    """True when two peers sit behind the same NAT (the LAN-address case)."""
    return a.ip == b.ip


def rate_key(ip: str) -> str:
    """The unit a rate limit applies to: one IPv4 address, or one IPv6 /64.

    An IPv6 end site usually gets at least a /64, so limiting single IPv6
    addresses would let one machine rotate through 2**64 buckets.
    """
    ip = normalise_ip(ip)
    if ":" not in ip:
        # IPv4 (an IPv4-mapped address included, once normalised): itself.  The
        # parse below costs ~10 µs, and `source_key`'s cache misses once the
        # registry holds more sources than it keeps.
        return ip
    parsed = ipaddress.ip_address(ip)
    if isinstance(parsed, ipaddress.IPv6Address):
        return ipaddress.IPv6Network((parsed, 64), strict=False).compressed
    return parsed.compressed


@functools.lru_cache(maxsize=1 << 16)
def source_key(ip: str) -> str:
    """`rate_key`, cached: the unit of the per-source host cap and of the spreading of
    list pages, which ask it for every registry entry and every listed host."""
    return rate_key(ip)
