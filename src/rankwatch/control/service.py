"""The recovery manager as a service: signed alerts in over HTTP, the existing policy and plan applied to the job it
owns.

    ManagerService(run_dir, secret=..., job=cfg).start()   the object form (tests; port 0 picks a free port)
    serve(run_dir, listen="127.0.0.1:PORT", secret_file=F, job=cfg)   the same, blocking until SIGINT / SIGTERM

A thin shell (Starlette on uvicorn) over `control.manager`: the HTTP layer only caps the body, verifies the Standard
Webhooks signature, parses the wire contract into a typed `AlertMessage` (`control.wire`) and hands it to `Manager`,
which owns the job (its `Launcher` in a background thread, ended at once through its `stop` event) and runs
`assess` / `apply` — the same functions `rankwatch recover` and `train --supervise` use. The job is any
`recovery.job.Job` with its `Launcher`; a service started without one reads the run's latest launch back through
`load_job` (the canary's: `CanaryConfig.from_run`). The ledger is `control.ledger`.

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
attempt that a later attempt already replaced (`replaced`: also one of unknown attempt found before the relaunch
started, with the relaunch resumed from before its onset), or about one a recovery acted on (its record names it, or
it is in the plan being applied), never stops the newer attempt.

POST /alertmanager — deliveries of a real Alertmanager (which cannot sign): `Authorization: Bearer <token>` or 401;
deduplicated by groupKey + status + sorted alert fingerprints; recorded as evidence only (<run>/manager/
alertmanager.jsonl, /status). They never stop, roll back or quarantine anything.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import queue
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.analytics.incidents import Incident
from rankwatch.base.rundir import RunDir, read_launches
from rankwatch.control.http import BodyRefused, Edge, GuardedServer, HttpLimits, read_body, server_config
from rankwatch.control.ledger import Ledger, MessageState
from rankwatch.control.manager import (
    Planner, apply, covering, latest_recovery, place_off_quarantine, plan_from_message, plan_live, quarantined,
)
from rankwatch.control.signer import load_secret, signature_problem
from rankwatch.control.wire import AlertMessage, MessageType, json_object, parse_message, typed_key
from rankwatch.recovery.catalog import checkpoint_step
from rankwatch.recovery.decision import Action
from rankwatch.recovery.job import Job, JobLoader, LaunchResult, Launcher

__all__ = [
    "DEFAULT_MAX_BODY", "TOLERANCE_S", "JobState", "Manager", "ManagerService", "PlacementRefused",
    "Refusal", "Reply", "read_secret", "serve",
]

log = logging.getLogger("rankwatch.manager")

DEFAULT_MAX_BODY = 1 << 20
"""Bytes; a rankwatch message is a few KiB (an incident carries at most EVIDENCE_ROWS_MAX rows per evidence item)."""
TOLERANCE_S = 300
"""Seconds a webhook-timestamp may be off the service's clock either way (Standard Webhooks' own tolerance)."""
STATUS_LATEST = 20
"""/status lists at most this many of anything that grows (open incidents, attempts), with the count beside it."""
_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_TIMESTAMP_RE = re.compile(r"[0-9]{1,12}")
"""Integer seconds in ASCII digits: `str.isdigit` also takes other scripts' digits ("\\xb2"), which `int` refuses,
and an unbounded run of digits overflows the float of the skew."""


def shown(value: object, limit: int = 80) -> str:
    """A value that came from a client as a log line may show it: quoted, escaped (no line breaks, no field that
    reads as ours), at most `limit` characters of it."""
    if value is None:
        return "-"
    text = str(value)
    return json.dumps(text[:limit] + ("..." if len(text) > limit else ""))


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
    """/alertmanager (or /status, when a token is configured) without the bearer token (or no token configured)."""
    NOT_LOOPBACK = "not_loopback"
    """/status from an address that is not loopback, and no token configured to let it in."""
    TOO_MANY_CONNECTIONS = "too_many_connections"
    """Over the connection caps (all clients, or one address), or no body-reader slot free (`control.http`)."""
    HEADER_TIMEOUT = "header_timeout"
    """The request line and headers did not complete in time; the connection was closed (`control.http`)."""
    BODY_TIMEOUT = "body_timeout"
    """The body did not arrive at the minimum rate (a Content-Length it never fills, a trickle)."""
    HEADERS_TOO_LARGE = "headers_too_large"
    """Request line and headers over `HttpLimits.max_header_bytes` (431)."""
    MALFORMED_REQUEST = "malformed_request"
    """Not HTTP that h11 can read: headers over the cap, a Content-Length that is no number (`control.http`)."""
    SHUTTING_DOWN = "shutting_down"
    """A body read in progress when the service began to stop (503, Retry-After: the sender tries again)."""
    CLIENT_GONE = "client_gone"
    """The client went away before its body was read (nothing to answer; counted and logged once)."""


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

    def __init__(self, run_dir: Path, *, launcher: Launcher, job: Job | None = None, load_job: JobLoader | None = None,
                 planner: Planner = plan_live, launch_kw: Mapping[str, Any] | None = None,
                 stop_wait_s: float = 60.0) -> None:
        self.run_dir = Path(run_dir).resolve()
        if job is not None and Path(job.run_dir).resolve() != self.run_dir:
            raise ValueError(f"job run dir {job.run_dir} is not the service's run dir {self.run_dir}")
        self._job = job
        self._launcher = launcher
        self._load_job = load_job
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
        self._received: dict[str, int] = {}
        """When each decision message queued since this start arrived (wall ns): its plan's detection, where earlier
        (`RecoveryPlan.seen`). One queued again after a restart has none."""
        self._db: Ledger | None = None
        self._worker: threading.Thread | None = None
        self._job_thread: threading.Thread | None = None
        self.interrupted: tuple[str, ...] = ()

    @property
    def state_path(self) -> Path:
        return RunDir(self.run_dir).manager_state

    @property
    def db(self) -> Ledger:
        assert self._db is not None, "manager not started"
        return self._db

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._db = Ledger(self.state_path)
        queued, interrupted = self._db.recover()
        self.interrupted = tuple(interrupted)
        for msg_id in interrupted:
            log.warning("decision %s was started before the service stopped: marked interrupted, not re-run", msg_id)
        for msg_id, body in queued:
            try:
                message = parse_message(body)
            except ValueError as exc:  # accepted by an older build of this contract
                self._db.mark(msg_id, MessageState.FAILED, outcome=f"not queued again: {exc}")
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
        """Count and log (one line, what came from the client quoted and cut short) a refused request."""
        with self._lock:
            self._refused[str(reason)] += 1
        log.warning("refused %s %s: %s: %s", path, shown(msg_id), reason, why)
        return Reply(status=status, body={"error": str(reason), "detail": why})

    def refused_at_edge(self, reason: str, client: str) -> None:
        """A connection or request refused by the HTTP edge (`control.http`): counted and logged like a request."""
        with self._lock:
            self._refused[reason] += 1
        log.warning("refused connection from %s: %s", shown(client), reason)

    def submit(self, msg_id: str, body: bytes, message: AlertMessage) -> Reply:
        """A verified, parsed message: committed, then (for a decision) the job stopped if it must be, and queued."""
        if message.run != self.run_dir.name:
            return self.refuse(Refusal.WRONG_RUN, "/alerts", msg_id,
                               f"message for run {message.run!r}, this manager serves {self.run_dir.name!r}", 400)
        sha = hashlib.sha256(body).hexdigest()
        verdict, state, outcome = self.db.admit(msg_id, sha, body, message)
        if verdict == "duplicate":
            log.info("duplicate %s (%s): already %s", msg_id, message.type, state)  # msg_id matched _ID_RE
            return Reply(status=200, body={"duplicate": True, "id": msg_id, "state": state, "outcome": outcome})
        if verdict == "conflict":
            return self.refuse(Refusal.REPLAYED_ID, "/alerts", msg_id, "id already seen with a different body", 409)
        if message.type is not MessageType.DECISION:
            log.info("incident %s %s (%s)", shown(message.incident_id), message.status, msg_id)
            return Reply(status=200, body={"recorded": True, "id": msg_id})
        with self._lock:
            self._received[msg_id] = time.time_ns()
        stopping = message.stops_job and self._stop_for(message)
        self._queue.put((msg_id, message))
        assert message.decision is not None
        log.info("decision %s (%s %s for %s): queued%s", msg_id, shown(message.decision.id), message.decision.action,
                 shown(message.incident_id), "; the running attempt is being stopped" if stopping else "")
        return Reply(status=202, body={"accepted": True, "id": msg_id, "stopping": stopping})

    def record_alertmanager(self, doc: dict[str, Any]) -> Reply:
        """An Alertmanager delivery: evidence only. ValueError names what the document lacks."""
        group_key = typed_key(doc, "groupKey", str)
        status = typed_key(doc, "status", str)
        alerts = typed_key(doc, "alerts", list)
        prints = sorted(str(typed_key(a, "fingerprint", str, "alerts[]")) if isinstance(a, dict) else "" for a in alerts)
        key = hashlib.sha256("\n".join([group_key, status, *prints]).encode()).hexdigest()
        if not self.db.admit_alertmanager(key, group_key, status, len(alerts)):
            return Reply(status=200, body={"duplicate": True})
        line = {"received_ns": time.time_ns(), "key": key, "groupKey": group_key, "status": status,
                "fingerprints": prints, "delivery": doc}
        path = RunDir(self.run_dir).alertmanager_log
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as f:  # evidence: owner only
            f.write(json.dumps(line) + "\n")
        log.info("alertmanager delivery %s %s (%d alert(s)): recorded as evidence", shown(group_key), shown(status),
                 len(alerts))
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
        for n, rec in list(enumerate(launches))[-STATUS_LATEST:]:
            r = results.get(n)
            attempts.append({"attempt": n, "started_wall_ns": rec.get("started_wall_ns"),
                             "resume_from": rec.get("resume_from"),
                             "exit_codes": None if r is None else list(r.exit_codes),
                             "stopped": None if r is None else r.stopped})
        return {
            "run": self.run_dir.name,
            "job": {"state": str(state), "owned": self._job is not None or cur is not None,
                    "attempt": None if cur is None else cur.number, "pids": [] if cur is None else list(cur.pids)},
            "attempts": attempts, "attempt_count": len(launches),
            **({"attempts_error": launch_error} if launch_error else {}),
            **self.db.summary(latest=STATUS_LATEST),
            "interrupted": list(self.interrupted)[-STATUS_LATEST:],
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
            number = cur.number
        if number is None:  # launched, its ranks not all up yet: the run file has its number already
            try:
                number = len(read_launches(self.run_dir, missing_ok=True)) - 1
            except ValueError:  # a damaged run file: the attempt's number is unknown, as before its ranks were up
                number = -1
        with self._lock:
            if inc_attempt is not None and number >= 0 and inc_attempt < number:
                return False
            if message.incident.id in self._acting:  # the running attempt is the recovery from this very incident
                return False
        if (replaced(self.run_dir, message.incident) is not None
                or covering(self.run_dir, message.incident.id) is not None):
            return False
        with self._lock:
            if cur.done.is_set():
                return False
            cur.stop.set()
            return True

    def _first_attempt(self, cfg: Job) -> None:
        try:
            self._run_attempt(cfg)
        except Exception as exc:
            log.error("the job's first attempt did not run: %s: %s", type(exc).__name__, exc)

    def _run_attempt(self, cfg: Job, **kw: Any) -> LaunchResult:
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

    def _placed(self, cfg: Job) -> Job:
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
            self.db.mark(msg_id, MessageState.STARTED)
            with self._lock:
                received = self._received.pop(msg_id, None)
            try:
                outcome, rid = self._act(message, received, msg_id)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                log.error("decision %s failed: %s", msg_id, why, exc_info=True)
                self.db.mark(msg_id, MessageState.FAILED, outcome=why)
                continue
            log.info("decision %s: %s%s", msg_id, outcome, f" ({rid})" if rid else "")
            self.db.mark(msg_id, MessageState.DONE, outcome=outcome, recovery_id=rid)

    def _config(self) -> Job:
        if self._job is not None:
            return self._job
        if self._load_job is None:
            raise ValueError("the service was started without a job and cannot read one back from the run")
        return self._load_job(self.run_dir)  # a service (re)started without a job: the run's latest launch

    def _act(self, message: AlertMessage, received_ns: int | None = None, msg_id: str = "") -> tuple[str, str | None]:
        d = message.decision
        assert d is not None
        if d.action is Action.OBSERVE:
            return "observed: nothing to do", None
        cfg = self._config()
        arrived = f"the decision message {msg_id} reached the manager service"
        if not message.stops_job:
            plan = plan_from_message(self.run_dir, cfg, message).seen(received_ns, arrived)
            if plan.relaunch:  # only a relaunching decision (or a fail-stop / hang) may stop the job
                plan = replace(plan, action=Action.QUARANTINE if plan.quarantines else Action.OBSERVE, checkpoint=None)
            if not plan.quarantines:
                return "observed: the manager's policy finds nothing to quarantine", None
            listed = {(e.kind, e.id) for e in quarantined(self.run_dir)}
            if all((str(t.kind), t.id) in listed for t, _ in plan.quarantines):
                return (f"observed: {', '.join(str(t) for t, _ in plan.quarantines)} quarantined already",
                        covering(self.run_dir, message.incident.id))
            rec = apply(cfg, plan, launcher=self._no_launch)
            return rec.outcome, rec.id
        why = replaced(self.run_dir, message.incident)
        if why is not None:
            return f"covered: {why}", latest_recovery(self.run_dir)
        done_by = covering(self.run_dir, message.incident.id)
        if done_by is not None:  # acted on already (the same incident reported again, or by the post-hoc reading)
            return f"covered by {done_by}: acted on already", done_by
        with self._lock:
            cur = self._current
        if cur is not None and not cur.done.is_set():
            cur.stop.set()  # a decision queued again after a restart, or one that came in before the pids
            if not cur.done.wait(self._stop_wait_s):
                raise RuntimeError(f"attempt {cur.number} did not end {self._stop_wait_s:.0f} s after the stop")
        with self._lock:
            before = self._state
            self._state = JobState.RECOVERING
        plan = self._planner(self.run_dir, cfg, message).seen(received_ns, arrived)
        for line in plan.lines():
            log.info("plan: %s", line)
        if not plan.relaunch and not plan.quarantines:
            with self._lock:
                self._state = before
            done_by = covering(self.run_dir, message.incident.id)
            if done_by is not None:
                return f"covered by {done_by}: nothing new to act on", done_by
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
    def _no_launch(cfg: Job, **kw: Any) -> LaunchResult:
        raise AssertionError("a quarantine-only plan relaunched")


# ---------------------------------------------------------------------------------------------------- HTTP layer


def read_secret(path: Path) -> str:
    """The signing secret file: one line "whsec_<base64>" (>= 24 bytes); the sender's parser
    (`control.signer.load_secret`), so both sides read the file alike. ValueError naming the file otherwise."""
    return load_secret(path)


def _exit_now(sig: int, frame: object) -> None:
    """A second SIGTERM or SIGINT while the service closes: exit now. The ledger is consistent at every instant
    (each statement commits, WAL with synchronous=FULL); what was accepted and not started is queued again at the
    next start, and what had started is marked interrupted."""
    log.warning("%s during shutdown: exiting now", signal.Signals(sig).name)
    os._exit(128 + sig)


def _is_loopback(host: str | None) -> bool:
    """True for an address of the loopback range (127.0.0.0/8, ::1) or the name localhost."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _app(manager: Manager, *, secret: str, token: str | None, max_body: int, edge: Edge) -> Any:
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    hook = Webhook(secret)
    limits = edge.limits

    def reply(r: Reply, *, close: bool = False) -> JSONResponse:
        headers = {"connection": "close"} if close else {}
        if r.status == 503:
            headers["retry-after"] = "1"
        return JSONResponse(r.body, status_code=r.status, headers=headers)

    async def body_of(request: Request, path: str, msg_id: str | None) -> bytes | JSONResponse | None:
        """The body, or the refusal to send (None: the client went away, nothing to send)."""
        try:
            return await read_body(request.stream(), request.headers.get("content-length"), max_body=max_body,
                                   edge=edge)
        except BodyRefused as exc:
            assert exc.reason is not None
            return reply(manager.refuse(Refusal(exc.reason), path, msg_id, exc.detail, exc.status),
                         close=exc.status in (408, 413, 503))
        except ClientDisconnect:
            manager.refuse(Refusal.CLIENT_GONE, path, msg_id, "the client went away before its body was read", 400)
            return None

    def bearer_ok(request: Request) -> bool:
        auth = request.headers.get("authorization", "")
        given = auth.removeprefix("Bearer ").encode() if auth.startswith("Bearer ") else b""
        return token is not None and bool(given) and hmac.compare_digest(given, token.encode())

    async def alerts(request: Request) -> JSONResponse | None:
        h = request.headers
        msg_id, ts, sig = h.get("webhook-id"), h.get("webhook-timestamp"), h.get("webhook-signature")
        # every header is checked before a byte of the body is read
        if not (msg_id and ts and sig):
            missing = [n for n, v in (("webhook-id", msg_id), ("webhook-timestamp", ts), ("webhook-signature", sig))
                       if not v]
            return reply(manager.refuse(Refusal.MISSING_HEADERS, "/alerts", msg_id, f"no {', '.join(missing)}", 401))
        if not _ID_RE.fullmatch(msg_id):
            return reply(manager.refuse(Refusal.MALFORMED_HEADERS, "/alerts", msg_id,
                                        "webhook-id is not 1-128 of [A-Za-z0-9_.:-]", 401))
        if not _TIMESTAMP_RE.fullmatch(ts):
            return reply(manager.refuse(Refusal.MALFORMED_HEADERS, "/alerts", msg_id,
                                        f"webhook-timestamp {shown(ts, 20)} is not integer seconds (ASCII digits)", 401))
        skew = int(ts) - time.time()
        if abs(skew) > TOLERANCE_S:
            return reply(manager.refuse(Refusal.STALE_TIMESTAMP, "/alerts", msg_id,
                                        f"timestamp {skew:+.0f} s off this clock (allowed +-{TOLERANCE_S})", 401))
        if (problem := signature_problem(sig)) is not None:
            return reply(manager.refuse(Refusal.MALFORMED_SIGNATURE, "/alerts", msg_id,
                                        f"webhook-signature unreadable: {problem}", 401))
        body = await body_of(request, "/alerts", msg_id)
        if not isinstance(body, bytes):
            return body
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alerts", msg_id, "body is not UTF-8", 400))
        try:
            hook.verify(text, {"webhook-id": msg_id, "webhook-timestamp": ts, "webhook-signature": sig},
                        json_parse=False)
        except WebhookVerificationError as exc:
            return reply(manager.refuse(Refusal.BAD_SIGNATURE, "/alerts", msg_id, str(exc), 401))
        try:
            message = parse_message(body)
        except ValueError as exc:
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alerts", msg_id, str(exc)[:300], 400))
        return reply(manager.submit(msg_id, body, message))

    async def alertmanager(request: Request) -> JSONResponse | None:
        if not bearer_ok(request):
            why = "no bearer token configured" if token is None else "missing or wrong bearer token"
            return reply(manager.refuse(Refusal.BAD_TOKEN, "/alertmanager", None, why, 401))
        body = await body_of(request, "/alertmanager", None)
        if not isinstance(body, bytes):
            return body
        try:
            return reply(manager.record_alertmanager(json_object(body)))
        except ValueError as exc:  # JSON, UTF-8, nesting, or a key of the wrong type
            return reply(manager.refuse(Refusal.MALFORMED_BODY, "/alertmanager", None, str(exc)[:300], 400))

    async def status(request: Request) -> JSONResponse:
        if token is not None:
            if not bearer_ok(request):
                return reply(manager.refuse(Refusal.BAD_TOKEN, "/status", None, "missing or wrong bearer token", 401))
        elif not _is_loopback(request.client.host if request.client else None):
            return reply(manager.refuse(Refusal.NOT_LOOPBACK, "/status", None,
                                        "without a token, /status answers loopback clients only", 403))
        return JSONResponse(manager.status())

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def responding(handler: Callable[[Request], Awaitable[JSONResponse | None]], request: Request) -> Any:
        response = await handler(request)
        if response is None:  # the client is gone: close without an answer
            return JSONResponse({}, status_code=400, headers={"connection": "close"})
        return response

    def route(path: str, handler: Callable[[Request], Awaitable[JSONResponse | None]], method: str) -> Route:
        async def endpoint(request: Request) -> Any:
            size = sum(len(k) + len(v) + 4 for k, v in request.scope["headers"])
            if size > limits.max_header_bytes:  # h11 caps headers that trickle in; this, those that came at once
                return reply(manager.refuse(Refusal.HEADERS_TOO_LARGE, path, None,
                                            f"headers of {size} bytes (at most {limits.max_header_bytes})", 431),
                             close=True)
            return await responding(handler, request)
        return Route(path, endpoint, methods=[method])

    return Starlette(routes=[
        route("/alerts", alerts, "POST"),
        route("/alertmanager", alertmanager, "POST"),
        route("/status", status, "GET"),
        route("/healthz", healthz, "GET"),
    ])


