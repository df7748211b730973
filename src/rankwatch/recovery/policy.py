"""Recovery scope: what to do about one incident, as a pure function of the evidence.

`decide(incident, gate, idempotent=..., membership=..., catalog=..., recurrence=...)` returns a typed `Decision`:
an action, its target, the ranks it touches, the gates it passed through (`path`), why (`reasons`), what lineage
must record (`lineage`), and secondary decisions (`also`, e.g. a quarantine next to a rollback).

The rule: retrying is unsafe until the failed operation is known to be idempotent AND the ranks of the affected
consistency domain are proven to agree on step, model, optimizer, RNG and data position. Proven agreement allows
only an explicitly safe narrow action; disagreement or uncertainty rolls the domain back to a committed,
integrity-checked checkpoint. Partial or corrupt checkpoints are evidence, never recovery points. A slow rank is not
a failed rank. Elastic membership does not preserve algorithm behaviour by itself, so every membership change is
declared CHANGED in lineage.

Words: a *consistency domain* is the set of ranks the job rolls back together (the gate names it; a synchronous job
has one domain, the whole job). `ROLLBACK_DOMAIN` reloads a checkpoint into living processes of that domain;
`RESTART_JOB` relaunches every process (from a checkpoint, or from step 0 when the target is None).
A checkpoint's `step` is the last step whose update it contains.

Branches, in the order `decide` takes them:

- straggler: OBSERVE; a slow rank is not a failed rank. QUARANTINE (take out of future placement; the running job
  is not stopped: no kill, no rollback) when recurrence across runs follows a device, host or link, or when the
  incident is a device fault (`Incident.device_fault`: direct hardware evidence from this run — throttling with
  clock loss, new uncorrectable ECC errors, hardware XIDs, corrected ECC errors rising on that device only — named
  the device). Recurrence that follows the rank number points at its data shard or code path, and hardware
  quarantine would not help — it overrides a single run's device evidence (the evidence moved with the rank to other
  devices) in every class; a throttle cause without that evidence is observed.
- imbalance: OBSERVE; a job-design issue (stage split, data skew), not a fault to recover from.
- unclassified: OBSERVE; reported, not guessed.
- a transient stall (hang, TRANSIENT_STALL): OBSERVE; the rank came back by itself. QUARANTINE of the device when
  the incident is a device fault, as for a straggler.
- divergence: roll the domain back (never retry), to the newest committed checkpoint taken before the onset (a
  checkpoint after the onset may hold the diverged state; integrity checks prove bytes, not values). Scope is the
  gate's domain, or the job without a gate or when the domain spans it. No such checkpoint: RESTART_JOB from 0.
- corruption: as divergence; plus QUARANTINE in `also` when recurrence follows a device/host/link, when the
  incident is a device fault, or when it is about a device and its cause is a hardware error (the device itself
  corroborates).
- fail_stop / hang: the failed ranks are gone or stuck.
  - hang whose ranks came back (they answered the gate), gate AGREE, operation IDEMPOTENT: RETRY_OPERATION. No
    membership, device or state changes; lineage expects bitwise identity.
  - gate AGREE among the survivors, operation IDEMPOTENT (a stuck rank that did not answer is killed and treated as
    lost), by declared membership support:
    - SPARE_REPLACEMENT: RESTART_REPLICA on a spare, state copied from an agreeing peer; world size, layout and data
      order unchanged, but lineage records CHANGED(hardware): the spare is another physical device, and identical
      SKU, driver and deterministic kernels (no autotuning) are what bitwise identity would need, none of which
      this policy can see. A later bitwise match is a finding, not an assumption.
    - PURE_DP_RECONFIGURABLE_BATCH: REBUILD_GROUP: the dp group without the lost replica, the smallest group whose
      membership change the algorithm supports. CHANGED(batch composition, ordering): fewer replicas reshard the
      data and change the gradient reduction.
    - FIXED_SHAPES: membership cannot change, so RESTART_JOB from the newest committed checkpoint (survivors' live
      state is lost with the relaunch); expected bitwise identical if relaunched on the same devices.
  - gate DISAGREE or UNKNOWN, no gate, or idempotency NOT_IDEMPOTENT or UNKNOWN: roll back. With a rank lost,
    FIXED_SHAPES, no gate, or a domain spanning the job: RESTART_JOB from the newest committed checkpoint; a proper
    sub-domain: ROLLBACK_DOMAIN with the membership action for the lost rank in `also` (RESTART_REPLICA on a spare,
    or REBUILD_GROUP without it). A hang whose ranks came back lost no process: ROLLBACK_DOMAIN.
  - plus QUARANTINE in `also` when recurrence follows a device/host/link, or when the incident is a device fault (a
    GPU that failed with an uncorrectable ECC error or fell off the bus): the primary action is unchanged.
- no committed checkpoint where one is needed: RESTART_JOB with target None ("no committed checkpoint: restart
  from step 0"). Partial and corrupt candidates are counted in the reasons and never chosen.

`single_run_quarantines(incidents)` is what the policy takes out of placement from one run's incidents alone (no gate,
no recurrence): the device faults. `python -m rankwatch.recovery.policy docs/recovery.md` rewrites the decision
table in the doc from `DECISION_CASES`; without an argument it prints the table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rankwatch.analytics.incidents import Cause, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.localize import FollowsKind, Localization
from rankwatch.base.rundir import atomic_write
from rankwatch.base.schema import ChangeReason, Comparability
from rankwatch.recovery.decision import (
    Action, CheckpointCatalogView, CheckpointRef, Decision, GateResult, GateVerdict, Idempotency, LineageNote,
    LineageRecord, MembershipSupport, ScopeKind, StateField, Target, TargetKind,
)

__all__ = [
    "DECISION_CASES", "DecisionCase", "DecisionRow", "RecurrenceView", "decide", "decision_rows",
    "hold_on_partial_input", "quarantine_targets", "render_decision_table", "single_run_quarantines", "write_decision_doc",
]

TABLE_START = "<!-- decision-table:start -->"
TABLE_END = "<!-- decision-table:end -->"


# ---------------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True, slots=True)
class RecurrenceView:
    """Localization across runs (analytics/localize.py) for the incident's fault family."""

    klass: IncidentClass
    follows: FollowsKind
    id: str
    """Device UUID, rank number, host or link the fault follows ('' when inconclusive)."""
    occurrences: int
    """Observations that implicated it."""

    def __post_init__(self) -> None:
        if self.follows is not FollowsKind.INCONCLUSIVE and not self.id:
            raise ValueError(f"recurrence {self.klass}: follows {self.follows} but names no id")
        if self.occurrences < 0:
            raise ValueError(f"recurrence {self.klass}: negative occurrences {self.occurrences}")

    @classmethod
    def from_localization(cls, loc: Localization) -> RecurrenceView:
        return cls(klass=loc.klass, follows=loc.follows, id=loc.subject, occurrences=loc.occurrences)


