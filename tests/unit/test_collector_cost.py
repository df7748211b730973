"""benchmarks/collector_cost.py --quick runs every part and prints the whole table (not its timing targets: those
belong to the benchmark's full run)."""

from __future__ import annotations

import pytest

from support import assert_rows, benchmark_table

ROWS = (
    "critical path per step, a",
    "critical path per collective, b",
    "critical path at 0 collectives a step",
    "critical path at 10 collectives a step",
    "critical path at 100 collectives a step",
    "  of a, the liveness record written at each step's end",
    "per-collective breakdown",
    "background CPU at 0.1 s steps × 100 collectives",
    "ON vs OFF step time, 2 ranks on 2 cores",
    "ON vs OFF training-thread CPU per step",
    "projected overhead, 0.1 s step × 100 collectives",
    "projected overhead, 0.5 s step × 1,000 collectives",
    "projected overhead, 2 s step × 1,000 collectives",
    "collector internal errors + dropped rows",
    "target: ON vs OFF ≤ 0.5 %",
    "target: projected 0.5 s step × 1,000 collectives ≤ 0.3 %",
)


@pytest.mark.slow  # spawns 2 gloo ranks four times
@pytest.mark.timeout(420)
def test_quick_run_prints_every_row() -> None:
    assert_rows(benchmark_table("collector_cost.py", "--quick", timeout_s=400), ROWS)
