"""Every injected fault leaves the trace it should, on the rank it should, in one 8-rank run
(dp=2, tp=2, pp=2 over 2 virtual hosts; rank = (pp*2 + dp)*2 + tp, host0 = pp stage 0)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from rankwatch.base.schema import ThrottleReason
from rankwatch.canary import Faults
from rankwatch.canary.loop import GPU_SLOW_CPU_WARNING

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAULTS = (
    Faults()
    .slow(rank=5, from_step=20, delay_s=0.06)
    .throttle(rank=2, from_step=30, delay_s=0.0)
    .bitflip(rank=1, step=12, target="grad", bit=30)
    .skew_rng(rank=3, step=20)
    .skew_data(rank=6, step=25, offset=3)
    .bitflip(rank=4, step=40, target="param", bit=20)
    .slow_link(hosts=(0, 1), from_step=45, until_step=55, delay_s=0.06)
)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    result = run(canary(run_dir, layout="dp=2,tp=2,pp=2", hosts=2, steps=60, faults=FAULTS, fingerprint_every=5,
                        flush_interval_s=0.5))
    assert result.ok, result
    return run_dir


def _compute_ms(run_dir: Path, lo: int, hi: int) -> dict[int, float]:
    return {
        r: ms for r, ms in rows(
            run_dir, f"SELECT rank, median(compute_ns)/1e6 FROM steps WHERE step >= {lo} AND step < {hi} GROUP BY rank"
        )
    }


def test_slow_rank_spends_the_delay_in_its_own_compute(faulty: Path) -> None:
    before, after = _compute_ms(faulty, 5, 20), _compute_ms(faulty, 20, 45)
    assert after[5] - before[5] > 45
    others = [after[r] - before[r] for r in range(8) if r != 5]
    assert max(others) < 30  # peers wait for rank 5 in collectives, not in compute


def test_throttled_gpu_reports_the_reason_on_its_device(faulty: Path) -> None:
    got = rows(
        faulty,
        "SELECT rank, step >= 30 AS late, bool_or((throttle_reasons & 64) <> 0), avg(sm_clock_mhz) FROM gpu "
        "WHERE step >= 0 GROUP BY ALL ORDER BY ALL",
    )
    throttled = {(r, late) for r, late, bit, _ in got if bit}
    assert throttled == {(2, True)}
    clocks = {(r, late): mhz for r, late, _, mhz in got}
    assert clocks[(2, True)] < 0.8 * clocks[(0, True)]
    assert int(ThrottleReason.HW_THERMAL_SLOWDOWN) == 64


def test_gradient_bitflip_shows_only_in_the_local_pre_allreduce_norm(faulty: Path) -> None:
    norms = dict(rows(faulty, "SELECT rank, local_grad_norm FROM steps WHERE step = 12"))
    finite = dict(rows(faulty, "SELECT rank, all_finite FROM steps WHERE step = 12"))
    typical = statistics.median(v for r, v in norms.items() if r != 1)
    assert (not finite[1]) or norms[1] > 100 * typical
    assert all(finite[r] for r in range(8) if r != 1)
    # after the all-reduce the replicas of rank 1's shard (ranks 1 and 3) still agree: the corruption is averaged in
    assert rows(faulty, "SELECT count(DISTINCT param_hash) FROM fingerprints WHERE step = 15 AND domain = 'dp.pp0.tp1'") == [(1,)]


def test_rng_skew_splits_one_replica_pair(faulty: Path) -> None:
    def distinct(step: int) -> int:
        return rows(faulty, f"SELECT count(DISTINCT rng_torch_hash) FROM fingerprints WHERE step = {step} AND domain = 'dp.pp0.tp1'")[0][0]

    assert distinct(15) == 1 and distinct(20) == 2 and distinct(35) == 2
    assert rows(faulty, "SELECT count(DISTINCT rng_torch_hash) FROM fingerprints WHERE step = 35 AND domain = 'dp.pp0.tp0'") == [(1,)]


def test_data_skew_moves_one_ranks_position(faulty: Path) -> None:
    got = dict(rows(faulty, "SELECT rank, data_position FROM steps WHERE step = 30"))
    assert got[6] == got[0] + 3 and len({v for r, v in got.items() if r != 6}) == 1
    assert rows(faulty, "SELECT count(DISTINCT data_position) FROM steps WHERE step = 24") == [(1,)]


def test_parameter_bitflip_splits_the_replicas_of_one_shard(faulty: Path) -> None:
    def distinct(step: int) -> tuple[int, int]:
        return rows(
            faulty,
            f"SELECT count(DISTINCT param_hash), count(DISTINCT rng_torch_hash) FROM fingerprints "
            f"WHERE step = {step} AND domain = 'dp.pp1.tp0'",
        )[0]

    assert distinct(35) == (1, 1)
    assert distinct(40) == (2, 1) and distinct(55) == (2, 1)


def test_slow_link_slows_only_collectives_that_cross_it(faulty: Path) -> None:
    got = rows(
        faulty,
        "SELECT \"group\" LIKE 'pp.%' AS crosses, step >= 45 AND step < 55 AS during, median(duration_ns)/1e6 "
        "FROM collectives WHERE op = 'send' OR \"group\" LIKE 'tp.%' GROUP BY ALL",
    )
    ms = {(c, d): v for c, d, v in got}
    assert ms[(True, True)] > 50 and ms[(True, False)] < 40
    assert ms[(False, True)] < 40


def _own_compute_ms(run_dir: Path, rank: int, lo: int, hi: int) -> float:
    """The least of the rank's own work per step over [lo, hi) (`steps.compute_ns`: its step less its waits in
    collectives and on the dataloader). The least, because a shared host's load only ever adds to it; its own work,
    because the peer of a slow rank spends the difference waiting in gloo, which moves its thread's CPU clock too
    (measured under a loaded CI host: the peer's thread CPU rose with the slow rank's)."""
    got = rows(run_dir, f"SELECT min(compute_ns) FROM steps WHERE rank = {rank} AND step >= {lo} AND step < {hi}")
    return float(got[0][0]) / 1e6


def test_gpu_slow_on_cpu_does_extra_work_on_its_rank_only_and_says_so(tmp_path: Path) -> None:
    """Without CUDA, gpu_slow falls back to extra CPU work on the training thread: the slow rank's own work rises by
    about `factor`, its peer's does not, the fallback is announced once, and the numerics are those of a clean run
    (the calibration trains a throwaway copy with inputs of its own).

    The rise is below `factor`: the extra work is (factor - 1) times the calibrated *own compute*, while the step's
    own work also holds the collector's and the optimizer's, which the products do not scale. So the bound asks for a
    clear rise (> 1.2, about 1.65 measured) on the slow rank and less than half of it on its peer (0.93 measured)."""
    slowed = tmp_path / "gpu_slow"
    faults = Faults().gpu_slow(rank=1, from_step=10, factor=2.0)
    assert run(canary(slowed, layout="dp=2", steps=30, faults=faults)).ok
    clean = tmp_path / "clean"
    assert run(canary(clean, layout="dp=2", steps=30)).ok
    rise = {r: _own_compute_ms(slowed, r, 12, 30) / _own_compute_ms(slowed, r, 3, 10) for r in (0, 1)}
    assert rise[1] > 1.2 and rise[0] < 1 + 0.5 * (rise[1] - 1), rise
    said = rows(slowed, "SELECT rank, message FROM events WHERE kind = 'warning'")
    assert [(r, m.startswith(GPU_SLOW_CPU_WARNING)) for r, m in said] == [(1, True)]
    loss = "SELECT rank, step, loss FROM steps ORDER BY rank, step"
    assert rows(slowed, loss) == rows(clean, loss)
