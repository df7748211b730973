"""Silent corruption: wrong values without an error.

Five traces, each a pure function of the frames:

- value mismatch: parameter / optimizer hashes disagree inside a consistency domain while step, RNG and data
  position agree, in a way one device's wrong value explains (`VALUE_MISMATCH`; majority rule as in
  `analytics.divergence`, which reports the other cases: `divergence.state_departures`);
- non-finite values: the rank(s) whose loss or local gradient norm is non-finite at the FIRST step any rank's is
  (`NON_FINITE`; one step later the all-reduce has spread it to everyone);
- non-finite state: the rank(s) whose own fingerprint first found NaN or inf in the parameters or optimizer state
  they hold (`EventKind.NONFINITE`, `NON_FINITE`): where the state is sharded (FSDP2) no rank holds a copy to
  disagree with, and an exponent bit flipped in a gradient leaves Adam's second moment infinite on that rank alone;
- outliers of the local, pre-all-reduce gradient norm (`GRAD_NORM_OUTLIER`): after the all-reduce replicas agree
  again, so this is the only trace a corrupted local computation leaves. Each rank's norm is compared with what
  the same step predicts for it (its shard's peers in the other replicas, corrected by how its own replica's other
  shards deviate: a long batch moves a whole replica), in units of the larger of its own recent noise and every
  rank's at the step, with a threshold bounded to x1.3..x4 (`blip_scores`). One blip of x4 or more is confirmed
  alone; smaller blips (x1.5-3 is typical of a flaky device) need a second on the same rank (`_confirmed`). The
  replica's loss at the same steps is corroboration, not a second incident; a loss outlier no gradient norm
  explains is one incident per replica (`LOSS_OUTLIER`);
- corroboration: a new ECC double-bit error or a hardware XID on the rank's device near the onset turns the cause
  into `HARDWARE_ERROR` and raises the confidence. A hardware error with no value anomaly is not an incident here.

One incident per fault: traces of one rank (a flipped parameter that also moves its gradient norm) are folded into
the first one found (`_one_per_fault`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import polars as pl

from rankwatch.analytics.divergence import STATE_FIELDS, build_incidents, fingerprint_departures, state_departures
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import EventKind, Fingerprints, Gpu, Steps

HARDWARE_XIDS: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95})
"""XIDs that mean a memory or device fault (48 DBE, 63/64 row remap, 74 NVLink, 79 fell off the bus, 92 high SBE
rate, 94/95 contained / uncontained ECC) rather than an application error (13, 31, 43, ...)."""

_MAD_SCALE = 1.4826  # MAD -> standard deviation for normal noise


@dataclass(frozen=True, kw_only=True, slots=True)
class CorruptionConfig:
    history_steps: int = 50
    """Steps of the rank's own history whose median absolute residual (the current step excluded) is its noise."""
    min_history: int = 5
    """Steps of own history needed before it is read; until then the spread of every rank at the step is the noise."""
    blip_ratio: float = 1.3
    """A residual is a blip only when the value is at least this factor off what its peers and its replica predict
    (up or down). Healthy residuals are a few percent (seen: <= x1.21 on the independent source's clean runs); a
    corrupted local computation is x1.5 or more."""
    mad_k: float = 8.0
    """... and more than this many robust standard deviations (MAD x 1.4826 of log residuals) of the larger of the
    rank's own recent noise and every rank's at that step."""
    max_ratio: float = 4.0
    """The threshold never rises above this factor however noisy the rank: a x4 residual is always a blip."""
    extreme_ratio: float = 4.0
    """A blip this far off is confirmed alone; smaller ones need `min_blips` blips of the same rank."""
    min_blips: int = 2
    """Blips of one rank within `blip_window_steps` that confirm a moderate (below `extreme_ratio`) outlier."""
    blip_window_steps: int = 200
    """... counted from a blip to the one that confirms it."""
    loss_near_steps: int = 1
    """A loss blip of the rank's replica within this many steps of a gradient-norm blip corroborates it."""
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
        if not 1.0 < self.blip_ratio <= self.max_ratio or self.extreme_ratio <= 1.0 or self.mad_k <= 0:
            raise ValueError(f"CorruptionConfig: need 1 < blip_ratio <= max_ratio, extreme_ratio > 1 and mad_k > 0, "
                             f"got {self.blip_ratio}, {self.max_ratio}, {self.extreme_ratio}, {self.mad_k}")
        if self.min_blips < 1 or self.blip_window_steps < 1 or self.loss_near_steps < 0:
            raise ValueError("CorruptionConfig: need min_blips >= 1, blip_window_steps >= 1, loss_near_steps >= 0")
        if self.hardware_before_steps < 0 or self.hardware_after_steps < 0:
            raise ValueError("CorruptionConfig: hardware windows must be >= 0 steps")
        for name in ("blamed_confidence", "unblamed_confidence", "non_finite_confidence", "hardware_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"CorruptionConfig.{name} must be in [0, 1], got {getattr(self, name)}")


def detect_corruption(frames: Frames, config: CorruptionConfig = CorruptionConfig()) -> tuple[Incident, ...]:
    """Corruption incidents: value mismatches, first non-finite ranks, local grad-norm / loss outliers; each rank
    incident upgraded to `HARDWARE_ERROR` when a new device error corroborates it."""
    hw = hardware_errors(frames)
    found: list[tuple[Incident, int | None]] = list(_value_mismatch(frames, config))
    found += [(inc, None) for inc in (*_non_finite(frames, config), *_outliers(frames, config))]
    # the fingerprints' non-finite state last: the coarsest trace (once per fingerprint), and every replica's when
    # a corrupted gradient was all-reduced, which the per-step traces above may already have blamed on its rank
    found += list(_non_finite_state(frames, config))
    return tuple(_corroborate(inc, hw, lo, config) for inc, lo in _one_per_fault(found))


def _one_per_fault(found: list[tuple[Incident, int | None]]) -> list[tuple[Incident, int | None]]:
    """One incident per fault: a later trace (in the order value mismatch, non-finite, gradient norm, loss,
    non-finite state) on ranks an earlier incident already names is the same fault seen again (a flipped parameter
    also moves the rank's gradient norm; a rank goes non-finite after blipping; a corrupted gradient all-reduced
    leaves every replica's optimizer state infinite); it is folded into that incident's evidence."""
    out: list[tuple[Incident, int | None]] = []
    for inc, lo in found:
        into = next((i for i, (o, _) in enumerate(out) if set(o.ranks) & set(inc.ranks)), None)
        if into is None:
            out.append((inc, lo))
            continue
        o, olo = out[into]
        also = f"{inc.cause} from step {inc.onset_step}"
        out[into] = (replace(
            o, id="", fields=o.fields + tuple(f for f in inc.fields if f not in o.fields),
            evidence=o.evidence + inc.evidence, summary=f"{o.summary}; also {also}",
        ), olo)
    return out


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


def _non_finite_state(frames: Frames, config: CorruptionConfig) -> list[tuple[Incident, int | None]]:
    """The ranks whose own fingerprint first found non-finite values in the parameters or optimizer state they hold
    (`EventKind.NONFINITE`), at the first fingerprint step any rank did: the only trace a wrong value leaves where no
    other rank holds a copy (a fully sharded state) and the loss is not recorded. Every rank at once (a non-finite
    gradient all-reduced to every replica) blames nobody. The fault came after the previous fingerprint."""
    ev = frames.events
    rows = ev.filter(pl.col("kind") == str(EventKind.NONFINITE)) if ev.height else ev
    if rows.height == 0 or rows["step"].drop_nulls().len() == 0:
        return []
    first = int(rows["step"].min())  # type: ignore[arg-type]
    at_first = rows.filter(pl.col("step") == first).sort("rank", "wall_ns").unique("rank", keep="first",
                                                                                     maintain_order=True)
    culprits = [int(r) for r in at_first["rank"]]
    fp = frames.fingerprints
    reporting = fp.filter(pl.col(Fingerprints.STEP) == first)[Fingerprints.RANK].n_unique() if fp.height else 0
    before = fp.filter(pl.col(Fingerprints.STEP) < first)[Fingerprints.STEP].max() if fp.height else None
    good = int(before) if before is not None else None  # type: ignore[arg-type]
    onset = good + 1 if good is not None else first
    evidence = Evidence(
        source="events", summary=f"ranks whose fingerprint at step {first} found non-finite values in the state they "
                                 "hold, the first fingerprint any rank did",
        columns=("rank", "step", "wall_ns", "message"),
        rows=tuple((int(r), int(st), int(w), str(m)) for r, st, w, m in
                   at_first.select("rank", "step", "wall_ns", "message").iter_rows()),
    )
    wall = at_first["wall_ns"].min()
    wall_ns = int(wall) if wall is not None else None  # type: ignore[arg-type]
    since = f"since step {onset}" if good is not None else f"by step {first}"
    if len(culprits) >= 2 and len(culprits) >= reporting:
        return [(Incident(
            klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.JOB, id="job"), ranks=tuple(culprits),
            onset_step=onset, detection_step=first, confidence=config.unblamed_confidence, cause=Cause.NON_FINITE,
            summary=f"every rank holds non-finite parameters or optimizer state {since} (found at step {first}): "
                    "nobody is blamed (numerics, or a value all-reduced to every replica)",
            detection_wall_ns=wall_ns, fields=("state",), evidence=(evidence,), last_good_step=good,
        ), good)]
    return [(Incident(
        klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.RANK, id=str(r)), ranks=(r,),
        onset_step=onset, detection_step=first, confidence=config.non_finite_confidence, cause=Cause.NON_FINITE,
        summary=f"rank {r} holds non-finite parameters or optimizer state {since} (found at step {first}; "
                f"{len(culprits)} of {reporting} ranks), which no other rank's values explain",
        detection_wall_ns=wall_ns, fields=("state",), evidence=(evidence,), last_good_step=good,
    ), good) for r in culprits]


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

