"""What each incident cost the job, and the stragglers found by what they cost.

The straggler rules (`analytics.straggler`) test how persistent and how large a rank's excess is; a slowdown of
another shape (a process stopped from outside for a slice of every 100 ms: a small median excess and a heavy tail,
plus collectives held while it is stopped) can cost the job a lot and pass them. The what-if (`analytics.whatif`)
asks the question that matters instead: how much sooner would the job's steps have ended had this subject done its
work at its peers' pace? `costed` runs after the detectors:

* **Stragglers found by their cost.** A rank whose own work saves at least `CostConfig.min_share` of the replayed
  time more than the typical rank's does, or a host whose ranks together save that much more than the typical
  host's do (and no single one of them most of it), is a straggler incident whatever the shape of its slowness,
  with the saving as its evidence; when it surely does (the 95 % lower bound over resampled blocks of the window's
  steps, `_surely_above`: not a step or two of noise), unless an incident of the analysis already names it, or the
  window is too short to measure a rate (`min_steps`).
  Benign noise costs nothing: with a peer at the median pace, fixing one noisy rank leaves the next-slowest one
  (a few per cent of a 4-rank CPU run's time at most; `benchmarks/whatif_canary.py`).
* **An impact on every incident** (`incidents.Impact`): for timing incidents (a straggler rank, device, host, link,
  a stage, a replica, data skew, a transient stall) what making the subject ideal saves over the steps from its
  onset to the window's end: seconds, GPU-hours (the job's ranks all wait for it) and the share of the span's step
  time. A fail-stop, hang, divergence, corruption or failed save costs what its recovery costs (lost work, restart:
  `rankwatch goodput`), which no replay of the steps that ran measures: its impact says so (`UNMEASURED`), as does
  every incident where the window could not be replayed, with the reason.

The what-if reads the analysis' clock (`Frames.clock`): each rank's training thread, or on a device-timed run (a
CUDA job, where the CPU's times are enqueueing) each rank's device (`analytics.whatif`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import (
    Cause, Evidence, Impact, ImpactBasis, Incident, IncidentClass, Subject, SubjectKind, sort_incidents,
)
from rankwatch.analytics.whatif import Replayed, Share
from rankwatch.analytics.whatif.analysis import Spec

__all__ = ["CostConfig", "costed"]

_TIMING = frozenset({IncidentClass.STRAGGLER, IncidentClass.IMBALANCE})
_RESAMPLES = 1000
_ALL_RANKS = 256
"""Up to this many ranks, every rank's own work is costed (the typical rank's saving is their median); above, the
most excess ones (`CostConfig.rank_subjects`), whose median is higher: fewer costly ranks, never more."""
_RECOVERY = ("costs what its recovery costs (the work lost since the recovery point, detection, restart and "
             "restore: `rankwatch goodput RUN`), not step time")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostConfig:
    min_share: float = 0.03
    """A rank or host whose fix saves at least this share of the replayed time is a straggler by its cost. Below
    the 5 % a straggler must never pass unreported at; above what one rank's noise saves on a busy 2-core CPU run
    (at most ~1.5 %)."""
    max_ops: int = 20_000
    """The what-if replays at most this many collective operations (the latest steps that fit), with a warning: its
    replay is an event loop in Python (~1 us per program item, two replays per subject), so a 2,048-rank window
    is costed over its last steps only (`benchmarks/analysis_scale.py`)."""
    rank_subjects: int = 8
    """Ranks costed one by one: the most excess ones, and every rank an incident names."""
    min_steps: int = 20
    """A window of fewer replayed steps raises no straggler by its cost (its incidents still get an impact): a cost
    measured over a handful of steps is one draw of their noise (one spike of a heavy-tailed step is 5 % of 4 steps),
    not a rate."""

    def __post_init__(self) -> None:
        if not 0.0 < self.min_share < 1.0:
            raise ValueError(f"CostConfig.min_share {self.min_share}: must be in (0, 1)")
        if self.max_ops < 1 or self.rank_subjects < 1 or self.min_steps < 1:
            raise ValueError(f"CostConfig: max_ops {self.max_ops}, rank_subjects {self.rank_subjects} and min_steps "
                             f"{self.min_steps} must be >= 1")


def costed(frames: Frames, incidents: Sequence[Incident], replayed: Replayed | None, *,
           config: CostConfig = CostConfig(), why_not: str = "") -> tuple[Incident, ...]:
    """`incidents` with the stragglers found by their cost added and an impact on each (module docstring).
    `replayed`: the window's what-if (None: not replayed, `why_not` says why)."""
    if replayed is None:
        note = why_not or "the window was not replayed"
        return sort_incidents(i if i.impact is not None else replace(i, impact=_unmeasured(i, note)) for i in incidents)
    found = [*incidents, *_by_cost(frames, incidents, replayed, config)]
    return sort_incidents(replace(i, impact=m) for i, m in zip(found, _impacts(frames, found, replayed), strict=True))


