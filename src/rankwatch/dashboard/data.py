"""Where the dashboard's figures come from: the run folders it was started with, and `rankwatch.analytics.views`
queries cached per run.

A run's `ViewStore` is a cached resource keyed by the run folder and the time its views were built
(`summary.built_wall_ns`), so a re-analysis opens a new one; the frames arranged from it are cached data under the
same key. What the recovery manager and the lineage write beside the telemetry (decisions, lineage, quarantine) can
change while the views stay, so those are cached for a few seconds only.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import polars as pl
import streamlit as st

from rankwatch.analytics import views

from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.errors import RunDirError
from rankwatch.analytics.incidents import Incident, sort_incidents
from rankwatch.analytics.localize import Localization

RUNS_ENV = "RANKWATCH_DASHBOARD_RUNS"
"""Run folders, `os.pathsep`-separated, when none are given after `--` on the command line."""
LIVE_ENV = "RANKWATCH_DASHBOARD_LIVE_S"
"""A run whose telemetry changed within this many seconds (default 60) is shown live."""
APP = Path(__file__).with_name("app.py")
_RUN_KEY = "current_run"
_FILES_TTL_S = 5


def run_dirs(argv: Sequence[str] | None = None) -> list[str]:
    """The run folders after streamlit's `--` (sys.argv is the app's only under `streamlit run`), else those in
    `RANKWATCH_DASHBOARD_RUNS`."""
    argv = sys.argv if argv is None else argv
    if len(argv) > 1 and Path(argv[0]).resolve() == APP.resolve():
        return list(argv[1:])
    return [p for p in os.environ.get(RUNS_ENV, "").split(os.pathsep) if p.strip()]


def run_names(runs: Sequence[str]) -> dict[str, str]:
    """What a URL calls each run (`?run=NAME`): its folder's name, or the whole path where two runs share a name."""
    names = [Path(p).name or p for p in runs]
    return {(n if names.count(n) == 1 else p): p for n, p in zip(names, runs)}


def run_with_incident(runs: Sequence[str], incident_id: str) -> str | None:
    """The first run (of those whose views are stored) that has the incident: a link that names only the incident
    lands on its run."""
    for run in runs:
        have = views.stored_views(run)
        if have is not None and any(i.id == incident_id for i in incidents(run, have.summary.built_wall_ns)):
            return run
    return None


def set_current_run(run_dir: str) -> None:
    st.session_state[_RUN_KEY] = run_dir


def current_run() -> str:
    run = st.session_state.get(_RUN_KEY)
    if isinstance(run, str):
        return run
    runs = run_dirs()
    return runs[0] if runs else ""


@st.cache_resource(max_entries=32, show_spinner=False)
def _store(run_dir: str, built_wall_ns: int) -> views.ViewStore:
    store = views.stored_views(run_dir)
    if store is None:
        raise RunDirError(f"{run_dir}: its views vanished while the dashboard opened them")
    return store


def open_store(run_dir: str) -> views.ViewStore:
    """The run's stored views, built once by an analysis when none are stored. Raises `ValueError` (an
    `AnalyticsError`, one line) for a run that cannot be read."""
    have = views.stored_views(run_dir)
    if have is None:
        with st.spinner(f"Analysing {run_dir}: the first open builds the run's views and stores them…"):
            have = ensure_views(run_dir)
    return _store(run_dir, have.summary.built_wall_ns)


def reanalyse(run_dir: str) -> None:
    """Build the run's views again when its telemetry changed since they were built."""
    ensure_views(run_dir, refresh=True)


def key(store: views.ViewStore) -> tuple[str, int]:
    """What cached figures of one run are keyed by."""
    return str(store.run_dir), store.summary.built_wall_ns


def is_live(run_dir: str, built: int) -> bool:
    """The telemetry grew since the views were built, or was written within `RANKWATCH_DASHBOARD_LIVE_S` by a run
    not every rank of which had exited when the views were built."""
    return _is_live(run_dir, built, float(os.environ.get(LIVE_ENV, "60")))


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def _is_live(run_dir: str, built: int, recent_s: float) -> bool:
    sig = views.telemetry_signature(run_dir)
    summary = _store(run_dir, built).summary
    if sig != summary.signature:
        return True
    return not summary.ended and time.time_ns() - sig[2] < recent_s * 1e9


@st.cache_data(ttl=2, max_entries=16, show_spinner=False)
def live_progress(run_dir: str, built: int) -> pl.DataFrame:
    """Progress read from the telemetry written since the views (merged over their stored progress)."""
    return views.live_progress(run_dir, since=_store(run_dir, built))


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def incidents(run_dir: str, built: int) -> tuple[Incident, ...]:
    """The analysis' incidents, then those only the recovery records carry (the live loop's)."""
    return sort_incidents(views.run_incidents(_store(run_dir, built)))


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def decisions(run_dir: str) -> pl.DataFrame:
    return views.decisions(run_dir)


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def lineage(run_dir: str) -> pl.DataFrame:
    return views.lineage(run_dir)


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def quarantine(run_dir: str) -> pl.DataFrame:
    return views.quarantine(run_dir)


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def incident_table(run_dir: str, built: int) -> pl.DataFrame:
    """The incident table with each incident's mark (`#`, `color`: the same on every page), state, decision in words
    and next step (`views.incident_states`), and when it was detected as a local time."""
    found = incidents(run_dir, built)
    table = views.incident_table(found, decisions(run_dir), _store(run_dir, built).summary.start_wall_ns)
    states = views.incident_states(found, decisions(run_dir), run_dir)
    marks = views.incident_marks(found)
    when = pl.DataFrame({"id": [i.id for i in found], "#": [marks[i.id].label for i in found],
                         "color": [marks[i.id].color for i in found],
                         "since": [views.local_time(i.detection_wall_ns)[5:] for i in found]}, schema={
        "id": pl.String, "#": pl.String, "color": pl.String, "since": pl.String})
    return table.drop("decision", "status").join(states, on="id", how="left").join(when, on="id", how="left")


def fail_stop_story(run_dir: str, built: int, incident: Incident) -> views.FailStopStory:
    return views.fail_stop_story(_store(run_dir, built), incident, decisions(run_dir), lineage(run_dir))


def incident_detail(run_dir: str, built: int, incident: Incident) -> views.IncidentDetail:
    return views.incident_detail(_store(run_dir, built), incident, decisions(run_dir))


@st.cache_data(max_entries=64, show_spinner=False)
def heatmap(run_dir: str, built: int, metric: str) -> pl.DataFrame:
    return views.heatmap(_store(run_dir, built), metric)


@st.cache_data(max_entries=64, show_spinner=False)
def grid(run_dir: str, built: int, metric: str) -> pl.DataFrame:
    return views.grid(_store(run_dir, built), metric)


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def topology_status(run_dir: str, built: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    return views.topology_status(_store(run_dir, built), incidents(run_dir, built), quarantine(run_dir))


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def timeline(run_dir: str, built: int) -> pl.DataFrame:
    return views.timeline(_store(run_dir, built), incidents(run_dir, built), decisions(run_dir), lineage(run_dir))


@st.cache_data(ttl=_FILES_TTL_S, max_entries=64, show_spinner=False)
def comparability_line(run_dir: str, built: int) -> tuple[bool, str]:
    c = views.comparability(run_dir, incidents(run_dir, built))
    return c.bitwise, c.line()


@st.cache_data(ttl=_FILES_TTL_S, max_entries=16, show_spinner=False)
def across_runs(keys: tuple[tuple[str, int], ...]) -> tuple[Localization, ...]:
    return views.across_runs([_store(run_dir, built) for run_dir, built in keys])
