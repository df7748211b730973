"""Where telemetry rows go: a `Sink` interface, a parquet implementation and an in-memory fake.

The training thread calls `Sink.append`, which never blocks on I/O and never raises: rows land in bounded
per-table buffers that a background thread turns into parquet part files. A part file is written under a
hidden temporary name and renamed into place, so a reader (or a post-mortem after SIGKILL) only ever sees
complete files. When the writer falls behind, new rows of a full buffer are dropped and counted — low
priority tables (GPU samples, phases) have smaller buffers, so they are dropped first.

A write that fails (a full disk: ENOSPC) removes its temporary file, puts its rows back in front of their buffer
(as far as the bound allows; the rest are dropped and counted) and is retried at every flush, so the rows land once
space frees. Evidence tables are written before low-priority ones, each table's part on its own, and a part that
does not fit is halved (oldest rows first) until what fits is written. `close` keeps retrying for `SinkConfig.close_retry_s`; rows it still cannot write are counted as dropped
and named in a warning on stderr, the one record left when not even the events table can be written.
"""

from __future__ import annotations

import errno
import functools
import logging
import re
import threading
import time
from collections import deque
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.rundir import TELEMETRY_DIR, atomic_write
from rankwatch.base.schema import LOW_PRIORITY, PARTITION_KEY, Table, storage_schema

log = logging.getLogger("rankwatch.collector")

Row = tuple[object, ...]
#: Rows describing state at write time (e.g. collectives still in flight), asked for at every flush.
SnapshotFn = Callable[[], Iterable[tuple[Table, Row]]]
#: Rows whose building was left to the writer (e.g. finished steps'), per table, taken once each at every flush.
SourceFn = Callable[[], Mapping[Table, list[Row]]]

