"""Connectionless heartbeats and introductions: the wire format and the daemon's checks."""

from __future__ import annotations

import random

import pytest

from matchmaker import heartbeat as hb
from matchmaker.addresses import Address
from matchmaker.liveness import _Groups
from matchmaker.messages import (
    Error,
    ErrorReason,
    HostUpdate,
    Introduce,
    Introduction,
    Register,
    Registered,
    Role,
    Update,
    decode,
)
from matchmaker.registry import MemoryRegistry, RemovalReason
from matchmaker.registry.base import TakeoverResult
from tests.matchmaker.fakes import settle
from tests.matchmaker.helpers import Harness, info, pub

HOST = Address(pub(1), 27960)
V6 = Address("2001:db8::7", 40000)
SECRET = b"k" * 32


# ------------------------------------------------------------------ wire


@pytest.mark.parametrize("address", [HOST, V6])
@pytest.mark.parametrize("kind", [hb.Kind.HEARTBEAT, hb.Kind.LEAVE, hb.Kind.MOVING])
def test_beat_round_trip(address: Address, kind: hb.Kind) -> None:
    data = hb.encode_beat(SECRET, address, 12345, kind)
    assert len(data) == (32 if address.family == 4 else 44)
    beat = hb.decode_beat(data)
    assert (beat.kind, beat.counter, beat.address) == (kind, 12345, address)
    assert hb.mac_ok(SECRET, beat.signed, beat.mac)
    assert not hb.mac_ok(b"x" * 32, beat.signed, beat.mac)


def test_a_heartbeat_cannot_pass_for_a_moving_one() -> None:
    """The kind is under the MAC: a recorded HEARTBEAT with its first byte changed
    does not ask a replica to take the host over."""
    plain = hb.encode_beat(SECRET, HOST, 7)
    beat = hb.decode_beat(bytes((hb.Kind.MOVING,)) + plain[1:])
    assert beat.kind is hb.Kind.MOVING
    assert not hb.mac_ok(SECRET, beat.signed, beat.mac)


@pytest.mark.parametrize("address", [HOST, V6])
def test_every_cut_and_trailing_garbage_is_refused(address: Address) -> None:
    data = hb.encode_beat(SECRET, address, 1)
    for end in range(len(data)):
        with pytest.raises(hb.BeatError) as cut:
            hb.decode_beat(data[:end])
        assert cut.value.reason in ("unknown_type", "truncated")
    with pytest.raises(hb.BeatError) as longer:
        hb.decode_beat(data + b"\0")
    assert longer.value.reason == "malformed"
    bad_family = data[:9] + b"\x05" + data[10:]
    with pytest.raises(hb.BeatError, match="malformed"):
        hb.decode_beat(bad_family)


def test_the_ack_made_from_a_beats_bytes_is_encode_ack() -> None:
    """`ack_of` reuses the beat's packed address where packing its Address gives
    the same bytes, and packs it otherwise (a mapped IPv4 address sent as IPv6)."""
    mapped = hb.encode_beat(SECRET, Address("::ffff:93.184.216.1", 27960), 5)
    mapped_beat = hb.decode_beat(mapped)
    assert mapped_beat.address == HOST  # normalised: no longer the bytes it came as
    beats = [hb.decode_beat(hb.encode_beat(SECRET, a, c)) for a in (HOST, V6) for c in (0, 7)]
    for beat in [*beats, mapped_beat]:
        assert hb.ack_of(SECRET, beat) == hb.encode_ack(SECRET, beat.address, beat.counter)
        assert hb.decode_ack(SECRET, beat.address, hb.ack_of(SECRET, beat)) == beat.counter


@pytest.mark.parametrize("address", [HOST, V6])
def test_a_beat_naming_port_zero_is_malformed(address: Address) -> None:
    data = hb.encode_beat(SECRET, address, 1)
    with pytest.raises(hb.BeatError, match="malformed"):
        hb.decode_beat(data[:10] + b"\0\0" + data[12:])


