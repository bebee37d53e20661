from __future__ import annotations

import contextlib
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matchmaker.addresses import Address
from matchmaker.messages import (
    DEFAULT_LIMITS,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    Error,
    ErrorReason,
    Heartbeat,
    HostEntry,
    HostInfo,
    HostUpdate,
    InfoReply,
    InfoRequest,
    Introduce,
    Introduction,
    Limits,
    ListFilter,
    ListPage,
    ListRequest,
    Message,
    MessageError,
    MsgType,
    Ok,
    Register,
    Registered,
    Role,
    ServerInfo,
    ServerQuery,
    Unregister,
    Update,
    WrongVersion,
    WrongVersionError,
    _readers,
    decode,
    decode_request,
    encode,
    encode_entry,
    encode_page,
    entry_fields,
    filter_from_mapping,
    wire_entry_fields,
)
from matchmaker.messages._readers import _fast_entry, _read_entry_slow, _Reader

HOST = HostInfo(
    name="Friday night — ünïcode",
    game="q3",
    version="1.32c",
    max_players=16,
    map="q3dm17",
    players=3,
    password=True,
    tags=("ctf", "insta"),
    region="eu-west",
    info=b"\x00\x01opaque",
    lan=Address("192.168.1.5", 27960),
    key=b"k" * 32,
)
A = Address("198.51.100.7", 27960)
B = Address("2001:db8::1", 27961)

