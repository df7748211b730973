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
    else:
        st.caption("Nothing is quarantined.")


main()
