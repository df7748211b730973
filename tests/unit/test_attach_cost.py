"""benchmarks/attach_cost.py --quick runs every part and prints the whole table (not its timing target: that belongs
to the benchmark's full run)."""

from __future__ import annotations

import pytest

from support import assert_rows, benchmark_table

ROWS = (
    "critical path per collective, b: attached − bare all_reduce",
    "critical path per collective, b, Flight Recorder off",
    "bare all_reduce (1 KiB, gloo, world 1)",
    "critical path per step, a",
    "projected overhead, 0.5 s step × 1,000 collectives",
    "ON vs OFF wall time per step, ddp_gpt",
    "ON vs OFF wall time per step, fsdp2_transformer",
    "ON vs OFF wall time per step, fsdp_tp_2d",
    "collector internal errors (in process)",
    "target: projected 0.5 s step × 1,000 collectives ≤ 0.3 %",
)


@pytest.mark.slow  # two measuring processes and twelve example launches
@pytest.mark.timeout(600)
def test_quick_run_prints_every_row() -> None:
    assert_rows(benchmark_table("attach_cost.py", "--quick", timeout_s=580), ROWS)