def replaced(run_dir: Path, incident: Incident) -> str | None:
    """Why the run's latest attempt already replaced what `incident` is about, or None. An incident of an earlier
    attempt is replaced. One whose attempt is unknown (a finding over every attempt's rows: a corruption, a
    divergence) is replaced when it was detected before the latest attempt started and that attempt resumed from a
    checkpoint before its onset (or from the start): the state it is about is not the state that runs. One found
    before the relaunch, with the relaunch resumed from after its onset, is not: that state runs on."""
    try:
        launches = read_launches(run_dir, missing_ok=True)
    except ValueError:
        return None
    latest = len(launches) - 1
    if latest < 1:
        return None
    if incident.attempt is not None:
        return (f"incident of attempt {incident.attempt}, which attempt {latest} replaced"
                if incident.attempt < latest else None)
    last = launches[-1]
    started, resumed = last.get("started_wall_ns"), last.get("resume_from")
    fresh = resumed == "start" or (resumed is None and last.get("resume") is False)  # a command job's; the canary's
    step = -1 if fresh else checkpoint_step(resumed) if isinstance(resumed, str) else None
    found, onset = incident.detection_wall_ns, incident.onset_step
    if step is None or not isinstance(started, int) or found is None or onset is None:
        return None
    if found < started and step < onset:
        where = "the start" if step < 0 else str(resumed)
        return (f"incident detected before attempt {latest} started, which resumed from {where}, before its onset "
                f"(step {onset})")
    return None


