"""The rankwatch incident dashboard: `streamlit run dashboard/app.py -- RUN_DIR [RUN_DIR ...]`.

Every figure is one `rankwatch.analytics.views` computes; the pages only draw it. With several runs, the sidebar
picks the one the pages show; the Runs page localizes recurring faults across all of them.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from rankwatch.dashboard import data
from rankwatch.dashboard.ui import USAGE

_PAGES = Path(__file__).with_name("pages")
PAGES = (  # (file, title, url_path, icon)
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


def _sidebar(runs: list[str]) -> None:
    with st.sidebar:
        run = runs[0]
        if len(runs) > 1:
            run = st.selectbox("Run", runs, key="run", format_func=lambda p: Path(p).name or p,
                               help="The run the pages show; the Runs page compares all of them.")
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
