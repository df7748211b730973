"""Alert webhooks: payload shape, ids, Standard Webhooks signatures, secret files, the tracker, and the outbox
against a real HTTP receiver on 127.0.0.1 that is down, then answers 503, 429 and 200."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from rankwatch.analytics.incidents import Cause, Evidence, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.control.outbox import Outbox, Outcome, Reply, RetryConfig, State
from rankwatch.control.sender import AlertSender, HttpTransport, MemoryTransport, _retry_after, signed_send
from rankwatch.control.signer import Signer, load_secret, new_secret, write_secret
from rankwatch.control.tracker import AlertTracker, TrackerConfig
from rankwatch.control.wire import (
    ZERO_TIME, AlertConfigError, AlertStatus, DecisionFields, Message, MessageType, RankPlacement, Severity, alertname,
    decision_fields, decision_message, fingerprint, incident_message, message_id, parse_message, plan_fields,
    severity,
)
from rankwatch.recovery.decision import Action
from rankwatch.recovery.policy import DECISION_CASES

T0 = 1_800_000_000.0
RUN = "run-17"

# The Alertmanager webhook v4 document (prometheus/alertmanager docs, configuration.md `<webhook_config>`).
AM_TOP = {"version", "groupKey", "truncatedAlerts", "status", "receiver", "groupLabels", "commonLabels",
          "commonAnnotations", "externalURL", "alerts"}
AM_ALERT = {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL", "fingerprint"}
LABELS = {"alertname", "class", "run", "rank", "hostname", "uuid", "severity"}
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def _inc(klass: IncidentClass = IncidentClass.FAIL_STOP, ranks: tuple[int, ...] = (3,), cause: Cause = Cause.EXIT, *,
         subject: Subject | None = None, onset: int = 120, wall_ns: int | None = int(T0 * 1e9) - 5_000_000_000,
         hardware: tuple[HardwareSignal, ...] = (), evidence: tuple[Evidence, ...] = ()) -> Incident:
    subj = subject or Subject(kind=SubjectKind.RANK, id=",".join(map(str, ranks)))
    return Incident(klass=klass, subject=subj, ranks=ranks, onset_step=onset, detection_step=onset + 2,
                    confidence=0.9, cause=cause, summary=f"{klass} on ranks {list(ranks)}\nsecond line",
                    detection_wall_ns=wall_ns, hardware=hardware, evidence=evidence)


def _strict(body: bytes) -> dict[str, Any]:
    def bad(c: str) -> Any:
        raise ValueError(f"non-standard JSON constant {c}")
    doc: dict[str, Any] = json.loads(body.decode("utf-8"), parse_constant=bad)
    return doc


PLACE = {3: RankPlacement(host="h1", uuid="GPU-33"), 4: RankPlacement(host="h1", uuid="GPU-44"),
         5: RankPlacement(host="h2", uuid="")}


# ------------------------------------------------------------------------------------------------------ payloads


def _check_alertmanager_shape(doc: dict[str, Any]) -> None:
    assert AM_TOP <= set(doc)
    assert doc["version"] == "4" and doc["truncatedAlerts"] == 0 and doc["receiver"] == "rankwatch-manager"
    assert doc["status"] in ("firing", "resolved") and doc["externalURL"] == ""
    assert set(doc["groupLabels"]) == {"alertname", "run"}
    assert doc["alerts"]
    for a in doc["alerts"]:
        assert set(a) == AM_ALERT
        assert set(a["labels"]) == LABELS
        assert set(a["annotations"]) == {"summary", "decision", "evidence"}
        for d in (a["labels"], a["annotations"]):
            assert all(isinstance(v, str) for v in d.values()), d
        assert all("\n" not in v for v in a["annotations"].values())
        assert RFC3339.match(a["startsAt"]) and RFC3339.match(a["endsAt"])
        assert re.fullmatch(r"[0-9a-f]{16}", a["fingerprint"])
        assert a["generatorURL"] == ""
    for d in (doc["commonLabels"], doc["commonAnnotations"], doc["groupLabels"]):
        assert all(isinstance(v, str) for v in d.values())
    assert doc["type"] in ("incident.firing", "incident.resolved", "decision")
    assert RFC3339.match(doc["timestamp"])
    rw = doc["rankwatch"]
    assert set(rw) == {"schema", "run", "run_dir", "incident", "incident_doc", "decision_id", "decision", "scope",
                       "evidence"}
    assert rw["schema"] == 1 and isinstance(rw["evidence"], dict)
    assert doc["groupKey"] == f"rankwatch/{rw['run']}/{rw['incident']}"


def test_firing_incident_is_an_alertmanager_v4_document_with_rankwatch_keys(tmp_path: Path) -> None:
    inc = _inc()
    m = incident_message(tmp_path / RUN, inc, AlertStatus.FIRING, evidence_path=tmp_path / "ev", placement=PLACE,
                         now=T0)
    doc = _strict(m.body)
    _check_alertmanager_shape(doc)
    assert doc == m.doc() and doc["status"] == "firing" and doc["type"] == "incident.firing"
    alert = doc["alerts"][0]
    assert alert["labels"] == {"alertname": "RankwatchFailStop", "class": "fail_stop", "run": RUN, "rank": "3",
                               "hostname": "h1", "uuid": "GPU-33", "severity": "critical"}
    assert alert["annotations"] == {"summary": "fail_stop rank:3: fail_stop on ranks [3] second line",
                                    "decision": "", "evidence": str(tmp_path / "ev")}
    assert alert["endsAt"] == ZERO_TIME and alert["startsAt"] == "2027-01-15T07:59:55.000Z"
    assert doc["commonLabels"] == alert["labels"] and doc["commonAnnotations"] == alert["annotations"]
    assert doc["groupLabels"] == {"alertname": "RankwatchFailStop", "run": RUN}
    rw = doc["rankwatch"]
    assert rw["run"] == RUN and rw["run_dir"] == str((tmp_path / RUN).absolute()) and rw["incident"] == inc.id
    assert rw["decision_id"] is None and rw["decision"] is None and rw["scope"] is None
    # the incident as analytics writes it into analysis/incidents.json, and read back unchanged
    assert rw["incident_doc"] == json.loads(json.dumps(inc.to_dict()))
    assert Incident.from_dict(rw["incident_doc"]) == inc
    assert m.id == message_id(RUN, MessageType.FIRING, inc.id) and re.fullmatch(r"msg_[0-9a-f]{32}", m.id)
    assert alert["fingerprint"] == fingerprint(RUN, inc.id)


def test_resolved_message_ends_the_alert_and_says_why(tmp_path: Path) -> None:
    inc = _inc(IncidentClass.STRAGGLER, (4, 5), Cause.SLOW_LINK)
    m = incident_message(tmp_path / RUN, inc, "resolved", placement=PLACE, now=T0 + 60, resolution="caught up",
                         decision="observe (scope none)")
    doc = _strict(m.body)
    _check_alertmanager_shape(doc)
    a = doc["alerts"][0]
    assert doc["status"] == a["status"] == "resolved" and doc["type"] == "incident.resolved"
    assert a["endsAt"] == "2027-01-15T08:01:00.000Z"
    assert a["labels"]["rank"] == "4,5" and a["labels"]["hostname"] == "h1,h2" and a["labels"]["uuid"] == "GPU-44"
    assert a["labels"]["severity"] == "warning" and a["annotations"]["decision"] == "observe (scope none)"
    assert doc["rankwatch"]["evidence"] == {"path": None, "resolution": "caught up"}
    assert m.id != incident_message(tmp_path / RUN, inc, "firing", now=T0).id


def test_labels_name_the_device_or_host_subject_and_are_empty_when_unknown(tmp_path: Path) -> None:
    dev = _inc(IncidentClass.STRAGGLER, (4,), Cause.THERMAL_THROTTLE, subject=Subject(kind=SubjectKind.DEVICE,
               id="GPU-aa"), hardware=(HardwareSignal.THROTTLE,))
    host = _inc(IncidentClass.STRAGGLER, (4, 5), Cause.DATALOADER, subject=Subject(kind=SubjectKind.HOST, id="h9"))
    job = _inc(IncidentClass.DIVERGENCE, (), Cause.RNG_MISMATCH, subject=Subject(kind=SubjectKind.JOB, id="job"))
    labels = [_strict(incident_message(tmp_path / RUN, i, "firing", placement=PLACE, now=T0).body)["alerts"][0]
              ["labels"] for i in (dev, host, job)]
    assert (labels[0]["uuid"], labels[0]["hostname"]) == ("GPU-aa", "h1")
    assert (labels[1]["uuid"], labels[1]["hostname"]) == ("GPU-44", "h9")
    assert (labels[2]["rank"], labels[2]["uuid"], labels[2]["hostname"]) == ("", "", "")
    no_topology = _strict(incident_message(tmp_path / RUN, _inc(), "firing", now=T0).body)["alerts"][0]["labels"]
    assert (no_topology["hostname"], no_topology["uuid"]) == ("", "")


def test_severity_and_alertname_per_class() -> None:
    expect = {IncidentClass.FAIL_STOP: Severity.CRITICAL, IncidentClass.HANG: Severity.CRITICAL,
              IncidentClass.CORRUPTION: Severity.CRITICAL, IncidentClass.DIVERGENCE: Severity.CRITICAL,
              IncidentClass.STRAGGLER: Severity.WARNING, IncidentClass.IMBALANCE: Severity.WARNING,
              IncidentClass.CHECKPOINT: Severity.WARNING, IncidentClass.UNCLASSIFIED: Severity.INFO}
    assert set(expect) == set(IncidentClass)
    for klass, sev in expect.items():
        assert severity(_inc(klass, cause=Cause.UNKNOWN)) is sev
    assert severity(_inc(IncidentClass.HANG, cause=Cause.TRANSIENT_STALL)) is Severity.WARNING
    assert [alertname(k) for k in (IncidentClass.FAIL_STOP, IncidentClass.HANG, IncidentClass.UNCLASSIFIED)] == [
        "RankwatchFailStop", "RankwatchHang", "RankwatchUnclassified"]


def test_non_finite_evidence_values_become_null_in_strict_json(tmp_path: Path) -> None:
    ev = Evidence(source="steps", summary="s", columns=("rank", "x"), rows=((3, float("nan")), (4, float("inf"))))
    doc = _strict(incident_message(tmp_path / RUN, _inc(evidence=(ev,)), "firing", now=T0).body)
    assert doc["rankwatch"]["incident_doc"]["evidence"][0]["rows"] == [[3, None], [4, None]]


def test_ids_are_stable_across_rebuilds_and_distinct_per_message(tmp_path: Path) -> None:
    inc = _inc()
    a = incident_message(tmp_path / RUN, inc, "firing", now=T0)
    b = incident_message(tmp_path / RUN, inc, "firing", now=T0 + 100)  # rebuilt later (a monitor restart)
    assert a.id == b.id and a.body != b.body
    other_run = incident_message(tmp_path / "run-18", inc, "firing", now=T0)
    assert other_run.id != a.id
    assert _strict(other_run.body)["alerts"][0]["fingerprint"] != _strict(a.body)["alerts"][0]["fingerprint"]
    d = plan_fields(run_dir=tmp_path / RUN, incidents=[inc], action=Action.RESTART_JOB, checkpoint="step-100")
    dm = decision_message(tmp_path / RUN, d, [inc], now=T0)
    assert len({a.id, dm.id, incident_message(tmp_path / RUN, inc, "resolved", now=T0).id}) == 3
    assert dm.id == message_id(RUN, MessageType.DECISION, inc.id, d.id)


def test_decision_fields_from_the_policy_and_the_decision_message(tmp_path: Path) -> None:
    case = next(c for c in DECISION_CASES if c.name == "failstop-device-fault-agree-idem-dp")
    decision = case.decide()
    inc = case.incident
    fields = decision_fields(decision, run_dir=tmp_path / RUN, incidents=[inc])
    assert fields.action is decision.action and fields.scope == str(decision.scope)
    assert fields.quarantines == ("device:GPU-aa",) and fields.path == decision.path
    rollback = next(c for c in DECISION_CASES if c.name == "failstop-disagree-partials").decide()
    rf = decision_fields(rollback, run_dir=tmp_path / RUN, incidents=[inc])
    assert rf.checkpoint == "step-00000100" and rf.target == "checkpoint:step-00000100@100"
    assert rf.id == fields.id  # one decision per set of incidents, whatever it says

    other = _inc(IncidentClass.STRAGGLER, (5,), Cause.SLOW_LINK)
    joined = plan_fields(run_dir=tmp_path / RUN, incidents=[inc, other], action=Action.RESTART_JOB,
                         checkpoint="step-00000100", reasons=["r"], path=["p"], quarantines=["device:GPU-aa"])
    m = decision_message(tmp_path / RUN, joined, [other, inc], placement=PLACE, now=T0)
    doc = _strict(m.body)
    _check_alertmanager_shape(doc)
    assert doc["type"] == "decision" and doc["status"] == "firing" and m.decision == joined.id
    assert [a["labels"]["class"] for a in doc["alerts"]] == ["fail_stop", "straggler"]
    rw = doc["rankwatch"]
    assert rw["incident"] == inc.id and rw["decision_id"] == joined.id and rw["scope"] == "job"
    assert rw["decision"] == {"id": joined.id, "action": "restart_job", "scope": "job",
                              "target": "checkpoint:step-00000100", "checkpoint": "step-00000100", "path": ["p"],
                              "reasons": ["r"], "quarantines": ["device:GPU-aa"]}
    assert rw["evidence"]["incidents"] == [inc.id, other.id]
    assert doc["commonLabels"] == {"run": RUN}
    assert doc["commonAnnotations"]["decision"] == joined.line()
    with pytest.raises(ValueError, match="not among those given"):
        decision_message(tmp_path / RUN, joined, [inc], now=T0)


def test_what_the_wire_builds_it_parses_back(tmp_path: Path) -> None:
    """One module builds and parses the wire format: every message the monitor sends parses back into the incident
    and the decision it was built from (what the manager service acts on)."""
    case = next(c for c in DECISION_CASES if c.name == "failstop-disagree-partials")
    inc, decision = case.incident, case.decide()
    fields = decision_fields(decision, run_dir=tmp_path / RUN, incidents=[inc])
    sent = decision_message(tmp_path / RUN, fields, [inc], placement=PLACE, now=T0)
    got = parse_message(sent.body)
    assert got.type is MessageType.DECISION and got.status == "firing" and got.run == RUN
    assert got.incident_id == inc.id and got.incident == inc
    assert got.decision is not None
    assert (got.decision.id, got.decision.action, got.decision.scope, got.decision.target, got.decision.checkpoint,
            got.decision.quarantines) == (fields.id, fields.action, fields.scope, fields.target, fields.checkpoint,
                                          fields.quarantines)
    assert got.stops_job  # a rollback of a fail-stop stops the running attempt
    for status in (AlertStatus.FIRING, AlertStatus.RESOLVED):
        record = parse_message(incident_message(tmp_path / RUN, inc, status, placement=PLACE, now=T0).body)
        assert (record.type, record.status, record.incident, record.decision) == (
            MessageType.FIRING if status is AlertStatus.FIRING else MessageType.RESOLVED, str(status), inc, None)


# ------------------------------------------------------------------------------------------------------- signing

SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def _by_hand(secret: str, msg_id: str, ts: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def test_signature_matches_the_package_a_hand_computed_hmac_and_the_spec_vector(tmp_path: Path) -> None:
    # the Standard Webhooks reference vector
    spec = Signer(SPEC_SECRET).headers("msg_p5jXN8AQM9LWM0D4loKWxJek", b'{"test": 2432232314}', timestamp=1614265330)
    assert spec["webhook-signature"] == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    secret = new_secret()
    m = incident_message(tmp_path / RUN, _inc(), "firing", now=T0)
    ts = int(time.time())
    h = Signer(secret).headers(m.id, m.body, timestamp=ts)
    assert h["webhook-id"] == m.id and h["webhook-timestamp"] == str(ts)
    assert h["content-type"] == "application/json"
    assert h["webhook-signature"] == _by_hand(secret, m.id, ts, m.body)
    assert Webhook(secret).verify(m.body, h) == m.doc()
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(m.body.replace(b"fail_stop", b"straggler"), h)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(m.body, h)


def test_secret_files(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    secret = write_secret(f)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and load_secret(f) == secret
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    with pytest.raises(AlertConfigError, match="exists already"):
        write_secret(f)
    bad = {"missing": None, "empty": "", "blank": "  \n\n", "prefix": "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\n",
           "base64": "whsec_not*base64!!\n", "short": "whsec_" + base64.b64encode(b"x" * 16).decode(),
           "two-lines": f"{SPEC_SECRET}\n{SPEC_SECRET}\n"}
    for name, text in bad.items():
        p = tmp_path / name
        if text is not None:
            p.write_text(text)
        with pytest.raises(AlertConfigError) as err:
            load_secret(p)
        msg = str(err.value)
        assert str(p) in msg and "\n" not in msg, (name, msg)
    (tmp_path / "ok").write_text(f"\n  {SPEC_SECRET}  \n")
    assert load_secret(tmp_path / "ok") == SPEC_SECRET
    for url in ("ftp://x", "http://", "localhost:8080/alerts"):
        with pytest.raises(AlertConfigError, match="not an http"):
            HttpTransport(url)


# ------------------------------------------------------------------------------------------------------- tracker


def test_tracker_fires_once_resolves_once_and_sends_each_decision_once(tmp_path: Path) -> None:
    t = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=2))
    strag = _inc(IncidentClass.STRAGGLER, (5,), Cause.SLOW_LINK)
    fail = _inc()
    first = t.update([strag, fail], now=T0)
    assert [(m.type, m.incident) for m in first] == [(MessageType.FIRING, fail.id), (MessageType.FIRING, strag.id)]
    assert t.update([strag, fail], now=T0 + 1) == []
    assert [i.id for i in t.undecided([strag, fail])] == [fail.id, strag.id]
    d = plan_fields(run_dir=tmp_path / RUN, incidents=[fail], action=Action.RESTART_JOB, checkpoint="step-100")
    out = t.update([fail], [d], now=T0 + 2)  # the straggler left the window once
    assert [(m.type, m.decision) for m in out] == [(MessageType.DECISION, d.id)]
    assert t.update([fail], [d], now=T0 + 3)[0].type is MessageType.RESOLVED  # decision not resent; straggler gone
    assert [i.id for i in t.undecided([strag, fail])] == []
    # a fail-stop leaving the window is not resolved by default (the window moved on, the rank did not come back)
    for k in range(5):
        assert t.update([], now=T0 + 4 + k) == []
    out = t.update([], recovered=[fail.id], now=T0 + 10)
    assert [(m.type, m.incident) for m in out] == [(MessageType.RESOLVED, fail.id)]
    doc = out[0].doc()
    assert doc["alerts"][0]["annotations"]["decision"] == d.line()
    assert doc["alerts"][0]["startsAt"] == _strict(first[0].body)["alerts"][0]["startsAt"]
    assert t.update([fail, strag], now=T0 + 11) == []  # resolved ids are not raised again
    with pytest.raises(ValueError, match="never reported"):
        t.update([], [plan_fields(run_dir=tmp_path / RUN, incidents=["nope"], action=Action.OBSERVE)])


def test_tracker_finish_and_stop_resolve_after(tmp_path: Path) -> None:
    t = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=1, stop_resolve_after=2),
                     evidence_path=lambda i: tmp_path / "ev" / i.id)
    hang, div = _inc(IncidentClass.HANG, cause=Cause.STUCK_IN_COLLECTIVE), _inc(IncidentClass.DIVERGENCE, (1, 2))
    fired = t.update([hang, div], now=T0)
    assert fired[0].doc()["alerts"][0]["annotations"]["evidence"] == str(tmp_path / "ev" / hang.id)
    assert [m.incident for m in t.update([], now=T0 + 1)] == [div.id]
    assert [m.incident for m in t.update([], now=T0 + 2)] == [hang.id]
    t2 = AlertTracker(tmp_path / RUN)
    t2.update([hang, div], now=T0)
    ended = t2.finish(now=T0 + 5)
    assert [m.incident for m in ended] == [hang.id, div.id]
    assert all(m.doc()["rankwatch"]["evidence"]["resolution"] == "the run ended" for m in ended)
    assert t2.open == () and t2.finish() == []


def test_one_alert_per_fault_while_the_window_moves_its_onset(tmp_path: Path) -> None:
    t = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=2))
    windows = [_inc(IncidentClass.STRAGGLER, (2,), Cause.SLOW_LINK, onset=onset) for onset in (40, 60, 80)]
    assert len({w.id for w in windows}) == 3  # the id hashes the onset, which the window moves
    fired = t.update([windows[0]], now=T0)
    assert [m.type for m in fired] == [MessageType.FIRING]
    d = plan_fields(run_dir=tmp_path / RUN, incidents=[windows[1]], action=Action.OBSERVE, scope="none")
    assert [i.id for i in t.undecided([windows[1]])] == [windows[1].id]
    out = t.update([windows[1]], [d], now=T0 + 1)
    assert [m.type for m in out] == [MessageType.DECISION]
    assert t.undecided([windows[2]]) == ()  # the fault is decided, whatever id the window gives it now
    assert t.update([windows[2]], now=T0 + 2) == []
    assert t.update([], now=T0 + 3) == []
    out = t.update([], now=T0 + 4)
    assert [(m.type, m.incident) for m in out] == [(MessageType.RESOLVED, windows[0].id)]
    assert out[0].doc()["alerts"][0]["annotations"]["decision"] == d.line()
    later = _inc(IncidentClass.STRAGGLER, (2,), Cause.SLOW_LINK, onset=200)  # a new episode after it resolved
    assert [m.type for m in t.update([later], now=T0 + 5)] == [MessageType.FIRING]


def test_a_fault_whose_window_moves_its_onset_and_spreads_its_ranks_fires_once_and_resolves_once(
        tmp_path: Path) -> None:
    """A NaN loss seen by a sliding window: every refresh the incident begins at the window's first step (a new id)
    and, once the all-reduce spread it, names more ranks; it is one fault: one firing while it goes on, one
    resolution when it is gone, and the console announces it once."""
    from rankwatch.control.monitor import FORGET_AFTER, Monitor

    t = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=3))
    windows = [_inc(IncidentClass.CORRUPTION, ranks, Cause.NON_FINITE, subject=Subject(kind=SubjectKind.JOB, id="job"),
                    onset=onset)
               for onset, ranks in ((1, (2,)), (9, (2,)), (17, (0, 1, 2, 3)), (26, (0, 1, 2, 3)), (34, (0, 1, 2, 3)))]
    assert len({w.id for w in windows}) == len(windows) and len({w.fault for w in windows}) == 1
    sent = [m for k, w in enumerate(windows) for m in t.update([w], now=T0 + k)]
    sent += [m for k in range(5) for m in t.update([], now=T0 + 10 + k)]
    assert [(m.type, m.incident) for m in sent] == [(MessageType.FIRING, windows[0].id),
                                                     (MessageType.RESOLVED, windows[0].id)]
    console = Monitor.__new__(Monitor)
    console.reported = {}
    announced = [console._fresh([w], []) for w in windows] + [console._fresh([], []) for _ in range(FORGET_AFTER)]
    assert [len(a) for a in announced] == [1] + [0] * (len(announced) - 1)
    assert console.reported == {} and len(console._fresh([windows[-1]], [])) == 1  # gone, then back: a new episode


def test_absence_is_counted_in_analyses_not_in_liveness_polls(tmp_path: Path) -> None:
    """A monitor updates the tracker at every liveness poll but analyses the window every few seconds: one window
    that misses a straggler (a detector's edge effect) must not resolve it within three polls of that window."""
    t = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=3))
    slow = _inc(IncidentClass.STRAGGLER, (1,), Cause.UNKNOWN, onset=30)
    assert [m.type for m in t.update([slow], now=T0)] == [MessageType.FIRING]
    assert t.update([], now=T0 + 1) == []  # an analysis without it
    assert [t.update([], now=T0 + 1 + k / 10, analyzed=False) for k in range(20)] == [[]] * 20  # polls, same analysis
    assert t.update([slow], now=T0 + 4) == []  # the next window sees it again: the same alert, still open
    assert t.update([], now=T0 + 5) == [] and t.update([], now=T0 + 6) == []
    assert [m.type for m in t.update([], now=T0 + 7)] == [MessageType.RESOLVED]


