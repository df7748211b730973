"""The anomaly model: unusual per-rank behaviour that no known incident explains, reported as UNCLASSIFIED.

Each rank's steps are cut into windows of `AnomalyConfig.window_steps` steps. Per (rank, window) the model compares
the rank's step timings and GPU samples with its role peers (ranks of the same pipeline stage, which should behave
alike). Step timings are compared step by step, each step against the role peers' median at that same step, and the
window's deviation is the median of those per-step deviations: noise every rank shares at a step (a checkpoint stall,
a scheduling burst on a loaded host) cancels in the pair, where a ratio of two window medians would carry it (on busy
cores a window median jumps between the on-core and the waiting level). GPU samples are compared as window medians:

    compute_ns, duration_ns        rank / peer median at the step - 1     (0.2 = 20 % slower than its peers)
    dataloader_wait_ns,            (rank - peer median at the step) /     (0.2 = waits a fifth of a typical step
    collective_wait_ns             peers' median duration at the step      longer than its peers)
    sm_clock_ratio                 SM clock / max SM clock, minus peers'   (-0.2 = clock 20 points of max lower)
    temperature_c                  rank median - peer median, in °C
    power_w                        rank median / peer median - 1
    new_hard_errors                new ECC double-bit, PCIe replay, NVLink, retired-page, remapped-row counts
                                   and XID events in the window (cumulative counters that merely stay high add 0)
    new_ecc_sbe                    log(1 + new ECC single-bit errors in the window)

Each deviation becomes a robust z-score against all windows of the run: (x - median) / scale, scale = max(1.4826 *
MAD, a per-feature floor, and for step timings the window median's own standard error, 1.2533 * 1.4826 * MAD of the
window's per-step deviations / sqrt(steps)): a window is unusual only by more than its own steps' spread allows, so
a few windows of a noisy run (a 4-rank CPU canary has 8 windows in 40 steps) cannot turn chance into z = 18. The
error counters and dataloader_wait_ns count upwards only (z clipped at 0): a rank that waits less for its data than
its peers is not at fault; when the peers' loaders are held up (an in-process loader preempted on a busy host) the
one that was not is the odd one out, and blaming it blames the healthy rank. The floor (`_SCALE_FLOOR`) is the
smallest deviation unit that is meaningful at all, so a run whose windows agree almost perfectly does not turn a
rank 2 % slower throughout into a huge z: z = 8 on compute_ns means at least 8 floors = 20 % off its peers. Window
medians ignore a one-step checkpoint stall, and peers share stalls that hit every rank, so benign variation stays
near z = 0.

An IsolationForest (fixed `random_state`) scores how easily a window's z-vector is isolated from the others: s in
(0, 1), about 0.5 for an ordinary window, towards 1 for one that a few random splits separate. It always ranks some
windows as outliers, so it only gates: a window is anomalous when some feature's |z| exceeds `z_threshold` (the
candidates) AND the forest, fitted on the candidates plus a reference subsample of the run's windows, scores it at
or above both 0.5 and the score only the `contamination` share of the reference reaches. An anomaly is confirmed on
`persist_windows` consecutive anomalous windows of one rank, or at once when |z| reaches `extreme_z`. Features of
ranks covered by a known incident (the rank itself, from the incident's onset on) are not read; for ranks that share
a process group with a known culprit, or any rank once a rank failed or hung, the waiting features
(collective_wait_ns, duration_ns) are not read either, since waiting for someone else's fault is not an anomaly of
one's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import polars as pl
from sklearn.ensemble import IsolationForest

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import Gpu, GroupField, GroupKind, Steps, Topology


class Feature(StrEnum):
    COMPUTE = "compute_ns"
    DURATION = "duration_ns"
    DATALOADER_WAIT = "dataloader_wait_ns"
    COLLECTIVE_WAIT = "collective_wait_ns"
    SM_CLOCK_RATIO = "sm_clock_ratio"
    TEMPERATURE = "temperature_c"
    POWER = "power_w"
    NEW_HARD_ERRORS = "new_hard_errors"
    NEW_ECC_SBE = "new_ecc_sbe"


FEATURES: tuple[Feature, ...] = tuple(Feature)

_SCALE_FLOOR: dict[Feature, float] = {
    Feature.COMPUTE: 0.025,
    Feature.DURATION: 0.025,
    Feature.DATALOADER_WAIT: 0.025,
    Feature.COLLECTIVE_WAIT: 0.025,
    Feature.SM_CLOCK_RATIO: 0.02,
    Feature.TEMPERATURE: 2.0,
    Feature.POWER: 0.04,
    # one new hard error in a window is z = 16 (extreme): such counters should never move in a healthy run
    Feature.NEW_HARD_ERRORS: 1.0 / 16.0,
    # z = 8 needs about 50 new single-bit errors in one window; a slow trickle is benign
    Feature.NEW_ECC_SBE: 0.5,
}
_ONE_SIDED = frozenset({Feature.NEW_HARD_ERRORS, Feature.NEW_ECC_SBE, Feature.DATALOADER_WAIT})
_WAITING = frozenset({Feature.COLLECTIVE_WAIT, Feature.DURATION})
_TRIGGERS: tuple[Feature, ...] = tuple(
    f for f in FEATURES if f not in (Feature.SM_CLOCK_RATIO, Feature.TEMPERATURE, Feature.POWER))
_BLOCKS_EVERYONE = frozenset({IncidentClass.FAIL_STOP, IncidentClass.HANG})

# gpu-frame columns that are per-step aggregates of several schema counters (see analytics/frames.py 'gpu')
_NVLINK_ERRORS, _RETIRED_PAGES, _REMAPPED_ROWS = "nvlink_errors", "retired_pages", "remapped_rows"
_HARD_COUNTERS = (Gpu.ECC_DBE_VOLATILE, Gpu.PCIE_REPLAY, _NVLINK_ERRORS, _RETIRED_PAGES, _REMAPPED_ROWS)
_ROLE = "role"


@dataclass(frozen=True, kw_only=True, slots=True)
class AnomalyConfig:
    window_steps: int = 20
    """Steps per window; windows are aligned to step // window_steps."""
    min_window_steps: int = 5
    """A (rank, window) with fewer completed steps is not scored (a partial last window, a rank that stopped)."""
    z_threshold: float = 8.0
    """A feature stands out when its robust |z| against all windows exceeds this."""
    extreme_z: float = 16.0
    """A window whose |z| reaches this is confirmed alone, without waiting for a second window."""
    persist_windows: int = 2
    """Consecutive anomalous windows of one rank needed to confirm an anomaly below `extreme_z`."""
    fit_windows: int = 4096
    """The forest is fitted on the candidate windows plus at most this many others, a deterministic random
    reference subsample of the run's windows."""
    contamination: float = 0.01
    """The forest calls a window an outlier when at most this share of the reference is as easy to isolate."""
    n_estimators: int = 100
    """Trees in the IsolationForest."""
    random_state: int = 0
    """Seed of the subsample and the forest: the same frames give the same incidents."""
    min_peers: int = 4
    """Roles with fewer ranks are compared with all ranks instead (too few peers for a median)."""

    def __post_init__(self) -> None:
        if self.window_steps < 2:
            raise ValueError(f"AnomalyConfig.window_steps={self.window_steps}: must be >= 2")
        if not 1 <= self.min_window_steps <= self.window_steps:
            raise ValueError(f"AnomalyConfig.min_window_steps={self.min_window_steps}: must be in 1..window_steps")
        if not 0 < self.z_threshold <= self.extreme_z:
            raise ValueError(f"AnomalyConfig: need 0 < z_threshold ({self.z_threshold}) <= extreme_z ({self.extreme_z})")
        if self.persist_windows < 1:
            raise ValueError(f"AnomalyConfig.persist_windows={self.persist_windows}: must be >= 1")
        if not 0.0 < self.contamination < 0.5:
            raise ValueError(f"AnomalyConfig.contamination={self.contamination}: must be in (0, 0.5)")
        if self.fit_windows < 256 or self.n_estimators < 1:
            raise ValueError(f"AnomalyConfig: fit_windows ({self.fit_windows}) must be >= 256, n_estimators >= 1")


