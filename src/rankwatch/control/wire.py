"""The alert wire format, built and parsed in one place: what the monitor sends and the recovery manager reads.

    incident_message / decision_message   one incident (firing or resolved) or one decision -> a `Message`: a
                                          deterministic id and the body bytes, fixed once built
    parse_message(body)                   the body -> a typed `AlertMessage`; ValueError naming the first missing or
                                          ill-typed key (what the manager service answers 400 with)

The contract (docs/alerts.md): an HTTP POST of one JSON object that is an Alertmanager webhook v4 document
(`version`, `groupKey`, `status`, `alerts[]` with string labels and annotations, ...) with rankwatch's own keys
beside it (`type`, `timestamp`, `rankwatch`), signed as Standard Webhooks v1 (`control.signer`): `webhook-id` is the
message's idempotency key ("msg_" + 32 hex chars of a SHA-256 over run, message type, incident id and decision id),
the same on every attempt and after a monitor restart. Only "decision" messages may make a manager act; incident
messages are records.

Severity per class: fail-stop, hang, corruption and divergence are critical (the job is stopped, stuck, or its
values are wrong); a hang the rank recovered from by itself (a transient stall), a straggler and an imbalance are
warnings (the job runs on, slower); unclassified is info.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any


from rankwatch.analytics.errors import AnalyticsError
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, SubjectKind
from rankwatch.recovery.decision import Action, Decision, TargetKind

if TYPE_CHECKING:
    import polars as pl

log = logging.getLogger("rankwatch.alerts")


ALERTS_SCHEMA = 1
"""Version of the `rankwatch` object in the body."""


RECEIVER = "rankwatch-manager"


ZERO_TIME = "0001-01-01T00:00:00Z"
"""Alertmanager's `endsAt` of an alert still firing."""




class AlertConfigError(AnalyticsError):
    """A secret file, webhook URL or outbox file that cannot be used (one line naming it and the problem)."""


class MessageType(StrEnum):
    FIRING = "incident.firing"
    RESOLVED = "incident.resolved"
    DECISION = "decision"


