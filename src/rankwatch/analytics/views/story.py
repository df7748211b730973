"""What an on-call reader is told, computed once for the dashboard, the notebook and the CLI: each incident's state
and next step (`incident_states`), a fail-stop told from the kill to the replay (`fail_stop_story`), and times and
durations written for people (`local_time`, `duration`)."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.analytics.views.store import ViewStore
from rankwatch.base.schema import EventKind, ThrottleReason

_R, _S = "rank", "step"


def local_time(wall_ns: int | None) -> str:
    """A wall time as this machine's local time of day, with the date (`2026-12-05 12:24:52`); '—' for none."""
    if wall_ns is None:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_ns / 1e9))


def duration(seconds: float | None) -> str:
    """A duration with its unit, to the precision a reader needs: `40 µs`, `1.5 ms`, `850 ms`, `12.4 s`,
    `3 min 05 s`, `2 h 14 min`."""
    if seconds is None:
        return "—"
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s < 1e-3:
        return f"{sign}{s * 1e6:.0f} µs"
    if s < 1:
        return f"{sign}{s * 1e3:.{1 if s < 0.01 else 0}f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s"
    if s < 3600:
        return f"{sign}{int(s // 60)} min {int(s % 60):02d} s"
    return f"{sign}{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def signal_name(signum: int | None) -> str:
    """`SIGTERM (15)`; a number this platform does not name stays a number."""
    if signum is None:
        return "no signal"
    try:
        return f"{signal.Signals(signum).name} ({signum})"
    except ValueError:
        return f"signal {signum}"


_ACTIONS = {"retry_operation": "retry the operation {id}", "rebuild_group": "rebuild process group {id}",
            "restart_replica": "restart replica {id}", "rollback_domain": "roll {id} back",
            "restart_job": "restart the job", "quarantine": "quarantine {kind} {id}",
            "observe": "observe (leave the job as it is)"}


def action_text(action: str, target: str | None) -> str:
    """A recorded decision (`restart_job`, `checkpoint:step-00000015@15`) in words: `restart the job from
    step-00000015 (step 15)`. An action this version does not know is shown as recorded."""
    kind, _, rest = (target or "").partition(":")
    ident, _, step = rest.partition("@")
    if kind == "checkpoint":
        where = f" from {ident}" + (f" (step {step})" if step else "")
        base = {"restart_job": "restart the job", "rollback_domain": "roll the domain back"}.get(action)
        if base is not None:
            return base + where
    if action == "restart_job":
        return "restart the job from step 0 (no clean committed checkpoint)"
    text = _ACTIONS.get(action)
    if text is None or ("{id}" in text and not ident):
        return action + (f" {target}" if target else "")
    return text.format(kind=kind, id=ident)


def throttle_names(mask: int | None) -> str:
    """NVML clocks-event reason bits by name (`HW_THERMAL_SLOWDOWN`), '|'-joined; 'none' for 0."""
    if mask is None:
        return "—"
    if not mask:
        return "none"
    names = [r.name for r in ThrottleReason if r.name and r.value & mask]
    rest = mask & ~sum(r.value for r in ThrottleReason)
    return "|".join(names + ([hex(rest)] if rest else []))


_MASK = re.compile(r"throttle_reasons=(\d+)")


def readable_text(text: str) -> str:
    """`throttle_reasons=64` in a line written for people, named: `throttle_reasons=HW_THERMAL_SLOWDOWN`."""
    return _MASK.sub(lambda m: f"throttle_reasons={throttle_names(int(m.group(1)))}", text)


def readable(frame: pl.DataFrame) -> pl.DataFrame:
    """A frame of evidence as people read it: wall times (`*wall_ns`, `time_ns`) as local times to the millisecond,
    other nanosecond columns (`*_ns`) as durations with units, throttle bit masks by name, and a missing value as an
    empty cell rather than 'None'."""
    out = []
    for name in frame.columns:
        col = frame[name]
        numeric = col.dtype.is_integer() or col.dtype.is_float()
        if numeric and (name.endswith("wall_ns") or name == "time_ns"):
            col = col.map_elements(lambda v: _clock(int(v)), return_dtype=pl.String, skip_nulls=True)
            name = name.removesuffix("_ns").removesuffix("_wall") or "time"
        elif numeric and name.endswith("_ns"):
            col = col.map_elements(lambda v: duration(v / 1e9), return_dtype=pl.String, skip_nulls=True)
            name = name.removesuffix("_ns")
        elif col.dtype.is_integer() and "throttle" in name:
            col = col.map_elements(lambda v: throttle_names(int(v)), return_dtype=pl.String, skip_nulls=True)
        out.append(col.alias(name))
    frame = pl.DataFrame(out) if out else frame
    return frame.with_columns(pl.col(pl.String).fill_null(""))