def detect_anomalies(frames: Frames, known: Sequence[Incident] = (),
                     config: AnomalyConfig = AnomalyConfig()) -> tuple[Incident, ...]:
    """UNCLASSIFIED incidents, one per rank and episode of confirmed anomalous windows that `known` does not cover.

    Confidence: 0.5 at z = z_threshold rising linearly to 0.9 at z = 2 * z_threshold and above: how far past the
    gate the strongest feature went. It says how sure the model is that something is abnormal, never what."""
    windows = _windows(frames, config)
    if windows.height == 0:
        return ()
    windows = _score(windows, config)
    windows = _excuse(windows, frames, known, config)
    # GPU environment features (clock, temperature, power) describe a window but cannot raise one alone: a
    # throttle bit or a warm GPU on a rank that is not slower is benign.
    z_abs = pl.max_horizontal([pl.col(f"z_{f}").abs() for f in _TRIGGERS])
    candidates = windows.with_columns(z_abs.alias("z_max")).filter(pl.col("z_max") > config.z_threshold)
    if candidates.height == 0:
        return ()
    forest_scores, cut = _forest_scores(windows, candidates, config)
    flagged = candidates.with_columns(pl.Series("forest_score", forest_scores),
                                         pl.lit(cut).alias("forest_cut")).filter(pl.col("forest_score") >= cut)
    return tuple(_incidents(flagged.sort(Steps.RANK, "window"), config))


