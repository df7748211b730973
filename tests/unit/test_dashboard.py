"""The Streamlit dashboard through AppTest: every page on a generated run, incident selection (widget and deep
link), unreadable runs as one-line errors, and localization across two runs."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from rankwatch.analytics import views

from rankwatch.analytics.analyze import ensure_views
from rankwatch.dashboard.data import LIVE_ENV, RUNS_ENV
from views_support import STRAGGLER, analyzed_run

APP = Path(__file__).resolve().parents[2] / "src" / "rankwatch" / "dashboard" / "app.py"
PAGES = ("overview", "progress", "incidents", "heatmap", "stragglers", "collectives", "topology", "breakdown", "timeline", "runs")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return analyzed_run(tmp_path_factory.mktemp("dash") / "run")


@pytest.fixture(scope="module")
def straggler_id(run: Path) -> str:
    store = ensure_views(run)
    return next(i.id for i in store.incidents if STRAGGLER in i.ranks)


def _app(monkeypatch: pytest.MonkeyPatch, *runs: Path | str) -> AppTest:
    monkeypatch.setenv(RUNS_ENV, os.pathsep.join(map(str, runs)))
    monkeypatch.setenv(LIVE_ENV, "0")
    return AppTest.from_file(str(APP), default_timeout=60)


def _text(at: AppTest) -> str:
    parts = [e.value for e in (*at.markdown, *at.header, *at.subheader, *at.title, *at.caption, *at.info,
                               *at.error, *at.warning, *at.success)]
    return "\n".join(map(str, parts))


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders(monkeypatch: pytest.MonkeyPatch, run: Path, page: str) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page(f"screens/{page}.py").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error] if page != "runs" else True
    assert at.dataframe or page in ("runs", "overview")


def test_progress_metrics(monkeypatch: pytest.MonkeyPatch, run: Path) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page("screens/progress.py").run()
    labels = {m.label: m.value for m in at.metric}
    assert labels["Ranks"] == "16"
    assert "Effective training time" in labels and "Goodput" in labels
    assert at.dataframe[0].value.shape[0] == 16


def test_a_finished_run_is_not_live_however_recent(monkeypatch: pytest.MonkeyPatch, run: Path) -> None:
    assert ensure_views(run).summary.ended  # every rank recorded its exit
    at = _app(monkeypatch, run)
    monkeypatch.setenv(LIVE_ENV, "3600")
    at.switch_page("screens/progress.py").run()
    assert not at.exception, at.exception
    assert "Live:" not in _text(at) and "not being written" in _text(at)


def test_progress_live_when_telemetry_changed(monkeypatch: pytest.MonkeyPatch, run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ensure_views(copy, refresh=True)
    part = next((copy / "telemetry" / "steps").glob("rank=*"))
    time.sleep(0.01)
    shutil.copy(next(part.glob("*.parquet")), part / "part-new.parquet")  # a rank published a part since
    at = _app(monkeypatch, copy)
    at.switch_page("screens/progress.py").run()
    assert not at.exception, at.exception
    assert "Live:" in _text(at)


def test_incident_table_and_selectbox(monkeypatch: pytest.MonkeyPatch, run: Path, straggler_id: str) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page("screens/incidents.py").run()
    assert any(straggler_id in o for o in at.selectbox(key="incident").options)
    table = at.dataframe[0].value
    assert list(table.columns) == ["#", "class", "subject", "since", "state", "decision", "cause", "summary"]
    assert table["#"].to_list() == ["#1"]  # the incident's mark, the same on every page
    assert "observed" in table["state"].to_list()
    assert not at.header
    at.selectbox(key="incident").select(straggler_id).run()
    assert not at.exception, at.exception
    assert f"Incident {straggler_id}" in [h.value for h in at.header]
    text = _text(at)
    assert "How it was decided:" in text and "a slow rank is not a failed rank" in text
    assert "**observe** — nothing to apply: the job is left as it is" in text  # not "observe (proposed, outcome: ...)"
    assert at.query_params.get("incident") == straggler_id


def test_incident_deep_link(monkeypatch: pytest.MonkeyPatch, run: Path, straggler_id: str) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page("screens/incidents.py")
    at.query_params["incident"] = straggler_id
    at.run()
    assert not at.exception, at.exception
    assert f"Incident {straggler_id}" in [h.value for h in at.header]


def test_overview_says_nothing_needs_a_look_when_every_incident_is_settled(monkeypatch: pytest.MonkeyPatch,
                                                                          run: Path) -> None:
    at = _app(monkeypatch, run).run()  # the landing page
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == ["What needs a look"]
    assert "Nothing needs a look now" in at.success[0].value  # the straggler is observed: a slow rank is not failed
    assert at.table and "straggler" in at.table[0].value["class"].to_list()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return analyzed_run(tmp_path_factory.mktemp("dash") / "stopped", steps=200, faults=("exit:rank=3,step=150",))


def test_overview_names_the_open_incident_and_the_command_that_applies_it(monkeypatch: pytest.MonkeyPatch,
                                                                          stopped: Path) -> None:
    at = _app(monkeypatch, stopped).run()
    assert not at.exception, at.exception
    assert at.error and "1 incident(s) need a decision or an action" in at.error[0].value
    text = _text(at)
    assert ":red[**#1**] **fail_stop** on `rank:3`" in text and "cause **exit**" in text  # its mark on every page
    at.switch_page("screens/timeline.py").run()
    assert any(w.startswith("#1 fail_stop rank:3") for w in at.dataframe[0].value["what"].to_list())
    assert f"`rankwatch recover {stopped} --apply`" in text and "restart the job from step 0" in text


def test_fail_stop_detail_tells_the_story_without_straggler_sections(monkeypatch: pytest.MonkeyPatch,
                                                                     stopped: Path) -> None:
    inc = next(i for i in ensure_views(stopped).incidents if i.klass == "fail_stop")
    at = _app(monkeypatch, stopped)
    at.query_params["incident"] = inc.id
    at.run()
    at.switch_page("screens/incidents.py")
    at.query_params["incident"] = inc.id
    at.run()
    assert not at.exception, at.exception
    text = _text(at)
    assert "First to stop: rank 3" in text and "Replayed: no step was trained twice" in text
    assert "GPU counters" not in text and "Collective arrivals" not in text
    assert "Every fingerprint agrees" not in text  # a fail-stop is not a divergence


def test_the_url_carries_the_run_and_a_link_naming_only_an_incident_opens_its_run(
        monkeypatch: pytest.MonkeyPatch, run: Path, stopped: Path) -> None:
    inc = next(i for i in ensure_views(stopped).incidents if i.klass == "fail_stop")
    at = _app(monkeypatch, run, stopped).run()
    assert at.query_params.get("run") == run.name  # the first run, named in the URL
    at = _app(monkeypatch, run, stopped)
    at.switch_page("screens/incidents.py")
    at.query_params["incident"] = inc.id  # a link from an alert: the second run's incident, no run named
    at.run()
    assert not at.exception, at.exception
    assert at.selectbox(key="run").value == stopped.name and at.query_params.get("run") == stopped.name
    assert f"Incident {inc.id}" in [h.value for h in at.header]
    at = _app(monkeypatch, run, stopped)
    at.query_params["run"] = stopped.name
    at.run()
    assert at.selectbox(key="run").value == stopped.name


def test_heatmap_drill_down(monkeypatch: pytest.MonkeyPatch, run: Path) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page("screens/heatmap.py").run()
    assert at.number_input(key="rank").value == STRAGGLER
    assert at.selectbox(key="metric").value == "compute_ms"  # opens where a straggler stands out
    at.selectbox(key="metric").select("late_ms").run()
    at.number_input(key="rank").set_value(3).run()
    assert not at.exception, at.exception
    assert "**Rank 3**: 300 steps" in _text(at)


def test_no_runs_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNS_ENV, raising=False)
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception
    assert "No run given" in at.error[0].value


@pytest.mark.parametrize("kind", ["empty", "missing", "damaged_views"])
def test_unreadable_run_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run: Path, kind: str) -> None:
    target = tmp_path / "run"
    if kind == "empty":
        target.mkdir()
    elif kind == "damaged_views":
        views.views_dir(target).mkdir(parents=True)
        (views.views_dir(target) / views.MANIFEST).write_bytes(b"\x00garbage")
    at = _app(monkeypatch, target).run()
    assert not at.exception, at.exception
    assert at.error and "Cannot open this run" in at.error[0].value
    assert str(target) in at.error[0].value


def test_damaged_telemetry_part_is_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = analyzed_run(tmp_path / "run", steps=60, faults=())
    views.views_dir(target).joinpath(views.MANIFEST).unlink()
    part = next((target / "telemetry" / "steps").rglob("*.parquet"))
    part.write_bytes(b"not a parquet file")
    at = _app(monkeypatch, target).run()
    assert not at.exception, at.exception
    assert any(part.name in w.value and "unreadable" in w.value for w in at.warning)


def test_runs_page_localizes_across_two_runs(monkeypatch: pytest.MonkeyPatch, run: Path, tmp_path: Path) -> None:
    other = analyzed_run(tmp_path / "other", seed=4)
    at = _app(monkeypatch, run, other).run()
    assert at.selectbox(key="run").options
    at.switch_page("screens/runs.py").run()
    assert not at.exception, at.exception
    assert any(h.value.startswith("straggler: follows") for h in at.subheader)


def test_runs_page_with_one_run(monkeypatch: pytest.MonkeyPatch, run: Path) -> None:
    at = _app(monkeypatch, run).run()
    at.switch_page("screens/runs.py").run()
    assert "needs at least two" in _text(at)


def test_collectives_name_the_hung_rank_not_the_peers_blocked_by_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    hung = analyzed_run(tmp_path / "hang", steps=200, faults=("hang:rank=6,step=120",))
    at = _app(monkeypatch, hung).run()
    at.switch_page("screens/collectives.py").run()
    assert not at.exception, at.exception
    labels = {m.label: m.value for m in at.metric}
    assert labels["Ranks missing"] == "1" and int(labels["Members behind"]) > 1
    assert set(at.dataframe[0].value["rank"]) == {6}


@pytest.mark.slow  # starts the real server
@pytest.mark.timeout(180)
def test_rankwatch_dashboard_stopped_by_sigterm_stops_its_server(run: Path, tmp_path: Path) -> None:
    """`rankwatch dashboard` runs Streamlit in a session of its own; a supervisor's SIGTERM (or a closed terminal's
    SIGHUP) to the command must take the server down too, and free the port. The start says no "No runtime found"."""
    import signal
    import socket
    import subprocess
    import sys

    from rankwatch.dashboard.serve import wait_ready

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "dashboard.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", "dashboard", str(run), "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, timeout_s=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"port {port} still served after the command ended")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "No runtime found" not in log.read_text(errors="replace")


def test_a_decision_reads_the_same_way_whatever_its_state() -> None:
    from rankwatch.dashboard.ui import decision_line

    base = {"action": "restart_job", "target": "checkpoint:step-00000019", "record": "dry-run", "outcome": "proposed"}
    assert decision_line({**base, "status": "proposed"}, "runs/r") == (
        "**restart the job from step-00000019** — proposed, not applied (a dry run, `dry-run`); to carry it out: "
        "`rankwatch recover runs/r --apply`")
    assert decision_line({**base, "status": "applied", "record": "recovery-1", "outcome": "relaunched"}, "runs/r") == (
        "**restart the job from step-00000019** — applied (`recovery-1`): relaunched")


def test_charts_stay_readable_from_8_ranks_to_2048() -> None:
    import polars as pl

    from rankwatch.dashboard import charts

    def grid(dp: int, pp: int) -> dict:
        cells = pl.DataFrame({"dp": [d for d in range(dp) for _ in range(pp)], "pp": [p for _ in range(dp)
                              for p in range(pp)], "value": [1.0] * (dp * pp), "rank": list(range(dp * pp))})
        return charts.grid(cells, "score").to_dict()

    small = grid(2, 2)  # the demo: every cell labelled with its rank, ticks in the middle of the cells
    assert [layer["mark"]["type"] for layer in small["layer"]] == ["rect", "text"] and small["height"] >= 160
    assert small["layer"][0]["encoding"]["y"]["axis"]["values"] == [0.5, 1.5]
    assert len(small["layer"][0]["encoding"]["y"]["title"]) <= 12  # a long rotated title took the plot's height
    big = grid(256, 8)  # 2,048 ranks: no numbers to overlap, at most 32 ticks, a bounded height
    assert big["mark"]["type"] == "rect" and big["height"] == 600
    assert len(big["encoding"]["y"]["axis"]["values"]) <= 32
    hosts = [f"host{i}" for i in range(64)]
    links = pl.DataFrame({"a": hosts[:-1], "b": hosts[1:], "link": [f"{a}<->{b}" for a, b in zip(hosts, hosts[1:])],
                          "gbps": [1.0] * 63, "vs_median_link": [1.0] * 63, "incidents": [""] * 63,
                          "status": ["ok"] * 63})
    spec = charts.links(links).to_dict()
    assert spec["encoding"]["x"]["sort"][:12] == hosts[:12]  # host2 before host10
    assert len(spec["encoding"]["x"]["axis"]["values"]) <= 16
