"""Goodput: how much of a run's wall time trained steps that count, and where the rest went (what its checkpoints
and recoveries cost across runs, and the checkpoint interval that follows, are `analytics.costs`).

    rankwatch goodput RUN [--json]

The span is the wall clock from the first launch (`run.json`, launch 0's `started_wall_ns`) to the last step end of
any rank of any attempt. It is cut, without gaps or overlaps, into:

* each attempt's training: its steps as the job saw them, step s's slice ending at the latest rank's end of s and
  beginning at the latest rank's end of the step before it (the attempt's first step: at the earliest rank's
  start), so time between steps (a save outside the step, fingerprints) falls in the slice of the step after it;
* the start-up before attempt 0's first step;
* each interruption: from a failed attempt's last step end to the first step start of the next attempt that trained.

Each piece goes to one part (`Part`; the parts sum to the span, `OTHER` takes what no record attributes):

* EFFECTIVE: the slices of the steps that count, less their checkpoint pauses and straggler slowdown. A step counts
  in the attempt whose copy is the final trajectory's; an earlier attempt's copy of a step is thrown away when a later
  attempt resumed at or before that step (its first step in the telemetry, or the lineage's rollback / restart).
* LOST_WORK: the slices of thrown-away copies, and the step in progress at each failure (from the attempt's last
  step end to the failure, where the failed rank recorded its own end later).
* STARTUP: launch 0's `started_wall_ns` to attempt 0's first step start.
* DETECTION: the failure to its detection: the recovery record's `detected_wall_ns`, when the manager's side first
  knew the attempt needed it (`detected_by`: the launcher's exit record of a rank that ended abnormally, the alert
  that reached the service, or the analysis that raised the incidents). A record written before the manager recorded
  it falls back on the incidents' own: `detection_wall_ns` of the incidents whose decision carried out the record's
  action (a hang's is its last step end plus the stall that raised it), except a fail-stop's, which is its culprit's
  last sign of life (`analytics.failstop`), not a detection: a fail-stop leaves such a record's detection unknown. The
  failure is the latest of the failed attempt's last step end, the earliest exception, signal or abnormal exit event
  of a rank the incidents name, and a fail-stop's `detection_wall_ns`. A detection at or before the failure (the
  fault seen while its rank was still up, or inside the attempt's training: a state fault found while the job
  trained on) or after the relaunch is no detection time: unknown.
* DECISION: the detection to the recovery record's `decided_wall_ns` (the manager's plan made, before anything it
  does begins). With the supervised manager it holds the rest of the failed attempt (the other ranks ending, or the
  launcher's grace before it stops them) and the analysis of the run. An older record has only its `wall_ns`, written
  after the relaunch ended: no decision time, unknown.
* RELAUNCH: the decision (else the relaunch's `started_wall_ns` in `run.json`) to the last `start` event of the
  attempt that trained next: every process up, its collector attached. Relaunches that trained nothing (a gate
  refusal) in between are in it.
* RESTORE: from there to the end of that attempt's last checkpoint `load`/`verify` phase (process group, model,
  checkpoint choice, verification, load); where nothing was loaded (a restart from step 0), to its first step.
* GATE: from the restore's end to the attempt's last `recovery` event after it (the consistency gate's outcome), and
  on to its first step start.
* CHECKPOINT: the blocking part of each save whose slice counts (the slice holding its first phase start): per save,
  the largest over ranks of its phases that blocked training, at most the slice. A phase overlapping a step its rank
  started after the save began ran beside training (an asynchronous save's write); the others blocked it (inside
  the step that saves, or between steps).
* STRAGGLER: per attempt, the what-if's share of its replayed time lost to slowness outside checkpoint phases
  (1 - T(checkpoints as measured, all else ideal) / T; `WhatIf.lost_share` where the window saves nothing: a rank
  slow to save is in CHECKPOINT already) times the attempt's counted slices (the what-if replays the attempt's
  steps with their checkpoint phases, so the share is of that time). An attempt the what-if cannot replay is a
  warning, and the part is unknown for it.
* OTHER: the rest: an interruption's time between marks that are not recorded (its note says which parts it holds).

A part that cannot be measured from what the run holds is None with the reason, never 0; its time is in OTHER.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.analytics.timeline import Interruption, SaveCost, SaveMode, timeline
from rankwatch.analytics.whatif import WhatIf, whatif

__all__ = ["Goodput", "Interruption", "Part", "PartTime", "SaveCost", "SaveMode", "goodput"]


class Part(StrEnum):
    """Where the run's wall time went (the module docstring says which interval each is measured from)."""

    EFFECTIVE = "effective"
    LOST_WORK = "lost_work"
    STARTUP = "startup"
    DETECTION = "detection"
    DECISION = "decision"
    RELAUNCH = "relaunch"
    RESTORE = "restore"
    GATE = "gate"
    CHECKPOINT = "checkpoint"
    STRAGGLER = "straggler"
    OTHER = "other"


