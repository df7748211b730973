"""Checks on what analysis reads, each failing in one line that names the file: the folders of a table, every rank
part's columns and types, the rows' rank, keys and value ranges, and whether there is any data at all.

Damaged input must never read as an answer: a copied part makes three healthy ranks look slow, a rank folder under
another name makes a straggler vanish, an empty run reads as "no incidents". The checks stay cheap at 2,048 ranks:

- folders: one listing of each table folder;
- columns and types: the footer pass `store.part_footers` already makes reads a digest of each part's arrow schema
  with the schema version; one footer per distinct digest is read and compared (host parts are written by
  `collector.rollup` from rank parts it checked against the storage schema, and are not compared again);
- rank and value ranges: a guard expression evaluated inside the read itself (`row_guard`), which raises with the
  file's name on the first row that breaks it;
- keys: one `count(*)` against `count(DISTINCT key)` per table in SQL over what analysis holds (its window);
- no data: row counts of the tables detectors need.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.analytics.errors import AnalyticsError, DamagedDataError, NoDataError, PartSchemaError, RunDirError
from rankwatch.base.schema import (
    PARTITION_KEY, READABLE_VERSIONS, SCHEMA_VERSION, SCHEMA_VERSION_KEY, CheckpointPhases, CollectiveStatus,
    Collectives, EventKind, Events, Fingerprints, Phases, Steps, Table, Topology, storage_schema,
)
from rankwatch.collector.rollup import ROLLUP_DIR, rank_of_part

ARROW_SCHEMA_KEY = b"ARROW:schema"
"""The footer key under which pyarrow stores a part's arrow schema."""
SCHEMA_DIGEST_KEY = b"rankwatch.arrow_schema_md5"
"""Where `store.part_footers` puts the md5 of a part's ARROW:schema value (hex), read in its footer pass."""

_GUARD_MARK = "rankwatch: damaged part: "

_NON_NEGATIVE: dict[Table, tuple[str, ...]] = {
    Table.STEPS: (Steps.STEP, Steps.DURATION_NS, Steps.COMPUTE_NS, Steps.COLLECTIVE_WAIT_NS,
                  Steps.DATALOADER_WAIT_NS, Steps.CHECKPOINT_NS),
    Table.PHASES: (Phases.DURATION_NS,),
    Table.COLLECTIVES: (Collectives.DURATION_NS,),
    Table.CHECKPOINT_PHASES: (CheckpointPhases.DURATION_NS, CheckpointPhases.BYTES),
    Table.TOPOLOGY: (Topology.ATTEMPT, Topology.WORLD_SIZE),
}
"""Columns no collector writes negative (durations are monotonic-clock differences; compute is clamped at 0)."""

_KEYS: dict[Table, tuple[tuple[str, ...], str]] = {
    Table.STEPS: ((Steps.RANK, Steps.ATTEMPT, Steps.STEP), ""),
    Table.TOPOLOGY: ((Topology.RANK, Topology.ATTEMPT), ""),
    Table.EVENTS: ((Events.RANK, Events.ATTEMPT, Events.KIND, Events.MONO_NS), ""),
    # an operation's in_flight snapshots may be written again by a later flush; finished rows are written once
    Table.COLLECTIVES: ((Collectives.RANK, Collectives.SEQ, Collectives.STATUS, Collectives.ENTER_MONO_NS),
                        f"{Collectives.STATUS} <> '{CollectiveStatus.IN_FLIGHT}'"),
    Table.FINGERPRINTS: ((Fingerprints.RANK, Fingerprints.STEP, Fingerprints.DOMAIN, Fingerprints.WALL_NS), ""),
    Table.CHECKPOINT_PHASES: ((CheckpointPhases.RANK, CheckpointPhases.CHECKPOINT_ID, CheckpointPhases.PHASE,
                               CheckpointPhases.START_MONO_NS), ""),
}
"""What identifies one row of each table (the GPU table has none: samples of one step may repeat)."""

_STEPPED = frozenset({Table.STEPS, Table.COLLECTIVES, Table.FINGERPRINTS, Table.CHECKPOINT_PHASES})


def table_of(path: Path) -> Table | None:
    """The table of a rank part (`<table>/rank=<r>/part-<n>.parquet`) or a host part
    (`<table>/_rollup/host=<h>/part-<n>.parquet`); None for any other path."""
    up = path.parent.parent
    name = up.parent.name if up.name == ROLLUP_DIR else up.name
    return Table(name) if name in Table._value2member_map_ else None


# -- folders ------------------------------------------------------------------------------------------------------


