"""The telemetry simulator writes the collector's schema, a consistent time model, and matching ground truth."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind
from rankwatch.analytics.store import connect, part_files
from rankwatch.base.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table, storage_schema
from rankwatch.base.topology import Layout
from rankwatch.simulator import SimConfig, parse_sim_fault, read_labels, simulate, standard_suite
from rankwatch.simulator.faults import (
    Corruption, CorruptionKind, DivergeField, Divergence, FailHow, FailStop, Hang, Straggler, StragglerCause,
)

LAYOUT = Layout(dp=4, tp=2, pp=2)


def _cfg(*faults: object, steps: int = 40, **kw: object) -> SimConfig:
    return SimConfig(layout=LAYOUT, hosts=4, steps=steps, faults=faults, fingerprint_every=10, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clean")
    simulate(_cfg(checkpoint_every=20, name="clean"), out)
    return out


def test_every_table_is_written_with_the_storage_schema_and_version(clean: Path) -> None:
    con = connect(clean)  # checks every part's schema version
    for table in Table:
        files = part_files(clean, table)
        assert len(files) == LAYOUT.world_size, table
        schema = pq.read_schema(files[0])
        assert schema.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
        assert schema.remove_metadata().equals(storage_schema(table).remove_metadata()), table
        assert con.execute(f"select count(distinct rank) from {table}").fetchone() == (LAYOUT.world_size,)
    assert not list(clean.rglob("*.tmp"))


def test_steps_are_consistent_and_clean_fingerprints_agree(clean: Path) -> None:
    con = connect(clean)
    bad = con.execute(
        "select count(*) from steps where duration_ns != compute_ns + collective_wait_ns + dataloader_wait_ns "
        "+ checkpoint_ns or end_mono_ns - start_mono_ns != duration_ns or compute_ns <= 0"
    ).fetchone()
    assert bad == (0,)
    assert con.execute("select count(*) from steps where checkpoint_ns > 0").fetchone() == (2 * LAYOUT.world_size,)
    split = con.execute(
        "select count(*) from (select domain, step, count(distinct param_hash) p, count(distinct optim_hash) o, "
        "count(distinct rng_torch_hash) r, count(distinct data_position) d from fingerprints group by all) "
        "where p > 1 or o > 1 or r > 1 or d > 1"
    ).fetchone()
    assert split == (0,)
    # group_seq is the same across a group's members for the same all-reduce
    mism = con.execute(
        "select count(*) from (select \"group\", step, seq_min from (select \"group\", step, rank, min(group_seq) "
        "seq_min from collectives where op = 'all_reduce' group by all) group by all having count(*) = 0)"
    ).fetchone()
    assert mism == (0,)
    assert con.execute("select count(distinct group_seq) from collectives where \"group\" = 'dp.pp0.tp0' and step = 7").fetchone() == (1,)
    exits = con.execute("select count(*) from events where kind = 'exit' and exit_code = 0").fetchone()
    assert exits == (LAYOUT.world_size,)
    assert con.execute("select count(*) from steps where loss is not null and rank < 8").fetchone() == (0,)


def test_straggler_computes_longer_and_waits_less(tmp_path: Path) -> None:
    simulate(_cfg(Straggler(rank=5, from_step=10, slow=0.2, cause=StragglerCause.THERMAL)), tmp_path)
    con = connect(tmp_path)
    rows = dict(
        (r, (c, w))
        for r, c, w in con.execute(
            "select rank, avg(compute_ns), avg(collective_wait_ns) from steps where step >= 10 and rank in (4, 5) "
            "group by rank"
        ).fetchall()
    )
    assert rows[5][0] > 1.15 * rows[4][0]
    assert rows[5][1] < rows[4][1]
    throttled = con.execute("select min(sm_clock_mhz), bit_or(throttle_reasons) from gpu where rank = 5 and step >= 10").fetchone()
    assert throttled is not None and throttled[0] < 1800 and throttled[1] & 0x40
    label = read_labels(tmp_path).expected[0]
    # a throttled GPU is a device fault: the label names the device (its replayed UUID) and carries rank 5
    assert (label.klass, label.subject_kind, label.ranks, label.cause, label.device_fault) == (
        IncidentClass.STRAGGLER, SubjectKind.DEVICE, (5,), Cause.THERMAL_THROTTLE, True)
    assert label.subject.startswith("GPU-")


def test_fail_stop_leaves_peers_in_flight_and_erroring(tmp_path: Path) -> None:
    simulate(_cfg(FailStop(rank=6, step=20, how=FailHow.EXIT)), tmp_path)
    con = connect(tmp_path)
    assert con.execute("select max(step) from steps where rank = 6").fetchone() == (19,)
    in_flight = con.execute(
        "select count(distinct rank) from collectives where status = 'in_flight' and exit_wall_ns is null"
    ).fetchone()
    assert in_flight == (LAYOUT.world_size - 1,)
    assert con.execute("select count(*) from collectives where rank = 6 and step >= 20").fetchone() == (0,)
    errs = con.execute("select count(distinct rank) from collectives where status = 'error'").fetchone()
    assert errs == (LAYOUT.world_size - 1,)
    codes = dict(con.execute("select rank, exit_code from events where kind = 'exit'").fetchall())
    assert codes[6] == 1 and all(c == 1 for c in codes.values())


def test_killed_all_and_hang_write_no_exit_events(tmp_path: Path) -> None:
    simulate(_cfg(FailStop(rank=3, step=20, how=FailHow.KILLED_ALL)), tmp_path / "k")
    con = connect(tmp_path / "k")
    assert con.execute("select count(*) from events where kind in ('exit', 'exception', 'signal')").fetchone() == (0,)
    assert con.execute("select count(*) from collectives where status = 'error'").fetchone() == (0,)
    simulate(_cfg(Hang(rank=9, step=20, killed=True)), tmp_path / "h")
    con = connect(tmp_path / "h")
    last = dict(con.execute("select rank, max(wall_ns) from events where kind = 'heartbeat' group by 1").fetchall())
    steps_end = con.execute("select max(end_wall_ns) from steps where rank = 9").fetchone()
    assert steps_end is not None and last[9] > steps_end[0] + 3_000_000_000  # still beating after its last step
    assert con.execute("select count(*) from events where kind = 'exit'").fetchone() == (0,)
    label = read_labels(tmp_path / "h").expected[0]
    assert (label.klass, label.cause) == (IncidentClass.HANG, Cause.STUCK_IN_STEP)


def test_divergence_and_corruption_traces_and_labels(tmp_path: Path) -> None:
    faults = (
        Divergence(ranks=(2,), step=10, field=DivergeField.RNG),
        Corruption(rank=5, step=25, kind=CorruptionKind.NAN, hardware=True),
    )
    simulate(_cfg(*faults), tmp_path)
    con = connect(tmp_path)
    fp = con.execute(
        "select step, count(distinct rng_torch_hash), count(distinct param_hash) from fingerprints "
        "where domain = 'dp.pp0.tp0' group by step order by step"
    ).fetchall()
    assert fp[0][1:] == (1, 1) and fp[1][1:] == (2, 1) and fp[2][1:] == (2, 2)
    assert con.execute("select bool_and(all_finite) from steps where step < 25").fetchone() == (True,)
    first_bad = con.execute("select list(distinct rank) from steps where step = 25 and not all_finite").fetchone()
    assert first_bad == ([5],)
    assert con.execute("select count(*) from steps where step = 26 and all_finite").fetchone() == (0,)
    hw = con.execute("select xid_events, ecc_dbe_volatile from gpu where rank = 5 and step = 25").fetchone()
    assert hw == ([48], 1)
    labels = read_labels(tmp_path)
    got = {(x.klass, x.subject_kind, x.ranks, x.cause, x.onset_step, x.device_fault) for x in labels.expected}
    assert got == {  # the hardware corruption (XID 48, a DBE) names rank 5's device
        (IncidentClass.DIVERGENCE, SubjectKind.RANK, (2,), Cause.RNG_MISMATCH, 10, False),
        (IncidentClass.CORRUPTION, SubjectKind.DEVICE, (5,), Cause.HARDWARE_ERROR, 25, True),
    }


def test_replica_divergence_labels_follow_the_majority_rule(tmp_path: Path) -> None:
    simulate(_cfg(Divergence(replica=1, step=10, field=DivergeField.DATA), steps=20), tmp_path / "r")
    (label,) = read_labels(tmp_path / "r").expected
    assert (label.subject_kind, label.subject, label.ranks) == (SubjectKind.REPLICA, "dp=1", (2, 3, 10, 11))
    two = SimConfig(layout=Layout(dp=2, tp=2, pp=1), hosts=2, steps=20, fingerprint_every=10,
                    faults=(Divergence(replica=1, step=10),))
    simulate(two, tmp_path / "j")
    (label,) = read_labels(tmp_path / "j").expected
    assert (label.subject_kind, label.ranks) == (SubjectKind.JOB, (0, 1, 2, 3))


def test_labels_round_trip(clean: Path) -> None:
    labels = read_labels(clean)
    assert labels.scenario == "clean" and labels.ranks == 16 and labels.expected == ()
    assert [b.kind for b in labels.benign] == ["checkpoint_stall"]
    assert read_labels(clean / "labels.json") == labels
    (clean / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        read_labels(clean / "bad.json")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nosuch:rank=1", "unknown kind 'nosuch'; valid kinds: slow, exit,"),
        ("slow:rank=1", "missing delay="),
        ("slow:rank=x,delay=0.01", "rank='x'"),
        ("slow:rank=1,delay=0.5", "delay=0.5 is 625% of rank 1's compute (0.08 s a step); the simulator models "
                                  "delay=0.004..0.08"),
        ("slow:rank=1,delay=0.01,from=-3", "from must be >= 0"),
        ("slow:rank=99,delay=0.01", "rank 99 outside world size 16"),
        ("kill:rank=1,step=3,signal=0", "signal must be >= 1"),
        ("vanish:rank=1,step=3,killed=maybe", "killed='maybe'"),
        ("bitflip:rank=1,step=3,target=weights", "target='weights' is not a valid value"),
        ("hang:rank=1,step=3,colour=red", "bad item 'colour=red'; valid keys for hang: rank, step, alive,"),
        ("bad_device:host=0,index=4", "device slot 4 does not exist (a host has slots 0..3)"),
        ("slow_link:hosts=0-1,until=9", "slow_link until= is train-only"),
        ("corruption:rank=1,step=3,kind=bitflip_param", "spelled bitflip:rank=,step=,target=param"),
        ("straggler:rank=1,slow=0.3", "unknown kind 'straggler'"),  # the simulator's old spelling: one syntax now
    ],
)
def test_spec_errors_are_one_line_and_name_the_spec(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_sim_fault(spec, _cfg())
    msg = str(info.value)
    assert "\n" not in msg and spec in msg and fragment in msg


def test_specs_parse() -> None:
    cfg = _cfg()
    assert parse_sim_fault("gpu_slow:rank=5,from=100,factor=1.1,until=150", cfg) == Straggler(
        rank=5, from_step=100, slow=0.1, until_step=150)
    assert parse_sim_fault("throttle:rank=5,from=10,delay=0.02,reason=power", cfg) == Straggler(
        rank=5, from_step=10, slow=0.25, cause=StragglerCause.POWER)
    assert parse_sim_fault("dataloader:rank=2,delay=0.04,period=10,burst=2", cfg) == Straggler(
        rank=2, slow=0.5, period=10, burst=2, cause=StragglerCause.DATALOADER)
    assert parse_sim_fault("divergence:ranks=3+7,step=50,field=data") == Divergence(
        ranks=(3, 7), step=50, field=DivergeField.DATA)
    assert parse_sim_fault("hang:rank=2,step=9,killed=1") == Hang(rank=2, step=9, killed=True)
    assert parse_sim_fault("exit:rank=2,step=9,in_collective=1") == FailStop(rank=2, step=9, in_collective=True)
    assert parse_sim_fault("kill:rank=2,step=9,signal=15") == FailStop(rank=2, step=9, how=FailHow.SIGNAL, signal=15)
    assert parse_sim_fault("vanish:rank=2,step=9,killed=1") == FailStop(rank=2, step=9, how=FailHow.KILLED_ALL)
    assert parse_sim_fault("bitflip:rank=2,step=9,target=param,hardware=1") == Corruption(
        rank=2, step=9, kind=CorruptionKind.BITFLIP_PARAM, hardware=True)
    assert parse_sim_fault("skew_data:rank=2,step=9") == Divergence(ranks=(2,), step=9, field=DivergeField.DATA,
                                                                   offset=1)


def test_config_validation_is_one_line() -> None:
    with pytest.raises(ValueError, match="rank 99 outside world size 16"):
        _cfg(Straggler(rank=99, slow=0.1))


def test_standard_suite_covers_every_class_and_cause() -> None:
    from rankwatch.simulator.labels import labels_for

    suite = standard_suite()
    assert len(suite) >= 50 and len({s.name for s in suite}) == len(suite)
    sizes = {s.config.world_size for s in suite}
    assert min(sizes) == 64 and max(sizes) == 2048
    labels = [labels_for(s.config, (1,)) for s in suite]
    classes = {x.klass for lab in labels for x in lab.expected}
    # failed checkpoint saves are the job's own machinery failing, tested on a real full disk (test_full_disk.py)
    assert classes == set(IncidentClass) - {IncidentClass.UNCLASSIFIED, IncidentClass.CHECKPOINT}
    causes = {x.cause for lab in labels for x in lab.expected}
    assert {Cause.UNKNOWN, Cause.THERMAL_THROTTLE, Cause.POWER_THROTTLE, Cause.DATALOADER, Cause.SLOW_LINK,
            Cause.STAGE_IMBALANCE, Cause.DATA_SKEW, Cause.EXIT, Cause.SIGNAL, Cause.VANISHED, Cause.STUCK_IN_STEP,
            Cause.RNG_MISMATCH, Cause.DATA_POSITION_MISMATCH, Cause.STEP_MISMATCH, Cause.VALUE_MISMATCH,
            Cause.NON_FINITE, Cause.GRAD_NORM_OUTLIER, Cause.HARDWARE_ERROR} <= causes
    kinds = {x.subject_kind for lab in labels for x in lab.expected}
    assert {SubjectKind.RANK, SubjectKind.HOST, SubjectKind.LINK, SubjectKind.STAGE, SubjectKind.REPLICA,
            SubjectKind.DOMAIN, SubjectKind.JOB} <= kinds
    controls = [lab for lab in labels if not lab.expected]
    assert len(controls) >= 10 and all(lab.benign for lab in controls)


def test_gpu_timing_fills_the_device_columns_and_keeps_the_step_identity(tmp_path: Path) -> None:
    from rankwatch.simulator.config import Timing

    simulate(_cfg(Straggler(rank=5, from_step=10, slow=0.2), checkpoint_every=20, timing=Timing.GPU), tmp_path)
    con = connect(tmp_path)
    bad = con.execute(
        "select count(*) from steps where duration_ns != compute_ns + collective_wait_ns + dataloader_wait_ns "
        "+ checkpoint_ns or device_ns is null or device_compute_ns + device_collective_ns != device_ns "
        "or device_collective_ns < 0 or compute_ns <= 0"
    ).fetchone()
    assert bad == (0,)
    assert con.execute("select count(*) from steps where checkpoint_ns > 0").fetchone() == (2 * LAYOUT.world_size,)
    assert con.execute("select count(*) - count(device_duration_ns) from phases").fetchone() == (0,)
    assert con.execute("select count(*) - count(device_duration_ns), count(*) - count(device_start_ns) from "
                       "collectives where status = 'ok'").fetchone() == (0, 0)
    (label,) = read_labels(tmp_path).expected
    assert (label.subject, label.cause) == ("5", Cause.DEVICE_SLOW)


def test_host_stall_spec_parses_and_labels_by_timing() -> None:
    """Train's `slow` is a sleep of the rank's host thread in forward: the simulator's host stall."""
    from rankwatch.simulator.config import Timing
    from rankwatch.simulator.labels import labels_for

    f = parse_sim_fault("slow:rank=3,from=5,delay=0.016", _cfg())
    assert f == Straggler(rank=3, from_step=5, slow=0.2, cause=StragglerCause.HOST_STALL)
    assert labels_for(_cfg(f)).expected[0].cause == Cause.UNKNOWN
    assert labels_for(_cfg(f, timing=Timing.GPU)).expected[0].cause == Cause.HOST_STALL


