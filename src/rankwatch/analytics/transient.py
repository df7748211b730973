"""Transient stalls: a rank that froze for a long time and then carried on.

A rank stopped by SIGSTOP and continued, a host thread blocked on a page fault storm or a hung NFS read that
returned, a GPU that hung for seconds and recovered: one step of that rank takes many times the usual step, its
peers wait the same time inside a collective with it, and then the job goes on. It is no straggler (one step, no
persistence) and no fail-stop or hang (the rank came back and the run finished). It is still worth knowing — who,
when, for how long, and where the peers waited — because it recurs, it costs the whole job its duration, and a
longer one would have hit the process-group timeout.

A step s of rank r is a stall when its own time (compute plus dataloader wait on the CPU clock; device compute less
the step's checkpoint time on the device clock, where a GPU idling through the host's save counts as the step's
device time) exceeds the median own time of the other ranks at the same step by at least `min_heartbeats` heartbeat
intervals and at least `step_factor` times the run's median own time, while most of those ranks spent at least
`wait_share` of that excess waiting in collectives (the others waited for r). The excess over the peers at the same step, not the ratio, is what counts: a freeze during a step
every rank also spends seconds in (a checkpoint, a job-wide pause) is still the frozen rank's, and a pause every
rank shares is nobody's. Consecutive stalled steps of one rank are one incident. A rank whose last step is the
stall is left to the fail-stop and hang detector (it may not have come back).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind

__all__ = ["TransientConfig", "detect_transient_stalls"]

_R, _S = "rank", "step"


@dataclass(frozen=True, kw_only=True, slots=True)
class TransientConfig:
    """Thresholds of the transient-stall detector."""

    min_heartbeats: float = 3.0
    """A stalled step's own time exceeds its peers' at the same step by at least this many heartbeat intervals
    (seconds-long, not a slow step) ..."""
    step_factor: float = 10.0
    """... and by at least this many times the run's median own time per step (a benign very slow step takes 2-4
    times the usual; a freeze of 15 s in a job of 0.9 s steps is 17 steps long)."""
    wait_share: float = 0.5
    """Most other ranks waited in collectives for at least this share of the stalled rank's excess."""

    def __post_init__(self) -> None:
        for name in ("min_heartbeats", "step_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransientConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.wait_share <= 1.0:
            raise ValueError(f"TransientConfig.wait_share must be in (0, 1], got {self.wait_share}")


def detect_transient_stalls(frames: Frames, config: TransientConfig = TransientConfig()) -> tuple[Incident, ...]:
    """HANG incidents with cause TRANSIENT_STALL, one per stalled rank and episode, for ranks that carried on."""
    steps = frames.steps
    if steps.height == 0 or frames.world_size < 2:
        return ()
    device = frames.clock is Clock.DEVICE
    own = pl.col("compute_ns").cast(pl.Float64)
    if device:
        own = (own - pl.col("checkpoint_ns").fill_null(0).cast(pl.Float64)).clip(lower_bound=0.0)
    else:
        own = own + pl.col("dataloader_wait_ns").fill_null(0).cast(pl.Float64)
    t = steps.filter(pl.col("compute_ns").is_not_null()).select(
        _R, _S, "end_wall_ns", own.alias("own"), pl.col("collective_wait_ns").fill_null(0).cast(pl.Float64).alias("wait"))
    if t.height == 0:
        return ()
    median_own = float(t.get_column("own").median() or 0.0)  # type: ignore[arg-type]
    floor = max(config.min_heartbeats * frames.heartbeat_interval_ns, config.step_factor * median_own)
    cand = t.filter(pl.col("own") >= floor)
    if cand.height == 0:
        return ()
    last = t.group_by(_R).agg(pl.col(_S).max().alias("last"))
    incidents: list[Incident] = []
    stalls: list[tuple[int, int, float, float, float, int]] = []
    seen_step, at_step = None, t.clear()
    for rank, step, own_ns in cand.sort(_S).select(_R, _S, "own").iter_rows():
        if step != seen_step:  # one read of each candidate step (a job-wide pause makes every rank a candidate)
            seen_step, at_step = step, t.filter(pl.col(_S) == step)
        peers = at_step.filter(pl.col(_R) != rank)
        if peers.height == 0:
            continue
        peer_own = float(peers.get_column("own").median() or 0.0)  # type: ignore[arg-type]
        excess = own_ns - peer_own
        if excess < floor:
            continue
        waited = peers.filter(pl.col("wait") >= config.wait_share * excess)
        if waited.height * 2 <= peers.height:
            continue
        rank_last = int(last.filter(pl.col(_R) == rank).get_column("last")[0])
        if rank_last <= step:
            continue  # no step after it: it may not have come back (the fail-stop and hang detector's case)
        stalls.append((int(rank), int(step), own_ns, peer_own, float(waited.get_column("wait").median() or 0.0),  # type: ignore[arg-type]
                       waited.height))
    by_rank: dict[int, list[tuple[int, int, float, float, float, int]]] = {}
    for s in stalls:
        by_rank.setdefault(s[0], []).append(s)
    for rank, rows in sorted(by_rank.items()):
        rows.sort(key=lambda r: r[1])
        episode = [rows[0]]
        for row in rows[1:]:
            if row[1] == episode[-1][1] + 1:
                episode.append(row)
                continue
            incidents.append(_incident(frames, rank, episode, device))
            episode = [row]
        incidents.append(_incident(frames, rank, episode, device))
    return tuple(incidents)


def _incident(frames: Frames, rank: int, episode: list[tuple[int, int, float, float, float, int]],
              device: bool) -> Incident:
    first, end = episode[0][1], episode[-1][1]
    stalled = sum(r[2] - r[3] for r in episode) / 1e9
    waited = sum(r[4] for r in episode) / 1e9
    peers = min(r[5] for r in episode)
    where = f"step {first}" if first == end else f"steps {first}..{end}"
    wall = frames.steps.filter((pl.col(_R) == rank) & (pl.col(_S) == end)).get_column("end_wall_ns")
    clock = "device" if device else "CPU"
    summary = (f"rank {rank} stalled for {stalled:.1f} s at {where} and then carried on: a transient hang; "
               f"{peers} peers waited {waited:.1f} s in collectives for it ({clock} clock)")
    evidence = (Evidence(
        source="steps",
        summary=f"the stalled rank's own time against its peers' median, and the peers' median collective wait",
        columns=("rank", "step", "own_ns", "peer_median_own_ns", "peer_median_wait_ns", "peers_waiting"),
        rows=tuple((rank, s, int(o), int(p), int(w), n) for _, s, o, p, w, n in episode[:20]),
    ),)
    return Incident(
        klass=IncidentClass.HANG, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
        onset_step=first, detection_step=end, confidence=0.9, cause=Cause.TRANSIENT_STALL, summary=summary,
        detection_wall_ns=int(wall[0]) if len(wall) and wall[0] is not None else None,
        fields=("device_compute_ns" if device else "compute_ns", "collective_wait_ns"), evidence=evidence,
    )
