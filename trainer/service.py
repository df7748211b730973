"""The recovery manager as a service: signed alerts in over HTTP, the existing policy and plan applied to the job it
owns.

    ManagerService(run_dir, secret=..., job=cfg).start()   the object form (tests; port 0 picks a free port)
    serve(run_dir, listen="127.0.0.1:PORT", secret_file=F, job=cfg)   the same, blocking until SIGINT / SIGTERM

A thin shell (Starlette on uvicorn) over `trainer.manager`: the HTTP layer only caps the body, verifies the Standard
Webhooks signature, parses the wire contract into a typed `AlertMessage` and hands it to `Manager`, which owns the
job (trainer.launch in a background thread, ended at once through its `stop` event) and runs `assess` / `apply` —
the same functions `rankwatch recover` and `train --supervise` use.

POST /alerts — rankwatch-signed messages (docs/manager.md has the contract and the codes). Checked in this order:
    413 body over `max_body` (Content-Length, then the streamed read is capped; nothing unbounded is read)
    401 missing webhook-id / -timestamp / -signature, a timestamp that is no integer, a timestamp outside +-5 min,
        a malformed signature header, a signature that does not match
    400 a body that is not UTF-8 JSON of the contract (the message names the missing key), or another run's message
    409 an id already seen with a different body;  200 {"duplicate": true} the same id and body again
    202 a decision accepted (queued);  200 an incident message recorded
Each refusal is one log line (path, request id, why) and a counter in GET /status.

At most once: every accepted id is committed to <run>/manager/state.sqlite with its body's SHA-256 before anything is
done about it (state "accepted"), and a decision is marked "started" (committed) before its action begins, then
"done" or "failed" with the outcome and the recovery id. On a restart, "accepted" decisions (nothing begun) are
queued again; "started" ones are marked "interrupted" and NOT re-run: the action may have partly happened (evidence,
quarantine, a relaunch), so an operator reads <run>/recovery and the lineage and decides (`rankwatch recover`).

What a decision does (only signed "decision" messages act):
    observe                                     recorded, nothing else
    quarantine (no relaunch)                    the manager's policy re-decides the message's incident; its
                                                quarantines are applied (list + lineage + record); the job runs on
    a relaunching action, or a fail-stop/hang   the running attempt is stopped at once, on receipt (SIGTERM, SIGKILL
                                                after term_grace_s; no wait for the collective timeout); then, in the
                                                background, `assess` on the run -> plan (the message's incident is
                                                added when the post-hoc analysis did not raise it) -> `apply`, whose
                                                relaunch is again an attempt the service can stop
Actions are serialized: one worker thread takes decisions in arrival order. A decision arriving while a recovery runs
is queued; when its turn comes, `assess` skips what earlier recoveries handled, so one whose incident the running
recovery covered ends as "covered by recovery-NNNN" with nothing done twice. A decision about an incident of an
attempt that a later attempt already replaced, or about one a recovery acted on (its record names it, or it is in the
plan being applied), never stops the newer attempt.

POST /alertmanager — deliveries of a real Alertmanager (which cannot sign): `Authorization: Bearer <token>` or 401;
deduplicated by groupKey + status + sorted alert fingerprints; recorded as evidence only (<run>/manager/
alertmanager.jsonl, /status). They never stop, roll back or quarantine anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import re
import signal
import socket
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.analytics.alerts import MessageType  # the wire's message types: the sender's, not a copy
from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.analytics.recovery import Action, TargetKind
from rankwatch.trainer.canary import CanaryConfig
from rankwatch.trainer.launch import LaunchResult, launch
from rankwatch.trainer.manager import (
    RECOVERY_DIR, RecoveryPlan, apply, assess, canary_declaration, catalog_view, config_from_run, place_off_quarantine,
    plan_recovery, quarantined,
)
from rankwatch.trainer.runfile import read_launches

__all__ = [
    "DEFAULT_MAX_BODY", "MANAGER_DIR", "STATE_FILE", "TOLERANCE_S", "AlertMessage", "DecisionNote", "FakeLauncher",
    "JobState", "Launcher", "Manager", "ManagerService", "MessageType", "PlacementRefused", "Planner", "Refusal",
    "parse_message", "plan_from_message", "plan_live", "read_secret", "serve",
]

log = logging.getLogger("rankwatch.manager")

MANAGER_DIR = "manager"
STATE_FILE = "state.sqlite"
ALERTMANAGER_LOG = "alertmanager.jsonl"
DEFAULT_MAX_BODY = 1 << 20
"""Bytes; a rankwatch message is a few KiB (an incident carries at most EVIDENCE_ROWS_MAX rows per evidence item)."""
TOLERANCE_S = 300
"""Seconds a webhook-timestamp may be off the service's clock either way (Standard Webhooks' own tolerance)."""
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_STOPPING_CLASSES = frozenset({IncidentClass.FAIL_STOP, IncidentClass.HANG})
_RELAUNCHING = frozenset({Action.RETRY_OPERATION, Action.REBUILD_GROUP, Action.RESTART_REPLICA,
                          Action.ROLLBACK_DOMAIN, Action.RESTART_JOB})
"""The actions the canary carries out as a relaunch (trainer.manager escalates every one of them to RESTART_JOB)."""


class Refusal(StrEnum):
    """Why a request was refused (the keys of /status "refused")."""

    TOO_LARGE = "too_large"
    MISSING_HEADERS = "missing_headers"
    MALFORMED_HEADERS = "malformed_headers"
    """A webhook-id or webhook-timestamp of the wrong shape."""
    STALE_TIMESTAMP = "stale_timestamp"
    MALFORMED_SIGNATURE = "malformed_signature"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED_BODY = "malformed_body"
    WRONG_RUN = "wrong_run"
    REPLAYED_ID = "replayed_id"
    """A seen id with a different body (the same body again is a duplicate, answered 200, not a refusal)."""
    BAD_TOKEN = "bad_token"
    """/alertmanager without the bearer token (or no token configured)."""


class JobState(StrEnum):
    NONE = "none"
    """No attempt launched by this service yet (it was started without a job, or after a restart)."""
    STARTING = "starting"
    RUNNING = "running"
    STOPPED = "stopped"
    """The service stopped the attempt; a recovery follows."""
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


class _Ledger(StrEnum):
    ACCEPTED = "accepted"
    STARTED = "started"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    RECORDED = "recorded"
    """An incident message: recorded, never acted on."""


# ----------------------------------------------------------------------------------------------------- messages


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
            self.decision.action in _RELAUNCHING or self.incident.klass in _STOPPING_CLASSES)


def _get(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    name = f"{where}.{key}" if where else key
    if key not in doc:
        raise ValueError(f"missing key {name!r}")
    value = doc[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"key {name!r} is {type(value).__name__}, not {want}")
    return value


def parse_message(body: bytes) -> AlertMessage:
    """The wire contract's body -> AlertMessage; ValueError naming the first missing or ill-typed key."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("body is not a JSON object")
    for key, kind in (("version", str), ("groupKey", str), ("status", str), ("alerts", list), ("timestamp", str)):
        _get(doc, key, kind)
    try:
        kind_ = MessageType(_get(doc, "type", str))
    except ValueError as exc:
        raise ValueError(f"key 'type': {exc}") from None
    rw = _get(doc, "rankwatch", dict)
    run = _get(rw, "run", str, "rankwatch")
    incident_id = _get(rw, "incident", str, "rankwatch")
    incident = Incident.from_dict(_get(rw, "incident_doc", dict, "rankwatch"))
    if incident.id != incident_id:
        raise ValueError(f"rankwatch.incident {incident_id!r} is not rankwatch.incident_doc.id {incident.id!r}")
    decision: DecisionNote | None = None
    if kind_ is MessageType.DECISION:
        d = _get(rw, "decision", dict, "rankwatch")
        where = "rankwatch.decision"
        try:
            action = Action(_get(d, "action", str, where))
        except ValueError as exc:
            raise ValueError(f"key '{where}.action': {exc}") from None
        quarantines = _get(d, "quarantines", list, where)
        decision = DecisionNote(
            id=_get(d, "id", str, where), action=action, scope=_get(d, "scope", (str, type(None)), where),
            target=_get(d, "target", (str, type(None)), where),
            checkpoint=_get(d, "checkpoint", (str, type(None)), where), quarantines=tuple(str(q) for q in quarantines))
    return AlertMessage(type=kind_, status=doc["status"], run=run, incident_id=incident_id, incident=incident,
                        decision=decision)


