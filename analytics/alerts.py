"""Alert webhooks from the monitor: Alertmanager-v4 payloads, Standard Webhooks signing, a durable outbox.

    incident_message / decision_message   one incident (firing or resolved) or one decision -> a `Message`: a
                                          deterministic id and the body bytes, fixed once built
    AlertTracker.update(incidents, ...)   what a monitor sends each tick: each new incident once (firing), its
                                          resolution once, each decision once (pure; no I/O)
    Outbox(path)                          SQLite: a message is committed before any send; delivered in order per
                                          run; retried with backoff while the receiver is down or answers 5xx/429
    AlertSender                           an Outbox, a Transport and a Signer on a background thread; never raises
                                          into the monitor loop

The wire contract (docs/alerts.md): an HTTP POST of one JSON object that is an Alertmanager webhook v4 document
(`version`, `groupKey`, `status`, `alerts[]` with string labels and annotations, ...) with rankwatch's own keys
beside it (`type`, `timestamp`, `rankwatch`), signed as Standard Webhooks v1: `webhook-id` is the message's
idempotency key ("msg_" + 32 hex chars of a SHA-256 over run, message type, incident id and decision id), the same
on every attempt and after a monitor restart; `webhook-timestamp` and `webhook-signature` are made fresh for each
attempt. Only "decision" messages may make a manager act; incident messages are records.

Retry rules: no answer (refused, timed out, reset) and 5xx / 429 are retried, after `Retry-After` when the receiver
gives one (capped), otherwise after a full-jitter exponential backoff; any other non-2xx answer (4xx, 3xx) is final
(`rejected`, with the status and the first line of the body); a message past its maximum age or attempts is `dead`.
A run's next message waits until the one before it is delivered, rejected or dead. A message enqueued again (same
id) is stored once, so a restarted monitor that rebuilds its messages resends nothing that was delivered.

Severity per class: fail-stop, hang, corruption and divergence are critical (the job is stopped, stuck, or its
values are wrong); a hang the rank recovered from by itself (a transient stall), a straggler and an imbalance are
warnings (the job runs on, slower); unclassified is info.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import hashlib
import json
import logging
import math
import os
import random
import sqlite3
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any

from standardwebhooks.webhooks import Webhook

from rankwatch.analytics.errors import AnalyticsError
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, SubjectKind, sort_incidents
from rankwatch.analytics.recovery import Action, Decision, TargetKind

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "ALERTS_DIR", "ALERTS_SCHEMA", "OUTBOX_FILE", "RECEIVER", "AlertConfigError", "AlertSender", "AlertStatus",
    "AlertTracker", "DecisionFields", "DeliveryResult", "HttpTransport", "MemoryTransport", "Message", "MessageType",
    "Outbox", "OutboxEntry", "OutboxStats", "Outcome", "RankPlacement", "Reply", "RetryConfig", "Severity", "Signer",
    "State", "TrackerConfig", "Transport", "alertname", "decision_fields", "decision_id", "decision_message",
    "fingerprint", "incident_message", "load_secret", "message_id", "new_secret", "outbox_path", "placements",
    "plan_fields", "severity", "signed_send", "write_secret",
]

log = logging.getLogger("rankwatch.alerts")

ALERTS_SCHEMA = 1
"""Version of the `rankwatch` object in the body."""
ALERTS_DIR = "alerts"
OUTBOX_FILE = "outbox.sqlite"
RECEIVER = "rankwatch-manager"
ZERO_TIME = "0001-01-01T00:00:00Z"
"""Alertmanager's `endsAt` of an alert still firing."""
SECRET_PREFIX = "whsec_"
SECRET_MIN_BYTES = 24
_DETAIL_MAX = 200
"""Characters of a receiver's answer (its first line) kept with a rejected or retried message."""


class AlertConfigError(AnalyticsError):
    """A secret file, webhook URL or outbox file that cannot be used (one line naming it and the problem)."""


def outbox_path(run_dir: Path | str) -> Path:
    """The default outbox of a run: `<run>/alerts/outbox.sqlite`."""
    return Path(run_dir) / ALERTS_DIR / OUTBOX_FILE


# ------------------------------------------------------------------------------------------------------- payloads


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
_WARNING = frozenset({IncidentClass.STRAGGLER, IncidentClass.IMBALANCE})
_STOPPED = frozenset({IncidentClass.FAIL_STOP, IncidentClass.HANG})


