"""LAN game discovery: the article's LANCALL / LANANSWER, over plain UDP.

Theory of operation
-------------------
A host that wants to be found runs a *responder* (:func:`serve_discovery`)
next to its game server; a client (:func:`discover`) sends one *call* to every
network it is attached to (IPv4 broadcast, the IPv6 link-local group
:data:`DEFAULT_IPV6_GROUP`, and any unicast ``targets``) and collects the
*answers*, each carrying the host's info. Calls are re-sent with a fresh nonce
each time; the nonce ties an answer to the send it answers, so stray answers
are ignored and the round-trip time is right. A call is padded and an answer
is never larger than its call, so a spoofed call buys an attacker nothing.
Malformed datagrams are counted and dropped; nothing raises out of the loop.

Layout, as :mod:`rudp.lockstep`:

* :mod:`rudp.lan.messages`: the wire format (header, CALL and ANSWER bodies)
  and its defaults; pure functions.
* :mod:`rudp.lan.responder`: which calls get answered, and with what (sans-IO).
* :mod:`rudp.lan.search`: when to send calls and what an answer means, given
  ``now`` (sans-IO).
* :mod:`rudp.lan.interfaces`: interface enumeration (Linux ioctls).
* :mod:`rudp.lan.aio`: the asyncio sockets, :func:`serve_discovery` and
  :func:`discover`.

Logging goes to the ``rudp.lan`` logger (``rudp.lan.aio`` for the sockets),
debug level only, except one info line when a responder cannot use IPv6 and
an error with the traceback when the info callable fails. See docs/lan.md.
"""

from __future__ import annotations

from rudp.lan.aio import DiscoveryResponder, discover, serve_discovery
from rudp.lan.interfaces import Interface, list_interfaces
from rudp.lan.messages import (
    DEFAULT_DISCOVERY_PORT,
    DEFAULT_IPV6_GROUP,
    DEFAULT_REQUEST_SIZE,
    HEADER,
    MAGIC,
    VERSION,
    Kind,
    MalformedDatagram,
    Packet,
    decode_packet,
    encode_packet,
)
from rudp.lan.responder import DiscoveryStats, InfoSource, Responder
from rudp.lan.search import DiscoveredHost, Search, SearchStats

__all__ = [
    "DEFAULT_DISCOVERY_PORT",
    "DEFAULT_IPV6_GROUP",
    "DEFAULT_REQUEST_SIZE",
    "HEADER",
    "MAGIC",
    "VERSION",
    "DiscoveredHost",
    "DiscoveryResponder",
    "DiscoveryStats",
    "InfoSource",
    "Interface",
    "Kind",
    "MalformedDatagram",
    "Packet",
    "Responder",
    "Search",
    "SearchStats",
    "decode_packet",
    "discover",
    "encode_packet",
    "list_interfaces",
    "serve_discovery",
]
