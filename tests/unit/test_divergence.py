"""Divergence from hand-built fingerprints: who departs, on what, since when, and the majority rule."""

from __future__ import annotations

import polars as pl
import pytest

from rankwatch.analytics.corruption import detect_corruption
from rankwatch.analytics.divergence import (
    DivergenceConfig, PerRankStream, detect_divergence, per_rank_notes, per_rank_streams,
)
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind

S = 1_000_000_000
FP_STEPS = range(0, 60, 10)


def _layout(dp: int, pp: int) -> tuple[pl.DataFrame, dict[int, list[int]]]:
    """rank = dp_coord + dp * pp_coord; one consistency domain per stage: 'dp.pp<k>.tp0'."""
    topo = pl.DataFrame([{"rank": d + dp * p, "world_size": dp * pp, "dp": d, "tp": 0, "pp": p, "role": f"pp={p}"}
                         for p in range(pp) for d in range(dp)])
    return topo, {p: [d + dp * p for d in range(dp)] for p in range(pp)}


def _fingerprints(domains: dict[int, list[int]], change: dict[tuple[int, str], int] | None = None) -> pl.DataFrame:
    """Identical fingerprints everywhere, except (rank, field) -> from that step on the rank's value differs."""
    change = change or {}
    rows = []
    for p, members in domains.items():
        for r in members:
            for s in FP_STEPS:
                def v(field: str, base: str) -> str:
                    since = change.get((r, field))
                    return f"{base}-bad" if since is not None and s >= since else base
                rows.append({
                    "rank": r, "step": s, "wall_ns": s * S + r, "domain": f"dp.pp{p}.tp0", "domain_ranks": members,
                    "param_hash": v("param", f"p{p}-{s}"), "optim_hash": v("optim", f"o{p}-{s}"),
                    "rng_python_hash": f"py{s}", "rng_numpy_hash": f"np{s}", "rng_torch_hash": v("rng_torch", f"t{s}"),
                    "rng_cuda_hash": None,
                    "data_position": s * 32 + (7 if (r, "data_position") in change and s >= change[(r, "data_position")] else 0),
                })
    return pl.DataFrame(rows)


def test_single_rank_of_four_replicas_is_blamed() -> None:
    topo, domains = _layout(dp=4, pp=1)
    fp = _fingerprints(domains, {(2, "rng_torch"): 30, (2, "param"): 40})
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.ranks) == (IncidentClass.DIVERGENCE, SubjectKind.RANK, "2", (2,))
    assert inc.cause is Cause.RNG_MISMATCH and inc.onset_step == inc.detection_step == 30
    assert inc.fields == ("rng_torch", "param")
    assert detect_corruption(Frames.build(topology=topo, fingerprints=fp)) == ()  # the param change is a consequence


def test_whole_replica_across_domains_is_one_replica_incident() -> None:
    topo, domains = _layout(dp=4, pp=4)
    replica = [3 + 4 * p for p in range(4)]
    fp = _fingerprints(domains, {(r, "data_position"): 20 for r in replica} | {(r, "param"): 30 for r in replica})
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    assert (inc.subject.kind, inc.subject.id, inc.ranks) == (SubjectKind.REPLICA, "dp=3", tuple(replica))
    assert inc.cause is Cause.DATA_POSITION_MISMATCH and inc.onset_step == 20


def test_two_replicas_no_majority_blames_nobody() -> None:
    topo, domains = _layout(dp=2, pp=1)
    fp = _fingerprints(domains, {(1, "rng_torch"): 20})
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    assert (inc.subject.kind, inc.subject.id, inc.ranks) == (SubjectKind.DOMAIN, "dp.pp0.tp0", (0, 1))
    assert inc.confidence < DivergenceConfig().blamed_confidence and "nobody is blamed" in inc.summary


def test_every_domain_split_without_majority_is_one_job_incident() -> None:
    topo, domains = _layout(dp=2, pp=2)
    fp = _fingerprints(domains, {(1, "rng_torch"): 20, (3, "rng_torch"): 20})
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    assert (inc.subject.kind, inc.ranks) == (SubjectKind.JOB, (0, 1, 2, 3))


