"""The responder's rules, sans-IO: which calls get an answer, and what it says.

Theory of operation
-------------------
:class:`Responder` turns one received datagram into the bytes to send back,
or into nothing and one counter bumped. A call is answered with this host's
info (the mapping, or what the info callable returns at that moment) unless:

* it is not a well-formed CALL (``malformed``), which includes a CALL whose
  body is longer than :data:`~rudp.lan.messages.MAX_CALL_BODY` (refused from
  its header, before any unpacking);
* it asks for another game (``other_game``);
* the info callable raises, or returns something msgpack cannot encode
  (``info_errors``; user code must not kill the event loop);
* the answer would be larger than the call (``oversize``). This is the
  anti-amplification rule: callers pad their calls to the request size, so an
  honest answer fits, and a call from a spoofed address gets at most its own
  size sent to the victim.

The nonce of the call is echoed, so the caller can tie the answer to the send
it answers. The instance id (random, injected) lets a caller merge answers
that reached it by several routes. No sockets, clocks or asyncio here: the
asyncio layer (:mod:`rudp.lan.aio`) owns the sockets and counts what the
kernel does with the answer (``answered``, ``send_errors``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rudp.lan.messages import (
    INSTANCE_ID_SIZE,
    MAX_CALL_BODY,
    MAX_DEPTH,
    NONCE_SIZE,
    Kind,
    MalformedDatagram,
    call_game,
    check_game,
    decode_packet,
    encode_answer,
    log_address,
)

__all__ = ["DiscoveryStats", "InfoSource", "Responder"]

log = logging.getLogger(__name__)

InfoSource = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
"""A responder's info: a msgpack-able mapping, or a callable returning one per call."""


@dataclass(slots=True)
class DiscoveryStats:
    """Counters kept by a responder. Every dropped datagram lands in exactly one."""

    requests: int = 0
    """Well-formed calls received."""
    answered: int = 0
    """Answers sent."""
    malformed: int = 0
    """Datagrams that failed to parse (wrong magic, version, kind, truncated, bad body, a
    CALL body longer than ``MAX_CALL_BODY``)."""
    oversize: int = 0
    """Answers withheld because they would be larger than the call (anti-amplification)."""
    other_game: int = 0
    """Calls filtered on a different game."""
    info_errors: int = 0
    """Calls left unanswered because the info callable raised or gave bad data."""
    send_errors: int = 0
    """Answers the kernel refused to send."""


def _check_info(info: object, game: str, instance_id: bytes) -> None:
    """Refuse at once an ``info`` no call could ever be answered with.

    A callable is called per call, so only its kind is checked: a coroutine function
    would give a coroutine, never awaited, instead of a mapping. A mapping is encoded
    once, as an answer, and walked for what a searcher's decoder refuses (a map key that
    is not a str, nesting deeper than ``MAX_DEPTH`` with the answer's own map).
    """
    if callable(info):
        if inspect.iscoroutinefunction(info) or inspect.iscoroutinefunction(type(info).__call__):
            raise TypeError(
                "info must be a mapping or a plain function returning one, not a coroutine"
                " function: it is called for each call, and nothing would await it"
            )
        return
    if not isinstance(info, Mapping):
        raise TypeError(
            f"info takes a mapping (a dict) or a function returning one,"
            f" not {type(info).__name__}: {info!r:.60}"
        )
    try:
        encode_answer(bytes(NONCE_SIZE), instance_id, game, info)
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack's, or the body's size
        error = TypeError if isinstance(exc, TypeError) else ValueError
        raise error(f"info cannot be sent: {exc}") from exc
    # Walked without unpacking (a searcher's decoder refuses these): the answer's map is
    # depth 1, so info is depth 2.
    stack: list[tuple[object, int]] = [(info, 2)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(
                f"info nests maps and lists {MAX_DEPTH - 1} levels deep at most (itself"
                " included): every searcher would drop the answer"
            )
        if isinstance(value, Mapping):
            for key in value:
                if not isinstance(key, str | bytes):
                    raise TypeError(
                        f"info's map keys must be str, not {type(key).__name__}: {key!r:.40}"
                        " (every searcher would drop the answer)"
                    )
            items: Iterable[object] = value.values()
        elif isinstance(value, list | tuple):
            items = value
        else:
            continue
        stack.extend((v, depth + 1) for v in items if isinstance(v, Mapping | list | tuple))


class Responder:
    """Answers discovery calls for one game with one host's info (sans-IO)."""

    def __init__(self, info: InfoSource, *, game: str, instance_id: bytes) -> None:
        check_game(game)
        if len(instance_id) != INSTANCE_ID_SIZE:
            raise ValueError(f"instance_id must be {INSTANCE_ID_SIZE} bytes")
        _check_info(info, game, instance_id)
        self.game = game
        """The game this responder answers for."""
        self.instance_id = instance_id
        """Random id sent in every answer, the same for the responder's lifetime."""
        self.stats = DiscoveryStats()
        self._info = info

    def __repr__(self) -> str:
        return f"<rudp.lan Responder game={self.game!r} instance={self.instance_id.hex()}>"

    def answer_for(self, data: bytes, addr: object = None) -> bytes | None:
        """The answer to send back for ``data``, or ``None`` (and a counter bumped).

        ``addr`` (where ``data`` came from) only appears in debug logs.
        """
        try:
            # Only "game" is read: a body longer than the longest honest one is
            # refused from its header, unparsed (64 KB of empty arrays cost 2,700x
            # the CPU of an honest call to unpack).
            packet = decode_packet(data, kind=Kind.CALL, max_body=MAX_CALL_BODY)
            wanted = call_game(packet.body)
        except MalformedDatagram as exc:
            self.stats.malformed += 1
            log.debug("call_malformed peer=%s reason=%r", log_address(addr), str(exc))
            return None
        self.stats.requests += 1
        if wanted is not None and wanted != self.game:
            self.stats.other_game += 1
            return None
        answer = self._encode_answer(packet.nonce)
        if answer is None:
            return None
        if len(answer) > len(data):
            self.stats.oversize += 1
            log.debug(
                "answer_oversize peer=%s answer_size=%d call_size=%d",
                log_address(addr),
                len(answer),
                len(data),
            )
            return None
        return answer

    def _encode_answer(self, nonce: bytes) -> bytes | None:
        try:
            info = self._info() if callable(self._info) else self._info
            return encode_answer(nonce, self.instance_id, self.game, info)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            # The info callable is user code; its failure must not kill the loop. A
            # CancelledError included (a cancelled future's result()): raised into the
            # transport's read callback, it would reach the loop's exception handler.
            self.stats.info_errors += 1
            log.exception("info_failed game=%r", self.game)
            return None
