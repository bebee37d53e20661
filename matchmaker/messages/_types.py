"""Message types of the matchmaker protocol: codes, reasons, limits, values, messages.

Every message is a frozen, keyword-only dataclass whose ``TYPE`` is its wire
code (``t``) and whose ``request_id`` is the ``id`` it carries or echoes.
`Message` is the union of them all, `Request` of those a client may send to
the matchmaker.  The values (`HostInfo`, `HostUpdate`, `ListFilter`,
`HostEntry`) are the fields messages share.  Encoding lives in `_writers`,
decoding and validation in `_readers`; `matchmaker.messages` re-exports all.

====  =============  ===================  ==================================
t     class          direction            answer
====  =============  ===================  ==================================
8     Register       host -> mm           Registered or Error
9     Registered     mm -> host
40    Update         host -> mm           Ok or Error
41    Unregister     host -> mm           Ok
42    Ok             mm -> host
43    Heartbeat      host -> mm           nothing, or Error not_registered
10    ListRequest    client -> mm         ListPage... or Error
11    ListPage       mm -> client
13    InfoRequest    anyone -> mm         InfoReply
12    InfoReply      mm -> anyone
44    Introduce      client -> mm         Introduction or Error
45    Introduction   mm -> client, host
46    Error          mm -> anyone
29    WrongVersion   mm -> anyone
47    ServerQuery    client -> game host  ServerInfo, WrongVersion or nothing
48    ServerInfo     game host -> client
====  =============  ===================  ==================================

The fields of each are in docs/matchmaker.md ("Protocol").
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar, TypeAlias

from matchmaker.addresses import Address

PROTOCOL_VERSION = 1
MAX_REQUEST_ID = 2**32 - 1


class MsgType(enum.IntEnum):
    """Message type codes (``t``)."""

    REGISTER = 8  # ADDSV
    REGISTERED = 9  # ADDEDSV
    LIST = 10  # GETSVLIST
    LIST_PAGE = 11  # SVADDR, batched; end=True replaces NOMOREHOSTS (15)
    INFO_REPLY = 12  # SVINFO
    INFO = 13  # GETSVINFO
    WRONG_VERSION = 29  # WRONGVERSION
    UPDATE = 40
    UNREGISTER = 41
    OK = 42
    HEARTBEAT = 43
    INTRODUCE = 44
    INTRODUCTION = 45
    ERROR = 46
    SERVER_QUERY = 47  # GETSVINFO sent to a game host (unconnected rudp query)
    SERVER_INFO = 48  # SVINFO from a game host


class ErrorReason(enum.StrEnum):
    """Why a request was refused; sent in `Error.reason`."""

    MALFORMED = "malformed"  # not a msgpack map with string keys
    TOO_LARGE = "too_large"  # message over Limits.max_message_bytes
    UNKNOWN_TYPE = "unknown_type"
    NOT_A_REQUEST = "not_a_request"  # a reply type sent to the matchmaker
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    BAD_FIELD = "bad_field"  # wrong type, size or range
    WRONG_VERSION = "wrong_version"
    RATE_LIMITED = "rate_limited"
    NOT_REGISTERED = "not_registered"
    TOO_MANY_HOSTS = "too_many_hosts"  # per-IP registration cap
    FORBIDDEN_ADDRESS = "forbidden_address"  # loopback/private/bogon source
    NOT_FOUND = "not_found"  # introduce: no such host
    UNAVAILABLE = "unavailable"  # registry unreachable and no fallback
    SHUTTING_DOWN = "shutting_down"  # this replica is stopping: register with another
    INTERNAL = "internal"


class MessageError(Exception):
    """A message could not be accepted; the service replies with `Error`."""

    def __init__(self, reason: ErrorReason, detail: str = "", *, request_id: int = 0) -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
        self.request_id = request_id


# What a peer sent, shown in an error's detail: short, and never deeper than a few
# levels (``repr`` of a value nested a thousand deep, which msgpack accepts, raised
# RecursionError past every reader, and a 4 KB one made a 24 KB log line).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = _SHOWN.maxother = 40
_SHOWN.maxlong = 40


class WrongVersionError(MessageError):
    """The peer speaks another protocol version; reply with `WrongVersion`."""

    def __init__(self, version: object, *, request_id: int = 0) -> None:
        shown = _SHOWN.repr(version)
        super().__init__(ErrorReason.WRONG_VERSION, f"version {shown}", request_id=request_id)
        self.version = version


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Size caps on every field.  Defaults are the documented ones (docs/matchmaker.md)."""

    max_message_bytes: int = 4096
    """Whole encoded message; larger ones are refused before decoding."""
    name_chars: int = 64
    """Host name, characters."""
    map_chars: int = 64
    """Map name, characters."""
    ident_chars: int = 32
    """game, version, region and each tag, characters."""
    max_tags: int = 16
    """Tags per host, and per tags_all / tags_any filter."""
    info_bytes: int = 512
    """Opaque per-host info blob."""
    max_players: int = 1024
    """Upper bound for max_players."""
    list_limit: int = 1000
    """Most hosts one list request can return."""
    detail_chars: int = 200
    """Error detail text."""

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- values


