"""Progress: the run at a glance and per rank its last step, heartbeat age and step rate — live while the run is
being written, else the stored progress view."""

from __future__ import annotations

import time

import polars as pl
import streamlit as st

from rankwatch.analytics import views
from rankwatch.dashboard import data, ui

_LIVE_EVERY_S = 5
_COLUMNS = ("rank", "host", "dp", "tp", "pp", "attempt", "last_step", "steps_per_s", "heartbeat_age_s",
            "step_age_s", "device_uuid")


def _summary(store: views.ViewStore) -> None:
    s = store.summary
    layout = " x ".join(f"{k}={v}" for k, v in s.layout.items()) or "unknown layout"
    a, b, c, d, e, f = st.columns(6)
    a.metric("Ranks", f"{s.ranks:,}", help=f"{layout} on {s.hosts} hosts")
    b.metric("Steps", f"{s.first_step}–{s.last_step}")
    c.metric("Step rate", f"{s.steps_per_s:.2f} steps/s", help="Steps of the final trajectory per wall second")
    d.metric("Effective training time", f"{s.effective_s:,.1f} s", help=views.ViewSummary.__doc__)
    e.metric("Goodput", f"{s.goodput:.1%}", help=f"effective training time of {s.wall_s:,.1f} s wall time")
    f.metric("Incidents", len(data.incidents(*data.key(store))),  # the Incidents page's list, counted
             help="the analysis' incidents and those only the live loop's recovery records carry (a fail-stop "
                  "recovered before the part files showed it)")
    st.caption(f"{layout}, {s.hosts} hosts, clock {s.clock}; views built "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.built_wall_ns / 1e9))}")


def _per_rank(df: pl.DataFrame) -> None:
    behind = df.filter(pl.col("last_step") < pl.col("last_step").max()) if df.height else df
    a, b = st.columns(2)
    a.metric("Ranks behind the newest step", behind.height)
    if "heartbeat_age_s" in df.columns and df.height:
        a_max = df["heartbeat_age_s"].max()
        b.metric("Oldest heartbeat", "—" if a_max is None else f"{float(a_max):,.1f} s")  # type: ignore[arg-type]
    ui.table(df.select([c for c in _COLUMNS if c in df.columns]), key="progress_table",
             column_config={"steps_per_s": st.column_config.NumberColumn("steps/s", format="%.2f"),
                            "heartbeat_age_s": st.column_config.NumberColumn("heartbeat age (s)", format="%.1f"),
                            "step_age_s": st.column_config.NumberColumn("last step age (s)", format="%.1f")})


@st.fragment(run_every=_LIVE_EVERY_S)
def _live(store: views.ViewStore) -> None:
    try:
        live = data.live_progress(*data.key(store))
    except ValueError as exc:
        st.warning(f"Live progress unavailable ({exc}); showing the stored view.")
        live = store.frame("progress")
    else:
        stored = store.frame("progress")
        topo = stored.select("rank", *[c for c in ("host", "dp", "tp", "pp", "device_uuid") if c in stored.columns])
        live = live.join(topo, on="rank", how="left") if topo.height else live
    st.caption(f"Live: read from the telemetry every {_LIVE_EVERY_S} s; ages against now "
               f"({time.strftime('%H:%M:%S')}).")
    _per_rank(ui.ns_to_age(live, time.time_ns()))


def main() -> None:
    st.title("Progress")
    store = ui.current_store()
    _summary(store)
    st.subheader("Per rank")
    if data.is_live(*data.key(store)):
        _live(store)
    else:
        st.caption("The run is not being written: ages against its newest record.")
        _per_rank(ui.ns_to_age(store.frame("progress"), store.summary.end_wall_ns))


main()
