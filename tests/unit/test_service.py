"""The recovery manager service against its real HTTP server (uvicorn on 127.0.0.1, a free port): refusals with the
right codes, counted in /status; at-most-once application, also across a restart on the same state file; decisions
that stop the job, quarantine while it runs, or only record; Alertmanager deliveries as evidence only. The job is
the shipped FakeLauncher (no torch ranks); the recovery is the real `control.manager.apply`."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rankwatch.analytics.incidents import Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.rundir import MANAGER_DIR, QUARANTINE_FILE, RECOVERY_DIR, STATE_FILE
from rankwatch.base.topology import Layout
from rankwatch.canary.config import CanaryConfig
from rankwatch.control.manager import plan_from_message, quarantined
from rankwatch.control.service import JobState, ManagerService, read_secret
from rankwatch.control.wire import parse_message
from rankwatch.recovery.job import FakeLauncher
from rankwatch.recovery.lineage import lineage_path, read
from service_support import SECRET, TOKEN, contract_body, incident, msg_id, signed, wait_for

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------- test helpers


def post(svc: ManagerService, path: str, body: bytes | Iterator[bytes], headers: dict[str, str]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    try:
        chunked = not isinstance(body, bytes)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers},
                     encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def get(svc: ManagerService, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def status(svc: ManagerService) -> dict[str, Any]:
    code, doc = get(svc, "/status")
    assert code == 200
    assert isinstance(doc, dict)
    return doc


def decided(svc: ManagerService, n: int = 1) -> dict[str, Any]:
    """/status once `n` decisions reached done or failed."""
    wait_for(lambda: sum(v for k, v in status(svc)["decisions"].items() if k in ("done", "failed")) >= n)
    return status(svc)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run-a"


def job(run_dir: Path) -> CanaryConfig:
    return CanaryConfig(run_dir=run_dir, steps=20, layout=Layout(dp=2), gpu="off")


def service(run_dir: Path, launcher: FakeLauncher, *, with_job: bool = True, **kw: Any) -> ManagerService:
    return ManagerService(run_dir, secret=SECRET, token=TOKEN, job=job(run_dir) if with_job else None,
                          load_job=CanaryConfig.from_run, launcher=launcher, planner=plan_from_message, **kw)


@pytest.fixture
def running(run_dir: Path) -> Iterator[tuple[ManagerService, FakeLauncher]]:
    fake = FakeLauncher(("run", "ok"))
    svc = service(run_dir, fake, max_body=4096).start()
    assert fake.started.acquire(timeout=10)
    wait_for(lambda: status(svc)["job"]["state"] == JobState.RUNNING)
    try:
        yield svc, fake
    finally:
        svc.stop()


# --------------------------------------------------------------------------------------------------- refusals


def test_healthz_and_the_bound_port(running: tuple[ManagerService, FakeLauncher]) -> None:
    svc, _ = running
    assert svc.port > 0 and get(svc, "/healthz") == (200, {"ok": True})


def test_every_refusal_has_its_code_its_log_line_and_its_counter(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    svc, fake = running
    body = contract_body(run_dir, incident())
    good = signed(body)
    caplog.set_level(logging.WARNING, logger="rankwatch.manager")

    cases: list[tuple[str, bytes | Iterator[bytes], dict[str, str], int]] = [
        ("bad_signature", body, signed(body, secret="whsec_" + base64.b64encode(b"x" * 32).decode()), 401),
        ("bad_signature", body.replace(b'"rank 1', b'"rank 2'), good, 401),  # the body changed under the signature
        ("missing_headers", body, {k: v for k, v in good.items() if k != "webhook-signature"}, 401),
        ("missing_headers", body, {}, 401),
        ("malformed_signature", body, {**good, "webhook-signature": "v1"}, 401),
        ("malformed_signature", body, {**good, "webhook-signature": "v1,@@not-base64@@"}, 401),
        ("malformed_headers", body, {**good, "webhook-timestamp": "soon"}, 401),
        ("stale_timestamp", body, signed(body, ts=time.time() - 301), 401),
        ("stale_timestamp", body, signed(body, ts=time.time() + 400), 401),
        ("too_large", b"{" + b" " * 5000 + b"}", good, 413),  # Content-Length over the limit
        ("too_large", iter([b"{", b" " * 3000, b" " * 3000, b"}"]), good, 413),  # chunked: the streamed read is capped
    ]
    for reason, b, headers, code in cases:
        got, doc = post(svc, "/alerts", b, headers)
        assert (got, doc["error"]) == (code, reason), (reason, doc)

    broken = json.loads(body)
    del broken["rankwatch"]["incident_doc"]
    raw = json.dumps(broken).encode()
    got, doc = post(svc, "/alerts", raw, signed(raw))
    assert got == 400 and doc["error"] == "malformed_body" and "rankwatch.incident_doc" in doc["detail"]
    other = contract_body(run_dir.with_name("run-b"), incident())
    got, doc = post(svc, "/alerts", other, signed(other))
    assert got == 400 and doc["error"] == "wrong_run"

    refused = status(svc)["refused"]
    assert refused == {"bad_signature": 2, "missing_headers": 2, "malformed_signature": 2, "malformed_headers": 1,
                       "stale_timestamp": 2, "too_large": 2, "malformed_body": 1, "wrong_run": 1}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused /alerts")]
    assert len(lines) == 13 and all("\n" not in line for line in lines)
    assert any(good["webhook-id"] in line and "bad_signature" in line for line in lines)
    # nothing refused was applied: the job still runs its first attempt
    assert len(fake.calls) == 1 and status(svc)["job"]["state"] == JobState.RUNNING
    assert not (run_dir / RECOVERY_DIR).exists()


def test_a_replayed_id_is_a_duplicate_with_the_same_body_and_a_conflict_with_another(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path
) -> None:
    svc, fake = running
    body = contract_body(run_dir, incident())
    mid = msg_id(body)
    code, doc = post(svc, "/alerts", body, signed(body, mid=mid))
    assert code == 202 and doc["accepted"] and doc["stopping"]
    s = decided(svc)
    assert s["last_decision"]["state"] == "done" and s["last_decision"]["recovery_id"] == "recovery-0001"
    # the retry of the same message (a new timestamp, so a new signature): acknowledged, nothing applied again
    code, doc = post(svc, "/alerts", body, signed(body, mid=mid, ts=time.time() + 1))
    assert code == 200 and doc["duplicate"] and doc["state"] == "done"
    other = contract_body(run_dir, incident(rank=0))
    code, doc = post(svc, "/alerts", other, signed(other, mid=mid))
    assert code == 409 and doc["error"] == "replayed_id"
    time.sleep(0.2)  # room for a wrongful second application to show
    assert len(fake.calls) == 2 and len(list((run_dir / RECOVERY_DIR).glob("recovery-*.json"))) == 1
    assert status(svc)["refused"] == {"replayed_id": 1}


# ---------------------------------------------------------------------------------------------------- actions


def test_a_fail_stop_decision_stops_the_job_at_once_recovers_it_and_status_shows_it(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path
) -> None:
    svc, fake = running
    inc = incident()
    fired = contract_body(run_dir, inc, type_="incident.firing", action=None)
    assert post(svc, "/alerts", fired, signed(fired))[0] == 200
    assert [i["id"] for i in status(svc)["open_incidents"]] == [inc.id]
    body = contract_body(run_dir, inc)
    assert post(svc, "/alerts", body, signed(body))[0] == 202
    s = decided(svc)
    assert s["last_decision"]["outcome"] == "recovered" and s["job"]["state"] == JobState.FINISHED
    # the first attempt ended by the stop event (not by its own end), the relaunch from step 0 finished
    assert [(a["attempt"], a["stopped"], a["exit_codes"]) for a in s["attempts"]] == [(0, True, [-15, -15]),
                                                                                      (1, False, [0, 0])]
    assert not fake.calls[1].resume and not fake.calls[1].faults.specs()
    rec = json.loads((run_dir / RECOVERY_DIR / "recovery-0001.json").read_text())
    assert rec["incidents"] == [inc.id] and rec["action"] == "restart_job" and rec["outcome"] == "recovered"
    # the detection is the decision's arrival, the decision its plan; both before the relaunch and the record
    assert rec["detected_by"] == f"the decision message {msg_id(body)} reached the manager service"
    assert rec["detected_wall_ns"] <= rec["decided_wall_ns"] <= s["attempts"][1]["started_wall_ns"] < rec["wall_ns"]
    assert [str(e.kind) for e in read(lineage_path(run_dir))][:1] == ["restart"]
    resolved = contract_body(run_dir, inc, type_="incident.resolved", action=None)
    assert post(svc, "/alerts", resolved, signed(resolved))[0] == 200
    assert status(svc)["open_incidents"] == []


def test_a_quarantine_decision_applies_it_and_leaves_the_job_running(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path
) -> None:
    svc, fake = running
    body = contract_body(run_dir, incident(IncidentClass.STRAGGLER, device="GPU-aa"), action="quarantine")
    code, doc = post(svc, "/alerts", body, signed(body))
    assert code == 202 and not doc["stopping"]
    s = decided(svc)
    assert s["last_decision"]["outcome"] == "quarantined" and s["job"]["state"] == JobState.RUNNING
    assert [(e.kind, e.id) for e in quarantined(run_dir)] == [("device", "GPU-aa")]
    assert len(fake.calls) == 1
    # the same device again (another reading of the fault, after a relaunch): nothing new, no second record
    again = contract_body(run_dir, incident(IncidentClass.STRAGGLER, device="GPU-aa", attempt=1), action="quarantine")
    assert post(svc, "/alerts", again, signed(again))[0] == 202
    s = decided(svc, 2)
    assert s["last_decision"]["outcome"] == "observed: device:GPU-aa quarantined already"
    assert len(list((run_dir / RECOVERY_DIR).glob("recovery-*.json"))) == 1


def test_an_observe_decision_is_only_recorded(running: tuple[ManagerService, FakeLauncher], run_dir: Path) -> None:
    svc, fake = running
    body = contract_body(run_dir, incident(IncidentClass.STRAGGLER), action="observe")
    assert post(svc, "/alerts", body, signed(body))[0] == 202
    s = decided(svc)
    assert s["last_decision"]["outcome"].startswith("observed") and s["job"]["state"] == JobState.RUNNING
    assert not (run_dir / RECOVERY_DIR).exists() and not (run_dir / QUARANTINE_FILE).exists()


def _relaunched(svc: ManagerService, fake: FakeLauncher, run_dir: Path) -> bytes:
    """A fail-stop decision sent, its relaunch (attempt 1) running; the decision's body."""
    assert fake.started.acquire(timeout=10)
    body = contract_body(run_dir, incident())
    assert post(svc, "/alerts", body, signed(body))[0] == 202
    assert fake.started.acquire(timeout=10)  # the relaunch, attempt 1, runs: its recovery record is not written
    wait_for(lambda: status(svc)["job"] == {**status(svc)["job"], "state": "running", "attempt": 1})
    return body


