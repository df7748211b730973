"""The post-mortem notebook on a canary run recovered live from a SIGKILL (4 real gloo ranks, rank 2 killed in step 20,
the recovery manager restarting the job from its newest checkpoint): the crash told in order, the replayed steps from
the lineage, goodput within 100 %, a verdict that does not call the run healthy, HTML without code."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.canary import Faults, launch
from rankwatch.control.manager import supervise
from support import canary
from notebook_support import GOODPUT as _GOODPUT, outputs as _outputs, readable_html as _readable_html, \
    report as _report, text as _text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass(frozen=True)
class Killed:
    run_dir: Path
    record: str
    replayed: str
    """The steps the recovery trained again, as the notebook writes them: 'first..last'."""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    """4 canary ranks (dp=4), rank 2 SIGKILLed in step 20, recovered live by the recovery manager from its newest
    checkpoint (step 15 unless a save was slow), as `rankwatch train ... --fault kill:rank=2,step=20 --supervise 1`."""
    run_dir = tmp_path_factory.mktemp("pm-kill") / "run"
    cfg = canary(run_dir, layout="dp=4", steps=40, faults=Faults().kill(rank=2, step=20), checkpoint_every=8,
                 pg_timeout_s=5.0)
    out = supervise(cfg, launcher=launch, max_recoveries=1, timeout_s=150, failure_grace_s=3.0, term_grace_s=2.0)
    assert not out.first.ok and out.ok and len(out.records) == 1, out.stopped
    ck = out.records[0].plan.checkpoint
    assert ck is not None and ck.step < 19, ck
    return Killed(run_dir=run_dir, record=out.records[0].id, replayed=f"{ck.step + 1}..19")



def test_live_recovered_kill_is_told_from_the_crash_to_the_replay(killed: Killed, tmp_path: Path):
    report = _report(killed.run_dir, tmp_path)
    outs = _outputs(report.nb)
    assert not [o for o in outs if o.output_type == "error"]
    text = _text(report.nb)
    assert "First to stop: rank 2" in text  # the SIGKILLed rank, before the peers it left in their all-reduce
    assert killed.record in text
    assert f"steps {killed.replayed} were trained twice" in text  # from the lineage, not from the final trajectory
    assert "no step was trained twice" not in text
    assert "healthy" not in text.lower() and "healthy" not in report.html.lower()
    assert "The run failed and was recovered" in text
    # the timeline draws the whole run: the crash, the decision and the restart; nothing is left outside
    assert "recorded outside the run's time" not in text
    goodput = [float(g) for g in _GOODPUT.findall(text) + _GOODPUT.findall(report.html)]
    assert goodput and all(0.0 < g <= 100.0 for g in goodput), goodput
    _readable_html(report.html)


def test_analyze_names_the_fail_stop_the_live_loop_recovered(killed: Killed, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The final telemetry shows a completed attempt, so the analysis finds no incident; the recovery record's
    fail-stop is still said, with what became of it."""
    from rankwatch.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["analyze", str(killed.run_dir), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "recovered live, recorded by the recovery manager (1):" in out, out
    assert "fail_stop rank:2 in step 20 (attempt 0): recovered" in out and killed.record in out
    section = out.split("recovered live")[1].split("written:")[0]  # the header and "written:" lines hold paths
    assert max(map(len, section.splitlines())) <= 80, out