def _windows(frames: Frames, cfg: AnomalyConfig) -> pl.DataFrame:
    """One row per (rank, window): raw window medians, peer medians and deviations (`d_<feature>`)."""
    w = cfg.window_steps
    steps = frames.steps
    if steps.height == 0:
        return pl.DataFrame()
    timing = (Feature.COMPUTE, Feature.DURATION, Feature.DATALOADER_WAIT, Feature.COLLECTIVE_WAIT)
    topo = frames.topology.select(Topology.RANK, pl.col(_ROLE))
    st = (steps.lazy().join(topo.lazy(), on=Steps.RANK, how="left")
          .with_columns(pl.col(_ROLE).fill_null("*")))
    role_size = pl.col(Steps.RANK).n_unique().over(_ROLE)
    st = st.with_columns(pl.when(role_size >= cfg.min_peers).then(pl.col(_ROLE)).otherwise(pl.lit("*")).alias(_ROLE))
    # each step against the role peers' median at the same step: noise every rank shares at that step (a
    # checkpoint stall, a loaded host's scheduling burst, a long batch) cancels in the pair
    at_step = [_ROLE, Steps.STEP]
    st = st.with_columns(*[pl.col(f).cast(pl.Float64).alias(f) for f in timing]).with_columns(
        *[pl.col(f).median().over(at_step).alias(f"p_{f}") for f in timing])
    step_len_t = pl.col(f"p_{Feature.DURATION}")
    per_step: list[pl.Expr] = []
    for f in timing:
        x, p = pl.col(f), pl.col(f"p_{f}")
        if f in (Feature.COMPUTE, Feature.DURATION):
            per_step.append(pl.when(p > 0).then(x / p - 1.0).alias(f"d_{f}"))
        else:
            per_step.append(pl.when(step_len_t > 0).then((x - p) / step_len_t).alias(f"d_{f}"))
    st = st.with_columns(per_step)

    sw = (
        st.with_columns((pl.col(Steps.STEP) // w).alias("window"))
        .group_by(Steps.RANK, "window")
        .agg(pl.len().alias("n"), pl.col(Steps.STEP).min().alias("first_step"),
             pl.col(Steps.STEP).max().alias("last_step"), pl.col(_ROLE).first(),
             *[pl.col(f).median() for f in timing], *[pl.col(f"p_{f}").median() for f in timing],
             *[pl.col(f"d_{f}").median() for f in timing],
             # the standard error of a median of n steps, from the steps' own spread (MAD -> sigma -> se)
             *[(1.2533 * 1.4826 * _mad(f"d_{f}") / pl.len().cast(pl.Float64).sqrt()).alias(f"se_{f}")
               for f in timing])
        .filter(pl.col("n") >= cfg.min_window_steps)
    )
    gpu = frames.gpu
    gpu_cols = (Feature.SM_CLOCK_RATIO, Feature.TEMPERATURE, Feature.POWER, Feature.NEW_HARD_ERRORS,
                Feature.NEW_ECC_SBE)
    if gpu.height:
        def new(col: str) -> pl.Expr:
            return pl.col(col).diff().over(Gpu.RANK).clip(lower_bound=0).fill_null(0)

        gw = (
            gpu.lazy()
            .sort(Gpu.RANK, Gpu.STEP)
            .with_columns(
                (pl.col(Gpu.STEP) // w).alias("window"),
                (pl.col(Gpu.SM_CLOCK_MHZ) / pl.col(Gpu.SM_CLOCK_MAX_MHZ)).alias(Feature.SM_CLOCK_RATIO),
                pl.sum_horizontal([new(c) for c in _HARD_COUNTERS]
                                  + [pl.col(Gpu.XID_EVENTS).list.len().fill_null(0)]).alias(Feature.NEW_HARD_ERRORS),
                new(Gpu.ECC_SBE_VOLATILE).alias(Feature.NEW_ECC_SBE),
            )
            .group_by(Gpu.RANK, "window")
            .agg(pl.col(Feature.SM_CLOCK_RATIO).median(), pl.col(Gpu.TEMPERATURE_C).median(),
                 pl.col(Gpu.POWER_W).median(), pl.col(Feature.NEW_HARD_ERRORS).sum().cast(pl.Float64),
                 pl.col(Feature.NEW_ECC_SBE).sum().cast(pl.Float64))
        )
        sw = sw.join(gw, on=[Steps.RANK, "window"], how="left")
    else:
        sw = sw.with_columns(*[pl.lit(None, dtype=pl.Float64).alias(str(c)) for c in gpu_cols])

    peers = [_ROLE, "window"]
    env = [f for f in FEATURES if f not in timing]
    sw = sw.with_columns(*[pl.col(f).median().over(peers).alias(f"p_{f}") for f in env])
    dev: list[pl.Expr] = []
    for f in env:
        x, p = pl.col(f), pl.col(f"p_{f}")
        e: pl.Expr
        if f == Feature.POWER:
            e = pl.when(p > 0).then(x / p - 1.0)
        elif f == Feature.NEW_HARD_ERRORS:
            e = x
        elif f == Feature.NEW_ECC_SBE:
            e = x.log1p()
        else:
            e = x - p
        dev.append(e.alias(f"d_{f}"))
    # sorted so the forest's subsample, and so its scores, do not depend on group_by's row order
    return sw.with_columns(dev).sort(Steps.RANK, "window").collect()


def _mad(column: str) -> pl.Expr:
    """The median absolute deviation of `column` from its median."""
    return (pl.col(column) - pl.col(column).median()).abs().median()


def _score(windows: pl.DataFrame, cfg: AnomalyConfig) -> pl.DataFrame:
    """Add `z_<feature>`: robust z of each deviation against all windows (null deviations -> 0)."""
    stats = windows.select(
        *[pl.col(f"d_{f}").median().alias(f"m_{f}") for f in FEATURES],
        *[_mad(f"d_{f}").alias(f"mad_{f}") for f in FEATURES],
    ).row(0, named=True)
    zs = []
    for f in FEATURES:
        med = stats[f"m_{f}"] or 0.0
        scale: pl.Expr | float = max(1.4826 * (stats[f"mad_{f}"] or 0.0), _SCALE_FLOOR[f])
        if f"se_{f}" in windows.columns:
            scale = pl.max_horizontal(pl.lit(scale), pl.col(f"se_{f}").fill_null(0.0))
        z = (pl.col(f"d_{f}") - med) / scale
        if f in _ONE_SIDED:
            z = z.clip(lower_bound=0.0)
        zs.append(z.fill_nan(0.0).fill_null(0.0).alias(f"z_{f}"))
    return windows.with_columns(zs)


def _excuse(windows: pl.DataFrame, frames: Frames, known: Sequence[Incident], cfg: AnomalyConfig) -> pl.DataFrame:
    """Zero the z of features that known incidents explain (see the module docstring)."""
    if not known:
        return windows
    own: dict[int, int] = {}
    waiting: dict[int, int] = {}

    def cover(into: dict[int, int], ranks: set[int], onset: int) -> None:
        for r in ranks:
            into[r] = min(onset, into.get(r, onset))

    members = _group_members(frames.groups)
    all_ranks = set(windows[Steps.RANK].unique().to_list())
    for inc in known:
        ranks = set(inc.ranks)
        if inc.subject.kind is SubjectKind.RANK and inc.subject.id.lstrip("-").isdigit():
            ranks.add(int(inc.subject.id))
        onset = inc.onset_step if inc.onset_step is not None else -(2**62)
        cover(own, ranks, onset)
        if inc.klass in _BLOCKS_EVERYONE or members.height == 0:
            cover(waiting, all_ranks, onset)
        else:
            groups = members.filter(pl.col(Steps.RANK).is_in(list(ranks)))[GroupField.NAME]
            cover(waiting, set(members.filter(pl.col(GroupField.NAME).is_in(groups.to_list()))[Steps.RANK].to_list()), onset)

    def onsets(d: dict[int, int], name: str) -> pl.DataFrame:
        return pl.DataFrame({Steps.RANK: list(d), name: list(d.values())},
                            schema={Steps.RANK: windows.schema[Steps.RANK], name: pl.Int64})

    # one window of slack: a known onset estimated a little late still covers the window the fault began in
    end = pl.col("last_step") + cfg.window_steps
    out = windows.join(onsets(own, "own_onset"), on=Steps.RANK, how="left").join(
        onsets(waiting, "wait_onset"), on=Steps.RANK, how="left")
    own_cov = pl.col("own_onset").is_not_null() & (end >= pl.col("own_onset"))
    wait_cov = own_cov | (pl.col("wait_onset").is_not_null() & (end >= pl.col("wait_onset")))
    return out.with_columns(
        pl.when(wait_cov if f in _WAITING else own_cov).then(0.0).otherwise(pl.col(f"z_{f}")).alias(f"z_{f}")
        for f in FEATURES
    ).drop("own_onset", "wait_onset")


def _group_members(groups: pl.DataFrame) -> pl.DataFrame:
    """(group name, rank) for every group except the world group, which would make every rank everyone's peer."""
    if groups.height == 0:
        return pl.DataFrame(schema={GroupField.NAME: pl.String, Steps.RANK: pl.Int32})
    return (groups.filter(pl.col(GroupField.KIND) != GroupKind.WORLD)
            .select(pl.col("group").alias(GroupField.NAME), pl.col(GroupField.RANKS).alias(Steps.RANK))
            .explode(Steps.RANK))


def _forest_scores(windows: pl.DataFrame, candidates: pl.DataFrame,
                   cfg: AnomalyConfig) -> tuple[np.ndarray, float]:
    """Isolation score s in (0, 1) of each candidate window, and the cut at or above which s marks an outlier.

    The forest is fitted on the candidates plus a deterministic random reference of at most `fit_windows` other
    windows, every tree on all of them: isolation only measures how far out a point is while the point is in the
    tree's sample (beyond the sample's range it lands in the leaf of the sample's most extreme point), so scoring
    candidates a forest never saw would rate z = 20 like z = 4. The cut is the larger of 0.5 (sklearn's
    contamination='auto' cut) and the score that only the `contamination` share of the reference reaches."""
    cols = [f"z_{f}" for f in FEATURES]
    cap = 4.0 * cfg.extreme_z  # beyond this, more extreme is not more informative
    rng = np.random.default_rng(cfg.random_state)
    is_candidate = windows.with_row_index("_i").join(
        candidates.select(Steps.RANK, "window"), on=[Steps.RANK, "window"], how="semi")["_i"].to_numpy()
    rest = np.setdiff1d(np.arange(windows.height), is_candidate)
    ref = np.sort(rng.choice(rest, min(cfg.fit_windows, rest.size), replace=False)) if rest.size else rest
    x_ref = windows.select(cols).to_numpy()[ref].clip(-cap, cap)
    x = candidates.select(cols).to_numpy().clip(-cap, cap)
    fit = np.concatenate([x_ref, x[: cfg.fit_windows]])
    forest = IsolationForest(n_estimators=cfg.n_estimators, max_samples=fit.shape[0], contamination="auto",
                             random_state=cfg.random_state, n_jobs=1)
    forest.fit(fit)
    cut = 0.5
    if x_ref.shape[0]:
        cut = max(cut, float(np.quantile(-forest.score_samples(x_ref), 1.0 - cfg.contamination)))
    return np.asarray(-forest.score_samples(x), dtype=np.float64), cut


def _incidents(flagged: pl.DataFrame, cfg: AnomalyConfig) -> list[Incident]:
    out: list[Incident] = []
    episode: list[dict[str, object]] = []
    for row in flagged.iter_rows(named=True):
        if episode and (row[Steps.RANK] != episode[-1][Steps.RANK] or row["window"] != episode[-1]["window"] + 1):  # type: ignore[operator]
            out.extend(_confirm(episode, cfg))
            episode = []
        episode.append(row)
    if episode:
        out.extend(_confirm(episode, cfg))
    return out


def _confirm(episode: list[dict[str, object]], cfg: AnomalyConfig) -> list[Incident]:
    """An incident for one rank's run of consecutive anomalous windows, if it is confirmed."""
    confirm_at = None
    for i, row in enumerate(episode):
        if i + 1 >= cfg.persist_windows or float(row["z_max"]) >= cfg.extreme_z:  # type: ignore[arg-type]
            confirm_at = i
            break
    if confirm_at is None:
        return []
    rank = int(episode[0][Steps.RANK])  # type: ignore[call-overload]
    first, confirm = episode[0], episode[confirm_at]
    stood_out = [f for f in FEATURES if any(abs(float(r[f"z_{f}"])) > cfg.z_threshold for r in episode)]  # type: ignore[arg-type]
    z_max = max(float(r["z_max"]) for r in episode)  # type: ignore[arg-type]
    confidence = 0.5 + 0.4 * min(1.0, (z_max - cfg.z_threshold) / cfg.z_threshold)
    rows = []
    for r in episode:
        for f in stood_out:
            rows.append((int(r["first_step"]), int(r["last_step"]), str(f), _num(r[f]), _num(r[f"p_{f}"]),  # type: ignore[call-overload]
                         round(float(r[f"z_{f}"]), 2), round(float(r["forest_score"]), 3)))  # type: ignore[arg-type]
    names = ", ".join(stood_out)
    return [Incident(
        klass=IncidentClass.UNCLASSIFIED,
        subject=Subject(kind=SubjectKind.RANK, id=str(rank)),
        ranks=(rank,),
        onset_step=int(first["first_step"]),  # type: ignore[call-overload]
        detection_step=int(confirm["last_step"]),  # type: ignore[call-overload]
        confidence=round(confidence, 4),
        cause=Cause.UNKNOWN,
        summary=(f"rank {rank}: unusual {names} against its role peers over {len(episode)} window(s) of "
                 f"{cfg.window_steps} steps from step {first['first_step']} (max robust z {z_max:.1f}); "
                 f"no known failure class explains it"),
        fields=tuple(str(f) for f in stood_out),
        evidence=(Evidence(
            source="anomaly.windows",
            summary=(f"window medians of rank {rank} vs the median of its role peers; z = robust z against all "
                     f"windows (|z| > {cfg.z_threshold:g} stands out); forest_score = isolation score s (outlier at s >= "
                     f"{float(confirm['forest_cut']):.3f})"),  # type: ignore[arg-type]
            columns=("first_step", "last_step", "feature", "value", "peer_median", "z", "forest_score"),
            rows=tuple(rows),
        ),),
    )]


def _num(v: object) -> float | None:
    return None if v is None else round(float(v), 4)  # type: ignore[arg-type]
