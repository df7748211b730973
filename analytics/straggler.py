"""Stragglers and imbalance: who holds the others back, and whether it is a device fault or the job's design.

In a blocking collective everyone waits for the last rank to arrive, so the straggler is the rank with the
SHORTEST collective wait; collective time never identifies it. This detector looks at each rank's own work
instead (compute, which excludes collective, dataloader and checkpoint time, plus dataloader wait) and compares
it step by step with its role peers (same pipeline stage, which should do the same work):

    excess[r, s] = own_ns[r, s] / (median peer compute_ns + median peer dataloader_wait_ns at step s) - 1

so 0.10 means rank r was 10 % slower than its median peer at step s. On the device clock (`Frames.clock`, a CUDA
run) compute_ns is the device time of the rank's own work: the training thread's clock sees only enqueueing and a
wait at the sync point that is the same on every rank. There a slow rank's cause also says whether its host thread
held the device (its CPU phases ran longer than its peers': HOST_STALL) or the device itself was slower
(DEVICE_SLOW), unless throttle bits or dataloader wait explain it. A rank's slowdown score is the rolling
median of `excess` over the last `score_window` steps. Per-step noise (~1 %) and per-device spread (~0.5 %) make
single steps meaningless, so an incident needs persistence, tested two ways:

* subtle: a one-sided CUSUM of `excess - cusum_reference` (per-step contributions clipped so a few wild steps
  cannot fire it) reaches `cusum_threshold`, and at least `sustain_count` of the last `sustain_window` steps are
  above `sustain_excess` (down to `sustain_min` in a quiet run, noise at most nominal, where fewer such steps are
  already beyond chance at the job's own rate of elevated rank-steps). The CUSUM's reference sits between the
  benign spread (a device 2 % slow all run long) and the smallest fault worth reporting (5 %); its change point
  (the step after it last stood at 0) is the onset.
* large: every one of the last `burst_window` steps is above `burst_excess` (fast detection of big slowdowns).

Then the episode runs until `episode_gap` steps in a row are back to normal; episodes of one rank at most
`merge_gap` steps apart (intermittent bursts), or with the rank's median excess between them above half the sustain
level (it never came back to its own speed), merge into one incident. Subjects above the rank: a host whose
ranks are slow through dataloader wait (one HOST incident), an inter-host link whose crossing groups transfer
slower than the other groups of their kind (one LINK incident), a pipeline stage whose median compute exceeds the
other stages' (IMBALANCE, STAGE), and random per-step data skew between replicas, a different one late each step
(IMBALANCE, JOB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.collector.schema import SLOWDOWN_REASONS, Gpu, Steps, ThrottleReason, Topology

__all__ = ["StragglerConfig", "detect_stragglers"]

# Frame columns derived by analytics (frames.FRAME_SCHEMAS) rather than written by the collector.
_ROLE, _LATE_NS, _LAST_ARRIVALS = "role", "late_ns", "last_arrivals"
_GROUP, _KIND, _LINKS, _RANKS, _TRANSFER_NS = "group", "kind", "links", "ranks", "transfer_ns"
_R, _S = Steps.RANK.value, Steps.STEP.value

_THERMAL = int(ThrottleReason.SW_THERMAL_SLOWDOWN | ThrottleReason.HW_THERMAL_SLOWDOWN)
_POWER = int(ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN)
_HW = int(ThrottleReason.HW_SLOWDOWN)


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """Thresholds of the straggler and imbalance detector. Excess values are fractions (0.05 = 5 % slower)."""

    score_window: int = 9
    """Steps in the rolling median that is a rank's slowdown score (reported, and used for stage imbalance)."""
    cusum_reference: float = 0.035
    """Excess subtracted per step in the CUSUM: halfway between a benign 2 % slow device and a 5 % fault."""
    cusum_threshold: float = 0.06
    """CUSUM level that fires. With ~1 % per-step noise a 2 %-slow rank reaches it about once in 10^6 steps,
    while a 5 % slowdown reaches it in ~5 steps."""
    cusum_clip: float = 0.03
    """Per-step CUSUM contributions are clipped to +-this, so one wild step cannot fire it alone."""
    sustain_excess: float = 0.03
    """A step counts as elevated for the persistence test when its excess is above this."""
    sustain_window: int = 8
    """Steps looked back on for the persistence test of the subtle rule."""
    sustain_count: int = 6
    """Elevated steps needed among the last `sustain_window` (keeps random per-step skew from firing)."""
    sustain_min: int = 4
    """The fewest elevated steps among the last `sustain_window` the persistence test can ask for in a quiet run
    (see `_fire_table`; half the window)."""
    burst_excess: float = 0.15
    """Excess above which a step counts for the large-slowdown rule."""
    burst_window: int = 4
    """Consecutive steps above `burst_excess` that fire the large-slowdown rule."""
    recur_window: int = 20
    """Steps looked back on by the recurrence rule: intermittent bursts too short for the other rules ..."""
    recur_count: int = 4
    """... fire when at least this many of the last `recur_window` steps are above `burst_excess` (a >= 15 % step
    is a > 10-sigma event at nominal noise, so four in twenty do not happen by chance)."""
    episode_gap: int = 5
    """Consecutive normal steps (excess <= `sustain_excess`) that end an episode."""
    merge_gap: int = 64
    """Episodes of one rank at most this many steps apart are one incident (intermittent bursts)."""
    min_peers: int = 3
    """Roles with fewer ranks than this are compared with the whole job instead (a median of 2 is the mean)."""
    cause_share: float = 0.5
    """Share of a rank's excess that dataloader wait must explain for cause DATALOADER."""
    throttle_share: float = 0.5
    """Share of a slow episode's GPU rows that must carry a slowdown throttle bit for a throttle cause."""
    clock_drop: float = 0.03
    """The SM clock (relative to its max) must be this much below the peers' for a throttle cause."""
    host_share: float = 0.5
    """A host with at least this share (and at least 2) of its ranks slow through dataloader wait is one incident."""
    checkpoint_excess: float = 0.5
    """A rank's own checkpoint time counts as slow when it exceeds the peers' median checkpoint time by this share
    and the excess is at least `checkpoint_min_share` of the peers' median step."""
    checkpoint_min_share: float = 0.1
    """See `checkpoint_excess`."""
    checkpoint_count: int = 2
    """Slow checkpoints a rank needs for a CHECKPOINT_IO incident (fewer when the run has fewer checkpoints)."""
    link_excess: float = 0.25
    """A group's transfer time counts as slow when it exceeds the median of its kind's groups by this share."""
    link_window: int = 5
    """Rolling median window (steps) of a group's transfer-time ratio."""
    stage_excess: float = 0.07
    """A stage is imbalanced when its rolling median compute exceeds the other stages' by this share ..."""
    stage_rank_share: float = 0.8
    """... and at least this share of its ranks are above the other stages' median by half that amount."""
    replica_skew: float = 0.04
    """Data skew: at a median step the replicas' compute factors must lie at least this far from the median
    replica's on average (mean absolute deviation: 4 %; a healthy job's replicas agree within ~1 %, and unlike the
    late replica's lead it does not grow with the number of replicas) ..."""
    replica_skew_ratio: float = 3.0
    """... and by at least this many times the per-step noise of ranks within one replica, so a noisy job whose
    ranks jitter independently (a replica's median of them jitters less than each) never reads as skew."""
    min_steps: int = 10
    """Runs with fewer steps than this are not analyzed (too short to tell persistence from noise)."""
    chance_alpha: float = 1e-3
    """A rank's elevated steps must be this unlikely (Bonferroni over ranks) under the job's base rate of elevated
    rank-steps, or its episodes are chance (random per-step data skew hits every rank now and then)."""
    nominal_noise: float = 0.015
    """Per-step spread of the excess (1.4826 x MAD over all rank-steps) the excess thresholds above are stated for:
    a GPU job's step-to-step jitter. When a run is noisier (CPU ranks sharing cores: 20-40 %), every excess
    threshold scales by measured / nominal, so the rules keep the same false-alarm rate in units of its noise."""
    baseline_steps: int = 15
    """A rank's first this many steps are its baseline: the median excess over them is its device's own speed."""
    baseline_cap: float = 0.05
    """Up to this much of a rank's baseline excess (either sign) is taken as its device's speed and subtracted
    before the rules run: the hardware spread of healthy devices (the slowest of a few hundred sits 3-5 % above
    its peers all run long). Without a change point, a constant offset that small cannot be told from that spread;
    a rank slower than this from its first step still fires with the rest of its excess, and a slowdown that starts
    later is measured against the rank's own baseline. Not scaled with a noisy run's noise: the hardware spread does
    not grow with it (and a live window whose straggler predates it keeps all but this much of its excess)."""
    nominal_transfer_noise: float = 0.03
    """Step-to-step spread of a group's log transfer time that `link_excess` is stated for; scales the same way."""

    def __post_init__(self) -> None:
        for name in ("score_window", "sustain_window", "burst_window", "recur_window", "recur_count", "episode_gap",
                     "link_window", "min_steps", "baseline_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be >= 1")
        if not 1 <= self.sustain_count <= self.sustain_window:
            raise ValueError(f"StragglerConfig.sustain_count={self.sustain_count}: must be in 1..sustain_window")
        if not 1 <= self.sustain_min <= self.sustain_count:
            raise ValueError(f"StragglerConfig.sustain_min={self.sustain_min}: must be in 1..sustain_count")
        if self.merge_gap < 0 or self.min_peers < 2 or self.checkpoint_count < 1:
            raise ValueError("StragglerConfig: merge_gap must be >= 0, min_peers >= 2, checkpoint_count >= 1")
        for name in ("cusum_reference", "cusum_threshold", "cusum_clip", "sustain_excess", "burst_excess",
                     "clock_drop", "checkpoint_excess", "checkpoint_min_share", "link_excess", "stage_excess",
                     "nominal_noise", "nominal_transfer_noise", "baseline_cap", "replica_skew",
                     "replica_skew_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be > 0")
        for name in ("cause_share", "throttle_share", "host_share", "stage_rank_share", "chance_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be in (0, 1]")


