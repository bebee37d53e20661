"""Every datagram of one source to one worker: a classic BPF program on a port's
``SO_REUSEPORT`` group (``SO_ATTACH_REUSEPORT_CBPF``, Linux 4.5+).

Without it the kernel picks a group's socket by a hash of the 4-tuple, so the
same client on two source ports (a NAT that rebinds, a host that opened a second
socket) reaches two workers: a rudp connection that migrates lands on a worker
that never heard of it, and the per-source limits (connections, handshakes,
registrations, lists, introductions) were each worker's, N times the ceiling
of one process.  The program picks the socket from the *source address* alone,
the same key the limits count by: an IPv4 address, or an IPv6 /64.

The program, run by the kernel on each datagram with the packet's network
header reachable at ``SKF_NET_OFF`` (`pick` is the same in Python)::

    A = version (the first byte's high nibble)
    if A == 6:  A = source[0:4] ^ source[4:8]     (the /64: header bytes 8-15)
    else:       A = source                         (IPv4: header bytes 12-15)
    A = ((A ^ key) * 0x9E3779B1) mod 2**32         (keyed, then mixed:
    A = ((A ^ A >> 16) * 0x85EBCA6B) mod 2**32      every bit of the source
    A = ((A >> 16) * N) >> 16                       counts, for any N)
    return A                                       (the group's socket index)

The key is random, drawn by the supervisor at each start: without it, anyone
could work out which sources share a worker and aim a flood of spoofed
datagrams at one (the kernel's own hash is keyed per boot too).  A restarted
supervisor therefore maps sources afresh; a host whose heartbeats now reach
another worker moves to it by a takeover, one datagram.

The group's sockets are indexed in the order they joined it: the supervisor
binds worker 0's first and holds every socket for the group's life, so index i
is worker i's for good.  An IPv4 datagram on a dual-stack socket has an IPv4
header: it takes the IPv4 branch, as its limits key does.
"""

from __future__ import annotations

import ctypes
import ipaddress
import secrets
import socket
import struct
import sys

SO_ATTACH_REUSEPORT_CBPF = 51
"""From <asm-generic/socket.h>; Python's socket module does not name it."""

_SKF_NET_OFF = -0x100000
_LD_B_ABS, _LD_W_ABS = 0x30, 0x20
_RSH_K, _MUL_K, _XOR_K, _XOR_X = 0x74, 0x24, 0xA4, 0xAC
_JEQ_K, _JA = 0x15, 0x05
_TAX, _RET_A = 0x07, 0x16
_MIX1, _MIX2 = 0x9E3779B1, 0x85EBCA6B
_MASK = 0xFFFFFFFF


def _ins(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(n: int, key: int) -> list[bytes]:
    """The instructions that pick one of ``n`` sockets by source address."""
    if not 1 <= n <= 0xFFFF:
        raise ValueError(f"a group of 1 to 65535 sockets, not {n}")
    return [
        _ins(_LD_B_ABS, _SKF_NET_OFF),  # 0: A = version << 4 | header length
        _ins(_RSH_K, 4),  # 1
        _ins(_JEQ_K, 6, 0, 4),  # 2: IPv6 ? 3 : 7
        _ins(_LD_W_ABS, _SKF_NET_OFF + 8),  # 3: the /64's first half
        _ins(_TAX),  # 4: X = A
        _ins(_LD_W_ABS, _SKF_NET_OFF + 12),  # 5: its second half
        _ins(_JA, 1),  # 6: to 8
        _ins(_LD_W_ABS, _SKF_NET_OFF + 12),  # 7: the IPv4 source (X is 0)
        _ins(_XOR_X),  # 8
        _ins(_XOR_K, key),  # 9
        _ins(_MUL_K, _MIX1),  # 10
        _ins(_TAX),  # 11
        _ins(_RSH_K, 16),  # 12
        _ins(_XOR_X),  # 13
        _ins(_MUL_K, _MIX2),  # 14
        _ins(_RSH_K, 16),  # 15
        _ins(_MUL_K, n),  # 16
        _ins(_RSH_K, 16),  # 17
        _ins(_RET_A),  # 18
    ]


def pick(source: ipaddress.IPv4Address | ipaddress.IPv6Address, n: int, key: int) -> int:
    """The socket index `program` returns for a datagram from ``source``."""
    raw = source.packed
    if len(raw) == 16:
        a = int.from_bytes(raw[0:4], "big") ^ int.from_bytes(raw[4:8], "big")
    else:
        a = int(source)
    a = ((a ^ key) * _MIX1) & _MASK
    a = ((a ^ (a >> 16)) * _MIX2) & _MASK
    return ((a >> 16) * n) >> 16


def new_key() -> int:
    """A random key for `program`."""
    return secrets.randbits(32)


def steer_by_source(sock: socket.socket, n: int, key: int) -> None:
    """Attach the program to the group ``sock`` belongs to (any one of its sockets).

    Raises OSError where the kernel cannot (not Linux, too old, a seccomp filter):
    the group then keeps the kernel's 4-tuple hash."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"SO_ATTACH_REUSEPORT_CBPF is Linux's, not {sys.platform}'s")
    instructions = program(n, key)
    code = ctypes.create_string_buffer(b"".join(instructions))
    fprog = _SockFprog(len(instructions), ctypes.addressof(code))
    # The kernel copies the program during the call; `code` outlives it.
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))


class _SockFprog(ctypes.Structure):
    """``struct sock_fprog``: the program's length, and where it is."""

    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))
