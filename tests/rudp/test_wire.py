"""Decoders tested whole, byte by byte, with garbage, truncations and bit flips."""

from __future__ import annotations

import copy
import pickle
import random
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rudp import frames, wire, wire_v1
from rudp.config import Config
from rudp.endpoint import Endpoint
from rudp.events import MessageReceived
from rudp.protection import Opener, Sealer
from rudp.wire import DecodeError, DropReason, PacketType

KEY = bytes(range(32))
HEADER = wire.data_prefix(0xDEADBEEF, 7)


def _body() -> bytes:
    """The plaintext of a DATA packet: acknowledgment fields, then frames."""
    return b"".join(
        [
            wire.ack_fields(65535, 0x80000001),
            frames.message_frame(wire.Delivery.RELIABLE_ORDERED, 0, 65535, b"hello"),
            frames.message_frame(wire.Delivery.RELIABLE_ORDERED, 31, 1, b""),
            frames.message_frame(wire.Delivery.UNRELIABLE, 0, 0, b"x" * 300),
            frames.message_frame(wire.Delivery.UNRELIABLE, 200, 0, b"y"),
            frames.PING_FRAME,
            frames.disconnect_frame(4000, "bye ✓"),
        ]
    )


def _data_packet() -> bytes:
    return HEADER + Sealer(KEY).seal(7, HEADER, _body())


def _open(packet: bytes) -> bytes | None:
    cut = wire.DATA_PREFIX_SIZE
    return Opener(KEY).open(7, packet[:cut], packet[cut:])


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**62 - 1))
def test_data_prefix_read_and_built_as_the_struct_lays_it_out(dcid: int, pn: int) -> None:
    header = wire.DATA_PREFIX.pack(wire.DATA_BYTE, dcid, pn & 0xFFFFFFFF)
    assert wire.data_prefix(dcid, pn) == header
    # What a sender keeps per connection, then adds each packet's number to.
    assert wire.data_prefix_start(dcid) + (pn & 0xFFFFFFFF).to_bytes(4, "big") == header
    assert wire.decode_data_prefix(header + bytes(22)) == (dcid, pn & 0xFFFFFFFF)


def _body_of(*frames: bytes) -> bytes:
    return wire.ack_fields(3, 4) + b"".join(frames)


def test_data_packet_round_trip() -> None:
    packet = _data_packet()
    assert packet[0] == 0xA5 and len(packet) == wire.DATA_PREFIX_SIZE + len(_body()) + 16
    assert wire.decode_type(packet) is PacketType.DATA
    assert wire.decode_data_prefix(packet) == (0xDEADBEEF, 7)
    body = _open(packet)
    assert body == _body()
    assert wire.ACK_FIELDS.unpack_from(body) == (65535, 0x80000001)
    decoded = frames.decode_frames(body)
    assert decoded.messages == [
        (1, 0, 65535, b"hello", None),
        (1, 31, 1, b"", None),
        (0, 0, 0, b"x" * 300, None),
        (0, 200, 0, b"y", None),
    ]
    assert not decoded.special
    assert decoded.ping
    assert decoded.disconnect == frames.DisconnectFrame(4000, "bye ✓")


def test_data_overhead_is_header_ack_fields_and_tag() -> None:
    assert wire.DATA_HEADER_SIZE == 9 + 6 + 16
    assert len(HEADER + Sealer(KEY).seal(0, HEADER, wire.ack_fields(0, 0))) == 31
    assert wire.NOCONN_SIZE == 21 < wire.DATA_HEADER_SIZE  # a NOCONN never amplifies


def test_no_version_2_packet_starts_with_ff() -> None:
    firsts = {wire.MARKER | t for t in PacketType}
    assert firsts == set(range(0xA1, 0xA9))
    assert 0xFF not in firsts


def test_frame_size_matches_encoding() -> None:
    for mode in range(wire.WIRE_MODES):
        for channel in (0, 5):
            frame = frames.message_frame(mode, channel, 9, b"abc")
            assert len(frame) == frames.message_frame_size(mode, channel, 3)
            assert len(frame) - 3 <= frames.MESSAGE_OVERHEAD
    frame = frames.message_frame(3, 7, 9, b"abc", deps=(1, 2, 3), fragment=(0, 4, 100))
    assert len(frame) == frames.message_frame_size(3, 7, 3, deps=3, fragment=True)


