"""The kill drill end to end: a fault-free reference run, then the manager service launching the same canary, a
Monitor sending it signed webhooks, a rank SIGKILLed from outside — detected as a fail-stop of that rank, a
relaunching decision accepted, the job restarted from a checkpoint and training again, its final fingerprints bitwise
equal to the reference run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwatch.canary.drills import REPORT_FILE, VICTIM, read_report, run_drills

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)
# analytics/failstop.py compares a column with a null mode value (polars UserWarning) while the job runs; in the
# monitor's thread pytest's filterwarnings=error would turn it into an exception that ends the monitor
@pytest.mark.filterwarnings("ignore:Comparisons with None always result in null:UserWarning")
def test_the_kill_drill_detects_decides_recovers_and_matches_the_reference_bitwise(tmp_path: Path) -> None:
    said: list[str] = []
    (report,) = run_drills(["sigkill"], tmp_path, say=said.append)
    assert report.detected == f"fail_stop rank:{VICTIM}", report
    assert report.decision is not None and report.decision.startswith("restart_job"), report
    assert report.recovery is not None and report.recovery.endswith(": recovered"), report
    assert report.attempts == 2 and report.resume_from is not None, report
    assert report.training_again_s is not None and report.training_again_s > 0, report
    assert report.steps_lost is not None and report.steps_lost >= 0, report
    assert report.bitwise is True and report.passed and report.verdict == "PASS", report
    assert report.detect_s is not None and report.decision_s is not None and report.detect_s <= report.decision_s + 1
    assert read_report(tmp_path / REPORT_FILE) == (report,)
    assert json.loads((tmp_path / "reference.json").read_text())["step"] == 49
    assert any("detected fail_stop rank:1" in s for s in said)


@pytest.mark.timeout(420)
def test_a_state_drill_and_a_checkpoint_drill_roll_back_past_what_holds_the_fault(tmp_path: Path) -> None:
    # bitflip: corruption all-reduced into every replica (they agree), rolled back to the checkpoint before it, the
    # replay not read as nondeterministic; corrupt_shard: the recovery passes over the damaged newest checkpoint
    flip, shard = run_drills(["bitflip", "corrupt_shard"], tmp_path, say=lambda _: None)
    assert flip.detected == f"corruption rank:{VICTIM}" and flip.decision is not None, flip
    assert flip.resume_from == "step-00000019" and flip.bitwise is True and flip.passed, flip
    assert shard.detected == f"fail_stop rank:{VICTIM}" and shard.resume_from == "step-00000019", shard
    # the damaged step-29 checkpoint was passed over and retired (as evidence), not resumed from
    assert "step-00000029 -> .retired-step-00000029-" in shard.reason and shard.bitwise is True and shard.passed, shard


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:Comparisons with None always result in null:UserWarning")
def test_a_partitioned_rank_and_a_device_failing_under_other_ranks_are_each_named_and_recovered(tmp_path: Path) -> None:
    # partition: every connection of rank 1 destroyed from outside, every rank's collective fails at once: named by
    # its own end's error (cause network), not the job; failing_device: a GPU failing under whichever rank sits on
    # it, every attempt: rotated, localized to the device across the attempts, quarantined, placed off
    cut, dev = run_drills(["partition", "failing_device"], tmp_path, say=lambda _: None)
    assert cut.detected == f"fail_stop rank:{VICTIM}" and cut.bitwise is True and cut.passed, cut
    assert dev.attempts == 4 and dev.recovery is not None and dev.recovery.startswith("recovery-0003"), dev
    assert dev.bitwise is True and dev.passed, dev
    run = Path(dev.run_dir)
    records = [json.loads(p.read_text()) for p in sorted((run / "recovery").glob("recovery-*.json"))]
    assert [bool(r["reshuffle"]) for r in records] == [False, True, False]
    assert [r["quarantined"] for r in records][-1] and "recurrence=device" in records[-1]["decisions"][0]["path"]
    shifts = [launch["device_shift"] for launch in json.loads((run / "run.json").read_text())["launches"]]
    assert shifts == [0, 0, 1, 2]


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Comparisons with None always result in null:UserWarning")
def test_the_kill_drill_on_a_job_rankwatch_did_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # examples/ddp_gpt.py owned by the manager by its own command line (control.command): the same chain, and the
    # final state (parameters, optimizer, torch's RNG, data position) bitwise the reference run's
    from rankwatch.canary.drills.targets import example_target

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # examples/ is found from the repository root
    (report,) = run_drills(["sigkill"], tmp_path, say=lambda _: None, target=example_target("ddp_gpt"))
    assert report.job == "example:ddp_gpt" and report.detected == f"fail_stop rank:{VICTIM}", report
    assert report.recovery is not None and report.recovery.endswith(": recovered") and report.attempts == 2, report
    assert report.resume_from is not None and report.bitwise is True and report.passed, report
    assert json.loads((tmp_path / "reference-ddp_gpt.json").read_text())["target"] == "example:ddp_gpt"
