"""Exceptions. Every one of them derives from :class:`RudpError`.

As in h11, a caller's misuse raises :class:`LocalProtocolError` at once; what a
peer does wrong is never raised into the event loop: the datagram is dropped and
counted, or the connection ends with reason "protocol error".
"""

from __future__ import annotations

import numbers


class RudpError(Exception):
    """Base class of every rudp exception."""


class LocalProtocolError(RudpError):
    """The caller used the API wrongly (bad argument, wrong state)."""


class EndpointClosed(LocalProtocolError):
    """The endpoint (its socket) is closed: nothing can be sent or connected from it."""


class MessageTooLarge(LocalProtocolError, ValueError):
    """The message does not fit in one datagram."""


class SendQueueFull(RudpError):
    """``send()`` was called while the send queue is at ``Config.send_queue_limit``.

    Await ``drain()`` before sending more; rudp never drops a message silently.
    """


class ConnectionClosed(RudpError):
    """The connection has ended; ``reason`` says why (see ``rudp.DisconnectReason``)."""

    def __init__(self, reason: str, code: int = 0, text: str = "") -> None:
        self.reason = reason
        self.code = code
        self.text = text
        detail = f" (code {code}: {text})" if code or text else ""
        super().__init__(f"connection closed: {reason}{detail}")


class ConnectError(RudpError):
    """``connect()`` did not establish a connection."""


class ConnectRefused(ConnectError):
    """The server answered and refused the connection; ``reason`` says why.

    ``address`` is the server's ``(host, port)`` when the raiser knows it.
    """

    def __init__(self, reason: str, address: tuple[str, int] | None = None) -> None:
        self.reason = reason
        self.address = address
        where = f" by {format_address(address)}" if address is not None else ""
        super().__init__(f"connection refused{where}: {reason}")


class ConnectTimeout(ConnectError, TimeoutError):
    """No answer from the server within ``Config.connect_timeout``.

    ``address`` is the server's ``(host, port)`` and ``timeout`` the seconds waited,
    when the raiser knows them; the message names both. A message given as the first
    argument is kept as it is.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        address: tuple[str, int] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        if message is None:
            where = f" from {format_address(address)}" if address is not None else ""
            within = f" within {timeout:g} s" if timeout is not None else ""
            message = f"no answer{where}{within} (Config.connect_timeout)"
        super().__init__(message)


def check_sequence(value: object, name: str) -> None:
    """Refuse a lone ``str`` or ``bytes`` where a sequence of items belongs.

    Both are iterable, so without this ``"ctf"`` would silently become the items
    ``'c'``, ``'t'``, ``'f'``. Raises TypeError naming the parameter and the fix.
    """
    if isinstance(value, str | bytes | bytearray | memoryview):
        raise TypeError(
            f"{name} takes a sequence (a list or tuple), not {type(value).__name__}: "
            f"write [{value!r}]"
        )


def check_now(value: object, name: str = "now") -> float:
    """A clock reading as a ``float``: an ``int`` is taken as one; anything else
    (``time.monotonic`` itself, a str, ``True``) is a TypeError here, not at a later
    flush that the stored value would break for every connection of the endpoint."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} takes a float (a time.monotonic() reading), not {value!r}")
    return float(value)


def as_bytes(value: object, name: str) -> bytes:
    """``value`` (``bytes``, ``bytearray`` or ``memoryview``) as ``bytes``, measured by
    its bytes (a memoryview's ``len()`` counts its items); a TypeError naming ``name``
    for anything else (``bytes(40)`` would be forty zero bytes)."""
    if type(value) is bytes:
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{name} must be bytes-like, not {type(value).__name__}")


def check_address(value: object, name: str) -> None:
    """Refuse anything but a ``(host, port)`` pair (or a longer IPv6 socket address)
    where an address belongs: ``"1.2.3.4:27960"`` is a TypeError naming the fix."""
    if isinstance(value, tuple | list) and len(value) >= 2 and isinstance(value[0], str):
        return
    raise TypeError(f"{name} takes a (host, port) tuple, not {value!r}: write ('1.2.3.4', 27960)")


def check_port(value: object, name: str = "port") -> int:
    """A port number as an ``int`` in 0..65535: anything else (``"9000"``, ``9000.0``,
    ``True``) is a TypeError naming the parameter, not a failed comparison deep inside,
    and a number outside 0..65535 a ValueError naming it (``getaddrinfo`` and the
    socket calls would take 74536 modulo 65536, as port 9000). Port 0 passes: a
    caller for whom it means nothing (a destination) refuses it itself."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            hint = f": write {int(value)}" if isinstance(value, str) and value.isdigit() else ""
            raise TypeError(f"{name} takes an int, not {value!r}{hint}")
        value = int(value)
    if not 0 <= value <= 0xFFFF:
        raise ValueError(f"{name} must be in 0..65535, got {value}")
    return value


def format_address(address: tuple[str, int]) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:27950``)."""
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
