"""Timeline: incidents, decisions, restarts, checkpoints saved and loaded, lineage — and whether the trajectory
stayed comparable."""

from __future__ import annotations

import streamlit as st

from rankwatch.dashboard import charts, data, ui


def main() -> None:
    st.title("Timeline")
    store = ui.current_store()
    k = data.key(store)
    bitwise, line = data.comparability_line(*k)
    (st.success if bitwise else st.warning)(f"Comparability: {line}")
    tl = data.timeline(*k)
    if not tl.height:
        st.info("Nothing happened to this run.")
        return
    st.altair_chart(charts.timeline(tl), key="timeline_chart")
    ui.table(tl, key="timeline")


main()
