"""rudp.tokens: issuing, decoding, and every reason a host refuses a token."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rudp.noise import generate_key, public_key
from rudp.tokens import (
    _HEAD,
    MAX_TOKEN_SIZE,
    MAX_USER_DATA,
    REFUSAL_TEXT,
    SIGNATURE_SIZE,
    Issuer,
    TokenError,
    TokenRefusal,
    TokenVerifier,
    decode_token,
    generate_issuer_key,
    issuer_public_key,
    key_id,
    open_token,
)

NOW = 1_800_000_000.0
HOST = public_key(generate_key())
CLIENT = public_key(generate_key())
ADDRESSES = (("203.0.113.7", 9000), ("2001:db8::7", 9000))


def _issuer() -> Issuer:
    return Issuer(generate_issuer_key())


def _token(issuer: Issuer, **overrides: object) -> bytes:
    fields: dict[str, object] = {
        "client_key": CLIENT,
        "host_key": HOST,
        "addresses": ADDRESSES,
        "client_id": 42,
        "now": NOW,
        "lifetime": 30.0,
        "user_data": b"player=ada;team=red",
    }
    fields.update(overrides)
    return issuer.issue(**fields)  # type: ignore[arg-type]


def _refusal(verifier: TokenVerifier, token: bytes, **kw: object) -> TokenRefusal:
    with pytest.raises(TokenError) as info:
        verifier.verify(token, kw.get("client", CLIENT), kw.get("now", NOW))  # type: ignore[arg-type]
    return info.value.refusal


def test_a_valid_token_gives_the_identity_and_round_trips() -> None:
    issuer = _issuer()
    token = _token(issuer)
    identity = TokenVerifier([issuer.public_key], HOST).verify(token, CLIENT, NOW + 29)
    assert (identity.client_id, identity.user_data) == (42, b"player=ada;team=red")
    assert identity.key_id == key_id(issuer.public_key) == issuer.key_id
    assert identity.expires == NOW + 30
    decoded = decode_token(token)
    assert decoded.addresses == ADDRESSES
    assert (decoded.client_key, decoded.host_key) == (CLIENT, HOST)
    assert issuer_public_key(generate_issuer_key()) != issuer.public_key


def test_forged_token_is_refused() -> None:
    issuer = _issuer()
    token = bytearray(_token(issuer))
    token[15] ^= 1  # inside client_id: a byte only the signature vouches for
    verifier = TokenVerifier([issuer.public_key], HOST)
    assert _refusal(verifier, bytes(token)) is TokenRefusal.FORGED
    # Signed by a stranger's key that claims the issuer's key id.
    stranger = _issuer()
    body = _token(stranger)
    forged = body[:1] + issuer.key_id + body[5:]
    assert _refusal(verifier, forged) is TokenRefusal.FORGED


def test_expired_token_is_refused() -> None:
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST)
    assert _refusal(verifier, _token(issuer), now=NOW + 30.001) is TokenRefusal.EXPIRED


def test_token_is_accepted_once_per_host() -> None:
    issuer = _issuer()
    token = _token(issuer)
    verifier = TokenVerifier([issuer.public_key], HOST)
    verifier.verify(token, CLIENT, NOW)
    assert _refusal(verifier, token, now=NOW + 1) is TokenRefusal.REPLAYED
    # Another host (another verifier, same key) takes it once too.
    TokenVerifier([issuer.public_key], HOST).verify(token, CLIENT, NOW)


def test_token_of_another_client_is_refused() -> None:
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST)
    other = public_key(generate_key())
    assert _refusal(verifier, _token(issuer), client=other) is TokenRefusal.WRONG_CLIENT
    # The refusal spent nothing: the genuine client still gets in.
    verifier.verify(_token(issuer), CLIENT, NOW)


def test_token_for_another_host_is_refused() -> None:
    issuer = _issuer()
    other_host = TokenVerifier([issuer.public_key], public_key(generate_key()))
    assert _refusal(other_host, _token(issuer)) is TokenRefusal.WRONG_HOST
    # Same key, but a host that knows its addresses and is not at any of them.
    elsewhere = TokenVerifier([issuer.public_key], HOST, [("198.51.100.1", 9000)])
    assert _refusal(elsewhere, _token(issuer)) is TokenRefusal.WRONG_HOST
    here = TokenVerifier([issuer.public_key], HOST, [("2001:db8::7", 9000)])
    here.verify(_token(issuer), CLIENT, NOW)


@pytest.mark.parametrize(
    ("configured", "named"),
    [
        (("2001:DB8::7", 9000), ("2001:db8::7", 9000)),
        (("2001:0db8:0:0::7", 9000), ("2001:db8::7", 9000)),
        (("::ffff:203.0.113.7", 9000), ("203.0.113.7", 9000)),
        (("203.0.113.7", 9000), ("::ffff:203.0.113.7", 9000)),
    ],
)
def test_host_addresses_are_compared_written_one_way(
    configured: tuple[str, int], named: tuple[str, int]
) -> None:
    issuer = _issuer()
    token = _token(issuer, addresses=(named,))
    TokenVerifier([issuer.public_key], HOST, [configured]).verify(token, CLIENT, NOW)
    # Another port is still another address.
    elsewhere = TokenVerifier([issuer.public_key], HOST, [(configured[0], 9001)])
    assert _refusal(elsewhere, token) is TokenRefusal.WRONG_HOST


def test_verifier_refuses_addresses_that_are_not_ip_addresses() -> None:
    with pytest.raises(ValueError):
        TokenVerifier([_issuer().public_key], HOST, [("game.example", 9000)])


def test_cheap_checks_refuse_before_the_signature_is_checked() -> None:
    # A token with a bad signature that is also expired, or for another client or
    # host, is refused for that, without the Ed25519 check; it is never accepted.
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST, [("203.0.113.7", 9000)])

    def junk(**overrides: object) -> bytes:
        token = _token(issuer, **overrides)
        return token[:-1] + bytes((token[-1] ^ 1,))

    other = public_key(generate_key())
    assert _refusal(verifier, junk(), now=NOW + 31) is TokenRefusal.EXPIRED
    assert _refusal(verifier, junk(), client=other) is TokenRefusal.WRONG_CLIENT
    assert _refusal(verifier, junk(host_key=other)) is TokenRefusal.WRONG_HOST
    assert _refusal(verifier, junk(addresses=(("198.51.100.1", 9000),))) is TokenRefusal.WRONG_HOST
    assert _refusal(verifier, junk()) is TokenRefusal.FORGED
    verifier.verify(_token(issuer), CLIENT, NOW)  # the forgeries spent nothing


def test_rotated_key_is_accepted_and_retired_key_refused() -> None:
    old, new = _issuer(), _issuer()
    rotating = TokenVerifier([old.public_key, new.public_key], HOST)
    rotating.verify(_token(old, client_id=1), CLIENT, NOW)
    rotating.verify(_token(new, client_id=2), CLIENT, NOW)
    retired = TokenVerifier([new.public_key], HOST)
    assert _refusal(retired, _token(old)) is TokenRefusal.UNKNOWN_ISSUER
    with pytest.raises(ValueError, match="at most 2"):
        TokenVerifier([old.public_key, new.public_key, _issuer().public_key], HOST)
    with pytest.raises(ValueError, match="same key id"):
        TokenVerifier([old.public_key, old.public_key], HOST)


def test_truncated_token_is_refused_at_every_length() -> None:
    issuer = _issuer()
    token = _token(issuer)
    verifier = TokenVerifier([issuer.public_key], HOST)
    for size in range(len(token)):
        refusal = _refusal(verifier, token[:size])
        # Cut in the signature, the body still parses and the signature is wrong.
        assert refusal in (TokenRefusal.TRUNCATED, TokenRefusal.FORGED, TokenRefusal.MALFORMED)
    assert _refusal(verifier, b"") is TokenRefusal.TRUNCATED
    assert _refusal(verifier, token[:100]) is TokenRefusal.TRUNCATED


def test_oversized_token_is_refused() -> None:
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST)
    token = _token(issuer, user_data=bytes(MAX_USER_DATA))
    assert _refusal(verifier, token + bytes(MAX_TOKEN_SIZE)) is TokenRefusal.OVERSIZED
    with pytest.raises(ValueError, match="at most 256"):
        _token(issuer, user_data=bytes(MAX_USER_DATA + 1))
    # A length field claiming more user data than allowed.
    head = decode_token(token)
    at = len(head.body) - MAX_USER_DATA - 2
    lying = token[:at] + (MAX_USER_DATA + 1).to_bytes(2, "big") + token[at + 2 :]
    assert _refusal(verifier, lying) is TokenRefusal.OVERSIZED


def test_other_refusals_have_their_own_reasons() -> None:
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST)
    token = _token(issuer)
    assert _refusal(verifier, b"\x02" + token[1:]) is TokenRefusal.UNKNOWN_VERSION
    bad_family = token[:86] + b"\x05" + token[87:]
    assert _refusal(verifier, bad_family) is TokenRefusal.MALFORMED
    assert len(set(REFUSAL_TEXT.values())) == len(TokenRefusal)
    assert all(len(text.encode()) <= 96 for text in REFUSAL_TEXT.values())


def test_issue_refuses_misuse() -> None:
    issuer = _issuer()
    with pytest.raises(ValueError, match="1 to 8"):
        _token(issuer, addresses=())
    with pytest.raises(ValueError, match="32-byte"):
        _token(issuer, client_key=b"short")
    with pytest.raises(ValueError):
        _token(issuer, addresses=(("not an ip", 1),))


def test_open_token_checks_the_signature_only() -> None:
    issuer = _issuer()
    token = _token(issuer)
    assert open_token(token, [issuer.public_key]).host_key == HOST
    with pytest.raises(TokenError):
        open_token(token, [_issuer().public_key])


def test_replay_cache_is_bounded_and_forgets_expired_tokens() -> None:
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST, cache_size=4)
    for n in range(6):
        verifier.verify(_token(issuer, client_id=n), CLIENT, NOW)
    assert len(verifier) == 4 and verifier.evicted == 2
    verifier.verify(_token(issuer, client_id=99, now=NOW + 100), CLIENT, NOW + 100)
    assert len(verifier) == 1  # the others expired


@given(st.binary(max_size=MAX_TOKEN_SIZE + 8))
def test_garbage_never_raises_anything_but_token_error(data: bytes) -> None:
    verifier = TokenVerifier([issuer_public_key(bytes(32))], HOST)
    with pytest.raises(TokenError):
        verifier.verify(data, CLIENT, NOW)


@given(
    st.sampled_from([4, 6, 0, 5]),
    st.binary(min_size=16, max_size=16),
    st.integers(0, 65535),
    st.binary(max_size=8),
)
def test_any_address_in_an_otherwise_matching_token_raises_only_token_error(
    family: int, raw: bytes, port: int, tail: bytes
) -> None:
    # Every field the cheap checks compare matches, so the address reaches the
    # comparison with the host's own addresses (unsigned: the signature comes after).
    issuer = _issuer()
    verifier = TokenVerifier([issuer.public_key], HOST, addresses=ADDRESSES)
    head = _HEAD.pack(1, issuer.key_id, int((NOW + 30) * 1000), 1, CLIENT, HOST, 1)
    address = bytes((family,)) + raw[: 4 if family == 4 else 16] + port.to_bytes(2, "big")
    with pytest.raises(TokenError):
        verifier.verify(head + address + bytes(2) + tail + bytes(SIGNATURE_SIZE), CLIENT, NOW)


def test_a_token_naming_port_0_is_malformed() -> None:
    issuer = _issuer()
    token = _token(issuer, addresses=[ADDRESSES[0]])
    port = _HEAD.size + 1 + 4
    zero = token[:port] + bytes(2) + token[port + 2 :]
    verifier = TokenVerifier([issuer.public_key], HOST, addresses=ADDRESSES)
    assert _refusal(verifier, zero) is TokenRefusal.MALFORMED


def test_config_refuses_token_addresses_that_are_not_ip_addresses() -> None:
    from rudp.config import Config

    Config(token_addresses=(("2001:DB8::7", 9000), ("::ffff:203.0.113.7", 9000)))
    for bad in (("game.example", 9000), ("203.0.113.7", 0), ("203.0.113.7",)):
        with pytest.raises(ValueError, match="token_addresses"):
            Config(token_addresses=(bad,))  # type: ignore[arg-type]
