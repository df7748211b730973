"""Pieces every page uses: the selected run's views (or its one-line error on the page), paged tables, evidence
rows as a frame."""

from __future__ import annotations

import os
from typing import Any

import polars as pl
import streamlit as st

from rankwatch.analytics import views
from rankwatch.analytics.incidents import Evidence
from rankwatch.dashboard import data

USAGE = ("No run given. Start the dashboard with run folders: `streamlit run dashboard/app.py -- RUN_DIR [RUN_DIR ...]` "
         f"(or set {data.RUNS_ENV}=RUN_A{os.pathsep}RUN_B).")
PAGE_ROWS = 500


def current_store() -> views.ViewStore:
    """The selected run's views. A run that cannot be read shows its one-line message and stops the page."""
    run = data.current_run()
    if not run:
        st.error(USAGE)
        st.stop()
    try:
        store = data.open_store(run)
    except ValueError as exc:
        st.error(f"Cannot open this run: {exc}")
        st.stop()
    for w in store.summary.warnings:
        st.warning(w)
    return store


def table(df: pl.DataFrame, *, key: str, rows: int = PAGE_ROWS, **kwargs: Any) -> None:
    """`df` a page of `rows` at a time: a large frame never goes to the browser whole. Shown as people read it
    (`views.readable`: wall times as local times, nanoseconds as durations, throttle masks by name, no 'None'); an
    epoch in nanoseconds is also past what a browser's numbers hold exactly."""
    if df.height > rows:
        pages = -(-df.height // rows)
        page = int(st.number_input(f"Page (of {pages}, {rows} rows each; {df.height:,} rows)", min_value=1,
                                   max_value=pages, value=1, step=1, key=f"{key}_page"))
        df = df.slice((page - 1) * rows, rows)
    st.dataframe(views.readable(df), key=key, hide_index=True, width="stretch", **kwargs)


def evidence_frame(ev: Evidence) -> pl.DataFrame:
    """An evidence item's rows (JSON scalars, a column may mix types: then shown as text)."""
    cols = list(dict.fromkeys(ev.columns))
    if len(cols) != len(ev.columns):
        cols = [f"{c} ({i})" for i, c in enumerate(ev.columns)]
    try:
        return pl.DataFrame([list(r) for r in ev.rows], schema=cols, orient="row")
    except (TypeError, ValueError, pl.exceptions.PolarsError):
        return pl.DataFrame([[None if v is None else str(v) for v in r] for r in ev.rows], schema=cols, orient="row")


def ns_to_age(df: pl.DataFrame, now_ns: int) -> pl.DataFrame:
    """`df` with heartbeat_age_s and step_age_s against `now_ns`, when it has the times they come from."""
    if {"last_heartbeat_wall_ns", "last_step_end_wall_ns"} <= set(df.columns):
        return views.heartbeat_age(df, now_ns)
    return df


def decision_line(d: dict[str, Any], run_dir: str) -> str:
    """One decision's state, said the same way for every action: what, whether it was carried out, and the command
    that carries out a proposed one."""
    action = views.action_text(d["action"], d["target"])
    if d["status"] == "applied":
        return f"**{action}** — applied (`{d['record']}`): {d['outcome']}"
    if d["action"] == "observe":
        return "**observe** — nothing to apply: the job is left as it is"
    return (f"**{action}** — proposed, not applied (a dry run, `{d['record']}`); to carry it out: "
            f"`rankwatch recover {run_dir} --apply`")
