"""The live monitor of one run: liveness polls every `poll` seconds, a part-file refresh and re-analysis of the latest
window every `every` seconds, and (with a webhook) each new incident, its resolution and each decision of the
recovery policy sent as a signed message through the durable outbox (`control.sender`).

    Monitor(run_dir, window=20, every=5.0, poll=0.2, say=print).run()          `rankwatch watch` in the foreground
    m = Monitor(run_dir, webhook=url, secret_file=f, load_job=..., say=...); m.run(stop=ev)   a thread (drills)

`tick()` is one pass: one liveness poll, a part-file refresh when one is due, the alerts. `run()` ticks every `poll`
seconds until `count` refreshes were made, `stop` is set, or Ctrl-C. Every incident first seen is kept in `seen`
with the monitor's monotonic clock, so a caller can time detection. Output goes through `say` (progress lines) and
`warn` (warnings, one line each).

Which side decides: the recovery manager (`control.service`). A decision message carries what the monitor's reading
of the policy asks for (the job's declaration read back through `load_job`); the manager re-plans with its own
policy and acts only on what it decides itself.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from rankwatch.analytics.analyze import render_incidents
from rankwatch.analytics.incidents import FaultKey, Incident
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
from rankwatch.analytics.liveness import LivenessMonitor, LivenessView, same_fault
from rankwatch.analytics.queries import topology
from rankwatch.analytics.store import telemetry_dir
from rankwatch.base.rundir import TELEMETRY_DIR, read_recovery_records
from rankwatch.control.manager import catalog_view, plan_recovery
from rankwatch.control.outbox import outbox_path
from rankwatch.control.sender import AlertSender
from rankwatch.control.tracker import AlertTracker
from rankwatch.control.wire import DecisionFields, decision_fields, placements
from rankwatch.recovery.job import JobLoader

__all__ = ["FORGET_AFTER", "Monitor", "Seen", "recovered_incidents"]

FORGET_AFTER = 3
"""Analyses in a row a reported fault must be absent from before the console forgets it (as the alert tracker
resolves one: `TrackerConfig.resolve_after`); the same fault seen later is announced as a new episode."""


def _stdout(msg: str) -> None:
    print(msg, flush=True)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """An incident as the monitor first saw it."""

    at: float
    """time.monotonic() of the tick that first saw it."""
    source: str
    """"live" (the liveness records) or "parts" (the part-file analysis)."""
    incident: Incident


def recovered_incidents(run_dir: Path) -> list[str]:
    """The incident ids the recovery manager's records say it acted on (a record that cannot be read is passed over
    this tick; the next tick reads it again)."""
    return [i for rec in read_recovery_records(run_dir, damaged=[]) for i in rec.incidents]


class _Alerts:
    """Each tick's incidents -> the policy's decisions (when the run records its launch) -> signed messages in the
    durable outbox, delivered by a background sender (`control.sender`)."""

    def __init__(self, run_dir: Path, webhook: str, secret_file: Path, *, load_job: JobLoader | None,
                 say: Callable[[str], None], err: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.load_job = load_job
        self.say, self.err = say, err
        self.sender: AlertSender = AlertSender.open(webhook, secret_file, outbox_path(run_dir),
                                                    say=lambda m: say(f"rankwatch watch: {m}")).start()
        self.tracker: AlertTracker = AlertTracker(run_dir)
        resumed = self.tracker.resume(e.message for e in self.sender.outbox.entries())
        if resumed:
            say(f"rankwatch watch: alerts: {resumed} message(s) of an earlier monitor taken back from the outbox")
        self._layout_said = False

    def _decisions(self, incidents: Sequence[Incident]) -> list[DecisionFields]:
        todo = self.tracker.undecided(incidents)
        if not todo:
            return []
        try:
            if self.load_job is None:
                raise ValueError("no job to read the run's declaration from")
            job = self.load_job(self.run_dir)
        except ValueError as exc:  # not a launched run of a known job (e.g. simulated): incidents only, said once
            if not self._layout_said:
                self.err(f"rankwatch watch: alerts: no decisions sent ({exc})")
                self._layout_said = True
            return []
        plan = plan_recovery(todo, job=job.declaration(), catalog=catalog_view(self.run_dir, job.layout))
        return [decision_fields(d.decision, run_dir=self.run_dir, incidents=[d.incident]) for d in plan.decided]

    def tick(self, incidents: Sequence[Incident], topo: pl.DataFrame, *, analyzed: bool) -> None:
        attempt = int(topo["attempt"].max()) if topo.height else None  # type: ignore[arg-type]
        messages = self.tracker.update(incidents, self._decisions(incidents),
                                       recovered=recovered_incidents(self.run_dir), attempt=attempt,
                                       placement=placements(topo) if topo.height else None, analyzed=analyzed)
        self.sender.submit_all(messages)

    def close(self) -> None:
        self.sender.submit_all(self.tracker.finish())
        self.sender.flush(10.0)
        self.say(f"rankwatch watch: alerts: {self.sender.stats()}")
        self.sender.close()


class Monitor:
    """One run watched live (see the module docstring). ValueError for bad intervals or a webhook without a secret
    file; the alert sender's own errors (a bad URL or secret file) at construction."""

    def __init__(self, run_dir: Path | str, *, window: int = 20, every: float = 5.0, poll: float = 0.2,
                 anomaly: bool = True, webhook: str | None = None, secret_file: Path | str | None = None,
                 load_job: JobLoader | None = None, say: Callable[[str], None] = _stdout,
                 warn: Callable[[str], None] = _stderr) -> None:
        if poll <= 0 or every < 0:
            raise ValueError(f"--poll {poll:g} must be > 0 and --every {every:g} >= 0 seconds")
        if bool(webhook) != bool(secret_file):
            raise ValueError("--webhook and --secret-file go together")
        self.run_dir = Path(run_dir)
        self.window, self.every, self.poll = window, every, poll
        self.webhook = webhook
        self._say, self._warn = say, warn
        self.live = LiveAnalyzer(self.run_dir, LiveConfig(window_steps=window, anomaly=anomaly))
        self.liveness = LivenessMonitor(self.run_dir)
        self._alerts = (_Alerts(self.run_dir, webhook, Path(secret_file), load_job=load_job, say=say, err=warn)
                        if webhook and secret_file else None)
        self.reported: dict[FaultKey, int] = {}
        """The faults the part-file analysis reported, each with how many analyses in a row it has been absent from:
        one announced once while it goes on (its id moves with the window), forgotten after `FORGET_AFTER` analyses
        without it (a later one is a new episode)."""
        self._warned: set[str] = set()
        self.window_incidents: tuple[Incident, ...] = ()
        self.view: LivenessView | None = None
        """The latest liveness poll."""
        self.seen: list[Seen] = []
        """Every incident in the order first seen (live ones and new part-file ones)."""
        self._seen_ids: set[str] = set()
        self._contradicted: set[str] = set()
        self.ticks = 0
        """Part-file refreshes made."""
        self._held = 0
        self._next_refresh = 0.0
        self._closed = False

    def _warnings(self, warnings: Sequence[str]) -> None:
        for w in warnings:
            if w not in self._warned:
                self._warn(f"rankwatch watch: warning: {w}")
        self._warned.update(warnings)

    def _note(self, source: str, incidents: Sequence[Incident], at: float) -> None:
        for inc in incidents:
            if inc.id not in self._seen_ids:
                self._seen_ids.add(inc.id)
                self.seen.append(Seen(at=at, source=source, incident=inc))

    def _fresh(self, incidents: Sequence[Incident], live: Sequence[Incident]) -> list[Incident]:
        """Those of this analysis' incidents whose fault is new: not one the analysis already reported and still sees,
        nor one the liveness channel named."""
        now = {i.fault: i for i in incidents}
        fresh = [i for k, i in now.items() if k not in self.reported and not any(same_fault(v, i) for v in live)]
        for k in list(self.reported):
            self.reported[k] = 0 if k in now else self.reported[k] + 1
            if self.reported[k] >= FORGET_AFTER:
                del self.reported[k]
        self.reported.update((k, 0) for k in now)
        return fresh

    def _uncontradicted(self, incidents: Sequence[Incident], view: LivenessView) -> tuple[Incident, ...]:
        """`incidents` less the fail-stops and hangs the liveness poll contradicts (`LivenessView.contradicts`: a rank
        whose part files lag is not a rank gone), each said once."""
        kept: list[Incident] = []
        for inc in incidents:
            why = view.contradicts(inc)
            if why is None:
                kept.append(inc)
            elif inc.id not in self._contradicted:
                self._contradicted.add(inc.id)
                self._say(f"[parts] set aside: {inc.klass} {inc.subject}: {why}")
        return tuple(kept)

    def banner(self) -> str:
        return (f"rankwatch watch: {self.run_dir}, latest {self.window} steps every {self.every:g}s, liveness every "
                f"{self.poll:g}s" + (f", alerts to {self.webhook}" if self._alerts else "") + " (Ctrl-C to stop)")

    def tick(self) -> None:
        """One liveness poll, a part-file refresh when due, the alerts."""

        monitor = self.liveness
        first = monitor.polls == 0 and not monitor.live_dir.is_dir()
        view = monitor.poll()
        now = time.monotonic()
        self.view = view
        if first:  # a run whose collectors write no liveness records (older, or simulated): a note, not a fault
            self._say(f"rankwatch watch: {monitor.live_dir}: no liveness records; fail-stops and hangs are seen at "
                      "the part-file cadence until one appears")
            self._warned.update(view.warnings)
        self._warnings(view.warnings)
        self._note("live", view.new, now)
        for inc in view.new:
            self._say(f"[live] {inc.klass} {inc.subject}: {inc.summary}")
        withdrawn = {i.id for i in view.withdrawn}
        for inc in view.resolved:
            if inc.id in withdrawn:  # a later poll contradicts it (an earlier failure found): it was never the fault
                self._say(f"[live] withdrawn: {inc.klass} {inc.subject}: contradicted by a later poll, not a fault")
            else:
                self._say(f"[live] resolved: {inc.klass} {inc.subject}")
        analyzed = False
        kept: tuple[Incident, ...] | None = None
        if time.monotonic() >= self._next_refresh:
            self._next_refresh = time.monotonic() + self.every
            new_parts = self.live.refresh()
            self._held += new_parts
            self._warnings(self.live.warnings)
            self.live.warnings.clear()
            if not self._held and not self.ticks:
                if self.live.started():
                    self._warn(f"rankwatch watch: warning: {telemetry_dir(self.run_dir)}: no telemetry part file "
                               "read yet — nothing to analyze (still waiting for the run's first flush?)")
                else:
                    self._warn(f"rankwatch watch: warning: {self.run_dir}: no {TELEMETRY_DIR}/ folder yet — "
                               "nothing recorded; waiting for the run's ranks to start")
            if new_parts:
                analysis = self.live.analyze()
                analyzed = True
                self._warnings(analysis.warnings)
                self.window_incidents = analysis.incidents
                kept = self._uncontradicted(self.window_incidents, view)
                fresh = self._fresh(kept, view.incidents)
                self._note("parts", fresh, time.monotonic())
                took = sum(s for _, s in analysis.seconds)
                steps = ("no completed step" if analysis.first_step < 0
                         else f"steps {analysis.first_step}..{analysis.last_step}")
                self._say(f"[{steps}] {new_parts} new part(s), {len(self.window_incidents)} incident(s) in the "
                          f"window, {len(fresh)} new ({took:.1f}s)")
                if fresh:
                    self._say(render_incidents(fresh, width=shutil.get_terminal_size((120, 24)).columns))
            self.ticks += 1
        if self._alerts is not None:
            if kept is None:  # no analysis this tick: the window's incidents against this poll
                kept = self._uncontradicted(self.window_incidents, view)
            confirmed = [i for i in kept if not any(same_fault(v, i) for v in view.incidents)]
            # liveness incidents come every poll, the window's with each analysis: absence is counted in analyses
            self._alerts.tick([*view.incidents, *confirmed], topology(self.live.con), analyzed=analyzed)

    def run(self, count: int | None = None, stop: threading.Event | None = None) -> None:
        """Tick every `poll` seconds until `count` refreshes (None or 0: no limit) or `stop` is set; then close."""
        self._say(self.banner())
        try:
            while stop is None or not stop.is_set():
                self.tick()
                if count and self.ticks >= count:
                    return
                if stop is not None:
                    stop.wait(self.poll)
                else:
                    time.sleep(self.poll)
        finally:
            self.close()

    def sent_bodies(self) -> list[bytes]:
        """The bodies of every message in the outbox (sent or pending), in enqueue order; [] without a webhook."""
        if self._alerts is None:
            return []
        return [e.message.body for e in self._alerts.sender.outbox.entries()]

    def close(self) -> None:
        """Send what is left (resolutions), flush the outbox (up to 10 s), stop the sender. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._alerts is not None:
            self._alerts.close()
