"""Fail-stop and hang: which rank stopped (or stopped progressing) first, and how.

What the telemetry shows when a rank goes (see trainer/canary.py and collector/collector.py):

- `os._exit` or SIGKILL: nothing at all from the victim; its steps and heartbeats just end. Peers block in their
  next collective with it, and after the process-group timeout write error rows and exception events naming the
  collective; the launcher then SIGTERMs the rest (signal + exit events).
- SIGTERM or an exception of its own: a signal / exception + exit event, BEFORE any peer's error.
- hang: the training thread blocks at a step start; heartbeats go on; peers block in their next collective with it.
- a launcher (or the operator) may kill everyone at once, so nobody writes anything: then only the peers' open
  collectives (entered, never left) tell who they were waiting for.

So survivors' exception and signal events are consequences, never evidence against them. The culprit is, in order
of the evidence used: the rank(s) whose own terminal event came first (before any consequence, and not as part of
a job-wide kill); else the root of the wait graph built from blocked collectives (a member of a blocked
operation's group that is not itself blocked anywhere, or one stuck in an operation its group has moved past);
else a rank silent for a long time while others were still heard; else the rank with the least progress.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.collector.schema import EventKind

_P2P_OPS = ("send", "recv", "isend", "irecv")
_TERMINAL = (str(EventKind.EXIT), str(EventKind.SIGNAL), str(EventKind.EXCEPTION))


@dataclass(frozen=True, kw_only=True, slots=True)
class FailStopConfig:
    stall_heartbeats: float = 5.0
    """A rank is stalled / silent after this many heartbeat intervals without progress / without a sign of life."""
    stall_step_factor: float = 5.0
    """... and at least this many median step durations (long steps are not stalls)."""
    simultaneous_fraction: float = 0.1
    """Terminal events of several ranks within this fraction of a heartbeat interval of the first are one cause
    (a host going down); when they cover more than half the ranks it is a job-wide kill and blames nobody."""
    event_confidence: float = 0.95
    """The culprit wrote its own terminal event before anyone else reacted."""
    graph_confidence: float = 0.9
    """The culprit is the root of the wait graph of blocked collectives."""
    fallback_confidence: float = 0.7
    """The culprit was chosen by silence or least progress only."""

    def __post_init__(self) -> None:
        if self.stall_heartbeats <= 0 or self.stall_step_factor <= 0:
            raise ValueError("FailStopConfig: stall_heartbeats and stall_step_factor must be > 0")
        if not 0 <= self.simultaneous_fraction < 1:
            raise ValueError(f"FailStopConfig.simultaneous_fraction must be in [0, 1), got {self.simultaneous_fraction}")
        for name in ("event_confidence", "graph_confidence", "fallback_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"FailStopConfig.{name} must be in [0, 1], got {getattr(self, name)}")


def detect_failstops(frames: Frames, config: FailStopConfig = FailStopConfig()) -> tuple[Incident, ...]:
    """FAIL_STOP and HANG incidents, one per culprit rank. Peers that blocked or errored waiting are not incidents;
    a run that finished cleanly, or is still progressing everywhere, gives none.

    `onset_step` = `detection_step` = the culprit's last completed step + 1 (a fail-stop is known as soon as peers
    block on it)."""
    live = frames.liveness
    if live.height == 0:
        return ()
    now = frames.end_wall_ns
    stall, block = _stall_ns(frames, config), _block_ns(frames, config)
    start = _attempt_start(frames)
    events = _latest_attempt_events(frames)
    blocked = _blocked(frames, start, now, block)
    terminal = events.filter(pl.col("kind").is_in(_TERMINAL))
    abnormal = terminal.filter(
        (pl.col("kind") != str(EventKind.EXIT)) | (pl.col("exit_code").fill_null(0) != 0)
    )

    exits = events.filter(pl.col("kind") == str(EventKind.EXIT))
    clean = exits.filter(pl.col("exit_code") == 0)["rank"].n_unique() >= live["rank"].n_unique() and abnormal.height == 0
    if clean:
        return ()
    quiet = blocked.height == 0 and abnormal.height == 0 and frames.collective_errors.height == 0
    if quiet and live["last_step"].n_unique() == 1:
        return ()  # every rank at the same last step with nothing open: a run that ended (or was stopped) cleanly
    progressing = live["last_step_end_wall_ns"].fill_null(0) >= now - stall
    if quiet and bool(progressing.all()):
        return ()  # a live window: everyone is still completing steps

    method, culprits = _by_events(frames, terminal, blocked, config)
    if not culprits:
        method, culprits = "wait graph", _by_wait_graph(blocked)
    if not culprits:
        method, culprits = "silence", _by_silence(live, now, stall)
    if not culprits:
        method, culprits = "least progress", _by_progress(live)
    confidence = {"events": config.event_confidence, "wait graph": config.graph_confidence}.get(
        method, config.fallback_confidence)
    return tuple(
        _incident(frames, r, method, confidence, events, blocked, stall, block) for r in sorted(culprits)
    )


# -- evidence ---------------------------------------------------------------------------------------------------------

def _stall_ns(frames: Frames, config: FailStopConfig) -> int:
    step = frames.steps["duration_ns"].median() if frames.steps.height else None
    step_ns = float(step) if step is not None else 0.0  # type: ignore[arg-type]
    return int(max(config.stall_heartbeats * frames.heartbeat_interval_ns, config.stall_step_factor * step_ns))


def _block_ns(frames: Frames, config: FailStopConfig) -> int:
    """How long a collective must have been open to count as blocked: a run killed soon after it stopped (before
    any timeout) still shows its waiters, while a live run's ordinary in-flight operations do not."""
    step = frames.steps["duration_ns"].median() if frames.steps.height else None
    step_ns = float(step) if step is not None else 0.0  # type: ignore[arg-type]
    return int(max(frames.heartbeat_interval_ns, config.stall_step_factor * step_ns))


