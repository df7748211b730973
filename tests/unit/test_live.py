"""Live analysis: new part files are read incrementally and the latest window is analyzed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import IncidentClass
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
from rankwatch.base.topology import Layout
from rankwatch.simulator import SimConfig, parse_sim_fault, simulate, split_tail


def test_refresh_reads_only_new_parts_and_the_window_sees_a_late_straggler(tmp_path: Path) -> None:
    run, staging = tmp_path / "run", tmp_path / "staging"
    simulate(SimConfig(layout=Layout(dp=4, tp=2, pp=2), hosts=4, steps=100, phases=False,
                       faults=(parse_sim_fault("gpu_slow:rank=6,from=85,factor=1.3"),)), run)
    tails = split_tail(run, 80, staging)
    assert tails > 0
    live = LiveAnalyzer(run, LiveConfig(window_steps=20, keep_steps=50))
    first = live.refresh()
    assert first > 0 and live.refresh() == 0  # nothing new
    before = live.analyze()
    assert before.last_step == 79 and before.incidents == ()
    for f in staging.rglob("*.parquet"):
        target = run / f.relative_to(staging)
        shutil.move(f, target)
    assert live.refresh() == tails
    after = live.analyze()
    assert (after.first_step, after.last_step) == (80, 99)
    assert [(i.klass, i.subject.id) for i in after.incidents] == [(IncidentClass.STRAGGLER, "6")]
    # rows older than keep_steps behind the newest step are gone from memory
    assert live.con.execute("SELECT min(step) FROM steps").fetchall()[0][0] == 49


def test_analyze_before_any_telemetry(tmp_path: Path) -> None:
    (tmp_path / "telemetry").mkdir()
    live = LiveAnalyzer(tmp_path)
    assert live.refresh() == 0
    with pytest.raises(RunDirError, match="no telemetry read yet"):
        live.analyze()
    with pytest.raises(ValueError, match="keep_steps"):
        LiveConfig(window_steps=30, keep_steps=10)


def test_a_run_whose_ranks_have_not_started_is_waited_for_and_a_missing_run_raises(tmp_path: Path) -> None:
    """A monitor started beside a job just launched finds its run directory before any rank created telemetry/:
    nothing to read yet, not an error; the parts are read once they appear. A run directory that does not exist is
    a mistyped path, and says so."""
    run = tmp_path / "run"
    simulate(SimConfig(layout=Layout(dp=2), hosts=1, steps=20, phases=False), run)
    shutil.move(run / "telemetry", tmp_path / "later")
    live = LiveAnalyzer(run)
    assert not live.started() and live.refresh() == 0
    shutil.move(tmp_path / "later", run / "telemetry")
    assert live.started() and live.refresh() > 0
    with pytest.raises(RunDirError, match="does not exist"):
        LiveAnalyzer(tmp_path / "nowhere").refresh()
