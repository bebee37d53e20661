"""rudp.noise against the published cacophony test vectors, and its refusals.

The vectors (tests/rudp/data/noise-vectors.json) fix both sides' ephemeral and static
keys, so every handshake message, the handshake hash and every transport message
must come out byte for byte. They cover NN and NK, which rudp uses, with both hashes,
and the other interactive patterns and psk modifiers the module's table has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rudp.noise import (
    CipherState,
    HandshakeState,
    NoiseError,
    parse_protocol_name,
    private_key,
    public_bytes,
)

VECTORS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "noise-vectors.json").read_text()
)["vectors"]


def _side(vector: dict[str, Any], prefix: str, *, initiator: bool) -> HandshakeState:
    def key(name: str) -> Any:
        raw = vector.get(f"{prefix}_{name}")
        return private_key(bytes.fromhex(raw)) if raw else None

    remote = vector.get(f"{prefix}_remote_static")
    return HandshakeState(
        vector["protocol_name"],
        initiator=initiator,
        prologue=bytes.fromhex(vector[f"{prefix}_prologue"]),
        static=key("static"),
        ephemeral=key("ephemeral"),
        remote_static=bytes.fromhex(remote) if remote else None,
        psks=[bytes.fromhex(p) for p in vector.get(f"{prefix}_psks", [])],
    )


@pytest.mark.parametrize("vector", VECTORS, ids=[v["protocol_name"] for v in VECTORS])
def test_published_vector(vector: dict[str, Any]) -> None:
    init = _side(vector, "init", initiator=True)
    resp = _side(vector, "resp", initiator=False)
    messages = vector["messages"]
    handshake_len = len(parse_protocol_name(vector["protocol_name"])[2])
    for i, message in enumerate(messages[:handshake_len]):
        writer, reader = (init, resp) if i % 2 == 0 else (resp, init)
        payload = bytes.fromhex(message["payload"])
        wire_bytes = writer.write_message(payload)
        assert wire_bytes.hex() == message["ciphertext"], f"handshake message {i}"
        assert reader.read_message(wire_bytes) == payload
    assert init.complete and resp.complete
    assert init.handshake_hash.hex() == vector["handshake_hash"]
    assert resp.handshake_hash == init.handshake_hash
    i_send, i_recv = (CipherState(k) for k in init.split())
    r_send, r_recv = (CipherState(k) for k in resp.split())
    # After the handshake the vectors keep alternating, the initiator first.
    for i, message in enumerate(messages[handshake_len:], start=handshake_len):
        sender, receiver = (i_send, r_recv) if i % 2 == 0 else (r_send, i_recv)
        payload = bytes.fromhex(message["payload"])
        ciphertext = sender.encrypt_with_ad(b"", payload)
        assert ciphertext.hex() == message["ciphertext"], f"transport message {i}"
        assert receiver.decrypt_with_ad(b"", ciphertext) == payload


def _nk_pair() -> tuple[HandshakeState, HandshakeState]:
    server_static = private_key(bytes(range(32)))
    init = HandshakeState(
        "Noise_NK_25519_ChaChaPoly_BLAKE2s",
        initiator=True,
        prologue=b"rudp",
        remote_static=public_bytes(server_static),
    )
    resp = HandshakeState(
        "Noise_NK_25519_ChaChaPoly_BLAKE2s",
        initiator=False,
        prologue=b"rudp",
        static=server_static,
    )
    return init, resp


@pytest.mark.parametrize("position", [0, 5, 31, 32, 40, 47])
def test_a_flipped_bit_anywhere_fails_authentication(position: int) -> None:
    init, resp = _nk_pair()
    message = bytearray(init.write_message(b"hello server!"))
    message[position] ^= 0x01
    with pytest.raises(NoiseError):
        resp.read_message(bytes(message))


def test_a_truncated_message_is_refused() -> None:
    init, resp = _nk_pair()
    message = init.write_message(b"")
    for cut in (0, 1, 31, 32, 47):
        _, fresh = _nk_pair()
        with pytest.raises(NoiseError):
            fresh.read_message(message[:cut])
    assert resp.read_message(message) == b""


def test_a_different_prologue_fails() -> None:
    init, _ = _nk_pair()
    other = HandshakeState(
        "Noise_NK_25519_ChaChaPoly_BLAKE2s",
        initiator=False,
        prologue=b"something else",
        static=private_key(bytes(range(32))),
    )
    with pytest.raises(NoiseError):
        other.read_message(init.write_message(b""))


def test_the_wrong_server_key_fails() -> None:
    init, _ = _nk_pair()
    impostor = HandshakeState(
        "Noise_NK_25519_ChaChaPoly_BLAKE2s",
        initiator=False,
        prologue=b"rudp",
        static=private_key(bytes(range(1, 33))),
    )
    with pytest.raises(NoiseError):
        impostor.read_message(init.write_message(b""))


def test_turns_are_enforced_and_split_waits_for_the_end() -> None:
    init, resp = _nk_pair()
    with pytest.raises(NoiseError):
        resp.write_message(b"")
    with pytest.raises(NoiseError):
        init.read_message(bytes(48))
    with pytest.raises(NoiseError):
        init.split()
    resp.read_message(init.write_message(b""))
    init.read_message(resp.write_message(b""))
    with pytest.raises(NoiseError):
        init.write_message(b"")
    assert init.split() == tuple(reversed(resp.split()))


def test_a_low_order_public_key_is_refused() -> None:
    _, resp = _nk_pair()
    with pytest.raises(NoiseError):
        resp.read_message(bytes(32) + bytes(16))


@pytest.mark.parametrize(
    "name",
    [
        "Noise_NK_448_ChaChaPoly_BLAKE2s",
        "Noise_NK_25519_AESGCM_SHA256",
        "Noise_NK_25519_ChaChaPoly_SHA512",
        "Noise_ZZ_25519_ChaChaPoly_SHA256",
        "Noise_NKpsk9_25519_ChaChaPoly_SHA256",
        "Noise_NKfallback_25519_ChaChaPoly_SHA256",
        "NK",
    ],
)
def test_unsupported_names_raise(name: str) -> None:
    with pytest.raises(ValueError):
        parse_protocol_name(name)


def test_missing_keys_raise_at_construction() -> None:
    with pytest.raises(ValueError):
        HandshakeState("Noise_NK_25519_ChaChaPoly_SHA256", initiator=True)
    with pytest.raises(ValueError):
        HandshakeState("Noise_NK_25519_ChaChaPoly_SHA256", initiator=False)
    with pytest.raises(ValueError):
        private_key(bytes(31))


def test_cipher_state_refuses_an_exhausted_nonce() -> None:
    cipher = CipherState(bytes(32))
    cipher.n = (1 << 64) - 1
    with pytest.raises(NoiseError):
        cipher.encrypt_with_ad(b"", b"x")


def test_the_names_worked_out_once_are_bounded() -> None:
    # Valid names are unbounded (psk0, psk00, ... and any number of modifiers); a
    # program building states from names it was sent must not grow the table.
    from rudp import noise

    for i in range(1, 200):
        name = "Noise_NNpsk" + "0" * i + "_25519_ChaChaPoly_SHA256"
        HandshakeState(name, initiator=True, psks=[bytes(32)] * i)
    assert len(noise._SCRIPTS) <= noise._SCRIPTS_KEPT
