"""The recovery manager's plan (joining decisions, escalating what the job cannot do, never narrowing) and its
apply step against a fake launcher: evidence, quarantine list and lineage, retirement, records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.localize import FollowsKind
from rankwatch.base.rundir import CHECKPOINT_DIR, QUARANTINE_FILE, RECOVERY_DIR, RUN_FILE
from rankwatch.base.schema import LineageKind
from rankwatch.base.topology import Layout
from rankwatch.canary.config import CanaryConfig, canary_declaration, config_from_run
from rankwatch.control.manager import apply, plan_recovery, quarantined, replay_basis
from rankwatch.recovery.decision import (
    Action, CheckpointCatalogView, CheckpointRef, GateResult, GateVerdict, Idempotency, MembershipSupport,
)
from rankwatch.recovery.job import JobDeclaration, LaunchResult
from rankwatch.recovery.lineage import lineage_path, read, verify
from rankwatch.recovery.policy import RecurrenceView

pytestmark = pytest.mark.timeout(60)

CANARY = canary_declaration(Layout(dp=2, tp=2))
CATALOG = CheckpointCatalogView(committed=(CheckpointRef(id="step-00000004", step=4),
                                           CheckpointRef(id="step-00000009", step=9)), partial=1)


def _inc(klass: IncidentClass, *, ranks: tuple[int, ...] = (1,), onset: int | None = 10,
         subject: Subject | None = None, cause: Cause = Cause.UNKNOWN) -> Incident:
    return Incident(klass=klass, subject=subject or Subject(kind=SubjectKind.RANK, id=str(ranks[0])), ranks=ranks,
                    onset_step=onset, detection_step=onset, confidence=0.9, cause=cause, summary="test")


def test_canary_declares_what_it_is() -> None:
    assert canary_declaration(Layout(dp=4)).membership is MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH
    assert CANARY.membership is MembershipSupport.FIXED_SHAPES
    assert CANARY.idempotent is Idempotency.NOT_IDEMPOTENT
    assert Action.RETRY_OPERATION not in CANARY.executable


def test_a_straggler_alone_is_observed_and_nothing_relaunches() -> None:
    plan = plan_recovery([_inc(IncidentClass.STRAGGLER)], job=CANARY, catalog=CATALOG)
    assert plan.action is Action.OBSERVE and not plan.relaunch and plan.checkpoint is None
    assert plan.lines()[-1] == "=> observe: nothing to recover"


def test_fail_stop_restarts_from_the_newest_committed_checkpoint() -> None:
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=CANARY, catalog=CATALOG)
    assert plan.relaunch and plan.checkpoint == CheckpointRef(id="step-00000009", step=9)
    assert not plan.escalations


def test_joined_decisions_take_the_oldest_checkpoint_any_of_them_needs() -> None:
    # the fail-stop alone would restart from step 9; a divergence with onset 7 needs a checkpoint before step 7
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP), _inc(IncidentClass.DIVERGENCE, onset=7, ranks=(0, 1),
                                                              subject=Subject(kind=SubjectKind.DOMAIN, id="dp0"))],
                         job=CANARY, catalog=CATALOG)
    assert plan.relaunch and plan.checkpoint is not None and plan.checkpoint.id == "step-00000004"
    assert {d.decision.action for d in plan.decided} == {Action.RESTART_JOB, Action.ROLLBACK_DOMAIN}


def test_no_clean_checkpoint_restarts_from_step_zero_even_when_another_decision_has_one() -> None:
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP), _inc(IncidentClass.CORRUPTION, onset=3)],
                         job=CANARY, catalog=CATALOG)
    assert plan.relaunch and plan.checkpoint is None
    assert "step 0" in plan.lines()[-1]


def test_a_plan_from_partial_telemetry_restarts_nothing_and_says_why(tmp_path: Path) -> None:
    """One rank's steps part cut short: the analysis leaves it out and says so; a corruption it reports (which the
    missing rows could undo) is observed, not turned into a restart."""
    from rankwatch.analytics.analyze import AnalysisConfig, analyze
    from rankwatch.cli import main

    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "8", "--hosts", "2", "--layout", "dp=4,tp=2", "--steps", "30", "--out",
                 str(out), "--no-phases"]) == 0
    victim = next((out / "telemetry" / "steps" / "rank=3").glob("part-*.parquet"))
    victim.write_bytes(victim.read_bytes()[:100])
    analysis = analyze(out, config=AnalysisConfig(views=False))
    assert len(analysis.left_out) == 1 and str(victim) in analysis.left_out[0]
    corruption = _inc(IncidentClass.CORRUPTION, onset=12, ranks=(0,), cause=Cause.LOSS_OUTLIER)
    whole = plan_recovery([corruption, _inc(IncidentClass.STRAGGLER)], job=CANARY, catalog=CATALOG)
    assert whole.relaunch
    partial = plan_recovery([corruption, _inc(IncidentClass.STRAGGLER)], job=CANARY, catalog=CATALOG,
                            left_out=analysis.left_out)
    assert not partial.relaunch and partial.checkpoint is None
    held = next(d.decision for d in partial.decided if d.incident.klass is IncidentClass.CORRUPTION)
    assert held.action is Action.OBSERVE and held.path[-2:] == ("input=partial", "-> observe")
    assert held.reasons[0].startswith(f"held: decided from partial telemetry (1 part file(s) left out, first {victim}")


def test_a_narrow_action_the_job_cannot_do_is_escalated_never_narrowed() -> None:
    # proven agreement + idempotent + pure dp: the policy rebuilds the dp group; the canary cannot, so it restarts
    job = JobDeclaration(membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH, idempotent=Idempotency.IDEMPOTENT)
    gate = GateResult(verdict=GateVerdict.AGREE, domain="world", ranks=(0, 2, 3), spans_job=True)
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=job, catalog=CATALOG, gate=gate)
    assert plan.decided[0].decision.action is Action.REBUILD_GROUP
    assert plan.relaunch and plan.checkpoint is not None and plan.checkpoint.id == "step-00000009"
    assert len(plan.escalations) == 1 and "rebuild_group is not something this job can do" in plan.escalations[0]
    # a job that can rebuild its group gets exactly that decision carried out (no escalation line)
    able = JobDeclaration(membership=job.membership, idempotent=job.idempotent,
                          executable=job.executable | {Action.REBUILD_GROUP})
    assert not plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=able, catalog=CATALOG, gate=gate).escalations


def test_recurrence_on_a_device_quarantines_it_without_touching_the_job() -> None:
    rec = {IncidentClass.STRAGGLER: RecurrenceView(klass=IncidentClass.STRAGGLER, follows=FollowsKind.DEVICE,
                                                   id="GPU-aa", occurrences=3)}
    plan = plan_recovery([_inc(IncidentClass.STRAGGLER)], job=CANARY, catalog=CATALOG, recurrence=rec)
    assert plan.action is Action.QUARANTINE and not plan.relaunch
    assert [str(t) for t, _ in plan.quarantines] == ["device:GPU-aa"]


# ------------------------------------------------------------------------------------------------------- apply


class FakeLauncher:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[CanaryConfig] = []

    def __call__(self, cfg: CanaryConfig, **kw: Any) -> LaunchResult:
        self.calls.append(cfg)
        return LaunchResult(run_dir=Path(cfg.run_dir), exit_codes=(0, 0) if self.ok else (1, 1), pids=(1, 2),
                            duration_s=0.1, terminated=())


def _run(tmp_path: Path, steps: tuple[int, ...], *, partial: int | None = None) -> CanaryConfig:
    run_dir = tmp_path / "run"
    for s in steps:  # checkpoint directories (judged corrupt: an empty manifest); the fake launcher loads nothing
        (run_dir / CHECKPOINT_DIR / f"step-{s:08d}").mkdir(parents=True)
        (run_dir / CHECKPOINT_DIR / f"step-{s:08d}" / "manifest.json").write_text("{}")
    if partial is not None:
        (run_dir / CHECKPOINT_DIR / f".step-{partial:08d}.tmp").mkdir(parents=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = CanaryConfig(run_dir=run_dir, steps=20, layout=Layout(dp=2), gpu="off")
    (run_dir / RUN_FILE).write_text(json.dumps({"launches": [{"started_wall_ns": 1}]}))
    return cfg


def test_apply_a_rollback_retires_newer_and_partial_checkpoints_and_relaunches_behind_the_gate(tmp_path: Path) -> None:
    cfg = _run(tmp_path, (4, 9), partial=12)
    plan = plan_recovery([_inc(IncidentClass.DIVERGENCE, onset=7, ranks=(0, 1),
                               subject=Subject(kind=SubjectKind.DOMAIN, id="dp0"))], job=CANARY, catalog=CATALOG)
    launcher = FakeLauncher()
    rec = apply(cfg, plan, launcher=launcher)
    [again] = launcher.calls
    assert again.resume and again.resume_from == "step-00000004" and not again.faults.specs()
    assert again.replay_basis == 7  # attempt 0 is a replay reference only before the divergence's onset
    names = sorted(p.name for p in (cfg.run_dir / CHECKPOINT_DIR).iterdir())
    assert names == [".retired-step-00000009-corrupt-recovery-0001", ".retired-step-00000012-partial-recovery-0001",
                     "step-00000004"]
    assert rec.outcome == "recovered" and len(rec.evidence) == 1 and rec.evidence[0].is_dir()
    doc = json.loads((cfg.run_dir / RECOVERY_DIR / "recovery-0001.json").read_text())
    assert doc["checkpoint"] == "step-00000004" and doc["decisions"][0]["action"] == "rollback_domain"
    assert doc["decisions"][0]["path"][-1].startswith("-> roll back")
    assert not lineage_path(cfg.run_dir).exists()  # the resumed job records its own rollback once the gate agreed


def test_a_retired_checkpoint_is_named_with_its_verified_verdict(tmp_path: Path) -> None:
    from support import make_checkpoint

    cfg = _run(tmp_path, ())
    for step in (4, 9, 14):
        make_checkpoint(cfg.run_dir, step)
    shard = sorted((cfg.run_dir / CHECKPOINT_DIR / "step-00000009").glob("rank-*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped in place: the manifest still reads, the SHA-256 does not match
    shard.write_bytes(bytes(data))
    only4 = CheckpointCatalogView(committed=(CheckpointRef(id="step-00000004", step=4),))
    apply(cfg, plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=CANARY, catalog=only4), launcher=FakeLauncher())
    assert sorted(p.name for p in (cfg.run_dir / CHECKPOINT_DIR).iterdir()) == [
        ".retired-step-00000009-corrupt-recovery-0001", ".retired-step-00000014-committed-recovery-0001",
        "step-00000004"]


def test_the_replay_basis_is_where_an_undone_state_fault_may_have_begun() -> None:
    sampled = Incident(klass=IncidentClass.DIVERGENCE, subject=Subject(kind=SubjectKind.RANK, id="1"), ranks=(1,),
                       onset_step=10, last_good_step=5, detection_step=10, confidence=0.9, cause=Cause.RNG_MISMATCH,
                       summary="seen at the step-10 fingerprint, agreed at step 5")
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP), sampled], job=CANARY, catalog=CATALOG)
    assert plan.checkpoint is not None and plan.checkpoint.id == "step-00000004" and replay_basis(plan) == 6
    assert replay_basis(plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=CANARY, catalog=CATALOG)) is None
    unknown = plan_recovery([_inc(IncidentClass.CORRUPTION, onset=None)], job=CANARY, catalog=CATALOG)
    assert replay_basis(unknown) == (unknown.checkpoint.step + 1 if unknown.checkpoint else 0)
    with pytest.raises(ValueError, match="last good step 10 is not before the onset at step 10"):
        Incident(klass=IncidentClass.DIVERGENCE, subject=Subject(kind=SubjectKind.RANK, id="1"), ranks=(1,),
                 onset_step=10, last_good_step=10, detection_step=10, confidence=0.9, cause=Cause.RNG_MISMATCH,
                 summary="x")


def test_apply_from_step_zero_records_the_restart_itself(tmp_path: Path) -> None:
    cfg = _run(tmp_path, (4,))
    plan = plan_recovery([_inc(IncidentClass.CORRUPTION, onset=2)], job=CANARY,
                         catalog=CheckpointCatalogView(committed=(CheckpointRef(id="step-00000004", step=4),)))
    launcher = FakeLauncher(ok=False)
    rec = apply(cfg, plan, launcher=launcher)
    assert not launcher.calls[0].resume and rec.outcome == "relaunch_failed" and not rec.ok
    assert [e.kind for e in read(lineage_path(cfg.run_dir))] == [LineageKind.RESTART]
    assert verify(lineage_path(cfg.run_dir)).ok
    assert [p.name for p in (cfg.run_dir / CHECKPOINT_DIR).iterdir()] == [
        ".retired-step-00000004-corrupt-recovery-0001"]


def test_apply_quarantine_writes_the_list_and_lineage_once(tmp_path: Path) -> None:
    cfg = _run(tmp_path, ())
    rec = {IncidentClass.STRAGGLER: RecurrenceView(klass=IncidentClass.STRAGGLER, follows=FollowsKind.HOST,
                                                   id="host1", occurrences=4)}
    plan = plan_recovery([_inc(IncidentClass.STRAGGLER)], job=CANARY, catalog=CATALOG, recurrence=rec)
    launcher = FakeLauncher()
    first = apply(cfg, plan, launcher=launcher)
    second = apply(cfg, plan, launcher=launcher)
    assert not launcher.calls and first.outcome == "quarantined" and second.outcome == "observed"
    assert [(e.kind, e.id) for e in quarantined(cfg.run_dir)] == [("host", "host1")]
    [entry] = read(lineage_path(cfg.run_dir))
    assert entry.kind is LineageKind.DEVICE_QUARANTINED and entry.details.subject == "host:host1"
    assert (cfg.run_dir / QUARANTINE_FILE).exists()
    assert sorted(p.name for p in (cfg.run_dir / RECOVERY_DIR).iterdir()) == ["recovery-0001.json", "recovery-0002.json"]


def test_a_reshuffle_rotates_ranks_so_another_rank_holds_each_suspect_device(tmp_path: Path) -> None:
    from rankwatch.canary.config import placement
    from rankwatch.control.manager import reshuffled

    cfg = CanaryConfig(run_dir=tmp_path / "run", steps=10, layout=Layout.parse("dp=4", nproc=4), hosts=2,
                       slots_per_host=3)
    cfg.run_dir.mkdir()
    before = placement(cfg)
    suspect = before[1][2]  # rank 1's GPU (host0 slot 1)
    said: list[str] = []
    moved = reshuffled(cfg.run_dir, cfg, [suspect], say=said.append)
    after = placement(moved)
    assert moved.device_shift == 1 and after[0][2] == suspect  # rank 0 now on it: the next failure tells
    assert all(after[r][2] != before[r][2] for r in before) and "rotated by 1" in said[0]
    entries = read(lineage_path(cfg.run_dir))
    assert [e.kind for e in entries] == [LineageKind.DEVICE_REPLACED] * 4 and verify(lineage_path(cfg.run_dir)).ok
    assert {e.details.old_device for e in entries} == {u for _, _, u in before.values()}
    # a rotation that would put a rank on a quarantined device is passed over; none left: placed as before, said
    (cfg.run_dir / QUARANTINE_FILE).write_text(json.dumps({"entries": [
        {"kind": "device", "id": placement(replace(cfg, device_shift=1))[1][2]},
        {"kind": "device", "id": placement(replace(cfg, device_shift=2))[0][2]}]}))
    assert reshuffled(cfg.run_dir, cfg, [suspect], say=said.append) is cfg and "placed as before" in said[-1]


def test_a_crash_loop_is_refused_after_too_many_failed_relaunches_in_a_row(tmp_path: Path) -> None:
    cfg = _run(tmp_path, (4, 9))
    plan = plan_recovery([_inc(IncidentClass.FAIL_STOP)], job=CANARY, catalog=CATALOG)
    launcher = FakeLauncher(ok=False)
    outcomes = [apply(cfg, plan, launcher=launcher, max_failed_relaunches=2).outcome for _ in range(3)]
    assert outcomes == ["relaunch_failed", "relaunch_failed", "relaunch_refused"] and len(launcher.calls) == 2
    doc = json.loads((cfg.run_dir / RECOVERY_DIR / "recovery-0003.json").read_text())
    assert doc["refused"].startswith("crash loop: the last 2 relaunches failed")
    # a relaunch that worked breaks the run of failures
    ok = FakeLauncher()
    assert apply(cfg, plan, launcher=ok).outcome == "recovered"  # the refused record is not a failed relaunch
    assert apply(cfg, plan, launcher=FakeLauncher(ok=False), max_failed_relaunches=1).outcome == "relaunch_failed"


def test_config_from_run_keeps_the_machines_faults_and_drops_the_attempts(tmp_path: Path) -> None:
    from rankwatch.canary.faults import BadDevice, Faults, SlowLink
    from rankwatch.canary.launcher import record_launch

    faults = (Faults().bad_device(host=0, index=1, from_step=5, delay_s=0.08).slow_link(hosts=(0, 1), delay_s=0.01)
              .exit(rank=1, step=3).bitflip(rank=2, step=4))
    cfg = CanaryConfig(run_dir=tmp_path / "run", steps=10, layout=Layout.parse("dp=4", nproc=4), hosts=2,
                       faults=faults, slots_per_host=3)
    cfg.run_dir.mkdir()
    record_launch(cfg)
    again = config_from_run(cfg.run_dir)
    assert [type(f) for f in again.faults.faults] == [BadDevice, SlowLink]
    assert again.faults == faults.hardware() and again.slots_per_host == 3
    run_file = cfg.run_dir / RUN_FILE
    doc = json.loads(run_file.read_text())
    doc["launches"][-1]["faults"] = ["nonsense:rank=1"]
    run_file.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"run.json: launch record's faults unreadable"):
        config_from_run(cfg.run_dir)


def test_config_from_run_names_what_an_old_run_file_lacks(tmp_path: Path) -> None:
    cfg = _run(tmp_path, ())
    with pytest.raises(ValueError, match=r"run.json: launch record lacks 'steps'"):
        config_from_run(cfg.run_dir)
    (cfg.run_dir / RUN_FILE).write_text("{")
    with pytest.raises(ValueError, match=r"run.json: unreadable run file"):
        config_from_run(cfg.run_dir)


def test_recover_command_on_a_folder_that_is_no_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.cli import main

    assert main(["recover", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rankwatch recover: error: {tmp_path}: not a run directory (none of run.json, telemetry, live, "
                   "checkpoints, lineage.jsonl in it)"]
    (tmp_path / "telemetry").mkdir()  # a run, but not one the canary launched: nothing to relaunch
    assert main(["recover", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rankwatch recover: error: {tmp_path / RUN_FILE}: no run file — not a canary run directory"]


def test_apply_relaunches_off_the_quarantine_list_or_refuses_and_says_so(tmp_path: Path) -> None:
    from dataclasses import replace

    from rankwatch.canary.config import placement
    from rankwatch.collector.gpu import replay_uuid

    cfg = _run(tmp_path, ())
    bad = replay_uuid("host0", 1)  # rank 1's device
    (cfg.run_dir / QUARANTINE_FILE).write_text(json.dumps({"entries": [{"kind": "device", "id": bad}]}))
    plan = plan_recovery([_inc(IncidentClass.CORRUPTION, onset=2)], job=CANARY, catalog=CheckpointCatalogView())
    spare = replace(cfg, slots_per_host=3)
    launcher = FakeLauncher()
    rec = apply(spare, plan, launcher=launcher)
    [again] = launcher.calls
    assert bad not in {u for _, _, u in placement(again).values()} and rec.outcome == "recovered" and rec.ok
    replaced = [e for e in read(lineage_path(cfg.run_dir)) if e.kind is LineageKind.DEVICE_REPLACED]
    assert [e.details.old_device for e in replaced] == [bad]
    # two ranks on a two-slot host: every placement of both touches the quarantined device. Fixed shapes (tp=2):
    # refused, never shrunk
    fixed = replace(cfg, layout=Layout(tp=2))
    launcher = FakeLauncher()
    rec = apply(fixed, plan, launcher=launcher)
    assert not launcher.calls and rec.outcome == "relaunch_refused" and not rec.ok and "quarantined" in rec.refused
    assert "fixed_shapes" in rec.refused
    doc = json.loads((cfg.run_dir / RECOVERY_DIR / f"{rec.id}.json").read_text())
    assert doc["outcome"] == "relaunch_refused" and doc["relaunch"] is None and doc["refused"]
    # the canary's pure dp=2 declares a reconfigurable batch: it goes on with one replica, and lineage says so
    launcher = FakeLauncher()
    rec = apply(cfg, plan, launcher=launcher)
    [smaller] = launcher.calls
    assert smaller.world_size == 1 and bad not in {u for _, _, u in placement(smaller).values()}
    assert rec.outcome == "recovered" and rec.world_size == 1
    entries = read(lineage_path(cfg.run_dir))
    changed = [e for e in entries if e.kind is LineageKind.WORLD_SIZE_CHANGE]
    assert [(e.details.old_world_size, e.details.new_world_size) for e in changed] == [(2, 1)]
    assert entries[-2].kind is LineageKind.RESTART and str(entries[-2].verdict.comparability) == "changed"


# ----------------------------------------------------------------------------------- detection, decision, advice


def _slow_run(tmp_path: Path, *, steps: int | None) -> tuple[Path, int]:
    """A simulated 4-rank run of 40 steps, rank 3 half again as slow from step 10, a checkpoint every 10 steps;
    run.json's launch at 2 s before the first step, declaring `steps`. Returns the run and its launch time."""
    from rankwatch.analytics.store import connect
    from rankwatch.base.rundir import append_launch
    from rankwatch.simulator.config import SimConfig
    from rankwatch.simulator.faults import parse_sim_fault
    from rankwatch.simulator.simulate import simulate

    run = tmp_path / "slow"
    simulate(SimConfig(name="slow", layout=Layout(dp=4), hosts=2, steps=40, seed=1, checkpoint_every=10,
                       faults=(parse_sim_fault("gpu_slow:rank=3,from=10,factor=1.5"),)), run)
    con = connect(run)
    try:
        started = int(con.execute("SELECT min(start_wall_ns) FROM steps").fetchall()[0][0]) - 2_000_000_000
    finally:
        con.close()
    append_launch(run, {"started_wall_ns": started, "world_size": 4, **({} if steps is None else {"steps": steps})})
    return run, started


