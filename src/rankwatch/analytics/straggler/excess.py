"""The excess table: each rank's own work against its role peers' median, step by step, with the noise scale, the
baseline and the persistence rules that fire on it (the module docstring of `analytics.straggler`)."""

from __future__ import annotations

import math
from dataclasses import replace

import polars as pl

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.straggler.config import StragglerConfig, _R, _ROLE, _S
from rankwatch.base.schema import Steps, Topology


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


def _noise(table: pl.DataFrame) -> float:
    """Robust per-step spread of the excess over all rank-steps (1.4826 * MAD), at least 0.5 %."""
    x = table.get_column("x")
    mad = float((x - x.median()).abs().median() or 0.0)  # type: ignore[arg-type]
    return max(1.4826 * mad, 0.005)


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