def _attempt_start(frames: Frames) -> pl.DataFrame:
    """rank -> start wall time of its latest attempt (rows older than it belong to a previous incarnation)."""
    topo = frames.topology
    if topo.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "attempt_start": pl.Int64})
    return topo.group_by("rank").agg(pl.col("start_wall_ns").max().alias("attempt_start"))


def _latest_attempt_events(frames: Frames) -> pl.DataFrame:
    ev = frames.events
    latest = frames.liveness.select("rank", pl.col("attempt").alias("_latest"))
    return (
        ev.join(latest, on="rank", how="left")
        .filter(pl.col("_latest").is_null() | (pl.col("attempt") == pl.col("_latest")))
        .drop("_latest")
        .sort("wall_ns")
    )


def _blocked(frames: Frames, start: pl.DataFrame, now: int, block: int) -> pl.DataFrame:
    """Collectives a rank entered and did not complete normally in its latest attempt: open for longer than
    `block`, or ended in an error. One row per (rank, group, group_seq)."""
    cols = ["rank", "step", "op", "group", "group_ranks", "group_seq", "peer", "wall_ns", "state"]
    opened = frames.open_collectives.filter(pl.col("enter_wall_ns") < now - block).select(
        "rank", "step", "op", "group", "group_ranks", "group_seq", "peer", pl.col("enter_wall_ns").alias("wall_ns"),
        pl.lit("open").alias("state"),
    )
    errors = frames.collective_errors.select(
        "rank", "step", "op", "group", "group_ranks", "group_seq", pl.lit(None, dtype=pl.Int32).alias("peer"),
        pl.col("exit_wall_ns").alias("wall_ns"), pl.lit("error").alias("state"),
    )
    rows = pl.concat([opened.select(cols), errors.select(cols)])
    if start.height:
        rows = rows.join(start, on="rank", how="left").filter(
            pl.col("attempt_start").is_null() | (pl.col("wall_ns") >= pl.col("attempt_start"))
        ).drop("attempt_start")
    return rows.unique(["rank", "group", "group_seq"], keep="first", maintain_order=True)


# -- culprit rules ------------------------------------------------------------------------------------------------------

def _by_events(frames: Frames, terminal: pl.DataFrame, blocked: pl.DataFrame,
               config: FailStopConfig) -> tuple[str, set[int]]:
    """Ranks whose own terminal event is the first thing that happened: before any consequence (a collective error
    or an exception raised from a collective) and not part of a job-wide kill."""
    if terminal.height == 0:
        return "events", set()
    consequence = terminal.filter(
        (pl.col("kind") == str(EventKind.EXCEPTION)) & pl.col("collective_op").is_not_null()
    )["wall_ns"].min()
    first_error = frames.collective_errors["exit_wall_ns"].min()
    firsts = terminal.group_by("rank").agg(pl.col("wall_ns").min().alias("t")).sort("t")
    t0 = int(firsts["t"][0])
    window = int(config.simultaneous_fraction * frames.heartbeat_interval_ns)
    cluster = terminal.filter(pl.col("wall_ns") <= t0 + window)
    primary = cluster.filter(
        (pl.col("kind") != str(EventKind.EXCEPTION)) | pl.col("collective_op").is_null()
    )
    first_consequence = _earliest(consequence, first_error)
    if first_consequence is not None:
        primary = primary.filter(pl.col("wall_ns") <= first_consequence)
    ranks = set(int(r) for r in primary["rank"].unique())
    world = max(frames.world_size, frames.liveness.height)
    if not ranks or 2 * len(ranks) > world:
        return "events", set()
    waiting = set(int(r) for r in blocked.filter(pl.col("wall_ns") < t0)["rank"].unique())
    return "events", ranks - waiting


