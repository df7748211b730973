"""Host rollups: merged parts hold exactly the rank parts' rows, readers stay consistent at every step of the protocol
(and after a crash at any step), cut parts are left alone, and a live analyzer across rollups holds every row once."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from rankwatch import cli
from rankwatch.analytics.analyze import analyze
from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
from rankwatch.analytics.store import ANALYZED_TABLES, analyzed_columns, connect, open_run, part_files
from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.schema import PARTITION_KEY, SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table
from rankwatch.base.topology import Layout
from rankwatch.collector import rollup as rollup_mod
from rankwatch.collector.rollup import (
    COVERS_KEY, MANIFEST, ROLLUP_DIR, host_dir, host_ranks, list_parts, read_manifest, rollup, rollup_all, run_agent,
)
from rankwatch.collector.sink import ParquetSink, SinkConfig
from rankwatch.simulator import SimConfig, parse_sim_fault, simulate, split_tail

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout(dp=2, tp=2, pp=2)
HOSTS = 2
Rows = dict[Table, list[str]]


def _rows(run: Path, tables: frozenset[Table] | tuple[Table, ...] = tuple(Table), *, analyzed: bool = False) -> Rows:
    """Every row of every table as the readers see it, sorted (a row seen twice shows twice); with `analyzed`, the
    columns analysis keeps."""
    con = connect(run)
    have = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    return {t: sorted(map(repr, con.execute(f"SELECT {analyzed_columns(t) if analyzed else '*'} FROM {t}").fetchall()))
            if str(t) in have else [] for t in tables}


def _held(live: LiveAnalyzer, table: Table) -> list[str]:
    return sorted(map(repr, live.con.execute(f"SELECT * FROM {table}").fetchall()))


def _rank_part(run: Path, table: Table, rank: int, n: int) -> Path:
    return run / TELEMETRY_DIR / str(table) / f"{PARTITION_KEY}={rank}" / f"part-{n:06d}.parquet"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run with a straggler, in three part files per rank and table (steps <20, 20..29, 30..39)."""
    base = tmp_path_factory.mktemp("sim")
    run = base / "run"
    simulate(SimConfig(layout=LAYOUT, hosts=HOSTS, steps=40, fingerprint_every=10, checkpoint_every=20,
                       faults=(parse_sim_fault("gpu_slow:rank=5,from=10,factor=1.3"),)), run)
    split_tail(run, 20, base / "a")
    split_tail(base / "a", 30, base / "b")
    return base


@pytest.fixture()
def run(sim: Path, tmp_path: Path) -> Path:
    """The whole run in the rank layout (three parts per rank and table), a fresh copy per test."""
    out = tmp_path / "run"
    shutil.copytree(sim / "run", out)
    for stage in ("a", "b"):
        _move_in(sim / stage, out, copy=True)
    return out


@pytest.fixture(scope="module")
def whole(sim: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("whole") / "run"
    shutil.copytree(sim / "run", out)
    for stage in ("a", "b"):
        _move_in(sim / stage, out, copy=True)
    return out


@pytest.fixture(scope="module")
def truth(whole: Path) -> Rows:
    """Every row of the run, from its rank layout."""
    return _rows(whole)


def _move_in(staging: Path, run: Path, *, copy: bool = False, ranks: set[int] | None = None) -> int:
    moved = 0
    for f in sorted(staging.rglob("*.parquet")):
        rel = f.relative_to(staging)
        rank = int(rel.parent.name.split("=")[1])
        if ranks is not None and rank not in ranks:
            continue
        target = run / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copy2 if copy else shutil.move)(f, target)
        moved += 1
    return moved


def test_host_ranks_follow_the_topology(run: Path) -> None:
    assert host_ranks(run) == {"host0": (0, 1, 2, 3), "host1": (4, 5, 6, 7)}


