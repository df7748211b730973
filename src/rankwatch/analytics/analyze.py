"""Analyze a run: load its frames, run every detector, and keep one typed incident per thing that went wrong.

`analyze(run_dir)` is what `rankwatch analyze RUN_DIR` runs; `write_analysis` puts the incidents into the run
(`<run>/analysis/incidents.parquet` and `incidents.json`); `render_incidents` is the readable table.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import duckdb

from rankwatch.analytics.anomaly import detect_anomalies
from rankwatch.analytics.corruption import detect_corruption
from rankwatch.analytics.coverage import collective_coverage
from rankwatch.analytics.divergence import detect_divergence, per_rank_notes, per_rank_streams
from rankwatch.analytics.failstop import FailStopConfig, detect_failstops
from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.hardware import attribute_device_faults
from rankwatch.analytics.impact import CostConfig, costed
from rankwatch.analytics.incidents import Incident, IncidentClass, sort_incidents, write_incidents
from rankwatch.analytics.whatif import Replayed, whatif_of
from rankwatch.analytics.localize import RunObservation
from rankwatch.analytics.liveness.posthoc import final_records, merge_records
from rankwatch.analytics.saves import detect_failed_saves
from rankwatch.analytics.queries import groups, load_frames, run_clock, topology
from rankwatch.analytics.replay import detect_replay_divergence
from rankwatch.analytics.store import attach, check_store, materialize, open_run, telemetry_dir
from rankwatch.analytics.straggler import detect_stragglers
from rankwatch.analytics.transient import detect_transient_stalls
from rankwatch.analytics.validate import read_error
from rankwatch.analytics.views import RunViews, build_views, write_views
from rankwatch.base.schema import Table
from typing import Any
from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.views.store import ViewStore, stored_views
from rankwatch.base.rundir import ANALYSIS_DIR



@dataclass(frozen=True, kw_only=True, slots=True)
class AnalysisConfig:
    window_steps: int | None = None
    """Analyze only the latest this many steps (a live window); None = the whole run."""
    anomaly: bool = True
    """Run the anomaly model over what no detector explained."""
    cost: CostConfig = CostConfig()
    """How the what-if costs the incidents and finds stragglers by their cost (`analytics.impact`)."""
    views: bool = False
    """Also build the views people look at (`analytics.views`: the dashboard's and the post-mortem's frames) from
    the frames the analysis loaded; `write_analysis` stores them."""

    def __post_init__(self) -> None:
        if self.window_steps is not None and self.window_steps < 1:
            raise ValueError(f"window_steps {self.window_steps}: must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Analysis:
    run_dir: Path
    incidents: tuple[Incident, ...]
    ranks: int
    first_step: int
    last_step: int
    warnings: tuple[str, ...]
    """One line per part file left out (cut short, unreadable) and per table the detectors need that holds no row,
    naming it."""
    seconds: tuple[tuple[str, float], ...]
    """Wall seconds per stage, in order."""
    views: RunViews | None = None
    """With `AnalysisConfig.views`: what the dashboard and the post-mortem draw."""
    notes: tuple[str, ...] = ()
    """What the detectors took as the job's design rather than a fault, one line each: random streams seeded per
    rank (`divergence.per_rank_notes`)."""
    left_out: tuple[str, ...] = ()
    """Part files the analysis could not read, one line each: its incidents were found without their rows, and a
    recovery must not act on them as if it had them (`policy.hold_on_partial_input`)."""


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


_COLLECTED: ContextVar[list[str] | None] = ContextVar("rankwatch_input_warnings", default=None)


@contextmanager
def input_warnings() -> Iterator[list[str]]:
    """The input warnings of every analysis run inside the block, each once, in order: what a caller surfaces when
    what it calls analyzes for it and keeps only the incidents (`observe_run`, the recovery manager's `assess`)."""
    seen: list[str] = []
    token = _COLLECTED.set(seen)
    try:
        yield seen
    finally:
        _COLLECTED.reset(token)


def _collect(warnings: tuple[str, ...]) -> None:
    seen = _COLLECTED.get()
    if seen is not None:
        seen.extend(w for w in warnings if w not in seen)


def detect_all(frames: Frames, *, anomaly: bool = True, progress: Progress = _quiet,
               timings: list[tuple[str, float]] | None = None, live: bool = False) -> tuple[Incident, ...]:
    """Every detector over one bundle of frames; then the device-fault post-pass (incidents that direct hardware
    evidence pins on one device name it, and failing devices nobody named are raised); the anomaly model last, told
    what the others found."""
    # `live`: the run is still going (a monitor's window of it), so telemetry that ends mid-step is the present,
    # not a job killed from outside (`FailStopConfig.run_over`).
    failstop_config = FailStopConfig(run_over=not live)
    found: list[Incident] = []
    stages: list[tuple[str, Callable[[Frames], tuple[Incident, ...]]]] = [
        ("fail-stop and hang", lambda f: detect_failstops(f, failstop_config)), ("transient stall", detect_transient_stalls),
        ("straggler", detect_stragglers),
        ("divergence", detect_divergence), ("replay verification", detect_replay_divergence),
        ("corruption", detect_corruption), ("failed checkpoint saves", detect_failed_saves),
    ]
    for name, detector in stages:
        t0 = time.perf_counter()
        progress(f"detecting {name}")
        found.extend(detector(frames))
        if timings is not None:
            timings.append((name, time.perf_counter() - t0))
    t0 = time.perf_counter()
    progress("attributing device faults")
    found = list(attribute_device_faults(frames, found))
    if timings is not None:
        timings.append(("device faults", time.perf_counter() - t0))
    if anomaly:
        t0 = time.perf_counter()
        progress("anomaly model")
        found.extend(detect_anomalies(frames, known=tuple(found)))
        if timings is not None:
            timings.append(("anomaly", time.perf_counter() - t0))
    return sort_incidents(found)


def analyze(run_dir: Path | str, *, config: AnalysisConfig = AnalysisConfig(), progress: Progress = _quiet,
            clock: Clock = Clock.AUTO) -> Analysis:
    """Find the incidents of a run. Raises `AnalyticsError` (one line, naming the file) for a run that cannot be
    read or whose rows no collector writes (`validate`); parts that are cut short, and tables the detectors need
    that hold no row, are warnings in the result (and in `input_warnings`). Timing is read from `clock`
    (`queries.run_clock`: AUTO = the device columns where every rank has them; a run where only some ranks have
    them is analysed on the CPU clock, with a warning)."""
    run = Path(run_dir)
    timings: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    progress(f"opening {run}")
    store = open_run(run)
    for w in store.warnings:
        progress(f"warning: {w}")
    since = None
    try:
        if config.window_steps is not None and Table.STEPS in store.tables:
            last = store.con.execute("SELECT max(step) FROM steps").fetchall()[0][0]
            since = None if last is None else max(0, int(last) - config.window_steps + 1)
        progress("reading telemetry" + (f" from step {since}" if since is not None else ""))
        materialize(store, since_step=since)
        found = check_store(store, run, since_step=since)
        clock, mixed = run_clock(store.con, clock, since)
        if clock is Clock.DEVICE:  # the host-side phase times tell a stalled host from a slow device
            store = attach(store, run, Table.PHASES)
        if mixed is not None:
            found = (*found, mixed)
        timings.append(("open", time.perf_counter() - t0))
        t0 = time.perf_counter()
        progress("loading frames" + (f" from step {since}" if since is not None else "") + f", {clock} clock")
        frames = load_frames(con=store.con, since_step=since, clock=clock)
    except duckdb.Error as exc:  # a row guard naming a damaged part, or a read that failed
        raise read_error(exc, telemetry_dir(run)) from None
    records, exits, unread = final_records(run)
    frames, lost = merge_records(frames, records, exits)
    found = (*found, *unread, *lost)
    timings.append(("load", time.perf_counter() - t0))
    try:
        found = (*found, *collective_coverage(store.con, set(store.tables), world_size=frames.world_size))
    except duckdb.Error as exc:
        raise read_error(exc, telemetry_dir(run)) from None
    for w in found:
        progress(f"warning: {w}")
    warnings = (*store.warnings, *found)
    _collect(warnings)
    progress(f"loaded {frames.steps.height} step rows from {frames.world_size} ranks")
    incidents = detect_all(frames, anomaly=config.anomaly, progress=progress, timings=timings)
    t0 = time.perf_counter()
    progress("costing the incidents (what-if)")
    replayed, why = _replayed(store.con, run, frames, incidents, config.cost)
    if replayed is not None:
        for w in replayed.whatif.warnings:
            progress(f"warning: {w}")
        warnings = (*warnings, *replayed.whatif.warnings)
    incidents = costed(frames, incidents, replayed, config=config.cost, why_not=why)
    timings.append(("impact", time.perf_counter() - t0))
    notes = per_rank_notes(per_rank_streams(frames))
    for n in notes:
        progress(f"note: {n}")
    views = None
    if config.views:
        t0 = time.perf_counter()
        progress("building views")
        try:
            views = build_views(frames, incidents, run_dir=run, warnings=warnings, since_step=since, con=store.con)
        except duckdb.Error as exc:
            raise read_error(exc, telemetry_dir(run)) from None
        timings.append(("views", time.perf_counter() - t0))
    return Analysis(
        run_dir=run, incidents=incidents, ranks=frames.world_size, first_step=frames.first_step,
        last_step=frames.last_step,
        warnings=warnings, seconds=tuple(timings), views=views, notes=notes, left_out=store.left_out,
    )


def _replayed(con: duckdb.DuckDBPyConnection, run: Path, frames: Frames, incidents: tuple[Incident, ...],
              config: CostConfig) -> tuple[Replayed | None, str]:
    """The analysed window's what-if, or why there is none (a window no replay can run over is no error of the
    analysis: a run cut short by a failure has its incidents without a cost)."""
    named = sorted({r for i in incidents if i.klass in (IncidentClass.STRAGGLER, IncidentClass.IMBALANCE)
                    for r in i.ranks})
    try:
        return whatif_of(con, run_dir=run, max_ops=config.max_ops, rank_subjects=config.rank_subjects,
                         named=named, clock=frames.clock), ""
    except ValueError as exc:  # WhatIfInputError, or a replay that cannot run to its end
        return None, f"the window was not replayed: {exc}"
    except duckdb.Error as exc:
        raise read_error(exc, telemetry_dir(run)) from None


def observe_run(run_dir: Path | str, *, progress: Progress = _quiet) -> RunObservation:
    """Analyze a run and pair its incidents with the topology they happened on, for `localize`."""
    analysis = analyze(run_dir, progress=progress)
    store = open_run(run_dir)
    try:
        topo, grouped = topology(store.con), groups(store.con)
    except duckdb.Error as exc:
        raise read_error(exc, telemetry_dir(run_dir)) from None
    attempt = int(topo["attempt"].max()) if topo.height else 0  # type: ignore[arg-type]
    return RunObservation(run=str(run_dir), attempt=attempt, incidents=analysis.incidents, topology=topo,
                          groups=grouped)


def write_analysis(analysis: Analysis) -> tuple[Path, Path]:
    """The incidents into `<run>/analysis/` (and the views, when the analysis built them, under
    `<run>/analysis/views/`)."""
    saved = write_incidents(analysis.incidents, analysis.run_dir / ANALYSIS_DIR)
    if analysis.views is not None:
        write_views(analysis.views)
    return saved


def _impact_text(incident: Incident) -> str:
    """'; cost 12.3% of step time over steps 2..29: 0.69 s lost, 0.0008 GPU-hours' where it was measured."""
    if incident.impact is None or incident.impact.lost_s is None:
        return ""
    return "; " + incident.impact.describe()


def _ranks_text(ranks: tuple[int, ...], limit: int = 6) -> str:
    if len(ranks) <= limit:
        return ",".join(map(str, ranks))
    return ",".join(map(str, ranks[:limit])) + f",… ({len(ranks)})"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_incidents(incidents: tuple[Incident, ...] | list[Incident], *, width: int | None = None) -> str:
    """A fixed-width table: class, subject, ranks, onset/detection step, confidence, cause, summary.

    With `width` (a terminal's columns) every line fits it: a long subject (a GPU's UUID), ranks or cause is cut with
    "…" (the full values are in `--json` and the saved incidents), and a summary that does not fit beside the row goes
    under it, wrapped, indented."""
    if not incidents:
        return "no incidents"
    head: tuple[str, ...] = ("class", "subject", "ranks", "onset", "detected", "conf", "cause", "summary")
    rows: list[tuple[str, ...]] = [
        (str(i.klass), str(i.subject), _ranks_text(i.ranks), "-" if i.onset_step is None else str(i.onset_step),
         "-" if i.detection_step is None else str(i.detection_step), f"{i.confidence:.2f}", str(i.cause),
         i.summary + _impact_text(i))
        for i in incidents
    ]
    if width is not None:
        if width < 100:  # at 80 columns: no detection step (it is in --json), narrower cells; the row fits in 76
            keep = (0, 1, 2, 3, 5, 6, 7)
            head = tuple(head[k] for k in keep)
            rows = [tuple(r[k] for k in keep) for r in rows]
            limits: tuple[int, ...] = (14, 16, 10, 7, 4, 14)
        else:
            limits = (18, 24, 14, 8, 8, 4, 18)
        rows = [tuple(_clip(v, n) for v, n in zip(r[:-1], limits)) + (r[-1],) for r in rows]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head) - 1)]
    lines = []
    for r in [head, *rows]:
        fixed = "  ".join(v.ljust(w) for v, w in zip(r[:-1], widths))
        if width is None or len(fixed) + 2 + len(r[-1]) <= width:
            lines.append((fixed + "  " + r[-1]).rstrip())
            continue
        lines.append(fixed.rstrip())
        if r is not head:
            lines.extend(textwrap.wrap(r[-1], width=max(20, width), initial_indent="    ", subsequent_indent="    ",
                                       break_on_hyphens=False))
    return "\n".join(lines)


def ensure_views(run_dir: Path | str, *, refresh: bool = False,
                 progress: Any = None) -> ViewStore:
    """The run's views: the stored ones when they match the telemetry (or, `refresh` False, whatever is stored),
    else an analysis of the run builds and stores them. Raises `AnalyticsError` (one line) for a run that cannot
    be analysed: a missing folder, no telemetry, damaged rows."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"{run}: no such run directory")
    have = stored_views(run)
    if have is not None and not (refresh and have.stale()):
        return have
    from rankwatch.analytics.analyze import AnalysisConfig, analyze

    kwargs = {} if progress is None else {"progress": progress}
    analysis = analyze(run, config=AnalysisConfig(views=True), **kwargs)
    assert analysis.views is not None
    return ViewStore(write_views(analysis.views), run)