def test_restart_before_onset_is_flagged() -> None:
    topo, domains = _layout(dp=4, pp=1)
    fp = _fingerprints(domains, {(1, "rng_torch"): 30})
    events = pl.DataFrame([{"rank": r, "attempt": 1, "wall_ns": 25 * S, "kind": "start"} for r in range(4)])
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp, events=events))
    assert "after_restart" in inc.fields and "restart" in inc.summary
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    assert "after_restart" not in inc.fields


def test_param_only_mismatch_is_corruption_not_divergence() -> None:
    topo, domains = _layout(dp=4, pp=1)
    fp = _fingerprints(domains, {(1, "param"): 30, (1, "optim"): 40})
    frames = Frames.build(topology=topo, fingerprints=fp)
    assert detect_divergence(frames) == ()
    (inc,) = detect_corruption(frames)
    assert (inc.klass, inc.subject.id, inc.cause, inc.onset_step) == (IncidentClass.CORRUPTION, "1", Cause.VALUE_MISMATCH, 30)
    assert inc.fields == ("param", "optim")


def test_a_replica_whose_whole_state_departs_diverged() -> None:
    """Parameters and optimizer state of every shard of one replica depart, step/RNG/data agreeing: the replica
    applied another update (divergence), not a wrong value on one device (corruption)."""
    topo, domains = _layout(dp=4, pp=4)
    replica = [2 + 4 * p for p in range(4)]
    fp = _fingerprints(domains, {(r, f): 30 for r in replica for f in ("param", "optim")})
    frames = Frames.build(topology=topo, fingerprints=fp)
    (inc,) = detect_divergence(frames)
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.ranks) == (
        IncidentClass.DIVERGENCE, SubjectKind.REPLICA, "dp=2", tuple(replica))
    assert (inc.cause, inc.onset_step) == (Cause.STATE_MISMATCH, 30)
    assert detect_corruption(frames) == ()


def test_param_only_departure_on_every_shard_of_a_replica_diverged() -> None:
    topo, domains = _layout(dp=4, pp=2)
    replica = [1, 5]
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(r, "param"): 20 for r in replica}))
    (inc,) = detect_divergence(frames)
    assert (inc.subject.kind, inc.subject.id, inc.cause) == (SubjectKind.REPLICA, "dp=1", Cause.STATE_MISMATCH)
    assert detect_corruption(frames) == ()


def test_one_rank_whose_param_and_optimizer_depart_at_once_diverged() -> None:
    topo, domains = _layout(dp=4, pp=1)
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(3, "param"): 20, (3, "optim"): 20}))
    (inc,) = detect_divergence(frames)
    assert (inc.subject.kind, inc.subject.id, inc.cause, inc.fields) == (
        SubjectKind.RANK, "3", Cause.STATE_MISMATCH, ("param", "optim"))
    assert detect_corruption(frames) == ()


def test_two_replicas_splitting_on_state_in_every_domain_is_a_job_divergence() -> None:
    topo, domains = _layout(dp=2, pp=2)
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(1, "param"): 20, (3, "param"): 20}))
    (inc,) = detect_divergence(frames)
    assert (inc.subject.kind, inc.cause) == (SubjectKind.JOB, Cause.STATE_MISMATCH)
    assert detect_corruption(frames) == ()
    # one domain splitting on parameters only: a value on one device, nobody blamed
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(1, "param"): 20}))
    assert detect_divergence(frames) == ()
    (inc,) = detect_corruption(frames)
    assert (inc.subject.kind, inc.cause) == (SubjectKind.DOMAIN, Cause.VALUE_MISMATCH)


def test_shifted_step_counter() -> None:
    topo, domains = _layout(dp=4, pp=1)
    fp = _fingerprints(domains)
    fp = fp.with_columns(pl.when((pl.col("rank") == 2) & (pl.col("step") >= 30)).then(pl.col("step") + 1)
                         .otherwise(pl.col("step")).alias("step"))
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=fp))
    # reported at the common step it skipped (30), where the majority was
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("2", Cause.STEP_MISMATCH, 30)


def test_agreement_and_single_member_domains_give_nothing() -> None:
    topo, domains = _layout(dp=4, pp=2)
    assert detect_divergence(Frames.build(topology=topo, fingerprints=_fingerprints(domains))) == ()
    topo, domains = _layout(dp=1, pp=2)
    fp = _fingerprints(domains, {(1, "rng_torch"): 10})
    assert detect_divergence(Frames.build(topology=topo, fingerprints=fp)) == ()