# -- one fault syntax: train's spelling, in train's units ---------------------------------------------------------


def test_a_delay_in_seconds_is_that_many_seconds_of_the_ranks_compute_on_every_stage() -> None:
    """`delay=` converts to the share of the rank's own nominal compute, which is longer on the last stage (it also
    computes the loss): the same seconds on either stage, by the model's own nominal compute."""
    from rankwatch.simulator.model import _NS, _Topo, _nominal

    cfg = _cfg()
    nominal = _nominal(cfg, _Topo(cfg)) / _NS
    assert nominal[13] > nominal[5]  # rank 13 is on the last of two stages
    for rank in (5, 13):
        for spec in (f"slow:rank={rank},delay=0.03", f"throttle:rank={rank},delay=0.03",
                     f"dataloader:rank={rank},delay=0.03"):
            f = parse_sim_fault(spec, cfg)
            assert isinstance(f, Straggler)
            assert f.slow * nominal[rank] == pytest.approx(0.03, rel=1e-9), spec


def test_a_train_spelled_slow_rank_computes_the_spec_s_delay_longer(tmp_path: Path) -> None:
    """Measured from the written telemetry: from the onset, the slow rank's median compute exceeds its stage peers'
    by the spec's delay (less the excess it had before, its hardware's own spread), within the simulator's noise."""
    specs = ("slow:rank=5,from=40,delay=0.03", "slow:rank=13,from=40,delay=0.02")
    base = _cfg(steps=120)
    simulate(replace(base, faults=tuple(parse_sim_fault(s, base) for s in specs)), tmp_path)
    compute: dict[tuple[int, int], float] = {
        (r, s): c / 1e9 for r, s, c in connect(tmp_path).execute("select rank, step, compute_ns from steps").fetchall()}

    def excess(rank: int, steps: range) -> float:
        peers = [p for p in range(16) if p // 8 == rank // 8 and p not in (5, 13)]
        return (statistics.median(compute[rank, s] for s in steps)
                - statistics.median(compute[p, s] for p in peers for s in steps))

    for rank, delay in ((5, 0.03), (13, 0.02)):
        measured = excess(rank, range(40, 120)) - excess(rank, range(0, 40))
        assert measured == pytest.approx(delay, rel=0.04), (rank, measured)
    (five, thirteen) = read_labels(tmp_path).expected
    assert (five.subject, five.onset_step, thirteen.subject) == ("5", 40, "13")


@pytest.mark.parametrize(
    "spec",
    ["nudge:param=1", "freeze:rank=1,step=3,seconds=2", "failing_device:host=0,index=1,step=3",
     "device_error:rank=0,step=3"],
)
def test_a_train_only_kind_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_sim_fault(spec, _cfg())
    msg = str(info.value)
    assert "\n" not in msg and spec in msg and "train-only fault" in msg


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("bitflip:rank=1,step=3", "target=grad (bitflip's default) is train-only"),
        ("exit:rank=1,step=3,code=7", "code=7: the simulator's exit code is 1 (other codes are train-only)"),
        ("throttle:rank=1,reason=power_brake", "the simulator models reason=thermal|power (the others are train-only)"),
        ("gpu_slow:rank=1,factor=5", "the simulator models factor=1.05..2 (more is train-only)"),
        ("slow_link:hosts=0-1,delay=0.1", "slow_link delay= is train-only"),
    ],
)
def test_what_only_train_can_do_with_a_shared_kind_is_a_one_line_error(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_sim_fault(spec, _cfg())
    msg = str(info.value)
    assert "\n" not in msg and spec in msg and fragment in msg


@pytest.mark.parametrize(("typo", "meant"), [("slwo", "slow"), ("stage_imbalanse", "stage_imbalance"),
                                             ("bad_devise", "bad_device"), ("vanished", "vanish")])
def test_a_mistyped_kind_gets_the_nearest_one(typo: str, meant: str) -> None:
    with pytest.raises(ValueError, match=f"unknown kind '{typo}' \\(did you mean '{meant}'\\?\\); valid kinds:"):
        parse_sim_fault(f"{typo}:rank=1")


def test_the_old_spellings_are_gone_and_never_offered() -> None:
    from rankwatch.simulator.faults import SIM_FAULT_HELP

    for old in ("straggler:rank=5,from=100,slow=0.1", "fail_stop:rank=3,step=150"):
        with pytest.raises(ValueError, match="unknown kind"):
            parse_sim_fault(old)
    with pytest.raises(ValueError) as info:
        parse_sim_fault("stragler:rank=1")
    for old in ("straggler", "fail_stop", "slow="):
        assert old not in str(info.value) and old not in SIM_FAULT_HELP


def test_seconds_and_device_slots_need_the_run() -> None:
    for spec in ("slow:rank=1,delay=0.01", "bad_device:host=0,index=1"):
        with pytest.raises(ValueError, match="needs the run the fault goes into: parse_sim_fault\\(spec, cfg\\)"):
            parse_sim_fault(spec)
    assert parse_sim_fault("bad_device:host=1,index=2,delay=0.04", _cfg()) == Straggler(
        rank=6, slow=0.5, cause=StragglerCause.THERMAL)  # 4 ranks a host: slot 2 of host 1 is rank 6
