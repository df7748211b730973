"""What is not in the telemetry, read from the run's own files for a reader: the recovery manager's decisions (its
records and the dry-run plan), the incidents only those records carry, the lineage and the quarantine list. A file
that cannot be read is a `RunDirError` naming it (the run directory's readers, `base.rundir`, say what is wrong)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import Incident
from rankwatch.base.rundir import RecoveryRecordDoc, RunDir, RunFileError, read_quarantine, read_recovery_records

_R, _S = "rank", "step"


def _records(run_dir: Path | str, *, dry_run: bool) -> tuple[RecoveryRecordDoc, ...]:
    try:
        return read_recovery_records(run_dir, dry_run=dry_run)
    except RunFileError as exc:
        raise RunDirError(str(exc)) from None


_DECISION_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {"record": pl.String, "status": pl.String, "wall_ns": pl.Int64, "incident": pl.String,
                    "class": pl.String, "subject": pl.String, "action": pl.String, "target": pl.String,
                    "path": pl.List(pl.String), "reasons": pl.List(pl.String), "comparability": pl.String,
                    "changed": pl.List(pl.String), "outcome": pl.String, "plan_action": pl.String,
                    "checkpoint": pl.String}


def decisions(run_dir: Path | str) -> pl.DataFrame:
    """Every decision the recovery manager recorded for the run, oldest first: per incident its action and target,
    its path through the recovery gates and the reasons, the lineage verdict, and the record's outcome. Status is
    `applied` for a recovery carried out (`recovery-*.json`) and `proposed` for a dry-run plan (`dry-run.json`)."""
    rows = []
    for rec in _records(run_dir, dry_run=True):
        status = "proposed" if rec.proposed else "applied"
        for d in rec.decisions:
            rows.append({
                "record": rec.id, "status": status, "wall_ns": rec.wall_ns, "incident": d.incident, "class": d.klass,
                "subject": d.subject, "action": d.action, "target": d.target, "path": list(d.path),
                "reasons": list(d.reasons), "comparability": d.comparability, "changed": list(d.changed),
                "outcome": rec.outcome or status, "plan_action": rec.action, "checkpoint": rec.checkpoint})
    return pl.DataFrame(rows, schema=_DECISION_SCHEMA).sort("wall_ns", nulls_last=True)


def recorded_incidents(run_dir: Path | str) -> tuple[Incident, ...]:
    """Incidents the recovery records carry (the live loop's, which the run's own analysis may not hold)."""
    out: dict[str, Incident] = {}
    for rec in _records(run_dir, dry_run=False):
        for d in rec.decisions:
            if d.incident_doc:
                try:
                    inc = Incident.from_dict(dict(d.incident_doc))
                except ValueError as exc:
                    raise RunDirError(f"{rec.path}: {exc}") from None
                out.setdefault(inc.id, inc)
    return tuple(out.values())


_LINEAGE_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {"seq": pl.Int64, "time_ns": pl.Int64, "kind": pl.String, "comparability": pl.String,
                   "reasons": pl.List(pl.String), "note": pl.String, "attempt": pl.Int64, "details": pl.String}


def lineage(run_dir: Path | str) -> pl.DataFrame:
    """The run's lineage entries (`<run>/lineage.jsonl`) in order: kind, comparability verdict and its reasons, the
    note, and the details as JSON. Reading only: `rankwatch lineage RUN` verifies the hash chain."""
    path = RunDir(Path(run_dir)).lineage
    rows = []
    if path.exists():
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise RunDirError(f"{path}: unreadable ({exc})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                v = e["verdict"]
                rows.append({"seq": int(e["seq"]), "time_ns": int(e["time_ns"]), "kind": str(e["kind"]),
                             "comparability": str(v["comparability"]), "reasons": [str(r) for r in v["reasons"]],
                             "note": str(v.get("note") or ""), "attempt": (e.get("details") or {}).get("attempt"),
                             "details": json.dumps(e.get("details") or {}, sort_keys=True)})
            except (ValueError, KeyError, TypeError) as exc:
                raise RunDirError(f"{path}: line {n} is not a lineage entry ({type(exc).__name__}: {exc})") from None
    return pl.DataFrame(rows, schema=_LINEAGE_SCHEMA)


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparability:
    """Whether the run's trajectory stayed what an uninterrupted run would have been."""

    bitwise: bool
    """Every lineage entry expects a bitwise-identical trajectory and no replay was found nondeterministic."""
    entries: int
    changed: tuple[str, ...]
    """One line per entry that changed the trajectory: its kind and reasons."""
    replay_mismatches: int
    """Replay-divergence incidents: a replayed step that ended in another state."""

    def line(self) -> str:
        if not self.entries:
            return "no lineage entries: the run was never interrupted, replayed or changed"
        if self.bitwise:
            return f"comparable: all {self.entries} lineage entries expect a bitwise-identical trajectory"
        why = "; ".join(self.changed) or f"{self.replay_mismatches} replayed step(s) ended in another state"
        return f"CHANGED: {why}"


def comparability(run_dir: Path | str, incidents: Sequence[Incident] = ()) -> Comparability:
    lin = lineage(run_dir)
    changed = tuple(f"#{r['seq']} {r['kind']}: {', '.join(r['reasons']) or r['note']}"
                    for r in lin.iter_rows(named=True) if r["comparability"] != "bitwise_identical_expected")
    replay = sum(1 for i in incidents if str(i.cause) == "nondeterministic_replay")
    return Comparability(bitwise=not changed and not replay, entries=lin.height, changed=changed,
                         replay_mismatches=replay)


def quarantine(run_dir: Path | str) -> pl.DataFrame:
    """The run's quarantine list (`<run>/quarantine.json`): kind, id, and why."""
    schema = {"kind": pl.String, "id": pl.String, "reason": pl.String}
    try:
        entries = read_quarantine(run_dir)
    except RunFileError as exc:
        raise RunDirError(str(exc)) from None
    return pl.DataFrame([{"kind": e.kind, "id": e.id, "reason": e.incident} for e in entries], schema=schema)
