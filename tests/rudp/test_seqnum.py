from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rudp.seqnum import SEQ_HALF, SEQ_MASK, seq_diff, seq_greater, unwrap

u16 = st.integers(0, SEQ_MASK)


@given(u16, st.integers(-SEQ_HALF + 1, SEQ_HALF - 1))
def test_diff_inverts_addition(a: int, n: int) -> None:
    assert seq_diff((a + n) & SEQ_MASK, a) == n


@given(u16, u16)
def test_greater_is_antisymmetric(a: int, b: int) -> None:
    if a != b and seq_diff(a, b) != -SEQ_HALF:
        assert seq_greater(a, b) != seq_greater(b, a)
    assert not seq_greater(a, a)


@given(st.integers(0, 1 << 40), st.integers(-SEQ_HALF + 1, SEQ_HALF - 1))
def test_unwrap_recovers_nearby_values(reference: int, offset: int) -> None:
    value = reference + offset
    assert unwrap(value & SEQ_MASK, reference) == value


def test_wraparound_examples() -> None:
    assert seq_greater(0, 65535)
    assert seq_diff(2, 65534) == 4
    assert unwrap(3, 65534) == 65539
    assert unwrap(65534, 65539) == 65534
