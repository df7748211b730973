"""Every rank of the current attempt classified from its records (`RankState`), and the fail-stop and hang incidents
that follow (`classify`; the rules are in the package docstring)."""

from __future__ import annotations

import hashlib
import signal
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.liveness.records import ExitRecord, OpenCollective, RankRecord
from rankwatch.analytics.transport import is_reaction, partitioned, peers_named
from rankwatch.base.schema import LiveState


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """How long a reader has seen a rank's record, and its progress (last completed step), unchanged, on the reader's
    own clock (ns): the younger of these and the writer-clock ages counts, so a writer whose clock runs behind never
    looks dead or stuck."""

    record_ns: int
    progress_ns: int


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
    outside_signal: int | None = None
    """Dead ranks: the first signal that reached it from outside before it ended, and when
    (`ExitRecord.outside_signal`: the launcher's SIGTERM to its process group), where the launcher's side tells."""
    outside_signal_wall_ns: int | None = None
    exc_type: str | None = None
    message: str | None = None
    stuck_at_end: bool = False
    """Dead ranks: it had made no progress for longer than allowed when last heard from (it was waiting)."""
    reacting: bool = False
    """Dead ranks: its exception came from a collective, names a peer, or is a survivor's text for a peer gone
    (`analytics.transport.is_reaction`: NCCL's, c10d's, gloo's): it died of another rank's failure."""
    detectable_wall_ns: int | None = None
    """When its present state could first be told (exit seen, silent or idle past the threshold)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LivenessView:
    """Every rank of the current attempt at one poll, and the incidents they make. `new`, `resolved` and `withdrawn`
    (set by `LivenessMonitor.poll`) are the incidents first seen at this poll, those seen at the previous poll but no
    longer, and those of the latter that were wrong."""

    now_ns: int
    attempt: int | None
    world_size: int
    ranks: tuple[RankLiveness, ...]
    incidents: tuple[Incident, ...]
    warnings: tuple[str, ...] = ()
    new: tuple[Incident, ...] = ()
    resolved: tuple[Incident, ...] = ()
    withdrawn: tuple[Incident, ...] = ()
    """Of `resolved`, the fail-stops of the attempt still current. A rank that stopped does not come back within an
    attempt, so such an incident leaving the view means a later reading contradicted it (a rank named on its
    SIGTERM, then found silent before it was a peer's; a frozen rank that beat again): it is retracted, not
    resolved, and nothing should act on it."""

    def rank(self, rank: int) -> RankLiveness | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    def in_state(self, *states: RankState) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks if r.state in states)

    @property
    def finished(self) -> bool:
        """Every rank of the attempt finished cleanly."""
        return bool(self.ranks) and all(r.state is RankState.FINISHED for r in self.ranks)

    def contradicts(self, incident: Incident) -> str | None:
        """Why this poll contradicts a fail-stop or hang read from the part files (None: it does not). The part
        files of a live run lag each rank's own flush (seconds; more on a loaded host, and not alike on every rank), so
        a rank whose rows stopped arriving may still be beating: the liveness record, rewritten twice per heartbeat
        from a thread of its own, is the fresher word on whether it is alive. Contradicted: an incident about an
        attempt this poll's attempt replaced, or one whose ranks are all RUNNING (beating and completing steps within
        their allowance) or FINISHED (its collector closing or closed with code 0: at a run's end the ranks that closed
        first flushed their last rows at once, while one still closing is only as fresh as its last periodic flush)
        here, or a fail-stop read as "vanished" (rows stopped with no exit, signal or exception event) whose ranks all
        still beat (PENDING, RUNNING or STUCK: a rank waiting on a hung peer did not vanish). Other classes are never
        contradicted: liveness says nothing of speed or values."""
        if incident.klass not in (IncidentClass.FAIL_STOP, IncidentClass.HANG) or self.attempt is None:
            return None
        if incident.attempt is not None and incident.attempt < self.attempt:
            return f"it is about attempt {incident.attempt}, which attempt {self.attempt} replaced"
        if incident.attempt is not None and incident.attempt > self.attempt:
            return None
        views = [self.rank(r) for r in incident.ranks]
        fine = (RankState.RUNNING, RankState.FINISHED)
        if incident.ranks and all(v is not None and v.state in fine for v in views):
            states = sorted({str(v.state) for v in views if v is not None})
            who = f"rank {incident.ranks[0]} is" if len(incident.ranks) == 1 else f"ranks {list(incident.ranks)} are"
            return f"{who} {' or '.join(states)} in attempt {self.attempt} by their liveness records"
        if (incident.klass is IncidentClass.FAIL_STOP and incident.cause is Cause.VANISHED and incident.ranks
                and all(v is not None and v.state in _ALIVE for v in views)):
            # "vanished" means its rows stopped with no exit, signal or exception event: a rank whose liveness thread
            # still beats did not vanish (a rank waiting in a collective for a hung peer is STUCK, and its part file
            # lags its flush like any other); if it is the one at fault, the liveness hang names it
            who = f"rank {incident.ranks[0]} is" if len(incident.ranks) == 1 else f"ranks {list(incident.ranks)} are"
            return f"{who} still beating in attempt {self.attempt} by their liveness records: it did not vanish"
        return None

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
    """The peers `message` names (`analytics.transport.peers_named`, as `analytics.failstop` reads them)."""
    return peers_named(message, reporter=rank, world=world)


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
                                signal=ex.signal, outside_signal=ex.outside_signal,
                                outside_signal_wall_ns=ex.outside_signal_wall_ns,
                                last_seen_wall_ns=ex.wall_ns, detectable_wall_ns=ex.wall_ns,
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
            outside_signal=ex.outside_signal if ex is not None else None,
            outside_signal_wall_ns=ex.outside_signal_wall_ns if ex is not None else None,
            last_seen_wall_ns=last_seen, stuck_at_end=rec.wall_ns - rec.progress_wall_ns > allowed,
            reacting=rec.exc_type is not None and (rec.collective is not None or bool(_named(rec.message, r, world))
                                                   or is_reaction(rec.message)),
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
    stopped, told = _stopped(dead, world)
    culprits = [v for v in dead if not v.stuck_at_end and not v.reacting and v.rank not in stopped]
    if told and any(v.state in _ALIVE and v.last_seen_wall_ns is not None and v.last_seen_wall_ns < min(told.values())
                    for v in views):
        # a rank not heard from since the stop requests began may be the one whose end the launcher reacted to
        # (it signals only the workers still running): the requested ones wait until it writes again (a live rank
        # does within half a heartbeat) or is lost
        culprits = [v for v in culprits if v.rank not in told]
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


def _stopped(dead: list[RankLiveness], world: int) -> tuple[set[int], dict[int, int]]:
    """(the dead ranks that were stopped rather than failed, {rank: when asked} for those asked to stop that may have
    stopped first). torchrun's agent, once a worker has failed, signals the process group of every worker still running
    with SIGTERM, waits `--shutdown-timeout` (30 s) and SIGKILLs those left (`SubprocessContext._close` and
    `SubprocessHandler.close` under torch/distributed/elastic/multiprocessing/). A rank was asked to stop when its own
    SIGTERM handler recorded the signal, or the launcher's side saw an outside signal reach it
    (`ExitRecord.outside_signal`); one that ended with no word of its own after the first such request was stopped too
    (its handler never ran: its main thread sat in a C call until the SIGKILL). A request that came after another rank
    had failed (its exit, its silence, its own exception; or a survivor's reaction seen before any request, which shows
    a failure came first) is the launcher's reaction to that failure. A request no failure preceded is from outside the
    job (the scheduler, the operator): on more than half the ranks it is the job's stop and no rank's (the job's
    incident once every rank is dead; until then the ranks it did not reach, or that were gone before it, are still to
    be told); on fewer, each rank it reached stopped first as far as anyone can tell, and is named."""
    def end(v: RankLiveness) -> int:
        return v.last_seen_wall_ns if v.last_seen_wall_ns is not None else 0

    asked = {v.rank: (v.outside_signal_wall_ns if v.outside_signal_wall_ns is not None else end(v))
             for v in dead if v.outside_signal is not None or v.signal == signal.SIGTERM}
    if not asked:
        return set(), {}
    first_ask = min(asked.values())
    stopped = {v.rank for v in dead if v.rank not in asked and v.exc_type is None and end(v) >= first_ask}
    failures = [end(v) for v in dead if v.rank not in asked and v.rank not in stopped
                and (not v.reacting or end(v) < first_ask)]
    if failures:
        first = min(failures)
        stopped |= {r for r, t in asked.items() if t > first}
    told = {r: t for r, t in asked.items() if r not in stopped}
    if 2 * len(told) > world:
        stopped |= set(told)
        told = {}
    return stopped, told


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
    behind = _behind(stuck, views, world)
    if behind:
        ahead = sorted(v.rank for v in stuck if v.rank not in behind)
        return tuple(_hang(by_rank[m], views, ahead, config.fallback_confidence, attempt) for m in sorted(behind))
    if any(v.state is RankState.RUNNING for v in views):
        return ()  # a partial stall that is still spreading: judged once it settles
    return (_job_hang(stuck, views, attempt, config),)


def _behind(stuck: list[RankLiveness], views: tuple[RankLiveness, ...], world: int) -> set[int]:
    """Once every rank is stuck (or died stuck), fewer than half of them one or more completed steps behind all the
    others: their progress stopped first, and the others went on until they waited for them (on CUDA, at a sync
    point rather than inside a collective the record shows). As `analytics.failstop`'s position rule reads it."""
    if len(stuck) < len(views) or any(v.last_step is None for v in views):
        return set()
    lo = min(v.last_step for v in views if v.last_step is not None)
    low = {v.rank for v in views if v.last_step == lo}
    if len(low) == len(views) or 2 * len(low) >= world:
        return set()
    return low


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
