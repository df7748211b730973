"""Incidents: the run's incidents, most consequential first; one selected (the selectbox, or a deep link
`?run=<name>&incident=<id>`) opens what its class needs: a fail-stop or hang is told from the kill to the replay
(who stopped first and how, how the others ended and where they waited, the decision, the recovery, the steps trained
again); a straggler shows its compute against its peers over the whole episode with the counters and arrivals behind
it; then the decision's path through the recovery gates and the evidence rows. Sections that do not apply to the
class are not shown."""

from __future__ import annotations

import polars as pl
import streamlit as st

from rankwatch.analytics import views
from rankwatch.analytics.incidents import Incident, IncidentClass
from rankwatch.dashboard import charts, data, ui

_KEY = "incident"
# what fits 1440 px beside the sidebar: the id is the selectbox's, steps and confidence the detail's (a bare string
# here would be drawn on the page: Streamlit's magic writes every expression statement)
_TABLE = ("#", "class", "subject", "since", "state", "decision", "cause", "summary")
_STRAGGLING = (IncidentClass.STRAGGLER, IncidentClass.IMBALANCE, IncidentClass.UNCLASSIFIED)


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
        if d["path"]:
            st.markdown("How it was decided:\n" + "\n".join(f"{n}. {w}" for n, w in enumerate(
                views.path_words(d["path"]), 1)))
            st.caption("Recorded path: " + " → ".join(f"`{p}`" for p in d["path"]))
        else:
            st.markdown("How it was decided: not recorded")
        if d["reasons"]:
            st.markdown("Why:\n" + "\n".join(f"- {r}" for r in d["reasons"]))
        if d["comparability"]:
            st.caption(f"Lineage verdict: {d['comparability']}"
                       + (f" (changed: {', '.join(d['changed'])})" if d["changed"] else ""))


def _story(store: views.ViewStore, inc: Incident) -> None:
    story = data.fail_stop_story(*data.key(store), inc)
    st.subheader("What happened")
    st.markdown("\n".join(f"- {line}" for line in story.lines()))
    _section("How each rank ended, in order", story.stops.drop("wall_ns"), "incident_stops",
             "No rank's end was recorded.")
    _section("Where the others were left waiting", story.waits, "incident_waits",
             "No collective was left open or ended in an error.")


def _straggling(store: views.ViewStore, inc: Incident, det: views.IncidentDetail) -> None:
    st.markdown("**Compute time and lateness of the subject against its stage peers' median, over the episode** "
                "(in lockstep training every rank's step takes as long as the slowest's: a straggler shows in its "
                "compute, and the others wait for it)")
    if det.series.height:
        st.altair_chart(charts.series(det.series, x="step", columns=["compute_ms", "late_ms"], color="who"),
                        key="incident_series")
    else:
        st.caption("No step rows in the episode.")
    if det.gpu.filter(pl.col("who") == "subject").height:
        _section("GPU counters against the median GPU", det.gpu, "incident_gpu", "")
    _section("Collective arrivals (leaderboard rows of the subject and its peers)", det.arrivals,
             "incident_arrivals", "No collective arrivals.")


def _detail(store: views.ViewStore, inc: Incident, mark: str) -> None:
    st.header(f"Incident {inc.id}")
    st.markdown(f"{mark} **{inc.klass}** on `{inc.subject}` — {views.readable_text(inc.summary)}")
    a, b, c, d = st.columns(4)
    a.metric("Cause", str(inc.cause))
    b.metric("Onset step", "—" if inc.onset_step is None else inc.onset_step)
    c.metric("Detected at step", "—" if inc.detection_step is None else inc.detection_step,
             help=f"at {views.local_time(inc.detection_wall_ns)}")
    d.metric("Confidence", f"{inc.confidence:.2f}")
    if inc.fields or inc.hardware:
        st.caption("Abnormal: " + views.readable_text(", ".join([*inc.fields, *map(str, inc.hardware)])))
    if inc.impact is not None:
        st.markdown("**What it cost:** " + views.readable_text(inc.impact.describe() + (
            f" (S = {inc.impact.slowdown:.3f} with only it slow)" if inc.impact.slowdown is not None else "")
            + (f"; {inc.impact.note}" if inc.impact.note and inc.impact.lost_s is not None else "")))
    det = data.incident_detail(*data.key(store), inc)
    if views.is_fail_stop(inc):
        _story(store, inc)
    elif inc.klass in _STRAGGLING:
        _straggling(store, inc, det)
    if det.links.height:
        _section("Links involved", views.readable(det.links), "incident_links", "")
    if det.checkpoints.height and (inc.klass is IncidentClass.CHECKPOINT or str(inc.cause) == "checkpoint_io"):
        _section("Checkpoint phases around the onset", views.readable(det.checkpoints), "incident_checkpoints", "")
    if inc.klass in (IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION):
        _section("Fingerprints that disagree", det.fingerprints, "incident_fingerprints", "Every fingerprint agrees.")
    _decisions(det.decisions, str(store.run_dir))
    with st.expander(f"Evidence rows ({len(inc.evidence)} item(s))", expanded=not views.is_fail_stop(inc)):
        if not inc.evidence:
            st.caption("The detector attached no evidence rows.")
        for n, ev in enumerate(inc.evidence):
            st.markdown(f"`{ev.source}` — {views.readable_text(ev.summary)}")
            if ev.rows:
                st.dataframe(views.readable(ui.evidence_frame(ev)), key=f"incident_evidence_{n}", hide_index=True,
                             width="stretch")


def main() -> None:
    st.title("Incidents")
    store = ui.current_store()
    table = data.incident_table(*data.key(store))
    if not table.height:
        st.success("No incidents: nothing in this run needs a look.")
        return
    ui.table(table.select(_TABLE), key="incident_table", column_config={  # 960 px: the main area at 1440 px
        "#": st.column_config.TextColumn(width=40, help="the incident's number in this run, on every page"),
        "class": st.column_config.TextColumn(width=90), "subject": st.column_config.TextColumn(width=90),
        "since": st.column_config.TextColumn("detected", width=120, help="local time of detection"),
        "state": st.column_config.TextColumn(width=80), "decision": st.column_config.TextColumn(width=200),
        "cause": st.column_config.TextColumn(width=110), "summary": st.column_config.TextColumn(width=230)})
    ids = table["id"].to_list()
    label = dict(zip(ids, (f"{m} {c} {s} — {i}" for i, m, c, s in table.select("id", "#", "class", "subject"
                                                                              ).iter_rows())))
    _follow_link(ids)
    chosen = st.selectbox("Incident", ids, index=None, key=_KEY, placeholder="Choose an incident to see its evidence",
                          format_func=lambda i: label.get(i, i), on_change=_to_link)
    if chosen is None:
        return
    by_id = {i.id: i for i in data.incidents(*data.key(store))}
    mark = table.filter(pl.col("id") == chosen).row(0, named=True)
    _detail(store, by_id[chosen], f":{mark['color']}[**{mark['#']}**]")


main()