class ManagerService:
    """The manager and its HTTP server. `start()` returns once the server listens (`port` is the bound one, also
    with port 0); `stop()` ends the server, then stops the job and closes the state file."""

    def __init__(self, run_dir: Path, *, secret: str, launcher: Launcher, token: str | None = None,
                 job: Job | None = None, load_job: JobLoader | None = None, host: str = "127.0.0.1", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, planner: Planner = plan_live, limits: HttpLimits = HttpLimits(),
                 launch_kw: Mapping[str, Any] | None = None, log_level: str = "warning") -> None:
        if max_body < 1024:
            raise ValueError(f"max_body {max_body}: must be >= 1024 bytes")
        from standardwebhooks.webhooks import Webhook

        Webhook(secret)  # an empty or non-base64 secret fails here, not on the first request
        self.manager = Manager(run_dir, job=job, load_job=load_job, launcher=launcher, planner=planner,
                               launch_kw=launch_kw)
        self._edge = Edge(limits, self.manager.refused_at_edge)
        self._app = _app(self.manager, secret=secret, token=token, max_body=max_body, edge=self._edge)
        self._host, self._port, self._log_level = host, port, log_level
        self._server: Any = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        if not _is_loopback(host):
            log.warning("manager service listens on %s, not loopback: anyone who can reach it and holds the secret "
                        "can stop the job", host)

    def _make_server(self) -> GuardedServer:
        return GuardedServer(server_config(self._app, host=self._host, port=self._port, edge=self._edge,
                                           log_level=self._log_level), self._edge)

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
            if main:  # the server is down; one more signal while the job is stopped ends the process at once
                for sig in found:
                    signal.signal(sig, _exit_now)
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


def serve(run_dir: Path, *, launcher: Launcher, load_job: JobLoader, listen: str = "127.0.0.1:8787",
          secret_file: Path, token_file: Path | None = None, job: Job | None = None, max_body: int = DEFAULT_MAX_BODY,
          limits: HttpLimits = HttpLimits(), launch_kw: Mapping[str, Any] | None = None,
          log_level: str = "info") -> int:
    """`rankwatch manager serve`: the service on `listen` (HOST:PORT, loopback by default) until SIGINT/SIGTERM.
    With `job`, it launches that job first; without, it acts on the run as <run>/run.json last recorded it
    (`load_job`)."""
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
    ManagerService(run_dir, secret=secret, token=token, job=job, load_job=load_job, launcher=launcher,
                   host=host.strip("[]"), port=int(port), max_body=max_body, limits=limits, launch_kw=launch_kw,
                   log_level=log_level).run_forever()
    return 0
