"""Network interfaces as LAN discovery sees them, and socket addresses made printable.

Linux only for enumeration: ``socket.if_nameindex()`` names the interfaces and
the ``SIOCGIFFLAGS`` / ``SIOCGIFBRDADDR`` ioctls give their flags and IPv4
broadcast address. Elsewhere :func:`list_interfaces` returns nothing and
discovery falls back to the limited broadcast ``255.255.255.255``.
"""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Interface", "format_address", "list_interfaces"]


@dataclass(frozen=True, slots=True)
class Interface:
    """A network interface as far as discovery cares."""

    name: str
    """Kernel name, e.g. ``eth0``."""
    index: int
    """Interface index, the IPv6 scope id."""
    broadcast: str | None
    """IPv4 broadcast address, or ``None`` if the interface has none."""
    multicast: bool
    """Whether IPv6 link-local multicast can be sent out of it."""


# <linux/if.h> flags and <linux/sockios.h> requests.
IFF_UP = 0x1
IFF_BROADCAST = 0x2
IFF_LOOPBACK = 0x8
IFF_MULTICAST = 0x1000
SIOCGIFFLAGS = 0x8913
SIOCGIFBRDADDR = 0x8919
IFREQ = struct.Struct("16s24x")  # struct ifreq: name, then a 24-byte union


def list_interfaces() -> list[Interface]:
    """Enumerate interfaces with their IPv4 broadcast address and multicast ability.

    Uses ``ioctl`` on Linux; on other systems returns an empty list (discovery
    then falls back to the limited broadcast address).
    """
    if not sys.platform.startswith("linux"):
        return []
    import fcntl  # Unix-only module; imported here so the rest works elsewhere.

    result: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for index, name in socket.if_nameindex():
            try:
                req = IFREQ.pack(name.encode())
                flags = struct.unpack_from("H", fcntl.ioctl(probe, SIOCGIFFLAGS, req), 16)[0]
            except OSError:
                continue  # vanished between listing and asking
            if not flags & IFF_UP:
                continue
            broadcast = None
            if flags & IFF_BROADCAST:
                broadcast = _broadcast_address(fcntl.ioctl, probe, req)
            multicast = bool(flags & IFF_MULTICAST) and not flags & IFF_LOOPBACK
            result.append(Interface(name, index, broadcast, multicast))
    return result


def _broadcast_address(
    ioctl: Callable[[socket.socket, int, bytes], bytes], probe: socket.socket, req: bytes
) -> str | None:
    try:
        reply = ioctl(probe, SIOCGIFBRDADDR, req)
    except OSError:
        return None  # no IPv4 address on this interface
    # struct sockaddr_in starts at offset 16: family(2) port(2) addr(4).
    addr = socket.inet_ntoa(reply[20:24])
    return None if addr == "0.0.0.0" else addr


def format_address(addr: tuple[Any, ...]) -> tuple[str, int]:
    """``(host, port)`` from a socket address; link-local IPv6 keeps its ``%scope``."""
    host, port = str(addr[0]), int(addr[1])
    if len(addr) == 4 and addr[3] and "%" not in host:
        try:
            host = f"{host}%{socket.if_indextoname(addr[3])}"
        except OSError:
            host = f"{host}%{addr[3]}"
    return host, port