def test_acks_and_introductions_are_bound_to_the_secret_and_address() -> None:
    ack = hb.encode_ack(SECRET, HOST, 7)
    assert len(ack) == hb.ACK_BYTES
    assert hb.decode_ack(SECRET, HOST, ack) == 7
    assert hb.decode_ack(SECRET, V6, ack) is None
    assert hb.decode_ack(b"x" * 32, HOST, ack) is None
    intro = hb.encode_introduction(SECRET, HOST, 9, b"payload")
    assert hb.decode_introduction(SECRET, HOST, intro) == (9, b"payload")
    assert hb.decode_introduction(SECRET, V6, intro) is None
    assert hb.decode_introduction(SECRET, HOST, intro[:-1] + b"\0") is None
    intro_ack = hb.encode_introduction_ack(SECRET, HOST, 9)
    assert hb.decode_introduction_ack(intro_ack)[0] == 9
    assert hb.introduction_ack_ok(SECRET, HOST, intro_ack)
    assert not hb.introduction_ack_ok(SECRET, V6, intro_ack)
    assert hb.decode_not_registered(SECRET, HOST, hb.encode_not_registered(3)) == (3, False)
    signed = hb.encode_not_registered(3, SECRET, HOST)
    assert len(signed) == hb.ACK_BYTES
    assert hb.decode_not_registered(SECRET, HOST, signed) == (3, True)
    assert hb.decode_not_registered(SECRET, V6, signed) is None
    assert hb.decode_not_registered(b"x" * 32, HOST, signed) is None
    assert hb.decode_not_registered(SECRET, HOST, signed[:-1]) is None


def test_counters_start_at_random() -> None:
    starts = {hb.first_counter() for _ in range(64)}
    assert len(starts) == 64
    assert all(0 < c <= 1 << hb.COUNTER_START_BITS for c in starts)


def test_first_bytes_are_free_of_rudp_a2s_and_master_queries() -> None:
    for byte in hb.FIRST_BYTES:
        assert not 0xA0 <= byte <= 0xAF  # rudp version 2
        assert byte not in (0xFF, 0x31)  # A2S / Quake out-of-band, Steam master query


# ------------------------------------------------------------------ the daemon's checks


async def registered(h: Harness, address: Address = HOST) -> bytes:
    """Register a host at `address` over a connection, close it; returns its secret."""
    wire = await h.host(address.ip, address.port)
    record = h.registry.get(address)
    assert record is not None
    await wire.close()
    return h.service.liveness.secret(record)


def result(h: Harness, name: str) -> float:
    return h.sample("matchmaker_heartbeats_total", result=name)


async def test_a_genuine_heartbeat_is_acknowledged_and_keeps_the_host_listed() -> None:
    h = Harness()
    secret = await registered(h)
    before = h.registry.get(HOST)
    assert before is not None
    h.clock.advance(10)
    beat = hb.encode_beat(secret, HOST, 1)
    replies = h.service.liveness.receive(beat, HOST)
    assert len(replies) == 1 and len(replies[0]) <= len(beat)
    assert hb.decode_ack(secret, HOST, replies[0]) == 1
    await h.service.flush_heartbeats()
    after = h.registry.get(HOST)
    assert after is not None and after.last_seen == h.registry.now()
    assert result(h, "ok") == 1
    assert h.service.connections == 0  # listed without a connection


async def test_forgery_is_dropped_and_counted() -> None:
    h = Harness()
    secret = await registered(h)
    forged = hb.encode_beat(b"guessed".ljust(32, b"\0"), HOST, 1)
    assert h.service.liveness.receive(forged, HOST) == []
    flipped = bytearray(hb.encode_beat(secret, HOST, 2))
    flipped[-1] ^= 1
    assert h.service.liveness.receive(bytes(flipped), HOST) == []
    assert result(h, "bad_mac") == 2
    await h.service.flush_heartbeats()
    assert result(h, "ok") == 0
    # A forged LEAVE removes nothing.
    leave = hb.encode_beat(b"\0" * 32, HOST, 3, hb.Kind.LEAVE)
    assert h.service.liveness.receive(leave, HOST) == []
    await settle()
    assert h.registry.get(HOST) is not None


