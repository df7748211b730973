"""The recovery-scope policy: every documented case by hand, invariants over the whole input space, the doc table.

All fail-stop and hang cases lose rank 3 of an 8-rank job (recovery/policy.py `DECISION_CASES`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from rankwatch.analytics.incidents import Cause, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.localize import FollowsKind, Localization
from rankwatch.base.schema import ChangeReason, Comparability
from rankwatch.recovery.decision import (
    Action, CheckpointCatalogView, CheckpointRef, Decision, GateResult, GateVerdict, Idempotency, LineageNote,
    LineageRecord, MembershipSupport, ScopeKind, StateField, TargetKind,
)
from rankwatch.recovery.policy import (
    DECISION_CASES, DecisionCase, RecurrenceView, decide, decision_rows, doc_table_section, quarantine_targets,
    render_decision_table, single_run_quarantines, write_decision_doc,
)

A = Action
SAME, CHANGED = Comparability.BITWISE_IDENTICAL_EXPECTED, Comparability.CHANGED
C100 = "checkpoint:step-00000100@100"
DOC = Path(__file__).resolve().parents[2] / "docs" / "recovery.md"


@dataclass(frozen=True, kw_only=True, slots=True)
class X:
    """What one documented case must decide."""

    action: Action
    target: str | None
    path: tuple[str, ...]
    """The path after 'class=...'."""
    reason: str
    """A substring of one of the reasons."""
    also: tuple[Action, ...] = ()
    lineage: Comparability = SAME


def _x(action: Action, target: str | None, path: tuple[str, ...], reason: str, also: tuple[Action, ...] = (),
       lineage: Comparability = SAME) -> X:
    return X(action=action, target=target, path=path, reason=reason, also=also, lineage=lineage)


AGREE_SURV = "domain job: ranks [0, 1, 2, 4, 5, 6, 7] agree"
EXPECTED: dict[str, X] = {
    "straggler": _x(A.OBSERVE, None, ("recurrence=none", "-> observe"), "a slow rank is not a failed rank"),
    "straggler-rank-recurs": _x(A.OBSERVE, None, ("recurrence=rank", "-> observe"),
                                "recurrence follows rank 5: its data shard or code path"),
    "straggler-device-recurs": _x(A.QUARANTINE, "device:GPU-aa", ("recurrence=device", "-> quarantine device:GPU-aa"),
                                  "recurrence follows device GPU-aa (3 occurrences)"),
    "straggler-link-recurs": _x(A.QUARANTINE, "link:h0<->h1", ("recurrence=link", "-> quarantine link:h0<->h1"),
                                "no restart or rollback"),
    "imbalance": _x(A.OBSERVE, None, ("-> observe",), "job-design issue"),
    "unclassified": _x(A.OBSERVE, None, ("-> observe",), "reported, not guessed"),
    "checkpoint-saves-failed": _x(A.OBSERVE, None, ("-> observe",), "has no recovery point; fix the storage"),
    "hang-transient": _x(A.OBSERVE, None, ("recurrence=none", "-> observe"), "came back by itself"),
    "straggler-device-fault": _x(A.QUARANTINE, "device:GPU-aa",
                                 ("hardware=clock_loss,throttle", "-> quarantine device:GPU-aa"),
                                 "direct hardware evidence in this run (clock_loss,throttle)"),
    "straggler-device-fault-rank-recurs": _x(A.OBSERVE, None, ("recurrence=rank", "-> observe"),
                                             "hardware evidence moved with the rank to other devices"),
    "hang-transient-device-fault": _x(A.QUARANTINE, "device:GPU-aa", ("hardware=xid", "-> quarantine device:GPU-aa"),
                                      "came back by itself"),
    "failstop-device-fault-agree-idem-dp": _x(
        A.REBUILD_GROUP, "group:dp without 3",
        ("gate=agree", "idempotent=idempotent", "membership=pure_dp_reconfigurable_batch", "hardware=ecc_dbe,xid",
         "-> rebuild dp group without 3"), AGREE_SURV, also=(A.QUARANTINE,), lineage=CHANGED),
    "failstop-device-fault-nogate": _x(
        A.RESTART_JOB, C100,
        ("gate=none", "membership=fixed_shapes", "checkpoint=step-00000100", "hardware=ecc_dbe,xid",
         "-> restart job from step-00000100"), "ranks [3] lost", also=(A.QUARANTINE,)),
    "failstop-device-fault-driver-error-nogate": _x(
        A.RESTART_JOB, C100,
        ("gate=none", "membership=fixed_shapes", "checkpoint=step-00000100", "hardware=driver_error",
         "-> restart job from step-00000100"), "ranks [3] lost", also=(A.QUARANTINE,)),
    "hang-device-fault-unknown-spare": _x(
        A.RESTART_JOB, C100,
        ("gate=unknown", "hung ranks silent", "membership=spare_replacement", "checkpoint=step-00000100",
         "hardware=xid", "-> restart job from step-00000100"), "ranks [3] lost", also=(A.QUARANTINE,)),
    "corruption-device-fault-sbe-rising": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=none", "checkpoint=step-00000100", "hardware=ecc_sbe_rising,xid,row_remap",
         "-> roll back job to step-00000100"), "only checkpoints before the onset at step 120", also=(A.QUARANTINE,)),
    "failstop-agree-idem-dp": _x(
        A.REBUILD_GROUP, "group:dp without 3",
        ("gate=agree", "idempotent=idempotent", "membership=pure_dp_reconfigurable_batch", "recurrence=none",
         "-> rebuild dp group without 3"), "smallest group whose membership change the algorithm supports",
        lineage=CHANGED),
    "failstop-agree-idem-spare": _x(
        A.RESTART_REPLICA, "spare:ranks 3",
        ("gate=agree", "idempotent=idempotent", "membership=spare_replacement", "recurrence=none",
         "-> restart ranks 3 on a spare"), "state comes from an agreeing dp peer", lineage=CHANGED),
    "failstop-agree-idem-fixed": _x(
        A.RESTART_JOB, C100,
        ("gate=agree", "idempotent=idempotent", "membership=fixed_shapes", "checkpoint=step-00000100",
         "recurrence=none", "-> restart job from step-00000100"), "fixed shapes: membership cannot change"),
    "failstop-agree-idem-fixed-nockpt": _x(
        A.RESTART_JOB, None,
        ("gate=agree", "idempotent=idempotent", "membership=fixed_shapes", "checkpoint=none", "recurrence=none",
         "-> restart job from step 0"), "no committed checkpoint: restart from step 0"),
    "failstop-agree-notidem-dp": _x(
        A.RESTART_JOB, C100,
        ("gate=agree", "idempotent=not_idempotent", "membership=pure_dp_reconfigurable_batch",
         "checkpoint=step-00000100", "recurrence=none", "-> restart job from step-00000100"),
        "re-running it may double-apply"),
    "failstop-agree-unknownidem-spare": _x(
        A.RESTART_JOB, C100,
        ("gate=agree", "idempotent=unknown", "membership=spare_replacement", "checkpoint=step-00000100",
         "recurrence=none", "-> restart job from step-00000100"), "failed operation: unknown"),
    "failstop-disagree-dp": _x(
        A.RESTART_JOB, C100,
        ("gate=disagree", "membership=pure_dp_reconfigurable_batch", "checkpoint=step-00000100", "recurrence=none",
         "-> restart job from step-00000100"), "ranks [7] disagree on optimizer, rng"),
    "failstop-unknown-spare": _x(
        A.RESTART_JOB, C100,
        ("gate=unknown", "membership=spare_replacement", "checkpoint=step-00000100", "recurrence=none",
         "-> restart job from step-00000100"), "gate could not prove agreement"),
    "failstop-nogate-dp": _x(
        A.RESTART_JOB, C100,
        ("gate=none", "membership=pure_dp_reconfigurable_batch", "checkpoint=step-00000100", "recurrence=none",
         "-> restart job from step-00000100"), "no gate: the affected domain is unknown"),
    "failstop-disagree-partials": _x(
        A.RESTART_JOB, C100,
        ("gate=disagree", "membership=fixed_shapes", "checkpoint=step-00000100", "recurrence=none",
         "-> restart job from step-00000100"), "1 partial and 1 corrupt checkpoint candidates ignored"),
    "failstop-unknown-nockpt": _x(
        A.RESTART_JOB, None,
        ("gate=unknown", "membership=pure_dp_reconfigurable_batch", "checkpoint=none", "recurrence=none",
         "-> restart job from step 0"), "no committed checkpoint: restart from step 0"),
    "failstop-subdomain-disagree-spare": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "membership=spare_replacement", "checkpoint=step-00000100", "recurrence=none",
         "-> roll back domain replica dp=1 to step-00000100 + restart_replica"),
        "ranks [3] lost and agreement or idempotency unproven", also=(A.RESTART_REPLICA,), lineage=CHANGED),
    "failstop-subdomain-unknown-dp": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=unknown", "membership=pure_dp_reconfigurable_batch", "checkpoint=step-00000100", "recurrence=none",
         "-> roll back domain replica dp=1 to step-00000100 + rebuild_group"),
        "domain replica dp=1: gate could not prove agreement", also=(A.REBUILD_GROUP,), lineage=CHANGED),
    "failstop-subdomain-disagree-fixed": _x(
        A.RESTART_JOB, C100,
        ("gate=disagree", "membership=fixed_shapes", "checkpoint=step-00000100", "recurrence=none",
         "-> restart job from step-00000100"), "fixed shapes: membership cannot change: every process relaunches"),
    "failstop-agree-idem-dp-device-recurs": _x(
        A.REBUILD_GROUP, "group:dp without 3",
        ("gate=agree", "idempotent=idempotent", "membership=pure_dp_reconfigurable_batch", "recurrence=device",
         "-> rebuild dp group without 3"), AGREE_SURV, also=(A.QUARANTINE,), lineage=CHANGED),
    "failstop-agree-idem-dp-rank-recurs": _x(
        A.REBUILD_GROUP, "group:dp without 3",
        ("gate=agree", "idempotent=idempotent", "membership=pure_dp_reconfigurable_batch", "recurrence=rank",
         "-> rebuild dp group without 3"), AGREE_SURV, lineage=CHANGED),
    "hang-back-agree-idem": _x(
        A.RETRY_OPERATION, "operation:stuck_in_collective",
        ("gate=agree", "hung ranks answered", "idempotent=idempotent", "recurrence=none", "-> retry the operation"),
        "proven agreement and an idempotent operation"),
    "hang-back-agree-notidem": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=agree", "hung ranks answered", "idempotent=not_idempotent", "checkpoint=step-00000100",
         "recurrence=none", "-> roll back job to step-00000100"), "no process was lost"),
    "hang-back-disagree": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "hung ranks answered", "checkpoint=step-00000100", "recurrence=none",
         "-> roll back job to step-00000100"), "hung ranks [3] came back"),
    "hang-back-agree-unknownidem-nockpt": _x(
        A.RESTART_JOB, None,
        ("gate=agree", "hung ranks answered", "idempotent=unknown", "checkpoint=none", "recurrence=none",
         "-> restart job from step 0"), "2 partial and 0 corrupt checkpoint candidates ignored"),
    "hang-silent-agree-idem-dp": _x(
        A.REBUILD_GROUP, "group:dp without 3",
        ("gate=agree", "hung ranks silent", "idempotent=idempotent", "membership=pure_dp_reconfigurable_batch",
         "recurrence=none", "-> rebuild dp group without 3"), "did not answer: kill and treat as lost",
        lineage=CHANGED),
    "hang-silent-agree-idem-spare": _x(
        A.RESTART_REPLICA, "spare:ranks 3",
        ("gate=agree", "hung ranks silent", "idempotent=idempotent", "membership=spare_replacement",
         "recurrence=none", "-> restart ranks 3 on a spare"), "did not answer", lineage=CHANGED),
    "hang-silent-agree-idem-fixed": _x(
        A.RESTART_JOB, C100,
        ("gate=agree", "hung ranks silent", "idempotent=idempotent", "membership=fixed_shapes",
         "checkpoint=step-00000100", "recurrence=none", "-> restart job from step-00000100"),
        "every process relaunches"),
    "hang-silent-unknown-dp": _x(
        A.RESTART_JOB, C100,
        ("gate=unknown", "hung ranks silent", "membership=pure_dp_reconfigurable_batch", "checkpoint=step-00000100",
         "recurrence=none", "-> restart job from step-00000100"), "domain job spans the job"),
    "hang-host-recurs": _x(
        A.RESTART_JOB, C100,
        ("gate=unknown", "hung ranks silent", "membership=fixed_shapes", "checkpoint=step-00000100",
         "recurrence=host", "-> restart job from step-00000100"), "ranks [3] lost", also=(A.QUARANTINE,)),
    "divergence-disagree-job": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "divergence is never retried"),
    "divergence-agree-job": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=agree", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "agreement now does not undo the fault"),
    "divergence-subdomain": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=none",
         "-> roll back domain replica dp=1 to step-00000100"), "domain replica dp=1: ranks [3] disagree"),
    "divergence-nogate": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=none", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "no gate result: agreement unproven"),
    "divergence-onset-before-ckpt": _x(
        A.ROLLBACK_DOMAIN, "checkpoint:step-00000050@50",
        ("gate=disagree", "checkpoint=step-00000050", "recurrence=none", "-> roll back job to step-00000050"),
        "only checkpoints before the onset at step 80 are clean"),
    "divergence-sampled-onset": _x(
        A.ROLLBACK_DOMAIN, "checkpoint:step-00000050@50",
        ("gate=disagree", "checkpoint=step-00000050", "recurrence=none", "-> roll back job to step-00000050"),
        "seen at step 120, sound last at step 90: only checkpoints up to step 90 are clean"),
    "divergence-onset-before-all": _x(
        A.RESTART_JOB, None, ("gate=disagree", "checkpoint=none", "recurrence=none", "-> restart job from step 0"),
        "no committed checkpoint before step 20: restart from step 0"),
    "divergence-onset-unknown": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "onset unknown"),
    "divergence-nockpt": _x(
        A.RESTART_JOB, None, ("gate=disagree", "checkpoint=none", "recurrence=none", "-> restart job from step 0"),
        "no committed checkpoint: restart from step 0"),
    "corruption": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "corruption is never retried"),
    "corruption-device-recurs": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=unknown", "checkpoint=step-00000100", "recurrence=device", "-> roll back job to step-00000100"),
        "only checkpoints before the onset at step 120", also=(A.QUARANTINE,)),
    "corruption-hw-error": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "corroboration=hardware_error",
         "-> roll back job to step-00000100"), "corruption is never retried", also=(A.QUARANTINE,)),
    "corruption-rank-recurs": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=rank", "-> roll back job to step-00000100"),
        "recurrence follows rank 4"),
    "corruption-partials": _x(
        A.ROLLBACK_DOMAIN, C100,
        ("gate=disagree", "checkpoint=step-00000100", "recurrence=none", "-> roll back job to step-00000100"),
        "never recovery points"),
    "corruption-nockpt-hw-error": _x(
        A.RESTART_JOB, None,
        ("gate=none", "checkpoint=none", "corroboration=hardware_error", "-> restart job from step 0"),
        "no committed checkpoint: restart from step 0", also=(A.QUARANTINE,)),
}


def test_every_documented_case_has_an_expectation() -> None:
    names = [c.name for c in DECISION_CASES]
    assert len(names) == len(set(names))
    assert set(names) == set(EXPECTED)


def test_documented_cases_cover_every_class_gate_idempotency_membership_and_catalog() -> None:
    assert {c.incident.klass for c in DECISION_CASES} == set(IncidentClass)
    assert {None if c.gate is None else c.gate.verdict for c in DECISION_CASES} == {None, *GateVerdict}
    assert {c.idempotent for c in DECISION_CASES} == set(Idempotency)
    assert {c.membership for c in DECISION_CASES} == set(MembershipSupport)
    assert {d.action for c in DECISION_CASES for d in (c.decide(), *c.decide().also)} == set(Action)


@pytest.mark.parametrize("case", DECISION_CASES, ids=lambda c: c.name)
def test_documented_case(case: DecisionCase) -> None:
    x = EXPECTED[case.name]
    d = case.decide()
    assert d.action is x.action
    assert (None if d.target is None else str(d.target)) == x.target
    assert d.path == (f"class={case.incident.klass}", *x.path)
    assert any(x.reason in r for r in d.reasons), d.reasons
    assert tuple(a.action for a in d.also) == x.also
    assert d.lineage.comparability is x.lineage


def test_rebuilt_group_is_the_survivors_and_its_lineage_names_the_membership_change() -> None:
    d = _case("failstop-agree-idem-dp").decide()
    assert d.ranks == (0, 1, 2, 4, 5, 6, 7) and d.scope is ScopeKind.RANKS
    assert d.lineage.changed == (ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION)
    assert d.lineage.records == (LineageRecord.WORLD_SIZE_CHANGE, LineageRecord.LAYOUT_CHANGE)


def test_spare_replacement_keeps_world_size_but_records_the_device_swap() -> None:
    d = _case("failstop-agree-idem-spare").decide()
    assert d.ranks == (3,)
    assert d.lineage.changed == (ChangeReason.HARDWARE,)
    assert d.lineage.records == (LineageRecord.DEVICE_REPLACED,)


def test_subdomain_rollback_touches_the_domain_and_the_lost_rank() -> None:
    d = _case("failstop-subdomain-disagree-spare").decide()
    assert d.scope is ScopeKind.DOMAIN and d.ranks == (2, 3)
    assert d.lineage.records[:2] == (LineageRecord.ROLLBACK, LineageRecord.REPLAYED_DATA_RANGE)
    assert LineageRecord.DEVICE_REPLACED in d.lineage.records


def test_corruption_quarantines_the_device_the_recurrence_follows() -> None:
    d = _case("corruption-device-recurs").decide()
    (q,) = d.also
    assert q.target is not None and (q.target.kind, q.target.id) == (TargetKind.DEVICE, "GPU-aa")
    assert q.lineage.records == (LineageRecord.DEVICE_QUARANTINED,)


def _case(name: str) -> DecisionCase:
    return next(c for c in DECISION_CASES if c.name == name)


# ---------------------------------------------------------------------------------- invariants over the whole space

_JOB = tuple(range(8))
_SURV = (0, 1, 2, 4, 5, 6, 7)
_COMMITTED = (CheckpointRef(id="c100", step=100), CheckpointRef(id="c50", step=50))
_CATALOGS = {
    "none": CheckpointCatalogView(),
    "only-partial": CheckpointCatalogView(partial=3, corrupt=1),
    "committed": CheckpointCatalogView(committed=_COMMITTED),
    "committed+partial": CheckpointCatalogView(committed=_COMMITTED, partial=2, corrupt=2),
    "committed-after-onset": CheckpointCatalogView(committed=(*_COMMITTED, CheckpointRef(id="c130", step=130))),
}
_SUBJECTS = {IncidentClass.CORRUPTION: Subject(kind=SubjectKind.DEVICE, id="GPU-x")}


def _gates() -> dict[str, GateResult | None]:
    out: dict[str, GateResult | None] = {"none": None}
    for v in GateVerdict:
        for ranks, tag in ((_SURV, "survivors"), (_JOB, "all")):
            for spans in (True, False):
                bad, fields = ((ranks[-1],), (StateField.MODEL,)) if v is GateVerdict.DISAGREE else ((), ())
                out[f"{v}-{tag}-{'job' if spans else 'sub'}"] = GateResult(
                    verdict=v, domain="job" if spans else "dp1", ranks=ranks, spans_job=spans, disagreeing=bad,
                    fields=fields)
    return out


_GATES = _gates()
_RECURRENCE = (None, FollowsKind.DEVICE, FollowsKind.HOST, FollowsKind.LINK, FollowsKind.RANK, FollowsKind.INCONCLUSIVE)


def _space() -> list[tuple[str, Incident, GateResult | None, Idempotency, MembershipSupport, CheckpointCatalogView,
                           RecurrenceView | None]]:
    out = []
    for klass, cause, gate_key, idem, mem, cat_key, follows in itertools.product(
            IncidentClass, (Cause.UNKNOWN, Cause.HARDWARE_ERROR), _GATES, Idempotency, MembershipSupport, _CATALOGS,
            _RECURRENCE):
        inc = Incident(klass=klass, subject=_SUBJECTS.get(klass, Subject(kind=SubjectKind.RANK, id="3")), ranks=(3,),
                       onset_step=120, detection_step=125, confidence=0.9, cause=cause, summary="x")
        rec = None if follows is None else RecurrenceView(
            klass=klass, follows=follows, id="" if follows is FollowsKind.INCONCLUSIVE else "x", occurrences=2)
        key = f"{klass}-{cause}-{gate_key}-{idem}-{mem}-{cat_key}-{follows}"
        out.append((key, inc, _GATES[gate_key], idem, mem, _CATALOGS[cat_key], rec))
    return out


def test_invariants_hold_over_every_combination() -> None:
    space = _space()
    assert len(space) > 10_000
    for key, inc, gate, idem, mem, cat, rec in space:
        d = decide(inc, gate, idempotent=idem, membership=mem, catalog=cat, recurrence=rec)
        _check(key, inc, gate, idem, mem, cat, rec, d)


def test_invariants_hold_for_device_faults() -> None:
    """The same invariants with every incident a device fault (direct hardware evidence on its device), over every
    class, gate, idempotency and recurrence (a smaller product: two memberships, two catalogs)."""
    n = 0
    for klass, cause, gate_key, idem, mem, cat_key, follows in itertools.product(
            IncidentClass, (Cause.UNKNOWN, Cause.HARDWARE_ERROR, Cause.TRANSIENT_STALL), _GATES, Idempotency,
            (MembershipSupport.FIXED_SHAPES, MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH), ("none", "committed"),
            _RECURRENCE):
        inc = Incident(klass=klass, subject=Subject(kind=SubjectKind.DEVICE, id="GPU-x"), ranks=(3,), onset_step=120,
                       detection_step=125, confidence=0.9, cause=cause, summary="x",
                       hardware=(HardwareSignal.ECC_DBE, HardwareSignal.XID))
        rec = None if follows is None else RecurrenceView(
            klass=klass, follows=follows, id="" if follows is FollowsKind.INCONCLUSIVE else "x", occurrences=2)
        key = f"device-fault-{klass}-{cause}-{gate_key}-{idem}-{mem}-{cat_key}-{follows}"
        d = decide(inc, _GATES[gate_key], idempotent=idem, membership=mem, catalog=_CATALOGS[cat_key], recurrence=rec)
        _check(key, inc, _GATES[gate_key], idem, mem, _CATALOGS[cat_key], rec, d)
        n += 1
    assert n > 1_000


def _check(key: str, inc: Incident, gate: GateResult | None, idem: Idempotency, mem: MembershipSupport,
           cat: CheckpointCatalogView, rec: RecurrenceView | None, d: Decision) -> None:
    narrow = {A.RETRY_OPERATION, A.REBUILD_GROUP, A.RESTART_REPLICA}
    agree = gate is not None and gate.verdict is GateVerdict.AGREE
    lost_class = inc.klass in (IncidentClass.FAIL_STOP, IncidentClass.HANG)
    assert d.path[0] == f"class={inc.klass}" and d.path[-1].startswith("-> "), key
    assert d.reasons, key
    if d.action in narrow:
        # the narrow actions need proven agreement, an idempotent operation and a lost/stuck rank
        assert agree and idem is Idempotency.IDEMPOTENT and lost_class, key
    if d.action is A.RETRY_OPERATION:
        assert inc.klass is IncidentClass.HANG and gate is not None and set(inc.ranks) <= set(gate.ranks), key
    if d.action is A.REBUILD_GROUP or A.REBUILD_GROUP in {a.action for a in d.also}:
        assert mem is MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH, key
    if d.action is A.RESTART_REPLICA or A.RESTART_REPLICA in {a.action for a in d.also}:
        assert mem is MembershipSupport.SPARE_REPLACEMENT, key
    if inc.klass in (IncidentClass.STRAGGLER, IncidentClass.IMBALANCE, IncidentClass.UNCLASSIFIED):
        assert d.action in (A.OBSERVE, A.QUARANTINE) and not d.also, key
    if inc.klass in (IncidentClass.IMBALANCE, IncidentClass.UNCLASSIFIED, IncidentClass.CHECKPOINT):
        assert d.action is A.OBSERVE and not d.also, key  # failed saves: no recovery helps, nothing to quarantine
    if inc.klass is IncidentClass.HANG and inc.cause is Cause.TRANSIENT_STALL:
        assert d.action in (A.OBSERVE, A.QUARANTINE) and not d.also, key
    if inc.klass in (IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION):
        assert d.action in (A.ROLLBACK_DOMAIN, A.RESTART_JOB), key
    # never a partial checkpoint, never one after a state fault's onset; none at all means step 0, said out loud
    committed = {c.id: c for c in cat.committed}
    for dec in (d, *d.also):
        if dec.target is not None and dec.target.kind is TargetKind.CHECKPOINT:
            assert dec.target.id in committed and committed[dec.target.id].step == dec.target.step, key
            if inc.klass in (IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION):
                assert dec.target.step < 120, key
    if d.action in (A.RESTART_JOB, A.ROLLBACK_DOMAIN) and not cat.committed:
        assert d.action is A.RESTART_JOB and d.target is None, key
        assert any("restart from step 0" in r for r in d.reasons), key
    if cat.partial or cat.corrupt:
        if d.action in (A.RESTART_JOB, A.ROLLBACK_DOMAIN):
            assert any("never recovery points" in r for r in d.reasons), key
    # quarantine only where recurrence follows hardware, the incident is a device fault (direct hardware evidence),
    # or a corrupting device reported a hardware error; exactly one quarantine, of the recurrence's target first
    quarantined = [x for x in (d, *d.also) if x.action is A.QUARANTINE]
    hw_follow = rec is not None and rec.follows in (FollowsKind.DEVICE, FollowsKind.HOST, FollowsKind.LINK)
    corroborated = (inc.klass is IncidentClass.CORRUPTION and inc.cause is Cause.HARDWARE_ERROR
                    and inc.subject.kind is SubjectKind.DEVICE)
    allowed = inc.klass not in (IncidentClass.IMBALANCE, IncidentClass.UNCLASSIFIED, IncidentClass.CHECKPOINT)
    rank_follow = rec is not None and rec.follows is FollowsKind.RANK
    assert bool(quarantined) == (allowed and (hw_follow or (not rank_follow and (corroborated or inc.device_fault)))), key
    assert len(quarantined) <= 1, key
    if quarantined and not hw_follow and inc.device_fault:
        assert str(quarantined[0].target) == f"device:{inc.subject.id}", key
    assert quarantine_targets(d) == tuple(x.target for x in quarantined if x.target is not None), key
    # a quarantine never stops the running job by itself: it touches no rank and changes nothing in lineage
    for q in quarantined:
        assert q.scope is ScopeKind.NONE and q.ranks == () and q.lineage.comparability is SAME, key
    # a membership change is never declared bitwise comparable
    membership_change = any(x.action in (A.REBUILD_GROUP, A.RESTART_REPLICA) for x in (d, *d.also))
    assert (d.lineage.comparability is Comparability.CHANGED) == membership_change, key


# ----------------------------------------------------------------------------------------------------- validation


def test_gate_rejects_inconsistent_answers() -> None:
    with pytest.raises(ValueError, match="DISAGREE needs"):
        GateResult(verdict=GateVerdict.DISAGREE, domain="job", ranks=(0, 1), spans_job=True)
    with pytest.raises(ValueError, match="not among"):
        GateResult(verdict=GateVerdict.DISAGREE, domain="job", ranks=(0, 1), spans_job=True, disagreeing=(5,),
                   fields=(StateField.RNG,))
    with pytest.raises(ValueError, match="carries disagreeing"):
        GateResult(verdict=GateVerdict.AGREE, domain="job", ranks=(0, 1), spans_job=True, fields=(StateField.RNG,))


def test_recurrence_of_another_family_is_refused() -> None:
    inc = _case("straggler").incident
    rec = RecurrenceView(klass=IncidentClass.CORRUPTION, follows=FollowsKind.DEVICE, id="GPU-aa", occurrences=2)
    with pytest.raises(ValueError, match="recurrence is for corruption"):
        decide(inc, None, idempotent=Idempotency.UNKNOWN, membership=MembershipSupport.FIXED_SHAPES,
               catalog=CheckpointCatalogView(), recurrence=rec)


def test_catalog_and_lineage_note_validation() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        CheckpointCatalogView(committed=(CheckpointRef(id="a", step=1), CheckpointRef(id="a", step=2)))
    with pytest.raises(ValueError, match="negative"):
        CheckpointCatalogView(partial=-1)
    with pytest.raises(ValueError, match="changed with change reasons"):
        LineageNote(comparability=Comparability.CHANGED)
    cat = CheckpointCatalogView(committed=(CheckpointRef(id="a", step=10), CheckpointRef(id="b", step=30)))
    assert cat.newest() == CheckpointRef(id="b", step=30)
    assert cat.newest(before_step=30) == CheckpointRef(id="a", step=10)
    assert cat.newest(before_step=10) is None


# ---------------------------------------------------------------------------------------------------- the doc table


def test_doc_table_matches_the_policy() -> None:
    rendered = render_decision_table(decision_rows(DECISION_CASES))
    assert doc_table_section(DOC.read_text()) == rendered, (
        "docs/recovery.md is stale: run `python -m rankwatch.recovery.policy docs/recovery.md`")


def test_render_has_one_row_per_case_and_write_keeps_the_prose(tmp_path: Path) -> None:
    rendered = render_decision_table(decision_rows(DECISION_CASES))
    assert len(rendered.splitlines()) == 2 + len(DECISION_CASES)
    doc = tmp_path / "r.md"
    doc.write_text("intro\n<!-- decision-table:start -->\nstale\n<!-- decision-table:end -->\noutro\n")
    write_decision_doc(doc, DECISION_CASES[:2])
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("<!-- decision-table:end -->\noutro\n")
    assert "stale" not in text and "| straggler-rank-recurs |" in text and "| imbalance |" not in text
    with pytest.raises(ValueError, match="no <!-- decision-table:start -->"):
        doc_table_section("no markers")


def test_recurrence_view_from_a_localization() -> None:
    loc = Localization(klass=IncidentClass.CORRUPTION, follows=FollowsKind.DEVICE, subject="GPU-aa", observations=4,
                       occurrences=3, by_device=(), by_rank=(), by_host=(), by_link=(), quarantine=(), summary="s")
    rec = RecurrenceView.from_localization(loc)
    assert (rec.klass, rec.follows, rec.id, rec.occurrences) == (IncidentClass.CORRUPTION, FollowsKind.DEVICE,
                                                                 "GPU-aa", 3)
    d = decide(_case("corruption").incident, None, idempotent=Idempotency.UNKNOWN,
               membership=MembershipSupport.FIXED_SHAPES, catalog=CheckpointCatalogView(), recurrence=rec)
    assert [str(a.target) for a in d.also] == ["device:GPU-aa"]


# ------------------------------------------------------------------------------------------ one run's quarantines


def _dev_inc(klass: IncidentClass, device: str, hardware: tuple[HardwareSignal, ...], cause: Cause) -> Incident:
    return Incident(klass=klass, subject=Subject(kind=SubjectKind.DEVICE, id=device), ranks=(1,), onset_step=50,
                    detection_step=52, confidence=0.9, cause=cause, summary="s", hardware=hardware)


def test_single_run_quarantines_are_the_device_faults_only() -> None:
    throttled = _dev_inc(IncidentClass.STRAGGLER, "GPU-a", (HardwareSignal.CLOCK_LOSS,), Cause.THERMAL_THROTTLE)
    crashed = _dev_inc(IncidentClass.FAIL_STOP, "GPU-b", (HardwareSignal.ECC_DBE,), Cause.EXCEPTION)
    failing = _dev_inc(IncidentClass.CORRUPTION, "GPU-c", (HardwareSignal.ECC_SBE_RISING,), Cause.HARDWARE_ERROR)
    plain = [_case("straggler").incident, _case("failstop-agree-idem-dp").incident,
             _case("corruption").incident, _case("hang-transient").incident]
    got = single_run_quarantines([*plain, throttled, crashed, failing, throttled])
    assert [(t.kind, t.id) for t in got] == [(TargetKind.DEVICE, "GPU-a"), (TargetKind.DEVICE, "GPU-b"),
                                             (TargetKind.DEVICE, "GPU-c")]
    assert single_run_quarantines(plain) == ()


def test_a_throttle_cause_without_hardware_evidence_is_observed() -> None:
    inc = Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id="5"), ranks=(5,),
                   onset_step=10, detection_step=14, confidence=0.9, cause=Cause.THERMAL_THROTTLE, summary="s")
    d = decide(inc, None, idempotent=Idempotency.UNKNOWN, membership=MembershipSupport.FIXED_SHAPES,
               catalog=CheckpointCatalogView())
    assert d.action is A.OBSERVE and quarantine_targets(d) == ()
    assert any("no direct hardware evidence" in r for r in d.reasons)


def test_device_fault_straggler_is_quarantined_without_touching_the_job() -> None:
    d = _case("straggler-device-fault").decide()
    assert d.scope is ScopeKind.NONE and d.ranks == () and not d.also
    assert d.lineage.records == (LineageRecord.DEVICE_QUARANTINED,)


def test_recurrence_quarantine_comes_before_the_device_fault_one() -> None:
    inc = _dev_inc(IncidentClass.STRAGGLER, "GPU-a", (HardwareSignal.CLOCK_LOSS,), Cause.THERMAL_THROTTLE)
    rec = RecurrenceView(klass=IncidentClass.STRAGGLER, follows=FollowsKind.HOST, id="host4", occurrences=3)
    d = decide(inc, None, idempotent=Idempotency.UNKNOWN, membership=MembershipSupport.FIXED_SHAPES,
               catalog=CheckpointCatalogView(), recurrence=rec)
    assert [str(t) for t in quarantine_targets(d)] == ["host:host4"]
