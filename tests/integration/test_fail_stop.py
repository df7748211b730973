"""Ranks that die or hang: their flushed evidence stays readable, and the survivors say where they were."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import TELEMETRY_DIR
from rankwatch.canary import Faults
from rankwatch.recovery.job import LaunchResult

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _all_parts_readable(run_dir: Path) -> int:
    parts = list((run_dir / TELEMETRY_DIR).rglob("part-*.parquet"))
    for p in parts:
        pq.read_table(p)  # raises on a half-written file
    return len(parts)


def _wait_for(predicate, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:
            pass  # tables may not exist yet
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def test_sigkill_from_outside(run_dir: Path) -> None:
    """An outside tool finds rank 2's pid in the topology table and SIGKILLs it mid-run."""
    cfg = canary(run_dir, layout="dp=2,tp=2", steps=100_000)
    out: list[LaunchResult] = []
    launcher = threading.Thread(target=lambda: out.append(run(cfg)), daemon=True)
    launcher.start()
    _wait_for(lambda: rows(run_dir, "SELECT count(*) FROM steps WHERE rank = 2")[0][0] >= 20, 90)
    ((pid,),) = rows(run_dir, "SELECT pid FROM topology WHERE rank = 2")
    os.kill(pid, signal.SIGKILL)
    launcher.join(120)
    (result,) = out
    assert result.exit_codes[2] == -signal.SIGKILL
    assert all(c != 0 for c in result.exit_codes)
    assert _all_parts_readable(run_dir) > 0
    # the killed rank wrote no exit event; every survivor recorded the collective that broke under it
    assert rows(run_dir, "SELECT count(*) FROM events WHERE rank = 2 AND kind = 'exit'") == [(0,)]
    broken = rows(
        run_dir,
        "SELECT rank, collective_op, collective_group FROM events WHERE kind = 'exception' AND collective_op IS NOT NULL",
    )
    assert {r for r, _, _ in broken} == {0, 1, 3}
    assert all(op in ("all_reduce", "barrier") for _, op, _ in broken)
    # matching error rows in the collectives table
    assert {r for (r,) in rows(run_dir, "SELECT DISTINCT rank FROM collectives WHERE status = 'error'")} == {0, 1, 3}


def test_hang_is_alive_but_stuck(run_dir: Path) -> None:
    """A hung rank keeps its heartbeats; peers block in a collective (snapshotted in flight) until the timeout."""
    result = run(canary(run_dir, layout="dp=2,tp=2", steps=60, faults=Faults().hang(rank=1, step=15)))
    assert result.exit_codes[1] == -signal.SIGTERM and 1 in result.terminated
    assert rows(run_dir, "SELECT max(step) FROM steps WHERE rank = 1") == [(14,)]
    ((last_step_end, last_beat),) = rows(
        run_dir,
        "SELECT (SELECT max(end_wall_ns) FROM steps WHERE rank = 1), "
        "(SELECT max(wall_ns) FROM events WHERE rank = 1 AND kind = 'heartbeat')",
    )
    assert last_beat - last_step_end > 5e9  # alive for seconds after its last step
    assert rows(run_dir, "SELECT count(*) FROM events WHERE rank = 1 AND kind = 'signal' AND signal = 15") == [(1,)]
    # peers were seen inside a collective at step 15 before their timeout fired
    in_flight = rows(run_dir, "SELECT DISTINCT rank FROM collectives WHERE status = 'in_flight' AND step = 15")
    assert {r for (r,) in in_flight} >= {0}
    assert _all_parts_readable(run_dir) > 0


def test_exit_fault(run_dir: Path) -> None:
    result = run(canary(run_dir, layout="dp=2,tp=2", steps=60, faults=Faults().exit(rank=3, step=12, code=3)))
    assert result.exit_codes[3] == 3
    assert rows(run_dir, "SELECT count(*) FROM events WHERE rank = 3 AND kind = 'exit'") == [(0,)]
    survivors = rows(run_dir, "SELECT DISTINCT rank FROM events WHERE kind = 'exception' AND collective_op IS NOT NULL")
    assert {r for (r,) in survivors} == {0, 1, 2}
    assert _all_parts_readable(run_dir) > 0