def _clock(wall_ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall_ns / 1e9)) + f".{wall_ns // 1_000_000 % 1000:03d}"


_STEP_WORDS = {
    "gate=none": "no consistency gate ran: nothing proves the ranks still agree on step, model, optimizer, RNG and "
                 "data position",
    "gate=agree": "the consistency gate found the ranks agreeing on step, model, optimizer, RNG and data position",
    "gate=disagree": "the consistency gate found ranks that disagree",
    "gate=unknown": "the consistency gate could not run, or not every rank answered",
    "membership=fixed_shapes": "the job's shapes are fixed: no rank can be dropped or swapped in place",
    "membership=spare_replacement": "a spare can take a lost rank's place (world size and layout unchanged)",
    "membership=pure_dp_reconfigurable_batch": "the job is pure data parallel: a replica can be dropped and the "
                                               "batch re-split over the rest",
    "idempotent=idempotent": "the failed operation is declared idempotent",
    "idempotent=not_idempotent": "the failed operation is not idempotent",
    "idempotent=unknown": "the failed operation is not declared idempotent (treated as not)",
    "checkpoint=none": "there is no clean committed checkpoint",
    "recurrence=none": "it has not recurred",
    "input=partial": "part of the telemetry could not be read",
    "hung ranks answered": "the hung ranks answered again",
    "hung ranks silent": "the hung ranks stayed silent",
}


def path_words(path: Sequence[str]) -> tuple[str, ...]:
    """A decision's recorded path through the recovery gates (`gate=none`, `membership=...`, `-> restart job from
    X`), step by step in words; a step this version does not know is kept as recorded."""
    out = []
    for step in path:
        key, _, value = step.partition("=")
        if step in _STEP_WORDS:
            out.append(_STEP_WORDS[step])
        elif step.startswith("->"):
            out.append("so: " + step.removeprefix("->").strip())
        elif key == "class":
            out.append(f"a {value} incident")
        elif key == "checkpoint":
            out.append(f"the newest complete, verified checkpoint is {value}")
        elif key == "recurrence":
            out.append(f"it recurred, following the {value}")
        else:
            out.append(step)
    return tuple(out)


_MARKS = (("red", "#d62728"), ("orange", "#ff7f0e"), ("violet", "#9467bd"), ("blue", "#1f77b4"),
          ("green", "#2ca02c"), ("gray", "#7f7f7f"))
"""(Streamlit's colour name, the same colour for charts): an incident keeps its colour on every page."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mark:
    """An incident's identity across pages: its number in the run (most consequential first) and its colour."""

    label: str
    """`#1`, `#2`, ... in the order the incidents are given (the run's most consequential first)."""
    color: str
    """A Streamlit colour name (`red`), for `:red[...]` text."""
    hex: str
    """The same colour for charts."""


def incident_marks(incidents: Sequence[Incident]) -> dict[str, Mark]:
    """Each incident's mark, by id: numbered in the order given, coloured in turn."""
    return {i.id: Mark(label=f"#{n + 1}", color=_MARKS[n % len(_MARKS)][0], hex=_MARKS[n % len(_MARKS)][1])
            for n, i in enumerate(incidents)}


# -- each incident's state and next step ---------------------------------------------------------------------------

STATES = ("open", "proposed", "recovered", "quarantined", "observed", "failed")
"""An incident's state: `open` (nothing decided), `proposed` (a dry-run plan waits to be applied), `recovered` (a
recovery was applied and its attempt completed), `quarantined` (a quarantine was applied; the job was not touched),
`observed` (the policy leaves the job as it is), `failed` (an applied recovery was refused or its relaunch failed)."""
PENDING = ("open", "proposed", "failed")
"""The states that need a person: nothing decided, a proposal not applied, a recovery that failed."""


