"""The manager service owning a real 2-rank canary: a rank SIGKILLed (or SIGSTOPped: a hang) from outside, a signed
decision by hand per the wire contract, the job stopped at once by the service (not by the launcher's failure grace,
not by the collective timeout), the recovery planned from the run by `assess`, applied with evidence and a record,
the relaunch finishing, and /status saying so."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.rundir import MANAGER_DIR, RECOVERY_DIR, STATE_FILE
from rankwatch.canary.config import config_from_run
from rankwatch.canary.faults import Faults
from rankwatch.canary.launcher import CanaryLauncher
from rankwatch.control.service import ManagerService
from support import canary, rows

pytestmark = [pytest.mark.slow]

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


def _decision(run_dir: Path, inc: Incident) -> bytes:
    """A "decision" message of the wire contract, by hand (the sender lives in control.wire)."""
    run = run_dir.name
    camel = "".join(p.capitalize() for p in str(inc.klass).split("_"))
    labels = {"alertname": f"Rankwatch{camel}", "class": str(inc.klass), "run": run, "rank": "1", "hostname": "h0",
              "uuid": "", "severity": "critical"}
    decision = {"id": f"{inc.id}/restart_job", "action": "restart_job", "scope": "job", "target": None,
                "checkpoint": None, "path": [str(inc.klass), "gate=none", "-> restart the job"],
                "reasons": ["rank 1 lost"],
                "quarantines": []}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return json.dumps({
        "version": "4", "groupKey": f"rankwatch/{run}/{inc.id}", "truncatedAlerts": 0, "status": "firing",
        "receiver": "rankwatch-manager", "externalURL": "",
        "groupLabels": {"alertname": labels["alertname"], "run": run},
        "commonLabels": labels, "commonAnnotations": {},
        "alerts": [{"status": "firing", "labels": labels,
                    "annotations": {"summary": inc.summary, "decision": "restart_job", "evidence": ""},
                    "startsAt": now, "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                    "fingerprint": hashlib.sha256(f"{run}|{inc.id}".encode()).hexdigest()[:16]}],
        "type": "decision", "timestamp": now,
        "rankwatch": {"schema": 1, "run": run, "run_dir": str(run_dir), "incident": inc.id,
                      "incident_doc": inc.to_dict(), "decision_id": decision["id"], "decision": decision,
                      "scope": "job", "evidence": {}},
    }).encode()


def _http(svc: ManagerService, method: str, path: str, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _status(svc: ManagerService) -> dict[str, Any]:
    code, doc = _http(svc, "GET", "/status")
    assert code == 200 and isinstance(doc, dict)
    return doc


def _wait_for(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:
            pass  # telemetry tables may not exist yet
        time.sleep(0.2)
    raise AssertionError(f"{what}: not reached in {timeout_s:.0f} s")


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("sig", "klass"), [(signal.SIGKILL, IncidentClass.FAIL_STOP),
                                            (signal.SIGSTOP, IncidentClass.HANG)], ids=["sigkill", "sigstop"])
def test_a_lost_or_stuck_rank_is_stopped_recovered_and_finished_by_the_service(
    run_dir: Path, sig: signal.Signals, klass: IncidentClass
) -> None:
    # a long collective timeout and failure grace: neither the launcher nor the collective timeout can end the
    # attempt quickly (only the service's stop, or for SIGKILL the survivor's own failure); both ranks
    # paced alike (no straggler) so that a loaded machine cannot finish the 60 steps before the test sees step 15
    pace = Faults().slow(rank=0, delay_s=0.1).slow(rank=1, delay_s=0.1)
    cfg = canary(run_dir, layout="dp=2", steps=60, checkpoint_every=10, pg_timeout_s=60.0, faults=pace)
    launch_kw = dict(timeout_s=140, failure_grace_s=90.0, term_grace_s=2.0)
    with ManagerService(run_dir, secret=SECRET, job=cfg, launcher=CanaryLauncher(), load_job=config_from_run,
                        launch_kw=launch_kw) as svc:
        _wait_for(lambda: _status(svc)["job"]["state"] == "running", 60, "the job running")
        _wait_for(lambda: rows(run_dir, "SELECT count(*) FROM steps WHERE rank = 1")[0][0] >= 15, 90,
                  "15 steps of rank 1")
        pid = _status(svc)["job"]["pids"][1]
        os.kill(pid, sig)
        killed = time.monotonic()

        inc = Incident(klass=klass, subject=Subject(kind=SubjectKind.RANK, id="1"), ranks=(1,),
                       onset_step=None, detection_step=None, confidence=1.0, cause=Cause.UNKNOWN,
                       summary=f"rank 1 {sig.name}", attempt=0, detection_wall_ns=time.time_ns())
        body = _decision(run_dir, inc)
        mid = "msg_" + hashlib.sha256(body).hexdigest()[:32]
        when = datetime.now(timezone.utc)
        headers = {"Content-Type": "application/json", "webhook-id": mid,
                   "webhook-timestamp": str(int(when.timestamp())),
                   "webhook-signature": Webhook(SECRET).sign(mid, when, body.decode())}
        code, doc = _http(svc, "POST", "/alerts", body, headers)
        assert code == 202 and doc["stopping"], doc

        # stopped at once: the first attempt ends by the stop event, long before the 90 s grace or 60 s timeout
        _wait_for(lambda: _status(svc)["attempts"][0]["stopped"] is not None, 30, "attempt 0 ended")
        first = _status(svc)["attempts"][0]
        assert first["exit_codes"][1] == -signal.SIGKILL, first
        if sig is signal.SIGSTOP:
            # nobody fails by itself beside a stopped rank: only the service's stop ends the attempt, and a stopped
            # process cannot act on SIGTERM, so the launcher's SIGKILL after term_grace_s ends it
            assert first["stopped"] is True, first
        else:
            # beside a killed rank gloo's survivor fails at once on the reset connection (exit 1): it or the
            # service's stop ends the attempt, whichever comes first; either way long before the grace or timeout
            assert first["stopped"] is True or first["exit_codes"][0] == 1, first
        assert time.monotonic() - killed < 30

        _wait_for(lambda: (_status(svc)["last_decision"] or {}).get("state") in ("done", "failed"), 120,
                  "the decision applied")
        s = _status(svc)
        assert s["last_decision"]["state"] == "done" and s["last_decision"]["outcome"] == "recovered", s
        rid = s["last_decision"]["recovery_id"]
        assert s["job"]["state"] == "finished" and len(s["attempts"]) == 2
        assert s["attempts"][1]["exit_codes"] == [0, 0] and s["attempts"][1]["resume_from"] is not None

    rec = json.loads((run_dir / RECOVERY_DIR / f"{rid}.json").read_text())
    assert rec["outcome"] == "recovered" and rec["action"] == "restart_job" and rec["evidence"]
    assert any(d["class"] in ("fail_stop", "hang") and d["subject"] == "rank:1" for d in rec["decisions"]), rec
    assert rows(run_dir, "SELECT max(step) FROM steps WHERE attempt = 1") == [(59,)]
    assert (run_dir / MANAGER_DIR / STATE_FILE).is_file()
