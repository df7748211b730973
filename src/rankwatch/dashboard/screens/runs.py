"""Runs: localization of recurring faults across the run folders — does it follow the device, the rank, the host
or a link?"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import streamlit as st

from rankwatch.dashboard import data, ui


def main() -> None:
    st.title("Runs")
    runs = data.run_dirs()
    if not runs:
        st.error(ui.USAGE)
        return
    keys = []
    for run in runs:
        try:
            keys.append(data.key(data.open_store(run)))
        except ValueError as exc:
            st.error(f"{Path(run).name}: {exc}")
    st.dataframe(pl.DataFrame({"run": [k[0] for k in keys]}), key="runs", hide_index=True)
    if len(keys) < 2:
        st.info("Localization across runs needs at least two readable runs: "
                "`streamlit run dashboard/app.py -- RUN_A RUN_B`.")
        return
    locs = data.across_runs(tuple(keys))
    if not locs:
        st.success("No fault family recurs across these runs.")
    for n, loc in enumerate(locs):
        st.subheader(f"{loc.klass}: follows {loc.follows}" + (f" {loc.subject}" if loc.subject else ""))
        st.write(loc.summary)
        occ = pl.DataFrame([{"kind": kind, "id": o.id, "implicated": o.implicated, "present": o.present}
                            for kind, group in (("device", loc.by_device), ("rank", loc.by_rank),
                                                ("host", loc.by_host), ("link", loc.by_link)) for o in group],
                           schema={"kind": pl.String, "id": pl.String, "implicated": pl.Int64, "present": pl.Int64})
        st.dataframe(occ, key=f"occurrences_{n}", hide_index=True)
        cand = [c for c in loc.quarantine if c.confidence > 0]
        if cand:
            st.dataframe(pl.DataFrame([{"kind": str(c.kind), "id": c.id, "confidence": c.confidence,
                                        "reason": c.reason} for c in cand]), key=f"quarantine_{n}", hide_index=True)


main()
