"""Trust through the matchmaker: issuing keys, tokens in introductions, host keys in
the list, and what a client checks before it joins."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from dataclasses import replace
from pathlib import Path

import pytest

import rudp
from matchmaker.__main__ import main
from matchmaker.addresses import Address
from matchmaker.client import MatchmakerClient
from matchmaker.keys import key_file_text, parse_key, read_key_file, read_public_key
from matchmaker.messages import Introduce, Introduction, ListPage, Register, Registered, Role
from matchmaker.server import Matchmaker, build_issuer
from matchmaker.settings import Settings, SettingsError
from matchmaker.tickets import Ticket, UntrustedIntroduction, check_introduction
from rudp.tokens import (
    Issuer,
    TokenVerifier,
    decode_token,
    generate_issuer_key,
    issuer_public_key,
)
from tests.matchmaker.fakes import Wire
from tests.matchmaker.helpers import WALL_CLOCK, Harness, collect_list, info, pub, settings

HOST_PRIVATE = rudp.generate_key()
HOST_KEY = rudp.public_key(HOST_PRIVATE)
HOST_ADDRESS = Address(pub(1), 27960)


async def _introduce(h: Harness, user_data: bytes = b"") -> tuple[Introduction, bytes]:
    client = h.connect(pub(2), 5555)
    handshake = rudp.generate_key()
    reply = await client.request(
        Introduce(
            request_id=3,
            host=HOST_ADDRESS,
            client_key=rudp.public_key(handshake),
            user_data=user_data,
        )
    )
    assert isinstance(reply, Introduction), reply
    return reply, handshake


# ------------------------------------------------------------------ issuing


async def test_every_introduction_carries_a_token_for_that_client_and_host() -> None:
    issuer = Issuer(generate_issuer_key())
    h = Harness(issuer=issuer)
    host = await h.host(pub(1), key=HOST_KEY)
    reply, handshake = await _introduce(h, b"team=red")
    assert reply.peer_key == HOST_KEY and reply.token is not None
    token = decode_token(reply.token)
    assert token.addresses == ((pub(1), 27960),)
    assert token.expires == WALL_CLOCK + h.settings.token_lifetime
    # The host admits exactly this client with it.
    verifier = TokenVerifier([issuer.public_key], HOST_KEY)
    identity = verifier.verify(reply.token, rudp.public_key(handshake), WALL_CLOCK + 1)
    assert identity.user_data == b"team=red" and identity.client_id == token.client_id
    # The host's own introduction carries neither a token nor a key.
    to_host = await host.recv()
    assert isinstance(to_host, Introduction) and to_host.role is Role.HOST
    assert to_host.token is None and to_host.peer_key is None


async def test_no_token_without_a_client_key_a_host_key_or_an_issuer() -> None:
    issuer = Issuer(generate_issuer_key())
    h = Harness(issuer=issuer)
    await h.host(pub(1), key=HOST_KEY)
    plain = await h.connect(pub(2), 5555).request(Introduce(request_id=1, host=HOST_ADDRESS))
    assert isinstance(plain, Introduction) and plain.token is None
    assert plain.peer_key == HOST_KEY
    keyless = Harness(issuer=issuer)
    await keyless.host(pub(1))
    reply, _ = await _introduce(keyless)
    assert reply.token is None and reply.peer_key is None
    no_issuer = Harness()
    await no_issuer.host(pub(1), key=HOST_KEY)
    reply, _ = await _introduce(no_issuer)
    assert reply.token is None and reply.peer_key == HOST_KEY


async def test_lists_carry_the_host_key() -> None:
    h = Harness()
    await h.host(pub(1), key=HOST_KEY)
    await h.host(pub(3))
    pages = await collect_list(h.connect(pub(9), 1))
    keys = {e.address.ip: e.info.key for p in pages for e in p.hosts}
    assert keys == {pub(1): HOST_KEY, pub(3): b""}
    assert isinstance(pages[0], ListPage)


async def test_a_new_host_key_is_a_new_registration() -> None:
    h = Harness()
    wire = h.connect(pub(1))
    for key, result in ((HOST_KEY, "created"), (HOST_KEY, "replaced"), (b"n" * 32, "created")):
        before = h.sample("matchmaker_registrations_total", result=result)
        reply = await wire.request(Register(request_id=1, host=info(key=key)))
        assert isinstance(reply, Registered)
        assert h.sample("matchmaker_registrations_total", result=result) == before + 1
    record = h.registry.get(HOST_ADDRESS)
    assert record is not None and record.info.key == b"n" * 32


# ------------------------------------------------------------------ the client's checks


async def test_the_client_believes_only_what_the_pinned_key_signed() -> None:
    issuer = Issuer(generate_issuer_key())
    h = Harness(issuer=issuer)
    await h.host(pub(1), key=HOST_KEY)
    reply, handshake = await _introduce(h)
    ticket = check_introduction(reply, [issuer.public_key], handshake)
    assert ticket.host_key == HOST_KEY and ticket.address == HOST_ADDRESS
    # Another matchmaker's token (or a man in the middle's).
    with pytest.raises(UntrustedIntroduction, match="pinned issuer key"):
        check_introduction(reply, [issuer_public_key(generate_issuer_key())], handshake)
    # A key swapped in the unsigned field.
    with pytest.raises(UntrustedIntroduction, match="host key"):
        check_introduction(replace(reply, peer_key=b"x" * 32), [issuer.public_key], handshake)
    # Sent elsewhere than the token names.
    moved = replace(reply, peer=Address(pub(7), 27960))
    with pytest.raises(UntrustedIntroduction, match="does not name"):
        check_introduction(moved, [issuer.public_key], handshake)
    # Someone else's token.
    with pytest.raises(UntrustedIntroduction, match="another client key"):
        check_introduction(reply, [issuer.public_key], rudp.generate_key())
    with pytest.raises(UntrustedIntroduction, match="no connect token"):
        check_introduction(replace(reply, token=None), [issuer.public_key], handshake)


def _ticket(issuer: Issuer, peer_lan: Address | None) -> Ticket:
    """A genuine ticket for the host at HOST_ADDRESS, whose LAN address is `peer_lan`
    (the token names both)."""
    handshake = rudp.generate_key()
    addresses = [(HOST_ADDRESS.ip, HOST_ADDRESS.port)]
    if peer_lan is not None:
        addresses.append((peer_lan.ip, peer_lan.port))
    token = issuer.issue(
        client_key=rudp.public_key(handshake),
        host_key=HOST_KEY,
        addresses=addresses,
        client_id=1,
        now=WALL_CLOCK,
    )
    intro = Introduction(
        role=Role.CLIENT,
        peer=HOST_ADDRESS,
        peer_lan=peer_lan,
        nonce=b"n" * 16,
        peer_key=HOST_KEY,
        token=token,
    )
    return check_introduction(intro, [issuer.public_key], handshake)


@pytest.mark.parametrize(
    "lan",
    [
        Address("198.51.200.7", 27960),  # a third party on the Internet
        Address("127.0.0.99", 27960),  # the client's own machine, not the host's
        Address("224.0.0.1", 27960),
    ],
)
def test_the_client_never_connects_to_a_lan_address_that_is_not_private(lan: Address) -> None:
    ticket = _ticket(Issuer(generate_issuer_key()), lan)
    assert ticket.address == HOST_ADDRESS and ticket.addresses == (HOST_ADDRESS,)


def test_the_client_tries_a_private_lan_address_first() -> None:
    lan = Address("192.168.1.5", 27960)
    ticket = _ticket(Issuer(generate_issuer_key()), lan)
    assert ticket.address == lan and ticket.addresses == (lan, HOST_ADDRESS)


class _Endpoint:
    """Where `Ticket.connect` connects: records each attempt; `answers` says what
    each address does (an exception to raise, None: never answers, else returned)."""

    def __init__(self, answers: dict[Address, object]) -> None:
        self.answers = answers
        self.tried: list[Address] = []

    async def connect(self, ip: str, port: int, **_: object) -> object:
        self.tried.append(Address(ip, port))
        answer = self.answers[Address(ip, port)]
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            await asyncio.Event().wait()
        return answer


LAN = Address("192.168.1.5", 27960)


@pytest.mark.parametrize(
    "lan_answer",
    [
        rudp.ConnectTimeout(address=(LAN.ip, LAN.port), timeout=5.0),
        rudp.ConnectRefused("another server key"),  # someone else at that LAN address
        None,  # nothing there: given up after lan_timeout
        # An IPv6 LAN address from an IPv4 socket: refused by the socket at once.
        socket.gaierror(socket.EAI_ADDRFAMILY, "Address family for hostname not supported"),
    ],
)
async def test_a_join_falls_back_to_the_public_address(lan_answer: object) -> None:
    ticket = _ticket(Issuer(generate_issuer_key()), LAN)
    joined = object()
    endpoint = _Endpoint({LAN: lan_answer, HOST_ADDRESS: joined})
    conn = await ticket.connect(endpoint, lan_timeout=0.01)  # type: ignore[arg-type]
    assert conn is joined and endpoint.tried == [LAN, HOST_ADDRESS]
    # The public address's failure is the one raised.
    endpoint = _Endpoint({LAN: lan_answer, HOST_ADDRESS: rudp.ConnectRefused("server full")})
    with pytest.raises(rudp.ConnectRefused, match="server full"):
        await ticket.connect(endpoint, lan_timeout=0.01)  # type: ignore[arg-type]
    # A LAN address that answers is the one joined.
    endpoint = _Endpoint({LAN: joined, HOST_ADDRESS: AssertionError("not reached")})
    assert await ticket.connect(endpoint) is joined  # type: ignore[arg-type]
    assert endpoint.tried == [LAN]


async def test_ticket_needs_a_pinned_key() -> None:
    async def never() -> Wire:
        raise AssertionError("not reached")

    client = MatchmakerClient(never)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="issuer_keys"):
        await client.ticket(HOST_ADDRESS)


# ------------------------------------------------------------------ over loopback


async def _listed_host(
    mm: Matchmaker, listed_key: bytes, serving_key: bytes
) -> tuple[rudp.Server, MatchmakerClient, asyncio.Queue[rudp.Connection]]:
    """A game host serving with ``serving_key`` and registered with ``listed_key``."""
    assert mm.issuer is not None
    accepted: asyncio.Queue[rudp.Connection] = asyncio.Queue()

    async def handler(conn: rudp.Connection) -> None:
        await accepted.put(conn)
        await conn.wait_closed()

    config = rudp.Config(static_key=serving_key, token_issuers=(mm.issuer.public_key,))
    game = await rudp.serve(handler, "127.0.0.1", 0, config=config)
    host = MatchmakerClient.to("127.0.0.1", mm.udp_address[1], via=game)
    await host.register(name="h", game="q3", version="1", max_players=4, key=listed_key)
    return game, host, accepted


async def test_a_pinned_client_joins_the_listed_host_and_refuses_an_impostor() -> None:
    mm = Matchmaker(settings(ephemeral_issuer_key=True))
    await mm.start()
    assert mm.issuer is not None
    endpoint = await rudp.open_endpoint("127.0.0.1", 0)
    client = MatchmakerClient.to(
        "127.0.0.1", mm.udp_address[1], via=endpoint, issuer_keys=[mm.issuer.public_key]
    )
    genuine_key, impostor_key = rudp.generate_key(), rudp.generate_key()
    genuine = await _listed_host(mm, rudp.public_key(genuine_key), genuine_key)
    # Listed with the genuine key, but whoever answers at its address holds another one.
    impostor = await _listed_host(mm, rudp.public_key(genuine_key), impostor_key)
    try:
        listed = await client.list_servers(game="q3")
        (entry,) = [e for e in listed if e.address.port == genuine[0].address[1]]
        assert entry.info.key == rudp.public_key(genuine_key)  # the list carries it
        ticket = await client.ticket(entry.address, user_data=b"ada")
        conn = await ticket.connect(endpoint)
        assert conn.server_authenticated and ticket.host_key == genuine[0].public_key
        joined = await asyncio.wait_for(genuine[2].get(), 5)
        assert joined.peer_identity is not None and joined.peer_identity.user_data == b"ada"

        ticket = await client.ticket(impostor[0].address[:2])
        with pytest.raises(rudp.ConnectRefused, match="another server key"):
            await ticket.connect(endpoint)
        assert impostor[2].empty()
        await conn.close()
    finally:
        for game, host, _ in (genuine, impostor):
            await host.close()
            await game.close()
        await client.close()
        await endpoint.close()
        await mm.shutdown()


# ------------------------------------------------------------------ keys and settings


def test_keygen_writes_a_private_file_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "issuer.key"
    assert main(["keygen", "--out", str(path)]) == 0
    private = read_key_file(str(path))
    public = issuer_public_key(private).hex()
    assert public in capsys.readouterr().out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_public_key(f"{path}.pub") == issuer_public_key(private)
    assert main(["keygen", "--out", str(path)]) == 2  # never overwrites
    assert main(["keygen", "--out", str(path), "--if-absent"]) == 0
    assert public in capsys.readouterr().out
    assert read_key_file(str(path)) == private
    assert main(["keygen"]) == 0
    lines = capsys.readouterr().out.split()
    assert lines[0] == "private" and lines[2] == "public"


def test_issuing_key_from_file_env_or_ephemeral(tmp_path: Path) -> None:
    private = generate_issuer_key()
    path = tmp_path / "k"
    path.write_text(key_file_text(private))
    from_file = Settings.from_sources({"issuer_key_file": str(path)}, {})
    assert from_file.issuer_source == "file" and from_file.startup_fields()["issuer"] == "file"
    issuer = build_issuer(from_file)
    assert issuer is not None and issuer.public_key == issuer_public_key(private)
    from_env = Settings.from_sources({}, {"MATCHMAKER_ISSUER_KEY": private.hex()})
    assert from_env.issuer_private_key() == private and from_env.issuer_source == "env"
    ephemeral = Settings(ephemeral_issuer_key=True)
    assert ephemeral.issuer_source == "ephemeral" and build_issuer(ephemeral) is not None
    assert Settings().issuer_source == "none" and build_issuer(Settings()) is None
    # Replicas given the same file sign with the same key.
    again = build_issuer(from_file)
    assert again is not None and again.public_key == issuer.public_key


def test_bad_issuing_key_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="issuer-key-file"):
        Settings.from_sources({"issuer_key_file": str(tmp_path / "missing")}, {})
    with pytest.raises(SettingsError, match="64 hex digits"):
        Settings.from_sources({}, {"MATCHMAKER_ISSUER_KEY": "abcd"})
    with pytest.raises(SettingsError, match="cannot be combined"):
        Settings.from_sources({"ephemeral_issuer_key": True, "issuer_key": "00" * 32}, {})
    with pytest.raises(ValueError, match="one line"):
        parse_key("# only a comment\n")
    assert parse_key(f"# c\n{'01' * 32}\n") == bytes([1] * 32)