def test_a_relaunch_resolves_the_old_attempts_fail_stop_and_it_is_not_raised_again(tmp_path: Path) -> None:
    t = AlertTracker(tmp_path / RUN)
    from_parts = replace(_inc(onset=118), attempt=0)
    from_liveness = replace(_inc(onset=119), attempt=0)  # the same death seen by another source, another id
    assert from_parts.id != from_liveness.id
    fired = t.update([from_parts, from_liveness], attempt=0, now=T0)
    assert [m.type for m in fired] == [MessageType.FIRING]
    assert t.update([from_parts], attempt=0, now=T0 + 1) == []
    out = t.update([from_liveness], attempt=1, now=T0 + 2)  # the manager relaunched; the window still shows it
    assert [(m.type, m.incident) for m in out] == [(MessageType.RESOLVED, fired[0].incident)]
    assert "relaunched (attempt 1)" in out[0].doc()["rankwatch"]["evidence"]["resolution"]
    assert t.update([from_parts, from_liveness], now=T0 + 3) == [] and t.undecided([from_parts]) == ()
    again = replace(_inc(onset=300), attempt=1)  # rank 3 dies again in the new attempt: a new alert
    assert [m.type for m in t.update([again], now=T0 + 4)] == [MessageType.FIRING]
    # a recovery record naming the incident under its post-hoc id resolves it by what it is about
    post_hoc = replace(_inc(onset=290), attempt=1)
    out = t.update([again], recovered=[post_hoc], now=T0 + 5)
    assert [(m.type, m.incident) for m in out] == [(MessageType.RESOLVED, again.id)]