def str_tuple(value: Iterable[str], field: str) -> tuple[str, ...]:
    """``value`` as a tuple of strings.

    A lone ``str`` is refused with a TypeError: ``tuple("ctf")`` would silently
    make the tags ``('c', 't', 'f')``.
    """
    if isinstance(value, str | bytes):
        raise TypeError(
            f"{field} must be a sequence of strings, not {type(value).__name__} (write [{value!r}])"
        )
    return tuple(value)


def _normalize_tags(obj: object, *fields: str) -> None:
    """Turn the sequence fields of a frozen value into tuples (a str is a TypeError).

    The decoder builds tuples already, so its hot path costs one type check per field.
    """
    for field in fields:
        value = getattr(obj, field)
        if value is not None and type(value) is not tuple:
            object.__setattr__(obj, field, str_tuple(value, field))


@dataclass(frozen=True, slots=True, kw_only=True)
class HostInfo:
    """What a game host tells the matchmaker about itself."""

    name: str
    game: str
    version: str
    max_players: int
    map: str = ""
    players: int = 0
    password: bool = False
    tags: tuple[str, ...] = ()
    region: str = ""
    info: bytes = b""
    lan: Address | None = None
    """The host's own LAN address; only ever shared with a client behind the same NAT."""
    key: bytes = b""
    """The host's static public key (``server.public_key``, 32 bytes), or empty: what
    clients authenticate it with (Noise NK), and what connect tokens name. Not
    updatable: a host with a new key registers anew."""

    def __post_init__(self) -> None:
        _normalize_tags(self, "tags")


UPDATABLE = ("name", "map", "players", "max_players", "password", "tags", "region", "info")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostUpdate:
    """A partial HostInfo; None means unchanged.  game and version need a re-register."""

    name: str | None = None
    map: str | None = None
    players: int | None = None
    max_players: int | None = None
    password: bool | None = None
    tags: tuple[str, ...] | None = None
    region: str | None = None
    info: bytes | None = None

    def __post_init__(self) -> None:
        _normalize_tags(self, "tags")

    def apply(self, current: HostInfo) -> HostInfo:
        """The merged HostInfo; raises MessageError if players would exceed max_players."""
        changes = {k: v for k in UPDATABLE if (v := getattr(self, k)) is not None}
        merged = replace(current, **changes)
        if merged.players > merged.max_players:
            raise MessageError(ErrorReason.BAD_FIELD, "players > max_players")
        return merged


@dataclass(frozen=True, slots=True, kw_only=True)
class ListFilter:
    """Server-list query; the same fields serve the wire and ``GET /servers``."""

    game: str
    version: str | None = None
    map: str | None = None
    region: str | None = None
    not_full: bool = False
    not_empty: bool = False
    password: bool | None = None
    """True: only passworded hosts; False: only open ones; None: both."""
    tags_all: tuple[str, ...] = ()
    tags_any: tuple[str, ...] = ()
    name: str | None = None
    """Case-insensitive substring of the host name."""
    family: int | None = None
    """4 or 6."""
    limit: int = DEFAULT_LIMITS.list_limit

    def __post_init__(self) -> None:
        _normalize_tags(self, "tags_all", "tags_any")


