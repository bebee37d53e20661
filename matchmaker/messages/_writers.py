"""Encoding: messages to msgpack bytes.

`encode` writes the envelope (``v``, ``t``, and ``id`` unless it is 0) and the
message's fields.  Optional fields at their default are left out where the
decoder fills them in (list entries, filters, updates), so the common message
stays small.  `encode_entry` and `encode_page` let the daemon encode each host
once and splice the bytes into every list page, byte for byte what `encode`
would write.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack

from matchmaker.addresses import Address
from matchmaker.messages._types import (
    ENTRY_DEFAULTS,
    PROTOCOL_VERSION,
    UPDATABLE,
    Error,
    HostEntry,
    HostInfo,
    HostUpdate,
    InfoReply,
    Introduce,
    Introduction,
    ListFilter,
    ListPage,
    ListRequest,
    Message,
    MsgType,
    Register,
    Registered,
    ServerInfo,
    ServerQuery,
    Update,
    WrongVersion,
)

__all__ = ["encode", "encode_entry", "encode_page", "entry_fields", "wire_entry_fields"]


def _addr(a: Address) -> list[object]:
    return [a.ip, a.port]


def _host_fields(h: HostInfo, *, with_lan: bool) -> dict[str, object]:
    out: dict[str, object] = {
        "name": h.name,
        "game": h.game,
        "version": h.version,
        "map": h.map,
        "players": h.players,
        "max_players": h.max_players,
        "password": h.password,
        "tags": list(h.tags),
        "region": h.region,
        "info": h.info,
        "key": h.key,
    }
    if with_lan and h.lan is not None:
        out["lan"] = _addr(h.lan)
    return out


def _update_fields(u: HostUpdate) -> dict[str, object]:
    out: dict[str, object] = {}
    for k in UPDATABLE:
        v = getattr(u, k)
        if v is not None:
            out[k] = list(v) if k == "tags" else v
    return out


def _filter_fields(f: ListFilter) -> dict[str, object]:
    out: dict[str, object] = {"game": f.game, "limit": f.limit}
    for k in ("version", "map", "region", "password", "name", "family"):
        v = getattr(f, k)
        if v is not None:
            out[k] = v
    for k in ("not_full", "not_empty"):
        if getattr(f, k):
            out[k] = True
    for k in ("tags_all", "tags_any"):
        if getattr(f, k):
            out[k] = list(getattr(f, k))
    return out


def entry_fields(e: HostEntry) -> dict[str, object]:
    """JSON form of a list entry: every field."""
    return {"addr": _addr(e.address), **_host_fields(e.info, with_lan=False)}


def wire_entry_fields(e: HostEntry) -> dict[str, object]:
    """Wire form of a list entry: `entry_fields` without the optional fields at default."""
    out = entry_fields(e)
    for key, default in ENTRY_DEFAULTS:
        if out[key] == default and type(out[key]) is type(default):
            del out[key]
    return out


def encode_entry(e: HostEntry) -> bytes:
    """The msgpack bytes of one list entry, as `encode_page` takes them."""
    packed: bytes = msgpack.packb(wire_entry_fields(e), use_bin_type=True)
    return packed


def encode_page(
    *,
    request_id: int = 0,
    seq: int,
    total: int,
    end: bool,
    entries: Sequence[bytes],
    partial: bool = False,
) -> bytes:
    """``encode(ListPage(...))`` from already encoded entries (`encode_entry`), byte
    for byte: the daemon encodes each host once, not once per list request."""
    head: dict[str, object] = {"v": PROTOCOL_VERSION, "t": int(MsgType.LIST_PAGE)}
    if request_id:
        head["id"] = request_id
    head |= {"seq": seq, "total": total, "end": end}
    if partial:
        head["partial"] = True
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(len(head) + 1)]
    for key, value in head.items():
        parts += (packer.pack(key), packer.pack(value))
    parts += (packer.pack("hosts"), packer.pack_array_header(len(entries)), *entries)
    return b"".join(parts)


def _fields(msg: Message) -> dict[str, object]:
    match msg:
        case Register():
            return _host_fields(msg.host, with_lan=True)
        case Registered():
            fields: dict[str, object] = {"addr": _addr(msg.address), "keepalive": msg.keepalive}
            return {**fields, "secret": msg.secret} if msg.secret else fields
        case Update():
            return _update_fields(msg.changes)
        case ListRequest():
            return _filter_fields(msg.filter)
        case ListPage():
            hosts = [wire_entry_fields(e) for e in msg.hosts]
            page: dict[str, object] = {"seq": msg.seq, "total": msg.total, "end": msg.end}
            if msg.partial:
                page["partial"] = True
            return page | {"hosts": hosts}
        case InfoReply():
            return {"software": msg.software, "hosts": msg.hosts, "keepalive": msg.keepalive}
        case Introduce():
            out: dict[str, object] = {"host": _addr(msg.host)}
            if msg.lan is not None:
                out["lan"] = _addr(msg.lan)
            if msg.client_key is not None:
                out["client_key"] = msg.client_key
            if msg.user_data:
                out["user_data"] = msg.user_data
            return out
        case Introduction():
            out = {"role": msg.role.value, "peer": _addr(msg.peer), "nonce": msg.nonce}
            if msg.peer_lan is not None:
                out["peer_lan"] = _addr(msg.peer_lan)
            if msg.peer_key is not None:
                out["peer_key"] = msg.peer_key
            if msg.token is not None:
                out["token"] = msg.token
            return out
        case Error():
            return {"reason": msg.reason.value, "detail": msg.detail}
        case WrongVersion():
            return {"supported": list(msg.supported)}
        case ServerQuery():
            return {"room": msg.room}
        case ServerInfo():
            return _host_fields(msg.host, with_lan=False)
        case _:
            return {}


def encode(msg: Message) -> bytes:
    """The msgpack bytes of `msg`."""
    envelope: dict[str, object] = {"v": PROTOCOL_VERSION, "t": int(msg.TYPE)}
    if msg.request_id:
        envelope["id"] = msg.request_id
    packed: bytes = msgpack.packb(envelope | _fields(msg), use_bin_type=True)
    return packed