_IDENTICAL = LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED, why="nothing in the job changes")
_GENESIS_WHY = "no committed checkpoint: restart from step 0"


# ------------------------------------------------------------------------------------------------------------ policy


def decide(
    incident: Incident,
    gate: GateResult | None,
    *,
    idempotent: Idempotency,
    membership: MembershipSupport,
    catalog: CheckpointCatalogView,
    recurrence: RecurrenceView | None = None,
) -> Decision:
    """The recovery decision for one incident; see the module docstring for every branch."""
    if recurrence is not None and recurrence.klass is not incident.klass:
        raise ValueError(f"recurrence is for {recurrence.klass} but incident {incident.id} is {incident.klass}")
    path = [f"class={incident.klass}"]
    k = incident.klass
    if k is IncidentClass.STRAGGLER:
        return _straggler(incident, recurrence, path)
    if k is IncidentClass.IMBALANCE:
        return _observe(path, "imbalance is a job-design issue (stage split, data skew): rebalance, do not recover")
    if k is IncidentClass.HANG and incident.cause is Cause.TRANSIENT_STALL:
        return _observe_or_quarantine(incident, recurrence, path, (
            "a transient stall: the rank came back by itself and the job carried on; nothing is lost and nothing "
            "to recover (it cost the job its duration: watch for a recurrence)"))
    if k is IncidentClass.UNCLASSIFIED:
        return _observe(path, "unclassified: reported, not guessed; no recovery without a class")
    if k is IncidentClass.CHECKPOINT:
        return _observe(path, (
            "checkpoint saves committed nothing: the job trains on and no recovery would help it, but the work since "
            "the last committed checkpoint has no recovery point; fix the storage (the incident names the error) "
            "before a failure makes it matter"))
    if k in (IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION):
        d = _state_fault(incident, gate, catalog, recurrence, path)
    else:
        d = _lost_rank(incident, gate, idempotent, membership, catalog, recurrence, path)
    return replace(d, path=(*d.path[:-1], _recurrence_label(d, recurrence), d.path[-1]))


def hold_on_partial_input(d: Decision, left_out: Sequence[str]) -> Decision:
    """`d`, held where the analysis behind it could not read every part file (`left_out`, one line each naming the
    file): an action that stops, restarts or rolls back ranks becomes OBSERVE, since the rows of a part left out could
    change or undo the incident it answers; an observation and a quarantine (which touches no rank) stand."""
    if not left_out or d.action in (Action.OBSERVE, Action.QUARANTINE):
        return d
    first = left_out[0].split(" — ")[0].split(": ")[0]
    why = (f"held: decided from partial telemetry ({len(left_out)} part file(s) left out, first {first}); their rows "
           f"could change or undo this incident, so nothing is restarted or rolled back on it (was: {d.action}); "
           "repair the part or move it aside and analyze again")
    return Decision(action=Action.OBSERVE, target=None, scope=ScopeKind.NONE, ranks=(),
                    path=(*d.path[:-1], "input=partial", "-> observe"), reasons=(why, *d.reasons),
                    lineage=_IDENTICAL, also=tuple(a for a in d.also if a.action is Action.QUARANTINE))


def _recurrence_label(d: Decision, recurrence: RecurrenceView | None) -> str:
    q = next((a for a in d.also if a.action is Action.QUARANTINE), None)
    if q is not None and q.target is not None:
        return q.path[0]
    return "recurrence=none" if recurrence is None else f"recurrence={recurrence.follows}"


