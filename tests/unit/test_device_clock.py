"""Analytics reads the right clock: a hand-made CUDA-like run, where the CPU-side figures are the same on every rank
(the wait absorbed at the sync point, collectives returning at launch) and only the device columns say who is slow.

Also: schema version 1 and 2 parts are still read (a column a part's version lacks reads as null)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.analytics import queries as q
from rankwatch.analytics.analyze import analyze
from rankwatch.analytics.frames import Clock
from rankwatch.analytics.incidents import Cause, IncidentClass
from rankwatch.analytics.store import connect
from rankwatch.base.schema import SCHEMA_VERSION_KEY, Table, column_names, storage_schema
from rankwatch.collector.sink import partition_dir, rows_to_table

MS = 1_000_000
T0 = 1_700_000_000_000_000_000
RANKS, STEPS, SLOW, ONSET = 8, 40, 5, 12
pytestmark = pytest.mark.timeout(120)


def _write(run: Path, table: Table, rank: int, rows: list[dict[str, Any]], *, version: int | None = None) -> Path:
    cols = column_names(table)
    t = rows_to_table(table, [tuple(r.get(c) for c in cols) for r in rows])
    if version is not None:  # the part an older collector wrote: that version's columns and footer
        old = storage_schema(table, version)
        t = t.select(old.names).cast(old.remove_metadata()).replace_schema_metadata(
            {SCHEMA_VERSION_KEY: str(version).encode()})
    d = partition_dir(run, table, rank)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "part-000000.parquet"
    pq.write_table(t, path)
    return path


def gpu_run(run: Path, *, host_stall: bool = False, untimed: tuple[int, ...] = (),
            versions: dict[Table, int] | None = None) -> Path:
    """8 data-parallel ranks on one host, 40 steps of a CUDA-like job. From step 12 rank 5's device takes 30 % longer
    for its own work: its GPU is slow, or (`host_stall`) its host thread stalls 18 ms in forward and the GPU waits."""
    rng = np.random.default_rng(7)
    versions = versions or {}
    group = {"name": "dp", "kind": "dp", "ranks": list(range(RANKS)), "hosts": ["h0"] * RANKS, "links": []}
    own = 60 * MS * (1 + 0.005 * rng.standard_normal((RANKS, STEPS)))
    own[SLOW, ONSET:] *= 1.3
    step_dev = own.max(axis=0) + 5 * MS  # every device finishes the all-reduce together, after the slowest
    for r in range(RANKS):
        v = versions.get
        _write(run, Table.TOPOLOGY, r, [{
            "rank": r, "attempt": 0, "world_size": RANKS, "local_rank": r, "host": "h0", "pid": 100 + r,
            "start_wall_ns": T0, "backend": "nccl", "dp": r, "tp": 0, "pp": 0, "dp_size": RANKS, "tp_size": 1,
            "pp_size": 1, "groups": [group]}], version=v(Table.TOPOLOGY))
        steps, phases, colls = [], [], []
        for s in range(STEPS):
            start = T0 + s * 100 * MS
            cpu = int(step_dev[s] + 2 * MS)  # the thread waits at the sync point for the slowest device
            timed = r not in untimed
            stall = 18 * MS if host_stall and r == SLOW and s >= ONSET else 0
            steps.append({
                "rank": r, "step": s, "attempt": 0, "start_wall_ns": start, "end_wall_ns": start + cpu,
                "start_mono_ns": s * 100 * MS, "end_mono_ns": s * 100 * MS + cpu, "duration_ns": cpu,
                "compute_ns": cpu - 40_000, "collective_wait_ns": 40_000, "dataloader_wait_ns": 100_000,
                "checkpoint_ns": 0, "num_collectives": 1, "loss": 1.0, "local_grad_norm": 1.0, "all_finite": True,
                "data_position": 8 * (s + 1),
                "device_ns": int(step_dev[s]) if timed else None,
                "device_compute_ns": int(own[r, s]) if timed else None,
                "device_collective_ns": int(step_dev[s] - own[r, s]) if timed else None,
            })
            enqueue = [int(MS * (1 + 0.02 * rng.standard_normal())) for _ in range(3)]
            enqueue[0] += stall
            for k, name in enumerate(("forward", "backward", "optimizer")):
                d = enqueue[k] if name != "optimizer" else cpu - enqueue[0] - enqueue[1]  # the sync is in optimizer
                phases.append({"rank": r, "step": s, "phase": name, "start_wall_ns": start, "start_mono_ns": 0,
                               "duration_ns": d, "device_duration_ns": int(own[r, s] / 3) if timed else None})
            launch = int(30_000 + 10_000 * rng.random())  # CPU time inside: launch latency, unrelated to arrival
            colls.append({
                "rank": r, "step": s, "seq": 0, "group_seq": s, "op": "all_reduce", "group": "dp",
                "group_ranks": list(range(RANKS)), "bytes": 4_000_000, "dtype": "float32", "async_op": True,
                "enter_wall_ns": start + 3 * MS, "enter_mono_ns": s * 100 * MS + 3 * MS,
                "exit_wall_ns": start + 3 * MS + launch, "exit_mono_ns": s * 100 * MS + 3 * MS + launch, "duration_ns": launch, "status": "ok",
                "device_duration_ns": int(step_dev[s] - own[r, s]) if timed else None,
                "device_start_ns": int(own[r, s]) if timed else None,
            })
        _write(run, Table.STEPS, r, steps, version=v(Table.STEPS))
        _write(run, Table.PHASES, r, phases, version=v(Table.PHASES))
        _write(run, Table.COLLECTIVES, r, colls, version=v(Table.COLLECTIVES))
        _write(run, Table.EVENTS, r, [
            {"rank": r, "attempt": 0, "wall_ns": T0, "mono_ns": 0, "kind": "start"},
            {"rank": r, "attempt": 0, "wall_ns": T0 + STEPS * 100 * MS, "mono_ns": 1, "kind": "exit",
             "step": STEPS - 1, "exit_code": 0}], version=v(Table.EVENTS))
        _write(run, Table.FINGERPRINTS, r, [{
            "rank": r, "step": STEPS - 1, "attempt": 0, "wall_ns": T0, "domain": "dp", "domain_ranks": list(range(RANKS)),
            "param_hash": "p", "optim_hash": "o", "rng_python_hash": "a", "rng_numpy_hash": "b", "rng_torch_hash": "c",
            "data_position": 8 * STEPS, "param_count": 10}], version=v(Table.FINGERPRINTS))
    return run


def _stragglers(incidents: Any) -> list[Any]:
    return [i for i in incidents if i.klass is IncidentClass.STRAGGLER]


def test_the_device_clock_finds_the_slow_gpu_and_says_it_is_the_device(tmp_path: Path) -> None:
    run = gpu_run(tmp_path)
    assert q.run_clock(connect(run)) == (Clock.DEVICE, None)
    analysis = analyze(run)
    (inc,) = _stragglers(analysis.incidents)
    assert inc.ranks == (SLOW,) and inc.cause is Cause.DEVICE_SLOW
    assert ONSET <= inc.onset_step <= ONSET + 2 and inc.detection_step <= ONSET + 10
    assert "device_compute_ns" in inc.fields
    assert {e.source for e in inc.evidence} >= {"steps", "phases"}


def test_a_stalled_host_thread_is_told_apart_from_a_slow_gpu(tmp_path: Path) -> None:
    (inc,) = _stragglers(analyze(gpu_run(tmp_path, host_stall=True)).incidents)
    assert inc.ranks == (SLOW,) and inc.cause is Cause.HOST_STALL, inc.summary


def test_the_cpu_clock_does_not_see_a_slow_gpu(tmp_path: Path) -> None:
    """The control: read CPU-side only, a CUDA job's straggler is invisible (the reason device columns exist)."""
    run = gpu_run(tmp_path)
    assert not [i for i in _stragglers(analyze(run, clock=Clock.CPU).incidents) if SLOW in i.ranks]


