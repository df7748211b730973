"""The recovery manager service's durable state: `<run>/manager/state.sqlite`, one table per concern.

    messages       every accepted webhook id with its body's SHA-256, its state (accepted -> started -> done |
                   failed | interrupted; incident messages: recorded), the outcome and the recovery id
    incidents      the latest status of each incident the service was told of
    alertmanager   the Alertmanager deliveries seen (deduplicated), recorded as evidence only

At most once: an id is committed before anything is done about it, and a decision is marked started (committed)
before its action begins; on a restart, accepted decisions are queued again and started ones marked interrupted.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import private_file
from rankwatch.control.wire import AlertMessage, MessageType


class MessageState(StrEnum):
    ACCEPTED = "accepted"
    STARTED = "started"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    RECORDED = "recorded"
    """An incident message: recorded, never acted on."""


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


class Ledger:
    """<run>/manager/state.sqlite, one table per concern: messages (every accepted webhook id, its body hash, and
    for decisions the action's progress and the recovery id), incidents (open or resolved, from incident messages),
    alertmanager (deduplicated deliveries). Every write is committed before the caller acts on it."""

    def __init__(self, path: Path) -> None:
        self.path = private_file(path)
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
                state = MessageState.ACCEPTED if m.type is MessageType.DECISION else MessageState.RECORDED
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

    def mark(self, msg_id: str, state: MessageState, *, outcome: str | None = None, recovery_id: str | None = None) -> None:
        with self._lock:
            self._con.execute("UPDATE messages SET state = ?, outcome = coalesce(?, outcome), "
                              "recovery_id = coalesce(?, recovery_id), updated_ns = ? WHERE id = ?",
                              (str(state), outcome, recovery_id, time.time_ns(), msg_id))

    def recover(self) -> tuple[list[tuple[str, bytes]], list[str]]:
        """At start: (decisions accepted but never started, to queue again in order; ids marked interrupted)."""
        with self._lock:
            started = [r[0] for r in self._con.execute("SELECT id FROM messages WHERE state = ?", (MessageState.STARTED,))]
            self._con.execute("UPDATE messages SET state = ?, outcome = ?, updated_ns = ? WHERE state = ?",
                              (str(MessageState.INTERRUPTED), "the service stopped while this action ran; not re-run: read "
                               "<run>/recovery and the lineage, then `rankwatch recover`", time.time_ns(),
                               str(MessageState.STARTED)))
            queued = [(r[0], r[1]) for r in self._con.execute(
                "SELECT id, body FROM messages WHERE state = ? ORDER BY received_ns", (MessageState.ACCEPTED,))]
        return queued, started

    def admit_alertmanager(self, key: str, group_key: str, status: str, alerts: int) -> bool:
        with self._lock:
            cur = self._con.execute("INSERT OR IGNORE INTO alertmanager VALUES (?, ?, ?, ?, ?)",
                                    (key, group_key, status, alerts, time.time_ns()))
            return cur.rowcount == 1

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision message, oldest first, with its state, outcome and recovery id."""
        cols = ("id", "decision_id", "incident", "action", "state", "outcome", "recovery_id", "received_ns")
        with self._lock:
            return [dict(zip(cols, r)) for r in self._con.execute(
                f"SELECT {', '.join(cols)} FROM messages WHERE type = 'decision' ORDER BY received_ns")]

    def summary(self, *, latest: int = 20) -> dict[str, Any]:
        """What /status shows, bounded whatever the history: the open incidents (how many, the `latest` newest),
        the decisions (how many in each state, the newest) and the Alertmanager deliveries (how many, the newest)."""
        with self._lock:
            open_count = self._con.execute("SELECT count(*) FROM incidents WHERE status = 'firing'").fetchone()[0]
            incidents = [dict(zip(("id", "class", "subject", "summary", "updated_ns"), r)) for r in self._con.execute(
                "SELECT id, class, subject, summary, updated_ns FROM incidents WHERE status = 'firing' "
                "ORDER BY updated_ns DESC LIMIT ?", (latest,))]
            states = dict(self._con.execute(
                "SELECT state, count(*) FROM messages WHERE type = 'decision' GROUP BY state ORDER BY state"))
            cols = ("id", "decision_id", "incident", "action", "state", "outcome", "recovery_id", "received_ns")
            last = self._con.execute(f"SELECT {', '.join(cols)} FROM messages WHERE type = 'decision' "
                                     "ORDER BY received_ns DESC LIMIT 1").fetchone()
            am = self._con.execute("SELECT count(*), max(received_ns) FROM alertmanager").fetchone()
            last_am = self._con.execute("SELECT group_key, status, alerts, received_ns FROM alertmanager "
                                        "ORDER BY received_ns DESC LIMIT 1").fetchone()
        return {
            "open_incidents": incidents,
            "open_incident_count": open_count,
            "decisions": states,
            "last_decision": None if last is None else dict(zip(cols, last)),
            "alertmanager": {"deliveries": am[0], "last": None if last_am is None else dict(zip(
                ("groupKey", "status", "alerts", "received_ns"), last_am))},
        }