async def test_replay_is_dropped_and_counted() -> None:
    h = Harness()
    secret = await registered(h)
    liveness = h.service.liveness
    first = hb.encode_beat(secret, HOST, 5)
    assert len(liveness.receive(first, HOST)) == 1
    assert liveness.receive(first, HOST) == []  # the same datagram again
    assert liveness.receive(hb.encode_beat(secret, HOST, 4), HOST) == []  # an older one
    assert result(h, "replayed") == 2
    assert len(liveness.receive(hb.encode_beat(secret, HOST, 6), HOST)) == 1
    assert result(h, "ok") == 2


async def test_an_update_keeps_the_replay_window() -> None:
    h = Harness()
    wire = await h.host(HOST.ip, HOST.port)
    record = h.registry.get(HOST)
    assert record is not None
    secret = h.service.liveness.secret(record)
    first = hb.encode_beat(secret, HOST, 5)
    assert len(h.service.liveness.receive(first, HOST)) == 1
    await wire.request(Update(request_id=2, changes=HostUpdate(players=3)))
    updated = h.registry.get(HOST)
    assert updated is not None and updated is not record and updated.info.players == 3
    assert h.service.liveness.receive(first, HOST) == []
    assert result(h, "replayed") == 1


async def test_a_heartbeat_from_another_address_is_refused_and_counted() -> None:
    h = Harness()
    secret = await registered(h)
    await registered(h, Address(pub(2), 27960))
    copied = hb.encode_beat(secret, HOST, 1)
    elsewhere = (pub(2), 27960)  # another listed host's address
    replies = h.service.liveness.receive(copied, elsewhere)
    # Authenticated: the matchmaker lists the address, so it knows the secret.
    assert replies == [hb.encode_not_registered(1, secret, HOST)]
    assert len(replies[0]) < len(copied)
    assert result(h, "wrong_address") == 1
    # The copy did not use up the genuine host's counter.
    assert len(h.service.liveness.receive(copied, HOST)) == 1
    assert result(h, "ok") == 1


async def test_a_heartbeat_through_a_dual_stack_socket_is_its_hosts() -> None:
    """An IPv4 host's heartbeat read on a dual-stack IPv6 socket comes from
    ``::ffff:a.b.c.d``: the same address, so it is acknowledged; another port is not."""
    h = Harness()
    secret = await registered(h)
    beat = hb.encode_beat(secret, HOST, 1)
    replies = h.service.liveness.receive(beat, (f"::ffff:{HOST.ip}", HOST.port, 0, 0))
    assert replies == [hb.encode_ack(secret, HOST, 1)]
    assert result(h, "ok") == 1
    other_port = h.service.liveness.receive(hb.encode_beat(secret, HOST, 2), (HOST.ip, 1))
    assert other_port == [hb.encode_not_registered(2, secret, HOST)]
    assert result(h, "wrong_address") == 1


async def test_unknown_hosts_and_garbage() -> None:
    h = Harness()
    stranger = hb.encode_beat(SECRET, HOST, 1)
    assert h.service.liveness.receive(stranger, HOST) == [hb.encode_not_registered(1)]
    assert result(h, "not_registered") == 1
    assert h.service.liveness.receive(stranger[:5], HOST) == []
    assert result(h, "truncated") == 1
    assert h.service.liveness.receive(stranger + b"!", HOST) == []
    assert result(h, "malformed") == 1
    assert h.service.liveness.receive(b"\xb2" + bytes(24), HOST) == []
    assert result(h, "unknown_type") == 1


async def test_leave_removes_the_host() -> None:
    h = Harness()
    secret = await registered(h)
    leave = hb.encode_beat(secret, HOST, 1, hb.Kind.LEAVE)
    assert len(h.service.liveness.receive(leave, HOST)) == 1
    await settle()
    assert h.registry.get(HOST) is None
    assert result(h, "left") == 1
    assert h.sample("matchmaker_removals_total", reason="unregistered") == 1


