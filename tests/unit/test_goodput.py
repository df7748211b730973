"""Goodput and the measured checkpoint and recovery costs on hand-built run directories, written with the real
writers (`base.rundir` for run.json and the recovery record, `recovery.lineage` for the lineage, the collector's
`ParquetSink` for the telemetry), with every part's answer worked out by hand; and the damaged cases."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rankwatch.analytics.errors import NoDataError, RunDirError
from rankwatch.analytics.costs import advise, measured_costs
from rankwatch.analytics.goodput import Part, SaveMode, goodput
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.interval import expected_figures, IntervalCosts, young_daly_interval
from rankwatch.base.rundir import append_launch, write_recovery_record
from rankwatch.base.schema import ChangeReason, CheckpointPhase, EventKind, LineageKind, Table
from rankwatch.collector.sink import ParquetSink, SinkConfig
from rankwatch.recovery.lineage import Details, Lineage, NewEntry, Verdict, lineage_path
from schema_support import schema_row

pytestmark = [pytest.mark.timeout(60)]

BASE = 1_700_000_000_000_000_000
MS = 1_000_000
RANKS = (0, 1, 2)
COMPUTE = {0: 100, 1: 100, 2: 200}
"""Rank 2 computes twice as long as its peers (ms) in every step: the straggler."""


class _Run:
    """One run's telemetry, rank by rank, in milliseconds from BASE (mono = wall here: one host, one clock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.rows: dict[int, list[tuple[Table, tuple[Any, ...]]]] = {r: [] for r in RANKS}
        self.seq: dict[int, int] = dict.fromkeys(RANKS, 0)

    def step(self, attempt: int, step: int, start: int, *, save: str | None = None, collectives: bool = True) -> int:
        """Every rank computes COMPUTE[rank], all-reduces until start + 220 (the last arrival + 20 of transfer), and
        with `save` saves synchronously for 50 ms inside the step; returns the step's end."""
        end = start + 220 + (50 if save else 0)
        for r in RANKS:
            enter, leave = start + COMPUTE[r], start + 220
            if collectives:
                self.rows[r].append((Table.COLLECTIVES, schema_row(
                    Table.COLLECTIVES, rank=r, step=step, seq=0, group_seq=self.seq[r], op="all_reduce", group="dp",
                    group_ranks=list(RANKS), bytes=4096, dtype="float32", async_op=False,
                    enter_wall_ns=BASE + enter * MS, enter_mono_ns=enter * MS, exit_wall_ns=BASE + leave * MS,
                    exit_mono_ns=leave * MS, duration_ns=(leave - enter) * MS, status="ok")))
                self.seq[r] += 1
            if save:
                last = "publish" if r == 0 else "write"
                spans = [("snapshot", 220, 240), ("write", 240, 265 if r == 0 else 270)]
                spans += [(last, 265, 270)] if r == 0 else []
                for phase, a, b in spans:
                    self.phase(r, step, save, phase, start + a, start + b)
            self.rows[r].append((Table.STEPS, schema_row(
                Table.STEPS, rank=r, step=step, attempt=attempt, start_wall_ns=BASE + start * MS,
                end_wall_ns=BASE + end * MS, start_mono_ns=start * MS, end_mono_ns=end * MS,
                duration_ns=(end - start) * MS, compute_ns=COMPUTE[r] * MS, collective_wait_ns=(220 - COMPUTE[r]) * MS,
                dataloader_wait_ns=0, checkpoint_ns=(50 if save else 0) * MS, num_collectives=1, all_finite=True)))
        return end

    def phase(self, rank: int, step: int, ckpt: str, phase: str, a: int, b: int, ok: bool = True) -> None:
        self.rows[rank].append((Table.CHECKPOINT_PHASES, schema_row(
            Table.CHECKPOINT_PHASES, rank=rank, step=step, checkpoint_id=ckpt, phase=phase,
            start_wall_ns=BASE + a * MS, start_mono_ns=a * MS, end_wall_ns=BASE + b * MS, end_mono_ns=b * MS,
            duration_ns=(b - a) * MS, ok=ok)))

    def event(self, rank: int, attempt: int, kind: EventKind, at: int, *, exit_code: int | None = None) -> None:
        self.rows[rank].append((Table.EVENTS, schema_row(
            Table.EVENTS, rank=rank, attempt=attempt, wall_ns=BASE + at * MS, mono_ns=at * MS, kind=str(kind),
            exit_code=exit_code)))

    def write(self) -> None:
        for r, rows in self.rows.items():
            sink = ParquetSink(self.root, r, SinkConfig(flush_interval_s=60.0))
            for table, row in rows:
                sink.append(table, row)
            sink.close()


