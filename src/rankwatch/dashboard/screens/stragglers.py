"""Stragglers: the leaderboard, slowest first."""

from __future__ import annotations

import streamlit as st

from rankwatch.dashboard import charts, ui


def main() -> None:
    st.title("Stragglers")
    store = ui.current_store()
    lb = store.frame("leaderboard")
    if not lb.height:
        st.info("No step rows: nothing to rank.")
        return
    top = lb.row(0, named=True)
    a, b, c = st.columns(3)
    a.metric("Slowest rank", top["rank"], help="Highest straggler score")
    b.metric("Its score", f"{top['score']:.2f}", help="median compute / its stage's median (1.0 = typical)")
    c.metric("Ranks named by incidents", lb["incidents"].drop_nulls().len())
    st.altair_chart(charts.bars(lb.head(32), x="rank", y="score"), key="leaderboard_chart")
    ui.table(lb.select("rank", "role", "score", "arrived_last", "late_ms_total", "persistence", "incidents",
                       "compute_ms"), key="leaderboard")


main()