def _observe(path: list[str], reason: str, *extra: str) -> Decision:
    return Decision(action=Action.OBSERVE, target=None, scope=ScopeKind.NONE, ranks=(), path=(*path, "-> observe"),
                    reasons=(reason, *extra), lineage=_IDENTICAL)


def _quarantine(recurrence: RecurrenceView | None, incident: Incident, *, corroborate: bool) -> Decision | None:
    """A quarantine when recurrence follows a device/host/link, when the incident is a device fault (direct hardware
    evidence from this run), or (corruption) the device corroborates itself with a hardware-error cause."""
    kinds = {FollowsKind.DEVICE: TargetKind.DEVICE, FollowsKind.HOST: TargetKind.HOST, FollowsKind.LINK: TargetKind.LINK}
    if recurrence is not None and recurrence.follows in kinds:
        target = Target(kind=kinds[recurrence.follows], id=recurrence.id)
        why = f"recurrence follows {recurrence.follows} {recurrence.id} ({recurrence.occurrences} occurrences)"
        label = f"recurrence={recurrence.follows}"
    elif recurrence is not None and recurrence.follows is FollowsKind.RANK:
        return None  # the fault moved with the rank number across devices: quarantining this one would not help
    elif incident.device_fault:
        target = Target(kind=TargetKind.DEVICE, id=incident.subject.id)
        signals = ",".join(str(h) for h in incident.hardware)
        why = (f"device {incident.subject.id} shows direct hardware evidence in this run ({signals}): one run is "
               "enough to take it out of placement")
        label = f"hardware={signals}"
    elif corroborate and incident.subject.kind is SubjectKind.DEVICE and incident.cause is Cause.HARDWARE_ERROR:
        target = Target(kind=TargetKind.DEVICE, id=incident.subject.id)
        why = f"device {incident.subject.id} reported a hardware error with the corruption"
        label = "corroboration=hardware_error"
    else:
        return None
    return Decision(
        action=Action.QUARANTINE, target=target, scope=ScopeKind.NONE, ranks=(),
        path=(label, f"-> quarantine {target}"),
        reasons=(why, "quarantine removes it from future placement; it does not stop the running job by itself"),
        lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                            records=(LineageRecord.DEVICE_QUARANTINED,),
                            why="the running job is unchanged; a later placement off it records DEVICE_REPLACED"),
    )


def _no_quarantine_reason(recurrence: RecurrenceView | None, incident: Incident) -> str:
    if recurrence is None:
        return "no recurrence evidence across runs and no direct hardware evidence from this run"
    if recurrence.follows is FollowsKind.RANK:
        moved = (f" (device {incident.subject.id}'s hardware evidence moved with the rank to other devices)"
                 if incident.device_fault else "")
        return f"recurrence follows rank {recurrence.id}: its data shard or code path, not hardware{moved}"
    return "recurrence inconclusive: nothing to quarantine"


def _straggler(incident: Incident, recurrence: RecurrenceView | None, path: list[str]) -> Decision:
    return _observe_or_quarantine(incident, recurrence, path, "a slow rank is not a failed rank")


def _observe_or_quarantine(incident: Incident, recurrence: RecurrenceView | None, path: list[str],
                           why: str) -> Decision:
    """Nothing to recover in the running job: OBSERVE, or QUARANTINE (no kill, no rollback) where recurrence or
    direct hardware evidence implicates a device, host or link."""
    q = _quarantine(recurrence, incident, corroborate=False)
    if q is None:
        label = "recurrence=none" if recurrence is None else f"recurrence={recurrence.follows}"
        return _observe([*path, label], why, _no_quarantine_reason(recurrence, incident))
    return Decision(action=q.action, target=q.target, scope=q.scope, ranks=q.ranks, path=(*path, *q.path),
                    reasons=(f"{why}: no restart or rollback", *q.reasons), lineage=q.lineage)


def quarantine_targets(decision: Decision) -> tuple[Target, ...]:
    """Every device, host or link a decision takes out of placement (its own action and those in `also`)."""
    return tuple(d.target for d in (decision, *decision.also)
                 if d.action is Action.QUARANTINE and d.target is not None)


def single_run_quarantines(incidents: Sequence[Incident]) -> tuple[Target, ...]:
    """What the policy takes out of placement from one run's incidents alone: each decided with no gate, nothing
    declared and no recurrence across runs, so only direct hardware evidence (device faults) can quarantine.
    Each target once, in incident order."""
    out: dict[Target, None] = {}
    for inc in incidents:
        d = decide(inc, None, idempotent=Idempotency.UNKNOWN, membership=MembershipSupport.FIXED_SHAPES,
                   catalog=CheckpointCatalogView())
        out.update(dict.fromkeys(quarantine_targets(d)))
    return tuple(out)


def _gate_label(gate: GateResult | None) -> str:
    return "gate=none" if gate is None else f"gate={gate.verdict}"


def _gate_reason(gate: GateResult | None) -> str:
    if gate is None:
        return "no gate result: agreement unproven"
    if gate.verdict is GateVerdict.AGREE:
        return f"domain {gate.domain}: ranks {list(gate.ranks)} agree"
    if gate.verdict is GateVerdict.UNKNOWN:
        return f"domain {gate.domain}: gate could not prove agreement (not every rank answered)"
    return (f"domain {gate.domain}: ranks {list(gate.disagreeing)} disagree on "
            f"{', '.join(str(f) for f in gate.fields)}")