BLIP_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "rank": pl.Int32, "step": pl.Int64, "dp": pl.Int32, "value": pl.Float64, "expected": pl.Float64,
    "residual": pl.Float64, "scale": pl.Float64, "threshold": pl.Float64, "blip": pl.Boolean, "end_wall_ns": pl.Int64,
}


def blip_scores(frames: Frames, column: str, config: CorruptionConfig = CorruptionConfig(), *,
                by_replica: bool = True) -> pl.DataFrame:
    """Per rank per step, `column` (local_grad_norm or loss) against what the same step's other ranks predict.

    `expected` is the value of its peers (the ranks of the same pipeline stage and tp shard in the other replicas:
    the same model shard on other data; their median, or the other one's value when there are two), times, with
    `by_replica`, the median deviation of its own replica's other shards from their peers when the replica has
    >= 3 ranks (a long or short batch moves every shard of a replica together, so peers in other replicas are
    comparable only in expectation; the loss is the replica's own, so it is read without). `residual` =
    ln(value / expected); `scale` = the robust standard deviation (1.4826 x median |residual|) of the larger of the
    rank's previous `history_steps` residuals and every rank's at the step. `blip` when |residual| > `threshold` =
    mad_k x scale bounded to [ln blip_ratio, ln max_ratio]."""
    topo = frames.topology
    s = frames.steps.select(Steps.RANK, Steps.STEP, Steps.END_WALL_NS, column).filter(
        pl.col(column).is_not_null() & pl.col(column).is_finite() & (pl.col(column) > 0)
    )
    if s.height == 0:
        return pl.DataFrame(schema=BLIP_SCHEMA)
    if topo.height:
        coords = topo.select(pl.col("rank").cast(pl.Int32), pl.col("dp").cast(pl.Int32),
                             pl.format("pp{}.tp{}", pl.col("pp"), pl.col("tp")).alias("_peers")).unique("rank")
        s = s.join(coords, on=Steps.RANK, how="left")
    else:
        s = s.with_columns(pl.lit(None, dtype=pl.Int32).alias("dp"), pl.lit(None, dtype=pl.String).alias("_peers"))
    s = s.with_columns(pl.col("_peers").fill_null("all"), pl.col(column).log().alias("_x"))
    peers = ["_peers", Steps.STEP]
    n = pl.len().over(peers)
    peer_ref = pl.when(n >= 3).then(pl.col("_x").median().over(peers)).otherwise(
        (pl.col("_x").sum().over(peers) - pl.col("_x")) / (n - 1)  # two members: the other one's value
    )
    s = s.filter(n >= 2).with_columns((pl.col("_x") - peer_ref).alias("_r"))
    if by_replica:
        replica = ["dp", Steps.STEP]
        m = pl.len().over(replica)
        s = s.with_columns(
            pl.when(pl.col("dp").is_not_null() & (m >= 3)).then(pl.col("_r").median().over(replica))
            .otherwise(0.0).alias("_rep")
        )
    else:
        s = s.with_columns(pl.lit(0.0).alias("_rep"))
    s = s.with_columns((pl.col("_r") - pl.col("_rep")).alias("residual"))
    s = s.sort(Steps.RANK, Steps.STEP).with_columns(
        pl.col("residual").abs().shift(1)
        .rolling_median(window_size=config.history_steps, min_samples=config.min_history).over(Steps.RANK)
        .alias("_own"),
        pl.col("residual").abs().median().over(Steps.STEP).alias("_step"),
    )
    scale = _MAD_SCALE * pl.max_horizontal("_own", "_step")
    lo, hi = math.log(config.blip_ratio), math.log(config.max_ratio)
    threshold = (config.mad_k * pl.col("scale")).clip(lo, hi)
    return s.with_columns(scale.alias("scale")).with_columns(threshold.alias("threshold")).select(
        pl.col(Steps.RANK).alias("rank"), pl.col(Steps.STEP).alias("step"), "dp",
        pl.col(column).alias("value"), (pl.col("_x") - pl.col("residual")).exp().alias("expected"), "residual",
        "scale", "threshold", (pl.col("residual").abs() > pl.col("threshold")).fill_null(False).alias("blip"),
        pl.col(Steps.END_WALL_NS).alias("end_wall_ns"),
    ).cast(BLIP_SCHEMA)  # type: ignore[arg-type]