@dataclass(frozen=True, slots=True, kw_only=True)
class HostEntry:
    """One host in a list page: public address and public info, never the LAN address."""

    address: Address
    info: HostInfo


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True, kw_only=True)
class Register:
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    request_id: int = 0
    host: HostInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    TYPE: ClassVar[MsgType] = MsgType.REGISTERED
    request_id: int = 0
    address: Address
    """The host's public address as the matchmaker observed it."""
    keepalive: float
    """Seconds between the Heartbeats the host must send to stay listed."""
    secret: bytes = b""
    """Key of the host's heartbeat datagrams (`matchmaker.heartbeat`); empty from
    a matchmaker that only takes heartbeats over the connection."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Update:
    TYPE: ClassVar[MsgType] = MsgType.UPDATE
    request_id: int = 0
    changes: HostUpdate


@dataclass(frozen=True, slots=True, kw_only=True)
class Unregister:
    TYPE: ClassVar[MsgType] = MsgType.UNREGISTER
    request_id: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Ok:
    """Success reply to Update and Unregister."""

    TYPE: ClassVar[MsgType] = MsgType.OK
    request_id: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Keeps a registration alive; no reply unless the host is not registered."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    request_id: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ListRequest:
    TYPE: ClassVar[MsgType] = MsgType.LIST
    request_id: int = 0
    filter: ListFilter


@dataclass(frozen=True, slots=True, kw_only=True)
class ListPage:
    TYPE: ClassVar[MsgType] = MsgType.LIST_PAGE
    request_id: int = 0
    seq: int
    """0, 1, 2... so the client can order pages that arrive out of order."""
    total: int
    """Number of hosts in the whole answer (sum over pages)."""
    end: bool
    """Last page (the article's NOMOREHOSTS)."""
    hosts: tuple[HostEntry, ...]
    partial: bool = False
    """The matchmaker stopped looking before it had found ``limit`` hosts or every
    match (each request examines a bounded number of hosts): more may match.  Sent
    (``true``, on every page of the answer) only then."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoRequest:
    TYPE: ClassVar[MsgType] = MsgType.INFO
    request_id: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class InfoReply:
    TYPE: ClassVar[MsgType] = MsgType.INFO_REPLY
    request_id: int = 0
    software: str
    hosts: int
    keepalive: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerQuery:
    """GETSVINFO to a game host, as an unconnected rudp query (a server-browser ping)."""

    TYPE: ClassVar[MsgType] = MsgType.SERVER_QUERY
    request_id: int = 0
    room: int
    """Bytes the querier padded its request for: the largest reply it can get."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerInfo:
    """SVINFO: a game host's answer to `ServerQuery`, its public info (never `lan`)."""

    TYPE: ClassVar[MsgType] = MsgType.SERVER_INFO
    request_id: int = 0
    host: HostInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Introduce:
    """A client asks to be introduced to the host at `host` (its public address)."""

    TYPE: ClassVar[MsgType] = MsgType.INTRODUCE
    request_id: int = 0
    host: Address
    lan: Address | None = None
    """The client's own LAN address, shared only if it is behind the host's NAT."""
    client_key: bytes | None = None
    """The public half of the key the client will handshake with (32 bytes): asks for
    a connect token bound to it."""
    user_data: bytes = b""
    """Up to 256 bytes for the token's user data (what the client says it is)."""


class Role(enum.StrEnum):
    HOST = "host"
    CLIENT = "client"


@dataclass(frozen=True, slots=True, kw_only=True)
class Introduction:
    """Sent to both sides of an introduction: punch towards `peer` (and `peer_lan`)."""

    TYPE: ClassVar[MsgType] = MsgType.INTRODUCTION
    request_id: int = 0
    role: Role
    """The recipient's role."""
    peer: Address
    peer_lan: Address | None = None
    nonce: bytes
    """16 random bytes, the same on both sides, to match the punch packets."""
    peer_key: bytes | None = None
    """To the client: the host's registered static public key, if it gave one."""
    token: bytes | None = None
    """To the client: a connect token for this host, when it asked with ``client_key``
    and the matchmaker has an issuing key (``rudp.tokens``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    request_id: int = 0
    reason: ErrorReason
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class WrongVersion:
    TYPE: ClassVar[MsgType] = MsgType.WRONG_VERSION
    request_id: int = 0
    supported: tuple[int, ...] = (PROTOCOL_VERSION,)


Message: TypeAlias = (
    Register
    | Registered
    | Update
    | Unregister
    | Ok
    | Heartbeat
    | ListRequest
    | ListPage
    | InfoRequest
    | InfoReply
    | Introduce
    | Introduction
    | Error
    | WrongVersion
    | ServerQuery
    | ServerInfo
)
Request: TypeAlias = (
    Register | Update | Unregister | Heartbeat | ListRequest | InfoRequest | Introduce
)
REQUEST_TYPES: tuple[type, ...] = (
    Register,
    Update,
    Unregister,
    Heartbeat,
    ListRequest,
    InfoRequest,
    Introduce,
)

NONCE_BYTES = 16
SECRET_BYTES = 32
"""Size of `Registered.secret`."""

# Optional host fields and their defaults; a list entry on the wire leaves out
# those at their default (the decoder fills them in), ~10% more hosts a page.
ENTRY_DEFAULTS: tuple[tuple[str, object], ...] = (
    ("map", ""),
    ("players", 0),
    ("password", False),
    ("tags", []),
    ("region", ""),
    ("info", b""),
    ("key", b""),
)
