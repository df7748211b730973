"""Each named query against a tiny hand-made run whose answers are worked out by hand below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from rankwatch.analytics import queries as q
from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.analytics.store import connect, open_run
from rankwatch.base.schema import Table, column_names
from rankwatch.collector.sink import partition_dir, rows_to_table

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def write(run: Path, table: Table, rank: int, rows: list[dict[str, Any]], part: int = 0) -> Path:
    cols = column_names(table)
    unknown = {k for r in rows for k in r} - set(cols)
    assert not unknown, unknown
    tuples = [tuple(r.get(c) for c in cols) for r in rows]
    d = partition_dir(run, table, rank)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"part-{part:06d}.parquet"
    pq.write_table(rows_to_table(table, tuples), path)
    return path


def _groups(rank: int) -> list[dict[str, Any]]:
    # 4 ranks, dp=2 x tp=2, hosts: ranks 0,1 on host0 and 2,3 on host1
    dp, tp = rank // 2, rank % 2
    link = "host0<->host1"
    return [
        {"name": f"dp.pp0.tp{tp}", "kind": "dp", "ranks": [tp, 2 + tp], "hosts": ["host0", "host1"], "links": [link]},
        {"name": f"tp.pp0.dp{dp}", "kind": "tp", "ranks": [2 * dp, 2 * dp + 1], "hosts": [f"host{dp}"] * 2, "links": []},
    ]


def _collective(rank: int, step: int, seq: int, group: str, ranks: list[int], group_seq: int, duration_ms: float,
                *, status: str = "ok", nbytes: int = 1000, enter_ms: float = 0.0) -> dict[str, Any]:
    enter = T0 + int((step * 100 + enter_ms) * MS)
    done = status != "in_flight"
    return {
        "rank": rank, "step": step, "seq": seq, "group_seq": group_seq, "op": "all_reduce", "group": group,
        "group_ranks": ranks, "bytes": nbytes, "dtype": "float32", "async_op": False, "enter_wall_ns": enter,
        "enter_mono_ns": enter, "exit_wall_ns": enter + int(duration_ms * MS) if done else None,
        "exit_mono_ns": enter + int(duration_ms * MS) if done else None,
        "duration_ns": int(duration_ms * MS) if done else None, "status": status,
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tiny")
    for rank in range(4):
        write(run, Table.TOPOLOGY, rank, [{
            "rank": rank, "attempt": 0, "world_size": 4, "local_rank": rank % 2, "host": f"host{rank // 2}",
            "pid": 100 + rank, "start_wall_ns": T0, "backend": "gloo", "dp": rank // 2, "tp": rank % 2, "pp": 0,
            "dp_size": 2, "tp_size": 2, "pp_size": 1, "groups": _groups(rank)}])
        write(run, Table.STEPS, rank, [{
            "rank": rank, "step": s, "attempt": 0, "start_wall_ns": T0 + s * 100 * MS,
            "end_wall_ns": T0 + (s * 100 + 90) * MS, "start_mono_ns": 0, "end_mono_ns": 90 * MS,
            "duration_ns": 90 * MS, "compute_ns": (60 if rank == 3 else 40) * MS,
            "collective_wait_ns": (20 if rank == 3 else 40) * MS, "dataloader_wait_ns": 5 * MS,
            "checkpoint_ns": 5 * MS if s == 1 else 0, "num_collectives": 2, "loss": None,
            "local_grad_norm": 1.0, "all_finite": True, "data_position": 8 * (s + 1)} for s in range(3)])
        events = [{"rank": rank, "attempt": 0, "wall_ns": T0, "mono_ns": 0, "kind": "start"}]
        events += [{"rank": rank, "attempt": 0, "wall_ns": T0 + k * 100 * MS, "mono_ns": 0, "kind": "heartbeat",
                    "step": k} for k in range(1, 4)]
        if rank != 3:
            events.append({"rank": rank, "attempt": 0, "wall_ns": T0 + 400 * MS, "mono_ns": 0, "kind": "exit",
                           "step": 2, "exit_code": 0})
        write(run, Table.EVENTS, rank, events)
        fp = {"domain": f"dp.pp0.tp{rank % 2}", "domain_ranks": [rank % 2, 2 + rank % 2], "param_hash": "p",
              "optim_hash": "o", "rng_python_hash": "a", "rng_numpy_hash": "b", "rng_torch_hash": "c",
              "data_position": 16, "param_count": 10}
        if rank == 3:
            fp["param_hash"] = "p-flipped"
        write(run, Table.FINGERPRINTS, rank, [{"rank": rank, "step": 1, "attempt": 0, "wall_ns": T0, **fp}])
        write(run, Table.GPU, rank, [{
            "rank": rank, "device_index": rank % 2, "device_uuid": f"GPU-{rank}", "pci_bus_id": f"0000:0{rank}:00.0",
            "source": "replay", "wall_ns": T0 + s * 100 * MS, "mono_ns": 0, "step": s,
            "sm_clock_mhz": 1500 if rank == 2 else 1980, "sm_clock_max_mhz": 1980, "power_w": 500.0,
            "temperature_c": 60.0 + (20 if rank == 2 else 0), "throttle_reasons": 0x40 if rank == 2 else 0,
            "ecc_dbe_volatile": (s if rank == 1 else 0), "pcie_replay": 7, "xid_events": [79] if (rank, s) == (1, 2) else []}
            for s in range(3)])
    # tp all_reduces: group tp.pp0.dp1 = ranks 2,3; rank 3 is late (waits least); tp.pp0.dp0 = ranks 0,1 even.
    rows: dict[int, list[dict[str, Any]]] = {r: [] for r in range(4)}
    for s in range(3):
        rows[0].append(_collective(0, s, 0, "tp.pp0.dp0", [0, 1], s, 10))
        rows[1].append(_collective(1, s, 0, "tp.pp0.dp0", [0, 1], s, 12))
        rows[2].append(_collective(2, s, 0, "tp.pp0.dp1", [2, 3], s, 30))
        rows[3].append(_collective(3, s, 0, "tp.pp0.dp1", [2, 3], s, 5))
        for r in range(4):  # dp all_reduce across the link: transfer (the shortest member time) 8 ms, 8e6 bytes
            rows[r].append(_collective(r, s, 1, f"dp.pp0.tp{r % 2}", [r % 2, 2 + r % 2], s, 8 if r < 2 else 9,
                                       nbytes=8_000_000, enter_ms=50))
    # rank 0 snapshotted its step-2 dp op while in flight, then completed it: superseded
    rows[0].append(_collective(0, 2, 1, "dp.pp0.tp0", [0, 2], 2, 0, status="in_flight", enter_ms=50))
    # rank 2 is stuck in a step-3 tp op that rank 3 never entered
    rows[2].append(_collective(2, 3, 0, "tp.pp0.dp1", [2, 3], 3, 0, status="in_flight"))
    for r in range(4):
        write(run, Table.COLLECTIVES, r, rows[r])
    write(run, Table.CHECKPOINT_PHASES, 0, [{
        "rank": 0, "step": 1, "checkpoint_id": "step-00000001", "phase": "write", "start_wall_ns": T0 + 150 * MS,
        "start_mono_ns": 0, "end_wall_ns": T0 + 160 * MS, "end_mono_ns": 0, "duration_ns": 10 * MS, "bytes": 4096,
        "ok": True}])
    return run


def test_topology_latest_attempt_and_role(tiny: Path) -> None:
    t = q.topology(connect(tiny))
    assert t["rank"].to_list() == [0, 1, 2, 3]
    assert t["role"].to_list() == ["pp=0"] * 4
    assert t["host"].to_list() == ["host0", "host0", "host1", "host1"]


def test_groups_once_each(tiny: Path) -> None:
    g = q.groups(connect(tiny))
    assert g["group"].to_list() == ["dp.pp0.tp0", "dp.pp0.tp1", "tp.pp0.dp0", "tp.pp0.dp1"]
    assert g.filter(pl.col("kind") == "dp")["links"].to_list() == [["host0<->host1"]] * 2


def test_lateness_blames_the_rank_that_waited_least(tiny: Path) -> None:
    lat = q.lateness(connect(tiny)).filter(pl.col("step") == 0).sort("rank")
    # tp.pp0.dp0: 0 waited 10 ms, 1 12 ms -> 0 is 2 ms late; tp.pp0.dp1: 2 waited 30, 3 5 -> 3 is 25 ms late;
    # dp ops: ranks 0,1 waited 8 ms, ranks 2,3 9 ms -> 0 and 1 are 1 ms late
    assert lat["late_ns"].to_list() == [3 * MS, 1 * MS, 0, 25 * MS]
    assert lat["last_arrivals"].to_list() == [2, 1, 0, 1]
    assert lat["ops"].to_list() == [2, 2, 2, 2]


def test_link_transfer_is_the_shortest_member_time(tiny: Path) -> None:
    links = q.links(connect(tiny))
    assert set(links["link"]) == {"host0<->host1"}
    row = links.filter(pl.col("step") == 0).row(0, named=True)
    assert row["transfer_ns"] == 8 * MS and row["ops"] == 2 and row["bytes"] == 16_000_000
    assert row["gbps"] == pytest.approx(8.0)  # 16e6 bytes * 8 bit / 16e6 ns
    gt = q.group_transfer(connect(tiny)).filter((pl.col("group") == "tp.pp0.dp1") & (pl.col("step") == 0))
    assert gt["transfer_ns"].to_list() == [5 * MS]


def test_point_to_point_transfer_pairs_send_with_recv(tmp_path: Path) -> None:
    # rank 0 (host0) sends twice to rank 2 (host1) in step 0; the pair's transfer is the shorter side's time
    run = tmp_path / "p2p"
    for rank in (0, 2):
        write(run, Table.TOPOLOGY, rank, [{
            "rank": rank, "attempt": 0, "world_size": 4, "local_rank": 0, "host": f"host{rank // 2}", "pid": 1,
            "start_wall_ns": T0, "backend": "gloo", "dp": 0, "tp": 0, "pp": rank // 2, "dp_size": 1, "tp_size": 1,
            "pp_size": 2, "groups": [{"name": "pp.dp0.tp0", "kind": "pp", "ranks": [0, 2], "hosts": ["host0", "host1"],
                                      "links": ["host0<->host1"]}]}])
    rows = []
    for seq, (send_ms, recv_ms) in enumerate(((4, 9), (12, 3))):
        for rank, op, peer, ms in ((0, "send", 2, send_ms), (2, "recv", 0, recv_ms)):
            row = _collective(rank, 0, seq, "pp.dp0.tp0", [0, 2], seq, ms, nbytes=4_000_000)
            rows.append({**row, "op": op, "peer": peer})
    write(run, Table.COLLECTIVES, 0, [r for r in rows if r["rank"] == 0])
    write(run, Table.COLLECTIVES, 2, [r for r in rows if r["rank"] == 2])
    links = q.links(connect(run))
    assert links.select("link", "kind", "step", "ops", "bytes", "transfer_ns").rows() == [
        ("host0<->host1", "pp", 0, 2, 8_000_000, int(3.5 * MS))]  # median of min(4, 9) and min(12, 3)


def test_open_collectives_only_unsuperseded(tiny: Path) -> None:
    o = q.open_collectives(connect(tiny))
    assert o.select("rank", "step", "group", "group_seq").rows() == [(2, 3, "tp.pp0.dp1", 3)]


def test_liveness(tiny: Path) -> None:
    lv = q.liveness(connect(tiny)).sort("rank")
    assert lv["last_step"].to_list() == [2, 2, 2, 2]
    assert lv["last_heartbeat_wall_ns"].to_list() == [T0 + 300 * MS] * 4
    assert lv["last_seen_wall_ns"].to_list() == [T0 + 400 * MS] * 3 + [T0 + 300 * MS]
    assert lv["heartbeat_step"].to_list() == [3] * 4


def test_gpu_counters_and_xids(tiny: Path) -> None:
    g = q.gpu(connect(tiny)).filter(pl.col("rank") == 1).sort("step")
    assert g["ecc_dbe_volatile"].to_list() == [0, 1, 2]
    assert g["xid_events"].to_list() == [[], [], [79]]
    peers = q.gpu_vs_peers(connect(tiny)).sort("rank")
    assert peers["throttled_share"].to_list() == [0.0, 0.0, 1.0, 0.0]
    assert peers["new_ecc_dbe"].to_list() == [0, 2, 0, 0]
    assert peers["xid_count"].to_list() == [0, 1, 0, 0]
    assert peers["temp_vs_peers_c"].to_list() == [0.0, 0.0, 20.0, 0.0]


def test_compute_decomposition(tiny: Path) -> None:
    d = q.compute_decomposition(connect(tiny)).sort("rank")
    assert d["compute_ms"].to_list() == [40.0, 40.0, 40.0, 60.0]
    assert d["checkpoint_ms_total"].to_list() == [5.0] * 4


def test_fingerprint_agreement(tiny: Path) -> None:
    f = q.fingerprint_agreement(connect(tiny)).sort("domain")
    assert f.select("domain", "members", "param_values", "rng_values", "agree").rows() == [
        ("dp.pp0.tp0", 2, 1, 1, True), ("dp.pp0.tp1", 2, 2, 1, False)]


def test_arrival_order(tiny: Path) -> None:
    a = q.arrival_order(connect(tiny)).filter((pl.col("step") == 0) & (pl.col("group") == "tp.pp0.dp1"))
    assert a.select("rank", "arrival", "lateness_ns").rows() == [(2, 0, 0), (3, 1, 25 * MS)]


def test_checkpoint_overlap(tiny: Path) -> None:
    c = q.checkpoint_overlap(connect(tiny))
    assert c.select("checkpoint_id", "step", "slowest_phase", "overlapping_slow_steps").rows() == [
        ("step-00000001", 1, "write", 0)]


def test_window_limits_step_frames(tiny: Path) -> None:
    frames = q.load_frames(tiny, since_step=2)
    assert frames.steps["step"].unique().to_list() == [2]
    assert frames.lateness["step"].unique().to_list() == [2]
    assert frames.end_wall_ns == T0 + 400 * MS
    assert frames.heartbeat_interval_ns == 100 * MS


def test_missing_tables_give_empty_frames(tmp_path: Path) -> None:
    write(tmp_path, Table.STEPS, 0, [{"rank": 0, "step": 0, "attempt": 0, "start_wall_ns": 0, "end_wall_ns": 1,
                                      "start_mono_ns": 0, "end_mono_ns": 1, "duration_ns": 1, "compute_ns": 1,
                                      "collective_wait_ns": 0, "dataloader_wait_ns": 0, "checkpoint_ns": 0,
                                      "num_collectives": 0, "all_finite": True}])
    frames = q.load_frames(tmp_path)
    assert frames.steps.height == 1 and frames.lateness.height == 0 and frames.open_collectives.height == 0
    assert frames.liveness.height == 0 and frames.gpu.columns[0] == "rank"


def test_open_run_leaves_out_a_cut_part_with_a_warning(tiny: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny, run)
    victim = next((run / "telemetry" / "steps" / "rank=3").glob("part-*.parquet"))
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    store = open_run(run)
    assert len(store.warnings) == 1 and str(victim) in store.warnings[0] and "\n" not in store.warnings[0]
    assert store.con.execute("SELECT count(DISTINCT rank) FROM steps").fetchall()[0][0] == 3
    with pytest.raises(RunDirError, match="rank=3"):
        connect(run)


def test_open_run_errors(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(RunDirError, match="does not exist"):
        open_run(tmp_path / "nope")
    (tmp_path / "empty" / "telemetry").mkdir(parents=True)
    with pytest.raises(RunDirError, match="no telemetry part files"):
        open_run(tmp_path / "empty")
    import shutil

    run = tmp_path / "future"
    shutil.copytree(tiny, run)
    victim = next((run / "telemetry" / "events" / "rank=0").glob("part-*.parquet"))
    table = pq.read_table(victim)
    pq.write_table(table.replace_schema_metadata({b"rankwatch.schema_version": b"99"}), victim)
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        open_run(run)


def test_heartbeat_period_comes_from_the_window_or_else_from_the_whole_run() -> None:
    con = duckdb.connect()
    con.execute("CREATE TABLE events (rank BIGINT, attempt BIGINT, step BIGINT, kind VARCHAR, wall_ns BIGINT)")
    s = 1_000_000_000
    rows = [(r, 0, step, "heartbeat", step * 5 * s + r) for r in range(4) for step in range(10)]  # every 5 s
    con.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?)", rows)
    assert q.heartbeat_interval_ns(con) == 5 * s
    assert q.heartbeat_interval_ns(con, since_step=5) == 5 * s
    assert q.heartbeat_interval_ns(con, since_step=9) == 5 * s  # one heartbeat per rank in the window: the run's
    con.execute("DELETE FROM events")
    assert q.heartbeat_interval_ns(con, since_step=9) == s  # none at all: the default


def _untimed(rank: int, step: int, group: str, ranks: list[int], seq: int, enter_ms: float) -> dict[str, Any]:
    """A collective no wrapper saw (a compiled graph's), as the writer records it from the Flight Recorder."""
    enter = T0 + int((step * 100 + enter_ms) * MS)
    return {"rank": rank, "step": step, "seq": -1, "group_seq": -seq, "op": "all_reduce", "group": group,
            "group_ranks": ranks, "bytes": 64, "dtype": "float32", "async_op": False, "enter_wall_ns": enter,
            "enter_mono_ns": enter, "status": "untimed"}


def _untimed_run(run: Path, hosts: list[str], *, drop_late: bool = False) -> Path:
    """Two ranks in one tensor-parallel group whose all-reduces run in a compiled graph (untimed rows): rank 1 arrives
    30 ms after rank 0 at the first of each step, 1 ms after at the second; each rank's own clock reads both steps
    and operations (monotonic = wall here). `drop_late`: rank 1's rows of the first ones lost."""
    for rank in (0, 1):
        write(run, Table.TOPOLOGY, rank, [{
            "rank": rank, "attempt": 0, "world_size": 2, "local_rank": rank, "host": hosts[rank], "pid": 1 + rank,
            "start_wall_ns": T0, "backend": "gloo", "dp": 0, "tp": rank, "pp": 0, "dp_size": 1, "tp_size": 2,
            "pp_size": 1, "groups": [{"name": "tp0", "kind": "tp", "ranks": [0, 1], "hosts": hosts, "links": []}]}])
        write(run, Table.EVENTS, rank, [{"rank": rank, "attempt": 0, "wall_ns": T0 - MS, "mono_ns": 0,
                                         "kind": "start"}])
        write(run, Table.STEPS, rank, [{
            "rank": rank, "step": s, "attempt": 0, "start_wall_ns": T0 + s * 100 * MS,
            "end_wall_ns": T0 + (s * 100 + 90) * MS, "start_mono_ns": T0 + s * 100 * MS,
            "end_mono_ns": T0 + (s * 100 + 90) * MS, "duration_ns": 90 * MS, "compute_ns": 80 * MS,
            "collective_wait_ns": 10 * MS, "dataloader_wait_ns": 0, "checkpoint_ns": 0, "num_collectives": 1,
            "loss": None, "local_grad_norm": 1.0, "all_finite": True, "data_position": s} for s in range(6)])
        rows = []
        for s in range(6):
            rows.append(_untimed(rank, s, "tp0", [0, 1], 2 * s + 1, 10 + (30 if rank == 1 else 0)))
            rows.append(_untimed(rank, s, "tp0", [0, 1], 2 * s + 2, 60 + (1 if rank == 1 else 0)))
        if drop_late and rank == 1:
            rows = [r for r in rows if r["group_seq"] % 2 == 0]  # only the second of each step left
        write(run, Table.COLLECTIVES, rank, rows)
    return run


@pytest.mark.parametrize("case", ["one host", "two hosts", "a member's row missing"])
def test_waits_in_untimed_collectives_are_read_from_arrivals_on_one_host(tmp_path: Path, case: str) -> None:
    """Compiled tensor-parallel all-reduces (untimed rows): rank 1 arrives 30 ms after rank 0 at the first of each
    step. Rank 0 waited those 30 ms; without the untimed rows they count as its compute, and it looks as slow as
    rank 1. Across hosts the wall clocks differ, and an operation missing a member's row tells nothing: no change."""
    run = _untimed_run(tmp_path / "run", ["h0", "h1"] if case == "two hosts" else ["h0", "h0"],
                       drop_late=case == "a member's row missing")
    steps = q.steps(connect(run)).sort("rank", "step")
    got = [(r, c // MS, w // MS) for r, c, w in steps.select("rank", "compute_ns", "collective_wait_ns").iter_rows()]
    if case == "one host":
        assert got == [(0, 49, 41)] * 6 + [(1, 80, 10)] * 6  # 30 + 1 ms of waiting, no longer compute
    elif case == "two hosts":
        assert got == [(0, 80, 10)] * 6 + [(1, 80, 10)] * 6
    else:
        assert got == [(0, 79, 11)] * 6 + [(1, 80, 10)] * 6  # the second all-reduce of each step only


def test_the_what_if_replays_untimed_collectives_as_ending_at_their_last_arrival(tmp_path: Path) -> None:
    """The same compiled all-reduces in the what-if: rank 0's 30 ms at the first of each step is waiting for rank 1,
    so the work to fix is rank 1's (without the untimed rows each rank's step is one span of work, alike)."""
    from rankwatch.analytics.whatif import whatif

    w = whatif(_untimed_run(tmp_path / "run", ["h0", "h0"]))
    saves = {s.subject: s.saved_share for s in w.by_rank}
    assert saves["rank:1"] > 0.1 and saves["rank:0"] < 0.02, saves
    assert w.last_rank is not None and w.last_rank[0] == 1