def _incident(*, attempt: int, detection_ms: int | None, klass: IncidentClass = IncidentClass.HANG) -> Incident:
    cause = Cause.VANISHED if klass is IncidentClass.FAIL_STOP else Cause.STUCK_IN_COLLECTIVE
    return Incident(klass=klass, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,), onset_step=7,
                    detection_step=7, confidence=0.95, cause=cause, summary="rank 2 stopped",
                    detection_wall_ns=None if detection_ms is None else BASE + detection_ms * MS, attempt=attempt)


def _record(root: Path, *, wall_ms: int, incidents: Sequence[Incident], checkpoint: str | None,
            extra: dict[str, Any] | None = None) -> None:
    write_recovery_record(root, "recovery-0001", {**(extra or {}),
        "id": "recovery-0001", "wall_ns": BASE + wall_ms * MS, "incidents": [i.id for i in incidents],
        "action": "restart_job", "checkpoint": checkpoint,
        "decisions": [{"incident": i.id, "class": str(i.klass), "subject": str(i.subject), "incident_doc": i.to_dict(),
                       "action": "restart_job", "target": None, "path": [], "reasons": [],
                       "lineage": {"comparability": "bitwise_identical_expected", "changed": []}} for i in incidents],
        "relaunch": {"exit_codes": [0, 0, 0], "duration_s": 1.0}, "outcome": "recovered"})


def _failed_and_resumed(root: Path, *, record_ms: int = 7000, detection_ms: int | None = 2820,
                        klass: IncidentClass = IncidentClass.HANG, recorded: dict[str, Any] | None = None) -> _Run:
    """Attempt 0 launched at 0, its processes up at 800, steps 0..6 from 1000 (a save in step 4: 1880..2150), its
    last step ending at 2590; rank 2 fails at 2620 (its exception), its peers exit at 2650 and 2660, a heartbeat at
    2690; the incident (a hang of rank 2 unless `klass`) detected at `detection_ms`. The relaunch at 3590; attempt 1's processes up at 4200, 4400, 4590; verify 5090..5190, load 5190..5490;
    the gate's recovery event at 5590; steps 5..9 from 5640 to 6740."""
    run = _Run(root)
    append_launch(root, {"started_wall_ns": BASE, "world_size": 3, "steps": 10})
    for r in RANKS:
        run.event(r, 0, EventKind.START, 800)
    t = 1000
    for s in range(7):
        t = run.step(0, s, t, save="step-00000004" if s == 4 else None)
    assert t == 2590
    run.event(2, 0, EventKind.EXCEPTION, 2620)
    run.event(0, 0, EventKind.EXIT, 2650, exit_code=1)
    run.event(1, 0, EventKind.EXIT, 2660, exit_code=1)
    run.event(0, 0, EventKind.HEARTBEAT, 2690)
    append_launch(root, {"started_wall_ns": BASE + 3590 * MS, "world_size": 3, "steps": 10, "resume": True})
    for r, at in zip(RANKS, (4200, 4400, 4590)):
        run.event(r, 1, EventKind.START, at)
        run.phase(r, 4, "step-00000004", str(CheckpointPhase.VERIFY), 5090, 5190)
        run.phase(r, 4, "step-00000004", str(CheckpointPhase.LOAD), 5190, 5490)
    run.event(0, 1, EventKind.RECOVERY, 5090)
    run.event(0, 1, EventKind.RECOVERY, 5590)
    t = 5640
    for s in range(5, 10):
        t = run.step(1, s, t)
    assert t == 6740
    run.write()
    book = Lineage(lineage_path(root))
    same = Verdict.identical()
    book.append(NewEntry(kind=LineageKind.ROLLBACK, verdict=same, time_ns=BASE + 5600 * MS, details=Details(
        from_step=6, to_step=5, checkpoint_id="step-00000004", attempt=1)))
    book.append(NewEntry(kind=LineageKind.REPLAYED_DATA_RANGE, verdict=same, time_ns=BASE + 5601 * MS,
                         details=Details(from_step=5, to_step=7, attempt=1)))
    _record(root, wall_ms=record_ms, incidents=[_incident(attempt=0, detection_ms=detection_ms, klass=klass)],
            checkpoint="step-00000004", extra=recorded)
    return run