ALL_MESSAGES: list[Message] = [
    Register(request_id=1, host=HOST),
    Register(host=HostInfo(name="x", game="g", version="1", max_players=1)),
    Registered(request_id=2, address=A, keepalive=5.0),
    Registered(request_id=2, address=A, keepalive=5.0, secret=b"s" * 32),
    Update(request_id=3, changes=HostUpdate(players=4, map="dm6", tags=(), info=b"")),
    Update(request_id=3, changes=HostUpdate(password=False)),
    Unregister(request_id=4),
    Ok(request_id=4),
    Heartbeat(),
    ListRequest(request_id=5, filter=ListFilter(game="q3")),
    ListRequest(
        request_id=2**32 - 1,
        filter=ListFilter(
            game="q3",
            version="1.32c",
            map="q3dm17",
            region="eu",
            not_full=True,
            not_empty=True,
            password=False,
            tags_all=("ctf",),
            tags_any=("a", "b"),
            name="fri",
            family=6,
            limit=10,
        ),
    ),
    ListPage(
        request_id=5,
        seq=0,
        total=2,
        end=True,
        hosts=(
            HostEntry(address=A, info=HostInfo(name="a", game="q3", version="1", max_players=8)),
            HostEntry(address=B, info=HostInfo(name="b", game="q3", version="1", max_players=8)),
        ),
    ),
    ListPage(request_id=5, seq=3, total=0, end=False, hosts=()),
    InfoRequest(request_id=6),
    InfoReply(request_id=6, software="matchmaker/0.1.0", hosts=10, keepalive=5.0),
    Introduce(request_id=7, host=A),
    Introduce(request_id=7, host=B, lan=Address("10.0.0.2", 5000)),
    Introduction(request_id=7, role=Role.CLIENT, peer=A, nonce=bytes(16)),
    Introduction(role=Role.HOST, peer=B, peer_lan=Address("10.0.0.2", 1), nonce=b"n" * 16),
    Introduce(request_id=8, host=A, client_key=b"c" * 32, user_data=b"team=red"),
    Introduction(
        request_id=8, role=Role.CLIENT, peer=A, nonce=b"n" * 16, peer_key=b"k" * 32, token=b"t"
    ),
    Error(request_id=8, reason=ErrorReason.RATE_LIMITED, detail="slow down"),
    WrongVersion(request_id=9),
    ServerQuery(request_id=10, room=1170),
    ServerInfo(request_id=10, host=HostInfo(name="h", game="q3", version="1", max_players=8)),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def raw(t: int, **fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": t, **fields}, use_bin_type=True)


def reg(**overrides: object) -> bytes:
    fields: dict[str, object] = {"name": "n", "game": "g", "version": "1", "max_players": 4}
    fields.update(overrides)
    return raw(MsgType.REGISTER, **{k: v for k, v in fields.items() if v is not None})


def reason_of(data: bytes, limits: Limits = DEFAULT_LIMITS) -> ErrorReason:
    with pytest.raises(MessageError) as info:
        decode(data, limits)
    return info.value.reason


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", ErrorReason.MALFORMED),
        (b"\xc1", ErrorReason.MALFORMED),  # never-used msgpack byte
        (msgpack.packb([1, 2]), ErrorReason.MALFORMED),
        (msgpack.packb({1: 2}), ErrorReason.MALFORMED),
        (msgpack.packb({"v": 1, "t": 8}) + b"x", ErrorReason.MALFORMED),  # trailing garbage
        (msgpack.packb({"t": 8}), ErrorReason.WRONG_VERSION),
        (msgpack.packb({"v": 2, "t": 8}), ErrorReason.WRONG_VERSION),
        (msgpack.packb({"v": True, "t": 8}), ErrorReason.WRONG_VERSION),
        (raw(99), ErrorReason.UNKNOWN_TYPE),
        (raw(8.0), ErrorReason.UNKNOWN_TYPE),  # type: ignore[arg-type]
        (msgpack.packb({"v": 1, "t": "register"}), ErrorReason.UNKNOWN_TYPE),
        (raw(MsgType.HEARTBEAT, id=-1), ErrorReason.BAD_FIELD),
        (raw(MsgType.HEARTBEAT, id=2**32), ErrorReason.BAD_FIELD),
        (raw(MsgType.HEARTBEAT, id=True), ErrorReason.BAD_FIELD),
        (raw(MsgType.HEARTBEAT, extra=1), ErrorReason.UNKNOWN_FIELD),
        (reg(name=None), ErrorReason.MISSING_FIELD),
        (reg(game=None), ErrorReason.MISSING_FIELD),
        (reg(max_players=None), ErrorReason.MISSING_FIELD),
        (reg(name=""), ErrorReason.BAD_FIELD),
        (reg(name="   "), ErrorReason.BAD_FIELD),
        (reg(name="x" * 65), ErrorReason.BAD_FIELD),
        (reg(name="evil\nlog line"), ErrorReason.BAD_FIELD),
        (reg(name="bidi\u2028"), ErrorReason.BAD_FIELD),
        (reg(name=b"bytes"), ErrorReason.BAD_FIELD),
        (reg(game="has space"), ErrorReason.BAD_FIELD),
        (reg(game=""), ErrorReason.BAD_FIELD),
        (reg(game="-leading"), ErrorReason.BAD_FIELD),
        (reg(version="v" * 33), ErrorReason.BAD_FIELD),
        (reg(max_players=0), ErrorReason.BAD_FIELD),
        (reg(max_players=1025), ErrorReason.BAD_FIELD),
        (reg(max_players=True), ErrorReason.BAD_FIELD),
        (reg(max_players=4.0), ErrorReason.BAD_FIELD),
        (reg(players=5), ErrorReason.BAD_FIELD),  # > max_players
        (reg(players=-1), ErrorReason.BAD_FIELD),
        (reg(password=1), ErrorReason.BAD_FIELD),
        (reg(tags="ctf"), ErrorReason.BAD_FIELD),
        (reg(tags=["ok", ""]), ErrorReason.BAD_FIELD),
        (reg(tags=["a b"]), ErrorReason.BAD_FIELD),
        (reg(tags=[1]), ErrorReason.BAD_FIELD),
        (reg(tags=[f"t{i}" for i in range(17)]), ErrorReason.BAD_FIELD),
        (reg(region="eu west"), ErrorReason.BAD_FIELD),
        (reg(info="text"), ErrorReason.BAD_FIELD),
        (reg(info=b"x" * 513), ErrorReason.BAD_FIELD),
        (reg(lan=["10.0.0.1"]), ErrorReason.BAD_FIELD),
        (reg(lan=["10.0.0.1", 0]), ErrorReason.BAD_FIELD),
        (reg(lan=["10.0.0.1", 65536]), ErrorReason.BAD_FIELD),
        (reg(lan=["not-an-ip", 1]), ErrorReason.BAD_FIELD),
        (reg(lan=["10.0.0.1", True]), ErrorReason.BAD_FIELD),
        (reg(key=b"k" * 31), ErrorReason.BAD_FIELD),
        (reg(key=b"k" * 33), ErrorReason.BAD_FIELD),
        (reg(key="k" * 32), ErrorReason.BAD_FIELD),
        (raw(MsgType.INTRODUCE, host=["1.2.3.4", 1], client_key=b"c" * 31), ErrorReason.BAD_FIELD),
        (raw(MsgType.INTRODUCE, host=["1.2.3.4", 1], user_data=b"u" * 257), ErrorReason.BAD_FIELD),
        (raw(MsgType.UPDATE, players=2000), ErrorReason.BAD_FIELD),
        (raw(MsgType.UPDATE, game="other"), ErrorReason.UNKNOWN_FIELD),  # not updatable
        (raw(MsgType.UPDATE, name=""), ErrorReason.BAD_FIELD),
        (raw(MsgType.LIST), ErrorReason.MISSING_FIELD),
        (raw(MsgType.LIST, game="g", family=5), ErrorReason.BAD_FIELD),
        (raw(MsgType.LIST, game="g", family=4.0), ErrorReason.BAD_FIELD),
        (raw(MsgType.LIST, game="g", limit=0), ErrorReason.BAD_FIELD),
        (raw(MsgType.LIST, game="g", limit=1001), ErrorReason.BAD_FIELD),
        (raw(MsgType.LIST, game="g", not_full="yes"), ErrorReason.BAD_FIELD),
        (raw(MsgType.INTRODUCE), ErrorReason.MISSING_FIELD),
        (raw(MsgType.INTRODUCE, host=["1.2.3.4", 5, 6]), ErrorReason.BAD_FIELD),
        (
            raw(MsgType.INTRODUCTION, role="host", peer=["1.2.3.4", 5], nonce=b"short"),
            ErrorReason.BAD_FIELD,
        ),
        (
            raw(MsgType.INTRODUCTION, role="boss", peer=["1.2.3.4", 5], nonce=bytes(16)),
            ErrorReason.BAD_FIELD,
        ),
        (
            raw(MsgType.LIST_PAGE, seq=0, total=1, end=True, hosts=[{"addr": ["1.2.3.4", 5]}]),
            ErrorReason.MISSING_FIELD,
        ),
        (
            raw(MsgType.REGISTERED, addr=["1.2.3.4", 5], keepalive=float("nan")),
            ErrorReason.BAD_FIELD,
        ),
        (raw(MsgType.WRONG_VERSION, supported=[]), ErrorReason.BAD_FIELD),
    ],
)
def test_rejects(data: bytes, reason: ErrorReason) -> None:
    assert reason_of(data) == reason


