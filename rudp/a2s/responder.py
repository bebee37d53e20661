"""The A2S responder: requests in, reply datagrams out; no socket, no clock.

Theory of operation
-------------------
Anyone can send a UDP request with a forged source address, so a reply larger
than its request, sent to an address nobody validated, would let a third
party aim our bandwidth at a victim.  The responder therefore answers a request
without a valid challenge only with ``S2C_CHALLENGE`` (9 bytes, never more
than the request; shorter requests get nothing), and sends the real answer
only to a requester that echoed the challenge, which proves it receives at its
address.  A request may also be answered at once when the reply is no larger
than the request itself.

The challenge is stored nowhere: it is an HMAC of the requester's address
and the current period number (``now // challenge_period``) under a secret
key, and a challenge of the current or the previous period is accepted, so it
lives between one and two periods.  0 and ``FFFFFFFF`` are never issued: clients
send those to ask for one.

A reply larger than one datagram is split in the Source engine's format; one
larger than 255 pieces loses its last rules (or players).

Every datagram is counted once: ``answered``, ``challenged`` or ``dropped``,
and each drop under its reason in ``drops`` (`DROP_REASONS`).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rudp.a2s.packets import (
    Kind,
    Player,
    ServerInfo,
    decode_request,
    encode_challenge,
    encode_info,
    encode_players,
    encode_rules,
    max_message,
    split,
)

InfoSource = Callable[[], ServerInfo | None]
PlayerSource = Callable[[], Sequence[Player]]
RuleSource = Callable[[], Mapping[str, str]]
_NO_CHALLENGE = (b"\x00\x00\x00\x00", b"\xff\xff\xff\xff")
log = logging.getLogger(__name__)

DROP_REASONS = ("not_a2s", "too_short", "not_hosting", "source_failed")
"""Why a datagram got no answer: no A2S request; a request without a valid
challenge shorter than the challenge it would get; a valid request while `info`
returns None (or the server closes); the game's `info`, `players` or `rules`
raised, or what they gave could not be sent (too large to split)."""


def _check_source(source: object, name: str, what: str) -> None:
    """Refuse at once, naming ``name``, a ``source`` that is not a plain function (``what``
    says what it must be): a value (a dict, a list, a str) would only fail at the first
    request, and an ``async def``'s coroutine would never be awaited."""
    if not callable(source):
        raise TypeError(f"{name} must be {what}, not {type(source).__name__}: {source!r:.60}")
    if inspect.iscoroutinefunction(source) or inspect.iscoroutinefunction(type(source).__call__):
        raise TypeError(
            f"{name} must be {what}, not a coroutine function: it is called for each"
            " request, and nothing would await it"
        )