_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
_MIN_SPLIT_ROWS = 64
"""On a full disk a part is halved, oldest rows first, down to parts of about this many rows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SinkConfig:
    flush_interval_s: float = 5.0
    """Seconds between background writes; also bounds how much a SIGKILL can lose."""
    max_buffered_rows: int = 100_000
    """Per-table buffer bound for evidence tables; rows beyond it are dropped and counted."""
    low_priority_max_rows: int = 10_000
    """Per-table buffer bound for low-priority tables (GPU samples, phases)."""
    rows_per_part: int = 50_000
    """A buffer this full wakes the writer before the interval ends."""
    compression: str = "lz4"
    """Parquet compression codec. lz4 writes a small part in about half zstd's CPU time; rank parts are short-lived
    where host rollups (zstd) merge them."""
    fsync: bool = False
    """fsync each part before the rename: survives a host crash, not only a process kill. Costs I/O."""
    close_retry_s: float = 2.0
    """Seconds `close` keeps retrying writes that failed (a full disk may free up, e.g. once a failed checkpoint's
    partial files are removed) before the rows still buffered are counted as dropped."""

    def __post_init__(self) -> None:
        if self.flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.max_buffered_rows < 1 or self.low_priority_max_rows < 1:
            raise ValueError("max_buffered_rows and low_priority_max_rows must be >= 1")
        if self.rows_per_part < 1:
            raise ValueError(f"rows_per_part must be >= 1, got {self.rows_per_part}")
        if self.close_retry_s < 0:
            raise ValueError(f"close_retry_s must be >= 0, got {self.close_retry_s}")

    def capacity(self, table: Table) -> int:
        return self.low_priority_max_rows if table in LOW_PRIORITY else self.max_buffered_rows


class Sink(ABC):
    """Accepts telemetry rows (tuples in `schema.column_names(table)` order)."""

    write_errors: int = 0
    """Writes that failed so far (each retried; a sink without files never fails one)."""
    last_write_error: str | None = None
    """One line on the latest failed write."""

    @abstractmethod
    def append(self, table: Table, row: Row) -> None:
        """Buffer one row. Never blocks on I/O, never raises."""

    def appender(self, table: Table) -> Callable[[Row], None]:
        """A function that appends one row to `table`, with `append`'s contract: what hot paths hold, so a row
        costs one call and no table lookup. Default: `append` with the table bound."""
        return functools.partial(self.append, table)

    def set_snapshot(self, fn: SnapshotFn | None) -> None:
        """Register rows to add at every flush (state at write time). Default: ignored."""

    @abstractmethod
    def set_source(self, fn: SourceFn | None) -> None:
        """Register a function whose rows are appended at every flush (once each: rows a producer left the writer
        to build, off the hot path). It must not raise; if it does, the error is counted and the flush goes on."""

    def start(self) -> None:
        """Start background work, if any."""

    @abstractmethod
    def flush(self, timeout_s: float | None = None) -> bool:
        """Write what is buffered; True if it completed within the timeout."""

    @abstractmethod
    def close(self, timeout_s: float | None = 10.0) -> None:
        """Flush and stop. Appends after close are dropped and counted."""

    @property
    @abstractmethod
    def dropped(self) -> Mapping[Table, int]:
        """Rows dropped so far, per table."""

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


class MemorySink(Sink):
    """In-memory fake for tests and for callers that want rows without files."""

    def __init__(self, *, capacity: int | None = None) -> None:
        self._rows: dict[Table, list[Row]] = {t: [] for t in Table}
        self._dropped: dict[Table, int] = {t: 0 for t in Table}
        self._capacity = capacity
        self._snapshot: SnapshotFn | None = None
        self._source: SourceFn | None = None
        self._lock = threading.Lock()
        self.closed = False

    def append(self, table: Table, row: Row) -> None:
        with self._lock:
            self._append_locked(table, row)

    def _append_locked(self, table: Table, row: Row) -> None:
        rows = self._rows[table]
        if self.closed or (self._capacity is not None and len(rows) >= self._capacity):
            self._dropped[table] += 1
            return
        rows.append(row)

    def set_snapshot(self, fn: SnapshotFn | None) -> None:
        self._snapshot = fn

    def set_source(self, fn: SourceFn | None) -> None:
        self._source = fn

    def _pull(self) -> None:
        """Take the source's rows, as a flush would (a reader sees what a parquet sink would have written)."""
        if self._source is not None and not self.closed:
            with self._lock:
                for table, rows in self._source().items():
                    for row in rows:
                        self._append_locked(table, row)

    def snapshot_rows(self) -> list[tuple[Table, Row]]:
        return list(self._snapshot()) if self._snapshot else []

    def flush(self, timeout_s: float | None = None) -> bool:
        self._pull()
        return True

    def close(self, timeout_s: float | None = 10.0) -> None:
        self._pull()
        self.closed = True

    @property
    def dropped(self) -> Mapping[Table, int]:
        return dict(self._dropped)

    def rows(self, table: Table) -> list[Row]:
        self._pull()
        with self._lock:
            return list(self._rows[table])

    def table(self, table: Table) -> pa.Table:
        return rows_to_table(table, self.rows(table))


def rows_to_table(table: Table, rows: list[Row]) -> pa.Table:
    schema = storage_schema(table)
    columns = list(zip(*rows)) if rows else [() for _ in schema]
    return pa.Table.from_arrays(
        [pa.array(col, type=field.type) for col, field in zip(columns, schema)], schema=schema
    )


def dictionary_columns(table: Table) -> list[str]:
    """Columns worth dictionary-encoding in a part file: the string ones (op, group, status, ...). Trying it on
    integer columns — unique timestamps, mostly — costs a small part ~40 % more writer CPU for nothing."""
    return [f.name for f in storage_schema(table) if pa.types.is_string(f.type)]


def partition_dir(run_dir: Path, table: Table, rank: int) -> Path:
    return Path(run_dir) / TELEMETRY_DIR / str(table) / f"{PARTITION_KEY}={rank}"


