"""Parity across packets: REPAIR frames that rebuild a lost packet, sized to the loss.

Theory of operation
-------------------
A thin stream of small reliable messages on a lossy path (a game's inputs, say)
wants each loss repaired within a few milliseconds, not a round trip later. Whole
copies of every message (``Config.redundancy``) do that for ``1 + n`` times the
payload; parity does it for a fraction: every ``k``-th packet of the stream also
carries a REPAIR frame, a linear combination of the packets sent just before it,
from which the receiver rebuilds any one of them it is missing (two REPAIR frames
rebuild two, and so on).

- **Sources.** A packet's *symbol* is its opened body up to its first tail frame
  (REPAIR, ACK_DELAY, RECOVERED): its acknowledgment fields and its other frames.
  As a number, ``x = int.from_bytes(b"\\x01" + symbol, "big")`` (the leading 1 keeps
  its length).
- **REPAIR** (``frames.repair_frame``) names up to ``COVER_MAX`` of the 32 packets
  before the one carrying it (a bit mask) and an exponent ``e``, and carries
  ``sum(c(n, e) * x_n)`` over them with ``c(n, e) = ((n mod 64) + 1) ** e``: the
  exponent cycles 0, 1, 2, 3 from one REPAIR to the next. Integer arithmetic, not
  a finite field: Python's integers do it at C speed, the sum is 3 bytes longer
  than the longest symbol, and any ``m`` REPAIRs of distinct exponents over the
  same ``m`` missing packets form a (generalized) Vandermonde system with distinct
  positive nodes, which is never singular.
- **Sizing** (``interval``): none below ``MIN_LOSS`` of measured loss, so a clean
  path pays nothing; above it one REPAIR per ``k`` packets, ``k = TARGET / loss``
  clamped to ``[K_MIN, K_MAX]`` (4 at 5 % loss, about 1.3 copies' worth of bytes
  per 4 messages), each covering the last ``3 k`` packets (at most 32), so that
  a packet is in about three REPAIRs. A REPAIR only rides in a packet that goes
  out anyway, with room for it, while the send queue is empty (a thin stream): a
  bulk transfer's packets are full and pay nothing.
- **Receiving.** The receiver keeps the symbols of the peer's last ``KEEP``
  packets (only on a connection where both sides stated parity). Each REPAIR becomes
  an equation in the packets it covers that are missing; one missing packet is
  solved at once (an exact division), two or more by elimination once as many
  equations cover them. A rebuilt packet is processed as if it had arrived: it
  is marked in the replay window (the original, should it come late, is dropped
  as a replay), acknowledged like any other, its messages delivered.
- **Cost.** What a peer's REPAIRs cost is bounded whatever they say: an exponent
  of ``EXPONENTS`` or more, which no sender uses, is refused; at most
  ``PENDING_MAX`` equations wait (a new one drops the oldest), and each only
  until its carrier is ``KEEP`` packets behind the newest; elimination runs only
  when an equation came or lost an unknown, divides every row by the gcd of its
  factors (its numbers stay the size of the system's minors, as in Bareiss's
  fraction-free elimination, instead of doubling at each pivot), and is paid for
  by the peer's packets (``STEP_CREDIT`` row merges each, ``CREDIT_MAX`` saved):
  a system that costs more waits for the packets that pay for it.
- **Feedback.** A rebuilt packet is acknowledged, so the sender's loss detection
  never sees it lost; the sender's loss rate, which sizes parity, would fall and
  turn parity off. The receiver therefore reports how many packets it rebuilt, a
  running 16-bit total in a RECOVERED frame on its next packet, and the sender
  counts each as a loss in its average (``PacketRecovery.on_recovered``).

The receiver checks nothing it rebuilt beyond what the peer could have sent it
directly: an equation the arithmetic refutes (a division with a remainder, a
symbol out of range) is dropped and counted (``repairs_unusable``; equations that
refute one another are dropped together, counted once, as is a REPAIR of an
exponent out of range), and a rebuilt body that does not decode is dropped under
``malformed`` like any packet.

Judgement calls: REPAIR protects *packets*, not messages, so a rebuilt packet
is one the receiver really has, and what it means (acknowledgments, flow frames,
messages of every mode) is decided by the same code as for any other. Both
halves live in one object per connection: one side's encoder and decoder share
nothing but the constants, and a connection sends and receives.
"""