async def test_a_stopping_replica_sends_heartbeaters_to_register_elsewhere() -> None:
    h = Harness()
    secret = await registered(h)
    h.service.stop_accepting()
    assert h.service.liveness.receive(hb.encode_beat(secret, HOST, 1), HOST) == [
        hb.encode_not_registered(1, secret, HOST)
    ]
    assert result(h, "stopping") == 1


async def test_not_registered_replies_are_rate_limited_per_source() -> None:
    h = Harness()
    liveness = h.service.liveness
    burst = int(liveness.reply_limiter.rate.burst)
    victim = (pub(9), 5000)
    for counter in range(1, burst + 1):
        stranger = hb.encode_beat(SECRET, HOST, counter)
        assert liveness.receive(stranger, victim) == [hb.encode_not_registered(counter)]
    # Beyond the burst the spoofed source gets nothing more.
    assert liveness.receive(hb.encode_beat(SECRET, HOST, 99), victim) == []
    assert result(h, "not_registered") == burst
    assert result(h, "unanswered") == 1
    # Another source has its own share.
    other = (pub(8), 5000)
    assert liveness.receive(hb.encode_beat(SECRET, HOST, 1), other) != []


async def test_the_secret_comes_from_the_shared_key() -> None:
    h = Harness()
    wire = h.connect(HOST.ip, HOST.port)
    reply = await wire.request(Register(request_id=1, host=info()))
    assert isinstance(reply, Registered)
    record = h.registry.get(HOST)
    assert record is not None
    assert reply.secret == hb.derive_secret(h.registry.heartbeat_key, record.token, HOST)
    # Another replica with the same key checks the same heartbeats.
    other = Harness()
    other.registry.heartbeat_key = h.registry.heartbeat_key
    other.registry.index().put(record)
    assert len(other.service.liveness.receive(hb.encode_beat(reply.secret, HOST, 1), HOST)) == 1


# ------------------------------------------------------------------ introductions


async def test_introductions_are_resent_until_acknowledged() -> None:
    h = Harness()
    secret = await registered(h)
    sent: list[tuple[bytes, Address]] = []
    liveness = h.service.liveness
    liveness.send = lambda data, to: sent.append((data, to))
    joiner = h.connect(pub(2), 5000)
    to_client = await joiner.request(Introduce(request_id=3, host=HOST))
    assert isinstance(to_client, Introduction) and to_client.role is Role.CLIENT
    assert len(sent) == 1 and sent[0][1] == HOST
    found = hb.decode_introduction(secret, HOST, sent[0][0])
    assert found is not None
    intro_id, payload = found
    to_host = decode(payload)
    assert isinstance(to_host, Introduction) and to_host.role is Role.HOST
    assert to_host.peer == Address(pub(2), 5000) and to_host.nonce == to_client.nonce
    # Lost: sent again when due, the same datagram.
    h.clock.advance(liveness.resend_interval)
    liveness.resend(h.clock())
    assert [d for d, _ in sent] == [sent[0][0]] * 2
    # A forged acknowledgement does not stop it; the host's does.
    forged = hb.encode_introduction_ack(b"\0" * 32, HOST, intro_id)
    assert liveness.receive(forged, HOST) == []
    assert h.sample("matchmaker_introduction_datagrams_total", result="bad_ack") == 1
    assert liveness.receive(hb.encode_introduction_ack(secret, HOST, intro_id), HOST) == []
    assert liveness.pending == 0
    h.clock.advance(liveness.resend_interval)
    liveness.resend(h.clock())
    assert len(sent) == 2
    deliveries = {
        r: h.sample("matchmaker_introduction_datagrams_total", result=r)
        for r in ("sent", "resent", "acked")
    }
    assert deliveries == {"sent": 1, "resent": 1, "acked": 1}


