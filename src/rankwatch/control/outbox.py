"""The monitor's durable outbox (SQLite): a message is committed before any send; delivered in order per run; retried
with backoff while the receiver is down or answers 5xx/429.

Retry rules: no answer (refused, timed out, reset) and 5xx / 429 are retried, after `Retry-After` when the receiver
gives one (capped), otherwise after a full-jitter exponential backoff; any other non-2xx answer (4xx, 3xx) is final
(`rejected`, with the status and the first line of the body); a message past its maximum age or attempts is `dead`.
A run's next message waits until the one before it is delivered, rejected or dead. A message enqueued again (same
id) is stored once, so a restarted monitor that rebuilds its messages resends nothing that was delivered.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any


from rankwatch.base.rundir import RunDir, private_file
from rankwatch.control.wire import AlertConfigError, Message, MessageType

if TYPE_CHECKING:
    pass

log = logging.getLogger("rankwatch.alerts")

DETAIL_MAX = 200
"""Characters of a receiver's answer (its first line) kept with a rejected or retried message."""


def outbox_path(run_dir: Path | str) -> Path:
    """The default outbox of a run: `<run>/alerts/outbox.sqlite`."""
    return RunDir(Path(run_dir)).outbox


@dataclass(frozen=True, kw_only=True, slots=True)
class Reply:
    """What one attempt got: `status` None when no HTTP answer came (refused, timed out, reset)."""

    status: int | None
    detail: str = ""
    """The first line of the answer's body, or the network error."""
    retry_after_s: float | None = None


Send = Callable[[Message], Reply]


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
            private_file(self.path)
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
            reply = Reply(status=None, detail=f"{type(exc).__name__}: {exc}"[:DETAIL_MAX])
        attempts = head.attempts + 1
        status, detail = reply.status, reply.detail[:DETAIL_MAX]
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
