"""DuckDB views over a run's telemetry, with loud, one-line errors for bad input.

A table's files are its committed host rollups and the rank part files no rollup covers (`collector.rollup`); every
part file carries `rank` as a column, so the two layouts are read together, rank from the files."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from rankwatch.analytics.errors import NoDataError, PartSchemaError, RunDirError, SchemaVersionError
from rankwatch.analytics.validate import (
    ARROW_SCHEMA_KEY, SCHEMA_DIGEST_KEY, check_folders, check_keys, check_part_schema, check_schemas, data_warnings,
    read_error, row_guard, stray_tables,
)
from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.schema import (
    READABLE_VERSIONS, SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table, added_after, storage_schema,
)
from rankwatch.collector.rollup import MANIFEST, PartListing, RollupError, list_parts, table_dir


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
    """The files that hold `table`'s rows, each row once: committed host rollups, then uncovered rank parts."""
    return table_parts(run_dir, table).files


def table_parts(run_dir: Path | str, table: Table, *, rank_parts: bool = True,
                fresh_s: float | None = None) -> PartListing:
    """`part_files` with the host manifests (see `collector.rollup.list_parts`; without `rank_parts`, host parts
    only; with `fresh_s`, no rank folder of a host whose agent published within `fresh_s` seconds). Host parts of
    another schema version raise `SchemaVersionError`, naming their manifest; anything in the table folder that is
    not a rank folder raises `DamagedDataError` (`validate.check_folders`)."""
    telemetry_dir(run_dir)
    check_folders(table_dir(run_dir, table))
    try:
        listing = list_parts(run_dir, table, rank_parts=rank_parts, fresh_s=fresh_s)
    except RollupError as exc:
        raise RunDirError(str(exc)) from None
    for directory, manifest in listing.manifests:
        if manifest.schema_version not in READABLE_VERSIONS:
            raise SchemaVersionError(f"{directory / MANIFEST}: host parts of schema version {manifest.schema_version}, "
                                     f"this rankwatch reads {_readable()}")
    return listing


def check_part(path: Path) -> dict[bytes, bytes]:
    """Raise a one-line error if a part file is unreadable, of an unknown schema version or (a rank part) of other
    columns than its table's; else its footer metadata."""
    try:
        schema = pq.read_schema(path)
    except Exception as exc:
        raise RunDirError(f"{path}: unreadable parquet part ({type(exc).__name__}: {exc})") from None
    meta = schema.metadata or {}
    version = meta.get(SCHEMA_VERSION_KEY)
    if version is None or not version.isdigit() or int(version) not in READABLE_VERSIONS:
        found = version.decode(errors="replace") if version else "none"
        raise SchemaVersionError(f"{path}: schema version {found}, this rankwatch reads {_readable()}")
    check_part_schema(path, schema)
    return dict(meta)


def _readable() -> str:
    return ", ".join(str(v) for v in READABLE_VERSIONS)


def footer_version(meta: Mapping[bytes, bytes]) -> int:
    """The schema version of a part from its footer values (one `check_part` or `part_footers` accepted)."""
    raw = meta.get(SCHEMA_VERSION_KEY, b"")
    return int(raw) if raw.isdigit() else SCHEMA_VERSION


