"""A run on the wall clock: its steps as the job saw them, each interruption with the marks its records carry, and its
checkpoint saves and loads. What `analytics.goodput` cuts into parts and `analytics.costs` averages across runs.

    timeline(run_dir) -> Timeline

* Steps (`StepSlice`): step s of an attempt ends at the latest rank's end of s and begins at the latest rank's end of
  the step before it (the attempt's first step: at the earliest rank's start), so time between steps (a save outside
  the step, fingerprints) falls in the slice of the step after it. A copy is thrown away (`thrown_by`) when a later
  attempt resumed at or before its step (that attempt's first step in the telemetry, or the lineage's rollback /
  restart).
* Interruptions (`Interruption`): each failed attempt that trained and the next launch, marked in wall ns: the
  failure (the latest of the attempt's last step end, the earliest exception, signal or abnormal exit event of a rank
  the acting incidents name, and a fail-stop's `detection_wall_ns`, its culprit's last sign of life), the detection
  and the decision (the recovery record's `detected_wall_ns` and `decided_wall_ns`; a record written before the
  manager recorded them falls back on the incidents' `detection_wall_ns`, fail-stops aside, and on the record's own
  `wall_ns` where it precedes the relaunch), the relaunch (run.json), every process up (the next attempt's last
  `start` event), the restore's end (its last checkpoint load/verify phase), the gate (its last `recovery` event
  after that) and its first step. A mark the records do not carry is None, with the reason where it is the detection
  or the decision.
* Saves (`SaveCost`): per save, the largest rank's phase time that blocked training and that ran beside it: a phase
  overlapping a step its rank started after the save began ran beside training (an asynchronous save's write); the
  others blocked it. Loads: per load, the largest rank's load and verify phase time.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import duckdb

from rankwatch.analytics.errors import NoDataError, RunDirError
from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.base.rundir import RecoveryRecordDoc, RunFileError, read_launches, read_recovery_records, run_dir_problem
from rankwatch.base.schema import CheckpointPhase, EventKind, LineageKind, Table

__all__ = ["Interruption", "SaveCost", "SaveMode", "StepSlice", "Timeline", "timeline"]

_SAVE_PHASES = frozenset(str(p) for p in (CheckpointPhase.SNAPSHOT, CheckpointPhase.SERIALIZE, CheckpointPhase.WRITE,
                                          CheckpointPhase.FSYNC, CheckpointPhase.PUBLISH))
_RESTORE_PHASES = frozenset(str(p) for p in (CheckpointPhase.LOAD, CheckpointPhase.VERIFY))
_TERMINAL = frozenset(str(k) for k in (EventKind.EXCEPTION, EventKind.SIGNAL, EventKind.EXIT))
_ASYNC_SHARE = 0.25
"""A save is asynchronous when at least this share of its phase time ran beside training on some rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Interruption:
    """One failed attempt and the attempt that trained next, with the marks the records carry (wall ns)."""

    failed_attempt: int
    resumed_attempt: int | None
    """The next attempt that completed a step; None when none did (the run ends failed)."""
    recovery: str | None
    """The recovery record that relaunched it (None: no record covers this relaunch)."""
    action: str | None
    """That record's action (restart_job, rollback_domain, ...)."""
    last_step_end_ns: int
    """The failed attempt's last step end (any rank)."""
    failure_ns: int
    """The latest of `last_step_end_ns`, the earliest exception, signal or abnormal exit of a rank the acting
    incidents name, and a fail-stop's culprit's last sign of life."""
    detected_ns: int | None
    """The recovery record's `detected_wall_ns`, else the acting incidents' earliest `detection_wall_ns` (fail-stops
    aside), where it lies after the failure and before the relaunch."""
    detected_by: str
    """What the detection was (the record's `detected_by`), where there is a record."""
    detection_why: str
    """Why `detected_ns` is None (empty where it is not)."""
    stopped_ns: int
    """The failed attempt's last sign of life: its newest event or step end."""
    decided_ns: int | None
    """The recovery record's `decided_wall_ns`, else its `wall_ns` where it was written before the relaunch."""
    decision_why: str
    """Why `decided_ns` is None (empty where it is not)."""
    relaunched_ns: int | None
    """`started_wall_ns` of the first launch after the failed attempt."""
    up_ns: int | None
    """The resumed attempt's last `start` event."""
    restored_ns: int | None
    """The end of its last checkpoint load/verify phase."""
    gated_ns: int | None
    """Its last `recovery` event after the restore (the consistency gate's outcome)."""
    training_ns: int | None
    """The resumed attempt's first step start."""
    resumed_step: int | None
    """The first step the resumed attempt trained."""
    lost_steps: int
    """Step copies of earlier attempts this resume threw away."""
    lost_s: float
    """Their slices, with the step in progress at the failure."""

    @property
    def restore_s(self) -> float | None:
        """From the failure to training again (detection, decision, relaunch, restore, gate): the lost work aside."""
        return None if self.training_ns is None else (self.training_ns - self.failure_ns) / 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveCost:
    """One checkpoint save as the job saw it."""

    checkpoint_id: str
    attempt: int
    step: int
    mode: SaveMode | None
    """None: nothing trained after it, so whether it blocked training cannot be told."""
    blocking_s: float
    """Largest over ranks of its phase time that blocked training (module docstring, CHECKPOINT)."""
    background_s: float
    """Largest over ranks of its phase time beside training: steps its rank started after the save began overlap
    it (an asynchronous save's write)."""
    started_ns: int
    """Its first phase start (any rank)."""
    committed: bool
    """A publish phase succeeded and no phase failed."""


