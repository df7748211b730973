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
