"""Localization across real canary runs of one job: restarts that place ranks on other GPUs of their host
(`device_shift`) tell a fault that follows the device from one that follows the rank number, and the recovery
manager quarantines the device only in the first case."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analytics.analyze import observe_run
from rankwatch.analytics.incidents import IncidentClass
from rankwatch.analytics.localize import FollowsKind, localize
from rankwatch.base.topology import Layout
from rankwatch.canary import Faults
from rankwatch.canary.config import canary_declaration
from rankwatch.collector.gpu import replay_uuid
from rankwatch.control.manager import catalog_view, plan_recovery
from rankwatch.recovery.decision import Action
from rankwatch.recovery.policy import RecurrenceView

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 80


def _runs(tmp_path: Path, faults: Faults) -> list[Path]:
    """The same job twice: devices in place, then a restart shifted by one slot (2 ranks a host)."""
    out = []
    for i, shift in enumerate((0, 1)):
        run_dir = tmp_path / f"run{i}"
        assert run(canary(run_dir, layout="dp=4", hosts=2, steps=STEPS, device_shift=shift, faults=faults)).ok
        out.append(run_dir)
    return out


def test_a_bad_gpu_follows_its_device_under_other_ranks_and_is_quarantined(tmp_path: Path) -> None:
    runs = _runs(tmp_path, Faults().bad_device(host=0, index=1, from_step=30, delay_s=0.03))
    bad = replay_uuid("host0", 1)
    # the placement really moved: rank 1 sat on the bad GPU, then rank 0, then rank 1 again
    placed = [rows(r, f"SELECT rank FROM topology WHERE device_uuid = '{bad}'") for r in runs]
    assert placed == [[(1,)], [(0,)]]
    observed = [observe_run(r) for r in runs]
    [loc] = [x for x in localize(observed) if x.klass is IncidentClass.STRAGGLER]
    assert (loc.follows, loc.subject, loc.occurrences) == (FollowsKind.DEVICE, bad, 2)

    recurrence = {IncidentClass.STRAGGLER: RecurrenceView.from_localization(loc)}
    plan = plan_recovery(observed[-1].incidents, job=canary_declaration(Layout(dp=4)),
                         catalog=catalog_view(runs[-1], Layout(dp=4)), recurrence=recurrence)
    assert plan.action is Action.QUARANTINE and [str(t) for t, _ in plan.quarantines] == [f"device:{bad}"]


def test_a_fault_that_follows_the_rank_number_quarantines_nothing(tmp_path: Path) -> None:
    runs = _runs(tmp_path, Faults().throttle(rank=1, from_step=30, delay_s=0.03))
    observed = [observe_run(r) for r in runs]
    [loc] = [x for x in localize(observed) if x.klass is IncidentClass.STRAGGLER]
    assert (loc.follows, loc.subject) == (FollowsKind.RANK, "1")
    recurrence = {IncidentClass.STRAGGLER: RecurrenceView.from_localization(loc)}
    plan = plan_recovery(observed[-1].incidents, job=canary_declaration(Layout(dp=4)),
                         catalog=catalog_view(runs[-1], Layout(dp=4)), recurrence=recurrence)
    assert plan.action is Action.OBSERVE and not plan.quarantines
    [d] = plan.decided
    assert "recurrence follows rank 1" in " ".join(d.decision.reasons)