def test_size_caps_before_parsing() -> None:
    limits = Limits(max_message_bytes=300)
    assert reason_of(reg(info=b"x" * 400), limits) == ErrorReason.TOO_LARGE
    # A length prefix claiming a huge string inside a small message is refused too.
    assert reason_of(b"\x81\xdb\xff\xff\xff\xff", limits) == ErrorReason.MALFORMED


def test_request_id_survives_into_errors() -> None:
    with pytest.raises(MessageError) as info:
        decode(reg(id=77, max_players=0))
    assert info.value.request_id == 77
    with pytest.raises(WrongVersionError) as wrong:
        decode(msgpack.packb({"v": 9, "t": 8, "id": 5}))
    assert wrong.value.request_id == 5 and wrong.value.version == 9


def test_decode_request_refuses_replies() -> None:
    assert isinstance(decode_request(encode(Heartbeat())), Heartbeat)
    with pytest.raises(MessageError) as info:
        decode_request(encode(Ok(request_id=3)))
    assert info.value.reason is ErrorReason.NOT_A_REQUEST
    assert info.value.request_id == 3


def test_tags_are_deduplicated_in_order() -> None:
    msg = decode(reg(tags=["b", "a", "b"]))
    assert isinstance(msg, Register)
    assert msg.host.tags == ("b", "a")


def test_unknown_error_reason_is_kept_as_text() -> None:
    msg = decode(raw(MsgType.ERROR, reason="from_the_future", detail="x"))
    assert isinstance(msg, Error)
    assert msg.reason is ErrorReason.INTERNAL and "from_the_future" in msg.detail


def test_list_entries_never_carry_lan() -> None:
    host = {"addr": ["1.2.3.4", 5], "name": "n", "game": "g", "version": "1", "max_players": 2}
    page = raw(MsgType.LIST_PAGE, seq=0, total=1, end=True, hosts=[host | {"lan": ["10.0.0.1", 1]}])
    assert reason_of(page) == ErrorReason.BAD_FIELD