def severity(incident: Incident) -> Severity:
    """Critical: fail-stop, hang, corruption, divergence. Warning: straggler, imbalance, and a hang the rank came
    back from by itself (TRANSIENT_STALL). Info: unclassified."""
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
    """One policy decision (`analytics.recovery.decide`) for `incidents` (the first is the primary one)."""
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


def _starts(incident: Incident, now: float, starts_at: float | None) -> float:
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
                   starts_at=_starts(incident, now, starts_at),
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
                     evidence=ev, starts_at=_starts(i, now, (starts_at or {}).get(i.id)), ends_at=None)
              for i in chosen]
    return _message(run_dir=run_dir, type=MessageType.DECISION, status=AlertStatus.FIRING, primary=chosen[0],
                    alerts=alerts, now=now, decision=decision,
                    evidence={"path": ev or None, "incidents": list(decision.incidents)})


# -------------------------------------------------------------------------------------------------------- tracker


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackerConfig:
    resolve_after: int = 3
    """An incident absent from this many consecutive updates is resolved (a straggler that caught up, a divergence
    the window moved past)."""
    stop_resolve_after: int | None = None
    """Fail-stop and hang (not a transient stall): resolved after this many absent updates; None = only when the
    job was relaunched (`attempt=` newer than the incident's), a recovery dealt with it (`recovered=`), or the run
    ended (`finish`). A rank that stopped does not come back by itself, and its incident leaving a monitor's window
    says only that the window moved on."""

    def __post_init__(self) -> None:
        if self.resolve_after < 1 or (self.stop_resolve_after is not None and self.stop_resolve_after < 1):
            raise ValueError(f"TrackerConfig: resolve_after {self.resolve_after} and stop_resolve_after "
                             f"{self.stop_resolve_after} must be >= 1")


_Key = tuple[IncidentClass, SubjectKind, str, tuple[int, ...], int | None]


def _key(incident: Incident) -> _Key:
    """What stays the same while one fault goes on: an incident's id also hashes its onset step, which a sliding
    window moves (a straggler seen in steps 80-99 and again in 100-119 has two ids), and two sources (the part-file
    detectors, the liveness channel) may raise one fail-stop under two ids."""
    return (incident.klass, incident.subject.kind, incident.subject.id, incident.ranks, incident.attempt)


def _stops(incident: Incident) -> bool:
    return incident.klass in _STOPPED and incident.cause is not Cause.TRANSIENT_STALL


@dataclass(slots=True)
class _Open:
    incident: Incident
    starts_at: float
    absent: int = 0
    decision: str = ""