async def test_an_unacknowledged_introduction_is_given_up_after_its_attempts() -> None:
    h = Harness()
    await registered(h)
    sent: list[bytes] = []
    liveness = h.service.liveness
    liveness.send = lambda data, to: sent.append(data)
    joiner = h.connect(pub(2), 5000)
    await joiner.request(Introduce(request_id=3, host=HOST))
    for _ in range(liveness.attempts + 3):
        h.clock.advance(liveness.resend_interval)
        liveness.resend(h.clock())
    assert len(sent) == liveness.attempts
    assert liveness.pending == 0
    assert h.sample("matchmaker_introduction_datagrams_total", result="unacked") == 1


def intro_id(secret: bytes, datagram: bytes, host: Address = HOST) -> int:
    found = hb.decode_introduction(secret, host, datagram)
    assert found is not None
    return found[0]


async def test_a_client_asking_again_has_one_introduction_waiting() -> None:
    """However often one client asks to be introduced to a host that does not
    acknowledge, the host gets one datagram per resend interval from it, `attempts`
    in all: the datagrams are bounded per client and host, not per request."""
    h = Harness()
    secret = await registered(h)
    sent: list[bytes] = []
    liveness = h.service.liveness
    liveness.send = lambda data, to: sent.append(data)
    joiner = h.connect(pub(2), 5000)
    for n in range(1, 6):
        assert isinstance(await joiner.request(Introduce(request_id=n, host=HOST)), Introduction)
    assert len(sent) == 1 and liveness.pending == 1
    assert h.sample("matchmaker_introduction_datagrams_total", result="coalesced") == 4
    # The one waiting is the newest (the host gets the nonce the client has now).
    h.clock.advance(liveness.resend_interval)
    liveness.resend(h.clock())
    first, newest = intro_id(secret, sent[0]), intro_id(secret, sent[1])
    assert newest == first + 4
    liveness.receive(hb.encode_introduction_ack(secret, HOST, first), HOST)
    assert h.sample("matchmaker_introduction_datagrams_total", result="late_ack") == 1
    assert liveness.pending == 1
    for _ in range(liveness.attempts - 2):
        h.clock.advance(liveness.resend_interval)
        liveness.resend(h.clock())
    assert len(sent) == liveness.attempts
    # Asked again after its last send: the newest still goes out, once.
    await joiner.request(Introduce(request_id=9, host=HOST))
    for _ in range(3):
        h.clock.advance(liveness.resend_interval)
        liveness.resend(h.clock())
    assert len(sent) == liveness.attempts + 1 and liveness.pending == 0
    assert intro_id(secret, sent[-1]) == newest + 1
    assert h.sample("matchmaker_introduction_datagrams_total", result="unacked") == 1
    # Another socket of the same machine is another client: its own introduction.
    await h.connect(pub(2), 5001).request(Introduce(request_id=10, host=HOST))
    assert len(sent) == liveness.attempts + 2 and liveness.pending == 1


async def test_introductions_for_a_host_gone_quiet_or_removed_are_given_up() -> None:
    h = Harness()
    await registered(h)
    other = Address(pub(3), 27960)
    await registered(h, other)
    sent: list[Address] = []
    liveness = h.service.liveness
    liveness.send = lambda data, to: sent.append(to)
    joiner = h.connect(pub(2), 5000)
    await joiner.request(Introduce(request_id=1, host=HOST))
    await joiner.request(Introduce(request_id=2, host=other))
    assert sent == [HOST, other]
    assert await h.registry.remove(other, RemovalReason.UNREGISTERED)
    h.clock.advance(liveness.resend_interval)
    liveness.resend(h.clock())
    assert sent == [HOST, other, HOST] and liveness.pending == 1
    # HOST sends no heartbeat: once hidden, it is not sent what it cannot answer.
    h.clock.advance(h.registry.hide_after)
    assert not h.registry.is_visible(h.registry.get(HOST), h.registry.now())  # type: ignore[arg-type]
    liveness.resend(h.clock())
    assert sent == [HOST, other, HOST] and liveness.pending == 0
    assert h.sample("matchmaker_introduction_datagrams_total", result="host_gone") == 2
    assert h.sample("matchmaker_introduction_datagrams_total", result="unacked") == 0


