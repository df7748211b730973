"""Corruption from hand-built steps, fingerprints and GPU counters."""

from __future__ import annotations

import math
import time

import numpy as np
import polars as pl
import pytest

from rankwatch.analytics.corruption import CorruptionConfig, detect_corruption, hardware_errors
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind

S = 1_000_000_000
RANKS, STEPS = 8, 120


def _topology(ranks: int = RANKS) -> pl.DataFrame:
    return pl.DataFrame([{"rank": r, "world_size": ranks, "dp": r, "tp": 0, "pp": 0, "role": "pp=0"} for r in range(ranks)])


def _steps(seed: int = 0, spike: tuple[int, int, float] | None = None, ranks: int = RANKS, steps: int = STEPS) -> pl.DataFrame:
    """Grad norms decaying slowly with 15 % multiplicative noise per rank per step; loss likewise."""
    rng = np.random.default_rng(seed)
    r = np.repeat(np.arange(ranks), steps)
    s = np.tile(np.arange(steps), ranks)
    trend = 10.0 * np.exp(-s / 60.0)  # a x7 decline over the run: faster than real training
    gn = trend * rng.lognormal(0.0, 0.15, r.size)
    loss = 2.0 * np.exp(-s / 80.0) * rng.lognormal(0.0, 0.1, r.size)
    if spike is not None:
        sr, ss, factor = spike
        gn[(r == sr) & (s == ss)] *= factor
    return pl.DataFrame({"rank": r, "step": s, "end_wall_ns": (s + 1) * S, "local_grad_norm": gn, "loss": loss,
                         "all_finite": np.ones(r.size, dtype=bool)})


def _gpu(dbe: dict[tuple[int, int], int] | None = None, xid: dict[tuple[int, int], list[int]] | None = None) -> pl.DataFrame:
    """Every device has a steady nonzero DBE counter of 2; `dbe` raises it from (rank, step) on."""
    dbe, xid = dbe or {}, xid or {}
    rows = []
    for r in range(RANKS):
        for s in range(STEPS):
            n = 2 + sum(v for (rr, ss), v in dbe.items() if rr == r and s >= ss)
            rows.append({"rank": r, "step": s, "device_uuid": f"GPU-{r}", "ecc_dbe_volatile": n, "ecc_sbe_volatile": 40,
                         "xid_events": xid.get((r, s), [])})
    return pl.DataFrame(rows)


def test_noise_and_trend_are_not_outliers() -> None:
    for seed in range(3):
        assert detect_corruption(Frames.build(topology=_topology(), steps=_steps(seed))) == ()


def test_grad_norm_spike_on_one_rank_is_found() -> None:
    (inc,) = detect_corruption(Frames.build(topology=_topology(), steps=_steps(spike=(5, 70, 10.0))))
    assert (inc.klass, inc.subject.kind, inc.subject.id, inc.cause) == (
        IncidentClass.CORRUPTION, SubjectKind.RANK, "5", Cause.GRAD_NORM_OUTLIER)
    assert inc.onset_step == inc.detection_step == 70


def test_spike_on_every_rank_at_once_is_not_a_rank_outlier() -> None:
    steps = _steps().with_columns(
        pl.when(pl.col("step") == 70).then(pl.col("local_grad_norm") * 10).otherwise(pl.col("local_grad_norm")))
    assert detect_corruption(Frames.build(topology=_topology(), steps=steps)) == ()