def test_device_arrival_order_names_the_late_rank_and_cpu_order_is_launch_jitter(tmp_path: Path) -> None:
    con = connect(gpu_run(tmp_path))
    dev = q.arrival_order(con)
    assert set(dev["clock"]) == {"device"}
    last = dev.filter(dev["step"] >= ONSET).sort("arrival").group_by("step").last()
    assert set(last["rank"]) == {SLOW}
    cpu = q.arrival_order(con, clock=Clock.CPU)
    assert cpu.height == 0  # DDP buckets are asynchronous: no CPU arrival evidence at all
    dec = q.compute_decomposition(con)
    assert set(dec["clock"]) == {"device"}
    slow = dec.filter(dec["rank"] == SLOW)["compute_ms"][0]
    assert slow > 1.2 * dec.filter(dec["rank"] != SLOW)["compute_ms"].median()


def test_a_run_that_mixes_timed_and_untimed_ranks_is_read_on_the_cpu_clock_with_a_warning(tmp_path: Path) -> None:
    run = gpu_run(tmp_path, untimed=(2,))
    clock, warning = q.run_clock(connect(run))
    assert clock is Clock.CPU and warning is not None and "ranks 2" in warning
    analysis = analyze(run)
    assert any("no device timing" in w for w in analysis.warnings)
    frames = q.load_frames(run)
    assert frames.clock is Clock.CPU and frames.host.height == 0
    with pytest.raises(ValueError, match="no rank"):
        q.run_clock(connect(gpu_run(tmp_path / "cpu", untimed=tuple(range(RANKS)))), Clock.DEVICE)