def detect_stragglers(frames: Frames, config: StragglerConfig = StragglerConfig()) -> tuple[Incident, ...]:
    """Straggler (rank, host, link) and imbalance (stage, job) incidents of a run, most severe first within kind."""
    if frames.steps.height == 0 or frames.last_step - int(frames.steps[_S].min()) + 1 < config.min_steps:  # type: ignore[arg-type]
        return ()
    own = _own_table(frames, config)
    factor = _noise(_baselined(own, config.baseline_steps, None)) / config.nominal_noise
    config = _scaled(config, factor)
    table = _fire_table(_baselined(own, config.baseline_steps, config.baseline_cap), config, quiet=factor <= 1.0)
    incidents: list[Incident] = []
    stage = _stage_imbalance(table, config)
    incidents.extend(stage)
    skew = _data_skew(table, config)
    ranks = _rank_incidents(frames, table, config, skew_found=bool(skew))
    incidents.extend(_group_hosts(frames, ranks, config))
    incidents.extend(_checkpoint_stragglers(frames, table, config, already={i.ranks[0] for i in ranks}))
    incidents.extend(_slow_links(frames, config))
    incidents.extend(skew)
    return tuple(incidents)


# ---------------------------------------------------------------------------------------------- the excess table


def _scaled(config: StragglerConfig, factor: float) -> StragglerConfig:
    """`config` with every per-step excess threshold multiplied by `factor` (when the run is noisier than nominal)."""
    if factor <= 1.0:
        return config
    return replace(config, **{name: getattr(config, name) * factor for name in (
        "cusum_reference", "cusum_threshold", "cusum_clip", "sustain_excess", "burst_excess", "stage_excess")})


