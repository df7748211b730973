"""Topology: hosts x devices and inter-host links coloured by incident status; quarantined ones marked."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rankwatch.dashboard import charts, data, ui


def main() -> None:
    st.title("Topology")
    store = ui.current_store()
    devices, links = data.topology_status(*data.key(store))
    q = data.quarantine(str(store.run_dir))
    a, b, c = st.columns(3)
    a.metric("Devices with incidents", devices.filter(pl.col("status") != "ok").height)
    b.metric("Links with incidents", links.filter(pl.col("status") != "ok").height)
    c.metric("Quarantined", q.height)
    st.subheader("Hosts x devices")
    if devices.height:
        st.altair_chart(charts.devices(devices), key="devices_chart")
        ui.table(devices, key="devices")
    st.subheader("Inter-host links")
    if links.height:
        st.altair_chart(charts.links(links), key="links_chart")
        ui.table(links, key="links")
    else:
        st.caption("No inter-host links.")
    st.subheader("Quarantine list")
    if q.height:
        ui.table(q, key="quarantine")
    dec = data.decisions(str(store.run_dir))
    proposed = dec.filter((pl.col("action") == "quarantine") & (pl.col("status") == "proposed")) if dec.height else dec
    applied = {f"{k}:{i}" for k, i in q.select("kind", "id").iter_rows()} if q.height else set()
    pending = sorted({str(t) for t in proposed["target"].to_list() if t} - applied)
    if pending:
        st.warning(f"Proposed, not applied: quarantine of {', '.join(pending)} (a dry run); to carry it out: "
                   f"`rankwatch recover {store.run_dir} --apply`")
    if not q.height:
        st.caption("Nothing is quarantined yet." if pending else "Nothing is quarantined.")


main()
