"""Incident impact and stragglers found by their cost (analytics/impact.py), on a hand-built graph whose answers are
worked out by hand; the charging of one host's transfer excess to the member that shows excess own work; the impact
through the incident files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.impact import CostConfig, costed
from rankwatch.analytics.incidents import (
    Cause, Impact, ImpactBasis, Incident, IncidentClass, Subject, SubjectKind, read_incidents, write_incidents,
)
from rankwatch.analytics.whatif import Costing, Graph, Replayed, analyze_graph
from rankwatch.analytics.whatif.graph import Instance, Item, Join, Launch, Mark, Work

pytestmark = pytest.mark.timeout(60)

SHORT = CostConfig(min_steps=1)
"""The hand-built graph has 2 steps: the default asks for 20 before a cost is a rate."""


def _graph(slow: float = 14.0) -> Graph:
    """3 ranks, 2 steps. Step 0: work 'a' (rank 2: `slow`, the others 10), an all-reduce of 2. Step 1: work 'b' (10
    each), an all-reduce of the same size that took 10 (its peer took 2: ideal 2). As measured T = slow + 2 + 10 + 10;
    ideal T = 10 + 2 + 10 + 2 = 24."""
    work: list[Work] = []
    ns: list[float] = []
    progs: dict[int, list[Item]] = {}
    inst = (Instance(id=0, op="all_reduce", group="g", members=(0, 1, 2), after=None, step=0, key=("ar", 4)),
            Instance(id=1, op="all_reduce", group="g", members=(0, 1, 2), after=0, step=1, key=("ar", 4)))
    for r in range(3):
        items: list[Item] = []
        for step, key, d in ((0, "a", slow if r == 2 else 10.0), (1, "b", 10.0)):
            w = Work(id=len(work), kind="compute", step=step, key=(0, step, key))
            work.append(w)
            ns.append(d)
            items += [w, Launch(step), Join((step,)), Mark(step)]
        progs[r] = items
    return Graph(programs={r: tuple(p) for r, p in progs.items()}, instances=inst, work=tuple(work),
                 work_ns=np.array(ns), transfer_ns=np.array([2.0, 10.0]))


def _replayed(hosts: dict[int, str], slow: float = 14.0) -> Replayed:
    g = _graph(slow)
    stage_of = dict.fromkeys(range(3), 0)
    c = Costing(g, stage_of=stage_of, host_of=hosts)
    w = analyze_graph(g, stage_of=stage_of, measured_ns=0.0, first_step=0, last_step=1, attempt=0, host_of=hosts,
                      costing=c)
    return Replayed(whatif=w, costing=c)


def _frames(slow: float = 14.0) -> Frames:
    steps = pl.DataFrame({"rank": [0, 1, 2] * 2, "step": [0, 0, 0, 1, 1, 1], "attempt": [0] * 6,
                          "compute_ns": [10, 10, int(slow), 10, 10, 10], "dataloader_wait_ns": [0] * 6})
    topo = pl.DataFrame({"rank": [0, 1, 2], "role": ["pp=0"] * 3, "world_size": [3] * 3})
    return Frames.build(steps=steps, topology=topo)


def test_one_hosts_transfer_excess_is_charged_to_the_member_with_excess_own_work() -> None:
    """On one host, step 1's all-reduce took 8 more than its peer; rank 2 is the only member with excess own work
    (4), so it is charged all 8: fixing rank 2 saves 12 of 36, everything lost. Across hosts the transfer stays with
    the group: fixing rank 2 saves only its own 4."""
    one = _replayed(dict.fromkeys(range(3), "h0")).whatif
    assert (one.actual_ns, one.ideal_ns) == (36.0, 24.0)
    top = one.by_rank[0]
    assert top.subject == "rank:2" and top.saved_ns == 12.0 and top.slowdown == pytest.approx(36 / 24)
    assert all(s.saved_ns == 0.0 for s in one.by_rank[1:])
    apart = _replayed({0: "h0", 1: "h1", 2: "h2"}).whatif
    assert apart.by_rank[0].subject == "rank:2" and apart.by_rank[0].saved_ns == 4.0
    assert next(s for s in apart.by_group if s.subject == "group:g").saved_ns == 8.0
    assert {s.subject for s in apart.by_host} == {"host:h0", "host:h1", "host:h2"}


def test_a_costly_rank_is_a_straggler_with_its_impact_and_every_incident_gets_one() -> None:
    r = _replayed(dict.fromkeys(range(3), "h0"))
    failed = Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.RANK, id="0"), ranks=(0,),
                      onset_step=1, detection_step=1, confidence=1.0, cause=Cause.EXIT, summary="rank 0 exited")
    assert [i.klass for i in costed(_frames(), [failed], r)] == [IncidentClass.FAIL_STOP]  # 2 steps: no rate yet
    out = costed(_frames(), [failed], r, config=SHORT)
    straggler = next(i for i in out if i.klass is IncidentClass.STRAGGLER)
    assert straggler.subject == Subject(kind=SubjectKind.RANK, id="2") and straggler.ranks == (2,)
    assert "cost the job 33.3% of its step time" in straggler.summary
    imp = straggler.impact
    assert imp is not None and imp.basis is ImpactBasis.WHATIF
    assert imp.lost_s == pytest.approx(12e-9) and imp.share == pytest.approx(12 / 36)
    assert imp.gpu_hours == pytest.approx(12e-9 * 3 / 3600) and (imp.first_step, imp.last_step) == (0, 1)
    stop = next(i for i in out if i.klass is IncidentClass.FAIL_STOP)
    assert stop.impact is not None and stop.impact.basis is ImpactBasis.UNMEASURED and "goodput" in stop.impact.note


def test_a_rank_an_incident_names_is_not_raised_twice_and_noise_raises_nothing() -> None:
    r = _replayed(dict.fromkeys(range(3), "h0"))
    named = Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,),
                     onset_step=1, detection_step=1, confidence=0.9, cause=Cause.UNKNOWN, summary="slow")
    out = costed(_frames(), [named], r, config=SHORT)
    assert len(out) == 1 and out[0].id == named.id
    imp = out[0].impact
    assert imp is not None and imp.first_step == 1  # its span: from its onset
    # fixing rank 2 saves 12 over the window, 4 of them in step 0 (its work 'a'), before the incident's onset: its
    # impact is step 1's 8 (its part of the all-reduce's excess), of the 20 step 1 took
    assert imp.lost_s == pytest.approx(8e-9) and imp.share == pytest.approx(8 / 20)
    quiet = _replayed(dict.fromkeys(range(3), "h0"), slow=10.1)  # saves 0.1 of 32.1 + its 8 of transfer: costly;
    assert costed(_frames(10.1), [], quiet, config=CostConfig(min_share=0.5, min_steps=1)) == ()  # below a set share: nothing


def test_no_replay_leaves_every_incident_unmeasured_with_the_reason() -> None:
    slow = Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,),
                    onset_step=1, detection_step=1, confidence=0.9, cause=Cause.UNKNOWN, summary="slow")
    out = costed(_frames(), [slow], None, why_not="the window was not replayed: no step completed")
    assert out[0].impact == Impact(basis=ImpactBasis.UNMEASURED, note="the window was not replayed: no step completed")


def test_impact_round_trips_through_the_incident_files(tmp_path: Path) -> None:
    r = _replayed(dict.fromkeys(range(3), "h0"))
    out = costed(_frames(), [], r, config=SHORT)
    write_incidents(out, tmp_path)
    for name in ("incidents.json", "incidents.parquet"):
        back = read_incidents(tmp_path / name)
        assert back[0].impact == out[0].impact and back[0].id == out[0].id
    with pytest.raises(ValueError, match="impact"):
        Impact(basis=ImpactBasis.WHATIF, lost_s=float("nan"))
    d = out[0].to_dict()
    d["impact"] = {"basis": "whatif", "lost_s": "a lot"}
    with pytest.raises(ValueError, match="lost_s"):
        Incident.from_dict(d)


def test_a_cost_is_sure_when_it_is_spread_over_the_window_not_made_of_one_step() -> None:
    """30 steps of 10. Rank a saves 1 in every step, rank b 30 in one step: both 10 % of the time, 10 % above the
    typical rank (the median of 4; c and d save nothing). Only a's is a rate: b's is one draw of the machine's noise
    (a process descheduled once), below the set share in more than 5 % of resamples of the steps."""
    from rankwatch.analytics.impact import _surely_above

    steps = np.full(30, 10.0)
    saved = np.zeros((30, 4))
    saved[:, 0] = 1.0
    saved[17, 1] = 30.0
    low = _surely_above(steps, saved)
    assert low[0] >= CostConfig().min_share > low[1]
    assert (low == _surely_above(steps, saved)).all()  # seeded: the same steps, the same answer
    assert _surely_above(steps, np.zeros((30, 0))).shape == (0,)


def test_a_rank_alone_in_its_stage_has_no_measured_cost_and_the_what_if_says_why() -> None:
    """A pipeline of one replica (each stage one rank): no peer does a rank's work, so its ideal is its own and
    making it ideal saves nothing by construction. Its straggler incident's impact is unmeasured with that reason,
    not a cost of 0 %; the what-if warns, and names no rank as most often over its peers."""
    g = _graph()
    stage_of = {0: 0, 1: 1, 2: 2}
    c = Costing(g, stage_of=stage_of, host_of=dict.fromkeys(range(3), "h0"))
    w = analyze_graph(g, stage_of=stage_of, measured_ns=0.0, first_step=0, last_step=1, attempt=0, costing=c)
    assert c.alone == {0, 1, 2} and w.last_rank is None
    assert any("their stage's only rank" in x for x in w.warnings)
    slow = Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,),
                    onset_step=0, detection_step=1, confidence=0.9, cause=Cause.UNKNOWN, summary="slow")
    (out,) = costed(_frames(), [slow], Replayed(whatif=w, costing=c), config=SHORT)
    assert out.impact is not None and out.impact.basis is ImpactBasis.UNMEASURED
    assert "rank 2 is stage 2's only rank" in out.impact.note
    # with peers (one stage of three ranks) the same rank's cost is measured
    (peered,) = [i for i in costed(_frames(), [slow], _replayed(dict.fromkeys(range(3), "h0")), config=SHORT)]
    assert peered.impact is not None and peered.impact.basis is ImpactBasis.WHATIF and peered.impact.share > 0
