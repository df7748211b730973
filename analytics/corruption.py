"""Silent corruption: wrong values without an error.

Four traces, each a pure function of the frames:

- value mismatch: parameter / optimizer hashes disagree inside a consistency domain while step, RNG and data
  position agree (`VALUE_MISMATCH`; majority rule as in `analytics.divergence`, which reports the other case);
- non-finite values: the rank(s) whose loss or local gradient norm is non-finite at the FIRST step any rank's is
  (`NON_FINITE`; one step later the all-reduce has spread it to everyone);
- outliers of the local, pre-all-reduce gradient norm or of the loss, against the rank's own recent history AND
  its peers at the same step (`GRAD_NORM_OUTLIER` / `LOSS_OUTLIER`): after the all-reduce replicas agree again,
  so this is the only trace a corrupted local computation leaves;
- corroboration: a new ECC double-bit error or a hardware XID on the rank's device near the onset turns the cause
  into `HARDWARE_ERROR` and raises the confidence. A hardware error with no value anomaly is not an incident here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import polars as pl

from rankwatch.analytics.divergence import STATE_FIELDS, build_incidents, fingerprint_departures, state_departures
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.collector.schema import Fingerprints, Gpu, Steps

HARDWARE_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95})
"""XIDs that mean a memory or device fault (48 DBE, 63/64 row remap, 74 NVLink, 79 fell off the bus, 92 high SBE
rate, 94/95 contained / uncontained ECC) rather than an application error (13, 31, 43, ...)."""

_MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise


@dataclass(frozen=True, kw_only=True, slots=True)
class CorruptionConfig:
    history_steps: int = 20
    """Steps of the rank's own history the rolling median / MAD are taken over (the current step excluded)."""
    min_history: int = 5
    """Steps of history needed before a value can be an outlier against it."""
    min_ratio: float = 4.0
    """A value is an outlier only when it is at least this factor away from both references (own history and
    peers), up or down. Training noise is 10-20 % and the downward trend of grad norms is slow, so x4 leaves a
    wide margin while a corrupted local computation is typically x10 or more off."""
    mad_k: float = 6.0
    """... and more than this many robust standard deviations (MAD x 1.4826, in log space) from each reference."""
    hardware_before_steps: int = 5
    """A new ECC DBE / XID up to this many steps before the onset corroborates it (fingerprint onsets: before the
    previous fingerprint step)."""
    hardware_after_steps: int = 2
    """... or up to this many steps after it (the counter is read asynchronously)."""
    blamed_confidence: float = 0.85
    """Confidence of a blamed value mismatch / outlier without hardware corroboration."""
    unblamed_confidence: float = 0.55
    """Confidence of a domain/job-level value mismatch (no majority) or of an all-ranks non-finite step."""
    non_finite_confidence: float = 0.9
    """Confidence of a non-finite culprit: direct evidence, but a numerically unstable rank is not a fault."""
    hardware_confidence: float = 0.97
    """Confidence once a new hardware error on the device corroborates the anomaly."""

    def __post_init__(self) -> None:
        if self.history_steps < 3 or not 1 <= self.min_history <= self.history_steps:
            raise ValueError(f"CorruptionConfig: need history_steps >= 3 and 1 <= min_history <= history_steps, "
                             f"got {self.history_steps}, {self.min_history}")
        if self.min_ratio <= 1.0 or self.mad_k <= 0:
            raise ValueError(f"CorruptionConfig: min_ratio must be > 1 and mad_k > 0, got {self.min_ratio}, {self.mad_k}")
        if self.hardware_before_steps < 0 or self.hardware_after_steps < 0:
            raise ValueError("CorruptionConfig: hardware windows must be >= 0 steps")
        for name in ("blamed_confidence", "unblamed_confidence", "non_finite_confidence", "hardware_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"CorruptionConfig.{name} must be in [0, 1], got {getattr(self, name)}")


def detect_corruption(frames: Frames, config: CorruptionConfig = CorruptionConfig()) -> tuple[Incident, ...]:
    """Corruption incidents: value mismatches, first non-finite ranks, local grad-norm / loss outliers; each rank
    incident upgraded to `HARDWARE_ERROR` when a new device error corroborates it."""
    hw = hardware_errors(frames)
    out: list[Incident] = []
    for inc, lo in _value_mismatch(frames, config):
        out.append(_corroborate(inc, hw, lo, config))
    for inc in _non_finite(frames, config):
        out.append(_corroborate(inc, hw, None, config))
    for inc in _outliers(frames, config):
        out.append(_corroborate(inc, hw, None, config))
    return tuple(out)


# -- value mismatch -------------------------------------------------------------------------------------------------

def _value_mismatch(frames: Frames, config: CorruptionConfig) -> list[tuple[Incident, int | None]]:
    dep = fingerprint_departures(frames)
    if dep.height == 0:
        return []
    # Only before any step/RNG/data disagreement (after one, state differences are its consequence), and only
    # departures one device's fault can explain (`state_departures`: the others are divergence).
    state = state_departures(frames, dep).filter(~pl.col("divergent")).drop("onset", "divergent")
    if state.height == 0:
        return []
    incidents = build_incidents(
        frames, state, klass=IncidentClass.CORRUPTION, onset_fields=STATE_FIELDS,
        config_blamed=config.blamed_confidence, config_unblamed=config.unblamed_confidence,
        what="holds different parameter/optimizer state while step, RNG and data position agree",
        cause_override=Cause.VALUE_MISMATCH,
    )
    fp_steps = frames.fingerprints[Fingerprints.STEP].unique().sort()
    out = []
    for inc in incidents:
        prev = fp_steps.filter(fp_steps < (inc.onset_step or 0)).max()
        out.append((inc, int(prev) if prev is not None else None))  # type: ignore[arg-type]
    return out


# -- non-finite ------------------------------------------------------------------------------------------------------

def _non_finite(frames: Frames, config: CorruptionConfig) -> list[Incident]:
    s = frames.steps
    if s.height == 0:
        return []
    bad = ~pl.col(Steps.ALL_FINITE).fill_null(True)
    for col in (Steps.LOSS, Steps.LOCAL_GRAD_NORM):
        bad = bad | (pl.col(col).is_not_null() & ~pl.col(col).is_finite().fill_null(True))
    rows = s.filter(bad)
    if rows.height == 0:
        return []
    first = int(rows[Steps.STEP].min())  # type: ignore[arg-type]
    at_first = rows.filter(pl.col(Steps.STEP) == first).sort(Steps.RANK)
    culprits = [int(r) for r in at_first[Steps.RANK].unique().sort()]
    reporting = s.filter(pl.col(Steps.STEP) == first)[Steps.RANK].n_unique()
    ev = Evidence(
        source="steps",
        summary=f"ranks with a non-finite loss or local gradient norm at step {first}, the first step any rank had one",
        columns=("rank", "step", "loss", "local_grad_norm", "all_finite"),
        rows=tuple(
            (int(r), int(st), _json_float(lo), _json_float(g), f)
            for r, st, lo, g, f in at_first.select(Steps.RANK, Steps.STEP, Steps.LOSS, Steps.LOCAL_GRAD_NORM,
                                                   Steps.ALL_FINITE).iter_rows()
        ),
    )
    wall = at_first[Steps.END_WALL_NS].min()
    wall_ns = int(wall) if wall is not None else None  # type: ignore[arg-type]
    if len(culprits) >= 2 and len(culprits) == reporting:
        return [Incident(
            klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=tuple(culprits),
            onset_step=first, detection_step=first, confidence=config.unblamed_confidence, cause=Cause.NON_FINITE,
            summary=f"every rank went non-finite at step {first} at once: nobody is blamed (numerics, not a device)",
            detection_wall_ns=wall_ns, fields=("loss", "local_grad_norm"), evidence=(ev,),
        )]
    return [
        Incident(
            klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.RANK, id=str(r)), ranks=(r,),
            onset_step=first, detection_step=first, confidence=config.non_finite_confidence, cause=Cause.NON_FINITE,
            summary=f"rank {r} was non-finite at step {first}, the first step any rank was "
                    f"({len(culprits)} of {reporting} ranks); the all-reduce spreads it to all afterwards",
            detection_wall_ns=wall_ns, fields=_non_finite_fields(at_first.filter(pl.col(Steps.RANK) == r)),
            evidence=(ev,),
        )
        for r in culprits
    ]


