"""Rank stragglers (episodes of a rank's excess, merged), a host whose ranks wait for data, and checkpoint I/O
stragglers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.straggler.config import (
    StragglerConfig, _HW, _LAST_ARRIVALS, _LATE_NS, _POWER, _R, _S, _THERMAL,
)
from rankwatch.analytics.straggler.excess import _binom_tail, _noise
from rankwatch.base.schema import SLOWDOWN_REASONS, Gpu, Steps, Topology


@dataclass(frozen=True, kw_only=True, slots=True)
class _Episode:
    onset: int
    detection: int
    end: int


def _episodes(steps: np.ndarray, x: np.ndarray, cusum: np.ndarray, fire: np.ndarray,
              config: StragglerConfig) -> list[_Episode]:
    out: list[_Episode] = []
    i, n = 0, len(steps)
    while i < n:
        hits = np.flatnonzero(fire[i:])
        if not len(hits):
            break
        d = i + int(hits[0])
        zeros = np.flatnonzero(cusum[: d + 1] <= 0)
        o = int(zeros[-1]) + 1 if len(zeros) else 0
        # The large-slowdown rule can fire before the CUSUM had a chance to leave zero: start at the run.
        o = min(o, d - config.burst_window + 1) if x[d] > config.burst_excess else o
        # The recurrence rule fires on short bursts the CUSUM may not hold: start at the window's first burst step.
        lo = max(i, d - config.recur_window + 1)
        big = np.flatnonzero(x[lo: d + 1] > config.burst_excess)
        if len(big) >= config.recur_count:
            o = min(o, lo + int(big[0]))
        o = min(max(o, i), d)
        while o < d and x[o] <= config.sustain_excess:
            o += 1
        e, quiet = d, 0
        j = d + 1
        while j < n and quiet < config.episode_gap:
            if x[j] > config.sustain_excess:
                e, quiet = j, 0
            else:
                quiet += 1
            j += 1
        out.append(_Episode(onset=int(steps[o]), detection=int(steps[d]), end=int(steps[e])))
        i = e + 1
    return out


def _merge(episodes: list[_Episode], gap: int, steps: np.ndarray, x: np.ndarray,
           level: float) -> list[list[_Episode]]:
    """Episodes grouped into incidents: the next one joins when it starts at most `gap` steps after the last ended
    (intermittent bursts), or when the rank never came back to its own speed in between (the median excess of the
    steps between them is above `level`): a slowdown whose per-step excess is heavy-tailed dips below the sustain
    level for a few steps now and then, which ends an episode, while the rank stays slow; that is one fault."""
    merged: list[list[_Episode]] = []
    for ep in episodes:
        if merged:
            end = merged[-1][-1].end
            between = x[(steps > end) & (steps < ep.onset)]
            if ep.onset - end <= gap or (len(between) and float(np.median(between)) > level):
                merged[-1].append(ep)
                continue
        merged.append([ep])
    return merged


def _rank_incidents(frames: Frames, table: pl.DataFrame, config: StragglerConfig, *,
                    skew_found: bool) -> list[Incident]:
    cand = table.filter(pl.col("fire")).get_column(_R).unique().sort().to_list()
    if not cand:
        return []
    noise = _noise(table)
    sub = table.filter(pl.col(_R).is_in(cand))
    clock = _clock_table(frames, cand)
    late = frames.lateness.filter(pl.col(_R).is_in(cand))
    device = frames.clock is Clock.DEVICE
    host = frames.host.filter(pl.col(_R).is_in(cand)) if device else None
    # Base rate of elevated rank-steps over the whole job: under random per-step skew any rank is elevated now and
    # then, and a rank whose elevated steps are not significantly more than that rate is not a straggler.
    # The rate is the other ranks' (the rank under test left out): a straggler's own elevated steps would raise it
    # (in a 4-rank run, 20 slow steps of one rank are 40 % of the job's elevated rank-steps) and hide it as chance.
    elevated = int(table.get_column("_up").sum())
    n_rows = table.height
    n_ranks = int(table.get_column(_R).n_unique())
    out: list[Incident] = []
    for (rank,), rows in sub.group_by(_R, maintain_order=True):
        rows = rows.sort(_S)
        steps = rows.get_column(_S).to_numpy()
        x = rows.get_column("x").to_numpy()
        k = int(rows.get_column("_up").sum())
        base_rate = (elevated - k) / (n_rows - len(x)) if n_rows > len(x) else 0.0
        if _binom_tail(k, len(x), base_rate) > config.chance_alpha / max(n_ranks, 1):
            continue
        eps = _episodes(steps, x, rows.get_column("cusum").to_numpy(), rows.get_column("fire").to_numpy(), config)
        for group in _merge(eps, config.merge_gap, steps, x, config.sustain_excess / 2):
            longest = max(int(np.sum((steps >= e.onset) & (steps <= e.end))) for e in group)
            # Random per-step skew makes short runs of "slow" steps by chance; only sustained runs stand then.
            if skew_found and longest < config.sustain_window:
                continue
            out.append(_rank_incident(int(rank), group, rows, clock, late, noise, config, device=device, host=host))
    return out


def _clock_table(frames: Frames, ranks: list[int]) -> pl.DataFrame:
    """GPU rows of `ranks` with their clock relative to max and the job's median of that at the same step."""
    gpu = frames.gpu
    if gpu.height == 0:
        return gpu.with_columns(pl.lit(None, pl.Float64).alias("rel"), pl.lit(None, pl.Float64).alias("med_rel"))
    rel = (pl.col(Gpu.SM_CLOCK_MHZ.value) / pl.col(Gpu.SM_CLOCK_MAX_MHZ.value)).alias("rel")
    gpu = gpu.with_columns(rel)
    # Where few GPUs were sampled at a step (samplers tick in seconds, steps can be milliseconds), the job-wide
    # median stands in for that step's.
    overall = gpu.get_column("rel").median()
    med = gpu.group_by(_S).agg(pl.col("rel").median().alias("_m"), pl.len().alias("_n")).with_columns(
        pl.when(pl.col("_n") >= 3).then(pl.col("_m")).otherwise(pl.lit(overall, pl.Float64)).alias("med_rel")
    ).drop("_m", "_n")
    return gpu.filter(pl.col(_R).is_in(ranks)).join(med, on=_S, how="left")