def _catalog_reasons(catalog: CheckpointCatalogView) -> tuple[str, ...]:
    if catalog.partial or catalog.corrupt:
        return (f"{catalog.partial} partial and {catalog.corrupt} corrupt checkpoint candidates ignored: "
                "evidence, never recovery points",)
    return ()


def _restart_from_zero(path: list[str], reasons: Sequence[str], catalog: CheckpointCatalogView,
                       also: tuple[Decision, ...], why: str = _GENESIS_WHY) -> Decision:
    return Decision(
        action=Action.RESTART_JOB, target=None, scope=ScopeKind.JOB, ranks=(),
        path=(*path, "checkpoint=none", "-> restart job from step 0"),
        reasons=(*reasons, why, *_catalog_reasons(catalog)),
        lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                            records=(LineageRecord.RESTART, LineageRecord.REPLAYED_DATA_RANGE),
                            why="replay of steps [0, failure) on the same layout and devices"),
        also=also,
    )


def _ckpt_target(ckpt: CheckpointRef) -> Target:
    return Target(kind=TargetKind.CHECKPOINT, id=ckpt.id, step=ckpt.step)


def _state_fault(incident: Incident, gate: GateResult | None, catalog: CheckpointCatalogView,
                 recurrence: RecurrenceView | None, path: list[str]) -> Decision:
    path.append(_gate_label(gate))
    reasons = [f"{incident.klass} is never retried: the state itself is in question", _gate_reason(gate)]
    if gate is not None and gate.verdict is GateVerdict.AGREE:
        reasons.append("agreement now does not undo the fault: a bad update all-reduced into every rank agrees too")
    q = _quarantine(recurrence, incident, corroborate=incident.klass is IncidentClass.CORRUPTION)
    also = () if q is None else (q,)
    if q is None:
        reasons.append(_no_quarantine_reason(recurrence, incident))
    bound = incident.onset_step if incident.onset_step is not None else incident.detection_step
    if bound is None:
        reasons.append("onset unknown: the newest checkpoint may already hold the fault; verify after rollback")
    elif incident.last_good_step is not None and incident.last_good_step + 1 < bound:
        reasons.append(f"seen at step {bound}, sound last at step {incident.last_good_step}: only checkpoints up to "
                       f"step {incident.last_good_step} are clean")
        bound = incident.last_good_step + 1
    else:
        reasons.append(f"only checkpoints before the onset at step {bound} are clean")
    ckpt = catalog.newest(before_step=bound)
    if ckpt is None:
        why = _GENESIS_WHY if not catalog.committed else f"no committed checkpoint before step {bound}: restart from step 0"
        return _restart_from_zero(path, reasons, catalog, also, why)
    if gate is None or gate.spans_job:
        scope, ranks, label = ScopeKind.JOB, (gate.ranks if gate else ()), "job"
    else:
        scope, ranks, label = ScopeKind.DOMAIN, gate.ranks, f"domain {gate.domain}"
    return Decision(
        action=Action.ROLLBACK_DOMAIN, target=_ckpt_target(ckpt), scope=scope, ranks=ranks,
        path=(*path, f"checkpoint={ckpt.id}", f"-> roll back {label} to {ckpt.id}"),
        reasons=(*reasons, *_catalog_reasons(catalog)),
        lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                            records=(LineageRecord.ROLLBACK, LineageRecord.REPLAYED_DATA_RANGE),
                            why=f"replay of steps ({ckpt.step}, failure] on the same layout, devices and code"),
        also=also,
    )


