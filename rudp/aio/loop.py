"""Event-loop selection: uvloop where installed, unless the user opts out."""

from __future__ import annotations

import asyncio
import os


def uvloop_wanted(use_uvloop: bool | None = None) -> bool:
    if use_uvloop is not None:
        return use_uvloop
    return os.environ.get("RUDP_NO_UVLOOP", "") in ("", "0")


def new_event_loop(use_uvloop: bool | None = None) -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when wanted and importable, else asyncio's default."""
    if uvloop_wanted(use_uvloop):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()