_MEASURED: dict[Part, str] = {
    Part.EFFECTIVE: "slices of the steps that count, less their checkpoint pauses and straggler slowdown",
    Part.LOST_WORK: "slices of step copies a later attempt trained again, and the step in progress at each failure",
    Part.STARTUP: "launch 0 (run.json) -> attempt 0's first step start",
    Part.DETECTION: "failure -> the recovery record's detected_wall_ns (else the incident's detection_wall_ns)",
    Part.DECISION: "detection -> the recovery record's decided_wall_ns",
    Part.RELAUNCH: "decision (else run.json's relaunch) -> the next attempt's last start event",
    Part.RESTORE: "every process up -> its last checkpoint load/verify end (none: its first step)",
    Part.GATE: "the restore's end -> its last recovery event (the gate) -> its first step",
    Part.CHECKPOINT: "blocking save phases inside counted slices (largest rank per save)",
    Part.STRAGGLER: "what-if share lost to slowness (saves aside) x each attempt's counted slices",
    Part.OTHER: "interruption time between marks the records do not carry",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PartTime:
    """One part of the run's wall time."""

    part: Part
    seconds: float | None
    """None: not measurable from what the run holds (`why`); its time is in OTHER."""
    share: float | None
    """`seconds` / the run's span."""
    measured: str
    """The interval it is measured from, in a few words (the module docstring has them in full)."""
    why: str = ""
    """Why it is unknown, or what it holds where that needs saying (OTHER)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Goodput:
    """Where one run's wall time went (module docstring)."""

    run_dir: Path
    started_ns: int
    """Launch 0's `started_wall_ns`."""
    ended_ns: int
    """The last step end."""
    ranks: int
    """The largest world size of its launches."""
    attempts: int
    parts: tuple[PartTime, ...]
    """Every `Part`, in `Part` order; the known ones sum to `total_s`."""
    interruptions: tuple[Interruption, ...]
    saves: tuple[SaveCost, ...]
    counted_steps: int
    """Steps of the final trajectory."""
    lost_steps: int
    """Step copies thrown away."""
    warnings: tuple[str, ...] = field(default=())

    @property
    def total_s(self) -> float:
        return (self.ended_ns - self.started_ns) / 1e9

    @property
    def effective_s(self) -> float:
        s = self.part(Part.EFFECTIVE).seconds
        assert s is not None
        return s

    @property
    def ratio(self) -> float:
        """Effective training time / the span."""
        return self.effective_s / self.total_s if self.total_s > 0 else 0.0

    def part(self, part: Part) -> PartTime:
        return next(p for p in self.parts if p.part is part)

    def describe(self) -> list[str]:
        n = len(self.interruptions)
        lines = [f"{self.run_dir}: {self.ranks} ranks, {self.attempts} attempt(s), {n} interruption(s); "
                 f"{self.total_s:.2f} s from the first launch to the last step end; effective training "
                 f"{self.effective_s:.2f} s = {self.ratio:.1%} ({self.counted_steps} steps count, "
                 f"{self.lost_steps} step copies thrown away)",
                 f"  {'part':<11} {'seconds':>9} {'share':>7}  measured from"]
        for p in self.parts:
            value = "unknown" if p.seconds is None else f"{p.seconds:9.3f}"
            share = "" if p.share is None else f"{p.share:7.1%}"
            lines.append(f"  {p.part:<11} {value:>9} {share:>7}  {p.measured}" + (f" ({p.why})" if p.why else ""))
        lines.append(f"  {'total':<11} {self.total_s:9.3f} {1.0:7.1%}")
        for i in self.interruptions:
            lines.append(f"  interruption: attempt {i.failed_attempt} failed "
                         f"{(i.failure_ns - self.started_ns) / 1e9:.2f} s in"
                         + (f", {i.recovery} ({i.action})" if i.recovery else ", no recovery record")
                         + (f", detected {(i.detected_ns - i.failure_ns) / 1e9:.2f} s later ({i.detected_by})"
                            if i.detected_ns is not None else "")
                         + (f", attempt {i.resumed_attempt} trained again from step {i.resumed_step} "
                            f"{i.restore_s:.2f} s after the failure" if i.restore_s is not None and
                            i.resumed_attempt is not None else ", nothing trained after it")
                         + f"; {i.lost_steps} step copies ({i.lost_s:.3f} s) lost")
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir), "ranks": self.ranks, "attempts": self.attempts,
            "total_s": round(self.total_s, 6), "effective_s": round(self.effective_s, 6),
            "ratio": round(self.ratio, 6), "counted_steps": self.counted_steps, "lost_steps": self.lost_steps,
            "parts": [{"part": str(p.part), "seconds": None if p.seconds is None else round(p.seconds, 6),
                       "share": None if p.share is None else round(p.share, 6), "measured": p.measured,
                       "why": p.why} for p in self.parts],
            "interruptions": [{**asdict(i), "restore_s": i.restore_s} for i in self.interruptions],
            "saves": [{**asdict(s), "mode": None if s.mode is None else str(s.mode)} for s in self.saves],
            "warnings": list(self.warnings),
        }