async def test_a_crowd_asking_for_one_host_gives_up_its_own_introductions() -> None:
    """Many sources, each with many sockets, asking for one host that does not
    acknowledge: that host's introductions are capped, and nobody else's is given up."""
    h = Harness()
    secret = await registered(h)
    bait = Address(pub(3), 27960)
    await registered(h, bait)
    liveness = h.service.liveness
    liveness.max_pending, liveness.max_per_host, liveness.max_per_source = 12, 8, 3
    to_host: list[bytes] = []
    liveness.send = lambda data, to: to_host.append(data) if to == HOST else None
    await h.connect(pub(2), 5000).request(Introduce(request_id=1, host=HOST))
    for n in range(20):
        for port in range(5):
            crowd = h.connect(pub(100 + n), 6000 + port)
            assert isinstance(await crowd.request(Introduce(request_id=1, host=bait)), Introduction)
    # No more for the bait host than its cap, none of a source's sockets beyond its.
    assert 1 + liveness.max_per_source <= liveness.pending <= 1 + liveness.max_per_host
    overflow = h.sample("matchmaker_introduction_datagrams_total", result="overflow")
    assert overflow == 100 - (liveness.pending - 1)
    for _ in range(liveness.attempts + 2):
        h.clock.advance(liveness.resend_interval)
        liveness.resend(h.clock())
    assert len(to_host) == liveness.attempts  # every send of its one introduction
    assert {intro_id(secret, d) for d in to_host} == {intro_id(secret, to_host[0])}


async def test_one_source_asking_for_many_hosts_gives_up_its_own_introductions() -> None:
    h = Harness()
    hosts = [Address(pub(10 + n), 27960) for n in range(6)]
    for address in hosts:
        await registered(h, address)
    liveness = h.service.liveness
    liveness.max_per_source = 3
    sent: list[Address] = []
    liveness.send = lambda data, to: sent.append(to)
    await h.connect(pub(2), 5000).request(Introduce(request_id=1, host=hosts[0]))
    for n, address in enumerate(hosts):
        await h.connect(pub(50), 6000 + n).request(Introduce(request_id=1, host=address))
    assert liveness.pending == 1 + 3
    assert h.sample("matchmaker_introduction_datagrams_total", result="overflow") == 3
    h.clock.advance(liveness.resend_interval)
    liveness.resend(h.clock())
    assert sorted(sent[7:]) == sorted([hosts[0], *hosts[3:]])  # the newest three, and pub(2)'s


async def test_when_all_are_full_the_busiest_host_or_source_gives_up_first() -> None:
    """No host or source over its own cap, but `max_pending` reached: the oldest of
    the host or source with the most goes, not the oldest of all."""
    h = Harness()
    await registered(h)
    bait = Address(pub(3), 27960)
    await registered(h, bait)
    liveness = h.service.liveness
    liveness.max_pending = 6
    to_host: list[bytes] = []
    liveness.send = lambda data, to: to_host.append(data) if to == HOST else None
    await h.connect(pub(2), 5000).request(Introduce(request_id=1, host=HOST))
    for port in range(10):  # one source: 5 ports to the bait host, then 5 to HOST
        target = bait if port < 5 else HOST
        await h.connect(pub(50), 6000 + port).request(Introduce(request_id=1, host=target))
    assert liveness.pending == 6
    assert h.sample("matchmaker_introduction_datagrams_total", result="overflow") == 5
    for _ in range(liveness.attempts + 2):
        h.clock.advance(liveness.resend_interval)
        liveness.resend(h.clock())
    # pub(2)'s introduction (the oldest of all) had every send; so did pub(50)'s last
    # five, to HOST; its five to the bait host went first as the busiest.
    assert len(to_host) == 6 * liveness.attempts


