"""Live analysis of a run that is still being written: keep its telemetry in memory, read only new part files.

A one-shot `analyze` opens every part file of every table; at 2,048 ranks that is tens of thousands of files
and several seconds before any detector runs. A monitor that re-analyzes the latest window every few seconds
holds a `LiveAnalyzer` instead: `refresh()` lists the part files, reads only those it has not seen (part files
are immutable: the collector writes each under a temporary name and renames it), appends their rows to in-memory
tables, and drops rows older than `keep_steps`; `analyze()` then runs every detector on the latest
`window_steps` steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from rankwatch.analytics.analyze import Analysis, Progress, detect_all
from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.queries import load_frames
from rankwatch.analytics.store import ANALYZED_TABLES, parquet_source, part_files, readable_parts
from rankwatch.collector.schema import EventKind, Table

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

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.keep_steps < self.window_steps:
            raise ValueError(f"LiveConfig: window_steps {self.window_steps} must be >= 1 and keep_steps "
                             f"{self.keep_steps} >= window_steps")


class LiveAnalyzer:
    """In-memory telemetry of one run, refreshed from new part files; see the module docstring."""

    def __init__(self, run_dir: Path | str, config: LiveConfig = LiveConfig()) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.con = duckdb.connect()
        self._seen: set[Path] = set()
        self._tables: set[Table] = set()
        self.warnings: list[str] = []

    def refresh(self) -> int:
        """Read the part files not seen yet; returns how many. A part that cannot be read is left out with a
        warning (and tried again at the next refresh, in case it was still being replaced); a part of an unknown
        schema version raises `SchemaVersionError`."""
        added = 0
        for table in Table:
            if table not in ANALYZED_TABLES:
                continue
            new = [f for f in part_files(self.run_dir, table) if f not in self._seen]
            if not new:
                continue
            readable, problems = readable_parts(self.con, new)
            self.warnings.extend(f"{p} — left out for now" for p in problems)
            good = [f for f in new if f in readable]
            if not good:
                continue
            source = parquet_source(good)
            if table in self._tables:
                self.con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {source}")
            else:
                self.con.execute(f"CREATE TABLE {table} AS SELECT * FROM {source}")
                self._tables.add(table)
            self._seen.update(good)
            added += len(good)
        if added:
            self._trim()
        return added

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
        frames = load_frames(con=self.con, since_step=since)
        timings.append(("load", time.perf_counter() - t0))
        incidents = detect_all(frames, anomaly=self.config.anomaly, progress=progress or (lambda _: None),
                               timings=timings)
        return Analysis(
            run_dir=self.run_dir, incidents=incidents, ranks=frames.world_size, first_step=frames.first_step,
            last_step=frames.last_step,
            warnings=tuple(self.warnings), seconds=tuple(timings),
        )
