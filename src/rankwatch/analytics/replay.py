"""Replay verification: a step trained again after a rollback must end in the state the first attempt reached.

A resume from a checkpoint replays the steps an earlier attempt had trained past it. When the lineage expects the
replay to be bitwise (same layout, code, config, determinism inputs), every fingerprint the replay takes at a step
an earlier attempt also fingerprinted must equal that attempt's, field by field. `replay_comparisons` lists every
such pair; `detect_replay_divergence` turns the mismatches into one divergence incident per (attempt, earlier
attempt): "replayed step N differs from attempt K: param, optim", onset at the first differing step.

Pairs whose consistency domain changed membership (a resume onto another dp degree) are not compared: such a resume
is CHANGED in the lineage already, and its replay is not expected to match. Nor are steps at and after the first
step where the earlier attempt's own replicas disagreed, or at and after a later attempt's `replay_basis` event (a
recovery that undid a state fault records where the fault may have begun: a corrupt gradient all-reduced into every
replica leaves them agreeing): a rollback that undoes a divergence or a corruption must end elsewhere than the
attempt it undoes, and that is the recovery working, not a nondeterministic replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from rankwatch.analytics.divergence import FIELDS, HASH_COLUMNS, short_ranks
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import EventKind, Fingerprints

__all__ = ["COMPARISON_SCHEMA", "ReplayCheck", "detect_replay_divergence", "replay_bases", "replay_checks",
           "replay_comparisons"]

COMPARISON_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "rank": pl.Int32, "step": pl.Int64, "domain": pl.String, "attempt": pl.Int32, "earlier_attempt": pl.Int32,
    "fields": pl.List(pl.String), "wall_ns": pl.Int64,
}
"""One row per (rank, step, attempt, earlier attempt) compared; `fields` lists what differs (empty: bitwise equal)."""

_NULL = "\x00null"


def replay_comparisons(frames: Frames) -> pl.DataFrame:
    """Every replayed fingerprint compared with each earlier attempt's fingerprint of the same rank and step."""
    rp = frames.replays
    if rp.height == 0:
        return pl.DataFrame(schema=COMPARISON_SCHEMA)
    cols = {name: pl.col(column).cast(pl.String).fill_null(_NULL) for name, column in HASH_COLUMNS.items()}
    base = rp.select(
        pl.col(Fingerprints.RANK), pl.col(Fingerprints.STEP), pl.col(Fingerprints.ATTEMPT),
        pl.col(Fingerprints.DOMAIN), pl.col(Fingerprints.DOMAIN_RANKS).list.sort().alias("members"),
        pl.col(Fingerprints.WALL_NS), *[e.alias(n) for n, e in cols.items()],
    )
    earlier = base.rename({c: f"{c}_e" for c in base.columns if c not in (Fingerprints.RANK, Fingerprints.STEP)})
    # An earlier attempt is a reference only up to the first step its own replicas disagreed at: a rollback that
    # undoes a divergence (the reason for many rollbacks) must differ from what it undoes.
    key = [Fingerprints.ATTEMPT, Fingerprints.DOMAIN, Fingerprints.STEP]
    split = base.group_by(key).agg([pl.col(n).n_unique().alias(n) for n in cols]).filter(
        pl.any_horizontal([pl.col(n) > 1 for n in cols]))
    diverged = split.group_by(Fingerprints.ATTEMPT, Fingerprints.DOMAIN).agg(
        pl.col(Fingerprints.STEP).min().alias("diverged_from")).rename(
        {Fingerprints.ATTEMPT: f"{Fingerprints.ATTEMPT}_e", Fingerprints.DOMAIN: f"{Fingerprints.DOMAIN}_e"})
    pairs = base.join(earlier, on=[Fingerprints.RANK, Fingerprints.STEP], how="inner").filter(
        (pl.col(f"{Fingerprints.ATTEMPT}_e") < pl.col(Fingerprints.ATTEMPT))
        & (pl.col(f"{Fingerprints.DOMAIN}_e") == pl.col(Fingerprints.DOMAIN))
        & (pl.col("members_e") == pl.col("members"))
    ).join(diverged, on=[f"{Fingerprints.ATTEMPT}_e", f"{Fingerprints.DOMAIN}_e"], how="left").filter(
        pl.col("diverged_from").is_null() | (pl.col(Fingerprints.STEP) < pl.col("diverged_from")))
    # Nor after a recovery's replay basis: an attempt that undid a state fault its replicas all agreed on (a bad
    # gradient all-reduced into every rank) says where the attempts it replaced stop being a reference.
    for undoing, from_step in replay_bases(frames):
        pairs = pairs.filter(~((pl.col(f"{Fingerprints.ATTEMPT}_e") < undoing)
                               & (pl.col(Fingerprints.ATTEMPT) >= undoing) & (pl.col(Fingerprints.STEP) >= from_step)))
    if pairs.height == 0:
        return pl.DataFrame(schema=COMPARISON_SCHEMA)
    differing = pl.concat_list([
        pl.when(pl.col(n) != pl.col(f"{n}_e")).then(pl.lit(n)).otherwise(pl.lit(None, dtype=pl.String))
        for n in FIELDS if n in HASH_COLUMNS
    ]).list.drop_nulls()
    return pairs.select(
        pl.col(Fingerprints.RANK).cast(pl.Int32).alias("rank"), pl.col(Fingerprints.STEP).alias("step"),
        pl.col(Fingerprints.DOMAIN).alias("domain"), pl.col(Fingerprints.ATTEMPT).cast(pl.Int32).alias("attempt"),
        pl.col(f"{Fingerprints.ATTEMPT}_e").cast(pl.Int32).alias("earlier_attempt"), differing.alias("fields"),
        pl.col(Fingerprints.WALL_NS).alias("wall_ns"),
    ).sort("attempt", "earlier_attempt", "step", "rank")