def _unmeasured(incident: Incident, note: str) -> Impact:
    if incident.klass not in _TIMING:
        return Impact(basis=ImpactBasis.UNMEASURED, note=f"a {incident.klass} {_RECOVERY}")
    return Impact(basis=ImpactBasis.UNMEASURED, note=note)


def _covered(incidents: Sequence[Incident]) -> set[int]:
    """Ranks an incident already names (a rank found by its cost is not raised twice)."""
    return {r for i in incidents for r in i.ranks}


def _by_cost(frames: Frames, incidents: Sequence[Incident], replayed: Replayed,
             config: CostConfig) -> list[Incident]:
    """Ranks and hosts whose own work (compute, dataloader waits, lateness to see a collective done, and their part
    of one host's transfers) costs the set share: a slow checkpoint write is the checkpoint rule's
    (`straggler.ranks._checkpoint_stragglers`), with its own tail, and the time between steps is no step's."""
    w, c = replayed.whatif, replayed.costing
    if w.last_step - w.first_step + 1 < config.min_steps:
        return []
    named = _covered(incidents)
    every = sorted(c.graph.programs)
    ranks = every if len(every) <= _ALL_RANKS else [int(s.subject.split(":")[1]) for s in w.by_rank]
    hosts = sorted({h for h in c.host_of.values()}) if len({*c.host_of.values()}) > 1 else []
    members = {h: sorted(r for r, x in c.host_of.items() if x == h) for h in hosts}
    found, by_step = c.costs([c.rank_spec(f"rank:{r}", [r], own=True) for r in ranks]
                             + [c.rank_spec(f"host:{h}", members[h], own=True) for h in hosts])
    by_rank, by_host = found[:len(ranks)], found[len(ranks):]
    # fixing any one rank removes its part of the job's jitter (each step waits for the slowest): a rank is costly
    # when it saves more than the typical rank does, by the set share (4 CPU ranks on 2 cores: 2-4 % each), and
    # surely so (`_surely_above`: a cost made of a step or two is one draw of the machine's noise)
    usual = max(0.0, float(np.median([s.saved_share for s in by_rank]))) if by_rank else 0.0
    sure = _surely_above(by_step.step_ns, by_step.saved_ns[:, :len(ranks)])
    out: list[Incident] = []
    for rank, share, low in zip(ranks, by_rank, sure):
        if share.saved_share - usual < config.min_share or low < config.min_share or rank in named:
            continue
        out.append(_rank_straggler(frames, rank, share, replayed))
        named.add(rank)
    reported = {i.subject.id for i in incidents if i.subject.kind is SubjectKind.HOST}
    best = {r: s.saved_ns for r, s in zip(ranks, by_rank)}
    # fixing any host's ranks removes their share of the job's noise (each step waits for the slowest of them): a
    # host is costly when it saves more than the typical host does, by the set share, and surely so
    typical = float(np.median([s.saved_share for s in by_host])) if by_host else 0.0
    sure = _surely_above(by_step.step_ns, by_step.saved_ns[:, len(ranks):])
    for host, share, low in zip(hosts, by_host, sure):
        mine = members[host]
        if (share.saved_share - max(0.0, typical) < config.min_share or low < config.min_share or host in reported
                or set(mine) <= named or max((best.get(r, 0.0) for r in mine), default=0.0) >= 0.5 * share.saved_ns):
            continue
        out.append(Incident(
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.HOST, id=host), ranks=tuple(mine),
            onset_step=w.first_step, detection_step=w.last_step, confidence=_confidence(share.saved_share),
            cause=Cause.UNKNOWN, attempt=w.attempt,
            summary=(f"host {host} cost the job {share.saved_share:.1%} of its step time over steps {w.first_step}.."
                     f"{w.last_step} (its {len(mine)} ranks together, {typical:.1%} for the typical host; none of "
                     "them alone most of it)"),
            evidence=(_share_evidence(sorted(by_host, key=lambda s: -s.saved_ns), "hosts' own work"),)))
    return out


