"""Host rollups: a per-node agent merges its ranks' small part files into one part per host and table.

Each rank writes its own part files (``<run>/telemetry/<table>/rank=<r>/part-<n>.parquet``). A monitor reading a
2,048-rank run pays about a millisecond per small file however it reads it; an agent on each host spreads that cost
over the hosts by merging the new parts of its ranks into one host part per table:

    <run>/telemetry/<table>/_rollup/host=<h>/part-<seq>.parquet   rows of several rank parts, in (rank, part) order
    <run>/telemetry/<table>/_rollup/host=<h>/_manifest.json       the commit point

``_rollup`` matches no ``rank=*`` pattern, so hive-partitioned reads of the rank layout are unaffected; every part
file carries ``rank`` as a column, so readers of the mixed layout read it from the files.

The protocol, per host and table (a crash at any point leaves readers a consistent view):

1. merge the rank parts not yet covered, write the host part under a temporary name, fsync and rename it. Until
   step 2 it is an orphan: no manifest lists it, no reader opens it, the next rollup deletes it.
2. publish the manifest (temporary name, fsync, ``os.replace``, fsync of the folder). It lists the host parts and,
   per rank, the highest rank part number covered (the watermark) and the numbers at or below it that are not
   covered (parts cut short or of another schema version, left for the readers' warning path).
3. delete covered rank parts: only once the manifest covering them has been published for `keep_s` seconds (a
   reader that listed them before the publish has that long to read them), and never a rank's newest part (a
   restarted rank's sink numbers its next part after the newest one it finds).

Readers (`list_parts`) list the rank parts first and read the manifests second: a rank part gone by then was
deleted after a manifest that covers it was published, so the manifest read second lists its rows; a rank part
listed that a manifest covers is skipped. No row is seen twice or missed, at any instant. (A reader still opening
the files of a listing `keep_s` after it was made may find a covered rank part deleted: it lists again, as
`analytics.store.open_run` and `analytics.live.LiveAnalyzer` do.)

A host part's footer names what it covers (``rankwatch.rollup.covers``: ``[[rank, part, rows], ...]`` in row
order), so a live reader that already read some of those rank parts can skip exactly their rows.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from rankwatch.base.rundir import TELEMETRY_DIR, atomic_write
from rankwatch.base.schema import PARTITION_KEY, SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table, Topology, storage_schema

ROLLUP_DIR = "_rollup"
MANIFEST = "_manifest.json"
COVERS_KEY = b"rankwatch.rollup.covers"
"""Host part footer key: JSON ``[[rank, rank part number, rows], ...]`` in the order of the host part's rows."""
MANIFEST_FORMAT = 1
DEFAULT_KEEP_S = 120.0

_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
_RANK_DIR_RE = re.compile(rf"^{PARTITION_KEY}=(\d+)$")
_LOCK = ".lock"


_NONE: frozenset[int] = frozenset()


