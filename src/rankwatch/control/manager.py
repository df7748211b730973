"""The recovery manager: incidents in, the narrowest safe recovery out, applied, and the job back behind the gate.

    assess(run, job)          analyze the run, decide for every new incident, join the decisions into one plan
                              (a dry run: nothing is touched)
    apply(cfg, plan)          evidence first, then quarantine, retire what the rollback passes over, relaunch,
                              and a record in <run>/recovery/<id>.json
    supervise(cfg)            launch the job; whenever an attempt ends, assess; act on what is new; repeat

Per incident, `recovery.policy.decide` gets the job's declaration (which membership change its algorithm
supports, whether its failed operations are idempotent), the checkpoint catalog (committed and verified
checkpoints only; partial and corrupt ones are counted as evidence), recurrence across runs when the caller has
other runs of the job, and the consistency gate. The plan joins the decisions into one executed action: the
broadest wins (a job restart covers a domain rollback), its checkpoint is the oldest any decision asked for (clean
for every incident), and every quarantine is applied. An action the job cannot carry out is escalated, never
narrowed: the canary relaunches every process, so a retry, a group rebuild, a replica restart or the rollback of a
sub-domain becomes a job restart from the checkpoint the policy chose (or the newest committed one), and the plan
says so.

The gate: the manager acts after an attempt ended, so no process is left to answer a gate and `decide` gets none
(agreement unproven) — it never takes a narrow branch on the manager's word alone. The gate runs where it can: in
the relaunched job, which loads the checkpoint, all-gathers every rank's fingerprints and refuses to train unless
every domain agrees (`recovery.resume`); a refusal ends the relaunch with a non-zero exit and the record says so.

Every plan `assess` makes carries when the manager's side first knew the attempt needed it (the launcher's earliest
exit record of a rank that ended abnormally, else the analysis' end; the service lowers it to an alert's arrival) and
when the plan was made; the record keeps both, so `analytics.goodput` measures detection and decision. For each
straggler the policy observes or quarantines, the plan also carries cost-aware advice (`recovery.advice`): keep it,
or replace it at the next checkpoint, from the run's own measured restart cost and the training time it has left.
The advice never changes the action: a slow rank is not a failed rank.

Where a relaunch runs (off the quarantine list, on fewer ranks where the job declared it, its ranks reshuffled) is
`control.placement`; its functions are re-exported here.

Nothing is retried blind: an attempt that failed with no incident that explains it is reported and left alone.
Before a relaunch, committed checkpoints newer than the rollback target are retired (renamed out of the catalog,
kept as evidence: they may hold the faulty state) and partial ones are moved aside (a re-save of the same step
would otherwise replace them); their manifests are copied into every incident's evidence bundle first.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pyarrow.parquet as pq

from rankwatch.analytics.analyze import AnalysisConfig, analyze, observe_run, write_analysis
from rankwatch.analytics.incidents import Incident, IncidentClass, sort_incidents
from rankwatch.analytics.liveness import parse_exit_record
from rankwatch.analytics.localize import FollowsKind, Localization, RunObservation, localize
from rankwatch.analytics.queries import attempt_topology, groups
from rankwatch.analytics.store import open_run, telemetry_dir
from rankwatch.analytics.validate import read_error
from rankwatch.base.rundir import (
    QuarantineEntry, RunDir, handled_incidents, next_recovery_id, read_launches, read_recovery_records,
    recovery_record_paths, write_quarantine, write_recovery_record,
)
from rankwatch.base.schema import EXIT_RECORD_PREFIX, EXIT_RECORD_SUFFIX, ChangeReason, LineageKind, Steps, Table
from rankwatch.base.topology import Layout
from rankwatch.collector.sink import partition_dir
from rankwatch.control.placement import continue_on, place_off_quarantine, placed_topology, quarantined, reshuffled
from rankwatch.control.wire import AlertMessage
from rankwatch.recovery.advice import ReplaceAdvice, replacement_advice
from rankwatch.recovery.catalog import Verdict, checkpoint_id, list_checkpoints
from rankwatch.recovery.decision import (
    Action, CheckpointCatalogView, CheckpointRef, Decision, GateResult, ScopeKind, Target, TargetKind,
)
from rankwatch.recovery.evidence import preserve_evidence
from rankwatch.recovery.job import Job, JobDeclaration, LaunchResult
from rankwatch.recovery.lineage import Details, Lineage, NewEntry, Verdict as LineageVerdict, lineage_path
from rankwatch.recovery.policy import RecurrenceView, decide, hold_on_partial_input
from rankwatch.recovery.resume import last_completed_step

__all__ = [
    "MAX_FAILED_RELAUNCHES", "Decided", "Outcome", "RecoveryPlan", "RecoveryRecord", "Supervised", "apply", "assess",
    "Planner", "catalog_view", "continue_on", "covering", "latest_recovery", "localize_attempts", "place_off_quarantine", "plan_from_message", "plan_live", "plan_recovery", "quarantined", "recurrence_from",
    "replay_basis", "reshuffled", "supervise", "write_plan",
]

# How much of the running job an action touches, narrowest first.
_BREADTH: dict[Action, int] = {
    Action.OBSERVE: 0, Action.QUARANTINE: 1, Action.RETRY_OPERATION: 2, Action.REBUILD_GROUP: 3,
    Action.RESTART_REPLICA: 4, Action.ROLLBACK_DOMAIN: 5, Action.RESTART_JOB: 6,
}
_RELAUNCHING = frozenset(a for a, b in _BREADTH.items() if b >= _BREADTH[Action.RETRY_OPERATION])


def catalog_view(run_dir: Path, layout: Layout) -> CheckpointCatalogView:
    """Committed, SHA-256-verified checkpoints this layout can load; partial and corrupt candidates counted."""
    committed, partial, corrupt = [], 0, 0
    for c in list_checkpoints(run_dir, verify=True, layout=layout, world_size=layout.world_size):
        if c.verdict is Verdict.COMMITTED:
            committed.append(CheckpointRef(id=c.path.name, step=c.step))
        elif c.verdict is Verdict.PARTIAL:
            partial += 1
        elif c.verdict is Verdict.CORRUPT:
            corrupt += 1
    return CheckpointCatalogView(committed=tuple(committed), partial=partial, corrupt=corrupt)


def recurrence_from(runs: Sequence[Path]) -> dict[IncidentClass, RecurrenceView]:
    """Localization across `runs` (this run among them) per incident class: what a recurring fault follows."""
    found = localize([observe_run(r) for r in runs])
    return {loc.klass: RecurrenceView.from_localization(loc) for loc in found
            if loc.follows is not FollowsKind.INCONCLUSIVE}


# ----------------------------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Decided:
    incident: Incident
    decision: Decision


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryPlan:
    """Every new incident's decision, and the one action the job will carry out for all of them."""

    decided: tuple[Decided, ...]
    action: Action
    """OBSERVE (nothing to do), QUARANTINE (the running job is untouched) or RESTART_JOB."""
    checkpoint: CheckpointRef | None
    """RESTART_JOB from this checkpoint; None with RESTART_JOB: from step 0."""
    quarantines: tuple[tuple[Target, str], ...]
    """(what, the incident id behind it)."""
    escalations: tuple[str, ...] = ()
    """Why the executed action is broader than a decision asked for, one line each."""
    skipped: tuple[str, ...] = ()
    """Incident ids already acted on by an earlier recovery, or raised before the latest launch."""
    reshuffle: tuple[str, ...] = ()
    """Devices (UUIDs) a recurring fault was seen on, again and again under one rank number: the relaunch moves the
    ranks to other devices (a rank number onto each) so that the next occurrence tells device from rank
    (`analytics.localize`, `Localization.reshuffle`). They are not quarantined."""
    advice: tuple[ReplaceAdvice, ...] = ()
    """For each straggler the policy observes or quarantines: keep it, or replace it at the next checkpoint, with
    the numbers (`recovery.advice`). A recommendation: the action is the policy's."""
    advice_notes: tuple[str, ...] = ()
    """What the advice rests on (the training time left), and why a straggler has none, one line each."""
    detected_wall_ns: int | None = None
    """When the manager's side first knew the attempt needed it (`assess`: the launcher's earliest exit record of a
    rank that ended abnormally, else the analysis' end; the service: the alert's arrival, where earlier); None for a
    plan made from incidents alone (`plan_recovery`)."""
    detected_by: str = ""
    """What that was, in words."""
    decided_wall_ns: int | None = None
    """When the plan was made (the end of `assess`), before anything in it is begun."""

    @property
    def relaunch(self) -> bool:
        return self.action is Action.RESTART_JOB

    def seen(self, wall_ns: int | None, by: str) -> RecoveryPlan:
        """This plan with its detection at `wall_ns` (`by` says what that was) where that is earlier than its own or
        it has none: the service's alert may reach it before the attempt's end shows anything."""
        if wall_ns is None or (self.detected_wall_ns is not None and self.detected_wall_ns <= wall_ns):
            return self
        return replace(self, detected_wall_ns=wall_ns, detected_by=by)

    def lines(self) -> list[str]:
        out = []
        for d in self.decided:
            i, dec = d.incident, d.decision
            out.append(f"{i.id} ({i.klass} {i.subject}): {dec.action}" + (f" {dec.target}" if dec.target else ""))
            out.append(f"    path: {' | '.join(dec.path)}")
            out.extend(f"    - {r}" for r in dec.reasons)
        out.extend(f"escalated: {e}" for e in self.escalations)
        for target, inc in self.quarantines:
            out.append(f"quarantine {target} ({inc})")
        out.extend(f"advice: {n}" for n in self.advice_notes)
        out.extend(f"advice: {a.describe()}" for a in self.advice)
        if self.relaunch:
            where = self.checkpoint.id if self.checkpoint is not None else "step 0 (no clean committed checkpoint)"
            out.append(f"=> restart the job from {where}")
            if self.reshuffle:
                out.append(f"=> with its ranks moved to other devices, to tell device from rank: "
                           f"{', '.join(self.reshuffle)} recurred under one rank number")
        elif self.action is Action.QUARANTINE:
            out.append("=> quarantine only; the job is not touched")
        else:
            out.append("=> observe: nothing to recover")
        return out