def connect(run_dir: Path | str, *, check: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table present in the run (union by name, rank from the path).
    With `check`, any unreadable part, unknown schema version or other columns raises a one-line error naming the
    file."""
    con = duckdb.connect()
    for table in Table:
        files = part_files(run_dir, table)
        if not files:
            continue
        versions = {SCHEMA_VERSION}
        if check:
            versions = {footer_version(check_part(f)) for f in files}
        _create_view(con, table, files, versions=versions)
    return con


@dataclass(frozen=True, kw_only=True, slots=True)
class RunStore:
    """A connection over a run's readable parts, and one warning per part file left out (naming the file)."""

    con: duckdb.DuckDBPyConnection
    warnings: tuple[str, ...]
    parts: int
    tables: frozenset[Table]
    """Tables with at least one readable part."""
    files: Mapping[Table, tuple[Path, ...]] = field(default_factory=dict)
    """The readable parts of each table (what the views read)."""
    left_out: tuple[str, ...] = ()
    """The part files left out (cut short, unreadable), one line each naming the file: the analysis is partial."""


RELIST_TRIES = 5
"""How many times a reader lists a table again when a listed rank part was deleted by a rollup meanwhile."""

ANALYZED_TABLES: frozenset[Table] = frozenset(Table) - {Table.PHASES}
"""Tables the detectors read (phases are for people, not for detection)."""


def open_run(run_dir: Path | str, *, tables: Collection[Table] = ANALYZED_TABLES, threads: int = 8,
             modified_since_ns: int | None = None) -> RunStore:
    """Open a run for analysis: one view per table over its readable parts. A part file that cannot be read (cut
    short, not parquet) is left out with a warning naming it; a part of an unknown schema version is an error,
    because its columns could mean something else; a run with no telemetry at all is an error. `materialize`
    then reads what many queries share into memory once. With `modified_since_ns`, only the parts modified since
    then (a live reader's increment: rows newer than a snapshot are only in parts written after it)."""
    tel = telemetry_dir(run_dir)
    con = duckdb.connect()
    for _ in range(RELIST_TRIES):
        by_table = {table: _modified_since(part_files(run_dir, table), modified_since_ns)
                    for table in Table if table in tables}
        every = [f for files in by_table.values() for f in files]
        if not every:
            raise RunDirError(f"{tel}: no telemetry part files — the run recorded nothing (or was cut before its first "
                              "flush)")
        meta, problems = part_footers(con, every, threads=threads)
        readable = set(meta)
        if not any(not f.exists() for f in every if f not in readable):
            break
        # a rank part was deleted after a host rollup covering it was published: the listing is stale, list again
    warnings = [*stray_tables(tel), *(f"{p} — left out of the analysis" for p in problems)]
    kept, present, read = 0, set(), {}
    for table, files in by_table.items():
        good = [f for f in files if f in readable]
        if good:
            # Every part was checked to carry a readable schema version and (rank parts) that version's columns, so
            # parts of one version share one column set: union by name (which reads every footer again at each
            # query) is only needed across versions.
            versions = {footer_version(meta[f]) for f in good}
            _create_view(con, table, good, union_by_name=False, versions=versions)
            kept += len(good)
            present.add(table)
            read[table] = tuple(good)
    if not kept:
        raise RunDirError(f"{tel}: none of its {len(every)} part files is readable")
    return RunStore(con=con, warnings=tuple(warnings), parts=kept, tables=frozenset(present), files=read,
                    left_out=tuple(str(p) for p in problems))


def _modified_since(files: list[Path], since_ns: int | None) -> list[Path]:
    if since_ns is None:
        return files
    out = []
    for f in files:
        try:
            if f.stat().st_mtime_ns >= since_ns:
                out.append(f)
        except OSError:
            continue  # replaced by a rollup meanwhile: the listing is relisted below
    return out


def check_store(store: RunStore, run_dir: Path | str, *, since_step: int | None = None) -> tuple[str, ...]:
    """The checks on an opened (and materialized) run's rows: repeated row keys raise `DamagedDataError` naming the
    files (from `since_step` on), a run without a row raises `NoDataError`; returns one warning per table the
    detectors need that is missing or empty. Rank and value ranges are checked inside the reads (`row_guard`)."""
    check_keys(store.con, store.tables, store.files, since_step=since_step)
    return data_warnings(store.con, store.tables, telemetry_dir(run_dir))


# What analysis keeps in memory: each table read by several queries, with the columns they use, and the small tables
# whose row keys `check_store` counts (fingerprints, checkpoint phases: a second read of their files would cost more
# than holding them). The GPU table, read by one query, stays a view over the files.
_MATERIALIZED: dict[Table, str] = {
    Table.TOPOLOGY: "*",
    Table.STEPS: "*",
    Table.EVENTS: "*",
    Table.COLLECTIVES: "* EXCLUDE (dtype)",
    Table.FINGERPRINTS: "*",
    Table.CHECKPOINT_PHASES: "*",
}


_UNANALYZED: dict[Table, str] = {
    # read by no detector (queries.gpu aggregates the rest); a GPU sample has the most columns of any table, and a
    # parquet reader pays per column chunk, so a live monitor reading every host's new part leaves them on disk
    Table.GPU: "* EXCLUDE (device_index, pci_bus_id, source, wall_ns, mono_ns, mem_clock_mhz, mem_util_pct, "
               "mem_used_bytes, ecc_sbe_aggregate, ecc_dbe_aggregate, remapped_rows_pending)",
}


def analyzed_columns(table: Table) -> str:
    """The column list analysis keeps in memory for `table` (a DuckDB select list: "*" or "* EXCLUDE (...)")."""
    return _MATERIALIZED.get(table) or _UNANALYZED.get(table, "*")


def attach(store: RunStore, run_dir: Path | str, table: Table) -> RunStore:
    """`store` with a view over `table` too (a table `open_run` was not asked for, e.g. the phases a device-clock
    analysis reads): its unreadable parts are left out with a warning naming each, as `open_run` does."""
    if table in store.tables:
        return store
    files = part_files(run_dir, table)
    if not files:
        return store
    meta, problems = part_footers(store.con, files)
    good = [f for f in files if f in meta]
    if not good:
        return replace(store, warnings=(*store.warnings, *(f"{p} — left out of the analysis" for p in problems)))
    _create_view(store.con, table, good, union_by_name=False, versions={footer_version(meta[f]) for f in good})
    return replace(store, warnings=(*store.warnings, *(f"{p} — left out of the analysis" for p in problems)),
                   parts=store.parts + len(good), tables=store.tables | {table},
                   files={**store.files, table: tuple(good)})


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
    meta, problems = part_footers(con, files, threads=threads)
    return set(meta), problems


def part_footers(con: duckdb.DuckDBPyConnection, files: list[Path], *, keys: Collection[bytes] = (),
                 threads: int = 8) -> tuple[dict[Path, dict[bytes, bytes]], tuple[RunDirError, ...]]:
    """`readable_parts`, with the footer metadata values of `keys` of each readable file, read in the same pass."""
    wanted = {SCHEMA_VERSION_KEY, *keys}
    fast = _footers_fast(con, files, wanted)
    if fast is not None:
        check_schemas(fast)
        return {f: {k: v for k, v in m.items() if k in wanted} for f, m in fast.items()}, ()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        checked = list(zip(files, pool.map(_part_problem, files)))
    for _, problem in checked:
        if isinstance(problem, (SchemaVersionError, PartSchemaError)):
            raise problem
    bad = tuple(p for _, p in checked if isinstance(p, RunDirError))
    good = {f: {k: v for k, v in p.items() if k in wanted} for f, p in checked if isinstance(p, dict)}
    return good, bad


def parquet_source(files: list[Path], *, union_by_name: bool = True, row_number: bool = False,
                   table: Table | None = None, versions: Collection[int] = (SCHEMA_VERSION,)) -> str:
    """A DuckDB relation over exactly `files`: rank from the files (a host rollup holds many ranks), as BIGINT like
    the hive-partitioned rank layout gave it. With `row_number`, each row's 0-based place in its file as
    `file_row_number`. Reading it raises, naming the file, at a row no collector writes (`validate.row_guard`: a
    rank other than its folder's, negative durations of `table`)."""
    listing = ", ".join("'" + str(f).replace("'", "''") + "'" for f in files)
    older = min(versions, default=SCHEMA_VERSION) < SCHEMA_VERSION
    by_name = "true" if union_by_name or older else "false"
    extra = ", file_row_number=true" if row_number else ""
    added = ""
    if older and table is not None:  # columns no listed part has read as null (parts of several versions: by name)
        types = {f.name: f.type for f in storage_schema(table)}
        added = "".join(f", CAST(NULL AS {_SQL_TYPES[str(types[c.name])]}) AS {c.name}"
                        for c in added_after(table, max(versions)))
    return (f"(SELECT * REPLACE (CAST(rank AS BIGINT) AS rank){added} "
            f"FROM read_parquet([{listing}], hive_partitioning=false, union_by_name={by_name}{extra}) "
            f"WHERE {row_guard(table, files)})")


_SQL_TYPES = {"int32": "INTEGER", "int64": "BIGINT", "double": "DOUBLE", "string": "VARCHAR", "bool": "BOOLEAN"}
"""DuckDB types of the columns a schema version may add (scalar columns only)."""


def _footers_fast(con: duckdb.DuckDBPyConnection, files: list[Path], keys: Collection[bytes]
                  ) -> dict[Path, dict[bytes, bytes]] | None:
    """The `keys` footer values of every file when every file is readable parquet carrying a readable schema
    version (one pass over the footers in DuckDB); None when any is not, or the pass itself fails."""
    if not files:
        return {}
    try:
        # the arrow schema comes back as its md5 (`validate.check_schemas` reads one footer per distinct value)
        rows = con.execute(
            "SELECT file_name, key, CASE WHEN decode(key) = $3 THEN md5(value)::BLOB ELSE value END "
            "FROM parquet_kv_metadata($1) WHERE list_contains($2, decode(key))",
            [[str(f) for f in files], sorted({*(k.decode() for k in keys), ARROW_SCHEMA_KEY.decode()}),
             ARROW_SCHEMA_KEY.decode()],
        ).fetchall()
    except duckdb.Error:
        return None
    by_name: dict[str, dict[bytes, bytes]] = {}
    for name, key, value in rows:
        k = bytes(key)
        by_name.setdefault(str(name), {})[SCHEMA_DIGEST_KEY if k == ARROW_SCHEMA_KEY else k] = bytes(value)
    versions = {str(v).encode() for v in READABLE_VERSIONS}
    out = {}
    for f in files:
        got = by_name.get(str(f))
        if got is None or got.get(SCHEMA_VERSION_KEY) not in versions:
            return None
        out[f] = got
    return out


def _part_problem(path: Path) -> RunDirError | SchemaVersionError | dict[bytes, bytes]:
    """What is wrong with a part, or its footer metadata."""
    try:
        return check_part(path)
    except (RunDirError, SchemaVersionError) as exc:
        return exc


def _create_view(con: duckdb.DuckDBPyConnection, table: Table, files: list[Path], *, union_by_name: bool = True,
                 versions: Collection[int] = (SCHEMA_VERSION,)) -> None:
    source = parquet_source(files, union_by_name=union_by_name, table=table, versions=versions)
    con.execute(f"CREATE VIEW {table} AS SELECT * FROM {source}")


def check_run(run_dir: Path | str) -> tuple[RunStore, tuple[str, ...]]:
    """Every table of a run opened with the checks analysis makes (`open_run`, `check_store`), for a command that
    reports what the run holds rather than what happened in it: damage raises a one-line error; parts left out,
    missing tables and a run without any row are warnings."""
    store = open_run(run_dir, tables=frozenset(Table))
    found = list(store.warnings)
    try:
        found.extend(check_store(store, run_dir))
    except NoDataError as exc:
        found.append(str(exc))
    except duckdb.Error as exc:
        raise read_error(exc, telemetry_dir(run_dir)) from None
    return store, tuple(found)


def table_summaries(run_dir: Path | str, *, warnings: list[str] | None = None) -> list[TableSummary]:
    """Rows, ranks, part files and bytes per table of a run (`check_run`'s warnings appended to `warnings`)."""
    store, found = check_run(run_dir)
    if warnings is not None:
        warnings.extend(found)
    con = store.con
    out = []
    for table in Table:
        files = list(store.files.get(table, ()))
        if not files:
            out.append(TableSummary(table=table, rows=0, ranks=0, files=0, bytes=0))
            continue
        try:
            rows, ranks = con.execute(f"SELECT count(*), count(DISTINCT rank) FROM {table}").fetchall()[0]
        except duckdb.Error as exc:
            raise read_error(exc, telemetry_dir(run_dir)) from None
        out.append(
            TableSummary(table=table, rows=rows, ranks=ranks, files=len(files), bytes=sum(f.stat().st_size for f in files))
        )
    return out