def _baselined(own: pl.DataFrame, steps: int, cap: float | None) -> pl.DataFrame:
    """`own` with each rank's baseline (the median excess of its first `steps` steps, clipped to +-`cap`; None =
    unclipped) subtracted from `x`; the excess against the peers as measured stays in `x_raw`."""
    base = own.sort(_S).group_by(_R).agg(pl.col("x").head(steps).median().alias("_b"))
    b = pl.col("_b").fill_null(0.0)
    b = b if cap is None else b.clip(-cap, cap)
    return own.join(base, on=_R, how="left").with_columns(pl.col("x").alias("x_raw"), (pl.col("x") - b).alias("x")
                                                          ).drop("_b").sort(_R, _S)


def _own_table(frames: Frames, config: StragglerConfig) -> pl.DataFrame:
    """One row per rank-step: own time, its peers' medians and the excess x."""
    topo = frames.topology.select(_R, _ROLE, Topology.HOST.value, Topology.PP.value, Topology.DP.value).unique(
        _R, keep="last")
    steps = frames.steps.select(
        _R, _S, Steps.END_WALL_NS.value, Steps.COMPUTE_NS.value, Steps.DATALOADER_WAIT_NS.value,
        Steps.CHECKPOINT_NS.value,
    ).filter(pl.col(Steps.COMPUTE_NS.value).is_not_null()).join(topo, on=_R, how="left")
    # (compute is null only on the device clock, for steps whose device events were dropped unresolved)
    comp, dl, ck = (pl.col(c.value).fill_null(0).cast(pl.Float64) for c in
                    (Steps.COMPUTE_NS, Steps.DATALOADER_WAIT_NS, Steps.CHECKPOINT_NS))
    # On the device clock the rank's device compute already holds the time its GPU idled while the host waited for
    # a batch (the fetch is inside the step): adding the dataloader wait would count it twice.
    device = frames.clock is Clock.DEVICE
    steps = steps.with_columns(
        comp.alias("comp"), dl.alias("dl"), ck.alias("ck"),
        pl.col(_ROLE).fill_null("job"), pl.col(Topology.PP.value).fill_null(0),
    )
    role_size = steps.group_by(_ROLE).agg(pl.col(_R).n_unique().alias("role_size"))
    steps = steps.join(role_size, on=_ROLE).with_columns(
        pl.when(pl.col("role_size") >= config.min_peers).then(pl.col(_ROLE)).otherwise(pl.lit("job")).alias("peer")
    )
    steps = _replica_adjusted(steps, config, device=device).with_columns(
        (pl.col("comp") if device else pl.col("comp") + pl.col("dl")).alias("own"))
    # Expected own time = the peers' median compute + their median dataloader wait, so a slow host input pipeline
    # is seen as long as the host holds at most half of a role (hosts >= 2 * pp with contiguous placement).
    meds = steps.group_by("peer", _S).agg(
        pl.col("comp").median().alias("med_comp"), pl.col("dl").median().alias("med_dl"),
    ).with_columns((pl.col("med_comp") if device else pl.col("med_comp") + pl.col("med_dl")).alias("med_own"))
    return (
        steps.join(meds, on=["peer", _S])
        .sort(_R, _S)
        .with_columns(
            pl.when(pl.col("med_own") > 0).then(pl.col("own") / pl.col("med_own") - 1.0).otherwise(0.0).alias("x")
        )
    )


_DP = Topology.DP.value
_REPLICA_MIN = 4
"""Ranks a replica needs at a step for its shared factor to be taken out: the lower median of four or more is
still a healthy rank's value with two slow ranks among them."""