def check_folders(table_dir: Path) -> None:
    """Raise `DamagedDataError` for anything in a table folder that no reader lists: a folder not named
    `rank=<n>` (a renamed or misplaced rank folder, whose rows would silently vanish) or a file beside the rank
    folders. Names starting with '.' (temporary files) and the rollup folder are the collector's."""
    try:
        names = os.listdir(table_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    prefix = f"{PARTITION_KEY}="
    for name in sorted(names):
        if name.startswith(".") or name == ROLLUP_DIR:
            continue
        if name.startswith(prefix) and name[len(prefix):].isdecimal():
            continue  # a rank folder (not stat'ed: a tick lists thousands)
        path = table_dir / name
        what = "folder" if path.is_dir() else "file"
        raise DamagedDataError(f"{path}: a {what} in a table folder that is not {prefix}<n>/ — its rows would not be "
                               f"read (a renamed or misplaced rank folder?); move it out of the run or name it "
                               f"{prefix}<rank>")


def stray_tables(tel: Path) -> tuple[str, ...]:
    """One warning per folder under telemetry/ that is no table (it is not read)."""
    try:
        names = sorted(os.listdir(tel))
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(f"{tel / n}: not a telemetry table ({', '.join(Table)}) — not read" for n in names
                 if not n.startswith((".", "_")) and n not in Table._value2member_map_)


# -- columns and types --------------------------------------------------------------------------------------------


def schema_problem(table: Table, schema: pa.Schema) -> str:
    """What differs between a part's columns and the storage schema of `table` at the part's schema version ('' if
    nothing): columns it has that the schema lacks, columns it lacks, and columns of another type. Column order and
    nullability are not compared."""
    want = {f.name: f.type for f in storage_schema(table, part_version(schema))}
    got = {f.name: f.type for f in schema}
    problems = []
    extra = [n for n in got if n not in want]
    missing = [n for n in want if n not in got]
    if extra:
        problems.append(f"column(s) {', '.join(extra)} not in the {table} schema")
    if missing:
        problems.append(f"lacks column(s) {', '.join(missing)}")
    problems.extend(f"column {n} is {got[n]}, the {table} schema says {t}" for n, t in want.items()
                    if n in got and not got[n].equals(t))
    return "; ".join(problems)


def part_version(schema: pa.Schema) -> int:
    """The schema version a part's footer names, where it is one this rankwatch reads; else the current one (the
    version itself is checked by `store.check_part`)."""
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY, b"")
    return int(raw) if raw.isdigit() and int(raw) in READABLE_VERSIONS else SCHEMA_VERSION


def check_part_schema(path: Path, schema: pa.Schema) -> None:
    """Raise `PartSchemaError` if a rank part's columns are not its table's."""
    table = table_of(path)
    if table is None or rank_of_part(path) is None:
        return
    problem = schema_problem(table, schema)
    if problem:
        raise PartSchemaError(f"{path}: {problem}")


def check_schemas(meta: Mapping[Path, Mapping[bytes, bytes]]) -> None:
    """`check_part_schema` for every rank part in `meta` (footer values by file, with `SCHEMA_DIGEST_KEY`), reading
    one footer per distinct (table, schema digest); a part without a digest is read on its own."""
    groups: dict[tuple[Table, bytes], list[Path]] = {}
    for path, values in meta.items():
        table = table_of(path)
        if table is None or rank_of_part(path) is None:
            continue
        digest = values.get(SCHEMA_DIGEST_KEY)
        if digest is None:
            check_part_schema(path, _read_schema(path))
            continue
        groups.setdefault((table, digest), []).append(path)
    for (table, _), files in groups.items():
        problem = schema_problem(table, _read_schema(files[0]))
        if problem:
            more = f" (and {len(files) - 1} more part(s) alike)" if len(files) > 1 else ""
            raise PartSchemaError(f"{files[0]}: {problem}{more}")


def _read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except Exception as exc:
        raise RunDirError(f"{path}: unreadable parquet part ({type(exc).__name__}: {exc})") from None


# -- rank and value ranges, inside the read -----------------------------------------------------------------------


def row_guard(table: Table | None, files: Sequence[Path]) -> str:
    """A SQL condition over `read_parquet(files)` that is true for every row a collector could have written and
    raises, naming the file, on the first that it could not: a rank other than its rank folder's (a part filed
    under another rank), a negative rank, or a negative duration, step or size. Uses DuckDB's `file_index` and
    `filename` virtual columns, so it costs a comparison per row and no second read."""
    rank = PARTITION_KEY
    folders = [rank_of_part(f) for f in files]
    checks: list[tuple[str, str]] = [(f"{rank} < 0", f"'negative {rank} ' || {rank}")]
    if any(r is not None for r in folders):
        listing = "[" + ", ".join("-1" if r is None else str(r) for r in folders) + "]"
        expected = f"{listing}[file_index::BIGINT + 1]"
        checks.append((f"{expected} >= 0 AND {rank} <> {expected}",
                       f"'{rank} ' || {rank} || ' in a {PARTITION_KEY}=' || {expected} || ' folder (a part filed under "
                       f"another rank, or its {rank} column rewritten)'"))
    if table is not None:
        checks.extend((f"{c} < 0", f"'negative {c} ' || {c}") for c in _NON_NEGATIVE.get(table, ()))
        if table is Table.TOPOLOGY:
            size = Topology.WORLD_SIZE
            checks.append((f"{rank} >= {size}", f"'{rank} ' || {rank} || ' not below {size} ' || {size}"))
    cases = " ".join(f"WHEN {cond} THEN error('{_GUARD_MARK}' || filename || ': ' || {msg})" for cond, msg in checks)
    return f"CASE {cases} ELSE true END"


