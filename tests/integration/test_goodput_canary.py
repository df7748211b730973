"""Goodput and checkpoint-interval advice on a real recovered canary run: 2 gloo ranks, a checkpoint every 4 steps,
rank 1 exits at step 10, the recovery manager restarts the job from step-00000007 and steps 8 and 9 are trained
again. `rankwatch goodput` counts the thrown-away copies as lost work (their time as the telemetry has it), the
detection and decision the manager recorded, the relaunch and restore as restart time, and its parts sum to the span;
`rankwatch advise` gives intervals at 2,048 and 16,384 ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rankwatch.base.rundir import read_recovery_records
from rankwatch.canary import Faults
from rankwatch.canary.launcher import launch
from rankwatch.cli import main
from rankwatch.control.manager import supervise
from support import canary, rows

pytestmark = [pytest.mark.slow]

BASE = dict(layout="dp=2", steps=14, checkpoint_every=4, fingerprint_every=4, seed=3, pg_timeout_s=4.0, pace_s=0.05)
LAUNCH = dict(timeout_s=150, failure_grace_s=3.0, term_grace_s=2.0)


@pytest.fixture(scope="module")
def recovered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("goodput") / "run"
    out = supervise(canary(run_dir, faults=Faults().exit(rank=1, step=10), **BASE),
                    launcher=launch, **LAUNCH)  # type: ignore[arg-type]
    assert not out.first.ok and out.ok and len(out.records) == 1, out.stopped
    return run_dir


@pytest.mark.timeout(300)
def test_goodput_counts_the_replayed_steps_as_lost_and_the_restart(recovered: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["goodput", str(recovered), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    parts = {p["part"]: p for p in doc["parts"]}
    [stop] = doc["interruptions"]
    resumed = stop["resumed_step"]
    assert stop["failed_attempt"] == 0 and stop["resumed_attempt"] == 1 and resumed == 8, stop
    assert stop["recovery"] == "recovery-0001" and stop["lost_steps"] == 2
    # the thrown-away copies' time, independently: attempt 0's steps from the resume on, each its slowest rank's
    # duration (the slices also hold the little time between steps, and the failed step's start)
    (replayed_s,) = rows(recovered, f"SELECT sum(d) / 1e9 FROM (SELECT step, max(duration_ns) AS d FROM steps "
                                    f"WHERE attempt = 0 AND step >= {resumed} GROUP BY step)")[0]
    lost = parts["lost_work"]["seconds"]
    assert lost > 0 and lost == pytest.approx(replayed_s, rel=0.25, abs=0.05), (lost, replayed_s)
    restart = sum(parts[p]["seconds"] or 0.0 for p in ("relaunch", "restore", "gate"))
    assert restart > 0 and parts["relaunch"]["seconds"] > 0 and parts["restore"]["seconds"] > 0
    assert 0 < doc["ratio"] < 1
    assert sum(p["seconds"] for p in doc["parts"] if p["seconds"] is not None) == pytest.approx(doc["total_s"],
                                                                                                abs=1e-5)
    # the supervised manager records when its launcher saw rank 1 exit and when it had decided: both measured, in
    # order between the failure and the relaunch, and nothing of the interruption is left unattributed
    for p in ("detection", "decision"):
        assert parts[p]["seconds"] is not None and parts[p]["seconds"] > 0 and not parts[p]["why"], parts[p]
    assert stop["failure_ns"] < stop["detected_ns"] < stop["decided_ns"] < stop["relaunched_ns"], stop
    # the launcher's earliest exit record of a rank that ended abnormally: the culprit's, or a survivor's whose
    # collective failed with it when one poll of the launcher saw both end (their order within a poll is arbitrary)
    assert re.fullmatch(r"the launcher saw rank [01] of attempt 0 end \(exit code 1\)", stop["detected_by"]), stop
    assert parts["detection"]["seconds"] < 1.0  # the launcher polls every 0.1 s
    [rec] = read_recovery_records(recovered)
    assert (rec.detected_wall_ns, rec.decided_wall_ns) == (stop["detected_ns"], stop["decided_ns"])
    assert rec.wall_ns is not None and rec.wall_ns > stop["relaunched_ns"]  # the record itself: after the relaunch
    assert parts["other"]["seconds"] == pytest.approx(0.0, abs=1e-6), parts["other"]
    assert parts["checkpoint"]["seconds"] > 0 and parts["straggler"]["seconds"] is not None
    assert main(["goodput", str(recovered)]) == 0
    table = capsys.readouterr().out
    assert "lost_work" in table and "recovery-0001 (restart_job)" in table


@pytest.mark.timeout(300)
def test_advise_gives_intervals_at_2048_and_16384_ranks(recovered: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", str(recovered), "--mtbf-hours", "50000"]) == 0
    text = capsys.readouterr().out
    assert "synchronous save (blocking):" in text and "unexpected interruptions: 1" in text
    assert main(["advise", str(recovered), "--mtbf-hours", "50000", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_ranks = {r["ranks"]: r for r in doc["rows"]}
    assert set(by_ranks) == {2, 2048, 16_384}
    for n in (2048, 16_384):
        row = by_ranks[n]
        assert row["job_mtbf_s"] == pytest.approx(50_000 * 3600 / n)
        assert 0 < row["young_daly_s"] and 0 < row["advised_s"]
        assert row["advised"]["goodput"] > 0.9 and row["current"] is not None
    assert by_ranks[16_384]["advised_s"] < by_ranks[2048]["advised_s"]
    assert doc["costs"]["restore"]["seconds"] > 0 and doc["costs"]["sync_interval"]["seconds"] > 0
    # without a given MTBF: the run's own one interruption, said to be a weak estimate
    assert main(["advise", str(recovered)]) == 0
    text = capsys.readouterr().out
    assert "observed: 1 interruption(s)" in text and "weak estimate" in text
