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

The memory registry keeps each host as a row the collector does not track
(`registry.memory`, "What a listed host costs the garbage collector"), so no
collection traces the fleet: a full one at 100,000 hosts walks ~300,000
pointers (~25 ms), not ~300,000 objects (~0.25-0.4 s). That is also why the
heap is not frozen again after a registration storm: the rows need no
freezing, and whatever else lived at that moment (a connection mid-handshake,
its tasks) would, once it became cyclic garbage, never be collected.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (5_000, 10, 100)
"""Young, middle and old generation thresholds (CPython's default: 700, 10, 10).

Measured at 100,000 hosts (docs/performance.md, "Matchmaker lists from an
index"): a young collection every 5,000 net allocations pauses up to ~4 ms, a
middle one ~30 ms; 50,000 made young pauses ~40 ms for no gain.  A full
collection (~25 ms there since the registry's rows are untracked; it traced
every host before, 0.2-0.5 s) is considered only every 100 middle ones, and
CPython still waits until a quarter of the old generation is new since the
last one."""


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Collect once, freeze what exists, and raise the thresholds (call after start-up)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
