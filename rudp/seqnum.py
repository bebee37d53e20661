"""Wrap-safe 16-bit sequence arithmetic (RFC 1982 serial numbers).

The seed article's ``PastAck`` compares 16-bit numbers by assuming they are
never more than half the space apart. We do the same, once, here: on the wire a
sequence number is 16 bits; inside a connection it is *unwrapped* into an
unbounded integer relative to a reference we already hold, so the rest of the
code compares plain ints and never thinks about wraparound again.
"""

from __future__ import annotations

from typing import Final

SEQ_BITS: Final = 16
SEQ_MOD: Final = 1 << SEQ_BITS
SEQ_MASK: Final = SEQ_MOD - 1
SEQ_HALF: Final = SEQ_MOD >> 1


def seq_diff(a: int, b: int) -> int:
    """Signed distance ``a - b`` of two 16-bit serial numbers, in [-32768, 32767]."""
    return ((a - b + SEQ_HALF) & SEQ_MASK) - SEQ_HALF


def seq_greater(a: int, b: int) -> bool:
    """RFC 1982 ``a > b`` for 16-bit serial numbers."""
    return seq_diff(a, b) > 0


def unwrap(wire: int, reference: int) -> int:
    """The unbounded integer nearest to ``reference`` whose low 16 bits are ``wire``."""
    return reference + seq_diff(wire, reference & SEQ_MASK)