def test_every_mode_fragment_and_dependency_round_trips() -> None:
    """Each mode's frame, with and without fragment header and dependencies, decodes
    to what was encoded; a dependency-free graph message costs exactly the bytes of a
    reliable-ordered one."""
    decoded = [
        frames.message_frame(2, 3, 65535, b"pos"),
        frames.message_frame(3, 0, 70000, b"free"),  # ids are sent mod 2**16
        frames.message_frame(3, 9, 12, b"dep", deps=(10, 65535)),
        frames.message_frame(4, 1, 5, b"latest"),
        frames.message_frame(1, 2, 40, b"frag", fragment=(1, 3, 10)),
        frames.message_frame(3, 0, 41, b"f0", deps=(7,), fragment=(0, 2, 3)),
        frames.message_frame(4, 4, 42, b"f1", fragment=(1, 2, 3)),
    ]
    decoded = frames.decode_frames(_body_of(*decoded))
    assert decoded.special
    FX = frames.FrameExtra
    assert decoded.messages == [
        (2, 3, 65535, b"pos", None),
        (3, 0, 70000 & 0xFFFF, b"free", None),
        (3, 9, 12, b"dep", FX(0, 0, 0, (10, 65535))),
        (4, 1, 5, b"latest", None),
        (1, 2, 40, b"frag", FX(3, 1, 10, ())),
        (3, 0, 41, b"f0", FX(2, 0, 3, (7,))),
        (4, 4, 42, b"f1", FX(2, 1, 3, ())),
    ]
    assert len(frames.message_frame(3, 5, 1, b"abc")) == len(frames.reliable_frame(5, 1, b"abc"))


