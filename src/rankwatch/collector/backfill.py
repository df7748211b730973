"""Collectives no wrapper saw, recorded from torch's Flight Recorder by the writer thread.

A compiled graph (torch.compile) calls the c10d functional ops directly, so none of the collector's Python wrappers
runs for its collectives (`instrument.tracing`: they step aside while Dynamo traces), and C++ callers the collector
does not wrap issue collectives of their own. torch records every collective a process group enqueues in its
Flight Recorder (``TORCH_FR_BUFFER_SIZE`` > 0): per entry the group, ``collective_seq_id``, ``profiling_name``,
input sizes and dtypes, ``time_created_ns`` (wall clock at enqueue) and, on NCCL with
``TORCH_NCCL_ENABLE_TIMING``, ``duration_ms`` (torch/csrc/distributed/c10d/FlightRecorder.hpp, dump format 2.10).

At every flush the writer (`Backfill.rows`, never the training thread):

1. counts, per process group, the collectives the Flight Recorder enqueued since its last look (its ``pg_status``:
   a dump without entries, ~0.1 ms) against the operations the collector recorded on that group meanwhile
   (point-to-point left out: the Flight Recorder's collective count leaves them out too). Equal or fewer: nothing
   was missed, and the watermark moves on. This is the whole cost in a job whose collectives the wrappers see.
2. More: it reads the entries (the whole ring buffer, milliseconds at 2,000 entries) and takes those past the
   watermark. The collector's own operations own the entries they enqueued: a blocking call every entry enqueued on
   its group while it ran (the training thread issued nothing else meanwhile; one call may enqueue several:
   ``all_gather_object``; the C++ call the training thread is inside counts as one), an asynchronous operation
   (``async_op``, a functional collective; its interval runs to its wait) the first free entry enqueued after it
   entered, open or not. Every other entry is a collective nothing recorded, and becomes a row: status
   ``untimed``, entered at its enqueue time, its exit and host duration unknown (the Flight Recorder on gloo keeps
   no completion time), its device duration where the Flight Recorder measured one, its ``group_seq`` minus its
   ``collective_seq_id`` (negative: apart from the collector's own numbering, and the same on every member of the
   group), its step the one it was enqueued in.
3. Entries that left the ring buffer before they were read are counted (`Backfill.lost`), never guessed.

One entry per operation is assumed when counting: a call that enqueues several makes the count disagree and costs a
read of the entries, never a row. Times are compared on the wall clock, to within `_SLACK_NS`; a wall clock stepped
(not slewed) mid-step can give an entry to the wrong operation.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rankwatch.base.schema import CollectiveStatus, Collectives, Table, column_names
from rankwatch.collector import flight

__all__ = ["Backfill", "Interval", "op_name", "uncovered"]

Row = tuple[Any, ...]

_UNTIMED, _IN_FLIGHT = str(CollectiveStatus.UNTIMED), str(CollectiveStatus.IN_FLIGHT)

_COLUMNS = column_names(Table.COLLECTIVES)
_I_GROUP = _COLUMNS.index(Collectives.GROUP)
_I_OP = _COLUMNS.index(Collectives.OP)
_I_ENTER = _COLUMNS.index(Collectives.ENTER_WALL_NS)
_I_EXIT = _COLUMNS.index(Collectives.EXIT_WALL_NS)
_I_STATUS = _COLUMNS.index(Collectives.STATUS)
_I_ASYNC = _COLUMNS.index(Collectives.ASYNC_OP)
_P2P = frozenset({"send", "recv"})
_SLACK_NS = 5_000
"""Clock slack when placing an enqueue time inside an operation. The collector's wall times are monotonic times plus
the wall - monotonic offset taken at the step's start; the Flight Recorder's are the wall clock at enqueue. Linux
applies NTP's frequency and slew corrections to both clocks alike (clock_gettime(2): CLOCK_MONOTONIC "is affected
by the incremental adjustments performed by adjtime(3) and NTP"), so the offset moves only when the wall clock is
stepped; what is left is the two reads of the offset (~0.1 µs apart). A larger slack would give a blocking call
the compiled collective enqueued right after it returned."""

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool",
           "ComplexFloat": "complex64", "ComplexDouble": "complex128"}
"""c10 ScalarType names (the Flight Recorder's ``input_dtypes``) as torch.dtype names (the table's)."""


def op_name(profiling_name: str) -> str:
    """The table's operation name of a Flight Recorder ``profiling_name`` ("gloo:_allgather_base" -> "all_gather",
    "nccl:reduce_scatter_tensor_coalesced" -> "reduce_scatter"); an unknown one as torch names it, less the
    backend."""
    raw = profiling_name.split(":", 1)[-1]
    flat = raw.replace("_", "").lower()
    for key, name in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                      ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("barrier", "barrier")):
        if key in flat:
            return name
    return raw


@dataclass(frozen=True, slots=True)
class Interval:
    """One of the collector's own operations on a group, on the wall clock: [enter, exit] (exit None: still open)."""

    group: str
    enter_ns: int
    exit_ns: int | None
    asynchronous: bool = False
    """Issued with ``async_op`` (or a functional collective): its call returned at once and its interval runs to its
    wait, so it owns one entry, the first enqueued after it entered; a blocking call owns every entry enqueued while
    it ran (the training thread issued nothing else meanwhile; one call may enqueue several: ``all_gather_object``)."""


