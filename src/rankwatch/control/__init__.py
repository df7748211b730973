"""rankwatch.control: the live loop in one room.

    monitor   liveness polls and window re-analysis of a running job; each incident, its resolution and each decision
              as a signed alert (`Monitor`, `rankwatch watch`)
    wire      the alert wire format, built and parsed in one module (Alertmanager v4 + rankwatch's keys)
    tracker   what a monitor sends each tick, each thing once
    signer    the Standard Webhooks secret and signature both sides use
    outbox    the durable SQLite outbox, retried with backoff
    sender    transports and the background sender
    manager   assess / plan / apply: incidents in, the narrowest safe recovery out, applied to any `recovery.job.Job`
    ledger    the service's durable state (at most once)
    service   the recovery manager as an HTTP service: a thin shell over `manager`

Which side decides: the recovery manager. The monitor attaches what its reading of the policy asks for to a decision
message; the manager verifies the signature, re-plans with its own policy (`manager.plan_live` after the attempt
ended, `manager.plan_from_message` for a quarantine while the job runs on) and acts only on its own plan. The job
and its launcher are given to it (`recovery.job`): control imports no job, the canary included.
"""

from rankwatch.control.manager import RecoveryPlan, apply, assess, plan_recovery, supervise
from rankwatch.control.monitor import Monitor
from rankwatch.control.outbox import Outbox, RetryConfig
from rankwatch.control.sender import AlertSender, HttpTransport, MemoryTransport, Transport
from rankwatch.control.service import Manager, ManagerService, serve
from rankwatch.control.signer import Signer, load_secret, new_secret, write_secret
from rankwatch.control.tracker import AlertTracker, TrackerConfig
from rankwatch.control.wire import (
    AlertConfigError, AlertMessage, Message, MessageType, decision_message, incident_message, parse_message,
)

__all__ = [
    "AlertConfigError", "AlertMessage", "AlertSender", "AlertTracker", "HttpTransport", "Manager", "ManagerService",
    "MemoryTransport", "Message", "MessageType", "Monitor", "Outbox", "RecoveryPlan", "RetryConfig", "Signer",
    "TrackerConfig", "Transport", "apply", "assess", "decision_message", "incident_message", "load_secret",
    "new_secret", "parse_message", "plan_recovery", "serve", "supervise", "write_secret",
]
