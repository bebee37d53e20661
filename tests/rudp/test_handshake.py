"""rudp.handshake: the two-message version-2 handshake and its parameters."""

from __future__ import annotations

import dataclasses

import pytest

from rudp.handshake import (
    PARAMS_SIZE,
    PATTERN_NK,
    PATTERN_NN,
    SECOND_MESSAGE_SIZE,
    ClientHandshake,
    TransportParams,
    answer,
    first_message_size,
)
from rudp.noise import NoiseError, private_key, public_bytes

SERVER_STATIC = private_key(bytes(range(32)))
SERVER_KEY = public_bytes(SERVER_STATIC)
CLIENT_PARAMS = TransportParams(7, 1 << 20, 32, 2 << 20, 1200, 10_000, bytes(range(5, 21)))
SERVER_PARAMS = TransportParams(9, 4 << 20, 8, 1 << 20, 1400, 15_000, bytes(range(16)))


@pytest.mark.parametrize("server_key", [SERVER_KEY, None], ids=["NK", "NN"])
def test_both_sides_agree(server_key: bytes | None) -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=42, server_key=server_key)
    assert client.pattern == (PATTERN_NK if server_key else PATTERN_NN)
    assert len(client.message) == first_message_size(client.pattern)
    reply, server_keys = answer(SERVER_STATIC, client.pattern, 42, client.message, SERVER_PARAMS)
    assert len(reply) == SECOND_MESSAGE_SIZE
    client_keys = client.finish(reply)
    assert server_keys.peer == CLIENT_PARAMS
    assert client_keys.peer == SERVER_PARAMS
    assert client_keys.send_key == server_keys.recv_key != client_keys.recv_key
    assert client_keys.recv_key == server_keys.send_key
    assert client_keys.handshake_hash == server_keys.handshake_hash


def test_nk_hides_the_client_parameters_nn_does_not() -> None:
    nk = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=SERVER_KEY)
    nn = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=None)
    assert CLIENT_PARAMS.encode() not in nk.message
    assert CLIENT_PARAMS.encode() in nn.message


def test_an_impostor_without_the_key_cannot_answer_nk() -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=SERVER_KEY)
    impostor = private_key(bytes(range(1, 33)))
    with pytest.raises(NoiseError):
        answer(impostor, PATTERN_NK, 1, client.message, SERVER_PARAMS)


def test_a_forged_or_tampered_answer_fails_at_the_client() -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=None)
    # Someone who saw only the first message answers with a handshake of its own.
    eavesdropper = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=None)
    forged, _ = answer(None, PATTERN_NN, 1, eavesdropper.message, SERVER_PARAMS)
    with pytest.raises(NoiseError):
        client.finish(forged)
    for position in (0, 31, 32, SECOND_MESSAGE_SIZE - 1):
        fresh = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=None)
        reply = bytearray(answer(None, PATTERN_NN, 1, fresh.message, SERVER_PARAMS)[0])
        reply[position] ^= 1
        with pytest.raises(NoiseError):
            fresh.finish(bytes(reply))


def test_changed_client_parameters_under_nn_fail_at_the_client() -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=None)
    changed = dataclasses.replace(CLIENT_PARAMS, max_message_size=1)
    tampered = client.message.replace(CLIENT_PARAMS.encode(), changed.encode())
    reply, server_keys = answer(None, PATTERN_NN, 1, tampered, SERVER_PARAMS)
    assert server_keys.peer == changed  # the server cannot tell...
    with pytest.raises(NoiseError):
        client.finish(reply)  # ...but the client refuses the handshake that followed


@pytest.mark.parametrize("salt,pattern", [(2, PATTERN_NK), (1, PATTERN_NN)])
def test_a_message_moved_to_another_salt_or_pattern_fails(salt: int, pattern: int) -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=SERVER_KEY)
    with pytest.raises(NoiseError):
        answer(SERVER_STATIC, pattern, salt, client.message, SERVER_PARAMS)


def test_server_without_a_key_refuses_nk_and_wrong_sizes() -> None:
    client = ClientHandshake(CLIENT_PARAMS, salt=1, server_key=SERVER_KEY)
    with pytest.raises(ValueError):
        answer(None, PATTERN_NK, 1, client.message, SERVER_PARAMS)
    with pytest.raises(NoiseError):
        answer(SERVER_STATIC, PATTERN_NK, 1, client.message[:-1], SERVER_PARAMS)
    with pytest.raises(ValueError):
        answer(SERVER_STATIC, 5, 1, client.message, SERVER_PARAMS)
    with pytest.raises(NoiseError):
        client.finish(bytes(SECOND_MESSAGE_SIZE + 1))


def test_parameters_round_trip_and_refuse_nonsense() -> None:
    assert TransportParams.decode(SERVER_PARAMS.encode()) == SERVER_PARAMS
    assert len(CLIENT_PARAMS.encode()) == PARAMS_SIZE
    with pytest.raises(ValueError):
        TransportParams.decode(SERVER_PARAMS.encode()[:-1])
    for bad in (
        dataclasses.replace(CLIENT_PARAMS, channels=0),
        dataclasses.replace(CLIENT_PARAMS, max_datagram_size=100),
        dataclasses.replace(CLIENT_PARAMS, max_message_size=0),
    ):
        with pytest.raises(ValueError):
            TransportParams.decode(bad.encode())
    with pytest.raises(ValueError):
        dataclasses.replace(CLIENT_PARAMS, reset_token=b"short").encode()
    with pytest.raises(ValueError):
        dataclasses.replace(CLIENT_PARAMS, reset_token=b"").encode()


def test_extensions_round_trip_and_an_earlier_release_reads_past_them() -> None:
    extended = dataclasses.replace(SERVER_PARAMS, max_ack_delay_ms=25, channel_window=512)
    encoded = extended.encode()
    assert len(encoded) == PARAMS_SIZE + 8 and TransportParams.decode(encoded) == extended
    # Only the delay (a release before the channel window): the window is not stated.
    only_delay = dataclasses.replace(extended, channel_window=None)
    assert TransportParams.decode(only_delay.encode()).channel_window is None
    assert extended.plain() == SERVER_PARAMS
    with pytest.raises(ValueError, match="channel_window"):
        TransportParams.decode(only_delay.encode() + bytes((2, 2, 0, 0)))  # a window of 0
    with pytest.raises(ValueError, match="channel_window"):
        TransportParams.decode(only_delay.encode() + bytes((2, 1, 9)))


def test_a_bad_server_key_length_raises() -> None:
    with pytest.raises(ValueError):
        ClientHandshake(CLIENT_PARAMS, salt=1, server_key=bytes(31))