def _sharded(seed: int = 0, dp: int = 4, tp: int = 2, pp: int = 2, steps: int = STEPS,
             blips: dict[tuple[int, int], float] | None = None,
             replica: dict[tuple[int, int], float] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """rank = tp + tp * (dp_coord + dp * pp_coord). Each tp shard has its own grad-norm level, each (replica, step) a
    shared batch factor (sequence-length skew), each rank 3 % noise; `blips` (rank, step) -> factor on one rank,
    `replica` (dp, step) -> factor on every shard of a replica. The last stage has the replica's loss."""
    rng = np.random.default_rng(seed)
    rows, ranks = [], dp * tp * pp
    topo = pl.DataFrame([{"rank": t + tp * (d + dp * p), "world_size": ranks, "dp": d, "tp": t, "pp": p,
                          "role": f"pp={p}"} for p in range(pp) for d in range(dp) for t in range(tp)])
    batch = rng.lognormal(0.0, 0.07, (dp, steps))
    loss = 2.0 * np.exp(-np.arange(steps) / 90.0)[None, :] * rng.lognormal(0.0, 0.01, (dp, steps))
    for r, d, t, p in topo.select("rank", "dp", "tp", "pp").iter_rows():
        level = 0.5 + t
        for st in range(steps):
            g = level * np.exp(-st / 70.0) * batch[d, st] * rng.lognormal(0.0, 0.03)
            g *= (blips or {}).get((r, st), 1.0) * (replica or {}).get((d, st), 1.0)
            rows.append({"rank": r, "step": st, "end_wall_ns": (st + 1) * S, "local_grad_norm": g,
                         "loss": float(loss[d, st]) if p == pp - 1 else None, "all_finite": True})
    return topo, pl.DataFrame(rows, infer_schema_length=None)


def test_moderate_blips_repeated_on_one_rank_are_one_incident() -> None:
    topo, steps = _sharded(blips={(9, 40): 2.0, (9, 75): 1.7, (9, 90): 2.5})
    (inc,) = detect_corruption(Frames.build(topology=topo, steps=steps))
    assert (inc.subject.kind, inc.subject.id, inc.ranks, inc.cause) == (
        SubjectKind.RANK, "9", (9,), Cause.GRAD_NORM_OUTLIER)
    assert (inc.onset_step, inc.detection_step) == (40, 75)
    (ev,) = inc.evidence
    assert [row[1] for row in ev.rows] == [40, 75, 90]


def test_one_moderate_blip_is_not_confirmed_but_an_extreme_one_is() -> None:
    topo, steps = _sharded(blips={(9, 40): 2.0})
    assert detect_corruption(Frames.build(topology=topo, steps=steps)) == ()
    topo, steps = _sharded(blips={(9, 40): 6.0})
    (inc,) = detect_corruption(Frames.build(topology=topo, steps=steps))
    assert (inc.subject.id, inc.onset_step, inc.detection_step) == ("9", 40, 40)


def test_blips_too_far_apart_are_not_confirmed() -> None:
    cfg = CorruptionConfig()
    topo, steps = _sharded(steps=cfg.blip_window_steps + 60, blips={(9, 20): 2.0, (9, 20 + cfg.blip_window_steps): 2.0})
    assert detect_corruption(Frames.build(topology=topo, steps=steps), cfg) == ()


def test_a_whole_replica_moving_together_is_not_a_rank_blip() -> None:
    """Every shard of replica 1 x1.8 at three steps: a long batch, which its peers in other replicas did not see."""
    topo, steps = _sharded(replica={(1, 30): 1.8, (1, 50): 1.8, (1, 70): 1.8})
    assert detect_corruption(Frames.build(topology=topo, steps=steps)) == ()


def test_small_repeated_deviations_below_the_floor_are_not_blips() -> None:
    topo, steps = _sharded(blips={(9, st): 1.2 for st in range(20, 110, 10)})
    assert detect_corruption(Frames.build(topology=topo, steps=steps)) == ()


def test_the_replicas_loss_corroborates_and_is_no_second_incident() -> None:
    """Rank 3 (replica 1, stage 0) blips; the replica's loss (on its last-stage ranks 10, 11) rises 15 % at the same
    steps."""
    topo, steps = _sharded(blips={(3, 40): 2.2, (3, 60): 2.4})
    steps = steps.with_columns(
        pl.when(pl.col("rank").is_in([10, 11]) & pl.col("step").is_in([40, 60])).then(pl.col("loss") * 1.15)
        .otherwise(pl.col("loss")).alias("loss"))
    (inc,) = detect_corruption(Frames.build(topology=topo, steps=steps))
    assert (inc.subject.id, inc.cause) == ("3", Cause.GRAD_NORM_OUTLIER)
    assert inc.fields == ("local_grad_norm", "loss")
    assert {row[0] for row in inc.evidence[1].rows} == {10, 11}


def test_a_loss_outlier_shared_by_a_replica_is_one_replica_incident() -> None:
    topo, steps = _sharded()
    steps = steps.with_columns(
        pl.when(pl.col("rank").is_in([10, 11]) & (pl.col("step") == 50)).then(pl.col("loss") * 10)
        .otherwise(pl.col("loss")).alias("loss"))
    (inc,) = detect_corruption(Frames.build(topology=topo, steps=steps))
    assert (inc.subject.kind, inc.subject.id, inc.ranks, inc.cause) == (
        SubjectKind.REPLICA, "dp=1", (10, 11), Cause.LOSS_OUTLIER)


def test_a_flipped_parameter_that_also_moves_the_gradient_norm_is_one_incident() -> None:
    topo = _topology(4)
    fp = []
    for r in range(4):
        for st in range(0, 120, 10):
            fp.append({"rank": r, "step": st, "wall_ns": st * S, "domain": "dp.pp0.tp0", "domain_ranks": [0, 1, 2, 3],
                       "param_hash": f"p{st}" + ("x" if r == 1 and st >= 40 else ""), "optim_hash": f"o{st}",
                       "rng_python_hash": "a", "rng_numpy_hash": "b", "rng_torch_hash": f"t{st}",
                       "rng_cuda_hash": None, "data_position": st})
    steps = _steps(ranks=4).with_columns(
        pl.when((pl.col("rank") == 1) & pl.col("step").is_in([41, 45])).then(pl.col("local_grad_norm") * 30)
        .otherwise(pl.col("local_grad_norm")).alias("local_grad_norm"))
    (inc,) = detect_corruption(Frames.build(topology=topo, steps=steps, fingerprints=pl.DataFrame(fp)))
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("1", Cause.VALUE_MISMATCH, 40)
    assert "local_grad_norm" in inc.fields and "also grad_norm_outlier" in inc.summary


def test_loss_outlier() -> None:
    steps = _steps().with_columns(
        pl.when((pl.col("rank") == 2) & (pl.col("step") == 50)).then(pl.col("loss") * 20).otherwise(pl.col("loss")))
    (inc,) = detect_corruption(Frames.build(topology=_topology(), steps=steps))
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("2", Cause.LOSS_OUTLIER, 50)


def test_non_finite_first_step_culprit_only() -> None:
    steps = _steps().with_columns(
        pl.when(((pl.col("rank") == 3) & (pl.col("step") >= 40)) | (pl.col("step") >= 41))
        .then(float("nan")).otherwise(pl.col("local_grad_norm")).alias("local_grad_norm"))
    steps = steps.with_columns(pl.col("local_grad_norm").is_finite().alias("all_finite"))
    (inc,) = detect_corruption(Frames.build(topology=_topology(), steps=steps))
    assert (inc.subject.id, inc.cause, inc.onset_step) == ("3", Cause.NON_FINITE, 40)
    assert inc.fields == ("local_grad_norm",)


def test_non_finite_everywhere_at_once_blames_nobody() -> None:
    steps = _steps().with_columns(pl.when(pl.col("step") >= 40).then(math.inf).otherwise(pl.col("loss")).alias("loss"))
    (inc,) = detect_corruption(Frames.build(topology=_topology(), steps=steps))
    assert (inc.subject.kind, inc.cause) == (SubjectKind.JOB, Cause.NON_FINITE)


def _sharded_fingerprints(ranks: int = 4) -> pl.DataFrame:
    """Fully sharded state (FSDP2): each rank its own domain, fingerprinted every 10 steps, nothing to compare."""
    return pl.DataFrame([{
        "rank": r, "step": s, "wall_ns": s * S + r, "domain": f"replicas:{r}", "domain_ranks": [r],
        "param_hash": f"p{r}-{s}", "optim_hash": f"o{r}-{s}", "rng_python_hash": "py", "rng_numpy_hash": "np",
        "rng_torch_hash": f"t{s}", "rng_cuda_hash": None, "data_position": s, "param_count": 10,
    } for r in range(ranks) for s in range(0, 60, 10)])


def _nonfinite(*at: tuple[int, int]) -> pl.DataFrame:
    return pl.DataFrame([{"rank": r, "attempt": 0, "wall_ns": s * S + r, "kind": "nonfinite", "step": s,
                          "message": "0 non-finite value(s) in its parameters, 1 in its optimizer state"}
                         for r, s in at])


def test_non_finite_state_a_rank_holds_alone_is_blamed_on_it() -> None:
    # an exponent bit flipped in rank 1's gradient shard at step 23: Adam's second moment infinite there, found by
    # its fingerprint at step 30 and every fingerprint after; no other rank holds the shard to disagree with
    topo = _topology(4)
    fp = _sharded_fingerprints()
    events = _nonfinite((1, 30), (1, 40), (1, 50))
    (inc,) = detect_corruption(Frames.build(topology=topo, fingerprints=fp, events=events))
    assert (inc.subject.kind, inc.subject.id, inc.ranks, inc.cause) == (SubjectKind.RANK, "1", (1,), Cause.NON_FINITE)
    assert (inc.onset_step, inc.detection_step, inc.last_good_step) == (21, 30, 20)
    assert inc.evidence[0].source == "events" and "1 in its optimizer state" in str(inc.evidence[0].rows[0])
    # every rank at once (a non-finite gradient all-reduced to every replica): nobody is blamed
    (inc,) = detect_corruption(Frames.build(topology=topo, fingerprints=fp,
                                            events=_nonfinite(*((r, 40) for r in range(4)))))
    assert (inc.subject.kind, inc.ranks, inc.last_good_step) == (SubjectKind.JOB, (0, 1, 2, 3), 30)
    assert detect_corruption(Frames.build(topology=topo, fingerprints=fp)) == ()


@pytest.mark.parametrize("gpu", [
    _gpu(dbe={(5, 69): 1}),
    _gpu(xid={(5, 70): [79]}),
])
def test_new_hardware_error_corroborates(gpu: pl.DataFrame) -> None:
    frames = Frames.build(topology=_topology(), steps=_steps(spike=(5, 70, 10.0)), gpu=gpu)
    (inc,) = detect_corruption(frames)
    assert (inc.subject.id, inc.cause) == ("5", Cause.HARDWARE_ERROR)
    assert inc.confidence >= CorruptionConfig().hardware_confidence


def test_steady_counters_far_errors_and_app_xids_do_not_corroborate() -> None:
    gpu = _gpu(dbe={(5, 10): 1}, xid={(5, 71): [13], (4, 70): [79]})  # too early; application XID; another rank
    frames = Frames.build(topology=_topology(), steps=_steps(spike=(5, 70, 10.0)), gpu=gpu)
    (inc,) = detect_corruption(frames)
    assert inc.cause is Cause.GRAD_NORM_OUTLIER
    assert hardware_errors(Frames.build(gpu=_gpu())).height == 0


def test_hardware_error_alone_is_not_corruption() -> None:
    frames = Frames.build(topology=_topology(), steps=_steps(), gpu=_gpu(dbe={(1, 30): 2}, xid={(1, 30): [48]}))
    assert detect_corruption(frames) == ()


def test_bitflip_value_mismatch_with_majority_and_ecc() -> None:
    rows = []
    for r in range(4):
        for s in range(0, 60, 10):
            rows.append({"rank": r, "step": s, "wall_ns": s * S, "domain": "dp.pp0.tp0", "domain_ranks": [0, 1, 2, 3],
                         "param_hash": f"p{s}" + ("x" if r == 1 and s >= 30 else ""), "optim_hash": f"o{s}",
                         "rng_python_hash": "a", "rng_numpy_hash": "b", "rng_torch_hash": f"t{s}",
                         "rng_cuda_hash": None, "data_position": s})
    topo = _topology(4)
    gpu = _gpu(dbe={(1, 24): 1}).filter(pl.col("rank") < 4)
    (inc,) = detect_corruption(Frames.build(topology=topo, fingerprints=pl.DataFrame(rows)))
    assert (inc.subject.kind, inc.subject.id, inc.cause, inc.onset_step) == (SubjectKind.RANK, "1", Cause.VALUE_MISMATCH, 30)
    (inc,) = detect_corruption(Frames.build(topology=topo, fingerprints=pl.DataFrame(rows), gpu=gpu))
    assert inc.cause is Cause.HARDWARE_ERROR  # DBE between the last agreeing fingerprint (20) and the onset (30)


def test_scale_is_vectorized() -> None:
    ranks, steps = 512, 400
    frames = Frames.build(topology=_topology(ranks), steps=_steps(ranks=ranks, steps=steps))
    t0 = time.perf_counter()
    detect_corruption(frames)
    assert time.perf_counter() - t0 < 10.0  # 200k rows; 2M rows (2048 x 1000) measure ~10x this
