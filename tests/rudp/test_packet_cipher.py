"""The packet cipher: AES-256-GCM when both sides allow it, ChaCha20-Poly1305 otherwise.

Both are stated in the handshake (``Config.aes_gcm``, extension ``EXT_AES_GCM``) and
used both ways; an attacker who rewrites the offer makes the handshake fail instead
of choosing the cipher.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

import rudp
from rudp.config import Config
from rudp.handshake import EXT_AES_GCM, PATTERN_NN, ClientHandshake, TransportParams, answer
from rudp.noise import NoiseError
from rudp.protection import (
    AES_256_GCM,
    CHACHA20_POLY1305,
    KEY_EPOCH,
    MAX_EPOCH_SKIP,
    Opener,
    Sealer,
    epoch_key,
)
from rudp.state import State

from .harness import SERVER, Network, server_conn

KEY = bytes(range(32))
HEADER = b"\x02\x00\x00\x00\x07\x00\x00\x00\x05"
PARAMS = TransportParams(7, 1 << 20, 32, 2 << 20, 1200, 10_000, bytes(range(5, 21)), 25)


def _nonce(number: int) -> bytes:
    return bytes(4) + number.to_bytes(8, "little")


@pytest.mark.parametrize(
    ("aes_gcm", "cipher", "other"),
    [(True, AESGCM, ChaCha20Poly1305), (False, ChaCha20Poly1305, AESGCM)],
    ids=["aes-256-gcm", "chacha20-poly1305"],
)
def test_a_sealed_packet_is_the_named_aead_under_the_packet_nonce(
    aes_gcm: bool, cipher: type[AESGCM | ChaCha20Poly1305], other: type[AESGCM | ChaCha20Poly1305]
) -> None:
    sealed = Sealer(KEY, aes_gcm).seal(5, HEADER, b"payload")
    assert cipher(KEY).decrypt(_nonce(5), sealed, HEADER) == b"payload"
    with pytest.raises(InvalidTag):
        other(KEY).decrypt(_nonce(5), sealed, HEADER)
    assert Opener(KEY, aes_gcm).open(5, HEADER, sealed) == b"payload"
    # Opened with the other cipher, it fails and changes nothing.
    wrong = Opener(KEY, not aes_gcm)
    assert wrong.open(5, HEADER, sealed) is None
    assert wrong.window.largest == -1 and wrong.window.accepted == 0


def test_the_extension_round_trips_takes_no_value_and_an_earlier_client_gets_none() -> None:
    offer = dataclasses.replace(PARAMS, aes_gcm=True)
    encoded = offer.encode()
    assert encoded.endswith(bytes((EXT_AES_GCM, 0)))
    assert TransportParams.decode(encoded) == offer
    assert not TransportParams.decode(PARAMS.encode()).aes_gcm
    assert not offer.plain().aes_gcm  # a client that states no extensions
    with pytest.raises(ValueError, match="aes_gcm"):
        TransportParams.decode(encoded[:-2] + bytes((EXT_AES_GCM, 1, 0)))
    assert TransportParams.of(Config(), 1, bytes(16)).aes_gcm
    assert not TransportParams.of(Config(aes_gcm=False), 1, bytes(16)).aes_gcm


def test_an_offer_rewritten_on_the_path_fails_the_handshake() -> None:
    """Under NN the client's parameters travel in clear; turning its AES-256-GCM offer
    into an unknown extension (same length) leaves the server choosing ChaCha20-Poly1305,
    and the client then refuses the server's answer: the transcripts differ."""
    client = ClientHandshake(dataclasses.replace(PARAMS, aes_gcm=True), 3, server_key=None)
    offer = bytes((EXT_AES_GCM, 0))
    # The offer is the last extension of the parameters, which end the message (the
    # random ephemeral key before them may hold the same two bytes by chance).
    assert client.message.endswith(offer)
    tampered = client.message[: -len(offer)] + bytes((0x7F, 0))
    server_params = dataclasses.replace(PARAMS, connection_id=9, aes_gcm=True)
    reply, server_keys = answer(None, PATTERN_NN, 3, tampered, server_params, extensions=6)
    assert not server_keys.peer.aes_gcm
    with pytest.raises(NoiseError):
        client.finish(reply)