def test_groups_track_counts_oldest_and_largest() -> None:
    rng = random.Random(5)
    groups: _Groups[int] = _Groups()
    model: dict[int, list[int]] = {}
    for intro_id in range(3000):
        key = rng.randrange(12)
        if rng.random() < 0.55:
            groups.add(key, intro_id)
            model.setdefault(key, []).append(intro_id)
        elif model:
            key = rng.choice(sorted(model))
            gone = rng.choice(model[key])
            groups.discard(key, gone)
            model[key].remove(gone)
            if not model[key]:
                del model[key]
        for k in range(12):
            assert groups.count(k) == len(model.get(k, ()))
            if k in model:
                assert groups.oldest(k) == model[k][0]
        if model:
            key, size = groups.largest()
            assert size == max(len(v) for v in model.values()) == len(model[key])


class _Loading(MemoryRegistry):
    """A shared registry before its first load: it does not know the shared key yet."""

    loaded = False

    @property
    def ready(self) -> bool:
        return self.loaded


async def test_no_secret_is_handed_out_before_the_registry_is_loaded() -> None:
    registry = _Loading()
    h = Harness(registry)
    wire = h.connect(HOST.ip, HOST.port)
    reply = await wire.request(Register(request_id=1, host=info()))
    assert isinstance(reply, Error) and reply.reason is ErrorReason.UNAVAILABLE
    assert h.registry.get(HOST) is None
    registry.loaded = True
    assert isinstance(await wire.request(Register(request_id=2, host=info())), Registered)


async def test_a_counter_the_registries_cannot_store_is_malformed() -> None:
    # Signed with the host's secret, a counter of 2**63 or more passed every check and
    # raised OverflowError out of the handler (the memory registry keeps counters in a
    # signed 64-bit array): a traceback logged per 32-byte datagram.
    with pytest.raises(hb.BeatError):
        hb.decode_beat(hb.encode_beat(SECRET, HOST, 1 << 63))
    h = Harness()
    secret = await registered(h)
    liveness = h.service.liveness
    for counter in (1 << 63, (1 << 64) - 1):
        for kind in (hb.Kind.HEARTBEAT, hb.Kind.MOVING, hb.Kind.LEAVE):
            assert liveness.receive(hb.encode_beat(secret, HOST, counter, kind), HOST) == []
    assert result(h, "malformed") == 6
    assert len(liveness.receive(hb.encode_beat(secret, HOST, hb.MAX_COUNTER), HOST)) == 1
    assert h.registry.get(HOST) is not None


async def test_a_moving_heartbeat_to_a_replica_of_one_is_taken() -> None:
    # The memory registry's records have a read-only owner: take_over raised
    # AttributeError, and every MOVING heartbeat went unanswered.
    h = Harness()
    secret = await registered(h)
    liveness = h.service.liveness
    assert liveness.receive(hb.encode_beat(secret, HOST, 7, hb.Kind.MOVING), HOST) == []
    waiting = liveness.take_takeovers()
    results = await h.registry.take_over([t for t, _ in waiting])
    assert results == [TakeoverResult.TAKEN]
    sent: list[tuple[bytes, object]] = []
    liveness._reply = lambda data, to: sent.append((data, to))  # type: ignore[method-assign]
    liveness.settle(waiting, results)
    assert [hb.decode_ack(secret, HOST, data) for data, _ in sent] == [7]
    assert result(h, "taken_over") == 1


async def test_a_spoofer_cannot_keep_a_stopping_replica_from_telling_its_host() -> None:
    # Junk heartbeats from the host's IP spent that IP's share of NOT_REGISTERED
    # replies, so the host's own heartbeat to a stopping replica went unanswered.
    h = Harness()
    secret = await registered(h)
    liveness = h.service.liveness
    burst = int(liveness.reply_limiter.rate.burst)
    for counter in range(1, burst + 5):  # an unlisted address, from the host's IP
        liveness.receive(hb.encode_beat(SECRET, Address(pub(7), 1), counter), (HOST.ip, 4000))
    assert result(h, "unanswered") == 4
    h.service.stop_accepting()
    reply = liveness.receive(hb.encode_beat(secret, HOST, 1), HOST)
    assert reply == [hb.encode_not_registered(1, secret, HOST)]
    assert result(h, "stopping") == 1