def _by_wait_graph(blocked: pl.DataFrame) -> set[int]:
    """Roots of the wait graph: members awaited by a blocked operation that are not blocked anywhere themselves,
    and members stuck in an operation every other blocked member of the group has moved past."""
    if blocked.height == 0:
        return set()
    waiting = set(int(r) for r in blocked["rank"].unique())
    is_p2p = pl.col("op").is_in(_P2P_OPS) | pl.col("peer").is_not_null()
    p2p = blocked.filter(is_p2p & pl.col("peer").is_not_null())
    awaited = set(int(r) for r in p2p["peer"].unique())
    coll = blocked.filter(~is_p2p)
    if coll.height:
        in_group = coll.select("group", "rank").unique()
        members = coll.select("group", pl.col("group_ranks").alias("rank")).explode("rank").unique()
        missing = members.join(in_group, on=["group", "rank"], how="anti")
        awaited |= set(int(r) for r in missing["rank"].unique())
    roots = awaited - waiting
    if coll.height:
        spans = coll.group_by("group", "rank").agg(pl.col("group_seq").min().alias("lo"),
                                                    pl.col("group_seq").max().alias("hi"))
        behind = spans.with_columns(pl.col("lo").max().over("group").alias("group_lo")).filter(
            pl.col("hi") < pl.col("group_lo")
        )
        roots |= set(int(r) for r in behind["rank"].unique())
    return roots


def _by_silence(live: pl.DataFrame, now: int, stall: int) -> set[int]:
    seen = live.select("rank", pl.col("last_seen_wall_ns").fill_null(0).alias("seen"))
    newest = int(seen["seen"].max())  # type: ignore[arg-type]
    silent = seen.filter((pl.col("seen") < now - stall) & (pl.col("seen") < newest - stall))
    if 2 * silent.height >= live.height:
        return set()
    return set(int(r) for r in silent["rank"])


def _by_progress(live: pl.DataFrame) -> set[int]:
    lo, hi = live["last_step"].min(), live["last_step"].max()
    if lo is None or lo == hi:
        return set()
    least = live.filter(pl.col("last_step") == lo)
    return set(int(r) for r in least["rank"]) if 2 * least.height < live.height else set()


# -- incidents ---------------------------------------------------------------------------------------------------------

