"""Liveness on a real canary: a rank SIGKILLed from outside is named by `LivenessMonitor` within seconds (not a
part-file interval), its survivors are not, the part-file detector later raises the same fault (`same_fault`, under its
own id), and a clean run ends with every rank finished and no incident."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rankwatch.analytics.analyze import AnalysisConfig, analyze
from rankwatch.analytics.incidents import IncidentClass, SubjectKind
from rankwatch.analytics.liveness import LivenessMonitor, LivenessView, RankState, same_fault
from rankwatch.recovery.job import LaunchResult

from support import canary, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _poll_until(monitor: LivenessMonitor, timeout_s: float, done: Callable[[LivenessView], bool],
                poll_s: float = 0.1) -> LivenessView:
    deadline = time.monotonic() + timeout_s
    while True:
        view = monitor.poll()
        if done(view):
            return view
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {view.line()}; {[r.why for r in view.ranks]}"
        time.sleep(poll_s)


def test_a_rank_killed_from_outside_is_named_within_seconds(run_dir: Path) -> None:
    # part files every 5 s (the default): liveness must not wait for them
    cfg = canary(run_dir, layout="dp=2,tp=2", steps=100_000, flush_interval_s=5.0, heartbeat_interval_s=0.5,
                 pg_timeout_s=30.0)
    stop = threading.Event()
    out: list[LaunchResult] = []
    launcher = threading.Thread(target=lambda: out.append(run(cfg, stop=stop)), daemon=True)
    launcher.start()
    monitor = LivenessMonitor(run_dir)
    try:
        ready = _poll_until(monitor, 90, lambda v: len(v.in_state(RankState.RUNNING)) == 4
                            and all((r.last_step or 0) >= 15 for r in v.ranks))
        assert ready.incidents == ()
        victim = ready.rank(2)
        assert victim is not None and victim.pid is not None
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        seen = _poll_until(monitor, 5, lambda v: any(i.klass is IncidentClass.FAIL_STOP for i in v.incidents))
        delay = time.monotonic() - killed_at
        (inc,) = seen.incidents
        assert inc.subject.kind is SubjectKind.RANK and inc.subject.id == "2" and inc.ranks == (2,), inc.summary
        assert delay < 3.0, f"named {delay:.2f} s after the kill"
        # the job ends (the survivors' collectives break); the incident stays the same one
        launcher.join(120)
        final = monitor.poll()
        assert final.rank(2).state is RankState.STOPPED and final.rank(2).signal == signal.SIGKILL  # type: ignore[union-attr]
        assert [i.id for i in final.incidents] == [inc.id]
    finally:
        stop.set()
        launcher.join(60)
    (result,) = out
    assert result.exit_codes[2] == -signal.SIGKILL
    # the part-file detector, after the fact, names the same fault with the same id
    failstops = [i for i in analyze(run_dir, config=AnalysisConfig(anomaly=False)).incidents
                 if i.klass is IncidentClass.FAIL_STOP]
    assert [i.subject.id for i in failstops] == ["2"]
    assert same_fault(inc, failstops[0]) and failstops[0].id != inc.id, (failstops[0].summary, inc.summary)


def test_a_clean_run_ends_finished_with_no_incident(run_dir: Path) -> None:
    result = run(canary(run_dir, layout="dp=2", steps=15))
    assert result.ok
    view = LivenessMonitor(run_dir).poll()
    assert view.finished and view.incidents == (), [r.why for r in view.ranks]
    assert {r.last_step for r in view.ranks} == {14}
