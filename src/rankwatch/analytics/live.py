"""Live analysis of a run that is still being written: keep its telemetry in memory, read only new part files.

A one-shot `analyze` opens every part file of every table; at 2,048 ranks that is tens of thousands of files
and several seconds before any detector runs. A monitor that re-analyzes the latest window every few seconds
holds a `LiveAnalyzer` instead: `refresh()` lists the part files, reads only those it has not seen (part files
are immutable: the collector writes each under a temporary name and renames it), appends their rows to in-memory
tables, and drops rows older than `keep_steps`; `analyze()` then runs every detector on the latest
`window_steps` steps.

Host rollups (`collector.rollup`) move rows the analyzer may already hold into a host part and may delete the rank
parts they came from. The analyzer remembers, per table and rank, which rank part numbers it has read; a new host
part's footer names the rank parts it covers, so it reads only the rows of those it has not read (none, some or
all of the host part). Every row of the run is held exactly once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import duckdb

from rankwatch.analytics.analyze import Analysis, Progress, detect_all
from rankwatch.analytics.impact import costed
from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.analytics.queries import load_frames
from rankwatch.analytics.store import (
    ANALYZED_TABLES, RELIST_TRIES, analyzed_columns, footer_version, parquet_source, part_footers, readable_parts,
    table_parts, telemetry_dir,
)
from rankwatch.analytics.validate import check_keys, data_warnings, is_guard_error, read_error, stray_tables
from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.schema import SCHEMA_VERSION, EventKind, Table
from rankwatch.collector.rollup import COVERS_KEY, MANIFEST, PartListing, part_number, rank_of_part, read_covers

_REFRESH_THREADS = 3
"""Tables read at once by `LiveAnalyzer.refresh`."""


class _Vanished(Exception):
    """A listed part file was gone when read."""


# Tables whose rows carry the step they belong to, trimmed to the latest `keep_steps`.
_STEPPED = (Table.STEPS, Table.COLLECTIVES, Table.GPU, Table.CHECKPOINT_PHASES, Table.FINGERPRINTS)


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveConfig:
    window_steps: int = 20
    """Steps each `analyze()` looks at (the latest ones)."""
    keep_steps: int = 2000
    """Rows older than this many steps behind the newest are dropped from memory (heartbeats too); lifecycle events
    and topology are kept."""
    anomaly: bool = True
    """Run the anomaly model."""
    rank_parts: bool = True
    """Read rank part files no host rollup covers yet. False reads host rollups only (every host runs a rollup
    agent): a refresh then lists no rank folder, and rows reach memory one agent round later."""
    rollup_fresh_s: float | None = 60.0
    """The folders of ranks whose host rollup manifest was published within this many seconds are not listed: a
    running agent brings their rows in its next host part (one agent round later), and listing 2,048 rank folders
    per table costs a refresh more than reading 256 host parts. A host whose agent stopped, or that has none, is
    read from its rank folders. None lists every rank folder at every refresh."""

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.keep_steps < self.window_steps:
            raise ValueError(f"LiveConfig: window_steps {self.window_steps} must be >= 1 and keep_steps "
                             f"{self.keep_steps} >= window_steps")
        if self.rollup_fresh_s is not None and self.rollup_fresh_s <= 0:
            raise ValueError(f"LiveConfig: rollup_fresh_s {self.rollup_fresh_s} must be > 0 (or None)")


class LiveAnalyzer:
    """In-memory telemetry of one run, refreshed from new part files; see the module docstring."""

    def __init__(self, run_dir: Path | str, config: LiveConfig = LiveConfig()) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.con = duckdb.connect()
        self._seen: set[Path] = set()
        self._direct: dict[Table, dict[int, set[int]]] = {t: {} for t in Table}
        """Per table, per rank: numbers of the rank parts read from their own file whose rows no host part read
        since holds. Only a new host part that covers one of them needs its footer read."""
        self._tables: set[Table] = set()
        self._files: dict[Table, list[Path]] = {t: [] for t in Table}
        """The part files read, per table (to name the ones holding a repeated row)."""
        self.warnings: list[str] = []

    def refresh(self) -> int:
        """Read the part files not seen yet; returns how many. A part that cannot be read is left out with a
        warning (and tried again at the next refresh, in case it was still being replaced); a part of an unknown
        schema version, of other columns, or with rows no collector writes raises (`errors`, one line naming it).

        Tables are read concurrently, each on its own DuckDB cursor: reading many small files has single-threaded
        stretches per statement (opening files, footers) that another table's statement fills."""
        tables = [t for t in Table if t in ANALYZED_TABLES]
        if not self._seen and not self.started():
            return 0  # a run just launched: its ranks have not created telemetry/ yet (a missing run still raises)
        if not self._seen:  # said once, while nothing was read yet
            self.warnings.extend(w for w in stray_tables(telemetry_dir(self.run_dir)) if w not in self.warnings)
        # the order of rows in memory carries no meaning (files arrive in any order): not keeping it reads faster
        self.con.execute("SET preserve_insertion_order = false")
        try:
            with ThreadPoolExecutor(max_workers=_REFRESH_THREADS, thread_name_prefix="rankwatch-refresh") as pool:
                added = sum(pool.map(self._refresh_table, tables))
        except duckdb.Error as exc:
            raise read_error(exc, telemetry_dir(self.run_dir)) from None
        finally:
            self.con.execute("RESET preserve_insertion_order")
        if added:
            self._trim()
        return added

    def started(self) -> bool:
        """Whether the run's ranks have created its telemetry/ folder; a run directory that does not exist raises
        (a live analyzer may be started beside a job it then waits for, not on a mistyped path)."""
        if (Path(self.run_dir) / TELEMETRY_DIR).is_dir():
            return True
        if not Path(self.run_dir).is_dir():
            telemetry_dir(self.run_dir)  # raises: not a run directory
        return False

    def _refresh_table(self, table: Table) -> int:
        con = self.con.cursor()  # one per table: statements on different cursors run concurrently
        try:
            for attempt in range(RELIST_TRIES):
                listing = table_parts(self.run_dir, table, rank_parts=self.config.rank_parts,
                                      fresh_s=self.config.rollup_fresh_s)
                try:
                    return self._ingest(con, table, listing)
                except _Vanished:
                    # a listed rank part was deleted after a rollup covering it was published: list again
                    if attempt == RELIST_TRIES - 1:
                        raise RunDirError(f"{self.run_dir}: {table} part files keep vanishing while being read "
                                          "(a rollup agent deleting faster than a refresh lists?)") from None
            return 0
        finally:
            con.close()

    def _ingest(self, con: duckdb.DuckDBPyConnection, table: Table, listing: PartListing) -> int:
        direct = self._direct[table]
        hosts: list[Path] = []  # new host parts holding no row held already: read without opening their footers
        check: list[Path] = []  # new host parts that may hold rows held already, and new rank parts: footers first
        for directory, manifest in listing.manifests:
            if manifest.schema_version != SCHEMA_VERSION:
                raise SchemaVersionError(f"{directory / MANIFEST}: host parts of schema version "
                                         f"{manifest.schema_version}; a live monitor reads version {SCHEMA_VERSION} "
                                         "only — analyze a run written by an older rankwatch with `rankwatch analyze`")
            new = [directory / p for p in manifest.parts if directory / p not in self._seen]
            overlap = any(cov.covers(n) for r, cov in manifest.ranks.items() for n in direct.get(r, ()))
            (check if overlap else hosts).extend(new)
        loose = {f: (r, n) for f in listing.rank_parts
                 if f not in self._seen and (r := rank_of_part(f)) is not None and (n := part_number(f)) is not None}
        check.extend(loose)
        meta: dict[Path, dict[bytes, bytes]] = {}
        if check:
            meta, problems = part_footers(con, check, keys=(COVERS_KEY,))
            self.warnings.extend(f"{p} — left out for now" for p in problems)
            old = next((f for f, m in meta.items() if footer_version(m) != SCHEMA_VERSION), None)
            if old is not None:
                raise SchemaVersionError(f"{old}: schema version {footer_version(meta[old])}; a live monitor reads "
                                         f"version {SCHEMA_VERSION} only — analyze a run written by an older "
                                         "rankwatch with `rankwatch analyze`")
        partial: list[tuple[Path, list[tuple[int, int]], list[tuple[int, int]]]] = []
        for f in check:
            if f not in meta or f in loose:
                continue
            covers = read_covers(meta[f].get(COVERS_KEY), path=f)
            held, offset = [], 0
            for r, n, rows in covers:
                if n in direct.get(r, ()):
                    held.append((r, n, offset, offset + rows - 1))
                offset += rows
            if not held:
                hosts.append(f)
            else:
                partial.append((f, [(lo, hi) for _, _, lo, hi in held], [(r, n) for r, n, _, _ in held]))
        ranks = [f for f in loose if f in meta]
        # each statement reads all or nothing; what it read is recorded before the next one can fail
        done = self._insert(con, table, [*hosts, *ranks]) if hosts or ranks else set()
        self._files[table].extend(f for f in done if f not in self._seen)
        for f in done:
            self._seen.add(f)
            if f in loose:
                r, n = loose[f]
                direct.setdefault(r, set()).add(n)
        for f, skip, held_parts in partial:
            rows_held = len(skip) == len(read_covers(meta[f].get(COVERS_KEY), path=f))
            if not rows_held:  # some of it is new: read it but the rows of rank parts held already
                where = " OR ".join(f"file_row_number BETWEEN {lo} AND {hi}" for lo, hi in skip)
                if not self._insert(con, table, [f], where=f"NOT ({where})"):
                    continue
                done.add(f)
                self._files[table].append(f)
            for r, n in held_parts:
                direct[r].discard(n)
            self._seen.add(f)
        return len(done)

    def _insert(self, con: duckdb.DuckDBPyConnection, table: Table, files: list[Path], *,
                where: str = "") -> set[Path]:
        """Append the rows of `files` (those matching `where`, over `file_row_number`) to `table`; returns the
        files read. A file that cannot be read is left out with a warning; a file gone raises `_Vanished`."""
        try:
            self._insert_sql(con, table, files, where)
            return set(files)
        except duckdb.Error as exc:
            if is_guard_error(exc):  # a row no collector writes, in a readable part: naming it is all there is to do
                raise
            if not all(f.exists() for f in files):
                raise _Vanished from None
        readable, problems = readable_parts(con, files)  # file by file, naming what is wrong
        self.warnings.extend(f"{p} — left out for now" for p in problems)
        good = [f for f in files if f in readable]
        if good:
            self._insert_sql(con, table, good, where)
        return set(good)

    def _insert_sql(self, con: duckdb.DuckDBPyConnection, table: Table, files: list[Path], where: str) -> None:
        # only the columns the detectors read (`store.analyzed_columns`)
        columns = analyzed_columns(table)
        if where:
            source = (f"(SELECT {columns} FROM (SELECT * EXCLUDE (file_row_number) "
                      f"FROM {parquet_source(files, row_number=True, table=table)} WHERE {where}))")
        else:
            source = f"(SELECT {columns} FROM {parquet_source(files, union_by_name=False, table=table)})"
        if table in self._tables:
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {source}")
        else:
            con.execute(f"CREATE TABLE {table} AS SELECT * FROM {source}")
            self._tables.add(table)

    def _trim(self) -> None:
        if Table.STEPS not in self._tables:
            return
        last = self.con.execute("SELECT max(step) FROM steps").fetchall()[0][0]
        if last is None:
            return
        floor = int(last) - self.config.keep_steps
        for table in _STEPPED:
            if table in self._tables:
                self.con.execute(f"DELETE FROM {table} WHERE step < {floor}")
        if Table.EVENTS in self._tables:
            self.con.execute(f"DELETE FROM events WHERE kind = '{EventKind.HEARTBEAT}' AND step < {floor}")

    def analyze(self, *, progress: Progress | None = None) -> Analysis:
        """Every detector over the latest `window_steps` steps held in memory."""
        if not self._tables:
            raise RunDirError(f"{self.run_dir}: no telemetry read yet (call refresh(), or the run recorded nothing)")
        timings: list[tuple[str, float]] = []
        t0 = time.perf_counter()
        since = None
        if Table.STEPS in self._tables:
            last = self.con.execute("SELECT max(step) FROM steps").fetchall()[0][0]
            since = None if last is None else max(0, int(last) - self.config.window_steps + 1)
        try:
            # the window's rows: a repeated key raises naming the parts, no row at all raises, a missing table warns
            check_keys(self.con, self._tables, self._files, since_step=since)
            found = data_warnings(self.con, self._tables, telemetry_dir(self.run_dir))
            frames = load_frames(con=self.con, since_step=since)
        except duckdb.Error as exc:
            raise read_error(exc, telemetry_dir(self.run_dir)) from None
        timings.append(("load", time.perf_counter() - t0))
        incidents = costed(frames, detect_all(frames, anomaly=self.config.anomaly,
                                              progress=progress or (lambda _: None), timings=timings, live=True),
                           None, why_not="a live window is not replayed (`rankwatch analyze` or `whatif` costs it)")
        return Analysis(
            run_dir=self.run_dir, incidents=incidents, ranks=frames.world_size, first_step=frames.first_step,
            last_step=frames.last_step,
            warnings=(*self.warnings, *found), seconds=tuple(timings),
        )
