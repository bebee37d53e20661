"""Decoding: msgpack bytes to validated messages, strict and total.

`decode` unpacks with msgpack capped by `Limits`, checks the envelope (``id``,
then ``v``: another version raises `WrongVersionError` before anything else is
read), then hands the fields to the reader for the type code.  A `_Reader`
gives typed, bounded access to fields and remembers which were read, so
`_Reader.finish` can reject unknown ones.  Every defect raises `MessageError`
with an `ErrorReason`; no other exception escapes, whatever the bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgpack

from matchmaker.addresses import make_address
from matchmaker.interning import share
from matchmaker.messages._types import (
    DEFAULT_LIMITS,
    ENTRY_DEFAULTS,
    MAX_REQUEST_ID,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    SECRET_BYTES,
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
    Request,
    Role,
    ServerInfo,
    ServerQuery,
    Unregister,
    Update,
    WrongVersion,
    WrongVersionError,
)
from rudp.tokens import KEY_SIZE, MAX_TOKEN_SIZE, MAX_USER_DATA

__all__ = ["decode", "decode_host", "decode_request", "filter_from_mapping", "read_filter"]

# Identifiers (game, version, region, tags): ASCII, no spaces, so they are safe
# as filter keys, in logs and in URLs.
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+\-]*")
# Free text (host name, map): any printable Unicode, no control characters
# (they would let a host forge log lines or garble server browsers).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MISSING: Any = object()

# Identifiers and tag lists a list's entries repeat (most hosts of a game share its
# game, version, region and tags): the ones seen valid, so that a 10,000-host list
# checks each once, not 10,000 times.  Bounded: once full they are emptied and fill
# again, so a burst of one-off values cannot keep the common ones out for good.
_VALID_IDENTS: dict[str, None] = {}
_VALID_TAGS: dict[tuple[object, ...], tuple[tuple[str, ...], int]] = {}
"""A tag list as received -> (the tags without repeats, the longest tag's length)."""
_VALID_MAX = 4096


class _Reader:
    """Typed, bounded access to one message's fields; remembers which were read."""

    def __init__(
        self, fields: Mapping[str, object], limits: Limits, request_id: int, *, envelope: bool
    ) -> None:
        self._fields = fields
        self._seen: set[str] = {"v", "t", "id"} if envelope else set()
        self.limits = limits
        self.request_id = request_id

    def fail(self, reason: ErrorReason, detail: str) -> MessageError:
        return MessageError(reason, detail, request_id=self.request_id)

    def has(self, key: str) -> bool:
        return key in self._fields

    def raw(self, key: str, default: object) -> object:
        self._seen.add(key)
        if key in self._fields:
            return self._fields[key]
        if default is _MISSING:
            raise self.fail(ErrorReason.MISSING_FIELD, key)
        return default

    def finish(self) -> None:
        extra = sorted(set(self._fields) - self._seen)
        if extra:
            raise self.fail(ErrorReason.UNKNOWN_FIELD, ",".join(extra)[:64])

    def text(
        self, key: str, max_chars: int, *, ident: bool = False, default: Any = _MISSING
    ) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, str) or len(v) > max_chars:
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: string of at most {max_chars} chars")
        if ident:
            if not _IDENT.fullmatch(v):
                raise self.fail(ErrorReason.BAD_FIELD, f"{key}: identifier [A-Za-z0-9._+-]")
            return v  # an identifier is ASCII without control characters
        if _CONTROL.search(v):
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: control characters")
        return v

    def ident(self, key: str, *, default: Any = _MISSING) -> Any:
        return self.text(key, self.limits.ident_chars, ident=True, default=default)

    def integer(self, key: str, lo: int, hi: int, *, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        # bool is an int subclass in Python but a distinct msgpack type.
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: integer in [{lo}, {hi}]")
        return v

    def number(self, key: str, lo: float, hi: float) -> float:
        v = self.raw(key, _MISSING)
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        if not ok or not math.isfinite(float(v)) or not lo <= float(v) <= hi:  # type: ignore[arg-type]
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: number in [{lo}, {hi}]")
        return float(v)  # type: ignore[arg-type]

    def boolean(self, key: str, *, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: boolean")
        return v

    def blob(self, key: str, max_bytes: int, *, min_bytes: int = 0, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, bytes) or not min_bytes <= len(v) <= max_bytes:
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: {min_bytes}..{max_bytes} bytes")
        return v

    def idents(self, key: str, *, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if not isinstance(v, list) or len(v) > self.limits.max_tags:
            raise self.fail(ErrorReason.BAD_FIELD, f"{key}: at most {self.limits.max_tags} items")
        for item in v:
            if not isinstance(item, str) or not 0 < len(item) <= self.limits.ident_chars:
                raise self.fail(ErrorReason.BAD_FIELD, f"{key}: identifiers")
            if not _IDENT.fullmatch(item):
                raise self.fail(ErrorReason.BAD_FIELD, f"{key}: identifier [A-Za-z0-9._+-]")
        # Order-preserving de-duplication: tags are a set, but a stable order is nicer.
        return tuple(dict.fromkeys(v))

    def address(self, key: str, *, default: Any = _MISSING) -> Any:
        v = self.raw(key, default)
        if v is default and default is not _MISSING:
            return v
        if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and len(v[0]) <= 64:
            port = v[1]
            if isinstance(port, int) and not isinstance(port, bool):
                try:
                    return make_address(v[0], port)
                except ValueError:
                    pass
        raise self.fail(ErrorReason.BAD_FIELD, f"{key}: [ip, port]")


def _read_host(r: _Reader) -> HostInfo:
    lim = r.limits
    max_players = r.integer("max_players", 1, lim.max_players)
    host = HostInfo(
        name=r.text("name", lim.name_chars),
        game=r.ident("game"),
        version=r.ident("version"),
        map=r.text("map", lim.map_chars, default=""),
        players=r.integer("players", 0, max_players, default=0),
        max_players=max_players,
        password=r.boolean("password", default=False),
        tags=r.idents("tags", default=()),
        region=r.text("region", lim.ident_chars, default=""),
        info=r.blob("info", lim.info_bytes, default=b""),
        lan=r.address("lan", default=None),
        key=r.blob("key", KEY_SIZE, default=b""),
    )
    if len(host.key) not in (0, KEY_SIZE):
        raise r.fail(ErrorReason.BAD_FIELD, f"key: empty or {KEY_SIZE} bytes")
    if not host.name.strip():
        raise r.fail(ErrorReason.BAD_FIELD, "name: empty")
    if host.region and not _IDENT.fullmatch(host.region):
        raise r.fail(ErrorReason.BAD_FIELD, "region: identifier [A-Za-z0-9._+-]")
    return host


def _read_update(r: _Reader) -> HostUpdate:
    lim = r.limits
    upd = HostUpdate(
        name=r.text("name", lim.name_chars, default=None),
        map=r.text("map", lim.map_chars, default=None),
        players=r.integer("players", 0, lim.max_players, default=None),
        max_players=r.integer("max_players", 1, lim.max_players, default=None),
        password=r.boolean("password", default=None) if r.has("password") else None,
        tags=r.idents("tags", default=None),
        region=r.text("region", lim.ident_chars, default=None),
        info=r.blob("info", lim.info_bytes, default=None) if r.has("info") else None,
    )
    if upd.name is not None and not upd.name.strip():
        raise r.fail(ErrorReason.BAD_FIELD, "name: empty")
    if upd.region and not _IDENT.fullmatch(upd.region):
        raise r.fail(ErrorReason.BAD_FIELD, "region: identifier [A-Za-z0-9._+-]")
    return upd


def read_filter(r: _Reader) -> ListFilter:
    """ListFilter from a reader; shared by the wire decoder and the HTTP query parser."""
    lim = r.limits
    family = r.integer("family", 4, 6, default=None)
    if family == 5:
        raise r.fail(ErrorReason.BAD_FIELD, "family: 4 or 6")
    return ListFilter(
        game=r.ident("game"),
        version=r.ident("version", default=None),
        map=r.text("map", lim.map_chars, default=None),
        region=r.ident("region", default=None),
        not_full=r.boolean("not_full", default=False),
        not_empty=r.boolean("not_empty", default=False),
        password=r.boolean("password", default=None) if r.has("password") else None,
        tags_all=r.idents("tags_all", default=()),
        tags_any=r.idents("tags_any", default=()),
        name=r.text("name", lim.name_chars, default=None),
        family=family,
        limit=r.integer("limit", 1, lim.list_limit, default=lim.list_limit),
    )


_ENTRY_KEYS = frozenset(
    ("addr", "name", "game", "version", "max_players", *(k for k, _ in ENTRY_DEFAULTS))
)
_ENTRY_REQUIRED = frozenset(("addr", "name", "game", "version", "max_players"))


def _fast_entry(raw: dict[str, Any], lim: Limits) -> HostEntry | None:
    """`_read_entry` for a valid entry, ~2x cheaper; None means "take the slow path".

    A 10,000-host list is 10,000 entries to validate on the client.  This
    accepts only what `_read_entry` accepts, with the same result; anything
    doubtful goes to `_read_entry`, which also words the error.  Keys outside
    `_ENTRY_KEYS` (every one a str) fail the first test, so it also checks that
    every key is a str.
    """
    if not _ENTRY_REQUIRED <= raw.keys() <= _ENTRY_KEYS:
        return None
    addr = raw["addr"]
    if not (
        type(addr) is list
        and len(addr) == 2
        and type(addr[0]) is str
        and len(addr[0]) <= 64
        and type(addr[1]) is int
    ):
        return None
    host = _fast_info(raw, lim, _as_is)
    if host is None:
        return None
    try:
        address = make_address(addr[0], addr[1])
    except ValueError:
        return None
    return HostEntry(address=address, info=host)


def _as_is(text: str) -> str:
    return text


def _fast_info(raw: dict[str, Any], lim: Limits, share: Callable[[str], str]) -> HostInfo | None:
    """The HostInfo of `raw`'s host fields if every one is valid, else None (the
    callers' slow path words the error); `share` applied to the strings many hosts
    repeat (game, version, map, region)."""
    name, game, version, top = raw["name"], raw["game"], raw["version"], raw["max_players"]
    m, players = raw.get("map", ""), raw.get("players", 0)
    tags, region, info = raw.get("tags", []), raw.get("region", ""), raw.get("info", b"")
    key = raw.get("key", b"")
    ok = (
        type(name) is str
        and len(name) <= lim.name_chars
        and not _CONTROL.search(name)
        and bool(name.strip())
        and _is_ident(game, lim)
        and _is_ident(version, lim)
        and type(top) is int
        and 1 <= top <= lim.max_players
        and type(m) is str
        and len(m) <= lim.map_chars
        and (not m or not _CONTROL.search(m))
        and type(players) is int
        and 0 <= players <= top
        and type(raw.get("password", False)) is bool
        and type(tags) is list
        and (region == "" or _is_ident(region, lim))
        and type(info) is bytes
        and len(info) <= lim.info_bytes
        and type(key) is bytes
        and len(key) in (0, KEY_SIZE)
    )
    unique = _tags(tags, lim) if ok else None
    if unique is None:
        return None
    return HostInfo(
        name=name,
        game=share(game),
        version=share(version),
        max_players=top,
        map=share(m),
        players=players,
        password=raw.get("password", False),
        tags=unique,
        region=share(region),
        info=info,
        key=key,
    )


def _tags(tags: list[object], lim: Limits) -> tuple[str, ...] | None:
    """`tags` without repeats if every one is an identifier and they are few enough
    for `lim`, else None; the answer for a tag list seen before is looked up."""
    if len(tags) > lim.max_tags:
        return None
    key = tuple(tags)
    try:
        known = _VALID_TAGS.get(key)
    except TypeError:  # an unhashable item: not a tag
        return None
    if known is None:
        if not all(_is_ident(t, lim) for t in tags):
            return None
        # Shared: the registry shares tag strings (`registry.base.shared_strings`).
        unique: tuple[str, ...] = tuple(dict.fromkeys(map(share, key)))  # type: ignore[arg-type]
        known = (unique, max(map(len, unique), default=0))
        if len(_VALID_TAGS) >= _VALID_MAX:
            _VALID_TAGS.clear()
        _VALID_TAGS[key] = known
    return known[0] if known[1] <= lim.ident_chars else None


def _is_ident(v: object, lim: Limits) -> bool:
    if type(v) is not str or not 0 < len(v) <= lim.ident_chars:
        return False
    if v in _VALID_IDENTS:
        return True
    if not _IDENT.fullmatch(v):
        return False
    if len(_VALID_IDENTS) >= _VALID_MAX:
        _VALID_IDENTS.clear()
    _VALID_IDENTS[v] = None
    return True


def _read_entry(raw: object, r: _Reader) -> HostEntry:
    if type(raw) is dict:
        fast = _fast_entry(raw, r.limits)
        if fast is not None:
            return fast
    return _read_entry_slow(raw, r)


def _read_entry_slow(raw: object, r: _Reader) -> HostEntry:
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise r.fail(ErrorReason.BAD_FIELD, "hosts: maps")
    sub = _Reader(raw, r.limits, r.request_id, envelope=False)
    address = sub.address("addr")
    info = _read_host(sub)
    if info.lan is not None:
        raise r.fail(ErrorReason.BAD_FIELD, "hosts: lan is never listed")
    sub.finish()
    return HostEntry(address=address, info=info)


def _read_server_info(r: _Reader) -> ServerInfo:
    host = _read_host(r)
    if host.lan is not None:
        raise r.fail(ErrorReason.BAD_FIELD, "lan: never sent to a querier")
    return ServerInfo(request_id=r.request_id, host=host)


def _read_page(r: _Reader) -> ListPage:
    raw = r.raw("hosts", _MISSING)
    if not isinstance(raw, list) or len(raw) > r.limits.list_limit:
        raise r.fail(ErrorReason.BAD_FIELD, "hosts: list")
    return ListPage(
        request_id=r.request_id,
        # Not capped by list_limit: the daemon's --list-limit may exceed the reader's.
        seq=r.integer("seq", 0, 2**31),
        total=r.integer("total", 0, 2**31),
        end=r.boolean("end"),
        hosts=tuple(_read_entry(item, r) for item in raw),
        partial=r.boolean("partial", default=False),
    )


def _read_introduction(r: _Reader) -> Introduction:
    role = r.text("role", 8)
    if role not in (Role.HOST.value, Role.CLIENT.value):
        raise r.fail(ErrorReason.BAD_FIELD, "role: host or client")
    return Introduction(
        request_id=r.request_id,
        role=Role(role),
        peer=r.address("peer"),
        peer_lan=r.address("peer_lan", default=None),
        nonce=r.blob("nonce", NONCE_BYTES, min_bytes=NONCE_BYTES),
        peer_key=r.blob("peer_key", KEY_SIZE, min_bytes=KEY_SIZE) if r.has("peer_key") else None,
        token=r.blob("token", MAX_TOKEN_SIZE, min_bytes=1) if r.has("token") else None,
    )


def _read_error(r: _Reader) -> Error:
    reason = r.text("reason", 32)
    try:
        code = ErrorReason(reason)
    except ValueError:
        # A newer matchmaker may add reasons; keep the text in the detail.
        code, reason = ErrorReason.INTERNAL, f"{reason}: "
    else:
        reason = ""
    detail = r.text("detail", r.limits.detail_chars, default="")
    return Error(request_id=r.request_id, reason=code, detail=reason + detail)


def _read_supported(r: _Reader) -> WrongVersion:
    raw = r.raw("supported", _MISSING)
    if not isinstance(raw, list) or not 0 < len(raw) <= 16:
        raise r.fail(ErrorReason.BAD_FIELD, "supported: list of versions")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**16 for x in raw):
        raise r.fail(ErrorReason.BAD_FIELD, "supported: list of versions")
    return WrongVersion(request_id=r.request_id, supported=tuple(raw))


_READERS: dict[MsgType, Callable[[_Reader], Message]] = {
    MsgType.REGISTER: lambda r: Register(request_id=r.request_id, host=_read_host(r)),
    MsgType.REGISTERED: lambda r: Registered(
        request_id=r.request_id,
        address=r.address("addr"),
        keepalive=r.number("keepalive", 0, 3600),
        secret=r.blob("secret", SECRET_BYTES, min_bytes=SECRET_BYTES, default=b""),
    ),
    MsgType.UPDATE: lambda r: Update(request_id=r.request_id, changes=_read_update(r)),
    MsgType.UNREGISTER: lambda r: Unregister(request_id=r.request_id),
    MsgType.OK: lambda r: Ok(request_id=r.request_id),
    MsgType.HEARTBEAT: lambda r: Heartbeat(request_id=r.request_id),
    MsgType.LIST: lambda r: ListRequest(request_id=r.request_id, filter=read_filter(r)),
    MsgType.LIST_PAGE: _read_page,
    MsgType.INFO: lambda r: InfoRequest(request_id=r.request_id),
    MsgType.INFO_REPLY: lambda r: InfoReply(
        request_id=r.request_id,
        software=r.text("software", 64),
        hosts=r.integer("hosts", 0, 2**31),
        keepalive=r.number("keepalive", 0, 3600),
    ),
    MsgType.INTRODUCE: lambda r: Introduce(
        request_id=r.request_id,
        host=r.address("host"),
        lan=r.address("lan", default=None),
        client_key=(
            r.blob("client_key", KEY_SIZE, min_bytes=KEY_SIZE) if r.has("client_key") else None
        ),
        user_data=r.blob("user_data", MAX_USER_DATA, default=b""),
    ),
    MsgType.INTRODUCTION: _read_introduction,
    MsgType.ERROR: _read_error,
    MsgType.WRONG_VERSION: _read_supported,
    MsgType.SERVER_QUERY: lambda r: ServerQuery(
        request_id=r.request_id, room=r.integer("room", 0, 65535)
    ),
    MsgType.SERVER_INFO: _read_server_info,
}


_TYPE_CODES = frozenset(int(t) for t in MsgType)


def _unpack(data: bytes, limits: Limits) -> dict[str, object]:
    if len(data) > limits.max_message_bytes:
        raise MessageError(ErrorReason.TOO_LARGE, f"{len(data)} > {limits.max_message_bytes}")
    cap = limits.max_message_bytes
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=cap,
            max_bin_len=cap,
            max_array_len=cap,
            max_map_len=64,
            max_ext_len=0,
        )
    # msgpack signals bad input with an assortment of exception types
    # (ExtraData, FormatError, StackError, ValueError, UnicodeDecodeError,
    # TypeError for unhashable keys...); all of them mean "malformed".
    except Exception as exc:
        raise MessageError(ErrorReason.MALFORMED, type(exc).__name__) from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise MessageError(ErrorReason.MALFORMED, "not a map with string keys")
    return obj


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validated message from `data`; raises MessageError (or WrongVersionError).

    A valid `Register`, what a registration storm is made of, is read on
    `decode_host`'s fast path (its host's shared strings already shared, so the
    registry keeps them as they are); anything else, or anything doubtful, by the
    readers (`_decode_slow`), which word the error."""
    fields = _unpack(data, limits)
    if fields.get("t") == MsgType.REGISTER:
        host = _fast_host(fields, limits)
        if host is not None:
            return Register(request_id=cast(int, fields.get("id", 0)), host=host)  # checked
    return _read_fields(fields, limits)


def _decode_slow(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Message:
    """`decode` by the readers alone: the reference the fast path is tested against."""
    return _read_fields(_unpack(data, limits), limits)


def _read_fields(fields: dict[str, Any], limits: Limits) -> Message:
    rid = fields.get("id", 0)
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid <= MAX_REQUEST_ID:
        raise MessageError(ErrorReason.BAD_FIELD, "id: integer in [0, 2**32-1]")
    version = fields.get("v")
    # type() not isinstance(): True == 1 and 1.0 == 1 in Python, not on the wire.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WrongVersionError(version, request_id=rid)
    kind = fields.get("t")
    reader = _READERS.get(MsgType(kind)) if type(kind) is int and kind in _TYPE_CODES else None
    if reader is None:
        raise MessageError(ErrorReason.UNKNOWN_TYPE, repr(kind)[:32], request_id=rid)
    r = _Reader(fields, limits, rid, envelope=True)
    msg = reader(r)
    r.finish()
    return msg


def decode_request(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Request:
    """Like `decode`, but only accepts what a client may send to the matchmaker."""
    msg = decode(data, limits)
    if not isinstance(msg, REQUEST_TYPES):
        raise MessageError(ErrorReason.NOT_A_REQUEST, msg.TYPE.name, request_id=msg.request_id)
    return msg  # type: ignore[return-value]


def filter_from_mapping(
    fields: Mapping[str, object], limits: Limits = DEFAULT_LIMITS
) -> ListFilter:
    """A validated ListFilter from already-typed values (the HTTP query parser's path)."""
    r = _Reader(fields, limits, 0, envelope=False)
    f = read_filter(r)
    r.finish()
    return f


_HOST_REQUIRED = frozenset(("v", "t", "name", "game", "version", "max_players"))
_HOST_KEYS = _HOST_REQUIRED | {
    "id", "map", "players", "password", "tags", "region", "info", "lan", "key"
}  # fmt: skip


def decode_host(data: bytes, limits: Limits = DEFAULT_LIMITS) -> HostInfo:
    """The host of an encoded `Register` message, validated as `decode` does.

    What a registry stores of a host and reads back (another replica's write):
    for a valid one, the fast path `decode` also takes for a `Register` (~2x
    cheaper than the readers, with the same result), its game, version, map and
    region shared (`interning.share`) and its tags a shared tuple.  Anything
    doubtful takes `decode`, which also words the error (`MessageError`).
    """
    if len(data) <= limits.max_message_bytes:
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_map_len=64)
        except Exception:  # malformed: `decode` says how
            raw = None
        if type(raw) is dict:
            host = _fast_host(raw, limits)
            if host is not None:
                return host
    msg = decode(data, limits)
    if not isinstance(msg, Register):
        raise MessageError(ErrorReason.UNKNOWN_TYPE, "not a Register message")
    return msg.host


def _fast_host(raw: dict[str, Any], lim: Limits) -> HostInfo | None:
    """`_read_host` of a valid Register message's fields, or None: take `decode`."""
    if not _HOST_REQUIRED <= raw.keys() <= _HOST_KEYS:
        return None
    rid = raw.get("id", 0)
    if not (
        type(raw["v"]) is int
        and raw["v"] == PROTOCOL_VERSION
        and type(raw["t"]) is int
        and raw["t"] == MsgType.REGISTER
        and type(rid) is int
        and 0 <= rid <= MAX_REQUEST_ID
        and raw.get("lan") is None  # a host with a LAN address: rare, `decode` reads it
    ):
        return None
    return _fast_info(raw, lim, share)