def uncovered(entries: Iterable[flight.Entry], intervals: Iterable[Interval], group_of: Callable[[str], str | None],
              slack_ns: int = _SLACK_NS) -> list[flight.Entry]:
    """The entries no operation of the collector owns (see `Interval.asynchronous`), in enqueue order; `group_of`
    names an entry's group as the table does (None: a group this rank's collector does not know, left out)."""
    blocking: dict[str, list[tuple[int, float]]] = {}
    waiting: dict[str, list[tuple[int, float]]] = {}
    for iv in intervals:
        span = (iv.enter_ns - slack_ns, math.inf if iv.exit_ns is None else iv.exit_ns + slack_ns)
        (waiting if iv.asynchronous else blocking).setdefault(iv.group, []).append(span)
    reach: dict[str, tuple[list[int], list[float]]] = {}
    for g, spans in blocking.items():
        spans.sort()
        starts, furthest = [], []
        top = -math.inf
        for a, b in spans:  # furthest[i]: the latest exit of the calls entered up to the i-th
            top = max(top, b)
            starts.append(a)
            furthest.append(top)
        reach[g] = (starts, furthest)
    by_group: dict[str, list[flight.Entry]] = {}
    for e in sorted(entries, key=lambda x: x.created_ns):
        named = group_of(e.group)
        if named is None:
            continue
        starts, furthest = reach.get(named, ([], []))
        i = bisect.bisect_right(starts, e.created_ns) - 1
        if i >= 0 and furthest[i] >= e.created_ns:
            continue
        by_group.setdefault(named, []).append(e)
    out: list[flight.Entry] = []
    for g, left in by_group.items():
        owned: set[int] = set()
        j = 0
        for a, b in sorted(waiting.get(g, ())):  # each asynchronous operation owns the first free entry after it
            while j < len(left) and left[j].created_ns < a:
                j += 1
            k = j
            while k < len(left) and (k in owned):
                k += 1
            if k < len(left) and left[k].created_ns <= b:
                owned.add(k)
        out += [e for k, e in enumerate(left) if k not in owned]
    return sorted(out, key=lambda x: x.created_ns)