from __future__ import annotations

from collections import deque
from math import gcd
from typing import TYPE_CHECKING, Final

from rudp import frames
from rudp.state import CLOSED
from rudp.wire import ACK_SIZE, DATA_HEADER_SIZE, DecodeError, DropReason

if TYPE_CHECKING:
    from rudp.packet_reader import PacketReader
    from rudp.protection import Opener, ReplayWindow
    from rudp.recovery import PacketRecovery
    from rudp.stats import ConnectionStats

SPAN: Final = 32  # a REPAIR's mask names packets among the 32 before its own
COVER_MAX: Final = 32
MIN_LOSS: Final = 0.005  # below this measured loss rate no REPAIR goes at all...
STOP_LOSS: Final = 0.001  # ...unless parity is on already: it stops below this one
TARGET: Final = 0.2  # expected losses between two REPAIRs (k = TARGET / loss)
K_MIN: Final = 2
K_MAX: Final = 8
EXPONENTS: Final = 4  # a REPAIR's exponent cycles 0..EXPONENTS-1
CONFIRM: Final = 64  # a rebuilt packet's original is taken as lost this many packets on
KEEP: Final = 96  # symbols and equations kept, in packet numbers behind the newest
SOLVE_MAX: Final = 24  # most unknowns the pending equations may hold for elimination
PENDING_MAX: Final = 16  # most equations pending: a new one beyond it drops the oldest
# Elimination is paid for by the peer's packets: each adds STEP_CREDIT steps (a step
# merges two rows), saved up to CREDIT_MAX, twice the largest elimination (PENDING_MAX
# - 1 rows updated at each of PENDING_MAX pivots); a step over values longer than
# STEP_BITS counts once more per STEP_BITS.
STEP_CREDIT: Final = 8
CREDIT_MAX: Final = 512
STEP_BITS: Final = 1 << 14
# What a rebuilt packet counts as on the wire (its body is the ack fields and frames).
REBUILT_OVERHEAD: Final = DATA_HEADER_SIZE - ACK_SIZE


def coefficient(pn: int, exponent: int) -> int:
    """The factor of packet ``pn``'s symbol in a REPAIR of ``exponent``."""
    factor: int = ((pn & 63) + 1) ** exponent  # an int: the exponent is never negative
    return factor


def to_symbol(body: bytes) -> int:
    return int.from_bytes(b"\x01" + body, "big")


def from_symbol(x: int) -> bytes | None:
    """The body a rebuilt symbol stands for, or None if it is none."""
    size = (x.bit_length() + 7) // 8
    if x <= 0:
        return None
    raw = x.to_bytes(size, "big")
    return raw[1:] if raw[0] == 1 else None