def _replica_adjusted(steps: pl.DataFrame, config: StragglerConfig, *, device: bool = False) -> pl.DataFrame:
    """Take out of each rank's compute the per-step variation its whole data-parallel replica shares.

    The ranks of one replica (same `dp` coordinate: every stage and tensor-parallel shard of it) work on the same
    batch, so a long batch slows all of them together; against stage peers in other replicas each looks 5-20 %
    slow or fast at random, which is the batch's doing, not the rank's. The replica's factor at a step is the lower
    median over its ranks of compute / stage-median compute (a healthy rank's value while at most two of
    `_REPLICA_MIN` or more are slow); it is divided out of compute, so each rank is compared with its stage peers
    as if every replica had drawn the same batch. The price: a slowdown of a whole replica at once (every rank of
    it) is taken for its batches and not seen by the rank rules. Replicas of fewer ranks are left as they are (a
    rank would be its own replica's median; there per-step skew stays in the noise).
    Adds `comp_raw` (as measured), `rep_f` / `rep_m` / `rep_n` (the replica's lower-median and median factor and its
    ranks at the step) and `rep_res` (the rank's factor minus its replica's median: the noise within a replica)."""
    dp = steps.get_column(_DP) if _DP in steps.columns else None
    if dp is None or dp.null_count() == dp.len():
        return steps.with_columns(pl.col("comp").alias("comp_raw"), pl.lit(None, pl.Float64).alias("rep_f"),
                                  pl.lit(None, pl.Float64).alias("rep_m"), pl.lit(None, pl.Float64).alias("rep_res"),
                                  pl.lit(0, pl.UInt32).alias("rep_n"))
    # The batch scales the device's own work; on the device clock compute also holds the time the GPU idled waiting
    # for the host's batch (the dataloader wait), which is the input pipeline's, not the batch's: left as it is.
    idle = pl.col("dl").clip(upper_bound=pl.col("comp")) if device else pl.lit(0.0)
    t = steps.with_columns((pl.col("comp") - idle).alias("_w"), idle.alias("_idle"))
    med = pl.col("_w").median().over("peer", _S)
    t = t.with_columns(pl.when(med > 0).then(pl.col("_w") / med - 1.0).otherwise(None).alias("_rc"))
    rep = t.group_by(_DP, _S).agg(pl.col("_rc").quantile(0.5, interpolation="lower").alias("rep_f"),
                                  pl.col("_rc").median().alias("rep_m"), pl.col("_rc").count().alias("rep_n"))
    t = t.join(rep, on=[_DP, _S], how="left")
    shared = pl.when(pl.col("rep_n") >= _REPLICA_MIN).then(pl.col("rep_f")).otherwise(0.0).fill_null(0.0)
    return t.with_columns(pl.col("comp").alias("comp_raw"), (pl.col("_rc") - pl.col("rep_m")).alias("rep_res"),
                          (pl.col("_w") / (1.0 + shared).clip(0.2, None) + pl.col("_idle")).alias("comp")
                          ).drop("_rc", "_w", "_idle")


def _fire_table(own: pl.DataFrame, config: StragglerConfig, *, quiet: bool) -> pl.DataFrame:
    """`own` with the CUSUM, the persistence counts, the rolling score and whether a rule fires at each step.
    `quiet`: the run's per-step noise is at most `nominal_noise` (a GPU job's independent step-to-step jitter)."""
    w, c = config.sustain_window, config.cusum_clip
    # The persistence count a rank needs: `sustain_count` of the last `sustain_window` steps, or, in a quiet run,
    # fewer (never under `sustain_min`) when that many elevated steps in a window are beyond chance at the job's own
    # rate of elevated rank-steps (Bonferroni over every rank-step): a quiet run's straggler whose per-step excess
    # is heavy-tailed (a third of its steps barely slow, the rest 5-30 %) is told from noise by fewer elevated steps.
    # A noisy run keeps the full count: there random per-step skew elevates any rank now and then, and the noise of
    # ranks sharing busy cores comes in bursts of steps, which a binomial count of independent steps would under-rate.
    # `_up` (the step is elevated) stays in the table: the chance test of `_rank_incidents` counts it too
    own = own.with_columns((pl.col("x") > config.sustain_excess).cast(pl.Int32).alias("_up"))
    need = config.sustain_count
    if quiet and own.height:
        rate = float(own.get_column("_up").mean() or 0.0)  # type: ignore[arg-type]
        tests = own.height / w
        while need > config.sustain_min and _binom_tail(need - 1, w, rate) * tests <= config.chance_alpha:
            need -= 1
    t = (
        own.with_columns(
            (pl.col("x") - config.cusum_reference).clip(-c, c).cum_sum().over(_R).alias("_c"),
            (pl.col("x") > config.burst_excess).cast(pl.Int32).alias("_big"),
        )
        .with_columns(
            (pl.col("_c") - pl.min_horizontal(pl.col("_c").cum_min().over(_R), pl.lit(0.0))).alias("cusum"),
            pl.col("_up").rolling_sum(w, min_samples=1).over(_R).alias("_nup"),
            pl.col("_big").rolling_sum(config.burst_window, min_samples=config.burst_window).over(_R).alias("_nbig"),
            pl.col("_big").rolling_sum(config.recur_window, min_samples=1).over(_R).alias("_nrec"),
            pl.col("x").rolling_median(config.score_window, min_samples=1).over(_R).alias("score"),
        )
        .with_columns(
            (((pl.col("cusum") >= config.cusum_threshold) & (pl.col("_nup") >= need))
             | (pl.col("_nbig") >= config.burst_window)
             | (pl.col("_nrec") >= config.recur_count)).fill_null(False).alias("fire")
        )
        .drop("_c", "_big", "_nbig", "_nrec")
    )
    return t


# ---------------------------------------------------------------------------------------------- rank stragglers


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


