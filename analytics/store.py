"""DuckDB views over a run's hive-partitioned telemetry, with loud, one-line errors for bad input."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.collector.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, TELEMETRY_DIR, Table


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSummary:
    table: Table
    rows: int
    ranks: int
    files: int
    bytes: int


def telemetry_dir(run_dir: Path | str) -> Path:
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"{run}: not a run directory (does not exist)")
    tel = run / TELEMETRY_DIR
    if not tel.is_dir():
        raise RunDirError(f"{run}: no {TELEMETRY_DIR}/ folder — not a rankwatch run, or nothing was recorded")
    return tel


def part_files(run_dir: Path | str, table: Table) -> list[Path]:
    return sorted((telemetry_dir(run_dir) / str(table)).glob("rank=*/part-*.parquet"))


def check_part(path: Path) -> None:
    """Raise a one-line error if a part file is unreadable or of an unknown schema version."""
    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception as exc:
        raise RunDirError(f"{path}: unreadable parquet part ({type(exc).__name__}: {exc})") from None
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is None or int(version) != SCHEMA_VERSION:
        found = version.decode() if version else "none"
        raise SchemaVersionError(f"{path}: schema version {found}, this rankwatch reads {SCHEMA_VERSION}")


def connect(run_dir: Path | str, *, check: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table present in the run (union by name, rank from the path).
    With `check`, any unreadable part or unknown schema version raises a one-line error naming the file."""
    con = duckdb.connect()
    for table in Table:
        files = part_files(run_dir, table)
        if not files:
            continue
        if check:
            for f in files:
                check_part(f)
        _create_view(con, table, files)
    return con


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStore:
    """A connection over a run's readable parts, and one warning per part file left out (naming the file)."""

    con: duckdb.DuckDBPyConnection
    warnings: tuple[str, ...]
    parts: int
    tables: frozenset[Table]
    """Tables with at least one readable part."""


ANALYZED_TABLES: frozenset[Table] = frozenset(Table) - {Table.PHASES}
"""Tables the detectors read (phases are for people, not for detection)."""


def open_run(run_dir: Path | str, *, tables: Collection[Table] = ANALYZED_TABLES, threads: int = 8) -> RunStore:
    """Open a run for analysis: one view per table over its readable parts. A part file that cannot be read (cut
    short, not parquet) is left out with a warning naming it; a part of an unknown schema version is an error,
    because its columns could mean something else; a run with no telemetry at all is an error. `materialize`
    then reads what many queries share into memory once."""
    tel = telemetry_dir(run_dir)
    by_table = {table: part_files(run_dir, table) for table in Table if table in tables}
    every = [f for files in by_table.values() for f in files]
    if not every:
        raise RunDirError(f"{tel}: no telemetry part files — the run recorded nothing (or was cut before its first flush)")
    con = duckdb.connect()
    readable, problems = readable_parts(con, every, threads=threads)
    warnings = [f"{p} — left out of the analysis" for p in problems]
    kept, present = 0, set()
    for table, files in by_table.items():
        good = [f for f in files if f in readable]
        if good:
            # Every part was checked to carry this rankwatch's schema version, so all share one column set:
            # union by name (which reads every footer again at each query) is only needed across versions.
            _create_view(con, table, good, union_by_name=False)
            kept += len(good)
            present.add(table)
    if not kept:
        raise RunDirError(f"{tel}: none of its {len(every)} part files is readable")
    return RunStore(con=con, warnings=tuple(warnings), parts=kept, tables=frozenset(present))


# What analysis keeps in memory: each table read by several queries, with the columns they use. Tables read by one
# query (gpu, fingerprints, checkpoint phases) stay views over the files.
_MATERIALIZED: dict[Table, str] = {
    Table.TOPOLOGY: "*",
    Table.STEPS: "*",
    Table.EVENTS: "*",
    Table.COLLECTIVES: "* EXCLUDE (dtype, device_duration_ns, exit_mono_ns)",
}