def _seconds(g: Any, part: Part) -> float | None:
    return g.part(part).seconds


def test_every_part_of_a_failed_and_resumed_run(tmp_path: Path) -> None:
    """Span 6.740 s. Start-up 1.000. Attempt 0's slices: 220 each, step 4's 270; attempt 1 resumed at step 5, so
    attempt 0's steps 5 and 6 (440) are thrown away, with the 30 of step 7 before rank 2 failed: lost 0.470. Counted:
    attempt 0's 0..4 (1.150), attempt 1's 5..9 (1.100); the save in step 4 blocked 0.050. The what-if: attempt 0
    over steps 1..6 replays in 6 x 220 + 50 and ideally (the median rank's 100 of compute) in 6 x 120 + 50, so 600 of
    1370 is slowness, of 1.150 counted; attempt 1 over 6..9: 100 of 220, of 1.100. Detection 2620 -> 2820; the
    record was written after the relaunch (no decision time), so 2820 -> 3590 is other; relaunch 3590 -> 4590,
    restore -> 5490, gate -> 5640."""
    root = tmp_path / "run"
    _failed_and_resumed(root)
    g = goodput(root)
    straggler = 0.600 / 1.370 * 1.150 + 0.100 / 0.220 * 1.100
    expected = {
        Part.STARTUP: 1.000, Part.LOST_WORK: 0.470, Part.CHECKPOINT: 0.050, Part.STRAGGLER: straggler,
        Part.DETECTION: 0.200, Part.RELAUNCH: 1.000, Part.RESTORE: 0.900, Part.GATE: 0.150, Part.OTHER: 0.770,
        Part.EFFECTIVE: 1.150 + 1.100 - 0.050 - straggler,
    }
    assert g.total_s == pytest.approx(6.740)
    for part, seconds in expected.items():
        assert _seconds(g, part) == pytest.approx(seconds, abs=2e-3), part
    assert _seconds(g, Part.DECISION) is None
    assert "writes it when the relaunch ends" in g.part(Part.DECISION).why
    assert g.part(Part.OTHER).why.endswith("from the detection to the relaunch: decision + relaunch")
    assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)
    assert g.ratio == pytest.approx(expected[Part.EFFECTIVE] / 6.740, abs=1e-3)
    assert (g.counted_steps, g.lost_steps, g.attempts, g.ranks) == (10, 2, 2, 3)
    [i] = g.interruptions
    assert (i.failed_attempt, i.resumed_attempt, i.resumed_step, i.recovery, i.lost_steps) == (0, 1, 5,
                                                                                               "recovery-0001", 2)
    assert i.restore_s == pytest.approx(3.020)
    assert i.stopped_ns == BASE + 2690 * MS
    [save] = g.saves
    assert (save.checkpoint_id, save.mode, save.committed) == ("step-00000004", SaveMode.SYNC, True)
    assert save.blocking_s == pytest.approx(0.050) and save.background_s == 0.0
    assert g.warnings == ()
    assert json.loads(json.dumps(g.to_dict()))["parts"][0]["part"] == "effective"


