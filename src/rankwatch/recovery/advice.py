"""Cost-aware advice about a slow device: keep it, or replace it at the next checkpoint.

The policy (`recovery.policy`) keeps "a slow rank is not a failed rank" for the running job: a straggler is observed
(or quarantined out of future placement on hardware evidence), never killed or rolled back. Whether to stop the job
at its next checkpoint and relaunch it without the slow device is a question of cost, answered here with numbers:

    projected loss = the share of step time the subject costs (its impact: what making its work its peers' pace
                     saves, `analytics.impact`) x the training time left in the run at the current pace
    restart cost   = save + relaunch + restore + gate, as measured (the run's own, or earlier runs')

Replace at the next checkpoint when the projected loss exceeds the restart cost; otherwise keep it. The save is in
the cost because a stop at the next checkpoint must wait for that save to commit (training pauses for its blocking
part either way, but the relaunch cannot start before it is durable), and the work since it is not lost (the job
stops right after a committed save). A relaunch onto other hardware changes lineage (CHANGED: hardware), as every
device swap does; that is what the advice costs beyond time, and it says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.analytics.costs import MeasuredCosts, measured_costs, training_left
from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind

__all__ = ["ReplaceAdvice", "RestartCost", "replace_advice", "replacement_advice", "restart_cost"]

_REPLACEABLE = frozenset({SubjectKind.DEVICE, SubjectKind.RANK, SubjectKind.HOST})


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartCost:
    """What one stop-and-relaunch at a checkpoint costs the job, in seconds of wall time, part by part."""

    save_s: float
    """The blocking part of the save the stop waits for."""
    relaunch_s: float
    """From the stop to the relaunched ranks' first step start, less restore and gate (process start, rendezvous,
    model build)."""
    restore_s: float
    """Loading and verifying the checkpoint."""
    gate_s: float = 0.0
    """The consistency gate before training resumes."""
    source: str = ""
    """Where the figures were measured (a run, its recovery record)."""

    def __post_init__(self) -> None:
        for name in ("save_s", "relaunch_s", "restore_s", "gate_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"RestartCost.{name} {v!r}: must be a finite number >= 0")

    @property
    def total_s(self) -> float:
        return self.save_s + self.relaunch_s + self.restore_s + self.gate_s

    def to_dict(self) -> dict[str, Any]:
        return {"save_s": self.save_s, "relaunch_s": self.relaunch_s, "restore_s": self.restore_s,
                "gate_s": self.gate_s, "total_s": self.total_s, "source": self.source}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplaceAdvice:
    incident: str
    subject: str
    share: float
    """The share of step time the subject costs (its incident's impact)."""
    remaining_s: float
    """Training time left in the run at the current pace."""
    projected_loss_s: float
    """`share` x `remaining_s`: what keeping it costs from here on."""
    restart: RestartCost
    replace: bool
    """True: replace it at the next checkpoint; False: keep it (the restart costs more than it would save)."""
    relaunching: bool = False
    """The plan relaunches the job anyway (for another incident): replacing it then costs no restart of its own."""

    def describe(self) -> str:
        if self.relaunching:
            return (f"{self.subject} ({self.incident}) costs {self.share:.1%} of step time: "
                    f"{self.projected_loss_s:.1f} s over the {self.remaining_s:.0f} s of training left; the plan "
                    "relaunches the job anyway, so replacing it in that relaunch costs no restart of its own: "
                    + ("replace it there (lineage records the hardware change)" if self.replace else
                       "nothing to gain (it costs no time)"))
        head = (f"{self.subject} ({self.incident}) costs {self.share:.1%} of step time: {self.projected_loss_s:.1f} s "
                f"over the {self.remaining_s:.0f} s of training left, against a restart of {self.restart.total_s:.1f} s "
                f"(save {self.restart.save_s:.1f} + relaunch {self.restart.relaunch_s:.1f} + restore "
                f"{self.restart.restore_s:.1f} + gate {self.restart.gate_s:.1f}"
                + (f", measured in {self.restart.source}" if self.restart.source else "") + ")")
        if self.replace:
            return (head + ": replace it at the next checkpoint (stop after the save commits, relaunch without it; "
                    "lineage records the hardware change); the running job is not stopped before then")
        return head + ": keep it; a slow rank is not a failed rank, and replacing it would cost more than it saves"

    def to_dict(self) -> dict[str, Any]:
        return {"incident": self.incident, "subject": self.subject, "share": self.share,
                "remaining_s": self.remaining_s, "projected_loss_s": self.projected_loss_s,
                "restart": self.restart.to_dict(), "replace": self.replace, "relaunching": self.relaunching}


def replace_advice(incident: Incident, *, remaining_s: float, restart: RestartCost,
                   relaunching: bool = False) -> ReplaceAdvice | None:
    """The advice for a straggler whose subject can be replaced (a device, a rank's device, a host) and whose cost
    was measured (`Incident.impact` with a share); None for any other incident. `relaunching`: the job relaunches
    anyway, so the replacement's restart costs nothing of its own. ValueError for a negative or non-finite
    `remaining_s`."""
    if not (math.isfinite(remaining_s) and remaining_s >= 0):
        raise ValueError(f"remaining_s {remaining_s!r}: must be a finite number >= 0")
    if incident.klass is not IncidentClass.STRAGGLER or incident.subject.kind not in _REPLACEABLE:
        return None
    impact = incident.impact
    if impact is None or impact.share is None:
        return None
    loss = impact.share * remaining_s
    return ReplaceAdvice(incident=incident.id, subject=str(incident.subject), share=impact.share,
                         remaining_s=remaining_s, projected_loss_s=loss, restart=restart,
                         replace=loss > (0.0 if relaunching else restart.total_s), relaunching=relaunching)


def restart_cost(costs: MeasuredCosts) -> tuple[RestartCost | None, str]:
    """A stop at the next checkpoint and a relaunch, from `costs` (`analytics.costs.measured_costs`): the save is the
    synchronous saves' blocking time (none: an asynchronous save's pause and write, which the stop waits for); the
    relaunch, restore and gate are the measured restarts' (relaunch -> every process up -> the checkpoint loaded ->
    training), and where no restart was measured yet, the relaunch is the first start-up (launch 0 to its first step),
    the restore a measured checkpoint load (else 0) and the gate 0, said in `source`. (None, why) when no save was
    measured: a replacement would then restart from step 0."""
    runs = ", ".join(str(r) for r in costs.runs)
    sync, pause, write = costs.sync_save.seconds, costs.async_pause.seconds, costs.async_write.seconds
    if sync is not None:
        save_s, save = sync, f"a synchronous save's blocking time (n={costs.sync_save.count})"
    elif pause is not None:
        save_s, save = pause + (write or 0.0), f"an asynchronous save's pause and write (n={costs.async_pause.count})"
    else:
        return None, (f"no checkpoint save is measured in {runs} ({costs.sync_save.why}): a replacement would "
                      "restart from step 0")
    relaunch = costs.relaunch.seconds
    if relaunch is not None:
        return RestartCost(save_s=save_s, relaunch_s=relaunch, restore_s=costs.reload.seconds or 0.0,
                           gate_s=costs.gate.seconds or 0.0,
                           source=f"{runs}: {save}, {costs.relaunch.count} restart(s)"), ""
    startup = costs.startup.seconds or 0.0
    load = costs.load.seconds
    return RestartCost(save_s=save_s, relaunch_s=startup, restore_s=load or 0.0, gate_s=0.0, source=(
        f"{runs}: {save}; no restart measured yet: relaunch = the first launch to its first step, restore = "
        + (f"its checkpoint loads (n={costs.load.count})" if load is not None else "0 (no checkpoint loaded)")
        + ", gate 0")), ""


def replacement_advice(run_dir: Path, stragglers: Sequence[Incident], *, relaunching: bool = False
                       ) -> tuple[tuple[ReplaceAdvice, ...], tuple[str, ...]]:
    """`replace_advice` for each of `stragglers` with the run's own figures: its restart cost (`restart_cost` of
    `measured_costs([run_dir])`) and the training time it has left (`analytics.costs.training_left`). Returns the
    advice and the notes: what the time left rests on, and why a straggler, or all of them, get none (no declared
    step count, no save measured, an impact not measured, a subject no relaunch replaces)."""
    if not stragglers:
        return (), ()
    try:
        left, costs = training_left(run_dir), measured_costs([run_dir])
    except ValueError as exc:
        return (), (f"no replace advice: the run's costs cannot be measured: {exc}",)
    if left.seconds is None:
        return (), (f"no replace advice: {left.describe()}",)
    restart, why = restart_cost(costs)
    if restart is None:
        return (), (f"no replace advice: {why}",)
    out: list[ReplaceAdvice] = []
    notes = [left.describe()]
    for inc in stragglers:
        advice = replace_advice(inc, remaining_s=left.seconds, restart=restart, relaunching=relaunching)
        if advice is not None:
            out.append(advice)
        elif inc.subject.kind not in _REPLACEABLE:
            notes.append(f"{inc.id} ({inc.subject}): no replace advice: a relaunch does not replace a "
                         f"{inc.subject.kind}")
        else:
            what = inc.impact.describe() if inc.impact is not None else "impact not measured"
            notes.append(f"{inc.id} ({inc.subject}): no replace advice: {what}")
    return tuple(out), tuple(notes)