@pytest.mark.parametrize(("late_incident", "action", "outcome"), [
    # the monitor's word on attempt 0 (another rank), arriving late
    (incident(rank=0, attempt=0), "restart_job", "covered: incident of attempt 0"),
    # the same incident decided again (the post-hoc reading's decision), its attempt unknown: the recovery running
    # is the one from it, and its record is not written until the relaunch ends
    (incident(attempt=None), "rollback_domain", "covered by recovery-0001: acted on already"),
    # a finding over every attempt's rows (its attempt unknown), detected before the relaunch started, whose onset
    # is after the point the relaunch resumed from: what it is about is not what runs (a drill's stale corruption
    # alert stopped the relaunch in CI)
    (replace(incident(IncidentClass.CORRUPTION, attempt=None), subject=Subject(kind=SubjectKind.JOB, id="job"),
             detection_wall_ns=1), "rollback_domain", "covered: incident detected before attempt 1 started"),
], ids=["replaced-attempt", "being-recovered", "found-before-the-relaunch"])
def test_a_late_decision_never_stops_the_relaunch_that_replaced_or_recovers_it(
        run_dir: Path, late_incident: Incident, action: str, outcome: str) -> None:
    fake = FakeLauncher(("run", "run"))
    with service(run_dir, fake) as svc:
        body = _relaunched(svc, fake, run_dir)
        late = contract_body(run_dir, late_incident, action=action)
        assert msg_id(late) != msg_id(body)
        code, doc = post(svc, "/alerts", late, signed(late))
        assert code == 202 and not doc["stopping"]
        assert status(svc)["job"]["state"] == JobState.RUNNING
        fake.finish()
        decided(svc, 2)
        by_id = {d["id"]: d for d in svc.manager.db.decisions()}
        assert by_id[msg_id(body)]["outcome"] == "recovered"
        assert by_id[msg_id(late)]["outcome"].startswith(outcome)
        assert status(svc)["job"]["state"] == JobState.FINISHED
    assert len(fake.calls) == 2


