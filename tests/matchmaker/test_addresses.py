from __future__ import annotations

import pytest

from matchmaker.addresses import (
    Address,
    from_sockaddr,
    lan_reason,
    make_address,
    non_public_reason,
    normalise_ip,
    parse_key,
    rate_key,
    same_public_ip,
)


def test_normalise() -> None:
    assert normalise_ip("::ffff:192.0.2.1") == "192.0.2.1"
    assert normalise_ip("2001:0db8:0000::0001") == "2001:db8::1"
    assert normalise_ip("fe80::1%eth0") == "fe80::1"
    with pytest.raises(ValueError):
        normalise_ip("example.com")


def test_keys_round_trip() -> None:
    for a in (Address("192.0.2.1", 1), Address("2001:db8::1", 65535)):
        assert parse_key(a.key) == a
    assert Address("2001:db8::1", 5).key == "[2001:db8::1]:5"
    assert Address("2001:db8::1", 5).family == 6 and Address("192.0.2.1", 5).family == 4
    for bad in ("1.2.3.4", "1.2.3.4:x", "[::1]:0", "host:80", "1.2.3.4:70000"):
        with pytest.raises(ValueError):
            parse_key(bad)


def test_from_sockaddr() -> None:
    assert from_sockaddr(("::ffff:198.51.100.1", 9, 0, 0)) == Address("198.51.100.1", 9)
    with pytest.raises(ValueError):
        from_sockaddr((b"x", 1))
    with pytest.raises(ValueError):
        make_address("1.2.3.4", 0)


@pytest.mark.parametrize(
    ("ip", "reason"),
    [
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.1.1", "link_local"),
        ("fe80::1", "link_local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.0.1", "private"),
        ("fc00::1", "private"),
        ("192.0.2.1", "private"),  # TEST-NET-1, documentation
        ("240.0.0.1", "private"),  # reserved, reported by ipaddress as private too
        ("100.64.0.1", "bogon"),  # shared address space (CGNAT)
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_non_public(ip: str, reason: str | None) -> None:
    assert non_public_reason(ip) == reason


def test_rate_key_groups_ipv6_by_64() -> None:
    assert (
        rate_key("2001:db8:1:2:aaaa::1") == rate_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    )
    assert rate_key("2001:db8:1:3::1") != rate_key("2001:db8:1:2::1")
    assert rate_key("::ffff:198.51.100.1") == "198.51.100.1"
    assert rate_key("198.51.100.1") == "198.51.100.1"
    with pytest.raises(ValueError):
        rate_key("198.51.100.300")


def test_same_public_ip() -> None:
    assert same_public_ip(Address("198.51.100.1", 1), Address("198.51.100.1", 2))
    assert not same_public_ip(Address("198.51.100.1", 1), Address("198.51.100.2", 1))


@pytest.mark.parametrize(
    ("lan", "public", "reason"),
    [
        ("10.1.2.3", "93.184.216.1", None),
        ("172.31.255.254", "93.184.216.1", None),
        ("192.168.1.5", "93.184.216.1", None),
        ("100.64.0.9", "93.184.216.1", None),  # carrier-grade NAT
        ("169.254.3.3", "93.184.216.1", None),
        ("fd12:3456::1", "2001:db8::1", None),
        ("fe80::1%eth0", "2001:db8::1", None),
        ("::ffff:192.168.1.5", "93.184.216.1", None),
        ("10.1.2.3", "10.214.0.1", None),  # a LAN behind a private "public" address
        # A third party on the Internet: what the peer behind the NAT would be aimed at.
        ("8.8.8.8", "93.184.216.1", "global"),
        # The peer's own public address (a host with a public IP of its own): only a
        # peer behind that very address is given it.
        ("93.184.216.1", "93.184.216.1", None),
        ("2606:4700:4700::1111", "2606:4700:4700::1111", None),
        ("172.32.0.1", "93.184.216.1", "global"),
        ("2606:4700:4700::1111", "2001:db8::1", "global"),
        # The peer's own machine, not the host's.
        ("127.0.0.99", "93.184.216.1", "loopback"),
        ("::1", "2001:db8::1", "loopback"),
        ("127.0.0.99", "10.1.2.3", "loopback"),
        # Both on the one machine the matchmaker sees them at (--allow-private).
        ("127.0.0.99", "127.0.0.1", None),
        ("::1", "127.0.0.1", None),
        # No machine of a LAN.
        ("0.0.0.0", "93.184.216.1", "not_private"),
        ("224.0.0.1", "93.184.216.1", "not_private"),
        ("255.255.255.255", "93.184.216.1", "not_private"),
        ("192.0.2.1", "93.184.216.1", "not_private"),  # documentation
        ("ff02::1", "2001:db8::1", "not_private"),
    ],
)
def test_a_lan_address_is_a_private_one(lan: str, public: str, reason: str | None) -> None:
    assert lan_reason(lan, public) == reason
