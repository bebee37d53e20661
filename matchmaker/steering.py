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
header reachable at ``SKF_NET_OFF``::

    A = version (the first byte's high nibble)
    if A == 6:  A = source[0:4] ^ source[4:8]     (the /64: header bytes 8-15)
    else:       A = source                         (IPv4: header bytes 12-15)
    A = (A * 0x9E3779B1 mod 2**32) >> 16 mod N     (a multiplicative hash)
    return A                                       (the group's socket index)

The group's sockets are indexed in the order they joined it: the supervisor
binds worker 0's first and holds every socket for the group's life, so index i
is worker i's for good.  An IPv4 datagram on a dual-stack socket has an IPv4
header: it takes the IPv4 branch, as its limits key does.
"""

from __future__ import annotations

import ctypes
import socket
import struct

SO_ATTACH_REUSEPORT_CBPF = 51
"""From <asm-generic/socket.h>; Python's socket module does not name it."""

_SKF_NET_OFF = -0x100000
_LD_B_ABS, _LD_W_ABS = 0x30, 0x20
_RSH_K, _MUL_K, _MOD_K, _XOR_X = 0x74, 0x24, 0x94, 0xAC
_JEQ_K, _JA = 0x15, 0x05
_TAX, _RET_A = 0x07, 0x16
_GOLDEN = 0x9E3779B1


def _ins(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(n: int) -> list[bytes]:
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
        _ins(_MUL_K, _GOLDEN),  # 9
        _ins(_RSH_K, 16),  # 10
        _ins(_MOD_K, n),  # 11
        _ins(_RET_A),  # 12
    ]


def steer_by_source(sock: socket.socket, n: int) -> None:
    """Attach the program to the group ``sock`` belongs to (any one of its sockets).

    Raises OSError where the kernel cannot (not Linux, too old, a seccomp filter):
    the group then keeps the kernel's 4-tuple hash."""
    instructions = program(n)
    code = ctypes.create_string_buffer(b"".join(instructions))
    fprog = _SockFprog(len(instructions), ctypes.addressof(code))
    # The kernel copies the program during the call; `code` outlives it.
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))


class _SockFprog(ctypes.Structure):
    """``struct sock_fprog``: the program's length, and where it is."""

    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))