def _non_finite_fields(rows: pl.DataFrame) -> tuple[str, ...]:
    out = []
    for col in (Steps.LOSS, Steps.LOCAL_GRAD_NORM):
        v = rows[col]
        if v.is_not_null().any() and (~v.drop_nulls().is_finite()).any():
            out.append(str(col))
    return tuple(out) or (str(Steps.ALL_FINITE),)


def _json_float(v: float | None) -> float | str | None:
    return v if v is None or math.isfinite(v) else str(v)


# -- outliers --------------------------------------------------------------------------------------------------------

def outlier_scores(frames: Frames, column: str, config: CorruptionConfig = CorruptionConfig()) -> pl.DataFrame:
    """Per rank per step, `column` (local_grad_norm or loss) in log space against two references: the rank's own
    previous `history_steps` (rolling median / MAD) and its peers at the same step (median / MAD over the ranks of
    its consistency domain: same tp shard and pipeline stage). `own_dev` / `peer_dev` are log10 deviations
    (1.0 = a factor of 10 above, -1.0 = 10 below); `outlier` is true when both exceed the thresholds."""
    s = frames.steps.select(Steps.RANK, Steps.STEP, Steps.END_WALL_NS, column).filter(
        pl.col(column).is_not_null() & pl.col(column).is_finite() & (pl.col(column) > 0)
    )
    if s.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int32, "step": pl.Int64, "value": pl.Float64, "own_dev": pl.Float64,
                                    "peer_dev": pl.Float64, "outlier": pl.Boolean, "end_wall_ns": pl.Int64})
    peers = _peer_key(frames)
    s = s.join(peers, on=Steps.RANK, how="left").with_columns(pl.col("peer_group").fill_null("all"))
    x = pl.col(column).log10()
    w, m = config.history_steps, config.min_history
    s = s.sort(Steps.RANK, Steps.STEP).with_columns(x.alias("x"))
    s = s.with_columns(
        pl.col("x").shift(1).rolling_median(window_size=w, min_samples=m).over(Steps.RANK).alias("own_med"),
    ).with_columns((pl.col("x") - pl.col("own_med")).abs().alias("_absdev")).with_columns(
        pl.col("_absdev").shift(1).rolling_median(window_size=w, min_samples=m).over(Steps.RANK).alias("own_mad"),
    )
    key = ["peer_group", Steps.STEP]
    n = pl.len().over(key)
    peer_med = pl.when(n >= 3).then(pl.col("x").median().over(key)).otherwise(
        (pl.col("x").sum().over(key) - pl.col("x")) / (n - 1)  # two members: the other one's value
    )
    s = s.with_columns(n.alias("_n"), peer_med.alias("peer_med")).with_columns(
        (pl.col("x") - pl.col("peer_med")).abs().median().over(key).alias("peer_mad")
    )
    lim = math.log10(config.min_ratio)
    own_dev = pl.col("x") - pl.col("own_med")
    peer_dev = pl.col("x") - pl.col("peer_med")
    own_ok = own_dev.abs() > pl.max_horizontal(pl.lit(lim), config.mad_k * _MAD_SCALE * pl.col("own_mad"))
    peer_ok = peer_dev.abs() > pl.max_horizontal(pl.lit(lim), config.mad_k * _MAD_SCALE * pl.col("peer_mad"))
    return s.select(
        pl.col(Steps.RANK).alias("rank"), pl.col(Steps.STEP).alias("step"), pl.col(column).alias("value"),
        own_dev.alias("own_dev"), peer_dev.alias("peer_dev"),
        (own_ok & peer_ok & (pl.col("_n") >= 2)).fill_null(False).alias("outlier"),
        pl.col(Steps.END_WALL_NS).alias("end_wall_ns"),
    )