def _state(d: dict[str, Any] | None, run_dir: str) -> tuple[str, str, str]:
    """(state, decision, next step) of one incident from its latest decision."""
    if d is None:
        return ("open", "none",
                f"decide: `rankwatch recover {run_dir}` proposes a recovery (a dry run; nothing is applied)")
    action = action_text(d["action"], d["target"])
    reason = next(iter(d["reasons"]), "")
    if d["action"] == "observe":
        return ("observed", "observe", "nothing to do: the policy leaves the job as it is" + (f" ({reason})" if reason
                                                                                            else ""))
    if d["status"] == "proposed":
        return ("proposed", action, f"apply: `rankwatch recover {run_dir} --apply` ({d['record']} is a dry run)")
    # an applied record's outcome is the manager's (`control.manager.Outcome`): recovered, quarantined, observed,
    # relaunch_failed, relaunch_refused
    if d["outcome"] == "recovered":
        return ("recovered", action, f"nothing to do: {d['record']} carried out '{action}' and the job completed")
    if d["outcome"] == "quarantined":
        return ("quarantined", action, f"nothing to do: {d['record']} carried out '{action}'; the job goes on "
                                       "without it")
    if d["outcome"] == "observed":
        return ("observed", action, f"nothing to do: {d['record']} left the job as it is")
    return ("failed", action, f"look: {d['record']} {action} ended '{d['outcome']}'; see `rankwatch lineage "
                              f"{run_dir}` and the recovery record")


def incident_states(incidents: Sequence[Incident], decided: pl.DataFrame, run_dir: str) -> pl.DataFrame:
    """Per incident (in the order given): id, state (`STATES`), its latest decision and the next step: the command to
    run, or 'nothing to do' and why."""
    latest: dict[str, dict[str, Any]] = {}
    for row in decided.iter_rows(named=True):
        latest[row["incident"]] = row
    rows = [dict(zip(("state", "decision", "next_step"), _state(latest.get(i.id), run_dir)), id=i.id)
            for i in incidents]
    return pl.DataFrame(rows, schema={"id": pl.String, "state": pl.String, "decision": pl.String,
                                      "next_step": pl.String}).select("id", "state", "decision", "next_step")


# -- a fail-stop, from the kill to the replay ----------------------------------------------------------------------

_STOPS = {"order": pl.Int32, _R: pl.Int32, "host": pl.String, "role": pl.String, "how": pl.String,
          "in_step": pl.Int64, "wall_ns": pl.Int64, "after_first": pl.String}
_WAITS = {_R: pl.Int32, _S: pl.Int64, "op": pl.String, "group": pl.String, "seq": pl.Int64, "state": pl.String}


@dataclass(frozen=True, kw_only=True, slots=True)
class FailStopStory:
    """A fail-stop told in order: who stopped first and how, how every other rank of that attempt ended (and when,
    after the first), the collectives they were left waiting in, the decision, the recovery and the steps trained
    again because of it."""

    incident: Incident
    stops: pl.DataFrame
    """order, rank, host, role ('stopped first' / 'reacted' / 'raised' / 'stopped by a signal' / 'exited'), how,
    in_step (the step it was in), wall_ns, after_first (a duration after the first rank's stop)."""
    waits: pl.DataFrame
    """rank, step, op, group, seq, state ('error' / 'open'): where the others were when the first one went."""
    decision: str
    """The latest decision and its state, one line ('none' when nothing was decided)."""
    recovery: str
    """What was carried out: the record, the checkpoint and the attempt that followed; or why nothing was."""
    replayed: tuple[tuple[int, int], ...]
    """Inclusive step ranges trained again after this incident's attempt (the lineage's replayed ranges)."""

    def replayed_text(self) -> str:
        if not self.replayed:
            return "no step was trained twice"
        spans = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in self.replayed)
        n = sum(b - a + 1 for a, b in self.replayed)
        return f"step{'s' if n > 1 else ''} {spans} {'were' if n > 1 else 'was'} trained twice (replayed after the " \
               "rollback)"

    def lines(self) -> tuple[str, ...]:
        """The story as sentences, in the order a reader asks."""
        first = self.stops.filter(pl.col("role") == "stopped first")
        out = []
        if first.height:
            r = first.row(0, named=True)
            out.append(f"First to stop: rank {r[_R]} on {r['host'] or 'an unknown host'}"
                       + (f" in step {r['in_step']}" if r["in_step"] is not None else "") + f", {r['how']}")
        others = self.stops.filter(pl.col("role") != "stopped first")
        if others.height:
            roles = others.group_by("role").agg(pl.col(_R).sort()).sort("role")
            out.append("Then: " + "; ".join(f"{r['role']}: rank{'s' if len(r[_R]) > 1 else ''} {_ranks(r[_R])}"
                                            for r in roles.iter_rows(named=True)))
        if self.waits.height:
            where = self.waits.group_by("op", "group").agg(pl.col(_R).unique().sort(), pl.col(_S).min()).sort("group")
            more = f"; and {where.height - _LIST} more group(s)" if where.height > _LIST else ""
            out.append("Left waiting in: " + "; ".join(
                f"{w['op']} on {w['group']} (step {w[_S]}, rank{'s' if len(w[_R]) > 1 else ''} {_ranks(w[_R])})"
                for w in where.head(_LIST).iter_rows(named=True)) + more)
        out.append(f"Decision: {self.decision}")
        out.append(f"Recovery: {self.recovery}")
        out.append(f"Replayed: {self.replayed_text()}")
        return tuple(out)


