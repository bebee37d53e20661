"""rudp.protection: packet numbers, the replay window, sealing and opening."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rudp import wire
from rudp.protection import (
    REPLAY_WINDOW,
    Opener,
    ReplayWindow,
    Sealer,
    decode_packet_number,
)
from tests.rudp.harness import pair, server_conn

KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


def test_rfc9000_example() -> None:
    # RFC 9000, appendix A.3: largest 0xa82f30ea, 16 bits 0x9b32.
    assert decode_packet_number(0xA82F30EA + 1, 0x9B32, 16) == 0xA82F9B32


@given(
    largest=st.integers(min_value=-1, max_value=(1 << 40)),
    delta=st.integers(min_value=-(1 << 15) + 1, max_value=1 << 15),
    bits=st.sampled_from([8, 16, 32]),
)
def test_numbers_within_half_the_window_come_back_exactly(
    largest: int, delta: int, bits: int
) -> None:
    # RFC 9000 A.3 is exact for expected - half < number <= expected + half.
    half = 1 << (bits - 1)
    expected = largest + 1
    number = expected + max(-half + 1, min(half, delta))
    if number < 0:
        return
    truncated = number & ((1 << bits) - 1)
    assert decode_packet_number(expected, truncated, bits) == number


def test_replay_window_refuses_duplicates_and_old_numbers() -> None:
    window = ReplayWindow()
    assert not window.seen(0)
    window.accept(0)
    assert window.seen(0)
    window.accept(5)
    assert not window.seen(3)
    window.accept(3)
    assert window.seen(3) and window.seen(5) and not window.seen(4)
    window.accept(4 + REPLAY_WINDOW - 1)
    assert not window.seen(4)  # still inside the window, never received
    window.accept(4 + REPLAY_WINDOW)
    assert window.seen(4)  # fell out of the window: too old to tell, refused
    window.accept(10 * REPLAY_WINDOW)  # a jump past the whole window
    assert window.seen(10 * REPLAY_WINDOW) and not window.seen(10 * REPLAY_WINDOW - 1)
    assert window.bits == 1


def test_window_against_a_model() -> None:
    rng = random.Random(3)
    window, accepted = ReplayWindow(), set[int]()
    top = 0
    for _ in range(20_000):
        top += rng.randrange(0, 40)
        number = max(0, top - rng.randrange(0, REPLAY_WINDOW + 200))
        largest = max(accepted, default=-1)
        expected = number in accepted or number <= largest - REPLAY_WINDOW
        assert window.seen(number) == expected
        if not expected:
            window.accept(number)
            accepted.add(number)


def test_seal_open_round_trip_and_replay() -> None:
    sealer, opener = Sealer(KEY_A), Opener(KEY_A)
    header = b"\x85\x00\x01"
    for _ in range(3):
        number = sealer.take_number()
        sealed = sealer.seal(number, header, b"payload %d" % number)
        assert opener.open(opener.full_number(number & 0xFFFF, 16), header, sealed) == (
            b"payload %d" % number
        )
        assert opener.is_replay(number)
        assert opener.open(number, header, sealed) is None  # the same packet again


def test_tampering_fails_and_changes_nothing() -> None:
    sealer, opener = Sealer(KEY_A), Opener(KEY_A)
    header = b"\x85\x00\x07"
    sealed = sealer.seal(7, header, b"secret")
    for i in range(len(sealed)):
        bad = bytearray(sealed)
        bad[i] ^= 0x80
        assert opener.open(7, header, bytes(bad)) is None
    assert opener.open(7, b"\x85\x00\x08", sealed) is None  # header is authenticated
    assert opener.open(8, header, sealed) is None  # so is the number (the nonce)
    assert opener.open(7, header, sealed[:15]) is None
    assert opener.window.largest == -1  # none of that moved the window
    assert opener.open(7, header, sealed) == b"secret"


def test_a_reflected_packet_does_not_open() -> None:
    # Each direction has its own key: our own packet sent back to us fails.
    mine, theirs = Sealer(KEY_A), Opener(KEY_B)
    assert theirs.open(0, b"h", mine.seal(0, b"h", b"x")) is None


def test_keys_must_be_32_bytes() -> None:
    with pytest.raises(ValueError):
        Sealer(bytes(16))
    with pytest.raises(ValueError):
        Opener(bytes(33))


def test_the_sender_stops_before_the_nonce_space_ends() -> None:
    sealer = Sealer(KEY_A)
    sealer.next_number = (1 << 62) - 1
    sealer.take_number()
    with pytest.raises(OverflowError):
        sealer.take_number()


# A DATA packet of packet number 0x1_2345_6789 to connection id 0xDEADBEEF, sealed under
# KEY_A: its header carries the number's low 32 bits, its nonce all 64. Pinned, so that
# no change to how a packet is put together can change a byte of it on the wire.
PINNED_BODY = bytes.fromhex("0007000000ff") + b"pinned"
PINNED_PACKET = bytes.fromhex(
    "a5deadbeef23456789465c670daf6476929b4549e2c4b346a3720d01d2bff0e44fbf7816c2"
)


def test_a_sealed_data_packet_is_byte_for_byte_the_same() -> None:
    number, header = 0x1_2345_6789, wire.data_prefix(0xDEADBEEF, 0x1_2345_6789)
    assert header + Sealer(KEY_A).seal(number, header, PINNED_BODY) == PINNED_PACKET
    _, _, _, conn = pair()
    builder = conn._builder
    builder.set_keys(Sealer(KEY_A), 0xDEADBEEF)
    builder.tx_next = number
    assert conn.seal_datagram(PINNED_BODY) == PINNED_PACKET
    cut = wire.DATA_PREFIX_SIZE
    opened = Opener(KEY_A).open(number, PINNED_PACKET[:cut], PINNED_PACKET[cut:])
    assert opened == PINNED_BODY


def test_a_message_delivered_stays_intact_after_the_next_packet_is_opened() -> None:
    # Whatever buffers the receive path keeps, a message handed to the application is
    # its own immutable bytes: opening the next packet must not change it.
    net, server, client, conn = pair()
    sconn = server_conn(server)
    first = bytes(range(256)) * 4
    sconn.send(first)
    net.run(0.5)
    (got,) = client.received(conn)
    assert type(got) is bytes and got == first
    sconn.send(bytes(1024))  # a packet of the same size, other bytes
    sconn.send(b"\xee" * 100, reliable=False)
    net.run(0.5)
    assert sorted(client.received(conn)[1:]) == [bytes(1024), b"\xee" * 100]
    assert all(type(m) is bytes for m in client.received(conn))
    assert got == first


def test_window_against_a_model_with_bursts_of_loss_and_late_packets() -> None:
    """Mostly in order, with runs of loss, packets held back and let go late, repeats
    and jumps past the window: the answers are the set model's, and the gaps kept
    stay within the window's bounds."""
    rng = random.Random(8)
    window, accepted = ReplayWindow(), set[int]()
    held: list[int] = []
    number = largest = -1
    for _ in range(60_000):
        roll = rng.random()
        if roll < 0.02:
            number += rng.randrange(2, 40)  # a burst lost (some held back to come late)
            held.extend(n for n in range(number - 30, number) if rng.random() < 0.3)
        elif roll < 0.0005 + 0.02:
            number += REPLAY_WINDOW + rng.randrange(0, 3000)  # a jump past the window
        else:
            number += 1
        candidates = [number]
        if held and rng.random() < 0.2:
            candidates.append(held.pop(rng.randrange(len(held))))
        if rng.random() < 0.05:
            candidates.append(max(0, number - rng.randrange(0, 1200)))  # a repeat or old one
        for n in candidates:
            if n < 0:
                continue
            expected = n in accepted or n <= largest - REPLAY_WINDOW
            assert window.seen(n) == expected, n
            if not expected:
                window.accept(n)
                accepted.add(n)
                largest = max(largest, n)
        assert window.largest == largest
        assert len(window._gaps) <= REPLAY_WINDOW + 4
    assert window.accepted == len(accepted)


def test_alternate_packets_cost_a_bounded_gap_list() -> None:
    """A peer sending every other number (the worst case for ranges) keeps the list
    at about the window's size; in-order packets keep it empty."""
    window = ReplayWindow()
    for n in range(0, 20 * REPLAY_WINDOW, 2):
        window.accept(n)
    assert REPLAY_WINDOW - 4 <= len(window._gaps) <= REPLAY_WINDOW + 4
    for n in range(20 * REPLAY_WINDOW, 22 * REPLAY_WINDOW):
        window.accept(n)
    assert window._gaps == []
    assert window.bits == (1 << REPLAY_WINDOW) - 1