def read_error(exc: duckdb.Error, where: Path) -> AnalyticsError:
    """The one-line error for a DuckDB error while reading telemetry: what `row_guard` raised, naming the file, or
    the first line of DuckDB's message under `where`."""
    text = str(exc)
    if _GUARD_MARK in text:
        return DamagedDataError(text.split(_GUARD_MARK, 1)[1].splitlines()[0])
    first = text.splitlines()[0] if text else type(exc).__name__
    return RunDirError(f"{where}: the telemetry could not be read ({first})")


def is_guard_error(exc: duckdb.Error) -> bool:
    return _GUARD_MARK in str(exc)


# -- keys -----------------------------------------------------------------------------------------------------------


def check_keys(con: duckdb.DuckDBPyConnection, tables: Collection[Table],
               files: Mapping[Table, Sequence[Path]], *, since_step: int | None = None) -> None:
    """Raise `DamagedDataError` when one row key of a table (`_KEYS`) is held in several rows: a part copied into a
    rank folder, or one rank's rows filed twice. Looks at steps from `since_step` on (the window being analyzed).
    The error names the part files holding the repeated row."""
    for table, (key, only) in _KEYS.items():
        if table not in tables:
            continue
        conds = [only] if only else []
        if since_step is not None and table in _STEPPED:
            conds.append(f"step >= {int(since_step)}")
        elif since_step is not None and table is Table.EVENTS:
            conds.append(f"({Events.KIND} <> '{EventKind.HEARTBEAT}' OR {Events.STEP} >= {int(since_step)})")
        where = f"WHERE {' AND '.join(conds)}" if conds else ""
        cols = ", ".join(f'"{c}"' for c in key)
        rows, distinct = con.execute(f"SELECT count(*), count(DISTINCT ({cols})) FROM {table} {where}").fetchall()[0]
        if rows == distinct:
            continue
        dup = con.execute(f"SELECT {cols}, count(*) FROM {table} {where} GROUP BY ALL HAVING count(*) > 1 "
                          f"ORDER BY {cols} LIMIT 1").fetchall()[0]
        raise _duplicate_error(con, table, key, dup[:-1], int(dup[-1]), int(rows - distinct), files.get(table, ()))


def _duplicate_error(con: duckdb.DuckDBPyConnection, table: Table, key: tuple[str, ...], values: Sequence[object],
                     times: int, extra: int, files: Sequence[Path]) -> DamagedDataError:
    shown = ", ".join(f"{k} {v}" for k, v in zip(key, values))
    what = f"{table} row ({shown}) is stored {times} times ({extra} repeated row(s) in all)"
    rank = values[0]
    candidates = [f for f in files if rank_of_part(f) in (None, rank)]
    holders: list[str] = []
    if candidates:
        listing = ", ".join("'" + str(f).replace("'", "''") + "'" for f in candidates)
        where = " AND ".join(f'"{k}" = ${i + 1}' for i, k in enumerate(key))
        holders = [str(r[0]) for r in con.execute(
            f"SELECT filename FROM read_parquet([{listing}], union_by_name=true) WHERE {where} "
            "GROUP BY filename ORDER BY filename", list(values)).fetchall()]
    if not holders:
        return DamagedDataError(f"{table}: {what}: a copied part, or rows written twice")
    others = (f" and {len(holders) - 1} other part(s)" if len(holders) > 1
              else f" ({times} times in the one part)")
    return DamagedDataError(f"{holders[0]}: {what}, in it{others}: a copied part, or rows written twice")


# -- no data --------------------------------------------------------------------------------------------------------


_NEEDED: tuple[tuple[Table, str], ...] = (
    (Table.STEPS, "no completed step: stragglers, divergence and anomalies cannot be seen"),
    (Table.EVENTS, "no lifecycle events or heartbeats: fail-stops and hangs cannot be seen"),
    (Table.TOPOLOGY, "no topology: incidents name ranks, never devices, hosts or links"),
)


def data_warnings(con: duckdb.DuckDBPyConnection, tables: Collection[Table], tel: Path) -> tuple[str, ...]:
    """One warning per table detectors need that holds no row; `NoDataError` when no table holds any. A table is
    asked for one row, not counted (a view over many files stops at the first)."""

    def any_row(t: Table) -> bool:
        return t in tables and bool(con.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchall())

    empty = [(t, why) for t, why in _NEEDED if not any_row(t)]
    if len(empty) == len(_NEEDED) and not any(any_row(t) for t in tables):
        raise NoDataError(f"{tel}: every table is empty ({', '.join(sorted(tables)) or 'no table'}: 0 rows) — the run "
                          "recorded nothing to analyze")
    return tuple(f"{tel / t}: {'no rows' if t in tables else 'no part files'} — {why}" for t, why in empty)