class ParquetSink(Sink):
    """Bounded buffers + a background writer of atomically renamed parquet part files, one rank's worth."""

    def __init__(self, run_dir: Path | str, rank: int, config: SinkConfig | None = None) -> None:
        self._run_dir = Path(run_dir)
        self._rank = rank
        self._config = config or SinkConfig()
        # deques: append and popleft are atomic under the GIL, so the hot path takes no lock; the writer drains
        # the same deque object rather than swapping it (an appender may hold a reference to it)
        self._buffers: dict[Table, deque[Row]] = {t: deque() for t in Table}
        self._caps = {t: self._config.capacity(t) for t in Table}
        self._dropped: dict[Table, int] = {t: 0 for t in Table}
        self._next_part: dict[Table, int] = {}
        self._dictionary = {t: dictionary_columns(t) for t in Table}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done = threading.Condition()
        self._requested = 0
        self._completed = 0
        self._closing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._snapshot: SnapshotFn | None = None
        self._source: SourceFn | None = None
        self.write_errors = 0
        self.last_write_error: str | None = None
        self._failing = 0
        """Consecutive flushes with a failed write (0 = the last one wrote everything)."""
        self._logged = False
        self.parts_written = 0
        self.bytes_written = 0
        self.writer_cpu_ns = 0
        """CPU time the writer thread spent building and writing parts (its own cost, for benchmarks)."""

    # -- training-thread side -------------------------------------------------------------------------
    def append(self, table: Table, row: Row) -> None:
        buf = self._buffers[table]
        if self._closed or len(buf) >= self._caps[table]:
            with self._lock:
                self._dropped[table] += 1
            return
        buf.append(row)
        if len(buf) == self._config.rows_per_part:
            self._wake.set()

    def appender(self, table: Table) -> Callable[[Row], None]:
        """`append` specialized to one table: the buffer, its bound and the wake-up size are bound once."""
        buf, cap, wake_at, wake = self._buffers[table], self._caps[table], self._config.rows_per_part, self._wake.set
        buf_append, lock, dropped = buf.append, self._lock, self._dropped

        def append(row: Row) -> None:
            n = len(buf)
            if n >= cap or self._closed:
                with lock:
                    dropped[table] += 1
                return
            buf_append(row)
            if n + 1 == wake_at:
                wake()

        return append

    def set_snapshot(self, fn: SnapshotFn | None) -> None:
        self._snapshot = fn

    def set_source(self, fn: SourceFn | None) -> None:
        self._source = fn

    @property
    def dropped(self) -> Mapping[Table, int]:
        with self._lock:
            return dict(self._dropped)

    def buffered_rows(self) -> int:
        return sum(len(b) for b in self._buffers.values())

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rankwatch-sink-{self._rank}", daemon=True)
            self._thread.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        if self._thread is None or not self._thread.is_alive():
            self._write_once()  # no writer thread: write inline (close after stop, or never started)
            return True
        with self._done:
            self._requested += 1
            target = self._requested
        self._wake.set()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._done:
            while self._completed < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._done.wait(remaining)
        return True

    def close(self, timeout_s: float | None = 10.0) -> None:
        if self._closed:
            return
        ok = self.flush(timeout_s)
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._closed = True  # from here on appends are counted as dropped
        if self._thread is None or not self._thread.is_alive():
            self._write_once()  # rows appended while the writer was stopping
            deadline = time.monotonic() + self._config.close_retry_s
            while self._failing and self.buffered_rows() and time.monotonic() < deadline:
                time.sleep(min(0.2, self._config.close_retry_s))  # a full disk may free up
                self._write_once()
            lost = self.buffered_rows()
            if lost:  # the events table may be unwritable too: stderr is the record of these
                with self._lock:
                    for table, buf in self._buffers.items():
                        self._dropped[table] += len(buf)
                        buf.clear()
                log.warning("rankwatch sink rank %d: %d row(s) could not be written and are dropped (%d failed "
                            "writes, last: %s); %d row(s) dropped in all", self._rank, lost, self.write_errors,
                            self.last_write_error, sum(self._dropped.values()))
        else:
            with self._lock:  # the writer is stuck: what it will never write is lost, and counted
                for table, buf in self._buffers.items():
                    self._dropped[table] += len(buf)
                    buf.clear()
        if not ok:
            log.warning("rankwatch sink rank %d: final flush did not finish within %ss", self._rank, timeout_s)

    # -- writer thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        self._warm()
        while not self._closing:
            self._wake.wait(self._config.flush_interval_s)
            self._wake.clear()
            with self._done:
                target = self._requested
            cpu = time.thread_time_ns()
            self._write_once()
            self.writer_cpu_ns += time.thread_time_ns() - cpu
            with self._done:
                self._completed = max(self._completed, target)
                self._done.notify_all()

    def _warm(self) -> None:
        """Convert an empty batch of every table once, as the writer starts: pyarrow imports pandas at its first
        `pa.array` when pandas is installed (pyarrow 26's pandas shim, whatever the input), ~0.2 s of CPU measured
        here, which a first flush would otherwise spend in the middle of training (`benchmarks/collector_cost.py`
        counted it as overhead). Never raises: a failure here is the first flush's to report."""
        cpu = time.thread_time_ns()
        try:
            for t in Table:
                rows_to_table(t, [])
        except Exception:
            pass
        self.writer_cpu_ns += time.thread_time_ns() - cpu

    def _write_once(self) -> None:
        batches: dict[Table, list[Row]] = {}
        for t, buf in self._buffers.items():
            n = len(buf)
            if n:
                batches[t] = [buf.popleft() for _ in range(n)]
        if self._source is not None:
            try:
                for table, rows in self._source().items():
                    if table in batches:
                        batches[table].extend(rows)
                    elif rows:
                        batches[table] = rows
            except Exception as exc:  # a broken source must not stop the writer
                self._count_error(f"source: {type(exc).__name__}: {exc}")
        if self._snapshot is not None:
            try:
                for table, row in self._snapshot():
                    batches.setdefault(table, []).append(row)
            except Exception as exc:  # a broken snapshot must not stop the writer
                self._count_error(f"snapshot: {type(exc).__name__}: {exc}")
        failed = 0
        for table in sorted(batches, key=lambda t: t in LOW_PRIORITY):  # evidence first: on a full disk it fits first
            rows = batches[table]
            try:
                written = self._write_fitting(table, rows)
            except Exception as exc:
                failed += 1
                self._count_error(f"{table}: {type(exc).__name__}: {exc}")
                self._requeue(table, rows)
                continue
            if written < len(rows):
                failed += 1
                self._count_error(f"{table}: disk full: {written} of {len(rows)} rows written")
                self._requeue(table, rows[written:])
        if failed:
            self._failing += 1
        elif self._failing:
            log.warning("rankwatch sink rank %d: writing again after %d failed flush(es) (%d failed writes)",
                        self._rank, self._failing, self.write_errors)
            self._failing = 0
            self._logged = False

    def _write_fitting(self, table: Table, rows: list[Row]) -> int:
        """Write `rows` as one part or, when it does not fit (ENOSPC), as halves, oldest first, as far as they fit.
        Returns how many rows were written (always the oldest); raises when not even the smallest part fits."""
        try:
            self._write_part(table, rows)
            return len(rows)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or len(rows) < 2 * _MIN_SPLIT_ROWS:
                raise
        half = len(rows) // 2
        written = self._write_fitting(table, rows[:half])
        if written < half:
            return written
        try:
            return half + self._write_fitting(table, rows[half:])
        except OSError:
            return half

    def _requeue(self, table: Table, rows: list[Row]) -> None:
        """Put rows that failed to write back in front of the buffer, as far as the bound allows."""
        buf = self._buffers[table]
        room = max(0, self._caps[table] - len(buf))
        keep = rows[-room:] if room else []
        with self._lock:
            self._dropped[table] += len(rows) - len(keep)
        buf.extendleft(reversed(keep))

    def _count_error(self, what: str) -> None:
        self.write_errors += 1
        self.last_write_error = what.splitlines()[0][:300] if what else what
        if not self._failing and not self._logged:  # once per spell of failures
            self._logged = True
            log.warning("rankwatch sink rank %d: write failed (%s); retrying at the next flush", self._rank, what)

    def _part_number(self, table: Table, directory: Path) -> int:
        n = self._next_part.get(table)
        if n is None:
            existing = [int(m.group(1)) for p in directory.iterdir() if (m := _PART_RE.match(p.name))]
            n = max(existing, default=-1) + 1
        self._next_part[table] = n + 1
        return n

    def _write_part(self, table: Table, rows: list[Row]) -> None:
        directory = partition_dir(self._run_dir, table, self._rank)
        directory.mkdir(parents=True, exist_ok=True)
        data = rows_to_table(table, rows)
        n = self._part_number(table, directory)
        final = directory / f"part-{n:06d}.parquet"
        atomic_write(final, lambda tmp: pq.write_table(data, tmp, compression=self._config.compression,
                                                       use_dictionary=self._dictionary[table]),
                     durable=self._config.fsync)  # a per-flush fsync is the config's choice (off: a killed process
        # still leaves whole parts; a host crash may lose the newest)
        self.parts_written += 1
        self.bytes_written += final.stat().st_size