def _peer_key(frames: Frames) -> pl.DataFrame:
    topo = frames.topology
    if topo.height:
        return topo.select(
            pl.col("rank").cast(pl.Int32), pl.format("pp{}.tp{}", pl.col("pp"), pl.col("tp")).alias("peer_group"),
        ).unique("rank")
    return pl.DataFrame(schema={"rank": pl.Int32, "peer_group": pl.String})


def _outliers(frames: Frames, config: CorruptionConfig) -> list[Incident]:
    out: list[Incident] = []
    for column, cause, label in ((Steps.LOCAL_GRAD_NORM, Cause.GRAD_NORM_OUTLIER, "local gradient norm"),
                                 (Steps.LOSS, Cause.LOSS_OUTLIER, "loss")):
        scores = outlier_scores(frames, column, config)
        hits = scores.filter(pl.col("outlier"))
        if hits.height == 0:
            continue
        firsts = hits.group_by("rank").agg(pl.col("step").min().alias("onset"), pl.len().alias("n")).sort("rank")
        for rank, onset, n in firsts.iter_rows():
            rows = hits.filter(pl.col("rank") == rank).sort("step")
            first = rows.row(0, named=True)
            factor = 10 ** abs(first["peer_dev"])
            direction = "above" if first["peer_dev"] > 0 else "below"
            out.append(Incident(
                klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
                onset_step=onset, detection_step=onset, confidence=config.blamed_confidence, cause=cause,
                summary=f"rank {rank}'s {label} at step {onset} was x{factor:.1f} {direction} its peers and "
                        f"x{10 ** abs(first['own_dev']):.1f} off its own recent history ({n} outlier step(s))",
                detection_wall_ns=first["end_wall_ns"], fields=(str(column),),
                evidence=(Evidence(
                    source=f"steps.{column}",
                    summary="outlier steps: log10 deviation from own rolling median and from peers' median",
                    columns=("rank", "step", "value", "own_dev", "peer_dev"),
                    rows=tuple(rows.select("rank", "step", "value", "own_dev", "peer_dev").iter_rows()),
                ),),
            ))
    return out