def _lost_rank(incident: Incident, gate: GateResult | None, idempotent: Idempotency, membership: MembershipSupport,
               catalog: CheckpointCatalogView, recurrence: RecurrenceView | None, path: list[str]) -> Decision:
    failed = incident.ranks
    came_back = (incident.klass is IncidentClass.HANG and gate is not None and bool(failed)
                 and set(failed) <= set(gate.ranks))
    path.append(_gate_label(gate))
    reasons = [_gate_reason(gate)]
    q = _quarantine(recurrence, incident, corroborate=False)
    quarantine = () if q is None else (q,)
    if incident.klass is IncidentClass.HANG:
        path.append("hung ranks answered" if came_back else "hung ranks silent")
        reasons.append(f"hung ranks {list(failed)} " + ("came back and answered the gate" if came_back
                                                          else "did not answer: kill and treat as lost"))
    agree = gate is not None and gate.verdict is GateVerdict.AGREE
    safe = agree and idempotent is Idempotency.IDEMPOTENT
    if agree:
        path.append(f"idempotent={idempotent}")
        reasons.append(f"failed operation: {idempotent}"
                       + ("" if idempotent is Idempotency.IDEMPOTENT else ", so re-running it may double-apply"))
    if safe and came_back:
        assert gate is not None
        return Decision(
            action=Action.RETRY_OPERATION, target=Target(kind=TargetKind.OPERATION, id=str(incident.cause)),
            scope=ScopeKind.DOMAIN, ranks=gate.ranks, path=(*path, "-> retry the operation"),
            reasons=(*reasons, "proven agreement and an idempotent operation: the narrowest safe action"),
            lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                                why="same ranks, devices, state and inputs re-run the same operation"),
            also=quarantine,
        )
    if safe:
        assert gate is not None
        path.append(f"membership={membership}")
        if membership is MembershipSupport.SPARE_REPLACEMENT:
            return _spare(failed, gate, path, reasons, quarantine)
        if membership is MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH:
            return _rebuild(failed, gate, path, reasons, quarantine)
        reasons.append("fixed shapes: membership cannot change, so every process relaunches")
        return _restart_job(path, reasons, catalog, quarantine)
    if not came_back:
        reasons.append(f"ranks {list(failed)} lost and agreement or idempotency unproven: roll back")
    else:
        reasons.append("agreement or idempotency unproven: roll back")
    if came_back:
        assert gate is not None
        return _rollback_living(gate, path, reasons, catalog, quarantine)
    path.append(f"membership={membership}")
    if membership is MembershipSupport.FIXED_SHAPES or gate is None or gate.spans_job:
        why = ("fixed shapes: membership cannot change" if membership is MembershipSupport.FIXED_SHAPES
               else "no gate: the affected domain is unknown" if gate is None else f"domain {gate.domain} spans the job")
        reasons.append(f"{why}: every process relaunches")
        return _restart_job(path, reasons, catalog, quarantine)
    ckpt = catalog.newest()
    if ckpt is None:
        return _restart_from_zero(path, reasons, catalog, quarantine)
    fill = (_spare(failed, gate, [], [f"fill lost ranks {list(failed)}"], ())
            if membership is MembershipSupport.SPARE_REPLACEMENT
            else _rebuild(failed, gate, [], [f"drop lost ranks {list(failed)}"], ()))
    return Decision(
        action=Action.ROLLBACK_DOMAIN, target=_ckpt_target(ckpt), scope=ScopeKind.DOMAIN,
        ranks=(*gate.ranks, *failed),
        path=(*path, f"checkpoint={ckpt.id}", f"-> roll back domain {gate.domain} to {ckpt.id} + {fill.action}"),
        reasons=(*reasons, *_catalog_reasons(catalog)),
        lineage=LineageNote(comparability=Comparability.CHANGED, changed=fill.lineage.changed,
                            records=(LineageRecord.ROLLBACK, LineageRecord.REPLAYED_DATA_RANGE, *fill.lineage.records),
                            why=f"rollback to {ckpt.id}; {fill.lineage.why}"),
        also=(fill, *quarantine),
    )


def _spare(failed: tuple[int, ...], gate: GateResult, path: list[str], reasons: Sequence[str],
           also: tuple[Decision, ...]) -> Decision:
    ranks = ",".join(map(str, failed))
    return Decision(
        action=Action.RESTART_REPLICA, target=Target(kind=TargetKind.SPARE, id=f"ranks {ranks}"),
        scope=ScopeKind.RANKS, ranks=failed, path=(*path, f"-> restart ranks {ranks} on a spare"),
        reasons=(*reasons, "a spare takes the lost ranks' places 1:1; state comes from an agreeing dp peer"),
        lineage=LineageNote(
            comparability=Comparability.CHANGED, changed=(ChangeReason.HARDWARE,),
            records=(LineageRecord.DEVICE_REPLACED,),
            why="world size, layout and data order unchanged; another physical device is not proven bitwise equal",
        ),
        also=also,
    )


def _rebuild(failed: tuple[int, ...], gate: GateResult, path: list[str], reasons: Sequence[str],
             also: tuple[Decision, ...]) -> Decision:
    without = ",".join(map(str, failed))
    return Decision(
        action=Action.REBUILD_GROUP, target=Target(kind=TargetKind.GROUP, id=f"dp without {without}"),
        scope=ScopeKind.RANKS, ranks=tuple(r for r in gate.ranks if r not in failed),
        path=(*path, f"-> rebuild dp group without {without}"),
        reasons=(*reasons, "pure data parallel with a reconfigurable batch: the dp group is the smallest group whose "
                 "membership change the algorithm supports"),
        lineage=LineageNote(
            comparability=Comparability.CHANGED, changed=(ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION),
            records=(LineageRecord.WORLD_SIZE_CHANGE, LineageRecord.LAYOUT_CHANGE),
            why="fewer replicas reshard the data and change the gradient reduction",
        ),
        also=also,
    )


def _restart_job(path: list[str], reasons: Sequence[str], catalog: CheckpointCatalogView,
                 also: tuple[Decision, ...]) -> Decision:
    ckpt = catalog.newest()
    if ckpt is None:
        return _restart_from_zero(path, reasons, catalog, also)
    return Decision(
        action=Action.RESTART_JOB, target=_ckpt_target(ckpt), scope=ScopeKind.JOB, ranks=(),
        path=(*path, f"checkpoint={ckpt.id}", f"-> restart job from {ckpt.id}"),
        reasons=(*reasons, *_catalog_reasons(catalog)),
        lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                            records=(LineageRecord.RESTART, LineageRecord.REPLAYED_DATA_RANGE),
                            why=f"replay from {ckpt.id} on the same layout; a rank placed on another device "
                                "records DEVICE_REPLACED and CHANGED(hardware)"),
        also=also,
    )