class SaveMode(StrEnum):
    """How a save met training: SYNC blocked it whole; ASYNC ran at least `_ASYNC_SHARE` of its phase time beside
    it."""

    SYNC = "sync"
    ASYNC = "async"


# ------------------------------------------------------------------------------------------------------- queries


def _job_steps(con: duckdb.DuckDBPyConnection) -> list[tuple[int, int, int, int]]:
    """(attempt, step, earliest rank's start, latest rank's end) of every step of every attempt, in order."""
    return [tuple(int(x) for x in r) for r in con.execute(  # type: ignore[misc]
        "SELECT attempt, step, min(start_wall_ns), max(end_wall_ns) FROM steps "
        "GROUP BY attempt, step ORDER BY attempt, step").fetchall()]


def _rank_steps(con: duckdb.DuckDBPyConnection) -> dict[int, list[tuple[int, int]]]:
    """Every step of each rank as (start, end) wall ns, in start order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rank, start, end in con.execute(
            "SELECT rank, start_wall_ns, end_wall_ns FROM steps ORDER BY rank, start_wall_ns").fetchall():
        out.setdefault(int(rank), []).append((int(start), int(end)))
    return out


@dataclass(frozen=True, slots=True)
class _Phase:
    """One checkpoint phase of one rank (wall ns)."""

    rank: int
    step: int
    checkpoint_id: str
    phase: str
    start_ns: int
    end_ns: int
    ok: bool


def _checkpoint_phases(con: duckdb.DuckDBPyConnection) -> list[_Phase]:
    """Every checkpoint phase of every rank, in start order."""
    if Table.CHECKPOINT_PHASES not in _tables(con):
        return []
    return [_Phase(int(r), int(s), str(c), str(p), int(a), int(b), bool(ok)) for r, s, c, p, a, b, ok in con.execute(
        "SELECT rank, step, checkpoint_id, phase, start_wall_ns, end_wall_ns, ok FROM checkpoint_phases "
        "ORDER BY start_wall_ns").fetchall()]


@dataclass(frozen=True, slots=True)
class _Event:
    attempt: int
    rank: int
    kind: str
    wall_ns: int
    exit_code: int | None


def _attempt_events(con: duckdb.DuckDBPyConnection) -> list[_Event]:
    """Every event but heartbeats, in time order."""
    if Table.EVENTS not in _tables(con):
        return []
    return [_Event(int(a), int(r), str(k), int(w), None if x is None else int(x)) for a, r, k, w, x in con.execute(
        f"SELECT attempt, rank, kind, wall_ns, exit_code FROM events WHERE kind <> '{EventKind.HEARTBEAT}' "
        "ORDER BY wall_ns").fetchall()]


def _last_seen(con: duckdb.DuckDBPyConnection) -> dict[int, int]:
    """Per attempt, the newest time anything was heard from it (an event, heartbeats included, or a step end)."""
    parts = ["SELECT attempt, max(end_wall_ns) AS t FROM steps GROUP BY attempt"]
    if Table.EVENTS in _tables(con):
        parts.append("SELECT attempt, max(wall_ns) AS t FROM events GROUP BY attempt")
    return {int(a): int(t) for a, t in con.execute(
        f"SELECT attempt, max(t) FROM ({' UNION ALL '.join(parts)}) GROUP BY attempt").fetchall() if t is not None}


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}


# ------------------------------------------------------------------------------------------------------ timeline


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSlice:
    """One step of one attempt as the job saw it."""

    attempt: int
    step: int
    start_ns: int
    """The latest rank's end of the attempt's step before it (its first step: the earliest rank's start)."""
    end_ns: int
    thrown_by: int | None
    """The first later attempt that resumed at or before this step (this copy is lost work); None: it counts."""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """A run's steps, interruptions and saves on the wall clock (`timeline`)."""

    run_dir: Path
    started_ns: int
    """Launch 0's `started_wall_ns` (the first step's start where that is earlier: another host's clock)."""
    ended_ns: int
    """The last step end."""
    ranks: int
    attempts: int
    """Launches in run.json, and attempts only the telemetry has."""
    launched: int
    """Launches in run.json."""
    declared_steps: int | None
    """The step count the latest launch declares (run.json's "steps"); None where it declares none."""
    slices: tuple[StepSlice, ...]
    startup_s: float
    """Launch 0 to its first step start."""
    interruptions: tuple[Interruption, ...]
    saves: tuple[SaveCost, ...]
    loads: tuple[tuple[int, float], ...]
    """Each checkpoint load as (attempt, seconds): the largest rank's load and verify phase time."""
    checkpoint_s: float
    """Blocking save time inside counted slices."""
    warnings: tuple[str, ...]

    def counted_s(self, attempt: int | None = None) -> float:
        return sum(s.seconds for s in self.slices if s.thrown_by is None and attempt in (None, s.attempt))


def _launches(run: Path) -> list[dict[str, Any]]:
    try:
        launches = read_launches(run)
    except RunFileError as exc:
        raise RunDirError(str(exc)) from None
    if not launches:
        raise RunDirError(f"{run / 'run.json'}: no launch recorded")
    if not isinstance(launches[0].get("started_wall_ns"), int):
        raise RunDirError(f"{run / 'run.json'}: launch 0 has no started_wall_ns: the run's start is unknown")
    return launches


def _records(run: Path) -> tuple[RecoveryRecordDoc, ...]:
    try:
        return read_recovery_records(run)
    except RunFileError as exc:
        raise RunDirError(str(exc)) from None


def _lineage_resumes(run: Path, launch_ns: Sequence[int | None]) -> dict[int, int]:
    """attempt -> the step it resumed at, as the lineage says: a ROLLBACK's `to_step` for the attempt it names; a
    RESTART's (step 0) for the first launch after the entry (the manager writes it before relaunching)."""
    from rankwatch.analytics.views.records import lineage

    out: dict[int, int] = {}
    for row in lineage(run).iter_rows(named=True):
        kind = row["kind"]
        if kind not in (str(LineageKind.ROLLBACK), str(LineageKind.RESTART)):
            continue
        to_step = json.loads(row["details"]).get("to_step")
        attempt = row["attempt"]
        if attempt is None and kind == str(LineageKind.RESTART):
            attempt = next((a for a, t in enumerate(launch_ns) if t is not None and t >= int(row["time_ns"])), None)
        if isinstance(to_step, int) and attempt is not None:
            out.setdefault(int(attempt), to_step)
    return out


def timeline(run_dir: Path | str) -> Timeline:
    """The run's `Timeline`. `RunDirError` naming the file for a directory that is not a run or a damaged record;
    `NoDataError` when no step completed."""
    from rankwatch.analytics.store import connect

    run = Path(run_dir)
    problem = run_dir_problem(run)
    if problem is not None:
        raise RunDirError(problem)
    launches = _launches(run)
    records = _records(run)
    con = connect(run)
    try:
        if Table.STEPS not in _tables(con) or not (rows := _job_steps(con)):
            raise NoDataError(f"{run}: no completed step in the telemetry: no training time to measure")
        events = _attempt_events(con)
        seen = _last_seen(con)
        phases = _checkpoint_phases(con)
        rank_steps = _rank_steps(con)
        ranks_seen = int(con.execute("SELECT count(DISTINCT rank) FROM steps").fetchall()[0][0])
    finally:
        con.close()
    warnings: list[str] = []
    launch_ns: list[int | None] = [x if isinstance(x := rec.get("started_wall_ns"), int) else None
                                   for rec in launches]
    started = launches[0]["started_wall_ns"]
    by_attempt: dict[int, list[tuple[int, int, int]]] = {}
    for attempt, step, s, e in rows:
        by_attempt.setdefault(attempt, []).append((step, s, e))
    if max(by_attempt) >= len(launches):
        warnings.append(f"the telemetry has attempt {max(by_attempt)} but run.json records {len(launches)} "
                        "launch(es)")
        launch_ns += [None] * (max(by_attempt) + 1 - len(launches))
    resumed = {a: steps[0][0] for a, steps in by_attempt.items()}
    for a, step in _lineage_resumes(run, launch_ns).items():
        if a in resumed and resumed[a] != step:
            warnings.append(f"the lineage says attempt {a} resumed at step {step}; its first step in the telemetry "
                            f"is {resumed[a]} (the telemetry's is used)")
        resumed.setdefault(a, step)
    slices: list[StepSlice] = []
    for a, steps in sorted(by_attempt.items()):
        prev_end: int | None = None
        for step, s, e in steps:
            begin = s if prev_end is None else prev_end
            thrown = min((b for b, r in resumed.items() if b > a and r <= step), default=None)
            slices.append(StepSlice(attempt=a, step=step, start_ns=begin, end_ns=max(begin, e), thrown_by=thrown))
            prev_end = max(begin, e)
    first = slices[0].start_ns
    if first < started:  # clocks of different hosts: the span starts at the first step, with no start-up
        warnings.append(f"attempt {slices[0].attempt}'s first step starts {(started - first) / 1e9:.3f} s before "
                        "launch 0's started_wall_ns (another host's clock?): the span starts at the first step")
        started = first
    interruptions = _interruptions(by_attempt, launch_ns, records, events, seen, slices, phases, warnings)
    saves = _saves(phases, rank_steps, launch_ns)
    undetermined = [s.checkpoint_id for s in saves if s.mode is None]
    if undetermined:
        warnings.append(f"save(s) {', '.join(undetermined)}: no step trained after them, so whether they blocked "
                        "training cannot be told; left out of the save costs")
    ranks = max([x for rec in launches if isinstance(x := rec.get("world_size"), int)] or [ranks_seen])
    return Timeline(run_dir=run, started_ns=started, ended_ns=max(s.end_ns for s in slices), ranks=ranks,
                     attempts=len(launch_ns), launched=len(launches),
                     declared_steps=x if isinstance(x := launches[-1].get("steps"), int) else None,
                     slices=tuple(slices), startup_s=(first - started) / 1e9,
                     interruptions=tuple(interruptions),
                     saves=tuple(saves), loads=tuple(_loads(phases, launch_ns)),
                     checkpoint_s=_checkpoint_in_counted(saves, slices), warnings=tuple(warnings))


# ------------------------------------------------------------------------------------------------- interruptions


_RELAUNCHED = frozenset({"recovered", "relaunch_failed"})
"""`RecoveryRecordDoc.outcome`s of a record that relaunched the job."""


def _acting(rec: RecoveryRecordDoc) -> list[Incident]:
    """The incidents whose decision was the record's action (a straggler observed beside a fail-stop is not)."""
    out = []
    for d in rec.decisions:
        if d.incident_doc is None or (rec.action is not None and d.action != rec.action):
            continue
        try:
            out.append(Incident.from_dict(dict(d.incident_doc)))
        except ValueError as exc:
            raise RunDirError(f"{rec.path}: {exc}") from None
    return out


def _covering(records: Sequence[RecoveryRecordDoc], failed: int, nth: int) -> RecoveryRecordDoc | None:
    """The recovery record that relaunched after attempt `failed`: the relaunching record acting on an incident of
    that attempt, else the `nth` relaunching record."""
    relaunching = [r for r in records if r.outcome in _RELAUNCHED]
    for r in relaunching:
        if any(i.attempt == failed for i in _acting(r)):
            return r
    return relaunching[nth] if nth < len(relaunching) else None


def _interruptions(by_attempt: Mapping[int, list[tuple[int, int, int]]], launch_ns: Sequence[int | None],
                   records: Sequence[RecoveryRecordDoc], events: Sequence[_Event], seen: Mapping[int, int],
                   slices: Sequence[StepSlice], phases: Sequence[_Phase], warnings: list[str],
                   ) -> list[Interruption]:
    """One `Interruption` per attempt that trained and was followed by another launch."""
    trained = sorted(by_attempt)
    out: list[Interruption] = []
    for k, a in enumerate(trained):
        nxt = trained[k + 1] if k + 1 < len(trained) else None
        if nxt is None and a + 1 >= len(launch_ns):
            break  # the last attempt: its end is the run's end
        last_end = max(e for _, _, e in by_attempt[a])
        rec = _covering(records, a, len(out))
        acting = _acting(rec) if rec is not None else []
        culprits = {r for inc in acting for r in inc.ranks}
        own = [e.wall_ns for e in events if e.attempt == a and e.rank in culprits and e.kind in _TERMINAL
               and (e.kind != str(EventKind.EXIT) or e.exit_code not in (None, 0))]
        # a fail-stop's detection_wall_ns is its culprit's last sign of life (analytics.failstop): a failure mark
        gone = [i.detection_wall_ns for i in acting if i.klass is IncidentClass.FAIL_STOP
                and i.detection_wall_ns is not None]
        failure = max([last_end, *([min(own)] if own else []), *gone])
        relaunched = launch_ns[a + 1] if a + 1 < len(launch_ns) else None
        if rec is None:
            detected, decided, detected_by = None, None, ""
            why_detected = why_decided = f"no recovery record covers the relaunch after attempt {a}"
        else:
            detected, detected_by, why_detected = _detection(rec, acting, failure, relaunched)
            decided, why_decided = _decision(rec, relaunched)
        up = restored = gated = training = resumed_step = None
        if nxt is not None:
            training = min(s for _, s, _ in by_attempt[nxt])
            resumed_step = by_attempt[nxt][0][0]
            lo = launch_ns[nxt] or last_end
            starts = [e.wall_ns for e in events if e.attempt == nxt and e.kind == str(EventKind.START)]
            up = max(starts) if starts else None
            loads = [p.end_ns for p in phases if p.phase in _RESTORE_PHASES and p.start_ns >= lo
                     and p.end_ns <= training]
            restored = max(loads) if loads else None
            if restored is not None:
                gated = max((e.wall_ns for e in events if e.attempt == nxt and e.kind == str(EventKind.RECOVERY)
                             and restored <= e.wall_ns <= training), default=None)
        upto = nxt if nxt is not None else len(launch_ns)
        lost = [s for s in slices if s.thrown_by is not None and a < s.thrown_by <= upto]
        out.append(Interruption(
            failed_attempt=a, resumed_attempt=nxt, recovery=None if rec is None else rec.id,
            action=None if rec is None else rec.action, last_step_end_ns=last_end, failure_ns=failure,
            detected_ns=detected, detected_by=detected_by, detection_why=why_detected,
            stopped_ns=max(seen.get(a, last_end), last_end), decided_ns=decided, decision_why=why_decided,
            relaunched_ns=relaunched, up_ns=up, restored_ns=restored, gated_ns=gated, training_ns=training,
            resumed_step=resumed_step, lost_steps=len(lost),
            lost_s=sum(s.seconds for s in lost) + (0.0 if training is None else (failure - last_end) / 1e9)))
        if training is None:
            warnings.append(f"attempt {a} failed and no later attempt trained: the run ends with it")
    return out


def _detection(rec: RecoveryRecordDoc, acting: Sequence[Incident], failure: int, relaunched: int | None,
               ) -> tuple[int | None, str, str]:
    """The detection mark of the interruption `rec` recovered: (wall ns, what it was, why it is unknown). The
    record's `detected_wall_ns` where the manager recorded it; else the acting incidents' earliest
    `detection_wall_ns`, fail-stops aside (theirs is the culprit's last sign of life: a failure mark). A detection at
    or before the failure mark, or after the relaunch, is no detection time."""
    detected: int | None = rec.detected_wall_ns
    if detected is not None:
        by = rec.detected_by or "recorded by the manager"
        if detected <= failure:
            return None, by, (f"{rec.id} records its detection ({by}) {(failure - detected) / 1e9:.3f} s before the "
                              "failure mark: the fault was seen before its rank stopped; that time is lost work")
    else:
        detected = min((i.detection_wall_ns for i in acting if i.detection_wall_ns is not None
                        and i.klass is not IncidentClass.FAIL_STOP), default=None)
        by = "the incident's detection_wall_ns"
        if detected is None and any(i.klass is IncidentClass.FAIL_STOP for i in acting):
            return None, "", (f"{rec.id}'s fail-stop records its culprit's last sign of life (taken as the failure), "
                              "not when it was detected, and the record carries no detected_wall_ns")
        if detected is None:
            return None, "", f"{rec.id}'s incidents record no detection time, nor the record a detected_wall_ns"
        if detected <= failure:
            return None, by, (f"{rec.id}'s incident records its detection {(failure - detected) / 1e9:.3f} s before "
                              "the failure mark: the time of its evidence, not of a detector reading it")
    if relaunched is not None and detected > relaunched:
        return None, by, f"{rec.id} records its detection after the relaunch"
    return detected, by, ""


def _decision(rec: RecoveryRecordDoc, relaunched: int | None) -> tuple[int | None, str]:
    """The decision mark of the interruption `rec` recovered, and why it is unknown: the record's `decided_wall_ns`,
    else its `wall_ns` where that was written before the relaunch (an older manager wrote it after the relaunch
    ended: no decision time)."""
    if rec.decided_wall_ns is not None:
        if relaunched is not None and rec.decided_wall_ns > relaunched:
            return None, f"{rec.id} records its decision after the relaunch started"
        return rec.decided_wall_ns, ""
    if rec.wall_ns is None:
        return None, f"{rec.id} carries no decided_wall_ns nor wall_ns"
    if relaunched is not None and rec.wall_ns > relaunched:
        return None, (f"{rec.id} carries no decided_wall_ns, and its wall_ns is {(rec.wall_ns - relaunched) / 1e9:.2f} "
                      "s after the relaunch started (the manager writes it when the relaunch ends): no decision time")
    return rec.wall_ns, ""


# --------------------------------------------------------------------------------------------------------- saves


def _attempt_at(t: int, launch_ns: Sequence[int | None]) -> int:
    """The attempt running at wall time `t`: the latest launch started at or before it."""
    return max((a for a, s in enumerate(launch_ns) if s is not None and s <= t), default=0)


def _saves(phases: Sequence[_Phase], rank_steps: Mapping[int, list[tuple[int, int]]],
           launch_ns: Sequence[int | None]) -> list[SaveCost]:
    """Every save (its phases other than load and verify, by attempt and checkpoint id), in time order, with its
    blocking and background time: a phase that overlaps a step its rank started after the save began ran beside
    training; the others blocked it (inside the step that saves, or between steps)."""
    groups: dict[tuple[int, str], list[_Phase]] = {}
    for p in phases:
        if p.phase in _SAVE_PHASES:
            groups.setdefault((_attempt_at(p.start_ns, launch_ns), p.checkpoint_id), []).append(p)
    out = []
    for (attempt, cid), rows in sorted(groups.items(), key=lambda kv: kv[1][0].start_ns):
        blocking: dict[int, int] = {}
        background: dict[int, int] = {}
        trained_after = True
        began: dict[int, int] = {}
        for p in rows:
            began.setdefault(p.rank, p.start_ns)
        for p in rows:
            mine = rank_steps.get(p.rank, [])
            i = bisect.bisect_right(mine, (began[p.rank], 2**63))
            beside = False
            while i < len(mine) and mine[i][0] < p.end_ns:
                beside = beside or mine[i][1] > p.start_ns
                i += 1
            into = background if beside else blocking
            into[p.rank] = into.get(p.rank, 0) + p.end_ns - p.start_ns
            trained_after = trained_after and bool(mine) and mine[-1][0] >= p.end_ns
        total = sum(p.end_ns - p.start_ns for p in rows)
        mode = (SaveMode.ASYNC if total > 0 and sum(background.values()) >= _ASYNC_SHARE * total
                else SaveMode.SYNC if trained_after else None)
        out.append(SaveCost(
            checkpoint_id=cid, attempt=attempt, step=min(p.step for p in rows), mode=mode,
            blocking_s=max(blocking.values(), default=0) / 1e9, background_s=max(background.values(), default=0) / 1e9,
            started_ns=min(p.start_ns for p in rows),
            committed=any(p.phase == str(CheckpointPhase.PUBLISH) and p.ok for p in rows) and all(p.ok for p in rows)))
    return out


def _loads(phases: Sequence[_Phase], launch_ns: Sequence[int | None]) -> list[tuple[int, float]]:
    """Every checkpoint load (its load and verify phases, by attempt and checkpoint id), in time order: (attempt, the
    largest rank's phase time in seconds)."""
    groups: dict[tuple[int, str], dict[int, int]] = {}
    for p in phases:
        if p.phase in _RESTORE_PHASES:
            per_rank = groups.setdefault((_attempt_at(p.start_ns, launch_ns), p.checkpoint_id), {})
            per_rank[p.rank] = per_rank.get(p.rank, 0) + p.end_ns - p.start_ns
    return [(attempt, max(per_rank.values()) / 1e9) for (attempt, _), per_rank in groups.items()]


def _checkpoint_in_counted(saves: Sequence[SaveCost], slices: Sequence[StepSlice]) -> float:
    """Blocking save time inside counted slices: each save in its attempt's slice holding its first phase start,
    at most what is left of the slice."""
    total = 0.0
    left = {(s.attempt, s.step): s.seconds for s in slices}
    for save in saves:
        s = next((s for s in slices if s.attempt == save.attempt and s.start_ns <= save.started_ns < s.end_ns), None)
        if s is None or s.thrown_by is not None:
            continue
        take = max(0.0, min(save.blocking_s, left[(s.attempt, s.step)]))
        left[(s.attempt, s.step)] -= take
        total += take
    return total