def _binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (n is at most a run's length)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _noise(table: pl.DataFrame) -> float:
    """Robust per-step spread of the excess over all rank-steps (1.4826 * MAD), at least 0.5 %."""
    x = table.get_column("x")
    mad = float((x - x.median()).abs().median() or 0.0)  # type: ignore[arg-type]
    return max(1.4826 * mad, 0.005)


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
    note = f"{flagged.height}/{g.height} slow steps show {cause.value.replace('_', ' ')} bits"
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


# ---------------------------------------------------------------------------------------------- host input pipeline


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


# ---------------------------------------------------------------------------------------------- checkpoint I/O


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
    need = min(config.checkpoint_count, n_ck)
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


# ---------------------------------------------------------------------------------------------- slow links


def _slow_links(frames: Frames, config: StragglerConfig) -> list[Incident]:
    """Slow inter-host links: first those point-to-point traffic pins down exactly (a send/recv pair crosses one
    link), then those the ring collectives point to (a ring crosses several links at once)."""
    exact = _slow_p2p_links(frames, config)
    return exact + _slow_ring_links(frames, config, known={i.subject.id for i in exact})


def _transfer_jitter(df: pl.DataFrame, key: str) -> float:
    """Robust step-to-step spread of log transfer time within each `key` (1.4826 x MAD)."""
    j = df.with_columns((pl.col(_TRANSFER_NS) / pl.col(_TRANSFER_NS).rolling_median(9, min_samples=1, center=True)
                         .over(key)).log().alias("j")).get_column("j")
    mad = (j - j.median()).abs().median()
    return 1.4826 * float(mad) if isinstance(mad, (int, float)) else 0.0


def _slow_p2p_links(frames: Frames, config: StragglerConfig) -> list[Incident]:
    """Links whose point-to-point transfers (per byte) are persistently slower than the other links'."""
    lk = frames.links.filter((pl.col(_KIND) == "pp") & (pl.col(_TRANSFER_NS) > 0) & (pl.col("bytes") > 0))
    if lk.get_column("link").n_unique() < 2:
        return []
    g = (
        lk.with_columns((pl.col(_TRANSFER_NS).cast(pl.Float64) * pl.col("ops") / pl.col("bytes")).alias("_nspb"))
        .with_columns((pl.col("_nspb") / pl.col("_nspb").quantile(0.25, "nearest").over(_S)).alias("q"))
        .sort("link", _S)
        .with_columns(pl.col("q").rolling_median(config.link_window, min_samples=config.link_window)
                      .over("link").alias("qs"))
    )
    excess = config.link_excess * max(1.0, _transfer_jitter(g, "link") / config.nominal_transfer_noise)
    slow = (g.filter(pl.col("qs") > 1 + excess).group_by("link")
            .agg(pl.col(_S).min().alias("first"), pl.col("qs").median().alias("ratio"), pl.len().alias("n"))
            .join(g.group_by("link").agg(pl.len().alias("total")), on="link")
            .filter(pl.col("n") >= pl.max_horizontal(pl.lit(config.link_window), 0.2 * pl.col("total"))))
    out: list[Incident] = []
    hosts = frames.topology.select(_R, Topology.HOST.value)
    for link, first, ratio in slow.sort("link").select("link", "first", "ratio").iter_rows():
        ends = str(link).split("<->")
        ranks = hosts.filter(pl.col(Topology.HOST.value).is_in(ends)).get_column(_R).sort().to_list()
        rows = g.filter(pl.col("link") == link)
        onset = int(first) - config.link_window + 1
        up = rows.filter((pl.col(_S) >= onset) & (pl.col("q") > 1 + excess))
        onset = int(up.get_column(_S).min()) if up.height else int(first)  # type: ignore[arg-type]
        wall = frames.steps.filter(pl.col(_S) == first).get_column(Steps.END_WALL_NS.value).max()
        out.append(Incident(
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.LINK, id=str(link)), ranks=tuple(ranks),
            onset_step=onset, detection_step=int(first),
            detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            confidence=min(0.99, 0.6 + 0.39 * math.tanh((float(ratio) - 1) / (2 * excess))), cause=Cause.SLOW_LINK,
            summary=f"link {link}: point-to-point transfers across it take {float(ratio):.2f}x the time per byte of "
                    "the other links' from step " + str(onset),
            fields=("transfer_ns",),
            evidence=(Evidence(
                source="links", summary="per-step point-to-point transfer time per byte against the other links",
                columns=("link", "step", "transfer_ns", "bytes", "ratio"),
                rows=tuple((str(a), int(st), int(t), int(b), round(float(q), 3)) for a, st, t, b, q in
                           rows.filter(pl.col(_S) >= onset).select("link", _S, _TRANSFER_NS, "bytes", "q")
                           .head(20).iter_rows()),
            ),),
        ))
    return out