def _confirmed(blips: pl.DataFrame, config: CorruptionConfig) -> tuple[int, int] | None:
    """(onset, confirming) blip steps of one rank: the first blip at least `extreme_ratio` off, or the first that
    completes `min_blips` within `blip_window_steps`; the onset is the earliest blip counted. None: unconfirmed."""
    steps = blips["step"].to_list()
    extreme = math.log(config.extreme_ratio)
    for i, (step, res) in enumerate(zip(steps, blips["residual"].to_list())):
        window = [s for s in steps[: i + 1] if s > step - config.blip_window_steps]
        if abs(res) >= extreme or len(window) >= config.min_blips:
            return window[0], step
    return None


def _blip_rows(rows: pl.DataFrame) -> tuple[tuple[object, ...], ...]:
    return tuple(
        (int(r), int(st), round(v, 6), round(e, 6), round(math.exp(res), 3), round(abs(res) / sc, 1) if sc else None)
        for r, st, v, e, res, sc in rows.select("rank", "step", "value", "expected", "residual", "scale").iter_rows()
    )


_BLIP_COLUMNS = ("rank", "step", "value", "expected", "factor", "robust_z")


def _outliers(frames: Frames, config: CorruptionConfig) -> list[Incident]:
    """Gradient-norm outliers (one incident per confirmed rank, its replica's loss blips at the same steps as
    corroboration), then loss outliers no gradient-norm incident explains (one per replica)."""
    out: list[Incident] = []
    gn = blip_scores(frames, Steps.LOCAL_GRAD_NORM, config).filter(pl.col("blip")).sort("rank", "step")
    # Corroboration asks less than an incident: a loss residual past mad_k robust sd, whatever its size (the loss
    # averages the whole replica's batch, so a corrupted shard moves it by less than its own gradient norm).
    loss = blip_scores(frames, Steps.LOSS, config, by_replica=False).filter(
        pl.col("blip") | (pl.col("residual").abs() > config.mad_k * pl.col("scale"))).sort("rank", "step")
    explained: list[pl.DataFrame] = []  # loss blips a gradient-norm incident accounts for
    near = config.loss_near_steps
    for (rank,), rows in gn.group_by("rank", maintain_order=True):
        hit = _confirmed(rows, config)
        if hit is None:
            continue
        onset, confirm = hit
        rows = rows.filter(pl.col("step") >= onset)
        first = rows.row(0, named=True)
        dp = first["dp"]
        lrows = loss.clear()
        if dp is not None and loss.height:
            lrows = (loss.filter(pl.col("dp") == dp).join(rows.select(pl.col("step").alias("_gn")), how="cross")
                     .filter((pl.col("step") - pl.col("_gn")).abs() <= near)
                     .drop("_gn").unique(["rank", "step"]).sort("step", "rank"))
        explained.append(lrows)
        factor = math.exp(first["residual"])
        direction = "above" if factor > 1 else "below"
        fields: tuple[str, ...] = (str(Steps.LOCAL_GRAD_NORM),)
        evidence = [Evidence(
            source=f"steps.{Steps.LOCAL_GRAD_NORM}",
            summary=("blips: the local gradient norm against what its peers (same shard, other replicas) and its "
                     "replica (other shards) predict at the step; factor = value / expected, robust_z in units of the "
                     "larger of its own recent noise and every rank's at the step"),
            columns=_BLIP_COLUMNS, rows=_blip_rows(rows),
        )]
        loss_note = ""
        if lrows.height:
            fields += (str(Steps.LOSS),)
            evidence.append(Evidence(
                source=f"steps.{Steps.LOSS}",
                summary=f"loss blips of replica dp={dp} within {near} step(s) of the gradient-norm blips",
                columns=_BLIP_COLUMNS, rows=_blip_rows(lrows),
            ))
            loss_note = f"; its replica's loss blipped at {lrows['step'].n_unique()} of those steps"
        out.append(Incident(
            klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(int(rank),),
            onset_step=onset, detection_step=confirm, confidence=config.blamed_confidence, cause=Cause.GRAD_NORM_OUTLIER,
            summary=f"rank {rank}'s local gradient norm at step {onset} was x{max(factor, 1 / factor):.2f} {direction} "
                    f"what its peers and replica predicted; {rows.height} blip(s) from then on, confirmed at step "
                    f"{confirm}{loss_note}",
            detection_wall_ns=int(rows.filter(pl.col("step") == confirm)["end_wall_ns"][0] or 0) or None,
            fields=fields, evidence=tuple(evidence),
        ))
    if loss.height:
        rest = loss.filter(pl.col("blip"))
        rest = rest.join(pl.concat(explained), on=["rank", "step"], how="anti") if explained else rest
        out.extend(_loss_outliers(rest, config))
    return out


