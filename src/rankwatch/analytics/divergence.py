"""Divergence: replicas of one consistency domain that stopped agreeing on step, RNG state or data position.

Ranks of a consistency domain (`fingerprints.domain`: the data-parallel replicas of one shard) must hold the same
step, RNG states and data position at every fingerprint, and therefore bitwise-identical parameters and optimizer
state. `fingerprint_departures` compares every fingerprint field across the members present at each fingerprint
step; `detect_divergence` turns the earliest departures into incidents under the majority rule:

- a strict majority of >= 3 members agrees -> the minority is blamed: one `Subject(RANK)` incident per rank, or,
  when the same data-parallel coordinate is the minority in several domains, ONE `Subject(REPLICA, "dp=<d>")`;
- no such majority (2 members, or a tie) -> `Subject(DOMAIN)` (or `Subject(JOB)` when every domain splits),
  all members, nobody blamed, lower confidence.

A disagreement only in parameter / optimizer hashes while step, RNG and data position agree is silent corruption,
not divergence: `analytics.corruption` reports it from the same departures.

The trajectory of ranks that replicate nothing: a rank whose state no other rank holds (pure FSDP2, FSDP x TP: a
one-member domain) still shares the job's trajectory with every such rank: the same step, the same random draws
where they are seeded alike, the same data position where they read alike. Their origin fields (RNG streams and
data position; never parameters or optimizer state, which differ by sharding) are compared across every such rank of
the attempt as one more domain, `trajectory:<ranks>` (`with_trajectory`), under the per-rank rule below for every one
of those fields, data position included: whatever differs there from the baseline by design (per-rank seeding, a
pipeline stage seeded apart, a tensor-parallel rank's own offset, a per-rank sampler) is compared by partition only.

Per-rank random streams: many scripts seed each rank differently on purpose (`torch.manual_seed(seed + rank)`), so an
RNG stream may differ across replicas from the start without anything having gone wrong. A stream whose values
already differ at a domain's baseline fingerprint of an attempt, with no strict majority there to blame a minority,
is per-rank by design (`per_rank_streams`): its values are not compared, but WHICH members agree is. The baseline
partition (members grouped by equal value) is the reference; a member whose value class later differs from its
baseline class (two members that differed now agree, or members that agreed now differ) departs as any other
field does; both sides of such a change are listed, since hashes cannot tell which one moved. A member of a class of
its own that moves to another value of its own is not seen: such a stream's values carry no expectation. A stream
that agreed at the baseline is compared value by value as always.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import polars as pl

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import CheckpointPhase, EventKind, Fingerprints

STEP = "step"
STATE_FIELDS: tuple[str, ...] = ("param", "optim")
"""Fields that differ as a consequence (divergence) or as the fault itself (corruption)."""
RNG_FIELDS: tuple[str, ...] = ("rng_python", "rng_numpy", "rng_torch", "rng_cuda")
"""Random streams: the fields a job may set apart per rank by design (`per_rank_streams`)."""
ORIGIN_FIELDS: tuple[str, ...] = ("step", *RNG_FIELDS, "data_position")
"""Fields whose disagreement is divergence, in the order a cause is picked from."""
FIELDS: tuple[str, ...] = ORIGIN_FIELDS + STATE_FIELDS
AFTER_RESTART = "after_restart"
AFTER_CHECKPOINT_LOAD = "after_checkpoint_load"

HASH_COLUMNS: dict[str, str] = {  # fingerprint field name -> column
    "rng_python": Fingerprints.RNG_PYTHON_HASH,
    "rng_numpy": Fingerprints.RNG_NUMPY_HASH,
    "rng_torch": Fingerprints.RNG_TORCH_HASH,
    "rng_cuda": Fingerprints.RNG_CUDA_HASH,
    "data_position": Fingerprints.DATA_POSITION,
    "param": Fingerprints.PARAM_HASH,
    "optim": Fingerprints.OPTIM_HASH,
}
_NULL = "\x00null"  # nulls (e.g. rng_cuda without CUDA) compare equal to each other
_AS_BASELINE = "\x00as at the baseline"  # a per-rank stream's member whose value class is its baseline class
_ABSENT = "\x00absent at the baseline:"  # + rank: a member without a row at the baseline step is a class of its own

DEPARTURE_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "domain": pl.String, "step": pl.Int64, "rank": pl.Int32, "field": pl.String, "minority": pl.Boolean,
    "majority": pl.Boolean, "members": pl.Int32, "wall_ns": pl.Int64, "value": pl.String,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class DivergenceConfig:
    min_majority_members: int = 3
    """Blame a minority only when at least this many members reported and a strict majority of them agree."""
    blamed_confidence: float = 0.9
    """Confidence of an incident that blames a minority: fingerprints are exact, so only a wrong majority (several
    replicas diverging identically) would make it wrong."""
    unblamed_confidence: float = 0.6
    """Confidence of a domain-/job-level incident without a majority: something diverged, but not who."""

    def __post_init__(self) -> None:
        if self.min_majority_members < 3:
            raise ValueError(f"DivergenceConfig.min_majority_members must be >= 3, got {self.min_majority_members}")
        for name in ("blamed_confidence", "unblamed_confidence"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DivergenceConfig.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PerRankStream:
    """A random stream that differs across a domain's members from its baseline fingerprint of an attempt: per-rank
    seeding. Its values are not compared across members; changes in which members agree are."""

    domain: str
    attempt: int
    field: str
    """One of `RNG_FIELDS`."""
    baseline_step: int
    """The fingerprint step whose partition of members by value is the reference (`per_rank_streams`)."""
    members: int
    """Members present at the baseline step."""
    classes: int
    """Distinct values among them (`members` when every rank seeds apart)."""


TRAJECTORY = "trajectory:"
"""The name prefix of the domain of ranks that replicate nothing (`with_trajectory`)."""
_TRAJECTORY_FIELDS: tuple[str, ...] = (*RNG_FIELDS, "data_position")
"""The fields a trajectory domain compares, each under the per-rank rule."""


def with_trajectory(frames: Frames) -> Frames:
    """`frames` with one more consistency domain per attempt: every rank whose own domain is itself alone, as
    `trajectory:<ranks>` (module docstring), its parameter and optimizer hashes blanked (sharded state is not
    compared). `frames` itself when fewer than two such ranks fingerprinted in any attempt."""
    fp = frames.fingerprints
    if fp.height == 0 or fp.filter(pl.col(Fingerprints.DOMAIN).str.starts_with(TRAJECTORY)).height:
        return frames
    alone = fp.filter(pl.col(Fingerprints.DOMAIN_RANKS).list.len() == 1).with_columns(
        pl.col(Fingerprints.ATTEMPT).fill_null(0).cast(pl.Int32).alias("_attempt"),
        pl.col(Fingerprints.RANK).cast(pl.Int32))
    if alone.height == 0:
        return frames
    # one trajectory per pipeline stage: ranks of one stage run the same code and draw alike; stages need not
    stage = frames.topology.select(pl.col("rank").cast(pl.Int32), pl.col("attempt").fill_null(0).cast(pl.Int32)
                                   .alias("_attempt"), pl.col("pp").fill_null(0).alias("_pp")).unique(
        ["rank", "_attempt"], keep="last")
    alone = alone.join(stage, on=["rank", "_attempt"], how="left").with_columns(pl.col("_pp").fill_null(0))
    key = ["_attempt", "_pp"]
    members = alone.group_by(key).agg(pl.col(Fingerprints.RANK).unique().sort().alias("_members"))
    members = members.filter(pl.col("_members").list.len() >= 2)
    if members.height == 0:
        return frames
    from rankwatch.collector.fingerprint import domain_name

    names = members.with_columns(pl.col("_members").map_elements(
        lambda m: TRAJECTORY + domain_name(list(m)).split(":", 1)[1], return_dtype=pl.String).alias("_name"))
    extra = alone.join(names, on=key, how="inner").with_columns(
        pl.col("_name").alias(Fingerprints.DOMAIN),
        pl.col("_members").cast(fp.schema[Fingerprints.DOMAIN_RANKS]).alias(Fingerprints.DOMAIN_RANKS),
        pl.lit(None, dtype=fp.schema[Fingerprints.PARAM_HASH]).alias(Fingerprints.PARAM_HASH),
        pl.lit(None, dtype=fp.schema[Fingerprints.OPTIM_HASH]).alias(Fingerprints.OPTIM_HASH),
    ).select(fp.columns).cast(fp.schema)
    return replace(frames, fingerprints=pl.concat([fp, extra], how="vertical"))


def per_rank_streams(frames: Frames, *, min_majority_members: int = 3) -> tuple[PerRankStream, ...]:
    """The random streams that are per-rank by design, per (domain, attempt), sorted.

    The baseline of a domain in an attempt is its earliest fingerprint step (in `frames`: a live window's first)
    that every member wrote, else its earliest with two or more members; a replayed step counts for its newest
    attempt only, as in `fingerprint_departures`. A stream is per-rank when its values differ there and no strict
    majority of >= `min_majority_members` members agrees (with one, the minority departs, as in any field: a rank
    that restored another RNG state at a restart is not per-rank seeding). So each attempt, a restart that restores
    every rank's own RNG state from a checkpoint included, is judged from its own first fingerprint.
    """
    fp = _latest_rows(with_trajectory(frames))
    if fp.height == 0:
        return ()
    base = _baselines(fp, min_majority_members)
    return tuple(
        PerRankStream(domain=d, attempt=int(a), field=f, baseline_step=int(s), members=int(m), classes=int(c))
        for d, a, f, s, m, c in base.select("domain", "attempt", "field", "baseline_step", "members", "classes")
        .unique().sort("domain", "attempt", "field").iter_rows()
    )


def per_rank_notes(streams: Sequence[PerRankStream]) -> tuple[str, ...]:
    """One line per random stream found per-rank in any domain, naming it and where, for an analysis to show."""
    by_field: dict[str, list[PerRankStream]] = {}
    for s in streams:
        by_field.setdefault(s.field, []).append(s)
    notes = []
    for field in _TRAJECTORY_FIELDS:
        found = by_field.get(field)
        if not found:
            continue
        domains = sorted({s.domain for s in found})
        where = f"domain {domains[0]}" if len(domains) == 1 else f"{len(domains)} domains"
        why = "per-rank seeding" if field in RNG_FIELDS else "a per-rank data stream"
        notes.append(f"{field} differs across the ranks of {where} from the first fingerprint: {why}, its values not "
                     "compared (a change in which ranks agree still is)")
    return tuple(notes)


def _latest_rows(frames: Frames) -> pl.DataFrame:
    """The fingerprint rows compared: a step's newest attempt, each (rank, domain, step)'s last row, domains of two or
    more members; with `attempt` (null as 0), `size` (members) and `present` (members with a row at the step)."""
    fp = frames.fingerprints
    if fp.height == 0:
        return fp
    fp = fp.with_columns(pl.col(Fingerprints.ATTEMPT).fill_null(0))
    # a step trained again is compared within its newest attempt only: while a replay is being written, some
    # ranks' rows of it are in and others' are still the replaced attempt's (which may hold the very fault the
    # replay undoes)
    fp = fp.filter(pl.col(Fingerprints.ATTEMPT)
                   == pl.col(Fingerprints.ATTEMPT).max().over(Fingerprints.DOMAIN, Fingerprints.STEP))
    fp = (
        fp.sort(Fingerprints.WALL_NS, nulls_last=False)
        .unique([Fingerprints.RANK, Fingerprints.DOMAIN, Fingerprints.STEP], keep="last", maintain_order=True)
        .with_columns(pl.col(Fingerprints.DOMAIN_RANKS).list.len().max().over(Fingerprints.DOMAIN).alias("size"))
        .filter(pl.col("size") >= 2)
    )
    return fp.with_columns(pl.len().over(Fingerprints.DOMAIN, Fingerprints.STEP).alias("present"))


def _baselines(fp: pl.DataFrame, min_majority_members: int) -> pl.DataFrame:
    """Per (domain, attempt, per-rank field, rank at the baseline step): `base`, the rank's value there; with
    `baseline_step`, `members` and `classes`. No row for a stream that is not per-rank."""
    key = [Fingerprints.DOMAIN, Fingerprints.ATTEMPT]
    candidates = fp.filter(pl.col("present") >= 2)
    full = pl.col(Fingerprints.STEP).filter(pl.col("present") >= pl.col("size")).min().over(key)
    at = candidates.with_columns(pl.coalesce(full, pl.col(Fingerprints.STEP).min().over(key)).alias("baseline_step"))
    at = at.filter(pl.col(Fingerprints.STEP) == pl.col("baseline_step"))
    parts = []
    for name in _TRAJECTORY_FIELDS:
        value = pl.col(HASH_COLUMNS[name]).cast(pl.String).fill_null(_NULL)
        rows = at if name in RNG_FIELDS else at.filter(pl.col(Fingerprints.DOMAIN).str.starts_with(TRAJECTORY))
        rows = rows.with_columns(value.alias("base")).with_columns(
            pl.col("base").n_unique().over(key).alias("classes"), pl.len().over([*key, "base"]).alias("count"),
        ).with_columns(pl.col("count").max().over(key).alias("top"))
        majority = (pl.col("present") >= min_majority_members) & (pl.col("top") * 2 > pl.col("present"))
        rows = rows.filter((pl.col("classes") > 1) & ~majority)
        parts.append(rows.select(
            pl.col(Fingerprints.DOMAIN).alias("domain"), pl.col(Fingerprints.ATTEMPT).cast(pl.Int32).alias("attempt"),
            pl.lit(name).alias("field"), pl.col(Fingerprints.RANK).cast(pl.Int32).alias("rank"), pl.col("base"),
            pl.col("baseline_step").cast(pl.Int64), pl.col("present").cast(pl.Int32).alias("members"),
            pl.col("classes").cast(pl.Int32),
        ))
    return pl.concat(parts)


def fingerprint_departures(frames: Frames, *, min_majority_members: int = 3) -> pl.DataFrame:
    """One row per (domain, fingerprint step, rank, field) where the domain's members disagree on that field.

    `minority` is true when a strict majority of >= `min_majority_members` present members holds another value
    (this rank departs from it); `majority` is true when the domain has such a majority at that step (rows of the
    majority itself are not listed). Without a majority every member present is listed with `minority` false.
    The `step` field flags fingerprints a rank wrote at a step most members never fingerprinted, before the
    domain's last common step (a shifted step counter); its `minority` follows the same rule. A step fingerprinted
    by several attempts (a replay) is read from its newest attempt's rows only. A random stream that is per-rank by
    design (`per_rank_streams`) is compared by which members share a value, not by the values: its rows are the
    members whose value class is no longer their baseline class, `value` their value.
    """
    fp = _latest_rows(frames)
    if fp.height == 0:
        return pl.DataFrame(schema=DEPARTURE_SCHEMA)
    key = [Fingerprints.DOMAIN, Fingerprints.STEP]
    parts: list[pl.DataFrame] = []

    # A shifted step counter: rows at steps fingerprinted by no more than half the domain, while the domain has
    # common steps after them (the newest, partially written step of a live run is not flagged).
    # A rank that holds every common step and has extra ones did not shift its counter: its peers lost rows (a
    # rank killed before its buffer reached disk), which a later replay's common steps would otherwise expose.
    common = pl.col("present") * 2 > pl.col("size")
    last_common = pl.col(Fingerprints.STEP).filter(common).max().over(Fingerprints.DOMAIN)
    n_common = pl.col(Fingerprints.STEP).filter(common).n_unique().over(Fingerprints.DOMAIN)
    has_common = pl.col(Fingerprints.STEP).filter(common).n_unique().over(Fingerprints.DOMAIN, Fingerprints.RANK)
    on_odd = fp.with_columns(last_common.alias("last_common"), n_common.alias("n_common"),
                             has_common.alias("has_n_common")).filter(
        ~common & (pl.col(Fingerprints.STEP) < pl.col("last_common"))
        & (pl.col("has_n_common").fill_null(0) < pl.col("n_common"))
    )
    if on_odd.height:
        # Report it at the common step the rank skipped (the majority's step at that moment) when there is one.
        commons = fp.filter(common).select(
            pl.col(Fingerprints.DOMAIN), pl.col(Fingerprints.STEP).alias("common_step")
        ).unique()
        has = fp.select(Fingerprints.RANK, Fingerprints.DOMAIN, pl.col(Fingerprints.STEP).alias("common_step"),
                        pl.lit(True).alias("has_common"))
        on_odd = (
            on_odd.join(
                on_odd.select(Fingerprints.DOMAIN, Fingerprints.STEP).unique()
                .join(commons, on=Fingerprints.DOMAIN, how="inner")
                .filter(pl.col("common_step") <= pl.col(Fingerprints.STEP))
                .group_by(Fingerprints.DOMAIN, Fingerprints.STEP).agg(pl.col("common_step").max()),
                on=[Fingerprints.DOMAIN, Fingerprints.STEP], how="left",
            )
            .sort(Fingerprints.STEP)
            .join(has, on=[Fingerprints.RANK, Fingerprints.DOMAIN, "common_step"], how="left")
            .with_columns(
                pl.col(Fingerprints.STEP).cast(pl.String).alias("value"),
                pl.when(pl.col("common_step").is_not_null() & pl.col("has_common").is_null())
                .then(pl.col("common_step")).otherwise(pl.col(Fingerprints.STEP)).alias(Fingerprints.STEP),
            )
            .unique([Fingerprints.RANK, Fingerprints.DOMAIN, Fingerprints.STEP], keep="first", maintain_order=True)
        )
        parts.append(
            on_odd.select(
                pl.col(Fingerprints.DOMAIN).alias("domain"), pl.col(Fingerprints.STEP).alias("step"),
                pl.col(Fingerprints.RANK).alias("rank"), pl.lit(STEP).alias("field"),
                (pl.col("size") >= min_majority_members).alias("minority"),
                (pl.col("size") >= min_majority_members).alias("majority"),
                pl.col("size").cast(pl.Int32).alias("members"), pl.col(Fingerprints.WALL_NS).alias("wall_ns"),
                pl.col("value"),
            )
        )

    on_common = fp.filter(pl.col("present") >= 2)
    baselines = _baselines(fp, min_majority_members)
    for name, column in HASH_COLUMNS.items():
        value = pl.col(column).cast(pl.String).fill_null(_NULL)
        rows = on_common.with_columns(value.alias("value"), value.alias("compared"))
        per_rank = baselines.filter(pl.col("field") == name)
        if per_rank.height:
            rows = _as_partition(rows, per_rank, key)
        counted = rows.with_columns(
            pl.len().over([*key, "compared"]).alias("count"),
            pl.col("compared").n_unique().over(key).alias("distinct"),
        ).with_columns(pl.col("count").max().over(key).alias("top"))
        majority = (pl.col("present") >= min_majority_members) & (pl.col("top") * 2 > pl.col("present"))
        rows = counted.filter(pl.col("distinct") > 1).with_columns(majority.alias("majority")).filter(
            ~pl.col("majority") | (pl.col("count") < pl.col("top"))
        )
        if rows.height:
            parts.append(
                rows.select(
                    pl.col(Fingerprints.DOMAIN).alias("domain"), pl.col(Fingerprints.STEP).alias("step"),
                    pl.col(Fingerprints.RANK).alias("rank"), pl.lit(name).alias("field"),
                    pl.col("majority").alias("minority"), pl.col("majority"),
                    pl.col("present").cast(pl.Int32).alias("members"), pl.col(Fingerprints.WALL_NS).alias("wall_ns"),
                    pl.col("value"),
                )
            )
    if not parts:
        return pl.DataFrame(schema=DEPARTURE_SCHEMA)
    return pl.concat([p.cast(DEPARTURE_SCHEMA) for p in parts]).sort("domain", "step", "rank", "field")  # type: ignore[arg-type]


def _as_partition(rows: pl.DataFrame, per_rank: pl.DataFrame, key: Sequence[str]) -> pl.DataFrame:
    """`compared` of a per-rank stream's rows: `_AS_BASELINE` where the member's value class at the step is its
    baseline class (among the members present at the step), else its value, so the majority rule then names the
    members whose class changed. Rows of (domain, attempt)s where the stream is not per-rank keep their value."""
    streams = per_rank.select(pl.col("domain").alias(Fingerprints.DOMAIN),
                              pl.col("attempt").alias(Fingerprints.ATTEMPT)).unique()
    bases = per_rank.select(pl.col("domain").alias(Fingerprints.DOMAIN), pl.col("attempt").alias(Fingerprints.ATTEMPT),
                            pl.col("rank").alias(Fingerprints.RANK), pl.col("base"))
    casts = {Fingerprints.ATTEMPT: pl.Int32, Fingerprints.RANK: pl.Int32}
    rows = rows.with_columns(pl.col(c).cast(t) for c, t in casts.items())
    inside = rows.join(streams.with_columns(pl.lit(True).alias("per_rank")), on=[Fingerprints.DOMAIN,
                       Fingerprints.ATTEMPT], how="left")
    inside = inside.join(bases, on=[Fingerprints.DOMAIN, Fingerprints.ATTEMPT, Fingerprints.RANK], how="left")
    base = pl.coalesce(pl.col("base"), pl.lit(_ABSENT) + pl.col(Fingerprints.RANK).cast(pl.String))
    # the class at the step equals the baseline class iff each lies within the other
    same = ((base.n_unique().over([*key, "value"]) == 1)
            & (pl.col("value").n_unique().over([*key, "base_or_absent"]) == 1))
    inside = inside.with_columns(base.alias("base_or_absent")).with_columns(
        pl.when(pl.col("per_rank").fill_null(False) & same).then(pl.lit(_AS_BASELINE))
        .otherwise(pl.col("value")).alias("compared"))
    return inside.drop("per_rank", "base", "base_or_absent")


def first_origin_steps(departures: pl.DataFrame) -> pl.DataFrame:
    """Per (domain, rank): the first step it shows a step / RNG / data-position disagreement (`origin_step`)."""
    return (
        departures.filter(pl.col("field").is_in(ORIGIN_FIELDS))
        .group_by("domain", "rank")
        .agg(pl.col("step").min().alias("origin_step"))
    )


def state_departures(frames: Frames, departures: pl.DataFrame) -> pl.DataFrame:
    """The parameter / optimizer-state departures that no step / RNG / data disagreement precedes, each with
    `divergent`: whether the departure is the replica's training process parting ways (divergence) rather than a
    wrong value in one device's memory (corruption).

    Under data parallelism every replica applies the same all-reduced gradient, so a value corrupted on one device
    (a flipped parameter bit) changes that rank's parameter hash only: its optimizer state, a function of the shared
    gradients, still agrees, and no other device is touched. A departure is therefore divergent when
    - its parameter AND optimizer hashes depart at the same first fingerprint (the replica applied another update:
      a skipped or doubled step, another gradient, another learning rate), or
    - the same data-parallel coordinate departs in two or more consistency domains (every shard of a replica: one
      device's fault cannot reach the others' memory). Without a majority (two replicas) the coordinate is unknown,
      so two or more domains splitting on state at all counts.
    A blamed rank's departure counts before its own first origin disagreement, an unblamed one before its domain's.
    """
    schema = {**DEPARTURE_SCHEMA, "onset": pl.Int64, "divergent": pl.Boolean}
    if departures.height == 0:
        return pl.DataFrame(schema=schema)
    rank_origin = first_origin_steps(departures)
    domain_origin = rank_origin.group_by("domain").agg(pl.col("origin_step").min().alias("domain_origin"))
    state = (
        departures.filter(pl.col("field").is_in(STATE_FIELDS))
        .join(rank_origin, on=["domain", "rank"], how="left")
        .join(domain_origin, on="domain", how="left")
        .filter(
            pl.when(pl.col("minority"))
            .then(pl.col("origin_step").is_null() | (pl.col("step") < pl.col("origin_step")))
            .otherwise(pl.col("domain_origin").is_null() | (pl.col("step") < pl.col("domain_origin")))
        )
        .drop("origin_step", "domain_origin")
    )
    if state.height == 0:
        return pl.DataFrame(schema=schema)
    key = ["domain", "rank", "minority"]
    state = state.with_columns(pl.col("step").min().over(key).alias("onset"))
    per = (
        state.group_by(key)
        .agg(pl.col("onset").first(),
             pl.col("field").filter(pl.col("step") == pl.col("onset")).n_unique().alias("at_onset"))
        .join(_dp_of(frames, state), on="rank", how="left")
    )
    blamed_domains = pl.col("domain").filter(pl.col("minority")).n_unique().over("dp")
    unblamed_domains = pl.col("domain").filter(~pl.col("minority")).n_unique()
    per = per.with_columns(
        (
            (pl.col("at_onset") >= len(STATE_FIELDS))
            | (pl.col("minority") & pl.col("dp").is_not_null() & (blamed_domains >= 2))
            | (~pl.col("minority") & (unblamed_domains >= 2))
        ).alias("divergent")
    )
    return state.join(per.select(*key, "divergent"), on=key, how="left").select(*schema).cast(schema)  # type: ignore[arg-type]


def detect_divergence(frames: Frames, config: DivergenceConfig = DivergenceConfig()) -> tuple[Incident, ...]:
    """Divergence incidents from the fingerprints: who departed first, on which fields, since which step.

    `onset_step` = `detection_step` = the first fingerprint step showing the departure (fingerprints are the only
    evidence, so the fault may lie anywhere since the previous fingerprint). `fields` lists every field the
    subject disagreed on from then on, plus 'after_restart' / 'after_checkpoint_load' when a restart or checkpoint
    load preceded the onset. A state departure with no step / RNG / data disagreement before it is divergence when
    `state_departures` calls it divergent (cause `STATE_MISMATCH`), else corruption (`analytics.corruption`).
    """
    frames = with_trajectory(frames)
    dep = fingerprint_departures(frames, min_majority_members=config.min_majority_members)
    if dep.height == 0:
        return ()
    origin = first_origin_steps(dep)
    # departures from the rank's (domain's) first origin disagreement on; state fields before it are corruption
    # unless they are divergent themselves
    parts = [dep.join(origin, on=["domain", "rank"], how="inner").filter(pl.col("step") >= pl.col("origin_step"))
             .drop("origin_step")]
    state = state_departures(frames, dep)
    parts.append(state.filter(pl.col("divergent")).drop("onset", "divergent"))
    dep = pl.concat([p.cast(DEPARTURE_SCHEMA) for p in parts]).unique(maintain_order=True)  # type: ignore[arg-type]
    if dep.height == 0:
        return ()
    return build_incidents(
        frames, dep, klass=IncidentClass.DIVERGENCE, onset_fields=FIELDS, config_blamed=config.blamed_confidence,
        config_unblamed=config.unblamed_confidence, what="diverged",
    )


def build_incidents(
    frames: Frames,
    dep: pl.DataFrame,
    *,
    klass: IncidentClass,
    onset_fields: Sequence[str],
    config_blamed: float,
    config_unblamed: float,
    what: str,
    cause_override: Cause | None = None,
) -> tuple[Incident, ...]:
    """Incidents from departure rows under the majority rule (shared with `analytics.corruption`).

    Onsets are taken from rows whose field is in `onset_fields`; every field seen from the onset on is listed.
    """
    dp_of = _dp_of(frames, dep)
    incidents: list[Incident] = []

    blamed = dep.filter(pl.col("minority"))
    if blamed.height:
        onsets = (
            blamed.filter(pl.col("field").is_in(list(onset_fields)))
            .group_by("domain", "rank").agg(pl.col("step").min().alias("onset"))
            .join(dp_of, on="rank", how="left")
        )
        by_dp: dict[int | None, list[tuple[str, int, int]]] = {}
        for domain, rank, onset, dp in onsets.select("domain", "rank", "onset", "dp").iter_rows():
            by_dp.setdefault(dp, []).append((domain, rank, onset))
        for dp, members in sorted(by_dp.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            domains = {d for d, _, _ in members}
            if dp is not None and len(domains) >= 2:
                incidents.append(_incident(
                    frames, blamed, klass, Subject(kind=SubjectKind.REPLICA, id=f"dp={dp}"), members, onset_fields,
                    config_blamed, what, blamed_=True, cause_override=cause_override,
                ))
            else:
                for m in members:
                    incidents.append(_incident(
                        frames, blamed, klass, Subject(kind=SubjectKind.RANK, id=str(m[1])), [m], onset_fields,
                        config_blamed, what, blamed_=True, cause_override=cause_override,
                    ))

    unblamed = dep.filter(~pl.col("majority"))
    if unblamed.height:
        onsets = (
            unblamed.filter(pl.col("field").is_in(list(onset_fields)))
            .group_by("domain", "rank").agg(pl.col("step").min().alias("onset"))
        )
        per_domain: dict[str, list[tuple[str, int, int]]] = {}
        for domain, rank, onset in onsets.select("domain", "rank", "onset").iter_rows():
            per_domain.setdefault(domain, []).append((domain, rank, onset))
        all_domains = set(
            frames.fingerprints.filter(pl.col(Fingerprints.DOMAIN_RANKS).list.len() >= 2)[Fingerprints.DOMAIN].unique()
        )
        if len(per_domain) >= 2 and set(per_domain) >= all_domains:
            members = [m for ms in per_domain.values() for m in ms]
            incidents.append(_incident(
                frames, unblamed, klass, Subject(kind=SubjectKind.JOB, id="job"), members, onset_fields,
                config_unblamed, what, blamed_=False, cause_override=cause_override,
            ))
        else:
            for domain, members in sorted(per_domain.items()):
                incidents.append(_incident(
                    frames, unblamed, klass, Subject(kind=SubjectKind.DOMAIN, id=domain), members, onset_fields,
                    config_unblamed, what, blamed_=False, cause_override=cause_override,
                ))
    return tuple(incidents)


def _dp_of(frames: Frames, dep: pl.DataFrame) -> pl.DataFrame:
    """rank -> data-parallel coordinate: from the topology, else the rank's position in its domain's member list."""
    topo = frames.topology
    if topo.height:
        return topo.select(pl.col("rank"), pl.col("dp").cast(pl.Int64)).unique("rank")
    rows = (
        frames.fingerprints.select(Fingerprints.RANK, Fingerprints.DOMAIN_RANKS)
        .unique(Fingerprints.RANK)
        .filter(pl.col(Fingerprints.RANK).is_in(dep["rank"].unique().implode()))
    )
    out = [(int(r), list(m).index(r) if r in m else None) for r, m in rows.iter_rows()]
    return pl.DataFrame(out, schema={"rank": pl.Int32, "dp": pl.Int64}, orient="row")


def _cause(fields_at_onset: Iterable[str], override: Cause | None) -> Cause:
    if override is not None:
        return override
    f = set(fields_at_onset)
    if STEP in f:
        return Cause.STEP_MISMATCH
    if f & {"rng_python", "rng_numpy", "rng_torch", "rng_cuda"}:
        return Cause.RNG_MISMATCH
    if "data_position" in f:
        return Cause.DATA_POSITION_MISMATCH
    return Cause.STATE_MISMATCH


def _incident(
    frames: Frames,
    dep: pl.DataFrame,
    klass: IncidentClass,
    subject: Subject,
    members: Sequence[tuple[str, int, int]],
    onset_fields: Sequence[str],
    confidence: float,
    what: str,
    *,
    blamed_: bool,
    cause_override: Cause | None,
) -> Incident:
    onset = min(o for _, _, o in members)
    keys = pl.DataFrame([(d, r, o) for d, r, o in members], schema={"domain": pl.String, "rank": pl.Int32, "onset": pl.Int64},
                        orient="row")
    rows = dep.join(keys, on=["domain", "rank"], how="inner").filter(pl.col("step") >= pl.col("onset"))
    seen = set(rows["field"].unique().to_list())
    at_onset = set(rows.filter((pl.col("step") == pl.col("onset")) & pl.col("field").is_in(list(onset_fields)))["field"])
    fields = [f for f in FIELDS if f in seen]
    wall = rows.filter(pl.col("step") == onset)["wall_ns"].min()
    onset_wall = int(wall) if wall is not None else None  # type: ignore[arg-type]
    ranks = sorted({r for _, r, _ in members})
    if not blamed_:
        domains = {d for d, _, _ in members}
        ranks = sorted(set(ranks) | set(_domain_members(frames, domains)))
    notes = _preceded_by(frames, {d for d, _, _ in members}, onset, onset_wall)
    good = _last_agreed(frames, {d for d, _, _ in members}, onset)
    fields += notes
    cause = _cause(at_onset, cause_override)
    who = f"{subject}" if blamed_ else f"{subject} (no majority: nobody is blamed)"
    summary = (
        f"{who} {what} at fingerprint step {onset} on {', '.join(f for f in fields if f not in notes)}"
        + (f"; preceded by {' and '.join(n.replace('_', ' ') for n in notes)}" if notes else "")
        + f"; ranks {short_ranks(ranks)}"
    )
    ev_rows = rows.sort("step", "rank", "field").head(20)
    evidence = (
        Evidence(
            source="fingerprints",
            summary=f"fingerprint fields where {'these ranks depart from the majority' if blamed_ else 'members disagree'}",
            columns=("domain", "step", "rank", "field", "value", "members"),
            rows=tuple(tuple(r) for r in ev_rows.select("domain", "step", "rank", "field", "value", "members").iter_rows()),
        ),
    )
    return Incident(
        klass=klass, subject=subject, ranks=tuple(ranks), onset_step=onset, detection_step=onset,
        confidence=confidence, cause=cause, summary=summary, detection_wall_ns=onset_wall, fields=tuple(fields),
        evidence=evidence, last_good_step=good,
    )


def _last_agreed(frames: Frames, domains: set[str], onset: int) -> int | None:
    """The domains' latest fingerprint step before `onset` (the last one known to agree: the departure's first
    fingerprint is the onset), None when there is none. The fault happened after it."""
    fp = frames.fingerprints.filter(pl.col(Fingerprints.DOMAIN).is_in(list(domains))
                                    & (pl.col(Fingerprints.STEP) < onset))
    step = fp[Fingerprints.STEP].max()
    return None if step is None else int(step)  # type: ignore[arg-type]


def _domain_members(frames: Frames, domains: set[str]) -> list[int]:
    fp = frames.fingerprints.filter(pl.col(Fingerprints.DOMAIN).is_in(list(domains)))
    return [int(r) for r in fp[Fingerprints.DOMAIN_RANKS].explode().drop_nulls().unique().to_list()]


def _preceded_by(frames: Frames, domains: set[str], onset: int, onset_wall: int | None) -> list[str]:
    """'after_restart' / 'after_checkpoint_load' when one happened after the domain's previous fingerprint (the last
    one known to agree) and no later than the onset fingerprint."""
    fp = frames.fingerprints.filter(pl.col(Fingerprints.DOMAIN).is_in(list(domains)))
    before = fp.filter(pl.col(Fingerprints.STEP) < onset)
    lo_step = before[Fingerprints.STEP].max()
    lo_wall = None if lo_step is None else before.filter(pl.col(Fingerprints.STEP) == lo_step)[Fingerprints.WALL_NS].min()
    hi_wall = onset_wall

    def within(wall: pl.Expr) -> pl.Expr:
        cond = pl.lit(True)
        if hi_wall is not None:
            cond = cond & (wall <= hi_wall)
        if lo_wall is not None:
            cond = cond & (wall >= lo_wall)
        return cond

    notes = []
    ev = frames.events
    restarts = ev.filter((pl.col("kind") == str(EventKind.START)) & (pl.col("attempt") > 0) & within(pl.col("wall_ns")))
    if restarts.height:
        notes.append(AFTER_RESTART)
    ck = frames.checkpoints
    loads = ck.filter((pl.col("phase") == str(CheckpointPhase.LOAD)) & within(pl.col("start_wall_ns")))
    if loads.height:
        notes.append(AFTER_CHECKPOINT_LOAD)
    return notes


def short_ranks(ranks: Sequence[int], limit: int = 16) -> str:
    """Up to `limit` ranks, comma-separated, then how many there are."""
    shown = ", ".join(map(str, ranks[:limit]))
    return shown + (f", ... ({len(ranks)} ranks)" if len(ranks) > limit else "")