def plan_recovery(
    incidents: Sequence[Incident],
    *,
    job: JobDeclaration,
    catalog: CheckpointCatalogView,
    gate: GateResult | None = None,
    recurrence: Mapping[IncidentClass, RecurrenceView] | None = None,
    left_out: Sequence[str] = (),
) -> RecoveryPlan:
    """Decide for every incident and join the decisions (pure; see the module docstring). `left_out`: part files the
    analysis behind `incidents` could not read; then nothing is restarted or rolled back (`hold_on_partial_input`)."""
    decided = tuple(
        Decided(incident=i, decision=hold_on_partial_input(
            decide(i, gate, idempotent=job.idempotent, membership=job.membership, catalog=catalog,
                   recurrence=(recurrence or {}).get(i.klass)), left_out))
        for i in sort_incidents(incidents)
    )
    quarantines: dict[str, tuple[Target, str]] = {}
    escalations: list[str] = []
    relaunch = False
    checkpoint: CheckpointRef | None = None
    genesis = False
    for d in decided:
        for dec in (d.decision, *d.decision.also):
            if dec.action is Action.QUARANTINE and dec.target is not None:
                quarantines.setdefault(str(dec.target), (dec.target, d.incident.id))
        dec = d.decision
        if dec.action not in _RELAUNCHING:
            continue
        relaunch = True
        target = dec.target if dec.target is not None and dec.target.kind is TargetKind.CHECKPOINT else None
        narrow_domain = dec.action is Action.ROLLBACK_DOMAIN and dec.scope is not ScopeKind.JOB
        if dec.action is Action.RESTART_JOB and target is None:
            genesis = True
        elif dec.action not in job.executable or (narrow_domain and not job.domain_rollback):
            if target is None:
                target_ref = catalog.newest()
                if target_ref is None:
                    genesis = True
                    escalations.append(f"{d.incident.id}: {dec.action} is not something this job can do; no committed "
                                       "checkpoint, so the job restarts from step 0")
                    continue
            else:
                target_ref = CheckpointRef(id=target.id, step=int(target.step or 0))
            what = f"{dec.action} of domain" if narrow_domain else str(dec.action)
            escalations.append(f"{d.incident.id}: {what} is not something this job can do; every process relaunches "
                               f"from {target_ref.id} instead (broader, never narrower)")
            if checkpoint is None or target_ref.step < checkpoint.step:
                checkpoint = target_ref
            continue
        if target is not None:
            ref = CheckpointRef(id=target.id, step=int(target.step or 0))
            if checkpoint is None or ref.step < checkpoint.step:
                checkpoint = ref
    if genesis:
        checkpoint = None
    action = Action.RESTART_JOB if relaunch else Action.QUARANTINE if quarantines else Action.OBSERVE
    return RecoveryPlan(decided=decided, action=action, checkpoint=checkpoint if relaunch else None,
                        quarantines=tuple(quarantines.values()), escalations=tuple(escalations))