def _episode_mask(col: pl.Expr, group: list[_Episode]) -> pl.Expr:
    m = pl.lit(False)
    for e in group:
        m = m | col.is_between(e.onset, e.end)
    return m


def _rank_incident(rank: int, group: list[_Episode], rows: pl.DataFrame, clock: pl.DataFrame, late: pl.DataFrame,
                   noise: float, config: StragglerConfig, *, device: bool = False,
                   host: pl.DataFrame | None = None) -> Incident:
    first = group[0]
    mask = _episode_mask(pl.col(_S), group)
    ep = rows.filter(mask)
    slow = ep.filter(pl.col("x") > config.sustain_excess)
    slow = slow if slow.height else ep
    effect = float(slow.get_column("x_raw").median())  # type: ignore[arg-type]
    ex_own = float((slow["own"] - slow["med_own"]).sum())
    ex_dl = float((slow["dl"] - slow["med_dl"]).sum())
    cause, cause_note, gpu_ev = Cause.UNKNOWN, "", None
    if ex_own > 0 and ex_dl >= config.cause_share * ex_own:
        cause, cause_note = Cause.DATALOADER, f"dataloader wait explains {ex_dl / ex_own:.0%} of the excess"
    else:
        cause, cause_note, gpu_ev = _throttle_cause(rank, slow.get_column(_S), clock, config)
    host_ev = None
    if cause is Cause.UNKNOWN and device:
        cause, cause_note, host_ev = _host_or_device(rank, slow, host, ex_own - ex_dl, config)
    det_wall = rows.filter(pl.col(_S) == first.detection).get_column(Steps.END_WALL_NS.value)
    bursts = len(group)
    span = f"steps {first.onset}..{group[-1].end}"
    shape = f"in {bursts} bursts ({span})" if bursts > 1 else f"from step {first.onset} ({span})"
    what = "its own device work takes" if device else "computes"
    summary = (f"rank {rank} {what} {effect:.1%} slower than its median {rows['peer'][0]} peer {shape}; "
               f"detected at step {first.detection}; cause {cause}" + (f": {cause_note}" if cause_note else ""))
    persistence = min(1.0, slow.height / 10)
    confidence = 0.5 + 0.49 * math.tanh(effect / (4 * noise)) * persistence
    comp_col = "device_compute_ns" if device else "compute_ns"
    evidence = [Evidence(
        source="steps",
        summary=f"own time ({'device compute' if device else 'compute'} + dataloader wait) against the median of the "
                f"role peers; excess {effect:.1%} median over {slow.height} slow steps, noise {noise:.2%} per step",
        columns=("rank", "step", comp_col, "dataloader_wait_ns", "peer_median_ns", "ratio"),
        rows=tuple((rank, int(s), int(c), int(d), int(m), round(1 + float(xx), 4)) for s, c, d, m, xx in
                   slow.select(_S, "comp_raw", "dl", "med_own", "x_raw").head(20).iter_rows()),
    )]
    if gpu_ev is not None:
        evidence.append(gpu_ev)
    if host_ev is not None:
        evidence.append(host_ev)
    lt = late.filter(pl.col(_R) == rank).filter(mask)
    if lt.height:
        arrivals = int(lt.get_column(_LAST_ARRIVALS).fill_null(0).sum())
        evidence.append(Evidence(
            source="lateness",
            summary=f"rank {rank} arrived last to {arrivals} collectives during the episode (corroboration)",
            columns=("rank", "step", "late_ns", "last_arrivals"),
            rows=tuple((rank, int(s), int(a or 0), int(b or 0)) for s, a, b in
                       lt.sort(_S).select(_S, _LATE_NS, _LAST_ARRIVALS).head(20).iter_rows()),
        ))
    return Incident(
        klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
        onset_step=first.onset, detection_step=first.detection, confidence=min(confidence, 1.0), cause=cause,
        summary=summary, detection_wall_ns=int(det_wall[0]) if len(det_wall) and det_wall[0] is not None else None,
        fields=(comp_col, "dataloader_wait_ns") if cause is Cause.DATALOADER else (comp_col,),
        evidence=tuple(evidence),
    )


