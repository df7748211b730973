"""The rankwatch incident dashboard: `streamlit run dashboard/app.py -- RUN_DIR [RUN_DIR ...]`.

Every figure is one `rankwatch.analytics.views` computes; the pages only draw it. With several runs, the sidebar
picks the one the pages show; the Runs page localizes recurring faults across all of them. The URL carries the run
(`?run=NAME`) and the incident (`/incidents?run=NAME&incident=ID`), so a link from an alert lands on a first visit; a
link that names only the incident opens the run that has it.

The pages live in `screens/`, not `pages/`: Streamlit treats a `pages/` folder beside the main script as its older
multipage layout, and a first visit to any non-root URL then listed the files instead of this navigation.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rankwatch.dashboard import data
from rankwatch.dashboard.ui import USAGE

_PAGES = Path(__file__).with_name("screens")
PAGES = (  # (file, title, url_path, icon); the first is the landing page, at "/"
    ("overview.py", "Overview", "overview", ":material/emergency:"),
    ("progress.py", "Progress", "progress", ":material/monitoring:"),
    ("incidents.py", "Incidents", "incidents", ":material/warning:"),
    ("heatmap.py", "Heatmap", "heatmap", ":material/grid_on:"),
    ("stragglers.py", "Stragglers", "stragglers", ":material/speed:"),
    ("collectives.py", "Collectives", "collectives", ":material/sync_alt:"),
    ("topology.py", "Topology", "topology", ":material/lan:"),
    ("breakdown.py", "Time breakdown", "breakdown", ":material/stacked_bar_chart:"),
    ("timeline.py", "Timeline", "timeline", ":material/timeline:"),
    ("runs.py", "Runs", "runs", ":material/compare_arrows:"),
)


_RUN = "run"


def _from_link(runs: list[str], names: dict[str, str]) -> None:
    """The run a link names wins over the widget's state; a link naming only an incident picks the run that has it."""
    want = st.query_params.get(_RUN)
    if want not in names and "incident" in st.query_params:
        run = data.run_with_incident(runs, st.query_params["incident"])
        want = next((n for n, p in names.items() if p == run), None)
    if want in names and st.session_state.get(_RUN) != want:
        st.session_state[_RUN] = want


def _run_changed() -> None:
    st.query_params.pop("incident", None)  # an incident id is one run's


def _sidebar(runs: list[str]) -> None:
    names = data.run_names(runs)
    _from_link(runs, names)
    with st.sidebar:
        name = next(iter(names))
        if len(names) > 1:
            name = st.selectbox("Run", list(names), key=_RUN, on_change=_run_changed,
                                help="The run the pages show; the Runs page compares all of them.")
        st.query_params[_RUN] = name
        run = names[name]
        data.set_current_run(run)
        st.caption(f"Run folder: `{run}`")
        if st.button("Re-analyse if the telemetry changed", key="reanalyse"):
            try:
                with st.spinner("Analysing…"):
                    data.reanalyse(run)
            except ValueError as exc:
                st.error(str(exc))


def main() -> None:
    st.set_page_config(page_title="rankwatch", page_icon=":material/monitoring:", layout="wide")
    pages = [st.Page(_PAGES / f, title=t, url_path=u, icon=i, default=(n == 0))
             for n, (f, t, u, i) in enumerate(PAGES)]
    nav = st.navigation(pages)
    runs = data.run_dirs()
    if not runs:
        st.error(USAGE)
        st.stop()
    _sidebar(runs)
    nav.run()


main()