def _incident(frames: Frames, rank: int, method: str, confidence: float, events: pl.DataFrame,
              blocked: pl.DataFrame, stall: int, block: int) -> Incident:
    row = frames.liveness.filter(pl.col("rank") == rank)
    liv = row.row(0, named=True) if row.height else {}
    last_step = liv.get("last_step")
    last_step = int(last_step) if last_step is not None else -1
    step_end = liv.get("last_step_end_wall_ns")
    heartbeat = liv.get("last_heartbeat_wall_ns")
    own = events.filter(pl.col("rank") == rank)
    own_terminal = own.filter(pl.col("kind").is_in(_TERMINAL))
    own_blocked = blocked.filter(pl.col("rank") == rank)
    reactions = [
        frames.collective_errors.filter(pl.col("rank") != rank)["exit_wall_ns"].min(),
        events.filter((pl.col("rank") != rank) & (pl.col("kind") == str(EventKind.EXCEPTION))
                      & pl.col("collective_op").is_not_null())["wall_ns"].min(),
    ]
    first_reaction = _earliest(*reactions)
    own_t = _earliest(own_terminal["wall_ns"].min())
    hb = frames.heartbeat_interval_ns
    alive_after = (heartbeat - step_end) if heartbeat is not None and step_end is not None else None
    others_seen = frames.liveness.filter(pl.col("rank") != rank)["last_seen_wall_ns"].median()
    seen = liv.get("last_seen_wall_ns")
    # alive = heard from as late as its peers (within 1.5 heartbeats) and beating well past its last step
    alive = (
        alive_after is not None and alive_after > max(1.5 * hb, block)
        and (others_seen is None or seen is None or seen >= float(others_seen) - 1.5 * hb)  # type: ignore[arg-type]
    )
    # its own event right after its last step is how it stopped; one long after (a launcher's SIGTERM) is not
    prompt = own_t is not None and (step_end is None or own_t <= step_end + stall)
    first = own_t is not None and (first_reaction is None or own_t <= first_reaction)
    if prompt or (first and not alive):
        klass, cause = IncidentClass.FAIL_STOP, _event_cause(own_terminal)
        how = f"{cause}" + _event_detail(own_terminal)
    elif alive and alive_after is not None:
        klass = IncidentClass.HANG
        cause = Cause.STUCK_IN_COLLECTIVE if own_blocked.height else Cause.STUCK_IN_STEP
        where = (f" in {own_blocked['op'][0]} on {own_blocked['group'][0]} (group_seq {own_blocked['group_seq'][0]})"
                 if own_blocked.height else " outside any collective")
        how = f"alive (heartbeats {alive_after / 1e9:.1f} s past its last step end) but stuck{where}"
    else:
        klass, cause = IncidentClass.FAIL_STOP, Cause.VANISHED
        how = "vanished without an exit, signal or exception event"
    onset = last_step + 1
    waiting = blocked.filter(pl.col("rank") != rank)
    # The rank's last rows can be lost with it (a part not yet flushed when it was killed); the peers' operations
    # that wait for it say which step it failed to join.
    awaiting = waiting.filter(pl.col("group_ranks").list.contains(rank) | (pl.col("peer") == rank))
    if awaiting.height and not blocked.filter(pl.col("rank") == rank).height:
        onset = max(onset, int(awaiting["step"].min()))  # type: ignore[arg-type]
    summary = (f"rank {rank} stopped in step {onset} (last recorded step {last_step}): {how}; "
               f"{waiting['rank'].n_unique()} peer(s) blocked or errored in collectives (found by {method})")
    evidence = [
        Evidence(
            source="liveness", summary="how far each rank got and when it was last heard from (culprit first)",
            columns=("rank", "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns",
                     "last_seen_wall_ns"),
            rows=tuple(
                frames.liveness.sort(pl.col("rank") != rank, "rank")
                .select("rank", "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns",
                        "last_seen_wall_ns").head(20).iter_rows()
            ),
        )
    ]
    if blocked.height:
        evidence.append(Evidence(
            source="open_collectives+collective_errors",
            summary="collectives entered and never completed normally (open past a stall, or ended in an error)",
            columns=("rank", "step", "op", "group", "group_seq", "state", "wall_ns"),
            rows=tuple(blocked.sort(pl.col("rank") != rank, "wall_ns")
                       .select("rank", "step", "op", "group", "group_seq", "state", "wall_ns").head(20).iter_rows()),
        ))
    term = events.filter(pl.col("kind").is_in(_TERMINAL))
    if term.height:
        evidence.append(Evidence(
            source="events", summary="terminal events in time order (the culprit's own, then peers' reactions)",
            columns=("rank", "wall_ns", "kind", "exc_type", "collective_op", "collective_group", "signal", "exit_code"),
            rows=tuple(term.sort(pl.col("rank") != rank, "wall_ns")
                       .select("rank", "wall_ns", "kind", "exc_type", "collective_op", "collective_group", "signal",
                               "exit_code").head(20).iter_rows()),
        ))
    detection_wall = (step_end + stall) if klass is IncidentClass.HANG and step_end is not None else liv.get("last_seen_wall_ns")
    return Incident(
        klass=klass, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,), onset_step=onset,
        detection_step=onset, confidence=confidence, cause=cause, summary=summary, detection_wall_ns=detection_wall,
        fields=(str(cause),), evidence=tuple(evidence), attempt=liv.get("attempt"),
    )


def _earliest(*times: object) -> int | None:
    """The earliest of some scalar times (ns), ignoring nulls; None when all are null."""
    ints = [int(t) for t in times if isinstance(t, int | float)]
    return min(ints, default=None)


def _event_cause(own_terminal: pl.DataFrame) -> Cause:
    kinds = own_terminal.filter(~((pl.col("kind") == str(EventKind.EXCEPTION)) & pl.col("collective_op").is_not_null()))
    if kinds.filter((pl.col("kind") == str(EventKind.EXCEPTION)) & (pl.col("exc_type") != "SystemExit")).height:
        return Cause.EXCEPTION
    if kinds.filter(pl.col("kind") == str(EventKind.SIGNAL)).height:
        return Cause.SIGNAL
    if kinds.height:
        return Cause.EXIT
    return Cause.VANISHED


def _event_detail(own_terminal: pl.DataFrame) -> str:
    if own_terminal.height == 0:
        return ""
    e = own_terminal.row(0, named=True)
    if e["kind"] == str(EventKind.EXCEPTION):
        return f" ({e['exc_type']}: {(e['message'] or '')[:80]})"
    if e["kind"] == str(EventKind.SIGNAL):
        return f" (signal {e['signal']})"
    return f" (exit code {e['exit_code']})"