# --------------------------------------------------------------------------------------------------------- assess


def _launches(run_dir: Path) -> list[dict[str, Any]]:
    launches = read_launches(run_dir)
    if not launches:
        raise ValueError(f"{RunDir(run_dir).run_file}: records no launch")
    return launches


def assess(
    run_dir: Path,
    *,
    layout: Layout,
    job: JobDeclaration,
    recurrence: Mapping[IncidentClass, RecurrenceView] | None = None,
    gate: GateResult | None = None,
    also: Sequence[Incident] = (),
) -> RecoveryPlan:
    """Analyze the run (writing <run>/analysis/incidents.*), keep the incidents that are new — raised in the
    latest launch and not acted on by an earlier recovery — and plan. `also`: incidents known from elsewhere (the
    live reading, which may see a fault before the part files show it); each is decided with the new ones unless
    the analysis raised one of its class about its subject, or a recovery handled it. Touches nothing else."""
    run_dir = Path(run_dir)
    launches = _launches(run_dir)
    started = int(launches[-1]["started_wall_ns"])
    analysis = analyze(run_dir, config=AnalysisConfig())
    write_analysis(analysis)
    analyzed = time.time_ns()
    handled = handled_incidents(read_recovery_records(run_dir))
    new: list[Incident] = []
    skipped: list[Incident] = []
    for inc in analysis.incidents:
        old = inc.detection_wall_ns is not None and inc.detection_wall_ns < started
        (skipped if inc.id in handled or old else new).append(inc)
    known = {(i.klass, i.subject) for i in new} | {i.id for i in skipped}
    new.extend(i for i in also if (i.klass, i.subject) not in known and i.id not in known and i.id not in handled)
    found: tuple[Localization, ...] = ()
    if recurrence is None:  # none from other runs: what this run's own attempts say
        found = localize_attempts(run_dir, new)
        recurrence = {loc.klass: RecurrenceView.from_localization(loc) for loc in found
                      if loc.follows is not FollowsKind.INCONCLUSIVE}
    plan = plan_recovery(new, job=job, catalog=catalog_view(run_dir, layout), gate=gate,
                         recurrence=recurrence, left_out=analysis.left_out)
    classes = {d.incident.klass for d in plan.decided}
    suspects = tuple(sorted({o.id for loc in found if loc.reshuffle and loc.klass in classes
                             for o in loc.by_device if o.implicated >= 2}))
    plan = replace(plan, skipped=tuple(i.id for i in skipped), reshuffle=suspects if plan.relaunch else ())
    if not plan.decided:
        return plan
    advice, notes = replacement_advice(run_dir, [d.incident for d in plan.decided if d.incident.klass is
                                                 IncidentClass.STRAGGLER and d.decision.action in _OBSERVING],
                                       relaunching=plan.relaunch)
    attempt = len(launches) - 1
    exited = _first_abnormal_exit(run_dir, attempt)
    detected, by = exited if exited is not None and exited[0] <= analyzed else (
        analyzed, f"the analysis of attempt {attempt} raised {len(plan.decided)} new incident(s)")
    return replace(plan, advice=advice, advice_notes=notes, detected_wall_ns=detected, detected_by=by,
                   decided_wall_ns=time.time_ns())