def _host_or_device(rank: int, slow: pl.DataFrame, host: pl.DataFrame | None, excess_ns: float,
                    config: StragglerConfig) -> tuple[Cause, str, Evidence | None]:
    """On the device clock, whether a slow rank's excess device time is its host thread's (the GPU waited for the
    host: the CPU phases of the rank ran longer than its peers' by at least `cause_share` of the excess) or the
    device's own (they did not). Without phase rows the two cannot be told apart: UNKNOWN, saying so."""
    if host is None or host.height == 0:
        return Cause.UNKNOWN, "no phase rows to tell a stalled host from a slow device", None
    h = host.filter((pl.col(_R) == rank) & pl.col(_S).is_in(slow.get_column(_S).implode()))
    if h.height == 0:
        return Cause.UNKNOWN, "no phase rows for the slow steps to tell a stalled host from a slow device", None
    host_ns = float(h.get_column("host_excess_ns").fill_null(0).sum()) * slow.height / h.height
    share = host_ns / excess_ns if excess_ns > 0 else 0.0
    ev = Evidence(
        source="phases",
        summary=f"host-thread time in the phases beyond the stage peers' (CPU clock) against the excess device time: "
                f"{share:.0%} of it",
        columns=("rank", "step", "host_excess_ns"),
        rows=tuple((rank, int(s), int(v or 0)) for s, v in h.sort(_S).select(_S, "host_excess_ns").head(20).iter_rows()),
    )
    if share >= config.cause_share:
        return Cause.HOST_STALL, f"its host thread explains {share:.0%} of the excess (the GPU waited for it)", ev
    return Cause.DEVICE_SLOW, f"its host thread explains only {share:.0%} of the excess: the device itself is slower", ev


def _throttle_cause(rank: int, slow_steps: pl.Series, clock: pl.DataFrame,
                    config: StragglerConfig) -> tuple[Cause, str, Evidence | None]:
    g = clock.filter((pl.col(_R) == rank) & pl.col(_S).is_in(slow_steps.implode()))
    if g.height == 0:
        return Cause.UNKNOWN, "", None
    bits = g.get_column(Gpu.THROTTLE_REASONS.value).fill_null(0)
    flagged = g.filter((bits & int(SLOWDOWN_REASONS)) != 0)
    if flagged.height < config.throttle_share * g.height:
        return Cause.UNKNOWN, "", None
    rel, med = flagged.get_column("rel"), flagged.get_column("med_rel")
    drop = float((med - rel).median()) if rel.null_count() < rel.len() and med.null_count() < med.len() else None  # type: ignore[arg-type]
    if drop is not None and not drop >= config.clock_drop:
        return Cause.UNKNOWN, "", None
    fb = flagged.get_column(Gpu.THROTTLE_REASONS.value)
    counts = {Cause.THERMAL_THROTTLE: int(((fb & _THERMAL) != 0).sum()),
              Cause.POWER_THROTTLE: int(((fb & _POWER) != 0).sum()),
              Cause.HW_SLOWDOWN: int(((fb & _HW) != 0).sum())}
    cause = max(counts, key=lambda k: counts[k])
    note = (f"{flagged.height} of the {g.height} slow steps with a GPU sample ({slow_steps.len()} slow steps in all) "
            f"show {cause.value.replace('_', ' ')} bits")
    if drop is not None:
        note += f", SM clock {drop:.0%} of max below the job's median"
    ev = Evidence(
        source="gpu",
        summary=f"throttle reasons and SM clock of rank {rank} during its slow steps",
        columns=("rank", "step", "throttle_reasons", "sm_clock_mhz", "sm_clock_max_mhz"),
        rows=tuple((rank, int(s), int(b), _f(c), _f(m)) for s, b, c, m in flagged.sort(_S).select(
            _S, Gpu.THROTTLE_REASONS.value, Gpu.SM_CLOCK_MHZ.value, Gpu.SM_CLOCK_MAX_MHZ.value).head(20).iter_rows()),
    )
    return cause, note, ev


