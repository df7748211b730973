"""Time breakdown: per rank, compute / collective wait / dataloader / checkpoint time per step."""

from __future__ import annotations

import streamlit as st

from rankwatch.dashboard import charts, ui

PARTS = ["compute_ms", "collective_wait_ms", "dataloader_ms", "checkpoint_ms"]
_CHART_RANKS = 256


def main() -> None:
    st.title("Time breakdown")
    store = ui.current_store()
    df = store.frame("breakdown")
    if not df.height:
        st.info("No step rows.")
        return
    shown = df if df.height <= _CHART_RANKS else df.sort("step_ms", descending=True).head(_CHART_RANKS)
    if shown.height < df.height:
        st.caption(f"The {_CHART_RANKS} slowest of {df.height:,} ranks (by median step time).")
    st.altair_chart(charts.stacked(shown.fill_null(0.0), x="rank", parts=PARTS), key="breakdown_chart")
    ui.table(df, key="breakdown")


main()