# ------------------------------------------------------------------------------------------- across a restart


def test_at_most_once_across_a_restart_on_the_same_state_file(run_dir: Path) -> None:
    fake = FakeLauncher(("run", "ok"))
    body = contract_body(run_dir, incident())
    with service(run_dir, fake) as svc:
        assert fake.started.acquire(timeout=10)
        assert post(svc, "/alerts", body, signed(body))[0] == 202
        assert decided(svc)["last_decision"]["outcome"] == "recovered"
    assert (run_dir / MANAGER_DIR / STATE_FILE).is_file()

    again = FakeLauncher(("ok",))
    with service(run_dir, again, with_job=False) as svc:  # restarted: owns no attempt, reads the state file
        code, doc = post(svc, "/alerts", body, signed(body))
        assert code == 200 and doc["duplicate"] and doc["state"] == "done"
        s = status(svc)
        assert s["job"]["state"] == JobState.NONE and len(s["attempts"]) == 2
        assert s["last_decision"]["recovery_id"] == "recovery-0001"
    assert again.calls == [] and len(list((run_dir / RECOVERY_DIR).glob("recovery-*.json"))) == 1


def test_a_restart_reruns_accepted_decisions_but_never_started_ones(run_dir: Path) -> None:
    first, second = incident(rank=0), incident(rank=1)
    b1, b2 = contract_body(run_dir, first), contract_body(run_dir, second)
    FakeLauncher(("fail",))(job(run_dir), stop=__import__("threading").Event(), on_start=lambda p: None)
    # a service that died: one decision started (its action may have partly run), one accepted and never started
    from rankwatch.control.ledger import Ledger, MessageState

    db = Ledger(run_dir / MANAGER_DIR / STATE_FILE)
    db.admit(msg_id(b1), hashlib.sha256(b1).hexdigest(), b1, parse_message(b1))
    db.mark(msg_id(b1), MessageState.STARTED)
    db.admit(msg_id(b2), hashlib.sha256(b2).hexdigest(), b2, parse_message(b2))
    db.close()

    fake = FakeLauncher(("ok",))
    with service(run_dir, fake, with_job=False) as svc:
        s = decided(svc)
        assert s["interrupted"] == [msg_id(b1)]
        by_id = {d["id"]: d for d in svc.manager.db.decisions()}
        assert by_id[msg_id(b1)]["state"] == "interrupted"
        assert by_id[msg_id(b2)]["state"] == "done" and by_id[msg_id(b2)]["outcome"] == "recovered"
        # a retry of the interrupted one is a duplicate, never a second run
        code, doc = post(svc, "/alerts", b1, signed(b1))
        assert code == 200 and doc["state"] == "interrupted"
    assert len(fake.calls) == 1
    rec = json.loads((run_dir / RECOVERY_DIR / "recovery-0001.json").read_text())
    assert rec["incidents"] == [second.id]