def test_a_restarted_monitor_resumes_its_alerts_from_the_outbox(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite")
    strag = [_inc(IncidentClass.STRAGGLER, (2,), Cause.SLOW_LINK, onset=o) for o in (40, 60)]
    fail, div = _inc(), _inc(IncidentClass.DIVERGENCE, (1,), Cause.RNG_MISMATCH)
    first = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=1))
    d = plan_fields(run_dir=tmp_path / RUN, incidents=[fail], action=Action.RESTART_JOB, checkpoint="step-100")
    said = first.update([strag[0], fail, div], [d], now=T0) + first.update([strag[0], fail], now=T0 + 1)
    assert [m.type for m in said][-1] is MessageType.RESOLVED  # the divergence left the window
    for m in said:
        box.enqueue(m)
    other = AlertTracker(tmp_path / "run-18").update([fail], now=T0)
    box.enqueue(other[0])
    again = AlertTracker(tmp_path / RUN, TrackerConfig(resolve_after=1))
    assert again.resume(e.message for e in box.entries()) == len(said)
    assert [i.id for i in again.open] == [fail.id, strag[0].id]
    assert again.undecided([fail, strag[1], div]) == (strag[1],)
    assert again.update([strag[1], fail, div], now=T0 + 2) == []  # nothing raised again under a newer id
    out = again.update([fail], recovered=[fail.id], now=T0 + 3)
    assert [(m.type, m.incident) for m in out] == [(MessageType.RESOLVED, fail.id), (MessageType.RESOLVED, strag[0].id)]
    assert out[0].doc()["alerts"][0]["annotations"]["decision"] == d.line()
    assert out[0].doc()["alerts"][0]["startsAt"] == said[0].doc()["alerts"][0]["startsAt"]
    box.close()


