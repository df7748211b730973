"""What the manager service's tests share: the signing secret and bearer token, incidents, bodies of the wire
contract built by hand, signatures, and a polling wait."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from standardwebhooks.webhooks import Webhook

from rankwatch.analytics.incidents import Cause, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


TOKEN = "am-token-1"


def incident(klass: IncidentClass = IncidentClass.FAIL_STOP, *, rank: int = 1, attempt: int | None = 0,
             device: str | None = None) -> Incident:
    if device is not None:  # a device fault: throttled with clock loss
        return Incident(klass=klass, subject=Subject(kind=SubjectKind.DEVICE, id=device), ranks=(rank,), onset_step=5,
                        detection_step=8, confidence=0.9, cause=Cause.THERMAL_THROTTLE, summary=f"{device} throttled",
                        attempt=attempt, hardware=(HardwareSignal.THROTTLE, HardwareSignal.CLOCK_LOSS))
    return Incident(klass=klass, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,), onset_step=7,
                    detection_step=7, confidence=1.0, cause=Cause.UNKNOWN, summary=f"rank {rank} {klass}",
                    attempt=attempt)


def contract_body(run_dir: Path, inc: Incident, *, type_: str = "decision", action: str | None = "restart_job",
                  **overrides: Any) -> bytes:
    """A body of the wire contract (PRE15: Alertmanager v4 + rankwatch's keys), built by hand."""
    run = run_dir.name
    firing = type_ != "incident.resolved"
    camel = "".join(p.capitalize() for p in str(inc.klass).split("_"))
    labels = {"alertname": f"Rankwatch{camel}", "class": str(inc.klass), "run": run,
              "rank": ",".join(map(str, inc.ranks)), "hostname": "h0", "uuid": "", "severity": "critical"}
    decision = None if type_ != "decision" else {
        "id": f"{inc.id}/{action}", "action": action, "scope": "job", "target": None, "checkpoint": None,
        "path": ["gate=none", f"-> {action}"], "reasons": ["test"], "quarantines": []}
    doc: dict[str, Any] = {
        "version": "4", "groupKey": f"rankwatch/{run}/{inc.id}", "truncatedAlerts": 0,
        "status": "firing" if firing else "resolved", "receiver": "rankwatch-manager", "externalURL": "",
        "groupLabels": {"alertname": labels["alertname"], "run": run}, "commonLabels": labels,
        "commonAnnotations": {},
        "alerts": [{"status": "firing" if firing else "resolved", "labels": labels,
                    "annotations": {"summary": inc.summary, "decision": "" if decision is None else str(action),
                                    "evidence": ""},
                    "startsAt": "2026-12-01T20:00:00Z", "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "",
                    "fingerprint": hashlib.sha256(f"{run}|{inc.id}".encode()).hexdigest()[:16]}],
        "type": type_, "timestamp": "2026-12-01T20:00:01Z",
        "rankwatch": {"schema": 1, "run": run, "run_dir": str(run_dir), "incident": inc.id,
                      "incident_doc": inc.to_dict(), "decision_id": None if decision is None else decision["id"],
                      "decision": decision, "scope": "job", "evidence": {}},
    }
    doc.update(overrides)
    return json.dumps(doc).encode()


def msg_id(body: bytes) -> str:
    return "msg_" + hashlib.sha256(body).hexdigest()[:32]


def signed(body: bytes, *, mid: str | None = None, ts: float | None = None, secret: str = SECRET) -> dict[str, str]:
    mid = mid or msg_id(body)
    when = datetime.fromtimestamp(time.time() if ts is None else ts, tz=timezone.utc)
    return {"webhook-id": mid, "webhook-timestamp": str(int(when.timestamp())),
            "webhook-signature": Webhook(secret).sign(mid, when, body.decode())}


def wait_for(pred: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def free_port() -> int:
    """A loopback port nothing listens on, outside the kernel's ephemeral range. A port from the range (what binding
    port 0 gives) can be handed to a client's probe as its own source before the server listens: the probe then
    connects to itself (a TCP self-connect) and holds the port, and the server's bind fails. CI saw both halves:
    `BadStatusLine: GET /healthz` and a service that never answered."""
    import random
    import socket

    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below = [p for p in range(10000, low) if p != 0]
    above = list(range(high + 1, 65536))
    ports = below + above
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free loopback port outside the ephemeral range")
