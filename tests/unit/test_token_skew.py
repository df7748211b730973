"""Data skew told from a rank's noise by the work in each batch (`steps.tokens`), where every data-parallel replica
is one rank and step times alone cannot (`straggler.imbalance._token_skew`), on hand-built steps whose batches vary as
variable-length batches do, and end to end on simulated pure data-parallel runs (CPU and GPU timing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, IncidentClass
from rankwatch.analytics.straggler import StragglerConfig, detect_stragglers
from rankwatch.analytics.straggler.imbalance import _token_skew

RANKS, STEPS, TOKENS = 16, 120, 8192


def _frames(tokens: np.ndarray, compute: np.ndarray) -> Frames:
    r, s = np.meshgrid(np.arange(RANKS), np.arange(STEPS))
    end = (s + 1) * 1_000_000_000
    steps = pl.DataFrame({"rank": r.ravel(), "step": s.ravel(), "compute_ns": np.rint(compute).astype(np.int64).ravel(),
                          "tokens": np.rint(tokens).astype(np.int64).ravel(), "end_wall_ns": end.ravel(),
                          "start_wall_ns": end.ravel() - 900_000_000, "duration_ns": np.full(r.size, 900_000_000),
                          "collective_wait_ns": np.zeros(r.size, np.int64),
                          "dataloader_wait_ns": np.zeros(r.size, np.int64), "checkpoint_ns": np.zeros(r.size, np.int64)})
    return Frames.build(steps=steps)


def _run(seed: int, *, spread: float, follows: float, slow_rank: int | None = None) -> Frames:
    """Batches whose tokens vary lognormally by `spread` on every rank every step (variable-length batches); compute
    = `follows` of it scaled by the tokens plus the rest fixed, times 2 % noise; `slow_rank` 25 % slower always."""
    rng = np.random.default_rng(seed)
    tok = TOKENS * rng.lognormal(0.0, spread, (STEPS, RANKS))
    comp = 5e8 * (1 - follows + follows * tok / TOKENS) * rng.lognormal(0.0, 0.02, (STEPS, RANKS))
    if slow_rank is not None:
        comp[:, slow_rank] *= 1.25
    return _frames(tok, comp)


@pytest.mark.timeout(60)
def test_compute_that_follows_variable_batches_is_data_skew_with_its_cost() -> None:
    """Tokens varying 10 % on every rank, compute following them: each step waits for the longest batch (about
    +20 % over the median of 16), so the skew costs about that, and it is reported as data skew with no rank named
    as a straggler."""
    found = detect_stragglers(_run(1, spread=0.10, follows=1.0))
    skew = [i for i in found if i.cause is Cause.DATA_SKEW]
    assert len(skew) == 1 and skew[0].klass is IncidentClass.IMBALANCE and skew[0].subject.id == "job"
    assert "1.0" in skew[0].summary.split("more tokens is ")[1][:4]  # the fitted slope: 1 % tokens, ~1 % compute
    assert not [i for i in found if i.klass is IncidentClass.STRAGGLER]
    assert len(skew[0].ranks) > RANKS // 2  # the longest batch moves from rank to rank


@pytest.mark.timeout(60)
def test_batches_whose_work_the_compute_does_not_follow_are_no_skew() -> None:
    """Tokens vary but compute does not follow (a padded batch: the kernels run on the padded length), or tokens do
    not vary (packed sequences), or vary too little to cost `replica_skew`: nothing."""
    assert _token_skew(_run(2, spread=0.10, follows=0.0), StragglerConfig()) == []
    rng = np.random.default_rng(3)
    assert _token_skew(_frames(np.full((STEPS, RANKS), TOKENS), 5e8 * rng.lognormal(0.0, 0.02, (STEPS, RANKS))),
                       StragglerConfig()) == []
    assert _token_skew(_run(4, spread=0.005, follows=1.0), StragglerConfig()) == []
    assert _token_skew(Frames.build(), StragglerConfig()) == []


@pytest.mark.timeout(60)
def test_a_slow_rank_among_skewed_batches_stays_a_straggler_and_the_skew_is_said() -> None:
    """A rank 25 % slower at every step, beside batches varying 10 %: its slowness is not in its tokens, so the fit
    does not take it for skew; the skew is said, and the slow rank is still a straggler by the rank rules."""
    found = detect_stragglers(_run(5, spread=0.10, follows=1.0, slow_rank=7))
    assert [i for i in found if i.cause is Cause.DATA_SKEW]
    assert [i.ranks for i in found if i.klass is IncidentClass.STRAGGLER] == [(7,)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timing", ["cpu", "gpu"])
def test_pure_data_parallel_skew_is_found_from_the_batches_and_costed(timing: str, tmp_path: Path) -> None:
    """dp=32 with one random rank's batch 30 % longer each step (the simulator's tokens count it): found as data
    skew from the batches, with a measured impact, and nothing else; the same run without it raises nothing. Before
    `steps.tokens` pure data parallelism could not tell this from per-rank noise (heldout6-043, missed)."""
    from rankwatch.analytics.analyze import analyze
    from rankwatch.analytics.incidents import ImpactBasis
    from rankwatch.base.topology import Layout
    from rankwatch.simulator import SimConfig, simulate
    from rankwatch.simulator.config import Timing
    from rankwatch.simulator.faults import DataSkew

    def cfg(*faults: DataSkew) -> SimConfig:
        return SimConfig(layout=Layout(dp=32), hosts=4, steps=100, seed=3, faults=faults, timing=Timing(timing))

    simulate(cfg(DataSkew(extra=0.3)), tmp_path / "skew")
    simulate(cfg(), tmp_path / "clean")
    found = analyze(tmp_path / "skew").incidents
    assert [(i.klass, i.cause) for i in found] == [(IncidentClass.IMBALANCE, Cause.DATA_SKEW)]
    impact = found[0].impact
    assert impact is not None and impact.basis is ImpactBasis.WHATIF and impact.share > 0.10
    assert analyze(tmp_path / "clean").incidents == ()