def replay_bases(frames: Frames) -> tuple[tuple[int, int], ...]:
    """(attempt, step) of every `replay_basis` event: the attempts before `attempt` are a replay reference for it
    and its successors only before `step`."""
    ev = frames.events
    if ev.height == 0:
        return ()
    rows = ev.filter(pl.col("kind") == str(EventKind.REPLAY_BASIS)).select("attempt", "step").drop_nulls().unique()
    return tuple(sorted((int(a), int(s)) for a, s in rows.iter_rows()))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayCheck:
    """What replay verification found for one attempt against one earlier attempt."""

    attempt: int
    earlier_attempt: int
    first_step: int
    """First step compared."""
    last_step: int
    """Last step compared."""
    steps: int
    """Distinct steps compared."""
    ranks: tuple[int, ...]
    """Ranks compared."""
    broken_step: int | None
    """First step whose replay differs; None: every compared fingerprint is bitwise equal."""
    fields: tuple[str, ...] = ()
    """Fields that differ at `broken_step`, in `divergence.FIELDS` order."""
    broken_ranks: tuple[int, ...] = ()
    """Ranks that differ at `broken_step`."""
    broken_domains: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        return self.broken_step is None

    def describe(self) -> str:
        span = f"step {self.first_step}" if self.first_step == self.last_step else \
            f"steps {self.first_step}..{self.last_step}"
        if self.held:
            return (f"attempt {self.attempt} replayed {span} bitwise equal to attempt {self.earlier_attempt} "
                    f"({self.steps} fingerprinted step(s), {len(self.ranks)} rank(s))")
        return (f"replayed step {self.broken_step} differs from attempt {self.earlier_attempt}: "
                f"{', '.join(self.fields)} (attempt {self.attempt}, ranks {short_ranks(self.broken_ranks)})")


def replay_checks(frames: Frames) -> tuple[ReplayCheck, ...]:
    """One `ReplayCheck` per (attempt, earlier attempt) whose fingerprints overlap, oldest first."""
    cmp = replay_comparisons(frames)
    out: list[ReplayCheck] = []
    for (attempt, earlier), g in cmp.group_by(["attempt", "earlier_attempt"], maintain_order=True):
        bad = g.filter(pl.col("fields").list.len() > 0)
        steps = g["step"]
        check = ReplayCheck(attempt=int(attempt), earlier_attempt=int(earlier),
                            first_step=int(steps.min()), last_step=int(steps.max()),  # type: ignore[arg-type]
                            steps=int(steps.n_unique()), ranks=tuple(sorted(set(g["rank"].to_list()))),
                            broken_step=None)
        if bad.height:
            first = int(bad["step"].min())  # type: ignore[arg-type]
            at = bad.filter(pl.col("step") == first)
            seen = set(at["fields"].explode().to_list())
            check = ReplayCheck(
                attempt=check.attempt, earlier_attempt=check.earlier_attempt, first_step=check.first_step,
                last_step=check.last_step, steps=check.steps, ranks=check.ranks, broken_step=first,
                fields=tuple(f for f in FIELDS if f in seen), broken_ranks=tuple(sorted(set(at["rank"].to_list()))),
                broken_domains=tuple(sorted(set(at["domain"].to_list()))),
            )
        out.append(check)
    return tuple(sorted(out, key=lambda c: (c.attempt, c.earlier_attempt)))


def detect_replay_divergence(frames: Frames, confidence: float = 0.95) -> tuple[Incident, ...]:
    """One divergence incident per broken `ReplayCheck`: the replay left the trajectory the earlier attempt took
    (cause `NONDETERMINISTIC_REPLAY`). `confidence` is high: a bitwise-unequal fingerprint of the same step is
    direct evidence, not an inference."""
    cmp = replay_comparisons(frames)
    incidents = []
    all_domains = set(frames.fingerprints[Fingerprints.DOMAIN].unique().to_list())
    for check in replay_checks(frames):
        if check.held:
            continue
        assert check.broken_step is not None
        domains = set(check.broken_domains)
        subject = Subject(kind=SubjectKind.JOB, id="job") if len(domains) > 1 and domains >= all_domains else \
            Subject(kind=SubjectKind.DOMAIN, id=sorted(domains)[0]) if len(domains) == 1 else \
            Subject(kind=SubjectKind.JOB, id="job")
        rows = cmp.filter((pl.col("attempt") == check.attempt) & (pl.col("earlier_attempt") == check.earlier_attempt)
                          & (pl.col("fields").list.len() > 0)).sort("step", "rank")
        wall = rows.filter(pl.col("step") == check.broken_step)["wall_ns"].min()
        evidence = Evidence(
            source="fingerprints",
            summary=f"fingerprints of attempt {check.attempt} that differ from attempt {check.earlier_attempt}'s "
                    "at the same rank and step",
            columns=("step", "rank", "domain", "attempt", "earlier_attempt", "fields"),
            rows=tuple((s, r, d, a, e, ",".join(f)) for s, r, d, a, e, f in
                       rows.head(20).select("step", "rank", "domain", "attempt", "earlier_attempt", "fields").iter_rows()),
        )
        incidents.append(Incident(
            klass=IncidentClass.DIVERGENCE, subject=subject, ranks=check.broken_ranks, onset_step=check.broken_step,
            detection_step=check.broken_step, confidence=confidence, cause=Cause.NONDETERMINISTIC_REPLAY,
            summary=check.describe() + "; the lineage's bitwise promise does not hold",
            detection_wall_ns=int(wall) if wall is not None else None,  # type: ignore[arg-type]
            fields=check.fields, evidence=(evidence,),
        ))
    return tuple(incidents)

