"""A client's side of trust through the matchmaker: what it checks in an introduction.

Theory of operation
-------------------
The game ships the matchmaker's issuing public key (one, or two while keys
rotate) and the client library pins it (``MatchmakerClient(issuer_keys=...)``).
To join a host, the client draws a fresh X25519 key for the handshake and asks
for an introduction with its public half; the matchmaker answers with the host's
address, the host's registered static key and a connect token signed with the
issuing key (``rudp.tokens``). The client believes none of the introduction's
unsigned fields: it opens the token with the pinned key and takes the host key
*from the token*, and checks that the token names its own handshake key and the
address it is about to connect to. It then connects with Noise NK to that key
(``Ticket.connect``): only the host the matchmaker vouched for can answer, and
the host admits the client on the token.

Behind the same public IP as the host, the introduction also carries the host's
LAN address (``peer_lan``): `Ticket.connect` tries it first, for at most
``lan_timeout`` seconds (a LAN answers within milliseconds), then the public
address.  A ``peer_lan`` that is no private address (`addresses.lan_reason`) is
never used: the matchmaker refuses such a LAN address, and the client does not
rely on that alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import rudp
from matchmaker.addresses import Address, lan_reason
from matchmaker.messages import Introduction
from rudp.tokens import TokenError, open_token

LAN_TIMEOUT = 1.0
"""Seconds `Ticket.connect` gives the host's LAN address before its public one."""


class UntrustedIntroduction(Exception):
    """An introduction the pinned issuer key does not vouch for; the client must not join."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """Everything a client needs to join one host, checked against the pinned key."""

    introduction: Introduction
    host_key: bytes
    """The host's static public key, as the signed token names it."""
    token: bytes
    """The connect token, bound to `handshake_key` and to the host."""
    handshake_key: bytes = b""
    """The private X25519 key the client handshakes with; good for one connection."""
    client_id: int = 0
    """The id the matchmaker gave this client in the token."""
    expires: float = 0.0
    """UNIX time after which the host refuses the token."""

    @property
    def address(self) -> Address:
        """Where to connect first: the host's LAN address when we share its NAT, else
        its public one."""
        return self.addresses[0]

    @property
    def addresses(self) -> tuple[Address, ...]:
        """Where `connect` tries, in order: the host's LAN address (when we share its
        NAT, and it is a private address), then its public one."""
        return _targets(self.introduction)

    async def connect(
        self, endpoint: rudp.Server, *, lan_timeout: float = LAN_TIMEOUT
    ) -> rudp.Connection:
        """Connect to the host from ``endpoint`` (the socket the matchmaker saw us on)
        with Noise NK to the vouched key, presenting the token: to its LAN address
        first when there is one (for at most ``lan_timeout`` seconds), then to its
        public address if that failed. Raises what ``endpoint.connect`` raises for the
        last address (``rudp.ConnectRefused`` naming a refused token)."""
        *lan, public = self.addresses
        for target in lan:
            try:
                return await asyncio.wait_for(self._connect(endpoint, target), lan_timeout)
            except (rudp.ConnectError, OSError):  # OSError: TimeoutError, or a family
                # the socket lacks (an IPv6 LAN address from an IPv4 socket)
                pass  # not (or not only) on our LAN: the public address
        return await self._connect(endpoint, public)

    async def _connect(self, endpoint: rudp.Server, target: Address) -> rudp.Connection:
        return await endpoint.connect(
            target.ip,
            target.port,
            server_key=self.host_key,
            token=self.token,
            token_key=self.handshake_key,
        )


def _targets(intro: Introduction) -> tuple[Address, ...]:
    """The host's addresses to connect to, in order (`Ticket.addresses`)."""
    lan = intro.peer_lan
    if lan is None or lan == intro.peer or lan_reason(lan.ip, intro.peer.ip) is not None:
        return (intro.peer,)
    return (lan, intro.peer)


def check_introduction(
    intro: Introduction, issuer_keys: Sequence[bytes], handshake_key: bytes
) -> Ticket:
    """A `Ticket` from ``intro``; UntrustedIntroduction when the pinned keys do not
    vouch for it, or it was not issued for ``handshake_key``."""
    if intro.token is None:
        raise UntrustedIntroduction(
            "the introduction carries no connect token (the matchmaker has no issuing key, "
            "or the host registered no key)"
        )
    try:
        token = open_token(intro.token, issuer_keys)
    except TokenError as exc:
        raise UntrustedIntroduction(f"not vouched for by the pinned issuer key: {exc}") from None
    if token.client_key != rudp.public_key(handshake_key):
        raise UntrustedIntroduction("the connect token was issued for another client key")
    if intro.peer_key is not None and intro.peer_key != token.host_key:
        raise UntrustedIntroduction("the introduction's host key is not the one the token names")
    for target in _targets(intro):
        if (target.ip, target.port) not in token.addresses:
            raise UntrustedIntroduction(f"the connect token does not name {target.key}")
    return Ticket(
        introduction=intro,
        host_key=token.host_key,
        token=intro.token,
        handshake_key=handshake_key,
        client_id=token.client_id,
        expires=token.expires,
    )
