"""SIGKILL a rank at random instants of checkpoint saves on real gloo ranks (the trials of
benchmarks/checkpoint_kills.py, fewer of them): no listing and no loader ever accepts a partial checkpoint, and
every chosen checkpoint loads into exactly the state an uninterrupted run had after that step, and every killed run
resumed from it ends bitwise where the uninterrupted run ends."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
from pathlib import Path

import pytest

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.recovery import catalog
from rankwatch.recovery.catalog import MANIFEST, Candidate, Manifest, Verdict, checkpoint_id

import checkpoint_kills as ck  # benchmarks/ is on the tests' path (pyproject), which spawned ranks inherit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRIALS = 8
SEED = 20261130


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> list[ck.TrialResult]:
    # checkpoint_every=1 only: one reference run serves every trial
    return ck.run_campaign(ck.plan_trials(TRIALS, SEED, everies=(1,)), tmp_path_factory.mktemp("kills"))


def test_random_kills_during_saves_never_publish_or_load_a_partial(campaign: list[ck.TrialResult]) -> None:
    for r in campaign:
        assert not r.note, ck.describe(r)  # each trial killed its rank as planned
        assert r.exit_codes[r.plan.rank] == -signal.SIGKILL, ck.describe(r)
        assert not r.violations, ck.describe(r)
        assert r.loaded, ck.describe(r)
    s = ck.summarize(campaign)
    assert s.partials_accepted == 0
    assert s.partials_seen >= 1, s  # the catalog had temporaries to reject
    assert s.in_save >= TRIALS // 2, s.landings  # the kills really land inside saves, not between them
    # every killed run, resumed to its last step, ends bitwise in the uninterrupted run's state
    assert s.resumed == s.resumed_ok == s.final_equal == TRIALS, s
    assert s.replay_broken == 0, s


def test_the_trial_check_fails_when_a_catalog_accepts_a_temporary(
    campaign: list[ck.TrialResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trial = campaign[0]
    assert trial.check.chosen is not None
    run_dir = tmp_path / "run"
    shutil.copytree(trial.run_dir / CHECKPOINT_DIR, run_dir / CHECKPOINT_DIR)
    # a save that got as far as its manifest but was never renamed: real bytes, a valid manifest, a temporary name
    newer = trial.plan.target_step + 100
    tmp = run_dir / CHECKPOINT_DIR / f".{checkpoint_id(newer)}.tmp"
    shutil.copytree(run_dir / CHECKPOINT_DIR / trial.check.chosen.path.name, tmp)
    doc = json.loads((tmp / MANIFEST).read_text())
    doc.update(checkpoint_id=checkpoint_id(newer), step=newer)
    (tmp / MANIFEST).write_text(json.dumps(doc))
    assert ck.check_catalog(run_dir, trial.plan).violations == ()  # the real catalog: PARTIAL, never chosen

    judge = catalog._judge

    def lenient(path: Path, step: int, **kw: object) -> Candidate:  # trusts a temporary's manifest
        c = judge(path, step, **kw)  # type: ignore[arg-type]
        if c.verdict is Verdict.PARTIAL and (path / MANIFEST).exists():
            return dataclasses.replace(c, verdict=Verdict.COMMITTED, reason="ok",
                                       manifest=Manifest.from_json((path / MANIFEST).read_text()))
        return c

    monkeypatch.setattr(catalog, "_judge", lenient)
    check = ck.check_catalog(run_dir, trial.plan)
    assert check.accepted_partial
    assert any(v.startswith(f"temporary {tmp.name} judged committed") for v in check.violations), check.violations
    assert f"chose a temporary: {tmp.name}" in check.violations