def _slow_ring_links(frames: Frames, config: StragglerConfig, *, known: set[str]) -> list[Incident]:
    """Links whose crossing groups are persistently slower than the other groups of the same kind."""
    gt, groups = frames.group_transfer, frames.groups
    if gt.height == 0 or groups.height == 0:
        return []
    # Baseline: the lower quartile of the kind's groups at that step, not the median, because on a small job a slow
    # link can slow half of a kind's groups (two of four data-parallel rings) and drag the median with it.
    # Groups are compared per byte (stages hold different parameter counts, so their rings move different sizes)
    # and only with groups of their kind that also cross hosts (an intra-host ring is faster by design).
    crosses = groups.select(_GROUP, (pl.col(_LINKS).list.len() > 0).alias("_x"))
    g = (
        gt.filter((pl.col(_TRANSFER_NS) > 0) & (pl.col("bytes") > 0))
        .join(crosses, on=_GROUP, how="left")
        .with_columns((pl.col(_TRANSFER_NS).cast(pl.Float64) * pl.col("ops") / pl.col("bytes")).alias("_nspb"))
        .with_columns((pl.col("_nspb") / pl.col("_nspb").quantile(0.25, "nearest").over(_KIND, "_x", _S)).alias("q"))
        .sort(_GROUP, _S)
    )
    g = _own_history(g, config.baseline_steps).with_columns(
        pl.max_horizontal("q", "q_own").alias("q")).with_columns(
        pl.col("q").rolling_median(config.link_window, min_samples=config.link_window).over(_GROUP).alias("qs"))
    # Step-to-step spread of each group's own log transfer time: how noisy transfers are on this job.
    excess = config.link_excess * max(1.0, _transfer_jitter(g, _GROUP) / config.nominal_transfer_noise)
    config = replace(config, link_excess=excess)
    slow_steps = g.filter(pl.col("qs") > 1 + config.link_excess)
    if slow_steps.height == 0:
        return []
    slow_groups = slow_steps.group_by(_GROUP).agg(pl.col(_S).min().alias("first"), pl.col("qs").median().alias("q"),
                                                  pl.len().alias("n"))
    # A group is slow when it is slow for a sizeable part of the steps it reports (an on-off link: in episodes
    # adding up to a tenth of the run), not once.
    reports = g.group_by(_GROUP).agg(pl.len().alias("total"))
    slow_groups = slow_groups.join(reports, on=_GROUP).filter(pl.col("n") >= pl.max_horizontal(
        pl.lit(config.link_window), 0.1 * pl.col("total")))
    if slow_groups.height == 0:
        return []
    present = groups.filter(pl.col(_GROUP).is_in(g.get_column(_GROUP).unique().implode()))
    pairs = present.select(_GROUP, _KIND, _LINKS).explode(_LINKS).drop_nulls(_LINKS)
    slow_set = set(slow_groups.get_column(_GROUP).to_list())
    pairs = pairs.with_columns(pl.col(_GROUP).is_in(sorted(slow_set)).alias("slow"))
    # "The other groups of their kind" are the kind's groups that cross some link (see the baseline above).
    crossing_any = present.filter(pl.col(_LINKS).list.len() > 0)
    per_link = (
        pairs.group_by(_LINKS, _KIND).agg(pl.len().alias("cross"), pl.col("slow").sum().alias("cross_slow"))
        .group_by(_LINKS).agg(pl.col("cross").sum(), pl.col("cross_slow").sum(), pl.col(_KIND))
        .filter(pl.col("cross_slow") >= 0.8 * pl.col("cross"))
    )
    crossing_of = {str(k): set(v) for k, v in pairs.group_by(_LINKS).agg(pl.col(_GROUP)).iter_rows()}
    # A link is one physical thing: while it is slow every group crossing it is slow at the same steps (an on-off
    # link too), and the other groups of their kinds are not. Noise (a preempted rank, a busy host) slows groups one
    # at a time at steps of their own, and a group slow by noise for a tenth of the run is common on a crowded host.
    # So the rule is judged step by step: the link's slow steps are those where at least 80 % of its crossing groups
    # are slow; it needs as many as a slow group needs slow steps, and on them the share of its slow crossing groups
    # must exceed the share of slow other groups of their kinds by more than one half.
    flags = g.filter(pl.col("qs").is_not_null()).select(_GROUP, _S, (pl.col("qs") > 1 + config.link_excess).alias("slow"))
    kind_of = dict(crossing_any.select(_GROUP, _KIND).iter_rows())
    scored: list[tuple[str, int, int, float, int]] = []
    for link, cross, cross_slow, kinds in per_link.select(_LINKS, "cross", "cross_slow", _KIND).iter_rows():
        crossing = crossing_of[str(link)]
        others = {grp for grp, k in kind_of.items() if k in set(kinds) and grp not in crossing}
        per_step = (
            flags.filter(pl.col(_GROUP).is_in(sorted(crossing | others)))
            .with_columns(pl.col(_GROUP).is_in(sorted(crossing)).alias("_c"))
            .group_by(_S).agg(pl.col("slow").filter(pl.col("_c")).mean().alias("fc"),
                              pl.col("slow").filter(~pl.col("_c")).mean().fill_null(0.0).alias("fo"))
            .drop_nulls("fc")
        )
        joint = per_step.filter(pl.col("fc") >= 0.8)
        if joint.height < max(config.link_window, 0.1 * per_step.height):
            continue
        score = float((joint.get_column("fc") - joint.get_column("fo")).mean())  # type: ignore[arg-type]
        if score > 0.5:
            scored.append((str(link), int(cross), int(cross_slow), score, int(joint.get_column(_S).min())))  # type: ignore[arg-type]
    scored.sort(key=lambda r: (-r[3], -r[2], r[0]))
    out: list[Incident] = []
    # Groups that cross a link already found exactly are explained by it.
    explained: set[str] = {grp for link in known for grp in crossing_of.get(link, ())}
    for link, cross, cross_slow, score, det in scored:
        crossing = crossing_of[link]
        newly = (crossing & slow_set) - explained
        if not newly:
            continue
        explained |= crossing & slow_set
        # A ring crosses several links; links crossed by exactly the same groups cannot be told apart.
        tied = sorted(other for other, gs in crossing_of.items() if gs == crossing and other != link)
        members = sorted({int(r) for rs in present.filter(pl.col(_GROUP).is_in(sorted(crossing)))
                         .get_column(_RANKS).to_list() for r in rs})
        sg = slow_groups.filter(pl.col(_GROUP).is_in(sorted(crossing)))
        # Detected at the link's first slow step (a trailing rolling median: up to a window after the onset); the
        # onset is the first step from a window before it where the crossing groups' median ratio is above the bar.
        onset = max(det - config.link_window + 1, int(g.get_column(_S).min()))  # type: ignore[arg-type]
        onset = _first_slow(g, sorted(crossing), onset, config)
        ratio = float(sg.get_column("q").median())  # type: ignore[arg-type]
        wall = frames.steps.filter(pl.col(_S) == det).get_column(Steps.END_WALL_NS.value).max()
        ev_rows = g.filter(pl.col(_GROUP).is_in(sorted(crossing)) & (pl.col(_S) >= onset)).sort(_S, _GROUP).head(20)
        out.append(Incident(
            # Links the data cannot tell apart are named together ('a<->b | c<->d'): one of them is slow.
            klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.LINK, id=" | ".join(sorted([str(link), *tied]))),
            ranks=tuple(members), onset_step=onset, detection_step=det, detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            confidence=min(0.99 if not tied else 0.5,
                           0.5 + 0.45 * float(score) * min(1.0, (ratio - 1) / (2 * config.link_excess))),
            cause=Cause.SLOW_LINK,
            summary=f"link {link}: {cross_slow} of the {cross} groups crossing it transfer {ratio:.2f}x slower than "
                    "the other groups of their kind"
                    + (f"; the same groups also cross {', '.join(tied)}, which the data cannot tell apart from it"
                       if tied else ""),
            fields=("transfer_ns",),
            evidence=(Evidence(
                source="group_transfer",
                summary="per-step transfer time of groups crossing the link against the median of their kind",
                columns=("group", "kind", "step", "transfer_ns", "ratio"),
                rows=tuple((str(a), str(b), int(s), int(t), round(float(q), 3)) for a, b, s, t, q in
                           ev_rows.select(_GROUP, _KIND, _S, _TRANSFER_NS, "q").iter_rows()),
            ),),
        ))
    return out