class AlertStatus(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class Severity(StrEnum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


_CRITICAL = frozenset({IncidentClass.FAIL_STOP, IncidentClass.HANG, IncidentClass.CORRUPTION,
                       IncidentClass.DIVERGENCE})


_WARNING = frozenset({IncidentClass.STRAGGLER, IncidentClass.IMBALANCE, IncidentClass.CHECKPOINT})


STOPPING_CLASSES = frozenset({IncidentClass.FAIL_STOP, IncidentClass.HANG})
"""The classes whose ranks are gone or stuck: a decision about one stops the running attempt at once."""


def severity(incident: Incident) -> Severity:
    """Critical: fail-stop, hang, corruption, divergence. Warning: straggler, imbalance, failed checkpoint saves (work
    at risk, nothing down), and a hang the rank came back from by itself (TRANSIENT_STALL). Info: unclassified."""
    if incident.klass is IncidentClass.HANG and incident.cause is Cause.TRANSIENT_STALL:
        return Severity.WARNING
    if incident.klass in _CRITICAL:
        return Severity.CRITICAL
    return Severity.WARNING if incident.klass in _WARNING else Severity.INFO


def alertname(klass: IncidentClass) -> str:
    """'Rankwatch' + the class in CamelCase: fail_stop -> RankwatchFailStop."""
    return "Rankwatch" + "".join(p.capitalize() for p in str(klass).split("_"))


def _hex(*parts: str, n: int) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:n]


def message_id(run: str, type: MessageType, incident_id: str, decision_id: str | None = None) -> str:
    """The webhook-id: 'msg_' + 32 hex chars, a function of (run, type, incident id, decision id) only."""
    return "msg_" + _hex(run, str(type), incident_id, decision_id or "", n=32)


def fingerprint(run: str, incident_id: str) -> str:
    """The alert's fingerprint: 16 hex chars, stable per (run, incident id)."""
    return _hex(run, incident_id, n=16)


def decision_id(run: str, incident_ids: Iterable[str]) -> str:
    """'dec_' + 16 hex chars over the run and the (sorted) incident ids the decision is about. A monitor decides once
    per set of incidents: the same incidents decided again (after a restart, with a newer checkpoint) carry the same
    id, so a receiver applies at most one decision for them."""
    ids = sorted(set(incident_ids))
    if not ids:
        raise ValueError("decision id: a decision names at least one incident")
    return "dec_" + _hex("decision", run, *ids, n=16)


def _rfc3339(t: float) -> str:
    dt = datetime.fromtimestamp(t, tz=timezone.utc)
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + f".{dt.microsecond // 1000:03d}Z"


def _one_line(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlacement:
    """Where a rank runs: its host and its device's UUID ('' on CPU)."""

    host: str
    uuid: str = ""


def placements(topology: pl.DataFrame) -> dict[int, RankPlacement]:
    """Rank -> placement from `analytics.queries.topology(con)` (each rank's latest start; e.g. on a
    `LiveAnalyzer`'s `con`)."""
    out: dict[int, RankPlacement] = {}
    for row in topology.select("rank", "host", "device_uuid").iter_rows(named=True):
        out[int(row["rank"])] = RankPlacement(host=str(row["host"] or ""), uuid=str(row["device_uuid"] or ""))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionFields:
    """A recovery decision as the wire carries it (`rankwatch.decision`). `incidents` are the ids of the incidents it
    decides for (the first is the primary one: the message's `rankwatch.incident` and `groupKey`)."""

    id: str
    incidents: tuple[str, ...]
    action: Action
    scope: str
    target: str | None
    checkpoint: str | None
    path: tuple[str, ...]
    reasons: tuple[str, ...]
    quarantines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.id.startswith("dec_") or not self.incidents:
            raise ValueError(f"decision {self.id!r}: needs a 'dec_' id and at least one incident id")
        object.__setattr__(self, "action", Action(self.action))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "action": str(self.action), "scope": self.scope, "target": self.target,
                "checkpoint": self.checkpoint, "path": list(self.path), "reasons": list(self.reasons),
                "quarantines": list(self.quarantines)}

    def line(self) -> str:
        """One line for the `decision` annotation: 'restart_job checkpoint:step-100@100 (scope job); quarantine
        device:GPU-aa [dec_...]'."""
        head = str(self.action) + (f" {self.target}" if self.target else "") + f" (scope {self.scope})"
        extra = "".join(f"; quarantine {q}" for q in self.quarantines)
        return _one_line(f"{head}{extra} [{self.id}]")


def _ids(incidents: Sequence[Incident | str]) -> tuple[str, ...]:
    ids = tuple(i if isinstance(i, str) else i.id for i in incidents)
    return tuple(dict.fromkeys(ids))


def decision_fields(decision: Decision, *, run_dir: Path | str, incidents: Sequence[Incident | str]) -> DecisionFields:
    """One policy decision (`recovery.policy.decide`) for `incidents` (the first is the primary one)."""
    ids = _ids(incidents)
    target = decision.target
    quarantines = tuple(dict.fromkeys(
        str(d.target) for d in (decision, *decision.also) if d.action is Action.QUARANTINE and d.target is not None))
    return DecisionFields(
        id=decision_id(Path(run_dir).name, ids), incidents=ids, action=decision.action, scope=str(decision.scope),
        target=None if target is None else str(target),
        checkpoint=target.id if target is not None and target.kind is TargetKind.CHECKPOINT else None,
        path=decision.path, reasons=decision.reasons, quarantines=quarantines,
    )


def plan_fields(*, run_dir: Path | str, incidents: Sequence[Incident | str], action: Action, scope: str = "job",
                checkpoint: str | None = None, target: str | None = None, path: Sequence[str] = (),
                reasons: Sequence[str] = (), quarantines: Sequence[str] = ()) -> DecisionFields:
    """A joined decision over several incidents (the recovery manager's plan: one executed action, its checkpoint,
    every quarantine). `target` defaults to 'checkpoint:<id>' when a checkpoint is given."""
    ids = _ids(incidents)
    if target is None and checkpoint is not None:
        target = f"{TargetKind.CHECKPOINT}:{checkpoint}"
    return DecisionFields(id=decision_id(Path(run_dir).name, ids), incidents=ids, action=action, scope=scope,
                          target=target, checkpoint=checkpoint, path=tuple(path), reasons=tuple(reasons),
                          quarantines=tuple(quarantines))


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    """One webhook message: `id` is the webhook-id, `body` the exact bytes sent (and signed) on every attempt, `run`
    the ordering key (messages of one run are delivered in the order they were enqueued)."""

    id: str
    type: MessageType
    run: str
    incident: str
    decision: str | None
    body: bytes

    def doc(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.body)
        return out


def _finite(value: Any) -> Any:
    """JSON that any parser reads: NaN and infinities (evidence rows may hold them) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _labels(run: str, incident: Incident, placement: Mapping[int, RankPlacement]) -> dict[str, str]:
    where = [placement[r] for r in incident.ranks if r in placement]
    if incident.subject.kind is SubjectKind.HOST:
        hosts = [incident.subject.id]
    else:
        hosts = list(dict.fromkeys(p.host for p in where if p.host))
    if incident.subject.kind is SubjectKind.DEVICE:
        uuids = [incident.subject.id]
    else:
        uuids = list(dict.fromkeys(p.uuid for p in where if p.uuid))
    return {
        "alertname": alertname(incident.klass), "class": str(incident.klass), "run": run,
        "rank": ",".join(map(str, incident.ranks)), "hostname": ",".join(hosts), "uuid": ",".join(uuids),
        "severity": str(severity(incident)),
    }


def _alert(run: str, incident: Incident, status: AlertStatus, *, placement: Mapping[int, RankPlacement],
           decision: str, evidence: str, starts_at: float, ends_at: float | None) -> dict[str, Any]:
    return {
        "status": str(status),
        "labels": _labels(run, incident, placement),
        "annotations": {"summary": _one_line(f"{incident.klass} {incident.subject}: {incident.summary}"),
                        "decision": _one_line(decision), "evidence": evidence},
        "startsAt": _rfc3339(starts_at),
        "endsAt": ZERO_TIME if ends_at is None else _rfc3339(ends_at),
        "generatorURL": "",
        "fingerprint": fingerprint(run, incident.id),
    }


def _common(items: Sequence[Mapping[str, str]]) -> dict[str, str]:
    first = items[0]
    return {k: v for k, v in first.items() if all(i.get(k) == v for i in items[1:])}


def alert_start(incident: Incident, now: float, starts_at: float | None) -> float:
    if starts_at is not None:
        return starts_at
    return incident.detection_wall_ns / 1e9 if incident.detection_wall_ns is not None else now


def _message(*, run_dir: Path, type: MessageType, status: AlertStatus, primary: Incident,
             alerts: list[dict[str, Any]], now: float, decision: DecisionFields | None,
             evidence: dict[str, Any]) -> Message:
    run = run_dir.name
    did = decision.id if decision is not None else None
    body = {
        "version": "4",
        "groupKey": f"rankwatch/{run}/{primary.id}",
        "truncatedAlerts": 0,
        "status": str(status),
        "receiver": RECEIVER,
        "groupLabels": {"alertname": alerts[0]["labels"]["alertname"], "run": run},
        "commonLabels": _common([a["labels"] for a in alerts]),
        "commonAnnotations": _common([a["annotations"] for a in alerts]),
        "externalURL": "",
        "alerts": alerts,
        "type": str(type),
        "timestamp": _rfc3339(now),
        "rankwatch": {
            "schema": ALERTS_SCHEMA, "run": run, "run_dir": str(run_dir.absolute()), "incident": primary.id,
            "incident_doc": _finite(primary.to_dict()), "decision_id": did,
            "decision": None if decision is None else decision.to_dict(),
            "scope": None if decision is None else decision.scope, "evidence": _finite(evidence),
        },
    }
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return Message(id=message_id(run, type, primary.id, did), type=type, run=run, incident=primary.id,
                   decision=did, body=data)


def incident_message(run_dir: Path | str, incident: Incident, status: AlertStatus | str, *,
                     decision: DecisionFields | str | None = None, evidence_path: Path | str | None = None,
                     placement: Mapping[int, RankPlacement] | None = None, now: float | None = None,
                     starts_at: float | None = None, resolution: str | None = None) -> Message:
    """An incident firing or resolved. `decision` only fills the `decision` annotation (an incident message never
    makes a manager act; `rankwatch.decision` stays null). `startsAt` is `starts_at`, else the incident's detection
    wall clock, else `now`; a resolved alert ends at `now`, and `resolution` says why (`rankwatch.evidence`)."""
    run_dir, status = Path(run_dir), AlertStatus(status)
    now = time.time() if now is None else now
    line = decision.line() if isinstance(decision, DecisionFields) else (decision or "")
    alert = _alert(run_dir.name, incident, status, placement=placement or {}, decision=line,
                   evidence="" if evidence_path is None else str(evidence_path),
                   starts_at=alert_start(incident, now, starts_at),
                   ends_at=now if status is AlertStatus.RESOLVED else None)
    evidence: dict[str, Any] = {"path": None if evidence_path is None else str(evidence_path)}
    if resolution is not None:
        evidence["resolution"] = resolution
    kind = MessageType.FIRING if status is AlertStatus.FIRING else MessageType.RESOLVED
    return _message(run_dir=run_dir, type=kind, status=status, primary=incident, alerts=[alert], now=now,
                    decision=None, evidence=evidence)


def decision_message(run_dir: Path | str, decision: DecisionFields, incidents: Sequence[Incident], *,
                     evidence_path: Path | str | None = None, placement: Mapping[int, RankPlacement] | None = None,
                     now: float | None = None, starts_at: Mapping[str, float] | None = None) -> Message:
    """A decision (status firing: it is about incidents that fire), one alert per incident it decides for; the
    primary incident (the decision's first) names `rankwatch.incident`, `incident_doc` and the groupKey.
    `incidents` must hold every incident the decision names."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    by_id = {i.id: i for i in incidents}
    missing = [i for i in decision.incidents if i not in by_id]
    if missing:
        raise ValueError(f"decision {decision.id}: incidents {missing} not among those given")
    chosen = [by_id[i] for i in decision.incidents]
    ev = "" if evidence_path is None else str(evidence_path)
    alerts = [_alert(run_dir.name, i, AlertStatus.FIRING, placement=placement or {}, decision=decision.line(),
                     evidence=ev, starts_at=alert_start(i, now, (starts_at or {}).get(i.id)), ends_at=None)
              for i in chosen]
    return _message(run_dir=run_dir, type=MessageType.DECISION, status=AlertStatus.FIRING, primary=chosen[0],
                    alerts=alerts, now=now, decision=decision,
                    evidence={"path": ev or None, "incidents": list(decision.incidents)})




_RELAUNCHING = frozenset({Action.RETRY_OPERATION, Action.REBUILD_GROUP, Action.RESTART_REPLICA,
                          Action.ROLLBACK_DOMAIN, Action.RESTART_JOB})
"""The actions carried out as a relaunch (a job that relaunches every process, as the canary does, escalates each
of them to RESTART_JOB: `control.manager.plan_recovery`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionNote:
    """The monitor's decision as the message carries it. The manager re-plans with its own policy; this says what
    was asked (and whether to stop the job at once)."""

    id: str
    action: Action
    scope: str | None
    target: str | None
    checkpoint: str | None
    quarantines: tuple[str, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class AlertMessage:
    """A rankwatch wire-contract message, parsed."""

    type: MessageType
    status: str
    run: str
    incident_id: str
    incident: Incident
    decision: DecisionNote | None
    """Set for "decision" messages (and then never None)."""

    @property
    def stops_job(self) -> bool:
        """True when the message must stop the running attempt at once: a relaunching decision, or any decision
        about a fail-stop or a hang (the ranks are gone or stuck; waiting only burns the collective timeout)."""
        return self.decision is not None and self.decision.action is not Action.OBSERVE and (
            self.decision.action in _RELAUNCHING or self.incident.klass in STOPPING_CLASSES)


def typed_key(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    """`doc[key]` when it is of `kind`; ValueError naming the key (as `where.key`) when it is missing or of another
    type (a bool is never taken for an int)."""
    name = f"{where}.{key}" if where else key
    if key not in doc:
        raise ValueError(f"missing key {name!r}")
    value = doc[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"key {name!r} is {type(value).__name__}, not {want}")
    return value


MAX_JSON_DEPTH = 32
"""How deep a received document may nest (objects and arrays): a rankwatch message nests 6 levels, an Alertmanager
delivery 4. Checked on the bytes before any parser runs, so a document nested 100,000 deep is refused, not a
RecursionError."""


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep `body` nests objects and arrays, counted on the raw bytes outside strings, stopping at `limit` + 1."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def json_object(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A received body as a JSON object: UTF-8, nested at most `max_depth` levels, an object at the top. ValueError
    saying which of those it is not."""
    if json_depth(body, max_depth) > max_depth:
        raise ValueError(f"body nests deeper than {max_depth} levels")
    try:
        doc = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("body is not a JSON object")
    return doc


def parse_message(body: bytes) -> AlertMessage:
    """The wire contract's body -> AlertMessage; ValueError naming the first missing or ill-typed key. Every key the
    service reads is type-checked here, the incident document by its own schema (`Incident.from_dict`)."""
    doc = json_object(body)
    for key, kind in (("version", str), ("groupKey", str), ("status", str), ("alerts", list), ("timestamp", str)):
        typed_key(doc, key, kind)
    if doc["status"] not in {str(s) for s in AlertStatus}:
        raise ValueError(f"key 'status' is {doc['status'][:20]!r}, not firing or resolved")
    for n, alert in enumerate(doc["alerts"]):
        if not isinstance(alert, dict):
            raise ValueError(f"key 'alerts[{n}]' is {type(alert).__name__}, not dict")
    try:
        kind_ = MessageType(typed_key(doc, "type", str))
    except ValueError as exc:
        raise ValueError(f"key 'type': {exc}") from None
    rw = typed_key(doc, "rankwatch", dict)
    run = typed_key(rw, "run", str, "rankwatch")
    incident_id = typed_key(rw, "incident", str, "rankwatch")
    incident = Incident.from_dict(typed_key(rw, "incident_doc", dict, "rankwatch"))
    if incident.id != incident_id:
        raise ValueError(f"rankwatch.incident {incident_id!r} is not rankwatch.incident_doc.id {incident.id!r}")
    decision: DecisionNote | None = None
    if kind_ is MessageType.DECISION:
        d = typed_key(rw, "decision", dict, "rankwatch")
        where = "rankwatch.decision"
        try:
            action = Action(typed_key(d, "action", str, where))
        except ValueError as exc:
            raise ValueError(f"key '{where}.action': {exc}") from None
        quarantines = typed_key(d, "quarantines", list, where)
        if not all(isinstance(q, str) for q in quarantines):
            raise ValueError(f"key '{where}.quarantines' holds a value that is not str")
        decision = DecisionNote(
            id=typed_key(d, "id", str, where), action=action, scope=typed_key(d, "scope", (str, type(None)), where),
            target=typed_key(d, "target", (str, type(None)), where),
            checkpoint=typed_key(d, "checkpoint", (str, type(None)), where), quarantines=tuple(str(q) for q in quarantines))
    return AlertMessage(type=kind_, status=doc["status"], run=run, incident_id=incident_id, incident=incident,
                        decision=decision)