def _rollback_living(gate: GateResult, path: list[str], reasons: Sequence[str], catalog: CheckpointCatalogView,
                     also: tuple[Decision, ...]) -> Decision:
    ckpt = catalog.newest()
    if ckpt is None:
        return _restart_from_zero(path, reasons, catalog, also)
    scope = ScopeKind.JOB if gate.spans_job else ScopeKind.DOMAIN
    label = "job" if gate.spans_job else f"domain {gate.domain}"
    return Decision(
        action=Action.ROLLBACK_DOMAIN, target=_ckpt_target(ckpt), scope=scope, ranks=gate.ranks,
        path=(*path, f"checkpoint={ckpt.id}", f"-> roll back {label} to {ckpt.id}"),
        reasons=(*reasons, "no process was lost: the domain reloads in place", *_catalog_reasons(catalog)),
        lineage=LineageNote(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED,
                            records=(LineageRecord.ROLLBACK, LineageRecord.REPLAYED_DATA_RANGE),
                            why=f"replay of steps ({ckpt.step}, failure] on the same layout, devices and code"),
        also=also,
    )


# ------------------------------------------------------------------------------------------------ the decision table


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionCase:
    """One row of the documented decision table: the inputs of `decide`."""

    name: str
    incident: Incident
    gate: GateResult | None
    idempotent: Idempotency
    membership: MembershipSupport
    catalog: CheckpointCatalogView
    recurrence: RecurrenceView | None = None

    def decide(self) -> Decision:
        return decide(self.incident, self.gate, idempotent=self.idempotent, membership=self.membership,
                      catalog=self.catalog, recurrence=self.recurrence)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionRow:
    case: DecisionCase
    decision: Decision


def decision_rows(cases: Sequence[DecisionCase]) -> tuple[DecisionRow, ...]:
    return tuple(DecisionRow(case=c, decision=c.decide()) for c in cases)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _catalog_label(c: CheckpointCatalogView) -> str:
    newest = c.newest()
    head = "none" if newest is None else f"{newest.id}@{newest.step}"
    if len(c.committed) > 1:
        head += f" (+{len(c.committed) - 1} older)"
    extra = "".join(f" +{n} {what}" for n, what in ((c.partial, "partial"), (c.corrupt, "corrupt")) if n)
    return head + extra


def _decision_label(d: Decision) -> str:
    return str(d.action) + "".join(f" + {a.action}" for a in d.also)


def render_decision_table(rows: Sequence[DecisionRow]) -> str:
    """The markdown decision table: one row per case, inputs -> action, target, lineage and path."""
    head = ("| case | class | gate | idempotent | membership | checkpoints | recurrence | action | target | lineage "
            "| path |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for row in rows:
        c, d = row.case, row.decision
        rec = "-" if c.recurrence is None else f"{c.recurrence.follows}:{c.recurrence.id} x{c.recurrence.occurrences}"
        gate = "none" if c.gate is None else f"{c.gate.verdict} ({'job' if c.gate.spans_job else c.gate.domain})"
        targets = [str(d.target) if d.target else "-", *(str(a.target) for a in d.also if a.target)]
        lineage = str(d.lineage.comparability) + (
            f"({', '.join(str(r) for r in d.lineage.changed)})" if d.lineage.changed else "")
        cells = (c.name, str(c.incident.klass), gate, str(c.idempotent), str(c.membership), _catalog_label(c.catalog),
                 rec, _decision_label(d), "; ".join(targets), lineage, " / ".join(d.path))
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |\n")
    return head + "".join(lines)


def doc_table_section(doc: str) -> str:
    """The text between the decision-table markers of a doc."""
    start, end = doc.find(TABLE_START), doc.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"doc has no {TABLE_START} ... {TABLE_END} section")
    return doc[start + len(TABLE_START):end].strip("\n") + "\n"


def write_decision_doc(path: Path, cases: Sequence[DecisionCase] | None = None) -> None:
    """Replace the table between the markers in `path` with the table rendered from `cases` (default: all)."""
    doc = path.read_text()
    doc_table_section(doc)
    table = render_decision_table(decision_rows(DECISION_CASES if cases is None else cases))
    start, end = doc.find(TABLE_START) + len(TABLE_START), doc.find(TABLE_END)
    atomic_write(path, doc[:start] + "\n" + table + doc[end:])


def _inc(klass: IncidentClass, ranks: tuple[int, ...], cause: Cause, *, subject: Subject | None = None,
         onset: int | None = 120, hardware: tuple[HardwareSignal, ...] = (),
         last_good: int | None = None) -> Incident:
    subj = subject if subject is not None else Subject(kind=SubjectKind.RANK, id=",".join(map(str, ranks)))
    return Incident(klass=klass, subject=subj, ranks=ranks, onset_step=onset,
                    detection_step=None if onset is None else onset + 5, confidence=0.9, cause=cause,
                    summary=f"{klass} on ranks {list(ranks)}", hardware=hardware, last_good_step=last_good)


_JOB = (0, 1, 2, 3, 4, 5, 6, 7)
_SURV = (0, 1, 2, 4, 5, 6, 7)
_CKPTS = CheckpointCatalogView(committed=(CheckpointRef(id="step-00000100", step=100),
                                          CheckpointRef(id="step-00000050", step=50)))
