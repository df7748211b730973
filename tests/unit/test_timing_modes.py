"""`SimConfig(timing=Timing.GPU)` writes what a CUDA job's collector writes: CPU columns without the straggler
signal (launch latencies, one sync point per step), device columns with it; `Timing.CPU` stays what it was."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rankwatch.analytics.incidents import Cause, IncidentClass
from rankwatch.analytics.store import connect
from rankwatch.base.topology import Layout
from rankwatch.simulator import SimConfig, read_labels, simulate
from rankwatch.simulator.config import Timing
from rankwatch.simulator.faults import FailHow, FailStop, HostDataloader, SlowLink, Straggler, StragglerCause

LAYOUT = Layout(dp=8, tp=2, pp=2)
SLOW = 13


def _cfg(*faults: object, timing: Timing | None = Timing.GPU, steps: int = 60) -> SimConfig:
    """A 32-rank run; timing=None leaves the field at its default."""
    kw = {} if timing is None else {"timing": timing}
    return SimConfig(layout=LAYOUT, hosts=4, steps=steps, seed=1, checkpoint_every=30, faults=faults,  # type: ignore[arg-type]
                     **kw)


@pytest.fixture(scope="module")
def device_slow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("device_slow")
    simulate(_cfg(Straggler(rank=SLOW, from_step=20, slow=0.2)), out)
    return out


@pytest.fixture(scope="module")
def host_stall(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("host_stall")
    simulate(_cfg(Straggler(rank=SLOW, from_step=20, slow=0.2, cause=StragglerCause.HOST_STALL)), out)
    return out


def _per_rank(run: Path, column: str, where: str = "step >= 20") -> dict[int, float]:
    return dict(connect(run).execute(f"select rank, avg({column}) from steps where {where} group by rank").fetchall())


def _last_arrival_share(run: Path, column: str) -> tuple[float, float]:
    """(share of the slow rank's all-reduces where its `column` is the group's least, chance of that)."""
    row = connect(run).execute(f"""
        with x as (select rank, {column} v, min({column}) over w least, count(*) over w k from collectives
                   where op = 'all_reduce' and step >= 20 and list_contains(group_ranks, {SLOW})
                   window w as (partition by "group", group_seq))
        select avg((v = least)::int), avg(1.0 / k) from x where rank = {SLOW}""").fetchone()
    assert row is not None
    return float(row[0]), float(row[1])


@pytest.mark.timeout(60)
def test_gpu_slow_device_shows_only_on_the_device_clock(device_slow: Path) -> None:
    cpu = _per_rank(device_slow, "compute_ns")
    peers = np.array([v for r, v in cpu.items() if r != SLOW])
    assert abs(cpu[SLOW] - np.median(peers)) < 3 * peers.std() + 1e-3 * np.median(peers)
    dev = _per_rank(device_slow, "device_compute_ns")
    assert dev[SLOW] > 1.15 * np.median([v for r, v in dev.items() if r != SLOW])
    share, chance = _last_arrival_share(device_slow, "duration_ns")
    assert share < 1.5 * chance  # CPU durations are launch latency: the slow rank is no more often the least
    share, _ = _last_arrival_share(device_slow, "device_duration_ns")
    assert share > 0.9  # on the device the others wait for it
    con = connect(device_slow)
    lat = con.execute("select median(duration_ns), max(duration_ns) from collectives where status = 'ok'").fetchone()
    assert lat is not None and 5_000 < lat[0] < 100_000 and lat[1] < 1_000_000
    bad = con.execute(
        "select count(*) from steps where duration_ns != compute_ns + collective_wait_ns + dataloader_wait_ns "
        "+ checkpoint_ns or device_compute_ns != device_ns - device_collective_ns or device_compute_ns <= 0 "
        "or device_ns is null").fetchone()
    assert bad == (0,)
    # CPU phases are enqueue time, except the optimizer, which holds the sync point
    ph = dict(con.execute("select phase, avg(duration_ns) / avg(device_duration_ns) from phases where rank = 4 "
                          "group by phase").fetchall())
    assert ph["forward"] < 0.2 and ph["backward"] < 0.2 and ph["optimizer"] > 5
    (label,) = read_labels(device_slow).expected
    assert label.cause == Cause.DEVICE_SLOW


def _backward_kernels(run: Path) -> dict[int, float]:
    """Per rank, mean device time of the backward phase outside collectives (those the device reached after the
    data and forward phases)."""
    return dict(connect(run).execute("""
        with ph as (pivot (select rank, step, phase, device_duration_ns from phases where step >= 20)
                    on phase using first(device_duration_ns)),
             co as (select c.rank, c.step, sum(c.device_duration_ns) d from collectives c join ph using (rank, step)
                    where c.device_start_ns >= ph.data + ph.forward - 1000 group by all)
        select rank, avg(ph.backward - co.d) from ph join co using (rank, step) group by rank""").fetchall())


@pytest.mark.timeout(60)
def test_gpu_host_stall_shows_in_its_phase_and_device_time_only(host_stall: Path, device_slow: Path) -> None:
    con = connect(host_stall)

    def phase(run: Path, name: str, column: str) -> dict[int, float]:
        return dict(connect(run).execute(f"select rank, avg({column}) from phases where phase = '{name}' and "
                                         "step >= 20 group by rank").fetchall())

    fwd = phase(host_stall, "forward", "duration_ns")
    assert fwd[SLOW] > 5 * np.median([v for r, v in fwd.items() if r != SLOW])
    dev = _per_rank(host_stall, "device_compute_ns")
    assert dev[SLOW] > 1.1 * np.median([v for r, v in dev.items() if r != SLOW])
    # the stall is not device kernel time: the slow rank's backward kernels take what its stage peers' do, while
    # a slow GPU's take longer
    for run, longer in ((host_stall, False), (device_slow, True)):
        bwd = _backward_kernels(run)
        peer = np.median([v for r, v in bwd.items() if r != SLOW and r // 16 == SLOW // 16])
        assert bool(bwd[SLOW] > 1.05 * peer) is longer
        fwd = phase(run, "forward", "duration_ns")
        assert bool(fwd[SLOW] > 2 * np.median(list(fwd.values()))) is not longer
    cpu = _per_rank(host_stall, "compute_ns")
    assert abs(cpu[SLOW] - np.median(list(cpu.values()))) < 0.01 * np.median(list(cpu.values()))
    (label,) = read_labels(host_stall).expected
    assert label.cause == Cause.HOST_STALL
    assert con.execute("select count(*) from steps where device_ns is null").fetchone() == (0,)


@pytest.mark.timeout(60)
def test_gpu_dataloader_rank_is_late_on_the_device(tmp_path: Path) -> None:
    simulate(_cfg(HostDataloader(host=1, from_step=20, slow=0.3)), tmp_path)
    dl = _per_rank(tmp_path, "dataloader_wait_ns")
    assert min(dl[r] for r in range(8, 16)) > 5 * max(dl[r] for r in range(8) )
    con = connect(tmp_path)
    start = dict(con.execute("select rank, avg(device_start_ns) from collectives where step >= 20 and "
                             "\"group\" like 'dp%' group by rank").fetchall())
    assert min(start[r] for r in range(8, 16)) > max(start[r] for r in range(16, 32))
    (label,) = read_labels(tmp_path).expected
    assert label.cause == Cause.DATALOADER


@pytest.mark.timeout(60)
def test_gpu_slow_link_and_fail_stop_keep_their_shape(tmp_path: Path) -> None:
    simulate(_cfg(SlowLink(host_a=0, host_b=1, from_step=20, factor=4.0)), tmp_path / "link")
    con = connect(tmp_path / "link")
    rows = dict(con.execute(
        "select step >= 20, median(device_duration_ns) from collectives where \"group\" = 'dp.pp0.tp0' group by 1"
    ).fetchall())
    assert rows[True] > 1.5 * rows[False]
    cpu = dict(con.execute(
        "select step >= 20, median(duration_ns) from collectives where \"group\" = 'dp.pp0.tp0' group by 1"
    ).fetchall())
    assert cpu[True] < 1.5 * cpu[False] and cpu[True] < 100_000
    simulate(_cfg(FailStop(rank=6, step=40, how=FailHow.EXIT)), tmp_path / "fail")
    con = connect(tmp_path / "fail")
    assert con.execute("select max(step) from steps where rank = 6").fetchone() == (39,)
    errs = con.execute("select count(distinct rank) from collectives where status = 'error'").fetchone()
    assert errs == (LAYOUT.world_size - 1,)
    in_flight = con.execute("select count(*), count(device_duration_ns) from collectives "
                            "where status != 'ok'").fetchone()
    assert in_flight is not None and in_flight[0] > 0 and in_flight[1] == 0


def _steps_digest(run: Path) -> str:
    rows = connect(run).execute(
        "select rank, step, duration_ns, compute_ns, collective_wait_ns, dataloader_wait_ns, checkpoint_ns, "
        "start_mono_ns from steps order by rank, step").fetchall()
    return hashlib.blake2b(repr(rows).encode(), digest_size=8).hexdigest()


#: `_steps_digest` of `_cfg(Straggler(rank=13, from_step=20, slow=0.2), timing=CPU)` written by the simulator before
#: it learned GPU timing: the CPU mode's output must not move (update it only for a deliberate model change).
_CPU_DIGEST = "6cfe79a6fe0a76b4"


@pytest.mark.timeout(60)
def test_cpu_mode_is_unchanged(tmp_path: Path) -> None:
    cfg = _cfg(Straggler(rank=SLOW, from_step=20, slow=0.2), timing=Timing.CPU)
    simulate(cfg, tmp_path / "cpu")
    default = _cfg(Straggler(rank=SLOW, from_step=20, slow=0.2), timing=None)
    assert default.timing is Timing.CPU
    simulate(default, tmp_path / "default")
    assert _steps_digest(tmp_path / "cpu") == _steps_digest(tmp_path / "default") == _CPU_DIGEST
    con = connect(tmp_path / "cpu")
    assert con.execute("select count(device_ns), count(device_compute_ns) from steps").fetchone() == (0, 0)
    assert con.execute("select count(device_duration_ns), count(device_start_ns) from collectives").fetchone() == (0, 0)
    assert con.execute("select count(device_duration_ns) from phases").fetchone() == (0,)
    (label,) = read_labels(tmp_path / "cpu").expected
    assert label.cause == Cause.UNKNOWN
    stall = replace(cfg, faults=(Straggler(rank=SLOW, from_step=20, slow=0.2, cause=StragglerCause.HOST_STALL),))
    assert labels_cause(stall) == Cause.UNKNOWN


def labels_cause(cfg: SimConfig) -> Cause:
    from rankwatch.simulator.labels import labels_for

    (label,) = labels_for(cfg).expected
    return label.cause


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fixture", ["device_slow", "host_stall"])
def test_cpu_clock_misses_gpu_stragglers(fixture: str, request: pytest.FixtureRequest) -> None:
    """The CPU-only detector path is blind on a GPU job: the reason the device columns exist."""
    analyze_mod = pytest.importorskip("rankwatch.analytics.analyze")
    frames = pytest.importorskip("rankwatch.analytics.frames")
    if not hasattr(frames, "Clock") or "clock" not in inspect.signature(analyze_mod.analyze).parameters:
        pytest.skip("analytics has no Clock yet (analyze(run, clock=...))")
    run: Path = request.getfixturevalue(fixture)
    found = analyze_mod.analyze(run, clock=frames.Clock.CPU).incidents
    assert not [i for i in found if i.klass is IncidentClass.STRAGGLER and SLOW in i.ranks]
    found = analyze_mod.analyze(run, clock=frames.Clock.AUTO).incidents
    assert [i for i in found if i.klass is IncidentClass.STRAGGLER and SLOW in i.ranks]


@pytest.fixture(scope="module")
def device_clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("device_clean")
    simulate(_cfg(), out)
    return out


@pytest.mark.timeout(120)
def test_the_what_if_replays_a_gpu_run_on_its_devices(device_slow: Path, host_stall: Path, device_clean: Path,
                                                       tmp_path: Path) -> None:
    """On a CUDA run the what-if reads each rank's device: its S matches the measured ratio to the same run without
    the fault (the summed device step time of the slowest rank, steps 20..59), the slow device's rank is what fixing
    saves most, a host stall (the device idles waiting for its host) costs as much, and a clean run costs nothing.
    Every incident of the slow run carries a measured impact (it was UNMEASURED: a device-timed run)."""
    from rankwatch.analytics.analyze import analyze
    from rankwatch.analytics.incidents import ImpactBasis
    from rankwatch.analytics.whatif import whatif

    def measured(run: Path) -> float:
        return max(_summed(run).values())

    clean = whatif(device_clean, steps=(20, 59))
    assert clean.clock == "device" and clean.slowdown < 1.03
    assert 0.98 < clean.fidelity < 1.02
    for run in (device_slow, host_stall):
        w = whatif(run, steps=(20, 59))
        assert w.clock == "device" and w.by_rank[0].subject == f"rank:{SLOW}"
        ratio = measured(run) / measured(device_clean)
        assert ratio > 1.05 and abs(w.slowdown / ratio - 1) < 0.10, (w.slowdown, ratio)
    slow = [i for i in analyze(device_slow).incidents if SLOW in i.ranks]
    assert slow and all(i.impact is not None and i.impact.basis is ImpactBasis.WHATIF for i in slow)
    assert slow[0].impact is not None and slow[0].impact.share > 0.03
    assert [i for i in analyze(device_clean).incidents if i.klass is IncidentClass.STRAGGLER] == []


def _summed(run: Path) -> dict[int, float]:
    return dict(connect(run).execute("select rank, sum(device_ns) from steps where step between 20 and 59 "
                                     "group by rank").fetchall())


@pytest.mark.timeout(60)
def test_a_step_with_unresolved_device_events_is_left_out_of_the_device_replay(device_clean: Path,
                                                                              tmp_path: Path) -> None:
    """A rank whose CUDA events for one collective were dropped unresolved (null device start): that step cannot be
    placed on its device's clock, so the replay leaves it out, says so, and replays the rest."""
    import shutil

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from rankwatch.analytics.whatif import whatif

    run = tmp_path / "run"
    shutil.copytree(device_clean, run)
    part = next((run / "telemetry" / "collectives" / "rank=5").glob("*.parquet"))
    table = pq.read_table(part)
    hit = pc.and_(pc.equal(table["step"], 30), pc.equal(table["seq"], 0))
    col = table.schema.get_field_index("device_start_ns")
    dropped = pc.if_else(hit, pa.scalar(None, pa.int64()), table["device_start_ns"])
    pq.write_table(table.set_column(col, table.schema.field(col), dropped), part)
    w = whatif(run, steps=(20, 39))
    assert w.clock == "device" and (w.first_step, w.last_step) == (20, 39)
    assert [x for x in w.warnings if "1 step(s) of the window left out of the device-clock replay" in x
            and "(steps 30)" in x]
    assert sum(1 for s, _ in w.step_ns if s == 30) == 0 and len(w.step_ns) == 19
