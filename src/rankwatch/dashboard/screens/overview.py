"""Overview, the landing page: what needs a look now. The incidents still open (nothing decided, a proposal not
applied, a recovery that failed), each with its class, subject, since when, cause, decision and next step — the
command to run, or "nothing to do" and why — and a link to its evidence; then the run's goodput and whether its
trajectory stayed comparable; then the incidents already recovered or observed."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rankwatch.analytics import views
from rankwatch.dashboard import data, ui

_NEEDS_A_LOOK = views.PENDING
_CARDS = 8


def _card(row: dict[str, object], run_name: str) -> None:
    with st.container(border=True):
        since = f"since {row['since']}" + (f" ({row['since_s']:.0f} s into the run)"
                                           if isinstance(row["since_s"], float) else "")
        st.markdown(f":{row['color']}[**{row['#']}**] **{row['class']}** on `{row['subject']}` — {since} · cause "
                    f"**{row['cause']}**")
        st.markdown(str(row["summary"]))
        st.markdown(f"Decision: **{row['decision']}** ({row['state']}). Next: {row['next_step']}")
        st.page_link("screens/incidents.py", label="Open its evidence", icon=":material/arrow_forward:",
                     query_params={"run": run_name, "incident": str(row["id"])})


def main() -> None:
    st.title("What needs a look")
    store = ui.current_store()
    s = store.summary
    table = data.incident_table(*data.key(store))
    pending = table.filter(pl.col("state").is_in(_NEEDS_A_LOOK))
    settled = table.filter(~pl.col("state").is_in(_NEEDS_A_LOOK))
    if pending.height:
        st.error(f"{pending.height} incident(s) need a decision or an action; {settled.height} settled.")
    elif settled.height:
        st.success(f"Nothing needs a look now: each of the {settled.height} incident(s) was recovered, "
                   "quarantined or is observed.")
    else:
        st.success("Nothing needs a look: the analysis found no incident in this run.")
    run_name = str(st.query_params.get("run", ""))
    for row in pending.head(_CARDS).iter_rows(named=True):
        _card(row, run_name)
    if pending.height > _CARDS:
        st.caption(f"… and {pending.height - _CARDS} more on the Incidents page.")
    bitwise, line = data.comparability_line(*data.key(store))
    a, b, c, d = st.columns(4)
    a.metric("Goodput", f"{s.goodput:.1%}", help=f"{views.duration(s.effective_s)} of productive training in "
             f"{views.duration(s.wall_s)} from the first launch to the last step (every attempt)")
    b.metric("Run span", views.duration(s.wall_s), help="from the first launch to the last step, across attempts")
    c.metric("Steps", f"{s.first_step}–{s.last_step}", help=f"{s.ranks:,} ranks on {s.hosts} hosts")
    d.metric("Trajectory", "comparable" if bitwise else "CHANGED", help=line)
    if not bitwise:
        st.warning(f"The trajectory changed: {line}")
    if settled.height:
        st.subheader("Recovered, quarantined or observed")
        st.table(settled.select("#", "class", "subject", "since", "cause", "state", "decision", "next_step").rename(
            {"next_step": "next step"}).to_pandas())


main()