_LIST = 6


def _ranks(ranks: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _first_sentence(text: str, limit: int = 160) -> str:
    """The first line of an error text, cut after its first sentence when that is long enough to say something
    (gloo's "...: Connection reset by peer. This is typically caused by ..." keeps its first sentence)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    cut = line.find(". ", 40)
    line = line[:cut + 1] if cut > 0 else line
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _how(r: dict[str, Any]) -> tuple[str, str]:
    """(role, how) of one rank's first abnormal event."""
    kind = r["kind"]
    if kind == str(EventKind.SIGNAL):
        return "stopped by a signal", signal_name(r["signal"])
    if kind == str(EventKind.EXCEPTION):
        text = _first_sentence(r["message"] or "")
        where = f" in {r['collective_op']} on {r['collective_group']}" if r["collective_op"] else ""
        role = "reacted" if r["collective_op"] else "raised"
        return role, f"{r['exc_type'] or 'an exception'}{where}" + (f": {text[:160]}" if text else "")
    if kind == str(EventKind.EXIT):
        return "exited", f"exit code {r['exit_code']}"
    return "stopped", kind


def _waits(incident: Incident, abnormal: pl.DataFrame) -> pl.DataFrame:
    """Collectives the others were left in: those that ended in an error (their exception events) and those the
    detector found open past a stall (its evidence rows with rank, op and group: a hang raises no error)."""
    parts = []
    if abnormal.height:
        parts.append(abnormal.filter(pl.col("collective_op").is_not_null()).select(
            pl.col(_R).cast(pl.Int32), pl.col(_S).cast(pl.Int64), pl.col("collective_op").alias("op"),
            pl.col("collective_group").alias("group"), pl.col("collective_seq").cast(pl.Int64).alias("seq"),
            pl.lit("error").alias("state")))
    for ev in incident.evidence:
        cols = list(ev.columns)
        if not {_R, "op", "group"} <= set(cols) or not ev.rows:
            continue
        at = {c: cols.index(c) for c in cols}
        seq = at.get("group_seq", at.get("seq"))
        rows = [{_R: r[at[_R]], _S: r[at[_S]] if _S in at else None, "op": r[at["op"]], "group": r[at["group"]],
                 "seq": r[seq] if seq is not None else None, "state": str(r[at["state"]]) if "state" in at else "open"}
                for r in ev.rows]
        parts.append(pl.DataFrame(rows, schema=_WAITS, strict=False))
    if not parts:
        return pl.DataFrame(schema=_WAITS)
    both = pl.concat([p.cast(_WAITS) for p in parts], how="vertical_relaxed")  # type: ignore[arg-type]
    return both.unique([_R, "op", "group", "seq"], keep="first", maintain_order=True).sort(_R, "seq",
                                                                                          nulls_last=True)


def fail_stop_story(views: ViewStore, incident: Incident, decided: pl.DataFrame,
                    lineage_frame: pl.DataFrame) -> FailStopStory:
    """Tell `incident` (a fail-stop or a hang) from the run's events, steps, decisions and lineage."""
    attempt = incident.attempt
    ev = views.frame("events")
    ev = ev.filter(pl.col("attempt") == attempt) if ev.height and attempt is not None else ev
    abnormal = ev.filter((pl.col("kind").is_in([str(EventKind.SIGNAL), str(EventKind.EXCEPTION)])) |
                         ((pl.col("kind") == str(EventKind.EXIT)) & (pl.col("exit_code").fill_null(0) != 0))
                         ).sort("wall_ns") if ev.height else ev
    first_event: dict[int, dict[str, Any]] = {}
    for r in abnormal.iter_rows(named=True):
        first_event.setdefault(r[_R], r)
    steps = views.frame("rank_steps")
    steps = steps.filter(pl.col("attempt") == attempt) if steps.height and attempt is not None else steps
    seen = dict(steps.group_by(_R).agg(pl.col("end_wall_ns").max()).iter_rows()) if steps.height else {}
    topo = views.frame("topology")
    hosts = dict(topo.select(_R, "host").unique(_R).iter_rows()) if topo.height else {}
    ranks = sorted(set(hosts) | set(first_event) | set(incident.ranks))
    culprits = set(incident.ranks)
    rows = []
    for rank in ranks:
        e = first_event.get(rank)
        if rank in culprits:
            how = _how(e)[1] if e is not None else f"{incident.cause}: no exit, signal or exception was recorded"
            role = "stopped first"
            wall = e["wall_ns"] if e is not None else (incident.detection_wall_ns or seen.get(rank))
            step = incident.onset_step if incident.onset_step is not None else (e or {}).get(_S)
        elif e is not None:
            role, how = _how(e)
            wall, step = e["wall_ns"], e[_S]
        else:
            continue  # a rank that ended normally, or was never heard to stop, is not part of the story
        rows.append({_R: rank, "host": hosts.get(rank), "role": role, "how": how, "in_step": step,
                     "wall_ns": wall})
    stops = pl.DataFrame(rows, schema={k: v for k, v in _STOPS.items() if k not in ("order", "after_first")})
    t0 = stops.filter(pl.col("role") == "stopped first")["wall_ns"].min() if stops.height else None
    stops = stops.sort(pl.col("role") != "stopped first", "wall_ns", nulls_last=True).with_columns(
        pl.int_range(1, pl.len() + 1, dtype=pl.Int32).alias("order"),
        pl.when(pl.col("role") == "stopped first").then(pl.lit("first")).otherwise(pl.col("wall_ns").map_elements(
            lambda w: "—" if t0 is None else "+" + duration((w - t0) / 1e9), return_dtype=pl.String,
            skip_nulls=True)).fill_null("—").alias("after_first"))
    waits = _waits(incident, abnormal)
    mine = decided.filter(pl.col("incident") == incident.id)
    d = mine.row(mine.height - 1, named=True) if mine.height else None
    state, decision, _next = _state(d, str(views.run_dir))
    if d is None:
        recovery = "none: nothing was decided"
    elif d["status"] == "applied":
        ck = f" from {d['checkpoint']}" if d["checkpoint"] and d["checkpoint"] not in decision else ""
        recovery = f"{d['record']}: {decision}{ck}; outcome {d['outcome']}"
    else:
        recovery = f"not carried out ({state}: {_next})"
    replayed = []
    for r in lineage_frame.filter(pl.col("kind") == "replayed_data_range").iter_rows(named=True):
        det = json.loads(r["details"] or "{}")
        # the attempt that followed this one replays because of it; a later attempt's replay is a later incident's
        follows = attempt is None or r["attempt"] is None or r["attempt"] == attempt + 1
        if follows and det.get("from_step") is not None and det.get("to_step") is not None \
                and det["to_step"] > det["from_step"]:
            replayed.append((int(det["from_step"]), int(det["to_step"]) - 1))
    return FailStopStory(incident=incident, stops=stops.select(list(_STOPS)), waits=waits.select(list(_WAITS)),
                         decision=f"{decision} ({state})", recovery=recovery, replayed=tuple(sorted(set(replayed))))


def is_fail_stop(incident: Incident) -> bool:
    return incident.klass in (IncidentClass.FAIL_STOP, IncidentClass.HANG)
