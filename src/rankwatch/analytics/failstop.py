"""Fail-stop and hang: which rank stopped (or stopped progressing) first, and how; or that the whole job did.

What the telemetry shows when a rank goes (see canary/loop.py and collector/collector.py):

- `os._exit` or SIGKILL: nothing at all from the victim; its steps and heartbeats just end (rows of its last
  flush interval may be lost with it). Peers block in their next collective with it, and fail (gloo: at once, the
  peer's connection reset; NCCL: "remote process exited", or the watchdog's timeout) with texts that name no peer
  (`analytics.transport.REACTION_TEXTS`), often with no collective error row (on CUDA the host thread enqueued the
  collective and moved on).
- torchrun's agent, once a worker has failed (its poll every `--monitor-interval`, 0.1 s), signals the process group
  of every worker still running with SIGTERM, waits `--shutdown-timeout` (30 s) and SIGKILLs those left
  (`SubprocessContext._close`, `SubprocessHandler.close` under torch/distributed/elastic/multiprocessing/). A
  worker's SIGTERM handler (the collector's: signal + exit events) runs once its main thread is back in Python; one
  blocked in a C call (a gloo wait, a CUDA sync) writes nothing, beats on and ends at the SIGKILL.
- SIGTERM or an exception of its own: a signal / exception + exit event, about when its peers start to fail.
- hang: the training thread blocks, outside any collective or inside one the other members of its group got past;
  heartbeats go on; peers block in their next collective with it.
- the launcher (or the operator, or the scheduler) may kill every rank at once: a SIGTERM event on every rank, or,
  for SIGKILL, nothing at all: every rank's telemetry just ends, mid-step, each rank's up to a flush interval
  before the kill, so many ranks' rows stop steps behind the others' or inside an operation (a checkpoint's long
  barrier) the others completed: an open operation is no wait in a step one of the rank's data- or tensor-parallel
  groups got past (`_reached`).

A clean end is an exit event with code 0 from every rank. Survivors' exception, error and signal rows are
consequences, never evidence against them, but they say what they react to: a signal after another rank had failed
is the launcher's reaction to it (`_reacting`). The culprit is, in order of the evidence used:

1. the rank the survivors' errors name: a peer rank in their exception or collective error messages ("connection
   closed by peer ... (rank 11)"), the most named first, following a chain to its end;
   1b. the rank whose own connections failed locally while its peers' failed because it went (`analytics.transport`:
   "Software caused connection abort" against "Connection reset by peer"): a partition of that rank, cause NETWORK;
2. the rank(s) whose own abnormal terminal event came first, from a rank that was neither reacting (no failed
   collective, no peer named, no survivor's text, no signal after a failure) nor already waiting in a collective;
   2b. the rank(s) whose telemetry ended, with no terminal event of their own, before any rank's abnormal end
   (`_gone_first`): anyone alive then wrote its end or lived on past it;
3. the root of the wait graph of blocked collectives (`_by_wait_graph`);
4. a rank silent for much longer than the rest of the job (`_silent`);
5. in a job stalled everywhere with heartbeats going on and nothing blocked on the host (a CUDA job's threads wait
   at a sync point), the rank not where the others are (`_by_position`).

When the launcher signalled every rank still running at once, no rank having failed before (`_launcher_stop`, from
the exit records `rankwatch torchrun`'s host agent writes: the recovery manager stopping a hung job, an operator's
cancel), what came at or after that signal is the stop and its consequence, not evidence: a collective that failed
after it was open when it came (and counts as blocked from its entry), a survivor's exception because a peer left on
its signal, a rank's own SIGTERM. The rules above read what came before; a hung rank stopped so is still a hang.

When there is none and the job itself stopped abnormally (a signal or abnormal exit on most ranks at once, counting with
a signal the ranks that ended after it writing nothing; or no terminal event anywhere and every rank's telemetry ending
at about the same time, mid-step), the incident is the job's. A run that stops on every rank at the same step boundary
with nothing open and nothing written (a copy cut at a step) gives nothing; a live window cut mid-step looks like a
SIGKILLed job (`FailStopConfig.run_over`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import polars as pl

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.transport import NAMED_RANK, REPORTER_RANK, is_reaction, partitioned
from rankwatch.base.schema import CheckpointPhase, EventKind

__all__ = ["FailStopConfig", "detect_failstops"]

_P2P_OPS = ("send", "recv", "isend", "irecv")
_TERMINAL = (str(EventKind.EXIT), str(EventKind.SIGNAL), str(EventKind.EXCEPTION))


@dataclass(frozen=True, kw_only=True, slots=True)
class FailStopConfig:
    stall_heartbeats: float = 5.0
    """A rank is stalled / silent after this many heartbeat intervals without progress / without a sign of life
    (more than the collector's flush interval, whose rows a killed rank may lose)."""
    stall_step_factor: float = 5.0
    """... and at least this many median step durations (long steps are not stalls)."""
    startup_grace_s: float = 120.0
    """A job none of whose ranks completed a step of its latest attempt yet is starting (spawn, imports, rendezvous,
    checkpoint load and the consistency gate: minutes on a large or loaded machine): its open collectives, silences
    and stalls are read as a hang or a fail-stop only this long after the attempt began. Exits, signals, exceptions
    and collective errors count at once."""
    simultaneous_fraction: float = 0.1
    """Terminal events of several ranks within this fraction of a heartbeat interval of the first are one cause
    (a host going down)."""
    job_window_heartbeats: float = 1.0
    """Abnormal terminal events on more than half the ranks within this many heartbeat intervals of the first are
    one job-wide stop (a launcher's SIGTERM reaches every rank about at once) that blames no rank."""
    run_over: bool = True
    """The frames are of a run that is over (a post-mortem): telemetry that ends mid-step on every rank at once,
    with no terminal event, is a job killed from outside. False for a live window, where it is the present."""
    event_confidence: float = 0.95
    """The culprit wrote its own terminal event before anyone else reacted, or the survivors' errors name it."""
    graph_confidence: float = 0.9
    """The culprit is the root of the wait graph of blocked collectives."""
    fallback_confidence: float = 0.7
    """The culprit was chosen by silence, or by where it is in a job stalled everywhere, only."""
    job_confidence: float = 0.8
    """The job stopped at once with no rank to blame."""

    def __post_init__(self) -> None:
        if self.stall_heartbeats <= 0 or self.stall_step_factor <= 0:
            raise ValueError("FailStopConfig: stall_heartbeats and stall_step_factor must be > 0")
        if not 0 <= self.simultaneous_fraction < 1:
            raise ValueError(f"FailStopConfig.simultaneous_fraction must be in [0, 1), got {self.simultaneous_fraction}")
        if self.job_window_heartbeats <= 0:
            raise ValueError(f"FailStopConfig.job_window_heartbeats must be > 0, got {self.job_window_heartbeats}")
        for name in ("event_confidence", "graph_confidence", "fallback_confidence", "job_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"FailStopConfig.{name} must be in [0, 1], got {getattr(self, name)}")


def detect_failstops(frames: Frames, config: FailStopConfig = FailStopConfig()) -> tuple[Incident, ...]:
    """FAIL_STOP and HANG incidents, one per culprit rank, or one FAIL_STOP of the job when the job stopped at once
    with no rank to blame. Peers that blocked or errored waiting are not incidents; a run that finished cleanly, or
    is still progressing everywhere, gives none.

    `onset_step` = `detection_step` = the culprit's last completed step + 1 (a fail-stop is known as soon as peers
    block on it); for the job, the newest step in progress."""
    start = _attempt_start(frames)
    live = _liveness(frames, start)
    if live.height == 0:
        return ()
    now = frames.end_wall_ns
    stall, block = _stall_ns(frames, config), _block_ns(frames, config)
    events = _latest_attempt_events(frames)
    terminal = events.filter(pl.col("kind").is_in(_TERMINAL))
    abnormal = terminal.filter(
        (pl.col("kind") != str(EventKind.EXIT)) | (pl.col("exit_code").fill_null(0) != 0)
    )
    exits = events.filter(pl.col("kind") == str(EventKind.EXIT))
    if exits.filter(pl.col("exit_code") == 0)["rank"].n_unique() >= live["rank"].n_unique() and abnormal.height == 0:
        return ()  # every rank exited cleanly
    world = max(frames.world_size, live.height)
    reached = _reached(frames, live)
    blocked = _blocked(frames, start, now, block, reached)
    starting = _starting(frames, now, config)
    if starting:  # waits on a rank still starting are start-up, not a hang
        blocked = blocked.filter(pl.col("state") == "error")
    errors = _since_attempt(frames.collective_errors, start, "exit_wall_ns")
    evidence, stopped = events, abnormal
    stop = _launcher_stop(frames, live)
    if stop is not None:  # the stop and what it caused are no evidence of what came before it
        blocked = _blocked(frames, start, stop, block, reached, stopped_at=stop)
        if starting:
            blocked = blocked.filter(pl.col("state") == "error")
        errors = errors.filter(pl.col("exit_wall_ns") < stop)
        abnormal, evidence = abnormal.filter(pl.col("wall_ns") < stop), events.filter(pl.col("wall_ns") < stop)
    named = _named_peers(evidence, errors, world)
    ended = set(int(r) for r in terminal["rank"].unique())
    # a rank that wrote its own terminal event ended; it did not fall silent
    silent = set() if starting else _silent(live, stall) - ended
    gone = set() if starting else _gone_first(live, ended, abnormal, errors, now, stall, config)
    stalled = not starting and _stalled(live, now, stall)

    culprits: set[int] = set()
    method = ""
    if abnormal.height or errors.height or blocked.height or silent or stalled:
        rules = (
            ("named by peers", lambda: _by_named(named)),
            ("own transport", lambda: _by_transport(evidence, errors)),
            ("events", lambda: _by_events(frames, live, abnormal, errors, named, blocked, silent | gone, ended,
                                          world, config)),
            ("gone first", lambda: gone),
            ("wait graph", lambda: _by_wait_graph(blocked, reached, silent, frames.clock is Clock.DEVICE)),
            ("silence", lambda: silent),
            ("position", lambda: _by_position(frames, live, events, stall) if stalled else set()),
        )
        for method, rule in rules:
            culprits = rule()
            if culprits:
                break
    if not culprits:
        # a job still starting that ends mid-operation is starting, not killed (its exits and signals still count)
        job = _job_stop(frames, live, start, terminal, stopped, world,
                        replace(config, run_over=False) if starting else config)
        return (_job_incident(frames, live, job, events, config),) if job is not None else ()
    confidence = {"events": config.event_confidence, "named by peers": config.event_confidence,
                  "own transport": config.event_confidence, "gone first": config.event_confidence,
                  "wait graph": config.graph_confidence}.get(method, config.fallback_confidence)
    return tuple(
        _incident(frames, r, method, confidence, events, errors, blocked, stall, block, silent, stop)
        for r in sorted(culprits)
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


def _liveness(frames: Frames, start: pl.DataFrame) -> pl.DataFrame:
    """`frames.liveness` with each rank's last progress no earlier than its latest attempt's start (`start`:
    `_attempt_start`): a relaunched rank still loading its checkpoint has not stopped at the step its previous
    incarnation last completed."""
    live = frames.liveness
    if not live.height or not start.height:
        return live
    end = pl.col("last_step_end_wall_ns")
    return live.join(start, on="rank", how="left").with_columns(
        pl.when(pl.col("attempt_start").is_not_null() & (end.is_null() | (end < pl.col("attempt_start"))))
        .then(pl.col("attempt_start")).otherwise(end).alias("last_step_end_wall_ns")
    ).drop("attempt_start")


def _attempt_start(frames: Frames) -> pl.DataFrame:
    """rank -> start wall time of its latest attempt (rows older than it belong to a previous incarnation). An
    attempt is a launch of the whole job, so in a relaunched job no rank's latest attempt began before the newest
    attempt's first sign of life (`_newest_start`): a rank still spawning, whose own rows of it are not written yet,
    is not its previous incarnation."""
    topo = frames.topology
    if topo.height == 0 and not frames.liveness.height:
        return pl.DataFrame(schema={"rank": pl.Int32, "attempt_start": pl.Int64})
    own = (topo.group_by("rank").agg(pl.col("start_wall_ns").max().alias("attempt_start"))
           .with_columns(pl.col("rank").cast(pl.Int32)) if topo.height else
           pl.DataFrame(schema={"rank": pl.Int32, "attempt_start": pl.Int64}))
    newest, first = _newest_start(frames)
    if newest is None or first is None:
        return own
    if newest == 0:  # never relaunched: no previous incarnation to tell apart
        if "attempt" not in topo.columns or not topo.height:
            return own
        t0 = topo.filter(pl.col("attempt").fill_null(0) == 0)["start_wall_ns"].min()
        if t0 is None:
            return own
        return own.with_columns(pl.max_horizontal("attempt_start", pl.lit(int(t0))).alias("attempt_start"))  # type: ignore[arg-type]
    ranks = frames.liveness.select(pl.col("rank").cast(pl.Int32)).unique()
    return (ranks.join(own, on="rank", how="full", coalesce=True)
            .with_columns(pl.max_horizontal(pl.col("attempt_start"), pl.lit(first)).alias("attempt_start")))


def _newest_start(frames: Frames) -> tuple[int | None, int | None]:
    """(the newest attempt any rank's liveness or topology shows, its first sign of life: an event, a heartbeat — a
    relaunched rank beats before it writes its topology row — or a topology row); Nones when nothing says."""
    live, topo = frames.liveness, frames.topology
    attempts = [a for a in (live["attempt"].max() if live.height else None,
                            topo["attempt"].max() if topo.height and "attempt" in topo.columns else None)
                if a is not None]
    if not attempts:
        return None, None
    newest = int(max(attempts))  # type: ignore[arg-type]
    signs = [frames.events.filter(pl.col("attempt").fill_null(0) == newest)["wall_ns"].min(),
             topo.filter(pl.col("attempt").fill_null(0) == newest)["start_wall_ns"].min()
             if topo.height and "attempt" in topo.columns else None,
             live.filter(pl.col("attempt") == newest)["first_seen_wall_ns"].min()
             if "first_seen_wall_ns" in live.columns else None]
    known = [int(x) for x in signs if x is not None]  # type: ignore[arg-type]
    return newest, min(known) if known else None


def _since_attempt(rows: pl.DataFrame, start: pl.DataFrame, wall: str) -> pl.DataFrame:
    """The rows of each rank's latest attempt (`wall` at or after its start)."""
    if not start.height or not rows.height:
        return rows
    return rows.join(start, on="rank", how="left").filter(
        pl.col("attempt_start").is_null() | (pl.col(wall) >= pl.col("attempt_start"))
    ).drop("attempt_start")


def _latest_attempt_events(frames: Frames) -> pl.DataFrame:
    ev = frames.events
    latest = frames.liveness.select("rank", pl.col("attempt").alias("_latest"))
    return (
        ev.join(latest, on="rank", how="left")
        .filter(pl.col("_latest").is_null() | (pl.col("attempt") == pl.col("_latest")))
        .drop("_latest")
        .sort("wall_ns")
    )


def _reached(frames: Frames, live: pl.DataFrame) -> pl.DataFrame:
    """`live` with each rank's last_step raised to the step before the newest one in which an operation of one of its
    data- or tensor-parallel groups completed on any member: every member takes part in each of those (one or more
    every step), so the rank got that far, whatever its own rows say (a rank killed loses its last flush interval of
    rows; in a job killed at once, those of many ranks end steps before the others'). Left as is in a relaunched job
    (`group_transfer` does not tell the attempts apart)."""
    done, groups = frames.group_transfer, frames.groups
    if not done.height or not groups.height or live["attempt"].fill_null(0).max() != 0:
        return live
    newest = (
        done.filter(pl.col("kind").is_in(("dp", "tp"))).group_by("group").agg(pl.col("step").max().alias("_t"))
        .join(groups.select("group", pl.col("ranks").alias("rank")), on="group").explode("rank")
        .group_by("rank").agg(pl.col("_t").max()).with_columns(pl.col("rank").cast(pl.Int32))
    )
    return live.join(newest, on="rank", how="left").with_columns(
        pl.max_horizontal("last_step", pl.col("_t") - 1).alias("last_step")).drop("_t")


def _blocked(frames: Frames, start: pl.DataFrame, now: int, block: int, reached: pl.DataFrame, *,
             stopped_at: int | None = None) -> pl.DataFrame:
    """Collectives a rank entered and did not complete normally in its latest attempt: open for longer than `block`
    in a step it is not known to have got past (`_reached`: its rows that said it left were lost), or ended in an
    error. One row per (rank, group, group_seq). With `stopped_at` (`_launcher_stop`), `now` is the stop: an
    operation that ended in an error after it was open when the stop came (its error is the stop's doing) and counts
    as open from its entry."""
    cols = ["rank", "step", "op", "group", "group_ranks", "group_seq", "peer", "wall_ns", "state"]
    done = reached.select("rank", pl.col("last_step").alias("_done"))
    failed = frames.collective_errors
    cut = (pl.col("exit_wall_ns") >= stopped_at) if stopped_at is not None else pl.lit(False)
    entered = pl.concat([
        frames.open_collectives.select("rank", "step", "op", "group", "group_ranks", "group_seq", "peer",
                                       "enter_wall_ns"),
        failed.filter(cut & pl.col("enter_wall_ns").is_not_null()).select(
            "rank", "step", "op", "group", "group_ranks", "group_seq", pl.lit(None, dtype=pl.Int32).alias("peer"),
            "enter_wall_ns"),
    ])
    opened = entered.join(done, on="rank", how="left").filter(
        (pl.col("enter_wall_ns") < now - block) & (pl.col("step") > pl.col("_done").fill_null(-1))
    ).select(
        "rank", "step", "op", "group", "group_ranks", "group_seq", "peer", pl.col("enter_wall_ns").alias("wall_ns"),
        pl.lit("open").alias("state"),
    )
    errors = failed.filter(~cut).select(
        "rank", "step", "op", "group", "group_ranks", "group_seq", pl.lit(None, dtype=pl.Int32).alias("peer"),
        pl.col("exit_wall_ns").alias("wall_ns"), pl.lit("error").alias("state"),
    )
    rows = _since_attempt(pl.concat([opened.select(cols), errors.select(cols)]), start, "wall_ns")
    return rows.unique(["rank", "group", "group_seq"], keep="first", maintain_order=True)


def _stuck_by_order(edges: pl.DataFrame, entered: pl.DataFrame) -> set[int]:
    """Ranks stuck inside a collective that its other members left, told by the order of blocking. A member blocked
    elsewhere since before a rank entered its collective cannot have got past that collective (it would have had to
    be inside it): a definite wait, as is every point-to-point wait on a peer blocked elsewhere. A member blocked
    only since later may have got past it. A rank with no definite wait is stuck when each member it may be waiting
    for waits, through definite waits, on it, or waits on nobody (blocked where every member is present): they are
    past it, waiting for what it never did."""
    import numpy as np
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import breadth_first_order

    e = edges.join(entered.rename({"rank": "m", "_t": "_m_t"}), on="m", how="left").with_columns(
        (pl.col("_p2p") | (pl.col("_m_t").fill_null(0) < pl.col("wall_ns"))).alias("_definite"))
    sure, maybe = e.filter(pl.col("_definite")), e.filter(~pl.col("_definite"))
    if maybe.height == 0:
        return set()
    candidates = set(int(r) for r in maybe["rank"].unique()) - set(int(r) for r in sure["rank"].unique())
    if not candidates:
        return set()
    n = int(max(e["rank"].to_numpy().max(), e["m"].to_numpy().max())) + 1
    pairs = sure.select("rank", "m").unique()
    # reversed graph: from a rank to those that wait on it, so a search from r finds every rank whose waits reach r
    back = coo_matrix((np.ones(pairs.height, dtype=np.int8), (pairs["m"].to_numpy(), pairs["rank"].to_numpy())),
                      shape=(n, n)).tocsr()
    waits = maybe.group_by("rank").agg(pl.col("m").unique())
    out = set()
    waiting = set(int(r) for r in e["rank"].unique())
    for r, ms in waits.filter(pl.col("rank").is_in(list(candidates))).iter_rows():
        reach = set(breadth_first_order(back, int(r), directed=True, return_predecessors=False).tolist())
        if all(int(m) in reach or int(m) not in waiting for m in ms):
            out.add(int(r))
    return out


def _messages(events: pl.DataFrame, errors: pl.DataFrame) -> pl.DataFrame:
    """(reporter, wall_ns, message): every rank's exception and collective error messages."""
    return pl.concat([
        events.filter((pl.col("kind") == str(EventKind.EXCEPTION)) & pl.col("message").is_not_null())
        .select(pl.col("rank").alias("reporter"), "wall_ns", "message"),
        errors.filter(pl.col("error").is_not_null())
        .select(pl.col("rank").alias("reporter"), pl.col("exit_wall_ns").alias("wall_ns"), pl.col("error").alias("message")),
    ])


def _named_peers(events: pl.DataFrame, errors: pl.DataFrame, world: int) -> pl.DataFrame:
    """(reporter, named, wall_ns): a rank named in another rank's exception or collective error message
    (`analytics.transport.peers_named`: a rank NCCL prints of the reporter itself is left out, and so is the
    reporter)."""
    out = (
        _messages(events, errors)
        .with_columns(pl.col("message").str.replace_all(REPORTER_RANK, "").str.extract_all(NAMED_RANK).alias("named"))
        .explode("named")
        .with_columns(pl.col("named").str.extract(r"(\d+)$", 1).cast(pl.Int64))
        .filter(pl.col("named").is_not_null() & (pl.col("named") != pl.col("reporter")) & (pl.col("named") < world))
    )
    return out.select("reporter", pl.col("named").cast(pl.Int32), "wall_ns")


def _starting(frames: Frames, now: int, config: FailStopConfig) -> bool:
    """The newest attempt has no completed step yet, and its first sign of life (`_newest_start`; a rank still
    spawning has written none) came less than `startup_grace_s` ago."""
    newest, first = _newest_start(frames)
    if newest is None or first is None:
        return False
    if frames.steps.filter(pl.col("attempt").fill_null(0) == newest).height:
        return False
    return now - first < config.startup_grace_s * 1e9


def _stalled(live: pl.DataFrame, now: int, stall: int) -> bool:
    """Every rank stopped completing steps more than `stall` before the end while most kept beating: the job hangs
    (a run that ended, or a copy cut at a step, has no heartbeats long after its last step)."""
    end = pl.col("last_step_end_wall_ns").fill_null(0)
    if live.filter(end >= now - stall).height:
        return False
    beating = live.filter(pl.col("last_heartbeat_wall_ns").fill_null(0) > end + stall)
    return 2 * beating.height > live.height


def _silent(live: pl.DataFrame, stall: int) -> set[int]:
    """Ranks last heard from more than `stall` before the job's median last sign of life (a job killed at once
    loses up to a flush interval of rows on each rank, so the newest rank is no reference)."""
    seen = live.select("rank", pl.col("last_seen_wall_ns").fill_null(0).alias("seen"))
    ref = seen["seen"].median()
    if ref is None:
        return set()
    silent = seen.filter(pl.col("seen") < float(ref) - stall)  # type: ignore[arg-type]
    if 2 * silent.height >= live.height:
        return set()
    return set(int(r) for r in silent["rank"])


def _gone_first(live: pl.DataFrame, ended: set[int], abnormal: pl.DataFrame, errors: pl.DataFrame, now: int,
                stall: int, config: FailStopConfig) -> set[int]:
    """Ranks that ended before anything else happened: no terminal event of their own (`ended`: the ranks that wrote
    one), telemetry ending before the first abnormal terminal event or collective error of any rank, and fewer than
    half the ranks. A rank alive when the first failure, reaction or stop request came either wrote its own end
    (a SIGTERM handler's signal and exit, an exception) or lived on after it (a handler deferred while its main
    thread is in a C call: it beats until the SIGKILL at the end of the launcher's grace, 30 s for torchrun, longer
    than the collector's flush interval, whose rows a SIGKILL loses). So one that ended silently before it was dead
    or frozen already (SIGKILL, a lost host), however shortly before; half the job or more ending so is a kill of
    the whole job that lost each rank's last rows. In a live window (not `run_over`) a rank's newest rows may be
    unread yet: it also must have been silent for `stall`."""
    first = _earliest(abnormal["wall_ns"].min(), errors["exit_wall_ns"].min())
    if first is None:
        return set()
    seen = pl.col("last_seen_wall_ns").fill_null(0)
    before = live.filter(~pl.col("rank").is_in(list(ended)) & (seen < first))
    if not config.run_over:
        before = before.filter(seen < now - stall)
    if 2 * before.height >= live.height:
        return set()
    return set(int(r) for r in before["rank"])


# -- culprit rules ------------------------------------------------------------------------------------------------------

def _by_named(named: pl.DataFrame) -> set[int]:
    """The ranks the survivors' errors name: named by at least half as many reporters as the most named one (and by
    two, where two reported), less those that themselves name another such rank (they reacted too)."""
    if named.height == 0:
        return set()
    votes = named.group_by("named").agg(pl.col("reporter").n_unique().alias("votes"))
    top = int(votes["votes"].max())  # type: ignore[arg-type]
    floor = max(min(2, named["reporter"].n_unique()), (top + 1) // 2)
    candidates = set(int(r) for r in votes.filter(pl.col("votes") >= floor)["named"])
    reacting = set(int(r) for r in named.filter(
        pl.col("reporter").is_in(list(candidates)) & pl.col("named").is_in(list(candidates))
    )["reporter"])
    roots = candidates - reacting
    return roots or set(int(r) for r in votes.filter(pl.col("votes") == top)["named"])


def _by_transport(events: pl.DataFrame, errors: pl.DataFrame) -> set[int]:
    """The ranks whose own connections failed while their peers saw them go (analytics.transport.partitioned), from
    each rank's exception and collective error messages (`_messages`)."""
    msgs: dict[int, list[str | None]] = {}
    for r, m in _messages(events, errors).select("reporter", "message").iter_rows():
        msgs.setdefault(int(r), []).append(m)
    return partitioned(msgs)


def _by_events(frames: Frames, live: pl.DataFrame, abnormal: pl.DataFrame, errors: pl.DataFrame,
               named: pl.DataFrame, blocked: pl.DataFrame, silent: set[int], ended: set[int], world: int,
               config: FailStopConfig) -> set[int]:
    """Ranks whose own abnormal terminal event came first: from a rank neither reacting (`_reacting`: a failed
    collective of its own, a peer named in its errors, a survivor's text for a peer gone, a SIGTERM after another
    rank had failed) nor already waiting for a peer in a collective when it happened (`_waiting`: one inside a
    collective every member entered waits for nobody; it ends there on its own, as a rank that exits or is killed
    mid-operation does, and its peers are the ones left waiting), about no later than the first reaction
    (within a heartbeat: host clocks differ), after no other rank had gone silent (`silent`: then it is a reaction to
    that one, whatever it says), and not part of a job-wide stop (`_stop_ranks`)."""
    reacting = _reacting(abnormal, errors, named, live, silent)
    own = abnormal.filter(~pl.col("rank").is_in(list(reacting)))
    if own.height == 0:
        return set()
    first_block = _waiting(blocked).group_by("rank").agg(pl.col("wall_ns").min().alias("_blocked"))
    own = own.join(first_block, on="rank", how="left").filter(
        pl.col("_blocked").is_null() | (pl.col("wall_ns") < pl.col("_blocked"))
    )
    if own.height == 0:
        return set()
    firsts = own.group_by("rank").agg(pl.col("wall_ns").min().alias("t")).sort("t")
    t0 = int(firsts["t"][0])
    gone = live.filter(pl.col("rank").is_in(list(silent)))["last_seen_wall_ns"].min()
    if gone is not None and int(gone) < t0:  # type: ignore[arg-type]
        return set()
    cluster = firsts.filter(pl.col("t") <= t0 + int(config.simultaneous_fraction * frames.heartbeat_interval_ns))
    reactions = abnormal.filter(pl.col("rank").is_in(list(reacting)))["wall_ns"].min()
    first_reaction = _earliest(reactions, errors["exit_wall_ns"].min())
    if first_reaction is not None and t0 > first_reaction + frames.heartbeat_interval_ns:
        return set()  # it came after the others failed: a reaction to them (a launcher's SIGTERM)
    if 2 * cluster.height > world:
        return set()
    # a launcher's signal reaches the hosts one after another: own events on most ranks within the job window are
    # one job-wide stop (the first host's cluster is not a culprit)
    if 2 * len(_stop_ranks(own, live, ended, frames, config)) > world:
        return set()
    return set(int(r) for r in cluster["rank"])


def _waiting(blocked: pl.DataFrame) -> pl.DataFrame:
    """The rows of `blocked` where the rank waits for a peer: an operation that ended in an error, a point-to-point
    one, or a collective some member of which never entered the same operation (group, group_seq; open or ended in
    an error there; its members unknown: some may be missing). A rank whose every fellow member is inside it with
    it waits for none of them."""
    coll = blocked.filter(~pl.col("op").is_in(_P2P_OPS) & pl.col("peer").is_null()
                          & pl.col("group_ranks").is_not_null())
    inside = coll.group_by("group", "group_seq").agg(pl.col("rank").unique().alias("_in"))  # open, or ended in error
    full = coll.filter(pl.col("state") == "open").join(inside, on=["group", "group_seq"]).filter(
        pl.col("group_ranks").cast(pl.List(pl.Int64)).list.set_difference(pl.col("_in").cast(pl.List(pl.Int64)))
        .list.len() == 0)
    return blocked.join(full.select("rank", "group", "group_seq"), on=["rank", "group", "group_seq"], how="anti")


def _reacting(abnormal: pl.DataFrame, errors: pl.DataFrame, named: pl.DataFrame, live: pl.DataFrame,
              gone: set[int]) -> set[int]:
    """Ranks whose abnormal end is a reaction to another rank's failure: a collective error of their own; a peer
    named in their errors; an exception whose text is a survivor's for a peer gone (`analytics.transport.
    is_reaction`: NCCL's, c10d's, gloo's); or a stop request after another rank had already failed
    (`_first_failure`): torchrun's agent, once a worker has failed, signals the process group of every worker still
    running with SIGTERM, then SIGKILL after `--shutdown-timeout` (`SubprocessContext._close` and
    `SubprocessHandler.close` under torch/distributed/elastic/multiprocessing/)."""
    reacting = set(int(r) for r in errors["rank"].unique()) | set(int(r) for r in named["reporter"].unique())
    exc = abnormal.filter((pl.col("kind") == str(EventKind.EXCEPTION)) & pl.col("message").is_not_null())
    reacting |= {int(r) for r, m in exc.select("rank", "message").iter_rows() if is_reaction(m)}
    failed = _first_failure(abnormal, errors, live, gone, reacting)
    if failed is not None:
        firsts = abnormal.sort("wall_ns").group_by("rank", maintain_order=True).first()
        reacting |= set(int(r) for r in firsts.filter(
            (pl.col("kind") == str(EventKind.SIGNAL)) & (pl.col("wall_ns") > failed))["rank"])
    return reacting


def _first_failure(abnormal: pl.DataFrame, errors: pl.DataFrame, live: pl.DataFrame, gone: set[int],
                   reacting: set[int]) -> int | None:
    """When some rank first failed rather than was stopped: the earliest exception or abnormal exit of a rank that
    got no signal (a signalled rank's exit code 128 + n is its signal's) from a rank not reacting, or end of a rank
    gone silent (`gone`); a reaction (an exception or exit of a `reacting` rank, a collective error) shows a failure
    came before it, but only before the first signal (after it, it may be a reaction to the stop itself: a peer
    that left). None when nothing failed."""
    signalled = abnormal.filter(pl.col("kind") == str(EventKind.SIGNAL))
    gone_on_signal = signalled["rank"].unique().to_list()  # a list: polars deprecates `is_in` of a same-typed Series
    failed = abnormal.filter((pl.col("kind") == str(EventKind.EXCEPTION))
                             | ((pl.col("kind") == str(EventKind.EXIT)) & ~pl.col("rank").is_in(gone_on_signal)))
    react = _earliest(failed.filter(pl.col("rank").is_in(list(reacting)))["wall_ns"].min(),
                      errors["exit_wall_ns"].min())
    first_signal = _earliest(signalled["wall_ns"].min())
    if react is not None and first_signal is not None and react > first_signal:
        react = None
    return _earliest(failed.filter(~pl.col("rank").is_in(list(reacting)))["wall_ns"].min(), react,
                     live.filter(pl.col("rank").is_in(list(gone)))["last_seen_wall_ns"].min())


def _stop_ranks(own: pl.DataFrame, live: pl.DataFrame, ended: set[int], frames: Frames,
                config: FailStopConfig) -> set[int]:
    """The ranks one stop from outside reached, when the first of the `own` abnormal events opens one: those with
    an own event within `job_window_heartbeats` of the first; and, when the first is a signal, every rank that wrote
    no terminal event at all (not in `ended`) and was heard from at or after it: its SIGTERM handler runs
    only once its main thread is back in Python, so a rank blocked in a C call (a gloo wait, a CUDA sync) writes
    nothing and is SIGKILLed at the end of the grace (torchrun: `--shutdown-timeout`, 30 s)."""
    first = own.sort("wall_ns").row(0, named=True)
    t0 = int(first["wall_ns"])
    window = int(config.job_window_heartbeats * frames.heartbeat_interval_ns)
    ranks = set(int(r) for r in own.filter(pl.col("wall_ns") <= t0 + window)["rank"])
    if first["kind"] == str(EventKind.SIGNAL):
        ranks |= set(int(r) for r in live.filter(
            ~pl.col("rank").is_in(list(ended)) & (pl.col("last_seen_wall_ns") >= t0))["rank"])
    return ranks


def _launcher_stop(frames: Frames, live: pl.DataFrame) -> int | None:
    """When the launcher (or whatever stops it: an operator, a scheduler, the recovery manager) signalled every rank
    still running at once, with no rank ended before it but cleanly: the earliest signal an exit record says reached
    a rank from outside (`ExitRecord.outside_signal`, as `rankwatch torchrun`'s host agent saw it). torchrun's agent
    signals only the workers still running once one has failed (`SubprocessContext._close` under
    torch/distributed/elastic/multiprocessing/), so a rank that failed first got no such signal, and its abnormal end
    makes this None; so does a run whose exit records do not cover every rank, or tell no outside signal. Whatever
    the ranks did after the stop (a collective failing because a peer left on its signal, that peer's exception) is
    the stop's consequence."""
    ex = frames.exits.join(live.select("rank", pl.col("attempt").alias("_latest")), on="rank", how="inner").filter(
        pl.col("attempt") == pl.col("_latest"))
    if ex.height == 0 or ex["rank"].n_unique() < max(live.height, frames.world_size):
        return None
    first = ex["outside_signal_wall_ns"].min()
    if first is None:
        return None
    unsignalled = ex.filter(pl.col("outside_signal").is_null())
    if unsignalled.filter(pl.col("signal").is_not_null() | (pl.col("exit_code").fill_null(1) != 0)
                          | (pl.col("wall_ns") >= first)).height:
        return None  # a rank failed without the launcher's signal: what it reacted to
    return int(first)  # type: ignore[arg-type]


def _by_wait_graph(blocked: pl.DataFrame, live: pl.DataFrame, silent: set[int], device: bool) -> set[int]:
    """Roots of the wait graph. A blocked rank waits for each member of its operation's group that is not inside the
    same operation (group, group_seq) and has not completed the operation's step (for a point-to-point operation,
    its peer). The roots are: ranks waited for that are not blocked anywhere (dead, or stuck outside collectives);
    else ranks blocked in an operation every other member of which got past (stuck inside it); else ranks blocked
    in a collective each missing member of which has been blocked elsewhere only since later (it may have got past;
    one blocked since before could not have), waiting on nobody for certain; else, in a cycle
    (a rank stuck inside an operation its peers left for the next one, in the same step), the ranks that blocked
    before every rank they wait for. On the device clock a host thread returns from a collective call once it is
    enqueued and waits at the next sync point instead, so a live member blocked nowhere may have got past it."""
    if blocked.height == 0:
        return set()
    waiting = set(int(r) for r in blocked["rank"].unique())
    is_p2p = pl.col("op").is_in(_P2P_OPS) | pl.col("peer").is_not_null()
    ops = blocked.with_columns(
        pl.when(is_p2p & pl.col("peer").is_not_null()).then(pl.concat_list(pl.col("peer")))
        .when(is_p2p).then(pl.lit([], dtype=pl.List(pl.Int32)))
        .otherwise(pl.col("group_ranks")).alias("_members"),
        is_p2p.alias("_p2p"),
    )
    present = ops.filter(~pl.col("_p2p")).select("group", "group_seq", pl.col("rank").alias("m")).unique()
    # a member blocked in a later operation of the same group got past this one (it left for the next)
    later = ops.filter(~pl.col("_p2p")).group_by("group", pl.col("rank").alias("m")).agg(
        pl.col("group_seq").max().alias("_m_seq"))
    last = live.select(pl.col("rank").alias("m"), pl.col("last_step").alias("_m_last"))
    pairs = (
        ops.select("rank", "step", "group", "group_seq", "wall_ns", "_p2p", pl.col("_members").alias("m"))
        .explode("m")
        .filter(pl.col("m").is_not_null() & (pl.col("m") != pl.col("rank")))
        .join(present, on=["group", "group_seq", "m"], how="anti")
        .join(last, on="m", how="left")
        .join(later, on=["group", "m"], how="left")
        .with_columns((
            (pl.col("_m_last").fill_null(-1) >= pl.col("step"))
            | (pl.col("_m_seq").fill_null(-1) > pl.col("group_seq"))
            | (pl.lit(device) & ~pl.col("m").is_in(list(waiting | silent)))
        ).alias("_passed"))
    )
    edges = pairs.filter(~pl.col("_passed"))
    roots = set(int(r) for r in edges["m"].unique()) - waiting
    if roots:
        return roots
    behind = pairs.group_by("rank", "group", "group_seq").agg(pl.col("_passed").all().alias("_all"))
    stuck = set(int(r) for r in behind.filter(pl.col("_all"))["rank"].unique())
    if stuck:
        return stuck
    if edges.height == 0:
        return set()
    entered = blocked.group_by("rank").agg(pl.col("wall_ns").min().alias("_t"))
    stuck = _stuck_by_order(edges, entered)
    if stuck:
        return stuck
    first = (
        edges.select("rank", "m").unique()
        .join(entered.rename({"rank": "m", "_t": "_m_t"}), on="m", how="left")
        .group_by("rank").agg(pl.col("_m_t").min().alias("_m_t"))
        .join(entered, on="rank", how="left")
        .filter(pl.col("_t") < pl.col("_m_t"))
    )
    awaited = set(int(r) for r in edges["m"].unique())
    return set(int(r) for r in first["rank"]) & awaited



def _by_position(frames: Frames, live: pl.DataFrame, events: pl.DataFrame, stall: int) -> set[int]:
    """In a job that stalled everywhere (`_stalled`) with no collective blocked on the host (a CUDA job: host
    threads wait at a sync point), the ranks not where the others are: behind every other rank of their pipeline
    stage in completed steps; else a few ranks (at most a quarter) whose latest event, written while stalled, is in
    another step or phase than the one most ranks are stalled in."""
    stage = frames.topology.select("rank", pl.col("pp").fill_null(0).alias("_pp")).unique("rank")
    by_stage = (
        live.join(stage, on="rank", how="left").with_columns(pl.col("_pp").fill_null(0))
        .with_columns(pl.col("last_step").min().over("_pp").alias("_lo"), pl.len().over("_pp").alias("_n"))
        .with_columns((pl.col("last_step") == pl.col("_lo")).sum().over("_pp").alias("_at_lo"),
                      pl.col("last_step").max().over("_pp").alias("_hi"))
    )
    behind = by_stage.filter((pl.col("last_step") == pl.col("_lo")) & (pl.col("_hi") > pl.col("_lo"))
                             & (2 * pl.col("_at_lo") < pl.col("_n")))
    if behind.height:
        return set(int(r) for r in behind["rank"])
    latest = (
        events.join(live.select("rank", "last_step_end_wall_ns"), on="rank", how="inner")
        .filter(pl.col("wall_ns") > pl.col("last_step_end_wall_ns").fill_null(0) + stall)
        .sort("wall_ns").group_by("rank").agg(pl.col("step").last(), pl.col("phase").last())
    )
    if 2 * latest.height <= live.height:
        return set()
    where = latest.group_by("step", "phase").agg(pl.len().alias("_n")).sort("_n", descending=True)
    mode = where.row(0, named=True)
    odd = latest.filter(pl.col("step").ne_missing(mode["step"]) | pl.col("phase").ne_missing(mode["phase"]))
    if odd.height == 0 or 4 * odd.height > live.height:
        return set()
    return set(int(r) for r in odd["rank"])


def _job_stop(frames: Frames, live: pl.DataFrame, start: pl.DataFrame, terminal: pl.DataFrame, abnormal: pl.DataFrame,
              world: int, config: FailStopConfig) -> tuple[Cause, str, int | None] | None:
    """How the job itself stopped, when it stopped abnormally at once: a signal or abnormal exit on more than half
    the ranks within `job_window_heartbeats` (with a signal first, counting the ranks that ended after it writing
    nothing: `_stop_ranks`); or (`run_over`) no terminal event anywhere and telemetry that ends mid-step (an
    operation open, a heartbeat in a step never completed, or ranks at different last steps)."""
    if abnormal.height:
        t0 = int(abnormal["wall_ns"].min())  # type: ignore[arg-type]
        window = int(config.job_window_heartbeats * frames.heartbeat_interval_ns)
        together = abnormal.filter(pl.col("wall_ns") <= t0 + window)
        ended = set(int(r) for r in terminal["rank"].unique())
        reached = _stop_ranks(abnormal, live, ended, frames, config)
        if 2 * len(reached) <= world:
            return None
        later = len(reached - set(int(r) for r in together["rank"]))
        killed = f" (and {later} that wrote nothing and ended later: SIGKILLed after the grace)" if later else ""
        attempt = together["attempt"].max()
        att = None if attempt is None else int(attempt)  # type: ignore[arg-type]
        if together.filter(pl.col("kind") == str(EventKind.SIGNAL)).height:
            sig = together.filter(pl.col("kind") == str(EventKind.SIGNAL))["signal"].drop_nulls()
            what = f"signal {int(sig.mode()[0])}" if sig.len() else "a signal"
            span = (int(together["wall_ns"].max()) - t0) / 1e6  # type: ignore[arg-type]
            return Cause.SIGNAL, (f"{what} on {together['rank'].n_unique()} of {world} ranks within {span:.0f} ms"
                                  f"{killed}, nobody failing first: the job was stopped from outside"), att
        cause = Cause.EXCEPTION if together.filter(pl.col("kind") == str(EventKind.EXCEPTION)).height else Cause.EXIT
        return cause, f"{cause} on {together['rank'].n_unique()} of {world} ranks at once, nobody failing first", att
    if terminal.height or not config.run_over:
        return None
    open_now = _since_attempt(frames.open_collectives, start, "enter_wall_ns")
    in_step = live.filter(pl.col("heartbeat_step").fill_null(-1) > pl.col("last_step"))
    if open_now.height == 0 and in_step.height == 0 and live["last_step"].n_unique() <= 1:
        return None  # every rank at one step boundary with nothing open: a run cut at a step, not a kill
    lo, hi = int(live["last_step"].min()), int(live["last_step"].max())  # type: ignore[arg-type]
    return Cause.VANISHED, (f"no rank wrote an exit, signal or exception event, and every rank's telemetry ends "
                            f"mid-step ({open_now['rank'].n_unique()} inside a collective, {in_step.height} beating "
                            f"in a step they never completed, last steps {lo}..{hi}): the job was killed from outside "
                            f"(SIGKILL, a lost node or power)"), None


# -- incidents ---------------------------------------------------------------------------------------------------------

def _job_incident(frames: Frames, live: pl.DataFrame, job: tuple[Cause, str, int | None], events: pl.DataFrame,
                  config: FailStopConfig) -> Incident:
    cause, how, attempt = job
    ranks = tuple(sorted(int(r) for r in live["rank"]))
    onset = int(live["last_step"].max()) + 1  # type: ignore[arg-type]
    evidence = [Evidence(
        source="liveness", summary="how far each rank got and when it was last heard from (the earliest first)",
        columns=("rank", "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns",
                 "last_seen_wall_ns"),
        rows=tuple(live.sort("last_seen_wall_ns", "rank").select(
            "rank", "attempt", "last_step", "last_step_end_wall_ns", "last_heartbeat_wall_ns", "last_seen_wall_ns",
        ).head(20).iter_rows()),
    )]
    term = events.filter(pl.col("kind").is_in(_TERMINAL))
    if term.height:
        evidence.append(Evidence(
            source="events", summary="terminal events in time order",
            columns=("rank", "wall_ns", "kind", "signal", "exit_code", "exc_type"),
            rows=tuple(term.select("rank", "wall_ns", "kind", "signal", "exit_code", "exc_type").head(20).iter_rows()),
        ))
    opened = frames.open_collectives
    if opened.height:
        evidence.append(Evidence(
            source="open_collectives", summary="collectives ranks were inside when the telemetry ended",
            columns=("rank", "step", "op", "group", "group_seq", "enter_wall_ns"),
            rows=tuple(opened.sort("enter_wall_ns").select("rank", "step", "op", "group", "group_seq", "enter_wall_ns")
                       .head(20).iter_rows()),
        ))
    summary = f"the job stopped in step {onset} on all {len(ranks)} ranks: {how}"
    return Incident(
        klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=ranks, onset_step=onset,
        detection_step=onset, confidence=config.job_confidence, cause=cause, summary=summary,
        detection_wall_ns=int(live["last_seen_wall_ns"].max()) if live["last_seen_wall_ns"].max() is not None else None,  # type: ignore[arg-type]
        fields=(str(cause),), evidence=tuple(evidence), attempt=attempt if attempt is not None else (
            int(live["attempt"].max()) if live["attempt"].max() is not None else None),  # type: ignore[arg-type]
    )


def _saved(frames: Frames, rank: int, step: int, after_ns: int | None) -> bool:
    """Whether this rank finished writing its checkpoint of `step` (its own fsync ok, after `after_ns`: this
    incarnation's). A checkpoint's step is the last step whose update it holds, so the rank had completed that step
    whatever its step rows say: a process that ends abruptly (`os._exit`, SIGKILL) loses its last flush interval of
    rows, and the row of a step that ends in a save is written after the save."""
    ck = frames.checkpoints.filter((pl.col("rank") == rank) & (pl.col("step") == step)
                                   & (pl.col("phase") == str(CheckpointPhase.FSYNC)) & pl.col("ok").fill_null(False))
    if after_ns is not None:
        ck = ck.filter(pl.col("end_wall_ns") >= after_ns)
    return ck.height > 0


def _incident(frames: Frames, rank: int, method: str, confidence: float, events: pl.DataFrame,
              errors: pl.DataFrame, blocked: pl.DataFrame, stall: int, block: int, silent: set[int],
              stop: int | None = None) -> Incident:
    """The culprit's incident. `stop`: when the launcher stopped every rank (`_launcher_stop`); the rank's own end
    after it was the launcher's doing, not how it stopped (a hung rank SIGTERMed is still a hang)."""
    row = frames.liveness.filter(pl.col("rank") == rank)
    liv = row.row(0, named=True) if row.height else {}
    last_step = liv.get("last_step")
    last_step = int(last_step) if last_step is not None else -1
    if _saved(frames, rank, last_step + 1, liv.get("last_step_end_wall_ns")):
        last_step += 1
    step_end = liv.get("last_step_end_wall_ns")
    heartbeat = liv.get("last_heartbeat_wall_ns")
    own = events.filter(pl.col("rank") == rank)
    own_terminal = own.filter(pl.col("kind").is_in(_TERMINAL))
    if stop is not None:
        own_terminal = own_terminal.filter(pl.col("wall_ns") < stop)
    own_blocked = blocked.filter(pl.col("rank") == rank)
    reactions = [
        errors.filter(pl.col("rank") != rank)["exit_wall_ns"].min(),
        events.filter((pl.col("rank") != rank) & (pl.col("kind") == str(EventKind.EXCEPTION)))["wall_ns"].min(),
    ]
    first_reaction = _earliest(*reactions)
    own_t = _earliest(own_terminal["wall_ns"].min())
    hb = frames.heartbeat_interval_ns
    alive_after = (heartbeat - step_end) if heartbeat is not None and step_end is not None else None
    # alive = not silent (heard from about as late as most of the job) and beating well past its last step
    alive = alive_after is not None and alive_after > max(1.5 * hb, block) and rank not in silent
    # its own event right after its last step is how it stopped; one long after (a launcher's SIGTERM) is not
    prompt = own_t is not None and (step_end is None or own_t <= step_end + stall)
    first = own_t is not None and (first_reaction is None or own_t <= first_reaction)
    if method == "own transport":
        klass, cause = IncidentClass.FAIL_STOP, Cause.NETWORK
        how = "its own end of the network failed" + _event_detail(own_terminal)
    elif prompt or (first and not alive):
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
    kinds = own_terminal
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