_CKPTS_PARTIAL = CheckpointCatalogView(committed=(CheckpointRef(id="step-00000100", step=100),),
                                       partial=1, corrupt=1)
_NO_CKPT = CheckpointCatalogView(partial=2)
_A, _D, _U = GateVerdict.AGREE, GateVerdict.DISAGREE, GateVerdict.UNKNOWN
_I, _N, _Q = Idempotency.IDEMPOTENT, Idempotency.NOT_IDEMPOTENT, Idempotency.UNKNOWN
_FIX = MembershipSupport.FIXED_SHAPES
_SPARE = MembershipSupport.SPARE_REPLACEMENT
_DP = MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH


def _gate(verdict: GateVerdict, ranks: tuple[int, ...] = _SURV, *, spans_job: bool = True,
          domain: str = "job") -> GateResult:
    bad = (ranks[-1],) if verdict is _D else ()
    fields = (StateField.OPTIMIZER, StateField.RNG) if verdict is _D else ()
    return GateResult(verdict=verdict, domain=domain, ranks=ranks, spans_job=spans_job, disagreeing=bad, fields=fields)


def _sub(verdict: GateVerdict, ranks: tuple[int, ...]) -> GateResult:
    """A gate over a proper sub-domain of the job: one dp replica."""
    return _gate(verdict, ranks, spans_job=False, domain="replica dp=1")


def _rec(klass: IncidentClass, follows: FollowsKind, id: str) -> RecurrenceView:
    return RecurrenceView(klass=klass, follows=follows, id=id, occurrences=3)