def test_assess_advises_on_a_slow_rank_from_the_runs_own_costs_and_leaves_the_decision_alone(tmp_path: Path) -> None:
    """400 steps declared, 40 trained: 360 left at the median step. The run has not restarted, so the restart is its
    first start-up (2 s from the launch to the first step), its blocking save, no load and no gate; rank 3 costs far
    more than that over what is left: replace it at the next checkpoint. The policy still observes it."""
    from rankwatch.analytics.costs import measured_costs, training_left
    from rankwatch.control.manager import assess

    run, _ = _slow_run(tmp_path, steps=400)
    layout = Layout(dp=4)
    plan = assess(run, layout=layout, job=canary_declaration(layout))
    assert plan.action is Action.OBSERVE and not plan.relaunch
    [slow] = [d for d in plan.decided if d.incident.klass is IncidentClass.STRAGGLER]
    assert slow.decision.action is Action.OBSERVE and slow.incident.ranks == (3,)
    [advice] = plan.advice
    left, costs = training_left(run), measured_costs([run])
    assert left.steps == 360 and advice.remaining_s == pytest.approx(left.seconds)
    assert advice.restart.relaunch_s == pytest.approx(2.0, abs=1e-6) and advice.restart.restore_s == 0.0
    assert advice.restart.save_s == pytest.approx(costs.sync_save.seconds) and advice.restart.gate_s == 0.0
    assert "no restart measured yet" in advice.restart.source
    assert advice.incident == slow.incident.id and advice.replace
    assert advice.projected_loss_s == pytest.approx(advice.share * advice.remaining_s)
    lines = plan.lines()
    assert f"advice: {advice.describe()}" in lines and any(ln.startswith("advice: training left: 360 step") for ln in lines)
    assert lines[-1] == "=> observe: nothing to recover"
    assert plan.decided_wall_ns is not None and plan.detected_wall_ns is not None
    assert plan.detected_wall_ns <= plan.decided_wall_ns and plan.detected_by.startswith("the analysis of attempt 0")