_OBSERVING = frozenset({Action.OBSERVE, Action.QUARANTINE})
"""Decisions that leave the running job alone: a straggler decided so gets replace advice."""


def _first_abnormal_exit(run_dir: Path, attempt: int) -> tuple[int, str] | None:
    """The launcher's earliest exit record (<run>/live/exit-<r>.json) of `attempt` for a rank that ended abnormally
    (an exit code other than 0, or a signal): (when the launcher saw it, in words). None when there is none; a
    record that cannot be read is passed over (the analysis' end is the detection then)."""
    seen: list[tuple[int, str]] = []
    for path in RunDir(run_dir).live.glob(f"{EXIT_RECORD_PREFIX}*{EXIT_RECORD_SUFFIX}"):
        try:
            rec = parse_exit_record(json.loads(path.read_text()), str(path))
        except (OSError, ValueError):
            continue
        if rec.attempt != attempt or (rec.signal is None and rec.exit_code in (None, 0)):
            continue
        how = f"signal {rec.signal}" if rec.signal is not None else f"exit code {rec.exit_code}"
        seen.append((rec.wall_ns, f"the launcher saw rank {rec.rank} of attempt {attempt} end ({how})"))
    return min(seen) if seen else None


def localize_attempts(run_dir: Path, incidents: Sequence[Incident]) -> tuple[Localization, ...]:
    """Localization across this run's attempts (`analytics.localize`, one observation per attempt on the placement
    it ran with): the incidents earlier recoveries acted on (their records keep them) and `incidents` (new ones).
    A fault that recurs attempt after attempt follows the device when it stayed with one GPU under different rank
    numbers. Incidents without an attempt are left out."""
    run_dir = Path(run_dir)
    seen: dict[str, Incident] = {}
    for rec in read_recovery_records(run_dir):
        for d in rec.decisions:
            if d.incident_doc is not None:
                try:
                    inc = Incident.from_dict(dict(d.incident_doc))
                except ValueError as exc:
                    raise ValueError(f"{rec.path}: {exc}") from None
                seen[inc.id] = inc
    seen.update((i.id, i) for i in incidents)
    by_attempt: dict[int, list[Incident]] = {}
    for inc in seen.values():
        if inc.attempt is not None:
            by_attempt.setdefault(inc.attempt, []).append(inc)
    if len(by_attempt) < 2:
        return ()  # one attempt's incidents cannot recur
    store = open_run(run_dir)
    try:
        topo, grouped = placed_topology(run_dir, attempt_topology(store.con)), groups(store.con)
    except duckdb.Error as exc:
        raise read_error(exc, telemetry_dir(run_dir)) from None
    attempts = sorted(int(a) for a in topo["attempt"].unique())
    return localize([RunObservation(run=f"{run_dir}#attempt-{a}", attempt=a, incidents=tuple(by_attempt.get(a, ())),
                                    topology=topo.filter(pl.col("attempt") == a), groups=grouped) for a in attempts])


