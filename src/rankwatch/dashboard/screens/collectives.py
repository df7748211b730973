"""Collectives: per process group and rank, the last operation issued and completed; who the others are missing."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rankwatch.dashboard import ui


def main() -> None:
    st.title("Collectives")
    store = ui.current_store()
    df = store.frame("collectives")
    if not df.height:
        st.info("No collective records in this run.")
        return
    missing = df.filter(pl.col("missing"))
    behind = df.filter(pl.col("behind") > 0)
    a, b, c = st.columns(3)
    a.metric("Process groups", df["group"].n_unique())
    b.metric("Ranks missing", missing["rank"].n_unique(), help="behind its group's newest operation and waiting in "
             "none of its groups: the rank the others wait for")
    c.metric("Members behind", behind.height, help="behind the group's newest operation (also ranks blocked in "
             "another group, waiting for a missing rank)")
    st.subheader("Who is missing")
    if missing.height:
        ui.table(missing, key="collectives_missing")
    elif behind.height:
        st.warning("Members are behind, but each waits in another group: no single rank is missing.")
    else:
        st.success("Every member is up to date with its groups.")
    if behind.height:
        st.subheader("Behind (blocked elsewhere or missing)")
        ui.table(behind, key="collectives_behind")
    st.subheader("All groups")
    groups = ["all", *df["group"].unique().sort().to_list()]
    g = st.selectbox("Group", groups, key="group")
    ui.table(df if g == "all" else df.filter(pl.col("group") == g), key="collectives_all")


main()
