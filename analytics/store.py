"""DuckDB views over a run's hive-partitioned telemetry, with loud, one-line errors for bad input."""

from __future__ import annotations

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
    """An in-memory DuckDB with one view per table present in the run (union by name, rank from the path)."""
    con = duckdb.connect()
    tel = telemetry_dir(run_dir)
    for table in Table:
        files = part_files(run_dir, table)
        if not files:
            continue
        if check:
            for f in files:
                check_part(f)
        glob = str(tel / str(table) / "rank=*" / "part-*.parquet").replace("'", "''")
        con.execute(
            f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{glob}', hive_partitioning=true, union_by_name=true)"
        )
    return con


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
