"""Connect tokens over loopback, through the asyncio layer: ``serve`` requires them,
``connect`` presents one, the handler reads ``conn.peer_identity``, and a client
without one gets ``ConnectRefused`` saying so."""

from __future__ import annotations

import asyncio
import time

import pytest

import rudp
from rudp.tokens import REFUSAL_TEXT, Issuer, TokenRefusal, generate_issuer_key

ISSUER = Issuer(generate_issuer_key())
SERVER_KEY = rudp.generate_key()


async def test_token_admits_the_client_and_a_plain_connect_is_refused() -> None:
    identities: asyncio.Queue[rudp.tokens.PeerIdentity | None] = asyncio.Queue()

    async def handler(conn: rudp.Connection) -> None:
        await identities.put(conn.peer_identity)
        await conn.recv()  # until the client closes

    config = rudp.Config(static_key=SERVER_KEY, token_issuers=(ISSUER.public_key,))
    async with await rudp.serve(handler, "127.0.0.1", 0, config=config) as server:
        host, port = server.address[:2]
        with pytest.raises(rudp.ConnectRefused, match="requires a connect token") as refused:
            await rudp.connect(host, port, server_key=server.public_key)
        assert str(refused.value).endswith(REFUSAL_TEXT[TokenRefusal.MISSING])

        key = rudp.generate_key()
        token = ISSUER.issue(
            client_key=rudp.public_key(key),
            host_key=rudp.public_key(SERVER_KEY),
            addresses=[(host, port)],
            client_id=99,
            now=time.time(),
            user_data=b"team=blue",
        )
        conn = await rudp.connect(
            host, port, server_key=server.public_key, token=token, token_key=key
        )
        identity = await asyncio.wait_for(identities.get(), 5)
        assert identity is not None and identity.user_data == b"team=blue"
        assert identity.client_id == 99 and conn.server_authenticated

        # The same token again: spent.
        with pytest.raises(rudp.ConnectRefused, match="already used"):
            await rudp.connect(host, port, server_key=server.public_key, token=token, token_key=key)
        await conn.close()
        stats = server.stats
        assert stats.tokens_accepted == 1
        assert stats.tokens_refused == {TokenRefusal.MISSING: 1, TokenRefusal.REPLAYED: 1}