# -------------------------------------------------------------------------------------------- interruption parts


_CHAIN = (Part.DETECTION, Part.DECISION, Part.RELAUNCH, Part.RELAUNCH, Part.RESTORE, Part.GATE, Part.GATE)
"""The part of the time between consecutive `_MARKS`."""
_MARKS = ("the failure", "the detection", "the decision", "the relaunch", "every process up", "the restore's end",
          "the gate", "the first step")


def _segments(marks: Sequence[int | None], attempt: int, warnings: list[str]) -> list[tuple[Part, float, str]]:
    """An interruption's time by part between consecutive known marks (`_CHAIN`). A span across unknown marks whose
    parts differ goes to OTHER with a note naming them, except set-up with nothing restored (RESTORE). A mark out of
    order is left out, with a warning."""
    known = [0]
    for i in range(1, len(marks)):
        t, prev = marks[i], marks[known[-1]]
        assert prev is not None
        if t is None:
            continue
        if t < prev and i < len(marks) - 1:
            warnings.append(f"after attempt {attempt}: {_MARKS[i]} is recorded before {_MARKS[known[-1]]}: left out")
            continue
        known.append(i)
    out = []
    for i, j in zip(known, known[1:]):
        seconds = max(0, marks[j] - marks[i]) / 1e9  # type: ignore[operator]
        held = list(dict.fromkeys(_CHAIN[i:j]))
        if len(held) == 1:
            out.append((held[0], seconds, ""))
        elif set(held) == {Part.RESTORE, Part.GATE} and marks[5] is None:
            out.append((Part.RESTORE, seconds, ""))
        else:
            out.append((Part.OTHER, seconds, f"{seconds:.3f} s after attempt {attempt}, from {_MARKS[i]} to "
                                             f"{_MARKS[j]}: {' + '.join(map(str, held))}"))
    return out


# ------------------------------------------------------------------------------------------------------- goodput


def _slowness_share(w: WhatIf) -> float:
    """The share of the what-if's replayed time lost to slowness outside checkpoint phases: 1 - T(checkpoints as
    measured, all else ideal) / T. A rank slow to save is in the CHECKPOINT part already (the largest rank's pause);
    with no checkpoint work in the window it is `WhatIf.lost_share`."""
    ckpt = next((s for s in w.by_kind if s.subject == "kind:checkpoint"), None)
    if ckpt is None or w.actual_ns <= 0:
        return w.lost_share
    return max(0.0, 1.0 - ckpt.slowdown * w.ideal_ns / w.actual_ns)


