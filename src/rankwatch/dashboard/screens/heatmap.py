"""Heatmap: the rank x step matrix of one metric (binned) and the dp x pp grid; a clicked cell, or the rank
input, drills into one rank's step series."""

from __future__ import annotations

from typing import Any

import polars as pl
import streamlit as st

from rankwatch.dashboard import charts, data, ui

# The first is the default: a rank's own work. In step time every rank waits for the slowest in lockstep, so a
# straggler does not stand out there; in compute time it does. (A comment, not a string: Streamlit's magic draws
# every bare expression statement of a page.)
METRICS = ("compute_ms", "late_ms", "step_ms", "wait_ms")
_RANK = "rank"


def _pick(chart_key: str, pick: str, lb: pl.DataFrame) -> None:
    """A clicked heatmap bin or grid cell sets the drilled rank: in a bin of several ranks, its top-scoring one."""
    event: Any = st.session_state.get(chart_key)
    points = (event or {}).get("selection", {}).get(pick) or []
    if not points:
        return
    p = points[0]
    if "rank" in p:
        st.session_state[_RANK] = int(p["rank"])
    elif "rank_lo" in p:
        lo, hi = int(p["rank_lo"]), int(p.get("rank_hi", p["rank_lo"]))
        inside = lb.filter(pl.col("rank").is_between(lo, hi))
        st.session_state[_RANK] = int(inside["rank"][0]) if inside.height else lo


def main() -> None:
    st.title("Heatmap")
    store = ui.current_store()
    k = data.key(store)
    lb = store.frame("leaderboard")
    ranks = max(store.summary.ranks, 1)
    st.session_state.setdefault(_RANK, int(lb["rank"][0]) if lb.height else 0)
    metric = st.selectbox("Metric", METRICS, key="metric", help=(
        "compute_ms: each rank's own work (where a straggler stands out); late_ms: how late it reached the step's "
        "collectives; step_ms: wall time a step (the same on every rank that waits in lockstep); wait_ms: time in "
        "collectives"))
    cells = data.heatmap(*k, metric)
    st.altair_chart(charts.heatmap(cells, metric), key="heatmap_chart", on_select=lambda: _pick(
        "heatmap_chart", charts.HEATMAP_PICK, lb), selection_mode=charts.HEATMAP_PICK)
    st.caption(f"{cells.height:,} cells; each holds the largest {metric} of its ranks and steps.")
    g = data.grid(*k, "score")
    if g.height:
        st.subheader("dp x pp grid (worst tensor-parallel rank's straggler score)")
        st.altair_chart(charts.grid(g, "score"), key="grid_chart", on_select=lambda: _pick(
            "grid_chart", charts.GRID_PICK, lb), selection_mode=charts.GRID_PICK)
    st.subheader("Drill-down")
    r = int(st.number_input("Rank", min_value=0, max_value=ranks - 1, step=1, key=_RANK))
    rows = store.rank(r)
    st.markdown(f"**Rank {r}**: {rows.height} steps")
    if rows.height:
        st.altair_chart(charts.series(rows, x="step", columns=[c for c in METRICS if c in rows.columns]),
                        key="rank_series")
        ui.table(rows, key="rank_rows")


main()
