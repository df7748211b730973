"""Incidents: the run's incidents, most consequential first; one selected (the selectbox, or a deep link
`?incident=<id>`) opens the evidence behind it and the decision's path through the recovery gates."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rankwatch.analytics import views
from rankwatch.analytics.incidents import Incident
from rankwatch.dashboard import charts, data, ui

_KEY = "incident"
_TABLE = ("id", "class", "subject", "ranks", "onset_step", "detection_step", "since_s", "confidence", "cause",
          "decision", "status", "summary")


def _follow_link(ids: list[str]) -> None:
    """A deep link (or a changed URL) wins over the widget's state; the widget writes the URL back."""
    want = st.query_params.get(_KEY)
    if want in ids and st.session_state.get(_KEY) != want:
        st.session_state[_KEY] = want


def _to_link() -> None:
    chosen = st.session_state.get(_KEY)
    if chosen:
        st.query_params[_KEY] = chosen
    else:
        st.query_params.pop(_KEY, None)


def _section(title: str, df: pl.DataFrame, key: str, empty: str) -> None:
    st.markdown(f"**{title}**")
    if df.height:
        ui.table(df, key=key)
    else:
        st.caption(empty)


def _decisions(dec: pl.DataFrame, run_dir: str) -> None:
    st.markdown("**Decision**")
    if not dec.height:
        st.caption("No recovery was planned for this incident yet: `rankwatch recover` (or the recovery manager) "
                   "decides one.")
        return
    for d in dec.iter_rows(named=True):
        st.markdown(ui.decision_line(d, run_dir))
        st.markdown("How it was decided: " + " → ".join(f"`{p}`" for p in d["path"]) if d["path"]
                    else "How it was decided: not recorded")
        for r in d["reasons"]:
            st.markdown(f"- {r}")
        if d["comparability"]:
            st.caption(f"Lineage verdict: {d['comparability']}"
                       + (f" (changed: {', '.join(d['changed'])})" if d["changed"] else ""))


def _detail(store: views.ViewStore, inc: Incident) -> None:
    st.header(f"Incident {inc.id}")
    st.markdown(f"**{inc.klass}** on `{inc.subject}` — {inc.summary}")
    a, b, c, d = st.columns(4)
    a.metric("Confidence", f"{inc.confidence:.2f}")
    b.metric("Cause", str(inc.cause))
    c.metric("Onset step", "—" if inc.onset_step is None else inc.onset_step)
    d.metric("Detected at step", "—" if inc.detection_step is None else inc.detection_step)
    if inc.fields or inc.hardware:
        st.caption("Abnormal: " + ", ".join([*inc.fields, *map(str, inc.hardware)]))
    det = data.incident_detail(*data.key(store), inc)
    st.markdown("**Per-step time and lateness against the stage peers' median**")
    if det.series.height:
        st.altair_chart(charts.series(det.series, x="step", columns=["step_ms", "late_ms"], color="who"),
                        key="incident_series")
    else:
        st.caption("No step rows around the onset.")
    _section("GPU counters against the median GPU", det.gpu, "incident_gpu", "No GPU samples.")
    _section("Collective arrivals (leaderboard rows of the subject and its peers)", det.arrivals,
             "incident_arrivals", "No collective arrivals.")
    _section("Links involved", det.links, "incident_links", "No inter-host link involved.")
    _section("Checkpoint phases around the onset", det.checkpoints, "incident_checkpoints",
             "No checkpoint phase around the onset.")
    _section("Fingerprints that disagree", det.fingerprints, "incident_fingerprints", "Every fingerprint agrees.")
    _decisions(det.decisions, str(store.run_dir))
    st.markdown("**Evidence**")
    if not inc.evidence:
        st.caption("The detector attached no evidence rows.")
    for n, ev in enumerate(inc.evidence):
        st.markdown(f"`{ev.source}` — {ev.summary}")
        if ev.rows:
            st.dataframe(ui.evidence_frame(ev), key=f"incident_evidence_{n}", hide_index=True, width="stretch")


def main() -> None:
    st.title("Incidents")
    store = ui.current_store()
    table = data.incident_table(*data.key(store))
    if not table.height:
        st.success("No incidents: nothing in this run needs a look.")
        return
    ui.table(table.select(_TABLE), key="incident_table",
             column_config={"since_s": st.column_config.NumberColumn("since (s into run)", format="%.1f")})
    ids = table["id"].to_list()
    label = dict(zip(ids, (f"{c} {s} — {i}" for i, c, s in table.select("id", "class", "subject").iter_rows())))
    _follow_link(ids)
    chosen = st.selectbox("Incident", ids, index=None, key=_KEY, placeholder="Choose an incident to see its evidence",
                          format_func=lambda i: label.get(i, i), on_change=_to_link)
    if chosen is None:
        return
    by_id = {i.id: i for i in data.incidents(*data.key(store))}
    _detail(store, by_id[chosen])


main()
