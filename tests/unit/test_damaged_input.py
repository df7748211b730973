"""Damaged input never reads as an answer: every analytics command, over every kind of damaged run directory, ends
in a one-line error naming the file and the problem, or says a named warning — never a silent answer, never a
traceback — and changes no file of the run.

One simulated run (8 ranks, a straggler on rank 5) is copied per damage and command; each damage is a function of
the copy. The commands are run through `rankwatch.cli.main` as a user would run them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import CHECKPOINT_DIR, RUN_FILE, TELEMETRY_DIR
from rankwatch.base.schema import (
    SCHEMA_VERSION_KEY, CheckpointPhases, Collectives, Events, Fingerprints, Gpu, Steps, Table, Topology,
)
from rankwatch.base.topology import Layout
from rankwatch.canary.config import CanaryConfig
from rankwatch.cli import main
from rankwatch.collector.rollup import MANIFEST, ROLLUP_DIR, rollup_all
from rankwatch.simulator import SimConfig, parse_sim_fault, simulate

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout.parse("dp=4,tp=2", nproc=8)
STRAGGLER = 5
OUTPUT_DIRS = ("analysis", "evidence")
"""What commands may add to a run (analyze's incidents, evidence bundles); nothing else changes."""
WRITERS = ("analyze", "analyze-json", "recover")
"""Commands that write (and so may replace) the run's analysis/incidents.*."""


@dataclass(frozen=True)
class Healthy:
    run: Path
    analysis: Path
    """A healthy analysis of the run (its incidents.json), put into a copy for `evidence`."""


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Healthy:
    root = tmp_path_factory.mktemp("damaged")
    run = root / "run"
    simulate(SimConfig(name="damaged", layout=LAYOUT, hosts=2, steps=40, seed=1, fingerprint_every=10,
                       checkpoint_every=20,
                       faults=(parse_sim_fault(f"gpu_slow:rank={STRAGGLER},from=20,factor=1.3"),)), run)
    cfg = CanaryConfig(run_dir=run, steps=40, layout=LAYOUT, hosts=2, gpu="off")
    launch = {  # what `manager.config_from_run` reads, so that `recover` can plan for the run
        "attempt": 0, "started_wall_ns": 0, "world_size": LAYOUT.world_size, "layout": str(LAYOUT), "hosts": 2,
        "seed": 0, "steps": 40, "faults": [], "checkpoint_every": 0, "threads": cfg.threads, "collector": True,
        "model": dataclasses.asdict(cfg.model), "global_batch": cfg.global_batch, "microbatches": cfg.microbatches,
        "lr": cfg.lr, "gpu": cfg.gpu, "pg_timeout_s": cfg.pg_timeout_s, "fingerprint_every": 10,
        "grad_norm": cfg.grad_norm, "flush_interval_s": cfg.flush_interval_s,
        "heartbeat_interval_s": cfg.heartbeat_interval_s, "gpu_interval_s": cfg.gpu_interval_s,
        "backend": cfg.backend, "device_shift": 0,
    }
    (run / RUN_FILE).write_text(json.dumps({"launches": [launch]}))
    assert main(["analyze", str(run), "--quiet", "--no-anomaly"]) == 0
    analysis = root / "healthy-analysis"
    shutil.move(run / "analysis", analysis)
    incidents = json.loads((analysis / "incidents.json").read_text())["incidents"]
    assert [(i["class"], i["subject"]) for i in incidents] == [("straggler", str(STRAGGLER))]
    return Healthy(run=run, analysis=analysis)


# -- damage -------------------------------------------------------------------------------------------------------


def _tel(run: Path, table: Table) -> Path:
    return run / TELEMETRY_DIR / str(table)


def _part(run: Path, table: Table, rank: int, n: int = 0) -> Path:
    return _tel(run, table) / f"rank={rank}" / f"part-{n:06d}.parquet"


def _parts(run: Path, table: Table | None = None) -> list[Path]:
    base = run / TELEMETRY_DIR if table is None else _tel(run, table)
    return sorted(base.rglob("part-*.parquet"))


def _rewrite(path: Path, change: Callable[[pa.Table], pa.Table]) -> None:
    data = pq.read_table(path)
    meta = data.schema.metadata
    out = change(data)
    pq.write_table(out.replace_schema_metadata(meta) if out.schema.metadata is None else out, path)


def _set(column: str, value: Callable[[pa.Table], pa.Array]) -> Callable[[pa.Table], pa.Table]:
    def change(t: pa.Table) -> pa.Table:
        return t.set_column(t.column_names.index(column), pa.field(column, t.schema.field(column).type), value(t))
    return change


def _cast(column: str, to: pa.DataType) -> Callable[[pa.Table], pa.Table]:
    def change(t: pa.Table) -> pa.Table:
        return t.set_column(t.column_names.index(column), column, pc.cast(t[column], to))
    return change


def _extra(t: pa.Table) -> pa.Table:
    return t.append_column("extra", pa.array([1] * t.num_rows, pa.int64()))


def _rename(old: str, new: str) -> Callable[[pa.Table], pa.Table]:
    return lambda t: t.rename_columns([new if n == old else n for n in t.column_names])


def _negate(column: str) -> Callable[[pa.Table], pa.Table]:
    return _set(column, lambda t: pc.negate(t[column]))


def _copies(path: Path, n: int) -> None:
    for i in range(1, n + 1):
        shutil.copy(path, path.with_name(f"part-{i:06d}.parquet"))


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(src, dst)


def _truncate(path: Path, size: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _empty_all(run: Path, table: Table | None = None) -> None:
    for p in _parts(run, table):
        _rewrite(p, lambda t: t.slice(0, 0))


def _version(value: bytes | None) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        path = _part(run, Table.STEPS, 2)
        data = pq.read_table(path)
        meta = dict(data.schema.metadata or {})
        if value is None:
            meta.pop(SCHEMA_VERSION_KEY)
        else:
            meta[SCHEMA_VERSION_KEY] = value
        pq.write_table(data.replace_schema_metadata(meta), path)
    return damage


def _manifest(run: Path, text: str) -> None:
    folder = _tel(run, Table.STEPS) / ROLLUP_DIR / "host=h0"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(text)


def _host_part(run: Path, table: Table) -> Path:
    """The first host part of `table` after one round of every host's rollup agent (rank parts kept)."""
    rollup_all(run, delete=False)
    return sorted((_tel(run, table) / ROLLUP_DIR).glob("host=*/part-*.parquet"))[0]


def _incidents(run: Path, text: str) -> None:
    (run / "analysis").mkdir(exist_ok=True)
    (run / "analysis" / "incidents.json").write_text(text)


def _world_size(t: pa.Table) -> pa.Table:
    return _set(Topology.WORLD_SIZE, lambda t: pa.array([4] * t.num_rows, pa.int32()))(t)


ERROR, WARNING, UNAFFECTED = "error", "warning", "unaffected"

TELEMETRY_COMMANDS = ("analyze", "analyze-json", "watch", "localize", "recover", "telemetry", "evidence")
COMMANDS = (*TELEMETRY_COMMANDS, "checkpoints")


@dataclass(frozen=True)
class Damage:
    name: str
    apply: Callable[[Path], None]
    problem: str
    """Text the error or warning line must contain."""
    names: str
    """The path (relative to the run) the line must name."""
    level: str = ERROR
    """What the telemetry commands say; `checkpoints` reads no telemetry and answers as for the healthy run."""
    levels: dict[str, str] = field(default_factory=dict)
    """Per command, where it differs from `level`."""
    problems: dict[str, str] = field(default_factory=dict)
    """Per command, where what it says differs from `problem`."""

    def expect(self, command: str) -> str:
        if command in self.levels:
            return self.levels[command]
        if command == "checkpoints":
            return UNAFFECTED
        if command == "evidence" and self.level == ERROR:
            return WARNING  # damaged telemetry is still evidence: preserved as it is, and said
        return self.level


def _copied_part(table: Table, rank: int) -> Damage:
    return Damage(f"{table} part copied", lambda r: _copies(_part(r, table, rank), 1), "stored 2 times",
                  f"telemetry/{table}/rank={rank}/part-")


S, C, E, T, G, F, K = (Table.STEPS, Table.COLLECTIVES, Table.EVENTS, Table.TOPOLOGY, Table.GPU, Table.FINGERPRINTS,
                       Table.CHECKPOINT_PHASES)
_NO_TELEMETRY = {"telemetry": ERROR, "evidence": WARNING}

DAMAGES = (
    # duplicated rows: a part copied into its own rank folder, rows written twice
    Damage("steps part copied 200 times", lambda r: _copies(_part(r, S, 3), 200), "stored 201 times",
           "telemetry/steps/rank=3/part-"),
    *(_copied_part(table, rank) for table, rank in ((C, 2), (E, 1), (T, 6), (F, 0), (K, 7))),
    Damage("steps rows doubled in one part", lambda r: _rewrite(_part(r, S, 0), lambda t: pa.concat_tables([t, t])),
           "stored 2 times (", "telemetry/steps/rank=0/part-000000.parquet"),
    Damage("steps rows ten times in one part",
           lambda r: _rewrite(_part(r, S, 0), lambda t: pa.concat_tables([t] * 10)),
           "(10 times in the one part)", "telemetry/steps/rank=0/part-000000.parquet"),
    # a rank's rows outside its folder
    Damage("straggler's rank folder renamed", lambda r: _move(_tel(r, S) / "rank=5", _tel(r, S) / "rank_5"),
           "not rank=<n>/", "telemetry/steps/rank_5"),
    Damage("rank folder not numbered", lambda r: _move(_tel(r, C) / "rank=5", _tel(r, C) / "rank=five"),
           "not rank=<n>/", "telemetry/collectives/rank=five"),
    Damage("part beside the rank folders", lambda r: _move(_part(r, S, 5), _tel(r, S) / "part-000000.parquet"),
           "not rank=<n>/", "telemetry/steps/part-000000.parquet"),
    Damage("straggler's part filed under another rank",
           lambda r: (_move(_part(r, S, 5), _part(r, S, 4, 1)), shutil.rmtree(_tel(r, S) / "rank=5")),
           "rank 5 in a rank=4 folder", "telemetry/steps/rank=4/part-000001.parquet"),
    Damage("topology part filed under another rank",
           lambda r: (_move(_part(r, T, 5), _part(r, T, 4, 1)), shutil.rmtree(_tel(r, T) / "rank=5")),
           "rank 5 in a rank=4 folder", "telemetry/topology/rank=4/part-000001.parquet"),
    Damage("rank column rewritten", lambda r: _rewrite(_part(r, S, 5), _set(
        Steps.RANK, lambda t: pa.array([4] * t.num_rows, pa.int32()))),
           "rank 4 in a rank=5 folder", "telemetry/steps/rank=5/part-000000.parquet"),
    Damage("negative rank", lambda r: _rewrite(_part(r, E, 2), _set(
        Events.RANK, lambda t: pa.array([-1] * t.num_rows, pa.int32()))),
           "negative rank -1", "telemetry/events/rank=2/part-000000.parquet"),
    # no data
    Damage("every table empty", _empty_all, "every table is empty", "telemetry",
           levels={"telemetry": WARNING}),
    Damage("steps table missing", lambda r: shutil.rmtree(_tel(r, S)), "no part files — no completed step",
           "telemetry/steps", level=WARNING),
    Damage("steps table empty", lambda r: _empty_all(r, S), "no rows — no completed step", "telemetry/steps",
           level=WARNING),
    Damage("telemetry folder without tables", lambda r: [shutil.rmtree(p) for p in (r / TELEMETRY_DIR).iterdir()],
           "no telemetry part files", "telemetry", levels={"watch": WARNING},
           problems={"watch": "no telemetry part file read yet"}),
    # a live monitor may be started beside a job whose ranks have not flushed yet: it waits for them, and says so
    Damage("no telemetry folder", lambda r: shutil.rmtree(r / TELEMETRY_DIR), "no telemetry/ folder", "",
           levels={**_NO_TELEMETRY, "watch": WARNING}, problems={"watch": "no telemetry/ folder yet"}),
    Damage("topology missing", lambda r: shutil.rmtree(_tel(r, T)), "no topology", "telemetry/topology",
           level=WARNING),
    Damage("events missing", lambda r: shutil.rmtree(_tel(r, E)), "no lifecycle events", "telemetry/events",
           level=WARNING),
    Damage("every part cut short", lambda r: [_truncate(p) for p in _parts(r)], "part files is readable",
           "telemetry", levels={"watch": WARNING}, problems={"watch": "left out for now"}),
    # columns and types
    Damage("steps part with an extra column", lambda r: _rewrite(_part(r, S, 3), _extra),
           "column(s) extra not in the steps schema", "telemetry/steps/rank=3/part-000000.parquet"),
    Damage("first steps part with an extra column", lambda r: _rewrite(_part(r, S, 0), _extra),
           "column(s) extra not in the steps schema", "telemetry/steps/rank=0/part-000000.parquet"),
    Damage("steps column renamed", lambda r: _rewrite(_part(r, S, 3), _rename(Steps.DURATION_NS, "dur_ns")),
           "lacks column(s) duration_ns", "telemetry/steps/rank=3/part-000000.parquet"),
    Damage("steps column missing", lambda r: _rewrite(_part(r, S, 6), lambda t: t.drop_columns([Steps.LOSS])),
           "lacks column(s) loss", "telemetry/steps/rank=6/part-000000.parquet"),
    Damage("steps duration as float", lambda r: _rewrite(_part(r, S, 3), _cast(Steps.DURATION_NS, pa.float64())),
           "column duration_ns is double", "telemetry/steps/rank=3/part-000000.parquet"),
    Damage("steps duration as int32", lambda r: _rewrite(_part(r, S, 3), _cast(Steps.DURATION_NS, pa.int32())),
           "column duration_ns is int32", "telemetry/steps/rank=3/part-000000.parquet"),
    Damage("steps duration as string", lambda r: _rewrite(_part(r, S, 0), _cast(Steps.DURATION_NS, pa.string())),
           "column duration_ns is string", "telemetry/steps/rank=0/part-000000.parquet"),
    Damage("collectives part with an extra column", lambda r: _rewrite(_part(r, C, 4), _extra),
           "not in the collectives schema", "telemetry/collectives/rank=4/part-000000.parquet"),
    Damage("collectives duration as float",
           lambda r: _rewrite(_part(r, C, 1), _cast(Collectives.DURATION_NS, pa.float64())),
           "column duration_ns is double", "telemetry/collectives/rank=1/part-000000.parquet"),
    Damage("events column renamed", lambda r: _rewrite(_part(r, E, 2), _rename(Events.KIND, "what")),
           "lacks column(s) kind", "telemetry/events/rank=2/part-000000.parquet"),
    Damage("gpu column missing", lambda r: _rewrite(_part(r, G, 3), lambda t: t.drop_columns([Gpu.POWER_W])),
           "lacks column(s) power_w", "telemetry/gpu/rank=3/part-000000.parquet"),
    Damage("topology world size as int64",
           lambda r: _rewrite(_part(r, T, 0), _cast(Topology.WORLD_SIZE, pa.int64())),
           "column world_size is int64", "telemetry/topology/rank=0/part-000000.parquet"),
    Damage("fingerprints hash as binary",
           lambda r: _rewrite(_part(r, F, 2), _cast(Fingerprints.PARAM_HASH, pa.binary())),
           "column param_hash is binary", "telemetry/fingerprints/rank=2/part-000000.parquet"),
    Damage("checkpoint phases part with an extra column", lambda r: _rewrite(_part(r, K, 5), _extra),
           "not in the checkpoint_phases schema", "telemetry/checkpoint_phases/rank=5/part-000000.parquet"),
    Damage("another schema version", _version(b"99"), "schema version 99",
           "telemetry/steps/rank=2/part-000000.parquet"),
    Damage("no schema version", _version(None), "schema version none", "telemetry/steps/rank=2/part-000000.parquet"),
    # values no collector writes
    Damage("negative step durations", lambda r: _rewrite(_part(r, S, 1), _negate(Steps.DURATION_NS)),
           "negative duration_ns", "telemetry/steps/rank=1/part-000000.parquet"),
    Damage("negative compute time", lambda r: _rewrite(_part(r, S, 5), _negate(Steps.COMPUTE_NS)),
           "negative compute_ns", "telemetry/steps/rank=5/part-000000.parquet"),
    Damage("negative collective durations", lambda r: _rewrite(_part(r, C, 6), _negate(Collectives.DURATION_NS)),
           "negative duration_ns", "telemetry/collectives/rank=6/part-000000.parquet"),
    Damage("negative checkpoint phase durations",
           lambda r: _rewrite(_part(r, K, 2), _negate(CheckpointPhases.DURATION_NS)),
           "negative duration_ns", "telemetry/checkpoint_phases/rank=2/part-000000.parquet"),
    Damage("negative steps", lambda r: _rewrite(_part(r, S, 7), _set(
        Steps.STEP, lambda t: pc.subtract(t[Steps.STEP], pa.scalar(100, pa.int64())))),
           "negative step", "telemetry/steps/rank=7/part-000000.parquet"),
    Damage("rank beyond the world size", lambda r: _rewrite(_part(r, T, 7), _world_size),
           "rank 7 not below world_size 4", "telemetry/topology/rank=7/part-000000.parquet"),
    # parts that cannot be read: left out, and said
    Damage("straggler's steps part cut short", lambda r: _truncate(_part(r, S, STRAGGLER)), "left out",
           "telemetry/steps/rank=5/part-000000.parquet", level=WARNING),
    Damage("empty part file", lambda r: _part(r, C, 2, 1).write_bytes(b""), "left out",
           "telemetry/collectives/rank=2/part-000001.parquet", level=WARNING),
    Damage("part that is not parquet", lambda r: _part(r, E, 3, 1).write_text("not parquet\n"), "left out",
           "telemetry/events/rank=3/part-000001.parquet", level=WARNING),
    Damage("unknown table folder", lambda r: shutil.copytree(_tel(r, S), r / TELEMETRY_DIR / "stepz"),
           "not a telemetry table", "telemetry/stepz", level=WARNING),
    # host rollups
    Damage("rollup manifest not JSON", lambda r: _manifest(r, '{"cut'), "unreadable rollup manifest",
           "telemetry/steps/_rollup/host=h0/_manifest.json"),
    Damage("host part with negative durations", lambda r: _rewrite(_host_part(r, S), _negate(Steps.DURATION_NS)),
           "negative duration_ns", "telemetry/steps/_rollup/host="),
    # the checkpoint catalog (read by checkpoints and recover; the telemetry commands are not concerned)
    Damage("checkpoint folder is a file", lambda r: (r / CHECKPOINT_DIR).write_text(""), "not a folder",
           CHECKPOINT_DIR, level=UNAFFECTED, levels={"checkpoints": ERROR}),
    Damage("checkpoint manifest not JSON", lambda r: (
        (r / CHECKPOINT_DIR / "step-00000020").mkdir(parents=True),
        (r / CHECKPOINT_DIR / "step-00000020" / "manifest.json").write_text('{"cut')),
           "invalid manifest.json", "step-00000020", level=UNAFFECTED, levels={"checkpoints": "verdict"}),
    # the analysis evidence preserves
    Damage("incidents file not JSON", lambda r: _incidents(r, '{"incidents": [{"id"'),
           "not a readable incidents file", "analysis/incidents.json", level=UNAFFECTED, levels={"evidence": ERROR}),
    Damage("incidents file of another shape", lambda r: _incidents(r, "[]"), "not a readable incidents file",
           "analysis/incidents.json", level=UNAFFECTED, levels={"evidence": ERROR}),
)


def test_there_are_at_least_forty_kinds_of_damage() -> None:
    assert len(DAMAGES) >= 40
    assert len({d.name for d in DAMAGES}) == len(DAMAGES)


# -- running a command on a damaged copy ---------------------------------------------------------------------------


def _hashes(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _argv(command: str, run: Path) -> list[str]:
    return {
        "analyze": ["analyze", str(run), "--quiet", "--no-anomaly"],
        "analyze-json": ["analyze", str(run), "--quiet", "--json", "--no-anomaly"],
        "watch": ["watch", str(run), "--window", "40", "--every", "0", "--count", "1", "--no-anomaly"],
        "localize": ["localize", str(run)],
        "recover": ["recover", str(run)],
        "telemetry": ["telemetry", str(run)],
        "evidence": ["evidence", str(run)],
        "checkpoints": ["checkpoints", str(run), "--verify"],
    }[command]


def _run(command: str, run: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(_argv(command, run))
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.fixture
def copy(healthy: Healthy, tmp_path: Path) -> Callable[[str], Path]:
    def make(command: str) -> Path:
        run = tmp_path / "run"
        shutil.copytree(healthy.run, run)
        if command == "evidence":
            shutil.copytree(healthy.analysis, run / "analysis")
        return run
    return make


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("damage", DAMAGES, ids=[d.name for d in DAMAGES])
def test_damaged_run(damage: Damage, command: str, copy: Callable[[str], Path], healthy: Healthy,
                     capsys: pytest.CaptureFixture[str]) -> None:
    run = copy(command)
    damage.apply(run)
    before = _hashes(run)
    rc, out, err = _run(command, run, capsys)
    after = _hashes(run)
    assert "Traceback" not in err and "Error:" not in out
    changed = sorted(p for p in before if after.get(p) != before[p]
                     and not (command in WRITERS and p.startswith(OUTPUT_DIRS[0]) and p in after))
    added = sorted(p for p in after if p not in before and not p.startswith(OUTPUT_DIRS))
    assert not changed and not added, (changed, added)
    named = str(run / damage.names) if damage.names else str(run)
    problem = damage.problems.get(command, damage.problem)
    expect = damage.expect(command)
    lines = [line for line in err.splitlines() if line.strip()]
    if expect == ERROR:
        assert rc != 0, out
        assert len(lines) == 1, err
        assert lines[0].startswith(f"rankwatch {_argv(command, run)[0]}: error: "), lines
        assert problem in lines[0] and named in lines[0], lines[0]
    elif expect == WARNING:
        assert rc == 0, err
        said = [line for line in lines if ": warning: " in line and problem in line and named in line]
        assert said, err
        if command == "analyze-json":
            assert any(problem in w and named in w for w in json.loads(out)["warnings"]), out
    elif expect == "verdict":
        assert rc == 0, err
        assert any(problem in line and damage.names in line for line in out.splitlines()), out
    else:
        assert rc == 0, err
        assert not [line for line in lines if ": warning: " in line], err
        if command.startswith("analyze"):  # the straggler is still found
            assert f"rank:{STRAGGLER}" in out or f'"subject": "{STRAGGLER}"' in out, out


@pytest.mark.parametrize("command", COMMANDS)
def test_the_healthy_run_is_answered_without_warnings(command: str, copy: Callable[[str], Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run = copy(command)
    before = _hashes(run)
    rc, out, err = _run(command, run, capsys)
    assert rc == 0 and not err.strip(), err
    after = _hashes(run)
    assert all(after.get(p) == h for p, h in before.items())
    if command == "analyze":
        assert f"8 ranks, steps 0..39, 1 incident(s)" in out and f"rank:{STRAGGLER}" in out