# --------------------------------------------------------------------------------------------- the job interface


class Launcher(ABC):
    """Runs one attempt of the job to its end; `stop`, set from another thread, ends it at once (the result's
    `stopped`); `on_start` gets the ranks' pids. The real one is `trainer.launch.launch`; `FakeLauncher` is for
    tests."""

    @abstractmethod
    def __call__(self, cfg: CanaryConfig, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult: ...


class _Launch(Launcher):
    def __call__(self, cfg: CanaryConfig, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult:
        return launch(cfg, stop=stop, on_start=on_start, **kw)


class FakeLauncher(Launcher):
    """A launcher that starts no process. Each call appends the attempt to run.json as the real launcher does (so
    `read_launches`, `config_from_run` and `apply` see it), calls `on_start`, and then follows the next of
    `script`: "run" waits until `stop` is set (or `finish()`, or `wait_s`), "ok" ends at once with exit 0, "fail"
    with exit 1 on rank 0. Past the script's end it ends "ok"."""

    def __init__(self, script: tuple[str, ...] = ("run",), *, wait_s: float = 60.0) -> None:
        for s in script:
            if s not in ("run", "ok", "fail"):
                raise ValueError(f"fake launcher: unknown step {s!r} (run, ok or fail)")
        self._script = list(script)
        self._wait_s = wait_s
        self._finish = threading.Event()
        self.calls: list[CanaryConfig] = []
        self.started = threading.Semaphore(0)
        """Released once per attempt, after on_start."""

    def finish(self) -> None:
        """End the attempt that is waiting ("run") with exit 0."""
        self._finish.set()

    def __call__(self, cfg: CanaryConfig, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult:
        from rankwatch.trainer.launch import record_launch  # the real run.json record, not a look-alike

        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        record_launch(cfg)
        self.calls.append(cfg)
        step = self._script.pop(0) if self._script else "ok"
        pids = tuple(range(1000, 1000 + cfg.world_size))
        on_start(pids)
        self.started.release()
        t0 = time.monotonic()
        stopped = False
        codes: tuple[int | None, ...] = (0,) * cfg.world_size
        if step == "run":
            self._finish.clear()
            while not (stop.is_set() or self._finish.is_set()) and time.monotonic() - t0 < self._wait_s:
                stop.wait(0.01)
            stopped = stop.is_set()
            if stopped:
                codes = (-15,) * cfg.world_size
        elif step == "fail":
            codes = (1,) + (0,) * (cfg.world_size - 1)
        return LaunchResult(run_dir=Path(cfg.run_dir), exit_codes=codes, pids=pids, duration_s=time.monotonic() - t0,
                            terminated=tuple(range(cfg.world_size)) if stopped else (), stopped=stopped)


Planner = Callable[[Path, CanaryConfig, AlertMessage], RecoveryPlan]
"""(run dir, the job's config, the decision message) -> the plan `apply` carries out."""


def plan_from_message(run_dir: Path, cfg: CanaryConfig, message: AlertMessage) -> RecoveryPlan:
    """The manager's own policy on the message's incident alone (no analysis of the run): what a quarantine-only
    decision applies while the job runs on, and the planner for tests with no telemetry."""
    return plan_recovery([message.incident], job=canary_declaration(cfg.layout),
                         catalog=catalog_view(Path(run_dir), cfg.layout))


def plan_live(run_dir: Path, cfg: CanaryConfig, message: AlertMessage) -> RecoveryPlan:
    """After the attempt ended: `assess` the run (post-hoc analysis, new incidents only), with the message's
    incident among them when that reading did not raise it (the live window saw the fault before the telemetry
    showed it to the post-hoc reading, or the stop cut it short) — no incident of its class about its subject — and
    no recovery has handled it yet and it belongs to the latest attempt, so a job the service stopped is not left
    stopped for want of a second sighting. (The live and the post-hoc readings may give one fault different ids:
    their onset steps can differ.)"""
    run_dir = Path(run_dir)
    inc = message.incident
    latest = len(read_launches(run_dir)) - 1
    return assess(run_dir, layout=cfg.layout, also=() if inc.attempt is not None and inc.attempt < latest else (inc,))


def _covering(run_dir: Path, incident_id: str) -> str | None:
    """The recovery that acted on `incident_id`, if one did."""
    for rec in sorted((run_dir / RECOVERY_DIR).glob("recovery-*.json")):
        try:
            if incident_id in json.loads(rec.read_text())["incidents"]:
                return rec.stem
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _latest_recovery(run_dir: Path) -> str | None:
    recs = sorted((run_dir / RECOVERY_DIR).glob("recovery-*.json"))
    return recs[-1].stem if recs else None


# ---------------------------------------------------------------------------------------------------- the ledger


_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id TEXT PRIMARY KEY, sha256 TEXT NOT NULL, type TEXT NOT NULL, incident TEXT NOT NULL, decision_id TEXT,
    action TEXT, state TEXT NOT NULL, outcome TEXT, recovery_id TEXT, received_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS incidents (
    id TEXT PRIMARY KEY, status TEXT NOT NULL, class TEXT NOT NULL, subject TEXT NOT NULL, summary TEXT NOT NULL,
    updated_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS alertmanager (
    key TEXT PRIMARY KEY, group_key TEXT NOT NULL, status TEXT NOT NULL, alerts INTEGER NOT NULL,
    received_ns INTEGER NOT NULL);
"""


class _State:
    """<run>/manager/state.sqlite, one table per concern: messages (every accepted webhook id, its body hash, and
    for decisions the action's progress and the recovery id), incidents (open or resolved, from incident messages),
    alertmanager (deduplicated deliveries). Every write is committed before the caller acts on it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._con = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._con.execute("PRAGMA journal_mode=WAL")
        self._con.execute("PRAGMA synchronous=FULL")
        self._con.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._con.close()

    def admit(self, msg_id: str, sha: str, body: bytes, m: AlertMessage) -> tuple[str, str | None, str | None]:
        """('new' | 'duplicate' | 'conflict', state, outcome) — a new id is committed before this returns."""
        now = time.time_ns()
        with self._lock:
            self._con.execute("BEGIN IMMEDIATE")
            try:
                row = self._con.execute("SELECT sha256, state, outcome FROM messages WHERE id = ?",
                                        (msg_id,)).fetchone()
                if row is not None:
                    self._con.execute("COMMIT")
                    return ("duplicate" if row[0] == sha else "conflict", row[1], row[2])
                state = _Ledger.ACCEPTED if m.type is MessageType.DECISION else _Ledger.RECORDED
                d = m.decision
                self._con.execute(
                    "INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, ?)",
                    (msg_id, sha, str(m.type), m.incident_id, d.id if d else None, str(d.action) if d else None,
                     str(state), now, now, body))
                if m.type is not MessageType.DECISION:
                    status = "resolved" if m.type is MessageType.RESOLVED else "firing"
                    self._con.execute(
                        "INSERT INTO incidents VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                        "status = excluded.status, summary = excluded.summary, updated_ns = excluded.updated_ns",
                        (m.incident_id, status, str(m.incident.klass), str(m.incident.subject), m.incident.summary,
                         now))
                self._con.execute("COMMIT")
            except BaseException:
                self._con.execute("ROLLBACK")
                raise
        return ("new", str(state), None)

    def mark(self, msg_id: str, state: _Ledger, *, outcome: str | None = None, recovery_id: str | None = None) -> None:
        with self._lock:
            self._con.execute("UPDATE messages SET state = ?, outcome = coalesce(?, outcome), "
                              "recovery_id = coalesce(?, recovery_id), updated_ns = ? WHERE id = ?",
                              (str(state), outcome, recovery_id, time.time_ns(), msg_id))

    def recover(self) -> tuple[list[tuple[str, bytes]], list[str]]:
        """At start: (decisions accepted but never started, to queue again in order; ids marked interrupted)."""
        with self._lock:
            started = [r[0] for r in self._con.execute("SELECT id FROM messages WHERE state = ?", (_Ledger.STARTED,))]
            self._con.execute("UPDATE messages SET state = ?, outcome = ?, updated_ns = ? WHERE state = ?",
                              (str(_Ledger.INTERRUPTED), "the service stopped while this action ran; not re-run: read "
                               "<run>/recovery and the lineage, then `rankwatch recover`", time.time_ns(),
                               str(_Ledger.STARTED)))
            queued = [(r[0], r[1]) for r in self._con.execute(
                "SELECT id, body FROM messages WHERE state = ? ORDER BY received_ns", (_Ledger.ACCEPTED,))]
        return queued, started

    def admit_alertmanager(self, key: str, group_key: str, status: str, alerts: int) -> bool:
        with self._lock:
            cur = self._con.execute("INSERT OR IGNORE INTO alertmanager VALUES (?, ?, ?, ?, ?)",
                                    (key, group_key, status, alerts, time.time_ns()))
            return cur.rowcount == 1

    def summary(self) -> dict[str, Any]:
        with self._lock:
            incidents = [dict(zip(("id", "class", "subject", "summary", "updated_ns"), r)) for r in self._con.execute(
                "SELECT id, class, subject, summary, updated_ns FROM incidents WHERE status = 'firing' "
                "ORDER BY updated_ns")]
            cols = ("id", "decision_id", "incident", "action", "state", "outcome", "recovery_id", "received_ns")
            decisions = [dict(zip(cols, r)) for r in self._con.execute(
                f"SELECT {', '.join(cols)} FROM messages WHERE type = 'decision' ORDER BY received_ns")]
            am = self._con.execute("SELECT count(*), max(received_ns) FROM alertmanager").fetchone()
            last_am = self._con.execute("SELECT group_key, status, alerts, received_ns FROM alertmanager "
                                        "ORDER BY received_ns DESC LIMIT 1").fetchone()
        return {
            "open_incidents": incidents,
            "decisions": decisions,
            "alertmanager": {"deliveries": am[0], "last": None if last_am is None else dict(zip(
                ("groupKey", "status", "alerts", "received_ns"), last_am))},
        }


# --------------------------------------------------------------------------------------------------- the manager


@dataclass(slots=True)
class _Attempt:
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    number: int | None = None
    pids: tuple[int, ...] = ()
    result: LaunchResult | None = None


class PlacementRefused(RuntimeError):
    """No placement of the job avoids the quarantine list; nothing was launched."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    status: int
    body: dict[str, Any]


class Manager:
    """The service's state and actions, without HTTP: the ledger, the job, one worker applying decisions in order."""

    def __init__(self, run_dir: Path, *, job: CanaryConfig | None = None, launcher: Launcher | None = None,
                 planner: Planner = plan_live, launch_kw: Mapping[str, Any] | None = None,
                 stop_wait_s: float = 60.0) -> None:
        self.run_dir = Path(run_dir).resolve()
        if job is not None and Path(job.run_dir).resolve() != self.run_dir:
            raise ValueError(f"job run dir {job.run_dir} is not the service's run dir {self.run_dir}")
        self._job = job
        self._launcher = launcher or _Launch()
        self._planner = planner
        self._launch_kw = dict(launch_kw or {})
        self._stop_wait_s = stop_wait_s
        self._lock = threading.Lock()
        self._state = JobState.NONE
        self._current: _Attempt | None = None
        self._results: dict[int, LaunchResult] = {}
        self._refused: Counter[str] = Counter()
        self._queue: queue.Queue[tuple[str, AlertMessage] | None] = queue.Queue()
        self._closing = False
        self._acting: frozenset[str] = frozenset()
        """The incidents of the plan being applied (its record is written only once the relaunch ends)."""
        self._db: _State | None = None
        self._worker: threading.Thread | None = None
        self._job_thread: threading.Thread | None = None
        self.interrupted: tuple[str, ...] = ()

    @property
    def state_path(self) -> Path:
        return self.run_dir / MANAGER_DIR / STATE_FILE

    @property
    def db(self) -> _State:
        assert self._db is not None, "manager not started"
        return self._db

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._db = _State(self.state_path)
        queued, interrupted = self._db.recover()
        self.interrupted = tuple(interrupted)
        for msg_id in interrupted:
            log.warning("decision %s was started before the service stopped: marked interrupted, not re-run", msg_id)
        for msg_id, body in queued:
            try:
                message = parse_message(body)
            except ValueError as exc:  # accepted by an older build of this contract
                self._db.mark(msg_id, _Ledger.FAILED, outcome=f"not queued again: {exc}")
                continue
            log.info("decision %s accepted before the service stopped and never started: queued again", msg_id)
            self._queue.put((msg_id, message))
        self._worker = threading.Thread(target=self._work, name="rankwatch-manager", daemon=True)
        self._worker.start()
        if self._job is not None:
            job = self._job
            self._job_thread = threading.Thread(target=self._first_attempt, args=(job,), name="rankwatch-job",
                                                daemon=True)
            self._job_thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the running attempt, let the worker finish what it holds (queued decisions stay accepted for the
        next start), and close the state file."""
        with self._lock:
            self._closing = True
            if self._current is not None:
                self._current.stop.set()
        self._queue.put(None)
        for t in (self._worker, self._job_thread):
            if t is not None:
                t.join(timeout_s)
        if self._db is not None:
            self._db.close()

    # --------------------------------------------------------------------------------------------- requests

    def refuse(self, reason: Refusal, path: str, msg_id: str | None, why: str, status: int) -> Reply:
        with self._lock:
            self._refused[str(reason)] += 1
        log.warning("refused %s %s: %s: %s", path, msg_id or "-", reason, why)
        return Reply(status=status, body={"error": str(reason), "detail": why})

    def submit(self, msg_id: str, body: bytes, message: AlertMessage) -> Reply:
        """A verified, parsed message: committed, then (for a decision) the job stopped if it must be, and queued."""
        if message.run != self.run_dir.name:
            return self.refuse(Refusal.WRONG_RUN, "/alerts", msg_id,
                               f"message for run {message.run!r}, this manager serves {self.run_dir.name!r}", 400)
        sha = hashlib.sha256(body).hexdigest()
        verdict, state, outcome = self.db.admit(msg_id, sha, body, message)
        if verdict == "duplicate":
            log.info("duplicate %s (%s): already %s", msg_id, message.type, state)
            return Reply(status=200, body={"duplicate": True, "id": msg_id, "state": state, "outcome": outcome})
        if verdict == "conflict":
            return self.refuse(Refusal.REPLAYED_ID, "/alerts", msg_id, "id already seen with a different body", 409)
        if message.type is not MessageType.DECISION:
            log.info("incident %s %s (%s)", message.incident_id, message.status, msg_id)
            return Reply(status=200, body={"recorded": True, "id": msg_id})
        stopping = message.stops_job and self._stop_for(message)
        self._queue.put((msg_id, message))
        assert message.decision is not None
        log.info("decision %s (%s %s for %s): queued%s", msg_id, message.decision.id, message.decision.action,
                 message.incident_id, "; the running attempt is being stopped" if stopping else "")
        return Reply(status=202, body={"accepted": True, "id": msg_id, "stopping": stopping})

    def record_alertmanager(self, doc: dict[str, Any]) -> Reply:
        """An Alertmanager delivery: evidence only. ValueError names what the document lacks."""
        group_key = _get(doc, "groupKey", str)
        status = _get(doc, "status", str)
        alerts = _get(doc, "alerts", list)
        prints = sorted(str(_get(a, "fingerprint", str, "alerts[]")) if isinstance(a, dict) else "" for a in alerts)
        key = hashlib.sha256("\n".join([group_key, status, *prints]).encode()).hexdigest()
        if not self.db.admit_alertmanager(key, group_key, status, len(alerts)):
            return Reply(status=200, body={"duplicate": True})
        line = {"received_ns": time.time_ns(), "key": key, "groupKey": group_key, "status": status,
                "fingerprints": prints, "delivery": doc}
        with open(self.run_dir / MANAGER_DIR / ALERTMANAGER_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
        log.info("alertmanager delivery %s %s (%d alert(s)): recorded as evidence", group_key, status, len(alerts))
        return Reply(status=200, body={"recorded": True, "evidence_only": True})

    def status(self) -> dict[str, Any]:
        with self._lock:
            state, refused = self._state, dict(self._refused)
            cur = self._current
            results = dict(self._results)
        try:
            launches = read_launches(self.run_dir, missing_ok=True)
            launch_error = None
        except ValueError as exc:
            launches, launch_error = [], str(exc)
        attempts: list[dict[str, Any]] = []
        for rec in launches:
            n = int(rec.get("attempt", len(attempts)))
            r = results.get(n)
            attempts.append({"attempt": n, "started_wall_ns": rec.get("started_wall_ns"),
                             "resume_from": rec.get("resume_from"),
                             "exit_codes": None if r is None else list(r.exit_codes),
                             "stopped": None if r is None else r.stopped})
        s = self.db.summary()
        decisions = s.pop("decisions")
        return {
            "run": self.run_dir.name, "run_dir": str(self.run_dir),
            "job": {"state": str(state), "owned": self._job is not None or cur is not None,
                    "attempt": None if cur is None else cur.number, "pids": [] if cur is None else list(cur.pids)},
            "attempts": attempts, **({"attempts_error": launch_error} if launch_error else {}),
            **s,
            "last_decision": decisions[-1] if decisions else None,
            "decisions": dict(sorted(Counter(str(d["state"]) for d in decisions).items())),
            "interrupted": list(self.interrupted),
            "refused": refused,
        }

    # ---------------------------------------------------------------------------------------------- the job

    def _stop_for(self, message: AlertMessage) -> bool:
        """Stop the running attempt for `message`, unless the incident belongs to an attempt already replaced."""
        with self._lock:
            cur = self._current
            if cur is None or cur.done.is_set():
                return False
            inc_attempt = message.incident.attempt
            if inc_attempt is not None and cur.number is not None and inc_attempt < cur.number:
                return False
            if message.incident.id in self._acting:  # the running attempt is the recovery from this very incident
                return False
        if _covering(self.run_dir, message.incident.id) is not None:
            return False
        with self._lock:
            if cur.done.is_set():
                return False
            cur.stop.set()
            return True

    def _first_attempt(self, cfg: CanaryConfig) -> None:
        try:
            self._run_attempt(cfg)
        except Exception as exc:
            log.error("the job's first attempt did not run: %s: %s", type(exc).__name__, exc)

    def _run_attempt(self, cfg: CanaryConfig, **kw: Any) -> LaunchResult:
        """One attempt through the launcher, with a stop event the request handler can set (also the launcher
        `apply` relaunches with)."""
        cfg = self._placed(cfg)
        attempt = _Attempt()
        with self._lock:
            if self._closing:
                raise RuntimeError("the service is closing: no new attempt")
            self._current = attempt
            if self._state is not JobState.RECOVERING:
                self._state = JobState.STARTING

        def started(pids: tuple[int, ...]) -> None:
            number = len(read_launches(self.run_dir, missing_ok=True)) - 1
            with self._lock:
                attempt.pids, attempt.number = tuple(pids), number
                self._state = JobState.RUNNING
            log.info("attempt %d running: pids %s", number, list(pids))

        try:
            result = self._launcher(cfg, stop=attempt.stop, on_start=started, **{**self._launch_kw, **kw})
        except BaseException:
            with self._lock:
                self._state = JobState.FAILED
            attempt.done.set()
            raise
        with self._lock:
            attempt.result = result
            if attempt.number is not None:
                self._results[attempt.number] = result
            self._state = (JobState.STOPPED if result.stopped else JobState.FINISHED if result.ok else JobState.FAILED)
        attempt.done.set()
        log.info("attempt %s ended: %s, exit codes %s", attempt.number, self._state, list(result.exit_codes))
        return result

    def _placed(self, cfg: CanaryConfig) -> CanaryConfig:
        """`cfg` off every quarantined device and host of the virtual topology (`manager.place_off_quarantine`).
        PlacementRefused when nothing is left: the attempt is not launched."""
        try:
            return place_off_quarantine(self.run_dir, cfg, say=lambda m: log.info("%s", m))
        except ValueError as exc:
            with self._lock:
                self._state = JobState.FAILED
            log.error("placement refused: %s", exc)
            raise PlacementRefused(f"placement refused: {exc}") from None

    # ----------------------------------------------------------------------------------------------- worker

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                if self._closing:
                    return  # what is left stays "accepted": the next start queues it again
            msg_id, message = item
            self.db.mark(msg_id, _Ledger.STARTED)
            try:
                outcome, rid = self._act(message)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                log.error("decision %s failed: %s", msg_id, why)
                self.db.mark(msg_id, _Ledger.FAILED, outcome=why)
                continue
            log.info("decision %s: %s%s", msg_id, outcome, f" ({rid})" if rid else "")
            self.db.mark(msg_id, _Ledger.DONE, outcome=outcome, recovery_id=rid)

    def _config(self) -> CanaryConfig:
        if self._job is not None:
            return self._job
        return config_from_run(self.run_dir)  # a service (re)started without a job: the run's latest launch

    def _act(self, message: AlertMessage) -> tuple[str, str | None]:
        d = message.decision
        assert d is not None
        if d.action is Action.OBSERVE:
            return "observed: nothing to do", None
        cfg = self._config()
        if not message.stops_job:
            plan = plan_from_message(self.run_dir, cfg, message)
            if plan.relaunch:  # only a relaunching decision (or a fail-stop / hang) may stop the job
                plan = replace(plan, action=Action.QUARANTINE if plan.quarantines else Action.OBSERVE, checkpoint=None)
            if not plan.quarantines:
                return "observed: the manager's policy finds nothing to quarantine", None
            listed = {(str(e.get("kind")), str(e.get("id"))) for e in quarantined(self.run_dir)}
            if all((str(t.kind), t.id) in listed for t, _ in plan.quarantines):
                return (f"observed: {', '.join(str(t) for t, _ in plan.quarantines)} quarantined already",
                        _covering(self.run_dir, message.incident.id))
            rec = apply(cfg, plan, launcher=self._no_launch)
            return rec.outcome, rec.id
        latest = len(read_launches(self.run_dir, missing_ok=True)) - 1
        inc_attempt = message.incident.attempt
        if inc_attempt is not None and inc_attempt < latest:
            return (f"covered: incident of attempt {inc_attempt}, which attempt {latest} replaced",
                    _latest_recovery(self.run_dir))
        covering = _covering(self.run_dir, message.incident.id)
        if covering is not None:  # acted on already (the same incident reported again, or by the post-hoc reading)
            return f"covered by {covering}: acted on already", covering
        with self._lock:
            cur = self._current
        if cur is not None and not cur.done.is_set():
            cur.stop.set()  # a decision queued again after a restart, or one that came in before the pids
            if not cur.done.wait(self._stop_wait_s):
                raise RuntimeError(f"attempt {cur.number} did not end {self._stop_wait_s:.0f} s after the stop")
        with self._lock:
            before = self._state
            self._state = JobState.RECOVERING
        plan = self._planner(self.run_dir, cfg, message)
        for line in plan.lines():
            log.info("plan: %s", line)
        if not plan.relaunch and not plan.quarantines:
            with self._lock:
                self._state = before
            covering = _covering(self.run_dir, message.incident.id)
            if covering is not None:
                return f"covered by {covering}: nothing new to act on", covering
            return f"nothing to recover ({plan.lines()[-1]}); the job stays {before}", None
        with self._lock:
            self._acting = frozenset({*(d.incident.id for d in plan.decided), *plan.skipped, message.incident.id})
        try:
            rec = apply(cfg, plan, launcher=self._run_attempt, say=lambda s: log.info("%s", s))
        finally:
            with self._lock:
                self._acting = frozenset()
        if rec.refused:  # nothing left to place the job on off the quarantine list (the record says so)
            with self._lock:
                self._state = JobState.FAILED
            log.error("placement refused: %s", rec.refused)
            raise PlacementRefused(f"{rec.id}: placement refused: {rec.refused}")
        with self._lock:
            if self._state is JobState.RECOVERING:  # no relaunch (quarantine only)
                self._state = before
        return rec.outcome, rec.id

    @staticmethod
    def _no_launch(cfg: CanaryConfig, **kw: Any) -> LaunchResult:
        raise AssertionError("a quarantine-only plan relaunched")


# ---------------------------------------------------------------------------------------------------- HTTP layer


def read_secret(path: Path) -> str:
    """The signing secret file: one line "whsec_<base64>" (>= 24 bytes); the sender's parser
    (`analytics.alerts.load_secret`), so both sides read the file alike. ValueError naming the file otherwise."""
    from rankwatch.analytics.alerts import load_secret

    return load_secret(path)


def _app(manager: Manager, *, secret: str, token: str | None, max_body: int) -> Any:
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    hook = Webhook(secret)

    def reply(r: Reply) -> JSONResponse:
        return JSONResponse(r.body, status_code=r.status)

    async def body_of(request: Request) -> bytes | None:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return None
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > max_body:
                return None
        return bytes(buf)

    async def alerts(request: Request) -> JSONResponse:
        h = request.headers
        msg_id = h.get("webhook-id")
        body = await body_of(request)
        if body is None:
            return reply(manager.refuse(Refusal.TOO_LARGE, "/alerts", msg_id, f"body over {max_body} bytes", 413))
        ts, sig = h.get("webhook-timestamp"), h.get("webhook-signature")
        if not (msg_id and ts and sig):
            missing = [n for n, v in (("webhook-id", msg_id), ("webhook-timestamp", ts), ("webhook-signature", sig))
                       if not v]
            return reply(manager.refuse(Refusal.MISSING_HEADERS, "/alerts", msg_id, f"no {', '.join(missing)}", 401))
        if not _ID_RE.fullmatch(msg_id):
            return reply(manager.refuse(Refusal.MALFORMED_HEADERS, "/alerts", msg_id[:40],
                                        "webhook-id is not 1-128 of [A-Za-z0-9_.:-]", 401))
        if not ts.isdigit():
            return reply(manager.refuse(Refusal.MALFORMED_HEADERS, "/alerts", msg_id,
                                        f"webhook-timestamp {ts[:20]!r} is not integer seconds", 401))
        skew = int(ts) - time.time()
        if abs(skew) > TOLERANCE_S:
            return reply(manager.refuse(Refusal.STALE_TIMESTAMP, "/alerts", msg_id,
                                        f"timestamp {skew:+.0f} s off this clock (allowed +-{TOLERANCE_S})", 401))
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alerts", msg_id, "body is not UTF-8", 400))
        try:
            hook.verify(text, {"webhook-id": msg_id, "webhook-timestamp": ts, "webhook-signature": sig},
                        json_parse=False)
        except WebhookVerificationError as exc:
            return reply(manager.refuse(Refusal.BAD_SIGNATURE, "/alerts", msg_id, str(exc), 401))
        except ValueError as exc:  # standardwebhooks on a signature header of the wrong shape
            return reply(manager.refuse(Refusal.MALFORMED_SIGNATURE, "/alerts", msg_id,
                                        f"webhook-signature unreadable ({type(exc).__name__})", 401))
        try:
            message = parse_message(body)
        except ValueError as exc:
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alerts", msg_id, str(exc), 400))
        return reply(manager.submit(msg_id, body, message))

    async def alertmanager(request: Request) -> JSONResponse:
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").encode() if auth.startswith("Bearer ") else b""
        if token is None or not given or not hmac.compare_digest(given, token.encode()):
            why = "no bearer token configured" if token is None else "missing or wrong bearer token"
            return reply(manager.refuse(Refusal.BAD_TOKEN, "/alertmanager", None, why, 401))
        body = await body_of(request)
        if body is None:
            return reply(manager.refuse(Refusal.TOO_LARGE, "/alertmanager", None, f"body over {max_body} bytes", 413))
        try:
            doc = json.loads(body.decode("utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("body is not a JSON object")
            return reply(manager.record_alertmanager(doc))
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError among them
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alertmanager", None, str(exc), 400))

    async def status(request: Request) -> JSONResponse:
        return JSONResponse(manager.status())

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/alerts", alerts, methods=["POST"]),
        Route("/alertmanager", alertmanager, methods=["POST"]),
        Route("/status", status, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ])


class ManagerService:
    """The manager and its HTTP server. `start()` returns once the server listens (`port` is the bound one, also
    with port 0); `stop()` ends the server, then stops the job and closes the state file."""

    def __init__(self, run_dir: Path, *, secret: str, token: str | None = None, job: CanaryConfig | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_body: int = DEFAULT_MAX_BODY,
                 launcher: Launcher | None = None, planner: Planner = plan_live,
                 launch_kw: Mapping[str, Any] | None = None, log_level: str = "warning") -> None:
        if max_body < 1024:
            raise ValueError(f"max_body {max_body}: must be >= 1024 bytes")
        from standardwebhooks.webhooks import Webhook

        Webhook(secret)  # an empty or non-base64 secret fails here, not on the first request
        self.manager = Manager(run_dir, job=job, launcher=launcher, planner=planner, launch_kw=launch_kw)
        self._app = _app(self.manager, secret=secret, token=token, max_body=max_body)
        self._host, self._port, self._log_level = host, port, log_level
        self._server: Any = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("manager service listens on %s, not loopback: anyone who can reach it and holds the secret "
                        "can stop the job", host)

    def _make_server(self) -> Any:
        import uvicorn

        config = uvicorn.Config(self._app, host=self._host, port=self._port, log_level=self._log_level,
                                lifespan="off", ws="none", access_log=False)
        return uvicorn.Server(config)

    def _bind(self) -> socket.socket:
        """The listening socket, bound before anything is launched: an address in use fails here, job untouched."""
        sock = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as exc:
            sock.close()
            raise ValueError(f"{self._host}:{self._port}: cannot listen ({exc.strerror})") from None
        self._sock = sock
        return sock

    @property
    def port(self) -> int:
        assert self._sock is not None, "service not started"
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ManagerService:
        sock = self._bind()
        self.manager.start()
        self._server = self._make_server()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="rankwatch-manager-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.manager.close()
                raise RuntimeError(f"manager service: could not listen on {self._host}:{self._port}")
            time.sleep(0.01)
        log.info("manager service for %s on %s", self.manager.run_dir, self.url)
        return self

    def run_forever(self) -> None:
        """Serve in the calling (main) thread until SIGINT / SIGTERM (uvicorn's handlers), then close."""
        sock = self._bind()
        self.manager.start()
        self._server = self._make_server()
        log.info("manager service for %s on %s", self.manager.run_dir, self.url)
        # uvicorn shuts down on SIGINT/SIGTERM, restores the handlers it found and raises the signal again: with the
        # default handlers the process would die there, before the job is stopped and the state file closed
        main = threading.current_thread() is threading.main_thread()
        found = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._server.run(sockets=[sock])
        finally:
            self.manager.close()
            sock.close()
            for sig, handler in found.items():
                signal.signal(sig, handler)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10.0)
        self.manager.close()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> ManagerService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(run_dir: Path, *, listen: str = "127.0.0.1:8787", secret_file: Path, token_file: Path | None = None,
          job: CanaryConfig | None = None, max_body: int = DEFAULT_MAX_BODY,
          launch_kw: Mapping[str, Any] | None = None, log_level: str = "info") -> int:
    """`rankwatch manager serve`: the service on `listen` (HOST:PORT, loopback by default) until SIGINT/SIGTERM.
    With `job`, it launches that job first; without, it acts on the run as <run>/run.json last recorded it."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT (e.g. 127.0.0.1:8787)")
    secret = read_secret(secret_file)
    token = None
    if token_file is not None:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{token_file}: unreadable token file ({exc.strerror})") from None
        if not token:
            raise ValueError(f"{token_file}: empty token file")
    ManagerService(run_dir, secret=secret, token=token, job=job, host=host.strip("[]"), port=int(port),
                   max_body=max_body, launch_kw=launch_kw, log_level=log_level).run_forever()
    return 0
