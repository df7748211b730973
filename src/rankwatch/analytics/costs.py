"""What checkpointing and recovery cost across runs, and the checkpoint interval that follows from it.

    rankwatch advise RUN [RUN ...] [--mtbf-hours H] [--ranks N ...] [--json]

`measured_costs` averages what each run's timeline (`analytics.timeline`) measured: the blocking part of
synchronous saves, the pause and background write of asynchronous ones, the time from a failure to training again,
the current interval between committed saves, and how often the runs were interrupted. `advise` turns those figures
into the Young/Daly and the advised checkpoint interval and the expected goodput at the current and the advised one
(`analytics.interval`), at the runs' own rank count and at larger ones, with a per-device MTBF either given or
observed (and then said to be weak below `WEAK_RATE_BELOW` interruptions). `training_left` is the run's declared
steps not yet trained, at its current pace: with the restart figures, what `recovery.advice` weighs a slow device's
cost against.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rankwatch.analytics.timeline import SaveMode, Timeline, timeline
from rankwatch.analytics.interval import (
    IntervalAdvice, IntervalCosts, IntervalFigures, advised_interval, interval_advice, job_mtbf_s, young_daly_interval,
)

__all__ = ["DEFAULT_RANKS", "WEAK_RATE_BELOW", "Advice", "AdviceRow", "Figure", "MeasuredCosts", "TrainingLeft",
           "advise", "measured_costs", "training_left"]

DEFAULT_RANKS = (2048, 16_384)
"""The rank counts `advise` scales to unless told otherwise."""

WEAK_RATE_BELOW = 10
"""Fewer interruptions than this make an observed failure rate a weak estimate (a Poisson count of n has a relative
standard error of 1/sqrt(n): over 30 % below 10)."""

# ------------------------------------------------------------------------------------------------ measured costs


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    """A measured time: its mean (or median, where said) over what was seen, or None with the reason."""

    seconds: float | None
    """None: not measured (`why`)."""
    count: int
    """How many occurrences it is taken over."""
    why: str = ""

    def text(self) -> str:
        return f"{self.seconds:.3f} s (n={self.count})" if self.seconds is not None else f"unknown ({self.why})"


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCosts:
    """What checkpointing and recovery cost across runs, and how often they were interrupted (`measured_costs`)."""

    runs: tuple[Path, ...]
    sync_save: Figure
    """Training time a synchronous save blocks (per save: the largest rank's), mean over saves."""
    async_pause: Figure
    """The pause training sees at an asynchronous save (the state copied), mean over saves."""
    async_write: Figure
    """An asynchronous save's background write (the largest rank's phase time beside training), mean over saves."""
    restore: Figure
    """From an interruption's failure to training again, lost work aside (detection, decision, relaunch, restore,
    gate): mean over the interruptions that trained again."""
    relaunch: Figure
    """Of that, from the relaunch (run.json) to every process of the next attempt up (its last `start` event), mean
    over the interruptions that record both: a planned restart's relaunch."""
    reload: Figure
    """From every process up to the checkpoint loaded and verified (nothing loaded: to the first step): goodput's
    RESTORE of one interruption, mean over the same."""
    gate: Figure
    """From the load's end to the first step (the consistency gate): goodput's GATE, mean over those that loaded."""
    startup: Figure
    """Launch 0 to its first step start, less a checkpoint load of attempt 0 (a resumed run's), mean over the runs:
    the relaunch of a run that has not restarted yet."""
    load: Figure
    """A checkpoint load: the largest rank's load and verify phase time, mean over loads."""
    sync_interval: Figure
    """The current checkpoint interval of synchronous saves: median wall seconds between consecutive committed saves
    of one attempt, both synchronous."""
    async_interval: Figure
    """The same between asynchronous saves."""
    interruptions: int
    """Unexpected interruptions seen: attempts that failed and were relaunched, and last attempts that ended short of
    their launch's step count."""
    wall_hours: float
    """The runs' spans (first launch to last step end), summed."""
    ranks: int
    """The largest world size among the runs."""
    rank_hours: float
    """Each run's span times its world size, summed."""
    warnings: tuple[str, ...] = field(default=())

    @property
    def job_mtbf_s(self) -> float | None:
        """Observed: wall hours / interruptions (None without an interruption)."""
        return self.wall_hours * 3600 / self.interruptions if self.interruptions else None

    @property
    def device_mtbf_s(self) -> float | None:
        """Observed, per device: rank hours / interruptions (None without an interruption)."""
        return self.rank_hours * 3600 / self.interruptions if self.interruptions else None

    def describe(self) -> list[str]:
        lines = [f"measured over {len(self.runs)} run(s), {self.ranks} ranks at most, {self.wall_hours * 3600:.1f} s "
                 f"of job wall time ({self.rank_hours * 3600:.1f} rank-seconds)",
                 f"  synchronous save (blocking): {self.sync_save.text()}",
                 f"  asynchronous save: pause {self.async_pause.text()}, background write {self.async_write.text()}",
                 f"  restore (failure -> training again, lost work aside): {self.restore.text()}",
                 f"    of which relaunch -> every process up {self.relaunch.text()}, -> checkpoint loaded "
                 f"{self.reload.text()}, -> training (gate) {self.gate.text()}",
                 f"  first start-up (launch 0 -> first step, a load aside): {self.startup.text()}; checkpoint load "
                 f"(load + verify): {self.load.text()}",
                 f"  current interval (median between committed saves): sync {self.sync_interval.text()}, async "
                 f"{self.async_interval.text()}",
                 f"  unexpected interruptions: {self.interruptions}"]
        return lines + [f"  warning: {w}" for w in self.warnings]

    def to_dict(self) -> dict[str, Any]:
        def fig(f: Figure) -> dict[str, Any]:
            return {"seconds": None if f.seconds is None else round(f.seconds, 6), "count": f.count, "why": f.why}

        return {"runs": [str(r) for r in self.runs], "sync_save": fig(self.sync_save),
                "async_pause": fig(self.async_pause), "async_write": fig(self.async_write),
                "restore": fig(self.restore), "relaunch": fig(self.relaunch), "reload": fig(self.reload),
                "gate": fig(self.gate), "startup": fig(self.startup), "load": fig(self.load),
                "sync_interval": fig(self.sync_interval),
                "async_interval": fig(self.async_interval), "interruptions": self.interruptions,
                "wall_hours": self.wall_hours, "ranks": self.ranks, "rank_hours": self.rank_hours,
                "job_mtbf_s": self.job_mtbf_s, "device_mtbf_s": self.device_mtbf_s, "warnings": list(self.warnings)}


def _mean(values: Sequence[float], none: str) -> Figure:
    return Figure(seconds=statistics.fmean(values), count=len(values)) if values else Figure(
        seconds=None, count=0, why=none)


def _median(values: Sequence[float], none: str) -> Figure:
    return Figure(seconds=statistics.median(values), count=len(values)) if values else Figure(
        seconds=None, count=0, why=none)


def _ended_short(tl: Timeline) -> bool:
    """The last attempt stopped before its launch's last step (where the launch records its step count)."""
    target = tl.declared_steps
    last = max((s.step for s in tl.slices if s.attempt == tl.launched - 1), default=None)
    return target is not None and (last is None or last < target - 1) and not (
        tl.interruptions and tl.interruptions[-1].resumed_attempt is None)


def measured_costs(run_dirs: Iterable[Path | str]) -> MeasuredCosts:
    """Save, restore and interruption figures across `run_dirs` (`MeasuredCosts`). A figure no run measures (no
    checkpoint, no failure) is None with the reason. RunDirError / NoDataError as `timeline.timeline`."""
    runs = [Path(r) for r in run_dirs]
    if not runs:
        raise ValueError("measured_costs: no run given")
    sync, pause, write, restore, relaunch, reload, gate, startup, load = [], [], [], [], [], [], [], [], []
    gaps: dict[SaveMode, list[float]] = {SaveMode.SYNC: [], SaveMode.ASYNC: []}
    interruptions, wall_s, rank_s, ranks = 0, 0.0, 0.0, 0
    warnings: list[str] = []
    for run in runs:
        tl = timeline(run)
        warnings += [f"{run}: {w}" for w in tl.warnings]
        for s in tl.saves:
            if s.mode is SaveMode.SYNC:
                sync.append(s.blocking_s)
            elif s.mode is SaveMode.ASYNC:
                pause.append(s.blocking_s)
                write.append(s.background_s)
        committed = [s for s in tl.saves if s.committed]
        for a, b in zip(committed, committed[1:]):
            if a.attempt == b.attempt and a.mode is not None and a.mode is b.mode:
                gaps[a.mode].append((b.started_ns - a.started_ns) / 1e9)
        restore += [x for i in tl.interruptions if (x := i.restore_s) is not None]
        for i in tl.interruptions:
            if i.training_ns is None or i.relaunched_ns is None or i.up_ns is None or i.up_ns < i.relaunched_ns:
                continue
            relaunch.append((i.up_ns - i.relaunched_ns) / 1e9)
            reload.append(max(0, (i.restored_ns or i.training_ns) - i.up_ns) / 1e9)
            if i.restored_ns is not None:
                gate.append(max(0, i.training_ns - i.restored_ns) / 1e9)
        startup.append(max(0.0, tl.startup_s - sum(x for a, x in tl.loads if a == 0)))
        load += [x for _, x in tl.loads]
        interruptions += len(tl.interruptions) + (1 if _ended_short(tl) else 0)
        span = (tl.ended_ns - tl.started_ns) / 1e9
        wall_s += span
        rank_s += span * tl.ranks
        ranks = max(ranks, tl.ranks)
    any_save = any([sync, pause])
    no_ckpt = "no checkpoint was saved in these runs" if not any_save else ""
    return MeasuredCosts(
        runs=tuple(runs),
        sync_save=_mean(sync, no_ckpt or "every save was asynchronous"),
        async_pause=_mean(pause, no_ckpt or "every save was synchronous"),
        async_write=_mean(write, no_ckpt or "every save was synchronous"),
        restore=_mean(restore, "no failure was recovered in these runs"),
        relaunch=_mean(relaunch, "no relaunch in these runs records its start and its processes' start events"),
        reload=_mean(reload, "no relaunch in these runs records its start and its processes' start events"),
        gate=_mean(gate, "no relaunch in these runs loaded a checkpoint"),
        startup=_mean(startup, ""),
        load=_mean(load, "no checkpoint was loaded in these runs"),
        sync_interval=_median(gaps[SaveMode.SYNC], no_ckpt or "no two committed synchronous saves in one attempt"),
        async_interval=_median(gaps[SaveMode.ASYNC], no_ckpt or "no two committed asynchronous saves in one attempt"),
        interruptions=interruptions, wall_hours=wall_s / 3600, ranks=ranks, rank_hours=rank_s / 3600,
        warnings=tuple(warnings))


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingLeft:
    """The training time left in a run at its current pace (`training_left`)."""

    run_dir: Path
    declared_steps: int | None
    """The step count the latest launch declares (run.json's "steps"); None: it declares none (the time left is
    unknown)."""
    attempt: int
    """The attempt whose progress and pace are taken: the latest that completed a step."""
    last_step: int
    """The last step it completed."""
    step_s: float
    """Its median step time as the job saw it (`timeline.StepSlice`: the latest rank's end of one step to the latest
    rank's end of the next)."""

    @property
    def steps(self) -> int | None:
        """Steps left: the declared count less steps 0 to `last_step`."""
        return None if self.declared_steps is None else max(0, self.declared_steps - self.last_step - 1)

    @property
    def seconds(self) -> float | None:
        return None if (n := self.steps) is None else n * self.step_s

    def describe(self) -> str:
        if self.declared_steps is None:
            return (f"{self.run_dir}: the latest launch in run.json declares no step count (\"steps\"): the training "
                    "time left is unknown")
        return (f"training left: {self.steps} step(s) (declared {self.declared_steps}, attempt {self.attempt} "
                f"completed step {self.last_step}) x its median step {self.step_s:.3f} s = {self.seconds or 0.0:.1f} s")


def training_left(run_dir: Path | str) -> TrainingLeft:
    """What is left of the run's declared steps after the latest attempt that trained, at that attempt's median step
    time. RunDirError / NoDataError as `timeline.timeline`."""
    tl = timeline(run_dir)
    attempt = max(s.attempt for s in tl.slices)
    mine = [s for s in tl.slices if s.attempt == attempt]
    return TrainingLeft(run_dir=tl.run_dir, declared_steps=tl.declared_steps, attempt=attempt,
                        last_step=max(s.step for s in mine), step_s=statistics.median(s.seconds for s in mine))


# -------------------------------------------------------------------------------------------------------- advice


@dataclass(frozen=True, kw_only=True, slots=True)
class AdviceRow:
    """The interval advice for one rank count and one kind of save."""

    ranks: int
    mode: SaveMode
    job_mtbf_s: float
    """The job's MTBF at `ranks` (`interval.job_mtbf_s` of the per-device MTBF)."""
    save_s: float
    """The blocking save cost used."""
    young_daly_s: float
    """Daly's higher-order Young/Daly interval (compute seconds between saves)."""
    advised_s: float
    """`interval.advised_interval`: the model's optimum."""
    current_s: float | None
    """The current compute interval (the measured one less the save), None when not measured."""
    current: IntervalFigures | None
    """Expected figures at the current interval; None when it or the restore cost is not measured."""
    advised: IntervalFigures | None
    """Expected figures at the advised interval; None when the restore cost is not measured."""
    why: str = ""
    """Why the expected figures are None, where they are."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Advice:
    """Checkpoint-interval advice from measured costs (`advise`)."""

    costs: MeasuredCosts
    device_mtbf_s: float | None
    """The per-device MTBF the rows scale (None: none known, and no rows)."""
    rate: str
    """Where the failure rate comes from, one line."""
    caveats: tuple[str, ...]
    """What weakens the figures (few failures seen, injected faults, an unmeasured cost)."""
    rows: tuple[AdviceRow, ...]

    def describe(self) -> list[str]:
        lines = [*self.costs.describe(), f"failure rate: {self.rate}"]
        lines += [f"  note: {c}" for c in self.caveats]
        if not self.rows:
            return lines
        lines.append(f"  {'ranks':>6} {'save':>5} {'job MTBF':>9} {'Young/Daly':>11} {'advised':>9}   at     "
                     f"{'interval':>9} {'lost':>7} {'save':>7} {'restart':>7} {'goodput':>7}")
        lines.append("  (intervals: compute seconds between saves; lost, save, restart: expected shares of wall time)")
        for r in self.rows:
            head = (f"  {r.ranks:>6} {r.mode:>5} {_dur(r.job_mtbf_s):>9} {_dur(r.young_daly_s):>11} "
                    f"{_dur(r.advised_s):>9}")
            for name, tau, fig in (("current", r.current_s, r.current), ("advised", r.advised_s, r.advised)):
                figs = (f"   unknown ({r.why})" if fig is None else
                        f" {fig.lost_share:7.3%} {fig.save_share:7.3%} {fig.restart_share:7.3%} {fig.goodput:7.3%}")
                lines.append(f"{head}   {name:<7}{'-' if tau is None else _dur(tau):>9}" +
                             (figs if tau is not None else "   unknown (current interval not measured)"))
                head = " " * len(head)
        return lines

    def to_dict(self) -> dict[str, Any]:
        def figs(f: IntervalFigures | None) -> dict[str, float] | None:
            return None if f is None else {"interval_s": f.interval_s, "lost_share": f.lost_share,
                                           "save_share": f.save_share, "restart_share": f.restart_share,
                                           "goodput": f.goodput, "lost_per_interruption_s": f.lost_per_interruption_s}

        return {"costs": self.costs.to_dict(), "device_mtbf_s": self.device_mtbf_s, "rate": self.rate,
                "caveats": list(self.caveats),
                "rows": [{"ranks": r.ranks, "mode": str(r.mode), "job_mtbf_s": r.job_mtbf_s, "save_s": r.save_s,
                          "young_daly_s": r.young_daly_s, "advised_s": r.advised_s, "current_s": r.current_s,
                          "current": figs(r.current), "advised": figs(r.advised)} for r in self.rows]}


def _dur(s: float) -> str:
    """A duration in one unit, at most 9 characters, up to days: a cell of the advice table (`views.story.duration`
    writes two units for prose, and no days)."""
    if s < 0.01:
        return f"{s * 1e3:.2f} ms"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h" if s < 172_800 else f"{s / 86_400:.1f} d"


def advise(costs: MeasuredCosts, *, device_mtbf_hours: float | None = None,
           ranks: Sequence[int] = DEFAULT_RANKS) -> Advice:
    """The Young/Daly and the advised checkpoint interval, and the expected lost work, save and restart overhead and
    goodput at the current and the advised interval (`analytics.interval`), for each rank count (`ranks` and the
    runs' own) and each kind of save the runs measured. The per-device MTBF is `device_mtbf_hours`, else the runs'
    interruptions per rank-hour; either is scaled to each rank count as independent device failures."""
    if device_mtbf_hours is not None and not device_mtbf_hours > 0:
        raise ValueError(f"--mtbf-hours {device_mtbf_hours}: must be > 0")
    if any(n < 1 for n in ranks):
        raise ValueError(f"--ranks {list(ranks)}: every rank count must be >= 1")
    caveats: list[str] = []
    device: float | None
    if device_mtbf_hours is not None:
        device = device_mtbf_hours * 3600
        rate = f"given: a per-device MTBF of {device_mtbf_hours:g} h, scaled to each rank count as device MTBF / ranks"
    elif costs.interruptions:
        device = costs.device_mtbf_s
        n = costs.interruptions
        rate = (f"observed: {n} interruption(s) in {costs.wall_hours * 3600:.1f} s of job wall time "
                f"({costs.rank_hours * 3600:.1f} rank-seconds): a job MTBF of {_dur(costs.job_mtbf_s or 0)} at "
                f"{costs.ranks} ranks; per device, rank-seconds / interruptions = {_dur(device or 0)}, scaled to each "
                "rank count as device MTBF / ranks")
        if n < WEAK_RATE_BELOW:
            caveats.append(f"only {n} interruption(s) seen: a weak estimate of the rate (relative standard error "
                           f"1/sqrt({n}) = {1 / n ** 0.5:.0%}); give --mtbf-hours for a fleet's per-device MTBF")
        caveats.append("interruptions in these runs may be injected faults (drills, canaries), not the hardware's "
                       "failure rate")
    else:
        device = None
        rate = "unknown: no interruption in these runs and no --mtbf-hours given"
    if costs.restore.seconds is None and device is not None:
        caveats.append(f"restore cost not measured ({costs.restore.why}): the intervals stand (the restore cost "
                       "does not move them), the expected shares are unknown")
    rows: list[AdviceRow] = []
    modes = [(SaveMode.SYNC, costs.sync_save.seconds, 0.0, costs.sync_interval.seconds),
             (SaveMode.ASYNC, costs.async_pause.seconds, costs.async_write.seconds or 0.0,
              costs.async_interval.seconds)]
    if device is not None:
        for n in sorted({*ranks, costs.ranks}):
            mtbf = job_mtbf_s(device, n)
            for mode, save, write, interval in modes:
                if save is None or save <= 0:
                    continue
                current = interval - save if interval is not None and interval > save else None
                restore = costs.restore.seconds
                ic = IntervalCosts(save_s=save, restore_s=restore or 0.0, mtbf_s=mtbf, async_write_s=write)
                why = "" if restore is not None else "restore cost not measured"
                try:
                    got: IntervalAdvice | None = interval_advice(ic, current_s=current)
                except OverflowError:  # e^(R/M) past a float: a restart far longer than the MTBF
                    got, why = None, (f"a restore of {_dur(restore or 0)} against a job MTBF of {_dur(mtbf)}: the "
                                      "job would not get past its restarts")
                # the restore cost does not move the optimum (`interval`): found without it, it cannot overflow
                best = advised_interval(replace(ic, restore_s=0.0))
                rows.append(AdviceRow(
                    ranks=n, mode=mode, job_mtbf_s=mtbf, save_s=save, young_daly_s=young_daly_interval(save, mtbf),
                    advised_s=best, current_s=current, current=got.current if got is not None and not why else None,
                    advised=got.advised if got is not None and not why else None, why=why))
        if not rows:
            caveats.append(f"no save cost measured ({costs.sync_save.why}): no interval to advise")
    return Advice(costs=costs, device_mtbf_s=device, rate=rate, caveats=tuple(caveats), rows=tuple(rows))