# -------------------------------------------------------------------------------------------- alertmanager


def test_alertmanager_deliveries_need_the_token_are_deduplicated_and_never_act(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path
) -> None:
    svc, fake = running
    doc = json.loads(contract_body(run_dir, incident()))
    for k in ("type", "timestamp", "rankwatch"):
        doc.pop(k)  # what a real Alertmanager sends: v4 only
    raw = json.dumps(doc).encode()
    assert post(svc, "/alertmanager", raw, {})[0] == 401
    assert post(svc, "/alertmanager", raw, {"Authorization": "Bearer wrong"})[0] == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert post(svc, "/alertmanager", raw, auth) == (200, {"recorded": True, "evidence_only": True})
    assert post(svc, "/alertmanager", raw, auth) == (200, {"duplicate": True})
    doc["status"] = "resolved"
    assert post(svc, "/alertmanager", json.dumps(doc).encode(), auth)[1] == {"recorded": True, "evidence_only": True}
    assert post(svc, "/alertmanager", b"[1]", auth)[0] == 400
    s = status(svc)
    assert s["alertmanager"]["deliveries"] == 2 and s["alertmanager"]["last"]["status"] == "resolved"
    assert s["refused"] == {"bad_token": 2, "malformed_body": 1}
    lines = (run_dir / MANAGER_DIR / "alertmanager.jsonl").read_text().splitlines()
    assert [json.loads(x)["status"] for x in lines] == ["firing", "resolved"]
    # evidence only: the job runs on, nothing recovered or quarantined, no decision recorded
    assert s["job"]["state"] == JobState.RUNNING and len(fake.calls) == 1 and s["last_decision"] is None
    assert not (run_dir / RECOVERY_DIR).exists()