def _surely_above(step_ns: np.ndarray, saved_ns: np.ndarray) -> np.ndarray:
    """For each subject (a column of `saved_ns`, what fixing it saved in each step), the one-sided 95 % lower bound
    of its share of the step time above the typical (median) subject's: a circular block bootstrap over the
    window's steps (Politis and Romano, 1992; blocks of about S^(1/3) steps keep the steps' correlation: a rank's late
    work shows in the next step), both measured on the same resampled steps. At least `CostConfig.min_share`: the
    subject surely costs that much more than the typical one, over the window, not in a step or two (a process
    descheduled twice on a busy machine: one draw of its noise), which a ratio of sums cannot tell apart. Seeded:
    the same run, the same answer."""
    steps, subjects = saved_ns.shape
    if subjects == 0 or steps == 0:
        return np.zeros(subjects)
    block = max(1, round(steps ** (1 / 3)))
    starts = np.random.default_rng(0).integers(0, steps, size=(_RESAMPLES, -(-steps // block)))
    rows = ((starts[:, :, None] + np.arange(block)) % steps).reshape(_RESAMPLES, -1)[:, :steps]
    counts = np.zeros((_RESAMPLES, steps))
    np.add.at(counts, (np.repeat(np.arange(_RESAMPLES), steps), rows.ravel()), 1.0)
    share = (counts @ saved_ns) / np.maximum(counts @ step_ns, 1.0)[:, None]
    return np.quantile(share - np.median(share, axis=1, keepdims=True), 0.05, axis=0)


def _confidence(share: float) -> float:
    """0.6 at the threshold's 3 %, 0.95 from 10 %: what a replay shows is sure; how much, less so when small."""
    return float(min(0.95, 0.45 + 5.0 * share))


def _own(frames: Frames) -> pl.DataFrame:
    """Each rank's own time per step (compute + dataloader wait) over its role peers' median: (rank, step, ratio)."""
    role = frames.topology.select("rank", "role") if frames.topology.height else pl.DataFrame(
        {"rank": frames.steps["rank"].unique(), "role": None}, schema={"rank": pl.Int32, "role": pl.String})
    own = (frames.steps.select("rank", "step", (pl.col("compute_ns").fill_null(0)
                                                 + pl.col("dataloader_wait_ns").fill_null(0)).alias("own"))
           .join(role, on="rank", how="left"))
    return own.with_columns((pl.col("own") / pl.col("own").median().over("role", "step")).alias("ratio"))


def _rank_straggler(frames: Frames, rank: int, share: Share, replayed: Replayed) -> Incident:
    w = replayed.whatif
    mine = (_own(frames).filter((pl.col("rank") == rank) & pl.col("step").is_between(w.first_step, w.last_step))
            .sort("step"))
    ratios = mine["ratio"].fill_null(1.0).to_numpy()
    steps = mine["step"].to_list()
    excess = ratios - 1.0
    if len(excess):
        p90 = float(np.quantile(excess, 0.9))
        onset = next((int(s) for s, x in zip(steps, excess) if x > 0.5 * p90 > 0), w.first_step)
        median, above = float(np.median(excess)), int((excess > 0.05).sum())
        shape = (f"its own work {median:+.1%} over its peers' median in the median step, {p90:+.1%} at the 90th "
                 f"percentile, above them by more than 5 % in {above} of {len(excess)} steps")
    else:
        onset, shape = w.first_step, "no step rows of its own in the window"
    last = w.last_rank
    most = (f"; the rank with the most own work over its peers in {last[1]:.0%} of steps"
            if last is not None and last[0] == rank else "")
    kinds = [s for s in w.by_kind if s.saved_share > 0]
    cause = Cause.DATALOADER if kinds and kinds[0].subject == "kind:dataloader" else Cause.UNKNOWN
    rows = tuple((rank, int(s), round(float(x), 4)) for s, x in zip(steps, excess) if x > 0.05)
    return Incident(
        klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
        onset_step=onset, detection_step=w.last_step, confidence=_confidence(share.saved_share), cause=cause,
        attempt=w.attempt,
        summary=(f"rank {rank} cost the job {share.saved_share:.1%} of its step time over steps {w.first_step}.."
                 f"{w.last_step} (S_{rank} = {share.slowdown:.3f}): {shape}{most}"),
        evidence=(_share_evidence((share,), "rank's own work"),
                  Evidence(source="steps", summary=f"steps where rank {rank}'s own work exceeded its peers' by > 5 %",
                           columns=("rank", "step", "excess"), rows=rows)))


def _share_evidence(shares: Sequence[Share], what: str) -> Evidence:
    return Evidence(source="whatif", summary=f"what making each of the {what} ideal saves the job (what-if replay)",
                    columns=("subject", "slowdown", "saved_ms", "saved_share"),
                    rows=tuple((s.subject, round(s.slowdown, 4), round(s.saved_ns / 1e6, 3), round(s.saved_share, 4))
                               for s in shares[:8]))


def _impacts(frames: Frames, incidents: Sequence[Incident], replayed: Replayed) -> list[Impact]:
    """Each incident's impact; the subjects a replay measures are replayed together (`Costing.costs`), and what
    fixing one saves is summed over its span's steps (from its onset: what fixing it saves before is the window's
    jitter, not its cost)."""
    w, c = replayed.whatif, replayed.costing
    out: list[Impact | None] = [None] * len(incidents)
    specs: list[tuple[int, Spec, int]] = []  # (incident's index, what to fix, first step)
    for n, incident in enumerate(incidents):
        if incident.klass not in _TIMING:
            out[n] = Impact(basis=ImpactBasis.UNMEASURED, note=f"a {incident.klass} {_RECOVERY}")
            continue
        first = w.first_step if incident.onset_step is None else max(incident.onset_step, w.first_step)
        if first > w.last_step:
            out[n] = Impact(basis=ImpactBasis.UNMEASURED, note=(
                f"began at step {incident.onset_step}, after the replayed steps {w.first_step}..{w.last_step}"))
            continue
        kind = incident.subject.kind
        if incident.cause is Cause.DATA_SKEW or (kind is SubjectKind.JOB and incident.klass is IncidentClass.IMBALANCE):
            specs.append((n, c.own_spec("job"), first))
        elif kind is SubjectKind.STAGE and w.stage_partition is not None and incident.klass is IncidentClass.IMBALANCE:
            # a re-partitioning what-if over the whole window (`analysis._stage_partition`): no step of its own
            out[n] = _measured(incident, w.stage_partition, w.stage_partition.saved_ns, first, replayed)
        elif kind is SubjectKind.LINK:
            links = {x.strip() for x in incident.subject.id.split("|")}
            groups = {str(g["group"]) for g in frames.groups.iter_rows(named=True) if links & set(g["links"] or [])}
            if not groups:
                out[n] = Impact(basis=ImpactBasis.UNMEASURED, note=f"no group of the run crosses {incident.subject.id}")
                continue
            specs.append((n, c.group_spec(str(incident.subject), groups), first))
        else:
            ranks = [r for r in incident.ranks if r in c.graph.programs]
            if not ranks:
                out[n] = Impact(basis=ImpactBasis.UNMEASURED,
                                note=f"ranks {list(incident.ranks)} have no steps in the replayed window")
                continue
            if all(r in c.alone for r in ranks):
                out[n] = Impact(basis=ImpactBasis.UNMEASURED, note=_alone(ranks, c.stage_of))
                continue
            specs.append((n, c.rank_spec(str(incident.subject), ranks), first))
    if specs:
        shares, by_step = c.costs([spec for _, spec, _ in specs])
        steps = np.array(by_step.steps)
        for k, ((n, _, first), share) in enumerate(zip(specs, shares)):
            lost = float(by_step.saved_ns[steps >= first, k].sum())
            out[n] = _measured(incidents[n], share, lost, first, replayed)
    return [x for x in out if x is not None]


def _alone(ranks: Sequence[int], stage_of: dict[int, int]) -> str:
    """Why a rank with no peer has no measured cost."""
    which = ", ".join(f"rank {r} is stage {stage_of[r]}'s only rank" for r in ranks)
    return (f"{which}: no peer does the same work, so its ideal is unknown and what fixing it saves is not measured "
            "(a pipeline of one replica without tensor parallelism; its stage's share is the stage imbalance's "
            "re-partitioning what-if)")


def _measured(incident: Incident, share: Share, lost_ns: float, first: int, replayed: Replayed) -> Impact:
    w = replayed.whatif
    span = replayed.costing.span_ns(first, w.last_step)
    lost = max(0.0, lost_ns)
    note = "" if incident.onset_step is None or incident.onset_step >= w.first_step else (
        f"began at step {incident.onset_step}, before the replayed steps: measured from step {w.first_step}")
    return Impact(basis=ImpactBasis.WHATIF, lost_s=lost / 1e9, gpu_hours=lost / 1e9 * w.ranks / 3600.0,
                  share=lost / span if span > 0 else 0.0, slowdown=share.slowdown, first_step=first,
                  last_step=w.last_step, note=note)