# ---------------------------------------------------------------------------------------------------------- apply


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryRecord:
    """What one recovery did, as written to <run>/recovery/<id>.json."""

    id: str
    plan: RecoveryPlan
    evidence: tuple[Path, ...]
    quarantined: tuple[str, ...]
    retired: tuple[str, ...]
    """Checkpoint directories moved out of the catalog (as '<old name> -> <new name>')."""
    relaunch: LaunchResult | None
    outcome: str
    refused: str = ""
    """Why the relaunch was refused (outcome relaunch_refused): what the quarantine list leaves no room for."""
    world_size: int | None = None
    """The relaunch's world size where a declared membership change made it differ from the job's (`continue_on`)."""

    @property
    def ok(self) -> bool:
        return self.outcome != Outcome.RELAUNCH_REFUSED and (self.relaunch is None or self.relaunch.ok)


class Outcome(StrEnum):
    OBSERVED = "observed"
    QUARANTINED = "quarantined"
    RECOVERED = "recovered"
    RELAUNCH_FAILED = "relaunch_failed"
    RELAUNCH_REFUSED = "relaunch_refused"
    """Nothing left to place the job on off the quarantine list, or a crash loop (`MAX_FAILED_RELAUNCHES`): not
    relaunched."""


MAX_FAILED_RELAUNCHES = 5
"""`apply` refuses to relaunch after this many recoveries in a row whose relaunch failed: a fault that comes back
every attempt and that nothing localized is a crash loop, and a person must look (torchrun's --max-restarts)."""


def _failed_in_a_row(run_dir: Path) -> int:
    """How many of the latest recovery records, in a row, relaunched and failed."""
    n = 0
    for rec in reversed(read_recovery_records(run_dir)):
        if rec.outcome != Outcome.RELAUNCH_FAILED:
            break
        n += 1
    return n


def _quarantine(run_dir: Path, plan: RecoveryPlan, rid: str) -> tuple[str, ...]:
    entries = list(quarantined(run_dir))
    have = {(e.kind, e.id) for e in entries}
    book = Lineage(lineage_path(run_dir))
    done = []
    for target, incident_id in plan.quarantines:
        if (str(target.kind), target.id) in have:
            continue
        entries.append(QuarantineEntry(kind=str(target.kind), id=target.id, incident=incident_id, recovery=rid,
                                       wall_ns=time.time_ns()))
        device = target.id if target.kind is TargetKind.DEVICE else None
        book.append(NewEntry(kind=LineageKind.DEVICE_QUARANTINED, verdict=LineageVerdict.identical(
            "the running job is unchanged; a later placement off it records device_replaced"),
            details=Details(old_device=device, subject=None if device else str(target),
                            text=f"{rid}: quarantine {target} for incident {incident_id}")))
        done.append(str(target))
    write_quarantine(run_dir, entries)
    return tuple(done)


def _retire(run_dir: Path, checkpoint: CheckpointRef | None, rid: str) -> tuple[str, ...]:
    """Move committed checkpoints newer than `checkpoint` (all of them from step 0) and every partial one out of
    the catalog's names; they stay on disk as evidence, named with their verified verdict (a shard whose SHA-256 no
    longer matches is labelled corrupt, not committed)."""
    root = RunDir(run_dir).checkpoints
    moved = []
    for c in list_checkpoints(run_dir, verify=True):
        newer = checkpoint is None or c.step > checkpoint.step
        if c.verdict is Verdict.PARTIAL or (newer and c.path.name != getattr(checkpoint, "id", None)):
            name = f".retired-{checkpoint_id(c.step)}-{c.verdict}-{rid}"
            os.rename(c.path, root / name)
            moved.append(f"{c.path.name} -> {name}")
    return tuple(moved)


