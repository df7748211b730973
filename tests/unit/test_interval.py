"""The checkpoint-interval model and its simulator (analytics/interval.py): Young's and Daly's formulas at points worked
out by hand, the expected-value model at a hand-computed point, the simulator against the model over long horizons,
asynchronous saves lost inside their write window, the advised interval against others, and bad inputs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import pytest

from rankwatch.analytics.interval import (
    InterruptionModel, InterruptionTrace, IntervalCosts, advised_interval, expected_figures, interval_advice,
    job_mtbf_s, simulate_goodput, young_daly_interval, young_interval,
)

pytestmark = pytest.mark.timeout(30)


def test_young_is_sqrt_2cm_and_daly_matches_hand_values() -> None:
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)
    assert young_interval(9.0, 3_600.0) == pytest.approx(math.sqrt(2 * 9 * 3_600))
    # C = 2, M = 100: C/2M = 0.01; sqrt(2CM) = 20; 20 * (1 + 0.1/3 + 0.01/9) - 2 = 20 * 1.0344444 - 2 = 18.688889
    assert young_daly_interval(2.0, 100.0) == pytest.approx(18.688889, abs=1e-6)
    # C = 50, M = 100: C/2M = 0.25; sqrt(2CM) = 100; 100 * (1 + 0.5/3 + 0.25/9) - 50 = 119.444444 - 50 = 69.444444
    assert young_daly_interval(50.0, 100.0) == pytest.approx(69.444444, abs=1e-6)
    assert young_daly_interval(250.0, 100.0) == 100.0  # C >= 2M: M
    # small C: Daly tends to Young
    assert young_daly_interval(0.01, 1e6) == pytest.approx(young_interval(0.01, 1e6), rel=1e-3)


def test_job_mtbf_divides_by_ranks() -> None:
    assert job_mtbf_s(1e8, 16_384) == pytest.approx(1e8 / 16_384)
    with pytest.raises(ValueError, match="ranks"):
        job_mtbf_s(1e8, 0)


def test_expected_figures_at_a_hand_computed_point() -> None:
    # C = 2, R = 10, M = 100, tau = 18 (lambda = 0.01, cycle 20): e^0.2 = 1.2214028, e^0.1 = 1.1051709
    # goodput = tau / (M e^(R/M) (e^(c/M) - 1)) = 18 / (100 * 1.1051709 * 0.2214028) = 18 / 24.468783 = 0.735631
    # restart = 1 - e^(-R/M) = 1 - 1/1.1051709 = 0.095163
    # save = (e^-0.18 - e^-0.2) / (1 - e^-0.2) / e^0.1 = (0.8352702 - 0.8187308) / 0.1812692 / 1.1051709 = 0.082560
    f = expected_figures(IntervalCosts(save_s=2.0, restore_s=10.0, mtbf_s=100.0), 18.0)
    assert f.goodput == pytest.approx(0.735631, abs=1e-6)
    assert f.restart_share == pytest.approx(0.095163, abs=1e-6)
    assert f.save_share == pytest.approx(0.082560, abs=1e-5)
    assert f.goodput + f.save_share + f.lost_share + f.restart_share == pytest.approx(1.0)
    assert f.lost_per_interruption_s == pytest.approx(f.lost_share * 100.0)
    assert f.overhead == pytest.approx(1 - f.goodput)


@pytest.mark.parametrize("costs, interval_s", [
    (IntervalCosts(save_s=20.0, restore_s=50.0, mtbf_s=1_000.0), 200.0),
    (IntervalCosts(save_s=5.0, restore_s=50.0, mtbf_s=1_000.0, async_write_s=80.0), 150.0),  # write < interval
    (IntervalCosts(save_s=5.0, restore_s=50.0, mtbf_s=1_000.0, async_write_s=80.0), 50.0),  # saves wait for writes
])
def test_simulated_goodput_matches_the_model_over_a_long_horizon(costs: IntervalCosts, interval_s: float) -> None:
    runs = [simulate_goodput(costs, interval_s, horizon_s=2e6, seed=s) for s in range(4)]  # ~2,000 interruptions each
    f = expected_figures(costs, interval_s)
    assert statistics.mean(r.goodput for r in runs) == pytest.approx(f.goodput, abs=0.004)
    assert statistics.mean(r.save_s / r.horizon_s for r in runs) == pytest.approx(f.save_share, abs=0.002)
    assert statistics.mean(r.lost_s / r.horizon_s for r in runs) == pytest.approx(f.lost_share, abs=0.004)
    assert statistics.mean(r.restart_s / r.horizon_s for r in runs) == pytest.approx(f.restart_share, abs=0.002)
    for r in runs:
        assert r.useful_s + r.lost_s + r.save_s + r.restart_s == pytest.approx(r.horizon_s)


def test_async_with_no_write_is_sync_with_the_pause() -> None:
    sync = IntervalCosts(save_s=3.0, restore_s=20.0, mtbf_s=500.0)
    async_ = IntervalCosts(save_s=3.0, restore_s=20.0, mtbf_s=500.0, async_write_s=0.0)
    assert expected_figures(async_, 60.0) == expected_figures(sync, 60.0)
    assert simulate_goodput(async_, 60.0, horizon_s=1e5, seed=3) == simulate_goodput(sync, 60.0, horizon_s=1e5, seed=3)
    # a write window of W <= tau costs what W more seconds of restart would
    w = IntervalCosts(save_s=3.0, restore_s=20.0, mtbf_s=500.0, async_write_s=15.0)
    longer = IntervalCosts(save_s=3.0, restore_s=35.0, mtbf_s=500.0)
    assert expected_figures(w, 60.0).goodput == pytest.approx(expected_figures(longer, 60.0).goodput)


def test_a_failure_inside_the_write_window_loses_the_save() -> None:
    costs = IntervalCosts(save_s=1.0, restore_s=10.0, mtbf_s=1e9, async_write_s=50.0)
    # compute 0-100, pause 100-101, write 101-151: the save of 100 s of work is complete at 151
    inside = simulate_goodput(costs, 100.0, horizon_s=140.0, failures=InterruptionTrace(times_s=(130.0,)))
    assert (inside.interruptions, inside.saves, inside.lost_saves) == (1, 1, 1)
    assert inside.lost_s == pytest.approx(129.0)  # 100 s before the save, 29 after: back to the start
    assert inside.restart_s == pytest.approx(10.0)
    after = simulate_goodput(costs, 100.0, horizon_s=170.0, failures=InterruptionTrace(times_s=(160.0,)))
    assert (after.saves, after.lost_saves) == (1, 0)
    assert after.lost_s == pytest.approx(59.0)  # back to the save: the 59 s since the pause ended
    sync = IntervalCosts(save_s=1.0, restore_s=10.0, mtbf_s=1e9)
    assert simulate_goodput(sync, 100.0, horizon_s=140.0, failures=InterruptionTrace(times_s=(130.0,))).lost_s \
        == pytest.approx(29.0)


def test_an_interrupted_restart_starts_over() -> None:
    costs = IntervalCosts(save_s=1.0, restore_s=10.0, mtbf_s=1e9)
    run = simulate_goodput(costs, 100.0, horizon_s=200.0, failures=InterruptionTrace(times_s=(50.0, 55.0)))
    # 0-50 compute (lost), 50-55 restart cut, 55-65 restart, 65-165 compute, 165-166 save, 166-200 compute
    assert run.interruptions == 2
    assert run.restart_s == pytest.approx(15.0)
    assert run.lost_s == pytest.approx(50.0)
    assert run.save_s == pytest.approx(1.0)
    assert run.useful_s == pytest.approx(134.0)


@pytest.mark.parametrize("costs", [
    IntervalCosts(save_s=9.4, restore_s=81.0, mtbf_s=11_135.0),
    IntervalCosts(save_s=0.6, restore_s=81.0, mtbf_s=11_135.0, async_write_s=8.8),
    IntervalCosts(save_s=50.0, restore_s=0.0, mtbf_s=100.0),  # C near M: Daly's estimate drifts
    IntervalCosts(save_s=1.0, restore_s=0.0, mtbf_s=1_000.0, async_write_s=200.0),  # the write outlasts the optimum
])
def test_advised_is_at_least_as_good_as_any_interval_under_the_model(costs: IntervalCosts) -> None:
    advised = advised_interval(costs)
    best = expected_figures(costs, advised).goodput
    grid = [m * 60.0 for m in (10, 30, 60, 120)] + [advised * f for f in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0)]
    grid.append(young_daly_interval(costs.save_s, costs.mtbf_s))
    for tau in grid:
        assert expected_figures(costs, tau).goodput <= best + 1e-12, tau


def test_advised_where_it_differs_from_daly() -> None:
    # C = 50, M = 100: the root of 1 - e^-(tau + 50)/100 = tau/100 is 69.83, Daly's estimate 69.44
    assert advised_interval(IntervalCosts(save_s=50.0, restore_s=0.0, mtbf_s=100.0)) == pytest.approx(69.829, abs=1e-3)
    # an async write of 200 s where the pause alone would advise 44 s: saves would queue behind writes
    assert advised_interval(IntervalCosts(save_s=1.0, restore_s=0.0, mtbf_s=1_000.0, async_write_s=200.0)) == 200.0
    advice = interval_advice(IntervalCosts(save_s=2.0, restore_s=10.0, mtbf_s=100.0), current_s=40.0)
    assert advice.young_s == pytest.approx(20.0)
    assert advice.daly_s == pytest.approx(18.688889, abs=1e-6)
    assert advice.advised_s == pytest.approx(18.689, abs=1e-3)
    assert advice.current is not None and advice.current.goodput < advice.advised.goodput


def test_bursty_interruptions_keep_their_mean() -> None:
    costs = IntervalCosts(save_s=1.0, restore_s=0.0, mtbf_s=100.0)
    runs = [simulate_goodput(costs, 1e9, horizon_s=1e6, seed=s, failures=InterruptionModel(shape=0.7))
            for s in range(3)]
    assert statistics.mean(r.interruptions for r in runs) == pytest.approx(1e4, rel=0.05)


@pytest.mark.parametrize("make, field", [
    (lambda: IntervalCosts(save_s=0.0, restore_s=1.0, mtbf_s=1.0), "IntervalCosts.save_s"),
    (lambda: IntervalCosts(save_s=1.0, restore_s=-1.0, mtbf_s=1.0), "IntervalCosts.restore_s"),
    (lambda: IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=-5.0), "IntervalCosts.mtbf_s"),
    (lambda: IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=math.nan), "IntervalCosts.mtbf_s"),
    (lambda: IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=1.0, async_write_s=-1.0), "IntervalCosts.async_write_s"),
    (lambda: expected_figures(IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=1.0), 0.0), "interval_s"),
    (lambda: simulate_goodput(IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=1.0), -1.0, horizon_s=1.0), "interval_s"),
    (lambda: simulate_goodput(IntervalCosts(save_s=1.0, restore_s=1.0, mtbf_s=1.0), 1.0, horizon_s=0.0), "horizon_s"),
    (lambda: young_daly_interval(0.0, 1.0), "save_s"),
    (lambda: young_daly_interval(1.0, 0.0), "mtbf_s"),
    (lambda: InterruptionModel(shape=0.0), "InterruptionModel.shape"),
    (lambda: InterruptionTrace(times_s=(5.0, 3.0)), "InterruptionTrace.times_s"),
])
def test_bad_inputs_name_the_field(make: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()