def materialize(store: RunStore, *, since_step: int | None = None) -> None:
    """Read the tables several queries use into memory once (see `_MATERIALIZED`), keeping only steps from
    `since_step` on (events: every non-heartbeat event, heartbeats from that step on)."""
    for table, columns in _MATERIALIZED.items():
        if table not in store.tables:
            continue
        where = ""
        if since_step is not None and table in (Table.STEPS, Table.COLLECTIVES):
            where = f"WHERE step >= {int(since_step)}"
        elif since_step is not None and table is Table.EVENTS:
            where = f"WHERE kind <> 'heartbeat' OR step >= {int(since_step)}"
        store.con.execute(f"CREATE TABLE _m_{table} AS SELECT {columns} FROM {table} {where}")
        store.con.execute(f"DROP VIEW {table}")
        store.con.execute(f"ALTER TABLE _m_{table} RENAME TO {table}")


def readable_parts(con: duckdb.DuckDBPyConnection, files: list[Path], *,
                   threads: int = 8) -> tuple[set[Path], tuple[RunDirError, ...]]:
    """The files that are readable parquet of this rankwatch's schema version, and one error per file that is not
    (naming it). A part of another schema version raises `SchemaVersionError`: its columns could mean something
    else. One fast pass over all footers; file by file only when that pass finds something off."""
    if _versions_ok(con, files):
        return set(files), ()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        problems = list(zip(files, pool.map(_part_problem, files)))
    for _, problem in problems:
        if isinstance(problem, SchemaVersionError):
            raise problem
    bad = tuple(p for _, p in problems if isinstance(p, RunDirError))
    return {f for f, p in problems if p is None}, bad


def parquet_source(files: list[Path], *, union_by_name: bool = True) -> str:
    """A DuckDB `read_parquet(...)` over exactly `files`, hive-partitioned (rank from the path)."""
    listing = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
    by_name = "true" if union_by_name else "false"
    return f"read_parquet([{listing}], hive_partitioning=true, union_by_name={by_name})"


def _versions_ok(con: duckdb.DuckDBPyConnection, files: list[Path]) -> bool:
    """True when every file is readable parquet carrying this rankwatch's schema version (one fast pass over the
    footers in DuckDB); False when any is not, or the pass itself fails."""
    try:
        rows = con.execute(
            "SELECT count(*), count(*) FILTER (WHERE decode(value) = $2) FROM parquet_kv_metadata($1) "
            "WHERE decode(key) = $3",
            [[str(f) for f in files], str(SCHEMA_VERSION), SCHEMA_VERSION_KEY.decode()],
        ).fetchall()
    except duckdb.Error:
        return False
    total, matching = rows[0]
    return bool(total == len(files) and matching == len(files))


def _part_problem(path: Path) -> RunDirError | SchemaVersionError | None:
    try:
        check_part(path)
    except RunDirError as exc:
        return exc
    except SchemaVersionError as exc:
        return exc
    return None


def _create_view(con: duckdb.DuckDBPyConnection, table: Table, files: list[Path], *, union_by_name: bool = True) -> None:
    con.execute(f"CREATE VIEW {table} AS SELECT * FROM {parquet_source(files, union_by_name=union_by_name)}")


def table_summaries(run_dir: Path | str) -> list[TableSummary]:
    """Rows, ranks, part files and bytes per table of a run."""
    con = connect(run_dir)
    out = []
    for table in Table:
        files = part_files(run_dir, table)
        if not files:
            out.append(TableSummary(table=table, rows=0, ranks=0, files=0, bytes=0))
            continue
        rows, ranks = con.execute(f"SELECT count(*), count(DISTINCT rank) FROM {table}").fetchall()[0]
        out.append(
            TableSummary(table=table, rows=rows, ranks=ranks, files=len(files), bytes=sum(f.stat().st_size for f in files))
        )
    return out