@pytest.mark.parametrize(
    "frame",
    [
        bytes([0x80 | 0x40, 0, 0, 0, 0, 0, 0, 0, 0]),  # fragment flag on an unreliable message
        bytes([0x80 | 0x40 | 2, 0, 0, 0, 0, 0, 2, 0, 0, 0, 9, 0, 0]),  # ... unreliable-sequenced
        bytes([0x80 | 0x10 | 1, 0, 0, 1, 0, 0, 0, 0]),  # dependencies on a reliable-ordered one
        bytes([0x80 | 0x10 | 3, 0, 0, 0, 0, 0]),  # a dependency list of length 0
        bytes([0x80 | 0x20 | 3, 0, 0, 0, 0]),  # reserved flag
        bytes([0x80 | 0x40 | 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 9, 0, 0]),  # 1 fragment
        bytes([0x80 | 0x40 | 1, 0, 0, 0, 2, 0, 2, 0, 0, 0, 9, 0, 0]),  # index >= count
        bytes([0x80 | 0x40 | 1, 0, 0, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0]),  # total < count
        # dependencies on a fragment other than the first:
        bytes([0x80 | 0x50 | 3, 0, 0, 0, 1, 0, 2, 0, 0, 0, 9, 1, 0, 0, 0, 0]),
        bytes([0x80 | 6, 0, 0, 0, 0]),  # wire mode 6
    ],
)
def test_inconsistent_frame_headers_are_malformed(frame: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        frames.decode_frames(_body_of(frame))
    assert info.value.reason is DropReason.MALFORMED


MSG1 = bytes(range(83))
TOKEN = bytes(range(100, 116))


@pytest.mark.parametrize(
    ("encoded", "decode", "expected"),
    [
        (wire.encode_challenge(3, b"k" * 20), wire.decode_challenge, wire.Challenge(3, b"k" * 20)),
        (wire.encode_accept(4, MSG1), wire.decode_accept, wire.Accept(4, MSG1)),
        (wire.encode_reject(7, "server full"), wire.decode_reject, wire.Reject(7, "server full")),
        (wire.encode_noconn(8, TOKEN), wire.decode_noconn, wire.NoConn(8, TOKEN)),
        (
            wire.encode_query(PacketType.QUERY, 10, b"q", 100),
            wire.decode_query,
            wire.Query(10, b"q"),
        ),
    ],
)
def test_control_packets_round_trip(encoded: bytes, decode: object, expected: object) -> None:
    wire.decode_type(encoded)
    assert decode(encoded) == expected  # type: ignore[operator]


def test_connect_round_trips_and_is_padded_to_the_datagram_size() -> None:
    packet = wire.encode_connect(1, 1, b"c" * 20, MSG1, 1200)
    assert len(packet) == 1200
    assert wire.decode_type(packet) is PacketType.CONNECT
    request = wire.decode_connect(packet)
    assert (request.salt, request.pattern, request.cookie) == (1, 1, b"c" * 20)
    assert request.rest[: len(MSG1)] == MSG1 and not any(request.rest[len(MSG1) :])
    assert packet[:2] == bytes([0xA1, 2])


def test_reject_text_is_clipped_on_a_character_boundary() -> None:
    packet = wire.encode_reject(1, "é" * 200)
    text = wire.decode_reject(packet).text
    assert len(text.encode()) <= wire.MAX_REJECT_TEXT
    assert set(text) == {"é"}


def test_every_truncation_is_rejected() -> None:
    packet = _data_packet()
    for n in range(len(packet)):
        cut = packet[:n]
        try:
            wire.decode_type(cut)
        except DecodeError:
            continue
        assert _open(cut) is None  # the tag no longer matches
    for control in (wire.encode_challenge(3, b"k" * 20), wire.encode_accept(4, MSG1)):
        for n in range(len(control)):
            with pytest.raises(DecodeError):
                wire.decode_type(control[:n])


def test_truncation_on_a_frame_boundary_is_the_only_one_the_frame_parser_takes() -> None:
    body = _body()
    full = frames.decode_frames(body)
    accepted = 0
    for n in range(wire.ACK_SIZE + 1, len(body)):
        try:
            decoded = frames.decode_frames(body[:n])
        except DecodeError:
            continue
        # Only a cut exactly on a frame boundary is valid: a prefix of the decoded.
        accepted += 1
        assert decoded.messages == full.messages[: len(decoded.messages)]
        assert decoded.disconnect is None
    assert accepted == 5  # one per frame boundary before the last frame


def test_every_single_bit_flip_is_caught() -> None:
    packet = _data_packet()
    for bit in range(len(packet) * 8):
        flipped = bytearray(packet)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            wire.decode_type(bytes(flipped))
        except DecodeError:
            continue
        assert _open(bytes(flipped)) is None  # the seal catches what the type byte lets by
    control = wire.encode_challenge(3, b"k" * 20)
    for bit in range(len(control) * 8):
        flipped = bytearray(control)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(DecodeError) as info:
            wire.decode_type(bytes(flipped))
        if bit >= 8:  # the type byte's flips make other types, caught by their own checks
            assert info.value.reason is DropReason.BAD_CHECKSUM


def _with_crc(head: bytes) -> bytes:
    return head + wire.CRC.pack(zlib.crc32(head, wire.PROTOCOL_ID))


def test_wrong_version_and_unknown_type() -> None:
    with pytest.raises(DecodeError) as info:
        wire.decode_type(_with_crc(bytes([0xA2, wire.PROTOCOL_VERSION + 1]) + bytes(20)))
    assert info.value.reason is DropReason.WRONG_VERSION
    with pytest.raises(DecodeError) as info:
        wire.decode_type(_with_crc(bytes([0xA9, wire.PROTOCOL_VERSION]) + bytes(20)))
    assert info.value.reason is DropReason.UNKNOWN_TYPE


def test_version_1_datagrams_are_recognised_as_the_wrong_version() -> None:
    v1 = wire_v1.encode_v1_connect(0x1122334455667788)
    assert len(v1) == 1200 and wire_v1.is_v1(v1)
    with pytest.raises(DecodeError) as info:
        wire.decode_type(v1)
    assert info.value.reason is DropReason.WRONG_VERSION
    assert wire_v1.v1_connect_salt(v1) == 0x1122334455667788
    assert wire_v1.v1_connect_salt(wire_v1.encode_v1_connect(5, pad_to=100)) is None  # too short
    reject = wire_v1.encode_v1_reject(5, "speak version 2")
    assert wire_v1.is_v1(reject) and len(reject) < wire_v1.V1_CONNECT_SIZE
    assert reject[4:6] == bytes([1, 4])


def test_reserved_flags_and_unknown_frames_are_malformed() -> None:
    for frame in (bytes([0x80 | 0x10, 0, 0]), bytes([0x80 | 0x05, 0, 0]), bytes([0x33])):
        with pytest.raises(DecodeError) as info:
            frames.decode_frames(_body_of(frame))
        assert info.value.reason is DropReason.MALFORMED


@given(st.binary(max_size=1500))
def test_random_bytes_never_raise_anything_but_decode_error(data: bytes) -> None:
    try:
        ptype = wire.decode_type(data)
    except DecodeError:
        return
    _decode_body(ptype, data)


@given(st.integers(1, 8), st.binary(max_size=1400))
def test_random_bodies_with_a_valid_crc_never_raise(ptype: int, body: bytes) -> None:
    data = _with_crc(bytes([wire.MARKER | ptype, wire.PROTOCOL_VERSION]) + body)
    try:
        ptype = wire.decode_type(data)
    except DecodeError:
        return
    _decode_body(ptype, data)


def _decode_body(ptype: PacketType, data: bytes) -> None:
    decoders = {
        PacketType.CONNECT: wire.decode_connect,
        PacketType.CHALLENGE: wire.decode_challenge,
        PacketType.ACCEPT: wire.decode_accept,
        PacketType.REJECT: wire.decode_reject,
        PacketType.NOCONN: wire.decode_noconn,
        PacketType.QUERY: wire.decode_query,
        PacketType.QUERY_REPLY: wire.decode_query,
    }
    try:
        if ptype is PacketType.DATA:
            wire.decode_data_prefix(data)
            frames.decode_frames(data[wire.DATA_PREFIX_SIZE :])
        else:
            decoders[ptype](data)
    except DecodeError:
        pass


@given(st.lists(st.binary(max_size=1300), max_size=40), st.integers(0, 2**32))
def test_endpoint_counts_every_bad_datagram_and_never_raises(
    datagrams: list[bytes], seed: int
) -> None:
    endpoint = Endpoint(Config(), now=0.0, rng=random.Random(seed), accept=True)
    for i, data in enumerate(datagrams):
        endpoint.receive_datagram(data, ("127.0.0.1", 4000 + i), float(i))
    stats = endpoint.stats
    assert stats.datagrams_received == len(datagrams)
    assert not endpoint.connections
    # Nothing unvalidated can make the endpoint send more than it received.
    endpoint.datagrams_to_send(float(len(datagrams)))
    assert stats.unvalidated_bytes_sent <= stats.unvalidated_bytes_received


def test_bit_flipped_real_packets_are_dropped_and_counted() -> None:
    rng = random.Random(5)
    endpoint = Endpoint(Config(), now=0.0, rng=rng, accept=True)
    packet = _data_packet()
    for i in range(500):
        flipped = bytearray(packet)
        for _ in range(rng.randint(1, 8)):
            bit = rng.randrange(len(flipped) * 8)
            flipped[bit // 8] ^= 1 << (bit % 8)
        endpoint.receive_datagram(bytes(flipped), ("127.0.0.1", 5000), float(i))
    # Mostly an unknown connection id (no connection here); a flipped type byte makes
    # other packet types, whose checks catch it. Never anything else: nothing opens.
    assert endpoint.stats.datagrams_dropped == 500
    assert endpoint.stats.dropped[DropReason.UNKNOWN_PEER] > 400
    assert not endpoint.connections


def test_the_hot_path_int_constants_match_their_enums() -> None:
    """The core compares plain ints on the hot path (an IntEnum comparison costs more
    when compiled); each must stay equal to the enum member it stands for."""
    from rudp import state as states

    assert int(wire.Delivery.UNRELIABLE) == wire._UNRELIABLE
    assert int(wire.Delivery.RELIABLE_ORDERED) == wire._ORDERED
    assert int(wire.Delivery.RELIABLE_UNORDERED) == wire._UNORDERED
    assert int(frames.FrameType.PING) == frames._PING
    assert int(frames.FrameType.DISCONNECT) == frames._DISCONNECT
    assert int(wire.PacketType.DATA) == wire._DATA
    for name in (
        "UNRELIABLE",
        "RELIABLE_ORDERED",
        "UNRELIABLE_SEQUENCED",
        "RELIABLE_SEQUENCED",
        "DEPENDENCY_ORDERED",
    ):
        assert getattr(wire, name) == wire.Delivery[name]
    assert int(wire.Delivery.RELIABLE_UNORDERED) == wire.GRAPH
    for state in states.State:
        assert getattr(states, state.name) is state
    unreliable = (int(wire.Delivery.UNRELIABLE), int(wire.Delivery.UNRELIABLE_SEQUENCED))
    assert unreliable == wire.UNRELIABLE_MODES  # defined once, in wire


@pytest.mark.parametrize("channel", [0, 1, 31])
@pytest.mark.parametrize("size", [0, 1, 64, 1000])
def test_the_fast_frame_encoders_match_the_layout(channel: int, size: int) -> None:
    data = bytes(range(256)) * 4
    data = data[:size]
    head = bytes([0x81 | (0x08 if channel else 0)]) + (bytes([channel]) if channel else b"")
    assert (
        frames.reliable_frame(channel, 0x12345, data)
        == head + b"\x23\x45" + size.to_bytes(2, "big") + data
    )
    head = bytes([0x80 | (0x08 if channel else 0)]) + (bytes([channel]) if channel else b"")
    assert frames.unreliable_frame(channel, data) == head + size.to_bytes(2, "big") + data


def test_a_received_message_copies_pickles_and_matches_like_the_tuple_it_was() -> None:
    msg = MessageReceived(b"payload", 3, True)
    for clone in (copy.copy(msg), copy.deepcopy(msg), pickle.loads(pickle.dumps(msg))):
        assert clone == msg and type(clone) is MessageReceived
    match msg:
        case MessageReceived(data, channel, reliable):
            assert (data, channel, reliable) == (b"payload", 3, True)
        case _:
            raise AssertionError("positional pattern did not match")