def test_update_apply_checks_players_against_max() -> None:
    merged = HostUpdate(players=5, max_players=5).apply(HOST)
    assert (merged.players, merged.max_players, merged.name) == (5, 5, HOST.name)
    with pytest.raises(MessageError):
        HostUpdate(max_players=2).apply(HOST)  # 3 players > 2


def test_filter_from_mapping_validates_like_the_wire() -> None:
    assert filter_from_mapping({"game": "g", "tags_any": ["a"]}).tags_any == ("a",)
    with pytest.raises(MessageError) as info:
        filter_from_mapping({"game": "g", "bogus": 1})
    assert info.value.reason is ErrorReason.UNKNOWN_FIELD


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Limits(max_tags=0)


# ------------------------------------------------------------------ fuzzing


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_message_error(data: bytes) -> None:
    with contextlib.suppress(MessageError):
        decode(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
_field_names = st.sampled_from(
    [
        "name",
        "game",
        "version",
        "max_players",
        "players",
        "map",
        "password",
        "tags",
        "region",
        "info",
        "lan",
        "addr",
        "host",
        "peer",
        "nonce",
        "role",
        "seq",
        "total",
        "end",
        "hosts",
        "reason",
        "detail",
        "supported",
        "keepalive",
        "software",
        "limit",
        "family",
        "tags_all",
        "tags_any",
        "not_full",
        "id",
        "x",
    ]
)


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from([int(t) for t in MsgType]),
    st.dictionaries(_field_names, _values, max_size=10),
)
def test_structured_garbage_only_raises_message_error(kind: int, fields: dict[str, object]) -> None:
    data = msgpack.packb({**fields, "v": PROTOCOL_VERSION, "t": kind}, use_bin_type=True)
    try:
        msg = decode(data)
    except MessageError:
        return
    # Whatever decoded must encode back to something that decodes the same.
    assert decode(encode(msg)) == msg


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALL_MESSAGES), st.data())
def test_truncated_and_bit_flipped_messages(msg: Message, data: st.DataObject) -> None:
    encoded = encode(msg)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with contextlib.suppress(MessageError):
        decode(encoded[:cut])
    flip = data.draw(st.integers(0, len(encoded) - 1))
    mutated = bytearray(encoded)
    mutated[flip] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(MessageError):
        decode(bytes(mutated))


# ------------------------------------------------------------------ list pages, compact


FULL = HostInfo(
    name="full",
    game="q3",
    version="1",
    max_players=8,
    map="dm17",
    players=3,
    password=True,
    tags=("ctf",),
    region="eu",
    info=b"x",
    key=bytes(range(32)),
)
BARE = HostInfo(name="bare", game="q3", version="1", max_players=8)


def test_list_entries_leave_out_fields_at_their_default() -> None:
    bare, full = HostEntry(address=A, info=BARE), HostEntry(address=B, info=FULL)
    assert set(wire_entry_fields(bare)) == {"addr", "name", "game", "version", "max_players"}
    assert wire_entry_fields(full) == entry_fields(full)  # nothing at its default
    page = ListPage(seq=0, total=2, end=True, hosts=(bare, full))
    assert decode(encode(page)) == page


@pytest.mark.parametrize("request_id", [0, 7, MAX_REQUEST_ID])
def test_encode_page_from_encoded_entries_matches_encode(request_id: int) -> None:
    entries = (HostEntry(address=A, info=BARE), HostEntry(address=B, info=FULL))
    for hosts in ((), entries):
        page = ListPage(request_id=request_id, seq=70000, total=2, end=False, hosts=hosts)
        data = encode_page(
            request_id=request_id,
            seq=70000,
            total=2,
            end=False,
            entries=[encode_entry(e) for e in hosts],
        )
        assert data == encode(page)


def test_a_partial_answer_says_so_on_its_pages_and_only_then() -> None:
    entries = (HostEntry(address=A, info=BARE),)
    page = ListPage(request_id=3, seq=0, total=1, end=True, hosts=entries, partial=True)
    data = encode_page(
        request_id=3,
        seq=0,
        total=1,
        end=True,
        entries=[encode_entry(e) for e in entries],
        partial=True,
    )
    assert data == encode(page) and decode(data) == page
    assert msgpack.unpackb(data)["partial"] is True
    whole = replace(page, partial=False)
    assert "partial" not in msgpack.unpackb(encode(whole))  # as before: nothing added
    assert decode(encode(whole)) == whole