# --------------------------------------------------------------------------------------------------- parsing


def test_parse_message_names_what_is_missing(run_dir: Path) -> None:
    body = json.loads(contract_body(run_dir, incident()))
    m = parse_message(json.dumps(body).encode())
    assert m.stops_job and m.decision is not None and str(m.decision.action) == "restart_job"
    del body["rankwatch"]["decision"]["action"]
    with pytest.raises(ValueError, match=r"missing key 'rankwatch.decision.action'"):
        parse_message(json.dumps(body).encode())
    with pytest.raises(ValueError, match="key 'type'"):
        parse_message(contract_body(run_dir, incident(), type_="incident.exploded"))
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_message(b"\xff\xfe")


def test_read_secret_says_what_is_wrong(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert read_secret(f) == SECRET
    f.write_text("whsec_" + base64.b64encode(b"short").decode())
    with pytest.raises(ValueError, match="at least 24"):
        read_secret(f)
    f.write_text("hunter2")
    with pytest.raises(ValueError, match="does not start with 'whsec_'"):
        read_secret(f)


def test_the_alerts_senders_messages_are_understood_and_acted_on(
    running: tuple[ManagerService, FakeLauncher], run_dir: Path
) -> None:
    """The other side of the wire contract: control.wire builds and signs, this service verifies and acts."""
    from rankwatch.control.signer import Signer
    from rankwatch.control.wire import decision_fields, decision_message, incident_message
    from rankwatch.recovery.decision import CheckpointCatalogView, Idempotency, MembershipSupport
    from rankwatch.recovery.policy import decide

    svc, fake = running
    inc = incident()
    signer = Signer(SECRET)
    fired = incident_message(run_dir, inc, "firing")
    code, _ = post(svc, "/alerts", fired.body, signer.headers(fired.id, fired.body, timestamp=int(time.time())))
    assert code == 200 and [i["id"] for i in status(svc)["open_incidents"]] == [inc.id]
    dec = decide(inc, None, idempotent=Idempotency.NOT_IDEMPOTENT, membership=MembershipSupport.FIXED_SHAPES,
                 catalog=CheckpointCatalogView(committed=()))
    msg = decision_message(run_dir, decision_fields(dec, run_dir=run_dir, incidents=[inc]), [inc])
    code, doc = post(svc, "/alerts", msg.body, signer.headers(msg.id, msg.body, timestamp=int(time.time())))
    assert code == 202 and doc["stopping"]
    s = decided(svc)
    assert s["last_decision"]["outcome"] == "recovered" and s["last_decision"]["decision_id"] == msg.decision
    assert len(fake.calls) == 2


# ---------------------------------------------------------------------------------- placement off the quarantine


def test_place_off_moves_every_host_by_one_shift_or_refuses_when_nothing_is_left(tmp_path: Path) -> None:
    from rankwatch.canary.config import place_off, placement
    from rankwatch.collector.gpu import replay_uuid

    cfg = CanaryConfig(run_dir=tmp_path, steps=5, layout=Layout(dp=4), hosts=2, slots_per_host=3, gpu="off")
    assert [s for _, s, _ in placement(cfg).values()] == [0, 1, 0, 1]
    assert place_off(cfg, devices={replay_uuid("host0", 2)}) == (cfg, ())  # a spare nobody uses
    bad = replay_uuid("host1", 1)
    moved, lines = place_off(cfg, devices={bad})
    # shift 1 puts ranks on slots 1, 2 (still host1 slot 1); shift 2 on slots 2, 0: clear on both hosts
    assert moved.device_shift == 2 and [s for _, s, _ in placement(moved).values()] == [2, 0, 2, 0]
    assert bad not in {u for _, _, u in placement(moved).values()}
    assert lines[0] == f"rank 0: host0 slot 0 {replay_uuid('host0', 0)} -> slot 2 {replay_uuid('host0', 2)}"
    with pytest.raises(ValueError, match="nothing is left"):
        place_off(cfg, devices={bad, replay_uuid("host0", 2), replay_uuid("host1", 0)})
    with pytest.raises(ValueError, match=r"nothing is left.*slots_per_host"):
        place_off(CanaryConfig(run_dir=tmp_path, steps=5, layout=Layout(dp=2), gpu="off"),
                  devices={replay_uuid("host0", 0)})
    with pytest.raises(ValueError, match="host1 quarantined.*no spare host"):
        place_off(cfg, hosts={"host1"})
    with pytest.raises(ValueError, match="fewer than the 2 ranks"):
        CanaryConfig(run_dir=tmp_path, steps=5, layout=Layout(dp=4), hosts=2, slots_per_host=1)


@pytest.mark.parametrize("slots", [3, 0])
def test_a_relaunch_never_lands_on_a_quarantined_device(run_dir: Path, slots: int) -> None:
    from dataclasses import replace

    from rankwatch.canary.config import placement
    from rankwatch.collector.gpu import replay_uuid

    # without spare slots the job has fixed shapes (tp=2): a pure-dp canary would go on with fewer replicas
    cfg = replace(job(run_dir), slots_per_host=slots, **({} if slots else {"layout": Layout(tp=2)}))
    fake = FakeLauncher(("run", "ok"))
    bad = replay_uuid("host0", 1)  # rank 1's device
    with ManagerService(run_dir, secret=SECRET, job=cfg, launcher=fake, planner=plan_from_message) as svc:
        assert fake.started.acquire(timeout=10)
        q = contract_body(run_dir, incident(IncidentClass.STRAGGLER, device=bad), action="quarantine")
        assert post(svc, "/alerts", q, signed(q))[0] == 202
        assert decided(svc)["last_decision"]["outcome"] == "quarantined"
        body = contract_body(run_dir, incident())
        assert post(svc, "/alerts", body, signed(body))[0] == 202
        s = decided(svc, 2)
    if slots:
        assert s["last_decision"]["outcome"] == "recovered"
        again = fake.calls[1]
        assert bad not in {u for _, _, u in placement(again).values()} and again.device_shift == 2
        kinds = [(str(e.kind), e.details.old_device, e.details.new_device) for e in read(lineage_path(run_dir))]
        assert ("device_replaced", bad, replay_uuid("host0", 0)) in kinds
    else:  # two ranks of fixed shapes on a two-slot host: nowhere else to go
        assert s["last_decision"]["state"] == "failed" and "nothing is left" in s["last_decision"]["outcome"]
        assert s["job"]["state"] == JobState.FAILED and len(fake.calls) == 1


def test_an_address_in_use_fails_before_anything_is_launched(run_dir: Path, tmp_path: Path) -> None:
    import socket

    from rankwatch.control.service import serve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        fake = FakeLauncher()
        svc = ManagerService(run_dir, secret=SECRET, job=job(run_dir), launcher=fake,
                             port=taken.getsockname()[1])
        with pytest.raises(ValueError, match="cannot listen"):
            svc.start()
        assert fake.calls == [] and not (run_dir / MANAGER_DIR).exists()
    finally:
        taken.close()
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        serve(run_dir, launcher=FakeLauncher(), load_job=CanaryConfig.from_run, listen="8787", secret_file=secret)


@pytest.mark.slow  # the service in a process of its own
def test_serve_runs_in_the_foreground_and_ends_cleanly_on_sigterm(tmp_path: Path) -> None:
    """What `rankwatch manager serve` calls: uvicorn in the main thread, its own SIGTERM handling, state closed."""
    import signal
    import subprocess
    import sys

    run_dir = tmp_path / "run-s"
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    from service_support import free_port

    port = free_port()
    code = ("import sys; from pathlib import Path; from rankwatch.control.service import serve; "
            "from rankwatch.canary import CanaryLauncher, config_from_run; "
            f"sys.exit(serve(Path({str(run_dir)!r}), launcher=CanaryLauncher(), load_job=config_from_run, "
            f"listen='127.0.0.1:{port}', secret_file=Path({str(secret)!r}), log_level='warning'))")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        def up() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                conn.connect()
                assert conn.sock is not None
                if conn.sock.getsockname() == conn.sock.getpeername():
                    return False  # a TCP self-connect before the service listens: the probe, not the service
                conn.request("GET", "/healthz")
                return conn.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                return False
            finally:
                conn.close()

        wait_for(up, 45)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/status")
            doc = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        assert doc["job"]["state"] == "none" and doc["run"] == "run-s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (run_dir / MANAGER_DIR / STATE_FILE).is_file()
