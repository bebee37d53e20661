"""The cyclic garbage collector, set for a daemon holding a large, long-lived registry.

CPython's defaults (a young collection every 700 net allocations, a full one
after 10 of the middle generation) suit short scripts.  A matchmaker holds
every registered host for hours, and a full collection traverses all of them:
at 100,000 hosts that was a pause of hundreds of milliseconds, taken by
whichever list request was running.  Two changes, made once at start-up:

* `gc.freeze` moves everything allocated while starting (modules, settings,
  sockets) to a generation no collection traverses again;
* higher thresholds make young collections rarer and full ones much rarer.
  Plain reference counting frees the registry's records (they hold no
  cycles), so collections only find the rare cyclic garbage (an exception
  with its traceback, a closed connection's callbacks) a little later.

The heartbeat path allocates nothing (`registry.HostRecord.last_seen` moves in
place), so what survives into the old generation is only real change:
registrations and updates.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (5_000, 10, 100)
"""Young, middle and old generation thresholds (CPython's default: 700, 10, 10).

Measured at 100,000 hosts (docs/performance.md, "Matchmaker lists from an
index"): a young collection every 5,000 net allocations pauses up to ~4 ms, a
middle one ~30 ms; 50,000 made young pauses ~40 ms for no gain.  A full
collection (~0.3-0.5 s there: it traces every host) is considered only every
100 middle ones, and CPython still waits until a quarter of the old
generation is new since the last one."""


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Collect once, freeze what exists, and raise the thresholds (call after start-up)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
