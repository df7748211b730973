"""Imbalance: a pipeline stage whose median compute exceeds the other stages' (IMBALANCE, STAGE), and data skew
(IMBALANCE, JOB): random per-step skew between replicas of several ranks, a different one late each step
(`_data_skew`), or, where the job counts its batches' work (`steps.tokens`), compute that follows it (`_token_skew`)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.straggler.config import StragglerConfig, _R, _S
from rankwatch.analytics.straggler.excess import _DP, _binom_tail
from rankwatch.base.schema import Steps, Topology


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


def _token_skew(frames: Frames, config: StragglerConfig) -> list[Incident]:
    """Data skew read from the work in each rank's batch (`steps.tokens`, as the job counts it): where replicas are
    single ranks (pure data parallelism) step times alone cannot tell a long batch from a rank's noise
    (`_data_skew`), but the batches' own sizes can. Per step, each rank's tokens and compute relative to the step's
    median (dt, dc); pooled over the rank-steps, the compute a batch's extra work explains, dc = beta * dt (a line
    through the origin: both are deviations from the same step's median), with beta surely positive (its t against
    the residuals' robust spread beyond the one-sided `chance_alpha` quantile). Each step waits for its slowest
    rank, so what the skew costs a step is the longest batch's explained excess, beta * max dt; skew is reported
    when that is at least `replica_skew` at the median step of those whose batches differ (at least `min_steps` of
    them). Which rank holds the longest batch need not change: a sharding that always gives one rank more is batch
    content too. Constant tokens (packed sequences) say nothing, and nothing is reported from them."""
    steps = frames.steps
    if Steps.TOKENS.value not in steps.columns or steps.get_column(Steps.TOKENS.value).null_count() == steps.height:
        return []
    t = (steps.select(_R, _S, pl.col(Steps.COMPUTE_NS.value).cast(pl.Float64).alias("c"),
                      pl.col(Steps.TOKENS.value).cast(pl.Float64).alias("k"), Steps.END_WALL_NS.value)
         .drop_nulls(["c", "k"]).filter((pl.col("c") > 0) & (pl.col("k") > 0))
         .with_columns((pl.col("k") / pl.col("k").median().over(_S) - 1.0).alias("dt"),
                       (pl.col("c") / pl.col("c").median().over(_S) - 1.0).alias("dc"),
                       pl.len().over(_S).alias("n"))
         .filter(pl.col("n") >= 4))
    per = (t.group_by(_S).agg(pl.col("dt").max().alias("top"), pl.col("dt").abs().max().alias("spread"),
                              pl.col(_R).sort_by("dt").last().alias("late"),
                              pl.col(Steps.END_WALL_NS.value).max().alias("wall"))
           .filter(pl.col("spread") > 0).sort(_S))
    if per.height < config.min_steps:
        return []
    x, y = t.get_column("dt").to_numpy(), t.get_column("dc").to_numpy()
    sxx = float(np.dot(x, x))
    beta = float(np.dot(x, y)) / sxx
    res = y - beta * x
    spread = 1.4826 * float(np.median(np.abs(res - np.median(res))))
    t_beta = beta / (max(spread, 1e-6) / math.sqrt(sxx))
    if beta <= 0 or t_beta < NormalDist().inv_cdf(1.0 - config.chance_alpha):
        return []
    per = per.with_columns((beta * pl.col("top").clip(lower_bound=0.0)).alias("cost"))
    cost = float(per.get_column("cost").median())  # type: ignore[arg-type]
    if cost < config.replica_skew:
        return []
    wide = per.filter(pl.col("cost") >= config.replica_skew)
    det_row = wide.row(min(config.min_steps, wide.height) - 1, named=True)
    late = sorted(int(r) for r in per.get_column("late").unique())
    longest = int(per.group_by("late").len().get_column("len").max())  # type: ignore[arg-type]
    return [Incident(
        klass=IncidentClass.IMBALANCE, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=tuple(late),
        onset_step=int(per.get_column(_S)[0]), detection_step=int(det_row[_S]), detection_wall_ns=det_row["wall"],
        confidence=min(0.99, 0.5 + 0.49 * math.tanh(cost / config.replica_skew - 0.5)),
        cause=Cause.DATA_SKEW,
        summary=f"data skew: the ranks' batches differ in work (steps.tokens) and their compute follows it (each "
                f"1 % more tokens is {beta:.2f} % more compute; t = {t_beta:.0f}); at a median step the longest batch "
                f"costs {cost:.1%} of the step's compute, which every rank waits for. It was on {len(late)} different "
                f"rank(s) (one rank held it in {longest} of {per.height} steps): batch content, not a device",
        fields=("compute_ns", "tokens"),
        evidence=(Evidence(
            source="steps", summary="per step: the longest batch's tokens over the step's median, its explained "
                                    "compute excess, and its rank",
            columns=("step", "longest_tokens_excess", "explained_compute_excess", "rank"),
            rows=tuple((int(st), round(float(tp), 4), round(float(cs), 4), int(lt)) for st, tp, cs, lt in
                       per.select(_S, "top", "cost", "late").head(20).iter_rows()),
        ),),
    )]