@pytest.mark.parametrize("version", [1, 2])
def test_runs_of_earlier_schema_versions_are_still_analyzed(tmp_path: Path, version: int) -> None:
    run = gpu_run(tmp_path, versions={t: version for t in Table})
    meta = pq.read_schema(next((run / "telemetry" / "steps" / "rank=0").glob("*.parquet"))).metadata
    assert meta[SCHEMA_VERSION_KEY] == str(version).encode()
    con = connect(run)
    assert con.execute("SELECT count(*) FROM steps WHERE device_ns IS NOT NULL").fetchall() == [(0,)]
    attempts = con.execute("SELECT DISTINCT attempt FROM fingerprints").fetchall()
    assert attempts == ([(None,)] if version == 1 else [(0,)])
    analysis = analyze(run)  # an old run is a CPU run: its straggler is invisible there, and nothing breaks
    assert analysis.ranks == RANKS and analysis.last_step == STEPS - 1
    assert q.run_clock(con)[0] is Clock.CPU


def test_parts_of_several_versions_in_one_table_read_together(tmp_path: Path) -> None:
    run = gpu_run(tmp_path)
    old = gpu_run(tmp_path / "old", versions={Table.STEPS: 1})
    victim = partition_dir(run, Table.STEPS, 3) / "part-000000.parquet"
    victim.write_bytes((partition_dir(old, Table.STEPS, 3) / "part-000000.parquet").read_bytes())
    con = connect(run)
    rows = con.execute("SELECT rank, count(*), count(device_ns) FROM steps GROUP BY rank ORDER BY rank").fetchall()
    assert rows[3] == (3, STEPS, 0) and rows[0] == (0, STEPS, STEPS)
    clock, warning = q.run_clock(con)  # rank 3 wrote no device timing: a mixed run
    assert clock is Clock.CPU and warning is not None
    assert pa.types.is_int64(pq.read_schema(victim).field("duration_ns").type)


def test_a_live_monitor_refuses_parts_of_an_earlier_version_in_one_line(tmp_path: Path) -> None:
    from rankwatch.analytics.errors import SchemaVersionError
    from rankwatch.analytics.live import LiveAnalyzer

    run = gpu_run(tmp_path, versions={Table.STEPS: 2})
    with pytest.raises(SchemaVersionError, match=r"steps/rank=\d/part-000000.parquet: schema version 2; a live"):
        LiveAnalyzer(run).refresh()
    assert analyze(run).ranks == RANKS  # post hoc, the same run is read
