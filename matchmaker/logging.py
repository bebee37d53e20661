"""Logging configuration, in one place: structlog for the daemon, one stderr handler.

Log events are structured key/values named in snake case (``host_registered``,
``host_removed``, ``request_rejected``...), one event per registration,
removal and error.  Per-connection context (peer address, connection id) is
set in `CONNECTION`, a context variable, in the connection's own task, so every
line a connection causes carries it without passing loggers around (one
variable set per connection: structlog's ``bind_contextvars`` costs several
times as much, paid by every registration).

Everything goes through the standard library's root logger and one stderr
handler whose formatter is structlog's ``ProcessorFormatter``: the daemon's own
structlog events, and every other record (rudp's, asyncio's "Task exception
was never retrieved", ``warnings`` through ``logging.captureWarnings``) alike.
So in JSON mode every line on stderr is one JSON object.  rudp writes its
events as ``"event_name key=%s key=%r"`` with the values as arguments (see
the "Logging" section of docs/api.md); `rudp_fields` turns such a record back
into ``event`` plus one field per key, so they read like the daemon's own.

JSON lines when stderr is not a terminal (what log shippers want), a
human-readable console format on a TTY, unless forced with ``--log-format``.
"""

from __future__ import annotations

import logging
import re
import sys
from contextvars import ContextVar
from typing import TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR

# "event_name key=%s key=%r ...": the convention of rudp's log calls.
_EVENT_TEMPLATE = re.compile(r"[a-z][a-z0-9_]*(?: [a-z][a-z0-9_]*=%[sdr])*")
_JSON_SCALARS = (str, int, float, bool, type(None))

_handler: logging.Handler | None = None  # the one installed by configure()

CONNECTION: ContextVar[tuple[str, int] | None] = ContextVar("matchmaker_connection", default=None)
"""The connection whose task logs: its peer's address and its number (``peer``,
``conn`` in each line, see `merge_connection`)."""


def merge_connection(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """Add ``peer`` and ``conn`` of the connection being served, if any (`CONNECTION`)."""
    connection = CONNECTION.get()
    if connection is not None:
        event_dict.setdefault("peer", connection[0])
        event_dict.setdefault("conn", connection[1])
    return event_dict


def rudp_fields(logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """A stdlib record written ``"event_name key=%s ..."`` becomes ``event`` plus fields.

    Any other record keeps its formatted message as ``event``.  (A processor for
    ``ProcessorFormatter(pass_foreign_args=True)``: it reads ``positional_args``.)
    """
    args = event_dict.pop("positional_args", ())
    record = event_dict.get("_record")
    template = record.msg if record is not None else None
    if not isinstance(template, str) or not isinstance(args, tuple):
        return event_dict
    if _EVENT_TEMPLATE.fullmatch(template) is None or template.count("=") != len(args):
        return event_dict
    name, *pairs = template.split(" ")
    event_dict["event"] = name
    for pair, value in zip(pairs, args, strict=True):
        key = pair.partition("=")[0]
        event_dict[key] = value if isinstance(value, _JSON_SCALARS) else str(value)
    return event_dict


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configure structlog and the root logger: one handler on ``stream`` (stderr)."""
    global _handler
    out = stream if stream is not None else sys.stderr
    console = fmt == "console" or (fmt == "auto" and out.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        merge_connection,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if console:
        final.append(structlog.dev.ConsoleRenderer())
    else:
        final += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, rudp_fields],
            processors=final,
            pass_foreign_args=True,
        )
    )
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)  # configured again (tests): one handler still
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    _handler = handler
    logging.captureWarnings(True)
