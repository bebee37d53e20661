"""The matchmaker's wire schema: msgpack maps over rudp reliable messages.

Theory of operation
-------------------
Every message is one msgpack map carried in one rudp reliable message::

    {"v": PROTOCOL_VERSION, "t": <MsgType>, "id": <request id>, ...fields}

``v`` is checked first: a peer speaking another protocol version gets a
`WrongVersion` reply (the seed article's PACKET_WRONGVERSION) before anything
else is looked at, so future versions may change every other field.  ``id``
(0..2**32-1, default 0) is chosen by the requester and echoed in the reply,
which lets a client keep several requests in flight.

Type codes reuse the article's packet numbers where there is a counterpart
(ADDSV=8, ADDEDSV=9, GETSVLIST=10, SVADDR=11, SVINFO=12, GETSVINFO=13,
WRONGVERSION=29).  The article sends one host per SVADDR and a final
NOMOREHOSTS; here a `ListPage` carries many hosts, the total match count, and
``end=True`` on the last page stands in for NOMOREHOSTS.

Decoding is strict and total: `decode` either returns a fully validated,
frozen message or raises `MessageError` carrying an `ErrorReason` code (and
the request id, when it could be read) that the service turns into an
`Error` reply.  Nothing else escapes, whatever the bytes (this is
fuzz-tested).  Unknown fields are rejected rather than ignored, because the
version check is how the schema evolves.  Every string, byte string, list
and number has a cap from `Limits`; msgpack itself is given the same caps so a
hostile length prefix cannot make the decoder allocate much.

Layout
------
`_types` holds the codes, limits and message dataclasses, `_writers` the
encoding and `_readers` the decoding and validation (the h11 split: events,
writers, readers); this package re-exports every public name, so callers
import from ``matchmaker.messages`` only.
"""

from __future__ import annotations

from matchmaker.messages._readers import (
    decode,
    decode_host,
    decode_request,
    filter_from_mapping,
    read_filter,
)
from matchmaker.messages._types import (
    DEFAULT_LIMITS,
    MAX_REQUEST_ID,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    REQUEST_TYPES,
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
    str_tuple,
)
from matchmaker.messages._writers import (
    encode,
    encode_entry,
    encode_page,
    entry_fields,
    wire_entry_fields,
)

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_REQUEST_ID",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "REQUEST_TYPES",
    "Error",
    "ErrorReason",
    "Heartbeat",
    "HostEntry",
    "HostInfo",
    "HostUpdate",
    "InfoReply",
    "InfoRequest",
    "Introduce",
    "Introduction",
    "Limits",
    "ListFilter",
    "ListPage",
    "ListRequest",
    "Message",
    "MessageError",
    "MsgType",
    "Ok",
    "Register",
    "Registered",
    "Request",
    "Role",
    "ServerInfo",
    "ServerQuery",
    "Unregister",
    "Update",
    "WrongVersion",
    "WrongVersionError",
    "decode",
    "decode_host",
    "decode_request",
    "encode",
    "encode_entry",
    "encode_page",
    "entry_fields",
    "filter_from_mapping",
    "read_filter",
    "str_tuple",
    "wire_entry_fields",
]