# -- hardware corroboration ------------------------------------------------------------------------------------------

def hardware_errors(frames: Frames) -> pl.DataFrame:
    """Per rank per step with a NEW device error: an increase of the cumulative ECC double-bit counter over the
    rank's previous sample, or a hardware XID (`HARDWARE_XIDS`). Steady nonzero counters are not new errors."""
    g = frames.gpu
    schema: dict[str, pl.DataType | type[pl.DataType]] = {"rank": pl.Int32, "step": pl.Int64, "device_uuid": pl.String, "new_dbe": pl.Int64, "xids": pl.List(pl.Int32)}
    if g.height == 0:
        return pl.DataFrame(schema=schema)
    g = g.sort(Gpu.RANK, Gpu.STEP).with_columns(
        (pl.col(Gpu.ECC_DBE_VOLATILE) - pl.col(Gpu.ECC_DBE_VOLATILE).shift(1).over(Gpu.RANK))
        .fill_null(0).clip(lower_bound=0).alias("new_dbe"),
        pl.col(Gpu.XID_EVENTS).fill_null([]).list.eval(
            pl.element().filter(pl.element().is_in(list(HARDWARE_XIDS)))
        ).alias("xids"),
    )
    return g.filter((pl.col("new_dbe") > 0) | (pl.col("xids").list.len() > 0)).select(
        pl.col(Gpu.RANK).alias("rank"), pl.col(Gpu.STEP).alias("step"), pl.col(Gpu.DEVICE_UUID).alias("device_uuid"),
        "new_dbe", "xids",
    ).cast(schema)  # type: ignore[arg-type]


def _corroborate(inc: Incident, hw: pl.DataFrame, lo_step: int | None, config: CorruptionConfig) -> Incident:
    if hw.height == 0 or inc.onset_step is None or inc.subject.kind not in (SubjectKind.RANK, SubjectKind.REPLICA):
        return inc
    lo = (lo_step if lo_step is not None else inc.onset_step) - config.hardware_before_steps
    hi = inc.onset_step + config.hardware_after_steps
    near = hw.filter(pl.col("rank").is_in(list(inc.ranks)) & pl.col("step").is_between(lo, hi)).sort("step")
    if near.height == 0:
        return inc
    what = []
    if (near["new_dbe"] > 0).any():
        what.append("ecc_dbe_volatile")
    if (near["xids"].list.len() > 0).any():
        what.append("xid_events")
    ev = Evidence(
        source="gpu",
        summary=f"new device errors on {inc.subject} within steps {lo}..{hi} of the onset",
        columns=("rank", "step", "device_uuid", "new_dbe", "xids"),
        rows=tuple((r, s, u, d, list(x)) for r, s, u, d, x in near.iter_rows()),
    )
    return replace(
        inc, id="", cause=Cause.HARDWARE_ERROR, confidence=max(inc.confidence, config.hardware_confidence),
        fields=inc.fields + tuple(what), evidence=inc.evidence + (ev,),
        summary=f"{inc.summary}; corroborated by new {' and '.join(what)} on the device (was {inc.cause})",
    )