def apply(
    cfg: Job,
    plan: RecoveryPlan,
    *,
    launcher: Callable[..., LaunchResult],
    keep_faults: bool = False,
    max_failed_relaunches: int = MAX_FAILED_RELAUNCHES,
    say: Callable[[str], None] = lambda _: None,
    **launch_kw: Any,
) -> RecoveryRecord:
    """Carry out `plan` on the run of `cfg`: evidence for every incident acted on, quarantines (list + lineage),
    then for a restart: retire what the rollback passes over, record a restart from step 0 in lineage when there is
    no checkpoint (a resume records its own), and relaunch through `launcher` — behind the consistency gate when
    resuming (the job's `relaunched` config: the injected faults are not re-injected unless `keep_faults`, they stood
    for a transient fault; the machine's own, which a relaunch meets again wherever it is placed, stay)."""
    run_dir = Path(cfg.run_dir)
    rid = next_recovery_id(run_dir)
    acted = [d for d in plan.decided if plan.relaunch or d.decision.action is not Action.OBSERVE
             or any(a.action is Action.QUARANTINE for a in d.decision.also)]
    ckpts = [c.path.name for c in list_checkpoints(run_dir, verify=False)]
    evidence = []
    for d in acted:
        b = preserve_evidence(run_dir, incident_id=d.incident.id, ranks=d.incident.ranks, checkpoint_ids=[
            c.removeprefix(".").removesuffix(".tmp") for c in ckpts],
            note=f"{rid}: {d.decision.action}: {' | '.join(d.decision.path)}")
        evidence.append(b.path)
        say(f"{rid}: evidence for {d.incident.id}: {len(b.files)} file(s) in {b.path}")
    done = _quarantine(run_dir, plan, rid) if plan.quarantines else ()
    for q in done:
        say(f"{rid}: quarantined {q} (every later launch of this run is placed off it)")
    retired: tuple[str, ...] = ()
    result: LaunchResult | None = None
    refused = ""
    again = cfg
    if plan.relaunch:
        retired = _retire(run_dir, plan.checkpoint, rid)
        for r in retired:
            say(f"{rid}: retired checkpoint {r}")
        again = cfg.relaunched(checkpoint=None if plan.checkpoint is None else plan.checkpoint.id,
                               keep_faults=keep_faults, replay_basis=replay_basis(plan))
        try:
            if (failures := _failed_in_a_row(run_dir)) >= max_failed_relaunches:
                raise ValueError(f"crash loop: the last {failures} relaunches failed, and nothing localized the fault "
                                 f"to take out of placement; not relaunching again (the evidence is kept)")
            again = place_off_quarantine(run_dir, again, say=lambda m: say(f"{rid}: {m}"))
            if plan.reshuffle:
                again = reshuffled(run_dir, again, plan.reshuffle, say=lambda m: say(f"{rid}: {m}"))
        except ValueError as exc:
            refused = f"{exc}"
        if plan.checkpoint is None and not refused:
            _record_restart(run_dir, rid, cfg, again)
        if refused:
            say(f"{rid}: relaunch refused: {refused}")
            outcome = Outcome.RELAUNCH_REFUSED
        else:
            say(f"{rid}: relaunching {again.world_size} ranks from "
                f"{plan.checkpoint.id if plan.checkpoint else 'step 0'}")
            result = launcher(again, **launch_kw)
            outcome = Outcome.RECOVERED if result.ok else Outcome.RELAUNCH_FAILED
    else:
        outcome = Outcome.QUARANTINED if done else Outcome.OBSERVED
    resized = again.world_size if again.world_size != cfg.world_size and result is not None else None
    record = RecoveryRecord(id=rid, plan=plan, evidence=tuple(evidence), quarantined=done, retired=retired,
                            relaunch=result, outcome=str(outcome), refused=refused if plan.relaunch else "",
                            world_size=resized)
    write_recovery_record(run_dir, rid, _record_json(record))
    return record


