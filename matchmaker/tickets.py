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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import rudp
from matchmaker.addresses import Address
from matchmaker.messages import Introduction
from rudp.tokens import TokenError, open_token


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
        """Where to connect: the host's LAN address when we share its NAT, else its public one."""
        return self.introduction.peer_lan or self.introduction.peer

    async def connect(self, endpoint: rudp.Server) -> rudp.Connection:
        """Connect to the host from ``endpoint`` (the socket the matchmaker saw us on)
        with Noise NK to the vouched key, presenting the token. Raises what
        ``endpoint.connect`` raises (``rudp.ConnectRefused`` naming a refused token)."""
        target = self.address
        return await endpoint.connect(
            target.ip,
            target.port,
            server_key=self.host_key,
            token=self.token,
            token_key=self.handshake_key,
        )


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
    target = intro.peer_lan or intro.peer
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
