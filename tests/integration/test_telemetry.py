"""A clean 8-rank canary run (dp=2, tp=2, pp=2 over 2 virtual hosts): every table written, readable with
DuckDB, and internally consistent."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.base.schema import Table
from rankwatch.collector.gpu import replay_uuid

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 30


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[int, ...]]:
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    result = run(canary(run_dir, layout="dp=2,tp=2,pp=2", hosts=2, steps=STEPS, checkpoint_every=10, fingerprint_every=5))
    assert result.ok, result
    return run_dir, result.pids


def test_every_table_has_every_rank(clean_run: tuple[Path, tuple[int, ...]]) -> None:
    run_dir, _ = clean_run
    for table in Table:
        ((n, ranks),) = rows(run_dir, f"SELECT count(*), count(DISTINCT rank) FROM {table}")
        assert ranks == 8 and n > 0, table
    files = list((run_dir / TELEMETRY_DIR).rglob("*"))
    assert not [f for f in files if f.name.endswith(".tmp")]
    for f in files:
        if f.suffix == ".parquet":
            pq.read_table(f)


def test_steps_are_complete_and_decomposed(clean_run: tuple[Path, tuple[int, ...]]) -> None:
    run_dir, _ = clean_run
    ((n, bad, ranks_per_step),) = rows(
        run_dir,
        "SELECT count(*), count(*) FILTER (WHERE compute_ns + collective_wait_ns + dataloader_wait_ns + checkpoint_ns "
        "> duration_ns OR duration_ns <= 0), min(c) FROM steps JOIN (SELECT step, count(*) c FROM steps GROUP BY step) "
        "USING (step)",
    )
    assert n == 8 * STEPS and bad == 0 and ranks_per_step == 8
    # one data position per step over the whole job; loss only on the last stage; finite everywhere
    assert rows(run_dir, "SELECT max(n) FROM (SELECT count(DISTINCT data_position) n FROM steps GROUP BY step)") == [(1,)]
    assert rows(run_dir, "SELECT DISTINCT rank FROM steps WHERE loss IS NOT NULL ORDER BY rank") == [(4,), (5,), (6,), (7,)]
    assert rows(run_dir, "SELECT bool_and(all_finite), min(local_grad_norm) > 0 FROM steps") == [(True, True)]
    # steps with a checkpoint carry its time
    assert rows(run_dir, "SELECT DISTINCT step FROM steps WHERE checkpoint_ns > 0 ORDER BY step") == [(9,), (19,), (29,)]


def test_collectives_match_across_ranks(clean_run: tuple[Path, tuple[int, ...]]) -> None:
    run_dir, _ = clean_run
    ops = {r[0] for r in rows(run_dir, "SELECT DISTINCT op FROM collectives")}
    # all_gather_object: the checkpoint commit protocol's agreement on what every rank wrote
    assert ops == {"all_reduce", "send", "recv", "barrier", "all_gather_object"}
    # (group, group_seq) names one operation: every member recorded it, with one op
    mismatched = rows(
        run_dir,
        'SELECT "group", group_seq FROM collectives WHERE status = \'ok\' GROUP BY ALL '
        "HAVING count(DISTINCT rank) <> max(len(group_ranks)) OR count(DISTINCT op) > 1 AND min(op) NOT IN ('recv')",
    )
    assert mismatched == []
    assert rows(run_dir, "SELECT count(*) FROM collectives WHERE status <> 'ok' OR exit_wall_ns IS NULL") == [(0,)]
    assert rows(run_dir, "SELECT bool_and(async_op) FROM collectives WHERE \"group\" LIKE 'dp.%'") == [(True,)]
    assert rows(run_dir, "SELECT min(bytes) > 0 FROM collectives WHERE op NOT IN ('barrier', 'all_gather_object')") == [(True,)]


def test_topology_has_pids_hosts_and_links(clean_run: tuple[Path, tuple[int, ...]]) -> None:
    run_dir, pids = clean_run
    topo = rows(run_dir, "SELECT rank, pid, host, local_rank, dp, tp, pp, device_uuid, groups FROM topology ORDER BY rank")
    assert [t[1] for t in topo] == list(pids)
    assert [t[2] for t in topo] == ["host0"] * 4 + ["host1"] * 4
    for rank, _, host, local, dp, tp, pp, uuid, groups in topo:
        assert rank == (pp * 2 + dp) * 2 + tp
        assert uuid == replay_uuid(host, local)
        by_kind = {g["kind"]: g for g in groups}
        assert set(by_kind) == {"world", "dp", "tp", "pp"}
        assert by_kind["pp"]["links"] == ["host0<->host1"]
        assert by_kind["tp"]["links"] == [] and by_kind["dp"]["links"] == []


def test_gpu_checkpoint_and_fingerprints(clean_run: tuple[Path, tuple[int, ...]]) -> None:
    run_dir, _ = clean_run
    assert rows(run_dir, "SELECT count(DISTINCT device_uuid), min(sm_clock_mhz) > 1000, max(throttle_reasons) FROM gpu") == [(8, True, 0)]
    phases = rows(run_dir, "SELECT step, phase, count(DISTINCT rank), bool_and(ok) FROM checkpoint_phases GROUP BY ALL ORDER BY ALL")
    assert {(s, p) for s, p, _, _ in phases} == {
        (s, p) for s in (9, 19, 29) for p in ("snapshot", "serialize", "write", "fsync", "publish")}
    # every rank snapshots, serializes, writes and fsyncs its shard; rank 0 alone publishes the manifest
    assert all(n == (1 if p == "publish" else 8) and ok for _, p, n, ok in phases)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000009", "step-00000019", "step-00000029"]
    # replicas of one shard agree on everything, at every fingerprinted step
    disagree = rows(
        run_dir,
        "SELECT domain, step FROM fingerprints GROUP BY ALL HAVING count(DISTINCT param_hash) > 1 OR "
        "count(DISTINCT optim_hash) > 1 OR count(DISTINCT rng_torch_hash) > 1 OR count(DISTINCT data_position) > 1",
    )
    assert disagree == []
    steps = [s for (s,) in rows(run_dir, "SELECT DISTINCT step FROM fingerprints ORDER BY step")]
    assert steps == [0, 5, 10, 15, 20, 25, 29]