def _record_restart(run_dir: Path, rid: str, before: Job, after: Job) -> None:
    """Lineage of a relaunch from step 0 (a resume records its own): RESTART, identical unless the world changed
    (a declared membership change: CHANGED, with the new world size), and the steps trained again."""
    last = last_completed_step(run_dir, before_attempt=len(_launches(run_dir)))
    book = Lineage(lineage_path(run_dir))
    if after.world_size == before.world_size:
        verdict = LineageVerdict.identical("same layout, devices, code and seed from step 0")
    else:
        verdict = LineageVerdict.changed(ChangeReason.BATCH_COMPOSITION, ChangeReason.ORDERING, note=(
            f"world {before.world_size} -> {after.world_size}, layout {before.layout} -> {after.layout}"))
    book.append(NewEntry(kind=LineageKind.RESTART, verdict=verdict, details=Details(
        from_step=last, to_step=0, text=f"{rid}: restart from step 0 (no clean committed checkpoint)")))
    if after.world_size != before.world_size:
        book.append(NewEntry(kind=LineageKind.WORLD_SIZE_CHANGE, verdict=verdict, details=Details(
            old_world_size=before.world_size, new_world_size=after.world_size,
            text=f"{rid}: the job declared {before.declaration().membership}; it goes on with {after.world_size} "
                 f"of {before.world_size} ranks")))
    if last is not None:
        # on another world the steps trained again are not the same steps (batch composition, reduction order)
        book.append(NewEntry(kind=LineageKind.REPLAYED_DATA_RANGE, verdict=verdict,
                             details=Details(from_step=0, to_step=last + 1, text=f"steps 0..{last} are trained again")))


def write_plan(run_dir: Path, plan: RecoveryPlan) -> Path:
    """Write a plan decided but not carried out to `<run>/recovery/dry-run.json` (replacing the previous one), in a
    recovery record's shape with outcome `proposed`, for the dashboard and the post-mortem: what the manager would
    do, and why. Never read as a recovery that happened (`base.rundir.read_recovery_records`)."""
    doc = _record_json(RecoveryRecord(id="dry-run", plan=plan, evidence=(), quarantined=(), retired=(), relaunch=None,
                                      outcome="proposed"))
    return write_recovery_record(run_dir, "dry-run", doc)


def replay_basis(plan: RecoveryPlan) -> int | None:
    """The step from which the attempts a relaunch replaces stop being a replay reference: the earliest step a state
    fault it undoes (corruption, divergence) may have begun at — after its last good fingerprint, else its onset,
    else just past the checkpoint resumed from. None when it undoes none."""
    steps = []
    for d in plan.decided:
        inc = d.incident
        if inc.klass not in (IncidentClass.CORRUPTION, IncidentClass.DIVERGENCE):
            continue
        if inc.last_good_step is not None:
            steps.append(inc.last_good_step + 1)
        elif inc.onset_step is not None:
            steps.append(inc.onset_step)
        else:
            steps.append(plan.checkpoint.step + 1 if plan.checkpoint is not None else 0)
    return min(steps) if steps else None


def _record_json(r: RecoveryRecord) -> dict[str, Any]:
    p = r.plan
    return {
        "id": r.id,
        "wall_ns": time.time_ns(),
        "incidents": [d.incident.id for d in p.decided],
        "action": str(p.action),
        "checkpoint": None if p.checkpoint is None else p.checkpoint.id,
        "decisions": [{
            "incident": d.incident.id, "class": str(d.incident.klass), "subject": str(d.incident.subject),
            "incident_doc": d.incident.to_dict(), "action": str(d.decision.action),
            "target": None if d.decision.target is None else str(d.decision.target),
            "path": list(d.decision.path), "reasons": list(d.decision.reasons),
            "lineage": {"comparability": str(d.decision.lineage.comparability),
                        "changed": [str(c) for c in d.decision.lineage.changed]},
        } for d in p.decided],
        "escalations": list(p.escalations),
        "skipped": list(p.skipped),
        "reshuffle": list(p.reshuffle),
        "detected_wall_ns": p.detected_wall_ns,
        "detected_by": p.detected_by or None,
        "decided_wall_ns": p.decided_wall_ns,
        "advice": [a.to_dict() for a in p.advice],
        "advice_notes": list(p.advice_notes),
        "evidence": [str(e) for e in r.evidence],
        "quarantined": list(r.quarantined),
        "retired": list(r.retired),
        "relaunch": None if r.relaunch is None else {"exit_codes": list(r.relaunch.exit_codes),
                                                     "duration_s": round(r.relaunch.duration_s, 3)},
        "outcome": r.outcome,
        "refused": r.refused or None,
        "world_size": r.world_size,
    }


# ------------------------------------------------------------------------------------------------------ supervise


@dataclass(frozen=True, kw_only=True, slots=True)
class Supervised:
    first: LaunchResult
    records: tuple[RecoveryRecord, ...]
    final: LaunchResult
    stopped: str
    """Why supervision ended, one line."""

    @property
    def ok(self) -> bool:
        return self.final.ok


