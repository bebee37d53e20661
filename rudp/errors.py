"""Exceptions. Every one of them derives from :class:`RudpError`.

As in h11, a caller's misuse raises :class:`LocalProtocolError` at once; what a
peer does wrong is never raised into the event loop: the datagram is dropped and
counted, or the connection ends with reason "protocol error".
"""

from __future__ import annotations


class RudpError(Exception):
    """Base class of every rudp exception."""


class LocalProtocolError(RudpError):
    """The caller used the API wrongly (bad argument, wrong state)."""


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
    """The server answered and refused the connection; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"connection refused: {reason}")


class ConnectTimeout(ConnectError, TimeoutError):
    """No answer from the server within ``Config.connect_timeout``."""