def test_page_seq_is_not_capped_by_the_readers_list_limit() -> None:
    # A daemon run with --list-limit 10000 sends more than 1000 pages; a client
    # with default limits must still read them.
    page = ListPage(seq=DEFAULT_LIMITS.list_limit + 500, total=1, end=True, hosts=())
    assert decode(encode(page)) == page


_ENTRY_VALUES = {
    "addr": st.sampled_from([["1.2.3.4", 5], ["::1", 5], ["1.2.3.4", True], ["01.2.3.4", 5], []]),
    "name": st.sampled_from(["a", " ", "x" * 64, "x" * 65, "a\x00", "é", 3]),
    "game": st.sampled_from(["q3", "", "-q3", "q 3", "x" * 33, None]),
    "version": st.sampled_from(["1", "1.32c", "", 1]),
    "max_players": st.sampled_from([1, 8, 0, 1025, True, 2.0]),
    "map": st.sampled_from(["", "dm\u2028", "m" * 65, b"m"]),
    "players": st.sampled_from([0, 3, 9, -1, False]),
    "password": st.sampled_from([True, False, 0, None]),
    "tags": st.sampled_from([[], ["a", "a"], ["a"] * 17, [""], ["a b"], "a", [1]]),
    "region": st.sampled_from(["", "eu", "e u", "e\x01", "x" * 33]),
    "info": st.sampled_from([b"", b"x" * 512, b"x" * 513, "x"]),
    "lan": st.sampled_from([["10.0.0.1", 1]]),
    "extra": st.just(1),
}


_ENTRY_REQUIRED = ("addr", "name", "game", "version", "max_players")


@given(
    st.fixed_dictionaries(
        {k: _ENTRY_VALUES[k] for k in _ENTRY_REQUIRED},
        optional={k: v for k, v in _ENTRY_VALUES.items() if k not in _ENTRY_REQUIRED},
    )
)
@settings(max_examples=300)
def test_fast_entry_reader_agrees_with_the_full_one(raw: dict[str, object]) -> None:
    reader = _Reader({}, DEFAULT_LIMITS, 0, envelope=False)
    try:
        slow: object = _read_entry_slow(raw, reader)
    except MessageError:
        slow = None
    fast = _fast_entry(raw, DEFAULT_LIMITS)
    # The fast path may hand anything over to the full reader, never disagree with it.
    assert fast is None or fast == slow
    if slow is not None and "lan" not in raw and "extra" not in raw:
        assert fast == slow  # and it does take the common case


def test_the_validated_identifier_and_tag_caches_refill_after_a_burst() -> None:
    # A burst of one-off names fills them; the names that come next are still cached
    # (they used to be checked anew forever once the caches were full).
    lim = Limits()
    for i in range(_readers._VALID_MAX + 10):
        assert _readers._is_ident(f"oneoff{i}", lim)
        assert _readers._tags([f"t{i}"], lim) == (f"t{i}",)
    assert len(_readers._VALID_IDENTS) <= _readers._VALID_MAX
    assert len(_readers._VALID_TAGS) <= _readers._VALID_MAX
    assert _readers._is_ident("common", lim) and "common" in _readers._VALID_IDENTS
    assert _readers._tags(["ctf", "eu"], lim) == ("ctf", "eu")
    assert ("ctf", "eu") in _readers._VALID_TAGS


@pytest.mark.parametrize(
    "version",
    [
        "deep",  # [[[...[None]...]]] a thousand deep: msgpack takes it, repr() did not
        [None] * 2000,
        b"\xff" * 3000,
        "x" * 3000,
    ],
)
def test_a_wrong_version_of_any_shape_is_a_short_message_error(version: object) -> None:
    if version == "deep":
        nested: object = None
        for _ in range(1010):
            nested = [nested]
        version = nested
    data = msgpack.packb({"v": version, "id": 7})
    assert len(data) <= DEFAULT_LIMITS.max_message_bytes
    with pytest.raises(WrongVersionError) as caught:
        decode(data)
    assert caught.value.request_id in (0, 7)
    assert len(caught.value.detail) <= 64