def _own_history(g: pl.DataFrame, baseline_steps: int) -> pl.DataFrame:
    """`g` with `q_own`: each group's transfer time per byte against its own baseline (the lower of the median of
    its first `baseline_steps` steps and its lower quartile over the run), divided by the job-wide factor of the
    step (the median of that ratio over every group: a network hiccup slows every group at once, a slow link only
    those crossing it). It finds a slow link that every group of a kind crosses (a ring spanning all hosts), where
    comparing the kind's groups with each other cannot."""
    base = g.group_by(_GROUP).agg(pl.min_horizontal(pl.col("_nspb").head(baseline_steps).median(),
                                                    pl.col("_nspb").quantile(0.25, "nearest")).alias("_base"))
    g = g.join(base, on=_GROUP, how="left").with_columns((pl.col("_nspb") / pl.col("_base")).alias("_qh"))
    job = g.group_by(_S).agg(pl.col("_qh").median().alias("_h"), pl.len().alias("_hn"))
    return (g.join(job, on=_S, how="left")
            .with_columns((pl.col("_qh") / pl.when(pl.col("_hn") >= 3).then(pl.col("_h")).otherwise(1.0)).alias("q_own"))
            .drop("_base", "_qh", "_h", "_hn").sort(_GROUP, _S))


def _first_slow(g: pl.DataFrame, groups: list[str], lo: int, config: StragglerConfig) -> int:
    """First step at or after `lo` where the crossing groups' median transfer ratio is above the threshold."""
    per = (g.filter(pl.col(_GROUP).is_in(groups) & (pl.col(_S) >= lo)).group_by(_S).agg(pl.col("q").median())
           .filter(pl.col("q") > 1 + config.link_excess))
    return int(per.get_column(_S).min()) if per.height else lo  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- imbalance