def test_a_decision_recorded_before_the_relaunch_is_measured(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _failed_and_resumed(root, record_ms=3000)
    g = goodput(root)
    assert _seconds(g, Part.DETECTION) == pytest.approx(0.200)
    assert _seconds(g, Part.DECISION) == pytest.approx(0.180)  # 2820 -> 3000
    assert _seconds(g, Part.RELAUNCH) == pytest.approx(1.590)  # 3000 -> 4590
    assert _seconds(g, Part.OTHER) == pytest.approx(0.0, abs=1e-9)


def test_a_fail_stop_records_the_failure_not_its_detection(tmp_path: Path) -> None:
    """A fail-stop's detection_wall_ns is its culprit's last sign of life (2640, after its exception at 2620): the
    failure, not a detection. Lost work gains the 50 from the last step end; the failure to the relaunch (0.950) is
    other, detection and decision both unknown. A hang detected before the failure mark is no detection either."""
    root = tmp_path / "run"
    _failed_and_resumed(root, detection_ms=2640, klass=IncidentClass.FAIL_STOP)
    g = goodput(root)
    assert _seconds(g, Part.DETECTION) is None and "last sign of life" in g.part(Part.DETECTION).why
    assert _seconds(g, Part.DECISION) is None
    assert _seconds(g, Part.LOST_WORK) == pytest.approx(0.490)
    assert _seconds(g, Part.OTHER) == pytest.approx(0.950)
    assert g.interruptions[0].failure_ns == BASE + 2640 * MS
    assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)
    early = tmp_path / "early"
    _failed_and_resumed(early, detection_ms=2590)
    g = goodput(early)
    assert _seconds(g, Part.DETECTION) is None and "before the failure mark" in g.part(Part.DETECTION).why
    assert _seconds(g, Part.OTHER) == pytest.approx(0.970)
    assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)


def test_the_managers_detection_and_decision_are_measured_where_its_record_has_them(tmp_path: Path) -> None:
    """The record's detected_wall_ns (2700: the launcher saw the exit) and decided_wall_ns (3300) stand before the
    incident's detection and the record's wall_ns (written after the relaunch): detection 2620 -> 2700, decision ->
    3300, relaunch -> 4590, nothing left in other. A fail-stop's too: its detection_wall_ns is a failure mark, the
    record's is the detection. A recorded detection before the failure mark is none: unknown, with the reason."""
    marks = {"detected_wall_ns": BASE + 2700 * MS, "detected_by": "the launcher saw rank 2 of attempt 0 end (exit "
             "code 1)", "decided_wall_ns": BASE + 3300 * MS}
    for klass, failure_ms in ((IncidentClass.HANG, 2620), (IncidentClass.FAIL_STOP, 2640)):
        root = tmp_path / str(klass)
        _failed_and_resumed(root, detection_ms=2640 if klass is IncidentClass.FAIL_STOP else 2820, klass=klass,
                            recorded=marks)
        g = goodput(root)
        assert _seconds(g, Part.DETECTION) == pytest.approx((2700 - failure_ms) / 1e3), klass
        assert _seconds(g, Part.DECISION) == pytest.approx(0.600)
        assert _seconds(g, Part.RELAUNCH) == pytest.approx(1.290)
        assert _seconds(g, Part.OTHER) == pytest.approx(0.0, abs=1e-9)
        assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)
        [i] = g.interruptions
        assert i.detected_ns == BASE + 2700 * MS and i.decided_ns == BASE + 3300 * MS
        assert i.detected_by == marks["detected_by"] and "detected 0.0" in g.describe()[-1]
    early = tmp_path / "early"
    _failed_and_resumed(early, recorded={**marks, "detected_wall_ns": BASE + 2600 * MS})
    g = goodput(early)
    assert _seconds(g, Part.DETECTION) is None and "before the failure mark" in g.part(Part.DETECTION).why
    assert _seconds(g, Part.DECISION) is None  # from an unknown detection: the failure -> the decision is other
    assert _seconds(g, Part.OTHER) == pytest.approx(0.680)
    assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)


