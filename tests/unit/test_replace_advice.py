"""Cost-aware advice about a slow device (recovery/advice.py): replace it at the next checkpoint only when what it
will cost over the rest of the run exceeds a measured restart."""

from __future__ import annotations

import pytest

from rankwatch.analytics.incidents import (
    Cause, Impact, ImpactBasis, Incident, IncidentClass, Subject, SubjectKind,
)
from rankwatch.recovery.advice import RestartCost, replace_advice

pytestmark = pytest.mark.timeout(30)

RESTART = RestartCost(save_s=9.0, relaunch_s=40.0, restore_s=20.0, gate_s=1.0, source="run A")


def _slow(share: float | None, kind: SubjectKind = SubjectKind.DEVICE, klass: IncidentClass = IncidentClass.STRAGGLER
          ) -> Incident:
    impact = (Impact(basis=ImpactBasis.WHATIF, lost_s=1.0, gpu_hours=0.1, share=share, first_step=0, last_step=9)
              if share is not None else Impact(basis=ImpactBasis.UNMEASURED, note="not replayed"))
    return Incident(klass=klass, subject=Subject(kind=kind, id="GPU-aa" if kind is SubjectKind.DEVICE else "3"),
                    ranks=(3,), onset_step=0, detection_step=5, confidence=0.9, cause=Cause.UNKNOWN, summary="slow",
                    impact=impact)


def test_replace_when_the_projected_loss_exceeds_a_restart() -> None:
    """5 % of step time over 2,000 s left is 100 s, more than the 70 s restart: replace at the next checkpoint. Over
    1,000 s left it is 50 s: keep."""
    a = replace_advice(_slow(0.05), remaining_s=2000.0, restart=RESTART)
    assert a is not None and a.replace and a.projected_loss_s == pytest.approx(100.0) and RESTART.total_s == 70.0
    assert "replace it at the next checkpoint" in a.describe() and "measured in run A" in a.describe()
    keep = replace_advice(_slow(0.05), remaining_s=1000.0, restart=RESTART)
    assert keep is not None and not keep.replace and "keep it" in keep.describe()


def test_no_advice_without_a_measured_cost_or_for_what_cannot_be_replaced() -> None:
    assert replace_advice(_slow(None), remaining_s=1e6, restart=RESTART) is None
    assert replace_advice(_slow(0.5, kind=SubjectKind.LINK), remaining_s=1e6, restart=RESTART) is None
    assert replace_advice(_slow(0.5, klass=IncidentClass.IMBALANCE, kind=SubjectKind.RANK), remaining_s=1e6,
                          restart=RESTART) is None
    with pytest.raises(ValueError, match="remaining_s"):
        replace_advice(_slow(0.05), remaining_s=-1.0, restart=RESTART)
    with pytest.raises(ValueError, match="RestartCost.restore_s"):
        RestartCost(save_s=1.0, relaunch_s=1.0, restore_s=float("nan"))


def test_a_relaunch_planned_anyway_replaces_at_no_restart_of_its_own() -> None:
    """1 % over 1,000 s left is 10 s, less than a 70 s restart: kept on its own; but when the plan relaunches the
    job for another incident, the replacement rides along."""
    alone = replace_advice(_slow(0.01), remaining_s=1000.0, restart=RESTART)
    assert alone is not None and not alone.replace
    riding = replace_advice(_slow(0.01), remaining_s=1000.0, restart=RESTART, relaunching=True)
    assert riding is not None and riding.replace and "relaunches the job anyway" in riding.describe()
    assert riding.to_dict()["relaunching"] is True
