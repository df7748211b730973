"""The what-if on real canary runs: a run with one slow rank and the same run without the fault, side by side. The
slow run's what-if slowdown S (its steps replayed with every rank's work made its peers' median) matches the ratio of
the two runs' measured times within 10 %; the clean run's S stays near 1 (its ranks' jitter only); the replay
reproduces what was measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analytics.whatif import WhatIfInputError, whatif
from rankwatch.canary.faults import Faults

from support import canary, run

pytestmark = pytest.mark.slow

STEPS = 12
BASE = dict(layout="dp=4", steps=STEPS, pace_s=0.12, fingerprint_every=0, checkpoint_every=0, seed=2)


@pytest.mark.timeout(240)
def test_the_what_if_of_a_slow_rank_matches_the_run_without_it(tmp_path: Path) -> None:
    clean_dir, slow_dir = tmp_path / "clean", tmp_path / "slow"
    assert run(canary(clean_dir, **BASE)).ok  # type: ignore[arg-type]
    assert run(canary(slow_dir, faults=Faults().slow(rank=2, delay_s=0.06), **BASE)).ok  # type: ignore[arg-type]
    clean, slow = whatif(clean_dir), whatif(slow_dir)
    assert (clean.first_step, clean.last_step) == (slow.first_step, slow.last_step) == (1, STEPS - 1)
    measured = slow.measured_ns / clean.measured_ns
    assert slow.slowdown == pytest.approx(measured, rel=0.10), (slow.describe(), clean.describe())
    assert slow.by_rank[0].subject == "rank:2" and slow.by_rank[0].saved_share > 0.15
    assert slow.last_rank is not None and slow.last_rank[0] == 2
    # a clean run loses only its ranks' jitter: each step waits for the slowest of 4 ranks, the ideal takes their
    # median. On 2 shared cores that reads 1.01-1.04 (docs/benchmarks.md); a GPU job's ~1 % jitter reads below 1.03
    assert clean.slowdown < 1.06, clean.describe()
    assert slow.slowdown - 1 > 5 * (clean.slowdown - 1)
    assert all(0.95 <= w.fidelity <= 1.05 for w in (clean, slow)), (clean.fidelity, slow.fidelity)
    with pytest.raises(WhatIfInputError, match=r"steps 5\.\.90 of attempt 0 were not all completed by ranks \[0, 1, 2, 3\]"):
        whatif(clean_dir, steps=(5, 90))
    with pytest.raises(WhatIfInputError, match="attempt 3 completed no step"):
        whatif(clean_dir, attempt=3)