def _f(v: float | None) -> float | None:
    return None if v is None else round(float(v), 1)


def _group_hosts(frames: Frames, ranks: list[Incident], config: StragglerConfig) -> list[Incident]:
    """Replace the dataloader incidents of most ranks of one host by one HOST incident."""
    host_of = dict(zip(frames.topology[_R].to_list(), frames.topology[Topology.HOST.value].to_list(), strict=True))
    per_host: dict[str, list[Incident]] = {}
    for inc in ranks:
        host = host_of.get(inc.ranks[0])
        if inc.cause is Cause.DATALOADER and host is not None:
            per_host.setdefault(host, []).append(inc)
    out = list(ranks)
    for host, incs in sorted(per_host.items()):
        members = sorted(r for r, h in host_of.items() if h == host)
        if len(incs) < max(2, math.ceil(config.host_share * len(members))):
            continue
        for inc in incs:
            out.remove(inc)
        detections = sorted(i.detection_step for i in incs if i.detection_step is not None)
        need = max(2, math.ceil(config.host_share * len(members)))
        det = detections[min(need, len(detections)) - 1]
        det_inc = next(i for i in incs if i.detection_step == det)
        out.append(Incident(
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.HOST, id=host), ranks=tuple(members),
            onset_step=min(i.onset_step for i in incs if i.onset_step is not None), detection_step=det,
            detection_wall_ns=det_inc.detection_wall_ns, confidence=max(i.confidence for i in incs),
            cause=Cause.DATALOADER,
            summary=f"host {host}: {len(incs)} of its {len(members)} ranks wait on the dataloader longer than "
                    f"their peers (ranks {', '.join(str(i.ranks[0]) for i in incs)}): its input pipeline is slow",
            fields=("dataloader_wait_ns",),
            evidence=tuple(e for i in incs[:3] for e in i.evidence[:1]),
        ))
    return out


def _checkpoint_stragglers(frames: Frames, table: pl.DataFrame, config: StragglerConfig, *,
                           already: set[int]) -> list[Incident]:
    """Ranks whose own checkpoint time, on steps where their peers checkpoint too, is well above the peers'."""
    ck = table.filter(pl.col("ck") > 0)
    if ck.height == 0:
        return []
    med = ck.group_by("peer", _S).agg(pl.col("ck").median().alias("med_ck"), pl.len().alias("writers"))
    ck = ck.join(med, on=["peer", _S]).filter(pl.col("writers") >= config.min_peers).with_columns(
        ((pl.col("ck") > (1 + config.checkpoint_excess) * pl.col("med_ck"))
         & (pl.col("ck") - pl.col("med_ck") > config.checkpoint_min_share * (pl.col("med_own") + pl.col("med_ck"))))
        .alias("slow_ck")
    )
    n_ck = ck.get_column(_S).n_unique()
    need = config.checkpoint_count  # one slow save is one draw of the storage's noise, however few the run made
    slow = ck.filter(pl.col("slow_ck") & ~pl.col(_R).is_in(sorted(already)))
    out: list[Incident] = []
    for (rank,), rows in slow.group_by(_R, maintain_order=True):
        if rows.height < need or rows.height < 0.5 * ck.filter(pl.col(_R) == rank).height:
            continue
        rows = rows.sort(_S)
        det_row = rows.row(need - 1, named=True)
        ratio = float((rows["ck"] / rows["med_ck"]).median())  # type: ignore[arg-type]
        out.append(Incident(
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(int(rank),),
            onset_step=int(rows[_S][0]), detection_step=int(det_row[_S]),
            detection_wall_ns=det_row[Steps.END_WALL_NS.value], confidence=min(0.99, 0.6 + 0.1 * rows.height),
            cause=Cause.CHECKPOINT_IO,
            summary=f"rank {rank}: its own checkpoint takes {ratio:.1f}x its peers' in {rows.height} of {n_ck} "
                    "checkpoints",
            fields=("checkpoint_ns",),
            evidence=(Evidence(
                source="steps", summary="checkpoint time against the median of the peers checkpointing at that step",
                columns=("rank", "step", "checkpoint_ns", "peer_median_ns", "ratio"),
                rows=tuple((int(rank), int(s), int(c), int(m), round(float(c) / float(m), 3))
                           for s, c, m in rows.select(_S, "ck", "med_ck").head(20).iter_rows()),
            ),),
        ))
    return out