class Responder:
    """Answers A2S_INFO, A2S_PLAYER and A2S_RULES for one game host.

    `info` is what to publish, or a function returning it or None (stay silent:
    not hosting now);
    `players` and `rules` are optional (empty lists without them).  `key` is the
    challenge secret (at least 16 random bytes); `max_datagram` bounds every
    datagram sent.
    """

    def __init__(
        self,
        info: InfoSource | ServerInfo,
        *,
        key: bytes,
        players: PlayerSource | None = None,
        rules: RuleSource | None = None,
        challenge_period: float = 30.0,
        max_datagram: int = 1200,
    ) -> None:
        if len(key) < 16:
            raise ValueError("key must be at least 16 bytes")
        source: InfoSource
        if isinstance(info, ServerInfo):
            published = info
            source = lambda: published  # noqa: E731
        else:
            _check_source(info, "info", "a ServerInfo, or a function returning one (or None)")
            source = info
        if players is not None:
            _check_source(players, "players", "a function returning a list of Player")
        if rules is not None:
            _check_source(rules, "rules", "a function returning a mapping of str to str")
        if isinstance(challenge_period, bool) or not isinstance(challenge_period, int | float):
            raise TypeError(f"challenge_period takes a number of seconds, not {challenge_period!r}")
        if not (challenge_period > 0 and math.isfinite(challenge_period)):
            raise ValueError(
                f"challenge_period must be a finite number of seconds > 0, not {challenge_period!r}"
            )
        if max_datagram < 64:
            raise ValueError("max_datagram must be >= 64")
        self._info = source
        self._players = players
        self._rules = rules
        self._key = key
        self._period = challenge_period
        self._max_datagram = max_datagram
        self._split_id = 0
        self.answered = 0
        """Requests answered with what they asked for."""
        self.challenged = 0
        """Requests answered with a challenge."""
        self.dropped = 0
        """Datagrams not answered: no A2S request, too short to answer at all, or a
        request while `info` returns None (each counted in `drops` too)."""
        self.drops = dict.fromkeys(DROP_REASONS, 0)
        """Datagrams not answered, by reason (`DROP_REASONS`)."""

    def __repr__(self) -> str:
        return (
            f"<rudp.a2s Responder answered={self.answered} challenged={self.challenged} "
            f"dropped={self.dropped}>"
        )

    def datagram_received(self, data: bytes, address: Any, now: float) -> list[bytes]:
        """The datagrams to send back to `address` (often none)."""
        request = decode_request(data)
        if request is None:
            return self._drop("not_a2s")
        validated = request.challenge is not None and self._valid(request.challenge, address, now)
        try:
            info = self._info()
            if info is None:
                return self._drop("not_hosting")
            if not validated and request.kind != Kind.INFO_REQUEST:
                # Players or rules for a source not validated: a challenge (no larger
                # than the request), without running the game's lists or encoding them.
                return self._challenge_reply(data, address, now)
            reply = self._reply(request.kind, info, validated)
            if not validated and len(reply) > len(data):
                return self._challenge_reply(data, address, now)
            self._split_id = (self._split_id + 1) & 0x7FFF
            pieces = split(reply, self._split_id, self._max_datagram)
        except Exception:
            # The game's code (or what it gave) failed: counted, never raised into the
            # socket's read (the answer is lost, the next request tries again); logged
            # the 1st, 2nd, 4th... time (anyone can send the requests that run it).
            dropped = self._drop("source_failed")
            count = self.drops["source_failed"]
            if count & (count - 1) == 0:
                log.exception("a2s_source_failed peer=%s count=%d", address, count)
            return dropped
        self.answered += 1
        return pieces

    def _challenge_reply(self, data: bytes, address: Any, now: float) -> list[bytes]:
        challenge = encode_challenge(self.challenge_for(address, now))
        if len(challenge) > len(data):
            return self._drop("too_short")
        self.challenged += 1
        return [challenge]

    def not_hosting(self) -> list[bytes]:
        """Count a request that comes while the server closes: no answer."""
        return self._drop("not_hosting")

    def _drop(self, reason: str) -> list[bytes]:
        self.dropped += 1
        self.drops[reason] += 1
        return []

    def _reply(self, kind: Kind, info: ServerInfo, validated: bool) -> bytes:
        limit = max_message(self._max_datagram) if validated else self._max_datagram
        if kind == Kind.INFO_REQUEST:
            return encode_info(info)
        if kind == Kind.PLAYER_REQUEST:
            return encode_players(list(self._players()) if self._players else [], limit)
        rules = self._rules() if self._rules else {}
        return encode_rules(list(rules.items()), limit)

    def challenge_for(self, address: Any, now: float) -> bytes:
        """The challenge `address` must echo, issued at `now`."""
        return self._challenge(address, int(now // self._period))

    def _valid(self, challenge: bytes, address: Any, now: float) -> bool:
        if challenge in _NO_CHALLENGE:
            return False
        period = int(now // self._period)
        return any(
            hmac.compare_digest(challenge, self._challenge(address, p))
            for p in (period, period - 1)
        )

    def _challenge(self, address: Any, period: int) -> bytes:
        text = f"{period}|{address[0]}|{address[1]}".encode()
        digest = hmac.new(self._key, text, hashlib.sha256).digest()[:4]
        return b"\x01\x00\x00\x00" if digest in _NO_CHALLENGE else digest