def test_a_restart_from_step_0_throws_away_every_earlier_step(tmp_path: Path) -> None:
    """No checkpoint: attempt 1 trains from step 0 again (no load, no gate): all of attempt 0 (1000 -> 1660) is
    lost; the set-up from every process up (2200) to the first step (2400) is restore; no collectives recorded, so
    the what-if cannot replay and the straggler slowdown is unknown, with a warning."""
    root = tmp_path / "run"
    run = _Run(root)
    append_launch(root, {"started_wall_ns": BASE, "world_size": 3, "steps": 3})
    t = 1000
    for s in range(3):
        t = run.step(0, s, t, collectives=False)
    append_launch(root, {"started_wall_ns": BASE + 2000 * MS, "world_size": 3, "steps": 3})
    for r in RANKS:
        run.event(r, 1, EventKind.START, 2200)
    t = 2400
    for s in range(3):
        t = run.step(1, s, t, collectives=False)
    run.write()
    Lineage(lineage_path(root)).append(NewEntry(kind=LineageKind.RESTART, verdict=Verdict.changed(
        ChangeReason.ORDERING), time_ns=BASE + 1990 * MS, details=Details(from_step=2, to_step=0)))
    g = goodput(root)
    assert _seconds(g, Part.LOST_WORK) == pytest.approx(0.660)
    assert _seconds(g, Part.RESTORE) == pytest.approx(0.200)
    assert _seconds(g, Part.RELAUNCH) == pytest.approx(0.200)
    assert _seconds(g, Part.STRAGGLER) is None and "replay" in g.part(Part.STRAGGLER).why
    assert any("cannot replay" in w for w in g.warnings)
    assert _seconds(g, Part.DETECTION) is None and "no recovery record" in g.part(Part.DETECTION).why
    assert _seconds(g, Part.EFFECTIVE) == pytest.approx(0.660)
    assert sum(p.seconds for p in g.parts if p.seconds is not None) == pytest.approx(g.total_s, abs=1e-9)


def test_a_run_never_interrupted_has_zero_recovery_time(tmp_path: Path) -> None:
    root = tmp_path / "run"
    run = _Run(root)
    append_launch(root, {"started_wall_ns": BASE, "world_size": 3, "steps": 5})
    t = 500
    for s in range(5):
        t = run.step(0, s, t)
    run.write()
    g = goodput(root)
    assert g.interruptions == () and _seconds(g, Part.LOST_WORK) == 0.0
    assert _seconds(g, Part.DETECTION) == 0.0 and g.part(Part.DETECTION).why == "no interruption was recovered"
    assert _seconds(g, Part.STARTUP) == pytest.approx(0.5)
    costs = measured_costs([root])
    assert costs.restore.seconds is None and "no failure" in costs.restore.why
    assert costs.sync_save.seconds is None and "no checkpoint" in costs.sync_save.why
    assert costs.interruptions == 0 and costs.job_mtbf_s is None
    advice = advise(costs)
    assert advice.rows == () and advice.device_mtbf_s is None and "no interruption" in advice.rate


def _async_run(root: Path) -> None:
    """One attempt, steps of 220 from 1000 (no collectives), synchronous saves in steps 1 and 5 (50 ms), and
    asynchronous ones at the end of steps 9 and 13: a 10 ms snapshot inside the step, then a 300 ms write beside
    the next steps."""
    run = _Run(root)
    append_launch(root, {"started_wall_ns": BASE, "world_size": 3, "steps": 16})
    t = 1000
    for s in range(16):
        start = t
        t = run.step(0, s, t, save=f"step-{s:08d}" if s in (1, 5) else None, collectives=False)
        if s in (9, 13):
            for r in RANKS:
                run.phase(r, s, f"step-{s:08d}", "snapshot", start + 200, start + 210)
                run.phase(r, s, f"step-{s:08d}", "write", start + 215, start + 515)
                if r == 0:
                    run.phase(r, s, f"step-{s:08d}", "publish", start + 515, start + 520)
    run.write()


def test_measured_costs_tell_synchronous_from_asynchronous_saves(tmp_path: Path) -> None:
    """Sync saves: 50 ms blocking. Async saves: the 10 ms snapshot blocks, the write (300 ms, 305 on rank 0 with its
    publish) runs while the next steps train. The saves begin at 1440, 2370, 3280 and 4160 ms (220 into steps 1 and
    5, 200 into steps 9 and 13): the synchronous ones 930 apart, the asynchronous ones 880 (the gap between a
    synchronous and an asynchronous save is neither's interval)."""
    root = tmp_path / "run"
    _async_run(root)
    costs = measured_costs([root])
    assert costs.sync_save.seconds == pytest.approx(0.050) and costs.sync_save.count == 2
    assert costs.async_pause.seconds == pytest.approx(0.010) and costs.async_pause.count == 2
    assert costs.async_write.seconds == pytest.approx(0.305)
    assert costs.sync_interval.seconds == pytest.approx(0.930) and costs.async_interval.seconds == pytest.approx(0.880)
    assert costs.interruptions == 0 and costs.ranks == 3
    g = goodput(root)
    assert [s.mode for s in g.saves] == [SaveMode.SYNC, SaveMode.SYNC, SaveMode.ASYNC, SaveMode.ASYNC]
    assert _seconds(g, Part.CHECKPOINT) == pytest.approx(0.050 * 2 + 0.010 * 2)