def test_no_advice_without_a_declared_step_count_and_a_line_says_why(tmp_path: Path) -> None:
    from rankwatch.control.manager import assess

    run, _ = _slow_run(tmp_path, steps=None)
    layout = Layout(dp=4)
    plan = assess(run, layout=layout, job=canary_declaration(layout))
    assert plan.advice == () and plan.action is Action.OBSERVE
    [note] = plan.advice_notes
    assert "declares no step count" in note and f"advice: {note}" in plan.lines()


def test_the_record_keeps_when_the_manager_detected_and_decided_and_its_advice(tmp_path: Path) -> None:
    """The launcher's earliest abnormal exit of the latest attempt is the detection (a clean exit, and an attempt's
    before, are not); the record written for the plan keeps it, the decision and the advice, typed when read back; a
    record from before these keys reads with None; a damaged one is a one-line error naming the file."""
    from rankwatch.base.rundir import RunFileError, read_recovery_records, write_recovery_record
    from rankwatch.collector.liveness import write_exit_record
    from rankwatch.control.manager import assess

    run, started = _slow_run(tmp_path, steps=400)
    for rank, attempt, code, at in ((0, 0, 0, started + 5), (1, 0, -9, started + 40), (2, 0, 1, started + 30),
                                    (3, 0, -15, started + 50)):
        write_exit_record(run, rank=rank, world_size=4, attempt=attempt, pid=None, host="h0", returncode=code,
                          wall_ns=at)
    layout = Layout(dp=4)
    plan = assess(run, layout=layout, job=canary_declaration(layout))
    assert plan.detected_wall_ns == started + 30
    assert plan.detected_by == "the launcher saw rank 2 of attempt 0 end (exit code 1)"
    seen = plan.seen(started + 20, "an alert")
    assert (seen.detected_wall_ns, seen.detected_by) == (started + 20, "an alert")
    assert plan.seen(started + 31, "later") is plan and plan.seen(None, "none") is plan
    cfg = CanaryConfig(run_dir=run, steps=400, layout=layout, gpu="off")
    rec = apply(cfg, plan, launcher=FakeLauncher())
    assert rec.outcome == "observed"
    [doc] = read_recovery_records(run)
    assert (doc.detected_wall_ns, doc.detected_by, doc.decided_wall_ns) == (
        started + 30, plan.detected_by, plan.decided_wall_ns)
    assert doc.wall_ns is not None and doc.decided_wall_ns is not None and doc.decided_wall_ns <= doc.wall_ns
    [advice] = doc.doc["advice"]
    assert advice["replace"] is True and advice["restart"]["total_s"] == pytest.approx(plan.advice[0].restart.total_s)
    assert doc.doc["advice_notes"][0].startswith("training left: 360 step")
    old = {k: v for k, v in json.loads(doc.path.read_text()).items()
           if k not in ("detected_wall_ns", "detected_by", "decided_wall_ns")}
    write_recovery_record(run, "recovery-0001", old)
    [again] = read_recovery_records(run)
    assert (again.detected_wall_ns, again.detected_by, again.decided_wall_ns) == (None, None, None)
    write_recovery_record(run, "recovery-0001", {**old, "decided_wall_ns": "soon"})
    with pytest.raises(RunFileError) as err:
        read_recovery_records(run)
    assert str(err.value) == f"{doc.path}: decided_wall_ns is 'soon', not a wall-clock time in ns (an integer >= 0)"