def _sharded(change: dict[tuple[int, str], int] | None = None, *, per_rank: tuple[str, ...] = (),
             world: int = 4) -> pl.DataFrame:
    """Fully sharded state (FSDP2 over the world): each rank its own domain, its own parameter and optimizer hashes;
    its RNG stream and data position as the job seeds them (alike, or per rank for the fields in `per_rank`)."""
    change = change or {}
    rows = []
    for r in range(world):
        for s in FP_STEPS:
            def v(field: str, base: str) -> str:
                since = change.get((r, field))
                own = f"{base}-r{r}" if field in per_rank else base
                return f"{own}-bad" if since is not None and s >= since else own
            rows.append({
                "rank": r, "step": s, "wall_ns": s * S + r, "domain": f"replicas:{r}", "domain_ranks": [r],
                "param_hash": f"p{r}-{s}", "optim_hash": f"o{r}-{s}", "rng_python_hash": v("rng_python", f"py{s}"),
                "rng_numpy_hash": f"np{s}", "rng_torch_hash": v("rng_torch", f"t{s}"), "rng_cuda_hash": None,
                "data_position": s * 32 + (1000 * r if "data_position" in per_rank else 0)
                + (7 if (r, "data_position") in change and s >= change[(r, "data_position")] else 0),
            })
    return pl.DataFrame(rows)


def test_ranks_that_replicate_nothing_still_share_a_trajectory_and_its_departure_is_blamed() -> None:
    # found on FSDP2 (issue 31): an extra random draw on one rank was not seen, each rank being a domain of its own
    topo, _ = _layout(dp=4, pp=1)
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=_sharded({(1, "rng_torch"): 30})))
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.ranks) == (IncidentClass.DIVERGENCE, SubjectKind.RANK,
                                                                         "1", (1,))
    assert inc.cause is Cause.RNG_MISMATCH and inc.onset_step == 30 and inc.fields == ("rng_torch",)
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=_sharded({(2, "data_position"): 20})))
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("2", Cause.DATA_POSITION_MISMATCH, 20)
    # sharded parameters differ by design: never compared; nothing else moved
    assert detect_divergence(Frames.build(topology=topo, fingerprints=_sharded())) == ()
    assert detect_corruption(Frames.build(topology=topo, fingerprints=_sharded())) == ()


def test_a_trajectory_seeded_per_rank_or_split_by_pipeline_stage_is_not_a_divergence() -> None:
    topo, _ = _layout(dp=4, pp=1)
    per_rank = _sharded(per_rank=("rng_python", "data_position"))
    assert detect_divergence(Frames.build(topology=topo, fingerprints=per_rank)) == ()
    notes = per_rank_notes(per_rank_streams(Frames.build(topology=topo, fingerprints=per_rank)))
    assert [n.split(" ", 1)[0] for n in notes] == ["rng_python", "data_position"] and "trajectory:0-3" in notes[0]
    # a per-rank stream whose partition changes (two ranks that differed now agree) still departs
    moved = per_rank.with_columns(pl.when((pl.col("rank") == 3) & (pl.col("step") >= 40))
                                  .then(pl.col("rng_python_hash").str.replace("-r3", "-r2"))
                                  .otherwise(pl.col("rng_python_hash")).alias("rng_python_hash"))
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=moved))
    assert inc.onset_step == 40 and set(inc.ranks) >= {2, 3}
    # pipeline stages run different code and need not draw alike: one trajectory per stage
    topo, _ = _layout(dp=1, pp=4)
    assert detect_divergence(Frames.build(topology=topo, fingerprints=_sharded({(1, "rng_torch"): 30}))) == ()
    topo, _ = _layout(dp=2, pp=2)
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=_sharded({(1, "rng_torch"): 30})))
    assert (inc.subject.kind, inc.ranks) == (SubjectKind.DOMAIN, (0, 1))  # two in its stage: nobody blamed


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_majority_members"):
        DivergenceConfig(min_majority_members=2)