class Backfill:
    """The writer's reader of collectives nothing recorded (see the module docstring). Not thread-safe except
    `note_loose`: `rows` runs on the writer thread only."""

    def __init__(self, *, rank: int, groups: Callable[[], dict[str, tuple[str, tuple[int, ...]]]],
                 pending: Callable[[], list[Interval]], ring: int = 2000, share: float = 0.005,
                 max_delay_s: float = 30.0, initial: flight.Dump | None = None,
                 status: Callable[[], dict[str, int]] = flight.status,
                 dump: Callable[[], flight.Dump | None] = flight.dump) -> None:
        """`groups`: c10d group name -> (the table's group name, its ranks), for this rank's groups. `pending`: the
        collector's operations entered and not yet written (open ones with exit None), read after a dump. `ring`:
        the Flight Recorder's entries (``TORCH_FR_BUFFER_SIZE``); `share`: the largest share of wall time spent
        reading them; `max_delay_s`: how long a collective nothing recorded may wait to be read; `initial`: a read
        at the start (the collector's, for its counts), which names the groups then in the ring and sets the
        watermarks (else the status at construction does)."""
        self._rank = rank
        self._ring = max(1, ring)
        self._share = share
        self._max_delay_ns = int(max_delay_s * 1e9)
        self.closing = False
        """Set before the process groups go: the next look reads whatever its cost (their entries go with them)."""
        self._gap_since: int | None = None
        """When a look first found more collectives than the collector recorded, until the read that settles it."""
        self._next_read = 0
        """Wall time before which the budget allows no read."""
        self.read_ns = 0
        """Wall time spent in reads (dump, parse, matching) so far."""
        self._groups_fn = groups
        self._groups: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._pending = pending
        self._status = status
        self._dump = dump
        self._ids: dict[str, str] = {} if initial is None else {e.pg_id: e.group for e in initial.entries}
        """Flight Recorder pg_id -> c10d group name (learned from entries, which carry both)."""
        self._mark: dict[str, int] = dict(status() if initial is None else initial.last)
        """pg_id -> the last collective_seq_id accounted for."""
        self._since = time.time_ns()
        """Wall time of the last look: operations entered after it have entries past the watermark."""
        self._history: list[Row] = []
        """Rows the collector wrote that may still own entries past the watermark (kept as the rows themselves:
        nothing is built per operation unless the buffer is read)."""
        self._loose: deque[Row] = deque()
        """Operations outside a step, written by the training thread as they exit (`note_loose`)."""
        self._steps: deque[tuple[int, int, int]] = deque(maxlen=4096)
        """(start wall, end wall, step) of recent finished steps, for the step of an entry."""
        self._held: list[flight.Entry] = []
        """Entries whose step is not known yet (see `rows`)."""
        self.lost = 0
        """Entries that left the ring buffer before they were read."""
        self.found = 0
        """Rows made from entries so far."""
        self.reads = 0
        """Reads of the whole ring buffer so far."""
        self._lock = threading.Lock()

    # -- what the collector wrote ------------------------------------------------------------------------
    def note_loose(self, row: Row) -> None:
        """A row of an operation outside a step, written as it exited (any thread)."""
        with self._lock:
            self._loose.append(row)

    def note(self, rows: list[Row], steps: Iterable[tuple[int, int, int]]) -> None:
        """The rows the writer is writing (operations of finished steps and exited ones of the step in progress)
        and the finished steps' (start wall, end wall, step)."""
        self._steps.extend(steps)
        self._history += rows
        with self._lock:
            loose, self._loose = list(self._loose), deque()
        self._history += loose

    def waiting(self, outstanding: Callable[[], dict[str, tuple[int, int]]] = flight.outstanding
                ) -> tuple[str, tuple[int, ...], int] | None:
        """(the table's group, its ranks, torch's collective_seq_id) of the first collective enqueued and not
        completed on a group the collector knows (one such group, where several have one), for the liveness record
        of a rank none of whose own operations is open: a compiled graph's collective it waits in, or an
        asynchronous one it waits on through torch. Any thread; never raises."""
        try:
            found = []
            for pg_id, (first, _) in outstanding().items():
                name = self._ids.get(pg_id)
                if name is None:
                    continue
                group = self._groups.get(name) or self._groups_fn().get(name)
                if group is not None:
                    found.append((first, group))
            if not found:
                return None
            first, (table_name, ranks) = min(found)
            return table_name, ranks, first
        except Exception:
            return None

    # -- the look at every flush ---------------------------------------------------------------------------
    def rows(self, current: tuple[int, int] | None, *, final: bool = False) -> list[Row]:
        """Rows of the collectives enqueued since the last look that nothing recorded; `current`: (step, start
        wall) of the step in progress, if any. An entry enqueued after the last finished step the writer knows of,
        and before the step in progress, waits for the next look, when that step's end is known (`final`: the last
        look; it is written outside a step). Never raises (a failure is one more look next time)."""
        try:
            found = self._rows(final or self.closing)
        except Exception:
            found = []
        held, self._held = self._held + found, []
        out = []
        for e in held:
            step = self._step_of(e.created_ns, current)
            if step is None and not final:
                self._held.append(e)
            else:
                out.append(self._row(e, -1 if step is None else step))
        self.found += len(out)
        return out

    def _intervals(self) -> list[Interval]:
        """The written operations kept, as intervals (point-to-point and in-flight snapshots left out)."""
        return [Interval(str(r[_I_GROUP]), int(r[_I_ENTER]), r[_I_EXIT], bool(r[_I_ASYNC])) for r in self._history
                if r[_I_OP] not in _P2P and r[_I_STATUS] != _IN_FLIGHT]

    def _ours_since(self, since: int) -> dict[str, int]:
        """Operations entered after `since`, per group: written ones and the pending ones."""
        counts: dict[str, int] = {}
        for r in self._history:
            if r[_I_ENTER] > since and r[_I_OP] not in _P2P and r[_I_STATUS] != _IN_FLIGHT:
                g = r[_I_GROUP]
                counts[g] = counts.get(g, 0) + 1
        for iv in self._pending():
            if iv.enter_ns > since:
                counts[iv.group] = counts.get(iv.group, 0) + 1
        return counts

    def _table_group(self, c10d: str) -> str | None:
        found = self._groups.get(c10d)
        if found is None:
            self._groups = self._groups_fn()
            found = self._groups.get(c10d)
        return None if found is None else found[0]

    def _rows(self, last_call: bool) -> list[flight.Entry]:
        ours = self._ours_since(self._since)  # before the status: an operation entered after it only adds a read
        status = self._status()
        looked = time.time_ns()  # after it: an operation entered between the two only adds a read next time
        if not status:
            return []
        if self._gap_since is None:
            if not self._missed(status, ours):
                self._mark.update(status)
                self._move_on(looked)
                return []
            self._gap_since = looked
        waiting = sum(max(0, last - self._mark.get(pg_id, 0)) for pg_id, last in status.items())
        due = last_call or waiting * 4 >= self._ring * 3 or looked - self._gap_since >= self._max_delay_ns
        if not due or (not last_call and looked < self._next_read):
            if len(self._history) > 2 * self._ring:  # older rows own entries the ring no longer holds
                del self._history[: len(self._history) - 2 * self._ring]
            return []
        started = time.perf_counter_ns()
        found = self._dump()
        looked = time.time_ns()
        if found is None:
            return []
        self.reads += 1
        pending = self._pending()  # after the dump: every entry in it was enqueued by an operation already entered
        for e in found.entries:
            self._ids.setdefault(e.pg_id, e.group)
        fresh = [e for e in found.entries if e.seq > self._mark.get(e.pg_id, 0)]
        for pg_id, last in found.last.items():
            mark = self._mark.get(pg_id, 0)
            have = {e.seq for e in fresh if e.pg_id == pg_id}
            self.lost += sum(1 for s in range(mark + 1, last + 1) if s not in have)
            self._mark[pg_id] = max(mark, last)
        out = uncovered(fresh, self._intervals() + pending, self._table_group)
        self._move_on(looked)
        self._gap_since = None
        cost = time.perf_counter_ns() - started
        self.read_ns += cost
        self._next_read = looked + int(cost / self._share)
        return out

    def _missed(self, status: dict[str, int], ours: dict[str, int]) -> bool:
        """More collectives enqueued on some group since the watermark than the collector recorded there (or on a
        group whose name no entry gave yet)."""
        for pg_id, last in status.items():
            new = last - self._mark.get(pg_id, 0)
            if new <= 0:
                continue
            name = self._ids.get(pg_id)
            group = None if name is None else self._table_group(name)
            if group is None or new > ours.get(group, 0):
                return True
        return False

    def _move_on(self, looked: int) -> None:
        """Forget the operations that ended before the last look (entries past the watermark came after it)."""
        self._since = looked
        edge = looked - _SLACK_NS
        self._history = [r for r in self._history if r[_I_EXIT] is None or r[_I_EXIT] >= edge]

    def _step_of(self, wall: int, current: tuple[int, int] | None) -> int | None:
        """The step `wall` lies in: the one in progress, a finished one, -1 between two finished ones; None after
        the last finished one and before the step in progress (a step that ended after the writer took the finished
        ones may hold it)."""
        if current is not None and wall >= current[1]:
            return current[0]
        latest = True
        for start, end, step in reversed(self._steps):
            if start <= wall <= end:
                return step
            if end < wall:
                if not latest:
                    return -1  # between two finished steps
                return -1 if current is not None and step + 1 == current[0] else None
            latest = False
        return None if latest else -1  # before every finished step the writer knows of: outside a step

    def _row(self, e: flight.Entry, step: int) -> Row:
        name, ranks = self._groups.get(e.group, (e.group, ()))
        enter_mono = e.created_ns - (time.time_ns() - time.monotonic_ns())
        return (self._rank, step, -1, -e.seq, op_name(e.op), name, ranks, None,
                e.nbytes, _DTYPES.get(e.dtype, e.dtype.lower()), False, e.created_ns, enter_mono, None, None, None,
                e.device_ns, None, _UNTIMED, None)