def test_advice_scales_a_given_device_mtbf_to_each_rank_count(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _failed_and_resumed(root)
    costs = measured_costs([root])
    assert costs.interruptions == 1 and costs.restore.seconds == pytest.approx(3.020)
    assert costs.sync_save.seconds == pytest.approx(0.050)
    assert costs.sync_interval.seconds is None and "no two committed synchronous saves" in costs.sync_interval.why
    assert costs.device_mtbf_s == pytest.approx(6.740 * 3)
    advice = advise(costs, device_mtbf_hours=10_000)
    assert [(r.ranks, r.mode) for r in advice.rows] == [(3, SaveMode.SYNC), (2048, SaveMode.SYNC),
                                                        (16_384, SaveMode.SYNC)]
    row = advice.rows[2]
    mtbf = 10_000 * 3600 / 16_384
    assert row.job_mtbf_s == pytest.approx(mtbf)
    assert row.young_daly_s == pytest.approx(young_daly_interval(0.050, mtbf), rel=1e-3)
    want = expected_figures(IntervalCosts(save_s=0.050, restore_s=3.020, mtbf_s=mtbf), row.advised_s)
    assert row.advised is not None and row.advised.goodput == pytest.approx(want.goodput, rel=1e-3)
    assert row.current is None and row.current_s is None  # one save: no current interval
    observed = advise(costs)
    assert "observed: 1 interruption" in observed.rate and any("weak estimate" in c for c in observed.caveats)
    assert "2048" in "\n".join(observed.describe())


def test_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"not a run directory \(does not exist\)$"):
        goodput(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="not a run directory"):
        measured_costs([tmp_path / "empty"])


def test_damaged_records_name_the_file(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _failed_and_resumed(root)
    record = root / "recovery" / "recovery-0001.json"
    good = record.read_text()
    record.write_text("{not json")
    with pytest.raises(RunDirError, match=rf"^{record}: unreadable recovery record") as exc:
        goodput(root)
    assert "\n" not in str(exc.value)
    doc = json.loads(good)
    doc["decisions"][0]["incident_doc"]["confidence"] = 3.0
    record.write_text(json.dumps(doc))
    with pytest.raises(RunDirError, match=rf"^{record}: incident record .*confidence 3.0 outside \[0, 1\]$"):
        goodput(root)
    record.write_text(good)
    (root / "run.json").write_text(json.dumps({"launches": [{"attempt": 0, "started_wall_ns": "soon"}]}))
    with pytest.raises(RunDirError, match=rf"^{root / 'run.json'}: launch 0: 'started_wall_ns'"):
        goodput(root)
    (root / "run.json").write_text(json.dumps({"launches": [{"attempt": 0}]}))
    with pytest.raises(RunDirError, match="launch 0 has no started_wall_ns"):
        goodput(root)
    (root / "run.json").unlink()
    with pytest.raises(RunDirError, match=rf"^{root / 'run.json'}: no run file"):
        goodput(root)


def test_a_damaged_lineage_names_the_file(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _failed_and_resumed(root)
    with open(lineage_path(root), "a") as f:
        f.write("{half a line\n")
    with pytest.raises(RunDirError, match=rf"^{lineage_path(root)}: line 3 is not a lineage entry"):
        goodput(root)


def test_a_run_with_no_step_is_no_data(tmp_path: Path) -> None:
    root = tmp_path / "run"
    append_launch(root, {"started_wall_ns": BASE, "world_size": 3})
    run = _Run(root)
    run.event(0, 0, EventKind.START, 10)
    run.write()
    with pytest.raises(NoDataError, match=rf"^{root}: no completed step"):
        goodput(root)