class Parity:
    """Both halves of parity for one connection: the REPAIRs it sends and the
    packets it rebuilds from the peer's."""

    __slots__ = (
        "_exponent",
        "_k",
        "_recovery",
        "_stats",
        "changed",
        "credit",
        "equations",
        "known",
        "newest",
        "peer_total",
        "rebuilt",
        "recovered_total",
        "reported",
        "since",
        "sources",
        "steps",
        "unconfirmed",
    )

    def __init__(self, recovery: PacketRecovery, stats: ConnectionStats) -> None:
        self._recovery = recovery
        self._stats = stats
        # -- sending
        self.sources: deque[tuple[int, int]] = deque()  # (pn, symbol) of our recent packets
        self.since = 0  # source packets since our last REPAIR
        self._exponent = 0
        self._k = 0  # the interval in use (see interval)
        self.peer_total = 0  # the peer's last RECOVERED total
        # -- receiving
        self.known: dict[int, int] = {}  # pn -> symbol, the peer's recent packets
        # Pending equations: [carrier pn, {missing pn: coefficient}, value].
        self.equations: list[tuple[int, dict[int, int], list[int]]] = []
        self.changed = False  # an equation came or lost an unknown since the last solve
        self.newest = -1  # the newest packet number of the peer's seen here
        self.credit = CREDIT_MAX  # elimination steps we may still take (see STEP_CREDIT)
        self.steps = 0  # elimination steps taken in all
        self.rebuilt: deque[tuple[int, bytes]] = deque()  # (pn, body) to process
        # Rebuilt packets whose original may still come (reordering): counted as lost,
        # and reported, only once CONFIRM packets later ones arrived without it.
        self.unconfirmed: dict[int, None] = {}
        self.recovered_total = 0  # packets rebuilt (what RECOVERED reports, mod 2**16)
        self.reported = 0  # the total our last RECOVERED frame carried

    # -- sending --------------------------------------------------------------------

    def interval(self) -> int:
        """Packets per REPAIR at the measured loss rate (0: none), with hysteresis:
        parity starts at ``MIN_LOSS`` and stops only below ``STOP_LOSS``. A path that
        loses 1 % has runs of a few hundred packets without a loss, which bring the
        average below 0.5 %; stopping there would leave the next loss to a resend,
        and a REPAIR only repairs losses after it started."""
        rate = self._recovery.loss_rate
        if rate < MIN_LOSS and not (self._k and rate >= STOP_LOSS):
            self._k = 0
            return 0
        self._k = k = max(K_MIN, min(K_MAX, round(TARGET / max(rate, MIN_LOSS))))
        return k

    def on_build(self, seq: int, parts: list[bytes], protected: int, budget: int) -> None:
        """Packet ``seq`` of a thin stream is being built from ``parts``, of which the
        first ``protected`` form its symbol: add a REPAIR at that index if one is due
        and fits ``budget``, then remember the symbol."""
        k = self.interval()
        sources = self.sources
        if not k:
            if sources:
                sources.clear()
                self.since = 0
            return
        while sources and seq - sources[0][0] > SPAN:
            sources.popleft()
        if self.since >= k and sources:
            frame = self._repair(seq, COVER_MAX)
            if len(frame) <= budget:
                parts.insert(protected, frame)
                self.since = 0
                self._stats.repairs_sent += 1
        sources.append((seq, to_symbol(b"".join(parts[:protected]))))
        self.since += 1

    def _repair(self, seq: int, cover: int) -> bytes:
        exponent = self._exponent
        self._exponent = (exponent + 1) % EXPONENTS
        mask = 0
        value = 0
        for n, (pn, x) in enumerate(reversed(self.sources)):
            if n >= cover:
                break
            mask |= 1 << (seq - 1 - pn)
            value += coefficient(pn, exponent) * x
        return frames.repair_frame(mask, exponent, value.to_bytes((value.bit_length() + 7) // 8))

    def on_report(self, total: int) -> None:
        """The peer's RECOVERED frame: it rebuilt ``total`` (mod 2**16) of our packets
        in all. Each new one is a loss for the rate that sizes parity."""
        delta = (total - self.peer_total) & 0xFFFF
        if 0 < delta < 0x8000:
            self.peer_total = total
            self._recovery.on_recovered(delta)

    # -- receiving ------------------------------------------------------------------

    def report(self) -> bytes:
        """A RECOVERED frame if we rebuilt packets since the last one went, else b""."""
        total = self.recovered_total & 0xFFFF
        if total == self.reported:
            return b""
        self.reported = total
        return frames.recovered_frame(total)

    def arrived_late(self, pn: int) -> bool:
        """Whether ``pn``, refused as already received, is the original of a packet we
        rebuilt (then it was not lost, only late)."""
        if pn in self.unconfirmed:
            del self.unconfirmed[pn]
            return True
        return False

    @property
    def report_due(self) -> bool:
        return (self.recovered_total & 0xFFFF) != self.reported

    def on_packet(
        self,
        seq: int,
        body: bytes,
        tail: int,
        repair: tuple[int, int, bytes] | None,
        window: ReplayWindow,
    ) -> None:
        """The peer's packet ``seq`` (opened ``body``, symbol up to ``tail``) arrived or
        was rebuilt; ``repair`` is its REPAIR frame's (mask, exponent, data)."""
        self.credit = min(CREDIT_MAX, self.credit + STEP_CREDIT)
        unconfirmed = self.unconfirmed
        while unconfirmed:
            first = next(iter(unconfirmed))
            if seq - first < CONFIRM:
                break
            del unconfirmed[first]
            self.recovered_total += 1  # its original never came: it was lost
        known = self.known
        x = to_symbol(body[:tail])
        known[seq] = x
        if len(known) > KEEP:
            del known[next(iter(known))]
        if self.equations:
            for _, missing, value in self.equations:
                c = missing.pop(seq, 0)
                if c:
                    value[0] -= c * x
                    self.changed = True
        if repair is not None:
            self._add_equation(seq, repair, window)
        if seq > self.newest:
            self.newest = seq
            self._forget(seq)
        if self.changed:
            self._solve()

    def _add_equation(self, seq: int, repair: tuple[int, int, bytes], window: ReplayWindow) -> None:
        mask, exponent, data = repair
        if exponent >= EXPONENTS:
            # No sender uses it, and its factors (up to 64 ** 255) would make every
            # later elimination over it costly: refused, like a refuted equation.
            self._stats.repairs_unusable += 1
            return
        value = int.from_bytes(data, "big")
        known = self.known
        missing: dict[int, int] = {}
        i = 0
        while mask:
            if mask & 1:
                pn = seq - 1 - i
                c = coefficient(pn, exponent)
                x = known.get(pn)
                if x is not None:
                    value -= c * x
                elif window.seen(pn):
                    return  # arrived before we kept symbols: this equation is no use
                else:
                    missing[pn] = c
            mask >>= 1
            i += 1
        if missing:
            equations = self.equations
            if len(equations) >= PENDING_MAX:
                del equations[0]  # the oldest: the least likely to complete
            equations.append((seq, missing, [value]))
            self.changed = True

    def _forget(self, newest: int) -> None:
        low = newest - KEEP
        known = self.known
        while known:
            first = next(iter(known))
            if first >= low:
                break
            del known[first]
        self.equations = [e for e in self.equations if e[0] >= low and e[1]]

    def _solve(self) -> None:
        """Rebuild what the pending equations determine: single unknowns at once, then
        small systems by elimination, once (it finds every unknown they determine,
        and a rebuilt packet determines no other one)."""
        self.changed = False
        self.equations = [e for e in self.equations if e[1]]
        eliminated = False
        progress = True
        while progress and self.equations:
            progress = False
            for eq in self.equations:
                missing = eq[1]
                if len(missing) == 1:
                    ((pn, c),) = missing.items()
                    value = eq[2][0]
                    self.equations.remove(eq)
                    if value % c:
                        self._stats.repairs_unusable += 1
                    else:
                        self._rebuilt(pn, value // c)
                    progress = True
                    break
            if not progress and not eliminated:
                eliminated = True
                progress = self._eliminate()

    def _eliminate(self) -> bool:
        """Gauss-Jordan elimination over the pending equations, newest unknowns first
        (those are mostly packets still on their way), in integers: each step scales a
        row instead of dividing, then divides it by the gcd of its factors, so that
        every number stays within the size of a minor of the pending equations (a
        determinant of at most ``PENDING_MAX`` rows of factors up to ``64 ** 3``), as
        in fraction-free (Bareiss) elimination. Rebuilds every unknown some row ends
        up holding alone: the reduced form isolates every unknown the equations
        determine. The equations stay as they came (less what got rebuilt): the rest
        wait for more equations or for their packets."""
        eqs = self.equations
        if len(eqs) < 2:
            return False
        unknown: dict[int, None] = {}
        for _, missing, _ in eqs:
            unknown.update(dict.fromkeys(missing))
        n = len(unknown)
        if n > SOLVE_MAX:
            return False
        values = [value[0] for _, _, value in eqs]
        # Its cost in steps, at most: each pivot updates every other row once.
        unit = 1 + max(abs(value).bit_length() for value in values) // STEP_BITS
        cost = (len(eqs) - 1) * min(len(eqs), n) * unit
        if cost > CREDIT_MAX:
            return False  # too costly for any credit (long values): their packets must come
        if cost > self.credit:
            self.changed = True  # tried again once the peer's packets paid for it
            return False
        credit = self.credit
        cols = sorted(unknown, reverse=True)  # column j is packet cols[j]
        index = {pn: j for j, pn in enumerate(cols)}
        rows: list[list[int]] = []
        for _, missing, _ in eqs:
            row = [0] * n
            for pn, c in missing.items():
                row[index[pn]] = c
            rows.append(row)
        weight = [len(missing) for _, missing, _ in eqs]  # unknowns left in each row
        used = [False] * len(rows)
        for j in range(n):
            pivot = -1
            for r, row in enumerate(rows):
                if not used[r] and row[j] and (pivot < 0 or weight[r] < weight[pivot]):
                    pivot = r
            if pivot < 0:
                continue
            used[pivot] = True
            head = rows[pivot]
            head_value = values[pivot]
            hc = head[j]
            for r, row in enumerate(rows):
                c = row[j]
                if r == pivot or not c:
                    continue
                credit -= unit
                row = [a * hc - h * c for a, h in zip(row, head, strict=True)]
                value = values[r] * hc - head_value * c
                g = gcd(*row)
                if g > 1:
                    value, rest = divmod(value, g)
                    if rest:  # no integer symbols satisfy it
                        self.steps += self.credit - credit
                        self.credit = credit
                        return self._refuted()
                    row = [a // g for a in row]
                rows[r] = row
                values[r] = value
                weight[r] = n - row.count(0)
        self.steps += self.credit - credit
        self.credit = credit
        solved = False
        for r, row in enumerate(rows):
            if weight[r] != 1:
                continue
            solved = True
            j = next(j for j, c in enumerate(row) if c)
            pn, c, value = cols[j], row[j], values[r]
            if pn in self.known:
                continue
            if value % c:
                return self._refuted()
            if not self._rebuilt(pn, value // c):
                self.equations = []
                return True
        if solved:
            self.equations = [e for e in self.equations if e[1]]
        return solved

    def _refuted(self) -> bool:
        """The pending equations contradict each other (one at least is false, which
        cannot be told): all dropped, counted once."""
        self._stats.repairs_unusable += 1
        self.equations = []
        return True

    def _rebuilt(self, pn: int, x: int) -> bool:
        body = from_symbol(x)
        if body is None or len(body) < ACK_SIZE:
            self._stats.repairs_unusable += 1
            return False
        self.known[pn] = x
        for _, missing, value in self.equations:
            c = missing.pop(pn, 0)
            if c:
                value[0] -= c * x
        self.rebuilt.append((pn, body))
        return True

    def clear(self) -> None:
        self.sources.clear()
        self.known.clear()
        self.equations.clear()
        self.changed = False
        self.rebuilt.clear()
        self.unconfirmed.clear()


def process_rebuilt(reader: PacketReader, parity: Parity, opener: Opener, now: float) -> None:
    """Process the packets ``parity`` rebuilt as if they had arrived (after the packet
    that completed them): marked in the replay window, so that a late original is
    dropped as a replay, then read by the same code as any packet."""
    stats = parity._stats
    rebuilt = parity.rebuilt
    while rebuilt:
        pn, body = rebuilt.popleft()
        if reader._conn.state is CLOSED:
            continue  # that packet ended the connection: nothing more to read
        if opener.window.seen(pn):
            continue  # it arrived after all, or is too old to take
        opener.window.accept(pn)
        stats.packets_recovered += 1
        parity.unconfirmed[pn] = None
        ack = (body[0] << 8) | body[1]
        bits = int.from_bytes(body[2:6], "big")
        try:
            reason = reader.process(body, pn, ack, bits, now, len(body) + REBUILT_OVERHEAD)
        except DecodeError:
            reason = DropReason.MALFORMED
        if reason is not None:
            stats.packets_dropped += 1
            stats.repairs_unusable += 1