def goodput(run_dir: Path | str) -> Goodput:
    """Where the run's wall time went, by `Part` (module docstring). `RunDirError` naming the file for a directory
    that is not a run or a damaged record; `NoDataError` when no step completed."""
    tl = timeline(run_dir)
    warnings = list(tl.warnings)
    total = (tl.ended_ns - tl.started_ns) / 1e9
    values: dict[Part, float | None] = {p: None for p in Part}
    why: dict[Part, str] = {}
    counted_attempts = sorted({s.attempt for s in tl.slices if s.thrown_by is None})
    straggler, unreplayed = 0.0, []
    for a in counted_attempts:
        try:
            share = _slowness_share(whatif(tl.run_dir, attempt=a))
        except ValueError as exc:
            unreplayed.append(a)
            warnings.append(f"attempt {a}: the what-if cannot replay it ({exc}): its straggler slowdown is unknown")
            continue
        straggler += float(share) * tl.counted_s(a)
    if len(unreplayed) < len(counted_attempts):
        values[Part.STRAGGLER] = straggler
        if unreplayed:
            why[Part.STRAGGLER] = f"attempt(s) {', '.join(map(str, unreplayed))} could not be replayed: left out"
    else:
        why[Part.STRAGGLER] = "the what-if could replay no attempt (see the warnings)"
    resumed = [i for i in tl.interruptions if i.training_ns is not None]
    values[Part.LOST_WORK] = sum(s.seconds for s in tl.slices if s.thrown_by is not None) + sum(
        (i.failure_ns - i.last_step_end_ns) / 1e9 for i in resumed)
    values[Part.STARTUP] = tl.startup_s
    values[Part.CHECKPOINT] = tl.checkpoint_s
    others = []
    unknown: dict[Part, str] = {}
    for i in resumed:
        for part, text in ((Part.DETECTION, i.detection_why), (Part.DECISION, i.decision_why)):
            if text:
                unknown.setdefault(part, text)
        marks = [i.failure_ns, i.detected_ns, i.decided_ns, i.relaunched_ns, i.up_ns, i.restored_ns, i.gated_ns,
                 i.training_ns]
        for part, seconds, note in _segments(marks, i.failed_attempt, warnings):
            values[part] = (values[part] or 0.0) + seconds
            if note:
                others.append(note)
    for part in (Part.DETECTION, Part.DECISION, Part.RELAUNCH, Part.RESTORE, Part.GATE):
        if not resumed:
            values[part], why[part] = 0.0, "no interruption was recovered"
        elif part in unknown:
            why[part] = (unknown[part] if values[part] is None else
                         f"measured for some interruptions only; {unknown[part]}")
        elif values[part] is None:
            why[part] = "not recorded (its marks are missing)"
    effective = tl.counted_s() - tl.checkpoint_s - (values[Part.STRAGGLER] or 0.0)
    if effective < 0:
        warnings.append(f"the checkpoint pauses and straggler slowdown exceed the counted steps' time by "
                        f"{-effective:.3f} s: the effective time is taken as 0")
        effective = 0.0
    values[Part.EFFECTIVE] = effective
    known = sum(v for p, v in values.items() if v is not None and p is not Part.OTHER)
    if known > total + 1e-6:
        warnings.append(f"the parts add up to {known - total:.6f} s more than the span: overlapping records")
    values[Part.OTHER] = max(0.0, total - known)
    if others:
        why[Part.OTHER] = "; ".join(others)
    parts = tuple(PartTime(part=p, seconds=v, share=None if v is None or total <= 0 else v / total,
                           measured=_MEASURED[p], why=why.get(p, "")) for p, v in values.items())
    return Goodput(run_dir=tl.run_dir, started_ns=tl.started_ns, ended_ns=tl.ended_ns, ranks=tl.ranks,
                   attempts=tl.attempts, parts=parts, interruptions=tl.interruptions, saves=tl.saves,
                   counted_steps=sum(1 for s in tl.slices if s.thrown_by is None),
                   lost_steps=sum(1 for s in tl.slices if s.thrown_by is not None), warnings=tuple(warnings))