@pytest.mark.parametrize(
    ("client_aes", "server_aes"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_both_sides_use_aes_256_gcm_only_when_both_allow_it(
    client_aes: bool, server_aes: bool
) -> None:
    net = Network(seed=5)
    server = net.add(SERVER, Config(aes_gcm=server_aes), accept=True)
    client = net.add(("10.0.0.2", 5000), Config(aes_gcm=client_aes))
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    sconn = server_conn(server)
    expected = AES_256_GCM if client_aes and server_aes else CHACHA20_POLY1305
    assert conn.packet_cipher == sconn.packet_cipher == expected
    conn.send(b"up" * 700)
    sconn.send(b"down")
    net.run(1.0)
    assert server.received() == [b"up" * 700] and client.received() == [b"down"]


def test_config_takes_only_a_bool() -> None:
    with pytest.raises(ValueError, match="aes_gcm"):
        Config(aes_gcm="yes")  # type: ignore[arg-type]


async def test_the_asyncio_connection_names_its_cipher() -> None:
    async def echo(conn: rudp.Connection) -> None:
        async for msg in conn:
            conn.send(msg.data + conn.packet_cipher.encode())

    async with await rudp.serve(echo, "127.0.0.1", 0) as server:
        for aes_gcm, name in ((True, "aes-256-gcm"), (False, "chacha20-poly1305")):
            conn = await rudp.connect(*server.address, config=rudp.Config(aes_gcm=aes_gcm))
            assert conn.packet_cipher == name
            conn.send(b"which: ")
            reply = await asyncio.wait_for(conn.recv(), 5)
            assert reply.data == b"which: " + name.encode()
            await conn.close()


def test_aes_gcm_keys_change_every_epoch_and_late_packets_still_open() -> None:
    sealer, opener = Sealer(KEY, True), Opener(KEY, True)
    edge = KEY_EPOCH
    sealer.next_number = edge - 3
    packets = {}
    for _ in range(6):
        number = sealer.take_number()
        packets[number] = sealer.seal(number, HEADER, b"n%d" % number)
    # Before the edge the handshake's key; from it, the next epoch's (derived, not sent).
    assert AESGCM(KEY).decrypt(_nonce(edge - 1), packets[edge - 1], HEADER) == b"n%d" % (edge - 1)
    with pytest.raises(InvalidTag):
        AESGCM(KEY).decrypt(_nonce(edge), packets[edge], HEADER)
    following = epoch_key(KEY, 1)
    assert AESGCM(following).decrypt(_nonce(edge + 1), packets[edge + 1], HEADER)
    # In order but for one late packet of the epoch before, after the change.
    for number in (edge - 3, edge - 2, edge, edge + 1, edge - 1, edge + 2):
        assert opener.open(number, HEADER, packets[number]) == b"n%d" % number, number
    # ChaCha20-Poly1305 keeps one key (its bound is past the packet numbers).
    chacha = Sealer(KEY, False)
    assert ChaCha20Poly1305(KEY).decrypt(_nonce(edge), chacha.seal(edge, HEADER, b"x"), HEADER)


def test_forged_numbers_of_later_epochs_cost_one_derivation_and_change_nothing() -> None:
    opener = Opener(KEY, True)
    forged = AESGCM(bytes(32)).encrypt(_nonce(5 * KEY_EPOCH), b"forged", HEADER)
    far = (MAX_EPOCH_SKIP + 1) * KEY_EPOCH
    assert opener.open(far, HEADER, forged) is None  # beyond any skip: nothing derived
    assert opener._ahead is None and opener._epoch == 0
    for _ in range(3):  # derived once, kept: a forgery never enters an epoch
        assert opener.open(5 * KEY_EPOCH, HEADER, forged) is None
        assert opener._ahead_epoch == 5 and opener._epoch == 0
    assert opener.window.largest == -1
    genuine = AESGCM(epoch_key(KEY, 5)).encrypt(_nonce(5 * KEY_EPOCH + 7), b"real", HEADER)
    assert opener.open(5 * KEY_EPOCH + 7, HEADER, genuine) == b"real"
    assert opener._epoch == 5 and opener._ahead is None
    late = AESGCM(epoch_key(KEY, 4)).encrypt(_nonce(5 * KEY_EPOCH - 1), b"late", HEADER)
    assert opener.open(5 * KEY_EPOCH - 1, HEADER, late) == b"late"  # the epoch before
    # A sender far along derives its epoch's key at once (no chain to walk).
    sealer = Sealer(KEY, True)
    near_end = 3 << 60
    sealed = sealer.seal(near_end, HEADER, b"far")
    assert AESGCM(epoch_key(KEY, near_end >> 22)).decrypt(_nonce(near_end), sealed, HEADER)


def test_a_connection_crosses_a_key_epoch_both_ways() -> None:
    net = Network(seed=6)
    server = net.add(SERVER, Config(), accept=True)
    client = net.add(("10.0.0.2", 5000), Config())
    conn = client.endpoint.connect(SERVER, net.now)
    net.run_until(lambda: conn.state is State.CONNECTED)
    sconn = server_conn(server)
    assert conn.packet_cipher == AES_256_GCM
    for side in (conn, sconn):  # both senders a few packets short of the next epoch
        side._builder.tx_next = KEY_EPOCH - 4
    for i in range(40):
        conn.send(b"up %d" % i)
        sconn.send(b"down %d" % i)
        net.run(0.02)
    net.run(1.0)
    assert server.received() == [b"up %d" % i for i in range(40)]
    assert client.received() == [b"down %d" % i for i in range(40)]
    assert conn._reader.opener._epoch == sconn._reader.opener._epoch == 1