def _cases() -> tuple[DecisionCase, ...]:
    S, F, H = IncidentClass.STRAGGLER, IncidentClass.FAIL_STOP, IncidentClass.HANG
    V, C = IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION
    fail = _inc(F, (3,), Cause.EXIT)
    hang = _inc(H, (3,), Cause.STUCK_IN_COLLECTIVE)
    dev_subject = Subject(kind=SubjectKind.DEVICE, id="GPU-aa")
    out: list[DecisionCase] = []

    def add(name: str, inc: Incident, gate: GateResult | None, idem: Idempotency = _I,
            mem: MembershipSupport = _FIX, cat: CheckpointCatalogView = _CKPTS,
            rec: RecurrenceView | None = None) -> None:
        out.append(DecisionCase(name=name, incident=inc, gate=gate, idempotent=idem, membership=mem, catalog=cat,
                                recurrence=rec))

    HW = HardwareSignal
    straggler = _inc(S, (5,), Cause.THERMAL_THROTTLE)
    add("straggler", straggler, None)
    add("straggler-rank-recurs", straggler, None, rec=_rec(S, FollowsKind.RANK, "5"))
    add("straggler-device-recurs", straggler, None, rec=_rec(S, FollowsKind.DEVICE, "GPU-aa"))
    add("straggler-link-recurs", _inc(S, (4, 5), Cause.SLOW_LINK), None, rec=_rec(S, FollowsKind.LINK, "h0<->h1"))
    dev_straggler = _inc(S, (5,), Cause.THERMAL_THROTTLE, subject=dev_subject, hardware=(HW.CLOCK_LOSS, HW.THROTTLE))
    add("straggler-device-fault", dev_straggler, None)
    add("straggler-device-fault-rank-recurs", dev_straggler, None, rec=_rec(S, FollowsKind.RANK, "5"))
    add("imbalance", _inc(IncidentClass.IMBALANCE, (6, 7), Cause.STAGE_IMBALANCE), _gate(_A, _JOB))
    add("unclassified", _inc(IncidentClass.UNCLASSIFIED, (2,), Cause.UNKNOWN), None)
    add("checkpoint-saves-failed", _inc(IncidentClass.CHECKPOINT, (), Cause.STORAGE_FULL,
                                        subject=Subject(kind=SubjectKind.JOB, id="checkpoints")), None)
    add("hang-transient", _inc(H, (3,), Cause.TRANSIENT_STALL), None)
    add("hang-transient-device-fault", _inc(H, (3,), Cause.TRANSIENT_STALL, subject=dev_subject, hardware=(HW.XID,)),
        None)

    for mem, tag in ((_DP, "dp"), (_SPARE, "spare"), (_FIX, "fixed")):
        add(f"failstop-agree-idem-{tag}", fail, _gate(_A), _I, mem)
    add("failstop-agree-idem-fixed-nockpt", fail, _gate(_A), _I, _FIX, _NO_CKPT)
    add("failstop-agree-notidem-dp", fail, _gate(_A), _N, _DP)
    add("failstop-agree-unknownidem-spare", fail, _gate(_A), _Q, _SPARE)
    add("failstop-disagree-dp", fail, _gate(_D), _I, _DP)
    add("failstop-unknown-spare", fail, _gate(_U), _I, _SPARE)
    add("failstop-nogate-dp", fail, None, _I, _DP)
    add("failstop-disagree-partials", fail, _gate(_D), _I, _FIX, _CKPTS_PARTIAL)
    add("failstop-unknown-nockpt", fail, _gate(_U), _I, _DP, _NO_CKPT)
    add("failstop-subdomain-disagree-spare", fail, _sub(_D, (2,)), _I, _SPARE)
    add("failstop-subdomain-unknown-dp", fail, _sub(_U, (2,)), _Q, _DP)
    add("failstop-subdomain-disagree-fixed", fail, _sub(_D, (2,)), _I, _FIX)
    add("failstop-agree-idem-dp-device-recurs", fail, _gate(_A), _I, _DP, rec=_rec(F, FollowsKind.DEVICE, "GPU-aa"))
    add("failstop-agree-idem-dp-rank-recurs", fail, _gate(_A), _I, _DP, rec=_rec(F, FollowsKind.RANK, "3"))
    dbe_fail = _inc(F, (3,), Cause.EXCEPTION, subject=dev_subject, hardware=(HW.ECC_DBE, HW.XID))
    add("failstop-device-fault-agree-idem-dp", dbe_fail, _gate(_A), _I, _DP)
    add("failstop-device-fault-nogate", dbe_fail, None, _Q, _FIX)
    add("failstop-device-fault-driver-error-nogate",
        _inc(F, (3,), Cause.EXCEPTION, subject=dev_subject, hardware=(HW.DRIVER_ERROR,)), None, _Q, _FIX)

    add("hang-back-agree-idem", hang, _gate(_A, _JOB), _I, _FIX)
    add("hang-back-agree-notidem", hang, _gate(_A, _JOB), _N, _DP)
    add("hang-back-disagree", hang, _gate(_D, _JOB), _I, _SPARE)
    add("hang-back-agree-unknownidem-nockpt", hang, _gate(_A, _JOB), _Q, _FIX, _NO_CKPT)
    add("hang-silent-agree-idem-dp", hang, _gate(_A), _I, _DP)
    add("hang-silent-agree-idem-spare", hang, _gate(_A), _I, _SPARE)
    add("hang-silent-agree-idem-fixed", hang, _gate(_A), _I, _FIX)
    add("hang-silent-unknown-dp", hang, _gate(_U), _I, _DP)
    add("hang-host-recurs", hang, _gate(_U), _Q, _FIX, rec=_rec(H, FollowsKind.HOST, "host1"))
    add("hang-device-fault-unknown-spare", _inc(H, (3,), Cause.STUCK_IN_COLLECTIVE, subject=dev_subject,
                                                hardware=(HW.XID,)), _gate(_U), _I, _SPARE)

    div = _inc(V, (0, 1, 2, 3, 4, 5, 6, 7), Cause.RNG_MISMATCH)
    add("divergence-disagree-job", div, _gate(_D, _JOB))
    add("divergence-agree-job", div, _gate(_A, _JOB), _I, _DP)
    add("divergence-subdomain", _inc(V, (2, 3), Cause.STATE_MISMATCH), _sub(_D, (2, 3)))
    add("divergence-nogate", div, None, _Q, _SPARE)
    add("divergence-onset-before-ckpt", _inc(V, (2,), Cause.DATA_POSITION_MISMATCH, onset=80), _gate(_D, _JOB))
    add("divergence-onset-before-all", _inc(V, (2,), Cause.STEP_MISMATCH, onset=20), _gate(_D, _JOB))
    add("divergence-onset-unknown", _inc(V, (2,), Cause.STEP_MISMATCH, onset=None), _gate(_D, _JOB))
    # seen at fingerprint step 120, sound last at fingerprint step 90: the step-100 checkpoint may hold the fault
    add("divergence-sampled-onset", _inc(V, (2,), Cause.RNG_MISMATCH, last_good=90), _gate(_D, _JOB))
    add("divergence-nockpt", div, _gate(_D, _JOB), cat=_NO_CKPT)

    corr = _inc(C, (4,), Cause.VALUE_MISMATCH)
    add("corruption", corr, _gate(_D, _JOB))
    add("corruption-device-recurs", corr, _gate(_U, _JOB), rec=_rec(C, FollowsKind.DEVICE, "GPU-aa"))
    add("corruption-hw-error", _inc(C, (4,), Cause.HARDWARE_ERROR, subject=dev_subject), _gate(_D, _JOB))
    add("corruption-rank-recurs", corr, _gate(_D, _JOB), rec=_rec(C, FollowsKind.RANK, "4"))
    add("corruption-partials", corr, _gate(_D, _JOB), cat=_CKPTS_PARTIAL)
    add("corruption-nockpt-hw-error", _inc(C, (4,), Cause.HARDWARE_ERROR, subject=dev_subject), None, cat=_NO_CKPT)
    add("corruption-device-fault-sbe-rising", _inc(C, (4,), Cause.HARDWARE_ERROR, subject=dev_subject,
                                                   hardware=(HW.ECC_SBE_RISING, HW.XID, HW.ROW_REMAP)), None)
    return tuple(out)


DECISION_CASES: tuple[DecisionCase, ...] = _cases()
"""The documented cases: docs/recovery.md renders them and tests/unit/test_recovery_policy.py checks each."""


def main(argv: Sequence[str]) -> int:
    if argv:
        write_decision_doc(Path(argv[0]))
    else:
        sys.stdout.write(render_decision_table(decision_rows(DECISION_CASES)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