def test_a_sampled_departure_says_the_last_fingerprint_that_agreed() -> None:
    # fingerprints every 10 steps: a departure first seen at 30 may have begun anywhere after 20
    topo, domains = _layout(dp=4, pp=1)
    (inc,) = detect_divergence(Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(2, "rng_torch"): 30})))
    assert (inc.onset_step, inc.last_good_step) == (30, 20)
    (first,) = detect_divergence(Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(1, "rng_torch"): 0})))
    assert (first.onset_step, first.last_good_step) == (0, None)  # nothing earlier was seen
    assert first.to_dict()["last_good_step"] is None and inc.to_dict()["last_good_step"] == 20


def test_a_replay_half_written_is_not_compared_with_the_attempt_it_replaces() -> None:
    # attempt 0 took a bad update every replica agreed on (params "bad" from step 30); attempt 1 replays from 20:
    # ranks 0 and 1 have written their good step-30 rows, ranks 2 and 3 not yet
    topo, domains = _layout(dp=4, pp=1)
    fp = _fingerprints(domains, {(r, "param"): 30 for r in range(4)}).with_columns(pl.lit(0).alias("attempt"))
    replay = (_fingerprints(domains).filter((pl.col("step") == 30) & (pl.col("rank") < 2))
              .with_columns(pl.lit(1).alias("attempt"), (pl.col("wall_ns") + 100 * S).alias("wall_ns")))
    assert detect_divergence(Frames.build(topology=topo, fingerprints=pl.concat([fp, replay]))) == ()
    assert detect_corruption(Frames.build(topology=topo, fingerprints=pl.concat([fp, replay]))) == ()


def _seeded_apart(fp: pl.DataFrame, seed_of: dict[int, int] | None = None, *, merge: tuple[int, int, int] | None = None
                  ) -> pl.DataFrame:
    """`fp` with rng_torch seeded per rank (`seed_of`: rank -> seed, default the rank itself); `merge` = (rank, onto,
    from_step): from that step on, `rank`'s stream equals rank `onto`'s."""
    seed = pl.col("rank").replace_strict(seed_of, default=None) if seed_of else pl.col("rank")
    fp = fp.with_columns((pl.col("rng_torch_hash") + "-seed" + seed.cast(pl.String)).alias("rng_torch_hash"))
    if merge is None:
        return fp
    rank, onto, since = merge
    theirs = fp.filter(pl.col("rank") == onto).select("step", pl.col("rng_torch_hash").alias("theirs"))
    return fp.join(theirs, on="step", how="left").with_columns(
        pl.when((pl.col("rank") == rank) & (pl.col("step") >= since)).then(pl.col("theirs"))
        .otherwise(pl.col("rng_torch_hash")).alias("rng_torch_hash")).drop("theirs")


def test_per_rank_seeding_from_the_first_fingerprint_is_not_divergence() -> None:
    topo, domains = _layout(dp=4, pp=1)
    frames = Frames.build(topology=topo, fingerprints=_seeded_apart(_fingerprints(domains)))
    assert detect_divergence(frames) == () and detect_corruption(frames) == ()
    assert per_rank_streams(frames) == (PerRankStream(domain="dp.pp0.tp0", attempt=0, field="rng_torch",
                                                      baseline_step=0, members=4, classes=4),)
    (note,) = per_rank_notes(per_rank_streams(frames))
    assert note.startswith("rng_torch differs across the ranks of domain dp.pp0.tp0 from the first fingerprint")
    # two replicas seeded apart: nothing to blame, nothing diverged
    topo, domains = _layout(dp=2, pp=2)
    frames = Frames.build(topology=topo, fingerprints=_seeded_apart(_fingerprints(domains)))
    assert detect_divergence(frames) == ()
    assert [(s.domain, s.classes) for s in per_rank_streams(frames)] == [("dp.pp0.tp0", 2), ("dp.pp1.tp0", 2)]


def test_identically_seeded_streams_are_not_per_rank() -> None:
    topo, domains = _layout(dp=4, pp=1)
    assert per_rank_streams(Frames.build(topology=topo, fingerprints=_fingerprints(domains))) == ()
    # one rank of four apart at the first fingerprint: a majority agrees, so that rank departs (not a design)
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(1, "rng_torch"): 0}))
    assert per_rank_streams(frames) == ()
    (inc,) = detect_divergence(frames)
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("1", Cause.RNG_MISMATCH, 0)