class AlertTracker:
    """Which messages a monitor sends, one call per tick. Pure: it builds messages and holds what it has said; the
    caller enqueues them (an `AlertSender`).

    One alert per fault, not per incident id: an incident with the class, subject, ranks and attempt of an open
    alert is that alert still going on (its id moved with the window's onset), and sends nothing. The alert's
    messages keep the id of the incident that raised it. A resolved incident id is not raised again, nor a
    fail-stop or hang of a resolved alert, or of an attempt older than the newest one seen. Built afresh after a
    monitor restart, it rebuilds the same messages (same ids) for what is still in the window, which the outbox
    stores once."""

    def __init__(self, run_dir: Path | str, config: TrackerConfig = TrackerConfig(), *,
                 evidence_path: Callable[[Incident], Path | str | None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self._evidence = evidence_path or (lambda _: None)
        self._open: dict[str, _Open] = {}
        self._keys: dict[_Key, str] = {}
        """Open alerts by key."""
        self._resolved: set[str] = set()
        self._resolved_stops: set[_Key] = set()
        self._decided: set[str] = set()
        self._decided_keys: set[_Key] = set()
        self._attempt: int | None = None

    @property
    def open(self) -> tuple[Incident, ...]:
        """The incidents whose alerts fire (each as first raised)."""
        return sort_incidents(o.incident for o in self._open.values())

    def _open_for(self, incident: Incident) -> str | None:
        if incident.id in self._open:
            return incident.id
        return self._keys.get(_key(incident))

    def undecided(self, incidents: Iterable[Incident]) -> tuple[Incident, ...]:
        """Those of `incidents` whose fault no decision sent so far covers, and that would fire (not resolved): what
        the caller plans for."""
        return sort_incidents(i for i in incidents
                              if _key(i) not in self._decided_keys and not self._silenced(i))

    def _silenced(self, incident: Incident) -> bool:
        if incident.id in self._resolved:
            return True
        if not _stops(incident):
            return False
        old = incident.attempt is not None and self._attempt is not None and incident.attempt < self._attempt
        return old or _key(incident) in self._resolved_stops

    def update(self, incidents: Iterable[Incident], decisions: Iterable[DecisionFields] = (), *,
               recovered: Iterable[str | Incident] = (), attempt: int | None = None,
               placement: Mapping[int, RankPlacement] | None = None, now: float | None = None) -> list[Message]:
        """The messages for this tick, in the order to send them: the new alerts firing (most consequential first),
        then each decision not sent before, then the resolutions.

        `incidents`: the latest analysis (and liveness view). `decisions`: what the caller decided this tick (for
        `undecided(incidents)`); each names incident ids of this tick or of open alerts. `recovered`: incidents (or
        ids) a recovery dealt with, e.g. those of the manager's recovery records; their alerts resolve now, present
        or not. `attempt`: the run's newest attempt (the topology's max attempt); a fail-stop or hang of an older
        attempt resolves (the job was relaunched past it)."""
        now = time.time() if now is None else now
        place = placement or {}
        if attempt is not None:
            self._attempt = attempt if self._attempt is None else max(self._attempt, attempt)
        current = {i.id: i for i in incidents}
        seen: set[str] = set()
        out: list[Message] = []
        for inc in sort_incidents(current.values()):
            if self._silenced(inc):
                continue
            held = self._open_for(inc)
            if held is not None:
                seen.add(held)
                continue
            o = _Open(incident=inc, starts_at=_starts(inc, now, None))
            self._open[inc.id] = o
            self._keys[_key(inc)] = inc.id
            seen.add(inc.id)
            out.append(incident_message(self.run_dir, inc, AlertStatus.FIRING, evidence_path=self._evidence(inc),
                                        placement=place, now=now, starts_at=o.starts_at))
        for d in decisions:
            if d.id in self._decided:
                continue
            known = {**{k: o.incident for k, o in self._open.items()}, **current}
            missing = [i for i in d.incidents if i not in known]
            if missing:
                raise ValueError(f"decision {d.id}: incidents {missing} were never reported to the tracker")
            chosen = [known[i] for i in d.incidents]
            starts = {i.id: self._open[h].starts_at for i in chosen if (h := self._open_for(i)) is not None}
            out.append(decision_message(self.run_dir, d, chosen, evidence_path=self._evidence(chosen[0]),
                                        placement=place, now=now, starts_at=starts))
            self._decided.add(d.id)
            for i in chosen:
                self._decided_keys.add(_key(i))
                if (h := self._open_for(i)) is not None:
                    self._open[h].decision = d.line()
        done_ids, done_keys = set(), set()
        for r in recovered:
            if isinstance(r, str):
                done_ids.add(r)
            else:
                done_ids.add(r.id)
                done_keys.add(_key(r))
        for iid, o in list(self._open.items()):
            inc = o.incident
            if iid in done_ids or _key(inc) in done_keys:
                out.append(self._resolve(iid, place, now, "a recovery dealt with it"))
                continue
            if _stops(inc) and inc.attempt is not None and self._attempt is not None and inc.attempt < self._attempt:
                out.append(self._resolve(iid, place, now, f"the job was relaunched (attempt {self._attempt})"))
                continue
            if iid in seen:
                o.absent = 0
                continue
            o.absent += 1
            after = self.config.stop_resolve_after if _stops(inc) else self.config.resolve_after
            if after is not None and o.absent >= after:
                out.append(self._resolve(iid, place, now, f"absent from {o.absent} consecutive analyses"))
        return out

    def resume(self, messages: Iterable[Message]) -> int:
        """Take back what an earlier monitor of this run said, from its messages in the order they were made (an
        outbox's `entries()`, whatever their delivery state): its open alerts, decisions and resolutions, so a
        restarted monitor neither raises a fault again under the newer id the window gave it nor decides it again.
        Returns how many messages of this run were read."""
        run, n = self.run_dir.name, 0
        for m in messages:
            if m.run != run:
                continue
            n += 1
            doc = m.doc()
            rw = doc["rankwatch"]
            inc = Incident.from_dict(rw["incident_doc"])
            if m.type is MessageType.FIRING and not self._silenced(inc) and self._open_for(inc) is None:
                starts = datetime.strptime(doc["alerts"][0]["startsAt"], "%Y-%m-%dT%H:%M:%S.%fZ")
                self._open[inc.id] = _Open(incident=inc, starts_at=starts.replace(tzinfo=timezone.utc).timestamp())
                self._keys[_key(inc)] = inc.id
            elif m.type is MessageType.DECISION and m.decision is not None:
                self._decided.add(m.decision)
                line = doc["alerts"][0]["annotations"]["decision"]
                self._decided_keys.add(_key(inc))
                for iid in rw["evidence"].get("incidents", [inc.id]):
                    if iid in self._open:
                        self._open[iid].decision = line
                        self._decided_keys.add(_key(self._open[iid].incident))
                if (h := self._open_for(inc)) is not None:
                    self._open[h].decision = line
            elif m.type is MessageType.RESOLVED:
                if (h := self._open_for(inc)) is not None:
                    self._resolve(h, {}, 0.0, "")
                else:
                    self._resolved.add(inc.id)
                    if _stops(inc):
                        self._resolved_stops.add(_key(inc))
        return n

    def finish(self, *, now: float | None = None, why: str = "the run ended",
               placement: Mapping[int, RankPlacement] | None = None) -> list[Message]:
        """Resolve every open alert (the run is over, or the monitor stops watching it for good)."""
        now = time.time() if now is None else now
        return [self._resolve(iid, placement or {}, now, why) for iid in
                [i.id for i in sort_incidents(o.incident for o in self._open.values())]]

    def _resolve(self, iid: str, placement: Mapping[int, RankPlacement], now: float, why: str) -> Message:
        o = self._open.pop(iid)
        key = _key(o.incident)
        self._keys.pop(key, None)
        self._resolved.add(iid)
        if _stops(o.incident):
            self._resolved_stops.add(key)
        return incident_message(self.run_dir, o.incident, AlertStatus.RESOLVED, decision=o.decision or None,
                                evidence_path=self._evidence(o.incident), placement=placement, now=now,
                                starts_at=o.starts_at, resolution=why)


# -------------------------------------------------------------------------------------------------------- signing


def new_secret() -> str:
    """A fresh secret: 'whsec_' + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()


def _parse_secret(text: str, where: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise AlertConfigError(f"{where}: empty secret file (expected one line 'whsec_<base64>')")
    if len(lines) > 1:
        raise AlertConfigError(f"{where}: {len(lines)} lines; a secret file holds one line 'whsec_<base64>'")
    line = lines[0]
    if not line.startswith(SECRET_PREFIX):
        raise AlertConfigError(f"{where}: the secret does not start with '{SECRET_PREFIX}'")
    raw = line[len(SECRET_PREFIX):]
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise AlertConfigError(f"{where}: the secret after '{SECRET_PREFIX}' is not base64") from None
    if len(key) < SECRET_MIN_BYTES:
        raise AlertConfigError(f"{where}: the secret holds {len(key)} bytes; at least {SECRET_MIN_BYTES} are needed")
    return line


def load_secret(path: Path | str) -> str:
    """The secret in `path` ('whsec_<base64 of >= 24 bytes>', one line); `AlertConfigError` naming the file when it
    is missing, unreadable, empty or malformed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AlertConfigError(f"{p}: secret file not found (write one with a fresh 'whsec_<base64>' line)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AlertConfigError(f"{p}: secret file unreadable ({type(exc).__name__}: {exc})") from None
    return _parse_secret(text, str(p))


def write_secret(path: Path | str) -> str:
    """Write a new secret to `path` (created, mode 0600; an existing file is an error, never overwritten)."""
    p = Path(path)
    secret = new_secret()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AlertConfigError(f"{p}: exists already; not overwriting a secret") from None
    except OSError as exc:
        raise AlertConfigError(f"{p}: cannot create the secret file ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret


class Signer:
    """Standard Webhooks v1 headers for one attempt (the `standardwebhooks` package signs)."""

    def __init__(self, secret: str) -> None:
        self._webhook = Webhook(_parse_secret(secret, "webhook secret"))

    def headers(self, msg_id: str, body: bytes, *, timestamp: int) -> dict[str, str]:
        sig = self._webhook.sign(msg_id, datetime.fromtimestamp(timestamp, tz=timezone.utc), body.decode("utf-8"))
        return {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(timestamp),
                "webhook-signature": sig}


# ------------------------------------------------------------------------------------------------------ transport


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    """What one attempt got: `status` None when no HTTP answer came (refused, timed out, reset)."""

    status: int | None
    detail: str = ""
    """The first line of the answer's body, or the network error."""
    retry_after_s: float | None = None


class Transport(ABC):
    """Posts one signed body; never raises (a failure is a `Reply` with status None)."""

    @abstractmethod
    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply: ...


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return (text.splitlines()[0] if text else "")[:_DETAIL_MAX]


def _retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx comes back as an HTTPError: a signed POST is not re-sent elsewhere


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class HttpTransport(Transport):
    """urllib POST with a short timeout; redirects are not followed; a loopback URL never goes through the
    environment's HTTP proxy."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AlertConfigError(f"webhook URL {url!r}: not an http:// or https:// URL with a host")
        if timeout_s <= 0:
            raise ValueError(f"HttpTransport: timeout_s {timeout_s} must be > 0")
        self.url, self.timeout_s = url, timeout_s
        handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
        if parts.hostname in _LOOPBACK:
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply:
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={**headers, "user-agent": "rankwatch-alerts/1"})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return Reply(status=resp.status, detail=_first_line(resp.read(4096)))
        except urllib.error.HTTPError as exc:
            try:
                data = exc.read(4096)
            except (OSError, HTTPException):
                data = b""
            finally:
                exc.close()
            return Reply(status=exc.code, detail=_first_line(data) or str(exc.reason),
                         retry_after_s=_retry_after(exc.headers.get("Retry-After"), time.time()))
        except urllib.error.URLError as exc:
            return Reply(status=None, detail=f"{self.url}: {exc.reason}"[:_DETAIL_MAX])
        except (OSError, HTTPException, ValueError) as exc:
            return Reply(status=None, detail=f"{self.url}: {type(exc).__name__}: {exc}"[:_DETAIL_MAX])


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    body: bytes
    headers: dict[str, str]


class MemoryTransport(Transport):
    """A fake: records every request; answers from `replies` in turn (an int is a status), then `default`."""

    def __init__(self, replies: Iterable[Reply | int] = (), *, default: Reply | int = 200) -> None:
        self._replies = [r if isinstance(r, Reply) else Reply(status=r) for r in replies]
        self._default = default if isinstance(default, Reply) else Reply(status=default)
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply:
        with self._lock:
            self.requests.append(Request(body=body, headers=dict(headers)))
            return self._replies.pop(0) if self._replies else self._default


Send = Callable[[Message], Reply]


def signed_send(transport: Transport, signer: Signer, *, clock: Callable[[], float] = time.time) -> Send:
    """A send function for `Outbox.deliver_due`: signs each attempt with the current time, then posts."""
    def send(message: Message) -> Reply:
        return transport.post(message.body, signer.headers(message.id, message.body, timestamp=int(clock())))
    return send


# --------------------------------------------------------------------------------------------------------- outbox


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryConfig:
    base_s: float = 0.5
    """First backoff ceiling; the n-th retry waits uniform(0, min(cap_s, base_s * 2**(n-1))) (full jitter)."""
    cap_s: float = 30.0
    """Largest backoff ceiling."""
    retry_after_max_s: float = 300.0
    """A receiver's Retry-After is honoured up to this many seconds."""
    max_age_s: float | None = 3600.0
    """A message not delivered this long after it was enqueued is dead (None: never by age)."""
    max_attempts: int | None = None
    """A message that failed this many attempts is dead (None: no limit but the age)."""

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s or self.retry_after_max_s < 0:
            raise ValueError(f"RetryConfig: need 0 < base_s ({self.base_s}) <= cap_s ({self.cap_s}) and "
                             f"retry_after_max_s ({self.retry_after_max_s}) >= 0")
        if (self.max_age_s is not None and self.max_age_s <= 0) or (
                self.max_attempts is not None and self.max_attempts < 1):
            raise ValueError(f"RetryConfig: max_age_s {self.max_age_s} must be > 0 and max_attempts "
                             f"{self.max_attempts} >= 1 (or None)")


class State(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    REJECTED = "rejected"
    """The receiver answered a final non-2xx (4xx other than 429, or 3xx): not retried."""
    DEAD = "dead"
    """Given up: past the maximum age or attempts."""


class Outcome(StrEnum):
    DELIVERED = "delivered"
    RETRY = "retry"
    REJECTED = "rejected"
    DEAD = "dead"


@dataclass(frozen=True, kw_only=True, slots=True)
class DeliveryResult:
    id: str
    run: str
    type: MessageType
    outcome: Outcome
    attempts: int
    """Attempts made so far (0 for a message that died of age before one)."""
    status: int | None
    detail: str
    retry_in_s: float | None = None
    """RETRY only: seconds until the next attempt."""

    def line(self) -> str:
        what = f"{self.id} ({self.type}, run {self.run})"
        code = "no answer" if self.status is None else f"HTTP {self.status}"
        if self.outcome is Outcome.DELIVERED:
            return f"{what}: delivered ({code}, attempt {self.attempts})"
        if self.outcome is Outcome.RETRY:
            return f"{what}: {code} {self.detail}; retry {self.attempts + 1} in {self.retry_in_s:.1f}s"
        if self.outcome is Outcome.REJECTED:
            return f"{what}: rejected, {code}: {self.detail} (not retried)"
        return f"{what}: dead, given up after {self.attempts} attempt(s): {self.detail}"


@dataclass(frozen=True, kw_only=True, slots=True)
class OutboxStats:
    pending: int = 0
    delivered: int = 0
    rejected: int = 0
    dead: int = 0

    def __str__(self) -> str:
        return (f"{self.pending} pending, {self.delivered} delivered, {self.rejected} rejected, "
                f"{self.dead} dead")


@dataclass(frozen=True, kw_only=True, slots=True)
class OutboxEntry:
    message: Message
    state: State
    attempts: int
    created: float
    next_at: float
    status: int | None
    detail: str


_OUTBOX_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    run TEXT NOT NULL,
    type TEXT NOT NULL,
    incident TEXT NOT NULL,
    decision TEXT,
    body BLOB NOT NULL,
    created REAL NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at REAL NOT NULL,
    status INTEGER,
    detail TEXT NOT NULL DEFAULT '',
    done_at REAL
);
CREATE INDEX IF NOT EXISTS messages_run_state ON messages (run, state, seq);
"""
_COLUMNS = "seq, id, run, type, incident, decision, body, created, state, attempts, next_at, status, detail"


class Outbox:
    """The durable outbox: one SQLite file, one `messages` table. `enqueue` commits before it returns; `deliver_due`
    sends what is due, the head of each run's queue only. A new Outbox on the same file resumes every pending
    message. One process at a time uses a file (the monitor); threads may share an Outbox."""

    def __init__(self, path: Path | str, retry: RetryConfig = RetryConfig(), *,
                 rng: random.Random | None = None) -> None:
        self.path = Path(path)
        self.retry = retry
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._deliver_lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._con = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        except (OSError, sqlite3.Error) as exc:
            raise AlertConfigError(f"{self.path}: cannot open the outbox ({exc})") from None
        try:
            version = self._con.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, _OUTBOX_VERSION):
                raise AlertConfigError(f"{self.path}: outbox version {version}; this rankwatch reads "
                                       f"{_OUTBOX_VERSION}")
            self._con.execute("PRAGMA journal_mode=WAL")
            self._con.execute("PRAGMA synchronous=FULL")  # committed = on disk, before any send
            self._con.executescript(_SCHEMA)
            self._con.execute(f"PRAGMA user_version={_OUTBOX_VERSION}")
        except sqlite3.Error as exc:
            self._con.close()
            raise AlertConfigError(f"{self.path}: not a usable outbox ({exc})") from None
        except AlertConfigError:
            self._con.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._con.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def enqueue(self, message: Message, *, now: float | None = None) -> bool:
        """Store `message` (committed on return); False when a message of that id is stored already (the first one
        is kept)."""
        now = time.time() if now is None else now
        with self._lock:
            cur = self._con.execute(
                "INSERT OR IGNORE INTO messages (id, run, type, incident, decision, body, created, state, next_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (message.id, message.run, str(message.type), message.incident, message.decision, message.body, now,
                 str(State.PENDING), now))
            return cur.rowcount == 1

    def _entries(self, where: str = "", args: tuple[Any, ...] = ()) -> list[OutboxEntry]:
        with self._lock:
            rows = self._con.execute(f"SELECT {_COLUMNS} FROM messages {where} ORDER BY seq", args).fetchall()
        return [OutboxEntry(
            message=Message(id=r[1], run=r[2], type=MessageType(r[3]), incident=r[4], decision=r[5], body=bytes(r[6])),
            state=State(r[8]), attempts=r[9], created=r[7], next_at=r[10], status=r[11], detail=r[12]) for r in rows]

    def entries(self, state: State | None = None) -> list[OutboxEntry]:
        """Every stored message (of one state), in enqueue order."""
        return self._entries() if state is None else self._entries("WHERE state = ?", (str(state),))

    def pending(self) -> list[Message]:
        return [e.message for e in self.entries(State.PENDING)]

    def stats(self) -> OutboxStats:
        with self._lock:
            counts = dict(self._con.execute("SELECT state, count(*) FROM messages GROUP BY state").fetchall())
        return OutboxStats(**{str(s): int(counts.get(str(s), 0)) for s in State})

    def _heads(self) -> list[OutboxEntry]:
        return self._entries(
            "WHERE seq IN (SELECT min(seq) FROM messages WHERE state = ? GROUP BY run)", (str(State.PENDING),))

    def next_due(self) -> float | None:
        """When the earliest run head is due (None: nothing pending)."""
        return min((h.next_at for h in self._heads()), default=None)

    def _finish(self, entry: OutboxEntry, state: State, attempts: int, status: int | None, detail: str,
                now: float) -> None:
        with self._lock:
            self._con.execute("UPDATE messages SET state = ?, attempts = ?, status = ?, detail = ?, done_at = ? "
                              "WHERE id = ?", (str(state), attempts, status, detail, now, entry.message.id))

    def _backoff(self, attempts: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.retry.retry_after_max_s)
        ceiling = min(self.retry.cap_s, self.retry.base_s * 2 ** min(attempts - 1, 62))
        return self._rng.uniform(0.0, ceiling)

    def _expired(self, entry: OutboxEntry, attempts: int, now: float) -> bool:
        r = self.retry
        return ((r.max_age_s is not None and now - entry.created >= r.max_age_s)
                or (r.max_attempts is not None and attempts >= r.max_attempts))

    def deliver_due(self, send: Send, *, now: float | None = None) -> list[DeliveryResult]:
        """Attempt every run's head message that is due at `now`, and the next one of a run whose head is settled,
        until each run's head is waiting or its queue empty. `send` must not raise (an exception it raises counts as
        no answer)."""
        now = time.time() if now is None else now
        results: list[DeliveryResult] = []
        waiting: set[str] = set()
        with self._deliver_lock:
            while True:
                due = [h for h in self._heads() if h.message.run not in waiting and h.next_at <= now]
                if not due:
                    return results
                for head in due:
                    result = self._attempt(head, send, now)
                    results.append(result)
                    if result.outcome is Outcome.RETRY:
                        waiting.add(head.message.run)

    def _attempt(self, head: OutboxEntry, send: Send, now: float) -> DeliveryResult:
        m = head.message

        def result(outcome: Outcome, attempts: int, status: int | None, detail: str,
                   retry_in: float | None = None) -> DeliveryResult:
            return DeliveryResult(id=m.id, run=m.run, type=m.type, outcome=outcome, attempts=attempts,
                                  status=status, detail=detail, retry_in_s=retry_in)

        if self.retry.max_age_s is not None and now - head.created >= self.retry.max_age_s:
            detail = f"older than {self.retry.max_age_s:g}s" + (f"; last: {head.detail}" if head.detail else "")
            self._finish(head, State.DEAD, head.attempts, head.status, detail, now)
            return result(Outcome.DEAD, head.attempts, head.status, detail)
        try:
            reply = send(m)
        except Exception as exc:  # a send that raises is a failed attempt, never the caller's exception
            reply = Reply(status=None, detail=f"{type(exc).__name__}: {exc}"[:_DETAIL_MAX])
        attempts = head.attempts + 1
        status, detail = reply.status, reply.detail[:_DETAIL_MAX]
        if status is not None and 200 <= status < 300:
            self._finish(head, State.DELIVERED, attempts, status, detail, now)
            return result(Outcome.DELIVERED, attempts, status, detail)
        if status is not None and status != 429 and status < 500:
            self._finish(head, State.REJECTED, attempts, status, detail, now)
            return result(Outcome.REJECTED, attempts, status, detail)
        if self._expired(head, attempts, now):
            self._finish(head, State.DEAD, attempts, status, detail, now)
            return result(Outcome.DEAD, attempts, status, detail)
        delay = self._backoff(attempts, reply.retry_after_s)
        with self._lock:
            self._con.execute("UPDATE messages SET attempts = ?, next_at = ?, status = ?, detail = ? WHERE id = ?",
                              (attempts, now + delay, status, detail, m.id))
        return result(Outcome.RETRY, attempts, status, detail, delay)


# --------------------------------------------------------------------------------------------------------- sender


class AlertSender:
    """Delivers an outbox on a background thread. `submit` stores a message (committed) and wakes the thread; it
    never raises: a message that cannot be stored (a full disk) is kept in memory and stored at the next chance.
    Rejected and dead messages, and the first failure of an outage, are said through `say` (a line each)."""

    def __init__(self, outbox: Outbox, transport: Transport, signer: Signer, *,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] | None = None,
                 idle_s: float = 1.0) -> None:
        if idle_s <= 0:
            raise ValueError(f"AlertSender: idle_s {idle_s} must be > 0")
        self.outbox = outbox
        self._send = signed_send(transport, signer, clock=clock)
        self._clock = clock
        self._say = say or log.warning
        self._idle_s = idle_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._unsaved: list[Message] = []
        self._unsaved_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()
        self.errors = 0
        """Exceptions the sender caught (storing, delivering) instead of raising them."""

    @classmethod
    def open(cls, url: str, secret_file: Path | str, outbox: Path | str, *, retry: RetryConfig = RetryConfig(),
             timeout_s: float = 5.0, say: Callable[[str], None] | None = None, idle_s: float = 1.0) -> AlertSender:
        """The monitor's sender: raises `AlertConfigError` (one line) for a bad URL, secret file or outbox, at
        start — never later."""
        signer = Signer(load_secret(secret_file))
        transport = HttpTransport(url, timeout_s=timeout_s)
        return cls(Outbox(outbox, retry), transport, signer, say=say, idle_s=idle_s)

    def start(self) -> AlertSender:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankwatch-alerts", daemon=True)
            self._thread.start()
        return self

    def submit(self, message: Message) -> bool:
        """Store `message` for delivery; False when it was stored before (or could not be stored yet)."""
        try:
            new = self.outbox.enqueue(message, now=self._clock())
        except Exception as exc:
            self.errors += 1
            self._say(f"alerts: could not store {message.id} in {self.outbox.path} ({type(exc).__name__}: {exc}); "
                      "kept in memory, trying again")
            with self._unsaved_lock:
                self._unsaved.append(message)
            new = False
        self._wake.set()
        return new

    def submit_all(self, messages: Iterable[Message]) -> int:
        """Submit in order; returns how many were new."""
        return sum(self.submit(m) for m in messages)

    def stats(self) -> OutboxStats:
        try:
            s = self.outbox.stats()
        except Exception:
            self.errors += 1
            return OutboxStats(pending=len(self._unsaved))
        return OutboxStats(pending=s.pending + len(self._unsaved), delivered=s.delivered, rejected=s.rejected,
                           dead=s.dead)

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (True) or `timeout_s` passed (False). Without a running thread, delivers in
        the caller's thread."""
        deadline = time.monotonic() + timeout_s
        while True:
            inline = self._thread is None or not self._thread.is_alive()
            if inline:
                self._pass()
            if self.stats().pending == 0:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if inline:
                time.sleep(max(0.0, min(self._wait_s(), left)))
            else:
                self._wake.set()
                time.sleep(min(0.02, left))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after its current attempt) and close the outbox; pending messages stay stored."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self.outbox.close()
        except Exception:
            self.errors += 1

    def __enter__(self) -> AlertSender:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_unsaved(self) -> None:
        with self._unsaved_lock:
            waiting, self._unsaved = self._unsaved, []
        for i, m in enumerate(waiting):
            try:
                self.outbox.enqueue(m, now=self._clock())
            except Exception:
                self.errors += 1
                with self._unsaved_lock:
                    self._unsaved[:0] = waiting[i:]
                return

    def _pass(self) -> None:
        try:
            self._save_unsaved()
            for r in self.outbox.deliver_due(self._send, now=self._clock()):
                self._report(r)
        except Exception as exc:
            self.errors += 1
            self._say(f"alerts: delivery pass failed ({type(exc).__name__}: {exc}); trying again")

    def _report(self, r: DeliveryResult) -> None:
        if r.outcome is Outcome.RETRY:
            if r.run not in self._failing:
                self._failing.add(r.run)
                self._say(f"alerts: {r.line()}")
            return
        if r.outcome is Outcome.DELIVERED:
            if r.run in self._failing:
                self._failing.discard(r.run)
                self._say(f"alerts: {r.line()}")
            return
        self._say(f"alerts: {r.line()}")

    def _wait_s(self) -> float:
        try:
            due = self.outbox.next_due()
        except Exception:
            self.errors += 1
            return self._idle_s
        if self._unsaved:
            return min(self._idle_s, 0.5)
        return self._idle_s if due is None else min(self._idle_s, max(0.0, due - self._clock()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._pass()
            if self._stop.is_set():
                return
            self._wake.wait(self._wait_s())