def test_a_restarted_monitor_rebuilds_the_same_messages_and_the_outbox_stores_them_once(tmp_path: Path) -> None:
    inc = _inc()
    d = plan_fields(run_dir=tmp_path / RUN, incidents=[inc], action=Action.RESTART_JOB, checkpoint="step-100")
    box = Outbox(tmp_path / "o.sqlite")
    before = AlertTracker(tmp_path / RUN).update([inc], [d], now=T0)
    assert [box.enqueue(m, now=T0) for m in before] == [True, True]
    after = AlertTracker(tmp_path / RUN).update([inc], [d], now=T0 + 30)
    assert [m.id for m in after] == [m.id for m in before]
    assert [box.enqueue(m, now=T0 + 30) for m in after] == [False, False]
    assert [m.body for m in box.pending()] == [m.body for m in before]  # the first stored body is the one sent
    box.close()


# -------------------------------------------------------------------------------------------- outbox, real server


@dataclass
class Hit:
    id: str
    timestamp: int
    body: bytes
    status: int


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1 that verifies every request and answers from a script."""

    secret: str
    port: int
    script: Callable[[str, int], tuple[int, dict[str, str], bytes]] = lambda _id, _n: (200, {}, b"ok")
    hits: list[Hit] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    thread: threading.Thread | None = None

    @property
    def accepted(self) -> list[str]:
        return [h.id for h in self.hits if 200 <= h.status < 300]

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                Webhook(receiver.secret).verify(body, headers)  # raises (500) on a bad signature
                assert headers["content-type"] == "application/json"
                msg_id = headers["webhook-id"]
                n = sum(h.id == msg_id for h in receiver.hits)
                status, extra, text = receiver.script(msg_id, n)
                receiver.hits.append(Hit(id=msg_id, timestamp=int(headers["webhook-timestamp"]), body=body,
                                         status=status))
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            assert self.thread is not None
            self.thread.join(5)


def _free_port() -> int:
    from service_support import free_port

    return free_port()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver(secret=new_secret(), port=_free_port())
    yield r
    r.stop()


def _messages(tmp_path: Path, n: int, run: str = RUN) -> list[Message]:
    return [incident_message(tmp_path / run, _inc(ranks=(i,), onset=100 + i), "firing", now=T0) for i in range(n)]


@pytest.fixture(autouse=True)
def _a_proxy_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loopback receiver is reached directly even when the environment names an HTTP proxy (none listens)."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)


def _send(r: Receiver) -> Callable[[Message], Reply]:
    ticks = itertools.count()  # each attempt signs a later second than the one before it
    return signed_send(HttpTransport(f"http://127.0.0.1:{r.port}/hook", timeout_s=5), Signer(r.secret),
                       clock=lambda: time.time() + next(ticks))


def test_outbox_delivers_each_message_once_in_order_through_down_503_and_429(tmp_path: Path,
                                                                              receiver: Receiver) -> None:
    msgs = _messages(tmp_path, 4)
    retry = RetryConfig(base_s=1.0, cap_s=4.0)
    box = Outbox(tmp_path / "alerts" / "outbox.sqlite", retry, rng=random.Random(7))
    assert all(box.enqueue(m, now=T0) for m in msgs)
    send, now, log = _send(receiver), T0, []
    for attempt in range(2):  # the receiver is down: connection refused
        out = box.deliver_due(send, now=now)
        assert [(r.id, r.outcome, r.status, r.attempts) for r in out] == [(msgs[0].id, Outcome.RETRY, None,
                                                                          attempt + 1)]
        assert out[0].retry_in_s is not None and 0 <= out[0].retry_in_s <= min(4.0, 1.0 * 2 ** attempt)
        assert box.deliver_due(send, now=now) == []  # nothing is due before the backoff ends
        due = box.next_due()
        assert due is not None and due == pytest.approx(now + out[0].retry_in_s)
        now = due
    answers = iter([(503, {}, b"busy\nmore"), (503, {}, b"busy"), (429, {"Retry-After": "7"}, b"slow down")])
    receiver.script = lambda _id, _n: next(answers, (200, {}, b"ok"))  # then 200 for every request
    receiver.start()
    for _ in range(20):
        out = box.deliver_due(send, now=now)
        log.extend(out)
        due = box.next_due()
        if due is None:
            break
        now = max(now, due)
    assert [(r.outcome, r.status) for r in log if r.id == msgs[0].id] == [
        (Outcome.RETRY, 503), (Outcome.RETRY, 503), (Outcome.RETRY, 429), (Outcome.DELIVERED, 200)]
    assert [r.detail for r in log[:2]] == ["busy", "busy"] and log[2].retry_in_s == 7.0  # Retry-After honoured
    assert receiver.accepted == [m.id for m in msgs]  # each once, in order
    assert box.stats().pending == 0 and box.stats().delivered == 4
    first = [h for h in receiver.hits if h.id == msgs[0].id]
    assert len(first) == 4 and len({h.timestamp for h in first}) == 4  # same id, a fresh timestamp per attempt
    assert all(h.body == msgs[0].body for h in first)
    assert [e.attempts for e in box.entries()] == [6, 1, 1, 1]
    box.close()


def test_a_400_is_not_retried_and_the_run_goes_on(tmp_path: Path, receiver: Receiver) -> None:
    msgs = _messages(tmp_path, 3)
    receiver.script = lambda i, _n: (400, {}, b"malformed body\nline two") if i == msgs[1].id else (200, {}, b"ok")
    receiver.start()
    with Outbox(tmp_path / "o.sqlite", RetryConfig(base_s=0.01, cap_s=0.01)) as box:
        for m in msgs:
            box.enqueue(m)
        out = box.deliver_due(_send(receiver))
        assert [(r.outcome, r.status) for r in out] == [(Outcome.DELIVERED, 200), (Outcome.REJECTED, 400),
                                                       (Outcome.DELIVERED, 200)]
        assert out[1].detail == "malformed body" and "not retried" in out[1].line()
        assert box.deliver_due(_send(receiver), now=time.time() + 3600) == []
        assert [h.id for h in receiver.hits] == [m.id for m in msgs]
        assert str(box.stats()) == "0 pending, 2 delivered, 1 rejected, 0 dead"
        rejected = box.entries(State.REJECTED)
        assert [(e.message.id, e.status, e.detail) for e in rejected] == [(msgs[1].id, 400, "malformed body")]


def test_restart_mid_way_loses_nothing_and_sends_nothing_twice(tmp_path: Path, receiver: Receiver) -> None:
    msgs = _messages(tmp_path, 5)
    receiver.script = lambda i, n: ((503, {"Retry-After": "1"}, b"down") if i == msgs[2].id and n == 0
                                    else (200, {}, b"ok"))
    receiver.start()
    path = tmp_path / "o.sqlite"
    box = Outbox(path, RetryConfig(base_s=0.5, cap_s=0.5))
    for m in msgs:
        box.enqueue(m, now=T0)
    out = box.deliver_due(_send(receiver), now=T0)
    assert [r.outcome for r in out] == [Outcome.DELIVERED, Outcome.DELIVERED, Outcome.RETRY]
    box.close()  # the monitor stops

    again = Outbox(path, RetryConfig(base_s=0.5, cap_s=0.5))
    assert [m.id for m in again.pending()] == [m.id for m in msgs[2:]]
    assert not any(again.enqueue(m, now=T0 + 1) for m in msgs)  # the restarted monitor rebuilds them: stored once
    assert again.next_due() == T0 + 1  # the 503's Retry-After, kept across the restart
    assert again.deliver_due(_send(receiver), now=T0 + 0.9) == []
    out = again.deliver_due(_send(receiver), now=T0 + 1)
    assert [(r.id, r.outcome) for r in out] == [(m.id, Outcome.DELIVERED) for m in msgs[2:]]
    assert receiver.accepted == [m.id for m in msgs]
    assert [h.id for h in receiver.hits].count(msgs[2].id) == 2 and len(receiver.hits) == 6
    again.close()


def test_runs_are_ordered_apart_and_given_up_messages_unblock_their_run(tmp_path: Path) -> None:
    a, b = _messages(tmp_path, 2, "run-a"), _messages(tmp_path, 2, "run-b")
    sent: list[str] = []

    def send(m: Message) -> Reply:
        sent.append(m.id)
        if m.run == "run-a" and m.id == a[0].id:
            return Reply(status=None, detail="refused")
        return Reply(status=204)

    box = Outbox(tmp_path / "o.sqlite", RetryConfig(base_s=1, cap_s=1, max_attempts=2))
    for m in (a[0], b[0], a[1], b[1]):
        box.enqueue(m, now=T0)
    out = box.deliver_due(send, now=T0)
    assert sent == [a[0].id, b[0].id, b[1].id]  # run-a waits behind its head; run-b is not held up by it
    out = box.deliver_due(send, now=T0 + 1)
    assert [(r.id, r.outcome) for r in out] == [(a[0].id, Outcome.DEAD), (a[1].id, Outcome.DELIVERED)]
    assert "given up after 2 attempt(s): refused" in out[0].line()
    assert box.stats().dead == 1 and box.stats().delivered == 3

    raising = Outbox(tmp_path / "p.sqlite", RetryConfig(max_age_s=10))
    raising.enqueue(a[0], now=T0)

    def boom(_: Message) -> Reply:
        raise RuntimeError("transport bug")

    out = raising.deliver_due(boom, now=T0)
    assert out[0].outcome is Outcome.RETRY and "transport bug" in out[0].detail
    out = raising.deliver_due(boom, now=T0 + 10)  # past its age: dead without another attempt
    assert (out[0].outcome, out[0].attempts) == (Outcome.DEAD, 1) and "older than 10s" in out[0].detail
    box.close()
    raising.close()


def test_one_attempt_per_head_per_pass_even_when_retry_after_is_zero(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "o.sqlite")
    msgs = _messages(tmp_path, 2)
    for m in msgs:
        box.enqueue(m, now=T0)
    transport = MemoryTransport(default=Reply(status=503, retry_after_s=0.0))
    out = box.deliver_due(signed_send(transport, Signer(SPEC_SECRET)), now=T0)
    assert [(r.id, r.outcome, r.retry_in_s) for r in out] == [(msgs[0].id, Outcome.RETRY, 0.0)]
    assert len(transport.requests) == 1 and box.next_due() == T0
    box.close()


def test_retry_after_forms_and_backoff_caps() -> None:
    assert _retry_after("12", T0) == 12.0
    assert _retry_after(None, T0) is None and _retry_after("soon", T0) is None
    date = datetime.fromtimestamp(T0 + 30, tz=timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert _retry_after(date, T0) == pytest.approx(30.0)
    with pytest.raises(ValueError):
        RetryConfig(base_s=2, cap_s=1)


def test_outbox_file_problems_are_one_line_errors(tmp_path: Path) -> None:
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not a database file at all, not even close" * 100)
    with pytest.raises(AlertConfigError, match="junk.sqlite"):
        Outbox(junk)


def test_sender_thread_delivers_after_the_receiver_comes_back(tmp_path: Path, receiver: Receiver) -> None:
    said: list[str] = []
    failed = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        if "no answer" in line:
            failed.set()

    secret_file = tmp_path / "secret"
    secret_file.write_text(receiver.secret + "\n")
    sender = AlertSender.open(f"http://127.0.0.1:{receiver.port}/hook", secret_file, tmp_path / "o.sqlite",
                              retry=RetryConfig(base_s=0.01, cap_s=0.05), timeout_s=2, say=say, idle_s=0.05)
    msgs = _messages(tmp_path, 3)
    with sender:
        assert sender.submit_all(msgs) == 3 and sender.submit(msgs[0]) is False
        assert failed.wait(10), said
        assert sender.flush(0.05) is False
        receiver.start()
        assert sender.flush(10), said
        assert str(sender.stats()) == "0 pending, 3 delivered, 0 rejected, 0 dead"
    assert receiver.accepted == [m.id for m in msgs]
    assert any("delivered" in s for s in said)
    assert sender.submit(_messages(tmp_path, 4)[3]) is False  # closed outbox: kept, never raised
    assert sender.errors >= 1 and sender.stats().pending == 1


def test_sender_without_thread_flushes_inline_with_the_memory_transport(tmp_path: Path) -> None:
    transport = MemoryTransport([Reply(status=500, detail="oops"), 200])
    sender = AlertSender(Outbox(tmp_path / "o.sqlite", RetryConfig(base_s=0.01, cap_s=0.01)), transport,
                         Signer(SPEC_SECRET), say=lambda _: None)
    msgs = _messages(tmp_path, 2)
    sender.submit_all(msgs)
    assert sender.flush(5)
    assert [r.headers["webhook-id"] for r in transport.requests] == [msgs[0].id, msgs[0].id, msgs[1].id]
    for r in transport.requests:
        Webhook(SPEC_SECRET).verify(r.body, r.headers)
    sender.close()


def test_decision_fields_are_dataclass_checked() -> None:
    with pytest.raises(ValueError, match="dec_"):
        DecisionFields(id="x", incidents=("a",), action=Action.OBSERVE, scope="none", target=None, checkpoint=None,
                       path=(), reasons=())


def test_the_documented_example_body_has_the_contract_shape() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "alerts.md").read_text()
    body = doc.split("```json\n", 1)[1].split("\n```", 1)[0]
    example = _strict(body.encode())
    _check_alertmanager_shape(example)
    assert example["type"] == "decision" and set(example["rankwatch"]["decision"]) == {
        "id", "action", "scope", "target", "checkpoint", "path", "reasons", "quarantines"}
    assert Incident.from_dict(example["rankwatch"]["incident_doc"]).id == example["rankwatch"]["incident"]