def _stage_imbalance(table: pl.DataFrame, config: StragglerConfig) -> list[Incident]:
    """Stages whose median compute exceeds the (lower) median of all stages' medians, all ranks together."""
    pp = Topology.PP.value
    if table.get_column(pp).n_unique() < 2:
        return []
    st = table.group_by(pp, _S).agg(pl.col("comp").median().alias("stage_med"))
    base = st.group_by(_S).agg(pl.col("stage_med").quantile(0.5, interpolation="lower").alias("base"))
    st = (st.join(base, on=_S).sort(pp, _S)
          .with_columns((pl.col("stage_med") / pl.col("base") - 1).alias("sx"))
          .with_columns(pl.col("sx").rolling_median(config.score_window, min_samples=config.score_window)
                        .over(pp).alias("ss")))
    share = (table.join(base, on=_S).group_by(pp, _S)
             .agg((pl.col("comp") > (1 + config.stage_excess / 2) * pl.col("base")).mean().alias("share")))
    st = st.join(share, on=[pp, _S])
    out: list[Incident] = []
    n_steps = st.get_column(_S).n_unique()
    for (stage,), rows in st.group_by(pp, maintain_order=True):
        rows = rows.sort(_S)
        hot = rows.filter((pl.col("ss") > config.stage_excess) & (pl.col("share") >= config.stage_rank_share))
        if hot.height < max(config.score_window, n_steps // 4):
            continue
        det = int(hot.get_column(_S).min())  # type: ignore[arg-type]
        pre = rows.filter((pl.col(_S) <= det) & (pl.col("sx") <= config.stage_excess))
        onset = int(pre.get_column(_S).max()) + 1 if pre.height else int(rows.get_column(_S).min())  # type: ignore[arg-type]
        onset = min(onset, det)
        effect = float(hot.get_column("ss").median())  # type: ignore[arg-type]
        members = sorted(table.filter(pl.col(pp) == stage).get_column(_R).unique().to_list())
        role = f"pp={stage}"
        wall = table.filter(pl.col(_S) == det).get_column(Steps.END_WALL_NS.value).max()
        out.append(Incident(
            klass=IncidentClass.IMBALANCE, subject=Subject(kind=SubjectKind.STAGE, id=role), ranks=tuple(members),
            onset_step=onset, detection_step=det, detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            confidence=min(0.99, 0.5 + 0.49 * math.tanh(effect / (2 * config.stage_excess))),
            cause=Cause.STAGE_IMBALANCE,
            summary=f"stage {role} computes {effect:.1%} longer per step than the median stage in "
                    f"{hot.height} of {n_steps} steps: the pipeline is unbalanced (job design, not a device fault)",
            fields=("compute_ns",),
            evidence=(Evidence(
                source="steps", summary="median compute of the stage against the median of all stages' medians",
                columns=("stage", "step", "stage_median_ns", "stages_median_ns", "ratio"),
                rows=tuple((role, int(s), int(a), int(b), round(float(a) / float(b), 4)) for s, a, b in
                           hot.select(_S, "stage_med", "base").head(20).iter_rows()),
            ),),
        ))
    return out


def _data_skew(table: pl.DataFrame, config: StragglerConfig) -> list[Incident]:
    """Random per-step data skew between data-parallel replicas (sequence-length imbalance: a replica's batch is
    long or short for all its ranks together), read step by step: at most steps the replicas' compute factors (the
    median over a replica's ranks of compute / stage-median compute) lie far apart — their mean absolute deviation
    from the median replica's is well above the noise of ranks within one replica — and the late replica is a
    different one from step to step — none is late
    more often than chance among them would make it (binomial, Bonferroni over replicas). One replica late at
    every step is a slow replica, not skew. A replica needs two ranks for its noise to be told from its batch's:
    where every replica is one rank (pure data parallelism), skew and per-rank noise look alike from step times
    and no skew is reported."""
    if "rep_m" not in table.columns:
        return []
    inside = table.filter((pl.col("rep_n") >= 2) & pl.col("rep_m").is_not_null())
    if inside.height == 0:
        return []
    res = inside.get_column("rep_res").drop_nulls()
    arr = res.to_numpy()
    noise = 1.4826 * float(np.median(np.abs(arr - np.median(arr)))) if len(arr) else 0.0
    per = (inside.unique([_DP, _S]).group_by(_S).agg(
        pl.len().alias("n"), (pl.col("rep_m") - pl.col("rep_m").median()).abs().mean().alias("lead"),
        pl.col(_DP).sort_by("rep_m").last().alias("late"), pl.col(Steps.END_WALL_NS.value).max().alias("wall"))
        .filter(pl.col("n") >= 4).sort(_S))
    if per.height < config.min_steps:
        return []
    need = max(config.replica_skew, config.replica_skew_ratio * noise)
    lead = float(per.get_column("lead").median())  # type: ignore[arg-type]
    if lead < need:
        return []
    replicas = int(per.get_column("n").median())  # type: ignore[arg-type]
    counts = per.group_by("late").len()
    top = int(counts.get_column("len").max())  # type: ignore[arg-type]
    if _binom_tail(top, per.height, 1.0 / replicas) * replicas < config.chance_alpha:
        return []
    wide = per.filter(pl.col("lead") >= need)
    det_row = wide.row(min(config.min_steps, wide.height) - 1, named=True)
    late = set(counts.get_column("late").to_list())
    ranks = sorted(int(r) for r in inside.filter(pl.col(_DP).is_in(sorted(late))).get_column(_R).unique())
    return [Incident(
        klass=IncidentClass.IMBALANCE, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=tuple(ranks),
        onset_step=int(per.get_column(_S)[0]), detection_step=int(det_row[_S]), detection_wall_ns=det_row["wall"],
        confidence=min(0.99, 0.5 + 0.49 * math.tanh(lead / need - 0.5)),
        cause=Cause.DATA_SKEW,
        summary=f"data skew between replicas: at a median step the {replicas} data-parallel replicas' compute lies "
                f"{lead:.1%} from the median replica's on average (all ranks of a replica together; noise within a "
                f"replica {noise:.1%} per step), and the late replica changes from step to step ({counts.height} different, "
                f"none late in more than {top} of {per.height} steps): batch content, not a device",
        fields=("compute_ns",),
        evidence=(Evidence(
            source="steps", summary="per step: the replicas' mean absolute deviation from the median replica, and the "
                                    "late replica",
            columns=("step", "replicas", "deviation", "late_replica"),
            rows=tuple((int(st), int(n), round(float(ld), 4), int(lt)) for st, n, ld, lt in
                       per.select(_S, "n", "lead", "late").head(20).iter_rows()),
        ),),
    )]