def test_rollup_merges_every_table_into_one_host_part_with_the_same_rows(run: Path, truth: Rows) -> None:
    before = {t: rollup_mod.rank_parts(run, t) for t in Table}
    results = rollup_all(run, keep_s=0)
    assert sorted(results) == ["host0", "host1"]
    for host, res in results.items():
        assert res.warnings == ()
        assert {t.table for t in res.tables if t.part is not None} == {t for t in Table if truth[t]}
        for t in res.tables:
            assert t.part is not None and t.part.parent == host_dir(run, t.table, host)
            assert t.rank_parts == sum(len(before[t.table][r]) for r in res.ranks)
            covers = json.loads(pq.read_schema(t.part).metadata[COVERS_KEY])
            assert sum(k for _, _, k in covers) == t.rows == pq.read_metadata(t.part).num_rows
            assert pq.read_schema(t.part).metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert _rows(run) == truth
    for table in Table:
        listing = list_parts(run, table)
        assert listing.rank_parts == ()  # every rank part is covered...
        assert len(listing.host_parts) == HOSTS
    # ...and, with keep_s=0, deleted but each rank's newest (a restarted sink numbers its parts after it)
    steps = run / TELEMETRY_DIR / "steps"
    assert sorted(p.name for p in (steps / "rank=3").iterdir()) == ["part-000002.parquet"]
    m = read_manifest(host_dir(run, Table.STEPS, "host0"))
    assert m is not None and {r: c.upto for r, c in m.ranks.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
    # a second rollup finds nothing new
    again = rollup(run, "host0", keep_s=0)
    assert again.rank_parts == 0 and again.host_parts == 0


def test_a_new_part_after_a_rollup_is_read_until_the_next_rollup_covers_it(run: Path, truth: Rows) -> None:
    rollup_all(run, keep_s=0)
    newest = _rank_part(run, Table.STEPS, 3, 2)
    extra = _rank_part(run, Table.STEPS, 3, 3)
    shutil.copy(newest, extra)  # a new part from rank 3 (its rows again: counted twice, as the files say)
    seen = _rows(run, (Table.STEPS,))[Table.STEPS]
    assert len(seen) == len(truth[Table.STEPS]) + pq.read_metadata(newest).num_rows
    res = rollup(run, "host0", keep_s=0)
    assert [(t.table, t.rank_parts) for t in res.tables if t.rank_parts] == [(Table.STEPS, 1)]
    assert _rows(run, (Table.STEPS,))[Table.STEPS] == seen
    assert not newest.exists() and extra.exists()


@pytest.mark.parametrize("stop_after", ["_write_host_part", "_publish", "_delete_one"])
def test_a_crash_at_any_step_leaves_readers_consistent(run: Path, truth: Rows, stop_after: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop the rollup right after writing the host part (before the manifest), right after the manifest (before
    any delete), and after the first delete: readers see every row once, and the next rollup completes."""

    class Crash(Exception):
        pass

    if stop_after == "_delete_one":
        real_unlink = Path.unlink
        count = {"n": 0}

        def unlink_then_crash(self: Path, missing_ok: bool = False) -> None:
            real_unlink(self, missing_ok=missing_ok)
            if self.name.startswith("part-"):
                count["n"] += 1
                raise Crash
        monkeypatch.setattr(Path, "unlink", unlink_then_crash)
    else:
        real = getattr(rollup_mod, stop_after)

        def crash_after(*args: object, **kwargs: object) -> object:
            real(*args, **kwargs)
            raise Crash
        monkeypatch.setattr(rollup_mod, stop_after, crash_after)
    with pytest.raises(Crash):
        rollup(run, "host0", keep_s=0)
    monkeypatch.undo()
    assert _rows(run) == truth
    folder = host_dir(run, Table.STEPS, "host0")
    if stop_after == "_write_host_part":
        assert read_manifest(folder) is None and list(folder.glob("part-*.parquet"))  # an orphan, ignored
    res = rollup(run, "host0", keep_s=0)
    assert _rows(run) == truth
    assert sorted(p.name for p in folder.glob("part-*.parquet")) == list(read_manifest(folder).parts)  # type: ignore[union-attr]
    assert res.warnings == ()


def test_readers_are_consistent_at_every_instant_of_a_rollup(run: Path, truth: Rows,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Check the readers' view after each file operation of a rollup (write, rename, publish, each delete), and
    across a whole rollup (with deletes) landing between a reader's listing of rank parts and of manifests."""
    checks = {"n": 0}

    def check() -> None:
        checks["n"] += 1
        assert _rows(run, (Table.STEPS, Table.COLLECTIVES)) == {t: truth[t] for t in (Table.STEPS, Table.COLLECTIVES)}

    for name in ("_write_host_part", "_publish"):
        real = getattr(rollup_mod, name)

        def wrapped(*args: object, _real: Callable[..., object] = real, **kwargs: object) -> object:
            out = _real(*args, **kwargs)
            check()
            return out
        monkeypatch.setattr(rollup_mod, name, wrapped)
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        real_unlink(self, missing_ok=missing_ok)
        if self.name.startswith("part-"):
            check()
    monkeypatch.setattr(Path, "unlink", unlink)
    rollup(run, "host0", keep_s=0, tables=(Table.STEPS, Table.COLLECTIVES))
    monkeypatch.undo()
    assert checks["n"] == 4 + 2 * 4 * 2  # 2 tables x (write + publish) + 2 tables x 4 ranks x 2 older parts

    # a whole rollup of host1, deletes included, between the reader's two listings (rank parts, manifests)
    called: list[str] = []

    def between(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def wrapped(*args: object) -> object:
            if called and name not in called and "rolled" not in called:
                called.append("rolled")
                rollup(run, "host1", keep_s=0)
            called.append(name)
            return real(*args)
        return wrapped
    monkeypatch.setattr(rollup_mod, "manifests", between("manifests", rollup_mod.manifests))
    monkeypatch.setattr(rollup_mod, "_rank_dirs", between("ranks", rollup_mod._rank_dirs))
    got = _rows(run, (Table.STEPS,))
    monkeypatch.undo()
    assert "rolled" in called and got[Table.STEPS] == truth[Table.STEPS]
    assert _rows(run) == truth


def test_open_run_lists_again_when_a_listed_part_was_deleted_by_a_rollup(run: Path, truth: Rows,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.analytics import store

    stale = {t: store.part_files(run, t) for t in Table}
    rollup_all(run, keep_s=0)
    calls: dict[Table, int] = {}
    real = store.part_files

    def first_stale(run_dir: Path, table: Table) -> list[Path]:
        calls[table] = calls.get(table, 0) + 1
        return stale[table] if calls[table] == 1 else real(run_dir, table)
    monkeypatch.setattr(store, "part_files", first_stale)
    opened = open_run(run)
    assert opened.warnings == ()
    assert max(calls.values()) == 2
    got = sorted(map(repr, opened.con.execute("SELECT * FROM steps").fetchall()))
    assert got == truth[Table.STEPS]


def test_a_cut_rank_part_is_left_alone_with_a_warning(run: Path, truth: Rows) -> None:
    cut = _rank_part(run, Table.STEPS, 2, 1)  # the middle part of rank 2
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    res = rollup(run, "host0", keep_s=0)
    assert len(res.warnings) == 1 and str(cut) in res.warnings[0] and "unreadable" in res.warnings[0]
    m = read_manifest(host_dir(run, Table.STEPS, "host0"))
    assert m is not None and m.ranks[2].upto == 2 and m.ranks[2].uncovered == {1}
    assert cut.exists()  # not covered, not deleted
    assert cut in list_parts(run, Table.STEPS).rank_parts
    store = open_run(run)
    assert [w for w in store.warnings if str(cut) in w] and len(store.warnings) == 1
    got = sorted(map(repr, store.con.execute("SELECT * FROM steps").fetchall()))
    lost = 10  # rank 2's steps 20..29
    assert len(got) == len(truth[Table.STEPS]) - lost and set(got) <= set(truth[Table.STEPS])
    live = LiveAnalyzer(run)
    live.refresh()
    assert len(live.warnings) == 1 and str(cut) in live.warnings[0]
    assert live.con.execute("SELECT count(*) FROM steps").fetchall()[0][0] == len(truth[Table.STEPS]) - lost
    # a later rollup does not try it again (it stays a rank part for the readers' warning)
    assert rollup(run, "host0", keep_s=0).warnings == ()


def test_deletes_wait_keep_s_after_the_publish_and_spare_each_ranks_newest(run: Path, truth: Rows,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"t": 1_000_000.0}
    monkeypatch.setattr(rollup_mod.time, "time", lambda: clock["t"])
    older = sum(len(parts) - 1 for t in Table for r, parts in rollup_mod.rank_parts(run, t, (0, 1, 2, 3)).items())
    assert older > 0
    res = rollup(run, "host0", keep_s=60)
    assert sum(t.deleted for t in res.tables) == 0
    clock["t"] += 30
    assert sum(t.deleted for t in rollup(run, "host0", keep_s=60).tables) == 0
    clock["t"] += 31
    assert sum(t.deleted for t in rollup(run, "host0", keep_s=60).tables) == older
    assert _rows(run) == truth
    # a restarted rank's sink numbers its next part after the newest it finds, which the rollup left in place
    newest = _rank_part(run, Table.EVENTS, 3, 2)
    assert sorted(p.name for p in newest.parent.iterdir()) == [newest.name]
    row = tuple(pq.read_table(newest).slice(0, 1).to_pylist()[0].values())
    sink = ParquetSink(run, 3, SinkConfig(flush_interval_s=60))
    sink.append(Table.EVENTS, row)
    sink.close()
    assert _rank_part(run, Table.EVENTS, 3, 3).exists()
    assert len(_rows(run, (Table.EVENTS,))[Table.EVENTS]) == len(truth[Table.EVENTS]) + 1


def test_two_agents_covering_one_rank_are_an_error(run: Path) -> None:
    rollup(run, "host0", ranks=(0, 1), keep_s=0, delete=False)
    rollup(run, "other", ranks=(1, 2), keep_s=0, delete=False)
    with pytest.raises(RunDirError, match="covers rank 1, which .* covers too"):
        part_files(run, Table.STEPS)


def test_host_names_are_quoted_into_one_folder_and_manifests_of_another_version_are_refused(run: Path) -> None:
    res = rollup(run, "rack/1 node:a", ranks=(0,), delete=False)
    folder = host_dir(run, Table.STEPS, "rack/1 node:a")
    assert folder.parent == run / TELEMETRY_DIR / "steps" / ROLLUP_DIR and res.host_parts == len(Table)
    doc = json.loads((folder / MANIFEST).read_text())
    doc["schema_version"] = 99
    (folder / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        part_files(run, Table.STEPS)
    with pytest.raises(ValueError, match="empty host name"):
        rollup(run, "")


def test_analyze_gives_the_same_incidents_on_host_rollups(run: Path) -> None:
    before = analyze(run)
    assert [(str(i.klass), i.subject.id) for i in before.incidents] == [("straggler", "5")]
    rollup_all(run, keep_s=0)
    after = analyze(run)
    assert after.incidents == before.incidents and after.warnings == ()


@pytest.mark.parametrize("fresh_s", [None, 60.0], ids=["every-rank-folder", "fresh-hosts-unlisted"])
def test_live_analyzer_across_rank_flushes_and_rollups_holds_every_row_once(sim: Path, tmp_path: Path, whole: Path,
                                                                             fresh_s: float | None) -> None:
    truth = _rows(whole, ANALYZED_TABLES, analyzed=True)
    run = tmp_path / "run"
    shutil.copytree(sim / "run", run)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(sim / "a", a)
    shutil.copytree(sim / "b", b)
    live = LiveAnalyzer(run, LiveConfig(window_steps=10, keep_steps=10_000, rollup_fresh_s=fresh_s))
    partial_reads: list[str] = []
    real_insert = live._insert

    def insert(con: duckdb.DuckDBPyConnection, table: Table, files: list[Path], *, where: str = "") -> set[Path]:
        if where:
            partial_reads.append(where)
        return real_insert(con, table, files, where=where)
    live._insert = insert  # type: ignore[method-assign]
    assert live.refresh() > 0
    _move_in(a, run, ranks={0, 1, 4})           # some ranks flush their second part
    live.refresh()                              # ...and the analyzer reads those rank parts
    _move_in(a, run, ranks={2})
    rollup(run, "host0", keep_s=0)              # host0's part holds rows the analyzer holds (ranks 0, 1) and not (2)
    live.refresh()
    assert partial_reads                        # only the rows not held were read
    _move_in(a, run)                            # the others flush
    _move_in(b, run, ranks={2, 5})
    rollup(run, "host1", keep_s=0, delete=False)
    live.refresh()
    rollup(run, "host0", keep_s=0)
    _move_in(b, run)
    live.refresh()
    rollup_all(run, keep_s=0)                   # everything covered, older rank parts deleted
    live.refresh()
    assert live.refresh() == 0
    for table in ANALYZED_TABLES:
        assert _held(live, table) == truth[table], table
    assert live.warnings == []
    assert [(str(i.klass), i.subject.id) for i in live.analyze().incidents] == [("straggler", "5")]
    # a new analyzer reading the rolled-up run holds the same rows
    fresh = LiveAnalyzer(run, LiveConfig(window_steps=10, keep_steps=10_000))
    fresh.refresh()
    for table in ANALYZED_TABLES:
        assert _held(fresh, table) == truth[table], table
    # reading host rollups only, a rank part no agent has rolled up yet is not read until one does
    extra = _rank_part(run, Table.STEPS, 6, 2)  # as if rank 6 wrote a part 7 (with part 2's rows again)
    extra.rename(extra.with_name("part-000007.parquet"))
    hosts_only = LiveAnalyzer(run, LiveConfig(window_steps=10, keep_steps=10_000, rank_parts=False))
    hosts_only.refresh()
    assert _held(hosts_only, Table.STEPS) == truth[Table.STEPS]
    rollup(run, "host1", keep_s=0)
    assert hosts_only.refresh() == 1
    assert len(_held(hosts_only, Table.STEPS)) == len(truth[Table.STEPS]) + pq.read_metadata(
        extra.with_name("part-000007.parquet")).num_rows


def test_agent_loop_and_cli(run: Path, truth: Rows, capsys: pytest.CaptureFixture[str]) -> None:
    parts = sum(len(p) for t in Table for p in rollup_mod.rank_parts(run, t, (4, 5, 6, 7)).values())
    assert cli.main(["rollup", str(run), "--host", "host1", "--once", "--no-delete"]) == 0
    out = capsys.readouterr().out
    assert f"host1: {parts} rank part(s) of 4 rank(s) -> {len(Table)} host part(s), 0 covered" in out
    assert "host0" not in out
    rounds: list[int] = []
    last = run_agent(run, None, interval_s=0.01, rounds=2, keep_s=0, report=lambda rs: rounds.append(len(rs)))
    assert rounds == [2, 2] and all(r.rank_parts == 0 for r in last)  # the second round finds nothing new
    assert _rows(run) == truth
    assert cli.main(["rollup", str(run), "--all", "--once"]) == 0
    assert "round 1: 2 host(s), 0 rank part(s) rolled up" in capsys.readouterr().out
    assert cli.main(["rollup", str(run / "nope"), "--all", "--once"]) == 2
    assert cli.main(["rollup", str(run), "--once"]) == 2
    assert "give --host H (repeatable) or --all" in capsys.readouterr().err


def test_a_live_listing_skips_the_rank_folders_of_hosts_whose_agent_published_recently(
        sim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    shutil.copytree(sim / "run", run)
    rollup(run, "host0", delete=False)                   # host0's agent ran; host1 has none
    _move_in(sim / "a", run, copy=True)                  # every rank flushes one more part
    now = time.time()
    fresh = list_parts(run, Table.STEPS, fresh_s=60.0)
    newest = {r: max(n for n, _ in parts) for r, parts in rollup_mod.rank_parts(run, Table.STEPS).items()}
    # host0 (ranks 0-3) is read from its host part only: its new parts come with its agent's next round
    assert sorted(rank_of(f) for f in fresh.rank_parts) == [4, 4, 5, 5, 6, 6, 7, 7]
    every = list_parts(run, Table.STEPS)                 # a one-shot reader lists every folder
    assert sorted(rank_of(f) for f in every.rank_parts) == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert all(part_no(f) == newest[rank_of(f)] for f in every.rank_parts if rank_of(f) < 4)
    # an agent that stopped publishing: its host's folders are listed again
    monkeypatch.setattr(rollup_mod.time, "time", lambda: now + 61.0)
    stale = list_parts(run, Table.STEPS, fresh_s=60.0)
    assert sorted(map(str, stale.rank_parts)) == sorted(map(str, every.rank_parts))


def rank_of(f: Path) -> int:
    return int(f.parent.name.split("=")[1])


def part_no(f: Path) -> int:
    return int(f.name[5:-8])