def test_a_normally_seeded_stream_skewing_mid_run_is_still_divergence() -> None:
    topo, domains = _layout(dp=4, pp=1)
    frames = Frames.build(topology=topo, fingerprints=_fingerprints(domains, {(3, "rng_torch"): 20}))
    (inc,) = detect_divergence(frames)
    assert (inc.subject.kind, inc.subject.id, inc.cause, inc.onset_step) == (SubjectKind.RANK, "3", Cause.RNG_MISMATCH, 20)
    assert per_rank_streams(frames) == ()


def test_a_per_rank_stream_that_becomes_another_ranks_is_divergence() -> None:
    # six replicas seeded apart; from step 30 rank 4 draws rank 1's numbers: the two now agree, which they did not
    topo, domains = _layout(dp=6, pp=1)
    frames = Frames.build(topology=topo, fingerprints=_seeded_apart(_fingerprints(domains), merge=(4, 1, 30)))
    incidents = detect_divergence(frames)
    # the hashes cannot tell which of the two moved: both are named, the four others are the majority
    assert sorted((i.subject.kind, i.subject.id) for i in incidents) == [(SubjectKind.RANK, "1"), (SubjectKind.RANK, "4")]
    assert {(i.cause, i.onset_step, i.last_good_step, i.fields) for i in incidents} == {
        (Cause.RNG_MISMATCH, 30, 20, ("rng_torch",))}
    # four replicas: two against two, nobody blamed
    topo, domains = _layout(dp=4, pp=1)
    frames = Frames.build(topology=topo, fingerprints=_seeded_apart(_fingerprints(domains), merge=(2, 0, 30)))
    (inc,) = detect_divergence(frames)
    assert (inc.subject.kind, inc.ranks, inc.cause, inc.onset_step) == (
        SubjectKind.DOMAIN, (0, 1, 2, 3), Cause.RNG_MISMATCH, 30)


def test_members_seeded_alike_that_part_is_divergence() -> None:
    # seeded per node (two ranks a node): ranks 2k and 2k+1 agree at the baseline; from step 40 rank 3 departs
    topo, domains = _layout(dp=6, pp=1)
    fp = _seeded_apart(_fingerprints(domains, {(3, "rng_torch"): 40}), {r: r // 2 for r in range(6)})
    frames = Frames.build(topology=topo, fingerprints=fp)
    assert [(s.members, s.classes) for s in per_rank_streams(frames)] == [(6, 3)]
    incidents = detect_divergence(frames)
    assert sorted(i.subject.id for i in incidents) == ["2", "3"]
    assert {(i.cause, i.onset_step) for i in incidents} == {(Cause.RNG_MISMATCH, 40)}


def test_each_attempt_is_judged_from_its_own_first_fingerprint() -> None:
    # attempt 1 resumes from step 20 and restores every rank's own RNG state: seeded apart again, other values
    topo, domains = _layout(dp=6, pp=1)
    first = _seeded_apart(_fingerprints(domains)).with_columns(pl.lit(0).alias("attempt"))
    resumed = (_seeded_apart(_fingerprints(domains)).filter(pl.col("step") >= 20)
               .with_columns(pl.lit(1).alias("attempt"), (pl.col("wall_ns") + 100 * S).alias("wall_ns"),
                             (pl.col("rng_torch_hash") + "-restored").alias("rng_torch_hash")))
    frames = Frames.build(topology=topo, fingerprints=pl.concat([first, resumed]))
    assert detect_divergence(frames) == ()
    assert [(s.attempt, s.baseline_step) for s in per_rank_streams(frames)] == [(0, 0), (1, 20)]
    # the resumed attempt's partition is its own reference: rank 5 taking rank 0's numbers at 40 departs there
    merged = _seeded_apart(_fingerprints(domains), merge=(5, 0, 40)).filter(pl.col("step") >= 20).with_columns(
        pl.lit(1).alias("attempt"), (pl.col("wall_ns") + 100 * S).alias("wall_ns"))
    incidents = detect_divergence(Frames.build(topology=topo, fingerprints=pl.concat([first, merged])))
    assert sorted((i.subject.id, i.onset_step) for i in incidents) == [("0", 40), ("5", 40)]