def _loss_outliers(loss: pl.DataFrame, config: CorruptionConfig) -> list[Incident]:
    """Loss blips confirmed per replica (the ranks of a replica's last stage share its loss): RANK subject when one
    rank carries it, else REPLICA."""
    out: list[Incident] = []
    loss = loss.with_columns(pl.coalesce(pl.col("dp").cast(pl.String), pl.format("r{}", pl.col("rank"))).alias("_g"))
    for (_,), rows in loss.sort("step", "rank").group_by("_g", maintain_order=True):
        per_step = rows.group_by("step", maintain_order=True).agg(pl.col("residual").first())
        hit = _confirmed(per_step, config)
        if hit is None:
            continue
        onset, confirm = hit
        rows = rows.filter(pl.col("step") >= onset)
        ranks = sorted(set(rows["rank"].to_list()))
        dp = rows["dp"][0]
        subject = (Subject(kind=SubjectKind.RANK, id=str(ranks[0])) if len(ranks) == 1
                   else Subject(kind=SubjectKind.REPLICA, id=f"dp={dp}"))
        first = rows.row(0, named=True)
        factor = math.exp(first["residual"])
        out.append(Incident(
            klass=IncidentClass.CORRUPTION, subject=subject, ranks=tuple(ranks), onset_step=onset,
            detection_step=confirm, confidence=config.blamed_confidence, cause=Cause.LOSS_OUTLIER,
            summary=f"{subject}'s loss at step {onset} was x{max(factor, 1 / factor):.2f} "
                    f"{'above' if factor > 1 else 'below'} its peers'; {rows['step'].n_unique()} blip step(s), "
                    f"confirmed at step {confirm}",
            detection_wall_ns=int(rows.filter(pl.col("step") == confirm)["end_wall_ns"][0] or 0) or None,
            fields=(str(Steps.LOSS),),
            evidence=(Evidence(source=f"steps.{Steps.LOSS}", summary="loss blips against the same shard's peers",
                               columns=_BLIP_COLUMNS, rows=_blip_rows(rows)),),
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