def supervise(
    cfg: Job,
    *,
    launcher: Callable[..., LaunchResult],
    max_recoveries: int = 3,
    job: JobDeclaration | None = None,
    recurrence: Mapping[IncidentClass, RecurrenceView] | None = None,
    say: Callable[[str], None] = lambda _: None,
    **launch_kw: Any,
) -> Supervised:
    """Launch the job through `launcher` and recover it until an attempt ends with nothing new to act on, or
    `max_recoveries`. `job`: the declaration the policy decides with (default: the job's own)."""
    if max_recoveries < 0:
        raise ValueError(f"max_recoveries {max_recoveries}: must be >= 0")
    first = result = launcher(cfg, **launch_kw)
    records: list[RecoveryRecord] = []
    while True:
        plan = assess(Path(cfg.run_dir), layout=cfg.layout, job=job or cfg.declaration(), recurrence=recurrence)
        for line in plan.lines():
            say(line)
        if not plan.relaunch:
            if plan.quarantines:
                records.append(apply(cfg, plan, launcher=launcher, say=say, **launch_kw))
            stopped = ("attempt completed" if result.ok else
                       "attempt failed and no incident explains it: not retried blind")
            break
        if len(records) >= max_recoveries:
            stopped = f"gave up after {max_recoveries} recoveries"
            break
        rec = apply(cfg, plan, launcher=launcher, say=say, **launch_kw)
        records.append(rec)
        if rec.relaunch is None:  # placement refused: nothing left off the quarantine list
            stopped = f"{rec.id}: relaunch refused (nothing left to place the job on off the quarantine list)"
            break
        result = rec.relaunch
        if not result.ok and not _trained(Path(cfg.run_dir)):
            stopped = f"{rec.id}: relaunch failed before training (the consistency gate refused, or nothing loads)"
            break
    return Supervised(first=first, records=tuple(records), final=result, stopped=stopped)


def _trained(run_dir: Path) -> bool:
    """True when the latest attempt completed at least one step (its rows in the steps telemetry)."""
    attempt = len(_launches(run_dir)) - 1
    root = partition_dir(run_dir, Table.STEPS, 0).parent
    for part in root.glob("*/part-*.parquet"):
        try:
            attempts = pq.read_table(part, columns=[str(Steps.ATTEMPT)]).column(0).to_pylist()
        except Exception:  # a part cut short by a killed rank: the other parts decide
            continue
        if attempt in attempts:
            return True
    return False


# ------------------------------------------------------------------------------------------- a decision message


Planner = Callable[[Path, Job, AlertMessage], RecoveryPlan]
"""(run dir, the job's config, the decision message) -> the plan `apply` carries out."""


def plan_from_message(run_dir: Path, cfg: Job, message: AlertMessage) -> RecoveryPlan:
    """The manager's own policy on the message's incident alone (no analysis of the run): what a quarantine-only
    decision applies while the job runs on, and the planner for tests with no telemetry."""
    plan = plan_recovery([message.incident], job=cfg.declaration(), catalog=catalog_view(Path(run_dir), cfg.layout))
    return replace(plan, decided_wall_ns=time.time_ns())


def plan_live(run_dir: Path, cfg: Job, message: AlertMessage) -> RecoveryPlan:
    """After the attempt ended: `assess` the run (post-hoc analysis, new incidents only), with the message's
    incident among them when that reading did not raise it (the live window saw the fault before the telemetry
    showed it to the post-hoc reading, or the stop cut it short) — no incident of its class about its subject — and
    no recovery has handled it yet and it belongs to the latest attempt, so a job the service stopped is not left
    stopped for want of a second sighting. (The live and the post-hoc readings may give one fault different ids:
    their onset steps can differ.)"""
    run_dir = Path(run_dir)
    inc = message.incident
    latest = len(read_launches(run_dir)) - 1
    return assess(run_dir, layout=cfg.layout, job=cfg.declaration(), also=() if inc.attempt is not None and inc.attempt < latest else (inc,))


def covering(run_dir: Path, incident_id: str) -> str | None:
    """The recovery that acted on `incident_id`, if one did (a record that cannot be read is passed over: the live
    loop goes on)."""
    for rec in read_recovery_records(run_dir, damaged=[]):
        if incident_id in rec.incidents:
            return rec.path.stem
    return None


def latest_recovery(run_dir: Path) -> str | None:
    paths = recovery_record_paths(run_dir)
    return paths[-1].stem if paths else None