class RollupError(ValueError):
    """A rollup folder or manifest that cannot be read, or rollups that contradict each other (one line, naming the
    file)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCoverage:
    """Which part files of one rank a host manifest covers."""

    upto: int
    """Highest rank part number covered."""
    uncovered: frozenset[int] = _NONE
    """Part numbers at or below `upto` that are not covered (cut short when the rollup ran, or another schema
    version): readers read them as rank parts."""

    def covers(self, part: int) -> bool:
        return part <= self.upto and part not in self.uncovered


@dataclass(frozen=True, kw_only=True, slots=True)
class HostManifest:
    """The committed state of one host's rollups of one table."""

    table: Table
    host: str
    schema_version: int = SCHEMA_VERSION
    """Schema version of every host part listed (rollups merge only rank parts of the version they write)."""
    parts: tuple[str, ...] = ()
    """Host part file names, oldest first."""
    ranks: Mapping[int, RankCoverage] = field(default_factory=dict)
    generations: tuple[tuple[float, Mapping[int, int]], ...] = ()
    """(publish time in Unix seconds, watermark per rank) of recent publishes: what may be deleted when."""

    def to_json(self) -> str:
        return json.dumps({
            "format": MANIFEST_FORMAT, "table": str(self.table), "host": self.host,
            "schema_version": self.schema_version, "parts": list(self.parts),
            "ranks": {str(r): [c.upto, sorted(c.uncovered)] for r, c in sorted(self.ranks.items())},
            "generations": [[t, {str(r): n for r, n in sorted(w.items())}] for t, w in self.generations],
        })

    @staticmethod
    def from_json(text: str | bytes, *, path: Path) -> HostManifest:
        try:
            doc = json.loads(text)
            if doc.get("format") != MANIFEST_FORMAT:
                raise RollupError(f"{path}: rollup manifest format {doc.get('format')!r}, this rankwatch reads "
                                  f"{MANIFEST_FORMAT}")
            return HostManifest(
                table=Table(doc["table"]), host=str(doc["host"]), schema_version=int(doc["schema_version"]),
                parts=tuple(str(p) for p in doc["parts"]),
                ranks={int(r): RankCoverage(upto=int(u), uncovered=frozenset(int(x) for x in unc) if unc else _NONE)
                       for r, (u, unc) in doc["ranks"].items()},
                generations=tuple((float(t), {int(r): int(n) for r, n in w.items()}) for t, w in doc["generations"]),
            )
        except RollupError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise RollupError(f"{path}: unreadable rollup manifest ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class PartListing:
    """What a reader of one table reads: committed host parts and the rank parts no manifest covers."""

    host_parts: tuple[Path, ...]
    rank_parts: tuple[Path, ...]
    coverage: Mapping[int, RankCoverage]
    """Per rank, what the host parts cover."""
    manifests: tuple[tuple[Path, HostManifest], ...] = ()
    """Each host folder with its manifest."""

    @property
    def files(self) -> list[Path]:
        return [*self.host_parts, *self.rank_parts]


@dataclass(frozen=True, kw_only=True, slots=True)
class TableRollup:
    table: Table
    part: Path | None
    """The host part written; None when no rank part was new."""
    rank_parts: int
    """Rank parts the host part covers."""
    rows: int
    deleted: int
    """Covered rank parts deleted by this rollup."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RollupResult:
    host: str
    ranks: tuple[int, ...]
    tables: tuple[TableRollup, ...]
    warnings: tuple[str, ...]
    """One line per rank part left alone (cut short, another schema version), naming it."""
    seconds: float

    @property
    def rank_parts(self) -> int:
        return sum(t.rank_parts for t in self.tables)

    @property
    def host_parts(self) -> int:
        return sum(t.part is not None for t in self.tables)


# -- paths and listing ---------------------------------------------------------------------------------------------


def table_dir(run_dir: Path | str, table: Table) -> Path:
    return Path(run_dir) / TELEMETRY_DIR / str(table)


def host_dir(run_dir: Path | str, table: Table, host: str) -> Path:
    """``<run>/telemetry/<table>/_rollup/host=<h>``, the host name percent-quoted so that any name is one folder."""
    if not host:
        raise ValueError("host rollup: empty host name")
    return table_dir(run_dir, table) / ROLLUP_DIR / f"host={quote(host, safe='')}"


def part_number(path: Path) -> int | None:
    m = _PART_RE.match(path.name)
    return int(m.group(1)) if m else None


def rank_of_part(path: Path) -> int | None:
    """The rank of a rank-layout part file (from its folder), None for any other path."""
    m = _RANK_DIR_RE.match(path.parent.name)
    return int(m.group(1)) if m else None


def _part_numbers(directory: str) -> list[tuple[int, str]]:
    """(part number, file name) of the part files in `directory`, ascending; none if it does not exist."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if name.startswith("part-") and name.endswith(".parquet") and name[5:-8].isdecimal():
            out.append((int(name[5:-8]), name))
    out.sort()
    return out


def _rank_dirs(base: str, ranks: Collection[int] | None, skip: Collection[int] = ()) -> list[tuple[int, str]]:
    if ranks is not None:
        return [(r, os.path.join(base, f"{PARTITION_KEY}={r}")) for r in ranks if r not in skip]
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    prefix = f"{PARTITION_KEY}="
    cut = len(prefix)
    base = base.rstrip("/") + "/"
    out = []
    for n in names:
        if n.startswith(prefix) and n[cut:].isdecimal():
            r = int(n[cut:])
            if r not in skip:
                out.append((r, base + n))
    return out


def rank_parts(run_dir: Path | str, table: Table, ranks: Collection[int] | None = None) -> dict[int, list[tuple[int, Path]]]:
    """Per rank (all, or `ranks`): its part files of `table` as (part number, path), ascending."""
    out: dict[int, list[tuple[int, Path]]] = {}
    for rank, d in _rank_dirs(str(table_dir(run_dir, table)), ranks):
        parts = _part_numbers(d)
        if parts:
            out[rank] = [(n, Path(d, name)) for n, name in parts]
    return out


def read_manifest(directory: Path) -> HostManifest | None:
    """The manifest of one host folder, None if it has none yet."""
    return _read_manifest(os.path.join(directory, MANIFEST))


def _read_manifest(path: str) -> HostManifest | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise RollupError(f"{path}: unreadable rollup manifest ({type(exc).__name__}: {exc})") from None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError as exc:
        raise RollupError(f"{path}: unreadable rollup manifest ({type(exc).__name__}: {exc})") from None
    finally:
        os.close(fd)
    return HostManifest.from_json(b"".join(chunks), path=Path(path))


def manifests(run_dir: Path | str, table: Table) -> list[tuple[Path, HostManifest]]:
    """Every committed host manifest of `table` with its folder."""
    root = os.path.join(table_dir(run_dir, table), ROLLUP_DIR)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.startswith("host="):
            folder = os.path.join(root, name)
            m = _read_manifest(os.path.join(folder, MANIFEST))
            if m is not None:
                out.append((Path(folder), m))
    return out


def _list_rank_dirs(base: str, *, skip: Collection[int] = (), threads: int = 2
                    ) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """(rank, folder, its parts) of every rank folder but those of `skip`; a few threads, since listing a folder
    releases the GIL."""
    dirs = _rank_dirs(base, None, skip)

    def chunk(part: list[tuple[int, str]]) -> list[tuple[int, str, list[tuple[int, str]]]]:
        return [(rank, d, _part_numbers(d)) for rank, d in part]

    if len(dirs) < 256:
        return chunk(dirs)
    size = -(-len(dirs) // threads)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [x for part in pool.map(chunk, [dirs[i:i + size] for i in range(0, len(dirs), size)]) for x in part]


def list_parts(run_dir: Path | str, table: Table, *, rank_parts: bool = True,
               fresh_s: float | None = None) -> PartListing:
    """The files to read for `table`: committed host parts plus the rank parts no manifest covers (without
    `rank_parts`, host parts only: no rank folder is listed). Rank parts are listed before the manifests are read
    (see the module docstring for why that order never loses or repeats a row). Raises `RollupError` when two host
    manifests cover the same rank.

    With `fresh_s` (a live reader's setting), the folders of ranks whose host manifest was published within the last
    `fresh_s` seconds are not listed: their agent is running, and their newest parts arrive in its next host part.
    The ranks of a host whose agent stopped, or never ran, are listed as without rollups. Here the manifests are read
    first; a rank part that a manifest published meanwhile covers is listed as a rank part (a reader that keeps
    what it read, `analytics.live`, skips its rows in the host part later), and none is deleted before `keep_s`."""
    base = str(table_dir(run_dir, table))
    if rank_parts and fresh_s is not None:
        hosts = manifests(run_dir, table)
        now = time.time()
        fresh = {r: cov for _, m in hosts if m.generations and now - m.generations[-1][0] <= fresh_s
                 for r, cov in m.ranks.items()}
        listed = _list_rank_dirs(base, skip=fresh)
        # what a fresh manifest leaves below its watermark (parts cut short, another schema version) is still
        # read as rank parts (readers warn about them), found without listing the folder
        for r, cov in fresh.items():
            if cov.uncovered:
                folder = os.path.join(base, f"{PARTITION_KEY}={r}")
                found = [(n, f"part-{n:06d}.parquet") for n in sorted(cov.uncovered)]
                listed.append((r, folder, [(n, name) for n, name in found
                                           if os.path.exists(os.path.join(folder, name))]))
    else:
        listed = _list_rank_dirs(base) if rank_parts else []
        hosts = manifests(run_dir, table)
    coverage: dict[int, RankCoverage] = {}
    owner: dict[int, Path] = {}
    host_files: list[Path] = []
    for d, m in hosts:
        for r, cov in m.ranks.items():
            if r in coverage:
                raise RollupError(f"{d / MANIFEST}: covers rank {r}, which {owner[r] / MANIFEST} covers too "
                                  "(two rollup agents for one rank)")
            coverage[r] = cov
            owner[r] = d
        host_files.extend(d / p for p in m.parts)
    loose: list[Path] = []
    for rank, folder, parts in sorted(listed):
        got = coverage.get(rank)
        if got is None:
            loose.extend(Path(folder, name) for _, name in parts)
        else:
            loose.extend(Path(folder, name) for n, name in parts if not got.covers(n))
    return PartListing(host_parts=tuple(host_files), rank_parts=tuple(loose), coverage=coverage,
                       manifests=tuple(hosts))


def read_covers(raw: bytes | None, *, path: Path) -> tuple[tuple[int, int, int], ...]:
    """The (rank, rank part number, rows) a host part covers, in row order, from its footer value of `COVERS_KEY`."""
    if raw is None:
        raise RollupError(f"{path}: host part without {COVERS_KEY.decode()} metadata")
    try:
        return tuple((int(r), int(n), int(k)) for r, n, k in json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise RollupError(f"{path}: unreadable {COVERS_KEY.decode()} metadata ({exc})") from None


# -- which ranks live on which host ----------------------------------------------------------------------------------


def host_ranks(run_dir: Path | str) -> dict[str, tuple[int, ...]]:
    """Host -> its ranks, from the topology table (committed host parts and rank parts). A rank belongs to the host
    of its first start, for good: a restart elsewhere must not hand its parts to a second agent."""
    return _host_ranks(run_dir)[0]


def _host_ranks(run_dir: Path | str, *, threads: int = 8) -> tuple[dict[str, tuple[int, ...]], int]:
    files = list_parts(run_dir, Table.TOPOLOGY).files
    cols = [str(Topology.RANK), str(Topology.ATTEMPT), str(Topology.START_WALL_NS), str(Topology.HOST),
            str(Topology.WORLD_SIZE)]

    def read(path: Path) -> pa.Table | None:
        try:
            return pq.read_table(path, columns=cols)
        except (OSError, pa.ArrowException):
            return None  # cut short or gone: that rank is assigned once a readable topology row exists

    with ThreadPoolExecutor(max_workers=threads) as pool:
        tables = [t for t in pool.map(read, files) if t is not None]
    first: dict[int, tuple[int, int, str]] = {}
    world = 0
    for t in tables:
        for rank, attempt, start, host, size in zip(*(t.column(c).to_pylist() for c in cols)):
            key = (int(attempt), int(start), str(host))
            if rank not in first or key < first[rank]:
                first[int(rank)] = key
            world = max(world, int(size))
    out: dict[str, list[int]] = {}
    for rank, (_, _, host) in sorted(first.items()):
        out.setdefault(host, []).append(rank)
    return {h: tuple(r) for h, r in out.items()}, world


# -- the rollup ------------------------------------------------------------------------------------------------------


def rollup(run_dir: Path | str, host: str, *, ranks: Collection[int] | None = None,
           tables: Collection[Table] = tuple(Table), delete: bool = True, keep_s: float = DEFAULT_KEEP_S,
           compression: str = "zstd", fsync: bool = True) -> RollupResult:
    """Merge the rank parts of `host`'s ranks that no manifest covers yet into one host part per table, publish the
    manifests, then (with `delete`) delete rank parts covered for at least `keep_s` seconds, except each rank's
    newest. `ranks` defaults to the host's ranks in the topology table. Raises `RollupError` if another rollup of
    the same host and table is running or the host's manifest is unreadable."""
    t0 = time.perf_counter()
    run = Path(run_dir)
    if not host:
        raise ValueError("host rollup: empty host name")
    if not (run / TELEMETRY_DIR).is_dir():
        raise RollupError(f"{run}: no {TELEMETRY_DIR}/ folder — not a rankwatch run")
    if ranks is None:
        mine = host_ranks(run).get(host, ())
    else:
        mine = tuple(sorted(set(ranks)))
    results: list[TableRollup] = []
    warnings: list[str] = []
    for table in Table:
        if table in tables and mine:
            res, warn = _rollup_table(run, table, host, mine, delete=delete, keep_s=keep_s,
                                      compression=compression, fsync=fsync)
            results.append(res)
            warnings.extend(warn)
    return RollupResult(host=host, ranks=mine, tables=tuple(results), warnings=tuple(warnings),
                        seconds=time.perf_counter() - t0)


def rollup_all(run_dir: Path | str, *, delete: bool = True, keep_s: float = DEFAULT_KEEP_S) -> dict[str, RollupResult]:
    """`rollup` every host of the run's topology in turn (what one agent per host would do): host -> result."""
    return {h: rollup(run_dir, h, ranks=r, delete=delete, keep_s=keep_s) for h, r in host_ranks(run_dir).items()}


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RollupError(f"{directory}: another rollup of this host and table is running") from None
        yield
    finally:
        os.close(fd)


def _rollup_table(run: Path, table: Table, host: str, ranks: Sequence[int], *, delete: bool, keep_s: float,
                  compression: str, fsync: bool) -> tuple[TableRollup, list[str]]:
    directory = host_dir(run, table, host)
    with _locked(directory):
        old = read_manifest(directory) or HostManifest(table=table, host=host)
        if old.table is not table or old.host != host:
            raise RollupError(f"{directory / MANIFEST}: names {old.table}/{old.host}, expected {table}/{host}")
        if old.schema_version != SCHEMA_VERSION:
            raise RollupError(f"{directory / MANIFEST}: host parts of schema version {old.schema_version}, this "
                              f"rankwatch writes {SCHEMA_VERSION}")
        _remove_orphans(directory, old)
        parts = rank_parts(run, table, ranks)
        chunks, covers, warnings, failed = _read_new(table, parts, old.ranks)
        written: Path | None = None
        manifest = old
        if chunks:
            written = _write_host_part(directory, old, table, chunks, covers, compression=compression, fsync=fsync)
            manifest = _next_manifest(old, written.name, covers, failed, now=time.time(), keep_s=keep_s)
            _publish(directory, manifest, fsync=fsync)
        deleted = _delete_covered(parts, manifest, now=time.time(), keep_s=keep_s) if delete else 0
    rows = sum(k for _, _, k in covers)
    return TableRollup(table=table, part=written, rank_parts=len(covers), rows=rows, deleted=deleted), warnings


def _remove_orphans(directory: Path, manifest: HostManifest) -> None:
    """Host parts no manifest lists (a rollup stopped before its publish) and temporary files: nobody reads them."""
    listed = set(manifest.parts)
    for e in os.scandir(directory):
        if e.name in (MANIFEST, _LOCK) or e.name in listed:
            continue
        if _PART_RE.match(e.name) or e.name.endswith(".tmp"):
            os.unlink(e.path)


def _read_new(table: Table, parts: Mapping[int, list[tuple[int, Path]]], covered: Mapping[int, RankCoverage]
              ) -> tuple[list[pa.Table], list[tuple[int, int, int]], list[str], dict[int, set[int]]]:
    """Read the rank parts no manifest covers yet. Returns their tables and (rank, part, rows) in order, a warning per
    part left alone, and per rank the numbers of the parts left alone."""
    want = storage_schema(table).remove_metadata()
    # only parts above the watermark: one left alone below it stays a rank part for good (readers read it)
    todo = [(r, n, p) for r, ps in sorted(parts.items()) for n, p in ps if r not in covered or n > covered[r].upto]
    with ThreadPoolExecutor(max_workers=8) as pool:
        read = list(pool.map(lambda item: _read_part(item[2], want), todo))
    chunks: list[pa.Table] = []
    covers: list[tuple[int, int, int]] = []
    warnings: list[str] = []
    failed: dict[int, set[int]] = {}
    for (rank, n, path), got in zip(todo, read):
        if isinstance(got, str):
            if got:  # "" = the part vanished (not ours to cover)
                warnings.append(f"{path}: {got} — left as a rank part")
            failed.setdefault(rank, set()).add(n)
            continue
        chunks.append(got)
        covers.append((rank, n, got.num_rows))
    return chunks, covers, warnings, failed


def _read_part(path: Path, want: pa.Schema) -> pa.Table | str:
    """The part's rows in the storage schema (without metadata), or why it is left alone ("" if it is gone)."""
    try:
        data = pq.read_table(path)
    except FileNotFoundError:
        return ""
    except (OSError, pa.ArrowException) as exc:
        return f"unreadable parquet part ({type(exc).__name__}: {exc})"
    version = (data.schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None or version != str(SCHEMA_VERSION).encode():
        return f"schema version {version.decode() if version else 'none'}, this rankwatch writes {SCHEMA_VERSION}"
    data = data.replace_schema_metadata(None)
    if not data.schema.equals(want):
        return "columns differ from the storage schema"
    return data


def _write_host_part(directory: Path, old: HostManifest, table: Table, chunks: list[pa.Table],
                     covers: list[tuple[int, int, int]], *, compression: str, fsync: bool) -> Path:
    existing = [n for e in os.scandir(directory) if (n := part_number(Path(e.name))) is not None]
    seq = max([*existing, *(part_number(Path(p)) or 0 for p in old.parts), -1]) + 1
    meta = dict(storage_schema(table).metadata or {})
    meta[COVERS_KEY] = json.dumps(covers, separators=(",", ":")).encode()
    data = pa.concat_tables(chunks).replace_schema_metadata(meta)
    final = directory / f"part-{seq:06d}.parquet"
    return atomic_write(final, lambda tmp: pq.write_table(data, tmp, compression=compression), durable=fsync)


def _next_manifest(old: HostManifest, part: str, covers: list[tuple[int, int, int]], failed: Mapping[int, set[int]],
                   *, now: float, keep_s: float) -> HostManifest:
    ranks = dict(old.ranks)
    new_by_rank: dict[int, set[int]] = {}
    for r, n, _ in covers:
        new_by_rank.setdefault(r, set()).add(n)
    for r, got in new_by_rank.items():
        prev = ranks.get(r)
        upto = max([*got, prev.upto if prev else -1])
        # below the watermark, not covered: the earlier exceptions and the parts this rollup left alone
        uncovered = (prev.uncovered if prev else frozenset()) | {n for n in failed.get(r, ()) if n <= upto}
        ranks[r] = RankCoverage(upto=upto, uncovered=frozenset(uncovered))
    generations = (*old.generations, (now, {r: c.upto for r, c in ranks.items()}))
    # keep the publishes younger than keep_s and the newest older one (it says what may be deleted now)
    older = [g for g in generations if g[0] <= now - keep_s]
    kept = tuple(g for g in generations if g[0] > now - keep_s)
    return HostManifest(table=old.table, host=old.host, schema_version=old.schema_version, parts=(*old.parts, part),
                        ranks=ranks, generations=(*older[-1:], *kept))


def _publish(directory: Path, manifest: HostManifest, *, fsync: bool) -> None:
    """The commit point: the manifest replaced atomically, durably when `fsync`."""
    atomic_write(directory / MANIFEST, manifest.to_json(), durable=fsync)


def _delete_covered(parts: Mapping[int, list[tuple[int, Path]]], manifest: HostManifest, *, now: float,
                    keep_s: float) -> int:
    """Delete rank parts a publish at least `keep_s` old covers, except each rank's newest part."""
    due = [w for t, w in manifest.generations if t <= now - keep_s]
    if not due:
        return 0
    watermark = due[-1]
    deleted = 0
    for rank, ps in parts.items():
        cov = manifest.ranks.get(rank)
        upto = watermark.get(rank)
        if cov is None or upto is None:
            continue
        for n, path in ps[:-1]:  # the newest stays: a restarted sink numbers after it
            if n <= upto and cov.covers(n):
                try:
                    path.unlink()
                    deleted += 1
                except FileNotFoundError:
                    pass
    return deleted


# -- the agent loop --------------------------------------------------------------------------------------------------


def run_agent(run_dir: Path | str, hosts: Sequence[str] | None = None, *, interval_s: float = 30.0,
              rounds: int | None = None, delete: bool = True, keep_s: float = DEFAULT_KEEP_S,
              report: Callable[[list[RollupResult]], None] | None = None,
              stop: threading.Event | None = None) -> list[RollupResult]:
    """Roll up `hosts` (None: every host in the topology) every `interval_s` seconds, `rounds` times (None: until
    `stop` is set). The host -> ranks assignment is read from the topology until it names the whole world, then
    kept. `report` gets each round's results; returns the last round's."""
    if not (Path(run_dir) / TELEMETRY_DIR).is_dir():
        raise RollupError(f"{run_dir}: no {TELEMETRY_DIR}/ folder — not a rankwatch run")
    stop = stop or threading.Event()
    assignment: dict[str, tuple[int, ...]] = {}
    complete = False
    done = 0
    last: list[RollupResult] = []
    while True:
        if not complete:
            assignment, complete = _assignment(run_dir)
        targets = sorted(assignment) if hosts is None else list(hosts)
        last = [rollup(run_dir, h, ranks=assignment.get(h, ()), delete=delete, keep_s=keep_s) for h in targets]
        if report is not None:
            report(last)
        done += 1
        if (rounds is not None and done >= rounds) or stop.wait(interval_s):
            return last


def _assignment(run_dir: Path | str) -> tuple[dict[str, tuple[int, ...]], bool]:
    """Host -> ranks, and whether every rank of the world size the topology states has a host."""
    assignment, world = _host_ranks(run_dir)
    return assignment, world > 0 and sum(len(r) for r in assignment.values()) >= world
