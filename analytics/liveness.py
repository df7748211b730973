"""Liveness in seconds: every rank of the current attempt classified from ``<run>/live/``, and the fail-stop and hang
incidents that follow, without waiting for part files.

Two channels feed it (docs/liveness.md): each rank's collector rewrites ``rank-<r>.live`` within
`CollectorConfig.liveness_poll_s` of every completed step and at least twice per heartbeat interval, from a thread that
runs while training is stuck (`collector.liveness`); the launcher's side of each host writes ``exit-<r>.json`` the
moment a rank's process ends. Records carry the rank's attempt; those of an earlier attempt say nothing of the current
one (a relaunch starts a new attempt, and its ranks are PENDING until they write).

A rank is (`RankState`):

- RUNNING: beating and completing steps (or starting: no step yet, within `startup_grace_s`);
- STUCK: beating, but no step completed for more than `stuck_heartbeats` heartbeats and `stuck_step_factor` recent
  step durations (a checkpoint phase gets `checkpoint_grace_s`); the record says where: the collective (group,
  sequence number) or the phase;
- STOPPED: its process ended abnormally (exit record: exit code or signal), or its collector closed with a non-zero
  code (an exception, SIGTERM);
- LOST: no record change for more than `lost_heartbeats` heartbeats and no exit record: the host is gone or the process
  is frozen (SIGSTOP stops its liveness thread too);
- FINISHED: its collector closed with code 0, or (no collector record) its process exited 0;
- PENDING: no record of the current attempt yet.

Incidents (`classify`), in analytics' vocabulary (`analytics.incidents`):

0. A dead rank whose own connections failed locally while other dead ranks' failed because their peer went
   (`analytics.transport.partitioned`: a partition of that rank) is a FAIL_STOP naming it, cause NETWORK — before
   the job-wide reading below, which every rank dying at once would otherwise give.
1. A STOPPED or LOST rank that was progressing when last heard from and did not die reacting (its exception came from
   a collective, named a peer, or said the peer went away: "Connection closed by peer"), nor of a signal more than
   `job_window_heartbeats` after the first such death (the stop that followed it: the launcher's or the manager's
   SIGTERM), is a FAIL_STOP naming it. Ranks that died after it while waiting for it, or of the
   error it caused, are survivors, not incidents. When every rank stopped within `job_window_heartbeats` of the first,
   none reacting, it is one FAIL_STOP of the job.
2. When every dead rank reacted, the rank their messages name (one that names no other) is the fail-stop: it is gone
   before its own exit is seen.
3. STUCK ranks (and dead ranks that were stuck when they died) with no fail-stop to wait on are a HANG: the ranks the
   others wait for in their collectives that wait in none themselves (the wait graph's roots), else a minority stuck
   outside any collective while no one waits in one, else the job's (every rank stuck; the summary names the
   collective).

Onset steps are counted as `analytics.failstop` counts them (the culprit's last completed step + 1; for the job, the
newest last step + 1). Ids are the same at every poll for the same fault (`_live_id`: class, subject, attempt, onset,
ranks, each fixed once the incident holds) and clearly distinct from the part-file detectors' (``<class>-live-...``):
the part-file reading of the same fault cannot be relied on to reach the same onset (the victim's last rows may be
lost with it, and failstop then takes the step its peers wait in; the liveness record says the last completed step up
to `liveness_poll_s` late), so equal ids would hold only by luck. `same_fault` says when a part-file incident is the
fault a liveness incident already named. Evidence and summaries say they come from liveness.

Clocks: ages compare the monitor's `time.time_ns()` with the writer's. On one machine there is no skew. Across hosts,
NTP keeps it to milliseconds against heartbeats of a second; `LivenessMonitor` also times each record's changes (and
its progress's) on its own clock and takes the younger age (`Seen`), so a writer whose clock runs behind never looks
dead or stuck (one whose clock runs ahead can make a stopped rank look alive longer, never a live one dead).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.transport import TransportSide, partitioned, transport_side
from rankwatch.collector.schema import (
    EXIT_RECORD_PREFIX,
    EXIT_RECORD_SUFFIX,
    LIVE_DIR,
    LIVE_HEADER_BYTES,
    LIVE_VERSION,
    RANK_RECORD_PREFIX,
    RANK_RECORD_SUFFIX,
    ExitField,
    LiveField,
    LiveState,
)

__all__ = [
    "ExitRecord", "LivenessConfig", "LivenessMonitor", "LivenessView", "OpenCollective", "RankLiveness", "RankRecord",
    "LIVE_ID_TAG", "RankState", "Seen", "classify", "decode_rank_record", "parse_exit_record", "same_fault",
]

_NAMED_RANK = re.compile(r"(?i)\brank\s*[=:#]?\s*(\d+)")
"""A rank named in an error message (gloo's "(rank 11)"); the same reading as `analytics.failstop`."""


class RankState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    STUCK = "stuck"
    STOPPED = "stopped"
    LOST = "lost"
    FINISHED = "finished"


_ALIVE = (RankState.PENDING, RankState.RUNNING, RankState.STUCK)
_DEAD = (RankState.STOPPED, RankState.LOST)


@dataclass(frozen=True, kw_only=True, slots=True)
class LivenessConfig:
    stuck_heartbeats: float = 2.0
    """A beating rank is STUCK after this many heartbeat intervals without completing a step (the issue's target is a
    hang seen within 3 intervals of its last progress; the record says a step completed within 0.05 s)."""
    stuck_step_factor: float = 5.0
    """... and this many median recent step durations (long steps are not stalls)."""
    startup_grace_s: float = 120.0
    """Before its first completed step a rank is STUCK only after this long since its collector started (rendezvous,
    model build, compilation); a rank of the attempt with no record this long after the attempt's first is LOST."""
    checkpoint_grace_s: float = 600.0
    """A rank inside a checkpoint phase is STUCK only after this long in it (saves take minutes on large jobs)."""
    lost_heartbeats: float = 2.0
    """A rank whose record has not changed for this many heartbeat intervals is LOST (it is rewritten at least twice
    per interval: 1.5 intervals of scheduling delay never make a live rank lost)."""
    job_window_heartbeats: float = 1.0
    """Every rank stopping within this many intervals of the first, none reacting to another, is one stop of the job."""
    stopped_confidence: float = 0.95
    """An exit record, or the rank's own collector, says it stopped, and it stopped first."""
    lost_confidence: float = 0.85
    """It fell silent first (a long freeze of a live process would read the same)."""
    named_confidence: float = 0.9
    """The survivors' errors name it; its own end is not seen yet."""
    hang_confidence: float = 0.9
    """The others wait for it in their collectives."""
    fallback_confidence: float = 0.7
    """Chosen by where it is stuck only, or the job's."""

    def __post_init__(self) -> None:
        for name in ("stuck_heartbeats", "stuck_step_factor", "lost_heartbeats", "job_window_heartbeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LivenessConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("startup_grace_s", "checkpoint_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LivenessConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("stopped_confidence", "lost_confidence", "named_confidence", "hang_confidence",
                     "fallback_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"LivenessConfig.{name} must be in [0, 1], got {getattr(self, name)}")


# -- records ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class OpenCollective:
    """The collective a rank is in (or, in an exiting record, the one its exception came from)."""

    op: str
    group: str
    seq: int | None
    peer: int | None = None
    wall_ns: int | None = None
    ranks: tuple[int, ...] | None = None
    """Its group's ranks (written once it has been open a while; None before)."""

    def __str__(self) -> str:
        peer = f" with rank {self.peer}" if self.peer is not None else ""
        return f"{self.op} on {self.group} (#{self.seq}){peer}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRecord:
    """One rank record as the collector wrote it (`schema.LiveField`)."""

    rank: int
    world_size: int
    attempt: int
    pid: int | None
    host: str
    state: LiveState
    seq: int
    wall_ns: int
    heartbeat_ns: int
    started_wall_ns: int
    last_step: int | None = None
    last_step_wall_ns: int | None = None
    step_ns: int | None = None
    step: int | None = None
    phase: str | None = None
    phase_start_wall_ns: int | None = None
    collective: OpenCollective | None = None
    exit_code: int | None = None
    signal: int | None = None
    exc_type: str | None = None
    message: str | None = None

    @property
    def progress_wall_ns(self) -> int:
        """The rank's last progress: its last completed step's end, or its collector's start before any."""
        return self.last_step_wall_ns if self.last_step_wall_ns is not None else self.started_wall_ns

    @property
    def closed(self) -> bool:
        return self.state is not LiveState.RUNNING


@dataclass(frozen=True, kw_only=True, slots=True)
class ExitRecord:
    """A rank process's end as its launcher saw it (`schema.ExitField`)."""

    rank: int
    world_size: int
    attempt: int
    pid: int | None
    host: str
    wall_ns: int
    exit_code: int | None
    signal: int | None


class _Torn(Exception):
    """A rank record read while being written (or otherwise not a whole frame)."""


def _field(d: Mapping[str, Any], key: str, kind: type, where: str, *, required: bool = False) -> Any:
    value = d.get(key)
    if type(value) is kind:  # the common case first: this runs ~20 times per record read
        return value
    if value is None:
        if required:
            raise RunDirError(f"{where}: liveness record without `{key}`")
        return None
    raise RunDirError(f"{where}: liveness record field `{key}` is {value!r}, not {kind.__name__}")


def _version(d: Mapping[str, Any], where: str) -> None:
    version = d.get(LiveField.VERSION)
    if version != LIVE_VERSION:
        raise SchemaVersionError(f"{where}: liveness record version {version!r}; this rankwatch reads {LIVE_VERSION}")


def decode_rank_record(data: bytes, where: str = "rank record") -> RankRecord:
    """Parse one rank-record frame (`schema.LIVE_HEADER_BYTES`). Raises `_Torn` for a frame whose length or CRC does
    not hold (a write in progress); `SchemaVersionError` / `RunDirError` for a whole record this rankwatch cannot
    read."""
    try:
        crc, n = int(data[:8], 16), int(data[9:15])
    except ValueError:
        raise _Torn(where) from None
    body = data[LIVE_HEADER_BYTES:LIVE_HEADER_BYTES + n]
    if len(body) != n or zlib.crc32(body) != crc:
        raise _Torn(where)
    try:
        d = json.loads(body)
    except ValueError:
        raise RunDirError(f"{where}: liveness record with a good CRC but not JSON") from None
    if not isinstance(d, dict):
        raise RunDirError(f"{where}: liveness record is not a JSON object")
    return _rank_record(d, where)


def _rank_record(d: Mapping[str, Any], where: str) -> RankRecord:
    _version(d, where)
    state = _field(d, LiveField.STATE, str, where, required=True)
    try:
        live_state = LiveState(state)
    except ValueError:
        raise RunDirError(f"{where}: liveness record state {state!r} is none of {[str(s) for s in LiveState]}") from None
    collective = None
    op = _field(d, LiveField.COLLECTIVE_OP, str, where)
    if op is not None:
        ranks = d.get(LiveField.COLLECTIVE_RANKS)
        collective = OpenCollective(
            op=op, group=str(_field(d, LiveField.COLLECTIVE_GROUP, str, where) or "?"),
            seq=_field(d, LiveField.COLLECTIVE_SEQ, int, where), peer=_field(d, LiveField.COLLECTIVE_PEER, int, where),
            wall_ns=_field(d, LiveField.COLLECTIVE_WALL_NS, int, where),
            ranks=tuple(int(r) for r in ranks) if isinstance(ranks, list) else None,
        )
    return RankRecord(
        rank=_field(d, LiveField.RANK, int, where, required=True),
        world_size=_field(d, LiveField.WORLD_SIZE, int, where, required=True),
        attempt=_field(d, LiveField.ATTEMPT, int, where, required=True),
        pid=_field(d, LiveField.PID, int, where),
        host=str(_field(d, LiveField.HOST, str, where) or ""),
        state=live_state,
        seq=_field(d, LiveField.SEQ, int, where, required=True),
        wall_ns=_field(d, LiveField.WALL_NS, int, where, required=True),
        heartbeat_ns=_field(d, LiveField.HEARTBEAT_NS, int, where, required=True),
        started_wall_ns=_field(d, LiveField.STARTED_WALL_NS, int, where, required=True),
        last_step=_field(d, LiveField.LAST_STEP, int, where),
        last_step_wall_ns=_field(d, LiveField.LAST_STEP_WALL_NS, int, where),
        step_ns=_field(d, LiveField.STEP_NS, int, where),
        step=_field(d, LiveField.STEP, int, where),
        phase=_field(d, LiveField.PHASE, str, where),
        phase_start_wall_ns=_field(d, LiveField.PHASE_START_WALL_NS, int, where),
        collective=collective,
        exit_code=_field(d, LiveField.EXIT_CODE, int, where),
        signal=_field(d, LiveField.SIGNAL, int, where),
        exc_type=_field(d, LiveField.EXC_TYPE, str, where),
        message=_field(d, LiveField.MESSAGE, str, where),
    )


def parse_exit_record(d: Mapping[str, Any], where: str = "exit record") -> ExitRecord:
    _version(d, where)
    return ExitRecord(
        rank=_field(d, ExitField.RANK, int, where, required=True),
        world_size=_field(d, ExitField.WORLD_SIZE, int, where, required=True),
        attempt=_field(d, ExitField.ATTEMPT, int, where, required=True),
        pid=_field(d, ExitField.PID, int, where),
        host=str(_field(d, ExitField.HOST, str, where) or ""),
        wall_ns=_field(d, ExitField.WALL_NS, int, where, required=True),
        exit_code=_field(d, ExitField.EXIT_CODE, int, where),
        signal=_field(d, ExitField.SIGNAL, int, where),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """How long a reader has seen a rank's record, and its progress (last completed step), unchanged, on the reader's
    own clock (ns): the younger of these and the writer-clock ages counts, so a writer whose clock runs behind never
    looks dead or stuck."""

    record_ns: int
    progress_ns: int


# -- results ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class RankLiveness:
    """One rank at one poll. `silent_ns`: since its record last changed (None: no record); `idle_ns`: since its last
    progress (a completed step, or its start); `last_seen_wall_ns`: its last sign of life (its record's last write,
    or its exit)."""

    rank: int
    state: RankState
    attempt: int
    why: str
    """One line: what it is doing or how it ended."""
    pid: int | None = None
    host: str = ""
    last_step: int | None = None
    step: int | None = None
    phase: str | None = None
    collective: OpenCollective | None = None
    silent_ns: int | None = None
    idle_ns: int | None = None
    allowed_ns: int | None = None
    """How long it may go without progress before it is STUCK."""
    last_seen_wall_ns: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    exc_type: str | None = None
    message: str | None = None
    stuck_at_end: bool = False
    """Dead ranks: it had made no progress for longer than allowed when last heard from (it was waiting)."""
    reacting: bool = False
    """Dead ranks: its exception came from a collective or names a peer (it died of another rank's failure)."""
    detectable_wall_ns: int | None = None
    """When its present state could first be told (exit seen, silent or idle past the threshold)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LivenessView:
    """Every rank of the current attempt at one poll, and the incidents they make. `new` and `resolved` (set by
    `LivenessMonitor.poll`) are the incidents first seen at this poll and those seen at the previous poll but no
    longer."""

    now_ns: int
    attempt: int | None
    world_size: int
    ranks: tuple[RankLiveness, ...]
    incidents: tuple[Incident, ...]
    warnings: tuple[str, ...] = ()
    new: tuple[Incident, ...] = ()
    resolved: tuple[Incident, ...] = ()

    def rank(self, rank: int) -> RankLiveness | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def in_state(self, *states: RankState) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.state in states)

    @property
    def finished(self) -> bool:
        """Every rank of the attempt finished cleanly."""
        return bool(self.ranks) and all(r.state is RankState.FINISHED for r in self.ranks)

    def line(self) -> str:
        """One line: the attempt and how many ranks are in each state."""
        if self.attempt is None:
            return "no liveness records yet"
        counts = Counter(r.state for r in self.ranks)
        parts = [f"{counts[s]} {s}" for s in RankState if counts[s]]
        return f"attempt {self.attempt}, {self.world_size} ranks: " + ", ".join(parts)

    def table(self) -> str:
        """One fixed-width line per rank: rank, state, host, pid, what it is doing or how it ended."""
        rows = [(str(r.rank), str(r.state), r.host or "-", str(r.pid) if r.pid is not None else "-", r.why)
                for r in self.ranks]
        head = ("rank", "state", "host", "pid", "")
        widths = [max(len(row[c]) for row in [head, *rows]) for c in range(4)]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(row[:4], widths)) + "  " + row[4]
                         for row in [head, *rows]).rstrip()


# -- classification -----------------------------------------------------------------------------------------------------

def _allowed_ns(rec: RankRecord, config: LivenessConfig) -> int:
    """How long `rec`'s rank may go without progress before it is STUCK."""
    hb = rec.heartbeat_ns
    if rec.phase_start_wall_ns is not None:  # inside a checkpoint phase
        return max(int(config.checkpoint_grace_s * 1e9), rec.phase_start_wall_ns - rec.progress_wall_ns
                   + int(config.stuck_heartbeats * hb))
    if rec.last_step is None:
        return int(max(config.startup_grace_s * 1e9, config.stuck_heartbeats * hb))
    return int(max(config.stuck_heartbeats * hb, config.stuck_step_factor * (rec.step_ns or 0)))


def _named(message: str | None, rank: int, world: int) -> set[int]:
    if not message:
        return set()
    return {int(m) for m in _NAMED_RANK.findall(message) if int(m) != rank and int(m) < world}


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _how_ended(rec: RankRecord | None, ex: ExitRecord | None) -> str:
    parts = []
    if rec is not None and rec.exc_type:
        parts.append(f"raised {rec.exc_type}" + (f": {rec.message.splitlines()[0][:120]}" if rec.message else ""))
    if ex is not None and ex.signal is not None:
        parts.append(f"killed by {_signal_name(ex.signal)}")
    elif rec is not None and rec.signal is not None:
        parts.append(f"stopped on {_signal_name(rec.signal)}")
    code = ex.exit_code if ex is not None and ex.exit_code is not None else (rec.exit_code if rec is not None else None)
    if code is not None and not parts:
        parts.append(f"exited with code {code}")
    if rec is not None and rec.state is LiveState.RUNNING and ex is not None:
        parts.append("without closing its collector")
    return ", ".join(parts) or "ended"


def _rank_view(r: int, attempt: int, rec: RankRecord | None, ex: ExitRecord | None, now: int, first_start: int | None,
               seen: Seen | None, world: int, config: LivenessConfig) -> RankLiveness:
    if rec is None:
        if ex is not None:
            state = RankState.FINISHED if ex.exit_code == 0 else RankState.STOPPED
            return RankLiveness(rank=r, state=state, attempt=attempt, pid=ex.pid, host=ex.host, exit_code=ex.exit_code,
                                signal=ex.signal, last_seen_wall_ns=ex.wall_ns, detectable_wall_ns=ex.wall_ns,
                                why=f"{state}: {_how_ended(None, ex)} (no liveness record)")
        grace = int(config.startup_grace_s * 1e9)
        if first_start is not None and now - first_start > grace:
            return RankLiveness(rank=r, state=RankState.LOST, attempt=attempt, detectable_wall_ns=first_start + grace,
                                why=f"lost: no liveness record {config.startup_grace_s:g} s into the attempt")
        return RankLiveness(rank=r, state=RankState.PENDING, attempt=attempt, why="pending: no record of this attempt yet")
    hb = rec.heartbeat_ns
    silent = now - rec.wall_ns
    idle = now - rec.progress_wall_ns
    if seen is not None:
        silent, idle = min(silent, seen.record_ns), min(idle, seen.progress_ns)
    silent, idle = max(0, silent), max(0, idle)
    allowed = _allowed_ns(rec, config)
    lost_ns = int(config.lost_heartbeats * hb)
    common: dict[str, Any] = dict(
        rank=r, attempt=attempt, pid=rec.pid, host=rec.host, last_step=rec.last_step, step=rec.step, phase=rec.phase,
        collective=rec.collective, silent_ns=silent, idle_ns=idle, allowed_ns=allowed, exc_type=rec.exc_type,
        message=rec.message,
    )
    exit_code = ex.exit_code if ex is not None and ex.exit_code is not None else rec.exit_code
    sig = ex.signal if ex is not None and ex.signal is not None else rec.signal
    # the collector's own word on a clean end wins (a launcher may kill a rank that already closed); a close without a
    # code (at interpreter exit) is clean unless the process then ended otherwise
    clean = rec.exit_code == 0 or rec.exit_code is None and (ex is None or ex.exit_code == 0)
    if rec.closed and clean:
        return RankLiveness(state=RankState.FINISHED, why=f"finished after step {rec.last_step}", exit_code=0,
                            last_seen_wall_ns=ex.wall_ns if ex is not None else rec.wall_ns, **common)
    if rec.closed or ex is not None:
        # last sign of life: its closing record, else its exit, unless it fell silent long before that (frozen)
        last_seen = rec.wall_ns
        if not rec.closed and ex is not None and ex.wall_ns - rec.wall_ns <= lost_ns:
            last_seen = ex.wall_ns
        told = [t for t in (rec.wall_ns if rec.closed else None, ex.wall_ns if ex is not None else None) if t is not None]
        return RankLiveness(
            state=RankState.STOPPED, why=f"stopped: {_how_ended(rec, ex)}", exit_code=exit_code, signal=sig,
            last_seen_wall_ns=last_seen, stuck_at_end=rec.wall_ns - rec.progress_wall_ns > allowed,
            reacting=rec.exc_type is not None and (rec.collective is not None or bool(_named(rec.message, r, world))
                                                   or transport_side(rec.message) is TransportSide.REMOTE),
            detectable_wall_ns=min(told), **common)
    if silent > lost_ns:
        return RankLiveness(state=RankState.LOST, last_seen_wall_ns=rec.wall_ns,
                            stuck_at_end=rec.wall_ns - rec.progress_wall_ns > allowed,
                            detectable_wall_ns=now - silent + lost_ns,
                            why=f"lost: no sign of life for {silent / 1e9:.1f} s ({silent / hb:.1f} heartbeats), "
                                "no exit record", **common)
    where = (f"in {rec.collective}" if rec.collective is not None
             else f"in phase {rec.phase}" if rec.phase else "outside any collective")
    if idle > allowed:
        what = f"step {rec.step}" if rec.step is not None else f"after step {rec.last_step}"
        return RankLiveness(state=RankState.STUCK, last_seen_wall_ns=rec.wall_ns,
                            detectable_wall_ns=now - idle + allowed,
                            why=f"stuck {idle / 1e9:.1f} s ({idle / hb:.1f} heartbeats) {what}, {where}", **common)
    doing = (f"step {rec.step}" if rec.step is not None else
             f"after step {rec.last_step}" if rec.last_step is not None else "starting")
    return RankLiveness(state=RankState.RUNNING, last_seen_wall_ns=rec.wall_ns,
                        why=f"running: {doing} (last completed {rec.last_step})", **common)


def classify(records: Iterable[RankRecord], exits: Iterable[ExitRecord], now_ns: int,
             config: LivenessConfig = LivenessConfig(), *, seen: Mapping[int, Seen] | None = None,
             warnings: tuple[str, ...] = ()) -> LivenessView:
    """Every rank of the newest attempt found in `records` and `exits`, and their incidents, at `now_ns` (wall clock).
    `seen`: per rank, how long the caller has seen its record and its progress unchanged on its own clock (`Seen`).
    Pure: no I/O, no clock."""
    rank_records, exit_records = list(records), list(exits)
    attempts = [x.attempt for x in rank_records] + [x.attempt for x in exit_records]
    if not attempts:
        return LivenessView(now_ns=now_ns, attempt=None, world_size=0, ranks=(), incidents=(), warnings=warnings)
    attempt = max(attempts)
    recs = {x.rank: x for x in rank_records if x.attempt == attempt}
    exs = {x.rank: x for x in exit_records if x.attempt == attempt}
    world = max([x.world_size for x in recs.values()] + [x.world_size for x in exs.values()]
                + [r + 1 for r in (*recs, *exs)])
    first_start = min((x.started_wall_ns for x in recs.values()), default=None)
    views = tuple(
        _rank_view(r, attempt, recs.get(r), exs.get(r), now_ns, first_start,
                   None if seen is None else seen.get(r), world, config)
        for r in range(world)
    )
    hb = sorted(x.heartbeat_ns for x in recs.values())[len(recs) // 2] if recs else 1_000_000_000
    incidents = _incidents(views, attempt, world, hb, config)
    return LivenessView(now_ns=now_ns, attempt=attempt, world_size=world, ranks=views, incidents=incidents,
                        warnings=warnings)


def _incidents(views: tuple[RankLiveness, ...], attempt: int, world: int, hb: int,
               config: LivenessConfig) -> tuple[Incident, ...]:
    by_rank = {v.rank: v for v in views}
    dead = [v for v in views if v.state in _DEAD]
    cut = partitioned({v.rank: [v.message] for v in dead})
    if cut:
        return tuple(_failstop(by_rank[r], views, "its own connections failed, its peers saw it go", config,
                               network=True) for r in sorted(cut))
    culprits = [v for v in dead if not v.stuck_at_end and not v.reacting]
    window = int(config.job_window_heartbeats * hb)
    first = min((v.last_seen_wall_ns for v in culprits if v.last_seen_wall_ns is not None), default=None)
    if first is not None:  # a signal well after the first death is the stop that followed it (launcher, manager)
        culprits = [v for v in culprits if v.signal is None or v.last_seen_wall_ns is None
                    or v.last_seen_wall_ns <= first + window]
    if culprits:
        seen = [v.last_seen_wall_ns for v in culprits if v.last_seen_wall_ns is not None]
        if len(culprits) == world and len(seen) == world and max(seen) - min(seen) <= window:
            return (_job_failstop(views, attempt, config),)
        return tuple(_failstop(v, views, "it stopped first", config) for v in culprits)
    if dead:
        named = _named_roots(dead, by_rank, world)
        if named:
            return tuple(_failstop(by_rank[r], views, "named by the survivors' errors", config, named=True)
                         for r in sorted(named))
    stuck = [v for v in views if v.state is RankState.STUCK or (v.state in _DEAD and v.stuck_at_end)]
    if stuck:
        found = _hangs(stuck, by_rank, views, attempt, world, config)
        if found:
            return found
    if dead and not any(v.state in _ALIVE for v in views):
        return (_job_failstop(views, attempt, config),)
    return ()


def _named_roots(dead: list[RankLiveness], by_rank: dict[int, RankLiveness], world: int) -> set[int]:
    """Ranks the dead ranks' messages name, that name no other such rank, and are not alive-but-stuck or finished."""
    edges = {v.rank: _named(v.message, v.rank, world) for v in dead}
    named = set().union(*edges.values()) if edges else set()
    roots = {m for m in named if not (edges.get(m, set()) & named)}
    return {m for m in roots if by_rank[m].state not in (RankState.STUCK, RankState.FINISHED)}


def _hangs(stuck: list[RankLiveness], by_rank: dict[int, RankLiveness], views: tuple[RankLiveness, ...],
           attempt: int, world: int, config: LivenessConfig) -> tuple[Incident, ...]:
    waiting = {v.rank: v for v in stuck if v.collective is not None}
    free = [v for v in stuck if v.collective is None]
    awaited: dict[int, set[int]] = {}
    for r, v in waiting.items():
        c = v.collective
        assert c is not None
        members = (c.peer,) if c.peer is not None else (c.ranks or ())
        for m in members:
            if m == r or m not in by_rank:
                continue
            mc = by_rank[m].collective
            if mc is not None and mc.group == c.group and mc.seq is not None and c.seq is not None and mc.seq >= c.seq:
                continue  # in it too, or past it
            awaited.setdefault(m, set()).add(r)
    roots = sorted(set(awaited) - set(waiting))
    if roots:
        return tuple(_hang(by_rank[m], views, sorted(awaited[m]), config.hang_confidence, attempt) for m in roots)
    if free and (waiting and not awaited or not waiting and 2 * len(free) < world):
        return tuple(_hang(v, views, [], config.fallback_confidence, attempt) for v in free)
    if any(v.state is RankState.RUNNING for v in views):
        return ()  # a partial stall that is still spreading: judged once it settles
    return (_job_hang(stuck, views, attempt, config),)


# -- incidents ----------------------------------------------------------------------------------------------------------

LIVE_ID_TAG = "live"
"""Liveness incident ids read ``<class>-live-<10 hex>``: never equal to a part-file detector's (`Incident.id`)."""


def _live_id(klass: IncidentClass, subject: Subject, attempt: int, onset: int | None, ranks: tuple[int, ...]) -> str:
    """Stable across polls: every input is fixed once the incident holds (a dead rank's record no longer changes; a
    stuck rank's last step does not; a job-wide incident waits until no rank is running)."""
    key = f"{klass}|{subject}|{attempt}|{onset}|{','.join(map(str, ranks))}"
    return f"{klass}-{LIVE_ID_TAG}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def same_fault(live: Incident, other: Incident, *, steps: int = 2) -> bool:
    """Whether `other` (a part-file detector's incident, `analytics.failstop`) is the fault the liveness incident
    `live` names, so a monitor reports it once: both fail-stop or hang (a frozen rank may read as either), the same
    subject and, where both say, the same attempt (a rank fails-stop once per attempt); two hangs also need onsets at
    most `steps` apart (a rank may stall more than once). Onsets of fail-stops are not compared: the part files may
    have lost the victim's last rows (failstop then takes the step its peers wait in), and the liveness record says
    the last completed step up to one step late."""
    family = (IncidentClass.FAIL_STOP, IncidentClass.HANG)
    if live.klass not in family or other.klass not in family or live.subject != other.subject:
        return False
    if live.attempt is not None and other.attempt is not None and live.attempt != other.attempt:
        return False
    if live.klass is IncidentClass.HANG and other.klass is IncidentClass.HANG:
        return (live.onset_step is None or other.onset_step is None
                or abs(live.onset_step - other.onset_step) <= steps)
    return True


# -- incident builders -------------------------------------------------------------------------------------------------

_EVIDENCE_COLUMNS = ("rank", "state", "last_step", "step", "where", "exit_code", "signal", "exc_type",
                     "last_seen_wall_ns")


def _evidence(views: tuple[RankLiveness, ...], first: Iterable[int], summary: str) -> Evidence:
    head = list(first)
    order = sorted(views, key=lambda v: (v.rank not in head, head.index(v.rank) if v.rank in head else 0, v.rank))
    rows = tuple(
        (v.rank, str(v.state), v.last_step, v.step,
         str(v.collective) if v.collective is not None else (v.phase or ""), v.exit_code, v.signal, v.exc_type,
         v.last_seen_wall_ns)
        for v in order
    )
    return Evidence(source="liveness", summary=summary, columns=_EVIDENCE_COLUMNS, rows=rows)


def _onset(v: RankLiveness) -> int | None:
    """The step it failed in, as `analytics.failstop` counts it: its last completed step + 1 (0 before any); None
    without a record of it."""
    if v.silent_ns is None:
        return None
    return (v.last_step if v.last_step is not None else -1) + 1


def _failstop(v: RankLiveness, views: tuple[RankLiveness, ...], method: str, config: LivenessConfig, *,
              named: bool = False, network: bool = False) -> Incident:
    onset = _onset(v)
    if network:
        cause = Cause.NETWORK
    elif v.exc_type is not None:
        cause = Cause.EXCEPTION
    elif v.signal is not None:
        cause = Cause.SIGNAL
    elif v.state is RankState.STOPPED:
        cause = Cause.EXIT
    else:
        cause = Cause.VANISHED
    after = [o.rank for o in views if o.rank != v.rank and (o.state is RankState.STUCK or o.state in _DEAD)]
    how = (f"its peers' errors name it ({v.why})" if named else
           f"its own end of the network failed ({v.why})" if network else v.why.split(": ", 1)[-1])
    step = f"in step {onset} (last completed step {v.last_step})" if onset is not None else "before its first record"
    summary = (f"rank {v.rank} stopped {step}: {how}; {len(after)} peer(s) stuck or gone after it "
               f"(liveness: {method})")
    confidence = (config.named_confidence if named or network else
                  config.stopped_confidence if v.state is RankState.STOPPED else config.lost_confidence)
    subject = Subject(kind=SubjectKind.RANK, id=str(v.rank))
    return Incident(
        id=_live_id(IncidentClass.FAIL_STOP, subject, v.attempt, onset, (v.rank,)),
        klass=IncidentClass.FAIL_STOP, subject=subject, ranks=(v.rank,),
        onset_step=onset, detection_step=onset, confidence=confidence, cause=cause, summary=summary,
        detection_wall_ns=v.detectable_wall_ns, fields=(str(cause),), attempt=v.attempt,
        evidence=(_evidence(views, [v.rank, *after], "each rank's liveness at detection (the culprit first)"),),
    )


def _job_failstop(views: tuple[RankLiveness, ...], attempt: int, config: LivenessConfig) -> Incident:
    last = [v.last_step for v in views if v.last_step is not None]
    onset = max(last) + 1 if last else None
    causes = Counter(Cause.EXCEPTION if v.exc_type else Cause.SIGNAL if v.signal is not None else
                     Cause.EXIT if v.state is RankState.STOPPED else Cause.VANISHED for v in views if v.state in _DEAD)
    cause = causes.most_common(1)[0][0] if causes else Cause.UNKNOWN
    seen = [v.last_seen_wall_ns for v in views if v.last_seen_wall_ns is not None]
    span = (max(seen) - min(seen)) / 1e6 if seen else 0.0
    summary = (f"the job stopped in step {onset} on all {len(views)} ranks within {span:.0f} ms, none failing first "
               f"({dict((str(k), n) for k, n in causes.items())}) (liveness)")
    detect = [v.detectable_wall_ns for v in views if v.detectable_wall_ns is not None]
    ranks = tuple(v.rank for v in views)
    subject = Subject(kind=SubjectKind.JOB, id="job")
    return Incident(
        id=_live_id(IncidentClass.FAIL_STOP, subject, attempt, onset, ranks),
        klass=IncidentClass.FAIL_STOP, subject=subject, ranks=ranks, onset_step=onset, detection_step=onset,
        confidence=config.fallback_confidence, cause=cause, summary=summary,
        detection_wall_ns=max(detect) if detect else None, fields=(str(cause),), attempt=attempt,
        evidence=(_evidence(views, [], "each rank's liveness at detection"),),
    )


def _hang(v: RankLiveness, views: tuple[RankLiveness, ...], waiters: list[int], confidence: float,
          attempt: int) -> Incident:
    onset = _onset(v)
    cause = Cause.STUCK_IN_COLLECTIVE if v.collective is not None else Cause.STUCK_IN_STEP
    where = (f"in {v.collective}" if v.collective is not None
             else f"outside any collective, in phase {v.phase}" if v.phase else "outside any collective")
    allowed = f"{v.allowed_ns / 1e9:.1f} s" if v.allowed_ns is not None else "the allowed time"
    alive = "alive (beating)" if v.state is RankState.STUCK else f"then {v.state}"
    summary = (f"rank {v.rank} hangs in step {onset} (last completed step {v.last_step}): {alive}, no step completed "
               f"for more than {allowed}, stuck {where}; {len(waiters)} peer(s) wait for it in their collectives "
               f"(liveness)")
    subject = Subject(kind=SubjectKind.RANK, id=str(v.rank))
    return Incident(
        id=_live_id(IncidentClass.HANG, subject, attempt, onset, (v.rank,)),
        klass=IncidentClass.HANG, subject=subject, ranks=(v.rank,),
        onset_step=onset, detection_step=onset, confidence=confidence, cause=cause, summary=summary,
        detection_wall_ns=v.detectable_wall_ns, fields=(str(cause),), attempt=attempt,
        evidence=(_evidence(views, [v.rank, *waiters], "each rank's liveness at detection (the culprit, then those "
                                                       "waiting for it)"),),
    )


def _job_hang(stuck: list[RankLiveness], views: tuple[RankLiveness, ...], attempt: int,
              config: LivenessConfig) -> Incident:
    last = [v.last_step for v in views if v.last_step is not None]
    onset = max(last) + 1 if last else None
    places = Counter(str(v.collective) if v.collective is not None else f"phase {v.phase or '-'}" for v in stuck)
    where = ", ".join(f"{n} in {p}" for p, n in places.most_common(4))
    cause = Cause.STUCK_IN_COLLECTIVE if any(v.collective is not None for v in stuck) else Cause.STUCK_IN_STEP
    summary = (f"the job hangs in step {onset}: {len(stuck)} of {len(views)} ranks stuck with no one gone and no rank "
               f"the others wait for ({where}) (liveness)")
    detect = [v.detectable_wall_ns for v in stuck if v.detectable_wall_ns is not None]
    ranks = tuple(v.rank for v in views)
    subject = Subject(kind=SubjectKind.JOB, id="job")
    return Incident(
        id=_live_id(IncidentClass.HANG, subject, attempt, onset, ranks),
        klass=IncidentClass.HANG, subject=subject, ranks=ranks, onset_step=onset, detection_step=onset,
        confidence=config.fallback_confidence, cause=cause, summary=summary,
        detection_wall_ns=max(detect) if detect else None, fields=(str(cause),), attempt=attempt,
        evidence=(_evidence(views, [], "each rank's liveness at detection"),),
    )


# -- the monitor --------------------------------------------------------------------------------------------------------

class LivenessMonitor:
    """Reads ``<run>/live/`` at each `poll` and classifies. Keeps the last whole record of each rank: a record caught
    mid-write (its CRC does not hold twice in a row), or an exit record that does not parse, leaves the previous one in
    use and a warning, never a dead rank. Times each record's changes on its own clock (see the module docstring)."""

    def __init__(self, run_dir: Path | str, config: LivenessConfig = LivenessConfig()) -> None:
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"{self.run_dir}: not a run directory")
        self.config = config
        self._records: dict[int, RankRecord] = {}
        self._exits: dict[int, ExitRecord] = {}
        self._changed: dict[tuple[int, str], tuple[tuple[int | None, int, int | None], int]] = {}
        """(rank, what) -> ((pid, attempt, seq or last step), monitor time that value was first read)."""
        self._open: dict[str, Incident] = {}
        self._raw: dict[str, bytes] = {}
        """path -> the bytes last decoded from it (an unchanged file is not decoded again)."""
        self.polls = 0

    @property
    def live_dir(self) -> Path:
        return self.run_dir / LIVE_DIR

    def poll(self, now_ns: int | None = None) -> LivenessView:
        """Read the live folder and classify at `now_ns` (default: the wall clock now)."""
        warnings = self._read()
        now = time.time_ns() if now_ns is None else now_ns
        seen = {r: Seen(record_ns=self._since(r, "record", (rec.pid, rec.attempt, rec.seq), now),
                        progress_ns=self._since(r, "progress", (rec.pid, rec.attempt, rec.last_step), now))
                for r, rec in self._records.items()}
        if self.polls == 0 and not self.live_dir.is_dir():
            warnings.append(f"{self.live_dir}: no liveness records yet (the run has not started, or its collectors "
                            "write none: CollectorConfig.liveness)")
        self.polls += 1
        view = classify(self._records.values(), self._exits.values(), now, self.config, seen=seen,
                        warnings=tuple(warnings))
        current = {i.id: i for i in view.incidents}
        new = tuple(i for k, i in current.items() if k not in self._open)
        resolved = tuple(i for k, i in self._open.items() if k not in current)
        self._open.update({i.id: i for i in new})
        for i in resolved:
            del self._open[i.id]
        return replace(view, new=new, resolved=resolved)

    def _since(self, rank: int, what: str, value: tuple[int | None, int, int | None], now: int) -> int:
        key = (rank, what)
        prev = self._changed.get(key)
        if prev is None or prev[0] != value:
            self._changed[key] = prev = (value, now)
        return now - prev[1]

    def _read(self) -> list[str]:
        warnings: list[str] = []
        try:
            entries = list(os.scandir(self.live_dir))
        except FileNotFoundError:
            return warnings
        except OSError as exc:
            raise RunDirError(f"{self.live_dir}: cannot list the liveness folder ({exc})") from None
        for entry in entries:
            name = entry.name
            if name.startswith(RANK_RECORD_PREFIX) and name.endswith(RANK_RECORD_SUFFIX):
                rank = _rank_of(name, RANK_RECORD_PREFIX, RANK_RECORD_SUFFIX)
                if rank is not None:
                    rec = self._read_rank(entry.path, warnings)
                    if rec is not None:
                        self._records[rank] = rec
            elif name.startswith(EXIT_RECORD_PREFIX) and name.endswith(EXIT_RECORD_SUFFIX):
                rank = _rank_of(name, EXIT_RECORD_PREFIX, EXIT_RECORD_SUFFIX)
                if rank is not None:
                    ex = self._read_exit(entry.path, warnings)
                    if ex is not None:
                        self._exits[rank] = ex
        return warnings

    def _bytes(self, path: str, warnings: list[str]) -> bytes | None:
        """The file's bytes, or None when they are what this monitor read last time (nothing to decode), or when the
        file is gone, empty (created, not yet written) or unreadable (a warning)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None  # replaced or removed between listing and reading: keep the one held
        except OSError as exc:
            warnings.append(f"{path}: unreadable ({exc}); the previous record is kept")
            return None
        if not data or self._raw.get(path) == data:
            return None
        return data

    def _read_rank(self, path: str, warnings: list[str]) -> RankRecord | None:
        for _ in range(2):
            data = self._bytes(path, warnings)
            if data is None:
                return None
            try:
                rec = decode_rank_record(data, path)
            except _Torn:
                continue
            self._raw[path] = data
            return rec
        warnings.append(f"{path}: caught mid-write twice (length or CRC does not hold); the previous record is kept")
        return None

    def _read_exit(self, path: str, warnings: list[str]) -> ExitRecord | None:
        data = self._bytes(path, warnings)
        if data is None:
            return None
        try:
            d = json.loads(data)
        except ValueError as exc:
            warnings.append(f"{path}: not a whole exit record ({type(exc).__name__}); left out for now")
            return None
        if not isinstance(d, dict):
            raise RunDirError(f"{path}: exit record is not a JSON object")
        ex = parse_exit_record(d, path)
        self._raw[path] = data
        return ex


def _rank_of(name: str, prefix: str, suffix: str) -> int | None:
    middle = name[len(prefix):-len(suffix)]
    return int(middle) if middle.isdigit() else None
